/* Reading a trace file: the whole file, gzip or plain, inflated up to the
 * readers' limit, then handed to the reader of its kind: a PyTorch memory
 * snapshot pickle (snapshot.c) or the text format (trace.c). The two
 * readers know nothing of each other; this is the one place that chooses. */
#include "reader.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "pickle.h"
#include "snapshot.h"

static int has_suffix(const char* s, const char* suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && strcmp(s + n - k, suffix) == 0;
}

size_t trace_max_bytes = TRACE_MAX_BYTES_DEFAULT;

gpumem_status_t trace_load(const char* path, trace_t** out) {
  *out = NULL;
  errno = 0;
  gzFile f = gzopen(path, "rb");
  if (!f) {
    gpumem_set_last_error("%s: cannot open: %s", path,
                          errno ? strerror(errno) : "out of host memory");
    return GPUMEM_ERR_IO;
  }
  gzbuffer(f, 1 << 17);

  /* Read it all, then parse: traces are a few MB of text, and a parser over
   * one buffer is simpler and faster than one over a stream. */
  size_t cap = 1 << 20, len = 0;
  char* buf = malloc(cap);
  gpumem_status_t st = GPUMEM_OK;
  if (!buf) {
    gpumem_set_last_error("%s: out of host memory", path);
    st = GPUMEM_ERR_HOST_MEMORY;
    goto done;
  }
  for (;;) {
    if (cap - len < (1 << 16)) {
      char* bigger = realloc(buf, cap * 2);
      if (!bigger) {
        gpumem_set_last_error("%s: out of host memory", path);
        st = GPUMEM_ERR_HOST_MEMORY;
        goto done;
      }
      buf = bigger;
      cap *= 2;
    }
    /* never more than one byte past the cap: that byte says it was passed */
    size_t room = trace_max_bytes + 1 - len;
    if (room > cap - len) room = cap - len;
    unsigned want = (unsigned)(room > (1u << 30) ? (1u << 30) : room);
    errno = 0;
    int got = gzread(f, buf + len, want);
    if (got < 0) {
      int zerr = 0;
      const char* msg = gzerror(f, &zerr);
      if (zerr == Z_ERRNO) msg = strerror(errno);
      gpumem_set_last_error("%s: cannot read: %s", path, msg);
      st = GPUMEM_ERR_IO;
      goto done;
    }
    if (got == 0) break;
    len += (size_t)got;
    /* Past the cap by even a byte: refused before the buffer grows again,
     * so a gzip bomb costs at most the cap in memory and its time. */
    if (len > trace_max_bytes) {
      gpumem_set_last_error(
          "%s: more than %zu bytes once inflated: larger than the readers' limit for a trace or "
          "snapshot",
          path, trace_max_bytes);
      st = GPUMEM_ERR_IO;
      goto done;
    }
  }
  /* gzread stops quietly at a truncated gzip stream; gzerror tells. */
  {
    int zerr = 0;
    const char* msg = gzerror(f, &zerr);
    if (zerr != Z_OK && zerr != Z_BUF_ERROR) {
      gpumem_set_last_error("%s: cannot read: %s", path, msg);
      st = GPUMEM_ERR_IO;
      goto done;
    }
    if (zerr == Z_BUF_ERROR) {
      gpumem_set_last_error("%s: cannot read: truncated gzip file", path);
      st = GPUMEM_ERR_IO;
      goto done;
    }
  }
  if (pickle_looks_like((const unsigned char*)buf, len)) {
    st = snapshot_to_trace(path, (const unsigned char*)buf, len, out);
  } else if (has_suffix(path, ".pickle") || has_suffix(path, ".pkl")) {
    gpumem_set_last_error(
        "%s: not a pickle (a PyTorch snapshot pickle starts with byte 0x80 and a protocol "
        "number 2 to 5)",
        path);
    st = GPUMEM_ERR_IO;
  } else {
    st = trace_parse(path, buf, len, out);
  }

done:
  free(buf);
  gzclose(f);
  return st;
}
