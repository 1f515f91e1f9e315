/* Files in shared directories against a hostile local user (the trust
 * model of docs/security.md): every attack of the audit, each shown to
 * leave files outside gpumem's own untouched, to cause no crash or hang,
 * and to be refused or repaired with a message that names the file.
 *
 * The directory stands in for /dev/shm (mode 1777, GPUMEM_PUBLISH_DIR).
 * The attacker is a forked child that drops to an unused uid (60001;
 * 60002 and 60003 are more users), so the attacks that need a second user
 * run only as root; without root they are skipped, saying so. Where pid
 * namespaces can be made (unshare, as root) a process in one shares a
 * budget and a publication with the host. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <pthread.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shmfile.h"
#include "test_util.h"

/* The size of a published page (src/publish.c): the figures of one allocator. */
#define PUB_PAGE 216

#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)
#define ATTACKER 60001
#define OTHER 60002
#define OUTSIDER 60003

static char dir[128];  /* the shared directory, mode 1777 */
static char safe[128]; /* files the attacker aims at, root's alone */
static bool root;

/* The budget's layout (src/budget.c), for writing over it as a corrupt
 * or hostile writer would. */
#define SLOTS_AT 32
#define SLOT_SIZE 16
#define BUDGET_SIZE (SLOTS_AT + 120 * SLOT_SIZE)

static const char* why_no_second_user = "needs root (to act as a second user)";

static void skip(const char* what) {
  printf("test_hostile: SKIPPED %s: %s\n", what, why_no_second_user);
}

/* In a child: become uid (group gid, supplementary groups), or die. */
static void become(uid_t uid, gid_t gid, int ngroups, const gid_t* groups) {
  if (setgroups((size_t)ngroups, groups) != 0 || setresgid(gid, gid, gid) != 0 ||
      setresuid(uid, uid, uid) != 0)
    _exit(99);
}

static int wait_child(pid_t pid) {
  int status = 0;
  if (pid <= 0 || waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void write_file(const char* path, const char* text) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd >= 0) {
    CHECK(write(fd, text, strlen(text)) == (ssize_t)strlen(text));
    close(fd);
  }
}

static bool file_is(const char* path, const char* text) {
  char buf[256] = "";
  int fd = open(path, O_RDONLY);
  if (fd < 0) return false;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  return n == (ssize_t)strlen(text) && memcmp(buf, text, (size_t)n) == 0;
}

static gpumem_t* make(const char* conf, gpumem_backend_t** sim) {
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = 8 * GIB;
  *sim = gpumem_sim_create(&so);
  gpumem_options_t o;
  gpumem_options_init(&o);
  if (!*sim || gpumem_options_parse(&o, conf) != GPUMEM_OK) return NULL;
  return gpumem_create(*sim, &o, NULL);
}

static void done(gpumem_t* gm, gpumem_backend_t* sim) {
  if (gm) CHECK_MSG(gpumem_check(gm) == 0, "gpumem_check: %s", gpumem_last_error());
  gpumem_destroy(gm);
  gpumem_sim_destroy(sim);
}

typedef struct seen {
  int count, alive;
  gpumem_published_t last;
} seen_t;

static int collect(const gpumem_published_t* p, void* arg) {
  seen_t* s = arg;
  s->count++;
  s->alive += p->alive;
  s->last = *p;
  return 0;
}

static seen_t scan(void) {
  seen_t s;
  memset(&s, 0, sizeof s);
  gpumem_published_scan(dir, collect, &s);
  return s;
}

static char budget_path[400];
static const char* budget_of(const char* name) {
  snprintf(budget_path, sizeof budget_path, "%s/gpumem-budget.u%u.%s.-1", dir, (unsigned)geteuid(),
           name);
  return budget_path;
}

/* Row 1: links at the next publication names, planted by another user,
 * pointing at a file of root's. */
static void test_publication_links(void) {
  if (!root) return skip("publication links");
  char target[300];
  snprintf(target, sizeof target, "%s/precious", safe);
  write_file(target, "precious");
  pid_t me = getpid();
  pid_t child = fork();
  if (child == 0) {
    become(ATTACKER, ATTACKER, 0, NULL);
    char link[400];
    for (int i = 0; i < 64; i++) {
      snprintf(link, sizeof link, "%s/gpumem.%d.%d", dir, (int)me, i);
      if (symlink(target, link) != 0) _exit(1);
    }
    _exit(0);
  }
  CHECK(wait_child(child) == 0);
  gpumem_backend_t* sim;
  gpumem_t* gm = make("publish:on", &sim);
  void* p = NULL;
  /* every name it may try is a link: publication stays off, allocation works */
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_ERR_UNSUPPORTED);
  CHECK_STATUS(gpumem_malloc(gm, MIB, 0, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  done(gm, sim);
  CHECK_MSG(file_is(target, "precious"), "the link's target was written");
  /* with a few names free, it publishes under one of its own */
  char link[400];
  for (int i = 20; i < 64; i++) { /* the next allocator tries 16 on */
    snprintf(link, sizeof link, "%s/gpumem.%d.%d", dir, (int)me, i);
    unlink(link);
  }
  gm = make("publish:on", &sim);
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_OK);
  seen_t s = scan();
  struct stat st;
  CHECK_MSG(s.count == 1 && s.alive == 1 && lstat(s.last.path, &st) == 0 && S_ISREG(st.st_mode) &&
                (st.st_mode & 0777) == 0600,
            "%d pages", s.count);
  done(gm, sim);
  CHECK(file_is(target, "precious"));
  for (int i = 0; i < 20; i++) {
    snprintf(link, sizeof link, "%s/gpumem.%d.%d", dir, (int)me, i);
    unlink(link);
  }
}

