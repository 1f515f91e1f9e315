/* The CUDA backend: gpumem's device primitives over the CUDA driver API.
 *
 * It owns the run-time binding to the driver (libcuda.so.1 is opened with
 * dlopen, so the library builds, loads and runs where no driver or GPU
 * exists), the device's primary context (retained here, made current on
 * threads that have none), the translation of CUresult into
 * gpumem_status_t plus a message naming the driver's own error, and the
 * choice between the virtual memory slots (cuMemAddressReserve, cuMemCreate,
 * cuMemMap) and plain cuMemAlloc. One backend serves one device ordinal.
 *
 * cuda.h is included for types and constants only: nothing here links
 * against a driver symbol. Every field below is immutable after create, so
 * the slots are thread-safe as far as the driver is. */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void gpumem_cuda_options_init(gpumem_cuda_options_t* opts) {
  if (!opts) return;
  memset(opts, 0, sizeof *opts);
  opts->struct_size = (uint32_t)sizeof *opts;
  opts->device = 0;
  opts->virtual_memory = 1;
  opts->peer_access_mask = 0;
}

#if !defined(GPUMEM_HAVE_CUDA)

/* Built without cuda.h: the backend exists as a name only, so callers can
 * link against it everywhere and learn at run time why it is missing. */
gpumem_backend_t* gpumem_cuda_create(const gpumem_cuda_options_t* opts, gpumem_status_t* err) {
  (void)opts;
  if (err) *err = GPUMEM_ERR_UNSUPPORTED;
  gpumem_set_last_error(
      "CUDA backend unavailable: gpumem was built without CUDA headers (cuda.h not found at "
      "configure time; rebuild with the CUDA toolkit's include directory visible)");
  return NULL;
}

void gpumem_cuda_destroy(gpumem_backend_t* cuda) {
  (void)cuda;
}

#else /* GPUMEM_HAVE_CUDA */

#include <cuda.h>
#include <dlfcn.h>

/* Driver entry points, looked up by the exact names cuda.h maps each API to
 * (cuMemAlloc is cuMemAlloc_v2, cuEventDestroy is cuEventDestroy_v2, ...):
 * GM_CU_NAME expands the macro first, so the string always matches the
 * ABI of the prototype the compiler saw, and __typeof__ gives the pointer
 * that exact type. The legacy default-stream names are used on purpose
 * (this file never defines CUDA_API_PER_THREAD_DEFAULT_STREAM): stream 0
 * means what it means to PyTorch and the runtime's default. The second
 * column is 1 where the backend cannot work without the entry. */
#define GM_CU_CORE(X)          \
  X(cuGetErrorName)            \
  X(cuGetErrorString)          \
  X(cuInit)                    \
  X(cuDriverGetVersion)        \
  X(cuDeviceGetCount)          \
  X(cuDeviceGet)               \
  X(cuDeviceGetName)           \
  X(cuDeviceGetAttribute)      \
  X(cuDeviceCanAccessPeer)     \
  X(cuDevicePrimaryCtxRetain)  \
  X(cuDevicePrimaryCtxRelease) \
  X(cuCtxGetCurrent)           \
  X(cuCtxSetCurrent)           \
  X(cuCtxPushCurrent)          \
  X(cuCtxPopCurrent)           \
  X(cuCtxSynchronize)          \
  X(cuMemAlloc)                \
  X(cuMemFree)                 \
  X(cuMemGetInfo)              \
  X(cuEventCreate)             \
  X(cuEventDestroy)            \
  X(cuEventRecord)             \
  X(cuEventQuery)              \
  X(cuEventSynchronize)        \
  X(cuStreamSynchronize)       \
  X(cuStreamWaitEvent)

/* Virtual memory management: CUDA 10.2 and later drivers. Missing entries
 * only turn the virtual memory path off. */
#define GM_CU_VMM(X)               \
  X(cuMemGetAllocationGranularity) \
  X(cuMemAddressReserve)           \
  X(cuMemAddressFree)              \
  X(cuMemCreate)                   \
  X(cuMemRelease)                  \
  X(cuMemMap)                      \
  X(cuMemUnmap)                    \
  X(cuMemSetAccess)

