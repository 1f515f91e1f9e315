/* The library's version, status texts and the thread-local detail message
 * behind gpumem_last_error(): every interesting failure leaves one here. */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

static _Thread_local char last_error[4096];
/* Messages written on this thread, and that count when the running backend
 * call began: a call that fails without writing one is named (GM_CALL). */
static _Thread_local uint64_t messages_written, written_at_call;

int gpumem_version(void) {
  return GPUMEM_VERSION;
}

const char* gpumem_strerror(gpumem_status_t status) {
  switch (status) {
    case GPUMEM_OK:
      return "success";
    case GPUMEM_ERR_INVALID_ARGUMENT:
      return "invalid argument";
    case GPUMEM_ERR_INVALID_POINTER:
      return "invalid pointer";
    case GPUMEM_ERR_OUT_OF_MEMORY:
      return "out of memory";
    case GPUMEM_ERR_BACKEND:
      return "device error";
    case GPUMEM_ERR_CONFIG:
      return "bad configuration";
    case GPUMEM_ERR_HOST_MEMORY:
      return "out of host memory";
    case GPUMEM_ERR_UNSUPPORTED:
      return "unsupported";
    case GPUMEM_NOT_READY:
      return "not ready";
    case GPUMEM_ERR_IO:
      return "input/output error";
  }
  return "unknown status";
}

const char* gpumem_last_error(void) {
  return last_error;
}

void gm_call_begin(void) {
  written_at_call = messages_written;
}

bool gm_call_wrote_message(void) {
  return messages_written != written_at_call;
}

void gpumem_set_last_error(const char* fmt, ...) {
  messages_written++;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
}

gpumem_status_t gm_fail(gpumem_status_t status, const char* fmt, ...) {
  messages_written++;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return status;
}

const char* gpumem_backend_call_name(int call) {
  static const char* const names[] = {
#define GM_X_CALL_NAME(name) #name,
      GPUMEM_BACKEND_CALLS(GM_X_CALL_NAME)
#undef GM_X_CALL_NAME
  };
  if (call < 0 || call >= GPUMEM_CALL_COUNT) return NULL;
  return names[call];
}
