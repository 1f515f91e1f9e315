/* Graph-private pools: the memory of CUDA graphs and torch.cuda.MemPool.
 *
 * A captured graph replays its kernels at the addresses they had during
 * capture, so the memory it used must stay where it is, and stay out of
 * other hands, until the graph is gone. A pool routed to (begin ... end)
 * serves the allocations on the streams its routing takes from streams of
 * its own: one private gm_stream per (pool, real stream), whose pools are
 * flagged is_private and which is not in gpumem_t.streams. So best fit,
 * splitting, merging and stream ownership work there as everywhere, while
 * everything that moves or shares pages walks gpumem_t.streams and never
 * sees a private pool: page reclaim, plans and their migrations, the move
 * guard, the retry ladder's cache release and aliases. Pages under a
 * private arena are always new device pages (gm_private_map), never spare
 * ones or ghosts, so they carry no other address and no other stream's
 * work, and they stay mapped until the pool is released. gpumem_check
 * verifies it (gm_graph_pools_check).
 *
 * While any pool is routed to, a capture may be underway, and CUDA refuses
 * synchronizations and event queries then (and events recorded on a
 * capturing stream join the graph). So, as PyTorch's allocator does, the
 * malloc path then leaves completed events alone and frees that would
 * record events on other streams are put off (gm_capture_defer_free) until
 * no known stream captures (the backend's stream_capture_info; without it,
 * until no pool is routed to). The OOM ladder frees no cached memory
 * during a capture (that needs synchronizations), and a synchronization
 * that page moves would need fails with a message instead. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

typedef struct gm_graph_pool {
  uint64_t id;
  int use_count;
  bool routed;
  bool use_on_oom; /* torch.cuda.MemPool(use_on_oom=True) */
  bool no_split;   /* torch.cuda.MemPool(no_split=True) */
  /* torch.cuda.MemPool(allocator=...): where its segments come from (the
   * caller's copy; its pools point here); all zero when it has none. */
  gpumem_segment_source_t source;
  /* Pages mapped into its arenas so far and not yet released: they never
   * move, so this equals its arenas' mapped pages (gpumem_check). */
  size_t pinned_pages;
  gm_stream* streams; /* private streams, one per real stream used */
  struct gm_graph_pool* next;
} gm_graph_pool;

typedef struct gm_pool_route {
  gm_graph_pool* pool;
  gpumem_stream_filter_fn filter; /* NULL: by capture id, or every stream */
  void* arg;
  uint64_t capture_id; /* 0: no capture filter */
} gm_pool_route;

static gm_graph_pool* pool_find(gpumem_t* gm, uint64_t id) {
  for (gm_graph_pool* p = gm->graph_pools; p; p = p->next)
    if (p->id == id) return p;
  return NULL;
}

/* The pool's segment source, or NULL (a set source has an alloc). */
static const gpumem_segment_source_t* pool_source(const gm_graph_pool* gp) {
  return gp->source.alloc ? &gp->source : NULL;
}

/* What each of a private stream's pools takes from its graph pool's
 * options: kept in the pool, where the malloc path reads them. */
static void pool_take_options(const gpumem_t* gm, const gm_graph_pool* gp, gm_pool* pool) {
  pool->no_split = gp->no_split;
  pool->source = pool_source(gp);
  pool->maps_pages = gm->virtual_memory && !pool->source;
}

/* The same for every pool of every private stream gp has. */
static void pools_take_options(const gpumem_t* gm, gm_graph_pool* gp) {
  for (gm_stream* s = gp->streams; s; s = s->next)
    for (int i = 0; i < GM_NUM_POOLS; i++) pool_take_options(gm, gp, &s->pools[i]);
}

static gm_stream* private_stream(const gpumem_t* gm, gm_graph_pool* gp, gpumem_stream_t handle) {
  for (gm_stream* s = gp->streams; s; s = s->next)
    if (s->handle == handle) return s;
  gm_stream* s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->handle = handle;
  s->graph_pool = gp;
  for (int i = 0; i < GM_NUM_POOLS; i++) {
    s->pools[i].stream = s;
    s->pools[i].is_small = i == GM_POOL_SMALL;
    s->pools[i].is_private = true;
    pool_take_options(gm, gp, &s->pools[i]);
    gm_dirty_init(&s->pools[i].dirty);
  }
  s->next = gp->streams;
  gp->streams = s;
  return s;
}

static bool stream_capturing(gpumem_t* gm, gpumem_stream_t stream, uint64_t* id) {
  int capturing = 0;
  uint64_t cid = 0;
  if (gm->backend->stream_capture_info(gm->backend->ctx, stream, &capturing, &cid) != GPUMEM_OK)
    return false;
  if (id) *id = cid;
  return capturing != 0;
}

