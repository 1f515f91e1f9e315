/* What every gpumem command does alike, kept in one place so that the
 * commands cannot drift apart: the configuration (GPUMEM_CONF first, then
 * --conf, then the explicit flags, each later one winning key by key),
 * sizes typed on the command line, the options and their checks, exit
 * codes (2 usage, 1 error) and error messages, the progress line, loading
 * traces and replaying one with progress. The commands themselves are
 * tools/cmd_*.c. */
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "internal.h" /* gm_emitter */
#include "reader.h"
#include "scale.h" /* SCALE_MAX_BATCH */
#include "show.h"

/* "gpumem: " and the message on stderr, every byte of it that a terminal
 * could act on made visible (show.h): messages name files, and quote
 * words from them, whose bytes anyone may have chosen. */
static void print_shown(const char* fmt, va_list ap) {
  va_list again;
  va_copy(again, ap);
  int n = vsnprintf(NULL, 0, fmt, ap);
  char* msg = n >= 0 ? malloc((size_t)n + 1) : NULL;
  char* shown = NULL;
  if (msg) vsnprintf(msg, (size_t)n + 1, fmt, again);
  va_end(again);
  if (msg) shown = show_dup(msg);
  fprintf(stderr, "gpumem: %s", shown ? shown : "out of host memory for a message");
  free(shown);
  free(msg);
}

/* Usage mistakes: say what was wrong and where the options are, exit 2.
 * The whole usage text would bury the one line that matters. usage is the
 * command's usage text, whose first line names the command. */
int cli_usage_error(const char* usage, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  print_shown(fmt, ap);
  va_end(ap);
  static const char head[] = "usage: gpumem ";
  const char* cmd = strncmp(usage, head, sizeof head - 1) == 0 ? usage + sizeof head - 1 : "<";
  int n = cmd[0] == '<' ? 0 : (int)strcspn(cmd, " \n");
  fprintf(stderr, "\ntry 'gpumem %.*s%s--help'\n", n, cmd, n ? " " : "");
  return EXIT_USAGE;
}

/* Errors: "gpumem: <message>", exit 1. */
int cli_error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  print_shown(fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  return EXIT_FAILURE;
}

typedef struct option_spec {
  const char* name;
  int id;
  int takes_value;
} option_spec_t;

static const option_spec_t all_options[] = {
    {"policy", OPT_POLICY, 1},
    {"limit", OPT_LIMIT, 1},
    {"limit-ratio", OPT_LIMIT_RATIO, 1},
    {"conf", OPT_CONF, 1},
    {"passes", OPT_PASSES, 1},
    {"device", OPT_DEVICE, 1},
    {"capacity", OPT_CAPACITY, 1},
    {"min-limit", OPT_MIN_LIMIT, 0},
    {"min-limit-tolerance", OPT_MIN_LIMIT_TOLERANCE, 1},
    {"steady", OPT_STEADY, 1},
    {"step-ms", OPT_STEP_MS, 1},
    {"steps", OPT_STEPS, 1},
    {"json", OPT_JSON, 0},
    {"compare", OPT_COMPARE, 0},
    {"detail", OPT_DETAIL, 0},
    {"snapshot", OPT_SNAPSHOT, 1},
    {"since-line", OPT_SINCE_LINE, 1},
    {"at-line", OPT_AT_LINE, 1},
    {"memory", OPT_MEMORY, 1},
    {"batch-sizes", OPT_SIZES, 1},
    {"sizes", OPT_SIZES, 1}, /* the older name of --batch-sizes */
    {"batch", OPT_BATCH, 1},
    {"max-batch", OPT_MAX_BATCH, 1},
    {"write-trace", OPT_WRITE_TRACE, 1},
    {"help", OPT_HELP, 0},
};

/* A whole decimal number in [min, max] into *out; 0 when it is not one. */
int cli_parse_count(const char* value, long min, long max, int* out) {
  char* end;
  errno = 0;
  long n = strtol(value, &end, 10);
  if (errno || end == value || *end || n < min || n > max) return 0;
  *out = (int)n;
  return 1;
}

