/* The overflow tier (option overflow:host): host memory under addresses the
 * allocator owns, so that a job needing more than the device holds runs
 * slower instead of failing.
 *
 * gpumem reserves the address range under every block it hands out, so
 * what backs a range can change while the address does not. A request the
 * device path cannot serve (after the whole retry ladder) gets a tier
 * block: an address range of its own with host pages mapped under it
 * (backend create_host_page: cuMemCreate with a host location). Kernels
 * read and write it over the host link. When device room returns the block
 * moves back: device pages are made and mapped at a scratch range, the
 * bytes copied on the block's stream, the old pages unmapped and the new
 * ones mapped at the block's own address. Nothing in the caller sees the
 * move; the address is the same throughout.
 *
 * Arena blocks' pages. A block placed in an arena shares its partly used
 * first and last pages with its neighbours, but the whole pages inside it
 * are its alone, so those move too: their page slots become host-backed
 * (pages.c), one host allocation under them, recorded here
 * (gm_arena_host), at the same addresses. What stays: the shared edge
 * pages, and pages of a mapping that reaches past the block (a mapping is
 * unmapped only whole; under a cap every mapping is one page). A free of
 * such a block waits for its streams and gives the host pages back before
 * the block is freed, leaving the slots unmapped for the usual machinery.
 *
 * What overflows, by coldness. Blocks that stay live across a whole step
 * and are touched once in it (optimizer state, master weights) are the
 * natural tenants; a request that arrives now is, by definition, about to
 * be used. So under pressure, before a new block goes to host pages, cold
 * blocks move to host, coldest first, until the pages freed cover the
 * request: the tier's own blocks on device pages and arena blocks with
 * whole pages of their own; those the caller marked (gpumem_prefer_host)
 * first, then the longest untouched (made, moved or handed to a stream
 * with record_stream longest ago, counted in allocations). An arena block
 * of the last GM_HOT_ALLOCS allocations (or the plan's period) is hot: it
 * belongs to the step now running. Where the cold ones fall short, the
 * warm ones go too, all but the last GM_HOT_MIN_ALLOCS allocations', unless
 * such moves have proved a waste (their blocks died young); only where
 * nothing movable is left does the new request get host pages
 * (docs/design.md, "The overflow tier").
 *
 * No ping-pong. A block (tier or arena) that pressure moved to host
 * GM_TIER_BOUNCES times stays there until empty_cache: a step that needs
 * its room every time would otherwise pay two copies of it per step over
 * the host link, where leaving it on host pays only the reads the kernels
 * make.
 *
 * When it is safe to move. A move copies on the block's own stream and
 * waits for that stream, so the copy follows the work queued there; every
 * other stream the block was handed to (record_stream) must be idle first.
 * Under pressure (the retry ladder's end, where PyTorch synchronizes every
 * stream too) and at empty_cache (which waits for pending frees in
 * PyTorch as here) the allocator waits for them; a move back at a free
 * never waits: an event recorded on each of the block's streams, its own
 * included, must be complete at once, else the block stays where it is
 * until a later free or empty_cache.
 *
 * A move assumes that no other host thread queues work touching the block
 * while it runs (the allocator's lock is held, but kernels are queued
 * without it): the address is unmapped for the few calls between the old
 * pages going and the new ones coming.
 *
 * Every step of a move can fail (the fault-injection test fails each in
 * turn): a failure undoes what was done, in reverse, so the block stays
 * where it was, with its bytes, and the allocator consistent. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

/* Pressure moves before a block stays on host until empty_cache: one move
 * back and forth is a guess that the room will last; the second time
 * round, it did not. */
#define GM_TIER_BOUNCES 2

/* The host link's rate for the priced figure host_link_model_us: a model
 * figure (the simulated device's, gpumem_backend.h: an H100's PCIe Gen5 x16
 * host link ~50 GB/s against ~3 TB/s of HBM3), pending a measurement on the
 * GPU. */
#define GM_HOST_LINK_BYTES_PER_S GPUMEM_SIM_HOST_LINK_BYTES_PER_S

static void price_host_traffic(gpumem_t* gm, size_t bytes) {
  gm->stats.host_link_model_us += (int64_t)((double)bytes * 1e6 / GM_HOST_LINK_BYTES_PER_S);
}

/* Host bytes held: under tier blocks and under arena blocks' interiors. */
static size_t host_held(const gpumem_t* gm) {
  return gm->tier_host_bytes + gm->arena_host_bytes;
}

static bool tier_has_host_pages(const gpumem_t* gm) {
  return gm->backend->create_host_page && gm->backend->copy;
}

static void tier_link(gpumem_t* gm, gm_tier_block* t) {
  t->prev = NULL;
  t->next = gm->tier;
  if (gm->tier) gm->tier->prev = t;
  gm->tier = t;
  gm->tier_count++;
}

static void tier_unlink(gpumem_t* gm, gm_tier_block* t) {
  if (t->prev)
    t->prev->next = t->next;
  else
    gm->tier = t->next;
  if (t->next) t->next->prev = t->prev;
  gm->tier_count--;
}

/* Which pool's statistics the tier block's bytes count in: its block's. */
static bool tier_small(const gm_tier_block* t) {
  return gm_block_stat_small(t->seg.first);
}

/* The side t's bytes are on changes (or appear, or go): the sums and the
 * statistics. delta is +1 (add t's bytes on side on_host) or -1. */
static void tier_account(gpumem_t* gm, const gm_tier_block* t, bool on_host, int delta) {
  int64_t n = (int64_t)t->bytes * delta;
  if (on_host) {
    gm->tier_host_bytes = (size_t)((int64_t)gm->tier_host_bytes + n);
    gm->tier_on_host = (size_t)((int64_t)gm->tier_on_host + delta);
    gm_stat_pool_add(gm, gm->stats.host_bytes, tier_small(t), n);
  } else {
    gm->tier_device_bytes = (size_t)((int64_t)gm->tier_device_bytes + n);
    if (delta > 0)
      gm_stat_pool_add(gm, gm->stats.reserved_bytes, tier_small(t), n);
    else
      gm_reserved_released(gm, tier_small(t), t->bytes);
  }
}

static bool host_take_kept(gpumem_t* gm, size_t bytes, gpumem_phys_t* out);
static void note_warm_free(gpumem_t* gm, uint64_t warm_moved_at);
static void host_trim_kept(gpumem_t* gm, size_t more, size_t bound);

/* Host pages for bytes more, within the budget: a kept allocation of that
 * size, else created; or GPUMEM_ERR_OUT_OF_MEMORY saying which of the two
 * (the budget, the host) refused. */
static gpumem_status_t create_host_pages(gpumem_t* gm, size_t bytes, gpumem_phys_t* out) {
  char want[32], held[32], budget[32];
  size_t cap = gm->opts.overflow_host_bytes;
  /* Freed blocks still retiring hold host pages: waited for before the
   * budget refuses. */
  if (cap && host_held(gm) + bytes > cap && gm->tier_retiring) gm_overflow_retire(gm, true);
  if (cap && host_held(gm) + bytes > cap) {
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                   "the host budget is spent too: %s more host pages would pass overflow:host:%s "
                   "(%s already host-backed)",
                   gm_format_bytes(bytes, want, sizeof want),
                   gm_format_bytes(cap, budget, sizeof budget),
                   gm_format_bytes(host_held(gm), held, sizeof held));
  }
  /* These bytes are about to be held: the bound on held and kept grows
   * with them. */
  if (host_held(gm) + bytes > gm->host_high) gm->host_high = host_held(gm) + bytes;
  if (host_take_kept(gm, bytes, out)) return GPUMEM_OK;
  host_trim_kept(gm, bytes, gm->host_high);
  gpumem_status_t st = GM_MAP_CALL(gm, create_host_page,
                                   gm->backend->create_host_page(gm->backend->ctx, bytes, out));
  if (st == GPUMEM_ERR_OUT_OF_MEMORY) {
    char cause[300];
    snprintf(cause, sizeof cause, "%s", gpumem_last_error());
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                   "the host refused %s more host pages too (%s already host-backed): %s",
                   gm_format_bytes(bytes, want, sizeof want),
                   gm_format_bytes(host_held(gm), held, sizeof held), cause);
  }
  return st;
}

