/* Fault injection: a small deterministic workload (allocations, frees,
 * record_stream, empty_cache and limits across two streams) runs again and
 * again while the simulated device fails its N-th use of one kind (or of
 * any kind), once or from then on, with a device error or out of memory.
 *
 * Whatever fails, every operation must answer OK or a status the failure
 * explains, with a message; the structures must stay consistent
 * (gpumem_check) and reserved memory must equal what the device holds.
 * Once the script is cleared the allocator must work normally, and after
 * gpumem_destroy the device must hold nothing: no range, page, mapping,
 * plain allocation or event. A spy backend checks that a free whose
 * deferral failed still never lets memory go while another stream may
 * use it: the free is deferred, or that stream was synchronized.
 *
 * GPUMEM_FAULTS_STRIDE=k tries every k-th N only (default 1: all). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "spy_backend.h"
#include "test_config_list.h"
#include "test_util.h"

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)

#define S0 ((gpumem_stream_t)0)
#define S1 ((gpumem_stream_t)0x77)

static const config_t configs[] = {
    {"pytorch", GPUMEM_POLICY_PYTORCH, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_BESTFIT, 0, 0},
    {"default/lazy", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_BESTFIT, 0, 0},
    /* eager unmaps on free: the only policy whose free calls the device */
    {"default/eager", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_EAGER, GPUMEM_PLACEMENT_BESTFIT, 0, 0},
    /* planned placement maps plan arenas and moves pages when a plan starts */
    {"default/pressure/planned", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_PRESSURE,
     GPUMEM_PLACEMENT_PLANNED, 0, 0},
    /* several pages per physical allocation (map_max) */
    {"default/pressure/map8", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_PRESSURE,
     GPUMEM_PLACEMENT_BESTFIT, 8, 0},
    /* the library's defaults: large mappings, the move budget, auto placement */
    {"default", GPUMEM_POLICY_DEFAULT, GPUMEM_RECLAIM_LAZY, GPUMEM_PLACEMENT_AUTO, 512, 1},
};

/* What one run injects. kind -2 means nothing (the baseline). */
typedef struct script {
  int kind;
  long skip;
  long count;
  gpumem_status_t status;
} script_t;

#define SLOTS 12
#define OWN_QUAR 16 /* the loop's latest frees, on their own stream: a ring */

/* Memory freed at moment t while stream `use` may still touch it. */
typedef struct quarantine {
  uintptr_t ptr;
  size_t size;
  uint64_t t;
  gpumem_stream_t use;
} quarantine_t;

typedef struct run {
  const config_t* cfg;
  script_t script;
  gpumem_backend_t* sim;
  spy_t spy; /* the allocator's view of the device */
  gpumem_t* gm;
  void* slot[SLOTS];
  size_t size[SLOTS];
  gpumem_stream_t stream[SLOTS];
  gpumem_stream_t use[SLOTS]; /* another stream it was recorded on, or 0 */
  quarantine_t quar[SLOTS];
  int nquar;
  /* The loop's frees, each on its own stream: in a plan arena the streams
   * share, another stream may take those bytes only once the device
   * orders it after that one (a stream wait). */
  quarantine_t own_quar[OWN_QUAR];
  int n_own_quar, own_next;
  int in_loop;
  int step;
  int failed; /* first failure ends the run: later ones only echo it */
  long failures_seen;
} run_t;

static void run_context(const run_t* r) {
  const char* kind = r->script.kind == -1   ? "any"
                     : r->script.kind == -2 ? "none"
                                            : gpumem_backend_call_name(r->script.kind);
  fprintf(stderr, "  in %s, failing %s call #%ld %s with %s, workload step %d\n", r->cfg->name,
          kind, r->script.skip, r->script.count < 0 ? "and every later one" : "once",
          gpumem_strerror(r->script.status), r->step);
}

/* The first failure ends the run; its context is printed once. */
static void run_failed(run_t* r) {
  if (!r->failed) run_context(r);
  r->failed = 1;
}

#define RUN_CHECK(r, cond, ...) CHECK_MSG_THEN_(cond, #cond, run_failed(r), __VA_ARGS__)

