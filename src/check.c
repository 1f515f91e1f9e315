/* gpumem_check: walks every structure and verifies the invariants written
 * in engine.h. Counts violations and describes the first one; it never
 * changes the allocator. O(blocks + pages): meant for tests. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

typedef struct check_ctx {
  size_t errors;
} check_ctx;

static void violation(check_ctx* c, const char* fmt, ...) GM_PRINTF(2, 3);
static void violation(check_ctx* c, const char* fmt, ...) {
  if (c->errors++ == 0) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    gpumem_set_last_error("gpumem_check: %s", msg);
  }
}

typedef struct sums {
  int64_t allocated[GPUMEM_POOL_COUNT], allocated_bytes[GPUMEM_POOL_COUNT];
  int64_t active[GPUMEM_POOL_COUNT], active_bytes[GPUMEM_POOL_COUNT];
  int64_t requested_bytes[GPUMEM_POOL_COUNT];
  int64_t split[GPUMEM_POOL_COUNT], split_bytes[GPUMEM_POOL_COUNT];
  int64_t segments[GPUMEM_POOL_COUNT], reserved[GPUMEM_POOL_COUNT];
  int64_t plain_reserved; /* bytes of plain segments, all pools */
  size_t free_blocks, pending_refs, mapped_pages, shadows, aliased, dirty;
} sums;

static void add(int64_t* arr, bool small, int64_t v) {
  arr[GPUMEM_POOL_ALL] += v;
  arr[small ? GPUMEM_POOL_SMALL : GPUMEM_POOL_LARGE] += v;
}

/* Busy counts, page records and ghosts of one arena. */
static void check_pages(gpumem_t* gm, gm_segment* seg, check_ctx* c) {
  size_t ps = gm->page_size;
  unsigned long at = (unsigned long)seg->addr;
  /* busy: the ends of allocated or pending blocks on each page,
   * and the pages strictly inside one, counted afresh */
  uint32_t* want = calloc(seg->num_pages, sizeof *want);
  uint8_t* inner = calloc(seg->num_pages, 1);
  if (!want || !inner) {
    free(want);
    free(inner);
    violation(c, "no host memory to check arena 0x%lx", at);
    return;
  }
  for (const gm_block* b = seg->first; b; b = b->next) {
    if (b->state == GM_FREE) continue;
    size_t first = (b->addr - seg->addr) / ps, last = (b->addr + b->size - 1 - seg->addr) / ps;
    if (last >= seg->num_pages) continue; /* reported by the block checks */
    want[first]++; /* first and last page each count once: twice for one page */
    want[last]++;
    for (size_t p = first + 1; p < last; p++) inner[p]++;
  }
  for (size_t p = 0; p < seg->num_pages; p++) {
    bool bit = (seg->busy_inner[p / 64] >> (p % 64)) & 1u;
    if (seg->busy[p] != want[p] || bit != (inner[p] != 0) || inner[p] > 1 ||
        (inner[p] && want[p])) {
      violation(c,
                "arena 0x%lx page %zu: busy count %u (%u blocks begin or end there), inner bit %d "
                "(%u blocks cover it)",
                at, p, (unsigned)seg->busy[p], want[p], (int)bit, (unsigned)inner[p]);
      break;
    }
  }
  free(inner);
  free(want);
  /* fence marks (fence.c): a page marked at a fence and one a completed
   * fence made safe are two states, and a block placed over a page clears
   * both, so no page in use carries one */
  for (size_t p = 0; seg->fence_pend && p < seg->num_pages; p++) {
    uint64_t bit = 1ull << (p % 64);
    bool pend = seg->fence_pend[p / 64] & bit, safe = seg->fence_safe[p / 64] & bit;
    if ((pend && safe) || ((pend || safe) && gm_page_busy(seg, p))) {
      violation(c, "arena 0x%lx page %zu: fence marks pending %d, safe %d, on a page %s", at, p,
                (int)pend, (int)safe, gm_page_busy(seg, p) ? "in use" : "free");
      break;
    }
  }
  /* host-backed slots (overflow.c): under a live block (check_segment:
   * wholly inside an allocated one), holding no device page, no page
   * record and no ghost; counted in host_pages */
  size_t host = 0;
  for (size_t p = 0; seg->host_bits && p < seg->num_pages; p++) {
    if (!gm_arena_page_host(seg, p)) continue;
    host++;
    if (gm_arena_page_mapped(seg, p) || seg->live_id[p] || seg->ghost_id[p] ||
        !gm_page_busy(seg, p)) {
      violation(c, "arena 0x%lx page %zu: host-backed, yet %s", at, p,
                gm_arena_page_mapped(seg, p)          ? "mapped to a device page"
                : seg->live_id[p] || seg->ghost_id[p] ? "with a page record or a ghost"
                                                      : "under no live block");
      break;
    }
  }
  if (host != seg->host_pages)
    violation(c, "arena 0x%lx: %zu host-backed page slots, counter says %zu", at, host,
              seg->host_pages);
  for (size_t p = 0; p < seg->num_pages; p++) {
    bool live = gm_arena_page_mapped(seg, p);
    bool single =
        live && seg->run_start[p] == p &&
        !(p + 1 < seg->num_pages && gm_arena_page_mapped(seg, p + 1) && seg->run_start[p + 1] == p);
    uint32_t id = seg->live_id[p];
    if (single != (id != 0)) {
      violation(c, "arena 0x%lx page %zu: %s a page record", at, p,
                id ? "a longer mapping has" : "a single-page mapping lacks");
      continue;
    }
    if (id && (id > gm->phys_count || gm->phys[id - 1].handle != seg->handles[p] ||
               !((gm->phys[id - 1].live_seg == seg && gm->phys[id - 1].live_page == p) ||
                 (gm->phys[id - 1].alias_seg == seg && gm->phys[id - 1].alias_page == p))))
      violation(c, "arena 0x%lx page %zu: its page record says it lives elsewhere", at, p);
    uint32_t g = seg->ghost_id[p];
    if (!g) continue;
    if (live) violation(c, "arena 0x%lx page %zu: live and a ghost at once", at, p);
    bool listed = false;
    if (g <= gm->phys_count) {
      const gm_phys* r = &gm->phys[g - 1];
      for (uint32_t i = 0; i < r->num_ghosts; i++)
        listed |= r->ghost_seg[i] == seg && r->ghost_page[i] == p;
    }
    if (!listed) violation(c, "arena 0x%lx page %zu: a ghost its page does not list", at, p);
  }
}

