/* Tests of the trace reader (tools/trace.c): parsing of plain and gzip
 * files, ID reuse and dense slots, record_stream lines, the peak-live
 * facts, every malformed-line error naming the file and the line, and the
 * bundled traces' published figures; then a few replays of a tiny trace on
 * the simulated device (tools/replay.c). Built with
 * -DTEST_TRACE_WITHOUT_ENGINE it tests the reader alone, linked with only
 * src/errors.c and zlib. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "gpumem.h"
#include "reader.h"
#include "replay.h"
#include "test_util.h"
#include "trace.h"

static char tmpdir[64];

static void write_plain(const char* path, const char* text) {
  FILE* f = fopen(path, "wb");
  CHECK(f != NULL);
  if (!f) return;
  fwrite(text, 1, strlen(text), f);
  fclose(f);
}

static void write_gzip(const char* path, const char* text) {
  gzFile f = gzopen(path, "wb");
  CHECK(f != NULL);
  if (!f) return;
  CHECK(gzwrite(f, text, (unsigned)strlen(text)) == (int)strlen(text));
  gzclose(f);
}

static const char* tmp_path(const char* name, char* buf, size_t cap) {
  snprintf(buf, cap, "%s/%s", tmpdir, name);
  return buf;
}

/* a 0, a 1 (stream 7), r 1 on 9, f 0, a 0 again (a new slot), f 1. */
static const char small_trace[] =
    "# gpumem-trace v1\n"
    "\n"
    "a 0 100 0\n"
    "a 1 200 7\n"
    "   \n"
    "r 1 9\n"
    "f 0\n"
    "a 0 50 0\n"
    "f 1\n";

static void check_small(const trace_t* t) {
  CHECK(t->num_events == 6);
  CHECK(t->num_allocs == 3);
  CHECK(t->num_frees == 2);
  CHECK(t->num_record_streams == 1);
  CHECK(t->peak_live_bytes == 300);
  CHECK(t->peak_event == 1);
  CHECK(t->peak_live_allocs == 2);
  CHECK(t->num_streams == 3);
  CHECK(t->end_live_bytes == 50);
  CHECK(t->end_live_allocs == 1);
  CHECK(t->total_alloc_bytes == 350);
  CHECK(t->max_alloc_size == 200);
  CHECK(trace_num_ops(t) == 5);
  if (t->num_events != 6) return;
  const trace_event_t* e = t->events;
  CHECK(e[0].op == TRACE_ALLOC && e[0].id == 0 && e[0].size == 100 && e[0].stream == 0);
  CHECK(e[0].line == 3);
  CHECK(e[1].op == TRACE_ALLOC && e[1].id == 1 && e[1].size == 200 && e[1].stream == 7);
  CHECK(e[2].op == TRACE_RECORD_STREAM && e[2].id == 1 && e[2].stream == 9 && e[2].size == 200);
  CHECK(e[2].line == 6);
  CHECK(e[3].op == TRACE_FREE && e[3].id == 0 && e[3].size == 100);
  /* A reused trace ID gets a slot of its own. */
  CHECK(e[4].op == TRACE_ALLOC && e[4].id == 2 && e[4].size == 50);
  CHECK(e[5].op == TRACE_FREE && e[5].id == 1 && e[5].stream == 7);
  CHECK(t->slot_trace_id[2] == 0 && t->slot_trace_id[1] == 1);
  CHECK(t->slot_event[2] == 4);
}