gm_stream* gm_graph_route(gpumem_t* gm, gpumem_stream_t stream) {
  gm_pool_route* routes = gm->routes;
  for (size_t i = 0; i < gm->num_routes; i++) {
    gm_pool_route* r = &routes[i];
    bool take;
    if (r->filter) {
      take = r->filter(stream, r->arg) != 0;
    } else if (r->capture_id) {
      uint64_t id = 0;
      take = stream_capturing(gm, stream, &id) && id == r->capture_id;
    } else {
      take = true;
    }
    if (take) return private_stream(gm, r->pool, stream);
  }
  return NULL;
}

static bool any_capturing(gpumem_t* gm, gm_stream* list) {
  for (gm_stream* s = list; s; s = s->next)
    if (stream_capturing(gm, s->handle, NULL)) return true;
  return false;
}

bool gm_capture_underway(gpumem_t* gm) {
  /* (torch ends a capture before it stops routing, but a caller may do it
   * the other way round: the backend's word comes first) */
  if (!gm->backend->stream_capture_info) return gm->num_routes != 0;
  if (any_capturing(gm, gm->streams)) return true;
  for (gm_graph_pool* p = gm->graph_pools; p; p = p->next)
    if (any_capturing(gm, p->streams)) return true;
  gm->capture_outlives_routes = false; /* (whatever outlived its routing has ended) */
  return false;
}

/* Frees a pool's record and its private stream objects (what they held
 * went back to the device, or to its segment source, first); the source's
 * context is used no more. */
static void free_pool_record(gm_graph_pool* gp) {
  for (gm_stream *s = gp->streams, *n; s; s = n) {
    n = s->next;
    free(s);
  }
  if (pool_source(gp) && gp->source.release) gp->source.release(gp->source.ctx);
  free(gp);
}

static bool pool_try_release(gpumem_t* gm, gm_graph_pool* gp);

gpumem_status_t gm_capture_defer_free(gpumem_t* gm, gm_block* b) {
  if (gm->num_capture_deferred == gm->capture_deferred_capacity) {
    size_t cap = gm->capture_deferred_capacity ? 2 * gm->capture_deferred_capacity : 16;
    gm_block** grown = realloc(gm->capture_deferred, cap * sizeof *grown);
    if (!grown)
      return gm_fail(GPUMEM_ERR_HOST_MEMORY,
                     "gpumem_free: out of host memory to put off a free during graph capture");
    gm->capture_deferred = grown;
    gm->capture_deferred_capacity = cap;
  }
  /* Active, waiting for one sentinel event (gpumem_check counts it). */
  b->state = GM_PENDING;
  b->pending_events = 1;
  gm->capture_deferred[gm->num_capture_deferred++] = b;
  return GPUMEM_OK;
}

void gm_capture_flush(gpumem_t* gm) {
  if (!gm->num_capture_deferred || gm_capture_underway(gm)) return;
  /* (a block freed at once below may release its pool, which flushes:
   * take the list first) */
  size_t kept = 0, count = gm->num_capture_deferred;
  for (size_t i = 0; i < count; i++) {
    gm_block* b = gm->capture_deferred[i];
    gm_pool* pool = b->pool;
    b->pending_events = 0;
    /* gm_defer_free records the events now, or frees at once; on failure
     * the block is unchanged and waits for the next flush. */
    if (gm_defer_free(gm, b) != GPUMEM_OK) {
      b->state = GM_PENDING;
      b->pending_events = 1;
      gm->capture_deferred[kept++] = b;
      continue;
    }
    (void)pool;
  }
  gm->num_capture_deferred = kept;
  if (kept < count) gm_graph_pools_release_idle(gm);
}

/* ---- lifetime of a pool ---- */

static gpumem_status_t pool_retain(gpumem_t* gm, uint64_t id, gm_graph_pool** out) {
  gm_graph_pool* p = pool_find(gm, id);
  if (!p) {
    p = calloc(1, sizeof *p);
    if (!p) return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory for a pool");
    p->id = id;
    p->next = gm->graph_pools;
    gm->graph_pools = p;
  }
  p->use_count++;
  *out = p;
  return GPUMEM_OK;
}

static bool pool_holds_segments(const gpumem_t* gm, const gm_graph_pool* gp) {
  for (const gm_segment* seg = gm->segments; seg; seg = seg->next_seg)
    if (seg->pool->stream->graph_pool == gp) return true;
  return false;
}

