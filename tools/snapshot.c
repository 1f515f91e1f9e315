/* PyTorch memory snapshots as traces: the dict that
 * torch.cuda.memory._dump_snapshot() pickles ("segments" and
 * "device_traces") becomes the events of a trace (trace.h's builder), so
 * every command that reads a trace reads a snapshot. The events of one device are
 * used: alloc (the size the program asked for), free_requested (the trace's
 * free time, as in the bundled traces); free_completed and oom are not
 * needed; segment_alloc/free/map/unmap give the peak reserved memory the
 * recording process had, kept beside the trace to compare a replay with.
 *
 * A snapshot whose history does not reach back to the start of the
 * allocations it shows (recorded without history, history started after
 * memory was allocated, or a ring of max_entries that wrapped) cannot be
 * replayed honestly: the missing allocations change every figure. That is
 * an error saying how much is missing, unless GPUMEM_SNAPSHOT_PARTIAL=1
 * asks for a replay anyway with the missing allocations made first. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pickle.h"
#include "show.h"
#include "snapshot.h"

#define GIB 1073741824.0

/* The trace's events as they are found, kept apart until the allocations
 * made before the first recorded event (found after it) can go first. */
typedef struct event_list {
  trace_event_t* ev; /* id: the trace ID; size and stream as read */
  uint32_t* role;    /* per event: its role's index in the role table + 1, 0 for none */
  size_t len, cap;
  int failed;
} event_list_t;

/* The roles of a snapshot's allocations, each text kept once: a pickle
 * may name one frame list for every event (two bytes of file each). */
typedef struct role_table {
  char** names;
  size_t n, cap;
  uint64_t* keys; /* open addressing on the text's hash: index + 1, 0 empty */
  uint32_t* slots;
  size_t mask;
  int failed;
} role_table_t;

/* The index + 1 of text in the table, added when new; 0 when out of memory. */
static uint32_t role_intern(role_table_t* r, const char* text) {
  if (r->failed) return 0;
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char* c = text; *c; c++) h = (h ^ (unsigned char)*c) * 0x100000001b3ull;
  if (r->n * 2 >= r->mask) {
    size_t cap = r->mask ? (r->mask + 1) * 2 : 256;
    uint64_t* keys = calloc(cap, sizeof *keys);
    uint32_t* slots = calloc(cap, sizeof *slots);
    if (!keys || !slots) {
      free(keys);
      free(slots);
      r->failed = 1;
      return 0;
    }
    for (size_t i = 0; r->mask && i <= r->mask; i++) {
      if (!r->slots[i]) continue;
      size_t j = r->keys[i] & (cap - 1);
      while (slots[j]) j = (j + 1) & (cap - 1);
      keys[j] = r->keys[i];
      slots[j] = r->slots[i];
    }
    free(r->keys);
    free(r->slots);
    r->keys = keys;
    r->slots = slots;
    r->mask = cap - 1;
  }
  size_t j = h & r->mask;
  for (; r->slots[j]; j = (j + 1) & r->mask)
    if (r->keys[j] == h && strcmp(r->names[r->slots[j] - 1], text) == 0) return r->slots[j];
  if (r->n == r->cap) {
    size_t cap = r->cap ? r->cap * 2 : 256;
    char** names = realloc(r->names, cap * sizeof *names);
    if (!names) {
      r->failed = 1;
      return 0;
    }
    r->names = names;
    r->cap = cap;
  }
  if (!(r->names[r->n] = strdup(text))) {
    r->failed = 1;
    return 0;
  }
  r->keys[j] = h;
  r->slots[j] = (uint32_t)++r->n;
  return r->slots[j];
}

static void role_table_free(role_table_t* r) {
  for (size_t i = 0; i < r->n; i++) free(r->names[i]);
  free(r->names);
  free(r->keys);
  free(r->slots);
}

