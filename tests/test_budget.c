/* Shared budgets (src/budget.c) on the simulated device: two allocators
 * under one shared_limit refuse what would pass it and take it back when
 * the other gives memory up (every policy), a random workload on both
 * keeps the budget's total equal to their reserved bytes after every
 * operation with gpumem_check on both, the default policy reclaims rather
 * than fails, a process that dies holding memory is reaped, a forked child
 * is refused, and bad names, sizes and files are errors that name them. */
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.h"

#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

static const char* const policies[] = {
    "policy:default",
    "policy:pytorch",
    "policy:default,reclaim:pressure,placement:bestfit",
};

static char dir[64];
static int name_seq;

/* conf plus a shared limit of limit bytes under a budget name of its own. */
static void budget_conf(char* out, size_t cap, const char* conf, size_t limit, int name) {
  snprintf(out, cap, "%s,shared_limit:%zu,shared_name:t%d-%d", conf, limit, (int)getpid(), name);
}

static int64_t reserved(gpumem_t* gm) {
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  return st.reserved_bytes[GPUMEM_POOL_ALL].current;
}

static uint64_t budget_total(gpumem_t* gm) {
  gpumem_shared_budget_t b;
  if (gpumem_shared_budget(gm, &b) != GPUMEM_OK) return UINT64_MAX;
  return b.total;
}

