/* The device allocator object: creation over a backend, the malloc and
 * free paths under one lock, the two policies' segment rules, limits, the
 * retry ladder on out-of-memory and its report, statistics and the
 * per-device default instances.
 *
 * Policies. `pytorch` follows PyTorch's native caching allocator: sizes
 * rounded to 512 B; requests up to 1 MiB from 2 MiB segments, 1-10 MiB from
 * 20 MiB segments, larger ones rounded to 2 MiB with their own segment; a
 * large block is split only if more than 1 MiB remains; segments come from
 * the backend's plain alloc and go back only on empty_cache or out of
 * memory. `default` tiles one reserved address range per stream and pool at
 * 512 B granularity and maps physical pages under it on demand (pages.c);
 * on a backend without virtual memory it falls back to the pytorch rules. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

gpumem_status_t gm_backend_status(gpumem_t* gm, int call, gpumem_status_t s) {
  (void)gm;
  if (GM_UNLIKELY(s != GPUMEM_OK && s != GPUMEM_NOT_READY && !gm_call_wrote_message())) {
    gpumem_set_last_error("backend %s call failed: %s", gpumem_backend_call_name(call),
                          gpumem_strerror(s));
  }
  return s;
}

void gm_segment_link(gpumem_t* gm, gm_segment* seg) {
  seg->prev_seg = NULL;
  seg->next_seg = gm->segments;
  if (gm->segments) gm->segments->prev_seg = seg;
  gm->segments = seg;
}

void gm_segment_install(gpumem_t* gm, gm_segment* seg, gm_block* b, gm_pool* pool, uintptr_t addr,
                        size_t size) {
  seg->addr = addr;
  seg->size = size;
  seg->pool = pool;
  seg->first = b;
  gm_segment_link(gm, seg);
  b->addr = addr;
  b->size = size;
  b->seg = seg;
  b->pool = pool;
  b->state = GM_FREE;
  gm_index_insert(&pool->index, b);
  gm_stat_pool_add(gm, gm->stats.segment, pool->is_small, 1);
}

void gm_segment_unlink(gpumem_t* gm, gm_segment* seg) {
  if (seg->prev_seg)
    seg->prev_seg->next_seg = seg->next_seg;
  else
    gm->segments = seg->next_seg;
  if (seg->next_seg) seg->next_seg->prev_seg = seg->prev_seg;
}

/* ---- creation ---- */

static bool backend_has_vm(const gpumem_backend_t* be) {
  return be->page_size && be->reserve && be->release_range && be->create_page && be->release_page &&
         be->map && be->unmap;
}

static size_t limit_from(const gpumem_options_t* o, size_t total) {
  size_t limit = o->limit_bytes;
  if (o->limit_fraction > 0) {
    size_t frac = (size_t)((double)total * o->limit_fraction);
    if (!limit || frac < limit) limit = frac;
  }
  return limit;
}

/* Planned placement pays where memory is capped: there pages must move
 * to hold the cap, and a plan keeps a repeating loop from moving them.
 * Uncapped, placement:auto uses best fit, whose pages stay where they are
 * mapped, in large mappings (pages.c, map_run_limit). */
static bool wants_planner(const gpumem_t* gm) {
  if (!gm->virtual_memory) return false;
  if (gm->opts.placement == GPUMEM_PLACEMENT_PLANNED) return true;
  return gm->opts.placement == GPUMEM_PLACEMENT_AUTO && (gm->limit || gm->opts.shared_limit);
}

gpumem_t* gpumem_create(gpumem_backend_t* backend, const gpumem_options_t* opts,
                        gpumem_status_t* err) {
  gpumem_status_t dummy;
  if (!err) err = &dummy;
  gpumem_options_t o;
  gpumem_options_init(&o);
  if (opts) {
    if (opts->struct_size != sizeof(gpumem_options_t)) {
      *err = gm_fail(
          GPUMEM_ERR_INVALID_ARGUMENT,
          "gpumem_create: options.struct_size is %u, expected %zu (call gpumem_options_init)",
          opts->struct_size, sizeof(gpumem_options_t));
      return NULL;
    }
    o = *opts;
  }
  if (!backend) {
    *err = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_create: backend is NULL");
    return NULL;
  }
  if (backend->version < 1 || backend->version > GPUMEM_BACKEND_VERSION) {
    *err = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_create: backend \"%s\" has version %u, expected 1 to %d",
                   backend->name ? backend->name : "?", backend->version, GPUMEM_BACKEND_VERSION);
    return NULL;
  }
  bool has_plain = backend->alloc && backend->free;
  bool has_vm = backend_has_vm(backend);
  if ((!has_plain && !has_vm) || !backend->mem_info) {
    *err = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_create: backend \"%s\" lacks mem_info or both the plain and the virtual "
                   "memory slots",
                   backend->name ? backend->name : "?");
    return NULL;
  }
  if (has_vm && (backend->page_size & (backend->page_size - 1))) {
    *err =
        gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                "gpumem_create: backend page_size %zu is not a power of two", backend->page_size);
    return NULL;
  }
  if (o.policy != GPUMEM_POLICY_DEFAULT && o.policy != GPUMEM_POLICY_PYTORCH) {
    *err = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_create: unknown policy %d", (int)o.policy);
    return NULL;
  }
  if (!(o.limit_fraction >= 0 && o.limit_fraction <= 1) || !(o.headroom >= 0 && o.headroom <= 1)) {
    *err = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_create: limit_fraction and headroom must be in [0, 1]");
    return NULL;
  }
  bool use_vm = o.policy == GPUMEM_POLICY_DEFAULT && has_vm;
  if (o.overflow != GPUMEM_OVERFLOW_OFF && o.overflow != GPUMEM_OVERFLOW_HOST) {
    *err = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_create: unknown overflow setting %d (0: off, 1: host)", o.overflow);
    return NULL;
  }
  if (o.overflow == GPUMEM_OVERFLOW_HOST && !use_vm) {
    *err = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_create: overflow:host needs the default policy over a backend with "
                   "virtual memory (host pages are mapped under the allocator's own address "
                   "ranges); here the policy is %s and backend \"%s\" %s",
                   o.policy == GPUMEM_POLICY_PYTORCH ? "pytorch" : "default",
                   backend->name ? backend->name : "?", has_vm ? "has virtual memory" : "has none");
    return NULL;
  }
  if (!use_vm && !has_plain) {
    *err = gm_fail(GPUMEM_ERR_UNSUPPORTED,
                   "gpumem_create: the pytorch policy needs the backend's alloc/free slots");
    return NULL;
  }
  size_t free_bytes = 0, total = 0;
  gpumem_status_t st = backend->mem_info(backend->ctx, &free_bytes, &total);
  if (st != GPUMEM_OK) {
    *err = st;
    return NULL;
  }
  /* A fraction so small that the limit rounds to 0 bytes would read as "no
   * limit" below (0 means none) and silently drop the cap it asked for. */
  if (o.limit_fraction > 0 && (size_t)((double)total * o.limit_fraction) == 0) {
    *err = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_create: limit fraction %g of the device's %zu bytes is 0 bytes: it "
                   "would remove the limit instead of setting one",
                   o.limit_fraction, total);
    return NULL;
  }
  gpumem_t* gm = calloc(1, sizeof *gm);
  if (!gm) {
    *err = gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_create: out of host memory");
    return NULL;
  }
  gm->stats.backend_calls[GPUMEM_CALL_mem_info] = 1;
  if (gm_lock_init(&gm->lock) != 0 || gm_ptr_map_init(&gm->ptrs) != GPUMEM_OK) {
    free(gm);
    *err =
        gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_create: cannot initialize the lock or pointer map");
    return NULL;
  }
  gm->backend = backend;
  gm->opts = o;
  gm->virtual_memory = use_vm;
  gm->page_size = use_vm ? backend->page_size : 0;
  while (use_vm && ((size_t)1 << gm->page_shift) < gm->page_size) gm->page_shift++;
  gm->device_total = total;
  gm->limit = limit_from(&o, total);
  /* An arena spans the whole device twice over: holes are unmapped, so the
   * address space a pool walks can exceed its physical memory. */
  if (use_vm) gm->arena_size = gm_round_up(total ? total * 2 : GM_GIB, gm->page_size);
  gm->map_max_pages =
      use_vm && o.map_max_bytes > gm->page_size ? o.map_max_bytes / gm->page_size : 1;
  gm->device_index = -1;
  gm->tier_retry_below = UINT64_MAX;
  /* the file itself is made at the first publication (publish.c) */
  gm->publish_wanted = gm_publish_wanted(gm);
  if (wants_planner(gm)) {
    gpumem_status_t pst = gm_plan_init(gm);
    if (pst != GPUMEM_OK) {
      gm_ptr_map_destroy(&gm->ptrs);
      gm_lock_destroy(&gm->lock);
      free(gm);
      *err = pst;
      return NULL;
    }
  }
  gpumem_status_t bst = gm_budget_init(gm);
  if (bst == GPUMEM_OK && o.record[0]) bst = gm_record_start(gm, o.record);
  if (bst != GPUMEM_OK) {
    gm_budget_destroy(gm);
    gm_plan_destroy(gm);
    gm_ptr_map_destroy(&gm->ptrs);
    gm_lock_destroy(&gm->lock);
    free(gm);
    *err = bst;
    return NULL;
  }
  *err = GPUMEM_OK;
  return gm;
}

/* A plain segment's memory comes from, and goes back to, the backend, or
 * its pool's segment source where the pool has one (graphpool.c; a
 * source's free cannot fail). */
static gpumem_status_t plain_memory_alloc(gpumem_t* gm, gm_pool* pool, size_t size,
                                          uintptr_t* addr) {
  if (GM_UNLIKELY(pool->source)) return gm_graph_pool_source_alloc(pool, size, addr);
  return GM_CALL(gm, alloc, gm->backend->alloc(gm->backend->ctx, size, addr));
}

static gpumem_status_t plain_memory_free(gpumem_t* gm, gm_segment* seg) {
  if (GM_UNLIKELY(seg->pool->source)) {
    gm_graph_pool_source_free(seg);
    return GPUMEM_OK;
  }
  return GM_CALL(gm, free, gm->backend->free(gm->backend->ctx, seg->addr, seg->size));
}

static void release_all_segments(gpumem_t* gm) {
  gm_segment* seg = gm->segments;
  while (seg) {
    gm_segment* next = seg->next_seg;
    gm_block* b = seg->first;
    while (b) {
      gm_block* nb = b->next;
      gm_block_delete(gm, b);
      b = nb;
    }
    if (seg->is_arena) {
      gm_arena_destroy(gm, seg);
    } else {
      plain_memory_free(gm, seg);
      free(seg);
    }
    seg = next;
  }
  gm->segments = NULL;
}

