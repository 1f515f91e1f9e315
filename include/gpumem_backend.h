/* gpumem backend interface: the device primitives the allocator builds on.
 *
 * A backend is a versioned table of function pointers plus a context
 * pointer (in the manner of SQLite's sqlite3_mem_methods). Every slot
 * returns a gpumem_status_t: GPUMEM_OK, GPUMEM_ERR_OUT_OF_MEMORY when the
 * device has no memory for the request (the allocator then runs its retry
 * ladder), or GPUMEM_ERR_BACKEND for anything else, with a message set
 * through gpumem_set_last_error() naming the device's own error.
 *
 * Two ways to hold memory:
 *  - virtual memory: reserve an address range, create physical pages of
 *    page_size bytes (or multiples), map them into the range and unmap
 *    them again (CUDA's cuMemAddressReserve/cuMemCreate/cuMemMap);
 *  - plain: alloc/free (cuMemAlloc/cuMemFree).
 * A backend provides at least one of the two sets.
 *
 * Slots marked (optional) may be NULL; the default is stated there. */
#ifndef GPUMEM_BACKEND_H
#define GPUMEM_BACKEND_H

#include "gpumem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 2 added export_page and import_page, 3 create_host_page and copy; a
 * backend of an earlier version (which lacks them) is still accepted. */
#define GPUMEM_BACKEND_VERSION 3

/* An opaque physical allocation handle (CUmemGenericAllocationHandle). */
typedef uint64_t gpumem_phys_t;
/* An opaque event handle (CUevent). */
typedef uintptr_t gpumem_event_t;

struct gpumem_backend {
  uint32_t version; /* GPUMEM_BACKEND_VERSION */
  const char* name; /* "sim", "cuda" */
  void* ctx;        /* passed to every slot */
  /* Physical page granularity in bytes (a power of two), or 0 when the
   * virtual memory slots are absent. */
  size_t page_size;

  /* -- virtual memory (optional as a set: all four or none) -- */
  /* Reserves size bytes (a multiple of page_size) of device address space. */
  gpumem_status_t (*reserve)(void* ctx, size_t size, uintptr_t* out_addr);
  /* Frees a reserved range; it must hold no mappings. */
  gpumem_status_t (*release_range)(void* ctx, uintptr_t addr, size_t size);
  /* Creates size bytes (a multiple of page_size) of physical memory. */
  gpumem_status_t (*create_page)(void* ctx, size_t size, gpumem_phys_t* out);
  /* Returns physical memory to the device; it must not be mapped. */
  gpumem_status_t (*release_page)(void* ctx, gpumem_phys_t page, size_t size);
  /* Maps a whole physical allocation at addr (page aligned, inside a
   * reserved range) and makes it accessible from the device. */
  gpumem_status_t (*map)(void* ctx, uintptr_t addr, size_t size, gpumem_phys_t page);
  /* Unmaps [addr, addr+size), which must be whole mapped allocations. The
   * caller guarantees no queued work still touches them. */
  gpumem_status_t (*unmap)(void* ctx, uintptr_t addr, size_t size);

  /* -- plain memory (optional as a set) -- */
  gpumem_status_t (*alloc)(void* ctx, size_t size, uintptr_t* out_addr);
  gpumem_status_t (*free)(void* ctx, uintptr_t addr, size_t size);

  /* Device memory: total and currently free bytes. */
  gpumem_status_t (*mem_info)(void* ctx, size_t* free_bytes, size_t* total_bytes);

  /* -- streams and events (optional as a set; without them every stream
   *    is treated as complete at once, as on a device with no async work) */
  gpumem_status_t (*event_create)(void* ctx, gpumem_event_t* out);
  gpumem_status_t (*event_destroy)(void* ctx, gpumem_event_t event);
  gpumem_status_t (*event_record)(void* ctx, gpumem_event_t event, gpumem_stream_t stream);
  /* GPUMEM_OK when complete, GPUMEM_NOT_READY when work is pending. */
  gpumem_status_t (*event_query)(void* ctx, gpumem_event_t event);
  gpumem_status_t (*event_sync)(void* ctx, gpumem_event_t event);
  gpumem_status_t (*stream_sync)(void* ctx, gpumem_stream_t stream);
  /* (optional) defaults to nothing when absent (no async work exists). */
  gpumem_status_t (*device_sync)(void* ctx);
  /* (optional) makes stream's work queued from now on wait, on the device,
   * for the event's latest record (cuStreamWaitEvent); the host does not
   * wait. Without it (or with the option stream_waits:off) the streams of
   * a plan never share an arena (docs/design.md, "Planned placement",
   * several streams). */
  gpumem_status_t (*stream_wait)(void* ctx, gpumem_stream_t stream, gpumem_event_t event);

