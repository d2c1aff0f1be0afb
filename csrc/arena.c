/* arena.c — best-fit sub-allocation over large chunks (see arena.h).
 *
 * Every block, free or live, is a host-side node in its chunk's address-ordered
 * list, so that a released block finds its neighbours in O(1) and merges with
 * the free ones. Free blocks are also on one unordered free list (best fit
 * scans it: a device holds tens of buffers, not millions); live blocks are in
 * a hash table keyed by address, so release finds its block without a scan.
 * A failed call leaves every live block as it was (a chunk it obtained stays,
 * free, for the next call).
 */
#include "arena.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct arena_chunk arena_chunk;

typedef struct arena_block {
  char *base;
  size_t size;                                   /* a multiple of DP_ARENA_ALIGN */
  int live;
  arena_chunk *chunk;
  struct arena_block *prev, *next;               /* address order within the chunk */
  struct arena_block *free_prev, *free_next;     /* the free list (free blocks) */
  struct arena_block *hash_next;                 /* a table bucket (live blocks) */
} arena_block;

struct arena_chunk {
  char *base;
  size_t size;
  size_t live_blocks;
  arena_block *first;
  arena_chunk *prev, *next;
};

struct dp_arena {
  pthread_mutex_t mutex;
  size_t min_chunk;
  dp_arena_alloc_chunk_fn alloc_chunk;
  dp_arena_free_chunk_fn free_chunk;
  void *ctx;
  arena_chunk *chunks;
  arena_block *free_list;
  arena_block **table; /* table_size buckets, a power of two */
  size_t table_size;
  dp_arena_stats stats;
};

static size_t bucket_of(const dp_arena *a, const void *p) {
  /* blocks are 256-aligned: drop the zero bits, then Fibonacci hashing */
  uint64_t h = (uint64_t)((uintptr_t)p >> 8) * UINT64_C(0x9E3779B97F4A7C15);
  return (size_t)(h >> 32) & (a->table_size - 1);
}

static void free_list_push(dp_arena *a, arena_block *b) {
  b->free_prev = NULL;
  b->free_next = a->free_list;
  if (a->free_list) a->free_list->free_prev = b;
  a->free_list = b;
}

static void free_list_remove(dp_arena *a, arena_block *b) {
  if (b->free_prev) b->free_prev->free_next = b->free_next;
  else a->free_list = b->free_next;
  if (b->free_next) b->free_next->free_prev = b->free_prev;
  b->free_prev = b->free_next = NULL;
}

/* Doubles the table when it holds as many live blocks as buckets. */
static dp_status table_reserve(dp_arena *a, size_t live) {
  if (live < a->table_size) return DP_OK;
  size_t size = a->table_size * 2;
  arena_block **table = calloc(size, sizeof *table);
  if (!table) return DP_FAIL(DP_ERR_MEMORY, "arena: cannot grow the block table to %zu buckets", size);
  arena_block **old = a->table;
  size_t old_size = a->table_size;
  a->table = table;
  a->table_size = size;
  for (size_t i = 0; i < old_size; ++i) {
    for (arena_block *b = old[i], *next; b; b = next) {
      next = b->hash_next;
      size_t k = bucket_of(a, b->base);
      b->hash_next = a->table[k];
      a->table[k] = b;
    }
  }
  free(old);
  return DP_OK;
}

static arena_block *table_take(dp_arena *a, const void *p) {
  for (arena_block **link = &a->table[bucket_of(a, p)]; *link; link = &(*link)->hash_next) {
    arena_block *b = *link;
    if (b->base == p) {
      *link = b->hash_next;
      b->hash_next = NULL;
      return b;
    }
  }
  return NULL;
}

