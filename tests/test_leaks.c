/* Leak detection (src/leaks.c) and the out-of-memory post-mortem on the
 * simulated device: a random workload on two streams against a shadow
 * record of what is live and when it was made (every mark, every policy,
 * gpumem_check after every operation, since the serial and tag share
 * storage with the free index's links); the report of a loop that keeps one
 * tensor a step; frees that wait for another stream; the leak_check option
 * at destroy; oom_snapshot's file and its failure; bad arguments. */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"

#define MIB ((size_t)1 << 20)
#define GIB8 ((size_t)8 << 30)

static const char* const confs[] = {
    "policy:default",
    "policy:pytorch",
    "policy:default,reclaim:pressure,placement:bestfit",
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

typedef struct shadow {
  void* ptr;
  size_t requested;
  gpumem_stream_t stream;
  uint64_t serial, tag;
} shadow_t;

/* The shadow's answer for mark since, compared with gpumem_find_leaks. */
static void compare(gpumem_t* gm, const shadow_t* live, size_t n, uint64_t since, uint64_t made,
                    const char* conf) {
  gpumem_leaks_t got;
  CHECK_STATUS(gpumem_find_leaks(gm, since, &got), GPUMEM_OK);
  uint64_t count = 0, requested = 0, oldest = 0, newest = 0, groups = 0;
  for (size_t i = 0; i < n; i++) {
    if (live[i].serial <= since) continue;
    count++;
    requested += live[i].requested;
    if (!oldest || live[i].serial < oldest) oldest = live[i].serial;
    if (live[i].serial > newest) newest = live[i].serial;
    bool seen = false; /* a group is counted at its first member */
    for (size_t j = 0; j < i && !seen; j++) {
      seen = live[j].serial > since && live[j].requested == live[i].requested &&
             live[j].stream == live[i].stream;
    }
    groups += !seen;
  }
  /* Allocated bytes (rounded, unsplit tails): all of them since 0. */
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  uint64_t allocated = (uint64_t)st.allocated_bytes[GPUMEM_POOL_ALL].current;
  CHECK_MSG(since ? got.bytes >= requested && got.bytes <= allocated : got.bytes == allocated,
            "%s since %" PRIu64 ": %" PRIu64 " bytes for %" PRIu64 " requested, %" PRIu64
            " allocated",
            conf, since, got.bytes, requested, allocated);
  CHECK_MSG(got.since == since && got.made == made && got.count == count &&
                got.requested_bytes == requested && got.oldest == oldest && got.newest == newest &&
                got.groups == groups,
            "%s since %" PRIu64 ": got %" PRIu64 " / %" PRIu64 " B / %" PRIu64 " groups, #%" PRIu64
            "..#%" PRIu64 " of %" PRIu64 "; want %" PRIu64 " / %" PRIu64 " B / %" PRIu64
            " groups, #%" PRIu64 "..#%" PRIu64 " of %" PRIu64,
            conf, since, got.count, got.requested_bytes, got.groups, got.oldest, got.newest,
            got.made, count, requested, groups, oldest, newest, made);
}

/* Random sizes on two streams, tags changing, a mark taken now and then:
 * every report agrees with the shadow, and the allocator stays consistent
 * though serials and tags live where free blocks keep their tree links. */
static void test_random(const char* conf) {
  fx_t f = fx_new(conf, GIB8, 0);
  if (!f.gm) return fx_done(&f);
  enum { MAX_LIVE = 256, STEPS = 3000 };
  shadow_t live[MAX_LIVE];
  size_t n = 0;
  uint64_t made = 0, marks[4] = {0, 0, 0, 0};
  gpumem_stream_t streams[2] = {0, (gpumem_stream_t)0x5};
  for (int step = 0; step < STEPS; step++) {
    uint64_t r = rng();
    if (n < MAX_LIVE && (n == 0 || r % 100 < 55)) {
      size_t sizes[] = {512, 4096, 100000, MIB, 3 * MIB + 512, 24 * MIB};
      size_t size = sizes[(r >> 8) % 6] + (size_t)((r >> 16) % 4) * 512;
      gpumem_stream_t s = streams[(r >> 24) & 1];
      uint64_t tag = 1 + (uint64_t)step / 100;
      gpumem_set_history_tag(f.gm, tag);
      void* p = NULL;
      CHECK_STATUS(gpumem_malloc(f.gm, size, s, &p), GPUMEM_OK);
      live[n++] = (shadow_t){p, size, s, ++made, tag};
    } else {
      size_t k = (size_t)((r >> 8) % n);
      CHECK_STATUS(gpumem_free(f.gm, live[k].ptr), GPUMEM_OK);
      live[k] = live[--n];
    }
    if (r % 97 == 0) {
      marks[(r >> 32) % 4] = gpumem_leak_mark(f.gm);
      CHECK(marks[(r >> 32) % 4] == made);
    }
    if (gpumem_check(f.gm) != 0) {
      CHECK_MSG(false, "%s step %d: %s", conf, step, gpumem_last_error());
      break;
    }
    if (step % 50 == 0) {
      for (int m = 0; m < 4; m++) compare(f.gm, live, n, marks[m], made, conf);
    }
  }
  /* The statistics' reset does not move the marks. */
  gpumem_reset_accumulated_stats(f.gm);
  CHECK(gpumem_leak_mark(f.gm) == made);
  compare(f.gm, live, n, 0, made, conf);
  for (size_t i = 0; i < n; i++) CHECK_STATUS(gpumem_free(f.gm, live[i].ptr), GPUMEM_OK);
  gpumem_leaks_t none;
  CHECK_STATUS(gpumem_find_leaks(f.gm, 0, &none), GPUMEM_OK);
  CHECK(none.count == 0 && none.groups == 0 && none.oldest == 0 && none.made == made);
  fx_done(&f);
}

static size_t count(const char* s, const char* what) {
  size_t n = 0;
  for (const char* p = strstr(s, what); p; p = strstr(p + 1, what)) n++;
  return n;
}

/* A loop whose steps each keep one 4 MiB tensor (tag = step) among
 * temporaries: one group, five allocations, tags 1..5, and nothing after a
 * mark taken at the end. */
static void test_loop_report(const char* conf) {
  fx_t f = fx_new(conf, GIB8, 0);
  if (!f.gm) return fx_done(&f);
  void* weights = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, 64 * MIB, 0, &weights), GPUMEM_OK);
  uint64_t mark = gpumem_leak_mark(f.gm);
  CHECK(mark == 1);
  void* kept[5];
  for (int step = 1; step <= 5; step++) {
    gpumem_set_history_tag(f.gm, (uint64_t)step);
    void* tmp[3];
    for (int k = 0; k < 3; k++)
      CHECK_STATUS(gpumem_malloc(f.gm, (size_t)(k + 1) * 10 * MIB, 0, &tmp[k]), GPUMEM_OK);
    CHECK_STATUS(gpumem_malloc(f.gm, 4 * MIB, 0, &kept[step - 1]), GPUMEM_OK);
    for (int k = 0; k < 3; k++) CHECK_STATUS(gpumem_free(f.gm, tmp[k]), GPUMEM_OK);
  }
  sink_t t = {0};
  CHECK(gpumem_print_leaks(f.gm, mark, sink_write, &t) == 0);
  CHECK_MSG(t.text && strstr(t.text, "5 allocations made after #1 still live") &&
                strstr(t.text, "#5..#21") && strstr(t.text, "tags 1..5") &&
                count(t.text, "\n") == 3,
            "%s: %s", conf, t.text ? t.text : "(nothing)");
  sink_free(&t);
  CHECK(gpumem_print_leaks_json(f.gm, mark, sink_write, &t) == 0);
  char want[160];
  snprintf(want, sizeof want,
           "\"requested\":%zu,\"stream\":0,\"count\":5,\"bytes\":%zu,\"requested_bytes\":%zu,"
           "\"first\":5,\"last\":21,\"first_tag\":1,\"last_tag\":5,\"addresses\":[%" PRIuPTR,
           4 * MIB, 20 * MIB, 20 * MIB, (uintptr_t)kept[0]);
  CHECK_MSG(t.text && strstr(t.text, want) && strstr(t.text, "\"count\":5,\"bytes\":") &&
                count(t.text, "\"requested\":") == 1,
            "%s: %s", conf, t.text ? t.text : "(nothing)");
  sink_free(&t);
  /* Everything, the weights too: two groups, the larger first. */
  CHECK(gpumem_print_leaks_json(f.gm, 0, sink_write, &t) == 0);
  const char* big = t.text ? strstr(t.text, "\"requested\":67108864") : NULL;
  const char* small = t.text ? strstr(t.text, "\"requested\":4194304") : NULL;
  CHECK_MSG(big && small && big < small, "%s: %s", conf, t.text ? t.text : "(nothing)");
  sink_free(&t);
  uint64_t end = gpumem_leak_mark(f.gm);
  CHECK(gpumem_print_leaks(f.gm, end, sink_write, &t) == 0);
  CHECK_MSG(t.text && strstr(t.text, "no allocation made after #21 is live"), "%s: %s", conf,
            t.text ? t.text : "(nothing)");
  sink_free(&t);
  /* An out-of-memory report names the same groups, most bytes first. */
  CHECK_STATUS(gpumem_set_limit(f.gm, 128 * MIB), GPUMEM_OK);
  void* huge = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, 512 * MIB, 0, &huge), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_MSG(strstr(gpumem_last_error(),
                   " Live: 6 allocations in 2 groups of one size and stream; the largest: 1 x "
                   "64.00 MiB (#1), 5 x 4.00 MiB (#5..#21, tags 1..5)."),
            "%s: %s", conf, gpumem_last_error());
  gpumem_remove_limit(f.gm);
  for (int k = 0; k < 5; k++) CHECK_STATUS(gpumem_free(f.gm, kept[k]), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f.gm, weights), GPUMEM_OK);
  fx_done(&f);
}

