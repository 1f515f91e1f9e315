/* Streams: the per-stream pools, the streams a block was used on
 * (record_stream), and deferred frees. A block freed after use on other
 * streams is not reusable until events recorded on those streams at the
 * time of the free have completed; until then it is PENDING, counted as
 * active, and referenced from a FIFO of (event, block) pairs. Events are
 * pooled: creating one per free would put a driver function on the free path.
 *
 * In a plan arena shared by several streams (plan.c) the order is kept on
 * the device instead: a stream that takes a block of the arena first
 * waits for an event of the arena's stream (gm_shared_take), and a block
 * freed after use on other streams makes the arena's stream wait for
 * events of those (gm_defer_free). Every piece of the arena's memory is
 * then ordered before the arena stream's later work, as memory of one
 * stream is: that stream reuses it at once, and its synchronization
 * finishes every use (what page reclaim relies on). */
#include <stdlib.h>
#include <string.h>

#include "engine.h"

gm_stream* gm_stream_get(gpumem_t* gm, gpumem_stream_t handle) {
  gm_stream* s = gm->last_stream;
  if (GM_LIKELY(s && s->handle == handle)) return s;
  for (s = gm->streams; s; s = s->next) {
    if (s->handle == handle) {
      gm->last_stream = s;
      return s;
    }
  }
  s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->handle = handle;
  for (int i = 0; i < GM_NUM_POOLS; i++) {
    s->pools[i].stream = s;
    s->pools[i].is_small = i == GM_POOL_SMALL;
    s->pools[i].is_plan = i == GM_POOL_PLAN;
    /* (a large arena's block of at most 1 MiB is a small request: large
     * ones are larger, and arenas split to the rounded request) */
    s->pools[i].stat_by_size =
        i == GM_POOL_PLAN || (i == GM_POOL_LARGE && gm->virtual_memory && gm->opts.small_pool);
    s->pools[i].maps_pages = gm->virtual_memory;
    s->pools[i].index.counts_only = i == GM_POOL_PLAN;
    gm_dirty_init(&s->pools[i].dirty);
  }
  s->next = gm->streams;
  gm->streams = s;
  gm->last_stream = s;
  return s;
}

void gm_streams_destroy(gpumem_t* gm) {
  gm_stream* s = gm->streams;
  while (s) {
    gm_stream* next = s->next;
    gm_fence_stream_destroy(gm, s);
    if (s->probe_made)
      GM_CALL(gm, event_destroy, gm->backend->event_destroy(gm->backend->ctx, s->probe_event));
    free(s);
    s = next;
  }
  gm->streams = NULL;
  gm->last_stream = NULL;
}

static gpumem_stream_t* block_uses(gm_block* b) {
  return b->num_uses > GM_INLINE_USES ? b->extra_uses : b->inline_uses;
}

gpumem_status_t gm_block_add_use(gm_block* b, gpumem_stream_t stream) {
  /* Its arena's stream is a use like any other of a lent block: its free
   * by the borrower leaves the lender's probe as it was (own_frees), so
   * the lender's work on it must be waited for as another stream's. */
  if (stream == b->pool->stream->handle && !b->lent) {
    b->handed = 0; /* a handed block used on its arena's stream too (ordered_free) */
    return GPUMEM_OK;
  }
  gpumem_stream_t* uses = block_uses(b);
  for (unsigned i = 0; i < b->num_uses; i++) {
    if (uses[i] == stream) return GPUMEM_OK;
  }
  if (b->num_uses < GM_INLINE_USES) {
    b->inline_uses[b->num_uses++] = stream;
    return GPUMEM_OK;
  }
  if (b->num_uses == UINT16_MAX) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_record_stream: block 0x%lx is used on too many streams",
                   (unsigned long)b->addr);
  }
  /* The array outlives the uses (a block struct is reused after its frees
   * complete): grow it only when it is full, whatever its earlier size.
   * (num_uses < UINT16_MAX here, so a full array is below the clamp.) */
  if (!b->extra_capacity || b->num_uses == b->extra_capacity) {
    uint32_t cap = b->extra_capacity ? 2u * b->extra_capacity : 8;
    if (cap > UINT16_MAX) cap = UINT16_MAX;
    gpumem_stream_t* grown = realloc(b->extra_uses, cap * sizeof *grown);
    if (!grown) return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_record_stream: out of host memory");
    b->extra_uses = grown;
    b->extra_capacity = (uint16_t)cap;
  }
  if (b->num_uses == GM_INLINE_USES) memcpy(b->extra_uses, b->inline_uses, sizeof b->inline_uses);
  b->extra_uses[b->num_uses++] = stream;
  return GPUMEM_OK;
}

