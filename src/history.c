/* History and snapshots: the allocator's last events in a ring, and its
 * segments with the blocks that tile them, written as the JSON of the dict
 * torch.cuda.memory._snapshot() returns, so that PyTorch's memory_viz (and
 * its segsum and trace printers) open what gpumem records.
 *
 * Recording costs one predictable branch per allocation and free while it
 * is off (gm_history_add), and a clock read and a 48-byte store while on.
 * The events are block events only: under virtual memory, reserved memory
 * moves page by page (spare pages, ghosts, aliases: pages.c), which
 * PyTorch's segment events cannot say, so the snapshot's segments show the
 * mapped pages as they are at the moment of the snapshot instead. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"

typedef struct gm_history_event {
  uint64_t time_us;
  uint64_t addr;
  uint64_t size;
  uint64_t stream;
  uint64_t tag;
  uint32_t action;
} gm_history_event;

typedef struct gm_history {
  gm_history_event* ring;
  size_t capacity;
  uint64_t recorded; /* since recording started; the ring keeps the last capacity */
} gm_history;

static const char* const action_names[] = {"alloc", "free_requested", "free_completed", "oom"};

static uint64_t now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

void gm_history_note(gpumem_t* gm, int action, uintptr_t addr, uint64_t size,
                     gpumem_stream_t stream) {
  gm_history* h = gm->history;
  gm_history_event* e = &h->ring[h->recorded % h->capacity];
  e->time_us = now_us();
  e->addr = addr;
  e->size = size;
  e->stream = (uint64_t)stream;
  e->tag = gm->history_tag;
  e->action = (uint32_t)action;
  h->recorded++;
}

void gm_history_note_block(gpumem_t* gm, int action, const gm_block* b) {
  gm_history_note(gm, action, b->addr, b->size, gm_block_stream(b));
}

static void history_free(gm_history* h) {
  if (!h) return;
  free(h->ring);
  free(h);
}

void gm_history_destroy(gpumem_t* gm) {
  history_free(gm->history);
  gm->history = NULL;
}

gpumem_status_t gpumem_record_history(gpumem_t* gm, size_t max_entries) {
  if (!gm) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_record_history: NULL allocator");
  gm_history* fresh = NULL;
  if (max_entries) {
    if (max_entries > SIZE_MAX / sizeof(gm_history_event)) {
      return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                     "gpumem_record_history: %zu entries do not fit in memory", max_entries);
    }
    fresh = calloc(1, sizeof *fresh);
    if (fresh) fresh->ring = malloc(max_entries * sizeof *fresh->ring);
    if (!fresh || !fresh->ring) {
      history_free(fresh);
      return gm_fail(GPUMEM_ERR_HOST_MEMORY,
                     "gpumem_record_history: out of host memory for %zu entries", max_entries);
    }
    fresh->capacity = max_entries;
  }
  gm_lock_acquire(&gm->lock);
  gm_history* old = gm->history;
  gm->history = fresh;
  gm_lock_release(&gm->lock);
  history_free(old);
  return GPUMEM_OK;
}

void gpumem_set_history_tag(gpumem_t* gm, uint64_t tag) {
  if (!gm) return;
  gm_lock_acquire(&gm->lock);
  gm->history_tag = tag;
  gm_lock_release(&gm->lock);
}

/* ---- the snapshot ---- */

/* A frames list: one frame for a tagged event or block, none otherwise. */
static void frames(gm_emitter* e, const char* tag_file, uint64_t tag) {
  if (!tag) {
    gm_emit(e, "[]", 2);
    return;
  }
  gm_emit(e, "[{\"filename\":", 13);
  gm_emit_json_string(e, tag_file);
  gm_emitf(e, ",\"line\":%" PRIu64 ",\"name\":\"tag\"}]", tag);
}

static const char* block_state(const gm_block* b) {
  if (b->state == GM_ALLOCATED) return "active_allocated";
  if (b->state == GM_PENDING) return "active_pending_free";
  return "inactive";
}

typedef struct snapshot_ctx {
  gpumem_t* gm;
  int device;
  gm_emitter* e;
  const char* tag_file;
  bool first_segment;
  uint64_t segment_bytes; /* total_size of every segment written */
} snapshot_ctx;

/* The part of block x that lies in [start, end): its bytes, and the
 * requested bytes it counts for (an allocated block's, at most its size;
 * a free or pending piece's size, as PyTorch's snapshots give them). */
typedef struct piece {
  uintptr_t addr;
  uint64_t size, requested;
  bool allocated, live; /* live: allocated or pending */
} piece_t;

