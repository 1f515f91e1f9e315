/* gpumem replay --compare (and so `make demo`): every trace under the
 * pytorch and default policies side by side, first in a few plain
 * columns, with --detail the full table beside the figures measured on an
 * H200. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "replay.h"
#include "replay_output.h"
#include "trace.h"

static void cell_ratio(char* buf, size_t cap, const replay_result_t* r, int ok) {
  if (!ok) {
    snprintf(buf, cap, "error");
  } else if (r->oom) {
    snprintf(buf, cap, "OOM");
  } else {
    snprintf(buf, cap, "%.4f", r->reserved_ratio);
  }
}

/* The smallest limit: over peak live ("1.0041"), or in GiB ("12.711 GiB"). */
static void cell_min(char* buf, size_t cap, const replay_result_t* r, int ok, int in_gib) {
  if (!ok || !r->min_limit_done) {
    snprintf(buf, cap, "error");
  } else if (!r->min_limit_found) {
    snprintf(buf, cap, "none");
  } else if (in_gib) {
    snprintf(buf, cap, "%.3f GiB", (double)r->min_limit_bytes / GIB);
  } else {
    snprintf(buf, cap, "%.4f", r->min_limit_ratio);
  }
}

static void cell_anchor(char* buf, size_t cap, double v, const char* who) {
  if (who) {
    snprintf(buf, cap, "%.4f %s", v, who);
  } else if (v > 0) {
    snprintf(buf, cap, "%.4f", v);
  } else {
    snprintf(buf, cap, "-");
  }
}

/* Whether the replays run under a cap (where OOM can mark a cell). */
static int limited(const cli_t* cli) {
  return replay_effective_cap(&cli->config, NULL) || cli->config.limit_ratio > 0;
}

/* A table row built piece by piece, printed without trailing blanks. */
typedef struct row {
  char text[1024];
  size_t len;
} row_t;

