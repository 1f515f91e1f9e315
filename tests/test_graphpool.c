/* Graph-private pools on the simulated device, which models capture: a
 * capturing stream refuses synchronizations, event queries and records
 * (counted as capture_violations). Deterministic cases (pool reuse across
 * captures, frees put off during capture, statistics back to where they
 * were, MemPool's options and segment sources, bad input) and a
 * randomized run per configuration that captures graphs among regular
 * traffic on two streams, under a limit and with injected device
 * failures, some pools taking their segments from a fake source that
 * fails at random, calling gpumem_check after every operation and
 * checking that every address a graph was given stays on the same
 * physical memory until its pool is released. */
#include <stdbool.h>
#include <stdint.h>

#include "test_util.h"

#define S_MAIN ((gpumem_stream_t)0x10)
#define S_SIDE ((gpumem_stream_t)0x20)

typedef struct config {
  const char* name;
  gpumem_policy_t policy;
  const char* conf;
} config_t;

static const config_t configs[] = {
    {"pytorch", GPUMEM_POLICY_PYTORCH, ""},
    {"default", GPUMEM_POLICY_DEFAULT, ""},
    {"default/pressure", GPUMEM_POLICY_DEFAULT, "reclaim:pressure,placement:bestfit"},
    {"default/limit", GPUMEM_POLICY_DEFAULT, "limit:160M"},
};

static gpumem_backend_t* sim;

static gpumem_t* make(const config_t* c) {
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = 256 * (size_t)1 << 20;
  so.host_backed = 1;
  sim = gpumem_sim_create(&so);
  gpumem_options_t o;
  gpumem_options_init(&o);
  o.policy = c->policy;
  if (c->conf[0]) CHECK_STATUS(gpumem_options_parse(&o, c->conf), GPUMEM_OK);
  o.own_backend = 1;
  gpumem_t* gm = gpumem_create(sim, &o, NULL);
  CHECK(gm != NULL);
  return gm;
}

static uint64_t violations(void) {
  gpumem_sim_counters_t ct;
  gpumem_sim_get_counters(sim, &ct);
  return ct.capture_violations;
}

static int64_t cur(const gpumem_stat_t* s) {
  return s[GPUMEM_POOL_ALL].current;
}

/* Two captures into one pool: the second reuses what the first freed, at
 * the same addresses; the pool's memory is counted and goes back. */
static void test_capture_and_release(const config_t* c) {
  gpumem_t* gm = make(c);
  void* keep;
  CHECK_STATUS(gpumem_malloc(gm, 3 << 20, S_MAIN, &keep), GPUMEM_OK);
  void* side;
  CHECK_STATUS(gpumem_malloc(gm, 1 << 20, S_SIDE, &side), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, side), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  gpumem_stats_t before;
  gpumem_get_stats(gm, &before);

  CHECK_STATUS(gpumem_sim_begin_capture(sim, S_MAIN, 7), GPUMEM_OK);
  CHECK_STATUS(gpumem_begin_allocate_to_pool_capture(gm, 1, 7), GPUMEM_OK);
  void *a, *b, *out;
  CHECK_STATUS(gpumem_malloc(gm, 1 << 20, S_MAIN, &a), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 5 << 20, S_MAIN, &b), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, a), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 4096, S_MAIN, &out), GPUMEM_OK);
  /* Another stream, not capturing: regular memory. */
  void* other;
  CHECK_STATUS(gpumem_malloc(gm, 1 << 20, S_SIDE, &other), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_sim_end_capture(sim, S_MAIN), GPUMEM_OK);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 1), GPUMEM_OK);
  gpumem_pool_info_t pi;
  CHECK_STATUS(gpumem_pool_info(gm, 1, &pi), GPUMEM_OK);
  CHECK(pi.exists && pi.use_count == 1 && !pi.routed);
  CHECK(pi.allocations == 2);
  CHECK(pi.reserved_bytes >= (6u << 20));
  void* live[4];
  CHECK(gpumem_pool_allocations(gm, 1, live, 4) == 2);
  CHECK((live[0] == b && live[1] == out) || (live[0] == out && live[1] == b));
  gpumem_stats_t mid;
  gpumem_get_stats(gm, &mid);
  CHECK(cur(mid.reserved_bytes) >= cur(before.reserved_bytes) + (int64_t)pi.reserved_bytes);

  /* The graph's buffers freed after capture stay in the pool: a second
   * capture into the same pool gets the same addresses back. */
  CHECK_STATUS(gpumem_free(gm, b), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_info(gm, 1, &pi), GPUMEM_OK);
  CHECK(pi.allocations == 1 && pi.reserved_bytes >= (6u << 20));
  void* x;
  CHECK_STATUS(gpumem_malloc(gm, 5 << 20, S_MAIN, &x), GPUMEM_OK); /* not routed: regular */
  CHECK(x != b);
  CHECK_STATUS(gpumem_free(gm, x), GPUMEM_OK);
  CHECK_STATUS(gpumem_sim_begin_capture(sim, S_MAIN, 8), GPUMEM_OK);
  CHECK_STATUS(gpumem_begin_allocate_to_pool_capture(gm, 1, 8), GPUMEM_OK);
  void* b2;
  CHECK_STATUS(gpumem_malloc(gm, 5 << 20, S_MAIN, &b2), GPUMEM_OK);
  CHECK(b2 == b);
  CHECK_STATUS(gpumem_free(gm, b2), GPUMEM_OK);
  CHECK_STATUS(gpumem_sim_end_capture(sim, S_MAIN), GPUMEM_OK);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 1), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);

  /* Both graphs gone (two uses), then the last buffer: all goes back. */
  CHECK_STATUS(gpumem_release_pool(gm, 1), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_info(gm, 1, &pi), GPUMEM_OK);
  CHECK(pi.exists && pi.use_count == 1);
  CHECK_STATUS(gpumem_release_pool(gm, 1), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_info(gm, 1, &pi), GPUMEM_OK);
  CHECK(pi.exists && pi.allocations == 1); /* out is still live */
  CHECK_STATUS(gpumem_free(gm, out), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_info(gm, 1, &pi), GPUMEM_OK);
  CHECK(!pi.exists);
  CHECK_STATUS(gpumem_free(gm, other), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  gpumem_stats_t after;
  gpumem_get_stats(gm, &after);
  CHECK(cur(after.allocated_bytes) == cur(before.allocated_bytes));
  CHECK(cur(after.allocation) == cur(before.allocation));
  CHECK(cur(after.segment) == cur(before.segment));
  CHECK_MSG(cur(after.reserved_bytes) == cur(before.reserved_bytes),
            "reserved %lld before, %lld after", (long long)cur(before.reserved_bytes),
            (long long)cur(after.reserved_bytes));
  CHECK(violations() == 0);
  CHECK_STATUS(gpumem_free(gm, keep), GPUMEM_OK);
  gpumem_destroy(gm);
}

/* A block used on another stream and freed during a capture: no event may
 * be recorded then; the free completes once the capture ends. */
static void test_deferred_free(const config_t* c) {
  gpumem_t* gm = make(c);
  void* p;
  CHECK_STATUS(gpumem_malloc(gm, 1 << 20, S_MAIN, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_record_stream(gm, p, S_SIDE), GPUMEM_OK);
  CHECK_STATUS(gpumem_sim_begin_capture(sim, S_MAIN, 3), GPUMEM_OK);
  CHECK_STATUS(gpumem_begin_allocate_to_pool_capture(gm, 2, 3), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  CHECK(cur(st.allocation) == 0 && cur(st.active) == 1); /* waiting */
  CHECK(gpumem_check(gm) == 0);
  void* q;
  CHECK_STATUS(gpumem_malloc(gm, 1 << 20, S_MAIN, &q), GPUMEM_OK);
  CHECK(q != p);
  CHECK_STATUS(gpumem_sim_end_capture(sim, S_MAIN), GPUMEM_OK);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 2), GPUMEM_OK);
  /* The flush waits for no capture: the next operation records its event. */
  void* r;
  CHECK_STATUS(gpumem_malloc(gm, 512, S_SIDE, &r), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  CHECK(violations() == 0);
  CHECK_STATUS(gpumem_free(gm, r), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, q), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 2), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
}

