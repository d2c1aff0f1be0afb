/* The CPU's cache sizes, so that blocking follows the machine rather than
 * constants tuned on one CPU: a block meant to stay in a core's L2 is sized
 * from this core's L2 (1 MiB on the AMD EPYC the defaults were tuned on, 2 MiB
 * on recent Intel Xeons, 512 KiB on older ones). */
#ifndef DP_CPU_CACHES_H
#define DP_CPU_CACHES_H

#include <stdint.h>

#include "dp_status.h"

/* Bytes of one core's L2 cache: DPCORE_L2_BYTES when set to a size in
 * [DP_L2_MIN, DP_L2_MAX] (A/B work, tests), else Linux's sysfs for cpu0, else
 * sysconf, else DP_L2_DEFAULT. Read once; thread-safe. */
int64_t dp_cpu_l2_bytes(void);

/* Where the value came from: "DPCORE_L2_BYTES", "sysfs", "sysconf" or "default". */
const char *dp_cpu_l2_source(void);

/* DP_ERR_VALUE when DPCORE_L2_BYTES is set to something that is not such a
 * size (dp_cpu_l2_bytes would pass over it; a model's construction asks this). */
DP_MUST_CHECK dp_status dp_cpu_l2_env_check(void);

#define DP_L2_MIN ((int64_t)128 << 10)
#define DP_L2_MAX ((int64_t)64 << 20)
#define DP_L2_DEFAULT ((int64_t)1 << 20)

#endif