/* Row 2: a dangling link at the budget's name. */
static void test_budget_link(void) {
  char target[300];
  snprintf(target, sizeof target, "%s/made-through-link", safe);
  CHECK(symlink(target, budget_of("linked")) == 0);
  gpumem_backend_t* sim;
  gpumem_t* gm = make("policy:pytorch,shared_limit:1G,shared_name:linked", &sim);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, MIB, 0, &p), GPUMEM_ERR_BACKEND);
  CHECK_MSG(strstr(gpumem_last_error(), "symbolic link") &&
                strstr(gpumem_last_error(), budget_of("linked")),
            "%s", gpumem_last_error());
  done(gm, sim);
  CHECK_MSG(access(target, F_OK) != 0, "a file was made where the link points");
  unlink(budget_of("linked"));
}

/* Row 3: a link at the out-of-memory snapshot's path (in a directory
 * anyone can write, as /tmp). */
static void test_snapshot_link(void) {
  char target[300], conf[600], path[400];
  snprintf(target, sizeof target, "%s/precious-snapshot", safe);
  write_file(target, "precious");
  snprintf(path, sizeof path, "%s/oom-%d.json", dir, (int)getpid());
  if (root) {
    pid_t child = fork();
    if (child == 0) {
      become(ATTACKER, ATTACKER, 0, NULL);
      _exit(symlink(target, path) == 0 ? 0 : 1);
    }
    CHECK(wait_child(child) == 0);
  } else {
    CHECK(symlink(target, path) == 0);
  }
  snprintf(conf, sizeof conf, "policy:pytorch,limit:64M,oom_snapshot:%s/oom-%%p.json", dir);
  gpumem_backend_t* sim;
  gpumem_t* gm = make(conf, &sim);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, 100 * MIB, 0, &p), GPUMEM_ERR_OUT_OF_MEMORY);
  done(gm, sim);
  CHECK_MSG(file_is(target, "precious"), "the snapshot went through the link");
  struct stat st;
  /* root may replace the name (its target untouched); another user is refused */
  CHECK(lstat(path, &st) == 0 && (S_ISLNK(st.st_mode) || st.st_uid == geteuid()));
  unlink(path);
}

/* A trace recorded to a path in a directory anyone can write (record:PATH,
 * the README's example once was /tmp/job.trace.gz): another user's link at
 * the path, or at the names of coming pids, points at a file of root's; a
 * file they made first, 0666, would receive the trace. Each is refused with
 * a message naming the path, nothing is written through or into them, and
 * a new trace is 0600 whatever the umask. */
static void plant(const char* target, const char* path, bool as_file) {
  pid_t child = root ? fork() : 0;
  if (child == 0) {
    if (root) become(ATTACKER, ATTACKER, 0, NULL);
    int ok;
    if (as_file) {
      int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0666);
      ok = fd >= 0 && fchmod(fd, 0666) == 0 && close(fd) == 0;
    } else {
      ok = symlink(target, path) == 0;
    }
    if (root) _exit(ok ? 0 : 1);
    CHECK(ok);
    return;
  }
  CHECK(wait_child(child) == 0);
}

