/* dist.h — the processes of a job, over MPI (Open MPI), never a transport
 * of our own.
 *
 * A process started by mpirun (or any launcher that sets Open MPI's, PMIx's
 * or PMI's rank variables) joins the job on first use (dp_dist_init); any
 * other process is a world of one and never initialises MPI. dpcore
 * finalises only an MPI it initialised (mpi4py may have done it first). It
 * asks for MPI_THREAD_MULTIPLE but needs only MPI_THREAD_SERIALIZED: every
 * MPI call it makes holds one process-wide lock.
 *
 * Every operation that waits for another process is non-blocking underneath
 * and polled against a deadline: a peer that never arrives (stopped, hung, or
 * skipping the operation) is a DP_ERR_DIST naming the missing peers and what
 * was awaited, never a hang. What to do next is the caller's; python/dpcore
 * ends an unhandled exception with MPI_Abort (dp_dist_abort), so that mpirun
 * takes the whole job down.
 *
 * Built without MPI (DPCORE_MPI=0, or no mpicc), every process is a world of
 * one and the operations that need a peer return DP_ERR_UNSUPPORTED.
 */
#ifndef DP_DIST_H
#define DP_DIST_H

#include <stdint.h>

#include "collective.h"
#include "dp_status.h"

typedef struct dp_dist_info {
  int rank, size;             /* MPI_COMM_WORLD */
  int local_rank, local_size; /* the processes of this host (MPI_COMM_TYPE_SHARED) */
  int mpi_initialized;        /* MPI is initialised (by us or by someone before us) */
  int initialized_here;       /* dpcore called MPI_Init_thread, and will finalise */
  int thread_level;           /* what MPI granted (0..3: single .. multiple), -1 without MPI */
  int launched;               /* a launcher's variables were found */
} dp_dist_info;

/* 1 when dpcore was built with MPI. */
int dp_dist_built(void);
/* The library's own description (MPI_Get_library_version), and whether it
 * can take CUDA device memory (Open MPI's MPIX_Query_cuda_support; -1 when it
 * cannot tell, or before MPI is initialised, which its run-time answer needs). */
const char *dp_dist_library_version(void);
int dp_dist_cuda_aware(void);

/* Joins the job (idempotent; thread-safe). A process no launcher started is a
 * world of one: rank 0 of 1, MPI not initialised. DP_ERR_DIST when MPI fails
 * to start or grants less than MPI_THREAD_SERIALIZED. */
DP_MUST_CHECK dp_status dp_dist_init(dp_dist_info *out);
/* What dp_dist_init found, without initialising anything (size 1 before it). */
dp_dist_info dp_dist_get_info(void);
/* MPI_Finalize when dpcore initialised MPI and nothing has failed since; a
 * no-op otherwise. After it every operation fails. */
DP_MUST_CHECK dp_status dp_dist_finalize(void);
/* MPI_Abort(MPI_COMM_WORLD, code) when MPI is initialised: mpirun ends every
 * process of the job. Returns only when MPI is not running. */
void dp_dist_abort(int code);

/* 1 once an operation failed part way (a peer missed its deadline, MPI
 * failed): the processes are out of step, every later operation fails at
 * once, and finalising could wait forever (python/dpcore aborts instead). */
int dp_dist_is_broken(void);

/* The operations below are collective over every process of the job: each
 * calls them in the same order with the same sizes. timeout: seconds to wait
 * for the slowest peer (> 0). what: what is awaited, for the error message
 * ("the gradient all-reduce of step 12"). */

/* Root's bytes to every process (MPI_Ibcast). */
DP_MUST_CHECK dp_status dp_dist_bcast(void *buf, int64_t bytes, int root, double timeout, const char *what);
/* Every process's `bytes` bytes, in rank order, into all[size * bytes].
 * Point to point, so that a timeout names the ranks that did not arrive. */
DP_MUST_CHECK dp_status dp_dist_allgather(const void *mine, int64_t bytes, void *all, double timeout,
                                          const char *what);
DP_MUST_CHECK dp_status dp_dist_barrier(double timeout, const char *what);

/* All-reduce across processes of this process's k replica buffers
 * bufs[0..k-1] (host memory, n floats each; each process passes its own k).
 * Every element of every buffer of every process becomes
 * (((g0 + g1) + g2) + ... + g_{R-1}) * scale over the job's R replicas in
 * global order (process by process, local rank by local rank): the value one
 * process computes over R replica threads (collective.c), whatever the split
 * into processes.
 *
 * A chain: process p receives the running sum of processes 0..p-1, adds its
 * own replicas in order and passes it on; the last process scales it and the
 * result travels back down. In segments of DP_DIST_SEGMENT floats, so that
 * the processes work on different segments at once. stage: 2 *
 * DP_DIST_SEGMENT floats of scratch. tag: in [0, DP_DIST_MAX_TAG), distinct
 * for operations that may be in flight at once. */
enum { DP_DIST_SEGMENT = 1 << 18, DP_DIST_MAX_TAG = 1 << 12 };
DP_MUST_CHECK dp_status dp_dist_chain_allreduce(float *const *bufs, int k, int64_t n, float scale, int tag,
                                                float *stage, double timeout, const char *what);

/* A channel: a communication context of its own (an MPI communicator
 * duplicated from the job's), whose messages never meet another channel's,
 * whatever the tags. Opening is collective: every process opens its channels
 * in the same order. Closing one after MPI was finalised only frees memory. */
