/* Trace replay: drives an allocator with a trace's events and measures what
 * BENCHMARKS.md shows for the peers (peak reserved over peak live, host ns
 * per operation cold and warm, the smallest workable limit), plus what only
 * we can see (backend calls, syncs, retries). Owns the device setup for a
 * replay (simulated by default, CUDA on request, with real streams in
 * place of the handles a trace recorded) and the timing rules: only the
 * events are timed, never setup, statistics reads or leftover frees. */
#include "replay.h"

#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TIB ((size_t)1 << 40)
#define MIB ((size_t)1 << 20)

/* Events between looks at the clock for progress: cheap enough to leave
 * inside the timed loop (a clock read per 16K events). */
#define PROGRESS_STRIDE 16384
/* Seconds between progress calls. */
#define PROGRESS_INTERVAL 0.2

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

const char* replay_policy_name(gpumem_policy_t policy) {
  switch (policy) {
    case GPUMEM_POLICY_DEFAULT:
      return "default";
    case GPUMEM_POLICY_PYTORCH:
      return "pytorch";
  }
  return "?";
}

const char* replay_device_name(replay_device_t device) {
  return device == REPLAY_DEVICE_CUDA ? "cuda" : "sim";
}

void replay_config_init(replay_config_t* c) {
  memset(c, 0, sizeof *c);
  c->policy = GPUMEM_POLICY_DEFAULT;
  c->warm_passes = 3;
  c->device = REPLAY_DEVICE_SIM;
  /* Large enough that no bundled trace ever meets the device's end: the
   * replay measures the allocator, and limits are set explicitly. */
  c->sim_capacity = TIB;
  c->sim_page_size = 2 * MIB;
}

gpumem_status_t replay_options(const replay_config_t* c, const trace_t* trace,
                               gpumem_options_t* out) {
  gpumem_options_t opts;
  gpumem_options_init(&opts);
  if (c->conf && c->conf[0]) {
    gpumem_status_t st = gpumem_options_parse(&opts, c->conf);
    if (st != GPUMEM_OK) return st; /* the parser's message names the key */
  }
  if (c->policy_set) opts.policy = c->policy;
  if (c->limit_bytes) {
    opts.limit_bytes = c->limit_bytes;
  } else if (c->limit_ratio > 0 && trace) {
    double bytes = c->limit_ratio * (double)trace->peak_live_bytes;
    opts.limit_bytes = bytes >= (double)SIZE_MAX ? SIZE_MAX : (size_t)bytes;
    if (opts.limit_bytes == 0) opts.limit_bytes = 1; /* 0 would mean "none" */
  }
  opts.own_backend = 1;
  /* A replay's allocators are short-lived and timed: no publication (its
   * file and first write would land in the cold pass) unless asked for. */
  if (opts.publish == GPUMEM_PUBLISH_AUTO) opts.publish = GPUMEM_PUBLISH_OFF;
  *out = opts;
  return GPUMEM_OK;
}

