/* dist_nccl.h — the bytes of dp.distributed's GPU messages, by NCCL
 * (csrc/dist_nccl.c); dist.c runs the protocol around them over MPI.
 *
 * One NCCL communicator of two ranks per direction of a pair of processes
 * and pair of GPUs (sender rank 0, receiver rank 1), made lazily by the
 * sender's first GPU message on it: only the two processes of a send take
 * part, so a job-wide communicator made on first use would wait for ranks
 * that never come. The sender makes the unique id; it travels to the
 * receiver in the ticket (over MPI, inside dist.c's protocol); both sides
 * create the communicator non-blocking (ncclConfig_t.blocking = 0) and poll
 * it against the call's deadline. Each direction has its own communicator and
 * stream, so a send and a receive between the same two processes never wait
 * for each other's kernels (NCCL: a send and a receive that must progress
 * together need one group, or, as here, separate communicators).
 *
 * Order: NCCL pairs a communicator's sends and receives by the order they are
 * queued, not by tag. The sender numbers its messages per communicator (the
 * ticket) when it takes them, and both sides queue ticket k only after ticket
 * k - 1, whatever thread runs each call.
 *
 * Failure: every wait polls (cudaEventQuery, ncclCommGetAsyncError) until the
 * deadline; at the deadline or on an NCCL error the communicator is aborted
 * (ncclCommAbort), every call still on it fails, and the next message of
 * that direction makes a new one. Built without NCCL, the functions fail with
 * DP_ERR_UNSUPPORTED.
 */
#ifndef DP_DIST_NCCL_H
#define DP_DIST_NCCL_H

#include <stdint.h>

#include "dp_status.h"

enum { DP_NCCL_ID_BYTES = 128 }; /* NCCL_UNIQUE_ID_BYTES */

/* What the sender of a GPU message tells the receiver before either queues
 * NCCL work: which communicator (the sender's generation), the message's
 * place in its order, and the unique id that makes it. generation < 0: the
 * sender could not start NCCL (why says so), and both sides fail. */
typedef struct dp_nccl_ticket {
  int64_t generation;
  int64_t ticket;
  unsigned char id[DP_NCCL_ID_BYTES];
  char why[256];
} dp_nccl_ticket;

/* 1 when dpcore was built with NCCL. */
int dp_nccl_p2p_built(void);

/* A number naming physical GPU `gpu` of this process among the job's: its
 * host name and PCI bus id hashed (FNV-1a); two processes on one GPU get the
 * same. 0 when CUDA cannot say. */
uint64_t dp_nccl_gpu_uid(int gpu);

/* The sender's ticket for its next message to `peer` from GPU my_gpu to the
 * peer's GPU peer_gpu; makes the communicator's entry (and unique id) on
 * first use. */
DP_MUST_CHECK dp_status dp_nccl_p2p_ticket(int peer, int my_gpu, int peer_gpu, dp_nccl_ticket *out);

/* Queues ticket t's message (send: buf's bytes to peer; receive: into buf)
 * in the ticket's order, after the work queued on `stream` (the tensor's
 * device stream) so far, and waits for it until timeout seconds have passed.
 * Creates the communicator when t is its first ticket. DP_ERR_DIST naming the
 * peer at the deadline (the communicator aborted), DP_ERR_CUDA for an NCCL or
 * CUDA error. */
DP_MUST_CHECK dp_status dp_nccl_p2p_move(int is_send, int peer, int my_gpu, const dp_nccl_ticket *t, void *buf,
                                         int64_t bytes, void *stream, double timeout, const char *what);

/* Aborts every communicator (ncclCommAbort: local, never waits for a peer)
 * and frees its stream: before MPI_Finalize, when no message is in flight. */
void dp_nccl_p2p_shutdown(void);

#endif