dp_status dp_arena_create(size_t min_chunk_bytes, dp_arena_alloc_chunk_fn alloc_chunk,
                          dp_arena_free_chunk_fn free_chunk, void *ctx, dp_arena **out) {
  *out = NULL;
  if (!alloc_chunk || !free_chunk) return DP_FAIL(DP_ERR_VALUE, "arena: both chunk callbacks are required");
  if (min_chunk_bytes == 0) min_chunk_bytes = DP_ARENA_DEFAULT_CHUNK;
  if (min_chunk_bytes > SIZE_MAX - DP_ARENA_ALIGN)
    return DP_FAIL(DP_ERR_VALUE, "arena: chunk size %zu is too large", min_chunk_bytes);
  dp_arena *a = calloc(1, sizeof *a);
  if (!a) return DP_FAIL(DP_ERR_MEMORY, "arena: cannot allocate the arena");
  a->table_size = 64;
  a->table = calloc(a->table_size, sizeof *a->table);
  if (!a->table) {
    free(a);
    return DP_FAIL(DP_ERR_MEMORY, "arena: cannot allocate the block table");
  }
  if (pthread_mutex_init(&a->mutex, NULL) != 0) {
    free(a->table);
    free(a);
    return DP_FAIL(DP_ERR_RUNTIME, "arena: pthread_mutex_init failed");
  }
  a->min_chunk = (min_chunk_bytes + DP_ARENA_ALIGN - 1) & ~(DP_ARENA_ALIGN - 1);
  a->alloc_chunk = alloc_chunk;
  a->free_chunk = free_chunk;
  a->ctx = ctx;
  *out = a;
  return DP_OK;
}

/* Unlinks a chunk, frees its block nodes (taking free ones off the free list)
 * and gives its memory back. Live blocks die with it (destroy only). */
static void chunk_release(dp_arena *a, arena_chunk *c) {
  for (arena_block *b = c->first, *next; b; b = next) {
    next = b->next;
    if (!b->live) free_list_remove(a, b);
    free(b);
  }
  if (c->prev) c->prev->next = c->next;
  else a->chunks = c->next;
  if (c->next) c->next->prev = c->prev;
  a->stats.reserved_bytes -= c->size;
  a->stats.chunks -= 1;
  a->free_chunk(a->ctx, c->base);
  free(c);
}

static size_t trim_locked(dp_arena *a) {
  size_t bytes = 0;
  for (arena_chunk *c = a->chunks, *next; c; c = next) {
    next = c->next;
    if (c->live_blocks == 0) {
      bytes += c->size;
      chunk_release(a, c);
    }
  }
  return bytes;
}

void dp_arena_destroy(dp_arena *a) {
  if (!a) return;
  while (a->chunks) chunk_release(a, a->chunks);
  free(a->table);
  pthread_mutex_destroy(&a->mutex);
  free(a);
}

/* A new chunk of `bytes`, as one free block on the free list. */
static dp_status chunk_add(dp_arena *a, size_t bytes) {
  arena_chunk *c = calloc(1, sizeof *c);
  arena_block *b = calloc(1, sizeof *b);
  if (!c || !b) {
    free(c);
    free(b);
    return DP_FAIL(DP_ERR_MEMORY, "arena: cannot allocate the bookkeeping of a new chunk");
  }
  void *base = NULL;
  dp_status st = a->alloc_chunk(a->ctx, bytes, &base);
  if (st == DP_OK && (!base || ((uintptr_t)base & (DP_ARENA_ALIGN - 1)) != 0)) {
    if (base) a->free_chunk(a->ctx, base);
    st = DP_FAIL(DP_ERR_RUNTIME, "arena: the chunk allocator returned %p, not aligned to %zu bytes", base,
                 DP_ARENA_ALIGN);
  }
  if (st != DP_OK) {
    free(c);
    free(b);
    return st;
  }
  c->base = base;
  c->size = bytes;
  c->first = b;
  c->next = a->chunks;
  if (a->chunks) a->chunks->prev = c;
  a->chunks = c;
  b->base = base;
  b->size = bytes;
  b->chunk = c;
  free_list_push(a, b);
  a->stats.reserved_bytes += bytes;
  a->stats.chunks += 1;
  return DP_OK;
}

static arena_block *best_fit(const dp_arena *a, size_t need) {
  arena_block *best = NULL;
  for (arena_block *b = a->free_list; b; b = b->free_next) {
    if (b->size >= need && (!best || b->size < best->size)) {
      best = b;
      if (b->size == need) break;
    }
  }
  return best;
}

