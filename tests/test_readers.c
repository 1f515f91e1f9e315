/* The readers' budgets (docs/security.md, "Limits of the readers"): hostile
 * traces, gzip files, snapshot pickles and configuration strings, made here,
 * must be refused by name or read in memory and time proportional to their
 * size. Each case runs in a forked child that reports its peak resident
 * memory (getrusage's ru_maxrss, less what it had before) and its time, so
 * a reader that allocates on a file's say-so fails a bound here instead of
 * taking the machine down; the time bounds are absolute and generous (a
 * loaded two-core machine under the sanitizers), far below what the
 * quadratic or multiplying readers took on the same inputs. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "gpumem.h"
#include "reader.h"
#include "gpumem_backend.h"
#include "peer_models.h"
#include "pickle.h"
#include "replay.h"
#include "snapshot.h"
#include "test_util.h"
#include "trace.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define UNDER_SANITIZER 1
#endif
#endif
#ifndef UNDER_SANITIZER
#define UNDER_SANITIZER 0
#endif

#define MIB (1024L * 1024L)
/* The sanitizers' redzones and quarantine hold freed and padded memory:
 * their runs get this factor on the memory bounds. */
#define MEM_SLACK (UNDER_SANITIZER ? 4 : 1)

/* ---- a child's memory and time ------------------------------------------ */

typedef struct outcome {
  int ok;         /* the case's own verdict: refused or read as it should be */
  long rss_kb;    /* peak resident memory the case added */
  double seconds; /* its time */
  char message[400];
} outcome_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long max_rss_kb(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

/* Runs fn(arg) in a child; fn returns 1 when the reader behaved. A child
 * that crashes, or is killed, is a failed case. */
static outcome_t in_child(int (*fn)(const void*), const void* arg) {
  outcome_t out = {0};
  int fds[2];
  if (pipe(fds) != 0) {
    snprintf(out.message, sizeof out.message, "pipe failed");
    return out;
  }
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    outcome_t r = {0};
    long before = max_rss_kb();
    double t0 = now_s();
    clear_error();
    r.ok = fn(arg);
    r.seconds = now_s() - t0;
    r.rss_kb = max_rss_kb() - before;
    snprintf(r.message, sizeof r.message, "%s", gpumem_last_error());
    ssize_t w = write(fds[1], &r, sizeof r);
    _exit(w == (ssize_t)sizeof r ? 0 : 1);
  }
  close(fds[1]);
  ssize_t got = pid > 0 ? read(fds[0], &out, sizeof out) : -1;
  close(fds[0]);
  int status = 0;
  if (pid > 0) waitpid(pid, &status, 0);
  if (got != (ssize_t)sizeof out) {
    memset(&out, 0, sizeof out);
    snprintf(out.message, sizeof out.message, "the child died (status 0x%x)", status);
  }
  return out;
}

/* Checks a case: its verdict, its memory at most max_kb, its time. */
#define CHECK_BOUNDED(name, o, max_kb, max_s)                                                \
  do {                                                                                       \
    printf("  %-44s %7ld KB %7.3f s  %.100s\n", name, (o).rss_kb, (o).seconds, (o).message); \
    CHECK_MSG((o).ok, "%s: %s", name, (o).message);                                          \
    CHECK_MSG((o).rss_kb <= (long)(max_kb)*MEM_SLACK, "%s: %ld KB, bound %ld KB", name,      \
              (o).rss_kb, (long)(max_kb)*MEM_SLACK);                                         \
    CHECK_MSG((o).seconds <= (max_s), "%s: %.3f s, bound %.1f s", name, (o).seconds,         \
              (double)(max_s));                                                              \
  } while (0)

static int error_says(const char* what) {
  return strstr(gpumem_last_error(), what) != NULL;
}

/* ---- building inputs ----------------------------------------------------- */

typedef struct buf {
  unsigned char* p;
  size_t len, cap;
} buf_t;

static void put(buf_t* b, const void* s, size_t n) {
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + n) cap *= 2;
    b->p = realloc(b->p, cap);
    if (!b->p) abort();
    b->cap = cap;
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
}

static void put_byte(buf_t* b, unsigned char c) {
  put(b, &c, 1);
}

