/* The summary table and the JSON from a hand-filled stats snapshot: the rows
 * and keys the X-macro lists promise, the values put in, well-formed JSON,
 * and a failing sink that ends the output and has its value returned. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>

#include "gpumem.h"
#include "internal.h"
#include "test_util.h"

/* ---- a small JSON checker ----------------------------------------------- */

/* Validates strictly (RFC 8259 grammar, no trailing commas, no NaN) and
 * records every object member as "path" -> raw value text, where a nested
 * member's path is "outer/inner". */
enum { MAX_MEMBERS = 1024 };
typedef struct json {
  const char* p;
  const char* end;
  int members;
  char keys[MAX_MEMBERS][96];
  const char* val[MAX_MEMBERS];
  size_t val_len[MAX_MEMBERS];
  int duplicates;
} json_t;

static void ws(json_t* j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

static int lit(json_t* j, const char* word) {
  size_t n = strlen(word);
  if ((size_t)(j->end - j->p) < n || memcmp(j->p, word, n) != 0) return 0;
  j->p += n;
  return 1;
}

static int digits(json_t* j) {
  const char* s = j->p;
  while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
  return j->p > s;
}

static int number(json_t* j) {
  if (j->p < j->end && *j->p == '-') j->p++;
  if (j->p < j->end && *j->p == '0') {
    j->p++;
  } else if (!digits(j)) {
    return 0;
  }
  if (j->p < j->end && *j->p == '.') {
    j->p++;
    if (!digits(j)) return 0;
  }
  if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
    j->p++;
    if (j->p < j->end && (*j->p == '+' || *j->p == '-')) j->p++;
    if (!digits(j)) return 0;
  }
  return 1;
}

/* Copies the (escape-free, as ours are) string into out. */
static int string(json_t* j, char* out, size_t cap) {
  if (j->p >= j->end || *j->p != '"') return 0;
  j->p++;
  size_t n = 0;
  while (j->p < j->end && *j->p != '"') {
    unsigned char c = (unsigned char)*j->p;
    if (c < 0x20) return 0;
    if (c == '\\') {
      j->p++;
      if (j->p >= j->end || !strchr("\"\\/bfnrtu", *j->p)) return 0;
    }
    if (out && n + 1 < cap) out[n++] = (char)c;
    j->p++;
  }
  if (j->p >= j->end) return 0;
  j->p++;
  if (out) out[n] = '\0';
  return 1;
}

static int value(json_t* j, const char* path);

static int object(json_t* j, const char* path) {
  j->p++; /* '{' */
  ws(j);
  if (j->p < j->end && *j->p == '}') return j->p++, 1;
  for (;;) {
    char key[64], full[96];
    ws(j);
    if (!string(j, key, sizeof key)) return 0;
    snprintf(full, sizeof full, "%s%s%s", path, *path ? "/" : "", key);
    ws(j);
    if (!lit(j, ":")) return 0;
    ws(j);
    const char* start = j->p;
    if (!value(j, full)) return 0;
    if (j->members < MAX_MEMBERS) {
      for (int i = 0; i < j->members; i++) {
        if (strcmp(j->keys[i], full) == 0) j->duplicates++;
      }
      snprintf(j->keys[j->members], sizeof j->keys[0], "%s", full);
      j->val[j->members] = start;
      j->val_len[j->members] = (size_t)(j->p - start);
      j->members++;
    }
    ws(j);
    if (lit(j, "}")) return 1;
    if (!lit(j, ",")) return 0;
  }
}

static int array(json_t* j, const char* path) {
  j->p++; /* '[' */
  ws(j);
  if (lit(j, "]")) return 1;
  for (;;) {
    ws(j);
    if (!value(j, path)) return 0;
    ws(j);
    if (lit(j, "]")) return 1;
    if (!lit(j, ",")) return 0;
  }
}

