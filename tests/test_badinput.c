/* Bad input at the API: pointers that are not live allocations (never
 * allocated, freed already, interior), impossible sizes, bad limits, NULL
 * arguments, bad backends and options, malformed configuration strings.
 *
 * Each must be refused with the right status and a message naming the
 * problem, and must leave the allocator exactly as it was: every statistic
 * (current, peak and totals of every array, every counter but the one the
 * refusal itself counts), the device's holdings, the limit, and the live
 * allocations, which are freed normally at the end. Both policies. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

#define S0 ((gpumem_stream_t)0)
#define S1 ((gpumem_stream_t)0x51)

typedef struct fixture {
  const char* policy_name;
  gpumem_backend_t* sim;
  gpumem_t* gm;
  void* live[4];
  size_t live_size[4];
} fixture_t;

typedef struct snapshot {
  gpumem_stats_t stats;
  gpumem_sim_counters_t dev;
  size_t limit;
  size_t sizes[4];
} snapshot_t;

/* A request of 2^55 bytes makes the default policy calloc a page table of
 * 128 GiB (see test_sizes). Under AddressSanitizer such a calloc aborts
 * the process unless the allocator may return NULL; with NULL the engine
 * answers, and the test can judge the answer. No effect without ASan. */
const char* __asan_default_options(void);
const char* __asan_default_options(void) {
  return "allocator_may_return_null=1";
}

static int has(const char* text) {
  return strstr(gpumem_last_error(), text) != NULL;
}

static snapshot_t take(fixture_t* f) {
  snapshot_t s;
  memset(&s, 0, sizeof s);
  gpumem_get_stats(f->gm, &s.stats);
  gpumem_sim_get_counters(f->sim, &s.dev);
  s.limit = gpumem_get_limit(f->gm);
  for (int i = 0; i < 4; i++) s.sizes[i] = gpumem_allocation_size(f->gm, f->live[i]);
  return s;
}

/* What a refused call must not change. num_ooms may grow by `ooms` (an
 * impossible size is counted as an OOM); mem_info calls come from taking
 * the snapshots themselves. */