static void put_text(buf_t* b, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void put_text(buf_t* b, const char* fmt, ...) {
  char line[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  put(b, line, (size_t)n);
}

/* Pickle pieces: SHORT_BINUNICODE, LONG1 of 8 bytes, BINPUT, BINGET. */
static void p_str(buf_t* b, const char* s) {
  put_byte(b, 0x8c);
  put_byte(b, (unsigned char)strlen(s));
  put(b, s, strlen(s));
}

static void p_int(buf_t* b, int64_t v) {
  put_byte(b, 0x8a);
  put_byte(b, 8);
  uint64_t u = (uint64_t)v;
  for (int k = 0; k < 8; k++) put_byte(b, (unsigned char)(u >> (8 * k)));
}

/* An event dict {action, addr, size, stream}, left on the stack. */
static void p_event(buf_t* b, const char* action, int64_t addr, int64_t size) {
  put_byte(b, '}');
  put_byte(b, '(');
  p_str(b, "action");
  p_str(b, action);
  p_str(b, "addr");
  p_int(b, addr);
  p_str(b, "size");
  p_int(b, size);
  p_str(b, "stream");
  p_int(b, 0);
  put_byte(b, 'u');
}

/* The start of a snapshot {"device_traces": [[events...]]}: the events go
 * on with p_event and 'a'; snap_end closes it. */
static void snap_begin(buf_t* b) {
  put_byte(b, 0x80);
  put_byte(b, 4);
  put_byte(b, '}');
  p_str(b, "device_traces");
  put_byte(b, ']');
  put_byte(b, ']');
}

static void snap_end(buf_t* b) {
  put_byte(b, 'a'); /* the device's list into device_traces */
  put_byte(b, 's'); /* device_traces into the dict */
  put_byte(b, '.');
}

static int snapshot_refused(const buf_t* b, const char* says) {
  trace_t* t = NULL;
  gpumem_status_t st = snapshot_to_trace("hostile.pickle", b->p, b->len, &t);
  trace_free(t);
  return st == GPUMEM_ERR_IO && t == NULL && error_says(says);
}

/* ---- row: streams -------------------------------------------------------- */

static void stream_trace(buf_t* b, int streams) {
  for (int i = 0; i < streams; i++) put_text(b, "a %d 512 %d\n", i, i + 1);
}

static int parse_refused(const void* arg) {
  const buf_t* b = arg;
  trace_t* t = NULL;
  gpumem_status_t st = trace_parse("hostile.trace", (const char*)b->p, b->len, &t);
  trace_free(t);
  return st == GPUMEM_ERR_IO && error_says("readers' limit");
}

static int replay_ok(const void* arg) {
  const buf_t* b = arg;
  trace_t* t = NULL;
  if (trace_parse("streams.trace", (const char*)b->p, b->len, &t) != GPUMEM_OK) return 0;
  replay_config_t c;
  replay_config_init(&c);
  c.warm_passes = 1;
  replay_result_t r;
  gpumem_status_t st = replay_trace(t, &c, &r);
  trace_free(t);
  return st == GPUMEM_OK && !r.oom;
}

/* Under an address-space limit the allocator's tables cannot be had: the
 * replay must fail as the host's out of memory, not report the device's. */
static int replay_host_oom(const void* arg) {
  const buf_t* b = arg;
  trace_t* t = NULL;
  if (trace_parse("streams.trace", (const char*)b->p, b->len, &t) != GPUMEM_OK) return 0;
  long pages = 0, page = sysconf(_SC_PAGESIZE);
  FILE* f = fopen("/proc/self/statm", "r");
  if (!f || fscanf(f, "%ld", &pages) != 1) {
    if (f) fclose(f);
    trace_free(t);
    return 0;
  }
  fclose(f);
  struct rlimit lim = {(rlim_t)(pages * page + 96 * MIB), (rlim_t)(pages * page + 96 * MIB)};
  setrlimit(RLIMIT_AS, &lim);
  replay_config_t c;
  replay_config_init(&c);
  c.warm_passes = 0;
  replay_result_t r;
  gpumem_status_t st = replay_trace(t, &c, &r);
  trace_free(t);
  return st == GPUMEM_ERR_HOST_MEMORY && !r.oom && error_says("out of host memory");
}

static void test_streams(void) {
  printf("streams\n");
  buf_t b = {0};
  stream_trace(&b, TRACE_MAX_STREAMS);
  trace_t* t = NULL;
  CHECK_STATUS(trace_parse("s.trace", (const char*)b.p, b.len, &t), GPUMEM_OK);
  if (t) CHECK(t->num_streams == TRACE_MAX_STREAMS);
  trace_free(t);
  /* a record_stream naming one more stream counts too */
  buf_t r = {0};
  stream_trace(&r, TRACE_MAX_STREAMS);
  put_text(&r, "r 0 0x%x\n", 4096);
  CHECK(parse_refused(&r));
  free(r.p);

  buf_t many = {0};
  stream_trace(&many, 5000); /* about 75 KB: explain took 6 GB */
  outcome_t o = in_child(parse_refused, &many);
  CHECK_BOUNDED("5000 streams: refused", o, 16 * 1024, 2.0);
  CHECK(strstr(o.message, "line 65") && strstr(o.message, "64 streams"));
  free(many.p);

  /* At the cap a replay costs what the cap allows (about 1.3 MB a stream
   * for explain's two allocators, 0.25 MB for a replay). */
  o = in_child(replay_ok, &b);
  CHECK_BOUNDED("64 streams: replayed", o, 160 * 1024, 20.0);
  if (!UNDER_SANITIZER) { /* their shadow memory needs the address space */
    o = in_child(replay_host_oom, &b);
    CHECK_BOUNDED("64 streams under RLIMIT_AS: host out of memory", o, 160 * 1024, 20.0);
  }
  free(b.p);
}

/* ---- row: sizes near 2^64 ------------------------------------------------ */

static void test_sizes(void) {
  printf("sizes\n");
  static const char* const refused[] = {
      "a 1 18446744073709551615 0\n", "a 1 281474976710657 0\n", /* 2^48 + 1 */
  };
  for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
    trace_t* t = NULL;
    clear_error();
    CHECK_STATUS(trace_parse("big.trace", refused[i], strlen(refused[i]), &t), GPUMEM_ERR_IO);
    CHECK(t == NULL);
    CHECK_MSG(error_says("line 1") && error_says("2^48"), "%s", gpumem_last_error());
  }
  /* the cap itself is a size, and one that fits no device: an OOM, never
   * a fit in 0 */
  const char* at_cap = "a 1 281474976710656 0\n";
  trace_t* t = NULL;
  CHECK_STATUS(trace_parse("cap.trace", at_cap, strlen(at_cap), &t), GPUMEM_OK);
  if (t) {
    replay_config_t c;
    replay_config_init(&c);
    c.warm_passes = 0;
    replay_result_t r;
    CHECK_STATUS(replay_trace(t, &c, &r), GPUMEM_OK);
    CHECK(r.oom);
    /* fit's models: it needs 2^48 bytes, and in 80 GiB it does not fit */
    static const peer_model_t models[] = {PEER_EXPANDABLE, PEER_ASYNC};
    for (size_t m = 0; m < 2; m++) {
      peer_result_t pr;
      CHECK_STATUS(peer_run(t, models[m], 0, 0, &pr), GPUMEM_OK);
      /* (expandable segments span 2^42 bytes: no room for it at all) */
      CHECK(pr.oom || pr.peak_reserved_bytes >= TRACE_MAX_SIZE);
      CHECK_STATUS(peer_run(t, models[m], (uint64_t)80 << 30, 0, &pr), GPUMEM_OK);
      CHECK(pr.oom);
    }
  }
  trace_free(t);
  /* totals past 2^62 (past 64 bits at 2^16): 2^16 allocations of 2^48 */
  buf_t b = {0};
  for (int i = 0; i < 65536; i++) put_text(&b, "a %d 281474976710656 0\nf %d\n", i, i);
  clear_error();
  CHECK_STATUS(trace_parse("sum.trace", (const char*)b.p, b.len, &t), GPUMEM_ERR_IO);
  CHECK_MSG(error_says("line 32769") && error_says("2^62"), "%s", gpumem_last_error());
  free(b.p);
}

/* ---- row: fraction that rounds the limit to 0 ---------------------------- */

static void test_fraction(void) {
  printf("fraction\n");
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = (size_t)80 << 30;
  gpumem_backend_t* sim = gpumem_sim_create(&so);
  CHECK(sim != NULL);
  if (!sim) return;
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, "fraction:1e-12"), GPUMEM_OK);
  gpumem_status_t err = GPUMEM_OK;
  clear_error();
  gpumem_t* gm = gpumem_create(sim, &o, &err);
  CHECK(gm == NULL);
  CHECK(err == GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_MSG(error_says("fraction") && error_says("0 bytes"), "%s", gpumem_last_error());
  gpumem_destroy(gm);
  /* 1e-9 of 80 GiB is 85 bytes: a limit, kept */
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, "fraction:1e-9"), GPUMEM_OK);
  gm = gpumem_create(sim, &o, &err);
  CHECK(gm != NULL);
  if (gm) CHECK(gpumem_get_limit(gm) == 85);
  gpumem_destroy(gm);
  gpumem_sim_destroy(sim);
}

