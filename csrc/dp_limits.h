/* dp_limits.h — the documented limits of dpcore, in one place.
 *
 * The C core refuses anything beyond them with DP_ERR_VALUE (a ValueError
 * naming the argument), never a crash; the binding exports each as a
 * constant of dpcore._core (MAX_THREADS, ...), so that python/dpcore checks
 * against the same numbers (python/dpcore/_check.py) and the README's
 * "Limits" paragraph states them.
 */
#ifndef DP_LIMITS_H
#define DP_LIMITS_H

#include <limits.h>

#include "dp_status.h"

/* threads of one CPU device's replica (OpenMP's team): more is a libgomp
 * failure or a crash long before it is any faster */
#define DP_MAX_THREADS 256
/* channels of a convolution's input or output, features of a dense layer's output */
#define DP_MAX_CHANNELS 65536
/* logical devices of one kind (CPU devices; logical GPUs in all) */
#define DP_MAX_DEVICES 64
/* trainable scalars of a model (its flat buffer, padding included), and
 * samples of one batch: fewer than 2**31 */
#define DP_MAX_PARAMS INT_MAX
#define DP_MAX_BATCH INT_MAX

/* The SGD hyperparameters, checked in one place before any step: lr and
 * weight_decay finite and >= 0, momentum in [0, 1], each within float32's
 * range (the kernels take floats). DP_ERR_VALUE naming the argument. */
DP_MUST_CHECK dp_status dp_sgd_args_check(double lr, double momentum, double weight_decay);
/* A gradient scale: finite and within float32's range. */
DP_MUST_CHECK dp_status dp_grad_scale_check(double grad_scale);

#endif
