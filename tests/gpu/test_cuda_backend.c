/* The CUDA backend's slots, called directly on a real GPU: granularity, the
 * reserve/create/map/unmap/release lifecycle with the memory checked byte
 * for byte, plain alloc/free, events and stream syncs, context handling
 * (none current, the primary current, another context current, a fresh
 * thread), error mapping and out of memory. Exits 77 (skipped) where no
 * driver or GPU exists.
 *
 * The test drives the GPU itself (memset, copies, streams) through the
 * driver API, opened with dlopen like the backend does: it is linked with
 * neither the CUDA runtime nor cuda.h: the binding (cuda_driver.h)
 * declares the few types it needs with their ABI. */
#include <pthread.h>
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

/* Fills [addr, addr+len) on the device with a position-dependent pattern
 * (so a page mapped at the wrong place shows), from a host buffer. */
static void fill_pattern(uintptr_t addr, size_t len, unsigned seed) {
  size_t chunk = len < 8 * MIB ? len : 8 * MIB;
  unsigned char* h = malloc(chunk);
  if (!h) return;
  for (size_t off = 0; off < len; off += chunk) {
    size_t n = len - off < chunk ? len - off : chunk;
    for (size_t i = 0; i < n; i++) h[i] = pattern_byte(off + i, seed);
    DRV_OK(drv.MemcpyHtoD((drv_ptr)(addr + off), h, n));
  }
  free(h);
}

/* Returns the number of bytes that differ from the pattern. */
static size_t check_pattern(uintptr_t addr, size_t len, unsigned seed) {
  size_t chunk = len < 8 * MIB ? len : 8 * MIB;
  unsigned char* h = malloc(chunk);
  size_t bad = 0;
  if (!h) return len;
  for (size_t off = 0; off < len; off += chunk) {
    size_t n = len - off < chunk ? len - off : chunk;
    DRV_OK(drv.MemcpyDtoH(h, (drv_ptr)(addr + off), n));
    for (size_t i = 0; i < n; i++) bad += h[i] != pattern_byte(off + i, seed);
  }
  free(h);
  return bad;
}

/* Bytes in [addr, addr+len) that are not all `value`. */
static size_t check_value(uintptr_t addr, size_t len, unsigned char value) {
  size_t chunk = len < 8 * MIB ? len : 8 * MIB;
  unsigned char* h = malloc(chunk);
  size_t bad = 0;
  if (!h) return len;
  for (size_t off = 0; off < len; off += chunk) {
    size_t n = len - off < chunk ? len - off : chunk;
    DRV_OK(drv.MemcpyDtoH(h, (drv_ptr)(addr + off), n));
    for (size_t i = 0; i < n; i++) bad += h[i] != value;
  }
  free(h);
  return bad;
}

/* ---- the tests ---------------------------------------------------------- */

static void test_options(void) {
  gpumem_cuda_options_t o;
  gpumem_cuda_options_init(&o);
  CHECK(o.struct_size == sizeof o);
  CHECK(o.device == 0 && o.virtual_memory == 1 && o.peer_access_mask == 0);

  gpumem_status_t st = GPUMEM_OK;
  o.device = 4096;
  CHECK(gpumem_cuda_create(&o, &st) == NULL);
  CHECK_MSG(st == GPUMEM_ERR_INVALID_ARGUMENT, "got %s", gpumem_strerror(st));
  CHECK_MSG(strstr(gpumem_last_error(), "4096") != NULL, "%s", gpumem_last_error());

  gpumem_cuda_options_init(&o);
  o.peer_access_mask = (uint64_t)1 << 63;
  CHECK(gpumem_cuda_create(&o, &st) == NULL);
  CHECK_MSG(st == GPUMEM_ERR_INVALID_ARGUMENT, "got %s (%s)", gpumem_strerror(st),
            gpumem_last_error());

  gpumem_cuda_options_init(&o);
  o.struct_size = 0;
  CHECK(gpumem_cuda_create(&o, &st) == NULL);
  CHECK(st == GPUMEM_ERR_INVALID_ARGUMENT);

  gpumem_cuda_destroy(NULL); /* safe */
}