/* Device pages for bytes more, within the limit and the shared budget. */
static gpumem_status_t create_device_pages(gpumem_t* gm, size_t bytes, gpumem_phys_t* out) {
  uint64_t reserved = (uint64_t)gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current;
  if (gm->limit && reserved + bytes > gm->limit)
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY, "no room under the limit");
  if (gm->budget) {
    gpumem_status_t st = gm_budget_take(gm, bytes);
    if (st != GPUMEM_OK) return st;
  }
  gpumem_status_t st =
      GM_MAP_CALL(gm, create_page, gm->backend->create_page(gm->backend->ctx, bytes, out));
  if (st != GPUMEM_OK && gm->budget) gm_budget_give(gm, bytes);
  return st;
}

/* Gives physical memory back. give_budget: device pages never counted as
 * reserved (a move undone), whose shared budget goes back here; those
 * that were counted went back with gm_reserved_released (tier_account). */
static void release_pages(gpumem_t* gm, gpumem_phys_t h, size_t bytes, bool give_budget) {
  if (GM_MAP_CALL(gm, release_page, gm->backend->release_page(gm->backend->ctx, h, bytes)) ==
          GPUMEM_OK &&
      give_budget && gm->budget)
    gm_budget_give(gm, bytes);
}

/* ---- kept host pages ----
 *
 * Pinning host memory is the tier's slowest call: cuMemCreate of host pages
 * ran at 3.4-3.6 GB/s on an H100 (the kernel allocates, zeroes and pins
 * them), against ~50 GB/s for the copy a move makes. A job over its cap
 * overflows the same requests and moves the same cold blocks every step,
 * so a host allocation that no block uses any more (a tier block retired or
 * moved back, an arena block's pages moved back or freed) is kept, unmapped
 * and idle, for a later one of exactly its size (cuMemMap maps a whole
 * allocation from offset 0). Bound: host bytes held under blocks and kept
 * together never pass host_high, the most held at once (plus a creation's
 * bytes), so the tier never pins more than the job needed on host at its
 * peak; within a budget, host_high is within it. Oldest kept go first.
 * empty_cache and teardown give every kept allocation back. */

typedef struct gm_host_kept {
  gpumem_phys_t handle;
  size_t bytes;
} gm_host_kept;

static void host_kept_account(gpumem_t* gm, size_t bytes, int delta) {
  int64_t n = (int64_t)bytes * delta;
  gm->host_kept_bytes = (size_t)((int64_t)gm->host_kept_bytes + n);
  gm_stat_pool_add(gm, gm->stats.host_cached_bytes, false, n);
}

/* Gives back kept allocations, oldest first, until held + kept + more is
 * within bound. */
static void host_trim_kept(gpumem_t* gm, size_t more, size_t bound) {
  size_t k = 0;
  while (k < gm->num_host_kept && host_held(gm) + gm->host_kept_bytes + more > bound) {
    host_kept_account(gm, gm->host_kept[k].bytes, -1);
    release_pages(gm, gm->host_kept[k].handle, gm->host_kept[k].bytes, false);
    k++;
  }
  if (!k) return;
  memmove(gm->host_kept, gm->host_kept + k, (gm->num_host_kept - k) * sizeof *gm->host_kept);
  gm->num_host_kept -= k;
}

void gm_overflow_release_kept(gpumem_t* gm) {
  host_trim_kept(gm, 0, 0);
  gm->host_high = host_held(gm);
}

/* A kept allocation of exactly bytes, the newest such: taken out of the
 * list, or false. */
static bool host_take_kept(gpumem_t* gm, size_t bytes, gpumem_phys_t* out) {
  for (size_t k = gm->num_host_kept; k-- > 0;) {
    if (gm->host_kept[k].bytes != bytes) continue;
    *out = gm->host_kept[k].handle;
    memmove(gm->host_kept + k, gm->host_kept + k + 1,
            (gm->num_host_kept - k - 1) * sizeof *gm->host_kept);
    gm->num_host_kept--;
    host_kept_account(gm, bytes, -1);
    gm->stats.num_host_pages_reused++;
    return true;
  }
  return false;
}

/* Host pages no block uses any more (unmapped, no work queued on them,
 * not counted as held): kept while the bound allows, else given back. */
static void release_host_pages(gpumem_t* gm, gpumem_phys_t h, size_t bytes) {
  if (host_held(gm) + gm->host_kept_bytes + bytes <= gm->host_high) {
    if (gm->num_host_kept == gm->host_kept_capacity) {
      size_t cap = gm->host_kept_capacity ? 2 * gm->host_kept_capacity : 16;
      gm_host_kept* grown = realloc(gm->host_kept, cap * sizeof *grown);
      if (grown) {
        gm->host_kept = grown;
        gm->host_kept_capacity = cap;
      }
    }
    if (gm->num_host_kept < gm->host_kept_capacity) {
      gm->host_kept[gm->num_host_kept++] = (gm_host_kept){h, bytes};
      host_kept_account(gm, bytes, +1);
      return;
    }
  }
  release_pages(gm, h, bytes, false);
}

/* ---- allocation and free ---- */

gpumem_status_t gm_overflow_alloc(gpumem_t* gm, gm_pool* pool, size_t rsize, gm_block** out) {
  if (!tier_has_host_pages(gm))
    return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                   "overflow:host is on but backend \"%s\" offers no host pages "
                   "(create_host_page)",
                   gm->backend->name ? gm->backend->name : "?");
  const gpumem_backend_t* be = gm->backend;
  size_t bytes = gm_round_up(rsize, gm->page_size);
  gm_tier_block* t = calloc(1, sizeof *t);
  if (!t || !gm_block_reserve(gm, 1)) {
    free(t);
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "overflow tier: no host memory for a block's record");
  }
  uintptr_t addr = 0;
  gpumem_status_t st = create_host_pages(gm, bytes, &t->handle);
  if (st != GPUMEM_OK) goto fail;
  st = GM_CALL(gm, reserve, be->reserve(be->ctx, bytes, &addr));
  if (st != GPUMEM_OK) goto fail_pages;
  st = GM_MAP_CALL(gm, map, be->map(be->ctx, addr, bytes, t->handle));
  if (st != GPUMEM_OK) goto fail_range;
  gm->stats.num_pages_mapped++;

  gm_block* b = gm_block_new(gm); /* cannot fail: reserved above */
  memset(b, 0, sizeof *b);
  b->addr = addr;
  b->size = rsize;
  b->seg = &t->seg;
  b->pool = pool;
  b->state = GM_ALLOCATED;
  gm_dirty_init(&b->dirty);
  t->seg.addr = addr;
  t->seg.size = bytes;
  t->seg.pool = pool;
  t->seg.first = b;
  t->seg.tier = t;
  t->bytes = bytes;
  t->on_host = true;
  t->last_touch = gm->num_mallocs;
  tier_link(gm, t);
  tier_account(gm, t, true, +1);
  gm->stats.num_host_allocs++;
  price_host_traffic(gm, rsize);
  *out = b;
  return GPUMEM_OK;

fail_range:
  GM_CALL(gm, release_range, be->release_range(be->ctx, addr, bytes));
fail_pages:
  release_host_pages(gm, t->handle, bytes);
fail:
  free(t);
  return st;
}

/* Waits for every stream block b was handed to but its own. */
static gpumem_status_t sync_other_uses(gpumem_t* gm, gm_block* b) {
  const gpumem_backend_t* be = gm->backend;
  if (!be->stream_sync) return GPUMEM_OK;
  const gpumem_stream_t* uses = b->num_uses > GM_INLINE_USES ? b->extra_uses : b->inline_uses;
  for (uint16_t i = 0; i < b->num_uses; i++) {
    gpumem_status_t st = GM_CALL(gm, stream_sync, be->stream_sync(be->ctx, uses[i]));
    if (st != GPUMEM_OK) return st;
    gm->stats.num_syncs++;
  }
  return GPUMEM_OK;
}

static void tier_release(gpumem_t* gm, gm_tier_block* t, bool count) {
  const gpumem_backend_t* be = gm->backend;
  if (count) {
    tier_unlink(gm, t);
    tier_account(gm, t, t->on_host, -1);
  }
  if (t->on_host)
    release_host_pages(gm, t->handle, t->bytes);
  else
    release_pages(gm, t->handle, t->bytes, false);
  GM_CALL(gm, release_range, be->release_range(be->ctx, t->seg.addr, t->bytes));
}