#define GM_CU_STR2(x) #x
#define GM_CU_NAME(fn) GM_CU_STR2(fn)

typedef struct gm_cu_api {
#define GM_CU_FIELD(fn) __typeof__(&fn) fn;
  GM_CU_CORE(GM_CU_FIELD)
  GM_CU_VMM(GM_CU_FIELD)
#undef GM_CU_FIELD
} gm_cu_api_t;

/* Peers are device ordinals below 64 (the width of peer_access_mask). */
#define GM_CU_MAX_ACCESS 64

typedef struct gm_cu_backend {
  gpumem_backend_t base; /* first: the public handle is this struct */
  gm_cu_api_t api;
  void* lib; /* dlopen handle of libcuda.so.1 */
  /* cuStreamGetCaptureInfo's first form (stream, status, id), which every
   * driver since CUDA 10.1 exports under this name; looked up by name
   * rather than through cuda.h, whose macro points at later forms with
   * more arguments. NULL: the slot stays empty. */
  CUresult (*stream_get_capture_info)(CUstream, CUstreamCaptureStatus*, cuuint64_t*);
  /* Sharing pages with other processes (export_page, import_page): NULL
   * where the driver lacks them or the device cannot make pages that
   * export as POSIX file descriptors. */
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long);
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
  /* The overflow tier (create_host_page, copy): cuMemcpyDtoDAsync, and the
   * host NUMA node nearest the device (-1: none known, HOST_NUMA is not
   * tried). */
  CUresult (*copy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  int host_numa_id;
  int ordinal;
  CUdevice device;
  CUcontext ctx; /* the device's primary context, retained by create */
  char device_name[128];
  /* cuMemCreate's properties and cuMemSetAccess's list: the device itself
   * first, then each peer asked for. */
  CUmemAllocationProp prop;
  CUmemAccessDesc access[GM_CU_MAX_ACCESS];
  size_t access_count;
} gm_cu_backend_t;

/* ---- errors ------------------------------------------------------------ */

/* Writes "NAME (string)" for a driver error into buf. */
static const char* cu_describe(const gm_cu_backend_t* b, CUresult r, char* buf, size_t len) {
  const char* name = NULL;
  const char* text = NULL;
  if (b->api.cuGetErrorName(r, &name) != CUDA_SUCCESS || !name) name = "CUDA_ERROR_UNKNOWN_CODE";
  if (b->api.cuGetErrorString(r, &text) != CUDA_SUCCESS || !text) text = "no description";
  snprintf(buf, len, "%s (%s) [code %d]", name, text, (int)r);
  return buf;
}

/* Sets "<call> failed: NAME (string) on device N (model)" and returns the
 * status the allocator should see: out of memory is the one error its
 * retry ladder can do something about. */
static gpumem_status_t GM_PRINTF(3, 4)
    cu_fail(const gm_cu_backend_t* b, CUresult r, const char* call_fmt, ...) {
  char call[256];
  va_list ap;
  va_start(ap, call_fmt);
  vsnprintf(call, sizeof call, call_fmt, ap);
  va_end(ap);
  char why[256];
  gpumem_set_last_error("%s failed: %s on device %d (%s)", call, cu_describe(b, r, why, sizeof why),
                        b->ordinal, b->device_name);
  return r == CUDA_ERROR_OUT_OF_MEMORY ? GPUMEM_ERR_OUT_OF_MEMORY : GPUMEM_ERR_BACKEND;
}

/* ---- context ----------------------------------------------------------- */

/* Makes the device's primary context current for one slot. A thread with
 * no context gets ours and keeps it (what the runtime does lazily; the
 * next slot then costs one cuCtxGetCurrent). A thread holding another
 * context (another device, or the application's own) gets ours pushed and
 * popped again by cu_leave, so its state is never clobbered and plain
 * allocations, events and stream 0 always land on this backend's device.
 * Returns 1 when cu_leave must pop. */
static int cu_enter(const gm_cu_backend_t* b) {
  CUcontext cur = NULL;
  if (GM_LIKELY(b->api.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == b->ctx)) return 0;
  if (cur == NULL) {
    b->api.cuCtxSetCurrent(b->ctx);
    return 0;
  }
  return b->api.cuCtxPushCurrent(b->ctx) == CUDA_SUCCESS;
}