static void put_role(event_list_t* l, trace_op_t op, uint64_t id, uint64_t size, uint64_t stream,
                     uint32_t role) {
  if (l->failed) return;
  if (l->len == l->cap) {
    size_t n = l->cap ? l->cap * 2 : 4096;
    trace_event_t* bigger = realloc(l->ev, n * sizeof *bigger);
    if (bigger) l->ev = bigger;
    uint32_t* roles = bigger ? realloc(l->role, n * sizeof *roles) : NULL;
    if (!roles) {
      l->failed = 1;
      return;
    }
    l->role = roles;
    l->cap = n;
  }
  /* IDs are counted here from 1, far below 2^32 events */
  trace_event_t e = {.size = size, .stream = (uintptr_t)stream, .id = (uint32_t)id, .op = op};
  l->role[l->len] = role;
  l->ev[l->len++] = e;
}

static void put(event_list_t* l, trace_op_t op, uint64_t id, uint64_t size, uint64_t stream) {
  put_role(l, op, id, size, stream, 0);
}

/* The events of l into b. */
static gpumem_status_t build(trace_builder_t* b, const event_list_t* l, const role_table_t* roles) {
  gpumem_status_t st = GPUMEM_OK;
  for (size_t i = 0; i < l->len && st == GPUMEM_OK; i++) {
    const trace_event_t* e = &l->ev[i];
    if (e->op == TRACE_ALLOC)
      st = trace_builder_alloc_role(b, e->id, e->size, e->stream,
                                    l->role[i] ? roles->names[l->role[i] - 1] : NULL);
    else
      st = trace_builder_free(b, e->id);
  }
  return st;
}

/* An integer field of an event or block; 0 when absent or not an int. */
static int64_t int_field(const pickle_doc_t* d, const pickle_value_t* dict, const char* key,
                         int* ok) {
  const pickle_value_t* v = pickle_get(d, dict, key);
  if (!v || (v->type != PICKLE_INT && v->type != PICKLE_BOOL)) {
    if (ok) *ok = 0;
    return 0;
  }
  return v->i;
}

/* Live allocations by address: a small open-addressing map. */
typedef struct live_map {
  uint64_t* addr;
  uint64_t* id; /* 0: empty cell (IDs start at 1) */
  size_t mask, count;
  uint64_t salt; /* mixed into every hash (below) */
} live_map_t;

/* Each table mixes a salt of its own into its hashes, as in trace.c:
 * addresses come from the file, and the finalizer is invertible, so
 * without a salt unknown to the file's author it could pick addresses that
 * all land in one probe run. */
static size_t hash(const live_map_t* m, uint64_t k) {
  k += m->salt;
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  return (size_t)k;
}

static int live_init(live_map_t* m, size_t n) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  m->salt = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ (uint64_t)(uintptr_t)m;
  size_t c = 64;
  while (c < n * 2) c *= 2;
  m->addr = calloc(c, sizeof *m->addr);
  m->id = calloc(c, sizeof *m->id);
  m->mask = c - 1;
  m->count = 0;
  return m->addr && m->id ? 0 : -1;
}

static size_t live_cell(const live_map_t* m, uint64_t a) {
  size_t i = hash(m, a) & m->mask;
  while (m->id[i] && m->addr[i] != a) i = (i + 1) & m->mask;
  return i;
}

/* Removes cell i, re-placing the run after it (no tombstones). */
static void live_remove(live_map_t* m, size_t i) {
  m->id[i] = 0;
  m->count--;
  for (size_t j = (i + 1) & m->mask; m->id[j]; j = (j + 1) & m->mask) {
    uint64_t a = m->addr[j], id = m->id[j];
    m->id[j] = 0;
    size_t c = live_cell(m, a);
    m->addr[c] = a;
    m->id[c] = id;
  }
}

/* Copies at most cap - 1 bytes of the string v into out as a part of a
 * ROLE field: printable ASCII but blanks ('?' for the rest, so nothing in a
 * file name can end the field or the line); returns the length. */
