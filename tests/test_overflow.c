/* The overflow tier (src/overflow.c) on the simulated device: the setting
 * and its bad values; requests the device cannot serve on host pages at
 * the same kind of address; out of memory only when the host budget is
 * spent, saying so; blocks back on device pages when room returns, and
 * cold ones out again before a new block goes to host; the hint; every
 * failure of a backend operation on those paths (each one failing on its own) ends cleanly with
 * gpumem_check passing and every byte of every live block intact; and
 * checksums in every overflowed block survive moves both ways with work
 * queued on two streams. gpumem_check runs after every operation. */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "test_util.h"

#define MIB ((size_t)1 << 20)

typedef struct ofx {
  gpumem_backend_t* sim;
  gpumem_t* gm;
} ofx_t;

/* An allocator under conf over a host-backed simulated device of
 * capacity bytes (2 MiB pages), so that tests can read what blocks hold. */
static ofx_t ofx_new(const char* conf, size_t capacity) {
  ofx_t f = {0};
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = capacity;
  so.host_backed = 1;
  f.sim = gpumem_sim_create(&so);
  gpumem_options_t o;
  gpumem_options_init(&o);
  o.publish = GPUMEM_PUBLISH_OFF;
  CHECK_STATUS(gpumem_options_parse(&o, conf), GPUMEM_OK);
  gpumem_status_t st;
  f.gm = gpumem_create(f.sim, &o, &st);
  CHECK_MSG(f.gm != NULL, "create under %s: %s", conf, gpumem_last_error());
  return f;
}

static void ofx_done(ofx_t* f) {
  gpumem_destroy(f->gm);
  gpumem_sim_counters_t c;
  gpumem_sim_get_counters(f->sim, &c);
  /* Everything the allocator held went back to the device and the host. */
  CHECK_MSG(c.pages_live == 0 && c.pages_mapped == 0 && c.ranges_reserved == 0 &&
                c.host_bytes_in_use == 0,
            "after destroy: %" PRIu64 " pages, %" PRIu64 " mappings, %" PRIu64 " ranges, %" PRIu64
            " host bytes",
            c.pages_live, c.pages_mapped, c.ranges_reserved, c.host_bytes_in_use);
  gpumem_sim_destroy(f->sim);
}

static gpumem_stats_t stats(gpumem_t* gm) {
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  return st;
}

/* Ends a fault-injection run's failures: whether any call failed in it. */
static bool stop_failing(gpumem_backend_t* sim) {
  gpumem_sim_counters_t c;
  gpumem_sim_get_counters(sim, &c);
  gpumem_sim_fail_clear(sim);
  return c.failures_injected > 0;
}

static void check_ok(gpumem_t* gm, const char* after) {
  size_t v = gpumem_check(gm);
  CHECK_MSG(v == 0, "gpumem_check after %s: %zu violations: %s", after, v, gpumem_last_error());
}

/* A block's bytes, seeded: written through the device address (the
 * simulated device's host memory behind it), and checked the same way. */
static void fill(gpumem_backend_t* sim, void* p, size_t n, uint32_t seed) {
  for (size_t off = 0; off < n; off += 4096) {
    uint32_t* w = gpumem_sim_host_ptr(sim, (uintptr_t)p + off);
    if (!w) return;
    *w = seed * 2654435761u + (uint32_t)off;
  }
}
static bool intact(gpumem_backend_t* sim, void* p, size_t n, uint32_t seed) {
  for (size_t off = 0; off < n; off += 4096) {
    uint32_t* w = gpumem_sim_host_ptr(sim, (uintptr_t)p + off);
    if (!w || *w != seed * 2654435761u + (uint32_t)off) return false;
  }
  return true;
}

/* ---- the setting ---- */

static void expect_config_error(const char* conf, const char* needle) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  clear_error();
  CHECK_STATUS(gpumem_options_parse(&o, conf), GPUMEM_ERR_CONFIG);
  CHECK_MSG(strstr(gpumem_last_error(), needle) != NULL, "%s: \"%s\" lacks \"%s\"", conf,
            gpumem_last_error(), needle);
  CHECK(o.overflow == GPUMEM_OVERFLOW_OFF);
}

static void test_setting(void) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK(o.overflow == GPUMEM_OVERFLOW_OFF && o.overflow_host_bytes == 0);
  CHECK_STATUS(gpumem_options_parse(&o, "overflow:host"), GPUMEM_OK);
  CHECK(o.overflow == GPUMEM_OVERFLOW_HOST && o.overflow_host_bytes == 0);
  CHECK_STATUS(gpumem_options_parse(&o, "overflow:host:64G,limit:1G"), GPUMEM_OK);
  CHECK(o.overflow == GPUMEM_OVERFLOW_HOST && o.overflow_host_bytes == ((size_t)64 << 30));
  CHECK_STATUS(gpumem_options_parse(&o, "overflow: Host : 1.5G"), GPUMEM_OK);
  CHECK(o.overflow_host_bytes == ((size_t)3 << 29));
  CHECK_STATUS(gpumem_options_parse(&o, "overflow:off"), GPUMEM_OK);
  CHECK(o.overflow == GPUMEM_OVERFLOW_OFF && o.overflow_host_bytes == 0);
  expect_config_error("overflow:disk", "bad value \"disk\" for key \"overflow\"");
  expect_config_error("overflow:", "off, host, or host:SIZE");
  expect_config_error("overflow:host:lots", "bad host budget \"lots\" for key \"overflow\"");
  expect_config_error("overflow:host:0", "a host budget above 0");
  expect_config_error("overflow:host:-1G", "sizes cannot be negative");
  expect_config_error("overfow:host", "did you mean \"overflow\"");

  /* The pytorch policy has no ranges of its own to map host pages under. */
  gpumem_backend_t* sim = gpumem_sim_create(NULL);
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, "policy:pytorch,overflow:host"), GPUMEM_OK);
  gpumem_status_t st = GPUMEM_OK;
  CHECK(gpumem_create(sim, &o, &st) == NULL);
  CHECK(st == GPUMEM_ERR_INVALID_ARGUMENT &&
        strstr(gpumem_last_error(), "overflow:host needs the default policy") != NULL);
  gpumem_sim_destroy(sim);
}

/* ---- host pages when the device is full, and the budget ---- */

/* Allocates blocks of size bytes until one lands on host pages; returns
 * how many landed on device pages (in ptrs[0..n)), the tier block in *tier. */
static int fill_device(ofx_t* f, size_t size, void** ptrs, int max, void** tier) {
  *tier = NULL;
  int n = 0;
  while (n < max) {
    int64_t before = stats(f->gm).num_host_allocs;
    void* p = NULL;
    CHECK_STATUS(gpumem_malloc(f->gm, size, 0, &p), GPUMEM_OK);
    check_ok(f->gm, "a malloc filling the device");
    if (!p) break;
    if (stats(f->gm).num_host_allocs > before) {
      *tier = p;
      break;
    }
    ptrs[n++] = p;
  }
  return n;
}

