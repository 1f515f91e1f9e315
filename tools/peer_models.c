/* The peer allocator models (peer_models.h).
 *
 * Expandable segments, as PyTorch's CUDACachingAllocator does them with
 * expandable_segments:True (rules read from its source, implemented here):
 * - requests round up to 512 bytes; up to 1 MiB they go to the small pool,
 *   above to the large one; each pool of each stream has one segment, a
 *   virtual range that physical memory is mapped into in pages of 2 MiB
 *   (small pool) or 20 MiB (large pool);
 * - an allocation takes the best-fitting free mapped block of its pool and
 *   stream and splits off any remainder of 512 bytes or more. Best fit
 *   starts at the smallest block that holds the request (lowest address on
 *   ties) and moves on to the next larger one while that one's expandable
 *   size is smaller, where a block's expandable size is its own plus that
 *   of the unmapped range right after it: the free block at the top of the
 *   mapped part of a segment counts as nearly the whole segment, so it is
 *   taken only when no block beyond it in size order stops the walk. With
 *   no block, it maps pages at the lowest unmapped address of the segment,
 *   joined with the free mapped block just before it when there is one,
 *   and allocates from there;
 * - a free merges with free neighbours; nothing is unmapped while the job
 *   runs. Under a memory fraction the growth is refused when reserved
 *   bytes plus the request's segment size (2 MiB, 20 MiB below 10 MiB, else
 *   the request rounded to 2 MiB: the same test as without expandable
 *   segments) would exceed it; then every whole page under a free block is
 *   unmapped (release_cached_blocks) and the growth is tried once more.
 * record_stream is not modelled: a replay runs no kernels, so the events a
 * deferred free waits for have completed by the next allocation.
 *
 * cudaMallocAsync (undocumented inside; what is modelled is observable):
 * one pool for the device whose physical memory, in 2 MiB pages, is never
 * returned while the release threshold is "never"; allocations are carved
 * best fit from the pool's range in 512-byte units, freed ranges merge and
 * are reused at once (a replay has no kernels for the stream order to wait
 * on); the range grows at its top, mapping pages as it goes. A limit is the
 * pool's maxSize: growth past it fails, nothing is moved. */
#include "peer_models.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define KIB 1024ULL
#define MIB (1024ULL * 1024ULL)
#define ROUND 512ULL
#define SMALL_MAX MIB
#define SMALL_PAGE (2 * MIB)
#define LARGE_PAGE (20 * MIB)
#define ASYNC_PAGE (2 * MIB)
#define SEGMENT_VA (1ULL << 42) /* virtual range of one expandable segment */
#define NIL UINT32_MAX

typedef struct block {
  uint64_t addr, size;
  uint32_t prev, next; /* address neighbours within the segment */
  uint32_t pool;
  uint32_t slot; /* index in its pool's free or unmapped list, NIL if in neither */
  uint8_t allocated, mapped;
} block_t;

typedef struct idlist {
  uint32_t* ids;
  size_t len, cap;
} idlist_t;

typedef struct pool {
  uint64_t page;
  int has_segment;
  idlist_t free_blocks; /* free and mapped */
  idlist_t unmapped;
} pool_t;

typedef struct sim {
  peer_model_t model;
  block_t* blocks;
  size_t num_blocks, cap_blocks;
  uint32_t* spare; /* block slots to reuse */
  size_t num_spare, cap_spare;
  pool_t* pools;
  size_t num_pools;
  uint64_t* pool_stream; /* pool p serves stream pool_stream[p / 2] */
  size_t num_streams, cap_streams;
  uint64_t reserved, peak, limit;
  uint64_t next_segment;
  uint64_t async_top;    /* async: end of the range carved so far */
  uint32_t async_last;   /* async: the block ending at async_top */
  uint64_t maps, unmaps; /* counts of map and unmap operations */
  uint64_t pages_mapped; /* expandable: pages mapped, each its own physical allocation */
  int no_memory;
} sim_t;

