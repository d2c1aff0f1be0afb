#include "mirrored.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "device.h"
#include "dist.h"
#include "trace.h"

void dp_shard_range(int64_t n, int k, int r, int64_t *begin, int64_t *end) {
  const int64_t base = n / k, extra = n % k;
  *begin = r * base + (r < extra ? r : extra);
  *end = *begin + base + (r < extra ? 1 : 0);
}

int dp_plan_buckets(const dp_model *m, int64_t bucket_floats, dp_grad_bucket *out, int max) {
  int lowest = -1; /* the first layer with parameters: the last bucket closes there */
  for (int i = 0; i < m->nlayers && lowest < 0; ++i)
    if (m->layers[i].w_len > 0) lowest = i;
  if (lowest < 0 || max < 1) return 0;
  for (;;) {
    int nb = 0;
    int64_t end = m->nparams;
    for (int i = m->nlayers - 1; i >= lowest && nb <= max; --i) {
      const dp_layer *l = &m->layers[i];
      if (l->w_len == 0) continue;
      /* the flat layout is in layer order, so [w_off, end) holds layers i.. only */
      const int64_t begin = i == lowest ? 0 : l->w_off;
      if (i == lowest || (bucket_floats > 0 && end - begin >= bucket_floats)) {
        if (nb < max) out[nb] = (dp_grad_bucket){begin, end, i};
        ++nb;
        end = begin;
      }
    }
    if (nb <= max) return nb;
    bucket_floats *= 2; /* too many buckets: fewer, larger ones */
  }
}

static void buffers_of(const dp_mirrored *m, size_t member, float **bufs) {
  for (int r = 0; r < m->k; ++r) bufs[r] = *(float **)((char *)m->models[r] + member);
}

/* What the replicas all-reduce through their collective interface: the
 * gradients (in buckets), BatchNorm's channel sums and running statistics.
 * The buffers are made by dp_model_finalize and never move. */
static dp_status register_buffers(dp_mirrored *m) {
  const dp_model *m0 = m->models[0];
  float *bufs[DP_COMM_MAX_REPLICAS];
  buffers_of(m, offsetof(dp_model, grads), bufs);
  /* the gradients and the loss flag after them (model.h): the first bucket,
   * the last layers' and the first reduced, carries the flag too */
  DP_TRY(dp_comm_register(m->comm, bufs, m0->nparams + 1));
  dp_grad_bucket with_flag[DP_COMM_MAX_BUCKETS];
  memcpy(with_flag, m->buckets, sizeof *with_flag * (size_t)m->nbuckets);
  if (m->nbuckets > 0) with_flag[0].end = m0->nparams + 1;
  DP_TRY(dp_comm_set_buckets(m->comm, bufs, with_flag, m->nbuckets));
  buffers_of(m, offsetof(dp_model, bn_tmp), bufs);
  DP_TRY(dp_comm_register(m->comm, bufs, m0->nbn_tmp));
  buffers_of(m, offsetof(dp_model, state), bufs);
  return dp_comm_register(m->comm, bufs, m0->nstate);
}

/* What every process of a job must agree on before its replicas can train
 * together (dp_mirrored_create_across), gathered from every process. */
typedef struct model_signature {
  int64_t nparams, nstate, bucket_bytes;
  uint64_t layers; /* FNV-1a of the layer table */
  int32_t k, nlayers, in_c, in_h, in_w, sync_batchnorm, nbuckets, device_kind, comm;
  int32_t pad;
  double timeout;
} model_signature;

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
static const uint64_t fnv_offset = 14695981039346656037ull;

/* The first field in which process q's signature differs from process 0's,
 * as a DP_ERR_DIST on every process (they all hold the same signatures). */
static dp_status compare_signatures(const model_signature *all, int nproc) {
  const model_signature *a = &all[0];
  for (int q = 1; q < nproc; ++q) {
    const model_signature *b = &all[q];
#define DIFF(field, what)                                                                                        \
  if (a->field != b->field)                                                                                      \
    return DP_FAIL(DP_ERR_DIST, "the processes disagree about the model: rank %d has %s %lld, rank 0 has %lld", q, \
                   what, (long long)b->field, (long long)a->field);
    DIFF(nparams, "a parameter count of")
    DIFF(nlayers, "a layer count of")
    DIFF(in_c, "input channels")
    DIFF(in_h, "input height")
    DIFF(in_w, "input width")
    DIFF(nstate, "a running-statistics count of")
    DIFF(sync_batchnorm, "sync_batchnorm =")
    DIFF(bucket_bytes, "a gradient bucket size (bytes) of")
    DIFF(nbuckets, "a gradient bucket count of")
    DIFF(device_kind, "device kind (0 cpu, 1 cuda)")
    DIFF(comm, "all_reduce kind number")
#undef DIFF
    if (a->layers != b->layers)
      return DP_FAIL(DP_ERR_DIST, "the processes disagree about the model: rank %d's layers differ from rank 0's "
                     "(same counts, other kinds or sizes)", q);
    if (a->timeout != b->timeout)
      return DP_FAIL(DP_ERR_DIST, "the processes disagree about the strategy: rank %d has timeout=%g s, rank 0 %g s",
                     q, b->timeout, a->timeout);
  }
  return DP_OK;
}

/* Models across processes, numbered in the order this process makes them
 * (the same on every process of a job), and one step at a time across
 * processes within a process: two threads stepping two such models at once
 * could take turns in another order on another process; the number in each
 * step's header makes that a clear error instead of crossed messages. */
static _Atomic int64_t models_across;
static pthread_mutex_t across_turn = PTHREAD_MUTEX_INITIALIZER;

/* This process's place among the job's replicas, after every process has
 * agreed about the model (collective). */