static size_t live_count(const run_t* r) {
  size_t n = 0;
  for (int i = 0; i < SLOTS; i++) n += r->slot[i] != NULL;
  return n;
}

/* The allocator's statistics as the test reads them: not a device call
 * that the script counts and fails (the spy answers the device's memory
 * figures itself), so that the sweeps fail the allocator's own calls, not
 * thousands of the test's readings, which only ever showed that a failed
 * reading leaves device_free at 0 (test_stats_survive_mem_info). */
static void read_stats(run_t* r, gpumem_stats_t* s) {
  r->spy.test_reading = 1;
  gpumem_get_stats(r->gm, s);
  r->spy.test_reading = 0;
}

/* After every step: consistent structures, the allocation count the
 * workload expects, and reserved memory equal to the device's own count
 * (a failed call must neither leak device memory nor forget it). */
static void check_state(run_t* r) {
  size_t v = gpumem_check(r->gm);
  RUN_CHECK(r, v == 0, "gpumem_check: %zu violations: %s", v, gpumem_last_error());
  gpumem_stats_t s;
  read_stats(r, &s);
  RUN_CHECK(r, s.allocation[GPUMEM_POOL_ALL].current == (int64_t)live_count(r),
            "%lld allocations, the workload holds %zu",
            (long long)s.allocation[GPUMEM_POOL_ALL].current, live_count(r));
  gpumem_sim_counters_t c = sim_counters(r->sim);
  RUN_CHECK(r, (uint64_t)s.reserved_bytes[GPUMEM_POOL_ALL].current == c.bytes_in_use,
            "reserved %lld, the device holds %llu",
            (long long)s.reserved_bytes[GPUMEM_POOL_ALL].current,
            (unsigned long long)c.bytes_in_use);
  r->step++;
}

/* A failing status is acceptable when the injected failure explains it:
 * the injected status itself, or out of memory (a failed release can leave
 * memory held that a later allocation under the limit then misses). */
static int explained(const run_t* r, gpumem_status_t st, int may_oom) {
  if (r->script.kind == -2) return 0; /* the baseline must not fail */
  return st == r->script.status || (may_oom && st == GPUMEM_ERR_OUT_OF_MEMORY);
}

static void do_malloc(run_t* r, int i, size_t size, gpumem_stream_t stream) {
  if (r->failed) return;
  void* p = (void*)1;
  clear_error();
  gpumem_status_t st = gpumem_malloc(r->gm, size, stream, &p);
  if (st == GPUMEM_OK) {
    RUN_CHECK(r, size == 0 ? p == NULL : p != NULL, "malloc(%zu) = %p", size, p);
    r->slot[i] = p;
    r->size[i] = size;
    r->stream[i] = stream;
    r->use[i] = 0;
    /* Never memory another stream may still be using. */
    uintptr_t a = (uintptr_t)p;
    for (int q = 0; q < r->nquar + r->n_own_quar; q++) {
      const quarantine_t* e = q < r->nquar ? &r->quar[q] : &r->own_quar[q - r->nquar];
      if (a + size <= e->ptr || e->ptr + e->size <= a) continue;
      RUN_CHECK(r, spy_ordered(&r->spy, stream, e->use, e->t),
                "malloc(%zu) = %p reuses memory freed while stream 0x%lx may still use it", size, p,
                (unsigned long)e->use);
    }
  } else {
    r->failures_seen++;
    RUN_CHECK(r, explained(r, st, 1), "malloc(%zu): unexplained %s: %s", size, gpumem_strerror(st),
              gpumem_last_error());
    RUN_CHECK(r, p == NULL, "failed malloc left *out = %p", p);
    RUN_CHECK(r, gpumem_last_error()[0] != '\0', "malloc(%zu) failed with %s and no message", size,
              gpumem_strerror(st));
    r->slot[i] = NULL;
  }
  check_state(r);
}

/* A free that fails may still have freed (eager reclaim reports the unmap
 * error after the pointer is gone) or not (no event and no sync could make
 * it safe): the allocation count says which, and allocation_size must
 * agree with it. */
