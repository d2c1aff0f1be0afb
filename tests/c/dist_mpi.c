/* dist_mpi.c — the processes of a job (dist.c), the mpi comm kind (comm.c)
 * and mirrored training across processes (mirrored.c) under the sanitizers,
 * run by tests/test_sanitizers.py as `mpirun -np 3 --oversubscribe`, each
 * process with LOCAL CPU replicas:
 *   1. dp_dist_init agrees with MPI about rank and size (one host: the
 *      local rank is the rank);
 *   2. allgather and broadcast move the right bytes (eager and rendezvous
 *      sizes), the barrier passes;
 *   3. the chain all-reduce is, bit for bit, the left fold over the job's
 *      replicas in global order, scaled, for one element, a part of a
 *      segment and several segments: values of mixed magnitude, so that any
 *      other order of the additions would show;
 *   4. replicas across processes train to the bits (parameters, running
 *      statistics, losses) of one process with all the job's replicas, from
 *      rank 0's parameters broadcast; the digests agree;
 *   5. a rank that arrives late at a barrier is a DP_ERR_DIST naming it on the
 *      others within a few seconds, and the job still ends cleanly.
 * Every process prints "dist_mpi: ok" when all its checks passed.
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "comm.h"
#include "dist.h"
#include "mirrored.h"
#include "model.h"
#include "check.h"

enum { LOCAL = 2, N = 20, SIDE = 12, STEPS = 3 };
static const double TIMEOUT = 60.0; /* generous: three processes share two cores under the sanitizers */

static dp_dist_info info;

static double now_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* splitmix64: the same numbers on every process for the same arguments */
static uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Global replica g's element i of the chain test: random sign and mantissa,
 * exponent in [-12, 12], so that sums round differently in other orders. */
static float chain_value(int g, int64_t i, uint64_t salt) {
  const uint64_t h = mix(salt * 0x100000001b3ull ^ mix(((uint64_t)g << 40) ^ (uint64_t)i));
  const float mantissa = 1.0f + (float)(h & 0x7fffff) / (float)(1u << 23);
  const int exponent = (int)((h >> 23) % 25) - 12;
  const float v = ldexpf(mantissa, exponent);
  return (h >> 63) ? -v : v;
}

/* A float in [-0.5, 0.5) from (a, b). */
static float small_value(uint64_t a, uint64_t b) {
  return (float)(mix(mix(a) ^ b) >> 40) / (float)(1u << 24) - 0.5f;
}

/* ---- 1 and 2: joining, allgather, broadcast, barrier ---------------------------- */

static void joining(void) {
  int rank = -1, size = -1;
  CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank) == MPI_SUCCESS);
  CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size) == MPI_SUCCESS);
  CHECK(dp_dist_built() == 1);
  CHECK(info.rank == rank && info.size == size);
  CHECK(info.size >= 2);
  CHECK(info.local_rank == info.rank && info.local_size == info.size); /* one host */
  CHECK(info.mpi_initialized && info.initialized_here && info.launched);
  CHECK(info.thread_level >= MPI_THREAD_SERIALIZED);
  int threads = -1;
  CHECK(MPI_Query_thread(&threads) == MPI_SUCCESS && threads == info.thread_level);
  /* idempotent, and what it found is kept */
  dp_dist_info again;
  CHECK(dp_dist_init(&again) == DP_OK && memcmp(&again, &info, sizeof info) == 0);
  const dp_dist_info seen = dp_dist_get_info();
  CHECK(memcmp(&seen, &info, sizeof info) == 0);
  CHECK(!dp_dist_is_broken());
}

static unsigned char pattern(int rank, int64_t i, int salt) {
  return (unsigned char)((rank * 131 + i * 7 + salt * 29 + (i >> 8)) & 0xff);
}

