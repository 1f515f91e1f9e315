/* The pickle subset reader (pickle.h): a stack machine over the opcodes that
 * pickle.dump writes for plain containers and scalars. Containers are built
 * in place (a memoized list that is appended to later is the same value), so
 * values live in one growing array and the stack and memo hold indices. */
#include "pickle.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MARK_VALUE UINT32_MAX /* a MARK on the stack */

typedef struct reader {
  const char* path;
  const unsigned char* p;
  size_t len, pos;
  size_t op_at; /* offset of the opcode being run, for messages */
  pickle_doc_t* doc;
  uint32_t* stack;
  size_t depth, stack_cap;
  uint32_t* memo;
  size_t memo_len, memo_cap;
  /* Container items while reading: a chain per container through one
   * array (kid, next), so a container costs no allocation of its own (a
   * one-item list was a 256-byte array: 9 GB for 30 MB of nested tuples).
   * pickle_read lays them out contiguously at the end. */
  uint32_t* edges; /* pairs: kid, next (0 ends a chain; edge 0 is unused) */
  size_t num_edges, edges_cap;
} reader_t;

static gpumem_status_t fail(reader_t* r, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));

static gpumem_status_t fail(reader_t* r, const char* fmt, ...) {
  char msg[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  gpumem_set_last_error(
      "%s: not a PyTorch memory snapshot pickle gpumem can read: %s (at byte %zu)", r->path, msg,
      r->op_at);
  return GPUMEM_ERR_IO;
}

static int grow(void** arr, size_t* cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t n = *cap ? *cap * 2 : 64;
  while (n < need) n *= 2;
  void* bigger = realloc(*arr, n * elem);
  if (!bigger) return -1;
  *arr = bigger;
  *cap = n;
  return 0;
}

static gpumem_status_t no_memory(reader_t* r) {
  gpumem_set_last_error("%s: out of host memory reading the pickle", r->path);
  return GPUMEM_ERR_HOST_MEMORY;
}

/* A new value of type t; its index in *out. */
static gpumem_status_t new_value(reader_t* r, pickle_type_t t, uint32_t* out) {
  pickle_doc_t* d = r->doc;
  if (d->num_values >= MARK_VALUE - 1) return fail(r, "too many values");
  if (grow((void**)&d->values, &d->cap_values, d->num_values + 1, sizeof *d->values) != 0)
    return no_memory(r);
  pickle_value_t* v = &d->values[d->num_values];
  memset(v, 0, sizeof *v);
  v->type = (uint8_t)t;
  *out = (uint32_t)d->num_values++;
  return GPUMEM_OK;
}

static gpumem_status_t push(reader_t* r, uint32_t v) {
  if (grow((void**)&r->stack, &r->stack_cap, r->depth + 1, sizeof *r->stack) != 0)
    return no_memory(r);
  r->stack[r->depth++] = v;
  return GPUMEM_OK;
}

static gpumem_status_t push_new(reader_t* r, pickle_type_t t, uint32_t* out) {
  gpumem_status_t st = new_value(r, t, out);
  return st == GPUMEM_OK ? push(r, *out) : st;
}

static gpumem_status_t add_kid(reader_t* r, uint32_t parent, uint32_t kid) {
  if (r->num_edges == 0) r->num_edges = 1; /* edge 0 means "none" */
  if (r->num_edges >= UINT32_MAX) return fail(r, "more than 2^32 container items");
  if (grow((void**)&r->edges, &r->edges_cap, 2 * (r->num_edges + 1), sizeof *r->edges) != 0)
    return no_memory(r);
  uint32_t e = (uint32_t)r->num_edges++;
  r->edges[2 * e] = kid;
  r->edges[2 * e + 1] = 0;
  pickle_value_t* v = &r->doc->values[parent];
  if (v->len == 0) {
    v->chain.head = e;
  } else {
    r->edges[2 * v->chain.tail + 1] = e;
  }
  v->chain.tail = e;
  v->len++;
  return GPUMEM_OK;
}

/* Every container's chain becomes its run in one array of kids. */
static gpumem_status_t lay_out_kids(reader_t* r) {
  pickle_doc_t* d = r->doc;
  size_t total = r->num_edges ? r->num_edges - 1 : 0;
  d->kids = malloc((total ? total : 1) * sizeof *d->kids);
  if (!d->kids) return no_memory(r);
  size_t at = 0;
  for (size_t i = 0; i < d->num_values; i++) {
    pickle_value_t* v = &d->values[i];
    if (v->type != PICKLE_LIST && v->type != PICKLE_TUPLE && v->type != PICKLE_DICT) continue;
    uint32_t e = v->len ? v->chain.head : 0;
    v->kids = d->kids + at;
    for (size_t k = 0; k < v->len; k++, e = r->edges[2 * e + 1]) d->kids[at++] = r->edges[2 * e];
  }
  return GPUMEM_OK;
}

/* n bytes of argument; NULL when the file ends first. */
static const unsigned char* take(reader_t* r, size_t n) {
  if (r->len - r->pos < n) return NULL;
  const unsigned char* at = r->p + r->pos;
  r->pos += n;
  return at;
}

static uint64_t le(const unsigned char* b, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) v |= (uint64_t)b[i] << (8 * i);
  return v;
}

