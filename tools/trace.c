/* Traces in memory: the builder that turns events into a trace_t, checking
 * that they are consistent (every free names a live ID), mapping the IDs
 * to dense slots and computing the facts the replay reports; the text
 * format's parser, which feeds it a file's lines; and the transformations
 * (a longer run, resized allocations), which feed it events. Every error
 * names the file and the line, since traces are hand-edited and generated
 * by scripts alike. Reading a file is reader.c's. */
#include "trace.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "show.h"

/* ---- a small hash map: 64-bit key -> 32-bit value -------------------- */

/* Keys are never removed: the ID map keeps each ID's latest slot and the
 * slot's live flag says whether it is allocated, so a reused ID just
 * overwrites its value. That keeps the table free of tombstones. */
#define MAP_EMPTY UINT32_MAX

typedef struct u64map {
  uint64_t* keys;
  uint32_t* vals; /* MAP_EMPTY marks an unused cell */
  size_t mask;
  size_t count;
  uint64_t salt; /* mixed into every hash (below) */
} u64map_t;

/* A salt of each table's own, mixed into its hashes. The finalizer below
 * is a bijection anyone can invert: a file could pick IDs whose hashes
 * share their low bits, and every insert would then probe the whole
 * cluster (quadratic: 50k such IDs took 8.6 s). Unknown to the file's
 * author, the salt makes such IDs as likely to collide as any. Lookups
 * never depend on the order of the table, so results stay deterministic;
 * and a table's own salt, unlike a shared one set on first use, needs no
 * care when threads read traces at once. */
static uint64_t new_salt(const void* where) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 40) ^
         (uint64_t)(uintptr_t)where;
}

static size_t map_hash(const u64map_t* m, uint64_t key) {
  /* splitmix64's finalizer: IDs are sequential and stream handles aligned,
   * so low bits alone would cluster. */
  key += m->salt;
  key ^= key >> 30;
  key *= 0xbf58476d1ce4e5b9ULL;
  key ^= key >> 27;
  key *= 0x94d049bb133111ebULL;
  key ^= key >> 31;
  return (size_t)key;
}

static int map_init(u64map_t* m, size_t cap) {
  m->salt = new_salt(m);
  size_t n = 16;
  while (n < cap * 2) n *= 2;
  m->keys = malloc(n * sizeof *m->keys);
  m->vals = malloc(n * sizeof *m->vals);
  m->mask = n - 1;
  m->count = 0;
  if (!m->keys || !m->vals) return -1;
  memset(m->vals, 0xff, n * sizeof *m->vals);
  return 0;
}

static void map_destroy(u64map_t* m) {
  free(m->keys);
  free(m->vals);
  m->keys = NULL;
  m->vals = NULL;
}

/* Cell of key, or the empty cell where it would go. */
static size_t map_cell(const u64map_t* m, uint64_t key) {
  size_t i = map_hash(m, key) & m->mask;
  while (m->vals[i] != MAP_EMPTY && m->keys[i] != key) i = (i + 1) & m->mask;
  return i;
}

static uint32_t map_get(const u64map_t* m, uint64_t key) {
  return m->vals[map_cell(m, key)];
}

static int map_grow(u64map_t* m) {
  u64map_t bigger;
  if (map_init(&bigger, (m->mask + 1)) != 0) {
    map_destroy(&bigger);
    return -1;
  }
  for (size_t i = 0; i <= m->mask; i++) {
    if (m->vals[i] == MAP_EMPTY) continue;
    size_t c = map_cell(&bigger, m->keys[i]);
    bigger.keys[c] = m->keys[i];
    bigger.vals[c] = m->vals[i];
  }
  bigger.count = m->count;
  map_destroy(m);
  *m = bigger;
  return 0;
}

/* Sets key to val; returns 1 if the key is new, 0 if it existed, -1 on
 * host memory failure. */
static int map_put(u64map_t* m, uint64_t key, uint32_t val) {
  if ((m->count + 1) * 2 > m->mask + 1 && map_grow(m) != 0) return -1;
  size_t c = map_cell(m, key);
  int is_new = m->vals[c] == MAP_EMPTY;
  m->keys[c] = key;
  m->vals[c] = val;
  if (is_new) m->count++;
  return is_new;
}

/* ---- parsing helpers -------------------------------------------------- */

typedef struct token {
  const char* s;
  size_t len;
} token_t;

/* Splits a line into at most max tokens on spaces and tabs; a token that
 * starts with '#' begins a trailing comment. Returns the number found, or
 * max + 1 when there are more (the caller reports the first extra one in
 * tok[max]). */