gpumem_status_t replay_check_config(const replay_config_t* c) {
  if (c->warm_passes < 0 || c->warm_passes > REPLAY_MAX_PASSES - 1) {
    gpumem_set_last_error("passes must be between 0 and %d, not %d", REPLAY_MAX_PASSES - 1,
                          c->warm_passes);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  if (!(c->limit_ratio >= 0) || isinf(c->limit_ratio)) {
    gpumem_set_last_error("limit ratio must be a positive number");
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  if (c->device != REPLAY_DEVICE_SIM && c->device != REPLAY_DEVICE_CUDA) {
    gpumem_set_last_error("unknown device %d (valid: sim, cuda)", (int)c->device);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  gpumem_options_t opts;
  return replay_options(c, NULL, &opts);
}

gpumem_status_t replay_open(const replay_config_t* c, const gpumem_options_t* opts,
                            gpumem_t** out) {
  gpumem_backend_t* backend = NULL;
  gpumem_status_t st = GPUMEM_OK;
  *out = NULL;
  if (c->device == REPLAY_DEVICE_CUDA) {
    gpumem_cuda_options_t co;
    gpumem_cuda_options_init(&co);
    co.device = c->cuda_device;
    backend = gpumem_cuda_create(&co, &st);
    if (!backend) {
      char why[1024];
      snprintf(why, sizeof why, "%s", gpumem_last_error());
      gpumem_set_last_error("cannot use CUDA device %d: %s", c->cuda_device,
                            why[0] ? why : gpumem_strerror(st));
      return st != GPUMEM_OK ? st : GPUMEM_ERR_UNSUPPORTED;
    }
  } else {
    gpumem_sim_options_t so;
    gpumem_sim_options_init(&so);
    if (c->sim_capacity) so.capacity = c->sim_capacity;
    if (c->sim_page_size) so.page_size = c->sim_page_size;
    /* As cudaMalloc did on the H200 the traces were recorded on
     * (traces/README.md): PyTorch's ties break by address. */
    so.descending_addresses = 1;
    backend = gpumem_sim_create(&so);
    if (!backend) {
      gpumem_set_last_error("cannot create the simulated device: out of host memory");
      return GPUMEM_ERR_HOST_MEMORY;
    }
  }
  gpumem_options_t o = *opts;
  o.own_backend = 1;
  gpumem_t* gm = gpumem_create(backend, &o, &st);
  if (!gm) {
    /* The allocator never took the backend over: it is still ours. */
    if (c->device == REPLAY_DEVICE_CUDA) {
      gpumem_cuda_destroy(backend);
    } else {
      gpumem_sim_destroy(backend);
    }
    return st != GPUMEM_OK ? st : GPUMEM_ERR_HOST_MEMORY;
  }
  *out = gm;
  return GPUMEM_OK;
}

void replay_result_init(replay_result_t* r, const trace_t* trace) {
  memset(r, 0, sizeof *r);
  r->ns_per_op_warm = -1;
  if (trace) {
    r->events = trace->num_events;
    r->allocations = trace->num_allocs;
    r->peak_live_bytes = trace->peak_live_bytes;
  }
}

/* ---- sessions: real streams on the CUDA device ------------------------- */

/* The few driver entry points the stream mapping needs, looked up in the
 * libcuda.so.1 the CUDA backend already loaded. Declared with plain types:
 * CUresult is an int, CUdevice an int, CUcontext and CUstream pointers. */
typedef struct cuda_api {
  void* lib;
  int (*device_get)(int* dev, int ordinal);
  int (*primary_retain)(void** ctx, int dev);
  int (*primary_release)(int dev);
  int (*ctx_get_current)(void** ctx);
  int (*ctx_set_current)(void* ctx);
  int (*stream_create)(void** stream, unsigned flags);
  int (*stream_destroy)(void* stream);
} cuda_api_t;

struct replay_session {
  gpumem_t* gm;
  trace_t view;          /* the trace as replayed here */
  trace_event_t* mapped; /* owned when streams were mapped */
  cuda_api_t cu;
  int cu_device;
  int ctx_retained;
  void** streams; /* created, one per distinct nonzero trace stream */
  size_t num_streams;
};

static void* cuda_sym(void* lib, const char* name, const char* fallback) {
  void* f = dlsym(lib, name);
  if (!f && fallback) f = dlsym(lib, fallback);
  return f;
}

static gpumem_status_t cuda_api_load(cuda_api_t* cu) {
  cu->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!cu->lib) {
    gpumem_set_last_error("cannot load libcuda.so.1 for the trace's streams: %s", dlerror());
    return GPUMEM_ERR_UNSUPPORTED;
  }
  /* Object pointers to function pointers: POSIX guarantees dlsym's
   * result converts; memcpy keeps -Wpedantic quiet about it. */
  void* f[7] = {
      cuda_sym(cu->lib, "cuDeviceGet", NULL),
      cuda_sym(cu->lib, "cuDevicePrimaryCtxRetain", NULL),
      cuda_sym(cu->lib, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
      cuda_sym(cu->lib, "cuCtxGetCurrent", NULL),
      cuda_sym(cu->lib, "cuCtxSetCurrent", NULL),
      cuda_sym(cu->lib, "cuStreamCreate", NULL),
      cuda_sym(cu->lib, "cuStreamDestroy_v2", "cuStreamDestroy"),
  };
  for (int i = 0; i < 7; i++) {
    if (!f[i]) {
      gpumem_set_last_error("libcuda.so.1 lacks a stream or context entry point");
      return GPUMEM_ERR_UNSUPPORTED;
    }
  }
  memcpy(&cu->device_get, &f[0], sizeof f[0]);
  memcpy(&cu->primary_retain, &f[1], sizeof f[1]);
  memcpy(&cu->primary_release, &f[2], sizeof f[2]);
  memcpy(&cu->ctx_get_current, &f[3], sizeof f[3]);
  memcpy(&cu->ctx_set_current, &f[4], sizeof f[4]);
  memcpy(&cu->stream_create, &f[5], sizeof f[5]);
  memcpy(&cu->stream_destroy, &f[6], sizeof f[6]);
  return GPUMEM_OK;
}

static int cmp_uintptr(const void* a, const void* b) {
  uintptr_t x = *(const uintptr_t*)a, y = *(const uintptr_t*)b;
  return (x > y) - (x < y);
}

/* Replaces the trace's stream values by streams created on the device's
 * primary context (the one the CUDA backend uses), kept alive by our own
 * retain until the streams are gone. */
static gpumem_status_t map_cuda_streams(replay_session_t* s, const replay_config_t* c) {
  const trace_t* t = &s->view;
  size_t n = t->num_events;
  uintptr_t* keys = malloc((n ? n : 1) * sizeof *keys);
  if (!keys) goto no_memory;
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (t->events[i].stream != 0) keys[k++] = t->events[i].stream;
  }
  if (k == 0) {
    free(keys);
    return GPUMEM_OK;
  }
  qsort(keys, k, sizeof *keys, cmp_uintptr);
  size_t u = 0;
  for (size_t i = 0; i < k; i++) {
    if (u == 0 || keys[u - 1] != keys[i]) keys[u++] = keys[i];
  }

  gpumem_status_t st = cuda_api_load(&s->cu);
  if (st != GPUMEM_OK) {
    free(keys);
    return st;
  }
  void* ctx = NULL;
  void* cur = NULL;
  int r = s->cu.device_get(&s->cu_device, c->cuda_device);
  if (r == 0) r = s->cu.primary_retain(&ctx, s->cu_device);
  if (r == 0) {
    s->ctx_retained = 1;
    if (s->cu.ctx_get_current(&cur) != 0 || cur != ctx) r = s->cu.ctx_set_current(ctx);
  }
  s->streams = calloc(u, sizeof *s->streams);
  s->mapped = malloc(n * sizeof *s->mapped);
  if (!s->streams || !s->mapped) {
    free(keys);
    goto no_memory;
  }
  for (size_t i = 0; r == 0 && i < u; i++) {
    r = s->cu.stream_create(&s->streams[i], 0);
    if (r == 0) s->num_streams++;
  }
  if (r != 0) {
    free(keys);
    gpumem_set_last_error("cannot create %zu CUDA streams for the trace's streams: driver error %d",
                          u, r);
    return GPUMEM_ERR_BACKEND;
  }
  for (size_t i = 0; i < n; i++) {
    s->mapped[i] = t->events[i];
    uintptr_t v = t->events[i].stream;
    if (v == 0) continue;
    uintptr_t* hit = bsearch(&v, keys, u, sizeof *keys, cmp_uintptr);
    s->mapped[i].stream = (uintptr_t)s->streams[hit - keys];
  }
  s->view.events = s->mapped;
  free(keys);
  return GPUMEM_OK;

no_memory:
  gpumem_set_last_error("replay: out of host memory mapping streams");
  return GPUMEM_ERR_HOST_MEMORY;
}

void replay_session_close(replay_session_t* s) {
  if (!s) return;
  /* The allocator first: its deferred frees may hold events on our
   * streams. The context outlives both through our retain. */
  gpumem_destroy(s->gm);
  for (size_t i = 0; i < s->num_streams; i++) s->cu.stream_destroy(s->streams[i]);
  if (s->ctx_retained) s->cu.primary_release(s->cu_device);
  if (s->cu.lib) dlclose(s->cu.lib);
  free(s->streams);
  free(s->mapped);
  free(s);
}

gpumem_status_t replay_session_open(const replay_config_t* c, const gpumem_options_t* opts,
                                    const trace_t* trace, replay_session_t** out) {
  *out = NULL;
  replay_session_t* s = calloc(1, sizeof *s);
  if (!s) {
    gpumem_set_last_error("replay: out of host memory");
    return GPUMEM_ERR_HOST_MEMORY;
  }
  s->view = *trace;
  gpumem_status_t st = replay_open(c, opts, &s->gm);
  if (st == GPUMEM_OK && c->device == REPLAY_DEVICE_CUDA) st = map_cuda_streams(s, c);
  if (st != GPUMEM_OK) {
    replay_session_close(s);
    return st;
  }
  *out = s;
  return GPUMEM_OK;
}

gpumem_t* replay_session_allocator(replay_session_t* s) {
  return s->gm;
}

const trace_t* replay_session_trace(replay_session_t* s) {
  return &s->view;
}

/* ---- one pass --------------------------------------------------------- */

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* Cold is pass 0; warm is the median of the later ones (the steady state
 * of a training loop, robust to one pass disturbed by the machine). */
static void update_timings(replay_result_t* r) {
  r->ns_per_op_cold = r->passes_run > 0 ? r->pass_ns_per_op[0] : 0;
  int n = r->passes_run - 1;
  if (n <= 0) {
    r->ns_per_op_warm = -1;
    return;
  }
  double sorted[REPLAY_MAX_PASSES];
  memcpy(sorted, r->pass_ns_per_op + 1, (size_t)n * sizeof *sorted);
  qsort(sorted, (size_t)n, sizeof *sorted, cmp_double);
  r->ns_per_op_warm = n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

static gpumem_status_t run_pass(gpumem_t* gm, const trace_t* t, replay_result_t* r, int keep_live) {
  if (r->passes_run >= REPLAY_MAX_PASSES) {
    gpumem_set_last_error("replay: more than %d passes on one result", REPLAY_MAX_PASSES);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  /* One pointer per allocation of the trace (its dense slot): the hot
   * loop then does no lookup of its own. */
  void** slots = calloc(t->num_allocs ? t->num_allocs : 1, sizeof *slots);
  if (!slots) {
    gpumem_set_last_error("replay: out of host memory for %zu slots", t->num_allocs);
    return GPUMEM_ERR_HOST_MEMORY;
  }
  const char* what = r->progress_what ? r->progress_what : "replay";
  gpumem_stats_t before;
  gpumem_get_stats(gm, &before);
  if (r->progress) r->progress(r->progress_arg, what, 0, t->num_events);

  const trace_event_t* ev = t->events;
  const size_t n = t->num_events;
  uint64_t ops = 0;
  size_t i;
  int failed_alloc = 0, failed_other = 0;
  gpumem_status_t st = GPUMEM_OK;
  double last_progress = now_s();

  /* The steady state of an extended trace is timed apart, in the cold
   * pass (the one long run). */
  size_t split = r->passes_run == 0 && t->steady_from_event ? t->steady_from_event : SIZE_MAX;
  uint64_t t_split = 0, ops_split = 0;
  gpumem_stats_t at_split;
  size_t half = r->passes_run == 0 ? n / 2 : SIZE_MAX;
  uint64_t ops_half = 0;
  gpumem_stats_t at_half;
  uint64_t t0 = now_ns();
  for (i = 0; i < n; i++) {
    const trace_event_t* e = &ev[i];
    if (i == split) {
      t_split = now_ns();
      ops_split = ops;
      gpumem_get_stats(gm, &at_split);
    }
    if (i == half) {
      ops_half = ops;
      gpumem_get_stats(gm, &at_half);
      at_half.backend_calls[GPUMEM_CALL_mem_info]--; /* the query's own */
    }
    if (e->op == TRACE_ALLOC) {
      void* p = NULL;
      ops++;
      st = gpumem_malloc(gm, (size_t)e->size, e->stream, &p);
      if (st != GPUMEM_OK) {
        /* The host refusing the allocator memory is no finding about the
         * device (an out-of-memory row would be one): an error. */
        if (st == GPUMEM_ERR_HOST_MEMORY) {
          failed_other = 1;
        } else {
          failed_alloc = 1;
        }
        break;
      }
      slots[e->id] = p;
    } else if (e->op == TRACE_FREE) {
      ops++;
      st = gpumem_free(gm, slots[e->id]);
      slots[e->id] = NULL;
      if (st != GPUMEM_OK) {
        failed_other = 1;
        break;
      }
    } else if (slots[e->id]) { /* record_stream; a 0-byte allocation has no pointer */
      st = gpumem_record_stream(gm, slots[e->id], e->stream);
      if (st != GPUMEM_OK) {
        failed_other = 1;
        break;
      }
    }
    if (r->progress && (i % PROGRESS_STRIDE) == PROGRESS_STRIDE - 1) {
      double s = now_s();
      if (s - last_progress >= PROGRESS_INTERVAL) {
        last_progress = s;
        r->progress(r->progress_arg, what, i + 1, n);
      }
    }
  }
  uint64_t t1 = now_ns();

  if (failed_alloc) {
    r->oom = 1;
    r->oom_pass = r->passes_run;
    r->oom_event = i;
    r->oom_line = ev[i].line;
    r->oom_size = (size_t)ev[i].size;
    r->oom_status = st;
    snprintf(r->oom_message, sizeof r->oom_message, "%s", gpumem_last_error());
  }

  gpumem_get_stats(gm, &r->last_pass_end);
  /* gpumem_get_stats counts its own query of the device's free memory:
   * the pass did not make that call. */
  r->last_pass_end.backend_calls[GPUMEM_CALL_mem_info]--;
  if (half != SIZE_MAX && i > half) r->last_pass_end.backend_calls[GPUMEM_CALL_mem_info]--;
  if (split != SIZE_MAX && i >= split && !failed_alloc && !failed_other) {
    r->steady_ops = ops - ops_split;
    r->steady_ns_per_op = r->steady_ops ? (double)(t1 - t_split) / (double)r->steady_ops : 0;
    for (int k = 0; k < GPUMEM_CALL_COUNT; k++)
      r->steady_calls[k] = r->last_pass_end.backend_calls[k] - at_split.backend_calls[k];
    r->steady_syncs = r->last_pass_end.num_syncs - at_split.num_syncs;
  }
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) {
    r->last_pass_calls[k] = r->last_pass_end.backend_calls[k] - before.backend_calls[k];
  }
  if (half != SIZE_MAX && i > half) {
    r->cold_half_ops = ops - ops_half;
    for (int k = 0; k < GPUMEM_CALL_COUNT; k++)
      r->cold_half_calls[k] = r->last_pass_end.backend_calls[k] - at_half.backend_calls[k];
  }
  r->last_pass_syncs = r->last_pass_end.num_syncs - before.num_syncs;
  r->last_pass_retries = r->last_pass_end.num_alloc_retries - before.num_alloc_retries;

  int p = r->passes_run++;
  r->pass_ops[p] = ops;
  r->pass_ns_per_op[p] = ops ? (double)(t1 - t0) / (double)ops : 0;
  update_timings(r);

  gpumem_status_t result = GPUMEM_OK;
  if (failed_other) {
    /* The trace was validated when loaded, so the allocator refused a
     * pointer it handed out (a bug worth seeing), or the host ran out of
     * memory: report it. */
    char why[1024];
    snprintf(why, sizeof why, "%s", gpumem_last_error());
    gpumem_set_last_error("%s: line %u: %s of id %llu failed: %s: %s", t->path,
                          (unsigned)ev[i].line, trace_op_name(ev[i].op),
                          (unsigned long long)t->slot_trace_id[ev[i].id], gpumem_strerror(st), why);
    result = st;
  }
  /* Weights and optimizer state are never freed by the trace: free them
   * here, untimed, so the next pass starts from the warmed cache. */
  if (!keep_live) {
    for (size_t s = 0; s < t->num_allocs; s++) {
      if (!slots[s]) continue;
      gpumem_status_t fst = gpumem_free(gm, slots[s]);
      if (fst != GPUMEM_OK && result == GPUMEM_OK) {
        char why[1024];
        snprintf(why, sizeof why, "%s", gpumem_last_error());
        gpumem_set_last_error("%s: freeing leftover id %llu after the pass failed: %s: %s", t->path,
                              (unsigned long long)t->slot_trace_id[s], gpumem_strerror(fst), why);
        result = fst;
      }
    }
  }
  free(slots);
  return result;
}

gpumem_status_t replay_event_tagged(gpumem_t* gm, const trace_t* trace, size_t i, void** slots) {
  const trace_event_t* e = &trace->events[i];
  gpumem_set_history_tag(gm, e->line);
  if (e->op == TRACE_ALLOC) return gpumem_malloc(gm, e->size, e->stream, &slots[e->id]);
  if (e->op == TRACE_FREE) {
    if (slots[e->id]) gpumem_free(gm, slots[e->id]);
    slots[e->id] = NULL;
  } else if (slots[e->id]) {
    gpumem_record_stream(gm, slots[e->id], e->stream);
  }
  return GPUMEM_OK;
}

gpumem_status_t replay_pass(gpumem_t* gm, const trace_t* trace, replay_result_t* result) {
  return run_pass(gm, trace, result, 0);
}

gpumem_status_t replay_pass_keep(gpumem_t* gm, const trace_t* trace, replay_result_t* result) {
  return run_pass(gm, trace, result, 1);
}

/* ---- cold + warm ------------------------------------------------------ */

gpumem_status_t replay_trace(const trace_t* trace, const replay_config_t* c, replay_result_t* r) {
  gpumem_options_t opts;
  replay_session_t* session = NULL;
  gpumem_status_t st;
  char label[64];

  replay_result_init(r, trace);
  r->progress = c->progress;
  r->progress_arg = c->progress_arg;
  if ((st = replay_check_config(c)) != GPUMEM_OK) return st;
  if ((st = replay_options(c, trace, &opts)) != GPUMEM_OK) return st;
  r->policy = opts.policy;
  r->limit_bytes = opts.limit_bytes;
  if ((st = replay_session_open(c, &opts, trace, &session)) != GPUMEM_OK) return st;
  gpumem_t* gm = replay_session_allocator(session);
  const trace_t* run = replay_session_trace(session);

  r->progress_what = "cold pass";
  st = replay_pass(gm, run, r);
  if (st != GPUMEM_OK) goto done;
  memcpy(r->backend_calls_cold, r->last_pass_calls, sizeof r->backend_calls_cold);
  r->ops_cold = r->pass_ops[0];
  r->num_syncs_cold = r->last_pass_syncs;
  r->num_alloc_retries_cold = r->last_pass_retries;
  gpumem_get_stats(gm, &r->stats_cold);
  r->peak_reserved_bytes = (uint64_t)r->stats_cold.reserved_bytes[GPUMEM_POOL_ALL].peak;
  r->reserved_ratio =
      trace->peak_live_bytes ? (double)r->peak_reserved_bytes / (double)trace->peak_live_bytes : 0;
  /* From here peaks are the warm passes' own: the steady state, which a
   * cold pass's first steps (before any plan) do not show. */
  gpumem_reset_peak_stats(gm);

  for (int k = 1; k <= c->warm_passes && !r->oom; k++) {
    snprintf(label, sizeof label, "warm pass %d/%d", k, c->warm_passes);
    r->progress_what = label;
    st = replay_pass(gm, run, r);
    if (st != GPUMEM_OK) goto done;
    for (int j = 0; j < GPUMEM_CALL_COUNT; j++) r->backend_calls_warm[j] += r->last_pass_calls[j];
    r->ops_warm += r->pass_ops[r->passes_run - 1];
    r->num_syncs_warm += r->last_pass_syncs;
    r->num_alloc_retries_warm += r->last_pass_retries;
    r->warm_passes++;
  }
  gpumem_get_stats(gm, &r->stats_final);
  r->warm_peak_reserved_bytes = (uint64_t)r->stats_final.reserved_bytes[GPUMEM_POOL_ALL].peak;

done:
  r->progress_what = NULL;
  replay_session_close(session);
  return st;
}

/* ---- the smallest limit ----------------------------------------------- */

/* One cold pass from a fresh allocator under limit (0 = none). */
static gpumem_status_t probe(const trace_t* trace, const replay_config_t* c, size_t limit,
                             const char* label, int* ok, uint64_t* peak_reserved,
                             uint64_t* page_size, char* msg, size_t msg_len) {
  gpumem_options_t opts;
  replay_session_t* session = NULL;
  gpumem_status_t st = replay_options(c, trace, &opts);
  if (st != GPUMEM_OK) return st;
  opts.limit_bytes = limit;
  opts.limit_fraction = 0;
  if ((st = replay_session_open(c, &opts, trace, &session)) != GPUMEM_OK) return st;
  gpumem_t* gm = replay_session_allocator(session);

  replay_result_t* pr = malloc(sizeof *pr);
  if (!pr) {
    replay_session_close(session);
    gpumem_set_last_error("replay: out of host memory");
    return GPUMEM_ERR_HOST_MEMORY;
  }
  replay_result_init(pr, trace);
  pr->progress = c->progress;
  pr->progress_arg = c->progress_arg;
  pr->progress_what = label;
  st = replay_pass(gm, replay_session_trace(session), pr);
  if (st == GPUMEM_OK) {
    gpumem_stats_t s;
    gpumem_get_stats(gm, &s);
    *ok = !pr->oom;
    *peak_reserved = (uint64_t)s.reserved_bytes[GPUMEM_POOL_ALL].peak;
    if (page_size) *page_size = s.page_size;
    if (pr->oom && msg) {
      /* The report is quoted inside ours: drop its own program prefix. */
      const char* why = pr->oom_message;
      if (strncmp(why, "gpumem: ", 8) == 0) why += 8;
      snprintf(msg, msg_len, "event %zu (line %u, %zu bytes): %.1400s", pr->oom_event, pr->oom_line,
               pr->oom_size, why);
    }
  }
  free(pr);
  replay_session_close(session);
  return st;
}

gpumem_status_t replay_min_limit(const trace_t* trace, const replay_config_t* config,
                                 replay_result_t* r) {
  replay_config_t c = *config;
  c.limit_bytes = 0;
  c.limit_ratio = 0;
  gpumem_status_t st = replay_check_config(&c);
  if (st != GPUMEM_OK) return st;

  const uint64_t peak = trace->peak_live_bytes;
  char label[96], msg[1536] = "";
  int ok = 0;
  uint64_t reserved = 0, page = 0;
  r->min_limit_done = 1;
  r->min_limit_found = 0;
  r->min_limit_bytes = 0;
  r->min_limit_ratio = 0;
  r->min_limit_probes = 0;
  r->min_limit_message[0] = '\0';

  r->min_limit_probes++;
  st = probe(trace, &c, 0, "min-limit: no limit", &ok, &reserved, &page, msg, sizeof msg);
  if (st != GPUMEM_OK) return st;
  if (!ok) {
    snprintf(r->min_limit_message, sizeof r->min_limit_message,
             "out of memory even without a limit at %s", msg);
    return GPUMEM_OK;
  }

  /* The limit the unlimited run reached should replay too; if it does not
   * (a limit can change decisions, e.g. when the allocator frees cache to
   * stay under it), widen it a few times before giving up. */
  uint64_t hi = reserved > peak ? reserved : peak;
  for (int tries = 0;; tries++) {
    snprintf(label, sizeof label, "min-limit: upper bound %.3f GiB",
             (double)hi / (double)((uint64_t)1 << 30));
    r->min_limit_probes++;
    st = probe(trace, &c, (size_t)hi, label, &ok, &reserved, NULL, msg, sizeof msg);
    if (st != GPUMEM_OK) return st;
    if (ok) break;
    if (tries == 8) {
      snprintf(r->min_limit_message, sizeof r->min_limit_message,
               "no limit up to %llu bytes (%.4f x peak live) replays the trace: %s",
               (unsigned long long)hi, (double)hi / (double)peak, msg);
      return GPUMEM_OK;
    }
    hi += hi / 32 + 1;
  }

  /* Nothing can replay under peak live: it is the lower end without a
   * probe. Reserved memory grows by whole pages, so limits between two
   * page multiples replay alike: probes sit at page multiples while the
   * bracket holds one, and a page is the default precision (0.25% of peak
   * live was the first: it left llama's answer at the unlimited run's
   * 1.0020 x peak live, where 1.0004 x replays). */
  uint64_t lo = peak;
  uint64_t tol = c.min_limit_tolerance > 0 ? (uint64_t)((double)peak * c.min_limit_tolerance)
                                           : peak / 400; /* 0.25% */
  if (c.min_limit_tolerance <= 0 && page && page < tol) tol = page;
  if (tol == 0) tol = 1;
  /* (> tol: a bracket of exactly one page between two page multiples is
   * the answer; probing inside it would only repeat its lower end.) */
  while (hi > lo && hi - lo > tol) {
    uint64_t mid = lo + (hi - lo) / 2;
    if (page && mid - mid % page > lo) mid -= mid % page;
    snprintf(label, sizeof label, "min-limit: probe %d at %.4f x peak live",
             r->min_limit_probes + 1, (double)mid / (double)peak);
    r->min_limit_probes++;
    st = probe(trace, &c, (size_t)mid, label, &ok, &reserved, NULL, NULL, 0);
    if (st != GPUMEM_OK) return st;
    if (ok) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  r->min_limit_found = 1;
  r->min_limit_bytes = (size_t)hi;
  r->min_limit_ratio = peak ? (double)hi / (double)peak : 0;
  return GPUMEM_OK;
}

size_t replay_tagged_peak(gpumem_t* gm, const trace_t* t, size_t start, size_t stop, void** slots) {
  int64_t best = -1;
  size_t best_event = 0;
  for (size_t i = start; i < stop; i++) {
    if (replay_event_tagged(gm, t, i, slots) != GPUMEM_OK) return SIZE_MAX;
    if (t->events[i].op != TRACE_ALLOC) continue;
    gpumem_stats_t st;
    gpumem_get_stats(gm, &st);
    if (st.reserved_bytes[GPUMEM_POOL_ALL].current > best) {
      best = st.reserved_bytes[GPUMEM_POOL_ALL].current;
      best_event = i;
    }
  }
  return best_event;
}

/* The cap a replay of t (NULL: before any trace, so no --limit-ratio)
 * runs under: the limit from the flags or the configuration, or the
 * configuration's fraction of the simulated device, the smaller; 0: none.
 * (On a GPU the fraction's bytes are known only once it is open.) */
uint64_t replay_effective_cap(const replay_config_t* c, const trace_t* t) {
  gpumem_options_t o;
  if (replay_options(c, t, &o) != GPUMEM_OK) return 0;
  uint64_t cap = o.limit_bytes;
  if (o.limit_fraction > 0 && c->device == REPLAY_DEVICE_SIM) {
    uint64_t f = (uint64_t)(o.limit_fraction * (double)c->sim_capacity);
    if (!cap || f < cap) cap = f;
  }
  return cap;
}
