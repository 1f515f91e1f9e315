/* Blocks and the structures that find them: the slab that recycles block
 * structs, the free index (best fit by size then address, segregated into
 * size classes with a bitmap, one treap per class), the pointer map from
 * allocated address to block, and splitting and merging.
 *
 * Best fit must be exact (smallest size, then lowest address, as PyTorch's
 * std::set ordering gives) so that the pytorch policy reproduces PyTorch's
 * choices. Size classes keep each treap small; the bitmap skips empty
 * classes in a few word operations, so finding a block costs O(log n) in
 * the worst case and a handful of steps in practice. */
#include <stdlib.h>
#include <string.h>

#include "engine.h"

/* ---- block slab ---- */

#define GM_SLAB_CHUNK 1024

gm_block* gm_block_new(gpumem_t* gm) {
  gm_block_slab* slab = &gm->slab;
  if (GM_UNLIKELY(!slab->free_list)) {
    if (slab->num_chunks == slab->chunk_capacity) {
      size_t cap = slab->chunk_capacity ? slab->chunk_capacity * 2 : 16;
      void** chunks = realloc(slab->chunks, cap * sizeof *chunks);
      if (!chunks) return NULL;
      slab->chunks = chunks;
      slab->chunk_capacity = cap;
    }
    /* Aligned so that each block fills exactly two cache lines. */
    gm_block* chunk = aligned_alloc(64, GM_SLAB_CHUNK * sizeof *chunk);
    if (!chunk) return NULL;
    slab->chunks[slab->num_chunks++] = chunk;
    for (size_t i = 0; i < GM_SLAB_CHUNK; i++) {
      chunk[i].next = slab->free_list;
      slab->free_list = &chunk[i];
    }
  }
  gm_block* b = slab->free_list;
  slab->free_list = b->next;
  slab->live++;
  /* Field by field rather than memset (or a compound literal): the
   * compiler makes a few vector stores of it, where memset of the struct
   * became `rep stos`, whose start-up cost on the hot path (one block per
   * split) was measurable. A new field of gm_block must be cleared here. */
  b->addr = 0;
  b->size = 0;
  b->left = b->right = b->prev = b->next = NULL;
  b->seg = NULL;
  b->prio = 0;
  b->cls = 0;
  b->state = GM_FREE;
  b->lent = 0;
  b->num_uses = 0;
  b->pool = NULL;
  b->requested = 0;
  b->seq = 0;
  gm_dirty_init(&b->dirty);
  b->extra_uses = NULL;
  b->inline_uses[0] = 0;
  b->pending_events = 0;
  b->extra_capacity = 0;
  b->aliased = 0;
  b->handed = 0;
  return b;
}

bool gm_block_reserve(gpumem_t* gm, int n) {
  gm_block* got[8];
  int k = 0;
  while (k < n && k < 8 && (got[k] = gm_block_new(gm)) != NULL) k++;
  bool ok = k == n;
  while (k > 0) gm_block_delete(gm, got[--k]);
  return ok;
}

void gm_block_delete(gpumem_t* gm, gm_block* b) {
  free(b->extra_uses);
  b->extra_uses = NULL;
  b->next = gm->slab.free_list;
  gm->slab.free_list = b;
  gm->slab.live--;
}

void gm_slab_destroy(gm_block_slab* slab) {
  for (size_t i = 0; i < slab->num_chunks; i++) {
    /* Blocks still holding use arrays were freed by their owners already;
     * the chunks themselves go here. */
    free(slab->chunks[i]);
  }
  free(slab->chunks);
  memset(slab, 0, sizeof *slab);
}

/* ---- free index ---- */

/* Without a branch (it mispredicted on mixed sizes): below 2^SUB_BITS
 * units, log is SUB_BITS and the class is the units themselves; above,
 * units >> (log - SUB_BITS) is the leading bit and the next SUB_BITS bits,
 * that is 2^SUB_BITS plus the sub-class. */