static void do_free(run_t* r, int i) {
  if (r->failed || !r->slot[i]) return;
  gpumem_stats_t before;
  read_stats(r, &before);
  uint64_t t = r->spy.clock;
  clear_error();
  gpumem_status_t st = gpumem_free(r->gm, r->slot[i]);
  if (st == GPUMEM_OK && r->use[i]) {
    /* Used on another stream: deferred (pending, still active), or that
     * stream was synchronized by the free itself. Anything else lets the
     * memory go while the stream may still be at work. */
    gpumem_stats_t after;
    read_stats(r, &after);
    int64_t pending_before = before.active_bytes[0].current - before.allocated_bytes[0].current;
    int64_t pending_after = after.active_bytes[0].current - after.allocated_bytes[0].current;
    int deferred = pending_after - pending_before >= (int64_t)r->size[i];
    RUN_CHECK(r, deferred || spy_safe(&r->spy, r->use[i], t),
              "free(%p) used on stream 0x%lx returned OK, neither deferred nor synchronized",
              r->slot[i], (unsigned long)r->use[i]);
    if (deferred && r->nquar < SLOTS) {
      quarantine_t e = {(uintptr_t)r->slot[i], r->size[i], t, r->use[i]};
      r->quar[r->nquar++] = e;
    }
  }
  if (st == GPUMEM_OK) {
    if (r->in_loop) {
      quarantine_t e = {(uintptr_t)r->slot[i], r->size[i], t, r->stream[i]};
      r->own_quar[r->own_next++ % OWN_QUAR] = e; /* the oldest goes */
      if (r->n_own_quar < OWN_QUAR) r->n_own_quar++;
    }
    r->slot[i] = NULL;
  } else {
    r->failures_seen++;
    RUN_CHECK(r, explained(r, st, 0), "free(%p): unexplained %s: %s", r->slot[i],
              gpumem_strerror(st), gpumem_last_error());
    RUN_CHECK(r, gpumem_last_error()[0] != '\0', "free failed with %s and no message",
              gpumem_strerror(st));
    gpumem_stats_t after;
    read_stats(r, &after);
    int64_t gone = before.allocation[0].current - after.allocation[0].current;
    RUN_CHECK(r, gone == 0 || gone == 1, "a failed free changed the allocation count by %lld",
              (long long)gone);
    size_t known = gpumem_allocation_size(r->gm, r->slot[i]);
    RUN_CHECK(r, gone ? known == 0 : known == r->size[i],
              "free failed, %s, yet allocation_size is %zu", gone ? "freed" : "kept", known);
    if (gone) r->slot[i] = NULL;
  }
  check_state(r);
}

static void do_record(run_t* r, int i, gpumem_stream_t stream) {
  if (r->failed || !r->slot[i]) return;
  clear_error();
  gpumem_status_t st = gpumem_record_stream(r->gm, r->slot[i], stream);
  /* record_stream only notes the stream: no device call that could fail. */
  RUN_CHECK(r, st == GPUMEM_OK, "record_stream: %s: %s", gpumem_strerror(st), gpumem_last_error());
  if (stream != r->stream[i]) r->use[i] = stream;
  check_state(r);
}

static void expect_ok_or_injected(run_t* r, const char* what, gpumem_status_t st) {
  if (st == GPUMEM_OK) return;
  r->failures_seen++;
  RUN_CHECK(r, explained(r, st, 0), "%s: unexplained %s: %s", what, gpumem_strerror(st),
            gpumem_last_error());
  RUN_CHECK(r, gpumem_last_error()[0] != '\0', "%s failed with %s and no message", what,
            gpumem_strerror(st));
}

static void do_empty_cache(run_t* r) {
  if (r->failed) return;
  clear_error();
  expect_ok_or_injected(r, "empty_cache", gpumem_empty_cache(r->gm));
  check_state(r);
}

