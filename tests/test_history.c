/* History and snapshots (src/history.c) on the simulated device: which
 * events the ring keeps and in what order, their tags, frees that wait for
 * other streams, out-of-memory events, the snapshot's totals against the
 * statistics, and failures (bad arguments, a sink that stops, a ring that
 * cannot be made) that leave the allocator as it was. The snapshot's shape
 * against what PyTorch's memory_viz reads is checked in Python
 * (python/tests/test_history.py) and with torch itself on the GPU machine
 * (tests/gpu/torch). */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"

#define MIB ((size_t)1 << 20)
#define GIB8 ((size_t)8 << 30)

static char* snapshot(gpumem_t* gm, int device) {
  sink_t t = {0};
  int rc = gpumem_snapshot_json(gm, device, "steps.py", sink_write, &t);
  CHECK_MSG(rc == 0, "snapshot: %d (%s)", rc, gpumem_last_error());
  return t.text;
}

/* The recorded events, one per line of the snapshot: "alloc:3" for an
 * allocation tagged 3, "free_completed:0" for an untagged completed free,
 * joined by spaces. */
static void events_of(const char* json, char* out, size_t cap) {
  out[0] = '\0';
  size_t used = 0;
  for (const char* p = strstr(json, "{\"action\":\""); p; p = strstr(p + 1, "{\"action\":\"")) {
    char action[32] = "";
    sscanf(p, "{\"action\":\"%31[a-z_]\"", action);
    const char* end = strchr(p, '\n');
    const char* line = strstr(p, "\"line\":");
    unsigned long tag = 0;
    if (line && (!end || line < end)) sscanf(line, "\"line\":%lu", &tag);
    int n = snprintf(out + used, cap - used, "%s%s:%lu", used ? " " : "", action, tag);
    if (n < 0 || (size_t)n >= cap - used) break;
    used += (size_t)n;
  }
}

/* A number of the snapshot's "gpumem" member. */
static long long gpumem_field(const char* json, const char* key) {
  const char* g = strstr(json, "\"gpumem\":{");
  char pattern[64];
  snprintf(pattern, sizeof pattern, "\"%s\":", key);
  const char* p = g ? strstr(g, pattern) : NULL;
  long long v = -1;
  if (p) sscanf(p + strlen(pattern), "%lld", &v);
  return v;
}

static size_t count(const char* s, const char* what) {
  size_t n = 0;
  for (const char* p = strstr(s, what); p; p = strstr(p + 1, what)) n++;
  return n;
}

static void* alloc_tagged(gpumem_t* gm, size_t size, gpumem_stream_t stream, uint64_t tag) {
  void* p = NULL;
  gpumem_set_history_tag(gm, tag);
  CHECK_STATUS(gpumem_malloc(gm, size, stream, &p), GPUMEM_OK);
  return p;
}