static void test_record_planted(void) {
  char target[300], path[400], conf[600];
  snprintf(target, sizeof target, "%s/precious-trace", safe);
  write_file(target, "precious");
  gpumem_backend_t* sim;
  gpumem_t* gm = make("policy:pytorch", &sim);
  /* a link at the path */
  snprintf(path, sizeof path, "%s/job.trace.gz", dir);
  plant(target, path, false);
  clear_error();
  CHECK_STATUS(gpumem_record_trace(gm, path), GPUMEM_ERR_IO);
  CHECK_MSG(strstr(gpumem_last_error(), "refusing to write") && strstr(gpumem_last_error(), path) &&
                strstr(gpumem_last_error(), "symbolic link"),
            "%s", gpumem_last_error());
  /* links at the names of this and coming pids, with record:PATH-%p */
  for (int i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/job-%d.trace.gz", dir, (int)getpid() + i);
    plant(target, path, false);
  }
  snprintf(path, sizeof path, "%s/job-%%p.trace.gz", dir);
  CHECK_STATUS(gpumem_record_trace(gm, path), GPUMEM_ERR_IO);
  done(gm, sim);
  snprintf(conf, sizeof conf, "policy:pytorch,record:%s/job-%%p.trace.gz", dir);
  gm = make(conf, &sim);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, MIB, 0, &p), GPUMEM_OK); /* recording off, allocation on */
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  done(gm, sim);
  CHECK_MSG(file_is(target, "precious"), "the trace went through a link");
  /* a file the other user made first, open to all */
  snprintf(path, sizeof path, "%s/pre.trace.gz", dir);
  plant(NULL, path, true);
  gm = make("policy:pytorch", &sim);
  CHECK_STATUS(gpumem_record_trace(gm, path), GPUMEM_ERR_IO);
  CHECK_MSG(strstr(gpumem_last_error(), path) &&
                (root ? strstr(gpumem_last_error(), "belongs to uid 60001")
                      : strstr(gpumem_last_error(), "other users can write it (mode 0666)")),
            "%s", gpumem_last_error());
  struct stat st;
  CHECK(stat(path, &st) == 0 && st.st_size == 0);
  /* another name of a file of root's (a hard link) */
  snprintf(path, sizeof path, "%s/hard.trace.gz", dir);
  CHECK(link(target, path) == 0);
  CHECK_STATUS(gpumem_record_trace(gm, path), GPUMEM_ERR_IO);
  CHECK_MSG(strstr(gpumem_last_error(), "hard links"), "%s", gpumem_last_error());
  CHECK(file_is(target, "precious"));
  /* a new trace: the user's alone */
  mode_t old = umask(022);
  snprintf(path, sizeof path, "%s/fresh.trace.gz", dir);
  CHECK_STATUS(gpumem_record_trace(gm, path), GPUMEM_OK);
  umask(old);
  CHECK_STATUS(gpumem_malloc(gm, MIB, 0, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  CHECK_STATUS(gpumem_record_trace(gm, NULL), GPUMEM_OK);
  CHECK_MSG(lstat(path, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 0777) == 0600 &&
                st.st_uid == geteuid() && st.st_size > 0,
            "the trace is mode %04o", (unsigned)(st.st_mode & 07777));
  done(gm, sim);
}

/* Rows 4 and 5: another user's budget file, made first, plain or well
 * formed with an absurd content, at the name every user once shared and at
 * this user's own name. */
static void test_budget_squatted(void) {
  if (!root) return skip("budget made by another user");
  pid_t child = fork();
  if (child == 0) {
    become(ATTACKER, ATTACKER, 0, NULL);
    char path[400], buf[BUDGET_SIZE];
    memset(buf, 0xff, sizeof buf); /* totals of 2^64-1, slots of pid -1 */
    snprintf(path, sizeof path, "%s/gpumem-budget.squat.-1", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0666);
    snprintf(path, sizeof path, "%s/gpumem-budget.u0.squat.-1", dir);
    int fd2 = open(path, O_WRONLY | O_CREAT | O_EXCL, 0666);
    _exit(fd >= 0 && fd2 >= 0 && write(fd, buf, sizeof buf) == (ssize_t)sizeof buf &&
                  write(fd2, buf, sizeof buf) == (ssize_t)sizeof buf
              ? 0
              : 1);
  }
  CHECK(wait_child(child) == 0);
  gpumem_backend_t* sim;
  gpumem_t* gm = make("policy:pytorch,shared_limit:1G,shared_name:squat", &sim);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, MIB, 0, &p), GPUMEM_ERR_BACKEND);
  const char* e = gpumem_last_error();
  CHECK_MSG(strstr(e, "refusing") && strstr(e, "belongs to uid 60001") && strstr(e, "rm ") &&
                strstr(e, "GPUMEM_PUBLISH_DIR"),
            "%s", e);
  CHECK(gpumem_check(gm) == 0);
  done(gm, sim);
  /* two other users, each with the budget name "squat": neither stops the other */
  for (int uid = OTHER; uid <= OUTSIDER; uid++) {
    child = fork();
    if (child == 0) {
      become((uid_t)uid, (gid_t)uid, 0, NULL);
      umask(022);
      gpumem_backend_t* s2;
      gpumem_t* g2 = make("policy:pytorch,shared_limit:1G,shared_name:squat", &s2);
      void* q = NULL;
      gpumem_status_t st = gpumem_malloc(g2, 600 * MIB, 0, &q);
      if (st != GPUMEM_OK) fprintf(stderr, "uid %d: %s\n", uid, gpumem_last_error());
      _exit(st == GPUMEM_OK ? 0 : 1); /* the file stays, as a killed process's */
    }
    CHECK_MSG(wait_child(child) == 0, "user %d could not use its budget", uid);
  }
}

/* Rows 5, 6 and 8 from inside: this user's own budget written over (by a
 * member of its group, or a bug) with slots of absent processes holding
 * 900 MiB each, a stored total of 2^64-1, the live holder's bytes set to
 * 0: the budget counts only slots whose holder lives, the holder's next
 * take writes its true figure back, and releases never wrap. */