static void do_set_limit(run_t* r, size_t bytes) {
  if (r->failed) return;
  clear_error();
  gpumem_status_t st = gpumem_set_limit(r->gm, bytes);
  expect_ok_or_injected(r, "set_limit", st);
  /* The cap holds even when releasing cached memory above it failed. */
  RUN_CHECK(r, gpumem_get_limit(r->gm) == bytes, "limit %zu after set_limit(%zu)",
            gpumem_get_limit(r->gm), bytes);
  check_state(r);
}

/* The workload: two streams, small and large pools, frees in another order
 * than allocation, frees deferred by record_stream (events stay pending for
 * two queries), empty_cache, and a limit that makes the retry ladder
 * release another stream's cache. Without failures every step succeeds. */
/* A slot whose free failed still holds its block: it is not reused. */
static void loop_malloc(run_t* r, int i, size_t size) {
  if (!r->slot[i]) do_malloc(r, i, size, S0);
}

static void workload(run_t* r) {
  do_malloc(r, 0, 1000, S0);
  do_malloc(r, 1, 3 * MIB, S0);
  do_malloc(r, 2, 700 * KIB, S1);
  do_record(r, 1, S1);
  do_malloc(r, 3, 12 * MIB, S1);
  do_free(r, 1); /* pending on S1's event */
  do_malloc(r, 4, 5 * MIB, S0);
  do_record(r, 2, S0);
  do_free(r, 2);
  do_free(r, 0);
  do_malloc(r, 5, 2 * MIB, S0);
  do_empty_cache(r);
  do_set_limit(r, 64 * MIB);
  do_malloc(r, 6, 30 * MIB, S0);
  do_free(r, 6);                 /* cached on S0 */
  do_malloc(r, 7, 20 * MIB, S1); /* over the limit: the ladder frees S0's cache */
  do_free(r, 3);
  do_record(r, 4, S1);
  do_free(r, 4);
  do_set_limit(r, 1024 * MIB);
  do_malloc(r, 8, MIB + 1, S1);
  do_malloc(r, 9, 0, S0);
  do_free(r, 7);
  do_free(r, 5);
  do_empty_cache(r);
  /* A training-like loop: under placement:planned it is planned after a
   * few iterations, so plan arenas are created and mapped (and pages move
   * to them) while calls fail. */
  /* Planned placement: another stream's work first, done before stream
   * 0 peaks: an arena per stream would hold both peaks, so the plan shares
   * one between the streams, with stream waits where memory passes
   * between them. (Only there: the other configurations' loop stays as it
   * was, and with it the time of the fault scripts under sanitizers.) */
  int two_streams = r->cfg->placement == GPUMEM_PLACEMENT_PLANNED;
  r->in_loop = two_streams;
  for (int it = 0; it < 24 && !r->failed; it++) {
    if (two_streams) {
      if (!r->slot[10]) do_malloc(r, 10, 6 * MIB, S1);
      if (!r->slot[11]) do_malloc(r, 11, 4 * MIB + 512, S1);
      do_free(r, 11);
      do_free(r, 10);
    }
    loop_malloc(r, 0, 3 * MIB);
    loop_malloc(r, 1, 700 * KIB);
    loop_malloc(r, 2, 5 * MIB);
    do_free(r, 1);
    loop_malloc(r, 3, 2 * KIB);
    do_free(r, 0);
    loop_malloc(r, 4, 9 * MIB);
    do_free(r, 2);
    do_free(r, 3);
    do_free(r, 4);
  }
  r->in_loop = 0;
  do_empty_cache(r);
}

static gpumem_backend_t* make_sim(void) {
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = 256 * MIB;
  so.event_delay_queries = 2;
  return gpumem_sim_create(&so);
}

static gpumem_t* make_gm(const config_t* cfg, gpumem_backend_t* sim) {
  gpumem_options_t o = config_options(cfg, sim->page_size);
  gpumem_status_t st = GPUMEM_OK;
  gpumem_t* gm = gpumem_create(sim, &o, &st);
  CHECK_MSG(gm != NULL, "create: %s: %s", gpumem_strerror(st), gpumem_last_error());
  return gm;
}