static gpumem_status_t take_event(gpumem_t* gm, gpumem_event_t* out) {
  if (gm->num_spare_events) {
    *out = gm->spare_events[--gm->num_spare_events];
    return GPUMEM_OK;
  }
  return GM_CALL(gm, event_create, gm->backend->event_create(gm->backend->ctx, out));
}

static void give_back_event(gpumem_t* gm, gpumem_event_t ev) {
  if (gm->num_spare_events == gm->spare_events_capacity) {
    size_t cap = gm->spare_events_capacity ? gm->spare_events_capacity * 2 : 16;
    gpumem_event_t* grown = realloc(gm->spare_events, cap * sizeof *grown);
    if (!grown) {
      GM_CALL(gm, event_destroy, gm->backend->event_destroy(gm->backend->ctx, ev));
      return;
    }
    gm->spare_events = grown;
    gm->spare_events_capacity = cap;
  }
  gm->spare_events[gm->num_spare_events++] = ev;
}

static gpumem_status_t pending_reserve(gpumem_t* gm, size_t extra) {
  if (gm->pending_count + extra <= gm->pending_capacity) return GPUMEM_OK;
  size_t cap = gm->pending_capacity ? gm->pending_capacity : 64;
  while (cap < gm->pending_count + extra) cap *= 2;
  gm_pending_event* grown = malloc(cap * sizeof *grown);
  if (!grown)
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_free: out of host memory for deferred frees");
  for (size_t i = 0; i < gm->pending_count; i++) {
    grown[i] = gm->pending[(gm->pending_head + i) % gm->pending_capacity];
  }
  free(gm->pending);
  gm->pending = grown;
  gm->pending_head = 0;
  gm->pending_capacity = cap;
  return GPUMEM_OK;
}

static bool backend_has_events(const gpumem_t* gm) {
  const gpumem_backend_t* be = gm->backend;
  return be->event_create && be->event_destroy && be->event_record && be->event_query &&
         be->event_sync;
}

bool gm_can_order_streams(const gpumem_t* gm) {
  return gm->opts.stream_waits && backend_has_events(gm) && gm->backend->stream_wait;
}

/* Makes `waiter`'s later work wait on the device for `source`'s work so
 * far: an event recorded on source, waited for by waiter. The event goes
 * back to the pool at once: a wait holds the record it was given, and a
 * later record of the same event does not move it. */
static gpumem_status_t order_after(gpumem_t* gm, gpumem_stream_t waiter, gpumem_stream_t source) {
  const gpumem_backend_t* be = gm->backend;
  gpumem_event_t ev;
  gpumem_status_t st = take_event(gm, &ev);
  if (st != GPUMEM_OK) return st;
  st = GM_CALL(gm, event_record, be->event_record(be->ctx, ev, source));
  if (st == GPUMEM_OK) st = GM_CALL(gm, stream_wait, be->stream_wait(be->ctx, waiter, ev));
  give_back_event(gm, ev);
  return st;
}

/* Is every use of the free blocks of s's arenas over on the device? A
 * probe event recorded on s after its last free answers, once complete,
 * with a query: never a wait. A free since makes the probe stale, and a
 * new one is recorded for a later question; not a lent block's free by its
 * borrower (own_frees): that block is free again only once the
 * borrower's use is over, and its uses on s were over before the lend.
 * (Blocks s's unordered borrower freed are the exception: that borrower
 * may take them in its own stream order, another only after
 * gm_lender_catch_up, which makes the probe stale.) Blocks that became free when
 * events of other streams completed (record_stream) were freed before the
 * probe too, and their other streams' uses are over. (The probe is queried
 * at once after its record: on a stream with nothing queued it may be
 * complete already.) */