/* The backend makes its context current where none is, and its slots work
 * before the application ever touched CUDA. */
static void test_context_none_current(gpumem_backend_t* be) {
  CHECK(drv_current() == NULL);
  size_t fr = 0, tot = 0;
  CHECK_STATUS(be->mem_info(be->ctx, &fr, &tot), GPUMEM_OK);
  CHECK(tot > 0 && fr > 0 && fr <= tot);
  CHECK_MSG(drv_current() == drv.primary, "the primary context is current after a slot");
  printf("device memory: %.2f GiB total, %.2f GiB free\n", (double)tot / GIB, (double)fr / GIB);
}

static void test_granularity(gpumem_backend_t* be) {
  CHECK(be->version == GPUMEM_BACKEND_VERSION);
  CHECK(be->name && strcmp(be->name, "cuda") == 0);
  size_t ps = be->page_size;
  CHECK_MSG(ps >= 4096 && (ps & (ps - 1)) == 0, "page_size %zu", ps);
  printf("page size (minimum granularity): %zu bytes\n", ps);
  CHECK(be->reserve && be->release_range && be->create_page && be->release_page && be->map &&
        be->unmap);
  CHECK(be->alloc && be->free && be->mem_info);
  CHECK(be->event_create && be->event_destroy && be->event_record && be->event_query &&
        be->event_sync && be->stream_sync && be->device_sync && be->stream_wait && be->destroy);
}

