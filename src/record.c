/* Recording an allocator's requests as a trace (traces/README.md), so that
 * `gpumem replay`/`fit` can answer what-if questions about the user's own
 * job: option record:PATH or gpumem_record_trace(). One line per
 * allocation (`a SERIAL SIZE STREAM`, the size asked for), free (`f
 * SERIAL`) and record_stream (`r SERIAL STREAM`), and a comment `# step N`
 * at each gpumem_record_step() (the optimizer step hook of the Python
 * package), gzip-compressed at level 1 (~2 bytes per event).
 *
 * Cheap enough to leave on: under the allocator's lock an event is only
 * formatted into a 1 MiB buffer (digits by hand, no printf); full buffers
 * go to a writer thread of the recorder's own, which compresses and writes
 * them while the job runs. Compressing on the allocating thread, as a
 * gzFile's own buffer does, cost a GPT-2 training step 4% (lockstep on an
 * H200). The allocating thread waits only when the writer has not finished
 * the previous buffer. Recorders still open when the process exits are
 * finished by an atexit handler, so a job recorded with record:PATH from
 * start to end leaves a whole file. Nothing is done while recording is
 * off: one load and branch in the allocator (engine.h, gm_record_*). The
 * file is opened at the first event, so that a per-device instance knows
 * its device: "%p" in the path becomes the process id, "%d" the device
 * ordinal. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "engine.h"

#define REC_BUFFER (1u << 20)
#define REC_LINE_MAX 80 /* the longest line an event formats to */

struct gm_recorder {
  gpumem_t* gm;
  gzFile file;        /* NULL until the first event; the writer's once it runs */
  _Atomic int failed; /* could not open or write: stop quietly */
  uint64_t steps;     /* markers written */
  uint64_t events;
  /* the first allocation recorded: frees and record_streams of older ones
   * (made before recording started) are left out, so the file stays a
   * trace whose every free names an allocation in it */
  uint64_t first_serial;
  char* buf; /* events being formatted (under the allocator's lock) */
  size_t len;
  /* the writer thread and what it is handed (under mu) */
  pthread_t thread;
  bool thread_running;
  pthread_mutex_t mu;
  pthread_cond_t work, done;
  char* full; /* a buffer for the writer, or NULL */
  size_t full_len;
  char* spare; /* a written buffer, for reuse */
  bool stop;
  struct gm_recorder* next_open; /* the recorders atexit finishes */
  char path[512];                /* as given, before expansion */
  char opened[600];
  char why[900]; /* why the file could not be made */
};

/* Recorders with a file open: finished at exit (and forgotten in a forked
 * child, which has no writer thread). */
static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
static struct gm_recorder* open_recorders;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;
static void finish_file(struct gm_recorder* r);

static void finish_all_at_exit(void) {
  pthread_mutex_lock(&open_lock);
  struct gm_recorder* list = open_recorders;
  open_recorders = NULL;
  pthread_mutex_unlock(&open_lock);
  for (struct gm_recorder* r = list; r; r = r->next_open) {
    gm_lock_acquire(&r->gm->lock);
    finish_file(r);
    gm_lock_release(&r->gm->lock);
  }
}

static void forget_all_in_child(void) {
  for (struct gm_recorder* r = open_recorders; r; r = r->next_open) {
    r->thread_running = false;
    r->file = NULL; /* the parent's: never touched here */
    r->failed = 1;
  }
  open_recorders = NULL;
  pthread_mutex_init(&open_lock, NULL);
}

static void register_handlers(void) {
  atexit(finish_all_at_exit);
  pthread_atfork(NULL, NULL, forget_all_in_child);
}

static void unlink_open(struct gm_recorder* r) {
  pthread_mutex_lock(&open_lock);
  for (struct gm_recorder** l = &open_recorders; *l; l = &(*l)->next_open) {
    if (*l == r) {
      *l = r->next_open;
      break;
    }
  }
  pthread_mutex_unlock(&open_lock);
}

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

static void* writer_main(void* arg) {
  struct gm_recorder* r = arg;
  pthread_mutex_lock(&r->mu);
  for (;;) {
    while (!r->full && !r->stop) pthread_cond_wait(&r->work, &r->mu);
    if (!r->full) break; /* stopped, and everything handed over is written */
    char* b = r->full;
    size_t n = r->full_len;
    pthread_mutex_unlock(&r->mu);
    bool ok = !atomic_load(&r->failed) && (n == 0 || gzwrite(r->file, b, (unsigned)n) == (int)n);
    pthread_mutex_lock(&r->mu);
    if (!ok && !atomic_exchange(&r->failed, 1))
      fprintf(stderr, "gpumem: record: cannot write %s; recording stopped\n", r->opened);
    if (r->spare)
      free(b);
    else
      r->spare = b;
    r->full = NULL;
    pthread_cond_broadcast(&r->done);
  }
  pthread_mutex_unlock(&r->mu);
  return NULL;
}

/* Hands the formatted events to the writer (waiting for it to finish the
 * previous buffer first) and starts a new buffer. */
