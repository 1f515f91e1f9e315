/* Virtual memory for the default policy: arenas (one reserved address
 * range per stream and pool, tiled by blocks at 512 B granularity),
 * physical pages mapped under blocks on demand, and reclamation of the
 * whole pages that lie inside free blocks.
 *
 * Reserved memory is the physical pages held: mapped ones plus a spare
 * list of unmapped single pages. A page is taken from the spare list first;
 * then, under the lazy setting, new memory is created only while reserved
 * memory stays within the allocated high-water mark plus headroom, and
 * otherwise free pages are reclaimed (unmapped from free blocks, highest
 * address first) and mapped where they are needed. Unmapping is
 * synchronous with respect to the host, not the stream, so a stream whose
 * blocks are reclaimed is synchronized first unless nothing was freed on it
 * since its last sync.
 *
 * Mappings: new memory for a run of unmapped pages under a block comes as
 * one physical allocation of up to map_max pages (creating, mapping and
 * granting access cost about the same per call whatever the size on a
 * real GPU). A mapping is unmapped only whole, and only when it lies
 * entirely inside one free block; a reclaimed single page joins the spare
 * list, a larger mapping goes back to the device (it could be remapped only
 * into an equally long run).
 *
 * Ghosts: a single page taken away from a free block is not unmapped; it
 * stays mapped there as a ghost (usable by no block) and is mapped where it
 * is needed too. When that address needs a page again and the page is free
 * where it is live, it simply becomes live here again: no call, no
 * synchronization (within one stream, stream order keeps the two uses
 * apart; across streams, the stream it was freed on is synchronized
 * first). Training jobs move the same pages between the same addresses
 * (the first step's layout and the plan's, a pass and the next), so after
 * the first time these moves cost nothing on the device. A page keeps at
 * most GM_MAX_GHOSTS ghosts (the oldest is unmapped), and an address needed
 * for another page unmaps its ghost first.
 *
 * Reserved bytes per pool: pages live in small arenas count as small;
 * large-arena and spare pages count as large. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"

static gpumem_status_t sync_stream_for_reclaim(gpumem_t* gm, gm_stream* s);
static gpumem_status_t reclaim_block(gpumem_t* gm, gm_block* b, size_t* budget, size_t* got,
                                     bool fenced);
static gpumem_status_t drop_ghosts_in(gpumem_t* gm, gm_segment* seg);
static void release_phys_everywhere(gpumem_t* gm, uint32_t id);
static inline gm_phys* phys_of(gpumem_t* gm, uint32_t id);
static gm_alias alias_forget(gpumem_t* gm, size_t k, gm_segment** seg, size_t* page);
static void ghost_forget(gm_phys* r, const gm_segment* seg, size_t p);

bool gm_arena_page_mapped(const gm_segment* seg, size_t page) {
  return (seg->mapped_bits[page / 64] >> (page % 64)) & 1u;
}

static inline void set_mapped(gm_segment* seg, size_t page, gpumem_phys_t handle,
                              size_t run_first) {
  seg->mapped_bits[page / 64] |= 1ull << (page % 64);
  seg->handles[page] = handle;
  seg->run_start[page] = (uint32_t)run_first;
  seg->mapped_pages++;
  if (page >= seg->mapped_end) seg->mapped_end = page + 1;
}

static inline void clear_mapped(gm_segment* seg, size_t page) {
  seg->mapped_bits[page / 64] &= ~(1ull << (page % 64));
  seg->handles[page] = 0;
  seg->run_start[page] = 0;
  seg->mapped_pages--;
}

/* Pages in the mapping that starts at page first (mapped). */
static size_t run_length(const gm_segment* seg, size_t first) {
  size_t n = 1;
  while (first + n < seg->num_pages && gm_arena_page_mapped(seg, first + n) &&
         seg->run_start[first + n] == first) {
    n++;
  }
  return n;
}

static void free_tables(gm_segment* seg) {
  free(seg->mapped_bits);
  free(seg->handles);
  free(seg->run_start);
  free(seg->live_id);
  free(seg->ghost_id);
  free(seg->busy);
  free(seg->busy_inner);
  free(seg->fence_pend);
  free(seg->fence_safe);
  free(seg->host_bits);
  free(seg);
}

/* True when pages [first, last] are all mapped: a word at a time. */
static bool range_mapped(const gm_segment* seg, size_t first, size_t last) {
  if (GM_LIKELY(first / 64 == last / 64)) { /* on every malloc: most blocks span one word */
    uint64_t mask = gm_bits_between(first % 64, last % 64);
    return (seg->mapped_bits[first / 64] & mask) == mask;
  }
  while (first <= last) {
    size_t span;
    uint64_t mask = gm_bits_word_mask(first, last, &span);
    if ((seg->mapped_bits[first / 64] & mask) != mask) return false;
    first += span;
  }
  return true;
}

bool gm_arena_pages_mapped(const gm_segment* seg, size_t first, size_t last) {
  return range_mapped(seg, first, last);
}

gpumem_status_t gm_arena_new(gpumem_t* gm, gm_pool* pool, size_t min_size, gm_block** out) {
  size_t ps = gm->page_size;
  size_t size = gm->arena_size;
  /* (a pool that never splits gets an arena per allocation, just large
   * enough: PyTorch's no_split pools make a segment per allocation) */
  if (min_size > size || pool->no_split) size = gm_round_up(min_size, ps);
  size_t num_pages = size / ps;
  gm_segment* seg = calloc(1, sizeof *seg);
  gm_block* b = gm_block_new(gm);
  uint64_t* bits = calloc((num_pages + 63) / 64, sizeof *bits);
  /* calloc of a large table maps zero pages lazily: untouched entries of a
   * big arena cost no host memory. */
  gpumem_phys_t* handles = calloc(num_pages, sizeof *handles);
  uint32_t* run_start = calloc(num_pages, sizeof *run_start);
  uint32_t* live_id = calloc(num_pages, sizeof *live_id);
  uint32_t* ghost_id = calloc(num_pages, sizeof *ghost_id);
  uint16_t* busy = calloc(num_pages, sizeof *busy);
  uint64_t* busy_inner = calloc((num_pages + 63) / 64, sizeof *busy_inner);
  if (seg) {
    seg->mapped_bits = bits;
    seg->handles = handles;
    seg->run_start = run_start;
    seg->live_id = live_id;
    seg->ghost_id = ghost_id;
    seg->busy = busy;
    seg->busy_inner = busy_inner;
  }
  if (!seg || !b || !bits || !handles || !run_start || !live_id || !ghost_id || !busy ||
      !busy_inner || num_pages > UINT32_MAX) {
    if (seg) {
      free_tables(seg);
    } else {
      free(bits);
      free(handles);
      free(run_start);
      free(live_id);
      free(ghost_id);
      free(busy);
      free(busy_inner);
    }
    if (b) gm_block_delete(gm, b);
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory for an arena of %zu pages",
                   num_pages);
  }
  uintptr_t addr = 0;
  gpumem_status_t st = GM_CALL(gm, reserve, gm->backend->reserve(gm->backend->ctx, size, &addr));
  if (st != GPUMEM_OK) {
    free_tables(seg);
    gm_block_delete(gm, b);
    return st;
  }
  seg->is_arena = true;
  seg->num_pages = num_pages;
  gm_segment_install(gm, seg, b, pool, addr, size);
  *out = b;
  return GPUMEM_OK;
}

void gm_arena_destroy(gpumem_t* gm, gm_segment* seg) {
  size_t ps = gm->page_size;
  /* Aliases first (blocks still allocated at gpumem_destroy): the page
   * goes back once, from where it lives. */
  for (size_t k = 0; k < gm->num_aliases;) {
    if (phys_of(gm, gm->aliases[k].id)->alias_seg != seg) {
      k++;
      continue;
    }
    gm_segment* at;
    size_t page;
    alias_forget(gm, k, &at, &page);
    GM_MAP_CALL(gm, unmap, gm->backend->unmap(gm->backend->ctx, seg->addr + page * ps, ps));
  }
  for (size_t p = 0; p < seg->mapped_end; p++) {
    uint32_t ghost = seg->ghost_id[p];
    if (ghost) { /* its page lives on elsewhere or as spare */
      GM_MAP_CALL(gm, unmap, gm->backend->unmap(gm->backend->ctx, seg->addr + p * ps, ps));
      ghost_forget(phys_of(gm, ghost), seg, p);
      seg->ghost_id[p] = 0;
    }
    if (seg->live_id[p]) { /* with its ghosts in other arenas */
      release_phys_everywhere(gm, seg->live_id[p]);
      continue;
    }
    if (!gm_arena_page_mapped(seg, p) || seg->run_start[p] != p) continue;
    size_t n = run_length(seg, p);
    gpumem_phys_t h = seg->handles[p];
    GM_MAP_CALL(gm, unmap, gm->backend->unmap(gm->backend->ctx, seg->addr + p * ps, n * ps));
    GM_MAP_CALL(gm, release_page, gm->backend->release_page(gm->backend->ctx, h, n * ps));
    p += n - 1;
  }
  GM_CALL(gm, release_range, gm->backend->release_range(gm->backend->ctx, seg->addr, seg->size));
  free_tables(seg);
}