/* ---- row: gzip bomb ------------------------------------------------------ */

typedef struct bomb {
  const char* path;
  size_t cap;
} bomb_t;

static int load_bomb(const void* arg) {
  const bomb_t* b = arg;
  trace_max_bytes = b->cap;
  trace_t* t = NULL;
  gpumem_status_t st = trace_load(b->path, &t);
  trace_free(t);
  return st == GPUMEM_ERR_IO && error_says("readers' limit");
}

static void test_gzip_bomb(void) {
  printf("gzip bomb\n");
  CHECK(trace_max_bytes == TRACE_MAX_BYTES_DEFAULT);
  char path[] = "/tmp/gpumem_bomb_XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  if (fd < 0) return;
  gzFile f = gzdopen(fd, "wb9");
  static char newlines[1 << 16];
  memset(newlines, '\n', sizeof newlines);
  /* 64 MiB of newlines, about 64 KB compressed */
  for (int i = 0; i < 1024; i++) gzwrite(f, newlines, sizeof newlines);
  gzclose(f);
  /* a cap of 4 MiB: the reader stops at it; 4 times the cap covers the
   * buffer's growth and the libraries' own */
  bomb_t b = {path, (size_t)4 << 20};
  outcome_t o = in_child(load_bomb, &b);
  CHECK_BOUNDED("64 MiB of newlines, cap 4 MiB", o, 16 * 1024, 3.0);
  unlink(path);
}

