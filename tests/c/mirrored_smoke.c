/* mirrored_smoke.c — the multi-threaded core under the sanitizers: replica
 * threads (replica.c), the breakable barrier and host all-reduce
 * (collective.c), the comm interface and its gradient buckets (comm.c), the
 * mirrored runner with per-replica and synchronized BatchNorm (mirrored.c)
 * and resident datasets (resident.c), dp.all_reduce's kept groups and the
 * collective interface's registered buffers. Three CPU replicas train a residual
 * block with BatchNorm; a step that fails in one replica leaves the others
 * unchanged and the group usable; every thread is joined and every byte
 * freed (LeakSanitizer), with no data race the sanitizers can see and no UB.
 * Run by tests/test_sanitizers.py.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "comm.h"
#include "mirrored.h"
#include "model.h"
#include "resident.h"
#include "check.h"

enum { K = 3, N = 20, SIDE = 12 };

/* A residual block, with BatchNorm (layers 1 and 4) or without (ReLUs there). */
static dp_status build(dp_device *dev, int bn, dp_model **out) {
  dp_model *m = NULL;
  DP_TRY(dp_model_create(dev, 1, SIDE, SIDE, &m));
  *out = m;
  DP_TRY(dp_model_add_conv2d(m, 4, 3, 1, 1));
  DP_TRY(bn ? dp_model_add_batchnorm(m, 1e-5f, 0.1f) : dp_model_add_relu(m));
  DP_TRY(dp_model_add_relu(m)); /* layer 2 */
  DP_TRY(dp_model_add_conv2d(m, 4, 3, 1, 1));
  DP_TRY(bn ? dp_model_add_batchnorm(m, 1e-5f, 0.1f) : dp_model_add_relu(m)); /* layer 4 */
  DP_TRY(dp_model_add_add(m, 4, 2));
  DP_TRY(dp_model_add_global_avgpool(m));
  DP_TRY(dp_model_add_flatten(m));
  DP_TRY(dp_model_add_dense(m, 10));
  return dp_model_finalize(m);
}

static int same_params(dp_model **models) {
  const int64_t n = models[0]->nparams;
  float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
  int same = dp_model_get_params(models[0], a) == DP_OK;
  for (int r = 1; r < K && same; ++r) same = dp_model_get_params(models[r], b) == DP_OK && !memcmp(a, b, sizeof(float) * (size_t)n);
  free(a);
  free(b);
  return same;
}

