/* The engine's structures: blocks, the free index, segments and arenas,
 * per-stream pools, and the allocator object itself. Shared by alloc.c
 * (front), cache.c (blocks, index, split/merge), pages.c (virtual memory),
 * streams.c (stream pools, events, deferred frees) and check.c.
 *
 * Invariants (verified by gpumem_check):
 *  - Blocks of one segment tile it exactly: sorted by address through
 *    prev/next, no gaps, no overlaps.
 *  - No two FREE neighbours: free_block merges them at once.
 *  - Every FREE block is in its pool's index exactly once; no other block is.
 *  - Every ALLOCATED block is in the pointer map exactly once; no other is.
 *  - PENDING blocks (freed, waiting for events of other streams) are in no
 *    index and no map; each is referenced by pending_events events.
 *  - requested <= allocated <= active <= reserved (bytes), and every stat's
 *    current equals the sum over the structures.
 *  - Virtual memory arenas: every page overlapped by an ALLOCATED or PENDING
 *    block is mapped; mapped_pages equals the bitmap's population.
 *  - Plan arenas (placement:planned) belong to a stream's plan pool, whose
 *    index is never searched by best fit: only the planner carves blocks
 *    out of them, at planned offsets. */
#ifndef GPUMEM_ENGINE_H
#define GPUMEM_ENGINE_H

#include <pthread.h>
#include <stdbool.h>

#include "internal.h"
#include "lock.h"

#define GM_MIN_BLOCK ((size_t)512)    /* rounding unit (PyTorch's kMinBlockSize) */
#define GM_SMALL_SIZE (GM_MIB)        /* requests up to this go to the small pool */
#define GM_SMALL_BUFFER (2 * GM_MIB)  /* pytorch: small pool segment size */
#define GM_LARGE_BUFFER (20 * GM_MIB) /* pytorch: segment for 1..10 MiB requests */
#define GM_MIN_LARGE_ALLOC (10 * GM_MIB)
#define GM_ROUND_LARGE (2 * GM_MIB)

/* Size classes of the free index: sizes in 512-byte units, exact below 16
 * units, then 16 classes per power of two (2^GM_CLASS_SUB_BITS), up to
 * 2^64 bytes: 16 + 51 * 16 classes, rounded up to whole bitmap words.
 * Measured against 8 per power of two (callgrind, warm replay): shorter
 * treaps, 0.15-0.8 fewer mispredicted branches per operation on the
 * bundled traces; 32 per power of two mispredicted more (t5: more
 * searches spill into the next class). */
#define GM_CLASS_SUB_BITS 4
#define GM_CLASS_COUNT 896
#define GM_CLASS_WORDS (GM_CLASS_COUNT / 64)

/* GM_SHADOW: a range no block may use because its bytes are another
 * address's on the same physical page (an alias, pages.c); not a user
 * allocation, never merged until its alias ends. */
typedef enum { GM_FREE = 0, GM_ALLOCATED = 1, GM_PENDING = 2, GM_SHADOW = 3 } gm_block_state;

typedef struct gm_block gm_block;
typedef struct gm_segment gm_segment;

/* Links of a pool's dirty list (free arena blocks that may hold mapped
 * whole pages): circular through a sentinel in the pool, and a block on
 * no list links to itself, so that taking a block off costs two stores
 * and no branch, whether it was on the list or not. */
typedef struct gm_dirty_link {
  struct gm_dirty_link* prev;
  struct gm_dirty_link* next;
} gm_dirty_link;
typedef struct gm_pool gm_pool;
typedef struct gm_stream gm_stream;

#define GM_INLINE_USES 1

struct gm_block {
  /* First cache line: what best-fit searches (treap walks), tiling walks
   * and the free path read. */
  uintptr_t addr;
  size_t size;
  union {
    struct { /* free: the free index's treap links */
      gm_block* left;
      gm_block* right;
    };
    struct {           /* allocated or pending: who made it (leaks.c, history.c) */
      uint64_t serial; /* 1 + the allocations made before it (gm->num_mallocs) */
      uint64_t tag;    /* gm->history_tag when it was made */
    };
  };
  gm_block* prev; /* address neighbours inside the segment */
  gm_block* next;
  gm_segment* seg;
  uint16_t prio; /* treap priority, a hash of the address */
  uint16_t cls;  /* its size class while in a free index (set by the insert) */
  uint8_t state; /* gm_block_state */
  /* Allocated on another stream than its arena's (alloc.c, borrow_mapped):
   * that stream is inline_uses[0], its first use, kept there until the
   * block is free again (gm_block_stream). */
  uint8_t lent;
  uint16_t num_uses; /* streams other than the owner's it was used on */
  /* Second line. */
  gm_pool* pool;
  size_t requested;            /* the caller's size while allocated */
  uint64_t seq;                /* planner: 1 + the request's sequence number, 0 = none */
  gm_dirty_link dirty;         /* its pool's dirty list; linked to itself when off it */
  gpumem_stream_t* extra_uses; /* num_uses > GM_INLINE_USES; kept for reuse */
  gpumem_stream_t inline_uses[GM_INLINE_USES];
  uint32_t pending_events;
  uint16_t extra_capacity; /* entries in extra_uses */
  uint8_t aliased;         /* its last page is an alias (pages.c): ends it when freed */
  uint8_t handed;          /* a shared plan arena's block taken by another stream (streams.c) */
};
#if UINTPTR_MAX == UINT64_MAX
/* Two cache lines exactly (the slab aligns its chunks): a block touched
 * on the hot path costs at most two lines, the first for searches. */
_Static_assert(sizeof(gm_block) == 128, "gm_block should fill two cache lines");
#endif

/* A segment is either a plain device allocation (pytorch policy: blocks
 * tile it, it is freed whole) or an arena: a reserved address range whose
 * pages are mapped on demand (default policy). */
typedef struct gm_spare_run {
  gpumem_phys_t handle;
  size_t pages;
} gm_spare_run;

struct gm_segment {
  uintptr_t addr;
  size_t size;
  gm_pool* pool;
  gm_block* first;      /* lowest block; walks of the tiling start here */
  gm_segment* prev_seg; /* all segments of the allocator */
  gm_segment* next_seg;
  bool is_arena;
  /* A plan serves from this arena now: reclaim spares its free pages, which
   * the plan wants again within a period (unless the device refuses). */
  bool plan_serving;
  /* A plan arena shared by the streams of a plan (plan.c): a block of it
   * used on a stream other than the pool's goes back ordered on the
   * device (the pool's stream waits for an event of the other), not
   * pending on the host (streams.c, gm_defer_free). */
  bool shared_streams;
  /* arenas only */
  size_t num_pages;
  size_t mapped_pages;
  size_t mapped_end;      /* 1 + the highest page ever mapped: scans stop here */
  uint64_t* mapped_bits;  /* one bit per page */
  gpumem_phys_t* handles; /* physical allocation mapped at each page, 0 if none */
  /* First page of the mapping each mapped page belongs to: one physical
   * allocation may back a run of pages (map_max), and it is unmapped and
   * released only whole. */
  uint32_t* run_start;
  /* Single-page mappings only (1 + index into gpumem_t.phys, 0 = none):
   * live_id[p] is the page mapped and usable at p, ghost_id[p] a page still
   * mapped at p but live elsewhere or spare (see pages.c, ghosts). */
  uint32_t* live_id;
  uint32_t* ghost_id;
  /* Which pages allocated or pending blocks overlap, kept on every malloc
   * and free at a cost independent of the block's length: busy[p] counts
   * the ends of blocks on page p, first and last page each once, so a
   * block within one page twice (at most 4096 blocks of 512 B: 8192), and
   * busy_inner has the bit of each page strictly inside one such block
   * (no other block can touch that page). A page with neither is wholly
   * free, and its physical page may be taken at once (gm_page_busy). */
  uint16_t* busy;
  uint64_t* busy_inner;
  /* Fences (fence.c), NULL until the arena's first: fence_pend has the bit
   * of each mapped page that lay wholly free when its stream's fence was
   * recorded and has not been used since; fence_safe of each such page
   * whose fence has completed (the device is done with it). A block placed
   * over a page clears both (gm_arena_busy). */
  uint64_t* fence_pend;
  uint64_t* fence_safe;
  /* A block of the overflow tier (overflow.c): this segment is its own
   * address range, in no segment list, and its one block is seg->first.
   * NULL for every other segment. */
  struct gm_tier_block* tier;
  /* Arenas only, NULL until the overflow tier first moves pages of one of
   * its blocks to host (overflow.c): host_bits has the bit of each page
   * slot backed by host pages instead of a device page. Such a slot lies
   * strictly inside one allocated block, is not in mapped_bits (it holds
   * no device page: not reserved, no page record, no ghost), and goes
   * back to unmapped when its block is freed or moves back. */
  uint64_t* host_bits;
  size_t host_pages;
};

