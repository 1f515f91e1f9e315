/* gpumem report: one self-contained HTML page about a recorded job, made on
 * the simulated device: live and reserved bytes over the trace under both
 * policies (an inline SVG chart, no script), the smallest limit it fits in
 * (--min-limit), where the reserved bytes beyond the live ones sit at the
 * peak, the largest allocations alive at the peak and what the trace leaves
 * live at its end, each with the trace lines that made them, and with
 * --memory (or --min-limit) the allocator table of `gpumem fit`.
 * Everything in it comes from replays made here; nothing is estimated. */
#include "commands.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpumem.h"
#include "cli.h"
#include "reader.h"
#include "show.h"
#include "fit.h"
#include "internal.h" /* gm_format_bytes, gm_print_leak_table */
#include "replay.h"
#include "trace.h"

static const char usage_report[] =
    "usage: gpumem report [options] TRACE\n"
    "\n"
    "Replays TRACE on the simulated device under the default and the pytorch\n"
    "policies and writes one HTML page (no script, no external file): live and\n"
    "reserved bytes over the trace, where the bytes beyond the live ones sit at\n"
    "the peak, the largest allocations alive then and what the trace leaves live\n"
    "at its end, with the trace lines that made them. With --memory SIZE, also\n"
    "the table of 'gpumem fit --memory SIZE' (with --min-limit alone, the same\n"
    "table without its fits column).\n"
    "\n"
    "options:\n"
    "  -o FILE                   write the page to FILE (default: standard output)\n"
    "  --conf STRING             configuration of the default policy's allocator\n"
    "                            (GPUMEM_CONF grammar), over GPUMEM_CONF's keys\n"
    "  --min-limit               also bisect the smallest limit each policy fits in\n"
    "                            (a cold replay per probe: seconds on large traces)\n"
    "                            and each allocator's in the table\n"
    "  --memory SIZE             the device memory to fit in (e.g. 80G): for each\n"
    "                            allocator a PyTorch user can choose and for gpumem's\n"
    "                            settings, whether the job fits, its peak reserved\n"
    "                            memory and the smallest memory it needs (fixed\n"
    "                            settings: --conf does not change these rows)\n"
    "  -h, --help                this text\n";

enum { BUCKETS = 800, TOP_GROUPS = 12 };

/* One policy's replay: the chart's series and its figures. */
typedef struct run {
  const char* name;
  uint64_t reserved_max[BUCKETS]; /* per bucket of events */
  uint64_t peak_reserved;
  size_t peak_event; /* first event after which reserved memory was at its peak */
  uint64_t creates, maps, unmaps;
  int oom;
  size_t oom_event;
  size_t min_limit; /* 0: not asked or not found */
  double min_limit_ratio;
} run_t;

typedef struct page {
  FILE* out;
  const trace_t* t;
  uint64_t live_max[BUCKETS];
  run_t runs[2];
  gpumem_explain_t at_peak; /* default policy */
  char* peak_groups;        /* text reports (gpumem_print_leaks) */
  char* end_groups;
  fit_result_t* fit; /* one per fit_rows entry; NULL: the table was not asked for */
  size_t memory;     /* the device memory of the table's fits column; 0: none */
} page_t;

static size_t bucket_of(const trace_t* t, size_t event) {
  return t->num_events ? event * BUCKETS / t->num_events : 0;
}

/* The largest groups of gm's live allocations (tags: trace lines): a
 * sentence, then the table of the leak report, its first TOP_GROUPS
 * groups and a line for the rest. */
static char* live_groups(gpumem_t* gm) {
  gm_text_t table = {NULL, 0, 0}, t = {NULL, 0, 0};
  gpumem_leaks_t sum;
  char b[32], head[160];
  if (gm_print_leak_table(gm, 0, TOP_GROUPS, &sum, gm_text_write, &table) != 0) {
    free(table.s);
    return NULL;
  }
  int n = snprintf(head, sizeof head, "%llu allocations, %s, in %llu groups\n",
                   (unsigned long long)sum.count, gm_format_bytes(sum.bytes, b, sizeof b),
                   (unsigned long long)sum.groups);
  if (gm_text_write(head, (size_t)n, &t) != 0 ||
      (sum.count && gm_text_write(table.s, table.len, &t) != 0)) {
    free(t.s);
    t.s = NULL;
  }
  free(table.s);
  return t.s;
}

