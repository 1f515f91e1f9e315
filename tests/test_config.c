/* Options defaults, GPUMEM_CONF parsing and byte sizes: every key, every
 * valid value, every error path, and that a failure leaves opts untouched
 * and names what was wrong. */
#include <stdint.h>

#include "gpumem.h"
#include "internal.h"
#include "test_util.h"

static int opts_equal(const gpumem_options_t* a, const gpumem_options_t* b) {
  /* Field by field: struct copies need not preserve padding bytes. */
  return a->struct_size == b->struct_size && a->policy == b->policy &&
         a->limit_bytes == b->limit_bytes && a->limit_fraction == b->limit_fraction &&
         a->reclaim == b->reclaim && a->headroom == b->headroom &&
         a->max_split_size == b->max_split_size && a->placement == b->placement &&
         a->own_backend == b->own_backend && a->map_max_bytes == b->map_max_bytes &&
         a->map_ahead_bytes == b->map_ahead_bytes && a->move_guard == b->move_guard &&
         a->stream_waits == b->stream_waits && a->publish == b->publish && a->lend == b->lend &&
         a->small_pool == b->small_pool;
}

/* A baseline that differs from the defaults everywhere, so "unchanged"
 * cannot pass by accident. */
static gpumem_options_t odd_options(void) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  o.policy = GPUMEM_POLICY_PYTORCH;
  o.limit_bytes = 12345;
  o.limit_fraction = 0.25;
  o.reclaim = GPUMEM_RECLAIM_EAGER;
  o.headroom = 0.75;
  o.max_split_size = 3 * GM_MIB;
  o.placement = GPUMEM_PLACEMENT_BESTFIT;
  o.own_backend = 1;
  o.map_max_bytes = 6 * GM_MIB;
  o.map_ahead_bytes = 7 * GM_MIB;
  o.move_guard = 0;
  o.stream_waits = 0;
  o.lend = 1;
  o.small_pool = 0;
  o.publish = GPUMEM_PUBLISH_OFF;
  return o;
}

static int contains(const char* hay, const char* needle) {
  return strstr(hay, needle) != NULL;
}

/* Parses conf over the defaults; the caller checks the result. */
static gpumem_options_t parse_ok(const char* conf) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, conf), GPUMEM_OK);
  return o;
}

/* Expects GPUMEM_ERR_CONFIG, opts unchanged, and each of the (up to three)
 * fragments in the message. */
static void parse_fails(const char* conf, const char* frag1, const char* frag2, const char* frag3) {
  gpumem_options_t o = odd_options();
  const gpumem_options_t before = o;
  gpumem_status_t st = gpumem_options_parse(&o, conf);
  CHECK_MSG(st == GPUMEM_ERR_CONFIG, "conf \"%s\": got %s", conf, gpumem_strerror(st));
  CHECK_MSG(opts_equal(&o, &before), "conf \"%s\" changed opts", conf);
  const char* msg = gpumem_last_error();
  const char* frags[] = {frag1, frag2, frag3};
  for (int i = 0; i < 3; i++) {
    if (frags[i]) {
      CHECK_MSG(contains(msg, frags[i]), "conf \"%s\": message lacks \"%s\": %s", conf, frags[i],
                msg);
    }
  }
  CHECK_MSG(contains(msg, "gpumem config: "), "message prefix: %s", msg);
}

static void test_defaults(void) {
  gpumem_options_t o;
  memset(&o, 0xab, sizeof o);
  gpumem_options_init(&o);
  CHECK(o.struct_size == sizeof(gpumem_options_t));
  CHECK(o.policy == GPUMEM_POLICY_DEFAULT);
  CHECK(o.limit_bytes == 0);
  CHECK(o.limit_fraction == 0.0);
  CHECK(o.reclaim == GPUMEM_RECLAIM_LAZY);
  CHECK(o.headroom == 0.02);
  CHECK(o.move_budget_us == 0.0);
  CHECK(o.max_split_size == 0);
  CHECK(o.placement == GPUMEM_PLACEMENT_AUTO);
  CHECK(o.own_backend == 0);
  CHECK(o.map_max_bytes == GM_GIB);
  CHECK(o.map_ahead_bytes == 128 * GM_MIB);
  CHECK(o.move_guard == 1);
  CHECK(o.stream_waits == 1);
  CHECK(o.lend == 0);
  CHECK(o.small_pool == 1);
  CHECK(o.publish == GPUMEM_PUBLISH_AUTO);
  gpumem_options_init(NULL); /* must not crash */
}

