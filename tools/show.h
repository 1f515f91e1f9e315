/* Names from outside (paths, trace names, process names, a file's own
 * words) as every command shows them: each byte a terminal could act on
 * made visible, so that a file named with a newline cannot add lines to
 * what a command prints, nor one with an escape sequence retitle the
 * window or clear the screen. JSON output escapes the same bytes its own
 * way (gm_emit_json_string). */
#ifndef GPUMEM_TOOLS_SHOW_H
#define GPUMEM_TOOLS_SHOW_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* s into buf (cap bytes, NUL-terminated, cut with "..." when it does not
 * fit) with control characters (C0, DEL, and C1 as UTF-8 encodes them)
 * and bytes that are not UTF-8 written as \xNN. Showing shown text again
 * changes nothing, so a message may show a name that is shown already.
 * Returns buf. */
const char* show_text(const char* s, char* buf, size_t cap);
/* The same, malloc'ed and never cut; NULL when out of host memory. */
char* show_dup(const char* s);

/* A library message without its own "gpumem: " (or "gpumem config: ")
 * prefix, for a line that starts with one already. */
const char* show_detail(const char* msg);
/* 1234567 -> "1,234,567" (buf of at least 32 bytes). */
const char* show_count(uint64_t v, char* buf);
/* The first line of a message, cut with "..." past 300 characters (the
 * JSON output carries the whole text). */
const char* show_first_line(const char* msg, char* buf, size_t cap);
/* s as a JSON string, every control character escaped. */
void show_json(FILE* f, const char* s);

#endif
