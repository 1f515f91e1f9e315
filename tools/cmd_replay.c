/* gpumem replay: each trace replayed through gpumem (one cold pass, then
 * warm passes), or through a model of another allocator (--policy async,
 * --conf expandable_segments:True), or --compare's table (cmd_compare.c). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"
#include "peer_models.h"
#include "replay.h"
#include "replay_output.h"
#include "show.h"
#include "trace.h"

static const char usage_replay[] =
    "usage: gpumem replay [options] TRACE...\n"
    "\n"
    "Replays each trace (gzip or plain text, traces/README.md, or a PyTorch\n"
    "memory snapshot pickle) through gpumem:\n"
    "one cold pass from an empty allocator, then warm passes from its cache.\n"
    "\n"
    "options:\n"
    "  --policy default|pytorch|async  allocation policy (default: default); async:\n"
    "                            a model of cudaMallocAsync (release threshold never)\n"
    "  --limit SIZE              hard cap on reserved memory (e.g. 12G, 1.5GiB)\n"
    "  --limit-ratio R           cap at R x each trace's peak live bytes\n"
    "  --conf STRING             configuration, GPUMEM_CONF grammar (key:value,...),\n"
    "                            over GPUMEM_CONF's keys; --policy and --limit override\n"
    "                            both. With --policy pytorch, expandable_segments:True\n"
    "                            replays a model of PyTorch's expandable segments; the\n"
    "                            models (it and async) take limit and fraction (of\n"
    "                            --capacity) and refuse other keys\n"
    "  --passes N                warm passes after the cold one (default 3)\n"
    "  --device sim|cuda         simulated device (default) or the real GPU\n"
    "  --capacity SIZE           simulated device memory (default 1T)\n"
    "  --min-limit               also bisect the smallest limit that replays the trace\n"
    "  --min-limit-tolerance F   stop the bisection within F x peak live (default: one\n"
    "                            page or 0.25%, the finer)\n"
    "  --steady N                append N repetitions of the trace's last period (a\n"
    "                            training step) and time them apart: a long run's\n"
    "                            steady state (traces that end in no period: as they are)\n"
    "  --step-ms MS              a step's time on the GPU: the mapping work priced at an\n"
    "                            H100's costs is also given as a share of the steps' time\n"
    "  --steps N                 how many steps the trace holds (with --step-ms)\n"
    "  --json                    one JSON object per trace (and policy) per line\n"
    "  --compare                 the pytorch and default policies side by side, a trace a\n"
    "                            row: peak live, reserved / live, the memory each needs\n"
    "                            (what make demo prints); --conf, --limit and GPUMEM_CONF\n"
    "                            apply to every column, each taking the keys its policy has\n"
    "  --detail                  with --compare: a third column, hold (the default holding\n"
    "                            reserved memory at the high-water mark: placement:planned,\n"
    "                            move_budget:unlimited,headroom:0.002), the figures measured\n"
    "                            on an H200 beside them and the mapping work priced per call\n"
    "  -h, --help                this text\n";

/* replay through a peer model: peak reserved, out of memory under the
 * limit, the smallest limit; human or JSON. */