static void test_host_pages_and_budget(void) {
  ofx_t f = ofx_new("overflow:host:12M", 64 * MIB);
  if (!f.gm) return ofx_done(&f);
  void* dev[64];
  void* tier = NULL;
  int n = fill_device(&f, 8 * MIB, dev, 64, &tier);
  CHECK_MSG(n >= 4 && tier != NULL, "%d blocks on device, tier block %p", n, tier);
  gpumem_stats_t st = stats(f.gm);
  CHECK(st.host_bytes[GPUMEM_POOL_ALL].current == (int64_t)(8 * MIB));
  CHECK(st.allocated_bytes[GPUMEM_POOL_ALL].current == (int64_t)((size_t)(n + 1) * 8 * MIB));
  CHECK(st.reserved_bytes[GPUMEM_POOL_ALL].current <= (int64_t)(64 * MIB));
  CHECK(st.host_link_model_us > 0);
  fill(f.sim, tier, 8 * MIB, 7);
  CHECK(intact(f.sim, tier, 8 * MIB, 7));
  CHECK(gpumem_allocation_size(f.gm, tier) == 8 * MIB);

  /* Leak reports count it like any live allocation. */
  gpumem_leaks_t lk;
  memset(&lk, 0, sizeof lk);
  lk.struct_size = sizeof lk;
  CHECK_STATUS(gpumem_find_leaks(f.gm, 0, &lk), GPUMEM_OK);
  CHECK_MSG(lk.count == (uint64_t)n + 1 && lk.bytes == (uint64_t)(n + 1) * 8 * MIB,
            "leaks: %" PRIu64 " allocations, %" PRIu64 " bytes", lk.count, lk.bytes);
  /* 4 MiB more would be 12: within the budget; then it is spent. */
  void* small = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, 4 * MIB, 0, &small), GPUMEM_OK);
  check_ok(f.gm, "a second block on host pages");
  void* none = NULL;
  clear_error();
  CHECK_STATUS(gpumem_malloc(f.gm, 2 * MIB, 0, &none), GPUMEM_ERR_OUT_OF_MEMORY);
  const char* msg = gpumem_last_error();
  CHECK_MSG(strstr(msg, "gpumem: out of memory: tried to allocate 2.00 MiB") &&
                strstr(msg, "the host budget is spent too") &&
                strstr(msg, "Overflow tier: 12.00 MiB on host pages (budget 12.00 MiB)"),
            "report: %s", msg);
  check_ok(f.gm, "an out-of-memory failure with the budget spent");
  CHECK(stats(f.gm).num_ooms == 1);

  /* Frees of tier blocks give the host pages back. */
  CHECK_STATUS(gpumem_free(f.gm, small), GPUMEM_OK);
  check_ok(f.gm, "a free on host pages");
  CHECK(stats(f.gm).host_bytes[GPUMEM_POOL_ALL].current == (int64_t)(8 * MIB));
  CHECK(intact(f.sim, tier, 8 * MIB, 7));
  /* A bad pointer into a tier block is named as one. */
  CHECK_STATUS(gpumem_free(f.gm, (char*)tier + 512), GPUMEM_ERR_INVALID_POINTER);
  CHECK(strstr(gpumem_last_error(), "points 512 bytes into the allocation") != NULL);
  for (int i = 0; i < n; i++) CHECK_STATUS(gpumem_free(f.gm, dev[i]), GPUMEM_OK);
  check_ok(f.gm, "frees of the device blocks");
  CHECK_STATUS(gpumem_free(f.gm, tier), GPUMEM_OK);
  check_ok(f.gm, "the last free");
  st = stats(f.gm);
  CHECK(st.host_bytes[GPUMEM_POOL_ALL].current == 0 && st.host_bytes[GPUMEM_POOL_ALL].peak > 0);
  CHECK(st.allocated_bytes[GPUMEM_POOL_ALL].current == 0);
  ofx_done(&f);
}

/* Without host pages from the backend the tier refuses, saying why. */
static void test_backend_without_host_pages(void) {
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = 16 * MIB;
  so.host_pages = 0;
  gpumem_backend_t* sim = gpumem_sim_create(&so);
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, "overflow:host"), GPUMEM_OK);
  gpumem_t* gm = gpumem_create(sim, &o, NULL);
  void* a = NULL;
  void* b = NULL;
  CHECK_STATUS(gpumem_malloc(gm, 16 * MIB, 0, &a), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 2 * MIB, 0, &b), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_MSG(strstr(gpumem_last_error(), "offers no host pages") != NULL, "%s", gpumem_last_error());
  check_ok(gm, "a refusal without host pages");
  gpumem_destroy(gm);
  gpumem_sim_destroy(sim);
}

/* Under a limit of 32 MiB: four blocks of 8 MiB on device pages (in
 * dev[0..4)), the fifth on host pages (*tier). Returns how many landed on
 * the device. */
static int fill_under_32m_limit(ofx_t* f, void** dev, void** tier) {
  int n = fill_device(f, 8 * MIB, dev, 16, tier);
  CHECK_MSG(n == 4 && *tier != NULL, "%d blocks under the 32 MiB limit", n);
  return n;
}

/* ---- moves: back when room returns, cold ones out under pressure ---- */

static void test_moves_and_hint(void) {
  ofx_t f = ofx_new("overflow:host,limit:32M", 1024 * MIB);
  if (!f.gm) return ofx_done(&f);
  void* dev[16];
  void* tier = NULL;
  int n = fill_under_32m_limit(&f, dev, &tier);
  fill(f.sim, tier, 8 * MIB, 11);
  /* Under a limit the arena keeps its freed pages: a free alone brings
   * nothing back (no page moves for it); empty_cache gives the room. */
  CHECK_STATUS(gpumem_free(f.gm, dev[0]), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f.gm, dev[1]), GPUMEM_OK);
  check_ok(f.gm, "frees under the limit");
  CHECK(stats(f.gm).num_moves_to_device == 0);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  check_ok(f.gm, "empty_cache bringing a block back");
  gpumem_stats_t st = stats(f.gm);
  CHECK_MSG(st.num_moves_to_device == 1 && st.host_bytes[GPUMEM_POOL_ALL].current == 0 &&
                st.bytes_moved_to_device == (int64_t)(8 * MIB),
            "moves back %" PRId64 ", host bytes %" PRId64, st.num_moves_to_device,
            st.host_bytes[GPUMEM_POOL_ALL].current);
  CHECK(intact(f.sim, tier, 8 * MIB, 11));
  CHECK(st.reserved_bytes[GPUMEM_POOL_ALL].current <= (int64_t)(32 * MIB));

  /* A new request: the cold tier block moves out rather than the new one
   * going to host. */
  void* hot = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, 16 * MIB, 0, &hot), GPUMEM_OK);
  check_ok(f.gm, "a malloc that moved a cold block out");
  st = stats(f.gm);
  CHECK_MSG(st.num_moves_to_host == 1 && st.num_host_allocs == 1 &&
                st.host_bytes[GPUMEM_POOL_ALL].current == (int64_t)(8 * MIB),
            "moves out %" PRId64 ", host allocations %" PRId64, st.num_moves_to_host,
            st.num_host_allocs);
  CHECK(intact(f.sim, tier, 8 * MIB, 11));

  /* The hint: taken by an arena block that owns whole pages (they go to
   * host now: nothing waits) and by a tier block; a pointer inside a
   * block is refused. */
  fill(f.sim, hot, 16 * MIB, 12);
  CHECK_STATUS(gpumem_prefer_host(f.gm, hot), GPUMEM_OK);
  check_ok(f.gm, "the hint on an arena block");
  CHECK_MSG(stats(f.gm).num_moves_to_host == 2, "the hinted arena block did not move");
  CHECK(intact(f.sim, hot, 16 * MIB, 12));
  CHECK_STATUS(gpumem_prefer_host(f.gm, (char*)hot + 512), GPUMEM_ERR_INVALID_POINTER);
  CHECK_STATUS(gpumem_prefer_host(f.gm, tier), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f.gm, hot), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  check_ok(f.gm, "empty_cache with a block that prefers host pages");
  st = stats(f.gm);
  CHECK_MSG(
      st.num_moves_to_device == 1 && st.host_bytes[GPUMEM_POOL_ALL].current == (int64_t)(8 * MIB),
      "a block that prefers host pages came back");
  CHECK(intact(f.sim, tier, 8 * MIB, 11));
  for (int i = 2; i < n; i++) CHECK_STATUS(gpumem_free(f.gm, dev[i]), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f.gm, tier), GPUMEM_OK);
  check_ok(f.gm, "the last frees");
  ofx_done(&f);

  /* With the tier off, the hint says so. */
  ofx_t off = ofx_new("", 64 * MIB);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(off.gm, MIB, 0, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_prefer_host(off.gm, p), GPUMEM_ERR_UNSUPPORTED);
  CHECK(strstr(gpumem_last_error(), "the overflow tier is off") != NULL);
  CHECK_STATUS(gpumem_free(off.gm, p), GPUMEM_OK);
  ofx_done(&off);
}