static bool pool_holds_blocks(const gpumem_t* gm, const gm_graph_pool* gp) {
  for (const gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (seg->pool->stream->graph_pool != gp) continue;
    for (const gm_block* b = seg->first; b; b = b->next)
      if (b->state != GM_FREE) return true;
  }
  return false;
}

/* Gives a released pool's memory back to the device, unless blocks are
 * still live in it or a capture is underway (its pages are then released
 * later: at the last free, or when the capture ends). */
static bool pool_try_release(gpumem_t* gm, gm_graph_pool* gp) {
  if (gp->use_count > 0 || gp->routed || pool_holds_blocks(gm, gp)) return false;
  if (gm_capture_underway(gm)) return false;
  size_t spare_before = gm->num_spare_pages;
  bool left = false;
  for (gm_segment* seg = gm->segments; seg;) {
    gm_segment* next = seg->next_seg;
    if (seg->pool->stream->graph_pool == gp) {
      size_t mapped = seg->is_arena ? seg->mapped_pages : 0;
      if (seg->is_arena) {
        gm_arena_release_if_unused(gm, seg);
        /* (released: unlinked, so no longer in the list; a failed call
         * may have left it with some of its pages unmapped) */
        bool still = false;
        for (gm_segment* x = gm->segments; x && !still; x = x->next_seg) still = x == seg;
        gp->pinned_pages -= still ? mapped - seg->mapped_pages : mapped;
        left |= still;
      } else if (gm_release_plain_segment(gm, seg->first) != GPUMEM_OK) {
        left = true;
      }
    }
    seg = next;
  }
  /* Pages the arenas gave up became spare: back to the device too, so that
   * what capture added to reserved memory goes away with the pool. */
  if (gm->virtual_memory && gm->num_spare_pages > spare_before)
    gm_release_spare_pages(gm, spare_before);
  if (left) return false; /* a device call failed: try again at the next chance */
  gm_graph_pool** link = &gm->graph_pools;
  while (*link != gp) link = &(*link)->next;
  *link = gp->next;
  free_pool_record(gp);
  return true;
}

/* Every released pool that holds nothing goes back (each release frees
 * only its own pool, so the walk may go on past it). */
void gm_graph_pools_release_idle(gpumem_t* gm) {
  for (gm_graph_pool *p = gm->graph_pools, *next; p; p = next) {
    next = p->next;
    if (p->use_count == 0) pool_try_release(gm, p);
  }
}

/* Completes what can be: frees put off by a capture, events completed. */
static void settle(gpumem_t* gm) {
  if (gm_capture_underway(gm)) return;
  gm_capture_flush(gm);
  if (gm->pending_count) gm_process_events(gm, false);
}

void gm_graph_pool_note_free(gpumem_t* gm, gm_pool* pool) {
  gm_graph_pool* gp = pool->stream->graph_pool;
  if (gp && gp->use_count == 0) pool_try_release(gm, gp);
}

void gm_graph_pools_destroy(gpumem_t* gm) {
  gm_graph_pool* p = gm->graph_pools;
  while (p) {
    gm_graph_pool* next = p->next;
    free_pool_record(p);
    p = next;
  }
  gm->graph_pools = NULL;
  free(gm->routes);
  gm->routes = NULL;
  gm->num_routes = gm->routes_capacity = 0;
  free(gm->capture_deferred);
  gm->capture_deferred = NULL;
  gm->num_capture_deferred = gm->capture_deferred_capacity = 0;
}

/* ---- the public calls ---- */

static gpumem_status_t begin_route(gpumem_t* gm, uint64_t pool_id, gpumem_stream_filter_fn filter,
                                   void* arg, uint64_t capture_id, const char* what) {
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "%s: NULL allocator", what);
  if (!pool_id) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "%s: pool id 0 names no pool", what);
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  gm_graph_pool* existing = pool_find(gm, pool_id);
  if (existing && existing->routed) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                 "%s: pool %llu is already being allocated to; end that first", what,
                 (unsigned long long)pool_id);
    goto out;
  }
  if (gm->num_routes == gm->routes_capacity) {
    size_t cap = gm->routes_capacity ? 2 * gm->routes_capacity : 4;
    gm_pool_route* grown = realloc(gm->routes, cap * sizeof *grown);
    if (!grown) {
      st = gm_fail(GPUMEM_ERR_HOST_MEMORY, "%s: out of host memory", what);
      goto out;
    }
    gm->routes = grown;
    gm->routes_capacity = cap;
  }
  /* No lender may stay unordered into a capture (its catch-up's event
   * and wait would join the graph): caught up now, and no new ones while
   * a capture may be underway (streams.c, freed_to_lender). */
  st = gm_lenders_catch_up(gm);
  if (st != GPUMEM_OK) goto out;
  gm_graph_pool* gp = NULL;
  st = pool_retain(gm, pool_id, &gp);
  if (st != GPUMEM_OK) goto out;
  gp->routed = true;
  gm->routes[gm->num_routes++] = (gm_pool_route){gp, filter, arg, capture_id};
