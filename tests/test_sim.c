/* Unit tests of the simulated device: every slot, its validation errors,
 * capacity, counters, host backing, scripted failures and events. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "gpumem.h"
#include "gpumem_backend.h"
#include "test_util.h"

#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

static gpumem_backend_t* make_sim(size_t capacity, int host_backed) {
  gpumem_sim_options_t opts;
  gpumem_sim_options_init(&opts);
  opts.capacity = capacity;
  opts.host_backed = host_backed;
  return gpumem_sim_create(&opts);
}

static gpumem_sim_counters_t counters_of(gpumem_backend_t* sim) {
  gpumem_sim_counters_t c;
  gpumem_sim_get_counters(sim, &c);
  return c;
}

static int last_error_has(const char* text) {
  return strstr(gpumem_last_error(), text) != NULL;
}

static void test_options_and_shape(void) {
  gpumem_sim_options_t opts;
  gpumem_sim_options_init(&opts);
  CHECK(opts.struct_size == sizeof opts);
  CHECK(opts.capacity == 80 * GIB);
  CHECK(opts.page_size == 2 * MIB);
  CHECK(opts.descending_addresses == 1);
  CHECK(opts.host_backed == 0);
  CHECK(opts.event_delay_queries == 0);
  CHECK(opts.virtual_memory == 1 && opts.plain_memory == 1);

  gpumem_backend_t* sim = gpumem_sim_create(NULL);
  CHECK(sim != NULL);
  if (sim == NULL) return;
  CHECK(sim->version == GPUMEM_BACKEND_VERSION);
  CHECK(strcmp(sim->name, "sim") == 0);
  CHECK(sim->page_size == 2 * MIB);
  CHECK(sim->reserve && sim->release_range && sim->create_page && sim->release_page);
  CHECK(sim->map && sim->unmap && sim->alloc && sim->free && sim->mem_info);
  CHECK(sim->event_create && sim->event_destroy && sim->event_record && sim->event_query);
  CHECK(sim->event_sync && sim->stream_sync && sim->device_sync && sim->stream_wait &&
        sim->destroy);
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_STATUS(sim->mem_info(sim->ctx, &free_bytes, &total_bytes), GPUMEM_OK);
  CHECK(total_bytes == 80 * GIB && free_bytes == 80 * GIB);
  /* The destroy slot frees the whole device (ASan reports a leak otherwise). */
  sim->destroy(sim);

  opts.virtual_memory = 0;
  sim = gpumem_sim_create(&opts);
  CHECK(sim != NULL);
  if (sim != NULL) {
    CHECK(sim->page_size == 0);
    CHECK(!sim->reserve && !sim->release_range && !sim->create_page && !sim->release_page);
    CHECK(!sim->map && !sim->unmap);
    CHECK(sim->alloc && sim->free);
    gpumem_sim_destroy(sim);
  }

  gpumem_sim_options_init(&opts);
  opts.plain_memory = 0;
  sim = gpumem_sim_create(&opts);
  CHECK(sim != NULL);
  if (sim != NULL) {
    CHECK(sim->page_size == 2 * MIB && sim->map != NULL);
    CHECK(sim->alloc == NULL && sim->free == NULL);
    gpumem_sim_destroy(sim);
  }

  /* Bad options name themselves. */
  gpumem_sim_options_init(&opts);
  opts.page_size = 3 * MIB;
  CHECK(gpumem_sim_create(&opts) == NULL);
  CHECK(last_error_has("page_size"));
  gpumem_sim_options_init(&opts);
  opts.virtual_memory = 0;
  opts.plain_memory = 0;
  CHECK(gpumem_sim_create(&opts) == NULL);
  CHECK(last_error_has("plain_memory"));
  gpumem_sim_options_init(&opts);
  opts.capacity = 0;
  CHECK(gpumem_sim_create(&opts) == NULL);
  CHECK(last_error_has("capacity"));
  memset(&opts, 0, sizeof opts);
  CHECK(gpumem_sim_create(&opts) == NULL);
  CHECK(last_error_has("struct_size"));

  gpumem_sim_destroy(NULL); /* safe */
}

static void test_plain_addresses(void) {
  gpumem_backend_t* sim = make_sim(GIB, 0);
  void* ctx = sim->ctx;
  uintptr_t a = 0, b = 0, c = 0;
  CHECK_STATUS(sim->alloc(ctx, 3 * MIB, &a), GPUMEM_OK);
  CHECK_STATUS(sim->alloc(ctx, 1000, &b), GPUMEM_OK);
  CHECK_STATUS(sim->alloc(ctx, 20 * MIB, &c), GPUMEM_OK);
  /* Descending, page aligned (so also 512-byte aligned), nonzero, disjoint. */
  CHECK(a != 0 && b != 0 && c != 0);
  CHECK(b < a && c < b);
  CHECK(a % (2 * MIB) == 0 && b % (2 * MIB) == 0 && c % (2 * MIB) == 0);
  CHECK(b + 1000 <= a && c + 20 * MIB <= b);
  /* A freed range is not handed out again while others are live. */
  CHECK_STATUS(sim->free(ctx, b, 1000), GPUMEM_OK);
  uintptr_t d = 0;
  CHECK_STATUS(sim->alloc(ctx, 1000, &d), GPUMEM_OK);
  CHECK(d < c);
  gpumem_sim_counters_t cnt = counters_of(sim);
  CHECK(cnt.plain_live == 3);
  CHECK(cnt.bytes_in_use == 3 * MIB + 20 * MIB + 1000);
  CHECK(cnt.peak_bytes_in_use == 3 * MIB + 20 * MIB + 1000);
  CHECK(cnt.calls[GPUMEM_CALL_alloc] == 4 && cnt.calls[GPUMEM_CALL_free] == 1);
  gpumem_sim_destroy(sim);

  /* Ascending when asked. */
  gpumem_sim_options_t opts;
  gpumem_sim_options_init(&opts);
  opts.descending_addresses = 0;
  opts.page_size = 4096;
  sim = gpumem_sim_create(&opts);
  CHECK_STATUS(sim->alloc(sim->ctx, 100, &a), GPUMEM_OK);
  CHECK_STATUS(sim->alloc(sim->ctx, 5000, &b), GPUMEM_OK);
  CHECK_STATUS(sim->alloc(sim->ctx, 1, &c), GPUMEM_OK);
  CHECK(a != 0 && a < b && b < c);
  CHECK(a % 4096 == 0 && b % 4096 == 0 && c % 4096 == 0);
  CHECK(a + 100 <= b && b + 5000 <= c);
  CHECK_STATUS(sim->free(sim->ctx, b, 5000), GPUMEM_OK);
  CHECK_STATUS(sim->free(sim->ctx, a, 100), GPUMEM_OK);
  CHECK_STATUS(sim->free(sim->ctx, c, 1), GPUMEM_OK);
  CHECK(counters_of(sim).plain_live == 0 && counters_of(sim).bytes_in_use == 0);
  gpumem_sim_destroy(sim);
}