static void expect_unchanged(fixture_t* f, const snapshot_t* before, const char* what,
                             int64_t ooms) {
  snapshot_t after = take(f);
  const gpumem_stats_t* a = &before->stats;
  const gpumem_stats_t* b = &after.stats;
  const char* pools[] = {"all", "small", "large"};
#define X_COMPARE_ARRAY(name, title, is_bytes)                                                    \
  for (int p = 0; p < GPUMEM_POOL_COUNT; p++) {                                                   \
    CHECK_MSG(a->name[p].current == b->name[p].current && a->name[p].peak == b->name[p].peak &&   \
                  a->name[p].allocated == b->name[p].allocated &&                                 \
                  a->name[p].freed == b->name[p].freed,                                           \
              "%s (%s): %s.%s changed: current %lld->%lld peak %lld->%lld", what, f->policy_name, \
              #name, pools[p], (long long)a->name[p].current, (long long)b->name[p].current,      \
              (long long)a->name[p].peak, (long long)b->name[p].peak);                            \
  }
  GPUMEM_STAT_ARRAYS(X_COMPARE_ARRAY)
#undef X_COMPARE_ARRAY
#define X_COMPARE_COUNTER(name, title)                                                        \
  {                                                                                           \
    int64_t want = a->name + (strcmp(#name, "num_ooms") == 0 ? ooms : 0);                     \
    CHECK_MSG(b->name == want, "%s (%s): %s is %lld, want %lld", what, f->policy_name, #name, \
              (long long)b->name, (long long)want);                                           \
  }
  GPUMEM_STAT_COUNTERS(X_COMPARE_COUNTER)
#undef X_COMPARE_COUNTER
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) {
    if (k == GPUMEM_CALL_mem_info) continue;
    CHECK_MSG(a->backend_calls[k] == b->backend_calls[k], "%s (%s): made %s calls", what,
              f->policy_name, gpumem_backend_call_name(k));
  }
  CHECK_MSG(a->largest_free_block == b->largest_free_block &&
                a->cached_free_bytes == b->cached_free_bytes && a->limit_bytes == b->limit_bytes,
            "%s (%s): derived figures changed", what, f->policy_name);
  CHECK_MSG(before->dev.bytes_in_use == after.dev.bytes_in_use &&
                before->dev.pages_mapped == after.dev.pages_mapped &&
                before->dev.ranges_reserved == after.dev.ranges_reserved &&
                before->dev.plain_live == after.dev.plain_live &&
                before->dev.events_live == after.dev.events_live,
            "%s (%s): the device's holdings changed", what, f->policy_name);
  CHECK_MSG(before->limit == after.limit, "%s (%s): limit %zu -> %zu", what, f->policy_name,
            before->limit, after.limit);
  for (int i = 0; i < 4; i++) {
    CHECK_MSG(after.sizes[i] == f->live_size[i], "%s (%s): live allocation %d now reads %zu", what,
              f->policy_name, i, after.sizes[i]);
  }
  size_t v = gpumem_check(f->gm);
  CHECK_MSG(v == 0, "%s (%s): gpumem_check: %s", what, f->policy_name, gpumem_last_error());
}

/* A refusal: status, a message with `text` (and `text2` if given), and no
 * change to the state. */
static void expect_refused(fixture_t* f, const snapshot_t* before, const char* what,
                           gpumem_status_t got, gpumem_status_t want, const char* text,
                           const char* text2) {
  CHECK_MSG(got == want, "%s (%s): got %s, want %s (%s)", what, f->policy_name,
            gpumem_strerror(got), gpumem_strerror(want), gpumem_last_error());
  CHECK_MSG(has(text), "%s (%s): message lacks \"%s\": \"%s\"", what, f->policy_name, text,
            gpumem_last_error());
  if (text2) {
    CHECK_MSG(has(text2), "%s (%s): message lacks \"%s\": \"%s\"", what, f->policy_name, text2,
              gpumem_last_error());
  }
  expect_unchanged(f, before, what, 0);
}

static int setup(fixture_t* f, gpumem_policy_t policy) {
  memset(f, 0, sizeof *f);
  f->policy_name = policy == GPUMEM_POLICY_PYTORCH ? "pytorch" : "default";
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = 1 * GIB;
  so.event_delay_queries = 2;
  f->sim = gpumem_sim_create(&so);
  CHECK(f->sim != NULL);
  if (!f->sim) return 0;
  gpumem_options_t o;
  gpumem_options_init(&o);
  o.policy = policy;
  gpumem_status_t st;
  f->gm = gpumem_create(f->sim, &o, &st);
  CHECK_MSG(f->gm != NULL, "create: %s", gpumem_last_error());
  if (!f->gm) return 0;
  /* A state worth preserving: small and large blocks on two streams, one
   * used on another stream, and cached free blocks. */
  static const size_t sizes[4] = {1000, 3 * MIB, 12 * MIB, 600 * KIB};
  static const gpumem_stream_t streams[4] = {S0, S0, S1, S1};
  for (int i = 0; i < 4; i++) {
    CHECK_STATUS(gpumem_malloc(f->gm, sizes[i], streams[i], &f->live[i]), GPUMEM_OK);
    f->live_size[i] = sizes[i];
  }
  CHECK_STATUS(gpumem_record_stream(f->gm, f->live[3], S0), GPUMEM_OK);
  void* cached = NULL;
  CHECK_STATUS(gpumem_malloc(f->gm, 5 * MIB, S0, &cached), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f->gm, cached), GPUMEM_OK);
  CHECK_STATUS(gpumem_set_limit(f->gm, 900 * MIB), GPUMEM_OK);
  return 1;
}

static void teardown(fixture_t* f) {
  for (int i = 0; i < 4; i++) {
    if (f->live[i]) CHECK_STATUS(gpumem_free(f->gm, f->live[i]), GPUMEM_OK);
  }
  CHECK_STATUS(gpumem_empty_cache(f->gm), GPUMEM_OK);
  CHECK(gpumem_check(f->gm) == 0);
  gpumem_destroy(f->gm);
  gpumem_sim_counters_t c;
  gpumem_sim_get_counters(f->sim, &c);
  CHECK_MSG(c.bytes_in_use == 0 && c.ranges_reserved == 0 && c.events_live == 0 &&
                c.plain_live == 0 && c.pages_live == 0,
            "%s: the device still holds something after destroy", f->policy_name);
  gpumem_sim_destroy(f->sim);
}