static int value(json_t* j, const char* path) {
  if (j->p >= j->end) return 0;
  switch (*j->p) {
    case '{':
      return object(j, path);
    case '[':
      return array(j, path);
    case '"':
      return string(j, NULL, 0);
    case 't':
      return lit(j, "true");
    case 'f':
      return lit(j, "false");
    case 'n':
      return lit(j, "null");
    default:
      return number(j);
  }
}

/* Whole text must be exactly one object. */
static int json_parse(json_t* j, const char* text) {
  memset(j, 0, sizeof *j);
  j->p = text;
  j->end = text + strlen(text);
  ws(j);
  if (j->p >= j->end || *j->p != '{') return 0;
  if (!object(j, "")) return 0;
  ws(j);
  return j->p == j->end;
}

/* The raw value text of a member, or NULL. */
static const char* json_get(const json_t* j, const char* path, char* buf, size_t cap) {
  for (int i = 0; i < j->members; i++) {
    if (strcmp(j->keys[i], path) == 0) {
      snprintf(buf, cap, "%.*s", (int)j->val_len[i], j->val[i]);
      return buf;
    }
  }
  return NULL;
}

static void check_member(const json_t* j, const char* path, const char* want) {
  char buf[128];
  const char* got = json_get(j, path, buf, sizeof buf);
  CHECK_MSG(got && strcmp(got, want) == 0, "JSON %s: got %s, want %s", path, got ? got : "(none)",
            want);
}

static void check_member_i64(const json_t* j, const char* path, int64_t want) {
  char w[32];
  snprintf(w, sizeof w, "%" PRId64, want);
  check_member(j, path, w);
}

static void test_json_checker(void) {
  /* The checker itself must reject what it is there to catch. */
  json_t* j = malloc(sizeof *j);
  CHECK(json_parse(j, "{\"a\": 1, \"b\": {\"c\": [true, null, -1.5e3]}}"));
  CHECK(j->members == 3);
  const char* bad[] = {"{\"a\": 1,}",  "{\"a\": 1", "{\"a\" 1}",    "{\"a\": nan}", "{\"a\": 01}",
                       "{\"a\": inf}", "{} {}",     "{\"a\": \"x}", "[1]",          "{\"a\": 1.}"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK_MSG(!json_parse(j, bad[i]), "checker accepted %s", bad[i]);
  }
  free(j);
}

/* ---- the snapshot --------------------------------------------------------- */

/* Distinct, recognisable values for every statistic: array a, pool p, field
 * f gets (a+1)*1000 + p*100 + f (counts), and the byte arrays get larger
 * ones so the table switches units. */
static int64_t pattern(int a, int p, int f) {
  return (int64_t)(a + 1) * 1000 + p * 100 + f;
}