void gpumem_destroy(gpumem_t* gm) {
  if (!gm) return;
  if (gm->opts.leak_check && !gm->leak_checked) gm_leak_check_report(gm, "at destroy");
  gm_lock_acquire(&gm->lock);
  gm_history_destroy(gm);
  gm_record_destroy(gm);
  gm_ipc_destroy(gm);
  gm_publish_close(gm);
  /* Wait for pending frees: their memory may still be in use on a stream. */
  if (gm->pending_count && gm->backend->event_sync) gm_process_events(gm, true);
  gm_overflow_destroy(gm);
  gm_events_destroy(gm);
  release_all_segments(gm);
  gm_release_spare_pages(gm, 0);
  free(gm->spare_pages);
  free(gm->phys);
  free(gm->aliases);
  free(gm->spare_runs);
  gm_streams_destroy(gm);
  gm_graph_pools_destroy(gm);
  gm_ptr_map_destroy(&gm->ptrs);
  gm_slab_destroy(&gm->slab);
  gm_plan_destroy(gm);
  gm_budget_destroy(gm);
  free(gm->callbacks);
  gm_lock_release(&gm->lock);
  gm_lock_destroy(&gm->lock);
  if (gm->opts.own_backend && gm->backend->destroy) gm->backend->destroy(gm->backend);
  free(gm);
}

/* ---- the pytorch rules ---- */

static inline size_t round_request(size_t size) {
  return size < GM_MIN_BLOCK ? GM_MIN_BLOCK : gm_round_up(size, GM_MIN_BLOCK);
}

static inline size_t segment_size_for(size_t rsize) {
  if (rsize <= GM_SMALL_SIZE) return GM_SMALL_BUFFER;
  if (rsize < GM_MIN_LARGE_ALLOC) return GM_LARGE_BUFFER;
  return gm_round_up(rsize, GM_ROUND_LARGE);
}

/* b, a free block of pool: in an arena (arena: pool->maps_pages, read
 * once by the caller: reloaded after the stores around it, it cost ~5
 * instructions an operation) a block is split whenever a minimum block is
 * left over; in a plain segment by PyTorch's rules. */
static inline bool should_split(const gpumem_t* gm, const gm_pool* pool, bool arena,
                                const gm_block* b, size_t rsize) {
  size_t remaining = b->size - rsize;
  if (pool->is_small || arena) return remaining >= GM_MIN_BLOCK;
  size_t max_split = gm->opts.max_split_size ? gm->opts.max_split_size : SIZE_MAX;
  return rsize < max_split && remaining > GM_SMALL_SIZE;
}

/* PyTorch's get_free_block, max_split_size rules included. A pool that
 * never splits (no_split) hands out only blocks that are a whole segment;
 * one split before the option was set is left alone. */
static gm_block* find_free(gpumem_t* gm, gm_pool* pool, size_t rsize) {
  gm_block* b = gm_index_find(&pool->index, rsize);
  if (GM_UNLIKELY(pool->no_split) && b && (b->prev || b->next)) return NULL;
  if (!b || !gm->opts.max_split_size || pool->maps_pages) return b;
  size_t max_split = gm->opts.max_split_size;
  if (rsize < max_split && b->size >= max_split) return NULL;
  if (rsize >= max_split && b->size >= rsize + GM_LARGE_BUFFER) return NULL;
  return b;
}

static bool over_limit(const gpumem_t* gm, size_t extra) {
  if (!gm->limit) return false;
  uint64_t reserved = (uint64_t)gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current;
  return reserved + extra > gm->limit;
}

/* A new plain segment for the pytorch rules; its one block is indexed. */
static gpumem_status_t new_plain_segment(gpumem_t* gm, gm_pool* pool, size_t seg_size,
                                         gm_block** out) {
  if (over_limit(gm, seg_size)) {
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                   "a new %zu-byte segment would pass the limit of %zu bytes", seg_size, gm->limit);
  }
  gm_segment* seg = calloc(1, sizeof *seg);
  gm_block* b = gm_block_new(gm);
  if (!seg || !b) {
    free(seg);
    if (b) gm_block_delete(gm, b);
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory for a segment");
  }
  gpumem_status_t st = gm->budget ? gm_budget_take(gm, seg_size) : GPUMEM_OK;
  uintptr_t addr = 0;
  if (st == GPUMEM_OK) {
    st = plain_memory_alloc(gm, pool, seg_size, &addr);
    if (st != GPUMEM_OK && gm->budget) gm_budget_give(gm, seg_size);
  }
  if (st != GPUMEM_OK) {
    free(seg);
    gm_block_delete(gm, b);
    return st;
  }
  gm->stats.num_device_alloc++;
  gm_segment_install(gm, seg, b, pool, addr, seg_size);
  gm_stat_pool_add(gm, gm->stats.reserved_bytes, pool->is_small, (int64_t)seg_size);
  *out = b;
  return GPUMEM_OK;
}

/* Releases a plain segment whose single block is free and indexed. */
static gpumem_status_t release_plain_segment(gpumem_t* gm, gm_block* b);
gpumem_status_t gm_release_plain_segment(gpumem_t* gm, gm_block* b) {
  if (gm_block_is_split(b) || b->state != GM_FREE) return GPUMEM_ERR_INVALID_ARGUMENT;
  return release_plain_segment(gm, b);
}
static gpumem_status_t release_plain_segment(gpumem_t* gm, gm_block* b) {
  gm_segment* seg = b->seg;
  gpumem_status_t st = plain_memory_free(gm, seg);
  if (st != GPUMEM_OK) return st;
  gm->stats.num_device_free++;
  gm_index_remove(&b->pool->index, b);
  gm_stat_pool_add(gm, gm->stats.segment, b->pool->is_small, -1);
  gm_reserved_released(gm, b->pool->is_small, seg->size);
  gm_segment_unlink(gm, seg);
  free(seg);
  gm_block_delete(gm, b);
  return GPUMEM_OK;
}

typedef struct release_state {
  gpumem_t* gm;
  gpumem_status_t status;
  size_t released;
} release_state;

static void release_if_whole(gm_block* b, void* arg) {
  release_state* rs = arg;
  if (rs->status != GPUMEM_OK || gm_block_is_split(b) || b->seg->is_arena) return;
  size_t size = b->size;
  gpumem_status_t st = release_plain_segment(rs->gm, b);
  if (st == GPUMEM_OK)
    rs->released += size;
  else
    rs->status = st;
}

/* Frees every cached plain segment that holds no allocation. */
static gpumem_status_t release_plain_cache(gpumem_t* gm, size_t* released) {
  release_state rs = {gm, GPUMEM_OK, 0};
  for (gm_stream* s = gm->streams; s; s = s->next) {
    for (int i = 0; i < GM_NUM_POOLS; i++)
      gm_index_visit(&s->pools[i].index, release_if_whole, &rs);
  }
  if (released) *released = rs.released;
  return rs.status;
}

/* PyTorch's release_available_cached_blocks: with max_split_size set, frees
 * the smallest whole cached large segment that covers the request, else
 * the largest ones until enough is freed. */
typedef struct available_state {
  size_t want;
  gm_block* best_fit;
  gm_block** candidates;
  size_t count, capacity;
} available_state;

static void collect_whole(gm_block* b, void* arg) {
  available_state* as = arg;
  if (gm_block_is_split(b)) return;
  if (b->size >= as->want && (!as->best_fit || b->size < as->best_fit->size)) as->best_fit = b;
  if (as->count < as->capacity) as->candidates[as->count++] = b;
}

static int by_size_desc(const void* a, const void* b) {
  const gm_block* x = *(gm_block* const*)a;
  const gm_block* y = *(gm_block* const*)b;
  return x->size < y->size ? 1 : x->size > y->size ? -1 : 0;
}

static bool release_available(gpumem_t* gm, gm_pool* pool, size_t rsize) {
  if (!gm->opts.max_split_size || pool->is_small || pool->maps_pages) return false;
  size_t n = pool->index.count;
  if (!n) return false;
  available_state as = {rsize, NULL, malloc(n * sizeof(gm_block*)), 0, n};
  if (!as.candidates) return false;
  gm_index_visit(&pool->index, collect_whole, &as);
  bool ok = false;
  if (as.best_fit) {
    ok = release_plain_segment(gm, as.best_fit) == GPUMEM_OK;
  } else {
    qsort(as.candidates, as.count, sizeof *as.candidates, by_size_desc);
    size_t freed = 0;
    for (size_t i = 0; i < as.count && freed < rsize; i++) {
      size_t sz = as.candidates[i]->size;
      if (release_plain_segment(gm, as.candidates[i]) != GPUMEM_OK) break;
      freed += sz;
    }
    ok = freed >= rsize;
  }
  free(as.candidates);
  return ok;
}

/* ---- the malloc path ---- */

/* Bytes of the free range [a, e) that lie in pages it does not cover
 * whole: memory reclaim cannot take back while the range's neighbours
 * live. */
static size_t hole_edge_waste(const gpumem_t* gm, uintptr_t a, uintptr_t e) {
  uintptr_t mask = (uintptr_t)gm->page_size - 1;
  uintptr_t first_whole = (a + mask) & ~mask, end_whole = e & ~mask;
  if (first_whole >= end_whole) return e - a;
  return (first_whole - a) + (e - end_whole);
}

/* The free block at an arena's top (the pool's largest), or NULL. */
static inline gm_block* arena_tail(gm_pool* pool) {
  gm_block* tail = gm_index_largest(&pool->index);
  return tail && !tail->next && tail->seg->is_arena ? tail : NULL;
}

/* Best fit sees an arena's free tail as one huge block, so it prefers any
 * hole to the free bytes at the top of what the arena has walked; that
 * leaves the top unused and the holes taken, and the next request that
 * fits no hole walks further. Where nothing moves pages (reserved memory
 * is the address space walked), the tail counts as a block of the size it
 * has below the arena's highest mapped page, as cudaMallocAsync's pool
 * grows by joining the free block at its top: llama_ckpt_train's peak
 * reserved fell from 1.1494 to 1.1043 x peak live (simulated device), the
 * other bundled traces moved by under 0.0005 (synth_kvcache rose from
 * 1.0573 to 1.0764). Under a limit pages move, and the holes'
 * pages are better taken first (min limits unchanged). b is best fit's
 * choice, a block with a successor (not a tail) larger than rsize.
 *
 * Only for a hole larger than GM_WALKED_TAIL_MIN_HOLE. A hole of a few
 * tens of MiB is what one step's tensor leaves for the next step's: in
 * greedy decoding with a dynamic KV cache each layer's cache block of the
 * last token is freed as the one a token longer is made. Passed over for
 * the tail's room, those holes stay empty while the live cache moves up
 * the arena, and it walks further each time the tail's room runs out:
 * GPT-2 small decoding batch 32 for 1024 tokens (CPU recording,
 * traces/jobs/decode_gpt2_b32_long) reserved 1.2090 x peak live, 1.1078
 * with this bound, where the expandable-segments model reserves 1.1091.
 * The holes the rule was made for are a job's largest tensors' (llama's
 * 1000 MB logits, graphsage's 737 MiB and 1.44 GiB blocks: 1.5690 x with
 * the rule off, 1.0420 with it, before the rule for huge blocks' ahead),
 * which small requests would split. The
 * bound is fitted to the traces at hand, and the layout that follows is
 * sensitive to it (simulated, bench/bounds_by_setting.py, with the rule
 * for huge blocks' ahead below): at 160 and 256 MiB the same traces hold
 * the bounds; at 128 MiB synth_random reserves 1.2342 x, at 192 1.1935
 * (1.1418 here); 64 MiB put beam search at 1.0830 (1.0541 here), 96 MiB
 * the decode at 1.1253. */