static void hand_off(struct gm_recorder* r) {
  pthread_mutex_lock(&r->mu);
  while (r->full) pthread_cond_wait(&r->done, &r->mu);
  r->full = r->buf;
  r->full_len = r->len;
  r->buf = r->spare;
  r->spare = NULL;
  pthread_cond_signal(&r->work);
  pthread_mutex_unlock(&r->mu);
  if (!r->buf) r->buf = malloc(REC_BUFFER);
  r->len = 0;
  if (!r->buf && !atomic_exchange(&r->failed, 1))
    fprintf(stderr, "gpumem: record: out of host memory; recording of %s stopped\n", r->opened);
}

static bool open_file(gpumem_t* gm, struct gm_recorder* r) {
  if (r->file) return !atomic_load(&r->failed);
  if (atomic_load(&r->failed)) return false;
  expand_path(r->path, gm->device_index, r->opened, sizeof r->opened);
  /* The path is often in /tmp, where another user may have planted a link
   * or a file of theirs at it (outfile.c). The new file is put in place at
   * once, so that a job killed before it exits leaves its trace so far
   * under the name asked for. */
  gm_outfile out;
  int fd = gm_outfile_open(&out, r->opened, 0600, r->why, sizeof r->why);
  if (fd >= 0 && !gm_outfile_commit(&out, r->why, sizeof r->why)) {
    close(fd);
    fd = -1;
  }
  r->file = fd >= 0 ? gzdopen(fd, "wb1") : NULL;
  if (fd >= 0 && !r->file) close(fd);
  r->buf = r->file ? malloc(REC_BUFFER) : NULL;
  if (fd >= 0 && (!r->file || !r->buf))
    snprintf(r->why, sizeof r->why, "cannot write %s: out of host memory", r->opened);
  if (!r->file || !r->buf) {
    r->failed = 1;
    fprintf(stderr, "gpumem: record: %s; not recording\n", r->why);
    if (r->file) gzclose(r->file);
    r->file = NULL;
    return false;
  }
  gzprintf(r->file, "# gpumem trace recorded by process %ld (traces/README.md)\n", (long)getpid());
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->work, NULL);
  pthread_cond_init(&r->done, NULL);
  if (pthread_create(&r->thread, NULL, writer_main, r) != 0) {
    r->failed = 1;
    fprintf(stderr, "gpumem: record: cannot start a writer thread; not recording %s\n", r->opened);
    return false;
  }
  r->thread_running = true;
  pthread_once(&exit_once, register_handlers);
  pthread_mutex_lock(&open_lock);
  r->next_open = open_recorders;
  open_recorders = r;
  pthread_mutex_unlock(&open_lock);
  return true;
}

/* Writes what is left, stops the writer and closes the file. */
static void finish_file(struct gm_recorder* r) {
  if (r->thread_running) {
    hand_off(r);
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_signal(&r->work);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thread, NULL);
    r->thread_running = false;
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->work);
    pthread_cond_destroy(&r->done);
  }
  if (r->file && gzclose(r->file) != Z_OK)
    fprintf(stderr, "gpumem: record: cannot finish %s\n", r->opened);
  r->file = NULL;
  r->failed = 1; /* (nothing more is written) */
  free(r->buf);
  free(r->spare);
  r->buf = r->spare = NULL;
}

static char* put_dec(char* p, uint64_t v) {
  char tmp[20];
  int n = 0;
  do {
    tmp[n++] = (char)('0' + v % 10);
    v /= 10;
  } while (v);
  while (n) *p++ = tmp[--n];
  return p;
}

static char* put_hex(char* p, uint64_t v) {
  static const char digits[] = "0123456789abcdef";
  char tmp[16];
  int n = 0;
  do {
    tmp[n++] = digits[v & 15];
    v >>= 4;
  } while (v);
  *p++ = '0';
  *p++ = 'x';
  while (n) *p++ = tmp[--n];
  return p;
}

/* Room for one more line, or false when recording stopped. */
static bool room(struct gm_recorder* r) {
  if (r->len + REC_LINE_MAX > REC_BUFFER) hand_off(r);
  return r->buf != NULL && !atomic_load(&r->failed);
}

void gm_record_note(gpumem_t* gm, char op, uint64_t serial, uint64_t size, gpumem_stream_t stream) {
  struct gm_recorder* r = gm->recorder;
  if (serial < r->first_serial || !open_file(gm, r) || !room(r)) return;
  char* p = r->buf + r->len;
  *p++ = op;
  *p++ = ' ';
  p = put_dec(p, serial);
  if (op == 'a') {
    *p++ = ' ';
    p = put_dec(p, size);
  }
  if (op != 'f') {
    *p++ = ' ';
    p = put_hex(p, (uint64_t)(uintptr_t)stream);
  }
  *p++ = '\n';
  r->len = (size_t)(p - r->buf);
  r->events++;
}

static void record_close(struct gm_recorder* r) {
  unlink_open(r);
  finish_file(r);
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
  r->gm = gm;
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
      st = gm_fail(GPUMEM_ERR_IO, "gpumem_record_trace: %s", gm->recorder->why);
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
  if (r && open_file(gm, r) && room(r)) {
    r->steps++;
    char* p = r->buf + r->len;
    memcpy(p, "# step ", 7);
    p = put_dec(p + 7, r->steps);
    *p++ = '\n';
    r->len = (size_t)(p - r->buf);
  }
  gm_lock_release(&gm->lock);
}