out:
  gm_lock_release(&gm->lock);
  return st;
}

gpumem_status_t gpumem_retain_pool(gpumem_t* gm, uint64_t pool_id) {
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_retain_pool: NULL allocator");
  if (!pool_id)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_retain_pool: pool id 0 names no pool");
  gm_lock_acquire(&gm->lock);
  gm_graph_pool* gp = NULL;
  gpumem_status_t st = pool_retain(gm, pool_id, &gp);
  gm_lock_release(&gm->lock);
  return st;
}

gpumem_status_t gpumem_begin_allocate_to_pool(gpumem_t* gm, uint64_t pool_id,
                                              gpumem_stream_filter_fn filter, void* arg) {
  return begin_route(gm, pool_id, filter, arg, 0, "gpumem_begin_allocate_to_pool");
}

gpumem_status_t gpumem_begin_allocate_to_pool_capture(gpumem_t* gm, uint64_t pool_id,
                                                      uint64_t capture_id) {
  const char* what = "gpumem_begin_allocate_to_pool_capture";
  if (gm && !gm->backend->stream_capture_info)
    return gm_fail(GPUMEM_ERR_UNSUPPORTED,
                   "%s: the %s backend cannot say which streams capture (no stream_capture_info "
                   "slot); route with a stream filter instead",
                   what, gm->backend->name ? gm->backend->name : "device");
  if (!capture_id) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "%s: capture id 0", what);
  return begin_route(gm, pool_id, NULL, NULL, capture_id, what);
}

gpumem_status_t gpumem_end_allocate_to_pool(gpumem_t* gm, uint64_t pool_id) {
  if (!gm)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_end_allocate_to_pool: NULL allocator");
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  size_t i = 0;
  while (i < gm->num_routes && gm->routes[i].pool->id != pool_id) i++;
  if (i == gm->num_routes) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                 "gpumem_end_allocate_to_pool: pool %llu is not being allocated to",
                 (unsigned long long)pool_id);
  } else {
    gm_graph_pool* gp = gm->routes[i].pool;
    gp->routed = false;
    memmove(&gm->routes[i], &gm->routes[i + 1], (gm->num_routes - i - 1) * sizeof *gm->routes);
    gm->num_routes--;
    /* A capture still going on after its routing ended (the caller ended
     * them in that order) keeps captures possible: nothing may synchronize
     * or record on a capturing stream until the backend says it ended. */
    if (!gm->num_routes && gm->backend->stream_capture_info && gm_capture_underway(gm))
      gm->capture_outlives_routes = true;
    /* Frees put off, and pools released, while a capture was underway. */
    settle(gm);
    gm_graph_pools_release_idle(gm);
  }
  gm_lock_release(&gm->lock);
  return st;
}

gpumem_status_t gpumem_release_pool(gpumem_t* gm, uint64_t pool_id) {
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_release_pool: NULL allocator");
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  gm_graph_pool* gp = pool_find(gm, pool_id);
  if (!gp || gp->use_count == 0) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_release_pool: pool %llu %s",
                 (unsigned long long)pool_id, gp ? "was released already" : "does not exist");
  } else if (--gp->use_count == 0) {
    settle(gm); /* (may release this pool already) */
    gp = pool_find(gm, pool_id);
    if (gp) pool_try_release(gm, gp);
  }
  gm_lock_release(&gm->lock);
  return st;
}

gpumem_status_t gpumem_pool_info(gpumem_t* gm, uint64_t pool_id, gpumem_pool_info_t* out) {
  if (!gm || !out) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_pool_info: NULL argument");
  memset(out, 0, sizeof *out);
  out->struct_size = sizeof *out;
  gm_lock_acquire(&gm->lock);
  gm_graph_pool* gp = pool_find(gm, pool_id);
  if (gp) {
    out->exists = 1;
    out->use_count = gp->use_count;
    out->routed = gp->routed;
    for (const gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
      if (seg->pool->stream->graph_pool != gp) continue;
      out->reserved_bytes +=
          seg->is_arena ? (uint64_t)seg->mapped_pages * gm->page_size : (uint64_t)seg->size;
      for (const gm_block* b = seg->first; b; b = b->next) {
        if (b->state != GM_ALLOCATED && b->state != GM_PENDING) continue;
        out->allocations++;
        out->allocated_bytes += b->size;
      }
    }
  }
  gm_lock_release(&gm->lock);
  return GPUMEM_OK;
}

