/* Several threads on one allocator: the lock must keep every structure
 * consistent. Each thread allocates on its own stream and on a shared one,
 * frees its own blocks and blocks other threads handed over through a
 * shared mailbox, and marks some blocks used on other streams. At the end
 * gpumem_check finds nothing, every byte is accounted for and the
 * simulated device holds exactly what the allocator says it reserves. An
 * observer thread reads leak reports and snapshots meanwhile: each must be
 * self-consistent though the allocator changes under it. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"

enum { THREADS = 4, OPS = 20000, LIVE = 64, MAILBOX = 256 };

typedef struct shared {
  gpumem_t* gm;
  pthread_mutex_t mailbox_lock;
  void* mailbox[MAILBOX]; /* blocks one thread allocates and another frees */
  int mailbox_count;
  atomic_long failures;
  atomic_int done;
  atomic_long reports; /* observer passes so far */
} shared_t;

typedef struct worker {
  shared_t* sh;
  int index;
} worker_t;

static uint64_t next_rand(uint64_t* s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static void* worker_main(void* arg) {
  worker_t* w = arg;
  shared_t* sh = w->sh;
  uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(w->index + 1);
  void* live[LIVE] = {0};
  gpumem_stream_t own = 0x1000u * (gpumem_stream_t)(w->index + 1);
  for (int op = 0; op < OPS; op++) {
    uint64_t r = next_rand(&rng);
    int slot = (int)(r % LIVE);
    if (!live[slot]) {
      size_t size = (size_t)1 << (9 + (r >> 8) % 16); /* 512 B .. 16 MiB */
      size += (r >> 20) % 4096;
      gpumem_stream_t stream = (r >> 32) % 4 == 0 ? 0 : own;
      if (gpumem_malloc(sh->gm, size, stream, &live[slot]) != GPUMEM_OK) {
        atomic_fetch_add(&sh->failures, 1);
        live[slot] = NULL;
        continue;
      }
      if ((r >> 40) % 8 == 0) gpumem_record_stream(sh->gm, live[slot], own + 1);
    } else if ((r >> 44) % 5 == 0) {
      /* hand the block to whichever thread empties the mailbox */
      pthread_mutex_lock(&sh->mailbox_lock);
      if (sh->mailbox_count < MAILBOX) {
        sh->mailbox[sh->mailbox_count++] = live[slot];
        live[slot] = NULL;
      }
      pthread_mutex_unlock(&sh->mailbox_lock);
    } else {
      if (gpumem_free(sh->gm, live[slot]) != GPUMEM_OK) atomic_fetch_add(&sh->failures, 1);
      live[slot] = NULL;
    }
    if (op % 97 == 0) {
      void* taken = NULL;
      pthread_mutex_lock(&sh->mailbox_lock);
      if (sh->mailbox_count) taken = sh->mailbox[--sh->mailbox_count];
      pthread_mutex_unlock(&sh->mailbox_lock);
      if (taken && gpumem_free(sh->gm, taken) != GPUMEM_OK) atomic_fetch_add(&sh->failures, 1);
    }
    if (op % 5000 == 4999) gpumem_empty_cache(sh->gm);
  }
  /* A loaded machine may run every worker to the end before the observer is
   * first scheduled; holding the last blocks until it has looked once makes
   * sure it observes a live allocator. */
  while (atomic_load(&sh->reports) == 0) sched_yield();
  for (int i = 0; i < LIVE; i++) {
    if (live[i] && gpumem_free(sh->gm, live[i]) != GPUMEM_OK) atomic_fetch_add(&sh->failures, 1);
  }
  return NULL;
}

/* Leak reports and snapshots taken while the workers run. */
static void* observer_main(void* arg) {
  shared_t* sh = arg;
  while (!atomic_load(&sh->done)) {
    uint64_t mark = gpumem_leak_mark(sh->gm);
    gpumem_leaks_t l;
    if (gpumem_find_leaks(sh->gm, mark / 2, &l) != GPUMEM_OK ||
        !(l.made >= mark && l.count <= l.made - l.since && (!l.count || l.oldest > l.since) &&
          l.newest <= l.made && l.groups <= l.count && l.requested_bytes <= l.bytes)) {
      atomic_fetch_add(&sh->failures, 1);
    }
    sink_t t = {0};
    if (gpumem_print_leaks_json(sh->gm, mark, sink_write, &t) != 0 ||
        gpumem_snapshot_json(sh->gm, 0, NULL, sink_write, &t) != 0) {
      atomic_fetch_add(&sh->failures, 1);
    }
    sink_free(&t);
    atomic_fetch_add(&sh->reports, 1);
    nanosleep(&(struct timespec){0, 1000000}, NULL); /* 1 ms: observe, do not crowd out */
  }
  return NULL;
}

static void run(const char* conf) {
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = (size_t)64 << 30;
  so.event_delay_queries = 2;
  gpumem_backend_t* sim = gpumem_sim_create(&so);
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, conf), GPUMEM_OK);
  shared_t sh = {0};
  sh.gm = gpumem_create(sim, &o, NULL);
  CHECK(sh.gm != NULL);
  if (!sh.gm) {
    gpumem_sim_destroy(sim);
    return;
  }
  pthread_mutex_init(&sh.mailbox_lock, NULL);
  pthread_t threads[THREADS];
  worker_t workers[THREADS];
  for (int i = 0; i < THREADS; i++) {
    workers[i].sh = &sh;
    workers[i].index = i;
    CHECK(pthread_create(&threads[i], NULL, worker_main, &workers[i]) == 0);
  }
  pthread_t observer;
  CHECK(pthread_create(&observer, NULL, observer_main, &sh) == 0);
  for (int i = 0; i < THREADS; i++) pthread_join(threads[i], NULL);
  atomic_store(&sh.done, 1);
  pthread_join(observer, NULL);
  for (int i = 0; i < sh.mailbox_count; i++)
    CHECK_STATUS(gpumem_free(sh.gm, sh.mailbox[i]), GPUMEM_OK);
  CHECK_MSG(atomic_load(&sh.failures) == 0, "%s: %ld operations failed: %s", conf,
            atomic_load(&sh.failures), gpumem_last_error());
  size_t violations = gpumem_check(sh.gm);
  CHECK_MSG(violations == 0, "%s: %zu violations: %s", conf, violations, gpumem_last_error());
  gpumem_stats_t st;
  gpumem_get_stats(sh.gm, &st);
  CHECK_MSG(st.allocated_bytes[GPUMEM_POOL_ALL].current == 0 &&
                st.allocation[GPUMEM_POOL_ALL].current == 0,
            "%s: %lld bytes still allocated after every free", conf,
            (long long)st.allocated_bytes[GPUMEM_POOL_ALL].current);
  printf(
      "%-30s %d threads: %lld mallocs, %lld deferred by other streams' events, peak reserved %lld "
      "MiB\n",
      conf, THREADS, (long long)st.allocation[GPUMEM_POOL_ALL].allocated,
      (long long)st.backend_calls[GPUMEM_CALL_event_record],
      (long long)(st.reserved_bytes[GPUMEM_POOL_ALL].peak >> 20));
  CHECK(st.allocation[GPUMEM_POOL_ALL].allocated > THREADS * OPS / 4);
  gpumem_leaks_t left;
  CHECK_STATUS(gpumem_find_leaks(sh.gm, 0, &left), GPUMEM_OK);
  CHECK_MSG(left.count == 0 && left.made == (uint64_t)st.allocation[GPUMEM_POOL_ALL].allocated,
            "%s: %llu live, %llu made, %lld allocations counted", conf,
            (unsigned long long)left.count, (unsigned long long)left.made,
            (long long)st.allocation[GPUMEM_POOL_ALL].allocated);
  gpumem_sim_counters_t c;
  gpumem_sim_get_counters(sim, &c);
  CHECK_MSG((int64_t)c.bytes_in_use == st.reserved_bytes[GPUMEM_POOL_ALL].current,
            "%s: device holds %llu bytes, allocator reserves %lld", conf,
            (unsigned long long)c.bytes_in_use,
            (long long)st.reserved_bytes[GPUMEM_POOL_ALL].current);
  gpumem_destroy(sh.gm);
  gpumem_sim_get_counters(sim, &c);
  CHECK_MSG(c.bytes_in_use == 0 && c.ranges_reserved == 0 && c.events_live == 0,
            "%s: leaked after destroy: %llu bytes, %llu ranges, %llu events", conf,
            (unsigned long long)c.bytes_in_use, (unsigned long long)c.ranges_reserved,
            (unsigned long long)c.events_live);
  gpumem_sim_destroy(sim);
  pthread_mutex_destroy(&sh.mailbox_lock);
}

int main(void) {
  run("policy:pytorch");
  run("policy:default");
  run("policy:default,reclaim:lazy");
  return test_finish("test_threads");
}
