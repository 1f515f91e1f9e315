/* Statistics presentation: the table torch.cuda.memory_summary() prints and
 * the flat key vocabulary of torch.cuda.memory_stats(), as JSON.
 *
 * Every row and key comes from the X-macro lists in gpumem.h
 * (GPUMEM_STAT_ARRAYS, GPUMEM_STAT_COUNTERS, GPUMEM_BACKEND_CALLS), so the
 * struct, the table and the JSON cannot drift apart. Counting lives with the
 * allocator; this file only formats a snapshot, so it also serves snapshots
 * read back from elsewhere, with no allocator at hand. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

const char* gm_format_bytes(uint64_t bytes, char* buf, size_t len) {
  static const char* const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (!buf || len == 0) return "";
  if (bytes < 1024) {
    snprintf(buf, len, "%" PRIu64 " B", bytes);
    return buf;
  }
  double v = (double)bytes / 1024.0;
  size_t u = 0;
  /* Move up a unit when the two-decimal rounding would print "1024.00". */
  while (u + 1 < sizeof units / sizeof units[0] && v * 100.0 + 0.5 >= 1024.0 * 100.0) {
    v /= 1024.0;
    u++;
  }
  snprintf(buf, len, "%.2f %s", v, units[u]);
  return buf;
}

/* ---- output plumbing ---------------------------------------------------- */

void gm_emit(gm_emitter* e, const char* text, size_t len) {
  if (e->rc != 0 || len == 0) return;
  int r = e->write(text, len, e->arg);
  if (r != 0) e->rc = r;
}