static void cu_leave(const gm_cu_backend_t* b, int pushed) {
  if (GM_UNLIKELY(pushed)) {
    CUcontext popped = NULL;
    b->api.cuCtxPopCurrent(&popped);
  }
}

/* ---- virtual memory slots ---------------------------------------------- */

static gpumem_status_t cu_reserve(void* ctx, size_t size, uintptr_t* out_addr) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUdeviceptr addr = 0;
  /* Page alignment is all the mapping needs; the driver picks the place. */
  CUresult r = b->api.cuMemAddressReserve(&addr, size, b->base.page_size, 0, 0);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS) return cu_fail(b, r, "cuMemAddressReserve(%zu bytes)", size);
  *out_addr = (uintptr_t)addr;
  return GPUMEM_OK;
}

static gpumem_status_t cu_release_range(void* ctx, uintptr_t addr, size_t size) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUresult r = b->api.cuMemAddressFree((CUdeviceptr)addr, size);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuMemAddressFree(0x%llx, %zu bytes)", (unsigned long long)addr, size);
  return GPUMEM_OK;
}

static gpumem_status_t cu_create_page(void* ctx, size_t size, gpumem_phys_t* out) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = b->api.cuMemCreate(&h, size, &b->prop, 0);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY &&
      b->prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) {
    /* A device that says it exports file descriptors but refuses such a
     * page still gets one that cannot be shared (gpumem_ipc_export then
     * fails, saying why). */
    CUmemAllocationProp plain = b->prop;
    plain.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    r = b->api.cuMemCreate(&h, size, &plain, 0);
  }
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS) return cu_fail(b, r, "cuMemCreate(%zu bytes)", size);
  *out = (gpumem_phys_t)h;
  return GPUMEM_OK;
}

/* Host pages for the overflow tier (CUDA 12.2 and later drivers): pinned
 * host memory on the NUMA node nearest the device first, mapped into
 * device ranges like device pages; where the driver refuses that form
 * (older drivers, some virtual machines), CU_MEM_LOCATION_TYPE_HOST. The
 * message names both refusals, so that a user learns why the tier cannot
 * serve on this machine. */
#if CUDA_VERSION >= 12020
/* Host memory may come in larger units than the device's pages: a size
 * that is not a multiple of its granularity is refused here, by name
 * (CUDA_ERROR_INVALID_VALUE), rather than by cuMemCreate's bare error. */
static CUresult host_granularity_fits(const gm_cu_backend_t* b, const CUmemAllocationProp* prop,
                                      size_t size) {
  size_t gran = 0;
  CUresult r = b->api.cuMemGetAllocationGranularity(&gran, prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) return r;
  return gran && size % gran == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
#endif

static gpumem_status_t cu_create_host_page(void* ctx, size_t size, gpumem_phys_t* out) {
  const gm_cu_backend_t* b = ctx;
#if CUDA_VERSION >= 12020
  int pushed = cu_enter(b);
  CUmemGenericAllocationHandle h = 0;
  CUmemAllocationProp prop = b->prop;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  CUresult numa = CUDA_ERROR_NOT_SUPPORTED, r;
  if (b->host_numa_id >= 0) {
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    prop.location.id = b->host_numa_id;
    numa = host_granularity_fits(b, &prop, size);
    if (numa == CUDA_SUCCESS) numa = b->api.cuMemCreate(&h, size, &prop, 0);
  }
  r = numa;
  if (numa != CUDA_SUCCESS && numa != CUDA_ERROR_OUT_OF_MEMORY) {
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    prop.location.id = 0;
    r = host_granularity_fits(b, &prop, size);
    if (r == CUDA_SUCCESS) r = b->api.cuMemCreate(&h, size, &prop, 0);
  }
  cu_leave(b, pushed);
  if (r == CUDA_SUCCESS) {
    *out = (gpumem_phys_t)h;
    return GPUMEM_OK;
  }
  char first[256];
  if (b->host_numa_id >= 0)
    cu_describe(b, numa, first, sizeof first);
  else
    snprintf(first, sizeof first, "not tried: the device names no host NUMA node");
  gpumem_status_t st = cu_fail(b, r,
                               "cuMemCreate(%zu bytes of host memory: HOST_NUMA node %d refused "
                               "with %s; then HOST)",
                               size, b->host_numa_id, first);
  return r == CUDA_ERROR_OUT_OF_MEMORY ? st : GPUMEM_ERR_UNSUPPORTED;
#else
  (void)size;
  (void)out;
  return cu_fail(b, CUDA_ERROR_NOT_SUPPORTED,
                 "cuMemCreate of host memory (gpumem was built against cuda.h %d; host locations "
                 "need 12.2)",
                 CUDA_VERSION);
#endif
}

static gpumem_status_t cu_copy(void* ctx, uintptr_t dst, uintptr_t src, size_t size,
                               gpumem_stream_t stream) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUresult r = b->copy_async((CUdeviceptr)dst, (CUdeviceptr)src, size, (CUstream)stream);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuMemcpyDtoDAsync(0x%llx <- 0x%llx, %zu bytes)", (unsigned long long)dst,
                   (unsigned long long)src, size);
  return GPUMEM_OK;
}