/* Frees a retiring block's range now (its stream is done with it): the
 * address unmapped, pages and range back, the record gone. On a failed
 * unmap it stays retiring, to be tried again. */
static gpumem_status_t retire_now(gpumem_t* gm, gm_tier_block* t) {
  const gpumem_backend_t* be = gm->backend;
  gm_block* b = t->seg.first;
  gpumem_status_t st = GM_MAP_CALL(gm, unmap, be->unmap(be->ctx, t->seg.addr, t->bytes));
  if (st != GPUMEM_OK) return st;
  gm->stats.num_pages_unmapped++;
  /* unlinked from the retiring list */
  if (t->prev)
    t->prev->next = t->next;
  else
    gm->tier_retiring = t->next;
  if (t->next) t->next->prev = t->prev;
  if (t->retire_event_made) GM_CALL(gm, event_destroy, be->event_destroy(be->ctx, t->retire_event));
  /* Past the unmap the free has happened: a failed release leaves memory
   * with the device, not a half-freed block. */
  tier_account(gm, t, t->on_host, -1);
  tier_release(gm, t, false);
  gm_block_delete(gm, b);
  free(t);
  return GPUMEM_OK;
}

/* A freed tier block waits, retiring, for the work its stream had queued
 * when it was freed: a training step frees tensors while its kernels still
 * run, and the host must not wait for them at every free. An event
 * recorded on its stream says when the range may go; a later operation
 * that finds the event complete gives it back (gm_overflow_retire).
 * Other streams it was handed to (record_stream, rare for a tier block)
 * are waited for at the free. Without events, the free waits. */
gpumem_status_t gm_overflow_free(gpumem_t* gm, gm_block* b) {
  gm_tier_block* t = b->seg->tier;
  const gpumem_backend_t* be = gm->backend;
  gpumem_status_t st = sync_other_uses(gm, b);
  if (st != GPUMEM_OK) return st;
  bool has_events = be->event_create && be->event_record && be->event_query && be->event_sync;
  bool capturing = gm_capture_possible(gm) && gm_capture_underway(gm);
  if (has_events && !capturing) {
    st = GM_CALL(gm, event_create, be->event_create(be->ctx, &t->retire_event));
    if (st != GPUMEM_OK) return st;
    st = GM_CALL(gm, event_record,
                 be->event_record(be->ctx, t->retire_event, b->pool->stream->handle));
    if (st != GPUMEM_OK) {
      GM_CALL(gm, event_destroy, be->event_destroy(be->ctx, t->retire_event));
      return st;
    }
    t->retire_event_made = true;
  } else if (!capturing && be->stream_sync) {
    st = GM_CALL(gm, stream_sync, be->stream_sync(be->ctx, b->pool->stream->handle));
    if (st != GPUMEM_OK) return st;
    gm->stats.num_syncs++;
  }
  /* (during a capture: no event and no wait; retired once it ends) */
  tier_unlink(gm, t);
  /* No longer active: a retiring block holds no memory anyone could
   * reuse, only its own range, which goes back as a whole. */
  bool small = gm_block_stat_small(b);
  gm_stat_pool_shrink(gm->stats.active, small, 1);
  gm_stat_pool_shrink(gm->stats.active_bytes, small, (int64_t)b->size);
  t->prev = NULL;
  t->next = gm->tier_retiring;
  if (gm->tier_retiring) gm->tier_retiring->prev = t;
  gm->tier_retiring = t;
  b->state = GM_PENDING;
  if (!has_events && !capturing) retire_now(gm, t);
  return GPUMEM_OK;
}

void gm_overflow_retire(gpumem_t* gm, bool wait) {
  const gpumem_backend_t* be = gm->backend;
  if (gm_capture_possible(gm) && gm_capture_underway(gm)) return;
  char cause[512];
  snprintf(cause, sizeof cause, "%s", gpumem_last_error());
  gm_tier_block* next;
  for (gm_tier_block* t = gm->tier_retiring; t; t = next) {
    next = t->next;
    gpumem_status_t st = GPUMEM_OK;
    gpumem_stream_t stream = t->seg.first->pool->stream->handle;
    if (!t->retire_event_made) {
      /* freed during a capture: its stream is waited for now */
      if (be->stream_sync) st = GM_CALL(gm, stream_sync, be->stream_sync(be->ctx, stream));
    } else if (wait) {
      st = GM_CALL(gm, event_sync, be->event_sync(be->ctx, t->retire_event));
      if (st == GPUMEM_OK) gm->stats.num_syncs++;
    } else {
      st = GM_CALL(gm, event_query, be->event_query(be->ctx, t->retire_event));
    }
    if (st == GPUMEM_OK) retire_now(gm, t);
  }
  gpumem_set_last_error("%s", cause);
}

static void arena_host_destroy(gpumem_t* gm);

void gm_overflow_destroy(gpumem_t* gm) {
  const gpumem_backend_t* be = gm->backend;
  arena_host_destroy(gm);
  gm_overflow_retire(gm, true);
  /* What could not be retired (a device that failed) goes regardless. */
  while (gm->tier_retiring) {
    gm_tier_block* t = gm->tier_retiring;
    gm->tier_retiring = t->next;
    GM_CALL(gm, unmap, be->unmap(be->ctx, t->seg.addr, t->bytes));
    if (t->retire_event_made)
      GM_CALL(gm, event_destroy, be->event_destroy(be->ctx, t->retire_event));
    tier_account(gm, t, t->on_host, -1);
    tier_release(gm, t, false);
    gm_block_delete(gm, t->seg.first);
    free(t);
  }
  while (gm->tier) {
    gm_tier_block* t = gm->tier;
    GM_CALL(gm, unmap, be->unmap(be->ctx, t->seg.addr, t->bytes));
    tier_release(gm, t, true);
    gm_block_delete(gm, t->seg.first);
    free(t);
  }
  if (gm->tier_event_made) GM_CALL(gm, event_destroy, be->event_destroy(be->ctx, gm->tier_event));
  gm->tier_event_made = false;
  gm_overflow_release_kept(gm);
  free(gm->host_kept);
  gm->host_kept = NULL;
  gm->host_kept_capacity = 0;
}

/* ---- moves ---- */

/* A scratch range of a move that failed: unmapped and given back, the
 * failure's message kept. */
static void scratch_undo(gpumem_t* gm, uintptr_t scratch, size_t bytes) {
  const gpumem_backend_t* be = gm->backend;
  char cause[300];
  snprintf(cause, sizeof cause, "%s", gpumem_last_error());
  GM_MAP_CALL(gm, unmap, be->unmap(be->ctx, scratch, bytes));
  GM_CALL(gm, release_range, be->release_range(be->ctx, scratch, bytes));
  gpumem_set_last_error("%s", cause);
}

/* A scratch range of a move that succeeded: its pages are at the block's
 * address too now. (A range whose unmap fails stays reserved: giving it
 * back with pages mapped would be refused.) */
static void scratch_done(gpumem_t* gm, uintptr_t scratch, size_t bytes) {
  const gpumem_backend_t* be = gm->backend;
  if (GM_MAP_CALL(gm, unmap, be->unmap(be->ctx, scratch, bytes)) == GPUMEM_OK)
    GM_CALL(gm, release_range, be->release_range(be->ctx, scratch, bytes));
}

/* A move is done: the counters gpumem top and the Python side read. */
static void count_move(gpumem_t* gm, bool to_host, size_t bytes, uint64_t t0) {
  int64_t ns = (int64_t)(gm_now_ns() - t0);
  if (to_host) {
    gm->stats.num_moves_to_host++;
    gm->stats.bytes_moved_to_host += (int64_t)bytes;
    gm->stats.move_to_host_ns += ns;
  } else {
    gm->stats.num_moves_to_device++;
    gm->stats.bytes_moved_to_device += (int64_t)bytes;
    gm->stats.move_to_device_ns += ns;
  }
  price_host_traffic(gm, bytes);
}

/* Whether every stream of b is idle now, by an event recorded on each and
 * queried (never waited for). */