static void test_parse(void) {
  char path[256];
  trace_t* t = NULL;

  CHECK_STATUS(trace_load(tmp_path("small.trace", path, sizeof path), &t), GPUMEM_OK);
  if (t) {
    check_small(t);
    CHECK(strcmp(t->name, "small") == 0);
    CHECK(strcmp(t->path, path) == 0);
    trace_free(t);
  }

  t = NULL;
  CHECK_STATUS(trace_load(tmp_path("small.trace.gz", path, sizeof path), &t), GPUMEM_OK);
  if (t) {
    check_small(t);
    CHECK(strcmp(t->name, "small") == 0);
    trace_free(t);
  }

  /* CRLF, tabs, trailing comments, no final newline, hex stream. */
  const char odd[] = "a 5\t10 0x10 # a comment\r\nf\t5\r\na 6 0 16";
  t = NULL;
  CHECK_STATUS(trace_parse("odd.trace", odd, strlen(odd), &t), GPUMEM_OK);
  if (t) {
    CHECK(t->num_events == 3);
    CHECK(t->events[0].stream == 16 && t->events[0].size == 10);
    CHECK(t->events[2].size == 0 && t->events[2].line == 3);
    CHECK(t->num_streams == 1);
    CHECK(t->peak_live_bytes == 10);
    trace_free(t);
  }

  /* Peak live is the largest sum, not the last or the largest single. */
  const char peaks[] = "a 1 100 0\na 2 100 0\nf 1\na 3 150 0\nf 2\nf 3\na 4 220 0\nf 4\na 5 10 0\n";
  t = NULL;
  CHECK_STATUS(trace_parse("peaks", peaks, strlen(peaks), &t), GPUMEM_OK);
  if (t) {
    CHECK(t->peak_live_bytes == 250);
    CHECK(t->peak_event == 3);
    CHECK(t->end_live_bytes == 10);
    trace_free(t);
  }

  /* IDs up to 64 bits; sizes up to the readers' limit (2^48, beyond it:
   * test_readers). */
  const char big[] = "a 18446744073709551615 281474976710656 0\n";
  t = NULL;
  CHECK_STATUS(trace_parse("big", big, strlen(big), &t), GPUMEM_OK);
  if (t) {
    CHECK(t->slot_trace_id[0] == UINT64_MAX);
    CHECK(t->events[0].size == TRACE_MAX_SIZE);
    trace_free(t);
  }
}

typedef struct bad_case {
  const char* text;
  int line;
  const char* want; /* in the message */
} bad_case_t;

static const bad_case_t bad_cases[] = {
    {"a 0 100 0\nx 1\n", 2, "unknown operation 'x'"},
    {"a 0 100 0\nalloc 1 2 0\n", 2, "unknown operation 'alloc'"},
    {"a 0 100\n", 1, "missing field"},
    {"a 0\n", 1, "missing field"},
    {"a 0 100 0 role 5\n", 1, "extra field '5'"},
    {"a 0 100 0 r\x01le\n", 1, "ROLE 'r?le' has a character that is not printable ASCII"},
    {"f\n", 1, "missing field"},
    {"a 0 100 0\nf 0 1\n", 2, "extra field '1'"},
    {"a 0 100 0\nr 0\n", 2, "missing field"},
    {"a 0 100 0\nr 0 1 2\n", 2, "extra field '2'"},
    {"a zz 100 0\n", 1, "ID 'zz' is not a non-negative integer"},
    {"a 0 1x 0\n", 1, "SIZE '1x' is not a non-negative integer"},
    {"a 0 -5 0\n", 1, "SIZE '-5' is not"},
    {"a 0 1.5 0\n", 1, "SIZE '1.5' is not"},
    {"a 0 99999999999999999999999 0\n", 1, "SIZE '99999999999999999999999' is too large"},
    {"a 0 18446744073709551615 0\n", 1, "larger than the readers' limit of 2^48"},
    {"a 0 5 s\n", 1, "STREAM 's' is not"},
    {"a 0 5 0\nr 0 0xg\n", 2, "STREAM '0xg' is not"},
    {"f -1\n", 1, "ID '-1' is not"},
    {"\n\na 0 1 0\nf 1\n", 4, "free of id 1 which is not allocated"},
    {"a 0 1 0\nf 0\nf 0\n", 3, "free of id 0 which is not allocated"},
    {"# c\nr 3 0\n", 2, "record_stream of id 3 which is not allocated"},
    {"a 4 1 0\na 4 2 0\n", 2, "alloc of id 4 which is already allocated (at line 1)"},
    {"a 4 1 0\nf 4\na 4 2 0\na 4 2 0\n", 4, "alloc of id 4 which is already allocated (at line 3)"},
};