size_t gpumem_pool_allocations(gpumem_t* gm, uint64_t pool_id, void** ptrs, size_t cap) {
  if (!gm) return 0;
  size_t n = 0;
  gm_lock_acquire(&gm->lock);
  gm_graph_pool* gp = pool_find(gm, pool_id);
  for (const gm_segment* seg = gm->segments; gp && seg; seg = seg->next_seg) {
    if (seg->pool->stream->graph_pool != gp) continue;
    for (const gm_block* b = seg->first; b; b = b->next) {
      if (b->state != GM_ALLOCATED) continue;
      if (ptrs && n < cap) ptrs[n] = (void*)b->addr;
      n++;
    }
  }
  gm_lock_release(&gm->lock);
  return n;
}

/* ---- pool options (torch.cuda.MemPool's use_on_oom and no_split) ---- */

gpumem_status_t gm_graph_pools_oom_alloc(gpumem_t* gm, gpumem_stream_t stream, int pool_idx,
                                         size_t rsize, gm_block** out) {
  /* Cached memory only, as PyTorch's allocator takes it: the pool's pages
   * are the graph's or the pool owner's, and only its free blocks may go.
   * The block stays the pool's: freed, it goes back there. */
  for (gm_graph_pool* gp = gm->graph_pools; gp; gp = gp->next) {
    if (!gp->use_on_oom) continue;
    for (gm_stream* s = gp->streams; s; s = s->next) {
      if (s->handle == stream && gm_take_cached(gm, &s->pools[pool_idx], rsize, out) == GPUMEM_OK)
        return GPUMEM_OK;
    }
  }
  return GPUMEM_ERR_OUT_OF_MEMORY;
}

typedef enum { POOL_USE_ON_OOM, POOL_NO_SPLIT } pool_option;

static gpumem_status_t set_option(gpumem_t* gm, uint64_t pool_id, pool_option option, int on,
                                  const char* what) {
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "%s: NULL allocator", what);
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  gm_graph_pool* gp = pool_find(gm, pool_id);
  if (!gp || gp->use_count == 0) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "%s: pool %llu %s", what, (unsigned long long)pool_id,
                 gp ? "was released" : "does not exist (retain it first)");
  } else if (option == POOL_USE_ON_OOM) {
    gp->use_on_oom = on != 0;
  } else {
    gp->no_split = on != 0;
    pools_take_options(gm, gp);
  }
  gm_lock_release(&gm->lock);
  return st;
}

gpumem_status_t gpumem_pool_set_use_on_oom(gpumem_t* gm, uint64_t pool_id, int on) {
  return set_option(gm, pool_id, POOL_USE_ON_OOM, on, "gpumem_pool_set_use_on_oom");
}

gpumem_status_t gpumem_pool_set_no_split(gpumem_t* gm, uint64_t pool_id, int on) {
  return set_option(gm, pool_id, POOL_NO_SPLIT, on, "gpumem_pool_set_no_split");
}

/* ---- segment sources (torch.cuda.MemPool(allocator=...)) ---- */

gpumem_status_t gpumem_pool_set_segment_source(gpumem_t* gm, uint64_t pool_id,
                                               const gpumem_segment_source_t* source) {
  const char* what = "gpumem_pool_set_segment_source";
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "%s: NULL allocator", what);
  if (source && (!source->alloc || !source->free))
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "%s: the source for pool %llu has no %s function (alloc and free are needed)",
                   what, (unsigned long long)pool_id, !source->alloc ? "alloc" : "free");
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  gpumem_segment_source_t old = {0};
  gm_graph_pool* gp = pool_find(gm, pool_id);
  if (!gp || gp->use_count == 0) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "%s: pool %llu %s", what, (unsigned long long)pool_id,
                 gp ? "was released" : "does not exist (retain it first)");
  } else if (pool_holds_segments(gm, gp)) {
    /* Its segments go back where they came from: the source of a pool that
     * holds some cannot change. */
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                 "%s: pool %llu holds memory already: set its allocator before its first "
                 "allocation",
                 what, (unsigned long long)pool_id);
  } else {
    old = gp->source;
    if (source)
      gp->source = *source;
    else
      memset(&gp->source, 0, sizeof gp->source);
    pools_take_options(gm, gp);
  }
  gm_lock_release(&gm->lock);
  /* (outside the lock: the replaced context's owner may do anything) */
  if (old.release) old.release(old.ctx);
  return st;
}

