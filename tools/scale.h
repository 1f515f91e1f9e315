/* A job's allocations at a batch size it has not run at (gpumem predict,
 * docs/predict.md). The same job recorded at a few batch sizes makes the
 * same requests in the same order; only their sizes change with the batch.
 * So the recordings are aligned event by event, each allocation's size is
 * fitted as a function of the batch (constant, affine, or quadratic, exact
 * on every recording), and the trace at any batch is written from those
 * functions: a trace like any other, which the replay and the allocator
 * models of fit.h take as they are. The engine does not know it is
 * predicting. */
#ifndef GPUMEM_TOOLS_SCALE_H
#define GPUMEM_TOOLS_SCALE_H

#include <stddef.h>
#include <stdint.h>

#include "fit.h"
#include "gpumem.h"
#include "replay.h"
#include "trace.h"

/* Recordings one model takes. */
#define SCALE_MAX_RECORDINGS 16
/* The largest batch a recording may have been made at, and the largest one
 * predicted: they keep the exact integer arithmetic of the fit within 128
 * bits (docs/predict.md, "Limits"). */
#define SCALE_MAX_RECORDED_BATCH ((long)1 << 20)
#define SCALE_MAX_BATCH ((long)1 << 30)
/* The block every allocator modelled gives a request of up to this many
 * bytes (PyTorch's kMinBlockSize, GM_MIN_BLOCK). */
#define SCALE_BLOCK 512

typedef enum scale_kind {
  SCALE_CONSTANT = 0,  /* the same size in every recording */
  SCALE_AFFINE = 1,    /* a + c*b */
  SCALE_QUADRATIC = 2, /* a + c*b + d*b^2 (three recordings or more) */
  SCALE_NUM_KINDS = 3,
} scale_kind_t;

/* With three recordings or more, the largest is held out: the model of
 * the others predicts it, and what it got right is counted. */
typedef struct scale_check {
  int done;
  long batch;               /* the recording held out */
  size_t allocations;       /* compared */
  size_t exact;             /* predicted to the byte */
  size_t unpredicted;       /* no model of the others fits, or it gives no size */
  uint64_t max_error_bytes; /* the largest miss among the predicted ones */
  /* Peak live of the held-out recording as recorded, and as predicted
   * (sizes that could not be predicted taken as recorded). */
  uint64_t recorded_peak_live;
  uint64_t predicted_peak_live;
} scale_check_t;

typedef struct scale_slot scale_slot_t; /* one allocation's size model (scale.c) */

typedef struct scale_model {
  size_t num_recordings;
  long batch[SCALE_MAX_RECORDINGS];            /* increasing */
  const trace_t* traces[SCALE_MAX_RECORDINGS]; /* borrowed: they outlive the model */
  size_t num_events;                           /* aligned and modelled: each one's first */
  size_t num_allocs;                           /* allocations among them */
  /* Whole steps aligned ("# step N" markers): when the recordings have
   * different numbers of steps, the first steps_used of each; 0 when they
   * were aligned as wholes. truncated: some recording had events past them. */
  size_t steps_used;
  int truncated;
  size_t kind_count[SCALE_NUM_KINDS]; /* allocations of each kind */
  /* Among the constant ones: allocations of at most SCALE_BLOCK bytes whose
   * sizes follow no trend, held at their largest recorded size (scale.c,
   * fit_sizes). */
  size_t num_held;
  /* With two recordings: the affine allocations that grow faster than the
   * batch between them, nearer a square than a line (a batch-by-batch
   * matrix: a contrastive loss's logits), which a line through two points
   * puts far too low at a large batch; their bytes at the larger batch and
   * the largest of them (a slot, where num_faster > 0). */
  size_t num_faster;
  uint64_t faster_bytes;
  size_t faster_example;
  scale_check_t check;
  scale_slot_t* slots; /* num_allocs of them */
} scale_model_t;

/* Puts each run of frees made together (consecutive, no allocation or
 * record_stream between them) in the order of the allocations they free.
 * Their order changes nothing an allocator decides (blocks merge the same
 * way whatever the order; the next choice comes at the next allocation),
 * but a recorder may see them in another order at another batch (a
 * framework releasing a graph's saved tensors, Python's collector). */
void scale_canonical_frees(trace_t* trace);

/* Aligns traces[0..n) recorded at batch[0..n) (at least 2, increasing, each
 * 1 to SCALE_MAX_RECORDED_BATCH) and fits every allocation's size. On
 * failure GPUMEM_ERR_INVALID_ARGUMENT with gpumem_last_error() saying why:
 * the first event at which the recordings differ (its line in each file and
 * what each has there), or an allocation whose sizes fit no model; host
 * memory: GPUMEM_ERR_HOST_MEMORY. */
gpumem_status_t scale_fit(const trace_t* const* traces, const long* batch, size_t n,
                          scale_model_t** out);
void scale_free(scale_model_t* model);

/* Why scale_trace_at gave no trace for a batch. */
typedef enum scale_at_status {
  SCALE_AT_OK = 0,
  SCALE_AT_BELOW_ONE = 1, /* a size would be 0 or less: the model does not hold there */
  SCALE_AT_TOO_LARGE = 2, /* a size would pass TRACE_MAX_SIZE: fits no device */
} scale_at_status_t;

typedef struct scale_at {
  scale_at_status_t status;
  size_t rounded; /* allocations whose size was rounded to a whole byte */
  size_t slot;    /* for a status other than OK: the allocation */
  double bytes;   /* and the size it would request */
} scale_at_t;

/* The trace at batch (1 to SCALE_MAX_BATCH): the events of the smallest
 * recording (its streams), every size from its model, rounded to the
 * nearest byte where the model's coefficients are fractions. A size below
 * 1 byte (where every recording had more) or above TRACE_MAX_SIZE gives
 * GPUMEM_ERR_INVALID_ARGUMENT, info->status saying which and
 * gpumem_last_error() naming the allocation (its line in each recording)
 * and its model. info may be NULL. */
gpumem_status_t scale_trace_at(const scale_model_t* model, long batch, trace_t** out,
                               scale_at_t* info);

/* What ends the search for the largest batch. */
typedef enum scale_limit {
  SCALE_BY_MEMORY = 0,    /* the next batch does not fit */
  SCALE_BY_MAX_BATCH = 1, /* the cap given (or SCALE_MAX_BATCH) fits */
  SCALE_BY_MODEL = 2,     /* the next batch has a size below 1 byte */
} scale_limit_t;

typedef struct scale_largest {
  long batch; /* the largest batch that fits; 0: none */
  scale_limit_t limited_by;
  long first_not_fitting; /* the smallest batch found not to fit (0: none) */
  long model_edge;        /* a batch where the model gives a size below 1 (0: none met) */
  int below_recorded;     /* batch < the smallest recording's: extrapolated downward */
  int probes;             /* replays run */
} scale_largest_t;

/* The largest batch b >= 1 (at most max_batch, 0 for SCALE_MAX_BATCH)
 * whose predicted trace replays under a hard limit of memory with the
 * row's allocator (fit_fits): from the smallest recording, doubling while
 * it fits, then bisection. Assumes what fits at b fits at any smaller b.
 * Batches whose sizes pass TRACE_MAX_SIZE do not fit. */
gpumem_status_t scale_largest_batch(const scale_model_t* model, const fit_row_t* row, size_t memory,
                                    long max_batch, const replay_config_t* base,
                                    scale_largest_t* out);

const char* scale_kind_name(scale_kind_t kind);

#endif