static inline unsigned size_class(size_t size) {
  const unsigned sub_bits = GM_CLASS_SUB_BITS;
  size_t units = size / GM_MIN_BLOCK;
  unsigned log =
      63u - (unsigned)__builtin_clzll((unsigned long long)(units | ((size_t)1 << sub_bits)));
  return ((log - sub_bits) << sub_bits) + (unsigned)(units >> (log - sub_bits));
}
/* The largest size, 2^64 - 1 bytes, is below 2^55 units: log <= 54. */
_Static_assert(((54u - GM_CLASS_SUB_BITS) << GM_CLASS_SUB_BITS) + (2u << GM_CLASS_SUB_BITS) - 1 <
                   GM_CLASS_COUNT,
               "size classes must cover every size");
_Static_assert(GM_CLASS_COUNT <= UINT16_MAX + 1, "a block keeps its class in 16 bits");

static inline bool block_less(const gm_block* a, const gm_block* b) {
  return a->size < b->size || (a->size == b->size && a->addr < b->addr);
}

/* Sixteen bits are plenty for a treap (ties are allowed; they only make
 * it a little less balanced) and leave room for the class in the block's
 * first cache line. */
static inline uint16_t addr_priority(uintptr_t addr) {
  uint64_t h = (uint64_t)addr * 0x9E3779B97F4A7C15ull;
  return (uint16_t)(h >> 48);
}

/* Splits treap t into keys < key and keys > key (key itself is absent). */
static void treap_split(gm_block* t, const gm_block* key, gm_block** lo, gm_block** hi) {
  while (t) {
    if (block_less(t, key)) {
      *lo = t;
      lo = &t->right;
      t = t->right;
    } else {
      *hi = t;
      hi = &t->left;
      t = t->left;
    }
  }
  *lo = NULL;
  *hi = NULL;
}

/* Joins two treaps whose keys are all ordered a < b. */
static gm_block* treap_join(gm_block* a, gm_block* b) {
  gm_block* root = NULL;
  gm_block** link = &root;
  while (a && b) {
    if (a->prio >= b->prio) {
      *link = a;
      link = &a->right;
      a = a->right;
    } else {
      *link = b;
      link = &b->left;
      b = b->left;
    }
  }
  *link = a ? a : b;
  return root;
}

void gm_index_insert(gm_free_index* ix, gm_block* b) {
  ix->count++;
  ix->bytes += b->size;
  if (ix->counts_only) return;
  unsigned cls = size_class(b->size);
  b->cls = (uint16_t)cls;
  b->prio = addr_priority(b->addr);
  gm_block** link = &ix->roots[cls];
  while (*link && (*link)->prio >= b->prio)
    link = block_less(b, *link) ? &(*link)->left : &(*link)->right;
  treap_split(*link, b, &b->left, &b->right);
  *link = b;
  ix->nonempty[cls / 64] |= 1ull << (cls % 64);
}

void gm_index_remove(gm_free_index* ix, gm_block* b) {
  ix->count--;
  ix->bytes -= b->size;
  if (ix->counts_only) return;
  unsigned cls = b->cls;
  gm_block** link = &ix->roots[cls];
  while (*link != b) link = block_less(b, *link) ? &(*link)->left : &(*link)->right;
  *link = treap_join(b->left, b->right);
  b->left = b->right = NULL;
  if (!ix->roots[cls]) ix->nonempty[cls / 64] &= ~(1ull << (cls % 64));
}

static gm_block* treap_min(gm_block* t) {
  while (t && t->left) t = t->left;
  return t;
}

static gm_block* treap_max(gm_block* t) {
  while (t && t->right) t = t->right;
  return t;
}

/* First class >= cls with a block, or GM_CLASS_COUNT. */
static unsigned next_nonempty(const gm_free_index* ix, unsigned cls) {
  unsigned word = cls / 64;
  uint64_t bits = ix->nonempty[word] & (~0ull << (cls % 64));
  while (!bits) {
    if (++word >= GM_CLASS_WORDS) return GM_CLASS_COUNT;
    bits = ix->nonempty[word];
  }
  return word * 64 + (unsigned)__builtin_ctzll(bits);
}

gm_block* gm_index_find(const gm_free_index* ix, size_t size) {
  unsigned cls = size_class(size);
  if (ix->nonempty[cls / 64] & (1ull << (cls % 64))) {
    /* lower bound of (size, 0) inside the class */
    gm_block* best = NULL;
    for (gm_block* t = ix->roots[cls]; t;) {
      if (t->size >= size) {
        best = t;
        t = t->left;
      } else {
        t = t->right;
      }
    }
    if (best) return best;
  }
  unsigned next = next_nonempty(ix, cls + 1);
  return next < GM_CLASS_COUNT ? treap_min(ix->roots[next]) : NULL;
}