static int run_peer(const trace_t* t, const cli_t* cli) {
  uint64_t limit = cli->config.limit_bytes;
  if (cli->config.limit_ratio > 0)
    limit = (uint64_t)(cli->config.limit_ratio * (double)t->peak_live_bytes);
  /* with a fraction of the device as well, the smaller cap holds, as in gpumem */
  if (cli->model_cap && (!limit || cli->model_cap < limit)) limit = cli->model_cap;
  /* and the simulated device's memory (--capacity) bounds the model as it
   * bounds the engine, a cap that is not a limit */
  uint64_t bound = limit && limit < cli->config.sim_capacity ? limit : cli->config.sim_capacity;
  peer_result_t r;
  uint64_t min = 0;
  if (peer_run(t, cli->peer, bound, 0, &r) != GPUMEM_OK ||
      (cli->min_limit &&
       peer_min_limit(t, cli->peer, cli->config.min_limit_tolerance, 0, &min) != GPUMEM_OK))
    return cli_error("%s", show_detail(gpumem_last_error()));
  double live = t->peak_live_bytes ? (double)t->peak_live_bytes : 1;
  if (cli->json) {
    printf("{\"trace\":");
    show_json(stdout, t->path);
    printf(",\"name\":");
    show_json(stdout, t->name);
    printf(",\"policy\":\"%s\",\"model\":true,\"events\":%zu,\"allocations\":%zu",
           peer_model_name(cli->peer), t->num_events, t->num_allocs);
    printf(",\"peak_live_bytes\":%llu,\"peak_reserved_bytes\":%llu,\"reserved_ratio\":%.4f",
           (unsigned long long)t->peak_live_bytes, (unsigned long long)r.peak_reserved_bytes,
           (double)r.peak_reserved_bytes / live);
    if (t->recorded_peak_reserved)
      printf(",\"recorded_peak_reserved_bytes\":%llu",
             (unsigned long long)t->recorded_peak_reserved);
    if (limit) {
      printf(",\"limit_bytes\":%llu", (unsigned long long)limit);
    } else {
      printf(",\"limit_bytes\":null");
    }
    printf(",\"oom\":%s", r.oom ? "true" : "false");
    if (r.oom)
      printf(",\"oom_event\":%zu,\"oom_size\":%llu", r.oom_event, (unsigned long long)r.oom_size);
    if (cli->min_limit)
      printf(",\"min_limit_bytes\":%llu,\"min_limit_ratio\":%.4f", (unsigned long long)min,
             (double)min / live);
    printf(",\"maps\":%llu,\"unmaps\":%llu", (unsigned long long)r.num_maps,
           (unsigned long long)r.num_unmaps);
    if (cli->peer == PEER_EXPANDABLE)
      printf(",\"pages_mapped\":%llu,\"est_h100_map_us_per_op_cold\":%.3f",
             (unsigned long long)r.num_pages_mapped,
             price_expandable_us_per_op(r.num_pages_mapped, trace_num_ops(t)));
    printf("}\n");
    return 0;
  }
  char path[512];
  printf("%s (%s)\n", t->name, show_text(t->path, path, sizeof path));
  printf("  %-16s%s (a model of it, in %.3f GiB of simulated device memory)", "policy",
         peer_model_name(cli->peer), (double)cli->config.sim_capacity / GIB);
  if (limit) {
    printf(", limit %.3f GiB\n", (double)limit / GIB);
  } else {
    printf(", no limit\n");
  }
  printf("  %-16s%zu (%zu allocations, %zu frees)\n", "events", t->num_events, t->num_allocs,
         t->num_frees);
  printf("  %-16s%.3f GiB (%llu bytes)\n", "peak live", (double)t->peak_live_bytes / GIB,
         (unsigned long long)t->peak_live_bytes);
  printf("  %-16s%.3f GiB (%llu bytes), %.4f x peak live%s\n", "peak reserved",
         (double)r.peak_reserved_bytes / GIB, (unsigned long long)r.peak_reserved_bytes,
         (double)r.peak_reserved_bytes / live, r.oom ? " (up to the failure)" : "");
  if (t->recorded_peak_reserved)
    printf("  %-16s%.3f GiB in the snapshot's segment events; model / recorded %.4f\n",
           "recorded peak", (double)t->recorded_peak_reserved / GIB,
           (double)r.peak_reserved_bytes / (double)t->recorded_peak_reserved);
  if (r.oom) {
    printf("  %-16syes: event %zu (line %u), %llu bytes\n", "oom", r.oom_event,
           t->events[r.oom_event].line, (unsigned long long)r.oom_size);
  } else {
    printf("  %-16sno\n", "oom");
  }
  if (cli->min_limit)
    printf("  %-16s%.3f GiB (%llu bytes), %.4f x peak live\n", "min limit", (double)min / GIB,
           (unsigned long long)min, (double)min / live);
  printf("  %-16s%llu maps, %llu unmaps", "physical", (unsigned long long)r.num_maps,
         (unsigned long long)r.num_unmaps);
  if (cli->peer == PEER_EXPANDABLE)
    printf("; %llu pages, each created and mapped: ~%.3f us/op at an H100's prices",
           (unsigned long long)r.num_pages_mapped,
           price_expandable_us_per_op(r.num_pages_mapped, trace_num_ops(t)));
  printf("\n");
  return 0;
}