#define GM_WALKED_TAIL_MIN_HOLE ((size_t)256 << 20)

static gm_block* prefer_walked_tail(const gpumem_t* gm, gm_pool* pool, gm_block* b, size_t rsize) {
  if (b->size <= GM_WALKED_TAIL_MIN_HOLE) return b;
  gm_block* tail = arena_tail(pool);
  if (!tail || tail == b) return b;
  uintptr_t walked = tail->seg->addr + tail->seg->mapped_end * gm->page_size;
  if (walked <= tail->addr) return b;
  size_t below = walked - tail->addr;
  return below >= rsize && below < b->size ? tail : b;
}

/* A run of allocations made with no free between them that had to go to
 * the arena's tail (no hole held them) is building state that lives on
 * together: a model's parameters, an optimizer's moments. Best fit would
 * scatter the rest of such a run into the holes that transient tensors
 * left, where, long-lived, they split the room those tensors' successors
 * need. Once two allocations in a row went to the tail for want of a hole,
 * the run's next ones follow them there until the stream frees something.
 * Measured (simulated device, peak reserved / peak live, no limit):
 * llama_ckpt_train 1.1043 -> 1.0803 (its optimizer states, 150 blocks
 * allocated in one run after two 250 MB ones, no longer split the holes
 * its 1000 MB logits need later), t5_varlen_prefetch 1.0354 -> 1.0353,
 * synth_random 1.1978 -> 1.1822, the other bundled and synthetic traces
 * unchanged; the first pass's mapping calls rise where a run grows the
 * arena block by block (llama 184 -> 208, t5 534 -> 577). Following
 * after one such allocation instead of two scattered gpt2's layers
 * (1.0720); after three, llama's run is lost to the holes (1.15). Only
 * where nothing moves pages, as prefer_walked_tail: under a limit the
 * holes' pages are better used first. */
#define GM_TAIL_RUN_FOLLOW 2

static inline bool follows_tail_run(const gm_pool* pool) {
  return pool->tail_run >= GM_TAIL_RUN_FOLLOW && pool->tail_run_frees == pool->stream->frees_total;
}

/* Such a run grows the arena block by block, one mapping (~48 us on an
 * H100: create, map, grant access) per block, about what a cudaMalloc
 * costs; a job whose shapes never repeat pays it at each new largest
 * shape. So where a block of a run walks past the arena's highest mapped
 * page, its mapping takes room for the run's next blocks too: twice the
 * block, at most the map_ahead setting (the pages above are free, and
 * best fit takes them next by prefer_walked_tail). What is mapped and not
 * used when the run stops is at most that much per arena, cached and
 * reclaimable. Only where nothing moves pages (mappings of several pages,
 * no limit or budget, growth that needed no reclaim: pages.c), so min
 * limits do not change. Measured (simulated device, default settings,
 * priced mapping work of the first pass in us per operation, and peak
 * reserved / peak live): gpt2 0.450 -> 0.211 (1.0695 both), llama 0.379 ->
 * 0.197 (1.0803 -> 1.0926), resnet 0.428 -> 0.235 (1.0034 -> 1.0037), t5
 * 0.111 -> 0.053 (1.0353 -> 1.0350), synth_streams 0.778 -> 0.381 and
 * synth_varlen 1.285 -> 0.434; the pytorch policy's cudaMalloc growth
 * costs 0.283, 0.283, 0.317, 0.054, 0.739 and 0.980 there. Unbounded,
 * llama rose to 1.1283 (from a run's first block on, 1.1402, and t5 to
 * 1.0854); at most 256 MiB llama 1.1252; at 96 MiB t5 1.0507, at 64 MiB
 * synth_streams stayed at 0.519: the bundled traces' peaks sit within
 * 0.0004 x of the best peer's (gpt2, t5), and the cap is where none of
 * them passes it. The cap is the map_ahead setting (default 128 MiB; 0:
 * nothing ahead): where a job's live peak is the end of such a run, what
 * it mapped ahead is part of the peak (gpt2_generate 1.0406 x peak live,
 * 1.0006 with map_ahead:0; BENCHMARKS.md). */
#define GM_TAIL_RUN_AHEAD_FACTOR 2

/* A block of GM_AHEAD_HUGE_BLOCK or more maps at most GM_AHEAD_HUGE_MAX
 * ahead of itself. A run's blocks are alike, and the cap's room cannot
 * hold a next block that large, so what such a block maps ahead serves only
 * the smaller blocks after it; where it ends the job's live peak it is all
 * above the peak: gpt2_generate's fp32 weights end in a 245 MiB block,
 * whose 128 MiB ahead put the job at 1.0406 x peak live, 1.0031 with 8 MiB
 * (the better peer model: 1.0006). 8 MiB rather than none, for the small
 * blocks that follow a huge one: graphsage_varlen's first pass costs 0.443
 * us/op so, 0.563 with none. The threshold is fitted to the traces at hand
 * (simulated, bench/bounds_by_setting.py): synth_streams' blocks of up to
 * 160 MiB need their ahead (with 128 MiB here its first pass costs 0.521
 * us/op), gpt2_generate's 245 MiB block is above it. */
#define GM_AHEAD_HUGE_BLOCK ((size_t)160 << 20)
#define GM_AHEAD_HUGE_MAX ((size_t)8 << 20)

/* A block at least GM_AHEAD_SPIKE times the run's block before it is no
 * sample of the run's next blocks either: it maps ahead as that block
 * would. A greedy generate() makes cuBLAS's 32 MiB workspace at its first
 * matmul, in a run after a 1.1 MiB activation; twice the workspace ahead
 * (64 MiB) held the decode's live peak up, and the next blocks are the
 * activations' size again. GPT-2 small at batch 8, prompt 32, 64 new
 * tokens (CPU recorder): 1.2093 -> 1.0263 x peak live, against the pytorch
 * policy's 1.1701 (the best peer model + 0.010: 1.0297); six of 22 such
 * recordings of GPT-2 sizes, batches and lengths were above the pytorch
 * policy by this, none after (BENCHMARKS.md). Fitted: at 8, gpt2_train's
 * first pass rose from 0.211 to 0.213 us/op and resnet50's 0.230 to
 * 0.238; at 16 the bundled and synthetic traces move by at most 0.016
 * us/op (lightning_gpt2 0.847 -> 0.863) and resnet_multiscale from 1.0071
 * to 1.0114 (its bound 1.0120); at 32 the decode's 28-fold spike is not
 * caught. Below GM_AHEAD_HUGE_BLOCK: a huge block has its own cap, which
 * graphsage's first pass needs (0.412 -> 0.532 us/op with this instead). */
#define GM_AHEAD_SPIKE 16

/* A block outside a run that walks past the arena's highest mapped page
 * by less than a GM_REGROWTH_SHARE-th of itself lies almost all on pages
 * mapped before: a shape a little larger than one made there earlier, a
 * varying-shape job's largest tensor made again at a new largest size.
 * The second time a pool sees one, its job is such a job, whose next,
 * larger shape comes there too: the mapping goes on as far again past
 * the block's end, and the next growth by as much needs no mapping.
 * graphsage_varlen's 1.4 GiB block grew the arena by 38, 62 and, in the
 * trace's second half, 4 MiB, one mapping each; with this the last needs
 * none (simulated device, bench/bounds_by_setting.py: second half 0.063
 * -> 0.000 us/op against native's 0.057, first pass 0.443 -> 0.412, peak
 * 1.0420 -> 1.0644 x peak live against the better peer model's 1.0861),
 * and no other trace moves. Not the first time: a one-off tensor that
 * lands in the room a larger one left is no such job, and what it maps
 * ahead lies above its peak (GPT-2 small predicted at batch 64 from
 * tests/predict, its 6.1 GiB logits 271 MiB past the top: 1.1185 ->
 * 1.1227 x, above the pytorch policy's 1.1202). The share is fitted: at
 * 8 decode_gpt2_b32_long rose from 1.1078 to 1.1105, at 4 decode_llama_b16
 * from 1.0144 to 1.0192 too (both within their bounds); 16 moves no other
 * trace. As much again: the growth seen is the one measure of the next
 * (twice: graphsage 1.0893). At most the map_ahead setting, and only
 * where nothing moves pages, as the run's ahead (pages.c). */
#define GM_REGROWTH_SHARE 16

/* A block alone between frees (tail_run 1) that walks past the highest
 * mapped page by more than that is a growth of its own, one mapping each.
 * Where an arena that had stood still for GM_LONE_QUIET_ALLOCS allocations
 * starts growing so, and goes on growing within GM_LONE_NEXT_ALLOCS of each
 * growth, the job has come to a new largest shape: a varying-shape job's
 * step whose every layer's output is larger than before, freed and made
 * block by block. Native's cache, larger, holds room for the step's
 * smaller tensors; the default's arena grows at each. From the
 * GM_LONE_AHEAD_FROM-th growth of such a climb on, the mapping goes on
 * twice the previous growth's block past this block's end (the run's
 * factor, GM_TAIL_RUN_AHEAD_FACTOR; at most map_ahead), and the next
 * layers' blocks land on pages mapped already. resnet_multiscale's live
 * peak is such a climb late in the job, 23 mappings in its second half:
 * with this 0.123 -> 0.048 us/op there (native's cudaMalloc growth 0.058),
 * first pass 0.431 -> 0.343, peak 1.0028 -> 1.0071 x peak live (the
 * better peer model + 0.010: 1.0120); bert_varlen_train 1.0182 -> 1.0171,
 * synth_kvcache's first pass 0.007 -> 0.006, no other row moves
 * (simulated device, bench/bounds_by_setting.py). The constants are
 * fitted: from the second growth, synth_kvcache (whose climbs, a KV cache
 * a step longer, are three growths; its last is the job's peak) rose from
 * 1.0317 to 1.0726, above its 1.0405; as much as the previous block rather
 * than twice leaves resnet's second half at 0.075. The quiet span holds
 * from 500 to 2000 allocations and the next growth's from 50 to 1000 with
 * no bound failing that holds without the rule; one span of 500 for both
 * put distill_side_stream at 1.4864 (over its 1.4836), of 2000
 * synth_kvcache at 1.0726. A training job's first step grows from the
 * start, with no quiet span before it, and is left to runs. Only where
 * nothing moves pages, as the run's ahead (pages.c). */
