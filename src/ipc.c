/* Sharing an allocation with another process (CUDA IPC, as PyTorch's
 * torch.multiprocessing does with CUDA tensors).
 *
 * cudaIpcGetMemHandle cannot export memory made of mapped physical pages,
 * but each physical allocation can be exported as a POSIX file descriptor
 * (the backend's export_page). An allocation is exported as the mappings
 * that cover it, whole (the driver maps only whole allocations), with their
 * file descriptors and this process's id; the other process takes the
 * descriptors out of this one with pidfd_getfd (Linux 5.6; the same user,
 * or the right to trace this process), imports and maps them at a range of
 * its own, and reads the allocation at its offset there.
 *
 * The handle is text: "gpumem-ipc/1 PID PAGE_SIZE OFFSET N FD:BYTES ..."
 * (N mappings in address order, adjacent). A handle is input from another
 * process: gpumem_ipc_open checks every field before it touches anything.
 *
 * The exporter keeps the descriptors open while the allocation lives (the
 * importer may open the handle any time until then: torch keeps a shared
 * tensor's memory alive until every receiver is done) and closes them when
 * it is freed, or at gpumem_destroy. An allocation exported again gets the
 * same descriptors in its handle: one set per allocation, however often it
 * is shared. The mapped pages of a live allocation
 * never move, so what the importer maps stays the allocation's. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "engine.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 /* the same number on every architecture */
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

#define IPC_MAGIC "gpumem-ipc/1"
#define IPC_MAX_RUNS 65536u
#define IPC_MAX_TEXT (64u * 1024u * 1024u)

struct gm_ipc_export {
  uintptr_t addr; /* the allocation */
  int* fds;
  size_t num_fds;
};

struct gm_ipc_import {
  uintptr_t base; /* the range reserved here */
  size_t size;
  uintptr_t ptr; /* what gpumem_ipc_open returned: base + the handle's offset */
  gpumem_phys_t* pages;
  size_t* page_bytes;
  size_t num_pages;
};

static bool can_share(const gpumem_t* gm) {
  const gpumem_backend_t* be = gm->backend;
  return be->version >= 2 && be->export_page && be->import_page && gm->virtual_memory;
}

/* Room in *arr (of *cap elements of elem bytes) for element len: doubles
 * the array when full. false when host memory ran out (*arr unchanged). */
static bool make_room(void** arr, size_t* cap, size_t len, size_t elem) {
  if (len < *cap) return true;
  size_t grown_cap = *cap ? 2 * *cap : 8;
  void* grown = realloc(*arr, grown_cap * elem);
  if (!grown) return false;
  *arr = grown;
  *cap = grown_cap;
  return true;
}

static void close_fds(int* fds, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (fds[i] >= 0) close(fds[i]);
  free(fds);
}

/* ---- export ---- */

/* The mappings under [b->addr, b->addr + b->size): first page and length
 * of each, in address order. */
typedef struct ipc_run {
  size_t page, pages;
  gpumem_phys_t handle;
} ipc_run;

static gpumem_status_t runs_of(gpumem_t* gm, const gm_block* b, ipc_run** out, size_t* count) {
  const gm_segment* seg = b->seg;
  size_t ps = gm->page_size;
  size_t first = (b->addr - seg->addr) / ps, last = (b->addr + b->size - 1 - seg->addr) / ps;
  size_t cap = 0, n = 0;
  ipc_run* runs = NULL;
  /* a mapping may begin before the allocation: start from its first page */
  size_t p = seg->run_start[first];
  while (p <= last) {
    if (!gm_arena_page_mapped(seg, p) || !seg->handles[p]) {
      free(runs);
      return gm_fail(GPUMEM_ERR_INVALID_POINTER,
                     "gpumem_ipc_export: page %zu under the allocation at 0x%" PRIxPTR
                     " is not mapped (an allocation gpumem is still setting up?)",
                     p, b->addr);
    }
    size_t q = p + 1;
    while (q < seg->num_pages && gm_arena_page_mapped(seg, q) && seg->run_start[q] == p) q++;
    if (!make_room((void**)&runs, &cap, n, sizeof *runs)) {
      free(runs);
      return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_ipc_export: out of host memory");
    }
    runs[n++] = (ipc_run){p, q - p, seg->handles[p]};
    p = q;
  }
  if (n > IPC_MAX_RUNS) {
    free(runs);
    return gm_fail(GPUMEM_ERR_UNSUPPORTED,
                   "gpumem_ipc_export: the allocation at 0x%" PRIxPTR
                   " spans %zu mappings, more than a handle carries (%u)",
                   b->addr, n, IPC_MAX_RUNS);
  }
  *out = runs;
  *count = n;
  return GPUMEM_OK;
}