static void test_vmm_lifecycle(gpumem_backend_t* be) {
  const size_t ps = be->page_size;
  size_t free0 = 0, tot = 0, free1 = 0, free2 = 0;
  CHECK_STATUS(be->mem_info(be->ctx, &free0, &tot), GPUMEM_OK);

  uintptr_t base = 0;
  CHECK_STATUS(be->reserve(be->ctx, 8 * ps, &base), GPUMEM_OK);
  CHECK(base != 0 && base % ps == 0);

  /* Three physical allocations: one page, one page, two pages. */
  gpumem_phys_t a = 0, b = 0, c = 0;
  CHECK_STATUS(be->create_page(be->ctx, ps, &a), GPUMEM_OK);
  CHECK_STATUS(be->create_page(be->ctx, ps, &b), GPUMEM_OK);
  CHECK_STATUS(be->create_page(be->ctx, 2 * ps, &c), GPUMEM_OK);
  CHECK_STATUS(be->mem_info(be->ctx, &free1, &tot), GPUMEM_OK);
  /* The driver may round its books to 2 MiB; 64 MiB covers page tables. */
  CHECK_MSG(free0 >= free1 && free0 - free1 + 64 * MIB >= 4 * ps, "free %zu -> %zu", free0, free1);

  CHECK_STATUS(be->map(be->ctx, base, ps, a), GPUMEM_OK);
  CHECK_STATUS(be->map(be->ctx, base + ps, ps, b), GPUMEM_OK);
  CHECK_STATUS(be->map(be->ctx, base + 2 * ps, 2 * ps, c), GPUMEM_OK);

  /* One copy across three mappings: access was granted on each. */
  fill_pattern(base, 4 * ps, 1);
  CHECK_MSG(check_pattern(base, 4 * ps, 1) == 0, "mapped memory reads back what was written");
  DRV_OK(drv.MemsetD8((drv_ptr)(base + ps), 0xA5, ps));
  CHECK(check_value(base + ps, ps, 0xA5) == 0);
  CHECK(check_pattern(base, ps, 1) == 0);

  /* One unmap covering two whole mappings, as the allocator issues them. */
  CHECK_STATUS(be->unmap(be->ctx, base, 2 * ps), GPUMEM_OK);
  /* Physical pages keep their contents while unmapped: map b elsewhere. */
  CHECK_STATUS(be->map(be->ctx, base + 5 * ps, ps, b), GPUMEM_OK);
  CHECK_MSG(check_value(base + 5 * ps, ps, 0xA5) == 0, "page b moved with its contents");
  /* And a back where b was. */
  CHECK_STATUS(be->map(be->ctx, base + ps, ps, a), GPUMEM_OK);
  CHECK(check_pattern(base + ps, ps, 1) == 0);

  /* Aliases (the allocator's ghosts): b mapped at a second address while
   * still mapped at the first is the same memory, and either mapping goes
   * on working when the other is unmapped. */
  CHECK_STATUS(be->map(be->ctx, base + 6 * ps, ps, b), GPUMEM_OK);
  CHECK_MSG(check_value(base + 6 * ps, ps, 0xA5) == 0, "an alias reads what the page holds");
  DRV_OK(drv.MemsetD8((drv_ptr)(base + 6 * ps), 0x5A, ps));
  CHECK_MSG(check_value(base + 5 * ps, ps, 0x5A) == 0,
            "a write through an alias shows through the other");
  CHECK_STATUS(be->unmap(be->ctx, base + 5 * ps, ps), GPUMEM_OK);
  CHECK(check_value(base + 6 * ps, ps, 0x5A) == 0);
  CHECK_STATUS(be->map(be->ctx, base + 5 * ps, ps, b), GPUMEM_OK);

  CHECK_STATUS(be->unmap(be->ctx, base + ps, ps), GPUMEM_OK);
  CHECK_STATUS(be->unmap(be->ctx, base + 2 * ps, 2 * ps), GPUMEM_OK);
  CHECK_STATUS(be->unmap(be->ctx, base + 5 * ps, 2 * ps), GPUMEM_OK); /* both aliases at once */
  CHECK_STATUS(be->release_page(be->ctx, a, ps), GPUMEM_OK);
  CHECK_STATUS(be->release_page(be->ctx, b, ps), GPUMEM_OK);
  CHECK_STATUS(be->release_page(be->ctx, c, 2 * ps), GPUMEM_OK);
  CHECK_STATUS(be->release_range(be->ctx, base, 8 * ps), GPUMEM_OK);

  CHECK_STATUS(be->mem_info(be->ctx, &free2, &tot), GPUMEM_OK);
  CHECK_MSG(free2 + 64 * MIB >= free0, "memory came back: free %zu -> %zu", free0, free2);

  /* A large range and a large page, as the default policy uses them (the
   * allocator reserves twice the device, rounded to pages: the driver
   * refuses sizes that are not multiples of the granularity). */
  const size_t span = (2 * tot + ps - 1) / ps * ps;
  const size_t mid = tot / ps * ps;
  uintptr_t big = 0;
  gpumem_phys_t p = 0;
  CHECK_STATUS(be->reserve(be->ctx, span, &big), GPUMEM_OK);
  if (!big) return;
  CHECK_STATUS(be->create_page(be->ctx, 512 * MIB, &p), GPUMEM_OK);
  CHECK_STATUS(be->map(be->ctx, big + mid, 512 * MIB, p), GPUMEM_OK);
  DRV_OK(drv.MemsetD8((drv_ptr)(big + mid), 0x3C, 512 * MIB));
  CHECK(check_value(big + mid + 511 * MIB, MIB, 0x3C) == 0);
  CHECK_STATUS(be->unmap(be->ctx, big + mid, 512 * MIB), GPUMEM_OK);
  CHECK_STATUS(be->release_page(be->ctx, p, 512 * MIB), GPUMEM_OK);
  CHECK_STATUS(be->release_range(be->ctx, big, span), GPUMEM_OK);
}

/* What each primitive costs, for the engine's design (printed, not
 * checked): the default policy maps pages on misses and under pressure. */