static bool streams_idle(gpumem_t* gm, gm_block* b) {
  const gpumem_backend_t* be = gm->backend;
  if (!be->event_create || !be->event_record || !be->event_query) return true;
  if (gm_capture_possible(gm) && gm_capture_underway(gm)) return false;
  if (!gm->tier_event_made) {
    if (GM_CALL(gm, event_create, be->event_create(be->ctx, &gm->tier_event)) != GPUMEM_OK)
      return false;
    gm->tier_event_made = true;
  }
  const gpumem_stream_t* uses = b->num_uses > GM_INLINE_USES ? b->extra_uses : b->inline_uses;
  for (int i = -1; i < (int)b->num_uses; i++) {
    gpumem_stream_t s = i < 0 ? b->pool->stream->handle : uses[i];
    if (GM_CALL(gm, event_record, be->event_record(be->ctx, gm->tier_event, s)) != GPUMEM_OK ||
        GM_CALL(gm, event_query, be->event_query(be->ctx, gm->tier_event)) != GPUMEM_OK)
      return false;
  }
  return true;
}

/* The bytes at [addr, addr + bytes) copied into physical pages `fresh`,
 * mapped at a scratch range for it (the copy needs both mapped), on
 * stream, and waited for. On success *scratch is the range, still
 * mapped; on failure nothing is left of it. */
static gpumem_status_t copy_to_scratch(gpumem_t* gm, gpumem_phys_t fresh, uintptr_t addr,
                                       size_t bytes, gpumem_stream_t stream, uintptr_t* scratch) {
  const gpumem_backend_t* be = gm->backend;
  *scratch = 0;
  gpumem_status_t st = GM_CALL(gm, reserve, be->reserve(be->ctx, bytes, scratch));
  if (st != GPUMEM_OK) return st;
  st = GM_MAP_CALL(gm, map, be->map(be->ctx, *scratch, bytes, fresh));
  if (st != GPUMEM_OK) {
    char cause[300];
    snprintf(cause, sizeof cause, "%s", gpumem_last_error());
    GM_CALL(gm, release_range, be->release_range(be->ctx, *scratch, bytes));
    gpumem_set_last_error("%s", cause);
    return st;
  }
  st = GM_CALL(gm, copy, be->copy(be->ctx, *scratch, addr, bytes, stream));
  if (st == GPUMEM_OK && be->stream_sync) {
    st = GM_CALL(gm, stream_sync, be->stream_sync(be->ctx, stream));
    if (st == GPUMEM_OK) gm->stats.num_syncs++;
  }
  if (st != GPUMEM_OK) scratch_undo(gm, *scratch, bytes);
  return st;
}

/* Moves t's bytes to new pages on the other side, at the same address.
 * The caller made sure no stream but the block's own may touch it. On
 * failure t is as it was: same pages, same bytes. */
static gpumem_status_t tier_move(gpumem_t* gm, gm_tier_block* t, bool to_host) {
  const gpumem_backend_t* be = gm->backend;
  gm_block* b = t->seg.first;
  gpumem_stream_t stream = b->pool->stream->handle;
  uintptr_t addr = t->seg.addr, scratch = 0;
  size_t bytes = t->bytes;
  gpumem_phys_t fresh = 0;
  uint64_t t0 = gm_now_ns();
  gpumem_status_t st =
      to_host ? create_host_pages(gm, bytes, &fresh) : create_device_pages(gm, bytes, &fresh);
  if (st != GPUMEM_OK) return st;
  st = copy_to_scratch(gm, fresh, addr, bytes, stream, &scratch);
  if (st != GPUMEM_OK) goto undo_pages;
  /* The swap: old pages off the address, new ones on. A physical
   * allocation may be mapped at two addresses at once, so the new pages
   * stay at scratch until they are at the address too. */
  st = GM_MAP_CALL(gm, unmap, be->unmap(be->ctx, addr, bytes));
  if (st != GPUMEM_OK) goto undo_scratch;
  st = GM_MAP_CALL(gm, map, be->map(be->ctx, addr, bytes, fresh));
  if (st != GPUMEM_OK) {
    /* Back as it was: the old pages, bytes intact, at the address. One
     * more try if the first refuses; the block's address must not stay
     * unmapped while it is live. */
    char cause[300];
    snprintf(cause, sizeof cause, "%s", gpumem_last_error());
    if (GM_MAP_CALL(gm, map, be->map(be->ctx, addr, bytes, t->handle)) != GPUMEM_OK)
      GM_MAP_CALL(gm, map, be->map(be->ctx, addr, bytes, t->handle));
    gpumem_set_last_error("%s", cause);
    goto undo_scratch;
  }
  gm->stats.num_pages_mapped++;
  gm->stats.num_pages_unmapped++;
  scratch_done(gm, scratch, bytes);
  /* The swap is done: the old pages go, whatever the device says. */
  tier_account(gm, t, t->on_host, -1);
  if (to_host)
    release_pages(gm, t->handle, bytes, false);
  else
    release_host_pages(gm, t->handle, bytes);
  t->handle = fresh;
  t->on_host = to_host;
  tier_account(gm, t, t->on_host, +1);
  t->last_touch = gm->num_mallocs;
  count_move(gm, to_host, bytes, t0);
  return GPUMEM_OK;

undo_scratch:
  scratch_undo(gm, scratch, bytes);
undo_pages:
  if (to_host)
    release_host_pages(gm, fresh, bytes);
  else
    release_pages(gm, fresh, bytes, true);
  return st;
}

/* ---- arena blocks' interior pages ----
 *
 * A block placed in an arena shares its first and last page with its
 * neighbours, but the whole pages strictly inside it are its alone (no
 * other block can touch them: gm_arena_busy's busy_inner), so those can
 * swap to host pages at the same addresses, and back, like a tier block's
 * range. Each such block has a record (gm_arena_host) of the pages and
 * the one host allocation under them; its page slots are host-backed
 * (pages.c), its edge pages stay on the device. What it knows of a
 * block's coldness beyond its serial, and the hint and pressure moves,
 * sit in a note beside it (gm_block_note): a block struct has no room
 * left, and only the few blocks the tier handles have one. */

typedef struct gm_arena_host {
  gm_block* block;
  size_t first, end;    /* pages of block->seg on host pages */
  gpumem_phys_t handle; /* the host allocation mapped under them */
  /* gm->num_mallocs + 1 when pressure moved it from within the hot window,
   * short of cold blocks (gm_overflow_make_room); 0 otherwise */
  uint64_t warm_moved_at;
} gm_arena_host;

typedef struct gm_block_note {
  gm_block* block;
  uint64_t serial;     /* the block's: a struct reused for another block is not it */
  uint64_t last_touch; /* gm->num_mallocs at its last record_stream or move */
  uint32_t pressure_moves;
  bool prefer_host;
} gm_block_note;

/* Allocations within which a block counts as hot (the current step's,
 * about to be used again), unless a plan knows the step's length (its
 * period, when longer). 1024: a training step of the jobs in traces/
 * makes a few hundred to a few thousand requests, and the tenants the
 * tier wants (optimizer state, master weights) were made at the first
 * step, so any window under a step would do for them; a shorter one would
 * let this step's activations (allocated a few hundred requests ago and
 * read again in the backward pass) look cold. (A build may set another,
 * -DGM_HOT_ALLOCS=N, to measure what the window buys.) */
#ifndef GM_HOT_ALLOCS
#define GM_HOT_ALLOCS 1024
#endif

/* Short of cold blocks, the blocks of the last GM_HOT_MIN_ALLOCS
 * allocations still never move (gm_overflow_make_room): the request's own
 * inputs, about to be read. */
#define GM_HOT_MIN_ALLOCS 32
/* Warm moves freed within a hot window of their move before warm blocks
 * stop moving: a few may be chance; a job whose warm blocks all die young
 * (bench: a decode's KV cache under 0.8 x its peak live moved 5,996 such
 * blocks, each freed within 1024 allocations) stops there. */
#define GM_WARM_WASTE_LIMIT 8

/* A block a warm move put on host pages is freed: was the copy for
 * nothing? warm_moved_at: the record's (0: not a warm move). */
static void note_warm_free(gpumem_t* gm, uint64_t warm_moved_at) {
  if (!warm_moved_at || gm->num_mallocs + 1 - warm_moved_at >= GM_HOT_ALLOCS) return;
  gm->tier_warm_wasted++;
  if (gm->tier_warm_wasted >= GM_WARM_WASTE_LIMIT && 2 * gm->tier_warm_wasted > gm->tier_warm_moves)
    gm->tier_warm_off = true;
}

