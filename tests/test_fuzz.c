/* Mutation fuzzing of everything gpumem reads from outside: configuration
 * strings (GPUMEM_CONF), byte sizes, traces, and the publication files
 * other processes leave in /dev/shm. Seeds that parse are mutated (bits
 * flipped, bytes replaced by ones the grammars care about, pieces inserted,
 * deleted, duplicated, spliced from another seed); every result must be
 * accepted or refused with a message, never crash or leak (the sanitizer
 * build runs this too), and a refusal must change nothing: the options
 * stay as they were, no trace comes back. A trace that parses is replayed
 * on the simulated device with gpumem_check after every event, and its
 * counts must agree with its events. Beside the publication pages lie
 * what a hostile user can plant (docs/security.md): FIFOs, links,
 * directories, files of every size, files changing size while read, and
 * more records than gpumem top holds; a scan must skip them without
 * blocking or SIGBUS, and top must say what it could not show.
 *
 *   test_fuzz [ROUNDS]   (default 20000 per target; GPUMEM_FUZZ_SEED=N)
 */
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"

/* The size of a published page (src/publish.c): the figures of one allocator. */
#define PUB_PAGE 216
#include "trace.h"

static uint64_t rng_state;
static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}
static size_t below(size_t n) {
  return n ? (size_t)(rng() % n) : 0;
}

/* Bytes the grammars give meaning to, and a few they should refuse. */
static const char interesting[] = ":,.-+ \t\n\r09GgMmKkTtBbiIe#_afrx\x7f\xff";

enum { MAX_TEXT = 4096 };

/* One mutation of buf (len bytes, capacity MAX_TEXT) in place. */
static size_t mutate(char* buf, size_t len, const char* other, size_t other_len) {
  int kinds = 7;
  for (int n = 1 + (int)below(4); n > 0; n--) {
    size_t at = below(len + 1);
    switch (below((size_t)kinds)) {
      case 0: /* flip a bit */
        if (len) buf[below(len)] ^= (char)(1u << below(8));
        break;
      case 1: /* replace with an interesting byte */
        if (len) buf[below(len)] = interesting[below(sizeof interesting - 1)];
        break;
      case 2: /* insert one */
        if (len < MAX_TEXT) {
          memmove(buf + at + 1, buf + at, len - at);
          buf[at] = interesting[below(sizeof interesting - 1)];
          len++;
        }
        break;
      case 3: { /* delete a piece */
        size_t k = below(len - at + 1);
        if (k > 16) k = 16;
        memmove(buf + at, buf + at + k, len - at - k);
        len -= k;
        break;
      }
      case 4: { /* duplicate a piece */
        size_t from = below(len + 1), k = below(len - from + 1);
        if (k > 64) k = 64;
        if (len + k <= MAX_TEXT) {
          char piece[64];
          memcpy(piece, buf + from, k);
          memmove(buf + at + k, buf + at, len - at);
          memcpy(buf + at, piece, k);
          len += k;
        }
        break;
      }
      case 5: /* truncate */
        len = at;
        break;
      default: { /* splice: our front, the other seed's back */
        size_t from = below(other_len + 1), k = other_len - from;
        if (at + k > MAX_TEXT) k = MAX_TEXT - at;
        memcpy(buf + at, other + from, k);
        len = at + k;
        break;
      }
    }
  }
  return len;
}

static size_t pick_mutant(const char* const* seeds, size_t num, char* buf) {
  const char* a = seeds[below(num)];
  const char* b = seeds[below(num)];
  size_t len = strlen(a);
  memcpy(buf, a, len);
  return mutate(buf, len, b, strlen(b));
}

/* ---- configuration strings and sizes ---- */

static const char* const conf_seeds[] = {
    "policy:pytorch,limit:4G,fraction:0.5",
    "policy:default,reclaim:lazy,headroom:0.002,placement:planned",
    "max_split_size_mb:512,map_max:1G,move_guard:off,stream_waits:on",
    "publish:auto,leak_check:on,oom_snapshot:/tmp/oom-%p.json",
    "reclaim:pressure,placement:bestfit, limit : 1.5GiB ,",
    "",
};

