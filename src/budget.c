/* Shared budgets: one cap on the reserved memory of every allocator, in any
 * process on this machine, that names the same budget on the same device
 * (options shared_limit and shared_name): several jobs on one GPU that
 * together must leave room for something else, or must not starve each
 * other.
 *
 * The budget is a file: DIR/gpumem-budget.u<uid>.<name>.<device>, mode
 * 0600, for one user's processes (DIR as for publication:
 * $GPUMEM_PUBLISH_DIR or /dev/shm), or, with option shared_group,
 * DIR/gpumem-group.<group>/gpumem-budget.<name>.<device>, mode 0660, for a
 * group's. It holds a slot per allocator (its pid and the bytes it holds);
 * the file is read and written with pread/pwrite, never mapped, so one
 * who truncates it makes a take fail with a message, not SIGBUS.
 *
 * Each allocator holds a lock on one byte of its slot for its life (an OFD
 * lock, shmfile.h), taken when it claims the slot: the kernel drops it
 * when the process dies, in whatever pid namespace, so a slot counts
 * exactly while its holder lives, with no pid to misjudge. A take, under a
 * lock on the file's header, sums the bytes of the slots whose lock is
 * held (zeroing the others: the driver freed a dead process's memory
 * itself), refuses to pass the cap, and writes the allocator's own slot.
 * No total is stored, so none can drift, wrap or be set by hand; an
 * allocator's own bytes live in its memory, and a release never takes
 * more than it holds. A refusal is a limit: the allocator reclaims and
 * empties its cache as it does at its own limit, then reports out of
 * memory naming the budget and who holds it. Each allocator checks
 * against its own shared_limit: give every process the same value.
 *
 * A file that is not a budget, or one another user (outside the group)
 * made or could write, is refused with a message naming it and saying
 * how to clear it (docs/security.md). */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <pwd.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine.h"
#include "shmfile.h"

#define BUDGET_MAGIC 0x3274656762646d67ull /* "gmdbget2" */
#define BUDGET_VERSION 2u
#define BUDGET_SLOTS 120
/* Lock bytes lie past the file's end (a lock may cover bytes a file does
 * not have): one for the header, one per slot. */
#define BUDGET_LOCK_HEADER ((off_t)1 << 20)
#define BUDGET_LOCK_SLOT(i) (BUDGET_LOCK_HEADER + 1 + (off_t)(i))

typedef struct budget_slot {
  int32_t pid; /* for messages only: liveness is the slot's lock */
  uint32_t uid;
  uint64_t bytes;
} budget_slot;

typedef struct budget_file {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t reserved_for_later[2];
  budget_slot slots[BUDGET_SLOTS];
} budget_file;

struct gm_budget {
  int fd;         /* -1 until the first take */
  int slot;       /* whose lock this allocator holds */
  pid_t pid;      /* the process that attached */
  uint64_t mine;  /* bytes this allocator holds: its slot's truth */
  char path[300]; /* as gpumem_shared_budget_t reports it */
};

gpumem_status_t gm_budget_init(gpumem_t* gm) {
  if (!gm->opts.shared_limit) return GPUMEM_OK;
  gm->budget = calloc(1, sizeof *gm->budget);
  if (!gm->budget) return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem: out of host memory");
  gm->budget->slot = -1;
  gm->budget->fd = -1;
  return GPUMEM_OK;
}