static uint64_t hot_window(const gpumem_t* gm) {
  uint64_t w = GM_HOT_ALLOCS;
  if (gm->planner.state == GM_PLAN_ACTIVE && gm->planner.period > w) w = gm->planner.period;
  return w;
}

static bool note_valid(const gm_block_note* n) {
  return n->block->state == GM_ALLOCATED && n->block->serial == n->serial;
}

static gm_block_note* find_note(gpumem_t* gm, const gm_block* b) {
  for (size_t i = 0; i < gm->num_notes; i++) {
    gm_block_note* n = &gm->notes[i];
    if (n->block == b && n->serial == b->serial) return n;
  }
  return NULL;
}

/* b's note, made if it has none; NULL without host memory (the note is
 * a hint: the caller goes on without it). */
static gm_block_note* get_note(gpumem_t* gm, gm_block* b) {
  gm_block_note* n = find_note(gm, b);
  if (n) return n;
  if (gm->num_notes == gm->notes_capacity) {
    /* Notes of blocks freed since go first. */
    size_t k = 0;
    for (size_t i = 0; i < gm->num_notes; i++)
      if (note_valid(&gm->notes[i])) gm->notes[k++] = gm->notes[i];
    gm->num_notes = k;
  }
  if (gm->num_notes == gm->notes_capacity) {
    size_t cap = gm->notes_capacity ? 2 * gm->notes_capacity : 64;
    gm_block_note* grown = realloc(gm->notes, cap * sizeof *grown);
    if (!grown) return NULL;
    gm->notes = grown;
    gm->notes_capacity = cap;
  }
  n = &gm->notes[gm->num_notes++];
  memset(n, 0, sizeof *n);
  n->block = b;
  n->serial = b->serial;
  return n;
}

void gm_overflow_note_touch(gpumem_t* gm, gm_block* b) {
  gm_block_note* n = get_note(gm, b);
  if (n) n->last_touch = gm->num_mallocs;
}

static size_t find_arena_host(const gpumem_t* gm, const gm_block* b) {
  size_t k = 0;
  while (k < gm->num_arena_host && gm->arena_host[k].block != b) k++;
  return k;
}

/* The record's bytes appear (+1) or go (-1): the sums and statistics. */
static void arena_host_account(gpumem_t* gm, const gm_arena_host* r, int delta) {
  int64_t n = (int64_t)((r->end - r->first) * gm->page_size) * delta;
  gm->arena_host_bytes = (size_t)((int64_t)gm->arena_host_bytes + n);
  gm_stat_pool_add(gm, gm->stats.host_bytes, gm_block_stat_small(r->block), n);
}

static void arena_host_remove(gpumem_t* gm, size_t k) {
  arena_host_account(gm, &gm->arena_host[k], -1);
  gm->arena_host[k] = gm->arena_host[--gm->num_arena_host];
}

/* Whether live arena block b may have its interior moved at all, and
 * which pages: a block of a regular arena (plans and private pools keep
 * their pages where they are), on its arena's own stream (not lent or
 * handed), not sharing a page as an alias, not exported to another
 * process, and owning whole pages. */
static bool arena_block_movable(gpumem_t* gm, gm_block* b, size_t* first, size_t* end) {
  gm_segment* seg = b->seg;
  gm_pool* pool = b->pool;
  if (!seg->is_arena || seg->tier || pool->is_plan || pool->is_private || pool->source ||
      seg->plan_serving || seg->shared_streams)
    return false;
  if (b->state != GM_ALLOCATED || b->lent || b->handed || b->aliased) return false;
  if (GM_UNLIKELY(gm->num_ipc_exports) && gm_ipc_exported(gm, b->addr)) return false;
  return gm_arena_movable(gm, b, first, end);
}

/* Moves the pages [first, end) of live arena block b to host pages. The
 * caller made sure no stream but the block's own may touch it. On
 * failure b is as it was: same pages, same bytes. */
static gpumem_status_t arena_to_host(gpumem_t* gm, gm_block* b, size_t first, size_t end,
                                     bool warm) {
  gm_segment* seg = b->seg;
  size_t bytes = (end - first) * gm->page_size;
  uintptr_t addr = seg->addr + first * gm->page_size, scratch = 0;
  if (gm->num_arena_host == gm->arena_host_capacity) {
    size_t cap = gm->arena_host_capacity ? 2 * gm->arena_host_capacity : 16;
    gm_arena_host* grown = realloc(gm->arena_host, cap * sizeof *grown);
    if (!grown)
      return gm_fail(GPUMEM_ERR_HOST_MEMORY, "overflow tier: no host memory for a block's record");
    gm->arena_host = grown;
    gm->arena_host_capacity = cap;
  }
  uint64_t t0 = gm_now_ns();
  gpumem_phys_t fresh = 0;
  gpumem_status_t st = create_host_pages(gm, bytes, &fresh);
  if (st != GPUMEM_OK) return st;
  st = copy_to_scratch(gm, fresh, addr, bytes, gm_block_stream(b), &scratch);
  if (st != GPUMEM_OK) {
    release_host_pages(gm, fresh, bytes);
    return st;
  }
  st = gm_arena_swap_to_host(gm, seg, first, end, fresh);
  if (st != GPUMEM_OK) {
    scratch_undo(gm, scratch, bytes);
    release_host_pages(gm, fresh, bytes);
    return st;
  }
  scratch_done(gm, scratch, bytes);
  gm_arena_host* r = &gm->arena_host[gm->num_arena_host++];
  *r = (gm_arena_host){b, first, end, fresh, warm ? gm->num_mallocs + 1 : 0};
  arena_host_account(gm, r, +1);
  count_move(gm, true, bytes, t0);
  return GPUMEM_OK;
}

/* Moves record k's pages back to new device pages. On failure the block
 * is as it was, on host pages. */
static gpumem_status_t arena_to_device(gpumem_t* gm, size_t k) {
  gm_arena_host r = gm->arena_host[k];
  gm_segment* seg = r.block->seg;
  size_t bytes = (r.end - r.first) * gm->page_size;
  uintptr_t addr = seg->addr + r.first * gm->page_size, scratch = 0;
  uint64_t t0 = gm_now_ns();
  gpumem_phys_t fresh = 0;
  gpumem_status_t st = create_device_pages(gm, bytes, &fresh);
  if (st != GPUMEM_OK) return st;
  st = copy_to_scratch(gm, fresh, addr, bytes, gm_block_stream(r.block), &scratch);
  if (st != GPUMEM_OK) {
    release_pages(gm, fresh, bytes, true);
    return st;
  }
  st = gm_arena_swap_to_device(gm, seg, r.first, r.end, r.handle, fresh);
  if (st != GPUMEM_OK) {
    scratch_undo(gm, scratch, bytes);
    release_pages(gm, fresh, bytes, true);
    return st;
  }
  scratch_done(gm, scratch, bytes);
  /* The swap is done: the host pages go, whatever the host says (kept,
   * once no longer counted as held). */
  arena_host_remove(gm, k);
  release_host_pages(gm, r.handle, bytes);
  count_move(gm, false, bytes, t0);
  return GPUMEM_OK;
}

