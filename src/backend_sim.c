/* The simulated device: a deterministic backend with no GPU behind it.
 *
 * It owns a fake device address space, capacity accounting, physical pages,
 * the mapping of pages into reserved ranges, plain allocations, events and
 * streams, per-call counters and scripted failures. By default no host memory
 * backs the device memory it hands out, so a 20 GiB workload replays on a
 * small machine; with host_backed every byte is real host memory that tests
 * reach through gpumem_sim_host_ptr().
 *
 * Its checks are strict on purpose (unknown handles, overlapping mappings,
 * partial unmaps, sizes that do not match): the device cannot be fooled, so the
 * allocator's bookkeeping bugs surface in tests rather than on a GPU.
 *
 * Fake address space (needs 64-bit uintptr_t; addresses are never
 * dereferenced, so they need not be valid host addresses):
 *   [SIM_PLAIN_BOTTOM, SIM_PLAIN_TOP)     plain allocations, bump-allocated
 *                                         downward from the top (or upward from
 *                                         the bottom when descending_addresses
 *                                         is 0), each aligned to page_size;
 *   [SIM_RESERVE_BASE, SIM_RESERVE_LIMIT) reserved ranges, bump-allocated
 *                                         upward, one guard page between two.
 * An address is never handed out twice while it is live: the bump cursors only
 * move one way (about 111 TiB of plain allocations over the device's life; the
 * plain cursor starts over only once it is exhausted and nothing is live). */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

_Static_assert(sizeof(uintptr_t) >= 8, "the simulated device needs a 64-bit address space");

#define SIM_PLAIN_BOTTOM ((uintptr_t)0x100000000000ull) /* 16 TiB */
#define SIM_PLAIN_TOP ((uintptr_t)0x7f0000000000ull)    /* 127 TiB, like cudaMalloc's */
#define SIM_RESERVE_BASE ((uintptr_t)0x800000000000ull) /* 128 TiB */
#define SIM_RESERVE_LIMIT ((uintptr_t)0x4000000000000000ull)
/* A reserved range keeps one slot pointer per page; capping the slots keeps
 * that array within reach of calloc (its untouched pages cost nothing). */
#define SIM_MAX_RANGE_PAGES ((size_t)1 << 27)
#define SIM_MIN_PAGE_SIZE ((size_t)512)
#define SIM_MAX_PAGE_SIZE GM_GIB

/* ---- small helpers ----------------------------------------------------- */

/* "12.34 MiB"; own copy so the sim builds without the stats code. */
static const char* sim_format_bytes(uint64_t bytes, char* buf, size_t len) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = (double)bytes;
  int unit = 0;
  while (value >= 1024.0 && unit < 6) {
    value /= 1024.0;
    unit++;
  }
  if (unit == 0) {
    snprintf(buf, len, "%llu B", (unsigned long long)bytes);
  } else {
    snprintf(buf, len, "%.2f %s", value, units[unit]);
  }
  return buf;
}

static bool is_power_of_two(size_t x) {
  return x != 0 && (x & (x - 1)) == 0;
}

/* ---- registry: objects keyed by a key that only grows ------------------
 *
 * Page and event handles are counters and plain addresses come from a bump
 * cursor, so objects are created in key order: appending keeps the array
 * sorted and lookups are binary searches. Removal leaves a hole (obj NULL)
 * that a later compaction squeezes out once holes outnumber live objects,
 * which keeps removal amortized O(1). Because keys are never reused, no two
 * entries (live or dead) overlap, which is what lets plain allocations be
 * found from an interior address. */
typedef struct sim_registry {
  uint64_t* keys;
  void** objs; /* NULL: removed */
  size_t len;
  size_t cap;
  size_t live;
} sim_registry_t;

static void registry_compact(sim_registry_t* reg) {
  size_t kept = 0;
  for (size_t i = 0; i < reg->len; i++) {
    if (reg->objs[i] == NULL) continue;
    reg->keys[kept] = reg->keys[i];
    reg->objs[kept] = reg->objs[i];
    kept++;
  }
  reg->len = kept;
}

static bool registry_append(sim_registry_t* reg, uint64_t key, void* obj) {
  if (reg->len == reg->cap && reg->len - reg->live > reg->len / 4) registry_compact(reg);
  if (reg->len == reg->cap) {
    size_t cap = reg->cap ? reg->cap * 2 : 64;
    uint64_t* keys = realloc(reg->keys, cap * sizeof *keys);
    if (keys == NULL) return false;
    reg->keys = keys;
    void** objs = realloc(reg->objs, cap * sizeof *objs);
    if (objs == NULL) return false;
    reg->objs = objs;
    reg->cap = cap;
  }
  reg->keys[reg->len] = key;
  reg->objs[reg->len] = obj;
  reg->len++;
  reg->live++;
  return true;
}

