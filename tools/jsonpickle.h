/* JSON text rewritten as a Python pickle (protocol 2) of the same value:
 * objects become dicts, arrays lists, numbers int or float, true, false
 * and null True, False and None. gpumem's snapshots are JSON in the shape
 * of torch.cuda.memory._snapshot(); PyTorch's memory_viz and gpumem's own
 * trace reader take that shape as a pickle, so `gpumem explain --snapshot`
 * writes one through this. */
#ifndef GPUMEM_TOOLS_JSONPICKLE_H
#define GPUMEM_TOOLS_JSONPICKLE_H

#include <stddef.h>

#include "gpumem.h"

/* Writes the pickle of the JSON value in json[0, len) through write.
 * GPUMEM_ERR_INVALID_ARGUMENT for text that is not one JSON value (or
 * nests deeper than 64), GPUMEM_ERR_HOST_MEMORY when write fails;
 * gpumem_last_error() says where. */
gpumem_status_t json_to_pickle(const char* json, size_t len, gpumem_write_fn write, void* arg);

#endif
