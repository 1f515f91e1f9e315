/* Planned placement (placement:planned, default policy): training loops
 * repeat one step's allocations exactly, and an offline placement of one
 * step with its lifetimes known packs it into ~1.0003 x its peak live bytes
 * where online best fit walks 1.004-1.15 x (bench/plan). So:
 *
 * 1. Detection, O(1) per request: a ring of recent requests (rounded size,
 *    stream) and a table from the hash of (request, 8 previous requests) to
 *    the latest request index with that context give a candidate period P;
 *    it is confirmed once P consecutive requests equal the request P back.
 * 2. Recording: the ring also holds when each request was freed, so the
 *    first of the two matching periods is a complete record: requests
 *    freed within P requests of their allocation are planned, the others
 *    (weights, optimizer state) stay with best fit.
 * 3. Planning, once, at the confirming request (a few ms): greedy by size,
 *    each at the lowest offset free during its lifetime (circular, modulo
 *    P), one plan arena per stream for small and large requests alike; or,
 *    where the streams peak apart, one arena for all of them, memory
 *    passing between streams ordered on the device (streams.c).
 * 4. Serving: a cursor walks the plan; a request equal to the item under
 *    the cursor gets the block at its planned offset when that range is
 *    free (found through the item planned just below it, or a walk), else
 *    best fit. Off the plan, the context hash resynchronises the cursor;
 *    with more than ~1% misses in a period the plan goes dormant (its arena
 *    drains; its free pages are reclaimable) and comes back after 16
 *    requests follow it again. A longer period confirmed meanwhile replaces
 *    it (a loop inside a step can be confirmed first: replacing it by the
 *    longer period is how the step is found).
 *
 * Plan arenas are ordinary arenas (pages mapped on demand, reclaim, stats,
 * gpumem_check) in the stream's plan pool, whose index best fit never
 * searches. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

#define SHADOW_RUN 16 /* requests on the plan before a dormant plan serves again */

static inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

static inline uint64_t req_key(size_t rsize, gpumem_stream_t stream) {
  return mix64((uint64_t)rsize * 0x9e3779b97f4a7c15ull ^ (uint64_t)stream);
}

static inline gm_plan_req* req_at(gm_planner* p, uint64_t i) {
  return &p->ring[i % GM_PLAN_RING];
}

/* Hash of request i and the 8 before it (i >= 8): sum of key(i - k) * M^k,
 * kept rolling in the ring as requests are recorded (two multiplies per
 * request instead of nine), then one final mix. The keys are already
 * mixed, so the powers of one odd multiplier keep the order. */
#define CTX_MULT 0x9e3779b97f4a7c15ull
#define CTX_MULT_POW9 \
  (CTX_MULT * CTX_MULT * CTX_MULT * CTX_MULT * CTX_MULT * CTX_MULT * CTX_MULT * CTX_MULT * CTX_MULT)

static inline uint64_t context_hash(gm_planner* p, uint64_t i) {
  return mix64(req_at(p, i)->ctx);
}

/* The rolling sum at request i, its key just recorded. */
static inline void context_roll(gm_planner* p, uint64_t i) {
  gm_plan_req* r = req_at(p, i);
  r->ctx = r->key + CTX_MULT * req_at(p, i - 1)->ctx - CTX_MULT_POW9 * req_at(p, i - 9)->key;
}

gpumem_status_t gm_plan_init(gpumem_t* gm) {
  gm_planner* p = &gm->planner;
  p->ring = calloc(GM_PLAN_RING, sizeof *p->ring);
  p->table = calloc(GM_PLAN_TABLE, sizeof *p->table);
  if (!p->ring || !p->table) {
    gm_plan_destroy(gm);
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_create: out of host memory for the planner");
  }
  p->min_period = GM_PLAN_MIN_PERIOD;
  p->enabled = true;
  return GPUMEM_OK;
}

static void set_state(gpumem_t* gm, int state) {
  gm_planner* p = &gm->planner;
  p->state = state;
  for (size_t a = 0; a < p->num_arenas; a++) {
    if (p->arenas[a]) p->arenas[a]->plan_serving = state == GM_PLAN_ACTIVE;
  }
  /* A plan serves: the job settled into a loop, so pages may be held at
   * the high-water mark again (pages.c, the move guard). */
  if (state == GM_PLAN_ACTIVE) gm_guard_reset(gm);
}

static void free_plan(gpumem_t* gm) {
  gm_planner* p = &gm->planner;
  set_state(gm, GM_PLAN_NONE);
  free(p->items);
  free(p->ctx_keys);
  free(p->ctx_items);
  p->items = NULL;
  p->ctx_keys = NULL;
  p->ctx_items = NULL;
  p->period = 0;
  p->num_arenas = 0;
  memset(p->arenas, 0, sizeof p->arenas);
}

void gm_plan_destroy(gpumem_t* gm) {
  gm_planner* p = &gm->planner;
  p->num_arenas = 0; /* the segments are gone already (allocator teardown) */
  free_plan(gm);
  free(p->ring);
  free(p->table);
  p->ring = NULL;
  p->table = NULL;
  p->enabled = false;
}