/* A block pressure moved out twice stays on host at frees (no ping-pong),
 * and comes back at empty_cache. */
static void test_no_ping_pong(void) {
  ofx_t f = ofx_new("overflow:host,map_max:2M,map_ahead:off", 32 * MIB);
  if (!f.gm) return ofx_done(&f);
  void* dev[8];
  void* tier = NULL;
  int n = fill_device(&f, 8 * MIB, dev, 8, &tier);
  CHECK(n >= 1 && tier != NULL);
  fill(f.sim, tier, 8 * MIB, 5);
  for (int round = 0; round < 3; round++) {
    /* room returns: the free brings the block back (no limit: the device
     * says whether there is room) */
    CHECK_STATUS(gpumem_free(f.gm, dev[n - 1]), GPUMEM_OK);
    CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
    check_ok(f.gm, "a free and empty_cache");
    CHECK(intact(f.sim, tier, 8 * MIB, 5));
    /* and pressure moves it out again */
    CHECK_STATUS(gpumem_malloc(f.gm, 8 * MIB, 0, &dev[n - 1]), GPUMEM_OK);
    check_ok(f.gm, "a malloc under pressure");
    CHECK(intact(f.sim, tier, 8 * MIB, 5));
  }
  gpumem_stats_t st = stats(f.gm);
  CHECK_MSG(st.num_moves_to_host == 3 && st.num_moves_to_device == 3,
            "out %" PRId64 " back %" PRId64, st.num_moves_to_host, st.num_moves_to_device);
  /* A plain free (no empty_cache) leaves a block that bounced on host. */
  CHECK_STATUS(gpumem_free(f.gm, dev[n - 1]), GPUMEM_OK);
  CHECK(stats(f.gm).num_moves_to_device == 3);
  for (int i = 0; i < n - 1; i++) CHECK_STATUS(gpumem_free(f.gm, dev[i]), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f.gm, tier), GPUMEM_OK);
  check_ok(f.gm, "the last frees");
  ofx_done(&f);
}

/* ---- checksums through moves both ways, two streams busy ---- */

static void test_checksums_two_streams(void) {
  ofx_t f = ofx_new("overflow:host,map_max:2M,map_ahead:off", 48 * MIB);
  if (!f.gm) return ofx_done(&f);
  const gpumem_stream_t s1 = 0x51, s2 = 0x52;
  enum { N = 24 };
  void* p[N] = {0};
  size_t sz[N];
  int on_s2 = 0;
  /* More than the device holds, on two streams, each block also handed to
   * the other stream. */
  for (int i = 0; i < N; i++) {
    sz[i] = (size_t)(1 + i % 5) * 3 * MIB + (size_t)i * 4096;
    gpumem_stream_t s = i % 2 ? s2 : s1;
    CHECK_STATUS(gpumem_malloc(f.gm, sz[i], s, &p[i]), GPUMEM_OK);
    CHECK_STATUS(gpumem_record_stream(f.gm, p[i], i % 2 ? s1 : s2), GPUMEM_OK);
    on_s2 += i % 2;
    fill(f.sim, p[i], sz[i], (uint32_t)i);
    check_ok(f.gm, "a malloc on two streams");
  }
  gpumem_stats_t st = stats(f.gm);
  CHECK_MSG(st.num_host_allocs >= 4, "only %" PRId64 " blocks overflowed", st.num_host_allocs);
  /* Work queued: events complete only after several queries. */
  gpumem_sim_set_event_delay(f.sim, 3);
  for (int i = 0; i < N; i += 3) {
    CHECK(intact(f.sim, p[i], sz[i], (uint32_t)i));
    CHECK_STATUS(gpumem_free(f.gm, p[i]), GPUMEM_OK);
    p[i] = NULL;
    check_ok(f.gm, "a free with work queued");
  }
  /* empty_cache may wait (as PyTorch's does): blocks come back. */
  int64_t back_before = stats(f.gm).num_moves_to_device;
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  check_ok(f.gm, "empty_cache with work queued");
  st = stats(f.gm);
  CHECK_MSG(st.num_moves_to_device > back_before, "nothing came back at empty_cache");
  for (int i = 0; i < N; i++)
    if (p[i]) CHECK_MSG(intact(f.sim, p[i], sz[i], (uint32_t)i), "block %d after moves back", i);
  /* The hint on a block back on device pages, with its streams busy: no
   * move now (nothing waits for a hint), first out at the next pressure. */
  int hinted = -1;
  for (int i = N - 1; i >= 0 && hinted < 0; i--) {
    if (p[i] && gpumem_prefer_host(f.gm, p[i]) == GPUMEM_OK) hinted = i;
  }
  CHECK_MSG(hinted >= 0, "no block of the tier took the hint");
  CHECK_MSG(stats(f.gm).num_moves_to_host == st.num_moves_to_host,
            "a hinted block moved while its streams were busy");
  check_ok(f.gm, "the hint with work queued");
  /* Pressure: cold tier blocks go out (waiting for their streams). */
  void* big[4] = {0};
  for (int k = 0; k < 4; k++) {
    CHECK_STATUS(gpumem_malloc(f.gm, 6 * MIB, k % 2 ? s2 : s1, &big[k]), GPUMEM_OK);
    check_ok(f.gm, "a malloc under pressure on two streams");
  }
  CHECK(stats(f.gm).num_moves_to_host > st.num_moves_to_host);
  gpumem_sim_set_event_delay(f.sim, 0);
  for (int i = 0; i < N; i++) {
    if (!p[i]) continue;
    CHECK_MSG(intact(f.sim, p[i], sz[i], (uint32_t)i), "block %d lost its bytes", i);
    CHECK_STATUS(gpumem_free(f.gm, p[i]), GPUMEM_OK);
    check_ok(f.gm, "a free");
  }
  for (int k = 0; k < 4; k++) CHECK_STATUS(gpumem_free(f.gm, big[k]), GPUMEM_OK);
  check_ok(f.gm, "the last frees");
  CHECK(on_s2 > 0);
  ofx_done(&f);
}

