/* The allocator's lock.
 *
 * Every public call that touches an allocator's state takes its lock once,
 * so on the warm path the lock is a measurable share of the cost: glibc's
 * pthread_mutex_lock and _unlock took 54 of the ~730 instructions per
 * operation of the replay's warm passes (callgrind, 2026-11-25). On Linux the
 * lock is a three-state futex mutex instead, whose uncontended lock and unlock
 * are one atomic instruction each; elsewhere it is a pthread mutex.
 *
 * States (Linux): 0 free, 1 held, 2 held and a thread may sleep on it. A
 * thread that finds it held spins briefly (allocator sections are short),
 * then marks it 2 and sleeps in the kernel; the unlock that finds 2 wakes
 * one sleeper, which takes it as 2 again so that the wakeups go on. */
#ifndef GPUMEM_LOCK_H
#define GPUMEM_LOCK_H

#if defined(__linux__)

#include <linux/futex.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct gm_lock {
  atomic_int state;
} gm_lock;

static inline int gm_lock_init(gm_lock* l) {
  atomic_init(&l->state, 0);
  return 0;
}

static inline void gm_lock_destroy(gm_lock* l) {
  (void)l;
}

static inline void gm_lock_futex(gm_lock* l, int op, int value) {
  /* atomic_int has int's size and alignment on Linux's ABIs, as the futex
   * word must. Errors (EAGAIN: the state changed before sleeping, EINTR)
   * all mean "look again", which the callers do. */
  syscall(SYS_futex, (int*)&l->state, op | FUTEX_PRIVATE_FLAG, value, NULL, NULL, 0);
}

void gm_lock_acquire_slow(gm_lock* l);

static inline void gm_lock_acquire(gm_lock* l) {
  int expected = 0;
  if (__builtin_expect(atomic_compare_exchange_strong_explicit(
                           &l->state, &expected, 1, memory_order_acquire, memory_order_relaxed),
                       1))
    return;
  gm_lock_acquire_slow(l);
}

static inline void gm_lock_release(gm_lock* l) {
  if (__builtin_expect(atomic_exchange_explicit(&l->state, 0, memory_order_release) == 2, 0))
    gm_lock_futex(l, FUTEX_WAKE, 1);
}

#else /* not Linux: a pthread mutex */

#include <pthread.h>

typedef struct gm_lock {
  pthread_mutex_t mutex;
} gm_lock;

static inline int gm_lock_init(gm_lock* l) {
  return pthread_mutex_init(&l->mutex, NULL);
}
static inline void gm_lock_destroy(gm_lock* l) {
  pthread_mutex_destroy(&l->mutex);
}
static inline void gm_lock_acquire(gm_lock* l) {
  pthread_mutex_lock(&l->mutex);
}
static inline void gm_lock_release(gm_lock* l) {
  pthread_mutex_unlock(&l->mutex);
}

#endif
#endif