#define GM_LONE_QUIET_ALLOCS 1000
#define GM_LONE_NEXT_ALLOCS 100
#define GM_LONE_AHEAD_FROM 3

static size_t lone_growth_ahead(const gpumem_t* gm, gm_pool* pool, size_t rsize) {
  uint64_t since = gm->num_mallocs - pool->lone_growth_serial;
  size_t previous = pool->lone_growth_size;
  pool->lone_growth_serial = gm->num_mallocs;
  pool->lone_growth_size = rsize;
  if (since >= GM_LONE_QUIET_ALLOCS)
    pool->lone_growths = 1;
  else if (pool->lone_growths && since <= GM_LONE_NEXT_ALLOCS)
    pool->lone_growths++;
  else
    pool->lone_growths = 0;
  if (pool->lone_growths < GM_LONE_AHEAD_FROM) return 0;
  size_t ahead = GM_TAIL_RUN_AHEAD_FACTOR * previous, cap = gm->opts.map_ahead_bytes;
  return ahead < cap ? ahead : cap;
}

static GM_COLD size_t regrowth_ahead(const gpumem_t* gm, gm_pool* pool, const gm_block* b,
                                     size_t rsize) {
  uintptr_t top = b->seg->addr + (b->seg->mapped_end << gm->page_shift), end = b->addr + rsize;
  if (end <= top) return 0;
  size_t past = end - top;
  if (past >= rsize / GM_REGROWTH_SHARE) return lone_growth_ahead(gm, pool, rsize);
  if (!pool->regrowths++) return 0;
  return past < gm->opts.map_ahead_bytes ? past : gm->opts.map_ahead_bytes;
}

static inline size_t tail_run_ahead(const gpumem_t* gm, gm_pool* pool, const gm_block* b,
                                    size_t rsize) {
  /* (the run first: on a warm path blocks come from holes, tail_run 0,
   * and that is all it costs; a block past the top went to the tail for
   * want of a hole, tail_run 1 or more. A small pool has no runs, and its
   * arenas are left as they were, not measured.) */
  if (GM_LIKELY(!follows_tail_run(pool)))
    return pool->tail_run && !pool->is_small ? regrowth_ahead(gm, pool, b, rsize) : 0;
  if (pool->is_small) return 0;
  size_t sample = rsize, prev = pool->tail_run_prev;
  if (rsize < GM_AHEAD_HUGE_BLOCK && prev && rsize / prev >= GM_AHEAD_SPIKE) sample = prev;
  size_t ahead = GM_TAIL_RUN_AHEAD_FACTOR * sample, cap = gm->opts.map_ahead_bytes;
  if (ahead > cap) ahead = cap;
  return rsize >= GM_AHEAD_HUGE_BLOCK && ahead > GM_AHEAD_HUGE_MAX ? GM_AHEAD_HUGE_MAX : ahead;
}

static inline void note_tail_run(gm_pool* pool, bool at_tail_for_want_of_hole, size_t rsize) {
  if (!at_tail_for_want_of_hole) {
    pool->tail_run = 0;
    return;
  }
  if (pool->tail_run_frees != pool->stream->frees_total) {
    pool->tail_run = 0;
    pool->tail_run_frees = pool->stream->frees_total;
  }
  pool->tail_run_prev = pool->tail_run ? pool->tail_run_last : 0;
  pool->tail_run_last = rsize;
  pool->tail_run++;
}

/* (inlined into its callers: on the malloc path a call costs ~20
 * instructions per operation, measured with bench/ir_per_op.sh) */
#if defined(__GNUC__)
#define GM_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define GM_ALWAYS_INLINE inline
#endif
static GM_ALWAYS_INLINE gpumem_status_t place_block(gpumem_t* gm, gm_pool* pool, gm_block* b,
                                                    size_t rsize, gm_segment* fresh,
                                                    gm_block** out);

/* Arenas are per stream, so a job whose streams peak at different times
 * holds the sum of their peaks: a side stream's free blocks sit mapped
 * while the main stream's arena grows. cudaMallocAsync's one pool lends
 * them, making the borrower wait on the device for the frees. gpumem
 * lends them only where no stream need wait: where memory grows in runs
 * (nothing moves pages) and a large request of one stream would have to
 * grow its arena, a free block of another stream's arena whose pages are
 * all mapped serves it, provided every use of that stream's free blocks
 * is known over (a probe event queried, never waited for:
 * gm_stream_settled). The block stays the lender's, used on the
 * borrower as after record_stream: freed, it waits for an event of the
 * borrower before the lender's pool has it back. Nothing is mapped for
 * it, no page moves, and no stream waits for another. Only with lend:on:
 * simulated (events complete at their first query) synth_streams fell
 * from 1.1047 to 1.0250 x peak live and a distillation job with its
 * teacher on a side stream from 1.4458 to 1.0124, but on an H200, whose
 * host ran ahead of the device, that job reserved 4.100-4.252 GiB over
 * five runs against 4.170 without lending: the lender's probe is seldom
 * complete in time, and a lent block comes back only when the borrower's
 * queued work is done, while the lender grows meanwhile. lend:ordered
 * lends where the probe is not complete too, the borrower waiting for it
 * on the device, and gives the borrower back at once what it frees
 * (streams.c, freed_to_lender): on the H200 the same job reserved 2.939
 * GiB, but ran 4% slower than native, its streams no longer overlapping
 * (BENCHMARKS.md). */
static bool lends_instead_of_growing(gpumem_t* gm, const gm_pool* pool, const gm_block* b,
                                     size_t rsize) {
  if (!pool->maps_pages || pool->is_small || pool->is_private) return false;
  if (!gm_grows_in_runs(gm)) return false;
  /* growth from pages held but unused needs no new memory */
  if (gm->num_spare_pages) return false;
  if (b && gm_arena_range_mapped(gm, b->seg, b->addr, rsize)) return false;
  const gpumem_backend_t* be = gm->backend;
  if (!be->event_create || !be->event_record || !be->event_query || !be->event_destroy)
    return false;
  /* (events recorded during a capture would become graph nodes) */
  return !(gm_capture_possible(gm) && gm_capture_underway(gm));
}

static GM_COLD gm_block* borrow_mapped(gpumem_t* gm, gm_pool* pool, size_t rsize) {
  gm_stream* me = pool->stream;
  const gpumem_backend_t* be = gm->backend;
  const bool may_wait = gm_lends_ordered(gm);
  gm_block* best = NULL;
  gm_stream* lender = NULL;
  bool best_settled = false;
  for (gm_stream* s = gm->streams; s; s = s->next) {
    gm_pool* lp = &s->pools[GM_POOL_LARGE];
    if (s == me || lp->is_private || !lp->maps_pages) continue;
    gm_block* c = find_free(gm, lp, rsize);
    if (!c) continue;
    /* (a lender that needs no wait beats a smaller block that does) */
    if (best && best_settled && c->size >= best->size) continue;
    if (!gm_arena_range_mapped(gm, c->seg, c->addr, rsize)) continue;
    /* What another borrower freed there is ours only once s is ordered
     * after it (what we freed ourselves is ours in stream order). */
    if (s->unordered_borrower != me && gm_lender_ready(gm, s) != GPUMEM_OK) continue;
    bool settled = gm_stream_settled(gm, s);
    /* Ordered: the probe, recorded after s's last free, is what the
     * borrower would wait for (a failed record leaves none to wait for). */
    if (!settled && !(may_wait && s->probe_recorded && s->probe_frees == s->own_frees)) continue;
    if (best && !settled && (best_settled || c->size >= best->size)) continue;
    best = c;
    lender = s;
    best_settled = settled;
  }
  if (!best) return NULL;
  if (!best_settled &&
      (me->lend_waited_on != lender || me->lend_waited_frees != lender->probe_frees)) {
    /* Every use of lender's free blocks comes before its probe: the
     * borrower's work from now on comes after it on the device. A wait
     * that fails leaves the request to grow the arena instead. */
    if (GM_CALL(gm, stream_wait, be->stream_wait(be->ctx, me->handle, lender->probe_event)) !=
        GPUMEM_OK)
      return NULL;
    me->lend_waited_on = lender;
    me->lend_waited_frees = lender->probe_frees;
  }
  gm_block* b = NULL;
  /* (all mapped: placing it makes no device call) */
  if (place_block(gm, best->pool, best, rsize, NULL, &b) != GPUMEM_OK) return NULL;
  if (gm_block_add_use(b, me->handle) != GPUMEM_OK) {
    gm_free_unused(gm, b);
    return NULL;
  }
  b->lent = 1;
  gm->stats.num_blocks_lent++;
  return b;
}

/* A small arena that must grow while its stream's large arena holds
 * mapped free room in its holes creates memory that is already there.
 * Where the job's live peak is long past, those holes are room the peak
 * left: a LoRA fine-tune with activation checkpointing
 * (traces/jobs/lora_peft_ckpt) peaks while loading its weights (4.22 GiB
 * live), then trains at up to 3.41 GiB, and its small arena grew to 288
 * MiB beside 1.16 GiB of whole free pages in the large arena's holes at
 * the reserved peak. So once GM_STALE_PEAK_ALLOCS allocations have passed
 * since the allocated high-water mark last rose, a small request that the
 * small arena could hold only by mapping pages is placed by best fit in
 * the large arena of its stream instead, where the pages under it are all
 * mapped (no device call; it counts in the small pool's statistics, as
 * the request it is). Before that, the holes are a peak's that may come
 * back: the same placement at any time (small_pool:off for the overflow)
 * put synth_random at 1.2390 x peak live and gpt2_beam_serve at 1.0712,
 * above their better peer model + 0.010; placed only past the reclaim
 * mark, 1.1911 and 1.0712. Measured (simulated device,
 * bench/bounds_by_setting.py; peak reserved / peak live, priced us/op
 * of the first pass and its second half): lora_peft_ckpt 1.0964 ->
 * 1.0571 (0.122 -> 0.064, 0.010 -> 0.000), and no other row worse.
 * The window is fitted: at 1000 allocations synth_random rose to 1.1726,
 * at 8192 lora stays at 1.0835 (2000: 1.0548). Only where memory grows in
 * runs (nothing moves pages) and no spare page could serve the growth. */
#define GM_STALE_PEAK_ALLOCS 4096

static GM_COLD gm_block* small_in_large_hole(gpumem_t* gm, gm_pool* pool, size_t rsize) {
  if (!gm_grows_in_runs(gm) || gm->num_spare_pages) return NULL;
  gm_pool* lp = &pool->stream->pools[GM_POOL_LARGE];
  if (!lp->maps_pages || lp->is_private) return NULL;
  gm_block* c = find_free(gm, lp, rsize);
  if (!c || !gm_arena_range_mapped(gm, c->seg, c->addr, rsize)) return NULL;
  /* (split to the request exactly, so that its size says it is a small
   * request: gm_block_stat_small) */
  return c->size == rsize || c->size - rsize >= GM_MIN_BLOCK ? c : NULL;
}

