/* Publication: each allocator's figures in a small file that other
 * processes map and read (`gpumem top`), so that memory can be watched
 * from outside the processes that hold it.
 *
 * One file per allocator, DIR/gpumem.<pid>.<instance>, DIR being
 * $GPUMEM_PUBLISH_DIR or /dev/shm (memory, not disk). The page is written
 * under the allocator's lock as a sequence lock: seq is odd while the
 * figures change, and a reader copies the page and keeps the copy only if
 * seq was even and unchanged around it. Writing costs ~20 stores, so the
 * hot path publishes one operation in 64, and at once whenever reserved
 * memory changed, after an out-of-memory failure, empty_cache or a new
 * limit: a reader is at most 63 allocations or frees behind on allocated
 * bytes and never behind on reserved ones. The file goes when the
 * allocator is destroyed or the process exits; a process that is killed
 * leaves it, and readers tell such a file by its process being gone
 * (gpumem top --clean removes it). A file that cannot be made turns
 * publication off for that allocator: it still allocates. */
#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"

#define PUBLISH_MAGIC 0x3162757070756d67ull /* "gmuppub1" */
#define PUBLISH_VERSION 1u
#define PUBLISH_PREFIX "gpumem."

struct gm_publication {
  uint64_t magic;
  uint32_t version;
  uint32_t size; /* of this struct: a reader refuses other layouts */
  _Atomic uint64_t seq;
  int32_t pid;
  int32_t device;
  uint32_t instance;
  uint32_t virtual_memory;
  char process[32];
  char policy[16];
  uint64_t started_unix_ms;
  uint64_t updated_unix_ms;
  int64_t allocated, allocated_peak;
  int64_t reserved, reserved_peak;
  int64_t active, requested;
  int64_t limit, device_total;
  int64_t num_allocations, num_ooms, num_alloc_retries;
};

static atomic_uint next_instance;

/* The files this process made, removed at exit: the per-device instances
 * that PyTorch and CuPy use are never destroyed, so without this every
 * process that ends normally would leave its file for readers to show as
 * exited (seen on the GPU machine: one per test process). A process that
 * is killed still leaves it (gpumem top --clean). Entries carry the pid
 * that made them: a forked child that exits must not remove its parent's
 * files. */
#define MAX_EXIT_FILES 64
static pthread_mutex_t exit_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;
static struct {
  char path[256];
  pid_t pid;
} exit_files[MAX_EXIT_FILES];

static void remove_at_exit(void) {
  pthread_mutex_lock(&exit_lock);
  for (int i = 0; i < MAX_EXIT_FILES; i++) {
    if (exit_files[i].path[0] && exit_files[i].pid == getpid()) unlink(exit_files[i].path);
    exit_files[i].path[0] = '\0';
  }
  pthread_mutex_unlock(&exit_lock);
}

static void register_at_exit(void) {
  atexit(remove_at_exit);
}

static void exit_file_add(const char* path) {
  pthread_once(&exit_once, register_at_exit);
  pthread_mutex_lock(&exit_lock);
  for (int i = 0; i < MAX_EXIT_FILES; i++) {
    if (!exit_files[i].path[0]) {
      snprintf(exit_files[i].path, sizeof exit_files[i].path, "%s", path);
      exit_files[i].pid = getpid();
      break;
    }
  }
  pthread_mutex_unlock(&exit_lock);
}

static void exit_file_remove(const char* path) {
  pthread_mutex_lock(&exit_lock);
  for (int i = 0; i < MAX_EXIT_FILES; i++) {
    if (strcmp(exit_files[i].path, path) == 0) exit_files[i].path[0] = '\0';
  }
  pthread_mutex_unlock(&exit_lock);
}

const char* gm_publish_dir(void) {
  const char* d = getenv("GPUMEM_PUBLISH_DIR");
  return d && d[0] ? d : "/dev/shm";
}

static uint64_t unix_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void process_name(char* out, size_t cap) {
  snprintf(out, cap, "?");
  FILE* f = fopen("/proc/self/comm", "r");
  if (!f) return;
  if (fgets(out, (int)cap, f)) out[strcspn(out, "\n")] = '\0';
  fclose(f);
}

bool gm_publish_wanted(const gpumem_t* gm) {
  if (gm->opts.publish == GPUMEM_PUBLISH_ON) return true;
  if (gm->opts.publish == GPUMEM_PUBLISH_OFF) return false;
  return gm->backend->name && strcmp(gm->backend->name, "cuda") == 0;
}