  /* (optional) frees the backend itself; called by gpumem_destroy when the
   * allocator owns the backend (options.own_backend). */
  void (*destroy)(gpumem_backend_t* self);

  /* (optional) whether stream is capturing a graph now and under which
   * capture id (cuStreamGetCaptureInfo); defaults to "not capturing". While
   * a stream captures, the allocator makes no synchronization and no event
   * query or record (illegal then on CUDA), and allocations the pool
   * routes say (gpumem_begin_allocate_to_pool_capture) take the stream's
   * capture id from here. */
  gpumem_status_t (*stream_capture_info)(void* ctx, gpumem_stream_t stream, int* capturing,
                                         uint64_t* capture_id);

  /* -- sharing memory with other processes (version 2; optional as a
   *    pair: without them gpumem_ipc_export and gpumem_ipc_open fail with
   *    GPUMEM_ERR_UNSUPPORTED) -- */
  /* A new file descriptor standing for physical allocation page, which
   * another process can import (cuMemExportToShareableHandle, POSIX file
   * descriptor); the caller closes it. */
  gpumem_status_t (*export_page)(void* ctx, gpumem_phys_t page, int* out_fd);
  /* The physical allocation fd stands for, to map with map() and give back
   * with release_page(); fd stays the caller's. */
  gpumem_status_t (*import_page)(void* ctx, int fd, gpumem_phys_t* out);

  /* -- the overflow tier (version 3; optional as a pair: without them
   *    option overflow:host has no host pages to give, and a request the
   *    device cannot serve fails as before) -- */
  /* Creates size bytes (a multiple of page_size) of physical memory in
   * host RAM that map() maps into a reserved range like a device page and
   * release_page() gives back; device kernels reach it over the host link.
   * GPUMEM_ERR_OUT_OF_MEMORY when the host has none; GPUMEM_ERR_UNSUPPORTED
   * when the driver refuses host locations (the message says how). */
  gpumem_status_t (*create_host_page)(void* ctx, size_t size, gpumem_phys_t* out);
  /* Copies size bytes from src to dst (mapped addresses of this device,
   * either tier), queued on stream after its work so far; done when
   * stream_sync(stream) returns. */
  gpumem_status_t (*copy)(void* ctx, uintptr_t dst, uintptr_t src, size_t size,
                          gpumem_stream_t stream);
};

/* ---- the simulated device -------------------------------------------- */

typedef struct gpumem_sim_options {
  uint32_t struct_size;
  size_t capacity;  /* bytes of device memory (default 80 GiB) */
  size_t page_size; /* physical granularity (default 2 MiB) */
  /* Plain allocations come at descending addresses, as cudaMalloc's did on
   * the H200 the traces were recorded on (default 1). */
  int descending_addresses;
  /* Every byte handed out is real host memory (for pattern tests). */
  int host_backed;
  /* An event recorded on a stream completes after this many queries
   * (default 0: at once). event_sync and stream_sync complete it. */
  int event_delay_queries;
  int virtual_memory; /* offer the virtual memory slots (default 1) */
  int plain_memory;   /* offer alloc/free (default 1) */
  /* Host memory create_host_page may hand out, bytes (default 1 TiB). */
  size_t host_capacity;
  /* Offer create_host_page and copy (default 1). */
  int host_pages;
} gpumem_sim_options_t;

GPUMEM_API void gpumem_sim_options_init(gpumem_sim_options_t* opts);
/* Creates a simulated device. NULL on host malloc failure. Destroy with
 * gpumem_sim_destroy (or hand it to the allocator with own_backend). */
GPUMEM_API gpumem_backend_t* gpumem_sim_create(const gpumem_sim_options_t* opts);
GPUMEM_API void gpumem_sim_destroy(gpumem_backend_t* sim);

/* Scripted failures. kind is a gpumem_backend_call_t or -1 for any call.
 * After `skip` more matching calls succeed, the next `count` matching calls
 * fail with status (count < 0: every later call fails). Replaces any
 * earlier script. */