/* The arena at its one free block, nothing allocated in it. */
static bool arena_idle(const gm_segment* seg) {
  return seg->first && !seg->first->next && seg->first->state == GM_FREE;
}

void gm_plan_drop(gpumem_t* gm) {
  gm_planner* p = &gm->planner;
  if (!p->enabled) return;
  if (p->period) gm->stats.num_plan_drops++;
  free_plan(gm);
  p->cand = p->matched = 0;
  p->min_period = GM_PLAN_MIN_PERIOD;
  /* Idle plan arenas go back whole (their pages become spare). */
  gm_segment* seg = gm->segments;
  while (seg) {
    gm_segment* next = seg->next_seg;
    if (seg->is_arena && seg->pool->is_plan && arena_idle(seg)) gm_arena_release_if_unused(gm, seg);
    seg = next;
  }
}

/* ---- planning ---- */

typedef struct build_item {
  uint64_t start, len; /* phase of the allocation, lifetime in requests (<= P) */
  size_t size, off;
  uint32_t idx;
  uint8_t arena;
} build_item;

/* Do two circular lifetimes (modulo P) share a request? x is shifted to
 * [P, 3P) and compared with y at three shifts, all without negatives. */
static inline bool overlap(const build_item* x, const build_item* y, uint64_t P) {
  uint64_t xa = x->start + P, xb = xa + x->len;
  for (uint64_t k = 0; k < 3; k++) {
    uint64_t ya = y->start + k * P, yb = ya + y->len;
    if (xa < yb && ya < xb) return true;
  }
  return false;
}

static int by_size_desc(const void* a, const void* b) {
  const build_item* x = *(build_item* const*)a;
  const build_item* y = *(build_item* const*)b;
  if (x->size != y->size) return x->size < y->size ? 1 : -1;
  return x->idx < y->idx ? -1 : 1;
}

/* Orders live items by arena, then by end offset. */
static inline bool live_before(const build_item* x, uint8_t arena, size_t end) {
  return x->arena != arena ? x->arena < arena : x->off + x->size < end;
}

/* Position of the first live item not before (arena, end). */
static size_t live_lower_bound(build_item* const* live, size_t n, uint8_t arena, size_t end) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (live_before(live[mid], arena, end))
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Inserts it into the sorted live list. */
static void live_insert(build_item** live, size_t* n, build_item* it) {
  size_t k = live_lower_bound(live, *n, it->arena, it->off + it->size);
  memmove(&live[k + 1], &live[k], (*n - k) * sizeof *live);
  live[k] = it;
  (*n)++;
}

/* Sets each planned item's anchor by one sweep over the phases of the
 * period, keeping the items live at each phase sorted by (arena, end): an
 * item's anchor is then the live item just below (arena, its offset + 1).
 * Items live at the same phase never share bytes, so ends are distinct
 * within an arena. items[] is in phase order (one request per phase);
 * an item is live at phases start .. start + len - 1, modulo P. */
static bool set_anchors(build_item* items, size_t n, gm_plan_item* plan, uint64_t P) {
  build_item** live = malloc((n ? n : 1) * sizeof *live);
  uint32_t* ends_at = calloc(P + 1, sizeof *ends_at); /* counting sort by end phase */
  build_item** by_end = malloc((n ? n : 1) * sizeof *by_end);
  bool ok = live && ends_at && by_end;
  if (!ok) goto out;
  for (size_t i = 0; i < n; i++) {
    uint64_t e = items[i].start + items[i].len;
    if (e != P) ends_at[e % P + 1]++; /* an item ending at P is live to the end */
  }
  for (uint64_t t = 0; t < P; t++) ends_at[t + 1] += ends_at[t];
  for (size_t i = 0; i < n; i++) {
    uint64_t e = items[i].start + items[i].len;
    if (e != P) by_end[ends_at[e % P]++] = &items[i];
  }
  /* ends_at[t] is now the end of phase t's run in by_end; phase t's run
   * starts where phase t - 1's ended. */
  size_t num_live = 0;
  for (size_t i = 0; i < n; i++) { /* wrapping items are live at phase 0 */
    if (items[i].start + items[i].len > P) live_insert(live, &num_live, &items[i]);
  }
  size_t next_item = 0, next_end = 0;
  for (uint64_t t = 0; t < P; t++) {
    for (; next_end < ends_at[t]; next_end++) {
      const build_item* o = by_end[next_end];
      size_t k = live_lower_bound(live, num_live, o->arena, o->off + o->size);
      if (k < num_live && live[k] == o) {
        memmove(&live[k], &live[k + 1], (num_live - k - 1) * sizeof *live);
        num_live--;
      }
    }
    if (next_item == n || items[next_item].start != t) continue;
    build_item* it = &items[next_item++];
    size_t k = live_lower_bound(live, num_live, it->arena, it->off + 1);
    if (k > 0 && live[k - 1]->arena == it->arena && live[k - 1]->off + live[k - 1]->size > 0)
      plan[it->idx].anchor = (int32_t)live[k - 1]->idx;
    live_insert(live, &num_live, it);
  }
out:
  free(live);
  free(ends_at);
  free(by_end);
  return ok;
}