static void exchanges(void) {
  const int P = info.size;
  /* 37 bytes (eager) and 300,000 bytes (rendezvous) from each process */
  const int64_t sizes[2] = {37, 300000};
  for (int t = 0; t < 2; ++t) {
    const int64_t bytes = sizes[t];
    unsigned char *mine = malloc((size_t)bytes), *all = malloc((size_t)(bytes * P));
    for (int64_t i = 0; i < bytes; ++i) mine[i] = pattern(info.rank, i, t);
    memset(all, 0xee, (size_t)(bytes * P));
    CHECK(dp_dist_allgather(mine, bytes, all, TIMEOUT, "the test's allgather") == DP_OK);
    int wrong = 0;
    for (int q = 0; q < P; ++q)
      for (int64_t i = 0; i < bytes; ++i) wrong += all[q * bytes + i] != pattern(q, i, t);
    CHECK(wrong == 0);
    free(mine);
    free(all);
  }
  /* a broadcast from the last rank and one from rank 0 */
  const int roots[2] = {P - 1, 0};
  const int64_t bcast_sizes[2] = {70001, 5};
  for (int t = 0; t < 2; ++t) {
    const int64_t bytes = bcast_sizes[t];
    unsigned char *buf = malloc((size_t)bytes);
    for (int64_t i = 0; i < bytes; ++i) buf[i] = info.rank == roots[t] ? pattern(roots[t], i, 10 + t) : 0;
    CHECK(dp_dist_bcast(buf, bytes, roots[t], TIMEOUT, "the test's broadcast") == DP_OK);
    int wrong = 0;
    for (int64_t i = 0; i < bytes; ++i) wrong += buf[i] != pattern(roots[t], i, 10 + t);
    CHECK(wrong == 0);
    free(buf);
  }
  /* a root outside the job is refused on every process, before anything is sent */
  char c = 0;
  CHECK(dp_dist_bcast(&c, 1, P, TIMEOUT, "a broadcast from nowhere") == DP_ERR_VALUE);
  CHECK(strstr(dp_error_message(), "root") != NULL);
  CHECK(!dp_dist_is_broken());
  CHECK(dp_dist_barrier(TIMEOUT, "the test's barrier") == DP_OK);
}

/* ---- 3: the chain all-reduce ----------------------------------------------------- */

static void chain(void) {
  const int G = info.size * LOCAL, first = info.rank * LOCAL;
  const int64_t sizes[3] = {1, 17, 3 * (int64_t)DP_DIST_SEGMENT + 5};
  const float scales[2] = {1.0f, 1.0f / 6.0f};
  float *stage = malloc(sizeof(float) * 2 * DP_DIST_SEGMENT);
  int tag = 0;
  for (int a = 0; a < 3; ++a)
    for (int b = 0; b < 2; ++b) {
      const int64_t n = sizes[a];
      const float scale = scales[b];
      const uint64_t salt = (uint64_t)(a * 2 + b + 1);
      float *bufs[LOCAL];
      for (int r = 0; r < LOCAL; ++r) {
        bufs[r] = malloc(sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < n; ++i) bufs[r][i] = chain_value(first + r, i, salt);
      }
      /* the reference: ((g0 + g1) + g2) + ... then scaled, in float; and
       * the fold the other way round, which must differ somewhere (else the
       * values could not tell the orders apart) */
      float *want = malloc(sizeof(float) * (size_t)n);
      int64_t order_matters = 0;
      for (int64_t i = 0; i < n; ++i) {
        float acc = chain_value(0, i, salt), rev = chain_value(G - 1, i, salt);
        for (int g = 1; g < G; ++g) {
          acc = acc + chain_value(g, i, salt);
          rev = rev + chain_value(G - 1 - g, i, salt);
        }
        want[i] = acc * scale;
        order_matters += memcmp(&want[i], &(float){rev * scale}, sizeof(float)) != 0;
      }
      if (n >= 17) CHECK(order_matters > 0);
      char what[96];
      snprintf(what, sizeof what, "the test's chain all-reduce of %lld floats", (long long)n);
      CHECK(dp_dist_chain_allreduce(bufs, LOCAL, n, scale, tag++, stage, TIMEOUT, what) == DP_OK);
      for (int r = 0; r < LOCAL; ++r) {
        const int same = memcmp(bufs[r], want, sizeof(float) * (size_t)n) == 0;
        if (!same) fprintf(stderr, "rank %d: chain n=%lld scale=%g: replica %d differs\n", info.rank, (long long)n,
                           (double)scale, first + r);
        CHECK(same);
      }
      for (int r = 0; r < LOCAL; ++r) free(bufs[r]);
      free(want);
    }
  /* tags outside the range are refused before anything is sent */
  float one = 1.0f, *p = &one;
  CHECK(dp_dist_chain_allreduce(&p, 1, 1, 1.0f, DP_DIST_MAX_TAG, stage, TIMEOUT, "a bad tag") == DP_ERR_VALUE);
  CHECK(!dp_dist_is_broken());
  free(stage);
}