GPUMEM_API void gpumem_sim_fail(gpumem_backend_t* sim, int kind, long skip, long count,
                                gpumem_status_t status);
GPUMEM_API void gpumem_sim_fail_clear(gpumem_backend_t* sim);

typedef struct gpumem_sim_counters {
  uint64_t calls[GPUMEM_CALL_COUNT]; /* every call, by kind */
  uint64_t failures_injected;
  uint64_t bytes_in_use; /* physical + plain bytes held */
  uint64_t peak_bytes_in_use;
  uint64_t ranges_reserved; /* live reserved ranges */
  uint64_t pages_live;      /* live physical allocations */
  uint64_t pages_mapped;    /* live mappings */
  uint64_t plain_live;      /* live plain allocations */
  uint64_t events_live;
  /* Calls CUDA refuses while a graph is being captured (a synchronization,
   * an event query, an event recorded on a capturing stream), made while
   * gpumem_sim_begin_capture had a stream capturing: 0 in a correct run. */
  uint64_t capture_violations;
  uint64_t host_bytes_in_use; /* host pages held (create_host_page) */
  uint64_t peak_host_bytes_in_use;
  /* Bytes copy() moved across the host link (one side a host page), and
   * the time that would take at GPUMEM_SIM_HOST_LINK_BYTES_PER_S. */
  uint64_t host_link_bytes;
  uint64_t host_link_model_ns;
} gpumem_sim_counters_t;

/* The simulated host link's rate, bytes per second: a model figure. An
 * H100's PCIe Gen5 x16 host link moves about 50 GB/s one way where its
 * HBM3 reads about 3 TB/s; pending a measurement on the GPU (the probe in
 * the overflow tier's GPU test), the simulated device prices host traffic
 * at this rate. */
#define GPUMEM_SIM_HOST_LINK_BYTES_PER_S 50e9

GPUMEM_API void gpumem_sim_get_counters(gpumem_backend_t* sim, gpumem_sim_counters_t* out);
/* Host address backing device address addr on a host-backed simulated
 * device; NULL if addr is not mapped (or the device is not host-backed). */
GPUMEM_API void* gpumem_sim_host_ptr(gpumem_backend_t* sim, uintptr_t addr);
/* Marks stream busy: events recorded on it from now on wait for queries
 * as configured; sim "work" is otherwise instantaneous. */
GPUMEM_API void gpumem_sim_set_event_delay(gpumem_backend_t* sim, int queries);
/* Graph capture, modelled: from begin_capture until end_capture, stream
 * captures under capture_id (nonzero), which stream_capture_info reports;
 * meanwhile synchronizations, event queries and event records on a
 * capturing stream fail and count as capture_violations. At most 16
 * streams capture at once; GPUMEM_ERR_INVALID_ARGUMENT beyond, for a
 * capture id of 0, or for ending a capture that was never begun. */
GPUMEM_API gpumem_status_t gpumem_sim_begin_capture(gpumem_backend_t* sim, gpumem_stream_t stream,
                                                    uint64_t capture_id);
GPUMEM_API gpumem_status_t gpumem_sim_end_capture(gpumem_backend_t* sim, gpumem_stream_t stream);

/* ---- CUDA ------------------------------------------------------------- */

typedef struct gpumem_cuda_options {
  uint32_t struct_size;
  int device;
  /* 1: use virtual memory when the device supports it (default);
   * 0: always cuMemAlloc. */
  int virtual_memory;
  /* Also grant access to these peer devices (bitmask of ordinals). */
  uint64_t peer_access_mask;
} gpumem_cuda_options_t;

GPUMEM_API void gpumem_cuda_options_init(gpumem_cuda_options_t* opts);
/* Creates a backend over the CUDA driver (libcuda.so.1 loaded with dlopen).
 * Returns NULL with *err set (GPUMEM_ERR_UNSUPPORTED where no driver or GPU
 * exists, or the library was built without CUDA headers). */
GPUMEM_API gpumem_backend_t* gpumem_cuda_create(const gpumem_cuda_options_t* opts,
                                                gpumem_status_t* err);
GPUMEM_API void gpumem_cuda_destroy(gpumem_backend_t* cuda);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_BACKEND_H */
