/* PyTorch memory snapshot pickles (torch.cuda.memory._dump_snapshot) read as
 * traces: see snapshot.c for what is taken from them and the errors. */
#ifndef GPUMEM_TOOLS_SNAPSHOT_H
#define GPUMEM_TOOLS_SNAPSHOT_H

#include <stddef.h>

#include "gpumem.h"
#include "trace.h"

/* The snapshot in data (a pickle) as a trace of one device's history
 * (GPUMEM_SNAPSHOT_DEVICE, else the device with most events). GPUMEM_ERR_IO
 * with "PATH: ..." in gpumem_last_error() for a file that is not a snapshot,
 * a snapshot without history, or one whose history lost events. */
gpumem_status_t snapshot_to_trace(const char* path, const unsigned char* data, size_t len,
                                  trace_t** out);

#endif
