/* Minimal test helpers: CHECK records a failure and goes on; the program's
 * exit status is the number of failures (capped), and it ends with the
 * plain "N passed, N failed" line. */
#ifndef GPUMEM_TEST_UTIL_H
#define GPUMEM_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem.h"
#include "gpumem_backend.h"

static long test_checks_passed;
static long test_checks_failed;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (cond) {                                                                \
      test_checks_passed++;                                                    \
    } else {                                                                   \
      test_checks_failed++;                                                    \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                          \
  } while (0)

/* CHECK_MSG with `text` (the condition as written) in the report and the
 * statement `on_fail` run after it: for checks of one's own, such as a
 * RUN_CHECK that also stops a run. Take #cond in the outer macro, so that
 * the report shows the condition unexpanded. */
#define CHECK_MSG_THEN_(cond, text, on_fail, ...)                             \
  do {                                                                        \
    if (cond) {                                                               \
      test_checks_passed++;                                                   \
    } else {                                                                  \
      test_checks_failed++;                                                   \
      fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, text); \
      fprintf(stderr, __VA_ARGS__);                                           \
      fputc('\n', stderr);                                                    \
      on_fail;                                                                \
    }                                                                         \
  } while (0)

#define CHECK_MSG(cond, ...) CHECK_MSG_THEN_(cond, #cond, (void)0, __VA_ARGS__)

/* Status equality with the detail message printed on mismatch. */
#define CHECK_STATUS(expr, want)                                                           \
  do {                                                                                     \
    gpumem_status_t got_status_ = (expr);                                                  \
    CHECK_MSG(got_status_ == (want), "got %s, want %s (%s)", gpumem_strerror(got_status_), \
              gpumem_strerror(want), gpumem_last_error());                                 \
  } while (0)

/* Messages persist until the next failure: clear it so that a message
 * checked after one operation is that operation's own. */
static inline void clear_error(void) {
  gpumem_set_last_error("%s", "");
}

static inline int test_finish(const char* name) {
  printf("%s: %ld passed, %ld failed\n", name, test_checks_passed, test_checks_failed);
  return test_checks_failed ? 1 : 0;
}

/* A growing text sink (gpumem_write_fn) for output tests; it can fail from
 * a given write on, to test that the output stops and its value comes back. */
typedef struct sink {
  char* text;
  size_t len, cap;
  int calls;
  int fail_at;   /* 1-based call that fails; 0 = never */
  int fail_with; /* what the failing call returns */
} sink_t;

static inline int sink_write(const char* text, size_t len, void* arg) {
  sink_t* s = (sink_t*)arg;
  s->calls++;
  if (s->fail_at && s->calls >= s->fail_at) return s->fail_with;
  if (s->len + len + 1 > s->cap) {
    size_t cap = (s->len + len + 1) * 2;
    char* t = (char*)realloc(s->text, cap);
    if (!t) return -1;
    s->text = t;
    s->cap = cap;
  }
  memcpy(s->text + s->len, text, len);
  s->len += len;
  s->text[s->len] = '\0';
  return 0;
}

static inline void sink_free(sink_t* s) {
  free(s->text);
  memset(s, 0, sizeof *s);
}

/* The tests' fixture: a simulated device and an allocator over it. */
typedef struct fx {
  gpumem_backend_t* sim;
  gpumem_t* gm;
} fx_t;

/* A fresh device and allocator. conf is a GPUMEM_CONF string (policy and
 * the rest); the allocator does not own the device, so fx_done can check
 * that it left nothing behind. */
static inline fx_t fx_new(const char* conf, size_t capacity, int event_delay) {
  fx_t f = {NULL, NULL};
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = capacity;
  so.event_delay_queries = event_delay;
  f.sim = gpumem_sim_create(&so);
  CHECK(f.sim != NULL);
  if (!f.sim) return f;
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, conf), GPUMEM_OK);
  gpumem_status_t st;
  f.gm = gpumem_create(f.sim, &o, &st);
  CHECK_MSG(f.gm != NULL, "create(%s): %s", conf, gpumem_last_error());
  return f;
}

static inline void fx_done(fx_t* f) {
  if (f->gm) {
    size_t v = gpumem_check(f->gm);
    CHECK_MSG(v == 0, "gpumem_check: %s", gpumem_last_error());
  }
  gpumem_destroy(f->gm);
  if (f->sim) {
    gpumem_sim_counters_t c;
    gpumem_sim_get_counters(f->sim, &c);
    CHECK_MSG(c.bytes_in_use == 0 && c.ranges_reserved == 0 && c.pages_live == 0 &&
                  c.plain_live == 0 && c.events_live == 0,
              "the device holds %llu bytes, %llu ranges, %llu events after destroy",
              (unsigned long long)c.bytes_in_use, (unsigned long long)c.ranges_reserved,
              (unsigned long long)c.events_live);
    gpumem_sim_destroy(f->sim);
  }
  f->gm = NULL;
  f->sim = NULL;
}

/* Exit code CTest reports as "skipped". */
#define TEST_SKIP 77

#endif
