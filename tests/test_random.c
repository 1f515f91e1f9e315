/* Randomized differential test: long random sequences of malloc, free (in
 * any order), record_stream onto other streams, empty_cache and a hard
 * limit, run against a reference model that is nothing but the list of live
 * allocations (pointer, size, stream, id).
 *
 * After every operation the allocator must pass gpumem_check and its
 * statistics must agree with the model. On a host-backed device every
 * allocation also carries a pattern derived from its id, written and read
 * through gpumem_sim_host_ptr one device page at a time: two live
 * allocations sharing a byte, or a page of a live block unmapped or moved
 * while free pages are reclaimed and remapped, show up as a mismatch.
 *
 * A spy backend between the allocator and the device remembers up to when
 * each stream's work is known complete (events seen complete, streams
 * synchronized). Memory freed after use on other streams must not be
 * handed out, and no page may be unmapped, before every stream that used
 * it is known done up to the free. Out-of-memory answers are judged too:
 * the device or the limit must really lack room for the request.
 *
 * Every policy runs: pytorch (plain segments) and default (arenas) under each
 * reclaim mode; odd seeds run host-backed with a small device and moderate
 * sizes, even seeds without backing with sizes up to 64 MiB.
 *
 * Scale: GPUMEM_RANDOM_OPS (operations per seed in the random phase,
 * default 12500; a number on the command line overrides it),
 * GPUMEM_RANDOM_SEEDS (seeds per configuration, default 4),
 * GPUMEM_RANDOM_SEED (first seed, to reproduce a reported run). The
 * default size was 100000 operations; 25000 and 12500, with the loop and
 * limit phases kept at their lengths (LOOP_ITERATIONS, LIMIT_OPS), caught
 * each of three faults planted in the engine in as many configurations: a
 * stream's use forgotten when a block is freed (all ten), pages taken back
 * before their fence completed (three), and a shared plan arena crediting
 * a block used on another stream as the taker's own (one: only the loop
 * phase reaches it). `--config NAME` runs one configuration only:
 * CTest registers one test per configuration, so that they run in parallel and each stays well
 * inside its timeout under the sanitizers. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "spy_backend.h"
#include "test_config_list.h"
#include "test_util.h"

#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

/* ---- random numbers: splitmix64, so a seed names one exact run ---- */

typedef struct rng {
  uint64_t state;
} rng_t;

static uint64_t rng_next(rng_t* r) {
  uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t rng_below(rng_t* r, uint64_t n) {
  return n ? rng_next(r) % n : 0;
}

/* ---- configurations ---- */

static const config_t configs[] = {
    {"pytorch", GPUMEM_POLICY_PYTORCH, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_BESTFIT, 0, 0},
    {"default/lazy", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_BESTFIT, 0, 0},
    {"default/eager", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_EAGER, GPUMEM_PLACEMENT_BESTFIT, 0, 0},
    {"default/pressure", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_PRESSURE, GPUMEM_PLACEMENT_BESTFIT,
     0, 0},
    /* Planned placement: the random phase rarely repeats, so these runs
     * also replay a loop (loop_phase) that does, and then changes. */
    {"default/lazy/planned", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_PLANNED,
     0, 0},
    {"default/pressure/planned", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_PRESSURE,
     GPUMEM_PLACEMENT_PLANNED, 0, 0},
    /* Several pages per mapping (until a limit or refusal): reclaimed only whole. */
    {"default/pressure/map8", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_PRESSURE,
     GPUMEM_PLACEMENT_BESTFIT, 8, 0},
    /* Fences: runs of 8 pages and the default's budgets, arenas growing
     * past a mark 0.2% above the high water; no limit until the limit
     * phase. */
    {"default/fenced", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_BESTFIT, 8, 2},
    /* The same with lend:on: lent blocks freed wait for their borrower's
     * event, and a lender's probe does not count them (own_frees). */
    {"default/fenced/on", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_BESTFIT, 8,
     3},
    /* What a user gets: large mappings uncapped, the move budget, and a
     * planner from the limit phase's set_limit on (auto placement). */
    {"default", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_AUTO, 512, 1},
    /* The overflow tier: past the device or the limit, host pages under
     * ranges of their own, moved back and out at frees, empty_cache and
     * pressure, with a host budget that the limit phase spends. */
    {"default/overflow", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_AUTO, 512, 4},
    /* The same with one page per mapping: arena blocks own their pages,
     * and cold ones (and hinted ones) move to host pages and back. */
    {"default/overflow/fine", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_AUTO, 1,
     5},
};

/* Streams allocations are made on; record_stream also names a fourth one
 * that never allocates, as a side stream of copies would. */
static const gpumem_stream_t alloc_streams[] = {0, 0x100, 0x200};
static const gpumem_stream_t use_streams[] = {0, 0x100, 0x200, 0x300};

/* A stream's bit in a mask over use_streams (0 for any other stream). */
static unsigned stream_bit(gpumem_stream_t stream) {
  for (unsigned k = 0; k < 4; k++) {
    if (use_streams[k] == stream) return 1u << k;
  }
  return 0;
}

/* ---- the model ---- */

typedef struct live {
  uintptr_t ptr;
  size_t size;
  gpumem_stream_t stream;
  uint64_t id;
  unsigned uses; /* bit i: recorded on use_streams[i], another stream */
} live_t;

/* Memory freed while other streams may still use it: [ptr, ptr+size)
 * must not be handed out before those streams' work up to the free
 * (moment t) is known complete. */
typedef struct quarantine {
  uintptr_t ptr;
  size_t size;
  uint64_t t;
  unsigned uses;
  int own; /* the block's own stream (loop_phase): dropped once its bytes are taken again */
} quarantine_t;

typedef struct run {
  const config_t* cfg;
  uint64_t seed;
  rng_t rng;
  int host_backed;
  gpumem_backend_t* sim;
  spy_t spy; /* the allocator's view of the device */
  gpumem_t* gm;
  size_t page_size;
  size_t capacity;
  size_t max_size;   /* largest request */
  size_t budget_max; /* live bytes the run aims at, at most */
  size_t budget;     /* current aim, moved now and then */
  size_t limit;      /* hard limit in force, 0 = none */
  int64_t prev_reserved;
  long op;
  const char* phase;
  int failed;

  live_t* live;
  size_t n, cap;
  quarantine_t* quar;
  size_t nquar, quar_cap;
  /* Per device page (default policy): for each of use_streams, the moment
   * a block on the page was last freed after use on that stream; the page
   * may be unmapped only once those streams are done up to then. Open
   * addressing by page number (never 0: device addresses are high). */
  uint64_t* page_keys;
  uint64_t (*page_freed)[4];
  size_t page_mask, page_count;
  long unmaps_checked;
  long reuses_checked;  /* pages of new blocks checked against earlier uses */
  long aliases_checked; /* pages shared with another address, checked byte by byte */
  /* the device's mappings as the spy saw them: [addr, addr+size) each */
  uintptr_t* map_addr;
  gpumem_phys_t* map_handle; /* a page may be mapped at two addresses (an alias) */
  size_t* map_size;
  size_t nmaps, maps_cap;
  long multi_page_maps; /* mappings of more than one page */
  uint64_t next_id;
  /* sums over live allocations, kept as the model changes */
  uint64_t sum_size, sum_round;
  uint64_t n_small, sum_small_size, sum_small_round;

  /* patterns: a random tape; allocation id reads it from its own offset */
  const unsigned char* tape;
  size_t tape_len;

  long allocs, frees, records, hints, ooms, empties, verified, deferred, ordered_frees;
  long reuses_ordered; /* reuses of bytes another stream used, ordered by stream waits */
  int quarantine_own;  /* every free is quarantined, its own stream included (loop_phase) */
  /* The configuration lends across streams: every free is quarantined
   * throughout, since a lender may take back at the same address what a
   * borrower freed only once the device orders it after the borrower. */
  int lends;
  uint64_t bytes_verified;
  size_t max_live;
} run_t;

static void run_context(const run_t* r) {
  fprintf(stderr, "  in run %s seed %llu (%s), phase %s, op %ld, %zu live\n", r->cfg->name,
          (unsigned long long)r->seed, r->host_backed ? "host-backed" : "no backing", r->phase,
          r->op, r->n);
}

/* A check that stops the run on failure: everything after it would only
 * repeat the first symptom. */
static void run_failed(run_t* r) {
  run_context(r);
  r->failed = 1;
}

#define RUN_CHECK(r, cond, ...) CHECK_MSG_THEN_(cond, #cond, run_failed(r), __VA_ARGS__)

static size_t round512(size_t size) {
  return size < 512 ? 512 : (size + 511) / 512 * 512;
}

/* The pytorch rules' segment for a request (PyTorch's allocation sizes). */
static size_t pytorch_segment(size_t size) {
  size_t r = round512(size);
  if (r <= MIB) return 2 * MIB;
  if (r < 10 * MIB) return 20 * MIB;
  return (r + 2 * MIB - 1) / (2 * MIB) * (2 * MIB);
}

/* ---- device bytes through the host: one page at a time ---- */

/* Host memory of consecutive device pages is not contiguous (a mapped page
 * is its own host buffer), so every copy is cut at page boundaries and each
 * piece is resolved on its own. NULL host pointers (an unmapped page under
 * a live allocation) make the copy fail. */
typedef enum { COPY_IN, COPY_OUT } copy_dir_t;

static int device_copy(run_t* r, copy_dir_t dir, uintptr_t addr, unsigned char* buf, size_t len) {
  size_t ps = r->page_size;
  while (len > 0) {
    size_t piece = ps - (size_t)(addr % ps);
    if (piece > len) piece = len;
    unsigned char* host = gpumem_sim_host_ptr(r->sim, addr);
    if (!host) return -1;
    if (dir == COPY_IN) {
      memcpy(host, buf, piece);
    } else {
      memcpy(buf, host, piece);
    }
    addr += piece;
    buf += piece;
    len -= piece;
  }
  return 0;
}

/* Compares device bytes with expected ones without a bounce buffer: the
 * same page-by-page walk. Returns the offset of the first difference, or
 * len when equal; (size_t)-1 when a page is not mapped. */
static size_t device_compare(run_t* r, uintptr_t addr, const unsigned char* want, size_t len) {
  size_t ps = r->page_size, done = 0;
  while (done < len) {
    size_t piece = ps - (size_t)((addr + done) % ps);
    if (piece > len - done) piece = len - done;
    const unsigned char* host = gpumem_sim_host_ptr(r->sim, addr + done);
    if (!host) return (size_t)-1;
    if (memcmp(host, want + done, piece) != 0) {
      for (size_t i = 0; i < piece; i++) {
        if (host[i] != want[done + i]) return done + i;
      }
    }
    done += piece;
  }
  return len;
}

/* The pattern of allocation id at byte offset o is tape[(start(id) + o) %
 * tape_len]: a random tape read from an id-dependent start. Different ids
 * start at different places, and the tape's length is no multiple of a
 * page, so overlapping allocations and swapped pages both read wrong. The
 * expected bytes are materialized in runs straight from the tape, so
 * filling and checking cost two memcpy/memcmp per piece. */
static size_t pattern_start(const run_t* r, uint64_t id) {
  uint64_t h = id * 0x9E3779B97F4A7C15ull;
  return (size_t)((h ^ (h >> 29)) % r->tape_len);
}

static int pattern_fill(run_t* r, const live_t* a) {
  size_t pos = pattern_start(r, a->id), done = 0;
  while (done < a->size) {
    size_t piece = r->tape_len - pos;
    if (piece > a->size - done) piece = a->size - done;
    if (device_copy(r, COPY_IN, a->ptr + done, (unsigned char*)r->tape + pos, piece) != 0) {
      return -1;
    }
    done += piece;
    pos = 0;
  }
  return 0;
}

/* Verifies the whole pattern of a; reports the first bad byte. */
static void pattern_verify(run_t* r, const live_t* a, const char* when) {
  size_t pos = pattern_start(r, a->id), done = 0;
  while (done < a->size && !r->failed) {
    size_t piece = r->tape_len - pos;
    if (piece > a->size - done) piece = a->size - done;
    size_t bad = device_compare(r, a->ptr + done, r->tape + pos, piece);
    RUN_CHECK(r, bad == piece, "%s: allocation #%llu at 0x%lx (%zu bytes) %s at offset %zu", when,
              (unsigned long long)a->id, (unsigned long)a->ptr, a->size,
              bad == (size_t)-1 ? "has an unmapped page" : "lost its pattern",
              bad == (size_t)-1 ? done : done + bad);
    done += piece;
    pos = 0;
  }
  r->verified++;
  r->bytes_verified += a->size;
}

/* ---- model checks ---- */

static int cmp_live_ptr(const void* x, const void* y) {
  const live_t* a = x;
  const live_t* b = y;
  return a->ptr < b->ptr ? -1 : a->ptr > b->ptr ? 1 : 0;
}

/* Calls fn for each page under the blocks of the live allocations (the
 * requests rounded to 512 bytes), once each, in address order. Sorts
 * r->live. */
static void visit_live_pages(run_t* r, void (*fn)(run_t* r, uintptr_t page, void* arg), void* arg) {
  qsort(r->live, r->n, sizeof *r->live, cmp_live_ptr);
  uintptr_t last_page = UINTPTR_MAX;
  for (size_t i = 0; i < r->n; i++) {
    uintptr_t first = r->live[i].ptr / r->page_size;
    uintptr_t end = (r->live[i].ptr + round512(r->live[i].size) - 1) / r->page_size;
    if (first == last_page) first++;
    for (uintptr_t p = first; p <= end && end >= first; p++) fn(r, p, arg);
    if (last_page == UINTPTR_MAX || end > last_page) last_page = end;
  }
}

static void count_page(run_t* r, uintptr_t page, void* arg) {
  (void)r, (void)page;
  ++*(uint64_t*)arg;
}

/* Pages of size ps under the blocks of the live allocations, counted once
 * each. Sorts r->live. */
static uint64_t live_pages(run_t* r) {
  uint64_t pages = 0;
  visit_live_pages(r, count_page, &pages);
  return pages;
}

/* A growable list of numbers; out of host memory fails the run. */
typedef struct u64_list {
  uint64_t* v;
  size_t n, cap;
} u64_list;

static bool u64_push(run_t* r, u64_list* l, uint64_t x) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 256;
    uint64_t* grown = realloc(l->v, cap * sizeof *grown);
    if (!grown) {
      RUN_CHECK(r, 0, "out of host memory");
      return false;
    }
    l->v = grown;
    l->cap = cap;
  }
  l->v[l->n++] = x;
  return true;
}