void gm_arena_release_if_unused(gpumem_t* gm, gm_segment* seg) {
  gm_block* b = seg->first;
  if (!b || b->next || b->state != GM_FREE) return;
  size_t got = 0, budget = 0;
  if (seg->mapped_pages) {
    if (sync_stream_for_reclaim(gm, seg->pool->stream) != GPUMEM_OK) return;
    if (reclaim_block(gm, b, &budget, &got, false) != GPUMEM_OK || seg->mapped_pages) return;
  }
  if (drop_ghosts_in(gm, seg) != GPUMEM_OK) return;
  if (GM_CALL(gm, release_range,
              gm->backend->release_range(gm->backend->ctx, seg->addr, seg->size)) != GPUMEM_OK) {
    return;
  }
  gm_index_remove(&seg->pool->index, b);
  gm_dirty_remove(b);
  gm_block_delete(gm, b);
  gm_segment_unlink(gm, seg);
  gm_stat_pool_add(gm, gm->stats.segment, seg->pool->is_small, -1);
  free_tables(seg);
}

/* ---- dirty lists: free blocks that may hold mapped whole pages ---- */

/* Whole pages inside block b: [*first, *end). */
bool gm_interior_pages(const gpumem_t* gm, const gm_block* b, size_t* first, size_t* end) {
  size_t ps = gm->page_size;
  uintptr_t lo = gm_round_up(b->addr - b->seg->addr, ps);
  uintptr_t hi = (b->addr + b->size - b->seg->addr) / ps * ps;
  *first = lo / ps;
  *end = hi / ps;
  /* Beyond the highest page ever mapped nothing can be mapped: the huge
   * free block at the top of an arena costs nothing to scan. */
  if (*end > b->seg->mapped_end) *end = b->seg->mapped_end;
  return *first < *end;
}

/* Pages of the mappings that lie wholly inside [first, end): what
 * reclaiming a free block spanning them would unmap. With any_one, stops at
 * the first such mapping (reclaim asks only whether there is one, of every
 * dirty block it considers). */
static size_t whole_mapping_pages(const gm_segment* seg, size_t first, size_t end, bool any_one) {
  size_t pages = 0;
  for (size_t p = first; p < end;) {
    if (!gm_arena_page_mapped(seg, p)) {
      p += (p % 64 == 0 && seg->mapped_bits[p / 64] == 0) ? 64 : 1;
      continue;
    }
    if (seg->run_start[p] != p) {
      p++;
      continue;
    }
    size_t n = run_length(seg, p);
    if (p + n <= end) {
      pages += n;
      if (any_one) break;
    }
    p += n;
  }
  return pages;
}

/* Whole free pages of free block b that are mapped in mappings reaching
 * past its interior: the driver unmaps a mapping only whole, so while the
 * blocks beside b live these pages stay reserved whatever reclaim or a
 * fence does. */
size_t gm_arena_pinned_pages(const gpumem_t* gm, const gm_block* b) {
  size_t first, end;
  if (!gm_interior_pages(gm, b, &first, &end)) return 0;
  size_t mapped = 0;
  for (size_t p = first; p < end; p++) mapped += gm_arena_page_mapped(b->seg, p);
  return mapped - whole_mapping_pages(b->seg, first, end, false);
}

/* ---- spare pages ---- */

static gpumem_status_t release_spare_runs(gpumem_t* gm);
static gpumem_status_t drop_ghosts_of(gpumem_t* gm, uint32_t id);
static void phys_delete(gpumem_t* gm, uint32_t id);

gpumem_status_t gm_release_spare_pages(gpumem_t* gm, size_t keep) {
  size_t ps = gm->page_size;
  gpumem_status_t runs = release_spare_runs(gm);
  if (runs != GPUMEM_OK) return runs;
  while (gm->num_spare_pages > keep) {
    uint32_t id = gm->spare_pages[gm->num_spare_pages - 1];
    gpumem_status_t st = drop_ghosts_of(gm, id);
    if (st != GPUMEM_OK) return st;
    gpumem_phys_t h = phys_of(gm, id)->handle;
    st = GM_MAP_CALL(gm, release_page, gm->backend->release_page(gm->backend->ctx, h, ps));
    if (st != GPUMEM_OK) return st;
    gm->num_spare_pages--;
    phys_delete(gm, id);
    gm->stats.num_device_free++;
    gm_reserved_released(gm, false, ps);
  }
  return GPUMEM_OK;
}

/* ---- reclaim ---- */

static gpumem_status_t sync_stream_for_reclaim(gpumem_t* gm, gm_stream* s) {
  if (!s->frees_since_sync || !gm->backend->stream_sync) return GPUMEM_OK;
  if (GM_UNLIKELY(gm_capture_possible(gm)) && gm_capture_underway(gm))
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                   "gpumem: moving pages would synchronize a stream while a CUDA graph is being "
                   "captured (illegal during capture); reserve the memory before capturing (run "
                   "the captured work once first) or raise the limit");
  /* (blocks a borrower freed in s's arenas: its work too, through s) */
  gpumem_status_t st = gm_lender_ready(gm, s);
  if (st != GPUMEM_OK) return st;
  gm->stats.num_syncs++;
  st = GM_CALL(gm, stream_sync, gm->backend->stream_sync(gm->backend->ctx, s->handle));
  if (st == GPUMEM_OK) {
    s->frees_since_sync = 0;
    s->syncs++;
  }
  return st;
}

/* Grows *arr (of elem-byte entries) to hold need entries. */
static bool grow_list(void** arr, size_t* cap, size_t need, size_t elem) {
  if (*cap >= need) return true;
  size_t n = *cap ? *cap : 16;
  while (n < need) n *= 2;
  void* grown = realloc(*arr, n * elem);
  if (!grown) return false;
  *arr = grown;
  *cap = n;
  return true;
}

/* Makes room for n more spare pages, so that a successful unmap cannot
 * lose handles. */
static gpumem_status_t spare_reserve(gpumem_t* gm, size_t n) {
  if (grow_list((void**)&gm->spare_pages, &gm->spare_pages_capacity, gm->num_spare_pages + n,
                sizeof *gm->spare_pages))
    return GPUMEM_OK;
  return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory for the spare page list");
}

/* Returns the unmapped mappings of more than one page to the device. One
 * whose release fails stays listed (and counted as reserved) for the next
 * try or gpumem_destroy. */
static gpumem_status_t release_spare_runs(gpumem_t* gm) {
  size_t ps = gm->page_size;
  while (gm->num_spare_runs) {
    gm_spare_run r = gm->spare_runs[gm->num_spare_runs - 1];
    gpumem_status_t st = GM_CALL(
        gm, release_page, gm->backend->release_page(gm->backend->ctx, r.handle, r.pages * ps));
    if (st != GPUMEM_OK) return st;
    gm->num_spare_runs--;
    gm->spare_run_pages -= r.pages;
    gm->stats.num_device_free++;
    gm_reserved_released(gm, false, r.pages * ps);
  }
  return GPUMEM_OK;
}

static gpumem_status_t spare_runs_reserve(gpumem_t* gm, size_t n) {
  if (grow_list((void**)&gm->spare_runs, &gm->spare_runs_capacity, gm->num_spare_runs + n,
                sizeof *gm->spare_runs))
    return GPUMEM_OK;
  return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory reclaiming pages");
}

/* ---- physical pages of single-page mappings, and their ghosts ---- */

static inline gm_phys* phys_of(gpumem_t* gm, uint32_t id) {
  return &gm->phys[id - 1];
}

/* A record for a new page; 0 without host memory. */
static uint32_t phys_new(gpumem_t* gm, gpumem_phys_t handle) {
  uint32_t id = gm->phys_free_head;
  if (id) {
    gm->phys_free_head = phys_of(gm, id)->live_page;
  } else {
    if (gm->phys_count >= UINT32_MAX - 1 ||
        !grow_list((void**)&gm->phys, &gm->phys_capacity, gm->phys_count + 1, sizeof *gm->phys))
      return 0;
    id = (uint32_t)++gm->phys_count;
  }
  gm_phys* r = phys_of(gm, id);
  memset(r, 0, sizeof *r);
  r->handle = handle;
  return id;
}

static void phys_delete(gpumem_t* gm, uint32_t id) {
  gm_phys* r = phys_of(gm, id);
  memset(r, 0, sizeof *r);
  r->live_page = gm->phys_free_head;
  gm->phys_free_head = id;
}

/* Spare list: room is made beforehand (spare_reserve). */
static void spare_push(gpumem_t* gm, uint32_t id) {
  gm_phys* r = phys_of(gm, id);
  r->live_seg = NULL;
  r->spare_pos = (uint32_t)gm->num_spare_pages;
  gm->spare_pages[gm->num_spare_pages++] = id;
}

static void spare_take(gpumem_t* gm, uint32_t id) {
  uint32_t pos = phys_of(gm, id)->spare_pos;
  uint32_t last = gm->spare_pages[--gm->num_spare_pages];
  gm->spare_pages[pos] = last;
  phys_of(gm, last)->spare_pos = pos;
}

