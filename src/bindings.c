/* The C ABI through which other frameworks allocate from gpumem: PyTorch's
 * CUDAPluggableAllocator (gpumem_torch_*) and CuPy's CFunctionAllocator
 * (gpumem_cupy_*), plus the few helpers the Python package needs to reach
 * the same allocators (gpumem_binding_*).
 *
 * Each device ordinal is served by one allocator: gpumem_default(device)
 * unless gpumem_binding_set_allocator() named another (tests use a simulated
 * device there; users may want a differently configured instance). The
 * choice is cached in an atomic table, so the hot path costs one load and
 * never takes gpumem_default's global lock.
 *
 * Neither framework can be told why an allocation failed: both take a NULL
 * return at face value (PyTorch 2.11's CUDAPluggableAllocator::malloc stores
 * it in a tensor; CuPy wraps it in a MemoryPointer). So every failure leaves
 * its status and full report in thread-local storage (gpumem_torch_last_oom,
 * gpumem_torch_last_status) for a wrapper to turn into the framework's own
 * exception: the Python package compiles a small C++ shim around
 * gpumem_torch_malloc that throws c10::OutOfMemoryError, and checks CuPy's
 * pointers itself. Where no such wrapper exists, a fail hook (a C++ function
 * that throws, e.g. c10::detail::torchCheckFail) can be installed with
 * gpumem_torch_set_fail_hook: it is called from gpumem_torch_malloc with no
 * lock held and nothing to clean up, so a C++ exception may unwind through
 * this frame.
 *
 * None of these entry points can return an error, and frees run in C++
 * destructors, so failures other than allocation ones are printed on
 * stderr: a wrong free is a bug worth seeing, never worth aborting for. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include "internal.h"

/* The entry points are declared in include/gpumem.h ("framework bindings"). */

/* ---- which allocator serves which device ---------------------------- */

#define GM_BIND_MAX_DEVICES 64

/* Written once per device (or by set_allocator), read on every call. */
static gpumem_t* _Atomic bound[GM_BIND_MAX_DEVICES];
/* How many devices have an allocator, and the last one given one: a free
 * that names no device (a C++ deleter gets only the pointer) goes straight
 * to the only allocator when there is one. */
static _Atomic int num_bound;
static _Atomic int last_bound = -1;

static void note_bound(int device) {
  atomic_store_explicit(&last_bound, device, memory_order_release);
  atomic_fetch_add_explicit(&num_bound, 1, memory_order_acq_rel);
}
static _Atomic int torch_device_count;
static _Atomic(gpumem_torch_fail_fn) fail_hook;

/* The failure report outlives later gpumem failures on the thread (a free
 * failing while the exception unwinds must not replace the OOM report). */
static _Thread_local char last_report[4096];
static _Thread_local int last_status;

static int device_ok(int device) {
  return device >= 0 && device < GM_BIND_MAX_DEVICES;
}

gpumem_t* gpumem_binding_peek(int device) {
  if (!device_ok(device)) return NULL;
  return atomic_load_explicit(&bound[device], memory_order_acquire);
}

gpumem_t* gpumem_binding_allocator(int device) {
  if (!device_ok(device)) {
    gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem: CUDA device %d is out of range [0, %d)", device,
            GM_BIND_MAX_DEVICES);
    return NULL;
  }
  gpumem_t* gm = atomic_load_explicit(&bound[device], memory_order_acquire);
  if (GM_LIKELY(gm != NULL)) return gm;
  gpumem_t* made = gpumem_default(device);
  if (!made) return NULL;
  /* A racing set_allocator wins: its choice was explicit. */
  gpumem_t* expected = NULL;
  if (atomic_compare_exchange_strong_explicit(&bound[device], &expected, made, memory_order_acq_rel,
                                              memory_order_acquire)) {
    note_bound(device);
    return made;
  }
  return expected;
}

