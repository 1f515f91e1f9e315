/* A minimal CUDA driver binding for the GPU tests' own work (memsets,
 * copies, streams, contexts), shared by tests/gpu/test_*.c.
 *
 * The driver is opened with dlopen, as the backend does: the tests link
 * with neither the CUDA runtime nor cuda.h, so the few types they need are
 * declared here with their ABI (CUresult and CUdevice are ints, handles are
 * pointers, CUdeviceptr is a 64-bit integer). Functions are static inline
 * so that a test using only part of the binding compiles without
 * unused-function warnings. */
#ifndef GPUMEM_TEST_CUDA_DRIVER_H
#define GPUMEM_TEST_CUDA_DRIVER_H

#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"

typedef int drv_result;
typedef unsigned long long drv_ptr;
typedef void* drv_stream;
typedef void* drv_ctx;
enum { DRV_SUCCESS = 0, DRV_NOT_READY = 600, DRV_STREAM_NON_BLOCKING = 1 };

static struct {
  void* lib;
  drv_ctx primary; /* the device's primary context, retained */
  int device;
  drv_result (*Init)(unsigned);
  drv_result (*DeviceGet)(int*, int);
  drv_result (*DeviceGetCount)(int*);
  drv_result (*PrimaryCtxRetain)(drv_ctx*, int);
  drv_result (*PrimaryCtxRelease)(int);
  drv_result (*CtxGetCurrent)(drv_ctx*);
  drv_result (*CtxSetCurrent)(drv_ctx);
  drv_result (*CtxPushCurrent)(drv_ctx);
  drv_result (*CtxPopCurrent)(drv_ctx*);
  drv_result (*CtxCreate)(drv_ctx*, unsigned, int); /* optional: cuCtxCreate_v2 */
  drv_result (*CtxDestroy)(drv_ctx);
  drv_result (*CtxSynchronize)(void);
  drv_result (*MemsetD8)(drv_ptr, unsigned char, size_t);
  drv_result (*MemsetD8Async)(drv_ptr, unsigned char, size_t, drv_stream);
  drv_result (*MemcpyHtoD)(drv_ptr, const void*, size_t);
  drv_result (*MemcpyDtoH)(void*, drv_ptr, size_t);
  drv_result (*StreamCreate)(drv_stream*, unsigned);
  drv_result (*StreamDestroy)(drv_stream);
  drv_result (*StreamSynchronize)(drv_stream);
  drv_result (*StreamQuery)(drv_stream);
  drv_result (*MemGetInfo)(size_t*, size_t*);
  drv_result (*GetErrorName)(drv_result, const char**);
} drv;

static inline const char* drv_name(drv_result r) {
  const char* s = NULL;
  if (!drv.GetErrorName || drv.GetErrorName(r, &s) != DRV_SUCCESS || !s) return "?";
  return s;
}