bool gm_stream_settled(gpumem_t* gm, gm_stream* s) {
  const gpumem_backend_t* be = gm->backend;
  if (!s->probe_recorded || s->probe_frees != s->own_frees) {
    if (!s->probe_made) {
      if (GM_CALL(gm, event_create, be->event_create(be->ctx, &s->probe_event)) != GPUMEM_OK)
        return false;
      s->probe_made = true;
    }
    if (GM_CALL(gm, event_record, be->event_record(be->ctx, s->probe_event, s->handle)) !=
        GPUMEM_OK)
      return false;
    s->probe_recorded = true;
    s->probe_done = false;
    s->probe_frees = s->own_frees;
  }
  if (!s->probe_done)
    s->probe_done = GM_CALL(gm, event_query, be->event_query(be->ctx, s->probe_event)) == GPUMEM_OK;
  return s->probe_done;
}

gpumem_status_t gm_lender_catch_up(gpumem_t* gm, gm_stream* s) {
  gm_stream* u = s->unordered_borrower;
  gpumem_status_t st = order_after(gm, s->handle, u->handle);
  if (st != GPUMEM_OK) return st;
  s->unordered_borrower = NULL;
  /* (a probe recorded before this wait does not cover u's uses) */
  s->own_frees++;
  return GPUMEM_OK;
}

gpumem_status_t gm_lenders_catch_up(gpumem_t* gm) {
  for (gm_stream* s = gm->streams; s; s = s->next) {
    gpumem_status_t st = gm_lender_ready(gm, s);
    if (st != GPUMEM_OK) return st;
  }
  return GPUMEM_OK;
}

/* lend:ordered: a lent block freed by its borrower alone is free at once,
 * in its lender's arena: the borrower may take it again in its own stream
 * order (borrow_mapped), as cudaMallocAsync's pool gives a stream back
 * what it freed; the lender is ordered after the borrower only when it
 * next needs to be (gm_lender_ready), so that a step's frees cost one
 * wait at most instead of an event each. One unordered borrower per
 * lender: a second one's free catches the lender up with the first. Not
 * while a capture may be underway (events and waits would join it). */
static bool freed_to_lender(gpumem_t* gm, gm_block* b) {
  if (!gm_lends_ordered(gm) || b->num_uses != 1 || gm_capture_possible(gm)) return false;
  gm_stream* lender = b->pool->stream;
  gm_stream* u = gm_stream_get(gm, b->inline_uses[0]);
  if (!u || u == lender) return false;
  if (lender->unordered_borrower != u && gm_lender_ready(gm, lender) != GPUMEM_OK) return false;
  lender->unordered_borrower = u;
  b->num_uses = 0;
  gm_free_block(gm, b);
  return true;
}

gpumem_status_t gm_shared_take(gpumem_t* gm, gm_block* b, gm_stream* u) {
  gm_stream* owner = b->pool->stream;
  /* u's own blocks freed since (used on u alone) need no wait: stream
   * order keeps u's uses apart. */
  uint64_t others = owner->frees_total - u->self_frees;
  if (u->waited_on != owner || u->waited_frees != others) {
    gpumem_status_t st = order_after(gm, u->handle, owner->handle);
    if (st != GPUMEM_OK) return st;
    u->waited_on = owner;
    u->waited_frees = others;
  }
  gpumem_status_t st = gm_block_add_use(b, u->handle);
  if (st == GPUMEM_OK) b->handed = 1;
  return st;
}

/* A block of a shared plan arena freed after use on other streams: its
 * stream waits for theirs on the device, and the block is free at once. */
static gpumem_status_t ordered_free(gpumem_t* gm, gm_block* b) {
  gpumem_stream_t* uses = block_uses(b);
  gpumem_stream_t owner = b->pool->stream->handle;
  for (unsigned i = 0; i < b->num_uses; i++) {
    gpumem_status_t st = order_after(gm, owner, uses[i]);
    if (st != GPUMEM_OK) return st;
  }
  if (b->handed && b->num_uses == 1) {
    /* Used on the stream that took it alone (the arena's own stream never
     * touched it): that stream's later takes need no wait for it. (The
     * lookup fails only without host memory: a wait too many.) */
    gm_stream* only = gm_stream_get(gm, uses[0]);
    if (only) only->self_frees++;
  }
  b->handed = 0;
  b->num_uses = 0;
  gm_free_block(gm, b);
  return GPUMEM_OK;
}