gpumem_status_t gpumem_binding_set_allocator(int device, gpumem_t* gm) {
  if (!device_ok(device))
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_binding_set_allocator: device %d is out of range [0, %d)", device,
                   GM_BIND_MAX_DEVICES);
  gpumem_t* cur = atomic_load_explicit(&bound[device], memory_order_acquire);
  if (cur && cur != gm) {
    /* Frees go to the allocator serving the device at free time: switching
     * under live blocks would send them to one that never saw them. */
    gpumem_stats_t st;
    gpumem_get_stats(cur, &st);
    if (st.allocation[GPUMEM_POOL_ALL].current > 0)
      return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                     "gpumem_binding_set_allocator: device %d's allocator still has %lld live "
                     "allocation(s); free them first",
                     device, (long long)st.allocation[GPUMEM_POOL_ALL].current);
  }
  gpumem_t* was = atomic_exchange_explicit(&bound[device], gm, memory_order_acq_rel);
  if (!was && gm) note_bound(device);
  if (was && !gm) atomic_fetch_sub_explicit(&num_bound, 1, memory_order_acq_rel);
  return GPUMEM_OK;
}

/* The served allocator whose live allocation starts at ptr, or NULL. The
 * torch hooks that get no device (record_stream, base_alloc) need it; the
 * first device answers on single-GPU jobs. */
static gpumem_t* owner_of(const void* ptr, size_t* size) {
  for (int d = 0; d < GM_BIND_MAX_DEVICES; d++) {
    gpumem_t* gm = atomic_load_explicit(&bound[d], memory_order_acquire);
    if (!gm) continue;
    size_t n = gpumem_allocation_size(gm, ptr);
    if (n) {
      if (size) *size = n;
      return gm;
    }
  }
  return NULL;
}

/* ---- text into a buffer ---------------------------------------------- */

typedef struct gm_text_buf {
  char* buf;
  size_t cap;
  size_t len; /* full length, even past cap */
} gm_text_buf;

static int text_buf_write(const char* text, size_t len, void* arg) {
  gm_text_buf* t = arg;
  if (t->cap && t->len + 1 < t->cap) {
    size_t room = t->cap - 1 - t->len;
    memcpy(t->buf + t->len, text, len < room ? len : room);
  }
  t->len += len;
  return 0;
}

static size_t format_into(gpumem_t* gm, char* buf, size_t cap, int json, int flags) {
  gm_text_buf t = {buf, buf ? cap : 0, 0};
  gpumem_stats_t st;
  if (gm) {
    gpumem_get_stats(gm, &st);
  } else {
    memset(&st, 0, sizeof st);
    st.struct_size = (uint32_t)sizeof st;
    st.max_split_size = -1; /* an allocator with default options */
  }
  if (json) {
    gpumem_format_stats_json(&st, text_buf_write, &t);
  } else if (gpumem_format_summary_flags(&st, flags, text_buf_write, &t) != 0) {
    return 0; /* unknown flags: nothing written, the sink never fails */
  }
  if (t.cap) t.buf[t.len < t.cap ? t.len : t.cap - 1] = '\0';
  return t.len;
}

size_t gpumem_binding_stats_json(gpumem_t* gm, char* buf, size_t cap) {
  return format_into(gm, buf, cap, 1, 0);
}

size_t gpumem_binding_summary(gpumem_t* gm, char* buf, size_t cap) {
  return format_into(gm, buf, cap, 0, 0);
}

size_t gpumem_binding_summary_flags(gpumem_t* gm, int flags, char* buf, size_t cap) {
  return format_into(gm, buf, cap, 0, flags);
}

size_t gpumem_binding_snapshot_json(gpumem_t* gm, int device, const char* tag_file, char* buf,
                                    size_t cap) {
  gm_text_buf t = {buf, buf ? cap : 0, 0};
  if (gpumem_snapshot_json(gm, device, tag_file, text_buf_write, &t) != 0) return 0;
  if (t.cap) t.buf[t.len < t.cap ? t.len : t.cap - 1] = '\0';
  return t.len;
}

size_t gpumem_binding_leaks(gpumem_t* gm, uint64_t since, int json, char* buf, size_t cap) {
  if (!gm) return 0;
  gm_text_buf t = {buf, buf ? cap : 0, 0};
  int rc = json ? gpumem_print_leaks_json(gm, since, text_buf_write, &t)
                : gpumem_print_leaks(gm, since, text_buf_write, &t);
  if (rc != 0) return 0;
  if (t.cap) t.buf[t.len < t.cap ? t.len : t.cap - 1] = '\0';
  return t.len;
}

/* ---- failures --------------------------------------------------------- */

