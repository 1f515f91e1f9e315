/* Recordings of one job at several batch sizes made alike before `gpumem
 * predict` fits their sizes (docs/predict.md, "Alignment"). Two runs of a
 * job at different batches are two versions of one text: most allocations
 * are the same request, a few are made at one batch and not the other (a
 * kernel that picks its algorithm by problem size takes a workspace, an
 * embedding's backward sorts its indices past a size, a scalar is read at
 * one batch only), and frees made together come in another order. So the
 * allocations are matched the way `diff` matches lines: an allocation is
 * known by what made it (its role, where the recorder says: the operator
 * or the frames), its stream, its order among the others, and a size that
 * can have grown into the larger one with the batch. The match is the
 * longest common subsequence, first of allocations whose sizes are equal
 * or in exact proportion to the batch, then, between those, of any whose
 * sizes can have grown into each other (the closest in proportion where
 * several would do).
 *
 * Every recording is then rewritten in the order of the largest (its
 * frees and record_streams too: the larger batch is the one predicted
 * from), each allocation at its own recorded size. An allocation only the
 * largest makes is added to the smaller ones in proportion to the batch:
 * an upper bound for sizes that grow at most linearly; where another
 * smaller recording makes it too, on the power law through the sizes the
 * recordings that make it give (an exponent of at most 2); where an
 * optimizer's step made it (a step a smaller run skipped), at its size.
 * What optimizer steps made is not counted against the recordings being
 * one job (the limits below). One a smaller
 * recording makes and the largest does not is left out. Both are counted,
 * with their bytes, in the report. */
#ifndef GPUMEM_TOOLS_ALIGN_H
#define GPUMEM_TOOLS_ALIGN_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem.h"
#include "trace.h"

/* Differences one alignment of two recordings may hold (its cost in memory
 * grows with the square of it): far more than algorithm choices make. */
#define ALIGN_MAX_DIFFERENCES 3000
/* At most one in ALIGN_MAX_UNMATCHED_SHARE_DEN of the largest recording's
 * allocations may go unmatched (in either recording, more than 16): more
 * is a job whose number of requests grows with the batch. */
#define ALIGN_MAX_UNMATCHED_SHARE_DEN 10
/* Roles named in the report: the unmatched ones with the most bytes. */
#define ALIGN_TOP_ROLES 3

typedef struct align_role_bytes {
  char role[TRACE_MAX_ROLE + 1]; /* "" where the recorder gave none */
  int inserted;                  /* 1: made only at the largest batch; 0: only at a smaller one */
  size_t count;
  uint64_t bytes;
} align_role_bytes_t;

typedef struct align_report {
  int edited;                /* some recording was rewritten */
  int by_role;               /* every recording named roles, and they were used */
  size_t steps;              /* whole steps aligned (0: recordings without step markers) */
  size_t matched;            /* allocations of the largest recording matched in every other */
  size_t inserted;           /* allocations only the largest makes, added to smaller ones */
  uint64_t inserted_bytes;   /* their sizes in the largest recording */
  size_t inserted_sized;     /* of them, made by another smaller recording and sized through it */
  size_t inserted_optimizer; /* of them, made in an optimizer's step: carried at their size */
  size_t dropped;            /* allocations of smaller recordings the largest does not make */
  uint64_t dropped_bytes;    /* their sizes as recorded */
  size_t frees_moved;        /* frees of matched allocations placed as in the largest recording */
  align_role_bytes_t top[ALIGN_TOP_ROLES]; /* by bytes, largest first; count 0: none */
} align_report_t;

/* Rewrites traces[0..n-1) (recorded at batch[0..n-1), increasing: the last
 * one the largest) in the order of traces[n-1], as above; a trace
 * rewritten is replaced (the old one freed). Recordings with step markers
 * are cut to the whole steps all of them have. GPUMEM_OK also when nothing
 * needed rewriting, and when the batches are not increasing (the fit
 * names that); GPUMEM_ERR_INVALID_ARGUMENT, with gpumem_last_error() beginning
 * "the recordings differ", when two recordings differ in more than
 * ALIGN_MAX_DIFFERENCES allocations (it names the first difference), when
 * one ends early, when less than half match, or when more than one in
 * ALIGN_MAX_UNMATCHED_SHARE_DEN goes unmatched; GPUMEM_ERR_HOST_MEMORY. */
gpumem_status_t align_recordings(trace_t** traces, const long* batch, size_t n,
                                 align_report_t* report);

#endif
