/* How one replay's figures are shown: `gpumem replay`'s human and JSON
 * forms, shared by its --compare table (cmd_compare.c). */
#ifndef GPUMEM_TOOLS_REPLAY_OUTPUT_H
#define GPUMEM_TOOLS_REPLAY_OUTPUT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "replay.h"
#include "trace.h"

/* These are measurements on an NVIDIA H200 (BENCHMARKS.md, "Peers"), not
 * anything this program computes; they are shown beside our replay so the
 * reader can see where gpumem stands. Keyed by trace basename. */
typedef struct anchor {
  const char* trace;
  double torch_reserved;     /* PyTorch native: peak reserved / peak live */
  double best_reserved;      /* best of torch_exp and async */
  const char* best_peer;     /* which one */
  double torch_min_cap;      /* min cap / peak live, PyTorch native */
  double best_min_cap;       /* best of torch_exp and async */
  const char* best_cap_peer; /* which one */
} anchor_t;

/* The H200 figures of a bundled trace by its name, or NULL. */
const anchor_t* replay_anchor(const char* name);

/* What a replay's device calls (counts by kind) would take on a GPU, in
 * microseconds, at the per-call costs measured on an H100 and an H200
 * (replay_output.c says which). */
double price_map_us(const uint64_t* calls);
double price_map_us_per_op(const uint64_t* calls, uint64_t ops);
/* The expandable-segments model's growth: pages created and mapped. */
double price_expandable_us_per_op(uint64_t pages, size_t ops);
/* The second half of the cold pass as a share of its operations. */
double replay_half_share(const replay_result_t* r);

/* One replay as a JSON object on a line; anchor (may be NULL) adds the
 * H200 figures, column names the --compare column (NULL: none). */
void replay_print_json(FILE* f, const trace_t* t, const replay_config_t* c,
                       const replay_result_t* r, const anchor_t* anchor, const char* column);
/* One replay for a person: a block of labelled lines. */
void replay_print_human(FILE* f, const trace_t* t, const replay_config_t* c,
                        const replay_result_t* r);

#endif