/* Every page record: live where its arena says, or spare where the spare
 * list says; its ghosts where their arenas say. */
static void check_page_records(gpumem_t* gm, check_ctx* c) {
  size_t spare = 0;
  for (size_t i = 0; i < gm->phys_count; i++) {
    const gm_phys* r = &gm->phys[i];
    uint32_t id = (uint32_t)i + 1;
    if (!r->handle) continue; /* a free record */
    if (r->num_ghosts > GM_MAX_GHOSTS) violation(c, "page record %u: %u ghosts", id, r->num_ghosts);
    for (uint32_t k = 0; k < r->num_ghosts && k < GM_MAX_GHOSTS; k++) {
      if (r->ghost_page[k] >= r->ghost_seg[k]->num_pages ||
          r->ghost_seg[k]->ghost_id[r->ghost_page[k]] != id)
        violation(c, "page record %u: ghost %u is not there", id, k);
      else if (r->ghost_sync_mark[k] > r->ghost_seg[k]->pool->stream->syncs + 1)
        violation(c, "page record %u: ghost %u waits for a synchronization its stream never had",
                  id, k);
    }
    if (r->alias_seg && (!r->live_seg || r->alias_seg->live_id[r->alias_page] != id))
      violation(c, "page record %u: not aliased where it says", id);
    if (r->live_seg) {
      if (r->live_seg->live_id[r->live_page] != id)
        violation(c, "page record %u: not live where it says", id);
    } else {
      spare++;
      if (r->spare_pos >= gm->num_spare_pages || gm->spare_pages[r->spare_pos] != id)
        violation(c, "page record %u: spare, but not in the spare list", id);
    }
  }
  if (spare != gm->num_spare_pages)
    violation(c, "%zu spare page records, the spare list holds %zu", spare, gm->num_spare_pages);
}