static void run(dp_device *devs, int bn, int sync_batchnorm, int64_t bucket_bytes) {
  dp_model *models[K] = {0};
  for (int r = 0; r < K; ++r) CHECK(build(&devs[r], bn, &models[r]) == DP_OK);
  float *params = malloc(sizeof(float) * (size_t)models[0]->nparams);
  for (int64_t i = 0; i < models[0]->nparams; ++i) params[i] = 0.2f * (uniform() - 0.5f);
  CHECK(dp_model_set_params(models[0], params) == DP_OK);
  dp_mirrored *m = NULL;
  CHECK(dp_mirrored_create(models, K, sync_batchnorm, DP_COMM_AUTO, bucket_bytes, &m) == DP_OK);
  if (!m) goto done;
  CHECK(dp_comm_get_kind(m->comm) == DP_COMM_HOST);
  CHECK(bucket_bytes > 0 ? m->nbuckets > 1 : m->nbuckets == 1);
  CHECK(dp_mirrored_broadcast(m, 0) == DP_OK && same_params(models));

  float *x = malloc(sizeof(float) * N * SIDE * SIDE);
  int64_t y[N];
  for (int i = 0; i < N * SIDE * SIDE; ++i) x[i] = uniform();
  for (int i = 0; i < N; ++i) y[i] = i % 10;
  double loss = 0;
  int64_t correct = 0;
  for (int step = 0; step < 3; ++step) {
    dp_batch b = {x, 0, y, N - step, NULL, NULL};
    CHECK(dp_mirrored_train_step(m, &b, 0.1f, 0.9f, 1e-4f, &loss, &correct) == DP_OK && isfinite(loss));
  }
  CHECK(same_params(models));

  CHECK(dp_comm_collectives_issued(m->comm) > 0); /* counted, on every kind */

  /* a label in the last replica's shard: found on the calling thread before
   * any replica starts, the error names it, and nothing changed anywhere */
  float *before = malloc(sizeof(float) * (size_t)models[0]->nparams);
  CHECK(dp_model_get_params(models[0], before) == DP_OK);
  y[N - 1] = 10;
  dp_batch bad = {x, 0, y, N, NULL, NULL};
  CHECK(dp_mirrored_train_step(m, &bad, 0.1f, 0.0f, 0.0f, &loss, &correct) == DP_ERR_VALUE);
  CHECK(strstr(dp_error_message(), "label 10 at index 19") != NULL);
  CHECK(!dp_comm_is_poisoned(m->comm));
  y[N - 1] = 9;
  float *after = malloc(sizeof(float) * (size_t)models[0]->nparams);
  CHECK(dp_model_get_params(models[0], after) == DP_OK &&
        !memcmp(before, after, sizeof(float) * (size_t)models[0]->nparams));
  CHECK(same_params(models));

  /* a shape the warm-up has not sized (the test marks it warm): inside the
   * step the activations would grow, which is a reported error before any
   * collective (so an NCCL comm would not be aborted), not an allocation;
   * the next step of that shape warms up and trains */
  enum { BIG = N + 5 };
  float *xb = malloc(sizeof(float) * BIG * SIDE * SIDE);
  int64_t yb[BIG];
  for (int i = 0; i < BIG * SIDE * SIDE; ++i) xb[i] = uniform();
  for (int i = 0; i < BIG; ++i) yb[i] = (i * 3) % 10;
  dp_batch big = {xb, 0, yb, BIG, NULL, NULL};
  int deterministic, allow_tf32;
  dp_cuda_get_defaults(&deterministic, &allow_tf32);
  CHECK(m->nwarm < DP_MIRRORED_WARM_KEYS);
  m->warm[m->nwarm++] = (dp_warm_key){BIG, 0, deterministic | allow_tf32 << 1};
  CHECK(dp_mirrored_train_step(m, &big, 0.1f, 0.0f, 0.0f, &loss, &correct) == DP_ERR_RUNTIME);
  CHECK(strstr(dp_error_message(), "activations would grow") != NULL);
  CHECK(strstr(dp_error_message(), "inside a training step") != NULL);
  CHECK(dp_comm_collectives_issued(m->comm) == 0 && !dp_comm_is_poisoned(m->comm));
  CHECK(dp_model_get_params(models[0], after) == DP_OK &&
        !memcmp(before, after, sizeof(float) * (size_t)models[0]->nparams));
  CHECK(same_params(models));
  CHECK(dp_mirrored_train_step(m, &big, 0.1f, 0.0f, 0.0f, &loss, &correct) == DP_OK && isfinite(loss));
  CHECK(dp_comm_collectives_issued(m->comm) > 0 && same_params(models));
  free(xb);

  /* the group works again, from resident data too; a row outside a
   * replica's dataset is refused first, like a label */
  dp_resident *res[K] = {0};
  for (int r = 0; r < K; ++r) CHECK(dp_resident_create(&devs[r], x, 0, y, N, SIDE * SIDE, 10, &res[r]) == DP_OK);
  const int64_t bad_rows[7] = {3, 19, 0, 7, 7, 12, N};
  CHECK(dp_mirrored_train_step(m, &(dp_batch){NULL, 0, NULL, 7, bad_rows, res}, 0.1f, 0.0f, 0.0f, &loss,
                               &correct) == DP_ERR_VALUE);
  CHECK(strstr(dp_error_message(), "sample index 20 at position 6") != NULL);
  const int64_t rows[7] = {3, 19, 0, 7, 7, 12, 5};
  dp_batch rb = {NULL, 0, NULL, 7, rows, res};
  CHECK(dp_mirrored_train_step(m, &rb, 0.1f, 0.0f, 0.0f, &loss, &correct) == DP_OK && isfinite(loss));
  CHECK(same_params(models));
  CHECK(dp_mirrored_evaluate(m, &(dp_batch){x, 0, y, N, NULL, NULL}, &loss, &correct) == DP_OK);
  for (int r = 0; r < K; ++r) dp_resident_destroy(res[r]);
  free(before);
  free(after);
  free(x);
  dp_mirrored_destroy(m);
done:
  free(params);
  for (int r = 0; r < K; ++r) dp_model_destroy(models[r]);
}

/* dp_allreduce_buffers (dp.all_reduce): the rank-ordered sum every time, on
 * one group per device set made once; more sets than are kept replace the
 * least recently used idle group. */
