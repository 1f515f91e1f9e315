/* Tests of prediction over the batch size (tools/scale.c). A synthetic job
 * written here at any batch is the ground truth: recordings at a few small
 * batches are aligned and fitted, and the trace predicted at another batch
 * must be the job's own trace there, event for event; the largest batch
 * found to fit a memory must be the one a direct replay of the job's own
 * trace finds. Then the refusals: recordings that differ (named by their
 * first differing event), sizes no model gives, sizes that would go to 0,
 * batches that do not increase. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fit.h"
#include "replay.h"
#include "scale.h"
#include "test_util.h"
#include "trace.h"

#define MIB 1048576L

/* What the synthetic job does besides its usual steps. */
typedef struct job {
  int steps;
  int attention;         /* an allocation quadratic in the batch (scores: b x b) */
  int shrinking;         /* one of 100*b - 150 bytes: below 1 byte at batch 1 */
  int cubic;             /* one of 1024 b^3 bytes: no model gives it */
  int zigzag;            /* one of at most 512 bytes that follows no trend: 6, 96, 24 */
  int swap_at;           /* in this step, free two activations in the other order */
  int halves;            /* one of (b + 4) / 2 bytes, b even in the recordings */
  int record_on_default; /* the activation is used on the default stream instead */
} job_t;

typedef struct text {
  char* s;
  size_t len, cap;
} text_t;

static void put(text_t* t, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text_t* t, const char* fmt, ...) {
  if (t->cap - t->len < 256) {
    t->cap = t->cap ? t->cap * 2 : 4096;
    t->s = realloc(t->s, t->cap);
    if (!t->s) abort();
  }
  va_list ap;
  va_start(ap, fmt);
  t->len += (size_t)vsnprintf(t->s + t->len, t->cap - t->len, fmt, ap);
  va_end(ap);
}

/* The job at batch b: weights (constant), then each step activations
 * affine in b, a constant workspace, one activation used on a side stream
 * whose handle differs from run to run (as in real recordings), gradients
 * freed one step later, and "# step N" after each step. */
static trace_t* job_at(const job_t* j, long b, const char* name) {
  text_t t = {0};
  long side = 0x100 + b; /* another process, another handle */
  put(&t, "# synthetic job at batch %ld\n", b);
  put(&t, "a 0 %ld 0\n", 64 * MIB);
  put(&t, "a 1 %ld 0\n", 4096L);
  for (int s = 1; s <= j->steps; s++) {
    put(&t, "a 10 %ld 0\n", MIB * b + 512);
    put(&t, "a 11 %ld 0\n", MIB / 2 * b);
    if (j->attention) put(&t, "a 12 %ld 0\n", 4096 * b * b + 1024 * b);
    put(&t, "a 13 %ld 0\n", 8 * MIB);
    put(&t, "r 11 0x%lx\n", j->record_on_default ? 0 : side);
    put(&t, "f 13\n");
    if (j->shrinking) put(&t, "a 14 %ld 0\nf 14\n", 100 * b - 150);
    if (j->cubic) put(&t, "a 15 %ld 0\nf 15\n", 1024 * b * b * b);
    if (j->zigzag) put(&t, "a 17 %ld 0\nf 17\n", b == 2 ? 6L : b == 4 ? 96L : 24L);
    if (j->halves) put(&t, "a 16 %ld 0\nf 16\n", (b + 4) / 2);
    if (s > 1) put(&t, "f 20\n"); /* the previous step's gradient */
    put(&t, "a 20 %ld 0\n", 2 * MIB + 256 * b);
    if (j->attention) put(&t, "f 12\n");
    if (s == j->swap_at) {
      put(&t, "f 10\nf 11\n");
    } else {
      put(&t, "f 11\nf 10\n");
    }
    put(&t, "# step %d\n", s);
  }
  trace_t* out = NULL;
  gpumem_status_t st = trace_parse(name, t.s, t.len, &out);
  CHECK_MSG(st == GPUMEM_OK, "job at batch %ld: %s", b, gpumem_last_error());
  free(t.s);
  return out;
}

