/* gpumem: a caching GPU memory allocator.
 *
 * This is the whole public API. Handles are opaque; every operation that can
 * fail returns a gpumem_status_t and leaves a detailed, thread-local message
 * readable with gpumem_last_error(). Nothing here aborts the process.
 *
 * One gpumem_t manages the memory of one device through a backend (see
 * gpumem_backend.h): the simulated device (gpumem_sim_create) or CUDA.
 * All functions taking a gpumem_t are thread-safe. */
#ifndef GPUMEM_H
#define GPUMEM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t, in the PyTorch binding */

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define GPUMEM_API
#else
#define GPUMEM_API __attribute__((visibility("default")))
#endif

#define GPUMEM_VERSION_MAJOR 0
#define GPUMEM_VERSION_MINOR 1
/* GPUMEM_VERSION_MAJOR * 1000 + GPUMEM_VERSION_MINOR, as gpumem_version()
 * returns it: bindings loading the library at run time compare the two. */
#define GPUMEM_VERSION (GPUMEM_VERSION_MAJOR * 1000 + GPUMEM_VERSION_MINOR)

typedef struct gpumem gpumem_t;
typedef struct gpumem_backend gpumem_backend_t;

/* A stream handle: the CUstream / cudaStream_t value (0 is the default
 * stream). On the simulated device any value names a stream. */
typedef uintptr_t gpumem_stream_t;

typedef enum gpumem_status {
  GPUMEM_OK = 0,
  GPUMEM_ERR_INVALID_ARGUMENT = 1, /* bad size, NULL out pointer, bad option */
  GPUMEM_ERR_INVALID_POINTER = 2,  /* never allocated, already freed, interior */
  GPUMEM_ERR_OUT_OF_MEMORY = 3,    /* device full or limit reached, after retries */
  GPUMEM_ERR_BACKEND = 4,          /* the device failed for another reason */
  GPUMEM_ERR_CONFIG = 5,           /* malformed configuration string */
  GPUMEM_ERR_HOST_MEMORY = 6,      /* malloc of host bookkeeping failed */
  GPUMEM_ERR_UNSUPPORTED = 7,      /* the backend lacks what this needs */
  GPUMEM_NOT_READY = 8,            /* backend event query: work still pending */
  GPUMEM_ERR_IO = 9,               /* file could not be read or parsed */
} gpumem_status_t;

/* GPUMEM_VERSION of the library actually loaded (which may differ from the
 * header a program was compiled with). */
GPUMEM_API int gpumem_version(void);
/* Short fixed text for a status. */
GPUMEM_API const char* gpumem_strerror(gpumem_status_t status);
/* Detail of the last failure on this thread (the OOM report, the bad key...);
 * "" when none. Valid until the next failing gpumem function on this thread. */