/* A key of the configuration under a peer model: limit and fraction cap
 * the model as they cap gpumem, policy is overridden by --policy; the
 * rest are gpumem's settings or ones the model does not model, and are
 * refused by name rather than dropped. */
typedef struct model_key {
  const cli_t* cli;
  const char* source; /* "GPUMEM_CONF" or "--conf" */
} model_key_t;

static int model_key(const char* key, size_t len, void* arg) {
  const model_key_t* m = arg;
  static const char* const applied[] = {"limit", "fraction", "policy"};
  for (size_t i = 0; i < sizeof applied / sizeof applied[0]; i++)
    if (strlen(applied[i]) == len && strncasecmp(key, applied[i], len) == 0) return 0;
  const char* model = peer_model_name(m->cli->peer);
  const char* why = "it is a setting of gpumem's allocator, and the model replays none";
  if (len == 17 && strncasecmp(key, "max_split_size_mb", len) == 0)
    why = m->cli->peer == PEER_ASYNC
              ? "cudaMallocAsync has no such setting"
              : "the expandable segments model does not model it (--policy pytorch without "
                "expandable_segments replays PyTorch's rules with it)";
  return cli_error("%s key '%.*s' does not apply to the %s model: %s", m->source, (int)len, key,
                   model, why);
}

/* A key that one engine policy has nothing to act on: the default
 * policy's own settings (how pages move, where blocks go in an arena) in
 * the pytorch policy's plain segments, and PyTorch's max_split_size_mb in
 * the default policy's arenas (which split any block). A replay would run
 * as if they were not there; refused by name instead. */
typedef struct policy_key {
  gpumem_policy_t policy;
  const char* source; /* "GPUMEM_CONF" or "--conf" */
} policy_key_t;

static int policy_key(const char* key, size_t len, void* arg) {
  const policy_key_t* k = arg;
  static const char* const vmm_only[] = {"reclaim", "headroom",   "move_budget", "placement",
                                         "map_max", "map_ahead",  "move_guard",  "stream_waits",
                                         "lend",    "small_pool", "overflow"};
  if (k->policy == GPUMEM_POLICY_DEFAULT) {
    if (len == 17 && strncasecmp(key, "max_split_size_mb", len) == 0)
      return cli_error(
          "%s key 'max_split_size_mb' does not apply to the default policy: it is PyTorch's rule "
          "for its segments (--policy pytorch), and the default policy's arenas split any block",
          k->source);
    return 0;
  }
  for (size_t i = 0; i < sizeof vmm_only / sizeof vmm_only[0]; i++) {
    if (strlen(vmm_only[i]) == len && strncasecmp(key, vmm_only[i], len) == 0)
      return cli_error(
          "%s key '%.*s' does not apply to the pytorch policy: it is a setting of the default "
          "policy's virtual memory, and PyTorch's rules have none",
          k->source, (int)len, key);
  }
  return 0;
}

/* After the options: which model of another allocator, if any, replays,
 * and that every configuration key is applied under it or refused. */
