/* The allocator table shared by `gpumem fit` and `gpumem report` (fit.h). */
#include "fit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static void print_wrapped(FILE* f, const char* text);

const char fit_note[] =
    "peak reserved: with no limit; memory needed: the smallest hard limit under which the job "
    "replays\n(x: over peak live). pytorch and the gpumem rows replay gpumem's engine; the "
    "expandable\nand cudaMallocAsync rows are models (docs/whatif.md: within 0.7% and 3.2% of "
    "the H200's figures).\n";

/* The row's replay settings over base: its policy and conf, no limit, one
 * cold pass. */
static replay_config_t row_config(const fit_row_t* row, const replay_config_t* base) {
  replay_config_t c = *base;
  c.policy = row->policy;
  c.policy_set = 1;
  c.conf = row->conf;
  c.warm_passes = 0;
  c.limit_bytes = 0;
  c.limit_ratio = 0;
  return c;
}

/* replay_result_t holds every pass's timings: too large for the stack */
static replay_result_t* new_result(void) {
  replay_result_t* r = malloc(sizeof *r);
  if (!r) gpumem_set_last_error("out of host memory");
  return r;
}

gpumem_status_t fit_fits(const trace_t* t, const fit_row_t* row, size_t memory,
                         const replay_config_t* base, int* fits) {
  *fits = 0;
  if (row->peer != PEER_NONE) {
    peer_result_t pr;
    gpumem_status_t st = peer_run(t, row->peer, memory, 0, &pr);
    *fits = st == GPUMEM_OK && !pr.oom;
    return st;
  }
  replay_result_t* r = new_result();
  if (!r) return GPUMEM_ERR_HOST_MEMORY;
  replay_config_t c = row_config(row, base);
  c.limit_bytes = memory;
  gpumem_status_t st = replay_trace(t, &c, r);
  *fits = st == GPUMEM_OK && !r->oom;
  free(r);
  return st;
}

gpumem_status_t fit_one(const trace_t* t, const fit_row_t* row, size_t memory,
                        const replay_config_t* base, fit_result_t* out) {
  out->fits = 0;
  out->peak_reserved = 0;
  out->needed = 0;
  gpumem_status_t st;
  if (row->peer != PEER_NONE) {
    peer_result_t pr;
    st = peer_run(t, row->peer, 0, 0, &pr);
    if (st != GPUMEM_OK) return st;
    out->peak_reserved = pr.peak_reserved_bytes;
    st = peer_min_limit(t, row->peer, base->min_limit_tolerance, 0, &out->needed);
  } else {
    replay_result_t* r = new_result();
    if (!r) return GPUMEM_ERR_HOST_MEMORY;
    replay_config_t c = row_config(row, base);
    st = replay_trace(t, &c, r);
    if (st == GPUMEM_OK) st = replay_min_limit(t, &c, r);
    if (st == GPUMEM_OK) {
      out->peak_reserved = r->peak_reserved_bytes;
      out->needed = r->min_limit_found ? r->min_limit_bytes : 0;
    }
    free(r);
  }
  if (st != GPUMEM_OK || !memory) return st;
  return fit_fits(t, row, memory, base, &out->fits);
}

gpumem_status_t fit_overflow(const trace_t* t, size_t memory, const replay_config_t* base,
                             fit_overflow_t* out) {
  memset(out, 0, sizeof *out);
  replay_result_t* r = new_result();
  if (!r) return GPUMEM_ERR_HOST_MEMORY;
  const fit_row_t row = {"gpumem overflow:host",
                         "enable(\"overflow:host\")",
                         PEER_NONE,
                         GPUMEM_POLICY_DEFAULT,
                         "overflow:host",
                         0};
  replay_config_t c = row_config(&row, base);
  c.limit_bytes = memory;
  gpumem_status_t st = replay_trace(t, &c, r);
  if (st == GPUMEM_OK) {
    const gpumem_stats_t* s = &r->last_pass_end;
    out->fits = !r->oom;
    out->host_peak = (uint64_t)s->host_bytes[GPUMEM_POOL_ALL].peak;
    out->host_allocs = (uint64_t)s->num_host_allocs;
    out->moves_to_host = (uint64_t)s->num_moves_to_host;
    out->moves_to_device = (uint64_t)s->num_moves_to_device;
    out->link_us = (double)s->host_link_model_us;
    out->link_bytes = (uint64_t)(out->link_us * 1e-6 * GPUMEM_SIM_HOST_LINK_BYTES_PER_S);
  }
  free(r);
  return st;
}