gpumem_status_t gm_graph_pool_source_alloc(gm_pool* pool, size_t size, uintptr_t* out) {
  const gpumem_segment_source_t* src = pool->source;
  unsigned long long id = (unsigned long long)pool->stream->graph_pool->id;
  gpumem_stream_t stream = pool->stream->handle;
  uintptr_t addr = 0;
  gm_call_begin();
  gpumem_status_t st = src->alloc(src->ctx, size, stream, &addr);
  if (st == GPUMEM_OK && (!addr || addr % GM_MIN_BLOCK)) {
    /* Blocks are carved at 512-byte offsets: a misaligned segment would
     * hand out misaligned memory. */
    if (addr) src->free(src->ctx, addr, size, stream);
    return gm_fail(GPUMEM_ERR_BACKEND,
                   "pool %llu's own allocator returned 0x%lx for %zu bytes: not a 512-byte "
                   "aligned address",
                   id, (unsigned long)addr, size);
  }
  if (st == GPUMEM_OK) {
    *out = addr;
    return GPUMEM_OK;
  }
  /* (not-ready is no failure status: the source failed all the same) */
  if (st == GPUMEM_NOT_READY) st = GPUMEM_ERR_BACKEND;
  if (!gm_call_wrote_message())
    gm_fail(st, "pool %llu's own allocator gave no %zu bytes on stream 0x%lx (%s)", id, size,
            (unsigned long)stream, gpumem_strerror(st));
  return st;
}

void gm_graph_pool_source_free(gm_segment* seg) {
  const gpumem_segment_source_t* src = seg->pool->source;
  src->free(src->ctx, seg->addr, seg->size, seg->pool->stream->handle);
}

/* ---- checkpoints ---- */

typedef struct gm_pool_entry {
  uintptr_t addr;
  size_t size; /* the block's */
  size_t requested;
} gm_pool_entry;

struct gpumem_pool_state {
  const gpumem_t* gm;
  uint64_t pool_id;
  size_t count;
  gm_pool_entry entries[];
};

static size_t pool_live_count(const gpumem_t* gm, const gm_graph_pool* gp) {
  size_t n = 0;
  for (const gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (seg->pool->stream->graph_pool != gp) continue;
    for (const gm_block* b = seg->first; b; b = b->next) n += b->state == GM_ALLOCATED;
  }
  return n;
}

static bool pool_has_pending(const gpumem_t* gm, const gm_graph_pool* gp) {
  for (const gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (seg->pool->stream->graph_pool != gp) continue;
    for (const gm_block* b = seg->first; b; b = b->next)
      if (b->state == GM_PENDING) return true;
  }
  return false;
}

/* The pool's segment that holds [addr, addr + size), or NULL. */
static gm_segment* pool_segment_at(gpumem_t* gm, const gm_graph_pool* gp, uintptr_t addr,
                                   size_t size) {
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (seg->pool->stream->graph_pool != gp) continue;
    if (addr >= seg->addr && size <= seg->size && addr - seg->addr <= seg->size - size) return seg;
  }
  return NULL;
}

gpumem_status_t gpumem_pool_checkpoint(gpumem_t* gm, uint64_t pool_id, gpumem_pool_state_t** out) {
  if (!gm || !out)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_pool_checkpoint: NULL argument");
  *out = NULL;
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  gm_graph_pool* gp = pool_find(gm, pool_id);
  if (!gp) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_pool_checkpoint: pool %llu does not exist",
                 (unsigned long long)pool_id);
    goto out;
  }
  size_t n = pool_live_count(gm, gp);
  gpumem_pool_state_t* state = malloc(sizeof *state + n * sizeof state->entries[0]);
  if (!state) {
    st = gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_pool_checkpoint: out of host memory");
    goto out;
  }
  state->gm = gm;
  state->pool_id = pool_id;
  state->count = 0;
  for (const gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (seg->pool->stream->graph_pool != gp) continue;
    for (const gm_block* b = seg->first; b; b = b->next)
      if (b->state == GM_ALLOCATED)
        state->entries[state->count++] = (gm_pool_entry){b->addr, b->size, b->requested};
  }
  *out = state;
out:
  gm_lock_release(&gm->lock);
  return st;
}

size_t gpumem_pool_state_allocations(const gpumem_pool_state_t* state) {
  return state ? state->count : 0;
}

void gpumem_pool_state_free(gpumem_pool_state_t* state) {
  free(state);
}

/* Makes e live again: its range lies inside one free block of seg (the
 * pool's allocations were all freed first). */