static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static void time_primitives(gpumem_backend_t* be) {
  enum { N = 256 };
  const size_t ps = be->page_size;
  static gpumem_phys_t pages[N];
  uintptr_t base = 0;
  CHECK_STATUS(be->reserve(be->ctx, N * ps, &base), GPUMEM_OK);
  if (!base) return;
  double t0 = now_us();
  for (int i = 0; i < N; i++) CHECK_STATUS(be->create_page(be->ctx, ps, &pages[i]), GPUMEM_OK);
  double t1 = now_us();
  for (int i = 0; i < N; i++)
    CHECK_STATUS(be->map(be->ctx, base + i * ps, ps, pages[i]), GPUMEM_OK);
  double t2 = now_us();
  CHECK_STATUS(be->unmap(be->ctx, base, N * ps), GPUMEM_OK); /* one call, N mappings */
  double t3 = now_us();
  for (int i = 0; i < N; i++)
    CHECK_STATUS(be->map(be->ctx, base + i * ps, ps, pages[i]), GPUMEM_OK);
  double t4 = now_us();
  for (int i = 0; i < N; i++) CHECK_STATUS(be->unmap(be->ctx, base + i * ps, ps), GPUMEM_OK);
  double t5 = now_us();
  for (int i = 0; i < N; i++) CHECK_STATUS(be->release_page(be->ctx, pages[i], ps), GPUMEM_OK);
  double t6 = now_us();
  gpumem_phys_t one = 0;
  CHECK_STATUS(be->create_page(be->ctx, N * ps, &one), GPUMEM_OK);
  double t7 = now_us();
  CHECK_STATUS(be->map(be->ctx, base, N * ps, one), GPUMEM_OK);
  double t8 = now_us();
  CHECK_STATUS(be->unmap(be->ctx, base, N * ps), GPUMEM_OK);
  double t9 = now_us();
  CHECK_STATUS(be->release_page(be->ctx, one, N * ps), GPUMEM_OK);
  CHECK_STATUS(be->release_range(be->ctx, base, N * ps), GPUMEM_OK);
  uintptr_t a = 0;
  double t10 = now_us();
  for (int i = 0; i < N; i++) {
    CHECK_STATUS(be->alloc(be->ctx, ps, &a), GPUMEM_OK);
    CHECK_STATUS(be->free(be->ctx, a, ps), GPUMEM_OK);
  }
  double t11 = now_us();
  printf(
      "primitive cost per %zu-byte page (us): create %.1f, map+access %.1f (again %.1f), "
      "unmap %.1f (batched %.1f), release %.1f; one %d-page allocation: create %.1f, "
      "map+access %.1f, unmap %.1f; cuMemAlloc+cuMemFree %.1f\n",
      ps, (t1 - t0) / N, (t2 - t1) / N, (t4 - t3) / N, (t5 - t4) / N, (t3 - t2) / N, (t6 - t5) / N,
      N, t7 - t6, t8 - t7, t9 - t8, (t11 - t10) / N);
}

static void test_plain(gpumem_backend_t* be) {
  uintptr_t p = 0;
  const size_t n = 3 * MIB + 1;
  CHECK_STATUS(be->alloc(be->ctx, n, &p), GPUMEM_OK);
  CHECK(p != 0 && p % 256 == 0);
  fill_pattern(p, n, 7);
  CHECK(check_pattern(p, n, 7) == 0);
  CHECK_STATUS(be->free(be->ctx, p, n), GPUMEM_OK);

  /* The plain-only backend. */
  gpumem_cuda_options_t o;
  gpumem_cuda_options_init(&o);
  o.virtual_memory = 0;
  gpumem_status_t st = GPUMEM_ERR_BACKEND;
  gpumem_backend_t* plain = gpumem_cuda_create(&o, &st);
  CHECK_STATUS(st, GPUMEM_OK);
  if (!plain) return;
  CHECK(strcmp(plain->name, "cuda-plain") == 0);
  CHECK(plain->page_size == 0);
  CHECK(!plain->reserve && !plain->release_range && !plain->create_page && !plain->release_page &&
        !plain->map && !plain->unmap);
  CHECK_STATUS(plain->alloc(plain->ctx, 100 * MIB, &p), GPUMEM_OK);
  DRV_OK(drv.MemsetD8((drv_ptr)p, 0x77, 100 * MIB));
  CHECK(check_value(p, 100 * MIB, 0x77) == 0);
  CHECK_STATUS(plain->free(plain->ctx, p, 100 * MIB), GPUMEM_OK);
  gpumem_cuda_destroy(plain);
  /* The other backend's retain keeps the primary context alive. */
  CHECK(drv_current() == drv.primary);
  size_t fr = 0, tot = 0;
  CHECK_STATUS(be->mem_info(be->ctx, &fr, &tot), GPUMEM_OK);
}