static void test_budget_repairs(void) {
  gpumem_backend_t *sa, *sb;
  gpumem_t* a = make("policy:pytorch,shared_limit:1G,shared_name:repair", &sa);
  void *p = NULL, *p2 = NULL, *q = NULL;
  CHECK_STATUS(gpumem_malloc(a, 600 * MIB, 0, &p), GPUMEM_OK);
  int fd = open(budget_of("repair"), O_RDWR);
  CHECK(fd >= 0);
  char slots[120 * SLOT_SIZE];
  uint64_t junk[2] = {UINT64_MAX, UINT64_MAX};
  CHECK(pread(fd, slots, sizeof slots, SLOTS_AT) == (ssize_t)sizeof slots);
  for (int i = 1; i < 120; i++) {
    int32_t pid = 1;
    uint64_t bytes = 900 * MIB;
    memcpy(slots + i * SLOT_SIZE, &pid, 4);
    memcpy(slots + i * SLOT_SIZE + 8, &bytes, 8);
  }
  memset(slots + 8, 0, 8); /* a's own slot: 0 where it holds 600 MiB */
  CHECK(pwrite(fd, slots, sizeof slots, SLOTS_AT) == (ssize_t)sizeof slots);
  CHECK(pwrite(fd, junk, sizeof junk, 16) == (ssize_t)sizeof junk);
  close(fd);
  CHECK_STATUS(gpumem_malloc(a, 30 * MIB, 0, &p2), GPUMEM_OK); /* rewrites a's slot */
  gpumem_t* b = make("policy:pytorch,shared_limit:1G,shared_name:repair", &sb);
  CHECK_STATUS(gpumem_malloc(b, 600 * MIB, 0, &q), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_MSG(strstr(gpumem_last_error(), "(1 live)"), "%s", gpumem_last_error());
  CHECK_STATUS(gpumem_malloc(b, 300 * MIB, 0, &q), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(b, q), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(b), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(a, p), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(a, p2), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(a), GPUMEM_OK); /* releases all: no wrap */
  CHECK_STATUS(gpumem_malloc(b, 1000 * MIB, 0, &q), GPUMEM_OK);
  gpumem_shared_budget_t info;
  CHECK_STATUS(gpumem_shared_budget(b, &info), GPUMEM_OK);
  CHECK_MSG(info.total == info.mine && info.allocators == 2, "total %" PRIu64 ", %d allocators",
            info.total, info.allocators);
  CHECK_STATUS(gpumem_free(b, q), GPUMEM_OK);
  done(b, sb);
  done(a, sa);
}

/* Row 7: the budget truncated (or cut) under its users; a publication
 * page another user tries to truncate. */
static void test_truncated(void) {
  gpumem_backend_t* sim;
  gpumem_t* gm = make("policy:pytorch,shared_limit:1G,shared_name:cut", &sim);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, 100 * MIB, 0, &p), GPUMEM_OK);
  CHECK(truncate(budget_of("cut"), 0) == 0);
  void* q = NULL;
  CHECK_STATUS(gpumem_malloc(gm, 200 * MIB, 0, &q), GPUMEM_ERR_BACKEND);
  CHECK_MSG(strstr(gpumem_last_error(), "is not a budget of this gpumem") &&
                strstr(gpumem_last_error(), "rm "),
            "%s", gpumem_last_error());
  CHECK(gpumem_check(gm) == 0);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  done(gm, sim);
  unlink(budget_of("cut"));
  if (!root) return skip("publication truncated by another user");
  gm = make("publish:on", &sim);
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_OK);
  seen_t s = scan();
  char path[256];
  snprintf(path, sizeof path, "%s", s.last.path);
  pid_t child = fork();
  if (child == 0) {
    become(ATTACKER, ATTACKER, 0, NULL);
    _exit(open(path, O_RDWR) < 0 && errno == EACCES && truncate(path, 0) != 0 ? 0 : 1);
  }
  CHECK_MSG(wait_child(child) == 0, "another user could open %s to write", path);
  CHECK_STATUS(gpumem_malloc(gm, MIB, 0, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  done(gm, sim);
}

/* Row 9: liveness is the holder's lock, not its pid. The pid in a slot or
 * a page is made one that no longer runs here (as a process in another pid
 * namespace shows): the holder is still counted and shown alive. Then, if
 * this machine lets root make a pid namespace, a process really in one. */
static void test_liveness(void) {
  pid_t gone = fork();
  if (gone == 0) _exit(0);
  CHECK(wait_child(gone) == 0);
  gpumem_backend_t *sa, *sb;
  gpumem_t* a = make("policy:pytorch,publish:on,shared_limit:1G,shared_name:alive", &sa);
  void *p = NULL, *q = NULL;
  CHECK_STATUS(gpumem_malloc(a, 600 * MIB, 0, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_publish(a), GPUMEM_OK);
  int fd = open(budget_of("alive"), O_RDWR);
  int32_t pid = (int32_t)gone;
  CHECK(fd >= 0 && pwrite(fd, &pid, 4, SLOTS_AT) == 4);
  close(fd);
  seen_t s = scan();
  fd = open(s.last.path, O_RDWR);
  CHECK(fd >= 0 && pwrite(fd, &pid, 4, 24) == 4); /* the page's pid */
  close(fd);
  gpumem_t* b = make("policy:pytorch,shared_limit:1G,shared_name:alive", &sb);
  CHECK_STATUS(gpumem_malloc(b, 600 * MIB, 0, &q), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_MSG(strstr(gpumem_last_error(), "other allocators 600.00 MiB (1 live)"), "%s",
            gpumem_last_error());
  s = scan();
  CHECK_MSG(s.count == 1 && s.alive == 1 && s.last.pid == (int)gone,
            "a page whose pid is gone was read as exited");
  CHECK_STATUS(gpumem_free(a, p), GPUMEM_OK);
  done(a, sa);
  done(b, sb);
  if (!root) return skip("pid namespaces");
  /* a process in a pid namespace of its own */
  int ready[2], go[2];
  CHECK(pipe(ready) == 0 && pipe(go) == 0);
  pid_t outer = fork();
  if (outer == 0) {
    if (unshare(CLONE_NEWPID) != 0) _exit(77);
    pid_t inner = fork(); /* pid 1 there */
    if (inner == 0) {
      gpumem_backend_t* si;
      gpumem_t* gi = make("policy:pytorch,publish:on,shared_limit:1G,shared_name:ns", &si);
      void* r = NULL;
      char c = gi && gpumem_malloc(gi, 600 * MIB, 0, &r) == GPUMEM_OK &&
                       gpumem_publish(gi) == GPUMEM_OK && getpid() == 1
                   ? 'y'
                   : 'n';
      (void)!write(ready[1], &c, 1);
      (void)!read(go[0], &c, 1);
      _exit(0);
    }
    _exit(wait_child(inner));
  }
  close(ready[1]);
  close(go[0]);
  char c = 0;
  if (read(ready[0], &c, 1) != 1) {
    int rc = wait_child(outer);
    if (rc == 77) printf("test_hostile: SKIPPED pid namespaces: unshare refused here\n");
    CHECK(rc == 77);
    close(ready[0]);
    close(go[1]);
    return;
  }
  CHECK_MSG(c == 'y', "the process in its own pid namespace could not allocate");
  gpumem_t* h = make("policy:pytorch,shared_limit:1G,shared_name:ns", &sb);
  CHECK_STATUS(gpumem_malloc(h, 600 * MIB, 0, &q), GPUMEM_ERR_OUT_OF_MEMORY);
  s = scan();
  CHECK_MSG(s.count == 1 && s.alive == 1 && s.last.pid == 1, "%d pages, %d alive, pid %d", s.count,
            s.alive, s.last.pid);
  CHECK(write(go[1], "x", 1) == 1);
  CHECK(wait_child(outer) == 0);
  /* gone now: its slot no longer counts, its page reads as exited */
  CHECK_STATUS(gpumem_malloc(h, 600 * MIB, 0, &q), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(h, q), GPUMEM_OK);
  s = scan();
  CHECK(s.count == 1 && s.alive == 0);
  if (s.count == 1) unlink(s.last.path);
  done(h, sb);
  close(ready[0]);
  close(go[1]);
}

/* Row 10: a FIFO among the pages (a scan must not block on it) and a page
 * flipping between its size and 0 while scans read it. */
typedef struct flipper {
  char path[300];
  atomic_int stop; /* set by the scanning thread */
} flipper_t;

static void* flip(void* arg) {
  flipper_t* f = arg;
  while (!atomic_load(&f->stop)) {
    CHECK(truncate(f->path, 0) == 0);
    CHECK(truncate(f->path, PUB_PAGE) == 0);
  }
  return NULL;
}

static void test_fifo_and_flipping(void) {
  char fifo[300];
  snprintf(fifo, sizeof fifo, "%s/gpumem.x", dir);
  CHECK(mkfifo(fifo, 0666) == 0);
  gpumem_backend_t* sim;
  gpumem_t* gm = make("publish:on", &sim);
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_OK);
  alarm(60); /* a blocked open would end the test here */
  seen_t s = scan();
  CHECK(s.count == 1);
  flipper_t f = {"", 0};
  snprintf(f.path, sizeof f.path, "%s/gpumem.777.0", dir);
  int fd = open(s.last.path, O_RDONLY), out = open(f.path, O_WRONLY | O_CREAT | O_EXCL, 0600);
  char page[PUB_PAGE];
  CHECK(fd >= 0 && out >= 0 && read(fd, page, sizeof page) == PUB_PAGE &&
        write(out, page, sizeof page) == PUB_PAGE);
  close(fd);
  close(out);
  pthread_t t;
  CHECK(pthread_create(&t, NULL, flip, &f) == 0);
  int both = 0;
  for (int i = 0; i < 2000; i++) both += scan().count == 2;
  atomic_store(&f.stop, 1);
  pthread_join(t, NULL);
  alarm(0);
  printf("test_hostile: a flipping page read whole in %d of 2000 scans\n", both);
  unlink(f.path);
  unlink(fifo);
  done(gm, sim);
}

/* Rows 11 and 12 through the command: a process named with escape
 * sequences, pages with INT64_MAX figures, and 5,000 fake ones beside the
 * real page. */
static int run_top_in(const char* in, const char* args, char* out, size_t cap) {
  char exe[512], cmd[1200];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  out[0] = '\0';
  if (n <= 0) return -1;
  exe[n] = '\0';
  char* slash = strrchr(exe, '/');
  if (slash) *slash = '\0';
  snprintf(cmd, sizeof cmd, "%s/../gpumem top %s --dir %s 2>&1", exe, args, in);
  FILE* f = popen(cmd, "r");
  if (!f) return -1;
  size_t len = fread(out, 1, cap - 1, f);
  out[len] = '\0';
  return pclose(f);
}

static void run_top(const char* args, char* out, size_t cap) {
  run_top_in(dir, args, out, cap);
}

/* Whether s is valid UTF-8 with no raw control character but newlines (C0,
 * DEL, or C1: U+0080-U+009F, which terminals act on): what `top --json`
 * may print, whatever names the processes gave themselves. */
static bool clean_utf8(const char* s) {
  const unsigned char* p = (const unsigned char*)s;
  while (*p) {
    unsigned c = *p;
    if ((c < 0x20 && c != '\n') || c == 0x7f) return false;
    if (c < 0x80) {
      p++;
      continue;
    }
    int n = c >= 0xc2 && c <= 0xdf   ? 2
            : c >= 0xe0 && c <= 0xef ? 3
            : c >= 0xf0 && c <= 0xf4 ? 4
                                     : 0;
    if (!n) return false;
    unsigned cp = c & (0x7f >> n);
    for (int i = 1; i < n; i++) {
      if ((p[i] & 0xc0) != 0x80) return false;
      cp = cp << 6 | (p[i] & 0x3f);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff) || (cp >= 0x80 && cp <= 0x9f))
      return false;
    p += n;
  }
  return true;
}

static void test_top(void) {
  static char out[1 << 22];
  int ready[2], go[2];
  CHECK(pipe(ready) == 0 && pipe(go) == 0);
  pid_t child = fork();
  if (child == 0) {
    prctl(PR_SET_NAME, "\033[2J\033]0;pwn\a", 0, 0, 0);
    gpumem_backend_t* sim;
    gpumem_t* gm = make("publish:on", &sim);
    char c = gm && gpumem_publish(gm) == GPUMEM_OK ? 'y' : 'n';
    (void)!write(ready[1], &c, 1);
    (void)!read(go[0], &c, 1);
    _exit(0);
  }
  char c = 0;
  CHECK(read(ready[0], &c, 1) == 1 && c == 'y');
  run_top("--once", out, sizeof out);
  CHECK_MSG(
      strchr(out, '\033') == NULL && strchr(out, '\a') == NULL && strstr(out, "\\x1b[2J\\x1b]0;pw"),
      "escape sequences reached the terminal: %s", out);
  /* two pages with INT64_MAX figures, copies of the live one */
  seen_t s = scan();
  char page[PUB_PAGE];
  int fd = open(s.last.path, O_RDONLY);
  CHECK(fd >= 0 && read(fd, page, sizeof page) == PUB_PAGE);
  close(fd);
  int64_t big = INT64_MAX;
  for (int at = 104; at < 136; at += 8) memcpy(page + at, &big, 8); /* allocated..reserved_peak */
  /* a name of bytes that are no UTF-8 (0x9b: CSI on an 8-bit terminal) */
  char hostile_name[32] =
      "\x9b"
      "31m\xff\xfe\xc2\x9b\xe2\x82";
  char saved_name[32];
  memcpy(saved_name, page + 40, sizeof saved_name);
  memcpy(page + 40, hostile_name, sizeof hostile_name);
  char path[400];
  int held[2];
  for (int i = 0; i < 2; i++) {
    snprintf(path, sizeof path, "%s/gpumem.%d.%d", dir, (int)child, 100 + i);
    held[i] = open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    /* held as a live writer holds its page */
    CHECK(held[i] >= 0 && write(held[i], page, sizeof page) == PUB_PAGE &&
          gm_life_lock(held[i], 0));
  }
  run_top("--once", out, sizeof out);
  CHECK_MSG(strstr(out, "3 allocators published") && strstr(out, "3 running, allocated 8.00 EiB"),
            "%s", out);
  run_top("--json", out, sizeof out);
  CHECK_MSG(clean_utf8(out), "top --json is not clean UTF-8: %s", out);
  CHECK_MSG(strstr(out, "\"process\":\"\\ufffd31m\\ufffd\\ufffd\\u009b\\ufffd\\ufffd\""), "%s",
            out);
  memcpy(page + 40, saved_name, sizeof saved_name);
  for (int i = 0; i < 2; i++) {
    snprintf(path, sizeof path, "%s/gpumem.%d.%d", dir, (int)child, 100 + i);
    unlink(path);
    close(held[i]);
  }
  /* 5,000 fake pages of a dead process: the live one is still shown */
  memset(page + 104, 0, 32);
  for (int i = 0; i < 5000; i++) {
    snprintf(path, sizeof path, "%s/gpumem.%d.%d", dir, 999999, i);
    int o = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
    CHECK(o >= 0 && write(o, page, sizeof page) == PUB_PAGE);
    close(o);
  }
  run_top("--once", out, sizeof out);
  char live[64];
  snprintf(live, sizeof live, "%8d  \\x1b[2J\\x1b]0;pw", (int)child);
  CHECK_MSG(strstr(out, "5001 allocators published") && strstr(out, live), "%.400s", out);
  run_top("--clean --once", out, sizeof out);
  CHECK_MSG(strstr(out, "removed 5000 files") && strstr(out, "1 allocator published"), "%.400s",
            out);
  CHECK(write(go[1], "x", 1) == 1);
  CHECK(wait_child(child) == 0);
  close(ready[0]);
  close(ready[1]);
  close(go[0]);
  close(go[1]);
}

/* Another user's 5,000 pages with a valid header and a sequence number held
 * odd (a writer forever mid-update): each refresh of root's top reads each
 * within a fixed number of tries, skips them, and takes well under a
 * second, not seconds per thousand; and with nothing published, top says
 * so and exits 0 (it sorted a NULL array: UBSan stopped it). */
static void test_top_odd_pages(void) {
  static char out[1 << 16];
  char odd[300], path[400];
  snprintf(odd, sizeof odd, "%s/odd", dir);
  CHECK(mkdir(odd, 01777) == 0 && chmod(odd, 01777) == 0);
  CHECK_MSG(
      run_top_in(odd, "--once", out, sizeof out) == 0 && strstr(out, "0 allocators published"),
      "top with nothing published: %s", out);
  CHECK_MSG(run_top_in(odd, "--json", out, sizeof out) == 0 && strcmp(out, "[]\n") == 0,
            "top --json with nothing published: %s", out);
  gpumem_backend_t* sim;
  gpumem_t* gm = make("publish:on", &sim);
  CHECK_STATUS(gpumem_publish(gm), GPUMEM_OK);
  seen_t s = scan();
  char page[PUB_PAGE];
  int fd = open(s.last.path, O_RDONLY);
  CHECK(fd >= 0 && read(fd, page, sizeof page) == PUB_PAGE);
  close(fd);
  done(gm, sim);
  uint64_t seq = 12345; /* odd */
  memcpy(page + 16, &seq, sizeof seq);
  pid_t child = root ? fork() : 0;
  if (child == 0) {
    if (root) become(ATTACKER, ATTACKER, 0, NULL);
    int made = 0;
    for (int i = 0; i < 5000; i++) {
      snprintf(path, sizeof path, "%s/gpumem.%d.0", odd, 100000 + i);
      int o = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
      made += o >= 0 && write(o, page, sizeof page) == PUB_PAGE;
      if (o >= 0) close(o);
    }
    if (root) _exit(made == 5000 ? 0 : 1);
    CHECK(made == 5000);
  } else {
    CHECK(wait_child(child) == 0);
  }
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = run_top_in(odd, "--once", out, sizeof out);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  printf("test_hostile: top over 5,000 pages held odd: %.2f s\n", secs);
  CHECK_MSG(rc == 0 && strstr(out, "0 allocators published"), "%s", out);
  CHECK_MSG(secs < 3.0, "one refresh over 5,000 odd pages took %.1f s", secs);
}

/* Row 13: a directory so long that budget paths would be cut. */
static void test_long_dir(void) {
  char longdir[400];
  memset(longdir, 'd', sizeof longdir);
  snprintf(longdir, sizeof longdir, "%s/", dir);
  size_t n = strlen(longdir);
  memset(longdir + n, 'd', 284 - n);
  longdir[284] = '\0';
  setenv("GPUMEM_PUBLISH_DIR", longdir, 1);
  gpumem_backend_t* sim;
  gpumem_t* gm = make("policy:pytorch,shared_limit:1G,shared_name:alpha", &sim);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, MIB, 0, &p), GPUMEM_ERR_BACKEND);
  CHECK_MSG(strstr(gpumem_last_error(), "choose a shorter GPUMEM_PUBLISH_DIR"), "%s",
            gpumem_last_error());
  done(gm, sim);
  setenv("GPUMEM_PUBLISH_DIR", dir, 1);
}

