/* Cross-file internals shared by every subsystem (gm_ prefix). The engine's
 * own structures live in engine.h. */
#ifndef GPUMEM_INTERNAL_H
#define GPUMEM_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "gpumem.h"
#include "gpumem_backend.h"

#define GM_KIB ((size_t)1024)
#define GM_MIB (GM_KIB * 1024)
#define GM_GIB (GM_MIB * 1024)

#if defined(__GNUC__)
#define GM_LIKELY(x) __builtin_expect(!!(x), 1)
#define GM_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define GM_PRINTF(a, b) __attribute__((format(printf, a, b)))
/* Rare paths kept out of the hot path's code (and its registers). */
#define GM_COLD __attribute__((cold, noinline))
#else
#define GM_LIKELY(x) (x)
#define GM_UNLIKELY(x) (x)
#define GM_PRINTF(a, b)
#define GM_COLD
#endif

/* Sets the thread-local detail message and returns status. */
gpumem_status_t gm_fail(gpumem_status_t status, const char* fmt, ...) GM_PRINTF(2, 3);

/* Around a backend call: whether the call wrote a detail message. */
void gm_call_begin(void);
bool gm_call_wrote_message(void);

/* The table of gpumem_print_leaks alone (leaks.c), its first max_groups
 * groups and a line for the rest, with the totals in *sum: for reports
 * that say the rest in their own words (gpumem report). */
int gm_print_leak_table(gpumem_t* gm, uint64_t since, uint64_t max_groups, gpumem_leaks_t* sum,
                        gpumem_write_fn write, void* arg);

/* Writes a byte count as "12.34 MiB" into buf (at least 32 bytes). */
const char* gm_format_bytes(uint64_t bytes, char* buf, size_t len);

/* ---- text output (stats.c) ---- */

/* Remembers the sink's first nonzero answer and writes nothing after it:
 * a full disk or closed pipe should end the output, not get 200 more calls. */
typedef struct gm_emitter {
  gpumem_write_fn write;
  void* arg;
  int rc;
} gm_emitter;
void gm_emit(gm_emitter* e, const char* text, size_t len);
void gm_emitf(gm_emitter* e, const char* fmt, ...) GM_PRINTF(2, 3);
/* s as a JSON string: quotes and backslashes escaped, control characters
 * (C0, DEL, C1) as \u00XX, bytes that are not UTF-8 as \ufffd. */
void gm_emit_json_string(gm_emitter* e, const char* s);

/* ---- output files at a user's path (outfile.c) ---- */

/* A file being written beside its target, renamed into place at commit.
 * Never opened through a link nor into a file that exists: the target is
 * refused (a link, not a regular file, another user's, writable by other
 * users, with other hard links) with the reason naming the path. */
typedef struct gm_outfile {
  int dir_fd;
  char path[1024]; /* as given */
  char name[256];  /* the target's name in its directory */
  char tmp[256];   /* the new file's name there, "" once renamed or removed */
} gm_outfile;
/* The new file's descriptor (O_WRONLY, O_CLOEXEC; mode exactly `mode`,
 * 0600 unless there is a reason), or -1 with why ("refusing to write PATH:
 * ..." or "cannot write PATH: ...") and nothing left behind. */
int gm_outfile_open(gm_outfile* o, const char* path, mode_t mode, char* why, size_t cap);
/* Renames the new file over the target (the descriptor stays usable);
 * false with why, the new file removed. */
bool gm_outfile_commit(gm_outfile* o, char* why, size_t cap);
/* Removes the new file (a failed write); nothing after a commit. */
void gm_outfile_abandon(gm_outfile* o);

#endif