/* ---- arena blocks: cold ones' pages out before a new request goes to host ---- */

static size_t gm_round512(size_t n) {
  return (n + 511) / 512 * 512;
}

/* Allocations of one small block, made and freed n times: they age every
 * live block by n allocations (the tier takes none of the recent ones). */
static void age(ofx_t* f, int n) {
  for (int i = 0; i < n; i++) {
    void* p = NULL;
    CHECK_STATUS(gpumem_malloc(f->gm, 4096, 0, &p), GPUMEM_OK);
    CHECK_STATUS(gpumem_free(f->gm, p), GPUMEM_OK);
  }
}

/* Three cold blocks (optimizer state: made long ago, live throughout)
 * on two streams, each handed to the other one; the third touched again
 * (record_stream) just before the pressure. Hot blocks fill the limit:
 * the cold, untouched ones move out, coldest first, and no request goes
 * to host pages. Checksums in every block survive the moves both ways,
 * with work queued on both streams. conf: the limit (single-page
 * mappings) or a full device (mappings of several pages). */
static void arena_cold_scenario(const char* conf, size_t capacity) {
  ofx_t f = ofx_new(conf, capacity);
  if (!f.gm) return ofx_done(&f);
  const gpumem_stream_t s1 = 0x51, s2 = 0x52;
  enum { COLD = 3, HOT = 16 };
  size_t cold_size = 10 * MIB + 512;
  void* cold[COLD];
  for (int i = 0; i < COLD; i++) {
    CHECK_STATUS(gpumem_malloc(f.gm, cold_size, i % 2 ? s2 : s1, &cold[i]), GPUMEM_OK);
    CHECK_STATUS(gpumem_record_stream(f.gm, cold[i], i % 2 ? s1 : s2), GPUMEM_OK);
    fill(f.sim, cold[i], cold_size, 100 + (uint32_t)i);
  }
  check_ok(f.gm, "the cold blocks");
  /* A block that owns no whole page cannot take the hint. */
  void* tiny = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, MIB, s1, &tiny), GPUMEM_OK);
  CHECK_STATUS(gpumem_prefer_host(f.gm, tiny), GPUMEM_ERR_UNSUPPORTED);
  CHECK(strstr(gpumem_last_error(), "owns no whole page") != NULL);
  CHECK_STATUS(gpumem_free(f.gm, tiny), GPUMEM_OK);
  age(&f, 1100);
  CHECK_STATUS(gpumem_record_stream(f.gm, cold[2], s1), GPUMEM_OK); /* warm again */
  gpumem_sim_set_event_delay(f.sim, 3);
  void* hot[HOT] = {0};
  int n = 0;
  gpumem_stats_t st = stats(f.gm);
  while (n < HOT && stats(f.gm).num_moves_to_host < 2) {
    CHECK_STATUS(gpumem_malloc(f.gm, 8 * MIB, n % 2 ? s2 : s1, &hot[n]), GPUMEM_OK);
    fill(f.sim, hot[n], 8 * MIB, 200 + (uint32_t)n);
    n++;
    check_ok(f.gm, "a hot malloc under pressure");
  }
  st = stats(f.gm);
  CHECK_MSG(st.num_moves_to_host == 2 && st.num_host_allocs == 0,
            "%s: %" PRId64 " moves out, %" PRId64 " requests on host pages after %d hot blocks",
            conf, st.num_moves_to_host, st.num_host_allocs, n);
  int64_t host = st.host_bytes[GPUMEM_POOL_ALL].current;
  CHECK_MSG(host >= (int64_t)(2 * 8 * MIB) && host <= (int64_t)(2 * cold_size) &&
                host == st.bytes_moved_to_host,
            "%s: %" PRId64 " host bytes for two cold blocks' interiors", conf, host);
  CHECK(st.move_to_host_ns > 0 && st.host_link_model_us > 0);
  for (int i = 0; i < COLD; i++)
    CHECK_MSG(intact(f.sim, cold[i], cold_size, 100 + (uint32_t)i), "cold block %d moved out", i);
  for (int i = 0; i < n; i++) CHECK(intact(f.sim, hot[i], 8 * MIB, 200 + (uint32_t)i));
  /* A snapshot lists every cold block whole, its host pages in its
   * segment (a block must lie inside one). */
  size_t cap = 1 << 20;
  char* snap = malloc(cap);
  CHECK(snap != NULL);
  if (snap) {
    size_t len = gpumem_binding_snapshot_json(f.gm, 0, NULL, snap, cap);
    CHECK(len > 0 && len < cap);
    for (int i = 0; i < COLD && len < cap; i++) {
      char want[96];
      snprintf(want, sizeof want, "{\"address\":%" PRIu64 ",\"size\":%zu,",
               (uint64_t)(uintptr_t)cold[i], (size_t)gm_round512(cold_size));
      CHECK_MSG(strstr(snap, want) != NULL, "%s: the snapshot lacks cold block %d whole (%s)", conf,
                i, want);
    }
    free(snap);
  }
  /* Which moved: freeing the touched one and the hot ones gives back no
   * host page; the first cold one's free gives back its share. */
  CHECK_STATUS(gpumem_free(f.gm, cold[2]), GPUMEM_OK);
  cold[2] = NULL;
  for (int i = 0; i < n / 2; i++) {
    CHECK_STATUS(gpumem_free(f.gm, hot[i]), GPUMEM_OK);
    hot[i] = NULL;
    check_ok(f.gm, "a free of a hot block");
  }
  st = stats(f.gm);
  CHECK_MSG(st.host_bytes[GPUMEM_POOL_ALL].current == host,
            "%s: host bytes %" PRId64 " after frees of blocks that stayed, were %" PRId64, conf,
            st.host_bytes[GPUMEM_POOL_ALL].current, host);
  /* empty_cache (it may wait, as PyTorch's does): the cold blocks come
   * back to device pages, bytes intact. */
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  check_ok(f.gm, "empty_cache bringing arena blocks back");
  st = stats(f.gm);
  CHECK_MSG(st.num_moves_to_device == 2 && st.host_bytes[GPUMEM_POOL_ALL].current == 0 &&
                st.bytes_moved_to_device == host,
            "%s: %" PRId64 " moves back, %" PRId64 " host bytes left", conf, st.num_moves_to_device,
            st.host_bytes[GPUMEM_POOL_ALL].current);
  for (int i = 0; i < 2; i++)
    CHECK_MSG(intact(f.sim, cold[i], cold_size, 100 + (uint32_t)i), "cold block %d came back", i);
  /* The hint on an arena block with its streams busy: no move now, first
   * out at the next pressure; a free of a block on host pages gives them
   * back. */
  CHECK_STATUS(gpumem_prefer_host(f.gm, cold[1]), GPUMEM_OK);
  CHECK(stats(f.gm).num_moves_to_host == 2);
  for (int i = 0; i < n / 2; i++) {
    CHECK_STATUS(gpumem_malloc(f.gm, 8 * MIB, s2, &hot[i]), GPUMEM_OK);
    fill(f.sim, hot[i], 8 * MIB, 200 + (uint32_t)i);
    check_ok(f.gm, "a hot malloc after the hint");
  }
  st = stats(f.gm);
  CHECK_MSG(st.num_moves_to_host >= 3 && st.num_host_allocs == 0,
            "%s: the hinted block did not go out first (%" PRId64 " moves, %" PRId64
            " requests on host)",
            conf, st.num_moves_to_host, st.num_host_allocs);
  CHECK(intact(f.sim, cold[1], cold_size, 101));
  CHECK_STATUS(gpumem_free(f.gm, cold[1]), GPUMEM_OK);
  cold[1] = NULL;
  check_ok(f.gm, "a free of a block on host pages");
  gpumem_sim_set_event_delay(f.sim, 0);
  for (int i = 0; i < COLD; i++)
    if (cold[i]) {
      CHECK(intact(f.sim, cold[i], cold_size, 100 + (uint32_t)i));
      CHECK_STATUS(gpumem_free(f.gm, cold[i]), GPUMEM_OK);
    }
  for (int i = 0; i < n; i++)
    if (hot[i]) {
      CHECK(intact(f.sim, hot[i], 8 * MIB, 200 + (uint32_t)i));
      CHECK_STATUS(gpumem_free(f.gm, hot[i]), GPUMEM_OK);
    }
  check_ok(f.gm, "the last frees");
  CHECK(stats(f.gm).host_bytes[GPUMEM_POOL_ALL].current == 0);
  ofx_done(&f);
}