static gpumem_status_t remember_export(gpumem_t* gm, uintptr_t addr, int* fds, size_t n) {
  if (!make_room((void**)&gm->ipc_exports, &gm->ipc_exports_capacity, gm->num_ipc_exports,
                 sizeof *gm->ipc_exports))
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_ipc_export: out of host memory");
  gm->ipc_exports[gm->num_ipc_exports++] = (struct gm_ipc_export){addr, fds, n};
  return GPUMEM_OK;
}

bool gm_ipc_exported(const gpumem_t* gm, uintptr_t addr) {
  for (size_t i = 0; i < gm->num_ipc_exports; i++)
    if (gm->ipc_exports[i].addr == addr) return true;
  return false;
}

void gm_ipc_forget_export(gpumem_t* gm, uintptr_t addr) {
  for (size_t i = 0; i < gm->num_ipc_exports;) {
    if (gm->ipc_exports[i].addr == addr) {
      close_fds(gm->ipc_exports[i].fds, gm->ipc_exports[i].num_fds);
      gm->ipc_exports[i] = gm->ipc_exports[--gm->num_ipc_exports];
    } else {
      i++;
    }
  }
}

gpumem_status_t gpumem_ipc_export(gpumem_t* gm, void* ptr, char* out, size_t cap, size_t* needed) {
  if (!gm || !ptr || !needed || (cap && !out))
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_ipc_export: allocator, pointer and needed must not be NULL (out may be "
                   "NULL only with cap 0)");
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  ipc_run* runs = NULL;
  size_t n = 0;
  int* fds = NULL;
  gm_block* b = gm_ptr_map_find(&gm->ptrs, (uintptr_t)ptr);
  if (!b) {
    st = gm_fail(GPUMEM_ERR_INVALID_POINTER,
                 "gpumem_ipc_export: %p is not the start of a live allocation of this allocator",
                 ptr);
    goto done;
  }
  if (!can_share(gm) || !b->seg->is_arena || b->aliased) {
    st = gm_fail(GPUMEM_ERR_UNSUPPORTED,
                 "gpumem_ipc_export: %s cannot share memory with another process (%s)",
                 gm->backend->name ? gm->backend->name : "this backend",
                 !can_share(gm)    ? "the backend cannot export its pages as file descriptors, or "
                                     "the policy does not map pages (policy pytorch)"
                 : b->aliased      ? "the allocation's last page is shared with another address"
                 : b->pool->source ? "the allocation's memory comes from its pool's own allocator "
                                     "(gpumem_pool_set_segment_source), not from pages gpumem maps"
                                   : "the allocation is not in a mapped arena");
    goto done;
  }
  st = runs_of(gm, b, &runs, &n);
  if (st != GPUMEM_OK) goto done;
  if (!n) {
    st = gm_fail(GPUMEM_ERR_INVALID_POINTER, "gpumem_ipc_export: %p has no pages", ptr);
    goto done;
  }
  /* Descriptors are written 10 digits wide, so the handle's length is
   * known before any is made: a call that only asks for the size (or
   * whose buffer is short) exports nothing. */
  uintptr_t first_va = b->seg->addr + runs[0].page * gm->page_size;
  char head[96];
  int head_len = snprintf(head, sizeof head, IPC_MAGIC " %ld %zu %zu %zu", (long)getpid(),
                          gm->page_size, (size_t)(b->addr - first_va), n);
  size_t len = (size_t)head_len;
  for (size_t i = 0; i < n; i++)
    len += (size_t)snprintf(NULL, 0, " %010d:%zu", 0, runs[i].pages * gm->page_size);
  *needed = len + 1;
  if (cap < len + 1) goto done;
  /* The allocation exported before: its descriptors again (its pages have
   * not moved while it lives), so that torch sharing one tensor anew each
   * time holds one set of descriptors per allocation, not one per export,
   * and cannot run the process out of them. */
  for (size_t i = 0; i < gm->num_ipc_exports; i++) {
    const struct gm_ipc_export* x = &gm->ipc_exports[i];
    if (x->addr != b->addr || x->num_fds != n) continue;
    memcpy(out, head, (size_t)head_len + 1);
    size_t at = (size_t)head_len;
    for (size_t k = 0; k < n; k++)
      at += (size_t)snprintf(out + at, cap - at, " %010d:%zu", x->fds[k],
                             runs[k].pages * gm->page_size);
    goto done;
  }
  fds = malloc(n * sizeof *fds);
  if (!fds) {
    st = gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_ipc_export: out of host memory");
    goto done;
  }
  for (size_t i = 0; i < n; i++) fds[i] = -1;
  memcpy(out, head, (size_t)head_len + 1);
  size_t at = (size_t)head_len;
  for (size_t i = 0; i < n && st == GPUMEM_OK; i++) {
    st = gm->backend->export_page(gm->backend->ctx, runs[i].handle, &fds[i]);
    if (st == GPUMEM_OK)
      at +=
          (size_t)snprintf(out + at, cap - at, " %010d:%zu", fds[i], runs[i].pages * gm->page_size);
  }
  if (st != GPUMEM_OK) {
    out[0] = '\0';
    goto done;
  }
  st = remember_export(gm, b->addr, fds, n);
  if (st != GPUMEM_OK) {
    out[0] = '\0';
    goto done;
  }
  fds = NULL; /* kept until the allocation is freed */
done:
  if (fds) close_fds(fds, n);
  free(runs);
  gm_lock_release(&gm->lock);
  return st;
}

