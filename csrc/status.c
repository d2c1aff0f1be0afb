#include "dp_status.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local char error_buffer[1024];

static const char *short_path(const char *file) {
  /* "…/csrc/layers.c" -> "csrc/layers.c": name the file as the repo does. */
  const char *p = strstr(file, "csrc/");
  if (!p) p = strstr(file, "kernels/");
  return p ? p : file;
}

dp_status dp_fail_at(dp_status code, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(error_buffer, sizeof error_buffer, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if ((size_t)n < sizeof error_buffer)
    snprintf(error_buffer + n, sizeof error_buffer - (size_t)n, " (%s:%d)", short_path(file), line);
  return code;
}

const char *dp_error_message(void) { return error_buffer; }

void dp_error_set_message(const char *msg) { snprintf(error_buffer, sizeof error_buffer, "%s", msg ? msg : ""); }

void dp_error_clear(void) { error_buffer[0] = '\0'; }

const char *dp_status_name(dp_status s) {
  switch (s) {
    case DP_OK: return "ok";
    case DP_ERR_VALUE: return "invalid value";
    case DP_ERR_TYPE: return "invalid type";
    case DP_ERR_MEMORY: return "out of memory";
    case DP_ERR_IO: return "I/O error";
    case DP_ERR_RUNTIME: return "runtime error";
    case DP_ERR_CUDA: return "CUDA error";
    case DP_ERR_UNSUPPORTED: return "unsupported";
    case DP_ERR_ABORTED: return "collective aborted";
    case DP_ERR_DIST: return "distributed error";
    case DP_ERR_NUMERIC: return "non-finite loss";
  }
  return "unknown error";
}

dp_status dp_env_switch(const char *name, int dflt, int *on) {
  const char *env = getenv(name);
  *on = dflt;
  if (!env || !env[0]) return DP_OK;
  if (strcmp(env, "1") == 0)
    *on = 1;
  else if (strcmp(env, "0") == 0)
    *on = 0;
  else
    return DP_FAIL(DP_ERR_VALUE, "%s must be \"0\", \"1\" or unset, got \"%.40s\"", name, env);
  return DP_OK;
}