static void fuzz_conf(long rounds) {
  char buf[MAX_TEXT + 1];
  long accepted = 0;
  for (long r = 0; r < rounds; r++) {
    size_t len = pick_mutant(conf_seeds, sizeof conf_seeds / sizeof conf_seeds[0], buf);
    buf[len] = '\0';
    gpumem_options_t before, o;
    gpumem_options_init(&o);
    if (r % 2) gpumem_options_parse(&o, "limit:3G,leak_check:on"); /* a non-default start */
    before = o;
    clear_error();
    gpumem_status_t st = gpumem_options_parse(&o, buf);
    if (st == GPUMEM_OK) {
      accepted++;
      continue;
    }
    CHECK_MSG(st == GPUMEM_ERR_CONFIG && strstr(gpumem_last_error(), "gpumem config: ") &&
                  memcmp(&before, &o, sizeof o) == 0,
              "conf \"%s\": status %d, message \"%s\", options %s", buf, st, gpumem_last_error(),
              memcmp(&before, &o, sizeof o) ? "changed" : "kept");
    size_t out = 12345;
    st = gpumem_parse_size(buf, &out);
    CHECK_MSG(st == GPUMEM_OK || (out == 12345 && gpumem_last_error()[0]),
              "size \"%s\": status %d, out %zu", buf, st, out);
  }
  CHECK_MSG(accepted > rounds / 50 && accepted < rounds, "conf: %ld of %ld accepted", accepted,
            rounds);
  printf("configurations: %ld of %ld mutants accepted\n", accepted, rounds);
}

/* ---- traces ---- */

static const char* const trace_seeds[] = {
    "# gpumem-trace v1\na 1 4000000 0\na 2 6000000 0\nf 1\na 3 512 0\nf 3\n",
    "# gpumem-trace v1\na 10 1048576 0\na 11 3000000 140000\nr 10 140000\nf 11\nf 10\n",
    "# gpumem-trace v1\n# a comment\na 7 1 0\na 8 2097152 0\n\nf 8\na 9 99999999 3\n",
};

static void replay_checked(const trace_t* t, gpumem_backend_t* sim, const char* text) {
  gpumem_t* gm = gpumem_create(sim, NULL, NULL);
  CHECK(gm != NULL);
  if (!gm) return;
  void** slots = calloc(t->num_allocs ? t->num_allocs : 1, sizeof *slots);
  for (size_t i = 0; slots && i < t->num_events; i++) {
    const trace_event_t* e = &t->events[i];
    if (e->op == TRACE_ALLOC) {
      gpumem_status_t st = gpumem_malloc(gm, e->size, e->stream, &slots[e->id]);
      CHECK_MSG(st == GPUMEM_OK || st == GPUMEM_ERR_OUT_OF_MEMORY, "alloc: %d", st);
    } else if (e->op == TRACE_FREE) {
      CHECK_STATUS(gpumem_free(gm, slots[e->id]), GPUMEM_OK);
      slots[e->id] = NULL;
    } else if (slots[e->id]) {
      CHECK_STATUS(gpumem_record_stream(gm, slots[e->id], e->stream), GPUMEM_OK);
    }
    if (gpumem_check(gm) != 0) {
      CHECK_MSG(false, "trace \"%s\" event %zu: %s", text, i, gpumem_last_error());
      break;
    }
  }
  free(slots);
  gpumem_destroy(gm);
}