static size_t split_line(const char* s, size_t len, token_t* tok, size_t max) {
  size_t n = 0, i = 0;
  while (i < len) {
    while (i < len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r')) i++;
    if (i >= len || s[i] == '#') break;
    size_t start = i;
    while (i < len && s[i] != ' ' && s[i] != '\t' && s[i] != '\r') i++;
    tok[n].s = s + start;
    tok[n].len = i - start;
    if (n == max) return max + 1;
    n++;
  }
  return n;
}

/* A token for a message: at most 40 characters, anything unprintable shown
 * as '?', so that a binary file does not fill the terminal with noise. */
static const char* show(token_t t, char* buf, size_t cap) {
  size_t n = t.len < 40 ? t.len : 40;
  if (n > cap - 4) n = cap - 4;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)t.s[i];
    buf[i] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
  }
  if (t.len > n) {
    memcpy(buf + n, "...", 3);
    n += 3;
  }
  buf[n] = '\0';
  return buf;
}

typedef enum num_result { NUM_OK = 0, NUM_BAD = 1, NUM_OVERFLOW = 2 } num_result_t;

/* Unsigned decimal (and 0x hexadecimal when hex is set: stream handles are
 * pointers and some tools write them that way). No sign, no spaces. */
static num_result_t parse_u64(token_t t, int hex, uint64_t* out) {
  const char* s = t.s;
  size_t len = t.len;
  unsigned base = 10;
  if (hex && len > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    base = 16;
    s += 2;
    len -= 2;
  }
  if (len == 0) return NUM_BAD;
  uint64_t v = 0;
  int overflow = 0;
  for (size_t i = 0; i < len; i++) {
    unsigned d;
    char c = s[i];
    if (c >= '0' && c <= '9') {
      d = (unsigned)(c - '0');
    } else if (base == 16 && c >= 'a' && c <= 'f') {
      d = (unsigned)(c - 'a' + 10);
    } else if (base == 16 && c >= 'A' && c <= 'F') {
      d = (unsigned)(c - 'A' + 10);
    } else {
      return NUM_BAD;
    }
    if (v > (UINT64_MAX - d) / base) overflow = 1;
    v = v * base + d;
  }
  if (overflow) return NUM_OVERFLOW;
  *out = v;
  return NUM_OK;
}

/* ---- building a trace ------------------------------------------------- */

/* One builder for every trace: the text parser feeds it the events of a
 * file's lines, and the snapshot reader and the trace transformations feed
 * it events directly, so every fact and check is the usual one and no text
 * from outside (a path, a file's contents) is ever read back as events. */
struct trace_builder {
  const char* path; /* t->path: messages name it */
  size_t line;
  trace_t* t;
  size_t events_cap;
  size_t slots_cap;
  size_t steps_cap;
  uint8_t* slot_live;
  u64map_t ids;     /* trace ID -> latest slot */
  u64map_t streams; /* distinct streams (value unused) */
  u64map_t roles;   /* a role's hash -> its index in t->roles */
  size_t roles_cap;
  size_t slot_roles_cap;
  uint64_t live_bytes;
  size_t live_allocs;
};
typedef struct trace_builder parser_t;

static gpumem_status_t fail_line(parser_t* p, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Every parse error reads "PATH: line N: what is wrong". */
static gpumem_status_t fail_line(parser_t* p, const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  gpumem_set_last_error("%s: line %zu: %s", p->path, p->line, msg);
  return GPUMEM_ERR_IO;
}

static gpumem_status_t no_memory(parser_t* p) {
  gpumem_set_last_error("%s: out of host memory at line %zu", p->path, p->line);
  return GPUMEM_ERR_HOST_MEMORY;
}

/* The per-slot arrays grow together, doubling. */
static int grow_slots(parser_t* p) {
  size_t n = p->slots_cap ? p->slots_cap * 2 : 1024;
  uint64_t* ids = realloc(p->t->slot_trace_id, n * sizeof *ids);
  if (!ids) return -1;
  p->t->slot_trace_id = ids;
  size_t* ev = realloc(p->t->slot_event, n * sizeof *ev);
  if (!ev) return -1;
  p->t->slot_event = ev;
  uint8_t* live = realloc(p->slot_live, n);
  if (!live) return -1;
  p->slot_live = live;
  p->slots_cap = n;
  return 0;
}

static int grow(void** arr, size_t* cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t n = *cap ? *cap : 1024;
  while (n < need) n *= 2;
  void* bigger = realloc(*arr, n * elem);
  if (!bigger) return -1;
  *arr = bigger;
  *cap = n;
  return 0;
}

/* Parses field `what` of the line as a number; reports bad and too-large
 * values by name. */
static gpumem_status_t field_u64(parser_t* p, token_t t, const char* what, int hex, uint64_t* out) {
  char buf[64];
  switch (parse_u64(t, hex, out)) {
    case NUM_OK:
      return GPUMEM_OK;
    case NUM_OVERFLOW:
      return fail_line(p, "%s '%s' is too large", what, show(t, buf, sizeof buf));
    default:
      break;
  }
  return fail_line(p, "%s '%s' is not a non-negative integer", what, show(t, buf, sizeof buf));
}

/* Checks the field count of an op: want fields after the op letter. */
static gpumem_status_t field_count(parser_t* p, size_t got, size_t want, const token_t* tok,
                                   const char* form) {
  char buf[64];
  if (got > want + 1) {
    return fail_line(p, "extra field '%s' (expected '%s')", show(tok[want + 1], buf, sizeof buf),
                     form);
  }
  if (got < want + 1) return fail_line(p, "missing field (expected '%s')", form);
  return GPUMEM_OK;
}

static gpumem_status_t add_stream(parser_t* p, uintptr_t stream) {
  /* Checked before the insert, so the map never holds more than the cap. */
  if (p->streams.count >= TRACE_MAX_STREAMS && map_get(&p->streams, (uint64_t)stream) == MAP_EMPTY)
    return fail_line(p,
                     "stream 0x%llx is the trace's %dth distinct stream: more than the "
                     "readers' limit of %d streams",
                     (unsigned long long)stream, TRACE_MAX_STREAMS + 1, TRACE_MAX_STREAMS);
  if (map_put(&p->streams, (uint64_t)stream, 0) < 0) return no_memory(p);
  return GPUMEM_OK;
}

/* Looks up the live slot of an ID for a free or record_stream. */
static gpumem_status_t live_slot(parser_t* p, uint64_t id, const char* verb, uint32_t* slot) {
  uint32_t s = map_get(&p->ids, id);
  if (s == MAP_EMPTY || !p->slot_live[s]) {
    return fail_line(p, "%s of id %llu which is not allocated", verb, (unsigned long long)id);
  }
  *slot = s;
  return GPUMEM_OK;
}

static gpumem_status_t push_event(parser_t* p, const trace_event_t* ev) {
  trace_t* t = p->t;
  if (grow((void**)&t->events, &p->events_cap, t->num_events + 1, sizeof *t->events) != 0)
    return no_memory(p);
  t->events[t->num_events] = *ev;
  t->events[t->num_events].line = p->line > UINT32_MAX ? UINT32_MAX : (uint32_t)p->line;
  t->num_events++;
  return GPUMEM_OK;
}

/* FNV-1a: a role's text as a map key (its text decides on a collision). */
static uint64_t role_hash(const char* s, size_t len) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
  return h;
}