static gpumem_status_t cu_export_page(void* ctx, gpumem_phys_t page, int* out_fd) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  int fd = -1;
  CUresult r = b->export_handle(&fd, (CUmemGenericAllocationHandle)page,
                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS) return cu_fail(b, r, "cuMemExportToShareableHandle");
  *out_fd = fd;
  return GPUMEM_OK;
}

static gpumem_status_t cu_import_page(void* ctx, int fd, gpumem_phys_t* out) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = b->import_handle(&h, (void*)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS) return cu_fail(b, r, "cuMemImportFromShareableHandle(fd %d)", fd);
  *out = (gpumem_phys_t)h;
  return GPUMEM_OK;
}

static gpumem_status_t cu_release_page(void* ctx, gpumem_phys_t page, size_t size) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUresult r = b->api.cuMemRelease((CUmemGenericAllocationHandle)page);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuMemRelease(handle 0x%llx, %zu bytes)", (unsigned long long)page, size);
  return GPUMEM_OK;
}

static gpumem_status_t cu_map(void* ctx, uintptr_t addr, size_t size, gpumem_phys_t page) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  gpumem_status_t st = GPUMEM_OK;
  CUresult r = b->api.cuMemMap((CUdeviceptr)addr, size, 0, (CUmemGenericAllocationHandle)page, 0);
  if (r != CUDA_SUCCESS) {
    st = cu_fail(b, r, "cuMemMap(0x%llx, %zu bytes, handle 0x%llx)", (unsigned long long)addr, size,
                 (unsigned long long)page);
    goto done;
  }
  /* A fresh mapping is inaccessible until access is granted; doing it per
   * mapping keeps map/unmap symmetric and the range always consistent. */
  r = b->api.cuMemSetAccess((CUdeviceptr)addr, size, b->access, b->access_count);
  if (r != CUDA_SUCCESS) {
    st = cu_fail(b, r, "cuMemSetAccess(0x%llx, %zu bytes, %zu locations)", (unsigned long long)addr,
                 size, b->access_count);
    /* Leave the range as the caller believes it is: unmapped. */
    b->api.cuMemUnmap((CUdeviceptr)addr, size);
  }
done:
  cu_leave(b, pushed);
  return st;
}

static gpumem_status_t cu_unmap(void* ctx, uintptr_t addr, size_t size) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  /* One call may cover several whole mappings: the driver unmaps each. */
  CUresult r = b->api.cuMemUnmap((CUdeviceptr)addr, size);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuMemUnmap(0x%llx, %zu bytes)", (unsigned long long)addr, size);
  return GPUMEM_OK;
}

/* ---- plain memory ------------------------------------------------------ */

static gpumem_status_t cu_alloc(void* ctx, size_t size, uintptr_t* out_addr) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUdeviceptr addr = 0;
  CUresult r = b->api.cuMemAlloc(&addr, size);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS) return cu_fail(b, r, "cuMemAlloc(%zu bytes)", size);
  *out_addr = (uintptr_t)addr;
  return GPUMEM_OK;
}