static void fuzz_traces(long rounds) {
  char buf[MAX_TEXT + 1];
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = (size_t)1 << 30; /* small: mutated sizes run out of memory */
  gpumem_backend_t* sim = gpumem_sim_create(&so);
  CHECK(sim != NULL);
  long parsed = 0;
  for (long r = 0; sim && r < rounds; r++) {
    size_t len = pick_mutant(trace_seeds, sizeof trace_seeds / sizeof trace_seeds[0], buf);
    buf[len] = '\0';
    trace_t* t = (trace_t*)0x1;
    clear_error();
    gpumem_status_t st = trace_parse("fuzz.trace", buf, len, &t);
    if (st != GPUMEM_OK) {
      CHECK_MSG(t == NULL && strstr(gpumem_last_error(), "fuzz.trace"),
                "refused trace: out %p, message \"%s\"", (void*)t, gpumem_last_error());
      continue;
    }
    parsed++;
    size_t allocs = 0, frees = 0, records = 0;
    for (size_t i = 0; i < t->num_events; i++) {
      allocs += t->events[i].op == TRACE_ALLOC;
      frees += t->events[i].op == TRACE_FREE;
      records += t->events[i].op == TRACE_RECORD_STREAM;
      CHECK(t->events[i].id < t->num_allocs);
    }
    CHECK_MSG(allocs == t->num_allocs && frees == t->num_frees &&
                  records == t->num_record_streams && frees <= allocs,
              "trace counts: %zu/%zu allocs, %zu/%zu frees", allocs, t->num_allocs, frees,
              t->num_frees);
    replay_checked(t, sim, buf);
    trace_free(t);
  }
  CHECK_MSG(parsed > rounds / 50 && parsed < rounds, "traces: %ld of %ld parsed", parsed, rounds);
  printf("traces: %ld of %ld mutants parsed and replayed\n", parsed, rounds);
  gpumem_sim_destroy(sim);
}

/* ---- publication files ---- */

typedef struct scan_seen {
  int n;
  char path[256]; /* the last page read */
} scan_seen_t;

static int count_one(const gpumem_published_t* p, void* arg) {
  scan_seen_t* seen = (scan_seen_t*)arg;
  seen->n++;
  snprintf(seen->path, sizeof seen->path, "%s", p->path);
  CHECK(memchr(p->process, '\0', sizeof p->process) && memchr(p->policy, '\0', sizeof p->policy));
  return 0;
}

/* A fresh publication directory (dir: a mkdtemp template) and an allocator
 * on the simulated device that has published its page there; NULL when
 * either could not be made (a failed check says which). */
static gpumem_t* published_allocator(char* dir) {
  if (!mkdtemp(dir)) {
    CHECK_MSG(false, "mkdtemp failed");
    return NULL;
  }
  setenv("GPUMEM_PUBLISH_DIR", dir, 1);
  gpumem_backend_t* sim = gpumem_sim_create(NULL);
  gpumem_options_t o;
  gpumem_options_init(&o);
  o.publish = GPUMEM_PUBLISH_ON;
  o.own_backend = 1; /* (destroyed with the allocator) */
  gpumem_t* gm = sim ? gpumem_create(sim, &o, NULL) : NULL;
  CHECK(gm != NULL && gpumem_publish(gm) == GPUMEM_OK);
  return gm;
}

/* A real page, then mutated copies of it beside it: the scan reads what is
 * consistent, skips the rest, and its strings stay terminated. */