static void check_segment(gpumem_t* gm, gm_segment* seg, sums* s, check_ctx* c) {
  bool small = seg->pool->is_small;
  uintptr_t expect = seg->addr;
  const gm_block* prev = NULL;
  size_t ps = gm->page_size;
  add(s->segments, small, 1);
  if (!seg->is_arena) {
    add(s->reserved, small, (int64_t)seg->size);
    s->plain_reserved += (int64_t)seg->size;
  }
  /* Under virtual memory every segment is an arena but those of a pool
   * with a segment source, which are plain; without it, none is. */
  if (seg->is_arena != seg->pool->maps_pages)
    violation(c, "segment 0x%lx is %s, but its pool %s", (unsigned long)seg->addr,
              seg->is_arena ? "an arena" : "plain",
              seg->pool->source    ? "takes its segments from a segment source"
              : gm->virtual_memory ? "maps pages (virtual memory)"
                                   : "has plain segments (no virtual memory)");
  if (!seg->first) violation(c, "segment 0x%lx has no blocks", (unsigned long)seg->addr);
  for (const gm_block* b = seg->first; b; prev = b, b = b->next) {
    if (b->prev != prev) violation(c, "block 0x%lx: prev link broken", (unsigned long)b->addr);
    if (b->addr != expect) {
      violation(c, "block 0x%lx: expected at 0x%lx (gap or overlap)", (unsigned long)b->addr,
                (unsigned long)expect);
    }
    if (b->seg != seg || b->pool != seg->pool)
      violation(c, "block 0x%lx: wrong segment or pool", (unsigned long)b->addr);
    if (b->size == 0 || b->size % GM_MIN_BLOCK)
      violation(c, "block 0x%lx: size %zu", (unsigned long)b->addr, b->size);
    expect = b->addr + b->size;
    switch (b->state) {
      case GM_FREE:
        s->free_blocks++;
        if (prev && prev->state == GM_FREE)
          violation(c, "free neighbours 0x%lx and 0x%lx unmerged", (unsigned long)prev->addr,
                    (unsigned long)b->addr);
        if (gm_block_is_split(b) && !seg->is_arena) {
          add(s->split, small, 1);
          add(s->split_bytes, small, (int64_t)b->size);
        }
        break;
      case GM_ALLOCATED:
        if (gm_ptr_map_find(&gm->ptrs, b->addr) != b)
          violation(c, "allocated block 0x%lx missing from the pointer map",
                    (unsigned long)b->addr);
        if (b->requested > b->size)
          violation(c, "block 0x%lx: requested %zu > size %zu", (unsigned long)b->addr,
                    b->requested, b->size);
        if (b->serial == 0 || b->serial > gm->num_mallocs)
          violation(c, "allocated block 0x%lx: serial %llu outside 1..%llu (allocations made)",
                    (unsigned long)b->addr, (unsigned long long)b->serial,
                    (unsigned long long)gm->num_mallocs);
        add(s->allocated, gm_block_stat_small(b), 1);
        add(s->allocated_bytes, gm_block_stat_small(b), (int64_t)b->size);
        add(s->requested_bytes, gm_block_stat_small(b), (int64_t)b->requested);
        add(s->active, gm_block_stat_small(b), 1);
        add(s->active_bytes, gm_block_stat_small(b), (int64_t)b->size);
        break;
      case GM_SHADOW:
        s->shadows++;
        break;
      case GM_PENDING:
        if (!b->pending_events)
          violation(c, "pending block 0x%lx waits for no event", (unsigned long)b->addr);
        s->pending_refs += b->pending_events;
        add(s->active, gm_block_stat_small(b), 1);
        add(s->active_bytes, gm_block_stat_small(b), (int64_t)b->size);
        break;
      default:
        violation(c, "block 0x%lx: bad state %d", (unsigned long)b->addr, b->state);
    }
    /* a lent block is live, in a large arena, and names its borrower:
     * another stream, still one of its uses while allocated */
    if (b->lent && (b->state == GM_FREE || b->state == GM_SHADOW || !seg->is_arena ||
                    b->pool->is_small || b->inline_uses[0] == b->pool->stream->handle ||
                    (b->state == GM_ALLOCATED && b->num_uses == 0)))
      violation(c, "lent block 0x%lx: state %d, borrower 0x%lx, %u uses", (unsigned long)b->addr,
                b->state, (unsigned long)b->inline_uses[0], (unsigned)b->num_uses);
    if (b->aliased) s->aliased++;
    if (b->aliased && b->state != GM_ALLOCATED && b->state != GM_PENDING)
      violation(c, "block 0x%lx: an alias's owner is not live", (unsigned long)b->addr);
    if (b->state != GM_FREE && gm_dirty_on(b))
      violation(c, "non-free block 0x%lx in a dirty list", (unsigned long)b->addr);
    if (gm_dirty_on(b))
      s->dirty++;
    else if (b->dirty.prev != &b->dirty)
      violation(c, "block 0x%lx is half linked to the dirty lists", (unsigned long)b->addr);
    if (seg->is_arena && b->state != GM_FREE) {
      size_t first = (b->addr - seg->addr) / ps, last = (b->addr + b->size - 1 - seg->addr) / ps;
      for (size_t p = first; p <= last; p++) {
        /* (or host-backed, strictly inside an allocated block: overflow.c) */
        bool host = gm_arena_page_host(seg, p) && b->state == GM_ALLOCATED &&
                    p * ps >= b->addr - seg->addr && (p + 1) * ps <= b->addr + b->size - seg->addr;
        if (!gm_arena_page_mapped(seg, p) && !host) {
          violation(c, "page %zu under live block 0x%lx is not mapped", p, (unsigned long)b->addr);
          break;
        }
      }
    }
  }
  if (expect != seg->addr + seg->size)
    violation(c, "segment 0x%lx: blocks cover %lu of %zu bytes", (unsigned long)seg->addr,
              (unsigned long)(expect - seg->addr), seg->size);
  if (seg->is_arena) {
    size_t mapped = 0;
    for (size_t p = 0; p < seg->num_pages; p++) {
      bool bit = gm_arena_page_mapped(seg, p);
      mapped += bit;
      if (bit != (seg->handles[p] != 0))
        violation(c, "arena 0x%lx page %zu: bitmap and handle disagree", (unsigned long)seg->addr,
                  p);
      /* a mapping is a run of pages with one handle, each naming its first */
      size_t start = seg->run_start[p];
      if (bit && (start > p || !gm_arena_page_mapped(seg, start) ||
                  seg->run_start[start] != start || seg->handles[start] != seg->handles[p] ||
                  (p > start && seg->run_start[p - 1] != start))) {
        violation(c, "arena 0x%lx page %zu: not part of a run of its mapping (starts at %zu)",
                  (unsigned long)seg->addr, p, start);
      }
      if (bit && p > 0 && start == p && gm_arena_page_mapped(seg, p - 1) &&
          seg->handles[p - 1] == seg->handles[p]) {
        violation(c, "arena 0x%lx page %zu: one handle mapped as two runs",
                  (unsigned long)seg->addr, p);
      }
    }
    if (mapped != seg->mapped_pages)
      violation(c, "arena 0x%lx: %zu pages mapped, counter says %zu", (unsigned long)seg->addr,
                mapped, seg->mapped_pages);
    check_pages(gm, seg, c);
    s->mapped_pages += mapped;
    if (small) s->reserved[GPUMEM_POOL_SMALL] += (int64_t)(mapped * ps);
  }
}

