/* The allocator table of `gpumem fit` and `gpumem report --memory`: for
 * each allocator a PyTorch user can choose and for gpumem's settings, the
 * peak reserved memory with no limit, the smallest limit under which the
 * trace replays, and whether it replays under a given device memory. Kept
 * here so that both commands ask the same rows the same way and show the
 * same figures. */
#ifndef GPUMEM_TOOLS_FIT_H
#define GPUMEM_TOOLS_FIT_H

#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "peer_models.h"
#include "replay.h"
#include "trace.h"

typedef struct fit_row {
  const char* name;  /* what the user would pick */
  const char* how;   /* how to pick it */
  peer_model_t peer; /* a model, or PEER_NONE for the engine */
  gpumem_policy_t policy;
  const char* conf;
  int gpumem_default; /* the row of gpumem as it comes (the table's headline) */
} fit_row_t;

extern const fit_row_t fit_rows[];
extern const size_t fit_num_rows;

typedef struct fit_result {
  int fits;               /* replays under the memory asked about (0 when none was) */
  uint64_t peak_reserved; /* no limit */
  uint64_t needed;        /* smallest limit; 0: none found */
} fit_result_t;

/* One row for trace t: peak reserved, the smallest limit (bisected to
 * base->min_limit_tolerance) and, when memory is not 0, whether it fits
 * in memory. base gives the replay settings the engine's rows start from
 * (device, tolerance, progress); its policy, conf and limits are replaced
 * by the row's. On failure the status, with gpumem_last_error() set. */
gpumem_status_t fit_one(const trace_t* t, const fit_row_t* row, size_t memory,
                        const replay_config_t* base, fit_result_t* out);

/* Whether trace t replays under a hard limit of memory (above 0) with the
 * row's allocator: one cold pass, without the peak and the bisection of
 * fit_one, for searches that ask this many times (gpumem predict's largest
 * batch). On failure the status, with gpumem_last_error() set. */
gpumem_status_t fit_fits(const trace_t* t, const fit_row_t* row, size_t memory,
                         const replay_config_t* base, int* fits);

/* The table's two figures as text, "5.660 GiB (1.003x)" (x: over peak
 * live), or "-" for a smallest limit not found. */
void fit_cells(const trace_t* t, const fit_result_t* f, char* peak, char* need, size_t cap);

/* Says on lines of their own (into f) why figures of the table that could
 * be read as contradicting each other do not: rows that fit in memory with
 * a peak above it (the peak is the one with no limit), or rows that do not
 * fit although their smallest limit is below memory. results: one per row
 * of fit_rows. The number of sentences said. */
int fit_explain(FILE* f, const fit_result_t* results, size_t memory);

/* The overflow tier's answer for a job that does not fit: replayed under a
 * hard limit of memory with gpumem's default and overflow:host (no host
 * budget), on the simulated device. */
typedef struct fit_overflow {
  int fits;             /* replays to its end that way */
  uint64_t host_peak;   /* the most bytes on host pages at once */
  uint64_t host_allocs; /* requests served from host pages */
  uint64_t moves_to_host, moves_to_device;
  uint64_t link_bytes; /* requests on host pages plus both ways of every move */
  double link_us;      /* link_bytes at the model's host-link rate */
} fit_overflow_t;
gpumem_status_t fit_overflow(const trace_t* t, size_t memory, const replay_config_t* base,
                             fit_overflow_t* out);
/* "With overflow:host it fits: ..." as a paragraph into f. */
void fit_overflow_say(FILE* f, const trace_t* t, const fit_overflow_t* o, size_t memory);

/* What the table's figures mean and where the models come from. */
extern const char fit_note[];

#endif