/* Gives allocation `slot` the role in s[0, len) (NULL: none), added to
 * t->roles when new. slot_role covers every slot once one has a role. */
static gpumem_status_t set_role(parser_t* p, size_t slot, const char* s, size_t len) {
  trace_t* t = p->t;
  if (!s && !t->slot_role) return GPUMEM_OK;
  if (grow((void**)&t->slot_role, &p->slot_roles_cap, t->num_allocs + 1, sizeof *t->slot_role) != 0)
    return no_memory(p);
  if (!s) {
    t->slot_role[slot] = 0;
    return GPUMEM_OK;
  }
  char buf[64];
  token_t tok = {s, len};
  if (len > TRACE_MAX_ROLE)
    return fail_line(p, "ROLE '%s' is longer than %d characters", show(tok, buf, sizeof buf),
                     TRACE_MAX_ROLE);
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c <= 0x20 || c >= 0x7f)
      return fail_line(p, "ROLE '%s' has a character that is not printable ASCII",
                       show(tok, buf, sizeof buf));
  }
  if (slot > 0 && t->num_roles == 0) /* the first role: those before it have none */
    memset(t->slot_role, 0, slot * sizeof *t->slot_role);
  if (!p->roles.keys && map_init(&p->roles, 64) != 0) return no_memory(p);
  uint64_t h = role_hash(s, len);
  uint32_t idx = map_get(&p->roles, h);
  if (idx == MAP_EMPTY || strlen(t->roles[idx]) != len || memcmp(t->roles[idx], s, len) != 0) {
    if (grow((void**)&t->roles, &p->roles_cap, t->num_roles + 2, sizeof *t->roles) != 0)
      return no_memory(p);
    if (t->num_roles == 0) t->roles[t->num_roles++] = NULL; /* index 0: no role */
    char* text = strndup(s, len);
    if (!text) return no_memory(p);
    idx = (uint32_t)t->num_roles;
    t->roles[t->num_roles++] = text;
    if (map_get(&p->roles, h) == MAP_EMPTY && map_put(&p->roles, h, idx) < 0) return no_memory(p);
  }
  t->slot_role[slot] = idx;
  return GPUMEM_OK;
}