static void test_bad_pointers(fixture_t* f) {
  snapshot_t s = take(f);
  char* b = f->live[1];
  gpumem_status_t st;

  void* never[] = {(void*)(uintptr_t)0x1234, (void*)(uintptr_t)0xdead0000ull, (void*)&s};
  for (size_t i = 0; i < sizeof never / sizeof never[0]; i++) {
    clear_error();
    st = gpumem_free(f->gm, never[i]);
    expect_refused(f, &s, "free(never allocated)", st, GPUMEM_ERR_INVALID_POINTER,
                   "never allocated", "gpumem_free");
  }

  size_t offsets[] = {1, 511, 512, 3 * MIB - 1};
  for (size_t i = 0; i < sizeof offsets / sizeof offsets[0]; i++) {
    clear_error();
    st = gpumem_free(f->gm, b + offsets[i]);
    expect_refused(f, &s, "free(interior)", st, GPUMEM_ERR_INVALID_POINTER, "points", "into");
    char where[64];
    snprintf(where, sizeof where, "%zu bytes into", offsets[i]);
    CHECK_MSG(has(where), "interior free message lacks \"%s\": %s", where, gpumem_last_error());
  }
  /* One past the end is no part of the allocation (it may start the next
   * block, which would make this a legal free of another allocation, so it
   * is not tried). */

  /* Double free: of a plain block, and of one freed with a pending event. */
  for (int pending = 0; pending < 2; pending++) {
    void* x = NULL;
    CHECK_STATUS(gpumem_malloc(f->gm, 2000, S0, &x), GPUMEM_OK);
    if (pending) CHECK_STATUS(gpumem_record_stream(f->gm, x, S1), GPUMEM_OK);
    CHECK_STATUS(gpumem_free(f->gm, x), GPUMEM_OK);
    snapshot_t s2 = take(f);
    clear_error();
    st = gpumem_free(f->gm, x);
    expect_refused(f, &s2, pending ? "double free (pending)" : "double free", st,
                   GPUMEM_ERR_INVALID_POINTER, "not a live allocation", "double free");
    clear_error();
    st = gpumem_record_stream(f->gm, x, S1);
    expect_refused(f, &s2, "record_stream(freed)", st, GPUMEM_ERR_INVALID_POINTER,
                   "not a live allocation", "gpumem_record_stream");
  }
  s = take(f);

  clear_error();
  st = gpumem_record_stream(f->gm, never[1], S1);
  expect_refused(f, &s, "record_stream(never allocated)", st, GPUMEM_ERR_INVALID_POINTER,
                 "never allocated", "gpumem_record_stream");
  clear_error();
  st = gpumem_record_stream(f->gm, b + 4096, S1);
  expect_refused(f, &s, "record_stream(interior)", st, GPUMEM_ERR_INVALID_POINTER,
                 "4096 bytes into", "gpumem_record_stream");
  clear_error();
  st = gpumem_record_stream(f->gm, NULL, S1);
  expect_refused(f, &s, "record_stream(NULL)", st, GPUMEM_ERR_INVALID_ARGUMENT, "NULL",
                 "gpumem_record_stream");
  /* Not errors: freeing NULL, and a use on the allocation's own stream. */
  CHECK_STATUS(gpumem_free(f->gm, NULL), GPUMEM_OK);
  CHECK_STATUS(gpumem_record_stream(f->gm, f->live[0], S0), GPUMEM_OK);
  expect_unchanged(f, &s, "free(NULL) and record_stream on the own stream", 0);
  CHECK(gpumem_allocation_size(f->gm, never[1]) == 0);
  CHECK(gpumem_allocation_size(f->gm, NULL) == 0);
}