/* One attempt to serve rsize bytes from pool, growing through the backend
 * as the policy allows. On success *out is ALLOCATED and out of the index. */
static gpumem_status_t try_alloc(gpumem_t* gm, gm_pool* pool, size_t rsize, gm_block** out) {
  if (GM_UNLIKELY(rsize > gm->device_total || (gm->limit && rsize > gm->limit))) {
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY, "%zu bytes is more than the %s of %zu bytes", rsize,
                   gm->limit && gm->limit < gm->device_total ? "limit" : "device's total memory",
                   gm->limit && gm->limit < gm->device_total ? gm->limit : gm->device_total);
  }
  gm_block* b = find_free(gm, pool, rsize);
  /* (arenas only: a pool with a segment source has plain segments) */
  if (pool->maps_pages && gm_grows_in_runs(gm) && !pool->no_split) {
    /* No hole holds it: best fit gave the arena's tail, or there is no arena yet. */
    bool for_want_of_hole = !b || !b->next;
    /* (small pools: not measured, left to best fit and prefer_walked_tail) */
    if (!pool->is_small && follows_tail_run(pool)) {
      gm_block* tail = arena_tail(pool);
      if (tail && tail->size >= rsize) {
        b = tail;
        for_want_of_hole = true;
      }
    } else if (b && b->next && b->size != rsize) {
      b = prefer_walked_tail(gm, pool, b, rsize);
    }
    if (!pool->is_small) note_tail_run(pool, for_want_of_hole, rsize);
  }
  if (GM_UNLIKELY(pool->is_small) && b && pool->maps_pages && !pool->is_private &&
      gm->num_mallocs - gm->high_water_serial >= GM_STALE_PEAK_ALLOCS &&
      !gm_arena_range_mapped(gm, b->seg, b->addr, rsize)) {
    gm_block* h = small_in_large_hole(gm, pool, rsize);
    if (h) return place_block(gm, h->pool, h, rsize, NULL, out);
  }
  /* (one test where lending is off, the default) */
  if (GM_UNLIKELY(gm->opts.lend) && gm->streams && gm->streams->next &&
      lends_instead_of_growing(gm, pool, b, rsize)) {
    gm_block* lent = borrow_mapped(gm, pool, rsize);
    if (lent) {
      *out = lent;
      return GPUMEM_OK;
    }
  }
  gm_segment* fresh = NULL;
  if (!b) {
    /* A new segment's block serves the request directly, as PyTorch's
     * alloc_block does: the max_split_size rules of find_free are for
     * cached blocks only. */
    gpumem_status_t st = pool->maps_pages
                             ? gm_arena_new(gm, pool, rsize, &b)
                             : new_plain_segment(gm, pool, segment_size_for(rsize), &b);
    if (st != GPUMEM_OK) return st;
    fresh = b->seg;
  }
  return place_block(gm, pool, b, rsize, fresh, out);
}

gpumem_status_t gm_take_cached(gpumem_t* gm, gm_pool* pool, size_t rsize, gm_block** out) {
  gm_block* b = find_free(gm, pool, rsize);
  if (!b) return GPUMEM_ERR_OUT_OF_MEMORY;
  return place_block(gm, pool, b, rsize, NULL, out);
}

/* Takes the free block b (indexed in pool; fresh: its segment when new)
 * for rsize bytes: splits off the rest and maps its pages. */
static GM_ALWAYS_INLINE gpumem_status_t place_block(gpumem_t* gm, gm_pool* pool, gm_block* b,
                                                    size_t rsize, gm_segment* fresh,
                                                    gm_block** out) {
  gm_index_remove(&pool->index, b);
  gm_dirty_remove(b);
  bool arena = pool->maps_pages;
  /* Best fit takes the front of a hole; where taking its end leaves fewer
   * free bytes stranded in partly used pages, the end (ties: the front).
   * Measured (simulated device, min limit / peak live): synth_kvcache
   * 1.0062 -> 1.0036, synth_random 1.0045 -> 1.0042, t5 1.0051 -> 1.0050,
   * at a cost on gpt2 (1.0032 -> 1.0040) and resnet (1.0034 -> 1.0037): the
   * worst case over the bundled and synthetic workloads falls from 1.0062
   * to 1.0050. Only where pages move one at a time (a limit, a budget, the
   * planner, eager reclaim: !gm_grows_in_runs), which is what the rule
   * serves. Where memory grows in runs nothing is reclaimed but what
   * fences take back, reserved memory is the address space walked, and
   * the end walks more: with the rule there the default reserved (peak /
   * peak live, no limit) gpt2_beam_serve 1.1540 against 1.0594 without it,
   * synth_random 1.2025 against 1.1301, synth_kvcache 1.0573 against
   * 1.0317 (llama_finetune_varlen 1.0307 against 1.0373 the one that
   * loses more than 0.0005). Without a block struct for the split the
   * front is taken. */
  if (arena && b->next && should_split(gm, pool, arena, b, rsize) && !gm_grows_in_runs(gm) &&
      hole_edge_waste(gm, b->addr, b->addr + b->size - rsize) <
          hole_edge_waste(gm, b->addr + rsize, b->addr + b->size)) {
    gm_block* end = gm_split_free_front(gm, b, b->size - rsize);
    if (end) b = end;
  }
  /* Split before mapping: the rest goes back to the index and its free
   * pages stay reclaimable while pages are found for this block. */
  gm_split_block(gm, b, rsize, should_split(gm, pool, arena, b, rsize) && !pool->no_split);
  b->state = GM_ALLOCATED;
  /* (a pool with a segment source has plain segments under virtual memory
   * too: no pages to map) */
  if (arena) {
    gm_arena_busy(gm, b, 1);
    gpumem_status_t st =
        gm_arena_map_range_ahead(gm, b->seg, b->addr, b->size, tail_run_ahead(gm, pool, b, rsize));
    if (st != GPUMEM_OK) {
      gm_free_unused(gm, b);
      /* An arena reserved for this request alone goes back with it. */
      if (fresh && !pool->is_private) gm_arena_release_if_unused(gm, fresh);
      /* (a private arena stays, with what it mapped, until its pool goes) */
      return st;
    }
  }
  *out = b;
  return GPUMEM_OK;
}

static void format_oom_report(gpumem_t* gm, size_t size, size_t rsize, gpumem_stream_t stream,
                              gpumem_status_t cause, const char* cause_text);

/* Frees what the cache holds for the retry ladder's second step (and for
 * empty_cache and a new limit: keep_spare false). keep_spare: the pages
 * reclaimed stay held, spare, for the retry to map where it needs them,
 * rather than going back to the device first: with the overflow tier on,
 * a request that still does not fit goes to host pages, and pages given
 * back at every such request would be made again at the next step's
 * growth (on gpt2_train under a limit of 8G, 4,183 releases and 8,122
 * creates in one pass). */
static gpumem_status_t free_cached_memory(gpumem_t* gm, bool keep_spare) {
  gpumem_status_t st = GPUMEM_OK;
  /* During a graph capture both need calls CUDA refuses then (event and
   * stream synchronizations, cudaFree): nothing is freed. */
  if (GM_UNLIKELY(gm_capture_possible(gm)) && gm_capture_underway(gm)) return GPUMEM_OK;
  if (GM_UNLIKELY(gm->num_capture_deferred)) gm_capture_flush(gm);
  if (gm->pending_count) {
    gm->stats.num_sync_all_streams++;
    st = gm_process_events(gm, true);
    if (st != GPUMEM_OK) return st;
  }
  /* A released pool whose memory a failed device call kept back holds
   * cached, unused memory too (PyTorch's release_cached_blocks frees such
   * pools as well). */
  if (GM_UNLIKELY(gm->graph_pools != NULL)) gm_graph_pools_release_idle(gm);
  /* freed overflow-tier blocks waiting for their stream (overflow.c) */
  if (GM_UNLIKELY(gm->tier_retiring != NULL)) gm_overflow_retire(gm, true);
  if (gm->virtual_memory) {
    size_t pages = 0;
    st = gm_reclaim(gm, 0, &pages);
    if (st == GPUMEM_OK && !keep_spare) st = gm_release_spare_pages(gm, 0);
    return st;
  }
  return release_plain_cache(gm, NULL);
}

/* Which pool serves a rounded request (see GM_NUM_POOLS). With
 * small_pool:off (default policy) every request goes to the large arenas,
 * as to cudaMallocAsync's one pool: small blocks then take the room large
 * blocks leave in partly used pages instead of pages of their own.
 * Measured (simulated device, peak reserved / peak live, no limit;
 * BENCHMARKS.md): lora_peft_ckpt 1.0964 -> 1.0298, t5_varlen_prefetch
 * 1.0310 -> 1.0246, llama_finetune_varlen 1.0373 -> 1.0305, the
 * llama serving recording 1.0515 -> 1.0501; but long-lived small blocks in
 * large holes split the room later large tensors need: gpt2_train 1.0691
 * -> 1.1149, llama_ckpt_train 1.0926 -> 1.1494, graphsage_varlen 1.0420
 * -> 1.6299. Hence PyTorch's split by default. */
static inline int pool_index(const gpumem_t* gm, size_t rsize) {
  if (rsize <= GM_SMALL_SIZE && (gm->opts.small_pool || !gm->virtual_memory)) return GM_POOL_SMALL;
  return GM_POOL_LARGE;
}

void gm_note_allocated(gpumem_t* gm, gm_block* b, size_t size, bool small, gpumem_stream_t stream) {
  b->requested = size;
  b->serial = ++gm->num_mallocs;
  b->tag = gm->history_tag;
  gm_stat_pool_grow(gm->stats.allocation, small, 1);
  gm_stat_pool_grow(gm->stats.allocated_bytes, small, (int64_t)b->size);
  gm_stat_pool_grow(gm->stats.active, small, 1);
  gm_stat_pool_grow(gm->stats.active_bytes, small, (int64_t)b->size);
  gm_stat_pool_grow(gm->stats.requested_bytes, small, (int64_t)size);
  if ((uint64_t)gm->stats.allocated_bytes[GPUMEM_POOL_ALL].current > gm->allocated_high_water) {
    gm->allocated_high_water = (uint64_t)gm->stats.allocated_bytes[GPUMEM_POOL_ALL].current;
    gm->high_water_serial = gm->num_mallocs;
  }
  gm_history_add(gm, GM_HISTORY_ALLOC, b->addr, b->size, stream);
  gm_record(gm, 'a', b->serial, size, stream);
}

/* The overflow tier's turn (option overflow:host), where the device path
 * failed: cold tier blocks move to host and the device is tried again,
 * else the request gets host pages. On failure the message keeps the
 * device's cause and adds the host's. */