/* A physical page of one page size and every address it is mapped at: at
 * most one where it is live (usable by blocks), and up to GM_MAX_GHOSTS
 * where it stays mapped after moving away, so that moving it back costs no
 * call (pages.c). */
#define GM_MAX_GHOSTS 3
typedef struct gm_phys {
  gpumem_phys_t handle;
  gm_segment* live_seg; /* NULL: spare (or a free record when handle is 0) */
  uint32_t live_page;
  uint32_t spare_pos; /* index in spare_pages while spare */
  /* The stream it was last live on, while that stream may still have
   * queued work on it (freed without a synchronization since): another
   * stream may use it only after synchronizing that one. */
  gm_stream* freed_on;
  uint32_t num_ghosts;
  gm_segment* ghost_seg[GM_MAX_GHOSTS]; /* oldest first */
  uint32_t ghost_page[GM_MAX_GHOSTS];
  /* Per ghost, whether unmapping it must wait for its arena's stream: 0
   * when that stream had no unsynchronized frees as the ghost was made,
   * else the stream's syncs count then plus one; a later synchronization
   * (syncs > mark - 1) finished every use of the address. */
  uint64_t ghost_sync_mark[GM_MAX_GHOSTS];
  /* A second address where it is live (an alias, pages.c), or NULL. */
  gm_segment* alias_seg;
  uint32_t alias_page;
} gm_phys;

/* A request that fitted only by sharing a partly used page: its last page
 * is mapped to the physical page of another address in the same arena
 * whose first bytes are free there (pages.c, gm_alias_alloc). */
typedef struct gm_alias {
  gm_block* owner;        /* the allocation; ends at offset e of its last page, and its
                             next block is the shadow to that page's end (the other's
                             bytes) */
  gm_block* shadow_there; /* the first e bytes of the shared page at its own address */
  uint32_t id;            /* the shared physical page */
} gm_alias;

typedef struct gm_free_index {
  gm_block* roots[GM_CLASS_COUNT];
  uint64_t nonempty[GM_CLASS_WORDS];
  size_t count;
  size_t bytes;
  /* Counts its blocks but does not sort them: a plan pool's free blocks
   * are found through the plan (anchors, walks), never by size, so
   * keeping them in treaps would cost every planned malloc and free two
   * to four tree updates for nothing. */
  bool counts_only;
} gm_free_index;

struct gm_pool {
  gm_stream* stream;
  bool is_small;
  bool is_plan; /* the stream's plan pool (placement:planned) */
  /* Its blocks count in the small or large pool's statistics by their
   * size (gm_block_stat_small): a plan pool, and a large pool whose stream
   * has a small pool. */
  bool stat_by_size;
  /* A graph-private pool's (graphpool.c): reclaim, plans, aliases and the
   * retry ladder never touch its pages, which stay mapped where they are
   * until the pool is released. */
  bool is_private;
  /* A private pool that never splits a block (torch.cuda.MemPool's
   * no_split): each allocation gets an arena of its own, of whole pages,
   * or a cached block of the pool whole. */
  bool no_split;
  /* Its segments are arenas whose pages are mapped on demand: virtual
   * memory, unless the pool has a segment source.
   * A flag of its own, next to the others, rather than a test of both:
   * the malloc path reads one byte of the pool it holds (measured: fewer
   * instructions per operation than reading gm->virtual_memory). */
  bool maps_pages;
  /* A private pool whose segments come from the caller's allocator
   * (torch.cuda.MemPool(allocator=...), graphpool.c's copy), NULL
   * otherwise: its segments are plain, by PyTorch's rules, even under
   * virtual memory. */
  const gpumem_segment_source_t* source;
  gm_free_index index;
  gm_dirty_link dirty; /* sentinel of the dirty list (order unused: reclaim sorts) */
  /* Allocations placed in a row at the arena's free tail, with no free on
   * the stream since the first of them (stream->frees_total was
   * tail_run_frees): alloc.c, follows_tail_run. */
  uint32_t tail_run;
  uint64_t tail_run_frees;
  /* The run's last block and the one before it (0: none), in bytes:
   * alloc.c, tail_run_ahead. */
  size_t tail_run_prev, tail_run_last;
  /* Blocks outside a run that walked past the arena's highest mapped page
   * by a little (alloc.c, regrowth_ahead). */
  uint32_t regrowths;
  /* Growths past the highest mapped page by a block alone between frees,
   * in a row since the arena last stood still (alloc.c, regrowth_ahead):
   * how many, the last one's block size and num_mallocs then. */
  uint32_t lone_growths;
  size_t lone_growth_size;
  uint64_t lone_growth_serial;
};

/* Pools of a stream: small requests (up to 1 MiB) and large ones, as in
 * PyTorch. (Measured: giving bands of large sizes their own arenas made the
 * address space walked by the bundled traces 5-40% larger, not smaller.) */
#define GM_POOL_SMALL 0
#define GM_POOL_LARGE 1
/* Plan arenas (placement:planned): small and large requests together, as
 * the plan placed them; counted as large in the statistics. */
#define GM_POOL_PLAN 2
#define GM_NUM_POOLS 3

struct gm_stream {
  gpumem_stream_t handle;
  gm_pool pools[GM_NUM_POOLS];
  uint64_t frees_since_sync; /* arena pages freed on it since its last sync */
  uint64_t syncs;            /* synchronizations by the allocator so far */
  /* Arena blocks of its pools freed so far (never reset); blocks of
   * another stream's shared plan arena used on this stream alone and freed
   * (self_frees); and the stream this one last waited for on the device,
   * when that one's count less this one's self_frees stood at
   * waited_frees (streams.c, gm_shared_take: a wait that would order
   * nothing new is skipped). */
  uint64_t frees_total;
  uint64_t self_frees;
  /* Of frees_total, those of blocks not lent (alloc.c, borrow_mapped): a
   * lent block's uses on this stream ended before it was lent, and its
   * borrower's are over when it is free again, so its free leaves this
   * stream's probe valid (gm_stream_settled). */
  uint64_t own_frees;
  gm_stream* waited_on;
  uint64_t waited_frees;
  /* Its fence (fence.c): an event recorded on it behind the pages marked
   * in its arenas' fence_pend, queried (never waited for) at later
   * growths. */
  gpumem_event_t fence_event;
  bool fence_made;     /* fence_event exists */
  bool fence_recorded; /* recorded and not yet seen complete */
  /* Its probe (streams.c, gm_stream_settled): an event recorded on it
   * when own_frees was probe_frees, and whether it was seen complete. */
  gpumem_event_t probe_event;
  uint64_t probe_frees;
  bool probe_made, probe_recorded, probe_done;
  /* The lender whose probe this stream last waited for on the device to
   * borrow (lend:ordered, alloc.c borrow_mapped), and that probe's
   * probe_frees then: a later borrow from it with no free since needs no
   * new wait. */
  gm_stream* lend_waited_on;
  uint64_t lend_waited_frees;
  /* lend:ordered: a borrower that freed blocks lent by this stream, now
   * free in its arenas, before this stream was ordered after it on the
   * device (streams.c, gm_lender_catch_up). NULL: none. Such blocks are
   * the borrower's to take again in its own stream order; this stream's
   * own use of its free memory, its probes and fences, and another
   * borrower wait for the catch-up first. */
  gm_stream* unordered_borrower;
  gm_stream* next;
  /* The graph-private pool this stream's pools belong to (graphpool.c),
   * NULL for a regular stream (those in gpumem_t.streams). */
  struct gm_graph_pool* graph_pool;
};