/* Sorts the live set by address and checks neighbours pairwise: no two
 * live allocations share a byte. */
static void check_no_overlap_sorted(run_t* r) {
  qsort(r->live, r->n, sizeof *r->live, cmp_live_ptr);
  for (size_t i = 1; i < r->n && !r->failed; i++) {
    const live_t* a = &r->live[i - 1];
    const live_t* b = &r->live[i];
    RUN_CHECK(r, a->ptr + a->size <= b->ptr,
              "live allocations overlap: #%llu [0x%lx, +%zu) and #%llu [0x%lx, +%zu)",
              (unsigned long long)a->id, (unsigned long)a->ptr, a->size, (unsigned long long)b->id,
              (unsigned long)b->ptr, b->size);
  }
}

/* The invariants checked after every operation. */
static void check_state(run_t* r) {
  size_t violations = gpumem_check(r->gm);
  RUN_CHECK(r, violations == 0, "gpumem_check found %zu violations: %s", violations,
            gpumem_last_error());
  if (r->failed) return;
  gpumem_stats_t s;
  gpumem_get_stats(r->gm, &s);
  const int A = GPUMEM_POOL_ALL, S = GPUMEM_POOL_SMALL, L = GPUMEM_POOL_LARGE;
  RUN_CHECK(r, s.allocation[A].current == (int64_t)r->n, "allocations %lld, model %zu",
            (long long)s.allocation[A].current, r->n);
  RUN_CHECK(r, s.allocation[S].current == (int64_t)r->n_small, "small allocations %lld, model %llu",
            (long long)s.allocation[S].current, (unsigned long long)r->n_small);
  RUN_CHECK(r, s.requested_bytes[A].current == (int64_t)r->sum_size, "requested %lld, model %llu",
            (long long)s.requested_bytes[A].current, (unsigned long long)r->sum_size);
  RUN_CHECK(r, s.requested_bytes[S].current == (int64_t)r->sum_small_size,
            "small requested %lld, model %llu", (long long)s.requested_bytes[S].current,
            (unsigned long long)r->sum_small_size);
  /* Small blocks are always split down to the rounded request, so the
   * small pool's allocated bytes are exact under both policies. */
  RUN_CHECK(r, s.allocated_bytes[S].current == (int64_t)r->sum_small_round,
            "small allocated %lld, model %llu", (long long)s.allocated_bytes[S].current,
            (unsigned long long)r->sum_small_round);
  int64_t large_round = (int64_t)(r->sum_round - r->sum_small_round);
  if (r->cfg->policy == GPUMEM_POLICY_DEFAULT) {
    /* Arenas split at 512-byte granularity whatever the remainder. */
    RUN_CHECK(r, s.allocated_bytes[L].current == large_round, "large allocated %lld, model %lld",
              (long long)s.allocated_bytes[L].current, (long long)large_round);
  } else {
    /* A large block stays whole when at most 1 MiB would remain. */
    int64_t slack = (int64_t)((r->n - r->n_small) * MIB);
    RUN_CHECK(r,
              s.allocated_bytes[L].current >= large_round &&
                  s.allocated_bytes[L].current <= large_round + slack,
              "large allocated %lld outside [%lld, %lld]", (long long)s.allocated_bytes[L].current,
              (long long)large_round, (long long)(large_round + slack));
  }
  RUN_CHECK(r, s.allocated_bytes[A].current >= s.requested_bytes[A].current,
            "allocated %lld < requested %lld", (long long)s.allocated_bytes[A].current,
            (long long)s.requested_bytes[A].current);
  RUN_CHECK(r, s.active_bytes[A].current >= s.allocated_bytes[A].current,
            "active %lld < allocated %lld", (long long)s.active_bytes[A].current,
            (long long)s.allocated_bytes[A].current);
  /* (blocks of the overflow tier on host pages are active, not reserved) */
  RUN_CHECK(r, s.reserved_bytes[A].current + s.host_bytes[A].current >= s.active_bytes[A].current,
            "reserved %lld + host-backed %lld < active %lld",
            (long long)s.reserved_bytes[A].current, (long long)s.host_bytes[A].current,
            (long long)s.active_bytes[A].current);
  gpumem_sim_counters_t c = sim_counters(r->sim);
  RUN_CHECK(r, (uint64_t)s.reserved_bytes[A].current == c.bytes_in_use,
            "reserved %lld, the device holds %llu", (long long)s.reserved_bytes[A].current,
            (unsigned long long)c.bytes_in_use);
  /* Nothing may take memory past the limit: above it, reserved only falls. */
  if (r->limit && s.reserved_bytes[A].current > (int64_t)r->limit) {
    RUN_CHECK(r, s.reserved_bytes[A].current <= r->prev_reserved,
              "reserved grew from %lld to %lld past the limit %zu", (long long)r->prev_reserved,
              (long long)s.reserved_bytes[A].current, r->limit);
  }
  r->prev_reserved = s.reserved_bytes[A].current;
}

