/* What every gpumem command does alike (cli.c): options, configuration,
 * errors, the progress line, loading and replaying traces. */
#ifndef GPUMEM_TOOLS_CLI_H
#define GPUMEM_TOOLS_CLI_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fit.h"
#include "gpumem.h"
#include "peer_models.h"
#include "replay.h"
#include "show.h"
#include "trace.h"

#define EXIT_USAGE 2
#define GIB 1073741824.0

/* ---- options ----------------------------------------------------------- */

enum {
  OPT_POLICY,
  OPT_LIMIT,
  OPT_LIMIT_RATIO,
  OPT_CONF,
  OPT_PASSES,
  OPT_DEVICE,
  OPT_CAPACITY,
  OPT_MIN_LIMIT,
  OPT_MIN_LIMIT_TOLERANCE,
  OPT_STEADY,
  OPT_STEP_MS,
  OPT_STEPS,
  OPT_JSON,
  OPT_COMPARE,
  OPT_DETAIL,
  OPT_SNAPSHOT,
  OPT_SINCE_LINE,
  OPT_AT_LINE,
  OPT_MEMORY,
  OPT_SIZES,
  OPT_BATCH,
  OPT_MAX_BATCH,
  OPT_WRITE_TRACE,
  OPT_HELP,
  OPT_PEER_MODELS, /* not an option: the command replays the peer models too */
};

typedef struct cli {
  replay_config_t config;
  int json;
  int compare;
  int detail; /* replay --compare --detail: the full table */
  int min_limit;
  int steady; /* repetitions to append (0: none) */
  int help;
  const char* snapshot;    /* explain: write the snapshot at the peak here */
  const char* write_trace; /* predict: write the trace at --batch here */
  int since_line;          /* leaks: count allocations from this trace line on */
  int at_line;             /* explain: the state after this trace line (0: at the peak) */
  peer_model_t peer;       /* replay through a model of another allocator */
  size_t memory;           /* fit: the device memory asked about */
  const char* sizes;       /* predict: the recordings' batch sizes, as given */
  long batch;              /* predict: the batch to predict at (0: none asked) */
  long max_batch;          /* predict: the largest batch the search tries (0: no cap) */
  char conf_rest[1024];    /* --conf without PyTorch's expandable_segments key */
  char conf_all[4096];     /* GPUMEM_CONF, then conf_rest: what the replays read */
  int expandable;          /* --conf's expandable_segments: 1, 0, or -1 when absent */
  uint64_t model_cap;      /* a peer model's cap from the fraction key (0: none) */
  const char** traces;
  int num_traces;
} cli_t;

/* A one-line progress display on stderr, only for a person at a terminal
 * (never in logs or pipes), and only once work has run long enough to be
 * worth watching. */
typedef struct progress {
  int enabled;
  double started;
  int shown; /* characters on the line now */
  const char* trace;
  const char* policy;
} progress_t;

/* Parses argv (after the command) into cli (zeroed by the caller). allowed
 * is a bitmask of OPT_* the command accepts; usage its usage text. Returns
 * 0, or the exit code after printing why. cli->traces is malloc'ed. */
int cli_parse_args(int argc, char** argv, unsigned allowed, const char* usage, cli_t* cli);
/* The same for a command that takes one trace: -1 when the command goes
 * on, else its exit code (help printed, or a usage error; cli->traces
 * freed). */
int cli_parse_one_trace(int argc, char** argv, unsigned allowed, const char* usage, cli_t* cli);
/* A whole decimal number in [min, max] into *out; 0 when it is not one. */
int cli_parse_count(const char* value, long min, long max, int* out);
int cli_parse_long(const char* value, long min, long max, long* out);

/* ---- errors ------------------------------------------------------------ */

/* Usage mistakes: "gpumem: <message>" and where the options are; returns
 * EXIT_USAGE. Every message is printed with show.h's rule. */
