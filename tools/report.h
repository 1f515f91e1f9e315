/* gpumem report: an HTML page about a trace (tools/report.c). */
#ifndef GPUMEM_TOOLS_REPORT_H
#define GPUMEM_TOOLS_REPORT_H

int gm_cli_report(int argc, char** argv);

#endif