/* A freed block waiting for another stream's work (record_stream). */
typedef struct gm_pending_event {
  gpumem_event_t event;
  gm_block* block;
} gm_pending_event;

/* Open-addressing map from allocated address to block. */
typedef struct gm_ptr_map {
  gm_block** slots;
  size_t mask; /* capacity - 1 */
  size_t count;
} gm_ptr_map;

/* ---- planned placement (plan.c) ---- */

#define GM_PLAN_RING 8192 /* requests remembered: two of the longest period */
#define GM_PLAN_MAX_PERIOD 4096
#define GM_PLAN_MIN_PERIOD 16
#define GM_PLAN_TABLE 16384        /* context hash -> latest request index */
#define GM_PLAN_SAMPLE_AFTER 16384 /* requests without a plan before detection samples (plan.c) */
#define GM_PLAN_IDLE_AFTER 65536   /* ... and before it takes turns, on and off (plan.c) */
#define GM_PLAN_TURN 16384         /* requests per turn: at least two of the longest period */
#define GM_PLAN_MAX_OFF_TURNS 16   /* the longest off turn, in turns (plan.c, off_turn) */
_Static_assert(GM_PLAN_TURN >= 2 * GM_PLAN_MAX_PERIOD + 8, "a turn must hold two periods");
#define GM_PLAN_MAX_STREAMS 4
/* How much more than the joint peak of a step the arenas of a plan on
 * several streams may hold (plan.c, arenas_fit_joint_peak). */
#define GM_PLAN_JOINT_SLACK 0.01

typedef struct gm_plan_req {
  uint64_t key; /* hash of (rounded size, stream) */
  uint64_t ctx; /* rolling sum of this key and the 8 before (plan.c) */
  size_t rsize;
  gpumem_stream_t stream;
  uint64_t free_at; /* 1 + index of the first request after its free; 0 = live */
  uint64_t live;    /* allocated bytes when it was requested */
  int32_t item;     /* dormant plan: the item it followed, -1 none */
} gm_plan_req;

typedef struct gm_plan_item {
  size_t rsize;
  size_t off; /* in its stream's plan arena */
  gpumem_stream_t stream;
  int32_t anchor;  /* planned item just below it, live when it is requested; -1 none */
  uint32_t life;   /* planned lifetime in requests */
  uint8_t planned; /* freed within a period: placed by the plan */
  uint8_t arena;   /* index into gm_planner.arenas */
} gm_plan_item;

enum { GM_PLAN_NONE = 0, GM_PLAN_ACTIVE = 1, GM_PLAN_DORMANT = 2 };

typedef struct gm_planner {
  bool enabled;
  uint64_t n;            /* requests seen */
  uint64_t window_start; /* detection uses requests from here on (plan.c, turns) */
  bool idle;             /* the last request came in an off turn: not recorded */
  bool turn_off;         /* detection is in an off turn (plan.c, off_turn) */
  uint32_t off_turns;    /* length of the last off turn, in turns */
  uint64_t turn_end;     /* request index where the current turn ends; 0 = none yet */
  gm_plan_req* ring;
  uint64_t* table; /* 1 + request index, 0 = empty */
  /* detection */
  uint64_t cand, matched, min_period;
  /* the plan */
  int state;
  size_t period;
  gm_plan_item* items;
  uint64_t* ctx_keys; /* resynchronisation: context hash -> item */
  int32_t* ctx_items;
  size_t ctx_mask;
  size_t num_arenas;
  /* One arena for all the plan's streams (arena_streams[0]'s), reuse
   * between them ordered on the device (plan.c, "several streams"). */
  bool shared;
  gm_segment* arenas[GM_PLAN_MAX_STREAMS];
  gpumem_stream_t arena_streams[GM_PLAN_MAX_STREAMS];
  size_t extents[GM_PLAN_MAX_STREAMS];
  uint64_t dormant_since; /* request index */
  size_t cursor;
  size_t window_reqs, window_misses; /* over the current period */
  size_t shadow, shadow_run;         /* dormant: following the plan without serving */
  uint64_t verify, verified;         /* dormant: next request whose lifetime to check; checked */
  uint64_t active_since;             /* request index */
  bool trimmed;                      /* pressure: cache trimmed after the first planned period */
} gm_planner;

typedef struct gm_oom_callback {
  gpumem_oom_callback_t fn;
  void* arg;
} gm_oom_callback;

/* Slab of block structs so the hot path never calls malloc. */
typedef struct gm_block_slab {
  gm_block* free_list;
  void** chunks;
  size_t num_chunks;
  size_t chunk_capacity;
  size_t live;
} gm_block_slab;

struct gpumem {
  gm_lock lock;
  gpumem_backend_t* backend;
  gpumem_options_t opts;
  bool virtual_memory; /* default policy on a backend with page slots */
  size_t page_size;
  unsigned page_shift; /* log2(page_size): page numbers on the hot path without a division */
  size_t device_total;
  size_t limit; /* effective cap on reserved bytes, 0 = none */

  gm_stream* streams;
  gm_stream* last_stream; /* one-entry cache for the hot path */
  gm_segment* segments;
  gm_ptr_map ptrs;
  gm_block_slab slab;

  /* deferred frees, FIFO */
  gm_pending_event* pending;
  size_t pending_head, pending_count, pending_capacity;
  gpumem_event_t* spare_events;
  size_t num_spare_events, spare_events_capacity;

  /* virtual memory */
  /* Physical pages of single-page mappings; free records are chained
   * through live_page. */
  gm_phys* phys;
  size_t phys_count, phys_capacity;
  gm_alias* aliases;
  size_t num_aliases, aliases_capacity;
  /* CUDA IPC (ipc.c): descriptors exported per allocation, closed when it
   * is freed; memory of other processes mapped here. */
  struct gm_ipc_export* ipc_exports;
  size_t num_ipc_exports, ipc_exports_capacity;
  struct gm_ipc_import* ipc_imports;
  size_t num_ipc_imports, ipc_imports_capacity;
  uint32_t phys_free_head; /* 1 + index, 0 = none */
  uint32_t* spare_pages;   /* 1 + index of pages held but live nowhere */
  size_t num_spare_pages, spare_pages_capacity;
  /* Unmapped mappings of several pages whose release failed (normally
   * empty: they go back to the device as they are unmapped). */
  gm_spare_run* spare_runs;
  size_t num_spare_runs, spare_runs_capacity, spare_run_pages;
  size_t arena_size;
  size_t map_max_pages;     /* pages per physical allocation at most (>= 1) */
  uint64_t mapping_call_t0; /* GM_MAP_CALL's start */
  double move_spent_us;     /* move budget spent (pages.c, move_budget_left) */
  double fence_spent_us;    /* fenced reuse's budget spent (pages.c, gm_fence_budget_left) */
  bool fine_mappings;       /* the device or limit refused once: one page per mapping */
  /* The move guard (pages.c, note_move): pages mapped at a new address
   * outside plan arenas, counted in windows of allocations. */
  struct {
    uint64_t window_start; /* allocations made when the window opened */
    uint64_t moves;        /* in this window */
    int hot_windows;       /* hot windows in a row; enough of them trip the guard */
  } guard;
  uint64_t allocated_high_water; /* never reset: the lazy reclaim target */
  /* num_mallocs when allocated_high_water last rose: how long the job has
   * run below its peak (alloc.c, small_in_large_hole). */
  uint64_t high_water_serial;
  gm_planner planner;
  struct gm_history* history;   /* recorded events (history.c); NULL: not recording */
  uint64_t history_tag;         /* carried by the events and allocations from now on */
  struct gm_recorder* recorder; /* option record (record.c); NULL: not recording */
  uint64_t num_mallocs;         /* allocations made, never reset: leak marks (leaks.c) */
  bool leak_checked;            /* gpumem_leak_check_now ran: destroy and exit stay quiet */
  struct gm_budget* budget;     /* option shared_limit (budget.c); NULL: none */
  /* Publication (publish.c): the mapped page, once made. */
  bool publish_wanted; /* publish after operations (cleared when the file fails) */
  bool publish_failed;
  uint32_t publish_tick; /* operations since the last publication */
  int64_t published_reserved;
  int device_index; /* CUDA ordinal of a gpumem_default instance, else -1 */
  struct gm_publication* publication;
  int publish_fd;  /* holds the life lock readers test (shmfile.h) */
  int publish_pid; /* the process that made the page */
  char publish_path[256];