/* ---- row: memo key 2^30 --------------------------------------------------- */

static int read_refused(const void* arg) {
  const buf_t* b = arg;
  pickle_doc_t doc;
  gpumem_status_t st = pickle_read("hostile.pickle", b->p, b->len, &doc);
  if (st == GPUMEM_OK) pickle_free(&doc);
  return st == GPUMEM_ERR_IO && error_says("memo key");
}

static int read_ok(const void* arg) {
  const buf_t* b = arg;
  pickle_doc_t doc;
  gpumem_status_t st = pickle_read("deep.pickle", b->p, b->len, &doc);
  if (st != GPUMEM_OK) return 0;
  pickle_free(&doc);
  return 1;
}

static void test_memo(void) {
  printf("memo\n");
  static const unsigned char nine[] = {0x80, 2, 'N', 'r', 0, 0, 0, 0x40, '.'};
  buf_t b = {0};
  put(&b, nine, sizeof nine);
  outcome_t o = in_child(read_refused, &b);
  CHECK_BOUNDED("memo key 2^30 in 9 bytes", o, 4 * 1024, 1.0);
  CHECK(strstr(o.message, "at byte 3") != NULL);
  free(b.p);
  /* keys up to the file's length are kept: MEMOIZE numbers them */
  buf_t ok = {0};
  put_byte(&ok, 0x80);
  put_byte(&ok, 4);
  put_byte(&ok, 'N');
  for (int i = 0; i < 100; i++) put_byte(&ok, 0x94);
  put_byte(&ok, 'j');
  put_byte(&ok, 99);
  put(&ok, "\0\0\0", 3);
  put_byte(&ok, '0');
  put_byte(&ok, '.');
  CHECK(read_ok(&ok));
  free(ok.p);
}

/* ---- row: nested containers, duplicated events ---------------------------- */