/* ---- open ---- */

/* A decimal number of at most 19 digits, no sign, followed by end or a
 * space (or ':' when colon_ok); advances *p. */
static bool parse_number(const char** p, const char* end, uint64_t max, bool colon_ok,
                         uint64_t* out) {
  const char* s = *p;
  uint64_t v = 0;
  int digits = 0;
  while (s < end && *s >= '0' && *s <= '9') {
    if (++digits > 19) return false;
    v = v * 10 + (uint64_t)(*s - '0');
    s++;
  }
  if (!digits || v > max) return false;
  if (s < end && !(*s == ' ' || (colon_ok && *s == ':'))) return false;
  *p = s;
  *out = v;
  return true;
}

static bool expect(const char** p, const char* end, char c) {
  if (*p >= end || **p != c) return false;
  (*p)++;
  return true;
}

typedef struct ipc_handle {
  uint64_t pid, page_size, offset, count, total;
  uint64_t* fds;
  uint64_t* bytes;
} ipc_handle;

static gpumem_status_t bad_handle(const char* why) {
  return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                 "gpumem_ipc_open: not a handle gpumem_ipc_export made (%s)", why);
}

static gpumem_status_t parse_handle(const gpumem_t* gm, const char* text, size_t len,
                                    ipc_handle* h) {
  memset(h, 0, sizeof *h);
  size_t magic = sizeof IPC_MAGIC - 1;
  if (len > IPC_MAX_TEXT) return bad_handle("longer than any handle");
  if (len < magic || memcmp(text, IPC_MAGIC, magic) != 0)
    return bad_handle("it does not start with \"" IPC_MAGIC "\"");
  const char *p = text + magic, *end = text + len;
  if (!expect(&p, end, ' ') || !parse_number(&p, end, INT32_MAX, false, &h->pid) || !h->pid)
    return bad_handle("bad process id");
  if (!expect(&p, end, ' ') || !parse_number(&p, end, UINT32_MAX, false, &h->page_size))
    return bad_handle("bad page size");
  if (h->page_size != gm->page_size) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_ipc_open: the handle's pages are %" PRIu64
                   " bytes, this device's %zu: another device kind",
                   h->page_size, gm->page_size);
  }
  if (!expect(&p, end, ' ') || !parse_number(&p, end, UINT64_MAX / 2, false, &h->offset))
    return bad_handle("bad offset");
  if (!expect(&p, end, ' ') || !parse_number(&p, end, IPC_MAX_RUNS, false, &h->count) || !h->count)
    return bad_handle("bad number of mappings");
  h->fds = calloc(h->count, sizeof *h->fds);
  h->bytes = calloc(h->count, sizeof *h->bytes);
  if (!h->fds || !h->bytes) {
    free(h->fds);
    free(h->bytes);
    h->fds = h->bytes = NULL;
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_ipc_open: out of host memory");
  }
  gpumem_status_t st = GPUMEM_OK;
  for (uint64_t i = 0; i < h->count && st == GPUMEM_OK; i++) {
    if (!expect(&p, end, ' ') || !parse_number(&p, end, INT32_MAX, true, &h->fds[i]) ||
        !expect(&p, end, ':') || !parse_number(&p, end, gm->device_total, false, &h->bytes[i]))
      st = bad_handle("bad mapping");
    else if (!h->bytes[i] || h->bytes[i] % h->page_size)
      st = bad_handle("a mapping that is not a whole number of pages");
    else if ((h->total += h->bytes[i]) > gm->device_total)
      st = bad_handle("more memory than this device has");
  }
  if (st == GPUMEM_OK && p != end) st = bad_handle("trailing characters");
  if (st == GPUMEM_OK && h->offset >= h->total) st = bad_handle("offset past its mappings");
  if (st != GPUMEM_OK) {
    free(h->fds);
    free(h->bytes);
    h->fds = h->bytes = NULL;
  }
  return st;
}

