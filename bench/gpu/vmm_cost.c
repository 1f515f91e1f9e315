/* What each CUDA virtual-memory call costs on this GPU, and which shapes of
 * call the driver accepts: the facts the CUDA backend's growth path is
 * designed on. Prints one line per measurement.
 *
 *   cc -O2 -std=c11 -I$CUDA/include bench/gpu/vmm_cost.c -o vmm_cost -lcuda
 *   ./vmm_cost [pages]
 *
 * Needs a GPU; the CUDA backend's tests cover correctness, this only times. */
#define _POSIX_C_SOURCE 200809L
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define MIB ((size_t)1024 * 1024)

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static void check(CUresult r, const char *what) {
  if (r == CUDA_SUCCESS) return;
  const char *name = "?";
  cuGetErrorName(r, &name);
  fprintf(stderr, "%s: %s\n", what, name);
  exit(1);
}

static const char *result_name(CUresult r) {
  const char *name = "?";
  cuGetErrorName(r, &name);
  return name;
}

static CUmemAllocationProp prop;
static CUmemAccessDesc access_desc;

static CUmemGenericAllocationHandle create(size_t size) {
  CUmemGenericAllocationHandle h;
  check(cuMemCreate(&h, size, &prop, 0), "cuMemCreate");
  return h;
}

int main(int argc, char **argv) {
  int pages = argc > 1 ? atoi(argv[1]) : 512;
  CUdevice dev;
  CUcontext ctx;
  check(cuInit(0), "cuInit");
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuDevicePrimaryCtxRetain(&ctx, dev), "retain");
  check(cuCtxSetCurrent(ctx), "current");
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  access_desc.location = prop.location;
  access_desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t gran = 0;
  check(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "gran");
  size_t page = gran;
  printf("granularity %zu KiB, %d pages per run\n", gran / 1024, pages);

  size_t span = (size_t)pages * page * 4;
  CUdeviceptr va;
  check(cuMemAddressReserve(&va, span, 0, 0, 0), "reserve");
  CUmemGenericAllocationHandle *h = calloc((size_t)pages, sizeof *h);

  /* 1. one page at a time: create, map, set access (the backend today). */
  double t0 = now_us();
  for (int i = 0; i < pages; i++) h[i] = create(page);
  double t1 = now_us();
  for (int i = 0; i < pages; i++) check(cuMemMap(va + (size_t)i * page, page, 0, h[i], 0), "map");
  double t2 = now_us();
  for (int i = 0; i < pages; i++)
    check(cuMemSetAccess(va + (size_t)i * page, page, &access_desc, 1), "access");
  double t3 = now_us();
  printf("per page: cuMemCreate %.2f us, cuMemMap %.2f us, cuMemSetAccess %.2f us\n",
         (t1 - t0) / pages, (t2 - t1) / pages, (t3 - t2) / pages);

  /* 2. unmap: one call over a range covering several separate mappings? */
  CUresult r = cuMemUnmap(va, 2 * page);
  printf("cuMemUnmap over 2 separate page mappings in one call: %s\n", result_name(r));
  int first_left = r == CUDA_SUCCESS ? 2 : 0;
  t0 = now_us();
  for (int i = first_left; i < pages; i++) check(cuMemUnmap(va + (size_t)i * page, page), "unmap");
  t1 = now_us();
  printf("per page: cuMemUnmap %.2f us\n", (t1 - t0) / (pages - first_left));

  /* 3. map every page again, then one cuMemSetAccess for the whole run. */
  t0 = now_us();
  for (int i = 0; i < pages; i++) check(cuMemMap(va + (size_t)i * page, page, 0, h[i], 0), "map");
  t1 = now_us();
  check(cuMemSetAccess(va, (size_t)pages * page, &access_desc, 1), "access run");
  t2 = now_us();
  printf(
      "remap per page %.2f us; one cuMemSetAccess over %d mappings: %.2f us (%.3f us per page)\n",
      (t1 - t0) / pages, pages, t2 - t1, (t2 - t1) / pages);
  for (int i = 0; i < pages; i++) check(cuMemUnmap(va + (size_t)i * page, page), "unmap");
  t0 = now_us();
  for (int i = 0; i < pages; i++) check(cuMemRelease(h[i]), "release");
  t1 = now_us();
  printf("per page: cuMemRelease %.2f us\n", (t1 - t0) / pages);

  /* 4. big physical handles: create cost, and mapping pieces of them. */
  size_t sizes[] = {16 * page, 64 * page, (size_t)pages * page};
  for (int s = 0; s < 3; s++) {
    t0 = now_us();
    CUmemGenericAllocationHandle big = create(sizes[s]);
    t1 = now_us();
    check(cuMemMap(va, sizes[s], 0, big, 0), "map big");
    t2 = now_us();
    check(cuMemSetAccess(va, sizes[s], &access_desc, 1), "access big");
    t3 = now_us();
    r = cuMemUnmap(va, page);
    printf(
        "handle of %zu MiB: create %.1f us, map %.1f us, access %.1f us; unmap of its first page "
        "alone: %s\n",
        sizes[s] / MIB, t1 - t0, t2 - t1, t3 - t2, result_name(r));
    if (r != CUDA_SUCCESS)
      check(cuMemUnmap(va, sizes[s]), "unmap big");
    else
      check(cuMemUnmap(va + page, sizes[s] - page), "unmap rest");
    /* pieces: map each page of the handle at its own address, offset != 0 */
    r = cuMemMap(va, page, page, big, 0);
    printf("  cuMemMap of one page at offset %zu KiB into it: %s\n", page / 1024, result_name(r));
    if (r == CUDA_SUCCESS) {
      check(cuMemUnmap(va, page), "unmap piece");
      int n = (int)(sizes[s] / page);
      t0 = now_us();
      for (int i = 0; i < n; i++)
        check(cuMemMap(va + (size_t)i * page, page, (size_t)i * page, big, 0), "map piece");
      t1 = now_us();
      check(cuMemSetAccess(va, sizes[s], &access_desc, 1), "access pieces");
      t2 = now_us();
      for (int i = 0; i < n; i++) check(cuMemUnmap(va + (size_t)i * page, page), "unmap piece");
      t3 = now_us();
      printf("  pieces: map %.2f us per page, one access %.1f us, unmap %.2f us per page\n",
             (t1 - t0) / n, t2 - t1, (t3 - t2) / n);
    }
    t0 = now_us();
    check(cuMemRelease(big), "release big");
    printf("  release %.1f us\n", now_us() - t0);
  }

  /* 5. the plain path for comparison */
  size_t plain[] = {2 * MIB, 20 * MIB, (size_t)pages * page};
  for (int s = 0; s < 3; s++) {
    CUdeviceptr p;
    t0 = now_us();
    check(cuMemAlloc(&p, plain[s]), "cuMemAlloc");
    t1 = now_us();
    check(cuMemFree(p), "cuMemFree");
    t2 = now_us();
    printf("cuMemAlloc %zu MiB: %.1f us, cuMemFree %.1f us\n", plain[s] / MIB, t1 - t0, t2 - t1);
  }
  check(cuMemAddressFree(va, span), "address free");
  free(h);
  return 0;
}
