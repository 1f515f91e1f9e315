/* Publication: each allocator's figures in a small file that other
 * processes read (`gpumem top`), so that memory can be watched from
 * outside the processes that hold it.
 *
 * One file per allocator, DIR/gpumem.<pid>.<instance>, DIR being
 * $GPUMEM_PUBLISH_DIR or /dev/shm (memory, not disk). The file is made
 * afresh (O_EXCL|O_NOFOLLOW, mode 0600: its user's alone; a name someone
 * else holds is passed over for the next instance number), so no other
 * user can point it elsewhere, read it or truncate it under the mapping
 * (docs/security.md). The writer maps it; the page is written under the
 * allocator's lock as a sequence lock: seq is odd while the figures
 * change, and a reader copies the page and keeps the copy only if seq was
 * even and unchanged around it. Readers copy with pread, never a mapping,
 * so a file truncated under them is a short read, not SIGBUS. Writing
 * costs ~20 stores, so the hot path publishes one operation in 64, and at
 * once whenever reserved memory changed, after an out-of-memory failure,
 * empty_cache or a new limit: a reader is at most 63 allocations or frees
 * behind on allocated bytes and never behind on reserved ones.
 *
 * The writer holds a lock on the file's first byte for its life (an OFD
 * lock, shmfile.h): readers tell a live writer by that lock, which the
 * kernel drops when the process dies, in whatever pid namespace. The file
 * goes when the allocator is destroyed or the process exits; a process
 * that is killed leaves it, shown as exited (gpumem top --clean removes
 * it). A file that cannot be made turns publication off for that
 * allocator: it still allocates. */
#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <inttypes.h>
#include <stddef.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"
#include "shmfile.h"

#define PUBLISH_MAGIC 0x3162757070756d67ull /* "gmuppub1" */
#define PUBLISH_VERSION 3u /* 2: liveness by the writer's lock; 3: the overflow tier */
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
  int64_t host_bytes, num_moves_to_host, num_moves_to_device; /* the overflow tier */
};

#define PUBLISH_READ_TRIES 4

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

/* Instance numbers a process tries before publication gives up: names
 * another user planted are passed over, not opened. */
#define PUBLISH_NAME_TRIES 16

/* Makes the file and maps it; false (publication off) when it cannot. */
static bool publish_open(gpumem_t* gm) {
  char path[sizeof gm->publish_path];
  unsigned instance = 0;
  int fd = -1, n = 0;
  for (int tries = 0; fd < 0 && tries < PUBLISH_NAME_TRIES; tries++) {
    instance = atomic_fetch_add(&next_instance, 1u);
    n = snprintf(path, sizeof path, "%s/" PUBLISH_PREFIX "%d.%u", gm_publish_dir(), (int)getpid(),
                 instance);
    if (n < 0 || (size_t)n >= sizeof path) return false;
    fd = gm_shm_create_at(AT_FDCWD, path, 0600);
    if (fd < 0 && errno != EEXIST) return false;
  }
  if (fd < 0) return false;
  struct gm_publication* page = MAP_FAILED;
  if (ftruncate(fd, (off_t)sizeof *page) == 0 && gm_life_lock(fd, 0))
    page = mmap(NULL, sizeof *page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (page == MAP_FAILED) {
    close(fd);
    unlink(path);
    return false;
  }
  gm_life_fd_register(fd);
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
  gm->publish_fd = fd;
  gm->publish_pid = (int)getpid();
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
  p->host_bytes = s->host_bytes[GPUMEM_POOL_ALL].current;
  p->num_moves_to_host = s->num_moves_to_host;
  p->num_moves_to_device = s->num_moves_to_device;
  atomic_fetch_add_explicit(&p->seq, 1, memory_order_release); /* even: whole */
  gm->published_reserved = p->reserved;
  gm->publish_tick = 0;
}

void gm_publish_close(gpumem_t* gm) {
  if (!gm->publication) return;
  munmap(gm->publication, sizeof *gm->publication);
  if (gm->publish_pid == (int)getpid()) {
    /* a forked child's copy of the descriptor was closed at the fork */
    unlink(gm->publish_path);
    gm_life_fd_unregister(gm->publish_fd);
    close(gm->publish_fd);
  }
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

/* A consistent copy of the page at path, *alive set by the writer's
 * lock; false when it is not one. The file is not trusted: it may be a
 * link, a FIFO, another user's, or shrink while read (docs/security.md). */
static bool read_page(const char* path, struct gm_publication* out, bool* alive, uid_t* owner) {
  struct stat st;
  int fd = gm_shm_open_read(path, sizeof *out, &st);
  if (fd < 0) return false;
  bool ok = false;
  const off_t seq_at = (off_t)offsetof(struct gm_publication, seq);
  /* A few tries: a writer holds its sequence odd for a few stores, so a
   * page that stays odd or changing is skipped this refresh. Another user
   * can plant thousands of pages held odd; a bounded time per file keeps
   * root's refresh from taking seconds per thousand of them. */
  for (int tries = 0; tries < PUBLISH_READ_TRIES && !ok; tries++) {
    uint64_t before = 0, after = 0;
    if (tries) sched_yield();
    if (!gm_pread_all(fd, &before, sizeof before, seq_at)) break;
    if (before & 1) continue;
    if (!gm_pread_all(fd, out, sizeof *out, 0)) break;
    if (!gm_pread_all(fd, &after, sizeof after, seq_at)) break;
    ok = after == before;
  }
  *alive = ok && gm_life_lock_held(fd, 0);
  *owner = st.st_uid;
  close(fd);
  return ok && out->magic == PUBLISH_MAGIC && out->version == PUBLISH_VERSION &&
         out->size == sizeof *out;
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
    bool alive = false;
    uid_t owner = 0;
    if (!read_page(out.path, &p, &alive, &owner)) continue;
    out.pid = p.pid;
    out.uid = (unsigned)owner;
    out.device = p.device;
    out.instance = p.instance;
    out.alive = alive;
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
    out.host_bytes = p.host_bytes;
    out.num_moves_to_host = p.num_moves_to_host;
    out.num_moves_to_device = p.num_moves_to_device;
    found++;
    if (fn(&out, arg) != 0) break;
  }
  closedir(d);
  return found;
}