/* ---- 4: mirrored training across processes ----------------------------------------- */

/* mirrored_smoke.c's residual block, with BatchNorm. */
static dp_status build(dp_device *dev, dp_model **out) {
  dp_model *m = NULL;
  DP_TRY(dp_model_create(dev, 1, SIDE, SIDE, &m));
  *out = m;
  DP_TRY(dp_model_add_conv2d(m, 4, 3, 1, 1));
  DP_TRY(dp_model_add_batchnorm(m, 1e-5f, 0.1f));
  DP_TRY(dp_model_add_relu(m)); /* layer 2 */
  DP_TRY(dp_model_add_conv2d(m, 4, 3, 1, 1));
  DP_TRY(dp_model_add_batchnorm(m, 1e-5f, 0.1f)); /* layer 4 */
  DP_TRY(dp_model_add_add(m, 4, 2));
  DP_TRY(dp_model_add_global_avgpool(m));
  DP_TRY(dp_model_add_flatten(m));
  DP_TRY(dp_model_add_dense(m, 10));
  return dp_model_finalize(m);
}

typedef struct trained {
  float *params, *state;
  double loss[STEPS];
  int64_t correct[STEPS];
} trained;

/* The job's global batches (the same on every process): step s has N - s samples. */
static void batches(float *x, int64_t *y) {
  for (int i = 0; i < N * SIDE * SIDE; ++i) x[i] = small_value(7, (uint64_t)i) + 0.5f;
  for (int i = 0; i < N; ++i) y[i] = (i * 7 + 3) % 10;
}

static void train(dp_mirrored *m, trained *out) {
  float *x = malloc(sizeof(float) * N * SIDE * SIDE);
  int64_t y[N];
  batches(x, y);
  for (int s = 0; s < STEPS; ++s) {
    dp_batch b = {x, 0, y, N - s, NULL, NULL};
    CHECK(dp_mirrored_train_step(m, &b, 0.1f, 0.9f, 1e-4f, &out->loss[s], &out->correct[s]) == DP_OK);
    CHECK(isfinite(out->loss[s]));
  }
  free(x);
}

/* Replica r's parameters and running statistics (malloc'ed). */
static void read_replica(dp_model *model, trained *out) {
  out->params = malloc(sizeof(float) * (size_t)model->nparams);
  out->state = malloc(sizeof(float) * (size_t)(model->nstate + 1));
  CHECK(dp_model_get_params(model, out->params) == DP_OK);
  CHECK(model->nstate == 0 || dp_model_get_state(model, out->state) == DP_OK);
}