/* Page p of seg becomes (or stops being) where page id is live. Reserved
 * bytes do not change; only the pool they count in. */
static void make_live(gpumem_t* gm, gm_segment* seg, size_t p, uint32_t id) {
  gm_phys* r = phys_of(gm, id);
  set_mapped(seg, p, r->handle, p);
  seg->live_id[p] = id;
  r->live_seg = seg;
  r->live_page = (uint32_t)p;
  if (seg->pool->is_small) {
    gm_stat_pool_move(gm->stats.reserved_bytes, true, (int64_t)gm->page_size);
  }
}

static void unmake_live(gpumem_t* gm, gm_segment* seg, size_t p) {
  clear_mapped(seg, p);
  seg->live_id[p] = 0;
  if (seg->pool->is_small) {
    gm_stat_pool_move(gm->stats.reserved_bytes, false, (int64_t)gm->page_size);
  }
}

/* Index of the ghost at page p of seg in r's list (num_ghosts if none). */
static uint32_t ghost_index(const gm_phys* r, const gm_segment* seg, size_t p) {
  uint32_t i = 0;
  while (i < r->num_ghosts && !(r->ghost_seg[i] == seg && r->ghost_page[i] == p)) i++;
  return i;
}

static void ghost_forget(gm_phys* r, const gm_segment* seg, size_t p) {
  uint32_t i = ghost_index(r, seg, p);
  if (i == r->num_ghosts) return;
  for (uint32_t k = i; k + 1 < r->num_ghosts; k++) {
    r->ghost_seg[k] = r->ghost_seg[k + 1];
    r->ghost_page[k] = r->ghost_page[k + 1];
    r->ghost_sync_mark[k] = r->ghost_sync_mark[k + 1];
  }
  r->num_ghosts--;
}

/* Page id, live at p of seg until now, stays mapped there as a ghost. The
 * address's last uses are the work queued on seg's stream before the frees
 * that emptied it: the mark says whether a synchronization must still
 * come before the ghost may be unmapped. */
static void ghost_note(gpumem_t* gm, uint32_t id, gm_segment* seg, size_t p) {
  gm_phys* r = phys_of(gm, id);
  const gm_stream* s = seg->pool->stream;
  r->ghost_seg[r->num_ghosts] = seg;
  r->ghost_page[r->num_ghosts] = (uint32_t)p;
  r->ghost_sync_mark[r->num_ghosts++] = s->frees_since_sync ? s->syncs + 1 : 0;
  seg->ghost_id[p] = id;
}

/* Unmaps the ghost at page p of seg. Queued work of seg's stream may still
 * use the address (blocks freed there before the page moved), so that
 * stream is synchronized first, unless it has been since the ghost was
 * made. */
static gpumem_status_t ghost_drop(gpumem_t* gm, gm_segment* seg, size_t p) {
  gm_phys* r = phys_of(gm, seg->ghost_id[p]);
  gm_stream* s = seg->pool->stream;
  uint32_t k = ghost_index(r, seg, p); /* listed, as gpumem_check verifies; else wait */
  gpumem_status_t st = GPUMEM_OK;
  if (k == r->num_ghosts || r->ghost_sync_mark[k] > s->syncs) st = sync_stream_for_reclaim(gm, s);
  if (st != GPUMEM_OK) return st;
  size_t ps = gm->page_size;
  st = GM_MAP_CALL(gm, unmap, gm->backend->unmap(gm->backend->ctx, seg->addr + p * ps, ps));
  if (st != GPUMEM_OK) return st;
  ghost_forget(phys_of(gm, seg->ghost_id[p]), seg, p);
  seg->ghost_id[p] = 0;
  gm->stats.num_pages_unmapped++;
  return GPUMEM_OK;
}

/* Another stream may use page id only once the stream it was freed on has
 * finished with it. */
static gpumem_status_t phys_claim_for(gpumem_t* gm, uint32_t id, gm_stream* to) {
  gm_phys* r = phys_of(gm, id);
  if (r->freed_on && r->freed_on != to) {
    gpumem_status_t st = sync_stream_for_reclaim(gm, r->freed_on);
    if (st != GPUMEM_OK) return st;
  }
  phys_of(gm, id)->freed_on = NULL;
  return GPUMEM_OK;
}

/* The single page live at p of seg, inside a free block, becomes a ghost
 * there and spare (room in the spare list made beforehand). No call,
 * unless it already had GM_MAX_GHOSTS ghosts: the oldest is unmapped. */
static gpumem_status_t retire_page(gpumem_t* gm, gm_segment* seg, size_t p) {
  uint32_t id = seg->live_id[p];
  gm_phys* r = phys_of(gm, id);
  if (r->num_ghosts == GM_MAX_GHOSTS) {
    gpumem_status_t st = ghost_drop(gm, r->ghost_seg[0], r->ghost_page[0]);
    if (st != GPUMEM_OK) return st;
  }
  unmake_live(gm, seg, p);
  ghost_note(gm, id, seg, p);
  gm_stream* s = seg->pool->stream;
  phys_of(gm, id)->freed_on = s->frees_since_sync ? s : NULL;
  spare_push(gm, id);
  return GPUMEM_OK;
}

/* The single page live at p of seg, inside a free block, which a fence
 * shows the device done with (fence.c), is unmapped there and becomes
 * spare (room in the spare list made beforehand): no ghost is left, whose
 * unmapping later might wait for the stream. */
static gpumem_status_t unmap_done_page(gpumem_t* gm, gm_segment* seg, size_t p) {
  uint32_t id = seg->live_id[p];
  size_t ps = gm->page_size;
  gpumem_status_t st =
      GM_MAP_CALL(gm, unmap, gm->backend->unmap(gm->backend->ctx, seg->addr + p * ps, ps));
  if (st != GPUMEM_OK) return st;
  unmake_live(gm, seg, p);
  phys_of(gm, id)->freed_on = NULL;
  spare_push(gm, id);
  gm->stats.num_pages_unmapped++;
  return GPUMEM_OK;
}

/* Page p of seg (unmapped, with a ghost) becomes live again when its page
 * is spare or wholly free where it is live: no backend call. A page live
 * in an arena a plan serves stays there (the plan wants it again within a
 * period). Sets *done when it did. */
static gpumem_status_t revive(gpumem_t* gm, gm_segment* seg, size_t p, bool* done) {
  uint32_t id = seg->ghost_id[p];
  gm_phys* r = phys_of(gm, id);
  gm_stream* to = seg->pool->stream;
  *done = false;
  gm_segment* from = r->live_seg;
  if (from) {
    size_t q = r->live_page;
    /* (a private pool's page never moves: a graph may replay on it) */
    if (gm_page_busy(from, q) || (from->plan_serving && from != seg) || from->pool->is_private)
      return GPUMEM_OK;
    if (from->pool->stream != to) {
      /* (a cross-stream revival waits for a stream: not during a capture) */
      if (GM_UNLIKELY(gm_capture_possible(gm)) && gm_capture_underway(gm) &&
          from->pool->stream->frees_since_sync)
        return GPUMEM_OK;
      gpumem_status_t st = sync_stream_for_reclaim(gm, from->pool->stream);
      if (st != GPUMEM_OK) return st;
    }
    unmake_live(gm, from, q);
    ghost_forget(r, seg, p);
    ghost_note(gm, id, from, q);
  } else {
    gpumem_status_t st = phys_claim_for(gm, id, to);
    if (st != GPUMEM_OK) return st;
    spare_take(gm, id);
    ghost_forget(r, seg, p);
  }
  r->freed_on = NULL;
  seg->ghost_id[p] = 0;
  make_live(gm, seg, p, id);
  gm->stats.num_pages_revived++;
  *done = true;
  return GPUMEM_OK;
}

/* Unmaps every ghost of page id. */
static gpumem_status_t drop_ghosts_of(gpumem_t* gm, uint32_t id) {
  while (phys_of(gm, id)->num_ghosts) {
    gm_phys* r = phys_of(gm, id);
    gpumem_status_t st = ghost_drop(gm, r->ghost_seg[0], r->ghost_page[0]);
    if (st != GPUMEM_OK) return st;
  }
  return GPUMEM_OK;
}

/* Unmaps every ghost held in seg. */
static gpumem_status_t drop_ghosts_in(gpumem_t* gm, gm_segment* seg) {
  for (size_t p = 0; p < seg->mapped_end; p++) {
    if (!seg->ghost_id[p]) continue;
    gpumem_status_t st = ghost_drop(gm, seg, p);
    if (st != GPUMEM_OK) return st;
  }
  return GPUMEM_OK;
}

/* Teardown: unmaps page id wherever it is mapped (live and ghosts) and
 * releases it, failures notwithstanding (the device goes with the
 * allocator). */