gpumem_status_t gm_overflow_arena_free(gpumem_t* gm, gm_block* b) {
  size_t k = find_arena_host(gm, b);
  if (k == gm->num_arena_host) return GPUMEM_OK;
  const gpumem_backend_t* be = gm->backend;
  gm_arena_host r = gm->arena_host[k];
  size_t bytes = (r.end - r.first) * gm->page_size;
  /* Kernels queued on its streams may still read the host pages: they are
   * waited for before the pages go (unmapping is not stream-ordered).
   * Such blocks are cold and few; a free of one waits, as a tier block's
   * free does without events. */
  if (gm_capture_possible(gm) && gm_capture_underway(gm))
    return gm_fail(GPUMEM_ERR_UNSUPPORTED,
                   "gpumem_free: 0x%lx has pages on host (overflow:host), which cannot be given "
                   "back while a CUDA graph is being captured (that needs a synchronization); "
                   "free it after the capture",
                   (unsigned long)b->addr);
  gpumem_status_t st = GPUMEM_OK;
  if (be->stream_sync) {
    st = GM_CALL(gm, stream_sync, be->stream_sync(be->ctx, gm_block_stream(b)));
    if (st != GPUMEM_OK) return st;
    gm->stats.num_syncs++;
  }
  st = sync_other_uses(gm, b);
  if (st != GPUMEM_OK) return st;
  st = GM_MAP_CALL(gm, unmap, be->unmap(be->ctx, b->seg->addr + r.first * gm->page_size, bytes));
  if (st != GPUMEM_OK) return st;
  gm->stats.num_pages_unmapped++;
  gm_arena_host_clear(b->seg, r.first, r.end);
  arena_host_remove(gm, k);
  release_host_pages(gm, r.handle, bytes);
  note_warm_free(gm, r.warm_moved_at); /* (once the free can no longer fail) */
  /* Every stream it was handed to is done with it: nothing to wait for. */
  b->num_uses = 0;
  return GPUMEM_OK;
}

/* Teardown (blocks still live at gpumem_destroy): the host pages under
 * arena blocks go, failures notwithstanding, before the arenas do. */
static void arena_host_destroy(gpumem_t* gm) {
  const gpumem_backend_t* be = gm->backend;
  while (gm->num_arena_host) {
    gm_arena_host r = gm->arena_host[gm->num_arena_host - 1];
    size_t bytes = (r.end - r.first) * gm->page_size;
    GM_MAP_CALL(gm, unmap, be->unmap(be->ctx, r.block->seg->addr + r.first * gm->page_size, bytes));
    gm_arena_host_clear(r.block->seg, r.first, r.end);
    arena_host_remove(gm, gm->num_arena_host - 1);
    release_pages(gm, r.handle, bytes, false);
  }
  free(gm->arena_host);
  gm->arena_host = NULL;
  gm->arena_host_capacity = 0;
  free(gm->notes);
  gm->notes = NULL;
  gm->num_notes = gm->notes_capacity = 0;
}

/* gpumem_check's part for arena blocks' host pages: each record's block
 * live, in a regular arena, the pages strictly inside it and host-backed
 * there (not mapped, no page record, no ghost); no block twice; the
 * bytes summed into s->host and against arena_host_bytes. */
static void check_arena_host(gpumem_t* gm, gm_tier_sums* s, size_t* errors, char* msg, size_t len) {
#define ARENA_FAIL(...)                                \
  do {                                                 \
    if (!(*errors)++) snprintf(msg, len, __VA_ARGS__); \
  } while (0)
  size_t ps = gm->page_size, bytes = 0;
  for (size_t k = 0; k < gm->num_arena_host; k++) {
    const gm_arena_host* r = &gm->arena_host[k];
    gm_block* b = r->block;
    gm_segment* seg = b->seg;
    if (b->state != GM_ALLOCATED || gm_ptr_map_find(&gm->ptrs, b->addr) != b || !seg->is_arena ||
        seg->tier || !seg->host_bits) {
      ARENA_FAIL("overflow tier: host pages under 0x%lx, not a live arena block",
                 (unsigned long)b->addr);
      continue;
    }
    if (r->first >= r->end || r->first * ps < b->addr - seg->addr ||
        r->end * ps > b->addr + b->size - seg->addr || !r->handle)
      ARENA_FAIL("overflow tier: host pages %zu..%zu of arena 0x%lx lie outside block 0x%lx",
                 r->first, r->end, (unsigned long)seg->addr, (unsigned long)b->addr);
    for (size_t p = r->first; p < r->end && p < seg->num_pages; p++) {
      if (!gm_arena_page_host(seg, p) || gm_arena_page_mapped(seg, p) || seg->live_id[p] ||
          seg->ghost_id[p]) {
        ARENA_FAIL("overflow tier: arena 0x%lx page %zu of block 0x%lx is not host-backed alone",
                   (unsigned long)seg->addr, p, (unsigned long)b->addr);
        break;
      }
    }
    for (size_t j = k + 1; j < gm->num_arena_host; j++)
      if (gm->arena_host[j].block == b)
        ARENA_FAIL("overflow tier: block 0x%lx has two host records", (unsigned long)b->addr);
    size_t n = (r->end - r->first) * ps;
    bytes += n;
    bool small = gm_block_stat_small(b);
    s->host[GPUMEM_POOL_ALL] += (int64_t)n;
    s->host[small ? GPUMEM_POOL_SMALL : GPUMEM_POOL_LARGE] += (int64_t)n;
  }
  if (bytes != gm->arena_host_bytes)
    ARENA_FAIL("overflow tier: arena blocks hold %zu host bytes, counted %zu", bytes,
               gm->arena_host_bytes);
  /* every host-backed slot is one of a record's (check.c counts the
   * arenas' slots against the same sum) */
  size_t slots = 0;
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) slots += seg->host_pages;
  if (slots * ps != bytes)
    ARENA_FAIL("overflow tier: %zu host-backed page slots in the arenas, records hold %zu bytes",
               slots, bytes);
#undef ARENA_FAIL
}

/* ---- pressure: the coldest blocks out first ---- */

/* A block that may go to host under pressure: a tier block on device
 * pages, or an arena block with pages of its own. */
typedef struct cold_candidate {
  gm_tier_block* tier; /* NULL: an arena block */
  gm_block* block;
  size_t first, end;
  bool prefer_host;
  uint64_t last_use; /* in allocations */
} cold_candidate;

static int colder_first(const void* x, const void* y) {
  const cold_candidate *a = x, *b = y;
  if (a->prefer_host != b->prefer_host) return a->prefer_host ? -1 : 1;
  if (a->last_use != b->last_use) return a->last_use < b->last_use ? -1 : 1;
  return a->block->addr < b->block->addr ? -1 : a->block->addr > b->block->addr;
}

static int note_by_block(const void* x, const void* y) {
  const gm_block_note *a = x, *b = y;
  if (a->block != b->block) return (uintptr_t)a->block < (uintptr_t)b->block ? -1 : 1;
  return a->serial < b->serial ? -1 : a->serial > b->serial;
}

/* find_note for every live block of the arenas at once: the notes sorted
 * by block (their order means nothing elsewhere), each found by a binary
 * search rather than a walk. */
static gm_block_note* find_note_sorted(gpumem_t* gm, const gm_block* b) {
  gm_block_note key = {(gm_block*)b, b->serial, 0, 0, false};
  return bsearch(&key, gm->notes, gm->num_notes, sizeof key, note_by_block);
}

/* The bytes moving all n candidates would free. */
static size_t candidates_bytes(const gpumem_t* gm, const cold_candidate* c, size_t n) {
  size_t bytes = 0;
  for (size_t i = 0; i < n; i++)
    bytes += c[i].tier ? c[i].tier->bytes : (c[i].end - c[i].first) * gm->page_size;
  return bytes;
}

/* Every candidate, coldest first, in *out (to be freed); their number. */
static size_t cold_candidates(gpumem_t* gm, uint64_t window, cold_candidate** out) {
  size_t n = 0, cap = 0;
  cold_candidate* c = NULL;
  if (gm->num_notes > 1) qsort(gm->notes, gm->num_notes, sizeof *gm->notes, note_by_block);
#define CANDIDATE_ROOM()                                           \
  if (n == cap) {                                                  \
    size_t grown_cap = cap ? 2 * cap : 64;                         \
    cold_candidate* grown = realloc(c, grown_cap * sizeof *grown); \
    if (!grown) goto done;                                         \
    c = grown;                                                     \
    cap = grown_cap;                                               \
  }
  for (gm_tier_block* t = gm->tier; t; t = t->next) {
    if (t->on_host) continue;
    CANDIDATE_ROOM();
    c[n++] = (cold_candidate){t, t->seg.first, 0, 0, t->prefer_host, t->last_touch};
  }
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (!seg->is_arena || seg->pool->is_plan || seg->pool->is_private) continue;
    for (gm_block* b = seg->first; b; b = b->next) {
      /* (cheap tests first: most blocks are small or recent) */
      if (b->state != GM_ALLOCATED || b->size < gm->page_size) continue;
      gm_block_note* note = gm->num_notes ? find_note_sorted(gm, b) : NULL;
      bool prefer = note && note->prefer_host;
      uint64_t last = note && note->last_touch > b->serial ? note->last_touch : b->serial;
      if (!prefer && gm->num_mallocs - last < window) continue;
      if (gm->num_arena_host && find_arena_host(gm, b) < gm->num_arena_host) continue;
      size_t first, end;
      if (!arena_block_movable(gm, b, &first, &end)) continue;
      CANDIDATE_ROOM();
      c[n++] = (cold_candidate){NULL, b, first, end, prefer, last};
    }
  }