static void test_plain_capacity_and_errors(void) {
  gpumem_backend_t* sim = make_sim(10 * MIB, 0);
  void* ctx = sim->ctx;
  uintptr_t a = 0, b = 0, c = 0;
  CHECK_STATUS(sim->alloc(ctx, 6 * MIB, &a), GPUMEM_OK);
  CHECK_STATUS(sim->alloc(ctx, 4 * MIB, &b), GPUMEM_OK); /* exactly full */
  size_t free_bytes = 1, total_bytes = 0;
  CHECK_STATUS(sim->mem_info(ctx, &free_bytes, &total_bytes), GPUMEM_OK);
  CHECK(free_bytes == 0 && total_bytes == 10 * MIB);

  c = 12345;
  CHECK_STATUS(sim->alloc(ctx, 1, &c), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(c == 12345); /* out untouched on failure */
  CHECK(last_error_has("sim: out of memory"));
  CHECK(last_error_has("in use of"));
  CHECK(last_error_has("10.00 MiB capacity"));
  CHECK(counters_of(sim).plain_live == 2);

  CHECK_STATUS(sim->free(ctx, b, 4 * MIB), GPUMEM_OK);
  CHECK_STATUS(sim->mem_info(ctx, &free_bytes, &total_bytes), GPUMEM_OK);
  CHECK(free_bytes == 4 * MIB);
  CHECK_STATUS(sim->alloc(ctx, 5 * MIB, &c), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(sim->alloc(ctx, 4 * MIB, &c), GPUMEM_OK);

  /* Validation. */
  CHECK_STATUS(sim->alloc(ctx, 0, &c), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(sim->alloc(ctx, 1, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(sim->free(ctx, a + 512, 6 * MIB), GPUMEM_ERR_BACKEND); /* interior */
  CHECK(last_error_has("not a live plain allocation"));
  CHECK_STATUS(sim->free(ctx, 0x1234, 6 * MIB), GPUMEM_ERR_BACKEND);     /* never handed out */
  CHECK_STATUS(sim->free(ctx, a, 5 * MIB), GPUMEM_ERR_INVALID_ARGUMENT); /* wrong size */
  CHECK(last_error_has("allocated with"));
  CHECK_STATUS(sim->free(ctx, a, 6 * MIB), GPUMEM_OK);
  CHECK_STATUS(sim->free(ctx, a, 6 * MIB), GPUMEM_ERR_BACKEND); /* double free */
  CHECK_STATUS(sim->free(ctx, c, 4 * MIB), GPUMEM_OK);
  gpumem_sim_counters_t cnt = counters_of(sim);
  CHECK(cnt.plain_live == 0 && cnt.bytes_in_use == 0 && cnt.peak_bytes_in_use == 10 * MIB);
  gpumem_sim_destroy(sim);
}

/* Many interleaved allocations and frees: exercises the lookup structure's
 * compaction and checks lookups stay exact (and quick: this runs 2*10^5
 * calls). */
static void test_plain_many(void) {
  gpumem_sim_options_t opts;
  gpumem_sim_options_init(&opts);
  opts.capacity = 64 * GIB;
  opts.page_size = 4096;
  opts.host_backed = 1;
  gpumem_backend_t* sim = gpumem_sim_create(&opts);
  enum { LIVE = 512, ROUNDS = 100000 };
  uintptr_t addrs[LIVE] = {0};
  size_t sizes[LIVE] = {0};
  uint32_t rng = 12345;
  int errors = 0;
  for (int round = 0; round < ROUNDS; round++) {
    rng = rng * 1664525u + 1013904223u;
    int slot = (int)((rng >> 8) % LIVE);
    if (addrs[slot] != 0) {
      unsigned char* host = gpumem_sim_host_ptr(sim, addrs[slot] + sizes[slot] - 1);
      if (host == NULL || *host != (unsigned char)slot) errors++;
      if (sim->free(sim->ctx, addrs[slot], sizes[slot]) != GPUMEM_OK) errors++;
      if (gpumem_sim_host_ptr(sim, addrs[slot]) != NULL) errors++;
      addrs[slot] = 0;
    } else {
      sizes[slot] = 1 + (rng >> 20) % 9000;
      if (sim->alloc(sim->ctx, sizes[slot], &addrs[slot]) != GPUMEM_OK) errors++;
      unsigned char* host = gpumem_sim_host_ptr(sim, addrs[slot] + sizes[slot] - 1);
      if (host == NULL) {
        errors++;
      } else {
        *host = (unsigned char)slot;
      }
    }
  }
  CHECK(errors == 0);
  size_t live = 0, bytes = 0;
  for (int i = 0; i < LIVE; i++) {
    if (addrs[i] == 0) continue;
    live++;
    bytes += sizes[i];
  }
  gpumem_sim_counters_t cnt = counters_of(sim);
  CHECK(cnt.plain_live == live);
  CHECK(cnt.bytes_in_use == bytes);
  gpumem_sim_destroy(sim); /* frees the live ones too */
}

static void test_vm_lifecycle(void) {
  gpumem_backend_t* sim = make_sim(64 * MIB, 0);
  void* ctx = sim->ctx;
  const size_t page = 2 * MIB;
  uintptr_t r1 = 0, r2 = 0;
  CHECK_STATUS(sim->reserve(ctx, 16 * page, &r1), GPUMEM_OK);
  CHECK_STATUS(sim->reserve(ctx, 8 * page, &r2), GPUMEM_OK);
  CHECK(r1 != 0 && r1 % page == 0 && r2 % page == 0);
  CHECK(r2 >= r1 + 16 * page || r2 + 8 * page <= r1); /* disjoint */
  /* Reserving address space does not take device memory. */
  CHECK(counters_of(sim).bytes_in_use == 0);
  CHECK(counters_of(sim).ranges_reserved == 2);

  gpumem_phys_t p1 = 0, p2 = 0, p3 = 0;
  CHECK_STATUS(sim->create_page(ctx, page, &p1), GPUMEM_OK);
  CHECK_STATUS(sim->create_page(ctx, 2 * page, &p2), GPUMEM_OK);
  CHECK_STATUS(sim->create_page(ctx, page, &p3), GPUMEM_OK);
  CHECK(p1 != 0 && p1 != p2 && p2 != p3 && p1 != p3);
  gpumem_sim_counters_t cnt = counters_of(sim);
  CHECK(cnt.pages_live == 3 && cnt.bytes_in_use == 4 * page && cnt.pages_mapped == 0);

  /* Map three consecutive mappings, then unmap two of them in one call. */
  CHECK_STATUS(sim->map(ctx, r1, page, p1), GPUMEM_OK);
  CHECK_STATUS(sim->map(ctx, r1 + page, 2 * page, p2), GPUMEM_OK);
  CHECK_STATUS(sim->map(ctx, r1 + 3 * page, page, p3), GPUMEM_OK);
  CHECK(counters_of(sim).pages_mapped == 3);
  CHECK_STATUS(sim->unmap(ctx, r1, 3 * page), GPUMEM_OK);
  CHECK(counters_of(sim).pages_mapped == 1);
  /* The unmapped pages map again, elsewhere, in the other range. */
  CHECK_STATUS(sim->map(ctx, r2 + 6 * page, 2 * page, p2), GPUMEM_OK);
  CHECK_STATUS(sim->map(ctx, r2, page, p1), GPUMEM_OK);
  CHECK(counters_of(sim).pages_mapped == 3);

  /* A range with mappings cannot go; an empty one can. */
  CHECK_STATUS(sim->release_range(ctx, r2, 8 * page), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("still holds 2 mappings"));
  CHECK_STATUS(sim->unmap(ctx, r2, page), GPUMEM_OK);
  CHECK_STATUS(sim->unmap(ctx, r2 + 6 * page, 2 * page), GPUMEM_OK);
  CHECK_STATUS(sim->unmap(ctx, r1 + 3 * page, page), GPUMEM_OK);
  CHECK_STATUS(sim->release_range(ctx, r2, 8 * page), GPUMEM_OK);
  CHECK(counters_of(sim).ranges_reserved == 1);
  CHECK_STATUS(sim->release_range(ctx, r2, 8 * page), GPUMEM_ERR_BACKEND); /* twice */
  CHECK_STATUS(sim->map(ctx, r2, page, p1), GPUMEM_ERR_BACKEND);           /* gone */

  CHECK_STATUS(sim->release_page(ctx, p1, page), GPUMEM_OK);
  CHECK_STATUS(sim->release_page(ctx, p2, 2 * page), GPUMEM_OK);
  CHECK_STATUS(sim->release_page(ctx, p3, page), GPUMEM_OK);
  CHECK_STATUS(sim->release_range(ctx, r1, 16 * page), GPUMEM_OK);
  cnt = counters_of(sim);
  CHECK(cnt.pages_live == 0 && cnt.pages_mapped == 0 && cnt.ranges_reserved == 0);
  CHECK(cnt.bytes_in_use == 0 && cnt.peak_bytes_in_use == 4 * page);
  CHECK(cnt.calls[GPUMEM_CALL_reserve] == 2 && cnt.calls[GPUMEM_CALL_map] == 6);
  CHECK(cnt.calls[GPUMEM_CALL_unmap] == 4 && cnt.calls[GPUMEM_CALL_release_range] == 4);
  gpumem_sim_destroy(sim);
}

static void test_vm_capacity(void) {
  gpumem_backend_t* sim = make_sim(8 * MIB, 0);
  void* ctx = sim->ctx;
  gpumem_phys_t p = 0, q = 0;
  uintptr_t plain = 0;
  CHECK_STATUS(sim->create_page(ctx, 4 * MIB, &p), GPUMEM_OK);
  CHECK_STATUS(sim->alloc(ctx, 2 * MIB, &plain), GPUMEM_OK);
  /* Pages and plain memory share the capacity. */
  q = 77;
  CHECK_STATUS(sim->create_page(ctx, 4 * MIB, &q), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(q == 77);
  CHECK(last_error_has("sim: out of memory: 4.00 MiB requested, 6.00 MiB in use of 8.00 MiB"));
  CHECK(counters_of(sim).pages_live == 1);
  CHECK_STATUS(sim->create_page(ctx, 2 * MIB, &q), GPUMEM_OK);
  size_t free_bytes = 1, total_bytes = 0;
  CHECK_STATUS(sim->mem_info(ctx, &free_bytes, &total_bytes), GPUMEM_OK);
  CHECK(free_bytes == 0 && total_bytes == 8 * MIB);
  CHECK_STATUS(sim->alloc(ctx, 1, &plain), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(sim->release_page(ctx, p, 4 * MIB), GPUMEM_OK);
  CHECK_STATUS(sim->mem_info(ctx, &free_bytes, &total_bytes), GPUMEM_OK);
  CHECK(free_bytes == 4 * MIB);
  gpumem_sim_destroy(sim);
}

static void test_vm_validation(void) {
  gpumem_backend_t* sim = make_sim(GIB, 0);
  void* ctx = sim->ctx;
  const size_t page = 2 * MIB;
  uintptr_t r = 0, other = 0;
  gpumem_phys_t p = 0, big = 0, q = 0;

  /* reserve and create_page sizes. */
  CHECK_STATUS(sim->reserve(ctx, 0, &r), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(sim->reserve(ctx, page + 4096, &r), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(last_error_has("multiple of the page size"));
  CHECK_STATUS(sim->reserve(ctx, page, NULL), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(sim->create_page(ctx, page / 2, &p), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(sim->create_page(ctx, 0, &p), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(counters_of(sim).ranges_reserved == 0 && counters_of(sim).pages_live == 0);

  CHECK_STATUS(sim->reserve(ctx, 4 * page, &r), GPUMEM_OK);
  CHECK_STATUS(sim->reserve(ctx, 4 * page, &other), GPUMEM_OK);
  CHECK_STATUS(sim->create_page(ctx, page, &p), GPUMEM_OK);
  CHECK_STATUS(sim->create_page(ctx, 2 * page, &big), GPUMEM_OK);
  CHECK_STATUS(sim->create_page(ctx, page, &q), GPUMEM_OK);

  /* map: outside any range, running past the end, misaligned, bad sizes,
   * unknown page, size not the page's, over a mapping. */
  CHECK_STATUS(sim->map(ctx, 0x200000, page, p), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("not in a reserved range"));
  CHECK_STATUS(sim->map(ctx, r + 4 * page, page, p), GPUMEM_ERR_BACKEND); /* just past r */
  CHECK_STATUS(sim->map(ctx, r + 3 * page, 2 * page, big), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("runs past the end"));
  CHECK_STATUS(sim->map(ctx, r + 4096, page, p), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(last_error_has("not aligned"));
  CHECK_STATUS(sim->map(ctx, r, 4096, p), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(sim->map(ctx, r, page, 999999), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("unknown page"));
  CHECK_STATUS(sim->map(ctx, r, page, big), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(last_error_has("map it whole"));
  CHECK(counters_of(sim).pages_mapped == 0);

  CHECK_STATUS(sim->map(ctx, r + page, 2 * page, big), GPUMEM_OK);
  CHECK_STATUS(sim->map(ctx, r + page, page, p), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("already mapped"));
  CHECK_STATUS(sim->map(ctx, r + 2 * page, page, p), GPUMEM_ERR_BACKEND); /* its 2nd half */
  CHECK(counters_of(sim).pages_mapped == 1);

  /* A page may be mapped at several addresses, as CUDA allows (the
   * allocator's ghosts); it is released only when no mapping is left. */
  CHECK_STATUS(sim->map(ctx, other, 2 * page, big), GPUMEM_OK);
  CHECK(counters_of(sim).pages_mapped == 2);
  CHECK_STATUS(sim->release_page(ctx, big, 2 * page), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("still mapped (2 mappings"));
  CHECK_STATUS(sim->unmap(ctx, other + page, page), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("starts inside"));
  CHECK_STATUS(sim->unmap(ctx, other, 2 * page), GPUMEM_OK);
  CHECK(counters_of(sim).pages_mapped == 1);

  /* unmap: nothing there, starting or ending inside a mapping, gaps,
   * outside a range, misaligned. Each refusal leaves the mapping intact. */
  CHECK_STATUS(sim->unmap(ctx, r, page), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("nothing is mapped"));
  CHECK_STATUS(sim->unmap(ctx, r + page, page), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("ends inside"));
  CHECK_STATUS(sim->unmap(ctx, r + 2 * page, page), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("starts inside"));
  CHECK_STATUS(sim->unmap(ctx, r + page, 3 * page), GPUMEM_ERR_BACKEND); /* then a hole */
  CHECK_STATUS(sim->unmap(ctx, r, 3 * page), GPUMEM_ERR_BACKEND);        /* hole first */
  CHECK_STATUS(sim->unmap(ctx, 0x200000, page), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->unmap(ctx, r + page + 512, page), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(sim->unmap(ctx, r + page, 0), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(counters_of(sim).pages_mapped == 1);

  /* One unmap may cover several whole, consecutive mappings. */
  CHECK_STATUS(sim->map(ctx, r + 3 * page, page, q), GPUMEM_OK);
  CHECK_STATUS(sim->unmap(ctx, r + page, 3 * page), GPUMEM_OK); /* two mappings at once */
  CHECK(counters_of(sim).pages_mapped == 0);

  /* release_page: unknown, wrong size, mapped. */
  CHECK_STATUS(sim->map(ctx, r, page, p), GPUMEM_OK);
  CHECK_STATUS(sim->release_page(ctx, p, page), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("still mapped"));
  CHECK_STATUS(sim->release_page(ctx, 424242, page), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("unknown page"));
  CHECK_STATUS(sim->release_page(ctx, big, page), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(counters_of(sim).pages_live == 3);

  /* release_range: unknown, interior, wrong size, with mappings. */
  CHECK_STATUS(sim->release_range(ctx, 0x1000, page), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("no range reserved there"));
  CHECK_STATUS(sim->release_range(ctx, r + page, 3 * page), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->release_range(ctx, other, 2 * page), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(sim->release_range(ctx, r, 4 * page), GPUMEM_ERR_BACKEND);
  CHECK(counters_of(sim).ranges_reserved == 2);

  CHECK_STATUS(sim->unmap(ctx, r, page), GPUMEM_OK);
  CHECK_STATUS(sim->release_page(ctx, p, page), GPUMEM_OK);
  CHECK_STATUS(sim->release_page(ctx, p, page), GPUMEM_ERR_BACKEND); /* twice */
  CHECK_STATUS(sim->map(ctx, r, page, p), GPUMEM_ERR_BACKEND);       /* released */
  gpumem_sim_destroy(sim); /* frees live ranges and pages too */
}

static void test_host_backed(void) {
  gpumem_backend_t* sim = make_sim(GIB, 1);
  void* ctx = sim->ctx;
  const size_t page = 2 * MIB;

  /* Plain memory: every byte, interior addresses included, zeroed. */
  uintptr_t a = 0, b = 0;
  CHECK_STATUS(sim->alloc(ctx, 3000, &a), GPUMEM_OK);
  CHECK_STATUS(sim->alloc(ctx, 100, &b), GPUMEM_OK);
  unsigned char* ha = gpumem_sim_host_ptr(sim, a);
  unsigned char* hb = gpumem_sim_host_ptr(sim, b);
  CHECK(ha != NULL && hb != NULL && ha != hb);
  if (ha != NULL) {
    CHECK(ha[0] == 0 && ha[2999] == 0);
    memset(ha, 0xab, 3000);
    CHECK(gpumem_sim_host_ptr(sim, a + 2999) == ha + 2999);
  }
  CHECK(gpumem_sim_host_ptr(sim, a + 3000) == NULL); /* past the end */
  CHECK(gpumem_sim_host_ptr(sim, b + 100) == NULL);
  CHECK(gpumem_sim_host_ptr(sim, 0) == NULL);
  CHECK_STATUS(sim->free(ctx, a, 3000), GPUMEM_OK);
  CHECK(gpumem_sim_host_ptr(sim, a) == NULL);
  CHECK(gpumem_sim_host_ptr(sim, b) == hb);

  /* Pages: bytes written through one mapping are there after the page moves. */
  uintptr_t r1 = 0, r2 = 0;
  gpumem_phys_t p = 0, two = 0;
  CHECK_STATUS(sim->reserve(ctx, 8 * page, &r1), GPUMEM_OK);
  CHECK_STATUS(sim->reserve(ctx, 8 * page, &r2), GPUMEM_OK);
  CHECK_STATUS(sim->create_page(ctx, page, &p), GPUMEM_OK);
  CHECK_STATUS(sim->create_page(ctx, 2 * page, &two), GPUMEM_OK);
  CHECK(gpumem_sim_host_ptr(sim, r1) == NULL); /* reserved, nothing mapped */
  CHECK_STATUS(sim->map(ctx, r1 + 2 * page, page, p), GPUMEM_OK);
  CHECK_STATUS(sim->map(ctx, r1 + 3 * page, 2 * page, two), GPUMEM_OK);
  unsigned char* at = gpumem_sim_host_ptr(sim, r1 + 2 * page + 100);
  CHECK(at != NULL);
  if (at != NULL) memcpy(at, "moves with the page", 20);
  /* A write straddling two mappings lands in two different pages. */
  unsigned char* end_of_p = gpumem_sim_host_ptr(sim, r1 + 3 * page - 1);
  unsigned char* start_of_two = gpumem_sim_host_ptr(sim, r1 + 3 * page);
  unsigned char* last_of_two = gpumem_sim_host_ptr(sim, r1 + 5 * page - 1);
  CHECK(end_of_p != NULL && start_of_two != NULL && last_of_two != NULL);
  if (end_of_p && start_of_two && last_of_two) {
    *end_of_p = 0x11;
    *start_of_two = 0x22;
    *last_of_two = 0x33;
    CHECK(last_of_two == start_of_two + 2 * page - 1); /* one host buffer per page */
  }
  CHECK(gpumem_sim_host_ptr(sim, r1 + 5 * page) == NULL);

  CHECK_STATUS(sim->unmap(ctx, r1 + 2 * page, 3 * page), GPUMEM_OK);
  CHECK(gpumem_sim_host_ptr(sim, r1 + 2 * page + 100) == NULL);
  CHECK(gpumem_sim_host_ptr(sim, r1 + 3 * page) == NULL);
  /* Remap in the other order, in the other range. */
  CHECK_STATUS(sim->map(ctx, r2, 2 * page, two), GPUMEM_OK);
  CHECK_STATUS(sim->map(ctx, r2 + 5 * page, page, p), GPUMEM_OK);
  unsigned char* moved = gpumem_sim_host_ptr(sim, r2 + 5 * page + 100);
  CHECK(moved != NULL && memcmp(moved, "moves with the page", 20) == 0);
  unsigned char* moved_end = gpumem_sim_host_ptr(sim, r2 + 6 * page - 1);
  CHECK(moved_end != NULL && *moved_end == 0x11);
  unsigned char* two_first = gpumem_sim_host_ptr(sim, r2);
  unsigned char* two_last = gpumem_sim_host_ptr(sim, r2 + 2 * page - 1);
  CHECK(two_first != NULL && *two_first == 0x22);
  CHECK(two_last != NULL && *two_last == 0x33);
  /* An alias is the same memory: written through one address, read
   * through the other, the second half of a two-page mapping included. */
  CHECK_STATUS(sim->map(ctx, r1 + 6 * page, 2 * page, two), GPUMEM_OK);
  unsigned char* alias_last = gpumem_sim_host_ptr(sim, r1 + 8 * page - 1);
  CHECK(alias_last != NULL && alias_last == two_last);
  if (alias_last != NULL && two_first != NULL) {
    *alias_last = 0x44;
    CHECK(*two_last == 0x44);
    const unsigned char* alias_first = gpumem_sim_host_ptr(sim, r1 + 6 * page);
    CHECK(alias_first != NULL && *alias_first == 0x22);
  }
  CHECK_STATUS(sim->unmap(ctx, r2, 2 * page), GPUMEM_OK);
  CHECK(gpumem_sim_host_ptr(sim, r1 + 7 * page) == alias_last - page + 1);
  gpumem_sim_destroy(sim);

  /* Without host backing there is nothing to point at. */
  sim = make_sim(GIB, 0);
  CHECK_STATUS(sim->alloc(sim->ctx, 4096, &a), GPUMEM_OK);
  CHECK(gpumem_sim_host_ptr(sim, a) == NULL);
  gpumem_sim_destroy(sim);
  CHECK(gpumem_sim_host_ptr(NULL, a) == NULL);
}

static void test_fail_nth_call(void) {
  gpumem_backend_t* sim = make_sim(GIB, 0);
  void* ctx = sim->ctx;
  uintptr_t addr[4] = {0};
  /* Fail the 3rd alloc from now, once. */
  gpumem_sim_fail(sim, GPUMEM_CALL_alloc, 2, 1, GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(sim->alloc(ctx, MIB, &addr[0]), GPUMEM_OK);
  CHECK_STATUS(sim->alloc(ctx, MIB, &addr[1]), GPUMEM_OK);
  uintptr_t untouched = 99;
  CHECK_STATUS(sim->alloc(ctx, MIB, &untouched), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(untouched == 99);
  CHECK(strcmp(gpumem_last_error(), "sim: injected failure of alloc (call #3)") == 0);
  CHECK_STATUS(sim->alloc(ctx, MIB, &addr[2]), GPUMEM_OK); /* the script ran out */
  gpumem_sim_counters_t cnt = counters_of(sim);
  CHECK(cnt.calls[GPUMEM_CALL_alloc] == 4);
  CHECK(cnt.failures_injected == 1);
  CHECK(cnt.plain_live == 3 && cnt.bytes_in_use == 3 * MIB);
  /* The failed call took no address: the next one follows on directly. */
  CHECK(addr[2] == addr[1] - 2 * MIB);

  /* Other kinds do not match a kind-specific script. */
  gpumem_sim_fail(sim, GPUMEM_CALL_free, 0, 1, GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->alloc(ctx, MIB, &addr[3]), GPUMEM_OK);
  CHECK_STATUS(sim->free(ctx, addr[3], MIB), GPUMEM_ERR_BACKEND);
  CHECK(counters_of(sim).plain_live == 4); /* the failed free freed nothing */
  CHECK_STATUS(sim->free(ctx, addr[3], MIB), GPUMEM_OK);
  CHECK(counters_of(sim).plain_live == 3);
  gpumem_sim_destroy(sim);
}

static void test_fail_every_call_after(void) {
  gpumem_backend_t* sim = make_sim(GIB, 0);
  void* ctx = sim->ctx;
  const size_t page = 2 * MIB;
  uintptr_t r = 0;
  gpumem_phys_t p = 0;
  size_t free_bytes, total_bytes;
  gpumem_event_t ev = 0;
  CHECK_STATUS(sim->reserve(ctx, 4 * page, &r), GPUMEM_OK);
  CHECK_STATUS(sim->event_create(ctx, &ev), GPUMEM_OK);
  /* Any call: 2 more succeed, then everything fails until cleared. */
  gpumem_sim_fail(sim, -1, 2, -1, GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->create_page(ctx, page, &p), GPUMEM_OK);
  CHECK_STATUS(sim->mem_info(ctx, &free_bytes, &total_bytes), GPUMEM_OK);
  gpumem_sim_counters_t before = counters_of(sim);
  for (int i = 0; i < 5; i++) CHECK_STATUS(sim->map(ctx, r, page, p), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("injected failure of map (call #5)"));
  CHECK_STATUS(sim->mem_info(ctx, &free_bytes, &total_bytes), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->event_record(ctx, ev, 0), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->event_query(ctx, ev), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->event_sync(ctx, ev), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->stream_sync(ctx, 0), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->device_sync(ctx), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->event_destroy(ctx, ev), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->release_page(ctx, p, page), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->release_range(ctx, r, 4 * page), GPUMEM_ERR_BACKEND);
  gpumem_sim_counters_t after = counters_of(sim);
  CHECK(after.failures_injected == 14);
  CHECK(after.calls[GPUMEM_CALL_map] == before.calls[GPUMEM_CALL_map] + 5);
  CHECK(after.calls[GPUMEM_CALL_device_sync] == 1);
  /* No failed call changed anything. */
  CHECK(after.pages_mapped == 0 && after.pages_live == 1 && after.ranges_reserved == 1);
  CHECK(after.events_live == 1 && after.bytes_in_use == page);

  gpumem_sim_fail_clear(sim);
  CHECK_STATUS(sim->map(ctx, r, page, p), GPUMEM_OK);
  CHECK_STATUS(sim->unmap(ctx, r, page), GPUMEM_OK);
  CHECK_STATUS(sim->event_destroy(ctx, ev), GPUMEM_OK);

  /* A new script replaces the old; count 0 fails nothing. */
  gpumem_sim_fail(sim, GPUMEM_CALL_unmap, 0, -1, GPUMEM_ERR_BACKEND);
  gpumem_sim_fail(sim, GPUMEM_CALL_map, 0, 0, GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->map(ctx, r, page, p), GPUMEM_OK);
  CHECK_STATUS(sim->unmap(ctx, r, page), GPUMEM_OK);
  gpumem_sim_destroy(sim);
}

static void test_fail_has_no_effect(void) {
  gpumem_backend_t* sim = make_sim(GIB, 1);
  void* ctx = sim->ctx;
  const size_t page = 2 * MIB;
  uintptr_t r = 0, r_next = 0;
  gpumem_phys_t p = 0, q = 0;
  CHECK_STATUS(sim->reserve(ctx, 4 * page, &r), GPUMEM_OK);
  CHECK_STATUS(sim->create_page(ctx, page, &p), GPUMEM_OK);

  gpumem_sim_fail(sim, GPUMEM_CALL_create_page, 0, 1, GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(sim->create_page(ctx, page, &q), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(counters_of(sim).pages_live == 1 && counters_of(sim).bytes_in_use == page);

  gpumem_sim_fail(sim, GPUMEM_CALL_map, 0, 1, GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->map(ctx, r, page, p), GPUMEM_ERR_BACKEND);
  CHECK(gpumem_sim_host_ptr(sim, r) == NULL); /* not mapped */
  CHECK_STATUS(sim->map(ctx, r, page, p), GPUMEM_OK);
  unsigned char* host = gpumem_sim_host_ptr(sim, r);
  CHECK(host != NULL);

  gpumem_sim_fail(sim, GPUMEM_CALL_unmap, 0, 1, GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->unmap(ctx, r, page), GPUMEM_ERR_BACKEND);
  CHECK(gpumem_sim_host_ptr(sim, r) == host); /* still mapped */
  CHECK(counters_of(sim).pages_mapped == 1);
  CHECK_STATUS(sim->unmap(ctx, r, page), GPUMEM_OK);

  gpumem_sim_fail(sim, GPUMEM_CALL_release_page, 0, 1, GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->release_page(ctx, p, page), GPUMEM_ERR_BACKEND);
  CHECK(counters_of(sim).pages_live == 1);
  CHECK_STATUS(sim->map(ctx, r + page, page, p), GPUMEM_OK); /* the page still exists */
  CHECK_STATUS(sim->unmap(ctx, r + page, page), GPUMEM_OK);
  CHECK_STATUS(sim->release_page(ctx, p, page), GPUMEM_OK);

  gpumem_sim_fail(sim, GPUMEM_CALL_reserve, 0, 1, GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->reserve(ctx, 2 * page, &r_next), GPUMEM_ERR_BACKEND);
  CHECK(r_next == 0);
  CHECK(counters_of(sim).ranges_reserved == 1);

  gpumem_sim_fail(sim, GPUMEM_CALL_release_range, 0, 1, GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->release_range(ctx, r, 4 * page), GPUMEM_ERR_BACKEND);
  CHECK(counters_of(sim).ranges_reserved == 1);
  CHECK_STATUS(sim->release_range(ctx, r, 4 * page), GPUMEM_OK);

  /* NOT_READY can be scripted for event_query, e.g. to hold work pending. */
  gpumem_event_t ev = 0;
  CHECK_STATUS(sim->event_create(ctx, &ev), GPUMEM_OK);
  gpumem_sim_fail(sim, GPUMEM_CALL_event_query, 1, 2, GPUMEM_NOT_READY);
  CHECK_STATUS(sim->event_query(ctx, ev), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, ev), GPUMEM_NOT_READY);
  CHECK_STATUS(sim->event_query(ctx, ev), GPUMEM_NOT_READY);
  CHECK_STATUS(sim->event_query(ctx, ev), GPUMEM_OK);
  CHECK_STATUS(sim->event_destroy(ctx, ev), GPUMEM_OK);

  /* Status OK in a script would report success without doing the work. */
  gpumem_sim_fail(sim, GPUMEM_CALL_mem_info, 0, 1, GPUMEM_OK);
  size_t free_bytes, total_bytes;
  CHECK_STATUS(sim->mem_info(ctx, &free_bytes, &total_bytes), GPUMEM_ERR_BACKEND);
  gpumem_sim_destroy(sim);
}

static void test_events(void) {
  gpumem_sim_options_t opts;
  gpumem_sim_options_init(&opts);
  opts.event_delay_queries = 2;
  gpumem_backend_t* sim = gpumem_sim_create(&opts);
  void* ctx = sim->ctx;
  gpumem_event_t a = 0, b = 0, c = 0;
  CHECK_STATUS(sim->event_create(ctx, &a), GPUMEM_OK);
  CHECK_STATUS(sim->event_create(ctx, &b), GPUMEM_OK);
  CHECK_STATUS(sim->event_create(ctx, &c), GPUMEM_OK);
  CHECK(a != 0 && a != b && b != c && a != c);
  CHECK(counters_of(sim).events_live == 3);
  CHECK_STATUS(sim->event_create(ctx, NULL), GPUMEM_ERR_INVALID_ARGUMENT);

  /* Never recorded: complete. */
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_OK);

  /* Delay 2: two queries say not ready, the third says done. */
  CHECK_STATUS(sim->event_record(ctx, a, 7), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_NOT_READY);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_NOT_READY);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_OK);
  /* Recording again makes it pending again. */
  CHECK_STATUS(sim->event_record(ctx, a, 7), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_NOT_READY);
  CHECK_STATUS(sim->event_sync(ctx, a), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_OK);

  /* stream_sync completes the events recorded on that stream only. */
  CHECK_STATUS(sim->event_record(ctx, a, 7), GPUMEM_OK);
  CHECK_STATUS(sim->event_record(ctx, b, 8), GPUMEM_OK);
  CHECK_STATUS(sim->event_record(ctx, c, 0), GPUMEM_OK);
  CHECK_STATUS(sim->stream_sync(ctx, 7), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, b), GPUMEM_NOT_READY);
  CHECK_STATUS(sim->event_query(ctx, c), GPUMEM_NOT_READY);
  /* An event recorded after the sync waits again. */
  CHECK_STATUS(sim->event_record(ctx, a, 7), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_NOT_READY);
  /* Syncing stream 0 (the default stream is a stream like any other). */
  CHECK_STATUS(sim->stream_sync(ctx, 0), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, c), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_NOT_READY);
  /* device_sync completes everything recorded so far. */
  CHECK_STATUS(sim->device_sync(ctx), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, b), GPUMEM_OK);
  CHECK_STATUS(sim->event_record(ctx, b, 8), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, b), GPUMEM_NOT_READY);

  /* The delay can change: from now on events complete after 0 queries. */
  gpumem_sim_set_event_delay(sim, 0);
  CHECK_STATUS(sim->event_record(ctx, c, 3), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, c), GPUMEM_OK);
  gpumem_sim_set_event_delay(sim, 1);
  CHECK_STATUS(sim->event_record(ctx, c, 3), GPUMEM_OK);
  CHECK_STATUS(sim->event_query(ctx, c), GPUMEM_NOT_READY);
  CHECK_STATUS(sim->event_query(ctx, c), GPUMEM_OK);

  /* Many streams: each keeps its own completion. */
  gpumem_event_t many[100];
  for (int i = 0; i < 100; i++) {
    CHECK_STATUS(sim->event_create(ctx, &many[i]), GPUMEM_OK);
    CHECK_STATUS(sim->event_record(ctx, many[i], (gpumem_stream_t)(1000 + i)), GPUMEM_OK);
  }
  for (int i = 0; i < 100; i += 2) CHECK_STATUS(sim->stream_sync(ctx, 1000 + i), GPUMEM_OK);
  int done = 0, pending = 0;
  for (int i = 0; i < 100; i++) {
    gpumem_status_t st = sim->event_query(ctx, many[i]);
    if (st == GPUMEM_OK && i % 2 == 0) done++;
    if (st == GPUMEM_NOT_READY && i % 2 == 1) pending++;
    CHECK_STATUS(sim->event_destroy(ctx, many[i]), GPUMEM_OK);
  }
  CHECK(done == 50 && pending == 50);

  /* Unknown events. */
  CHECK_STATUS(sim->event_query(ctx, 123456), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("unknown event"));
  CHECK_STATUS(sim->event_record(ctx, 123456, 0), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->event_sync(ctx, 123456), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->event_destroy(ctx, 123456), GPUMEM_ERR_BACKEND);
  /* stream_wait: any stream may wait for a known event, recorded or not
   * (work is instantaneous: it orders nothing the sim shows); an unknown
   * event is an error. */
  CHECK_STATUS(sim->stream_wait(ctx, 9, b), GPUMEM_OK);
  CHECK_STATUS(sim->stream_wait(ctx, 0, c), GPUMEM_OK);
  CHECK_STATUS(sim->stream_wait(ctx, 9, 123456), GPUMEM_ERR_BACKEND);
  CHECK(last_error_has("stream_wait of unknown event"));
  CHECK_STATUS(sim->event_destroy(ctx, a), GPUMEM_OK);
  CHECK_STATUS(sim->event_destroy(ctx, a), GPUMEM_ERR_BACKEND);
  CHECK_STATUS(sim->event_query(ctx, a), GPUMEM_ERR_BACKEND);
  gpumem_sim_counters_t cnt = counters_of(sim);
  CHECK(cnt.events_live == 2);
  CHECK(cnt.calls[GPUMEM_CALL_event_create] == 104);
  CHECK(cnt.calls[GPUMEM_CALL_stream_sync] == 52);
  CHECK(cnt.calls[GPUMEM_CALL_device_sync] == 1);
  CHECK(cnt.calls[GPUMEM_CALL_stream_wait] == 3);
  gpumem_sim_destroy(sim); /* frees the live events */
}

typedef struct worker_arg {
  gpumem_backend_t* sim;
  int errors;
} worker_arg_t;

static void* worker(void* p) {
  worker_arg_t* arg = p;
  gpumem_backend_t* sim = arg->sim;
  for (int i = 0; i < 2000; i++) {
    uintptr_t addr = 0;
    gpumem_phys_t page = 0;
    gpumem_event_t ev = 0;
    if (sim->alloc(sim->ctx, 4096 + (size_t)i, &addr) != GPUMEM_OK) arg->errors++;
    if (sim->create_page(sim->ctx, 2 * MIB, &page) != GPUMEM_OK) arg->errors++;
    if (sim->event_create(sim->ctx, &ev) != GPUMEM_OK) arg->errors++;
    if (sim->event_destroy(sim->ctx, ev) != GPUMEM_OK) arg->errors++;
    if (sim->release_page(sim->ctx, page, 2 * MIB) != GPUMEM_OK) arg->errors++;
    if (sim->free(sim->ctx, addr, 4096 + (size_t)i) != GPUMEM_OK) arg->errors++;
  }
  return NULL;
}

static void test_threads(void) {
  gpumem_backend_t* sim = make_sim(GIB, 0);
  enum { THREADS = 4 };
  pthread_t threads[THREADS];
  worker_arg_t args[THREADS];
  for (int i = 0; i < THREADS; i++) {
    args[i].sim = sim;
    args[i].errors = 0;
    pthread_create(&threads[i], NULL, worker, &args[i]);
  }
  int errors = 0;
  for (int i = 0; i < THREADS; i++) {
    pthread_join(threads[i], NULL);
    errors += args[i].errors;
  }
  CHECK(errors == 0);
  gpumem_sim_counters_t cnt = counters_of(sim);
  CHECK(cnt.calls[GPUMEM_CALL_alloc] == THREADS * 2000);
  CHECK(cnt.calls[GPUMEM_CALL_release_page] == THREADS * 2000);
  CHECK(cnt.bytes_in_use == 0 && cnt.plain_live == 0 && cnt.pages_live == 0);
  CHECK(cnt.events_live == 0);
  gpumem_sim_destroy(sim);
}

/* A device far larger than this machine's memory works, since nothing backs it. */
static void test_large_fake_device(void) {
  gpumem_sim_options_t opts;
  gpumem_sim_options_init(&opts);
  opts.capacity = 1024 * GIB;
  gpumem_backend_t* sim = gpumem_sim_create(&opts);
  void* ctx = sim->ctx;
  uintptr_t r = 0, plain = 0;
  gpumem_phys_t big = 0;
  CHECK_STATUS(sim->reserve(ctx, 2048 * GIB, &r), GPUMEM_OK);
  CHECK_STATUS(sim->create_page(ctx, 512 * GIB, &big), GPUMEM_OK);
  CHECK_STATUS(sim->map(ctx, r + 1024 * GIB, 512 * GIB, big), GPUMEM_OK);
  CHECK_STATUS(sim->alloc(ctx, 500 * GIB, &plain), GPUMEM_OK);
  CHECK(plain % (2 * MIB) == 0);
  CHECK_STATUS(sim->alloc(ctx, 13 * GIB, &plain), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(counters_of(sim).bytes_in_use == 1012 * GIB);
  CHECK_STATUS(sim->unmap(ctx, r + 1024 * GIB, 512 * GIB), GPUMEM_OK);
  gpumem_sim_destroy(sim);
}

/* The plain region is bump-allocated: once it runs out, it starts over only
 * when nothing in it is live, and otherwise says so. */
static void test_plain_address_space_exhaustion(void) {
  const size_t tib = 1024 * GIB;
  gpumem_backend_t* sim = make_sim(300 * tib, 0);
  void* ctx = sim->ctx;
  uintptr_t first = 0, again = 0, small = 0, more = 0;
  CHECK_STATUS(sim->alloc(ctx, 100 * tib, &first), GPUMEM_OK);
  CHECK_STATUS(sim->free(ctx, first, 100 * tib), GPUMEM_OK);
  CHECK_STATUS(sim->alloc(ctx, 100 * tib, &again), GPUMEM_OK); /* started over */
  CHECK(again == first);
  CHECK_STATUS(sim->alloc(ctx, 2 * MIB, &small), GPUMEM_OK);
  CHECK(small == again - 2 * MIB);
  CHECK_STATUS(sim->alloc(ctx, 50 * tib, &more), GPUMEM_ERR_OUT_OF_MEMORY);
  CHECK(last_error_has("address space for plain allocations is exhausted"));
  CHECK(counters_of(sim).plain_live == 2);
  gpumem_sim_destroy(sim);
}

/* Calls made by nothing: the public helpers tolerate NULL and non-sim
 * backends instead of crashing. */
static void test_helpers_on_bad_input(void) {
  gpumem_sim_counters_t cnt;
  memset(&cnt, 0xff, sizeof cnt);
  gpumem_sim_get_counters(NULL, &cnt);
  CHECK(cnt.calls[0] == 0 && cnt.bytes_in_use == 0);
  gpumem_backend_t not_a_sim;
  memset(&not_a_sim, 0, sizeof not_a_sim);
  gpumem_sim_fail(&not_a_sim, -1, 0, 1, GPUMEM_ERR_BACKEND);
  gpumem_sim_fail_clear(NULL);
  gpumem_sim_set_event_delay(NULL, 3);
  CHECK(gpumem_sim_host_ptr(&not_a_sim, 0x1000) == NULL);
  gpumem_sim_destroy(&not_a_sim); /* ignored */

  gpumem_backend_t* sim = make_sim(GIB, 0);
  gpumem_sim_fail(sim, GPUMEM_CALL_COUNT, 0, 1, GPUMEM_ERR_BACKEND); /* bad kind: no script */
  CHECK(last_error_has("out of range"));
  uintptr_t addr = 0;
  CHECK_STATUS(sim->alloc(sim->ctx, 1, &addr), GPUMEM_OK);
  gpumem_sim_destroy(sim); /* with a live allocation */
}

int main(void) {
  test_options_and_shape();
  test_plain_addresses();
  test_plain_capacity_and_errors();
  test_plain_many();
  test_vm_lifecycle();
  test_vm_capacity();
  test_vm_validation();
  test_host_backed();
  test_fail_nth_call();
  test_fail_every_call_after();
  test_fail_has_no_effect();
  test_events();
  test_threads();
  test_large_fake_device();
  test_plain_address_space_exhaustion();
  test_helpers_on_bad_input();
  return test_finish("test_sim");
}
