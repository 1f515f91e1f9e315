/* The allocator on a real GPU, through the CUDA backend, under both
 * policies: every byte handed out is usable and no two live blocks share a
 * byte; blocks freed while other streams still work on them are never
 * handed out (or their pages moved) before that work is done; out of
 * memory at the device's real limit is reported and recovered from; the
 * driver's free-memory count agrees with the allocator's reserved bytes;
 * empty_cache gives memory back; a limit holds while the device has room.
 * Exits 77 (skipped) where no driver or GPU exists.
 *
 * The GPU work (memsets, copies, streams) goes through the driver API,
 * opened with dlopen as the backend does; the test links with neither the
 * CUDA runtime nor cuda.h: the binding (cuda_driver.h) declares the few
 * types it needs with their ABI.
 *
 * Environment: GPUMEM_TEST_MEMINFO_TOL_MIB widens the tolerance between the
 * driver's and the allocator's counts (compute-sanitizer holds device
 * memory of its own; the tolerance widens by itself when it is detected);
 * GPUMEM_TEST_QUICK=1 runs fewer random operations (for slow tools);
 * GPUMEM_TEST_NO_DRIVER_ERRORS=1 leaves out test_oom (cuda_driver.h). */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"
#include "cuda_driver.h"

#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

static size_t device_free(void) {
  size_t fr = 0, tot = 0;
  DRV_OK(drv.MemGetInfo(&fr, &tot));
  return fr;
}

static size_t device_total(void) {
  size_t fr = 0, tot = 0;
  DRV_OK(drv.MemGetInfo(&fr, &tot));
  return tot;
}

/* ---- helpers ------------------------------------------------------------ */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

static int contains_nocase(const char* hay, const char* needle) {
  size_t n = strlen(needle);
  for (; *hay; hay++) {
    size_t i = 0;
    while (i < n && hay[i] && tolower((unsigned char)hay[i]) == tolower((unsigned char)needle[i]))
      i++;
    if (i == n) return 1;
  }
  return n == 0;
}

static unsigned char* scratch; /* 8 MiB host staging buffer */
#define SCRATCH (8 * MIB)

static void fill_pattern(uintptr_t addr, size_t len, unsigned seed) {
  for (size_t off = 0; off < len; off += SCRATCH) {
    size_t n = len - off < SCRATCH ? len - off : SCRATCH;
    for (size_t i = 0; i < n; i++) scratch[i] = pattern_byte(off + i, seed);
    DRV_OK(drv.MemcpyHtoD((drv_ptr)(addr + off), scratch, n));
  }
}

static size_t check_pattern(uintptr_t addr, size_t len, unsigned seed) {
  size_t bad = 0;
  for (size_t off = 0; off < len; off += SCRATCH) {
    size_t n = len - off < SCRATCH ? len - off : SCRATCH;
    DRV_OK(drv.MemcpyDtoH(scratch, (drv_ptr)(addr + off), n));
    for (size_t i = 0; i < n; i++) bad += scratch[i] != pattern_byte(off + i, seed);
  }
  return bad;
}

static size_t check_value(uintptr_t addr, size_t len, unsigned char value) {
  size_t bad = 0;
  for (size_t off = 0; off < len; off += SCRATCH) {
    size_t n = len - off < SCRATCH ? len - off : SCRATCH;
    DRV_OK(drv.MemcpyDtoH(scratch, (drv_ptr)(addr + off), n));
    for (size_t i = 0; i < n; i++) bad += scratch[i] != value;
  }
  return bad;
}

static const char* policy_name(int policy) {
  return policy == GPUMEM_POLICY_PYTORCH ? "pytorch" : "default";
}

/* An allocator with options o over a fresh CUDA backend it owns; NULL
 * (with a failed check naming what) when it cannot be made. */
static gpumem_t* make_with(gpumem_options_t o, int virtual_memory, const char* what) {
  gpumem_cuda_options_t co;
  gpumem_cuda_options_init(&co);
  co.virtual_memory = virtual_memory;
  gpumem_status_t st = GPUMEM_OK;
  gpumem_backend_t* be = gpumem_cuda_create(&co, &st);
  CHECK_MSG(be != NULL, "gpumem_cuda_create: %s (%s)", gpumem_strerror(st), gpumem_last_error());
  if (!be) return NULL;
  o.own_backend = 1;
  gpumem_t* gm = gpumem_create(be, &o, &st);
  CHECK_MSG(gm != NULL, "gpumem_create(%s, %s): %s (%s)", be->name, what, gpumem_strerror(st),
            gpumem_last_error());
  if (!gm) gpumem_cuda_destroy(be);
  return gm;
}

/* (map_max_bytes 0: the default's) */
static gpumem_t* make_mapped(int policy, int virtual_memory, gpumem_placement_t placement,
                             size_t map_max_bytes) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  o.policy = (gpumem_policy_t)policy;
  o.placement = placement;
  if (map_max_bytes) o.map_max_bytes = map_max_bytes;
  return make_with(o, virtual_memory, policy_name(policy));
}

/* Virtual memory, under the configuration conf. */
static gpumem_t* make_conf(const char* conf) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, conf), GPUMEM_OK);
  return make_with(o, 1, conf);
}

static gpumem_t* make(int policy, int virtual_memory) {
  return make_mapped(policy, virtual_memory, GPUMEM_PLACEMENT_AUTO, 0);
}