static void test_errors(void) {
  char path[256], want[512];
  for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
    const bad_case_t* c = &bad_cases[i];
    char name[32];
    snprintf(name, sizeof name, "bad%zu.trace", i);
    tmp_path(name, path, sizeof path);
    /* Plain and gzip alike. */
    for (int gz = 0; gz < 2; gz++) {
      char p[300];
      snprintf(p, sizeof p, "%s%s", path, gz ? ".gz" : "");
      if (gz) {
        write_gzip(p, c->text);
      } else {
        write_plain(p, c->text);
      }
      trace_t* t = (trace_t*)1;
      gpumem_status_t st = trace_load(p, &t);
      CHECK_MSG(st == GPUMEM_ERR_IO, "case %zu: status %d", i, (int)st);
      CHECK(t == NULL);
      snprintf(want, sizeof want, "%s: line %d: ", p, c->line);
      const char* msg = gpumem_last_error();
      CHECK_MSG(strstr(msg, want) == msg, "case %zu: message '%s' lacks '%s'", i, msg, want);
      CHECK_MSG(strstr(msg, c->want) != NULL, "case %zu: message '%s' lacks '%s'", i, msg, c->want);
    }
  }

  /* No events at all. */
  trace_t* t = NULL;
  CHECK_STATUS(trace_parse("empty.trace", "# nothing\n\n", 11, &t), GPUMEM_ERR_IO);
  CHECK(strstr(gpumem_last_error(), "empty.trace: no events") != NULL);
  CHECK(t == NULL);

  /* Binary junk is named without dumping control characters. */
  const char junk[] = "\x01\x02garbage\x7f here\n";
  CHECK_STATUS(trace_parse("junk", junk, sizeof junk - 1, &t), GPUMEM_ERR_IO);
  CHECK(strstr(gpumem_last_error(), "junk: line 1: unknown operation '??garbage?'") != NULL);

  /* A file that is not there, and a directory. */
  CHECK_STATUS(trace_load(tmp_path("missing.trace.gz", path, sizeof path), &t), GPUMEM_ERR_IO);
  CHECK(strstr(gpumem_last_error(), path) != NULL);
  CHECK(strstr(gpumem_last_error(), "cannot open") != NULL);
  CHECK_STATUS(trace_load(tmpdir, &t), GPUMEM_ERR_IO);
  CHECK(strstr(gpumem_last_error(), tmpdir) != NULL);

  /* A gzip file cut short: reading fails rather than replaying half. */
  {
    char gz[256];
    tmp_path("cut.trace.gz", gz, sizeof gz);
    char* text = malloc(200000);
    size_t len = 0;
    for (int i = 0; len < 190000; i++) {
      len +=
          (size_t)snprintf(text + len, 200000 - len, "a %d %d 0\nf %d\n", i, i * 7919 % 100003, i);
    }
    write_gzip(gz, text);
    free(text);
    FILE* f = fopen(gz, "rb");
    CHECK(f != NULL);
    if (f) {
      fseek(f, 0, SEEK_END);
      long size = ftell(f);
      fclose(f);
      CHECK(truncate(gz, size / 2) == 0);
      CHECK_STATUS(trace_load(gz, &t), GPUMEM_ERR_IO);
      CHECK(strstr(gpumem_last_error(), gz) != NULL);
      CHECK(t == NULL);
    }
  }
}

/* The figures traces/README.md publishes. */
static void test_bundled(void) {
  static const struct {
    const char* name;
    size_t allocs;
    const char* peak_gib;
    size_t streams;
  } want[] = {
      {"gpt2_train", 11911, "12.661", 1},
      {"resnet50_train", 9177, "5.641", 1},
      {"llama_ckpt_train", 13245, "10.172", 1},
      {"t5_varlen_prefetch", 124563, "14.062", 2},
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    char path[512], gib[32];
    snprintf(path, sizeof path, "%s/traces/%s.trace.gz", GPUMEM_SOURCE_DIR, want[i].name);
    trace_t* t = NULL;
    CHECK_STATUS(trace_load(path, &t), GPUMEM_OK);
    if (!t) continue;
    snprintf(gib, sizeof gib, "%.3f", (double)t->peak_live_bytes / 1073741824.0);
    CHECK_MSG(t->num_allocs == want[i].allocs, "%s: %zu allocations", want[i].name, t->num_allocs);
    CHECK_MSG(strcmp(gib, want[i].peak_gib) == 0, "%s: peak live %s GiB", want[i].name, gib);
    CHECK(t->num_streams == want[i].streams);
    CHECK(strcmp(t->name, want[i].name) == 0);
    CHECK(t->num_events == t->num_allocs + t->num_frees + t->num_record_streams);
    CHECK(t->end_live_allocs == t->num_allocs - t->num_frees);
    trace_free(t);
  }
}

/* trace_repeat_tail: a training loop's last step appended again and again,
 * IDs renumbered, gradients freed one step later still matched; traces
 * that end in no such step refused with a message. */
