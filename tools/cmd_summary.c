/* gpumem summary: memory_summary() of the allocator at a replay's end. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"
#include "reader.h"
#include "replay.h"
#include "trace.h"

static const char usage_summary[] =
    "usage: gpumem summary [options] TRACE\n"
    "\n"
    "Replays one cold pass of TRACE and prints the allocator's summary table\n"
    "(as torch.cuda.memory_summary) at the end of the trace, before anything\n"
    "still live is freed.\n"
    "\n"
    "options:\n"
    "  --policy default|pytorch  allocation policy (default: default)\n"
    "  --limit SIZE              hard cap on reserved memory\n"
    "  --conf STRING             configuration, GPUMEM_CONF grammar (key:value,...),\n"
    "                            over GPUMEM_CONF's keys; --policy, --limit override both\n"
    "  --device sim|cuda         simulated device (default) or the real GPU\n"
    "  --capacity SIZE           simulated device memory (default 1T)\n"
    "  --json                    the statistics as one JSON object instead\n"
    "  -h, --help                this text\n";

int cmd_summary(int argc, char** argv) {
  cli_t cli;
  unsigned allowed = (1u << OPT_POLICY) | (1u << OPT_LIMIT) | (1u << OPT_CONF) |
                     (1u << OPT_DEVICE) | (1u << OPT_CAPACITY) | (1u << OPT_JSON) |
                     (1u << OPT_HELP);
  int rc = cli_parse_one_trace(argc, argv, allowed, usage_summary, &cli);
  if (rc >= 0) return rc;
  rc = 0;

  trace_t* t = NULL;
  replay_session_t* session = NULL;
  gpumem_t* gm = NULL;
  replay_result_t* r = NULL;
  gpumem_options_t opts;
  progress_t progress = {0};
  progress.enabled = isatty(STDERR_FILENO);

  if (trace_load(cli.traces[0], &t) != GPUMEM_OK) {
    rc = cli_error("%s", show_detail(gpumem_last_error()));
    goto done;
  }
  if (replay_options(&cli.config, t, &opts) != GPUMEM_OK ||
      replay_session_open(&cli.config, &opts, t, &session) != GPUMEM_OK) {
    rc = cli_error("%s", show_detail(gpumem_last_error()));
    goto done;
  }
  gm = replay_session_allocator(session);
  r = malloc(sizeof *r);
  if (!r) {
    rc = cli_error("out of host memory");
    goto done;
  }
  replay_result_init(r, t);
  progress_start(&progress, t->name, replay_policy_name(opts.policy));
  r->progress = progress_show;
  r->progress_arg = &progress;
  r->progress_what = "cold pass";
  gpumem_status_t st = replay_pass_keep(gm, replay_session_trace(session), r);
  progress_clear(&progress);
  if (st != GPUMEM_OK) {
    rc = cli_error("%s", show_detail(gpumem_last_error()));
    goto done;
  }
  if (r->oom) {
    char msg[512];
    fprintf(stderr,
            "gpumem: note: out of memory at event %zu (line %u, %zu bytes): %s\n"
            "gpumem: the summary shows the state at that failure\n",
            r->oom_event, r->oom_line, r->oom_size,
            show_first_line(show_detail(r->oom_message), msg, sizeof msg));
  }
  if (cli.json) {
    gpumem_print_stats_json(gm, gpumem_write_to_file, stdout);
    fputc('\n', stdout);
  } else {
    printf("%s: allocator state at the end of the trace (policy %s, %s device, ", t->name,
           replay_policy_name(opts.policy), replay_device_name(cli.config.device));
    uint64_t cap = replay_effective_cap(&cli.config, t);
    if (cap) {
      printf("limit %llu bytes)\n", (unsigned long long)cap);
    } else {
      printf("no limit)\n");
    }
    gpumem_print_summary(gm, gpumem_write_to_file, stdout);
  }

done:
  free(r);
  replay_session_close(session);
  trace_free(t);
  free(cli.traces);
  return rc;
}