/* Makes the file and maps it; false (publication off) when it cannot. */
static bool publish_open(gpumem_t* gm) {
  unsigned instance = atomic_fetch_add(&next_instance, 1u);
  char path[sizeof gm->publish_path];
  int n = snprintf(path, sizeof path, "%s/" PUBLISH_PREFIX "%d.%u", gm_publish_dir(), (int)getpid(),
                   instance);
  if (n < 0 || (size_t)n >= sizeof path) return false;
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  struct gm_publication* page = MAP_FAILED;
  if (ftruncate(fd, (off_t)sizeof *page) == 0)
    page = mmap(NULL, sizeof *page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (page == MAP_FAILED) {
    unlink(path);
    return false;
  }
  memset(page, 0, sizeof *page);
  page->version = PUBLISH_VERSION;
  page->size = (uint32_t)sizeof *page;
  page->pid = (int32_t)getpid();
  page->device = gm->device_index;
  page->instance = instance;
  page->virtual_memory = gm->virtual_memory;
  process_name(page->process, sizeof page->process);
  snprintf(page->policy, sizeof page->policy, "%s",
           gm->opts.policy == GPUMEM_POLICY_PYTORCH ? "pytorch" : "default");
  page->started_unix_ms = unix_ms();
  /* the magic last: a reader ignores a page until it is whole */
  atomic_thread_fence(memory_order_release);
  page->magic = PUBLISH_MAGIC;
  gm->publication = page;
  memcpy(gm->publish_path, path, (size_t)n + 1);
  exit_file_add(path);
  return true;
}

void gm_publish_now(gpumem_t* gm) {
  if (!gm->publication) {
    if (gm->publish_failed || !publish_open(gm)) {
      gm->publish_failed = true;
      gm->publish_wanted = false;
      return;
    }
  }
  struct gm_publication* p = gm->publication;
  const gpumem_stats_t* s = &gm->stats;
  atomic_fetch_add_explicit(&p->seq, 1, memory_order_acq_rel); /* odd: changing */
  atomic_thread_fence(memory_order_release);
  p->device = gm->device_index;
  p->updated_unix_ms = unix_ms();
  p->allocated = s->allocated_bytes[GPUMEM_POOL_ALL].current;
  p->allocated_peak = s->allocated_bytes[GPUMEM_POOL_ALL].peak;
  p->reserved = s->reserved_bytes[GPUMEM_POOL_ALL].current;
  p->reserved_peak = s->reserved_bytes[GPUMEM_POOL_ALL].peak;
  p->active = s->active_bytes[GPUMEM_POOL_ALL].current;
  p->requested = s->requested_bytes[GPUMEM_POOL_ALL].current;
  p->limit = (int64_t)gm->limit;
  p->device_total = (int64_t)gm->device_total;
  p->num_allocations = s->allocation[GPUMEM_POOL_ALL].allocated;
  p->num_ooms = s->num_ooms;
  p->num_alloc_retries = s->num_alloc_retries;
  atomic_fetch_add_explicit(&p->seq, 1, memory_order_release); /* even: whole */
  gm->published_reserved = p->reserved;
  gm->publish_tick = 0;
}

void gm_publish_close(gpumem_t* gm) {
  if (!gm->publication) return;
  munmap(gm->publication, sizeof *gm->publication);
  unlink(gm->publish_path);
  exit_file_remove(gm->publish_path);
  gm->publication = NULL;
}

gpumem_status_t gpumem_publish(gpumem_t* gm) {
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_publish: NULL allocator");
  gm_lock_acquire(&gm->lock);
  gm_publish_if_wanted(gm);
  bool ok = gm->publication != NULL, failed = gm->publish_failed;
  gm_lock_release(&gm->lock);
  if (ok) return GPUMEM_OK;
  return gm_fail(GPUMEM_ERR_UNSUPPORTED, "gpumem_publish: %s",
                 failed ? "the publication file could not be made (see GPUMEM_PUBLISH_DIR)"
                        : "publication is off for this allocator (option publish)");
}

/* ---- reading ---- */

/* A consistent copy of the page at path; false when it is not one. */
static bool read_page(const char* path, struct gm_publication* out) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st;
  const struct gm_publication* p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && (size_t)st.st_size == sizeof *p)
    p = mmap(NULL, sizeof *p, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return false;
  bool ok = false;
  for (int tries = 0; tries < 1000 && !ok; tries++) {
    uint64_t before = atomic_load_explicit(&p->seq, memory_order_acquire);
    if (before & 1) continue;
    memcpy(out, (const void*)p, sizeof *out);
    atomic_thread_fence(memory_order_acquire);
    ok = atomic_load_explicit(&p->seq, memory_order_relaxed) == before;
  }
  munmap((void*)p, sizeof *p);
  return ok && out->magic == PUBLISH_MAGIC && out->version == PUBLISH_VERSION &&
         out->size == sizeof *out;
}

bool gm_process_alive(int pid) {
  return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
}

int gpumem_published_scan(const char* dir, gpumem_published_fn fn, void* arg) {
  if (!fn) {
    gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_published_scan: NULL fn");
    return -1;
  }
  if (!dir) dir = gm_publish_dir();
  DIR* d = opendir(dir);
  if (!d) {
    gm_fail(GPUMEM_ERR_IO, "gpumem_published_scan: cannot read %s: %s", dir, strerror(errno));
    return -1;
  }
  int found = 0;
  struct dirent* e;
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, PUBLISH_PREFIX, strlen(PUBLISH_PREFIX)) != 0) continue;
    gpumem_published_t out;
    memset(&out, 0, sizeof out);
    out.struct_size = (uint32_t)sizeof out;
    int n = snprintf(out.path, sizeof out.path, "%s/%s", dir, e->d_name);
    if (n < 0 || (size_t)n >= sizeof out.path) continue;
    struct gm_publication p;
    if (!read_page(out.path, &p)) continue;
    out.pid = p.pid;
    out.device = p.device;
    out.instance = p.instance;
    out.alive = gm_process_alive(p.pid);
    out.virtual_memory = (int)p.virtual_memory;
    memcpy(out.process, p.process, sizeof out.process);
    out.process[sizeof out.process - 1] = '\0';
    memcpy(out.policy, p.policy, sizeof out.policy);
    out.policy[sizeof out.policy - 1] = '\0';
    out.started_unix_ms = p.started_unix_ms;
    out.updated_unix_ms = p.updated_unix_ms;
    out.allocated_bytes = p.allocated;
    out.allocated_peak = p.allocated_peak;
    out.reserved_bytes = p.reserved;
    out.reserved_peak = p.reserved_peak;
    out.active_bytes = p.active;
    out.requested_bytes = p.requested;
    out.limit_bytes = p.limit;
    out.device_total = p.device_total;
    out.num_allocations = p.num_allocations;
    out.num_ooms = p.num_ooms;
    out.num_alloc_retries = p.num_alloc_retries;
    found++;
    if (fn(&out, arg) != 0) break;
  }
  closedir(d);
  return found;
}