static void row_add(row_t* r, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

static void row_add(row_t* r, const char* fmt, ...) {
  if (r->len >= sizeof r->text - 1) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(r->text + r->len, sizeof r->text - r->len, fmt, ap);
  va_end(ap);
  if (n > 0) r->len += (size_t)n;
  if (r->len > sizeof r->text - 1) r->len = sizeof r->text - 1;
}

static void row_print(row_t* r) {
  while (r->len > 0 && r->text[r->len - 1] == ' ') r->len--;
  r->text[r->len] = '\0';
  puts(r->text);
  fflush(stdout);
  r->len = 0;
}

/* --detail (and --json): one table for every trace under three columns:
 * what BENCHMARKS.md reports for the peers, computed here for gpumem, with
 * the measured H200 figures beside it, and what the mapping calls would
 * cost on a GPU. Rows are printed as each trace finishes. */
static int compare_detail(const cli_t* cli, trace_t** traces, progress_t* progress) {
  /* pytorch; default; default holding memory at the high-water mark
   * whatever the moves cost (planned placement, no move budget) */
  enum { NCOL = 3 };
  static const gpumem_policy_t policies[NCOL] = {GPUMEM_POLICY_PYTORCH, GPUMEM_POLICY_DEFAULT,
                                                 GPUMEM_POLICY_DEFAULT};
  static const char* const columns[NCOL] = {"pytorch", "default", "hold"};
  char hold_conf[512];
  snprintf(
      hold_conf, sizeof hold_conf, "%s%splacement:planned,move_budget:unlimited,headroom:0.002",
      cli->config.conf ? cli->config.conf : "", cli->config.conf && cli->config.conf[0] ? "," : "");
  const int mins = cli->min_limit;
  int failed = 0;
  int name_w = 5; /* "trace" */
  row_t row = {{0}, 0};
  replay_result_t* r = malloc(NCOL * sizeof *r);
  if (!r) return cli_error("out of host memory");
  for (int i = 0; i < cli->num_traces; i++) {
    int n = (int)strlen(traces[i]->name);
    if (n > name_w) name_w = n > 60 ? 60 : n;
  }

  if (!cli->json) {
    const char* limit_note = "no limit";
    char limit_buf[96];
    uint64_t cap = replay_effective_cap(&cli->config, NULL);
    if (cap) {
      snprintf(limit_buf, sizeof limit_buf, "limit %.3f GiB", (double)cap / GIB);
      limit_note = limit_buf;
    } else if (cli->config.limit_ratio > 0) {
      snprintf(limit_buf, sizeof limit_buf, "limit %.4f x peak live", cli->config.limit_ratio);
      limit_note = limit_buf;
    }
    printf(
        "Peak reserved / peak live: gpumem replayed here (%s device, %s), beside figures\n"
        "MEASURED on an NVIDIA H200 and quoted from BENCHMARKS.md. Columns: pytorch = the pytorch\n"
        "policy; default = the default policy (memory moves only when something needs it);\n"
        "hold = the default holding reserved memory at the high-water mark whatever it costs\n"
        "(placement:planned,move_budget:unlimited,headroom:0.002).\n\n",
        cli->config.device == REPLAY_DEVICE_CUDA ? "CUDA" : "simulated", limit_note);
    row_add(&row, "%-*s %10s | %-25s | %-22s | %-25s | %-16s", name_w, "", "", "replayed here",
            "H200, BENCHMARKS.md", "us/op, 1st pass", "us/op, 2nd half");
    if (mins) row_add(&row, " | %-25s | %-22s", "min limit", "H200 min cap (measured)");
    row_print(&row);
    row_add(&row, "%-*s %10s | %7s  %7s  %7s | %-8s  %-12s | %7s  %7s  %7s | %7s  %7s", name_w,
            "trace", "peak live", "pytorch", "default", "hold", "PyTorch", "best peer", "pytorch",
            "default", "hold", "default", "hold");
    if (mins)
      row_add(&row, " | %7s  %7s  %7s | %-8s  %-12s", "pytorch", "default", "hold", "PyTorch",
              "best peer");
    row_print(&row);
    int width = name_w + 1 + 10 + 3 + 25 + 3 + 22 + 3 + 25 + 3 + 16 + (mins ? 3 + 25 + 3 + 22 : 0);
    for (int i = 0; i < width && row.len < sizeof row.text - 1; i++) row.text[row.len++] = '-';
    row_print(&row);
  }

  for (int i = 0; i < cli->num_traces; i++) {
    const trace_t* t = traces[i];
    const anchor_t* anchor = replay_anchor(t->name);
    int ok[NCOL];
    for (int p = 0; p < NCOL; p++) {
      replay_config_t c = cli->config;
      c.policy = policies[p];
      c.policy_set = 1;
      if (p == 2) c.conf = hold_conf;
      ok[p] = cli_run_one(t, &c, mins, progress, &r[p]) == 0;
      if (!ok[p]) failed = 1;
      if (ok[p] && cli->json) replay_print_json(stdout, t, &c, &r[p], anchor, columns[p]);
    }
    if (cli->json) continue;

    char live[32], c[NCOL][16], a0[32], a1[32], w[NCOL][16], h[NCOL][16];
    snprintf(live, sizeof live, "%.3f GiB", (double)t->peak_live_bytes / GIB);
    cell_anchor(a0, sizeof a0, anchor ? anchor->torch_reserved : 0, NULL);
    cell_anchor(a1, sizeof a1, anchor ? anchor->best_reserved : 0,
                anchor ? anchor->best_peer : NULL);
    for (int p = 0; p < NCOL; p++) {
      cell_ratio(c[p], sizeof c[p], &r[p], ok[p]);
      snprintf(w[p], sizeof w[p], "-");
      snprintf(h[p], sizeof h[p], "-");
      if (ok[p] && cli->config.device == REPLAY_DEVICE_SIM) {
        snprintf(w[p], sizeof w[p], "%.3f",
                 price_map_us_per_op(r[p].backend_calls_cold, r[p].ops_cold));
        snprintf(h[p], sizeof h[p], "%.3f",
                 price_map_us_per_op(r[p].cold_half_calls, r[p].cold_half_ops));
      }
    }
    row_add(&row, "%-*.*s %10s | %7s  %7s  %7s | %-8s  %-12s | %7s  %7s  %7s | %7s  %7s", name_w,
            name_w, t->name, live, c[0], c[1], c[2], a0, a1, w[0], w[1], w[2], h[1], h[2]);
    if (mins) {
      char m[NCOL][16], x0[32], x1[32];
      for (int p = 0; p < NCOL; p++) cell_min(m[p], sizeof m[p], &r[p], ok[p], 0);
      cell_anchor(x0, sizeof x0, anchor ? anchor->torch_min_cap : 0, NULL);
      cell_anchor(x1, sizeof x1, anchor ? anchor->best_min_cap : 0,
                  anchor ? anchor->best_cap_peer : NULL);
      row_add(&row, " | %7s  %7s  %7s | %-8s  %-12s", m[0], m[1], m[2], x0, x1);
    }
    row_print(&row);
  }

  if (!cli->json) {
    printf("\nreplayed here: peak reserved in the first pass / peak live%s.\n",
           limited(cli) ? " (OOM: ran out of memory under the limit)" : "");
    printf(
        "H200 columns: measured on an NVIDIA H200 with PyTorch 2.11 (BENCHMARKS.md), not computed"
        " by this run;\n"
        "  PyTorch = its native caching allocator; best peer = the better of expandable"
        " segments (exp)\n"
        "  and cudaMallocAsync (async). '-': no H200 measurement of this trace.\n"
        "us/op: the mapping calls of the first pass (a job that never repeats: the whole job),"
        " and of its\n"
        "  second half (a long job's steady state), priced at an H100's measured cost per call"
        " (create 12.7 us,\n"
        "  map with access 35.1, unmap 19.6, release 18.4), per alloc or free; under pytorch,"
        " its cudaMalloc\n"
        "  growth (cuMemAlloc 42.9 us, cuMemFree 38.6, H200), as native PyTorch pays it.\n");
    if (mins) {
      printf(
          "min limit: smallest hard limit under which the trace replays, / peak live"
          " (bisection to one page or 0.25%%, the finer, unless --min-limit-tolerance).\n");
    }
  }
  free(r);
  return failed ? EXIT_FAILURE : 0;
}

/* The largest gap, as a fraction, between the pytorch policy's peak reserved
 * here and PyTorch's own on an H200 (BENCHMARKS.md) over the traces that
 * have such a measurement; -1 when none has. torch[i * stride] is trace
 * i's pytorch replay, ok[i * stride] whether it ran. */
static double worst_gap(trace_t** traces, int n, const replay_result_t* torch, const int* ok,
                        int stride) {
  double worst = -1;
  for (int i = 0; i < n; i++) {
    const anchor_t* a = replay_anchor(traces[i]->name);
    const replay_result_t* x = &torch[i * stride];
    if (!a || !ok[i * stride] || x->oom) continue;
    double gap = fabs(x->reserved_ratio / a->torch_reserved - 1);
    if (gap > worst) worst = gap;
  }
  return worst;
}

/* The plain view (make demo): PyTorch's rules and gpumem's default side by
 * side in a few columns a newcomer reads without the docs, each explained
 * under the table; the figures need one pass and the bisection of the
 * memory needed, nothing the columns do not show. */
static int compare_plain(const cli_t* cli, trace_t** traces, progress_t* progress) {
  static const gpumem_policy_t policies[2] = {GPUMEM_POLICY_PYTORCH, GPUMEM_POLICY_DEFAULT};
  int n = cli->num_traces, failed = 0, any_oom = 0, name_w = 5; /* "trace" */
  replay_result_t* r = malloc(2 * (size_t)n * sizeof *r);
  int* ok = calloc(2 * (size_t)n, sizeof *ok);
  if (!r || !ok) {
    free(r);
    free(ok);
    return cli_error("out of host memory");
  }
  for (int i = 0; i < n; i++) {
    int w = (int)strlen(traces[i]->name);
    if (w > name_w) name_w = w > 40 ? 40 : w;
  }
  char limit[96] = "no limit";
  uint64_t cap = replay_effective_cap(&cli->config, NULL);
  if (cap)
    snprintf(limit, sizeof limit, "limit %.3f GiB", (double)cap / GIB);
  else if (cli->config.limit_ratio > 0)
    snprintf(limit, sizeof limit, "limit %.4f x peak live", cli->config.limit_ratio);
  printf(
      "%d recorded job%s replayed under PyTorch's own allocator rules and under gpumem\n"
      "(%s device, %s%s):\n\n",
      n, n == 1 ? "" : "s", cli->config.device == REPLAY_DEVICE_CUDA ? "CUDA" : "simulated", limit,
      cli->config.device == REPLAY_DEVICE_CUDA ? "" : "; no GPU is used");
  printf("%-*s  %10s    %-17s    %s\n", name_w, "", "", "reserved / live", "memory needed");
  printf("%-*s  %10s    %7s  %7s    %10s  %10s\n", name_w, "trace", "peak live", "PyTorch",
         "gpumem", "PyTorch", "gpumem");
  for (int k = 0; k < name_w + 2 + 10 + 4 + 16 + 4 + 22; k++) putchar('-');
  putchar('\n');
  for (int i = 0; i < n; i++) {
    const trace_t* t = traces[i];
    char ratio[2][16], needed[2][32];
    for (int p = 0; p < 2; p++) {
      replay_config_t c = cli->config;
      c.policy = policies[p];
      c.policy_set = 1;
      c.warm_passes = 0; /* no column shows a warm pass */
      replay_result_t* x = &r[2 * i + p];
      ok[2 * i + p] = cli_run_one(t, &c, 1, progress, x) == 0;
      if (!ok[2 * i + p]) failed = 1;
      if (ok[2 * i + p] && x->oom) any_oom = 1;
      cell_ratio(ratio[p], sizeof ratio[p], x, ok[2 * i + p]);
      cell_min(needed[p], sizeof needed[p], x, ok[2 * i + p], 1);
    }
    printf("%-*.*s  %6.3f GiB    %7s  %7s    %10s  %10s\n", name_w, name_w, t->name,
           (double)t->peak_live_bytes / GIB, ratio[0], ratio[1], needed[0], needed[1]);
    fflush(stdout);
  }
  printf(
      "\npeak live: the most memory the job's tensors take at once.\n"
      "reserved / live: the most memory the allocator holds from the device while the job runs,\n"
      "  over peak live (1.0000 would hold nothing beyond the tensors).\n"
      "memory needed: the smallest memory cap under which the job still runs to its end.\n");
  if (any_oom) printf("OOM: ran out of memory under the %s.\n", limit);
  double gap = limited(cli) ? -1 : worst_gap(traces, n, r, ok, 2);
  if (gap >= 0)
    printf(
        "PyTorch: its caching allocator's rules, replayed here rule for rule; on the traces above\n"
        "  that were also run on an NVIDIA H200, they reserve what PyTorch itself reserved there "
        "to\n"
        "  within %.2f%% (BENCHMARKS.md).\n",
        ceil(100 * gap * 100 - 1e-9) / 100);
  printf(
      "More columns (the figures measured on an H200, the cost of mapping calls):\n"
      "  gpumem replay --compare --detail TRACE...\n");
  free(r);
  free(ok);
  return failed ? EXIT_FAILURE : 0;
}

int replay_compare(const cli_t* cli, trace_t** traces, progress_t* progress) {
  return cli->json || cli->detail ? compare_detail(cli, traces, progress)
                                  : compare_plain(cli, traces, progress);
}