int cmd_replay(int argc, char** argv) {
  cli_t cli;
  memset(&cli, 0, sizeof cli);
  unsigned allowed = (1u << OPT_POLICY) | (1u << OPT_LIMIT) | (1u << OPT_LIMIT_RATIO) |
                     (1u << OPT_CONF) | (1u << OPT_PASSES) | (1u << OPT_DEVICE) |
                     (1u << OPT_CAPACITY) | (1u << OPT_MIN_LIMIT) |
                     (1u << OPT_MIN_LIMIT_TOLERANCE) | (1u << OPT_STEADY) | (1u << OPT_STEP_MS) |
                     (1u << OPT_STEPS) | (1u << OPT_JSON) | (1u << OPT_COMPARE) |
                     (1u << OPT_DETAIL) | (1u << OPT_HELP) | (1u << OPT_PEER_MODELS);
  int rc = cli_parse_args(argc, argv, allowed, usage_replay, &cli);
  if (rc == 0 && cli.help) {
    fputs(usage_replay, stdout);
  } else if (rc == 0 && cli.num_traces == 0) {
    rc = cli_usage_error(usage_replay, "no trace given");
  } else if (rc == 0 && cli.detail && !cli.compare) {
    rc = cli_usage_error(usage_replay, "--detail widens --compare's table: give --compare too");
  } else if (rc == 0 && cli.compare && (cli.config.policy_set || cli.peer)) {
    rc = cli_usage_error(usage_replay, "--compare replays both policies: drop --policy");
  } else if (rc == 0 && cli.config.step_ms > 0 && (cli.compare || cli.peer)) {
    /* refused rather than dropped: the figure it asks for would not appear */
    rc =
        cli_usage_error(usage_replay,
                        cli.compare ? "--step-ms prices one replay's mapping calls as a share of "
                                      "its steps: not with --compare (its us/op columns price them)"
                                    : "--step-ms prices gpumem's mapping calls: the %s model makes "
                                      "no device calls to price",
                        peer_model_name(cli.peer));
  } else if (rc == 0 && (cli.config.step_ms > 0) != (cli.config.steps > 0)) {
    rc = cli_usage_error(usage_replay,
                         "--step-ms and --steps go together (a step's time, and how "
                         "many steps the trace holds)");
  } else if (rc == 0 && cli.peer &&
             (cli.config.device != REPLAY_DEVICE_SIM || cli.steady ||
              cli.config.warm_passes != 3)) {
    rc = cli_usage_error(usage_replay,
                         "the %s model replays on no device: drop --device, --steady "
                         "and --passes",
                         peer_model_name(cli.peer));
  }
  if (rc != 0 || cli.help) {
    free(cli.traces);
    return rc;
  }

  trace_t** traces = NULL;
  if ((rc = cli_check_device(&cli.config)) != 0 || (rc = cli_load_all(&cli, &traces)) != 0) {
    free(cli.traces);
    return rc;
  }
  progress_t progress = {0};
  progress.enabled = isatty(STDERR_FILENO);

  if (cli.compare) {
    rc = replay_compare(&cli, traces, &progress);
  } else if (cli.peer) {
    for (int i = 0; i < cli.num_traces; i++)
      if (run_peer(traces[i], &cli) != 0) rc = EXIT_FAILURE;
  } else {
    replay_result_t* r = malloc(sizeof *r);
    if (!r) {
      rc = cli_error("out of host memory");
    } else {
      for (int i = 0; i < cli.num_traces; i++) {
        if (cli_run_one(traces[i], &cli.config, cli.min_limit, &progress, r) != 0) {
          rc = EXIT_FAILURE;
          continue;
        }
        if (cli.json) {
          replay_print_json(stdout, traces[i], &cli.config, r, NULL, NULL);
        } else {
          replay_print_human(stdout, traces[i], &cli.config, r);
        }
      }
      free(r);
    }
  }
  for (int i = 0; i < cli.num_traces; i++) trace_free(traces[i]);
  free(traces);
  free(cli.traces);
  return rc;
}
