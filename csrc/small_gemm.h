/* small_gemm.h — dpcore's own single-threaded SGEMM for the Winograd
 * products (winograd.c), built where the compiler targets AVX-512.
 *
 * Why not the BLAS: F(2x2, 3x3)'s products are 16 small GEMMs per sample
 * (64..512 channels by 49..196 tiles), called from inside dpcore's own
 * threads. OpenBLAS runs them on the kernels its runtime chose (on an AVX-512
 * CPU under OPENBLAS_CORETYPE=Haswell, as this project's workplace sets, the
 * AVX2 ones at half the width) and packs both operands on every call. This
 * kernel reads U and V where the transforms wrote them (no packing), with an
 * 8 x 32 register block (16 of the 32 vector registers accumulate). Measured
 * against OpenBLAS, both with its AVX2 kernels and with its own AVX-512 choice
 * (benchmarks/RESULTS.md, "dpcore's AVX-512 SGEMM for the Winograd products"):
 * kept where it measured faster, and switchable (DPCORE_OWN_GEMM=0: OpenBLAS).
 *
 * Each output is one sequential sum of fused multiply-adds in k order (the
 * same bits whatever the blocking and the thread).
 */
#ifndef DP_SMALL_GEMM_H
#define DP_SMALL_GEMM_H

#include <stdint.h>

#include "dp_status.h"

/* 1 where this build has the kernel (whatever the switch says), else 0 */
int dp_small_gemm_built(void);

/* 1 where this build has the kernel (AVX-512F) and DPCORE_OWN_GEMM is not 0;
 * else 0: the callers use the BLAS. Fails only for a malformed switch. */
DP_MUST_CHECK dp_status dp_small_gemm_on(int *on);

/* C (M, N) = A (M, K) . B (K, N), row-major, leading dimensions lda, ldb,
 * ldc (beta 0: C's old contents are ignored). Only where dp_small_gemm_on
 * said 1 (elsewhere it does nothing). */
void dp_small_gemm_nn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                      float *C, int64_t ldc);

/* C (M, N) = A^T . B, A (K, M) row-major (A^T's element (i, k) at
 * A[k * lda + i]), B (K, N); beta 0. Only where dp_small_gemm_on said 1. */
void dp_small_gemm_tn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                      float *C, int64_t ldc);

/* floats of dp_small_gemm_nt's packing buffer: a panel of 32 columns of B^T
 * by a block of 512 k */
#define DP_SMALL_GEMM_PACK_FLOATS (32 * 512)

/* C (M, N) (+)= A (M, K) . B^T, B (N, K) row-major: beta 0 (overwrite) or 1
 * (accumulate: the sums go on from C's values in k order). B^T is packed a
 * panel at a time into `pack` (DP_SMALL_GEMM_PACK_FLOATS, the caller's). Only
 * where dp_small_gemm_on said 1. */
void dp_small_gemm_nt(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                      float *C, int64_t ldc, int accumulate, float *pack);

#endif