static piece_t piece_of(const gm_block* x, uintptr_t start, uintptr_t end) {
  uintptr_t lo = x->addr > start ? x->addr : start;
  uintptr_t hi = x->addr + x->size < end ? x->addr + x->size : end;
  piece_t p = {lo, hi - lo, hi - lo, x->state == GM_ALLOCATED, false};
  p.live = p.allocated || x->state == GM_PENDING;
  if (p.allocated && x->requested < p.size) p.requested = x->requested;
  return p;
}

/* One segment: [start, end) of seg, tiled by the parts of its blocks that
 * lie in it, from *cursor on (blocks in address order; *cursor is left at
 * the first block reaching past end). */
static void write_segment(snapshot_ctx* c, gm_segment* seg, uintptr_t start, uintptr_t end,
                          gm_block** cursor) {
  gm_emitter* e = c->e;
  uint64_t allocated = 0, active = 0, requested = 0;
  gm_block* b = *cursor;
  while (b && b->addr + b->size <= start) b = b->next;
  *cursor = b;
  for (gm_block* x = b; x && x->addr < end; x = x->next) {
    piece_t p = piece_of(x, start, end);
    if (p.allocated) {
      allocated += p.size;
      requested += p.requested;
    }
    if (p.live) active += p.size;
  }
  gm_emit(e, c->first_segment ? "\n  " : ",\n  ", c->first_segment ? 3 : 4);
  c->first_segment = false;
  gm_emitf(e,
           "{\"device\":%d,\"address\":%" PRIu64 ",\"total_size\":%" PRIu64
           ",\"allocated_size\":%" PRIu64 ",\"active_size\":%" PRIu64 ",\"requested_size\":%" PRIu64
           ",\"stream\":%" PRIu64
           ",\"segment_type\":\"%s\",\"segment_pool_id\":[0,0]"
           ",\"is_expandable\":%s,\"frames\":[],\"blocks\":[",
           c->device, (uint64_t)start, (uint64_t)(end - start), allocated, active, requested,
           (uint64_t)seg->pool->stream->handle, seg->pool->is_small ? "small" : "large",
           seg->is_arena ? "true" : "false");
  c->segment_bytes += end - start;
  for (gm_block* x = b; x && x->addr < end; x = x->next) {
    piece_t p = piece_of(x, start, end);
    gm_emitf(e,
             "%s{\"address\":%" PRIu64 ",\"size\":%" PRIu64 ",\"requested_size\":%" PRIu64
             ",\"state\":\"%s\",\"frames\":",
             x == b ? "" : ",", (uint64_t)p.addr, p.size, p.requested, block_state(x));
    frames(e, c->tag_file, p.live ? x->tag : 0);
    gm_emit(e, "}", 1);
  }
  gm_emit(e, "]}", 2);
}

/* Pages [*from, ...) of an arena: the next run of mapped pages (host-backed
 * ones included: they lie inside a live block, which a segment must hold
 * whole; overflow.c). */
static bool page_backed(const gm_segment* seg, size_t p) {
  return gm_arena_page_mapped(seg, p) || gm_arena_page_host(seg, p);
}

static bool next_mapped_run(const gm_segment* seg, size_t* from, size_t* run_end) {
  size_t p = *from;
  while (p < seg->mapped_end && !page_backed(seg, p)) {
    if (p % 64 == 0 && seg->mapped_bits[p / 64] == 0 && !seg->host_bits)
      p += 64;
    else
      p++;
  }
  if (p >= seg->mapped_end) return false;
  size_t q = p;
  while (q < seg->mapped_end && page_backed(seg, q)) q++;
  *from = p;
  *run_end = q;
  return true;
}

static void write_segments(snapshot_ctx* c) {
  gpumem_t* gm = c->gm;
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    gm_block* cursor = seg->first;
    if (!seg->is_arena) {
      write_segment(c, seg, seg->addr, seg->addr + seg->size, &cursor);
      continue;
    }
    size_t p = 0, q;
    while (next_mapped_run(seg, &p, &q)) {
      write_segment(c, seg, seg->addr + p * gm->page_size, seg->addr + q * gm->page_size, &cursor);
      p = q;
    }
  }
}

static void write_events(gm_emitter* e, const gm_history* h, const char* tag_file) {
  if (!h) return;
  uint64_t kept = h->recorded < h->capacity ? h->recorded : h->capacity;
  for (uint64_t k = h->recorded - kept; k < h->recorded; k++) {
    const gm_history_event* ev = &h->ring[k % h->capacity];
    gm_emitf(e,
             "%s\n    {\"action\":\"%s\",\"addr\":%" PRIu64 ",\"size\":%" PRIu64
             ",\"stream\":%" PRIu64 ",\"time_us\":%" PRIu64 ",",
             k == h->recorded - kept ? "" : ",", action_names[ev->action], ev->addr, ev->size,
             ev->stream, ev->time_us);
    /* PyTorch files an out-of-memory event's free device memory in addr
     * and in device_free */
    if (ev->action == GM_HISTORY_OOM) gm_emitf(e, "\"device_free\":%" PRIu64 ",", ev->addr);
    gm_emit(e, "\"frames\":", 9);
    frames(e, tag_file, ev->tag);
    gm_emit(e, "}", 1);
  }
}