static size_t reserved_now(gpumem_t* gm) {
  gpumem_stats_t s;
  gpumem_get_stats(gm, &s);
  return (size_t)s.reserved_bytes[GPUMEM_POOL_ALL].current;
}

/* Driver overhead allowed between cuMemGetInfo and reserved_bytes: page
 * tables and the driver's own bookkeeping for the mappings stay well under
 * 64 MiB for the few GiB these tests hold; compute-sanitizer keeps device
 * memory of its own, so under it the bound is looser. */
static size_t meminfo_tolerance(void) {
  const char* env = getenv("GPUMEM_TEST_MEMINFO_TOL_MIB");
  if (env && *env) return (size_t)strtoull(env, NULL, 10) * MIB;
  const char* inj = getenv("CUDA_INJECTION64_PATH");
  const char* pre = getenv("LD_PRELOAD");
  if ((inj && strstr(inj, "anitizer")) || (pre && strstr(pre, "anitizer"))) return 1024 * MIB;
  return 64 * MIB;
}

/* Whether the device offers virtual memory (the backend is "cuda"). */
static int have_vmm;

static size_t absdiff(size_t a, size_t b) {
  return a > b ? a - b : b - a;
}

/* ---- every byte usable, no overlap ------------------------------------- */

typedef struct live_block {
  uintptr_t addr;
  size_t size;
  unsigned seed;
} live_block;

static size_t random_size(void) {
  uint64_t r = rng();
  if (r % 20 == 0) return 64 * MIB + (size_t)(rng() % (240 * MIB)); /* a few large ones */
  unsigned bits = (unsigned)(rng() % 25);                           /* 1 B .. 16 MiB */
  return 1 + (size_t)(rng() % ((uint64_t)1 << bits));
}

static void test_patterns(int policy, int virtual_memory) {
  gpumem_t* gm = make(policy, virtual_memory);
  if (!gm) return;
  enum { MAX_LIVE = 160 };
  const char* quick = getenv("GPUMEM_TEST_QUICK");
  const int n_ops = quick && *quick == '1' ? 150 : 500;
  live_block live[MAX_LIVE];
  int n = 0;
  unsigned seed = 1;
  size_t bad_total = 0, overlaps = 0, misaligned = 0, wrong_size = 0;
  for (int op = 0; op < n_ops; op++) {
    int do_free = n == MAX_LIVE || (n > 0 && rng() % 100 < 45);
    if (do_free) {
      int k = (int)(rng() % (uint64_t)n);
      /* Before it goes back, it still holds exactly what was written. */
      bad_total += check_pattern(live[k].addr, live[k].size, live[k].seed);
      CHECK_STATUS(gpumem_free(gm, (void*)live[k].addr), GPUMEM_OK);
      live[k] = live[--n];
    } else {
      size_t size = random_size();
      void* p = NULL;
      gpumem_status_t st = gpumem_malloc(gm, size, 0, &p);
      CHECK_MSG(st == GPUMEM_OK && p, "malloc(%zu): %s (%s)", size, gpumem_strerror(st),
                gpumem_last_error());
      if (st != GPUMEM_OK || !p) break;
      uintptr_t a = (uintptr_t)p;
      misaligned += a % 256 != 0;
      wrong_size += gpumem_allocation_size(gm, p) != size;
      for (int i = 0; i < n; i++)
        overlaps += a < live[i].addr + live[i].size && live[i].addr < a + size;
      live[n].addr = a;
      live[n].size = size;
      live[n].seed = seed++;
      fill_pattern(a, size, live[n].seed);
      n++;
    }
    if (op % 50 == 0) CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
  }
  for (int i = 0; i < n; i++) bad_total += check_pattern(live[i].addr, live[i].size, live[i].seed);
  CHECK_MSG(bad_total == 0, "%s/%s: %zu bytes differ from what was written", policy_name(policy),
            virtual_memory ? "vmm" : "plain", bad_total);
  CHECK_MSG(overlaps == 0, "%zu overlapping live blocks", overlaps);
  CHECK_MSG(misaligned == 0, "%zu blocks not 256-byte aligned", misaligned);
  CHECK_MSG(wrong_size == 0, "%zu blocks with a wrong allocation_size", wrong_size);
  for (int i = 0; i < n; i++) CHECK_STATUS(gpumem_free(gm, (void*)live[i].addr), GPUMEM_OK);
  CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
  gpumem_stats_t s;
  gpumem_get_stats(gm, &s);
  CHECK(s.allocated_bytes[GPUMEM_POOL_ALL].current == 0);
  CHECK(s.virtual_memory == (virtual_memory && have_vmm && policy == GPUMEM_POLICY_DEFAULT));
  printf("patterns %s/%s: %d ops, peak reserved %.1f MiB, peak allocated %.1f MiB\n",
         policy_name(policy), virtual_memory ? "vmm" : "plain", n_ops,
         (double)s.reserved_bytes[0].peak / MIB, (double)s.allocated_bytes[0].peak / MIB);
  gpumem_destroy(gm);
}

/* ---- the driver's count, empty_cache, limits --------------------------- */