static void fill(gpumem_stats_t* s) {
  memset(s, 0, sizeof *s);
  s->struct_size = (uint32_t)sizeof *s;
  int a = 0;
#define FILL_ARRAY(name, title, is_bytes)       \
  for (int p = 0; p < GPUMEM_POOL_COUNT; p++) { \
    s->name[p].current = pattern(a, p, 0);      \
    s->name[p].peak = pattern(a, p, 1);         \
    s->name[p].allocated = pattern(a, p, 2);    \
    s->name[p].freed = pattern(a, p, 3);        \
  }                                             \
  a++;
  GPUMEM_STAT_ARRAYS(FILL_ARRAY)
#undef FILL_ARRAY
  int c = 0;
#define FILL_COUNTER(name, title) s->name = 11 * (++c);
  GPUMEM_STAT_COUNTERS(FILL_COUNTER)
#undef FILL_COUNTER

  /* Two rows set by hand to check torch's unit choice. */
  gpumem_stat_t* al = s->allocated_bytes;
  al[GPUMEM_POOL_ALL] = (gpumem_stat_t){12345 * 1024, (int64_t)2 << 30, (int64_t)5 << 40, 100};
  al[GPUMEM_POOL_LARGE] = (gpumem_stat_t){12000 * 1024, (int64_t)2 << 30, (int64_t)5 << 40, 60};
  al[GPUMEM_POOL_SMALL] = (gpumem_stat_t){345 * 1024, 0, 0, 40};
  gpumem_stat_t* n = s->allocation;
  n[GPUMEM_POOL_ALL] = (gpumem_stat_t){42, 800000, 2000000000, 7};
  n[GPUMEM_POOL_LARGE] = (gpumem_stat_t){40, 799999, 1999000000, 5};
  n[GPUMEM_POOL_SMALL] = (gpumem_stat_t){2, 1, 1000000, 2};

  s->num_ooms = 3;
  s->num_alloc_retries = 5;
  s->backend_calls[GPUMEM_CALL_map] = 17;
  s->backend_calls[GPUMEM_CALL_alloc] = 4;
  s->largest_free_block = 3 * (uint64_t)GM_GIB / 2;
  s->cached_free_bytes = 2 * (uint64_t)GM_GIB;
  s->fragmentation = 0.25;
  s->limit_bytes = 40 * (uint64_t)GM_GIB;
  s->device_total = 80 * (uint64_t)GM_GIB;
  s->device_free = 512 * (uint64_t)GM_MIB;
  s->page_size = 2 * (uint64_t)GM_MIB;
  s->policy = GPUMEM_POLICY_PYTORCH;
  s->virtual_memory = 1;
  s->max_split_size = 64 * (int64_t)GM_MIB;
}

/* ---- tests ----------------------------------------------------------------- */