static void test_arena_cold_blocks(void) {
  arena_cold_scenario("overflow:host,limit:64M", 1024 * MIB);
  arena_cold_scenario("overflow:host,map_max:8M", 64 * MIB);
}

/* One round of pressure short of cold blocks: `warm` blocks of 8 MiB made
 * `since` allocations before a request of 24 MiB that the cold block
 * alone (10 MiB) cannot make room for, the rest of the limit filled. The
 * warm blocks' and the request's bytes are checked; the blocks made are
 * left in *w (warm, WARM of them) and *h (the filler and the request). */
enum { WARM = 3, FILL = 2 };
static void warm_round(ofx_t* f, int since, void* w[WARM], void* h[FILL + 1], uint32_t seed) {
  for (int i = 0; i < WARM; i++) {
    CHECK_STATUS(gpumem_malloc(f->gm, 8 * MIB, 0, &w[i]), GPUMEM_OK);
    fill(f->sim, w[i], 8 * MIB, seed + (uint32_t)i);
  }
  age(f, since);
  for (int i = 0; i < FILL; i++) {
    CHECK_STATUS(gpumem_malloc(f->gm, 8 * MIB, 0, &h[i]), GPUMEM_OK);
    fill(f->sim, h[i], 8 * MIB, seed + 10 + (uint32_t)i);
  }
  CHECK_STATUS(gpumem_malloc(f->gm, 24 * MIB, 0, &h[FILL]), GPUMEM_OK);
  fill(f->sim, h[FILL], 24 * MIB, seed + 20);
  check_ok(f->gm, "a request short of cold blocks");
  for (int i = 0; i < WARM; i++)
    CHECK_MSG(intact(f->sim, w[i], 8 * MIB, seed + (uint32_t)i), "warm block %d lost bytes", i);
}

static void free_all(ofx_t* f, void** p, int n) {
  for (int i = 0; i < n; i++) {
    CHECK_STATUS(gpumem_free(f->gm, p[i]), GPUMEM_OK);
    check_ok(f->gm, "a free");
  }
}

/* Short of cold blocks, warm ones move too, coldest first, rather than the
 * whole request going to host pages (a fine-tune's second logits block
 * under peak / 1.10); where such blocks die young (a decode's KV cache),
 * each move was a copy for nothing, and after GM_WARM_WASTE_LIMIT of them,
 * more than half of all, warm blocks stay and requests go to host again. */
static void test_warm_blocks_short_of_cold(void) {
  /* (best fit: the rounds below repeat, and blocks a plan serves stay put) */
  ofx_t f = ofx_new("overflow:host,limit:64M,placement:bestfit", 1024 * MIB);
  if (!f.gm) return ofx_done(&f);
  void* cold = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, 10 * MIB + 512, 0, &cold), GPUMEM_OK);
  fill(f.sim, cold, 10 * MIB + 512, 7);
  age(&f, 1100);
  void *w[WARM], *h[FILL + 1];
  /* the warm blocks 40 allocations old: past the last 32 (the request's
   * inputs), well within the hot window */
  warm_round(&f, 40, w, h, 100);
  gpumem_stats_t st = stats(f.gm);
  CHECK_MSG(st.num_host_allocs == 0 && st.num_moves_to_host >= 2,
            "short of cold blocks: %" PRId64 " requests on host pages, %" PRId64 " moves out",
            st.num_host_allocs, st.num_moves_to_host);
  CHECK(intact(f.sim, cold, 10 * MIB + 512, 7));
  /* (the cold block went first: the oldest) */
  CHECK(st.host_bytes[GPUMEM_POOL_ALL].current >= (int64_t)(8 * MIB + 8 * MIB));
  /* the warm blocks live on: freed after a whole window, nothing wasted */
  age(&f, 1100);
  free_all(&f, w, WARM);
  free_all(&f, h, FILL + 1);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  check_ok(f.gm, "empty_cache");
  /* now rounds whose warm blocks die at once: each freed right after the
   * request, its copy to host for nothing. (The cold block, back on device
   * pages since empty_cache and touched by that move, goes out as a warm
   * block in the first round and stays: one warm move not wasted.) */
  int64_t host_allocs = stats(f.gm).num_host_allocs, moves = 0;
  int round = 0;
  for (; round < 12; round++) {
    int64_t before = stats(f.gm).num_moves_to_host;
    warm_round(&f, 40, w, h, 1000 + 100 * (uint32_t)round);
    moves = stats(f.gm).num_moves_to_host - before;
    free_all(&f, w, WARM);
    free_all(&f, h, FILL + 1);
    if (!moves) break; /* warm blocks stayed: the request went to host pages */
  }
  /* eight wasted, more than half of the nine warm moves: off */
  CHECK_MSG(round == 8 && moves == 0, "warm blocks that die young: moves stopped after %d rounds",
            round);
  CHECK_MSG(stats(f.gm).num_host_allocs > host_allocs,
            "with warm moves off, the request goes to host pages (%" PRId64 " before, %" PRId64
            " now)",
            host_allocs, stats(f.gm).num_host_allocs);
  CHECK_STATUS(gpumem_free(f.gm, cold), GPUMEM_OK);
  check_ok(f.gm, "the last free");
  ofx_done(&f);
}

