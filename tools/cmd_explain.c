/* gpumem explain: where the reserved bytes beyond the live ones sit at the
 * moment of peak reserved, and (--snapshot) the allocator's snapshot there
 * as a pickle memory_viz opens. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"
#include "internal.h"
#include "jsonpickle.h"
#include "replay.h"
#include "show.h"
#include "trace.h"

static const char usage_explain[] =
    "usage: gpumem explain [options] TRACE\n"
    "\n"
    "Replays one cold pass of TRACE, finds the event at which reserved memory\n"
    "peaked (or takes the one --at-line names), replays again up to it and\n"
    "says where the reserved bytes beyond the live ones sit: rounding,\n"
    "partial pages at hole edges (large and small pool), cached free memory\n"
    "not yet reclaimed (apart: whole free pages whose mapping also lies under\n"
    "live blocks, which go back only with them), memory waiting for other\n"
    "streams, spare pages.\n"
    "\n"
    "options:\n"
    "  --policy default|pytorch  allocation policy (default: default)\n"
    "  --limit SIZE              hard cap on reserved memory\n"
    "  --conf STRING             configuration, GPUMEM_CONF grammar (key:value,...),\n"
    "                            over GPUMEM_CONF's keys; --policy, --limit override both\n"
    "  --capacity SIZE           simulated device memory (default 1T)\n"
    "  --at-line LINE            the state after the last event at or before trace\n"
    "                            line LINE, instead of at the peak\n"
    "  --json                    one JSON object: the event, its line and each\n"
    "                            field in bytes (with --snapshot, its path too)\n"
    "  --snapshot FILE           also write the allocator's snapshot at that event\n"
    "                            as a pickle of torch.cuda.memory._snapshot()'s shape:\n"
    "                            segments, blocks and the events so far, each tagged\n"
    "                            with its trace line; memory_viz opens it, and every\n"
    "                            gpumem command reads it as a TRACE (the job up to\n"
    "                            the peak)\n"
    "  -h, --help                this text\n";

static void explain_row(const char* what, uint64_t bytes, uint64_t live) {
  char b[32];
  printf("  %-46s %14s  %7.4f%%\n", what, gm_format_bytes(bytes, b, sizeof b),
         live ? 100.0 * (double)bytes / (double)live : 0.0);
}

/* The snapshot of gm, its frames tagged with trace lines of t, into path
 * as a pickle: the form PyTorch's memory_viz opens and every gpumem
 * command reads back (the library writes it as JSON; the pickle is the
 * same value). */
static int write_snapshot(gpumem_t* gm, const trace_t* t, const char* path, int quiet) {
  gm_text_t json = {NULL, 0, 0};
  if (gpumem_snapshot_json(gm, 0, t->path, gm_text_write, &json) != 0) {
    free(json.s);
    return cli_error("out of host memory for the snapshot");
  }
  /* never through a link or into another user's file (src/outfile.c) */
  gm_outfile out;
  char why[1400];
  int fd = gm_outfile_open(&out, path, 0600, why, sizeof why);
  if (fd < 0) {
    free(json.s);
    return cli_error("%s", why);
  }
  FILE* f = fdopen(fd, "wb");
  if (!f) {
    free(json.s);
    close(fd);
    gm_outfile_abandon(&out);
    return cli_error("cannot write %s: %s", path, strerror(errno));
  }
  int failed = json_to_pickle(json.s, json.len, gpumem_write_to_file, f) != GPUMEM_OK;
  free(json.s);
  if (fclose(f) != 0) failed = 1;
  if (failed) {
    gm_outfile_abandon(&out);
    return cli_error("writing %s failed: %s", path, show_detail(gpumem_last_error()));
  }
  if (!gm_outfile_commit(&out, why, sizeof why)) return cli_error("%s", why);
  if (!quiet) {
    char shown[512];
    printf("\nsnapshot at that event: %s\n", show_text(path, shown, sizeof shown));
  }
  return 0;
}

/* The fields of ex beyond the live bytes, in the order both forms print
 * them: the row's text and the JSON key. */
#define EXPLAIN_BEYOND 7
typedef struct beyond_field {
  const char* text;
  const char* key;
  uint64_t n;
} beyond_field_t;

static void beyond_fields(const gpumem_explain_t* ex, beyond_field_t f[EXPLAIN_BEYOND]) {
  const beyond_field_t all[EXPLAIN_BEYOND] = {
      {"rounding (512 B units, unsplit tails)", "rounding", ex->rounding},
      {"partial pages at hole edges, large pool", "partial_pages_large", ex->partial_pages_large},
      {"partial pages at hole edges, small pool", "partial_pages_small", ex->partial_pages_small},
      {"cached free, reclaimable (whole pages/segments)", "cached_reclaimable",
       ex->cached_reclaimable},
      {"cached free, pinned (mapping under live blocks)", "cached_pinned", ex->cached_pinned},
      {"waiting for other streams (record_stream)", "other_streams", ex->other_streams},
      {"spare pages (held, not in use)", "spare_pages", ex->spare_pages}};
  memcpy(f, all, sizeof all);
}

