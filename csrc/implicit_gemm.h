/* implicit_gemm.h — convolution on the CPU as a GEMM whose input operand is
 * never written out: the forward pass, the weight gradient and (below) the
 * input gradient of convolutions with few channels (LeNet's 20 -> 50, 5x5 on
 * 13x13). Why: im2col's column matrix is KH*KW times the input (25 times for
 * 5x5), and with few channels writing and reading it is a large share of the
 * layer's time, while the BLAS runs such small GEMMs below its best rate.
 *
 * The product is the im2col GEMM's, y[o, p] = sum over taps t = (c, ki, kj)
 * of w[o, t] * x[off[p] + toff[t]], where off[p] is where output position p's
 * window starts in the (zero-padded) input and toff[t] where tap t lies in a
 * window: a table of KH*KW*C offsets and one of OH*OW. The micro-kernel holds
 * 6 rows by 16 output channels in registers, broadcasts each row's input
 * value and multiplies it with 16 (or 8) channels of the packed filter
 * (w transposed to (taps, channels), in panels of 16 channels):
 * forward, rows are output positions and the sum runs over the taps; for dw
 * the same kernel with the roles swapped, rows are taps and the sum runs over
 * a group of samples' output positions against dy transposed. db is the sums
 * of dy.
 *
 * Threads: thread t of nt takes the samples [N*t/nt, N*(t+1)/nt); each
 * sample's y depends on that sample alone, whatever else is in the batch; dw
 * and db are each thread's partial sums (its samples in groups of at least
 * DP_IGEMM_DW_ROWS output positions, in order) added in thread order, as the
 * GEMM path does.
 *
 * Sums: each output is a sum over the taps in (c, ki, kj) order, blocked as
 * dpcore's GEMM kernel's (gemm_kernel.h, small_gemm.h's DP_GEMM_KB): each
 * block of KB taps one chain of fused multiply-adds (where the CPU has FMA)
 * from zero, the blocks' results added in turn, as im2col + that kernel
 * computes it; dw such a sum per group of samples, added to the thread's
 * running partial.
 *
 * The switch: DPCORE_IMPLICIT_GEMM, read with getenv at every call as
 * DPCORE_WINOGRAD is: "1" on, "0" off, unset or empty the default
 * (DP_IGEMM_DEFAULT), any other value DP_ERR_VALUE. It takes the
 * convolutions with more than one input channel and at most DP_IGEMM_MAX_OUT
 * (64) output channels, where it is faster than im2col + SGEMM; the Winograd
 * and one-channel paths come first.
 *
 * dx: the col2im of w^T dy with the same kernel (rows 6 output positions,
 * lanes 16 taps, the sum over the O output channels), each tile added into dx
 * as it is computed. Taken where it is no slower than the GEMM path: with at
 * least DP_IGEMM_DX_MIN_OUT output channels (a shorter sum loses to the
 * tile's scatter), and where the GEMM path does not compute dx as a
 * convolution of dy ("same" padding, which needs no col2im). Otherwise dx
 * stays on the GEMM path, without its im2col of x.
 */
#ifndef DP_IMPLICIT_GEMM_H
#define DP_IMPLICIT_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* *takes = 1 when the switch is on and g is one the implicit GEMM takes;
 * DP_ERR_VALUE for a DPCORE_IMPLICIT_GEMM that is not "0", "1" or empty. */
DP_MUST_CHECK dp_status dp_igemm_takes(const dp_conv_geom *g, int *takes);

/* dx takes the implicit GEMM from this many output channels (see above). */
#define DP_IGEMM_DX_MIN_OUT 32

/* The passes, for dp_igemm_scratch_floats. */
enum { DP_IGEMM_FORWARD = 0, DP_IGEMM_DW = 1, DP_IGEMM_DX = 2 };

/* Floats of scratch (64-byte aligned) that a pass needs for N samples on
 * nthreads threads. */
size_t dp_igemm_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads, int pass);

/* y (N, O, OH, OW) = conv(x, w) + b (b may be NULL). */
DP_MUST_CHECK dp_status dp_igemm_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                         const float *b, float *y, int nthreads, float *scratch);

/* dw (O, C, KH, KW) and db (O) (db may be NULL) of y = conv(x, w), from dy
 * (N, O, OH, OW), over the batch. */
DP_MUST_CHECK dp_status dp_igemm_backward_dw(const dp_conv_geom *g, int64_t N, const float *x, const float *dy,
                                             float *dw, float *db, int nthreads, float *scratch);

/* dx (N, C, H, W) of y = conv(x, w), from dy (N, O, OH, OW): the col2im of
 * w^T dy, each tile of it added into the sample's dx as it is computed. */
DP_MUST_CHECK dp_status dp_igemm_backward_dx(const dp_conv_geom *g, int64_t N, const float *w, const float *dy,
                                             float *dx, int nthreads, float *scratch);

#endif
