/* Tests of reconciling recordings that differ by short-lived allocations
 * (tools/reconcile.c): a group only the largest recording has is added to
 * the smaller one in proportion to the batch, a group only a smaller one
 * has is dropped, a transient group is not matched with the lasting
 * allocation after it, step markers stay where they were, and a difference
 * no group explains is left for the aligner to name. */
#include <stdio.h>
#include <string.h>

#include "reconcile.h"
#include "scale.h"
#include "test_util.h"
#include "trace.h"

static trace_t* parse(const char* name, const char* text) {
  trace_t* t = NULL;
  CHECK_STATUS(trace_parse(name, text, strlen(text), &t), GPUMEM_OK);
  return t;
}

/* Reconciles x (batch bx) with r (batch br), aligns and fits them, and
 * returns the model (NULL when they still differ); x may be replaced. */
static scale_model_t* fit_pair(trace_t** t, long bx, long br, reconcile_report_t* rep) {
  long batch[] = {bx, br};
  CHECK_STATUS(reconcile_transients(t, batch, 2, rep), GPUMEM_OK);
  scale_canonical_frees(t[0]);
  scale_canonical_frees(t[1]);
  scale_model_t* m = NULL;
  if (scale_fit((const trace_t* const*)t, batch, 2, &m) != GPUMEM_OK) return NULL;
  return m;
}

static void test_group_only_in_the_larger(void) {
  /* at batch 4 a kernel takes a workspace (800 bytes and 16) that batch 2 does without */
  trace_t* t[2] = {
      parse("b2.trace", "a 0 200 0\na 1 20 0\nf 1\na 2 200 0\nf 0\nf 2\n# step 1\n"),
      parse("b4.trace",
            "a 0 400 0\na 1 40 0\na 9 800 0\na 8 16 0\nf 8\nf 9\nf 1\na 2 400 0\nf 0\nf 2\n# step "
            "1\n"),
  };
  if (!t[0] || !t[1]) return;
  reconcile_report_t rep;
  scale_model_t* m = fit_pair(t, 2, 4, &rep);
  CHECK(m != NULL);
  CHECK(rep.groups == 1 && rep.added == 2 && rep.dropped == 0);
  CHECK(rep.added_bytes_at_largest == 816);
  CHECK(t[0]->num_allocs == 5 && t[0]->num_steps == 1 && t[0]->step_end[0] == 10);
  CHECK(strcmp(t[0]->path, "b2.trace") == 0);
  if (m) {
    trace_t* at = NULL;
    CHECK_STATUS(scale_trace_at(m, 8, &at, NULL), GPUMEM_OK);
    /* the workspace in proportion to the batch: 1600 and 32 bytes at batch 8 */
    if (at) CHECK(at->events[2].size == 1600 && at->events[3].size == 32);
    trace_free(at);
  }
  scale_free(m);
  trace_free(t[0]);
  trace_free(t[1]);
}

static void test_group_only_in_the_smaller(void) {
  trace_t* t[2] = {
      parse("b2.trace", "a 0 200 0\na 5 300 0\nf 5\na 1 20 0\nf 1\na 2 200 0\nf 0\nf 2\n"),
      parse("b4.trace", "a 0 400 0\na 1 40 0\nf 1\na 2 400 0\nf 0\nf 2\n"),
  };
  if (!t[0] || !t[1]) return;
  reconcile_report_t rep;
  scale_model_t* m = fit_pair(t, 2, 4, &rep);
  CHECK(m != NULL);
  CHECK(rep.groups == 1 && rep.added == 0 && rep.dropped == 1);
  CHECK(t[0]->num_allocs == 3 && t[0]->num_events == 6);
  /* the events kept name their lines in the file */
  CHECK(t[0]->events[0].line == 1 && t[0]->events[5].line == 8);
  scale_free(m);
  trace_free(t[0]);
  trace_free(t[1]);
}

static void test_transient_not_matched_with_a_lasting_allocation(void) {
  /* at batch 4 a 272-byte workspace comes between two allocations that
   * both recordings make: it must not be taken for the second of them */
  trace_t* t[2] = {
      parse("b2.trace", "a 0 100 0\na 1 100 0\na 2 8 0\nf 2\na 3 100 0\nf 0\nf 1\nf 3\n"),
      parse("b4.trace",
            "a 0 200 0\na 7 272 0\nf 7\na 1 200 0\na 2 8 0\nf 2\na 3 200 0\nf 0\nf 1\nf 3\n"),
  };
  if (!t[0] || !t[1]) return;
  reconcile_report_t rep;
  scale_model_t* m = fit_pair(t, 2, 4, &rep);
  CHECK(m != NULL);
  CHECK(rep.groups == 1 && rep.added == 1);
  if (m) CHECK(m->kind_count[SCALE_AFFINE] == 4 && m->kind_count[SCALE_CONSTANT] == 1);
  scale_free(m);
  trace_free(t[0]);
  trace_free(t[1]);
}

static void test_unexplained_difference_left_alone(void) {
  /* a lasting allocation freed past another allocation: no transient
   * group explains it, so the recordings are left as they were and the
   * aligner names it */
  trace_t* t[2] = {
      parse("b2.trace", "a 0 100 0\na 1 100 0\na 2 8 0\nf 2\nf 0\na 3 100 0\nf 1\nf 3\n"),
      parse("b4.trace", "a 0 200 0\na 1 200 0\na 2 8 0\nf 2\na 3 200 0\nf 0\nf 1\nf 3\n"),
  };
  if (!t[0] || !t[1]) return;
  const trace_t* before = t[0];
  reconcile_report_t rep;
  scale_model_t* m = fit_pair(t, 2, 4, &rep);
  CHECK(m == NULL);
  CHECK(strstr(gpumem_last_error(), "differ at event 4") != NULL);
  CHECK(rep.groups == 0 && t[0] == before);
  scale_free(m);
  trace_free(t[0]);
  trace_free(t[1]);
}

int main(void) {
  test_group_only_in_the_larger();
  test_group_only_in_the_smaller();
  test_transient_not_matched_with_a_lasting_allocation();
  test_unexplained_difference_left_alone();
  return test_finish("test_reconcile");
}
