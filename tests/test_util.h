/* Minimal test helpers: CHECK records a failure and goes on; the program's
 * exit status is the number of failures (capped), and it ends with the
 * plain "N passed, N failed" line. */
#ifndef GPUMEM_TEST_UTIL_H
#define GPUMEM_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem.h"

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
 * checked after a call is that call's own. */
static inline void clear_error(void) {
  gpumem_set_last_error("%s", "");
}

static inline int test_finish(const char* name) {
  printf("%s: %ld passed, %ld failed\n", name, test_checks_passed, test_checks_failed);
  return test_checks_failed ? 1 : 0;
}

/* A growing text sink (gpumem_write_fn) for output tests; it can fail from
 * a given call on, to test that the output stops and its value comes back. */
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

/* Exit code CTest reports as "skipped". */
#define TEST_SKIP 77

#endif