/* A group of the test's own whose members, in the group database (what
 * gpumem consults to trust an owner), are the system users daemon and bin;
 * removed at the end. */
static char test_group[32];
static uid_t member_uid[2];
static gid_t member_gid[2];
static const char* why_no_group = "needs root, groupadd and gpasswd, and users daemon and bin";

static bool make_test_group(void) {
  const char* names[2] = {"daemon", "bin"};
  for (int i = 0; i < 2; i++) {
    struct passwd* pw = getpwnam(names[i]);
    if (!pw) return false;
    member_uid[i] = pw->pw_uid;
    member_gid[i] = pw->pw_gid;
  }
  snprintf(test_group, sizeof test_group, "gmhostile%d", (int)getpid());
  char cmd[200];
  snprintf(cmd, sizeof cmd, "groupadd %s 2>/dev/null && gpasswd -M daemon,bin %s >/dev/null 2>&1",
           test_group, test_group);
  if (system(cmd) == 0 && getgrnam(test_group)) return true;
  test_group[0] = '\0';
  return false;
}

static void remove_test_group(void) {
  char cmd[200];
  snprintf(cmd, sizeof cmd, "groupdel %s", test_group);
  if (test_group[0] && system(cmd) != 0)
    printf("test_hostile: could not remove group %s\n", test_group);
}

