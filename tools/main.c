/* The gpumem command line: `replay` (one trace at a time, or --compare for
 * both policies side by side with the figures measured on an H200),
 * `summary`, `explain`, `leaks` and `fit`, and the dispatch to report, top
 * and run. Owns argument parsing, exit codes (2 usage, 1 error), the
 * human, JSON and table output, and the progress line. The replay itself
 * lives in replay.c; what every command reads alike (GPUMEM_CONF, its
 * precedence, sizes) in cliconf.c. */
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

#include "align.h"
#include "cliconf.h"
#include "gpumem.h"
#include "fit.h"
#include "internal.h" /* gm_format_bytes */
#include "jsonpickle.h"
#include "peer_models.h"
#include "replay.h"
#include "report.h"
#include "run.h"
#include "scale.h"
#include "shmfile.h" /* gm_pwrite_all */
#include "top.h"
#include "trace.h"

#define EXIT_USAGE 2
#define GIB 1073741824.0

/* ---- measured figures quoted from BENCHMARKS.md ----------------------- */

/* These are measurements on an NVIDIA H200 (BENCHMARKS.md, "Peers"), not
 * anything this program computes; they are shown beside our replay so the
 * reader can see where gpumem stands. Keyed by trace basename. */
typedef struct anchor {
  const char* trace;
  double torch_reserved;     /* PyTorch native: peak reserved / peak live */
  double best_reserved;      /* best of torch_exp and async */
  const char* best_peer;     /* which one */
  double torch_min_cap;      /* min cap / peak live, PyTorch native */
  double best_min_cap;       /* best of torch_exp and async */
  const char* best_cap_peer; /* which one */
} anchor_t;

static const anchor_t anchors[] = {
    {"gpt2_train", 1.1245, 1.0698, "exp", 1.1266, 1.0094, "exp"},
    {"resnet50_train", 1.1266, 1.0068, "exp", 1.0211, 1.0070, "exp"},
    {"llama_ckpt_train", 1.3514, 1.0968, "async", 1.1266, 1.0258, "exp"},
    {"t5_varlen_prefetch", 1.3497, 1.0354, "exp", 1.0328, 1.0141, "exp"},
};

static const anchor_t* find_anchor(const char* name) {
  for (size_t i = 0; i < sizeof anchors / sizeof anchors[0]; i++) {
    if (strcmp(anchors[i].trace, name) == 0) return &anchors[i];
  }
  return NULL;
}

/* ---- usage ------------------------------------------------------------ */

static const char usage_main[] =
    "usage: gpumem <command> [options]\n"
    "\n"
    "commands:\n"
    "  replay    replay allocation traces and report memory and host cost\n"
    "  summary   replay one trace and print the allocator's summary at its end\n"
    "  fit       does a job fit in N GiB under each allocator, and how much it needs\n"
    "  predict   a job's memory at another batch size, from recordings at small ones,\n"
    "            and the largest batch that fits N GiB under each allocator\n"
    "  explain   where reserved memory sits at the moment of peak reserved\n"
    "  leaks     the allocations a trace leaves live at its end\n"
    "  report    one HTML page about a trace: memory over time, the peak, leaks\n"
    "  top       the memory of every process using gpumem on this machine, live\n"
    "  run       run a command with gpumem as PyTorch's allocator in its Python processes\n"
    "\n"
    "Every command reads GPUMEM_CONF (the allocator's configuration) and refuses a\n"
    "bad one. Settings apply in this order, later ones winning key by key:\n"
    "GPUMEM_CONF, then --conf, then the explicit flags (--policy, --limit, ...).\n"
    "Sizes take a unit: 80G, 1.5GiB, 512M; bytes are written 4096B.\n"
    "\n"
    "Run 'gpumem <command> --help' for a command's options; 'gpumem --version'.\n";

static const char usage_replay[] =
    "usage: gpumem replay [options] TRACE...\n"
    "\n"
    "Replays each trace (gzip or plain text, traces/README.md, or a PyTorch\n"
    "memory snapshot pickle) through gpumem:\n"
    "one cold pass from an empty allocator, then warm passes from its cache.\n"
    "\n"
    "options:\n"
    "  --policy default|pytorch|async  allocation policy (default: default); async:\n"
    "                            a model of cudaMallocAsync (release threshold never)\n"
    "  --limit SIZE              hard cap on reserved memory (e.g. 12G, 1.5GiB)\n"
    "  --limit-ratio R           cap at R x each trace's peak live bytes\n"
    "  --conf STRING             configuration, GPUMEM_CONF grammar (key:value,...),\n"
    "                            over GPUMEM_CONF's keys; --policy and --limit override\n"
    "                            both. With --policy pytorch, expandable_segments:True\n"
    "                            replays a model of PyTorch's expandable segments; the\n"
    "                            models (it and async) take limit and fraction (of\n"
    "                            --capacity) and refuse other keys\n"
    "  --passes N                warm passes after the cold one (default 3)\n"
    "  --device sim|cuda         simulated device (default) or the real GPU\n"
    "  --capacity SIZE           simulated device memory (default 1T)\n"
    "  --min-limit               also bisect the smallest limit that replays the trace\n"
    "  --min-limit-tolerance F   stop the bisection within F x peak live (default: one\n"
    "                            page or 0.25%, the finer)\n"
    "  --steady N                append N repetitions of the trace's last period (a\n"
    "                            training step) and time them apart: a long run's\n"
    "                            steady state (traces that end in no period: as they are)\n"
    "  --step-ms MS              a step's time on the GPU: the mapping work priced at an\n"
    "                            H100's costs is also given as a share of the steps' time\n"
    "  --steps N                 how many steps the trace holds (with --step-ms)\n"
    "  --json                    one JSON object per trace (and policy) per line\n"
    "  --compare                 three columns side by side, beside measured H200 figures:\n"
    "                            pytorch, default, and hold (the default holding reserved\n"
    "                            memory at the high-water mark: placement:planned,\n"
    "                            move_budget:unlimited,headroom:0.002); --conf, --limit and\n"
    "                            GPUMEM_CONF apply to all three, each column taking the keys\n"
    "                            its policy has\n"
    "  -h, --help                this text\n";

static const char usage_summary[] =
    "usage: gpumem summary [options] TRACE\n"
    "\n"
    "Replays one cold pass of TRACE and prints the allocator's summary table\n"
    "(as torch.cuda.memory_summary) at the end of the trace, before anything\n"
    "still live is freed.\n"
    "\n"
    "options:\n"
    "  --policy default|pytorch  allocation policy (default: default)\n"
    "  --limit SIZE              hard cap on reserved memory\n"
    "  --conf STRING             configuration, GPUMEM_CONF grammar (key:value,...),\n"
    "                            over GPUMEM_CONF's keys; --policy, --limit override both\n"
    "  --device sim|cuda         simulated device (default) or the real GPU\n"
    "  --capacity SIZE           simulated device memory (default 1T)\n"
    "  --json                    the statistics as one JSON object instead\n"
    "  -h, --help                this text\n";

static const char usage_explain[] =
    "usage: gpumem explain [options] TRACE\n"
    "\n"
    "Replays one cold pass of TRACE, finds the event at which reserved memory\n"
    "peaked, replays again up to it and says where the reserved bytes beyond\n"
    "the live ones sit: rounding, partial pages at hole edges (large and\n"
    "small pool), cached free memory not yet reclaimed, memory waiting for\n"
    "other streams, spare pages.\n"
    "\n"
    "options:\n"
    "  --policy default|pytorch  allocation policy (default: default)\n"
    "  --limit SIZE              hard cap on reserved memory\n"
    "  --conf STRING             configuration, GPUMEM_CONF grammar (key:value,...),\n"
    "                            over GPUMEM_CONF's keys; --policy, --limit override both\n"
    "  --capacity SIZE           simulated device memory (default 1T)\n"
    "  --snapshot FILE           also write the allocator's snapshot at that event\n"
    "                            as a pickle of torch.cuda.memory._snapshot()'s shape:\n"
    "                            segments, blocks and the events so far, each tagged\n"
    "                            with its trace line; memory_viz opens it, and every\n"
    "                            gpumem command reads it as a TRACE (the job up to\n"
    "                            the peak)\n"
    "  -h, --help                this text\n";

static int usage_error(const char* usage, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Usage mistakes: say what was wrong and where the options are, exit 2.
 * The whole usage text would bury the one line that matters. usage is the
 * command's usage text, whose first line names the command. */
static int usage_error(const char* usage, const char* fmt, ...) {
  va_list ap;
  fputs("gpumem: ", stderr);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  static const char head[] = "usage: gpumem ";
  const char* cmd = strncmp(usage, head, sizeof head - 1) == 0 ? usage + sizeof head - 1 : "<";
  int n = cmd[0] == '<' ? 0 : (int)strcspn(cmd, " \n");
  fprintf(stderr, "\ntry 'gpumem %.*s%s--help'\n", n, cmd, n ? " " : "");
  return EXIT_USAGE;
}

static int error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

/* Errors: "gpumem: <message>", exit 1. */
static int error(const char* fmt, ...) {
  va_list ap;
  fputs("gpumem: ", stderr);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  return EXIT_FAILURE;
}

/* The library's messages may begin with "gpumem: " (or "gpumem config: ")
 * for programs that print them bare; ours already start with "gpumem: ". */
static const char* detail(const char* msg) {
  static const char* const prefixes[] = {"gpumem: ", "gpumem config: "};
  for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++) {
    size_t n = strlen(prefixes[i]);
    if (strncmp(msg, prefixes[i], n) == 0) return msg + n;
  }
  return msg;
}

/* ---- arguments -------------------------------------------------------- */

enum {
  OPT_POLICY,
  OPT_LIMIT,
  OPT_LIMIT_RATIO,
  OPT_CONF,
  OPT_PASSES,
  OPT_DEVICE,
  OPT_CAPACITY,
  OPT_MIN_LIMIT,
  OPT_MIN_LIMIT_TOLERANCE,
  OPT_STEADY,
  OPT_STEP_MS,
  OPT_STEPS,
  OPT_JSON,
  OPT_COMPARE,
  OPT_SNAPSHOT,
  OPT_SINCE_LINE,
  OPT_MEMORY,
  OPT_SIZES,
  OPT_BATCH,
  OPT_MAX_BATCH,
  OPT_WRITE_TRACE,
  OPT_HELP,
  OPT_PEER_MODELS, /* not an option: the command replays the peer models too */
};

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
    {"snapshot", OPT_SNAPSHOT, 1},
    {"since-line", OPT_SINCE_LINE, 1},
    {"memory", OPT_MEMORY, 1},
    {"batch-sizes", OPT_SIZES, 1},
    {"sizes", OPT_SIZES, 1}, /* the older name of --batch-sizes */
    {"batch", OPT_BATCH, 1},
    {"max-batch", OPT_MAX_BATCH, 1},
    {"write-trace", OPT_WRITE_TRACE, 1},
    {"help", OPT_HELP, 0},
};