/* Captures the allocator could miss: a block used (record_stream) on a
 * capturing stream nothing was ever allocated on, freed during the
 * capture; and a capture that goes on after its routing ended. Neither
 * may bring a synchronization, event query or record on a capturing
 * stream. */
static void test_capture_unseen_streams(const config_t* c) {
  gpumem_t* gm = make(c);
  void* p;
  CHECK_STATUS(gpumem_malloc(gm, 1 << 20, S_SIDE, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_sim_begin_capture(sim, S_MAIN, 5), GPUMEM_OK);
  CHECK_STATUS(gpumem_begin_allocate_to_pool_capture(gm, 6, 5), GPUMEM_OK);
  /* S_MAIN has allocated nothing, in the pool or out of it */
  CHECK_STATUS(gpumem_record_stream(gm, p, S_MAIN), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  CHECK(violations() == 0);
  /* the routing ends first; the capture goes on */
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 6), GPUMEM_OK);
  void* q;
  CHECK_STATUS(gpumem_malloc(gm, 4 << 20, S_SIDE, &q), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  CHECK(violations() == 0);
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  CHECK(cur(st.active) == 2); /* p still waits for the capture to end */
  CHECK_STATUS(gpumem_sim_end_capture(sim, S_MAIN), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, q), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  gpumem_get_stats(gm, &st);
  CHECK(cur(st.active) == 0); /* p's free completed once the capture ended */
  CHECK(gpumem_check(gm) == 0);
  CHECK(violations() == 0);
  CHECK_STATUS(gpumem_release_pool(gm, 6), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
}

static int accept_main(gpumem_stream_t s, void* arg) {
  (void)arg;
  return s == S_MAIN;
}

/* torch.cuda.MemPool: retained, routed by a filter, no capture at all. */
static void test_mempool(const config_t* c) {
  gpumem_t* gm = make(c);
  void* side;
  CHECK_STATUS(gpumem_malloc(gm, 2 << 20, S_SIDE, &side), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, side), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  gpumem_stats_t before;
  gpumem_get_stats(gm, &before);
  CHECK_STATUS(gpumem_retain_pool(gm, 9), GPUMEM_OK);
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 9, accept_main, NULL), GPUMEM_OK);
  void *a, *b;
  CHECK_STATUS(gpumem_malloc(gm, 2 << 20, S_MAIN, &a), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 2 << 20, S_SIDE, &b), GPUMEM_OK);
  CHECK(gpumem_pool_allocations(gm, 9, NULL, 0) == 1);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 9), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 9), GPUMEM_OK); /* use_mem_pool's exit */
  gpumem_pool_info_t pi;
  CHECK_STATUS(gpumem_pool_info(gm, 9, &pi), GPUMEM_OK);
  CHECK(pi.exists && pi.use_count == 1);
  CHECK_STATUS(gpumem_free(gm, a), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, b), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_info(gm, 9, &pi), GPUMEM_OK);
  CHECK(pi.exists && pi.reserved_bytes > 0);           /* empty_cache leaves a pool alone */
  CHECK_STATUS(gpumem_release_pool(gm, 9), GPUMEM_OK); /* the MemPool is gone */
  CHECK_STATUS(gpumem_pool_info(gm, 9, &pi), GPUMEM_OK);
  CHECK(!pi.exists);
  gpumem_stats_t after;
  gpumem_get_stats(gm, &after);
  CHECK(cur(after.reserved_bytes) == cur(before.reserved_bytes));
  CHECK(cur(after.segment) == cur(before.segment));
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
}

/* Allocates size bytes on S_MAIN (routed to pool) into *p; returns how
 * many bytes the pool's allocated memory grew by: the block it got. */
static uint64_t malloc_in_pool(gpumem_t* gm, uint64_t pool, size_t size, void** p) {
  gpumem_pool_info_t pi;
  CHECK_STATUS(gpumem_pool_info(gm, pool, &pi), GPUMEM_OK);
  uint64_t had = pi.allocated_bytes;
  CHECK_STATUS(gpumem_malloc(gm, size, S_MAIN, p), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_info(gm, pool, &pi), GPUMEM_OK);
  return pi.allocated_bytes - had;
}

/* MemPool(no_split=True): every allocation the pool serves is a segment
 * of its own, and a freed one is handed out again whole. */
static void test_no_split(const config_t* c) {
  gpumem_t* gm = make(c);
  bool vm = c->policy == GPUMEM_POLICY_DEFAULT;
  CHECK_STATUS(gpumem_retain_pool(gm, 11), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_set_no_split(gm, 11, 1), GPUMEM_OK);
  gpumem_stats_t before;
  gpumem_get_stats(gm, &before);
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 11, accept_main, NULL), GPUMEM_OK);
  const size_t sizes[] = {512, 3 << 20, 3 << 20, 12 << 20};
  /* the block each gets: whole pages, or PyTorch's segment sizes */
  const size_t whole[] = {2 << 20, vm ? 4 << 20 : 20 << 20, vm ? 4 << 20 : 20 << 20, 12 << 20};
  void* p[4];
  for (int i = 0; i < 4; i++) {
    uint64_t got = malloc_in_pool(gm, 11, sizes[i], &p[i]);
    CHECK_MSG(got == whole[i], "%s: %zu bytes got a %llu-byte block", c->name, sizes[i],
              (unsigned long long)got);
    CHECK(gpumem_check(gm) == 0);
  }
  gpumem_stats_t mid;
  gpumem_get_stats(gm, &mid);
  CHECK_MSG(cur(mid.segment) == cur(before.segment) + 4, "%s: %lld segments for 4 allocations",
            c->name, (long long)(cur(mid.segment) - cur(before.segment)));
  /* Freed, a block comes back whole for a smaller request, at its address. */
  CHECK_STATUS(gpumem_free(gm, p[1]), GPUMEM_OK);
  void* again;
  uint64_t got = malloc_in_pool(gm, 11, (2 << 20) + 4096, &again);
  CHECK(again == p[1] && got == whole[1]);
  CHECK(gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 11), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, again), GPUMEM_OK);
  for (int i = 0; i < 4; i++)
    if (i != 1) CHECK_STATUS(gpumem_free(gm, p[i]), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 11), GPUMEM_OK); /* the routing's */
  CHECK_STATUS(gpumem_release_pool(gm, 11), GPUMEM_OK); /* the retain's */
  gpumem_stats_t after;
  gpumem_get_stats(gm, &after);
  CHECK(cur(after.segment) == cur(before.segment));
  CHECK(cur(after.reserved_bytes) == cur(before.reserved_bytes));
  /* Set on a pool that split blocks already: those stay as they are, and
   * what comes next gets segments of its own. */
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 12, accept_main, NULL), GPUMEM_OK);
  void *x, *y;
  CHECK_STATUS(gpumem_malloc(gm, 2 << 20, S_MAIN, &x), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 2 << 20, S_MAIN, &y), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, y), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_set_no_split(gm, 12, 1), GPUMEM_OK);
  gpumem_get_stats(gm, &mid);
  CHECK_STATUS(gpumem_malloc(gm, 2 << 20, S_MAIN, &y), GPUMEM_OK);
  gpumem_get_stats(gm, &after);
  CHECK(cur(after.segment) == cur(mid.segment) + 1);
  CHECK(gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 12), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, x), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, y), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 12), GPUMEM_OK);
  clear_error();
  CHECK_STATUS(gpumem_pool_set_no_split(gm, 12, 1), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "does not exist") != NULL);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
}

