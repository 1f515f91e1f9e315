/* JSON to pickle (jsonpickle.h): a recursive-descent reader that writes
 * pickle opcodes as it goes, so no tree is built. */
#include "jsonpickle.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_DEPTH = 64, OUT_CHUNK = 1 << 16 };

typedef struct jp {
  const char* s;
  size_t n, i;
  gpumem_write_fn write;
  void* arg;
  unsigned char out[OUT_CHUNK]; /* opcodes are buffered: the sink sees few, large writes */
  size_t used;
  int failed; /* the sink refused a write */
} jp_t;

static void flush(jp_t* p) {
  if (p->used && !p->failed && p->write((const char*)p->out, p->used, p->arg) != 0) p->failed = 1;
  p->used = 0;
}

static void emit(jp_t* p, const void* bytes, size_t len) {
  const unsigned char* b = bytes;
  while (len) {
    if (p->used == OUT_CHUNK) flush(p);
    size_t k = OUT_CHUNK - p->used < len ? OUT_CHUNK - p->used : len;
    memcpy(p->out + p->used, b, k);
    p->used += k;
    b += k;
    len -= k;
  }
}

static void op(jp_t* p, unsigned char c) {
  emit(p, &c, 1);
}

static void le32(jp_t* p, uint32_t v) {
  unsigned char b[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                        (unsigned char)(v >> 24)};
  emit(p, b, 4);
}

static gpumem_status_t bad(jp_t* p, const char* what) {
  gpumem_set_last_error("JSON: %s at byte %zu", what, p->i);
  return GPUMEM_ERR_INVALID_ARGUMENT;
}

static void skip_space(jp_t* p) {
  while (p->i < p->n &&
         (p->s[p->i] == ' ' || p->s[p->i] == '\n' || p->s[p->i] == '\r' || p->s[p->i] == '\t'))
    p->i++;
}