/* fd of process pid as a descriptor of this one. */
static gpumem_status_t take_fd(int pidfd, pid_t pid, int fd, int* out) {
  int got = pid == getpid() ? dup(fd) : (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
  if (got < 0) {
    int e = errno;
    return gm_fail(GPUMEM_ERR_BACKEND,
                   "gpumem_ipc_open: cannot take descriptor %d of process %ld: %s%s", fd, (long)pid,
                   strerror(e),
                   e == EPERM    ? " (pidfd_getfd needs the same user and the right to trace that "
                                   "process: kernel.yama.ptrace_scope 0, or CAP_SYS_PTRACE)"
                   : e == ENOSYS ? " (pidfd_getfd needs Linux 5.6)"
                   : e == EBADF  ? " (the exporting process has freed the allocation)"
                                 : "");
  }
  *out = got;
  return GPUMEM_OK;
}

static void release_import(gpumem_t* gm, struct gm_ipc_import* im, size_t mapped) {
  const gpumem_backend_t* be = gm->backend;
  size_t off = 0;
  for (size_t i = 0; im->pages && im->page_bytes && i < im->num_pages; i++) {
    if (i < mapped) GM_MAP_CALL(gm, unmap, be->unmap(be->ctx, im->base + off, im->page_bytes[i]));
    if (im->pages[i])
      GM_MAP_CALL(gm, release_page, be->release_page(be->ctx, im->pages[i], im->page_bytes[i]));
    off += im->page_bytes[i];
  }
  if (im->base) GM_CALL(gm, release_range, be->release_range(be->ctx, im->base, im->size));
  free(im->pages);
  free(im->page_bytes);
}

gpumem_status_t gpumem_ipc_open(gpumem_t* gm, const char* handle, size_t len, void** out) {
  if (!gm || !handle || !out)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_ipc_open: allocator, handle and out must not be NULL");
  *out = NULL;
  ipc_handle h;
  gpumem_status_t st = parse_handle(gm, handle, len, &h);
  if (st != GPUMEM_OK) return st;
  if (!can_share(gm)) {
    free(h.fds);
    free(h.bytes);
    return gm_fail(GPUMEM_ERR_UNSUPPORTED,
                   "gpumem_ipc_open: %s cannot map memory of another process (no import_page, "
                   "or the policy does not map pages)",
                   gm->backend->name ? gm->backend->name : "this backend");
  }
  struct gm_ipc_import im = {0};
  im.size = (size_t)h.total;
  im.num_pages = (size_t)h.count;
  im.pages = calloc(im.num_pages, sizeof *im.pages);
  im.page_bytes = calloc(im.num_pages, sizeof *im.page_bytes);
  pid_t pid = (pid_t)h.pid;
  int pidfd = -1;
  size_t mapped = 0;
  const gpumem_backend_t* be = gm->backend;
  gm_lock_acquire(&gm->lock);
  if (!im.pages || !im.page_bytes) {
    st = gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_ipc_open: out of host memory");
    goto fail;
  }
  if (pid != getpid()) {
    pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0) {
      int e = errno;
      st = gm_fail(GPUMEM_ERR_BACKEND, "gpumem_ipc_open: process %ld that shared the memory: %s",
                   (long)pid, strerror(e));
      goto fail;
    }
  }
  for (size_t i = 0; i < im.num_pages; i++) {
    int fd = -1;
    im.page_bytes[i] = (size_t)h.bytes[i];
    st = take_fd(pidfd, pid, (int)h.fds[i], &fd);
    if (st != GPUMEM_OK) goto fail;
    st = be->import_page(be->ctx, fd, &im.pages[i]);
    close(fd);
    if (st != GPUMEM_OK) goto fail;
  }
  st = GM_CALL(gm, reserve, be->reserve(be->ctx, im.size, &im.base));
  if (st != GPUMEM_OK) goto fail;
  for (size_t off = 0; mapped < im.num_pages; mapped++) {
    st = GM_MAP_CALL(gm, map,
                     be->map(be->ctx, im.base + off, im.page_bytes[mapped], im.pages[mapped]));
    if (st != GPUMEM_OK) goto fail;
    off += im.page_bytes[mapped];
  }
  if (!make_room((void**)&gm->ipc_imports, &gm->ipc_imports_capacity, gm->num_ipc_imports,
                 sizeof *gm->ipc_imports)) {
    st = gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_ipc_open: out of host memory");
    goto fail;
  }
  im.ptr = im.base + (uintptr_t)h.offset;
  gm->ipc_imports[gm->num_ipc_imports++] = im;
  gm_lock_release(&gm->lock);
  if (pidfd >= 0) close(pidfd);
  free(h.fds);
  free(h.bytes);
  *out = (void*)im.ptr;
  return GPUMEM_OK;
fail:
  release_import(gm, &im, mapped);
  gm_lock_release(&gm->lock);
  if (pidfd >= 0) close(pidfd);
  free(h.fds);
  free(h.bytes);
  return st;
}

