/* The engine's rules, one at a time, through the public API.
 *
 * pytorch policy: rounding to 512 bytes; segment sizes (2 MiB for small
 * requests, 20 MiB for 1-10 MiB, larger ones rounded to 2 MiB); when blocks
 * split; merging of free neighbours; best fit with ties broken by address;
 * stream ownership; record_stream and event-deferred reuse; the retry
 * ladder, OOM callbacks and the OOM report; empty_cache; limits as a
 * fraction; max_split_size.
 *
 * default policy: pages mapped on demand, a run of allocations kept at the
 * arena's top while no hole holds them, reserved memory following live
 * bytes, empty_cache unmapping and releasing pages, limits met by moving
 * pages, and streams lending each other their free pages.
 *
 * Last, a throughput figure with 10^6 cached blocks (printed, not judged). */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

/* The default policy holding memory at the high-water mark whatever the
 * moves cost: one page per mapping, no move budget, 0.2% headroom, plans.
 * Tests of page moves, plans and the move guard run under it. */
#define HOLD "policy:default,placement:planned,map_max:2M,move_budget:unlimited,headroom:0.002"
/* Lazy reclaim with every move it allows (no budget, one page per mapping). */
#define LAZY_ALL "policy:default,reclaim:lazy,map_max:2M,move_budget:unlimited,headroom:0.002"

#define SA ((gpumem_stream_t)0)
#define SB ((gpumem_stream_t)0xB0)
#define SC ((gpumem_stream_t)0xC0)

static gpumem_stats_t stats(fx_t* f) {
  gpumem_stats_t s;
  gpumem_get_stats(f->gm, &s);
  return s;
}

static gpumem_sim_counters_t dev(fx_t* f) {
  gpumem_sim_counters_t c;
  gpumem_sim_get_counters(f->sim, &c);
  return c;
}

static int64_t reserved(fx_t* f) {
  return stats(f).reserved_bytes[GPUMEM_POOL_ALL].current;
}

/* Allocates or records a failed check and returns NULL. */
static char* alloc(fx_t* f, size_t size, gpumem_stream_t stream) {
  void* p = NULL;
  gpumem_status_t st = gpumem_malloc(f->gm, size, stream, &p);
  CHECK_MSG(st == GPUMEM_OK && p != NULL, "malloc(%zu) on 0x%lx: %s: %s", size,
            (unsigned long)stream, gpumem_strerror(st), gpumem_last_error());
  return p;
}

static void release(fx_t* f, void* p) {
  CHECK_STATUS(gpumem_free(f->gm, p), GPUMEM_OK);
}

/* ---- pytorch policy ---- */

static void test_rounding(void) {
  static const struct {
    size_t request, block;
    int small;
  } cases[] = {
      {1, 512, 1},    {511, 512, 1},           {512, 512, 1},
      {513, 1024, 1}, {1000, 1024, 1},         {MIB - 1, MIB, 1},
      {MIB, MIB, 1},  {MIB + 1, MIB + 512, 0}, {5 * MIB + 3, 5 * MIB + 512, 0},
  };
  fx_t f = fx_new("policy:pytorch", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char* p = alloc(&f, cases[i].request, SA);
    gpumem_stats_t s = stats(&f);
    int pool = cases[i].small ? GPUMEM_POOL_SMALL : GPUMEM_POOL_LARGE;
    CHECK_MSG(s.allocated_bytes[GPUMEM_POOL_ALL].current == (int64_t)cases[i].block &&
                  s.allocated_bytes[pool].current == (int64_t)cases[i].block,
              "request %zu: allocated %lld, want %zu in the %s pool", cases[i].request,
              (long long)s.allocated_bytes[GPUMEM_POOL_ALL].current, cases[i].block,
              cases[i].small ? "small" : "large");
    CHECK(s.requested_bytes[GPUMEM_POOL_ALL].current == (int64_t)cases[i].request);
    CHECK(gpumem_allocation_size(f.gm, p) == cases[i].request);
    release(&f, p);
  }
  fx_done(&f);
}

