/* gpumem report: an HTML page about a trace (tools/report.c). */
#ifndef GPUMEM_TOOLS_REPORT_H
#define GPUMEM_TOOLS_REPORT_H

#include <stddef.h>

int gm_cli_report(int argc, char** argv);

/* A growing, NUL-terminated text buffer that the library's writers
 * (gpumem_write_fn) fill: start it {NULL, 0, 0}, free(s) when done. */
typedef struct gm_text {
  char* s;
  size_t len, cap;
} gm_text_t;
int gm_text_write(const char* s, size_t len, void* arg);

#endif
