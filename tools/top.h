/* gpumem top (tools/top.c): the command's entry, argv after "top". */
#ifndef GPUMEM_TOOLS_TOP_H
#define GPUMEM_TOOLS_TOP_H

int gm_cli_top(int argc, char** argv);

#endif
