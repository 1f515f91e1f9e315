/* gpumem predict: the options and the output of the prediction of a job's
 * memory at another batch size from recordings at small ones; the model
 * itself is scale.c, the alignment of the recordings align.c. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"
#include "fit.h"
#include "internal.h"
#include "align.h"
#include "scale.h"
#include "shmfile.h"
#include "trace.h"

static const char usage_predict[] =
    "usage: gpumem predict --batch-sizes B1,B2[,...] TRACE1 TRACE2 [...] [--batch N] [--memory "
    "SIZE]\n"
    "\n"
    "The same job recorded at two or more batch sizes B1 < B2 < ... (one TRACE\n"
    "each, in that order) predicts its allocations at any batch: each\n"
    "allocation's size is fitted exactly as constant, affine (a + c*b) or, from\n"
    "three recordings on, quadratic (a + c*b + d*b^2) in the batch b. From\n"
    "three recordings on, the largest is also predicted from the others, as a\n"
    "check. For each allocator of gpumem fit: the peak reserved memory and the\n"
    "memory needed at --batch, and the largest batch that replays under a hard\n"
    "limit of --memory.\n"
    "TRACE: a gpumem trace or a PyTorch memory snapshot pickle. Recordings with\n"
    "'# step N' markers and different numbers of steps are compared over the\n"
    "steps they have in common.\n"
    "\n"
    "options:\n"
    "  --batch-sizes B1,B2,...   the batch size of each TRACE, increasing (--sizes: the same)\n"
    "  --batch N                 predict the job at batch N\n"
    "  --memory SIZE             find the largest batch that fits in SIZE (e.g. 80G)\n"
    "  --max-batch N             search no batch above N (with --memory)\n"
    "  --write-trace FILE        also write the job's trace at --batch to FILE: a\n"
    "                            trace like any other, for the other commands, or for\n"
    "                            a second predict over another dimension\n"
    "  --min-limit-tolerance F   bisect the needed memory to F x peak live (default:\n"
    "                            one page or 0.25%, the finer)\n"
    "  --json                    one JSON object with every figure\n"
    "  -h, --help                this text\n"
    "\n"
    "Give --batch, --memory or both. Each allocator runs at its own settings:\n"
    "GPUMEM_CONF is checked, not applied. The batch may be any dimension the\n"
    "sizes follow, such as a sequence length recorded at a fixed batch. Two\n"
    "dimensions: predict each recorded length at the batch wanted with\n"
    "--write-trace, then predict those traces over the lengths (docs/predict.md).\n";

/* --batch-sizes "2,4,8" into batch[] (SCALE_MAX_RECORDINGS of room), one a trace.
 * 0, or the exit code after printing why. */
static int parse_sizes(const char* text, int num_traces, long* batch) {
  int n = 0;
  const char* p = text;
  for (;;) {
    size_t len = strcspn(p, ",");
    char item[32];
    if (len == 0 || len >= sizeof item)
      return cli_error("bad --batch-sizes '%s' (batch sizes separated by commas, e.g. 2,4,8)",
                       text);
    memcpy(item, p, len);
    item[len] = '\0';
    if (n == SCALE_MAX_RECORDINGS)
      return cli_error("bad --batch-sizes '%s': at most %d recordings", text, SCALE_MAX_RECORDINGS);
    if (!cli_parse_long(item, 1, SCALE_MAX_RECORDED_BATCH, &batch[n]))
      return cli_error("bad --batch-sizes '%s': '%s' is not a batch size (1 to %ld)", text, item,
                       SCALE_MAX_RECORDED_BATCH);
    if (n && batch[n] <= batch[n - 1])
      return cli_error(
          "bad --batch-sizes '%s': %ld then %ld: the sizes must increase (one recording a size, "
          "the traces in the same order)",
          text, batch[n - 1], batch[n]);
    n++;
    p += len;
    if (!*p) break;
    p++;
  }
  if (n < 2)
    return cli_usage_error(
        usage_predict,
        "--batch-sizes '%s' gives one batch size: the model needs the job recorded "
        "at two sizes or more",
        text);
  if (n != num_traces)
    return cli_usage_error(
        usage_predict,
        "--batch-sizes gives %d batch sizes for %d traces (one a trace, in the same "
        "order)",
        n, num_traces);
  return 0;
}

