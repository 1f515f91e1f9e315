/* Publication (src/publish.c): what another process reads of an
 * allocator, when it is up to date, what a process that died leaves, and
 * that a file that cannot be made costs nothing but the publication. The
 * files go to a directory of the test's own (GPUMEM_PUBLISH_DIR). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"

#define MIB ((size_t)1 << 20)

static char dir[256];

typedef struct seen {
  gpumem_published_t items[16];
  int count;
} seen_t;

static int collect(const gpumem_published_t* p, void* arg) {
  seen_t* s = arg;
  if (s->count < 16) s->items[s->count++] = *p;
  return 0;
}

static seen_t scan(void) {
  seen_t s;
  memset(&s, 0, sizeof s);
  int n = gpumem_published_scan(dir, collect, &s);
  CHECK_MSG(n == s.count, "scan returned %d for %d read (%s)", n, s.count, gpumem_last_error());
  return s;
}

static gpumem_t* make(const char* conf, gpumem_backend_t** sim) {
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = (size_t)1 << 30;
  *sim = gpumem_sim_create(&so);
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, conf), GPUMEM_OK);
  o.own_backend = 1;
  gpumem_status_t st;
  gpumem_t* gm = gpumem_create(*sim, &o, &st);
  CHECK_MSG(gm != NULL, "create(%s): %s", conf, gpumem_last_error());
  return gm;
}

static void* alloc(gpumem_t* gm, size_t size) {
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, size, 0, &p), GPUMEM_OK);
  return p;
}

/* The published figures equal the statistics after gpumem_publish, and
 * lag by at most 63 operations between publications. */
static void test_figures(void) {
  gpumem_backend_t* sim;
  gpumem_t* gm = make("publish:on,limit:256M", &sim);
  if (!gm) return;
  CHECK(scan().count == 0); /* the file comes with the first publication */
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_OK);
  seen_t s = scan();
  CHECK(s.count == 1);
  if (s.count != 1) return gpumem_destroy(gm);
  const gpumem_published_t* p = &s.items[0];
  CHECK(p->pid == (int)getpid() && p->alive && p->device == -1 && p->virtual_memory == 1);
  CHECK(strcmp(p->policy, "default") == 0 && p->process[0] != '\0');
  CHECK(p->limit_bytes == 256 * (int64_t)MIB && p->device_total == (int64_t)1 << 30);
  CHECK(p->updated_unix_ms >= p->started_unix_ms && p->started_unix_ms > 0);
  void* ptrs[200];
  int max_lag = 0;
  for (int i = 0; i < 200; i++) {
    ptrs[i] = alloc(gm, 64 * 1024);
    gpumem_stats_t st;
    gpumem_get_stats(gm, &st);
    s = scan();
    CHECK_MSG(s.items[0].reserved_bytes == st.reserved_bytes[GPUMEM_POOL_ALL].current,
              "reserved %lld published, %lld now", (long long)s.items[0].reserved_bytes,
              (long long)st.reserved_bytes[GPUMEM_POOL_ALL].current);
    int lag = (int)(st.allocation[GPUMEM_POOL_ALL].allocated - s.items[0].num_allocations);
    if (lag > max_lag) max_lag = lag;
  }
  CHECK_MSG(max_lag > 0 && max_lag <= 63, "published allocations lagged by up to %d", max_lag);
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_OK);
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  s = scan();
  CHECK(s.items[0].allocated_bytes == st.allocated_bytes[GPUMEM_POOL_ALL].current);
  CHECK(s.items[0].allocated_peak == st.allocated_bytes[GPUMEM_POOL_ALL].peak);
  CHECK(s.items[0].active_bytes == st.active_bytes[GPUMEM_POOL_ALL].current);
  CHECK(s.items[0].requested_bytes == st.requested_bytes[GPUMEM_POOL_ALL].current);
  CHECK(s.items[0].num_allocations == 200);
  /* An out-of-memory failure is published at once. */
  void* big = NULL;
  CHECK_STATUS(gpumem_malloc(gm, 300 * MIB, 0, &big), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(scan().items[0].num_ooms == 1);
  /* So are a new limit and empty_cache. */
  gpumem_remove_limit(gm);
  CHECK(scan().items[0].limit_bytes == 0);
  for (int i = 0; i < 200; i++) CHECK_STATUS(gpumem_free(gm, ptrs[i]), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(gm), GPUMEM_OK);
  s = scan();
  CHECK_MSG(s.items[0].reserved_bytes == 0 && s.items[0].allocated_bytes == 0,
            "after empty_cache: reserved %lld, allocated %lld",
            (long long)s.items[0].reserved_bytes, (long long)s.items[0].allocated_bytes);
  /* Two allocators, two files; destroying one removes its own. */
  gpumem_backend_t* sim2;
  gpumem_t* other = make("policy:pytorch,publish:on", &sim2);
  void* q = alloc(other, MIB); /* published: reserved changed */
  s = scan();
  CHECK(s.count == 2 && s.items[0].instance != s.items[1].instance);
  gpumem_destroy(gm);
  s = scan();
  CHECK(s.count == 1 && strcmp(s.items[0].policy, "pytorch") == 0);
  CHECK_STATUS(gpumem_free(other, q), GPUMEM_OK);
  gpumem_destroy(other);
  CHECK(scan().count == 0);
}