/* A free that waits for another stream is not a leak: the caller gave the
 * memory back. */
static void test_pending_not_leaked(void) {
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.event_delay_queries = 1000;
  gpumem_backend_t* sim = gpumem_sim_create(&so);
  gpumem_t* gm = sim ? gpumem_create(sim, NULL, NULL) : NULL;
  CHECK(gm != NULL);
  if (!gm) return gpumem_sim_destroy(sim);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, 8 * MIB, 0, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_record_stream(gm, p, (gpumem_stream_t)0x7), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  CHECK_MSG(st.active_bytes[GPUMEM_POOL_ALL].current > 0, "the free does not wait");
  gpumem_leaks_t l;
  CHECK_STATUS(gpumem_find_leaks(gm, 0, &l), GPUMEM_OK);
  CHECK(l.count == 0 && l.made == 1);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
  gpumem_sim_destroy(sim);
}

/* What a child writes on stderr while it runs fn. */
static void stderr_of(void (*fn)(void), char* out, size_t cap) {
  out[0] = '\0';
  char path[] = "/tmp/gpumem_test_leaks_XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  if (fd < 0) return;
  fflush(stderr);
  pid_t child = fork();
  if (child == 0) {
    dup2(fd, 2);
    fn();
    _exit(0);
  }
  int status = 0;
  CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) &&
        WEXITSTATUS(status) == 0);
  ssize_t got = pread(fd, out, cap - 1, 0);
  out[got > 0 ? got : 0] = '\0';
  close(fd);
  unlink(path);
}