static size_t role_part(const pickle_value_t* v, char* out, size_t cap) {
  size_t n = 0;
  if (v && v->type == PICKLE_STR) {
    const char* s = v->s;
    size_t len = v->len;
    for (size_t i = 0; i < len && n + 1 < cap; i++) {
      unsigned char c = (unsigned char)s[i];
      out[n++] = c > 0x20 && c < 0x7f ? (char)c : '?';
    }
  }
  out[n] = '\0';
  return n;
}

/* Whether the pickle string v ends with (or, contains) the C string w. */
static int str_has(const pickle_value_t* v, const char* w, int at_end) {
  size_t n = strlen(w);
  if (!v || v->type != PICKLE_STR || v->len < n) return 0;
  if (at_end) return memcmp(v->s + v->len - n, w, n) == 0;
  for (size_t j = 0; j + n <= v->len; j++)
    if (memcmp(v->s + j, w, n) == 0) return 1;
  return 0;
}

/* Whether an allocation was made inside a convolution, by its frames:
 * nn.Conv*'s forward (torch/nn/modules/conv.py, the Python frames every
 * snapshot has) or, where C++ frames were recorded, cuDNN's convolution.
 * cuDNN picks a convolution's algorithm, and the workspace it takes
 * through the allocator, by shape, so what recordings at small batches
 * show of them need not hold at a larger one (predict says so). */
static int frames_convolution(const pickle_doc_t* d, const pickle_value_t* e) {
  const pickle_value_t* frames = pickle_get(d, e, "frames");
  if (!frames || frames->type != PICKLE_LIST) return 0;
  for (size_t i = 0; i < frames->len; i++) {
    const pickle_value_t* f = pickle_item(d, frames, i);
    if (f->type != PICKLE_DICT) continue;
    if (str_has(pickle_get(d, f, "filename"), "torch/nn/modules/conv.py", 1) ||
        str_has(pickle_get(d, f, "name"), "cudnn_convolution", 0))
      return 1;
  }
  return 0;
}

/* Frames a role looks at: the innermost (a deep recursion adds nothing). */
#define ROLE_FRAMES 64

/* What made an allocation, from its frames (innermost first): its role
 * (tools/trace.h), "name@file:line~hash" with the innermost frame outside
 * PyTorch's own installed files (else the innermost) and a hash of all of them, so
 * that two allocations made by one line at different depths differ, after
 * TRACE_OPTIMIZER_ROLE where a frame is in torch/optim (an optimizer's
 * step: align.c keeps such a request's size where one recording lacks it).
 * 0 when the event has no frames (a snapshot recorded without them). */
static int frames_role(const pickle_doc_t* d, const pickle_value_t* e, char* out, size_t cap) {
  const pickle_value_t* frames = pickle_get(d, e, "frames");
  if (!frames || frames->type != PICKLE_LIST || frames->len == 0) return 0;
  uint64_t h = 0xcbf29ce484222325ull;
  const pickle_value_t* shown = NULL;
  int optimizer = 0;
  size_t n = frames->len < ROLE_FRAMES ? frames->len : ROLE_FRAMES;
  for (size_t i = 0; i < n; i++) {
    const pickle_value_t* f = pickle_item(d, frames, i);
    if (f->type != PICKLE_DICT) continue;
    const pickle_value_t* file = pickle_get(d, f, "filename");
    const pickle_value_t* name = pickle_get(d, f, "name");
    const pickle_value_t* line = pickle_get(d, f, "line");
    const pickle_value_t* parts[2] = {file, name};
    for (int k = 0; k < 2; k++) {
      if (!parts[k] || parts[k]->type != PICKLE_STR) continue;
      for (size_t j = 0; j < parts[k]->len; j++)
        h = (h ^ (unsigned char)parts[k]->s[j]) * 0x100000001b3ull;
      h = (h ^ 0xff) * 0x100000001b3ull;
    }
    if (line && line->type == PICKLE_INT) h = (h ^ (uint64_t)line->i) * 0x100000001b3ull;
    /* (PyTorch's own files as installed: a script of the user's may lie
     * in a directory named torch) */
    if (!shown && file && file->type == PICKLE_STR && !str_has(file, "-packages/torch/", 0))
      shown = f;
    if (str_has(file, "/torch/optim/", 0)) optimizer = 1;
  }
  if (!shown) shown = pickle_item(d, frames, 0);
  if (shown->type != PICKLE_DICT) shown = NULL;
  char name[48] = "", file[64] = "";
  long long line = 0;
  if (shown) {
    role_part(pickle_get(d, shown, "name"), name, sizeof name);
    const pickle_value_t* fv = pickle_get(d, shown, "filename");
    if (fv && fv->type == PICKLE_STR) {
      /* the file's base name: the role is for people to read */
      pickle_value_t base = *fv;
      for (size_t j = fv->len; j > 0; j--)
        if (fv->s[j - 1] == '/') {
          base.s = fv->s + j;
          base.len = fv->len - j;
          break;
        }
      role_part(&base, file, sizeof file);
    }
    const pickle_value_t* lv = pickle_get(d, shown, "line");
    if (lv && lv->type == PICKLE_INT) line = (long long)lv->i;
  }
  snprintf(out, cap, "%s%s@%s:%lld~%08llx", optimizer ? TRACE_OPTIMIZER_ROLE : "",
           name[0] ? name : "?", file[0] ? file : "?", line,
           (unsigned long long)(h & 0xffffffffull));
  return 1;
}

