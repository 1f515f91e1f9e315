/* Shared budgets: one cap on the reserved memory of every allocator, in any
 * process on this machine, that names the same budget on the same device
 * (options shared_limit and shared_name): several jobs on one GPU that
 * together must leave room for something else, or must not starve each
 * other.
 *
 * The budget is a file, DIR/gpumem-budget.<name>.<device> (DIR as for
 * publication: $GPUMEM_PUBLISH_DIR or /dev/shm), one page mapped shared by
 * every allocator in it: a total and a slot per allocator (its pid and the
 * bytes it holds), changed with atomics and no lock. Growing takes from
 * the total with a compare-and-swap that refuses to pass the cap, then
 * adds to the allocator's slot; releasing memory gives back to both. A
 * refusal is a limit: the allocator reclaims and empties its cache as it
 * does at its own limit, then reports out of memory naming the budget and
 * who holds it. Each allocator checks against its own shared_limit: give
 * every process the same value.
 *
 * A process that dies holding memory leaves its slot (the driver freed the
 * memory itself). When a take would fail, the slots of processes that are
 * gone are reaped, their bytes leave the total, and the take is tried
 * again. A process killed between taking from the total and adding to its
 * slot (two instructions) leaves those bytes counted for good: the budget
 * errs toward refusing. A reused pid keeps a dead process's slot until the
 * new process ends. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine.h"

#define BUDGET_MAGIC 0x3174656762646d67ull /* "gmdbget1" */
#define BUDGET_VERSION 1u
#define BUDGET_SLOTS 120

typedef struct budget_slot {
  _Atomic int32_t pid; /* 0: free */
  uint32_t unused;
  _Atomic uint64_t bytes;
} budget_slot;

typedef struct budget_file {
  _Atomic uint64_t magic; /* 0 in a file just made: the first to open it writes it */
  uint32_t version;
  uint32_t size;
  _Atomic uint64_t total;
  uint64_t reserved_for_later;
  budget_slot slots[BUDGET_SLOTS];
} budget_file;

struct gm_budget {
  budget_file* file; /* NULL until the first take */
  int slot;
  pid_t pid; /* the process that attached */
  char path[300];
};

gpumem_status_t gm_budget_init(gpumem_t* gm) {
  if (!gm->opts.shared_limit) return GPUMEM_OK;
  gm->budget = calloc(1, sizeof *gm->budget);
  if (!gm->budget) return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory");
  gm->budget->slot = -1;
  return GPUMEM_OK;
}

/* Frees the slots of processes that are gone; their bytes leave the total. */
static void reap(budget_file* f) {
  for (int i = 0; i < BUDGET_SLOTS; i++) {
    int32_t pid = atomic_load(&f->slots[i].pid);
    if (pid <= 0 || gm_process_alive(pid)) continue;
    uint64_t held = atomic_exchange(&f->slots[i].bytes, 0);
    atomic_fetch_sub(&f->total, held);
    atomic_compare_exchange_strong(&f->slots[i].pid, &pid, 0);
  }
}