static void release_phys_everywhere(gpumem_t* gm, uint32_t id) {
  size_t ps = gm->page_size;
  gm_phys* r = phys_of(gm, id);
  while (r->num_ghosts) {
    gm_segment* g = r->ghost_seg[0];
    size_t q = r->ghost_page[0];
    GM_MAP_CALL(gm, unmap, gm->backend->unmap(gm->backend->ctx, g->addr + q * ps, ps));
    ghost_forget(r, g, q);
    g->ghost_id[q] = 0;
  }
  if (r->live_seg) {
    gm_segment* seg = r->live_seg;
    size_t p = r->live_page;
    GM_MAP_CALL(gm, unmap, gm->backend->unmap(gm->backend->ctx, seg->addr + p * ps, ps));
    clear_mapped(seg, p);
    seg->live_id[p] = 0;
  } else {
    spare_take(gm, id);
  }
  GM_MAP_CALL(gm, release_page, gm->backend->release_page(gm->backend->ctx, r->handle, ps));
  phys_delete(gm, id);
}

/* Takes the mappings that lie wholly inside b, up to *budget pages (0 =
 * all; a mapping counts whole, so the budget may be passed). Single pages
 * become ghosts there and spare (no call); longer mappings are unmapped,
 * consecutive ones in one call after synchronizing the stream, and go back
 * to the device. fenced: only mappings whose pages a completed fence shows
 * the device done with (fence.c), and nothing waits. */
static gpumem_status_t reclaim_block(gpumem_t* gm, gm_block* b, size_t* budget, size_t* got,
                                     bool fenced) {
  size_t first, end;
  gm_segment* seg = b->seg;
  size_t ps = gm->page_size;
  bool small = seg->pool->is_small;
  if (!gm_interior_pages(gm, b, &first, &end)) return GPUMEM_OK;
  size_t p = first;
  while (p < end && (!*budget || *got < *budget)) {
    /* skip unmapped pages a word at a time */
    if (!gm_arena_page_mapped(seg, p)) {
      if (p % 64 == 0 && seg->mapped_bits[p / 64] == 0)
        p += 64;
      else
        p++;
      continue;
    }
    /* a mapping that starts before the free block or runs past it holds
     * live bytes (or a partial page): it stays */
    if (seg->run_start[p] != p) {
      p++;
      continue;
    }
    if (seg->live_id[p]) {
      if (fenced && !gm_fence_done(seg, p, 1)) {
        p++;
        continue;
      }
      gpumem_status_t st = spare_reserve(gm, 1);
      if (st == GPUMEM_OK) st = fenced ? unmap_done_page(gm, seg, p) : retire_page(gm, seg, p);
      if (st != GPUMEM_OK) return st;
      *got += 1;
      p++;
      continue;
    }
    size_t n = run_length(seg, p);
    if (p + n > end || (fenced && !gm_fence_done(seg, p, n))) {
      p += n;
      continue;
    }
    /* the batch: consecutive whole multi-page mappings inside the block */
    size_t batch_end = p + n, runs = 1;
    while (batch_end < end && (!*budget || *got + (batch_end - p) < *budget) &&
           gm_arena_page_mapped(seg, batch_end) && seg->run_start[batch_end] == batch_end &&
           !seg->live_id[batch_end]) {
      size_t m = run_length(seg, batch_end);
      if (batch_end + m > end || (fenced && !gm_fence_done(seg, batch_end, m))) break;
      runs++;
      batch_end += m;
    }
    gpumem_status_t st = spare_runs_reserve(gm, runs);
    if (st == GPUMEM_OK && !fenced) st = sync_stream_for_reclaim(gm, seg->pool->stream);
    if (st != GPUMEM_OK) return st;
    size_t pages = batch_end - p;
    st = GM_MAP_CALL(gm, unmap,
                     gm->backend->unmap(gm->backend->ctx, seg->addr + p * ps, pages * ps));
    if (st != GPUMEM_OK) return st;
    for (size_t q = p; q < batch_end;) {
      size_t m = run_length(seg, q);
      gm->spare_runs[gm->num_spare_runs++] = (gm_spare_run){seg->handles[q], m};
      gm->spare_run_pages += m;
      for (size_t r = q; r < q + m; r++) clear_mapped(seg, r);
      q += m;
    }
    gm->stats.num_pages_unmapped += (int64_t)pages;
    if (small) {
      gm_stat_pool_move(gm->stats.reserved_bytes, false, (int64_t)(pages * ps));
    }
    *got += pages;
    p = batch_end;
  }
  return release_spare_runs(gm);
}

static int by_addr_desc(const void* a, const void* b) {
  const gm_block* x = *(gm_block* const*)a;
  const gm_block* y = *(gm_block* const*)b;
  return x->addr > y->addr ? -1 : 1;
}

static inline bool reclaim_skips(int which, const gm_segment* seg) {
  return which != GM_RECLAIM_ALL && seg->plan_serving;
}

static gpumem_status_t reclaim_pool(gpumem_t* gm, gm_pool* pool, int which, size_t want,
                                    size_t* got) {
  size_t n = 0;
  gm_block* b;
  GM_DIRTY_FOREACH(pool, b) n += !reclaim_skips(which, b->seg);
  if (!n) return GPUMEM_OK;
  gm_block** order = malloc(n * sizeof *order);
  if (!order) return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory reclaiming pages");
  n = 0;
  GM_DIRTY_FOREACH(pool, b) {
    if (!reclaim_skips(which, b->seg)) order[n++] = b;
  }
  /* Highest addresses first: best fit refills low holes soonest, so pages
   * at the top of an arena are the ones least likely to be wanted back. In
   * replays this halves page moves against oldest-freed-first. */
  qsort(order, n, sizeof *order, by_addr_desc);
  for (size_t i = 0; i < n && (!want || *got < want); i++) {
    b = order[i];
    size_t first, end;
    /* (a fenced pass leaves every block it takes nothing from listed) */
    if (which == GM_RECLAIM_FENCED && !b->seg->fence_safe) continue;
    bool has_pages =
        gm_interior_pages(gm, b, &first, &end) && whole_mapping_pages(b->seg, first, end, true);
    if (has_pages) {
      size_t budget = want;
      gpumem_status_t st = reclaim_block(gm, b, &budget, got, which == GM_RECLAIM_FENCED);
      if (st != GPUMEM_OK) {
        free(order);
        return st;
      }
      /* (a fenced pass leaves pages the device may still use: the block
       * stays listed while it holds any) */
      if (which == GM_RECLAIM_FENCED) {
        if (!whole_mapping_pages(b->seg, first, end, true)) gm_dirty_remove(b);
        if (want && *got >= want) break;
        continue;
      }
      if (want && *got >= want) {
        if (!whole_mapping_pages(b->seg, first, end, true)) gm_dirty_remove(b);
        break;
      }
    }
    gm_dirty_remove(b);
  }
  free(order);
  return GPUMEM_OK;
}

gpumem_status_t gm_reclaim(gpumem_t* gm, size_t want, size_t* reclaimed) {
  return gm_reclaim_from(gm, GM_RECLAIM_ALL, want, reclaimed);
}

gpumem_status_t gm_reclaim_from(gpumem_t* gm, int which, size_t want, size_t* reclaimed) {
  size_t got = 0;
  gpumem_status_t st = GPUMEM_OK;
  /* Large pools first: their free pages come in runs, one unmap each (the
   * plan pools, last in the array, come first: idle plan arenas are
   * large runs too). */
  for (int i = GM_NUM_POOLS; i-- > 0 && st == GPUMEM_OK;) {
    for (gm_stream* s = gm->streams; s && st == GPUMEM_OK && (!want || got < want); s = s->next) {
      gm_pool* pool = &s->pools[i];
      if (which == GM_RECLAIM_IDLE_PLANS && !pool->is_plan) continue;
      st = reclaim_pool(gm, pool, which, want, &got);
    }
  }
  if (got) gm->stats.num_reclaims++;
  if (reclaimed) *reclaimed = got;
  return st;
}

uint64_t gm_reclaimable_bytes(gpumem_t* gm) {
  uint64_t pages = 0;
  for (gm_stream* s = gm->streams; s; s = s->next) {
    for (int i = 0; i < GM_NUM_POOLS; i++) {
      gm_block* b;
      GM_DIRTY_FOREACH(&s->pools[i], b) {
        size_t first, end;
        if (gm_interior_pages(gm, b, &first, &end))
          pages += whole_mapping_pages(b->seg, first, end, false);
      }
    }
  }
  return pages * gm->page_size;
}

/* The move guard. A page moved (a spare page mapped at a new address) costs
 * an unmap, a map and an access grant on a GPU (~55 us on an H100), so
 * holding reserved memory at the high-water mark pays off only while moves
 * are rare. Training loops move pages in their first steps and then stop
 * (a plan serves, or the layout settles); workloads whose sizes never
 * repeat move one page every few allocations for as long as they run
 * (synth_random: ~600 per 1,000 allocations, 16.9 us per operation through
 * CUDA). A window is at least GM_GUARD_WINDOW allocations; it is hot when
 * it saw more than one move per GM_GUARD_RATE allocations and no plan was
 * serving; after GM_GUARD_HOT_WINDOWS hot windows in a row the lazy
 * setting stops reclaiming for headroom and grows instead (provide_pages).
 * Moves into a plan's arena are the plan's migration and are not counted.
 * Of the bundled traces only t5 has hot windows (two, not in a row, in its
 * cold pass), so none trips; synth_random trips at its third. A window
 * closes at the first move after its end, so a quiet stretch ends the run
 * of hot windows. A plan that starts serving arms the guard again (the job
 * settled into a loop: pages can be held at the mark), as empty_cache
 * does. */