static int resolve_model(cli_t* cli, int limit_flag) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  if (cli->config.conf && gpumem_options_parse(&o, cli->config.conf) != GPUMEM_OK)
    return cli_error("bad --conf '%s': %s", cli->conf_rest, show_detail(gpumem_last_error()));
  gpumem_policy_t policy = cli->config.policy_set ? cli->config.policy : o.policy;
  if (cli->expandable >= 0) {
    const char* v = cli->expandable ? "True" : "False";
    if (cli->peer == PEER_ASYNC)
      return cli_error(
          "--conf expandable_segments:%s is a setting of PyTorch's caching allocator, and "
          "--policy async replays cudaMallocAsync instead: give one or the other",
          v);
    if (policy != GPUMEM_POLICY_PYTORCH)
      return cli_error(
          "--conf expandable_segments:%s is PyTorch's setting: give it with --policy pytorch "
          "(the %s policy has no such setting)",
          v, replay_policy_name(policy));
    if (cli->expandable == 1) cli->peer = PEER_EXPANDABLE;
  }
  /* --compare's columns take one conf between them, each the keys its
   * policy has (its help says so) */
  if (!cli->peer && !cli->compare) {
    policy_key_t env = {policy, "GPUMEM_CONF"}, flag = {policy, "--conf"};
    int rc = cli_each_key(cli_env_conf(), policy_key, &env);
    return rc ? rc : cli_each_key(cli->conf_rest, policy_key, &flag);
  }
  if (!cli->peer) return 0;
  model_key_t env = {cli, "GPUMEM_CONF"}, flag = {cli, "--conf"};
  int rc = cli_each_key(cli_env_conf(), model_key, &env);
  if (!rc) rc = cli_each_key(cli->conf_rest, model_key, &flag);
  if (rc) return rc;
  /* The explicit --limit or --limit-ratio wins over the configuration's. */
  if (!limit_flag) cli->config.limit_bytes = o.limit_bytes;
  if (o.limit_fraction > 0)
    cli->model_cap = (uint64_t)(o.limit_fraction * (double)cli->config.sim_capacity);
  return 0;
}

/* The same for a long. */
int cli_parse_long(const char* value, long min, long max, long* out) {
  char* end;
  errno = 0;
  long n = strtol(value, &end, 10);
  if (errno || end == value || *end || n < min || n > max) return 0;
  *out = n;
  return 1;
}

/* Parses argv (after the command) into cli. allowed is a bitmask of OPT_*
 * the command accepts. Returns 0, or the exit code after printing why. */