static gpumem_status_t add_alloc(parser_t* p, uint64_t id, uint64_t size, uint64_t stream,
                                 const char* role, size_t role_len) {
  trace_t* t = p->t;
  gpumem_status_t st;
  if (size > TRACE_MAX_SIZE) {
    return fail_line(p, "SIZE %llu is larger than the readers' limit of 2^48 bytes (256 TiB)",
                     (unsigned long long)size);
  }
#if UINTPTR_MAX < UINT64_MAX
  if (stream > UINTPTR_MAX) return fail_line(p, "STREAM does not fit in a pointer");
#endif
  uint32_t old = map_get(&p->ids, id);
  if (old != MAP_EMPTY && p->slot_live[old]) {
    return fail_line(p, "alloc of id %llu which is already allocated (at line %u)",
                     (unsigned long long)id, (unsigned)t->events[t->slot_event[old]].line);
  }
  if (t->num_allocs >= MAP_EMPTY) return fail_line(p, "too many allocations");
  if (p->live_bytes + size < p->live_bytes) return fail_line(p, "live bytes overflow 64 bits");
  if (size > TRACE_MAX_TOTAL - t->total_alloc_bytes)
    return fail_line(p, "the total of allocated bytes passes the readers' limit of 2^62");
  size_t slot = t->num_allocs;
  if (slot >= p->slots_cap && grow_slots(p) != 0) return no_memory(p);
  if (map_put(&p->ids, id, (uint32_t)slot) < 0) return no_memory(p);
  if ((st = add_stream(p, (uintptr_t)stream)) != GPUMEM_OK) return st;
  if ((st = set_role(p, slot, role, role_len)) != GPUMEM_OK) return st;

  trace_event_t ev = {.op = TRACE_ALLOC, .id = (uint32_t)slot, .size = size};
  ev.stream = (uintptr_t)stream;
  if ((st = push_event(p, &ev)) != GPUMEM_OK) return st;
  t->slot_trace_id[slot] = id;
  t->slot_event[slot] = t->num_events - 1;
  p->slot_live[slot] = 1;
  t->num_allocs++;
  p->live_bytes += size;
  p->live_allocs++;
  t->total_alloc_bytes += size;
  if (size > t->max_alloc_size) t->max_alloc_size = size;
  if (p->live_bytes > t->peak_live_bytes) {
    t->peak_live_bytes = p->live_bytes;
    t->peak_event = t->num_events - 1;
    t->peak_live_allocs = p->live_allocs;
  }
  return GPUMEM_OK;
}

static gpumem_status_t add_free(parser_t* p, uint64_t id) {
  trace_t* t = p->t;
  uint32_t slot = 0;
  gpumem_status_t st = live_slot(p, id, "free", &slot);
  if (st != GPUMEM_OK) return st;
  const trace_event_t* a = &t->events[t->slot_event[slot]];
  trace_event_t ev = {.op = TRACE_FREE, .id = slot, .size = a->size, .stream = a->stream};
  if ((st = push_event(p, &ev)) != GPUMEM_OK) return st;
  p->slot_live[slot] = 0;
  t->num_frees++;
  p->live_bytes -= ev.size;
  p->live_allocs--;
  return GPUMEM_OK;
}

static gpumem_status_t add_record_stream(parser_t* p, uint64_t id, uint64_t stream) {
  trace_t* t = p->t;
  uint32_t slot = 0;
  gpumem_status_t st;
#if UINTPTR_MAX < UINT64_MAX
  if (stream > UINTPTR_MAX) return fail_line(p, "STREAM does not fit in a pointer");
#endif
  if ((st = live_slot(p, id, "record_stream", &slot)) != GPUMEM_OK) return st;
  if ((st = add_stream(p, (uintptr_t)stream)) != GPUMEM_OK) return st;
  trace_event_t ev = {.op = TRACE_RECORD_STREAM, .id = slot};
  ev.size = t->events[t->slot_event[slot]].size;
  ev.stream = (uintptr_t)stream;
  if ((st = push_event(p, &ev)) != GPUMEM_OK) return st;
  t->num_record_streams++;
  return GPUMEM_OK;
}

static gpumem_status_t add_step(parser_t* p) {
  trace_t* t = p->t;
  if (grow((void**)&t->step_end, &p->steps_cap, t->num_steps + 1, sizeof *t->step_end) != 0)
    return no_memory(p);
  t->step_end[t->num_steps++] = t->num_events;
  return GPUMEM_OK;
}

/* "dir/gpt2_train.trace.gz" -> "gpt2_train", with every byte a terminal
 * could act on made visible (show.h): the name is only ever shown. */
static char* trace_name(const char* path) {
  const char* base = strrchr(path, '/');
  base = base ? base + 1 : path;
  size_t len = strlen(base);
  static const char* const suffixes[] = {".gz", ".trace", ".txt", ".pickle", ".pkl"};
  for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
    size_t sl = strlen(suffixes[i]);
    if (len > sl && memcmp(base + len - sl, suffixes[i], sl) == 0) len -= sl;
  }
  char* raw = strndup(base, len);
  char* name = raw ? show_dup(raw) : NULL;
  free(raw);
  return name;
}

gpumem_status_t trace_builder_new(const char* path, size_t expected_events, trace_builder_t** out) {
  *out = NULL;
  parser_t* p = calloc(1, sizeof *p);
  trace_t* t = calloc(1, sizeof *t);
  if (p) p->t = t;
  /* start the ID map near its final size (about two events an
   * allocation) to skip most regrowth */
  if (!p || !t || map_init(&p->ids, expected_events / 2 + 16) != 0 ||
      map_init(&p->streams, 16) != 0 || !(t->path = strdup(path)) ||
      !(t->name = trace_name(path))) {
    if (p)
      trace_builder_discard(p);
    else
      free(t);
    gpumem_set_last_error("%s: out of host memory", path);
    return GPUMEM_ERR_HOST_MEMORY;
  }
  p->path = t->path;
  *out = p;
  return GPUMEM_OK;
}