#define GM_GUARD_WINDOW 4096
#define GM_GUARD_RATE 10
#define GM_GUARD_HOT_WINDOWS 3

static inline bool guard_tripped(const gpumem_t* gm) {
  return gm->guard.hot_windows >= GM_GUARD_HOT_WINDOWS;
}

static void note_move(gpumem_t* gm, const gm_segment* seg) {
  if (!gm->opts.move_guard || gm->opts.reclaim != GPUMEM_RECLAIM_LAZY || guard_tripped(gm) ||
      seg->plan_serving)
    return;
  uint64_t now = (uint64_t)gm->stats.allocation[GPUMEM_POOL_ALL].allocated;
  if (now < gm->guard.window_start) gm_guard_reset(gm); /* the counts were reset */
  gm->guard.moves++;
  uint64_t span = now - gm->guard.window_start;
  if (span < GM_GUARD_WINDOW) return;
  bool hot = gm->guard.moves * GM_GUARD_RATE > span && gm->planner.state != GM_PLAN_ACTIVE;
  gm->guard.hot_windows = hot ? gm->guard.hot_windows + 1 : 0;
  gm->guard.window_start = now;
  gm->guard.moves = 0;
  if (guard_tripped(gm)) gm->stats.num_move_guard_trips++;
}

void gm_guard_reset(gpumem_t* gm) {
  memset(&gm->guard, 0, sizeof gm->guard);
  gm->guard.window_start = (uint64_t)gm->stats.allocation[GPUMEM_POOL_ALL].allocated;
}

uint64_t gm_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The move budget (option move_budget_us). Moving pages that nobody needs
 * (to hold reserved memory near the allocated high-water mark) is paid
 * for in mapping calls, and on a GPU a call costs tens of microseconds
 * whatever its size, so these moves spend from a budget that grows by
 * move_budget_us per allocation and saves up at most GM_MOVE_BURST_US.
 * Growth, and moves that a limit, a shared budget or the device asks for,
 * are not charged and never held back. Why a budget per allocation: a
 * training step's kernels take tens of microseconds or more per
 * allocation, so 0.05 us of mapping work per allocation would stay under a
 * percent of a step on any job, and it is deterministic on the simulated
 * device. The default budget is 0 all the same: a run moved waits for its
 * stream first, and on host-bound jobs (the GPU idle, the host queueing
 * ahead) those waits cost more than the calls (config.c). The work is priced at an H100's measured
 * cost per call (bench/gpu/vmm_cost.c): a page moved through a ghost costs an unmap of the ghost at
 * its new address and a map with its access grant later; a whole run unmapped goes back to the
 * device and is created and mapped again where it is needed. */
#define GM_MOVE_BURST_US 2000.0
#define GM_PRICE_PAGE_MOVE_US (19.6 + 35.1)
#define GM_PRICE_RUN_MOVE_US (19.6 + 18.4 + 12.7 + 35.1)

static bool move_budget_left(gpumem_t* gm) {
  if (gm->opts.move_budget_us < 0) return true;
  double earned = gm->opts.move_budget_us * (double)gm->num_mallocs;
  if (gm->move_spent_us < earned - GM_MOVE_BURST_US) gm->move_spent_us = earned - GM_MOVE_BURST_US;
  return gm->move_spent_us < earned;
}

/* The budget of fenced reuse (fence.c): it takes back pages with no
 * wait, but each mapping it gives back may have to be made again when the
 * job wants that memory back (a job whose sizes never repeat would move
 * memory at every growth: synth_random 0.66 us per operation of priced
 * mapping work in its first pass without a budget), so it spends from a
 * budget of its own, GM_FENCE_BUDGET_US per allocation with at most
 * GM_MOVE_BURST_US saved up, charged as moves are. Measured on the
 * simulated device (t5_varlen_prefetch: peak reserved / peak live, priced
 * us per operation in the first pass and in its second half): none 1.0350,
 * 0.053, 0.001; 0.05: 1.0310, 0.115, 0.022; 0.1: 1.0251, 0.153, 0.056; 0.2:
 * 1.0251, 0.182, 0.058. Above 0.05 a long job's steady state passes 0.05 us
 * per operation (t5, and synth_random's second half 0.143 at 0.2). */
#define GM_FENCE_BUDGET_US 0.05

bool gm_fence_budget_left(gpumem_t* gm) {
  double earned = GM_FENCE_BUDGET_US * (double)gm->num_mallocs;
  if (gm->fence_spent_us < earned - GM_MOVE_BURST_US)
    gm->fence_spent_us = earned - GM_MOVE_BURST_US;
  return gm->fence_spent_us < earned;
}

gpumem_status_t gm_reclaim_priced(gpumem_t* gm, int which, size_t want, double* spent,
                                  size_t* got) {
  uint64_t runs0 = gm->stats.backend_calls[GPUMEM_CALL_release_page];
  int64_t unmapped0 = gm->stats.num_pages_unmapped;
  *got = 0;
  gpumem_status_t st = gm_reclaim_from(gm, which, want, got);
  double runs = (double)(gm->stats.backend_calls[GPUMEM_CALL_release_page] - runs0);
  double run_pages = (double)(gm->stats.num_pages_unmapped - unmapped0);
  double pages = (double)*got > run_pages ? (double)*got - run_pages : 0.0;
  double cost = runs * GM_PRICE_RUN_MOVE_US + pages * GM_PRICE_PAGE_MOVE_US;
  *spent += cost;
  gm->stats.move_work_us += (int64_t)(cost + 0.5);
  return st;
}

/* Reclaims for headroom and charges what the moves will cost. */
static gpumem_status_t reclaim_charged(gpumem_t* gm, size_t want) {
  size_t got = 0;
  return gm_reclaim_priced(gm, GM_RECLAIM_SPARE_SERVING, want, &gm->move_spent_us, &got);
}

/* Reserved bytes once `missing` more pages are created. */
static inline uint64_t room_after(const gpumem_t* gm, size_t missing) {
  return (uint64_t)gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current +
         (uint64_t)missing * gm->page_size;
}

/* Under lazy reclaim: would creating `missing` pages for a request of
 * `size` bytes take reserved memory past the most ever allocated plus
 * headroom? Up to there memory grows freely; past it, free pages move
 * instead of new ones being made (within what may be spent on it). */
static bool past_mark(const gpumem_t* gm, size_t missing, size_t size) {
  if (gm->opts.reclaim != GPUMEM_RECLAIM_LAZY || guard_tripped(gm)) return false;
  uint64_t hw = gm->allocated_high_water;
  uint64_t now = (uint64_t)gm->stats.allocated_bytes[GPUMEM_POOL_ALL].current + size;
  if (now > hw) hw = now;
  return (double)room_after(gm, missing) > (double)hw * (1.0 + gm->opts.headroom);
}

/* Room for `need` more mapped pages for a request of `size` bytes in arena
 * seg: spare pages, or reserved memory allowed to grow, reclaiming first
 * where the setting or a limit says so. It creates nothing (map_range
 * does, one mapping per run). *grows_freely: reserved memory is to grow
 * and nothing asked for or spent on keeping it small. */
static gpumem_status_t provide_pages(gpumem_t* gm, gm_segment* seg, size_t need, size_t size,
                                     bool* grows_freely) {
  *grows_freely = false;
  if (gm->num_spare_pages >= need) return GPUMEM_OK;
  /* During a graph capture reclaim may need synchronizations: grow. */
  if (GM_UNLIKELY(gm_capture_possible(gm)) && gm_capture_underway(gm)) return GPUMEM_OK;
  /* Planned placement: pages move when the workload changes phase, not as
   * it runs. In the first period after a plan starts serving, its arena
   * fills up while the regular arenas drain of the step's blocks (the plan
   * holds them now), so it takes free pages from every arena no plan
   * serves, instead of the footprint growing by the plan's extent; the
   * rest goes back to the device at the end of that period (plan.c,
   * trim). A regular arena takes the free pages of plan arenas no plan
   * serves (the steps stopped: a dormant or retired plan) first. An arena
   * a plan serves is robbed only when the device refuses: its free pages
   * are wanted again within a period; and after its first period it
   * robs the regular arenas no more, or pages would move both ways at
   * every fallback. */
  if (gm->planner.enabled && gm->opts.reclaim != GPUMEM_RECLAIM_EAGER) {
    /* (with a planner every mapping is one page: what is reclaimed here
     * becomes spare) */
    bool migrating = seg->plan_serving && !gm->planner.trimmed;
    int from = migrating ? GM_RECLAIM_SPARE_SERVING : GM_RECLAIM_IDLE_PLANS;
    gpumem_status_t st = gm_reclaim_from(gm, from, need - gm->num_spare_pages, NULL);
    if (st != GPUMEM_OK) return st;
    if (gm->num_spare_pages >= need) return GPUMEM_OK;
  }
  size_t ps = gm->page_size;
  size_t missing = need - (gm->num_spare_pages < need ? gm->num_spare_pages : need);
  bool reclaim_first = past_mark(gm, missing, size);
  bool needed = (gm->limit && room_after(gm, missing) > gm->limit) ||
                (gm->budget && !gm_budget_has_room(gm, (uint64_t)missing * ps));
  if (!needed && reclaim_first && gm->opts.fences && gm->opts.move_budget_us >= 0) {
    /* Before growing past the mark, whole free pages the device is known
     * done with come back (fence.c): no wait, and the growth that follows
     * creates only what they did not cover. (Where moves are paid for
     * whatever they cost, move_budget:unlimited, pages move as they did:
     * through ghosts, which come back without a call.) */
    gpumem_status_t st = gm_fence_reuse(gm, missing);
    if (st != GPUMEM_OK) return st;
    if (gm->num_spare_pages >= need) return GPUMEM_OK;
    missing = need - (gm->num_spare_pages < need ? gm->num_spare_pages : need);
    reclaim_first = past_mark(gm, missing, size);
  }
  if (!needed) {
    /* Only headroom asks: move within the budget, else grow. */
    if (!reclaim_first) {
      *grows_freely = true;
      return GPUMEM_OK;
    }
    if (!move_budget_left(gm)) {
      gm->stats.num_moves_deferred++;
      *grows_freely = true;
      return GPUMEM_OK;
    }
    return reclaim_charged(gm, missing);
  }
  /* Without a plan serving, this reclaims from every pool. At a limit,
   * take a batch (1/32 of the limit) per pass: every pass synchronizes the
   * streams it takes pages from, and on llama under a 1.02 x limit this cut
   * synchronizations in the cold pass from 195 to 63, with the same min
   * limit on every bundled trace. The surplus waits in the spare list,
   * inside the limit. */
  size_t want = missing;
  size_t batch = gm->limit / 32 / ps;
  if (gm->limit && room_after(gm, missing) > gm->limit && want < batch) want = batch;
  return gm_reclaim_from(gm, GM_RECLAIM_SPARE_SERVING, want, NULL);
}