/* First index whose key is >= key (len when none). */
static size_t registry_lower_bound(const sim_registry_t* reg, uint64_t key) {
  size_t lo = 0, hi = reg->len;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (reg->keys[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/* Index of the live object with exactly this key, or SIZE_MAX. */
static size_t registry_index(const sim_registry_t* reg, uint64_t key) {
  size_t i = registry_lower_bound(reg, key);
  if (i < reg->len && reg->keys[i] == key && reg->objs[i] != NULL) return i;
  return SIZE_MAX;
}

static void* registry_find(const sim_registry_t* reg, uint64_t key) {
  size_t i = registry_index(reg, key);
  return i == SIZE_MAX ? NULL : reg->objs[i];
}

static void registry_remove_at(sim_registry_t* reg, size_t i) {
  reg->objs[i] = NULL;
  reg->live--;
  while (reg->len > 0 && reg->objs[reg->len - 1] == NULL) reg->len--;
  size_t dead = reg->len - reg->live;
  if (dead > 64 && dead > reg->live) registry_compact(reg);
}

/* Frees every live object with free() and the arrays. */
static void registry_free_all(sim_registry_t* reg) {
  for (size_t i = 0; i < reg->len; i++) free(reg->objs[i]);
  free(reg->keys);
  free(reg->objs);
  memset(reg, 0, sizeof *reg);
}

/* ---- the device's state ------------------------------------------------ */

typedef struct sim_range sim_range_t;

/* One physical allocation (cuMemCreate). Like CUDA, a page may be mapped at
 * several addresses at once (aliases of the same memory); it can be
 * released only when no mapping is left (stricter than CUDA, which defers
 * the free: an allocator that releases a mapped page has lost track of it). */
typedef struct sim_page {
  gpumem_phys_t handle;
  size_t size;
  unsigned char* host; /* host_backed only */
  size_t num_mappings;
  uintptr_t mapped_at; /* one of its mappings, for messages */
  bool on_host;        /* create_host_page's: held against host_capacity */
} sim_page_t;

/* A reserved address range. slots[i] is the page mapped over the i-th
 * page_size unit of the range (a page of n units fills n slots, units[i]
 * says which of them), so map and unmap cost O(pages touched). mappings
 * counts mappings. */
struct sim_range {
  uintptr_t base;
  size_t size;
  size_t mappings;
  sim_page_t** slots;
  uint32_t* units;
};

typedef struct sim_plain {
  uintptr_t addr;
  size_t size;
  unsigned char* host; /* host_backed only */
} sim_plain_t;

/* An event is complete when never recorded, when its countdown of queries
 * has run out, or when its stream (or the whole device) was synchronized
 * after it was recorded: syncs bump an epoch instead of walking events. */
typedef struct sim_event {
  gpumem_event_t handle;
  bool recorded;
  int countdown;
  gpumem_stream_t stream;
  uint64_t stream_epoch;
  uint64_t device_epoch;
} sim_event_t;

/* Per-stream sync epochs: open addressing, insert only (streams are few and
 * only those ever synchronized get an entry). */
typedef struct sim_stream_slot {
  gpumem_stream_t stream;
  uint64_t epoch;
  bool used;
} sim_stream_slot_t;

typedef struct sim {
  gpumem_backend_t backend; /* first: handed out to the caller */
  pthread_mutex_t lock;     /* guards everything below */
  gpumem_sim_options_t opts;

  gpumem_sim_counters_t counters;
  uint64_t bytes_used; /* physical + plain bytes held, against opts.capacity */
  uint64_t host_used;  /* host pages held, against opts.host_capacity */

  /* Scripted failure: active when fail_active. */
  bool fail_active;
  int fail_kind; /* call kind or -1 for any */
  long fail_skip;
  long fail_count; /* < 0: forever */
  gpumem_status_t fail_status;

  uintptr_t plain_cursor; /* next free edge of the plain region */
  sim_registry_t plains;  /* keyed by plain_key(addr) */

  uintptr_t reserve_cursor;
  sim_range_t** ranges; /* sorted by base */
  size_t range_count;
  size_t range_cap;

  gpumem_phys_t next_page_handle;
  sim_registry_t pages; /* keyed by handle */

  gpumem_event_t next_event_handle;
  sim_registry_t events; /* keyed by handle */
  int event_delay;
  uint64_t device_epoch;
  sim_stream_slot_t* streams;
  size_t stream_cap; /* power of two, or 0 */
  size_t stream_count;

  /* Streams capturing a graph now (gpumem_sim_begin_capture). */
  struct {
    gpumem_stream_t stream;
    uint64_t id;
  } captures[16];
  int num_captures;
} sim_t;

/* ---- call entry: counting and scripted failures ------------------------ */

/* Takes the lock, counts the call and applies the failure script. Returns
 * GPUMEM_OK to go on, or the injected status; the lock is held either way. */
static gpumem_status_t sim_enter(sim_t* sim, int kind) {
  pthread_mutex_lock(&sim->lock);
  uint64_t call_number = ++sim->counters.calls[kind];
  if (!sim->fail_active || (sim->fail_kind != -1 && sim->fail_kind != kind)) return GPUMEM_OK;
  if (sim->fail_skip > 0) {
    sim->fail_skip--;
    return GPUMEM_OK;
  }
  if (sim->fail_count == 0) return GPUMEM_OK;
  if (sim->fail_count > 0) sim->fail_count--;
  sim->counters.failures_injected++;
  return gm_fail(sim->fail_status, "sim: injected failure of %s (call #%llu)",
                 gpumem_backend_call_name(kind), (unsigned long long)call_number);
}

/* CUDA refuses synchronizations and event queries while a graph is being
 * captured (and a record on a capturing stream would join the graph): the
 * sim refuses them too and counts them. stream 0 with any: any capture. */
static gpumem_status_t capture_refuses(sim_t* sim, const char* call, gpumem_stream_t stream,
                                       bool any) {
  for (int i = 0; i < sim->num_captures; i++) {
    if (any || sim->captures[i].stream == stream) {
      sim->counters.capture_violations++;
      return gm_fail(GPUMEM_ERR_BACKEND,
                     "sim: %s while stream 0x%lx captures a graph (illegal during capture)", call,
                     (unsigned long)sim->captures[i].stream);
    }
  }
  return GPUMEM_OK;
}

static gpumem_status_t sim_leave(sim_t* sim, gpumem_status_t status) {
  pthread_mutex_unlock(&sim->lock);
  return status;
}

/* ---- capacity ---------------------------------------------------------- */

static gpumem_status_t charge(sim_t* sim, size_t size) {
  if (size > sim->opts.capacity - sim->bytes_used) {
    char want[32], used[32], total[32];
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                   "sim: out of memory: %s requested, %s in use of %s capacity",
                   sim_format_bytes(size, want, sizeof want),
                   sim_format_bytes(sim->bytes_used, used, sizeof used),
                   sim_format_bytes(sim->opts.capacity, total, sizeof total));
  }
  sim->bytes_used += size;
  sim->counters.bytes_in_use = sim->bytes_used;
  if (sim->bytes_used > sim->counters.peak_bytes_in_use) {
    sim->counters.peak_bytes_in_use = sim->bytes_used;
  }
  return GPUMEM_OK;
}

static void uncharge(sim_t* sim, size_t size) {
  sim->bytes_used -= size;
  sim->counters.bytes_in_use = sim->bytes_used;
}

/* ---- reserved ranges --------------------------------------------------- */

/* The range containing addr, or NULL. */
static sim_range_t* find_range(const sim_t* sim, uintptr_t addr, size_t* out_index) {
  size_t lo = 0, hi = sim->range_count; /* first range with base > addr */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (sim->ranges[mid]->base <= addr) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == 0) return NULL;
  sim_range_t* range = sim->ranges[lo - 1];
  if (addr - range->base >= range->size) return NULL;
  if (out_index) *out_index = lo - 1;
  return range;
}

/* Checks the shape shared by every VM size argument. */
static gpumem_status_t check_vm_size(const sim_t* sim, const char* call, size_t size) {
  size_t page = sim->opts.page_size;
  if (size == 0 || size % page != 0) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "sim: %s of %zu bytes: size must be a nonzero multiple of the page size %zu",
                   call, size, page);
  }
  return GPUMEM_OK;
}

