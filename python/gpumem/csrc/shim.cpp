// gpumem's PyTorch shim, compiled by gpumem/torch.py against the installed
// torch at first use when the full allocator (allocator.cpp) cannot be;
// torch.py puts the definition of GPUMEM_SHIM_OOM_STATUS in front.
// PyTorch's pluggable allocator stores whatever its alloc function returns,
// NULL included; this wrapper turns gpumem's failure into the exception the
// native allocator throws, so Python sees torch.OutOfMemoryError.
#include <c10/util/Exception.h>
#include <sys/types.h>

namespace {
typedef void* (*gm_malloc_fn)(ssize_t, int, void*);
typedef void (*gm_free_fn)(void*, ssize_t, int, void*);
typedef const char* (*gm_report_fn)();
typedef int (*gm_status_fn)();
gm_malloc_fn g_malloc = nullptr;
gm_free_fn g_free = nullptr;
gm_report_fn g_report = nullptr;
gm_status_fn g_status = nullptr;
}  // namespace

extern "C" {
// Bound once from Python with the addresses of libgpumem's entry points, so
// the shim does not link against (or load a second copy of) libgpumem.
__attribute__((visibility("default"))) void gpumem_shim_bind(void* m, void* f, void* r, void* s) {
  g_malloc = reinterpret_cast<gm_malloc_fn>(m);
  g_free = reinterpret_cast<gm_free_fn>(f);
  g_report = reinterpret_cast<gm_report_fn>(r);
  g_status = reinterpret_cast<gm_status_fn>(s);
}

__attribute__((visibility("default"))) void* gpumem_shim_malloc(ssize_t size, int device, void* stream) {
  void* p = g_malloc(size, device, stream);
  if (p == nullptr && size > 0) {
    const char* report = g_report();
    if (g_status() == GPUMEM_SHIM_OOM_STATUS) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, report);
    }
    TORCH_CHECK(false, report);
  }
  return p;
}

// Frees run in destructors: never throw here (gpumem reports on stderr).
__attribute__((visibility("default"))) void gpumem_shim_free(void* p, ssize_t size, int device, void* stream) {
  g_free(p, size, device, stream);
}
}