static void destroy_with(int leaked, const char* conf, bool check_now) {
  gpumem_backend_t* sim = gpumem_sim_create(NULL);
  gpumem_options_t o;
  gpumem_options_init(&o);
  if (gpumem_options_parse(&o, conf) != GPUMEM_OK) _exit(3);
  o.own_backend = 1;
  gpumem_t* gm = gpumem_create(sim, &o, NULL);
  if (!gm) _exit(4);
  void* p = NULL;
  for (int k = 0; k < 3; k++) {
    if (gpumem_malloc(gm, MIB, 0, &p) != GPUMEM_OK) _exit(5);
    if (k >= leaked && gpumem_free(gm, p) != GPUMEM_OK) _exit(6);
  }
  if (check_now) gpumem_leak_check_now(gm, "before teardown");
  gpumem_destroy(gm);
}
static void destroy_leaking_two(void) {
  destroy_with(2, "leak_check:on", false);
}
static void destroy_clean(void) {
  destroy_with(0, "leak_check:on", false);
}
static void check_now_then_destroy(void) {
  destroy_with(1, "leak_check:on", true);
}
static void check_now_option_off(void) {
  destroy_with(1, "leak_check:off", true);
}

static void test_leak_check_option(void) {
  char err[4096];
  stderr_of(destroy_leaking_two, err, sizeof err);
  CHECK_MSG(strstr(err, "gpumem leak check (at destroy): 2 allocations made after #0 still live") &&
                strstr(err, "#1..#2"),
            "stderr: %s", err);
  stderr_of(destroy_clean, err, sizeof err);
  CHECK_MSG(err[0] == '\0', "a clean destroy said: %s", err);
  /* gpumem_leak_check_now reports once; destroy then stays quiet. */
  stderr_of(check_now_then_destroy, err, sizeof err);
  CHECK_MSG(strstr(err, "gpumem leak check (before teardown): 1 allocation made after #0") &&
                !strstr(err, "at destroy"),
            "stderr: %s", err);
  stderr_of(check_now_option_off, err, sizeof err);
  CHECK_MSG(err[0] == '\0', "with the option off: %s", err);
}