#define DRV_OK(expr)                                                      \
  do {                                                                    \
    drv_result r_ = (expr);                                               \
    CHECK_MSG(r_ == DRV_SUCCESS, "%s -> %d %s", #expr, r_, drv_name(r_)); \
  } while (0)

static inline int drv_sym(void* fnptr, const char* name, int required) {
  void* p = dlsym(drv.lib, name);
  if (!p && required) fprintf(stderr, "libcuda.so.1 lacks %s\n", name);
  memcpy(fnptr, &p, sizeof p);
  return p != NULL || !required;
}

/* Opens the driver and retains the device's primary context. With
 * make_current, also makes it current, as an application using the runtime
 * (PyTorch) would have; without, leaves the thread's current context alone
 * (for tests of what the backend does with it). */
static inline int drv_open(int device, int make_current) {
  drv.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!drv.lib) return 0;
  int ok = 1;
  ok &= drv_sym(&drv.Init, "cuInit", 1);
  ok &= drv_sym(&drv.DeviceGet, "cuDeviceGet", 1);
  ok &= drv_sym(&drv.DeviceGetCount, "cuDeviceGetCount", 1);
  ok &= drv_sym(&drv.PrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 1);
  ok &= drv_sym(&drv.PrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", 1);
  ok &= drv_sym(&drv.CtxGetCurrent, "cuCtxGetCurrent", 1);
  ok &= drv_sym(&drv.CtxSetCurrent, "cuCtxSetCurrent", 1);
  ok &= drv_sym(&drv.CtxPushCurrent, "cuCtxPushCurrent_v2", 1);
  ok &= drv_sym(&drv.CtxPopCurrent, "cuCtxPopCurrent_v2", 1);
  ok &= drv_sym(&drv.CtxCreate, "cuCtxCreate_v2", 0);
  ok &= drv_sym(&drv.CtxDestroy, "cuCtxDestroy_v2", 1);
  ok &= drv_sym(&drv.CtxSynchronize, "cuCtxSynchronize", 1);
  ok &= drv_sym(&drv.MemsetD8, "cuMemsetD8_v2", 1);
  ok &= drv_sym(&drv.MemsetD8Async, "cuMemsetD8Async", 1);
  ok &= drv_sym(&drv.MemcpyHtoD, "cuMemcpyHtoD_v2", 1);
  ok &= drv_sym(&drv.MemcpyDtoH, "cuMemcpyDtoH_v2", 1);
  ok &= drv_sym(&drv.StreamCreate, "cuStreamCreate", 1);
  ok &= drv_sym(&drv.StreamDestroy, "cuStreamDestroy_v2", 1);
  ok &= drv_sym(&drv.StreamSynchronize, "cuStreamSynchronize", 1);
  ok &= drv_sym(&drv.StreamQuery, "cuStreamQuery", 1);
  ok &= drv_sym(&drv.MemGetInfo, "cuMemGetInfo_v2", 1);
  ok &= drv_sym(&drv.GetErrorName, "cuGetErrorName", 1);
  if (!ok) return 0;
  int dev = 0;
  if (drv.Init(0) != DRV_SUCCESS || drv.DeviceGet(&dev, device) != DRV_SUCCESS) return 0;
  drv.device = dev;
  if (drv.PrimaryCtxRetain(&drv.primary, dev) != DRV_SUCCESS) return 0;
  return !make_current || drv.CtxSetCurrent(drv.primary) == DRV_SUCCESS;
}

static inline void drv_close(void) {
  if (drv.primary) drv.PrimaryCtxRelease(drv.device);
  if (drv.lib) dlclose(drv.lib);
  memset(&drv, 0, sizeof drv);
}

/* The calling thread's current context (NULL: none). */
static inline drv_ctx drv_current(void) {
  drv_ctx c = NULL;
  drv.CtxGetCurrent(&c);
  return c;
}

/* GPUMEM_TEST_NO_DRIVER_ERRORS=1: the tests leave out the checks that make
 * the driver refuse on purpose (out of memory at the device's limit, a map
 * at an unreserved address, a bad free). compute-sanitizer reports every
 * failed driver function as an error; without those checks its count is of
 * real errors only. */
static inline bool drv_no_provoked_errors(void) {
  const char* v = getenv("GPUMEM_TEST_NO_DRIVER_ERRORS");
  return v && *v && strcmp(v, "0") != 0;
}

/* Position-dependent bytes: a page mapped at the wrong place shows. */
static inline unsigned char pattern_byte(size_t i, unsigned seed) {
  return (unsigned char)((i >> 12) * 31u + i * 7u + seed * 101u);
}

/* Device work on stream s that keeps buf busy for a while, so that an event
 * recorded after it is very likely still pending when the host asks: reps
 * memsets of len bytes (256 MiB x 100 is about 10 ms on an H100), the i-th
 * writing i (the last value written is reps & 0xff). */
static inline void queue_busy_work(uintptr_t buf, size_t len, drv_stream s, int reps) {
  for (int i = 1; i <= reps; i++) DRV_OK(drv.MemsetD8Async((drv_ptr)buf, (unsigned char)i, len, s));
}

/* A GPU test's start: the CUDA backend with default options, and this
 * test's own binding of the driver open. NULL where the test ends there,
 * with *exit_code set: TEST_SKIP where there is no CUDA device, else
 * test_finish's (the failure CHECKed). */
static inline gpumem_backend_t* gpu_test_backend(const char* name, int* exit_code) {
  gpumem_cuda_options_t o;
  gpumem_cuda_options_init(&o);
  gpumem_status_t st = GPUMEM_OK;
  gpumem_backend_t* be = gpumem_cuda_create(&o, &st);
  if (!be && st == GPUMEM_ERR_UNSUPPORTED) {
    printf("SKIP: %s\n", gpumem_last_error());
    *exit_code = TEST_SKIP;
    return NULL;
  }
  CHECK_MSG(be != NULL, "gpumem_cuda_create: %s (%s)", gpumem_strerror(st), gpumem_last_error());
  if (be && !drv_open(0, 0)) {
    CHECK_MSG(0, "the backend loaded the driver, but the test's own binding failed");
    gpumem_cuda_destroy(be);
    be = NULL;
  }
  if (!be) *exit_code = test_finish(name);
  return be;
}

#endif