/* Finds or makes the plan arena of a stream: an idle one is reused, so a
 * plan that comes back finds its pages still mapped. */
static gpumem_status_t plan_arena(gpumem_t* gm, gpumem_stream_t stream, size_t extent,
                                  gm_segment** out) {
  gm_stream* s = gm_stream_get(gm, stream);
  if (!s) return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory for a stream");
  gm_pool* pool = &s->pools[GM_POOL_PLAN];
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (seg->pool == pool && seg->size >= extent && arena_idle(seg)) {
      *out = seg;
      return GPUMEM_OK;
    }
  }
  gm_block* b = NULL;
  gpumem_status_t st = gm_arena_new(gm, pool, extent, &b);
  if (st != GPUMEM_OK) return st;
  *out = b->seg;
  return GPUMEM_OK;
}

/* The peaks of planned bytes live at once over the period, of each arena
 * (peaks[a]) and of all together (returned), in one sweep; items[0..n)
 * are live at phases start .. start + len - 1, modulo P. SIZE_MAX when
 * host memory is short. */
static size_t live_peaks(const build_item* items, size_t n, uint64_t P, size_t num_streams,
                         size_t* peaks) {
  int64_t* delta = calloc(num_streams * (P + 1), sizeof *delta); /* a row per arena */
  if (!delta) return SIZE_MAX;
  for (size_t k = 0; k < n; k++) {
    const build_item* it = &items[k];
    int64_t* row = delta + it->arena * (P + 1);
    uint64_t end = it->start + it->len; /* one past the last phase, maybe beyond P */
    row[it->start] += (int64_t)it->size;
    if (end <= P) {
      row[end] -= (int64_t)it->size;
    } else {
      row[0] += (int64_t)it->size;
      row[end - P] -= (int64_t)it->size;
    }
  }
  int64_t live[GM_PLAN_MAX_STREAMS] = {0}, peak[GM_PLAN_MAX_STREAMS] = {0}, joint = 0;
  for (uint64_t j = 0; j < P; j++) {
    int64_t all = 0;
    for (size_t a = 0; a < num_streams; a++) {
      live[a] += delta[a * (P + 1) + j];
      if (live[a] > peak[a]) peak[a] = live[a];
      all += live[a];
    }
    if (all > joint) joint = all;
  }
  free(delta);
  for (size_t a = 0; a < num_streams; a++) peaks[a] = (size_t)peak[a];
  return (size_t)joint;
}

/* Several streams get an arena each, and each arena holds its own
 * stream's peak layout: where the streams peak at different phases the
 * arenas together hold more than the step ever has live, and the plan
 * would raise reserved memory above what best fit and lazy reclaim hold
 * (synth_streams: 1.0014 -> 1.0709 x peak live). Fits when the arenas,
 * page-rounded, hold at most the step's joint peak plus GM_PLAN_JOINT_SLACK
 * (1%: a plan whose streams peak nearly together keeps its steady state
 * without page moves) and a page per extra arena (rounding). held[] is
 * what each arena must hold at least (its stream's live peak, before
 * placement) or holds (its extent, after). */
static bool arenas_fit_joint_peak(const gpumem_t* gm, size_t joint_peak, const size_t* held,
                                  size_t num_streams) {
  double sum = 0;
  for (size_t a = 0; a < num_streams; a++) sum += (double)gm_round_up(held[a], gm->page_size);
  double allowed = (double)gm_round_up(joint_peak, gm->page_size) * (1.0 + GM_PLAN_JOINT_SLACK) +
                   (double)((num_streams - 1) * gm->page_size);
  return sum <= allowed;
}

/* Builds the plan from requests [s, s + P) of the ring (all lifetimes of
 * at most P requests are known by now). Returns false when the period does
 * not look like a step (or host memory is short): nothing changes then. */