static gpumem_status_t check_vm_addr(const sim_t* sim, const char* call, uintptr_t addr,
                                     size_t size) {
  if (addr % sim->opts.page_size != 0) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "sim: %s at 0x%llx: address is not aligned to the page size %zu", call,
                   (unsigned long long)addr, sim->opts.page_size);
  }
  return check_vm_size(sim, call, size);
}

static gpumem_status_t reserve_locked(sim_t* sim, size_t size, uintptr_t* out_addr) {
  if (out_addr == NULL) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "sim: reserve: NULL out_addr");
  gpumem_status_t status = check_vm_size(sim, "reserve", size);
  if (status != GPUMEM_OK) return status;
  size_t pages = size / sim->opts.page_size;
  if (pages > SIM_MAX_RANGE_PAGES) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "sim: reserve of %zu bytes: more than the simulator's %zu pages per range", size,
                   SIM_MAX_RANGE_PAGES);
  }
  if (size > SIM_RESERVE_LIMIT - sim->reserve_cursor) {
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                   "sim: reserve of %zu bytes: the fake address space for ranges is exhausted",
                   size);
  }
  if (sim->range_count == sim->range_cap) {
    size_t cap = sim->range_cap ? sim->range_cap * 2 : 16;
    sim_range_t** ranges = realloc(sim->ranges, cap * sizeof *ranges);
    if (ranges == NULL) goto no_host_memory;
    sim->ranges = ranges;
    sim->range_cap = cap;
  }
  sim_range_t* range = calloc(1, sizeof *range);
  if (range == NULL) goto no_host_memory;
  range->slots = calloc(pages, sizeof *range->slots);
  range->units = calloc(pages, sizeof *range->units);
  if (range->slots == NULL || range->units == NULL) {
    free(range->slots);
    free(range->units);
    free(range);
    goto no_host_memory;
  }
  range->base = sim->reserve_cursor;
  range->size = size;
  /* The cursor only grows, so appending keeps ranges sorted by base. The
   * guard page keeps two ranges from ever looking contiguous. */
  sim->reserve_cursor += size + sim->opts.page_size;
  sim->ranges[sim->range_count++] = range;
  sim->counters.ranges_reserved++;
  *out_addr = range->base;
  return GPUMEM_OK;

no_host_memory:
  return gm_fail(GPUMEM_ERR_HOST_MEMORY, "sim: reserve of %zu bytes: no host memory for the map",
                 size);
}

static gpumem_status_t release_range_locked(sim_t* sim, uintptr_t addr, size_t size) {
  size_t index = 0;
  sim_range_t* range = find_range(sim, addr, &index);
  if (range == NULL || range->base != addr) {
    return gm_fail(GPUMEM_ERR_BACKEND, "sim: release_range of 0x%llx: no range reserved there",
                   (unsigned long long)addr);
  }
  if (range->size != size) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "sim: release_range of 0x%llx with size %zu: the range was reserved with %zu",
                   (unsigned long long)addr, size, range->size);
  }
  if (range->mappings != 0) {
    return gm_fail(GPUMEM_ERR_BACKEND,
                   "sim: release_range of 0x%llx: the range still holds %zu mappings",
                   (unsigned long long)addr, range->mappings);
  }
  memmove(&sim->ranges[index], &sim->ranges[index + 1],
          (sim->range_count - index - 1) * sizeof *sim->ranges);
  sim->range_count--;
  free(range->slots);
  free(range->units);
  free(range);
  sim->counters.ranges_reserved--;
  return GPUMEM_OK;
}

/* ---- physical pages ---------------------------------------------------- */

/* Host pages are charged to the host, not to the device's capacity: the
 * device's free memory (mem_info) does not see them, as on a GPU. */
static gpumem_status_t charge_host(sim_t* sim, size_t size) {
  if (size > sim->opts.host_capacity - sim->host_used) {
    char want[32], used[32], total[32];
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                   "sim: out of host memory: %s of host pages requested, %s in use of %s",
                   sim_format_bytes(size, want, sizeof want),
                   sim_format_bytes(sim->host_used, used, sizeof used),
                   sim_format_bytes(sim->opts.host_capacity, total, sizeof total));
  }
  sim->host_used += size;
  sim->counters.host_bytes_in_use = sim->host_used;
  if (sim->host_used > sim->counters.peak_host_bytes_in_use)
    sim->counters.peak_host_bytes_in_use = sim->host_used;
  return GPUMEM_OK;
}

static gpumem_status_t create_page_locked(sim_t* sim, size_t size, bool on_host,
                                          gpumem_phys_t* out) {
  const char* call = on_host ? "create_host_page" : "create_page";
  if (out == NULL) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "sim: %s: NULL out", call);
  gpumem_status_t status = check_vm_size(sim, call, size);
  if (status != GPUMEM_OK) return status;
  if (on_host && size > sim->opts.host_capacity - sim->host_used) return charge_host(sim, size);
  if (!on_host && size > sim->opts.capacity - sim->bytes_used)
    return charge(sim, size); /* the OOM report */
  sim_page_t* page = calloc(1, sizeof *page);
  if (page == NULL) goto no_host_memory;
  if (sim->opts.host_backed) {
    page->host = calloc(1, size);
    if (page->host == NULL) {
      free(page);
      goto no_host_memory;
    }
  }
  page->handle = sim->next_page_handle;
  page->size = size;
  if (!registry_append(&sim->pages, page->handle, page)) {
    free(page->host);
    free(page);
    goto no_host_memory;
  }
  sim->next_page_handle++;
  page->on_host = on_host;
  if (on_host)
    charge_host(sim, size);
  else
    charge(sim, size);
  sim->counters.pages_live++;
  *out = page->handle;
  return GPUMEM_OK;

no_host_memory:
  return gm_fail(GPUMEM_ERR_HOST_MEMORY, "sim: %s of %zu bytes: no host memory", call, size);
}

static gpumem_status_t release_page_locked(sim_t* sim, gpumem_phys_t handle, size_t size) {
  size_t index = registry_index(&sim->pages, handle);
  if (index == SIZE_MAX) {
    return gm_fail(GPUMEM_ERR_BACKEND, "sim: release_page of unknown page %llu",
                   (unsigned long long)handle);
  }
  sim_page_t* page = sim->pages.objs[index];
  if (page->size != size) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "sim: release_page of page %llu with size %zu: it was created with %zu",
                   (unsigned long long)handle, size, page->size);
  }
  if (page->num_mappings != 0) {
    return gm_fail(
        GPUMEM_ERR_BACKEND,
        "sim: release_page of page %llu: it is still mapped (%zu mappings, one at 0x%llx)",
        (unsigned long long)handle, page->num_mappings, (unsigned long long)page->mapped_at);
  }
  registry_remove_at(&sim->pages, index);
  if (page->on_host) {
    sim->host_used -= page->size;
    sim->counters.host_bytes_in_use = sim->host_used;
  } else {
    uncharge(sim, page->size);
  }
  sim->counters.pages_live--;
  free(page->host);
  free(page);
  return GPUMEM_OK;
}