static gpumem_status_t cu_free(void* ctx, uintptr_t addr, size_t size) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUresult r = b->api.cuMemFree((CUdeviceptr)addr);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuMemFree(0x%llx, %zu bytes)", (unsigned long long)addr, size);
  return GPUMEM_OK;
}

static gpumem_status_t cu_mem_info(void* ctx, size_t* free_bytes, size_t* total_bytes) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b); /* cuMemGetInfo reports the current context's device */
  size_t fr = 0, tot = 0;
  CUresult r = b->api.cuMemGetInfo(&fr, &tot);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS) return cu_fail(b, r, "cuMemGetInfo()");
  if (free_bytes) *free_bytes = fr;
  if (total_bytes) *total_bytes = tot;
  return GPUMEM_OK;
}

/* ---- streams and events ------------------------------------------------ */

static gpumem_status_t cu_event_create(void* ctx, gpumem_event_t* out) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUevent ev = NULL;
  /* Ordering only: timing would make every record and query dearer. */
  CUresult r = b->api.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS) return cu_fail(b, r, "cuEventCreate(CU_EVENT_DISABLE_TIMING)");
  *out = (gpumem_event_t)ev;
  return GPUMEM_OK;
}

static gpumem_status_t cu_event_destroy(void* ctx, gpumem_event_t event) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUresult r = b->api.cuEventDestroy((CUevent)event);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuEventDestroy(event 0x%llx)", (unsigned long long)event);
  return GPUMEM_OK;
}

static gpumem_status_t cu_event_record(void* ctx, gpumem_event_t event, gpumem_stream_t stream) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b); /* stream 0 is the current context's default stream */
  CUresult r = b->api.cuEventRecord((CUevent)event, (CUstream)stream);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuEventRecord(event 0x%llx, stream 0x%llx)", (unsigned long long)event,
                   (unsigned long long)stream);
  return GPUMEM_OK;
}

static gpumem_status_t cu_event_query(void* ctx, gpumem_event_t event) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUresult r = b->api.cuEventQuery((CUevent)event);
  cu_leave(b, pushed);
  if (r == CUDA_SUCCESS) return GPUMEM_OK;
  if (r == CUDA_ERROR_NOT_READY) return GPUMEM_NOT_READY;
  return cu_fail(b, r, "cuEventQuery(event 0x%llx)", (unsigned long long)event);
}

static gpumem_status_t cu_event_sync(void* ctx, gpumem_event_t event) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUresult r = b->api.cuEventSynchronize((CUevent)event);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuEventSynchronize(event 0x%llx)", (unsigned long long)event);
  return GPUMEM_OK;
}

static gpumem_status_t cu_stream_sync(void* ctx, gpumem_stream_t stream) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUresult r = b->api.cuStreamSynchronize((CUstream)stream);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuStreamSynchronize(stream 0x%llx)", (unsigned long long)stream);
  return GPUMEM_OK;
}

static gpumem_status_t cu_device_sync(void* ctx) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b); /* cuCtxSynchronize waits for the current context */
  CUresult r = b->api.cuCtxSynchronize();
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS) return cu_fail(b, r, "cuCtxSynchronize()");
  return GPUMEM_OK;
}

static gpumem_status_t cu_stream_wait(void* ctx, gpumem_stream_t stream, gpumem_event_t event) {
  const gm_cu_backend_t* b = ctx;
  int pushed = cu_enter(b);
  CUresult r = b->api.cuStreamWaitEvent((CUstream)stream, (CUevent)event, 0);
  cu_leave(b, pushed);
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuStreamWaitEvent(stream 0x%llx, event 0x%llx)",
                   (unsigned long long)stream, (unsigned long long)event);
  return GPUMEM_OK;
}

static gpumem_status_t cu_stream_capture_info(void* ctx, gpumem_stream_t stream, int* capturing,
                                              uint64_t* capture_id) {
  const gm_cu_backend_t* b = ctx;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  cuuint64_t id = 0;
  int pushed = cu_enter(b);
  CUresult r = b->stream_get_capture_info((CUstream)stream, &status, &id);
  cu_leave(b, pushed);
  *capturing = 0;
  *capture_id = 0;
  if (r != CUDA_SUCCESS)
    return cu_fail(b, r, "cuStreamGetCaptureInfo(stream 0x%llx)", (unsigned long long)stream);
  *capturing = status == CU_STREAM_CAPTURE_STATUS_ACTIVE;
  *capture_id = (uint64_t)id;
  return GPUMEM_OK;
}

