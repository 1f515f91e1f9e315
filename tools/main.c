/* The gpumem command line: the table of commands and the dispatch to them.
 * Each command is a file of its own (tools/cmd_*.c, commands.h); what they
 * share, options, configuration, errors and the progress line, is cli.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

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

typedef struct command {
  const char* name;
  int (*run)(int argc, char** argv);
} command_t;

static const command_t commands[] = {
    {"replay", cmd_replay}, {"summary", cmd_summary}, {"explain", cmd_explain},
    {"leaks", cmd_leaks},   {"report", cmd_report},   {"top", cmd_top},
    {"run", cmd_run},       {"fit", cmd_fit},         {"predict", cmd_predict},
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
  if (cmd[0] == '-') return cli_usage_error(usage_main, "unknown option '%s'", cmd);
  return cli_usage_error(usage_main, "unknown command '%s'", cmd);
}