static int grow(void** arr, size_t* cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t n = *cap ? *cap * 2 : 256;
  while (n < need) n *= 2;
  void* b = realloc(*arr, n * elem);
  if (!b) return -1;
  *arr = b;
  *cap = n;
  return 0;
}

static uint32_t new_block(sim_t* s, uint64_t addr, uint64_t size, uint32_t pool) {
  uint32_t id;
  if (s->num_spare) {
    id = s->spare[--s->num_spare];
  } else {
    if (grow((void**)&s->blocks, &s->cap_blocks, s->num_blocks + 1, sizeof *s->blocks) != 0) {
      s->no_memory = 1;
      return NIL;
    }
    id = (uint32_t)s->num_blocks++;
  }
  block_t* b = &s->blocks[id];
  memset(b, 0, sizeof *b);
  b->addr = addr;
  b->size = size;
  b->prev = b->next = NIL;
  b->pool = pool;
  b->slot = NIL;
  return id;
}

static void drop_block(sim_t* s, uint32_t id) {
  if (grow((void**)&s->spare, &s->cap_spare, s->num_spare + 1, sizeof *s->spare) != 0) {
    s->no_memory = 1;
    return;
  }
  s->spare[s->num_spare++] = id;
}

static idlist_t* list_of(sim_t* s, uint32_t id) {
  block_t* b = &s->blocks[id];
  pool_t* p = &s->pools[b->pool];
  return b->mapped ? &p->free_blocks : &p->unmapped;
}

/* Puts a free block into its pool's free (mapped) or unmapped list. */
static void list_add(sim_t* s, uint32_t id) {
  idlist_t* l = list_of(s, id);
  if (grow((void**)&l->ids, &l->cap, l->len + 1, sizeof *l->ids) != 0) {
    s->no_memory = 1;
    return;
  }
  s->blocks[id].slot = (uint32_t)l->len;
  l->ids[l->len++] = id;
}

static void list_remove(sim_t* s, uint32_t id) {
  block_t* b = &s->blocks[id];
  if (b->slot == NIL) return;
  idlist_t* l = list_of(s, id);
  uint32_t last = l->ids[--l->len];
  if (last != id) {
    l->ids[b->slot] = last;
    s->blocks[last].slot = b->slot;
  }
  b->slot = NIL;
}

/* Splits block id at offset: the tail becomes a new block of the same
 * state (not listed). Returns the tail. */
static uint32_t split(sim_t* s, uint32_t id, uint64_t offset) {
  block_t b = s->blocks[id];
  uint32_t t = new_block(s, b.addr + offset, b.size - offset, b.pool);
  if (t == NIL) return NIL;
  block_t* head = &s->blocks[id];
  block_t* tail = &s->blocks[t];
  tail->mapped = head->mapped;
  tail->prev = id;
  tail->next = head->next;
  if (head->next != NIL) s->blocks[head->next].prev = t;
  head->next = t;
  head->size = offset;
  return t;
}

/* Merges free block src into free block dst when both are free and both
 * mapped or both unmapped; src must be dst's neighbour. Lists updated. */
static void try_merge(sim_t* s, uint32_t dst, uint32_t src) {
  if (src == NIL) return;
  block_t* d = &s->blocks[dst];
  block_t* c = &s->blocks[src];
  if (c->allocated || c->mapped != d->mapped) return;
  list_remove(s, src);
  if (d->prev == src) {
    d->addr = c->addr;
    d->prev = c->prev;
    if (c->prev != NIL) s->blocks[c->prev].next = dst;
  } else {
    d->next = c->next;
    if (c->next != NIL) s->blocks[c->next].prev = dst;
  }
  d->size += c->size;
  drop_block(s, src);
}

static uint64_t round_up(uint64_t v, uint64_t to) {
  return (v + to - 1) / to * to;
}