  gm_oom_callback* callbacks;
  size_t num_callbacks;

  /* Graph-private pools (graphpool.c): every pool, the routings now in
   * force, and frees put off while a capture may be underway. */
  struct gm_graph_pool* graph_pools;
  struct gm_pool_route* routes;
  size_t num_routes, routes_capacity;
  /* A capture went on after the last routing ended (graphpool.c,
   * gpumem_end_allocate_to_pool): captures stay possible until the backend
   * says no known stream captures. */
  bool capture_outlives_routes;
  gm_block** capture_deferred;
  size_t num_capture_deferred, capture_deferred_capacity;

  /* The overflow tier (overflow.c): its blocks, newest first; bytes held
   * on each side; the event its idleness questions are asked with. */
  struct gm_tier_block* tier;
  struct gm_tier_block* tier_retiring; /* freed, waiting for their stream's work */
  size_t tier_count;
  size_t tier_host_bytes;   /* host pages mapped under tier blocks */
  size_t tier_device_bytes; /* device pages mapped under tier blocks (in reserved) */
  size_t tier_on_host;      /* tier blocks on host pages */
  /* Reserved bytes when a move back to the device last failed for want of
   * memory: none is tried again at a free until reserved is below it. */
  uint64_t tier_retry_below;
  gpumem_event_t tier_event;
  bool tier_event_made;
  /* Arena blocks whose interior pages are on host pages (overflow.c,
   * gm_arena_host): one record per block; their host bytes (within the
   * host budget with tier_host_bytes). */
  struct gm_arena_host* arena_host;
  size_t num_arena_host, arena_host_capacity;
  size_t arena_host_bytes;
  /* Moves of blocks from within the hot window, short of cold ones
   * (overflow.c): how many, how many of them were freed within a window of
   * their move (the copy was for nothing), and whether such moves stopped. */
  size_t tier_warm_moves, tier_warm_wasted;
  bool tier_warm_off;
  /* What the tier knows of arena blocks beyond their serial (overflow.c,
   * gm_block_note): the last record_stream, the hint, pressure moves. */
  struct gm_block_note* notes;
  size_t num_notes, notes_capacity;
  /* Host allocations no block uses any more, unmapped and idle, kept for
   * a later one of the same size (overflow.c, "kept host pages"): pinning
   * host memory is the tier's slowest call. host_high: the most host bytes
   * held under blocks at once (plus a creation's), which held and kept
   * together never pass. */
  struct gm_host_kept* host_kept;
  size_t num_host_kept, host_kept_capacity;
  size_t host_kept_bytes;
  size_t host_high;

  gpumem_stats_t stats; /* live counters; derived fields filled on read */
};

/* Bits lo..hi of a word (lo <= hi <= 63): two shifts, no special case
 * for a whole word. */
static inline uint64_t gm_bits_between(size_t lo, size_t hi) {
  return (~0ull << lo) & (~0ull >> (63 - hi));
}

/* Bitmaps of pages, a word at a time: the next run of bits [first, last]
 * within first's word is *span bits long, under the returned mask. */
static inline uint64_t gm_bits_word_mask(size_t first, size_t last, size_t* span) {
  size_t bit = first % 64, top = last - first >= 63 - bit ? 63 : bit + (last - first);
  *span = top - bit + 1;
  return gm_bits_between(bit, top);
}

/* Sets (on) or clears the bits of pages [first, last] of a bitmap. */
static inline void gm_bits_range(uint64_t* bits, size_t first, size_t last, bool on) {
  while (first <= last) {
    size_t span;
    uint64_t mask = gm_bits_word_mask(first, last, &span);
    if (on)
      bits[first / 64] |= mask;
    else
      bits[first / 64] &= ~mask;
    first += span;
  }
}

/* Counts block b (allocated or pending, in an arena) on the pages it
 * overlaps (delta +1), or no longer (-1). On every malloc and free: most
 * blocks lie within one page. */
static inline void gm_arena_busy(const gpumem_t* gm, const gm_block* b, int delta) {
  gm_segment* seg = b->seg;
  unsigned sh = gm->page_shift;
  size_t first = (b->addr - seg->addr) >> sh, last = (b->addr + b->size - 1 - seg->addr) >> sh;
  uint16_t* busy = seg->busy;
  /* Both ends counted even when they are the same page (a block within
   * one page counts twice there): no branch on it, which mispredicted on
   * mixed sizes. */
  busy[first] = (uint16_t)(busy[first] + delta);
  busy[last] = (uint16_t)(busy[last] + delta);
  if (last - first > 1) gm_bits_range(seg->busy_inner, first + 1, last - 1, delta > 0);
  /* A page used again is no longer known done with (fence.c). */
  if (GM_UNLIKELY(seg->fence_pend != NULL) && delta > 0) {
    gm_bits_range(seg->fence_pend, first, last, false);
    gm_bits_range(seg->fence_safe, first, last, false);
  }
}

/* Does an allocated or pending block overlap page p of arena seg? */
static inline bool gm_page_busy(const gm_segment* seg, size_t p) {
  return seg->busy[p] || ((seg->busy_inner[p / 64] >> (p % 64)) & 1u);
}

/* ---- cache.c: blocks, free index, pointer map ---- */
gm_block* gm_block_new(gpumem_t* gm);
/* Makes room for n (<= 8) block structs, so that the next n gm_block_new
 * calls cannot fail: for changes that must not stop halfway. */
bool gm_block_reserve(gpumem_t* gm, int n);
void gm_block_delete(gpumem_t* gm, gm_block* b);
void gm_slab_destroy(gm_block_slab* slab);
void gm_index_insert(gm_free_index* ix, gm_block* b);
void gm_index_remove(gm_free_index* ix, gm_block* b);
gm_block* gm_index_find(const gm_free_index* ix, size_t size);
gm_block* gm_index_largest(const gm_free_index* ix);
/* The block after b in (size, address) order, or NULL. */
gm_block* gm_index_next(const gm_free_index* ix, const gm_block* b);
/* Visits every block of the index (for release and checks). */
typedef void (*gm_block_visit_fn)(gm_block* b, void* arg);
void gm_index_visit(const gm_free_index* ix, gm_block_visit_fn fn, void* arg);
size_t gm_index_check(const gm_free_index* ix, const gm_pool* pool);
gpumem_status_t gm_ptr_map_init(gm_ptr_map* m);
void gm_ptr_map_destroy(gm_ptr_map* m);
gpumem_status_t gm_ptr_map_insert(gm_ptr_map* m, gm_block* b);
gm_block* gm_ptr_map_find(const gm_ptr_map* m, uintptr_t addr);
gm_block* gm_ptr_map_remove(gm_ptr_map* m, uintptr_t addr);
/* Marks b free, merges it with free neighbours, indexes the result. */
gm_block* gm_free_block(gpumem_t* gm, gm_block* b);
/* Frees a shadow block (no statistics: it holds no user bytes). */
gm_block* gm_free_shadow(gpumem_t* gm, gm_block* b);
/* Frees b, taken for a request but never handed out (an undo): counted
 * active first, so that freeing it balances to nothing. */
gm_block* gm_free_unused(gpumem_t* gm, gm_block* b);
/* Carves size bytes off the front of free block b (already out of the
 * index) when the policy says so; the rest goes back to the index. */
void gm_split_block(gpumem_t* gm, gm_block* b, size_t size, bool split);
gm_block* gm_split_free_front(gpumem_t* gm, gm_block* f, size_t front);