static void test_nesting(void) {
  printf("nesting\n");
  /* (((None,),),...) two bytes a tuple: 30 MB took 9.4 GB */
  const size_t n = 2u << 20;
  buf_t tuples = {0};
  put_byte(&tuples, 0x80);
  put_byte(&tuples, 2);
  put_byte(&tuples, 'N');
  for (size_t i = 0; i < n; i++) put_byte(&tuples, 0x85);
  put_byte(&tuples, '.');
  outcome_t o = in_child(read_ok, &tuples);
  CHECK_BOUNDED("2M nested one-item tuples (2 MB)", o,
                PICKLE_BYTES_PER_INPUT_BYTE * tuples.len / 1024, 5.0);
  free(tuples.p);

  /* [[[...]]]: 2M empty lists, then each appended to the one below */
  buf_t lists = {0};
  put_byte(&lists, 0x80);
  put_byte(&lists, 2);
  for (size_t i = 0; i < n; i++) put_byte(&lists, ']');
  for (size_t i = 1; i < n; i++) put_byte(&lists, 'a');
  put_byte(&lists, '.');
  o = in_child(read_ok, &lists);
  CHECK_BOUNDED("2M nested lists (4 MB)", o, PICKLE_BYTES_PER_INPUT_BYTE * lists.len / 1024, 5.0);
  free(lists.p);
}

static int dup_refused(const void* arg) {
  return snapshot_refused(arg, "already read");
}

static void test_duplicates(void) {
  printf("duplicates\n");
  /* one free_requested event memoized, then named 1M times (2 bytes each) */
  buf_t b = {0};
  snap_begin(&b);
  p_event(&b, "alloc", 4096, 512);
  put_byte(&b, 'a');
  p_event(&b, "free_requested", 8192, 512);
  put_byte(&b, 'q');
  put_byte(&b, 200);
  put_byte(&b, 'a');
  for (int i = 0; i < 1000000; i++) {
    put_byte(&b, 'h');
    put_byte(&b, 200);
    put_byte(&b, 'a');
  }
  snap_end(&b);
  setenv("GPUMEM_SNAPSHOT_PARTIAL", "1", 1);
  outcome_t o = in_child(dup_refused, &b);
  CHECK_BOUNDED("one event named 1M times (3 MB)", o, PICKLE_BYTES_PER_INPUT_BYTE * b.len / 1024,
                5.0);
  CHECK(strstr(o.message, "event 2") != NULL);
  unsetenv("GPUMEM_SNAPSHOT_PARTIAL");
  free(b.p);

  /* a dict of K junk keys (memo references: 4 bytes a key) named N times:
   * each lookup walked the K keys, N x K in all (384 KB took 50 s) */
  const int k = 50000, refs = 50000;
  buf_t d = {0};
  snap_begin(&d);
  p_str(&d, "junk");
  put_byte(&d, 'q');
  put_byte(&d, 1);
  put_byte(&d, '0');
  p_event(&d, "alloc", 4096, 512);
  put_byte(&d, 'a');
  put_byte(&d, '}');
  put_byte(&d, '(');
  for (int i = 0; i < k; i++) {
    put_byte(&d, 'h');
    put_byte(&d, 1);
    put_byte(&d, 'h');
    put_byte(&d, 1);
  }
  p_str(&d, "action");
  p_str(&d, "segment_alloc");
  p_str(&d, "addr");
  p_int(&d, 0);
  p_str(&d, "size");
  p_int(&d, 1 << 21);
  put_byte(&d, 'u');
  put_byte(&d, 'q');
  put_byte(&d, 2);
  put_byte(&d, 'a');
  for (int i = 0; i < refs; i++) {
    put_byte(&d, 'h');
    put_byte(&d, 2);
    put_byte(&d, 'a');
  }
  snap_end(&d);
  o = in_child(dup_refused, &d);
  CHECK_BOUNDED("a 50k-key dict named 50k times (350 KB)", o,
                16 * 1024 + PICKLE_BYTES_PER_INPUT_BYTE * d.len / 1024, 2.0);
  free(d.p);
}

/* ---- row: segment sizes near 2^63 ------------------------------------------ */