/* Runs the workload under one script; returns the device's call counts of
 * the workload (for the baseline). */
static long runs_with_failures, failures_total;

static gpumem_sim_counters_t run_script(const config_t* cfg, script_t sc) {
  run_t run;
  memset(&run, 0, sizeof run);
  run_t* r = &run;
  r->cfg = cfg;
  r->script = sc;
  gpumem_sim_counters_t calls;
  memset(&calls, 0, sizeof calls);
  r->sim = make_sim();
  if (!r->sim) {
    CHECK_MSG(0, "sim_create: %s", gpumem_last_error());
    return calls;
  }
  spy_init(&r->spy, r->sim);
  r->gm = make_gm(cfg, &r->spy.be);
  if (!r->gm) {
    gpumem_sim_destroy(r->sim);
    spy_fini(&r->spy);
    return calls;
  }
  gpumem_sim_counters_t at_start = sim_counters(r->sim);
  if (sc.kind != -2) gpumem_sim_fail(r->sim, sc.kind, sc.skip, sc.count, sc.status);
  workload(r);
  gpumem_sim_fail_clear(r->sim);
  if (sc.kind == -2 && strstr(cfg->name, "planned")) {
    /* The baseline must reach the shared arena's paths (stream waits) for
     * the scripts to fail them. */
    gpumem_stats_t s;
    read_stats(r, &s);
    RUN_CHECK(r, s.num_plans_shared >= 1 && s.backend_calls[GPUMEM_CALL_stream_wait] > 0,
              "the loop's plan shares no arena between its streams (%lld shared plans, %llu "
              "stream waits)",
              (long long)s.num_plans_shared,
              (unsigned long long)s.backend_calls[GPUMEM_CALL_stream_wait]);
  }
  runs_with_failures += r->failures_seen > 0;
  failures_total += r->failures_seen;
  calls = sim_counters(r->sim);
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) calls.calls[k] -= at_start.calls[k];

  /* With the device healthy again, the allocator works: new allocations,
   * and frees of whatever a failed free left live. */
  r->step = 100;
  if (!r->failed) {
    r->script.kind = -2; /* from here on nothing may fail */
    void* a = NULL;
    void* b = NULL;
    RUN_CHECK(r, gpumem_malloc(r->gm, 4 * MIB, S0, &a) == GPUMEM_OK && a,
              "malloc after recovery: %s", gpumem_last_error());
    RUN_CHECK(r, gpumem_malloc(r->gm, 100, S1, &b) == GPUMEM_OK && b, "malloc after recovery: %s",
              gpumem_last_error());
    RUN_CHECK(r, gpumem_free(r->gm, a) == GPUMEM_OK && gpumem_free(r->gm, b) == GPUMEM_OK,
              "free after recovery: %s", gpumem_last_error());
    for (int i = 0; i < SLOTS; i++) do_free(r, i);
    do_empty_cache(r);
    gpumem_stats_t s;
    read_stats(r, &s);
    gpumem_sim_counters_t c = sim_counters(r->sim);
    /* Everything is free and the cache emptied: nothing may be held. */
    RUN_CHECK(
        r,
        s.reserved_bytes[0].current == 0 && s.active_bytes[0].current == 0 && c.bytes_in_use == 0,
        "after recovery and empty_cache: reserved %lld, active %lld, device %llu",
        (long long)s.reserved_bytes[0].current, (long long)s.active_bytes[0].current,
        (unsigned long long)c.bytes_in_use);
  }
  gpumem_destroy(r->gm);
  char leak[256];
  RUN_CHECK(r, sim_holds_nothing(r->sim, leak, sizeof leak), "%s", leak);
  gpumem_sim_destroy(r->sim);
  spy_fini(&r->spy);
  return calls;
}

/* Statistics read while the device refuses its memory figures: every
 * counter as before, device_free 0 (unknown), and the next reading whole. */