/* Events [0, stop) of the trace on gm, tagged with their lines; fills the
 * series of r (and p's live series when live is set). Returns 0, or 1 when
 * the backend refused something other than memory. */
static int run_events(gpumem_t* gm, const trace_t* t, size_t stop, void** slots, run_t* r,
                      uint64_t* live) {
  for (size_t i = 0; i < stop; i++) {
    gpumem_status_t st = replay_event_tagged(gm, t, i, slots);
    if (st != GPUMEM_OK) {
      if (st != GPUMEM_ERR_OUT_OF_MEMORY) return 1;
      if (r && !r->oom) r->oom = 1, r->oom_event = i;
      continue;
    }
    bool alloc = t->events[i].op == TRACE_ALLOC;
    if (!alloc && !(live && t->events[i].op == TRACE_FREE)) continue;
    /* reserved memory grows only at allocations; live bytes fall at frees */
    gpumem_stats_t now;
    gpumem_get_stats(gm, &now);
    uint64_t reserved = (uint64_t)now.reserved_bytes[GPUMEM_POOL_ALL].current;
    uint64_t requested = (uint64_t)now.requested_bytes[GPUMEM_POOL_ALL].current;
    size_t b = bucket_of(t, i);
    if (alloc && r && reserved > r->reserved_max[b]) r->reserved_max[b] = reserved;
    if (alloc && r && reserved > r->peak_reserved) r->peak_reserved = reserved, r->peak_event = i;
    if (live && requested > live[b]) live[b] = requested;
  }
  return 0;
}

/* One replay under policy (conf for the default one); the default one also
 * gives the end-of-trace groups. */
static int replay_policy(page_t* p, int which, const char* conf, int min_limit, void** slots) {
  run_t* r = &p->runs[which];
  replay_config_t cfg;
  replay_config_init(&cfg);
  cfg.conf = which == 0 ? conf : NULL;
  cfg.policy = which == 0 ? GPUMEM_POLICY_DEFAULT : GPUMEM_POLICY_PYTORCH;
  cfg.policy_set = which == 1;
  cfg.warm_passes = 0;
  gpumem_options_t opts;
  gpumem_t* gm = NULL;
  if (replay_options(&cfg, p->t, &opts) != GPUMEM_OK || replay_open(&cfg, &opts, &gm) != GPUMEM_OK)
    return 1;
  r->name = replay_policy_name(opts.policy);
  memset(slots, 0, p->t->num_allocs * sizeof *slots);
  int rc = run_events(gm, p->t, p->t->num_events, slots, r, which == 0 ? p->live_max : NULL);
  gpumem_stats_t st;
  gpumem_get_stats(gm, &st);
  r->creates = (uint64_t)st.backend_calls[GPUMEM_CALL_create_page] +
               (uint64_t)st.backend_calls[GPUMEM_CALL_alloc];
  r->maps = (uint64_t)st.backend_calls[GPUMEM_CALL_map];
  r->unmaps = (uint64_t)st.backend_calls[GPUMEM_CALL_unmap];
  if (which == 0 && rc == 0) p->end_groups = live_groups(gm);
  gpumem_destroy(gm);
  if (rc != 0) return rc;
  if (min_limit) {
    replay_result_t* res = malloc(sizeof *res);
    if (!res) return 1;
    replay_result_init(res, p->t);
    if (replay_min_limit(p->t, &cfg, res) == GPUMEM_OK && res->min_limit_found) {
      r->min_limit = res->min_limit_bytes;
      r->min_limit_ratio = res->min_limit_ratio;
    }
    free(res);
  }
  if (which != 0) return 0;
  /* Again up to the peak: where the bytes sit then, and who holds them. */
  if (replay_open(&cfg, &opts, &gm) != GPUMEM_OK) return 1;
  memset(slots, 0, p->t->num_allocs * sizeof *slots);
  rc = run_events(gm, p->t, r->peak_event + 1, slots, NULL, NULL);
  if (rc == 0) {
    gpumem_explain(gm, &p->at_peak);
    p->peak_groups = live_groups(gm);
  }
  gpumem_destroy(gm);
  return rc;
}