static gpumem_status_t make_live_at(gpumem_t* gm, gm_segment* seg, const gm_pool_entry* e) {
  gm_block* b = seg->first;
  while (b && b->addr + b->size <= e->addr) b = b->next;
  if (!b || b->state != GM_FREE || b->addr > e->addr || e->addr + e->size > b->addr + b->size)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_pool_restore: the checkpoint's allocation at 0x%lx (%zu bytes) overlaps "
                   "memory that is not free",
                   (unsigned long)e->addr, e->size);
  /* Two splits at most, which must not stop halfway. */
  if (!gm_block_reserve(gm, 2))
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_pool_restore: out of host memory");
  gm_pool* pool = b->pool;
  gm_index_remove(&pool->index, b);
  gm_dirty_remove(b);
  if (e->addr > b->addr) b = gm_split_free_front(gm, b, e->addr - b->addr);
  /* (called even when nothing is left over: it counts b out of the free
   * split blocks) */
  gm_split_block(gm, b, e->size, b->size > e->size);
  b->state = GM_ALLOCATED;
  gpumem_status_t st = GPUMEM_OK;
  if (seg->is_arena) {
    gm_arena_busy(gm, b, 1);
    /* (its pages stayed mapped: a private arena never gives one up) */
    st = gm_arena_map_range(gm, seg, b->addr, b->size);
  }
  if (st == GPUMEM_OK) st = gm_ptr_map_insert(&gm->ptrs, b);
  if (st != GPUMEM_OK) {
    gm_free_unused(gm, b);
    return st;
  }
  gm_note_allocated(gm, b, e->requested, gm_block_stat_small(b), pool->stream->handle);
  b->seq = 0; /* (a private pool's blocks are never the planner's) */
  return GPUMEM_OK;
}

gpumem_status_t gpumem_pool_restore(gpumem_t* gm, uint64_t pool_id,
                                    const gpumem_pool_state_t* state, void** freed,
                                    size_t freed_cap, size_t* num_freed, void** made,
                                    size_t made_cap, size_t* num_made) {
  const char* what = "gpumem_pool_restore";
  if (!gm || !state || !num_freed || !num_made || (freed_cap && !freed) || (made_cap && !made))
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "%s: NULL argument", what);
  *num_freed = *num_made = 0;
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  gm_graph_pool* gp = pool_find(gm, pool_id);
  if (state->gm != gm || state->pool_id != pool_id) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                 "%s: the checkpoint is of %s pool %llu, not of pool %llu", what,
                 state->gm == gm ? "" : "another allocator's", (unsigned long long)state->pool_id,
                 (unsigned long long)pool_id);
    goto out;
  }
  if (!gp || gp->use_count == 0) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "%s: pool %llu %s", what, (unsigned long long)pool_id,
                 gp ? "was released" : "does not exist");
    goto out;
  }
  if (gm_capture_underway(gm)) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                 "%s: refused while a graph is being captured (frees would need events)", what);
    goto out;
  }
  size_t live = pool_live_count(gm, gp);
  if (live > freed_cap || state->count > made_cap) {
    st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                 "%s: room for %zu freed and %zu made addresses; pool %llu holds %zu live "
                 "allocations and the checkpoint %zu",
                 what, freed_cap, made_cap, (unsigned long long)pool_id, live, state->count);
    goto out;
  }
  for (size_t i = 0; i < state->count; i++) {
    if (!pool_segment_at(gm, gp, state->entries[i].addr, state->entries[i].size)) {
      st = gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "%s: the checkpoint's allocation at 0x%lx is not in pool %llu's memory now",
                   what, (unsigned long)state->entries[i].addr, (unsigned long long)pool_id);
      goto out;
    }
  }
  /* Every allocation live in the pool now is freed (collected first: the
   * frees merge the blocks being walked). */
  size_t n = 0;
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (seg->pool->stream->graph_pool != gp) continue;
    for (gm_block* b = seg->first; b; b = b->next)
      if (b->state == GM_ALLOCATED) freed[n++] = (void*)b->addr;
  }
  for (size_t i = 0; i < n; i++) {
    st = gm_free_locked(gm, (uintptr_t)freed[i]);
    if (st != GPUMEM_OK) goto out; /* (freed[i..] are still live) */
    *num_freed = i + 1;
  }
  /* Frees that wait for other streams' work (and those put off by a
   * capture) complete before their memory is handed out again. */
  if (gm->num_capture_deferred) gm_capture_flush(gm);
  if (pool_has_pending(gm, gp)) {
    gm->stats.num_sync_all_streams++;
    st = gm_process_events(gm, true);
    if (st != GPUMEM_OK) goto out;
  }
  for (size_t i = 0; i < state->count; i++) {
    const gm_pool_entry* e = &state->entries[i];
    st = make_live_at(gm, pool_segment_at(gm, gp, e->addr, e->size), e);
    if (st != GPUMEM_OK) goto out;
    made[(*num_made)++] = (void*)e->addr;
  }
  gm_publish_after_op(gm);