int cli_parse_args(int argc, char** argv, unsigned allowed, const char* usage, cli_t* cli) {
  int only_files = 0;
  const char* limit_text = NULL;
  const char* ratio_text = NULL;
  replay_config_init(&cli->config);
  cli->expandable = -1;
  cli->traces = calloc((size_t)argc + 1, sizeof *cli->traces);
  if (!cli->traces) return cli_error("out of host memory");

  for (int i = 0; i < argc; i++) {
    const char* arg = argv[i];
    if (only_files || arg[0] != '-' || arg[1] == '\0') {
      cli->traces[cli->num_traces++] = arg;
      continue;
    }
    if (strcmp(arg, "--") == 0) {
      only_files = 1;
      continue;
    }
    if (strcmp(arg, "-h") == 0) {
      cli->help = 1;
      continue;
    }
    if (arg[1] != '-') return cli_usage_error(usage, "unknown option '%s'", arg);

    /* --name value or --name=value */
    const char* name = arg + 2;
    const char* eq = strchr(name, '=');
    size_t name_len = eq ? (size_t)(eq - name) : strlen(name);
    const option_spec_t* spec = NULL;
    for (size_t k = 0; k < sizeof all_options / sizeof all_options[0]; k++) {
      if (strlen(all_options[k].name) == name_len &&
          memcmp(all_options[k].name, name, name_len) == 0 && (allowed >> all_options[k].id) & 1) {
        spec = &all_options[k];
      }
    }
    if (!spec) return cli_usage_error(usage, "unknown option '%.*s'", (int)name_len + 2, arg);
    const char* value = NULL;
    if (spec->takes_value) {
      if (eq) {
        value = eq + 1;
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return cli_usage_error(usage, "option '--%s' needs a value", spec->name);
      }
    } else if (eq) {
      return cli_usage_error(usage, "option '--%s' takes no value", spec->name);
    }

    replay_config_t* c = &cli->config;
    switch (spec->id) {
      case OPT_POLICY:
        if (strcmp(value, "default") == 0) {
          c->policy = GPUMEM_POLICY_DEFAULT;
        } else if (strcmp(value, "pytorch") == 0) {
          c->policy = GPUMEM_POLICY_PYTORCH;
        } else if (strcmp(value, "async") == 0 && (allowed >> OPT_PEER_MODELS) & 1) {
          c->policy = GPUMEM_POLICY_PYTORCH;
          cli->peer = PEER_ASYNC;
        } else {
          return cli_error("bad --policy '%s' (valid: default, pytorch%s)", value,
                           (allowed >> OPT_PEER_MODELS) & 1 ? ", async" : "");
        }
        c->policy_set = 1;
        break;
      case OPT_LIMIT:
        limit_text = value;
        break;
      case OPT_LIMIT_RATIO:
        ratio_text = value;
        break;
      case OPT_CONF: {
        /* PyTorch's own key selects the model of its expandable segments */
        if (peer_take_expandable(value, cli->conf_rest, sizeof cli->conf_rest, &cli->expandable) !=
            GPUMEM_OK)
          return cli_error("bad --conf '%s': %s", value, show_detail(gpumem_last_error()));
        if (cli->expandable >= 0 && !((allowed >> OPT_PEER_MODELS) & 1))
          return cli_error(
              "--conf expandable_segments is PyTorch's setting, modelled only by gpumem replay "
              "--policy pytorch (gpumem fit shows every allocator)");
        if (cli_check_conf_units("--conf", cli->conf_rest) != GPUMEM_OK)
          return cli_error("%s", gpumem_last_error());
        break;
      }
      case OPT_MEMORY:
        if (cli_parse_memory(value, &cli->memory) != GPUMEM_OK)
          return cli_error("%s", gpumem_last_error());
        break;
      case OPT_SIZES:
        cli->sizes = value;
        break;
      case OPT_BATCH:
        if (!cli_parse_long(value, 1, SCALE_MAX_BATCH, &cli->batch))
          return cli_usage_error(usage, "bad --batch '%s' (a batch size, 1 to %ld)", value,
                                 SCALE_MAX_BATCH);
        break;
      case OPT_MAX_BATCH:
        if (!cli_parse_long(value, 1, SCALE_MAX_BATCH, &cli->max_batch))
          return cli_usage_error(usage, "bad --max-batch '%s' (a batch size, 1 to %ld)", value,
                                 SCALE_MAX_BATCH);
        break;
      case OPT_PASSES:
        if (!cli_parse_count(value, 0, REPLAY_MAX_PASSES - 1, &c->warm_passes)) {
          return cli_error("bad --passes '%s' (a number of warm passes, 0 to %d)", value,
                           REPLAY_MAX_PASSES - 1);
        }
        break;
      case OPT_STEADY:
        if (!cli_parse_count(value, 1, 10000, &cli->steady)) {
          return cli_error("bad --steady '%s' (a number of repetitions, 1 to 10000)", value);
        }
        break;
      case OPT_STEP_MS: {
        char* end;
        errno = 0;
        double ms = strtod(value, &end);
        if (errno || end == value || *end || !(ms > 0 && ms <= 1e7)) {
          return cli_error("bad --step-ms '%s' (a step's time in milliseconds, above 0)", value);
        }
        c->step_ms = ms;
        break;
      }
      case OPT_STEPS:
        if (!cli_parse_count(value, 1, 100000000, &c->steps)) {
          return cli_error("bad --steps '%s' (the number of steps the trace holds, from 1)", value);
        }
        break;
      case OPT_DEVICE:
        if (strcmp(value, "sim") == 0) {
          c->device = REPLAY_DEVICE_SIM;
        } else if (strcmp(value, "cuda") == 0) {
          c->device = REPLAY_DEVICE_CUDA;
        } else {
          return cli_error("bad --device '%s' (valid: sim, cuda)", value);
        }
        break;
      case OPT_CAPACITY: {
        size_t cap = 0;
        if (cli_parse_size("--capacity", value, &cap) != GPUMEM_OK)
          return cli_error("%s", gpumem_last_error());
        if (cap == 0) return cli_error("bad --capacity '%s': must be above 0", value);
        c->sim_capacity = cap;
        break;
      }
      case OPT_MIN_LIMIT:
        cli->min_limit = 1;
        break;
      case OPT_MIN_LIMIT_TOLERANCE: {
        char* end;
        errno = 0;
        double f = strtod(value, &end);
        if (errno || end == value || *end || !(f > 0) || !(f < 1)) {
          return cli_error(
              "bad --min-limit-tolerance '%s' (a fraction of peak live, above 0 and "
              "below 1, e.g. 0.0025)",
              value);
        }
        c->min_limit_tolerance = f;
        cli->min_limit = 1;
        break;
      }
      case OPT_JSON:
        cli->json = 1;
        break;
      case OPT_COMPARE:
        cli->compare = 1;
        break;
      case OPT_DETAIL:
        cli->detail = 1;
        break;
      case OPT_SNAPSHOT:
        cli->snapshot = value;
        break;
      case OPT_WRITE_TRACE:
        cli->write_trace = value;
        break;
      case OPT_SINCE_LINE:
        if (!cli_parse_count(value, 1, INT_MAX, &cli->since_line))
          return cli_usage_error(usage, "bad --since-line '%s' (a trace line number, from 1)",
                                 value);
        break;
      case OPT_AT_LINE:
        if (!cli_parse_count(value, 1, INT_MAX, &cli->at_line))
          return cli_usage_error(usage, "bad --at-line '%s' (a trace line number, from 1)", value);
        break;
      case OPT_HELP:
        cli->help = 1;
        break;
      default:
        break;
    }
  }
  if (cli->help) return 0;

  /* One precedence for every command: GPUMEM_CONF, then --conf, then the
   * explicit flags (--policy, --limit, --limit-ratio), later ones winning
   * key by key. main() has already refused a bad GPUMEM_CONF. */
  if (cli_join_conf(cli->conf_rest, cli->conf_all, sizeof cli->conf_all) != 0)
    return cli_error("GPUMEM_CONF and --conf together are too long (%zu bytes at most)",
                     sizeof cli->conf_all - 1);
  cli->config.conf = cli->conf_all[0] ? cli->conf_all : NULL;

  if (limit_text && ratio_text) return cli_error("give either --limit or --limit-ratio, not both");
  if (limit_text) {
    size_t bytes = 0;
    if (cli_parse_size("--limit", limit_text, &bytes) != GPUMEM_OK)
      return cli_error("%s", gpumem_last_error());
    /* 0 means "no limit" inside; a limit that rounds to 0 is a mistake */
    if (bytes == 0) {
      return cli_error(
          "bad --limit '%s': expected a size of at least 1 byte (leave --limit out "
          "for none)",
          limit_text);
    }
    cli->config.limit_bytes = bytes;
  }
  if (ratio_text) {
    char* end;
    errno = 0;
    double r = strtod(ratio_text, &end);
    if (errno || end == ratio_text || *end || !(r > 0) || isinf(r)) {
      return cli_error("bad --limit-ratio '%s' (a positive number: the limit is R x peak live)",
                       ratio_text);
    }
    cli->config.limit_ratio = r;
  }
  /* A bad --conf is reported before any trace is read. */
  if (replay_check_config(&cli->config) != GPUMEM_OK) {
    return cli_error("bad --conf '%s': %s", cli->conf_rest, show_detail(gpumem_last_error()));
  }
  /* fit's rows run at their own settings: nothing of GPUMEM_CONF records */
  if (((allowed >> OPT_CONF) & 1) && cli_refuse_record(cli->conf_rest)) return EXIT_FAILURE;
  return resolve_model(cli, limit_text || ratio_text);
}

