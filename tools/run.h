/* gpumem run (tools/run.c): the command's entry, argv after "run". */
#ifndef GPUMEM_TOOLS_RUN_H
#define GPUMEM_TOOLS_RUN_H

int gm_cli_run(int argc, char** argv);

#endif