static gpumem_status_t attach(gpumem_t* gm, gm_budget* b) {
  snprintf(b->path, sizeof b->path, "%s/gpumem-budget.%s.%d", gm_publish_dir(),
           gm->opts.shared_name[0] ? gm->opts.shared_name : "default", gm->device_index);
  int fd = open(b->path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) {
    return gm_fail(GPUMEM_ERR_BACKEND, "gpumem shared budget: cannot open %s: %s", b->path,
                   strerror(errno));
  }
  struct stat st;
  bool sized =
      fstat(fd, &st) == 0 && ((size_t)st.st_size == sizeof(budget_file) ||
                              (st.st_size == 0 && ftruncate(fd, sizeof(budget_file)) == 0));
  budget_file* f =
      sized ? mmap(NULL, sizeof *f, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  if (f == MAP_FAILED) {
    return gm_fail(GPUMEM_ERR_BACKEND,
                   "gpumem shared budget: %s is not a budget of this gpumem (%s)", b->path,
                   sized ? strerror(errno) : "its size differs");
  }
  uint64_t none = 0;
  if (atomic_compare_exchange_strong(&f->magic, &none, BUDGET_MAGIC)) {
    f->version = BUDGET_VERSION;
    f->size = sizeof *f;
  } else if (none != BUDGET_MAGIC) {
    munmap(f, sizeof *f);
    return gm_fail(GPUMEM_ERR_BACKEND, "gpumem shared budget: %s is not a gpumem budget", b->path);
  }
  pid_t me = getpid();
  for (int round = 0; round < 2 && b->slot < 0; round++) {
    for (int i = 0; i < BUDGET_SLOTS; i++) {
      int32_t free_pid = 0;
      if (atomic_compare_exchange_strong(&f->slots[i].pid, &free_pid, (int32_t)me)) {
        b->slot = i;
        break;
      }
    }
    if (b->slot < 0) reap(f);
  }
  if (b->slot < 0) {
    munmap(f, sizeof *f);
    return gm_fail(GPUMEM_ERR_BACKEND,
                   "gpumem shared budget: all %d allocator slots of %s are taken by live "
                   "processes",
                   BUDGET_SLOTS, b->path);
  }
  b->file = f;
  b->pid = me;
  return GPUMEM_OK;
}

gpumem_status_t gm_budget_take(gpumem_t* gm, uint64_t bytes) {
  gm_budget* b = gm->budget;
  if (!b->file) {
    gpumem_status_t st = attach(gm, b);
    if (st != GPUMEM_OK) return st;
  }
  if (b->pid != getpid()) {
    return gm_fail(GPUMEM_ERR_UNSUPPORTED,
                   "gpumem shared budget: this allocator was made in process %d and is used "
                   "in %d, its fork: the budget counts an allocator in one process only",
                   (int)b->pid, (int)getpid());
  }
  budget_file* f = b->file;
  uint64_t cap = gm->opts.shared_limit;
  for (int round = 0; round < 2; round++) {
    uint64_t total = atomic_load(&f->total);
    while (bytes <= cap && total <= cap - bytes) {
      if (atomic_compare_exchange_weak(&f->total, &total, total + bytes)) {
        atomic_fetch_add(&f->slots[b->slot].bytes, bytes);
        return GPUMEM_OK;
      }
    }
    if (round == 0) reap(f);
  }
  char c[32], mine[32], others[32], want[32];
  uint64_t total = atomic_load(&f->total), held = atomic_load(&f->slots[b->slot].bytes);
  return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                 "the shared limit of %s (budget %s) is reached: %s more would pass it; this "
                 "allocator holds %s of it, other allocators %s",
                 gm_format_bytes(cap, c, sizeof c), b->path,
                 gm_format_bytes(bytes, want, sizeof want),
                 gm_format_bytes(held, mine, sizeof mine),
                 gm_format_bytes(total > held ? total - held : 0, others, sizeof others));
}

bool gm_budget_has_room(const gpumem_t* gm, uint64_t bytes) {
  const gm_budget* b = gm->budget;
  if (!b->file) return bytes <= gm->opts.shared_limit; /* not attached yet: nothing taken */
  uint64_t total = atomic_load(&b->file->total);
  return bytes <= gm->opts.shared_limit && total <= gm->opts.shared_limit - bytes;
}

uint64_t gm_budget_others(const gpumem_t* gm) {
  const gm_budget* b = gm->budget;
  if (!b->file) return 0;
  uint64_t total = atomic_load(&b->file->total);
  uint64_t mine = b->pid == getpid() ? atomic_load(&b->file->slots[b->slot].bytes) : 0;
  return total > mine ? total - mine : 0;
}

void gm_budget_give(gpumem_t* gm, uint64_t bytes) {
  gm_budget* b = gm->budget;
  if (!b->file || b->pid != getpid()) return;
  atomic_fetch_sub(&b->file->slots[b->slot].bytes, bytes);
  atomic_fetch_sub(&b->file->total, bytes);
}

void gm_budget_destroy(gpumem_t* gm) {
  gm_budget* b = gm->budget;
  if (!b) return;
  if (b->file && b->pid == getpid()) {
    /* what teardown released without counting (arenas go whole) */
    uint64_t left = atomic_exchange(&b->file->slots[b->slot].bytes, 0);
    atomic_fetch_sub(&b->file->total, left);
    atomic_store(&b->file->slots[b->slot].pid, 0);
  }
  if (b->file) munmap(b->file, sizeof *b->file);
  free(b);
  gm->budget = NULL;
}

gpumem_status_t gpumem_shared_budget(gpumem_t* gm, gpumem_shared_budget_t* out) {
  if (!gm || !out)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_shared_budget: NULL argument");
  memset(out, 0, sizeof *out);
  out->struct_size = sizeof *out;
  gm_lock_acquire(&gm->lock);
  gm_budget* b = gm->budget;
  gpumem_status_t st = GPUMEM_OK;
  if (!b) {
    st = gm_fail(GPUMEM_ERR_UNSUPPORTED, "gpumem_shared_budget: no shared_limit is set");
  } else if (!b->file && (st = attach(gm, b)) != GPUMEM_OK) {
    /* attach said why */
  } else {
    budget_file* f = b->file;
    out->limit = gm->opts.shared_limit;
    out->total = atomic_load(&f->total);
    out->mine = b->pid == getpid() ? atomic_load(&f->slots[b->slot].bytes) : 0;
    for (int i = 0; i < BUDGET_SLOTS; i++) out->allocators += atomic_load(&f->slots[i].pid) != 0;
    snprintf(out->path, sizeof out->path, "%s", b->path);
  }
  gm_lock_release(&gm->lock);
  return st;
}