static uint32_t pool_for(sim_t* s, uintptr_t stream, int small) {
  size_t k = 0;
  while (k < s->num_streams && s->pool_stream[k] != (uint64_t)stream) k++;
  if (k == s->num_streams) {
    if (grow((void**)&s->pool_stream, &s->cap_streams, s->num_streams + 1,
             sizeof *s->pool_stream) != 0) {
      s->no_memory = 1;
      return 0;
    }
    pool_t* p = realloc(s->pools, (s->num_pools + 2) * sizeof *p);
    if (!p) {
      s->no_memory = 1;
      return 0;
    }
    s->pools = p;
    memset(&s->pools[s->num_pools], 0, 2 * sizeof *p);
    s->pools[s->num_pools].page = LARGE_PAGE;
    s->pools[s->num_pools + 1].page = SMALL_PAGE;
    s->num_pools += 2;
    s->pool_stream[s->num_streams++] = (uint64_t)stream;
  }
  return (uint32_t)(2 * k + (small ? 1 : 0));
}

/* ---- expandable segments ---------------------------------------------- */

/* Maps the first `size` bytes (rounded up to pages) of unmapped block id;
 * the rest stays unmapped. Returns the mapped block (merged with free
 * mapped neighbours) or NIL. */
static uint32_t map_block(sim_t* s, uint32_t id, uint64_t size) {
  pool_t* p = &s->pools[s->blocks[id].pool];
  uint64_t bytes = round_up(size, p->page);
  if (bytes > s->blocks[id].size) bytes = s->blocks[id].size;
  list_remove(s, id);
  if (bytes < s->blocks[id].size) {
    uint32_t rest = split(s, id, bytes);
    if (rest == NIL) return NIL;
    list_add(s, rest);
  }
  s->blocks[id].mapped = 1;
  s->reserved += bytes;
  if (s->reserved > s->peak) s->peak = s->reserved;
  s->maps++;
  s->pages_mapped += bytes / p->page;
  try_merge(s, id, s->blocks[id].prev);
  try_merge(s, id, s->blocks[id].next);
  list_add(s, id);
  return id;
}

static int allocatable(const sim_t* s, uint32_t id) {
  return id != NIL && !s->blocks[id].allocated;
}

/* A free mapped block of at least size made by mapping more of the pool's
 * segment (find_expandable_block + try_allocate_expandable_block), or NIL. */
static uint32_t expand(sim_t* s, uint32_t pool, uint64_t size) {
  pool_t* p = &s->pools[pool];
  if (!p->has_segment) {
    uint32_t seg = new_block(s, s->next_segment, SEGMENT_VA, pool);
    if (seg == NIL) return NIL;
    s->next_segment += 2 * SEGMENT_VA;
    p->has_segment = 1;
    list_add(s, seg);
  }
  /* lowest unmapped address first, starting at a free mapped block just
   * before it when there is one */
  uint32_t candidate = NIL;
  uint64_t best_addr = UINT64_MAX;
  for (size_t k = 0; k < p->unmapped.len; k++) {
    uint32_t u = p->unmapped.ids[k];
    if (s->blocks[u].addr >= best_addr) continue;
    uint32_t c = allocatable(s, s->blocks[u].prev) ? s->blocks[u].prev : u;
    uint64_t bytes = 0;
    for (uint32_t b = c; bytes < size && allocatable(s, b); b = s->blocks[b].next)
      bytes += s->blocks[b].size;
    if (bytes >= size) {
      candidate = c;
      best_addr = s->blocks[u].addr;
    }
  }
  if (candidate == NIL) return NIL; /* the segment's range is used up: never here */
  if (!s->blocks[candidate].mapped) {
    candidate = map_block(s, candidate, size);
    if (candidate == NIL) return NIL;
  }
  while (s->blocks[candidate].size < size) {
    uint32_t next = s->blocks[candidate].next;
    uint64_t want = size - s->blocks[candidate].size;
    if (next == NIL || s->blocks[next].mapped) return NIL;
    /* the mapped pages merge with candidate into one block: next's */
    candidate = map_block(s, next, want < s->blocks[next].size ? want : s->blocks[next].size);
    if (candidate == NIL) return NIL;
  }
  return candidate;
}

