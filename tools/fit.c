/* The allocator table shared by `gpumem fit` and `gpumem report` (fit.h). */
#include "fit.h"

#include <stdio.h>
#include <stdlib.h>

#include "cliconf.h"

#define GIB 1073741824.0

const fit_row_t fit_rows[] = {
    {"pytorch", "PyTorch's default allocator", PEER_NONE, GPUMEM_POLICY_PYTORCH, NULL, 0},
    {"pytorch expandable", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", PEER_EXPANDABLE,
     GPUMEM_POLICY_PYTORCH, NULL, 0},
    {"cudaMallocAsync", "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync", PEER_ASYNC,
     GPUMEM_POLICY_PYTORCH, NULL, 0},
    {"gpumem default", "gpumem.torch.enable()", PEER_NONE, GPUMEM_POLICY_DEFAULT, NULL, 1},
    {"gpumem pressure", "enable(\"reclaim:pressure,placement:bestfit\")", PEER_NONE,
     GPUMEM_POLICY_DEFAULT, "reclaim:pressure,placement:bestfit", 0},
};

const size_t fit_num_rows = sizeof fit_rows / sizeof fit_rows[0];

const char fit_note[] =
    "peak reserved: with no limit; memory needed: the smallest hard limit under which the job "
    "replays\n(x: over peak live). pytorch and the gpumem rows replay gpumem's engine; the "
    "expandable\nand cudaMallocAsync rows are models (docs/whatif.md: within 0.5% and 3.2% of "
    "the H200's figures).\n";

gpumem_status_t fit_parse_memory(const char* text, size_t* out) {
  size_t bytes = 0;
  /* 0 would ask whether the job fits in nothing: a mistake, not a question */
  if (gpumem_parse_size(text, &bytes) != GPUMEM_OK || bytes == 0) {
    gpumem_set_last_error("bad --memory '%s' (bytes with an optional K/M/G/T suffix, e.g. 80G)",
                          text);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  /* "80" parses as 80 bytes: refused with a hint rather than answered */
  if (cli_parse_size("--memory", text, &bytes) != GPUMEM_OK) return GPUMEM_ERR_INVALID_ARGUMENT;
  *out = bytes;
  return GPUMEM_OK;
}

static gpumem_status_t fit_model(const trace_t* t, const fit_row_t* row, size_t memory,
                                 double tolerance, fit_result_t* out) {
  peer_result_t r;
  gpumem_status_t st = peer_run(t, row->peer, 0, 0, &r);
  if (st != GPUMEM_OK) return st;
  out->peak_reserved = r.peak_reserved_bytes;
  st = peer_min_limit(t, row->peer, tolerance, 0, &out->needed);
  if (st != GPUMEM_OK || !memory) return st;
  st = peer_run(t, row->peer, memory, 0, &r);
  out->fits = st == GPUMEM_OK && !r.oom;
  return st;
}

gpumem_status_t fit_one(const trace_t* t, const fit_row_t* row, size_t memory,
                        const replay_config_t* base, fit_result_t* out) {
  out->fits = 0;
  out->peak_reserved = 0;
  out->needed = 0;
  if (row->peer != PEER_NONE) return fit_model(t, row, memory, base->min_limit_tolerance, out);
  /* replay_result_t holds every pass's timings: too large for the stack */
  replay_result_t* r = malloc(sizeof *r);
  if (!r) {
    gpumem_set_last_error("out of host memory");
    return GPUMEM_ERR_HOST_MEMORY;
  }
  replay_config_t c = *base;
  c.policy = row->policy;
  c.policy_set = 1;
  c.conf = row->conf;
  c.warm_passes = 0;
  c.limit_bytes = 0;
  c.limit_ratio = 0;
  gpumem_status_t st = replay_trace(t, &c, r);
  if (st == GPUMEM_OK) st = replay_min_limit(t, &c, r);
  if (st == GPUMEM_OK) {
    out->peak_reserved = r->peak_reserved_bytes;
    out->needed = r->min_limit_found ? r->min_limit_bytes : 0;
  }
  if (st == GPUMEM_OK && memory) {
    c.limit_bytes = memory;
    st = replay_trace(t, &c, r);
    out->fits = st == GPUMEM_OK && !r->oom;
  }
  free(r);
  return st;
}

void fit_cells(const trace_t* t, const fit_result_t* f, char* peak, char* need, size_t cap) {
  double live = t->peak_live_bytes ? (double)t->peak_live_bytes : 1;
  snprintf(peak, cap, "%.3f GiB (%.3fx)", (double)f->peak_reserved / GIB,
           (double)f->peak_reserved / live);
  if (f->needed) {
    snprintf(need, cap, "%.3f GiB (%.3fx)", (double)f->needed / GIB, (double)f->needed / live);
  } else {
    snprintf(need, cap, "-");
  }
}