gm_block* gm_index_next(const gm_free_index* ix, const gm_block* b) {
  unsigned cls = size_class(b->size);
  gm_block* best = NULL;
  for (gm_block* t = ix->roots[cls]; t;) {
    if (block_less(b, t)) {
      best = t;
      t = t->left;
    } else {
      t = t->right;
    }
  }
  if (best) return best;
  unsigned next = next_nonempty(ix, cls + 1);
  return next < GM_CLASS_COUNT ? treap_min(ix->roots[next]) : NULL;
}

gm_block* gm_index_largest(const gm_free_index* ix) {
  for (unsigned w = GM_CLASS_WORDS; w-- > 0;) {
    if (ix->nonempty[w]) {
      unsigned cls = w * 64 + 63u - (unsigned)__builtin_clzll(ix->nonempty[w]);
      return treap_max(ix->roots[cls]);
    }
  }
  return NULL;
}

static void treap_visit(gm_block* t, gm_block_visit_fn fn, void* arg) {
  while (t) {
    gm_block* right = t->right;
    treap_visit(t->left, fn, arg);
    fn(t, arg); /* may remove t: its children were read first */
    t = right;
  }
}

void gm_index_visit(const gm_free_index* ix, gm_block_visit_fn fn, void* arg) {
  for (unsigned cls = 0; cls < GM_CLASS_COUNT; cls++) {
    if (ix->roots[cls]) treap_visit(ix->roots[cls], fn, arg);
  }
}

typedef struct index_check_state {
  const gm_pool* pool;
  unsigned cls;
  size_t count;
  size_t bytes;
  size_t errors;
} index_check_state;

static void check_treap(gm_block* t, const gm_block* lo, const gm_block* hi,
                        index_check_state* st) {
  if (!t) return;
  if ((lo && !block_less(lo, t)) || (hi && !block_less(t, hi))) {
    if (!st->errors)
      gpumem_set_last_error("check: free index out of order at block 0x%lx",
                            (unsigned long)t->addr);
    st->errors++;
  }
  if ((t->left && t->left->prio > t->prio) || (t->right && t->right->prio > t->prio)) {
    if (!st->errors)
      gpumem_set_last_error("check: treap heap order broken at 0x%lx", (unsigned long)t->addr);
    st->errors++;
  }
  if (t->state != GM_FREE || t->pool != st->pool || size_class(t->size) != st->cls ||
      t->cls != st->cls) {
    if (!st->errors)
      gpumem_set_last_error("check: indexed block 0x%lx is not free, or in the wrong pool or class",
                            (unsigned long)t->addr);
    st->errors++;
  }
  st->count++;
  st->bytes += t->size;
  check_treap(t->left, lo, t, st);
  check_treap(t->right, t, hi, st);
}

size_t gm_index_check(const gm_free_index* ix, const gm_pool* pool) {
  index_check_state st = {pool, 0, 0, 0, 0};
  for (unsigned cls = 0; cls < GM_CLASS_COUNT; cls++) {
    bool bit = (ix->nonempty[cls / 64] >> (cls % 64)) & 1u;
    if (bit != (ix->roots[cls] != NULL)) {
      if (!st.errors) gpumem_set_last_error("check: class bitmap disagrees with class %u", cls);
      st.errors++;
    }
    st.cls = cls;
    check_treap(ix->roots[cls], NULL, NULL, &st);
  }
  /* A counts-only index holds no tree; gpumem_check compares its counts
   * with the pool's free blocks. */
  if (!ix->counts_only && (st.count != ix->count || st.bytes != ix->bytes)) {
    if (!st.errors)
      gpumem_set_last_error("check: free index counts %zu blocks/%zu bytes, holds %zu/%zu",
                            ix->count, ix->bytes, st.count, st.bytes);
    st.errors++;
  }
  return st.errors;
}

/* ---- pointer map ---- */

static inline size_t ptr_hash(uintptr_t addr, size_t mask) {
  return (size_t)(((uint64_t)addr * 0x9E3779B97F4A7C15ull) >> 20) & mask;
}

