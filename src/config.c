/* Options: their defaults, the GPUMEM_CONF string ("key:value,key:value", the
 * grammar of PYTORCH_CUDA_ALLOC_CONF) and byte sizes such as "1.5G".
 *
 * The person reading a configuration error is usually looking at an
 * environment variable, not at this code, so every error quotes the offending
 * text and lists what would have been accepted. Numbers are parsed by hand
 * rather than with strtod/strtoull: those accept signs, hex, "inf" and
 * locale-specific decimal commas, none of which belong in a config string,
 * and the host process (Python, a training job) may have changed the locale. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"

#define VALID_KEYS                                                                           \
  "policy, limit, fraction, reclaim, headroom, max_split_size_mb, placement, map_max, "      \
  "move_guard, move_budget, stream_waits, publish, leak_check, oom_snapshot, shared_limit, " \
  "shared_name, shared_group, record, fences, map_ahead, lend, small_pool, overflow"
#define SIZE_FORMS "a size such as 123, 4K, 1.5G, 2GiB or 512MB (binary units K, M, G, T)"
#define PAIRS_HINT "expected key:value pairs separated by ','"

/* Long tokens are cut in messages so the list of valid choices still fits in
 * the thread-local message buffer. */
#define SHOWN(n) ((int)((n) > 200 ? 200 : (n)))

/* Python passes options as an opaque buffer of this size
 * (python/gpumem/_lib.py, _OPTS_BUF). */
_Static_assert(sizeof(gpumem_options_t) <= 1024, "gpumem_options_t outgrew Python's buffer");

void gpumem_options_init(gpumem_options_t* opts) {
  if (!opts) return;
  memset(opts, 0, sizeof *opts);
  opts->struct_size = (uint32_t)sizeof *opts;
  opts->policy = GPUMEM_POLICY_DEFAULT;
  opts->limit_bytes = 0;
  opts->limit_fraction = 0.0;
  /* Memory moves only when something needs it: with no cap, growth comes
   * in large mappings and pages move for headroom only within the move
   * budget; under a cap, pages are fine-grained and a plan serves loops
   * that repeat. docs/design.md ("The default policy") has the reasons and
   * the measured trade-offs. */
  opts->reclaim = GPUMEM_RECLAIM_LAZY;
  opts->headroom = 0.02;
  /* No moves for headroom by default: each budgeted move of a run waits
   * for its stream, and on host-bound jobs those synchronizations cost
   * more than the memory saved (t5 1.089 -> 0.998 x native, serving 1.19 ->
   * 0.88 x, one H200 run each; BENCHMARKS.md). */
  opts->move_budget_us = 0.0;
  opts->max_split_size = 0;
  opts->placement = GPUMEM_PLACEMENT_AUTO;
  opts->own_backend = 0;
  /* Large mappings while nothing needs fine reclaim (pages.c says when):
   * on an H100 a mapping costs ~50-110 us to create, map and grant access
   * to, 2 MiB or 1 GiB alike; see docs/design.md. */
  opts->map_max_bytes = (size_t)1 << 30;
  /* A run that grows an arena block by block maps ahead of itself, up to
   * this much (alloc.c, tail_run_ahead has the measurements). */
  opts->map_ahead_bytes = (size_t)128 << 20;
  /* Off: on a GPU the host runs ahead, and lending gained nothing on the
   * one job measured (alloc.c, borrow_mapped). */
  opts->lend = 0;
  /* Requests of up to 1 MiB in arenas of their own, as PyTorch's small
   * pool: small blocks scattered through the large arenas' holes split the
   * room later large tensors need (alloc.c, pool_index). */
  opts->small_pool = 1;
  /* Memory held at the high-water mark unless that costs a page move every
   * few allocations with no plan serving (pages.c, note_move). */
  opts->move_guard = 1;
  opts->fences = 1;
  /* Streams of a plan may share memory, ordered on the device (plan.c). */
  opts->stream_waits = 1;
  /* Published for gpumem top over CUDA; not for the simulated device's
   * many short-lived allocators (publish.c). */
  opts->publish = GPUMEM_PUBLISH_AUTO;
}

/* A piece of the configuration string; never NUL-terminated on its own. */
typedef struct span {
  const char* p;
  size_t n;
} span_t;