/* ---- streams.c ---- */
gm_stream* gm_stream_get(gpumem_t* gm, gpumem_stream_t handle);
gpumem_status_t gm_block_add_use(gm_block* b, gpumem_stream_t stream);
/* Records events on the block's other streams; the block turns PENDING.
 * In a shared plan arena its stream waits for those events on the device
 * instead, and the block is free at once. */
gpumem_status_t gm_defer_free(gpumem_t* gm, gm_block* b);
/* Whether the backend and the options let one stream wait for another on
 * the device (event_record and stream_wait, option stream_waits). */
bool gm_can_order_streams(const gpumem_t* gm);
/* Hands block b of a shared plan arena (its pool's stream's) to stream u,
 * another stream:
 * u waits on the device for the pool's stream's work so far (unless the
 * only arena blocks freed since u last did were u's own), and u becomes a
 * use of b, so that its free orders the pool's stream after u. On failure
 * b is unchanged. */
gpumem_status_t gm_shared_take(gpumem_t* gm, gm_block* b, gm_stream* u);
/* lend:ordered with the means to order: stream_waits on and the
 * backend's stream_wait slot (alloc.c, borrow_mapped). */
static inline bool gm_lends_ordered(const gpumem_t* gm) {
  return gm->opts.lend == GPUMEM_LEND_ORDERED && gm->opts.stream_waits && gm->backend->stream_wait;
}
/* The stream b was allocated on: its arena's, or the borrower's. */
static inline gpumem_stream_t gm_block_stream(const gm_block* b) {
  return GM_UNLIKELY(b->lent) ? b->inline_uses[0] : b->pool->stream->handle;
}
/* True when every use of the free blocks of s's arenas is known over on
 * the device (an event queried, never waited for). */
bool gm_stream_settled(gpumem_t* gm, gm_stream* s);
/* Orders s after its unordered borrower (there must be one) on the
 * device (an event recorded on the borrower, waited for on s: the host
 * never waits) and makes s's probe stale (own_frees). */
gpumem_status_t gm_lender_catch_up(gpumem_t* gm, gm_stream* s);
/* gm_lender_catch_up where s has an unordered borrower; nothing otherwise. */
static inline gpumem_status_t gm_lender_ready(gpumem_t* gm, gm_stream* s) {
  return GM_UNLIKELY(s->unordered_borrower != NULL) ? gm_lender_catch_up(gm, s) : GPUMEM_OK;
}
/* Every stream caught up with its borrowers (before a capture may begin). */
gpumem_status_t gm_lenders_catch_up(gpumem_t* gm);
/* Frees blocks whose events completed; with wait, synchronizes on every
 * pending event first. */
gpumem_status_t gm_process_events(gpumem_t* gm, bool wait);
void gm_streams_destroy(gpumem_t* gm);
/* Destroys pooled and pending events (allocator teardown). */
void gm_events_destroy(gpumem_t* gm);

/* ---- pages.c: arenas and physical pages (default policy) ---- */
gpumem_status_t gm_arena_new(gpumem_t* gm, gm_pool* pool, size_t min_size, gm_block** out);
/* Maps every page under [addr, addr+size) of the arena. */
gpumem_status_t gm_arena_map_range(gpumem_t* gm, gm_segment* seg, uintptr_t addr, size_t size);
/* The same; where the range grows the arena past its highest mapped page
 * and the growth needs no reclaim, the new mapping also takes up to
 * `ahead` bytes of the free pages above the range (alloc.c, map ahead of a
 * tail run). */
gpumem_status_t gm_arena_map_range_ahead(gpumem_t* gm, gm_segment* seg, uintptr_t addr, size_t size,
                                         size_t ahead);
/* Whether new memory comes in mappings of several pages (no limit, budget
 * or planner, and the device has not refused): nothing moves pages then,
 * and reserved memory is the address space the arenas walk. */
static inline bool gm_grows_in_runs(const gpumem_t* gm) {
  if (gm->opts.reclaim == GPUMEM_RECLAIM_EAGER || gm->limit || gm->budget || gm->fine_mappings)
    return false;
  /* A plan that starts serving takes the regular arenas' free pages one by
   * one (provide_pages); whole-mapping reclaim left resnet at 1.0508 x
   * peak live under pressure with planned placement, against 1.0037. */
  return !gm->planner.enabled && gm->map_max_pages > 1;
}
/* Re-arms the move guard (pages.c): empty_cache and a plan that starts
 * serving start it afresh. */
void gm_guard_reset(gpumem_t* gm);
static inline void gm_dirty_init(gm_dirty_link* l) {
  l->prev = l->next = l;
}
/* On a dirty list: linked to something other than itself. */
static inline bool gm_dirty_on(const gm_block* b) {
  return b->dirty.next != &b->dirty;
}
static inline gm_block* gm_dirty_block(gm_dirty_link* l) {
  return (gm_block*)((char*)l - offsetof(gm_block, dirty));
}
/* Puts free block b on its pool's dirty list, if it is not on it. */
static inline void gm_dirty_add(gm_pool* pool, gm_block* b) {
  if (gm_dirty_on(b)) return;
  b->dirty.prev = pool->dirty.prev;
  b->dirty.next = &pool->dirty;
  pool->dirty.prev->next = &b->dirty;
  pool->dirty.prev = &b->dirty;
}
/* Takes b off its pool's dirty list; nothing happens if it is on none. */
static inline void gm_dirty_remove(gm_block* b) {
  b->dirty.prev->next = b->dirty.next;
  b->dirty.next->prev = b->dirty.prev;
  gm_dirty_init(&b->dirty);
}
/* Visits a pool's dirty list; the visited block may be taken off. */
#define GM_DIRTY_FOREACH(pool, b)                                       \
  for (gm_dirty_link* gm_l_ = (pool)->dirty.next, *gm_n_ = gm_l_->next; \
       gm_l_ != &(pool)->dirty && ((b) = gm_dirty_block(gm_l_), 1);     \
       gm_l_ = gm_n_, gm_n_ = gm_l_->next)
/* Unmaps free whole pages into the spare list; at most want pages (0 = all);
 * returns pages reclaimed or an error. */
gpumem_status_t gm_reclaim(gpumem_t* gm, size_t want, size_t* reclaimed);
/* Returns spare pages to the device. */
gpumem_status_t gm_release_spare_pages(gpumem_t* gm, size_t keep);
/* Bytes of whole free pages that could be reclaimed now (stats). */
uint64_t gm_reclaimable_bytes(gpumem_t* gm);
/* The retry ladder's last rung for a large request in a regular arena:
 * placed at the arena's tail with its last page shared with a page whose
 * first bytes are free elsewhere in the arena (one page fewer to find).
 * On success *out is allocated, out of the index, mapped. */
gpumem_status_t gm_alias_alloc(gpumem_t* gm, gm_pool* pool, size_t rsize, gm_block** out);
/* Ends the alias of b (being freed): its shadows are freed, its last page
 * stays mapped as a ghost. No backend call. */
void gm_alias_release(gpumem_t* gm, gm_block* b);
void gm_arena_destroy(gpumem_t* gm, gm_segment* seg);
/* Releases an arena that holds nothing but its one free block (its mapped
 * pages become spare). */
void gm_arena_release_if_unused(gpumem_t* gm, gm_segment* seg);
bool gm_arena_page_mapped(const gm_segment* seg, size_t page);

/* True when every page of the arena from first to last is mapped. */
bool gm_arena_pages_mapped(const gm_segment* seg, size_t first, size_t last);
/* True when every page under [addr, addr+size) of the arena is mapped.
 * Asked of most small requests once a job's peak is past (alloc.c,
 * small_in_large_hole), so the common case, a range within one word of
 * the bitmap, is inline and shifts instead of dividing. */
static inline bool gm_arena_range_mapped(const gpumem_t* gm, const gm_segment* seg, uintptr_t addr,
                                         size_t size) {
  size_t first = (addr - seg->addr) >> gm->page_shift;
  size_t last = (addr + size - 1 - seg->addr) >> gm->page_shift;
  if (GM_LIKELY(first / 64 == last / 64)) {
    uint64_t mask = gm_bits_between(first % 64, last % 64);
    return (seg->mapped_bits[first / 64] & mask) == mask;
  }
  return gm_arena_pages_mapped(seg, first, last);
}

