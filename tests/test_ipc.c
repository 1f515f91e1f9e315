/* Sharing an allocation with another process (src/ipc.c) on the simulated
 * device, which has no file descriptors to export: a wrapper gives it
 * export_page (a memfd holding the page's handle) and import_page (the
 * handle read back, marked as imported so that releasing it leaves the
 * exporter's page alone). The importer is a second allocator in this
 * process, on the same simulated device, so gpumem_ipc_open takes the
 * descriptors with dup() instead of pidfd_getfd; everything else is the
 * real path: the mappings under an allocation, the handle's text, its
 * checks, the range the importer maps and unmaps, the descriptors closed
 * when the allocation is freed. gpumem_check after every operation. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"

#define MIB ((size_t)1 << 20)
#define IMPORTED ((gpumem_phys_t)1 << 62)

typedef struct share {
  gpumem_backend_t be; /* what the allocators are given: the device's table, four slots changed */
  gpumem_backend_t* dev;
  long exports, imports, imported_live;
} share_t;

/* The slots below get the device's context (the table is the device's
 * own, copied); the test's one wrapper is found here. */
static share_t* the_share;

static gpumem_status_t w_release(void* c, gpumem_phys_t page, size_t size) {
  if (page & IMPORTED) { /* the importer's reference: the page stays the exporter's */
    the_share->imported_live--;
    return GPUMEM_OK;
  }
  return the_share->dev->release_page(c, page, size);
}
static gpumem_status_t w_map(void* c, uintptr_t addr, size_t size, gpumem_phys_t page) {
  return the_share->dev->map(c, addr, size, page & ~IMPORTED);
}
static gpumem_status_t w_export(void* c, gpumem_phys_t page, int* out_fd) {
  (void)c;
  int fd = memfd_create("gpumem-test-page", 0);
  if (fd < 0) return GPUMEM_ERR_BACKEND;
  if (pwrite(fd, &page, sizeof page, 0) != (ssize_t)sizeof page) {
    close(fd);
    return GPUMEM_ERR_BACKEND;
  }
  the_share->exports++;
  *out_fd = fd;
  return GPUMEM_OK;
}
static gpumem_status_t w_import(void* c, int fd, gpumem_phys_t* out) {
  (void)c;
  gpumem_phys_t page = 0;
  if (pread(fd, &page, sizeof page, 0) != (ssize_t)sizeof page || !page) return GPUMEM_ERR_BACKEND;
  the_share->imports++;
  the_share->imported_live++;
  *out = page | IMPORTED;
  return GPUMEM_OK;
}

static void share_init(share_t* s, gpumem_backend_t* dev) {
  memset(s, 0, sizeof *s);
  s->dev = dev;
  s->be = *dev;
  s->be.name = "sim-shared";
  s->be.release_page = w_release;
  s->be.map = w_map;
  s->be.export_page = w_export;
  s->be.import_page = w_import;
  the_share = s;
}

