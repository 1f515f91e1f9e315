/* Output directories another user could swap a file in (src/outfile.c):
 * a directory others can write, sticky or not, that belongs to neither
 * this user nor root is refused, the message naming the directory and its
 * owner, for every writer that goes through it (`gpumem report -o` and
 * `explain --snapshot` in tests/cli_test.sh; option record and option
 * oom_snapshot here); /tmp itself, root's and sticky, stays accepted.
 *
 * The other user is real: as root the directory is made and handed to
 * uid 65534 (nobody) with chown. Without root that part is skipped, with
 * the reason printed; the accepted cases run either way. */
#include <dirent.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "test_util.h"

#define OTHER_UID 65534

static gpumem_t* make(const char* conf) {
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  gpumem_backend_t* dev = gpumem_sim_create(&so);
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, conf), GPUMEM_OK);
  o.own_backend = 1;
  gpumem_status_t st;
  gpumem_t* gm = gpumem_create(dev, &o, &st);
  CHECK_STATUS(st, GPUMEM_OK);
  return gm;
}

/* Whether dir holds no entry but . and .. (nothing was written there). */
static int is_empty(const char* dir) {
  DIR* d = opendir(dir);
  if (!d) return 0;
  int n = 0;
  for (struct dirent* e; (e = readdir(d)) != NULL;)
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) n++;
  closedir(d);
  return n == 0;
}

/* Writes a file at path through gm_outfile; 1 when it is there after. */
static int writes(const char* path, char* why, size_t cap) {
  gm_outfile out;
  int fd = gm_outfile_open(&out, path, 0600, why, cap);
  if (fd < 0) return 0;
  int ok = write(fd, "x\n", 2) == 2;
  close(fd);
  if (!ok) {
    gm_outfile_abandon(&out);
    return 0;
  }
  return gm_outfile_commit(&out, why, cap) && access(path, F_OK) == 0;
}

static void test_accepted(const char* top) {
  char path[512], why[1400];
  /* /tmp: root's, sticky, every user's */
  struct stat st;
  if (stat("/tmp", &st) == 0 && st.st_uid == 0 && (st.st_mode & S_ISVTX)) {
    snprintf(path, sizeof path, "/tmp/gpumem_outfile_%ld.txt", (long)getpid());
    CHECK_MSG(writes(path, why, sizeof why), "/tmp refused: %s", why);
    unlink(path);
  } else {
    printf("test_outfile: SKIPPED the /tmp case: /tmp is not root's and sticky here\n");
  }
  /* a directory of this user's own */
  snprintf(path, sizeof path, "%s/own.txt", top);
  CHECK_MSG(writes(path, why, sizeof why), "own directory refused: %s", why);
  unlink(path);
}

/* A directory at dir owned by OTHER_UID with mode; 0 when it cannot be. */
static int make_others_dir(const char* dir, mode_t mode) {
  if (mkdir(dir, 0700) != 0) return 0;
  if (chown(dir, OTHER_UID, OTHER_UID) != 0 || chmod(dir, mode) != 0) return 0;
  return 1;
}

static void test_refused(const char* top) {
  char owner[64];
  struct passwd* pw = getpwuid(OTHER_UID);
  if (pw && pw->pw_name)
    snprintf(owner, sizeof owner, "uid %d (%s)", OTHER_UID, pw->pw_name);
  else
    snprintf(owner, sizeof owner, "uid %d", OTHER_UID);

  static const mode_t modes[] = {01777, 01770, 0770, 0777};
  for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
    char dir[512], path[600], why[1400];
    snprintf(dir, sizeof dir, "%s/others%04o", top, (unsigned)modes[i]);
    if (!make_others_dir(dir, modes[i])) {
      CHECK_MSG(0, "cannot make %s owned by uid %d", dir, OTHER_UID);
      continue;
    }
    snprintf(path, sizeof path, "%s/r.html", dir);
    CHECK_MSG(!writes(path, why, sizeof why), "mode %04o: written", (unsigned)modes[i]);
    CHECK_MSG(strstr(why, dir) != NULL, "mode %04o: the directory is not named: %s",
              (unsigned)modes[i], why);
    if (modes[i] == 0777) {
      /* every user's and not sticky: refused whoever owns it */
      CHECK_MSG(strstr(why, "not sticky") != NULL, "mode 0777: %s", why);
    } else {
      CHECK_MSG(strstr(why, owner) != NULL, "mode %04o: the owner (%s) is not named: %s",
                (unsigned)modes[i], owner, why);
    }
    CHECK_MSG(is_empty(dir), "mode %04o: something was left in %s", (unsigned)modes[i], dir);
  }

  /* the other user's directory that only they can write: nothing for
   * anyone else to swap, and root may write there */
  char dir[512], path[600], why[1400];
  snprintf(dir, sizeof dir, "%s/others0755", top);
  if (make_others_dir(dir, 0755)) {
    snprintf(path, sizeof path, "%s/r.html", dir);
    CHECK_MSG(writes(path, why, sizeof why), "mode 0755: refused: %s", why);
    unlink(path);
  }

  /* root's own sticky directory every user can write, as /tmp */
  snprintf(dir, sizeof dir, "%s/roots1777", top);
  CHECK(mkdir(dir, 0700) == 0 && chmod(dir, 01777) == 0);
  snprintf(path, sizeof path, "%s/r.html", dir);
  CHECK_MSG(writes(path, why, sizeof why), "root's sticky directory refused: %s", why);
  unlink(path);

  /* option record: the trace is not started there, and nothing is left */
  char conf[700];
  snprintf(dir, sizeof dir, "%s/others1777", top);
  snprintf(conf, sizeof conf, "record:%s/job.trace.gz", dir);
  gpumem_t* gm = make(conf);
  if (gm) {
    void* p = NULL;
    CHECK_STATUS(gpumem_malloc(gm, 1 << 20, 0, &p), GPUMEM_OK);
    CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
    gpumem_destroy(gm);
  }
  CHECK_MSG(is_empty(dir), "record: a file was written in %s", dir);

  /* option oom_snapshot: the failure says why the snapshot is missing */
  snprintf(conf, sizeof conf, "limit:64M,oom_snapshot:%s/oom.json", dir);
  gm = make(conf);
  if (gm) {
    void* p = NULL;
    CHECK(gpumem_malloc(gm, (size_t)1 << 30, 0, &p) == GPUMEM_ERR_OUT_OF_MEMORY);
    const char* msg = gpumem_last_error();
    CHECK_MSG(strstr(msg, "could not write the snapshot") && strstr(msg, owner), "oom_snapshot: %s",
              msg);
    gpumem_destroy(gm);
  }
  CHECK_MSG(is_empty(dir), "oom_snapshot: a file was written in %s", dir);
}

int main(void) {
  char top[] = "/tmp/gpumem_outfile.XXXXXX";
  if (!mkdtemp(top)) {
    perror("mkdtemp");
    return 1;
  }
  test_accepted(top);
  if (geteuid() == 0) {
    test_refused(top);
  } else {
    printf(
        "test_outfile: SKIPPED directories of another user: making one (chown to uid %d) "
        "needs root\n",
        OTHER_UID);
  }
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", top);
  if (system(cmd) != 0) fprintf(stderr, "test_outfile: could not remove %s\n", top);
  return test_finish("test_outfile");
}