static void test_format_bytes(void) {
  char b[32];
  const struct {
    uint64_t v;
    const char* want;
  } cases[] = {
      {0, "0 B"},
      {512, "512 B"},
      {1023, "1023 B"},
      {1024, "1.00 KiB"},
      {1536, "1.50 KiB"},
      {12939428, "12.34 MiB"},
      {3 * (uint64_t)GM_GIB / 2, "1.50 GiB"},
      {1048575, "1.00 MiB"}, /* 1023.999 KiB would print as 1024.00 KiB */
      {(uint64_t)1 << 40, "1.00 TiB"},
      {UINT64_MAX, "16.00 EiB"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char* got = gm_format_bytes(cases[i].v, b, sizeof b);
    CHECK_MSG(got == b && strcmp(got, cases[i].want) == 0, "%" PRIu64 ": got \"%s\", want \"%s\"",
              cases[i].v, got, cases[i].want);
  }
  char tiny[4];
  gm_format_bytes(12939428, tiny, sizeof tiny); /* truncates, never overflows */
  CHECK(strlen(tiny) == 3);
  CHECK(strcmp(gm_format_bytes(1, NULL, 0), "") == 0);
}

static void test_summary(void) {
  gpumem_stats_t s;
  fill(&s);
  sink_t out = {0};
  CHECK(gpumem_format_summary(&s, sink_write, &out) == 0);
  const char* t = out.text;
  CHECK(t != NULL);
  if (!t) return;

  /* Every line is torch's 77 columns wide, bars at both ends. */
  int lines = 0, bad_width = 0;
  for (const char* l = t; *l;) {
    const char* nl = strchr(l, '\n');
    CHECK(nl != NULL);
    if (!nl) break;
    if (nl - l != 77 || l[0] != '|' || nl[-1] != '|') {
      bad_width++;
      fprintf(stderr, "bad line: %.*s\n", (int)(nl - l), l);
    }
    lines++;
    l = nl + 1;
  }
  CHECK(bad_width == 0);
  CHECK(lines > 40);

  CHECK(strncmp(t,
                "|===========================================================================|\n"
                "|                           gpumem memory summary                           |\n"
                "|---------------------------------------------------------------------------|\n"
                "|            CUDA OOMs: 3            |        cudaMalloc retries: 5         |\n"
                "|===========================================================================|\n"
                "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n",
                6 * 78) == 0); /* six lines of 77 + '\n' */

  /* torch's units: chosen by the "all" value, shared by the pool rows. */
  CHECK(strstr(t,
               "| Allocated memory      |  12345 KiB |   2048 MiB |   5120 GiB |    100 B   |\n"
               "|       from large pool |  12000 KiB |   2048 MiB |   5120 GiB |     60 B   |\n"
               "|       from small pool |    345 KiB |      0 MiB |      0 GiB |     40 B   |\n"));
  CHECK(strstr(t,
               "| Allocations           |      42    |     800 K  |    2000 M  |       7    |\n"
               "|       from large pool |      40    |     799 K  |    1999 M  |       5    |\n"
               "|       from small pool |       2    |       0 K  |       1 M  |       2    |\n"));

  /* Every array of the list has its three rows, values from the pattern. */
  const char* last_bytes = NULL;
  const char* first_count = NULL;
  int a = 0;
#define CHECK_ROWS(name, title, is_bytes)                                                        \
  do {                                                                                           \
    char row[96];                                                                                \
    snprintf(row, sizeof row, "| %-21s | ", title);                                              \
    const char* at = strstr(t, row);                                                             \
    CHECK_MSG(at != NULL, "no row for %s", title);                                               \
    if (at) {                                                                                    \
      const char* nl = strchr(at, '\n');                                                         \
      CHECK(nl&& strncmp(nl + 1, "|       from large pool |", 25) == 0);                         \
      const char* nl2 = nl ? strchr(nl + 1, '\n') : NULL;                                        \
      CHECK(nl2&& strncmp(nl2 + 1, "|       from small pool |", 25) == 0);                       \
      if (a != 0 && a != 4) { /* the two rows set by hand are checked above */                   \
        char cell[32];                                                                           \
        snprintf(cell, sizeof cell, "%" PRId64 " %s", pattern(a, GPUMEM_POOL_LARGE, 1),          \
                 is_bytes ? "B  " : "  ");                                                       \
        CHECK_MSG(nl&& nl2&& strstr(nl, cell) && strstr(nl, cell) < nl2, "%s large peak \"%s\"", \
                  title, cell);                                                                  \
      }                                                                                          \
      if (is_bytes && (!last_bytes || at > last_bytes)) last_bytes = at;                         \
      if (!is_bytes && (!first_count || at < first_count)) first_count = at;                     \
    }                                                                                            \
    a++;                                                                                         \
  } while (0);
  GPUMEM_STAT_ARRAYS(CHECK_ROWS)
#undef CHECK_ROWS
  /* Memory rows come before count rows, as in torch. */
  CHECK(last_bytes && first_count && last_bytes < first_count);

  /* Counters, every one, with its value. */
#define CHECK_COUNTER(name, title)                                                    \
  do {                                                                                \
    char row[128];                                                                    \
    snprintf(row, sizeof row, "| %-52s | %18" PRId64 " |\n", title, (int64_t)s.name); \
    CHECK_MSG(strstr(t, row) != NULL, "counter row %s", row);                         \
  } while (0);
  GPUMEM_STAT_COUNTERS(CHECK_COUNTER)
#undef CHECK_COUNTER

  const char* kv[][2] = {
      {"Largest free block", "1.50 GiB"}, {"Cached free memory", "2.00 GiB"},
      {"Fragmentation", "25.00%"},        {"Limit", "40.00 GiB"},
      {"Device total", "80.00 GiB"},      {"Device free", "512.00 MiB"},
      {"Page size", "2.00 MiB"},          {"Policy", "pytorch"},
      {"Virtual memory", "yes"},          {"Backend calls: map", "17"},
      {"Backend calls: alloc", "4"},
  };
  for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++) {
    char row[128];
    snprintf(row, sizeof row, "| %-52s | %18s |\n", kv[i][0], kv[i][1]);
    CHECK_MSG(strstr(t, row) != NULL, "row %s", row);
  }
  /* Only the backend calls that happened are listed. */
  CHECK(strstr(t, "Backend calls: unmap") == NULL);
  CHECK(strstr(t, "Backend calls: reserve") == NULL);
  sink_free(&out);

  /* No limit, no calls, the other policy, no virtual memory, NaN. */
  memset(&s.backend_calls, 0, sizeof s.backend_calls);
  s.limit_bytes = 0;
  s.policy = GPUMEM_POLICY_DEFAULT;
  s.virtual_memory = 0;
  s.fragmentation = NAN;
  CHECK(gpumem_format_summary(&s, sink_write, &out) == 0);
  t = out.text ? out.text : "";
  CHECK(strstr(t, "| Limit                                                |               none |"));
  CHECK(strstr(t, "| Policy                                               |            default |"));
  CHECK(strstr(t, "| Virtual memory                                       |                 no |"));
  CHECK(strstr(t, "| Backend calls                                        |               none |"));
  CHECK(strstr(t, "| Fragmentation                                        |                n/a |"));
  sink_free(&out);
}

