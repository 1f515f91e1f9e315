/* The overflow tier (option overflow:host) over the CUDA backend on a real
 * GPU: the backend's host pages (cuMemCreate with a host NUMA location,
 * else a host location) mapped into a device range and read and written
 * there; an allocator capped below what it is asked for, whose requests
 * past the cap land on host pages; checksums written into every block,
 * moves to device pages (empty_cache) and back to host (pressure, with
 * work queued on two streams), and every checksum read back the same at
 * the same address; and the time of a move each way, printed (the figures
 * the design's model stands in for until measured).
 *
 * Exits 77 (skipped), saying why, where no driver or GPU exists, and
 * fails saying the driver's words where the driver refuses host pages
 * (the tier cannot serve on that machine). */
#include <inttypes.h>
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

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void fill_pattern(uintptr_t addr, size_t len, unsigned seed) {
  unsigned char* h = malloc(len);
  if (!h) return;
  for (size_t i = 0; i < len; i++) h[i] = pattern_byte(i, seed);
  DRV_OK(drv.MemcpyHtoD((drv_ptr)addr, h, len));
  free(h);
}

static size_t check_pattern(uintptr_t addr, size_t len, unsigned seed) {
  unsigned char* h = malloc(len);
  size_t bad = 0;
  if (!h) return len;
  DRV_OK(drv.MemcpyDtoH(h, (drv_ptr)addr, len));
  for (size_t i = 0; i < len; i++) bad += h[i] != pattern_byte(i, seed);
  free(h);
  return bad;
}

/* Bytes of [p, p+len) that are not value. */
static size_t count_not(void* p, size_t len, unsigned char value) {
  unsigned char* h = malloc(len);
  size_t bad = 0;
  if (!h) return len;
  DRV_OK(drv.MemcpyDtoH(h, (drv_ptr)(uintptr_t)p, len));
  for (size_t i = 0; i < len; i++) bad += h[i] != value;
  free(h);
  return bad;
}

/* The backend's host pages alone: made, mapped, written, read, unmapped. */
static bool test_host_page_slots(gpumem_backend_t* be) {
  CHECK_MSG(be->create_host_page && be->copy, "backend \"%s\" lacks create_host_page or copy",
            be->name);
  if (!be->create_host_page || !be->copy) return false;
  size_t size = 4 * be->page_size;
  gpumem_phys_t host = 0;
  gpumem_status_t st = be->create_host_page(be->ctx, size, &host);
  CHECK_MSG(st == GPUMEM_OK, "create_host_page(%zu): %s: %s", size, gpumem_strerror(st),
            gpumem_last_error());
  if (st != GPUMEM_OK) {
    printf("the driver refuses host pages: the overflow tier cannot serve here: %s\n",
           gpumem_last_error());
    return false;
  }
  uintptr_t va = 0, va2 = 0;
  CHECK_STATUS(be->reserve(be->ctx, size, &va), GPUMEM_OK);
  CHECK_STATUS(be->reserve(be->ctx, size, &va2), GPUMEM_OK);
  CHECK_STATUS(be->map(be->ctx, va, size, host), GPUMEM_OK);
  fill_pattern(va, size, 3);
  CHECK(check_pattern(va, size, 3) == 0);
  /* copy into device pages mapped elsewhere, and back the same */
  gpumem_phys_t dev = 0;
  CHECK_STATUS(be->create_page(be->ctx, size, &dev), GPUMEM_OK);
  CHECK_STATUS(be->map(be->ctx, va2, size, dev), GPUMEM_OK);
  CHECK_STATUS(be->copy(be->ctx, va2, va, size, 0), GPUMEM_OK);
  CHECK_STATUS(be->stream_sync(be->ctx, 0), GPUMEM_OK);
  CHECK(check_pattern(va2, size, 3) == 0);
  CHECK_STATUS(be->unmap(be->ctx, va2, size), GPUMEM_OK);
  CHECK_STATUS(be->unmap(be->ctx, va, size), GPUMEM_OK);
  CHECK_STATUS(be->release_page(be->ctx, dev, size), GPUMEM_OK);
  CHECK_STATUS(be->release_page(be->ctx, host, size), GPUMEM_OK);
  CHECK_STATUS(be->release_range(be->ctx, va, size), GPUMEM_OK);
  CHECK_STATUS(be->release_range(be->ctx, va2, size), GPUMEM_OK);
  return true;
}