/* Off by option, off by default on the simulated device, off when the
 * file cannot be made; the allocator works all the same. */
static void test_off(void) {
  gpumem_backend_t* sim;
  gpumem_t* gm = make("publish:off", &sim);
  clear_error();
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_ERR_UNSUPPORTED);
  CHECK(strstr(gpumem_last_error(), "option publish") != NULL);
  gpumem_free(gm, alloc(gm, MIB));
  gpumem_destroy(gm);
  gm = make("policy:default", &sim); /* auto: off on the simulated device */
  gpumem_free(gm, alloc(gm, MIB));
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_ERR_UNSUPPORTED);
  gpumem_destroy(gm);
  CHECK(scan().count == 0);
  setenv("GPUMEM_PUBLISH_DIR", "/nonexistent/gpumem-test", 1);
  gm = make("publish:on", &sim);
  void* p = alloc(gm, MIB); /* the first publication fails quietly */
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_ERR_UNSUPPORTED);
  CHECK(strstr(gpumem_last_error(), "GPUMEM_PUBLISH_DIR") != NULL);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
  setenv("GPUMEM_PUBLISH_DIR", dir, 1);
  /* Scanning what cannot be read */
  seen_t s;
  memset(&s, 0, sizeof s);
  CHECK(gpumem_published_scan("/nonexistent/gpumem-test", collect, &s) == -1);
  CHECK(strstr(gpumem_last_error(), "cannot read") != NULL);
  CHECK(gpumem_published_scan(dir, NULL, NULL) == -1);
}

/* A process that ends without destroying its allocator leaves its file:
 * read as not alive, with what it last published. */
static void test_dead_process(void) {
  pid_t child = fork();
  if (child == 0) {
    gpumem_backend_t* sim;
    gpumem_t* gm = make("publish:on", &sim);
    void* p = NULL;
    gpumem_malloc(gm, 5 * MIB, 0, &p);
    gpumem_publish(gm);
    _exit(0); /* no gpumem_destroy */
  }
  int status = 0;
  CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status));
  seen_t s = scan();
  CHECK(s.count == 1);
  if (s.count != 1) return;
  CHECK(s.items[0].pid == (int)child && !s.items[0].alive);
  CHECK(s.items[0].allocated_bytes == 5 * (int64_t)MIB);
  CHECK(unlink(s.items[0].path) == 0);
  CHECK(scan().count == 0);
}

/* A process that exits normally removes its files, even of allocators it
 * never destroyed (the per-device instances are not); a forked child's
 * exit leaves its parent's alone. */