/* ---- operations ---- */

static size_t pick_size(run_t* r) {
  rng_t* g = &r->rng;
  size_t ps = r->page_size, max = r->max_size;
  uint64_t c = rng_below(g, 1000);
  size_t size;
  if (c < 30) return 0;
  if (c < 180) {
    size = 1 + rng_below(g, 512); /* below one block */
  } else if (c < 380) {
    size = 512 * (1 + rng_below(g, r->host_backed ? 512 : 2048)); /* 512-multiples */
  } else if (c < 410) {
    size = ps * (1 + rng_below(g, r->host_backed ? 1 : 8)); /* exactly whole pages */
  } else if (c < 440) {
    /* a page multiple give or take a little: straddles one more page */
    size = ps * (1 + rng_below(g, r->host_backed ? 1 : 4)) + rng_below(g, 1024);
    size = size > 512 ? size - 512 : size;
  } else if (c < 470) {
    /* the pytorch thresholds: 1 MiB (small/large), 10 MiB (segment rule) */
    static const size_t edges[] = {MIB - 1, MIB, MIB + 1, 10 * MIB - 1, 10 * MIB, 10 * MIB + 1};
    size = edges[rng_below(g, r->host_backed ? 3 : 6)];
  } else {
    /* log-uniform over 1 B .. max; host-backed runs keep large ones rare
     * so that writing every byte stays affordable */
    unsigned top = 0;
    while (((size_t)2 << top) <= max) top++;
    unsigned bits = (unsigned)rng_below(g, top + 1);
    if (r->host_backed && bits > 18 && rng_below(g, 8) != 0) bits = (unsigned)rng_below(g, 19);
    size = ((size_t)1 << bits) + rng_below(g, (size_t)1 << bits);
  }
  return size > max ? max : size;
}

/* An out-of-memory answer is right only when the device or the limit
 * really refused what the policy needed. The retry ladder has emptied the
 * cache by then, so the room left must be smaller than the request's need:
 * its segment (pytorch), or the pages its block can span, ceil(size/page)
 * + 1 (default; fewer when edge pages are shared, hence an upper bound). */
static int oom_justified(run_t* r, size_t size, char* why, size_t why_len) {
  gpumem_stats_t s;
  gpumem_get_stats(r->gm, &s);
  gpumem_sim_counters_t c = sim_counters(r->sim);
  uint64_t ps = r->page_size;
  uint64_t need = r->cfg->policy == GPUMEM_POLICY_PYTORCH
                      ? pytorch_segment(size)
                      : ((round512(size) + ps - 1) / ps + 1) * ps;
  uint64_t reserved = (uint64_t)s.reserved_bytes[GPUMEM_POOL_ALL].current;
  uint64_t room = r->capacity - c.bytes_in_use;
  if (r->limit) {
    uint64_t under_limit = r->limit > reserved ? r->limit - reserved : 0;
    if (under_limit < room) room = under_limit;
  }
  snprintf(why, why_len,
           "needs at most %llu, room %llu: reserved %llu, device free %llu, limit %zu",
           (unsigned long long)need, (unsigned long long)room, (unsigned long long)reserved,
           (unsigned long long)(r->capacity - c.bytes_in_use), r->limit);
  return room < need;
}

static void model_add(run_t* r, live_t a) {
  if (r->n == r->cap) {
    r->cap = r->cap ? r->cap * 2 : 256;
    r->live = realloc(r->live, r->cap * sizeof *r->live);
    if (!r->live) {
      fprintf(stderr, "out of host memory\n");
      exit(2);
    }
  }
  r->live[r->n++] = a;
  size_t rs = round512(a.size);
  r->sum_size += a.size;
  r->sum_round += rs;
  if (rs <= MIB) {
    r->n_small++;
    r->sum_small_size += a.size;
    r->sum_small_round += rs;
  }
  if (r->n > r->max_live) r->max_live = r->n;
}

static void model_remove(run_t* r, size_t i) {
  live_t a = r->live[i];
  size_t rs = round512(a.size);
  r->sum_size -= a.size;
  r->sum_round -= rs;
  if (rs <= MIB) {
    r->n_small--;
    r->sum_small_size -= a.size;
    r->sum_small_round -= rs;
  }
  r->live[i] = r->live[--r->n];
}

static int uses_safe(run_t* r, unsigned uses, uint64_t t, gpumem_stream_t* unsafe) {
  for (int i = 0; i < 4; i++) {
    if ((uses >> i & 1u) && !spy_safe(&r->spy, use_streams[i], t)) {
      *unsafe = use_streams[i];
      return 0;
    }
  }
  return 1;
}

/* Whether work on `user` from now on comes after the work of each stream
 * of uses up to moment t (complete, or ordered by stream waits). */
static int uses_ordered(run_t* r, unsigned uses, uint64_t t, gpumem_stream_t user,
                        gpumem_stream_t* unordered) {
  for (int i = 0; i < 4; i++) {
    if ((uses >> i & 1u) && !spy_ordered(&r->spy, user, use_streams[i], t)) {
      *unordered = use_streams[i];
      return 0;
    }
  }
  return 1;
}

/* A new allocation on `stream` must not overlap memory whose other
 * streams may still be at work, unless the device orders their work
 * before the stream's (stream waits); entries whose streams are done
 * leave the list. */
static void quarantine_check(run_t* r, uintptr_t ptr, size_t size, gpumem_stream_t stream) {
  for (size_t i = 0; i < r->nquar && !r->failed;) {
    quarantine_t* q = &r->quar[i];
    gpumem_stream_t busy = 0;
    if (uses_safe(r, q->uses, q->t, &busy)) {
      *q = r->quar[--r->nquar];
      continue;
    }
    if (uses_ordered(r, q->uses, q->t, stream, &busy)) {
      r->reuses_ordered +=
          (q->uses & ~stream_bit(stream)) && !(ptr + size <= q->ptr || q->ptr + q->size <= ptr);
      /* Bytes taken again whole: the new block's own free stands for them
       * from now on (its stream comes after this one's, just checked). */
      if (q->own && ptr <= q->ptr && q->ptr + q->size <= ptr + size) {
        *q = r->quar[--r->nquar];
        continue;
      }
      i++;
      continue;
    }
    RUN_CHECK(r, ptr + size <= q->ptr || q->ptr + q->size <= ptr,
              "malloc(%zu) = 0x%lx reuses [0x%lx, +%zu) before stream 0x%lx's work was known "
              "complete",
              size, (unsigned long)ptr, (unsigned long)q->ptr, q->size, (unsigned long)busy);
    i++;
  }
}