/* MemPool(use_on_oom=True): a request outside the pool that finds no
 * memory takes the pool's cached memory before out of memory is reported;
 * the block stays the pool's. Without the option, or on a stream the pool
 * holds nothing for, out of memory. */
static void test_use_on_oom(const config_t* c) {
  gpumem_t* gm = make(c);
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 13, accept_main, NULL), GPUMEM_OK);
  void* in_pool;
  CHECK_STATUS(gpumem_malloc(gm, 40 << 20, S_MAIN, &in_pool), GPUMEM_OK);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 13), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, in_pool), GPUMEM_OK); /* cached by the pool */
  void* fill[64];
  int n = 0;
  while (n < 64 && gpumem_malloc(gm, 16 << 20, S_MAIN, &fill[n]) == GPUMEM_OK) n++;
  CHECK_MSG(n > 0 && n < 64, "%s: %d fills", c->name, n);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, 16 << 20, S_MAIN, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_pool_set_use_on_oom(gm, 13, 1), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 16 << 20, S_SIDE, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  gpumem_stats_t before;
  gpumem_get_stats(gm, &before);
  gpumem_pool_info_t pi;
  CHECK_STATUS(gpumem_pool_info(gm, 13, &pi), GPUMEM_OK);
  uint64_t pool_reserved = pi.reserved_bytes;
  CHECK_STATUS(gpumem_malloc(gm, 16 << 20, S_MAIN, &p), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_pool_info(gm, 13, &pi), GPUMEM_OK);
  CHECK(pi.allocations == 1 && gpumem_pool_allocations(gm, 13, NULL, 0) == 1);
  gpumem_stats_t after;
  gpumem_get_stats(gm, &after);
  CHECK(pi.reserved_bytes == pool_reserved); /* the pool's memory, none new */
  CHECK(cur(after.allocation) == cur(before.allocation) + 1);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_info(gm, 13, &pi), GPUMEM_OK);
  CHECK(pi.allocations == 0 && pi.reserved_bytes >= (40 << 20));
  CHECK_STATUS(gpumem_pool_set_use_on_oom(gm, 13, 0), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 16 << 20, S_MAIN, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  /* The pool's release gives its memory back: the request fits then. */
  CHECK_STATUS(gpumem_release_pool(gm, 13), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 16 << 20, S_MAIN, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  while (n) CHECK_STATUS(gpumem_free(gm, fill[--n]), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
}

/* ---- MemPool(allocator=...): segments from the caller's allocator ---- */

/* A fake segment source: bump-allocates from [SRC_BASE, SRC_TOP), below
 * the simulated device's plain allocations (from 16 TiB) and reserved
 * ranges (from 128 TiB), so no address of its can be the device's. Every
 * segment it hands out is recorded until it comes back; one cursor for all
 * sources of the process, never reused. */
#define SRC_BASE ((uintptr_t)0x010000000000ull) /* 1 TiB */
#define SRC_TOP ((uintptr_t)0x100000000000ull)  /* 16 TiB: the device's plain range */
#define SRC_MAX_LIVE 1024

typedef struct fake_src {
  uint64_t allocs, frees, releases;
  size_t live;          /* its segments not yet back */
  int fail;             /* fail the next this many allocs (-1: every one) */
  unsigned fail_one_in; /* and, at random, one in this many (0: none) */
  bool write_message;   /* a failure writes its own message */
  bool misalign;        /* hand out addresses 256 bytes off */
  gpumem_stream_t last_stream;
} fake_src_t;

typedef struct src_seg {
  uintptr_t addr;
  size_t size;
  gpumem_stream_t stream;
  fake_src_t* owner;
} src_seg_t;

static src_seg_t src_live[SRC_MAX_LIVE];
static size_t src_nlive;
static uintptr_t src_cursor = SRC_BASE;
static uint64_t src_rng = 88172645463325252ull;

static gpumem_status_t fake_alloc(void* ctx, size_t size, gpumem_stream_t stream, uintptr_t* out) {
  fake_src_t* f = ctx;
  f->allocs++;
  f->last_stream = stream;
  src_rng ^= src_rng << 13;
  src_rng ^= src_rng >> 7;
  src_rng ^= src_rng << 17;
  if (f->fail || (f->fail_one_in && src_rng % f->fail_one_in == 0)) {
    if (f->fail > 0) f->fail--;
    if (f->write_message) gpumem_set_last_error("fake source: no room for %zu bytes", size);
    return GPUMEM_ERR_OUT_OF_MEMORY;
  }
  size_t span = (size + (2u << 20) - 1) / (2u << 20) * (2u << 20);
  CHECK(src_nlive < SRC_MAX_LIVE && src_cursor + span < SRC_TOP);
  if (src_nlive == SRC_MAX_LIVE) return GPUMEM_ERR_OUT_OF_MEMORY;
  uintptr_t addr = src_cursor + (f->misalign ? 256 : 0);
  src_cursor += span + (2u << 20); /* a gap: no two segments touch */
  src_live[src_nlive++] = (src_seg_t){addr, size, stream, f};
  f->live++;
  *out = addr;
  return GPUMEM_OK;
}

static void fake_free(void* ctx, uintptr_t addr, size_t size, gpumem_stream_t stream) {
  fake_src_t* f = ctx;
  f->frees++;
  size_t i = 0;
  while (i < src_nlive && src_live[i].addr != addr) i++;
  CHECK_MSG(i < src_nlive, "the source takes back 0x%lx, which it never gave", (unsigned long)addr);
  if (i == src_nlive) return;
  CHECK_MSG(src_live[i].owner == f && src_live[i].size == size && src_live[i].stream == stream,
            "segment 0x%lx comes back as %zu bytes on stream 0x%lx, given as %zu on 0x%lx",
            (unsigned long)addr, size, (unsigned long)stream, src_live[i].size,
            (unsigned long)src_live[i].stream);
  src_live[i] = src_live[--src_nlive];
  f->live--;
}

static void fake_release(void* ctx) {
  fake_src_t* f = ctx;
  CHECK_MSG(f->live == 0, "release with %zu segments of the source still out", f->live);
  f->releases++;
}

/* Export slots for the simulated device, so that gpumem_ipc_export gets
 * as far as looking at the allocation (never called: it is refused). */
static gpumem_status_t fake_export_page(void* ctx, gpumem_phys_t page, int* out_fd) {
  (void)ctx, (void)page, (void)out_fd;
  return GPUMEM_ERR_UNSUPPORTED;
}
static gpumem_status_t fake_import_page(void* ctx, int fd, gpumem_phys_t* out) {
  (void)ctx, (void)fd, (void)out;
  return GPUMEM_ERR_UNSUPPORTED;
}

static gpumem_segment_source_t source_of(fake_src_t* f) {
  return (gpumem_segment_source_t){fake_alloc, fake_free, fake_release, f};
}

/* The source segment of f holding [p, p + n), or NULL. */
static const src_seg_t* src_segment_of(const fake_src_t* f, const void* p, size_t n) {
  uintptr_t a = (uintptr_t)p;
  for (size_t i = 0; i < src_nlive; i++)
    if (src_live[i].owner == f && a >= src_live[i].addr &&
        a + n <= src_live[i].addr + src_live[i].size)
      return &src_live[i];
  return NULL;
}

/* An allocator with pool `pool` routed to on S_MAIN, its segments from f. */
static gpumem_t* make_source_pool(const config_t* c, uint64_t pool, fake_src_t* f) {
  gpumem_t* gm = make(c);
  gpumem_segment_source_t src = source_of(f);
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, pool, accept_main, NULL), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, pool, &src), GPUMEM_OK);
  return gm;
}

