/* Models of the allocators PyTorch users choose between besides its native
 * one (which is the engine's `pytorch` policy): expandable segments
 * (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and CUDA's
 * stream-ordered allocator (cudaMallocAsync on a pool whose release
 * threshold is "never"). Each is a replay-side simulator over a trace: it
 * tracks addresses and mapped bytes only, and answers the two questions
 * `gpumem fit` asks: the peak reserved memory without a limit, and whether
 * the trace fits under a limit (so, by bisection, the smallest that does). */
#ifndef GPUMEM_TOOLS_PEER_MODELS_H
#define GPUMEM_TOOLS_PEER_MODELS_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem.h"
#include "trace.h"

typedef enum peer_model {
  PEER_NONE = 0,
  PEER_EXPANDABLE = 1, /* PyTorch's caching allocator with expandable segments */
  PEER_ASYNC = 2,      /* cudaMallocAsync, release threshold "never" */
} peer_model_t;

typedef struct peer_result {
  uint64_t peak_reserved_bytes;
  int oom;          /* ran out under the limit */
  size_t oom_event; /* index of the failed allocation */
  uint64_t oom_size;
  uint64_t num_maps, num_unmaps; /* physical mappings made and released */
  /* Expandable segments: pages mapped (2 MiB small, 20 MiB large). PyTorch
   * makes each page a physical allocation of its own, mapped on its own
   * (ExpandableSegment::map: cuMemCreate and cuMemMap per page, then one
   * cuMemSetAccess over the range), so this is the count its growth pays
   * calls for. 0 for the cudaMallocAsync model (the driver's pool). */
  uint64_t num_pages_mapped;
} peer_result_t;

/* Replays trace through the model with a hard limit on reserved bytes (0:
 * none). one_stream: every allocation on one stream (as the measuring
 * harness of ANCHORS.md replayed them). GPUMEM_ERR_HOST_MEMORY is the only
 * failure; running out under the limit is result->oom. */
gpumem_status_t peer_run(const trace_t* trace, peer_model_t model, uint64_t limit, int one_stream,
                         peer_result_t* result);

/* The smallest limit under which the trace replays, bisected between peak
 * live and the peak reserved without a limit to within tolerance x peak
 * live (0: one 2 MiB page or 0.25%, the finer, as replay_min_limit).
 * *found is 0 when even the unlimited peak failed (never, for these). */
gpumem_status_t peer_min_limit(const trace_t* trace, peer_model_t model, double tolerance,
                               int one_stream, uint64_t* min_limit);

const char* peer_model_name(peer_model_t model);

/* PyTorch's own configuration string (PYTORCH_CUDA_ALLOC_CONF grammar) in
 * conf: removes the expandable_segments key (any case, as PyTorch accepts
 * it; values true/false in any case) into *expandable (1/0, untouched when
 * absent) and writes the rest to out. GPUMEM_ERR_CONFIG for a bad value. */
gpumem_status_t peer_take_expandable(const char* conf, char* out, size_t cap, int* expandable);

#endif