static int hex4(const char* s, unsigned* out) {
  unsigned v = 0;
  for (int k = 0; k < 4; k++) {
    char c = s[k];
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= (unsigned)(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v |= (unsigned)(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      v |= (unsigned)(c - 'A' + 10);
    } else {
      return 0;
    }
  }
  *out = v;
  return 1;
}

/* A code point as UTF-8 into b (4 bytes at most); its length. */
static size_t utf8(unsigned cp, unsigned char* b) {
  if (cp < 0x80) {
    b[0] = (unsigned char)cp;
    return 1;
  }
  if (cp < 0x800) {
    b[0] = (unsigned char)(0xC0 | (cp >> 6));
    b[1] = (unsigned char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    b[0] = (unsigned char)(0xE0 | (cp >> 12));
    b[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    b[2] = (unsigned char)(0x80 | (cp & 0x3F));
    return 3;
  }
  b[0] = (unsigned char)(0xF0 | (cp >> 18));
  b[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
  b[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
  b[3] = (unsigned char)(0x80 | (cp & 0x3F));
  return 4;
}

/* A string at p->i (its opening quote) as BINUNICODE. The decoded text is
 * never longer than the JSON text, so one buffer of that size holds it. */
static gpumem_status_t string(jp_t* p) {
  size_t start = ++p->i, end = start;
  while (end < p->n && p->s[end] != '"') end += p->s[end] == '\\' ? 2 : 1;
  if (end >= p->n) return bad(p, "unterminated string");
  unsigned char* text = malloc(end - start + 1);
  if (!text) {
    gpumem_set_last_error("JSON: out of host memory");
    return GPUMEM_ERR_HOST_MEMORY;
  }
  size_t len = 0;
  while (p->i < end) {
    char c = p->s[p->i++];
    if (c != '\\') {
      text[len++] = (unsigned char)c;
      continue;
    }
    c = p->s[p->i++];
    const char* from = "\"\\/bfnrt";
    const char* to = "\"\\/\b\f\n\r\t";
    const char* at = strchr(from, c);
    if (c && at) {
      text[len++] = (unsigned char)to[at - from];
      continue;
    }
    unsigned cp = 0, lo = 0;
    if (c != 'u' || p->i + 4 > end || !hex4(p->s + p->i, &cp)) {
      free(text);
      return bad(p, "bad escape in a string");
    }
    p->i += 4;
    /* a surrogate pair is one code point */
    if (cp >= 0xD800 && cp < 0xDC00 && p->i + 6 <= end && p->s[p->i] == '\\' &&
        p->s[p->i + 1] == 'u' && hex4(p->s + p->i + 2, &lo) && lo >= 0xDC00 && lo < 0xE000) {
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
      p->i += 6;
    }
    len += utf8(cp, text + len);
  }
  p->i = end + 1;
  op(p, 'X');
  le32(p, (uint32_t)len);
  emit(p, text, len);
  free(text);
  return GPUMEM_OK;
}

/* A whole number fits a signed 64-bit LONG1; anything else is a float. */
static gpumem_status_t number(jp_t* p) {
  size_t start = p->i;
  int is_float = 0;
  if (p->i < p->n && p->s[p->i] == '-') p->i++;
  while (p->i < p->n && p->s[p->i] && strchr("0123456789.eE+-", p->s[p->i])) {
    if (strchr(".eE", p->s[p->i])) is_float = 1;
    p->i++;
  }
  char buf[64];
  size_t len = p->i - start;
  if (len == 0 || len >= sizeof buf) return bad(p, "bad number");
  memcpy(buf, p->s + start, len);
  buf[len] = '\0';
  char* end;
  errno = 0;
  if (!is_float) {
    long long v = strtoll(buf, &end, 10);
    if (*end || errno) return bad(p, "bad number");
    unsigned char b[10] = {0x8a, 8};
    for (int k = 0; k < 8; k++) b[2 + k] = (unsigned char)((unsigned long long)v >> (8 * k));
    emit(p, b, sizeof b);
    return GPUMEM_OK;
  }
  double d = strtod(buf, &end);
  if (*end || !isfinite(d)) return bad(p, "bad number");
  uint64_t bits;
  memcpy(&bits, &d, sizeof bits);
  unsigned char b[9] = {'G'};
  for (int k = 0; k < 8; k++) b[1 + k] = (unsigned char)(bits >> (56 - 8 * k));
  emit(p, b, sizeof b);
  return GPUMEM_OK;
}

static gpumem_status_t value(jp_t* p, int depth);

/* An object or an array: the empty container, a mark, the items, then
 * SETITEMS or APPENDS (valid with no items too). */
static gpumem_status_t container(jp_t* p, int depth, int object) {
  char close = object ? '}' : ']';
  op(p, object ? '}' : ']');
  op(p, '(');
  p->i++;
  skip_space(p);
  if (p->i < p->n && p->s[p->i] == close) {
    p->i++;
  } else {
    for (;;) {
      gpumem_status_t st;
      skip_space(p);
      if (object) {
        if (p->i >= p->n || p->s[p->i] != '"') return bad(p, "expected a key");
        if ((st = string(p)) != GPUMEM_OK) return st;
        skip_space(p);
        if (p->i >= p->n || p->s[p->i] != ':') return bad(p, "expected ':'");
        p->i++;
      }
      if ((st = value(p, depth + 1)) != GPUMEM_OK) return st;
      skip_space(p);
      if (p->i < p->n && p->s[p->i] == ',') {
        p->i++;
        continue;
      }
      if (p->i < p->n && p->s[p->i] == close) {
        p->i++;
        break;
      }
      return bad(p, object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
  }
  op(p, object ? 'u' : 'e');
  return GPUMEM_OK;
}

static gpumem_status_t value(jp_t* p, int depth) {
  if (depth > MAX_DEPTH) return bad(p, "nested too deep");
  skip_space(p);
  if (p->i >= p->n) return bad(p, "expected a value");
  char c = p->s[p->i];
  if (c == '{' || c == '[') return container(p, depth, c == '{');
  if (c == '"') return string(p);
  static const struct {
    const char* word;
    unsigned char op;
  } words[] = {{"true", 0x88}, {"false", 0x89}, {"null", 'N'}};
  for (size_t k = 0; k < sizeof words / sizeof words[0]; k++) {
    size_t len = strlen(words[k].word);
    if (p->n - p->i >= len && memcmp(p->s + p->i, words[k].word, len) == 0) {
      p->i += len;
      op(p, words[k].op);
      return GPUMEM_OK;
    }
  }
  return number(p);
}

gpumem_status_t json_to_pickle(const char* json, size_t len, gpumem_write_fn write, void* arg) {
  jp_t* p = calloc(1, sizeof *p);
  if (!p) {
    gpumem_set_last_error("JSON: out of host memory");
    return GPUMEM_ERR_HOST_MEMORY;
  }
  p->s = json;
  p->n = len;
  p->write = write;
  p->arg = arg;
  static const unsigned char proto[2] = {0x80, 2};
  emit(p, proto, 2);
  gpumem_status_t st = value(p, 0);
  skip_space(p);
  if (st == GPUMEM_OK && p->i != p->n) st = bad(p, "text after the value");
  if (st == GPUMEM_OK) {
    op(p, '.');
    flush(p);
    if (p->failed) {
      gpumem_set_last_error("writing the pickle failed");
      st = GPUMEM_ERR_HOST_MEMORY;
    }
  }
  free(p);
  return st;
}