/* ---- mapping ----------------------------------------------------------- */

/* The range holding all of [addr, addr+size), or NULL with a message. */
static sim_range_t* range_holding(const sim_t* sim, const char* call, uintptr_t addr, size_t size) {
  sim_range_t* range = find_range(sim, addr, NULL);
  if (range == NULL) {
    gm_fail(GPUMEM_ERR_BACKEND, "sim: %s at 0x%llx: the address is not in a reserved range", call,
            (unsigned long long)addr);
    return NULL;
  }
  if (size > range->size - (addr - range->base)) {
    gm_fail(GPUMEM_ERR_BACKEND,
            "sim: %s of [0x%llx, +%zu): runs past the end of the range [0x%llx, +%zu)", call,
            (unsigned long long)addr, size, (unsigned long long)range->base, range->size);
    return NULL;
  }
  return range;
}

static gpumem_status_t map_locked(sim_t* sim, uintptr_t addr, size_t size, gpumem_phys_t handle) {
  gpumem_status_t status = check_vm_addr(sim, "map", addr, size);
  if (status != GPUMEM_OK) return status;
  sim_range_t* range = range_holding(sim, "map", addr, size);
  if (range == NULL) return GPUMEM_ERR_BACKEND;
  sim_page_t* page = registry_find(&sim->pages, handle);
  if (page == NULL) {
    return gm_fail(GPUMEM_ERR_BACKEND, "sim: map at 0x%llx of unknown page %llu",
                   (unsigned long long)addr, (unsigned long long)handle);
  }
  if (page->size != size) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "sim: map at 0x%llx of %zu bytes: page %llu is %zu bytes (map it whole)",
                   (unsigned long long)addr, size, (unsigned long long)handle, page->size);
  }
  size_t first = (addr - range->base) / sim->opts.page_size;
  size_t count = size / sim->opts.page_size;
  for (size_t i = first; i < first + count; i++) {
    if (range->slots[i] != NULL) {
      return gm_fail(
          GPUMEM_ERR_BACKEND,
          "sim: map of page %llu at [0x%llx, +%zu): 0x%llx is already mapped (page %llu)",
          (unsigned long long)handle, (unsigned long long)addr, size,
          (unsigned long long)(range->base + i * sim->opts.page_size),
          (unsigned long long)range->slots[i]->handle);
    }
  }
  for (size_t i = first; i < first + count; i++) {
    range->slots[i] = page;
    range->units[i] = (uint32_t)(i - first);
  }
  page->num_mappings++;
  page->mapped_at = addr;
  range->mappings++;
  sim->counters.pages_mapped++;
  return GPUMEM_OK;
}

static gpumem_status_t unmap_locked(sim_t* sim, uintptr_t addr, size_t size) {
  gpumem_status_t status = check_vm_addr(sim, "unmap", addr, size);
  if (status != GPUMEM_OK) return status;
  sim_range_t* range = range_holding(sim, "unmap", addr, size);
  if (range == NULL) return GPUMEM_ERR_BACKEND;
  size_t page_size = sim->opts.page_size;
  uintptr_t end = addr + size;
  /* Check everything first: a refused unmap must change nothing. */
  for (uintptr_t at = addr; at < end;) {
    sim_page_t* page = range->slots[(at - range->base) / page_size];
    if (page == NULL) {
      return gm_fail(GPUMEM_ERR_BACKEND,
                     "sim: unmap of [0x%llx, +%zu): nothing is mapped at 0x%llx",
                     (unsigned long long)addr, size, (unsigned long long)at);
    }
    if (range->units[(at - range->base) / page_size] != 0) {
      return gm_fail(
          GPUMEM_ERR_BACKEND,
          "sim: unmap of [0x%llx, +%zu): starts inside page %llu mapped at [0x%llx, +%zu)",
          (unsigned long long)addr, size, (unsigned long long)page->handle,
          (unsigned long long)(at - range->units[(at - range->base) / page_size] * page_size),
          page->size);
    }
    if (page->size > end - at) {
      return gm_fail(GPUMEM_ERR_BACKEND,
                     "sim: unmap of [0x%llx, +%zu): ends inside page %llu mapped at [0x%llx, +%zu)",
                     (unsigned long long)addr, size, (unsigned long long)page->handle,
                     (unsigned long long)at, page->size);
    }
    at += page->size;
  }
  for (uintptr_t at = addr; at < end;) {
    size_t first = (at - range->base) / page_size;
    sim_page_t* page = range->slots[first];
    for (size_t i = first; i < first + page->size / page_size; i++) {
      range->slots[i] = NULL;
      range->units[i] = 0;
    }
    page->num_mappings--;
    range->mappings--;
    sim->counters.pages_mapped--;
    at += page->size;
  }
  return GPUMEM_OK;
}

/* ---- plain memory ------------------------------------------------------ */

/* Registry key growing with each new plain allocation, whichever way the
 * addresses go. */
static uint64_t plain_key(const sim_t* sim, uintptr_t addr) {
  return sim->opts.descending_addresses ? (uint64_t)(SIM_PLAIN_TOP - addr) : (uint64_t)addr;
}

/* Registry index of the live plain allocation containing addr, or SIZE_MAX.
 * The candidate is the one with the highest start <= addr; allocations never
 * overlap, so if it does not hold addr, none does. */
static size_t plain_index_containing(const sim_t* sim, uintptr_t addr) {
  if (addr < SIM_PLAIN_BOTTOM || addr >= SIM_PLAIN_TOP) return SIZE_MAX;
  const sim_registry_t* reg = &sim->plains;
  size_t i;
  if (sim->opts.descending_addresses) {
    i = registry_lower_bound(reg, plain_key(sim, addr));
  } else {
    i = registry_lower_bound(reg, (uint64_t)addr + 1);
    i = i == 0 ? reg->len : i - 1;
  }
  if (i >= reg->len || reg->objs[i] == NULL) return SIZE_MAX;
  const sim_plain_t* plain = reg->objs[i];
  return addr - plain->addr < plain->size ? i : SIZE_MAX;
}

