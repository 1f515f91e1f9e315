/* Output files at paths a user names (a trace from option record, the
 * out-of-memory snapshot, `gpumem report -o`, `gpumem explain --snapshot`):
 * one way to make them, because such a path is often in a directory every
 * user can write (/tmp), where another user can plant a name first: a link
 * to a file of the victim's (which a plain fopen "w" would truncate and
 * overwrite, as root anywhere on the machine), or a file of their own
 * (which would receive the victim's data, and stay theirs to read).
 *
 * So the data goes to a new file made beside the target with
 * O_CREAT|O_EXCL|O_NOFOLLOW (nothing that exists is ever opened), mode
 * 0600 unless the caller asks otherwise, then renamed over the target: a
 * rename replaces a name, it never follows a link. Before that, what sits
 * at the target is checked and refused with the reason: a link, something
 * not a regular file, another user's file, a file other users can write, a
 * file with another name (a hard link: it would keep the old contents
 * under that name, or be a file of someone else's planted there). So is a
 * directory where someone else could swap the file after it is written:
 * one every user can write without the sticky bit, and one others can
 * write (sticky or not) that belongs to neither this user nor root, since
 * the sticky bit leaves a directory's owner free to rename any name in it.
 * docs/security.md. */
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* Why the name in dir_fd may not be replaced, or NULL (also when absent). */
static const char* target_refused(int dir_fd, const char* name, char* why, size_t cap) {
  struct stat st;
  if (fstatat(dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return NULL;
    snprintf(why, cap, "cannot look at it: %s", strerror(errno));
    return why;
  }
  if (S_ISLNK(st.st_mode))
    return "it is a symbolic link, and gpumem never writes through one; remove it or choose "
           "a path in a directory of your own";
  if (!S_ISREG(st.st_mode)) return "it exists and is not a regular file";
  if (st.st_uid != geteuid()) {
    snprintf(why, cap,
             "it belongs to uid %u, not to this user (uid %u); its owner or root can remove it, "
             "or choose a path in a directory of your own",
             (unsigned)st.st_uid, (unsigned)geteuid());
    return why;
  }
  if (st.st_nlink != 1) {
    snprintf(why, cap, "it has %lu hard links (another name of the same file); remove it first",
             (unsigned long)st.st_nlink);
    return why;
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    snprintf(why, cap, "other users can write it (mode %04o); remove it first",
             (unsigned)(st.st_mode & 07777));
    return why;
  }
  return NULL;
}

/* "65534 (nobody)", or the uid alone when it has no name. */
static const char* owner_name(uid_t uid, char* buf, size_t cap) {
  struct passwd pw, *found = NULL;
  char records[1024];
  if (getpwuid_r(uid, &pw, records, sizeof records, &found) == 0 && found && found->pw_name)
    snprintf(buf, cap, "%u (%s)", (unsigned)uid, found->pw_name);
  else
    snprintf(buf, cap, "%u", (unsigned)uid);
  return buf;
}

/* Why a file in the directory described by st could be swapped by someone
 * else after it is written, or NULL. dir names it in the reason. */
static const char* directory_refused(const struct stat* st, const char* dir, char* why,
                                     size_t cap) {
  unsigned mode = (unsigned)(st->st_mode & 07777);
  if ((st->st_mode & S_IWOTH) && !(st->st_mode & S_ISVTX)) {
    snprintf(why, cap,
             "its directory %s can be written by every user and is not sticky (mode %04o): "
             "anyone could replace the file",
             dir, mode);
    return why;
  }
  /* The sticky bit keeps other users from renaming this user's file, but
   * not the directory's owner: one who is neither this user nor root, in
   * a directory others can write (so this user could make a file there),
   * could rename the finished file away and put their own in its place. */
  if ((st->st_mode & (S_IWGRP | S_IWOTH)) && st->st_uid != geteuid() && st->st_uid != 0) {
    char owner[160];
    snprintf(why, cap,
             "its directory %s belongs to uid %s, not to this user (uid %u) or root, and others "
             "can write it (mode %04o): its owner could replace the file after it is written; "
             "choose a path in a directory of your own",
             dir, owner_name(st->st_uid, owner, sizeof owner), (unsigned)geteuid(), mode);
    return why;
  }
  return NULL;
}

int gm_outfile_open(gm_outfile* o, const char* path, mode_t mode, char* why, size_t cap) {
  memset(o, 0, sizeof *o);
  o->dir_fd = -1;
  size_t len = path ? strlen(path) : 0;
  if (len == 0 || len >= sizeof o->path) {
    snprintf(why, cap, "cannot write '%s': the path must be 1 to %zu bytes long",
             path ? path : "(null)", sizeof o->path - 1);
    return -1;
  }
  memcpy(o->path, path, len + 1);
  const char* slash = strrchr(path, '/');
  const char* name = slash ? slash + 1 : path;
  if (!*name || strcmp(name, ".") == 0 || strcmp(name, "..") == 0 ||
      strlen(name) >= sizeof o->name) {
    snprintf(why, cap, "cannot write %s: it does not name a file", path);
    return -1;
  }
  memcpy(o->name, name, strlen(name) + 1);
  char dir[sizeof o->path];
  if (!slash) {
    strcpy(dir, ".");
  } else if (slash == path) {
    strcpy(dir, "/");
  } else {
    memcpy(dir, path, (size_t)(slash - path));
    dir[slash - path] = '\0';
  }
  o->dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (o->dir_fd < 0) {
    snprintf(why, cap, "cannot write %s: cannot open its directory %s: %s", path, dir,
             strerror(errno));
    return -1;
  }
  struct stat st;
  char reason[1400]; /* names the directory, up to a path's length */
  const char* bad = NULL;
  if (fstat(o->dir_fd, &st) != 0) {
    snprintf(reason, sizeof reason, "cannot look at its directory: %s", strerror(errno));
    bad = reason;
  } else {
    bad = directory_refused(&st, dir, reason, sizeof reason);
    if (!bad) bad = target_refused(o->dir_fd, o->name, reason, sizeof reason);
  }
  if (bad) {
    snprintf(why, cap, "refusing to write %s: %s", path, bad);
    gm_outfile_abandon(o);
    return -1;
  }
  /* A fresh hidden name beside the target: O_EXCL makes a name planted
   * first (by a guess at the suffix) a retry, never a file to write. */
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  unsigned long long seed =
      (unsigned long long)ts.tv_nsec ^ ((unsigned long long)getpid() << 20) ^ (uintptr_t)o;
  int fd = -1, err = EEXIST;
  for (int tries = 0; tries < 100 && fd < 0 && err == EEXIST; tries++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    snprintf(o->tmp, sizeof o->tmp, ".%.200s.%012llx", o->name, (seed >> 16) & 0xffffffffffffull);
    fd = openat(o->dir_fd, o->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    err = fd < 0 ? errno : 0;
  }
  if (fd < 0) {
    o->tmp[0] = '\0';
    snprintf(why, cap, "cannot write %s: cannot make a file in its directory: %s", path,
             strerror(err));
    gm_outfile_abandon(o);
    return -1;
  }
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      ((st.st_mode & 07777) != mode && fchmod(fd, mode) != 0)) {
    snprintf(why, cap, "cannot write %s: the new file beside it is not as made", path);
    close(fd);
    gm_outfile_abandon(o);
    return -1;
  }
  return fd;
}

bool gm_outfile_commit(gm_outfile* o, char* why, size_t cap) {
  if (o->dir_fd < 0 || !o->tmp[0]) {
    snprintf(why, cap, "cannot write %s: not opened", o->path);
    return false;
  }
  /* checked again: a name planted while the file was written is refused
   * too (the rename would not follow it, but would hide a squatter's
   * attempt) */
  char reason[300];
  const char* bad = target_refused(o->dir_fd, o->name, reason, sizeof reason);
  if (bad) {
    snprintf(why, cap, "refusing to write %s: %s", o->path, bad);
    gm_outfile_abandon(o);
    return false;
  }
  if (renameat(o->dir_fd, o->tmp, o->dir_fd, o->name) != 0) {
    int e = errno;
    snprintf(why, cap, "cannot write %s: %s%s", o->path, strerror(e),
             e == EPERM || e == EACCES ? " (the name is another user's)" : "");
    gm_outfile_abandon(o);
    return false;
  }
  o->tmp[0] = '\0';
  close(o->dir_fd);
  o->dir_fd = -1;
  return true;
}

void gm_outfile_abandon(gm_outfile* o) {
  if (o->dir_fd >= 0) {
    if (o->tmp[0]) unlinkat(o->dir_fd, o->tmp, 0);
    close(o->dir_fd);
  }
  o->tmp[0] = '\0';
  o->dir_fd = -1;
}