void trace_builder_discard(trace_builder_t* b) {
  if (!b) return;
  map_destroy(&b->ids);
  map_destroy(&b->streams);
  map_destroy(&b->roles);
  free(b->slot_live);
  trace_free(b->t);
  free(b);
}

void trace_builder_set_line(trace_builder_t* b, size_t line) {
  b->line = line ? line - 1 : 0;
}

gpumem_status_t trace_builder_alloc(trace_builder_t* b, uint64_t id, uint64_t size,
                                    uint64_t stream) {
  b->line++;
  return add_alloc(b, id, size, stream, NULL, 0);
}

gpumem_status_t trace_builder_alloc_role(trace_builder_t* b, uint64_t id, uint64_t size,
                                         uint64_t stream, const char* role) {
  b->line++;
  return add_alloc(b, id, size, stream, role, role ? strlen(role) : 0);
}

gpumem_status_t trace_builder_free(trace_builder_t* b, uint64_t id) {
  b->line++;
  return add_free(b, id);
}

gpumem_status_t trace_builder_record_stream(trace_builder_t* b, uint64_t id, uint64_t stream) {
  b->line++;
  return add_record_stream(b, id, stream);
}

gpumem_status_t trace_builder_step(trace_builder_t* b) {
  b->line++;
  return add_step(b);
}

gpumem_status_t trace_builder_finish(trace_builder_t* b, trace_t** out) {
  *out = NULL;
  trace_t* t = b->t;
  if (t->num_events == 0) {
    gpumem_set_last_error("%s: no events (expected lines 'a ID SIZE STREAM' and 'f ID')", b->path);
    trace_builder_discard(b);
    return GPUMEM_ERR_IO;
  }
  t->num_streams = b->streams.count;
  t->end_live_bytes = b->live_bytes;
  t->end_live_allocs = b->live_allocs;
  b->t = NULL;
  trace_builder_discard(b);
  *out = t;
  return GPUMEM_OK;
}

/* ---- the text format -------------------------------------------------- */

static gpumem_status_t parse_event(parser_t* p, const token_t* tok, size_t n) {
  uint64_t id = 0, size = 0, stream = 0;
  gpumem_status_t st;
  char c = tok[0].len == 1 ? tok[0].s[0] : '\0';
  if (c == 'a') {
    if (n > 5) {
      char buf[64];
      return fail_line(p, "extra field '%s' (expected 'a ID SIZE STREAM [ROLE]')",
                       show(tok[5], buf, sizeof buf));
    }
    if (n < 4) return fail_line(p, "missing field (expected 'a ID SIZE STREAM [ROLE]')");
    if ((st = field_u64(p, tok[1], "ID", 0, &id)) != GPUMEM_OK) return st;
    if ((st = field_u64(p, tok[2], "SIZE", 0, &size)) != GPUMEM_OK) return st;
    if ((st = field_u64(p, tok[3], "STREAM", 1, &stream)) != GPUMEM_OK) return st;
    return add_alloc(p, id, size, stream, n == 5 ? tok[4].s : NULL, n == 5 ? tok[4].len : 0);
  }
  if (c == 'f') {
    if ((st = field_count(p, n, 1, tok, "f ID")) != GPUMEM_OK) return st;
    if ((st = field_u64(p, tok[1], "ID", 0, &id)) != GPUMEM_OK) return st;
    return add_free(p, id);
  }
  if (c == 'r') {
    if ((st = field_count(p, n, 2, tok, "r ID STREAM")) != GPUMEM_OK) return st;
    if ((st = field_u64(p, tok[1], "ID", 0, &id)) != GPUMEM_OK) return st;
    if ((st = field_u64(p, tok[2], "STREAM", 1, &stream)) != GPUMEM_OK) return st;
    return add_record_stream(p, id, stream);
  }
  char buf[64];
  return fail_line(p,
                   "unknown operation '%s' (expected 'a ID SIZE STREAM [ROLE]', 'f ID' or 'r ID "
                   "STREAM')",
                   show(tok[0], buf, sizeof buf));
}

/* Whether a line is the recorder's step marker, "# step N" (src/record.c),
 * with any blanks around its words. Other comments are just comments. */
