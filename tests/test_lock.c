/* The allocator lock (src/lock.h) on its own: threads increment a plain
 * counter under it and flag their presence inside; a second thread inside,
 * or a lost increment, fails. Some holders yield or sleep inside so that
 * the others go past the spin and sleep in the kernel (the futex path),
 * which the test checks did happen. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "lock.h"
#include "test_util.h"

enum { THREADS = 8, ITERATIONS = 50000 };

static gm_lock lock;
static long counter;           /* guarded by lock, deliberately not atomic */
static atomic_int inside;      /* threads inside the critical section */
static atomic_long overlaps;   /* times a thread found another inside */
static atomic_long found_held; /* acquisitions that found the lock held */

static void* worker(void* arg) {
  long id = (long)(intptr_t)arg;
  for (long i = 0; i < ITERATIONS; i++) {
#if defined(__linux__)
    if (atomic_load_explicit(&lock.state, memory_order_relaxed) != 0)
      atomic_fetch_add(&found_held, 1);
#endif
    gm_lock_acquire(&lock);
    if (atomic_fetch_add(&inside, 1) != 0) atomic_fetch_add(&overlaps, 1);
    long seen = counter;
    if ((i + id) % 997 == 0) {
      struct timespec nap = {0, 20000}; /* 20 us asleep while holding it */
      nanosleep(&nap, NULL);
    } else if ((i + id) % 61 == 0) {
      sched_yield();
    }
    counter = seen + 1;
    atomic_fetch_sub(&inside, 1);
    gm_lock_release(&lock);
  }
  return NULL;
}

int main(void) {
  CHECK(gm_lock_init(&lock) == 0);
  pthread_t threads[THREADS];
  for (long t = 0; t < THREADS; t++)
    CHECK(pthread_create(&threads[t], NULL, worker, (void*)(intptr_t)t) == 0);
  for (int t = 0; t < THREADS; t++) pthread_join(threads[t], NULL);
  CHECK_MSG(counter == (long)THREADS * ITERATIONS, "lost increments: %ld of %ld", counter,
            (long)THREADS * ITERATIONS);
  CHECK_MSG(atomic_load(&overlaps) == 0, "%ld times two threads were inside at once",
            atomic_load(&overlaps));
#if defined(__linux__)
  CHECK_MSG(atomic_load(&found_held) > 0, "the lock was never contended: the test proves little");
  CHECK_MSG(atomic_load_explicit(&lock.state, memory_order_relaxed) == 0,
            "the lock is not free after every thread released it");
#endif
  gm_lock_destroy(&lock);
  printf("test_lock: %ld acquisitions, %ld found it held\n", counter, atomic_load(&found_held));
  return test_finish("test_lock");
}