static uint64_t add_capped(uint64_t a, uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

/* Whether files owned by uid may hold the group's budget: this user's, root's,
 * or a member's by the group database (primary group or listed member). A
 * user outside the group who owns the directory or a file in it can
 * rewrite or swap what members trust, whatever its group and mode say. */
static bool trusted_in_group(uid_t uid, const struct group* gr) {
  if (uid == 0 || uid == geteuid()) return true;
  struct passwd pw, *found = NULL;
  char buf[16384];
  if (getpwuid_r(uid, &pw, buf, sizeof buf, &found) != 0 || !found) return false;
  if (pw.pw_gid == gr->gr_gid) return true;
  for (char** m = gr->gr_mem; m && *m; m++)
    if (strcmp(*m, pw.pw_name) == 0) return true;
  return false;
}

/* The group's directory, made (setgid and sticky, closed to others) when
 * it is missing, and checked when it is not: a directory, not a link, of
 * the group, not writable by other users, owned by root or a member. Returns its descriptor or -1
 * with the failure reported. */
static int open_group_dir(const char* path, const struct group* gr) {
  gid_t gid = gr->gr_gid;
  const char* group = gr->gr_name;
  int dfd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0 && errno == ENOENT && mkdir(path, 0700) == 0) {
    dfd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd >= 0 && (fchown(dfd, (uid_t)-1, gid) != 0 || fchmod(dfd, 03770) != 0)) {
      int e = errno;
      close(dfd);
      rmdir(path);
      gm_fail(GPUMEM_ERR_BACKEND,
              "gpumem shared budget: cannot give %s to group %s (%s): is this user a member?", path,
              group, strerror(e));
      return -1;
    }
  }
  if (dfd < 0) {
    gm_fail(GPUMEM_ERR_BACKEND, "gpumem shared budget: cannot open the directory %s: %s%s", path,
            strerror(errno), errno == ELOOP || errno == ENOTDIR ? " (not a directory)" : "");
    return -1;
  }
  struct stat st;
  if (fstat(dfd, &st) != 0 || st.st_gid != gid || (st.st_mode & S_IWOTH)) {
    close(dfd);
    gm_fail(GPUMEM_ERR_BACKEND,
            "gpumem shared budget: the directory %s is not group %s's alone (group %u, mode "
            "%04o): gpumem uses a group budget only in a directory of that group that other "
            "users cannot write; ask its owner or root to fix it (chgrp %s %s; chmod 3770 %s)",
            path, group, (unsigned)st.st_gid, (unsigned)(st.st_mode & 07777), group, path, path);
    return -1;
  }
  if (!trusted_in_group(st.st_uid, gr)) {
    close(dfd);
    gm_fail(GPUMEM_ERR_BACKEND,
            "gpumem shared budget: the directory %s belongs to uid %u, who is not root nor a "
            "member of group %s: its owner could change any budget in it; ask root to give it "
            "to root (chown root %s) or remove it",
            path, (unsigned)st.st_uid, group, path);
    return -1;
  }
  return dfd;
}

/* Why fd's file is not one this process may use as its budget, or NULL. */
static const char* untrusted(const struct stat* st, const struct group* gr, char* why, size_t cap) {
  bool grouped = gr != NULL;
  if (!S_ISREG(st->st_mode)) return "it is not a regular file";
  /* another name of a file (a hard link made where protected_hardlinks is
   * off): adopting it would rewrite the file under its other name */
  if (st->st_nlink != 1) {
    snprintf(why, cap,
             "it has %lu hard links (another name of some file), and gpumem never uses one as "
             "a budget",
             (unsigned long)st->st_nlink);
    return why;
  }
  if (grouped && !trusted_in_group(st->st_uid, gr)) {
    snprintf(why, cap,
             "it belongs to uid %u, who is not root nor a member of group %s, and gpumem never "
             "uses a budget an outsider made",
             (unsigned)st->st_uid, gr->gr_name);
    return why;
  }
  if (!grouped && st->st_uid != geteuid()) {
    snprintf(why, cap,
             "it belongs to uid %u, not to this user (uid %u), and gpumem never uses a budget "
             "another user made",
             (unsigned)st->st_uid, (unsigned)geteuid());
    return why;
  }
  if (!grouped && (st->st_mode & 077)) {
    snprintf(why, cap, "other users can open it (mode %04o)", (unsigned)(st->st_mode & 07777));
    return why;
  }
  if (grouped && (st->st_gid != gr->gr_gid || (st->st_mode & 07))) {
    snprintf(why, cap, "it is not the group's alone (group %u, mode %04o)", (unsigned)st->st_gid,
             (unsigned)(st->st_mode & 07777));
    return why;
  }
  return NULL;
}