/* Each alias: its owner live and ending on its last page, which is the
 * shared page; the shadow after the owner to that page's end; the shadow
 * over the shared page's first bytes where it lives; nothing else shadowed. */
static void check_aliases(gpumem_t* gm, const sums* s, check_ctx* c) {
  size_t ps = gm->page_size;
  if (s->shadows != 2 * gm->num_aliases || s->aliased != gm->num_aliases)
    violation(c, "%zu aliases, %zu shadow blocks, %zu owners", gm->num_aliases, s->shadows,
              s->aliased);
  for (size_t k = 0; k < gm->num_aliases; k++) {
    const gm_alias* a = &gm->aliases[k];
    const gm_block* o = a->owner;
    const gm_phys* r = a->id && a->id <= gm->phys_count ? &gm->phys[a->id - 1] : NULL;
    if (!r || !r->alias_seg || !r->live_seg || r->alias_seg != o->seg || r->live_seg != o->seg) {
      violation(c, "alias %zu: its page is not shared in its owner's arena", k);
      continue;
    }
    uintptr_t last = o->seg->addr + (uintptr_t)r->alias_page * ps,
              at = o->seg->addr + r->live_page * ps;
    size_t e = o->addr + o->size - last;
    const gm_block* h = o->next;
    const gm_block* t = a->shadow_there;
    if (!o->aliased || o->addr >= last || e == 0 || e >= ps || !h || h->state != GM_SHADOW ||
        h->addr + h->size != last + ps || t->state != GM_SHADOW || t->seg != o->seg ||
        t->addr != at || t->size != e)
      violation(c, "alias %zu (owner 0x%lx): owner, shadows and shared page do not line up", k,
                (unsigned long)o->addr);
  }
}