#undef CANDIDATE_ROOM
done:
  if (n) qsort(c, n, sizeof *c, colder_first);
  *out = c;
  return n;
}

gpumem_status_t gm_overflow_make_room(gpumem_t* gm, size_t rsize, bool* retry) {
  *retry = false;
  if (gm->tier_retiring) {
    /* device pages of freed tier blocks: room once their stream is done */
    size_t before = gm->tier_device_bytes;
    gm_overflow_retire(gm, true);
    *retry = gm->tier_device_bytes < before;
  }
  if (!tier_has_host_pages(gm)) return GPUMEM_OK;
  if (gm_capture_possible(gm) && gm_capture_underway(gm)) return GPUMEM_OK;
  cold_candidate* c = NULL;
  size_t n = cold_candidates(gm, hot_window(gm), &c);
  /* The room there is already: spare pages, whole free pages still mapped
   * (a failed try leaves the pages it mapped), and what the limit leaves. */
  size_t ps = gm->page_size;
  size_t room = gm->num_spare_pages * ps + (size_t)gm_reclaimable_bytes(gm);
  uint64_t reserved = (uint64_t)gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current;
  if (gm->limit && reserved < gm->limit) room += (size_t)(gm->limit - reserved);
  size_t movable = candidates_bytes(gm, c, n);
  /* Short of cold blocks: the warm ones too, all but the last
   * GM_HOT_MIN_ALLOCS allocations' (the request's own inputs), still
   * coldest first, so that only the shortfall comes from them. Without
   * this the whole request went to host pages: the fine-tune of
   * bench/torch/overflow_job.py under peak / 1.10 had 1.14 GiB of cold
   * blocks for 1.24 GiB over the cap, and its second 1000 MiB logits block
   * went to host whole (1.85 GiB on host, kernels reading the logits over
   * the link); the optimizer state made at the first step, within the
   * window, covers the rest (1.27 GiB on host, no request there). A job
   * whose warm blocks die soon after (a decode's KV cache, made again a
   * token longer) would copy each for nothing and wait for its stream at
   * its free: after GM_WARM_WASTE_LIMIT such, more than half of all warm
   * moves, warm blocks stay where they are (note_warm_free). */
  bool widened = room + movable < rsize && !gm->tier_warm_off;
  if (widened) {
    free(c);
    c = NULL;
    n = cold_candidates(gm, GM_HOT_MIN_ALLOCS, &c);
    movable = candidates_bytes(gm, c, n);
  }
  uint64_t window = hot_window(gm);
  /* Where all of them would not make room, none moves: the request goes
   * to host pages either way, and moving them would cost copies for
   * nothing (gpt2_train under 0.9 x its peak live: 127 moves a pass, and
   * its 8 requests on host pages all the same). */
  if (room + movable < rsize) n = 0;
  /* Enough for the request's pages and the two edge pages it may start
   * and end in. */
  size_t want = rsize + 2 * ps, freed = 0;
  char cause[512];
  snprintf(cause, sizeof cause, "%s", gpumem_last_error());
  for (size_t i = 0; i < n && room + freed < want; i++) {
    gm_block* b = c[i].block;
    /* (the retry ladder's end: waiting for the block's other streams is
     * what PyTorch's synchronization there does too) */
    gpumem_status_t st = sync_other_uses(gm, b);
    if (c[i].tier) {
      if (st == GPUMEM_OK) st = tier_move(gm, c[i].tier, true);
      if (st != GPUMEM_OK) break; /* the new block goes to host instead */
      c[i].tier->pressure_moves++;
      freed += c[i].tier->bytes;
      continue;
    }
    bool warm = widened && !c[i].prefer_host && gm->num_mallocs - c[i].last_use < window;
    gm_block_note* note = get_note(gm, b);
    if (st == GPUMEM_OK && !note)
      st = gm_fail(GPUMEM_ERR_HOST_MEMORY, "overflow tier: no host memory for a block's note");
    if (st == GPUMEM_OK) st = arena_to_host(gm, b, c[i].first, c[i].end, warm);
    if (st != GPUMEM_OK) break;
    gm->tier_warm_moves += warm;
    note->pressure_moves++;
    note->last_touch = gm->num_mallocs;
    freed += (c[i].end - c[i].first) * gm->page_size;
  }
  free(c);
  gpumem_set_last_error("%s", cause); /* the report names the first cause */
  *retry = *retry || freed > 0;
  return GPUMEM_OK;
}

void gm_overflow_bring_back(gpumem_t* gm, bool after_empty_cache) {
  if (gm_capture_possible(gm) && gm_capture_underway(gm)) return;
  char cause[512];
  snprintf(cause, sizeof cause, "%s", gpumem_last_error());
  bool any_room = false, refused = false;
  /* Hottest first: the list is newest first, and a block's place follows
   * its making, not its touches; good enough for the few tier blocks a
   * job holds. */
  for (gm_tier_block* t = gm->tier; t; t = t->next) {
    if (!t->on_host || t->prefer_host) continue;
    if (!after_empty_cache && t->pressure_moves >= GM_TIER_BOUNCES) continue;
    uint64_t reserved = (uint64_t)gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current;
    if (gm->limit && reserved + t->bytes > gm->limit) continue;
    if (gm->budget && !gm_budget_has_room(gm, t->bytes)) continue;
    any_room = true;
    /* At empty_cache the caller gives the allocator leave to wait, as
     * PyTorch's empty_cache waits for pending frees: the block's other
     * streams are waited for (its own stream orders the copy). At a free
     * nothing waits: every stream must be idle already. */
    if (after_empty_cache ? sync_other_uses(gm, t->seg.first) != GPUMEM_OK
                          : !streams_idle(gm, t->seg.first))
      continue;
    gpumem_status_t st = tier_move(gm, t, false);
    if (st == GPUMEM_ERR_OUT_OF_MEMORY) {
      refused = true;
      break;
    }
    if (after_empty_cache) t->pressure_moves = 0;
  }
  /* Then arena blocks' pages, by the same rules (the hint, the bounces,
   * the room, the streams). From the last record down: a move back takes
   * its record out by moving the last one into its place. */
  for (size_t k = gm->num_arena_host; k-- > 0 && !refused;) {
    gm_block* b = gm->arena_host[k].block;
    gm_block_note* note = find_note(gm, b);
    if (note && note->prefer_host) continue;
    if (!after_empty_cache && note && note->pressure_moves >= GM_TIER_BOUNCES) continue;
    size_t bytes = (gm->arena_host[k].end - gm->arena_host[k].first) * gm->page_size;
    uint64_t reserved = (uint64_t)gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current;
    if (gm->limit && reserved + bytes > gm->limit) continue;
    if (gm->budget && !gm_budget_has_room(gm, bytes)) continue;
    any_room = true;
    if (after_empty_cache ? sync_other_uses(gm, b) != GPUMEM_OK : !streams_idle(gm, b)) continue;
    gpumem_status_t st = arena_to_device(gm, k);
    if (st == GPUMEM_ERR_OUT_OF_MEMORY) refused = true;
    if (st == GPUMEM_OK && after_empty_cache && note) note->pressure_moves = 0;
  }
  if (refused) any_room = false;
  /* Nothing fitted: no free tries again until reserved memory is lower. */
  gm->tier_retry_below =
      any_room ? UINT64_MAX : (uint64_t)gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current;
  gpumem_set_last_error("%s", cause);
}

/* ---- the hint ---- */