/* A holds most of the budget: B is refused, then served once A gives up. */
static void test_two_allocators(const char* policy) {
  char conf[256];
  budget_conf(conf, sizeof conf, policy, GIB, ++name_seq);
  fx_t a = fx_new(conf, 8 * GIB, 0), b = fx_new(conf, 8 * GIB, 0);
  if (!a.gm || !b.gm) return fx_done(&a), fx_done(&b);
  void *pa = NULL, *pb = NULL;
  CHECK_STATUS(gpumem_malloc(a.gm, 600 * MIB, 0, &pa), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(b.gm, 600 * MIB, 0, &pb), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_MSG(strstr(gpumem_last_error(), "the shared limit of 1.00 GiB (budget ") &&
                strstr(gpumem_last_error(), "other allocators 600.00 MiB") &&
                strstr(gpumem_last_error(),
                       "Advice: the shared limit (option shared_limit), not the device, refused: "
                       "the other allocators in the budget hold 600.00 MiB"),
            "%s: %s", policy, gpumem_last_error());
  CHECK_MSG(budget_total(a.gm) == (uint64_t)(reserved(a.gm) + reserved(b.gm)),
            "%s: budget %" PRIu64 ", reserved %lld + %lld", policy, budget_total(a.gm),
            (long long)reserved(a.gm), (long long)reserved(b.gm));
  gpumem_shared_budget_t info;
  CHECK_STATUS(gpumem_shared_budget(b.gm, &info), GPUMEM_OK);
  CHECK(info.limit == GIB && info.mine == (uint64_t)reserved(b.gm) && info.allocators == 2);
  CHECK_STATUS(gpumem_free(a.gm, pa), GPUMEM_OK);
  CHECK_STATUS(gpumem_empty_cache(a.gm), GPUMEM_OK);
  CHECK_MSG(budget_total(a.gm) == (uint64_t)reserved(b.gm), "%s: %" PRIu64, policy,
            budget_total(a.gm));
  CHECK_STATUS(gpumem_malloc(b.gm, 600 * MIB, 0, &pb), GPUMEM_OK);
  CHECK(budget_total(b.gm) == (uint64_t)(reserved(a.gm) + reserved(b.gm)));
  CHECK_STATUS(gpumem_free(b.gm, pb), GPUMEM_OK);
  fx_done(&a);
  /* A's destroy gave back its slot: one allocator left */
  CHECK_STATUS(gpumem_shared_budget(b.gm, &info), GPUMEM_OK);
  CHECK(info.allocators == 1 && info.total == (uint64_t)reserved(b.gm));
  fx_done(&b);
}

static uint64_t rng_state = 0x243f6a8885a308d3ull;
static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

/* Random sizes on two allocators under a tight budget: refusals are out of
 * memory, never anything else; after every operation the budget's total is
 * what the two reserve, and both are consistent. */
static void test_random(const char* policy) {
  char conf[256];
  budget_conf(conf, sizeof conf, policy, 512 * MIB, ++name_seq);
  fx_t f[2] = {fx_new(conf, 8 * GIB, 0), fx_new(conf, 8 * GIB, 0)};
  if (!f[0].gm || !f[1].gm) return fx_done(&f[0]), fx_done(&f[1]);
  enum { LIVE = 48, STEPS = 4000 };
  void* live[2][LIVE] = {{0}};
  long refused = 0;
  for (int step = 0; step < STEPS; step++) {
    uint64_t r = rng();
    int w = (int)(r & 1);
    int k = (int)((r >> 1) % LIVE);
    gpumem_t* gm = f[w].gm;
    if (live[w][k]) {
      CHECK_STATUS(gpumem_free(gm, live[w][k]), GPUMEM_OK);
      live[w][k] = NULL;
    } else {
      size_t size = ((size_t)1 << (10 + (r >> 8) % 17)) + (size_t)((r >> 32) % 5000);
      gpumem_status_t st = gpumem_malloc(gm, size, 0, &live[w][k]);
      if (st == GPUMEM_ERR_OUT_OF_MEMORY) {
        refused++;
        live[w][k] = NULL;
      } else {
        CHECK_STATUS(st, GPUMEM_OK);
      }
    }
    if (r % 50 == 0) gpumem_empty_cache(gm);
    uint64_t total = budget_total(gm);
    int64_t both = reserved(f[0].gm) + reserved(f[1].gm);
    if (total != (uint64_t)both || both > (int64_t)(512 * MIB) || gpumem_check(f[0].gm) ||
        gpumem_check(f[1].gm)) {
      CHECK_MSG(false, "%s step %d: budget %" PRIu64 ", reserved %lld: %s", policy, step, total,
                (long long)both, gpumem_last_error());
      break;
    }
  }
  CHECK_MSG(refused > 0, "%s: the budget never refused", policy);
  for (int w = 0; w < 2; w++)
    for (int k = 0; k < LIVE; k++)
      if (live[w][k]) CHECK_STATUS(gpumem_free(f[w].gm, live[w][k]), GPUMEM_OK);
  fx_done(&f[0]);
  fx_done(&f[1]);
}

/* The default policy under budget pressure moves pages rather than fail:
 * B's live bytes fit in what A leaves, its address space does not. */
static void test_lazy_reclaims(void) {
  char conf[256];
  budget_conf(conf, sizeof conf, "policy:default", 1 * GIB, ++name_seq);
  fx_t a = fx_new(conf, 8 * GIB, 0), b = fx_new(conf, 8 * GIB, 0);
  if (!a.gm || !b.gm) return fx_done(&a), fx_done(&b);
  void* held = NULL;
  CHECK_STATUS(gpumem_malloc(a.gm, 400 * MIB, 0, &held), GPUMEM_OK);
  void* p[4] = {0};
  for (int round = 0; round < 40; round++) {
    /* sizes that never repeat: holes left by one round do not fit the next */
    for (int k = 0; k < 4; k++) {
      size_t size = (size_t)(100 + (round * 7 + k * 13) % 40) * MIB;
      gpumem_status_t st = gpumem_malloc(b.gm, size, 0, &p[k]);
      CHECK_MSG(st == GPUMEM_OK, "round %d: %s", round, gpumem_last_error());
      if (st != GPUMEM_OK) p[k] = NULL;
    }
    for (int k = 0; k < 4; k += 2) {
      if (p[k]) CHECK_STATUS(gpumem_free(b.gm, p[k]), GPUMEM_OK);
      p[k] = NULL;
    }
    for (int k = 1; k < 4; k += 2) {
      if (p[k]) CHECK_STATUS(gpumem_free(b.gm, p[k]), GPUMEM_OK);
      p[k] = NULL;
    }
  }
  CHECK(reserved(a.gm) + reserved(b.gm) <= (int64_t)GIB);
  CHECK(budget_total(a.gm) == (uint64_t)(reserved(a.gm) + reserved(b.gm)));
  CHECK_STATUS(gpumem_free(a.gm, held), GPUMEM_OK);
  fx_done(&a);
  fx_done(&b);
}

/* A child takes most of the budget and dies without destroying anything:
 * the parent's next take reaps it. A child using its parent's allocator
 * is refused, saying why. */
static void test_processes(void) {
  char conf[256];
  budget_conf(conf, sizeof conf, "policy:default", GIB, ++name_seq);
  fflush(stdout);
  pid_t child = fork();
  if (child == 0) {
    fx_t c = fx_new(conf, 8 * GIB, 0);
    void* p = NULL;
    _exit(c.gm && gpumem_malloc(c.gm, 900 * MIB, 0, &p) == GPUMEM_OK ? 0 : 1);
  }
  int status = 0;
  CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) &&
        WEXITSTATUS(status) == 0);
  fx_t f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  void* p = NULL;
  CHECK_MSG(gpumem_malloc(f.gm, 600 * MIB, 0, &p) == GPUMEM_OK, "after the child died: %s",
            gpumem_last_error());
  gpumem_shared_budget_t info;
  CHECK_STATUS(gpumem_shared_budget(f.gm, &info), GPUMEM_OK);
  CHECK_MSG(info.allocators == 1 && info.total == (uint64_t)reserved(f.gm),
            "%d allocators, %" PRIu64 " bytes", info.allocators, info.total);
  fflush(stdout);
  child = fork();
  if (child == 0) {
    void* q = NULL;
    gpumem_status_t st = gpumem_malloc(f.gm, 300 * MIB, 0, &q);
    _exit(st == GPUMEM_ERR_UNSUPPORTED && strstr(gpumem_last_error(), "its fork") ? 0 : 1);
  }
  CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) &&
        WEXITSTATUS(status) == 0);
  CHECK(budget_total(f.gm) == (uint64_t)reserved(f.gm));
  CHECK_STATUS(gpumem_free(f.gm, p), GPUMEM_OK);
  fx_done(&f);
}