static GM_COLD bool build_plan(gpumem_t* gm, uint64_t s, uint64_t P) {
  gm_planner* p = &gm->planner;
  build_item* items = calloc(P, sizeof *items);
  build_item** order = calloc(P, sizeof *order);
  build_item** placed = NULL;
  gm_plan_item* plan = calloc(P, sizeof *plan);
  size_t ctx_cap = 1;
  while (ctx_cap < 2 * P) ctx_cap *= 2;
  uint64_t* ctx_keys = NULL;
  int32_t* ctx_items = NULL;
  bool ok = false;
  if (!items || !order || !plan) goto done;

  gpumem_stream_t streams[GM_PLAN_MAX_STREAMS];
  size_t num_streams = 0, n_planned = 0;
  size_t joint_peak = 0; /* of planned bytes, all streams (several streams only) */
  uint64_t bytes_all = 0, bytes_planned = 0, live_min = UINT64_MAX, live_max = 0;
  for (uint64_t j = 0; j < P; j++) {
    const gm_plan_req* r = req_at(p, s + j);
    size_t a = 0;
    while (a < num_streams && streams[a] != r->stream) a++;
    if (a == num_streams) {
      if (num_streams == GM_PLAN_MAX_STREAMS) goto done;
      streams[num_streams++] = r->stream;
    }
    plan[j].rsize = r->rsize;
    plan[j].stream = r->stream;
    plan[j].arena = (uint8_t)a;
    plan[j].anchor = -1;
    bytes_all += r->rsize;
    if (r->live < live_min) live_min = r->live;
    if (r->live > live_max) live_max = r->live;
    uint64_t life = r->free_at ? r->free_at - 1 - (s + j) : UINT64_MAX;
    if (life >= 1 && life <= P) {
      build_item* it = &items[n_planned];
      it->start = j;
      it->len = life;
      it->size = r->rsize;
      it->idx = (uint32_t)j;
      it->arena = (uint8_t)a;
      order[n_planned++] = it;
      plan[j].planned = 1;
      plan[j].life = (uint32_t)life;
      bytes_planned += r->rsize;
    }
  }
  /* A step frees nearly all it allocates within the step; a loop inside a
   * step (layer after layer) keeps what each iteration made. */
  if (bytes_planned < bytes_all / 10 * 9) goto done;

  /* Cheap before placement: each arena holds at least its stream's peak.
   * Where the streams peak apart, one arena for all of them, reuse between
   * streams ordered on the device, if the backend and options allow. */
  size_t num_arenas = num_streams;
  bool shared = false;
  if (num_streams > 1) {
    size_t peaks[GM_PLAN_MAX_STREAMS];
    joint_peak = live_peaks(items, n_planned, P, num_streams, peaks);
    if (joint_peak == SIZE_MAX) goto done;
    if (!arenas_fit_joint_peak(gm, joint_peak, peaks, num_streams)) {
      if (!gm_can_order_streams(gm)) goto declined;
      shared = true;
      num_arenas = 1;
      /* The arena is the stream's with the most planned bytes: its own
       * requests need no wait. */
      uint64_t bytes[GM_PLAN_MAX_STREAMS] = {0};
      for (size_t k = 0; k < n_planned; k++) bytes[items[k].arena] += items[k].size;
      size_t owner = 0;
      for (size_t a = 1; a < num_streams; a++)
        if (bytes[a] > bytes[owner]) owner = a;
      gpumem_stream_t owner_stream = streams[owner];
      streams[owner] = streams[0];
      streams[0] = owner_stream;
      for (size_t k = 0; k < n_planned; k++) items[k].arena = 0;
      for (uint64_t j = 0; j < P; j++) plan[j].arena = 0;
    }
  }
  /* The rest is needed only by a plan that passed the checks above. */
  placed = calloc(P, sizeof *placed);
  ctx_keys = calloc(ctx_cap, sizeof *ctx_keys);
  ctx_items = calloc(ctx_cap, sizeof *ctx_items);
  if (!placed || !ctx_keys || !ctx_items) goto done;
  /* Greedy by size, each at the lowest offset free during its lifetime:
   * placed items are kept sorted by offset, so one scan finds the gap. */
  qsort(order, n_planned, sizeof *order, by_size_desc);
  size_t extent[GM_PLAN_MAX_STREAMS] = {0};
  size_t n_placed = 0;
  for (size_t i = 0; i < n_planned; i++) {
    build_item* it = order[i];
    size_t off = 0, k = 0;
    for (; k < n_placed && placed[k]->off < off + it->size; k++) {
      const build_item* o = placed[k];
      if (o->arena == it->arena && o->off + o->size > off && overlap(it, o, P))
        off = o->off + o->size;
    }
    it->off = off;
    if (off + it->size > extent[it->arena]) extent[it->arena] = off + it->size;
    /* insert after the items at lower or equal offsets (those the scan
     * passed may lie above off: they did not overlap in time) */
    size_t lo = 0, hi = n_placed;
    while (lo < hi) {
      size_t mid = lo + (hi - lo) / 2;
      if (placed[mid]->off <= off)
        lo = mid + 1;
      else
        hi = mid;
    }
    k = lo;
    memmove(&placed[k + 1], &placed[k], (n_placed - k) * sizeof *placed);
    placed[k] = it;
    n_placed++;
  }
  /* The plan's peak must be a good part of the swing of live bytes over
   * the period, or the period is not the step (most of it is elsewhere). */
  {
    uint64_t peak = 0;
    for (size_t a = 0; a < num_arenas; a++) peak += extent[a];
    if (peak < (live_max - live_min) / 2) goto done;
  }
  /* Checked again with the arenas' extents (see before placement). One
   * arena shared by the streams is not: like a single stream's plan, it
   * holds what greedy placement packs, and declining it would leave the
   * loop to best fit with pages moving between streams (a two-stream
   * PyTorch loop, packed at its joint peak plus 512 bytes, was declined:
   * the check rounds to pages, and 1% of its 80 MiB is less than one). */
  if (num_streams > 1 && !shared && !arenas_fit_joint_peak(gm, joint_peak, extent, num_arenas))
    goto declined;
  for (size_t i = 0; i < n_planned; i++) plan[order[i]->idx].off = order[i]->off;

  /* Anchors: for each planned item, the planned item that ends highest
   * below its offset among those live when it is requested. When the plan
   * is followed, the block after the anchor's is the free block to carve. */
  if (!set_anchors(items, n_planned, plan, P)) goto done;
  /* Resynchronisation table: context hash of each item -> item. */
  for (uint64_t j = 0; j < P; j++) {
    uint64_t h = context_hash(p, s + j) | 1; /* 0 marks an empty slot */
    size_t slot = h & (ctx_cap - 1);
    while (ctx_keys[slot] && ctx_keys[slot] != h) slot = (slot + 1) & (ctx_cap - 1);
    if (!ctx_keys[slot]) {
      ctx_keys[slot] = h;
      ctx_items[slot] = (int32_t)j;
    }
  }
  gm_segment* arenas[GM_PLAN_MAX_STREAMS] = {0};
  for (size_t a = 0; a < num_arenas; a++) {
    size_t ext = gm_round_up(extent[a] ? extent[a] : gm->page_size, gm->page_size);
    if (ext > gm->arena_size) goto done;
    /* An arena of the old plan is idle or not; it is reused only if idle. */
    if (plan_arena(gm, streams[a], ext, &arenas[a]) != GPUMEM_OK) goto done;
    for (size_t b = 0; b < a; b++) {
      if (arenas[b] == arenas[a]) goto done; /* cannot happen: one per stream */
    }
  }
  free_plan(gm);
  p->items = plan;
  p->ctx_keys = ctx_keys;
  p->ctx_items = ctx_items;
  p->ctx_mask = ctx_cap - 1;
  p->period = P;
  /* detection in turns (off_turn) starts over when this plan is gone */
  p->turn_end = 0;
  p->turn_off = false;
  p->off_turns = 0;
  p->num_arenas = num_arenas;
  p->shared = shared;
  memcpy(p->arenas, arenas, sizeof arenas);
  memcpy(p->arena_streams, streams, num_arenas * sizeof *streams);
  for (size_t a = 0; a < num_arenas; a++) {
    p->extents[a] = gm_round_up(extent[a] ? extent[a] : 1, gm->page_size);
    arenas[a]->shared_streams = shared;
  }
  if (shared) gm->stats.num_plans_shared++;
  p->cursor = 0;
  p->window_reqs = p->window_misses = 0;
  p->trimmed = false;
  p->active_since = s + 2 * P;
  set_state(gm, GM_PLAN_ACTIVE);
  gm->stats.num_plans++;
  plan = NULL;
  ctx_keys = NULL;
  ctx_items = NULL;
  ok = true;
  goto done;
declined:
  gm->stats.num_plans_declined++;
done:
  free(items);
  free(order);
  free(placed);
  free(plan);
  free(ctx_keys);
  free(ctx_items);
  return ok;
}