typedef struct predict_row {
  fit_result_t at;         /* at --batch */
  scale_largest_t largest; /* in --memory */
} predict_row_t;

static const char* limited_by_name(scale_limit_t why) {
  return why == SCALE_BY_MAX_BATCH ? "max_batch" : why == SCALE_BY_MODEL ? "model" : "memory";
}

/* The "largest batch" cell: the batch and what ended the search. */
static void largest_cell(const cli_t* cli, const scale_model_t* m, const scale_largest_t* l,
                         char* buf, size_t cap) {
  if (!l->batch && l->model_edge) {
    snprintf(buf, cap, "none (%ld does not fit; %ld has a size <= 0)", l->first_not_fitting,
             l->model_edge);
  } else if (!l->batch) {
    snprintf(buf, cap, "none (%ld does not fit)", l->first_not_fitting);
  } else if (l->limited_by == SCALE_BY_MAX_BATCH) {
    snprintf(buf, cap, "%ld (%s)", l->batch,
             cli->max_batch ? "--max-batch" : "every batch tried fits");
  } else if (l->limited_by == SCALE_BY_MODEL) {
    snprintf(buf, cap, "%ld (%ld has a size <= 0)", l->batch, l->model_edge);
  } else if (l->below_recorded) {
    snprintf(buf, cap, "%ld (below %ld: extrapolated)", l->batch, m->batch[0]);
  } else {
    snprintf(buf, cap, "%ld", l->batch);
  }
}

