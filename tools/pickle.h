/* A reader for the subset of Python's pickle format that a PyTorch memory
 * snapshot uses (torch.cuda.memory._dump_snapshot: pickle.dump of a dict of
 * lists, dicts, strings, ints, floats, booleans and None, protocols 2 to
 * 5). The file becomes a tree of values in one array; nothing executes, and
 * any opcode outside the subset (classes, globals, persistent IDs) is an
 * error that names it and its offset. */
#ifndef GPUMEM_TOOLS_PICKLE_H
#define GPUMEM_TOOLS_PICKLE_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem.h"

typedef enum pickle_type {
  PICKLE_NONE = 0,
  PICKLE_BOOL,
  PICKLE_INT, /* fits in 64 bits (larger integers are an error) */
  PICKLE_FLOAT,
  PICKLE_STR,   /* UTF-8, not NUL-terminated: use len */
  PICKLE_BYTES, /* same */
  PICKLE_LIST,  /* children: items */
  PICKLE_TUPLE, /* children: items */
  PICKLE_DICT,  /* children: key, value, key, value... */
} pickle_type_t;

typedef struct pickle_value {
  uint8_t type; /* pickle_type_t */
  /* One of these, by type (a union: a value costs 32 bytes, and a file
   * may hold one value for every byte). */
  union {
    int64_t i;     /* INT, BOOL */
    double f;      /* FLOAT */
    const char* s; /* STR, BYTES: points into the file's bytes */
    struct {
      uint32_t head, tail; /* while reading: the container's chain of kids */
    } chain;
  };
  size_t len;     /* STR, BYTES: bytes; LIST, TUPLE: items; DICT: 2 x entries */
  uint32_t* kids; /* LIST, TUPLE, DICT: value indices (into the doc's one array) */
} pickle_value_t;

typedef struct pickle_doc {
  pickle_value_t* values; /* values[root] is the pickled object */
  size_t num_values;
  size_t cap_values;
  uint32_t* kids; /* every container's kids, one after another */
  uint32_t root;
} pickle_doc_t;

/* Limits of the reader (docs/security.md, "Limits of the readers"). Memory
 * stays linear in the file: every value, container item, stack slot and
 * memo entry needs at least one byte of it, and costs at most 32 bytes
 * (a value), 8 (an item while reading, 4 after), 4 (a stack slot) and 4
 * (a memo entry); in all at most PICKLE_BYTES_PER_INPUT_BYTE times the
 * file, plus growth slack. A memo key past the file's length is refused
 * (pickle.dump numbers memo entries 0, 1, 2..., one per PUT opcode) before
 * the memo grows. */
#define PICKLE_BYTES_PER_INPUT_BYTE 64

/* Whether the bytes begin as a pickle of protocol 2 or later does. */
int pickle_looks_like(const unsigned char* data, size_t len);

/* Reads data (which must outlive doc: strings point into it). On failure
 * GPUMEM_ERR_IO with "PATH: ..." in gpumem_last_error(): not a pickle, an
 * unsupported opcode (named, with its offset), truncated, malformed. */
gpumem_status_t pickle_read(const char* path, const unsigned char* data, size_t len,
                            pickle_doc_t* doc);
void pickle_free(pickle_doc_t* doc);

/* The value of key in dict d (a DICT value), or NULL. */
const pickle_value_t* pickle_get(const pickle_doc_t* doc, const pickle_value_t* d, const char* key);
/* Child k of a LIST or TUPLE. */
static inline const pickle_value_t* pickle_item(const pickle_doc_t* doc, const pickle_value_t* v,
                                                size_t k) {
  return &doc->values[v->kids[k]];
}
/* Whether v is the string s. */
int pickle_is_str(const pickle_value_t* v, const char* s);

#endif