/* A pool whose segments come from the source: PyTorch's segment sizes,
 * blocks split and reused inside them, counted in the statistics, and all
 * back to the source (then release) when the pool goes. */
static void test_source_basics(const config_t* c) {
  gpumem_t* gm = make(c);
  fake_src_t f = {0};
  gpumem_stats_t before, st;
  gpumem_get_stats(gm, &before);
  CHECK_STATUS(gpumem_retain_pool(gm, 21), GPUMEM_OK);
  gpumem_segment_source_t src = source_of(&f);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 21, &src), GPUMEM_OK);
  src.ctx = NULL; /* copied: the caller's struct may go */
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 21, accept_main, NULL), GPUMEM_OK);
  /* request, the segment PyTorch would make for it */
  const size_t sizes[] = {4096, 3 << 20, (24 << 20) + 1};
  const size_t segs[] = {2 << 20, 20 << 20, 26 << 20};
  void* p[3];
  for (int i = 0; i < 3; i++) {
    CHECK_STATUS(gpumem_malloc(gm, sizes[i], S_MAIN, &p[i]), GPUMEM_OK);
    const src_seg_t* seg = src_segment_of(&f, p[i], sizes[i]);
    CHECK_MSG(seg && seg->size == segs[i], "%s: %zu bytes at %p: segment of %zu bytes", c->name,
              sizes[i], p[i], seg ? seg->size : 0);
    CHECK(f.last_stream == S_MAIN);
    CHECK(gpumem_check(gm) == 0);
  }
  CHECK(f.allocs == 3 && f.live == 3);
  /* Split inside the segments, and a freed block reused. */
  void *q, *r;
  CHECK_STATUS(gpumem_malloc(gm, 4096, S_MAIN, &q), GPUMEM_OK);
  CHECK(src_segment_of(&f, q, 4096) == src_segment_of(&f, p[0], 4096));
  CHECK_STATUS(gpumem_malloc(gm, 2 << 20, S_MAIN, &r), GPUMEM_OK); /* the 20 MiB one's rest */
  CHECK(src_segment_of(&f, r, 2 << 20) == src_segment_of(&f, p[1], 3 << 20));
  CHECK(gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_free(gm, p[0]), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  void* again;
  CHECK_STATUS(gpumem_malloc(gm, 2048, S_MAIN, &again), GPUMEM_OK);
  CHECK(again == p[0]);
  CHECK(f.allocs == 3);
  CHECK(gpumem_check(gm) == 0);
  /* Counted as reserved memory and segments; not as the backend's calls. */
  gpumem_get_stats(gm, &st);
  CHECK_MSG(cur(st.reserved_bytes) == cur(before.reserved_bytes) + (48 << 20),
            "%s: reserved %lld, %lld before", c->name, (long long)cur(st.reserved_bytes),
            (long long)cur(before.reserved_bytes));
  CHECK(cur(st.segment) == cur(before.segment) + 3);
  CHECK(st.reserved_bytes[GPUMEM_POOL_SMALL].current ==
        before.reserved_bytes[GPUMEM_POOL_SMALL].current + (2 << 20));
  CHECK(st.num_device_alloc == before.num_device_alloc + 3);
  CHECK(st.backend_calls[GPUMEM_CALL_alloc] == before.backend_calls[GPUMEM_CALL_alloc]);
  gpumem_pool_info_t pi;
  CHECK_STATUS(gpumem_pool_info(gm, 21, &pi), GPUMEM_OK);
  CHECK(pi.reserved_bytes == (48u << 20) && pi.allocations == 5);
  /* Another stream outside the routing: the device's memory, as ever. */
  void* side;
  CHECK_STATUS(gpumem_malloc(gm, 4096, S_SIDE, &side), GPUMEM_OK);
  CHECK(src_segment_of(&f, side, 1) == NULL && f.allocs == 3);
  CHECK_STATUS(gpumem_free(gm, side), GPUMEM_OK);
  /* empty_cache leaves the pool alone */
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK(f.frees == 0);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 21), GPUMEM_OK);
  void* all[] = {again, p[1], p[2], q, r};
  for (int i = 0; i < 5; i++) {
    CHECK_STATUS(gpumem_free(gm, all[i]), GPUMEM_OK);
    CHECK(gpumem_check(gm) == 0);
  }
  CHECK(f.frees == 0 && f.releases == 0);               /* the pool is still in use */
  CHECK_STATUS(gpumem_release_pool(gm, 21), GPUMEM_OK); /* the routing's */
  CHECK(f.frees == 0);
  gpumem_stats_t mid;
  gpumem_get_stats(gm, &mid);
  CHECK_STATUS(gpumem_release_pool(gm, 21), GPUMEM_OK); /* the retain's */
  CHECK(f.frees == 3 && f.live == 0 && f.releases == 1);
  CHECK_STATUS(gpumem_pool_info(gm, 21, &pi), GPUMEM_OK);
  CHECK(!pi.exists);
  CHECK(gpumem_check(gm) == 0);
  gpumem_get_stats(gm, &st);
  CHECK(cur(st.reserved_bytes) == cur(mid.reserved_bytes) - (48 << 20));
  CHECK(cur(st.segment) == cur(mid.segment) - 3);
  CHECK(st.num_device_free == mid.num_device_free + 3);
  CHECK(st.backend_calls[GPUMEM_CALL_free] == mid.backend_calls[GPUMEM_CALL_free]);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK); /* (the side allocation's memory) */
  gpumem_get_stats(gm, &st);
  CHECK(cur(st.reserved_bytes) == cur(before.reserved_bytes));
  gpumem_destroy(gm);
  CHECK(f.releases == 1);
}

/* Under a limit a source segment that would pass it is refused before the
 * source is asked; a source that fails makes the request fail as out of
 * memory, with a message, and leaves nothing behind. */