static void test_events(gpumem_backend_t* be) {
  drv_stream s = NULL;
  DRV_OK(drv.StreamCreate(&s, DRV_STREAM_NON_BLOCKING));
  const size_t n = 256 * MIB;
  uintptr_t buf = 0;
  CHECK_STATUS(be->alloc(be->ctx, n, &buf), GPUMEM_OK);

  gpumem_event_t ev = 0, ev0 = 0;
  CHECK_STATUS(be->event_create(be->ctx, &ev), GPUMEM_OK);
  CHECK_STATUS(be->event_create(be->ctx, &ev0), GPUMEM_OK);
  CHECK(ev != 0 && ev0 != 0 && ev != ev0);

  /* A fresh event counts as complete. */
  CHECK_STATUS(be->event_query(be->ctx, ev), GPUMEM_OK);

  queue_busy_work(buf, n, s, 80);
  CHECK_STATUS(be->event_record(be->ctx, ev, (gpumem_stream_t)s), GPUMEM_OK);
  gpumem_status_t q = be->event_query(be->ctx, ev);
  CHECK_MSG(q == GPUMEM_NOT_READY || q == GPUMEM_OK, "event_query -> %s", gpumem_strerror(q));
  printf("event query right after queued work: %s\n", gpumem_strerror(q));
  CHECK_STATUS(be->event_sync(be->ctx, ev), GPUMEM_OK);
  CHECK_STATUS(be->event_query(be->ctx, ev), GPUMEM_OK);
  CHECK(drv.StreamQuery(s) == DRV_SUCCESS);
  CHECK(check_value(buf, n, 80) == 0);

  /* stream_wait orders on the device: work queued on s2 after the wait
   * runs after s's work up to the record, so its write lands last, and
   * once s2 is idle so is s (the host never waited for s). */
  {
    drv_stream s2 = NULL;
    DRV_OK(drv.StreamCreate(&s2, DRV_STREAM_NON_BLOCKING));
    queue_busy_work(buf, n, s, 80);
    CHECK_STATUS(be->event_record(be->ctx, ev, (gpumem_stream_t)s), GPUMEM_OK);
    CHECK_STATUS(be->stream_wait(be->ctx, (gpumem_stream_t)s2, ev), GPUMEM_OK);
    DRV_OK(drv.MemsetD8Async((drv_ptr)buf, 0x33, n, s2));
    DRV_OK(drv.StreamSynchronize(s2));
    CHECK_MSG(drv.StreamQuery(s) == DRV_SUCCESS, "s idle once s2, which waited for it, is");
    CHECK_MSG(check_value(buf, n, 0x33) == 0, "the waiting stream's write landed last");
    DRV_OK(drv.StreamDestroy(s2));
  }

  /* stream_sync waits for the stream's work. */
  queue_busy_work(buf, n, s, 40);
  CHECK_STATUS(be->stream_sync(be->ctx, (gpumem_stream_t)s), GPUMEM_OK);
  CHECK_MSG(drv.StreamQuery(s) == DRV_SUCCESS, "stream idle after stream_sync");

  /* device_sync waits for every stream of the context. */
  queue_busy_work(buf, n, s, 40);
  CHECK_STATUS(be->device_sync(be->ctx), GPUMEM_OK);
  CHECK_MSG(drv.StreamQuery(s) == DRV_SUCCESS, "stream idle after device_sync");

  /* The legacy default stream (0). */
  DRV_OK(drv.MemsetD8Async((drv_ptr)buf, 0x42, n, NULL));
  CHECK_STATUS(be->event_record(be->ctx, ev0, 0), GPUMEM_OK);
  CHECK_STATUS(be->event_sync(be->ctx, ev0), GPUMEM_OK);
  CHECK_STATUS(be->stream_sync(be->ctx, 0), GPUMEM_OK);
  CHECK(check_value(buf, n, 0x42) == 0);

  CHECK_STATUS(be->event_destroy(be->ctx, ev), GPUMEM_OK);
  CHECK_STATUS(be->event_destroy(be->ctx, ev0), GPUMEM_OK);
  CHECK_STATUS(be->free(be->ctx, buf, n), GPUMEM_OK);
  DRV_OK(drv.StreamDestroy(s));
}

