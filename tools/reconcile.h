/* Recordings of one job at several batch sizes that differ by short-lived
 * allocations: a kernel that takes a workspace at one batch and not at
 * another (cuBLAS and cuDNN choose their algorithms by problem size), made
 * alike before `gpumem predict` aligns them (docs/predict.md, "Algorithm
 * choices").
 *
 * A transient group is one to RECONCILE_MAX_GROUP allocations made one after
 * another and all freed in the run of frees that follows them. Walking each
 * recording beside the largest one, where the two differ, reconcile looks
 * for such a group in either, just before or up to RECONCILE_MAX_BACKTRACK
 * matched allocations before the difference, whose removal lets the next
 * RECONCILE_LOOKAHEAD requests match again. A group only the largest
 * recording has is added to the smaller one, its sizes scaled in proportion
 * to the batch (the larger problems are the ones that take the workspace);
 * a group only a smaller recording has is dropped from it. Where no group
 * explains a difference, the recordings are left as they were and the
 * aligner names the difference. */
#ifndef GPUMEM_TOOLS_RECONCILE_H
#define GPUMEM_TOOLS_RECONCILE_H

#include <stddef.h>

#include "gpumem.h"
#include "trace.h"

#define RECONCILE_MAX_GROUP 4
#define RECONCILE_MAX_BACKTRACK 3
#define RECONCILE_LOOKAHEAD 8

typedef struct reconcile_report {
  size_t added;                    /* allocations added to smaller recordings */
  size_t dropped;                  /* allocations dropped from smaller recordings */
  size_t groups;                   /* transient groups added or dropped */
  uint64_t added_bytes_at_largest; /* their sizes in the largest recording */
} reconcile_report_t;

/* Makes traces[0..n-2] alike traces[n-1] where transient groups explain
 * their differences; a trace edited is replaced (the old one freed). batch:
 * each trace's batch size. GPUMEM_OK also when nothing could be reconciled;
 * an error only for host memory. */
gpumem_status_t reconcile_transients(trace_t** traces, const long* batch, size_t n,
                                     reconcile_report_t* report);

#endif