/* ---- detection ---- */

static int32_t resync(gm_planner* p, uint64_t i);

/* Is requests [s, s + P) the current plan repeated (any phase)? Then
 * there is nothing to build. P need not be a multiple of the plan's
 * period: a loop shorter than the shortest period looked for (14
 * requests) is planned as two of itself (28), and is then confirmed as
 * 42, 56, ... requests, each the same loop; each was rebuilt before, with
 * a new arena each time, until the plan had served two periods in a row. */
static bool same_as_plan(gm_planner* p, uint64_t s, uint64_t P) {
  if (!p->period) return false;
  int32_t j0 = resync(p, s);
  if (j0 < 0) return false;
  for (uint64_t k = 0; k < P; k++) {
    const gm_plan_item* it = &p->items[(j0 + k) % p->period];
    if (req_at(p, s + k)->key != req_key(it->rsize, it->stream)) return false;
  }
  return true;
}

/* The table slot of request i's context (i >= 8), or NULL where detection
 * skips the table: once GM_PLAN_SAMPLE_AFTER requests
 * have gone by without a plan, for all but the contexts whose rolling sum
 * has its top three bits clear (one in eight). The contexts of a period
 * recur with it, so a period that begins later is still found, a few
 * requests later, at an eighth of the hashing and table traffic. (A
 * workload that never repeats, such as t5, paid about 50 of its ~630
 * instructions per operation for detection.) */
static uint64_t* detection_slot(gm_planner* p, uint64_t i) {
  if (!p->period && i >= GM_PLAN_SAMPLE_AFTER && (req_at(p, i)->ctx >> 61)) return NULL;
  return &p->table[context_hash(p, i) % GM_PLAN_TABLE];
}