/* grow: may ask the owner for a chunk (and give empty ones back first) */
static dp_status alloc_locked(dp_arena *a, size_t bytes, int grow, const char *what, void **out) {
  if (bytes == 0) bytes = 1;
  if (bytes > SIZE_MAX - DP_ARENA_ALIGN)
    return DP_FAIL(DP_ERR_MEMORY, "arena: cannot allocate %zu bytes (too large)", bytes);
  const size_t need = (bytes + DP_ARENA_ALIGN - 1) & ~(DP_ARENA_ALIGN - 1);
  DP_TRY(table_reserve(a, a->stats.blocks + 1));
  /* the node for a split's free tail, before anything changes */
  arena_block *tail = calloc(1, sizeof *tail);
  if (!tail) return DP_FAIL(DP_ERR_MEMORY, "arena: cannot allocate a block node");
  arena_block *b = best_fit(a, need);
  if (!b && !grow) {
    free(tail);
    return DP_FAIL(DP_ERR_RUNTIME,
                   "arena: %s needs %zu bytes and no free block of the %zu reserved bytes fits; a new chunk is not "
                   "allowed here (inside a training step)",
                   what, need, a->stats.reserved_bytes);
  }
  if (!b) {
    const size_t chunk = need > a->min_chunk ? need : a->min_chunk;
    dp_status st = chunk_add(a, chunk);
    /* memory held in empty chunks may be what the owner lacks: give it back, try once more */
    if (st == DP_ERR_MEMORY && trim_locked(a) > 0) st = chunk_add(a, chunk);
    if (st != DP_OK) {
      free(tail);
      return st;
    }
    b = best_fit(a, need);
  }
  if (b->size > need) { /* split: the tail stays free */
    tail->base = b->base + need;
    tail->size = b->size - need;
    tail->chunk = b->chunk;
    tail->prev = b;
    tail->next = b->next;
    if (b->next) b->next->prev = tail;
    b->next = tail;
    b->size = need;
    free_list_push(a, tail);
  } else {
    free(tail);
  }
  free_list_remove(a, b);
  b->live = 1;
  b->chunk->live_blocks += 1;
  const size_t k = bucket_of(a, b->base);
  b->hash_next = a->table[k];
  a->table[k] = b;
  a->stats.blocks += 1;
  a->stats.in_use_bytes += b->size;
  if (a->stats.in_use_bytes > a->stats.peak_in_use_bytes) a->stats.peak_in_use_bytes = a->stats.in_use_bytes;
  *out = b->base;
  return DP_OK;
}

dp_status dp_arena_alloc(dp_arena *a, size_t bytes, void **out) {
  *out = NULL;
  pthread_mutex_lock(&a->mutex);
  dp_status st = alloc_locked(a, bytes, 1, NULL, out);
  pthread_mutex_unlock(&a->mutex);
  return st;
}

dp_status dp_arena_alloc_reserved(dp_arena *a, size_t bytes, const char *what, void **out) {
  *out = NULL;
  pthread_mutex_lock(&a->mutex);
  dp_status st = alloc_locked(a, bytes, 0, what ? what : "a block", out);
  pthread_mutex_unlock(&a->mutex);
  return st;
}

/* b (now free) absorbs its free successor. */
static void absorb_next(dp_arena *a, arena_block *b) {
  arena_block *n = b->next;
  free_list_remove(a, n);
  b->size += n->size;
  b->next = n->next;
  if (n->next) n->next->prev = b;
  free(n);
}

dp_status dp_arena_release(dp_arena *a, void *p) {
  if (!p) return DP_OK;
  pthread_mutex_lock(&a->mutex);
  arena_block *b = table_take(a, p);
  if (!b) {
    pthread_mutex_unlock(&a->mutex);
    return DP_FAIL(DP_ERR_VALUE, "arena: %p is not a live block of this arena (released twice?)", p);
  }
  b->live = 0;
  b->chunk->live_blocks -= 1;
  a->stats.blocks -= 1;
  a->stats.in_use_bytes -= b->size;
  free_list_push(a, b);
  if (b->next && !b->next->live) absorb_next(a, b);
  if (b->prev && !b->prev->live) absorb_next(a, b->prev);
  pthread_mutex_unlock(&a->mutex);
  return DP_OK;
}

size_t dp_arena_trim(dp_arena *a) {
  pthread_mutex_lock(&a->mutex);
  size_t bytes = trim_locked(a);
  pthread_mutex_unlock(&a->mutex);
  return bytes;
}

void dp_arena_get_stats(dp_arena *a, dp_arena_stats *out) {
  pthread_mutex_lock(&a->mutex);
  *out = a->stats;
  pthread_mutex_unlock(&a->mutex);
}