static dp_status join_processes(dp_mirrored *m, dp_comm_kind comm, int64_t bucket_bytes) {
  m->id = atomic_fetch_add(&models_across, 1);
  dp_dist_info info;
  DP_TRY(dp_dist_init(&info));
  const dp_model *m0 = m->models[0];
  model_signature mine;
  memset(&mine, 0, sizeof mine);
  mine.nparams = m0->nparams;
  mine.nstate = m0->nstate;
  mine.bucket_bytes = bucket_bytes;
  mine.layers = fnv1a(fnv_offset, m0->layers, sizeof *m0->layers * (size_t)m0->nlayers);
  mine.k = m->k;
  mine.nlayers = m0->nlayers;
  mine.in_c = (int32_t)m0->in_c;
  mine.in_h = (int32_t)m0->in_h;
  mine.in_w = (int32_t)m0->in_w;
  mine.sync_batchnorm = m->sync_batchnorm;
  mine.nbuckets = m->nbuckets;
  mine.device_kind = m0->dev->kind == DP_DEVICE_CPU ? 0 : 1;
  mine.comm = comm;
  mine.timeout = m->timeout;
  model_signature *all = calloc((size_t)info.size, sizeof *all);
  m->proc_k = calloc((size_t)info.size, sizeof *m->proc_k);
  m->gathered = calloc((size_t)info.size, sizeof *m->gathered);
  if (!all || !m->proc_k || !m->gathered) {
    free(all);
    return DP_FAIL(DP_ERR_MEMORY, "mirrored: cannot allocate the signatures of %d processes", info.size);
  }
  dp_status st = dp_dist_allgather(&mine, (int64_t)sizeof mine, all, m->timeout,
                                   "the comparison of the models (making MultiWorkerMirroredStrategy's model)");
  if (st == DP_OK) st = compare_signatures(all, info.size);
  if (st == DP_OK) {
    m->nproc = info.size;
    m->proc = info.rank;
    m->first = m->total = 0;
    for (int q = 0; q < info.size; ++q) {
      m->proc_k[q] = all[q].k;
      if (q < info.rank) m->first += all[q].k;
      m->total += all[q].k;
    }
  }
  free(all);
  return st;
}

static dp_status create_impl(dp_model **models, int k, int sync_batchnorm, dp_comm_kind comm, int64_t bucket_bytes,
                             int across, double timeout, dp_mirrored **out) {
  *out = NULL;
  if (k < 1 || k > DP_COMM_MAX_REPLICAS)
    return DP_FAIL(DP_ERR_VALUE, "mirrored: need 1 to %d replicas, got %d", DP_COMM_MAX_REPLICAS, k);
  if (bucket_bytes < 0) return DP_FAIL(DP_ERR_VALUE, "mirrored: bucket size must be >= 0, got %lld", (long long)bucket_bytes);
  dp_device *devs[DP_COMM_MAX_REPLICAS];
  for (int r = 0; r < k; ++r) {
    const dp_model *a = models[0], *b = models[r];
    if (!b->finalized) return DP_FAIL(DP_ERR_VALUE, "mirrored: replica %d is not finalized", r);
    if (b->nparams != a->nparams || b->nlayers != a->nlayers || b->in_c != a->in_c || b->in_h != a->in_h ||
        b->in_w != a->in_w || memcmp(b->layers, a->layers, sizeof *a->layers * (size_t)a->nlayers) != 0)
      return DP_FAIL(DP_ERR_VALUE, "mirrored: replica %d has a different architecture than replica 0", r);
    for (int q = 0; q < r; ++q)
      if (models[q]->dev == b->dev || strcmp(models[q]->dev->name, b->dev->name) == 0)
        return DP_FAIL(DP_ERR_VALUE, "mirrored: replicas %d and %d are both on %s", q, r, b->dev->name);
    devs[r] = b->dev;
  }
  int pin_threads;
  DP_TRY(dp_pin_threads_enabled(&pin_threads));
  dp_mirrored *m = calloc(1, sizeof *m);
  int *threads = malloc(sizeof(int) * (size_t)k);
  if (!m || !threads || !(m->models = malloc(sizeof *m->models * (size_t)k))) {
    free(threads);
    if (m) free(m->models);
    free(m);
    return DP_FAIL(DP_ERR_MEMORY, "mirrored: cannot allocate %d replicas", k);
  }
  m->k = k;
  m->nproc = 1;
  m->total = k;
  m->timeout = timeout;
  m->sync_batchnorm = sync_batchnorm;
  /* CPU replicas on logical devices pinned to their devices' cores with
   * DPCORE_PIN_THREADS=1, when each runs the device's own share of threads */
  int *pin = malloc(sizeof(int) * (size_t)k);
  for (int r = 0; r < k; ++r) {
    m->models[r] = models[r];
    threads[r] = models[r]->dev->nthreads;
    if (pin) pin[r] = k > 1 && pin_threads && models[r]->dev->kind == DP_DEVICE_CPU &&
                              models[r]->dev->nthreads == dp_cpu_device_share(models[r]->dev->index)
                          ? models[r]->dev->index
                          : -1;
  }
  m->nbuckets = dp_plan_buckets(models[0], bucket_bytes / (int64_t)sizeof(float), m->buckets, DP_COMM_MAX_BUCKETS);
  dp_status st = dp_group_create(k, threads, pin, &m->group);
  free(pin);
  free(threads);
  if (st == DP_OK && across) st = join_processes(m, comm, bucket_bytes);
  /* the communicators are made now, so that a failure shows here and not in
   * the middle of training */
  if (st == DP_OK)
    st = dp_comm_create_across(devs, k, comm, dp_group_barrier(m->group), m->first, m->total, timeout, &m->comm);
  if (st == DP_OK) st = register_buffers(m);
  if (st != DP_OK) {
    dp_mirrored_destroy(m);
    return st;
  }
  *out = m;
  return DP_OK;
}

dp_status dp_mirrored_create(dp_model **models, int k, int sync_batchnorm, dp_comm_kind comm, int64_t bucket_bytes,
                             dp_mirrored **out) {
  return create_impl(models, k, sync_batchnorm, comm, bucket_bytes, 0, 0.0, out);
}

dp_status dp_mirrored_create_across(dp_model **models, int k, int sync_batchnorm, dp_comm_kind comm,
                                    int64_t bucket_bytes, double timeout, dp_mirrored **out) {
  *out = NULL;
  if (!(timeout > 0.0) || !isfinite(timeout))
    return DP_FAIL(DP_ERR_VALUE, "timeout must be a finite number of seconds > 0, got %g", timeout);
  return create_impl(models, k, sync_batchnorm, comm, bucket_bytes, 1, timeout, out);
}