static GM_COLD gpumem_status_t overflow_alloc(gpumem_t* gm, gm_pool* pool, size_t rsize,
                                              gm_block** out) {
  char cause[512];
  snprintf(cause, sizeof cause, "%s", gpumem_last_error());
  bool retry = false;
  gpumem_status_t st = gm_overflow_make_room(gm, rsize, &retry);
  if (st == GPUMEM_OK) st = retry ? try_alloc(gm, pool, rsize, out) : GPUMEM_ERR_OUT_OF_MEMORY;
  if (st == GPUMEM_OK) return st;
  st = gm_overflow_alloc(gm, pool, rsize, out);
  if (st != GPUMEM_OK) {
    char host[512];
    snprintf(host, sizeof host, "%s", gpumem_last_error());
    gpumem_set_last_error("%s; overflow:host: %s", cause, host);
    /* The device had no room and the tier could not take it: out of
     * memory, whatever stopped the tier (named in the message), so that
     * the caller's out-of-memory handling (PyTorch's, microbatch's) acts. */
    if (st != GPUMEM_ERR_HOST_MEMORY) st = GPUMEM_ERR_OUT_OF_MEMORY;
  }
  return st;
}

static gpumem_status_t malloc_locked(gpumem_t* gm, size_t size, gpumem_stream_t stream, void** out,
                                     bool* want_callbacks) {
  gpumem_status_t st;
  /* (no event queries while a graph may be captured: PyTorch's rule) */
  if (GM_UNLIKELY(gm->pending_count) &&
      !(GM_UNLIKELY(gm_capture_possible(gm)) && gm_capture_underway(gm))) {
    st = gm_process_events(gm, false);
    if (st != GPUMEM_OK) return st;
  }
  gm_stream* s = gm_stream_get(gm, stream);
  if (GM_UNLIKELY(!s))
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_malloc: out of host memory for a stream");
  /* Its arenas may hold blocks a borrower freed (lend:ordered): ordered
   * after that borrower before it takes any. */
  st = gm_lender_ready(gm, s);
  if (GM_UNLIKELY(st != GPUMEM_OK)) return st;
  bool private_pool = false;
  if (GM_UNLIKELY(gm->num_routes | gm->num_capture_deferred)) {
    gm_stream* ps = gm->num_routes ? gm_graph_route(gm, stream) : NULL;
    if (ps) {
      s = ps;
      private_pool = true;
    } else if (gm->num_capture_deferred) {
      gm_capture_flush(gm);
    }
  }
  size_t rsize = round_request(size);
  /* (the request's size; statistics follow the block's pool, below) */
  const bool small = rsize <= GM_SMALL_SIZE;
  gm_pool* pool = &s->pools[pool_index(gm, rsize)];
  gm_block* b = NULL;
  size_t spare_before = gm->num_spare_pages;
  st = GPUMEM_OK;
  if (gm->planner.enabled && rsize <= gm->device_total && !private_pool)
    b = gm_plan_malloc(gm, s, rsize);
  if (!b) st = try_alloc(gm, pool, rsize, &b);
  if (GM_UNLIKELY(st == GPUMEM_ERR_OUT_OF_MEMORY)) {
    /* The ladder: cached memory first (PyTorch's order), then a retry. */
    if (!private_pool && release_available(gm, pool, rsize)) st = try_alloc(gm, pool, rsize, &b);
    if (st == GPUMEM_ERR_OUT_OF_MEMORY) {
      st = free_cached_memory(gm, gm->opts.overflow == GPUMEM_OVERFLOW_HOST);
      if (st == GPUMEM_OK) {
        gm->stats.num_alloc_retries++;
        st = try_alloc(gm, pool, rsize, &b);
      }
    }
    /* Last: a large request may share a partly used page (pages.c). */
    if (st == GPUMEM_ERR_OUT_OF_MEMORY && gm->virtual_memory && !small && !b && !private_pool) {
      char cause[512];
      snprintf(cause, sizeof cause, "%s", gpumem_last_error());
      st = gm_alias_alloc(gm, pool, rsize, &b);
      if (st == GPUMEM_ERR_OUT_OF_MEMORY)
        gpumem_set_last_error("%s", cause); /* the report names the first cause */
    }
    /* Then the overflow tier, before the callbacks: a job that can go on
     * on host pages goes on (overflow.c). */
    if (GM_UNLIKELY(st == GPUMEM_ERR_OUT_OF_MEMORY && gm->opts.overflow) && !b && !private_pool) {
      gm_release_spare_pages(gm, spare_before);
      st = overflow_alloc(gm, pool, rsize, &b);
    }
    if (st == GPUMEM_ERR_OUT_OF_MEMORY && *want_callbacks) {
      if (gm->virtual_memory) gm_release_spare_pages(gm, spare_before);
      return st; /* the caller runs the callbacks and retries */
    }
    /* Last resort, after the callbacks: a pool's cached memory, where a
     * torch.cuda.MemPool(use_on_oom=True) allows it (graphpool.c). */
    if (st == GPUMEM_ERR_OUT_OF_MEMORY && !private_pool && gm->graph_pools) {
      char cause[512];
      snprintf(cause, sizeof cause, "%s", gpumem_last_error());
      /* (pages the failed attempts took go back first) */
      if (gm->virtual_memory) gm_release_spare_pages(gm, spare_before);
      st = gm_graph_pools_oom_alloc(gm, stream, pool_index(gm, rsize), rsize, &b);
      if (st == GPUMEM_OK)
        private_pool = true;
      else
        gpumem_set_last_error("%s", cause);
    }
  }
  if (GM_UNLIKELY(st != GPUMEM_OK)) {
    char cause[512];
    snprintf(cause, sizeof cause, "%s", gpumem_last_error());
    if (st == GPUMEM_ERR_OUT_OF_MEMORY) gm->stats.num_ooms++;
    /* Pages taken from the device for a request that failed go back. */
    if (gm->virtual_memory) gm_release_spare_pages(gm, spare_before);
    format_oom_report(gm, size, rsize, stream, st, cause);
    gm_publish_if_wanted(gm);
    return st;
  }
  st = gm_ptr_map_insert(&gm->ptrs, b);
  if (GM_UNLIKELY(st != GPUMEM_OK)) {
    gm_free_unused(gm, b);
    return st;
  }
  /* (the pool the block is in says which statistics it counts in: a plan
   * arena's blocks by their size, and with small_pool:off a small request
   * may be in a large arena) */
  gm_note_allocated(gm, b, size, gm_block_stat_small(b), stream);
  b->seq = gm->planner.enabled && !gm->planner.idle && !private_pool ? gm->planner.n : 0;
  gm_publish_after_op(gm);
  *out = (void*)b->addr;
  return GPUMEM_OK;
}

gpumem_status_t gpumem_malloc(gpumem_t* gm, size_t size, gpumem_stream_t stream, void** out) {
  if (GM_UNLIKELY(!gm || !out))
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_malloc: NULL allocator or out");
  *out = NULL;
  if (GM_UNLIKELY(size == 0)) return GPUMEM_OK;
  /* Far beyond any device; also keeps the rounding below from wrapping. */
  if (GM_UNLIKELY(size > ((size_t)1 << 56))) {
    gm_lock_acquire(&gm->lock);
    gm->stats.num_ooms++;
    gm_lock_release(&gm->lock);
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                   "gpumem: out of memory: tried to allocate %zu bytes, more than any device holds",
                   size);
  }
  gm_lock_acquire(&gm->lock);
  bool has_callbacks = gm->num_callbacks > 0;
  gpumem_status_t st = malloc_locked(gm, size, stream, out, &has_callbacks);
  if (GM_UNLIKELY(st == GPUMEM_ERR_OUT_OF_MEMORY && has_callbacks)) {
    /* Callbacks run unlocked: they may free memory through this allocator. */
    size_t n = gm->num_callbacks;
    gm_oom_callback cbs[16];
    if (n > 16) n = 16;
    memcpy(cbs, gm->callbacks, n * sizeof *cbs);
    gm->stats.num_oom_callbacks += (int64_t)n;
    gm_lock_release(&gm->lock);
    int again = 0;
    for (size_t i = 0; i < n; i++) again |= cbs[i].fn(gm, size, stream, cbs[i].arg) != 0;
    gm_lock_acquire(&gm->lock);
    bool no_more = false;
    if (again) gm->stats.num_alloc_retries++;
    st = again ? malloc_locked(gm, size, stream, out, &no_more) : GPUMEM_ERR_OUT_OF_MEMORY;
    if (!again) {
      char cause[512];
      snprintf(cause, sizeof cause, "%s", gpumem_last_error());
      gm->stats.num_ooms++;
      format_oom_report(gm, size, round_request(size), stream, st, cause);
    }
  }
  gm_lock_release(&gm->lock);
  return st;
}

/* ---- free ---- */

/* Slow path: says why ptr is not a live allocation. */
static gpumem_status_t diagnose_bad_free(gpumem_t* gm, uintptr_t addr, const char* what) {
  for (size_t i = 0; i <= gm->ptrs.mask; i++) {
    gm_block* b = gm->ptrs.slots[i];
    if (b && addr > b->addr && addr < b->addr + b->size) {
      return gm_fail(
          GPUMEM_ERR_INVALID_POINTER,
          "%s: 0x%lx points %lu bytes into the allocation at 0x%lx (%zu bytes); pass the pointer "
          "the allocation returned",
          what, (unsigned long)addr, (unsigned long)(addr - b->addr), (unsigned long)b->addr,
          b->requested);
    }
  }
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (addr >= seg->addr && addr < seg->addr + seg->size) {
      return gm_fail(GPUMEM_ERR_INVALID_POINTER,
                     "%s: 0x%lx is not a live allocation (freed already? double free)", what,
                     (unsigned long)addr);
    }
  }
  return gm_fail(GPUMEM_ERR_INVALID_POINTER, "%s: 0x%lx was never allocated by this allocator",
                 what, (unsigned long)addr);
}

gpumem_status_t gpumem_free(gpumem_t* gm, void* ptr) {
  if (GM_UNLIKELY(!gm)) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_free: NULL allocator");
  if (!ptr) return GPUMEM_OK;
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = gm_free_locked(gm, (uintptr_t)ptr);
  gm_lock_release(&gm->lock);
  return st;
}

/* gm_free_locked's path for a block of the overflow tier (overflow.c). */
static GM_COLD gpumem_status_t free_tier_block(gpumem_t* gm, gm_block* b) {
  bool small = gm_block_stat_small(b);
  size_t size = b->size, requested = b->requested;
  gpumem_status_t st = gm_overflow_free(gm, b);
  if (st != GPUMEM_OK) {
    /* Not freed: the block stays allocated and the caller may retry. */
    gm_ptr_map_insert(&gm->ptrs, b);
    return st;
  }
  gm_stat_pool_shrink(gm->stats.allocation, small, 1);
  gm_stat_pool_shrink(gm->stats.allocated_bytes, small, (int64_t)size);
  gm_stat_pool_shrink(gm->stats.requested_bytes, small, (int64_t)requested);
  gm_overflow_after_free(gm);
  gm_publish_after_op(gm);
  return GPUMEM_OK;
}