/* Opt-in sharing: two users of one group share a budget in the group's
 * directory; a user outside the group cannot open it. */
static void test_group_budget(void) {
  if (!root || !test_group[0]) {
    printf("test_hostile: SKIPPED a budget shared by two users: %s\n", why_no_group);
    return;
  }
  struct group* g = getgrnam(test_group);
  gid_t gid = g->gr_gid;
  char conf[200];
  snprintf(conf, sizeof conf, "policy:pytorch,shared_limit:1G,shared_name:team,shared_group:%s",
           g->gr_name);
  int ready[2], go[2];
  CHECK(pipe(ready) == 0 && pipe(go) == 0);
  pid_t first = fork();
  if (first == 0) {
    become(member_uid[0], member_gid[0], 1, &gid);
    umask(077); /* the file is made 0660 whatever the umask */
    gpumem_backend_t* sim;
    gpumem_t* gm = make(conf, &sim);
    void* p = NULL;
    gpumem_status_t st = gpumem_malloc(gm, 600 * MIB, 0, &p);
    if (st != GPUMEM_OK) fprintf(stderr, "first member: %s\n", gpumem_last_error());
    char c = st == GPUMEM_OK ? 'y' : 'n';
    (void)!write(ready[1], &c, 1);
    (void)!read(go[0], &c, 1);
    _exit(0);
  }
  char c = 0;
  CHECK(read(ready[0], &c, 1) == 1 && c == 'y');
  pid_t second = fork();
  if (second == 0) {
    become(member_uid[1], member_gid[1], 1, &gid);
    gpumem_backend_t* sim;
    gpumem_t* gm = make(conf, &sim);
    void* p = NULL;
    bool refused = gpumem_malloc(gm, 600 * MIB, 0, &p) == GPUMEM_ERR_OUT_OF_MEMORY &&
                   strstr(gpumem_last_error(), "other allocators 600.00 MiB (1 live)");
    if (!refused) fprintf(stderr, "second member: %s\n", gpumem_last_error());
    bool fits = gpumem_malloc(gm, 300 * MIB, 0, &p) == GPUMEM_OK;
    _exit(refused && fits && gpumem_check(gm) == 0 ? 0 : 1);
  }
  CHECK_MSG(wait_child(second) == 0, "the second member did not share the budget");
  pid_t outsider = fork();
  if (outsider == 0) {
    become(OUTSIDER, OUTSIDER, 0, NULL);
    gpumem_backend_t* sim;
    gpumem_t* gm = make(conf, &sim);
    void* p = NULL;
    _exit(gpumem_malloc(gm, MIB, 0, &p) == GPUMEM_ERR_BACKEND &&
                  strstr(gpumem_last_error(), "Permission denied")
              ? 0
              : 1);
  }
  CHECK_MSG(wait_child(outsider) == 0, "a user outside the group opened its budget");
  CHECK(write(go[1], "x", 1) == 1);
  CHECK(wait_child(first) == 0);
  char gdir[300];
  snprintf(gdir, sizeof gdir, "%s/gpumem-group.%s", dir, g->gr_name);
  struct stat st;
  CHECK_MSG(stat(gdir, &st) == 0 && st.st_gid == gid && (st.st_mode & 07777) == 03770,
            "the group's directory is mode %04o", (unsigned)(st.st_mode & 07777));
  close(ready[0]);
  close(ready[1]);
  close(go[0]);
  close(go[1]);
}