typedef struct dp_dist_channel dp_dist_channel;
DP_MUST_CHECK dp_status dp_dist_channel_open(double timeout, dp_dist_channel **out);
void dp_dist_channel_close(dp_dist_channel *ch);

/* dp_dist_chain_allreduce on a channel (NULL: the job's default one), with a
 * flag that, once set by another thread, makes the chain give up
 * (DP_ERR_ABORTED) instead of waiting on: a comm being destroyed. */
DP_MUST_CHECK dp_status dp_dist_chain_allreduce_on(const dp_dist_channel *ch, float *const *bufs, int k, int64_t n,
                                                   float scale, int tag, float *stage, double timeout,
                                                   const char *what, const _Atomic int *abandon);

/* The same all-reduce, the same bits, in the owner-computes form: the buffer
 * in P segments; process q receives every other process's replicas' slices
 * of segment q, adds all R replicas' slices in global order (exactly the
 * chain's additions), scales, and sends the result to every process. Two
 * rounds of messages whatever P (the chain takes 2P), each process sending
 * about k n floats and receiving about (R - k) n / P + n; chunked so that
 * adding overlaps the arrival of the next chunk. ks[q]: process q's replica
 * count (every process passes the same ks; ks[rank] == k). Stages (R - k) n / P
 * floats of its own. */
DP_MUST_CHECK dp_status dp_dist_owner_allreduce_on(const dp_dist_channel *ch, float *const *bufs, int k, const int *ks,
                                                   int64_t n, float scale, int tag, double timeout, const char *what,
                                                   const _Atomic int *abandon);

/* ---- point to point (dp.distributed.send / recv) ----
 *
 * A message is a description (element type, memory kind, shape) and its
 * bytes. The receiver compares the description with the one it expects and
 * answers before any byte moves, so that a mismatch is a DP_ERR_DIST naming
 * both descriptions on both ranks and leaves the job in step. Each call waits
 * at most timeout seconds for its peer; a peer that does not come is named
 * and the job is out of step (dp_dist_is_broken), as for the collectives.
 * The k-th send from a to b with tag t pairs with b's k-th receive from a with
 * tag t, whatever the threads: the caller takes k (dp_dist_p2p_next_seq) in
 * program order, and at most DP_DIST_P2P_SLOTS may be in flight per peer and
 * tag (it refuses more: their MPI tags would repeat); every k taken is given
 * to one dp_dist_send_seq / dp_dist_recv_seq, whose return ends it. Not
 * collective; a process alone (or built without MPI) has no peer. */
/* Point-to-point tags: 0..99 are the user's (dp.distributed checks them),
 * 100..DP_DIST_P2P_TAGS - 1 dpcore's own channels (the multi-process
 * pipeline). The largest MPI tag, (255 * 32 + 31) * 3 + 2 = 24575, stays under
 * 32767, the least MPI_TAG_UB the standard allows. */
enum { DP_DIST_MAX_DIMS = 8, DP_DIST_P2P_TAGS = 256, DP_DIST_P2P_SLOTS = 32 };
typedef struct dp_dist_desc {
  int32_t dtype;  /* 0 float32, 1 float64, 2 int32, 3 int64, 4 uint8 */
  int32_t device; /* 0 host memory, 1 GPU memory */
  int32_t ndim;
  int32_t gpu;       /* GPU memory: the physical GPU's ordinal in its process */
  uint64_t gpu_uid;  /* GPU memory: the GPU's UUID, hashed (dp_nccl_gpu_uid), 0 when unknown */
  int64_t shape[DP_DIST_MAX_DIMS];
} dp_dist_desc;
/* The sequence number of the next send to (is_send) or receive from peer with tag. */
DP_MUST_CHECK dp_status dp_dist_p2p_next_seq(int is_send, int peer, int tag, int64_t *seq);
/* desc's bytes from buf to rank dst. GPU memory (desc->device 1): buf is
 * device memory of GPU desc->gpu, ready once the work queued on `stream` (its
 * device's cudaStream_t) so far is done; the bytes move by NCCL (dist_nccl.h)
 * after the description was accepted over MPI. stream is NULL for host memory. */
DP_MUST_CHECK dp_status dp_dist_send_seq(const void *buf, const dp_dist_desc *desc, int dst, int tag, int64_t seq,
                                         void *stream, double timeout, const char *what);
/* A message described as expect from rank src, into buf (expect's bytes;
 * GPU memory as for dp_dist_send_seq, written once the call returns). The
 * receiver refuses a description other than expect, and a GPU message between
 * two processes on one physical GPU (equal gpu_uid: NCCL refuses two ranks on
 * one GPU). */
DP_MUST_CHECK dp_status dp_dist_recv_seq(void *buf, const dp_dist_desc *expect, int src, int tag, int64_t seq,
                                         void *stream, double timeout, const char *what);
/* Only the description and the answer of a send (is_send) or receive: DP_OK
 * when the receiver accepts, the DP_ERR_DIST of dp_dist_send_seq otherwise;
 * no byte moves either way. The peer calls it too (the protocol's first half,
 * for the tests of the descriptions on machines without GPUs). */
DP_MUST_CHECK dp_status dp_dist_p2p_handshake(int is_send, const dp_dist_desc *desc, int peer, int tag, int64_t seq,
                                              double timeout, const char *what);

#endif