/* ---- HTML ---- */

static void put_escaped(FILE* f, const char* s) {
  for (; s && *s; s++) {
    if (*s == '<')
      fputs("&lt;", f);
    else if (*s == '>')
      fputs("&gt;", f);
    else if (*s == '&')
      fputs("&amp;", f);
    else if (*s == '"')
      fputs("&quot;", f);
    else
      fputc(*s, f);
  }
}

static const char* bytes(uint64_t n, char* buf, size_t len) {
  return gm_format_bytes(n, buf, len);
}

#define GIB 1073741824.0

static const char* const colors[3] = {"#2b6cb0", "#c05621", "#2f855a"}; /* default, pytorch, live */

static void chart(page_t* p) {
  FILE* f = p->out;
  const double w = 960, h = 360, left = 70, right = 20, top = 34, bottom = 40;
  uint64_t ymax = 1;
  for (int k = 0; k < 2; k++)
    for (int b = 0; b < BUCKETS; b++)
      if (p->runs[k].reserved_max[b] > ymax) ymax = p->runs[k].reserved_max[b];
  ymax += ymax / 20;
  fprintf(f, "<svg viewBox=\"0 0 %.0f %.0f\" width=\"%.0f\" height=\"%.0f\" role=\"img\">\n", w, h,
          w, h);
  fprintf(f,
          "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"#fafafa\" "
          "stroke=\"#ccc\"/>\n",
          left, top, w - left - right, h - top - bottom);
  char b1[32];
  for (int k = 0; k <= 4; k++) { /* horizontal grid, labelled in bytes */
    double y = top + (h - top - bottom) * (1.0 - k / 4.0);
    fprintf(f, "<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#e2e2e2\"/>", left,
            w - right, y, y);
    fprintf(f, "<text x=\"%.0f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">%s</text>\n",
            left - 6, y + 4, bytes(ymax / 4 * (uint64_t)k, b1, sizeof b1));
  }
  fprintf(f,
          "<text x=\"%.0f\" y=\"%.0f\" font-size=\"11\" text-anchor=\"middle\">events of the "
          "trace (%zu)</text>\n",
          (left + w - right) / 2, h - 10, p->t->num_events);
  for (int s = 0; s < 3; s++) {
    const uint64_t* v = s < 2 ? p->runs[s].reserved_max : p->live_max;
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"", colors[s]);
    uint64_t last = 0;
    for (int b = 0; b < BUCKETS; b++) {
      if (v[b]) last = v[b]; /* a bucket without allocations keeps the level */
      double x = left + (w - left - right) * (b + 0.5) / BUCKETS;
      double y = top + (h - top - bottom) * (1.0 - (double)last / (double)ymax);
      fprintf(f, "%.1f,%.1f ", x, y);
    }
    fprintf(f, "\"/>\n");
  }
  for (int k = 0; k < 2; k++) { /* the min limits, dashed */
    if (!p->runs[k].min_limit) continue;
    double y = top + (h - top - bottom) * (1.0 - (double)p->runs[k].min_limit / (double)ymax);
    fprintf(f,
            "<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
            "stroke-dasharray=\"6 4\"/>\n",
            left, w - right, y, y, colors[k]);
  }
  const char* names[3] = {"reserved, default policy", "reserved, pytorch policy",
                          "live (requested)"};
  for (int s = 0; s < 3; s++) {
    fprintf(f,
            "<rect x=\"%.0f\" y=\"%d\" width=\"12\" height=\"3\" fill=\"%s\"/><text x=\"%.0f\" "
            "y=\"%d\" font-size=\"11\">%s</text>\n",
            left + 230.0 * s, 12, colors[s], left + 16 + 230.0 * s, 16, names[s]);
  }
  fprintf(f, "</svg>\n");
}