static void test_stats_survive_mem_info(void) {
  static const gpumem_status_t statuses[] = {GPUMEM_ERR_BACKEND, GPUMEM_ERR_OUT_OF_MEMORY};
  for (int s = 0; s < 2; s++) {
    gpumem_backend_t* sim = make_sim();
    if (!sim) return;
    gpumem_options_t o;
    gpumem_options_init(&o);
    gpumem_status_t st = GPUMEM_OK;
    gpumem_t* gm = gpumem_create(sim, &o, &st);
    void* p = NULL;
    CHECK(gm != NULL && gpumem_malloc(gm, 3 * MIB, S0, &p) == GPUMEM_OK);
    gpumem_stats_t before, during, after;
    gpumem_get_stats(gm, &before);
    gpumem_sim_fail(sim, GPUMEM_CALL_mem_info, 0, 1, statuses[s]);
    gpumem_get_stats(gm, &during);
    gpumem_get_stats(gm, &after);
    CHECK(before.device_free > 0 && during.device_free == 0 && after.device_free > 0);
    CHECK(during.allocated_bytes[0].current == before.allocated_bytes[0].current &&
          during.reserved_bytes[0].current == before.reserved_bytes[0].current);
    CHECK(gpumem_check(gm) == 0);
    gpumem_free(gm, p);
    gpumem_destroy(gm);
    gpumem_sim_destroy(sim);
  }
}

/* gpumem_create asks the device for its size first; a failure there must
 * come back as a NULL allocator with the device's status. */
static void test_create_fails(void) {
  static const gpumem_status_t statuses[] = {GPUMEM_ERR_BACKEND, GPUMEM_ERR_OUT_OF_MEMORY};
  for (int p = 0; p < 2; p++) {
    for (int s = 0; s < 2; s++) {
      gpumem_backend_t* sim = make_sim();
      if (!sim) return;
      gpumem_sim_fail(sim, GPUMEM_CALL_mem_info, 0, 1, statuses[s]);
      gpumem_options_t o;
      gpumem_options_init(&o);
      o.policy = p ? GPUMEM_POLICY_PYTORCH : GPUMEM_POLICY_DEFAULT;
      gpumem_status_t st = GPUMEM_OK;
      clear_error();
      gpumem_t* gm = gpumem_create(sim, &o, &st);
      CHECK(gm == NULL);
      CHECK_MSG(st == statuses[s], "create with mem_info failing: %s", gpumem_strerror(st));
      CHECK_MSG(strstr(gpumem_last_error(), "mem_info") != NULL, "message: %s",
                gpumem_last_error());
      gpumem_destroy(gm);
      /* The failure was one call: the next create works. */
      gm = gpumem_create(sim, &o, &st);
      CHECK_MSG(gm != NULL && st == GPUMEM_OK, "create after the failure: %s", gpumem_last_error());
      gpumem_destroy(gm);
      gpumem_sim_counters_t c = sim_counters(sim);
      CHECK(c.ranges_reserved == 0 && c.bytes_in_use == 0 && c.events_live == 0);
      gpumem_sim_destroy(sim);
    }
  }
}

/* Destroy with the device still failing every call must not crash or
 * touch freed memory (AddressSanitizer watches); what the device then
 * still holds goes with the device. */
static void test_destroy_while_failing(const config_t* cfg) {
  for (long n = 0; n < 40; n += 3) {
    gpumem_backend_t* sim = make_sim();
    if (!sim) return;
    gpumem_t* gm = make_gm(cfg, sim);
    if (!gm) {
      gpumem_sim_destroy(sim);
      return;
    }
    void* p[4] = {NULL, NULL, NULL, NULL};
    gpumem_malloc(gm, 3 * MIB, S0, &p[0]);
    gpumem_malloc(gm, 100, S1, &p[1]);
    gpumem_record_stream(gm, p[0], S1);
    gpumem_free(gm, p[0]);
    gpumem_malloc(gm, 40 * MIB, S1, &p[2]);
    gpumem_sim_fail(sim, -1, n, -1, GPUMEM_ERR_BACKEND);
    gpumem_malloc(gm, 7 * MIB, S0, &p[3]);
    gpumem_free(gm, p[1]);
    size_t v = gpumem_check(gm);
    CHECK_MSG(v == 0, "%s, failing from call %ld: %s", cfg->name, n, gpumem_last_error());
    gpumem_destroy(gm);
    gpumem_sim_destroy(sim);
  }
}