/* Recordings of job j at batch[0..n), named "b<batch>.trace". */
static void record(const job_t* j, const long* batch, size_t n, trace_t** out) {
  for (size_t i = 0; i < n; i++) {
    char name[64];
    snprintf(name, sizeof name, "b%ld.trace", batch[i]);
    out[i] = job_at(j, batch[i], name);
  }
}

static void free_all(trace_t** t, size_t n) {
  for (size_t i = 0; i < n; i++) trace_free(t[i]);
}

/* Same events, same slots, same sizes, same streams. */
static int same_trace(const trace_t* a, const trace_t* b) {
  if (a->num_events != b->num_events || a->num_allocs != b->num_allocs) return 0;
  for (size_t i = 0; i < a->num_events; i++) {
    const trace_event_t *x = &a->events[i], *y = &b->events[i];
    if (x->op != y->op || x->id != y->id || x->size != y->size) return 0;
  }
  return a->peak_live_bytes == b->peak_live_bytes && a->num_steps == b->num_steps;
}

static void test_affine_and_constant(void) {
  job_t j = {.steps = 3};
  long batch[] = {2, 4};
  trace_t* rec[2];
  record(&j, batch, 2, rec);
  scale_model_t* m = NULL;
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 2, &m), GPUMEM_OK);
  if (!m) return free_all(rec, 2);
  /* weights and workspaces constant; activations and gradients affine */
  CHECK(m->num_allocs == 2 + 3 * 4);
  CHECK(m->kind_count[SCALE_CONSTANT] == 2 + 3);
  CHECK(m->kind_count[SCALE_AFFINE] == 3 * 3);
  CHECK(m->kind_count[SCALE_QUADRATIC] == 0);
  CHECK(m->steps_used == 3 && !m->truncated);
  CHECK(!m->check.done);
  long targets[] = {1, 3, 4, 64, 1000};
  for (size_t i = 0; i < sizeof targets / sizeof targets[0]; i++) {
    trace_t* got = NULL;
    scale_at_t info;
    CHECK_STATUS(scale_trace_at(m, targets[i], &got, &info), GPUMEM_OK);
    trace_t* want = job_at(&j, targets[i], "want");
    CHECK_MSG(got && want && same_trace(got, want), "batch %ld", targets[i]);
    CHECK(info.rounded == 0);
    /* the events of the smallest recording: its side stream */
    if (got) CHECK(got->events[5].op == TRACE_RECORD_STREAM && got->events[5].stream == 0x102);
    trace_free(got);
    trace_free(want);
  }
  scale_free(m);
  free_all(rec, 2);
}