void dp_mirrored_destroy(dp_mirrored *m) {
  if (!m) return;
  dp_comm_destroy(m->comm);
  dp_group_destroy(m->group);
  free(m->proc_k);
  free(m->gathered);
  free(m->models);
  free(m);
}

dp_status dp_mirrored_broadcast(dp_mirrored *m, int root) {
  if (root < 0 || root >= m->k) return DP_FAIL(DP_ERR_VALUE, "broadcast: root %d is not a replica", root);
  dp_model *src = m->models[root];
  for (int r = 0; r < m->k; ++r) {
    dp_model *dst = m->models[r];
    if (r != root) {
      /* CPU devices share the host address space; a CUDA pair is a peer copy,
       * ordered on dst's stream only, so src's queued work finishes first */
      DP_TRY(src->dev->backend->synchronize(src->dev));
      DP_TRY(dst->dev->backend->copy_to_device(dst->dev, dst->params, src->params,
                                               sizeof(float) * (size_t)src->nparams));
    }
    DP_TRY(dp_model_reset_velocity(dst));
  }
  for (int r = 0; r < m->k; ++r) DP_TRY(m->models[r]->dev->backend->synchronize(m->models[r]->dev));
  return DP_OK;
}

/* FNV-1a 64 over 8-byte words (the digest's speed matters for 45 MB of
 * ResNet-18 parameters; its strength does not: it compares bits that should
 * be equal). */
static uint64_t digest_words(uint64_t h, const float *p, int64_t n) {
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    uint64_t w;
    memcpy(&w, p + i, sizeof w);
    h = (h ^ w) * 1099511628211ull;
  }
  if (i < n) {
    uint32_t w;
    memcpy(&w, p + i, sizeof w);
    h = (h ^ w) * 1099511628211ull;
  }
  return h;
}

/* Replica 0's parameters, then running statistics, in host memory. */
static dp_status replica0_to_host(dp_mirrored *m, float **out) {
  const dp_model *m0 = m->models[0];
  float *host = malloc(sizeof(float) * (size_t)(m0->nparams + m0->nstate + 1));
  if (!host) return DP_FAIL(DP_ERR_MEMORY, "cannot copy %lld parameters to the host", (long long)m0->nparams);
  dp_status st = dp_model_get_params(m->models[0], host);
  if (st == DP_OK && m0->nstate > 0) st = dp_model_get_state(m->models[0], host + m0->nparams);
  if (st != DP_OK) {
    free(host);
    return st;
  }
  *out = host;
  return DP_OK;
}

dp_status dp_mirrored_digest(dp_mirrored *m, uint64_t *out) {
  float *host;
  DP_TRY(replica0_to_host(m, &host));
  *out = digest_words(fnv_offset, host, m->models[0]->nparams + m->models[0]->nstate);
  free(host);
  return DP_OK;
}

dp_status dp_mirrored_broadcast_across(dp_mirrored *m) {
  if (m->nproc == 1) return dp_mirrored_broadcast(m, 0);
  const dp_model *m0 = m->models[0];
  float *host;
  DP_TRY(replica0_to_host(m, &host));
  dp_status st = dp_dist_bcast(host, (int64_t)sizeof(float) * (m0->nparams + m0->nstate), 0, m->timeout,
                               "the broadcast of rank 0's parameters");
  for (int r = 0; r < m->k && st == DP_OK; ++r) {
    st = dp_model_set_params(m->models[r], host);
    if (st == DP_OK && m0->nstate > 0) st = dp_model_set_state(m->models[r], host + m0->nparams);
    if (st == DP_OK) st = dp_model_reset_velocity(m->models[r]);
  }
  free(host);
  /* checked: every process holds process 0's bits */
  uint64_t mine = 0;
  if (st == DP_OK) st = dp_mirrored_digest(m, &mine);
  uint64_t *all = st == DP_OK ? calloc((size_t)m->nproc, sizeof *all) : NULL;
  if (st == DP_OK && !all) st = DP_FAIL(DP_ERR_MEMORY, "digests of %d processes", m->nproc);
  if (st == DP_OK) st = dp_dist_allgather(&mine, sizeof mine, all, m->timeout, "the check of the broadcast parameters");
  for (int q = 1; q < m->nproc && st == DP_OK; ++q)
    if (all[q] != all[0])
      st = DP_FAIL(DP_ERR_DIST, "after the broadcast, rank %d's parameters differ from rank 0's", q);
  free(all);
  return st;
}

/* A step, as the replica threads see it: written by the calling thread
 * before any replica thread starts (the shards included), read-only to them
 * but for each rank's own loss and correct. */
typedef struct step_task {
  dp_mirrored *m;
  const dp_batch *batch;
  size_t sample_bytes;
  float grad_scale, lr, momentum, weight_decay;
  int evaluate_only, step;
  int64_t shard_begin[DP_COMM_MAX_REPLICAS], shard_n[DP_COMM_MAX_REPLICAS];
  int with_samples;  /* replicas whose shard is not empty */
  int planted_fail;  /* DPCORE_TEST_FAIL_REPLICA's replica, else -1 (planted_failure) */
  double loss[DP_COMM_MAX_REPLICAS];
  int64_t correct[DP_COMM_MAX_REPLICAS];
} step_task;

static dp_batch shard_of(const step_task *t, int rank) {
  const int64_t begin = t->shard_begin[rank];
  const dp_batch *b = t->batch;
  dp_batch s = {b->x ? (const char *)b->x + begin * (int64_t)t->sample_bytes : NULL, b->x_is_u8,
                b->y ? b->y + begin : NULL, t->shard_n[rank], b->rows ? b->rows + begin : NULL, b->resident};
  return s;
}

/* Stage a shard (checked by dp_mirrored_check_batch already). */
static dp_status stage_shard(step_task *t, int rank) {
  dp_batch s = shard_of(t, rank);
  dp_model *model = t->m->models[rank];
  return s.rows ? dp_model_load_rows(model, s.resident[rank], s.rows, s.n) : dp_model_load(model, &s, 1);
}

