/* Fences: whole free pages given back when an arena must grow, without the
 * host ever waiting for the device.
 *
 * Under the default policy with no limit, arenas grow in large mappings
 * and nothing moves for headroom unless the move budget pays for it,
 * because unmapping memory that queued work may still use needs that
 * work done: a synchronization of the stream, which on a host-bound job
 * costs more than the memory saved. So a job whose early phase freed
 * large mappings (weights converted, a long prompt served) grew its arena
 * past them later, and its reserved memory was the address space it
 * walked.
 *
 * A fence tells the allocator, without waiting, when the device is done
 * with pages. At a growth past the allocated high-water mark plus
 * headroom, each stream whose arenas hold whole free mapped pages gets
 * an event recorded behind them (its fence), and those pages are marked
 * (fence_pend). A page that a block is placed over since loses its mark
 * (gm_arena_busy). At a later such growth the fence is queried: once
 * complete, every use of the marked pages came before it and is over, so
 * their marks become fence_safe, and a mapping all of whose pages are
 * safe is unmapped with no synchronization: a single page becomes spare
 * (a ghost with nothing to wait for), a longer mapping goes back to the
 * device; the growth then creates only what they did not cover. A fence
 * not yet complete is simply asked again at the next growth: the arena
 * grows meanwhile as it did before.
 *
 * Costs: an event record per stream per fence and a query per growth past
 * the mark (about a microsecond each on a GPU, beside the tens a mapping
 * costs), a walk of the stream's free blocks when a fence is recorded,
 * and on the hot path one test per placed block while an arena has marks.
 * The unmaps are mapping work, priced as such by the replay. */
#include <stdlib.h>

#include "engine.h"

static bool fences_usable(gpumem_t* gm) {
  const gpumem_backend_t* be = gm->backend;
  if (!be->event_create || !be->event_record || !be->event_query) return false;
  /* (events recorded during a capture would become graph nodes) */
  return !(GM_UNLIKELY(gm_capture_possible(gm)) && gm_capture_underway(gm));
}

bool gm_fence_done(const gm_segment* seg, size_t first, size_t n) {
  if (!seg->fence_safe) return false;
  for (size_t p = first; p < first + n; p++) {
    if (!((seg->fence_safe[p / 64] >> (p % 64)) & 1u)) return false;
  }
  return true;
}

static bool fence_tables(gm_segment* seg) {
  if (seg->fence_pend) return true;
  size_t words = (seg->num_pages + 63) / 64;
  uint64_t* pend = calloc(words, sizeof *pend);
  uint64_t* safe = calloc(words, sizeof *safe);
  if (!pend || !safe) {
    free(pend);
    free(safe);
    return false;
  }
  seg->fence_pend = pend;
  seg->fence_safe = safe;
  return true;
}

/* The stream's fence completed: what it covered is safe now. */
static void fence_completed(gpumem_t* gm, gm_stream* s) {
  s->fence_recorded = false;
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (!seg->is_arena || !seg->fence_pend || seg->pool->stream != s) continue;
    size_t words = (seg->mapped_end + 63) / 64;
    for (size_t w = 0; w < words; w++) {
      seg->fence_safe[w] |= seg->fence_pend[w];
      seg->fence_pend[w] = 0;
    }
  }
}

/* Marks the whole free mapped pages of s's regular arenas not already
 * safe; how many. */
static size_t mark_free_pages(gpumem_t* gm, gm_stream* s) {
  size_t marked = 0;
  for (int i = GM_POOL_SMALL; i <= GM_POOL_LARGE; i++) {
    gm_block* b;
    GM_DIRTY_FOREACH(&s->pools[i], b) {
      gm_segment* seg = b->seg;
      size_t first, end;
      if (seg->plan_serving || !gm_interior_pages(gm, b, &first, &end)) continue;
      if (!fence_tables(seg)) return marked; /* (no host memory: fewer marks) */
      for (size_t p = first; p < end; p++) {
        uint64_t bit = 1ull << (p % 64);
        if (!gm_arena_page_mapped(seg, p) || (seg->fence_safe[p / 64] & bit)) continue;
        seg->fence_pend[p / 64] |= bit;
        marked++;
      }
    }
  }
  return marked;
}

/* Queries recorded fences; records new ones behind the free pages of
 * streams whose fence is not pending. */
static gpumem_status_t fences_advance(gpumem_t* gm) {
  for (gm_stream* s = gm->streams; s; s = s->next) {
    if (s->fence_recorded) {
      gpumem_status_t q =
          GM_CALL(gm, event_query, gm->backend->event_query(gm->backend->ctx, s->fence_event));
      if (q == GPUMEM_NOT_READY) continue;
      if (q != GPUMEM_OK) return q;
      fence_completed(gm, s);
    }
    if (!mark_free_pages(gm, s)) continue;
    /* (the fence covers what a borrower freed in s's arenas once s waits for it) */
    gpumem_status_t ready = gm_lender_ready(gm, s);
    if (ready != GPUMEM_OK) return ready;
    if (!s->fence_made) {
      gpumem_status_t st =
          GM_CALL(gm, event_create, gm->backend->event_create(gm->backend->ctx, &s->fence_event));
      if (st != GPUMEM_OK) return st;
      s->fence_made = true;
    }
    gpumem_status_t st = GM_CALL(
        gm, event_record, gm->backend->event_record(gm->backend->ctx, s->fence_event, s->handle));
    if (st != GPUMEM_OK) return st;
    s->fence_recorded = true;
  }
  return GPUMEM_OK;
}

gpumem_status_t gm_fence_reuse(gpumem_t* gm, size_t want) {
  if (!fences_usable(gm) || !gm_fence_budget_left(gm)) return GPUMEM_OK;
  /* Completed fences first, so that what they cover is taken now; then
   * the pages still free are marked for a later growth. */
  gpumem_status_t st = fences_advance(gm);
  if (st != GPUMEM_OK) return st;
  size_t got = 0;
  st = gm_reclaim_priced(gm, GM_RECLAIM_FENCED, want, &gm->fence_spent_us, &got);
  gm->stats.num_pages_fenced += (int64_t)got;
  return st;
}

void gm_fence_stream_destroy(gpumem_t* gm, gm_stream* s) {
  if (!s->fence_made) return;
  GM_CALL(gm, event_destroy, gm->backend->event_destroy(gm->backend->ctx, s->fence_event));
  s->fence_made = s->fence_recorded = false;
}