static void test_errors(gpumem_backend_t* be) {
  const size_t ps = be->page_size;
  size_t fr = 0, tot = 0;
  CHECK_STATUS(be->mem_info(be->ctx, &fr, &tot), GPUMEM_OK);

  /* Mapping where nothing is reserved: a released range's address. */
  uintptr_t r = 0;
  gpumem_phys_t p = 0;
  CHECK_STATUS(be->reserve(be->ctx, 4 * ps, &r), GPUMEM_OK);
  CHECK_STATUS(be->release_range(be->ctx, r, 4 * ps), GPUMEM_OK);
  CHECK_STATUS(be->create_page(be->ctx, ps, &p), GPUMEM_OK);
  gpumem_status_t st = be->map(be->ctx, r, ps, p);
  CHECK_MSG(st == GPUMEM_ERR_BACKEND, "map of an unreserved address -> %s", gpumem_strerror(st));
  const char* msg = gpumem_last_error();
  printf("map of an unreserved address: %s\n", msg);
  CHECK_MSG(strstr(msg, "cuMemMap(") != NULL && strstr(msg, "CUDA_ERROR_") != NULL, "%s", msg);
  CHECK_STATUS(be->release_page(be->ctx, p, ps), GPUMEM_OK);

  /* Unmapping what is reserved but not mapped: the driver (580) accepts
   * it; either answer is fine as long as a failure names the call. */
  CHECK_STATUS(be->reserve(be->ctx, 4 * ps, &r), GPUMEM_OK);
  st = be->unmap(be->ctx, r, ps);
  CHECK_MSG(st == GPUMEM_OK ||
                (st == GPUMEM_ERR_BACKEND && strstr(gpumem_last_error(), "cuMemUnmap(") != NULL),
            "unmap of an unmapped range -> %s (%s)", gpumem_strerror(st), gpumem_last_error());
  CHECK_STATUS(be->release_range(be->ctx, r, 4 * ps), GPUMEM_OK);

  /* A plain free of an address never allocated. */
  st = be->free(be->ctx, (uintptr_t)0x1000, 1);
  CHECK_MSG(st == GPUMEM_ERR_BACKEND && strstr(gpumem_last_error(), "cuMemFree(0x1000"),
            "free of a bad address -> %s (%s)", gpumem_strerror(st), gpumem_last_error());

  /* Out of memory: twice the device's memory in one physical allocation. */
  size_t huge = (2 * tot + ps - 1) / ps * ps;
  st = be->create_page(be->ctx, huge, &p);
  CHECK_MSG(st == GPUMEM_ERR_OUT_OF_MEMORY, "cuMemCreate(%zu) -> %s (%s)", huge,
            gpumem_strerror(st), gpumem_last_error());
  msg = gpumem_last_error();
  printf("huge cuMemCreate: %s\n", msg);
  CHECK_MSG(strstr(msg, "cuMemCreate(") && strstr(msg, "CUDA_ERROR_OUT_OF_MEMORY"), "%s", msg);
  if (st == GPUMEM_OK) be->release_page(be->ctx, p, huge);

  uintptr_t a = 0;
  st = be->alloc(be->ctx, huge, &a);
  CHECK_MSG(st == GPUMEM_ERR_OUT_OF_MEMORY, "cuMemAlloc(%zu) -> %s (%s)", huge, gpumem_strerror(st),
            gpumem_last_error());
  CHECK(strstr(gpumem_last_error(), "CUDA_ERROR_OUT_OF_MEMORY") != NULL);
  if (st == GPUMEM_OK) be->free(be->ctx, a, huge);

  /* The device still works after the failures (none is sticky). */
  CHECK_STATUS(be->alloc(be->ctx, MIB, &a), GPUMEM_OK);
  DRV_OK(drv.MemsetD8((drv_ptr)a, 1, MIB));
  CHECK(check_value(a, MIB, 1) == 0);
  CHECK_STATUS(be->free(be->ctx, a, MIB), GPUMEM_OK);
}

/* Another context current (the application's own): the slot runs in the
 * backend's primary context and gives the thread its context back. */