/* A group's directory an outsider made first, whose group and mode root
 * then fixed as the old message advised (the outsider still owns it and can
 * write in it), with the outsider's budget file inside; then the directory
 * given to root, the outsider's file still there. Members refuse both,
 * saying whose they are. */
static int member_tries(const char* conf, const char* want1, const char* want2) {
  gid_t gid = getgrnam(test_group)->gr_gid;
  pid_t child = fork();
  if (child == 0) {
    become(member_uid[0], member_gid[0], 1, &gid);
    gpumem_backend_t* sim;
    gpumem_t* gm = make(conf, &sim);
    void* p = NULL;
    gpumem_status_t st = gpumem_malloc(gm, MIB, 0, &p);
    const char* e = gpumem_last_error();
    bool ok = st == GPUMEM_ERR_BACKEND && strstr(e, want1) && strstr(e, want2);
    if (!ok) fprintf(stderr, "member: %s: %s\n", gpumem_strerror(st), e);
    _exit(ok ? 0 : 1);
  }
  return wait_child(child);
}

static void test_group_outsider(void) {
  if (!root || !test_group[0]) {
    printf("test_hostile: SKIPPED a group directory an outsider made: %s\n", why_no_group);
    return;
  }
  char pub[300], gdir[400], file[500], conf[200];
  snprintf(pub, sizeof pub, "%s/outsider", dir);
  CHECK(mkdir(pub, 01777) == 0 && chmod(pub, 01777) == 0);
  setenv("GPUMEM_PUBLISH_DIR", pub, 1);
  snprintf(gdir, sizeof gdir, "%s/gpumem-group.%s", pub, test_group);
  snprintf(file, sizeof file, "%s/gpumem-budget.team.-1", gdir);
  snprintf(conf, sizeof conf, "policy:pytorch,shared_limit:1G,shared_name:team,shared_group:%s",
           test_group);
  pid_t child = fork();
  if (child == 0) {
    become(OUTSIDER, OUTSIDER, 0, NULL);
    _exit(mkdir(gdir, 0777) == 0 && chmod(gdir, 0777) == 0 ? 0 : 1);
  }
  CHECK(wait_child(child) == 0);
  CHECK(chown(gdir, (uid_t)-1, getgrnam(test_group)->gr_gid) == 0 && chmod(gdir, 03770) == 0);
  child = fork();
  if (child == 0) {
    become(OUTSIDER, OUTSIDER, 0, NULL);
    int fd = open(file, O_RDWR | O_CREAT | O_EXCL, 0660); /* of the group: setgid directory */
    _exit(fd >= 0 && fchmod(fd, 0660) == 0 ? 0 : 1);
  }
  CHECK(wait_child(child) == 0);
  CHECK_MSG(member_tries(conf, "belongs to uid 60003, who is not root nor a member", gdir) == 0,
            "a member used a directory an outsider owns");
  CHECK(chown(gdir, 0, (gid_t)-1) == 0 && chmod(gdir, 03770) == 0);
  CHECK_MSG(member_tries(conf, "belongs to uid 60003, who is not root nor a member", file) == 0,
            "a member used a budget an outsider made");
  struct stat st;
  CHECK_MSG(stat(file, &st) == 0 && st.st_size == 0, "the outsider's file was written");
  setenv("GPUMEM_PUBLISH_DIR", dir, 1);
}