static void test_source_failures(const config_t* c) {
  fake_src_t f = {0};
  gpumem_t* gm = make_source_pool(c, 22, &f);
  void* small;
  CHECK_STATUS(gpumem_malloc(gm, 1000, S_MAIN, &small), GPUMEM_OK);
  gpumem_stats_t before, st;
  gpumem_get_stats(gm, &before);
  CHECK_STATUS(gpumem_set_limit(gm, (size_t)cur(before.reserved_bytes) + (10 << 20)), GPUMEM_OK);
  void* p = NULL;
  clear_error();
  CHECK_STATUS(gpumem_malloc(gm, 3 << 20, S_MAIN, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(p == NULL && f.allocs == 1);
  CHECK_MSG(strstr(gpumem_last_error(), "limit") != NULL, "%s", gpumem_last_error());
  CHECK(gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_malloc(gm, 600 << 10, S_MAIN, &p), GPUMEM_OK); /* the 2 MiB segment */
  CHECK(f.allocs == 1 && src_segment_of(&f, p, 600 << 10));
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  gpumem_remove_limit(gm);
  if (!strcmp(c->name, "default/limit")) CHECK_STATUS(gpumem_set_limit(gm, 160 << 20), GPUMEM_OK);

  /* The source has nothing: out of memory, the retry ladder's retry too. */
  gpumem_get_stats(gm, &before);
  f.fail = -1;
  clear_error();
  CHECK_STATUS(gpumem_malloc(gm, 3 << 20, S_MAIN, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(p == NULL && f.allocs >= 2 && f.live == 1);
  CHECK_MSG(strstr(gpumem_last_error(), "out of memory") != NULL &&
                strstr(gpumem_last_error(), "pool 22's own allocator gave no 20971520 bytes"),
            "%s", gpumem_last_error());
  CHECK(gpumem_check(gm) == 0);
  gpumem_get_stats(gm, &st);
  CHECK(cur(st.reserved_bytes) == cur(before.reserved_bytes));
  CHECK(cur(st.segment) == cur(before.segment) && cur(st.allocation) == cur(before.allocation));
  CHECK(st.num_ooms == before.num_ooms + 1);
  CHECK(st.num_device_alloc == before.num_device_alloc);
  /* Its own message is kept. */
  f.write_message = true;
  CHECK_STATUS(gpumem_malloc(gm, 3 << 20, S_MAIN, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_MSG(strstr(gpumem_last_error(), "fake source: no room for 20971520 bytes") &&
                !strstr(gpumem_last_error(), "gave no"),
            "%s", gpumem_last_error());
  CHECK(gpumem_check(gm) == 0);
  /* An address off the 512-byte grid is refused and given back. */
  f.fail = 0;
  f.misalign = true;
  clear_error();
  CHECK_STATUS(gpumem_malloc(gm, 3 << 20, S_MAIN, &p), GPUMEM_ERR_BACKEND);
  CHECK_MSG(strstr(gpumem_last_error(), "not a 512-byte aligned") != NULL, "%s",
            gpumem_last_error());
  CHECK(f.live == 1 && gpumem_check(gm) == 0);
  f.misalign = false;
  CHECK_STATUS(gpumem_malloc(gm, 3 << 20, S_MAIN, &p), GPUMEM_OK);
  CHECK(f.live == 2 && src_segment_of(&f, p, 3 << 20));
  CHECK(gpumem_check(gm) == 0);
  /* IPC: the source's memory is not gpumem's to export. */
  if (c->policy == GPUMEM_POLICY_DEFAULT) {
    sim->export_page = fake_export_page;
    sim->import_page = fake_import_page;
    char handle[256];
    size_t needed = 0;
    CHECK_STATUS(gpumem_ipc_export(gm, p, handle, sizeof handle, &needed), GPUMEM_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(gpumem_last_error(), "pool's own allocator") != NULL, "%s",
              gpumem_last_error());
    sim->export_page = NULL;
    sim->import_page = NULL;
  }
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 22), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, small), GPUMEM_OK);
  CHECK(f.frees == 1); /* (the misaligned one) */
  CHECK_STATUS(gpumem_release_pool(gm, 22), GPUMEM_OK);
  CHECK(f.live == 0 && f.releases == 1);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
}

/* Released while blocks are live: the segments go back at the last free,
 * then release, once. gpumem_destroy gives back what is still out. */
static void test_source_lifetime(const config_t* c) {
  gpumem_t* gm = make(c);
  fake_src_t f = {0}, g = {0};
  gpumem_segment_source_t src = source_of(&f);
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 23, accept_main, NULL), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 23, &src), GPUMEM_OK);
  void *a, *b;
  CHECK_STATUS(gpumem_malloc(gm, 5 << 20, S_MAIN, &a), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 100, S_MAIN, &b), GPUMEM_OK);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 23), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 23), GPUMEM_OK);
  CHECK(f.live == 2 && f.frees == 0 && f.releases == 0);
  gpumem_pool_info_t pi;
  CHECK_STATUS(gpumem_pool_info(gm, 23, &pi), GPUMEM_OK);
  CHECK(pi.exists && pi.use_count == 0);
  clear_error();
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 23, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "pool 23 was released") != NULL);
  CHECK_STATUS(gpumem_free(gm, a), GPUMEM_OK);
  CHECK(f.frees == 0 && f.releases == 0 && gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_free(gm, b), GPUMEM_OK);
  CHECK(f.frees == 2 && f.live == 0 && f.releases == 1);
  CHECK_STATUS(gpumem_pool_info(gm, 23, &pi), GPUMEM_OK);
  CHECK(!pi.exists && gpumem_check(gm) == 0);

  /* Destroyed with a live block and a cached segment in the pool. */
  src = source_of(&g);
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 24, accept_main, NULL), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 24, &src), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 5 << 20, S_MAIN, &a), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 100, S_MAIN, &b), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, b), GPUMEM_OK);
  CHECK(g.live == 2 && gpumem_check(gm) == 0);
  gpumem_destroy(gm);
  CHECK(g.live == 0 && g.frees == 2 && g.releases == 1);
  CHECK(f.releases == 1);
}

/* Refusals name the problem and keep nothing: the caller still owns ctx. */
static void test_source_refusals(const config_t* c) {
  gpumem_t* gm = make(c);
  fake_src_t f = {0}, g = {0};
  gpumem_segment_source_t src = source_of(&f);
  clear_error();
  CHECK_STATUS(gpumem_pool_set_segment_source(NULL, 25, &src), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "NULL allocator") != NULL);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 25, &src), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "pool 25 does not exist") != NULL);
  CHECK_STATUS(gpumem_retain_pool(gm, 25), GPUMEM_OK);
  gpumem_segment_source_t bad = src;
  bad.alloc = NULL;
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 25, &bad), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "no alloc function") != NULL);
  bad = src;
  bad.free = NULL;
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 25, &bad), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "no free function") != NULL);
  /* Replaced, then cleared, before the first allocation: each one given
   * up is released at once. */
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 25, &src), GPUMEM_OK);
  gpumem_segment_source_t other = source_of(&g);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 25, &other), GPUMEM_OK);
  CHECK(f.releases == 1 && g.releases == 0);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 25, NULL), GPUMEM_OK);
  CHECK(g.releases == 1);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 25, NULL), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  /* A pool that holds the device's memory keeps it. */
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 25, accept_main, NULL), GPUMEM_OK);
  void* p;
  CHECK_STATUS(gpumem_malloc(gm, 4096, S_MAIN, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK); /* (cached: still the pool's memory) */
  fake_src_t h = {0};
  gpumem_segment_source_t third = source_of(&h);
  clear_error();
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 25, &third), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_MSG(strstr(gpumem_last_error(),
                   "pool 25 holds memory already: set its allocator before its first "
                   "allocation") != NULL,
            "%s", gpumem_last_error());
  CHECK(gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 25), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 25), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 25), GPUMEM_OK);
  CHECK(h.allocs == 0 && h.releases == 0);
  /* A pool that holds its source's memory keeps its source. */
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 26, accept_main, NULL), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 26, &third), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 4096, S_MAIN, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 26, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(gpumem_pool_set_segment_source(gm, 26, &src), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "holds memory already") != NULL);
  CHECK(f.releases == 1 && h.releases == 0 && h.live == 1);
  CHECK(gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 26), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 26), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  CHECK(h.live == 0 && h.releases == 1);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
  CHECK(f.releases == 1 && g.releases == 1 && h.releases == 1);
}

/* With no_split each allocation is a source segment of its own, of
 * PyTorch's size, handed out whole; with use_on_oom a request outside
 * the pool takes a cached block of the source's memory, mapping nothing. */
