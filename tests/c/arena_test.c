/* arena_test.c — csrc/arena.c against a simple model of what it must do,
 * with malloc-backed chunks (tests/test_arena.py builds it with
 * -fsanitize=address,undefined and runs it).
 *
 * - random allocation / release sequences: every block aligned, no two live
 *   blocks overlap, every byte of a block writable (the sanitizer sees a chunk
 *   as exactly the malloc'd bytes) and still holding its owner's pattern when
 *   released, statistics equal to the model's, everything given back;
 * - reuse and coalescing: a chunk freed block by block in any order serves a
 *   request of its whole size without a new chunk;
 * - a failing chunk allocator is a dp_status, the arena stays usable, and
 *   empty chunks are given back before giving up;
 * - misuse (unknown pointer, double release, absurd sizes, unaligned chunks)
 *   is an error value, never a crash;
 * - four threads on one arena.
 * Exit status 0 only if every check passed. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "check.h"


/* ---- the owner: malloc-backed chunks with a budget and accounting ---------- */

typedef struct owned {
  char *user, *real; /* what the arena got, what aligned_alloc returned */
  size_t bytes;
} owned;

typedef struct owner {
  pthread_mutex_t mutex;
  owned *chunks; /* outstanding chunks */
  size_t nchunks, cap;
  size_t outstanding_bytes;
  size_t budget;  /* most bytes outstanding at once; SIZE_MAX: unlimited */
  size_t calls;   /* alloc_chunk calls */
  int misalign;   /* hand out chunks 16 bytes off the alignment */
} owner;

static dp_status owner_alloc(void *ctx, size_t bytes, void **out) {
  owner *o = ctx;
  dp_status st = DP_OK;
  pthread_mutex_lock(&o->mutex);
  o->calls++;
  if (bytes == 0 || bytes % DP_ARENA_ALIGN != 0) {
    fprintf(stderr, "alloc_chunk asked for %zu bytes, not a positive multiple of the alignment\n", bytes);
    failures++;
    st = DP_FAIL(DP_ERR_VALUE, "bad chunk size");
  } else if (bytes > o->budget || o->outstanding_bytes > o->budget - bytes) {
    st = DP_FAIL(DP_ERR_MEMORY, "test owner: %zu more bytes would exceed the budget", bytes);
  } else if (o->nchunks == o->cap) {
    size_t cap = o->cap ? 2 * o->cap : 16;
    owned *grown = realloc(o->chunks, cap * sizeof *grown);
    if (!grown) st = DP_FAIL(DP_ERR_MEMORY, "test owner: out of host memory");
    else {
      o->chunks = grown;
      o->cap = cap;
    }
  }
  char *real = NULL;
  if (st == DP_OK) {
    real = aligned_alloc(DP_ARENA_ALIGN, bytes + (o->misalign ? DP_ARENA_ALIGN : 0));
    if (!real) st = DP_FAIL(DP_ERR_MEMORY, "test owner: aligned_alloc(%zu) failed", bytes);
  }
  if (st == DP_OK) {
    owned c = {real + (o->misalign ? 16 : 0), real, bytes};
    o->chunks[o->nchunks++] = c;
    o->outstanding_bytes += bytes;
    *out = c.user;
  }
  pthread_mutex_unlock(&o->mutex);
  return st;
}

static void owner_free(void *ctx, void *chunk) {
  owner *o = ctx;
  pthread_mutex_lock(&o->mutex);
  size_t i = 0;
  while (i < o->nchunks && o->chunks[i].user != (char *)chunk) ++i;
  if (i == o->nchunks) {
    fprintf(stderr, "free_chunk(%p): not a chunk of this owner\n", chunk);
    failures++;
  } else {
    free(o->chunks[i].real);
    o->outstanding_bytes -= o->chunks[i].bytes;
    o->chunks[i] = o->chunks[--o->nchunks];
  }
  pthread_mutex_unlock(&o->mutex);
}

static void owner_init(owner *o, size_t budget) {
  memset(o, 0, sizeof *o);
  pthread_mutex_init(&o->mutex, NULL);
  o->budget = budget;
}

/* everything given back */
static void owner_done(owner *o) {
  CHECK(o->nchunks == 0 && o->outstanding_bytes == 0);
  free(o->chunks);
  pthread_mutex_destroy(&o->mutex);
}