static double seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void progress_start(progress_t* p, const char* trace, const char* policy) {
  p->started = seconds();
  p->trace = trace;
  p->policy = policy;
}

void progress_show(void* arg, const char* what, size_t done, size_t total) {
  progress_t* p = arg;
  if (!p->enabled || seconds() - p->started < 0.5) return;
  char line[160];
  int n = snprintf(line, sizeof line, "%s [%s] %s %3.0f%%", p->trace, p->policy, what,
                   total ? 100.0 * (double)done / (double)total : 0.0);
  if (n < 0) return;
  if (n >= (int)sizeof line) n = (int)sizeof line - 1;
  /* Pad over a longer previous line rather than rely on terminal codes. */
  fprintf(stderr, "\r%s%*s", line, p->shown > n ? p->shown - n : 0, "");
  fflush(stderr);
  p->shown = n > p->shown ? n : p->shown;
}

void progress_clear(progress_t* p) {
  if (!p->shown) return;
  fprintf(stderr, "\r%*s\r", p->shown, "");
  fflush(stderr);
  p->shown = 0;
}

/* Loads every trace before replaying any, so that a typo in the last file
 * name fails at once, not after minutes of replay. */
int cli_load_all(const cli_t* cli, trace_t*** out) {
  trace_t** traces = calloc((size_t)cli->num_traces, sizeof *traces);
  if (!traces) return cli_error("out of host memory");
  for (int i = 0; i < cli->num_traces; i++) {
    if (trace_load(cli->traces[i], &traces[i]) != GPUMEM_OK) {
      int rc = cli_error("%s", show_detail(gpumem_last_error()));
      for (int j = 0; j < i; j++) trace_free(traces[j]);
      free(traces);
      return rc;
    }
    trace_t* longer = NULL;
    if (!cli->steady) continue;
    gpumem_status_t st = trace_repeat_tail(traces[i], cli->steady, &longer, NULL);
    if (st == GPUMEM_OK) {
      trace_free(traces[i]);
      traces[i] = longer;
    } else if (st == GPUMEM_ERR_INVALID_ARGUMENT) {
      fprintf(stderr, "gpumem: note: %s; replayed as it is\n", show_detail(gpumem_last_error()));
    } else {
      int rc = cli_error("%s", show_detail(gpumem_last_error()));
      for (int j = 0; j <= i; j++) trace_free(traces[j]);
      free(traces);
      return rc;
    }
  }
  *out = traces;
  return 0;
}

