/* gpumem run: starts a command with gpumem as PyTorch's CUDA allocator in
 * every Python process of it that imports torch, with no edit to the
 * program. The work happens in Python (gpumem/_bootstrap/sitecustomize.py
 * of the package): this command checks the configuration, points
 * PYTHONPATH at that hook, switches it on and replaces itself with the
 * command, whose children (torchrun's workers) inherit all of it. */
#include "commands.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "gpumem.h"

#define EXIT_USAGE 2
#define HOOK "/_bootstrap/sitecustomize.py"

static const char usage_run[] =
    "usage: gpumem run [--conf STRING] [--verbose] [--] COMMAND [ARGS...]\n"
    "\n"
    "Runs COMMAND with gpumem as PyTorch's CUDA allocator in every Python\n"
    "process of it that imports torch (the command itself, torchrun's workers,\n"
    "what they start); the program is not edited:\n"
    "\n"
    "  gpumem run -- python train.py --lr 3e-4\n"
    "  gpumem run --conf limit:40G -- torchrun --nproc-per-node 8 train.py\n"
    "\n"
    "options:\n"
    "  --conf STRING   configuration, GPUMEM_CONF grammar (key:value,...), checked\n"
    "                  here; the processes get GPUMEM_CONF from the environment\n"
    "                  followed by it, so its keys win\n"
    "  --verbose       each such process says on stderr that gpumem is enabled,\n"
    "                  and its peak memory when it exits\n"
    "  -h, --help      this text\n"
    "\n"
    "The directory of gpumem's Python start-up hook goes first on PYTHONPATH\n"
    "and GPUMEM_ENABLE_TORCH=1 switches it on: the hook enables gpumem.torch as\n"
    "torch is imported, then runs the sitecustomize it shadows, if any.\n";

static int run_usage_error(const char* what, const char* arg) {
  return cli_usage_error(usage_run, "%s%s%s%s", what, arg ? " '" : "", arg ? arg : "",
                         arg ? "'" : "");
}

/* Whether dir holds the package's start-up hook (and is a package). */
static int has_hook(const char* dir) {
  char path[PATH_MAX], init[PATH_MAX];
  int n = snprintf(path, sizeof path, "%s" HOOK, dir);
  int m = snprintf(init, sizeof init, "%s/__init__.py", dir);
  return n > 0 && (size_t)n < sizeof path && m > 0 && (size_t)m < sizeof init &&
         access(path, R_OK) == 0 && access(init, R_OK) == 0;
}

/* Why the code at path (a file or directory whose contents Python will
 * run) may not be trusted, or NULL: it must belong to this user or root and
 * be writable by nobody else, or another user could put code there that
 * runs as this user. */
static const char* untrusted(const char* path, char* why, size_t cap) {
  struct stat st;
  if (lstat(path, &st) != 0) {
    snprintf(why, cap, "%s: %s", path, strerror(errno));
  } else if (S_ISLNK(st.st_mode)) {
    snprintf(why, cap, "%s is a symbolic link", path);
  } else if (st.st_uid != 0 && st.st_uid != geteuid()) {
    snprintf(why, cap, "%s belongs to uid %u, not to this user or root", path, (unsigned)st.st_uid);
  } else if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    snprintf(why, cap, "other users can write %s (mode %04o)", path,
             (unsigned)(st.st_mode & 07777));
  } else {
    return NULL;
  }
  return why;
}

/* The same for the directories above pkg (a resolved path): another user
 * who could rename an entry in one could swap the whole package. A sticky
 * directory (/tmp) lets nobody rename what they do not own. */
static const char* untrusted_above(const char* pkg, char* why, size_t cap) {
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", pkg);
  for (char* slash = strrchr(dir, '/'); slash; slash = strrchr(dir, '/')) {
    if (slash == dir)
      slash[1] = '\0';
    else
      *slash = '\0';
    struct stat st;
    if (stat(dir, &st) != 0) {
      snprintf(why, cap, "%s: %s", dir, strerror(errno));
      return why;
    }
    if (st.st_uid != 0 && st.st_uid != geteuid()) {
      snprintf(why, cap, "%s belongs to uid %u, not to this user or root", dir,
               (unsigned)st.st_uid);
      return why;
    }
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX)) {
      snprintf(why, cap, "other users can write %s (mode %04o)", dir,
               (unsigned)(st.st_mode & 07777));
      return why;
    }
    if (slash == dir) break;
  }
  return NULL;
}

/* Whether the package at pkg (resolved) may be put on PYTHONPATH: the
 * package, its _bootstrap and the hook, and every directory above. */
static const char* package_untrusted(const char* pkg, char* why, size_t cap) {
  char path[PATH_MAX + 64];
  const char* parts[] = {"", "/__init__.py", "/_bootstrap", HOOK};
  for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
    snprintf(path, sizeof path, "%s%s", pkg, parts[i]);
    if (untrusted(path, why, cap)) return why;
  }
  return untrusted_above(pkg, why, cap);
}

