/* gpumem leaks: the allocations a trace leaves live at its end. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "replay.h"
#include "trace.h"

static const char usage_leaks[] =
    "usage: gpumem leaks [options] TRACE\n"
    "\n"
    "Replays one cold pass of TRACE and lists the allocations still live at\n"
    "its end (the trace never freed them), in groups of one requested size\n"
    "and stream, most bytes first, each with its trace lines (as tags).\n"
    "\n"
    "options:\n"
    "  --since-line N            only allocations made at trace line N or later\n"
    "                            (a step's first line: what later steps kept)\n"
    "  --policy default|pytorch  allocation policy (default: default)\n"
    "  --limit SIZE              hard cap on reserved memory\n"
    "  --conf STRING             configuration, GPUMEM_CONF grammar (key:value,...),\n"
    "                            over GPUMEM_CONF's keys; --policy, --limit override both\n"
    "  --capacity SIZE           simulated device memory (default 1T)\n"
    "  --json                    the report as one JSON object\n"
    "  -h, --help                this text\n";

int cmd_leaks(int argc, char** argv) {
  cli_t cli;
  unsigned allowed = (1u << OPT_POLICY) | (1u << OPT_LIMIT) | (1u << OPT_CONF) |
                     (1u << OPT_CAPACITY) | (1u << OPT_SINCE_LINE) | (1u << OPT_JSON) |
                     (1u << OPT_HELP);
  int rc = cli_parse_one_trace(argc, argv, allowed, usage_leaks, &cli);
  if (rc >= 0) return rc;
  rc = 0;
  trace_t* t = NULL;
  gpumem_t* gm = NULL;
  void** slots = NULL;
  gpumem_options_t opts;
  if ((rc = cli_load_with_slots(&cli, &t, &slots)) != 0) goto done;
  if (replay_options(&cli.config, t, &opts) != GPUMEM_OK ||
      replay_open(&cli.config, &opts, &gm) != GPUMEM_OK) {
    rc = cli_error("%s", show_detail(gpumem_last_error()));
    goto done;
  }
  /* A line past the last event would count nothing and say so as if the
   * trace had no leak. */
  if (cli.since_line &&
      (!t->num_events || (int64_t)cli.since_line > (int64_t)t->events[t->num_events - 1].line)) {
    rc = cli_usage_error(usage_leaks, "bad --since-line %d: the last event of %s is at line %u",
                         cli.since_line, t->path,
                         t->num_events ? t->events[t->num_events - 1].line : 0);
    goto done;
  }
  /* The mark: the allocations made before the first event at the line. */
  size_t first = 0;
  while (first < t->num_events && (int64_t)t->events[first].line < cli.since_line) first++;
  if (replay_tagged_peak(gm, t, 0, first, slots) == SIZE_MAX) {
    rc = cli_error("%s: %s", t->name, show_detail(gpumem_last_error()));
    goto done;
  }
  uint64_t mark = gpumem_leak_mark(gm);
  if (replay_tagged_peak(gm, t, first, t->num_events, slots) == SIZE_MAX) {
    rc = cli_error("%s: %s", t->name, show_detail(gpumem_last_error()));
    goto done;
  }
  if (!cli.json) {
    printf("%s: live at its end (policy %s; tags are trace lines", t->name,
           replay_policy_name(opts.policy));
    if (cli.since_line) printf(", from line %d on", cli.since_line);
    printf(")\n");
  }
  int out = cli.json ? gpumem_print_leaks_json(gm, mark, gpumem_write_to_file, stdout)
                     : gpumem_print_leaks(gm, mark, gpumem_write_to_file, stdout);
  if (out != 0) rc = cli_error("writing the report failed: %s", show_detail(gpumem_last_error()));
done:
  gpumem_destroy(gm);
  free(slots);
  trace_free(t);
  free(cli.traces);
  return rc;
}