static void test_sizes(fixture_t* f) {
  snapshot_t s = take(f);
  void* p = (void*)1;
  CHECK_STATUS(gpumem_malloc(f->gm, 0, S0, &p), GPUMEM_OK);
  CHECK(p == NULL);
  expect_unchanged(f, &s, "malloc(0)", 0);

  /* Sizes no device holds: refused up front (the rounding to 512 would
   * wrap), counted as an OOM, nothing else touched. */
  const size_t huge[] = {SIZE_MAX, SIZE_MAX - 511, SIZE_MAX - 512, (size_t)1 << 62,
                         ((size_t)1 << 56) + 1};
  for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
    s = take(f);
    p = (void*)1;
    clear_error();
    gpumem_status_t st = gpumem_malloc(f->gm, huge[i], S1, &p);
    CHECK_MSG(st == GPUMEM_ERR_OUT_OF_MEMORY, "malloc(%zu): %s", huge[i], gpumem_strerror(st));
    CHECK(p == NULL);
    char num[32];
    snprintf(num, sizeof num, "%zu", huge[i]);
    CHECK_MSG(has("out of memory") && has(num), "malloc(%zu) message: %s", huge[i],
              gpumem_last_error());
    expect_unchanged(f, &s, "malloc(huge)", 1);
  }

  /* Larger than the device but small enough to try: the retry ladder may
   * empty the cache (PyTorch does the same), but the answer is out of
   * memory, live allocations are untouched, and a failed request leaves
   * no more memory or address space held than there was. */
  const size_t too_big[] = {2 * GIB, (size_t)1 << 40, (size_t)1 << 50, (size_t)1 << 55};
  for (size_t i = 0; i < sizeof too_big / sizeof too_big[0]; i++) {
    s = take(f);
    p = (void*)1;
    clear_error();
    gpumem_status_t st = gpumem_malloc(f->gm, too_big[i], S1, &p);
    CHECK_MSG(st == GPUMEM_ERR_OUT_OF_MEMORY, "%s: malloc(%zu) on a 1 GiB device: %s (%s)",
              f->policy_name, too_big[i], gpumem_strerror(st), gpumem_last_error());
    CHECK(p == NULL);
    char num[32];
    snprintf(num, sizeof num, "%zu", too_big[i]);
    CHECK_MSG(has("out of memory") && has(num), "malloc(%zu) message: %s", too_big[i],
              gpumem_last_error());
    snapshot_t after = take(f);
    CHECK(after.stats.allocation[0].current == s.stats.allocation[0].current);
    CHECK(after.stats.allocated_bytes[0].current == s.stats.allocated_bytes[0].current);
    CHECK(after.stats.requested_bytes[0].current == s.stats.requested_bytes[0].current);
    CHECK(after.stats.num_ooms == s.stats.num_ooms + 1);
    CHECK_MSG(after.stats.reserved_bytes[0].current <= s.stats.reserved_bytes[0].current,
              "%s: failed malloc(%zu) grew reserved memory from %lld to %lld", f->policy_name,
              too_big[i], (long long)s.stats.reserved_bytes[0].current,
              (long long)after.stats.reserved_bytes[0].current);
    CHECK_MSG(after.dev.ranges_reserved <= s.dev.ranges_reserved &&
                  after.stats.segment[0].current <= s.stats.segment[0].current,
              "%s: failed malloc(%zu) left a new segment/range reserved (%lld -> %lld segments)",
              f->policy_name, too_big[i], (long long)s.stats.segment[0].current,
              (long long)after.stats.segment[0].current);
    for (int k = 0; k < 4; k++) CHECK(after.sizes[k] == f->live_size[k]);
    CHECK(gpumem_check(f->gm) == 0);
  }

  /* NULL out pointer: refused before anything is allocated. */
  s = take(f);
  clear_error();
  gpumem_status_t st = gpumem_malloc(f->gm, 100, S0, NULL);
  expect_refused(f, &s, "malloc(out = NULL)", st, GPUMEM_ERR_INVALID_ARGUMENT, "NULL",
                 "gpumem_malloc");
}

static void test_limits(fixture_t* f) {
  snapshot_t s = take(f);
  CHECK(s.limit == 900 * MIB);
  clear_error();
  gpumem_status_t st = gpumem_set_limit(f->gm, 0);
  expect_refused(f, &s, "set_limit(0)", st, GPUMEM_ERR_INVALID_ARGUMENT, "0 bytes",
                 "gpumem_remove_limit");
  const double bad[] = {0.0, -0.0, -1.0, 1.5, 1.0000001, NAN, INFINITY, -INFINITY};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    clear_error();
    st = gpumem_set_limit_fraction(f->gm, bad[i]);
    expect_refused(f, &s, "set_limit_fraction(bad)", st, GPUMEM_ERR_INVALID_ARGUMENT, "fraction",
                   "(0, 1]");
  }
  /* A fraction so small it is no byte at all is as useless as 0. */
  clear_error();
  st = gpumem_set_limit_fraction(f->gm, 1e-300);
  expect_refused(f, &s, "set_limit_fraction(1e-300)", st, GPUMEM_ERR_INVALID_ARGUMENT, "0 bytes",
                 NULL);
  clear_error();
  st = gpumem_add_oom_callback(f->gm, NULL, NULL);
  expect_refused(f, &s, "add_oom_callback(NULL)", st, GPUMEM_ERR_INVALID_ARGUMENT, "NULL",
                 "gpumem_add_oom_callback");
  CHECK(gpumem_print_summary(f->gm, NULL, NULL) != 0);
  CHECK(gpumem_print_stats_json(f->gm, NULL, NULL) != 0);
  expect_unchanged(f, &s, "print with no sink", 0);
}