void gm_emitf(gm_emitter* e, const char* fmt, ...) {
  if (e->rc != 0) return;
  /* Every piece is one table line or one JSON member: fixed labels and
   * numbers, well under this size. */
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  gm_emit(e, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

/* The length of the valid UTF-8 sequence at s (1 to 4), or 0 when it is
 * not one (a stray byte, an overlong form, a surrogate, past U+10FFFF). */
static int utf8_length(const unsigned char* s) {
  unsigned char c = s[0];
  int n = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
  for (int i = 1; i < n; i++)
    if ((s[i] & 0xc0) != 0x80) return 0;
  if ((c == 0xe0 && s[1] < 0xa0) || (c == 0xed && s[1] > 0x9f) || (c == 0xf0 && s[1] < 0x90) ||
      (c == 0xf4 && s[1] > 0x8f))
    return 0;
  return n;
}

void gm_emit_json_string(gm_emitter* e, const char* s) {
  /* Strings may come from another process (a published process name, a
   * path): the output stays valid UTF-8, with every control character,
   * C1 ones (U+0080-U+009F, which terminals act on) included, escaped, and
   * each byte that is not UTF-8 replaced by U+FFFD. */
  gm_emit(e, "\"", 1);
  const unsigned char* p = (const unsigned char*)s;
  while (*p) {
    unsigned char c = *p;
    if (c == '"' || c == '\\') {
      char esc[2] = {'\\', (char)c};
      gm_emit(e, esc, 2);
      p++;
    } else if (c < 0x20 || c == 0x7f) {
      gm_emitf(e, "\\u%04x", c);
      p++;
    } else if (c < 0x80) {
      gm_emit(e, (const char*)p, 1);
      p++;
    } else {
      int n = utf8_length(p);
      if (n == 0) {
        gm_emit(e, "\\ufffd", 6);
        p++;
      } else if (n == 2 && c == 0xc2 && p[1] <= 0x9f) {
        gm_emitf(e, "\\u%04x", p[1]);
        p += 2;
      } else {
        gm_emit(e, (const char*)p, (size_t)n);
        p += n;
      }
    }
  }
  gm_emit(e, "\"", 1);
}

static int check_args(const gpumem_stats_t* stats, gpumem_write_fn write, const char* fn) {
  if (stats && write) return 0;
  return (int)gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, stats ? "write" : "stats");
}

/* ---- the lists, as tables --------------------------------------------- */

typedef struct stat_array_desc {
  const char* name;  /* memory_stats() key prefix: "allocated_bytes" */
  const char* title; /* summary row title: "Allocated memory" */
  int is_bytes;
  size_t offset;
} stat_array_desc_t;

static const stat_array_desc_t stat_arrays[] = {
#define GM_X_ARRAY_DESC(name, title, is_bytes) \
  {#name, title, is_bytes, offsetof(gpumem_stats_t, name)},
    GPUMEM_STAT_ARRAYS(GM_X_ARRAY_DESC)
#undef GM_X_ARRAY_DESC
};
enum { STAT_ARRAY_COUNT = sizeof stat_arrays / sizeof stat_arrays[0] };

typedef struct stat_counter_desc {
  const char* name;
  const char* title;
  size_t offset;
} stat_counter_desc_t;

static const stat_counter_desc_t stat_counters[] = {
#define GM_X_COUNTER_DESC(name, title) {#name, title, offsetof(gpumem_stats_t, name)},
    GPUMEM_STAT_COUNTERS(GM_X_COUNTER_DESC)
#undef GM_X_COUNTER_DESC
};
enum { STAT_COUNTER_COUNT = sizeof stat_counters / sizeof stat_counters[0] };

static const gpumem_stat_t* stat_at(const gpumem_stats_t* s, const stat_array_desc_t* d, int pool) {
  return (const gpumem_stat_t*)((const char*)s + d->offset) + pool;
}

static int64_t counter_at(const gpumem_stats_t* s, const stat_counter_desc_t* d) {
  int64_t v;
  memcpy(&v, (const char*)s + d->offset, sizeof v);
  return v;
}

/* memory_stats() pool names, indexed by GPUMEM_POOL_*. */
static const char* const pool_keys[GPUMEM_POOL_COUNT] = {"all", "small_pool", "large_pool"};

static const char* policy_name(int policy) {
  switch (policy) {
    case GPUMEM_POLICY_DEFAULT:
      return "default";
    case GPUMEM_POLICY_PYTORCH:
      return "pytorch";
  }
  return "unknown";
}

/* ---- summary table ---------------------------------------------------- */

/* torch's table is 75 characters between the outer bars. */
enum { TABLE_WIDTH = 75 };

static void rule(gm_emitter* e, char c) {
  char line[TABLE_WIDTH + 3];
  line[0] = '|';
  memset(line + 1, c, TABLE_WIDTH);
  line[TABLE_WIDTH + 1] = '|';
  line[TABLE_WIDTH + 2] = '\n';
  gm_emit(e, line, sizeof line);
}

/* Python's floor division, which torch's formatting uses. */
static int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* A 10-character byte cell the way torch formats one: an integer in the
 * unit chosen by the pool's "all" value (pref), so a metric's three rows
 * share units and can be compared at a glance. */
static void size_cell(char* out, size_t len, int64_t v, int64_t pref) {
  static const char* const units[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
  size_t u = 0;
  double p = (double)pref;
  /* A pool's value never exceeds "all"'s, but a snapshot read back from
   * elsewhere may hold anything: never overflow the column. */
  while (u + 1 < sizeof units / sizeof units[0] &&
         (p >= 768.0 * 1024.0 || v > 999999 || v < -99999)) {
    v = floor_div(v, 1024);
    p /= 1024.0;
    u++;
  }
  snprintf(out, len, "%6" PRId64 " %s", v, units[u]);
}

/* The count counterpart: thousands, K and M past 750,000 of the pref. */
static void count_cell(char* out, size_t len, int64_t v, int64_t pref) {
  static const char* const units[] = {" ", "K", "M"};
  size_t u = 0;
  double p = (double)pref;
  while (u + 1 < sizeof units / sizeof units[0] && p >= 750.0 * 1000.0) {
    v = floor_div(v, 1000);
    p /= 1000.0;
    u++;
  }
  snprintf(out, len, "%7" PRId64 " %s ", v, units[u]);
}

static void metric_rows(gm_emitter* e, const gpumem_stats_t* s, const stat_array_desc_t* d,
                        int abbreviated) {
  /* torch's order: the total, then large before small; torch's abbreviated
   * table keeps the total alone. */
  static const int pools[] = {GPUMEM_POOL_ALL, GPUMEM_POOL_LARGE, GPUMEM_POOL_SMALL};
  static const char* const labels[] = {NULL, "      from large pool", "      from small pool"};
  const gpumem_stat_t* all = stat_at(s, d, GPUMEM_POOL_ALL);
  const int64_t prefs[4] = {all->current, all->peak, all->allocated, all->freed};
  rule(e, '-');
  for (size_t r = 0; r < (abbreviated ? 1u : 3u); r++) {
    const gpumem_stat_t* st = stat_at(s, d, pools[r]);
    const int64_t vals[4] = {st->current, st->peak, st->allocated, st->freed};
    char cells[4][32];
    for (int c = 0; c < 4; c++) {
      if (d->is_bytes) {
        size_cell(cells[c], sizeof cells[c], vals[c], prefs[c]);
      } else {
        count_cell(cells[c], sizeof cells[c], vals[c], prefs[c]);
      }
    }
    gm_emitf(e, "| %-21s | %s | %s | %s | %s |\n", labels[r] ? labels[r] : d->title, cells[0],
             cells[1], cells[2], cells[3]);
  }
}

/* A label/value row for the sections torch lacks; same outer width. */
static void kv_row(gm_emitter* e, const char* label, const char* value) {
  gm_emitf(e, "| %-52s | %18s |\n", label, value);
}

int gpumem_format_summary(const gpumem_stats_t* stats, gpumem_write_fn write, void* arg) {
  return gpumem_format_summary_flags(stats, 0, write, arg);
}

int gpumem_format_summary_flags(const gpumem_stats_t* stats, int flags, gpumem_write_fn write,
                                void* arg) {
  int bad = check_args(stats, write, "gpumem_format_summary");
  if (bad) return bad;
  if (flags & ~GPUMEM_SUMMARY_ABBREVIATED) {
    return (int)gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                        "gpumem_format_summary_flags: unknown flags 0x%x",
                        (unsigned)(flags & ~GPUMEM_SUMMARY_ABBREVIATED));
  }
  const int abbreviated = (flags & GPUMEM_SUMMARY_ABBREVIATED) != 0;
  gm_emitter e = {write, arg, 0};
  char v[64];

  static const char title[] = "gpumem memory summary";
  int pad = (TABLE_WIDTH - (int)(sizeof title - 1)) / 2;
  rule(&e, '=');
  gm_emitf(&e, "|%*s%s%*s|\n", pad, "", title, TABLE_WIDTH - pad - (int)(sizeof title - 1), "");
  rule(&e, '-');
  gm_emitf(&e, "|  %9s CUDA OOMs: %-12" PRId64 " | %6s cudaMalloc retries: %-8" PRId64 "  |\n", "",
           stats->num_ooms, "", stats->num_alloc_retries);
  rule(&e, '=');
  gm_emitf(&e, "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n");
  /* Memory rows first, then counts, as torch groups them; both from the list. */
  for (int want_bytes = 1; want_bytes >= 0; want_bytes--) {
    for (size_t i = 0; i < STAT_ARRAY_COUNT; i++) {
      if (stat_arrays[i].is_bytes == want_bytes)
        metric_rows(&e, stats, &stat_arrays[i], abbreviated);
    }
  }
  rule(&e, '=');

  kv_row(&e, "Counter", "Total");
  rule(&e, '-');
  for (size_t i = 0; i < STAT_COUNTER_COUNT; i++) {
    snprintf(v, sizeof v, "%" PRId64, counter_at(stats, &stat_counters[i]));
    kv_row(&e, stat_counters[i].title, v);
  }
  rule(&e, '=');

  kv_row(&e, "gpumem", "Value");
  rule(&e, '-');
  kv_row(&e, "Largest free block", gm_format_bytes(stats->largest_free_block, v, sizeof v));
  kv_row(&e, "Cached free memory", gm_format_bytes(stats->cached_free_bytes, v, sizeof v));
  if (isfinite(stats->fragmentation)) {
    snprintf(v, sizeof v, "%.2f%%", stats->fragmentation * 100.0);
  } else {
    snprintf(v, sizeof v, "n/a");
  }
  kv_row(&e, "Fragmentation", v);
  kv_row(&e, "Limit",
         stats->limit_bytes ? gm_format_bytes(stats->limit_bytes, v, sizeof v) : "none");
  kv_row(&e, "Device total", gm_format_bytes(stats->device_total, v, sizeof v));
  kv_row(&e, "Device free", gm_format_bytes(stats->device_free, v, sizeof v));
  kv_row(&e, "Page size", gm_format_bytes(stats->page_size, v, sizeof v));
  kv_row(&e, "Policy", policy_name(stats->policy));
  kv_row(&e, "Virtual memory", stats->virtual_memory ? "yes" : "no");
  /* Only the kinds that were called: sixteen rows of zeros would bury the
   * ones that matter. The JSON lists every kind. */
  int any_call = 0;
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) {
    if (stats->backend_calls[k] == 0) continue;
    char label[64];
    snprintf(label, sizeof label, "Backend calls: %s", gpumem_backend_call_name(k));
    snprintf(v, sizeof v, "%" PRIu64, stats->backend_calls[k]);
    kv_row(&e, label, v);
    any_call = 1;
  }
  if (!any_call) kv_row(&e, "Backend calls", "none");
  rule(&e, '=');
  return e.rc;
}

/* ---- JSON --------------------------------------------------------------- */

/* Writes the separator and indentation before each member, so no member
 * ever leaves a trailing comma behind. */
static void json_key(gm_emitter* e, int* first, const char* indent, const char* key) {
  gm_emitf(e, "%s%s\"%s\": ", *first ? "" : ",\n", indent, key);
  *first = 0;
}

/* JSON has no NaN or infinity; null says "no meaningful value". */
static void json_double(gm_emitter* e, double v) {
  if (isfinite(v)) {
    gm_emitf(e, "%.6g", v);
  } else {
    gm_emit(e, "null", 4);
  }
}

int gpumem_format_stats_json(const gpumem_stats_t* stats, gpumem_write_fn write, void* arg) {
  int bad = check_args(stats, write, "gpumem_format_stats_json");
  if (bad) return bad;
  gm_emitter e = {write, arg, 0};
  static const char* const ind = "  ";
  int first = 1;
  char key[128];

  gm_emit(&e, "{\n", 2);
  for (size_t i = 0; i < STAT_ARRAY_COUNT; i++) {
    for (int pool = 0; pool < GPUMEM_POOL_COUNT; pool++) {
      const gpumem_stat_t* st = stat_at(stats, &stat_arrays[i], pool);
      const struct {
        const char* type;
        int64_t value;
      } fields[] = {
          {"current", st->current},
          {"peak", st->peak},
          {"allocated", st->allocated},
          {"freed", st->freed},
      };
      for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++) {
        snprintf(key, sizeof key, "%s.%s.%s", stat_arrays[i].name, pool_keys[pool], fields[f].type);
        json_key(&e, &first, ind, key);
        gm_emitf(&e, "%" PRId64, fields[f].value);
      }
    }
  }
  for (size_t i = 0; i < STAT_COUNTER_COUNT; i++) {
    json_key(&e, &first, ind, stat_counters[i].name);
    gm_emitf(&e, "%" PRId64, counter_at(stats, &stat_counters[i]));
  }
  /* The rest of torch.cuda.memory_stats()'s keys. Oversize blocks (at
   * least max_split_size) are counted by nothing in gpumem: zeros, so a
   * reader of torch's dict finds every key it expects. */
  json_key(&e, &first, ind, "max_split_size");
  gm_emitf(&e, "%" PRId64, stats->max_split_size);
  static const char* const oversize[] = {"oversize_allocations", "oversize_segments"};
  for (size_t i = 0; i < sizeof oversize / sizeof oversize[0]; i++) {
    json_key(&e, &first, ind, oversize[i]);
    gm_emitf(&e, "{\"current\": 0, \"peak\": 0, \"allocated\": 0, \"freed\": 0}");
  }

  json_key(&e, &first, ind, "largest_free_block");
  gm_emitf(&e, "%" PRIu64, stats->largest_free_block);
  json_key(&e, &first, ind, "cached_free_bytes");
  gm_emitf(&e, "%" PRIu64, stats->cached_free_bytes);
  json_key(&e, &first, ind, "fragmentation");
  json_double(&e, stats->fragmentation);
  const struct {
    const char* name;
    uint64_t value;
  } extras[] = {
      {"limit_bytes", stats->limit_bytes},
      {"device_total", stats->device_total},
      {"device_free", stats->device_free},
      {"page_size", stats->page_size},
  };
  for (size_t i = 0; i < sizeof extras / sizeof extras[0]; i++) {
    json_key(&e, &first, ind, extras[i].name);
    gm_emitf(&e, "%" PRIu64, extras[i].value);
  }
  json_key(&e, &first, ind, "policy");
  gm_emitf(&e, "\"%s\"", policy_name(stats->policy));
  json_key(&e, &first, ind, "virtual_memory");
  gm_emitf(&e, "%s", stats->virtual_memory ? "true" : "false");

  json_key(&e, &first, ind, "backend_calls");
  gm_emit(&e, "{\n", 2);
  int first_call = 1;
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) {
    json_key(&e, &first_call, "    ", gpumem_backend_call_name(k));
    gm_emitf(&e, "%" PRIu64, stats->backend_calls[k]);
  }
  gm_emitf(&e, "\n%s}\n}\n", ind);
  return e.rc;
}

int gpumem_write_to_file(const char* text, size_t len, void* file) {
  if (!file || (!text && len)) return (int)GPUMEM_ERR_INVALID_ARGUMENT;
  if (len == 0) return 0;
  return fwrite(text, 1, len, (FILE*)file) == len ? 0 : (int)GPUMEM_ERR_IO;
}
