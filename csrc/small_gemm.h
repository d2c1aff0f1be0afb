/* small_gemm.h — the CPU convolutions' GEMMs (Winograd F(2x2, 3x3)'s
 * products, winograd.c; the im2col GEMMs, backend_cpu.c): dpcore's own
 * single-threaded SGEMM where the compiler targets AVX-512 (or AVX2 and FMA:
 * the same kernel at half the width, a 6 x 16 block), CBLAS elsewhere or
 * when DPCORE_OWN_GEMM=0.
 *
 * Why not only the BLAS: the products are small GEMMs (64..512 channels by
 * a few dozen to a few hundred tiles) called from inside dpcore's own
 * threads. OpenBLAS runs them on the kernels its runtime chose (on an AVX-512
 * CPU under OPENBLAS_CORETYPE=Haswell, as this project's workplace sets, the
 * AVX2 ones at half the width) and packs both operands on every call. This
 * kernel reads A and B where they lie (NT packs B^T a panel at a time), with
 * an 8 x 32 register block (16 of the 32 vector registers accumulate).
 * Measured against OpenBLAS with its AVX2 kernels and with its own AVX-512
 * ones (benchmarks/bench_own_gemm.py; benchmarks/RESULTS.md, "dpcore's
 * AVX-512 GEMM kernel A/B").
 *
 * On the kernel each output is a blocked sum in k order: the k of each block
 * of DP_GEMM_KB (k in [j*KB, (j+1)*KB) from the call's first k) one chain of
 * fused multiply-adds from zero in registers, the blocks' results then added
 * one by one into C (the first stored, or added to C's old value when
 * accumulating). KB is a constant of the build (never of the thread count or
 * the cache): the same bits whatever the threads, the row and column blocking
 * and the batch, and the same on the AVX2 kernel as on the AVX-512 one and in
 * gemm_kernel.h's kernel (the implicit GEMM, Winograd with samples in lanes).
 *
 * Why blocks: one chain over all K (as before the blocking) has an error growing
 * like sqrt(K) u on random-sign terms and K u at worst; blocks of KB grow
 * like sqrt(KB + K/KB) u, and at worst gamma_{KB + ceil(K/KB) - 1} S in place
 * of gamma_K S (S = sum |a_k b_k|). ResNet-18's deep layers sum K = C*9 =
 * 2304..4608 terms on the im2col GEMM, and Winograd's products C = 256..512:
 * benchmarks/RESULTS.md, "Precision: K-blocked accumulation".
 */

#ifndef DP_SMALL_GEMM_H
#define DP_SMALL_GEMM_H

#include <stdint.h>

#include "dp_status.h"

/* The accumulation block (k): see above. On random-sign sums (a convolution's
 * forward and dx) the error goes like sqrt(KB + K/KB), least at KB = sqrt(K)
 * (48..68 for ResNet-18's K = 2304..4608, 16..23 for Winograd's C = 256..512);
 * on same-sign sums like sqrt(KB^2/K + K/KB), least at (K^2/2)^(1/3) (138..220).
 * Measured (benchmarks/RESULTS.md, "Precision: K-blocked accumulation"): 64
 * had 0.8-1.1x 128's GEMM-path error (0.75x on Winograd's products at 256 and
 * 512 channels) and cost 4-8% on the deep layers' GEMM path; 128 and 256 cost
 * nothing measurable, 256 had 1.0-1.4x 128's error.
 * The extra work is one add of the C tile per block, 1 in 128 of the k loop's. */
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

/* How many dp_gemm calls this process has sent to the BLAS and to dpcore's kernel (what the
 * DPCORE_OWN_GEMM switch switches, observable: _core.debug_counters()). */
void dp_gemm_counts(long long *blas, long long *own);

#endif
