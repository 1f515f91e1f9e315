/* Trace files of either kind, a gpumem trace (gzip or plain text,
 * traces/README.md) or a PyTorch memory snapshot pickle, read into one
 * trace_t (trace.h). */
#ifndef GPUMEM_TOOLS_READER_H
#define GPUMEM_TOOLS_READER_H

#include <stddef.h>

#include "gpumem.h"
#include "trace.h"

/* Limit of the readers (docs/security.md, "Limits of the readers"): the
 * bytes a file (trace text or snapshot pickle) may hold once inflated (a
 * gzip file inflates up to 1032 times its size, so the cap is on the
 * output). TRACE_MAX_BYTES_DEFAULT unless changed (tests lower it). */
#define TRACE_MAX_BYTES_DEFAULT ((size_t)256 << 20)
extern size_t trace_max_bytes;

/* Reads path (gzip or plain) and validates every event. On failure returns
 * GPUMEM_ERR_IO (unreadable file, malformed line, inconsistent IDs) or
 * GPUMEM_ERR_HOST_MEMORY, with a message naming the file and the line in
 * gpumem_last_error(), and *out is NULL. */
gpumem_status_t trace_load(const char* path, trace_t** out);

#endif