static void predict_json(const cli_t* cli, const scale_model_t* m, const align_report_t* al,
                         const trace_t* at, const scale_at_t* info, const predict_row_t* rows,
                         const fit_overflow_t* over, size_t convolutions) {
  printf("{\"recordings\":[");
  for (size_t i = 0; i < m->num_recordings; i++) {
    const trace_t* t = m->traces[i];
    printf("%s{\"trace\":", i ? "," : "");
    show_json(stdout, t->path);
    printf(",\"batch\":%ld,\"events\":%zu,\"steps\":%zu,\"peak_live_bytes\":%llu}", m->batch[i],
           t->num_events, t->num_steps, (unsigned long long)t->peak_live_bytes);
  }
  printf("],\"events\":%zu,\"allocations\":%zu,\"steps_used\":%zu,\"truncated\":%s", m->num_events,
         m->num_allocs, m->steps_used, m->truncated ? "true" : "false");
  printf(
      ",\"model\":{\"constant\":%zu,\"affine\":%zu,\"quadratic\":%zu,\"held\":%zu,"
      "\"faster_than_batch\":%zu,\"faster_than_batch_bytes\":%llu}",
      m->kind_count[SCALE_CONSTANT], m->kind_count[SCALE_AFFINE], m->kind_count[SCALE_QUADRATIC],
      m->num_held, m->num_faster, (unsigned long long)m->faster_bytes);
  printf(
      ",\"aligned\":{\"by_role\":%s,\"matched\":%zu,\"inserted\":%zu,"
      "\"inserted_bytes_at_largest\":%llu,\"inserted_sized_by_others\":%zu,"
      "\"inserted_optimizer\":%zu,\"dropped\":%zu,\"dropped_bytes\":%llu,\"frees_moved\":%zu,"
      "\"upper_bound\":%s,\"unmatched_roles\":[",
      al->by_role ? "true" : "false", al->matched, al->inserted,
      (unsigned long long)al->inserted_bytes, al->inserted_sized, al->inserted_optimizer,
      al->dropped, (unsigned long long)al->dropped_bytes, al->frees_moved,
      al->inserted > al->inserted_sized + al->inserted_optimizer ? "true" : "false");
  for (size_t k = 0; k < ALIGN_TOP_ROLES && al->top[k].count; k++) {
    printf("%s{\"role\":", k ? "," : "");
    show_json(stdout, al->top[k].role);
    printf(",\"only_at\":\"%s\",\"count\":%zu,\"bytes\":%llu}",
           al->top[k].inserted ? "largest" : "smaller", al->top[k].count,
           (unsigned long long)al->top[k].bytes);
  }
  printf("]}");
  const scale_check_t* c = &m->check;
  if (c->done) {
    printf(
        ",\"check\":{\"batch\":%ld,\"allocations\":%zu,\"exact\":%zu,\"unpredicted\":%zu,"
        "\"max_error_bytes\":%llu,\"recorded_peak_live_bytes\":%llu,"
        "\"predicted_peak_live_bytes\":%llu}",
        c->batch, c->allocations, c->exact, c->unpredicted, (unsigned long long)c->max_error_bytes,
        (unsigned long long)c->recorded_peak_live, (unsigned long long)c->predicted_peak_live);
  } else {
    printf(",\"check\":null");
  }
  if (at) {
    printf(",\"batch\":%ld,\"peak_live_bytes\":%llu,\"rounded_sizes\":%zu", cli->batch,
           (unsigned long long)at->peak_live_bytes, info->rounded);
  } else {
    printf(",\"batch\":null,\"peak_live_bytes\":null,\"rounded_sizes\":null");
  }
  if (cli->memory) {
    printf(",\"memory_bytes\":%zu", cli->memory);
  } else {
    printf(",\"memory_bytes\":null");
  }
  if (cli->max_batch) {
    printf(",\"max_batch\":%ld", cli->max_batch);
  } else {
    printf(",\"max_batch\":null");
  }
  printf(",\"allocators\":[");
  for (size_t k = 0; k < fit_num_rows; k++) {
    const predict_row_t* r = &rows[k];
    printf("%s{\"allocator\":\"%s\",\"model\":%s", k ? "," : "", fit_rows[k].name,
           fit_rows[k].peer != PEER_NONE ? "true" : "false");
    if (at) {
      printf(",\"peak_reserved_bytes\":%llu,\"needed_bytes\":%llu",
             (unsigned long long)r->at.peak_reserved, (unsigned long long)r->at.needed);
    } else {
      printf(",\"peak_reserved_bytes\":null,\"needed_bytes\":null");
    }
    if (at && cli->memory) {
      printf(",\"fits\":%s", r->at.fits ? "true" : "false");
    } else {
      printf(",\"fits\":null");
    }
    if (cli->memory) {
      const scale_largest_t* l = &r->largest;
      printf(
          ",\"largest_batch\":%ld,\"largest_batch_limited_by\":\"%s\",\"first_not_fitting\":%ld,"
          "\"below_recorded\":%s,\"model_edge\":%ld",
          l->batch, limited_by_name(l->limited_by), l->first_not_fitting,
          l->below_recorded ? "true" : "false", l->model_edge);
    } else {
      printf(",\"largest_batch\":null");
    }
    printf("}");
  }
  printf("]");
  /* The overflow tier at --batch, where gpumem's default does not fit. */
  if (over)
    printf(
        ",\"overflow\":{\"fits\":%s,\"host_peak_bytes\":%llu,\"host_allocations\":%llu,"
        "\"moves_to_host\":%llu,\"moves_to_device\":%llu,\"host_link_bytes\":%llu,"
        "\"host_link_model_us\":%.0f}",
        over->fits ? "true" : "false", (unsigned long long)over->host_peak,
        (unsigned long long)over->host_allocs, (unsigned long long)over->moves_to_host,
        (unsigned long long)over->moves_to_device, (unsigned long long)over->link_bytes,
        over->link_us);
  else
    printf(",\"overflow\":null");
  printf(",\"convolution_allocations\":%zu}\n", convolutions);
}