gpumem_status_t gm_ptr_map_init(gm_ptr_map* m) {
  m->mask = 1023;
  m->count = 0;
  m->slots = calloc(m->mask + 1, sizeof *m->slots);
  return m->slots
             ? GPUMEM_OK
             : gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory for the pointer map");
}

void gm_ptr_map_destroy(gm_ptr_map* m) {
  free(m->slots);
  m->slots = NULL;
}

static void ptr_map_put(gm_block** slots, size_t mask, gm_block* b) {
  size_t i = ptr_hash(b->addr, mask);
  while (slots[i]) i = (i + 1) & mask;
  slots[i] = b;
}

gpumem_status_t gm_ptr_map_insert(gm_ptr_map* m, gm_block* b) {
  if (GM_UNLIKELY((m->count + 1) * 4 > m->mask + 1)) {
    size_t new_mask = m->mask * 2 + 1;
    gm_block** slots = calloc(new_mask + 1, sizeof *slots);
    if (!slots)
      return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory growing the pointer map");
    for (size_t i = 0; i <= m->mask; i++) {
      if (m->slots[i]) ptr_map_put(slots, new_mask, m->slots[i]);
    }
    free(m->slots);
    m->slots = slots;
    m->mask = new_mask;
  }
  ptr_map_put(m->slots, m->mask, b);
  m->count++;
  return GPUMEM_OK;
}

gm_block* gm_ptr_map_find(const gm_ptr_map* m, uintptr_t addr) {
  for (size_t i = ptr_hash(addr, m->mask);; i = (i + 1) & m->mask) {
    gm_block* b = m->slots[i];
    if (!b || b->addr == addr) return b;
  }
}

gm_block* gm_ptr_map_remove(gm_ptr_map* m, uintptr_t addr) {
  size_t mask = m->mask;
  size_t i = ptr_hash(addr, mask);
  for (;; i = (i + 1) & mask) {
    if (!m->slots[i]) return NULL;
    if (m->slots[i]->addr == addr) break;
  }
  gm_block* found = m->slots[i];
  /* Backward-shift deletion keeps probe sequences intact without tombstones. */
  for (size_t j = i;;) {
    j = (j + 1) & mask;
    gm_block* b = m->slots[j];
    if (!b) break;
    size_t home = ptr_hash(b->addr, mask);
    bool movable = (j > i) ? (home <= i || home > j) : (home <= i && home > j);
    if (movable) {
      m->slots[i] = b;
      i = j;
    }
  }
  m->slots[i] = NULL;
  m->count--;
  return found;
}

/* ---- split and merge ---- */

static void absorb_neighbour(gpumem_t* gm, gm_block* b, gm_block* n, int64_t* split_count,
                             int64_t* split_bytes) {
  gm_pool* pool = b->pool;
  gm_index_remove(&pool->index, n);
  gm_dirty_remove(n);
  *split_count -= 1;
  *split_bytes -= (int64_t)n->size;
  if (n == b->prev) {
    if (b->seg->first == n) b->seg->first = b;
    b->addr = n->addr;
    b->prev = n->prev;
    if (b->prev) b->prev->next = b;
  } else {
    b->next = n->next;
    if (b->next) b->next->prev = b;
  }
  b->size += n->size;
  gm_block_delete(gm, n);
}

/* b (allocated, pending or a shadow) becomes free, merged with its free
 * neighbours, indexed; returns the merged block. Inlined into the free
 * path: as an out-of-line function it cost ~12 instructions per operation. */
static inline __attribute__((always_inline)) gm_block* release_block(gpumem_t* gm, gm_block* b,
                                                                     bool small) {
  int64_t split_count = 0, split_bytes = 0;
  if (b->seg->is_arena) gm_arena_busy(gm, b, -1);
  b->state = GM_FREE;
  if (b->prev && b->prev->state == GM_FREE)
    absorb_neighbour(gm, b, b->prev, &split_count, &split_bytes);
  if (b->next && b->next->state == GM_FREE)
    absorb_neighbour(gm, b, b->next, &split_count, &split_bytes);
  gm_index_insert(&b->pool->index, b);
  if (gm_block_is_split(b)) {
    split_count += 1;
    split_bytes += (int64_t)b->size;
  }
  /* Arenas are never released whole, so "non-releasable" split blocks mean
   * nothing there (PyTorch skips them for expandable segments too). */
  if (!b->seg->is_arena) {
    gm_stat_pool_add(gm, gm->stats.inactive_split, small, split_count);
    gm_stat_pool_add(gm, gm->stats.inactive_split_bytes, small, split_bytes);
  }
  if (b->seg->is_arena && b->size >= gm->page_size) gm_dirty_add(b->pool, b);
  return b;
}

