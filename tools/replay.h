/* Replaying a trace against an allocator: one timed pass (replay_pass),
 * the cold-plus-warm measurement the command line and the benchmarks
 * report (replay_trace), and the bisection for the smallest memory limit
 * under which the trace still runs (replay_min_limit). Numbers follow the
 * definitions of BENCHMARKS.md ("Peers"), so they sit beside the peers'. */
#ifndef GPUMEM_TOOLS_REPLAY_H
#define GPUMEM_TOOLS_REPLAY_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "trace.h"

/* Most passes one replay_result_t keeps timings for (1 cold + warm). */
#define REPLAY_MAX_PASSES 101

typedef enum replay_device {
  REPLAY_DEVICE_SIM = 0,  /* simulated device: deterministic, no GPU */
  REPLAY_DEVICE_CUDA = 1, /* the real GPU through the CUDA driver */
} replay_device_t;

/* Called now and then during long work (never more than a few times a
 * second): what is running ("cold pass", "warm pass 2/3", "min-limit
 * probe 4"), and how far it is, done of total events. */
typedef void (*replay_progress_fn)(void* arg, const char* what, size_t done, size_t total);

typedef struct replay_config {
  gpumem_policy_t policy;
  /* Configuration string (GPUMEM_CONF grammar) applied first; policy,
   * limit_bytes and limit_ratio, when set, override what it says. */
  const char* conf;
  int policy_set;     /* policy above overrides conf */
  size_t limit_bytes; /* 0 = none */
  double limit_ratio; /* > 0: limit = ratio x the trace's peak live */
  int warm_passes;    /* after the cold one (default 3) */
  replay_device_t device;
  size_t sim_capacity;  /* simulated device memory (default 1 TiB) */
  size_t sim_page_size; /* default 2 MiB */
  int cuda_device;      /* ordinal for REPLAY_DEVICE_CUDA */
  /* replay_min_limit stops when the bracket is at most this fraction of
   * peak live (> 0), or, at 0 (the default), at most one page of the
   * device or 0.25% of peak live, whichever is finer. */
  double min_limit_tolerance;
  replay_progress_fn progress;
  void* progress_arg;
  /* For pricing only (the replay ignores them): a step's time on the GPU
   * in ms and how many steps the trace holds; 0 = not given. */
  double step_ms;
  int steps;
} replay_config_t;

void replay_config_init(replay_config_t* config);
/* Checks the configuration once, before any trace is loaded: the conf
 * string parses, the numbers are sane. GPUMEM_ERR_CONFIG or
 * GPUMEM_ERR_INVALID_ARGUMENT with gpumem_last_error() set. */
gpumem_status_t replay_check_config(const replay_config_t* config);
/* The allocator options this config gives for trace (limit resolved). */
gpumem_status_t replay_options(const replay_config_t* config, const trace_t* trace,
                               gpumem_options_t* out);
/* A fresh device (sim or CUDA) and an allocator that owns it, with opts.
 * Streams are whatever the caller passes: on CUDA only 0 is safe, see
 * replay_session_open. */
gpumem_status_t replay_open(const replay_config_t* config, const gpumem_options_t* opts,
                            gpumem_t** out);

/* A device and allocator ready to replay one trace. On the CUDA device a
 * trace's stream values are handles from the recording process, which
 * would crash the driver here: each distinct nonzero stream is replaced by
 * a real stream created for the session (0 stays the default stream). On
 * the simulated device the trace is used as it is. */
typedef struct replay_session replay_session_t;
gpumem_status_t replay_session_open(const replay_config_t* config, const gpumem_options_t* opts,
                                    const trace_t* trace, replay_session_t** out);
gpumem_t* replay_session_allocator(replay_session_t* session);
/* The trace to replay on this session's device (streams mapped). */
const trace_t* replay_session_trace(replay_session_t* session);
/* Destroys the allocator (and what it still holds), then the streams. */
void replay_session_close(replay_session_t* session);