static void test_empty_and_null(void) {
  CHECK_STATUS(gpumem_options_parse(NULL, "policy:pytorch"), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK(contains(gpumem_last_error(), "opts"));
  CHECK_STATUS(gpumem_options_parse(NULL, NULL), GPUMEM_ERR_INVALID_ARGUMENT);

  const char* nothing[] = {NULL, "", "   ", " \t\n "};
  for (size_t i = 0; i < sizeof nothing / sizeof nothing[0]; i++) {
    gpumem_options_t o = odd_options();
    const gpumem_options_t before = o;
    CHECK_STATUS(gpumem_options_parse(&o, nothing[i]), GPUMEM_OK);
    CHECK(opts_equal(&o, &before));
  }
}

static void test_policy(void) {
  CHECK(parse_ok("policy:default").policy == GPUMEM_POLICY_DEFAULT);
  CHECK(parse_ok("policy:pytorch").policy == GPUMEM_POLICY_PYTORCH);
  CHECK(parse_ok("policy:PyTorch").policy == GPUMEM_POLICY_PYTORCH);
  CHECK(parse_ok("  policy  :  pytorch  ").policy == GPUMEM_POLICY_PYTORCH);
  gpumem_options_t o = odd_options();
  CHECK_STATUS(gpumem_options_parse(&o, "policy:default"), GPUMEM_OK);
  CHECK(o.policy == GPUMEM_POLICY_DEFAULT);

  parse_fails("policy:torch", "bad value \"torch\" for key \"policy\"", "default, pytorch", NULL);
  parse_fails("policy:", "bad value \"\" for key \"policy\"", NULL, NULL);
  parse_fails("policy:pytorch:x", "\"pytorch:x\"", NULL, NULL);
}

static void test_reclaim(void) {
  CHECK(parse_ok("reclaim:lazy").reclaim == GPUMEM_RECLAIM_LAZY);
  CHECK(parse_ok("reclaim:eager").reclaim == GPUMEM_RECLAIM_EAGER);
  CHECK(parse_ok("reclaim:pressure").reclaim == GPUMEM_RECLAIM_PRESSURE);
  CHECK(parse_ok("reclaim:EAGER").reclaim == GPUMEM_RECLAIM_EAGER);
  parse_fails("reclaim:sometimes", "bad value \"sometimes\" for key \"reclaim\"",
              "lazy, eager, pressure", NULL);
}

static void test_placement(void) {
  CHECK(parse_ok("placement:planned").placement == GPUMEM_PLACEMENT_PLANNED);
  CHECK(parse_ok("placement:bestfit").placement == GPUMEM_PLACEMENT_BESTFIT);
  CHECK(parse_ok("placement:PLANNED").placement == GPUMEM_PLACEMENT_PLANNED);
  CHECK(parse_ok("placement:auto").placement == GPUMEM_PLACEMENT_AUTO);
  CHECK(parse_ok("move_budget:0").move_budget_us == 0.0);
  CHECK(parse_ok("move_budget:2.5").move_budget_us == 2.5);
  CHECK(parse_ok("move_budget:unlimited").move_budget_us < 0);
  CHECK(parse_ok("move_budget:Unlimited").move_budget_us < 0);
  parse_fails("move_budget:-1", "bad value \"-1\" for key \"move_budget\"", "unlimited", NULL);
  parse_fails("move_budget:fast", "\"fast\"", "microseconds", NULL);
  parse_fails("move_budget:2e6", "\"2e6\"", "1e6", NULL);
  parse_fails("placement:first_fit", "bad value \"first_fit\" for key \"placement\"",
              "planned, bestfit", NULL);
  parse_fails("placment:planned", "unknown key \"placment\"", "did you mean \"placement\"", NULL);
}

static void test_stream_waits(void) {
  CHECK(parse_ok("stream_waits:off").stream_waits == 0);
  CHECK(parse_ok("stream_waits:on").stream_waits == 1);
  parse_fails("stream_waits:1", "bad value \"1\" for key \"stream_waits\"", "on, off", NULL);
  CHECK(parse_ok("lend:off").lend == 0);
  CHECK(parse_ok("lend:on").lend == GPUMEM_LEND_ON);
  CHECK(parse_ok("lend:ordered").lend == GPUMEM_LEND_ORDERED);
  CHECK(parse_ok("small_pool:off").small_pool == 0);
  CHECK(parse_ok("small_pool:on").small_pool == 1);
  parse_fails("small_pool:shared", "bad value \"shared\" for key \"small_pool\"", "on, off", NULL);
  parse_fails("lend:0", "bad value \"0\" for key \"lend\"", "off, on, ordered", NULL);
  parse_fails("stream_wait:off", "unknown key \"stream_wait\"", "did you mean \"stream_waits\"",
              NULL);
}

static void test_publish(void) {
  CHECK(parse_ok("publish:on").publish == GPUMEM_PUBLISH_ON);
  CHECK(parse_ok("publish:off").publish == GPUMEM_PUBLISH_OFF);
  CHECK(parse_ok("publish:auto").publish == GPUMEM_PUBLISH_AUTO);
  parse_fails("publish:yes", "bad value \"yes\" for key \"publish\"", "auto, on, off", NULL);
  parse_fails("publsh:on", "unknown key \"publsh\"", "did you mean \"publish\"", NULL);
}

static void test_fences(void) {
  CHECK(parse_ok("").fences == 1);
  CHECK(parse_ok("fences:off").fences == 0);
  CHECK(parse_ok("fences:on").fences == 1);
  parse_fails("fences:maybe", "bad value \"maybe\" for key \"fences\"", "on, off", NULL);
}

static void test_move_guard(void) {
  CHECK(parse_ok("move_guard:off").move_guard == 0);
  CHECK(parse_ok("move_guard:on").move_guard == 1);
  CHECK(parse_ok("move_guard:OFF").move_guard == 0);
  parse_fails("move_guard:no", "bad value \"no\" for key \"move_guard\"", "on, off", NULL);
  parse_fails("move_gaurd:off", "unknown key \"move_gaurd\"", "did you mean \"move_guard\"", NULL);
}

static void test_limit(void) {
  CHECK(parse_ok("limit:40G").limit_bytes == (size_t)40 * GM_GIB);
  CHECK(parse_ok("limit:1.5G").limit_bytes == (size_t)3 * GM_GIB / 2);
  CHECK(parse_ok("limit:512MB").limit_bytes == 512 * GM_MIB);
  CHECK(parse_ok("limit:2GiB").limit_bytes == 2 * GM_GIB);
  CHECK(parse_ok("limit:123").limit_bytes == 123);
  CHECK(parse_ok("limit: 4 K ").limit_bytes == 4096);
  /* A zero limit would refuse everything: an error, not "no limit". */
  parse_fails("limit:0", "bad value \"0\" for key \"limit\"", "leave the key out", NULL);

  parse_fails("limit:lots", "bad value \"lots\" for key \"limit\"", "4K", NULL);
  parse_fails("limit:-1G", "\"-1G\"", "negative", NULL);
  parse_fails("limit:4X", "\"4X\"", "unexpected characters", NULL);
  parse_fails("limit:", "bad value \"\" for key \"limit\"", NULL, NULL);
#if SIZE_MAX == UINT64_MAX
  parse_fails("limit:16777216T", "\"16777216T\"", "too large", NULL);
#endif
}

static void test_fraction(void) {
  CHECK(parse_ok("fraction:0.9").limit_fraction == 0.9);
  CHECK(parse_ok("fraction:1").limit_fraction == 1.0);
  CHECK(parse_ok("fraction:1.0").limit_fraction == 1.0);
  CHECK(parse_ok("fraction:.5").limit_fraction == 0.5);
  CHECK(parse_ok("fraction:0.000001").limit_fraction == 0.000001);
  CHECK(parse_ok("fraction:1e-1").limit_fraction == 0.1);
  CHECK(parse_ok("fraction:25E-2").limit_fraction == 0.25);
  CHECK(parse_ok("fraction:0.30000000000000000000001").limit_fraction == 0.3);
  CHECK(parse_ok("fraction:0.1").limit_bytes == 0);

  const char* bad[] = {"0",   "0.0",  "1.01", "2",   "-0.5", "+0.5", "x",      "",      "nan",
                       "inf", "0.5x", "1e",   "1e+", ".",    "0,5",  "0x1p-1", "1e999", "1e-999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char conf[64], frag[64];
    snprintf(conf, sizeof conf, "fraction:%s", bad[i]);
    snprintf(frag, sizeof frag, "bad value \"%s\" for key \"fraction\"", bad[i]);
    /* "0,5" splits at the comma: "fraction:0" is the bad entry. */
    parse_fails(conf, strcmp(bad[i], "0,5") == 0 ? "bad value \"0\"" : frag,
                "expected a number in (0, 1]", NULL);
  }
  /* The brief's exact example. */
  parse_fails("fraction:x",
              "gpumem config: bad value \"x\" for key \"fraction\": expected a number in (0, 1]",
              NULL, NULL);
}

static void test_headroom(void) {
  CHECK(parse_ok("headroom:0").headroom == 0.0);
  CHECK(parse_ok("headroom:1").headroom == 1.0);
  CHECK(parse_ok("headroom:0.5").headroom == 0.5);
  CHECK(parse_ok("headroom:0.002").headroom == 0.002);
  CHECK(parse_ok("headroom:0.0").headroom == 0.0);
  parse_fails("headroom:1.5", "bad value \"1.5\" for key \"headroom\"", "[0, 1]", NULL);
  parse_fails("headroom:-0.1", "\"-0.1\"", "[0, 1]", NULL);
  parse_fails("headroom:abc", "\"abc\"", "headroom", NULL);
}

static void test_map_max(void) {
  CHECK(parse_ok("map_max:2M").map_max_bytes == 2 * GM_MIB);
  CHECK(parse_ok("map_max:1G").map_max_bytes == GM_GIB);
  CHECK(parse_ok("map_max:0").map_max_bytes == 0);
  parse_fails("map_max:lots", "bad value \"lots\" for key \"map_max\"", "1.5G", NULL);
  parse_fails("map_max:-1M", "\"-1M\"", "map_max", NULL);
  CHECK(parse_ok("map_ahead:64M").map_ahead_bytes == 64 * GM_MIB);
  CHECK(parse_ok("map_ahead:off").map_ahead_bytes == 0);
  CHECK(parse_ok("map_ahead:0").map_ahead_bytes == 0);
  parse_fails("map_ahead:lots", "bad value \"lots\" for key \"map_ahead\"", "1.5G", NULL);
  parse_fails("map_ahead:on", "bad value \"on\" for key \"map_ahead\"", "1.5G", NULL);
}

static void test_max_split_size(void) {
  CHECK(parse_ok("max_split_size_mb:512").max_split_size == 512 * GM_MIB);
  CHECK(parse_ok("max_split_size_mb:1").max_split_size == GM_MIB);
  CHECK(parse_ok("max_split_size_mb: 64 ").max_split_size == 64 * GM_MIB);
  const char* bad[] = {"0", "-1", "1.5", "512MB", "", "x", "99999999999999999999", "+5"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char conf[64], frag[80];
    snprintf(conf, sizeof conf, "max_split_size_mb:%s", bad[i]);
    snprintf(frag, sizeof frag, "bad value \"%s\" for key \"max_split_size_mb\"", bad[i]);
    parse_fails(conf, frag, "MiB", NULL);
  }
#if SIZE_MAX == UINT64_MAX
  /* 2^44 MiB is 2^64 bytes: one too many. */
  parse_fails("max_split_size_mb:17592186044416", "\"17592186044416\"", NULL, NULL);
  CHECK(parse_ok("max_split_size_mb:17592186044415").max_split_size ==
        (size_t)17592186044415u * GM_MIB);
#endif
}

static void test_combined(void) {
  gpumem_options_t o = parse_ok(
      "policy:pytorch,limit:4G,fraction:0.5,reclaim:eager,headroom:0.1,max_split_size_mb:256,"
      "placement:planned");
  CHECK(o.policy == GPUMEM_POLICY_PYTORCH);
  CHECK(o.limit_bytes == 4 * GM_GIB);
  CHECK(o.limit_fraction == 0.5);
  CHECK(o.reclaim == GPUMEM_RECLAIM_EAGER);
  CHECK(o.headroom == 0.1);
  CHECK(o.max_split_size == 256 * GM_MIB);
  CHECK(o.placement == GPUMEM_PLACEMENT_PLANNED);
  CHECK(o.struct_size == sizeof(gpumem_options_t));
  CHECK(o.own_backend == 0);

  /* Whitespace everywhere, a trailing comma (PyTorch accepts one). */
  o = parse_ok(" policy : pytorch , limit : 1G ,");
  CHECK(o.policy == GPUMEM_POLICY_PYTORCH && o.limit_bytes == GM_GIB);

  /* Repeated keys: the last one wins. */
  CHECK(parse_ok("limit:1G,limit:2G").limit_bytes == 2 * GM_GIB);
  CHECK(parse_ok("policy:pytorch,policy:default").policy == GPUMEM_POLICY_DEFAULT);

  /* Keys not mentioned keep their values. */
  o = odd_options();
  CHECK_STATUS(gpumem_options_parse(&o, "reclaim:lazy"), GPUMEM_OK);
  CHECK(o.reclaim == GPUMEM_RECLAIM_LAZY && o.policy == GPUMEM_POLICY_PYTORCH &&
        o.limit_bytes == 12345 && o.headroom == 0.75 && o.own_backend == 1);
}

static void test_structure_errors(void) {
  /* The brief's exact example, with the spelling hint after it. */
  parse_fails("polcy:pytorch",
              "gpumem config: unknown key \"polcy\" in \"polcy:pytorch\"; valid keys: policy, "
              "limit, fraction, reclaim, headroom, max_split_size_mb, placement",
              "did you mean \"policy\"", NULL);
  parse_fails("Policy:pytorch", "unknown key \"Policy\"", "did you mean \"policy\"", NULL);
  parse_fails("max_split_size:512", "unknown key \"max_split_size\"",
              "did you mean \"max_split_size_mb\"", NULL);
  parse_fails("expandable_segments:True", "unknown key \"expandable_segments\"", "valid keys",
              NULL);
  CHECK(!contains(gpumem_last_error(), "did you mean"));

  parse_fails("policy", "missing ':' in \"policy\"", "valid keys: policy", NULL);
  parse_fails("limit:1G,pytorch", "missing ':' in \"pytorch\"", NULL, NULL);
  parse_fails(":pytorch", "empty key in \":pytorch\"", "valid keys", NULL);
  parse_fails("  : 1G", "empty key", NULL, NULL);
  parse_fails(",policy:pytorch", "empty entry", NULL, NULL);
  parse_fails("policy:pytorch,,limit:1G", "empty entry", NULL, NULL);
  parse_fails("policy:pytorch, ,limit:1G", "empty entry", NULL, NULL);
  parse_fails(",", "empty entry", NULL, NULL);

  /* A good entry before a bad one is not applied either. */
  parse_fails("policy:default,limit:1G,reclaim:lazy,fraction:2", "\"fraction\"", NULL, NULL);
  parse_fails("limit:1G,limit:abc", "\"abc\"", NULL, NULL);

  /* A huge key is cut in the message, which still lists the valid keys. */
  char big[5000];
  memset(big, 'k', sizeof big);
  memcpy(big + sizeof big - 4, ":1G", 4);
  parse_fails(big, "unknown key", "valid keys: policy", NULL);
}

static void check_size(const char* text, uint64_t want) {
  size_t got = 7;
  gpumem_status_t st = gpumem_parse_size(text, &got);
  CHECK_MSG(st == GPUMEM_OK && (uint64_t)got == want, "\"%s\": status %s, got %zu, want %llu (%s)",
            text, gpumem_strerror(st), got, (unsigned long long)want, gpumem_last_error());
}

static void check_bad_size(const char* text, const char* frag) {
  size_t got = 7;
  gpumem_status_t st = gpumem_parse_size(text, &got);
  CHECK_MSG(st == GPUMEM_ERR_INVALID_ARGUMENT, "\"%s\": got %s", text, gpumem_strerror(st));
  CHECK_MSG(got == 7, "\"%s\": out changed on failure", text);
  const char* msg = gpumem_last_error();
  CHECK_MSG(contains(msg, "bad size"), "\"%s\": %s", text, msg);
  if (frag) CHECK_MSG(contains(msg, frag), "\"%s\": message lacks \"%s\": %s", text, frag, msg);
}

static void test_parse_size(void) {
  check_size("0", 0);
  check_size("123", 123);
  check_size("10B", 10);
  check_size("10b", 10);
  const char* kib[] = {"4K", "4k", "4KB", "4kb", "4KiB", "4kib", "4Ki", "4ki", " 4 K ", "4 KiB"};
  for (size_t i = 0; i < sizeof kib / sizeof kib[0]; i++) check_size(kib[i], 4096);
  check_size("3M", 3 * (uint64_t)GM_MIB);
  check_size("512MB", 512 * (uint64_t)GM_MIB);
  check_size("2GiB", 2 * (uint64_t)GM_GIB);
  check_size("2g", 2 * (uint64_t)GM_GIB);
  check_size("1.5G", 1610612736u);
  check_size("0.5K", 512);
  check_size(".5K", 512);
  check_size("1.K", 1024);
  check_size("0.1K", 102); /* 102.4 bytes, rounded down */
  check_size("1.5", 1);
  check_size("0.25M", 262144);
  check_size("1.0000000000000000000000000000001K", 1024);
  check_size("0.99999999999999999999999999K", 1023);
  check_size("007", 7);
#if SIZE_MAX == UINT64_MAX
  check_size("1T", (uint64_t)1 << 40);
  check_size("2.5t", (uint64_t)5 << 39);
  check_size("18446744073709551615", UINT64_MAX);
  check_size("16777215T", UINT64_MAX - ((uint64_t)1 << 40) + 1);
  check_size("16777215.5T", UINT64_MAX - ((uint64_t)1 << 40) + 1 + ((uint64_t)1 << 39));
  check_size("17179869183.99999999999G", UINT64_MAX - (uint64_t)GM_GIB + 1 + 1073741823u);
  check_bad_size("18446744073709551616", "too large");
  check_bad_size("99999999999999999999999999", "too large");
  check_bad_size("16777216T", "too large");
  check_bad_size("17179869184G", "too large");
#endif
  check_bad_size("", "empty");
  check_bad_size("   ", "empty");
  check_bad_size("-1", "negative");
  check_bad_size("-0", "negative");
  check_bad_size("+1", NULL);
  check_bad_size("abc", "not a number");
  check_bad_size("K", "not a number");
  check_bad_size(".", "not a number");
  check_bad_size("1e9", "unexpected characters");
  check_bad_size("1.2.3", "unexpected characters");
  check_bad_size("1KK", "unexpected characters");
  check_bad_size("1iB", "unexpected characters");
  check_bad_size("1KiBs", "unexpected characters");
  check_bad_size("1BB", "unexpected characters");
  check_bad_size("1P", "unexpected characters");
  check_bad_size("0x10", "unexpected characters");
  check_bad_size("1,5G", "unexpected characters");
  check_bad_size("1 2", "unexpected characters");
  check_bad_size("inf", NULL);
  check_bad_size("lots", "\"lots\"");

  size_t out = 0;
  CHECK_STATUS(gpumem_parse_size(NULL, &out), GPUMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(gpumem_parse_size("1K", NULL), GPUMEM_ERR_INVALID_ARGUMENT);
}

int main(void) {
  test_defaults();
  test_empty_and_null();
  test_policy();
  test_reclaim();
  test_placement();
  test_move_guard();
  test_fences();
  test_stream_waits();
  test_publish();
  test_limit();
  test_fraction();
  test_headroom();
  test_map_max();
  test_max_split_size();
  test_combined();
  test_structure_errors();
  test_parse_size();
  return test_finish("test_config");
}