/* Reclaim from every arena, from all but those a plan serves from now, or
 * only from plan arenas no plan serves from (dormant or retired). */
enum {
  GM_RECLAIM_ALL = 0,
  GM_RECLAIM_SPARE_SERVING = 1,
  GM_RECLAIM_IDLE_PLANS = 2,
  /* only mappings whose pages the device is known done with (fence.c):
   * nothing waits, no plan arena a plan serves */
  GM_RECLAIM_FENCED = 3,
};
gpumem_status_t gm_reclaim_from(gpumem_t* gm, int which, size_t want, size_t* reclaimed);
/* Whole pages inside free block b, [*first, *end), below the arena's
 * highest mapped page; false when none. */
bool gm_interior_pages(const gpumem_t* gm, const gm_block* b, size_t* first, size_t* end);
/* Of those, the mapped pages whose mapping reaches past them (under live
 * blocks or edge pages): pinned until those go. */
size_t gm_arena_pinned_pages(const gpumem_t* gm, const gm_block* b);
/* gpumem_explain with the lock held (check.c). */
void gm_explain_locked(gpumem_t* gm, gpumem_explain_t* out);

/* Host-backed page slots (the overflow tier, overflow.c). */
static inline bool gm_arena_page_host(const gm_segment* seg, size_t p) {
  return seg->host_bits && ((seg->host_bits[p / 64] >> (p % 64)) & 1u);
}
/* The pages of live block b that it alone may hand to host pages: its
 * whole interior pages, less any mapping that reaches past them (a
 * mapping moves only whole), [*first, *end); false when none, or when one
 * of them is not a plain device page (a shared alias). */
bool gm_arena_movable(const gpumem_t* gm, const gm_block* b, size_t* first, size_t* end);
/* Pages [first, end) of seg (device pages under one live block, whose
 * bytes were copied to host pages `host` already) swap to `host`: the
 * device mappings are unmapped in one call, host mapped there in one,
 * and the device pages become spare (single pages) or go back to the
 * device (longer mappings). On failure the device pages are where they
 * were. */
gpumem_status_t gm_arena_swap_to_host(gpumem_t* gm, gm_segment* seg, size_t first, size_t end,
                                      gpumem_phys_t host);
/* The reverse: host-backed pages [first, end) of seg swap to the device
 * pages `dev` (one physical allocation of end - first pages, counted in
 * reserved from here on). On failure the host pages are where they were
 * and `dev` is not counted. */
gpumem_status_t gm_arena_swap_to_device(gpumem_t* gm, gm_segment* seg, size_t first, size_t end,
                                        gpumem_phys_t host, gpumem_phys_t dev);
/* Marks host-backed pages [first, end) of seg as unmapped (after the
 * caller unmapped them). */
void gm_arena_host_clear(gm_segment* seg, size_t first, size_t end);

/* ---- fence.c: free pages taken back without waiting ---- */
/* Before an arena grows past the mark: advances the streams' fences and
 * takes back up to `want` pages (a mapping counts whole) that a completed
 * fence shows the device done with. */
gpumem_status_t gm_fence_reuse(gpumem_t* gm, size_t want);
/* Whether fenced reuse may spend more mapping work now (pages.c). */
bool gm_fence_budget_left(gpumem_t* gm);
/* Reclaims up to `want` pages from which (GM_RECLAIM_*) and charges the
 * mapping work it costs to *spent, at an H100's prices (pages.c). */
gpumem_status_t gm_reclaim_priced(gpumem_t* gm, int which, size_t want, double* spent, size_t* got);
/* Are pages [first, first + n) of seg known done with (fence_safe)? */
bool gm_fence_done(const gm_segment* seg, size_t first, size_t n);
void gm_fence_stream_destroy(gpumem_t* gm, gm_stream* s);

/* ---- plan.c: planned placement ---- */
gpumem_status_t gm_plan_init(gpumem_t* gm);
void gm_plan_destroy(gpumem_t* gm);
/* Records the request and, when a plan is active and the request is on
 * it, returns its block carved at the planned offset (ALLOCATED, mapped);
 * NULL means: place it by best fit. */
gm_block* gm_plan_malloc(gpumem_t* gm, gm_stream* s, size_t rsize);
static inline void gm_plan_note_free(gpumem_t* gm, const gm_block* b) {
  gm_planner* p = &gm->planner;
  if (b->seq && p->n - (b->seq - 1) < GM_PLAN_RING)
    p->ring[(b->seq - 1) % GM_PLAN_RING].free_at = p->n + 1;
}
/* Forgets the plan (gpumem_empty_cache); idle plan arenas are released. */
void gm_plan_drop(gpumem_t* gm);
/* gpumem_check's part: counts violations of the planner's invariants. */
size_t gm_plan_check(gpumem_t* gm, char* msg, size_t len);

/* ---- graphpool.c: graph-private pools ---- */

/* The private stream that serves an allocation on stream when a routing
 * takes it, else NULL (s then serves). Only called while routes exist. */
gm_stream* gm_graph_route(gpumem_t* gm, gpumem_stream_t stream);
/* Whether a stream the allocator knows is capturing a graph now (without
 * the backend's capture slot: whenever a pool is routed to). While it is,
 * no synchronization, event query or event record may be made. */
bool gm_capture_underway(gpumem_t* gm);
static inline bool gm_capture_possible(const gpumem_t* gm) {
  return gm->num_routes != 0 || gm->capture_outlives_routes;
}
/* Puts off the free of block b (with uses on other streams) until no
 * capture is underway: it turns PENDING, waiting for one sentinel event. */
gpumem_status_t gm_capture_defer_free(gpumem_t* gm, gm_block* b);
/* Frees what was put off, once no capture is underway. */
void gm_capture_flush(gpumem_t* gm);
/* A block of a private pool was freed: a released pool that holds nothing
 * goes back to the device. */
void gm_graph_pool_note_free(gpumem_t* gm, gm_pool* pool);
/* Every released pool that holds nothing goes back (empty_cache and the
 * retry ladder: a release a failed device call stopped is tried again). */
void gm_graph_pools_release_idle(gpumem_t* gm);
/* The last step before out of memory for a request on stream outside
 * every pool (torch.cuda.MemPool's use_on_oom): a cached block of a pool
 * that allows it, on a private stream of that pool for the same stream,
 * from its pool pool_idx; GPUMEM_ERR_OUT_OF_MEMORY when none has one. */
gpumem_status_t gm_graph_pools_oom_alloc(gpumem_t* gm, gpumem_stream_t stream, int pool_idx,
                                         size_t rsize, gm_block** out);
/* (alloc.c) A cached block of pool for rsize bytes, placed and mapped as
 * any allocation's, without growing: GPUMEM_ERR_OUT_OF_MEMORY when the
 * pool holds no free block that large. */
gpumem_status_t gm_take_cached(gpumem_t* gm, gm_pool* pool, size_t rsize, gm_block** out);
/* gpumem_check's part: private pools' indexes and dirty lists (counted
 * into *indexed and *dirty_listed) and their invariants. */
size_t gm_graph_pools_check(gpumem_t* gm, size_t* indexed, size_t* dirty_listed, char* msg,
                            size_t len);
void gm_graph_pools_destroy(gpumem_t* gm);
/* Maps pages [first, last] of a private arena: new device pages only, so
 * that no page a graph may touch is ever one another stream still uses,
 * and no synchronization is needed during a capture (pages.c). */
gpumem_status_t gm_private_map(gpumem_t* gm, gm_segment* seg, size_t first, size_t last);
/* pages more were mapped into private arena seg (they stay until release). */
void gm_graph_pool_pinned(gm_segment* seg, size_t pages);
/* Releases a wholly free segment of a private pool to the device (or to
 * its pool's segment source). */
gpumem_status_t gm_release_plain_segment(gpumem_t* gm, gm_block* b);
/* A segment of size bytes for pool from its segment source (pool->source
 * set): on failure a message names the pool's allocator, if the source
 * wrote none. Not a backend call: counted nowhere here. */