/* Locale-independent on purpose (see the top of the file). */
static bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
static bool is_digit(char c) {
  return c >= '0' && c <= '9';
}
static char to_lower(char c) {
  return (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
}

static span_t trim(const char* p, size_t n) {
  while (n > 0 && is_space(p[0])) p++, n--;
  while (n > 0 && is_space(p[n - 1])) n--;
  return (span_t){p, n};
}

static bool span_eq(span_t s, const char* word) {
  return strlen(word) == s.n && memcmp(s.p, word, s.n) == 0;
}

static bool span_eq_nocase(span_t s, const char* word) {
  if (strlen(word) != s.n) return false;
  for (size_t i = 0; i < s.n; i++) {
    if (to_lower(s.p[i]) != to_lower(word[i])) return false;
  }
  return true;
}

/* The largest byte count representable, as a uint64_t even where size_t is
 * narrower, so one overflow test serves every platform. */
#define SIZE_LIMIT ((uint64_t)SIZE_MAX)

/* Parses a byte size. On failure *why says what was wrong and *out is left
 * alone. Fractions are exact: "1.5G" is 1610612736, and a fractional byte
 * count is rounded down. */
static bool parse_size_span(span_t s, size_t* out, const char** why) {
  s = trim(s.p, s.n);
  const char* p = s.p;
  size_t n = s.n, i = 0;
  if (n == 0) {
    *why = "empty value";
    return false;
  }
  if (p[0] == '-') {
    *why = "sizes cannot be negative";
    return false;
  }

  uint64_t whole = 0;
  bool overflow = false, any_digit = false;
  for (; i < n && is_digit(p[i]); i++) {
    unsigned d = (unsigned)(p[i] - '0');
    if (whole > (UINT64_MAX - d) / 10) overflow = true;
    if (!overflow) whole = whole * 10 + d;
    any_digit = true;
  }
  size_t frac_at = i, frac_len = 0;
  if (i < n && p[i] == '.') {
    frac_at = ++i;
    while (i < n && is_digit(p[i])) i++;
    frac_len = i - frac_at;
    any_digit = any_digit || frac_len > 0;
  }
  if (!any_digit) {
    *why = "not a number";
    return false;
  }

  while (i < n && is_space(p[i])) i++;
  unsigned shift = 0;
  if (i < n) {
    static const char units[] = "kmgt";
    char c = to_lower(p[i]);
    const char* u = c ? strchr(units, c) : NULL;
    if (u) {
      shift = 10u * (unsigned)(u - units + 1);
      i++;
      /* "K", "Ki", "KiB" and "KB" all mean 1024: PyTorch users write all four. */
      if (i < n && to_lower(p[i]) == 'i') i++;
      if (i < n && to_lower(p[i]) == 'b') i++;
    } else if (c == 'b') {
      i++;
    }
  }
  if (i != n) {
    *why = "unexpected characters after the number";
    return false;
  }

  uint64_t mult = (uint64_t)1 << shift;
  if (overflow || whole > SIZE_LIMIT / mult) {
    *why = "too large (does not fit in size_t)";
    return false;
  }
  uint64_t bytes = whole * mult;
  /* floor(0.d1d2...dn * mult), computed from the last digit up as
   * x = (d * mult + x) / 10: flooring at every step gives the same result as
   * flooring once at the end, and d * mult + x < 10 * 2^40 never overflows,
   * so any number of digits is exact. */
  uint64_t frac = 0;
  for (size_t k = frac_len; k-- > 0;) {
    frac = ((uint64_t)(p[frac_at + k] - '0') * mult + frac) / 10;
  }
  if (bytes > SIZE_LIMIT - frac) {
    *why = "too large (does not fit in size_t)";
    return false;
  }
  *out = (size_t)(bytes + frac);
  return true;
}

gpumem_status_t gpumem_parse_size(const char* text, size_t* out) {
  if (!text || !out) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_parse_size: %s is NULL",
                   text ? "out" : "text");
  }
  const char* why = "";
  size_t n = strlen(text);
  if (!parse_size_span((span_t){text, n}, out, &why)) {
    return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT,
                   "gpumem: bad size \"%.*s\": %s; expected " SIZE_FORMS, SHOWN(n), text, why);
  }
  return GPUMEM_OK;
}

/* 10^e as a double for |e| <= 22, where every power is exact. */
static double exact_pow10(int e) {
  double r = 1.0;
  while (e-- > 0) r *= 10.0;
  return r;
}

/* Parses an unsigned decimal number: digits, an optional fraction and an
 * optional exponent ("0.9", "1", ".5", "2e-3"). Up to 19 significant digits
 * are kept in an integer, so typical values ("0.9" = 9 / 10) come out
 * correctly rounded from a single exact division. */