static void test_context_other_current(gpumem_backend_t* be) {
  if (!drv.CtxCreate) {
    printf("cuCtxCreate_v2 not exported; other-context check skipped\n");
    return;
  }
  drv_ctx mine = NULL;
  drv_result r = drv.CtxCreate(&mine, 0, drv.device); /* also makes it current */
  if (r != DRV_SUCCESS) {
    printf("cuCtxCreate_v2 failed (%s); other-context check skipped\n", drv_name(r));
    return;
  }
  CHECK(drv_current() == mine && mine != drv.primary);
  uintptr_t p = 0;
  gpumem_event_t ev = 0;
  CHECK_STATUS(be->alloc(be->ctx, MIB, &p), GPUMEM_OK);
  CHECK_MSG(drv_current() == mine, "the application's context is current again");
  CHECK_STATUS(be->event_create(be->ctx, &ev), GPUMEM_OK);
  CHECK_STATUS(be->event_record(be->ctx, ev, 0), GPUMEM_OK);
  CHECK_STATUS(be->event_sync(be->ctx, ev), GPUMEM_OK);
  CHECK_STATUS(be->device_sync(be->ctx), GPUMEM_OK);
  CHECK_STATUS(be->event_destroy(be->ctx, ev), GPUMEM_OK);
  CHECK(drv_current() == mine);
  /* The memory belongs to the primary context: use it there. */
  DRV_OK(drv.CtxPushCurrent(drv.primary));
  DRV_OK(drv.MemsetD8((drv_ptr)p, 9, MIB));
  CHECK(check_value(p, MIB, 9) == 0);
  drv_ctx popped = NULL;
  DRV_OK(drv.CtxPopCurrent(&popped));
  CHECK(popped == drv.primary);
  CHECK_STATUS(be->free(be->ctx, p, MIB), GPUMEM_OK);
  CHECK(drv_current() == mine);
  DRV_OK(drv.CtxDestroy(mine));
  DRV_OK(drv.CtxSetCurrent(drv.primary));
}

/* A thread that never touched CUDA: every slot works there. */
static void* thread_body(void* arg) {
  gpumem_backend_t* be = arg;
  long* failures = calloc(1, sizeof *failures);
  if (!failures) return NULL;
  const size_t ps = be->page_size;
  uintptr_t base = 0;
  gpumem_phys_t p = 0;
  gpumem_event_t ev = 0;
  if (drv_current() != NULL) ++*failures;
  if (be->reserve(be->ctx, 2 * ps, &base) != GPUMEM_OK) ++*failures;
  if (be->create_page(be->ctx, ps, &p) != GPUMEM_OK) ++*failures;
  if (be->map(be->ctx, base, ps, p) != GPUMEM_OK) ++*failures;
  if (drv_current() != drv.primary) ++*failures;
  if (drv.MemsetD8((drv_ptr)base, 0x5E, ps) != DRV_SUCCESS) ++*failures;
  if (be->event_create(be->ctx, &ev) != GPUMEM_OK) ++*failures;
  if (be->event_record(be->ctx, ev, 0) != GPUMEM_OK) ++*failures;
  if (be->event_sync(be->ctx, ev) != GPUMEM_OK) ++*failures;
  if (be->event_destroy(be->ctx, ev) != GPUMEM_OK) ++*failures;
  if (be->device_sync(be->ctx) != GPUMEM_OK) ++*failures;
  unsigned char h[64];
  if (drv.MemcpyDtoH(h, (drv_ptr)(base + ps - sizeof h), sizeof h) != DRV_SUCCESS) ++*failures;
  for (size_t i = 0; i < sizeof h; i++) *failures += h[i] != 0x5E;
  if (be->unmap(be->ctx, base, ps) != GPUMEM_OK) ++*failures;
  if (be->release_page(be->ctx, p, ps) != GPUMEM_OK) ++*failures;
  if (be->release_range(be->ctx, base, 2 * ps) != GPUMEM_OK) ++*failures;
  if (*failures)
    fprintf(stderr, "thread: %ld failures, last error: %s\n", *failures, gpumem_last_error());
  return failures;
}