gpumem_status_t gm_graph_pool_source_alloc(gm_pool* pool, size_t size, uintptr_t* out);
/* Gives plain segment seg back to its pool's segment source. */
void gm_graph_pool_source_free(gm_segment* seg);

/* ---- overflow.c: the overflow tier (option overflow:host) ---- */

/* A block of the tier: it owns its address range, so what backs the range
 * (host pages, or device pages once it came back) may change while its
 * address does not. One physical allocation covers the whole range.
 * Invariants (gm_overflow_check): the block is ALLOCATED and in the
 * pointer map; the range is page-rounded and holds the block; exactly one
 * physical allocation is mapped there; tier_host_bytes and
 * tier_device_bytes are the sums over the list; the host budget holds. */
typedef struct gm_tier_block {
  gm_segment seg;       /* seg.first is the block; seg.tier points back here */
  gpumem_phys_t handle; /* mapped under the whole range */
  size_t bytes;         /* the range's size, whole pages */
  bool on_host;
  /* gpumem_prefer_host: moved to host first, never brought back. */
  bool prefer_host;
  /* Times pressure moved it to host; at GM_TIER_BOUNCES it stays there
   * until empty_cache (overflow.c says why). */
  uint32_t pressure_moves;
  uint64_t last_touch; /* gm->num_mallocs when made, moved or handed to a stream */
  /* Freed, retiring (its block PENDING): the event recorded on its stream
   * at the free, after which the range may go (overflow.c). */
  gpumem_event_t retire_event;
  bool retire_event_made;
  struct gm_tier_block* prev;
  struct gm_tier_block* next;
} gm_tier_block;

static inline bool gm_block_in_tier(const gm_block* b) {
  return b->seg->tier != NULL;
}
/* The request of rsize bytes that the device path could not serve: first
 * cold tier blocks on device pages move to host (gm_overflow_make_room;
 * the caller then tries the device again: *retry), else a new tier block
 * on host pages (gm_overflow_alloc: *out, ALLOCATED, not yet in the
 * pointer map, counted in pool's statistics as the request would have
 * been).
 * GPUMEM_ERR_OUT_OF_MEMORY with a message naming the host budget when
 * the host cannot take it either. */
gpumem_status_t gm_overflow_make_room(gpumem_t* gm, size_t rsize, bool* retry);
gpumem_status_t gm_overflow_alloc(gpumem_t* gm, gm_pool* pool, size_t rsize, gm_block** out);
/* Frees tier block b (out of the pointer map already): it turns PENDING,
 * retiring until its stream's work is done, then its range is unmapped
 * and given back (gm_overflow_retire). On failure b stays allocated (the
 * caller puts it back in the pointer map). */
gpumem_status_t gm_overflow_free(gpumem_t* gm, gm_block* b);
/* Moves tier blocks on host pages back to device pages where there is
 * room and their streams are idle; after_empty_cache: every such block,
 * those that bounced included. */
void gm_overflow_bring_back(gpumem_t* gm, bool after_empty_cache);
/* Gives back the ranges of freed tier blocks whose stream's work is done
 * (events queried; with wait, waited for). */
void gm_overflow_retire(gpumem_t* gm, bool wait);
static inline void gm_overflow_after_free(gpumem_t* gm) {
  if (GM_UNLIKELY(gm->tier_retiring != NULL)) gm_overflow_retire(gm, false);
  if (GM_UNLIKELY((gm->tier_on_host | gm->num_arena_host) != 0) &&
      (uint64_t)gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current < gm->tier_retry_below)
    gm_overflow_bring_back(gm, false);
}
/* A block was handed to a stream (record_stream) with the tier on: it is
 * warm. An arena block's touch is noted beside it (gm_block_note). */
void gm_overflow_note_touch(gpumem_t* gm, gm_block* b);
static inline void gm_overflow_touch(gpumem_t* gm, gm_block* b) {
  if (gm_block_in_tier(b))
    b->seg->tier->last_touch = gm->num_mallocs;
  else if (b->seg->is_arena)
    gm_overflow_note_touch(gm, b);
}
/* Arena block b (out of the pointer map, about to be freed) gives back
 * the host pages under its interior, if it has any: its streams are
 * waited for, the host pages unmapped and released, the slots left
 * unmapped, and its other streams' uses dropped (they are over). On
 * failure nothing changed and the free must not go on. */
gpumem_status_t gm_overflow_arena_free(gpumem_t* gm, gm_block* b);
/* gpumem_check's part: tier blocks counted into the sums, violations. */
typedef struct gm_tier_sums {
  int64_t blocks[GPUMEM_POOL_COUNT], bytes[GPUMEM_POOL_COUNT], requested[GPUMEM_POOL_COUNT];
  int64_t pending[GPUMEM_POOL_COUNT], pending_bytes[GPUMEM_POOL_COUNT]; /* retiring */
  int64_t host[GPUMEM_POOL_COUNT];
  int64_t device[GPUMEM_POOL_COUNT]; /* device pages under tier blocks (reserved) */
  int64_t kept[GPUMEM_POOL_COUNT];   /* host pages kept for reuse (large pool) */
} gm_tier_sums;
size_t gm_overflow_check(gpumem_t* gm, gm_tier_sums* sums, char* msg, size_t len);
/* Releases every tier block (allocator teardown). */
void gm_overflow_destroy(gpumem_t* gm);
/* Gives back the host pages kept for reuse (empty_cache, teardown). */
void gm_overflow_release_kept(gpumem_t* gm);
/* A line for the out-of-memory report: what the tier holds (empty when
 * the tier is off). */
void gm_overflow_describe(gpumem_t* gm, char* out, size_t cap);

/* ---- alloc.c helpers used across files ---- */
gpumem_status_t gm_backend_status(gpumem_t* gm, int call, gpumem_status_t s);
/* gpumem_free with the lock held. */
gpumem_status_t gm_free_locked(gpumem_t* gm, uintptr_t addr);
/* Counts b (ALLOCATED, in the pointer map) as handed out for a request of
 * size bytes on stream: serial, statistics, history and recording. */
void gm_note_allocated(gpumem_t* gm, gm_block* b, size_t size, bool small, gpumem_stream_t stream);
/* Statistics: on every malloc and free, so inline; a delta's sign is
 * usually known where it is called, and the branch folds away. */
/* Where the sign is known (the malloc and free paths): no branch on it. */
static inline void gm_stat_grow(gpumem_stat_t* s, int64_t n) {
  s->current += n;
  s->allocated += n;
  if (s->current > s->peak) s->peak = s->current;
}
static inline void gm_stat_shrink(gpumem_stat_t* s, int64_t n) {
  s->current -= n;
  s->freed += n;
}

static inline void gm_stat_add(gpumem_stat_t* s, int64_t delta) {
  if (delta > 0)
    gm_stat_grow(s, delta);
  else
    gm_stat_shrink(s, -delta);
}

/* Adds to the all-pools entry and to the small or large one. */
static inline void gm_stat_pool_add(gpumem_t* gm, gpumem_stat_t* arr, bool small, int64_t delta) {
  (void)gm;
  gm_stat_add(&arr[GPUMEM_POOL_ALL], delta);
  gm_stat_add(&arr[small ? GPUMEM_POOL_SMALL : GPUMEM_POOL_LARGE], delta);
}
static inline void gm_stat_pool_grow(gpumem_stat_t* arr, bool small, int64_t n) {
  gm_stat_grow(&arr[GPUMEM_POOL_ALL], n);
  gm_stat_grow(&arr[small ? GPUMEM_POOL_SMALL : GPUMEM_POOL_LARGE], n);
}
static inline void gm_stat_pool_shrink(gpumem_stat_t* arr, bool small, int64_t n) {
  gm_stat_shrink(&arr[GPUMEM_POOL_ALL], n);
  gm_stat_shrink(&arr[small ? GPUMEM_POOL_SMALL : GPUMEM_POOL_LARGE], n);
}
/* n reserved bytes change pools (a page made live in a small segment, or
 * back): freed from one pool and allocated to the other, and both in the
 * all-pools entry too, so each pool's current stays allocated - freed and
 * the two pools' totals add up to the all-pools ones, as in PyTorch's
 * table. The all-pools current, and so its peak, does not move. */