static gpumem_status_t alloc_locked(sim_t* sim, size_t size, uintptr_t* out_addr) {
  if (out_addr == NULL) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "sim: alloc: NULL out_addr");
  if (size == 0) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "sim: alloc of 0 bytes");
  if (size > sim->opts.capacity - sim->bytes_used) return charge(sim, size); /* the OOM report */
  /* Segments start on page boundaries, as cudaMalloc's 2 MiB-aligned ones do. */
  size_t align = sim->opts.page_size;
  size_t span = size <= SIZE_MAX - (align - 1) ? (size + align - 1) & ~(align - 1) : SIZE_MAX;
  size_t room = sim->opts.descending_addresses ? sim->plain_cursor - SIM_PLAIN_BOTTOM
                                               : SIM_PLAIN_TOP - sim->plain_cursor;
  if (span > room && sim->plains.live == 0) {
    /* Nothing is live: starting over reuses no live address. */
    sim->plains.len = 0;
    sim->plain_cursor = sim->opts.descending_addresses ? SIM_PLAIN_TOP : SIM_PLAIN_BOTTOM;
    room = SIM_PLAIN_TOP - SIM_PLAIN_BOTTOM;
  }
  if (span > room) {
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                   "sim: alloc of %zu bytes: the fake address space for plain allocations is "
                   "exhausted",
                   size);
  }
  uintptr_t addr = sim->opts.descending_addresses ? sim->plain_cursor - span : sim->plain_cursor;
  sim_plain_t* plain = calloc(1, sizeof *plain);
  if (plain == NULL) goto no_host_memory;
  if (sim->opts.host_backed) {
    plain->host = calloc(1, size);
    if (plain->host == NULL) {
      free(plain);
      goto no_host_memory;
    }
  }
  plain->addr = addr;
  plain->size = size;
  if (!registry_append(&sim->plains, plain_key(sim, addr), plain)) {
    free(plain->host);
    free(plain);
    goto no_host_memory;
  }
  sim->plain_cursor = sim->opts.descending_addresses ? addr : addr + span;
  charge(sim, size);
  sim->counters.plain_live++;
  *out_addr = addr;
  return GPUMEM_OK;

no_host_memory:
  return gm_fail(GPUMEM_ERR_HOST_MEMORY, "sim: alloc of %zu bytes: no host memory", size);
}

static gpumem_status_t free_locked(sim_t* sim, uintptr_t addr, size_t size) {
  size_t index = plain_index_containing(sim, addr);
  sim_plain_t* plain = index == SIZE_MAX ? NULL : sim->plains.objs[index];
  if (plain == NULL || plain->addr != addr) {
    return gm_fail(GPUMEM_ERR_BACKEND, "sim: free of 0x%llx: not a live plain allocation",
                   (unsigned long long)addr);
  }
  if (plain->size != size) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "sim: free of 0x%llx with size %zu: it was allocated with %zu",
                   (unsigned long long)addr, size, plain->size);
  }
  registry_remove_at(&sim->plains, index);
  uncharge(sim, plain->size);
  sim->counters.plain_live--;
  free(plain->host);
  free(plain);
  return GPUMEM_OK;
}

static gpumem_status_t mem_info_locked(sim_t* sim, size_t* free_bytes, size_t* total_bytes) {
  if (free_bytes == NULL || total_bytes == NULL) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "sim: mem_info: NULL out pointer");
  }
  *total_bytes = sim->opts.capacity;
  *free_bytes = sim->opts.capacity - sim->bytes_used;
  return GPUMEM_OK;
}

/* ---- streams and events ------------------------------------------------ */

static size_t stream_hash(gpumem_stream_t stream, size_t mask) {
  uint64_t x = (uint64_t)stream * 0x9e3779b97f4a7c15ull;
  return (size_t)(x >> 32) & mask;
}

static uint64_t stream_epoch(const sim_t* sim, gpumem_stream_t stream) {
  if (sim->stream_cap == 0) return 0;
  size_t mask = sim->stream_cap - 1;
  for (size_t i = stream_hash(stream, mask);; i = (i + 1) & mask) {
    if (!sim->streams[i].used) return 0;
    if (sim->streams[i].stream == stream) return sim->streams[i].epoch;
  }
}

/* The stream's slot, created (epoch 0) if needed; NULL when out of memory. */
static sim_stream_slot_t* stream_slot(sim_t* sim, gpumem_stream_t stream) {
  if (2 * (sim->stream_count + 1) > sim->stream_cap) {
    size_t cap = sim->stream_cap ? sim->stream_cap * 2 : 16;
    sim_stream_slot_t* table = calloc(cap, sizeof *table);
    if (table == NULL) return NULL;
    for (size_t j = 0; j < sim->stream_cap; j++) {
      if (!sim->streams[j].used) continue;
      size_t i = stream_hash(sim->streams[j].stream, cap - 1);
      while (table[i].used) i = (i + 1) & (cap - 1);
      table[i] = sim->streams[j];
    }
    free(sim->streams);
    sim->streams = table;
    sim->stream_cap = cap;
  }
  size_t mask = sim->stream_cap - 1;
  size_t i = stream_hash(stream, mask);
  while (sim->streams[i].used && sim->streams[i].stream != stream) i = (i + 1) & mask;
  if (!sim->streams[i].used) {
    sim->streams[i].used = true;
    sim->streams[i].stream = stream;
    sim->streams[i].epoch = 0;
    sim->stream_count++;
  }
  return &sim->streams[i];
}

static bool event_complete(const sim_t* sim, const sim_event_t* event) {
  return !event->recorded || event->countdown == 0 || event->device_epoch != sim->device_epoch ||
         event->stream_epoch != stream_epoch(sim, event->stream);
}

static sim_event_t* find_event(sim_t* sim, const char* call, gpumem_event_t handle) {
  sim_event_t* event = registry_find(&sim->events, handle);
  if (event == NULL) {
    gm_fail(GPUMEM_ERR_BACKEND, "sim: %s of unknown event %llu", call, (unsigned long long)handle);
  }
  return event;
}

static gpumem_status_t event_create_locked(sim_t* sim, gpumem_event_t* out) {
  if (out == NULL) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "sim: event_create: NULL out");
  sim_event_t* event = calloc(1, sizeof *event);
  if (event == NULL || !registry_append(&sim->events, sim->next_event_handle, event)) {
    free(event);
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "sim: event_create: no host memory");
  }
  event->handle = sim->next_event_handle++;
  sim->counters.events_live++;
  *out = event->handle;
  return GPUMEM_OK;
}