static void detect(gpumem_t* gm, uint64_t i) {
  gm_planner* p = &gm->planner;
  if (i < p->window_start + 8) return; /* the context needs 9 requests of the window */
  uint64_t* slot = detection_slot(p, i);
  uint64_t key = req_at(p, i)->key;
  if (p->cand) {
    if (req_at(p, i - p->cand)->key == key)
      p->matched++;
    else
      p->cand = p->matched = 0;
  }
  if (slot) {
    uint64_t last = *slot;
    if (!p->cand && last && last - 1 >= p->window_start) {
      uint64_t P = i - (last - 1);
      if (P >= p->min_period && P <= GM_PLAN_MAX_PERIOD && req_at(p, i - P)->key == key) {
        p->cand = P;
        p->matched = 1;
      }
    }
    /* Keep an occurrence at least min_period old: once a period was found
     * wanting, only longer ones are looked for. */
    if (!last || i - (last - 1) >= p->min_period) *slot = i + 1;
  }
  if (p->cand && p->matched >= p->cand && i + 1 >= 2 * p->cand + 8) {
    uint64_t P = p->cand;
    p->cand = p->matched = 0;
    /* Built or found wanting, only longer periods are looked for now: a
     * plan of a loop inside the step falls off the plan between the loops
     * and is replaced by the step's period when that is confirmed. The
     * first of the two equal periods is [i + 1 - 2P, i + 1 - P); the next
     * request is at phase 0 of the new plan. */
    p->min_period = P + 1;
    if (!same_as_plan(p, i + 1 - 2 * P, P)) build_plan(gm, i + 1 - 2 * P, P);
  }
}

/* ---- serving ---- */

static gm_block* cover_by_walk(gm_segment* seg, uintptr_t addr) {
  gm_block* b = seg->first;
  while (b && b->addr + b->size <= addr) b = b->next;
  return b;
}

/* Carves [addr, addr + rsize) out of the free block f that covers it. */
static gm_block* carve(gpumem_t* gm, gm_block* f, uintptr_t addr, size_t rsize) {
  gm_pool* pool = f->pool;
  size_t ps = gm->page_size;
  gm_index_remove(&pool->index, f);
  gm_dirty_remove(f);
  if (f->addr < addr) {
    gm_block* rest = gm_split_free_front(gm, f, addr - f->addr);
    if (!rest) { /* no block struct (host memory): f stays free as it was */
      gm_index_insert(&pool->index, f);
      if (f->size >= ps) gm_dirty_add(pool, f);
      return NULL;
    }
    f = rest;
  }
  gm_split_block(gm, f, rsize, f->size - rsize >= GM_MIN_BLOCK);
  f->state = GM_ALLOCATED;
  gm_arena_busy(gm, f, 1);
  if (gm_arena_map_range(gm, f->seg, f->addr, f->size) != GPUMEM_OK) {
    gm_free_unused(gm, f);
    return NULL;
  }
  return f;
}

/* The block at item j's planned range, or NULL when the range is busy. */
static gm_block* serve(gpumem_t* gm, size_t j) {
  gm_planner* p = &gm->planner;
  const gm_plan_item* it = &p->items[j];
  gm_segment* seg = p->arenas[it->arena];
  uintptr_t addr = seg->addr + it->off;
  gm_block* f = NULL;
  if (it->anchor >= 0) {
    const gm_plan_item* an = &p->items[it->anchor];
    gm_block* ab = gm_ptr_map_find(&gm->ptrs, seg->addr + an->off);
    if (ab && ab->seg == seg && ab->addr + ab->size <= addr) f = ab->next;
  } else {
    f = seg->first;
  }
  /* The anchor is missing (it was placed elsewhere: the plan's first
   * period, or a miss) or not adjacent: find the block the slow way. */
  if (!f || f->addr > addr || f->addr + f->size <= addr) f = cover_by_walk(seg, addr);
  if (!f || f->state != GM_FREE || f->addr > addr || f->addr + f->size < addr + it->rsize)
    return NULL;
  return carve(gm, f, addr, it->rsize);
}

/* The plan item with request i's context, or -1. */
static int32_t resync(gm_planner* p, uint64_t i) {
  if (i < 8) return -1;
  uint64_t h = context_hash(p, i) | 1;
  size_t slot = h & p->ctx_mask;
  while (p->ctx_keys[slot]) {
    if (p->ctx_keys[slot] == h) return p->ctx_items[slot];
    slot = (slot + 1) & p->ctx_mask;
  }
  return -1;
}

/* A dormant plan serves again from idle arenas only: what is left in its
 * arena may sit where the plan places others (a block that matched the
 * plan but outlived it). The arena drains within a period; one that still
 * holds blocks two periods on is left to drain alone (retired: its free
 * pages are reclaimed first), and an idle or new arena takes its place. */
static bool arenas_ready(gpumem_t* gm) {
  gm_planner* p = &gm->planner;
  bool idle = true;
  for (size_t a = 0; a < p->num_arenas; a++) idle &= arena_idle(p->arenas[a]);
  if (idle) return true;
  if (p->n - p->dormant_since < 2 * (uint64_t)p->period) return false;
  for (size_t a = 0; a < p->num_arenas; a++) {
    if (arena_idle(p->arenas[a])) continue;
    gm_segment* seg = NULL;
    if (plan_arena(gm, p->arena_streams[a], p->extents[a], &seg) != GPUMEM_OK) return false;
    seg->shared_streams = p->shared;
    p->arenas[a] = seg;
  }
  return true;
}

/* Pressure: after the first period a plan serves (from its start or its
 * return), the pages the regular arenas no longer need (their step blocks
 * moved to the plan) go back to the device. */