static void test_meminfo_and_empty_cache(int policy) {
  gpumem_t* gm = make(policy, 1);
  if (!gm) return;
  const size_t tol = meminfo_tolerance();
  const size_t free0 = device_free(); /* baseline: context and allocator exist */
  enum { N = 40 };
  void* p[N] = {0};
  for (int i = 0; i < N; i++) {
    /* 20 blocks of 100..150 MiB and 20 small ones. */
    size_t size = i % 2 ? (100 + (size_t)(rng() % 51)) * MIB : 1 + (size_t)(rng() % (2 * MIB));
    CHECK_STATUS(gpumem_malloc(gm, size, 0, &p[i]), GPUMEM_OK);
    if (p[i]) DRV_OK(drv.MemsetD8((drv_ptr)(uintptr_t)p[i], 0x11, size));
  }
  DRV_OK(drv.CtxSynchronize());
  size_t free1 = device_free(), reserved1 = reserved_now(gm);
  size_t used1 = free0 > free1 ? free0 - free1 : 0;
  printf("meminfo %s: device used %.1f MiB, reserved %.1f MiB (tolerance %.0f MiB)\n",
         policy_name(policy), (double)used1 / MIB, (double)reserved1 / MIB, (double)tol / MIB);
  CHECK_MSG(absdiff(used1, reserved1) <= tol, "device used %zu vs reserved %zu", used1, reserved1);
  CHECK(reserved1 >= 20 * 100 * MIB);

  /* Free half, in a scattered order: the cache keeps what it keeps, but the
   * two counts still agree. */
  for (int i = 0; i < N; i += 2) CHECK_STATUS(gpumem_free(gm, p[i]), GPUMEM_OK);
  for (int i = 3; i < N; i += 4) CHECK_STATUS(gpumem_free(gm, p[i]), GPUMEM_OK);
  size_t free2 = device_free(), reserved2 = reserved_now(gm);
  size_t used2 = free0 > free2 ? free0 - free2 : 0;
  CHECK_MSG(absdiff(used2, reserved2) <= tol, "after frees: device used %zu vs reserved %zu", used2,
            reserved2);
  for (int i = 1; i < N; i += 4) CHECK_STATUS(gpumem_free(gm, p[i]), GPUMEM_OK);

  /* Nothing live: empty_cache gives every byte back. */
  size_t free3 = device_free(), reserved3 = reserved_now(gm);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  size_t free4 = device_free(), reserved4 = reserved_now(gm);
  printf("empty_cache %s: reserved %.1f -> %.1f MiB, device free +%.1f MiB\n", policy_name(policy),
         (double)reserved3 / MIB, (double)reserved4 / MIB,
         ((double)free4 - (double)free3) / (double)MIB);
  CHECK_MSG(reserved4 == 0, "reserved after empty_cache with nothing live: %zu", reserved4);
  CHECK_MSG(free4 + tol >= free0, "device free back to baseline: %zu vs %zu", free4, free0);
  CHECK_MSG(free4 + tol >= free3 + reserved3, "empty_cache returned %zu of %zu cached",
            free4 > free3 ? free4 - free3 : 0, reserved3);
  CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
  gpumem_destroy(gm);
}

static void test_limit(int policy) {
  gpumem_t* gm = make(policy, 1);
  if (!gm) return;
  CHECK_STATUS(gpumem_set_limit(gm, 2 * GIB), GPUMEM_OK);
  CHECK(gpumem_get_limit(gm) == 2 * GIB);
  void* a = NULL;
  void* b = NULL;
  CHECK_STATUS(gpumem_malloc(gm, GIB, 0, &a), GPUMEM_OK);
  CHECK_MSG(device_free() > 4 * GIB, "the device has room beyond the limit");
  gpumem_status_t st = gpumem_malloc(gm, 3 * GIB / 2, 0, &b);
  CHECK_MSG(st == GPUMEM_ERR_OUT_OF_MEMORY, "malloc beyond the limit -> %s", gpumem_strerror(st));
  CHECK(b == NULL);
  CHECK_MSG(gpumem_last_error()[0] != '\0', "an explanation is left");
  printf("limit %s: %s\n", policy_name(policy), gpumem_last_error());
  CHECK(reserved_now(gm) <= 2 * GIB);
  CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
  /* Under the limit still works. */
  CHECK_STATUS(gpumem_malloc(gm, 512 * MIB, 0, &b), GPUMEM_OK);
  CHECK(reserved_now(gm) <= 2 * GIB);
  CHECK_STATUS(gpumem_free(gm, b), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, a), GPUMEM_OK);
  /* A limit of 0 is refused (it would refuse everything); lifted, the
   * same request passes. */
  CHECK_STATUS(gpumem_set_limit(gm, 0), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(gpumem_get_limit(gm) == 2 * GIB);
  gpumem_remove_limit(gm);
  CHECK(gpumem_get_limit(gm) == 0);
  CHECK_STATUS(gpumem_malloc(gm, 3 * GIB, 0, &b), GPUMEM_OK);
  if (b) DRV_OK(drv.MemsetD8((drv_ptr)(uintptr_t)b, 0x21, 3 * GIB));
  CHECK_STATUS(gpumem_free(gm, b), GPUMEM_OK);
  CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
  gpumem_destroy(gm);
}

/* ---- a partly used page shared by a request (an alias) ------------------ */

/* Pages 0-3 hold x1 [0, 2p) and x3 [2.75p, 4p); page 2's first 0.75p are a
 * hole. Under a limit of 6 pages a 2.5-page request fits at the tail only
 * with its last page (ending 0.5p in) mapped to page 2's physical page:
 * the same bytes through two addresses, on the real device. */