static void mirrored(int sync_batchnorm, int64_t bucket_bytes) {
  const int G = info.size * LOCAL;
  dp_device devs[LOCAL];
  dp_model *models[LOCAL] = {0};
  for (int r = 0; r < LOCAL; ++r) CHECK(dp_cpu_device_init(&devs[r], r, 1) == DP_OK);
  for (int r = 0; r < LOCAL; ++r) CHECK(build(&devs[r], &models[r]) == DP_OK);
  const int64_t np = models[0]->nparams, ns = models[0]->nstate;
  CHECK(np > 0 && ns > 0);
  /* the job's initial parameters: rank 0's; the other ranks start from other
   * values, which the broadcast replaces */
  float *init = malloc(sizeof(float) * (size_t)np), *mine = malloc(sizeof(float) * (size_t)np);
  for (int64_t i = 0; i < np; ++i) {
    init[i] = 0.4f * small_value(11, (uint64_t)i);
    mine[i] = info.rank == 0 ? init[i] : 0.4f * small_value(12 + (uint64_t)info.rank, (uint64_t)i);
  }
  for (int r = 0; r < LOCAL; ++r) CHECK(dp_model_set_params(models[r], r == 0 ? mine : init) == DP_OK);
  trained across[LOCAL];
  memset(across, 0, sizeof across);
  uint64_t digest = 0;
  dp_mirrored *m = NULL;
  CHECK(dp_mirrored_create_across(models, LOCAL, sync_batchnorm, DP_COMM_AUTO, bucket_bytes, TIMEOUT, &m) == DP_OK);
  if (m) {
    CHECK(dp_comm_get_kind(m->comm) == DP_COMM_MPI);
    CHECK(m->nproc == info.size && m->proc == info.rank && m->first == info.rank * LOCAL && m->total == G);
    CHECK(dp_comm_total(m->comm) == G && dp_comm_first(m->comm) == info.rank * LOCAL);
    CHECK(bucket_bytes > 0 ? m->nbuckets > 1 : m->nbuckets == 1);
    CHECK(dp_mirrored_broadcast_across(m) == DP_OK);
    for (int r = 0; r < LOCAL; ++r) {
      CHECK(dp_model_get_params(models[r], mine) == DP_OK);
      CHECK(memcmp(mine, init, sizeof(float) * (size_t)np) == 0);
    }
    train(m, &across[0]);
    for (int r = 0; r < LOCAL; ++r) read_replica(models[r], &across[r]);
    CHECK(dp_mirrored_digest(m, &digest) == DP_OK);
    uint64_t *digests = calloc((size_t)info.size, sizeof *digests);
    CHECK(dp_dist_allgather(&digest, sizeof digest, digests, TIMEOUT, "the test's digests") == DP_OK);
    for (int q = 0; q < info.size; ++q) CHECK(digests[q] == digest);
    free(digests);
    dp_mirrored_destroy(m);
  }
  for (int r = 0; r < LOCAL; ++r) {
    dp_model_destroy(models[r]);
    dp_device_destroy(&devs[r]);
  }

  /* the reference: one process, all G replicas, the same start and batches */
  dp_device *rdevs = calloc((size_t)G, sizeof *rdevs);
  dp_model **rmodels = calloc((size_t)G, sizeof *rmodels);
  for (int r = 0; r < G; ++r) CHECK(dp_cpu_device_init(&rdevs[r], r, 1) == DP_OK);
  for (int r = 0; r < G; ++r) CHECK(build(&rdevs[r], &rmodels[r]) == DP_OK);
  for (int r = 0; r < G; ++r) CHECK(dp_model_set_params(rmodels[r], init) == DP_OK);
  trained ref;
  memset(&ref, 0, sizeof ref);
  dp_mirrored *one = NULL;
  CHECK(dp_mirrored_create(rmodels, G, sync_batchnorm, DP_COMM_AUTO, bucket_bytes, &one) == DP_OK);
  if (one) {
    CHECK(dp_comm_get_kind(one->comm) == DP_COMM_HOST);
    CHECK(dp_mirrored_broadcast(one, 0) == DP_OK);
    train(one, &ref);
    read_replica(rmodels[0], &ref);
    uint64_t ref_digest = 0;
    CHECK(dp_mirrored_digest(one, &ref_digest) == DP_OK);
    CHECK(ref_digest == digest);
    dp_mirrored_destroy(one);
  }
  for (int r = 0; r < G; ++r) {
    dp_model_destroy(rmodels[r]);
    dp_device_destroy(&rdevs[r]);
  }
  free(rmodels);
  free(rdevs);

  for (int r = 0; r < LOCAL; ++r) {
    const int params = across[r].params && ref.params &&
                       memcmp(across[r].params, ref.params, sizeof(float) * (size_t)np) == 0;
    const int state = across[r].state && ref.state &&
                      memcmp(across[r].state, ref.state, sizeof(float) * (size_t)ns) == 0;
    if (!params || !state)
      fprintf(stderr, "rank %d (sync_batchnorm=%d, bucket_bytes=%lld): replica %d's %s differ from one process's\n",
              info.rank, sync_batchnorm, (long long)bucket_bytes, info.rank * LOCAL + r,
              params ? "running statistics" : "parameters");
    CHECK(params);
    CHECK(state);
  }
  /* the metrics, summed in global replica order, are one process's too */
  for (int s = 0; s < STEPS; ++s) {
    CHECK(memcmp(&across[0].loss[s], &ref.loss[s], sizeof(double)) == 0);
    CHECK(across[0].correct[s] == ref.correct[s]);
  }
  for (int r = 0; r < LOCAL; ++r) {
    free(across[r].params);
    free(across[r].state);
  }
  free(ref.params);
  free(ref.state);
  free(init);
  free(mine);
}