static void test_source_options(const config_t* c) {
  fake_src_t f = {0};
  gpumem_t* gm = make_source_pool(c, 27, &f);
  CHECK_STATUS(gpumem_pool_set_no_split(gm, 27, 1), GPUMEM_OK);
  const size_t sizes[] = {512, 3 << 20, 3 << 20, 12 << 20};
  const size_t whole[] = {2 << 20, 20 << 20, 20 << 20, 12 << 20};
  void* p[4];
  for (int i = 0; i < 4; i++) {
    uint64_t got = malloc_in_pool(gm, 27, sizes[i], &p[i]);
    const src_seg_t* seg = src_segment_of(&f, p[i], sizes[i]);
    CHECK_MSG(seg && seg->addr == (uintptr_t)p[i] && seg->size == whole[i] && got == whole[i],
              "%s: %zu bytes got a %llu-byte block", c->name, sizes[i], (unsigned long long)got);
    CHECK(gpumem_check(gm) == 0);
  }
  CHECK(f.allocs == 4);
  CHECK_STATUS(gpumem_free(gm, p[1]), GPUMEM_OK);
  void* again;
  CHECK_STATUS(gpumem_malloc(gm, (2 << 20) + 4096, S_MAIN, &again), GPUMEM_OK);
  CHECK(again == p[1] && f.allocs == 4);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 27), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, again), GPUMEM_OK);
  for (int i = 0; i < 4; i++)
    if (i != 1) CHECK_STATUS(gpumem_free(gm, p[i]), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);

  /* use_on_oom: the pool's cached 20 MiB segments serve the device's
   * overflow (on the pool's stream). */
  CHECK_STATUS(gpumem_pool_set_use_on_oom(gm, 27, 1), GPUMEM_OK);
  void* fill[64];
  int n = 0;
  while (n < 64 && gpumem_malloc(gm, 16 << 20, S_MAIN, &fill[n]) == GPUMEM_OK &&
         !src_segment_of(&f, fill[n], 1))
    n++;
  CHECK_MSG(n < 64, "%s: the device never filled", c->name);
  /* the last one came from the pool: its 20 MiB segment, whole */
  CHECK(n < 64 && src_segment_of(&f, fill[n], 16 << 20) &&
        src_segment_of(&f, fill[n], 16 << 20)->size == (20u << 20));
  CHECK(gpumem_check(gm) == 0);
  CHECK(gpumem_pool_allocations(gm, 27, NULL, 0) == 1);
  CHECK(f.allocs == 4);
  CHECK_STATUS(gpumem_free(gm, fill[n]), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  while (n) CHECK_STATUS(gpumem_free(gm, fill[--n]), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 27), GPUMEM_OK);
  CHECK(f.live == 0 && f.frees == 4 && f.releases == 1);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
}

/* A checkpoint puts a pool back as it was: what is live now is freed and
 * what was live then is live again at the same addresses (torch.compile's
 * CUDA graph trees, before recording a new branch). */
static void test_checkpoint(const config_t* c) {
  gpumem_t* gm = make(c);
  gpumem_stats_t before;
  gpumem_get_stats(gm, &before);
  CHECK_STATUS(gpumem_sim_begin_capture(sim, S_MAIN, 3), GPUMEM_OK);
  CHECK_STATUS(gpumem_begin_allocate_to_pool_capture(gm, 9, 3), GPUMEM_OK);
  void *a, *b, *x;
  CHECK_STATUS(gpumem_malloc(gm, 1 << 20, S_MAIN, &a), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 3000, S_MAIN, &b), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 3 << 20, S_MAIN, &x), GPUMEM_OK);
  CHECK_STATUS(gpumem_sim_end_capture(sim, S_MAIN), GPUMEM_OK);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 9), GPUMEM_OK);
  gpumem_pool_state_t* state = NULL;
  CHECK_STATUS(gpumem_pool_checkpoint(gm, 9, &state), GPUMEM_OK);
  CHECK(gpumem_pool_state_allocations(state) == 3);
  gpumem_stats_t at_checkpoint;
  gpumem_get_stats(gm, &at_checkpoint);

  /* The tree goes on: b freed, x used on another stream and freed (its
   * free waits for that stream), a second graph allocates y. */
  CHECK_STATUS(gpumem_free(gm, b), GPUMEM_OK);
  CHECK_STATUS(gpumem_record_stream(gm, x, S_SIDE), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, x), GPUMEM_OK);
  CHECK_STATUS(gpumem_sim_begin_capture(sim, S_MAIN, 4), GPUMEM_OK);
  CHECK_STATUS(gpumem_begin_allocate_to_pool_capture(gm, 9, 4), GPUMEM_OK);
  void* y;
  CHECK_STATUS(gpumem_malloc(gm, 2 << 20, S_MAIN, &y), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);

  /* Refused during the capture, and with too little room, unchanged. */
  void *freed[8], *made[8];
  size_t nf = 99, nm = 99;
  clear_error();
  CHECK_STATUS(gpumem_pool_restore(gm, 9, state, freed, 8, &nf, made, 8, &nm),
               GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "captured") != NULL);
  CHECK(nf == 0 && nm == 0);
  CHECK_STATUS(gpumem_sim_end_capture(sim, S_MAIN), GPUMEM_OK);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 9), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_restore(gm, 9, state, freed, 1, &nf, made, 8, &nm),
               GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "room for 1 freed") != NULL);
  CHECK_STATUS(gpumem_pool_restore(gm, 8, state, freed, 8, &nf, made, 8, &nm),
               GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "not of pool 8") != NULL);
  gpumem_pool_info_t pi;
  CHECK_STATUS(gpumem_pool_info(gm, 9, &pi), GPUMEM_OK);
  CHECK(pi.allocations >= 2); /* a and y (x may still wait for its stream) */
  CHECK(gpumem_check(gm) == 0);

  CHECK_STATUS(gpumem_pool_restore(gm, 9, state, freed, 8, &nf, made, 8, &nm), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  CHECK(nf == 2 && nm == 3);
  CHECK((freed[0] == a && freed[1] == y) || (freed[0] == y && freed[1] == a));
  void* want[3] = {a, b, x};
  for (int i = 0; i < 3; i++) {
    bool found = false;
    for (size_t k = 0; k < nm; k++) found |= made[k] == want[i];
    CHECK_MSG(found, "allocation %d of the checkpoint is not live again at its address", i);
  }
  CHECK(gpumem_allocation_size(gm, b) >= 3000 && gpumem_allocation_size(gm, x) == 3u << 20);
  gpumem_stats_t restored;
  gpumem_get_stats(gm, &restored);
  CHECK(cur(restored.allocated_bytes) == cur(at_checkpoint.allocated_bytes));
  CHECK(cur(restored.requested_bytes) == cur(at_checkpoint.requested_bytes));
  CHECK(cur(restored.allocation) == cur(at_checkpoint.allocation));
  CHECK(violations() == 0);

  /* A checkpoint can be restored again; then everything goes back. */
  CHECK_STATUS(gpumem_free(gm, a), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_restore(gm, 9, state, freed, 8, &nf, made, 8, &nm), GPUMEM_OK);
  CHECK(nf == 2 && nm == 3);
  CHECK(gpumem_check(gm) == 0);
  for (size_t k = 0; k < nm; k++) CHECK_STATUS(gpumem_free(gm, made[k]), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 9), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 9), GPUMEM_OK);
  CHECK_STATUS(gpumem_pool_restore(gm, 9, state, freed, 8, &nf, made, 8, &nm),
               GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "does not exist") != NULL);
  gpumem_pool_state_free(state);
  CHECK_STATUS(gpumem_pool_checkpoint(gm, 9, &state), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(state == NULL);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  gpumem_stats_t after;
  gpumem_get_stats(gm, &after);
  CHECK(cur(after.allocation) == cur(before.allocation));
  CHECK_MSG(cur(after.reserved_bytes) == cur(before.reserved_bytes),
            "reserved %lld before, %lld after", (long long)cur(before.reserved_bytes),
            (long long)cur(after.reserved_bytes));
  gpumem_destroy(gm);
}

