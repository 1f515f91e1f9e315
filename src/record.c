/* Recording an allocator's requests as a trace (traces/README.md), so that
 * `gpumem replay`/`fit` can answer what-if questions about the user's own
 * job: option record:PATH or gpumem_record_trace(). One line per
 * allocation (`a SERIAL SIZE STREAM`, the size asked for), free (`f
 * SERIAL`) and record_stream (`r SERIAL STREAM`), and a comment `# step N`
 * at each gpumem_record_step() (the optimizer step hook of the Python
 * package), written through zlib's gzip stream at level 1: text is
 * formatted into zlib's buffer under the allocator's lock, and compressed
 * when 256 KiB have gathered (well under a millisecond at level 1), so the
 * cost is a few hundred nanoseconds per request and the file ~2 bytes per
 * event. Nothing is written while recording is off: one load and branch in
 * the allocator (engine.h, gm_record_*). The file is opened at the first
 * event, so that a per-device instance knows its device: "%p" in the path
 * becomes the process id, "%d" the device ordinal. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "engine.h"

struct gm_recorder {
  gzFile file;    /* NULL until the first event */
  int failed;     /* the file could not be opened or written: stop quietly */
  uint64_t steps; /* markers written */
  uint64_t events;
  /* the first allocation recorded: frees and record_streams of older ones
   * (made before recording started) are left out, so the file stays a
   * trace whose every free names an allocation in it */
  uint64_t first_serial;
  char path[512]; /* as given, before expansion */
  char opened[600];
};

/* PATH with %p -> pid and %d -> device (0 for an allocator of no device). */
static void expand_path(const char* in, int device, char* out, size_t cap) {
  size_t n = 0;
  for (const char* p = in; *p && n + 24 < cap; p++) {
    if (p[0] == '%' && p[1] == 'p') {
      n += (size_t)snprintf(out + n, cap - n, "%ld", (long)getpid());
      p++;
    } else if (p[0] == '%' && p[1] == 'd') {
      n += (size_t)snprintf(out + n, cap - n, "%d", device < 0 ? 0 : device);
      p++;
    } else {
      out[n++] = *p;
    }
  }
  out[n] = '\0';
}

static bool open_file(gpumem_t* gm, struct gm_recorder* r) {
  if (r->file) return true;
  if (r->failed) return false;
  expand_path(r->path, gm->device_index, r->opened, sizeof r->opened);
  r->file = gzopen(r->opened, "wb1");
  if (!r->file) {
    r->failed = 1;
    fprintf(stderr, "gpumem: record: cannot write %s: %s; not recording\n", r->opened,
            errno ? strerror(errno) : "out of host memory");
    return false;
  }
  gzbuffer(r->file, 1 << 18);
  gzprintf(r->file, "# gpumem trace recorded by process %ld (traces/README.md)\n", (long)getpid());
  return true;
}

static void wrote(struct gm_recorder* r, int n) {
  if (n <= 0) {
    r->failed = 1;
    gzclose(r->file);
    r->file = NULL;
    fprintf(stderr, "gpumem: record: cannot write %s; recording stopped\n", r->opened);
    return;
  }
  r->events++;
}

void gm_record_note(gpumem_t* gm, char op, uint64_t serial, uint64_t size, gpumem_stream_t stream) {
  struct gm_recorder* r = gm->recorder;
  if (serial < r->first_serial || !open_file(gm, r)) return;
  unsigned long long id = serial, bytes = size, s = (unsigned long long)(uintptr_t)stream;
  if (op == 'a') {
    wrote(r, gzprintf(r->file, "a %llu %llu 0x%llx\n", id, bytes, s));
  } else if (op == 'f') {
    wrote(r, gzprintf(r->file, "f %llu\n", id));
  } else {
    wrote(r, gzprintf(r->file, "r %llu 0x%llx\n", id, s));
  }
}

static void record_close(struct gm_recorder* r) {
  if (r->file && gzclose(r->file) != Z_OK)
    fprintf(stderr, "gpumem: record: cannot finish %s\n", r->opened);
  free(r);
}

void gm_record_destroy(gpumem_t* gm) {
  if (!gm->recorder) return;
  record_close(gm->recorder);
  gm->recorder = NULL;
}

gpumem_status_t gm_record_start(gpumem_t* gm, const char* path) {
  size_t n = strlen(path);
  if (n == 0 || n >= sizeof((struct gm_recorder*)0)->path)
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem_record_trace: the path must be 1 to 511 bytes long");
  struct gm_recorder* r = calloc(1, sizeof *r);
  if (!r) return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem_record_trace: out of host memory");
  memcpy(r->path, path, n + 1);
  r->first_serial = gm->num_mallocs + 1;
  gm_record_destroy(gm);
  gm->recorder = r;
  return GPUMEM_OK;
}

gpumem_status_t gpumem_record_trace(gpumem_t* gm, const char* path) {
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_record_trace: NULL allocator");
  gm_lock_acquire(&gm->lock);
  gpumem_status_t st = GPUMEM_OK;
  if (path) {
    st = gm_record_start(gm, path);
    /* open now, so that a path that cannot be written is an error here */
    if (st == GPUMEM_OK && !open_file(gm, gm->recorder)) {
      st = gm_fail(GPUMEM_ERR_IO, "gpumem_record_trace: cannot write %s: %s", gm->recorder->opened,
                   errno ? strerror(errno) : "unknown error");
      gm_record_destroy(gm);
    }
  } else {
    gm_record_destroy(gm);
  }
  gm_lock_release(&gm->lock);
  return st;
}

void gpumem_record_step(gpumem_t* gm) {
  if (!gm) return;
  gm_lock_acquire(&gm->lock);
  struct gm_recorder* r = gm->recorder;
  if (r && open_file(gm, r)) {
    r->steps++;
    if (gzprintf(r->file, "# step %llu\n", (unsigned long long)r->steps) <= 0) wrote(r, 0);
  }
  gm_lock_release(&gm->lock);
}