static void test_quadratic_and_check(void) {
  job_t j = {.steps = 2, .attention = 1};
  long batch[] = {2, 4, 8};
  trace_t* rec[3];
  record(&j, batch, 3, rec);
  scale_model_t* m = NULL;
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 3, &m), GPUMEM_OK);
  if (!m) return free_all(rec, 3);
  CHECK(m->kind_count[SCALE_QUADRATIC] == 2);
  CHECK(m->kind_count[SCALE_AFFINE] == 2 * 3);
  CHECK(m->kind_count[SCALE_CONSTANT] == 2 + 2);
  /* the held-out batch 8 from 2 and 4: all but the scores to the byte */
  CHECK(m->check.done && m->check.batch == 8);
  CHECK(m->check.allocations == m->num_allocs);
  CHECK(m->check.exact == m->num_allocs - 2);
  CHECK(m->check.unpredicted == 0);
  /* scores at 8: 4096*64 + 8192; the line through 2 and 4 gives 4096*(6*8 - 8) + 8192 */
  CHECK(m->check.max_error_bytes == 4096 * 64 - 4096 * 40);
  CHECK(m->check.recorded_peak_live == rec[2]->peak_live_bytes);
  CHECK(m->check.predicted_peak_live < m->check.recorded_peak_live);
  trace_t* got = NULL;
  CHECK_STATUS(scale_trace_at(m, 48, &got, NULL), GPUMEM_OK);
  trace_t* want = job_at(&j, 48, "want");
  CHECK(got && want && same_trace(got, want));
  trace_free(got);
  trace_free(want);
  scale_free(m);

  /* four recordings and an allocation of b^3 bytes: no model, named */
  job_t c = {.steps = 1, .cubic = 1};
  long four[] = {1, 2, 3, 5};
  trace_t* r4[4];
  record(&c, four, 4, r4);
  clear_error();
  CHECK_STATUS(scale_fit((const trace_t* const*)r4, four, 4, &m), GPUMEM_ERR_INVALID_ARGUMENT);
  const char* msg = gpumem_last_error();
  CHECK_MSG(strstr(msg, "b1.trace line 9") && strstr(msg, "b5.trace line 9") &&
                strstr(msg, "128000 at batch 5") && strstr(msg, "no constant, affine"),
            "%s", msg);
  CHECK(m == NULL);
  free_all(r4, 4);
  free_all(rec, 3);
}

/* An allocation of at most 512 bytes that follows no trend (6, 96, 24 at
 * batch 2, 4, 8) is held at its largest size, where a curve through it
 * would fall below one byte by batch 16; one of larger sizes in the same
 * zigzag is still refused. */
static void test_small_sizes_held(void) {
  job_t j = {.steps = 1, .zigzag = 1};
  long batch[] = {2, 4, 8};
  trace_t* rec[3];
  record(&j, batch, 3, rec);
  scale_model_t* m = NULL;
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 3, &m), GPUMEM_OK);
  if (m) {
    CHECK(m->num_held == 1);
    CHECK(m->kind_count[SCALE_QUADRATIC] == 0);
    trace_t* got = NULL;
    CHECK_STATUS(scale_trace_at(m, 1024, &got, NULL), GPUMEM_OK);
    size_t held = 0;
    for (size_t i = 0; got && i < got->num_events; i++)
      if (got->events[i].op == TRACE_ALLOC && got->events[i].size == 96) held++;
    CHECK(held == 1);
    trace_free(got);
    scale_free(m);
  }
  free_all(rec, 3);
}