void fit_overflow_say(FILE* f, const trace_t* t, const fit_overflow_t* o, size_t memory) {
  char text[1024], per_step[96] = "";
  if (t->num_steps > 1)
    snprintf(per_step, sizeof per_step, " (%.1f ms a step over its %zu steps)",
             o->link_us / 1e3 / (double)t->num_steps, t->num_steps);
  if (!o->fits) {
    snprintf(text, sizeof text,
             "With overflow:host (host pages under the requests the device cannot hold) it does "
             "not replay under %.3f GiB either.",
             (double)memory / GIB);
  } else if (!o->host_allocs && !o->moves_to_host) {
    snprintf(text, sizeof text,
             "With overflow:host it fits with nothing on the host: gpumem's default alone holds "
             "it under %.3f GiB.",
             (double)memory / GIB);
  } else {
    snprintf(text, sizeof text,
             "With overflow:host it fits under %.3f GiB with %.3f GiB on the host at most: %llu "
             "requests on host pages, %llu blocks moved out and %llu back, %.3f GiB over the "
             "host link in the whole trace, about %.1f ms at %.0f GB/s%s (a model figure, "
             "pending a measurement on the GPU; a lower bound: each block crossing once, "
             "kernels' repeated reads not counted).",
             (double)memory / GIB, (double)o->host_peak / GIB, (unsigned long long)o->host_allocs,
             (unsigned long long)o->moves_to_host, (unsigned long long)o->moves_to_device,
             (double)o->link_bytes / GIB, o->link_us / 1e3, GPUMEM_SIM_HOST_LINK_BYTES_PER_S / 1e9,
             per_step);
  }
  print_wrapped(f, text);
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

/* The names of the rows whose result passes test, as "a, b and c"; the
 * number of them. */
static int row_names(const fit_result_t* results, size_t memory,
                     int (*test)(const fit_result_t*, size_t), char* buf, size_t cap) {
  int n = 0, total = 0;
  for (size_t k = 0; k < fit_num_rows; k++) total += test(&results[k], memory);
  size_t len = 0;
  buf[0] = '\0';
  for (size_t k = 0; k < fit_num_rows && len < cap; k++) {
    if (!test(&results[k], memory)) continue;
    n++;
    int w = snprintf(buf + len, cap - len, "%s%s",
                     n == 1       ? ""
                     : n == total ? " and "
                                  : ", ",
                     fit_rows[k].name);
    if (w > 0) len += (size_t)w;
  }
  return total;
}

static int fits_above_peak(const fit_result_t* r, size_t memory) {
  return r->fits && r->peak_reserved > memory;
}

static int misses_below_needed(const fit_result_t* r, size_t memory) {
  return !r->fits && r->needed && r->needed <= memory;
}

/* text on lines of at most 100 characters, broken at blanks. */
static void print_wrapped(FILE* f, const char* text) {
  while (*text) {
    size_t len = strlen(text), cut = len;
    if (len > 100) {
      cut = 100;
      while (cut > 0 && text[cut] != ' ') cut--;
      if (cut == 0) cut = 100;
    }
    fprintf(f, "%.*s\n", (int)cut, text);
    text += cut;
    while (*text == ' ') text++;
  }
}

int fit_explain(FILE* f, const fit_result_t* results, size_t memory) {
  if (!memory) return 0;
  char names[512], text[1024];
  double mem = (double)memory / GIB;
  int said = 0;
  int n = row_names(results, memory, fits_above_peak, names, sizeof names);
  int one = n == 1;
  if (n) {
    snprintf(text, sizeof text,
             "%s fit%s in %.3f GiB although %s peak reserved is above it: that peak is the one "
             "with no limit; under a limit %s reuse%s or give%s back cached memory instead of "
             "growing, and need%s only the memory needed in %s row.",
             names, one ? "s" : "", mem, one ? "its" : "their", one ? "it" : "they", one ? "s" : "",
             one ? "s" : "", one ? "s" : "", one ? "its" : "their");
    print_wrapped(f, text);
    said++;
  }
  n = row_names(results, memory, misses_below_needed, names, sizeof names);
  one = n == 1;
  if (n) {
    snprintf(text, sizeof text,
             "%s do%s not fit in %.3f GiB although %s memory needed is below it: a limit above "
             "the smallest one that fits does not always fit.",
             names, one ? "es" : "", mem, one ? "its" : "their");
    print_wrapped(f, text);
    said++;
  }
  return said;
}
