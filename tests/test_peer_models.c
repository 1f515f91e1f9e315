/* The peer allocator models (tools/peer_models.c) against what the real
 * allocators did on an NVIDIA H200 (PyTorch 2.11, CUDA 13) with the bundled
 * traces, replayed alloc for alloc on one stream (/work/shared/ANCHORS.md,
 * its replay harness): peak reserved / peak live and the smallest memory
 * fraction under which the trace replays / peak live. Expandable segments
 * must be within 2% of both, cudaMallocAsync within 5%. Prints model beside
 * measured for every trace; also checks the configuration key parsing. */
#include <stdio.h>
#include <string.h>

#include "peer_models.h"
#include "reader.h"
#include "test_util.h"
#include "trace.h"

typedef struct measured {
  const char* trace;
  double exp_reserved, exp_min; /* expandable segments */
  double async_reserved, async_min;
} measured_t;

/* ANCHORS.md. The min caps were bisected in 8 steps over [1, 1.6] x peak
 * live and report the upper end: each is up to 0.0023 above the truth. */
static const measured_t measured[] = {
    {"gpt2_train", 1.0698, 1.0094, 1.0786, 1.0773},
    {"resnet50_train", 1.0068, 1.0070, 1.0359, 1.0305},
    {"llama_ckpt_train", 1.1508, 1.0258, 1.0968, 1.0937},
    {"t5_varlen_prefetch", 1.0354, 1.0141, 1.0489, 1.0469},
};

static void check_within(const char* what, const char* trace, double model, double real,
                         double tolerance) {
  double err = (model - real) / real;
  printf("  %-20s %-26s model %.4f  measured %.4f  error %+.2f%%\n", trace, what, model, real,
         100 * err);
  CHECK_MSG(err <= tolerance && err >= -tolerance, "%s %s: model %.4f, measured %.4f", trace, what,
            model, real);
}

static void test_anchors(void) {
  for (size_t i = 0; i < sizeof measured / sizeof measured[0]; i++) {
    const measured_t* m = &measured[i];
    char path[1024];
    snprintf(path, sizeof path, "%s/traces/%s.trace.gz", GPUMEM_SOURCE_DIR, m->trace);
    trace_t* t = NULL;
    CHECK_STATUS(trace_load(path, &t), GPUMEM_OK);
    if (!t) continue;
    double live = (double)t->peak_live_bytes;
    peer_result_t r;
    uint64_t min = 0;
    CHECK_STATUS(peer_run(t, PEER_EXPANDABLE, 0, 1, &r), GPUMEM_OK);
    check_within("expandable peak reserved", m->trace, (double)r.peak_reserved_bytes / live,
                 m->exp_reserved, 0.02);
    CHECK(!r.oom);
    CHECK_STATUS(peer_min_limit(t, PEER_EXPANDABLE, 0, 1, &min), GPUMEM_OK);
    check_within("expandable min limit", m->trace, (double)min / live, m->exp_min, 0.02);
    /* the limit found replays, a page less does not */
    CHECK_STATUS(peer_run(t, PEER_EXPANDABLE, min, 1, &r), GPUMEM_OK);
    CHECK(!r.oom);
    CHECK_STATUS(peer_run(t, PEER_EXPANDABLE, min - (2 << 20), 1, &r), GPUMEM_OK);
    CHECK(r.oom);
    CHECK_STATUS(peer_run(t, PEER_ASYNC, 0, 1, &r), GPUMEM_OK);
    check_within("async peak reserved", m->trace, (double)r.peak_reserved_bytes / live,
                 m->async_reserved, 0.05);
    CHECK_STATUS(peer_min_limit(t, PEER_ASYNC, 0, 1, &min), GPUMEM_OK);
    check_within("async min limit", m->trace, (double)min / live, m->async_min, 0.05);
    trace_free(t);
  }
}