out:
  gm_lock_release(&gm->lock);
  return st;
}

/* ---- pinned pages, counted and checked ---- */

void gm_graph_pool_pinned(gm_segment* seg, size_t pages) {
  seg->pool->stream->graph_pool->pinned_pages += pages;
}

size_t gm_graph_pools_check(gpumem_t* gm, size_t* indexed, size_t* dirty_listed, char* msg,
                            size_t len) {
  size_t errors = 0;
#define GP_VIOLATION(...)                                         \
  do {                                                            \
    if (!errors++ && msg && len) snprintf(msg, len, __VA_ARGS__); \
  } while (0)
  for (gm_graph_pool* gp = gm->graph_pools; gp; gp = gp->next) {
    if (gp->use_count < 0)
      GP_VIOLATION("pool %llu: use count %d", (unsigned long long)gp->id, gp->use_count);
    /* A pool no graph uses any more may be part way through its release
     * (a device call failed): its pages are free to go. */
    bool pinned = gp->use_count > 0 || gp->routed;
    for (gm_stream* st = gp->streams; st; st = st->next) {
      for (int i = 0; i < GM_NUM_POOLS; i++) {
        gm_pool* pool = &st->pools[i];
        if (!pool->is_private || st->graph_pool != gp)
          GP_VIOLATION("pool %llu: a stream's pool is not marked private",
                       (unsigned long long)gp->id);
        if (pool->no_split != gp->no_split)
          GP_VIOLATION("pool %llu: a stream's pool disagrees on no_split",
                       (unsigned long long)gp->id);
        if (pool->source != pool_source(gp))
          GP_VIOLATION("pool %llu: a stream's pool disagrees on its segment source",
                       (unsigned long long)gp->id);
        if (pool->maps_pages != (gm->virtual_memory && !pool_source(gp)))
          GP_VIOLATION(
              "pool %llu: a stream's pool %s pages (segment source: %s, virtual "
              "memory: %s)",
              (unsigned long long)gp->id, pool->maps_pages ? "maps" : "does not map",
              pool_source(gp) ? "yes" : "no", gm->virtual_memory ? "yes" : "no");
        errors += gm_index_check(&pool->index, pool);
        *indexed += pool->index.count;
        for (const gm_dirty_link* l = pool->dirty.next; l != &pool->dirty; l = l->next) {
          (*dirty_listed)++;
          if (l->next->prev != l) {
            GP_VIOLATION("pool %llu: dirty list broken", (unsigned long long)gp->id);
            break;
          }
        }
      }
    }
    /* (that a pool with a source holds no arena, and one without holds
     * only arenas under virtual memory, gpumem_check's walk of the segments
     * verifies against maps_pages, checked above) */
    if (pool_source(gp) && !gp->source.free)
      GP_VIOLATION("pool %llu: its segment source lacks free", (unsigned long long)gp->id);
    size_t mapped = 0;
    for (gm_segment* seg = gm->segments; seg && pinned; seg = seg->next_seg) {
      if (seg->pool->stream->graph_pool != gp || !seg->is_arena) continue;
      mapped += seg->mapped_pages;
      for (size_t p = 0; p < seg->mapped_end; p++) {
        if (seg->ghost_id[p])
          GP_VIOLATION("pool %llu: page %zu of a private arena holds a ghost",
                       (unsigned long long)gp->id, p);
        uint32_t id = seg->live_id[p];
        if (!id) continue;
        const gm_phys* r = &gm->phys[id - 1];
        if (r->live_seg != seg || r->live_page != p || r->num_ghosts || r->alias_seg)
          GP_VIOLATION("pool %llu: page %zu of a private arena is mapped elsewhere too",
                       (unsigned long long)gp->id, p);
      }
    }
    /* No page under a private pool was ever unmapped or moved: every page
     * mapped into it is still mapped there. */
    if (pinned && mapped != gp->pinned_pages)
      GP_VIOLATION("pool %llu: %zu pages were mapped into it, %zu are mapped now",
                   (unsigned long long)gp->id, gp->pinned_pages, mapped);
  }
  for (size_t i = 0; i < gm->num_routes; i++) {
    if (!gm->routes[i].pool->routed)
      GP_VIOLATION("a routing names pool %llu, which is not marked routed",
                   (unsigned long long)gm->routes[i].pool->id);
  }
  for (size_t i = 0; i < gm->num_capture_deferred; i++) {
    const gm_block* b = gm->capture_deferred[i];
    if (b->state != GM_PENDING || b->pending_events != 1)
      GP_VIOLATION("a free put off during capture is not pending on its sentinel");
  }
#undef GP_VIOLATION
  return errors;
}