static gpumem_stats_t stats(gpumem_t* gm) {
  gpumem_stats_t s;
  gpumem_get_stats(gm, &s);
  return s;
}

/* An allocator with the overflow tier under a 256 MiB cap (NULL, the
 * failure counted, where it cannot be made). */
static gpumem_t* create_capped(gpumem_backend_t* be) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, "overflow:host,limit:256M,publish:off"), GPUMEM_OK);
  gpumem_status_t st = GPUMEM_OK;
  gpumem_t* gm = gpumem_create(be, &o, &st);
  CHECK_MSG(gm != NULL, "create: %s", gpumem_last_error());
  return gm;
}

/* The allocator under a cap: requests past it on host pages, moves both
 * ways with work queued on two streams, checksums the same throughout. */
static void test_tier(gpumem_backend_t* be) {
  gpumem_t* gm = create_capped(be);
  if (!gm) return;
  drv_stream s1 = NULL, s2 = NULL;
  DRV_OK(drv.StreamCreate(&s1, DRV_STREAM_NON_BLOCKING));
  DRV_OK(drv.StreamCreate(&s2, DRV_STREAM_NON_BLOCKING));
  enum { N = 12 };
  void* p[N] = {0};
  const size_t sz = 32 * MIB;
  for (int i = 0; i < N; i++) {
    drv_stream s = i % 2 ? s2 : s1;
    CHECK_STATUS(gpumem_malloc(gm, sz, (gpumem_stream_t)s, &p[i]), GPUMEM_OK);
    if (!p[i]) continue;
    CHECK_STATUS(gpumem_record_stream(gm, p[i], (gpumem_stream_t)(i % 2 ? s1 : s2)), GPUMEM_OK);
    fill_pattern((uintptr_t)p[i], sz, (unsigned)i + 1);
    CHECK(gpumem_check(gm) == 0);
  }
  gpumem_stats_t s = stats(gm);
  printf("under a 256 MiB cap, 12 x 32 MiB: %" PRId64 " on host pages (%.0f MiB host-backed)\n",
         s.num_host_allocs, (double)s.host_bytes[GPUMEM_POOL_ALL].current / (double)MIB);
  CHECK(s.num_host_allocs >= 4);
  /* Work queued on both streams, on the last two blocks (on host pages:
   * the last to come), while blocks move: a move copies on the block's
   * stream, after that work. */
  queue_busy_work((uintptr_t)p[N - 2], sz, s1, 50);
  queue_busy_work((uintptr_t)p[N - 1], sz, s2, 50);
  const unsigned char seed0 = 50; /* what the busy work leaves there */
  CHECK_STATUS(gpumem_free(gm, p[2]), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p[3]), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p[4]), GPUMEM_OK);
  p[2] = p[3] = p[4] = NULL;
  double t0 = now_s();
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  double t_back = now_s() - t0;
  CHECK(gpumem_check(gm) == 0);
  gpumem_stats_t s2st = stats(gm);
  printf("empty_cache: %" PRId64
         " blocks moved to device pages in %.3f ms (%.3f ms measured in "
         "moves, %.1f GB/s)\n",
         s2st.num_moves_to_device - s.num_moves_to_device, t_back * 1e3,
         (double)(s2st.move_to_device_ns - s.move_to_device_ns) * 1e-6,
         s2st.move_to_device_ns > s.move_to_device_ns
             ? (double)(s2st.bytes_moved_to_device - s.bytes_moved_to_device) /
                   (double)(s2st.move_to_device_ns - s.move_to_device_ns)
             : 0.0);
  CHECK(s2st.num_moves_to_device > s.num_moves_to_device);
  for (int i = 5; i < N - 2; i++)
    CHECK_MSG(check_pattern((uintptr_t)p[i], sz, (unsigned)i + 1) == 0, "block %d after moves back",
              i);
  /* Pressure: cold tier blocks move out to host pages. */
  void* q[3] = {0};
  queue_busy_work((uintptr_t)p[N - 2], sz, s1, 50);
  for (int k = 0; k < 3; k++) {
    CHECK_STATUS(gpumem_malloc(gm, sz, (gpumem_stream_t)s1, &q[k]), GPUMEM_OK);
    CHECK(gpumem_check(gm) == 0);
  }
  gpumem_stats_t s3 = stats(gm);
  printf("pressure: %" PRId64 " blocks moved to host pages (%.3f ms measured, %.1f GB/s)\n",
         s3.num_moves_to_host - s2st.num_moves_to_host,
         (double)(s3.move_to_host_ns - s2st.move_to_host_ns) * 1e-6,
         s3.move_to_host_ns > s2st.move_to_host_ns
             ? (double)(s3.bytes_moved_to_host - s2st.bytes_moved_to_host) /
                   (double)(s3.move_to_host_ns - s2st.move_to_host_ns)
             : 0.0);
  CHECK(s3.num_moves_to_host > s2st.num_moves_to_host);
  DRV_OK(drv.StreamSynchronize(s1));
  DRV_OK(drv.StreamSynchronize(s2));
  /* The busy work's last memset is what the last two blocks hold. */
  CHECK_MSG(count_not(p[N - 2], sz, seed0) == 0 && count_not(p[N - 1], sz, seed0) == 0,
            "the work queued while blocks moved wrote elsewhere");
  for (int i = 0; i < N - 2; i++)
    if (p[i])
      CHECK_MSG(check_pattern((uintptr_t)p[i], sz, (unsigned)i + 1) == 0,
                "block %d after moves both ways", i);
  for (int i = 0; i < N; i++)
    if (p[i]) CHECK_STATUS(gpumem_free(gm, p[i]), GPUMEM_OK);
  for (int k = 0; k < 3; k++) CHECK_STATUS(gpumem_free(gm, q[k]), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  CHECK(stats(gm).host_bytes[GPUMEM_POOL_ALL].current == 0);
  gpumem_destroy(gm);
  DRV_OK(drv.StreamDestroy(s1));
  DRV_OK(drv.StreamDestroy(s2));
}