/* oom_snapshot: the failure writes the snapshot and names it; the
 * allocator stays usable; an unwritable path is reported, not fatal. */
static void test_oom_snapshot(const char* conf) {
  char dir[] = "/tmp/gpumem_oom_XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  char full[600];
  snprintf(full, sizeof full, "%s,limit:64M,oom_snapshot:%s/post-%%p.json", conf, dir);
  fx_t f = fx_new(full, GIB8, 0);
  if (!f.gm) return fx_done(&f);
  void* a = NULL;
  void* b = NULL;
  gpumem_set_history_tag(f.gm, 42);
  CHECK_STATUS(gpumem_malloc(f.gm, 40 * MIB, 0, &a), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(f.gm, 40 * MIB, 0, &b), GPUMEM_ERR_OUT_OF_MEMORY);
  char path[700];
  snprintf(path, sizeof path, "%s/post-%ld.json", dir, (long)getpid());
  CHECK_MSG(strstr(gpumem_last_error(), "Post-mortem: snapshot written to ") &&
                strstr(gpumem_last_error(), path),
            "%s: %s", conf, gpumem_last_error());
  /* The report names what is live, the largest groups first. */
  CHECK_MSG(strstr(gpumem_last_error(),
                   ". Live: 1 allocation in 1 group of one size and stream; the largest: 1 x "
                   "40.00 MiB (#1, tag 42). Post-mortem: "),
            "%s: %s", conf, gpumem_last_error());
  FILE* file = fopen(path, "r");
  CHECK_MSG(file != NULL, "%s: no %s", conf, path);
  if (file) {
    char text[8192];
    size_t len = fread(text, 1, sizeof text - 1, file);
    text[len] = '\0';
    fclose(file);
    char addr[64];
    snprintf(addr, sizeof addr, "{\"address\":%" PRIuPTR ",\"size\":", (uintptr_t)a);
    CHECK_MSG(strncmp(text, "{\"segments\":[", 13) == 0 && strstr(text, addr) &&
                  strstr(text, "\"line\":42,") && strstr(text, "\"device_traces\":[["),
              "%s: %.400s", conf, text);
    unlink(path);
  }
  CHECK(gpumem_check(f.gm) == 0);
  CHECK_STATUS(gpumem_free(f.gm, a), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(f.gm, 40 * MIB, 0, &b), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f.gm, b), GPUMEM_OK);
  fx_done(&f);
  rmdir(dir);

  /* A directory that is not there. */
  snprintf(full, sizeof full, "%s,limit:64M,oom_snapshot:%s/missing/post.json", conf, dir);
  f = fx_new(full, GIB8, 0);
  if (!f.gm) return fx_done(&f);
  CHECK_STATUS(gpumem_malloc(f.gm, 80 * MIB, 0, &b), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_MSG(strstr(gpumem_last_error(), "Advice: the limit, not the device, refused"), "%s: %s",
            conf, gpumem_last_error());
  CHECK_MSG(
      strstr(gpumem_last_error(), "Post-mortem: could not write the snapshot: cannot write ") &&
          strstr(gpumem_last_error(), "No such file") && !strstr(gpumem_last_error(), " Live: "),
      "%s: %s", conf, gpumem_last_error());
  CHECK_STATUS(gpumem_malloc(f.gm, 40 * MIB, 0, &a), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(f.gm, a), GPUMEM_OK);
  fx_done(&f);
}