/* Every backend operation of the arena paths failing, each in an allocator of its own: moves out
 * under pressure and by the hint, back at empty_cache, the free of a block on host pages. Each
 * operation ends in success or a clean failure, with gpumem_check passing and every live block's
 * bytes intact. */
static bool arena_fault_run(long skip, int kind, int* failures_seen) {
  ofx_t f = ofx_new("overflow:host:48M,limit:40M", 1024 * MIB);
  if (!f.gm) {
    ofx_done(&f);
    return false;
  }
  enum { COLD = 3, HOT = 6, N = COLD + HOT };
  size_t sz[N];
  void* p[N] = {0};
  const gpumem_stream_t s2 = 0x52;
  for (int i = 0; i < COLD; i++) {
    sz[i] = 10 * MIB + 512;
    CHECK_STATUS(gpumem_malloc(f.gm, sz[i], i % 2 ? s2 : 0, &p[i]), GPUMEM_OK);
    CHECK_STATUS(gpumem_record_stream(f.gm, p[i], i % 2 ? 0 : s2), GPUMEM_OK);
    fill(f.sim, p[i], sz[i], (uint32_t)i);
  }
  age(&f, 1100);
  for (int i = COLD; i < N; i++) sz[i] = 8 * MIB;
  /* failures from here on only: the scene above is set */
  gpumem_sim_fail(f.sim, kind, skip, 1,
                  kind == GPUMEM_CALL_create_host_page || kind == -1 ? GPUMEM_ERR_OUT_OF_MEMORY
                                                                     : GPUMEM_ERR_BACKEND);
#define OP_DONE(what)                                                                         \
  do {                                                                                        \
    check_ok(f.gm, what);                                                                     \
    for (int j = 0; j < N; j++)                                                               \
      if (p[j])                                                                               \
        CHECK_MSG(intact(f.sim, p[j], sz[j], (uint32_t)j), "block %d lost bytes after %s", j, \
                  what);                                                                      \
  } while (0)
#define MALLOC_OK(st)                                                                        \
  CHECK_MSG(st == GPUMEM_OK || st == GPUMEM_ERR_OUT_OF_MEMORY ||                             \
                (st == GPUMEM_ERR_BACKEND && !strstr(gpumem_last_error(), "overflow:host")), \
            "malloc: %s: %s", gpumem_strerror(st), gpumem_last_error())
  for (int i = COLD; i < N - 1; i++) {
    gpumem_status_t st = gpumem_malloc(f.gm, sz[i], i % 2 ? s2 : 0, &p[i]);
    MALLOC_OK(st);
    if (st != GPUMEM_OK) {
      (*failures_seen)++;
      p[i] = NULL;
    } else {
      fill(f.sim, p[i], sz[i], (uint32_t)i);
      /* (handed to the other stream: its free waits for an event) */
      if (gpumem_record_stream(f.gm, p[i], i % 2 ? 0 : s2) != GPUMEM_OK) (*failures_seen)++;
    }
    OP_DONE("a malloc under pressure");
  }
  /* frees with room under the limit: blocks come back where their
   * streams are idle (events queried) */
  for (int i = COLD; i < COLD + 2; i++) {
    if (!p[i]) continue;
    if (gpumem_free(f.gm, p[i]) == GPUMEM_OK)
      p[i] = NULL;
    else
      (*failures_seen)++;
    OP_DONE("a free of a hot block");
  }
  /* (a malloc queries the frees' events) */
  void* small = NULL;
  gpumem_status_t small_st = gpumem_malloc(f.gm, MIB, 0, &small);
  MALLOC_OK(small_st);
  if (small_st == GPUMEM_OK && gpumem_free(f.gm, small) != GPUMEM_OK) (*failures_seen)++;
  OP_DONE("a malloc and free with events pending");
  if (gpumem_empty_cache(f.gm) != GPUMEM_OK) (*failures_seen)++;
  OP_DONE("empty_cache");
  gpumem_status_t st = gpumem_malloc(f.gm, sz[N - 1], 0, &p[N - 1]);
  MALLOC_OK(st);
  if (st == GPUMEM_OK)
    fill(f.sim, p[N - 1], sz[N - 1], (uint32_t)(N - 1));
  else
    p[N - 1] = NULL;
  OP_DONE("a malloc after empty_cache");
  for (int i = 0; i < COLD; i++)
    if (p[i]) (void)gpumem_prefer_host(f.gm, p[i]);
  OP_DONE("the hint");
  if (p[0]) {
    if (gpumem_free(f.gm, p[0]) == GPUMEM_OK)
      p[0] = NULL;
    else
      (*failures_seen)++;
    OP_DONE("a free of a cold block");
  }
  if (gpumem_empty_cache(f.gm) != GPUMEM_OK) (*failures_seen)++;
  OP_DONE("the last empty_cache");
  bool fired = stop_failing(f.sim);
  gpumem_stats_t st0 = stats(f.gm);
  int64_t hinted_host = st0.host_bytes[GPUMEM_POOL_ALL].current;
  /* (the run no failure reached took every path: out, back, the hint) */
  CHECK_MSG(
      fired || (st0.num_moves_to_host >= 3 && st0.num_moves_to_device >= 1 && hinted_host > 0),
      "arena scenario: %" PRId64 " moves out, %" PRId64 " back, %" PRId64
      " requests on host, %" PRId64 " host bytes",
      st0.num_moves_to_host, st0.num_moves_to_device, st0.num_host_allocs, hinted_host);
  for (int i = 0; i < N; i++) {
    if (!p[i]) continue;
    CHECK_STATUS(gpumem_free(f.gm, p[i]), GPUMEM_OK);
    p[i] = NULL;
    OP_DONE("a free after the failures");
  }
  CHECK(stats(f.gm).host_bytes[GPUMEM_POOL_ALL].current == 0);
#undef MALLOC_OK
#undef OP_DONE
  gpumem_destroy(f.gm);
  gpumem_sim_destroy(f.sim);
  return fired;
}

/* ---- kept host pages ----
 * A host allocation no block uses any more is kept for a later one of the
 * same size (pinning host memory is the tier's slowest call), within the
 * most held at once; empty_cache gives it back. */
static uint64_t host_creations(gpumem_t* gm) {
  return stats(gm).backend_calls[GPUMEM_CALL_create_host_page];
}