gpumem_status_t gpumem_prefer_host(gpumem_t* gm, void* ptr) {
  if (!gm || !ptr)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_prefer_host: NULL allocator or pointer");
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  gm_block* b = gm_ptr_map_find(&gm->ptrs, (uintptr_t)ptr);
  if (gm->opts.overflow != GPUMEM_OVERFLOW_HOST) {
    st = gm_fail(GPUMEM_ERR_UNSUPPORTED,
                 "gpumem_prefer_host: the overflow tier is off (GPUMEM_CONF=overflow:host)");
  } else if (!b) {
    st = gm_fail(GPUMEM_ERR_INVALID_POINTER, "gpumem_prefer_host: 0x%lx is not a live allocation",
                 (unsigned long)(uintptr_t)ptr);
  } else if (!gm_block_in_tier(b)) {
    size_t first = 0, end = 0;
    gm_block_note* note = NULL;
    bool on_host = find_arena_host(gm, b) < gm->num_arena_host;
    if (!on_host && !arena_block_movable(gm, b, &first, &end)) {
      st = gm_fail(GPUMEM_ERR_UNSUPPORTED,
                   "gpumem_prefer_host: 0x%lx lies in an arena it shares with other blocks and "
                   "owns no whole page there (or its pages may not move: a plan's or a private "
                   "pool's arena, another stream's, exported); only pages no other block touches "
                   "can move",
                   (unsigned long)(uintptr_t)ptr);
    } else if (!(note = get_note(gm, b))) {
      st = gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_prefer_host: no host memory for a note");
    } else {
      note->prefer_host = true;
      /* Now if nothing waits; else at the next pressure, first of all. */
      if (!on_host && streams_idle(gm, b)) st = arena_to_host(gm, b, first, end, false);
    }
  } else {
    gm_tier_block* t = b->seg->tier;
    t->prefer_host = true;
    /* Now if nothing waits; else at the next pressure, first of all. */
    if (!t->on_host && streams_idle(gm, b)) st = tier_move(gm, t, true);
  }
  gm_lock_release(&gm->lock);
  return st;
}

/* ---- checks and reports ---- */

/* One tier record's part of gpumem_check: its block against its range,
 * its bytes into the sums. */
static void check_tier_block(gpumem_t* gm, gm_tier_block* t, bool retiring, gm_tier_sums* s,
                             size_t* host, size_t* device, size_t* errors, char* msg, size_t len) {
#define TIER_FAIL(...)                                 \
  do {                                                 \
    if (!(*errors)++) snprintf(msg, len, __VA_ARGS__); \
  } while (0)
  gm_block* b = t->seg.first;
  if (t->next && t->next->prev != t) TIER_FAIL("overflow tier: list broken");
  if (!b || b->seg != &t->seg || t->seg.tier != t) {
    TIER_FAIL("overflow tier: a block and its range do not point at each other");
    return;
  }
  if (retiring) {
    if (b->state != GM_PENDING || gm_ptr_map_find(&gm->ptrs, b->addr) == b)
      TIER_FAIL("overflow tier: retiring block 0x%lx is not pending, or still in the pointer map",
                (unsigned long)b->addr);
  } else if (b->state != GM_ALLOCATED || gm_ptr_map_find(&gm->ptrs, b->addr) != b) {
    TIER_FAIL("overflow tier: block 0x%lx is not allocated and in the pointer map",
              (unsigned long)b->addr);
  }
  if (b->addr != t->seg.addr || b->size > t->bytes || t->bytes != t->seg.size ||
      t->bytes % gm->page_size || b->prev || b->next)
    TIER_FAIL("overflow tier: block 0x%lx (%zu bytes) does not fill its range of %zu",
              (unsigned long)b->addr, b->size, t->bytes);
  if (!t->handle) TIER_FAIL("overflow tier: block 0x%lx has no pages", (unsigned long)b->addr);
  bool small = gm_block_stat_small(b);
  for (int p = 0; p < 2; p++) {
    int pool = p == 0 ? GPUMEM_POOL_ALL : small ? GPUMEM_POOL_SMALL : GPUMEM_POOL_LARGE;
    if (retiring) {
      s->pending[pool]++;
      s->pending_bytes[pool] += (int64_t)b->size;
    } else {
      s->blocks[pool]++;
      s->bytes[pool] += (int64_t)b->size;
      s->requested[pool] += (int64_t)b->requested;
    }
    if (t->on_host)
      s->host[pool] += (int64_t)t->bytes;
    else
      s->device[pool] += (int64_t)t->bytes;
  }
  if (t->on_host)
    *host += t->bytes;
  else
    *device += t->bytes;
#undef TIER_FAIL
}

size_t gm_overflow_check(gpumem_t* gm, gm_tier_sums* s, char* msg, size_t len) {
  size_t errors = 0;
  size_t host = 0, device = 0, count = 0, on_host = 0;
  for (gm_tier_block* t = gm->tier; t; t = t->next) {
    count++;
    on_host += t->on_host;
    check_tier_block(gm, t, false, s, &host, &device, &errors, msg, len);
  }
  size_t retiring_host = 0;
  for (gm_tier_block* t = gm->tier_retiring; t; t = t->next) {
    retiring_host += t->on_host;
    check_tier_block(gm, t, true, s, &host, &device, &errors, msg, len);
  }
  check_arena_host(gm, s, &errors, msg, len);
  if (count != gm->tier_count || on_host + retiring_host != gm->tier_on_host ||
      host != gm->tier_host_bytes || device != gm->tier_device_bytes) {
    if (!errors++)
      snprintf(msg, len,
               "overflow tier: %zu blocks (%zu on host), %zu host and %zu device bytes; counted "
               "%zu (%zu), %zu and %zu",
               count, on_host + retiring_host, host, device, gm->tier_count, gm->tier_on_host,
               gm->tier_host_bytes, gm->tier_device_bytes);
  }
  if (gm->opts.overflow_host_bytes && host + gm->arena_host_bytes > gm->opts.overflow_host_bytes) {
    if (!errors++)
      snprintf(msg, len, "overflow tier: %zu host bytes pass the budget of %zu",
               host + gm->arena_host_bytes, gm->opts.overflow_host_bytes);
  }
  size_t kept = 0;
  for (size_t k = 0; k < gm->num_host_kept; k++) {
    if (!gm->host_kept[k].handle || !gm->host_kept[k].bytes ||
        gm->host_kept[k].bytes % gm->page_size)
      if (!errors++)
        snprintf(msg, len, "overflow tier: kept host allocation %zu is not whole pages", k);
    kept += gm->host_kept[k].bytes;
  }
  s->kept[GPUMEM_POOL_ALL] = s->kept[GPUMEM_POOL_LARGE] = (int64_t)kept;
  if (kept != gm->host_kept_bytes || gm->num_host_kept > gm->host_kept_capacity) {
    if (!errors++)
      snprintf(msg, len, "overflow tier: %zu host bytes kept, counted %zu", kept,
               gm->host_kept_bytes);
  }
  /* the bound the kept pages keep (overflow.c, "kept host pages") */
  if (host + gm->arena_host_bytes + kept > gm->host_high && kept) {
    if (!errors++)
      snprintf(msg, len, "overflow tier: %zu host bytes held and %zu kept pass the most held, %zu",
               host + gm->arena_host_bytes, kept, gm->host_high);
  }
  if ((count || gm->tier_retiring || gm->num_arena_host || gm->num_host_kept) &&
      gm->opts.overflow != GPUMEM_OVERFLOW_HOST) {
    if (!errors++) snprintf(msg, len, "overflow tier: %zu blocks with the tier off", count);
  }
  return errors;
}

void gm_overflow_describe(gpumem_t* gm, char* out, size_t cap) {
  out[0] = '\0';
  if (gm->opts.overflow != GPUMEM_OVERFLOW_HOST) return;
  char host[32], kept[64] = "", dev[32], budget[32];
  if (gm->host_kept_bytes) {
    char b[32];
    snprintf(kept, sizeof kept, " and %s kept for reuse",
             gm_format_bytes(gm->host_kept_bytes, b, sizeof b));
  }
  snprintf(out, cap,
           " Overflow tier: %s on host pages%s (budget %s), %s of tier blocks back on device "
           "pages; %lld moves to host, %lld back.",
           gm_format_bytes(host_held(gm), host, sizeof host), kept,
           gm->opts.overflow_host_bytes
               ? gm_format_bytes(gm->opts.overflow_host_bytes, budget, sizeof budget)
               : "none",
           gm_format_bytes(gm->tier_device_bytes, dev, sizeof dev),
           (long long)gm->stats.num_moves_to_host, (long long)gm->stats.num_moves_to_device);
}