static void test_segment_overflow(void) {
  printf("segment sizes\n");
  buf_t b = {0};
  snap_begin(&b);
  for (int i = 0; i < 2; i++) {
    p_event(&b, "segment_alloc", (int64_t)i << 40, INT64_MAX);
    put_byte(&b, 'a');
  }
  p_event(&b, "alloc", 4096, 512);
  put_byte(&b, 'a');
  snap_end(&b);
  clear_error();
  CHECK(snapshot_refused(&b, "2^48"));
  CHECK_MSG(error_says("event 0"), "%s", gpumem_last_error());
  free(b.p);

  /* under the cap, a sum past 2^63: 2^15 + 1 segments of 2^48 */
  buf_t s = {0};
  snap_begin(&s);
  for (int i = 0; i <= 32768; i++) {
    p_event(&s, "segment_alloc", (int64_t)i << 30, (int64_t)1 << 48);
    put_byte(&s, 'a');
  }
  p_event(&s, "alloc", 4096, 512);
  put_byte(&s, 'a');
  snap_end(&s);
  clear_error();
  CHECK(snapshot_refused(&s, "overflow 64 bits"));
  free(s.p);
}

/* ---- row: the steady-state period search ------------------------------------ */

static int repeat_linear(const void* arg) {
  const buf_t* b = arg;
  trace_t* t = NULL;
  if (trace_parse("steady.trace", (const char*)b->p, b->len, &t) != GPUMEM_OK) return 0;
  trace_t* ext = NULL;
  size_t period = 0;
  gpumem_status_t st = trace_repeat_tail(t, 2, &ext, &period);
  size_t n = t->num_allocs;
  trace_free(t);
  trace_free(ext);
  return st == GPUMEM_OK && period == n / 2;
}

static void test_period_search(void) {
  printf("period search\n");
  /* n same-size allocations, then a free of the first: every period's
   * sizes match and its frees fail only at the last event, so the old
   * search took O(n^2) (200k: 10.6 s) */
  buf_t b = {0};
  for (int i = 0; i < 200000; i++) put_text(&b, "a %d 4096 0\n", i);
  put_text(&b, "f 0\n");
  outcome_t o = in_child(repeat_linear, &b);
  CHECK_BOUNDED("200k same-size allocations, --steady 2", o, 256 * 1024, 3.0);
  free(b.p);
  /* a real loop is still found: two steps of alloc, alloc, free, free */
  const char* loop =
      "a 1 100 0\na 2 200 0\nf 1\na 3 100 0\nf 2\na 4 200 0\nf 3\na 5 100 0\nf 4\n"
      "a 6 200 0\nf 5\n";
  trace_t* t = NULL;
  CHECK_STATUS(trace_parse("loop.trace", loop, strlen(loop), &t), GPUMEM_OK);
  if (t) {
    trace_t* ext = NULL;
    size_t period = 0;
    CHECK_STATUS(trace_repeat_tail(t, 3, &ext, &period), GPUMEM_OK);
    CHECK(period == 2);
    if (ext) CHECK(ext->num_allocs == t->num_allocs + 3 * 2);
    trace_free(ext);
  }
  trace_free(t);
}

/* ---- hash flooding ---------------------------------------------------------- */

/* The inverse of splitmix64's finalizer, the trace reader's hash before it
 * was keyed: IDs unmix(k << 32) all hash to one cell of any table of up to
 * 2^32 cells. */
static uint64_t unmix(uint64_t x) {
  x ^= (x >> 31) ^ (x >> 62);
  x *= 0x319642b2d24d8ec3ULL;
  x ^= (x >> 27) ^ (x >> 54);
  x *= 0x96de1b173f119089ULL;
  x ^= (x >> 30) ^ (x >> 60);
  return x;
}

static int parse_ok(const void* arg) {
  const buf_t* b = arg;
  trace_t* t = NULL;
  gpumem_status_t st = trace_parse("flood.trace", (const char*)b->p, b->len, &t);
  int ok = st == GPUMEM_OK && t->num_allocs == 50000;
  trace_free(t);
  return ok;
}

static void test_hash_flood(void) {
  printf("hash flooding\n");
  buf_t b = {0};
  for (uint64_t k = 1; k <= 50000; k++)
    put_text(&b, "a %llu 512 0\n", (unsigned long long)unmix(k << 32));
  /* 1.4 MB: 8.6 s with the unkeyed hash */
  outcome_t o = in_child(parse_ok, &b);
  CHECK_BOUNDED("50k IDs of one unkeyed hash cell", o, 64 * 1024, 2.0);
  free(b.p);
}

int main(void) {
  test_streams();
  test_sizes();
  test_fraction();
  test_gzip_bomb();
  test_memo();
  test_nesting();
  test_duplicates();
  test_segment_overflow();
  test_period_search();
  test_hash_flood();
  return test_finish("test_readers");
}