static void test_kept_host_pages(void) {
  ofx_t f = ofx_new("overflow:host:24M,limit:32M", 64 * MIB);
  if (!f.gm) return ofx_done(&f);
  void* dev[16];
  void* tier = NULL;
  int n = fill_under_32m_limit(&f, dev, &tier);
  CHECK(host_creations(f.gm) == 1);
  /* Freed and retired: its host pages are kept. */
  CHECK_STATUS(gpumem_free(f.gm, tier), GPUMEM_OK);
  check_ok(f.gm, "a free of a tier block");
  void* again = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, 8 * MIB, 0, &again), GPUMEM_OK);
  check_ok(f.gm, "a request of the same size on host pages");
  gpumem_stats_t st = stats(f.gm);
  CHECK_MSG(host_creations(f.gm) == 1 && st.num_host_pages_reused == 1 && st.num_host_allocs == 2 &&
                st.host_cached_bytes[GPUMEM_POOL_ALL].current == 0 &&
                st.host_bytes[GPUMEM_POOL_ALL].current == (int64_t)(8 * MIB),
            "host pages created %" PRIu64 ", reused %" PRId64 ", kept %" PRId64,
            host_creations(f.gm), st.num_host_pages_reused,
            st.host_cached_bytes[GPUMEM_POOL_ALL].current);
  fill(f.sim, again, 8 * MIB, 21);
  CHECK(intact(f.sim, again, 8 * MIB, 21));
  /* (the simulated device's work is done at once: the free retires it) */
  CHECK_STATUS(gpumem_free(f.gm, again), GPUMEM_OK);
  check_ok(f.gm, "a second retirement");
  st = stats(f.gm);
  CHECK(st.host_cached_bytes[GPUMEM_POOL_ALL].current == (int64_t)(8 * MIB) &&
        st.host_cached_bytes[GPUMEM_POOL_LARGE].current == (int64_t)(8 * MIB) &&
        st.host_bytes[GPUMEM_POOL_ALL].current == 0);
  /* A larger request is a new allocation; the kept one goes, so that held
   * and kept never pass the most held at once (16 MiB now). */
  void* big = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, 16 * MIB, 0, &big), GPUMEM_OK);
  check_ok(f.gm, "a larger request on host pages");
  gpumem_sim_counters_t c;
  gpumem_sim_get_counters(f.sim, &c);
  st = stats(f.gm);
  CHECK_MSG(host_creations(f.gm) == 2 && st.host_cached_bytes[GPUMEM_POOL_ALL].current == 0 &&
                c.host_bytes_in_use == 16 * MIB,
            "created %" PRIu64 ", kept %" PRId64 ", host in use %" PRIu64, host_creations(f.gm),
            st.host_cached_bytes[GPUMEM_POOL_ALL].current, c.host_bytes_in_use);
  /* The out-of-memory report and empty_cache: kept pages named, then gone. */
  CHECK_STATUS(gpumem_free(f.gm, big), GPUMEM_OK);
  check_ok(f.gm, "a third retirement");
  CHECK(stats(f.gm).host_cached_bytes[GPUMEM_POOL_ALL].current == (int64_t)(16 * MIB));
  /* Kept pages are within the budget, not against it: a request past the
   * budget is refused, and the report names what is kept. */
  void* over = NULL;
  clear_error();
  CHECK_STATUS(gpumem_malloc(f.gm, 32 * MIB, 0, &over), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_MSG(strstr(gpumem_last_error(),
                   "Overflow tier: 0 B on host pages and 16.00 MiB kept for reuse (budget 24.00 "
                   "MiB)") != NULL,
            "report: %s", gpumem_last_error());
  check_ok(f.gm, "a request past the host budget");
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  check_ok(f.gm, "empty_cache with kept host pages");
  gpumem_sim_get_counters(f.sim, &c);
  CHECK(stats(f.gm).host_cached_bytes[GPUMEM_POOL_ALL].current == 0 && c.host_bytes_in_use == 0);
  for (int i = 0; i < n; i++) CHECK_STATUS(gpumem_free(f.gm, dev[i]), GPUMEM_OK);
  check_ok(f.gm, "the last frees");
  ofx_done(&f);
}

/* ---- every backend call failing in turn ---- */

/* One scenario through every path of the tier: blocks overflow, come back,
 * go out under pressure, take the hint, are freed. Every status is either
 * OK or a clean failure; after each, gpumem_check passes and every live
 * block still holds its bytes. Returns whether the scripted failure fired. */
static bool fault_run(long skip, int kind, int* failures_seen) {
  ofx_t f = ofx_new("overflow:host:40M,limit:24M", 1024 * MIB);
  if (!f.gm) {
    ofx_done(&f);
    return false;
  }
  gpumem_sim_fail(f.sim, kind, skip, 1,
                  kind == GPUMEM_CALL_create_host_page || kind == -1 ? GPUMEM_ERR_OUT_OF_MEMORY
                                                                     : GPUMEM_ERR_BACKEND);
  enum { N = 10 };
  void* p[N] = {0};
  size_t sz = 6 * MIB;
#define OP_DONE(what)                                                                             \
  do {                                                                                            \
    check_ok(f.gm, what);                                                                         \
    for (int j = 0; j < N; j++)                                                                   \
      if (p[j])                                                                                   \
        CHECK_MSG(intact(f.sim, p[j], sz, (uint32_t)j), "block %d lost bytes after %s", j, what); \
  } while (0)
  for (int i = 0; i < 7; i++) {
    gpumem_status_t st = gpumem_malloc(f.gm, sz, 0, &p[i]);
    /* A failed device operation of the tier ends as out of memory (the
     * request could be served neither on the device nor on the host); a
     * failure of the device path itself, before the tier, stays the device
     * error it is without the tier. */
    CHECK_MSG(st == GPUMEM_OK || st == GPUMEM_ERR_OUT_OF_MEMORY ||
                  (st == GPUMEM_ERR_BACKEND && !strstr(gpumem_last_error(), "overflow:host")),
              "malloc: %s: %s", gpumem_strerror(st), gpumem_last_error());
    if (st != GPUMEM_OK) {
      (*failures_seen)++;
      p[i] = NULL;
    } else {
      fill(f.sim, p[i], sz, (uint32_t)i);
    }
    OP_DONE("a malloc");
  }
  for (int i = 0; i < 3; i++) {
    if (!p[i]) continue;
    gpumem_status_t st = gpumem_free(f.gm, p[i]);
    if (st == GPUMEM_OK)
      p[i] = NULL;
    else
      (*failures_seen)++;
    OP_DONE("a free");
  }
  if (gpumem_empty_cache(f.gm) != GPUMEM_OK) (*failures_seen)++;
  OP_DONE("empty_cache");
  for (int i = 7; i < N; i++) {
    gpumem_status_t st = gpumem_malloc(f.gm, sz, 0, &p[i]);
    CHECK_MSG(st == GPUMEM_OK || st == GPUMEM_ERR_OUT_OF_MEMORY ||
                  (st == GPUMEM_ERR_BACKEND && !strstr(gpumem_last_error(), "overflow:host")),
              "malloc under pressure: %s: %s", gpumem_strerror(st), gpumem_last_error());
    if (st != GPUMEM_OK) {
      (*failures_seen)++;
      p[i] = NULL;
    } else {
      fill(f.sim, p[i], sz, (uint32_t)i);
    }
    OP_DONE("a malloc under pressure");
  }
  for (int i = 0; i < N; i++)
    if (p[i]) (void)gpumem_prefer_host(f.gm, p[i]);
  OP_DONE("the hint");
  for (int i = 5; i < 8; i++) {
    if (!p[i]) continue;
    if (gpumem_free(f.gm, p[i]) == GPUMEM_OK)
      p[i] = NULL;
    else
      (*failures_seen)++;
    OP_DONE("a free of a late block");
  }
  if (gpumem_empty_cache(f.gm) != GPUMEM_OK) (*failures_seen)++;
  OP_DONE("the last empty_cache");
  bool fired = stop_failing(f.sim);
  for (int i = 0; i < N; i++) {
    if (!p[i]) continue;
    CHECK_STATUS(gpumem_free(f.gm, p[i]), GPUMEM_OK);
    p[i] = NULL;
    OP_DONE("a free after the failures");
  }
#undef OP_DONE
  gpumem_destroy(f.gm);
  gpumem_sim_destroy(f.sim);
  return fired;
}