/* ... in a step: the timeline's "scatter" */
static dp_status load_shard(void *arg, int rank) {
  step_task *t = arg;
  dp_trace *previous = dp_trace_step_begin(t->evaluate_only ? NULL : &t->m->models[rank]->trace);
  const int64_t t0 = dp_trace_begin();
  const dp_status st = stage_shard(t, rank);
  if (st == DP_OK) dp_trace_end(DP_PHASE_SCATTER, -1, 0, t0);
  dp_trace_step_end(previous);
  return st;
}

dp_status dp_mirrored_check_batch(const dp_mirrored *m, const dp_batch *b, int evaluate_only) {
  if (b->n < 0) return DP_FAIL(DP_ERR_VALUE, "batch size must be >= 0, got %lld", (long long)b->n);
  if (b->rows && (evaluate_only || !b->resident))
    return DP_FAIL(DP_ERR_VALUE, "mirrored: resident rows are for training steps, with one dataset per replica");
  if (!b->rows && b->n > 0 && !b->x) return DP_FAIL(DP_ERR_VALUE, "images are required");
  /* every shard of the job, so that every process of a job reaches the same
   * verdict on the same batch (another process's shard is checked against
   * this process's first replica: the models and datasets are the same) */
  for (int g = 0; g < m->total; ++g) {
    int64_t begin, end;
    dp_shard_range(b->n, m->total, g, &begin, &end);
    const int local = g - m->first, r = local >= 0 && local < m->k ? local : 0;
    const dp_model *model = m->models[r];
    if (b->rows)
      DP_TRY(dp_model_check_rows(model, b->resident[r], b->rows + begin, end - begin, begin));
    else
      DP_TRY(dp_model_check_labels(model, b->y ? b->y + begin : NULL, end - begin, begin));
    /* per-replica BatchNorm: each shard alone needs more than one value per channel */
    if (!evaluate_only && !m->sync_batchnorm) DP_TRY(dp_model_check_batchnorm_batch(model, end - begin));
  }
  if (!evaluate_only && m->sync_batchnorm) DP_TRY(dp_model_check_batchnorm_batch(m->models[0], b->n));
  return DP_OK;
}

/* Staging runs in a fork-join of its own when a replica failing to stage its
 * shard (the batch was checked: a device error, memory) could leave the
 * others changed: with BatchNorm, whose forward pass updates the running
 * statistics before the first collective. Otherwise a failing replica breaks
 * the group's barrier, its peers give up at their first collective before
 * changing anything, and the whole step is one wake-up of the replica
 * threads. */
static int stage_separately(const dp_mirrored *m) { return m->models[0]->nstate > 0; }

/* After the backward pass: the running statistics of per-replica BatchNorm,
 * averaged over the replicas that had samples, then the gradient buckets'
 * end, then the step. */
static dp_status reduce_and_step(step_task *t, int rank, const dp_collective *coll) {
  dp_mirrored *m = t->m;
  dp_model *model = m->models[rank];
  if (model->nstate > 0 && !m->sync_batchnorm && m->total > 1 && t->with_samples > 0) {
    if (t->shard_n[rank] == 0) DP_TRY(model->dev->backend->fill(model->dev, model->state, model->nstate, 0.0f));
    DP_TRY(dp_collective_all_reduce(coll, model->state, model->nstate, DP_REDUCE_SUM));
    DP_TRY(model->dev->backend->scale(model->dev, model->nstate, model->state, 1.0f / (float)t->with_samples));
  }
  DP_TRY(dp_collective_wait(coll));
  if (!t->step) return DP_OK;
  /* the loss flag came with the gradients: every replica skips or steps alike */
  return dp_model_guarded_step(model, t->lr, t->momentum, t->weight_decay);
}

/* A replica's whole step: forward and backward on its shard, the gradient
 * buckets all-reduced as the backward pass produces them, and the step. */
static dp_status run_shard_steps(void *arg, int rank) {
  step_task *t = arg;
  dp_mirrored *m = t->m;
  dp_model *model = m->models[rank];
  if (t->evaluate_only) {
    dp_batch s = shard_of(t, rank);
    return dp_model_evaluate(model, &s, &t->loss[rank], &t->correct[rank]);
  }
  if (!stage_separately(m)) DP_TRY(load_shard(arg, rank));
  dp_collective coll = dp_comm_collective(m->comm, rank);
  coll.sync_batchnorm = m->sync_batchnorm;
  coll.global_batch = t->batch->n;
  if (rank == t->planted_fail)
    return DP_FAIL(DP_ERR_RUNTIME, "replica %d: the failure planted by DPCORE_TEST_FAIL_REPLICA", rank);
  /* the loss is read at the end: the host queues the whole step first */
  DP_TRY(dp_model_forward_backward_loaded(model, t->shard_n[rank], t->grad_scale, &coll, NULL, NULL));
  DP_TRY(reduce_and_step(t, rank, &coll));
  return dp_model_read_metrics(model, &t->loss[rank], &t->correct[rank]);
}

/* ... recorded in the replica's timeline when it profiles (trace.h) */
static dp_status run_shard(void *arg, int rank) {
  step_task *t = arg;
  dp_trace *previous = dp_trace_step_begin(t->evaluate_only ? NULL : &t->m->models[rank]->trace);
  const int64_t t0 = dp_trace_begin();
  const dp_status st = run_shard_steps(arg, rank);
  if (st == DP_OK) dp_trace_end(DP_PHASE_STEP, -1, 0, t0);
  dp_trace_step_end(previous);
  return st;
}

/* Replica rank's warm-up for the step in t: its shard staged, forward and
 * backward with the collectives off, and the kernels the step launches after
 * its first collective (fill and scale of the BatchNorm statistics, the SGD
 * step) run once on the gradient scratch, whose contents no one reads. With
 * CUDA's lazy module loading a kernel's first launch loads it, which must not
 * happen while a peer's NCCL kernel spins (CUDA Programming Guide, "Lazy
 * Loading", potential hazards). The running statistics the forward pass
 * updated are put back; the gradients are overwritten by the step. */