static void explain_rows(FILE* f, const gpumem_explain_t* ex) {
  struct {
    const char* what;
    uint64_t n;
  } rows[] = {
      {"requested by live allocations", ex->requested},
      {"rounding (512 B units, unsplit tails)", ex->rounding},
      {"partial pages at hole edges, large pool", ex->partial_pages_large},
      {"partial pages at hole edges, small pool", ex->partial_pages_small},
      {"cached free, reclaimable", ex->cached_reclaimable},
      {"cached free, pinned (mapping under live blocks)", ex->cached_pinned},
      {"waiting for other streams (record_stream)", ex->other_streams},
      {"spare pages (held, not mapped)", ex->spare_pages},
  };
  char b[32];
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    fprintf(f, "<tr><td>%s</td><td class=n>%s</td><td class=n>%.4f%%</td></tr>\n", rows[i].what,
            bytes(rows[i].n, b, sizeof b),
            ex->reserved ? 100.0 * (double)rows[i].n / (double)ex->reserved : 0.0);
  }
  fprintf(f, "<tr><th>reserved</th><th class=n>%s</th><th class=n>100%%</th></tr>\n",
          bytes(ex->reserved, b, sizeof b));
}

/* The table of `gpumem fit`: its rows, cells and note, as fit prints them. */
static void fit_section(page_t* p) {
  FILE* f = p->out;
  const trace_t* t = p->t;
  if (p->memory)
    fprintf(f, "<h2>Each allocator: does it fit in %.3f GiB?</h2>\n", (double)p->memory / GIB);
  else
    fputs("<h2>Each allocator: the memory it needs</h2>\n", f);
  fputs("<table><tr><th>allocator</th>", f);
  if (p->memory) fputs("<th>fits</th>", f);
  fputs(
      "<th class=n>peak reserved</th><th class=n>memory needed</th><th>how to choose "
      "it</th></tr>\n",
      f);
  uint64_t default_needed = 0;
  for (size_t k = 0; k < fit_num_rows; k++) {
    char peak[40], need[40];
    fit_cells(t, &p->fit[k], peak, need, sizeof peak);
    if (fit_rows[k].gpumem_default) default_needed = p->fit[k].needed;
    fprintf(f, "<tr><td>%s</td>", fit_rows[k].name);
    if (p->memory) fprintf(f, "<td>%s</td>", p->fit[k].fits ? "yes" : "NO");
    fprintf(f, "<td class=n>%s</td><td class=n>%s</td><td>", peak, need);
    put_escaped(f, fit_rows[k].how);
    fputs("</td></tr>\n", f);
  }
  fputs("</table>\n<p>", f);
  /* the rows whose figures could read as a contradiction, said as fit says it */
  char* why = NULL;
  size_t why_len = 0;
  FILE* said = p->memory ? open_memstream(&why, &why_len) : NULL;
  if (said) {
    fit_explain(said, p->fit, p->memory);
    fclose(said);
    if (why_len) {
      put_escaped(f, why);
      fputs("</p>\n<p>", f);
    }
  }
  free(why);
  put_escaped(f, fit_note);
  if (default_needed) fprintf(f, "gpumem's default needs %.3f GiB. ", (double)default_needed / GIB);
  if (t->recorded_peak_reserved)
    fprintf(f, "The recording process reserved %.3f GiB at its peak (snapshot segment events). ",
            (double)t->recorded_peak_reserved / GIB);
  fputs(
      "The rows are fixed settings: <code>--conf</code> applies to the default policy's "
      "replays above, not to them.</p>\n",
      f);
}