gpumem_status_t gm_free_locked(gpumem_t* gm, uintptr_t addr) {
  gm_block* b = gm_ptr_map_remove(&gm->ptrs, addr);
  if (GM_UNLIKELY(!b)) return diagnose_bad_free(gm, addr, "gpumem_free");
  if (GM_UNLIKELY(gm_block_in_tier(b))) {
    if (GM_UNLIKELY(gm->num_ipc_exports)) gm_ipc_forget_export(gm, addr);
    gm_history_add_block(gm, GM_HISTORY_FREE_REQUESTED, b);
    gm_record(gm, 'f', b->serial, 0, 0);
    if (gm->planner.enabled) gm_plan_note_free(gm, b);
    return free_tier_block(gm, b);
  }
  if (GM_UNLIKELY(gm->num_arena_host)) {
    /* host pages under its interior go first (overflow.c) */
    gpumem_status_t st = gm_overflow_arena_free(gm, b);
    if (st != GPUMEM_OK) {
      gm_ptr_map_insert(&gm->ptrs, b);
      return st;
    }
  }
  if (GM_UNLIKELY(gm->num_ipc_exports)) gm_ipc_forget_export(gm, addr);
  bool small = gm_block_stat_small(b);
  size_t size = b->size, requested = b->requested;
  gm_history_add_block(gm, GM_HISTORY_FREE_REQUESTED, b);
  gm_record(gm, 'f', b->serial, 0, 0);
  if (b->seg->is_arena) {
    gm_stream* owner = b->pool->stream;
    owner->frees_since_sync++;
    owner->frees_total++;
    /* (a lent block's uses on its arena's stream ended before the lend:
     * its free leaves the lender's probe as good as it was) */
    if (!b->lent) owner->own_frees++;
  }
  if (gm->planner.enabled) gm_plan_note_free(gm, b);
  if (GM_UNLIKELY(b->num_uses)) {
    /* Events cannot be recorded during a capture: put off (graphpool.c). */
    gpumem_status_t st = GM_UNLIKELY(gm_capture_possible(gm)) && gm_capture_underway(gm)
                             ? gm_capture_defer_free(gm, b)
                             : gm_defer_free(gm, b);
    if (st != GPUMEM_OK) {
      /* Not freed: the block stays allocated and the caller may retry. */
      gm_ptr_map_insert(&gm->ptrs, b);
      return st;
    }
  } else {
    gm_pool* pool = b->pool;
    gm_free_block(gm, b);
    if (GM_UNLIKELY(pool->is_private)) gm_graph_pool_note_free(gm, pool);
  }
  gm_stat_pool_shrink(gm->stats.allocation, small, 1);
  gm_stat_pool_shrink(gm->stats.allocated_bytes, small, (int64_t)size);
  gm_stat_pool_shrink(gm->stats.requested_bytes, small, (int64_t)requested);
  gpumem_status_t st = GPUMEM_OK;
  /* Eager reclaim: the pointer is freed whatever the unmap says; a device
   * error is still reported. */
  if (gm->virtual_memory && gm->opts.reclaim == GPUMEM_RECLAIM_EAGER) st = gm_reclaim(gm, 0, NULL);
  gm_overflow_after_free(gm);
  gm_publish_after_op(gm);
  return st;
}

gpumem_status_t gpumem_record_stream(gpumem_t* gm, void* ptr, gpumem_stream_t stream) {
  if (!gm || !ptr)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_record_stream: NULL allocator or pointer");
  gm_lock_acquire(&gm->lock);
  gm_block* b = gm_ptr_map_find(&gm->ptrs, (uintptr_t)ptr);
  gpumem_status_t st =
      b ? GPUMEM_OK : diagnose_bad_free(gm, (uintptr_t)ptr, "gpumem_record_stream");
  /* The stream becomes one the allocator knows (if it was not): whether a
   * graph capture is underway is asked of the known streams, and the
   * block's free will record an event on this one, which must not happen
   * while it captures, even if nothing was ever allocated on it. */
  if (st == GPUMEM_OK && !gm_stream_get(gm, stream))
    st = gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_record_stream: out of host memory for a stream");
  if (st == GPUMEM_OK) st = gm_block_add_use(b, stream);
  if (st == GPUMEM_OK) gm_record(gm, 'r', b->serial, 0, stream);
  if (st == GPUMEM_OK && GM_UNLIKELY(gm->opts.overflow)) gm_overflow_touch(gm, b);
  gm_lock_release(&gm->lock);
  return st;
}

size_t gpumem_allocation_size(gpumem_t* gm, const void* ptr) {
  if (!gm || !ptr) return 0;
  gm_lock_acquire(&gm->lock);
  gm_block* b = gm_ptr_map_find(&gm->ptrs, (uintptr_t)ptr);
  size_t size = b ? b->requested : 0;
  gm_lock_release(&gm->lock);
  return size;
}

gpumem_status_t gpumem_empty_cache(gpumem_t* gm) {
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_empty_cache: NULL allocator");
  gm_lock_acquire(&gm->lock);
  /* The plan goes too: a caller emptying the cache wants the memory back,
   * and a plan would map its arena again at once. */
  gm_plan_drop(gm);
  gm_guard_reset(gm);
  gpumem_status_t st = free_cached_memory(gm, false);
  /* The room just given back serves the tier's host-backed blocks first. */
  if (st == GPUMEM_OK && (gm->tier_on_host | gm->num_arena_host)) gm_overflow_bring_back(gm, true);
  /* (after the moves back, which keep the host pages they leave) */
  if (gm->num_host_kept) gm_overflow_release_kept(gm);
  gm_publish_if_wanted(gm);
  gm_lock_release(&gm->lock);
  return st;
}

/* ---- limits and callbacks ---- */

static gpumem_status_t apply_limit(gpumem_t* gm, size_t limit) {
  gpumem_status_t st = GPUMEM_OK;
  gm_lock_acquire(&gm->lock);
  gm->limit = limit;
  /* Capped from now on: placement:auto plans loops that repeat. Without
   * host memory for the planner it goes on with best fit. */
  if (!gm->planner.enabled && wants_planner(gm)) (void)gm_plan_init(gm);
  /* Give back what the cache holds above the new cap; live memory stays. */
  if (over_limit(gm, 0)) st = free_cached_memory(gm, false);
  gm_publish_if_wanted(gm);
  gm_lock_release(&gm->lock);
  return st;
}

gpumem_status_t gpumem_set_limit(gpumem_t* gm, size_t bytes) {
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_set_limit: NULL allocator");
  if (bytes == 0) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_set_limit: a limit of 0 bytes would refuse every allocation; use "
                   "gpumem_remove_limit "
                   "to lift the cap");
  }
  return apply_limit(gm, bytes);
}

gpumem_status_t gpumem_set_limit_fraction(gpumem_t* gm, double fraction) {
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_set_limit_fraction: NULL allocator");
  if (!(fraction > 0 && fraction <= 1)) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_set_limit_fraction: fraction %g is not in (0, 1]", fraction);
  }
  size_t bytes = (size_t)((double)gm->device_total * fraction);
  if (!bytes)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_set_limit_fraction: %g of the device is 0 bytes", fraction);
  return apply_limit(gm, bytes);
}

void gpumem_remove_limit(gpumem_t* gm) {
  if (!gm) return;
  gm_lock_acquire(&gm->lock);
  gm->limit = 0;
  gm_publish_if_wanted(gm);
  gm_lock_release(&gm->lock);
}

size_t gpumem_get_limit(gpumem_t* gm) {
  if (!gm) return 0;
  gm_lock_acquire(&gm->lock);
  size_t limit = gm->limit;
  gm_lock_release(&gm->lock);
  return limit;
}

gpumem_status_t gpumem_add_oom_callback(gpumem_t* gm, gpumem_oom_callback_t fn, void* arg) {
  if (!gm || !fn)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_add_oom_callback: NULL allocator or function");
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  if (gm->num_callbacks >= 16) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_add_oom_callback: at most 16 callbacks");
  } else {
    gm_oom_callback* grown = realloc(gm->callbacks, (gm->num_callbacks + 1) * sizeof *grown);
    if (!grown) {
      st = gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_add_oom_callback: out of host memory");
    } else {
      gm->callbacks = grown;
      gm->callbacks[gm->num_callbacks].fn = fn;
      gm->callbacks[gm->num_callbacks].arg = arg;
      gm->num_callbacks++;
    }
  }
  gm_lock_release(&gm->lock);
  return st;
}

/* ---- statistics ---- */

/* Derived figures: what a new allocation could get from held memory. */
static void fill_derived(gpumem_t* gm, gpumem_stats_t* out) {
  uint64_t largest = 0, free_total = 0;
  for (gm_stream* s = gm->streams; s; s = s->next) {
    for (int i = 0; i < GM_NUM_POOLS; i++) {
      if (gm->virtual_memory) continue;
      gm_block* b = gm_index_largest(&s->pools[i].index);
      if (b && b->size > largest) largest = b->size;
      free_total += s->pools[i].index.bytes;
    }
  }
  int64_t reserved = gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current;
  int64_t active = gm->stats.active_bytes[GPUMEM_POOL_ALL].current;
  out->cached_free_bytes = reserved > active ? (uint64_t)(reserved - active) : 0;
  if (gm->virtual_memory) {
    /* Whole free pages can be remapped anywhere: together they are one
     * block as far as the next allocation is concerned. */
    largest = gm_reclaimable_bytes(gm) +
              (uint64_t)(gm->num_spare_pages + gm->spare_run_pages) * gm->page_size;
    free_total = out->cached_free_bytes;
  }
  out->largest_free_block = largest;
  out->fragmentation = free_total ? 1.0 - (double)largest / (double)free_total : 0.0;
  if (out->fragmentation < 0) out->fragmentation = 0;
  out->limit_bytes = gm->limit;
  out->device_total = gm->device_total;
  out->page_size = gm->virtual_memory ? gm->page_size : 0;
  out->policy = (int)gm->opts.policy;
  out->virtual_memory = gm->virtual_memory;
  out->max_split_size = gm->opts.max_split_size ? (int64_t)gm->opts.max_split_size : -1;
}

void gpumem_get_stats(gpumem_t* gm, gpumem_stats_t* out) {
  if (!out) return;
  memset(out, 0, sizeof *out);
  out->struct_size = sizeof *out;
  if (!gm) return;
  gm_lock_acquire(&gm->lock);
  *out = gm->stats;
  out->struct_size = sizeof *out;
  fill_derived(gm, out);
  size_t free_bytes = 0, total = 0;
  gm->stats.backend_calls[GPUMEM_CALL_mem_info]++;
  if (gm->backend->mem_info(gm->backend->ctx, &free_bytes, &total) == GPUMEM_OK)
    out->device_free = free_bytes;
  out->backend_calls[GPUMEM_CALL_mem_info] = gm->stats.backend_calls[GPUMEM_CALL_mem_info];
  gm_lock_release(&gm->lock);
}