static void test_conf(void) {
  char rest[256];
  int exp = -1;
  CHECK_STATUS(peer_take_expandable("expandable_segments:True", rest, sizeof rest, &exp),
               GPUMEM_OK);
  CHECK(exp == 1 && rest[0] == '\0');
  exp = -1;
  CHECK_STATUS(peer_take_expandable("limit:4G,EXPANDABLE_SEGMENTS:false,reclaim:pressure", rest,
                                    sizeof rest, &exp),
               GPUMEM_OK);
  CHECK(exp == 0 && strcmp(rest, "limit:4G,reclaim:pressure") == 0);
  exp = -1;
  CHECK_STATUS(peer_take_expandable("limit:4G", rest, sizeof rest, &exp), GPUMEM_OK);
  CHECK(exp == -1 && strcmp(rest, "limit:4G") == 0);
  clear_error();
  CHECK_STATUS(peer_take_expandable("expandable_segments:yes", rest, sizeof rest, &exp),
               GPUMEM_ERR_CONFIG);
  CHECK(strstr(gpumem_last_error(), "expandable_segments") != NULL);
}

/* Expandable segments' best fit walks past the free block at the top of
 * the mapped part of a segment when a larger hole comes next in size
 * order (PyTorch counts a block as its size plus the unmapped range after
 * it). Pages of 20 MiB: a0, a1 fill the first page; a2 (15 MiB) maps a
 * second and leaves a 5 MiB top; a0's 10 MiB hole opens. a3 (4 MiB) takes
 * the hole, not the top, so a4 (9 MiB) fits neither what is left of the
 * hole nor the top, and a third page is mapped: 60 MiB. A plain best fit
 * would put a3 at the top and a4 in the hole, at 40 MiB. Measured on an
 * H200 under PyTorch 2.11, the walk's placements match the allocation
 * history address for address. */
static void test_expandable_best_fit_walk(void) {
  static const char text[] =
      "# gpumem-trace v1\n"
      "a 0 10485760 0\na 1 10485760 0\na 2 15728640 0\nf 0\n"
      "a 3 4194304 0\na 4 9437184 0\n";
  trace_t* t = NULL;
  CHECK_STATUS(trace_parse("walk.trace", text, sizeof text - 1, &t), GPUMEM_OK);
  if (!t) return;
  peer_result_t r;
  CHECK_STATUS(peer_run(t, PEER_EXPANDABLE, 0, 1, &r), GPUMEM_OK);
  CHECK_MSG(r.peak_reserved_bytes == 60ULL << 20, "peak reserved %llu, want 60 MiB",
            (unsigned long long)r.peak_reserved_bytes);
  CHECK(r.num_maps == 3);
  CHECK(r.num_pages_mapped == 3);
  trace_free(t);
}

/* A growth's pages are counted one by one, as PyTorch creates and maps
 * them: 50 MiB is one map of three 20 MiB pages, 4 KiB one small page. */
static void test_expandable_pages(void) {
  static const char text[] = "# gpumem-trace v1\na 0 52428800 0\na 1 4096 0\n";
  trace_t* t = NULL;
  CHECK_STATUS(trace_parse("pages.trace", text, sizeof text - 1, &t), GPUMEM_OK);
  if (!t) return;
  peer_result_t r;
  CHECK_STATUS(peer_run(t, PEER_EXPANDABLE, 0, 1, &r), GPUMEM_OK);
  CHECK_MSG(r.num_maps == 2 && r.num_pages_mapped == 4, "maps %llu, pages %llu: want 2 and 4",
            (unsigned long long)r.num_maps, (unsigned long long)r.num_pages_mapped);
  CHECK(r.peak_reserved_bytes == 62ULL << 20);
  CHECK_STATUS(peer_run(t, PEER_ASYNC, 0, 1, &r), GPUMEM_OK);
  CHECK(r.num_pages_mapped == 0);
  trace_free(t);
}

int main(void) {
  test_conf();
  test_expandable_best_fit_walk();
  test_expandable_pages();
  test_anchors();
  return test_finish("test_peer_models");
}