static void test_alias(void) {
  /* (single-page mappings: a page is aliased only where it is a mapping of
   * its own, as under the limit set below; with no limit the run x1-x3
   * would map pages ahead of itself in one mapping) */
  gpumem_t* gm = make_mapped(GPUMEM_POLICY_DEFAULT, 1, GPUMEM_PLACEMENT_AUTO, 2 * MIB);
  if (!gm) return;
  gpumem_stats_t s;
  gpumem_get_stats(gm, &s);
  size_t ps = s.page_size;
  void *x1 = NULL, *x2 = NULL, *x3 = NULL, *r = NULL;
  CHECK_STATUS(gpumem_malloc(gm, 2 * ps, 0, &x1), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 3 * ps / 4, 0, &x2), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 5 * ps / 4, 0, &x3), GPUMEM_OK);
  uintptr_t a1 = (uintptr_t)x1, a3 = (uintptr_t)x3;
  if (!x1 || !x2 || !x3 || (uintptr_t)x2 != a1 + 2 * ps || a3 != a1 + 11 * ps / 4 || a1 % ps) {
    CHECK_MSG(0, "alias: blocks not laid out as planned");
    gpumem_destroy(gm);
    return;
  }
  CHECK_STATUS(gpumem_free(gm, x2), GPUMEM_OK);
  CHECK_STATUS(gpumem_set_limit(gm, 6 * ps), GPUMEM_OK);
  fill_pattern(a1, 2 * ps, 11);
  fill_pattern(a3, 5 * ps / 4, 13);
  for (int round = 0; round < 2; round++) {
    CHECK_STATUS(gpumem_malloc(gm, 5 * ps / 2, 0, &r), GPUMEM_OK);
    if (!r) break;
    uintptr_t ar = (uintptr_t)r;
    gpumem_get_stats(gm, &s);
    CHECK_MSG(ar == a1 + 4 * ps && s.num_pages_aliased == round + 1 &&
                  (size_t)s.reserved_bytes[GPUMEM_POOL_ALL].current == 6 * ps,
              "alias: at 0x%lx, %lld shared, %lld reserved", (unsigned long)ar,
              (long long)s.num_pages_aliased, (long long)s.reserved_bytes[GPUMEM_POOL_ALL].current);
    CHECK_MSG(gpumem_check(gm) == 0, "alias: %s", gpumem_last_error());
    fill_pattern(ar, 5 * ps / 2, 17 + (unsigned)round);
    /* Its last half page is page 2's first half, read through x1's arena. */
    DRV_OK(drv.MemsetD8((drv_ptr)(ar + 2 * ps), 0x5A, ps / 2));
    CHECK_MSG(check_value(a1 + 2 * ps, ps / 2, 0x5A) == 0,
              "alias: the shared bytes differ between the two addresses");
    CHECK_MSG(check_pattern(a1, 2 * ps, 11) == 0 && check_pattern(a3, 5 * ps / 4, 13) == 0,
              "alias: writing the request changed its neighbours' bytes");
    CHECK_MSG(check_pattern(ar, 2 * ps, 17 + (unsigned)round) == 0,
              "alias: the request's own pages changed");
    CHECK_STATUS(gpumem_free(gm, r), GPUMEM_OK);
    CHECK_MSG(gpumem_check(gm) == 0, "alias, freed: %s", gpumem_last_error());
  }
  CHECK_STATUS(gpumem_free(gm, x3), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, x1), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK_MSG(gpumem_check(gm) == 0, "alias, emptied: %s", gpumem_last_error());
  gpumem_destroy(gm);
}

/* ---- out of memory at the device's real limit -------------------------- */

static void test_oom(int policy) {
  gpumem_t* gm = make(policy, 1);
  if (!gm) return;
  const size_t free0 = device_free();
  const int max_blocks = (int)(device_total() / GIB) + 8;
  void** blocks = calloc((size_t)max_blocks, sizeof *blocks);
  if (!blocks) return;
  int n = 0;
  gpumem_status_t st = GPUMEM_OK;
  char report[4096] = "";
  while (n < max_blocks) {
    void* p = NULL;
    st = gpumem_malloc(gm, GIB, 0, &p);
    if (st != GPUMEM_OK) {
      snprintf(report, sizeof report, "%s", gpumem_last_error());
      break;
    }
    /* Touch both ends: the memory is really there. */
    DRV_OK(drv.MemsetD8((drv_ptr)(uintptr_t)p, 0x5A, MIB));
    DRV_OK(drv.MemsetD8((drv_ptr)((uintptr_t)p + GIB - MIB), 0x5A, MIB));
    blocks[n++] = p;
  }
  printf("oom %s: %d x 1 GiB before %s (device had %.2f GiB free)\n%s\n", policy_name(policy), n,
         gpumem_strerror(st), (double)free0 / GIB, report);
  CHECK_MSG(st == GPUMEM_ERR_OUT_OF_MEMORY, "filling the device ends in out of memory, got %s",
            gpumem_strerror(st));
  CHECK_MSG(report[0] != '\0' && contains_nocase(report, "out of memory"),
            "the report explains: \"%s\"", report);
  /* The allocator used the device: at most one block's worth plus the
   * driver's share left unused. */
  CHECK_MSG((size_t)n + 2 >= free0 / GIB, "%d blocks of 1 GiB with %zu bytes free", n, free0);
  CHECK_MSG(gpumem_check(gm) == 0, "consistent after OOM: %s", gpumem_last_error());
  gpumem_stats_t s;
  gpumem_get_stats(gm, &s);
  CHECK(s.num_ooms >= 1);
  CHECK(s.allocated_bytes[0].current == (int64_t)n * (int64_t)GIB);
  for (int i = 0; i < n; i++) {
    unsigned char h[16];
    DRV_OK(drv.MemcpyDtoH(h, (drv_ptr)((uintptr_t)blocks[i] + GIB - sizeof h), sizeof h));
    CHECK(h[0] == 0x5A && h[15] == 0x5A);
    CHECK_STATUS(gpumem_free(gm, blocks[i]), GPUMEM_OK);
  }
  CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
  /* Recovered: a fresh allocation succeeds, and a big one too. */
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, GIB, 0, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, (size_t)(n / 2) * GIB, 0, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK_MSG(device_free() + meminfo_tolerance() >= free0, "all memory back after empty_cache");
  free(blocks);
  gpumem_destroy(gm);
}