static gpumem_status_t event_destroy_locked(sim_t* sim, gpumem_event_t handle) {
  size_t index = registry_index(&sim->events, handle);
  if (index == SIZE_MAX) {
    return gm_fail(GPUMEM_ERR_BACKEND, "sim: event_destroy of unknown event %llu",
                   (unsigned long long)handle);
  }
  free(sim->events.objs[index]);
  registry_remove_at(&sim->events, index);
  sim->counters.events_live--;
  return GPUMEM_OK;
}

static gpumem_status_t event_record_locked(sim_t* sim, gpumem_event_t handle,
                                           gpumem_stream_t stream) {
  sim_event_t* event = find_event(sim, "event_record", handle);
  if (event == NULL) return GPUMEM_ERR_BACKEND;
  event->recorded = true;
  event->countdown = sim->event_delay;
  event->stream = stream;
  event->stream_epoch = stream_epoch(sim, stream);
  event->device_epoch = sim->device_epoch;
  return GPUMEM_OK;
}

static gpumem_status_t event_query_locked(sim_t* sim, gpumem_event_t handle) {
  sim_event_t* event = find_event(sim, "event_query", handle);
  if (event == NULL) return GPUMEM_ERR_BACKEND;
  if (event_complete(sim, event)) return GPUMEM_OK;
  event->countdown--;
  return GPUMEM_NOT_READY;
}

static gpumem_status_t event_sync_locked(sim_t* sim, gpumem_event_t handle) {
  sim_event_t* event = find_event(sim, "event_sync", handle);
  if (event == NULL) return GPUMEM_ERR_BACKEND;
  event->countdown = 0;
  return GPUMEM_OK;
}

static gpumem_status_t stream_sync_locked(sim_t* sim, gpumem_stream_t stream) {
  sim_stream_slot_t* slot = stream_slot(sim, stream);
  if (slot == NULL) return gm_fail(GPUMEM_ERR_HOST_MEMORY, "sim: stream_sync: no host memory");
  slot->epoch++;
  return GPUMEM_OK;
}

/* Work on the simulated device is instantaneous, so a wait orders nothing
 * the sim could observe: it checks the event and counts the call. (The
 * tests' spy, tests/spy_backend.h, models what the wait orders.) */
static gpumem_status_t stream_wait_locked(sim_t* sim, gpumem_stream_t stream,
                                          gpumem_event_t handle) {
  (void)stream;
  return find_event(sim, "stream_wait", handle) ? GPUMEM_OK : GPUMEM_ERR_BACKEND;
}

/* ---- the slots --------------------------------------------------------- */

static gpumem_status_t sim_reserve(void* ctx, size_t size, uintptr_t* out_addr) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_reserve);
  if (status == GPUMEM_OK) status = reserve_locked(sim, size, out_addr);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_release_range(void* ctx, uintptr_t addr, size_t size) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_release_range);
  if (status == GPUMEM_OK) status = release_range_locked(sim, addr, size);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_create_page(void* ctx, size_t size, gpumem_phys_t* out) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_create_page);
  if (status == GPUMEM_OK) status = create_page_locked(sim, size, false, out);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_create_host_page(void* ctx, size_t size, gpumem_phys_t* out) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_create_host_page);
  if (status == GPUMEM_OK) status = create_page_locked(sim, size, true, out);
  return sim_leave(sim, status);
}

/* The page mapped at addr and addr's offset in it, or NULL with a message. */
static sim_page_t* page_at(sim_t* sim, const char* call, uintptr_t addr, size_t* offset) {
  sim_range_t* range = find_range(sim, addr, NULL);
  sim_page_t* page = NULL;
  if (range) {
    size_t unit = (addr - range->base) / sim->opts.page_size;
    page = range->slots[unit];
    *offset = (size_t)range->units[unit] * sim->opts.page_size +
              (addr - range->base) % sim->opts.page_size;
  }
  if (!page)
    gm_fail(GPUMEM_ERR_BACKEND, "sim: %s: nothing is mapped at 0x%llx", call,
            (unsigned long long)addr);
  return page;
}

/* Checks that both ranges are mapped throughout, then moves the bytes (on
 * a host-backed device) and prices what crosses the host link. The copy
 * is done at once: the simulated device runs no queued work. */
static gpumem_status_t copy_locked(sim_t* sim, uintptr_t dst, uintptr_t src, size_t size) {
  size_t done = 0;
  while (done < size) {
    size_t doff = 0, soff = 0;
    sim_page_t* d = page_at(sim, "copy", dst + done, &doff);
    if (!d) return GPUMEM_ERR_BACKEND;
    sim_page_t* sp = page_at(sim, "copy", src + done, &soff);
    if (!sp) return GPUMEM_ERR_BACKEND;
    size_t n = size - done;
    if (n > d->size - doff) n = d->size - doff;
    if (n > sp->size - soff) n = sp->size - soff;
    if (d->host && sp->host) memmove(d->host + doff, sp->host + soff, n);
    if (d->on_host || sp->on_host) sim->counters.host_link_bytes += n;
    done += n;
  }
  sim->counters.host_link_model_ns =
      (uint64_t)((double)sim->counters.host_link_bytes * 1e9 / GPUMEM_SIM_HOST_LINK_BYTES_PER_S);
  return GPUMEM_OK;
}