static inline void gm_stat_pool_move(gpumem_stat_t* arr, bool to_small, int64_t n) {
  gm_stat_shrink(&arr[to_small ? GPUMEM_POOL_LARGE : GPUMEM_POOL_SMALL], n);
  gm_stat_grow(&arr[to_small ? GPUMEM_POOL_SMALL : GPUMEM_POOL_LARGE], n);
  arr[GPUMEM_POOL_ALL].allocated += n;
  arr[GPUMEM_POOL_ALL].freed += n;
}
void gm_segment_link(gpumem_t* gm, gm_segment* seg);
void gm_segment_unlink(gpumem_t* gm, gm_segment* seg);
/* Links a new segment [addr, addr+size) whose one block b is free and
 * indexed in pool. */
void gm_segment_install(gpumem_t* gm, gm_segment* seg, gm_block* b, gm_pool* pool, uintptr_t addr,
                        size_t size);

/* Counts a backend call and makes sure a failure carries a message: a
 * backend that fails without writing one is named rather than leaving an
 * older, unrelated message in place. A call that succeeds leaves the
 * message alone: it may be the cause of a failure still being handled
 * (cleanup and reclaim make calls before the report is written). */
#define GM_CALL(gm, kind, expr)                                      \
  (gm_call_begin(), (gm)->stats.backend_calls[GPUMEM_CALL_##kind]++, \
   gm_backend_status((gm), GPUMEM_CALL_##kind, (expr)))

/* GM_CALL for the mapping calls (create_page, map, unmap, release_page),
 * timed on the host's monotonic clock into stats.mapping_time_ns: on a GPU
 * each takes tens of microseconds, so the two clock reads are noise, and
 * the figure says what moving memory really cost this process. */
uint64_t gm_now_ns(void);
static inline gpumem_status_t gm_mapping_call_end(gpumem_t* gm, uint64_t t0, gpumem_status_t s) {
  gm->stats.mapping_time_ns += (int64_t)(gm_now_ns() - t0);
  return s;
}
#define GM_MAP_CALL(gm, kind, expr)     \
  ((gm)->mapping_call_t0 = gm_now_ns(), \
   gm_mapping_call_end((gm), (gm)->mapping_call_t0, GM_CALL(gm, kind, expr)))

static inline bool gm_block_is_split(const gm_block* b) {
  return b->prev || b->next;
}
/* Which pool's statistics a live block counts in: its pool's, except in a
 * plan arena (small and large requests together) or a large arena beside
 * a small pool (a small request in a large hole: alloc.c,
 * small_in_large_hole), where its size says, as for the request
 * (PyTorch's small_pool / large_pool split). */
static inline bool gm_block_stat_small(const gm_block* b) {
  return b->pool->stat_by_size ? b->size <= GM_SMALL_SIZE : b->pool->is_small;
}
static inline size_t gm_round_up(size_t x, size_t unit) {
  return (x + unit - 1) / unit * unit;
}

/* ---- history (history.c) ---- */

/* What an event of the history records, named as in PyTorch's traces. */
enum {
  GM_HISTORY_ALLOC = 0,
  GM_HISTORY_FREE_REQUESTED = 1,
  GM_HISTORY_FREE_COMPLETED = 2,
  GM_HISTORY_OOM = 3,
};
GM_COLD void gm_history_note(gpumem_t* gm, int action, uintptr_t addr, uint64_t size,
                             gpumem_stream_t stream);
/* The same for block b: its address and size, its pool's stream. */
GM_COLD void gm_history_note_block(gpumem_t* gm, int action, const gm_block* b);
void gm_history_destroy(gpumem_t* gm);

/* ipc.c: closes the descriptors exported for the allocation at addr (on
 * its free); everything at gpumem_destroy. */
void gm_ipc_forget_export(gpumem_t* gm, uintptr_t addr);
/* Whether the allocation at addr was exported (another process may map
 * its device pages: they must stay where they are). */
bool gm_ipc_exported(const gpumem_t* gm, uintptr_t addr);
void gm_ipc_destroy(gpumem_t* gm);
/* One predictable branch where nothing is recorded. */
static inline void gm_history_add(gpumem_t* gm, int action, uintptr_t addr, uint64_t size,
                                  gpumem_stream_t stream) {
  if (GM_UNLIKELY(gm->history != NULL)) gm_history_note(gm, action, addr, size, stream);
}
/* Recording the requests as a trace (record.c): op 'a', 'f' or 'r'. One
 * load and branch while off. */
GM_COLD void gm_record_note(gpumem_t* gm, char op, uint64_t serial, uint64_t size,
                            gpumem_stream_t stream);
gpumem_status_t gm_record_start(gpumem_t* gm, const char* path);
void gm_record_destroy(gpumem_t* gm);
static inline void gm_record(gpumem_t* gm, char op, uint64_t serial, uint64_t size,
                             gpumem_stream_t stream) {
  if (GM_UNLIKELY(gm->recorder != NULL)) gm_record_note(gm, op, serial, size, stream);
}
static inline void gm_history_add_block(gpumem_t* gm, int action, const gm_block* b) {
  if (GM_UNLIKELY(gm->history != NULL)) gm_history_note_block(gm, action, b);
}

/* Option oom_snapshot, with the lock held: writes the snapshot and says
 * where (or why not) in said. */
GM_COLD bool gm_oom_snapshot(gpumem_t* gm, char* said, size_t said_cap);

/* ---- shared budgets (budget.c) ---- */

typedef struct gm_budget gm_budget;
gpumem_status_t gm_budget_init(gpumem_t* gm);
void gm_budget_destroy(gpumem_t* gm);
/* Takes bytes from the budget before the device is asked for them:
 * GPUMEM_ERR_OUT_OF_MEMORY (a limit) when they would pass it. */
gpumem_status_t gm_budget_take(gpumem_t* gm, uint64_t bytes);
/* Gives back bytes released to the device (or never obtained). */
void gm_budget_give(gpumem_t* gm, uint64_t bytes);
/* Whether bytes more would fit now (no take). */
bool gm_budget_has_room(const gpumem_t* gm, uint64_t bytes);
/* What the budget's other allocators hold now. */
uint64_t gm_budget_others(const gpumem_t* gm);
/* Reserved bytes given back to the device: the statistics, and the
 * shared budget when there is one. */
static inline void gm_reserved_released(gpumem_t* gm, bool small, size_t bytes) {
  gm_stat_pool_add(gm, gm->stats.reserved_bytes, small, -(int64_t)bytes);
  if (gm->budget) gm_budget_give(gm, bytes);
}

/* ---- leak detection (leaks.c) ---- */

/* The allocations gm still holds, on stderr, when there are any (option
 * leak_check); when says at what moment. */
GM_COLD void gm_leak_check_report(gpumem_t* gm, const char* when);
/* For the out-of-memory report, with the lock held: " Live: N allocations
 * in G groups ...; the largest: ..." (the three groups holding most), or
 * "" when nothing is live or host memory is short. */
GM_COLD void gm_live_groups_locked(gpumem_t* gm, char* out, size_t cap);

/* ---- publication (publish.c) ---- */

/* $GPUMEM_PUBLISH_DIR or /dev/shm: where publication and budget files live. */
const char* gm_publish_dir(void);
bool gm_publish_wanted(const gpumem_t* gm);
GM_COLD void gm_publish_now(gpumem_t* gm);
void gm_publish_close(gpumem_t* gm);
/* After a change a reader should see at once (an out-of-memory failure,
 * empty_cache, a limit). */
static inline void gm_publish_if_wanted(gpumem_t* gm) {
  if (gm->publish_wanted) gm_publish_now(gm);
}
/* After an allocation or a free: one operation in 64, or reserved memory
 * changed. One predictable branch where nothing is published. */
static inline void gm_publish_after_op(gpumem_t* gm) {
  if (GM_UNLIKELY(gm->publish_wanted) &&
      (++gm->publish_tick >= 64 ||
       gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current != gm->published_reserved))
    gm_publish_now(gm);
}

#endif