/* Creates one physical allocation of n pages, within the limit, and maps it
 * at page p of seg (which holds no ghost there). */
static gpumem_status_t map_new(gpumem_t* gm, gm_segment* seg, size_t p, size_t n) {
  size_t ps = gm->page_size, size = n * ps;
  if (gm->limit && (uint64_t)gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current + size > gm->limit) {
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY, "the limit of %zu bytes is reached", gm->limit);
  }
  if (gm->budget) {
    gpumem_status_t taken = gm_budget_take(gm, size);
    if (taken != GPUMEM_OK) return taken;
  }
  gpumem_phys_t h = 0;
  gpumem_status_t st =
      GM_MAP_CALL(gm, create_page, gm->backend->create_page(gm->backend->ctx, size, &h));
  if (st != GPUMEM_OK) {
    if (gm->budget) gm_budget_give(gm, size);
    return st;
  }
  /* Held from here on: if the map fails, the memory waits unmapped (a page
   * as spare, a run for release) rather than being lost to a failing
   * release. */
  uint32_t id = 0;
  gpumem_status_t room = n == 1 ? spare_reserve(gm, 1) : spare_runs_reserve(gm, 1);
  if (room == GPUMEM_OK && n == 1) {
    id = phys_new(gm, h);
    if (!id) room = gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory for a page record");
  }
  if (room != GPUMEM_OK) {
    GM_MAP_CALL(gm, release_page, gm->backend->release_page(gm->backend->ctx, h, size));
    if (gm->budget) gm_budget_give(gm, size);
    return room;
  }
  gm->stats.num_device_alloc++;
  gm_stat_pool_add(gm, gm->stats.reserved_bytes, false, (int64_t)size);
  st = GM_MAP_CALL(gm, map, gm->backend->map(gm->backend->ctx, seg->addr + p * ps, size, h));
  if (st != GPUMEM_OK) {
    if (n == 1) {
      spare_push(gm, id);
    } else {
      gm->spare_runs[gm->num_spare_runs++] = (gm_spare_run){h, n};
      gm->spare_run_pages += n;
      release_spare_runs(gm);
    }
    return st;
  }
  gm->stats.num_pages_mapped += (int64_t)n;
  if (n == 1) {
    make_live(gm, seg, p, id);
    return GPUMEM_OK;
  }
  for (size_t q = p; q < p + n; q++) set_mapped(seg, q, h, p);
  if (seg->pool->is_small) {
    gm_stat_pool_move(gm->stats.reserved_bytes, true, (int64_t)size);
  }
  return GPUMEM_OK;
}

gpumem_status_t gm_private_map(gpumem_t* gm, gm_segment* seg, size_t first, size_t last) {
  /* New device pages only (graphpool.c): a spare page or a ghost may still
   * carry another stream's work or another address. Runs as long as
   * map_max allows: a private arena is reclaimed only whole, at release. */
  bool retried = false;
  for (size_t p = first; p <= last;) {
    if (gm_arena_page_mapped(seg, p)) {
      p++;
      continue;
    }
    /* (a ghost here only when a release of the pool failed part way and
     * the pool was taken up again) */
    gpumem_status_t st = seg->ghost_id[p] ? ghost_drop(gm, seg, p) : GPUMEM_OK;
    if (st != GPUMEM_OK) return st;
    size_t n = 1;
    while (n < gm->map_max_pages && p + n <= last && !gm_arena_page_mapped(seg, p + n) &&
           !seg->ghost_id[p + n])
      n++;
    st = map_new(gm, seg, p, n);
    if (st == GPUMEM_ERR_OUT_OF_MEMORY && n > 1) {
      gm->fine_mappings = true;
      st = map_new(gm, seg, p, n = 1);
    }
    if (st == GPUMEM_ERR_OUT_OF_MEMORY && !retried &&
        !(gm_capture_possible(gm) && gm_capture_underway(gm))) {
      /* Free pages of the regular arenas go back to the device, making
       * room under the limit or on the device (not during a capture:
       * that needs synchronizations). */
      retried = true;
      size_t got = 0;
      st = gm_reclaim(gm, last - p + 1, &got);
      if (st == GPUMEM_OK) st = gm_release_spare_pages(gm, 0);
      if (st == GPUMEM_OK) continue;
    }
    if (st != GPUMEM_OK) return st;
    gm_graph_pool_pinned(seg, n);
    p += n;
  }
  return GPUMEM_OK;
}

/* Pages per new mapping at most. A mapping is reclaimed only whole, so
 * large ones are made only where nothing asks for fine-grained reclaim:
 * under the pressure setting with best-fit placement, with no limit, and
 * until the device has refused memory once. Measured on the bundled traces (simulated device):
 * map_max 1G cuts mappings in the cold pass from 6,929 to 220 (gpt2) with
 * the same peak reserved, but under a limit it lifts the smallest limit
 * that fits from 1.0043 to 1.0689 x peak live (partly used mappings pin
 * their pages). */
static size_t map_run_limit(const gpumem_t* gm) {
  return gm_grows_in_runs(gm) ? gm->map_max_pages : 1;
}

/* Maps spare page id at page p of seg (whose ghost there, if any, is
 * unmapped first: one address holds one mapping). */
static gpumem_status_t map_spare(gpumem_t* gm, gm_segment* seg, size_t p, uint32_t id) {
  size_t ps = gm->page_size;
  gpumem_status_t st = GPUMEM_OK;
  if (seg->ghost_id[p]) st = ghost_drop(gm, seg, p);
  if (st == GPUMEM_OK) st = phys_claim_for(gm, id, seg->pool->stream);
  if (st != GPUMEM_OK) return st;
  st = GM_MAP_CALL(
      gm, map, gm->backend->map(gm->backend->ctx, seg->addr + p * ps, ps, phys_of(gm, id)->handle));
  if (st != GPUMEM_OK) return st;
  spare_take(gm, id);
  make_live(gm, seg, p, id);
  gm->stats.num_pages_mapped++;
  note_move(gm, seg);
  return GPUMEM_OK;
}

gpumem_status_t gm_arena_map_range(gpumem_t* gm, gm_segment* seg, uintptr_t addr, size_t size) {
  return gm_arena_map_range_ahead(gm, seg, addr, size, 0);
}