static void test_faults(bool arena) {
  const int kinds[] = {-1,
                       GPUMEM_CALL_create_host_page,
                       GPUMEM_CALL_create_page,
                       GPUMEM_CALL_reserve,
                       GPUMEM_CALL_map,
                       GPUMEM_CALL_unmap,
                       GPUMEM_CALL_copy,
                       GPUMEM_CALL_stream_sync,
                       GPUMEM_CALL_event_record,
                       GPUMEM_CALL_event_query,
                       GPUMEM_CALL_event_create};
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
    int failures = 0;
    long runs = 0;
    for (long skip = 0; skip < 100000; skip++) {
      runs++;
      if (!(arena ? arena_fault_run : fault_run)(skip, kinds[k], &failures)) break;
    }
    /* These paths use every kind of backend operation, so some failure
     * reached the caller or was absorbed; the sweep ended where the script
     * outlived the run. */
    CHECK_MSG(runs > 1, "kind %d: the paths never reached it", kinds[k]);
    printf("faults of %s%s: %ld runs, %d operations failed cleanly\n",
           kinds[k] < 0 ? "any call" : gpumem_backend_call_name(kinds[k]),
           arena ? " (arena blocks)" : "", runs - 1, failures);
  }
}

/* ---- a shared budget ---- */

static uint64_t budget_mine(gpumem_t* gm) {
  gpumem_shared_budget_t b;
  memset(&b, 0, sizeof b);
  b.struct_size = sizeof b;
  if (gpumem_shared_budget(gm, &b) != GPUMEM_OK) return UINT64_MAX;
  return b.mine;
}

/* The tier's device pages count in the shared budget as reserved memory
 * does, through moves both ways: the budget's share of this allocator is
 * its reserved bytes after every operation. */
static void test_shared_budget(void) {
  char dir[] = "/tmp/gpumem-overflow-budget-XXXXXX";
  if (!mkdtemp(dir)) {
    CHECK_MSG(0, "mkdtemp failed");
    return;
  }
  setenv("GPUMEM_PUBLISH_DIR", dir, 1);
  char conf[128];
  snprintf(conf, sizeof conf, "overflow:host,shared_limit:32M,shared_name:ovf%d", (int)getpid());
  ofx_t f = ofx_new(conf, 1024 * MIB);
  if (!f.gm) return ofx_done(&f);
#define BUDGET_HOLDS(what)                                                                       \
  CHECK_MSG(budget_mine(f.gm) == (uint64_t)stats(f.gm).reserved_bytes[0].current,                \
            "after %s: the budget holds %" PRIu64 " of this allocator, reserved %" PRId64, what, \
            budget_mine(f.gm), stats(f.gm).reserved_bytes[0].current)
  void* dev[8];
  void* tier = NULL;
  int n = fill_device(&f, 8 * MIB, dev, 8, &tier);
  CHECK(n >= 2 && tier != NULL);
  BUDGET_HOLDS("a block on host pages");
  fill(f.sim, tier, 8 * MIB, 9);
  CHECK_STATUS(gpumem_free(f.gm, dev[0]), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  check_ok(f.gm, "empty_cache under a shared budget");
  CHECK(stats(f.gm).num_moves_to_device == 1);
  BUDGET_HOLDS("a move back");
  CHECK_STATUS(gpumem_malloc(f.gm, 8 * MIB, 0, &dev[0]), GPUMEM_OK);
  check_ok(f.gm, "pressure under a shared budget");
  CHECK(stats(f.gm).num_moves_to_host == 1);
  BUDGET_HOLDS("a move out");
  CHECK(intact(f.sim, tier, 8 * MIB, 9));
  for (int i = 0; i < n; i++) CHECK_STATUS(gpumem_free(f.gm, dev[i]), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f.gm, tier), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  check_ok(f.gm, "the last frees under a shared budget");
  BUDGET_HOLDS("the last frees");
#undef BUDGET_HOLDS
  ofx_done(&f);
  unsetenv("GPUMEM_PUBLISH_DIR");
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  CHECK(system(cmd) == 0);
}

/* ---- gpumem top's figures ---- */

static int find_own(const gpumem_published_t* p, void* arg) {
  if (p->pid == (int)getpid()) *(gpumem_published_t*)arg = *p;
  return 0;
}

/* The tier's figures reach other processes: host bytes and moves both
 * ways in the published record that gpumem top reads. */
static void test_published(void) {
  char dir[] = "/tmp/gpumem-overflow-XXXXXX";
  if (!mkdtemp(dir)) {
    CHECK_MSG(0, "mkdtemp failed");
    return;
  }
  setenv("GPUMEM_PUBLISH_DIR", dir, 1);
  ofx_t f = ofx_new("overflow:host,limit:16M,publish:on", 1024 * MIB);
  if (!f.gm) return ofx_done(&f);
  void* dev[8];
  void* tier = NULL;
  int n = fill_device(&f, 8 * MIB, dev, 8, &tier);
  CHECK(n == 2 && tier != NULL);
  CHECK_STATUS(gpumem_publish(f.gm), GPUMEM_OK);
  gpumem_published_t seen;
  memset(&seen, 0, sizeof seen);
  CHECK(gpumem_published_scan(dir, find_own, &seen) >= 1);
  CHECK_MSG(seen.host_bytes == (int64_t)(8 * MIB) && seen.num_moves_to_host == 0,
            "published host bytes %" PRId64, seen.host_bytes);
  for (int i = 0; i < n; i++) CHECK_STATUS(gpumem_free(f.gm, dev[i]), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(f.gm), GPUMEM_OK);
  CHECK_STATUS(gpumem_publish(f.gm), GPUMEM_OK);
  CHECK(gpumem_published_scan(dir, find_own, &seen) >= 1);
  CHECK_MSG(seen.host_bytes == 0 && seen.num_moves_to_device == 1,
            "after a move back: host bytes %" PRId64 ", moves back %" PRId64, seen.host_bytes,
            seen.num_moves_to_device);
  CHECK_STATUS(gpumem_free(f.gm, tier), GPUMEM_OK);
  ofx_done(&f);
  unsetenv("GPUMEM_PUBLISH_DIR");
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  CHECK(system(cmd) == 0);
}

int main(void) {
  test_setting();
  test_host_pages_and_budget();
  test_backend_without_host_pages();
  test_moves_and_hint();
  test_no_ping_pong();
  test_checksums_two_streams();
  test_published();
  test_shared_budget();
  test_arena_cold_blocks();
  test_warm_blocks_short_of_cold();
  test_kept_host_pages();
  test_faults(false);
  test_faults(true);
  return test_finish("test_overflow");
}
