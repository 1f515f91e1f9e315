/* Safe files in shared directories, for publication (publish.c), shared
 * budgets (budget.c) and the out-of-memory post-mortem (history.c): made
 * with O_EXCL|O_NOFOLLOW so that a name another user planted (a link, a
 * FIFO, a file of theirs) is never opened for writing, read through
 * O_NOFOLLOW|O_NONBLOCK and fstat so that a reader skips what is not a
 * regular file of a trusted owner, and liveness told by locks the kernel
 * drops at a process's death (kill(pid, 0) is wrong across pid
 * namespaces: the pid in a file names another process, or none, in the
 * reader's). docs/security.md has the whole model. */
#include "shmfile.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

int gm_shm_create_at(int dir_fd, const char* name, mode_t mode) {
  int fd = openat(dir_fd, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) return -1;
  struct stat st;
  bool ok = fstat(fd, &st) == 0;
  int e = errno;
  if (ok && (!S_ISREG(st.st_mode) || st.st_uid != geteuid())) {
    ok = false;
    e = EPERM;
  }
  /* the umask may have taken bits the file needs (a group's budget) */
  if (ok && (st.st_mode & 07777) != mode && fchmod(fd, mode) != 0) {
    ok = false;
    e = errno;
  }
  if (!ok) {
    close(fd);
    unlinkat(dir_fd, name, 0);
    errno = e;
    return -1;
  }
  return fd;
}

bool gm_shm_owner_trusted(uid_t uid) {
  uid_t me = geteuid();
  return me == 0 || uid == me;
}

int gm_shm_open_read(const char* path, size_t want_size, struct stat* st) {
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return -1;
  if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode) || !gm_shm_owner_trusted(st->st_uid) ||
      (want_size && (size_t)st->st_size != want_size)) {
    close(fd);
    errno = EINVAL;
    return -1;
  }
  return fd;
}

static bool ofd_lock(int fd, int cmd, short type, off_t byte, off_t len, struct flock* out) {
  struct flock fl;
  memset(&fl, 0, sizeof fl); /* l_pid must be 0 for OFD locks */
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = len;
  int rc;
  do rc = fcntl(fd, cmd, &fl);
  while (rc != 0 && errno == EINTR);
  if (out) *out = fl;
  return rc == 0;
}

bool gm_life_lock(int fd, off_t byte) {
  return ofd_lock(fd, F_OFD_SETLK, F_WRLCK, byte, 1, NULL);
}

bool gm_life_lock_held(int fd, off_t byte) {
  struct flock fl;
  /* asks "could a write lock be taken?": any holder, of either kind, says no */
  return ofd_lock(fd, F_OFD_GETLK, F_WRLCK, byte, 1, &fl) && fl.l_type != F_UNLCK;
}

bool gm_range_lock(int fd, off_t byte, off_t len) {
  return ofd_lock(fd, F_OFD_SETLKW, F_WRLCK, byte, len, NULL);
}

void gm_range_unlock(int fd, off_t byte, off_t len) {
  ofd_lock(fd, F_OFD_SETLK, F_UNLCK, byte, len, NULL);
}

/* The descriptors that hold life locks. fork() copies a descriptor, and an
 * OFD lock lives while any copy of it is open: a child that outlived its
 * parent would keep the parent's slot or page alive. */
#define MAX_LIFE_FDS 256
static pthread_mutex_t life_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t life_once = PTHREAD_ONCE_INIT;
static int life_fds[MAX_LIFE_FDS];
static int life_count;

static void close_in_child(void) {
  /* the child has one thread; the mutex may have been held at fork */
  pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
  life_lock = fresh;
  for (int i = 0; i < life_count; i++) close(life_fds[i]);
  life_count = 0;
}

static void install_fork_handler(void) {
  pthread_atfork(NULL, NULL, close_in_child);
}

void gm_life_fd_register(int fd) {
  pthread_once(&life_once, install_fork_handler);
  pthread_mutex_lock(&life_lock);
  if (life_count < MAX_LIFE_FDS) life_fds[life_count++] = fd;
  pthread_mutex_unlock(&life_lock);
}

void gm_life_fd_unregister(int fd) {
  pthread_mutex_lock(&life_lock);
  for (int i = 0; i < life_count; i++) {
    if (life_fds[i] == fd) {
      life_fds[i] = life_fds[--life_count];
      break;
    }
  }
  pthread_mutex_unlock(&life_lock);
}

bool gm_pread_all(int fd, void* buf, size_t n, off_t off) {
  char* p = buf;
  while (n) {
    ssize_t got = pread(fd, p, n, off);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= (size_t)got;
    off += got;
  }
  return true;
}

bool gm_pwrite_all(int fd, const void* buf, size_t n, off_t off) {
  const char* p = buf;
  while (n) {
    ssize_t put = pwrite(fd, p, n, off);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put;
    n -= (size_t)put;
    off += put;
  }
  return true;
}