static void write_page(page_t* p) {
  FILE* f = p->out;
  const trace_t* t = p->t;
  char b1[32], b2[32];
  fputs("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>gpumem report: ", f);
  put_escaped(f, t->name);
  fputs(
      "</title>\n<style>body{font:14px/1.45 system-ui,sans-serif;max-width:1000px;margin:2em "
      "auto;color:#222}td,th{padding:2px 10px;text-align:left}.n{text-align:right;font-variant-"
      "numeric:tabular-nums}table{border-collapse:collapse}tr:nth-child(even){background:#f4f4f4}"
      "pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px}</style>\n</head><body>\n",
      f);
  fputs("<h1>gpumem report: ", f);
  put_escaped(f, t->name);
  fputs("</h1>\n<p>", f);
  put_escaped(f, t->path);
  fprintf(f,
          ": %zu events, %zu allocations on %zu stream%s; peak live %s (event %zu), "
          "still live at the end %s. Replayed on gpumem's simulated device.</p>\n",
          t->num_events, t->num_allocs, t->num_streams, t->num_streams == 1 ? "" : "s",
          bytes(t->peak_live_bytes, b1, sizeof b1), t->peak_event,
          bytes(t->end_live_bytes, b2, sizeof b2));
  fputs(
      "<table><tr><th>policy</th><th class=n>peak reserved</th><th class=n>/ peak "
      "live</th><th class=n>smallest limit</th><th class=n>/ peak live</th><th "
      "class=n>memory created</th><th class=n>maps</th><th class=n>unmaps</th></tr>\n",
      f);
  for (int k = 0; k < 2; k++) {
    const run_t* r = &p->runs[k];
    fprintf(f, "<tr><td><span style=\"color:%s\">&#9632;</span> %s</td><td class=n>%s</td>",
            colors[k], r->name, bytes(r->peak_reserved, b1, sizeof b1));
    fprintf(f, "<td class=n>%.4f</td>",
            t->peak_live_bytes ? (double)r->peak_reserved / (double)t->peak_live_bytes : 0.0);
    if (r->min_limit)
      fprintf(f, "<td class=n>%s</td><td class=n>%.4f</td>", bytes(r->min_limit, b1, sizeof b1),
              r->min_limit_ratio);
    else
      fputs("<td class=n>-</td><td class=n>-</td>", f);
    fprintf(f, "<td class=n>%llu</td><td class=n>%llu</td><td class=n>%llu</td></tr>\n",
            (unsigned long long)r->creates, (unsigned long long)r->maps,
            (unsigned long long)r->unmaps);
  }
  fputs("</table>\n", f);
  if (p->fit) fit_section(p);
  fputs("<h2>Memory over the trace</h2>\n", f);
  chart(p);
  fputs(
      "<p>Highest value in each of the chart's steps. Dashed: the smallest limits found by "
      "bisection (<code>--min-limit</code>).</p>\n",
      f);
  fprintf(f, "<h2>At the peak (default policy, event %zu, line %u)</h2>\n<table>\n",
          p->runs[0].peak_event, t->events[p->runs[0].peak_event].line);
  explain_rows(f, &p->at_peak);
  fputs(
      "</table>\n<h3>The largest groups of allocations alive then</h3>\n<p>One requested "
      "size on one stream each, most bytes first; allocations are counted from 1, tags are "
      "the trace lines that made them.</p>\n<pre>",
      f);
  put_escaped(f, p->peak_groups ? p->peak_groups : "(not available)\n");
  fputs(
      "</pre>\n<h2>Live at the end of the trace</h2>\n<p>What the trace never freed: weights "
      "and optimizer state, or leaks (<code>gpumem leaks --since-line N</code> leaves out a "
      "first step).</p>\n<pre>",
      f);
  put_escaped(f, p->end_groups ? p->end_groups : "(not available)\n");
  fputs("</pre>\n", f);
  for (int k = 0; k < 2; k++) {
    if (p->runs[k].oom)
      fprintf(f, "<p><b>%s ran out of memory at event %zu.</b></p>\n", p->runs[k].name,
              p->runs[k].oom_event);
  }
  fputs("<p>Made by <code>gpumem report</code>.</p>\n</body></html>\n", f);
}

/* Whether the option a (its first len characters) is name. */
static bool option_is(const char* a, size_t len, const char* name) {
  return strlen(name) == len && strncmp(a, name, len) == 0;
}