static bool parse_number_span(span_t s, double* out) {
  const char* p = s.p;
  size_t n = s.n, i = 0;
  uint64_t mant = 0;
  int digits = 0, exp10 = 0;
  bool any_digit = false;
  for (; i < n && is_digit(p[i]); i++) {
    any_digit = true;
    if (digits < 19) {
      mant = mant * 10 + (uint64_t)(p[i] - '0');
      if (mant) digits++;
    } else {
      exp10++; /* a dropped integer digit still scales the value */
    }
  }
  if (i < n && p[i] == '.') {
    for (i++; i < n && is_digit(p[i]); i++) {
      any_digit = true;
      if (digits < 19) {
        mant = mant * 10 + (uint64_t)(p[i] - '0');
        if (mant) digits++;
        exp10--;
      }
    }
  }
  if (!any_digit) return false;
  if (i < n && (p[i] == 'e' || p[i] == 'E')) {
    i++;
    int sign = 1, e = 0;
    if (i < n && (p[i] == '+' || p[i] == '-')) sign = p[i++] == '-' ? -1 : 1;
    if (i >= n || !is_digit(p[i])) return false;
    for (; i < n && is_digit(p[i]); i++) {
      if (e < 10000) e = e * 10 + (p[i] - '0'); /* past that it is 0 or inf anyway */
    }
    exp10 += sign * e;
  }
  if (i != n) return false;

  double v = (double)mant;
  if (mant == 0) {
    v = 0.0;
  } else if (exp10 >= 0) {
    for (; exp10 > 22 && isfinite(v); exp10 -= 22) v *= exact_pow10(22);
    v *= exact_pow10(exp10);
  } else {
    for (; exp10 < -22 && v != 0.0; exp10 += 22) v /= exact_pow10(22);
    v /= exact_pow10(-exp10);
  }
  if (!isfinite(v)) return false;
  *out = v;
  return true;
}