static void trim(gpumem_t* gm) {
  gm_planner* p = &gm->planner;
  p->trimmed = true;
  if (gm->opts.reclaim != GPUMEM_RECLAIM_PRESSURE) return;
  if (gm_reclaim_from(gm, GM_RECLAIM_SPARE_SERVING, 0, NULL) == GPUMEM_OK)
    gm_release_spare_pages(gm, 0);
}

static void go_dormant(gpumem_t* gm, uint64_t i, size_t shadow) {
  gm_planner* p = &gm->planner;
  gm->stats.num_plan_drops++;
  p->shadow = shadow;
  p->shadow_run = p->verified = 0;
  p->verify = i;
  p->dormant_since = i;
  set_state(gm, GM_PLAN_DORMANT);
}

/* Dormant: follow the plan without serving, and check that what followed
 * it also lived as planned (freed within its planned lifetime, plus a
 * little). A sequence can repeat a step's sizes with other lifetimes
 * (weights allocated in the order an optimizer step allocates its
 * temporaries): served by the plan, such blocks would squat on ranges the
 * plan gives to others. */
static void shadow_step(gpumem_t* gm, uint64_t i, size_t rsize, gpumem_stream_t stream) {
  gm_planner* p = &gm->planner;
  const gm_plan_item* it = &p->items[p->shadow];
  if (it->rsize != rsize || it->stream != stream) {
    int32_t j = resync(p, i);
    p->shadow_run = p->verified = 0;
    p->verify = i;
    if (j < 0) {
      req_at(p, i)->item = -1;
      return;
    }
    p->shadow = (size_t)j;
  }
  req_at(p, i)->item = (int32_t)p->shadow;
  p->shadow = p->shadow + 1 == p->period ? 0 : p->shadow + 1; /* no division */
  p->shadow_run++;
  uint64_t slack = p->period / 64 + 1;
  while (p->verify < i) {
    const gm_plan_req* r = req_at(p, p->verify);
    const gm_plan_item* v = r->item >= 0 ? &p->items[r->item] : NULL;
    if (!v || !v->planned) {
      p->verify++;
      continue;
    }
    uint64_t due = p->verify + v->life + slack;
    if (r->free_at && r->free_at - 1 <= due) {
      p->verify++;
      p->verified++;
      continue;
    }
    if (i < due) break; /* not yet due */
    /* Outlived its plan: start over from here. */
    p->shadow_run = p->verified = 0;
    p->verify = i;
    break;
  }
  if (p->shadow_run >= SHADOW_RUN && p->verified >= SHADOW_RUN && arenas_ready(gm)) {
    p->cursor = p->shadow;
    p->window_reqs = p->window_misses = 0;
    p->active_since = i;
    p->trimmed = false; /* a phase change: pages move once more */
    set_state(gm, GM_PLAN_ACTIVE);
  }
}

/* A block of the arena the plan's streams share, for stream s, not the
 * arena's: s waits for the arena's stream first (streams.c); if it
 * cannot, the block goes back and best fit serves. */
static GM_COLD gm_block* hand_over(gpumem_t* gm, gm_block* b, gm_stream* s) {
  if (gm_shared_take(gm, b, s) == GPUMEM_OK) return b;
  gm_free_unused(gm, b);
  return NULL;
}

static gm_block* plan_malloc(gpumem_t* gm, gm_stream* s, size_t rsize, uint64_t i) {
  gm_planner* p = &gm->planner;
  if (p->state == GM_PLAN_DORMANT) {
    /* This request was shadowed; a plan that comes back serves the next. */
    shadow_step(gm, i, rsize, s->handle);
    return NULL;
  }
  if (p->state != GM_PLAN_ACTIVE) return NULL;
  const gm_plan_item* it = &p->items[p->cursor];
  if (it->rsize != rsize || it->stream != s->handle) {
    /* Off the plan: never serve on a guess (see shadow_step). */
    go_dormant(gm, i, p->cursor);
    shadow_step(gm, i, rsize, s->handle);
    return NULL;
  }
  size_t j = p->cursor;
  p->cursor = j + 1 == p->period ? 0 : j + 1; /* no division on the hot path */
  gm_block* b = NULL;
  if (it->planned) {
    b = serve(gm, j);
    if (GM_UNLIKELY(b && p->shared && b->pool->stream != s)) b = hand_over(gm, b, s);
    if (b)
      gm->stats.num_planned_allocs++;
    else
      p->window_misses++;
  }
  if (++p->window_reqs >= p->period) {
    bool bad = p->window_misses > p->period / 100 + 1;
    p->window_reqs = p->window_misses = 0;
    if (bad)
      go_dormant(gm, i + 1, p->cursor);
    else if (!p->trimmed)
      trim(gm);
  }
  return b;
}

