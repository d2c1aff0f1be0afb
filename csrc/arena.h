/* arena.h — a sub-allocator over large chunks, one per device (csrc/arena.c).
 *
 * The arena asks its owner for large chunks (alloc_chunk: cudaMalloc for a
 * CUDA device, malloc in tests/c/arena_test.c) and hands out 256-byte-aligned
 * blocks from them: best fit over a free list, a free block split on
 * allocation, neighbours coalesced on release. Chunks go back to the owner
 * only when empty (dp_arena_trim, or an allocation the owner cannot serve
 * otherwise) and on dp_arena_destroy (all of them). The bookkeeping lives in host memory, so the chunks may be
 * memory the host cannot touch. Plain C11 + pthreads, no CUDA: the CPU test
 * suite runs it under the sanitizers.
 *
 * Thread-safe: one mutex per arena (a device allocates from its replica thread
 * and from the Python thread). The chunk callbacks run with it held and must
 * not call back into the arena.
 */
#ifndef DP_ARENA_H
#define DP_ARENA_H

#include <stddef.h>

#include "dp_status.h"

/* Block alignment and size granularity: the alignment cudaMalloc guarantees
 * (CUDA C++ Programming Guide, "Device Memory Accesses": an address returned
 * by the runtime's allocation routines "is always aligned to at least 256
 * bytes"). The arena checks every chunk it is given. */
#define DP_ARENA_ALIGN ((size_t)256)
/* The smallest chunk requested from the owner; larger requests get a chunk
 * of their own, of their rounded size. */
#define DP_ARENA_DEFAULT_CHUNK ((size_t)32 << 20)

/* Get a chunk of exactly `bytes` (a multiple of DP_ARENA_ALIGN), aligned to
 * DP_ARENA_ALIGN, into *out; a failure is a dp_status with its message set
 * (DP_ERR_MEMORY when the device is full). */
typedef DP_MUST_CHECK dp_status (*dp_arena_alloc_chunk_fn)(void *ctx, size_t bytes, void **out);
/* Give back a chunk alloc_chunk returned; nothing to report. */
typedef void (*dp_arena_free_chunk_fn)(void *ctx, void *chunk);

typedef struct dp_arena_stats {
  size_t reserved_bytes;    /* in chunks held from the owner */
  size_t in_use_bytes;      /* in live blocks (rounded sizes) */
  size_t peak_in_use_bytes; /* the most in_use_bytes has been since create */
  size_t chunks;            /* chunks held */
  size_t blocks;            /* live blocks */
} dp_arena_stats;

typedef struct dp_arena dp_arena;

/* min_chunk_bytes: 0 for DP_ARENA_DEFAULT_CHUNK; rounded up to DP_ARENA_ALIGN. */
DP_MUST_CHECK dp_status dp_arena_create(size_t min_chunk_bytes, dp_arena_alloc_chunk_fn alloc_chunk,
                                        dp_arena_free_chunk_fn free_chunk, void *ctx, dp_arena **out);
/* Gives every chunk back (live blocks included) and frees the arena; NULL is fine. */
void dp_arena_destroy(dp_arena *a);
/* A block of at least `bytes` (0 counts as 1), DP_ARENA_ALIGN-aligned. Its
 * contents are whatever the chunk held. When a new chunk is needed and the
 * owner cannot give one, chunks with no live block are given back first and
 * the request tried once more. */
DP_MUST_CHECK dp_status dp_arena_alloc(dp_arena *a, size_t bytes, void **out);
/* dp_arena_alloc from the chunks already held: never asks the owner for a
 * chunk (nor gives one back). DP_ERR_RUNTIME when no free block fits, its
 * message naming `what` and the sizes; the arena is unchanged then. For the
 * inside of a training step, where a cudaMalloc could hang the collectives
 * (dp_device.in_step in backend.h). */
DP_MUST_CHECK dp_status dp_arena_alloc_reserved(dp_arena *a, size_t bytes, const char *what, void **out);
/* DP_ERR_VALUE for a pointer that is not a live block of this arena (a
 * double release included); the arena is unchanged then. */
DP_MUST_CHECK dp_status dp_arena_release(dp_arena *a, void *p);
/* Gives back the chunks with no live block; returns how many bytes went back. */
size_t dp_arena_trim(dp_arena *a);
void dp_arena_get_stats(dp_arena *a, dp_arena_stats *out);

#endif
