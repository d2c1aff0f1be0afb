/* small_gemm_check.c — csrc/small_gemm.c's kernel (dp_gemm with own = 1) in its three products against a double
 * reference, built with the CPU's own instruction set (tests/test_small_gemm.py
 * compiles it with -march=native under ASan and UBSan, and with -march=haswell
 * for the AVX2 + FMA kernel; without either the kernel is not built and the
 * program checks that the switch says so).
 *
 * For each shape (M, N, K) (the kernel's edges: rows around its 8-row block,
 * columns around its 16 and 32 lanes, K around its accumulation blocks of
 * DP_GEMM_KB and the NT packing's 512, zero sizes) and each product: C within
 * gamma_n * sum |a_k b_k| of the reference, n = min(K, KB) + ceil(K/KB) - 1
 * (a block's chain from zero, then the blocks' results added in turn: no
 * product meets more roundings; small_gemm.h), plus one with C's old value
 * added in NT's accumulate mode; the leading dimensions wider than the
 * matrices, and every float outside C's M x N block still its sentinel after
 * the call; NT over K in two calls (accumulate) split at a multiple of KB the
 * same bits as one call; K = 0 a zero C (or C unchanged).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "small_gemm.h"

#define PAD 5 /* extra floats per row of every operand */
static const float SENTINEL = -12345.5f;

static double gamma_k(int64_t k) {
  const double u = ldexp(1.0, -24);
  return (double)k * u / (1.0 - (double)k * u);
}

/* the most roundings a product meets in a blocked sum of K (see the header comment) */
static int64_t blocked_roundings(int64_t K) {
  if (K <= 0) return 0;
  return (K < DP_GEMM_KB ? K : DP_GEMM_KB) + (K + DP_GEMM_KB - 1) / DP_GEMM_KB - 1;
}

static void fill(float *p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = 2.0f * uniform() - 1.0f;
}

/* mode 0: NN (A M x K, B K x N), 1: TN (A stored K x M), 2: NT (B stored N x K) */
static void check_product(int mode, int64_t M, int64_t N, int64_t K, int accumulate) {
  const int64_t lda = (mode == 1 ? M : K) + PAD, ldb = (mode == 2 ? K : N) + PAD, ldc = N + PAD;
  const int64_t arows = mode == 1 ? K : M, brows = mode == 2 ? N : K;
  float *A = malloc(sizeof(float) * (size_t)(arows * lda + 1));
  float *B = malloc(sizeof(float) * (size_t)(brows * ldb + 1));
  float *C = malloc(sizeof(float) * (size_t)(M * ldc + 1));
  float *C0 = malloc(sizeof(float) * (size_t)(M * ldc + 1));
  float *pack = aligned_alloc(64, sizeof(float) * DP_SMALL_GEMM_PACK_FLOATS);
  if (!A || !B || !C || !C0 || !pack) {
    CHECK(!"out of memory");
    free(A), free(B), free(C), free(C0), free(pack);
    return;
  }
  fill(A, arows * lda + 1);
  fill(B, brows * ldb + 1);
  for (int64_t i = 0; i < M * ldc + 1; ++i) C[i] = SENTINEL;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = accumulate ? 2.0f * uniform() - 1.0f : SENTINEL;
  memcpy(C0, C, sizeof(float) * (size_t)(M * ldc + 1));
  dp_gemm(1, mode == 1, mode == 2, M, N, K, A, lda, B, ldb, C, ldc, accumulate, pack);
  int bad = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double ref = accumulate ? C0[i * ldc + j] : 0.0, abs_sum = accumulate ? fabs(ref) : 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = mode == 1 ? A[k * lda + i] : A[i * lda + k];
        const double b = mode == 2 ? B[j * ldb + k] : B[k * ldb + j];
        ref += a * b;
        abs_sum += fabs(a * b);
      }
      const double err = fabs((double)C[i * ldc + j] - ref);
      if (!(err <= gamma_k(blocked_roundings(K) + accumulate) * abs_sum)) bad++;
    }
  CHECK(bad == 0);
  for (int64_t i = 0; i < M; ++i) /* the padding and the float past the last row untouched */
    for (int64_t j = N; j < ldc; ++j) CHECK(C[i * ldc + j] == SENTINEL);
  CHECK(C[M * ldc] == SENTINEL);
  if (mode == 2 && K > DP_GEMM_KB && !accumulate) { /* K in two calls, split at a block's end: the same bits */
    const int64_t K1 = (K / 3 / DP_GEMM_KB > 1 ? K / 3 / DP_GEMM_KB : 1) * DP_GEMM_KB;
    float *C2 = malloc(sizeof(float) * (size_t)(M * ldc + 1));
    if (!C2) {
      CHECK(!"out of memory");
    } else {
      memcpy(C2, C0, sizeof(float) * (size_t)(M * ldc + 1));
      dp_gemm(1, 0, 1, M, N, K1, A, lda, B, ldb, C2, ldc, 0, pack);
      dp_gemm(1, 0, 1, M, N, K - K1, A + K1, lda, B + K1, ldb, C2, ldc, 1, pack);
      CHECK(memcmp(C, C2, sizeof(float) * (size_t)(M * ldc + 1)) == 0);
      free(C2);
    }
  }
  if (bad) fprintf(stderr, "mode %d M %ld N %ld K %ld accumulate %d: %d outputs past the bound\n", mode, (long)M,
                   (long)N, (long)K, accumulate, bad);
  free(A), free(B), free(C), free(C0), free(pack);
}