static void compare(check_ctx* c, const char* name, const gpumem_stat_t* stat, const int64_t* sum) {
  static const char* const pools[] = {"all", "small_pool", "large_pool"};
  for (int p = 0; p < GPUMEM_POOL_COUNT; p++) {
    if (stat[p].current != sum[p]) {
      violation(c, "%s.%s.current is %lld, the structures hold %lld", name, pools[p],
                (long long)stat[p].current, (long long)sum[p]);
    }
    if (stat[p].current > stat[p].peak || stat[p].current < 0)
      violation(c, "%s.%s: current %lld outside [0, peak %lld]", name, pools[p],
                (long long)stat[p].current, (long long)stat[p].peak);
  }
  /* The pools' totals add up to the all-pools ones, as in PyTorch's table
   * (peaks, reached at different times, need not). */
  const gpumem_stat_t *all = &stat[GPUMEM_POOL_ALL], *sm = &stat[GPUMEM_POOL_SMALL],
                      *lg = &stat[GPUMEM_POOL_LARGE];
  if (sm->allocated + lg->allocated != all->allocated || sm->freed + lg->freed != all->freed) {
    violation(
        c, "%s: the pools' allocated %lld + %lld and freed %lld + %lld are not all's %lld and %lld",
        name, (long long)sm->allocated, (long long)lg->allocated, (long long)sm->freed,
        (long long)lg->freed, (long long)all->allocated, (long long)all->freed);
  }
}

/* A counts-only index (plan pools) holds no tree: its counts must be the
 * pool's free blocks and bytes, counted afresh. */
static void check_counted_pool(gpumem_t* gm, const gm_pool* pool, check_ctx* c) {
  size_t blocks = 0, bytes = 0;
  for (const gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (seg->pool != pool) continue;
    for (const gm_block* b = seg->first; b; b = b->next) {
      if (b->state != GM_FREE) continue;
      blocks++;
      bytes += b->size;
    }
  }
  if (blocks != pool->index.count || bytes != pool->index.bytes)
    violation(c, "plan pool of stream 0x%lx counts %zu free blocks / %zu bytes, holds %zu / %zu",
              (unsigned long)pool->stream->handle, pool->index.count, pool->index.bytes, blocks,
              bytes);
  for (unsigned cls = 0; cls < GM_CLASS_COUNT; cls++) {
    if (pool->index.roots[cls]) {
      violation(c, "plan pool of stream 0x%lx has a sorted class",
                (unsigned long)pool->stream->handle);
      break;
    }
  }
}

