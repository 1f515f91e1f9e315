/* PyTorch memory snapshot pickles read as traces (tools/pickle.c,
 * tools/snapshot.c), on the fixtures tests/snapshots/make_fixtures.py
 * writes: the snapshot of a sequence gives the same events as the sequence's
 * own trace, for pickle protocols 2 and 4; the busiest device is chosen or
 * the one GPUMEM_SNAPSHOT_DEVICE names; a snapshot without history, with a
 * wrapped ring, of another shape, with an object in it, or not a pickle at
 * all is an error that says so; and no corruption of a good pickle crashes
 * the reader (truncations and flipped bytes, each an error or a trace). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pickle.h"
#include "reader.h"
#include "snapshot.h"
#include "test_util.h"
#include "trace.h"

static const char* fixture(const char* name) {
  static char path[1024];
  snprintf(path, sizeof path, "%s/tests/snapshots/%s", GPUMEM_SOURCE_DIR, name);
  return path;
}

static void check_same_events(const trace_t* a, const trace_t* b) {
  CHECK(a->num_events == b->num_events);
  CHECK(a->num_allocs == b->num_allocs);
  CHECK(a->peak_live_bytes == b->peak_live_bytes);
  CHECK(a->end_live_bytes == b->end_live_bytes);
  size_t n = a->num_events < b->num_events ? a->num_events : b->num_events;
  size_t differ = 0;
  for (size_t i = 0; i < n; i++) {
    const trace_event_t *x = &a->events[i], *y = &b->events[i];
    if (x->op != y->op || x->size != y->size || x->stream != y->stream || x->id != y->id) differ++;
  }
  CHECK_MSG(differ == 0, "%zu events differ", differ);
}

static void test_same_as_trace(void) {
  trace_t *want = NULL, *got = NULL;
  CHECK_STATUS(trace_load(fixture("small.trace"), &want), GPUMEM_OK);
  const char* pickles[] = {"small.pickle", "small_proto2.pickle"};
  for (size_t k = 0; k < 2 && want; k++) {
    CHECK_STATUS(trace_load(fixture(pickles[k]), &got), GPUMEM_OK);
    if (!got) continue;
    check_same_events(want, got);
    CHECK(got->from_snapshot == 1);
    CHECK(got->snapshot_device == 0);
    CHECK(got->snapshot_lost_events == 0);
    CHECK(got->recorded_peak_reserved > 0);
    CHECK(strcmp(got->name, k == 0 ? "small" : "small_proto2") == 0);
    trace_free(got);
    got = NULL;
  }
  trace_free(want);
}

static void test_devices(void) {
  trace_t* t = NULL;
  unsetenv("GPUMEM_SNAPSHOT_DEVICE");
  CHECK_STATUS(trace_load(fixture("two_devices.pickle"), &t), GPUMEM_OK);
  if (t) {
    CHECK(t->snapshot_device == 1); /* the busier one */
    CHECK(t->num_allocs == 17);
    trace_free(t);
  }
  setenv("GPUMEM_SNAPSHOT_DEVICE", "0", 1);
  CHECK_STATUS(trace_load(fixture("two_devices.pickle"), &t), GPUMEM_OK);
  if (t) {
    CHECK(t->snapshot_device == 0);
    CHECK(t->num_allocs == 16);
    trace_free(t);
  }
  setenv("GPUMEM_SNAPSHOT_DEVICE", "2", 1);
  clear_error();
  CHECK_STATUS(trace_load(fixture("two_devices.pickle"), &t), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "names no device") != NULL);
  unsetenv("GPUMEM_SNAPSHOT_DEVICE");
}

static void expect_error(const char* name, const char* needle) {
  trace_t* t = NULL;
  clear_error();
  gpumem_status_t st = trace_load(fixture(name), &t);
  CHECK_MSG(st == GPUMEM_ERR_IO && t == NULL, "%s: status %s", name, gpumem_strerror(st));
  CHECK_MSG(strstr(gpumem_last_error(), needle) != NULL, "%s: '%s' not in: %s", name, needle,
            gpumem_last_error());
  CHECK_MSG(strstr(gpumem_last_error(), name) != NULL, "%s: message does not name the file", name);
  trace_free(t);
}

static void test_errors(void) {
  expect_error("no_history.pickle", "no allocation history");
  expect_error("truncated.pickle", "does not reach back");
  /* how much was lost, and what it does to the answer */
  expect_error("truncated.pickle", "at least 5 events are lost");
  expect_error("truncated.pickle", "lower bound");
  expect_error("a_list.pickle", "not a PyTorch memory snapshot");
  expect_error("with_object.pickle", "unsupported opcode STACK_GLOBAL");
  expect_error("not_a_pickle.pickle", "not a pickle");

  /* replayed anyway when asked: the lost allocations come first */
  trace_t* t = NULL;
  setenv("GPUMEM_SNAPSHOT_PARTIAL", "1", 1);
  CHECK_STATUS(trace_load(fixture("truncated.pickle"), &t), GPUMEM_OK);
  if (t) {
    CHECK(t->snapshot_lost_events == 5);
    CHECK(t->recorded_peak_reserved == 0); /* unknown: segments before the ring */
    CHECK(t->events[0].op == TRACE_ALLOC);
    trace_free(t);
  }
  unsetenv("GPUMEM_SNAPSHOT_PARTIAL");
}

/* Every truncation and many single-byte changes of a good pickle: the
 * reader returns a trace or an error, never crashes or leaks (ASan). */
static void test_corruption(void) {
  FILE* f = fopen(fixture("small.pickle"), "rb");
  CHECK(f != NULL);
  if (!f) return;
  unsigned char buf[16384];
  size_t len = fread(buf, 1, sizeof buf, f);
  fclose(f);
  unsigned char* copy = malloc(len);
  size_t ok = 0, errors = 0;
  for (size_t cut = 0; cut < len; cut += 7) {
    trace_t* t = NULL;
    gpumem_status_t st = snapshot_to_trace("cut", buf, cut, &t);
    if (st == GPUMEM_OK)
      ok++, trace_free(t);
    else
      errors++;
  }
  CHECK(errors > 0);
  srand(7);
  for (int i = 0; i < 3000; i++) {
    memcpy(copy, buf, len);
    size_t at = 2 + (size_t)rand() % (len - 2);
    copy[at] = (unsigned char)rand();
    trace_t* t = NULL;
    gpumem_status_t st = snapshot_to_trace("flip", copy, len, &t);
    if (st == GPUMEM_OK)
      ok++, trace_free(t);
    else
      errors++;
  }
  CHECK(ok > 0);
  free(copy);
}

int main(void) {
  test_same_as_trace();
  test_devices();
  test_errors();
  test_corruption();
  return test_finish("test_snapshot");
}