static dp_status warm_shard(void *arg, int rank) {
  step_task *t = arg;
  dp_mirrored *m = t->m;
  dp_model *model = m->models[rank];
  dp_device *dev = model->dev;
  DP_TRY(stage_shard(t, rank));
  float *state = NULL;
  if (model->nstate > 0) {
    state = malloc(sizeof(float) * (size_t)model->nstate);
    if (!state)
      return DP_FAIL(DP_ERR_MEMORY, "mirrored warm-up: cannot save %lld statistics", (long long)model->nstate);
    dp_status st = dp_model_get_state(model, state);
    if (st != DP_OK) {
      free(state);
      return st;
    }
  }
  /* BatchNorm counts as in the step (the whole batch's samples when
   * synchronized), but nothing is exchanged */
  const dp_collective none = {&dp_collective_local_ops, NULL, rank, m->sync_batchnorm, t->batch->n};
  dp_status st = dp_model_forward_backward_loaded(model, t->shard_n[rank], t->grad_scale, &none, NULL, NULL);
  double loss;
  int64_t hits;
  if (st == DP_OK) st = dp_model_read_metrics(model, &loss, &hits);
  if (st == DP_OK) st = dev->backend->fill(dev, model->dscratch, 1, 0.0f);
  if (st == DP_OK) st = dev->backend->scale(dev, 1, model->dscratch, 1.0f);
  if (st == DP_OK)
    st = dev->backend->sgd_update(dev, 1, model->dscratch, model->dscratch, NULL, 0.0f, 0.0f, 0.0f, model->dscratch);
  if (st == DP_OK) st = dev->backend->restore_unless_allowed(dev, 1, model->dscratch, model->dscratch, model->dscratch);
  if (state) {
    const dp_status restored = dp_model_set_state(model, state);
    if (st == DP_OK) st = restored;
    free(state);
  }
  if (st == DP_OK) st = dev->backend->synchronize(dev);
  return st;
}

/* settings: the dp_cuda_defaults_snapshot the replicas' devices took for this step */
static dp_warm_key warm_key_of(const dp_batch *b, unsigned long long settings) {
  dp_warm_key key = {b->n, b->rows ? 2 : b->x_is_u8 ? 1 : 0, (int)(settings & 7u)};
  return key;
}

static int warm_find(const dp_mirrored *m, dp_warm_key key) {
  for (int i = 0; i < m->nwarm; ++i)
    if (m->warm[i].n == key.n && m->warm[i].source == key.source && m->warm[i].settings == key.settings) return i;
  return -1;
}

/* Warms the replicas up for t's batch shape unless they are already. */
static dp_status warm_up(dp_mirrored *m, step_task *t, dp_warm_key key) {
  if (warm_find(m, key) >= 0) return DP_OK;
  DP_TRY(dp_group_run(m->group, warm_shard, t));
  m->warm[m->next_warm] = key;
  m->next_warm = (m->next_warm + 1) % DP_MIRRORED_WARM_KEYS;
  if (m->nwarm < DP_MIRRORED_WARM_KEYS) m->nwarm++;
  return DP_OK;
}

static void warm_forget(dp_mirrored *m, dp_warm_key key) {
  const int i = warm_find(m, key);
  if (i >= 0) m->warm[i].n = -1; /* matches no batch */
}

static void set_in_step(dp_mirrored *m, int on) {
  for (int r = 0; r < m->k; ++r) {
    m->models[r]->dev->in_step = on;
    /* across processes: no host wait of the step outlasts the timeout */
    m->models[r]->dev->wait_timeout = on && m->nproc > 1 ? m->timeout : 0.0;
  }
}

/* What every process of a job must agree on before a step exchanges
 * anything: that it is the same call on the same batch. */
typedef struct step_header {
  int64_t model, calls, n;
  uint64_t batch; /* FNV-1a of the labels (or rows) */
  int32_t evaluate_only, step, source;
  uint32_t lr, momentum, weight_decay; /* the bits */
} step_header;

/* agree_on_step gathers every process's header into m->gathered, which holds
 * one dp_step_metrics per process */
_Static_assert(sizeof(step_header) <= sizeof(dp_step_metrics) &&
                   _Alignof(dp_step_metrics) % _Alignof(step_header) == 0,
               "a step_header must fit where a dp_step_metrics stands");

static const char *call_name(const step_header *h) {
  return h->evaluate_only ? "an evaluation" : h->step ? "a training step" : "a forward-backward";
}

/* Across processes: every process's header, compared with process 0's; a
 * difference is the same DP_ERR_DIST on every process. */
static dp_status agree_on_step(dp_mirrored *m, const dp_batch *b, int evaluate_only, int step, float lr,
                               float momentum, float weight_decay) {
  step_header h;
  memset(&h, 0, sizeof h);
  h.model = m->id;
  h.calls = m->calls;
  h.n = b->n;
  const int64_t *ids = b->rows ? b->rows : b->y;
  h.batch = ids ? fnv1a(fnv_offset, ids, sizeof *ids * (size_t)(b->n > 0 ? b->n : 0)) : 0;
  h.evaluate_only = evaluate_only;
  h.step = step;
  h.source = b->rows ? 2 : b->x_is_u8;
  memcpy(&h.lr, &lr, sizeof lr);
  memcpy(&h.momentum, &momentum, sizeof momentum);
  memcpy(&h.weight_decay, &weight_decay, sizeof weight_decay);
  step_header *all = (step_header *)m->gathered; /* big enough: the _Static_assert above */
  char what[96];
  snprintf(what, sizeof what, "the start of call %lld (%s of %lld samples)", (long long)m->calls, call_name(&h),
           (long long)h.n);
  DP_TRY(dp_dist_allgather(&h, (int64_t)sizeof h, all, m->timeout, what));
  /* read back with the stride of the gather */
  for (int q = 1; q < m->nproc; ++q) {
    const step_header *a = &all[0], *o = &all[q];
    if (o->model != a->model)
      return DP_FAIL(DP_ERR_DIST, "the processes are out of step: rank %d is stepping its model #%lld, rank 0 its "
                     "model #%lld (models across processes are numbered in the order each process makes them; "
                     "several such models must step in the same order on every process)", q,
                     (long long)o->model, (long long)a->model);
    if (o->calls != a->calls || o->evaluate_only != a->evaluate_only || o->step != a->step)
      return DP_FAIL(DP_ERR_DIST, "the processes are out of step: rank %d is at call %lld (%s), rank 0 at call %lld "
                     "(%s); every process must make the same training steps and evaluations", q,
                     (long long)o->calls, call_name(o), (long long)a->calls, call_name(a));
    if (o->n != a->n)
      return DP_FAIL(DP_ERR_DIST, "the processes disagree about the batch of call %lld (%s): rank %d has %lld samples, "
                     "rank 0 %lld; every process must pass the same global batch", (long long)a->calls, call_name(a),
                     q, (long long)o->n, (long long)a->n);
    if (o->batch != a->batch || o->source != a->source)
      return DP_FAIL(DP_ERR_DIST, "the processes disagree about the batch of call %lld (%s): rank %d's labels (or "
                     "rows) differ from rank 0's; every process must pass the same global batch, in the same order "
                     "(the same data and the same shuffling seed)", (long long)a->calls, call_name(a), q);
    if (o->lr != a->lr || o->momentum != a->momentum || o->weight_decay != a->weight_decay)
      return DP_FAIL(DP_ERR_DIST, "the processes disagree about the hyperparameters of call %lld: rank %d's lr, "
                     "momentum or weight_decay differ from rank 0's", (long long)a->calls, q);
  }
  return DP_OK;
}