/* The ring keeps the last events, oldest first, with their tags. */
static void test_ring(const char* conf) {
  fx_t f = fx_new(conf, GIB8, 0);
  if (!f.gm) return fx_done(&f);
  char* json = snapshot(f.gm, 0);
  CHECK_MSG(json && count(json, "\"action\"") == 0 && strstr(json, "\"device_traces\":[[]]"),
            "%s: events before recording started", conf);
  free(json);
  CHECK_STATUS(gpumem_record_history(f.gm, 8), GPUMEM_OK);
  void* p[10];
  for (int i = 0; i < 10; i++) p[i] = alloc_tagged(f.gm, (size_t)(i + 1) * MIB, 0, 1 + i);
  char got[1024];
  json = snapshot(f.gm, 0);
  events_of(json, got, sizeof got);
  CHECK_MSG(strcmp(got, "alloc:3 alloc:4 alloc:5 alloc:6 alloc:7 alloc:8 alloc:9 alloc:10") == 0,
            "%s: kept %s", conf, got);
  CHECK(gpumem_field(json, "history_recorded") == 10 &&
        gpumem_field(json, "history_capacity") == 8);
  free(json);
  gpumem_set_history_tag(f.gm, 0);
  CHECK_STATUS(gpumem_free(f.gm, p[0]), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f.gm, p[9]), GPUMEM_OK);
  json = snapshot(f.gm, 0);
  events_of(json, got, sizeof got);
  CHECK_MSG(strcmp(got,
                   "alloc:7 alloc:8 alloc:9 alloc:10 free_requested:0 free_completed:0 "
                   "free_requested:0 free_completed:0") == 0,
            "%s: kept %s", conf, got);
  /* A live block's frame is its allocation's tag, which the block keeps:
   * block 5 (tag 5, 5 MiB) has it though the ring wrapped out its event... */
  CHECK_MSG(count(json, "\"line\":5,") == 1, "%s: block 5's tag appears %zu times", conf,
            count(json, "\"line\":5,"));
  /* ...blocks 7-9 are live with their allocations kept: one frame in the
   * events and one on the block each. */
  for (int tag = 7; tag <= 9; tag++) {
    char pattern[32];
    snprintf(pattern, sizeof pattern, "\"line\":%d,", tag);
    CHECK_MSG(count(json, pattern) == 2, "%s: tag %d appears %zu times", conf, tag,
              count(json, pattern));
  }
  /* Totals: segments and spare pages make the reserved bytes. */
  gpumem_stats_t st;
  gpumem_get_stats(f.gm, &st);
  CHECK(gpumem_field(json, "reserved_bytes") == st.reserved_bytes[GPUMEM_POOL_ALL].current);
  CHECK(gpumem_field(json, "allocated_bytes") == st.allocated_bytes[GPUMEM_POOL_ALL].current);
  CHECK_MSG(gpumem_field(json, "segment_bytes") + gpumem_field(json, "spare_bytes") ==
                st.reserved_bytes[GPUMEM_POOL_ALL].current,
            "%s: segments %lld + spare %lld, reserved %lld", conf,
            gpumem_field(json, "segment_bytes"), gpumem_field(json, "spare_bytes"),
            (long long)st.reserved_bytes[GPUMEM_POOL_ALL].current);
  free(json);
  /* Filed under its device index. */
  json = snapshot(f.gm, 2);
  CHECK(json && strstr(json, "\"device_traces\":[[],[],[\n"));
  CHECK(json && count(json, "\"device\":2,") > 0 && count(json, "\"device\":0,") == 0);
  free(json);
  /* Stopping forgets. */
  CHECK_STATUS(gpumem_record_history(f.gm, 0), GPUMEM_OK);
  json = snapshot(f.gm, 0);
  CHECK(json && count(json, "\"action\"") == 0 && gpumem_field(json, "history_capacity") == 0);
  free(json);
  for (int i = 1; i < 9; i++) CHECK_STATUS(gpumem_free(f.gm, p[i]), GPUMEM_OK);
  fx_done(&f);
}

/* A free that waits for another stream's work: requested at once,
 * completed when the event is; meanwhile the block is pending. */
static void test_pending_free(void) {
  fx_t f = fx_new("policy:default", GIB8, 3);
  if (!f.gm) return fx_done(&f);
  CHECK_STATUS(gpumem_record_history(f.gm, 64), GPUMEM_OK);
  void* p = alloc_tagged(f.gm, 4 * MIB, 1, 11);
  CHECK_STATUS(gpumem_record_stream(f.gm, p, 2), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f.gm, p), GPUMEM_OK);
  char got[512];
  char* json = snapshot(f.gm, 0);
  events_of(json, got, sizeof got);
  CHECK_MSG(strcmp(got, "alloc:11 free_requested:11") == 0, "pending: %s", got);
  CHECK_MSG(count(json, "\"state\":\"active_pending_free\"") == 1, "no pending block: %s", json);
  /* ...still carrying its allocation's frame */
  CHECK(count(json, "\"line\":11,") == 3);
  free(json);
  /* Later allocations query the event until it completes. */
  void* q[4];
  for (int i = 0; i < 4; i++) q[i] = alloc_tagged(f.gm, MIB, 1, 20 + i);
  json = snapshot(f.gm, 0);
  events_of(json, got, sizeof got);
  CHECK_MSG(strstr(got, "free_completed:") != NULL, "never completed: %s", got);
  CHECK(count(json, "active_pending_free") == 0);
  free(json);
  for (int i = 0; i < 4; i++) CHECK_STATUS(gpumem_free(f.gm, q[i]), GPUMEM_OK);
  fx_done(&f);
}