static void test_rounding_and_below_one(void) {
  job_t j = {.steps = 1, .halves = 1, .shrinking = 1};
  long batch[] = {2, 4};
  trace_t* rec[2];
  record(&j, batch, 2, rec);
  scale_model_t* m = NULL;
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 2, &m), GPUMEM_OK);
  if (!m) return free_all(rec, 2);
  /* (b + 4) / 2 at batch 3: 3.5 bytes, rounded to 4 */
  trace_t* got = NULL;
  scale_at_t info;
  CHECK_STATUS(scale_trace_at(m, 3, &got, &info), GPUMEM_OK);
  CHECK(info.rounded == 1);
  if (got) CHECK(got->events[9].size == 4);
  trace_free(got);
  /* 100*b - 150 at batch 1: -50 bytes, refused by name */
  clear_error();
  CHECK_STATUS(scale_trace_at(m, 1, &got, &info), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(got == NULL && info.status == SCALE_AT_BELOW_ONE);
  const char* msg = gpumem_last_error();
  CHECK_MSG(strstr(msg, "at batch 1") && strstr(msg, "b2.trace line 9") &&
                strstr(msg, "-50 bytes") && strstr(msg, "100*b - 150") &&
                strstr(msg, "at least 1 byte"),
            "%s", msg);
  CHECK_STATUS(scale_trace_at(m, 0, &got, &info), GPUMEM_ERR_INVALID_ARGUMENT);
  /* too large for any device: refused, as not fitting */
  CHECK_STATUS(scale_trace_at(m, SCALE_MAX_BATCH, &got, &info), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(info.status == SCALE_AT_TOO_LARGE);
  scale_free(m);
  free_all(rec, 2);
}

static void test_misaligned(void) {
  job_t j = {.steps = 3};
  job_t swapped = {.steps = 3, .swap_at = 2};
  trace_t* rec[2] = {job_at(&j, 2, "b2.trace"), job_at(&swapped, 4, "b4.trace")};
  long batch[] = {2, 4};
  scale_model_t* m = NULL;
  clear_error();
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 2, &m), GPUMEM_ERR_INVALID_ARGUMENT);
  const char* msg = gpumem_last_error();
  /* step 2 allocates its activations at lines 13 and 14 and frees one at line 20 */
  CHECK_MSG(strstr(msg, "differ at event 18") &&
                strstr(msg, "b2.trace (batch 2) has line 20: free of the allocation of line 14") &&
                strstr(msg, "b4.trace (batch 4) has line 20: free of the allocation of line 13"),
            "%s", msg);
  trace_free(rec[1]);

  /* the side stream in one recording, the default one in the other */
  job_t side = {.steps = 3, .record_on_default = 1};
  rec[1] = job_at(&side, 4, "b4.trace");
  clear_error();
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 2, &m), GPUMEM_ERR_INVALID_ARGUMENT);
  msg = gpumem_last_error();
  CHECK_MSG(strstr(msg, "differ at event 6") &&
                strstr(msg,
                       "line 7: record_stream of the allocation of line 5 on stream 0x102 "
                       "(its 2nd stream)") &&
                strstr(msg,
                       "line 7: record_stream of the allocation of line 5 on stream 0x0 "
                       "(its 1st stream)"),
            "%s", msg);
  trace_free(rec[1]);

  /* a recording cut short without step markers in common: named where it ends */
  rec[1] = job_at(&j, 4, "b4.trace");
  rec[1]->num_steps = 0; /* as if recorded without markers */
  rec[1]->num_events -= 3;
  clear_error();
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 2, &m), GPUMEM_ERR_INVALID_ARGUMENT);
  msg = gpumem_last_error();
  CHECK_MSG(strstr(msg, "b4.trace ends there") && strstr(msg, "b2.trace has line"), "%s", msg);
  rec[1]->num_events += 3;
  trace_free(rec[1]);

  /* different numbers of steps: the steps in common, and said so */
  job_t longer = {.steps = 5};
  rec[1] = job_at(&longer, 4, "b4.trace");
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 2, &m), GPUMEM_OK);
  if (m) {
    CHECK(m->steps_used == 3 && m->truncated);
    trace_t* got = NULL;
    CHECK_STATUS(scale_trace_at(m, 8, &got, NULL), GPUMEM_OK);
    trace_t* want = job_at(&j, 8, "want");
    CHECK(got && want && same_trace(got, want));
    trace_free(got);
    trace_free(want);
    scale_free(m);
  }
  free_all(rec, 2);

  /* as many steps, one recording stopped in the middle of a fourth */
  rec[0] = job_at(&j, 2, "b2.trace");
  rec[1] = job_at(&longer, 4, "b4.trace");
  rec[1]->num_steps = 3;
  rec[1]->num_events = rec[1]->step_end[2] + 4;
  m = NULL;
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 2, &m), GPUMEM_OK);
  if (m) CHECK(m->steps_used == 3 && m->truncated && m->num_events == rec[0]->num_events);
  scale_free(m);
  free_all(rec, 2);

  /* batches that do not increase, too few recordings, the same run twice */
  rec[0] = job_at(&j, 2, "b2.trace");
  rec[1] = job_at(&j, 2, "b2.trace");
  clear_error();
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 2, &m), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_MSG(strstr(gpumem_last_error(), "no allocation's size differs"), "%s", gpumem_last_error());
  long same[] = {2, 2};
  clear_error();
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, same, 2, &m), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_MSG(strstr(gpumem_last_error(), "must increase"), "%s", gpumem_last_error());
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, same, 1, &m), GPUMEM_ERR_INVALID_ARGUMENT);
  long zero[] = {0, 2};
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, zero, 2, &m), GPUMEM_ERR_INVALID_ARGUMENT);
  free_all(rec, 2);
}