/* A request larger than the device says so, whatever else is true. */
static void test_larger_than_device(void) {
  fx_t f = fx_new("policy:default", GIB8, 0);
  if (!f.gm) return fx_done(&f);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, GIB8 + 1, 0, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_MSG(strstr(gpumem_last_error(), "Advice: the request alone is larger than the device's"),
            "%s", gpumem_last_error());
  fx_done(&f);
}

static void test_bad_arguments(void) {
  gpumem_leaks_t l;
  clear_error();
  CHECK_STATUS(gpumem_find_leaks(NULL, 0, &l), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "gpumem_find_leaks: NULL argument") != NULL);
  CHECK(gpumem_leak_mark(NULL) == 0);
  fx_t f = fx_new("policy:default", GIB8, 0);
  if (!f.gm) return fx_done(&f);
  CHECK_STATUS(gpumem_find_leaks(f.gm, 0, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(gpumem_print_leaks(f.gm, 0, NULL, NULL) == GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(gpumem_print_leaks_json(NULL, 0, sink_write, NULL) == GPUMEM_ERR_INVALID_ARGUMENT);
  /* A sink that stops: its value comes back, the allocator is unchanged. */
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, MIB, 0, &p), GPUMEM_OK);
  sink_t t = {0};
  t.fail_at = 1;
  t.fail_with = 9;
  CHECK(gpumem_print_leaks_json(f.gm, 0, sink_write, &t) == 9);
  sink_free(&t);
  CHECK(gpumem_binding_leaks(NULL, 0, 1, NULL, 0) == 0);
  size_t need = gpumem_binding_leaks(f.gm, 0, 1, NULL, 0);
  char buf[16];
  CHECK(need > sizeof buf && gpumem_binding_leaks(f.gm, 0, 1, buf, sizeof buf) == need &&
        strlen(buf) == sizeof buf - 1);
  CHECK_STATUS(gpumem_free(f.gm, p), GPUMEM_OK);
  fx_done(&f);
  /* Options. */
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, "leak_check:maybe"), GPUMEM_ERR_CONFIG);
  CHECK(strstr(gpumem_last_error(), "\"leak_check\": expected one of: on, off") != NULL);
  char longpath[400] = "oom_snapshot:/";
  memset(longpath + 14, 'x', 300);
  longpath[314] = '\0';
  CHECK_STATUS(gpumem_options_parse(&o, longpath), GPUMEM_ERR_CONFIG);
  CHECK(strstr(gpumem_last_error(), "a path shorter than 256 bytes") != NULL);
  CHECK(o.oom_snapshot[0] == '\0' && o.leak_check == 0);
}

int main(void) {
  for (size_t c = 0; c < sizeof confs / sizeof confs[0]; c++) {
    test_random(confs[c]);
    test_loop_report(confs[c]);
    test_oom_snapshot(confs[c]);
  }
  test_pending_not_leaked();
  test_larger_than_device();
  test_leak_check_option();
  test_bad_arguments();
  return test_finish("test_leaks");
}