gpumem_status_t gm_arena_map_range_ahead(gpumem_t* gm, gm_segment* seg, uintptr_t addr, size_t size,
                                         size_t ahead) {
  size_t first = (addr - seg->addr) >> gm->page_shift;
  size_t last = (addr + size - 1 - seg->addr) >> gm->page_shift;
  if (GM_LIKELY(range_mapped(seg, first, last))) return GPUMEM_OK;
  if (GM_UNLIKELY(seg->pool->is_private)) return gm_private_map(gm, seg, first, last);
  /* Ghosts first: a page that was here before and is free now comes back
   * without a call. */
  size_t need = 0;
  for (size_t p = first; p <= last; p++) {
    if (gm_arena_page_mapped(seg, p)) continue;
    bool done = false;
    if (seg->ghost_id[p]) {
      gpumem_status_t st = revive(gm, seg, p, &done);
      if (st != GPUMEM_OK) return st;
    }
    need += !done;
  }
  if (!need) return GPUMEM_OK;
  bool grows_freely = false;
  gpumem_status_t st = provide_pages(gm, seg, need, size, &grows_freely);
  if (st != GPUMEM_OK) return st;
  bool all_tried = false;
  size_t max_run = map_run_limit(gm);
  /* (ahead only in mappings of several pages: a one-page mapping is the
   * setting for page-grained reclaim, which pages mapped unasked defeat) */
  size_t ahead_pages = grows_freely && max_run > 1 ? ahead >> gm->page_shift : 0;
  for (size_t p = first; p <= last;) {
    if (gm_arena_page_mapped(seg, p)) {
      p++;
      continue;
    }
    if (gm->num_spare_pages) {
      /* a ghost here whose page became spare since: that page, else the
       * newest spare */
      uint32_t id = seg->ghost_id[p];
      bool done = false;
      if (id && !phys_of(gm, id)->live_seg)
        st = revive(gm, seg, p, &done);
      else
        st = map_spare(gm, seg, p, gm->spare_pages[gm->num_spare_pages - 1]);
      if (st != GPUMEM_OK) return st;
      p++;
      continue;
    }
    if (seg->ghost_id[p]) {
      st = ghost_drop(gm, seg, p);
      if (st != GPUMEM_OK) return st;
    }
    size_t n = 1;
    while (n < max_run && p + n <= last && !gm_arena_page_mapped(seg, p + n) &&
           !seg->ghost_id[p + n])
      n++;
    /* The range's last mapping, where it walks past the arena's highest
     * mapped page, goes on over the free pages above: no block lies on an
     * unmapped page, so they are the free tail's. */
    if (ahead_pages && p + n > last && p + n >= seg->mapped_end) {
      size_t want = n + ahead_pages;
      while (n < want && n < max_run && p + n < seg->num_pages &&
             !gm_arena_page_mapped(seg, p + n) && !seg->ghost_id[p + n])
        n++;
    }
    st = map_new(gm, seg, p, n);
    if (st == GPUMEM_ERR_OUT_OF_MEMORY) {
      /* Memory is short: from now on one page per mapping, which may
       * still fit where the device or the limit has room, and which
       * reclaim can take back one at a time; nothing ahead. */
      gm->fine_mappings = true;
      max_run = 1;
      ahead_pages = 0;
      if (n > 1) continue;
    }
    if (st == GPUMEM_ERR_OUT_OF_MEMORY && !all_tried) {
      /* The device or the limit refused: free pages elsewhere may do,
       * those of a serving plan arena included. */
      all_tried = true;
      size_t got = 0;
      st = gm_reclaim(gm, last - p + 1, &got);
      if (st == GPUMEM_OK && !got) st = GPUMEM_ERR_OUT_OF_MEMORY; /* the refusal's message */
      if (st == GPUMEM_OK) continue;
    }
    if (st != GPUMEM_OK) return st;
    p += n;
  }
  return GPUMEM_OK;
}

/* ---- aliases: a partly used page shared by the request that needs it ----
 *
 * At the peak of a workload the bytes beyond live ones are mostly the free
 * parts of pages that live blocks only partly cover, at the edges of holes
 * (t5: 0.49% of live bytes); no reclaim can take them while the neighbours
 * live. When a large request still finds no room at the end of the retry
 * ladder, its last page need not be a new one: a physical page may be
 * mapped at two addresses (ghosts already are), so the page of another
 * address in the same arena whose first e bytes are free there is mapped
 * once more under the request's last page, where the request uses only its
 * first e bytes. Two shadow blocks keep the rest apart: after the request,
 * up to the end of its last page (the other address's bytes), and the
 * first e bytes at the other address (the request's). The bytes of the
 * physical page are used at one address or the other, never both, and in
 * stream order within one arena's stream. When the request is freed its
 * shadows are freed and its last page stays mapped as a ghost: no call.
 *
 * Only the arena's tail can hold a request that the holes could not: the
 * request goes there, so its last page is a page the arena never mapped
 * or one it gave up. Measured at t5's peak under a limit one page below
 * its min limit: the 363 MiB request that ran out ends 0.55 pages into
 * its last page, and 5 pages of the arena had that much free at their
 * front. */

/* Carves [addr, addr + size) out of the free block f (indexed) as a shadow:
 * the free parts before and after go back to the index. Needs room for two
 * block structs (gm_block_reserve), so that it cannot stop halfway. */
static gm_block* carve_shadow(gpumem_t* gm, gm_block* f, uintptr_t addr, size_t size) {
  gm_pool* pool = f->pool;
  gm_index_remove(&pool->index, f);
  gm_dirty_remove(f);
  if (f->addr < addr) f = gm_split_free_front(gm, f, addr - f->addr);
  gm_split_block(gm, f, size, f->size > size);
  f->state = GM_SHADOW;
  gm_arena_busy(gm, f, 1);
  return f;
}

/* The alias of record k ends: the shared page is no longer live at its
 * second address (the caller unmaps it there or leaves it as a ghost). */
static gm_alias alias_forget(gpumem_t* gm, size_t k, gm_segment** seg, size_t* page) {
  gm_alias a = gm->aliases[k];
  gm->aliases[k] = gm->aliases[--gm->num_aliases];
  gm_phys* r = phys_of(gm, a.id);
  *seg = r->alias_seg;
  *page = r->alias_page;
  clear_mapped(*seg, *page);
  (*seg)->live_id[*page] = 0;
  r->alias_seg = NULL;
  r->alias_page = 0;
  return a;
}

/* The page of seg, other than those from before_page to last_page, whose
 * first e bytes are free and which is live there alone (a single-page
 * mapping, no alias): the free block that covers them is returned in
 * *hole. The tightest such page, to leave larger free fronts to larger
 * needs. SIZE_MAX if none. */
static size_t find_free_front(gpumem_t* gm, gm_segment* seg, size_t e, size_t before_page,
                              size_t last_page, gm_block** hole) {
  size_t ps = gm->page_size, best = SIZE_MAX, best_free = SIZE_MAX;
  for (gm_block* b = seg->first; b; b = b->next) {
    if (b->state != GM_FREE || !b->next) continue;
    uintptr_t end = b->addr + b->size - seg->addr;
    size_t p = end / ps, free_front = end % ps;
    if (free_front < e || b->addr - seg->addr > p * ps)
      continue; /* not free from the page's start */
    if (p + 1 >= before_page && p <= last_page) continue;
    uint32_t id = seg->live_id[p];
    if (!id || phys_of(gm, id)->alias_seg || phys_of(gm, id)->live_seg != seg) continue;
    if (free_front < best_free) {
      best = p;
      best_free = free_front;
      *hole = b;
    }
  }
  return best;
}

gpumem_status_t gm_alias_alloc(gpumem_t* gm, gm_pool* pool, size_t rsize, gm_block** out) {
  size_t ps = gm->page_size;
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (!seg->is_arena || seg->pool != pool || seg->plan_serving) continue;
    gm_block* tail = seg->first;
    while (tail->next) tail = tail->next;
    if (tail->state != GM_FREE) continue;
    uintptr_t start = tail->addr - seg->addr, end = start + rsize;
    size_t first_page = start / ps, last_page = (end - 1) / ps, e = end - last_page * ps;
    /* Nothing to gain where the request fills its last page, or where its
     * last page is already mapped (no new page to spare). */
    if (e == ps || last_page <= first_page || tail->size < rsize + (ps - e) ||
        gm_arena_page_mapped(seg, last_page))
      continue;
    gm_block* hole = NULL;
    size_t q = find_free_front(gm, seg, e, first_page, last_page, &hole);
    if (q == SIZE_MAX) continue;
    uint32_t id = seg->live_id[q];
    /* Room for the ghost the alias becomes, and the address unmapped. */
    gpumem_status_t st = GPUMEM_OK;
    if (seg->ghost_id[last_page]) st = ghost_drop(gm, seg, last_page);
    if (st == GPUMEM_OK && phys_of(gm, id)->num_ghosts == GM_MAX_GHOSTS)
      st = ghost_drop(gm, phys_of(gm, id)->ghost_seg[0], phys_of(gm, id)->ghost_page[0]);
    if (st != GPUMEM_OK) return st;
    if (!grow_list((void**)&gm->aliases, &gm->aliases_capacity, gm->num_aliases + 1,
                   sizeof *gm->aliases) ||
        !gm_block_reserve(gm, 4))
      return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory for an alias");
    gm_block* there = carve_shadow(gm, hole, seg->addr + q * ps, e);
    /* The shadow to the end of the request's last page, carved out of the
     * tail; what stays free before it is exactly the request's range. */
    gm_block* here = carve_shadow(gm, tail, seg->addr + end, ps - e);
    gm_block* b = here->prev;
    gm_index_remove(&pool->index, b);
    gm_dirty_remove(b);
    b->state = GM_ALLOCATED;
    gm_arena_busy(gm, b, 1);
    st = gm_arena_map_range(gm, seg, b->addr, last_page * ps - start);
    if (st == GPUMEM_OK)
      st = GM_MAP_CALL(gm, map,
                       gm->backend->map(gm->backend->ctx, seg->addr + last_page * ps, ps,
                                        phys_of(gm, id)->handle));
    if (st != GPUMEM_OK) {
      gm_free_shadow(gm, here);
      gm_free_shadow(gm, there);
      gm_free_unused(gm, b);
      return st;
    }
    set_mapped(seg, last_page, phys_of(gm, id)->handle, last_page);
    seg->live_id[last_page] = id;
    phys_of(gm, id)->alias_seg = seg;
    phys_of(gm, id)->alias_page = (uint32_t)last_page;
    gm->aliases[gm->num_aliases++] = (gm_alias){b, there, id};
    b->aliased = 1;
    gm->stats.num_pages_mapped++;
    gm->stats.num_pages_aliased++;
    *out = b;
    return GPUMEM_OK;
  }
  return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY, "no page to share");
}