/* The index of the topmost MARK. */
static gpumem_status_t find_mark(reader_t* r, size_t* at) {
  for (size_t i = r->depth; i-- > 0;) {
    if (r->stack[i] == MARK_VALUE) {
      *at = i;
      return GPUMEM_OK;
    }
  }
  return fail(r, "no MARK on the stack");
}

static gpumem_status_t pop_value(reader_t* r, uint32_t* out) {
  if (r->depth == 0 || r->stack[r->depth - 1] == MARK_VALUE) return fail(r, "stack underflow");
  *out = r->stack[--r->depth];
  return GPUMEM_OK;
}

/* The container under the top n values (which must be values, not marks). */
static gpumem_status_t container_below(reader_t* r, size_t below, pickle_type_t want,
                                       uint32_t* out) {
  if (below == 0 || r->stack[below - 1] == MARK_VALUE) return fail(r, "stack underflow");
  uint32_t c = r->stack[below - 1];
  if (r->doc->values[c].type != want)
    return fail(r, "%s onto something that is not a %s", want == PICKLE_DICT ? "SETITEM" : "APPEND",
                want == PICKLE_DICT ? "dict" : "list");
  *out = c;
  return GPUMEM_OK;
}

static gpumem_status_t make_str(reader_t* r, pickle_type_t t, size_t n) {
  const unsigned char* s = take(r, n);
  if (!s) return fail(r, "truncated (a string runs past the end of the file)");
  uint32_t v = 0;
  gpumem_status_t st = push_new(r, t, &v);
  if (st != GPUMEM_OK) return st;
  r->doc->values[v].s = (const char*)s;
  r->doc->values[v].len = n;
  return GPUMEM_OK;
}

static gpumem_status_t make_int(reader_t* r, int64_t i) {
  uint32_t v = 0;
  gpumem_status_t st = push_new(r, PICKLE_INT, &v);
  if (st == GPUMEM_OK) r->doc->values[v].i = i;
  return st;
}

/* LONG1/LONG4: little-endian two's complement of n bytes. */
static gpumem_status_t make_long(reader_t* r, size_t n) {
  const unsigned char* b = take(r, n);
  if (!b) return fail(r, "truncated integer");
  if (n == 0) return make_int(r, 0);
  /* Bytes beyond the eighth must be sign extension. */
  unsigned char sign = (b[n - 1] & 0x80) ? 0xff : 0;
  for (size_t k = 8; k < n; k++)
    if (b[k] != sign) return fail(r, "integer larger than 64 bits");
  size_t m = n < 8 ? n : 8;
  uint64_t u = le(b, m);
  if (m < 8 && sign) u |= ~0ULL << (8 * m);
  if (n > 8 && ((u >> 63) ? 0xff : 0) != sign) return fail(r, "integer larger than 64 bits");
  return make_int(r, (int64_t)u);
}