/* A real GPU is opened once up front, so that a machine without one says
 * so plainly, before any trace is read. */
int cli_check_device(const replay_config_t* config) {
  if (config->device != REPLAY_DEVICE_CUDA) return 0;
  gpumem_options_t opts;
  gpumem_t* gm = NULL;
  if (replay_options(config, NULL, &opts) != GPUMEM_OK ||
      replay_open(config, &opts, &gm) != GPUMEM_OK) {
    return cli_error("%s", show_detail(gpumem_last_error()));
  }
  gpumem_destroy(gm);
  return 0;
}

/* Replays one trace under config (and the min-limit bisection when asked);
 * returns 0 or prints the error and returns 1. */
/* The library's error about trace t, named by its path, exit 1. */
int cli_trace_error(const trace_t* t) {
  const char* msg = show_detail(gpumem_last_error());
  /* Trace-level messages already start with the path. */
  if (strncmp(msg, t->path, strlen(t->path)) == 0) return cli_error("%s", msg);
  return cli_error("%s: %s", t->path, msg);
}

int cli_run_one(const trace_t* t, const replay_config_t* config, int min_limit,
                progress_t* progress, replay_result_t* r) {
  replay_config_t c = *config;
  c.progress = progress_show;
  c.progress_arg = progress;
  /* The policy may come from --conf: label the progress with the one used. */
  gpumem_options_t opts;
  gpumem_policy_t policy = c.policy;
  if (replay_options(&c, t, &opts) == GPUMEM_OK) policy = opts.policy;
  progress_start(progress, t->name, replay_policy_name(policy));
  gpumem_status_t st = replay_trace(t, &c, r);
  if (st == GPUMEM_OK && min_limit) st = replay_min_limit(t, &c, r);
  progress_clear(progress);
  return st == GPUMEM_OK ? 0 : cli_trace_error(t);
}

/* One row of the table, with the progress line labelled by the row. */
int cli_fit_row(const trace_t* t, const fit_row_t* row, const cli_t* cli, progress_t* progress,
                fit_result_t* out) {
  replay_config_t base = cli->config;
  base.progress = progress_show;
  base.progress_arg = progress;
  progress_start(progress, t->name, row->name);
  gpumem_status_t st = fit_one(t, row, cli->memory, &base, out);
  progress_clear(progress);
  return st == GPUMEM_OK ? 0 : cli_trace_error(t);
}