/* A live block goes back to the cache, whether the caller freed it or a
 * failed allocation never handed it out. */
static gm_block* free_live_block(gpumem_t* gm, gm_block* b) {
  bool small = gm_block_stat_small(b); /* before merging: the live block's size */
  size_t original_size = b->size;
  if (GM_UNLIKELY(b->aliased)) gm_alias_release(gm, b);
  b->lent = 0;
  b = release_block(gm, b, small);
  gm_stat_pool_shrink(gm->stats.active, small, 1);
  gm_stat_pool_shrink(gm->stats.active_bytes, small, (int64_t)original_size);
  return b;
}

gm_block* gm_free_block(gpumem_t* gm, gm_block* b) {
  gm_history_add_block(gm, GM_HISTORY_FREE_COMPLETED, b);
  return free_live_block(gm, b);
}

gm_block* gm_free_shadow(gpumem_t* gm, gm_block* b) {
  return release_block(gm, b, gm_block_stat_small(b));
}

gm_block* gm_free_unused(gpumem_t* gm, gm_block* b) {
  bool small = gm_block_stat_small(b);
  gm_stat_pool_grow(gm->stats.active, small, 1);
  gm_stat_pool_grow(gm->stats.active_bytes, small, (int64_t)b->size);
  return free_live_block(gm, b);
}

/* Splits the free block f (out of the index) at front bytes: the front
 * stays free and goes back to the index (and the dirty list), the rest is
 * returned, out of both, for the caller to place. NULL, with f untouched
 * and still out of the index, when no block struct could be had. */
gm_block* gm_split_free_front(gpumem_t* gm, gm_block* f, size_t front) {
  gm_pool* pool = f->pool;
  gm_split_block(gm, f, front, true);
  if (f->size != front) return NULL;
  gm_index_insert(&pool->index, f);
  if (!f->seg->is_arena) {
    /* (the split counted f out as if it were taken; it stays free) */
    gm_stat_pool_add(gm, gm->stats.inactive_split, pool->is_small, 1);
    gm_stat_pool_add(gm, gm->stats.inactive_split_bytes, pool->is_small, (int64_t)f->size);
  }
  if (f->seg->is_arena && f->size >= gm->page_size) gm_dirty_add(pool, f);
  gm_block* rest = f->next;
  gm_index_remove(&pool->index, rest);
  gm_dirty_remove(rest);
  return rest;
}

void gm_split_block(gpumem_t* gm, gm_block* b, size_t size, bool split) {
  bool small = b->pool->is_small;
  bool was_split = gm_block_is_split(b) && !b->seg->is_arena;
  if (was_split) {
    gm_stat_pool_add(gm, gm->stats.inactive_split, small, -1);
    gm_stat_pool_add(gm, gm->stats.inactive_split_bytes, small, -(int64_t)b->size);
  }
  if (split) {
    gm_block* rest = gm_block_new(gm);
    if (rest) {
      rest->addr = b->addr + size;
      rest->size = b->size - size;
      rest->seg = b->seg;
      rest->pool = b->pool;
      rest->state = GM_FREE;
      rest->prev = b;
      rest->next = b->next;
      if (b->next) b->next->prev = rest;
      b->next = rest;
      b->size = size;
      gm_index_insert(&b->pool->index, rest);
      if (!rest->seg->is_arena) {
        gm_stat_pool_add(gm, gm->stats.inactive_split, small, 1);
        gm_stat_pool_add(gm, gm->stats.inactive_split_bytes, small, (int64_t)rest->size);
      }
      if (rest->seg->is_arena && rest->size >= gm->page_size) gm_dirty_add(rest->pool, rest);
    }
    /* Without a block struct the whole block is handed out: correct, merely
     * less economical, and only under host memory exhaustion. */
  }
}