static gpumem_status_t memo_put(reader_t* r, size_t key) {
  if (r->depth == 0 || r->stack[r->depth - 1] == MARK_VALUE) return fail(r, "memo of nothing");
  /* Checked before the memo grows to the key: a 9-byte file asking for key
   * 2^30 made a 4 GB memo. pickle.dump numbers keys from 0, one per PUT
   * opcode, so a key never reaches the file's length. */
  if (key >= r->len || key >= MARK_VALUE)
    return fail(r, "memo key %zu is beyond what a file of %zu bytes can hold (the readers' limit)",
                key, r->len);
  if (grow((void**)&r->memo, &r->memo_cap, key + 1, sizeof *r->memo) != 0) return no_memory(r);
  while (r->memo_len <= key) r->memo[r->memo_len++] = MARK_VALUE;
  r->memo[key] = r->stack[r->depth - 1];
  return GPUMEM_OK;
}

static gpumem_status_t memo_get(reader_t* r, size_t key) {
  if (key >= r->memo_len || r->memo[key] == MARK_VALUE)
    return fail(r, "memo key %zu was never stored", key);
  return push(r, r->memo[key]);
}

/* Pops everything above the topmost MARK into a new tuple. */
static gpumem_status_t tuple_from_mark(reader_t* r) {
  size_t m = 0;
  gpumem_status_t st = find_mark(r, &m);
  if (st != GPUMEM_OK) return st;
  uint32_t t = 0;
  if ((st = new_value(r, PICKLE_TUPLE, &t)) != GPUMEM_OK) return st;
  for (size_t i = m + 1; i < r->depth; i++)
    if ((st = add_kid(r, t, r->stack[i])) != GPUMEM_OK) return st;
  r->depth = m;
  return push(r, t);
}

static gpumem_status_t tuple_of(reader_t* r, size_t n) {
  if (r->depth < n) return fail(r, "stack underflow");
  for (size_t i = r->depth - n; i < r->depth; i++)
    if (r->stack[i] == MARK_VALUE) return fail(r, "stack underflow");
  uint32_t t = 0;
  gpumem_status_t st = new_value(r, PICKLE_TUPLE, &t);
  for (size_t i = r->depth - n; i < r->depth && st == GPUMEM_OK; i++)
    st = add_kid(r, t, r->stack[i]);
  if (st != GPUMEM_OK) return st;
  r->depth -= n;
  return push(r, t);
}

/* APPENDS / SETITEMS: the values above the mark go into the container
 * below it (pairs for a dict). */
static gpumem_status_t fill_from_mark(reader_t* r, pickle_type_t want) {
  size_t m = 0;
  gpumem_status_t st = find_mark(r, &m);
  if (st != GPUMEM_OK) return st;
  uint32_t c = 0;
  if ((st = container_below(r, m, want, &c)) != GPUMEM_OK) return st;
  if (want == PICKLE_DICT && (r->depth - m - 1) % 2)
    return fail(r, "SETITEMS with an odd number of values");
  for (size_t i = m + 1; i < r->depth; i++)
    if ((st = add_kid(r, c, r->stack[i])) != GPUMEM_OK) return st;
  r->depth = m;
  return GPUMEM_OK;
}

static const char* opcode_name(unsigned char op) {
  switch (op) {
    case 'c':
      return "GLOBAL (a class or function reference)";
    case 0x93:
      return "STACK_GLOBAL (a class or function reference)";
    case 'R':
      return "REDUCE (an object constructor call)";
    case 0x81:
      return "NEWOBJ (an object)";
    case 0x92:
      return "NEWOBJ_EX (an object)";
    case 'b':
      return "BUILD (an object's state)";
    case 'P':
    case 'Q':
      return "PERSID (a persistent reference)";
    case 'o':
      return "OBJ (an object)";
    case 'i':
      return "INST (an object)";
    default:
      return NULL;
  }
}