static void fuzz_publication(long rounds) {
  char dir[] = "/tmp/gpumem_fuzz_XXXXXX";
  gpumem_t* gm = published_allocator(dir);
  if (!gm) return;
  char page[4096];
  size_t page_len = 0;
  scan_seen_t seen = {0, ""};
  CHECK(gpumem_published_scan(dir, count_one, &seen) == 1 && seen.n == 1);
  FILE* f = fopen(seen.path, "rb");
  if (f) {
    page_len = fread(page, 1, sizeof page, f);
    fclose(f);
  }
  CHECK_MSG(page_len == PUB_PAGE, "page of %zu bytes at %s", page_len, seen.path);
  char mutant_path[420];
  snprintf(mutant_path, sizeof mutant_path, "%s/gpumem.999999.1", dir);
  int read_back = 0;
  for (long r = 0; page_len && r < rounds; r++) {
    char buf[4096];
    memcpy(buf, page, page_len);
    size_t len = page_len;
    /* in place mostly (the size is checked first), sometimes resized */
    for (int n = 1 + (int)below(8); n > 0; n--) buf[below(len)] = (char)rng();
    if (r % 8 == 0) len = mutate(buf, len, page, page_len);
    f = fopen(mutant_path, "wb");
    if (!f) break;
    fwrite(buf, 1, len, f);
    fclose(f);
    seen.n = 0;
    int got = gpumem_published_scan(dir, count_one, &seen);
    CHECK_MSG(got == seen.n && (got == 1 || got == 2), "scan: %d (%d)", got, seen.n);
    read_back += got == 2;
  }
  unlink(mutant_path);
  /* Mutations outside the checked header read back (and are shown). */
  CHECK_MSG(read_back > 0, "no mutated page was ever read back");
  printf("publication: %d of %ld mutated pages read back\n", read_back, rounds);
  gpumem_destroy(gm);
  unsetenv("GPUMEM_PUBLISH_DIR");
  rmdir(dir);
}

typedef struct resizer {
  char path[300];
  volatile int stop;
} resizer_t;

/* Changes a page's size between every size a reader checks for. */
static void* resize_loop(void* arg) {
  resizer_t* z = arg;
  static const off_t sizes[] = {0, PUB_PAGE - 1, PUB_PAGE, PUB_PAGE + 1, 8, 4096};
  for (unsigned i = 0; !z->stop; i++) {
    if (truncate(z->path, sizes[i % 6]) != 0) break;
  }
  return NULL;
}

static size_t run_top_output(const char* dir, const char* args, char* out, size_t cap) {
  char exe[512], cmd[1400];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  out[0] = '\0';
  if (n <= 0) return 0;
  exe[n] = '\0';
  char* slash = strrchr(exe, '/');
  if (slash) *slash = '\0';
  snprintf(cmd, sizeof cmd, "%s/../gpumem top %s --dir %s 2>&1", exe, args, dir);
  FILE* f = popen(cmd, "r");
  if (!f) return 0;
  size_t len = fread(out, 1, cap - 1, f);
  out[len] = '\0';
  pclose(f);
  return len;
}

/* One live page among what a hostile user plants, rounds times a fresh
 * random mix: every scan reads the live page, never blocks on a FIFO
 * (the alarm would end the test), never dies of SIGBUS on a file that
 * shrinks under it, and reads no more pages than regular files of a whole page (PUB_PAGE bytes)
 * lie there. Then more dead records than top holds. */