size_t gpumem_check(gpumem_t* gm) {
  check_ctx c = {0};
  if (!gm) {
    gpumem_set_last_error("gpumem_check: NULL allocator");
    return 1;
  }
  gm_lock_acquire(&gm->lock);
  sums s = {0};
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    if (seg->next_seg && seg->next_seg->prev_seg != seg) violation(&c, "segment list broken");
    check_segment(gm, seg, &s, &c);
  }
  size_t indexed = 0, dirty_listed = 0;
  for (gm_stream* st = gm->streams; st; st = st->next) {
    /* an unordered borrower (streams.c, freed_to_lender) is another
     * stream of this allocator, and only under lend:ordered */
    if (st->unordered_borrower) {
      const gm_stream* u = gm->streams;
      while (u && u != st->unordered_borrower) u = u->next;
      if (!u || u == st || !gm_lends_ordered(gm))
        violation(&c, "stream 0x%lx: its unordered borrower is %s", (unsigned long)st->handle,
                  !u        ? "no stream of the allocator"
                  : u == st ? "itself"
                            : "there without lend:ordered");
    }
    for (int i = 0; i < GM_NUM_POOLS; i++) {
      gm_pool* pool = &st->pools[i];
      if (pool->source)
        violation(&c, "a pool of stream 0x%lx, not a private one, has a segment source",
                  (unsigned long)st->handle);
      if (pool->maps_pages != gm->virtual_memory)
        violation(&c, "a pool of stream 0x%lx %s pages, the allocator %s",
                  (unsigned long)st->handle, pool->maps_pages ? "maps" : "does not map",
                  gm->virtual_memory ? "does (virtual memory)" : "does not");
      c.errors += gm_index_check(&pool->index, pool);
      indexed += pool->index.count;
      if (pool->index.counts_only) check_counted_pool(gm, pool, &c);
      for (const gm_dirty_link* l = pool->dirty.next; l != &pool->dirty; l = l->next) {
        const gm_block* b = gm_dirty_block((gm_dirty_link*)l);
        if (++dirty_listed > s.dirty || l->next->prev != l || b->pool != pool) {
          violation(&c, "dirty list of stream 0x%lx broken", (unsigned long)st->handle);
          break;
        }
      }
      if (pool->dirty.next->prev != &pool->dirty)
        violation(&c, "dirty list of stream 0x%lx broken at its head", (unsigned long)st->handle);
    }
  }
  char pool_msg[256] = "";
  size_t pool_errors = gm_graph_pools_check(gm, &indexed, &dirty_listed, pool_msg, sizeof pool_msg);
  if (pool_errors) {
    violation(&c, "%s", pool_msg);
    c.errors += pool_errors - 1;
  }
  if (dirty_listed != s.dirty)
    violation(&c, "%zu blocks are marked dirty, the dirty lists hold %zu", s.dirty, dirty_listed);
  if (indexed != s.free_blocks)
    violation(&c, "%zu free blocks in segments, %zu in the index", s.free_blocks, indexed);
  if (gm->ptrs.count != (size_t)s.allocated[GPUMEM_POOL_ALL] + gm->tier_count)
    violation(&c, "pointer map holds %zu, %lld blocks allocated and %zu in the overflow tier",
              gm->ptrs.count, (long long)s.allocated[GPUMEM_POOL_ALL], gm->tier_count);
  /* (a free put off during a capture waits for one sentinel) */
  if (s.pending_refs != gm->pending_count + gm->num_capture_deferred)
    violation(&c, "%zu pending events and %zu frees put off by a capture, blocks wait for %zu",
              gm->pending_count, gm->num_capture_deferred, s.pending_refs);
  if (gm->virtual_memory) {
    check_page_records(gm, &c);
    check_aliases(gm, &s, &c);
    /* an aliased page is mapped twice and held once; plain segments (of
     * pools with a segment source) count whole */
    int64_t all =
        (int64_t)((s.mapped_pages - gm->num_aliases + gm->num_spare_pages + gm->spare_run_pages) *
                  gm->page_size) +
        s.plain_reserved;
    s.reserved[GPUMEM_POOL_ALL] = all;
    s.reserved[GPUMEM_POOL_LARGE] = all - s.reserved[GPUMEM_POOL_SMALL];
  }
  /* Blocks of the overflow tier: allocated and active like any, reserved
   * only while on device pages (overflow.c). */
  gm_tier_sums tier = {0};
  char tier_msg[256] = "";
  size_t tier_errors = gm_overflow_check(gm, &tier, tier_msg, sizeof tier_msg);
  if (tier_errors) {
    violation(&c, "%s", tier_msg);
    c.errors += tier_errors - 1;
  }
  for (int p = 0; p < GPUMEM_POOL_COUNT; p++) {
    s.allocated[p] += tier.blocks[p];
    s.active[p] += tier.blocks[p];
    s.allocated_bytes[p] += tier.bytes[p];
    s.active_bytes[p] += tier.bytes[p];
    s.requested_bytes[p] += tier.requested[p];
  }
  for (int p = 0; p < GPUMEM_POOL_COUNT; p++) s.reserved[p] += tier.device[p];
  const gpumem_stats_t* st = &gm->stats;
  compare(&c, "host_bytes", st->host_bytes, tier.host);
  compare(&c, "host_cached_bytes", st->host_cached_bytes, tier.kept);
  compare(&c, "allocation", st->allocation, s.allocated);
  compare(&c, "allocated_bytes", st->allocated_bytes, s.allocated_bytes);
  compare(&c, "active", st->active, s.active);
  compare(&c, "active_bytes", st->active_bytes, s.active_bytes);
  compare(&c, "requested_bytes", st->requested_bytes, s.requested_bytes);
  compare(&c, "inactive_split", st->inactive_split, s.split);
  compare(&c, "inactive_split_bytes", st->inactive_split_bytes, s.split_bytes);
  compare(&c, "segment", st->segment, s.segments);
  compare(&c, "reserved_bytes", st->reserved_bytes, s.reserved);
  int64_t req = st->requested_bytes[0].current, alloc = st->allocated_bytes[0].current;
  int64_t act = st->active_bytes[0].current, res = st->reserved_bytes[0].current;
  /* (host-backed tier blocks are active but hold no device memory) */
  if (!(req <= alloc && alloc <= act && act <= res + st->host_bytes[0].current)) {
    violation(&c, "requested %lld <= allocated %lld <= active %lld <= reserved %lld does not hold",
              (long long)req, (long long)alloc, (long long)act, (long long)res);
  }
  char plan_msg[256] = "";
  size_t plan_errors = gm_plan_check(gm, plan_msg, sizeof plan_msg);
  if (plan_errors) {
    violation(&c, "%s", plan_msg);
    c.errors += plan_errors - 1;
  }
  /* (live tier blocks were added to active above; retiring ones are
   * active no more, but their structs stay until the range goes) */
  size_t structs = s.free_blocks + s.shadows + (size_t)s.active[GPUMEM_POOL_ALL] +
                   (size_t)tier.pending[GPUMEM_POOL_ALL];
  if (gm->slab.live != structs) {
    violation(&c, "%zu block structs live, %zu blocks in segments and the overflow tier",
              gm->slab.live, structs);
  }
  gm_lock_release(&gm->lock);
  return c.errors;
}