/* torch's abbreviated table: the full one less every "from ... pool" row. */
static void test_summary_abbreviated(void) {
  gpumem_stats_t s;
  fill(&s);
  sink_t full = {0}, same = {0}, brief = {0}, refused = {0};
  CHECK(gpumem_format_summary(&s, sink_write, &full) == 0);
  CHECK(gpumem_format_summary_flags(&s, 0, sink_write, &same) == 0);
  CHECK(full.text && same.text && strcmp(full.text, same.text) == 0);
  CHECK(gpumem_format_summary_flags(&s, GPUMEM_SUMMARY_ABBREVIATED, sink_write, &brief) == 0);
  const char* t = full.text ? full.text : "";
  char* want = calloc(strlen(t) + 1, 1);
  size_t n = 0, dropped = 0;
  for (const char* l = t; *l;) {
    const char* nl = strchr(l, '\n');
    size_t len = nl ? (size_t)(nl - l) + 1 : strlen(l);
    if (strncmp(l, "|       from ", 13) == 0) {
      dropped++;
    } else {
      memcpy(want + n, l, len);
      n += len;
    }
    l += len;
  }
#define COUNT_ARRAY(name, title, is_bytes) +1
  const size_t arrays = 0 GPUMEM_STAT_ARRAYS(COUNT_ARRAY);
#undef COUNT_ARRAY
  CHECK(dropped == 2 * arrays); /* two pool rows a metric */
  CHECK_MSG(brief.text && strcmp(brief.text, want) == 0, "abbreviated:\n%s",
            brief.text ? brief.text : "(none)");
  CHECK(brief.text &&
        strstr(brief.text,
               "| Allocated memory      |  12345 KiB |   2048 MiB |   5120 GiB |    100 B   |\n"
               "|-----"));
  /* An unknown flag is refused, and nothing is written. */
  CHECK(gpumem_format_summary_flags(&s, 2, sink_write, &refused) == GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(refused.text == NULL || refused.text[0] == '\0');
  free(want);
  sink_free(&full);
  sink_free(&same);
  sink_free(&brief);
  sink_free(&refused);
}

static void test_json(void) {
  gpumem_stats_t s;
  fill(&s);
  sink_t out = {0};
  CHECK(gpumem_format_stats_json(&s, sink_write, &out) == 0);
  const char* t = out.text ? out.text : "";
  CHECK(strstr(t, ",}") == NULL && strstr(t, ",\n}") == NULL);
  json_t* j = malloc(sizeof *j);
  CHECK_MSG(json_parse(j, t), "invalid JSON:\n%s", t);
  CHECK(j->duplicates == 0);

  static const char* const pools[] = {"all", "small_pool", "large_pool"};
  static const char* const types[] = {"current", "peak", "allocated", "freed"};
  int expected = 0;
#define CHECK_ARRAY_KEYS(name, title, is_bytes)                                   \
  for (int p = 0; p < GPUMEM_POOL_COUNT; p++) {                                   \
    const int64_t v[4] = {s.name[p].current, s.name[p].peak, s.name[p].allocated, \
                          s.name[p].freed};                                       \
    for (int f = 0; f < 4; f++) {                                                 \
      char key[96];                                                               \
      snprintf(key, sizeof key, "%s.%s.%s", #name, pools[p], types[f]);           \
      check_member_i64(j, key, v[f]);                                             \
      expected++;                                                                 \
    }                                                                             \
  }
  GPUMEM_STAT_ARRAYS(CHECK_ARRAY_KEYS)
#undef CHECK_ARRAY_KEYS
#define CHECK_COUNTER_KEY(name, title) \
  check_member_i64(j, #name, s.name);  \
  expected++;
  GPUMEM_STAT_COUNTERS(CHECK_COUNTER_KEY)
#undef CHECK_COUNTER_KEY

  /* torch's own spellings, spot-checked literally. */
  check_member(j, "allocated_bytes.all.current", "12641280");
  check_member(j, "allocated_bytes.small_pool.peak", "0");
  check_member(j, "allocated_bytes.large_pool.freed", "60");
  check_member(j, "allocation.all.allocated", "2000000000");
  check_member_i64(j, "reserved_bytes.large_pool.allocated", pattern(1 + 4, 2, 2));
  check_member(j, "num_alloc_retries", "5");
  check_member(j, "num_ooms", "3");

  check_member(j, "largest_free_block", "1610612736");
  check_member(j, "cached_free_bytes", "2147483648");
  check_member(j, "fragmentation", "0.25");
  check_member(j, "limit_bytes", "42949672960");
  check_member(j, "device_total", "85899345920");
  check_member(j, "device_free", "536870912");
  check_member(j, "page_size", "2097152");
  check_member(j, "policy", "\"pytorch\"");
  check_member(j, "virtual_memory", "true");
  expected += 10;
  /* The rest of torch's keys: max_split_size, and oversize counts of zero. */
  check_member(j, "max_split_size", "67108864");
  expected++;
  static const char* const oversize[] = {"oversize_allocations", "oversize_segments"};
  for (int i = 0; i < 2; i++) {
    for (int f = 0; f < 4; f++) {
      char key[96];
      snprintf(key, sizeof key, "%s/%s", oversize[i], types[f]);
      check_member(j, key, "0");
    }
    expected += 5; /* the object and its four members */
  }
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) {
    char key[64], want[32];
    snprintf(key, sizeof key, "backend_calls/%s", gpumem_backend_call_name(k));
    snprintf(want, sizeof want, "%" PRIu64, s.backend_calls[k]);
    check_member(j, key, want);
    expected++;
  }
  check_member(j, "backend_calls/map", "17");
  /* Nothing beyond what the lists and the extras define. */
  CHECK_MSG(j->members == expected, "%d members, want %d", j->members, expected);
  sink_free(&out);

  /* %.6g, and no NaN/inf in JSON. */
  s.fragmentation = 1.0 / 3.0;
  s.virtual_memory = 0;
  s.policy = GPUMEM_POLICY_DEFAULT;
  CHECK(gpumem_format_stats_json(&s, sink_write, &out) == 0);
  CHECK(json_parse(j, out.text ? out.text : ""));
  check_member(j, "fragmentation", "0.333333");
  check_member(j, "virtual_memory", "false");
  check_member(j, "policy", "\"default\"");
  sink_free(&out);
  s.max_split_size = -1; /* unset, as torch reports it */
  CHECK(gpumem_format_stats_json(&s, sink_write, &out) == 0);
  CHECK(json_parse(j, out.text ? out.text : ""));
  check_member(j, "max_split_size", "-1");
  sink_free(&out);
  const double odd[] = {NAN, INFINITY, -INFINITY};
  for (size_t i = 0; i < 3; i++) {
    s.fragmentation = odd[i];
    CHECK(gpumem_format_stats_json(&s, sink_write, &out) == 0);
    CHECK(json_parse(j, out.text ? out.text : ""));
    check_member(j, "fragmentation", "null");
    sink_free(&out);
  }
  s.fragmentation = 1e-7;
  s.policy = 99;
  CHECK(gpumem_format_stats_json(&s, sink_write, &out) == 0);
  CHECK(json_parse(j, out.text ? out.text : ""));
  check_member(j, "fragmentation", "1e-07");
  check_member(j, "policy", "\"unknown\"");
  sink_free(&out);

  /* An all-zero snapshot is valid too. */
  memset(&s, 0, sizeof s);
  CHECK(gpumem_format_stats_json(&s, sink_write, &out) == 0);
  CHECK(json_parse(j, out.text ? out.text : ""));
  sink_free(&out);
  free(j);
}

typedef int (*format_fn)(const gpumem_stats_t*, gpumem_write_fn, void*);

/* Failing at every possible call: the value comes back, nothing is written
 * after it, and what came before is the start of the full output. */
static void check_failing_sink(format_fn fn, const char* name) {
  gpumem_stats_t s;
  fill(&s);
  sink_t full = {0};
  CHECK(fn(&s, sink_write, &full) == 0);
  CHECK(full.calls > 10);
  for (int at = 1; at <= full.calls; at++) {
    sink_t part = {0};
    part.fail_at = at;
    part.fail_with = 40 + at;
    int rc = fn(&s, sink_write, &part);
    CHECK_MSG(rc == 40 + at, "%s failing at call %d returned %d", name, at, rc);
    CHECK_MSG(part.calls == at, "%s: %d calls after failing at %d", name, part.calls, at);
    CHECK(part.len == 0 || (part.len < full.len && memcmp(part.text, full.text, part.len) == 0));
    sink_free(&part);
  }
  /* Negative values are sink answers too. */
  sink_t neg = {0};
  neg.fail_at = 1;
  neg.fail_with = -5;
  CHECK(fn(&s, sink_write, &neg) == -5 && neg.calls == 1);
  sink_free(&full);
  sink_free(&neg);

  sink_t dummy = {0};
  CHECK(fn(NULL, sink_write, &dummy) == GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "stats") != NULL);
  CHECK(fn(&s, NULL, &dummy) == GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(dummy.calls == 0);
}

static void test_write_to_file(void) {
  FILE* f = tmpfile();
  CHECK(f != NULL);
  if (f) {
    CHECK(gpumem_write_to_file("hello ", 6, f) == 0);
    CHECK(gpumem_write_to_file("world", 5, f) == 0);
    CHECK(gpumem_write_to_file("", 0, f) == 0);
    gpumem_stats_t s;
    fill(&s);
    CHECK(gpumem_format_stats_json(&s, gpumem_write_to_file, f) == 0);
    rewind(f);
    char buf[16] = {0};
    CHECK(fread(buf, 1, 11, f) == 11);
    CHECK(strcmp(buf, "hello world") == 0);
    fclose(f);
  }
  CHECK(gpumem_write_to_file("x", 1, NULL) != 0);
  /* A stream that cannot be written: the failure reaches the caller. */
  FILE* ro = fopen("/dev/null", "r");
  if (ro) {
    CHECK(gpumem_write_to_file("x", 1, ro) == GPUMEM_ERR_IO);
    gpumem_stats_t s;
    fill(&s);
    CHECK(gpumem_format_summary(&s, gpumem_write_to_file, ro) == GPUMEM_ERR_IO);
    fclose(ro);
  }
}

int main(void) {
  test_json_checker();
  test_format_bytes();
  test_summary();
  test_summary_abbreviated();
  test_json();
  check_failing_sink(gpumem_format_summary, "summary");
  check_failing_sink(gpumem_format_stats_json, "json");
  test_write_to_file();
  return test_finish("test_stats_format");
}