void gm_alias_release(gpumem_t* gm, gm_block* b) {
  size_t k = 0;
  while (k < gm->num_aliases && gm->aliases[k].owner != b) k++;
  if (k == gm->num_aliases) return; /* cannot happen: gpumem_check pairs them */
  gm_segment* seg;
  size_t p;
  gm_alias a = alias_forget(gm, k, &seg, &p);
  ghost_note(gm, a.id, seg, p); /* room was made when the alias was */
  b->aliased = 0;
  gm_free_shadow(gm, b->next);
  gm_free_shadow(gm, a.shadow_there);
}

/* ---- host-backed page slots (the overflow tier, overflow.c) ----
 *
 * A slot strictly inside a live block may hold host pages instead of a
 * device page. Such a slot is outside everything above: not mapped in
 * mapped_bits (no device page, not reserved), no page record, no ghost,
 * and under a live block, so that reclaim, ghosts, spare pages, map-ahead
 * and aliases (which look at free blocks and mapped pages only) never see
 * it. Its block is its only user; when the block is freed or its bytes
 * move back, the slot is unmapped again and the machinery above maps a
 * device page there when a block needs one. */

bool gm_arena_movable(const gpumem_t* gm, const gm_block* b, size_t* first, size_t* end) {
  const gm_segment* seg = b->seg;
  size_t ps = gm->page_size;
  size_t lo = gm_round_up(b->addr - seg->addr, ps) / ps;
  size_t hi = (b->addr + b->size - seg->addr) / ps;
  /* A mapping that begins before the interior or runs past it holds a
   * neighbour's bytes (or an edge page): its pages stay. */
  while (lo < hi && gm_arena_page_mapped(seg, lo) && seg->run_start[lo] != lo) lo++;
  while (hi > lo && gm_arena_page_mapped(seg, hi - 1)) {
    size_t start = seg->run_start[hi - 1];
    if (start + run_length(seg, start) <= hi) break;
    hi = start > lo ? start : lo;
  }
  *first = lo;
  *end = hi;
  if (lo >= hi) return false;
  for (size_t p = lo; p < hi; p++) {
    /* (every page under a live block is mapped; a page shared as an alias
     * is mapped at two addresses and stays) */
    if (!gm_arena_page_mapped(seg, p) || gm_arena_page_host(seg, p)) return false;
    uint32_t id = seg->live_id[p];
    if (id &&
        (phys_of((gpumem_t*)gm, id)->alias_seg || phys_of((gpumem_t*)gm, id)->live_seg != seg))
      return false;
  }
  return true;
}

static void host_bits_set(gm_segment* seg, size_t first, size_t end, bool on) {
  gm_bits_range(seg->host_bits, first, end - 1, on);
  seg->host_pages = on ? seg->host_pages + (end - first) : seg->host_pages - (end - first);
}

void gm_arena_host_clear(gm_segment* seg, size_t first, size_t end) {
  host_bits_set(seg, first, end, false);
}

/* Maps the device mappings of pages [first, end) back where they were
 * (their records still say which), after an unmap of the range: twice
 * each if need be, since a live block's page must not stay unmapped. */
static void remap_device(gpumem_t* gm, gm_segment* seg, size_t first, size_t end) {
  size_t ps = gm->page_size;
  for (size_t p = first; p < end;) {
    size_t n = seg->live_id[p] ? 1 : run_length(seg, p);
    uintptr_t at = seg->addr + p * ps;
    if (GM_MAP_CALL(gm, map, gm->backend->map(gm->backend->ctx, at, n * ps, seg->handles[p])) !=
        GPUMEM_OK)
      GM_MAP_CALL(gm, map, gm->backend->map(gm->backend->ctx, at, n * ps, seg->handles[p]));
    p += n;
  }
}

gpumem_status_t gm_arena_swap_to_host(gpumem_t* gm, gm_segment* seg, size_t first, size_t end,
                                      gpumem_phys_t host) {
  size_t ps = gm->page_size, n = end - first;
  uintptr_t at = seg->addr + first * ps;
  /* Room first, so that nothing can fail once the pages have swapped. */
  size_t singles = 0, runs = 0;
  for (size_t p = first; p < end;) {
    size_t m = seg->live_id[p] ? 1 : run_length(seg, p);
    singles += seg->live_id[p] != 0;
    runs += seg->live_id[p] == 0;
    p += m;
  }
  if (!seg->host_bits) {
    seg->host_bits = calloc((seg->num_pages + 63) / 64, sizeof *seg->host_bits);
    if (!seg->host_bits)
      return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory for host page slots");
  }
  gpumem_status_t st = spare_reserve(gm, singles);
  if (st == GPUMEM_OK) st = spare_runs_reserve(gm, runs);
  if (st != GPUMEM_OK) return st;
  st = GM_MAP_CALL(gm, unmap, gm->backend->unmap(gm->backend->ctx, at, n * ps));
  if (st != GPUMEM_OK) return st;
  st = GM_MAP_CALL(gm, map, gm->backend->map(gm->backend->ctx, at, n * ps, host));
  if (st != GPUMEM_OK) {
    char cause[300];
    snprintf(cause, sizeof cause, "%s", gpumem_last_error());
    remap_device(gm, seg, first, end);
    gpumem_set_last_error("%s", cause);
    return st;
  }
  gm->stats.num_pages_unmapped += (int64_t)n;
  gm->stats.num_pages_mapped++;
  /* The device pages leave the address: single pages to the spare list
   * (the request the move makes room for maps them; the caller waited for
   * every stream of the block), longer mappings back to the device. */
  for (size_t p = first; p < end;) {
    uint32_t id = seg->live_id[p];
    if (id) {
      unmake_live(gm, seg, p);
      phys_of(gm, id)->freed_on = NULL;
      spare_push(gm, id);
      p++;
      continue;
    }
    size_t m = run_length(seg, p);
    gm->spare_runs[gm->num_spare_runs++] = (gm_spare_run){seg->handles[p], m};
    gm->spare_run_pages += m;
    for (size_t q = p; q < p + m; q++) clear_mapped(seg, q);
    if (seg->pool->is_small) gm_stat_pool_move(gm->stats.reserved_bytes, false, (int64_t)(m * ps));
    p += m;
  }
  host_bits_set(seg, first, end, true);
  /* (a run whose release fails stays listed, counted as reserved, for the
   * next try) */
  (void)release_spare_runs(gm);
  return GPUMEM_OK;
}

gpumem_status_t gm_arena_swap_to_device(gpumem_t* gm, gm_segment* seg, size_t first, size_t end,
                                        gpumem_phys_t host, gpumem_phys_t dev) {
  size_t ps = gm->page_size, n = end - first;
  uintptr_t at = seg->addr + first * ps;
  /* One page is a single-page mapping, which has a page record. */
  uint32_t id = 0;
  if (n == 1) {
    id = phys_new(gm, dev);
    if (!id) return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory for a page record");
  }
  gpumem_status_t st = GM_MAP_CALL(gm, unmap, gm->backend->unmap(gm->backend->ctx, at, n * ps));
  if (st == GPUMEM_OK) {
    st = GM_MAP_CALL(gm, map, gm->backend->map(gm->backend->ctx, at, n * ps, dev));
    if (st != GPUMEM_OK) {
      char cause[300];
      snprintf(cause, sizeof cause, "%s", gpumem_last_error());
      if (GM_MAP_CALL(gm, map, gm->backend->map(gm->backend->ctx, at, n * ps, host)) != GPUMEM_OK)
        GM_MAP_CALL(gm, map, gm->backend->map(gm->backend->ctx, at, n * ps, host));
      gpumem_set_last_error("%s", cause);
    }
  }
  if (st != GPUMEM_OK) {
    if (id) phys_delete(gm, id);
    return st;
  }
  gm->stats.num_pages_unmapped++;
  gm->stats.num_pages_mapped += (int64_t)n;
  gm->stats.num_device_alloc++;
  host_bits_set(seg, first, end, false);
  /* Counted as map_new counts a new mapping: reserved (large), then moved
   * to the small pool's count for a page live in a small arena. */
  gm_stat_pool_add(gm, gm->stats.reserved_bytes, false, (int64_t)(n * ps));
  if (id) {
    make_live(gm, seg, first, id);
    return GPUMEM_OK;
  }
  for (size_t q = first; q < end; q++) set_mapped(seg, q, dev, first);
  if (seg->pool->is_small) gm_stat_pool_move(gm->stats.reserved_bytes, true, (int64_t)(n * ps));
  return GPUMEM_OK;
}