/* release_cached_blocks: unmaps every whole page under a free block. */
static void release_cached(sim_t* s) {
  for (uint32_t pool = 0; pool < s->num_pools; pool++) {
    pool_t* p = &s->pools[pool];
    /* take the list: blocks move between lists while we go */
    size_t n = p->free_blocks.len;
    uint32_t* ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
      s->no_memory = 1;
      return;
    }
    if (n) memcpy(ids, p->free_blocks.ids, n * sizeof *ids); /* the list has no array while empty */
    for (size_t k = 0; k < n; k++) {
      uint32_t id = ids[k];
      block_t* b = &s->blocks[id];
      uint64_t lo = round_up(b->addr, p->page);
      uint64_t hi = (b->addr + b->size) / p->page * p->page;
      if (hi <= lo) continue;
      list_remove(s, id);
      if (lo > b->addr) {
        uint32_t mid = split(s, id, lo - b->addr);
        if (mid == NIL) break;
        list_add(s, id); /* the head stays free and mapped */
        id = mid;
      }
      if (hi < s->blocks[id].addr + s->blocks[id].size) {
        uint32_t tail = split(s, id, hi - s->blocks[id].addr);
        if (tail == NIL) break;
        list_add(s, tail);
      }
      s->blocks[id].mapped = 0;
      s->reserved -= hi - lo;
      s->unmaps++;
      try_merge(s, id, s->blocks[id].prev);
      try_merge(s, id, s->blocks[id].next);
      list_add(s, id);
    }
    free(ids);
  }
}

/* The smallest free block of pool that holds size bytes, lowest address
 * on ties (both models' best fit), or NIL. */
static uint32_t best_fit(const sim_t* s, uint32_t pool, uint64_t size) {
  const pool_t* p = &s->pools[pool];
  uint32_t best = NIL;
  for (size_t k = 0; k < p->free_blocks.len; k++) {
    uint32_t id = p->free_blocks.ids[k];
    const block_t* b = &s->blocks[id];
    if (b->size < size) continue;
    if (best == NIL || b->size < s->blocks[best].size ||
        (b->size == s->blocks[best].size && b->addr < s->blocks[best].addr))
      best = id;
  }
  return best;
}

/* Whether block a comes before block b in size order (size, then address). */
static int size_order_before(const block_t* a, const block_t* b) {
  return a->size < b->size || (a->size == b->size && a->addr < b->addr);
}

/* A free block's size plus the unmapped range just after it: what it can
 * grow to without moving. */
static uint64_t expandable_size(const sim_t* s, uint32_t id) {
  uint32_t next = s->blocks[id].next;
  return s->blocks[id].size + (next != NIL && !s->blocks[next].mapped ? s->blocks[next].size : 0);
}

/* Best fit as PyTorch's allocator does it with expandable segments (see
 * the top of this file): from the smallest free block of pool that holds
 * size, on to the next in size order while its expandable size is smaller.
 * NIL when no block holds size. */
static uint32_t expandable_best_fit(const sim_t* s, uint32_t pool, uint64_t size) {
  const pool_t* p = &s->pools[pool];
  uint32_t at = best_fit(s, pool, size);
  while (at != NIL) {
    uint32_t next = NIL; /* at's successor in size order */
    for (size_t k = 0; k < p->free_blocks.len; k++) {
      uint32_t id = p->free_blocks.ids[k];
      if (size_order_before(&s->blocks[at], &s->blocks[id]) &&
          (next == NIL || size_order_before(&s->blocks[id], &s->blocks[next])))
        next = id;
    }
    if (next == NIL || expandable_size(s, next) >= expandable_size(s, at)) break;
    at = next;
  }
  return at;
}

/* The block for one allocation of rounded size on pool, or NIL (out of
 * memory under the limit). */
static uint32_t expandable_alloc(sim_t* s, uint32_t pool, uint64_t size, uint64_t alloc_size) {
  uint32_t best = expandable_best_fit(s, pool, size);
  if (best == NIL) {
    for (int attempt = 0; attempt < 2 && best == NIL; attempt++) {
      if (attempt == 1) release_cached(s);
      if (s->limit && s->reserved + alloc_size > s->limit) continue;
      best = expand(s, pool, size);
    }
    if (best == NIL) return NIL;
  }
  list_remove(s, best);
  if (s->blocks[best].size - size >= ROUND) {
    uint32_t rest = split(s, best, size);
    if (rest == NIL) return NIL;
    list_add(s, rest);
  }
  s->blocks[best].allocated = 1;
  return best;
}