static void predict_human(const cli_t* cli, const scale_model_t* m, const align_report_t* al,
                          const trace_t* at, const scale_at_t* info, const predict_row_t* rows,
                          const fit_overflow_t* over, size_t convolutions) {
  char a[32], b[32];
  printf("%s: the job recorded at batch", m->traces[0]->name);
  for (size_t i = 0; i < m->num_recordings; i++)
    printf("%s %ld", i == 0 ? "" : i + 1 == m->num_recordings ? " and" : ",", m->batch[i]);
  printf("\naligned: %s events, %s allocations", show_count(m->num_events, a),
         show_count(m->num_allocs, b));
  if (m->truncated) {
    printf(" (the first %zu steps of each recording: the steps they have in common)",
           m->steps_used);
  } else if (m->steps_used) {
    printf(" (%zu steps)", m->steps_used);
  }
  if (al->inserted || al->dropped || al->frees_moved) {
    char c1[32], c2[32], c3[32];
    printf("\nmatched by %s: %s of the largest recording's allocations in every recording",
           al->by_role ? "what made them, stream and size" : "stream and size",
           show_count(al->matched, c1));
    if (al->frees_moved)
      printf("; %s frees in another order, placed as at the largest batch",
             show_count(al->frees_moved, c2));
    if (al->inserted)
      printf(
          "\nnot at every batch: %s allocations (%.3f GiB at the largest), where a smaller batch "
          "makes them too sized through it (%zu), the rest taken in proportion to the batch: an "
          "upper bound where they grow at most linearly; but what a library picks by shape "
          "(cuDNN's convolution workspaces, a large reduction's staging buffer) may change again "
          "between the recorded batches and the target, which only recordings nearer the target "
          "show",
          show_count(al->inserted, c3), (double)al->inserted_bytes / GIB, al->inserted_sized);
    if (al->inserted_optimizer)
      printf(
          "\n  of them %zu made in an optimizer's step that a smaller batch's run skipped (a "
          "GradScaler skips a step whose gradients overflow), carried at their size: an "
          "optimizer's state is shaped like the parameters",
          al->inserted_optimizer);
    if (al->dropped)
      printf("\nonly at a smaller batch: %s allocations (%.3f GiB), left out",
             show_count(al->dropped, c3), (double)al->dropped_bytes / GIB);
    for (size_t k = 0; k < ALIGN_TOP_ROLES && al->top[k].count; k++) {
      /* (a role is printable ASCII: the reader refuses anything else) */
      printf("\n  %s: %zu allocation%s, %.3f MiB, only at the %s batch",
             al->top[k].role[0] ? al->top[k].role : "(no role)", al->top[k].count,
             al->top[k].count == 1 ? "" : "s", (double)al->top[k].bytes / (1 << 20),
             al->top[k].inserted ? "largest" : "smaller");
    }
  }
  printf("\nsizes in the batch: %zu constant, %zu affine, %zu quadratic\n",
         m->kind_count[SCALE_CONSTANT], m->kind_count[SCALE_AFFINE],
         m->kind_count[SCALE_QUADRATIC]);
  if (m->num_faster) {
    const trace_t *t0 = m->traces[0], *t1 = m->traces[1];
    size_t slot = m->faster_example;
    uint32_t role = t1->slot_role ? t1->slot_role[slot] : 0;
    /* (a role is printable ASCII: the readers refuse anything else) */
    printf(
        "faster than the batch: %zu allocation%s (%.3f GiB at batch %ld; the largest %s%s%llu "
        "bytes at %ld, %llu at %ld) grow\nnearer its square than a line: a size quadratic in the "
        "batch (a batch-by-batch matrix, a contrastive loss's\nlogits) is taken here as a line, "
        "far too low at a large batch. Record a third batch size and give\nall three "
        "(--batch-sizes %ld,%ld,%ld).\n",
        m->num_faster, m->num_faster == 1 ? "" : "s", (double)m->faster_bytes / GIB, m->batch[1],
        role ? t1->roles[role] : "", role ? ": " : "",
        (unsigned long long)t0->events[t0->slot_event[slot]].size, m->batch[0],
        (unsigned long long)t1->events[t1->slot_event[slot]].size, m->batch[1], m->batch[0],
        m->batch[1], 2 * m->batch[1]);
  }
  if (m->num_held)
    printf(
        "held: %zu allocation%s of at most %d bytes that follow no trend in the batch, at the "
        "largest size recorded (every allocator gives them a block of %d)\n",
        m->num_held, m->num_held == 1 ? "" : "s", SCALE_BLOCK, SCALE_BLOCK);
  const scale_check_t* c = &m->check;
  if (c->done) {
    double off = c->recorded_peak_live
                     ? 100.0 * ((double)c->predicted_peak_live - (double)c->recorded_peak_live) /
                           (double)c->recorded_peak_live
                     : 0;
    printf("check: batch %ld predicted from batch", c->batch);
    for (size_t i = 0; i + 1 < m->num_recordings; i++)
      printf("%s %ld", i == 0 ? "" : i + 2 == m->num_recordings ? " and" : ",", m->batch[i]);
    printf(": %zu of %zu allocations to the byte", c->exact, c->allocations);
    size_t missed = c->allocations - c->exact - c->unpredicted;
    if (missed)
      printf(", %zu off by at most %s", missed, gm_format_bytes(c->max_error_bytes, a, sizeof a));
    if (c->unpredicted) printf(", %zu without a model", c->unpredicted);
    printf("\n       peak live %s predicted, %s recorded (%+.2f%%)\n",
           gm_format_bytes(c->predicted_peak_live, a, sizeof a),
           gm_format_bytes(c->recorded_peak_live, b, sizeof b), off);
  } else {
    printf("check: none (a third recording would check the model and find quadratic sizes)\n");
  }
  printf("\n");
  if (at) {
    printf("at batch %ld: peak live %s", cli->batch,
           gm_format_bytes(at->peak_live_bytes, a, sizeof a));
    if (info->rounded)
      printf(" (%zu sizes rounded to the nearest byte: fractional coefficients)", info->rounded);
    printf("\n");
  }
  if (cli->memory) {
    printf("largest batch: the largest that replays under a hard limit of %.3f GiB",
           (double)cli->memory / GIB);
    if (cli->max_batch) printf(", at most %ld", cli->max_batch);
    printf("\n");
  }
  printf("\n%-20s", "allocator");
  if (at && cli->memory) printf(" %-5s", "fits");
  if (at) printf(" %-22s %-22s", "peak reserved", "memory needed");
  if (cli->memory) printf(" %-22s", "largest batch");
  printf(" %s\n%.*s\n", "how to choose it", 120,
         "----------------------------------------------------------------------------------"
         "--------------------------------------");
  for (size_t k = 0; k < fit_num_rows; k++) {
    const predict_row_t* r = &rows[k];
    printf("%-20s", fit_rows[k].name);
    if (at && cli->memory) printf(" %-5s", r->at.fits ? "yes" : "NO");
    if (at) {
      char peak[40], need[40];
      fit_cells(at, &r->at, peak, need, sizeof peak);
      printf(" %-22s %-22s", peak, need);
    }
    if (cli->memory) {
      char cell[96];
      largest_cell(cli, m, &r->largest, cell, sizeof cell);
      printf(" %-22s", cell);
    }
    printf(" %s\n", fit_rows[k].how);
  }
  printf("\n");
  if (at && cli->memory) {
    fit_result_t* at_rows = calloc(fit_num_rows, sizeof *at_rows);
    for (size_t k = 0; at_rows && k < fit_num_rows; k++) at_rows[k] = rows[k].at;
    if (at_rows) fit_explain(stdout, at_rows, cli->memory);
    free(at_rows);
    if (over) fit_overflow_say(stdout, at, over, cli->memory);
  }
  if (at) printf("%s", fit_note);
  if (convolutions)
    printf(
        "convolutions: %zu allocations of the recordings were made inside one (nn.Conv*, cuDNN). "
        "cuDNN\npicks each convolution's algorithm, and the workspace it takes, by shape: what "
        "the recorded\nbatches show of them need not hold at a larger one, and the figures may "
        "be low (a ResNet-18\nin fp32 recorded at 1 and 2 came out 23%% low at 16 on an H100). "
        "python -m gpumem.predict\nchecks the batches themselves, each convolution run on the "
        "GPU.\n",
        convolutions);
  if (cli->memory)
    printf(
        "largest batch: searched from the smallest recording, doubling then bisecting; what "
        "fits at\none batch is taken to fit at every smaller one.\n");
}