/* A whole number without units (max_split_size_mb, as PyTorch takes it). */
static bool parse_uint_span(span_t s, uint64_t* out) {
  if (s.n == 0) return false;
  uint64_t v = 0;
  for (size_t i = 0; i < s.n; i++) {
    if (!is_digit(s.p[i])) return false;
    unsigned d = (unsigned)(s.p[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

/* Matches value against a NULL-terminated list of choices, ignoring case
 * ("Pytorch" is not worth an error); returns the index or -1. */
static int parse_choice(span_t value, const char* const* choices) {
  for (int i = 0; choices[i]; i++) {
    if (span_eq_nocase(value, choices[i])) return i;
  }
  return -1;
}

enum {
  KEY_POLICY,
  KEY_LIMIT,
  KEY_FRACTION,
  KEY_RECLAIM,
  KEY_HEADROOM,
  KEY_MAX_SPLIT_SIZE_MB,
  KEY_PLACEMENT,
  KEY_MAP_MAX,
  KEY_MOVE_GUARD,
  KEY_STREAM_WAITS,
  KEY_PUBLISH,
  KEY_LEAK_CHECK,
  KEY_OOM_SNAPSHOT,
  KEY_SHARED_LIMIT,
  KEY_SHARED_NAME,
  KEY_MOVE_BUDGET,
  KEY_SHARED_GROUP,
  KEY_RECORD,
  KEY_FENCES,
  KEY_MAP_AHEAD,
  KEY_LEND,
  KEY_SMALL_POOL,
  KEY_OVERFLOW,
  KEY_COUNT
};

/* Same order as the enum above and VALID_KEYS. */
static const char* const key_names[KEY_COUNT] = {
    "policy",       "limit",        "fraction",
    "reclaim",      "headroom",     "max_split_size_mb",
    "placement",    "map_max",      "move_guard",
    "stream_waits", "publish",      "leak_check",
    "oom_snapshot", "shared_limit", "shared_name",
    "move_budget",  "shared_group", "record",
    "fences",       "map_ahead",    "lend",
    "small_pool",   "overflow",
};

static const char* const policy_names[] = {"default", "pytorch", NULL};
static const char* const reclaim_names[] = {"lazy", "eager", "pressure", NULL};
static const char* const placement_names[] = {"planned", "bestfit", "auto", NULL};
static const char* const on_off_names[] = {"on", "off", NULL};
static const char* const publish_names[] = {"auto", "on", "off", NULL};
static const char* const lend_names[] = {"off", "on", "ordered", NULL};
static const char* const unlimited_names[] = {"unlimited", NULL};

/* Levenshtein distance between a (short) typed key and a valid key, capped
 * so an absurdly long key costs nothing; used only to suggest a spelling. */
static size_t edit_distance(span_t a, const char* b) {
  enum { CAP = 32 };
  size_t bn = strlen(b);
  if (a.n > CAP || bn > CAP) return CAP;
  size_t row[CAP + 1];
  for (size_t j = 0; j <= bn; j++) row[j] = j;
  for (size_t i = 1; i <= a.n; i++) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= bn; j++) {
      size_t up = row[j];
      size_t best = diag + (to_lower(a.p[i - 1]) == b[j - 1] ? 0 : 1);
      if (up + 1 < best) best = up + 1;
      if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
      row[j] = best;
      diag = up;
    }
  }
  return row[bn];
}

static gpumem_status_t unknown_key(span_t key, span_t entry) {
  const char* guess = NULL;
  size_t best = SIZE_MAX;
  for (int k = 0; k < KEY_COUNT; k++) {
    /* A typo is a few edits, more for a long key ("max_split_size" lacks
     * three letters of "max_split_size_mb"); further away is another word. */
    size_t len = strlen(key_names[k]);
    size_t reach = len / 3 > 2 ? len / 3 : 2;
    size_t d = edit_distance(key, key_names[k]);
    if (d <= reach && d < best) best = d, guess = key_names[k];
  }
  return gm_fail(GPUMEM_ERR_CONFIG,
                 "gpumem config: unknown key \"%.*s\" in \"%.*s\"; valid keys: " VALID_KEYS
                 "%s%s%s",
                 SHOWN(key.n), key.p, SHOWN(entry.n), entry.p, guess ? " (did you mean \"" : "",
                 guess ? guess : "", guess ? "\"?)" : "");
}

static gpumem_status_t bad_value(span_t value, const char* key, const char* expected) {
  return gm_fail(GPUMEM_ERR_CONFIG, "gpumem config: bad value \"%.*s\" for key \"%s\": expected %s",
                 SHOWN(value.n), value.p, key, expected);
}

/* A byte size for key; *out is written only when it parses. */
static gpumem_status_t size_value(span_t value, const char* key, size_t* out) {
  size_t bytes = 0;
  const char* why = "";
  if (!parse_size_span(value, &bytes, &why)) {
    return gm_fail(GPUMEM_ERR_CONFIG,
                   "gpumem config: bad value \"%.*s\" for key \"%s\": expected " SIZE_FORMS " (%s)",
                   SHOWN(value.n), value.p, key, why);
  }
  *out = bytes;
  return GPUMEM_OK;
}

/* Applies one key:value to the working copy. */
static gpumem_status_t apply(gpumem_options_t* o, span_t key, span_t value, span_t entry) {
  int k = 0;
  while (k < KEY_COUNT && !span_eq(key, key_names[k])) k++;
  if (k == KEY_COUNT) return unknown_key(key, entry);
  const char* name = key_names[k];

  switch (k) {
    case KEY_POLICY: {
      int c = parse_choice(value, policy_names);
      if (c < 0) return bad_value(value, name, "one of: default, pytorch");
      o->policy = c == 0 ? GPUMEM_POLICY_DEFAULT : GPUMEM_POLICY_PYTORCH;
      return GPUMEM_OK;
    }
    case KEY_RECLAIM: {
      int c = parse_choice(value, reclaim_names);
      if (c < 0) return bad_value(value, name, "one of: lazy, eager, pressure");
      o->reclaim =
          c == 0 ? GPUMEM_RECLAIM_LAZY : (c == 1 ? GPUMEM_RECLAIM_EAGER : GPUMEM_RECLAIM_PRESSURE);
      return GPUMEM_OK;
    }
    case KEY_PLACEMENT: {
      int c = parse_choice(value, placement_names);
      if (c < 0) return bad_value(value, name, "one of: auto, planned, bestfit");
      o->placement = c == 0   ? GPUMEM_PLACEMENT_PLANNED
                     : c == 1 ? GPUMEM_PLACEMENT_BESTFIT
                              : GPUMEM_PLACEMENT_AUTO;
      return GPUMEM_OK;
    }
    case KEY_MOVE_GUARD:
    case KEY_STREAM_WAITS:
    case KEY_FENCES:
    case KEY_SMALL_POOL:
    case KEY_LEAK_CHECK: {
      int c = parse_choice(value, on_off_names);
      if (c < 0) return bad_value(value, name, "one of: on, off");
      *(k == KEY_MOVE_GUARD     ? &o->move_guard
        : k == KEY_STREAM_WAITS ? &o->stream_waits
        : k == KEY_FENCES       ? &o->fences
        : k == KEY_SMALL_POOL   ? &o->small_pool
                                : &o->leak_check) = c == 0;
      return GPUMEM_OK;
    }
    case KEY_LEND: {
      int c = parse_choice(value, lend_names);
      if (c < 0) return bad_value(value, name, "one of: off, on, ordered");
      o->lend = c == 0 ? GPUMEM_LEND_OFF : c == 1 ? GPUMEM_LEND_ON : GPUMEM_LEND_ORDERED;
      return GPUMEM_OK;
    }
    case KEY_PUBLISH: {
      int c = parse_choice(value, publish_names);
      if (c < 0) return bad_value(value, name, "one of: auto, on, off");
      o->publish = c == 0 ? GPUMEM_PUBLISH_AUTO : c == 1 ? GPUMEM_PUBLISH_ON : GPUMEM_PUBLISH_OFF;
      return GPUMEM_OK;
    }
    case KEY_OOM_SNAPSHOT:
    case KEY_RECORD: {
      char* dst = k == KEY_RECORD ? o->record : o->oom_snapshot;
      if (value.n >= sizeof o->oom_snapshot || (k == KEY_RECORD && value.n == 0)) {
        return bad_value(value, name, "a path shorter than 256 bytes (without ',')");
      }
      memcpy(dst, value.p, value.n);
      dst[value.n] = '\0';
      return GPUMEM_OK;
    }
    case KEY_SHARED_LIMIT: {
      size_t bytes = 0;
      gpumem_status_t st = size_value(value, name, &bytes);
      if (st != GPUMEM_OK) return st;
      if (bytes == 0) return bad_value(value, name, "a size above 0 (leave the key out for none)");
      o->shared_limit = bytes;
      return GPUMEM_OK;
    }
    case KEY_SHARED_NAME:
    case KEY_SHARED_GROUP: {
      char* dst = k == KEY_SHARED_NAME ? o->shared_name : o->shared_group;
      bool ok = value.n > 0 && value.n < sizeof o->shared_name;
      for (size_t i = 0; ok && i < value.n; i++) {
        char c = value.p[i];
        ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
             c == '_' || c == '-' || c == '.';
      }
      if (!ok) {
        return bad_value(value, name,
                         k == KEY_SHARED_NAME
                             ? "1 to 39 letters, digits, '_', '-' or '.' (it names a file)"
                             : "a group's name: 1 to 39 letters, digits, '_', '-' or '.'");
      }
      memcpy(dst, value.p, value.n);
      dst[value.n] = '\0';
      return GPUMEM_OK;
    }
    case KEY_LIMIT: {
      size_t bytes = 0;
      gpumem_status_t st = size_value(value, "limit", &bytes);
      if (st != GPUMEM_OK) return st;
      if (bytes == 0) {
        return gm_fail(
            GPUMEM_ERR_CONFIG,
            "gpumem config: bad value \"%.*s\" for key \"limit\": a limit of 0 bytes would "
            "refuse every allocation; leave the key out for no limit",
            SHOWN(value.n), value.p);
      }
      o->limit_bytes = bytes;
      return GPUMEM_OK;
    }
    case KEY_MAP_MAX: {
      gpumem_status_t st = size_value(value, "map_max", &o->map_max_bytes);
      if (st != GPUMEM_OK) return st;
      return GPUMEM_OK;
    }
    case KEY_MAP_AHEAD: {
      if (span_eq(value, "off")) {
        o->map_ahead_bytes = 0;
        return GPUMEM_OK;
      }
      return size_value(value, "map_ahead", &o->map_ahead_bytes);
    }
    case KEY_FRACTION: {
      double v = 0;
      if (!parse_number_span(value, &v) || !(v > 0.0 && v <= 1.0)) {
        return bad_value(value, name, "a number in (0, 1]");
      }
      o->limit_fraction = v;
      return GPUMEM_OK;
    }
    case KEY_MOVE_BUDGET: {
      double v = 0;
      if (parse_choice(value, unlimited_names) == 0) {
        o->move_budget_us = -1.0;
        return GPUMEM_OK;
      }
      if (!parse_number_span(value, &v) || !(v >= 0.0 && v <= 1e6)) {
        return bad_value(value, name,
                         "microseconds of mapping work per allocation, 0 to 1e6, or unlimited");
      }
      o->move_budget_us = v;
      return GPUMEM_OK;
    }
    case KEY_HEADROOM: {
      double v = 0;
      if (!parse_number_span(value, &v) || !(v >= 0.0 && v <= 1.0)) {
        return bad_value(value, name, "a number in [0, 1]");
      }
      o->headroom = v;
      return GPUMEM_OK;
    }
    case KEY_OVERFLOW: {
      /* "off", "host", or "host:SIZE" (a budget of host bytes): the value
       * is everything after the key's colon, so the budget's colon is
       * the value's own. */
      static const char expected[] = "off, host, or host:SIZE (a host budget such as host:64G)";
      if (span_eq_nocase(value, "off")) {
        o->overflow = GPUMEM_OVERFLOW_OFF;
        o->overflow_host_bytes = 0;
        return GPUMEM_OK;
      }
      const char* colon = memchr(value.p, ':', value.n);
      span_t kind = trim(value.p, colon ? (size_t)(colon - value.p) : value.n);
      if (!span_eq_nocase(kind, "host")) return bad_value(value, name, expected);
      size_t budget = 0;
      if (colon) {
        span_t size = trim(colon + 1, value.n - (size_t)(colon - value.p) - 1);
        const char* why = "";
        if (!parse_size_span(size, &budget, &why)) {
          return gm_fail(GPUMEM_ERR_CONFIG,
                         "gpumem config: bad host budget \"%.*s\" for key \"overflow\": %s; "
                         "expected %s, the size " SIZE_FORMS,
                         SHOWN(size.n), size.p, why, expected);
        }
        if (budget == 0)
          return bad_value(value, name,
                           "a host budget above 0 (overflow:host for no budget, overflow:off "
                           "for no tier)");
      }
      o->overflow = GPUMEM_OVERFLOW_HOST;
      o->overflow_host_bytes = budget;
      return GPUMEM_OK;
    }
    case KEY_MAX_SPLIT_SIZE_MB: {
      uint64_t mb = 0;
      if (!parse_uint_span(value, &mb) || mb == 0 || mb > SIZE_LIMIT / GM_MIB) {
        return bad_value(value, name, "a whole number of MiB greater than 0");
      }
      o->max_split_size = (size_t)(mb * GM_MIB);
      return GPUMEM_OK;
    }
  }
  return unknown_key(key, entry); /* not reached: every key has a case */
}

gpumem_status_t gpumem_options_parse(gpumem_options_t* opts, const char* conf) {
  if (!opts) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_options_parse: opts is NULL");
  if (!conf) return GPUMEM_OK;

  /* Work on a copy and commit only when every entry is good, so a typo
   * never leaves half a configuration applied. */
  gpumem_options_t next = *opts;
  const char* p = conf;
  for (;;) {
    const char* comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    span_t entry = trim(p, len);
    if (entry.n == 0) {
      /* The last entry may be empty: "" (nothing to do) or a trailing comma,
       * which PyTorch accepts too. Elsewhere an empty entry is a mistake. */
      if (!comma) break;
      return gm_fail(GPUMEM_ERR_CONFIG, "gpumem config: empty entry in \"%.*s\" (" PAIRS_HINT ")",
                     SHOWN(strlen(conf)), conf);
    }
    const char* colon = memchr(entry.p, ':', entry.n);
    if (!colon) {
      return gm_fail(GPUMEM_ERR_CONFIG,
                     "gpumem config: missing ':' in \"%.*s\" (" PAIRS_HINT
                     "); valid keys: " VALID_KEYS,
                     SHOWN(entry.n), entry.p);
    }
    span_t key = trim(entry.p, (size_t)(colon - entry.p));
    span_t value = trim(colon + 1, entry.n - (size_t)(colon - entry.p) - 1);
    if (key.n == 0) {
      return gm_fail(GPUMEM_ERR_CONFIG,
                     "gpumem config: empty key in \"%.*s\"; valid keys: " VALID_KEYS,
                     SHOWN(entry.n), entry.p);
    }
    gpumem_status_t st = apply(&next, key, value, entry);
    if (st != GPUMEM_OK) return st; /* a repeated key simply wins, as in PyTorch */
    if (!comma) break;
    p = comma + 1;
  }
  *opts = next;
  return GPUMEM_OK;
}