static void remember_failure(gpumem_status_t st, const char* prefix) {
  const char* detail = gpumem_last_error();
  if (!detail[0]) detail = gpumem_strerror(st);
  snprintf(last_report, sizeof last_report, "%s%s", prefix, detail);
  last_status = (int)st;
}

/* ---- out of memory in PyTorch's words ---------------------------------
 *
 * Tools recognise an out-of-memory error by its text, not its type:
 * Accelerate's batch-size finder looks for "CUDA out of memory." in the
 * message, Lightning's for "CUDA" and "out of memory", and users' own
 * loops copy them. So under PyTorch a failure's message opens with the
 * sentences PyTorch's caching allocator writes (c10/cuda/
 * CUDACachingAllocator.cpp), with its figures, and gpumem's report follows.
 * "Tried to allocate" is what PyTorch's allocator would have asked the
 * device for at that request (its segment rounding), so that the two
 * messages compare for the same request; gpumem's report gives the request
 * itself in bytes. */

static _Atomic int torch_minor = 11; /* the installed PyTorch 2.x's minor */
static _Atomic(gpumem_torch_oom_observer_fn) oom_observer;

void gpumem_torch_set_version(int major, int minor) {
  atomic_store_explicit(&torch_minor, major > 2 ? 99 : minor, memory_order_relaxed);
}

void gpumem_torch_set_oom_observer(gpumem_torch_oom_observer_fn fn) {
  atomic_store_explicit(&oom_observer, fn, memory_order_release);
}

/* c10's format_size: bytes up to 1 KiB, then KiB, MiB and GiB with two
 * decimals, each unit up to and including its upper bound. */
static const char* torch_format_size(uint64_t size, char* out, size_t cap) {
  if (size <= 1024)
    snprintf(out, cap, "%llu bytes", (unsigned long long)size);
  else if (size <= 1048576)
    snprintf(out, cap, "%.2f KiB", (double)size / 1024.0);
  else if (size <= 1073741824ULL)
    snprintf(out, cap, "%.2f MiB", (double)size / 1048576.0);
  else
    snprintf(out, cap, "%.2f GiB", (double)size / 1073741824.0);
  return out;
}

/* What PyTorch's allocator asks the device for at a request of size bytes:
 * the request rounded to 512 bytes, then a 2 MiB segment for small ones, a
 * 20 MiB one up to 10 MiB, else the request rounded up to 2 MiB. */
uint64_t gpumem_torch_segment_size(uint64_t size) {
  const uint64_t mib = 1048576;
  uint64_t rounded = size < 512 ? 512 : (size + 511) / 512 * 512;
  if (rounded <= mib) return 2 * mib;
  if (rounded < 10 * mib) return 20 * mib;
  return (rounded + 2 * mib - 1) / (2 * mib) * (2 * mib);
}

static void remember_torch_oom(gpumem_t* gm, size_t size, int device) {
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  int64_t allocated = st.allocated_bytes[GPUMEM_POOL_ALL].current;
  int64_t reserved = st.reserved_bytes[GPUMEM_POOL_ALL].current;
  uint64_t unallocated = reserved > allocated ? (uint64_t)(reserved - allocated) : 0;
  uint64_t asked = gpumem_torch_segment_size(size);
  char tried[32], total[32], free_b[32], allowed[48] = "", alloc_b[32], unalloc_b[32];
  if (st.limit_bytes) {
    char lim[32];
    snprintf(allowed, sizeof allowed, "%s allowed; ",
             torch_format_size(st.limit_bytes, lim, sizeof lim));
  }
  /* PyTorch 2.1 spelled it "capacty". */
  int minor = atomic_load_explicit(&torch_minor, memory_order_relaxed);
  char prefix[640];
  snprintf(prefix, sizeof prefix,
           "CUDA out of memory. Tried to allocate %s. GPU %d has a total %s of %s of which %s is "
           "free. %sOf the allocated memory %s is allocated by PyTorch, and %s is reserved by "
           "PyTorch but unallocated. ",
           torch_format_size(asked, tried, sizeof tried), device,
           minor == 1 ? "capacty" : "capacity",
           torch_format_size(st.device_total, total, sizeof total),
           torch_format_size(st.device_free, free_b, sizeof free_b), allowed,
           torch_format_size((uint64_t)(allocated > 0 ? allocated : 0), alloc_b, sizeof alloc_b),
           torch_format_size(unallocated, unalloc_b, sizeof unalloc_b));
  remember_failure(GPUMEM_ERR_OUT_OF_MEMORY, prefix);
  /* torch._C._cuda_attach_out_of_memory_observer's arguments: the device,
   * the allocation size, the memory allowed (the limit, else the device's
   * total) and the device's free memory. Called with no lock held. */
  gpumem_torch_oom_observer_fn obs = atomic_load_explicit(&oom_observer, memory_order_acquire);
  if (obs)
    obs(device, (int64_t)asked, (int64_t)(st.limit_bytes ? st.limit_bytes : st.device_total),
        (int64_t)st.device_free);
}