static void test_repeat_tail(void) {
  static const char loop[] =
      "a 1 1000 0\n"    /* weights, never freed */
      "a 2 50 0\nf 2\n" /* step 0: different */
      "a 3 100 0\na 4 200 0\nf 3\n"
      "a 5 100 0\na 6 200 0\nf 4\nf 5\n" /* the previous step's gradient goes */
      "a 7 100 0\na 8 200 0\nf 6\nf 7\n";
  trace_t* t = NULL;
  CHECK_STATUS(trace_parse("loop", loop, strlen(loop), &t), GPUMEM_OK);
  if (!t) return;
  trace_t* x = NULL;
  size_t period = 0;
  CHECK_STATUS(trace_repeat_tail(t, 3, &x, &period), GPUMEM_OK);
  if (x) {
    CHECK_MSG(period == 2 && x->steady_period == 2 && x->steady_reps == 3, "period %zu", period);
    CHECK(x->steady_from_event == t->num_events);
    CHECK_MSG(x->num_allocs == t->num_allocs + 6 && x->num_frees == t->num_frees + 6,
              "%zu allocations, %zu frees", x->num_allocs, x->num_frees);
    CHECK(x->end_live_allocs == 2 && x->end_live_bytes == 1200);
    CHECK(x->peak_live_bytes == t->peak_live_bytes);
    /* the appended events mirror the tail, sizes and all */
    for (size_t i = x->steady_from_event; i < x->num_events; i++) {
      size_t j = t->slot_event[t->num_allocs - 2] + (i - x->steady_from_event) % 4;
      CHECK(x->events[i].op == t->events[j].op && x->events[i].size == t->events[j].size);
    }
#ifndef TEST_TRACE_WITHOUT_ENGINE
    replay_config_t c;
    replay_config_init(&c);
    c.warm_passes = 0;
    replay_result_t r;
    CHECK_STATUS(replay_trace(x, &c, &r), GPUMEM_OK);
    CHECK_MSG(r.steady_ops == 12, "steady ops %llu", (unsigned long long)r.steady_ops);
#endif
    trace_free(x);
  }
  trace_free(t);

  /* the only period whose sizes repeat (1) frees what an allocation two
   * periods back made: no repetition fits */
  static const char drift[] = "a 1 100 0\na 2 200 0\na 3 100 0\na 4 100 0\nf 1\n";
  CHECK_STATUS(trace_parse("drift", drift, strlen(drift), &t), GPUMEM_OK);
  if (!t) return;
  x = (trace_t*)1;
  CHECK_STATUS(trace_repeat_tail(t, 1, &x, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(x == NULL);
  CHECK(strstr(gpumem_last_error(), "does not end in a repeating period") != NULL);
  trace_free(t);

  /* the bundled training traces repeat one step; t5's steps all differ */
  static const struct {
    const char* name;
    size_t period;
  } want[] = {
      {"gpt2_train", 1433},
      {"llama_ckpt_train", 1627},
      {"resnet50_train", 1080},
      {"t5_varlen_prefetch", 0},
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    char path[512];
    snprintf(path, sizeof path, "%s/traces/%s.trace.gz", GPUMEM_SOURCE_DIR, want[i].name);
    CHECK_STATUS(trace_load(path, &t), GPUMEM_OK);
    if (!t) continue;
    x = NULL;
    period = 0;
    gpumem_status_t st = trace_repeat_tail(t, 2, &x, &period);
    CHECK_MSG(st == (want[i].period ? GPUMEM_OK : GPUMEM_ERR_INVALID_ARGUMENT) &&
                  period == want[i].period,
              "%s: %s, period %zu", want[i].name, gpumem_strerror(st), period);
    if (x) {
      CHECK(x->peak_live_bytes == t->peak_live_bytes);
      trace_free(x);
    }
    trace_free(t);
  }
}

#ifndef TEST_TRACE_WITHOUT_ENGINE
/* A few replays of a tiny trace on the simulated device: the replay's
 * bookkeeping (ops counted, leftovers freed between passes, OOM reported
 * with its event, the min-limit bracket), not the engine's policy. */
static void test_replay(void) {
  char text[8192];
  size_t len = 0;
  /* Three "steps" of activations over a few live "weights"; one side-
   * stream use. */
  len += (size_t)snprintf(text + len, sizeof text - len, "a 1000 4000000 0\na 1001 6000000 0\n");
  for (int step = 0; step < 3; step++) {
    for (int i = 0; i < 8; i++) {
      len += (size_t)snprintf(text + len, sizeof text - len, "a %d %d 0\n", i, (i + 1) * 1000000);
    }
    len += (size_t)snprintf(text + len, sizeof text - len, "r 3 5\n");
    for (int i = 7; i >= 0; i--)
      len += (size_t)snprintf(text + len, sizeof text - len, "f %d\n", i);
  }
  trace_t* t = NULL;
  CHECK_STATUS(trace_parse("tiny.trace", text, len, &t), GPUMEM_OK);
  if (!t) return;
  CHECK(t->peak_live_bytes == 10000000 + 36000000);

  replay_config_t c;
  replay_config_init(&c);
  c.warm_passes = 2;
  replay_result_t* r = malloc(sizeof *r);
  for (int p = 0; p < 2; p++) {
    c.policy = p ? GPUMEM_POLICY_PYTORCH : GPUMEM_POLICY_DEFAULT;
    c.policy_set = 1;
    CHECK_STATUS(replay_trace(t, &c, r), GPUMEM_OK);
    CHECK(!r->oom);
    CHECK(r->policy == c.policy);
    CHECK(r->passes_run == 3 && r->warm_passes == 2);
    CHECK(r->ops_cold == trace_num_ops(t));
    CHECK(r->ops_warm == 2 * trace_num_ops(t));
    CHECK(r->peak_reserved_bytes >= t->peak_live_bytes);
    CHECK(r->reserved_ratio >= 1.0);
    CHECK(r->ns_per_op_cold > 0 && r->ns_per_op_warm > 0);
    CHECK(r->limit_bytes == 0);
    /* Everything was freed after the last pass. */
    CHECK(r->stats_final.allocated_bytes[GPUMEM_POOL_ALL].current == 0);

    CHECK_STATUS(replay_min_limit(t, &c, r), GPUMEM_OK);
    CHECK(r->min_limit_done && r->min_limit_found);
    CHECK_MSG(
        r->min_limit_bytes >= t->peak_live_bytes && r->min_limit_bytes <= r->peak_reserved_bytes,
        "min limit %zu, peak live %llu, reserved %llu", r->min_limit_bytes,
        (unsigned long long)t->peak_live_bytes, (unsigned long long)r->peak_reserved_bytes);
    CHECK(r->min_limit_probes >= 2);
  }

  /* Under half of peak live it must fail, at an allocation, in the cold
   * pass, and stop there. */
  c.policy_set = 0;
  c.limit_ratio = 0.5;
  CHECK_STATUS(replay_trace(t, &c, r), GPUMEM_OK);
  CHECK(r->oom == 1 && r->oom_pass == 0);
  CHECK(r->limit_bytes == t->peak_live_bytes / 2);
  CHECK(r->oom_event < t->num_events && t->events[r->oom_event].op == TRACE_ALLOC);
  CHECK(r->oom_size == t->events[r->oom_event].size);
  CHECK(r->oom_status == GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(r->oom_message[0] != '\0');
  CHECK(r->passes_run == 1 && r->warm_passes == 0 && r->ns_per_op_warm < 0);

  /* The bare pass on an allocator of our own, leftovers kept. */
  gpumem_options_t o;
  gpumem_t* gm = NULL;
  c.limit_ratio = 0;
  CHECK_STATUS(replay_options(&c, t, &o), GPUMEM_OK);
  CHECK_STATUS(replay_open(&c, &o, &gm), GPUMEM_OK);
  if (gm) {
    replay_result_init(r, t);
    CHECK_STATUS(replay_pass_keep(gm, t, r), GPUMEM_OK);
    gpumem_stats_t s;
    gpumem_get_stats(gm, &s);
    CHECK(s.requested_bytes[GPUMEM_POOL_ALL].current == (int64_t)t->end_live_bytes);
    CHECK(s.allocation[GPUMEM_POOL_ALL].current == (int64_t)t->end_live_allocs);
    CHECK(gpumem_check(gm) == 0);
    gpumem_destroy(gm);
  }

  /* A configuration string the parser refuses names its key. */
  c.conf = "nonsense_key:1";
  CHECK_STATUS(replay_check_config(&c), GPUMEM_ERR_CONFIG);
  CHECK(strstr(gpumem_last_error(), "nonsense_key") != NULL);

  free(r);
  trace_free(t);
}
#endif

int main(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/gpumem_test_trace_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  char path[256];
  write_plain(tmp_path("small.trace", path, sizeof path), small_trace);
  write_gzip(tmp_path("small.trace.gz", path, sizeof path), small_trace);

  test_parse();
  test_errors();
  test_bundled();
  test_repeat_tail();
#ifndef TEST_TRACE_WITHOUT_ENGINE
  test_replay();
#endif

  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
  return test_finish("test_trace");
}
