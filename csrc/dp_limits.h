/* dp_limits.h — the documented upper limits of dpcore, in one place.
 *
 * The Python package reads them from the extension (_core.MAX_*) and checks
 * arguments against them first, with messages naming the argument; the core
 * enforces the same limits itself (DP_ERR_VALUE), so that no caller, the
 * binding's own included, can take it past them: a thread count of 100000
 * used to reach libgomp and end the process.
 */
#ifndef DP_LIMITS_H
#define DP_LIMITS_H

#include <limits.h>

/* threads one device's replica may use (OpenMP team size) */
#define DP_MAX_THREADS 256
/* channels of a convolution or an input, features of a dense layer */
#define DP_MAX_FEATURES 65536
/* parameters of one model: the flat buffer is indexed with an int */
#define DP_MAX_PARAMS INT_MAX
/* samples in one batch */
#define DP_MAX_BATCH INT_MAX
/* logical devices of one kind (the device registry's table) */
#define DP_DEVICES_MAX 64

#endif