static void expandable_free(sim_t* s, uint32_t id) {
  s->blocks[id].allocated = 0;
  try_merge(s, id, s->blocks[id].prev);
  try_merge(s, id, s->blocks[id].next);
  list_add(s, id);
}

/* ---- cudaMallocAsync ---------------------------------------------------- */

static uint32_t async_alloc(sim_t* s, uint64_t size) {
  uint32_t best = best_fit(s, 0, size);
  if (best == NIL) {
    /* grow at the top, joining a free block that ends there */
    uint64_t start = s->async_top;
    uint32_t last = s->async_last;
    if (last != NIL && !s->blocks[last].allocated) start = s->blocks[last].addr;
    uint64_t top = start + size;
    uint64_t need = round_up(top, ASYNC_PAGE);
    if (need > s->reserved) {
      if (s->limit && need > s->limit) return NIL;
      s->maps++;
      s->reserved = need;
      if (s->reserved > s->peak) s->peak = s->reserved;
    }
    if (last != NIL && !s->blocks[last].allocated) {
      best = last;
      list_remove(s, best);
      s->blocks[best].size = top - start;
    } else {
      best = new_block(s, start, size, 0);
      if (best == NIL) return NIL;
      s->blocks[best].mapped = 1;
      s->blocks[best].prev = last;
      if (last != NIL) s->blocks[last].next = best;
    }
    s->async_top = top;
    s->async_last = best;
  } else {
    list_remove(s, best);
    if (s->blocks[best].size > size) {
      uint32_t rest = split(s, best, size);
      if (rest == NIL) return NIL;
      if (s->async_last == best) s->async_last = rest;
      list_add(s, rest);
    }
  }
  s->blocks[best].allocated = 1;
  return best;
}

static void async_free(sim_t* s, uint32_t id) {
  s->blocks[id].allocated = 0;
  uint32_t next = s->blocks[id].next;
  if (next != NIL && !s->blocks[next].allocated) {
    if (s->async_last == next) s->async_last = id;
    try_merge(s, id, next);
  }
  uint32_t prev = s->blocks[id].prev;
  if (prev != NIL && !s->blocks[prev].allocated) {
    if (s->async_last == id) s->async_last = prev;
    list_remove(s, prev);
    try_merge(s, prev, id);
    id = prev;
  }
  list_add(s, id);
}

/* ---- the replay --------------------------------------------------------- */

gpumem_status_t peer_run(const trace_t* trace, peer_model_t model, uint64_t limit, int one_stream,
                         peer_result_t* result) {
  memset(result, 0, sizeof *result);
  sim_t s;
  memset(&s, 0, sizeof s);
  s.model = model;
  s.limit = limit;
  s.async_last = NIL;
  s.next_segment = SEGMENT_VA;
  uint32_t* slot = malloc((trace->num_allocs ? trace->num_allocs : 1) * sizeof *slot);
  if (!slot) return GPUMEM_ERR_HOST_MEMORY;
  if (model == PEER_ASYNC) pool_for(&s, 0, 0);
  for (size_t i = 0; i < trace->num_events && !s.no_memory; i++) {
    const trace_event_t* e = &trace->events[i];
    if (e->op == TRACE_ALLOC) {
      uint64_t size = e->size < ROUND ? ROUND : round_up(e->size, ROUND);
      uint32_t b;
      if (model == PEER_ASYNC) {
        b = async_alloc(&s, size);
      } else {
        int small = size <= SMALL_MAX;
        uint64_t alloc_size = small             ? SMALL_PAGE
                              : size < 10 * MIB ? LARGE_PAGE
                                                : round_up(size, SMALL_PAGE);
        b = expandable_alloc(&s, pool_for(&s, one_stream ? 0 : e->stream, small), size, alloc_size);
      }
      if (s.no_memory) break;
      if (b == NIL) {
        result->oom = 1;
        result->oom_event = i;
        result->oom_size = e->size;
        break;
      }
      slot[e->id] = b;
    } else if (e->op == TRACE_FREE) {
      if (model == PEER_ASYNC) {
        async_free(&s, slot[e->id]);
      } else {
        expandable_free(&s, slot[e->id]);
      }
    }
  }
  result->peak_reserved_bytes = s.peak;
  result->num_maps = s.maps;
  result->num_unmaps = s.unmaps;
  result->num_pages_mapped = s.pages_mapped;
  int no_memory = s.no_memory;
  for (size_t p = 0; p < s.num_pools; p++) {
    free(s.pools[p].free_blocks.ids);
    free(s.pools[p].unmapped.ids);
  }
  free(s.pools);
  free(s.pool_stream);
  free(s.blocks);
  free(s.spare);
  free(slot);
  if (no_memory) {
    gpumem_set_last_error("%s: out of host memory in the %s model", trace->path,
                          peer_model_name(model));
    return GPUMEM_ERR_HOST_MEMORY;
  }
  return GPUMEM_OK;
}