/* test_faults [--config NAME]: every configuration, or one (CTest runs
 * one entry per configuration, in parallel: under the sanitizers the whole
 * table takes longer than a test's timeout). */
int main(int argc, char** argv) {
  const char* stride_env = getenv("GPUMEM_FAULTS_STRIDE");
  long stride = stride_env ? strtol(stride_env, NULL, 10) : 1;
  if (stride < 1) stride = 1;
  static const gpumem_status_t statuses[] = {GPUMEM_ERR_BACKEND, GPUMEM_ERR_OUT_OF_MEMORY};
  static const long counts[] = {1, -1};
  const char* only = NULL;
  if (argc == 3 && strcmp(argv[1], "--config") == 0) {
    only = argv[2];
  } else if (argc != 1) {
    fprintf(stderr, "usage: test_faults [--config NAME]\n");
    return 2;
  }
  size_t matched = 0;
  for (size_t ci = 0; ci < sizeof configs / sizeof configs[0]; ci++)
    matched += !only || strcmp(configs[ci].name, only) == 0;
  if (!matched) {
    fprintf(stderr, "test_faults: no configuration named '%s'; there are:", only);
    for (size_t ci = 0; ci < sizeof configs / sizeof configs[0]; ci++)
      fprintf(stderr, " %s", configs[ci].name);
    fprintf(stderr, "\n");
    return 2;
  }

  test_create_fails();
  test_stats_survive_mem_info();
  long runs = 0;
  for (size_t ci = 0; ci < sizeof configs / sizeof configs[0]; ci++) {
    const config_t* cfg = &configs[ci];
    if (only && strcmp(cfg->name, only) != 0) continue;
    script_t none = {-2, 0, 0, GPUMEM_OK};
    long before_failed = test_checks_failed;
    gpumem_sim_counters_t base = run_script(cfg, none);
    CHECK_MSG(test_checks_failed == before_failed, "%s: the workload fails without injection",
              cfg->name);
    uint64_t total = 0;
    for (int k = 0; k < GPUMEM_CALL_COUNT; k++) total += base.calls[k];
    printf("%s: the workload makes %llu device calls:", cfg->name, (unsigned long long)total);
    for (int k = 0; k < GPUMEM_CALL_COUNT; k++) {
      if (base.calls[k]) {
        printf(" %s %llu", gpumem_backend_call_name(k), (unsigned long long)base.calls[k]);
      }
    }
    printf("\n");
    for (int kind = -1; kind < GPUMEM_CALL_COUNT; kind++) {
      uint64_t n_calls = kind < 0 ? total : base.calls[kind];
      /* n_calls itself is one past the last call: a script that never
       * fires, which must change nothing either. */
      for (long n = 0; n <= (long)n_calls; n += stride) {
        for (int s = 0; s < 2; s++) {
          for (int c = 0; c < 2; c++) {
            /* A single failure of the N-th operation of a kind is a failure
             * of that operation's place among the operations of any kind: the
             * workload and the device are deterministic up to the failure,
             * and the sweep over any kind (kind -1) covers it. Failures
             * that repeat differ (any kind fails every later call). */
            if (kind >= 0 && counts[c] == 1) continue;
            script_t sc = {kind, n, counts[c], statuses[s]};
            long failed_before = test_checks_failed;
            run_script(cfg, sc);
            runs++;
            /* One report per failing configuration is enough to act on. */
            if (test_checks_failed != failed_before && test_checks_failed > 20) {
              return test_finish("test_faults");
            }
          }
        }
      }
    }
    test_destroy_while_failing(cfg);
  }
  /* Most scripts must reach the caller: otherwise the workload would not
   * exercise the failure paths at all. */
  printf("%ld fault-injection runs, %ld of them saw %ld failed operations\n", runs,
         runs_with_failures, failures_total);
  CHECK(runs_with_failures > runs / 4);
  return test_finish("test_faults");
}