static gpumem_status_t sim_copy(void* ctx, uintptr_t dst, uintptr_t src, size_t size,
                                gpumem_stream_t stream) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_copy);
  if (status == GPUMEM_OK) status = capture_refuses(sim, "copy", stream, false);
  if (status == GPUMEM_OK) status = copy_locked(sim, dst, src, size);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_release_page(void* ctx, gpumem_phys_t page, size_t size) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_release_page);
  if (status == GPUMEM_OK) status = release_page_locked(sim, page, size);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_map(void* ctx, uintptr_t addr, size_t size, gpumem_phys_t page) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_map);
  if (status == GPUMEM_OK) status = map_locked(sim, addr, size, page);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_unmap(void* ctx, uintptr_t addr, size_t size) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_unmap);
  if (status == GPUMEM_OK) status = unmap_locked(sim, addr, size);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_alloc(void* ctx, size_t size, uintptr_t* out_addr) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_alloc);
  if (status == GPUMEM_OK) status = alloc_locked(sim, size, out_addr);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_free(void* ctx, uintptr_t addr, size_t size) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_free);
  if (status == GPUMEM_OK) status = free_locked(sim, addr, size);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_mem_info(void* ctx, size_t* free_bytes, size_t* total_bytes) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_mem_info);
  if (status == GPUMEM_OK) status = mem_info_locked(sim, free_bytes, total_bytes);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_event_create(void* ctx, gpumem_event_t* out) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_event_create);
  if (status == GPUMEM_OK) status = event_create_locked(sim, out);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_event_destroy(void* ctx, gpumem_event_t event) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_event_destroy);
  if (status == GPUMEM_OK) status = event_destroy_locked(sim, event);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_event_record(void* ctx, gpumem_event_t event, gpumem_stream_t stream) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_event_record);
  if (status == GPUMEM_OK) status = capture_refuses(sim, "event_record", stream, false);
  if (status == GPUMEM_OK) status = event_record_locked(sim, event, stream);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_event_query(void* ctx, gpumem_event_t event) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_event_query);
  if (status == GPUMEM_OK) status = capture_refuses(sim, "event_query", 0, true);
  if (status == GPUMEM_OK) status = event_query_locked(sim, event);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_event_sync(void* ctx, gpumem_event_t event) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_event_sync);
  if (status == GPUMEM_OK) status = capture_refuses(sim, "event_sync", 0, true);
  if (status == GPUMEM_OK) status = event_sync_locked(sim, event);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_stream_sync(void* ctx, gpumem_stream_t stream) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_stream_sync);
  if (status == GPUMEM_OK) status = capture_refuses(sim, "stream_sync", 0, true);
  if (status == GPUMEM_OK) status = stream_sync_locked(sim, stream);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_device_sync(void* ctx) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_device_sync);
  if (status == GPUMEM_OK) status = capture_refuses(sim, "device_sync", 0, true);
  if (status == GPUMEM_OK) sim->device_epoch++;
  return sim_leave(sim, status);
}

static gpumem_status_t sim_stream_wait(void* ctx, gpumem_stream_t stream, gpumem_event_t event) {
  sim_t* sim = ctx;
  gpumem_status_t status = sim_enter(sim, GPUMEM_CALL_stream_wait);
  if (status == GPUMEM_OK) status = stream_wait_locked(sim, stream, event);
  return sim_leave(sim, status);
}

static gpumem_status_t sim_stream_capture_info(void* ctx, gpumem_stream_t stream, int* capturing,
                                               uint64_t* capture_id) {
  sim_t* sim = ctx;
  /* Not a counted call kind: a query of host-side state. */
  pthread_mutex_lock(&sim->lock);
  *capturing = 0;
  *capture_id = 0;
  for (int i = 0; i < sim->num_captures; i++) {
    if (sim->captures[i].stream == stream) {
      *capturing = 1;
      *capture_id = sim->captures[i].id;
    }
  }
  pthread_mutex_unlock(&sim->lock);
  return GPUMEM_OK;
}

static void sim_destroy_slot(gpumem_backend_t* self) {
  if (self == NULL) return;
  sim_t* sim = (sim_t*)self->ctx;
  for (size_t i = 0; i < sim->pages.len; i++) {
    sim_page_t* page = sim->pages.objs[i];
    if (page != NULL) free(page->host);
  }
  for (size_t i = 0; i < sim->plains.len; i++) {
    sim_plain_t* plain = sim->plains.objs[i];
    if (plain != NULL) free(plain->host);
  }
  registry_free_all(&sim->pages);
  registry_free_all(&sim->plains);
  registry_free_all(&sim->events);
  for (size_t i = 0; i < sim->range_count; i++) {
    free(sim->ranges[i]->slots);
    free(sim->ranges[i]->units);
    free(sim->ranges[i]);
  }
  free(sim->ranges);
  free(sim->streams);
  pthread_mutex_destroy(&sim->lock);
  free(sim);
}

/* ---- public API -------------------------------------------------------- */

void gpumem_sim_options_init(gpumem_sim_options_t* opts) {
  if (opts == NULL) return;
  memset(opts, 0, sizeof *opts);
  opts->struct_size = (uint32_t)sizeof *opts;
  opts->capacity = 80 * GM_GIB;
  opts->page_size = 2 * GM_MIB;
  opts->descending_addresses = 1;
  opts->host_backed = 0;
  opts->event_delay_queries = 0;
  opts->virtual_memory = 1;
  opts->plain_memory = 1;
  opts->host_capacity = 1024 * GM_GIB;
  opts->host_pages = 1;
}

static bool options_valid(const gpumem_sim_options_t* opts) {
  if (opts->capacity == 0) {
    gpumem_set_last_error("sim: capacity must be nonzero");
    return false;
  }
  if (!is_power_of_two(opts->page_size) || opts->page_size < SIM_MIN_PAGE_SIZE ||
      opts->page_size > SIM_MAX_PAGE_SIZE) {
    gpumem_set_last_error("sim: page_size %zu must be a power of two from %zu to %zu",
                          opts->page_size, SIM_MIN_PAGE_SIZE, SIM_MAX_PAGE_SIZE);
    return false;
  }
  if (!opts->virtual_memory && !opts->plain_memory) {
    gpumem_set_last_error("sim: virtual_memory and plain_memory are both off; a device needs one");
    return false;
  }
  if (opts->event_delay_queries < 0) {
    gpumem_set_last_error("sim: event_delay_queries %d must not be negative",
                          opts->event_delay_queries);
    return false;
  }
  return true;
}