const char* gpumem_torch_last_oom(void) {
  return last_report;
}

int gpumem_torch_last_status(void) {
  return last_status;
}

void gpumem_torch_set_fail_hook(gpumem_torch_fail_fn fn) {
  atomic_store_explicit(&fail_hook, fn, memory_order_release);
}

static void warn_failure(const char* what, const void* ptr, int device) {
  fprintf(stderr, "gpumem: %s of %p on CUDA device %d failed: %s\n", what, ptr, device,
          gpumem_last_error());
}

/* ---- PyTorch ------------------------------------------------------------ */

void* gpumem_torch_malloc(ssize_t size, int device, void* stream) {
  /* torch asks for 0 bytes for empty tensors and expects NULL back. */
  if (size <= 0) return NULL;
  void* p = NULL;
  gpumem_status_t st;
  gpumem_t* gm = gpumem_binding_allocator(device);
  if (GM_LIKELY(gm != NULL)) {
    st = gpumem_malloc(gm, (size_t)size, (gpumem_stream_t)(uintptr_t)stream, &p);
    if (GM_LIKELY(st == GPUMEM_OK)) return p;
    if (st == GPUMEM_ERR_OUT_OF_MEMORY)
      remember_torch_oom(gm, (size_t)size, device);
    else
      remember_failure(st, "");
  } else {
    /* No allocator at all (no driver, bad GPUMEM_CONF): not an OOM, but
     * the report must still say why every allocation fails. */
    char prefix[96];
    snprintf(prefix, sizeof prefix, "gpumem: no allocator for CUDA device %d: ", device);
    remember_failure(GPUMEM_ERR_BACKEND, prefix);
  }
  gpumem_torch_fail_fn hook = atomic_load_explicit(&fail_hook, memory_order_acquire);
  if (hook) hook(__func__, __FILE__, (uint32_t)__LINE__, last_report);
  return NULL;
}

/* Frees ptr through gm, or the device's binding allocator, or whichever
 * allocator owns it; frees run in destructors, so failures are reported on
 * stderr rather than returned. */
static void binding_free(gpumem_t* gm, void* ptr, int device) {
  if (!ptr) return;
  if (!gm) gm = gpumem_binding_peek(device);
  if (!gm && device < 0 && atomic_load_explicit(&num_bound, memory_order_acquire) == 1)
    gm = gpumem_binding_peek(atomic_load_explicit(&last_bound, memory_order_acquire));
  if (!gm) gm = owner_of(ptr, NULL);
  if (!gm) {
    gpumem_set_last_error("no gpumem allocator serves this device");
    warn_failure("free", ptr, device);
    return;
  }
  if (gpumem_free(gm, ptr) != GPUMEM_OK) warn_failure("free", ptr, device);
}

void gpumem_torch_free(void* ptr, ssize_t size, int device, void* stream) {
  (void)size;   /* gpumem knows every block's size */
  (void)stream; /* and the stream it was allocated on */
  binding_free(NULL, ptr, device);
}

void gpumem_torch_init(int device_count) {
  /* Allocators are made lazily per device on first use, so a process that
   * only ever touches GPU 0 creates nothing on the others. */
  atomic_store_explicit(&torch_device_count, device_count, memory_order_relaxed);
}