/* The step's metrics summed over the job's replicas in global order (the
 * same bits on every process, and those of one process with all replicas). */
static dp_status gather_metrics(dp_mirrored *m, const step_task *t, double *loss_sum, int64_t *correct) {
  double loss = 0.0;
  int64_t hits = 0;
  if (m->nproc == 1) {
    for (int r = 0; r < m->k; ++r) {
      loss += t->loss[r];
      hits += t->correct[r];
    }
  } else {
    dp_step_metrics mine;
    memset(&mine, 0, sizeof mine);
    for (int r = 0; r < m->k; ++r) {
      mine.loss[r] = t->loss[r];
      mine.correct[r] = t->correct[r];
    }
    char what[80];
    snprintf(what, sizeof what, "the metrics of call %lld", (long long)m->calls);
    DP_TRY(dp_dist_allgather(&mine, (int64_t)sizeof mine, m->gathered, m->timeout, what));
    for (int q = 0; q < m->nproc; ++q)
      for (int r = 0; r < m->proc_k[q]; ++r) {
        loss += m->gathered[q].loss[r];
        hits += m->gathered[q].correct[r];
      }
  }
  *loss_sum = loss;
  *correct = hits;
  return DP_OK;
}

/* A training step whose global loss is not finite applied no update on any
 * replica (the loss flag rode with the gradients); every process reaches
 * this verdict from the same sum. DP_ERR_NUMERIC names the replicas (global
 * index; the device where it is this process's, the rank otherwise). */
static dp_status check_step_loss(const dp_mirrored *m, const step_task *t, double loss_sum) {
  if (isfinite(loss_sum)) return DP_OK;
  char names[512] = "";
  size_t used = 0;
  int bad = 0, g = 0;
  for (int q = 0; q < m->nproc; ++q) {
    const int kq = m->nproc == 1 ? m->k : m->proc_k[q];
    for (int r = 0; r < kq; ++r, ++g) {
      const double l = m->nproc == 1 ? t->loss[r] : m->gathered[q].loss[r];
      if (isfinite(l)) continue;
      char one[96], text[32];
      if (q == m->proc)
        snprintf(one, sizeof one, "%s%d (%s, loss %s)", bad ? ", " : "", g, m->models[r]->dev->name,
                 dp_loss_text(l, text));
      else
        snprintf(one, sizeof one, "%s%d (rank %d, loss %s)", bad ? ", " : "", g, q, dp_loss_text(l, text));
      bad++;
      if (used + strlen(one) + 1 < sizeof names) {
        memcpy(names + used, one, strlen(one) + 1);
        used += strlen(one);
      }
    }
  }
  char text[32];
  return DP_FAIL(DP_ERR_NUMERIC,
                 "the loss is not finite (%s) on replica%s %s; the step applied no update on any replica: the "
                 "parameters, momentum and BatchNorm statistics are those of the last finite step",
                 dp_loss_text(loss_sum, text), bad == 1 ? "" : "s", names);
}

/* DPCORE_TEST_FAIL_REPLICA=r, for tests: local replica r fails inside the training step, after
 * staging its shard, while its peers go on to their first collective (what a device error there
 * does; the batch checks refuse bad input before any replica starts, so nothing else reaches that
 * path from Python). Read on the calling thread before the replica threads start. */
static dp_status planted_failure(const dp_mirrored *m, int *rank) {
  *rank = -1;
  const char *v = getenv("DPCORE_TEST_FAIL_REPLICA");
  if (!v || !*v) return DP_OK;
  char *end = NULL;
  const long r = strtol(v, &end, 10);
  if (*end != '\0' || r < 0 || r >= m->k)
    return DP_FAIL(DP_ERR_VALUE, "DPCORE_TEST_FAIL_REPLICA=%s: expected a replica index in [0, %d)", v, m->k);
  *rank = (int)r;
  return DP_OK;
}