/* The whole file, checked: false with the failure reported. */
static bool read_budget(gm_budget* b, budget_file* f) {
  struct stat st;
  if (fstat(b->fd, &st) == 0 && (size_t)st.st_size == sizeof *f &&
      gm_pread_all(b->fd, f, sizeof *f, 0) && f->magic == BUDGET_MAGIC &&
      f->version == BUDGET_VERSION && f->size == sizeof *f)
    return true;
  gm_fail(GPUMEM_ERR_BACKEND,
          "gpumem shared budget: %s is not a budget of this gpumem (%lld bytes, of %zu; "
          "corrupted, truncated or of another version): when no process uses the budget, "
          "remove it (rm %s)",
          b->path, (long long)st.st_size, sizeof *f, b->path);
  return false;
}

static bool write_slot(gm_budget* b, const budget_slot* s) {
  return gm_pwrite_all(b->fd, s, sizeof *s,
                       (off_t)(offsetof(budget_file, slots) + (size_t)b->slot * sizeof *s));
}

/* What the other allocators hold: the slots whose lock is held. With
 * repair (the header locked), slots nobody holds are zeroed. */
static uint64_t others_held(gm_budget* b, budget_file* f, bool repair, int* live) {
  uint64_t sum = 0;
  for (int i = 0; i < BUDGET_SLOTS; i++) {
    budget_slot* s = &f->slots[i];
    if (i == b->slot || (!s->bytes && !s->pid)) continue;
    if (gm_life_lock_held(b->fd, BUDGET_LOCK_SLOT(i))) {
      sum = add_capped(sum, s->bytes);
      if (live) ++*live;
    } else if (repair) {
      budget_slot none = {0, 0, 0};
      gm_pwrite_all(b->fd, &none, sizeof none,
                    (off_t)(offsetof(budget_file, slots) + (size_t)i * sizeof none));
    }
  }
  return sum;
}