/* ---- streams ------------------------------------------------------------ */

/* Of n blocks (both streams idle), those that do not hold value v
 * throughout; then each is freed while stream s still writes it. */
static size_t check_then_free_busy(gpumem_t* gm, void** blk, const size_t* len, int n,
                                   unsigned char v, drv_stream s) {
  size_t bad = 0;
  for (int k = 0; k < n; k++)
    if (blk[k]) bad += check_value((uintptr_t)blk[k], len[k], v) != 0;
  for (int k = 0; k < n; k++) {
    if (blk[k]) queue_busy_work((uintptr_t)blk[k], len[k], s, 40);
    CHECK_STATUS(gpumem_free(gm, blk[k]), GPUMEM_OK);
  }
  return bad;
}

/* A step on two streams that peak apart (the side stream's blocks are
 * freed before the main stream allocates): the plan gives both one arena,
 * so each stream's blocks take memory the other's work, still queued, is
 * writing. The device must order it (stream waits): once both streams are
 * idle, every block holds what its own stream wrote last, not the other
 * stream's late writes. */
static void test_shared_plan(void) {
  /* planned placement asked for: uncapped, the default places by best fit */
  gpumem_t* gm = make_mapped(GPUMEM_POLICY_DEFAULT, 1, GPUMEM_PLACEMENT_PLANNED, 0);
  if (!gm) return;
  drv_stream sa = NULL, sb = NULL;
  DRV_OK(drv.StreamCreate(&sa, DRV_STREAM_NON_BLOCKING));
  DRV_OK(drv.StreamCreate(&sb, DRV_STREAM_NON_BLOCKING));
  const gpumem_stream_t ga = (gpumem_stream_t)sa, gb = (gpumem_stream_t)sb;
  size_t bad_a = 0, bad_b = 0;
  for (int it = 0; it < 30; it++) {
    void* b[3] = {NULL, NULL, NULL};
    void* a[4] = {NULL, NULL, NULL, NULL};
    size_t bsz[3], asz[4];
    unsigned char vb = (unsigned char)(0x10 + it), va = (unsigned char)(0x80 + it);
    /* The side stream takes memory the main stream's last step is still
     * writing (queued below, at the end of the step before). */
    for (int k = 0; k < 3; k++) {
      bsz[k] = (16 + 8 * (size_t)k) * MIB;
      CHECK_STATUS(gpumem_malloc(gm, bsz[k], gb, &b[k]), GPUMEM_OK);
      if (!b[k]) continue;
      queue_busy_work((uintptr_t)b[k], bsz[k], sb, 8);
      DRV_OK(drv.MemsetD8Async((drv_ptr)(uintptr_t)b[k], vb, bsz[k], sb));
    }
    DRV_OK(drv.StreamSynchronize(sb));
    DRV_OK(drv.StreamSynchronize(sa));
    bad_b += check_then_free_busy(gm, b, bsz, 3, vb, sb);
    for (int k = 0; k < 4; k++) {
      asz[k] = (24 + 8 * (size_t)k) * MIB + 512;
      CHECK_STATUS(gpumem_malloc(gm, asz[k], ga, &a[k]), GPUMEM_OK);
      if (a[k]) DRV_OK(drv.MemsetD8Async((drv_ptr)(uintptr_t)a[k], va, asz[k], sa));
    }
    DRV_OK(drv.StreamSynchronize(sa));
    DRV_OK(drv.StreamSynchronize(sb));
    bad_a += check_then_free_busy(gm, a, asz, 4, va, sa);
    CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
  }
  DRV_OK(drv.StreamSynchronize(sa));
  DRV_OK(drv.StreamSynchronize(sb));
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  printf(
      "shared plan: %lld plans (%lld shared), %lld planned allocations, %llu stream waits, "
      "%llu event records, %lld syncs; blocks overwritten: main %zu, side %zu\n",
      (long long)st.num_plans, (long long)st.num_plans_shared, (long long)st.num_planned_allocs,
      (unsigned long long)st.backend_calls[GPUMEM_CALL_stream_wait],
      (unsigned long long)st.backend_calls[GPUMEM_CALL_event_record], (long long)st.num_syncs,
      bad_a, bad_b);
  CHECK_MSG(st.num_plans_shared >= 1 && st.num_planned_allocs >= 100 &&
                st.backend_calls[GPUMEM_CALL_stream_wait] > 0,
            "the step was not served by a shared plan");
  CHECK_MSG(bad_a == 0 && bad_b == 0,
            "a block took memory before the other stream's work on it was done: %zu main, %zu "
            "side blocks overwritten",
            bad_a, bad_b);
  gpumem_destroy(gm);
  DRV_OK(drv.StreamDestroy(sa));
  DRV_OK(drv.StreamDestroy(sb));
}

