/* gpumem fit: does the job fit in N GiB under each allocator a PyTorch
 * user can choose and under gpumem, and how much does it need (the table
 * itself is fit.c, shared with report). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"
#include "fit.h"
#include "trace.h"

static const char usage_fit[] =
    "usage: gpumem fit --memory SIZE [options] TRACE...\n"
    "\n"
    "Does the job fit in SIZE of device memory, under each allocator a PyTorch\n"
    "user can choose and under gpumem? For each: whether the trace replays\n"
    "under a hard limit of SIZE, the peak reserved memory (no limit) and the\n"
    "smallest limit under which it replays (the memory the job needs).\n"
    "TRACE: a gpumem trace (GPUMEM_CONF=record:PATH) or a PyTorch memory\n"
    "snapshot pickle (torch.cuda.memory._dump_snapshot).\n"
    "\n"
    "options:\n"
    "  --memory SIZE             the device memory to fit in (e.g. 80G)\n"
    "  --min-limit-tolerance F   bisect the needed memory to F x peak live (default:\n"
    "                            one page or 0.25%, the finer)\n"
    "  --json                    one JSON object per row\n"
    "  -h, --help                this text\n"
    "\n"
    "Each row runs at that allocator's own settings: GPUMEM_CONF is checked, not\n"
    "applied (a note says so when it is set).\n";

int cmd_fit(int argc, char** argv) {
  cli_t cli;
  memset(&cli, 0, sizeof cli);
  unsigned allowed =
      (1u << OPT_MEMORY) | (1u << OPT_JSON) | (1u << OPT_MIN_LIMIT_TOLERANCE) | (1u << OPT_HELP);
  int rc = cli_parse_args(argc, argv, allowed, usage_fit, &cli);
  if (rc == 0 && cli.help) {
    fputs(usage_fit, stdout);
  } else if (rc == 0 && cli.num_traces == 0) {
    rc = cli_usage_error(usage_fit, "no trace given");
  } else if (rc == 0 && cli.memory == 0) {
    rc = cli_usage_error(usage_fit, "--memory SIZE is needed (the device memory to fit in)");
  }
  trace_t** traces = NULL;
  if (rc != 0 || cli.help || (rc = cli_load_all(&cli, &traces)) != 0) {
    free(cli.traces);
    return rc;
  }
  if (cli_env_conf())
    fprintf(stderr,
            "gpumem: note: GPUMEM_CONF is not applied: fit runs each allocator at its own "
            "settings\n");
  progress_t progress = {0};
  progress.enabled = isatty(STDERR_FILENO);
  fit_result_t* results = calloc(fit_num_rows, sizeof *results);
  if (!results) rc = cli_error("out of host memory");
  for (int i = 0; i < cli.num_traces && rc == 0; i++) {
    const trace_t* t = traces[i];
    if (!cli.json) {
      printf("%s: peak live %.3f GiB; does it fit in %.3f GiB?\n\n", t->name,
             (double)t->peak_live_bytes / GIB, (double)cli.memory / GIB);
      printf("%-20s %-5s %-22s %-22s %s\n", "allocator", "fits", "peak reserved", "memory needed",
             "how to choose it");
      printf("%.*s\n", 110,
             "------------------------------------------------------------------------------"
             "--------------------------------");
    }
    uint64_t default_needed = 0;
    for (size_t k = 0; k < fit_num_rows; k++) {
      fit_result_t f;
      if (cli_fit_row(t, &fit_rows[k], &cli, &progress, &f) != 0) {
        rc = EXIT_FAILURE;
        break;
      }
      if (fit_rows[k].gpumem_default) default_needed = f.needed;
      results[k] = f;
      if (cli.json) {
        printf("{\"trace\":");
        show_json(stdout, t->path);
        printf(",\"allocator\":\"%s\",\"model\":%s,\"memory_bytes\":%zu,\"fits\":%s",
               fit_rows[k].name, fit_rows[k].peer != PEER_NONE ? "true" : "false", cli.memory,
               f.fits ? "true" : "false");
        printf(",\"peak_live_bytes\":%llu,\"peak_reserved_bytes\":%llu,\"needed_bytes\":%llu}\n",
               (unsigned long long)t->peak_live_bytes, (unsigned long long)f.peak_reserved,
               (unsigned long long)f.needed);
        continue;
      }
      char peak[40], need[40];
      fit_cells(t, &f, peak, need, sizeof peak);
      printf("%-20s %-5s %-22s %-22s %s\n", fit_rows[k].name, f.fits ? "yes" : "NO", peak, need,
             fit_rows[k].how);
    }
    /* The overflow tier's answer where gpumem's default does not fit. */
    int default_fits = 1;
    for (size_t k = 0; k < fit_num_rows; k++)
      if (fit_rows[k].gpumem_default) default_fits = results[k].fits;
    fit_overflow_t over;
    int said_overflow = 0;
    if (rc == 0 && !default_fits) {
      replay_config_t base = cli.config;
      if (fit_overflow(t, cli.memory, &base, &over) != GPUMEM_OK)
        rc = cli_trace_error(t);
      else
        said_overflow = 1;
    }
    if (said_overflow && cli.json) {
      printf("{\"trace\":");
      show_json(stdout, t->path);
      printf(
          ",\"allocator\":\"gpumem overflow:host\",\"model\":false,\"memory_bytes\":%zu,"
          "\"fits\":%s,\"host_peak_bytes\":%llu,\"host_allocations\":%llu,"
          "\"moves_to_host\":%llu,\"moves_to_device\":%llu,\"host_link_bytes\":%llu,"
          "\"host_link_model_us\":%.0f}\n",
          cli.memory, over.fits ? "true" : "false", (unsigned long long)over.host_peak,
          (unsigned long long)over.host_allocs, (unsigned long long)over.moves_to_host,
          (unsigned long long)over.moves_to_device, (unsigned long long)over.link_bytes,
          over.link_us);
    }
    if (!cli.json && rc == 0) {
      printf("\n");
      fit_explain(stdout, results, cli.memory);
      if (said_overflow) fit_overflow_say(stdout, t, &over, cli.memory);
      printf("%s", fit_note);
      if (default_needed)
        printf("gpumem's default needs %.3f GiB.\n", (double)default_needed / GIB);
      if (t->recorded_peak_reserved)
        printf("The recording process reserved %.3f GiB at its peak (snapshot segment events).\n",
               (double)t->recorded_peak_reserved / GIB);
      if (i + 1 < cli.num_traces) printf("\n");
    }
  }
  free(results);
  for (int i = 0; i < cli.num_traces; i++) trace_free(traces[i]);
  free(traces);
  free(cli.traces);
  return rc;
}
