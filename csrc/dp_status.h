/* dp_status.h — errors are values.
 *
 * Every fallible core function returns a dp_status. On failure the message
 * (what failed, and the file:line that detected it) is kept in a thread-local
 * buffer, read with dp_error_message() on the same thread. The binding turns
 * status + message into a Python exception in exactly one place
 * (raise_from_status in csrc/py_common.c). The core never exits or aborts.
 *
 * Every function that returns a dp_status is declared DP_MUST_CHECK, so a
 * caller that drops one gets a compiler warning (an error under the
 * project's -Werror builds): DP_TRY it, or hand it to dp_status_ignore with a
 * comment saying why nothing can be done with it.
 */
#ifndef DP_STATUS_H
#define DP_STATUS_H

#include <stddef.h>

/* GCC and Clang (and nvcc's host pass, whose host compiler is one of them)
 * warn about a call whose result is dropped; other compilers get nothing. */
#if defined(__GNUC__) || defined(__clang__)
#define DP_MUST_CHECK __attribute__((warn_unused_result))
#else
#define DP_MUST_CHECK
#endif

typedef enum dp_status {
  DP_OK = 0,
  DP_ERR_VALUE,        /* bad argument: shape, range, device name  -> ValueError */
  DP_ERR_TYPE,         /* wrong kind of argument                    -> TypeError */
  DP_ERR_MEMORY,       /* allocation failed                         -> MemoryError */
  DP_ERR_IO,           /* file or stream                            -> OSError */
  DP_ERR_RUNTIME,      /* internal failure                          -> dpcore.DpcoreError */
  DP_ERR_CUDA,         /* CUDA runtime / cuDNN / cuBLAS / NCCL      -> dpcore.DeviceError */
  DP_ERR_UNSUPPORTED,  /* not built in / not available here         -> dpcore.DpcoreError */
  DP_ERR_ABORTED,      /* a collective gave up: another replica failed (that replica's error is reported) */
  DP_ERR_DIST,         /* another process: missing past the deadline, out of step, MPI failed -> dpcore.DistributedError */
  DP_ERR_NUMERIC       /* a training step's loss is not finite; the step applied no update -> FloatingPointError */
} dp_status;
/* No status means "interrupted": Ctrl-C is Python's to see. The loops over
 * steps and batches are Python's (dp.train, evaluate, predict), each step or
 * batch one C call with the GIL released, and Python raises KeyboardInterrupt
 * when that call returns; the core has no loop of steps to check for it. */

/* Record an error (printf-style) and return code. Use through DP_FAIL. */
DP_MUST_CHECK dp_status dp_fail_at(dp_status code, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define DP_FAIL(code, ...) dp_fail_at((code), __FILE__, __LINE__, __VA_ARGS__)

/* Propagate a failure unchanged. */
#define DP_TRY(expr)                       \
  do {                                     \
    dp_status dp_try_s_ = (expr);          \
    if (dp_try_s_ != DP_OK) return dp_try_s_; \
  } while (0)

/* Drop a status on purpose, where nothing can be done with a failure (a
 * cleanup path that is already reporting another error). GCC warns about a
 * (void) cast of a DP_MUST_CHECK call (Clang does not), so the cast goes here,
 * on a parameter; every caller says why in a comment. */
static inline void dp_status_ignore(dp_status s) { (void)s; }

/* An on/off switch of the environment, read with getenv at every call (so a
 * test may set it between calls in one process): *on = 1 for "1", 0 for "0",
 * dflt when unset or empty; DP_ERR_VALUE naming the variable otherwise. */
DP_MUST_CHECK dp_status dp_env_switch(const char *name, int dflt, int *on);

/* The last error message recorded on this thread ("" if none). */
const char *dp_error_message(void);
/* Copy another thread's message into this thread's buffer (replica threads). */
void dp_error_set_message(const char *msg);
void dp_error_clear(void);
const char *dp_status_name(dp_status s);

#endif