int main(void) {
  int on = -1;
  CHECK(dp_small_gemm_on(&on) == DP_OK);
  CHECK(on == (dp_small_gemm_built() != 0)); /* the default: the kernel, where built */
  if (!dp_small_gemm_built()) {
    printf("small_gemm_check: the kernel is not built (no AVX-512, no AVX2 + FMA): nothing else to check\n");
    printf(failures ? "small_gemm_check: FAILED\n" : "small_gemm_check: ok\n");
    return failures ? 1 : 0;
  }
  const int64_t shapes[][3] = {
      {1, 1, 1},     {8, 32, 64},   {7, 31, 5},    {9, 33, 257},  {16, 16, 256}, {17, 15, 513}, {64, 196, 64},
      {67, 90, 360}, {129, 47, 3},  {3, 200, 600}, {8, 1, 1000},  {1, 64, 1},    {150, 8, 297}, {24, 48, 1100},
      /* the AVX2 kernel's: rows around its 6-row block and 120-row blocks, columns around 8 and 16 */
      {6, 8, 33},    {13, 9, 70},   {11, 17, 256}, {121, 7, 5},   {12, 16, 2100},
      /* K around the accumulation blocks: one block, one and one k, many blocks and a short last one */
      {9, 40, DP_GEMM_KB}, {9, 40, DP_GEMM_KB + 1}, {10, 20, 2 * DP_GEMM_KB - 1}, {8, 32, 8192}, {3, 5, 4099},
  };
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; ++s)
    for (int mode = 0; mode < 3; ++mode) {
      check_product(mode, shapes[s][0], shapes[s][1], shapes[s][2], 0);
      if (mode == 2) check_product(mode, shapes[s][0], shapes[s][1], shapes[s][2], 1);
    }
  for (int mode = 0; mode < 3; ++mode) { /* empty K: zeros (NT accumulating: C unchanged) */
    check_product(mode, 5, 9, 0, 0);
    if (mode == 2) check_product(mode, 5, 9, 0, 1);
  }
  check_product(0, 0, 7, 3, 0); /* no rows, no columns */
  check_product(1, 4, 0, 3, 0);
  printf(failures ? "small_gemm_check: FAILED\n" : "small_gemm_check: ok\n");
  return failures ? 1 : 0;
}
