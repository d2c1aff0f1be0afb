/* small_gemm.h — the CPU convolutions' GEMMs (Winograd F(2x2, 3x3)'s
 * products, winograd.c; the im2col GEMMs, backend_cpu.c): dpcore's own
 * single-threaded SGEMM where the compiler targets AVX-512 (or AVX2 and FMA:
 * the same kernel at half the width, a 6 x 16 block), CBLAS elsewhere or
 * when DPCORE_OWN_GEMM=0.
 *
 * Why a kernel of our own: these are small GEMMs (64..512 channels by tens
 * to hundreds of tiles) called from inside dpcore's threads. OpenBLAS packs
 * both operands on every call and runs the kernels its runtime chose (the
 * AVX2 ones under OPENBLAS_CORETYPE=Haswell, even on an AVX-512 CPU). This
 * kernel reads A and B where they lie (an NT product packs B^T a panel at a
 * time), with an 8 x 32 register block. The A/B: benchmarks/RESULTS.md,
 * "dpcore's AVX-512 GEMM kernel A/B".
 *
 * Sums: on the kernel each output is a blocked sum in k order, each block of
 * DP_GEMM_KB k (counted from the call's first k) one chain of fused
 * multiply-adds from zero in registers, the blocks' results added one by one
 * into C (the first stored, or added to C's old value when accumulating). KB
 * is a constant of the build, never of the thread count or the cache, so that
 * the result does not depend on the threads, the row and column blocking or
 * the batch, and is the same on the AVX2 and AVX-512 kernels and on
 * gemm_kernel.h's (the implicit GEMM, Winograd with samples in lanes).
 * Blocks, because one chain over all K has an error growing like sqrt(K) u
 * on random-sign terms and K u at worst; blocks of KB grow like
 * sqrt(KB + K/KB) u, and at worst gamma_{KB + ceil(K/KB) - 1} S in place of
 * gamma_K S (S = sum |a_k b_k|): benchmarks/RESULTS.md, "Precision: K-blocked
 * accumulation".
 */

#ifndef DP_SMALL_GEMM_H
#define DP_SMALL_GEMM_H

#include <stdint.h>

#include "dp_status.h"

/* The accumulation block (k), above. The error is least at KB = sqrt(K) on
 * random-sign sums (a convolution's forward and dx) and at (K^2/2)^(1/3) on
 * same-sign sums; 128 lies between the two for ResNet-18's K = 2304..4608.
 * The extra work is one add of the C tile per block. The A/B of 64, 128 and
 * 256: benchmarks/RESULTS.md, "Precision: K-blocked accumulation". */
#define DP_GEMM_KB 128

/* 2 where this build has the AVX-512 kernel, 1 the AVX2 + FMA one (whatever
 * the switch says), else 0 */
int dp_small_gemm_built(void);

/* 1 where this build has a kernel (AVX-512F, or AVX2 and FMA) and DPCORE_OWN_GEMM is not 0;
 * else 0: the callers use the BLAS. Fails only for a malformed switch. */
DP_MUST_CHECK dp_status dp_small_gemm_on(int *on);

/* floats of the packing buffer a B^T product needs on the kernel: a panel of
 * 32 columns of B^T by a block of 512 k */
#define DP_SMALL_GEMM_PACK_FLOATS (32 * 512)

/* C (M, N) = op(A) . op(B), row-major: op(A) = A (M, K), or A^T with A
 * stored (K, M) (ta); op(B) = B (K, N), or B^T with B stored (N, K) (tb).
 * accumulate: C's values plus the product (on the kernel each K-block's
 * chain added to C in turn; through CBLAS, beta = 1), else C's old contents
 * are ignored. own (dp_small_gemm_on's answer): dpcore's kernel, one thread (a
 * B^T product packs into `pack`, DP_SMALL_GEMM_PACK_FLOATS floats, the
 * caller's); else, and for A^T . B^T, CBLAS. */
void dp_gemm(int own, int ta, int tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
             int64_t ldb, float *C, int64_t ldc, int accumulate, float *pack);

/* How many dp_gemm calls this process has sent to the BLAS and to dpcore's
 * kernel (_core.debug_counters(): makes DPCORE_OWN_GEMM observable). */
void dp_gemm_counts(long long *blas, long long *own);

#endif