/* An out-of-memory failure is an event: the request's size, and the
 * device's free bytes in addr and device_free, as PyTorch files them. */
static void test_oom_event(void) {
  fx_t f = fx_new("policy:default,limit:64M", GIB8, 0);
  if (!f.gm) return fx_done(&f);
  CHECK_STATUS(gpumem_record_history(f.gm, 16), GPUMEM_OK);
  void* p = NULL;
  gpumem_set_history_tag(f.gm, 5);
  CHECK_STATUS(gpumem_malloc(f.gm, 100 * MIB, 0, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  char* json = snapshot(f.gm, 0);
  char got[256];
  events_of(json, got, sizeof got);
  CHECK_MSG(strcmp(got, "oom:5") == 0, "oom: %s", got);
  char want[128];
  snprintf(want, sizeof want, "\"size\":%zu,", 100 * MIB);
  CHECK_MSG(json && strstr(json, want) && strstr(json, "\"device_free\":"), "oom event: %s",
            json ? json : "(none)");
  free(json);
  fx_done(&f);
}

/* Bad arguments and failures change nothing. */
static void test_failures(void) {
  fx_t f = fx_new("policy:default", GIB8, 0);
  if (!f.gm) return fx_done(&f);
  sink_t t = {0};
  CHECK(gpumem_snapshot_json(NULL, 0, NULL, sink_write, &t) == GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(gpumem_snapshot_json(f.gm, -1, NULL, sink_write, &t) == GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_MSG(strstr(gpumem_last_error(), "negative device") != NULL, "%s", gpumem_last_error());
  CHECK(gpumem_snapshot_json(f.gm, 0, NULL, NULL, NULL) == GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(gpumem_record_history(NULL, 4), GPUMEM_ERR_INVALID_ARGUMENT);
  gpumem_set_history_tag(NULL, 1); /* ignored */
  CHECK_STATUS(gpumem_record_history(f.gm, 4), GPUMEM_OK);
  /* A ring that cannot be made leaves the one recording. */
  CHECK_STATUS(gpumem_record_history(f.gm, SIZE_MAX / 2), GPUMEM_ERR_INVALID_ARGUMENT);
#if !defined(__SANITIZE_ADDRESS__) /* ASan aborts on a request this size instead of failing it */
  CHECK_STATUS(gpumem_record_history(f.gm, ((size_t)1 << 60) / 48), GPUMEM_ERR_HOST_MEMORY);
#endif
  void* p = alloc_tagged(f.gm, MIB, 0, 9);
  char* json = snapshot(f.gm, 0);
  char got[128];
  events_of(json, got, sizeof got);
  CHECK_MSG(strcmp(got, "alloc:9") == 0, "after failed restarts: %s", got);
  CHECK(gpumem_field(json, "history_capacity") == 4);
  free(json);
  /* A sink that stops: its answer comes back, and the lock is free. */
  t.fail_at = 3;
  t.fail_with = 7;
  CHECK(gpumem_snapshot_json(f.gm, 0, NULL, sink_write, &t) == 7);
  CHECK(t.calls == 3); /* nothing written after the sink said stop */
  sink_free(&t);
  CHECK_STATUS(gpumem_free(f.gm, p), GPUMEM_OK);
  /* A file name that needs escaping stays valid JSON. */
  t = (sink_t){0};
  p = alloc_tagged(f.gm, MIB, 0, 3);
  CHECK(gpumem_snapshot_json(f.gm, 0, "a \"b\"\\c\n", sink_write, &t) == 0);
  CHECK_MSG(t.text && strstr(t.text, "\"filename\":\"a \\\"b\\\"\\\\c\\u000a\""), "%s",
            t.text ? t.text : "(none)");
  sink_free(&t);
  CHECK_STATUS(gpumem_free(f.gm, p), GPUMEM_OK);
  fx_done(&f);
}

int main(void) {
  test_ring("policy:default");
  test_ring("policy:pytorch");
  test_ring("policy:default,reclaim:pressure,placement:bestfit");
  test_pending_free();
  test_oom_event();
  test_failures();
  return test_finish("test_history");
}