static void cu_destroy_slot(gpumem_backend_t* self) {
  gpumem_cuda_destroy(self);
}

/* ---- lifetime ---------------------------------------------------------- */

/* Resolves one set of entries; returns the first missing name or NULL.
 * memcpy moves dlsym's object pointer into the function pointer without
 * the cast ISO C leaves undefined (POSIX guarantees the representation). */
#define GM_CU_LOAD(fn)                          \
  do {                                          \
    void* sym_ = dlsym(b->lib, GM_CU_NAME(fn)); \
    if (!sym_) return GM_CU_NAME(fn);           \
    memcpy(&b->api.fn, &sym_, sizeof sym_);     \
  } while (0);

static const char* cu_load_core(gm_cu_backend_t* b) {
  GM_CU_CORE(GM_CU_LOAD)
  return NULL;
}

static const char* cu_load_vmm(gm_cu_backend_t* b) {
  GM_CU_VMM(GM_CU_LOAD)
  return NULL;
}
#undef GM_CU_LOAD

/* Fails create: frees what was taken so far (in reverse) and reports. */
static gpumem_backend_t* GM_PRINTF(4, 5) cu_create_fail(gm_cu_backend_t* b, gpumem_status_t* err,
                                                        gpumem_status_t st, const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (b) {
    if (b->ctx) b->api.cuDevicePrimaryCtxRelease(b->device);
    if (b->lib) dlclose(b->lib);
    free(b);
  }
  gpumem_set_last_error("%s", msg);
  if (err) *err = st;
  return NULL;
}