/* The breakdown as one JSON object (--json). */
static void print_json(const trace_t* t, size_t event, const gpumem_options_t* opts,
                       const gpumem_explain_t* ex, const beyond_field_t* f, const char* snapshot) {
  fputs("{\"trace\":", stdout);
  show_json(stdout, t->path);
  fputs(",\"name\":", stdout);
  show_json(stdout, t->name);
  printf(",\"event\":%zu,\"line\":%u,\"policy\":\"%s\"", event, t->events[event].line,
         replay_policy_name(opts->policy));
  printf(",\"reserved\":%llu,\"requested\":%llu", (unsigned long long)ex->reserved,
         (unsigned long long)ex->requested);
  for (size_t i = 0; i < EXPLAIN_BEYOND; i++)
    printf(",\"%s\":%llu", f[i].key, (unsigned long long)f[i].n);
  printf(",\"live_blocks\":%zu,\"free_blocks\":%zu", ex->live_blocks, ex->free_blocks);
  if (snapshot) {
    fputs(",\"snapshot\":", stdout);
    show_json(stdout, snapshot);
  }
  fputs("}\n", stdout);
}

int cmd_explain(int argc, char** argv) {
  cli_t cli;
  unsigned allowed = (1u << OPT_POLICY) | (1u << OPT_LIMIT) | (1u << OPT_CONF) |
                     (1u << OPT_CAPACITY) | (1u << OPT_SNAPSHOT) | (1u << OPT_AT_LINE) |
                     (1u << OPT_JSON) | (1u << OPT_HELP);
  int rc = cli_parse_one_trace(argc, argv, allowed, usage_explain, &cli);
  if (rc >= 0) return rc;
  rc = 0;
  trace_t* t = NULL;
  gpumem_t* gm = NULL;
  void** slots = NULL;
  gpumem_options_t opts;
  if ((rc = cli_load_with_slots(&cli, &t, &slots)) != 0) goto done;
  /* --at-line: the last event on or before that line; the peak otherwise */
  size_t at_event = SIZE_MAX;
  for (size_t i = 0; cli.at_line && i < t->num_events && t->events[i].line <= (unsigned)cli.at_line;
       i++)
    at_event = i;
  if (cli.at_line && at_event == SIZE_MAX) {
    rc = cli_error("--at-line %d: %s has no event on or before that line", cli.at_line, t->name);
    goto done;
  }
  /* Two runs on fresh allocators: the first finds the peak, the second
   * stops right after it. Replays on the simulated device are
   * deterministic, so both see the same state at that event. With
   * --at-line the event is known: the second run alone. */
  size_t peak_event = at_event;
  for (int run = cli.at_line ? 1 : 0; run < 2; run++) {
    if (replay_options(&cli.config, t, &opts) != GPUMEM_OK ||
        replay_open(&cli.config, &opts, &gm) != GPUMEM_OK) {
      rc = cli_error("%s", show_detail(gpumem_last_error()));
      goto done;
    }
    memset(slots, 0, t->num_allocs * sizeof *slots);
    size_t stop = run == 0 ? t->num_events : peak_event + 1;
    /* the second run records every event up to the peak for the snapshot
     * (a free is two: requested and completed) */
    if (run == 1 && cli.snapshot && gpumem_record_history(gm, 2 * stop + 64) != GPUMEM_OK) {
      rc = cli_error("%s", show_detail(gpumem_last_error()));
      goto done;
    }
    size_t found = replay_tagged_peak(gm, t, 0, stop, slots);
    if (found == SIZE_MAX) {
      rc = cli_error("%s: the replay failed before the peak: %s", t->name,
                     show_detail(gpumem_last_error()));
      goto done;
    }
    if (run == 0) {
      peak_event = found;
      gpumem_destroy(gm);
      gm = NULL;
    }
  }
  gpumem_explain_t ex;
  gpumem_explain(gm, &ex);
  uint64_t live = ex.requested, beyond = 0;
  beyond_field_t f[EXPLAIN_BEYOND];
  beyond_fields(&ex, f);
  for (size_t i = 0; i < EXPLAIN_BEYOND; i++) beyond += f[i].n;
  if (live + beyond != ex.reserved) {
    rc = cli_error("internal: the breakdown adds up to %llu bytes, reserved is %llu",
                   (unsigned long long)(live + beyond), (unsigned long long)ex.reserved);
    goto done;
  }
  if (cli.json) {
    /* (the snapshot first: the object names it only once it is written) */
    if (cli.snapshot && (rc = write_snapshot(gm, t, cli.snapshot, 1)) != 0) goto done;
    print_json(t, peak_event, &opts, &ex, f, cli.snapshot);
    goto done;
  }
  char b1[32], b2[32];
  printf("%s: %s at event %zu (line %u), policy %s\n", t->name,
         cli.at_line ? "as it stands" : "peak reserved", peak_event, t->events[peak_event].line,
         replay_policy_name(opts.policy));
  printf("  reserved %s for %s requested by %zu live allocations (%.4f x)\n\n",
         gm_format_bytes(ex.reserved, b1, sizeof b1), gm_format_bytes(live, b2, sizeof b2),
         ex.live_blocks, live ? (double)ex.reserved / (double)live : 0.0);
  printf("  %-46s %14s  %8s\n", "bytes beyond the live ones", "bytes", "of live");
  for (size_t i = 0; i < EXPLAIN_BEYOND; i++) explain_row(f[i].text, f[i].n, live);
  explain_row("total", beyond, live);
  if (cli.snapshot) rc = write_snapshot(gm, t, cli.snapshot, 0);
done:
  gpumem_destroy(gm);
  free(slots);
  trace_free(t);
  free(cli.traces);
  return rc;
}
