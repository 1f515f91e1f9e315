/* The allocator lock's contended path (see lock.h). */
#include "lock.h"

#if defined(__linux__)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

void gm_lock_acquire_slow(gm_lock* l) {
  /* Spin a little first: the holder is most likely inside one short
   * allocator function on another core. */
  for (int spin = 0; spin < 100; spin++) {
    int expected = 0;
    if (atomic_load_explicit(&l->state, memory_order_relaxed) == 0 &&
        atomic_compare_exchange_weak_explicit(&l->state, &expected, 1, memory_order_acquire,
                                              memory_order_relaxed))
      return;
    cpu_relax();
  }
  /* Mark the lock contended (2) and sleep until it is free; whoever takes
   * it here takes it as 2, so its release wakes the next sleeper. */
  while (atomic_exchange_explicit(&l->state, 2, memory_order_acquire) != 0)
    gm_lock_futex(l, FUTEX_WAIT, 2);
}

#else

/* Keeps the translation unit non-empty where the lock is a pthread mutex. */
typedef int gm_lock_unused;

#endif