/* Whether job j's own trace at batch b replays under memory with row. */
static int truth_fits(const job_t* j, long b, const fit_row_t* row, size_t memory,
                      const replay_config_t* base) {
  trace_t* t = job_at(j, b, "truth");
  int fits = 0;
  CHECK_STATUS(fit_fits(t, row, memory, base, &fits), GPUMEM_OK);
  trace_free(t);
  return fits;
}

static void test_largest_batch(void) {
  job_t j = {.steps = 3, .attention = 1};
  long batch[] = {2, 4, 8};
  trace_t* rec[3];
  record(&j, batch, 3, rec);
  scale_model_t* m = NULL;
  CHECK_STATUS(scale_fit((const trace_t* const*)rec, batch, 3, &m), GPUMEM_OK);
  if (!m) return free_all(rec, 3);
  replay_config_t base;
  replay_config_init(&base);
  size_t memory = 512 * (size_t)MIB;
  for (size_t r = 0; r < fit_num_rows; r++) {
    const fit_row_t* row = &fit_rows[r];
    scale_largest_t got;
    CHECK_STATUS(scale_largest_batch(m, row, memory, 0, &base, &got), GPUMEM_OK);
    CHECK_MSG(got.batch > 8 && got.limited_by == SCALE_BY_MEMORY && !got.below_recorded,
              "%s: batch %ld", row->name, got.batch);
    CHECK(got.first_not_fitting == got.batch + 1);
    /* the job's own traces: the answer fits, the next batch does not */
    CHECK_MSG(truth_fits(&j, got.batch, row, memory, &base), "%s: %ld", row->name, got.batch);
    CHECK_MSG(!truth_fits(&j, got.batch + 1, row, memory, &base), "%s: %ld", row->name,
              got.batch + 1);
  }
  /* a cap below the answer */
  scale_largest_t capped;
  CHECK_STATUS(scale_largest_batch(m, &fit_rows[0], memory, 20, &base, &capped), GPUMEM_OK);
  CHECK(capped.batch == 20 && capped.limited_by == SCALE_BY_MAX_BATCH);
  /* the memory batch 1 needs, below what the smallest recording needs:
   * extrapolated downward */
  trace_t* one = job_at(&j, 1, "truth");
  fit_result_t need;
  CHECK_STATUS(fit_one(one, &fit_rows[3], 0, &base, &need), GPUMEM_OK);
  trace_free(one);
  size_t small = need.needed;
  CHECK(small > 0 && !truth_fits(&j, 2, &fit_rows[3], small, &base));
  scale_largest_t down;
  CHECK_STATUS(scale_largest_batch(m, &fit_rows[3], small, 0, &base, &down), GPUMEM_OK);
  CHECK_MSG(down.batch == 1 && down.below_recorded, "batch %ld", down.batch);
  CHECK(!truth_fits(&j, down.batch + 1, &fit_rows[3], small, &base));
  /* less than the weights: no batch fits */
  scale_largest_t none;
  CHECK_STATUS(scale_largest_batch(m, &fit_rows[3], 32 * (size_t)MIB, 0, &base, &none), GPUMEM_OK);
  CHECK(none.batch == 0 && none.first_not_fitting == 1 && none.limited_by == SCALE_BY_MEMORY);
  scale_free(m);
  free_all(rec, 3);

  /* sizes that reach 0 below the recordings: no answer below where the model holds */
  job_t s = {.steps = 1, .shrinking = 1};
  long two[] = {4, 8};
  trace_t* r2[2];
  record(&s, two, 2, r2);
  CHECK_STATUS(scale_fit((const trace_t* const*)r2, two, 2, &m), GPUMEM_OK);
  if (m) {
    scale_largest_t edge;
    CHECK_STATUS(scale_largest_batch(m, &fit_rows[3], 32 * (size_t)MIB, 0, &base, &edge),
                 GPUMEM_OK);
    CHECK_MSG(edge.batch == 0 && edge.model_edge == 1, "batch %ld edge %ld", edge.batch,
              edge.model_edge);
    scale_free(m);
  }
  free_all(r2, 2);
}

