/* replica.h — one OS thread per replica.
 *
 * A replica group owns k worker threads, one per device; worker r sets its
 * OpenMP thread count to its device's share of the cores, so k replicas never
 * oversubscribe the machine. dp_group_run runs fn(arg, r) on every worker and
 * waits for all of them (fork-join). A replica that fails breaks the group's
 * barrier, so its peers return DP_ERR_ABORTED from any collective instead of
 * waiting for it forever; dp_group_run reports the failure itself.
 */
#ifndef DP_REPLICA_H
#define DP_REPLICA_H

#include "collective.h"
#include "dp_status.h"

typedef struct dp_group dp_group;
typedef DP_MUST_CHECK dp_status (*dp_group_fn)(void *arg, int rank);

/* threads[r]: OpenMP threads of worker r. cpu_device (NULL: none): worker r
 * is pinned, with the OpenMP threads it starts, to the cores of logical CPU
 * device cpu_device[r] (-1: not pinned) of dp_devices_logical(CPU) devices
 * (dp_cpu_device_cores): replicas on their own cores never share one. */
DP_MUST_CHECK dp_status dp_group_create(int k, const int *threads, const int *cpu_device, dp_group **out);
/* Whether mirrored CPU replicas are pinned to their cores
 * (DPCORE_PIN_THREADS="1"). Off by default: pinning showed no gain
 * (benchmarks/RESULTS.md, "Environment A/B"), and a pinned replica cannot
 * move off a core that another process is using. A value other than "0",
 * "1" or empty is DP_ERR_VALUE. */
DP_MUST_CHECK dp_status dp_pin_threads_enabled(int *on);
void dp_group_destroy(dp_group *g);
/* How many groups this process has made (a debug counter: tests check that
 * repeated collectives reuse their threads). */
long dp_group_created_count(void);
int dp_group_size(const dp_group *g);
/* The barrier of the k workers, for collectives inside fn. */
dp_barrier *dp_group_barrier(dp_group *g);
/* Runs fn(arg, r) on worker r for every r and waits for all; returns DP_OK
 * or the status of the lowest failing rank (one that failed by itself before
 * one that aborted because of it), its message moved to the calling thread. */
DP_MUST_CHECK dp_status dp_group_run(dp_group *g, dp_group_fn fn, void *arg);

#endif