/* ---- gpumem_explain: the same walk, sorting bytes instead of judging ---- */

/* Free bytes of block b (in an arena) that lie in mapped pages, split into
 * whole interior pages (reclaimable, or pinned where their mapping reaches
 * under live blocks) and partial edge pages. */
static void explain_arena_free(const gpumem_t* gm, const gm_block* b, gpumem_explain_t* out) {
  const gm_segment* seg = b->seg;
  size_t ps = gm->page_size;
  uintptr_t lo = b->addr - seg->addr, hi = lo + b->size;
  size_t first = lo / ps, last = (hi - 1) / ps;
  if (first >= seg->mapped_end) return;
  if (last >= seg->mapped_end) last = seg->mapped_end - 1;
  for (size_t p = first; p <= last; p++) {
    if (!gm_arena_page_mapped(seg, p)) continue;
    uintptr_t page_lo = p * ps, page_hi = page_lo + ps;
    uintptr_t a = lo > page_lo ? lo : page_lo, z = hi < page_hi ? hi : page_hi;
    uint64_t bytes = z - a;
    if (a == page_lo && z == page_hi)
      out->cached_reclaimable += bytes;
    else if (seg->pool->is_small)
      out->partial_pages_small += bytes;
    else
      out->partial_pages_large += bytes;
  }
  uint64_t pinned = (uint64_t)gm_arena_pinned_pages(gm, b) * ps;
  out->cached_reclaimable -= pinned;
  out->cached_pinned += pinned;
}

void gm_explain_locked(gpumem_t* gm, gpumem_explain_t* out) {
  memset(out, 0, sizeof *out);
  out->struct_size = sizeof *out;
  out->reserved = (uint64_t)gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current;
  out->spare_pages = (uint64_t)(gm->num_spare_pages + gm->spare_run_pages) * gm->page_size;
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    bool whole_free = seg->first && !seg->first->next && seg->first->state == GM_FREE;
    for (const gm_block* b = seg->first; b; b = b->next) {
      if (b->state == GM_ALLOCATED) {
        out->live_blocks++;
        out->requested += b->requested;
        out->rounding += b->size - b->requested;
      } else if (b->state == GM_PENDING) {
        out->other_streams += b->size;
      } else if (b->state == GM_SHADOW) {
        continue; /* bytes of a shared page, counted where they are used */
      } else {
        out->free_blocks++;
        if (seg->is_arena)
          explain_arena_free(gm, b, out);
        else if (whole_free)
          out->cached_reclaimable += b->size;
        else if (seg->pool->is_small)
          out->partial_pages_small += b->size;
        else
          out->partial_pages_large += b->size;
      }
    }
  }
  /* Live and pending blocks lie wholly in mapped pages (an invariant), so
   * their bytes plus the free bytes in mapped pages are the mapped memory:
   * the fields partition reserved memory. */
}

gpumem_status_t gpumem_explain(gpumem_t* gm, gpumem_explain_t* out) {
  if (!gm || !out) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_explain: NULL argument");
  gm_lock_acquire(&gm->lock);
  gm_explain_locked(gm, out);
  gm_lock_release(&gm->lock);
  return GPUMEM_OK;
}