typedef struct cli {
  replay_config_t config;
  int json;
  int compare;
  int min_limit;
  int steady; /* repetitions to append (0: none) */
  int help;
  const char* snapshot;    /* explain: write the snapshot at the peak here */
  const char* write_trace; /* predict: write the trace at --batch here */
  int since_line;          /* leaks: count allocations from this trace line on */
  peer_model_t peer;       /* replay through a model of another allocator */
  size_t memory;           /* fit: the device memory asked about */
  const char* sizes;       /* predict: the recordings' batch sizes, as given */
  long batch;              /* predict: the batch to predict at (0: none asked) */
  long max_batch;          /* predict: the largest batch the search tries (0: no cap) */
  char conf_rest[1024];    /* --conf without PyTorch's expandable_segments key */
  char conf_all[4096];     /* GPUMEM_CONF, then conf_rest: what the replays read */
  int expandable;          /* --conf's expandable_segments: 1, 0, or -1 when absent */
  uint64_t model_cap;      /* a peer model's cap from the fraction key (0: none) */
  const char** traces;
  int num_traces;
} cli_t;

/* A whole decimal number in [min, max] into *out; 0 when it is not one. */
static int parse_count(const char* value, long min, long max, int* out) {
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
  return error("%s key '%.*s' does not apply to the %s model: %s", m->source, (int)len, key, model,
               why);
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
  static const char* const vmm_only[] = {"reclaim", "headroom",  "move_budget", "placement",
                                         "map_max", "map_ahead", "move_guard",  "stream_waits",
                                         "lend",    "small_pool"};
  if (k->policy == GPUMEM_POLICY_DEFAULT) {
    if (len == 17 && strncasecmp(key, "max_split_size_mb", len) == 0)
      return error(
          "%s key 'max_split_size_mb' does not apply to the default policy: it is PyTorch's rule "
          "for its segments (--policy pytorch), and the default policy's arenas split any block",
          k->source);
    return 0;
  }
  for (size_t i = 0; i < sizeof vmm_only / sizeof vmm_only[0]; i++) {
    if (strlen(vmm_only[i]) == len && strncasecmp(key, vmm_only[i], len) == 0)
      return error(
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
    return error("bad --conf '%s': %s", cli->conf_rest, detail(gpumem_last_error()));
  gpumem_policy_t policy = cli->config.policy_set ? cli->config.policy : o.policy;
  if (cli->expandable >= 0) {
    const char* v = cli->expandable ? "True" : "False";
    if (cli->peer == PEER_ASYNC)
      return error(
          "--conf expandable_segments:%s is a setting of PyTorch's caching allocator, and "
          "--policy async replays cudaMallocAsync instead: give one or the other",
          v);
    if (policy != GPUMEM_POLICY_PYTORCH)
      return error(
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
static int parse_long(const char* value, long min, long max, long* out) {
  char* end;
  errno = 0;
  long n = strtol(value, &end, 10);
  if (errno || end == value || *end || n < min || n > max) return 0;
  *out = n;
  return 1;
}

/* Parses argv (after the command) into cli. allowed is a bitmask of OPT_*
 * the command accepts. Returns 0, or the exit code after printing why. */
static int parse_args(int argc, char** argv, unsigned allowed, const char* usage, cli_t* cli) {
  int only_files = 0;
  const char* limit_text = NULL;
  const char* ratio_text = NULL;
  replay_config_init(&cli->config);
  cli->expandable = -1;
  cli->traces = calloc((size_t)argc + 1, sizeof *cli->traces);
  if (!cli->traces) return error("out of host memory");

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
    if (arg[1] != '-') return usage_error(usage, "unknown option '%s'", arg);

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
    if (!spec) return usage_error(usage, "unknown option '%.*s'", (int)name_len + 2, arg);
    const char* value = NULL;
    if (spec->takes_value) {
      if (eq) {
        value = eq + 1;
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return usage_error(usage, "option '--%s' needs a value", spec->name);
      }
    } else if (eq) {
      return usage_error(usage, "option '--%s' takes no value", spec->name);
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
          return error("bad --policy '%s' (valid: default, pytorch%s)", value,
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
          return error("bad --conf '%s': %s", value, detail(gpumem_last_error()));
        if (cli->expandable >= 0 && !((allowed >> OPT_PEER_MODELS) & 1))
          return error(
              "--conf expandable_segments is PyTorch's setting, modelled only by gpumem replay "
              "--policy pytorch (gpumem fit shows every allocator)");
        if (cli_check_conf_units("--conf", cli->conf_rest) != GPUMEM_OK)
          return error("%s", gpumem_last_error());
        break;
      }
      case OPT_MEMORY:
        if (fit_parse_memory(value, &cli->memory) != GPUMEM_OK)
          return error("%s", gpumem_last_error());
        break;
      case OPT_SIZES:
        cli->sizes = value;
        break;
      case OPT_BATCH:
        if (!parse_long(value, 1, SCALE_MAX_BATCH, &cli->batch))
          return usage_error(usage, "bad --batch '%s' (a batch size, 1 to %ld)", value,
                             SCALE_MAX_BATCH);
        break;
      case OPT_MAX_BATCH:
        if (!parse_long(value, 1, SCALE_MAX_BATCH, &cli->max_batch))
          return usage_error(usage, "bad --max-batch '%s' (a batch size, 1 to %ld)", value,
                             SCALE_MAX_BATCH);
        break;
      case OPT_PASSES:
        if (!parse_count(value, 0, REPLAY_MAX_PASSES - 1, &c->warm_passes)) {
          return error("bad --passes '%s' (a number of warm passes, 0 to %d)", value,
                       REPLAY_MAX_PASSES - 1);
        }
        break;
      case OPT_STEADY:
        if (!parse_count(value, 1, 10000, &cli->steady)) {
          return error("bad --steady '%s' (a number of repetitions, 1 to 10000)", value);
        }
        break;
      case OPT_STEP_MS: {
        char* end;
        errno = 0;
        double ms = strtod(value, &end);
        if (errno || end == value || *end || !(ms > 0 && ms <= 1e7)) {
          return error("bad --step-ms '%s' (a step's time in milliseconds, above 0)", value);
        }
        c->step_ms = ms;
        break;
      }
      case OPT_STEPS:
        if (!parse_count(value, 1, 100000000, &c->steps)) {
          return error("bad --steps '%s' (the number of steps the trace holds, from 1)", value);
        }
        break;
      case OPT_DEVICE:
        if (strcmp(value, "sim") == 0) {
          c->device = REPLAY_DEVICE_SIM;
        } else if (strcmp(value, "cuda") == 0) {
          c->device = REPLAY_DEVICE_CUDA;
        } else {
          return error("bad --device '%s' (valid: sim, cuda)", value);
        }
        break;
      case OPT_CAPACITY: {
        size_t cap = 0;
        if (cli_parse_size("--capacity", value, &cap) != GPUMEM_OK)
          return error("%s", gpumem_last_error());
        if (cap == 0) return error("bad --capacity '%s': must be above 0", value);
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
          return error(
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
      case OPT_SNAPSHOT:
        cli->snapshot = value;
        break;
      case OPT_WRITE_TRACE:
        cli->write_trace = value;
        break;
      case OPT_SINCE_LINE:
        if (!parse_count(value, 1, INT_MAX, &cli->since_line))
          return usage_error(usage, "bad --since-line '%s' (a trace line number, from 1)", value);
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
    return error("GPUMEM_CONF and --conf together are too long (%zu bytes at most)",
                 sizeof cli->conf_all - 1);
  cli->config.conf = cli->conf_all[0] ? cli->conf_all : NULL;

  if (limit_text && ratio_text) return error("give either --limit or --limit-ratio, not both");
  if (limit_text) {
    size_t bytes = 0;
    if (cli_parse_size("--limit", limit_text, &bytes) != GPUMEM_OK)
      return error("%s", gpumem_last_error());
    /* 0 means "no limit" inside; a limit that rounds to 0 is a mistake */
    if (bytes == 0) {
      return error(
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
      return error("bad --limit-ratio '%s' (a positive number: the limit is R x peak live)",
                   ratio_text);
    }
    cli->config.limit_ratio = r;
  }
  /* A bad --conf is reported before any trace is read. */
  if (replay_check_config(&cli->config) != GPUMEM_OK) {
    return error("bad --conf '%s': %s", cli->conf_rest, detail(gpumem_last_error()));
  }
  /* fit's rows run at their own settings: nothing of GPUMEM_CONF records */
  if (((allowed >> OPT_CONF) & 1) && cli_refuse_record(cli->conf_rest)) return EXIT_FAILURE;
  return resolve_model(cli, limit_text || ratio_text);
}

/* ---- progress --------------------------------------------------------- */

/* A one-line progress display on stderr, only for a person at a terminal
 * (never in logs or pipes), and only once work has run long enough to be
 * worth watching. */
typedef struct progress {
  int enabled;
  double started;
  int shown; /* characters on the line now */
  const char* trace;
  const char* policy;
} progress_t;

static double seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void progress_start(progress_t* p, const char* trace, const char* policy) {
  p->started = seconds();
  p->trace = trace;
  p->policy = policy;
}

static void progress_show(void* arg, const char* what, size_t done, size_t total) {
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

static void progress_clear(progress_t* p) {
  if (!p->shown) return;
  fprintf(stderr, "\r%*s\r", p->shown, "");
  fflush(stderr);
  p->shown = 0;
}

/* ---- formatting ------------------------------------------------------- */

/* 1234567 -> "1,234,567" (buf of at least 32 bytes). */
static const char* fmt_count(uint64_t v, char* buf) {
  char tmp[32];
  int n = snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
  int o = 0;
  for (int i = 0; i < n; i++) {
    if (i > 0 && (n - i) % 3 == 0) buf[o++] = ',';
    buf[o++] = tmp[i];
  }
  buf[o] = '\0';
  return buf;
}

/* The first line of a message, for one-line reports; long ones are cut
 * with "..." (the JSON output carries the whole text). */
static const char* first_line(const char* msg, char* buf, size_t cap) {
  size_t n = strcspn(msg, "\n");
  int cut = 0;
  if (n > 300) n = 300;
  if (n >= cap - 4) n = cap - 4;
  if (msg[n] != '\0' && msg[n] != '\n') cut = 1;
  memcpy(buf, msg, n);
  if (cut) memcpy(buf + n, "...", 3);
  buf[n + (cut ? 3 : 0)] = '\0';
  return buf;
}

static void json_string(FILE* f, const char* s) {
  gm_emitter e = {gpumem_write_to_file, f, 0};
  gm_emit_json_string(&e, s);
}

static void json_calls(FILE* f, const uint64_t* calls) {
  fputc('{', f);
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) {
    fprintf(f, "%s\"%s\":%llu", k ? "," : "", gpumem_backend_call_name(k),
            (unsigned long long)calls[k]);
  }
  fputc('}', f);
}

static uint64_t sum_calls(const uint64_t* calls) {
  uint64_t n = 0;
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) n += calls[k];
  return n;
}

static double per_1k(uint64_t calls, uint64_t ops) {
  return ops ? 1000.0 * (double)calls / (double)ops : 0;
}

/* What the mapping calls of a replay on the simulated device would take on
 * a GPU, per operation: the simulated device prices them at a few hundred
 * instructions, an H100 at tens of microseconds, so a workload that keeps
 * moving pages looks cheap here and is not there. Per-call costs measured
 * on an H100 (bench/gpu/vmm_cost.c, 2026-11-22, docs/design.md): create
 * 12.7 us, map with its access grant 35.1 us, unmap 19.6 us, release 18.4
 * us. Other calls (events, synchronizations) are left out. Measured
 * against replays through CUDA (2026-11-25, on an H100): synth_random's warm
 * pass 16.3 estimated, 16.9 us/op measured. */
/* The pytorch policy's plain segments (PyTorch's cudaMalloc growth) are
 * priced too, so that a cold start can be set beside native's: cuMemAlloc
 * and cuMemFree measured on an H200 (bench/gpu/vmm_cost.c, 2026-11-27; 2 MiB
 * 100.0 / 44.0 us, 20 MiB 42.9 / 38.6, 1 GiB 119.8 / 339.9): the cheapest
 * size's, so native's cost is if anything understated. */
#define EST_ALLOC_US 42.9
#define EST_FREE_US 38.6

static double est_map_us(const uint64_t* calls) {
  return 12.7 * (double)calls[GPUMEM_CALL_create_page] + 35.1 * (double)calls[GPUMEM_CALL_map] +
         19.6 * (double)calls[GPUMEM_CALL_unmap] + 18.4 * (double)calls[GPUMEM_CALL_release_page] +
         EST_ALLOC_US * (double)calls[GPUMEM_CALL_alloc] +
         EST_FREE_US * (double)calls[GPUMEM_CALL_free];
}

static double est_map_us_per_op(const uint64_t* calls, uint64_t ops) {
  return ops ? est_map_us(calls) / (double)ops : 0.0;
}

/* The expandable-segments model's growth, priced the same way: PyTorch
 * makes every page (2 MiB small pool, 20 MiB large) a physical allocation
 * of its own and maps it on its own, then grants access over the range
 * once; on the H100 a grant costs 29.7 us per mapping it covers even when
 * one call covers 512 (bench/gpu/vmm_cost.c). So a page is a create
 * (12.7), a map (1.5) and its share of the grant (29.7), at the 2 MiB
 * page's prices: a 20 MiB page's, if anything, are higher. The
 * cudaMallocAsync model is not priced: its pool's growth is the driver's,
 * whose calls are not observable. */
#define EST_EXPANDABLE_PAGE_US (12.7 + 1.5 + 29.7)

static double est_expandable_us_per_op(uint64_t pages, size_t ops) {
  return ops ? EST_EXPANDABLE_PAGE_US * (double)pages / (double)ops : 0.0;
}

/* The second half of the cold pass as a share of its operations (steps
 * are taken to be spread evenly over the operations). */
static double half_share(const replay_result_t* r) {
  return r->ops_cold ? (double)r->cold_half_ops / (double)r->ops_cold : 0.5;
}

/* The cap a replay of t (NULL: before any trace, so no --limit-ratio)
 * runs under: the limit from the flags or the configuration, or the
 * configuration's fraction of the simulated device, the smaller; 0: none.
 * (On a GPU the fraction's bytes are known only once it is open.) */
static uint64_t effective_cap(const replay_config_t* c, const trace_t* t) {
  gpumem_options_t o;
  if (replay_options(c, t, &o) != GPUMEM_OK) return 0;
  uint64_t cap = o.limit_bytes;
  if (o.limit_fraction > 0 && c->device == REPLAY_DEVICE_SIM) {
    uint64_t f = (uint64_t)(o.limit_fraction * (double)c->sim_capacity);
    if (!cap || f < cap) cap = f;
  }
  return cap;
}

/* column: the --compare column the row belongs to (NULL: not compared). */
static void print_json(FILE* f, const trace_t* t, const replay_config_t* c,
                       const replay_result_t* r, const anchor_t* anchor, const char* column) {
  fputs("{\"trace\":", f);
  json_string(f, t->path);
  fputs(",\"name\":", f);
  json_string(f, t->name);
  fprintf(f, ",\"policy\":\"%s\",\"device\":\"%s\"", replay_policy_name(r->policy),
          replay_device_name(c->device));
  if (column) fprintf(f, ",\"column\":\"%s\"", column);
  fputs(",\"conf\":", f);
  if (c->conf && c->conf[0]) {
    json_string(f, c->conf);
  } else {
    fputs("null", f);
  }
  fprintf(f, ",\"events\":%zu,\"allocations\":%zu,\"streams\":%zu", t->num_events, t->num_allocs,
          t->num_streams);
  fprintf(f, ",\"peak_live_bytes\":%llu,\"peak_live_event\":%zu",
          (unsigned long long)t->peak_live_bytes, t->peak_event);
  fprintf(f, ",\"peak_reserved_bytes\":%llu,\"reserved_ratio\":%.4f",
          (unsigned long long)r->peak_reserved_bytes, r->reserved_ratio);
  if (t->recorded_peak_reserved)
    fprintf(f, ",\"recorded_peak_reserved_bytes\":%llu",
            (unsigned long long)t->recorded_peak_reserved);
  fprintf(f, ",\"ns_per_op_cold\":%.1f", r->ns_per_op_cold);
  if (r->ns_per_op_warm >= 0) {
    fprintf(f, ",\"ns_per_op_warm\":%.1f", r->ns_per_op_warm);
  } else {
    fputs(",\"ns_per_op_warm\":null", f);
  }
  fprintf(f, ",\"warm_passes\":%d,\"ops_cold\":%llu,\"ops_warm\":%llu", r->warm_passes,
          (unsigned long long)r->ops_cold, (unsigned long long)r->ops_warm);
  if (r->oom) {
    fprintf(f, ",\"oom\":true,\"oom_pass\":%d,\"oom_event\":%zu,\"oom_line\":%u,\"oom_size\":%zu",
            r->oom_pass, r->oom_event, r->oom_line, r->oom_size);
    fprintf(f, ",\"oom_status\":\"%s\",\"oom_message\":", gpumem_strerror(r->oom_status));
    json_string(f, r->oom_message);
  } else {
    fputs(",\"oom\":false,\"oom_event\":null", f);
  }
  uint64_t cap = effective_cap(c, t);
  if (cap) {
    fprintf(f, ",\"limit_bytes\":%llu", (unsigned long long)cap);
  } else {
    fputs(",\"limit_bytes\":null", f);
  }
  fputs(",\"backend_calls\":", f);
  json_calls(f, r->backend_calls_cold);
  fputs(",\"backend_calls_warm\":", f);
  json_calls(f, r->backend_calls_warm);
  if (c->device == REPLAY_DEVICE_SIM) {
    fprintf(f, ",\"est_h100_map_us_per_op_cold\":%.3f",
            est_map_us_per_op(r->backend_calls_cold, r->ops_cold));
    fprintf(f, ",\"est_h100_map_us_per_op_cold_second_half\":%.3f",
            est_map_us_per_op(r->cold_half_calls, r->cold_half_ops));
    if (c->step_ms > 0 && c->steps > 0) {
      double step_us = c->step_ms * 1000.0 * (double)c->steps;
      fprintf(f, ",\"step_ms\":%g,\"steps\":%d,\"est_h100_map_share_of_time_cold\":%.5f",
              c->step_ms, c->steps, est_map_us(r->backend_calls_cold) / step_us);
      fprintf(f, ",\"est_h100_map_share_of_time_cold_second_half\":%.5f",
              est_map_us(r->cold_half_calls) / (step_us * half_share(r)));
    }
    if (r->warm_passes)
      fprintf(f, ",\"est_h100_map_us_per_op_warm\":%.3f",
              est_map_us_per_op(r->backend_calls_warm, r->ops_warm));
  }
  fprintf(f, ",\"num_syncs\":%lld,\"num_syncs_warm\":%lld", (long long)r->num_syncs_cold,
          (long long)r->num_syncs_warm);
  fprintf(f, ",\"num_alloc_retries\":%lld,\"num_alloc_retries_warm\":%lld",
          (long long)r->num_alloc_retries_cold, (long long)r->num_alloc_retries_warm);
  if (r->warm_passes) {
    fprintf(
        f, ",\"warm_peak_reserved_bytes\":%llu,\"warm_reserved_ratio\":%.4f",
        (unsigned long long)r->warm_peak_reserved_bytes,
        t->peak_live_bytes ? (double)r->warm_peak_reserved_bytes / (double)t->peak_live_bytes : 0);
  }
  if (r->steady_ops) {
    fprintf(f, ",\"steady_period\":%zu,\"steady_steps\":%d,\"steady_ops\":%llu", t->steady_period,
            t->steady_reps, (unsigned long long)r->steady_ops);
    fprintf(f, ",\"ns_per_op_steady\":%.1f,\"num_syncs_steady\":%lld,\"backend_calls_steady\":",
            r->steady_ns_per_op, (long long)r->steady_syncs);
    json_calls(f, r->steady_calls);
  }
  fprintf(f,
          ",\"num_plans\":%lld,\"num_plan_drops\":%lld,\"num_planned_allocs\":%lld,"
          "\"num_pages_aliased\":%lld,\"num_move_guard_trips\":%lld,\"num_plans_declined\":%lld,"
          "\"num_plans_shared\":%lld",
          (long long)r->stats_final.num_plans, (long long)r->stats_final.num_plan_drops,
          (long long)r->stats_final.num_planned_allocs, (long long)r->stats_final.num_pages_aliased,
          (long long)r->stats_final.num_move_guard_trips,
          (long long)r->stats_final.num_plans_declined, (long long)r->stats_final.num_plans_shared);
  if (r->min_limit_done) {
    if (r->min_limit_found) {
      fprintf(f, ",\"min_limit_bytes\":%zu,\"min_limit_ratio\":%.4f", r->min_limit_bytes,
              r->min_limit_ratio);
    } else {
      fputs(",\"min_limit_bytes\":null,\"min_limit_ratio\":null,\"min_limit_message\":", f);
      json_string(f, r->min_limit_message);
    }
    fprintf(f, ",\"min_limit_probes\":%d", r->min_limit_probes);
  }
  if (anchor) {
    fprintf(f, ",\"h200_pytorch_reserved_ratio\":%.4f,\"h200_best_peer_reserved_ratio\":%.4f",
            anchor->torch_reserved, anchor->best_reserved);
  }
  fputs("}\n", f);
  fflush(f);
}

static void print_calls_line(FILE* f, const char* label, const uint64_t* calls, uint64_t ops) {
  fprintf(f, "  %-16s", label);
  if (sum_calls(calls) == 0) {
    fputs("none\n", f);
    return;
  }
  /* Wrapped under the label column, to stay readable in 100 columns. */
  int col = 18, first = 1;
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) {
    if (!calls[k]) continue;
    char item[96];
    int n = snprintf(item, sizeof item, "%s %llu (%.2f/1k ops)", gpumem_backend_call_name(k),
                     (unsigned long long)calls[k], per_1k(calls[k], ops));
    if (!first && col + 2 + n > 100) {
      fprintf(f, ",\n%18s", "");
      col = 18;
    } else if (!first) {
      fputs(", ", f);
      col += 2;
    }
    fputs(item, f);
    col += n;
    first = 0;
  }
  fputc('\n', f);
}

static void print_human(FILE* f, const trace_t* t, const replay_config_t* c,
                        const replay_result_t* r) {
  char a[32], b[32], d[32], msg[512];
  fprintf(f, "%s (%s)\n", t->name, t->path);
  fprintf(f, "  %-16s%s on the %s device, ", "policy", replay_policy_name(r->policy),
          c->device == REPLAY_DEVICE_CUDA ? "CUDA" : "simulated");
  uint64_t cap = effective_cap(c, t);
  if (cap) {
    fprintf(f, "limit %.3f GiB (%llu bytes)\n", (double)cap / GIB, (unsigned long long)cap);
  } else {
    fputs("no limit\n", f);
  }
  fprintf(f, "  %-16s%s (%s allocations, %s frees", "events", fmt_count(t->num_events, a),
          fmt_count(t->num_allocs, b), fmt_count(t->num_frees, d));
  if (t->num_record_streams) fprintf(f, ", %zu record_stream", t->num_record_streams);
  fprintf(f, "), %zu stream%s\n", t->num_streams, t->num_streams == 1 ? "" : "s");
  fprintf(f, "  %-16s%.3f GiB (%llu bytes) at event %zu\n", "peak live",
          (double)t->peak_live_bytes / GIB, (unsigned long long)t->peak_live_bytes, t->peak_event);
  fprintf(f, "  %-16s%.3f GiB (%llu bytes), %.4f x peak live%s\n", "peak reserved",
          (double)r->peak_reserved_bytes / GIB, (unsigned long long)r->peak_reserved_bytes,
          r->reserved_ratio, r->oom && r->oom_pass == 0 ? " (up to the failure)" : "");
  if (t->recorded_peak_reserved) {
    fprintf(f,
            "  %-16s%.3f GiB (%llu bytes) in the snapshot's segment events; replayed / "
            "recorded %.4f\n",
            "recorded peak", (double)t->recorded_peak_reserved / GIB,
            (unsigned long long)t->recorded_peak_reserved,
            (double)r->peak_reserved_bytes / (double)t->recorded_peak_reserved);
  }
  if (r->warm_passes && t->peak_live_bytes) {
    fprintf(f, "  %-16s%.3f GiB, %.4f x peak live\n", "reserved (warm)",
            (double)r->warm_peak_reserved_bytes / GIB,
            (double)r->warm_peak_reserved_bytes / (double)t->peak_live_bytes);
  }
  if (r->stats_final.num_plans) {
    fprintf(f, "  %-16s%lld built, %lld dropped, %lld allocations placed by a plan\n", "plans",
            (long long)r->stats_final.num_plans, (long long)r->stats_final.num_plan_drops,
            (long long)r->stats_final.num_planned_allocs);
  }
  if (r->stats_final.num_plans_shared) {
    fprintf(f,
            "  %-16s%lld with one arena for all their streams: the streams peak apart, and "
            "memory passes between them ordered on the device (stream waits)\n",
            "plans", (long long)r->stats_final.num_plans_shared);
  }
  if (r->stats_final.num_plans_declined) {
    fprintf(f,
            "  %-16s%lld declined: the streams peak apart, and an arena per stream would hold "
            "more than the loop has live\n",
            "plans", (long long)r->stats_final.num_plans_declined);
  }
  if (r->stats_final.num_pages_aliased) {
    fprintf(f, "  %-16s%lld (a partly used page shared by a request that did not fit)\n",
            "pages shared", (long long)r->stats_final.num_pages_aliased);
  }
  if (r->stats_final.num_move_guard_trips) {
    fprintf(f,
            "  %-16spages kept moving with no plan serving: grew instead of moving from then on "
            "(move_guard:off holds memory at the high-water mark)\n",
            "move guard");
  }
  fprintf(f, "  %-16scold %.1f", "ns/op", r->ns_per_op_cold);
  if (r->ns_per_op_warm >= 0) {
    fprintf(f, ", warm %.1f (median of %d pass%s)\n", r->ns_per_op_warm, r->warm_passes,
            r->warm_passes == 1 ? "" : "es");
  } else {
    fputs(", warm -\n", f);
  }
  if (r->oom) {
    fprintf(f, "  %-16syes: %s pass, event %zu (line %u), %zu bytes: %s\n", "oom",
            r->oom_pass ? "warm" : "cold", r->oom_event, r->oom_line, r->oom_size,
            first_line(r->oom_message[0] ? detail(r->oom_message) : gpumem_strerror(r->oom_status),
                       msg, sizeof msg));
  } else {
    fprintf(f, "  %-16sno\n", "oom");
  }
  if (r->steady_ops) {
    fprintf(f,
            "  %-16s%d more steps of %zu allocations (in the cold pass): %.1f ns/op, %lld syncs\n",
            "steady state", t->steady_reps, t->steady_period, r->steady_ns_per_op,
            (long long)r->steady_syncs);
    print_calls_line(f, "calls (steady)", r->steady_calls, r->steady_ops);
  }
  print_calls_line(f, "calls (cold)", r->backend_calls_cold, r->ops_cold);
  if (r->warm_passes) print_calls_line(f, "calls (warm)", r->backend_calls_warm, r->ops_warm);
  if (c->device == REPLAY_DEVICE_SIM && sum_calls(r->backend_calls_cold)) {
    fprintf(f, "  %-16s~%.3f us/op over the first pass, ~%.3f over its second half", "on an H100",
            est_map_us_per_op(r->backend_calls_cold, r->ops_cold),
            est_map_us_per_op(r->cold_half_calls, r->cold_half_ops));
    if (r->warm_passes)
      fprintf(f, ", ~%.3f warm", est_map_us_per_op(r->backend_calls_warm, r->ops_warm));
    fputs(" in mapping calls (priced per call)\n", f);
    if (c->step_ms > 0 && c->steps > 0) {
      double step_us = c->step_ms * 1000.0 * (double)c->steps;
      fprintf(f,
              "  %-16s%.3f%% of %d steps of %g ms in the first pass, %.3f%% in its second half\n",
              "share of time", 100.0 * est_map_us(r->backend_calls_cold) / step_us, c->steps,
              c->step_ms, 100.0 * est_map_us(r->cold_half_calls) / (step_us * half_share(r)));
    }
  }
  fprintf(f, "  %-16scold %lld, warm %lld\n", "syncs", (long long)r->num_syncs_cold,
          (long long)r->num_syncs_warm);
  fprintf(f, "  %-16scold %lld, warm %lld\n", "alloc retries", (long long)r->num_alloc_retries_cold,
          (long long)r->num_alloc_retries_warm);
  if (r->min_limit_done) {
    if (r->min_limit_found) {
      fprintf(f, "  %-16s%.3f GiB (%zu bytes), %.4f x peak live (%d probes)\n", "min limit",
              (double)r->min_limit_bytes / GIB, r->min_limit_bytes, r->min_limit_ratio,
              r->min_limit_probes);
    } else {
      fprintf(f, "  %-16snot found: %s\n", "min limit",
              first_line(r->min_limit_message, msg, sizeof msg));
    }
  }
  fputc('\n', f);
  fflush(f);
}

/* ---- replay ----------------------------------------------------------- */

/* Loads every trace before replaying any, so that a typo in the last file
 * name fails at once, not after minutes of replay. */
static int load_all(const cli_t* cli, trace_t*** out) {
  trace_t** traces = calloc((size_t)cli->num_traces, sizeof *traces);
  if (!traces) return error("out of host memory");
  for (int i = 0; i < cli->num_traces; i++) {
    if (trace_load(cli->traces[i], &traces[i]) != GPUMEM_OK) {
      int rc = error("%s", detail(gpumem_last_error()));
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
      fprintf(stderr, "gpumem: note: %s; replayed as it is\n", detail(gpumem_last_error()));
    } else {
      int rc = error("%s", detail(gpumem_last_error()));
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
static int check_device(const replay_config_t* config) {
  if (config->device != REPLAY_DEVICE_CUDA) return 0;
  gpumem_options_t opts;
  gpumem_t* gm = NULL;
  if (replay_options(config, NULL, &opts) != GPUMEM_OK ||
      replay_open(config, &opts, &gm) != GPUMEM_OK) {
    return error("%s", detail(gpumem_last_error()));
  }
  gpumem_destroy(gm);
  return 0;
}

/* Replays one trace under config (and the min-limit bisection when asked);
 * returns 0 or prints the error and returns 1. */
/* The library's error about trace t, named by its path, exit 1. */
static int trace_error(const trace_t* t) {
  const char* msg = detail(gpumem_last_error());
  /* Trace-level messages already start with the path. */
  if (strncmp(msg, t->path, strlen(t->path)) == 0) return error("%s", msg);
  return error("%s: %s", t->path, msg);
}

static int run_one(const trace_t* t, const replay_config_t* config, int min_limit,
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
  return st == GPUMEM_OK ? 0 : trace_error(t);
}

static void cell_ratio(char* buf, size_t cap, const replay_result_t* r, int ok) {
  if (!ok) {
    snprintf(buf, cap, "error");
  } else if (r->oom) {
    snprintf(buf, cap, "OOM");
  } else {
    snprintf(buf, cap, "%.4f", r->reserved_ratio);
  }
}

static void cell_min(char* buf, size_t cap, const replay_result_t* r, int ok) {
  if (!ok || !r->min_limit_done) {
    snprintf(buf, cap, "error");
  } else if (!r->min_limit_found) {
    snprintf(buf, cap, "none");
  } else {
    snprintf(buf, cap, "%.4f", r->min_limit_ratio);
  }
}

static void cell_anchor(char* buf, size_t cap, double v, const char* who) {
  if (who) {
    snprintf(buf, cap, "%.4f %s", v, who);
  } else if (v > 0) {
    snprintf(buf, cap, "%.4f", v);
  } else {
    snprintf(buf, cap, "-");
  }
}

/* A table row built piece by piece, printed without trailing blanks. */
typedef struct row {
  char text[1024];
  size_t len;
} row_t;

static void row_add(row_t* r, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

static void row_add(row_t* r, const char* fmt, ...) {
  if (r->len >= sizeof r->text - 1) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(r->text + r->len, sizeof r->text - r->len, fmt, ap);
  va_end(ap);
  if (n > 0) r->len += (size_t)n;
  if (r->len > sizeof r->text - 1) r->len = sizeof r->text - 1;
}

static void row_print(row_t* r) {
  while (r->len > 0 && r->text[r->len - 1] == ' ') r->len--;
  r->text[r->len] = '\0';
  puts(r->text);
  fflush(stdout);
  r->len = 0;
}

/* One table for every trace under both policies: what BENCHMARKS.md reports
 * for the peers, computed here for gpumem, with the measured H200 figures
 * beside it, and what the default's mapping calls would cost on a GPU.
 * Rows are printed as each trace finishes. */
static int cmd_compare(const cli_t* cli, trace_t** traces, progress_t* progress) {
  /* pytorch; default; default holding memory at the high-water mark
   * whatever the moves cost (planned placement, no move budget) */
  enum { NCOL = 3 };
  static const gpumem_policy_t policies[NCOL] = {GPUMEM_POLICY_PYTORCH, GPUMEM_POLICY_DEFAULT,
                                                 GPUMEM_POLICY_DEFAULT};
  static const char* const columns[NCOL] = {"pytorch", "default", "hold"};
  char hold_conf[512];
  snprintf(
      hold_conf, sizeof hold_conf, "%s%splacement:planned,move_budget:unlimited,headroom:0.002",
      cli->config.conf ? cli->config.conf : "", cli->config.conf && cli->config.conf[0] ? "," : "");
  const int mins = cli->min_limit;
  int failed = 0;
  int name_w = 5; /* "trace" */
  row_t row = {{0}, 0};
  replay_result_t* r = malloc(NCOL * sizeof *r);
  if (!r) return error("out of host memory");
  for (int i = 0; i < cli->num_traces; i++) {
    int n = (int)strlen(traces[i]->name);
    if (n > name_w) name_w = n > 60 ? 60 : n;
  }

  if (!cli->json) {
    const char* limit_note = "no limit";
    char limit_buf[96];
    uint64_t cap = effective_cap(&cli->config, NULL);
    if (cap) {
      snprintf(limit_buf, sizeof limit_buf, "limit %.3f GiB", (double)cap / GIB);
      limit_note = limit_buf;
    } else if (cli->config.limit_ratio > 0) {
      snprintf(limit_buf, sizeof limit_buf, "limit %.4f x peak live", cli->config.limit_ratio);
      limit_note = limit_buf;
    }
    printf(
        "Peak reserved / peak live: gpumem replayed here (%s device, %s), beside figures\n"
        "MEASURED on an NVIDIA H200 and quoted from BENCHMARKS.md. Columns: pytorch = the pytorch\n"
        "policy; default = the default policy (memory moves only when something needs it);\n"
        "hold = the default holding reserved memory at the high-water mark whatever it costs\n"
        "(placement:planned,move_budget:unlimited,headroom:0.002).\n\n",
        cli->config.device == REPLAY_DEVICE_CUDA ? "CUDA" : "simulated", limit_note);
    row_add(&row, "%-*s %10s | %-25s | %-22s | %-25s | %-16s", name_w, "", "", "replayed here",
            "H200, BENCHMARKS.md", "us/op, 1st pass", "us/op, 2nd half");
    if (mins) row_add(&row, " | %-25s | %-22s", "min limit", "H200 min cap (measured)");
    row_print(&row);
    row_add(&row, "%-*s %10s | %7s  %7s  %7s | %-8s  %-12s | %7s  %7s  %7s | %7s  %7s", name_w,
            "trace", "peak live", "pytorch", "default", "hold", "PyTorch", "best peer", "pytorch",
            "default", "hold", "default", "hold");
    if (mins)
      row_add(&row, " | %7s  %7s  %7s | %-8s  %-12s", "pytorch", "default", "hold", "PyTorch",
              "best peer");
    row_print(&row);
    int width = name_w + 1 + 10 + 3 + 25 + 3 + 22 + 3 + 25 + 3 + 16 + (mins ? 3 + 25 + 3 + 22 : 0);
    for (int i = 0; i < width && row.len < sizeof row.text - 1; i++) row.text[row.len++] = '-';
    row_print(&row);
  }

  for (int i = 0; i < cli->num_traces; i++) {
    const trace_t* t = traces[i];
    const anchor_t* anchor = find_anchor(t->name);
    int ok[NCOL];
    for (int p = 0; p < NCOL; p++) {
      replay_config_t c = cli->config;
      c.policy = policies[p];
      c.policy_set = 1;
      if (p == 2) c.conf = hold_conf;
      ok[p] = run_one(t, &c, mins, progress, &r[p]) == 0;
      if (!ok[p]) failed = 1;
      if (ok[p] && cli->json) print_json(stdout, t, &c, &r[p], anchor, columns[p]);
    }
    if (cli->json) continue;

    char live[32], c[NCOL][16], a0[32], a1[32], w[NCOL][16], h[NCOL][16];
    snprintf(live, sizeof live, "%.3f GiB", (double)t->peak_live_bytes / GIB);
    cell_anchor(a0, sizeof a0, anchor ? anchor->torch_reserved : 0, NULL);
    cell_anchor(a1, sizeof a1, anchor ? anchor->best_reserved : 0,
                anchor ? anchor->best_peer : NULL);
    for (int p = 0; p < NCOL; p++) {
      cell_ratio(c[p], sizeof c[p], &r[p], ok[p]);
      snprintf(w[p], sizeof w[p], "-");
      snprintf(h[p], sizeof h[p], "-");
      if (ok[p] && cli->config.device == REPLAY_DEVICE_SIM) {
        snprintf(w[p], sizeof w[p], "%.3f",
                 est_map_us_per_op(r[p].backend_calls_cold, r[p].ops_cold));
        snprintf(h[p], sizeof h[p], "%.3f",
                 est_map_us_per_op(r[p].cold_half_calls, r[p].cold_half_ops));
      }
    }
    row_add(&row, "%-*.*s %10s | %7s  %7s  %7s | %-8s  %-12s | %7s  %7s  %7s | %7s  %7s", name_w,
            name_w, t->name, live, c[0], c[1], c[2], a0, a1, w[0], w[1], w[2], h[1], h[2]);
    if (mins) {
      char m[NCOL][16], x0[32], x1[32];
      for (int p = 0; p < NCOL; p++) cell_min(m[p], sizeof m[p], &r[p], ok[p]);
      cell_anchor(x0, sizeof x0, anchor ? anchor->torch_min_cap : 0, NULL);
      cell_anchor(x1, sizeof x1, anchor ? anchor->best_min_cap : 0,
                  anchor ? anchor->best_cap_peer : NULL);
      row_add(&row, " | %7s  %7s  %7s | %-8s  %-12s", m[0], m[1], m[2], x0, x1);
    }
    row_print(&row);
  }

  if (!cli->json) {
    printf(
        "\nreplayed here: peak reserved in the first pass / peak live (OOM: ran out of memory"
        " under the limit).\n"
        "H200 columns: measured on an NVIDIA H200 with PyTorch 2.11 (BENCHMARKS.md), not computed"
        " by this run;\n"
        "  PyTorch = its native caching allocator; best peer = the better of expandable"
        " segments (exp)\n"
        "  and cudaMallocAsync (async). '-': no H200 measurement of this trace.\n"
        "us/op: the mapping calls of the first pass (a job that never repeats: the whole job),"
        " and of its\n"
        "  second half (a long job's steady state), priced at an H100's measured cost per call"
        " (create 12.7 us,\n"
        "  map with access 35.1, unmap 19.6, release 18.4), per alloc or free; under pytorch,"
        " its cudaMalloc\n"
        "  growth (cuMemAlloc 42.9 us, cuMemFree 38.6, H200), as native PyTorch pays it.\n");
    if (mins) {
      printf(
          "min limit: smallest hard limit under which the trace replays, / peak live"
          " (bisection to one page or 0.25%%, the finer, unless --min-limit-tolerance).\n");
    }
  }
  free(r);
  return failed ? EXIT_FAILURE : 0;
}

/* replay through a peer model: peak reserved, out of memory under the
 * limit, the smallest limit; human or JSON. */
static int run_peer(const trace_t* t, const cli_t* cli) {
  uint64_t limit = cli->config.limit_bytes;
  if (cli->config.limit_ratio > 0)
    limit = (uint64_t)(cli->config.limit_ratio * (double)t->peak_live_bytes);
  /* with a fraction of the device as well, the smaller cap holds, as in gpumem */
  if (cli->model_cap && (!limit || cli->model_cap < limit)) limit = cli->model_cap;
  /* and the simulated device's memory (--capacity) bounds the model as it
   * bounds the engine, a cap that is not a limit */
  uint64_t bound = limit && limit < cli->config.sim_capacity ? limit : cli->config.sim_capacity;
  peer_result_t r;
  uint64_t min = 0;
  if (peer_run(t, cli->peer, bound, 0, &r) != GPUMEM_OK ||
      (cli->min_limit &&
       peer_min_limit(t, cli->peer, cli->config.min_limit_tolerance, 0, &min) != GPUMEM_OK))
    return error("%s", detail(gpumem_last_error()));
  double live = t->peak_live_bytes ? (double)t->peak_live_bytes : 1;
  if (cli->json) {
    printf("{\"trace\":");
    json_string(stdout, t->path);
    printf(",\"name\":");
    json_string(stdout, t->name);
    printf(",\"policy\":\"%s\",\"model\":true,\"events\":%zu,\"allocations\":%zu",
           peer_model_name(cli->peer), t->num_events, t->num_allocs);
    printf(",\"peak_live_bytes\":%llu,\"peak_reserved_bytes\":%llu,\"reserved_ratio\":%.4f",
           (unsigned long long)t->peak_live_bytes, (unsigned long long)r.peak_reserved_bytes,
           (double)r.peak_reserved_bytes / live);
    if (t->recorded_peak_reserved)
      printf(",\"recorded_peak_reserved_bytes\":%llu",
             (unsigned long long)t->recorded_peak_reserved);
    if (limit) {
      printf(",\"limit_bytes\":%llu", (unsigned long long)limit);
    } else {
      printf(",\"limit_bytes\":null");
    }
    printf(",\"oom\":%s", r.oom ? "true" : "false");
    if (r.oom)
      printf(",\"oom_event\":%zu,\"oom_size\":%llu", r.oom_event, (unsigned long long)r.oom_size);
    if (cli->min_limit)
      printf(",\"min_limit_bytes\":%llu,\"min_limit_ratio\":%.4f", (unsigned long long)min,
             (double)min / live);
    printf(",\"maps\":%llu,\"unmaps\":%llu", (unsigned long long)r.num_maps,
           (unsigned long long)r.num_unmaps);
    if (cli->peer == PEER_EXPANDABLE)
      printf(",\"pages_mapped\":%llu,\"est_h100_map_us_per_op_cold\":%.3f",
             (unsigned long long)r.num_pages_mapped,
             est_expandable_us_per_op(r.num_pages_mapped, trace_num_ops(t)));
    printf("}\n");
    return 0;
  }
  printf("%s (%s)\n", t->name, t->path);
  printf("  %-16s%s (a model of it, in %.3f GiB of simulated device memory)", "policy",
         peer_model_name(cli->peer), (double)cli->config.sim_capacity / GIB);
  if (limit) {
    printf(", limit %.3f GiB\n", (double)limit / GIB);
  } else {
    printf(", no limit\n");
  }
  printf("  %-16s%zu (%zu allocations, %zu frees)\n", "events", t->num_events, t->num_allocs,
         t->num_frees);
  printf("  %-16s%.3f GiB (%llu bytes)\n", "peak live", (double)t->peak_live_bytes / GIB,
         (unsigned long long)t->peak_live_bytes);
  printf("  %-16s%.3f GiB (%llu bytes), %.4f x peak live%s\n", "peak reserved",
         (double)r.peak_reserved_bytes / GIB, (unsigned long long)r.peak_reserved_bytes,
         (double)r.peak_reserved_bytes / live, r.oom ? " (up to the failure)" : "");
  if (t->recorded_peak_reserved)
    printf("  %-16s%.3f GiB in the snapshot's segment events; model / recorded %.4f\n",
           "recorded peak", (double)t->recorded_peak_reserved / GIB,
           (double)r.peak_reserved_bytes / (double)t->recorded_peak_reserved);
  if (r.oom) {
    printf("  %-16syes: event %zu (line %u), %llu bytes\n", "oom", r.oom_event,
           t->events[r.oom_event].line, (unsigned long long)r.oom_size);
  } else {
    printf("  %-16sno\n", "oom");
  }
  if (cli->min_limit)
    printf("  %-16s%.3f GiB (%llu bytes), %.4f x peak live\n", "min limit", (double)min / GIB,
           (unsigned long long)min, (double)min / live);
  printf("  %-16s%llu maps, %llu unmaps", "physical", (unsigned long long)r.num_maps,
         (unsigned long long)r.num_unmaps);
  if (cli->peer == PEER_EXPANDABLE)
    printf("; %llu pages, each created and mapped: ~%.3f us/op at an H100's prices",
           (unsigned long long)r.num_pages_mapped,
           est_expandable_us_per_op(r.num_pages_mapped, trace_num_ops(t)));
  printf("\n");
  return 0;
}

/* ---- fit -------------------------------------------------------------- */

static const char usage_fit[] =
    "usage: gpumem fit --memory SIZE [options] TRACE...\n"
    "\n"
    "Does the job fit in SIZE of device memory, under each allocator a PyTorch\n"
    "user can choose and under gpumem? For each: whether the trace replays\n"
    "under a hard limit of SIZE, the peak reserved memory (no limit) and the\n"
    "smallest limit under which it replays (the memory the job needs).\n"
    "TRACE: a gpumem trace (GPUMEM_CONF=record:PATH) or a PyTorch memory\n"
    "snapshot pickle (torch.cuda.memory._dump_snapshot).\n"
    "\n"
    "options:\n"
    "  --memory SIZE             the device memory to fit in (e.g. 80G)\n"
    "  --min-limit-tolerance F   bisect the needed memory to F x peak live (default:\n"
    "                            one page or 0.25%, the finer)\n"
    "  --json                    one JSON object per row\n"
    "  -h, --help                this text\n"
    "\n"
    "Each row runs at that allocator's own settings: GPUMEM_CONF is checked, not\n"
    "applied (a note says so when it is set).\n";

/* One row of the table, with the progress line labelled by the row. */
static int fit_row(const trace_t* t, const fit_row_t* row, const cli_t* cli, progress_t* progress,
                   fit_result_t* out) {
  replay_config_t base = cli->config;
  base.progress = progress_show;
  base.progress_arg = progress;
  progress_start(progress, t->name, row->name);
  gpumem_status_t st = fit_one(t, row, cli->memory, &base, out);
  progress_clear(progress);
  return st == GPUMEM_OK ? 0 : trace_error(t);
}

static int cmd_fit(int argc, char** argv) {
  cli_t cli;
  memset(&cli, 0, sizeof cli);
  unsigned allowed =
      (1u << OPT_MEMORY) | (1u << OPT_JSON) | (1u << OPT_MIN_LIMIT_TOLERANCE) | (1u << OPT_HELP);
  int rc = parse_args(argc, argv, allowed, usage_fit, &cli);
  if (rc == 0 && cli.help) {
    fputs(usage_fit, stdout);
  } else if (rc == 0 && cli.num_traces == 0) {
    rc = usage_error(usage_fit, "no trace given");
  } else if (rc == 0 && cli.memory == 0) {
    rc = usage_error(usage_fit, "--memory SIZE is needed (the device memory to fit in)");
  }
  trace_t** traces = NULL;
  if (rc != 0 || cli.help || (rc = load_all(&cli, &traces)) != 0) {
    free(cli.traces);
    return rc;
  }
  if (cli_env_conf())
    fprintf(stderr,
            "gpumem: note: GPUMEM_CONF is not applied: fit runs each allocator at its own "
            "settings\n");
  progress_t progress = {0};
  progress.enabled = isatty(STDERR_FILENO);
  for (int i = 0; i < cli.num_traces && rc == 0; i++) {
    const trace_t* t = traces[i];
    if (!cli.json) {
      printf("%s: peak live %.3f GiB; does it fit in %.3f GiB?\n\n", t->name,
             (double)t->peak_live_bytes / GIB, (double)cli.memory / GIB);
      printf("%-20s %-5s %-22s %-22s %s\n", "allocator", "fits", "peak reserved", "memory needed",
             "how to choose it");
      printf("%.*s\n", 110,
             "------------------------------------------------------------------------------"
             "--------------------------------");
    }
    uint64_t default_needed = 0;
    for (size_t k = 0; k < fit_num_rows; k++) {
      fit_result_t f;
      if (fit_row(t, &fit_rows[k], &cli, &progress, &f) != 0) {
        rc = EXIT_FAILURE;
        break;
      }
      if (fit_rows[k].gpumem_default) default_needed = f.needed;
      if (cli.json) {
        printf("{\"trace\":");
        json_string(stdout, t->path);
        printf(",\"allocator\":\"%s\",\"model\":%s,\"memory_bytes\":%zu,\"fits\":%s",
               fit_rows[k].name, fit_rows[k].peer != PEER_NONE ? "true" : "false", cli.memory,
               f.fits ? "true" : "false");
        printf(",\"peak_live_bytes\":%llu,\"peak_reserved_bytes\":%llu,\"needed_bytes\":%llu}\n",
               (unsigned long long)t->peak_live_bytes, (unsigned long long)f.peak_reserved,
               (unsigned long long)f.needed);
        continue;
      }
      char peak[40], need[40];
      fit_cells(t, &f, peak, need, sizeof peak);
      printf("%-20s %-5s %-22s %-22s %s\n", fit_rows[k].name, f.fits ? "yes" : "NO", peak, need,
             fit_rows[k].how);
    }
    if (!cli.json && rc == 0) {
      printf("\n%s", fit_note);
      if (default_needed)
        printf("gpumem's default needs %.3f GiB.\n", (double)default_needed / GIB);
      if (t->recorded_peak_reserved)
        printf("The recording process reserved %.3f GiB at its peak (snapshot segment events).\n",
               (double)t->recorded_peak_reserved / GIB);
      if (i + 1 < cli.num_traces) printf("\n");
    }
  }
  for (int i = 0; i < cli.num_traces; i++) trace_free(traces[i]);
  free(traces);
  free(cli.traces);
  return rc;
}

/* ---- predict ---------------------------------------------------------- */

static const char usage_predict[] =
    "usage: gpumem predict --batch-sizes B1,B2[,...] TRACE1 TRACE2 [...] [--batch N] [--memory SIZE]\n"
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
      return error("bad --batch-sizes '%s' (batch sizes separated by commas, e.g. 2,4,8)", text);
    memcpy(item, p, len);
    item[len] = '\0';
    if (n == SCALE_MAX_RECORDINGS)
      return error("bad --batch-sizes '%s': at most %d recordings", text, SCALE_MAX_RECORDINGS);
    if (!parse_long(item, 1, SCALE_MAX_RECORDED_BATCH, &batch[n]))
      return error("bad --batch-sizes '%s': '%s' is not a batch size (1 to %ld)", text, item,
                   SCALE_MAX_RECORDED_BATCH);
    if (n && batch[n] <= batch[n - 1])
      return error(
          "bad --batch-sizes '%s': %ld then %ld: the sizes must increase (one recording a size, "
          "the traces in the same order)",
          text, batch[n - 1], batch[n]);
    n++;
    p += len;
    if (!*p) break;
    p++;
  }
  if (n < 2)
    return usage_error(usage_predict,
                       "--sizes '%s' gives one batch size: the model needs the job recorded "
                       "at two sizes or more",
                       text);
  if (n != num_traces)
    return usage_error(usage_predict,
                       "--sizes gives %d batch sizes for %d traces (one a trace, in the same "
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
                         const trace_t* at, const scale_at_t* info, const predict_row_t* rows) {
  printf("{\"recordings\":[");
  for (size_t i = 0; i < m->num_recordings; i++) {
    const trace_t* t = m->traces[i];
    printf("%s{\"trace\":", i ? "," : "");
    json_string(stdout, t->path);
    printf(",\"batch\":%ld,\"events\":%zu,\"steps\":%zu,\"peak_live_bytes\":%llu}", m->batch[i],
           t->num_events, t->num_steps, (unsigned long long)t->peak_live_bytes);
  }
  printf("],\"events\":%zu,\"allocations\":%zu,\"steps_used\":%zu,\"truncated\":%s", m->num_events,
         m->num_allocs, m->steps_used, m->truncated ? "true" : "false");
  printf(",\"model\":{\"constant\":%zu,\"affine\":%zu,\"quadratic\":%zu,\"held\":%zu}",
         m->kind_count[SCALE_CONSTANT], m->kind_count[SCALE_AFFINE], m->kind_count[SCALE_QUADRATIC],
         m->num_held);
  printf(
      ",\"aligned\":{\"by_role\":%s,\"matched\":%zu,\"inserted\":%zu,"
      "\"inserted_bytes_at_largest\":%llu,\"dropped\":%zu,\"dropped_bytes\":%llu,"
      "\"frees_moved\":%zu,\"upper_bound\":%s,\"unmatched_roles\":[",
      al->by_role ? "true" : "false", al->matched, al->inserted,
      (unsigned long long)al->inserted_bytes, al->dropped, (unsigned long long)al->dropped_bytes,
      al->frees_moved, al->inserted ? "true" : "false");
  for (size_t k = 0; k < ALIGN_TOP_ROLES && al->top[k].count; k++) {
    printf("%s{\"role\":", k ? "," : "");
    json_string(stdout, al->top[k].role);
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
  printf("]}\n");
}

static void predict_human(const cli_t* cli, const scale_model_t* m, const align_report_t* al,
                          const trace_t* at, const scale_at_t* info, const predict_row_t* rows) {
  char a[32], b[32];
  printf("%s: the job recorded at batch", m->traces[0]->name);
  for (size_t i = 0; i < m->num_recordings; i++)
    printf("%s %ld", i == 0 ? "" : i + 1 == m->num_recordings ? " and" : ",", m->batch[i]);
  printf("\naligned: %s events, %s allocations", fmt_count(m->num_events, a),
         fmt_count(m->num_allocs, b));
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
           fmt_count(al->matched, c1));
    if (al->frees_moved)
      printf("; %s frees in another order, placed as at the largest batch",
             fmt_count(al->frees_moved, c2));
    if (al->inserted)
      printf(
          "\nonly at the largest batch: %s allocations (%.3f GiB there), taken in proportion to "
          "the batch at every batch: an upper bound where they grow at most linearly",
          fmt_count(al->inserted, c3), (double)al->inserted_bytes / GIB);
    if (al->dropped)
      printf("\nonly at a smaller batch: %s allocations (%.3f GiB), left out",
             fmt_count(al->dropped, c3), (double)al->dropped_bytes / GIB);
    for (size_t k = 0; k < ALIGN_TOP_ROLES && al->top[k].count; k++) {
      /* (a role is printable ASCII: the reader refuses anything else) */
      printf("\n  %s: %zu allocation%s, %.3f MiB, only at the %s batch",
             al->top[k].role[0] ? al->top[k].role : "(no role)",
             al->top[k].count, al->top[k].count == 1 ? "" : "s",
             (double)al->top[k].bytes / (1 << 20), al->top[k].inserted ? "largest" : "smaller");
    }
  }
  printf("\nsizes in the batch: %zu constant, %zu affine, %zu quadratic\n",
         m->kind_count[SCALE_CONSTANT], m->kind_count[SCALE_AFFINE],
         m->kind_count[SCALE_QUADRATIC]);
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
  if (at) printf("%s", fit_note);
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
    return error("%s", detail(gpumem_last_error()));
  gm_outfile out;
  char why[1400];
  int fd = gm_outfile_open(&out, cli->write_trace, 0600, why, sizeof why);
  if (fd < 0) {
    free(text);
    return error("%s", why);
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
    return error("cannot write %s: %s", cli->write_trace, strerror(why_not));
  }
  if (!gm_outfile_commit(&out, why, sizeof why)) return error("%s", why);
  return 0;
}

static int cmd_predict(int argc, char** argv) {
  cli_t cli;
  memset(&cli, 0, sizeof cli);
  unsigned allowed = (1u << OPT_SIZES) | (1u << OPT_BATCH) | (1u << OPT_MEMORY) |
                     (1u << OPT_MAX_BATCH) | (1u << OPT_JSON) | (1u << OPT_MIN_LIMIT_TOLERANCE) |
                     (1u << OPT_WRITE_TRACE) | (1u << OPT_HELP);
  long batch[SCALE_MAX_RECORDINGS];
  int rc = parse_args(argc, argv, allowed, usage_predict, &cli);
  if (rc == 0 && cli.help) {
    fputs(usage_predict, stdout);
  } else if (rc == 0 && !cli.sizes) {
    rc = usage_error(usage_predict,
                     "--batch-sizes B1,B2,... is needed (the batch size each trace was recorded "
                     "at)");
  } else if (rc == 0 && cli.num_traces < 2) {
    rc = usage_error(usage_predict,
                     "%d trace%s given: the model needs the job recorded at two batch sizes "
                     "or more",
                     cli.num_traces, cli.num_traces == 1 ? "" : "s");
  } else if (rc == 0 && !cli.batch && !cli.memory) {
    rc = usage_error(usage_predict,
                     "give --batch N (predict the job at N), --memory SIZE (the largest batch "
                     "that fits), or both");
  } else if (rc == 0 && cli.max_batch && !cli.memory) {
    rc = usage_error(usage_predict,
                     "--max-batch caps the search for the largest batch that fits --memory: "
                     "give --memory too");
  } else if (rc == 0 && cli.write_trace && !cli.batch) {
    rc = usage_error(usage_predict,
                     "--write-trace writes the job's trace at --batch: give --batch too");
  } else if (rc == 0) {
    rc = parse_sizes(cli.sizes, cli.num_traces, batch);
  }
  trace_t** traces = NULL;
  if (rc != 0 || cli.help || (rc = load_all(&cli, &traces)) != 0) {
    free(cli.traces);
    return rc;
  }
  align_report_t aligned;
  if (align_recordings(traces, batch, (size_t)cli.num_traces, &aligned) != GPUMEM_OK) {
    for (int i = 0; i < cli.num_traces; i++) trace_free(traces[i]);
    free(traces);
    free(cli.traces);
    return error("%s", detail(gpumem_last_error()));
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
    rc = error("out of host memory");
  } else if (scale_fit((const trace_t* const*)traces, batch, (size_t)cli.num_traces, &m) !=
             GPUMEM_OK) {
    rc = error("%s", detail(gpumem_last_error()));
  } else if (cli.batch && scale_trace_at(m, cli.batch, &at, &info) != GPUMEM_OK) {
    rc = error("%s", detail(gpumem_last_error()));
  } else if (cli.write_trace) {
    rc = write_predicted_trace(at, &cli, batch);
  }
  progress_t progress = {0};
  progress.enabled = isatty(STDERR_FILENO);
  replay_config_t base = cli.config;
  base.progress = progress_show;
  base.progress_arg = &progress;
  for (size_t k = 0; k < fit_num_rows && rc == 0; k++) {
    if (at) rc = fit_row(at, &fit_rows[k], &cli, &progress, &rows[k].at);
    if (rc || !cli.memory) continue;
    progress_start(&progress, m->traces[0]->name, fit_rows[k].name);
    gpumem_status_t st =
        scale_largest_batch(m, &fit_rows[k], cli.memory, cli.max_batch, &base, &rows[k].largest);
    progress_clear(&progress);
    if (st != GPUMEM_OK) rc = error("%s", detail(gpumem_last_error()));
  }
  if (rc == 0 && cli.json) predict_json(&cli, m, &aligned, at, &info, rows);
  if (rc == 0 && !cli.json) predict_human(&cli, m, &aligned, at, &info, rows);
  trace_free(at);
  scale_free(m);
  free(rows);
  for (int i = 0; i < cli.num_traces; i++) trace_free(traces[i]);
  free(traces);
  free(cli.traces);
  return rc;
}

static int cmd_replay(int argc, char** argv) {
  cli_t cli;
  memset(&cli, 0, sizeof cli);
  unsigned allowed = (1u << OPT_POLICY) | (1u << OPT_LIMIT) | (1u << OPT_LIMIT_RATIO) |
                     (1u << OPT_CONF) | (1u << OPT_PASSES) | (1u << OPT_DEVICE) |
                     (1u << OPT_CAPACITY) | (1u << OPT_MIN_LIMIT) |
                     (1u << OPT_MIN_LIMIT_TOLERANCE) | (1u << OPT_STEADY) | (1u << OPT_STEP_MS) |
                     (1u << OPT_STEPS) | (1u << OPT_JSON) | (1u << OPT_COMPARE) | (1u << OPT_HELP) |
                     (1u << OPT_PEER_MODELS);
  int rc = parse_args(argc, argv, allowed, usage_replay, &cli);
  if (rc == 0 && cli.help) {
    fputs(usage_replay, stdout);
  } else if (rc == 0 && cli.num_traces == 0) {
    rc = usage_error(usage_replay, "no trace given");
  } else if (rc == 0 && cli.compare && (cli.config.policy_set || cli.peer)) {
    rc = usage_error(usage_replay, "--compare replays both policies: drop --policy");
  } else if (rc == 0 && cli.config.step_ms > 0 && (cli.compare || cli.peer)) {
    /* refused rather than dropped: the figure it asks for would not appear */
    rc = usage_error(usage_replay,
                     cli.compare ? "--step-ms prices one replay's mapping calls as a share of "
                                   "its steps: not with --compare (its us/op columns price them)"
                                 : "--step-ms prices gpumem's mapping calls: the %s model makes "
                                   "no device calls to price",
                     peer_model_name(cli.peer));
  } else if (rc == 0 && (cli.config.step_ms > 0) != (cli.config.steps > 0)) {
    rc = usage_error(usage_replay,
                     "--step-ms and --steps go together (a step's time, and how "
                     "many steps the trace holds)");
  } else if (rc == 0 && cli.peer &&
             (cli.config.device != REPLAY_DEVICE_SIM || cli.steady ||
              cli.config.warm_passes != 3)) {
    rc = usage_error(usage_replay,
                     "the %s model replays on no device: drop --device, --steady "
                     "and --passes",
                     peer_model_name(cli.peer));
  }
  if (rc != 0 || cli.help) {
    free(cli.traces);
    return rc;
  }

  trace_t** traces = NULL;
  if ((rc = check_device(&cli.config)) != 0 || (rc = load_all(&cli, &traces)) != 0) {
    free(cli.traces);
    return rc;
  }
  progress_t progress = {0};
  progress.enabled = isatty(STDERR_FILENO);

  if (cli.compare) {
    rc = cmd_compare(&cli, traces, &progress);
  } else if (cli.peer) {
    for (int i = 0; i < cli.num_traces; i++)
      if (run_peer(traces[i], &cli) != 0) rc = EXIT_FAILURE;
  } else {
    replay_result_t* r = malloc(sizeof *r);
    if (!r) {
      rc = error("out of host memory");
    } else {
      for (int i = 0; i < cli.num_traces; i++) {
        if (run_one(traces[i], &cli.config, cli.min_limit, &progress, r) != 0) {
          rc = EXIT_FAILURE;
          continue;
        }
        if (cli.json) {
          print_json(stdout, traces[i], &cli.config, r, NULL, NULL);
        } else {
          print_human(stdout, traces[i], &cli.config, r);
        }
      }
      free(r);
    }
  }
  for (int i = 0; i < cli.num_traces; i++) trace_free(traces[i]);
  free(traces);
  free(cli.traces);
  return rc;
}

/* ---- summary ---------------------------------------------------------- */

/* Parses the arguments of a command that takes one trace. Returns -1 when
 * the command goes on, else its exit code (help printed, or a usage error;
 * cli->traces freed). */
static int parse_one_trace(int argc, char** argv, unsigned allowed, const char* usage, cli_t* cli) {
  memset(cli, 0, sizeof *cli);
  int rc = parse_args(argc, argv, allowed, usage, cli);
  if (rc == 0 && cli->help) {
    fputs(usage, stdout);
  } else if (rc == 0 && cli->num_traces != 1) {
    rc = usage_error(usage, cli->num_traces ? "one trace at a time" : "no trace given");
  } else if (rc == 0) {
    return -1;
  }
  free(cli->traces);
  return rc;
}

/* The trace of a one-trace command, and a slot per allocation for it. */
static int load_with_slots(const cli_t* cli, trace_t** t, void*** slots) {
  if (trace_load(cli->traces[0], t) != GPUMEM_OK) return error("%s", detail(gpumem_last_error()));
  *slots = calloc((*t)->num_allocs ? (*t)->num_allocs : 1, sizeof **slots);
  return *slots ? 0 : error("out of host memory");
}

static int cmd_summary(int argc, char** argv) {
  cli_t cli;
  unsigned allowed = (1u << OPT_POLICY) | (1u << OPT_LIMIT) | (1u << OPT_CONF) |
                     (1u << OPT_DEVICE) | (1u << OPT_CAPACITY) | (1u << OPT_JSON) |
                     (1u << OPT_HELP);
  int rc = parse_one_trace(argc, argv, allowed, usage_summary, &cli);
  if (rc >= 0) return rc;
  rc = 0;

  trace_t* t = NULL;
  replay_session_t* session = NULL;
  gpumem_t* gm = NULL;
  replay_result_t* r = NULL;
  gpumem_options_t opts;
  progress_t progress = {0};
  progress.enabled = isatty(STDERR_FILENO);

  if (trace_load(cli.traces[0], &t) != GPUMEM_OK) {
    rc = error("%s", detail(gpumem_last_error()));
    goto done;
  }
  if (replay_options(&cli.config, t, &opts) != GPUMEM_OK ||
      replay_session_open(&cli.config, &opts, t, &session) != GPUMEM_OK) {
    rc = error("%s", detail(gpumem_last_error()));
    goto done;
  }
  gm = replay_session_allocator(session);
  r = malloc(sizeof *r);
  if (!r) {
    rc = error("out of host memory");
    goto done;
  }
  replay_result_init(r, t);
  progress_start(&progress, t->name, replay_policy_name(opts.policy));
  r->progress = progress_show;
  r->progress_arg = &progress;
  r->progress_what = "cold pass";
  gpumem_status_t st = replay_pass_keep(gm, replay_session_trace(session), r);
  progress_clear(&progress);
  if (st != GPUMEM_OK) {
    rc = error("%s", detail(gpumem_last_error()));
    goto done;
  }
  if (r->oom) {
    char msg[512];
    fprintf(stderr,
            "gpumem: note: out of memory at event %zu (line %u, %zu bytes): %s\n"
            "gpumem: the summary shows the state at that failure\n",
            r->oom_event, r->oom_line, r->oom_size,
            first_line(detail(r->oom_message), msg, sizeof msg));
  }
  if (cli.json) {
    gpumem_print_stats_json(gm, gpumem_write_to_file, stdout);
    fputc('\n', stdout);
  } else {
    printf("%s: allocator state at the end of the trace (policy %s, %s device, ", t->name,
           replay_policy_name(opts.policy), replay_device_name(cli.config.device));
    uint64_t cap = effective_cap(&cli.config, t);
    if (cap) {
      printf("limit %llu bytes)\n", (unsigned long long)cap);
    } else {
      printf("no limit)\n");
    }
    gpumem_print_summary(gm, gpumem_write_to_file, stdout);
  }

done:
  free(r);
  replay_session_close(session);
  trace_free(t);
  free(cli.traces);
  return rc;
}

/* ---- explain ------------------------------------------------------------ */

/* Runs events [start, stop) of t on gm, each tagged with its trace line;
 * returns the index of the event after which reserved memory first reached
 * its highest value in them (or SIZE_MAX when an allocation failed). */
static size_t explain_run_from(gpumem_t* gm, const trace_t* t, size_t start, size_t stop,
                               void** slots) {
  int64_t best = -1;
  size_t best_event = 0;
  for (size_t i = start; i < stop; i++) {
    if (replay_event_tagged(gm, t, i, slots) != GPUMEM_OK) return SIZE_MAX;
    if (t->events[i].op != TRACE_ALLOC) continue;
    gpumem_stats_t st;
    gpumem_get_stats(gm, &st);
    if (st.reserved_bytes[GPUMEM_POOL_ALL].current > best) {
      best = st.reserved_bytes[GPUMEM_POOL_ALL].current;
      best_event = i;
    }
  }
  return best_event;
}

static size_t explain_run(gpumem_t* gm, const trace_t* t, size_t stop, void** slots) {
  return explain_run_from(gm, t, 0, stop, slots);
}

static void explain_row(const char* what, uint64_t bytes, uint64_t live) {
  char b[32];
  printf("  %-46s %14s  %7.4f%%\n", what, gm_format_bytes(bytes, b, sizeof b),
         live ? 100.0 * (double)bytes / (double)live : 0.0);
}

/* The snapshot of gm, its frames tagged with trace lines of t, into path
 * as a pickle: the form PyTorch's memory_viz opens and every gpumem
 * command reads back (the library writes it as JSON; the pickle is the
 * same value). */
static int write_snapshot(gpumem_t* gm, const trace_t* t, const char* path) {
  gm_text_t json = {NULL, 0, 0};
  if (gpumem_snapshot_json(gm, 0, t->path, gm_text_write, &json) != 0) {
    free(json.s);
    return error("out of host memory for the snapshot");
  }
  /* never through a link or into another user's file (src/outfile.c) */
  gm_outfile out;
  char why[1400];
  int fd = gm_outfile_open(&out, path, 0600, why, sizeof why);
  if (fd < 0) {
    free(json.s);
    return error("%s", why);
  }
  FILE* f = fdopen(fd, "wb");
  if (!f) {
    free(json.s);
    close(fd);
    gm_outfile_abandon(&out);
    return error("cannot write %s: %s", path, strerror(errno));
  }
  int failed = json_to_pickle(json.s, json.len, gpumem_write_to_file, f) != GPUMEM_OK;
  free(json.s);
  if (fclose(f) != 0) failed = 1;
  if (failed) {
    gm_outfile_abandon(&out);
    return error("writing %s failed: %s", path, detail(gpumem_last_error()));
  }
  if (!gm_outfile_commit(&out, why, sizeof why)) return error("%s", why);
  printf("\nsnapshot at that event: %s\n", path);
  return 0;
}

static int cmd_explain(int argc, char** argv) {
  cli_t cli;
  unsigned allowed = (1u << OPT_POLICY) | (1u << OPT_LIMIT) | (1u << OPT_CONF) |
                     (1u << OPT_CAPACITY) | (1u << OPT_SNAPSHOT) | (1u << OPT_HELP);
  int rc = parse_one_trace(argc, argv, allowed, usage_explain, &cli);
  if (rc >= 0) return rc;
  rc = 0;
  trace_t* t = NULL;
  gpumem_t* gm = NULL;
  void** slots = NULL;
  gpumem_options_t opts;
  if ((rc = load_with_slots(&cli, &t, &slots)) != 0) goto done;
  /* Two runs on fresh allocators: the first finds the peak, the second
   * stops right after it. Replays on the simulated device are
   * deterministic, so both see the same state at that event. */
  size_t peak_event = SIZE_MAX;
  for (int run = 0; run < 2; run++) {
    if (replay_options(&cli.config, t, &opts) != GPUMEM_OK ||
        replay_open(&cli.config, &opts, &gm) != GPUMEM_OK) {
      rc = error("%s", detail(gpumem_last_error()));
      goto done;
    }
    memset(slots, 0, t->num_allocs * sizeof *slots);
    size_t stop = run == 0 ? t->num_events : peak_event + 1;
    /* the second run records every event up to the peak for the snapshot
     * (a free is two: requested and completed) */
    if (run == 1 && cli.snapshot && gpumem_record_history(gm, 2 * stop + 64) != GPUMEM_OK) {
      rc = error("%s", detail(gpumem_last_error()));
      goto done;
    }
    size_t found = explain_run(gm, t, stop, slots);
    if (found == SIZE_MAX) {
      rc = error("%s: the replay failed before the peak: %s", t->name, detail(gpumem_last_error()));
      goto done;
    }
    if (run == 0) {
      peak_event = found;
      gpumem_destroy(gm);
      gm = NULL;
    }
  }
  gpumem_explain_t ex;
  gpumem_explain(gm, &ex);
  uint64_t live = ex.requested;
  char b1[32], b2[32];
  printf("%s: peak reserved at event %zu (line %u), policy %s\n", t->name, peak_event,
         t->events[peak_event].line, replay_policy_name(opts.policy));
  printf("  reserved %s for %s requested by %zu live allocations (%.4f x)\n\n",
         gm_format_bytes(ex.reserved, b1, sizeof b1), gm_format_bytes(live, b2, sizeof b2),
         ex.live_blocks, live ? (double)ex.reserved / (double)live : 0.0);
  printf("  %-46s %14s  %8s\n", "bytes beyond the live ones", "bytes", "of live");
  explain_row("rounding (512 B units, unsplit tails)", ex.rounding, live);
  explain_row("partial pages at hole edges, large pool", ex.partial_pages_large, live);
  explain_row("partial pages at hole edges, small pool", ex.partial_pages_small, live);
  explain_row("cached free, reclaimable (whole pages/segments)", ex.cached_reclaimable, live);
  explain_row("waiting for other streams (record_stream)", ex.other_streams, live);
  explain_row("spare pages (held, not in use)", ex.spare_pages, live);
  uint64_t beyond = ex.rounding + ex.partial_pages_large + ex.partial_pages_small +
                    ex.cached_reclaimable + ex.other_streams + ex.spare_pages;
  explain_row("total", beyond, live);
  if (live + beyond != ex.reserved) {
    rc = error("internal: the breakdown adds up to %llu bytes, reserved is %llu",
               (unsigned long long)(live + beyond), (unsigned long long)ex.reserved);
  }
  if (rc == 0 && cli.snapshot) rc = write_snapshot(gm, t, cli.snapshot);
done:
  gpumem_destroy(gm);
  free(slots);
  trace_free(t);
  free(cli.traces);
  return rc;
}

/* ---- leaks -------------------------------------------------------------- */

static const char usage_leaks[] =
    "usage: gpumem leaks [options] TRACE\n"
    "\n"
    "Replays one cold pass of TRACE and lists the allocations still live at\n"
    "its end (the trace never freed them), in groups of one requested size\n"
    "and stream, most bytes first, each with its trace lines (as tags).\n"
    "\n"
    "options:\n"
    "  --since-line N            only allocations made at trace line N or later\n"
    "                            (a step's first line: what later steps kept)\n"
    "  --policy default|pytorch  allocation policy (default: default)\n"
    "  --limit SIZE              hard cap on reserved memory\n"
    "  --conf STRING             configuration, GPUMEM_CONF grammar (key:value,...),\n"
    "                            over GPUMEM_CONF's keys; --policy, --limit override both\n"
    "  --capacity SIZE           simulated device memory (default 1T)\n"
    "  --json                    the report as one JSON object\n"
    "  -h, --help                this text\n";

static int cmd_leaks(int argc, char** argv) {
  cli_t cli;
  unsigned allowed = (1u << OPT_POLICY) | (1u << OPT_LIMIT) | (1u << OPT_CONF) |
                     (1u << OPT_CAPACITY) | (1u << OPT_SINCE_LINE) | (1u << OPT_JSON) |
                     (1u << OPT_HELP);
  int rc = parse_one_trace(argc, argv, allowed, usage_leaks, &cli);
  if (rc >= 0) return rc;
  rc = 0;
  trace_t* t = NULL;
  gpumem_t* gm = NULL;
  void** slots = NULL;
  gpumem_options_t opts;
  if ((rc = load_with_slots(&cli, &t, &slots)) != 0) goto done;
  if (replay_options(&cli.config, t, &opts) != GPUMEM_OK ||
      replay_open(&cli.config, &opts, &gm) != GPUMEM_OK) {
    rc = error("%s", detail(gpumem_last_error()));
    goto done;
  }
  /* A line past the last event would count nothing and say so as if the
   * trace had no leak. */
  if (cli.since_line &&
      (!t->num_events || (int64_t)cli.since_line > (int64_t)t->events[t->num_events - 1].line)) {
    rc =
        usage_error(usage_leaks, "bad --since-line %d: the last event of %s is at line %u",
                    cli.since_line, t->path, t->num_events ? t->events[t->num_events - 1].line : 0);
    goto done;
  }
  /* The mark: the allocations made before the first event at the line. */
  size_t first = 0;
  while (first < t->num_events && (int64_t)t->events[first].line < cli.since_line) first++;
  if (explain_run(gm, t, first, slots) == SIZE_MAX) {
    rc = error("%s: %s", t->name, detail(gpumem_last_error()));
    goto done;
  }
  uint64_t mark = gpumem_leak_mark(gm);
  if (explain_run_from(gm, t, first, t->num_events, slots) == SIZE_MAX) {
    rc = error("%s: %s", t->name, detail(gpumem_last_error()));
    goto done;
  }
  if (!cli.json) {
    printf("%s: live at its end (policy %s; tags are trace lines", t->name,
           replay_policy_name(opts.policy));
    if (cli.since_line) printf(", from line %d on", cli.since_line);
    printf(")\n");
  }
  int out = cli.json ? gpumem_print_leaks_json(gm, mark, gpumem_write_to_file, stdout)
                     : gpumem_print_leaks(gm, mark, gpumem_write_to_file, stdout);
  if (out != 0) rc = error("writing the report failed: %s", detail(gpumem_last_error()));
done:
  gpumem_destroy(gm);
  free(slots);
  trace_free(t);
  free(cli.traces);
  return rc;
}

/* ---- commands --------------------------------------------------------- */

typedef struct command {
  const char* name;
  int (*run)(int argc, char** argv);
} command_t;

static const command_t commands[] = {
    {"replay", cmd_replay}, {"summary", cmd_summary},  {"explain", cmd_explain},
    {"leaks", cmd_leaks},   {"report", gm_cli_report}, {"top", gm_cli_top},
    {"run", gm_cli_run},    {"fit", cmd_fit},          {"predict", cmd_predict},
};

/* Whether the arguments (up to a "--") ask for a command's help. */
static int asks_help(int argc, char** argv) {
  for (int i = 0; i < argc && strcmp(argv[i], "--") != 0; i++)
    if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) return 1;
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fputs(usage_main, stderr);
    return EXIT_USAGE;
  }
  const char* cmd = argv[1];
  if (strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "help") == 0) {
    fputs(usage_main, stdout);
    return 0;
  }
  if (strcmp(cmd, "-V") == 0 || strcmp(cmd, "--version") == 0) {
    printf("gpumem %s\n", GPUMEM_PROJECT_VERSION);
    return 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
    if (strcmp(cmd, commands[i].name) != 0) continue;
    /* Every command refuses a bad GPUMEM_CONF, as the library would in the
     * processes it configures; only asking for help goes on regardless. */
    if (!asks_help(argc - 2, argv + 2) && cli_check_env_conf() != 0) return EXIT_FAILURE;
    return commands[i].run(argc - 2, argv + 2);
  }
  if (cmd[0] == '-') return usage_error(usage_main, "unknown option '%s'", cmd);
  return usage_error(usage_main, "unknown command '%s'", cmd);
}