gpumem_status_t gpumem_ipc_close(gpumem_t* gm, void* ptr) {
  if (!gm || !ptr)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_ipc_close: allocator and pointer must not be NULL");
  gm_lock_acquire(&gm->lock);
  for (size_t i = 0; i < gm->num_ipc_imports; i++) {
    if (gm->ipc_imports[i].ptr == (uintptr_t)ptr) {
      struct gm_ipc_import im = gm->ipc_imports[i];
      gm->ipc_imports[i] = gm->ipc_imports[--gm->num_ipc_imports];
      release_import(gm, &im, im.num_pages);
      gm_lock_release(&gm->lock);
      return GPUMEM_OK;
    }
  }
  gm_lock_release(&gm->lock);
  return gm_fail(GPUMEM_ERR_INVALID_POINTER,
                 "gpumem_ipc_close: %p was not opened by gpumem_ipc_open on this allocator", ptr);
}

void gm_ipc_destroy(gpumem_t* gm) {
  for (size_t i = 0; i < gm->num_ipc_exports; i++)
    close_fds(gm->ipc_exports[i].fds, gm->ipc_exports[i].num_fds);
  free(gm->ipc_exports);
  gm->ipc_exports = NULL;
  gm->num_ipc_exports = gm->ipc_exports_capacity = 0;
  for (size_t i = 0; i < gm->num_ipc_imports; i++)
    release_import(gm, &gm->ipc_imports[i], gm->ipc_imports[i].num_pages);
  free(gm->ipc_imports);
  gm->ipc_imports = NULL;
  gm->num_ipc_imports = gm->ipc_imports_capacity = 0;
}