/* The recorder's "# step N" lines are kept as step boundaries; other
 * comments that merely start alike are not. */
static void test_step_markers(void) {
  static const char text[] =
      "# step 9\n"
      "a 0 10 0\n"
      "# step 1\n"
      "a 1 10 0\n"
      "# steps 2\n"
      "#step 2  \n"
      "# step x\n"
      "f 1\n"
      "  # step 3\r\n";
  trace_t* t = NULL;
  CHECK_STATUS(trace_parse("steps.trace", text, sizeof text - 1, &t), GPUMEM_OK);
  if (!t) return;
  CHECK(t->num_steps == 4);
  size_t want[] = {0, 1, 2, 3};
  for (size_t i = 0; i < 4 && i < t->num_steps; i++) CHECK(t->step_end[i] == want[i]);
  trace_free(t);
}

/* Frees made together may come in another order at another batch (a
 * recorder sees a graph's saved tensors go in the order its collector
 * frees them): they align once each run is in allocation order, and a
 * free moved past an allocation still does not. */
static void test_frees_made_together(void) {
  static const char b1[] = "a 0 100 0\na 1 10 0\na 2 20 0\nf 0\nf 2\nf 1\na 3 100 0\nf 3\n";
  static const char b2[] = "a 0 200 0\na 1 10 0\na 2 20 0\nf 1\nf 0\nf 2\na 3 200 0\nf 3\n";
  static const char moved[] = "a 0 200 0\na 1 10 0\na 2 20 0\nf 1\nf 0\na 3 200 0\nf 2\nf 3\n";
  trace_t *x = NULL, *y = NULL, *z = NULL;
  CHECK_STATUS(trace_parse("b1.trace", b1, sizeof b1 - 1, &x), GPUMEM_OK);
  CHECK_STATUS(trace_parse("b2.trace", b2, sizeof b2 - 1, &y), GPUMEM_OK);
  CHECK_STATUS(trace_parse("moved.trace", moved, sizeof moved - 1, &z), GPUMEM_OK);
  if (!x || !y || !z) return;
  long batch[] = {1, 2};
  scale_model_t* m = NULL;
  const trace_t* raw[] = {x, y};
  CHECK(scale_fit(raw, batch, 2, &m) == GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "differ at event 4") != NULL);
  scale_canonical_frees(x);
  scale_canonical_frees(y);
  scale_canonical_frees(z);
  CHECK_STATUS(scale_fit(raw, batch, 2, &m), GPUMEM_OK);
  if (m) CHECK(m->kind_count[SCALE_AFFINE] == 2 && m->kind_count[SCALE_CONSTANT] == 2);
  scale_free(m);
  m = NULL;
  const trace_t* other[] = {x, z};
  CHECK(scale_fit(other, batch, 2, &m) == GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "differ at event 6") != NULL);
  scale_free(m);
  trace_free(x);
  trace_free(y);
  trace_free(z);
}

int main(void) {
  test_frees_made_together();
  test_step_markers();
  test_affine_and_constant();
  test_quadratic_and_check();
  test_rounding_and_below_one();
  test_small_sizes_held();
  test_misaligned();
  test_largest_batch();
  return test_finish("test_scale");
}