/* Every entry point given a NULL allocator refuses (or, for those with no
 * status, does nothing) without crashing. */
static void test_null_allocator(void) {
  void* p = (void*)1;
  clear_error();
  CHECK_STATUS(gpumem_malloc(NULL, 100, S0, &p), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(has("NULL") && has("gpumem_malloc"));
  CHECK_STATUS(gpumem_malloc(NULL, 100, S0, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  clear_error();
  CHECK_STATUS(gpumem_free(NULL, (void*)0x1000), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(has("NULL") && has("gpumem_free"));
  clear_error();
  CHECK_STATUS(gpumem_record_stream(NULL, (void*)0x1000, S1), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(has("NULL"));
  clear_error();
  CHECK_STATUS(gpumem_empty_cache(NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(has("NULL"));
  clear_error();
  CHECK_STATUS(gpumem_set_limit(NULL, MIB), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(has("NULL"));
  clear_error();
  CHECK_STATUS(gpumem_set_limit_fraction(NULL, 0.5), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(has("NULL"));
  CHECK_STATUS(gpumem_add_oom_callback(NULL, NULL, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(gpumem_allocation_size(NULL, (void*)0x1000) == 0);
  CHECK(gpumem_get_limit(NULL) == 0);
  gpumem_remove_limit(NULL);
  gpumem_reset_peak_stats(NULL);
  gpumem_reset_accumulated_stats(NULL);
  gpumem_destroy(NULL);
  clear_error();
  CHECK(gpumem_check(NULL) != 0);
  CHECK(has("NULL"));
  gpumem_stats_t s;
  memset(&s, 0xab, sizeof s);
  gpumem_get_stats(NULL, &s);
  CHECK(s.struct_size == sizeof s && s.allocation[0].current == 0 && s.reserved_bytes[0].peak == 0);
  gpumem_get_stats(NULL, NULL);
}

/* gpumem_create with a bad backend or bad options: NULL, a status, a
 * message, and nothing taken from the device. */
static void expect_create_fails(gpumem_backend_t* be, const gpumem_options_t* o,
                                gpumem_status_t want, const char* text, gpumem_backend_t* sim) {
  gpumem_status_t st = GPUMEM_OK;
  clear_error();
  gpumem_t* gm = gpumem_create(be, o, &st);
  CHECK_MSG(gm == NULL && st == want, "create wanted %s (%s), got %s", gpumem_strerror(want), text,
            gpumem_strerror(st));
  CHECK_MSG(has(text), "create message lacks \"%s\": \"%s\"", text, gpumem_last_error());
  gpumem_destroy(gm);
  if (sim) {
    gpumem_sim_counters_t c;
    gpumem_sim_get_counters(sim, &c);
    CHECK(c.ranges_reserved == 0 && c.bytes_in_use == 0 && c.events_live == 0);
  }
}

static void test_create(void) {
  gpumem_backend_t* sim = gpumem_sim_create(NULL);
  if (!sim) return;
  gpumem_options_t o;
  gpumem_options_init(&o);

  expect_create_fails(NULL, &o, GPUMEM_ERR_INVALID_ARGUMENT, "backend is NULL", NULL);
  CHECK(gpumem_create(NULL, NULL, NULL) == NULL); /* err may be NULL */

  gpumem_backend_t copy = *sim;
  copy.version = GPUMEM_BACKEND_VERSION + 1;
  expect_create_fails(&copy, &o, GPUMEM_ERR_INVALID_ARGUMENT, "version", sim);
  copy.version = 0;
  expect_create_fails(&copy, &o, GPUMEM_ERR_INVALID_ARGUMENT, "version", sim);

  copy = *sim;
  copy.mem_info = NULL;
  expect_create_fails(&copy, &o, GPUMEM_ERR_INVALID_ARGUMENT, "mem_info", sim);
  copy = *sim;
  copy.alloc = NULL;
  copy.free = NULL;
  copy.map = NULL; /* half a virtual memory set counts as none */
  expect_create_fails(&copy, &o, GPUMEM_ERR_INVALID_ARGUMENT, "lacks", sim);
  copy = *sim;
  copy.page_size = 3 * MIB;
  expect_create_fails(&copy, &o, GPUMEM_ERR_INVALID_ARGUMENT, "power of two", sim);
  copy = *sim;
  copy.alloc = NULL;
  copy.free = NULL;
  gpumem_options_t po = o;
  po.policy = GPUMEM_POLICY_PYTORCH;
  expect_create_fails(&copy, &po, GPUMEM_ERR_UNSUPPORTED, "pytorch", sim);

  const uint32_t bad_sizes[] = {0, (uint32_t)sizeof o - 8, (uint32_t)sizeof o + 8, 1};
  for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++) {
    gpumem_options_t b = o;
    b.struct_size = bad_sizes[i];
    expect_create_fails(sim, &b, GPUMEM_ERR_INVALID_ARGUMENT, "struct_size", sim);
  }
  gpumem_options_t b = o;
  b.policy = (gpumem_policy_t)7;
  expect_create_fails(sim, &b, GPUMEM_ERR_INVALID_ARGUMENT, "policy", sim);
  const double bad_fractions[] = {-0.5, 1.5, NAN};
  for (size_t i = 0; i < 3; i++) {
    b = o;
    b.limit_fraction = bad_fractions[i];
    expect_create_fails(sim, &b, GPUMEM_ERR_INVALID_ARGUMENT, "limit_fraction", sim);
    b = o;
    b.headroom = bad_fractions[i];
    expect_create_fails(sim, &b, GPUMEM_ERR_INVALID_ARGUMENT, "headroom", sim);
  }
  /* The device is still perfectly usable. */
  gpumem_status_t st;
  gpumem_t* gm = gpumem_create(sim, &o, &st);
  CHECK(gm != NULL && st == GPUMEM_OK);
  gpumem_destroy(gm);
  gpumem_sim_destroy(sim);
}

/* A few malformed strings (tests/test_config.c has the full grammar):
 * refused, opts untouched, the key named. */
static void test_config_strings(void) {
  static const struct {
    const char* conf;
    const char* text;
  } bad[] = {
      {"policy:fast", "policy"},
      {"limitt:4G", "limitt"},
      {"limit:-1", "limit"},
      {"fraction:2", "fraction"},
      {"fraction:nan", "fraction"},
      {"reclaim:sometimes", "reclaim"},
      {"policy", "policy"},
      {"limit:4Q", "limit"},
      {"headroom:1.5", "headroom"},
      {"max_split_size_mb:x", "max_split_size_mb"},
      {"policy:default,,limit:1G", "empty"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    gpumem_options_t o, before;
    gpumem_options_init(&o);
    o.limit_bytes = 12345; /* something to keep */
    before = o;
    clear_error();
    gpumem_status_t st = gpumem_options_parse(&o, bad[i].conf);
    CHECK_MSG(st == GPUMEM_ERR_CONFIG, "\"%s\": %s", bad[i].conf, gpumem_strerror(st));
    CHECK_MSG(memcmp(&o, &before, sizeof o) == 0, "\"%s\" changed the options", bad[i].conf);
    CHECK_MSG(has(bad[i].text), "\"%s\": message lacks \"%s\": %s", bad[i].conf, bad[i].text,
              gpumem_last_error());
  }
  clear_error();
  CHECK_STATUS(gpumem_options_parse(NULL, "policy:default"), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(has("NULL"));
}

int main(void) {
  const gpumem_policy_t policies[] = {GPUMEM_POLICY_PYTORCH, GPUMEM_POLICY_DEFAULT};
  for (int i = 0; i < 2; i++) {
    fixture_t f;
    if (setup(&f, policies[i])) {
      test_bad_pointers(&f);
      test_limits(&f);
      test_sizes(&f);
    }
    if (f.gm) teardown(&f);
  }
  test_null_allocator();
  test_create();
  test_config_strings();
  return test_finish("test_badinput");
}