static void quarantine_add(run_t* r, const live_t* a, uint64_t t) {
  if (r->nquar == r->quar_cap) {
    r->quar_cap = r->quar_cap ? r->quar_cap * 2 : 64;
    r->quar = realloc(r->quar, r->quar_cap * sizeof *r->quar);
    if (!r->quar) {
      fprintf(stderr, "out of host memory\n");
      exit(2);
    }
  }
  quarantine_t q = {a->ptr, a->size, t, a->uses, 0};
  r->quar[r->nquar++] = q;
}

static uint64_t* page_entry(run_t* r, uint64_t page) {
  if (!r->page_keys || 2 * (r->page_count + 1) > r->page_mask + 1) {
    size_t cap = r->page_keys ? 2 * (r->page_mask + 1) : 1024;
    uint64_t* keys = calloc(cap, sizeof *keys);
    uint64_t(*vals)[4] = calloc(cap, sizeof *vals);
    if (!keys || !vals) {
      fprintf(stderr, "out of host memory\n");
      exit(2);
    }
    for (size_t i = 0; r->page_keys && i <= r->page_mask; i++) {
      if (!r->page_keys[i]) continue;
      size_t j = (size_t)(r->page_keys[i] * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
      while (keys[j]) j = (j + 1) & (cap - 1);
      keys[j] = r->page_keys[i];
      memcpy(vals[j], r->page_freed[i], sizeof vals[j]);
    }
    free(r->page_keys);
    free(r->page_freed);
    r->page_keys = keys;
    r->page_freed = vals;
    r->page_mask = cap - 1;
  }
  size_t j = (size_t)(page * 0x9E3779B97F4A7C15ull >> 20) & r->page_mask;
  while (r->page_keys[j] && r->page_keys[j] != page) j = (j + 1) & r->page_mask;
  if (!r->page_keys[j]) {
    r->page_keys[j] = page;
    r->page_count++;
  }
  return r->page_freed[j];
}

/* Physical pages are followed apart from addresses: a page may be mapped
 * at several addresses at once (the allocator's ghosts). Keys in page_entry
 * of the address page a ((a | VA_KEY) -> [1 + handle, unit]) and of the
 * unit-th page-sized part of handle h ((h << 16 | unit | PHYS_KEY) -> the
 * last time each stream used it before a free). */
#define VA_KEY (1ull << 62)
#define PHYS_KEY (1ull << 63)

#define WHERE_KEY (1ull << 61)

/* The physical page at an address, and (*where) the address page each
 * stream last used it through. */
static uint64_t* phys_entry_at(run_t* r, uint64_t va_page, uint64_t** where) {
  uint64_t* va = page_entry(r, va_page | VA_KEY);
  if (!va[0]) return NULL;
  uint64_t key = (va[0] - 1) << 16 | va[1] | PHYS_KEY;
  /* page_entry may move the table: look the second entry up first */
  *where = page_entry(r, key | WHERE_KEY);
  return page_entry(r, key);
}

static int cmp_u64(const void* x, const void* y) {
  uint64_t a = *(const uint64_t*)x, b = *(const uint64_t*)y;
  return a < b ? -1 : a > b;
}

/* The physical page (handle and unit) mapped under a live page. */
static void push_phys_key(run_t* r, uintptr_t p, void* arg) {
  if (r->failed) return;
  uint64_t* va = page_entry(r, p | VA_KEY);
  RUN_CHECK(r, va[0] != 0, "a page under a live block at 0x%lx is not mapped",
            (unsigned long)(p * r->page_size));
  u64_push(r, arg, (va[0] - 1) << 16 | va[1]);
}

/* Physical pages under live blocks, each counted once: a page shared by
 * a request (an alias) is under two addresses. */
static uint64_t live_phys_pages(run_t* r) {
  u64_list keys = {NULL, 0, 0};
  visit_live_pages(r, push_phys_key, &keys);
  if (keys.n) qsort(keys.v, keys.n, sizeof *keys.v, cmp_u64);
  uint64_t distinct = 0;
  for (size_t i = 0; i < keys.n; i++) distinct += i == 0 || keys.v[i] != keys.v[i - 1];
  free(keys.v);
  return distinct;
}

/* Notes that a's pages were in use on its own stream and its other streams
 * up to moment t (the free). */
static void pages_freed(run_t* r, const live_t* a, uint64_t t) {
  if (r->cfg->policy != GPUMEM_POLICY_DEFAULT) return;
  unsigned streams = a->uses | stream_bit(a->stream);
  uint64_t first = a->ptr / r->page_size;
  uint64_t last = (a->ptr + round512(a->size) - 1) / r->page_size;
  for (uint64_t p = first; p <= last; p++) {
    uint64_t* e = page_entry(r, p);
    for (unsigned k = 0; k < 4; k++) {
      if (streams >> k & 1u) e[k] = t;
    }
    uint64_t* where = NULL;
    phys_entry_at(r, p, &where); /* (sizes the table for both entries) */
    uint64_t* phys = phys_entry_at(r, p, &where);
    for (unsigned k = 0; phys && k < 4; k++) {
      if (streams >> k & 1u) {
        phys[k] = t;
        where[k] = p;
      }
    }
  }
}

/* A physical page taken by a block on `stream` through another address
 * than a stream used it before: that stream must be done with it, unless it
 * is the same stream (stream order keeps the uses apart). (Through the same
 * address, the uses are those of blocks at that address: the deferred-free
 * quarantine covers them.) */
/* Page p under block a is also mapped, at another address page, under
 * other live blocks or blocks freed but still used by another stream (the
 * allocator shares a partly used page: an alias)?
 * Then what must hold is byte by byte: the bytes a uses in the page are
 * neither live nor waiting for another stream (quarantined) at the other
 * address. Returns 1 when p is such a page (and checks it), 0 otherwise. */
static int check_alias_page(run_t* r, const live_t* a, uint64_t p) {
  uint64_t ps = r->page_size;
  uint64_t* va = page_entry(r, p | VA_KEY);
  uint64_t handle = va[0] - 1, unit = va[1];
  size_t lo = a->ptr > p * ps ? a->ptr - p * ps : 0;
  size_t hi = a->ptr + round512(a->size) < (p + 1) * ps ? a->ptr + round512(a->size) - p * ps : ps;
  int shared = 0;
  for (size_t m = 0; m < r->nmaps && !r->failed; m++) {
    if (r->map_handle[m] != handle || r->map_size[m] != ps || unit != 0) continue;
    uint64_t q = r->map_addr[m] / ps;
    if (q == p) continue;
    for (size_t i = 0; i < r->n; i++) {
      const live_t* b = &r->live[i];
      uintptr_t b_end = b->ptr + round512(b->size);
      if (b == a || b_end <= q * ps || b->ptr >= (q + 1) * ps) continue;
      shared = 1;
      size_t b_lo = b->ptr > q * ps ? b->ptr - q * ps : 0;
      size_t b_hi = b_end < (q + 1) * ps ? b_end - q * ps : ps;
      RUN_CHECK(r, b_hi <= lo || hi <= b_lo,
                "block 0x%lx uses bytes [%zu, %zu) of a page whose bytes [%zu, %zu) are block "
                "0x%lx's at another address",
                (unsigned long)a->ptr, lo, hi, b_lo, b_hi, (unsigned long)b->ptr);
    }
    for (size_t i = 0; i < r->nquar; i++) {
      const quarantine_t* w = &r->quar[i];
      gpumem_stream_t busy = 0;
      if (w->ptr + w->size <= q * ps || w->ptr >= (q + 1) * ps ||
          uses_ordered(r, w->uses, w->t, a->stream, &busy))
        continue;
      shared = 1;
      size_t w_lo = w->ptr > q * ps ? w->ptr - q * ps : 0;
      size_t w_hi = w->ptr + w->size < (q + 1) * ps ? w->ptr + w->size - q * ps : ps;
      RUN_CHECK(r, w_hi <= lo || hi <= w_lo,
                "block 0x%lx uses bytes of a page that stream 0x%lx may still use at another "
                "address",
                (unsigned long)a->ptr, (unsigned long)busy);
    }
  }
  if (shared) r->aliases_checked++;
  return shared;
}

static void check_phys_reuse(run_t* r, const live_t* a) {
  if (r->cfg->policy != GPUMEM_POLICY_DEFAULT) return;
  uint64_t first = a->ptr / r->page_size;
  uint64_t last = (a->ptr + round512(a->size) - 1) / r->page_size;
  for (uint64_t p = first; p <= last && !r->failed; p++) {
    uint64_t* where = NULL;
    phys_entry_at(r, p, &where);
    uint64_t* e = phys_entry_at(r, p, &where);
    RUN_CHECK(r, e != NULL, "block 0x%lx: page 0x%lx has no mapping the spy saw",
              (unsigned long)a->ptr, (unsigned long)(p * r->page_size));
    if (!e) return;
    int safe = 1;
    unsigned unsafe_k = 0;
    for (unsigned k = 0; k < 4; k++) {
      if (use_streams[k] == a->stream || !e[k] || where[k] == p) continue;
      /* (the device may order the uses: stream waits) */
      if (!spy_ordered(&r->spy, a->stream, use_streams[k], e[k])) safe = 0, unsafe_k = k;
    }
    /* A page shared with live blocks elsewhere is judged by its bytes. */
    if (!safe && check_alias_page(r, a, p)) continue;
    RUN_CHECK(r, safe, "page under 0x%lx (stream 0x%lx) reused while stream 0x%lx may still use it",
              (unsigned long)a->ptr, (unsigned long)a->stream,
              (unsigned long)use_streams[unsafe_k]);
    r->reuses_checked++;
  }
}

/* The spy's map hook: which physical page is at each address now. */
static void note_map(void* arg, uintptr_t addr, size_t size, gpumem_phys_t page) {
  run_t* r = arg;
  for (size_t unit = 0; unit * r->page_size < size; unit++) {
    uint64_t* va = page_entry(r, (addr / r->page_size + unit) | VA_KEY);
    va[0] = (uint64_t)page + 1;
    va[1] = unit;
  }
  if (r->nmaps == r->maps_cap) {
    size_t cap = r->maps_cap ? r->maps_cap * 2 : 256;
    uintptr_t* a = realloc(r->map_addr, cap * sizeof *a);
    if (a) r->map_addr = a;
    size_t* z = realloc(r->map_size, cap * sizeof *z);
    if (z) r->map_size = z;
    gpumem_phys_t* h = realloc(r->map_handle, cap * sizeof *h);
    if (h) r->map_handle = h;
    RUN_CHECK(r, a && z && h, "out of host memory for the mapping model");
    if (!a || !z || !h) return;
    r->maps_cap = cap;
  }
  r->map_addr[r->nmaps] = addr;
  r->map_handle[r->nmaps] = page;
  r->map_size[r->nmaps++] = size;
  r->multi_page_maps += size > r->page_size;
}

/* Mappings inside an unmapped range leave the model (the sim refuses an
 * unmap that cuts one, so none is cut here). */
static void forget_maps(run_t* r, uintptr_t addr, size_t size) {
  for (size_t i = 0; i < r->nmaps;) {
    if (r->map_addr[i] >= addr && r->map_addr[i] < addr + size) {
      r->map_addr[i] = r->map_addr[--r->nmaps];
      r->map_handle[i] = r->map_handle[r->nmaps];
      r->map_size[i] = r->map_size[r->nmaps];
    } else {
      i++;
    }
  }
}

/* Bytes of the physical pages whose mappings hold at least one page under
 * a live block, each counted once (an alias maps one at two addresses):
 * after empty_cache exactly these stay (a mapping goes back only whole). */
static uint64_t live_mapping_bytes(run_t* r) {
  u64_list list = {NULL, 0, 0};
  for (size_t i = 0; i < r->n; i++) {
    uint64_t first = r->live[i].ptr / r->page_size;
    uint64_t end = (r->live[i].ptr + round512(r->live[i].size) - 1) / r->page_size;
    for (uint64_t p = first; p <= end; p++) {
      if (!u64_push(r, &list, p)) {
        free(list.v);
        return 0;
      }
    }
  }
  uint64_t* pages = list.v;
  size_t n = list.n;
  if (n) qsort(pages, n, sizeof *pages, cmp_u64);
  /* (handle, size) of each mapping over a live page, sorted: a handle
   * mapped at two addresses counts once */
  typedef struct {
    gpumem_phys_t handle;
    size_t size;
  } held_t;
  held_t* held = calloc(r->nmaps ? r->nmaps : 1, sizeof *held);
  size_t nheld = 0;
  RUN_CHECK(r, held != NULL, "out of host memory");
  if (!held) {
    free(pages);
    return 0;
  }
  for (size_t i = 0; i < r->nmaps; i++) {
    uint64_t lo = r->map_addr[i] / r->page_size;
    uint64_t hi = lo + r->map_size[i] / r->page_size; /* exclusive */
    size_t a = 0, b = n;                              /* first live page >= lo */
    while (a < b) {
      size_t m = a + (b - a) / 2;
      if (pages[m] < lo)
        a = m + 1;
      else
        b = m;
    }
    if (a < n && pages[a] < hi) held[nheld++] = (held_t){r->map_handle[i], r->map_size[i]};
  }
  if (nheld) qsort(held, nheld, sizeof *held, cmp_u64); /* by handle, the first field */
  uint64_t bytes = 0;
  for (size_t i = 0; i < nheld; i++)
    if (i == 0 || held[i].handle != held[i - 1].handle) bytes += held[i].size;
  free(held);
  free(pages);
  return bytes;
}

/* The spy's unmap hook: a page leaving its address must not still be in
 * use through it by a stream that worked on it before it was freed. */
static void check_unmap(void* arg, uintptr_t addr, size_t size) {
  run_t* r = arg;
  forget_maps(r, addr, size);
  for (uintptr_t at = addr; at < addr + size && !r->failed; at += r->page_size) {
    uint64_t* va = page_entry(r, at / r->page_size | VA_KEY);
    va[0] = va[1] = 0;
    uint64_t* e = page_entry(r, at / r->page_size);
    for (unsigned k = 0; k < 4; k++) {
      RUN_CHECK(r, !e[k] || spy_safe(&r->spy, use_streams[k], e[k]),
                "page 0x%lx unmapped while stream 0x%lx may still use it", (unsigned long)at,
                (unsigned long)use_streams[k]);
      e[k] = 0;
    }
  }
  r->unmaps_checked++;
}

static int64_t pending_bytes(run_t* r) {
  gpumem_stats_t s;
  gpumem_get_stats(r->gm, &s);
  return s.active_bytes[GPUMEM_POOL_ALL].current - s.allocated_bytes[GPUMEM_POOL_ALL].current;
}

/* Allocates; returns the gpumem status (the model holds the result). */
static gpumem_status_t op_malloc(run_t* r, size_t size, gpumem_stream_t stream) {
  void* p = (void*)1;
  clear_error();
  gpumem_status_t st = gpumem_malloc(r->gm, size, stream, &p);
  if (size == 0) {
    RUN_CHECK(r, st == GPUMEM_OK && p == NULL, "malloc(0): %s, %p", gpumem_strerror(st), p);
    return st;
  }
  if (st == GPUMEM_OK) {
    uintptr_t ptr = (uintptr_t)p;
    RUN_CHECK(r, ptr != 0 && ptr % 512 == 0, "malloc(%zu) returned %p", size, p);
    /* The new one against every live one: no shared byte. */
    for (size_t i = 0; i < r->n && !r->failed; i++) {
      const live_t* b = &r->live[i];
      RUN_CHECK(r, ptr + size <= b->ptr || b->ptr + b->size <= ptr,
                "malloc(%zu) = 0x%lx overlaps live #%llu [0x%lx, +%zu)", size, (unsigned long)ptr,
                (unsigned long long)b->id, (unsigned long)b->ptr, b->size);
    }
    quarantine_check(r, ptr, size, stream);
    live_t a = {ptr, size, stream, r->next_id++, 0};
    check_phys_reuse(r, &a);
    model_add(r, a);
    r->allocs++;
    if (r->host_backed) {
      RUN_CHECK(r, pattern_fill(r, &a) == 0, "malloc(%zu) = 0x%lx: a page is not mapped", size,
                (unsigned long)ptr);
    }
    return st;
  }
  RUN_CHECK(r, st == GPUMEM_ERR_OUT_OF_MEMORY, "malloc(%zu) on stream 0x%lx: %s: %s", size,
            (unsigned long)stream, gpumem_strerror(st), gpumem_last_error());
  RUN_CHECK(r, p == NULL, "failed malloc left *out = %p", p);
  RUN_CHECK(r, strstr(gpumem_last_error(), "out of memory") != NULL,
            "OOM message lacks \"out of memory\": \"%s\"", gpumem_last_error());
  char why[200];
  int justified = oom_justified(r, size, why, sizeof why);
  RUN_CHECK(r, justified, "malloc(%zu) reported out of memory with room to spare (%s): %s", size,
            why, gpumem_last_error());
  r->ooms++;
  return st;
}

static void op_free(run_t* r, size_t i) {
  live_t a = r->live[i];
  if (r->host_backed) pattern_verify(r, &a, "before free");
  size_t known = gpumem_allocation_size(r->gm, (void*)a.ptr);
  RUN_CHECK(r, known == a.size, "allocation_size(#%llu) = %zu, model %zu", (unsigned long long)a.id,
            known, a.size);
  int64_t pending_before = a.uses ? pending_bytes(r) : 0;
  uint64_t t = r->spy.clock;
  clear_error();
  gpumem_status_t st = gpumem_free(r->gm, (void*)a.ptr);
  RUN_CHECK(r, st == GPUMEM_OK, "free(0x%lx): %s: %s", (unsigned long)a.ptr, gpumem_strerror(st),
            gpumem_last_error());
  if (a.uses) {
    /* Used on other streams: either deferred (pending, counted active),
     * made safe at once by synchronizing those streams, or (a plan arena
     * shared by streams) ordered before some stream's later work by
     * stream waits: then quarantined, and the reuse checks (malloc,
     * pages) ask that the new user's work come after those streams'. */
    gpumem_stream_t busy = 0;
    if (pending_bytes(r) - pending_before >= (int64_t)round512(a.size)) {
      quarantine_add(r, &a, t);
      r->deferred++;
    } else if (!uses_safe(r, a.uses, t, &busy)) {
      int ordered = 1;
      for (int k = 0; k < 4; k++) {
        if (!(a.uses >> k & 1u)) continue;
        int waited = 0;
        for (int y = 0; y < 4; y++)
          waited |= y != k && spy_ordered(&r->spy, use_streams[y], use_streams[k], t);
        /* Or k is the shared arena's own stream, which the block was
         * handed from to its allocating stream: the free made k wait for
         * that one (ordered_free), k's own later work is in stream order,
         * and a stream that takes the bytes next waits for k then
         * (gm_shared_take; the reuse checks hold it to that). */
        waited |= use_streams[k] != a.stream && spy_ordered(&r->spy, use_streams[k], a.stream, t);
        ordered &= waited;
      }
      RUN_CHECK(r, ordered,
                "free of #%llu used on stream 0x%lx: neither deferred, synchronized nor ordered",
                (unsigned long long)a.id, (unsigned long)busy);
      quarantine_add(r, &a, t);
      r->ordered_frees++;
    }
  }
  if (r->quarantine_own) {
    /* Where a plan arena is shared by streams, another stream may reuse
     * these bytes at this address: only once the device orders it after
     * this block's own stream (the malloc check, with stream order for
     * the same stream). */
    live_t own = a;
    own.uses = stream_bit(a.stream);
    if (own.uses) {
      quarantine_add(r, &own, t);
      r->quar[r->nquar - 1].own = 1;
    }
  }
  pages_freed(r, &a, t);
  model_remove(r, i);
  r->frees++;
}

static void op_record(run_t* r) {
  size_t i = (size_t)rng_below(&r->rng, r->n);
  unsigned k = (unsigned)rng_below(&r->rng, 4);
  gpumem_stream_t s = use_streams[k];
  gpumem_status_t st = gpumem_record_stream(r->gm, (void*)r->live[i].ptr, s);
  RUN_CHECK(r, st == GPUMEM_OK, "record_stream: %s: %s", gpumem_strerror(st), gpumem_last_error());
  if (s != r->live[i].stream) r->live[i].uses |= 1u << k;
  r->records++;
}

/* The overflow tier's hint (gpumem_prefer_host): taken by tier blocks and
 * by arena blocks that own whole pages (moved now when their streams are
 * idle, else first at the next pressure), refused for the others. */
static void op_hint(run_t* r) {
  /* (the largest of a few: most live blocks own no whole page) */
  size_t i = (size_t)rng_below(&r->rng, r->n);
  for (int k = 0; k < 8; k++) {
    size_t j = (size_t)rng_below(&r->rng, r->n);
    if (r->live[j].size > r->live[i].size) i = j;
  }
  gpumem_status_t st = gpumem_prefer_host(r->gm, (void*)r->live[i].ptr);
  RUN_CHECK(r,
            st == GPUMEM_OK || st == GPUMEM_ERR_UNSUPPORTED ||
                (st == GPUMEM_ERR_OUT_OF_MEMORY && strstr(gpumem_last_error(), "host")),
            "prefer_host: %s: %s", gpumem_strerror(st), gpumem_last_error());
  r->hints += st == GPUMEM_OK;
}

/* empty_cache waits for every pending free and returns every cached page or
 * segment; under the default policy what is left is exactly the pages
 * under live blocks. */
static void op_empty_cache(run_t* r) {
  gpumem_status_t st = gpumem_empty_cache(r->gm);
  RUN_CHECK(r, st == GPUMEM_OK, "empty_cache: %s: %s", gpumem_strerror(st), gpumem_last_error());
  r->empties++;
  gpumem_stats_t s;
  gpumem_get_stats(r->gm, &s);
  RUN_CHECK(r,
            s.active_bytes[GPUMEM_POOL_ALL].current == s.allocated_bytes[GPUMEM_POOL_ALL].current,
            "after empty_cache active %lld != allocated %lld (a pending free survived)",
            (long long)s.active_bytes[GPUMEM_POOL_ALL].current,
            (long long)s.allocated_bytes[GPUMEM_POOL_ALL].current);
  if (r->cfg->policy == GPUMEM_POLICY_DEFAULT) {
    uint64_t want = live_phys_pages(r) * r->page_size;
    uint64_t held = live_mapping_bytes(r);
    /* with one page per mapping the two agree; the model of mappings is
     * checked against the model of pages there */
    RUN_CHECK(r, r->cfg->map_pages > 1 || held == want,
              "mapping model: %llu bytes of mappings under live blocks, %llu of pages",
              (unsigned long long)held, (unsigned long long)want);
    /* (the overflow tier's host pages are mappings under live blocks too,
     * held from the host, not the device) */
    RUN_CHECK(r,
              (uint64_t)(s.reserved_bytes[GPUMEM_POOL_ALL].current +
                         s.host_bytes[GPUMEM_POOL_ALL].current) == held,
              "after empty_cache reserved %lld (and %lld host-backed), mappings holding live "
              "pages %llu bytes (live pages alone: %llu)",
              (long long)s.reserved_bytes[GPUMEM_POOL_ALL].current,
              (long long)s.host_bytes[GPUMEM_POOL_ALL].current, (unsigned long long)held,
              (unsigned long long)want);
  } else if (r->n == 0) {
    RUN_CHECK(r, s.reserved_bytes[GPUMEM_POOL_ALL].current == 0 && s.segment[0].current == 0,
              "after empty_cache with nothing live: reserved %lld in %lld segments",
              (long long)s.reserved_bytes[GPUMEM_POOL_ALL].current,
              (long long)s.segment[0].current);
  }
}

/* Verifies a few live patterns: reclaim and remap must not have moved a
 * byte of a live allocation. */
static void verify_some(run_t* r, int count) {
  for (int k = 0; k < count && r->n && !r->failed; k++) {
    pattern_verify(r, &r->live[rng_below(&r->rng, r->n)], "spot check");
  }
}

static void verify_all(run_t* r, const char* when) {
  for (size_t i = 0; i < r->n && !r->failed; i++) pattern_verify(r, &r->live[i], when);
}

/* One random step. Live bytes drift around r->budget: allocations are
 * likelier below it, frees above. */
static void random_step(run_t* r) {
  rng_t* g = &r->rng;
  uint64_t c = rng_below(g, 1000);
  int want_alloc = r->sum_size < r->budget ? 560 : 400;
  if (r->n < 4) want_alloc = 900;
  if (c < 5) {
    op_empty_cache(r);
    if (r->host_backed) verify_some(r, 4);
  } else if (c < 85 && r->n) {
    op_record(r);
  } else if (c < 85 + (uint64_t)want_alloc) {
    op_malloc(r, pick_size(r), alloc_streams[rng_below(g, 3)]);
  } else if (r->n) {
    op_free(r, (size_t)rng_below(g, r->n));
  }
  if (r->host_backed && r->n && rng_below(g, 8) == 0) verify_some(r, 1);
  /* (the tier's configuration alone: the others' sequences stay as they were) */
  if (r->cfg->library_defaults >= 4 && r->n && rng_below(g, 64) == 0) op_hint(r);
}

/* Frees live allocations in random order until keep(r) says stop. */
static void free_until(run_t* r, int (*enough)(run_t*, size_t), size_t arg) {
  while (r->n && !enough(r, arg) && !r->failed) {
    op_free(r, (size_t)rng_below(&r->rng, r->n));
    check_state(r);
  }
}

static int enough_nothing(run_t* r, size_t arg) {
  (void)arg;
  return r->n == 0;
}

static int enough_below_bytes(run_t* r, size_t bytes) {
  return r->sum_size <= bytes;
}

/* Default policy: the retry of a refused request of `size` bytes is sure to
 * succeed once the pages under live blocks plus the pages the request can
 * touch fit under the limit and the device. */
static int enough_pages_for(run_t* r, size_t size) {
  uint64_t ps = r->page_size;
  /* A mapping goes back only whole: one holding any live page stays. */
  uint64_t held = r->cfg->map_pages > 1 ? live_mapping_bytes(r) : live_pages(r) * ps;
  uint64_t need = held + ((round512(size) + ps - 1) / ps + 1) * ps;
  uint64_t cap = r->limit && r->limit < r->capacity ? r->limit : r->capacity;
  return need <= cap;
}

/* Planned placement: a training-like loop. Each iteration replays the same
 * random requests (sizes, streams, which of its own allocations to free),
 * so a plan is built and serves; halfway through the pattern changes, and
 * now and then a stray request or record_stream perturbs an iteration. */
/* Iterations of the loop phase, whatever the random phase's length: shared
 * plan arenas form only after a loop has repeated for a while, and their
 * faults show only in the steps after. */
#define LOOP_ITERATIONS 50
/* Operations of the limit phase, whatever the random phase's length: enough
 * that it always runs out of memory under its limit (checked). */
#define LIMIT_OPS 5000

static void loop_phase(run_t* r, int iters, int len) {
  r->phase = "loop";
  r->quarantine_own = 1;
  size_t base = r->n;
  rng_t pattern = r->rng;
  rng_t stray = {r->rng.state ^ 0xabcdefull};
  for (int it = 0; it < iters && !r->failed; it++) {
    if (it == iters / 2) pattern.state ^= 0x5555;
    r->rng = pattern;
    for (int k = 0; k < len && !r->failed; k++) {
      if (r->n > base && rng_below(&r->rng, 3) == 0) {
        op_free(r, base + (size_t)rng_below(&r->rng, r->n - base));
      } else {
        size_t size = pick_size(r);
        if (size > r->max_size / 4) size = r->max_size / 4; /* room for the loop */
        op_malloc(r, size, alloc_streams[rng_below(&r->rng, 2)]);
      }
      /* record_stream leaves the requests, and so the plan, alone: often
       * (one in ten), so that blocks a shared arena hands between streams
       * are also used on a third; a stray request now and then. */
      uint64_t c = rng_below(&stray, 1000);
      if (c < 100 && r->n > base) {
        rng_t keep = r->rng; /* op_record draws from r->rng: keep the pattern's */
        op_record(r);
        r->rng = keep;
      } else if (c >= 997)
        op_malloc(r, 512 * (1 + rng_below(&stray, 64)), alloc_streams[0]);
      check_state(r);
    }
    /* The iteration's survivors go in a fixed order (strays included). */
    while (r->n > base && !r->failed) {
      op_free(r, r->n - 1);
      check_state(r);
    }
  }
  r->rng = stray;
  r->quarantine_own = r->lends;
  gpumem_stats_t st;
  gpumem_get_stats(r->gm, &st);
  /* The loop's two streams may peak apart: then a plan is declined (its
   * arenas would hold more than the loop has live), which counts. */
  if (iters >= 40)
    RUN_CHECK(r, (st.num_plans > 0 && st.num_planned_allocs > 0) || st.num_plans_declined > 0,
              "the loop was neither planned nor declined");
}

/* The limit phase: OOMs are expected; each must change nothing, and the
 * refused request must succeed once enough is freed. */
static void limit_phase(run_t* r, long ops) {
  r->phase = "limit";
  size_t limit = r->capacity / 4;
  /* Start below the limit so that the phase begins with room. */
  free_until(r, enough_below_bytes, limit / 2);
  if (r->failed) return;
  clear_error();
  gpumem_status_t st = gpumem_set_limit(r->gm, limit);
  RUN_CHECK(r, st == GPUMEM_OK, "set_limit(%zu): %s: %s", limit, gpumem_strerror(st),
            gpumem_last_error());
  RUN_CHECK(r, gpumem_get_limit(r->gm) == limit, "get_limit %zu, want %zu", gpumem_get_limit(r->gm),
            limit);
  r->limit = limit;
  r->budget = limit; /* aim at the limit: about half the allocations refused */
  check_state(r);
  long retries = 0, phase_ooms = 0;
  for (long k = 0; k < ops && !r->failed; k++, r->op++) {
    uint64_t c = rng_below(&r->rng, 100);
    if (c < 55 || r->n == 0) {
      size_t size = pick_size(r);
      gpumem_stream_t stream = alloc_streams[rng_below(&r->rng, 3)];
      gpumem_status_t ms = op_malloc(r, size, stream);
      check_state(r);
      if (ms == GPUMEM_ERR_OUT_OF_MEMORY && !r->failed && ++phase_ooms % 4 == 1) {
        /* Make room, then the same request must go through. */
        if (r->cfg->policy == GPUMEM_POLICY_DEFAULT) {
          free_until(r, enough_pages_for, size);
        } else {
          free_until(r, enough_nothing, 0);
        }
        if (r->failed) break;
        size_t unit = r->cfg->policy == GPUMEM_POLICY_PYTORCH ? pytorch_segment(size) : 0;
        if (unit <= limit) {
          ms = op_malloc(r, size, stream);
          RUN_CHECK(r, ms == GPUMEM_OK, "malloc(%zu) still refused after freeing: %s", size,
                    gpumem_last_error());
          retries++;
        }
      }
    } else if (c < 65) {
      op_record(r);
    } else if (c < 67) {
      op_empty_cache(r);
    } else {
      op_free(r, (size_t)rng_below(&r->rng, r->n));
    }
    check_state(r);
  }
  if (r->failed) return;
  /* A limit phase that never hit the limit tested nothing (a short run
   * may be unlucky; the default length never is). */
  if (ops >= 5000) RUN_CHECK(r, phase_ooms > 0 && retries > 0, "the limit phase saw no OOM");
  gpumem_remove_limit(r->gm);
  r->limit = 0;
  RUN_CHECK(r, gpumem_get_limit(r->gm) == 0, "limit still %zu after remove",
            gpumem_get_limit(r->gm));
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Kept host allocations reused, summed over the runs of the tier's
 * configuration (run_one). */
static long long tier_reuses;

static void run_one(const config_t* cfg, uint64_t seed, int host_backed, long ops,
                    const unsigned char* tape, size_t tape_len) {
  run_t run;
  memset(&run, 0, sizeof run);
  run_t* r = &run;
  r->cfg = cfg;
  r->seed = seed;
  r->rng.state = seed * 0x2545F4914F6CDD1Dull + (uint64_t)(cfg - configs);
  r->host_backed = host_backed;
  r->tape = tape;
  r->tape_len = tape_len;
  r->phase = "main";
  r->next_id = 1;
  /* Devices stay small: every byte of a host-backed one is host memory, and
   * gpumem_check walks every page of every arena (twice the device's size)
   * after each operation. 1 GiB still holds a dozen 64 MiB requests. */
  r->capacity = host_backed ? 512 * MIB : 1 * GIB;
  r->max_size = host_backed ? 16 * MIB : 64 * MIB;
  r->budget_max = host_backed ? 160 * MIB : 384 * MIB;
  r->budget = r->budget_max / 2;

  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = r->capacity;
  so.host_backed = host_backed;
  /* Events stay pending for a few queries: freed blocks used on other
   * streams wait while later mallocs go on. */
  so.event_delay_queries = 1 + (int)(seed % 4);
  r->sim = gpumem_sim_create(&so);
  RUN_CHECK(r, r->sim != NULL, "sim_create: %s", gpumem_last_error());
  if (!r->sim) return;
  r->page_size = so.page_size;
  spy_init(&r->spy, r->sim);
  r->spy.on_unmap = check_unmap;
  r->spy.on_unmap_arg = r;
  r->spy.on_map = note_map;

  gpumem_options_t o = config_options(cfg, so.page_size);
  r->lends = cfg->policy == GPUMEM_POLICY_DEFAULT && o.lend != GPUMEM_LEND_OFF;
  r->quarantine_own = r->lends;
  gpumem_status_t st = GPUMEM_OK;
  r->gm = gpumem_create(&r->spy.be, &o, &st);
  RUN_CHECK(r, r->gm != NULL && st == GPUMEM_OK, "create: %s: %s", gpumem_strerror(st),
            gpumem_last_error());
  if (!r->gm) {
    gpumem_sim_destroy(r->sim);
    spy_fini(&r->spy);
    return;
  }

  double t0 = now_s();
  for (r->op = 0; r->op < ops && !r->failed; r->op++) {
    if (r->op % 2000 == 0) r->budget = (size_t)rng_below(&r->rng, r->budget_max + 1);
    random_step(r);
    check_state(r);
    if (r->op % 1024 == 1023 && !r->failed) check_no_overlap_sorted(r);
    if (r->host_backed && r->op % 10000 == 9999 && !r->failed) verify_all(r, "periodic sweep");
  }
  RUN_CHECK(r, r->failed || cfg->map_pages <= 1 || r->multi_page_maps > 0,
            "map_max of %zu pages, yet no mapping of more than one page was made", cfg->map_pages);
  if (!r->failed && cfg->placement == GPUMEM_PLACEMENT_PLANNED) {
    loop_phase(r, LOOP_ITERATIONS, 60);
  }
  if (!r->failed) limit_phase(r, LIMIT_OPS);
  if (!r->failed && cfg->library_defaults >= 4) {
    /* The tier's configuration must have used the tier: requests on host
     * pages and moves back in every run; kept host allocations reused in
     * one run of the configuration at least (main checks: where warm
     * blocks move instead, a run may send too few requests to host pages
     * for sizes to repeat). */
    gpumem_stats_t s;
    gpumem_get_stats(r->gm, &s);
    RUN_CHECK(r, s.num_host_allocs > 0 && s.num_moves_to_device > 0,
              "the overflow tier served %lld requests, moved %lld blocks back, %lld out",
              (long long)s.num_host_allocs, (long long)s.num_moves_to_device,
              (long long)s.num_moves_to_host);
    tier_reuses += s.num_host_pages_reused;
    printf(
        "%s seed %llu: %lld requests on host pages, %lld blocks moved back, %lld out, %lld kept "
        "host allocations reused, %ld hints taken\n",
        cfg->name, (unsigned long long)seed, (long long)s.num_host_allocs,
        (long long)s.num_moves_to_device, (long long)s.num_moves_to_host,
        (long long)s.num_host_pages_reused, r->hints);
  }

  /* Teardown: every pattern intact, everything freed, nothing held. */
  r->phase = "teardown";
  if (!r->failed) check_no_overlap_sorted(r);
  if (r->host_backed && !r->failed) verify_all(r, "teardown");
  free_until(r, enough_nothing, 0);
  if (!r->failed) {
    op_empty_cache(r);
    check_state(r);
    gpumem_stats_t s;
    gpumem_get_stats(r->gm, &s);
    RUN_CHECK(r,
              s.allocated_bytes[0].current == 0 && s.active_bytes[0].current == 0 &&
                  s.reserved_bytes[0].current == 0 && s.active[0].current == 0,
              "after freeing everything: allocated %lld active %lld reserved %lld",
              (long long)s.allocated_bytes[0].current, (long long)s.active_bytes[0].current,
              (long long)s.reserved_bytes[0].current);
  }
  gpumem_stats_t fin;
  gpumem_get_stats(r->gm, &fin);
  /* destroy tears everything down; the caller vouches that no work is
   * queued any more, so unmapping there is not judged */
  r->spy.on_unmap = NULL;
  gpumem_destroy(r->gm);
  /* The allocator does not own the device: after destroy the device must
   * hold nothing of it. */
  char leak[256];
  RUN_CHECK(r, sim_holds_nothing(r->sim, leak, sizeof leak), "%s", leak);
  gpumem_sim_counters_t c = sim_counters(r->sim); /* for the device peak below */
  gpumem_sim_destroy(r->sim);
  spy_fini(&r->spy);
  printf(
      "%-16s seed %-3llu %-11s %ld ops: %ld mallocs, %ld frees, %ld record_stream, %ld "
      "deferred frees, %ld ordered (%lld shared plans, %ld reuses ordered on the device), %lld "
      "lent (%lld stream waits in all), %ld unmaps checked, %ld page reuses checked, %lld pages "
      "shared (%ld "
      "checked by byte), %ld empty_cache, %ld OOMs, max %zu live, %ld "
      "verified (%.1f MiB), device peak %.0f MiB, %lld segments at most, %.2f s\n",
      cfg->name, (unsigned long long)seed, host_backed ? "host-backed" : "no-backing", r->op,
      r->allocs, r->frees, r->records, r->deferred, r->ordered_frees,
      (long long)fin.num_plans_shared, r->reuses_ordered, (long long)fin.num_blocks_lent,
      (long long)fin.backend_calls[GPUMEM_CALL_stream_wait], r->unmaps_checked, r->reuses_checked,
      (long long)fin.num_pages_aliased, r->aliases_checked, r->empties, r->ooms, r->max_live,
      r->verified, (double)r->bytes_verified / (double)MIB,
      (double)c.peak_bytes_in_use / (double)MIB, (long long)fin.segment[0].peak, now_s() - t0);
  fflush(stdout);
  free(r->live);
  free(r->map_addr);
  free(r->map_handle);
  free(r->map_size);
  free(r->quar);
  free(r->page_keys);
  free(r->page_freed);
}

static long env_long(const char* name, long fallback) {
  const char* v = getenv(name);
  if (!v || !*v) return fallback;
  char* end = NULL;
  long x = strtol(v, &end, 10);
  return end && *end == '\0' && x >= 0 ? x : fallback;
}

int main(int argc, char** argv) {
  long ops = env_long("GPUMEM_RANDOM_OPS", 12500);
  const char* only = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
      only = argv[++i];
      continue;
    }
    char* end = NULL;
    ops = strtol(argv[i], &end, 10);
    if (!end || *end != '\0' || ops <= 0) {
      fprintf(stderr, "test_random: expected an operation count or --config NAME, got '%s'\n",
              argv[i]);
      return 2;
    }
  }
  size_t n_configs = sizeof configs / sizeof configs[0];
  if (only) {
    size_t ci = 0;
    while (ci < n_configs && strcmp(configs[ci].name, only) != 0) ci++;
    if (ci == n_configs) {
      fprintf(stderr, "test_random: no configuration named '%s'; there are:", only);
      for (size_t k = 0; k < n_configs; k++) fprintf(stderr, " %s", configs[k].name);
      fprintf(stderr, "\n");
      return 2;
    }
  }
  long seeds = env_long("GPUMEM_RANDOM_SEEDS", 4);
  long first = env_long("GPUMEM_RANDOM_SEED", 1);

  /* 4 MiB plus an odd tail: no multiple of a page, so shifted or swapped
   * pages never read the same bytes. */
  size_t tape_len = 4 * MIB + 4099;
  unsigned char* tape = malloc(tape_len);
  if (!tape) return 2;
  rng_t g = {12345};
  for (size_t i = 0; i < tape_len; i += 8) {
    uint64_t w = rng_next(&g);
    size_t n = tape_len - i < 8 ? tape_len - i : 8;
    memcpy(tape + i, &w, n);
  }

  for (size_t ci = 0; ci < n_configs; ci++) {
    if (only && strcmp(configs[ci].name, only) != 0) continue;
    tier_reuses = 0;
    for (long k = 0; k < seeds; k++) {
      uint64_t seed = (uint64_t)(first + k);
      run_one(&configs[ci], seed, (int)(seed % 2 == 1), ops, tape, tape_len);
    }
    if (configs[ci].library_defaults >= 4)
      CHECK_MSG(tier_reuses > 0, "%s: no run reused a kept host allocation", configs[ci].name);
  }
  free(tape);
  return test_finish("test_random");
}