/* ---- 5: a rank that is late ---------------------------------------------------- */

static void late_rank(void) {
  const double limit = 1.0;
  CHECK(dp_dist_barrier(TIMEOUT, "the barrier before the late one") == DP_OK);
  if (info.rank == 1) {
    /* late for sure, however slow the machine: rank 1 joins only once every
     * other rank has given up and said so (plain MPI, on MPI_COMM_WORLD: not
     * dpcore's communicators), and not before twice the others' limit */
    const double start = now_seconds();
    for (int q = 0; q < info.size; ++q) {
      if (q == 1) continue;
      int gave_up = 0;
      CHECK(MPI_Recv(&gave_up, 1, MPI_INT, q, 99, MPI_COMM_WORLD, MPI_STATUS_IGNORE) == MPI_SUCCESS && gave_up == 1);
    }
    const double left = 2.0 * limit - (now_seconds() - start);
    if (left > 0) {
      struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
      nanosleep(&ts, NULL);
    }
    /* the others' messages of that barrier are here: it passes, and what
     * rank 1 sends meets the receives they left posted (or cancelled) */
    CHECK(dp_dist_barrier(TIMEOUT, "the late barrier") == DP_OK);
    CHECK(!dp_dist_is_broken());
    return;
  }
  const double start = now_seconds();
  const dp_status st = dp_dist_barrier(limit, "the late barrier");
  const double waited = now_seconds() - start;
  CHECK(st == DP_ERR_DIST);
  const char *msg = dp_error_message();
  if (!strstr(msg, "waiting for rank 1")) fprintf(stderr, "rank %d: %s\n", info.rank, msg);
  CHECK(strstr(msg, "waiting for rank 1") != NULL);
  CHECK(strstr(msg, "the late barrier") != NULL);
  CHECK(waited >= limit && waited < limit + 5.0);
  CHECK(dp_dist_is_broken());
  /* from now on every operation fails at once, and dpcore will not finalise
   * MPI (that could wait forever) */
  char c = 0;
  CHECK(dp_dist_bcast(&c, 1, 0, TIMEOUT, "a broadcast after the failure") == DP_ERR_DIST);
  CHECK(strstr(dp_error_message(), "out of step") != NULL);
  CHECK(dp_dist_finalize() == DP_OK);
  int down = 1;
  MPI_Finalized(&down);
  CHECK(!down);
  const int gave_up = 1;
  CHECK(MPI_Send(&gave_up, 1, MPI_INT, 1, 99, MPI_COMM_WORLD) == MPI_SUCCESS);
}

int main(void) {
  if (dp_dist_init(&info) != DP_OK) {
    fprintf(stderr, "dp_dist_init: %s\n", dp_error_message());
    return 2;
  }
  joining();
  exchanges();
  chain();
  mirrored(0, 64); /* per-replica BatchNorm, a bucket per layer with parameters */
  mirrored(1, 0);  /* synchronized BatchNorm (collectives in the forward pass), one bucket */
  late_rank();
  /* dpcore refuses to finalise a job that is out of step (ranks 0 and 2
   * are); every rank ends MPI itself, after rank 1's late barrier has met the
   * others' messages */
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Finalize();
  if (failures) fprintf(stderr, "rank %d: %d checks failed\n", info.rank, failures);
  printf("dist_mpi: %s\n", failures ? "FAILED" : "ok");
  fflush(stdout);
  return failures < 255 ? failures : 255;
}