/* Uncapped, with lend:on, a stream whose arena must grow borrows another stream's free
 * block only once that stream's work up to its last free is known done
 * (an event queried): while the lender's queued work still writes the
 * blocks it freed, the borrower must not get them; once the lender is
 * idle, it does, and no stream waits for another. Each round the lender
 * frees 160 MiB still being written, the borrower takes two blocks (its
 * first growth, then, the lender idle and a millisecond later, one its
 * arena has no room for), and once both streams are idle every block holds
 * what its own stream wrote. With lend:ordered (ordered true) the borrower
 * takes the lender's blocks while the lender still writes them: its work
 * waits on the device for the lender's (one stream wait a round at most,
 * none where the lender's probe is complete already), and the same check
 * of what each block holds says whether the device kept them apart; then
 * the borrower takes a block again, frees it while still writing it, and
 * the lender takes its whole hole back: its work must come after those
 * writes (the lender's catch-up, one more stream wait a round). */
static void test_lend(bool ordered) {
  int rounds = 6;
  size_t bad_borrower = 0, bad_lender = 0, overlapped = 0;
  long long lent = 0;
  unsigned long long waits = 0;
  for (int it = 0; it < rounds; it++) {
    gpumem_t* gm = make_conf(ordered ? "policy:default,lend:ordered" : "policy:default,lend:on");
    if (!gm) return;
    drv_stream sa = NULL, sb = NULL;
    DRV_OK(drv.StreamCreate(&sa, DRV_STREAM_NON_BLOCKING));
    DRV_OK(drv.StreamCreate(&sb, DRV_STREAM_NON_BLOCKING));
    const gpumem_stream_t ga = (gpumem_stream_t)sa, gb = (gpumem_stream_t)sb;
    void* a[2] = {NULL, NULL};
    size_t asz[2] = {64 * MIB, 96 * MIB};
    unsigned char va = (unsigned char)(0x40 + it), vb = (unsigned char)(0xC0 + it);
    for (int k = 0; k < 2; k++) CHECK_STATUS(gpumem_malloc(gm, asz[k], ga, &a[k]), GPUMEM_OK);
    DRV_OK(drv.StreamSynchronize(sa));
    for (int k = 0; k < 2; k++) {
      if (!a[k]) continue;
      queue_busy_work((uintptr_t)a[k], asz[k], sa, 40);
      DRV_OK(drv.MemsetD8Async((drv_ptr)(uintptr_t)a[k], va, asz[k], sa));
      CHECK_STATUS(gpumem_free(gm, a[k]), GPUMEM_OK); /* still being written */
    }
    void* b[2] = {NULL, NULL};
    size_t bsz[2] = {48 * MIB, 64 * MIB};
    CHECK_STATUS(gpumem_malloc(gm, bsz[0], gb, &b[0]), GPUMEM_OK); /* the lender is busy */
    if (b[0]) DRV_OK(drv.MemsetD8Async((drv_ptr)(uintptr_t)b[0], vb, bsz[0], sb));
    DRV_OK(drv.StreamSynchronize(sa));
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
    CHECK_STATUS(gpumem_malloc(gm, bsz[1], gb, &b[1]), GPUMEM_OK); /* the lender is idle */
    if (b[1]) DRV_OK(drv.MemsetD8Async((drv_ptr)(uintptr_t)b[1], vb, bsz[1], sb));
    DRV_OK(drv.StreamSynchronize(sb));
    DRV_OK(drv.StreamSynchronize(sa));
    for (int k = 0; k < 2; k++) {
      if (!b[k]) continue;
      bad_borrower += check_value((uintptr_t)b[k], bsz[k], vb) != 0;
      CHECK_STATUS(gpumem_free(gm, b[k]), GPUMEM_OK);
    }
    if (ordered) {
      /* The borrower takes one again (its own stream order) and frees it
       * while still writing it; the lender then takes its whole hole back
       * and must be ordered after those writes. */
      void* c = NULL;
      CHECK_STATUS(gpumem_malloc(gm, bsz[1], gb, &c), GPUMEM_OK);
      if (c) {
        queue_busy_work((uintptr_t)c, bsz[1], sb, 40);
        CHECK_STATUS(gpumem_free(gm, c), GPUMEM_OK);
      }
      void* d = NULL;
      const size_t dsz = asz[0] + asz[1];
      const unsigned char vd = (unsigned char)(0xE0 + it);
      CHECK_STATUS(gpumem_malloc(gm, dsz, ga, &d), GPUMEM_OK);
      if (d) DRV_OK(drv.MemsetD8Async((drv_ptr)(uintptr_t)d, vd, dsz, sa));
      DRV_OK(drv.StreamSynchronize(sa));
      DRV_OK(drv.StreamSynchronize(sb));
      if (d) {
        overlapped += c && (uintptr_t)d <= (uintptr_t)c && (uintptr_t)c < (uintptr_t)d + dsz;
        bad_lender += check_value((uintptr_t)d, dsz, vd) != 0;
        CHECK_STATUS(gpumem_free(gm, d), GPUMEM_OK);
      }
    }
    CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
    gpumem_stats_t st;
    gpumem_get_stats(gm, &st);
    lent += st.num_blocks_lent;
    waits += st.backend_calls[GPUMEM_CALL_stream_wait];
    gpumem_destroy(gm);
    DRV_OK(drv.StreamDestroy(sa));
    DRV_OK(drv.StreamDestroy(sb));
  }
  printf(
      "lend:%s: %d rounds, %lld blocks lent, %llu stream waits, borrower blocks overwritten "
      "%zu; lender blocks over the borrower's last %zu, overwritten %zu\n",
      ordered ? "ordered" : "on", rounds, lent, waits, bad_borrower, overlapped, bad_lender);
  CHECK_MSG(bad_borrower == 0,
            "a borrowed block was handed out while its lender's work still wrote it (%zu blocks)",
            bad_borrower);
  if (ordered) {
    CHECK_MSG(lent == 3LL * rounds && waits > (unsigned long long)rounds &&
                  waits <= 2ULL * (unsigned long long)rounds,
              "lend:ordered: %lld blocks lent in %d rounds (not 3 a round), %llu stream waits",
              lent, rounds, waits);
    CHECK_MSG(overlapped == (size_t)rounds && bad_lender == 0,
              "lend:ordered: the lender's block covered the borrower's last in %zu of %d rounds; "
              "%zu were overwritten by the borrower's late writes",
              overlapped, rounds, bad_lender);
  } else {
    CHECK_MSG(lent >= rounds && waits == 0, "%lld blocks lent in %d rounds, %llu stream waits",
              lent, rounds, waits);
  }
}