static dp_status run_step_here(dp_mirrored *m, const dp_batch *b, int evaluate_only, int step, float lr,
                               float momentum, float weight_decay, double *loss_sum, int64_t *correct) {
  if (m->nproc > 1) DP_TRY(agree_on_step(m, b, evaluate_only, step, lr, momentum, weight_decay));
  m->calls++;
  DP_TRY(dp_mirrored_check_batch(m, b, evaluate_only));
  const dp_model *m0 = m->models[0];
  step_task t = {m, b, (size_t)m0->in_c * m0->in_h * m0->in_w * (b->x_is_u8 ? 1 : sizeof(float)),
                 b->n ? 1.0f / (float)b->n : 0.0f, lr, momentum, weight_decay, evaluate_only, step,
                 {0}, {0}, 0, -1, {0}, {0}};
  if (b->n == 0) t.step = 0; /* an empty batch: zero gradients, nothing to learn */
  if (!evaluate_only) DP_TRY(planted_failure(m, &t.planted_fail));
  /* the shards of the job's replicas, here on the calling thread: the replica
   * threads only read them */
  for (int g = 0; g < m->total; ++g) {
    int64_t begin, end;
    dp_shard_range(b->n, m->total, g, &begin, &end);
    t.with_samples += end > begin;
    const int r = g - m->first;
    if (r >= 0 && r < m->k) {
      t.shard_begin[r] = begin;
      t.shard_n[r] = end - begin;
    }
  }
  /* the process-wide CUDA settings, read once: the warm-up and the step run
   * with the same ones, whatever another thread sets meanwhile */
  const unsigned long long settings = dp_cuda_defaults_snapshot();
  for (int r = 0; r < m->k; ++r) DP_TRY(dp_cuda_take_defaults(m->models[r]->dev, settings));
  dp_status st;
  if (evaluate_only) {
    st = dp_group_run(m->group, run_shard, &t); /* no collectives */
  } else {
    const dp_warm_key key = warm_key_of(b, settings);
    DP_TRY(warm_up(m, &t, key));
    for (int r = 0; r < m->k; ++r) dp_trace_count_step(&m->models[r]->trace);
    dp_comm_step_begin(m->comm);
    set_in_step(m, 1);
    st = stage_separately(m) ? dp_group_run(m->group, load_shard, &t) : DP_OK;
    if (st == DP_OK) st = dp_group_run(m->group, run_shard, &t);
    set_in_step(m, 0);
    if (st != DP_OK) {
      /* NCCL operations queued by some replicas may never be matched; none
       * queued, nothing to abort. The next step of this shape warms up again. */
      dp_comm_step_failed(m->comm);
      warm_forget(m, key);
    }
  }
  if (st != DP_OK) return st;
  DP_TRY(gather_metrics(m, &t, loss_sum, correct));
  return t.step ? check_step_loss(m, &t, *loss_sum) : DP_OK;
}

static dp_status run_step(dp_mirrored *m, const dp_batch *b, int evaluate_only, int step, float lr, float momentum,
                          float weight_decay, double *loss_sum, int64_t *correct) {
  if (m->nproc == 1) return run_step_here(m, b, evaluate_only, step, lr, momentum, weight_decay, loss_sum, correct);
  pthread_mutex_lock(&across_turn);
  const dp_status st = run_step_here(m, b, evaluate_only, step, lr, momentum, weight_decay, loss_sum, correct);
  pthread_mutex_unlock(&across_turn);
  return st;
}

dp_status dp_mirrored_train_step(dp_mirrored *m, const dp_batch *b, float lr, float momentum, float weight_decay,
                                 double *loss_sum, int64_t *correct) {
  DP_TRY(dp_sgd_args_check(lr, momentum, weight_decay)); /* before any replica starts */
  return run_step(m, b, 0, 1, lr, momentum, weight_decay, loss_sum, correct);
}

dp_status dp_mirrored_forward_backward(dp_mirrored *m, const dp_batch *b, double *loss_sum, int64_t *correct) {
  return run_step(m, b, 0, 0, 0.0f, 0.0f, 0.0f, loss_sum, correct);
}

dp_status dp_mirrored_evaluate(dp_mirrored *m, const dp_batch *b, double *loss_sum, int64_t *correct) {
  return run_step(m, b, 1, 0, 0.0f, 0.0f, 0.0f, loss_sum, correct);
}

/* ---- dp.all_reduce: kept groups, one per device set ----------------------------- */

enum { REDUCE_GROUPS = 8, REDUCE_KEY = DP_COMM_MAX_REPLICAS * 32 };

/* k replica threads and their comm, for the buffers of one device set. The
 * devices are descriptors of the host kind: a Tensor's memory is host memory
 * (py_tensor.c), whatever device it is labelled with. */
typedef struct reduce_group {
  char key[REDUCE_KEY];  /* the device names, each ended by '\n' */
  int k;
  dp_device devs[DP_COMM_MAX_REPLICAS];
  dp_group *group;
  dp_comm *comm;
  pthread_mutex_t turn;  /* one call at a time runs the group */
  int users;             /* calls holding it (guarded by groups_mutex) */
  unsigned long last_used;
} reduce_group;

static pthread_mutex_t groups_mutex = PTHREAD_MUTEX_INITIALIZER;
static reduce_group *groups[REDUCE_GROUPS];
static unsigned long groups_clock;

static void reduce_group_destroy(reduce_group *g) {
  if (!g) return;
  dp_comm_destroy(g->comm);
  dp_group_destroy(g->group);
  pthread_mutex_destroy(&g->turn);
  free(g);
}

static dp_status reduce_group_create(const char *key, const char *const *devices, int k, reduce_group **out) {
  *out = NULL;
  reduce_group *g = calloc(1, sizeof *g);
  if (!g) return DP_FAIL(DP_ERR_MEMORY, "all_reduce: cannot allocate a group of %d replicas", k);
  snprintf(g->key, sizeof g->key, "%s", key);
  g->k = k;
  int threads[DP_COMM_MAX_REPLICAS];
  dp_device *devs[DP_COMM_MAX_REPLICAS];
  for (int r = 0; r < k; ++r) {
    g->devs[r].kind = DP_DEVICE_CPU;
    g->devs[r].nthreads = 1;
    snprintf(g->devs[r].name, sizeof g->devs[r].name, "%s", devices[r]);
    devs[r] = &g->devs[r];
    threads[r] = 1;
  }
  if (pthread_mutex_init(&g->turn, NULL) != 0) {
    free(g);
    return DP_FAIL(DP_ERR_RUNTIME, "all_reduce: pthread_mutex_init failed");
  }
  dp_status st = dp_group_create(k, threads, NULL, &g->group);
  if (st == DP_OK) st = dp_comm_create(devs, k, DP_COMM_HOST, dp_group_barrier(g->group), &g->comm);
  if (st != DP_OK) {
    reduce_group_destroy(g);
    return st;
  }
  *out = g;
  return DP_OK;
}