static gpumem_status_t attach(gpumem_t* gm, gm_budget* b) {
  const char* name = gm->opts.shared_name[0] ? gm->opts.shared_name : "default";
  const char* group = gm->opts.shared_group;
  bool grouped = group[0] != '\0';
  char file[128], dir_path[300];
  int dir_fd = -1, n;
  gid_t gid = 0;
  struct group gr, *found = NULL;
  char grbuf[16384];
  if (grouped) {
    if (getgrnam_r(group, &gr, grbuf, sizeof grbuf, &found) != 0 || !found) {
      return gm_fail(GPUMEM_ERR_BACKEND, "gpumem shared budget: no group named %s (shared_group)",
                     group);
    }
    gid = gr.gr_gid;
    n = snprintf(dir_path, sizeof dir_path, "%s/gpumem-group.%s", gm_publish_dir(), group);
    snprintf(file, sizeof file, "gpumem-budget.%s.%d", name, gm->device_index);
  } else {
    n = snprintf(dir_path, sizeof dir_path, "%s", gm_publish_dir());
    snprintf(file, sizeof file, "gpumem-budget.u%u.%s.%d", (unsigned)geteuid(), name,
             gm->device_index);
  }
  int whole = n < 0 || (size_t)n >= sizeof dir_path
                  ? -1
                  : snprintf(b->path, sizeof b->path, "%s/%s", dir_path, file);
  if (whole < 0 || (size_t)whole >= sizeof b->path) {
    b->path[0] = '\0';
    return gm_fail(GPUMEM_ERR_BACKEND,
                   "gpumem shared budget: the budget's path (in %s) would pass %zu bytes: "
                   "choose a shorter GPUMEM_PUBLISH_DIR",
                   gm_publish_dir(), sizeof b->path - 1);
  }
  if (grouped) {
    dir_fd = open_group_dir(dir_path, &gr);
    if (dir_fd < 0) return GPUMEM_ERR_BACKEND;
  } else if ((dir_fd = open(dir_path, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
    return gm_fail(GPUMEM_ERR_BACKEND, "gpumem shared budget: cannot open the directory %s: %s",
                   dir_path, strerror(errno));
  }
  int fd = gm_shm_create_at(dir_fd, file, grouped ? 0660 : 0600);
  if (fd >= 0 && grouped && fchown(fd, (uid_t)-1, gid) != 0) {
    close(fd);
    fd = -1;
  }
  if (fd < 0 && errno == EEXIST)
    fd = openat(dir_fd, file, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  int open_errno = errno;
  close(dir_fd);
  errno = open_errno;
  if (fd < 0) {
    int e = errno;
    return gm_fail(
        GPUMEM_ERR_BACKEND, "gpumem shared budget: cannot open %s: %s%s", b->path, strerror(e),
        e == ELOOP    ? " (a symbolic link: gpumem never opens a budget through one; "
                        "remove it)"
        : e == EACCES ? " (another user's file: gpumem never uses one; its owner or root "
                        "can remove it, or set GPUMEM_PUBLISH_DIR to a directory of your own)"
                      : "");
  }
  struct stat st;
  char why[300];
  const char* bad =
      fstat(fd, &st) != 0 ? strerror(errno) : untrusted(&st, grouped ? &gr : NULL, why, sizeof why);
  if (bad) {
    close(fd);
    return gm_fail(GPUMEM_ERR_BACKEND,
                   "gpumem shared budget: refusing %s: %s; its owner or root can remove it (rm "
                   "%s), or set GPUMEM_PUBLISH_DIR to a directory of your own",
                   b->path, bad, b->path);
  }
  b->fd = fd;
  gm_range_lock(fd, BUDGET_LOCK_HEADER, 1);
  /* a file just made (by this process or one racing it) is empty */
  budget_file f;
  bool fresh = fstat(fd, &st) == 0 && st.st_size == 0;
  if (fresh) {
    memset(&f, 0, sizeof f);
    f.magic = BUDGET_MAGIC;
    f.version = BUDGET_VERSION;
    f.size = sizeof f;
    if (ftruncate(fd, sizeof f) != 0 || !gm_pwrite_all(fd, &f, sizeof f, 0)) fresh = false;
  }
  gpumem_status_t result = GPUMEM_OK;
  if (!read_budget(b, &f)) {
    result = GPUMEM_ERR_BACKEND;
  } else {
    for (int i = 0; i < BUDGET_SLOTS && b->slot < 0; i++) {
      if (gm_life_lock(fd, BUDGET_LOCK_SLOT(i))) b->slot = i;
    }
    budget_slot s = {(int32_t)getpid(), (uint32_t)geteuid(), 0};
    if (b->slot < 0) {
      result = gm_fail(GPUMEM_ERR_BACKEND,
                       "gpumem shared budget: all %d allocator slots of %s are held by live "
                       "processes",
                       BUDGET_SLOTS, b->path);
    } else if (!write_slot(b, &s)) {
      result = gm_fail(GPUMEM_ERR_BACKEND, "gpumem shared budget: cannot write %s: %s", b->path,
                       strerror(errno));
    }
  }
  gm_range_unlock(fd, BUDGET_LOCK_HEADER, 1);
  if (result != GPUMEM_OK) {
    close(fd); /* drops the slot's lock too */
    b->fd = -1;
    b->slot = -1;
    return result;
  }
  gm_life_fd_register(fd);
  b->pid = getpid();
  b->mine = 0;
  return GPUMEM_OK;
}

static gpumem_status_t attached_here(gpumem_t* gm, gm_budget* b) {
  if (b->fd < 0) return attach(gm, b);
  if (b->pid != getpid()) {
    return gm_fail(GPUMEM_ERR_UNSUPPORTED,
                   "gpumem shared budget: this allocator was made in process %d and is used "
                   "in %d, its fork: the budget counts an allocator in one process only",
                   (int)b->pid, (int)getpid());
  }
  return GPUMEM_OK;
}

gpumem_status_t gm_budget_take(gpumem_t* gm, uint64_t bytes) {
  gm_budget* b = gm->budget;
  gpumem_status_t st = attached_here(gm, b);
  if (st != GPUMEM_OK) return st;
  uint64_t cap = gm->opts.shared_limit;
  budget_file f;
  gm_range_lock(b->fd, BUDGET_LOCK_HEADER, 1);
  if (!read_budget(b, &f)) {
    gm_range_unlock(b->fd, BUDGET_LOCK_HEADER, 1);
    return GPUMEM_ERR_BACKEND;
  }
  int live = 0;
  uint64_t others = others_held(b, &f, true, &live);
  uint64_t total = add_capped(others, b->mine);
  bool fits = bytes <= cap && total <= cap - bytes;
  if (fits) {
    budget_slot s = {(int32_t)getpid(), (uint32_t)geteuid(), b->mine + bytes};
    if (!write_slot(b, &s)) {
      gm_range_unlock(b->fd, BUDGET_LOCK_HEADER, 1);
      return gm_fail(GPUMEM_ERR_BACKEND, "gpumem shared budget: cannot write %s: %s", b->path,
                     strerror(errno));
    }
    b->mine += bytes;
  }
  gm_range_unlock(b->fd, BUDGET_LOCK_HEADER, 1);
  if (fits) return GPUMEM_OK;
  char c[32], mine[32], other[32], want[32];
  return gm_fail(GPUMEM_ERR_OUT_OF_MEMORY,
                 "the shared limit of %s (budget %s) is reached: %s more would pass it; this "
                 "allocator holds %s of it, other allocators %s (%d live)",
                 gm_format_bytes(cap, c, sizeof c), b->path,
                 gm_format_bytes(bytes, want, sizeof want),
                 gm_format_bytes(b->mine, mine, sizeof mine),
                 gm_format_bytes(others, other, sizeof other), live);
}

/* What the other allocators hold now, read without the header lock (an
 * estimate for decisions and messages; takes decide under the lock). */
static uint64_t others_now(const gm_budget* b, int* live) {
  budget_file f;
  if (b->fd < 0 || b->pid != getpid() || !gm_pread_all(b->fd, &f, sizeof f, 0) ||
      f.magic != BUDGET_MAGIC)
    return 0;
  return others_held((gm_budget*)b, &f, false, live);
}

bool gm_budget_has_room(const gpumem_t* gm, uint64_t bytes) {
  const gm_budget* b = gm->budget;
  uint64_t cap = gm->opts.shared_limit;
  uint64_t total = add_capped(others_now(b, NULL), b->fd >= 0 ? b->mine : 0);
  return bytes <= cap && total <= cap - bytes;
}

uint64_t gm_budget_others(const gpumem_t* gm) {
  return others_now(gm->budget, NULL);
}

void gm_budget_give(gpumem_t* gm, uint64_t bytes) {
  gm_budget* b = gm->budget;
  if (b->fd < 0 || b->pid != getpid()) return;
  b->mine = bytes > b->mine ? 0 : b->mine - bytes; /* never wraps */
  budget_slot s = {(int32_t)getpid(), (uint32_t)geteuid(), b->mine};
  gm_range_lock(b->fd, BUDGET_LOCK_HEADER, 1);
  write_slot(b, &s);
  gm_range_unlock(b->fd, BUDGET_LOCK_HEADER, 1);
}

void gm_budget_destroy(gpumem_t* gm) {
  gm_budget* b = gm->budget;
  if (!b) return;
  /* in a forked child the descriptor was closed at the fork */
  if (b->fd >= 0 && b->pid == getpid()) {
    budget_slot none = {0, 0, 0};
    gm_range_lock(b->fd, BUDGET_LOCK_HEADER, 1);
    write_slot(b, &none);
    gm_range_unlock(b->fd, BUDGET_LOCK_HEADER, 1);
    gm_life_fd_unregister(b->fd);
    close(b->fd);
  }
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
  } else if ((st = attached_here(gm, b)) != GPUMEM_OK) {
    /* attach said why */
  } else {
    int live = 0;
    uint64_t others = others_now(b, &live);
    out->limit = gm->opts.shared_limit;
    out->mine = b->mine;
    out->total = add_capped(others, b->mine);
    out->allocators = live + 1;
    snprintf(out->path, sizeof out->path, "%s", b->path);
  }
  gm_lock_release(&gm->lock);
  return st;
}