/* A block freed while another stream (record_stream) still writes it must
 * not be handed out, on its own stream or any other, before that work is
 * done; a block on its own stream may be reused at once (stream order
 * protects it). After all syncs, every block holds what its last user
 * wrote: a premature reuse shows as the busy stream's bytes. */
static void test_streams(int policy) {
  gpumem_t* gm = make(policy, 1);
  if (!gm) return;
  drv_stream s1 = NULL, s2 = NULL, s3 = NULL;
  DRV_OK(drv.StreamCreate(&s1, DRV_STREAM_NON_BLOCKING));
  DRV_OK(drv.StreamCreate(&s2, DRV_STREAM_NON_BLOCKING));
  DRV_OK(drv.StreamCreate(&s3, DRV_STREAM_NON_BLOCKING));
  const gpumem_stream_t g1 = (gpumem_stream_t)s1, g2 = (gpumem_stream_t)s2,
                        g3 = (gpumem_stream_t)s3;
  const size_t n = 64 * MIB;
  int same1 = 0, same3 = 0;
  for (int round = 0; round < 6; round++) {
    void* x = NULL;
    CHECK_STATUS(gpumem_malloc(gm, n, g1, &x), GPUMEM_OK);
    if (!x) break;
    CHECK_STATUS(gpumem_record_stream(gm, x, g2), GPUMEM_OK);
    queue_busy_work((uintptr_t)x, n, s2, 160); /* ~10 GB of writes on s2 */
    CHECK_STATUS(gpumem_free(gm, x), GPUMEM_OK);

    void* y1 = NULL;
    void* y3 = NULL;
    unsigned char v1 = (unsigned char)(0xC0 + round), v3 = (unsigned char)(0xE0 + round);
    CHECK_STATUS(gpumem_malloc(gm, n, g1, &y1), GPUMEM_OK);
    CHECK_STATUS(gpumem_malloc(gm, n, g3, &y3), GPUMEM_OK);
    if (y1) DRV_OK(drv.MemsetD8Async((drv_ptr)(uintptr_t)y1, v1, n, s1));
    if (y3) DRV_OK(drv.MemsetD8Async((drv_ptr)(uintptr_t)y3, v3, n, s3));
    same1 += y1 == x;
    same3 += y3 == x;
    DRV_OK(drv.StreamSynchronize(s1));
    DRV_OK(drv.StreamSynchronize(s2));
    DRV_OK(drv.StreamSynchronize(s3));
    if (y1) CHECK_MSG(check_value((uintptr_t)y1, n, v1) == 0, "round %d: y1 overwritten", round);
    if (y3) CHECK_MSG(check_value((uintptr_t)y3, n, v3) == 0, "round %d: y3 overwritten", round);
    CHECK_STATUS(gpumem_free(gm, y1), GPUMEM_OK);
    CHECK_STATUS(gpumem_free(gm, y3), GPUMEM_OK);
    CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
  }
  printf("streams %s: reused the busy block on its own stream %d/6, on another %d/6\n",
         policy_name(policy), same1, same3);

  /* Own-stream reuse: ordered after the stream's work, so immediate reuse
   * is correct and the new owner's write lands last. */
  {
    void* x = NULL;
    void* y = NULL;
    CHECK_STATUS(gpumem_malloc(gm, n, g1, &x), GPUMEM_OK);
    if (x) queue_busy_work((uintptr_t)x, n, s1, 100);
    CHECK_STATUS(gpumem_free(gm, x), GPUMEM_OK);
    CHECK_STATUS(gpumem_malloc(gm, n, g1, &y), GPUMEM_OK);
    if (y) DRV_OK(drv.MemsetD8Async((drv_ptr)(uintptr_t)y, 0x99, n, s1));
    DRV_OK(drv.StreamSynchronize(s1));
    if (y) CHECK(check_value((uintptr_t)y, n, 0x99) == 0);
    CHECK_STATUS(gpumem_free(gm, y), GPUMEM_OK);
  }

  /* Under a limit that leaves no room, a request on another stream can only
   * be served by the busy block's memory (its pages moved, or its segment
   * freed and made again): that must wait for the busy streams. Unmapping
   * or freeing under running work would fault the memsets (memcheck sees
   * it; the stream syncs below fail). */
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK_STATUS(gpumem_set_limit(gm, 320 * MIB), GPUMEM_OK);
  {
    const size_t m = 256 * MIB;
    void* x = NULL;
    void* y = NULL;
    CHECK_STATUS(gpumem_malloc(gm, m, g1, &x), GPUMEM_OK);
    if (x) {
      queue_busy_work((uintptr_t)x, m, s1, 40); /* owner stream busy */
      CHECK_STATUS(gpumem_record_stream(gm, x, g2), GPUMEM_OK);
      queue_busy_work((uintptr_t)x, m, s2, 40); /* and another */
    }
    CHECK_STATUS(gpumem_free(gm, x), GPUMEM_OK);
    CHECK_STATUS(gpumem_malloc(gm, m, g3, &y), GPUMEM_OK);
    if (y) DRV_OK(drv.MemsetD8Async((drv_ptr)(uintptr_t)y, 0x3D, m, s3));
    DRV_OK(drv.StreamSynchronize(s1));
    DRV_OK(drv.StreamSynchronize(s2));
    DRV_OK(drv.StreamSynchronize(s3));
    if (y) CHECK_MSG(check_value((uintptr_t)y, m, 0x3D) == 0, "moved memory overwritten");
    CHECK_STATUS(gpumem_free(gm, y), GPUMEM_OK);
    CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
  }
  gpumem_remove_limit(gm);

  /* empty_cache while freed blocks are still being written on their own
   * stream and on another: nothing may be unmapped or freed under them. */
  {
    void* x = NULL;
    void* z = NULL;
    CHECK_STATUS(gpumem_malloc(gm, 256 * MIB, g1, &x), GPUMEM_OK);
    CHECK_STATUS(gpumem_malloc(gm, 256 * MIB, g2, &z), GPUMEM_OK);
    if (x && z) {
      queue_busy_work((uintptr_t)x, 256 * MIB, s1, 60);
      CHECK_STATUS(gpumem_record_stream(gm, z, g3), GPUMEM_OK);
      queue_busy_work((uintptr_t)z, 256 * MIB, s3, 60);
    }
    CHECK_STATUS(gpumem_free(gm, x), GPUMEM_OK);
    CHECK_STATUS(gpumem_free(gm, z), GPUMEM_OK);
    CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
    DRV_OK(drv.StreamSynchronize(s1));
    DRV_OK(drv.StreamSynchronize(s2));
    DRV_OK(drv.StreamSynchronize(s3));
    CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
    CHECK_MSG(reserved_now(gm) == 0, "everything released once the streams are idle");
    CHECK_MSG(gpumem_check(gm) == 0, "check: %s", gpumem_last_error());
  }

  DRV_OK(drv.StreamDestroy(s1));
  DRV_OK(drv.StreamDestroy(s2));
  DRV_OK(drv.StreamDestroy(s3));
  gpumem_destroy(gm);
}