static int is_step_marker(const char* s, size_t len) {
  size_t i = 0;
  while (i < len && (s[i] == ' ' || s[i] == '\t')) i++;
  if (i >= len || s[i++] != '#') return 0;
  while (i < len && (s[i] == ' ' || s[i] == '\t')) i++;
  if (len - i < 4 || memcmp(s + i, "step", 4) != 0) return 0;
  i += 4;
  size_t blanks = i;
  while (i < len && (s[i] == ' ' || s[i] == '\t')) i++;
  size_t digits = i;
  while (i < len && s[i] >= '0' && s[i] <= '9') i++;
  if (blanks == digits || digits == i) return 0;
  while (i < len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r')) i++;
  return i == len;
}

gpumem_status_t trace_parse(const char* path, const char* text, size_t len, trace_t** out) {
  *out = NULL;
  parser_t* p = NULL;
  /* about 13 bytes a line in real traces */
  gpumem_status_t st = trace_builder_new(path, len / 16, &p);
  if (st != GPUMEM_OK) return st;
  size_t pos = 0;
  while (pos < len) {
    const char* line = text + pos;
    const char* nl = memchr(line, '\n', len - pos);
    size_t line_len = nl ? (size_t)(nl - line) : len - pos;
    pos += line_len + (nl ? 1 : 0);
    p->line++;

    token_t tok[6];
    size_t n = split_line(line, line_len, tok, 5);
    if (n == 0 && is_step_marker(line, line_len)) st = add_step(p);
    if (st == GPUMEM_OK && n > 0) st = parse_event(p, tok, n);
    if (st != GPUMEM_OK) {
      trace_builder_discard(p);
      return st;
    }
  }
  return trace_builder_finish(p, out);
}

void trace_free(trace_t* t) {
  if (!t) return;
  free(t->path);
  free(t->name);
  free(t->events);
  free(t->slot_trace_id);
  free(t->slot_event);
  free(t->slot_role);
  for (size_t i = 0; i < t->num_roles; i++) free(t->roles[i]);
  free(t->roles);
  free(t->step_end);
  free(t);
}

const char* trace_op_name(int op) {
  switch (op) {
    case TRACE_ALLOC:
      return "alloc";
    case TRACE_FREE:
      return "free";
    case TRACE_RECORD_STREAM:
      return "record_stream";
    default:
      return "?";
  }
}

/* ---- a longer run of the same loop ------------------------------------- */

static gpumem_status_t repeat_no_memory(const trace_t* t) {
  gpumem_set_last_error("%s: out of host memory writing a copy of the trace", t->path);
  return GPUMEM_ERR_HOST_MEMORY;
}

/* Appends one event as a trace line to buf (grown as needed). */
static int emit(char** buf, size_t* len, size_t* cap, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int emit(char** buf, size_t* len, size_t* cap, const char* fmt, ...) {
  if (*cap - *len < 96 && grow((void**)buf, cap, *len + 96, 1) != 0) return 0;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(*buf + *len, *cap - *len, fmt, ap);
  va_end(ap);
  if (n < 0 || (size_t)n >= *cap - *len) return 0;
  *len += (size_t)n;
  return 1;
}

/* Appends event e as a trace line naming allocation id. */
static int emit_event(char** buf, size_t* len, size_t* cap, const trace_event_t* e, uint64_t id) {
  unsigned long long i = id, size = e->size, stream = e->stream;
  if (e->op == TRACE_ALLOC) return emit(buf, len, cap, "a %llu %llu 0x%llx\n", i, size, stream);
  if (e->op == TRACE_FREE) return emit(buf, len, cap, "f %llu\n", i);
  return emit(buf, len, cap, "r %llu 0x%llx\n", i, stream);
}

/* Adds event e to b, naming allocation id. */
static gpumem_status_t build_event(trace_builder_t* b, const trace_event_t* e, uint64_t id) {
  if (e->op == TRACE_ALLOC) return trace_builder_alloc(b, id, e->size, e->stream);
  if (e->op == TRACE_FREE) return trace_builder_free(b, id);
  return trace_builder_record_stream(b, id, e->stream);
}

/* Whether allocations a and b request the same size on the same stream. */
static int same_request(const trace_t* t, size_t a, size_t b) {
  const trace_event_t* x = &t->events[t->slot_event[a]];
  const trace_event_t* y = &t->events[t->slot_event[b]];
  return x->size == y->size && x->stream == y->stream;
}

/* The period search, linear in the trace. A period P qualifies when the
 * last P allocations request what the P before them did, and every free or
 * record_stream from allocation n - P on that names an allocation before it
 * names one of the P before, still live at the end of the trace, that the
 * next repetition can name again. Trying each P with a scan of its tail
 * costs O(n) a try, O(n^2) in all: n same-size allocations and one free of
 * the first took 10 s at 200k. So:
 * - the sizes: with r the allocations from the last backwards, P matches
 *   when r[0, P) equals r[P, 2P), i.e. z[P] >= P for r's Z-function (one
 *   O(n) pass for every P);
 * - the frees: the smallest ID named from allocation n - P on must be at
 *   least n - 2P (a suffix minimum over the non-alloc events);
 * - what remains is checked event by event, the non-alloc ones only, within
 *   a budget proportional to the trace; past it the search gives up by
 *   name rather than run for minutes. */
typedef struct period_search {
  const trace_t* t;
  size_t n;
  size_t* z;     /* Z-function of the allocations, last first */
  size_t* other; /* indices of the non-alloc events, in order */
  size_t num_other;
  uint32_t* min_id; /* min_id[k]: smallest ID named by other[k..] */
  size_t* freed_in; /* per slot: the try (P) that saw it freed, 0 for none */
  const unsigned char* live_at_end;
  uint64_t work, budget;
} period_search_t;

static void z_function(const trace_t* t, size_t n, size_t* z) {
  /* r[i] is allocation n - 1 - i */
  z[0] = n;
  size_t l = 0, r = 0; /* [l, r): the rightmost match found */
  for (size_t i = 1; i < n; i++) {
    size_t k = 0;
    if (i < r) k = z[i - l] < r - i ? z[i - l] : r - i;
    while (i + k < n && same_request(t, n - 1 - k, n - 1 - (i + k))) k++;
    z[i] = k;
    if (i + k > r) {
      l = i;
      r = i + k;
    }
  }
}

/* 1: period P qualifies; 0: not; -1: the work budget ran out. */
static int tail_repeats(period_search_t* s, size_t period, size_t* first_other) {
  const trace_t* t = s->t;
  size_t n = s->n;
  if (s->z[period] < period) return 0;
  /* non-alloc events from allocation n - period on: other[*first_other..] */
  size_t from = t->slot_event[n - period];
  while (*first_other > 0 && s->other[*first_other - 1] > from) (*first_other)--;
  size_t k0 = *first_other;
  if (k0 >= s->num_other) return 1;
  if (s->min_id[k0] < n - 2 * period) return 0; /* reaches further back than one period */
  for (size_t k = k0; k < s->num_other; k++) {
    if (++s->work > s->budget) return -1;
    const trace_event_t* e = &t->events[s->other[k]];
    if (e->id >= n - period) continue;
    /* in the next repetition this names allocation id + period of the
     * tail, which must still be live at the end of the trace, and a free
     * names each allocation once */
    if (!s->live_at_end[e->id + period]) return 0;
    if (e->op == TRACE_FREE) {
      if (s->freed_in[e->id] == period) return 0;
      s->freed_in[e->id] = period;
    }
  }
  return 1;
}

gpumem_status_t trace_repeat_tail(const trace_t* t, int reps, trace_t** out, size_t* period_out) {
  *out = NULL;
  size_t n = t->num_allocs;
  if (reps < 1 || n < 2) {
    gpumem_set_last_error("%s: nothing to repeat (%zu allocations)", t->path, n);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  period_search_t s = {0};
  s.t = t;
  s.n = n;
  s.num_other = t->num_events - n;
  s.budget = 8 * (uint64_t)t->num_events + 65536;
  /* Which allocations of the trace are never freed (by slot). */
  unsigned char* live = malloc(n);
  s.z = malloc(n * sizeof *s.z);
  s.freed_in = calloc(n, sizeof *s.freed_in);
  s.other = malloc((s.num_other ? s.num_other : 1) * sizeof *s.other);
  s.min_id = malloc((s.num_other ? s.num_other : 1) * sizeof *s.min_id);
  if (!live || !s.z || !s.freed_in || !s.other || !s.min_id) {
    free(live);
    free(s.z);
    free(s.freed_in);
    free(s.other);
    free(s.min_id);
    return repeat_no_memory(t);
  }
  s.live_at_end = live;
  memset(live, 1, n);
  size_t k = 0;
  for (size_t i = 0; i < t->num_events; i++) {
    if (t->events[i].op == TRACE_FREE) live[t->events[i].id] = 0;
    if (t->events[i].op != TRACE_ALLOC) s.other[k++] = i;
  }
  s.num_other = k;
  for (size_t i = k; i-- > 0;) {
    uint32_t id = t->events[s.other[i]].id;
    s.min_id[i] = i + 1 < k && s.min_id[i + 1] < id ? s.min_id[i + 1] : id;
  }
  z_function(t, n, s.z);
  size_t period = 0, first_other = s.num_other;
  int gave_up = 0;
  for (size_t p = 1; 2 * p <= n && !period && !gave_up; p++) {
    int r = tail_repeats(&s, p, &first_other);
    if (r > 0) period = p;
    if (r < 0) gave_up = 1;
  }
  free(live);
  free(s.z);
  free(s.freed_in);
  free(s.other);
  free(s.min_id);
  if (gave_up) {
    gpumem_set_last_error(
        "%s: the search for the trace's repeating period passed its budget of %llu steps (8 a "
        "trace event): too many candidate periods whose frees have to be checked one by one",
        t->path, (unsigned long long)s.budget);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  if (!period) {
    gpumem_set_last_error(
        "%s: the trace does not end in a repeating period (a training step whose last two "
        "occurrences request the same sizes, with frees that stay within one step of it)",
        t->path);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  /* The extended trace, with slot numbers as IDs (unique), built by the
   * one builder so that every count and check is the usual one; events
   * are numbered as lines from 2, after a line saying what the trace is. */
  size_t first = t->slot_event[n - period];
  trace_builder_t* b = NULL;
  gpumem_status_t st =
      trace_builder_new(t->path, t->num_events + (size_t)reps * (t->num_events - first), &b);
  if (st != GPUMEM_OK) return st;
  trace_builder_set_line(b, 2);
  for (size_t i = 0; i < t->num_events && st == GPUMEM_OK; i++)
    st = build_event(b, &t->events[i], t->events[i].id);
  for (int r = 1; r <= reps && st == GPUMEM_OK; r++) {
    /* each event names the allocation r periods on */
    for (size_t i = first; i < t->num_events && st == GPUMEM_OK; i++)
      st = build_event(b, &t->events[i], (uint64_t)t->events[i].id + (uint64_t)r * period);
  }
  if (st != GPUMEM_OK) {
    trace_builder_discard(b);
    return st;
  }
  trace_t* ext = NULL;
  if ((st = trace_builder_finish(b, &ext)) != GPUMEM_OK) return st;
  ext->steady_from_event = t->num_events;
  ext->steady_period = period;
  ext->steady_reps = reps;
  *out = ext;
  if (period_out) *period_out = period;
  return GPUMEM_OK;
}

/* Events [0, num_events) as lines, each naming its allocation by id, with
 * a step marker before event step_end[k] for each k (and those at the end);
 * slot_size, when given, replaces each allocation's size. 0 when out of
 * host memory. */
static int emit_events(char** buf, size_t* len, size_t* cap, const trace_event_t* events,
                       size_t num_events, const size_t* step_end, size_t num_steps,
                       const uint64_t* slot_size) {
  int ok = 1;
  size_t step = 0;
  for (size_t i = 0; i < num_events && ok; i++) {
    for (; step < num_steps && step_end[step] == i && ok; step++)
      ok = emit(buf, len, cap, "# step %zu\n", step + 1);
    trace_event_t e = events[i];
    if (slot_size) e.size = slot_size[e.id];
    if (ok) ok = emit_event(buf, len, cap, &e, e.id);
  }
  for (; step < num_steps && step_end[step] == num_events && ok; step++)
    ok = emit(buf, len, cap, "# step %zu\n", step + 1);
  return ok;
}

gpumem_status_t trace_text(const trace_t* t, const char* comment, char** text, size_t* text_len) {
  *text = NULL;
  *text_len = 0;
  size_t cap = 0, len = 0;
  char* buf = NULL;
  int ok = emit(&buf, &len, &cap, "# gpumem-trace v1\n");
  /* one comment line, whatever the text holds */
  for (const char* c = comment; ok && c && *c;) {
    size_t n = strcspn(c, "\r\n");
    ok = emit(&buf, &len, &cap, "# %.*s\n", (int)(n > 200 ? 200 : n), c);
    c += n;
    c += strspn(c, "\r\n");
  }
  if (ok)
    ok = emit_events(&buf, &len, &cap, t->events, t->num_events, t->step_end, t->num_steps, NULL);
  if (!ok) {
    free(buf);
    gpumem_set_last_error("%s: out of host memory writing the trace as text", t->path);
    return GPUMEM_ERR_HOST_MEMORY;
  }
  *text = buf;
  *text_len = len;
  return GPUMEM_OK;
}

/* Events [0, num_events) into b, each naming its allocation by id, with a
 * step marker before event step_end[k] for each k (and those at the end);
 * slot_size, when given, replaces each allocation's size. line, when
 * given, numbers each event as the line it came from (else they count on). */
static gpumem_status_t build_events(trace_builder_t* b, const trace_event_t* events,
                                    size_t num_events, const size_t* step_end, size_t num_steps,
                                    const uint64_t* slot_size, int keep_lines) {
  gpumem_status_t st = GPUMEM_OK;
  size_t step = 0;
  for (size_t i = 0; i < num_events && st == GPUMEM_OK; i++) {
    for (; step < num_steps && step_end[step] == i && st == GPUMEM_OK; step++)
      st = trace_builder_step(b);
    trace_event_t e = events[i];
    if (slot_size) e.size = slot_size[e.id];
    if (keep_lines) trace_builder_set_line(b, e.line);
    if (st == GPUMEM_OK) st = build_event(b, &e, e.id);
  }
  for (; step < num_steps && step_end[step] == num_events && st == GPUMEM_OK; step++)
    st = trace_builder_step(b);
  return st;
}

gpumem_status_t trace_resized(const trace_t* t, size_t num_events, const uint64_t* slot_size,
                              const char* path, trace_t** out) {
  *out = NULL;
  if (num_events > t->num_events) num_events = t->num_events;
  trace_builder_t* b = NULL;
  gpumem_status_t st = trace_builder_new(path, num_events, &b);
  if (st != GPUMEM_OK) return st;
  trace_builder_set_line(b, 2); /* as in a file, after a line saying what it is */
  st = build_events(b, t->events, num_events, t->step_end, t->num_steps, slot_size, 0);
  if (st != GPUMEM_OK) {
    trace_builder_discard(b);
    return st;
  }
  return trace_builder_finish(b, out);
}

gpumem_status_t trace_from_events(const char* path, const trace_event_t* events, size_t num_events,
                                  const size_t* step_end, size_t num_steps, trace_t** out) {
  *out = NULL;
  trace_builder_t* b = NULL;
  gpumem_status_t st = trace_builder_new(path, num_events, &b);
  if (st != GPUMEM_OK) return st;
  /* messages name the lines of the file the events came from */
  st = build_events(b, events, num_events, step_end, num_steps, NULL, 1);
  if (st != GPUMEM_OK) {
    trace_builder_discard(b);
    return st;
  }
  return trace_builder_finish(b, out);
}