/* The predicted trace into cli->write_trace, never through a link or into
 * another user's file (src/outfile.c); its comment says what it is. */
static int write_predicted_trace(const trace_t* at, const cli_t* cli, const long* batch) {
  char comment[1024];
  int n = snprintf(comment, sizeof comment, "gpumem predict: the job at %ld, from recordings at",
                   cli->batch);
  for (int i = 0; i < cli->num_traces && n > 0 && (size_t)n < sizeof comment; i++)
    n += snprintf(comment + n, sizeof comment - (size_t)n, "%s %ld", i ? "," : "", batch[i]);
  char* text = NULL;
  size_t len = 0;
  if (trace_text(at, comment, &text, &len) != GPUMEM_OK)
    return cli_error("%s", show_detail(gpumem_last_error()));
  gm_outfile out;
  char why[1400];
  int fd = gm_outfile_open(&out, cli->write_trace, 0600, why, sizeof why);
  if (fd < 0) {
    free(text);
    return cli_error("%s", why);
  }
  bool written = gm_pwrite_all(fd, text, len, 0);
  int why_not = errno;
  free(text);
  if (close(fd) != 0 && written) {
    written = false;
    why_not = errno;
  }
  if (!written) {
    gm_outfile_abandon(&out);
    return cli_error("cannot write %s: %s", cli->write_trace, strerror(why_not));
  }
  if (!gm_outfile_commit(&out, why, sizeof why)) return cli_error("%s", why);
  return 0;
}