void gpumem_reset_peak_stats(gpumem_t* gm) {
  if (!gm) return;
  gm_lock_acquire(&gm->lock);
#define GM_X_RESET_PEAK(name, title, is_bytes) \
  for (int p = 0; p < GPUMEM_POOL_COUNT; p++) gm->stats.name[p].peak = gm->stats.name[p].current;
  GPUMEM_STAT_ARRAYS(GM_X_RESET_PEAK)
#undef GM_X_RESET_PEAK
  gm_lock_release(&gm->lock);
}

void gpumem_reset_accumulated_stats(gpumem_t* gm) {
  if (!gm) return;
  gm_lock_acquire(&gm->lock);
#define GM_X_RESET_ACC(name, title, is_bytes)                  \
  for (int p = 0; p < GPUMEM_POOL_COUNT; p++) {                \
    gm->stats.name[p].allocated = gm->stats.name[p].freed = 0; \
  }
  GPUMEM_STAT_ARRAYS(GM_X_RESET_ACC)
#undef GM_X_RESET_ACC
#define GM_X_RESET_COUNTER(name, title) gm->stats.name = 0;
  GPUMEM_STAT_COUNTERS(GM_X_RESET_COUNTER)
#undef GM_X_RESET_COUNTER
  memset(gm->stats.backend_calls, 0, sizeof gm->stats.backend_calls);
  gm_lock_release(&gm->lock);
}

int gpumem_print_summary(gpumem_t* gm, gpumem_write_fn write, void* arg) {
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  return gpumem_format_summary(&st, write, arg);
}

int gpumem_print_stats_json(gpumem_t* gm, gpumem_write_fn write, void* arg) {
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  return gpumem_format_stats_json(&st, write, arg);
}

/* ---- the out-of-memory report ---- */

static void format_oom_report(gpumem_t* gm, size_t size, size_t rsize, gpumem_stream_t stream,
                              gpumem_status_t cause, const char* cause_text) {
  gpumem_stats_t st;
  st = gm->stats;
  fill_derived(gm, &st);
  size_t dev_free = 0, total = 0;
  gm->stats.backend_calls[GPUMEM_CALL_mem_info]++;
  if (gm->backend->mem_info(gm->backend->ctx, &dev_free, &total) != GPUMEM_OK) dev_free = 0;
  if (cause == GPUMEM_ERR_OUT_OF_MEMORY) gm_history_add(gm, GM_HISTORY_OOM, dev_free, size, stream);
  char req[32], tot[32], fre[32], lim[32], res[32], alloc_b[32], pend[32], cached[32], largest[32];
  int64_t active = st.active_bytes[GPUMEM_POOL_ALL].current;
  int64_t allocated = st.allocated_bytes[GPUMEM_POOL_ALL].current;
  int64_t reserved = st.reserved_bytes[GPUMEM_POOL_ALL].current;
  gm_format_bytes(size, req, sizeof req);
  gm_format_bytes(gm->device_total, tot, sizeof tot);
  gm_format_bytes(dev_free, fre, sizeof fre);
  gm_format_bytes(gm->limit, lim, sizeof lim);
  gm_format_bytes((uint64_t)reserved, res, sizeof res);
  gm_format_bytes((uint64_t)allocated, alloc_b, sizeof alloc_b);
  gm_format_bytes((uint64_t)(active - allocated), pend, sizeof pend);
  gm_format_bytes(st.cached_free_bytes, cached, sizeof cached);
  gm_format_bytes(st.largest_free_block, largest, sizeof largest);
  const char* advice;
  char advice_buf[400];
  if (cause == GPUMEM_ERR_HOST_MEMORY) {
    /* Not the device: the host refused memory for the allocator's own
     * tables, which no change to the device's figures above would fix. */
    advice =
        "the host, not the device, is out of memory (the allocator's own tables could not be "
        "allocated); nothing was allocated and the allocator is consistent";
  } else if (cause != GPUMEM_ERR_OUT_OF_MEMORY) {
    advice =
        "the device reported an error other than out of memory (the cause above); nothing was "
        "allocated and "
        "the allocator is consistent";
  } else if (rsize > gm->device_total) {
    advice =
        "the request alone is larger than the device's memory: split it, or look for a size "
        "computed wrong (a shape multiplied twice, bytes passed as elements)";
  } else if (gm->opts.overflow == GPUMEM_OVERFLOW_HOST) {
    advice =
        "the device and the overflow tier's host pages are both spent (overflow:host): raise "
        "or lift the host budget (overflow:host:SIZE), free tensors, or lower the batch size";
  } else if (st.cached_free_bytes >= rsize && st.largest_free_block < rsize) {
    /* Under virtual memory the reclaim before this report took every whole
     * free page it could: what is left lies in pages live blocks partly
     * cover, or in whole pages whose mapping also lies under live blocks
     * (the driver unmaps a mapping only whole), which only a cap from the
     * start avoids: capped, every mapping is one page. */
    if (!gm->virtual_memory) {
      snprintf(advice_buf, sizeof advice_buf,
               "fragmentation: %s is cached free but the largest piece is %s. "
               "GPUMEM_CONF=policy:default (virtual memory) reclaims such holes; with the pytorch "
               "policy, max_split_size_mb limits splitting of large blocks",
               cached, largest);
    } else {
      gpumem_explain_t ex;
      gm_explain_locked(gm, &ex);
      char partial[32], pinned[32];
      gm_format_bytes(ex.partial_pages_large + ex.partial_pages_small, partial, sizeof partial);
      gm_format_bytes(ex.cached_pinned, pinned, sizeof pinned);
      if (ex.cached_pinned == 0)
        snprintf(advice_buf, sizeof advice_buf,
                 "fragmentation: %s is cached free but the largest piece is %s. Free memory sits "
                 "in partly used pages",
                 cached, largest);
      else
        snprintf(advice_buf, sizeof advice_buf,
                 "fragmentation: %s is cached free but the largest piece is %s. Free memory sits "
                 "in partly used pages (%s) and in whole pages whose mapping live blocks also lie "
                 "on (%s), which go back only with those blocks: a limit or fraction set from the "
                 "start maps one page at a time and pins none",
                 cached, largest, partial, pinned);
    }
    advice = advice_buf;
  } else if (active - allocated >= (int64_t)rsize) {
    advice =
        "freed memory is still waiting for work on other streams (record_stream); synchronize "
        "those streams "
        "before allocating";
  } else if (gm->budget && !gm_budget_has_room(gm, rsize) && dev_free >= rsize) {
    char others[32];
    snprintf(advice_buf, sizeof advice_buf,
             "the shared limit (option shared_limit), not the device, refused: the other "
             "allocators in the budget hold %s; free memory there (empty_cache), or raise the "
             "shared limit",
             gm_format_bytes(gm_budget_others(gm), others, sizeof others));
    advice = advice_buf;
  } else if (gm->limit && (uint64_t)reserved + rsize > gm->limit && dev_free >= rsize) {
    advice = "the limit, not the device, refused: raise the limit or lower the batch size";
  } else {
    advice =
        "live allocations fill the memory: free tensors, lower the batch size, or use activation "
        "checkpointing";
  }
  char live[512], tier[300];
  gm_live_groups_locked(gm, live, sizeof live);
  gm_overflow_describe(gm, tier, sizeof tier);
  char snapshot[2 * sizeof gm->opts.oom_snapshot + 400] = ""; /* room for why it failed */
  if (cause == GPUMEM_ERR_OUT_OF_MEMORY && gm->opts.oom_snapshot[0]) {
    char said[sizeof snapshot - 16];
    gm_oom_snapshot(gm, said, sizeof said);
    snprintf(snapshot, sizeof snapshot, " Post-mortem: %s.", said);
  }
  gpumem_set_last_error(
      "gpumem: %s: tried to allocate %s (%zu bytes) on stream 0x%lx. Device: %s total, %s free. "
      "Limit: %s. gpumem holds %s reserved: %s allocated, %s freed but waiting for other streams, "
      "%s cached "
      "free; largest free block %s, fragmentation %.1f%%. Policy: %s.%s Cause: %s. Advice: "
      "%s.%s%s",
      cause == GPUMEM_ERR_OUT_OF_MEMORY ? "out of memory"
      : cause == GPUMEM_ERR_HOST_MEMORY ? "out of host memory"
                                        : "allocation failed",
      req, size, (unsigned long)stream, tot, fre, gm->limit ? lim : "none", res, alloc_b, pend,
      cached, largest, st.fragmentation * 100.0,
      gm->opts.policy == GPUMEM_POLICY_PYTORCH ? "pytorch" : "default", tier,
      cause_text[0] ? cause_text : gpumem_strerror(cause), advice, live, snapshot);
}

/* ---- per-device default instances ---- */

#define GM_MAX_DEVICES 64
static gpumem_t* default_instances[GM_MAX_DEVICES];
static pthread_mutex_t default_lock = PTHREAD_MUTEX_INITIALIZER;

/* Option leak_check: the per-device instances are never destroyed, so
 * they report what they still hold when the process exits. */
static bool leak_check_at_exit;
static void check_default_instances(void) {
  for (int d = 0; d < GM_MAX_DEVICES; d++) {
    gpumem_t* gm = default_instances[d];
    if (gm && gm->opts.leak_check && !gm->leak_checked) gm_leak_check_report(gm, "at exit");
  }
}

gpumem_t* gpumem_default(int device) {
  if (device < 0 || device >= GM_MAX_DEVICES) {
    gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_default: device %d out of range [0, %d)", device,
            GM_MAX_DEVICES);
    return NULL;
  }
  pthread_mutex_lock(&default_lock);
  gpumem_t* gm = default_instances[device];
  if (!gm) {
    gpumem_options_t opts;
    gpumem_options_init(&opts);
    const char* conf = getenv("GPUMEM_CONF");
    gpumem_status_t st = gpumem_options_parse(&opts, conf);
    if (st == GPUMEM_OK) {
      gpumem_cuda_options_t copts;
      gpumem_cuda_options_init(&copts);
      copts.device = device;
      gpumem_backend_t* be = gpumem_cuda_create(&copts, &st);
      if (be) {
        opts.own_backend = 1;
        gm = gpumem_create(be, &opts, &st);
        if (!gm) gpumem_cuda_destroy(be);
        if (gm) gm->device_index = device; /* published as the process's device */
      }
    }
    default_instances[device] = gm;
    if (gm && gm->opts.leak_check && !leak_check_at_exit) {
      leak_check_at_exit = true;
      atexit(check_default_instances);
    }
  }
  pthread_mutex_unlock(&default_lock);
  return gm;
}