/* A workload that has gone GM_PLAN_IDLE_AFTER requests without a plan is
 * unlikely to repeat soon, and looking for a period is most of what the
 * planner costs it (t5, which never repeats: about 7 of its ~60 ns per
 * operation on the development machine). From then on, while no plan
 * exists, detection takes turns: an on turn of GM_PLAN_TURN requests
 * records and looks as before; the off turn after it skips every request.
 * Off turns lengthen while on turns keep finding nothing: the first is
 * GM_PLAN_TURN requests long, each next one twice the one before, up to
 * GM_PLAN_MAX_OFF_TURNS turns (a plan built starts the count again). So a
 * workload that never repeats spends one request in 17 on detection, and
 * a loop that begins in an off turn is found in the next on turn, at most
 * GM_PLAN_MAX_OFF_TURNS * GM_PLAN_TURN requests later (262,144: seconds of
 * a training job); a turn holds two of the longest period, so one that
 * runs through an on turn is found in it, as it would have been without
 * turns. (Sampling fewer contexts instead, one in 64, missed short loops
 * outright: a period of 36 requests may have none of its contexts
 * sampled, test_engine.) */
static void open_window(gm_planner* p, uint64_t i) {
  /* The requests of the off turn were not recorded: the context restarts
   * from zero keys, as at the very first request, and neither the table's
   * entries from before nor a candidate carries over. */
  for (uint64_t k = 1; k <= 9; k++) req_at(p, i - k)->key = 0;
  req_at(p, i - 1)->ctx = 0;
  p->window_start = i;
  p->cand = p->matched = 0;
}

static GM_COLD void next_turn(gm_planner* p, uint64_t i) {
  if (p->turn_off || !p->turn_end) {
    p->turn_off = false;
    p->turn_end = i + GM_PLAN_TURN;
    open_window(p, i);
    return;
  }
  /* the on turn found nothing: a longer rest */
  p->off_turns = p->off_turns ? 2 * p->off_turns : 1;
  if (p->off_turns > GM_PLAN_MAX_OFF_TURNS) p->off_turns = GM_PLAN_MAX_OFF_TURNS;
  p->turn_off = true;
  p->turn_end = i + (uint64_t)GM_PLAN_TURN * p->off_turns;
}

static inline bool off_turn(gm_planner* p, uint64_t i) {
  if (p->period || i < GM_PLAN_IDLE_AFTER) return false;
  if (GM_UNLIKELY(i >= p->turn_end)) next_turn(p, i);
  return p->turn_off;
}

gm_block* gm_plan_malloc(gpumem_t* gm, gm_stream* s, size_t rsize) {
  gm_planner* p = &gm->planner;
  uint64_t i = p->n++;
  p->idle = off_turn(p, i);
  if (p->idle) return NULL;
  gm_plan_req* r = req_at(p, i);
  r->key = req_key(rsize, s->handle);
  context_roll(p, i);
  r->rsize = rsize;
  r->stream = s->handle;
  r->free_at = 0;
  r->item = -1;
  r->live = (uint64_t)gm->stats.allocated_bytes[GPUMEM_POOL_ALL].current;
  gm_block* b = p->period ? plan_malloc(gm, s, rsize, i) : NULL;
  /* Detection runs until a plan has served two periods in a row: a plan
   * of a loop inside the step falls off between loops, and the step's
   * longer period then replaces it. */
  if (p->state != GM_PLAN_ACTIVE || i - p->active_since < 2 * (uint64_t)p->period) detect(gm, i);
  return b;
}

/* ---- checks ---- */

size_t gm_plan_check(gpumem_t* gm, char* msg, size_t len) {
  gm_planner* p = &gm->planner;
  size_t errors = 0;
  if (!p->enabled) return 0;
  for (size_t a = 0; a < p->num_arenas; a++) {
    gm_segment* seg = p->arenas[a];
    bool found = false;
    for (gm_segment* x = gm->segments; x && !found; x = x->next_seg) found = x == seg;
    if (!found || !seg->is_arena || !seg->pool->is_plan) {
      if (!errors++) snprintf(msg, len, "plan arena %zu is not a plan pool's arena", a);
    } else if (seg->plan_serving != (p->state == GM_PLAN_ACTIVE)) {
      if (!errors++)
        snprintf(msg, len, "plan arena %zu: plan_serving disagrees with the planner", a);
    }
  }
  for (size_t j = 0; j < p->period; j++) {
    const gm_plan_item* it = &p->items[j];
    if (!it->planned) continue;
    const gm_segment* seg = p->arenas[it->arena];
    if (it->off + it->rsize > seg->size || it->rsize % GM_MIN_BLOCK) {
      if (!errors++) snprintf(msg, len, "plan item %zu lies outside its arena", j);
    }
  }
  /* Plan pools hold arenas only, and only the current plan's may serve. */
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (seg->pool->is_plan && !seg->is_arena) {
      if (!errors++) snprintf(msg, len, "plain segment in a plan pool");
    }
    bool current = false;
    for (size_t a = 0; a < p->num_arenas; a++) current |= p->arenas[a] == seg;
    if (seg->plan_serving && !current) {
      if (!errors++)
        snprintf(msg, len, "arena 0x%lx serves no plan but is marked serving",
                 (unsigned long)seg->addr);
    }
  }
  return errors;
}
