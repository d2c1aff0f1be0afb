/* dist_nccl.h — the bytes of dp.distributed's GPU messages, by NCCL
 * (csrc/dist_nccl.c); dist.c runs the protocol around them over MPI.
 *
 * One NCCL communicator of two ranks per pair of processes (and pair of
 * GPUs), for both directions, made lazily by the pair's first GPU message:
 * only the two processes of a message take part, so a job-wide communicator
 * made on first use would wait for ranks that never come. The lower rank of
 * the pair is its communicator's rank 0 and its sequencer: it makes the
 * unique id and numbers every GPU message of the pair, in either direction
 * (the ticket), and sends the ticket to the higher rank over MPI inside
 * dist.c's protocol (as the sender after the answer, as the receiver with
 * it). Both sides make the communicator non-blocking (ncclConfig_t.blocking
 * = 0) and poll it against the call's deadline.
 *
 * Order: NCCL pairs a communicator's sends and receives by the order they are
 * queued, not by tag, and its kernels block the GPU until the peer's matching
 * call runs. Both sides queue ticket k only after ticket k - 1, whatever
 * thread runs each call, on the communicator's one stream: the pair's
 * messages run one at a time in the same order on both GPUs, so messages in
 * both directions at once (an isend each way) cannot wait for each other. A
 * process exchanging with several peers at once uses several communicators
 * at once, which needs their kernels to run side by side (NCCL's guide warns
 * that this is not guaranteed: "Using multiple NCCL communicators
 * concurrently").
 *
 * Failure: every wait polls (cudaEventQuery, ncclCommGetAsyncError) until the
 * deadline; at the deadline or on an NCCL error the communicator is aborted
 * (ncclCommAbort), every call still on it fails, and the pair's next message
 * makes a new one. Built without NCCL, the functions fail with
 * DP_ERR_UNSUPPORTED.
 */
#ifndef DP_DIST_NCCL_H
#define DP_DIST_NCCL_H

#include <stdint.h>

#include "dp_status.h"

enum { DP_NCCL_ID_BYTES = 128 }; /* NCCL_UNIQUE_ID_BYTES */

/* What the lower rank of a pair tells the higher about a GPU message before
 * either queues NCCL work: which communicator (the lower rank's generation),
 * the message's place in its order, and the unique id that makes it.
 * generation < 0: the lower rank could not start NCCL (why says so), and both
 * sides fail. */
typedef struct dp_nccl_ticket {
  int64_t generation;
  int64_t ticket;
  unsigned char id[DP_NCCL_ID_BYTES];
  char why[256];
} dp_nccl_ticket;

/* 1 when dpcore was built with NCCL. */
int dp_nccl_p2p_built(void);

/* A number naming GPU `gpu` of this process among the job's: its UUID
 * hashed (FNV-1a); two processes on one GPU get the same. 0 when CUDA cannot
 * say. */
uint64_t dp_nccl_gpu_uid(int gpu);

/* The lower rank's ticket for the next GPU message between it (GPU my_gpu)
 * and `peer` (its GPU peer_gpu), either way; makes the communicator's entry
 * (and unique id) on first use. */
DP_MUST_CHECK dp_status dp_nccl_p2p_ticket(int peer, int my_gpu, int peer_gpu, dp_nccl_ticket *out);

/* Queues ticket t's message (send: buf's bytes to peer; receive: into buf)
 * in the ticket's order, after the work queued on `stream` (the tensor's
 * device stream) so far, and waits for it until timeout seconds have passed.
 * lower: this process is the pair's lower rank. Creates the communicator when
 * t is its first ticket. DP_ERR_DIST naming the peer at the deadline or on an
 * NCCL error (the communicator aborted), DP_ERR_CUDA for a CUDA error. */
DP_MUST_CHECK dp_status dp_nccl_p2p_move(int is_send, int lower, int peer, int my_gpu, const dp_nccl_ticket *t,
                                         void *buf, int64_t bytes, void *stream, double timeout, const char *what);

/* Aborts every communicator (ncclCommAbort: local, never waits for a peer)
 * and frees its stream: before MPI_Finalize, when no message is in flight. */
void dp_nccl_p2p_shutdown(void);

#endif