/* Each request on a fresh allocator takes exactly one new segment. */
static void test_segment_sizes(void) {
  static const struct {
    size_t request, segment;
    int small;
  } cases[] = {
      {1, 2 * MIB, 1},
      {1000, 2 * MIB, 1},
      {MIB, 2 * MIB, 1},
      {MIB + 1, 20 * MIB, 0},
      {5 * MIB, 20 * MIB, 0},
      {10 * MIB - 512, 20 * MIB, 0},
      {10 * MIB - 1, 10 * MIB, 0}, /* rounds to 10 MiB: no longer "below 10 MiB" */
      {10 * MIB, 10 * MIB, 0},
      {11 * MIB, 12 * MIB, 0},
      {64 * MIB + 1, 66 * MIB, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    fx_t f = fx_new("policy:pytorch", 8 * GIB, 0);
    if (!f.gm) return fx_done(&f);
    alloc(&f, cases[i].request, SA);
    gpumem_stats_t s = stats(&f);
    int pool = cases[i].small ? GPUMEM_POOL_SMALL : GPUMEM_POOL_LARGE;
    CHECK_MSG(s.reserved_bytes[GPUMEM_POOL_ALL].current == (int64_t)cases[i].segment &&
                  s.reserved_bytes[pool].current == (int64_t)cases[i].segment &&
                  s.segment[pool].current == 1,
              "request %zu: reserved %lld in %lld segments, want one of %zu", cases[i].request,
              (long long)s.reserved_bytes[GPUMEM_POOL_ALL].current,
              (long long)s.segment[GPUMEM_POOL_ALL].current, cases[i].segment);
    CHECK(dev(&f).bytes_in_use == cases[i].segment && dev(&f).plain_live == 1);
    fx_done(&f);
  }
}

static void test_splitting(void) {
  fx_t f = fx_new("policy:pytorch", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  /* Large: a 12 MiB segment, reused by requests that leave 1 MiB - 512,
   * exactly 1 MiB, and 1 MiB + 512 behind: only the last is split. */
  char* seg = alloc(&f, 12 * MIB, SA);
  release(&f, seg);
  static const struct {
    size_t request;
    int split;
  } cases[] = {{11 * MIB + 512, 0}, {11 * MIB, 0}, {11 * MIB - 512, 1}};
  for (size_t i = 0; i < 3; i++) {
    char* p = alloc(&f, cases[i].request, SA);
    CHECK(p == seg);
    gpumem_stats_t s = stats(&f);
    size_t block = cases[i].split ? cases[i].request : 12 * MIB;
    CHECK_MSG(s.allocated_bytes[GPUMEM_POOL_LARGE].current == (int64_t)block,
              "request %zu from a 12 MiB block: allocated %lld, want %zu", cases[i].request,
              (long long)s.allocated_bytes[GPUMEM_POOL_LARGE].current, block);
    CHECK(s.inactive_split[GPUMEM_POOL_LARGE].current == cases[i].split);
    CHECK(s.inactive_split_bytes[GPUMEM_POOL_LARGE].current ==
          (cases[i].split ? (int64_t)(12 * MIB - cases[i].request) : 0));
    CHECK(s.reserved_bytes[GPUMEM_POOL_ALL].current == (int64_t)(12 * MIB)); /* no new segment */
    release(&f, p);
    /* Freed, the pieces merge back into the whole segment. */
    CHECK(stats(&f).inactive_split[GPUMEM_POOL_ALL].current == 0);
  }

  /* Small: split whenever at least 512 bytes remain. */
  char* a = alloc(&f, MIB, SB); /* a 2 MiB segment: 1 MiB remains, split */
  gpumem_stats_t s = stats(&f);
  CHECK(s.inactive_split[GPUMEM_POOL_SMALL].current == 1);
  CHECK(s.inactive_split_bytes[GPUMEM_POOL_SMALL].current == (int64_t)MIB);
  char* b = alloc(&f, MIB - 512, SB); /* leaves exactly 512: still split */
  CHECK(b == a + MIB);
  s = stats(&f);
  CHECK(s.inactive_split[GPUMEM_POOL_SMALL].current == 1);
  CHECK(s.inactive_split_bytes[GPUMEM_POOL_SMALL].current == 512);
  char* c = alloc(&f, 1, SB); /* takes the last 512 bytes whole */
  CHECK(c == b + MIB - 512);
  s = stats(&f);
  CHECK(s.inactive_split[GPUMEM_POOL_SMALL].current == 0);
  CHECK(s.allocated_bytes[GPUMEM_POOL_SMALL].current == (int64_t)(2 * MIB));
  CHECK(s.segment[GPUMEM_POOL_SMALL].current == 1);
  fx_done(&f);
}

/* Three adjacent blocks; free the middle, then the sides: one free block,
 * the whole segment again. */
static void test_merging(const char* conf) {
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  int pytorch = strstr(conf, "pytorch") != NULL;
  char* a = alloc(&f, 2 * MIB, SA);
  char* b = alloc(&f, 2 * MIB, SA);
  char* c = alloc(&f, 2 * MIB, SA);
  CHECK_MSG(b == a + 2 * MIB && c == b + 2 * MIB, "%s: blocks not adjacent: %p %p %p", conf,
            (void*)a, (void*)b, (void*)c);
  release(&f, b);
  gpumem_stats_t s = stats(&f);
  if (pytorch) {
    /* the hole and the tail of the 20 MiB segment */
    CHECK(s.inactive_split[GPUMEM_POOL_ALL].current == 2);
    CHECK(s.largest_free_block == 14 * MIB);
  }
  release(&f, a);
  if (pytorch) {
    s = stats(&f);
    CHECK(s.inactive_split[GPUMEM_POOL_ALL].current == 2);
    CHECK(s.inactive_split_bytes[GPUMEM_POOL_ALL].current == (int64_t)(18 * MIB));
  }
  release(&f, c);
  s = stats(&f);
  CHECK_MSG(s.inactive_split[GPUMEM_POOL_ALL].current == 0, "%s: %lld split blocks remain", conf,
            (long long)s.inactive_split[GPUMEM_POOL_ALL].current);
  CHECK(s.segment[GPUMEM_POOL_ALL].current == 1);
  if (pytorch) {
    CHECK(s.largest_free_block == 20 * MIB);
    CHECK(s.cached_free_bytes == 20 * MIB);
    CHECK(s.fragmentation == 0.0);
  }
  /* One block again: a request of all three together lands where a was. */
  char* all = alloc(&f, 6 * MIB, SA);
  CHECK_MSG(all == a, "%s: 6 MiB after merging at %p, want %p", conf, (void*)all, (void*)a);
  CHECK(gpumem_check(f.gm) == 0);
  fx_done(&f);
}

/* Holes of 4, 3 and 3 MiB (in address order) between live guards: a 2.5
 * MiB request takes the smallest hole that fits, and of two equal ones the
 * lower; then the other 3 MiB one; then the 4 MiB hole rather than the
 * equally large tail above it. */
static void test_best_fit(const char* conf) {
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* h1 = alloc(&f, 4 * MIB, SA);
  char* g1 = alloc(&f, 2 * MIB, SA);
  char* h2 = alloc(&f, 3 * MIB, SA);
  char* g2 = alloc(&f, 2 * MIB, SA);
  char* h3 = alloc(&f, 3 * MIB, SA);
  char* g3 = alloc(&f, 2 * MIB, SA);
  /* and a 4 MiB block above, the tail of the 20 MiB segment (pytorch) */
  char* g4 = strstr(conf, "pytorch") ? NULL : alloc(&f, 4 * MIB, SA);
  CHECK(g1 == h1 + 4 * MIB && h2 == g1 + 2 * MIB && g2 == h2 + 3 * MIB && h3 == g2 + 2 * MIB &&
        g3 == h3 + 3 * MIB);
  char* tail = g3 + 2 * MIB;
  if (g4) {
    CHECK(g4 == tail);
    release(&f, g4); /* default: a free block from g3's end to the arena's end */
  }
  release(&f, h1);
  release(&f, h2);
  release(&f, h3);
  char* x = alloc(&f, 5 * MIB / 2, SA);
  CHECK_MSG(x == h2, "%s: first 2.5 MiB at %p, want the lower 3 MiB hole %p", conf, (void*)x,
            (void*)h2);
  char* y = alloc(&f, 5 * MIB / 2, SA);
  CHECK_MSG(y == h3, "%s: second 2.5 MiB at %p, want %p", conf, (void*)y, (void*)h3);
  char* z = alloc(&f, 5 * MIB / 2, SA);
  CHECK_MSG(z == h1, "%s: third 2.5 MiB at %p, want the 4 MiB hole %p (tail %p)", conf, (void*)z,
            (void*)h1, (void*)tail);

  /* The same in the small pool, inside one 2 MiB segment or arena. */
  char* s1 = alloc(&f, 4 * KIB, SB);
  char* t1 = alloc(&f, 512, SB);
  char* s2 = alloc(&f, 3 * KIB, SB);
  char* t2 = alloc(&f, 512, SB);
  char* s3 = alloc(&f, 3 * KIB, SB);
  char* t3 = alloc(&f, 512, SB);
  CHECK(t3 == s3 + 3 * KIB && s2 == t1 + 512 && t1 == s1 + 4 * KIB);
  release(&f, s1);
  release(&f, s2);
  release(&f, s3);
  CHECK(alloc(&f, 2500, SB) == s2);
  CHECK(alloc(&f, 2500, SB) == s3);
  CHECK(alloc(&f, 2500, SB) == s1);
  (void)t2;
  fx_done(&f);
}

/* Where pages move one at a time (here one page per mapping), best fit
 * takes the end of a hole rather than its front where that leaves fewer
 * free bytes in partly used pages (the 2 MiB pages of the simulated
 * device). Where memory grows in runs (the default with no cap), nothing
 * reclaims those pages, and the front is taken as best fit always did:
 * the end walks more address space. */
static void test_hole_end(const char* conf, bool takes_end) {
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* a = alloc(&f, 2 * MIB, SA);
  char* h = alloc(&f, 5 * MIB, SA);
  char* c = alloc(&f, 2 * MIB, SA); /* (1 MiB would go to the small pool) */
  CHECK_MSG(a && h == a + 2 * MIB && c == h + 5 * MIB, "%s: a %p h %p c %p", conf, (void*)a,
            (void*)h, (void*)c);
  CHECK_MSG(((uintptr_t)a & (2 * MIB - 1)) == 0, "arena base %p not page aligned", (void*)a);
  release(&f, h); /* hole [2, 7) MiB */
  /* 3 MiB at the front would leave [5, 7): a partly used page; at the end
   * it leaves [2, 4), one whole page reclaim can take. */
  char* x = alloc(&f, 3 * MIB, SA);
  char* want = takes_end ? a + 4 * MIB : a + 2 * MIB;
  CHECK_MSG(x == want, "%s: 3 MiB at %p, want the hole's %s %p", conf, (void*)x,
            takes_end ? "end" : "front", (void*)want);
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  if (takes_end) {
    /* With the same waste either way, the front, as best fit always did: a
     * 1.5 MiB request in the 2 MiB hole [2, 4) leaves 0.5 MiB at either end. */
    char* y = alloc(&f, 3 * MIB / 2, SA);
    CHECK_MSG(y == a + 2 * MIB, "%s: 1.5 MiB at %p, want the hole's front %p", conf, (void*)y,
              (void*)(a + 2 * MIB));
    release(&f, y);
  }
  release(&f, x);
  release(&f, c);
  release(&f, a);
  fx_done(&f);
}

/* With no cap, a run of allocations made with no free between them, two of
 * which found no hole, keeps going to the arena's top until the stream
 * frees: state built together (parameters, optimizer moments) stays out of
 * the holes transient tensors left. One such allocation is not a run, and
 * under a limit best fit places as always. */
static void test_tail_run(const char* conf, bool follows) {
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* t1 = alloc(&f, 64 * MIB, SA);
  char* k1 = alloc(&f, 2 * MIB, SA);
  char* t2 = alloc(&f, 64 * MIB, SA);
  release(&f, t1);                       /* a 64 MiB hole below k1 */
  char* r1 = alloc(&f, 128 * MIB, SA);   /* no hole holds it: the top */
  char* small = alloc(&f, 16 * MIB, SA); /* one at the top is no run yet: the hole */
  CHECK_MSG(small == t1, "%s: after one top allocation 16 MiB went to %p, want the hole %p", conf,
            (void*)small, (void*)t1);
  release(&f, small); /* (a free: the run starts again) */
  char* r2 = alloc(&f, 128 * MIB, SA);
  char* r3 = alloc(&f, 128 * MIB, SA); /* two in a row at the top, no free between */
  char* r4 = alloc(&f, 16 * MIB, SA);
  if (follows)
    CHECK_MSG(r4 > r3, "%s: the run's next 16 MiB went to %p, want above %p", conf, (void*)r4,
              (void*)r3);
  else
    CHECK_MSG(r4 == t1, "%s: 16 MiB went to %p, want the hole %p (best fit)", conf, (void*)r4,
              (void*)t1);
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  release(&f, t2); /* the stream frees: the run is over, holes are best fit's again */
  char* r5 = alloc(&f, 16 * MIB, SA);
  CHECK_MSG(r5 < k1, "%s: after a free 16 MiB went to %p, want a hole below %p", conf, (void*)r5,
            (void*)k1);
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  char* live[] = {k1, r1, r2, r3, r4, r5};
  for (size_t i = 0; i < sizeof live / sizeof live[0]; i++) release(&f, live[i]);
  fx_done(&f);
}

/* A run at the arena's tail maps ahead of itself (alloc.c,
 * tail_run_ahead): a block that follows another to the top with no free
 * between grows the arena by twice its size more, at most 128 MiB, and the
 * run's next blocks find those pages mapped. The first block of a run, a
 * block after a free and any block under a limit map only their own pages;
 * the pages ahead are cached memory that empty_cache gives back. */
static void test_map_ahead(void) {
  fx_t f = fx_new("policy:default", 64 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* a = alloc(&f, 10 * MIB, SA); /* the first at the top: its 5 pages */
  CHECK_MSG(reserved(&f) == (int64_t)(10 * MIB), "one block: reserved %lld, want 10 MiB",
            (long long)reserved(&f));
  char* b = alloc(&f, 10 * MIB, SA); /* a run: 10 MiB and 20 ahead */
  CHECK_MSG(reserved(&f) == (int64_t)(40 * MIB), "a run of two: reserved %lld, want 40 MiB",
            (long long)reserved(&f));
  uint64_t creates = dev(&f).calls[GPUMEM_CALL_create_page];
  char* c = alloc(&f, 10 * MIB, SA);
  char* d = alloc(&f, 10 * MIB, SA); /* both in the pages ahead: no call */
  CHECK_MSG(
      c == b + 10 * MIB && d == c + 10 * MIB && dev(&f).calls[GPUMEM_CALL_create_page] == creates,
      "the run's next blocks: %llu new mappings, want none",
      (unsigned long long)(dev(&f).calls[GPUMEM_CALL_create_page] - creates));
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  char* e = alloc(&f, 100 * MIB, SA); /* walks on: 100 MiB and 128 ahead (capped) */
  CHECK_MSG(reserved(&f) == (int64_t)(268 * MIB), "capped: reserved %lld, want 268 MiB",
            (long long)reserved(&f));
  release(&f, alloc(&f, 1000, SA)); /* a free on the stream: the run is over */
  int64_t before = reserved(&f);
  char* g = alloc(&f, 300 * MIB, SA); /* past the pages ahead: only its own */
  CHECK_MSG(g == e + 100 * MIB && reserved(&f) == before + (int64_t)(172 * MIB),
            "after a free: reserved grew %lld, want 172 MiB", (long long)(reserved(&f) - before));
  char* h = alloc(&f, 10 * MIB, SA); /* the second of a new run */
  CHECK_MSG(reserved(&f) == before + (int64_t)(202 * MIB), "a new run: reserved grew %lld",
            (long long)(reserved(&f) - before));
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  char* live[] = {a, b, c, d, e, g, h};
  for (size_t i = 0; i < sizeof live / sizeof live[0]; i++) release(&f, live[i]);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  CHECK_MSG(reserved(&f) == 0, "after empty_cache: reserved %lld, want 0", (long long)reserved(&f));
  /* under a limit: one page per mapping, nothing ahead */
  CHECK_STATUS(gpumem_set_limit(f.gm, 8 * GIB), GPUMEM_OK);
  before = reserved(&f);
  char* x = alloc(&f, 10 * MIB, SA);
  char* y = alloc(&f, 10 * MIB, SA);
  CHECK_MSG(reserved(&f) - before <= (int64_t)(20 * MIB), "under a limit: reserved grew %lld",
            (long long)(reserved(&f) - before));
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  release(&f, x);
  release(&f, y);
  fx_done(&f);
}

/* A block at least 16 times the run's block before it maps ahead as that
 * block would (alloc.c, GM_AHEAD_SPIKE): a decode's 32 MiB cuBLAS
 * workspace made in a run of 2 MiB activations takes 4 MiB ahead, not 64,
 * and the run's next small block still finds its pages mapped. */
static void test_map_ahead_spike(void) {
  fx_t f = fx_new("policy:default", 64 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* a = alloc(&f, 2 * MIB, SA);
  char* b = alloc(&f, 2 * MIB, SA); /* a run: 2 MiB and 4 ahead */
  CHECK_MSG(reserved(&f) == (int64_t)(8 * MIB), "a run of two: reserved %lld, want 8 MiB",
            (long long)reserved(&f));
  char* w = alloc(&f, 32 * MIB, SA); /* 16 times b: b's 4 MiB ahead, not 64 */
  CHECK_MSG(w == b + 2 * MIB && reserved(&f) == (int64_t)(40 * MIB),
            "the spike: reserved %lld, want 40 MiB (at %p, want %p)", (long long)reserved(&f),
            (void*)w, (void*)(b + 2 * MIB));
  uint64_t creates = dev(&f).calls[GPUMEM_CALL_create_page];
  char* c = alloc(&f, 2 * MIB, SA); /* in the pages ahead: no call */
  CHECK_MSG(c == w + 32 * MIB && dev(&f).calls[GPUMEM_CALL_create_page] == creates,
            "after the spike: %llu new mappings, want none",
            (unsigned long long)(dev(&f).calls[GPUMEM_CALL_create_page] - creates));
  char* d = alloc(&f, 20 * MIB, SA); /* 10 times c: no spike; 18 MiB more and 40 ahead */
  CHECK_MSG(reserved(&f) == (int64_t)(98 * MIB), "no spike: reserved %lld, want 98 MiB",
            (long long)reserved(&f));
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  char* live[] = {a, b, w, c, d};
  for (size_t i = 0; i < sizeof live / sizeof live[0]; i++) release(&f, live[i]);
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  fx_done(&f);
}

/* small_pool:off puts a small request in the large arena, in the room a
 * large block leaves in its last page: no page of its own, and it counts
 * in the large pool's statistics, where its free takes it back out. By
 * default it gets a small arena of its own, as in PyTorch. */
static void test_small_pool_setting(const char* conf, bool shared) {
  fx_t f = fx_new(conf, 64 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* big = alloc(&f, 3 * MIB, SA); /* two pages, the second half free */
  char* small = alloc(&f, 4096, SA);
  gpumem_stats_t s = stats(&f);
  CHECK_MSG(reserved(&f) == (int64_t)((shared ? 4 : 6) * MIB), "%s: reserved %lld", conf,
            (long long)reserved(&f));
  CHECK_MSG((small == big + 3 * MIB) == shared, "%s: the small block at %p, the large at %p", conf,
            (void*)small, (void*)big);
  CHECK_MSG(
      s.allocated_bytes[GPUMEM_POOL_SMALL].current == (shared ? 0 : 4096) &&
          s.allocated_bytes[GPUMEM_POOL_LARGE].current == (int64_t)(3 * MIB) + (shared ? 4096 : 0),
      "%s: allocated small %lld, large %lld", conf,
      (long long)s.allocated_bytes[GPUMEM_POOL_SMALL].current,
      (long long)s.allocated_bytes[GPUMEM_POOL_LARGE].current);
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  release(&f, small);
  s = stats(&f);
  CHECK_MSG(s.allocated_bytes[GPUMEM_POOL_ALL].current == (int64_t)(3 * MIB) &&
                s.allocated_bytes[GPUMEM_POOL_SMALL].current == 0,
            "%s: after the free, allocated %lld (small %lld)", conf,
            (long long)s.allocated_bytes[GPUMEM_POOL_ALL].current,
            (long long)s.allocated_bytes[GPUMEM_POOL_SMALL].current);
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  release(&f, big);
  fx_done(&f);
}

/* map_ahead caps what a run maps ahead of itself; off (or 0): each block
 * of a run maps its own pages only, one mapping each. */
static void test_map_ahead_setting(const char* conf, size_t cap) {
  fx_t f = fx_new(conf, 64 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* a = alloc(&f, 10 * MIB, SA);
  char* b = alloc(&f, 10 * MIB, SA); /* the run's second block: 10 MiB and min(20, cap) ahead */
  size_t ahead = cap < 20 * MIB ? cap : 20 * MIB;
  CHECK_MSG(reserved(&f) == (int64_t)(20 * MIB + ahead),
            "%s: a run of two: reserved %lld, want %zu", conf, (long long)reserved(&f),
            20 * MIB + ahead);
  uint64_t creates = dev(&f).calls[GPUMEM_CALL_create_page];
  char* c = alloc(&f, 10 * MIB, SA);
  uint64_t want = ahead >= 10 * MIB ? 0 : 1; /* found mapped, or one mapping of its own */
  CHECK_MSG(dev(&f).calls[GPUMEM_CALL_create_page] - creates == want,
            "%s: the third block made %llu mappings, want %llu", conf,
            (unsigned long long)(dev(&f).calls[GPUMEM_CALL_create_page] - creates),
            (unsigned long long)want);
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  release(&f, a);
  release(&f, b);
  release(&f, c);
  fx_done(&f);
}

/* Mapping ahead under random runs and frees on three streams, on a device
 * large enough never to refuse (a refusal turns mapping ahead off for
 * good, so the randomized test's small devices reach it rarely):
 * gpumem_check after every operation, the device holding exactly what the
 * allocator reserves, and some growth that did map ahead. */
static void test_map_ahead_random(void) {
  fx_t f = fx_new("policy:default", 8 * GIB, 1);
  if (!f.gm) return fx_done(&f);
  static const gpumem_stream_t streams[] = {SA, SB, SC};
  enum { LIVE = 96 };
  char* live[LIVE] = {0};
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  long grew_ahead = 0, violations = 0;
  size_t live_bytes = 0, sizes[LIVE] = {0};
  for (int op = 0; op < 4000 && !violations; op++) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    int slot = (int)(rng % LIVE);
    if (live[slot] && (rng >> 8) % 3 == 0) {
      release(&f, live[slot]);
      live_bytes -= sizes[slot];
      live[slot] = NULL;
    } else if (!live[slot] && live_bytes < 3 * GIB) {
      /* one to four in a row on one stream, with no free between: a run */
      gpumem_stream_t s = streams[(rng >> 12) % 3];
      for (uint64_t k = (rng >> 16) % 4; slot < LIVE; slot++) {
        if (live[slot]) continue;
        size_t size = (size_t)1 << (10 + (rng >> (20 + 3 * k)) % 17); /* 1 KiB - 64 MiB */
        size += (size_t)(rng >> 40) % size;
        int64_t before = reserved(&f);
        live[slot] = alloc(&f, size, s);
        if (!live[slot]) break;
        sizes[slot] = size;
        live_bytes += size;
        grew_ahead += reserved(&f) - before > (int64_t)(size + 2 * 2 * MIB);
        violations += gpumem_check(f.gm) != 0;
        if (k-- == 0) break;
      }
    }
    violations += gpumem_check(f.gm) != 0;
    if (op % 500 == 499) CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  }
  CHECK_MSG(!violations, "gpumem_check: %s", gpumem_last_error());
  CHECK_MSG(grew_ahead > 0, "no growth mapped ahead of its block");
  CHECK_MSG((int64_t)dev(&f).bytes_in_use == reserved(&f),
            "the device holds %llu bytes, the allocator reserves %lld",
            (unsigned long long)dev(&f).bytes_in_use, (long long)reserved(&f));
  CHECK_MSG(stats(&f).num_ooms == 0, "a device of 8 GiB refused 3 GiB live");
  for (int i = 0; i < LIVE; i++)
    if (live[i]) release(&f, live[i]);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  CHECK_MSG(reserved(&f) == 0, "after every free and empty_cache: reserved %lld",
            (long long)reserved(&f));
  printf("map ahead, random: %ld growths mapped ahead of their block\n", grew_ahead);
  fx_done(&f);
}

/* A block freed on stream A is A's: B gets new memory, A gets it back at
 * once. */
static void test_stream_ownership(void) {
  fx_t f = fx_new("policy:pytorch", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* a = alloc(&f, 5 * MIB, SA);
  release(&f, a);
  CHECK(reserved(&f) == (int64_t)(20 * MIB));
  char* b = alloc(&f, 5 * MIB, SB);
  CHECK(b != a);
  CHECK_MSG(reserved(&f) == (int64_t)(40 * MIB), "stream B reused A's cache: reserved %lld",
            (long long)reserved(&f));
  char* a2 = alloc(&f, 5 * MIB, SA);
  CHECK(a2 == a);
  CHECK(reserved(&f) == (int64_t)(40 * MIB));
  fx_done(&f);

  /* default: B never gets A's address either; with lazy reclaim A's free
   * pages move to B, but only after A was synchronized (its queued work may
   * still touch them). They stay mapped at A's address as ghosts: nothing
   * is unmapped. */
  f = fx_new(LAZY_ALL, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  a = alloc(&f, 6 * MIB, SA);
  release(&f, a);
  gpumem_stats_t before = stats(&f);
  uint64_t syncs_before = dev(&f).calls[GPUMEM_CALL_stream_sync];
  b = alloc(&f, 6 * MIB, SB);
  CHECK(b != a);
  gpumem_stats_t after = stats(&f);
  CHECK_MSG(after.reserved_bytes[0].current == (int64_t)(6 * MIB),
            "default: stream B took new pages instead of A's free ones: reserved %lld",
            (long long)after.reserved_bytes[0].current);
  CHECK(after.num_pages_unmapped == before.num_pages_unmapped);
  CHECK(after.num_pages_mapped - before.num_pages_mapped == 3);
  CHECK_MSG(dev(&f).calls[GPUMEM_CALL_stream_sync] == syncs_before + 1 &&
                after.num_syncs == before.num_syncs + 1,
            "A's pages moved without synchronizing A");
  a2 = alloc(&f, 6 * MIB, SA);
  CHECK(a2 == a);
  fx_done(&f);
}

/* A block used on another stream is not reused until that stream's work
 * up to the free has completed: the event completes after 3 queries, one
 * per malloc. Meanwhile it counts as active. */
static void test_record_stream(const char* conf) {
  fx_t f = fx_new(conf, 8 * GIB, 3);
  if (!f.gm) return fx_done(&f);
  char* a = alloc(&f, 5 * MIB, SA);
  CHECK_STATUS(gpumem_record_stream(f.gm, a, SB), GPUMEM_OK);
  CHECK_STATUS(gpumem_record_stream(f.gm, a, SB), GPUMEM_OK); /* twice: one use */
  release(&f, a);
  gpumem_stats_t s = stats(&f);
  CHECK(s.allocated_bytes[0].current == 0);
  CHECK_MSG(s.active_bytes[0].current == (int64_t)(5 * MIB) && s.active[0].current == 1,
            "%s: pending block not active: %lld", conf, (long long)s.active_bytes[0].current);
  CHECK(gpumem_allocation_size(f.gm, a) == 0);
  CHECK(dev(&f).calls[GPUMEM_CALL_event_record] == 1);
  /* Three mallocs query the event three times: still pending, so even a
   * request that a would fit exactly goes elsewhere. */
  char* other = alloc(&f, 5 * MIB, SA);
  CHECK_MSG(other != a, "%s: reused a block whose event is pending", conf);
  char* s1 = alloc(&f, 1000, SA);
  char* s2 = alloc(&f, 1000, SA);
  s = stats(&f);
  CHECK_MSG(s.active_bytes[0].current - s.allocated_bytes[0].current == (int64_t)(5 * MIB),
            "%s: the pending block was released early", conf);
  CHECK(dev(&f).calls[GPUMEM_CALL_event_query] == 3);
  /* The fourth query finds the work done; that same malloc reuses it. */
  char* again = alloc(&f, 5 * MIB, SA);
  CHECK_MSG(again == a, "%s: after the event completed, got %p, want %p", conf, (void*)again,
            (void*)a);
  s = stats(&f);
  CHECK(s.active_bytes[0].current == s.allocated_bytes[0].current);
  /* Free without other uses: back at once, no event. */
  release(&f, s1);
  CHECK(alloc(&f, 1000, SA) == s1);
  CHECK(dev(&f).calls[GPUMEM_CALL_event_record] == 1);
  (void)s2;
  (void)other;

  /* A pending free is synchronized by empty_cache. */
  CHECK_STATUS(gpumem_record_stream(f.gm, again, SC), GPUMEM_OK);
  release(&f, again);
  CHECK(stats(&f).active_bytes[0].current > stats(&f).allocated_bytes[0].current);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  s = stats(&f);
  CHECK(s.active_bytes[0].current == s.allocated_bytes[0].current);
  CHECK(s.num_sync_all_streams == 1);
  fx_done(&f);
}

/* A block struct outlives its uses: a block used on several other streams,
 * freed and reused many times, keeps one use array of its size (it once
 * doubled at every reuse until host memory ran out). */
static void test_record_stream_reuse(const char* conf) {
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  const gpumem_stream_t others[] = {SB, SC, (gpumem_stream_t)0xD0, (gpumem_stream_t)0xE0};
  char* first = NULL;
  for (int round = 0; round < 48; round++) {
    char* a = alloc(&f, 12 * MIB, SA);
    if (!first) first = a;
    CHECK_MSG(a == first, "%s: round %d: the freed block was not reused", conf, round);
    for (size_t k = 0; k < sizeof others / sizeof others[0]; k++)
      CHECK_STATUS(gpumem_record_stream(f.gm, a, others[k]), GPUMEM_OK);
    release(&f, a);
    CHECK_MSG(gpumem_check(f.gm) == 0, "%s: round %d: %s", conf, round, gpumem_last_error());
  }
  fx_done(&f);
}

typedef struct oom_cb {
  fx_t* f;
  void* to_free;
  int ret;
  int calls;
  size_t size;
  gpumem_stream_t stream;
} oom_cb_t;

static int on_oom(gpumem_t* gm, size_t size, gpumem_stream_t stream, void* arg) {
  oom_cb_t* cb = arg;
  CHECK(gm == cb->f->gm);
  cb->calls++;
  cb->size = size;
  cb->stream = stream;
  if (cb->to_free) {
    /* Called without the allocator's lock: freeing here must work. */
    CHECK_STATUS(gpumem_free(gm, cb->to_free), GPUMEM_OK);
    cb->to_free = NULL;
  }
  return cb->ret;
}

static void test_retry_ladder(void) {
  fx_t f = fx_new("policy:pytorch", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  CHECK_STATUS(gpumem_set_limit(f.gm, 40 * MIB), GPUMEM_OK);
  /* Whole 20 MiB segments, so that no free tail can serve what follows. */
  char* b = alloc(&f, 20 * MIB, SB);
  release(&f, b);          /* 20 MiB cached on B */
  alloc(&f, 20 * MIB, SA); /* 20 MiB on A: at the limit */
  gpumem_stats_t s0 = stats(&f);
  CHECK(s0.reserved_bytes[0].current == (int64_t)(40 * MIB));
  /* A 12 MiB segment does not fit: B's cache goes, then it does. */
  char* a2 = alloc(&f, 12 * MIB, SA);
  gpumem_stats_t s1 = stats(&f);
  CHECK(s1.num_alloc_retries == s0.num_alloc_retries + 1);
  CHECK(s1.num_ooms == s0.num_ooms);
  CHECK(s1.reserved_bytes[0].current == (int64_t)(32 * MIB));
  CHECK(dev(&f).bytes_in_use == 32 * MIB);
  CHECK(s1.num_device_free == s0.num_device_free + 1);

  /* Nothing cached left: a 16 MiB segment needs an OOM callback. It frees
   * a2 and asks for another try, which succeeds. */
  oom_cb_t cb = {&f, a2, 1, 0, 0, 0};
  CHECK_STATUS(gpumem_add_oom_callback(f.gm, on_oom, &cb), GPUMEM_OK);
  char* a3 = alloc(&f, 16 * MIB, SA);
  gpumem_stats_t s2 = stats(&f);
  CHECK(a3 != NULL);
  CHECK(cb.calls == 1 && cb.size == 16 * MIB && cb.stream == SA);
  CHECK(s2.num_oom_callbacks == s1.num_oom_callbacks + 1);
  CHECK(s2.num_ooms == s1.num_ooms);
  CHECK(s2.num_alloc_retries > s1.num_alloc_retries);
  CHECK(s2.reserved_bytes[0].current == (int64_t)(36 * MIB));

  /* Final failure: the callback frees nothing and declines. */
  cb.ret = 0;
  void* p = (void*)1;
  gpumem_set_last_error("%s", "");
  gpumem_status_t st = gpumem_malloc(f.gm, 30 * MIB, SA, &p);
  CHECK_STATUS(st, GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(p == NULL);
  CHECK(cb.calls == 2);
  gpumem_stats_t s3 = stats(&f);
  CHECK(s3.num_ooms == s2.num_ooms + 1);
  const char* msg = gpumem_last_error();
  CHECK_MSG(strstr(msg, "out of memory") && strstr(msg, "31457280") && strstr(msg, "40.00 MiB"),
            "OOM report lacks the words, the size or the limit: %s", msg);
  /* The failure changed nothing. */
  CHECK(s3.allocation[0].current == s2.allocation[0].current);
  CHECK(s3.reserved_bytes[0].current == s2.reserved_bytes[0].current);
  /* A callback that asks again but frees nothing: still one OOM. */
  cb.ret = 1;
  CHECK_STATUS(gpumem_malloc(f.gm, 30 * MIB, SA, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(stats(&f).num_ooms == s3.num_ooms + 1);
  fx_done(&f);

  /* default: an OOM callback freeing a live block lets the retry map its
   * pages. */
  f = fx_new("policy:default", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  CHECK_STATUS(gpumem_set_limit(f.gm, 32 * MIB), GPUMEM_OK);
  char* big = alloc(&f, 24 * MIB, SA);
  oom_cb_t cb2 = {&f, big, 1, 0, 0, 0};
  CHECK_STATUS(gpumem_add_oom_callback(f.gm, on_oom, &cb2), GPUMEM_OK);
  char* next = alloc(&f, 16 * MIB, SB);
  CHECK(next != NULL && cb2.calls == 1);
  CHECK(reserved(&f) <= (int64_t)(32 * MIB));
  fx_done(&f);
}

static void test_empty_cache(void) {
  fx_t f = fx_new("policy:pytorch", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* a = alloc(&f, 5 * MIB, SA);  /* 20 MiB segment, stays (a is live) */
  char* b = alloc(&f, 16 * MIB, SA); /* 16 MiB segment (a's 15 MiB tail is too small) */
  char* c = alloc(&f, 1000, SB);     /* 2 MiB segment, stays */
  char* d = alloc(&f, 30 * MIB, SB); /* 30 MiB segment */
  release(&f, b);
  release(&f, d);
  CHECK(reserved(&f) == (int64_t)(68 * MIB));
  gpumem_stats_t s0 = stats(&f);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  gpumem_stats_t s1 = stats(&f);
  CHECK_MSG(s1.reserved_bytes[0].current == (int64_t)(22 * MIB),
            "after empty_cache reserved %lld, want the 22 MiB live blocks need",
            (long long)s1.reserved_bytes[0].current);
  CHECK(dev(&f).bytes_in_use == 22 * MIB && dev(&f).plain_live == 2);
  CHECK(s1.segment[0].current == 2);
  CHECK(s1.num_device_free == s0.num_device_free + 2);
  release(&f, a);
  release(&f, c);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  CHECK(reserved(&f) == 0 && dev(&f).bytes_in_use == 0 && stats(&f).segment[0].current == 0);
  fx_done(&f);

  /* default, one page per mapping: free pages are unmapped and released;
   * pages still under live blocks stay. (Larger mappings:
   * test_mappings.) */
  f = fx_new("policy:default,map_max:2M", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  a = alloc(&f, 6 * MIB, SA);
  b = alloc(&f, 6 * MIB, SA);
  release(&f, a);
  CHECK(dev(&f).pages_live == 6 && reserved(&f) == (int64_t)(12 * MIB));
  s0 = stats(&f);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  s1 = stats(&f);
  gpumem_sim_counters_t c1 = dev(&f);
  CHECK_MSG(c1.pages_live == 3 && c1.pages_mapped == 3 && c1.bytes_in_use == 6 * MIB,
            "default empty_cache: %llu pages live, %llu mapped", (unsigned long long)c1.pages_live,
            (unsigned long long)c1.pages_mapped);
  CHECK(s1.reserved_bytes[0].current == (int64_t)(6 * MIB));
  CHECK(s1.num_pages_unmapped == s0.num_pages_unmapped + 3);
  /* The unmapped range maps again on demand. */
  CHECK(alloc(&f, 6 * MIB, SA) == a);
  CHECK(dev(&f).pages_mapped == 6);
  fx_done(&f);
}

static void test_limit_fraction(const char* conf) {
  fx_t f = fx_new(conf, 1 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  CHECK_STATUS(gpumem_set_limit_fraction(f.gm, 0.25), GPUMEM_OK);
  CHECK(gpumem_get_limit(f.gm) == 256 * MIB);
  CHECK(stats(&f).limit_bytes == 256 * MIB);
  alloc(&f, 200 * MIB, SA);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, 100 * MIB, SA, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(reserved(&f) <= (int64_t)(256 * MIB));
  CHECK_STATUS(gpumem_set_limit_fraction(f.gm, 1.0), GPUMEM_OK);
  CHECK(gpumem_get_limit(f.gm) == GIB);
  alloc(&f, 100 * MIB, SA);
  fx_done(&f);

  /* At creation: the fraction, and with a byte limit too the smaller. */
  char buf[128];
  snprintf(buf, sizeof buf, "%s,fraction:0.5", conf);
  f = fx_new(buf, 1 * GIB, 0);
  if (f.gm) CHECK(gpumem_get_limit(f.gm) == 512 * MIB);
  fx_done(&f);
  snprintf(buf, sizeof buf, "%s,fraction:0.5,limit:100M", conf);
  f = fx_new(buf, 1 * GIB, 0);
  if (f.gm) CHECK(gpumem_get_limit(f.gm) == 100 * MIB);
  fx_done(&f);
  snprintf(buf, sizeof buf, "%s,fraction:0.05,limit:100M", conf);
  f = fx_new(buf, 1 * GIB, 0);
  if (f.gm) CHECK(gpumem_get_limit(f.gm) == (size_t)(0.05 * (double)GIB));
  fx_done(&f);
}

/* max_split_size_mb:20: a cached 40 MiB block is not split for a 5 MiB
 * request (a new segment is made instead), and a request of at least 20
 * MiB takes it only whole and only when it is less than 20 MiB too big. */
static void test_max_split_size(void) {
  /* The simplest case first: a 5 MiB request takes a new 20 MiB segment,
   * which is itself at least max_split_size. PyTorch hands out the block
   * of a segment it just made without searching again, so this works. */
  fx_t f0 = fx_new("policy:pytorch,max_split_size_mb:20", 8 * GIB, 0);
  if (f0.gm) {
    void* p = NULL;
    CHECK_STATUS(gpumem_malloc(f0.gm, 5 * MIB, SA, &p), GPUMEM_OK);
    CHECK(reserved(&f0) == (int64_t)(20 * MIB));
  }
  fx_done(&f0);
  for (int limited = 0; limited < 2; limited++) {
    fx_t f = fx_new(limited ? "policy:pytorch,max_split_size_mb:20" : "policy:pytorch", 8 * GIB, 0);
    if (!f.gm) return fx_done(&f);
    char* big = alloc(&f, 40 * MIB, SA);
    release(&f, big);
    char* small = alloc(&f, 5 * MIB, SA);
    if (limited) {
      CHECK_MSG(small != big && reserved(&f) == (int64_t)(60 * MIB),
                "max_split_size: the 40 MiB block was split for 5 MiB (reserved %lld)",
                (long long)reserved(&f));
    } else {
      CHECK(small == big && reserved(&f) == (int64_t)(40 * MIB));
    }
    char* mid = alloc(&f, 25 * MIB, SA);
    gpumem_stats_t s = stats(&f);
    if (limited) {
      /* 40 < 25 + 20: the oversize block serves, unsplit */
      CHECK(mid == big);
      CHECK_MSG(s.allocated_bytes[GPUMEM_POOL_LARGE].current == (int64_t)(45 * MIB),
                "allocated %lld, want 40 MiB whole + 5 MiB",
                (long long)s.allocated_bytes[GPUMEM_POOL_LARGE].current);
      release(&f, mid);
      /* 40 >= 19 + 20: too big to waste on this one: a new segment */
      char* m2 = alloc(&f, 19 * MIB, SA);
      CHECK(m2 != big);
    }
    fx_done(&f);
  }
}

/* ---- default policy ---- */

static void test_pages_on_demand(void) {
  fx_t f = fx_new("policy:default,map_max:2M", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  gpumem_stats_t s = stats(&f);
  CHECK(s.virtual_memory == 1 && s.page_size == 2 * MIB);
  CHECK(s.reserved_bytes[0].current == 0 && s.num_pages_mapped == 0);
  alloc(&f, 5 * MIB, SA); /* pages 0..2 of the large arena */
  s = stats(&f);
  CHECK_MSG(s.num_pages_mapped == 3 && dev(&f).pages_mapped == 3,
            "5 MiB mapped %lld pages, want 3 (not the whole arena)", (long long)s.num_pages_mapped);
  CHECK(s.reserved_bytes[0].current == (int64_t)(6 * MIB));
  char* x = alloc(&f, 1000, SA); /* the small arena: one page */
  CHECK(stats(&f).num_pages_mapped == 4);
  char* y = alloc(&f, 1000, SA); /* the same page */
  CHECK(y == x + 1024);
  CHECK(stats(&f).num_pages_mapped == 4 && dev(&f).pages_live == 4);
  CHECK(stats(&f).reserved_bytes[GPUMEM_POOL_SMALL].current == (int64_t)(2 * MIB));
  fx_done(&f);
}

/* Under reclaim:pressure with best fit, growth under a block maps one physical
 * allocation per run of unmapped pages (up to map_max), which goes back
 * only whole; a limit or a refusal by the device turns growth to single
 * pages (as lazy reclaim always does: tested in the random tests). */
static void test_mappings(void) {
  fx_t f = fx_new("policy:default,reclaim:pressure,placement:bestfit,map_max:8M", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* a = alloc(&f, 5 * MIB, SA); /* pages 0..2: one mapping */
  gpumem_stats_t s = stats(&f);
  CHECK_MSG(s.num_pages_mapped == 3 && dev(&f).pages_mapped == 1 && dev(&f).pages_live == 1 &&
                s.num_device_alloc == 1,
            "5 MiB: %lld pages in %llu mappings, want 3 in 1", (long long)s.num_pages_mapped,
            (unsigned long long)dev(&f).pages_mapped);
  /* page 2 shared; 3..12: 10 pages = 4 + 4 + 2, and b follows a to the
   * tail with no free between (a run): its last mapping goes on over the
   * free pages above, up to map_max (13..14) */
  char* b = alloc(&f, 20 * MIB, SA);
  s = stats(&f);
  CHECK_MSG(s.num_pages_mapped == 15 && dev(&f).pages_mapped == 4,
            "then 20 MiB: %lld pages in %llu mappings, want 15 in 4", (long long)s.num_pages_mapped,
            (unsigned long long)dev(&f).pages_mapped);
  CHECK(s.reserved_bytes[0].current == (int64_t)(30 * MIB));
  /* a's free pages 0..1 share a mapping with page 2 under b, and the pages
   * ahead one with b's last: none goes */
  release(&f, a);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  CHECK_MSG(reserved(&f) == (int64_t)(30 * MIB) && dev(&f).pages_mapped == 4,
            "empty_cache with a mapping partly under a live block: reserved %lld",
            (long long)reserved(&f));
  CHECK_STATUS(gpumem_check(f.gm), GPUMEM_OK);
  /* explain says so: those four whole free pages are pinned, not
   * reclaimable; the free halves of pages 2 and 12 are hole edges */
  gpumem_explain_t ex;
  CHECK_STATUS(gpumem_explain(f.gm, &ex), GPUMEM_OK);
  CHECK_MSG(ex.cached_pinned == 8 * MIB && ex.cached_reclaimable == 0 &&
                ex.partial_pages_large == 2 * MIB &&
                ex.requested + ex.rounding + ex.partial_pages_large + ex.partial_pages_small +
                        ex.cached_reclaimable + ex.cached_pinned + ex.other_streams +
                        ex.spare_pages ==
                    ex.reserved,
            "explain with pages pinned by b's mappings: pinned %llu, reclaimable %llu, edges "
            "%llu bytes",
            (unsigned long long)ex.cached_pinned, (unsigned long long)ex.cached_reclaimable,
            (unsigned long long)ex.partial_pages_large);
  /* b freed too: everything goes, one unmap call for the run of mappings */
  uint64_t unmaps = dev(&f).calls[GPUMEM_CALL_unmap];
  release(&f, b);
  CHECK_STATUS(gpumem_explain(f.gm, &ex), GPUMEM_OK);
  CHECK_MSG(ex.cached_pinned == 0 && ex.cached_reclaimable == 30 * MIB,
            "explain with every block free: pinned %llu, reclaimable %llu bytes",
            (unsigned long long)ex.cached_pinned, (unsigned long long)ex.cached_reclaimable);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  CHECK(reserved(&f) == 0 && dev(&f).pages_live == 0 && dev(&f).bytes_in_use == 0);
  CHECK(dev(&f).calls[GPUMEM_CALL_unmap] == unmaps + 1);
  /* under a limit, single pages */
  CHECK_STATUS(gpumem_set_limit(f.gm, 1 * GIB), GPUMEM_OK);
  alloc(&f, 9 * MIB, SA);
  CHECK_MSG(dev(&f).pages_mapped == 5, "9 MiB under a limit: %llu mappings, want 5 pages",
            (unsigned long long)dev(&f).pages_mapped);
  CHECK_STATUS(gpumem_check(f.gm), GPUMEM_OK);
  fx_done(&f);

  /* planned placement keeps one page per mapping (a plan takes pages one
   * by one when it starts serving) */
  f = fx_new("policy:default,reclaim:pressure,placement:planned,map_max:8M", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  alloc(&f, 5 * MIB, SA);
  CHECK_MSG(dev(&f).pages_mapped == 3, "planned: 5 MiB in %llu mappings, want 3 single pages",
            (unsigned long long)dev(&f).pages_mapped);
  fx_done(&f);

  /* the device refuses a large piece: single pages from then on */
  f = fx_new("policy:default,reclaim:pressure,placement:bestfit,map_max:64M", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  gpumem_sim_fail(f.sim, GPUMEM_CALL_create_page, 0, 1, GPUMEM_ERR_OUT_OF_MEMORY);
  char* c = alloc(&f, 16 * MIB, SA); /* 8 pages in one piece: refused; then 8 single pages */
  CHECK(c != NULL);
  CHECK_MSG(dev(&f).pages_mapped == 8 && stats(&f).num_alloc_retries == 0,
            "after one refusal: %llu mappings for 8 pages, want 8 single pages",
            (unsigned long long)dev(&f).pages_mapped);
  CHECK_STATUS(gpumem_check(f.gm), GPUMEM_OK);
  fx_done(&f);
}

/* When the device refuses and the free memory left lies in whole pages of
 * mappings that live blocks share, the out-of-memory message says so and
 * how much, apart from partly used pages: empty_cache cannot give those
 * back, a cap from the start would have pinned none. */
static void test_oom_names_pinned_pages(void) {
  fx_t f = fx_new("policy:default,reclaim:pressure,placement:bestfit,map_max:8M", 32 * MIB, 0);
  if (!f.gm) return fx_done(&f);
  char* a = alloc(&f, 5 * MIB, SA);  /* pages 0..2, one mapping */
  char* b = alloc(&f, 20 * MIB, SA); /* page 2 shared, 3..12, and ahead to 14 */
  CHECK(a && b && reserved(&f) == (int64_t)(30 * MIB));
  release(&f, a); /* pages 0..1: whole, free, in the mapping under b's first page */
  void* p = NULL;
  gpumem_status_t st = gpumem_malloc(f.gm, 8 * MIB, SA, &p);
  const char* msg = gpumem_last_error();
  CHECK_MSG(st == GPUMEM_ERR_OUT_OF_MEMORY && p == NULL, "8 MiB on a 32 MiB device: %s",
            gpumem_strerror(st));
  CHECK_MSG(strstr(msg,
                   "Free memory sits in partly used pages (2.00 MiB) and in whole pages "
                   "whose mapping live blocks also lie on (8.00 MiB)") != NULL,
            "the message does not name the pinned pages: %s", msg);
  CHECK_STATUS(gpumem_check(f.gm), GPUMEM_OK);
  release(&f, b);
  fx_done(&f);
}

/* Reserved memory follows live bytes, not history: 100 x 3 MiB, every
 * other one freed, then 50 x 3 MiB again (into the holes), then 50 x 4 MiB
 * (which fit no hole, so pages move from the holes). */
static void test_reserved_tracks_live(const char* conf) {
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  const int64_t page = 2 * MIB;
  char* p[100];
  for (int i = 0; i < 100; i++) p[i] = alloc(&f, 3 * MIB, SA);
  for (int i = 0; i < 100; i += 2) release(&f, p[i]);
  for (int i = 0; i < 100; i += 2) p[i] = alloc(&f, 3 * MIB, SA);
  gpumem_stats_t s = stats(&f);
  int64_t live = s.allocated_bytes[0].current;
  CHECK(live == (int64_t)(300 * MIB));
  CHECK_MSG(s.reserved_bytes[0].current <= live + 2 * page,
            "%s: reserved %lld for %lld live after refilling the holes", conf,
            (long long)s.reserved_bytes[0].current, (long long)live);
  for (int i = 0; i < 100; i += 2) release(&f, p[i]);
  for (int i = 0; i < 50; i++) alloc(&f, 4 * MIB, SA);
  s = stats(&f);
  live = s.allocated_bytes[0].current;
  CHECK(live == (int64_t)(350 * MIB));
  if (strstr(conf, "pressure")) {
    /* Pressure reclaims only when the device or a limit refuses: without
     * one the history stays (300 MiB + 200 MiB), until a limit asks. */
    CHECK_MSG(s.reserved_bytes[0].current == (int64_t)(500 * MIB),
              "%s: reserved %lld without pressure, want the 500 MiB of history", conf,
              (long long)s.reserved_bytes[0].current);
    CHECK_STATUS(gpumem_set_limit(f.gm, 420 * MIB), GPUMEM_OK);
    s = stats(&f);
  }
  /* Each 3 MiB hole holds one whole page (reclaimable) and 1 MiB sharing
   * pages with live neighbours (not): 50 MiB of slack at most. Keeping the
   * history would hold 500 MiB. */
  CHECK_MSG(s.reserved_bytes[0].current <= live + 50 * (int64_t)MIB + 2 * page,
            "%s: reserved %lld for %lld live: pages did not move", conf,
            (long long)s.reserved_bytes[0].current, (long long)live);
  printf("%s: 100 x 3 MiB, half freed, +50 x 4 MiB: %lld MiB reserved for %lld MiB live\n", conf,
         (long long)(s.reserved_bytes[0].current / (int64_t)MIB), (long long)(live / (int64_t)MIB));
  fx_done(&f);
}

/* A limit just above the live bytes: new requests that fit no hole still
 * succeed, with pages reclaimed from the holes. */
static void test_limit_moves_pages(const char* conf) {
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  CHECK_STATUS(gpumem_set_limit(f.gm, 64 * MIB), GPUMEM_OK);
  char* p[10];
  for (int i = 0; i < 10; i++) p[i] = alloc(&f, 6 * MIB, SA); /* 60 MiB */
  /* (eager unmaps the holes' pages as they are freed; the others when the
   * limit presses) */
  gpumem_stats_t s0 = stats(&f);
  for (int i = 0; i < 10; i += 2) release(&f, p[i]); /* 30 MiB in 6 MiB holes */
  for (int i = 0; i < 4; i++) {
    void* q = NULL;
    gpumem_status_t st = gpumem_malloc(f.gm, 7 * MIB, SA, &q);
    CHECK_MSG(st == GPUMEM_OK, "%s: 7 MiB #%d under a 64 MiB limit with 58 MiB live: %s", conf, i,
              gpumem_last_error());
  }
  gpumem_stats_t s1 = stats(&f);
  CHECK(s1.allocated_bytes[0].current == (int64_t)(58 * MIB));
  CHECK(s1.reserved_bytes[0].current <= (int64_t)(64 * MIB));
  /* 28 MiB of new blocks within 4 MiB of new memory: pages moved */
  CHECK(s1.num_pages_mapped - s0.num_pages_mapped >= 14);
  CHECK(s1.num_ooms == 0);
  fx_done(&f);
}

/* Memory freed on stream A serves stream B under a limit, also while A's
 * block is still waiting for an event of a third stream. */
static void test_streams_share_pages(const char* conf) {
  fx_t f = fx_new(conf, 8 * GIB, 5);
  if (!f.gm) return fx_done(&f);
  CHECK_STATUS(gpumem_set_limit(f.gm, 32 * MIB), GPUMEM_OK);
  char* a = alloc(&f, 24 * MIB, SA);
  release(&f, a);
  char* b = alloc(&f, 24 * MIB, SB);
  CHECK(reserved(&f) <= (int64_t)(32 * MIB));
  release(&f, b);
  /* B's block used on C: freed, pending; A needs its pages. */
  b = alloc(&f, 24 * MIB, SB);
  CHECK_STATUS(gpumem_record_stream(f.gm, b, SC), GPUMEM_OK);
  release(&f, b);
  gpumem_stats_t s0 = stats(&f);
  void* q = NULL;
  gpumem_status_t st = gpumem_malloc(f.gm, 24 * MIB, SA, &q);
  CHECK_MSG(st == GPUMEM_OK, "%s: stream A could not use B's freed pages: %s", conf,
            gpumem_last_error());
  gpumem_stats_t s1 = stats(&f);
  CHECK(s1.reserved_bytes[0].current <= (int64_t)(32 * MIB));
  CHECK(s1.num_sync_all_streams > s0.num_sync_all_streams);
  fx_done(&f);
}

/* ---- throughput ---- */

/* ---- aliases: a partly used page shared by a request (pages.c) ---- */

/* Writes or verifies byte v over [addr, addr + n) of a host-backed sim. */
static int pattern(fx_t* f, const char* addr, size_t n, unsigned char v, int verify) {
  for (size_t off = 0; off < n;) {
    uintptr_t a = (uintptr_t)addr + off;
    size_t chunk = 2 * MIB - (a % (2 * MIB));
    if (chunk > n - off) chunk = n - off;
    unsigned char* h = gpumem_sim_host_ptr(f->sim, a);
    if (!h) return 0;
    for (size_t i = 0; i < chunk; i++) {
      if (!verify)
        h[i] = v;
      else if (h[i] != v)
        return 0;
    }
    off += chunk;
  }
  return 1;
}

/* Pages 0-3 hold x1 [0, 4 MiB) and x3 [5.5, 8 MiB); page 2's first 1.5 MiB
 * are a hole. Under a limit of 6 pages a 5 MiB request fits at the tail
 * only with its last page (ending 1 MiB in) shared with page 2. */
typedef struct alias_fx {
  fx_t f;
  char *x1, *x3;
} alias_fx_t;

static alias_fx_t alias_setup(int event_delay) {
  alias_fx_t a;
  memset(&a, 0, sizeof a);
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = 1 * GIB;
  so.host_backed = 1;
  so.event_delay_queries = event_delay;
  a.f.sim = gpumem_sim_create(&so);
  gpumem_options_t o;
  gpumem_options_init(&o);
  /* (single-page mappings: a page is aliased only where it is a mapping
   * of its own, as under the limit set below) */
  CHECK_STATUS(gpumem_options_parse(&o, "policy:default,placement:bestfit,map_max:2M"), GPUMEM_OK);
  gpumem_status_t st;
  a.f.gm = gpumem_create(a.f.sim, &o, &st);
  CHECK_MSG(a.f.gm != NULL, "create: %s", gpumem_last_error());
  if (!a.f.gm) return a;
  a.x1 = alloc(&a.f, 4 * MIB, SA);
  char* x2 = alloc(&a.f, 3 * MIB / 2, SA);
  a.x3 = alloc(&a.f, 5 * MIB / 2, SA);
  CHECK_MSG(x2 == a.x1 + 4 * MIB && a.x3 == x2 + 3 * MIB / 2 && (uintptr_t)a.x1 % (2 * MIB) == 0,
            "alias fixture: blocks not laid out as planned");
  release(&a.f, x2);
  CHECK_STATUS(gpumem_set_limit(a.f.gm, 12 * MIB), GPUMEM_OK);
  CHECK(pattern(&a.f, a.x1, 4 * MIB, 0x11, 0));
  return a;
}

static char* alias_alloc(alias_fx_t* a) {
  int64_t before = stats(&a->f).num_pages_aliased;
  CHECK(pattern(&a->f, a->x3, 5 * MIB / 2, 0x33, 0));
  char* r = alloc(&a->f, 5 * MIB, SA);
  CHECK_MSG(gpumem_check(a->f.gm) == 0, "alias: %s", gpumem_last_error());
  CHECK_MSG(r == a->x1 + 8 * MIB, "alias: the request is not at the tail");
  CHECK_MSG(stats(&a->f).num_pages_aliased == before + 1, "alias: no page was shared");
  CHECK_MSG(reserved(&a->f) == 12 * MIB, "alias: reserved %lld, want 6 pages",
            (long long)reserved(&a->f));
  /* The last MiB of r is page 2's first MiB; x3's bytes stay x3's. */
  CHECK(gpumem_sim_host_ptr(a->f.sim, (uintptr_t)(r + 4 * MIB)) ==
        gpumem_sim_host_ptr(a->f.sim, (uintptr_t)(a->x1 + 4 * MIB)));
  CHECK(pattern(&a->f, r, 5 * MIB, 0xAB, 0));
  CHECK_MSG(pattern(&a->f, a->x3, 5 * MIB / 2, 0x33, 1) && pattern(&a->f, a->x1, 4 * MIB, 0x11, 1),
            "alias: writing the request changed its neighbours' bytes");
  CHECK(pattern(&a->f, a->x3, 5 * MIB / 2, 0x34, 0));
  CHECK_MSG(pattern(&a->f, r, 5 * MIB, 0xAB, 1), "alias: writing x3 changed the request's bytes");
  return r;
}

static void alias_check(alias_fx_t* a, const char* when) {
  CHECK_MSG(gpumem_check(a->f.gm) == 0, "alias, %s: %s", when, gpumem_last_error());
}

static void test_alias(void) {
  /* Freed first, allocated again (its last page is a ghost now, of a page
   * still busy where it lives: shared again), then its neighbour first. */
  alias_fx_t a = alias_setup(0);
  if (!a.f.gm) return fx_done(&a.f);
  char* r = alias_alloc(&a);
  release(&a.f, r);
  alias_check(&a, "request freed");
  r = alias_alloc(&a);
  release(&a.f, a.x3);
  alias_check(&a, "the shared page's other user freed");
  release(&a.f, r);
  alias_check(&a, "both freed");
  release(&a.f, a.x1);
  CHECK_STATUS(gpumem_empty_cache(a.f.gm), GPUMEM_OK);
  alias_check(&a, "emptied");
  CHECK_MSG(reserved(&a.f) == 0, "alias: %lld bytes reserved after empty_cache",
            (long long)reserved(&a.f));
  fx_done(&a.f);

  /* Freed while another stream still uses it (record_stream): pending,
   * then freed with its alias when the event completes. */
  a = alias_setup(2);
  if (!a.f.gm) return fx_done(&a.f);
  r = alias_alloc(&a);
  CHECK_STATUS(gpumem_record_stream(a.f.gm, r, SB), GPUMEM_OK);
  release(&a.f, r);
  alias_check(&a, "pending");
  for (int i = 0; i < 6; i++) release(&a.f, alloc(&a.f, 512, SA)); /* queries the event */
  alias_check(&a, "pending, completed");
  release(&a.f, a.x3);
  release(&a.f, a.x1);
  fx_done(&a.f);

  /* Still allocated at gpumem_destroy: every page goes back once (fx_done
   * checks the device holds nothing). */
  a = alias_setup(0);
  if (!a.f.gm) return fx_done(&a.f);
  alias_alloc(&a);
  fx_done(&a.f);

  /* The device fails the shared page's mapping: a clean error, nothing
   * held for it, and the next try succeeds. */
  a = alias_setup(0);
  if (!a.f.gm) return fx_done(&a.f);
  gpumem_sim_fail(a.f.sim, GPUMEM_CALL_map, 2, 1, GPUMEM_ERR_BACKEND);
  void* p = NULL;
  gpumem_status_t st = gpumem_malloc(a.f.gm, 5 * MIB, SA, &p);
  CHECK_MSG(st == GPUMEM_ERR_BACKEND && !p, "alias, failed map: %s", gpumem_strerror(st));
  alias_check(&a, "failed map");
  CHECK_MSG(stats(&a.f).num_pages_aliased == 0, "alias: counted though it failed");
  gpumem_sim_fail_clear(a.f.sim);
  r = alias_alloc(&a);
  release(&a.f, r);
  release(&a.f, a.x1);
  release(&a.f, a.x3);
  fx_done(&a.f);
}

/* ---- planned placement ---- */

typedef struct live_set {
  char* p[64];
  size_t size[64];
} live_set_t;

/* No two live blocks share a byte. */
static void check_disjoint(const live_set_t* l, const char* conf) {
  for (int i = 0; i < 64; i++) {
    for (int j = i + 1; j < 64 && l->p[i]; j++) {
      if (!l->p[j]) continue;
      int apart = l->p[i] + l->size[i] <= l->p[j] || l->p[j] + l->size[j] <= l->p[i];
      CHECK_MSG(apart, "%s: live blocks %d and %d overlap", conf, i, j);
    }
  }
}

/* One step of a training-like loop: a forward pass that keeps activations
 * for a backward pass freeing them in reverse, temporaries freed at once,
 * small and large requests mixed; `shift` changes the pattern. */
static void loop_step(fx_t* f, live_set_t* l, int shift, const char* conf) {
  static const size_t sizes[] = {3 * MIB,   40 * MIB, 512,     MIB + 512, 24 * MIB, 6 * MIB,
                                 700 * KIB, 9 * MIB,  2 * KIB, 17 * MIB,  5 * MIB,  64 * KIB};
  const int n = 12;
  for (int k = 0; k < n; k++) {
    size_t act = sizes[(k + shift) % n] + (size_t)shift * 4096;
    l->size[k] = act;
    l->p[k] = alloc(f, act, SA);
    l->size[32 + k] = sizes[(k * 5 + 3) % n];
    l->p[32 + k] = alloc(f, l->size[32 + k], SA); /* temporary */
    check_disjoint(l, conf);
    release(f, l->p[32 + k]);
    l->p[32 + k] = NULL;
  }
  for (int k = n; k-- > 0;) {
    l->size[16 + k] = sizes[(k + 7) % n] / 2 + 512; /* gradient, freed below */
    l->p[16 + k] = alloc(f, l->size[16 + k], SA);
    check_disjoint(l, conf);
    release(f, l->p[k]);
    l->p[k] = NULL;
  }
  for (int k = 0; k < n; k++) {
    release(f, l->p[16 + k]);
    l->p[16 + k] = NULL;
  }
}

static void test_planned_loop(const char* conf) {
  int planned = strstr(conf, "placement:planned") != NULL;
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  live_set_t l;
  memset(&l, 0, sizeof l);
  char* weights[8];
  for (int i = 0; i < 8; i++) weights[i] = alloc(&f, 7 * MIB + (size_t)i * 512, SA);
  for (int it = 0; it < 50; it++) {
    loop_step(&f, &l, 0, conf);
    if (it % 10 == 9) CHECK_MSG(gpumem_check(f.gm) == 0, "%s: %s", conf, gpumem_last_error());
  }
  gpumem_stats_t s = stats(&f);
  CHECK_MSG(!planned || (s.num_plans >= 1 && s.num_planned_allocs > 0),
            "%s: the loop was not planned (%lld plans)", conf, (long long)s.num_plans);
  /* Served by the plan for most of the run. */
  CHECK_MSG(!planned || s.num_planned_allocs > 30 * 36, "%s: only %lld allocations planned", conf,
            (long long)s.num_planned_allocs);
  /* Reserved memory after the loop: the pages under the weights and the
   * plan's extent, which packs a step into little more than its peak. */
  gpumem_reset_peak_stats(f.gm);
  for (int it = 0; it < 5; it++) loop_step(&f, &l, 0, conf);
  s = stats(&f);
  int64_t peak_live = s.allocated_bytes[GPUMEM_POOL_ALL].peak;
  int64_t res = s.reserved_bytes[GPUMEM_POOL_ALL].peak;
  printf(
      "%s: planned loop: %lld planned allocations, reserved %.1f MiB for %.1f MiB peak live (%.4f "
      "x)\n",
      conf, (long long)s.num_planned_allocs, (double)res / (double)MIB,
      (double)peak_live / (double)MIB, (double)res / (double)peak_live);
  /* Pages are 2 MiB: the plan's extent and the weights' last page round
   * up, and a few pages sit at the edges of small blocks. */
  CHECK_MSG(!planned || res <= peak_live + 6 * 2 * (int64_t)MIB,
            "%s: reserved %lld for peak live %lld", conf, (long long)res, (long long)peak_live);
  /* The pattern changes: the plan falls off, the new loop stays correct
   * and is planned in turn. */
  int64_t drops = s.num_plan_drops, plans = s.num_plans;
  for (int it = 0; it < 40; it++) {
    loop_step(&f, &l, 1 + it / 20, conf);
    if (it % 5 == 4) CHECK_MSG(gpumem_check(f.gm) == 0, "%s: %s", conf, gpumem_last_error());
  }
  s = stats(&f);
  CHECK_MSG(!planned || s.num_plan_drops > drops,
            "%s: the plan was not dropped when the pattern changed", conf);
  CHECK_MSG(!planned || s.num_plans > plans, "%s: the new pattern was not planned", conf);
  /* empty_cache forgets the plan and gives back what is free. */
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  CHECK_MSG(gpumem_check(f.gm) == 0, "%s: %s", conf, gpumem_last_error());
  for (int i = 0; i < 8; i++) release(&f, weights[i]);
  fx_done(&f);
}

/* A loop on two streams. Apart: stream B's buffers are freed before stream
 * A's peak, so an arena per stream (each holding its own stream's peak)
 * would hold B's peak on top of A's: the plan is declined and reserved
 * memory stays near the loop's peak live. Together: B's buffers live
 * through A's peak, the arenas hold no more than the loop has live, and
 * the loop is planned. */
static void test_planned_streams(const char* conf, int apart) {
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* weights = alloc(&f, 96 * MIB, SA);
  for (int it = 0; it < 60; it++) {
    char* side[6];
    for (int k = 0; k < 6; k++) side[k] = alloc(&f, (20 + 4 * (size_t)k) * MIB, SB);
    if (apart)
      for (int k = 5; k >= 0; k--) release(&f, side[k]);
    char* acts[8];
    for (int k = 0; k < 8; k++) acts[k] = alloc(&f, (40 + 8 * (size_t)k) * MIB + 512, SA);
    for (int k = 7; k >= 0; k--) release(&f, acts[k]);
    if (!apart)
      for (int k = 5; k >= 0; k--) release(&f, side[k]);
    if (it % 10 == 9) CHECK_MSG(gpumem_check(f.gm) == 0, "%s: %s", conf, gpumem_last_error());
  }
  gpumem_stats_t s = stats(&f);
  int64_t peak_live = s.allocated_bytes[GPUMEM_POOL_ALL].peak;
  int64_t res = s.reserved_bytes[GPUMEM_POOL_ALL].peak;
  uint64_t waits = dev(&f).calls[GPUMEM_CALL_stream_wait];
  printf(
      "%s: two streams %s: %lld plans (%lld shared), %lld dropped, %lld declined, %llu stream "
      "waits, reserved %.4f x peak live\n",
      conf, apart ? "apart" : "together", (long long)s.num_plans, (long long)s.num_plans_shared,
      (long long)s.num_plan_drops, (long long)s.num_plans_declined, (unsigned long long)waits,
      (double)res / (double)peak_live);
  int waits_allowed = strstr(conf, "stream_waits:off") == NULL;
  if (apart && waits_allowed) {
    /* One arena for both streams: B's blocks reuse A's memory and back,
     * each handoff a stream wait (at most two per request of B: its take
     * and its free), never a host synchronization. */
    CHECK_MSG(s.num_plans == 1 && s.num_plans_shared == 1 && s.num_planned_allocs > 40 * 14,
              "%s: streams apart: %lld plans (%lld shared), %lld planned", conf,
              (long long)s.num_plans, (long long)s.num_plans_shared,
              (long long)s.num_planned_allocs);
    CHECK_MSG(waits > 0 && waits <= 2 * 6 * 60, "%s: streams apart: %llu stream waits", conf,
              (unsigned long long)waits);
    CHECK_MSG((double)res <= (double)peak_live * 1.01, "%s: streams apart: reserved %.4f x", conf,
              (double)res / (double)peak_live);
  } else if (apart) {
    CHECK_MSG(s.num_plans == 0 && s.num_plans_declined >= 1,
              "%s: streams apart: %lld plans, %lld declined", conf, (long long)s.num_plans,
              (long long)s.num_plans_declined);
    /* B's peak is 180 MiB: held on top of A's 640, reserved would pass 1.2 x
     * (1.2906 x before plans were declined). */
    CHECK_MSG((double)res <= (double)peak_live * 1.01, "%s: streams apart: reserved %.4f x", conf,
              (double)res / (double)peak_live);
  } else {
    /* The loop is 14 requests, shorter than the shortest period looked
     * for: planned as 28, then confirmed as 42, 56, ... of the same loop,
     * which must not be rebuilt (8 plans, each with a new arena, before). */
    CHECK_MSG(s.num_plans == 1 && s.num_plans_declined == 0 && s.num_planned_allocs > 30 * 14,
              "%s: streams together: %lld plans, %lld declined, %lld planned", conf,
              (long long)s.num_plans, (long long)s.num_plans_declined,
              (long long)s.num_planned_allocs);
  }
  release(&f, weights);
  CHECK_MSG(gpumem_check(f.gm) == 0, "%s: %s", conf, gpumem_last_error());
  fx_done(&f);
}

/* The waits of a shared arena, counted: a stream that takes memory waits
 * for the arena's stream unless nothing but its own blocks was freed since
 * it last waited. B's second block of a step follows the free of its first
 * (used on B alone): no wait. Recorded on A (the arena's stream) before its
 * free, the first block was A's too: B's next take must wait. */
static void test_shared_take_waits(void) {
  fx_t f = fx_new(HOLD, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* weights = alloc(&f, 96 * MIB, SA);
  uint64_t waits[3] = {0, 0, 0};
  for (int it = 0; it < 63; it++) {
    uint64_t before = dev(&f).calls[GPUMEM_CALL_stream_wait];
    char* x = alloc(&f, 20 * MIB, SB);
    if (it == 62) CHECK(gpumem_record_stream(f.gm, x, SA) == GPUMEM_OK);
    release(&f, x);
    char* y = alloc(&f, 24 * MIB, SB);
    release(&f, y);
    char* acts[8];
    for (int k = 0; k < 8; k++) acts[k] = alloc(&f, (40 + 8 * (size_t)k) * MIB + 512, SA);
    for (int k = 7; k >= 0; k--) release(&f, acts[k]);
    if (it >= 60) waits[it - 60] = dev(&f).calls[GPUMEM_CALL_stream_wait] - before;
  }
  gpumem_stats_t s = stats(&f);
  printf(
      "shared take waits: %lld shared plans; stream waits per step %llu, %llu, then %llu with "
      "B's first block recorded on A\n",
      (long long)s.num_plans_shared, (unsigned long long)waits[0], (unsigned long long)waits[1],
      (unsigned long long)waits[2]);
  CHECK_MSG(s.num_plans_shared == 1 && s.num_plans == 1, "%lld plans, %lld shared",
            (long long)s.num_plans, (long long)s.num_plans_shared);
  /* a step: x's take, x's free, y's free (y's take skips the wait) */
  CHECK_MSG(waits[0] == 3 && waits[1] == 3, "steady steps wait %llu and %llu times, not 3",
            (unsigned long long)waits[0], (unsigned long long)waits[1]);
  CHECK_MSG(waits[2] == 4, "with x recorded on A, y's take must wait: %llu waits, not 4",
            (unsigned long long)waits[2]);
  release(&f, weights);
  CHECK_MSG(gpumem_check(f.gm) == 0, "%s", gpumem_last_error());
  fx_done(&f);
}

/* Device calls between two readings that lending may make: pages
 * created, stream waits, host synchronizations (stream or event). */
typedef struct lend_calls {
  uint64_t made, waits, syncs;
} lend_calls_t;
static lend_calls_t lend_calls(const gpumem_sim_counters_t* before,
                               const gpumem_sim_counters_t* after) {
  lend_calls_t d;
  d.made = after->calls[GPUMEM_CALL_create_page] - before->calls[GPUMEM_CALL_create_page];
  d.waits = after->calls[GPUMEM_CALL_stream_wait] - before->calls[GPUMEM_CALL_stream_wait];
  d.syncs = after->calls[GPUMEM_CALL_stream_sync] + after->calls[GPUMEM_CALL_event_sync] -
            before->calls[GPUMEM_CALL_stream_sync] - before->calls[GPUMEM_CALL_event_sync];
  return d;
}

/* Uncapped, a large request of a stream whose arena would have to grow
 * borrows a free block of another stream's arena whose pages are mapped,
 * once that stream's work up to its last free is known over: an event
 * recorded on it, queried (the simulated device completes it at its first
 * query). No mapping, and no stream waits for another. Freed, the block
 * waits for an event of the borrower before its lender reuses it. A
 * lender that freed something since its probe is asked again (a new
 * probe). By default (lend:off), or under a limit (pages move one at a
 * time there), the borrower's arena grows. */
static void test_streams_lend(const char* conf, bool lends) {
  fx_t f = fx_new(conf, 64 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* a1 = alloc(&f, 64 * MIB, SA);
  char* a2 = alloc(&f, 64 * MIB, SA);
  char* b1 = alloc(&f, 96 * MIB, SB);
  char* b2 = alloc(&f, 64 * MIB, SB);
  release(&f, a1); /* A: a mapped 64 MiB hole */
  release(&f, b1); /* B: a mapped 96 MiB hole */
  gpumem_sim_counters_t before = dev(&f);
  char* u1 = alloc(&f, 64 * MIB, SC);
  gpumem_sim_counters_t after = dev(&f);
  lend_calls_t d = lend_calls(&before, &after);
  uint64_t made = d.made, waits = d.waits, syncs = d.syncs;
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  CHECK_MSG(waits == 0 && syncs == 0, "%s: lending waited: %llu stream waits, %llu syncs", conf,
            (unsigned long long)waits, (unsigned long long)syncs);
  if (!lends) {
    CHECK_MSG(u1 != a1 && made >= 1 && stats(&f).num_blocks_lent == 0,
              "%s: C took A's hole (%d), %llu mappings", conf, u1 == a1, (unsigned long long)made);
    release(&f, u1);
    release(&f, a2);
    release(&f, b2);
    return fx_done(&f);
  }
  CHECK_MSG(u1 == a1 && made == 0 && stats(&f).num_blocks_lent == 1,
            "%s: C's block at A's hole: %d; %llu mappings, %lld lent", conf, u1 == a1,
            (unsigned long long)made, (long long)stats(&f).num_blocks_lent);
  /* Reports name the stream it was allocated on: a2 on A, b2 on B and u1
   * on C are three groups of one size and stream, not two. */
  gpumem_leaks_t leaks = {.struct_size = sizeof leaks};
  CHECK_STATUS(gpumem_find_leaks(f.gm, 0, &leaks), GPUMEM_OK);
  CHECK_MSG(leaks.count == 3 && leaks.groups == 3,
            "%s: %llu live in %llu groups of one size and stream, not 3 in 3", conf,
            (unsigned long long)leaks.count, (unsigned long long)leaks.groups);
  char* u2 = alloc(&f, 96 * MIB, SC); /* only B's hole holds it */
  CHECK_MSG(u2 == b1, "C's second block not at B's hole");
  /* Freed, C's block is A's again only after an event of C: pending until
   * the next allocation queries it. Under lend:ordered it is free at once
   * and A, allocating next, waits for C on the device first. */
  const bool ordered = strstr(conf, "lend:ordered") != NULL;
  uint64_t records = dev(&f).calls[GPUMEM_CALL_event_record];
  release(&f, u1);
  CHECK_MSG(dev(&f).calls[GPUMEM_CALL_event_record] - records == (ordered ? 0 : 1),
            "%s: freeing a lent block recorded %llu events", conf,
            (unsigned long long)(dev(&f).calls[GPUMEM_CALL_event_record] - records));
  CHECK_MSG(stats(&f).active_bytes[GPUMEM_POOL_ALL].current ==
                (int64_t)(64 * MIB + 96 * MIB + 64 * MIB + (ordered ? 0 : 64 * MIB)),
            "%s: a lent block freed is %s: active %lld", conf, ordered ? "pending" : "not pending",
            (long long)stats(&f).active_bytes[GPUMEM_POOL_ALL].current);
  uint64_t waits_before = dev(&f).calls[GPUMEM_CALL_stream_wait];
  char* a3 = alloc(&f, 64 * MIB, SA); /* A takes its hole back */
  CHECK_MSG(a3 == a1, "A did not take its hole back");
  CHECK_MSG(dev(&f).calls[GPUMEM_CALL_stream_wait] - waits_before == (ordered ? 1 : 0),
            "%s: A took back what C freed after %llu stream waits", conf,
            (unsigned long long)(dev(&f).calls[GPUMEM_CALL_stream_wait] - waits_before));
  release(&f, b2); /* B frees its own, at its top: its probe is stale */
  records = dev(&f).calls[GPUMEM_CALL_event_record];
  char* u3 = alloc(&f, 64 * MIB, SC);
  CHECK_MSG(u3 == b2 && dev(&f).calls[GPUMEM_CALL_event_record] - records == 1,
            "C taking what B freed since its probe: at b2 %d, %llu events recorded, not 1",
            u3 == b2, (unsigned long long)(dev(&f).calls[GPUMEM_CALL_event_record] - records));
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  release(&f, u2);
  release(&f, u3);
  release(&f, a2);
  release(&f, a3);
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  fx_done(&f);
}

/* Where the lender's probe is not complete yet (its stream still at
 * work), lend:ordered lends all the same: the borrower waits on the device
 * for the lender's work up to its probe (one stream wait, no host wait),
 * and a second borrow from the same lender with no free since needs no new
 * wait. lend:on grows instead, as does lend:ordered with stream_waits:off
 * (nothing to order with). */
static void test_streams_lend_ordered(const char* conf, bool lends) {
  fx_t f = fx_new(conf, 64 * GIB, 1000); /* events complete after 1000 queries */
  if (!f.gm) return fx_done(&f);
  char* a1 = alloc(&f, 64 * MIB, SA);
  char* a2 = alloc(&f, 64 * MIB, SA);
  char* a3 = alloc(&f, 32 * MIB, SA);
  char* a4 = alloc(&f, 64 * MIB, SA);
  release(&f, a1);
  release(&f, a3); /* A: mapped holes of 64 and 32 MiB */
  gpumem_sim_counters_t before = dev(&f);
  char* u1 = alloc(&f, 64 * MIB, SC);
  char* u2 = alloc(&f, 32 * MIB, SC);
  gpumem_sim_counters_t after = dev(&f);
  lend_calls_t d = lend_calls(&before, &after);
  uint64_t made = d.made, waits = d.waits, syncs = d.syncs;
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  CHECK_MSG(syncs == 0, "%s: lending synchronized %llu times", conf, (unsigned long long)syncs);
  if (lends) {
    CHECK_MSG(u1 == a1 && u2 == a3 && made == 0 && waits == 1 && stats(&f).num_blocks_lent == 2,
              "%s: C at A's holes: %d %d; %llu mappings, %llu stream waits, %lld lent", conf,
              u1 == a1, u2 == a3, (unsigned long long)made, (unsigned long long)waits,
              (long long)stats(&f).num_blocks_lent);
    /* C frees one and takes it again: its own stream order, no call */
    uint64_t calls0 =
        dev(&f).calls[GPUMEM_CALL_stream_wait] + dev(&f).calls[GPUMEM_CALL_event_record];
    release(&f, u1);
    u1 = alloc(&f, 64 * MIB, SC);
    uint64_t calls1 =
        dev(&f).calls[GPUMEM_CALL_stream_wait] + dev(&f).calls[GPUMEM_CALL_event_record];
    CHECK_MSG(u1 == a1 && calls1 == calls0,
              "%s: C took back what it freed: at a1 %d, after %llu waits and records", conf,
              u1 == a1, (unsigned long long)(calls1 - calls0));
    /* A frees again: the next borrow waits again */
    release(&f, a2);
    uint64_t w0 = dev(&f).calls[GPUMEM_CALL_stream_wait];
    char* u3 = alloc(&f, 64 * MIB, SC);
    CHECK_MSG(u3 == a2 && dev(&f).calls[GPUMEM_CALL_stream_wait] - w0 == 1,
              "%s: C taking what A freed since its wait: at a2 %d, %llu stream waits, not 1", conf,
              u3 == a2, (unsigned long long)(dev(&f).calls[GPUMEM_CALL_stream_wait] - w0));
    release(&f, u3);
  } else {
    CHECK_MSG(u1 != a1 && u2 != a3 && made >= 1 && waits == 0 && stats(&f).num_blocks_lent == 0,
              "%s: C took A's holes (%d %d), %llu mappings, %llu waits", conf, u1 == a1, u2 == a3,
              (unsigned long long)made, (unsigned long long)waits);
    release(&f, a2);
  }
  release(&f, u1);
  release(&f, u2);
  release(&f, a4);
  CHECK_MSG(gpumem_check(f.gm) == 0, "gpumem_check: %s", gpumem_last_error());
  fx_done(&f);
}

/* A workload that repeats only after a long stretch that never does: past
 * GM_PLAN_SAMPLE_AFTER (16384) requests without a plan, detection consults
 * its table for one context in eight, and from GM_PLAN_IDLE_AFTER (65536)
 * it runs in turns: on turns of 16384 requests, off turns after each that
 * double from 16384 up to 16 turns. With this test's own requests
 * (counted from the allocator's first): on 65536-81920, off 81920-98304,
 * on 98304-114688, off 114688-147456, on 147456-163840, off 163840-229376.
 * The loop (36 requests a step) must still be found, in the next on turn
 * at the latest; where `planned` is false, the steps end inside an off
 * turn and no plan may be built (the turn really is off, and as long as
 * the schedule says). */
static void test_planned_after_noise(const char* conf, int noise, int steps, bool planned) {
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* held[4] = {NULL, NULL, NULL, NULL};
  uint64_t x = 88172645463325252ull;
  for (int i = 0; i < noise; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17; /* xorshift: sizes that never repeat in step */
    size_t size = 512 + (size_t)(x % (8 * MIB));
    int k = (int)((x >> 40) % 4);
    if (held[k]) release(&f, held[k]);
    held[k] = alloc(&f, size, SA);
  }
  for (int k = 0; k < 4; k++) release(&f, held[k]);
  CHECK_MSG(gpumem_check(f.gm) == 0, "%s: %s", conf, gpumem_last_error());
  gpumem_stats_t s = stats(&f);
  CHECK_MSG(s.num_plans == 0, "%s: %lld plans built from requests that never repeat", conf,
            (long long)s.num_plans);
  live_set_t l;
  memset(&l, 0, sizeof l);
  for (int it = 0; it < steps; it++) loop_step(&f, &l, 0, conf);
  CHECK_MSG(gpumem_check(f.gm) == 0, "%s: %s", conf, gpumem_last_error());
  s = stats(&f);
  if (planned) {
    CHECK_MSG(s.num_plans >= 1 && s.num_planned_allocs > 10 * 36,
              "%s: after %d unrepeated requests the loop was not planned in %d steps (%lld "
              "plans, %lld planned allocations)",
              conf, noise, steps, (long long)s.num_plans, (long long)s.num_planned_allocs);
  } else {
    CHECK_MSG(s.num_plans == 0,
              "%s: a loop of %d steps after %d unrepeated requests, inside an off turn, was "
              "planned (%lld plans)",
              conf, steps, noise, (long long)s.num_plans);
  }
  fx_done(&f);
}

/* Page moves so far: maps of pages that already existed (created pages are
 * mapped once by the call that creates them). */
static int64_t page_moves(fx_t* f) {
  gpumem_stats_t s = stats(f);
  return (int64_t)s.backend_calls[GPUMEM_CALL_map] -
         (int64_t)s.backend_calls[GPUMEM_CALL_create_page];
}

/* Sizes over six orders of magnitude that never repeat, 96 live at a time
 * (synth_random's sizes): holding reserved memory at the high-water mark
 * moves a page every few allocations for as long as it runs. The move
 * guard (pages.c) notices and grows instead; move_guard:off keeps moving;
 * empty_cache arms the guard again. gpumem_check runs every 64 operations. */
static void random_sizes(fx_t* f, char** held, int slots, int n, uint64_t* x, const char* conf) {
  for (int i = 0; i < n; i++) {
    *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
    int k = (int)(*x % (uint64_t)slots);
    double e = (double)((*x >> 8) % 1000) / 1000.0; /* log-uniform 1 KiB .. 1 GiB */
    size_t size = (size_t)(1024.0 * pow(2.0, 20.0 * e)) + (size_t)((*x >> 20) % 512);
    if (held[k]) release(f, held[k]);
    held[k] = alloc(f, size, SA);
    if (i % 64 == 63) CHECK_MSG(gpumem_check(f->gm) == 0, "%s: %s", conf, gpumem_last_error());
  }
}

static void test_move_guard(void) {
  static const char* const confs[] = {HOLD, HOLD ",move_guard:off"};
  for (int c = 0; c < 2; c++) {
    const char* conf = confs[c];
    int guarded = c == 0;
    fx_t f = fx_new(conf, 64 * GIB, 0);
    if (!f.gm) return fx_done(&f);
    char* held[96] = {NULL};
    uint64_t x = 0x9E3779B97F4A7C15ull;
    random_sizes(&f, held, 96, 30000, &x, conf);
    int64_t moves_before = page_moves(&f);
    /* the last 10,000 allocations: after the trip, pages no longer move */
    random_sizes(&f, held, 96, 10000, &x, conf);
    int64_t late_moves = page_moves(&f) - moves_before;
    gpumem_stats_t s = stats(&f);
    printf(
        "%s: random sizes: %lld guard trips, %lld page moves in the last 10,000 allocations, "
        "reserved %.1f MiB for %.1f MiB peak allocated\n",
        conf, (long long)s.num_move_guard_trips, (long long)late_moves,
        (double)s.reserved_bytes[GPUMEM_POOL_ALL].current / (double)MIB,
        (double)s.allocated_bytes[GPUMEM_POOL_ALL].peak / (double)MIB);
    if (guarded) {
      CHECK_MSG(s.num_move_guard_trips == 1, "%s: %lld trips", conf,
                (long long)s.num_move_guard_trips);
      CHECK_MSG(late_moves < 100, "%s: %lld page moves after the guard tripped", conf,
                (long long)late_moves);
      /* empty_cache arms it again, and the workload trips it again */
      CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
      random_sizes(&f, held, 96, 30000, &x, conf);
      CHECK_MSG(stats(&f).num_move_guard_trips == 2, "%s: %lld trips after empty_cache", conf,
                (long long)stats(&f).num_move_guard_trips);
    } else {
      /* the workload does keep moving pages: what the guard is for */
      CHECK_MSG(s.num_move_guard_trips == 0 && late_moves > 1000, "%s: %lld trips, %lld late moves",
                conf, (long long)s.num_move_guard_trips, (long long)late_moves);
    }
    for (int k = 0; k < 96; k++) release(&f, held[k]);
    fx_done(&f);
  }
  /* A loop that repeats never trips it: its moves stop once a plan serves.
   * And one that follows a stretch that tripped it arms it again: the next
   * such stretch trips it a second time, without empty_cache. */
  {
    fx_t g = fx_new(HOLD, 64 * GIB, 0);
    if (!g.gm) return fx_done(&g);
    char* held[192] = {NULL};
    uint64_t x = 0x2545F4914F6CDD1Dull;
    random_sizes(&g, held, 96, 20000, &x, "rearm");
    CHECK_MSG(stats(&g).num_move_guard_trips == 1, "rearm: %lld trips after random sizes",
              (long long)stats(&g).num_move_guard_trips);
    for (int k = 0; k < 192; k++) release(&g, held[k]), held[k] = NULL;
    live_set_t l;
    memset(&l, 0, sizeof l);
    for (int it = 0; it < 60; it++) loop_step(&g, &l, 0, "rearm");
    gpumem_stats_t s = stats(&g);
    CHECK_MSG(s.num_plans >= 1 && s.num_move_guard_trips == 1, "rearm: %lld plans, %lld trips",
              (long long)s.num_plans, (long long)s.num_move_guard_trips);
    /* twice the live blocks: past the memory the first stretch grew */
    random_sizes(&g, held, 192, 30000, &x, "rearm");
    CHECK_MSG(stats(&g).num_move_guard_trips == 2,
              "rearm: %lld trips: the plan did not arm the guard again",
              (long long)stats(&g).num_move_guard_trips);
    for (int k = 0; k < 192; k++) release(&g, held[k]);
    fx_done(&g);
  }
  fx_t f = fx_new(HOLD, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  live_set_t l;
  memset(&l, 0, sizeof l);
  for (int it = 0; it < 60; it++) loop_step(&f, &l, it < 30 ? 0 : 1, HOLD);
  CHECK_MSG(stats(&f).num_move_guard_trips == 0, "a repeating loop tripped the move guard");
  CHECK_MSG(gpumem_check(f.gm) == 0, "%s", gpumem_last_error());
  fx_done(&f);
}

/* Fences (src/fence.c): with no limit, an arena growing past the mark
 * takes back first the whole free pages a completed fence shows the
 * device done with, and never waits for a stream to do so. A 1 GiB hole
 * left by freed activations is given back when the job later grows by
 * requests that do not fit it; pages used again after the fence that
 * marked them are not taken; a fence still pending takes nothing (the
 * arena grows as without fences). */
static void grow_past_hole(fx_t* f, const char* what, size_t first_request, int check_used) {
  char* weights[8];
  for (int k = 0; k < 8; k++) weights[k] = alloc(f, 64 * MIB, SA);
  char* acts[4];
  for (int k = 0; k < 4; k++) acts[k] = alloc(f, 256 * MIB, SA);
  char* pin = alloc(f, 64 * MIB, SA); /* (keeps the hole from the arena's free tail) */
  for (int k = 0; k < 4; k++) release(f, acts[k]);
  CHECK_MSG(gpumem_check(f->gm) == 0, "%s: %s", what, gpumem_last_error());
  /* larger than the hole: the arena grows past the mark and a fence is
   * recorded behind the hole's pages */
  char* big = alloc(f, first_request, SA);
  CHECK_MSG(gpumem_check(f->gm) == 0, "%s: %s", what, gpumem_last_error());
  release(f, big);
  if (check_used) {
    /* the hole used again: its pages are no longer known done with */
    char* again = alloc(f, 900 * MIB, SA);
    release(f, again);
  }
  big = alloc(f, first_request + 1000 * MIB, SA);
  CHECK_MSG(gpumem_check(f->gm) == 0, "%s: %s", what, gpumem_last_error());
  release(f, big);
  for (int k = 0; k < 8; k++) release(f, weights[k]);
  release(f, pin);
  CHECK_MSG(gpumem_check(f->gm) == 0, "%s: %s", what, gpumem_last_error());
}

static void test_fences(void) {
  int64_t peak[2];
  static const char* const confs[] = {"policy:default", "policy:default,fences:off"};
  for (int c = 0; c < 2; c++) {
    fx_t f = fx_new(confs[c], 64 * GIB, 0);
    if (!f.gm) return fx_done(&f);
    grow_past_hole(&f, confs[c], 1200 * MIB, 0);
    gpumem_stats_t s = stats(&f);
    peak[c] = s.reserved_bytes[GPUMEM_POOL_ALL].peak;
    if (c == 0) {
      /* (the hole's mappings wholly inside it: at least 512 MiB of its 1 GiB;
       * one of them began under the weights, as the run mapped ahead) */
      CHECK_MSG(s.num_pages_fenced >= 256, "fences took back %lld pages of the 1 GiB hole",
                (long long)s.num_pages_fenced);
      CHECK_MSG(s.backend_calls[GPUMEM_CALL_stream_sync] == 0 &&
                    s.backend_calls[GPUMEM_CALL_device_sync] == 0 &&
                    s.backend_calls[GPUMEM_CALL_event_sync] == 0,
                "fenced reuse waited on the host");
      CHECK_MSG(s.backend_calls[GPUMEM_CALL_event_query] > 0, "no fence was queried");
    } else {
      CHECK_MSG(s.num_pages_fenced == 0 && s.backend_calls[GPUMEM_CALL_event_record] == 0,
                "fences:off recorded fences");
    }
    fx_done(&f);
  }
  printf("fences: peak reserved %.3f GiB with, %.3f GiB without\n", (double)peak[0] / GIB,
         (double)peak[1] / GIB);
  CHECK_MSG(peak[0] + (int64_t)(512 * MIB) <= peak[1],
            "fences saved too little: peak reserved %lld with, %lld without", (long long)peak[0],
            (long long)peak[1]);
  {
    /* pages used since their fence stay */
    fx_t f = fx_new("policy:default", 64 * GIB, 0);
    if (!f.gm) return fx_done(&f);
    grow_past_hole(&f, "used again", 1200 * MIB, 1);
    CHECK_MSG(stats(&f).num_pages_fenced == 0, "took back %lld pages used since their fence",
              (long long)stats(&f).num_pages_fenced);
    fx_done(&f);
  }
  {
    /* a fence the device has not reached takes nothing and nothing waits */
    fx_t f = fx_new("policy:default", 64 * GIB, 1000000);
    if (!f.gm) return fx_done(&f);
    grow_past_hole(&f, "pending", 1200 * MIB, 0);
    gpumem_stats_t s = stats(&f);
    CHECK_MSG(s.num_pages_fenced == 0 && s.backend_calls[GPUMEM_CALL_stream_sync] == 0,
              "a pending fence: %lld pages taken, %lld stream syncs", (long long)s.num_pages_fenced,
              (long long)s.backend_calls[GPUMEM_CALL_stream_sync]);
    fx_done(&f);
  }
}

/* Pages that nobody needs move only within the move budget (0 by default:
 * none; here 0.05 us per allocation): on random sizes (where holding memory at the mark moves a
 * page every few allocations) the mapping work it spends on moves stays within 0.05 us per
 * allocation plus 2 ms saved up, the rest is deferred and memory grows instead; with the budget
 * unlimited the same workload moves far more. A limit still gets every move it needs. */
static void test_move_budget(void) {
  const int n = 40000;
  int64_t work[2] = {0, 0}, deferred[2] = {0, 0}, moves[2] = {0, 0};
  /* (fences off: what they take back is charged as moves too) */
  static const char* const confs[] = {"policy:default,move_budget:0.05,fences:off",
                                      "policy:default,move_budget:unlimited,fences:off"};
  for (int c = 0; c < 2; c++) {
    fx_t f = fx_new(confs[c], 64 * GIB, 0);
    if (!f.gm) return fx_done(&f);
    char* held[96] = {NULL};
    uint64_t x = 0x9E3779B97F4A7C15ull;
    random_sizes(&f, held, 96, n, &x, confs[c]);
    gpumem_stats_t s = stats(&f);
    work[c] = s.move_work_us;
    deferred[c] = s.num_moves_deferred;
    moves[c] = s.num_reclaims;
    for (int k = 0; k < 96; k++) release(&f, held[k]);
    fx_done(&f);
  }
  printf(
      "move budget: %lld us of moves priced, %lld deferred, %lld reclaims; unlimited: %lld us, "
      "%lld reclaims\n",
      (long long)work[0], (long long)deferred[0], (long long)moves[0], (long long)work[1],
      (long long)moves[1]);
  CHECK_MSG(work[0] <= (int64_t)(0.05 * n + 2000 + 100),
            "the default spent %lld us on moves, over its budget of %d us", (long long)work[0],
            (int)(0.05 * n + 2000));
  CHECK_MSG(deferred[0] > 0, "nothing was deferred: the budget never bound");
  {
    /* (fences off: what they take back is charged as moves too) */
    fx_t d = fx_new("policy:default,fences:off", 64 * GIB, 0);
    if (!d.gm) return fx_done(&d);
    char* held[96] = {NULL};
    uint64_t x = 0x9E3779B97F4A7C15ull;
    random_sizes(&d, held, 96, n, &x, "policy:default,fences:off");
    gpumem_stats_t s = stats(&d);
    CHECK_MSG(s.move_work_us == 0 && s.num_moves_deferred > 0,
              "the default moved pages nobody needed: %lld us, %lld deferred",
              (long long)s.move_work_us, (long long)s.num_moves_deferred);
    for (int k = 0; k < 96; k++) release(&d, held[k]);
    fx_done(&d);
  }
  CHECK_MSG(work[1] > 10 * work[0] && deferred[1] == 0,
            "unlimited: %lld us of moves, %lld deferred", (long long)work[1],
            (long long)deferred[1]);

  /* A limit is a need: the moves it asks for are not charged or held back
   * (under a limit pages are mapped one at a time, so any whole free page
   * can move). */
  fx_t f = fx_new("policy:default,move_budget:0,limit:400M", 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  char* p[100];
  for (int i = 0; i < 100; i++) p[i] = alloc(&f, 3 * MIB, SA);
  for (int i = 0; i < 100; i += 2) release(&f, p[i]);
  for (int i = 0; i < 40; i++) CHECK(alloc(&f, 4 * MIB, SA) != NULL);
  gpumem_stats_t s = stats(&f);
  CHECK_MSG(s.reserved_bytes[0].current <= (int64_t)(400 * MIB) && s.move_work_us == 0,
            "under a limit with no budget: reserved %lld, %lld us charged",
            (long long)s.reserved_bytes[0].current, (long long)s.move_work_us);
  CHECK_MSG(gpumem_check(f.gm) == 0, "%s", gpumem_last_error());
  fx_done(&f);
}

/* placement:auto plans only where memory is capped. Uncapped, a repeating
 * loop is served by best fit in large mappings (no plan); with a limit set
 * at creation or later (gpumem_set_limit), the same loop is planned. */
static void test_auto_placement(void) {
  for (int c = 0; c < 3; c++) {
    const char* conf = c == 1 ? "policy:default,limit:6G" : "policy:default";
    fx_t f = fx_new(conf, 8 * GIB, 0);
    if (!f.gm) return fx_done(&f);
    if (c == 2) CHECK_STATUS(gpumem_set_limit(f.gm, 6 * GIB), GPUMEM_OK);
    live_set_t l;
    memset(&l, 0, sizeof l);
    for (int it = 0; it < 40; it++) loop_step(&f, &l, 0, conf);
    gpumem_stats_t s = stats(&f);
    const char* how = c == 0 ? "uncapped" : c == 1 ? "limit at creation" : "limit set later";
    printf(
        "auto placement, %s: %lld plans, %lld planned allocations, %lld mappings for %lld "
        "pages\n",
        how, (long long)s.num_plans, (long long)s.num_planned_allocs,
        (long long)s.backend_calls[GPUMEM_CALL_map], (long long)s.num_pages_mapped);
    if (c == 0) {
      CHECK_MSG(s.num_plans == 0, "%s: %lld plans", how, (long long)s.num_plans);
      CHECK_MSG((int64_t)s.backend_calls[GPUMEM_CALL_map] * 2 < s.num_pages_mapped,
                "%s: %lld mappings for %lld pages: not in large mappings", how,
                (long long)s.backend_calls[GPUMEM_CALL_map], (long long)s.num_pages_mapped);
    } else {
      CHECK_MSG(s.num_plans >= 1 && s.num_planned_allocs > 0, "%s: %lld plans, %lld planned", how,
                (long long)s.num_plans, (long long)s.num_planned_allocs);
    }
    CHECK_MSG(gpumem_check(f.gm) == 0, "%s: %s", how, gpumem_last_error());
    fx_done(&f);
  }
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ~10^6 small live allocations, every other one freed (so ~5*10^5 cached
 * free blocks that cannot merge), then 10^5 malloc/free pairs of mixed
 * small sizes. The time is printed, not judged; correctness is checked
 * once at the end (gpumem_check is O(blocks)). */
static void test_throughput(const char* conf, long n) {
  fx_t f = fx_new(conf, 80 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  void** p = malloc((size_t)n * sizeof *p);
  if (!p) return fx_done(&f);
  long failures = 0;
  double t0 = now_s();
  for (long i = 0; i < n; i++) failures += gpumem_malloc(f.gm, 512, SA, &p[i]) != GPUMEM_OK;
  for (long i = 0; i < n; i += 2) failures += gpumem_free(f.gm, p[i]) != GPUMEM_OK;
  double t1 = now_s();
  gpumem_stats_t s = stats(&f);
  CHECK(s.allocation[0].current == n / 2);
  static const size_t sizes[] = {512, 1024, 512, 1536, 4096, 512, 2048, 65536};
  long pairs = n / 10;
  double t2 = now_s();
  for (long i = 0; i < pairs; i++) {
    void* q = NULL;
    failures += gpumem_malloc(f.gm, sizes[i & 7], SA, &q) != GPUMEM_OK;
    failures += gpumem_free(f.gm, q) != GPUMEM_OK;
  }
  double t3 = now_s();
  CHECK(failures == 0);
  size_t v = gpumem_check(f.gm);
  CHECK_MSG(v == 0, "%s after the throughput run: %s", conf, gpumem_last_error());
  printf(
      "%s: %ld live + %ld cached free blocks (setup %.0f ns/op); %ld malloc/free pairs: %.1f "
      "ns per pair, %.1f ns/op\n",
      conf, n / 2, n / 2, (t1 - t0) * 1e9 / (double)(n + n / 2), pairs,
      (t3 - t2) * 1e9 / (double)pairs, (t3 - t2) * 1e9 / (double)(2 * pairs));
  free(p);
  fx_done(&f);
}

int main(int argc, char** argv) {
  long blocks = 1000000;
  const char* env = getenv("GPUMEM_ENGINE_BLOCKS");
  if (env) blocks = strtol(env, NULL, 10);
  if (argc > 1) blocks = strtol(argv[1], NULL, 10);

  test_rounding();
  test_segment_sizes();
  test_splitting();
  test_merging("policy:pytorch");
  test_merging("policy:default");
  test_best_fit("policy:pytorch");
  test_best_fit("policy:default");
  test_hole_end("policy:default,map_max:2M", true);
  test_hole_end("policy:default,limit:4G", true);
  test_hole_end("policy:default", false);
  test_tail_run("policy:default", true);
  test_tail_run("policy:default,limit:4G", false);
  test_map_ahead();
  test_map_ahead_spike();
  test_small_pool_setting("policy:default", false);
  test_small_pool_setting("policy:default,small_pool:on", false);
  test_small_pool_setting("policy:default,small_pool:off", true);
  test_map_ahead_setting("policy:default,map_ahead:off", 0);
  test_map_ahead_setting("policy:default,map_ahead:4M", 4 * MIB);
  test_map_ahead_setting("policy:default,map_ahead:1G", 1 * GIB);
  test_map_ahead_random();
  test_stream_ownership();
  test_record_stream("policy:pytorch");
  test_record_stream("policy:default");
  test_record_stream_reuse("policy:pytorch");
  test_record_stream_reuse("policy:default,placement:bestfit");
  test_retry_ladder();
  test_empty_cache();
  test_limit_fraction("policy:pytorch");
  test_limit_fraction("policy:default");
  test_max_split_size();

  test_pages_on_demand();
  test_mappings();
  test_oom_names_pinned_pages();
  /* pressure with one page per mapping: what a limit set later can reclaim
   * (with larger mappings, only the wholly free ones) */
  static const char* const reclaim[] = {LAZY_ALL, "policy:default,reclaim:eager",
                                        "policy:default,reclaim:pressure,map_max:2M"};
  for (int i = 0; i < 3; i++) {
    test_reserved_tracks_live(reclaim[i]);
    test_limit_moves_pages(reclaim[i]);
    test_streams_share_pages(reclaim[i]);
  }

  test_planned_loop("policy:default,reclaim:pressure,placement:bestfit"); /* for comparison */
  test_planned_loop("policy:default,reclaim:pressure,placement:planned");
  test_planned_loop("policy:default,reclaim:lazy,placement:planned");
  test_planned_streams(HOLD, 1);
  test_planned_streams(HOLD ",stream_waits:off", 1);
  test_planned_streams(HOLD, 0);
  test_shared_take_waits();
  test_streams_lend("policy:default,map_ahead:off,lend:on", true);
  test_streams_lend("policy:default,map_ahead:off", false);
  test_streams_lend("policy:default,map_ahead:off,lend:off", false);
  test_streams_lend("policy:default,map_ahead:off,lend:on,limit:8G", false);
  test_streams_lend("policy:default,map_ahead:off,lend:ordered", true);
  test_streams_lend_ordered("policy:default,map_ahead:off,lend:ordered", true);
  test_streams_lend_ordered("policy:default,map_ahead:off,lend:on", false);
  test_streams_lend_ordered("policy:default,map_ahead:off,lend:ordered,stream_waits:off", false);
  test_move_budget();
  test_fences();
  test_auto_placement();
  /* the loop begins before turns; in an on turn; in the first off turn
   * (~15,000 requests, ~420 steps, before the next on turn); deep in the
   * third, four turns long (~60,000 requests, ~1,700 steps; with off turns
   * of one turn each the loop would be planned within 600 steps) */
  const char* planned = "policy:default,reclaim:lazy,placement:planned";
  test_planned_after_noise(planned, 20000, 30, true);
  test_planned_after_noise(planned, 70000, 30, true);
  test_planned_after_noise(planned, 83000, 30, false);
  test_planned_after_noise(planned, 83000, 500, true);
  test_planned_after_noise(planned, 170000, 600, false);
  test_planned_after_noise(planned, 170000, 2000, true);
  test_alias();
  test_move_guard();

  if (blocks > 0) {
    test_throughput("policy:pytorch", blocks);
    test_throughput("policy:default", blocks);
  }
  return test_finish("test_engine");
}