/* Arena blocks on a real GPU: cold blocks (made long ago, on two streams,
 * each handed to the other) hold checksums; hot blocks fill the cap, and
 * the cold blocks' whole pages move to host pages (no request goes there)
 * while work runs on both streams; empty_cache brings them back; the
 * hint moves one out again and its free gives the host pages back. Every
 * checksum reads back the same at the same address. */
static void test_arena_blocks(gpumem_backend_t* be) {
  gpumem_t* gm = create_capped(be);
  if (!gm) return;
  drv_stream s1 = NULL, s2 = NULL;
  DRV_OK(drv.StreamCreate(&s1, DRV_STREAM_NON_BLOCKING));
  DRV_OK(drv.StreamCreate(&s2, DRV_STREAM_NON_BLOCKING));
  enum { COLD = 3, HOT = 8 };
  const size_t cold_sz = 40 * MIB + 512, hot_sz = 32 * MIB;
  void* cold[COLD] = {0};
  void* hot[HOT] = {0};
  for (int i = 0; i < COLD; i++) {
    CHECK_STATUS(gpumem_malloc(gm, cold_sz, (gpumem_stream_t)(i % 2 ? s2 : s1), &cold[i]),
                 GPUMEM_OK);
    if (!cold[i]) return;
    CHECK_STATUS(gpumem_record_stream(gm, cold[i], (gpumem_stream_t)(i % 2 ? s1 : s2)), GPUMEM_OK);
    fill_pattern((uintptr_t)cold[i], cold_sz, 100u + (unsigned)i);
  }
  /* A step's worth of allocations since: the cold blocks are old. */
  for (int i = 0; i < 1100; i++) {
    void* t = NULL;
    CHECK_STATUS(gpumem_malloc(gm, 4096, (gpumem_stream_t)s1, &t), GPUMEM_OK);
    CHECK_STATUS(gpumem_free(gm, t), GPUMEM_OK);
  }
  int n = 0;
  while (n < HOT && stats(gm).num_moves_to_host < 2) {
    CHECK_STATUS(gpumem_malloc(gm, hot_sz, (gpumem_stream_t)(n % 2 ? s2 : s1), &hot[n]), GPUMEM_OK);
    if (!hot[n]) break;
    /* the hot blocks are busy on their streams while the cold ones move */
    queue_busy_work((uintptr_t)hot[n], hot_sz, n % 2 ? s2 : s1, 20);
    n++;
    CHECK(gpumem_check(gm) == 0);
  }
  gpumem_stats_t s = stats(gm);
  printf("arena blocks under a 256 MiB cap: %" PRId64
         " cold blocks moved out (%.0f MiB, %.3f ms "
         "measured, %.1f GB/s), %" PRId64 " requests on host pages, after %d hot blocks\n",
         s.num_moves_to_host, (double)s.bytes_moved_to_host / (double)MIB,
         (double)s.move_to_host_ns * 1e-6,
         s.move_to_host_ns ? (double)s.bytes_moved_to_host / (double)s.move_to_host_ns : 0.0,
         s.num_host_allocs, n);
  CHECK(s.num_moves_to_host == 2 && s.num_host_allocs == 0);
  for (int i = 0; i < COLD; i++)
    CHECK_MSG(check_pattern((uintptr_t)cold[i], cold_sz, 100u + (unsigned)i) == 0,
              "cold block %d after moves out", i);
  DRV_OK(drv.StreamSynchronize(s1));
  DRV_OK(drv.StreamSynchronize(s2));
  for (int i = 0; i < n; i++)
    CHECK_MSG(count_not(hot[i], hot_sz, 20) == 0, "hot block %d: the busy work wrote elsewhere", i);
  for (int i = 0; i < n; i += 2) {
    CHECK_STATUS(gpumem_free(gm, hot[i]), GPUMEM_OK);
    hot[i] = NULL;
  }
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  gpumem_stats_t s2st = stats(gm);
  printf(
      "empty_cache: %" PRId64 " arena blocks back on device pages (%.3f ms measured, %.1f GB/s)\n",
      s2st.num_moves_to_device, (double)s2st.move_to_device_ns * 1e-6,
      s2st.move_to_device_ns ? (double)s2st.bytes_moved_to_device / (double)s2st.move_to_device_ns
                             : 0.0);
  CHECK(s2st.num_moves_to_device == 2 && s2st.host_bytes[GPUMEM_POOL_ALL].current == 0);
  for (int i = 0; i < COLD; i++)
    CHECK_MSG(check_pattern((uintptr_t)cold[i], cold_sz, 100u + (unsigned)i) == 0,
              "cold block %d after moves back", i);
  CHECK_STATUS(gpumem_prefer_host(gm, cold[1]), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  CHECK(stats(gm).num_moves_to_host == 3);
  CHECK(check_pattern((uintptr_t)cold[1], cold_sz, 101u) == 0);
  CHECK_STATUS(gpumem_free(gm, cold[1]), GPUMEM_OK);
  cold[1] = NULL;
  CHECK(gpumem_check(gm) == 0);
  CHECK(stats(gm).host_bytes[GPUMEM_POOL_ALL].current == 0);
  for (int i = 0; i < COLD; i++)
    if (cold[i]) {
      CHECK(check_pattern((uintptr_t)cold[i], cold_sz, 100u + (unsigned)i) == 0);
      CHECK_STATUS(gpumem_free(gm, cold[i]), GPUMEM_OK);
    }
  for (int i = 0; i < n; i++)
    if (hot[i]) CHECK_STATUS(gpumem_free(gm, hot[i]), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
  DRV_OK(drv.StreamDestroy(s1));
  DRV_OK(drv.StreamDestroy(s2));
}

int main(void) {
  const char* name = "gpu_test_overflow_cuda";
  int exit_code = 0;
  gpumem_backend_t* be = gpu_test_backend(name, &exit_code);
  if (!be) return exit_code;
  if (!be->map) {
    printf("SKIP: the device has no virtual memory management (backend \"%s\")\n", be->name);
    gpumem_cuda_destroy(be);
    drv_close();
    return TEST_SKIP;
  }
  if (test_host_page_slots(be)) {
    test_tier(be);
    test_arena_blocks(be);
  }
  gpumem_cuda_destroy(be);
  drv_close();
  return test_finish(name);
}