/* The gpumem Python package that belongs with this binary: the one it is
 * shipped in (gpumem/bin/gpumem), the checkout it was built from
 * (build/gpumem beside python/gpumem, or the source directory CMake saw).
 * Only a package that this user or root owns and nobody else can write is
 * taken: a binary built into /tmp/x would otherwise run whatever another
 * user put in /tmp/_bootstrap. exe_dir receives the binary's directory; why
 * receives why a package found was refused. 0 when found. */
static int find_package(char* pkg, char* exe_dir, size_t cap, char* why, size_t why_cap) {
  why[0] = '\0';
  ssize_t n = readlink("/proc/self/exe", exe_dir, cap - 1);
  if (n <= 0) return -1;
  exe_dir[n] = '\0';
  char* slash = strrchr(exe_dir, '/');
  if (slash) *slash = '\0';
  char candidates[3][PATH_MAX];
  int count = 0;
  const char* layouts[] = {"%s/..", "%s/../python/gpumem"};
  for (int i = 0; i < 2; i++) {
    int len = snprintf(candidates[count], sizeof candidates[count], layouts[i], exe_dir);
    if (len > 0 && (size_t)len < sizeof candidates[count]) count++;
  }
#ifdef GPUMEM_SOURCE_DIR
  snprintf(candidates[count++], sizeof candidates[0], "%s", GPUMEM_SOURCE_DIR "/python/gpumem");
#endif
  char refused[PATH_MAX + 200];
  for (int i = 0; i < count; i++) {
    if (!has_hook(candidates[i]) || !realpath(candidates[i], pkg)) continue;
    if (!package_untrusted(pkg, refused, sizeof refused)) return 0;
    /* (the reason is cut to fit: it names the path first) */
    if (!why[0]) snprintf(why, why_cap, "refused the package at %s: %.1024s", pkg, refused);
  }
  return -1;
}

int cmd_run(int argc, char** argv) {
  const char* conf = NULL;
  int verbose = 0, i = 0;
  for (; i < argc; i++) {
    const char* a = argv[i];
    if (strcmp(a, "--") == 0) {
      i++;
      break;
    }
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      fputs(usage_run, stdout);
      return 0;
    }
    if (strcmp(a, "--verbose") == 0) {
      verbose = 1;
    } else if (strcmp(a, "--conf") == 0) {
      if (i + 1 >= argc) return run_usage_error("--conf needs a value", NULL);
      conf = argv[++i];
    } else if (strncmp(a, "--conf=", 7) == 0) {
      conf = a + 7;
    } else if (a[0] == '-') {
      return run_usage_error("unknown option", a);
    } else {
      break; /* the command starts here */
    }
  }
  if (i >= argc) return run_usage_error("no command to run", NULL);

  char joined[4096];
  if (conf) {
    /* A bad key is reported now, not in every process the command starts. */
    gpumem_options_t opts;
    gpumem_options_init(&opts);
    if (cli_check_conf_units("--conf", conf) != GPUMEM_OK ||
        gpumem_options_parse(&opts, conf) != GPUMEM_OK) {
      cli_error("--conf: %s", show_detail(gpumem_last_error()));
      return EXIT_USAGE;
    }
    /* GPUMEM_CONF first, then --conf, as every command reads them */
    if (cli_join_conf(conf, joined, sizeof joined) != 0) {
      cli_error("GPUMEM_CONF and --conf together are too long");
      return EXIT_USAGE;
    }
    conf = joined;
  }
  char pkg[PATH_MAX], exe_dir[PATH_MAX], why[2 * PATH_MAX + 1100];
  if (find_package(pkg, exe_dir, sizeof exe_dir, why, sizeof why) != 0) {
    return cli_error(
        "cannot find the gpumem Python package that belongs with this program (looked for "
        "gpumem" HOOK
        " beside it and in python/gpumem of its checkout%s%s); install it with pip "
        "install <gpumem checkout>",
        why[0] ? "; " : "", why);
  }

  char path[2 * PATH_MAX + 32];
  const char* old = getenv("PYTHONPATH");
  snprintf(path, sizeof path, "%s/_bootstrap%s%s", pkg, old && *old ? ":" : "", old ? old : "");
  char library[PATH_MAX + 16];
  snprintf(library, sizeof library, "%s/libgpumem.so", exe_dir);
  const char* env_library = getenv("GPUMEM_LIBRARY");
  /* A build tree's binary sits beside the library it was built with. */
  char refused[PATH_MAX + 200];
  int use_library = (!env_library || !*env_library) && access(library, R_OK) == 0 &&
                    !untrusted(library, refused, sizeof refused) &&
                    !untrusted(exe_dir, refused, sizeof refused);
  if (setenv("PYTHONPATH", path, 1) != 0 || setenv("GPUMEM_ENABLE_TORCH", "1", 1) != 0 ||
      (conf && setenv("GPUMEM_CONF", conf, 1) != 0) ||
      (verbose && setenv("GPUMEM_TORCH_VERBOSE", "1", 1) != 0) ||
      (use_library && setenv("GPUMEM_LIBRARY", library, 1) != 0)) {
    return cli_error("cannot set the environment: %s", strerror(errno));
  }
  execvp(argv[i], argv + i);
  int err = errno;
  cli_error("cannot run '%s': %s", argv[i], strerror(err));
  return err == ENOENT ? 127 : 126; /* as env(1) and the shells */
}