static void test_exit_cleanup(void) {
  pid_t child = fork();
  if (child == 0) {
    gpumem_backend_t* sim;
    gpumem_t* gm = make("publish:on", &sim);
    void* p = NULL;
    gpumem_malloc(gm, MIB, 0, &p);
    gpumem_publish(gm);
    exit(0); /* atexit handlers run; gpumem_destroy never does */
  }
  int status = 0;
  CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status));
  CHECK_MSG(scan().count == 0, "a normal exit left its file");
  gpumem_backend_t* sim;
  gpumem_t* gm = make("publish:on", &sim);
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_OK);
  child = fork();
  if (child == 0) exit(0);
  CHECK(child > 0 && waitpid(child, &status, 0) == child);
  seen_t s = scan();
  CHECK_MSG(s.count == 1 && s.items[0].pid == (int)getpid() && s.items[0].alive,
            "a forked child's exit removed its parent's file");
  gpumem_destroy(gm);
  CHECK(scan().count == 0);
}

/* Readers scanning while the allocator publishes: every copy a scan keeps
 * must be one publication's, its figures agreeing with each other. (A
 * smoke test: on two cores a reader rarely lands inside a write, and
 * without the sequence lock this test still passed in three runs.) */
typedef struct writer {
  gpumem_t* gm;
  atomic_int done;
  atomic_long scans; /* the reader's scans so far */
} writer_t;

/* The i-th operation of the churn: free a slot's block, allocate anew. */
static void churn(gpumem_t* gm, void* ptrs[64], int i) {
  int k = i % 64;
  if (ptrs[k]) gpumem_free(gm, ptrs[k]);
  gpumem_malloc(gm, (size_t)(1 + (i * 7919) % 4096) * 512, 0, &ptrs[k]);
}

static void* write_loop(void* arg) {
  writer_t* w = arg;
  void* ptrs[64] = {NULL};
  for (int i = 0; i < 40000; i++) churn(w->gm, ptrs, i);
  /* A loaded machine may run the whole loop before the reader is first
   * scheduled: publish on until it has scanned once. */
  for (int i = 0; atomic_load(&w->scans) == 0; i = (i + 1) % 40000) churn(w->gm, ptrs, i);
  for (int k = 0; k < 64; k++) gpumem_free(w->gm, ptrs[k]);
  atomic_store(&w->done, 1);
  return NULL;
}

static void test_concurrent_readers(void) {
  gpumem_backend_t* sim;
  writer_t w = {make("publish:on", &sim), 0, 0};
  gpumem_publish(w.gm);
  pthread_t t;
  CHECK(pthread_create(&t, NULL, write_loop, &w) == 0);
  long reads = 0, bad = 0;
  while (!atomic_load(&w.done)) {
    seen_t s = scan();
    atomic_fetch_add(&w.scans, 1);
    for (int i = 0; i < s.count; i++) {
      const gpumem_published_t* p = &s.items[i];
      reads++;
      /* one publication's figures agree with each other */
      bad += p->allocated_bytes > p->allocated_peak || p->reserved_bytes > p->reserved_peak ||
             p->allocated_bytes > p->active_bytes || p->requested_bytes > p->allocated_bytes ||
             p->allocated_bytes > p->reserved_bytes;
    }
  }
  pthread_join(t, NULL);
  CHECK_MSG(bad == 0, "%ld of %ld reads inconsistent", bad, reads);
  CHECK_MSG(reads > 0, "no scan found the publishing allocator");
  gpumem_destroy(w.gm);
}

int main(void) {
  snprintf(dir, sizeof dir, "%s/gpumem_publish.XXXXXX",
           getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    return 1;
  }
  setenv("GPUMEM_PUBLISH_DIR", dir, 1);
  test_figures();
  test_off();
  test_dead_process();
  test_exit_cleanup();
  test_concurrent_readers();
  rmdir(dir);
  return test_finish("test_publish");
}