static void kept_groups(void) {
  enum { LEN = 37, SETS = 11 };
  float *bufs[K];
  for (int r = 0; r < K; ++r) bufs[r] = malloc(sizeof(float) * LEN);
  const char *names[K] = {"cpu:0", "cpu:1", "cpu:2"};
  const long before = dp_group_created_count();
  for (int call = 0; call < 50; ++call) {
    for (int r = 0; r < K; ++r)
      for (int i = 0; i < LEN; ++i) bufs[r][i] = 0.1f * (float)(r + 1) + (float)i;
    CHECK(dp_allreduce_buffers(names, bufs, K, LEN, call % 2 ? DP_REDUCE_MEAN : DP_REDUCE_SUM) == DP_OK);
    for (int i = 0; i < LEN; ++i) {
      const float sum = ((0.1f + (float)i) + (0.2f + (float)i)) + (0.3f + (float)i);
      const float want = call % 2 ? sum * (1.0f / (float)K) : sum;
      for (int r = 0; r < K; ++r) CHECK(bufs[r][i] == want);
    }
  }
  CHECK(dp_group_created_count() - before == 1);
  /* SETS device sets, each reduced twice: the kept ones are reused, the rest made again */
  char set_names[SETS][K][16];
  for (int round = 0; round < 2; ++round)
    for (int set = 0; set < SETS; ++set) {
      const char *ptrs[K];
      for (int r = 0; r < K; ++r) {
        snprintf(set_names[set][r], sizeof set_names[set][r], "cpu:%d", set * K + r);
        ptrs[r] = set_names[set][r];
        for (int i = 0; i < LEN; ++i) bufs[r][i] = (float)(r + set);
      }
      CHECK(dp_allreduce_buffers(ptrs, bufs, K, LEN, DP_REDUCE_SUM) == DP_OK);
      for (int r = 0; r < K; ++r) CHECK(bufs[r][LEN - 1] == (float)(3 * set + 3));
    }
  CHECK(dp_group_created_count() - before > SETS && dp_group_created_count() - before <= 2 * SETS + 1);
  for (int r = 0; r < K; ++r) free(bufs[r]);
  dp_allreduce_groups_clear();
}

/* The collective interface all-reduces registered buffers only; every kind's
 * table is full, and MPI's slot is empty. */
static void registered_buffers(dp_device *devs) {
  dp_device *ptrs[K] = {&devs[0], &devs[1], &devs[2]};
  dp_barrier bar;
  CHECK(dp_barrier_init(&bar, K) == DP_OK);
  dp_comm *c = NULL;
  CHECK(dp_comm_create(ptrs, K, DP_COMM_HOST, &bar, &c) == DP_OK);
  float a[K][8], elsewhere[8];
  float *bufs[K] = {a[0], a[1], a[2]};
  CHECK(dp_comm_register(c, bufs, 8) == DP_OK);
  const dp_collective coll = dp_comm_collective(c, 1);
  CHECK(dp_collective_all_reduce(&coll, elsewhere, 8, DP_REDUCE_SUM) == DP_ERR_VALUE);
  CHECK(strstr(dp_error_message(), "no buffer registered") != NULL);
  CHECK(dp_collective_all_reduce(&coll, a[1] + 4, 5, DP_REDUCE_SUM) == DP_ERR_VALUE); /* runs past its end */
  dp_grad_bucket whole = {0, 9, 0};
  CHECK(dp_comm_set_buckets(c, bufs, &whole, 1) == DP_ERR_VALUE);
  dp_comm_destroy(c);
  dp_barrier_destroy(&bar);
  const char *names[8];
  CHECK(dp_comm_ops_null_entries(DP_COMM_HOST, names, 8) == 0);
  CHECK(dp_comm_ops_null_entries(DP_COMM_MPI, names, 8) == -1);
}

int main(void) {
  dp_device devs[K];
  for (int r = 0; r < K; ++r)
    if (dp_cpu_device_init(&devs[r], r, 1) != DP_OK) return 2;
  run(devs, 0, 0, 64); /* no BatchNorm, a bucket per layer with parameters: the failing step aborts peers */
  run(devs, 1, 0, 0);  /* per-replica BatchNorm, one bucket: running statistics all-reduced */
  run(devs, 1, 1, 64); /* synchronized BatchNorm: collectives in the forward pass too */
  /* the GPU kinds on CPU devices are refused, with the reason */
  dp_device *ptrs[K] = {&devs[0], &devs[1], &devs[2]};
  dp_barrier bar;
  CHECK(dp_barrier_init(&bar, K) == DP_OK);
  dp_comm *c = NULL;
  CHECK(dp_comm_create(ptrs, K, DP_COMM_NCCL, &bar, &c) == DP_ERR_VALUE && c == NULL);
  CHECK(strstr(dp_error_message(), "nccl") != NULL);
  CHECK(dp_comm_create(ptrs, K, DP_COMM_KERNEL, &bar, &c) == DP_ERR_VALUE && c == NULL);
  dp_barrier_destroy(&bar);
  kept_groups();
  registered_buffers(devs);
  for (int r = 0; r < K; ++r) dp_device_destroy(&devs[r]);
  if (failures) fprintf(stderr, "%d checks failed\n", failures);
  printf("mirrored_smoke: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