gpumem_status_t gm_defer_free(gpumem_t* gm, gm_block* b) {
  /* (an arena is shared only where streams can be ordered, plan.c; a
   * wait that failed leaves the block as it was: pending instead) */
  if (b->seg->shared_streams && ordered_free(gm, b) == GPUMEM_OK) return GPUMEM_OK;
  if (GM_UNLIKELY(b->lent) && freed_to_lender(gm, b)) return GPUMEM_OK;
  b->handed = 0;
  unsigned n = b->num_uses;
  gpumem_stream_t* uses = block_uses(b);
  if (!backend_has_events(gm)) {
    b->num_uses = 0;
    gm_free_block(gm, b);
    return GPUMEM_OK;
  }
  gpumem_status_t st = pending_reserve(gm, n);
  if (st != GPUMEM_OK) return st;
  /* Record every event first; commit only when all succeeded, so that a
   * failure leaves nothing half done. */
  gpumem_event_t local[16];
  gpumem_event_t* events = n <= 16 ? local : malloc(n * sizeof *events);
  if (!events) return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_free: out of host memory");
  unsigned taken = 0;
  for (; taken < n; taken++) {
    st = take_event(gm, &events[taken]);
    if (st != GPUMEM_OK) break;
    st = GM_CALL(gm, event_record,
                 gm->backend->event_record(gm->backend->ctx, events[taken], uses[taken]));
    if (st != GPUMEM_OK) {
      give_back_event(gm, events[taken]);
      break;
    }
  }
  if (st != GPUMEM_OK) {
    for (unsigned i = 0; i < taken; i++) give_back_event(gm, events[i]);
    if (events != local) free(events);
    /* Fall back to waiting for the streams now: slower, equally safe. */
    for (unsigned i = 0; i < n; i++) {
      gm->stats.num_syncs++;
      st = GM_CALL(gm, stream_sync, gm->backend->stream_sync(gm->backend->ctx, uses[i]));
      if (st != GPUMEM_OK) return st;
    }
    b->num_uses = 0;
    gm_free_block(gm, b);
    return GPUMEM_OK;
  }
  b->state = GM_PENDING;
  b->pending_events = n;
  for (unsigned i = 0; i < n; i++) {
    size_t slot = (gm->pending_head + gm->pending_count) % gm->pending_capacity;
    gm->pending[slot].event = events[i];
    gm->pending[slot].block = b;
    gm->pending_count++;
  }
  if (events != local) free(events);
  b->num_uses = 0;
  return GPUMEM_OK;
}

gpumem_status_t gm_process_events(gpumem_t* gm, bool wait) {
  while (gm->pending_count) {
    gm_pending_event* pe = &gm->pending[gm->pending_head];
    gpumem_status_t st;
    if (wait) {
      gm->stats.num_syncs++;
      st = GM_CALL(gm, event_sync, gm->backend->event_sync(gm->backend->ctx, pe->event));
    } else {
      st = GM_CALL(gm, event_query, gm->backend->event_query(gm->backend->ctx, pe->event));
      if (st == GPUMEM_NOT_READY) return GPUMEM_OK;
    }
    if (st != GPUMEM_OK) return st;
    gm_block* b = pe->block;
    give_back_event(gm, pe->event);
    gm->pending_head = (gm->pending_head + 1) % gm->pending_capacity;
    gm->pending_count--;
    if (--b->pending_events == 0) {
      gm_pool* pool = b->pool;
      gm_free_block(gm, b);
      /* The last free of a released private pool may be this one: the
       * pool goes back now, as at a direct free (graphpool.c). Its blocks
       * were all free but this one, so no later entry names it. */
      if (GM_UNLIKELY(pool->is_private)) gm_graph_pool_note_free(gm, pool);
    }
  }
  return GPUMEM_OK;
}

void gm_events_destroy(gpumem_t* gm) {
  for (size_t i = 0; i < gm->pending_count; i++) {
    gpumem_event_t ev = gm->pending[(gm->pending_head + i) % gm->pending_capacity].event;
    GM_CALL(gm, event_destroy, gm->backend->event_destroy(gm->backend->ctx, ev));
  }
  for (size_t i = 0; i < gm->num_spare_events; i++) {
    GM_CALL(gm, event_destroy, gm->backend->event_destroy(gm->backend->ctx, gm->spare_events[i]));
  }
  free(gm->pending);
  free(gm->spare_events);
  gm->pending = NULL;
  gm->spare_events = NULL;
  gm->pending_count = gm->num_spare_events = 0;
}