typedef struct replay_result {
  /* -- inputs a caller of replay_pass may set (replay_trace sets them) -- */
  replay_progress_fn progress;
  void* progress_arg;
  const char* progress_what; /* label for the progress line */

  /* -- the trace -- */
  size_t events;
  size_t allocations;
  uint64_t peak_live_bytes;

  /* -- what was run -- */
  gpumem_policy_t policy;
  size_t limit_bytes; /* 0 = none */

  /* -- filled by each replay_pass: timings of every pass so far. An
   * operation is one alloc or one free; record_stream events are timed
   * with them but not counted. -- */
  int passes_run;
  double pass_ns_per_op[REPLAY_MAX_PASSES];
  uint64_t pass_ops[REPLAY_MAX_PASSES]; /* allocs + frees executed */
  double ns_per_op_cold;                /* pass 0 */
  double ns_per_op_warm;                /* median of passes 1.., or -1 when none ran */
  /* Of the latest pass only: backend calls, syncs and retries it caused
   * (leftovers freed after the timed region are not counted), and the
   * allocator's statistics at the end of the trace, before leftovers were
   * freed. */
  uint64_t last_pass_calls[GPUMEM_CALL_COUNT];
  int64_t last_pass_syncs;
  int64_t last_pass_retries;
  gpumem_stats_t last_pass_end;

  /* The first failed allocation (one per result: the pass stops there). */
  int oom;
  int oom_pass;     /* 0 = cold */
  size_t oom_event; /* index into the trace's events */
  unsigned oom_line;
  size_t oom_size;
  gpumem_status_t oom_status; /* usually GPUMEM_ERR_OUT_OF_MEMORY */
  char oom_message[2048];     /* gpumem_last_error() of the failure */

  /* Of the cold pass: its second half (events from the middle on), a long
   * job's steady state when the job never repeats exactly. */
  uint64_t cold_half_ops;
  uint64_t cold_half_calls[GPUMEM_CALL_COUNT];
  /* Of the cold pass of a trace made by trace_repeat_tail: the appended
   * repetitions alone (a long run's steady state). steady_ops 0 = none. */
  uint64_t steady_ops;
  double steady_ns_per_op;
  uint64_t steady_calls[GPUMEM_CALL_COUNT];
  int64_t steady_syncs;
  /* -- filled by replay_trace -- */
  uint64_t peak_reserved_bytes; /* reserved peak after the cold pass */
  double reserved_ratio;        /* over peak live */
  uint64_t backend_calls_cold[GPUMEM_CALL_COUNT];
  uint64_t backend_calls_warm[GPUMEM_CALL_COUNT]; /* summed over warm passes */
  uint64_t ops_cold;
  uint64_t ops_warm; /* summed over warm passes */
  int warm_passes;   /* warm passes that ran */
  int64_t num_syncs_cold, num_syncs_warm;
  int64_t num_alloc_retries_cold, num_alloc_retries_warm;
  gpumem_stats_t stats_cold;         /* right after the cold pass */
  gpumem_stats_t stats_final;        /* after every pass (peaks: of the warm passes) */
  uint64_t warm_peak_reserved_bytes; /* peak reserved over the warm passes */

  /* -- filled by replay_min_limit -- */
  int min_limit_done;     /* 1 once replay_min_limit ran */
  int min_limit_found;    /* 0: even no limit ran out of memory (see message) */
  size_t min_limit_bytes; /* smallest limit found to replay the whole trace */
  double min_limit_ratio; /* over peak live */
  int min_limit_probes;
  char min_limit_message[2048];
} replay_result_t;

/* Zeroes result and fills the trace facts. */
void replay_result_init(replay_result_t* result, const trace_t* trace);

/* One pass over the trace on gm: every event in order, timed as a whole.
 * Stops at the first failed allocation (result->oom and its details). Then
 * frees what is still live, outside the timed region, so that a next pass
 * starts from the warmed cache. Returns GPUMEM_OK when the pass ran (to its
 * end or to an out-of-memory stop); another status when it could not run
 * (host memory, or the allocator refused a free: a bug), with
 * gpumem_last_error() set. */
gpumem_status_t replay_pass(gpumem_t* gm, const trace_t* trace, replay_result_t* result);
/* Same, but the allocations still live at the end are left allocated (for
 * printing the allocator's state at the end of the trace); destroy gm to
 * release them. */
gpumem_status_t replay_pass_keep(gpumem_t* gm, const trace_t* trace, replay_result_t* result);

/* Starts result afresh (replay_result_init), so call replay_min_limit
 * after it. A fresh device and allocator from config, one cold pass, then
 * config->warm_passes warm ones (fewer if one runs out of memory). Returns
 * GPUMEM_OK with result filled, or the error that stopped it (bad config,
 * no device), with gpumem_last_error() set. */
gpumem_status_t replay_trace(const trace_t* trace, const replay_config_t* config,
                             replay_result_t* result);

/* The smallest limit (bytes) under which the whole trace replays in one
 * cold pass, bisected between peak live and the peak reserved without a
 * limit until the interval is at most config->min_limit_tolerance (by
 * default one page or 0.25% of peak live, the finer); probes are at whole
 * pages where the bracket allows. Each probe a fresh allocator. Any limit
 * in config is ignored. Fills the min_limit fields. */
gpumem_status_t replay_min_limit(const trace_t* trace, const replay_config_t* config,
                                 replay_result_t* result);

/* Runs event i of trace on gm untimed, tagged with its trace line
 * (gpumem_set_history_tag: snapshots and leak reports name the line);
 * slots[id] holds each live allocation. Returns an allocation's status,
 * GPUMEM_OK for frees and record_streams (of allocations that failed:
 * nothing). For the tools that look at the allocator between events
 * (explain, leaks, report). */
gpumem_status_t replay_event_tagged(gpumem_t* gm, const trace_t* trace, size_t i, void** slots);
/* Events [start, stop) of t on gm, each tagged with its trace line (as
 * replay_event_tagged); the index of the event after which reserved
 * memory first reached its highest value in them, or SIZE_MAX when an
 * event failed (gpumem_last_error() says why). */
size_t replay_tagged_peak(gpumem_t* gm, const trace_t* t, size_t start, size_t stop, void** slots);

/* The cap a replay of t (NULL: before any trace, so no --limit-ratio)
 * runs under: the limit from the flags or the configuration, or the
 * configuration's fraction of the simulated device, the smaller; 0: none.
 * (On a GPU the fraction's bytes are known only once it is open.) */
uint64_t replay_effective_cap(const replay_config_t* c, const trace_t* t);

const char* replay_policy_name(gpumem_policy_t policy);
const char* replay_device_name(replay_device_t device);

#endif