gpumem_backend_t* gpumem_cuda_create(const gpumem_cuda_options_t* user, gpumem_status_t* err) {
  gpumem_cuda_options_t opts;
  gpumem_cuda_options_init(&opts);
  if (user) {
    if (user->struct_size == 0)
      return cu_create_fail(NULL, err, GPUMEM_ERR_INVALID_ARGUMENT,
                            "gpumem_cuda_create: options.struct_size is 0 (call "
                            "gpumem_cuda_options_init first)");
    /* An older caller's smaller struct keeps the defaults of later fields. */
    size_t n = user->struct_size < sizeof opts ? user->struct_size : sizeof opts;
    memcpy(&opts, user, n);
    opts.struct_size = (uint32_t)sizeof opts;
  }
  if (opts.device < 0)
    return cu_create_fail(NULL, err, GPUMEM_ERR_INVALID_ARGUMENT,
                          "gpumem_cuda_create: device %d is negative", opts.device);

  gm_cu_backend_t* b = calloc(1, sizeof *b);
  if (!b)
    return cu_create_fail(NULL, err, GPUMEM_ERR_HOST_MEMORY,
                          "gpumem_cuda_create: host malloc of %zu bytes failed", sizeof *b);
  b->ordinal = opts.device;
  snprintf(b->device_name, sizeof b->device_name, "unknown GPU");

  /* RTLD_LOCAL keeps the driver's symbols out of the global namespace; when
   * the runtime already loaded it (PyTorch), this just takes a reference. */
  b->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!b->lib) {
    const char* why = dlerror();
    return cu_create_fail(b, err, GPUMEM_ERR_UNSUPPORTED, "libcuda.so.1 not found: %s",
                          why ? why : "dlopen failed");
  }
  const char* missing = cu_load_core(b);
  if (missing)
    return cu_create_fail(b, err, GPUMEM_ERR_UNSUPPORTED,
                          "libcuda.so.1 lacks %s: the CUDA driver is too old for gpumem", missing);
  int have_vmm_api = cu_load_vmm(b) == NULL;

  char why[256];
  CUresult r = b->api.cuInit(0);
  if (r != CUDA_SUCCESS) {
    /* No device, no usable driver, driver/library mismatch: all mean this
     * machine cannot run CUDA, which callers (and tests) treat as absent. */
    int version = 0;
    b->api.cuDriverGetVersion(&version); /* answers without cuInit */
    return cu_create_fail(b, err, GPUMEM_ERR_UNSUPPORTED,
                          "cuInit failed: %s (driver supports CUDA %d.%d)",
                          cu_describe(b, r, why, sizeof why), version / 1000, version % 1000 / 10);
  }
  int count = 0;
  r = b->api.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS)
    return cu_create_fail(b, err, GPUMEM_ERR_UNSUPPORTED, "cuDeviceGetCount failed: %s",
                          cu_describe(b, r, why, sizeof why));
  if (count <= 0) return cu_create_fail(b, err, GPUMEM_ERR_UNSUPPORTED, "no CUDA device");
  if (opts.device >= count)
    return cu_create_fail(b, err, GPUMEM_ERR_INVALID_ARGUMENT,
                          "gpumem_cuda_create: device %d does not exist (%d CUDA device%s)",
                          opts.device, count, count == 1 ? "" : "s");
  r = b->api.cuDeviceGet(&b->device, opts.device);
  if (r != CUDA_SUCCESS)
    return cu_create_fail(b, err, GPUMEM_ERR_BACKEND, "cuDeviceGet(%d) failed: %s", opts.device,
                          cu_describe(b, r, why, sizeof why));
  if (b->api.cuDeviceGetName(b->device_name, (int)sizeof b->device_name, b->device) != CUDA_SUCCESS)
    snprintf(b->device_name, sizeof b->device_name, "unknown GPU");

  /* The primary context is the one the runtime (and so PyTorch) uses:
   * memory made here is usable there and the reverse. Retaining it keeps it
   * alive for as long as this backend lives, whoever else releases it. */
  CUcontext pctx = NULL;
  r = b->api.cuDevicePrimaryCtxRetain(&pctx, b->device);
  if (r != CUDA_SUCCESS) {
    gpumem_status_t st =
        r == CUDA_ERROR_OUT_OF_MEMORY ? GPUMEM_ERR_OUT_OF_MEMORY : GPUMEM_ERR_BACKEND;
    return cu_create_fail(b, err, st, "cuDevicePrimaryCtxRetain(device %d) failed: %s", opts.device,
                          cu_describe(b, r, why, sizeof why));
  }
  b->ctx = pctx;

  /* Access list: the device itself, then every peer asked for that the
   * hardware lets read this device's memory. */
  b->access[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  b->access[0].location.id = (int)b->device;
  b->access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  b->access_count = 1;
  for (int peer = 0; peer < GM_CU_MAX_ACCESS; peer++) {
    if (!(opts.peer_access_mask & ((uint64_t)1 << peer)) || peer == opts.device) continue;
    if (peer >= count)
      return cu_create_fail(b, err, GPUMEM_ERR_INVALID_ARGUMENT,
                            "gpumem_cuda_create: peer_access_mask names device %d, but only %d "
                            "CUDA device%s exist",
                            peer, count, count == 1 ? "" : "s");
    CUdevice pdev = 0;
    int can = 0;
    r = b->api.cuDeviceGet(&pdev, peer);
    if (r == CUDA_SUCCESS) r = b->api.cuDeviceCanAccessPeer(&can, pdev, b->device);
    if (r != CUDA_SUCCESS)
      return cu_create_fail(b, err, GPUMEM_ERR_BACKEND,
                            "cuDeviceCanAccessPeer(device %d -> device %d) failed: %s", peer,
                            opts.device, cu_describe(b, r, why, sizeof why));
    if (!can)
      return cu_create_fail(b, err, GPUMEM_ERR_UNSUPPORTED,
                            "gpumem_cuda_create: device %d cannot access device %d's memory "
                            "(cuDeviceCanAccessPeer says no); drop it from peer_access_mask",
                            peer, opts.device);
    b->access[b->access_count].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    b->access[b->access_count].location.id = (int)pdev;
    b->access[b->access_count].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    b->access_count++;
  }

  /* Virtual memory when asked for and the device and driver have it. */
  int vmm = 0;
  if (opts.virtual_memory && have_vmm_api) {
    int supported = 0;
    r = b->api.cuDeviceGetAttribute(
        &supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, b->device);
    vmm = r == CUDA_SUCCESS && supported;
  }
  /* Pages that export as POSIX file descriptors, so that another process
   * can map them (gpumem_ipc_export), where the device and driver can. */
  int shareable = 0;
  if (vmm) {
    void* exp = dlsym(b->lib, "cuMemExportToShareableHandle");
    void* imp = dlsym(b->lib, "cuMemImportFromShareableHandle");
    int supported = 0;
    r = b->api.cuDeviceGetAttribute(
        &supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, b->device);
    if (exp && imp && r == CUDA_SUCCESS && supported) {
      memcpy(&b->export_handle, &exp, sizeof exp);
      memcpy(&b->import_handle, &imp, sizeof imp);
      shareable = 1;
    }
  }
  if (vmm) {
    b->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    b->prop.requestedHandleTypes =
        shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    b->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    b->prop.location.id = (int)b->device;
    size_t gran = 0;
    /* The minimum (2 MiB on current GPUs) is the finest unit physical
     * memory can move in, which is what defragmentation needs. */
    r = b->api.cuMemGetAllocationGranularity(&gran, &b->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS)
      return cu_create_fail(b, err, GPUMEM_ERR_BACKEND,
                            "cuMemGetAllocationGranularity(device %d) failed: %s", opts.device,
                            cu_describe(b, r, why, sizeof why));
    if (gran == 0 || (gran & (gran - 1)) != 0)
      return cu_create_fail(b, err, GPUMEM_ERR_BACKEND,
                            "cuMemGetAllocationGranularity(device %d) gave %zu bytes, not a power "
                            "of two",
                            opts.device, gran);
    b->base.page_size = gran;
  }

  b->base.version = GPUMEM_BACKEND_VERSION;
  /* The name tells which path was chosen: stats and summaries show it. */
  b->base.name = vmm ? "cuda" : "cuda-plain";
  b->base.ctx = b;
  if (vmm) {
    b->base.reserve = cu_reserve;
    b->base.release_range = cu_release_range;
    b->base.create_page = cu_create_page;
    b->base.release_page = cu_release_page;
    b->base.map = cu_map;
    b->base.unmap = cu_unmap;
    if (shareable) {
      b->base.export_page = cu_export_page;
      b->base.import_page = cu_import_page;
    }
    /* The overflow tier's slots: the host page's refusal, where the driver
     * gives one, is said when a request first needs it. */
    void* copy = dlsym(b->lib, "cuMemcpyDtoDAsync_v2");
    if (copy) {
      memcpy(&b->copy_async, &copy, sizeof copy);
      b->host_numa_id = -1;
#if CUDA_VERSION >= 12020
      int numa = -1;
      if (b->api.cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, b->device) ==
              CUDA_SUCCESS &&
          numa >= 0)
        b->host_numa_id = numa;
#endif
      b->base.create_host_page = cu_create_host_page;
      b->base.copy = cu_copy;
    }
  }
  b->base.alloc = cu_alloc;
  b->base.free = cu_free;
  b->base.mem_info = cu_mem_info;
  b->base.event_create = cu_event_create;
  b->base.event_destroy = cu_event_destroy;
  b->base.event_record = cu_event_record;
  b->base.event_query = cu_event_query;
  b->base.event_sync = cu_event_sync;
  b->base.stream_sync = cu_stream_sync;
  b->base.device_sync = cu_device_sync;
  b->base.stream_wait = cu_stream_wait;
  {
    void* sym = dlsym(b->lib, "cuStreamGetCaptureInfo");
    if (sym) {
      memcpy(&b->stream_get_capture_info, &sym, sizeof sym);
      b->base.stream_capture_info = cu_stream_capture_info;
    }
  }
  b->base.destroy = cu_destroy_slot;
  if (err) *err = GPUMEM_OK;
  return &b->base;
}

void gpumem_cuda_destroy(gpumem_backend_t* cuda) {
  if (!cuda) return;
  gm_cu_backend_t* b = (gm_cu_backend_t*)cuda;
  /* Errors are ignored on purpose: at process exit the driver may already
   * be shut down (CUDA_ERROR_DEINITIALIZED), and there is nobody to tell. */
  if (b->ctx) b->api.cuDevicePrimaryCtxRelease(b->device);
  if (b->lib) dlclose(b->lib);
  free(b);
}

#endif /* GPUMEM_HAVE_CUDA */
