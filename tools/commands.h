/* The commands of the gpumem command line, one file each (tools/cmd_*.c),
 * each given argv after its name and returning the exit status (0, 1 an
 * error, 2 a usage mistake). main.c dispatches. */
#ifndef GPUMEM_TOOLS_COMMANDS_H
#define GPUMEM_TOOLS_COMMANDS_H

#include "cli.h"

int cmd_replay(int argc, char** argv);
int cmd_summary(int argc, char** argv);
int cmd_explain(int argc, char** argv);
int cmd_leaks(int argc, char** argv);
int cmd_report(int argc, char** argv);
int cmd_fit(int argc, char** argv);
int cmd_predict(int argc, char** argv);
int cmd_top(int argc, char** argv);
int cmd_run(int argc, char** argv);

/* replay --compare (cmd_compare.c): the traces, loaded, under every column. */
int replay_compare(const cli_t* cli, trace_t** traces, progress_t* progress);

#endif