/* The kept group for key, made (replacing the least recently used idle one)
 * when there is none; *kept = 0 when every slot was busy and the group is the
 * caller's alone, to destroy after use. */
static dp_status reduce_group_take(const char *key, const char *const *devices, int k, reduce_group **out,
                                   int *kept) {
  pthread_mutex_lock(&groups_mutex);
  reduce_group *g = NULL;
  int slot = -1;
  for (int i = 0; i < REDUCE_GROUPS && !g; ++i)
    if (groups[i] && strcmp(groups[i]->key, key) == 0) g = groups[i];
  dp_status st = DP_OK;
  *kept = 1;
  if (!g) {
    /* a free slot, else the least recently used idle group's */
    for (int i = 0; i < REDUCE_GROUPS; ++i) {
      if (!groups[i]) {
        slot = i;
        break;
      }
      if (groups[i]->users == 0 && (slot < 0 || groups[i]->last_used < groups[slot]->last_used)) slot = i;
    }
    st = reduce_group_create(key, devices, k, &g);
    if (st == DP_OK && slot >= 0) {
      reduce_group_destroy(groups[slot]); /* idle: no call holds it */
      groups[slot] = g;
    } else if (st == DP_OK) {
      *kept = 0;
    }
  }
  if (st == DP_OK) {
    g->users++;
    g->last_used = ++groups_clock;
  }
  pthread_mutex_unlock(&groups_mutex);
  *out = g;
  return st;
}

static void reduce_group_give_back(reduce_group *g, int kept) {
  pthread_mutex_lock(&groups_mutex);
  g->users--;
  pthread_mutex_unlock(&groups_mutex);
  if (!kept) reduce_group_destroy(g);
}

typedef struct reduce_task {
  dp_comm *comm;
  float *const *bufs;
  int64_t n;
  dp_reduce_op op;
} reduce_task;

/* Each rank all-reduces its own buffer through the group's collective interface. */
static dp_status run_reduce(void *arg, int rank) {
  reduce_task *t = arg;
  const dp_collective coll = dp_comm_collective(t->comm, rank);
  DP_TRY(dp_collective_all_reduce(&coll, t->bufs[rank], t->n, t->op));
  return dp_collective_wait(&coll);
}

dp_status dp_allreduce_buffers(const char *const *devices, float *const *bufs, int k, int64_t n, dp_reduce_op op) {
  if (k < 1 || k > DP_COMM_MAX_REPLICAS)
    return DP_FAIL(DP_ERR_VALUE, "all_reduce: need 1 to %d tensors, got %d", DP_COMM_MAX_REPLICAS, k);
  if (k == 1) return DP_OK; /* the sum over one replica is itself, and so is its mean */
  char key[REDUCE_KEY];
  size_t used = 0;
  for (int r = 0; r < k; ++r) {
    const int w = snprintf(key + used, sizeof key - used, "%s\n", devices[r]);
    if (w < 0 || (size_t)w >= sizeof key - used)
      return DP_FAIL(DP_ERR_VALUE, "all_reduce: the device names are too long");
    used += (size_t)w;
  }
  reduce_group *g;
  int kept;
  DP_TRY(reduce_group_take(key, devices, k, &g, &kept));
  pthread_mutex_lock(&g->turn);
  /* registered here, on the calling thread, before the replica threads start */
  dp_status st = dp_comm_register(g->comm, bufs, n);
  reduce_task t = {g->comm, bufs, n, op};
  if (st == DP_OK) st = dp_group_run(g->group, run_reduce, &t);
  dp_comm_unregister_all(g->comm);
  pthread_mutex_unlock(&g->turn);
  reduce_group_give_back(g, kept);
  return st;
}

void dp_allreduce_groups_clear(void) {
  pthread_mutex_lock(&groups_mutex);
  for (int i = 0; i < REDUCE_GROUPS; ++i)
    if (groups[i] && groups[i]->users == 0) {
      reduce_group_destroy(groups[i]);
      groups[i] = NULL;
    }
  pthread_mutex_unlock(&groups_mutex);
}

typedef struct bench_task {
  float *const *bufs;
  int k, iters;
  int64_t n;
  dp_barrier *bar;
} bench_task;

static dp_status run_bench(void *arg, int rank) {
  bench_task *t = arg;
  for (int i = 0; i < t->iters; ++i) DP_TRY(dp_allreduce(t->bufs, t->k, rank, t->n, DP_REDUCE_SUM, t->bar));
  return DP_OK;
}

dp_status dp_allreduce_benchmark(int k, int64_t n, int iters, double *seconds) {
  if (k < 1 || k > 64 || n < 1 || iters < 1)
    return DP_FAIL(DP_ERR_VALUE, "allreduce benchmark: need 1 <= k <= 64, n >= 1, iters >= 1");
  float *bufs[64] = {0};
  int threads[64];
  dp_status st = DP_OK;
  for (int r = 0; r < k; ++r) {
    threads[r] = 1;
    bufs[r] = aligned_alloc(64, ((size_t)n * sizeof(float) + 63) & ~(size_t)63);
    if (!bufs[r]) {
      st = DP_FAIL(DP_ERR_MEMORY, "allreduce benchmark: cannot allocate %lld floats", (long long)n);
      goto done;
    }
    /* zeros: the sums stay finite however many iterations run */
    for (int64_t i = 0; i < n; ++i) bufs[r][i] = 0.0f;
  }
  dp_group *g;
  st = dp_group_create(k, threads, NULL, &g);
  if (st != DP_OK) goto done;
  bench_task warm = {bufs, k, 2, n, dp_group_barrier(g)};
  st = dp_group_run(g, run_bench, &warm); /* first touch and thread start-up */
  bench_task t = {bufs, k, iters, n, dp_group_barrier(g)};
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  if (st == DP_OK) st = dp_group_run(g, run_bench, &t);
  clock_gettime(CLOCK_MONOTONIC, &b);
  *seconds = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
  dp_group_destroy(g);
done:
  for (int r = 0; r < k; ++r) free(bufs[r]);
  return st;
}