static int open_fds(void) {
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

static gpumem_t* make(gpumem_backend_t* be, const char* conf) {
  gpumem_options_t opts;
  gpumem_options_init(&opts);
  if (conf) CHECK_STATUS(gpumem_options_parse(&opts, conf), GPUMEM_OK);
  gpumem_status_t st = GPUMEM_OK;
  gpumem_t* gm = gpumem_create(be, &opts, &st);
  CHECK_MSG(gm != NULL, "gpumem_create: %s", gpumem_last_error());
  return gm;
}

/* Export the allocation at p from a, open it in b, compare, close. */
static void round_trip(gpumem_t* a, gpumem_t* b, share_t* s, void* p) {
  size_t need = 0;
  CHECK_STATUS(gpumem_ipc_export(a, p, NULL, 0, &need), GPUMEM_OK);
  CHECK(need > 20);
  char* text = malloc(need);
  size_t again = 0;
  CHECK_STATUS(gpumem_ipc_export(a, p, text, need, &again), GPUMEM_OK);
  CHECK(again == need && strlen(text) + 1 == need);
  CHECK(strncmp(text, "gpumem-ipc/1 ", 13) == 0);
  CHECK(gpumem_check(a) == 0);
  void* q = NULL;
  long live_before = s->imported_live;
  CHECK_STATUS(gpumem_ipc_open(b, text, strlen(text), &q), GPUMEM_OK);
  CHECK(q != NULL && q != p);
  CHECK(s->imported_live > live_before);
  /* the offset into the first mapping is the allocation's own */
  size_t page = s->be.page_size;
  CHECK(((uintptr_t)q & (page - 1)) == ((uintptr_t)p & (page - 1)));
  CHECK(gpumem_check(b) == 0);
  /* the importer's statistics do not count the other process's memory */
  gpumem_stats_t st;
  gpumem_get_stats(b, &st);
  CHECK(st.allocated_bytes[GPUMEM_POOL_ALL].current == 0);
  CHECK_STATUS(gpumem_ipc_close(b, q), GPUMEM_OK);
  CHECK(s->imported_live == live_before);
  CHECK_STATUS(gpumem_ipc_close(b, q), GPUMEM_ERR_INVALID_POINTER);
  CHECK(gpumem_check(b) == 0);
  free(text);
}

static void hostile_handles(gpumem_t* b, share_t* s) {
  char big[160];
  snprintf(big, sizeof big, "gpumem-ipc/1 %d %zu 0 1 0:%zu", (int)getpid(), s->be.page_size,
           (size_t)1 << 62);
  char wrong_page[96];
  snprintf(wrong_page, sizeof wrong_page, "gpumem-ipc/1 %d 4096 0 1 3:4096", (int)getpid());
  char ok_prefix[96];
  snprintf(ok_prefix, sizeof ok_prefix, "gpumem-ipc/1 %d %zu", (int)getpid(), s->be.page_size);
  char cases[][128] = {
      "",
      "gpumem-ipc/2 1 2097152 0 1 3:2097152",
      "gpumem-ipc/1",
      "gpumem-ipc/1 0 2097152 0 1 3:2097152",
      "gpumem-ipc/1 -5 2097152 0 1 3:2097152",
      "gpumem-ipc/1 1 2097152 0 0",
      "gpumem-ipc/1 1 2097152 0 2 3:2097152",
      "gpumem-ipc/1 1 2097152 0 1 3:2097153",
      "gpumem-ipc/1 1 2097152 0 1 3:0",
      "gpumem-ipc/1 1 2097152 2097152 1 3:2097152",
      "gpumem-ipc/1 1 2097152 0 1 3:2097152 ",
      "gpumem-ipc/1 1 2097152 0 1 3:2097152x",
      "gpumem-ipc/1 1 2097152 0 1 99999999999999999999:2097152",
      "gpumem-ipc/1 1 2097152 0 1 3 2097152",
      "gpumem-ipc/1  1 2097152 0 1 3:2097152",
      "gpumem-ipc/1 1 2097152 0 70000 3:2097152",
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    void* q = (void*)1;
    clear_error();
    CHECK_STATUS(gpumem_ipc_open(b, cases[i], strlen(cases[i]), &q), GPUMEM_ERR_INVALID_ARGUMENT);
    CHECK(q == NULL);
    CHECK(strstr(gpumem_last_error(), "gpumem_ipc_open") != NULL);
    CHECK(gpumem_check(b) == 0);
  }
  void* q = (void*)1;
  CHECK_STATUS(gpumem_ipc_open(b, big, strlen(big), &q), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(gpumem_ipc_open(b, wrong_page, strlen(wrong_page), &q), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "another device kind") != NULL);
  /* well formed, but the descriptor is not open here: a clear failure, and
   * nothing is left mapped or reserved */
  char closed[160];
  snprintf(closed, sizeof closed, "%s 0 1 1000000:%zu", ok_prefix, s->be.page_size);
  long live = s->imported_live;
  CHECK_STATUS(gpumem_ipc_open(b, closed, strlen(closed), &q), GPUMEM_ERR_BACKEND);
  CHECK(strstr(gpumem_last_error(), "descriptor 1000000") != NULL);
  CHECK(s->imported_live == live);
  /* a descriptor that stands for no page: the import fails, nothing kept */
  int fd = memfd_create("empty", 0);
  char bogus[160];
  snprintf(bogus, sizeof bogus, "%s 0 1 %d:%zu", ok_prefix, fd, s->be.page_size);
  CHECK(gpumem_ipc_open(b, bogus, strlen(bogus), &q) != GPUMEM_OK);
  CHECK(s->imported_live == live);
  close(fd);
  CHECK(gpumem_check(b) == 0);
}

int main(void) {
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  so.capacity = (size_t)64 << 30;
  gpumem_backend_t* sim = gpumem_sim_create(&so);
  CHECK(sim != NULL);
  share_t s;
  share_init(&s, sim);

  /* No export slots (the plain simulated device): unsupported, said so. */
  {
    gpumem_t* plain = make(sim, NULL);
    void* p = NULL;
    CHECK_STATUS(gpumem_malloc(plain, 4 * MIB, 0, &p), GPUMEM_OK);
    size_t need = 0;
    clear_error();
    CHECK_STATUS(gpumem_ipc_export(plain, p, NULL, 0, &need), GPUMEM_ERR_UNSUPPORTED);
    CHECK(strstr(gpumem_last_error(), "file descriptors") != NULL);
    void* q = NULL;
    char h[96];
    snprintf(h, sizeof h, "gpumem-ipc/1 %d %zu 0 1 3:%zu", (int)getpid(), sim->page_size,
             sim->page_size);
    CHECK_STATUS(gpumem_ipc_open(plain, h, strlen(h), &q), GPUMEM_ERR_UNSUPPORTED);
    CHECK_STATUS(gpumem_free(plain, p), GPUMEM_OK);
    CHECK(gpumem_check(plain) == 0);
    gpumem_destroy(plain);
  }

  /* The pytorch policy (plain segments): unsupported too. */
  {
    gpumem_t* pt = make(&s.be, "policy:pytorch");
    void* p = NULL;
    CHECK_STATUS(gpumem_malloc(pt, 4 * MIB, 0, &p), GPUMEM_OK);
    size_t need = 0;
    CHECK_STATUS(gpumem_ipc_export(pt, p, NULL, 0, &need), GPUMEM_ERR_UNSUPPORTED);
    CHECK_STATUS(gpumem_free(pt, p), GPUMEM_OK);
    gpumem_destroy(pt);
  }

  const char* confs[] = {NULL, "limit:8G", "map_max:2M"};
  for (size_t c = 0; c < sizeof confs / sizeof confs[0]; c++) {
    gpumem_t* a = make(&s.be, confs[c]);
    gpumem_t* b = make(&s.be, NULL);
    int fds0 = open_fds();
    /* sizes: within one page, across pages, several large mappings */
    size_t sizes[] = {4096, 3 * MIB + 512, 300 * MIB, 1536 * MIB};
    void* ps[4] = {0};
    for (size_t i = 0; i < 4; i++) {
      CHECK_STATUS(gpumem_malloc(a, sizes[i], 0, &ps[i]), GPUMEM_OK);
      CHECK(gpumem_check(a) == 0);
    }
    for (size_t i = 0; i < 4; i++) round_trip(a, b, &s, ps[i]);
    CHECK(open_fds() > fds0); /* the exports' descriptors stay open ... */
    CHECK(s.exports > 0 && s.imports > 0);
    /* a pointer inside an allocation, or not gpumem's: refused */
    size_t need = 0;
    CHECK_STATUS(gpumem_ipc_export(a, (char*)ps[2] + 4096, NULL, 0, &need),
                 GPUMEM_ERR_INVALID_POINTER);
    CHECK_STATUS(gpumem_ipc_export(a, &need, NULL, 0, &need), GPUMEM_ERR_INVALID_POINTER);
    CHECK_STATUS(gpumem_ipc_export(a, ps[0], NULL, 0, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
    /* one allocation exported again and again (torch shares a tensor anew
     * each time): the same descriptors each time, not one set per export,
     * so 1,100 exports do not run the process out of descriptors */
    {
      char first[4096], again[4096];
      long exports_before = s.exports;
      CHECK_STATUS(gpumem_ipc_export(a, ps[2], first, sizeof first, &need), GPUMEM_OK);
      int fds_after_one = open_fds();
      bool same = true;
      for (int i = 0; i < 1100 && same; i++) {
        CHECK_STATUS(gpumem_ipc_export(a, ps[2], again, sizeof again, &need), GPUMEM_OK);
        same = strcmp(first, again) == 0;
      }
      CHECK_MSG(same, "a second export's handle differs: %s / %s", first, again);
      CHECK_MSG(open_fds() == fds_after_one,
                "%d descriptors open after 1,100 exports, %d after one", open_fds(), fds_after_one);
      CHECK(s.exports - exports_before <= 3); /* at most the first export's pages, once */
      void* q2 = NULL;
      CHECK_STATUS(gpumem_ipc_open(b, again, strlen(again), &q2), GPUMEM_OK);
      CHECK_STATUS(gpumem_ipc_close(b, q2), GPUMEM_OK);
    }
    /* an import still open when its allocator is destroyed is unmapped */
    char* text = malloc(4096);
    CHECK_STATUS(gpumem_ipc_export(a, ps[1], text, 4096, &need), GPUMEM_OK);
    void* q = NULL;
    CHECK_STATUS(gpumem_ipc_open(b, text, strlen(text), &q), GPUMEM_OK);
    free(text);
    hostile_handles(b, &s);
    for (size_t i = 0; i < 4; i++) {
      CHECK_STATUS(gpumem_free(a, ps[i]), GPUMEM_OK);
      CHECK(gpumem_check(a) == 0);
    }
    CHECK(open_fds() == fds0); /* ... until their allocations are freed */
    gpumem_destroy(b);
    CHECK(s.imported_live == 0);
    gpumem_destroy(a);
  }
  gpumem_sim_counters_t cnt;
  gpumem_sim_get_counters(sim, &cnt);
  CHECK(cnt.pages_mapped == 0 && cnt.ranges_reserved == 0 && cnt.pages_live == 0);
  gpumem_sim_destroy(sim);
  return test_finish("test_ipc");
}