int main(void) {
  const char* name = "gpu_test_cuda_alloc";
  gpumem_cuda_options_t co;
  gpumem_cuda_options_init(&co);
  gpumem_status_t st = GPUMEM_OK;
  gpumem_backend_t* probe = gpumem_cuda_create(&co, &st);
  if (!probe && st == GPUMEM_ERR_UNSUPPORTED) {
    printf("SKIP: %s\n", gpumem_last_error());
    return TEST_SKIP;
  }
  CHECK_MSG(probe != NULL, "gpumem_cuda_create: %s (%s)", gpumem_strerror(st), gpumem_last_error());
  if (!probe) return test_finish(name);
  have_vmm = probe->map != NULL;
  printf("backend \"%s\", page size %zu\n", probe->name, probe->page_size);
  scratch = malloc(SCRATCH);
  if (!scratch || !drv_open(0, 1)) {
    CHECK_MSG(0, "the test's own driver binding failed");
    gpumem_cuda_destroy(probe);
    return test_finish(name);
  }
  /* The probe keeps the primary context retained across the allocators. */

  const int policies[2] = {GPUMEM_POLICY_DEFAULT, GPUMEM_POLICY_PYTORCH};
  for (int i = 0; i < 2; i++) {
    test_patterns(policies[i], 1);
    if (have_vmm) test_patterns(policies[i], 0);
    test_meminfo_and_empty_cache(policies[i]);
    test_limit(policies[i]);
    if (drv_no_provoked_errors())
      printf(
          "skipped test_oom %s: it fills the device until the driver refuses "
          "(GPUMEM_TEST_NO_DRIVER_ERRORS)\n",
          policy_name(policies[i]));
    else
      test_oom(policies[i]);
  }
  if (have_vmm) test_alias();
  if (have_vmm) test_shared_plan();
  if (have_vmm) test_lend(false);
  if (have_vmm) test_lend(true);
  /* Last: a premature reuse would fault the context. */
  for (int i = 0; i < 2; i++) test_streams(policies[i]);

  gpumem_cuda_destroy(probe);
  drv_close();
  free(scratch);
  return test_finish(name);
}