/* At protected_hardlinks=0 another user can link a victim's file to the
 * victim's budget name: adopting it would rewrite the file as a budget.
 * A hard link is refused (the test links its own file: no second user). */
static void test_budget_hardlink(void) {
  char target[300];
  snprintf(target, sizeof target, "%s/empty-notes", safe);
  write_file(target, "");
  CHECK(link(target, budget_of("hard")) == 0);
  gpumem_backend_t* sim;
  gpumem_t* gm = make("policy:pytorch,shared_limit:1G,shared_name:hard", &sim);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(gm, MIB, 0, &p), GPUMEM_ERR_BACKEND);
  CHECK_MSG(
      strstr(gpumem_last_error(), "2 hard links") && strstr(gpumem_last_error(), budget_of("hard")),
      "%s", gpumem_last_error());
  done(gm, sim);
  struct stat st;
  CHECK_MSG(stat(target, &st) == 0 && st.st_size == 0, "the linked file was rewritten");
  unlink(budget_of("hard"));
}

/* Whether this root can become another user at all (a container may not
 * let it). */
static bool can_switch_user(void) {
  pid_t child = fork();
  if (child == 0) {
    become(ATTACKER, ATTACKER, 0, NULL);
    _exit(0);
  }
  return wait_child(child) == 0;
}

int main(void) {
  root = geteuid() == 0;
  if (root && !can_switch_user()) {
    root = false;
    why_no_second_user = "this root cannot switch to uid 60001 (setresuid refused)";
  }
  snprintf(dir, sizeof dir, "/tmp/gpumem_hostile_XXXXXX");
  snprintf(safe, sizeof safe, "/tmp/gpumem_hostile_safe_XXXXXX");
  if (!mkdtemp(dir) || !mkdtemp(safe) || chmod(dir, 01777) != 0) {
    perror("test_hostile: mkdtemp");
    return 1;
  }
  setenv("GPUMEM_PUBLISH_DIR", dir, 1);
  if (root && !make_test_group()) why_no_group = "groupadd or gpasswd failed here";
  test_publication_links();
  test_budget_link();
  test_snapshot_link();
  test_record_planted();
  test_budget_squatted();
  test_budget_repairs();
  test_truncated();
  test_liveness();
  test_fifo_and_flipping();
  test_top();
  test_top_odd_pages();
  test_long_dir();
  test_group_budget();
  test_group_outsider();
  test_budget_hardlink();
  remove_test_group();
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf %s %s", dir, safe);
  if (system(cmd) != 0) printf("test_hostile: could not remove %s\n", dir);
  return test_finish("test_hostile");
}