/* ---- a deterministic generator ------------------------------------------- */

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint64_t next_u64(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static size_t round_up(size_t n) { return ((n ? n : 1) + DP_ARENA_ALIGN - 1) / DP_ARENA_ALIGN * DP_ARENA_ALIGN; }

/* ---- random sequences against the model ------------------------------------ */

enum { MAX_LIVE = 256 };

typedef struct live_block {
  unsigned char *p;
  size_t bytes, rounded;
  unsigned char pattern;
} live_block;

static int overlaps(const live_block *a, const unsigned char *p, size_t rounded) {
  return p < a->p + a->rounded && a->p < p + rounded;
}

static int pattern_intact(const live_block *b) {
  for (size_t i = 0; i < b->bytes; ++i)
    if (b->p[i] != b->pattern) return 0;
  return 1;
}

static void random_sequences(void) {
  owner o;
  owner_init(&o, SIZE_MAX);
  dp_arena *a = NULL;
  const size_t chunk = (size_t)1 << 16; /* small chunks: many of them, and large requests beside */
  CHECK(dp_arena_create(chunk, owner_alloc, owner_free, &o, &a) == DP_OK);
  if (!a) return;
  live_block live[MAX_LIVE];
  int nlive = 0;
  size_t in_use = 0, peak = 0;
  for (int step = 0; step < 10000; ++step) {
    const uint64_t r = next_u64(&rng);
    const int do_alloc = nlive == 0 || (nlive < MAX_LIVE && (r % 100) < 55);
    if (do_alloc) {
      size_t bytes;
      switch ((r >> 8) % 8) {
        case 0: bytes = 0; break;
        case 1: bytes = 1 + (r >> 16) % 255; break;
        case 2: bytes = 256 * (1 + (r >> 16) % 4); break;
        case 3: bytes = chunk + (r >> 16) % chunk; break; /* a chunk of its own */
        default: bytes = 1 + (r >> 16) % (chunk / 8); break;
      }
      void *p = NULL;
      dp_status st = dp_arena_alloc(a, bytes, &p);
      CHECK(st == DP_OK && p != NULL);
      if (st != DP_OK || !p) break;
      live_block b = {p, bytes, round_up(bytes), (unsigned char)(1 + step % 251)};
      CHECK(((uintptr_t)p % DP_ARENA_ALIGN) == 0);
      for (int i = 0; i < nlive; ++i) CHECK(!overlaps(&live[i], b.p, b.rounded));
      memset(b.p, b.pattern, b.rounded); /* the whole rounded block is the caller's */
      live[nlive++] = b;
      in_use += b.rounded;
      if (in_use > peak) peak = in_use;
    } else {
      const int i = (int)((r >> 8) % (uint64_t)nlive);
      CHECK(pattern_intact(&live[i]));
      CHECK(dp_arena_release(a, live[i].p) == DP_OK);
      in_use -= live[i].rounded;
      live[i] = live[--nlive];
    }
    dp_arena_stats s;
    dp_arena_get_stats(a, &s);
    CHECK(s.in_use_bytes == in_use);
    CHECK(s.peak_in_use_bytes == peak);
    CHECK(s.blocks == (size_t)nlive);
    CHECK(s.chunks == o.nchunks);
    CHECK(s.reserved_bytes == o.outstanding_bytes);
    CHECK(s.reserved_bytes >= s.in_use_bytes);
    if (failures) break;
    if (step % 2500 == 2499) { /* trimming never touches live blocks */
      dp_arena_trim(a);
      for (int i = 0; i < nlive; ++i) CHECK(pattern_intact(&live[i]));
    }
  }
  for (int i = 0; i < nlive; ++i) {
    CHECK(pattern_intact(&live[i]));
    CHECK(dp_arena_release(a, live[i].p) == DP_OK);
  }
  dp_arena_stats s;
  dp_arena_get_stats(a, &s);
  CHECK(s.in_use_bytes == 0 && s.blocks == 0);
  CHECK(s.peak_in_use_bytes == peak);
  const size_t reserved = s.reserved_bytes;
  CHECK(dp_arena_trim(a) == reserved); /* everything coalesced: every chunk is empty */
  dp_arena_get_stats(a, &s);
  CHECK(s.reserved_bytes == 0 && s.chunks == 0);
  dp_arena_destroy(a);
  owner_done(&o);
}

static void reuse_and_coalescing(void) {
  owner o;
  owner_init(&o, SIZE_MAX);
  dp_arena *a = NULL;
  const size_t chunk = 64 * DP_ARENA_ALIGN;
  CHECK(dp_arena_create(chunk, owner_alloc, owner_free, &o, &a) == DP_OK);
  if (!a) return;
  /* four quarters of one chunk, in address order (each split leaves the tail free) */
  void *p[4];
  for (int i = 0; i < 4; ++i) CHECK(dp_arena_alloc(a, 16 * DP_ARENA_ALIGN, &p[i]) == DP_OK);
  dp_arena_stats s;
  dp_arena_get_stats(a, &s);
  CHECK(s.chunks == 1 && s.reserved_bytes == chunk && s.in_use_bytes == chunk && o.calls == 1);
  for (int i = 1; i < 4; ++i) CHECK((char *)p[i] == (char *)p[0] + i * 16 * DP_ARENA_ALIGN);
  /* release in the order 2, 0, 3, 1: every merge case (next, prev, both) */
  const int order[4] = {2, 0, 3, 1};
  for (int i = 0; i < 4; ++i) CHECK(dp_arena_release(a, p[order[i]]) == DP_OK);
  void *whole = NULL;
  CHECK(dp_arena_alloc(a, chunk, &whole) == DP_OK); /* only possible if all four merged */
  dp_arena_get_stats(a, &s);
  CHECK(s.chunks == 1 && o.calls == 1);
  CHECK(dp_arena_release(a, whole) == DP_OK);
  /* best fit: of a 2-block and a 6-block hole, a 2-block request takes the first */
  void *q[8];
  for (int i = 0; i < 8; ++i) CHECK(dp_arena_alloc(a, 8 * DP_ARENA_ALIGN, &q[i]) == DP_OK);
  dp_arena_get_stats(a, &s);
  CHECK(s.chunks == 1);
  CHECK(dp_arena_release(a, q[1]) == DP_OK); /* a hole of 8 blocks */
  CHECK(dp_arena_release(a, q[3]) == DP_OK);
  CHECK(dp_arena_release(a, q[4]) == DP_OK); /* a hole of 16 blocks */
  void *small = NULL;
  CHECK(dp_arena_alloc(a, 8 * DP_ARENA_ALIGN, &small) == DP_OK);
  CHECK(small == q[1]);
  void *big = NULL;
  CHECK(dp_arena_alloc(a, 16 * DP_ARENA_ALIGN, &big) == DP_OK);
  CHECK(big == q[3]);
  dp_arena_get_stats(a, &s);
  CHECK(s.chunks == 1 && s.in_use_bytes == chunk);
  /* a request larger than the chunk size gets a chunk of exactly its rounded size */
  void *huge = NULL;
  CHECK(dp_arena_alloc(a, 3 * chunk + 1, &huge) == DP_OK);
  dp_arena_get_stats(a, &s);
  CHECK(s.chunks == 2 && s.reserved_bytes == chunk + 3 * chunk + DP_ARENA_ALIGN);
  /* destroy with live blocks: every chunk goes back (the sanitizer checks the leak) */
  dp_arena_destroy(a);
  owner_done(&o);
}

static void failing_owner(void) {
  owner o;
  const size_t chunk = 64 * DP_ARENA_ALIGN;
  owner_init(&o, 2 * chunk + DP_ARENA_ALIGN); /* room for two chunks and a block */
  dp_arena *a = NULL;
  CHECK(dp_arena_create(chunk, owner_alloc, owner_free, &o, &a) == DP_OK);
  if (!a) return;
  void *x = NULL, *y = NULL, *z = NULL;
  CHECK(dp_arena_alloc(a, chunk, &x) == DP_OK);
  CHECK(dp_arena_alloc(a, chunk, &y) == DP_OK);
  dp_error_clear();
  size_t calls = o.calls;
  CHECK(dp_arena_alloc(a, 1, &z) == DP_ERR_MEMORY && z == NULL);
  CHECK(strstr(dp_error_message(), "budget") != NULL); /* the owner's message comes through */
  CHECK(o.calls == calls + 1);                          /* no empty chunk to give back: no retry */
  dp_arena_stats s;
  dp_arena_get_stats(a, &s);
  CHECK(s.chunks == 2 && s.blocks == 2 && s.in_use_bytes == 2 * chunk);
  /* still usable: release one, allocate again from its chunk */
  CHECK(dp_arena_release(a, x) == DP_OK);
  CHECK(dp_arena_alloc(a, 100, &z) == DP_OK && z == x);
  CHECK(dp_arena_release(a, z) == DP_OK);
  /* a request no held chunk can serve and the budget cannot add: the empty
   * chunk goes back, and the second try fits */
  calls = o.calls;
  void *w = NULL;
  CHECK(dp_arena_alloc(a, chunk + 1, &w) == DP_OK);
  CHECK(o.calls == calls + 2);
  dp_arena_get_stats(a, &s);
  CHECK(s.chunks == 2 && s.blocks == 2 && s.reserved_bytes == 2 * chunk + DP_ARENA_ALIGN);
  CHECK(s.reserved_bytes == o.outstanding_bytes);
  /* nothing left to give back: the failure stands */
  calls = o.calls;
  CHECK(dp_arena_alloc(a, 1, &z) == DP_ERR_MEMORY && o.calls == calls + 1);
  CHECK(dp_arena_release(a, w) == DP_OK);
  CHECK(dp_arena_release(a, y) == DP_OK);
  dp_arena_destroy(a);
  owner_done(&o);
}

/* Inside a training step the arena serves from the chunks it holds and never
 * asks the owner (a cudaMalloc there could hang the collectives): a request
 * that fits a free block is served, one that does not is a DP_ERR_RUNTIME
 * naming what asked, with no owner call and nothing changed. */
static void reserved_only(void) {
  owner o;
  const size_t chunk = 64 * DP_ARENA_ALIGN;
  owner_init(&o, SIZE_MAX);
  dp_arena *a = NULL;
  CHECK(dp_arena_create(chunk, owner_alloc, owner_free, &o, &a) == DP_OK);
  if (!a) return;
  void *p = NULL, *q = NULL, *r = NULL;
  /* nothing reserved yet: even one byte is refused */
  CHECK(dp_arena_alloc_reserved(a, 1, "the first block", &p) == DP_ERR_RUNTIME && p == NULL && o.calls == 0);
  CHECK(strstr(dp_error_message(), "the first block") != NULL);
  CHECK(dp_arena_alloc(a, 16 * DP_ARENA_ALIGN, &p) == DP_OK && o.calls == 1); /* the warm-up reserves */
  CHECK(dp_arena_release(a, p) == DP_OK);
  /* the step: the whole chunk is there to be used, in pieces */
  CHECK(dp_arena_alloc_reserved(a, 48 * DP_ARENA_ALIGN, "activations", &q) == DP_OK && q != NULL);
  CHECK(dp_arena_alloc_reserved(a, 16 * DP_ARENA_ALIGN, "workspace", &r) == DP_OK && r != NULL);
  dp_arena_stats before, after;
  dp_arena_get_stats(a, &before);
  void *s = (void *)1;
  dp_error_clear();
  CHECK(dp_arena_alloc_reserved(a, 1, "the cuDNN workspace", &s) == DP_ERR_RUNTIME && s == NULL);
  CHECK(strstr(dp_error_message(), "the cuDNN workspace") != NULL);
  CHECK(strstr(dp_error_message(), "inside a training step") != NULL);
  dp_arena_get_stats(a, &after);
  CHECK(o.calls == 1 && after.chunks == 1 && after.blocks == before.blocks && after.in_use_bytes == chunk);
  /* an empty chunk is not given back either (that would be a cudaFree) */
  CHECK(dp_arena_release(a, q) == DP_OK && dp_arena_release(a, r) == DP_OK);
  CHECK(dp_arena_alloc_reserved(a, 2 * chunk, "too large", &s) == DP_ERR_RUNTIME);
  dp_arena_get_stats(a, &after);
  CHECK(after.chunks == 1 && after.reserved_bytes == chunk && o.calls == 1);
  /* outside the step it grows as before */
  CHECK(dp_arena_alloc(a, 2 * chunk, &s) == DP_OK && o.calls == 2);
  CHECK(dp_arena_release(a, s) == DP_OK);
  dp_arena_destroy(a);
  owner_done(&o);
}

static void misuse(void) {
  owner o;
  owner_init(&o, SIZE_MAX);
  dp_arena *a = NULL;
  CHECK(dp_arena_create(0, NULL, owner_free, &o, &a) == DP_ERR_VALUE && a == NULL);
  CHECK(dp_arena_create(0, owner_alloc, owner_free, &o, &a) == DP_OK);
  if (!a) return;
  void *p = NULL;
  CHECK(dp_arena_alloc(a, SIZE_MAX, &p) == DP_ERR_MEMORY && p == NULL);
  CHECK(dp_arena_alloc(a, SIZE_MAX - 100, &p) == DP_ERR_MEMORY && p == NULL);
  CHECK(o.calls == 0); /* refused before asking the owner */
  CHECK(dp_arena_alloc(a, 10, &p) == DP_OK);
  dp_arena_stats s;
  dp_arena_get_stats(a, &s);
  CHECK(s.reserved_bytes == DP_ARENA_DEFAULT_CHUNK && s.in_use_bytes == DP_ARENA_ALIGN);
  int on_stack = 0;
  CHECK(dp_arena_release(a, &on_stack) == DP_ERR_VALUE);
  CHECK(dp_arena_release(a, (char *)p + DP_ARENA_ALIGN) == DP_ERR_VALUE); /* inside the chunk, not a block */
  CHECK(dp_arena_release(a, NULL) == DP_OK);
  CHECK(dp_arena_release(a, p) == DP_OK);
  CHECK(dp_arena_release(a, p) == DP_ERR_VALUE); /* twice */
  dp_arena_get_stats(a, &s);
  CHECK(s.in_use_bytes == 0 && s.blocks == 0);
  dp_arena_destroy(a);
  dp_arena_destroy(NULL);
  owner_done(&o);

  /* an owner that returns unaligned chunks: refused, and the chunk given back */
  owner_init(&o, SIZE_MAX);
  o.misalign = 1;
  CHECK(dp_arena_create(DP_ARENA_ALIGN, owner_alloc, owner_free, &o, &a) == DP_OK);
  if (!a) return;
  p = NULL;
  CHECK(dp_arena_alloc(a, 1, &p) == DP_ERR_RUNTIME && p == NULL);
  dp_arena_get_stats(a, &s);
  CHECK(s.chunks == 0 && s.reserved_bytes == 0);
  dp_arena_destroy(a);
  owner_done(&o);
}

/* ---- four threads ------------------------------------------------------------ */

typedef struct worker {
  dp_arena *a;
  uint64_t seed;
  int id, failed;
} worker;

static void *work(void *arg) {
  worker *w = arg;
  unsigned char *mine[32] = {0};
  size_t sizes[32] = {0};
  for (int step = 0; step < 4000; ++step) {
    const uint64_t r = next_u64(&w->seed);
    const int i = (int)(r % 32);
    if (mine[i]) {
      for (size_t k = 0; k < sizes[i]; ++k)
        if (mine[i][k] != (unsigned char)w->id) w->failed = 1;
      if (dp_arena_release(w->a, mine[i]) != DP_OK) w->failed = 1;
      mine[i] = NULL;
    } else {
      sizes[i] = 1 + (r >> 8) % 20000;
      void *p = NULL;
      if (dp_arena_alloc(w->a, sizes[i], &p) != DP_OK) {
        w->failed = 1;
        break;
      }
      mine[i] = p;
      memset(mine[i], w->id, sizes[i]);
    }
  }
  for (int i = 0; i < 32; ++i)
    if (mine[i] && dp_arena_release(w->a, mine[i]) != DP_OK) w->failed = 1;
  return NULL;
}

static void threads(void) {
  owner o;
  owner_init(&o, SIZE_MAX);
  dp_arena *a = NULL;
  CHECK(dp_arena_create((size_t)1 << 18, owner_alloc, owner_free, &o, &a) == DP_OK);
  if (!a) return;
  pthread_t t[4];
  worker w[4];
  for (int i = 0; i < 4; ++i) {
    w[i] = (worker){a, 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1), i + 1, 0};
    CHECK(pthread_create(&t[i], NULL, work, &w[i]) == 0);
  }
  for (int i = 0; i < 4; ++i) {
    pthread_join(t[i], NULL);
    CHECK(!w[i].failed);
  }
  dp_arena_stats s;
  dp_arena_get_stats(a, &s);
  CHECK(s.in_use_bytes == 0 && s.blocks == 0);
  dp_arena_destroy(a);
  owner_done(&o);
}

int main(void) {
  random_sequences();
  reuse_and_coalescing();
  failing_owner();
  reserved_only();
  misuse();
  threads();
  if (failures) {
    fprintf(stderr, "arena_test: %d checks failed\n", failures);
    return 1;
  }
  printf("arena_test: ok\n");
  return 0;
}