gpumem_status_t peer_min_limit(const trace_t* trace, peer_model_t model, double tolerance,
                               int one_stream, uint64_t* min_limit) {
  peer_result_t r;
  gpumem_status_t st = peer_run(trace, model, 0, one_stream, &r);
  if (st != GPUMEM_OK) return st;
  uint64_t lo = trace->peak_live_bytes ? trace->peak_live_bytes - 1 : 0; /* fails */
  uint64_t hi = r.peak_reserved_bytes;                                   /* fits */
  uint64_t step = tolerance > 0 ? (uint64_t)(tolerance * (double)trace->peak_live_bytes)
                                : (uint64_t)(0.0025 * (double)trace->peak_live_bytes);
  if (tolerance <= 0 && step > 2 * MIB) step = 2 * MIB;
  if (step == 0) step = 1;
  while (hi - lo > step) {
    uint64_t mid = lo + (hi - lo) / 2;
    if ((st = peer_run(trace, model, mid, one_stream, &r)) != GPUMEM_OK) return st;
    if (r.oom) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  *min_limit = hi;
  return GPUMEM_OK;
}

const char* peer_model_name(peer_model_t model) {
  switch (model) {
    case PEER_EXPANDABLE:
      return "pytorch-expandable";
    case PEER_ASYNC:
      return "cudaMallocAsync";
    default:
      return "none";
  }
}

gpumem_status_t peer_take_expandable(const char* conf, char* out, size_t cap, int* expandable) {
  size_t used = 0;
  if (cap) out[0] = '\0';
  const char* p = conf ? conf : "";
  while (*p) {
    const char* end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    static const char key[] = "expandable_segments";
    size_t klen = sizeof key - 1;
    while (len && isspace((unsigned char)*p)) p++, len--;
    if (len > klen && strncasecmp(p, key, klen) == 0 && p[klen] == ':') {
      const char* v = p + klen + 1;
      size_t vlen = len - klen - 1;
      if (vlen == 4 && strncasecmp(v, "true", 4) == 0) {
        *expandable = 1;
      } else if (vlen == 5 && strncasecmp(v, "false", 5) == 0) {
        *expandable = 0;
      } else {
        gpumem_set_last_error("bad expandable_segments value '%.*s' (valid: True, False)",
                              (int)vlen, v);
        return GPUMEM_ERR_CONFIG;
      }
    } else if (len) {
      if (used + len + 2 > cap) {
        gpumem_set_last_error("configuration string too long");
        return GPUMEM_ERR_CONFIG;
      }
      if (used) out[used++] = ',';
      memcpy(out + used, p, len);
      used += len;
      out[used] = '\0';
    }
    p += len + (end ? 1 : 0);
    if (!end) break;
  }
  return GPUMEM_OK;
}