/* The snapshot, with gm's lock held (also at an out-of-memory failure). */
static void snapshot_locked(gpumem_t* gm, int device, const char* tag_file, gm_emitter* e) {
  snapshot_ctx c = {gm, device, e, tag_file ? tag_file : "gpumem tag", true, 0};
  gm_emit(e, "{\"segments\":[", 13);
  write_segments(&c);
  gm_emit(e, "],\n\"device_traces\":[", 20);
  for (int d = 0; d < device; d++) gm_emit(e, "[],", 3);
  gm_emit(e, "[", 1);
  write_events(e, gm->history, c.tag_file);
  gm_emit(e, "]],\n", 4);
  const gm_history* h = gm->history;
  uint64_t spare = (uint64_t)(gm->num_spare_pages + gm->spare_run_pages) * gm->page_size;
  gm_emitf(e,
           "\"gpumem\":{\"policy\":\"%s\",\"virtual_memory\":%s,\"page_size\":%zu"
           ",\"reserved_bytes\":%" PRId64 ",\"allocated_bytes\":%" PRId64
           ",\"segment_bytes\":%" PRIu64 ",\"spare_bytes\":%" PRIu64
           ",\"history_capacity\":%zu,\"history_recorded\":%" PRIu64 "}}\n",
           gm->opts.policy == GPUMEM_POLICY_PYTORCH ? "pytorch" : "default",
           gm->virtual_memory ? "true" : "false", gm->virtual_memory ? gm->page_size : (size_t)0,
           gm->stats.reserved_bytes[GPUMEM_POOL_ALL].current,
           gm->stats.allocated_bytes[GPUMEM_POOL_ALL].current, c.segment_bytes, spare,
           h ? h->capacity : (size_t)0, h ? h->recorded : (uint64_t)0);
}

int gpumem_snapshot_json(gpumem_t* gm, int device, const char* tag_file, gpumem_write_fn write,
                         void* arg) {
  if (!gm || !write || device < 0) {
    return (int)gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_snapshot_json: %s",
                        !gm      ? "NULL allocator"
                        : !write ? "NULL write"
                                 : "negative device");
  }
  gm_emitter e = {write, arg, 0};
  gm_lock_acquire(&gm->lock);
  snapshot_locked(gm, device, tag_file, &e);
  gm_lock_release(&gm->lock);
  return e.rc;
}

/* Option oom_snapshot: the path with "%p" replaced by the process id. */
static void oom_snapshot_path(const char* pattern, char* out, size_t cap) {
  size_t n = 0;
  for (const char* p = pattern; *p && n + 1 < cap; p++) {
    if (p[0] == '%' && p[1] == 'p') {
      int w = snprintf(out + n, cap - n, "%ld", (long)getpid());
      n = w > 0 && (size_t)w < cap - n ? n + (size_t)w : cap - 1;
      p++;
    } else {
      out[n++] = *p;
    }
  }
  out[n] = '\0';
}

/* The snapshot goes to a file made afresh beside the target, renamed over
 * it (outfile.c): a link, FIFO or another user's file planted at the
 * target (as in a shared /tmp) is refused, never followed, truncated or
 * written through. */
bool gm_oom_snapshot(gpumem_t* gm, char* said, size_t said_cap) {
  char path[sizeof gm->opts.oom_snapshot + 32], why[1400];
  oom_snapshot_path(gm->opts.oom_snapshot, path, sizeof path);
  gm_outfile out;
  int fd = gm_outfile_open(&out, path, 0600, why, sizeof why);
  FILE* f = fd >= 0 ? fdopen(fd, "w") : NULL;
  if (!f) {
    if (fd >= 0) {
      snprintf(why, sizeof why, "cannot write %s: %s", path, strerror(errno));
      close(fd);
      gm_outfile_abandon(&out);
    }
    snprintf(said, said_cap, "could not write the snapshot: %s", why);
    return false;
  }
  gm_emitter e = {gpumem_write_to_file, f, 0};
  snapshot_locked(gm, gm->device_index >= 0 ? gm->device_index : 0, NULL, &e);
  bool ok = e.rc == 0;
  if (fclose(f) != 0) ok = false;
  if (!ok) {
    gm_outfile_abandon(&out);
  } else if (!gm_outfile_commit(&out, why, sizeof why)) {
    snprintf(said, said_cap, "could not write the snapshot: %s", why);
    return false;
  }
  snprintf(said, said_cap, ok ? "snapshot written to %s" : "writing the snapshot to %s failed",
           path);
  return ok;
}