static void fuzz_hostile_entries(long rounds) {
  char dir[] = "/tmp/gpumem_fuzz_hostile_XXXXXX";
  gpumem_t* gm = published_allocator(dir);
  if (!gm) return;
  scan_seen_t seen = {0, ""};
  CHECK(gpumem_published_scan(dir, count_one, &seen) == 1);
  char live[256], page[PUB_PAGE];
  snprintf(live, sizeof live, "%s", seen.path);
  int fd = open(live, O_RDONLY);
  CHECK(fd >= 0 && read(fd, page, sizeof page) == (ssize_t)sizeof page);
  if (fd >= 0) close(fd);
  resizer_t z = {"", 0};
  snprintf(z.path, sizeof z.path, "%s/gpumem.424242.0", dir);
  pthread_t t;
  bool resizing = false;
  alarm(600);
  long kinds[7] = {0};
  for (long r = 0; r < rounds; r++) {
    int planted = 1 + (int)below(6), whole = 0;
    char names[8][300];
    for (int k = 0; k < planted; k++) {
      snprintf(names[k], sizeof names[k], "%s/gpumem.%d.%d", dir, 500000 + (int)r, k);
      int kind = (int)below(7);
      kinds[kind]++;
      if (kind == 0) {
        CHECK(mkfifo(names[k], 0600) == 0);
      } else if (kind == 1) {
        CHECK(symlink(below(2) ? live : "/nonexistent/gpumem", names[k]) == 0);
      } else if (kind == 2) {
        CHECK(mkdir(names[k], 0700) == 0);
      } else if (kind == 3) {
        CHECK(symlink("/dev/zero", names[k]) == 0);
      } else {
        /* a copy of the live page, of a random size, some bytes changed */
        static const size_t sizes[] = {0,        1,        PUB_PAGE - 1, PUB_PAGE,
                                       PUB_PAGE, PUB_PAGE, PUB_PAGE + 1, 4096};
        size_t len = sizes[below(8)];
        char buf[4096];
        memset(buf, 0, sizeof buf);
        memcpy(buf, page, sizeof page);
        if (below(2)) buf[below(PUB_PAGE)] = (char)rng();
        int w = open(names[k], O_WRONLY | O_CREAT | O_EXCL, 0600);
        CHECK(w >= 0 && write(w, buf, len) == (ssize_t)len);
        if (w >= 0) close(w);
        whole += len == PUB_PAGE;
      }
    }
    if (!resizing) {
      int w = open(z.path, O_WRONLY | O_CREAT | O_EXCL, 0600);
      CHECK(w >= 0 && write(w, page, sizeof page) == (ssize_t)sizeof page);
      if (w >= 0) close(w);
      resizing = pthread_create(&t, NULL, resize_loop, &z) == 0;
    }
    seen.n = 0;
    int got = gpumem_published_scan(dir, count_one, &seen);
    /* the live page, the resized one when whole, the planted whole ones */
    CHECK_MSG(got >= 1 && got <= 2 + whole, "round %ld: %d pages read, %d whole planted", r, got,
              whole);
    for (int k = 0; k < planted; k++) {
      if (unlink(names[k]) != 0) rmdir(names[k]);
    }
  }
  alarm(0);
  z.stop = 1;
  if (resizing) pthread_join(t, NULL);
  unlink(z.path);
  printf("hostile entries: %ld FIFOs, %ld links, %ld directories, %ld device links, %ld files\n",
         kinds[0], kinds[1], kinds[2], kinds[3], kinds[4] + kinds[5] + kinds[6]);
  /* more records than top holds: the live one kept, the rest counted */
  for (int i = 0; i < 300; i++) {
    char path[300];
    snprintf(path, sizeof path, "%s/gpumem.999998.%d", dir, i);
    int w = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
    CHECK(w >= 0 && write(w, page, sizeof page) == (ssize_t)sizeof page);
    if (w >= 0) close(w);
  }
  static char out[1 << 20];
  run_top_output(dir, "--once --max-rows 100", out, sizeof out);
  char mine[32];
  snprintf(mine, sizeof mine, "\n%8d  ", (int)getpid());
  CHECK_MSG(strstr(out, "100 allocators published") &&
                strstr(out, "201 more allocator records not shown (more than 100") &&
                strstr(out, mine) && strstr(out, "1 running"),
            "%.600s", out);
  run_top_output(dir, "--clean --once", out, sizeof out);
  CHECK_MSG(strstr(out, "removed 300 files") && strstr(out, "1 allocator published"), "%.300s",
            out);
  gpumem_destroy(gm);
  unsetenv("GPUMEM_PUBLISH_DIR");
  rmdir(dir);
}

int main(int argc, char** argv) {
  long rounds = argc > 1 ? atol(argv[1]) : 20000;
  if (rounds <= 0) rounds = 20000;
  const char* seed = getenv("GPUMEM_FUZZ_SEED");
  rng_state = seed ? strtoull(seed, NULL, 10) : 0x2545f4914f6cdd1dull;
  if (!rng_state) rng_state = 1;
  printf("test_fuzz: seed %" PRIu64 ", %ld rounds per target\n", rng_state, rounds);
  fuzz_conf(rounds);
  fuzz_traces(rounds);
  fuzz_publication(rounds / 4);
  fuzz_hostile_entries(rounds / 20);
  return test_finish("test_fuzz");
}