/* Marks the dict v as read; 0 when it was read before. The events, segments
 * and blocks of a snapshot are distinct objects, and a memo reference can
 * name one dict any number of times for two bytes each: 16M references to
 * one event made 16M trace events (3.8 GB), and N references to a dict of K
 * keys cost N x K key comparisons. Reading each dict once keeps the work
 * linear in the file. */
static int first_read(unsigned char* seen, const pickle_doc_t* d, const pickle_value_t* v) {
  size_t i = (size_t)(v - d->values);
  if (seen[i / 8] & (1u << (i % 8))) return 0;
  seen[i / 8] |= (unsigned char)(1u << (i % 8));
  return 1;
}

gpumem_status_t snapshot_to_trace(const char* path, const unsigned char* data, size_t len,
                                  trace_t** out) {
  *out = NULL;
  pickle_doc_t doc;
  gpumem_status_t st = pickle_read(path, data, len, &doc);
  if (st != GPUMEM_OK) return st;
  const pickle_value_t* root = &doc.values[doc.root];
  const pickle_value_t* traces = pickle_get(&doc, root, "device_traces");
  const pickle_value_t* segments = pickle_get(&doc, root, "segments");
  event_list_t body = {0}; /* the trace's events */
  event_list_t pre = {0};  /* allocations made before the first recorded event */
  role_table_t roles = {0};
  trace_builder_t* builder = NULL;
  live_map_t live = {0};
  unsigned char* seen = calloc(doc.num_values / 8 + 1, 1);
  if (!seen) goto no_memory;
  if (root->type != PICKLE_DICT || !traces || traces->type != PICKLE_LIST) {
    gpumem_set_last_error(
        "%s: a pickle, but not a PyTorch memory snapshot (no \"device_traces\" list: expected the "
        "dict torch.cuda.memory._snapshot() returns)",
        path);
    st = GPUMEM_ERR_IO;
    goto done;
  }

  /* Which device: GPUMEM_SNAPSHOT_DEVICE, else the one with most events. */
  long device = -1;
  size_t busiest = 0, with_events = 0, total_events = 0;
  for (size_t d = 0; d < traces->len; d++) {
    const pickle_value_t* ev = pickle_item(&doc, traces, d);
    size_t n = ev->type == PICKLE_LIST ? ev->len : 0;
    total_events += n;
    if (n) with_events++;
    if (n > busiest) {
      busiest = n;
      device = (long)d;
    }
  }
  const char* want = getenv("GPUMEM_SNAPSHOT_DEVICE");
  if (want && *want) {
    char* end;
    long d = strtol(want, &end, 10);
    if (*end || d < 0 || (size_t)d >= traces->len) {
      gpumem_set_last_error(
          "%s: GPUMEM_SNAPSHOT_DEVICE=%s names no device of the snapshot "
          "(it has %zu: 0 to %zu)",
          path, want, traces->len, traces->len ? traces->len - 1 : 0);
      st = GPUMEM_ERR_INVALID_ARGUMENT;
      goto done;
    }
    device = d;
  } else if (with_events > 1) {
    char shown[512];
    fprintf(stderr,
            "gpumem: note: %s holds events of %zu devices; replaying device %ld, the busiest "
            "(GPUMEM_SNAPSHOT_DEVICE=N picks another)\n",
            show_text(path, shown, sizeof shown), with_events, device);
  }
  if (total_events == 0 || device < 0) {
    gpumem_set_last_error(
        "%s: the snapshot has no allocation history (\"device_traces\" is empty): it was taken "
        "without torch.cuda.memory._record_memory_history() running, so there is nothing to "
        "replay. Call _record_memory_history(max_entries=N) before the job allocates, N above "
        "the number of allocations and frees it makes, then _dump_snapshot()",
        path);
    st = GPUMEM_ERR_IO;
    goto done;
  }
  const pickle_value_t* events = pickle_item(&doc, traces, (size_t)device);
  if (events->type != PICKLE_LIST || events->len == 0) {
    gpumem_set_last_error("%s: device %ld has no recorded events", path, device);
    st = GPUMEM_ERR_IO;
    goto done;
  }
  if (live_init(&live, events->len / 2 + 64) != 0) goto no_memory;

  /* Pass over the events: the trace body, and what the ring is missing. */
  uint64_t next_id = 1;
  size_t lost_frees = 0, allocs = 0, conv_allocs = 0;
  uint64_t lost_free_bytes = 0;
  int64_t reserved = 0, peak_reserved = 0, min_reserved = 0;
  size_t segment_events = 0;
  for (size_t k = 0; k < events->len; k++) {
    const pickle_value_t* e = pickle_item(&doc, events, k);
    if (!first_read(seen, &doc, e)) {
      gpumem_set_last_error(
          "%s: device %ld event %zu is an event already read (the pickle names one object "
          "twice): a snapshot records each event once",
          path, device, k);
      st = GPUMEM_ERR_IO;
      goto done;
    }
    const pickle_value_t* action = pickle_get(&doc, e, "action");
    if (!action || action->type != PICKLE_STR) {
      gpumem_set_last_error("%s: device %ld event %zu has no \"action\"", path, device, k);
      st = GPUMEM_ERR_IO;
      goto done;
    }
    int ok = 1;
    uint64_t addr = (uint64_t)int_field(&doc, e, "addr", &ok);
    int64_t size = int_field(&doc, e, "size", &ok);
    uint64_t stream = (uint64_t)int_field(&doc, e, "stream", NULL);
    int is_alloc = pickle_is_str(action, "alloc");
    int is_free = pickle_is_str(action, "free_requested");
    int seg_up = pickle_is_str(action, "segment_alloc") || pickle_is_str(action, "segment_map");
    int seg_down = pickle_is_str(action, "segment_free") || pickle_is_str(action, "segment_unmap");
    if ((is_alloc || is_free || seg_up || seg_down) && (!ok || size < 0)) {
      gpumem_set_last_error("%s: device %ld event %zu (%.*s) lacks an integer addr or size", path,
                            device, k, (int)action->len, action->s);
      st = GPUMEM_ERR_IO;
      goto done;
    }
    /* The trace reader's cap, checked here too because segment sizes never
     * reach it: two segments of 2^63 - 1 bytes overflowed the reserved sum
     * (undefined behaviour). Under the cap the sum cannot overflow before
     * more events than a pickle can hold. */
    if (size > (int64_t)TRACE_MAX_SIZE) {
      gpumem_set_last_error(
          "%s: device %ld event %zu (%.*s) has size %lld, larger than the readers' limit of "
          "2^48 bytes (256 TiB)",
          path, device, k, (int)action->len, action->s, (long long)size);
      st = GPUMEM_ERR_IO;
      goto done;
    }
    if (is_alloc) {
      size_t c = live_cell(&live, addr);
      if (live.id[c]) {
        gpumem_set_last_error(
            "%s: device %ld event %zu allocates address 0x%llx, which is "
            "already allocated",
            path, device, k, (unsigned long long)addr);
        st = GPUMEM_ERR_IO;
        goto done;
      }
      if ((live.count + 1) * 2 > live.mask + 1) {
        /* grow: rehash into a map twice the size */
        live_map_t bigger;
        if (live_init(&bigger, live.mask + 1) != 0) goto no_memory;
        for (size_t i = 0; i <= live.mask; i++) {
          if (!live.id[i]) continue;
          size_t b = live_cell(&bigger, live.addr[i]);
          bigger.addr[b] = live.addr[i];
          bigger.id[b] = live.id[i];
          bigger.count++;
        }
        free(live.addr);
        free(live.id);
        live = bigger;
        c = live_cell(&live, addr);
      }
      live.addr[c] = addr;
      live.id[c] = next_id;
      live.count++;
      char role[TRACE_MAX_ROLE];
      uint32_t r = frames_role(&doc, e, role, sizeof role) ? role_intern(&roles, role) : 0;
      if (roles.failed) goto no_memory;
      put_role(&body, TRACE_ALLOC, next_id++, (uint64_t)size, stream, r);
      allocs++;
      conv_allocs += (size_t)frames_convolution(&doc, e);
    } else if (is_free) {
      size_t c = live_cell(&live, addr);
      if (live.id[c]) {
        put(&body, TRACE_FREE, live.id[c], 0, 0);
        live_remove(&live, c);
      } else {
        /* allocated before the first recorded event */
        lost_frees++;
        lost_free_bytes += (uint64_t)size;
        put(&pre, TRACE_ALLOC, next_id, (uint64_t)size, stream);
        put(&body, TRACE_FREE, next_id++, 0, 0);
      }
    } else if (seg_up || seg_down) {
      segment_events++;
      if (seg_up ? reserved > INT64_MAX - size : reserved < INT64_MIN + size) {
        gpumem_set_last_error(
            "%s: device %ld event %zu (%.*s): the reserved bytes its segment events add up to "
            "overflow 64 bits",
            path, device, k, (int)action->len, action->s);
        st = GPUMEM_ERR_IO;
        goto done;
      }
      reserved += seg_up ? size : -size;
      if (reserved > peak_reserved) peak_reserved = reserved;
      if (reserved < min_reserved) min_reserved = reserved;
    }
    if (body.failed || pre.failed) goto no_memory;
  }

  /* Blocks the snapshot's segments hold that no recorded event allocated. */
  size_t lost_blocks = 0;
  uint64_t lost_block_bytes = 0;
  if (segments && segments->type == PICKLE_LIST) {
    for (size_t s = 0; s < segments->len; s++) {
      const pickle_value_t* seg = pickle_item(&doc, segments, s);
      if (!first_read(seen, &doc, seg)) goto read_twice;
      int dok = 1;
      int64_t seg_dev = int_field(&doc, seg, "device", &dok);
      if (dok && seg_dev != device) continue;
      uint64_t stream = (uint64_t)int_field(&doc, seg, "stream", NULL);
      const pickle_value_t* blocks = pickle_get(&doc, seg, "blocks");
      if (!blocks || blocks->type != PICKLE_LIST) continue;
      if (!first_read(seen, &doc, blocks)) goto read_twice;
      for (size_t b = 0; b < blocks->len; b++) {
        const pickle_value_t* blk = pickle_item(&doc, blocks, b);
        if (!first_read(seen, &doc, blk)) goto read_twice;
        const pickle_value_t* state = pickle_get(&doc, blk, "state");
        if (!state || !(pickle_is_str(state, "active_allocated") ||
                        pickle_is_str(state, "active_pending_free")))
          continue;
        uint64_t addr = (uint64_t)int_field(&doc, blk, "address", NULL);
        if (live.id[live_cell(&live, addr)]) continue;
        int rok = 1;
        int64_t req = int_field(&doc, blk, "requested_size", &rok);
        if (!rok || req <= 0) req = int_field(&doc, blk, "size", NULL);
        lost_blocks++;
        lost_block_bytes += (uint64_t)req;
        put(&pre, TRACE_ALLOC, next_id++, (uint64_t)req, stream);
      }
    }
  }
  if (pre.failed) goto no_memory;
  if (allocs == 0) {
    gpumem_set_last_error("%s: device %ld's history holds no allocation (%zu events)", path, device,
                          events->len);
    st = GPUMEM_ERR_IO;
    goto done;
  }
  const char* partial = getenv("GPUMEM_SNAPSHOT_PARTIAL");
  int allow_partial = partial && strcmp(partial, "1") == 0;
  if ((lost_frees || lost_blocks) && !allow_partial) {
    gpumem_set_last_error(
        "%s: the snapshot's history does not reach back to the job's first allocation (the "
        "ring of max_entries wrapped, or recording started after memory was allocated): on "
        "device %ld, %zu frees (%.3f GiB) release allocations made before the first recorded "
        "event and %zu blocks (%.3f GiB) live in its segments were allocated before it; at least "
        "%zu events are lost. A replay would miss that memory for as long as it lived, so every "
        "peak from it is only a lower bound (by up to %.3f GiB). Record again with "
        "torch.cuda.memory._record_memory_history(max_entries=N) started before the job "
        "allocates, N above its allocations and frees (this ring held %zu events), or set "
        "GPUMEM_SNAPSHOT_PARTIAL=1 to replay it anyway with those allocations made first",
        path, device, lost_frees, (double)lost_free_bytes / GIB, lost_blocks,
        (double)lost_block_bytes / GIB, lost_frees + lost_blocks,
        (double)(lost_free_bytes + lost_block_bytes) / GIB, events->len);
    st = GPUMEM_ERR_IO;
    goto done;
  }

  /* Built as a file would read: a line saying what it is (and one saying
   * it is partial), then the allocations made before the first recorded
   * event, then the history. */
  if ((st = trace_builder_new(path, pre.len + body.len, &builder)) != GPUMEM_OK) goto done;
  trace_builder_set_line(builder, lost_frees || lost_blocks ? 3 : 2);
  st = build(builder, &pre, &roles);
  if (st == GPUMEM_OK) st = build(builder, &body, &roles);
  if (st == GPUMEM_OK) {
    st = trace_builder_finish(builder, out);
    builder = NULL;
  }
  if (st == GPUMEM_OK) {
    trace_t* t = *out;
    t->from_snapshot = 1;
    t->snapshot_device = (int)device;
    t->snapshot_lost_events = lost_frees + lost_blocks;
    t->snapshot_conv_allocs = conv_allocs;
    /* The recorded peak is known when the segment events start from an
     * empty device: nothing reserved before the first one. */
    if (segment_events && min_reserved >= 0 && !lost_frees && !lost_blocks)
      t->recorded_peak_reserved = (uint64_t)peak_reserved;
  }
  goto done;

read_twice:
  gpumem_set_last_error(
      "%s: a segment or block of \"segments\" is one already read (the pickle names one object "
      "twice): a snapshot lists each once",
      path);
  st = GPUMEM_ERR_IO;
  goto done;

no_memory:
  gpumem_set_last_error("%s: out of host memory converting the snapshot", path);
  st = GPUMEM_ERR_HOST_MEMORY;
done:
  trace_builder_discard(builder);
  free(body.ev);
  free(body.role);
  free(pre.ev);
  free(pre.role);
  role_table_free(&roles);
  free(live.addr);
  free(live.id);
  free(seen);
  pickle_free(&doc);
  return st;
}