gpumem_backend_t* gpumem_sim_create(const gpumem_sim_options_t* opts) {
  gpumem_sim_options_t options;
  gpumem_sim_options_init(&options);
  if (opts != NULL) {
    /* Older callers pass a shorter struct: take what they know, default the rest. */
    if (opts->struct_size == 0 || opts->struct_size > sizeof options) {
      gpumem_set_last_error(
          "sim: options.struct_size is %u (want %zu); fill options with gpumem_sim_options_init",
          (unsigned)opts->struct_size, sizeof options);
      return NULL;
    }
    memcpy(&options, opts, opts->struct_size);
    options.struct_size = (uint32_t)sizeof options;
  }
  if (!options_valid(&options)) return NULL;

  sim_t* sim = calloc(1, sizeof *sim);
  if (sim == NULL) {
    gpumem_set_last_error("sim: no host memory for the device");
    return NULL;
  }
  if (pthread_mutex_init(&sim->lock, NULL) != 0) {
    free(sim);
    gpumem_set_last_error("sim: pthread_mutex_init failed");
    return NULL;
  }
  sim->opts = options;
  sim->plain_cursor = options.descending_addresses ? SIM_PLAIN_TOP : SIM_PLAIN_BOTTOM;
  sim->reserve_cursor = SIM_RESERVE_BASE;
  sim->next_page_handle = 1; /* 0 never names a page or an event */
  sim->next_event_handle = 1;
  sim->event_delay = options.event_delay_queries;

  gpumem_backend_t* b = &sim->backend;
  b->version = GPUMEM_BACKEND_VERSION;
  b->name = "sim";
  b->ctx = sim;
  if (options.virtual_memory) {
    b->page_size = options.page_size;
    b->reserve = sim_reserve;
    b->release_range = sim_release_range;
    b->create_page = sim_create_page;
    b->release_page = sim_release_page;
    b->map = sim_map;
    b->unmap = sim_unmap;
    if (options.host_pages) {
      b->create_host_page = sim_create_host_page;
      b->copy = sim_copy;
    }
  }
  if (options.plain_memory) {
    b->alloc = sim_alloc;
    b->free = sim_free;
  }
  b->mem_info = sim_mem_info;
  b->event_create = sim_event_create;
  b->event_destroy = sim_event_destroy;
  b->event_record = sim_event_record;
  b->event_query = sim_event_query;
  b->event_sync = sim_event_sync;
  b->stream_sync = sim_stream_sync;
  b->device_sync = sim_device_sync;
  b->stream_wait = sim_stream_wait;
  b->stream_capture_info = sim_stream_capture_info;
  b->destroy = sim_destroy_slot;
  return b;
}

/* The sim behind a backend, or NULL when it is not one (the sim's own
 * destroy slot is the mark). */
static sim_t* sim_of(gpumem_backend_t* backend) {
  if (backend == NULL || backend->destroy != sim_destroy_slot) return NULL;
  return (sim_t*)backend->ctx;
}

void gpumem_sim_destroy(gpumem_backend_t* sim) {
  if (sim_of(sim) != NULL) sim_destroy_slot(sim);
}

void gpumem_sim_fail(gpumem_backend_t* backend, int kind, long skip, long count,
                     gpumem_status_t status) {
  sim_t* sim = sim_of(backend);
  if (sim == NULL) return;
  if (kind < -1 || kind >= GPUMEM_CALL_COUNT) {
    gpumem_set_last_error("sim: gpumem_sim_fail: call kind %d out of range; script unchanged",
                          kind);
    return;
  }
  pthread_mutex_lock(&sim->lock);
  sim->fail_active = true;
  sim->fail_kind = kind;
  sim->fail_skip = skip < 0 ? 0 : skip;
  sim->fail_count = count;
  /* A "failure" that reports success would leave out-parameters unset. */
  sim->fail_status = status == GPUMEM_OK ? GPUMEM_ERR_BACKEND : status;
  pthread_mutex_unlock(&sim->lock);
}

void gpumem_sim_fail_clear(gpumem_backend_t* backend) {
  sim_t* sim = sim_of(backend);
  if (sim == NULL) return;
  pthread_mutex_lock(&sim->lock);
  sim->fail_active = false;
  pthread_mutex_unlock(&sim->lock);
}

void gpumem_sim_get_counters(gpumem_backend_t* backend, gpumem_sim_counters_t* out) {
  if (out == NULL) return;
  sim_t* sim = sim_of(backend);
  if (sim == NULL) {
    memset(out, 0, sizeof *out);
    return;
  }
  pthread_mutex_lock(&sim->lock);
  *out = sim->counters;
  pthread_mutex_unlock(&sim->lock);
}

void* gpumem_sim_host_ptr(gpumem_backend_t* backend, uintptr_t addr) {
  sim_t* sim = sim_of(backend);
  if (sim == NULL || !sim->opts.host_backed) return NULL;
  void* host = NULL;
  pthread_mutex_lock(&sim->lock);
  sim_range_t* range = find_range(sim, addr, NULL);
  if (range != NULL) {
    sim_page_t* page = range->slots[(addr - range->base) / sim->opts.page_size];
    if (page != NULL) {
      size_t unit = (addr - range->base) / sim->opts.page_size;
      host = page->host + (size_t)range->units[unit] * sim->opts.page_size +
             (addr - range->base) % sim->opts.page_size;
    }
  } else {
    size_t index = plain_index_containing(sim, addr);
    if (index != SIZE_MAX) {
      sim_plain_t* plain = sim->plains.objs[index];
      host = plain->host + (addr - plain->addr);
    }
  }
  pthread_mutex_unlock(&sim->lock);
  return host;
}

void gpumem_sim_set_event_delay(gpumem_backend_t* backend, int queries) {
  sim_t* sim = sim_of(backend);
  if (sim == NULL) return;
  pthread_mutex_lock(&sim->lock);
  sim->event_delay = queries < 0 ? 0 : queries;
  pthread_mutex_unlock(&sim->lock);
}

gpumem_status_t gpumem_sim_begin_capture(gpumem_backend_t* backend, gpumem_stream_t stream,
                                         uint64_t capture_id) {
  sim_t* sim = sim_of(backend);
  if (sim == NULL)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_sim_begin_capture: not a sim");
  if (!capture_id)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_sim_begin_capture: capture id 0");
  pthread_mutex_lock(&sim->lock);
  gpumem_status_t st = GPUMEM_OK;
  for (int i = 0; i < sim->num_captures; i++)
    if (sim->captures[i].stream == stream)
      st =
          gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                  "gpumem_sim_begin_capture: stream 0x%lx captures already", (unsigned long)stream);
  if (st == GPUMEM_OK && sim->num_captures == 16)
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                 "gpumem_sim_begin_capture: 16 streams capture already");
  if (st == GPUMEM_OK) {
    sim->captures[sim->num_captures].stream = stream;
    sim->captures[sim->num_captures].id = capture_id;
    sim->num_captures++;
  }
  pthread_mutex_unlock(&sim->lock);
  return st;
}

gpumem_status_t gpumem_sim_end_capture(gpumem_backend_t* backend, gpumem_stream_t stream) {
  sim_t* sim = sim_of(backend);
  if (sim == NULL) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_sim_end_capture: not a sim");
  pthread_mutex_lock(&sim->lock);
  bool found = false;
  for (int i = 0; i < sim->num_captures && !found; i++) {
    if (sim->captures[i].stream != stream) continue;
    sim->captures[i] = sim->captures[--sim->num_captures];
    found = true;
  }
  pthread_mutex_unlock(&sim->lock);
  if (!found)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_sim_end_capture: stream 0x%lx is not capturing", (unsigned long)stream);
  return GPUMEM_OK;
}