/* Parses the arguments of a command that takes one trace. Returns -1 when
 * the command goes on, else its exit code (help printed, or a usage error;
 * cli->traces freed). */
int cli_parse_one_trace(int argc, char** argv, unsigned allowed, const char* usage, cli_t* cli) {
  memset(cli, 0, sizeof *cli);
  int rc = cli_parse_args(argc, argv, allowed, usage, cli);
  if (rc == 0 && cli->help) {
    fputs(usage, stdout);
  } else if (rc == 0 && cli->num_traces != 1) {
    rc = cli_usage_error(usage, cli->num_traces ? "one trace at a time" : "no trace given");
  } else if (rc == 0) {
    return -1;
  }
  free(cli->traces);
  return rc;
}

/* The trace of a one-trace command, and a slot per allocation for it. */
int cli_load_with_slots(const cli_t* cli, trace_t** t, void*** slots) {
  if (trace_load(cli->traces[0], t) != GPUMEM_OK)
    return cli_error("%s", show_detail(gpumem_last_error()));
  *slots = calloc((*t)->num_allocs ? (*t)->num_allocs : 1, sizeof **slots);
  return *slots ? 0 : cli_error("out of host memory");
}

int gm_text_write(const char* s, size_t len, void* arg) {
  gm_text_t* t = arg;
  if (t->len + len + 1 > t->cap) {
    size_t cap = (t->len + len + 1) * 2;
    char* grown = realloc(t->s, cap);
    if (!grown) return 1;
    t->s = grown;
    t->cap = cap;
  }
  memcpy(t->s + t->len, s, len);
  t->len += len;
  t->s[t->len] = '\0';
  return 0;
}