static void test_bad_input(void) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, "shared_limit:0"), GPUMEM_ERR_CONFIG);
  CHECK(strstr(gpumem_last_error(), "\"shared_limit\": expected a size above 0") != NULL);
  CHECK_STATUS(gpumem_options_parse(&o, "shared_name:a/b"), GPUMEM_ERR_CONFIG);
  CHECK(strstr(gpumem_last_error(), "letters, digits") != NULL);
  CHECK_STATUS(gpumem_options_parse(&o, "shared_name:0123456789012345678901234567890123456789"),
               GPUMEM_ERR_CONFIG);
  CHECK(o.shared_limit == 0 && o.shared_name[0] == '\0');
  CHECK_STATUS(gpumem_options_parse(&o, "shared_group:a/b"), GPUMEM_ERR_CONFIG);
  CHECK(strstr(gpumem_last_error(), "a group's name") != NULL && o.shared_group[0] == '\0');
  CHECK_STATUS(gpumem_options_parse(&o, "shared_group:gpu-users"), GPUMEM_OK);
  CHECK(strcmp(o.shared_group, "gpu-users") == 0);
  fx_t f = fx_new("policy:default", 8 * GIB, 0);
  gpumem_shared_budget_t info;
  if (f.gm) {
    CHECK_STATUS(gpumem_shared_budget(f.gm, &info), GPUMEM_ERR_UNSUPPORTED);
    CHECK_STATUS(gpumem_shared_budget(f.gm, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  }
  fx_done(&f);
  /* A group that does not exist: refused, naming it. */
  f = fx_new("policy:default,shared_limit:1G,shared_group:no-such-group-gpumem", 8 * GIB, 0);
  if (f.gm) {
    void* p = NULL;
    CHECK_STATUS(gpumem_malloc(f.gm, MIB, 0, &p), GPUMEM_ERR_BACKEND);
    CHECK_MSG(strstr(gpumem_last_error(), "no group named no-such-group-gpumem"), "%s",
              gpumem_last_error());
  }
  fx_done(&f);
  /* A file of the budget's name that is not one: refused, said, consistent. */
  char conf[256];
  budget_conf(conf, sizeof conf, "policy:default", GIB, ++name_seq);
  char path[200];
  snprintf(path, sizeof path, "%s/gpumem-budget.u%u.t%d-%d.-1", dir, (unsigned)geteuid(),
           (int)getpid(), name_seq);
  int bad_fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
  FILE* bad = bad_fd >= 0 ? fdopen(bad_fd, "w") : NULL;
  if (bad) {
    fputs("not a budget", bad);
    fclose(bad);
  }
  f = fx_new(conf, 8 * GIB, 0);
  if (!f.gm) return fx_done(&f);
  void* p = NULL;
  CHECK_STATUS(gpumem_malloc(f.gm, MIB, 0, &p), GPUMEM_ERR_BACKEND);
  CHECK_MSG(strstr(gpumem_last_error(), "is not a budget of this gpumem"), "%s",
            gpumem_last_error());
  fx_done(&f);
  unlink(path);
}

int main(void) {
  snprintf(dir, sizeof dir, "/tmp/gpumem_budget_XXXXXX");
  if (!mkdtemp(dir)) {
    printf("test_budget: no temporary directory\n");
    return 1;
  }
  setenv("GPUMEM_PUBLISH_DIR", dir, 1);
  for (size_t i = 0; i < sizeof policies / sizeof policies[0]; i++) {
    test_two_allocators(policies[i]);
    test_random(policies[i]);
  }
  test_lazy_reclaims();
  test_processes();
  test_bad_input();
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0) printf("test_budget: could not remove %s\n", dir);
  return test_finish("test_budget");
}