int cmd_report(int argc, char** argv) {
  const char* out_path = NULL;
  const char* conf = NULL;
  const char* memory_text = NULL;
  const char* trace_path = NULL;
  int min_limit = 0;
  for (int i = 0; i < argc; i++) {
    const char* a = argv[i];
    /* --name=value as well as --name value, as the other commands take them */
    const char* eq = a[0] == '-' && a[1] == '-' ? strchr(a, '=') : NULL;
    size_t len = eq ? (size_t)(eq - a) : strlen(a);
    const char** value = option_is(a, len, "-o")         ? &out_path
                         : option_is(a, len, "--conf")   ? &conf
                         : option_is(a, len, "--memory") ? &memory_text
                                                         : NULL;
    if (value) {
      if (!eq && i + 1 >= argc) {
        return cli_usage_error(usage_report, "option '%s' needs a value", a);
      }
      *value = eq ? eq + 1 : argv[++i];
    } else if (eq && (option_is(a, len, "--help") || option_is(a, len, "--min-limit"))) {
      return cli_usage_error(usage_report, "option '%.*s' takes no value", (int)len, a);
    } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      fputs(usage_report, stdout);
      return 0;
    } else if (strcmp(a, "--min-limit") == 0) {
      min_limit = 1;
    } else if (a[0] == '-' && a[1]) {
      return cli_usage_error(usage_report, "unknown option '%s'", a);
    } else if (trace_path) {
      return cli_usage_error(usage_report, "one trace at a time");
    } else {
      trace_path = a;
    }
  }
  if (!trace_path) {
    return cli_usage_error(usage_report, "no trace given");
  }
  /* Bad values are reported before any trace is read, as gpumem fit does. */
  size_t memory = 0;
  if (memory_text && cli_parse_memory(memory_text, &memory) != GPUMEM_OK) {
    return cli_error("%s", gpumem_last_error());
  }
  gpumem_options_t check;
  gpumem_options_init(&check);
  if (conf && (cli_check_conf_units("--conf", conf) != GPUMEM_OK ||
               gpumem_options_parse(&check, conf) != GPUMEM_OK)) {
    return cli_error("%s", gpumem_last_error());
  }
  if (cli_refuse_record(conf)) return 1;
  /* GPUMEM_CONF first, then --conf, as every command reads them */
  static char joined[4096];
  if (cli_join_conf(conf, joined, sizeof joined) != 0) {
    return cli_error("GPUMEM_CONF and --conf together are too long");
  }
  conf = joined[0] ? joined : NULL;
  page_t* p = calloc(1, sizeof *p);
  trace_t* t = NULL;
  void** slots = NULL;
  int rc = 1;
  if (!p) {
    return cli_error("out of host memory");
  }
  if (trace_load(trace_path, &t) != GPUMEM_OK) {
    cli_error("%s", gpumem_last_error());
    goto done;
  }
  p->t = t;
  slots = calloc(t->num_allocs ? t->num_allocs : 1, sizeof *slots);
  if (!slots) {
    cli_error("out of host memory");
    goto done;
  }
  for (int k = 0; k < 2; k++) {
    if (replay_policy(p, k, conf, min_limit, slots) != 0) {
      cli_error("%s: %s", t->name, gpumem_last_error());
      goto done;
    }
  }
  /* The table bisects each row's smallest memory: only when asked for */
  if (memory || min_limit) {
    p->memory = memory;
    p->fit = calloc(fit_num_rows, sizeof *p->fit);
    if (!p->fit) {
      cli_error("out of host memory");
      goto done;
    }
    replay_config_t base;
    replay_config_init(&base);
    for (size_t k = 0; k < fit_num_rows; k++) {
      if (fit_one(t, &fit_rows[k], memory, &base, &p->fit[k]) != GPUMEM_OK) {
        cli_error("%s: %s", t->name, gpumem_last_error());
        goto done;
      }
    }
  }
  /* -o: never through a link or into another user's file (src/outfile.c) */
  gm_outfile out;
  char why[1400];
  int fd = out_path ? gm_outfile_open(&out, out_path, 0600, why, sizeof why) : -1;
  if (out_path && fd < 0) {
    cli_error("%s", why);
    goto done;
  }
  p->out = out_path ? fdopen(fd, "w") : stdout;
  if (!p->out) {
    cli_error("cannot write %s: %s", out_path, strerror(errno));
    close(fd);
    gm_outfile_abandon(&out);
    goto done;
  }
  write_page(p);
  rc = ferror(p->out) ? 1 : 0;
  if (out_path && fclose(p->out) != 0) rc = 1;
  if (rc) cli_error("writing %s failed", out_path ? out_path : "the page");
  if (out_path && rc) gm_outfile_abandon(&out);
  if (out_path && !rc && !gm_outfile_commit(&out, why, sizeof why)) {
    cli_error("%s", why);
    rc = 1;
  }
  char shown[512];
  if (!rc && out_path)
    printf("%s: report written to %s\n", t->name, show_text(out_path, shown, sizeof shown));
done:
  if (p) {
    free(p->peak_groups);
    free(p->end_groups);
    free(p->fit);
  }
  free(p);
  free(slots);
  trace_free(t);
  return rc;
}