gpumem_status_t cli_parse_memory(const char* text, size_t* out) {
  size_t bytes = 0;
  /* 0 would ask whether the job fits in nothing: a mistake, not a question */
  if (gpumem_parse_size(text, &bytes) != GPUMEM_OK || bytes == 0) {
    gpumem_set_last_error("bad --memory '%s' (bytes with an optional K/M/G/T suffix, e.g. 80G)",
                          text);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  /* "80" parses as 80 bytes: refused with a hint rather than answered */
  if (cli_parse_size("--memory", text, &bytes) != GPUMEM_OK) return GPUMEM_ERR_INVALID_ARGUMENT;
  *out = bytes;
  return GPUMEM_OK;
}

/* ---- the configuration ------------------------------------------------ */

const char* cli_env_conf(void) {
  const char* env = getenv("GPUMEM_CONF");
  return env && env[0] ? env : NULL;
}

int cli_check_env_conf(void) {
  const char* env = cli_env_conf();
  if (!env) return 0;
  gpumem_options_t opts;
  gpumem_options_init(&opts);
  if (gpumem_options_parse(&opts, env) == GPUMEM_OK) return 0;
  const char* why = gpumem_last_error();
  if (strncmp(why, "gpumem config: ", 15) == 0) why += 15;
  cli_error("bad GPUMEM_CONF '%s': %s (unset it or fix it)", env, why);
  return 1;
}

int cli_join_conf(const char* conf, char* out, size_t cap) {
  const char* env = cli_env_conf();
  int both = env && conf && conf[0];
  int n = snprintf(out, cap, "%s%s%s", env ? env : "", both ? "," : "", conf ? conf : "");
  if (n < 0 || (size_t)n >= cap) {
    if (cap) out[0] = '\0';
    return -1;
  }
  return 0;
}

int cli_each_key(const char* conf, int (*fn)(const char* key, size_t len, void* arg), void* arg) {
  const char* p = conf ? conf : "";
  while (*p) {
    size_t item = strcspn(p, ",");
    size_t klen = strcspn(p, ":,");
    if (klen > item) klen = item;
    const char* k = p;
    while (klen && isspace((unsigned char)*k)) k++, klen--;
    while (klen && isspace((unsigned char)k[klen - 1])) klen--;
    if (klen) {
      int rc = fn(k, klen, arg);
      if (rc) return rc;
    }
    p += item;
    if (*p == ',') p++;
  }
  return 0;
}

typedef struct {
  const char* want;
} has_t;

int cli_refuse_record(const char* conf) {
  const char* source = cli_conf_has(cli_env_conf(), "record") ? "GPUMEM_CONF"
                       : cli_conf_has(conf, "record")         ? "--conf"
                                                              : NULL;
  if (!source) return 0;
  fprintf(stderr,
          "gpumem: %s key 'record' would record this replay as a trace (over the recording "
          "it reads, if the path is the same): leave it out for the trace commands\n",
          source);
  return 1;
}

static int has_key(const char* key, size_t len, void* arg) {
  const has_t* h = arg;
  return strlen(h->want) == len && strncasecmp(key, h->want, len) == 0;
}

int cli_conf_has(const char* conf, const char* key) {
  has_t h = {key};
  return cli_each_key(conf, has_key, &h);
}

/* Whether text (n bytes) is a bare number, with no unit. */
static int unitless(const char* text, size_t n) {
  while (n && isspace((unsigned char)text[n - 1])) n--;
  return n && (isdigit((unsigned char)text[n - 1]) || text[n - 1] == '.');
}

/* Whether text (n bytes) is a bare zero ("0", "0.0"): the same in every
 * unit, so a key's value needs none (map_ahead:0; limit:0 is refused by
 * the library, by name). */
static int bare_zero(const char* text, size_t n) {
  while (n && isspace((unsigned char)text[n - 1])) n--;
  size_t zeros = 0;
  for (size_t i = 0; i < n; i++) {
    if (text[i] == '0')
      zeros++;
    else if (text[i] != '.')
      return 0;
  }
  return zeros > 0;
}

/* "bad --limit '80': 80 bytes: did you mean 80G? write 80B for bytes" */
static void unit_message(const char* option, const char* text, size_t n) {
  while (n && isspace((unsigned char)text[n - 1])) n--;
  gpumem_set_last_error("bad %s '%.*s': %.*s bytes: did you mean %.*sG? write %.*sB for bytes",
                        option, (int)n, text, (int)n, text, (int)n, text, (int)n, text);
}

gpumem_status_t cli_parse_size(const char* option, const char* text, size_t* out) {
  size_t bytes = 0;
  if (gpumem_parse_size(text, &bytes) != GPUMEM_OK) {
    const char* why = gpumem_last_error();
    if (strncmp(why, "gpumem: ", 8) == 0) why += 8;
    char copy[512];
    snprintf(copy, sizeof copy, "%s", why);
    gpumem_set_last_error("bad %s '%s': %s", option, text, copy);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  if (unitless(text, strlen(text))) {
    unit_message(option, text, strlen(text));
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  *out = bytes;
  return GPUMEM_OK;
}

gpumem_status_t cli_check_conf_units(const char* option, const char* conf) {
  static const char* const size_keys[] = {"limit", "map_max", "map_ahead", "shared_limit"};
  const char* p = conf ? conf : "";
  while (*p) {
    size_t item = strcspn(p, ",");
    const char* colon = memchr(p, ':', item);
    if (colon) {
      const char* k = p;
      size_t klen = (size_t)(colon - p);
      while (klen && isspace((unsigned char)*k)) k++, klen--;
      while (klen && isspace((unsigned char)k[klen - 1])) klen--;
      const char* v = colon + 1;
      size_t vlen = item - (size_t)(v - p);
      while (vlen && isspace((unsigned char)*v)) v++, vlen--;
      for (size_t i = 0; i < sizeof size_keys / sizeof size_keys[0]; i++) {
        if (strlen(size_keys[i]) == klen && strncasecmp(k, size_keys[i], klen) == 0 &&
            unitless(v, vlen) && !bare_zero(v, vlen)) {
          char name[64];
          snprintf(name, sizeof name, "%s %.*s", option, (int)klen, k);
          unit_message(name, v, vlen);
          return GPUMEM_ERR_CONFIG;
        }
      }
    }
    p += item;
    if (*p == ',') p++;
  }
  return GPUMEM_OK;
}