int cmd_predict(int argc, char** argv) {
  cli_t cli;
  memset(&cli, 0, sizeof cli);
  unsigned allowed = (1u << OPT_SIZES) | (1u << OPT_BATCH) | (1u << OPT_MEMORY) |
                     (1u << OPT_MAX_BATCH) | (1u << OPT_JSON) | (1u << OPT_MIN_LIMIT_TOLERANCE) |
                     (1u << OPT_WRITE_TRACE) | (1u << OPT_HELP);
  long batch[SCALE_MAX_RECORDINGS];
  int rc = cli_parse_args(argc, argv, allowed, usage_predict, &cli);
  if (rc == 0 && cli.help) {
    fputs(usage_predict, stdout);
  } else if (rc == 0 && !cli.sizes) {
    rc = cli_usage_error(
        usage_predict,
        "--batch-sizes B1,B2,... is needed (the batch size each trace was recorded at)");
  } else if (rc == 0 && cli.num_traces < 2) {
    rc = cli_usage_error(usage_predict,
                         "%d trace%s given: the model needs the job recorded at two batch sizes "
                         "or more",
                         cli.num_traces, cli.num_traces == 1 ? "" : "s");
  } else if (rc == 0 && !cli.batch && !cli.memory) {
    rc = cli_usage_error(usage_predict,
                         "give --batch N (predict the job at N), --memory SIZE (the largest batch "
                         "that fits), or both");
  } else if (rc == 0 && cli.max_batch && !cli.memory) {
    rc = cli_usage_error(usage_predict,
                         "--max-batch caps the search for the largest batch that fits --memory: "
                         "give --memory too");
  } else if (rc == 0 && cli.write_trace && !cli.batch) {
    rc = cli_usage_error(usage_predict,
                         "--write-trace writes the job's trace at --batch: give --batch too");
  } else if (rc == 0) {
    rc = parse_sizes(cli.sizes, cli.num_traces, batch);
  }
  trace_t** traces = NULL;
  if (rc != 0 || cli.help || (rc = cli_load_all(&cli, &traces)) != 0) {
    free(cli.traces);
    return rc;
  }
  /* (counted before the alignment, which may rebuild a recording) */
  size_t convolutions = 0;
  for (int i = 0; i < cli.num_traces; i++) convolutions += traces[i]->snapshot_conv_allocs;
  align_report_t aligned;
  if (align_recordings(traces, batch, (size_t)cli.num_traces, &aligned) != GPUMEM_OK) {
    for (int i = 0; i < cli.num_traces; i++) trace_free(traces[i]);
    free(traces);
    free(cli.traces);
    return cli_error("%s", show_detail(gpumem_last_error()));
  }
  for (int i = 0; i < cli.num_traces; i++) scale_canonical_frees(traces[i]);
  if (cli_env_conf())
    fprintf(stderr,
            "gpumem: note: GPUMEM_CONF is not applied: predict runs each allocator at its own "
            "settings\n");
  scale_model_t* m = NULL;
  trace_t* at = NULL;
  scale_at_t info = {0};
  predict_row_t* rows = calloc(fit_num_rows, sizeof *rows);
  if (!rows) {
    rc = cli_error("out of host memory");
  } else if (scale_fit((const trace_t* const*)traces, batch, (size_t)cli.num_traces, &m) !=
             GPUMEM_OK) {
    rc = cli_error("%s", show_detail(gpumem_last_error()));
  } else if (cli.batch && scale_trace_at(m, cli.batch, &at, &info) != GPUMEM_OK) {
    rc = cli_error("%s", show_detail(gpumem_last_error()));
  } else if (cli.write_trace) {
    rc = write_predicted_trace(at, &cli, batch);
  }
  progress_t progress = {0};
  progress.enabled = isatty(STDERR_FILENO);
  replay_config_t base = cli.config;
  base.progress = progress_show;
  base.progress_arg = &progress;
  for (size_t k = 0; k < fit_num_rows && rc == 0; k++) {
    if (at) rc = cli_fit_row(at, &fit_rows[k], &cli, &progress, &rows[k].at);
    if (rc || !cli.memory) continue;
    progress_start(&progress, m->traces[0]->name, fit_rows[k].name);
    gpumem_status_t st =
        scale_largest_batch(m, &fit_rows[k], cli.memory, cli.max_batch, &base, &rows[k].largest);
    progress_clear(&progress);
    if (st != GPUMEM_OK) rc = cli_error("%s", show_detail(gpumem_last_error()));
  }
  /* At --batch, where gpumem's default does not fit: the overflow tier's
   * answer (host bytes and the host link's cost). */
  fit_overflow_t over;
  const fit_overflow_t* said = NULL;
  for (size_t k = 0; k < fit_num_rows && rc == 0 && at && cli.memory; k++) {
    if (!fit_rows[k].gpumem_default || rows[k].at.fits) continue;
    if (fit_overflow(at, cli.memory, &base, &over) != GPUMEM_OK)
      rc = cli_error("%s", show_detail(gpumem_last_error()));
    else
      said = &over;
  }
  if (rc == 0 && cli.json) predict_json(&cli, m, &aligned, at, &info, rows, said, convolutions);
  if (rc == 0 && !cli.json) predict_human(&cli, m, &aligned, at, &info, rows, said, convolutions);
  trace_free(at);
  scale_free(m);
  free(rows);
  for (int i = 0; i < cli.num_traces; i++) trace_free(traces[i]);
  free(traces);
  free(cli.traces);
  return rc;
}