int cli_usage_error(const char* usage, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
/* Errors: "gpumem: <message>"; returns EXIT_FAILURE. */
int cli_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
/* The library's error about trace t, named by its path; EXIT_FAILURE. */
int cli_trace_error(const trace_t* t);

/* ---- the progress line ------------------------------------------------- */

void progress_start(progress_t* p, const char* trace, const char* policy);
/* A replay_config_t progress callback; arg is the progress_t. */
void progress_show(void* arg, const char* what, size_t done, size_t total);
void progress_clear(progress_t* p);

/* ---- output ------------------------------------------------------------ */

/* A growing, NUL-terminated text buffer that the library's writers
 * (gpumem_write_fn) fill: start it {NULL, 0, 0}, free(s) when done. */
typedef struct gm_text {
  char* s;
  size_t len, cap;
} gm_text_t;
int gm_text_write(const char* s, size_t len, void* arg);

/* ---- traces and replays ------------------------------------------------ */

/* Every trace of cli loaded (and extended by --steady) before any replay,
 * so that a typo in the last name fails at once. 0 or the exit code. */
int cli_load_all(const cli_t* cli, trace_t*** out);
/* The one trace of a one-trace command and a slot per allocation for it. */
int cli_load_with_slots(const cli_t* cli, trace_t** t, void*** slots);
/* A real GPU opened once up front, so that a machine without one says so
 * before any trace is read (nothing for the simulated device). */
int cli_check_device(const replay_config_t* config);
/* One replay with the progress line (and the min-limit bisection when
 * asked); 0, or 1 after printing the error. */
int cli_run_one(const trace_t* t, const replay_config_t* config, int min_limit,
                progress_t* progress, replay_result_t* r);
/* One row of fit's table for t, with the progress line; 0 or 1. */
int cli_fit_row(const trace_t* t, const fit_row_t* row, const cli_t* cli, progress_t* progress,
                fit_result_t* out);

/* ---- the configuration ------------------------------------------------- */

/* GPUMEM_CONF from the environment, or NULL when unset or empty. */
const char* cli_env_conf(void);

/* 0 when GPUMEM_CONF is unset or parses as the library reads it; else
 * prints "gpumem: bad GPUMEM_CONF '...': why" on stderr and returns 1. */
int cli_check_env_conf(void);

/* GPUMEM_CONF and then conf (either may be NULL) joined into out as one
 * configuration string, so that conf's keys override the environment's.
 * -1 (nothing written) when they do not fit in cap. */
int cli_join_conf(const char* conf, char* out, size_t cap);

/* Calls fn for each key of conf (as written, trimmed); stops at and returns
 * the first nonzero value fn returns. */
int cli_each_key(const char* conf, int (*fn)(const char* key, size_t len, void* arg), void* arg);

/* Whether conf names key (any case). */
int cli_conf_has(const char* conf, const char* key);

/* 0 when neither GPUMEM_CONF nor conf (--conf) holds record; else prints
 * why and returns 1. In a command that replays a trace, record would
 * write the replay itself as a trace, over the recording being read when
 * the paths are the same. */
int cli_refuse_record(const char* conf);

/* A --memory value: a size with its unit (80G; 4096B for bytes), above 0.
 * GPUMEM_ERR_INVALID_ARGUMENT with gpumem_last_error() naming the value. */
gpumem_status_t cli_parse_memory(const char* text, size_t* out);

/* A size typed on the command line (option names it, e.g. "--limit"): as
 * gpumem_parse_size, but a number without a unit is refused ("80" would be
 * 80 bytes, almost never what was meant; "80B" says so). On failure
 * gpumem_last_error() holds the whole message, starting with the option. */
gpumem_status_t cli_parse_size(const char* option, const char* text, size_t* out);

/* The size-valued keys of a configuration string typed on the command line
 * must carry a unit too; GPUMEM_ERR_CONFIG with the message otherwise. */
gpumem_status_t cli_check_conf_units(const char* option, const char* conf);

#endif