gpumem_status_t pickle_read(const char* path, const unsigned char* data, size_t len,
                            pickle_doc_t* doc) {
  reader_t r;
  memset(&r, 0, sizeof r);
  memset(doc, 0, sizeof *doc);
  r.path = path;
  r.p = data;
  r.len = len;
  r.doc = doc;
  gpumem_status_t st = GPUMEM_OK;
  if (!pickle_looks_like(data, len)) {
    gpumem_set_last_error(
        "%s: not a pickle (a PyTorch snapshot pickle starts with byte 0x80 and a protocol "
        "number 2 to 5)",
        path);
    return GPUMEM_ERR_IO;
  }
  int stopped = 0;
  while (!stopped && st == GPUMEM_OK) {
    r.op_at = r.pos;
    const unsigned char* opb = take(&r, 1);
    if (!opb) {
      st = fail(&r, "truncated (the file ends before the pickle's STOP)");
      break;
    }
    unsigned char op = *opb;
    const unsigned char* a;
    uint32_t v = 0;
    switch (op) {
      case 0x80: /* PROTO */
        if (!take(&r, 1)) st = fail(&r, "truncated");
        break;
      case 0x95: /* FRAME: a length hint only */
        if (!take(&r, 8)) st = fail(&r, "truncated");
        break;
      case '.': /* STOP */
        stopped = 1;
        break;
      case '}':
        st = push_new(&r, PICKLE_DICT, &v);
        break;
      case ']':
        st = push_new(&r, PICKLE_LIST, &v);
        break;
      case ')':
        st = push_new(&r, PICKLE_TUPLE, &v);
        break;
      case '(':
        st = push(&r, MARK_VALUE);
        break;
      case 'l': { /* LIST from mark */
        st = tuple_from_mark(&r);
        if (st == GPUMEM_OK) r.doc->values[r.stack[r.depth - 1]].type = PICKLE_LIST;
        break;
      }
      case 'd': { /* DICT from mark */
        size_t m = 0;
        if ((st = find_mark(&r, &m)) != GPUMEM_OK) break;
        if ((r.depth - m - 1) % 2) {
          st = fail(&r, "DICT with an odd number of values");
          break;
        }
        st = tuple_from_mark(&r);
        if (st == GPUMEM_OK) r.doc->values[r.stack[r.depth - 1]].type = PICKLE_DICT;
        break;
      }
      case 't':
        st = tuple_from_mark(&r);
        break;
      case 0x85:
      case 0x86:
      case 0x87:
        st = tuple_of(&r, (size_t)(op - 0x84));
        break;
      case 'a': { /* APPEND */
        uint32_t item = 0, list = 0;
        if ((st = pop_value(&r, &item)) != GPUMEM_OK) break;
        if ((st = container_below(&r, r.depth, PICKLE_LIST, &list)) != GPUMEM_OK) break;
        st = add_kid(&r, list, item);
        break;
      }
      case 'e':
        st = fill_from_mark(&r, PICKLE_LIST);
        break;
      case 's': { /* SETITEM */
        uint32_t key = 0, val = 0, dict = 0;
        if ((st = pop_value(&r, &val)) != GPUMEM_OK || (st = pop_value(&r, &key)) != GPUMEM_OK)
          break;
        if ((st = container_below(&r, r.depth, PICKLE_DICT, &dict)) != GPUMEM_OK) break;
        if ((st = add_kid(&r, dict, key)) == GPUMEM_OK) st = add_kid(&r, dict, val);
        break;
      }
      case 'u':
        st = fill_from_mark(&r, PICKLE_DICT);
        break;
      case 'N':
        st = push_new(&r, PICKLE_NONE, &v);
        break;
      case 0x88:
      case 0x89:
        if ((st = push_new(&r, PICKLE_BOOL, &v)) == GPUMEM_OK) r.doc->values[v].i = op == 0x88;
        break;
      case 'K':
        st = (a = take(&r, 1)) ? make_int(&r, a[0]) : fail(&r, "truncated");
        break;
      case 'M':
        st = (a = take(&r, 2)) ? make_int(&r, (int64_t)le(a, 2)) : fail(&r, "truncated");
        break;
      case 'J':
        st = (a = take(&r, 4)) ? make_int(&r, (int32_t)(uint32_t)le(a, 4)) : fail(&r, "truncated");
        break;
      case 0x8a:
        st = (a = take(&r, 1)) ? make_long(&r, a[0]) : fail(&r, "truncated");
        break;
      case 0x8b:
        st = (a = take(&r, 4)) ? make_long(&r, (size_t)le(a, 4)) : fail(&r, "truncated");
        break;
      case 'G': { /* BINFLOAT: big-endian double */
        if (!(a = take(&r, 8))) {
          st = fail(&r, "truncated");
          break;
        }
        uint64_t u = 0;
        for (int k = 0; k < 8; k++) u = (u << 8) | a[k];
        double f;
        memcpy(&f, &u, sizeof f);
        if ((st = push_new(&r, PICKLE_FLOAT, &v)) == GPUMEM_OK) r.doc->values[v].f = f;
        break;
      }
      case 0x8c: /* SHORT_BINUNICODE */
        st = (a = take(&r, 1)) ? make_str(&r, PICKLE_STR, a[0]) : fail(&r, "truncated");
        break;
      case 'X':
        st = (a = take(&r, 4)) ? make_str(&r, PICKLE_STR, (size_t)le(a, 4)) : fail(&r, "truncated");
        break;
      case 0x8d:
        st = (a = take(&r, 8)) ? make_str(&r, PICKLE_STR, (size_t)le(a, 8)) : fail(&r, "truncated");
        break;
      case 'C':
        st = (a = take(&r, 1)) ? make_str(&r, PICKLE_BYTES, a[0]) : fail(&r, "truncated");
        break;
      case 'B':
        st = (a = take(&r, 4)) ? make_str(&r, PICKLE_BYTES, (size_t)le(a, 4))
                               : fail(&r, "truncated");
        break;
      case 0x8e:
        st = (a = take(&r, 8)) ? make_str(&r, PICKLE_BYTES, (size_t)le(a, 8))
                               : fail(&r, "truncated");
        break;
      case 0x94: /* MEMOIZE */
        st = memo_put(&r, r.memo_len);
        break;
      case 'q':
        st = (a = take(&r, 1)) ? memo_put(&r, a[0]) : fail(&r, "truncated");
        break;
      case 'r':
        st = (a = take(&r, 4)) ? memo_put(&r, (size_t)le(a, 4)) : fail(&r, "truncated");
        break;
      case 'h':
        st = (a = take(&r, 1)) ? memo_get(&r, a[0]) : fail(&r, "truncated");
        break;
      case 'j':
        st = (a = take(&r, 4)) ? memo_get(&r, (size_t)le(a, 4)) : fail(&r, "truncated");
        break;
      case '0': { /* POP */
        if (r.depth == 0) {
          st = fail(&r, "stack underflow");
          break;
        }
        r.depth--;
        break;
      }
      case '2': /* DUP */
        st = r.depth ? push(&r, r.stack[r.depth - 1]) : fail(&r, "stack underflow");
        break;
      default: {
        const char* name = opcode_name(op);
        if (name) {
          st = fail(&r,
                    "unsupported opcode %s, 0x%02x: a snapshot holds only plain containers, "
                    "strings and numbers",
                    name, op);
        } else {
          st = fail(&r, "unsupported opcode 0x%02x", op);
        }
        break;
      }
    }
  }
  if (st == GPUMEM_OK) {
    if (r.depth != 1 || r.stack[0] == MARK_VALUE) {
      st = fail(&r, "the pickle stops with %zu values on its stack, not one", r.depth);
    } else {
      doc->root = r.stack[0];
    }
  }
  free(r.stack);
  free(r.memo);
  r.stack = NULL;
  r.memo = NULL;
  if (st == GPUMEM_OK) st = lay_out_kids(&r);
  free(r.edges);
  if (st != GPUMEM_OK) pickle_free(doc);
  return st;
}

void pickle_free(pickle_doc_t* doc) {
  free(doc->kids);
  free(doc->values);
  memset(doc, 0, sizeof *doc);
}

int pickle_looks_like(const unsigned char* data, size_t len) {
  return len >= 3 && data[0] == 0x80 && data[1] >= 2 && data[1] <= 5;
}

int pickle_is_str(const pickle_value_t* v, const char* s) {
  size_t n = strlen(s);
  return v->type == PICKLE_STR && v->len == n && memcmp(v->s, s, n) == 0;
}

const pickle_value_t* pickle_get(const pickle_doc_t* doc, const pickle_value_t* d,
                                 const char* key) {
  if (!d || d->type != PICKLE_DICT) return NULL;
  for (size_t k = 0; k + 1 < d->len; k += 2) {
    if (pickle_is_str(&doc->values[d->kids[k]], key)) return &doc->values[d->kids[k + 1]];
  }
  return NULL;
}