GPUMEM_API const char* gpumem_last_error(void);
/* Replaces this thread's detail message (printf format); for backends. */
GPUMEM_API void gpumem_set_last_error(const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/* ---- options ---------------------------------------------------------- */

typedef enum gpumem_policy {
  /* The project's own policy (defragmenting on virtual memory when the
   * backend has it). */
  GPUMEM_POLICY_DEFAULT = 0,
  /* PyTorch's native caching allocator rules, reproduced exactly. */
  GPUMEM_POLICY_PYTORCH = 1,
} gpumem_policy_t;

/* When free pages under holes are unmapped and moved where they are
 * needed (default policy). docs/design.md has the measured trade-offs. */
typedef enum gpumem_reclaim {
  /* Reclaim free pages whenever memory would otherwise grow past the
   * high-water mark of allocated bytes plus headroom (the default):
   * reserved memory stays within ~0.5% of live bytes, at the price of
   * moving pages (device calls and stream synchronizations) while the
   * layout changes; with planned placement a repeating loop moves none. */
  GPUMEM_RECLAIM_LAZY = 0,
  /* Unmap every whole free page as soon as it becomes free. */
  GPUMEM_RECLAIM_EAGER = 1,
  /* Reclaim only when the device or the limit refuses: no device calls
   * on the warm path whatever the workload, and growth in large mappings
   * (map_max); reserved memory is the address space walked (1.004-1.15 x
   * live on the bundled traces), but under a limit jobs still fit in
   * ~0.5% over their live bytes. */
  GPUMEM_RECLAIM_PRESSURE = 2,
} gpumem_reclaim_t;

/* Where the default policy places blocks. */
typedef enum gpumem_placement {
  /* Online best fit in one arena per stream and pool. */
  GPUMEM_PLACEMENT_BESTFIT = 0,
  /* (the default) Best fit, plus: when the request sequence repeats a period (a training
   * step), one period is planned offline (lifetimes known) and later
   * periods are placed by the plan in a plan arena per stream; requests
   * off the plan fall back to best fit. */
  GPUMEM_PLACEMENT_PLANNED = 1,
  /* (the default) Planned while memory is capped (a limit, a fraction or a
   * shared budget: pages then move one at a time and a plan keeps a
   * repeating loop from moving them), best fit otherwise (nothing needs
   * the memory a plan would save, and growth comes in large mappings). */
  GPUMEM_PLACEMENT_AUTO = 2,
} gpumem_placement_t;

typedef struct gpumem_options {
  uint32_t struct_size; /* sizeof(gpumem_options_t), set by options_init */
  gpumem_policy_t policy;
  size_t limit_bytes;    /* hard cap on reserved memory; 0 = none */
  double limit_fraction; /* cap as a fraction of device total; 0 = none.
                          * With both set, the smaller cap holds. */
  gpumem_reclaim_t reclaim;
  /* Lazy reclaim lets reserved memory exceed the allocated high-water mark
   * by this fraction before it moves pages (default 0.02). */
  double headroom;
  /* PyTorch's max_split_size_mb: blocks at least this large are never
   * split for smaller requests; 0 = unlimited (the default). */
  size_t max_split_size;
  /* Default policy only; the pytorch policy always places by best fit. */
  gpumem_placement_t placement;
  /* Take ownership of the backend and destroy it with the allocator. */
  int own_backend;
  /* Default policy: the largest piece of physical memory created and
   * mapped in one go when an arena grows (rounded down to whole pages;
   * 0 or less than a page: one page). A run of unmapped pages under a new
   * block gets one physical allocation instead of one per page: on an H100
   * creating, mapping and granting access cost ~50 us per mapping whatever
   * its size. A mapping is reclaimed only whole, so large ones trade reclaim
   * granularity for growth speed: they are made only under
   * reclaim:pressure with best-fit placement and no limit, until the
   * device first refuses memory.
   * Default 1 GiB. */
  size_t map_max_bytes;
  /* Default policy, lazy reclaim: 1 (the default) lets the allocator stop
   * moving pages to hold memory at the high-water mark once pages keep
   * moving with no plan serving (more than one move per ten allocations
   * over three windows of 4,096 allocations in a row): from then on it
   * grows instead, as reclaim:pressure does, until empty_cache or a plan
   * that starts serving. Workloads whose sizes never repeat otherwise pay
   * a page move (an unmap, a map and an access grant, ~55 us on an H100)
   * every few allocations. Limits and device refusals still reclaim. 0
   * holds memory at the mark whatever it costs. */
  int move_guard;
  /* Default policy, lazy reclaim: what moving pages that nobody needs may
   * cost, in microseconds of mapping work (priced at an H100's measured
   * cost per call, docs/design.md) per allocation, with at most 2 ms of it
   * saved up. Moves for headroom beyond it wait, and memory grows instead
   * (num_moves_deferred). Moves that a limit, a shared budget or the device
   * asks for are never held back. Default 0 (no such moves); a negative value: no
   * budget (memory held at the mark whatever it costs). */
  double move_budget_us;
  /* Default policy, planned placement: 1 (the default) lets the streams of
   * a repeating step share one plan arena where separate arenas would hold
   * more than the step has live (streams that peak at different times).
   * Memory one stream frees is then reused by another after the allocator
   * makes the reusing stream wait on the device for an event of the one
   * that freed it (cuStreamWaitEvent; the host never waits), so work of
   * those streams is ordered where they pass memory on. 0: streams never
   * wait for each other; such a plan is declined and best fit serves
   * (pages then move between streams after host synchronizations). Needs
   * the backend's stream_wait slot. */
  int stream_waits;
  /* Default policy, lazy reclaim: 1 (the default) lets an arena that must
   * grow past the allocated high-water mark plus headroom take back first
   * the whole free pages the device is known to be done with: each stream
   * gets an event (a fence) recorded behind the pages that lay wholly free
   * at a growth, and a later growth queries it (the host never waits); the
   * pages still unused since then are unmapped and their memory given back
   * or mapped where it is needed (src/fence.c). 0: growth past the mark
   * creates new memory unless the move budget allows a move. Needs the
   * backend's event slots. */
  int fences;
  /* Whether other processes can read this allocator's figures (gpumem
   * top; src/publish.c): GPUMEM_PUBLISH_AUTO (the default: on over CUDA,
   * off on the simulated device), _ON or _OFF. */
  int publish;
  /* 1: report the allocations still live when the allocator is destroyed
   * (for gpumem_default's per-device instances: at process exit) on
   * stderr, as gpumem_print_leaks does (src/leaks.c). Default 0. */
  int leak_check;
  /* When an allocation fails for want of memory, write the allocator's
   * snapshot (gpumem_snapshot_json, with the history if recording) to this
   * path, "%p" replaced by the process id; the out-of-memory report names
   * the file. Empty (the default): no file. A later failure overwrites it. */
  char oom_snapshot[256];
  /* A cap on the reserved memory of every allocator, in any process on
   * this machine, that names the same budget (shared_name) on the same
   * device (src/budget.c); 0 (the default): none. Growing past it is
   * refused as the allocator's own limit is: it reclaims and empties its
   * cache first. Give every process the same value. */
  size_t shared_limit;
  /* The budget's name: letters, digits, '_', '-', '.' (empty: "default"). */
  char shared_name[40];
  /* A group whose members share the budget (docs/security.md): the budget
   * then lives in DIR/gpumem-group.<group>/, a directory of that group
   * closed to other users, mode 0660. Empty (the default): the budget is
   * this user's alone (mode 0600, its uid in the file's name). */
  char shared_group[40];
  /* Record every allocation, free and record_stream to this path as a
   * gzip trace (traces/README.md; src/record.c), "%p" the process id, "%d"
   * the device; gpumem_record_trace() does the same at run time. Empty
   * (the default): no recording. */
  char record[256];
  /* Default policy, no cap: a run of allocations made with no free between
   * them that walks past an arena's highest mapped page maps ahead of
   * itself, twice the block and at most this many bytes, so that the run's
   * next blocks need no mapping (src/alloc.c, tail_run_ahead). What a run
   * mapped and did not use when it stops (at most this much per arena)
   * stays reserved, and where a job's live peak is the end of such a run
   * (weights loaded, then converted) it is part of the peak. 0: nothing
   * ahead, one mapping per block. Default 128 MiB. */
  size_t map_ahead_bytes;
  /* Default policy, no cap: GPUMEM_LEND_ON lets a large request of one
   * stream whose arena would have to grow take a free block of another
   * stream's arena whose pages are mapped, once an event recorded on that
   * stream after its last free is seen complete (queried, never waited
   * for; src/alloc.c, borrow_mapped). The block is used on the borrower as
   * after record_stream. GPUMEM_LEND_ORDERED lends as well where that
   * event is not complete yet: the borrower's later work waits on the
   * device for the lender's work so far (a stream wait, as cudaMallocAsync
   * orders its reuse across streams; the host never waits), and a lent
   * block the borrower frees is free at once, the borrower's to take again
   * in its stream order, the lender waiting for the borrower on the device
   * before it uses its free memory again. Streams that ran side by side
   * are ordered where memory passes between them. Needs the backend's
   * stream_wait slot and stream_waits on; without them it lends as
   * GPUMEM_LEND_ON. GPUMEM_LEND_OFF (0): each stream's arena holds its
   * own peak. Lending needs the backend's event slots. */
  int lend;
  /* Default policy: 1 (the default) serves requests of up to 1 MiB from
   * arenas of their own, as PyTorch's small pool; 0 serves every request
   * from the large arenas, as cudaMallocAsync's one pool, where small
   * blocks fill the room that large blocks leave (src/alloc.c,
   * pool_index). */
  int small_pool;
  /* Default policy, virtual memory: GPUMEM_OVERFLOW_HOST lets a request
   * that device memory or the limit cannot serve be backed by host pages
   * mapped under an address range of the allocator's own (src/overflow.c):
   * kernels reach them over the host link, the address never changes, and
   * the block moves to device pages once there is room and its streams are
   * idle. Cold blocks already in the tier move to host first. Out of memory
   * only when the host budget is spent too. GPUMEM_OVERFLOW_OFF (0, the
   * default): nothing of this. */
  int overflow;
  /* Host bytes the tier may hold at most; 0 (the default): as much as the
   * host grants. Option overflow:host:SIZE. */
  size_t overflow_host_bytes;
} gpumem_options_t;

enum { GPUMEM_OVERFLOW_OFF = 0, GPUMEM_OVERFLOW_HOST = 1 };

enum { GPUMEM_PUBLISH_AUTO = 0, GPUMEM_PUBLISH_ON = 1, GPUMEM_PUBLISH_OFF = 2 };
enum { GPUMEM_LEND_OFF = 0, GPUMEM_LEND_ON = 1, GPUMEM_LEND_ORDERED = 2 };

/* Fills defaults (policy default with auto placement and lazy reclaim
 * with no move budget (moves only when needed), headroom 0.02, no limit,
 * map_max 1 GiB, map_ahead 128 MiB, move_guard on, stream_waits on, fences
 * on, lend off, small_pool on, publish auto, leak_check off, no oom_snapshot). */
GPUMEM_API void gpumem_options_init(gpumem_options_t* opts);
/* Applies a configuration string "key:value,key:value" (the grammar of
 * PYTORCH_CUDA_ALLOC_CONF) over opts. Keys: policy (default|pytorch),
 * limit (bytes with optional K/M/G/T suffix, binary), fraction (0..1],
 * reclaim (lazy|eager|pressure), headroom (0..1), max_split_size_mb,
 * placement (auto|planned|bestfit), map_max (a size, as limit), map_ahead
 * (a size, or off), move_guard
 * (on|off), fences (on|off), move_budget (microseconds per allocation, >= 0, or unlimited),
 * stream_waits (on|off), lend (off|on|ordered), small_pool (on|off), publish (auto|on|off),
 * leak_check (on|off), oom_snapshot (a path without ','), shared_limit (a size), shared_name (a
 * name), shared_group (a group's name), record (a path without ','), overflow (off|host|host:SIZE).
 * Unknown keys and bad values
 * fail with GPUMEM_ERR_CONFIG naming the key and the valid choices; opts is unchanged on failure.
 */
GPUMEM_API gpumem_status_t gpumem_options_parse(gpumem_options_t* opts, const char* conf);
/* Parses "123", "4K", "1.5G", "2GiB" (binary units). */
GPUMEM_API gpumem_status_t gpumem_parse_size(const char* text, size_t* out);

/* ---- lifetime --------------------------------------------------------- */

/* Creates an allocator over backend. opts may be NULL (defaults). On
 * failure returns NULL and sets *err (if err is not NULL). */
GPUMEM_API gpumem_t* gpumem_create(gpumem_backend_t* backend, const gpumem_options_t* opts,
                                   gpumem_status_t* err);
/* Frees all device memory the allocator holds (live blocks included) and
 * the allocator. Safe on NULL. */
GPUMEM_API void gpumem_destroy(gpumem_t* gm);
/* The per-device default instance, created on first use over the CUDA
 * backend and configured from the environment variable GPUMEM_CONF. NULL
 * with gpumem_last_error() set when it cannot be created. */
GPUMEM_API gpumem_t* gpumem_default(int device);

/* ---- allocation ------------------------------------------------------- */

/* Allocates size bytes usable on stream. size 0 yields *out == NULL and
 * GPUMEM_OK (as cudaMalloc(0) does). */
GPUMEM_API gpumem_status_t gpumem_malloc(gpumem_t* gm, size_t size, gpumem_stream_t stream,
                                         void** out);
/* Frees a pointer returned by gpumem_malloc. NULL is a no-op. */
GPUMEM_API gpumem_status_t gpumem_free(gpumem_t* gm, void* ptr);
/* Marks ptr as used on stream: when freed, its memory is reused only after
 * the work queued on stream up to the free has completed. */
GPUMEM_API gpumem_status_t gpumem_record_stream(gpumem_t* gm, void* ptr, gpumem_stream_t stream);
/* Hint (option overflow:host): the allocation at ptr is cold, and host
 * pages suit it. A block in the overflow tier, or the whole pages inside
 * a block of an arena, move to host pages now if its streams are idle
 * (else at the next pressure, before any other), and stay there until it
 * is freed. GPUMEM_ERR_UNSUPPORTED when the tier is off or the block lies
 * in an arena and owns no whole page there that may move (its edge pages
 * are its neighbours' too; docs/design.md, "The overflow tier"). */
GPUMEM_API gpumem_status_t gpumem_prefer_host(gpumem_t* gm, void* ptr);

/* ---- sharing an allocation with another process (CUDA IPC) ----
 * The physical pages under an allocation are exported as file descriptors
 * that another process takes with pidfd_getfd (Linux 5.6; the same user and
 * the right to trace this process) and maps at addresses of its own. Needs
 * the default policy on a backend with export_page/import_page (CUDA);
 * GPUMEM_ERR_UNSUPPORTED otherwise. */

/* Writes a handle (text, NUL-terminated) for the live allocation that
 * starts at ptr into out when it fits in cap bytes; *needed gets its size
 * with the NUL either way (a call with a shorter buffer exports nothing;
 * each call that writes makes new descriptors). The descriptors stay open
 * until the allocation is freed. */
GPUMEM_API gpumem_status_t gpumem_ipc_export(gpumem_t* gm, void* ptr, char* out, size_t cap,
                                             size_t* needed);
/* Maps the allocation another process exported as handle (len bytes, the
 * NUL not counted) and sets *out to it here; every field of the handle is
 * checked (GPUMEM_ERR_INVALID_ARGUMENT naming the bad one). Close with
 * gpumem_ipc_close. It does not count in this allocator's statistics: the memory is the
 * other process's. */
GPUMEM_API gpumem_status_t gpumem_ipc_open(gpumem_t* gm, const char* handle, size_t len,
                                           void** out);
/* Unmaps what gpumem_ipc_open mapped at ptr. */
GPUMEM_API gpumem_status_t gpumem_ipc_close(gpumem_t* gm, void* ptr);
/* Returns every cached, unused page or segment to the device. */
GPUMEM_API gpumem_status_t gpumem_empty_cache(gpumem_t* gm);
/* The size requested for the live allocation that starts at ptr, or 0 when
 * ptr does not start one (interior pointers included). */
GPUMEM_API size_t gpumem_allocation_size(gpumem_t* gm, const void* ptr);

/* ---- limits ----------------------------------------------------------- */

/* Caps reserved memory at bytes (> 0: a limit of 0 would refuse every
 * allocation and is rejected). Memory already held above the new cap is
 * released from the cache where possible. */
GPUMEM_API gpumem_status_t gpumem_set_limit(gpumem_t* gm, size_t bytes);
/* Caps reserved memory at fraction (0, 1] of the device's total memory
 * (torch.cuda.set_per_process_memory_fraction). */
GPUMEM_API gpumem_status_t gpumem_set_limit_fraction(gpumem_t* gm, double fraction);
/* Removes the cap. */
GPUMEM_API void gpumem_remove_limit(gpumem_t* gm);
/* The cap in bytes, 0 when none. */
GPUMEM_API size_t gpumem_get_limit(gpumem_t* gm);

/* Called, without the allocator's lock held, when an allocation fails
 * after the cache was emptied: free what you can and return nonzero to
 * ask for one more try. */
typedef int (*gpumem_oom_callback_t)(gpumem_t* gm, size_t size, gpumem_stream_t stream, void* arg);
GPUMEM_API gpumem_status_t gpumem_add_oom_callback(gpumem_t* gm, gpumem_oom_callback_t fn,
                                                   void* arg);

/* ---- statistics ------------------------------------------------------- */

/* Statistic arrays, PyTorch's names: each has all/small/large pools and
 * current/peak/allocated/freed. One list drives the struct, the summary
 * table and the JSON. */
#define GPUMEM_STAT_ARRAYS(X)                         \
  X(allocation, "Allocations", 0)                     \
  X(segment, "GPU reserved segments", 0)              \
  X(active, "Active allocs", 0)                       \
  X(inactive_split, "Non-releasable allocs", 0)       \
  X(allocated_bytes, "Allocated memory", 1)           \
  X(reserved_bytes, "GPU reserved memory", 1)         \
  X(active_bytes, "Active memory", 1)                 \
  X(inactive_split_bytes, "Non-releasable memory", 1) \
  X(requested_bytes, "Requested memory", 1)           \
  X(host_bytes, "Host-backed memory", 1)              \
  X(host_cached_bytes, "Host memory kept", 1)

/* Plain counters: PyTorch's and gpumem's own. */
#define GPUMEM_STAT_COUNTERS(X)                                        \
  X(num_alloc_retries, "cudaMalloc retries")                           \
  X(num_ooms, "CUDA OOMs")                                             \
  X(num_sync_all_streams, "Synchronizations of all streams")           \
  X(num_device_alloc, "Device allocations")                            \
  X(num_device_free, "Device frees")                                   \
  X(num_syncs, "Stream or event synchronizations")                     \
  X(num_pages_mapped, "Pages mapped")                                  \
  X(num_pages_unmapped, "Pages unmapped")                              \
  X(num_reclaims, "Page reclaim passes")                               \
  X(num_oom_callbacks, "OOM callbacks called")                         \
  X(num_plans, "Placement plans built")                                \
  X(num_plan_drops, "Placement plans dropped")                         \
  X(num_planned_allocs, "Allocations placed by a plan")                \
  X(num_pages_revived, "Pages moved back to a ghost mapping")          \
  X(num_pages_aliased, "Partly used pages shared by a request")        \
  X(num_move_guard_trips, "Move guard trips (grew instead of moving)") \
  X(num_plans_declined, "Plans declined (streams peak apart)")         \
  X(num_plans_shared, "Plans whose streams share one arena")           \
  X(num_moves_deferred, "Moves over the move budget (grew instead)")   \
  X(num_pages_fenced, "Free pages taken back behind a fence")          \
  X(num_blocks_lent, "Blocks lent to another stream")                  \
  X(move_work_us, "Mapping work spent moving pages (us, priced)")      \
  X(mapping_time_ns, "Time in mapping calls (ns, measured)")           \
  X(num_host_allocs, "Allocations served from host pages")             \
  X(num_host_pages_reused, "Host allocations reused (none pinned)")    \
  X(num_moves_to_host, "Blocks moved to host pages")                   \
  X(bytes_moved_to_host, "Bytes moved to host pages")                  \
  X(move_to_host_ns, "Time moving blocks to host (ns, measured)")      \
  X(num_moves_to_device, "Blocks moved back to device pages")          \
  X(bytes_moved_to_device, "Bytes moved back to device pages")         \
  X(move_to_device_ns, "Time moving blocks to device (ns, measured)")  \
  X(host_link_model_us, "Host link traffic at the model's rate (us)")

/* Backend primitives, each use counted by the allocator. */
#define GPUMEM_BACKEND_CALLS(X) \
  X(reserve)                    \
  X(release_range)              \
  X(create_page)                \
  X(release_page)               \
  X(map)                        \
  X(unmap)                      \
  X(alloc)                      \
  X(free)                       \
  X(mem_info)                   \
  X(event_create)               \
  X(event_destroy)              \
  X(event_record)               \
  X(event_query)                \
  X(event_sync)                 \
  X(stream_sync)                \
  X(device_sync)                \
  X(stream_wait)                \
  X(create_host_page)           \
  X(copy)

typedef enum gpumem_backend_call {
#define GPUMEM_X_CALL_ENUM(name) GPUMEM_CALL_##name,
  GPUMEM_BACKEND_CALLS(GPUMEM_X_CALL_ENUM)
#undef GPUMEM_X_CALL_ENUM
      GPUMEM_CALL_COUNT
} gpumem_backend_call_t;

/* Name of a backend call kind ("map", "alloc", ...), NULL if out of range. */
GPUMEM_API const char* gpumem_backend_call_name(int call);

enum { GPUMEM_POOL_ALL = 0, GPUMEM_POOL_SMALL = 1, GPUMEM_POOL_LARGE = 2, GPUMEM_POOL_COUNT = 3 };

typedef struct gpumem_stat {
  int64_t current;
  int64_t peak;
  int64_t allocated; /* total increments */
  int64_t freed;     /* total decrements */
} gpumem_stat_t;

typedef struct gpumem_stats {
  uint32_t struct_size; /* set by gpumem_get_stats */
#define GPUMEM_X_STAT_ARRAY(name, title, is_bytes) gpumem_stat_t name[GPUMEM_POOL_COUNT];
  GPUMEM_STAT_ARRAYS(GPUMEM_X_STAT_ARRAY)
#undef GPUMEM_X_STAT_ARRAY
#define GPUMEM_X_STAT_COUNTER(name, title) int64_t name;
  GPUMEM_STAT_COUNTERS(GPUMEM_X_STAT_COUNTER)
#undef GPUMEM_X_STAT_COUNTER
  uint64_t backend_calls[GPUMEM_CALL_COUNT];
  /* What PyTorch lacks. */
  uint64_t largest_free_block; /* largest cached block, bytes */
  uint64_t cached_free_bytes;  /* reserved but not active */
  /* 1 - largest_free_block / cached_free_bytes: 0 when the cache is one
   * block (or empty), near 1 when it is dust. */
  double fragmentation;
  uint64_t limit_bytes;  /* 0 = none */
  uint64_t device_total; /* from the backend */
  uint64_t device_free;
  uint64_t page_size;
  int policy;
  int virtual_memory; /* 1 when blocks live on reserved ranges with pages */
  /* PyTorch's max_split_size: option max_split_size_mb in bytes, -1 when
   * unset (PyTorch's SIZE_MAX read as a signed number). */
  int64_t max_split_size;
} gpumem_stats_t;

/* Snapshot of all statistics. */
GPUMEM_API void gpumem_get_stats(gpumem_t* gm, gpumem_stats_t* out);
/* Resets peaks to current values (torch.cuda.reset_peak_memory_stats). */
GPUMEM_API void gpumem_reset_peak_stats(gpumem_t* gm);
/* Resets the allocated/freed totals and counters (reset_accumulated...). */
GPUMEM_API void gpumem_reset_accumulated_stats(gpumem_t* gm);

/* Output sink: receives text pieces; returns 0 to continue. */
typedef int (*gpumem_write_fn)(const char* text, size_t len, void* arg);

/* Prints the table torch.cuda.memory_summary() prints, plus gpumem's own
 * figures. Returns 0, or the sink's nonzero value. */
GPUMEM_API int gpumem_print_summary(gpumem_t* gm, gpumem_write_fn write, void* arg);
/* Same data as one JSON object. */
GPUMEM_API int gpumem_print_stats_json(gpumem_t* gm, gpumem_write_fn write, void* arg);
/* Formatting from a stats snapshot (no allocator needed). */
GPUMEM_API int gpumem_format_summary(const gpumem_stats_t* stats, gpumem_write_fn write, void* arg);
/* Flags of gpumem_format_summary_flags. ABBREVIATED: each metric's total
 * row alone, without its "from large pool"/"from small pool" rows, as
 * torch.cuda.memory_summary(abbreviated=True) prints it. */
enum { GPUMEM_SUMMARY_ABBREVIATED = 1 };
/* gpumem_format_summary with flags (GPUMEM_SUMMARY_*; 0: the same table).
 * Unknown flags are refused (GPUMEM_ERR_INVALID_ARGUMENT). */
GPUMEM_API int gpumem_format_summary_flags(const gpumem_stats_t* stats, int flags,
                                           gpumem_write_fn write, void* arg);
GPUMEM_API int gpumem_format_stats_json(const gpumem_stats_t* stats, gpumem_write_fn write,
                                        void* arg);
/* A gpumem_write_fn that writes to a FILE* given as arg. */
GPUMEM_API int gpumem_write_to_file(const char* text, size_t len, void* file);

/* ---- where reserved memory sits --------------------------------------- */

/* A breakdown of reserved memory at this moment: every reserved byte is in
 * exactly one field, so the fields add up to `reserved`. */
typedef struct gpumem_explain {
  uint32_t struct_size;
  uint64_t reserved;
  uint64_t requested;     /* what live allocations asked for */
  uint64_t rounding;      /* allocated minus requested: 512 B rounding, unsplit tails */
  uint64_t other_streams; /* freed, waiting for work on other streams (record_stream) */
  /* Free bytes in pages (or segments) that also hold live blocks: the
   * edges of holes, where a page cannot be reclaimed. */
  uint64_t partial_pages_large;
  uint64_t partial_pages_small; /* the same, in small-pool pages */
  /* Free bytes the cache could give back now: whole free pages still
   * mapped in mappings of their own, whole free segments (pytorch
   * policy). */
  uint64_t cached_reclaimable;
  uint64_t spare_pages; /* physical pages held, unmapped */
  size_t live_blocks;
  size_t free_blocks;
  /* Whole free pages still mapped whose mapping (one physical allocation,
   * unmapped only whole) also lies under live blocks: they go back only
   * with those blocks, or by moving the blocks' bytes. */
  uint64_t cached_pinned;
} gpumem_explain_t;

/* Fills out with where reserved memory sits now. */
GPUMEM_API gpumem_status_t gpumem_explain(gpumem_t* gm, gpumem_explain_t* out);

/* ---- history and snapshots (src/history.c) ---------------------------- */

/* Starts recording the allocator's last max_entries events (allocations,
 * frees requested and completed, out-of-memory failures), as
 * torch.cuda.memory._record_memory_history does; 0 stops recording and
 * forgets them. Calling it again starts over. GPUMEM_ERR_HOST_MEMORY when
 * the ring cannot be made (recording stays as it was). */
GPUMEM_API gpumem_status_t gpumem_record_history(gpumem_t* gm, size_t max_entries);
/* Events recorded and allocations made from now on carry tag (0: none):
 * the snapshot shows a tagged event or live block with one frame {file,
 * line = tag}, and leak reports name the tags of what they list (a
 * training step, a layer, a trace's line number). */
GPUMEM_API void gpumem_set_history_tag(gpumem_t* gm, uint64_t tag);
/* Records every allocation, free and record_stream from now on to path as
 * a gzip trace that `gpumem replay` and `gpumem fit` read ("%p": the process
 * id, "%d": the device); NULL stops and finishes the file. GPUMEM_ERR_IO
 * when path cannot be written. */
GPUMEM_API gpumem_status_t gpumem_record_trace(gpumem_t* gm, const char* path);
/* Marks the end of a training step in the recorded trace (a "# step N"
 * line); nothing when not recording. */
GPUMEM_API void gpumem_record_step(gpumem_t* gm);
/* Writes every segment with the blocks that tile it, and the recorded
 * events, as one JSON object shaped like torch.cuda.memory._snapshot()'s
 * dict ("segments", "device_traces"; PyTorch's memory_viz opens it once
 * loaded and pickled), plus a "gpumem" member with what PyTorch's shape
 * has no room for. Under virtual memory a segment is one run of mapped
 * pages of an address range (is_expandable): the segments add up to the
 * reserved bytes less the spare pages (held, not mapped), plus the host
 * pages under arena blocks (overflow:host), which lie in their blocks'
 * segments so that every block is whole in one. device: the
 * index the events are filed under; tag_file: the file name of tagged
 * frames (NULL: "gpumem tag"). Returns 0, or the sink's nonzero value. */
GPUMEM_API int gpumem_snapshot_json(gpumem_t* gm, int device, const char* tag_file,
                                    gpumem_write_fn write, void* arg);

/* ---- leak detection (src/leaks.c) ------------------------------------ */

/* The number of allocations made so far (never reset): a mark. Every
 * allocation gets the next number (its serial, from 1); the live ones made
 * after a mark are what the work since the mark kept. */
GPUMEM_API uint64_t gpumem_leak_mark(gpumem_t* gm);

typedef struct gpumem_leaks {
  uint32_t struct_size;
  uint64_t since;           /* the mark */
  uint64_t made;            /* allocations made so far */
  uint64_t count;           /* live allocations made after the mark */
  uint64_t bytes;           /* their allocated bytes */
  uint64_t requested_bytes; /* what they asked for */
  uint64_t groups;          /* distinct (requested size, stream) among them */
  uint64_t oldest, newest;  /* their lowest and highest serials (0: none) */
} gpumem_leaks_t;

/* Counts the live allocations made after mark since (0: every live one). */
GPUMEM_API gpumem_status_t gpumem_find_leaks(gpumem_t* gm, uint64_t since, gpumem_leaks_t* out);
/* The same as a report: groups of one requested size on one stream, most
 * bytes first, each with its count, serials, tags (gpumem_set_history_tag
 * when they were made) and an address. Returns 0, the sink's nonzero
 * value, or a gpumem_status_t. */
GPUMEM_API int gpumem_print_leaks(gpumem_t* gm, uint64_t since, gpumem_write_fn write, void* arg);
/* The same as one JSON object: since, made, count, bytes, requested_bytes,
 * oldest, newest and "groups" (requested, stream, count, bytes,
 * requested_bytes, first, last, first_tag, last_tag, addresses: up to 4,
 * oldest first). */
GPUMEM_API int gpumem_print_leaks_json(gpumem_t* gm, uint64_t since, gpumem_write_fn write,
                                       void* arg);

/* With the option leak_check on: reports now, on stderr, the allocations
 * gm still holds, as gpumem_destroy (and the exit of a process, for the
 * per-device instances) would, and not again at destroy or exit; when
 * names the moment ("at exit"). For hosts whose own teardown frees memory
 * before the process exits: Python frees the tensors module globals hold
 * during finalization, before C's exit handlers run. Does nothing with the
 * option off. */
GPUMEM_API void gpumem_leak_check_now(gpumem_t* gm, const char* when);

/* ---- shared budgets (src/budget.c) ------------------------------------ */

typedef struct gpumem_shared_budget {
  uint32_t struct_size;
  uint64_t limit; /* this allocator's shared_limit */
  uint64_t total; /* held by every allocator in the budget */
  uint64_t mine;  /* held by this one */
  int allocators; /* slots in use, processes that exited uncleanly included */
  char path[300]; /* the budget's file */
} gpumem_shared_budget_t;

/* The budget gm belongs to (option shared_limit), as it stands now.
 * GPUMEM_ERR_UNSUPPORTED when gm has none. */
GPUMEM_API gpumem_status_t gpumem_shared_budget(gpumem_t* gm, gpumem_shared_budget_t* out);

/* ---- publication: figures other processes read (src/publish.c) -------- */

/* One published allocator, as gpumem_published_scan reads it. */
typedef struct gpumem_published {
  uint32_t struct_size;
  int pid;
  int device; /* -1 when the allocator was not made by gpumem_default */
  unsigned instance;
  int alive; /* the process still runs */
  int virtual_memory;
  char process[32]; /* the process's name (/proc/self/comm) */
  char policy[16];
  uint64_t started_unix_ms, updated_unix_ms;
  int64_t allocated_bytes, allocated_peak;
  int64_t reserved_bytes, reserved_peak;
  int64_t active_bytes, requested_bytes;
  int64_t limit_bytes, device_total;
  int64_t num_allocations, num_ooms, num_alloc_retries;
  char path[256]; /* the file it was read from */
  unsigned uid;   /* the file's owner (a reader trusts its own files; root all) */
  /* The overflow tier (option overflow:host): bytes on host pages now, and
   * blocks moved to host and back so far. */
  int64_t host_bytes, num_moves_to_host, num_moves_to_device;
} gpumem_published_t;

/* Returns nonzero to stop the scan. */
typedef int (*gpumem_published_fn)(const gpumem_published_t* p, void* arg);

/* Publishes gm's figures now (they are also published every 64
 * operations, whenever reserved memory changes, after an out-of-memory
 * failure, empty_cache and a new limit). GPUMEM_ERR_UNSUPPORTED when
 * publication is off (option publish) or its file could not be made. */
GPUMEM_API gpumem_status_t gpumem_publish(gpumem_t* gm);
/* Calls fn for every allocator published in dir (NULL: $GPUMEM_PUBLISH_DIR
 * or /dev/shm), live processes and files left by dead ones alike: regular
 * files of this user (root: of any user), never links, FIFOs or pages of
 * another layout (docs/security.md). Returns
 * how many were read, or -1 (gpumem_last_error) when dir cannot be read. */
GPUMEM_API int gpumem_published_scan(const char* dir, gpumem_published_fn fn, void* arg);

/* ---- graph-private pools (src/graphpool.c) ----------------------------- */

/* CUDA graphs and torch.cuda.MemPool. While a pool is routed to, the
 * allocations made on the streams it takes come from memory private to the
 * pool (pool_id: any nonzero number the caller chooses): blocks freed there
 * stay reserved for the pool until it is released, so a captured graph
 * finds its memory at the same addresses at every replay; page reclaim,
 * plans and aliases never move or share a page under a private pool. A
 * pool is made at its first retain or begin (use count 1) and its memory
 * goes back to the device when its use count falls to 0 and its last
 * allocation is freed. While any pool is routed to, a capture may be
 * underway: the allocator then makes no synchronization and no event query
 * on a stream the backend reports capturing, and frees that would record
 * events on other streams wait until no stream captures. */
typedef int (*gpumem_stream_filter_fn)(gpumem_stream_t stream, void* arg);
/* Makes the pool if it does not exist, else adds one to its use count (a
 * torch.cuda.MemPool's creation). */
GPUMEM_API gpumem_status_t gpumem_retain_pool(gpumem_t* gm, uint64_t pool_id);
/* Retains the pool and routes to it the allocations on streams filter
 * accepts (filter NULL: every stream). One routing per pool at a time. */
GPUMEM_API gpumem_status_t gpumem_begin_allocate_to_pool(gpumem_t* gm, uint64_t pool_id,
                                                         gpumem_stream_filter_fn filter, void* arg);
/* The same for the streams the backend reports capturing under capture_id
 * (stream_capture_info; GPUMEM_ERR_UNSUPPORTED without that slot). */
GPUMEM_API gpumem_status_t gpumem_begin_allocate_to_pool_capture(gpumem_t* gm, uint64_t pool_id,
                                                                 uint64_t capture_id);
/* Stops routing to the pool (its memory stays private to it). */
GPUMEM_API gpumem_status_t gpumem_end_allocate_to_pool(gpumem_t* gm, uint64_t pool_id);
/* Takes one from the pool's use count; at 0 its cached memory goes back to
 * the device, and the rest as its last allocations are freed. */
GPUMEM_API gpumem_status_t gpumem_release_pool(gpumem_t* gm, uint64_t pool_id);

/* torch.cuda.MemPool(use_on_oom=True): a request outside every pool that
 * finds no memory after the whole retry ladder may take a cached block of
 * this pool on the same stream, before out of memory is reported. Only
 * memory the pool holds already, never new pages; the block stays the
 * pool's and goes back to it when freed. Off again with on = 0. */
GPUMEM_API gpumem_status_t gpumem_pool_set_use_on_oom(gpumem_t* gm, uint64_t pool_id, int on);
/* torch.cuda.MemPool(no_split=True): from now on the pool never splits a
 * block: each allocation it serves is a cached block of the pool handed
 * out whole, or a new segment of its own (an arena of whole pages; under
 * the pytorch policy, PyTorch's segment size), as libraries that register
 * each allocation's segment on its own need (NCCL's buffer registration).
 * Blocks split before stay as they are. */
GPUMEM_API gpumem_status_t gpumem_pool_set_no_split(gpumem_t* gm, uint64_t pool_id, int on);

/* torch.cuda.MemPool(allocator=...): the pool's segments come from the
 * caller's allocator (an ncclMemAlloc, say) instead of the device's
 * memory. Blocks inside them are still cached, split and reused by
 * PyTorch's rules: segments of PyTorch's sizes (2 MiB for requests up to
 * 1 MiB, 20 MiB below 10 MiB, else the request rounded up to 2 MiB), plain
 * ones even under the default policy (never page-mapped, never moved),
 * counted as reserved memory and under the limit and the shared budget
 * like any segment. They go back through free when the pool is released
 * and holds no live block, or at gpumem_destroy. The stream passed to
 * alloc and free is the one the pool serves the request on. alloc, free
 * and release may be called with the allocator's lock held: none of them
 * may call into this allocator. */
typedef struct gpumem_segment_source {
  /* size bytes of device memory at *out_addr (512-byte aligned), or a
   * failure status (GPUMEM_ERR_OUT_OF_MEMORY when it has none). */
  gpumem_status_t (*alloc)(void* ctx, size_t size, gpumem_stream_t stream, uintptr_t* out_addr);
  /* Takes back, whole, what alloc returned. */
  void (*free)(void* ctx, uintptr_t addr, size_t size, gpumem_stream_t stream);
  /* (optional) ctx is used no more: called once, after the pool's last
   * segment went back and the pool itself goes (or at gpumem_destroy, or
   * when a later call replaces or clears the source). */
  void (*release)(void* ctx);
  void* ctx;
} gpumem_segment_source_t;
/* Sets pool_id's segment source (source NULL: the device's memory again).
 * On success *source is copied and the allocator owns ctx from then on;
 * on failure nothing is kept and release is not called. Refused
 * (GPUMEM_ERR_INVALID_ARGUMENT) for a pool that does not exist or was
 * released, a source without alloc or free, and a pool that holds memory
 * already: set it before the pool's first allocation. */
GPUMEM_API gpumem_status_t gpumem_pool_set_segment_source(gpumem_t* gm, uint64_t pool_id,
                                                          const gpumem_segment_source_t* source);

typedef struct gpumem_pool_info {
  uint32_t struct_size;
  int exists;
  int use_count;
  int routed;           /* allocations are being routed to it now */
  uint64_t allocations; /* live allocations (and frees waiting for streams) */
  uint64_t allocated_bytes;
  uint64_t reserved_bytes; /* mapped pages or segments held by the pool */
} gpumem_pool_info_t;
/* What pool_id holds now (exists 0 when there is no such pool). */
GPUMEM_API gpumem_status_t gpumem_pool_info(gpumem_t* gm, uint64_t pool_id,
                                            gpumem_pool_info_t* out);
/* Writes up to cap addresses of the pool's live allocations to ptrs and
 * returns how many it holds (torch's checkPoolLiveAllocations). */
GPUMEM_API size_t gpumem_pool_allocations(gpumem_t* gm, uint64_t pool_id, void** ptrs, size_t cap);

/* Checkpoints of a pool (torch.compile's CUDA graph trees: a tree records
 * graph after graph into one pool, and before it records a new branch it
 * puts the pool back as it was after the branch point's graph). A
 * checkpoint holds the pool's live allocations (address, size, requested
 * bytes) at one moment; frees waiting for other streams count as freed. */
typedef struct gpumem_pool_state gpumem_pool_state_t;
GPUMEM_API gpumem_status_t gpumem_pool_checkpoint(gpumem_t* gm, uint64_t pool_id,
                                                  gpumem_pool_state_t** out);
/* How many live allocations the checkpoint holds. */
GPUMEM_API size_t gpumem_pool_state_allocations(const gpumem_pool_state_t* state);
GPUMEM_API void gpumem_pool_state_free(gpumem_pool_state_t* state);
/* Puts pool_id back as state saw it: frees every allocation live in the
 * pool now (their addresses go to freed[0..*num_freed)), then makes each
 * of the checkpoint's allocations live again at its address (made[0..
 * *num_made), in the checkpoint's order). Refused during a capture, for a
 * checkpoint of another pool, and when freed_cap is below the pool's live
 * allocations or made_cap below the checkpoint's, before anything changes.
 * The pool's pages never moved, so the addresses are the memory the
 * graphs recorded. */
GPUMEM_API gpumem_status_t gpumem_pool_restore(gpumem_t* gm, uint64_t pool_id,
                                               const gpumem_pool_state_t* state, void** freed,
                                               size_t freed_cap, size_t* num_freed, void** made,
                                               size_t made_cap, size_t* num_made);

/* ---- checking --------------------------------------------------------- */

/* Verifies every invariant of the allocator's structures; returns the
 * number of violations (0 = consistent) and describes the first in
 * gpumem_last_error(). O(blocks): for tests, not the hot path. */
GPUMEM_API size_t gpumem_check(gpumem_t* gm);

/* ---- framework bindings (src/bindings.c) ------------------------------ */

/* Which allocator serves device's requests through these bindings; created
 * (gpumem_default) on first use. NULL with gpumem_last_error() on failure. */
GPUMEM_API gpumem_t* gpumem_binding_allocator(int device);
/* Like gpumem_binding_allocator, but never creates one: NULL when nothing
 * has been allocated on device through the bindings yet. */
GPUMEM_API gpumem_t* gpumem_binding_peek(int device);
/* Serves device from gm instead (NULL: back to gpumem_default). Refused
 * while the allocator serving device now has live allocations. gm is not
 * owned: keep it alive while it serves. */
GPUMEM_API gpumem_status_t gpumem_binding_set_allocator(int device, gpumem_t* gm);
/* gpumem_print_stats_json / gpumem_print_summary into buf (always
 * NUL-terminated when cap > 0). Returns the full length the text needs
 * (excluding the NUL): call again with a larger buffer when it is >= cap.
 * gm NULL formats all-zero statistics (an allocator that never ran). */
GPUMEM_API size_t gpumem_binding_stats_json(gpumem_t* gm, char* buf, size_t cap);
GPUMEM_API size_t gpumem_binding_summary(gpumem_t* gm, char* buf, size_t cap);
/* gpumem_binding_summary with gpumem_format_summary_flags' flags; 0 when
 * flags are unknown. */
GPUMEM_API size_t gpumem_binding_summary_flags(gpumem_t* gm, int flags, char* buf, size_t cap);
/* gpumem_snapshot_json into buf, the same way; 0 when gm is NULL or device
 * negative. The state may change between two calls: a caller that grows
 * its buffer calls again until the text fits. */
GPUMEM_API size_t gpumem_binding_snapshot_json(gpumem_t* gm, int device, const char* tag_file,
                                               char* buf, size_t cap);
/* gpumem_print_leaks_json (json nonzero) or gpumem_print_leaks into buf,
 * the same way; 0 when gm is NULL. */
GPUMEM_API size_t gpumem_binding_leaks(gpumem_t* gm, uint64_t since, int json, char* buf,
                                       size_t cap);

/* PyTorch CUDAPluggableAllocator: alloc_fn and free_fn. The stream is the
 * cudaStream_t, taken as void* so no CUDA header is needed. NULL on failure
 * (see gpumem_torch_last_oom). */
GPUMEM_API void* gpumem_torch_malloc(ssize_t size, int device, void* stream);
GPUMEM_API void gpumem_torch_free(void* ptr, ssize_t size, int device, void* stream);
/* The optional hooks: set_init_fn, set_reset_fn (torch.cuda.empty_cache),
 * set_memory_fraction_fn, set_base_alloc_fn and set_record_stream_fn. */
GPUMEM_API void gpumem_torch_init(int device_count);
GPUMEM_API void gpumem_torch_reset(void);
GPUMEM_API void gpumem_torch_set_memory_fraction(double fraction, int device);
GPUMEM_API void* gpumem_torch_base_alloc(void* ptr, size_t* size);
GPUMEM_API void gpumem_torch_record_stream(void* ptr, void* stream);
/* Empties the cache of device, or of every device served so far (-1). */
GPUMEM_API gpumem_status_t gpumem_torch_empty_cache(int device);
/* The report and status of the last failed allocation through these
 * bindings on this thread ("" and GPUMEM_OK when none). */
GPUMEM_API const char* gpumem_torch_last_oom(void);
GPUMEM_API int gpumem_torch_last_status(void);
/* A function that raises the caller's exception and does not return, given
 * torch's source location convention and the report. */
typedef void (*gpumem_torch_fail_fn)(const char* func, const char* file, uint32_t line,
                                     const char* msg);
/* Installs (or, with NULL, removes) the hook gpumem_torch_malloc calls
 * before it would return NULL. */
GPUMEM_API void gpumem_torch_set_fail_hook(gpumem_torch_fail_fn fn);
/* Out of memory under PyTorch: the report gpumem_torch_last_oom gives opens
 * with PyTorch's own sentences ("CUDA out of memory. Tried to allocate ...",
 * in the wording of the PyTorch version set here; 2.2 onward by default),
 * then gpumem's report. */
GPUMEM_API void gpumem_torch_set_version(int major, int minor);
/* What PyTorch's caching allocator would ask the device for at a request
 * of size bytes (the "Tried to allocate" figure of its message). */
GPUMEM_API uint64_t gpumem_torch_segment_size(uint64_t size);
/* Called once per out-of-memory failure of gpumem_torch_malloc, before it
 * returns, with no lock held: the arguments of the observers of
 * torch._C._cuda_attach_out_of_memory_observer (device, allocation size,
 * memory allowed, device free). NULL removes it. */
typedef void (*gpumem_torch_oom_observer_fn)(int64_t device, int64_t alloc_size, int64_t allowed,
                                             int64_t device_free);
GPUMEM_API void gpumem_torch_set_oom_observer(gpumem_torch_oom_observer_fn fn);
/* The largest allocation that needs no reclaim or device refusal: for
 * torch's cacheInfo (cuDNN's benchmark mode sizes workspaces by it). */
GPUMEM_API uint64_t gpumem_torch_largest_free(int device);
/* CUDA IPC for torch's shareIpcHandle / getIpcDevPtr: gpumem_ipc_export on
 * the allocator that holds ptr, gpumem_ipc_open / gpumem_ipc_close on
 * device's. Statuses as there. */
GPUMEM_API int gpumem_torch_ipc_export(void* ptr, char* out, size_t cap, size_t* needed);
GPUMEM_API int gpumem_torch_ipc_open(int device, const char* handle, size_t len, void** out);
GPUMEM_API int gpumem_torch_ipc_close(int device, void* ptr);

/* CuPy CFunctionAllocator: malloc and free. param is NULL (the device's
 * binding allocator) or the gpumem_t* to use. Allocations belong to stream
 * 0, the stream CuPy uses unless told otherwise. NULL on failure. */
GPUMEM_API void* gpumem_cupy_malloc(void* param, size_t size, int device);
GPUMEM_API void gpumem_cupy_free(void* param, void* ptr, int device);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_H */