static void test_thread(gpumem_backend_t* be) {
  pthread_t t;
  void* ret = NULL;
  CHECK(pthread_create(&t, NULL, thread_body, be) == 0);
  CHECK(pthread_join(t, &ret) == 0);
  CHECK_MSG(ret && *(long*)ret == 0, "slots on a fresh thread");
  free(ret);
}

/* Every device ordinal gets its own backend; with two or more GPUs, the
 * peers asked for can be granted access. */
static void test_devices(void) {
  int count = 0;
  DRV_OK(drv.DeviceGetCount(&count));
  printf("%d CUDA device%s\n", count, count == 1 ? "" : "s");
  gpumem_cuda_options_t o;
  gpumem_cuda_options_init(&o);
  o.device = count - 1;
  if (count >= 2) o.peer_access_mask = 1; /* device 0 may read device count-1 */
  gpumem_status_t st = GPUMEM_OK;
  gpumem_backend_t* be = gpumem_cuda_create(&o, &st);
  if (!be && st == GPUMEM_ERR_UNSUPPORTED && count >= 2) {
    printf("peer access unsupported here (%s); without peers\n", gpumem_last_error());
    o.peer_access_mask = 0;
    be = gpumem_cuda_create(&o, &st);
  }
  CHECK_STATUS(st, GPUMEM_OK);
  if (!be) return;
  if (be->map) {
    uintptr_t base = 0;
    gpumem_phys_t p = 0;
    CHECK_STATUS(be->reserve(be->ctx, be->page_size, &base), GPUMEM_OK);
    CHECK_STATUS(be->create_page(be->ctx, be->page_size, &p), GPUMEM_OK);
    CHECK_STATUS(be->map(be->ctx, base, be->page_size, p), GPUMEM_OK);
    if (o.peer_access_mask & 1) {
      /* Device 0 (its primary context is current here) writes the page of
       * device count-1 through the access granted to it, and the bytes
       * read back are what it wrote. */
      DRV_OK(drv.MemsetD8((drv_ptr)base, 0x5a, be->page_size));
      DRV_OK(drv.CtxSynchronize());
      unsigned char* back = malloc(be->page_size);
      CHECK(back != NULL);
      if (back) {
        DRV_OK(drv.MemcpyDtoH(back, (drv_ptr)base, be->page_size));
        size_t bad = 0;
        for (size_t i = 0; i < be->page_size; i++) bad += back[i] != 0x5a;
        CHECK_MSG(bad == 0, "peer write from device 0 to device %d: %zu bytes differ", count - 1,
                  bad);
        printf("device 0 wrote %zu bytes on device %d through peer access\n", be->page_size,
               count - 1);
        free(back);
      }
    }
    CHECK_STATUS(be->unmap(be->ctx, base, be->page_size), GPUMEM_OK);
    CHECK_STATUS(be->release_page(be->ctx, p, be->page_size), GPUMEM_OK);
    CHECK_STATUS(be->release_range(be->ctx, base, be->page_size), GPUMEM_OK);
  }
  gpumem_cuda_destroy(be);
  /* The main thread is back on device 0's context. */
  CHECK(drv_current() == drv.primary);
}

int main(void) {
  const char* name = "gpu_test_cuda_backend";
  int exit_code = 0;
  gpumem_backend_t* be = gpu_test_backend(name, &exit_code);
  if (!be) return exit_code;

  test_options();
  test_context_none_current(be);
  if (!be->map) {
    printf("device has no virtual memory management: backend \"%s\"\n", be->name);
    CHECK(strcmp(be->name, "cuda-plain") == 0 && be->page_size == 0);
  } else {
    test_granularity(be);
    test_vmm_lifecycle(be);
    time_primitives(be);
    if (drv_no_provoked_errors())
      printf(
          "skipped test_errors: it makes the driver fail on purpose "
          "(GPUMEM_TEST_NO_DRIVER_ERRORS)\n");
    else
      test_errors(be);
    test_thread(be);
  }
  test_plain(be);
  test_events(be);
  test_context_other_current(be);
  test_devices();

  gpumem_cuda_destroy(be);
  drv_close();
  return test_finish(name);
}