gpumem_status_t gpumem_torch_empty_cache(int device) {
  gpumem_status_t first = GPUMEM_OK;
  for (int d = 0; d < GM_BIND_MAX_DEVICES; d++) {
    if (device >= 0 && d != device) continue;
    gpumem_t* gm = atomic_load_explicit(&bound[d], memory_order_acquire);
    if (!gm) continue;
    gpumem_status_t st = gpumem_empty_cache(gm);
    if (st != GPUMEM_OK && first == GPUMEM_OK) first = st;
  }
  return first;
}

void gpumem_torch_reset(void) {
  if (gpumem_torch_empty_cache(-1) != GPUMEM_OK) warn_failure("empty_cache", NULL, -1);
}

void gpumem_torch_set_memory_fraction(double fraction, int device) {
  gpumem_t* gm = gpumem_binding_allocator(device);
  gpumem_status_t st = gm ? gpumem_set_limit_fraction(gm, fraction) : GPUMEM_ERR_BACKEND;
  if (st != GPUMEM_OK) {
    fprintf(stderr, "gpumem: set_per_process_memory_fraction(%g) on CUDA device %d failed: %s\n",
            fraction, device, gpumem_last_error());
  }
}

void* gpumem_torch_base_alloc(void* ptr, size_t* size) {
  /* Every block is its own allocation as far as callers can tell: gpumem
   * never hands out pieces of a larger one to share by IPC. */
  size_t n = 0;
  owner_of(ptr, &n);
  if (size) *size = n;
  return ptr;
}

void gpumem_torch_record_stream(void* ptr, void* stream) {
  if (!ptr) return;
  gpumem_t* gm = owner_of(ptr, NULL);
  gpumem_status_t st =
      gm ? gpumem_record_stream(gm, ptr, (gpumem_stream_t)(uintptr_t)stream)
         : gm_fail(GPUMEM_ERR_INVALID_POINTER, "no gpumem allocator holds this pointer");
  if (st != GPUMEM_OK) warn_failure("record_stream", ptr, -1);
}

/* ---- CuPy --------------------------------------------------------------- */

void* gpumem_cupy_malloc(void* param, size_t size, int device) {
  if (size == 0) return NULL;
  gpumem_t* gm = param ? (gpumem_t*)param : gpumem_binding_allocator(device);
  if (!gm) {
    char prefix[96];
    snprintf(prefix, sizeof prefix, "gpumem: no allocator for CUDA device %d: ", device);
    remember_failure(GPUMEM_ERR_BACKEND, prefix);
    return NULL;
  }
  void* p = NULL;
  gpumem_status_t st = gpumem_malloc(gm, size, 0, &p);
  if (st != GPUMEM_OK) {
    remember_failure(st, "");
    return NULL;
  }
  return p;
}

void gpumem_cupy_free(void* param, void* ptr, int device) {
  binding_free(param, ptr, device);
}

int gpumem_torch_ipc_export(void* ptr, char* out, size_t cap, size_t* needed) {
  gpumem_t* gm = ptr ? owner_of(ptr, NULL) : NULL;
  if (!gm)
    return gm_fail(GPUMEM_ERR_INVALID_POINTER,
                   "gpumem_ipc_export: %p is not an allocation of gpumem's PyTorch allocator", ptr);
  return gpumem_ipc_export(gm, ptr, out, cap, needed);
}

int gpumem_torch_ipc_open(int device, const char* handle, size_t len, void** out) {
  gpumem_t* gm = gpumem_binding_allocator(device);
  if (!gm) return GPUMEM_ERR_BACKEND; /* gpumem_last_error() says why */
  return gpumem_ipc_open(gm, handle, len, out);
}

int gpumem_torch_ipc_close(int device, void* ptr) {
  gpumem_t* gm = gpumem_binding_allocator(device);
  if (!gm) return GPUMEM_ERR_BACKEND;
  return gpumem_ipc_close(gm, ptr);
}

/* cuDNN's benchmark mode asks torch's allocator for its largest cached
 * block (cacheInfo) to size workspaces. Under gpumem a block's pages are
 * mapped on demand, so what one allocation can get is the largest free
 * block gpumem holds or the device's free memory, whichever is larger. */
uint64_t gpumem_torch_largest_free(int device) {
  gpumem_t* gm = gpumem_binding_allocator(device);
  if (!gm) return 0;
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  uint64_t largest = st.largest_free_block;
  return st.device_free > largest ? st.device_free : largest;
}
