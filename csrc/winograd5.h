/* winograd5.h — Winograd F(3x3, 5x5) for the CPU backend's 5x5 stride-1
 * convolutions with several input channels (LeNet's 20 -> 50 on 13x13): the
 * forward pass and both gradients, 49 multiplies per 3x3 block of outputs and
 * input channel where im2col + GEMM and the implicit GEMM do 225 (4.6x
 * fewer).
 *
 * Each 3x3 block of outputs comes from the 7x7 input tile around it (tiles at
 * stride 3, the input zero past its edge and padding): with the transforms of
 * scripts/winograd_matrices.py (interpolation points 0, 1, -1, 2, -2, 1/2 and
 * infinity),
 *
 *   y = A^T [ sum over c of (G g G^T) . (B^T d B) ] A      (A^T 3x7, G 7x5, B^T 7x7)
 *
 * 49 products M_xi (O, lanes) = U_xi (O, C) . V_xi (C, lanes) per tile. The
 * gradients are the same algorithm transposed (nothing as a convolution of the
 * padded dy, which would multiply zeros):
 *
 *   dM = A dY A^T                         (7x7 from a 3x3 block of dy)
 *   dx += B [ sum over o of U_xi . dM ] B^T   (each tile's 7x7, added where the tile lies)
 *   dU = sum over tiles of dM . (B^T d B),  dw = G^T dU G
 *
 * Lanes: the samples in chunks of 16, one sample per vector lane (the input
 * chunk transposed to (C, H, W, 16) first), so that every transform is
 * 16-wide vector arithmetic and the products are gemm_kernel.h's micro-kernel
 * (6 channels by 16 lanes). A sample's y and dx therefore depend on that
 * sample alone (the same bits whatever else is in the batch, however the
 * threads split it); thread t of nt takes the chunks [nch*t/nt, nch*(t+1)/nt),
 * and dw and db are each thread's partial sums (its chunks in order) added in
 * thread order, as the GEMM and implicit GEMM paths do.
 *
 * Numerics: the transforms weigh the terms by |B|, |G|, |A| (entries up to 6)
 * and G's entries (1/3, 1/9, 1/36, ...) are rounded to float32: the error is a
 * derived gamma_k bound larger than the GEMM path's (tests/test_winograd5.py
 * derives it and checks it, and the suite's tolerances).
 *
 * The switch: DPCORE_WINOGRAD, as for F(2x2, 3x3) (winograd.h): "0" turns
 * both off.
 */
#ifndef DP_WINOGRAD5_H
#define DP_WINOGRAD5_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* The passes, for dp_wino5_scratch_floats. */
enum { DP_WINO5_FORWARD = 0, DP_WINO5_BACKWARD = 1 };

/* *takes = 1 when the switch is on and g is 5x5, stride 1 (any padding), with
 * at least DP_WINO5_MIN_IN input channels; DP_ERR_VALUE for a DPCORE_WINOGRAD
 * that is not "0", "1" or empty. */
DP_MUST_CHECK dp_status dp_wino5_takes(const dp_conv_geom *g, int *takes);

/* Floats of scratch (64-byte aligned) that a pass needs for N samples on
 * nthreads threads. */
size_t dp_wino5_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads, int pass);

/* y (N, O, OH, OW) = conv(x, w) + b (b may be NULL). */
DP_MUST_CHECK dp_status dp_wino5_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                         const float *b, float *y, int nthreads, float *scratch);

/* dx (N, C, H, W) (dx may be NULL), dw (O, C, 5, 5) and db (O) (db may be
 * NULL) of y = conv(x, w), from dy (N, O, OH, OW): one pass over the chunks,
 * each tile's A dY A^T computed once for both gradients. */
DP_MUST_CHECK dp_status dp_wino5_backward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                          const float *dy, float *dx, float *dw, float *db, int nthreads,
                                          float *scratch);

#endif