static void test_bad_input(void) {
  gpumem_t* gm = make(&configs[1]);
  clear_error();
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 5), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "not being allocated to") != NULL);
  CHECK_STATUS(gpumem_release_pool(gm, 5), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "does not exist") != NULL);
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 0, NULL, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(gpumem_begin_allocate_to_pool_capture(gm, 5, 0), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 5, NULL, NULL), GPUMEM_OK);
  CHECK_STATUS(gpumem_begin_allocate_to_pool(gm, 5, NULL, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "already being allocated to") != NULL);
  CHECK_STATUS(gpumem_end_allocate_to_pool(gm, 5), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 5), GPUMEM_OK);
  CHECK_STATUS(gpumem_release_pool(gm, 5), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(gpumem_retain_pool(NULL, 1), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(gpumem_sim_end_capture(sim, S_MAIN), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
  /* A backend that cannot say which streams capture. */
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  gpumem_backend_t* plain = gpumem_sim_create(&so);
  plain->stream_capture_info = NULL;
  gpumem_options_t o;
  gpumem_options_init(&o);
  o.own_backend = 1;
  gm = gpumem_create(plain, &o, NULL);
  CHECK_STATUS(gpumem_begin_allocate_to_pool_capture(gm, 5, 1), GPUMEM_ERR_UNSUPPORTED);
  CHECK(strstr(gpumem_last_error(), "stream filter") != NULL);
  gpumem_destroy(gm);
}

/* ---- randomized ---- */

static uint64_t rng_state;
static uint64_t rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

#define MAX_LIVE 256
#define MAX_WATCH 4096

typedef struct watch {
  uintptr_t addr;
  size_t size;
  void* host; /* host memory behind addr at capture time */
  uint64_t pool;
} watch_t;

static size_t random_size(void) {
  switch (rnd() % 4) {
    case 0:
      return 1 + rnd() % 4096;
    case 1:
      return 1 + rnd() % (1 << 20);
    case 2:
      return (1 << 20) + rnd() % (6 << 20);
    default:
      return 512 * (1 + rnd() % 64);
  }
}

/* Pools of a run given a segment source: one fake each, failing at random. */
#define MAX_SOURCES 128
static fake_src_t run_src[MAX_SOURCES];
static uint64_t run_src_pool[MAX_SOURCES];
static size_t run_nsrc;

static fake_src_t* run_source_of(uint64_t pool) {
  for (size_t k = 0; k < run_nsrc; k++)
    if (run_src_pool[k] == pool) return &run_src[k];
  return NULL;
}

static void random_run(const config_t* c, uint64_t seed, int ops) {
  rng_state = seed * 2654435761u + 1;
  memset(run_src, 0, sizeof run_src);
  run_nsrc = 0;
  gpumem_t* gm = make(c);
  void* live[2 * MAX_LIVE]; /* (restores may add up to MAX_LIVE more) */
  size_t nlive = 0;
  static watch_t watch[MAX_WATCH];
  size_t nwatch = 0;
  uint64_t pools_live[8] = {0}; /* pool ids with a graph alive */
  uint64_t next_pool = 100, capture_id = 0, capturing_pool = 0;
  int failures_on = 0;
  size_t captured_allocs = 0, restores = 0;
  gpumem_pool_state_t* states[8] = {0}; /* a checkpoint of pools_live[k] */
  for (int op = 0; op < ops; op++) {
    unsigned what = (unsigned)(rnd() % 100);
    if (what < 45 && nlive < MAX_LIVE) {
      gpumem_stream_t s = rnd() % 4 ? S_MAIN : S_SIDE;
      void* p = NULL;
      gpumem_status_t st = gpumem_malloc(gm, random_size(), s, &p);
      CHECK_MSG(st == GPUMEM_OK || st == GPUMEM_ERR_OUT_OF_MEMORY || failures_on,
                "seed %llu op %d: %s", (unsigned long long)seed, op, gpumem_last_error());
      if (st == GPUMEM_OK) {
        live[nlive++] = p;
        if (rnd() % 8 == 0) gpumem_record_stream(gm, p, s == S_MAIN ? S_SIDE : S_MAIN);
        fake_src_t* fs = capturing_pool && s == S_MAIN ? run_source_of(capturing_pool) : NULL;
        if (fs) {
          /* (the source's memory is not the device's: nothing to watch) */
          CHECK_MSG(src_segment_of(fs, p, 1) != NULL,
                    "seed %llu op %d: pool %llu's allocation %p is not in its source's memory",
                    (unsigned long long)seed, op, (unsigned long long)capturing_pool, p);
          captured_allocs++;
        } else if (capturing_pool && s == S_MAIN && nwatch < MAX_WATCH) {
          void* host = gpumem_sim_host_ptr(sim, (uintptr_t)p);
          CHECK(host != NULL);
          watch[nwatch++] = (watch_t){(uintptr_t)p, 512, host, capturing_pool};
          captured_allocs++;
        }
      }
    } else if (what < 85 && nlive) {
      size_t i = rnd() % nlive;
      gpumem_status_t st = gpumem_free(gm, live[i]);
      CHECK_MSG(st == GPUMEM_OK || failures_on, "seed %llu op %d: %s", (unsigned long long)seed, op,
                gpumem_last_error());
      if (st == GPUMEM_OK) live[i] = live[--nlive];
    } else if (what < 90) {
      if (!capturing_pool) { /* begin a capture, into a new pool or a live one */
        uint64_t pool = 0;
        bool fresh = false;
        for (int k = 0; k < 8 && !pool; k++)
          if (pools_live[k] && rnd() % 3 == 0) pool = pools_live[k];
        if (!pool) {
          for (int k = 0; k < 8 && !pool; k++)
            if (!pools_live[k]) pool = pools_live[k] = next_pool++;
          fresh = pool != 0;
        }
        if (pool) {
          capture_id++;
          CHECK_STATUS(gpumem_sim_begin_capture(sim, S_MAIN, capture_id), GPUMEM_OK);
          CHECK_STATUS(gpumem_begin_allocate_to_pool_capture(gm, pool, capture_id), GPUMEM_OK);
          capturing_pool = pool;
          /* MemPool(allocator=...), on some new pools */
          if (fresh && run_nsrc < MAX_SOURCES && rnd() % 3 == 0) {
            run_src[run_nsrc].fail_one_in = 6;
            gpumem_segment_source_t src = source_of(&run_src[run_nsrc]);
            CHECK_STATUS(gpumem_pool_set_segment_source(gm, pool, &src), GPUMEM_OK);
            run_src_pool[run_nsrc++] = pool;
          }
          /* MemPool's options, on some pools */
          if (rnd() % 4 == 0) CHECK_STATUS(gpumem_pool_set_no_split(gm, pool, 1), GPUMEM_OK);
          if (rnd() % 3 == 0)
            CHECK_STATUS(gpumem_pool_set_use_on_oom(gm, pool, (int)(rnd() % 2)), GPUMEM_OK);
        }
      } else { /* end it */
        /* either order: torch ends the capture first */
        if (rnd() % 2) {
          CHECK_STATUS(gpumem_sim_end_capture(sim, S_MAIN), GPUMEM_OK);
          CHECK_STATUS(gpumem_end_allocate_to_pool(gm, capturing_pool), GPUMEM_OK);
        } else {
          CHECK_STATUS(gpumem_end_allocate_to_pool(gm, capturing_pool), GPUMEM_OK);
          CHECK_STATUS(gpumem_sim_end_capture(sim, S_MAIN), GPUMEM_OK);
        }
        capturing_pool = 0;
      }
    } else if (what < 93 && !capturing_pool) { /* a checkpoint of a pool, or back to it */
      int k = (int)(rnd() % 8);
      for (int t = 0; t < 8 && !pools_live[k]; t++) k = (k + 1) % 8;
      if (pools_live[k] && (!states[k] || rnd() % 2)) {
        gpumem_pool_state_free(states[k]);
        states[k] = NULL;
        CHECK_STATUS(gpumem_pool_checkpoint(gm, pools_live[k], &states[k]), GPUMEM_OK);
      } else if (states[k] && nlive + gpumem_pool_state_allocations(states[k]) <= 2 * MAX_LIVE) {
        void *freed[MAX_LIVE], *made[MAX_LIVE];
        size_t nf = 0, nm = 0;
        gpumem_status_t st = gpumem_pool_restore(gm, pools_live[k], states[k], freed, MAX_LIVE, &nf,
                                                 made, MAX_LIVE, &nm);
        CHECK_MSG(st == GPUMEM_OK || failures_on, "seed %llu op %d: %s", (unsigned long long)seed,
                  op, gpumem_last_error());
        restores += st == GPUMEM_OK;
        for (size_t f = 0; f < nf; f++) {
          size_t i = 0;
          while (i < nlive && live[i] != freed[f]) i++;
          CHECK_MSG(i < nlive, "seed %llu op %d: restore freed an address the test never had",
                    (unsigned long long)seed, op);
          if (i < nlive) live[i] = live[--nlive];
        }
        for (size_t m = 0; m < nm; m++) live[nlive++] = made[m];
      }
    } else if (what < 95 && !capturing_pool) { /* a graph is deleted */
      int k = (int)(rnd() % 8);
      if (pools_live[k]) {
        uint64_t pool = pools_live[k];
        gpumem_pool_state_free(states[k]);
        states[k] = NULL;
        gpumem_pool_info_t pi;
        gpumem_pool_info(gm, pool, &pi);
        for (int u = 0; u < pi.use_count; u++)
          CHECK_STATUS(gpumem_release_pool(gm, pool), GPUMEM_OK);
        pools_live[k] = 0;
        size_t kept = 0;
        for (size_t w = 0; w < nwatch; w++)
          if (watch[w].pool != pool) watch[kept++] = watch[w];
        nwatch = kept;
      }
    } else if (what < 97) {
      /* injected failures: any device call may fail for a while */
      if (!failures_on && rnd() % 2) {
        gpumem_sim_fail(sim, -1, (long)(rnd() % 20), (long)(1 + rnd() % 3), GPUMEM_ERR_BACKEND);
        failures_on = 1;
      } else {
        gpumem_sim_fail_clear(sim);
        failures_on = 0;
      }
    } else if (what < 99 && !capturing_pool) {
      gpumem_status_t st = gpumem_empty_cache(gm);
      CHECK(st == GPUMEM_OK || failures_on);
    }
    size_t bad = gpumem_check(gm);
    CHECK_MSG(bad == 0, "seed %llu op %d (%s): %s", (unsigned long long)seed, op, c->name,
              gpumem_last_error());
    if (bad) break;
    /* Every address a live graph was given is still on the same memory. */
    for (size_t w = 0; w < nwatch; w++) {
      void* host = gpumem_sim_host_ptr(sim, watch[w].addr);
      if (host != watch[w].host) {
        CHECK_MSG(host == watch[w].host, "seed %llu op %d: a graph's address 0x%lx moved",
                  (unsigned long long)seed, op, (unsigned long)watch[w].addr);
        op = ops;
        break;
      }
    }
  }
  gpumem_sim_fail_clear(sim);
  if (capturing_pool) {
    CHECK_STATUS(gpumem_end_allocate_to_pool(gm, capturing_pool), GPUMEM_OK);
    CHECK_STATUS(gpumem_sim_end_capture(sim, S_MAIN), GPUMEM_OK);
  }
  CHECK_MSG(violations() == 0, "seed %llu: %llu calls made during capture",
            (unsigned long long)seed, (unsigned long long)violations());
  CHECK(captured_allocs > 0);
  CHECK_MSG(restores > 0, "seed %llu: no pool was restored", (unsigned long long)seed);
  for (int k = 0; k < 8; k++) gpumem_pool_state_free(states[k]);
  while (nlive) CHECK_STATUS(gpumem_free(gm, live[--nlive]), GPUMEM_OK);
  for (int k = 0; k < 8; k++) {
    if (!pools_live[k]) continue;
    gpumem_pool_info_t pi;
    gpumem_pool_info(gm, pools_live[k], &pi);
    for (int u = 0; u < pi.use_count; u++) gpumem_release_pool(gm, pools_live[k]);
    gpumem_pool_info(gm, pools_live[k], &pi);
    CHECK_MSG(!pi.exists, "seed %llu: pool %llu survives its release with nothing live",
              (unsigned long long)seed, (unsigned long long)pools_live[k]);
  }
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  /* Every pool deleted along the way went back too, whether its last
   * block was freed directly or waited for another stream's work, or a
   * device failure stopped its release (empty_cache tries again). */
  for (uint64_t id = 100; id < next_pool; id++) {
    gpumem_pool_info_t pi;
    gpumem_pool_info(gm, id, &pi);
    CHECK_MSG(!pi.exists, "seed %llu: pool %llu survives its release with nothing live",
              (unsigned long long)seed, (unsigned long long)id);
  }
  CHECK(gpumem_check(gm) == 0);
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  CHECK(cur(st.allocation) == 0 && cur(st.active) == 0);
  /* Every source segment went back, and each source was released once. */
  CHECK_MSG(run_nsrc > 0, "seed %llu: no pool had a segment source", (unsigned long long)seed);
  uint64_t src_allocs = 0;
  for (size_t k = 0; k < run_nsrc; k++) {
    src_allocs += run_src[k].allocs;
    CHECK_MSG(run_src[k].live == 0 && run_src[k].releases == 1,
              "seed %llu: pool %llu's source has %zu segments out and was released %llu times",
              (unsigned long long)seed, (unsigned long long)run_src_pool[k], run_src[k].live,
              (unsigned long long)run_src[k].releases);
  }
  CHECK_MSG(src_allocs > 0, "seed %llu: no source was asked for a segment",
            (unsigned long long)seed);
  gpumem_destroy(gm);
  for (size_t k = 0; k < run_nsrc; k++) CHECK(run_src[k].releases == 1);
}

int main(int argc, char** argv) {
  const char* only = NULL;
  for (int i = 1; i + 1 < argc; i++)
    if (!strcmp(argv[i], "--config")) only = argv[i + 1];
  const char* seed_env = getenv("GPUMEM_RANDOM_SEED");
  uint64_t first_seed = seed_env ? strtoull(seed_env, NULL, 10) : 1;
  int seeds = seed_env ? 1 : 6;
  for (size_t k = 0; k < sizeof configs / sizeof configs[0]; k++) {
    const config_t* c = &configs[k];
    if (only && strcmp(only, c->name)) continue;
    test_capture_and_release(c);
    test_deferred_free(c);
    test_capture_unseen_streams(c);
    test_mempool(c);
    test_checkpoint(c);
    test_no_split(c);
    test_use_on_oom(c);
    test_source_basics(c);
    test_source_failures(c);
    test_source_lifetime(c);
    test_source_refusals(c);
    test_source_options(c);
    for (int s = 0; s < seeds; s++) random_run(c, first_seed + (uint64_t)s, 3000);
  }
  if (!only) test_bad_input();
  return test_finish("test_graphpool");
}
