/* winograd_lanes.h — Winograd convolution with the samples in vector lanes,
 * for the CPU backend; the forward pass and both gradients:
 *
 *   F(3x3, 5x5)  5x5 stride-1 convolutions of at least 6 input channels
 *                (LeNet's 20 -> 50): 49 multiplies per 3x3 block of outputs
 *                and input channel where a GEMM does 225
 *   F(4x4, 3x3)  3x3 stride-1 convolutions of at least 64 channels in and out
 *                on planes of at least 16 4x4 tiles (13x13 outputs and more):
 *                36 multiplies per 4x4 block where a GEMM does 144; narrower
 *                planes stay on F(2x2, 3x3) (winograd.h), whose backward
 *                passes are faster there and whose rounding errors are smaller
 *
 * Each m x m block of outputs comes from the A x A input tile around it
 * (A = m + r - 1, tiles at stride m, the input zero past its edge and
 * padding): with the transforms of scripts/winograd_matrices.py (F(3, 5):
 * interpolation points 0, 1, -1, 2, -2, 1/2 and infinity; F(4, 3): 0, 1, -1,
 * 2, -2 and infinity),
 *
 *   y = A^T [ sum over c of (G g G^T) . (B^T d B) ] A
 *
 * A^2 products M_xi (O, lanes) = U_xi (O, C) . V_xi (C, lanes) per tile. The
 * gradients are the same algorithm transposed (nothing as a convolution of
 * the padded dy, which would multiply zeros):
 *
 *   dM = A dY A^T                              (A x A from an m x m block of dy)
 *   dx += B [ sum over o of U_xi . dM ] B^T    (each tile's, added where the tile lies)
 *   dU = sum over tiles of dM . (B^T d B),  dw = G^T dU G
 *
 * Lanes: the samples in chunks of 16, one per vector lane (the chunk's input
 * transposed to (C, H, W, 16) first), so that every transform is 16-wide
 * vector arithmetic and the products are gemm_kernel.h's micro-kernel (6
 * channels by 16 lanes). A sample's y and dx therefore depend on that sample
 * alone, whatever else is in the batch and however the threads split it.
 * Thread t of nt takes the chunks [nch*t/nt, nch*(t+1)/nt); dw and db are
 * each thread's partial sums (its chunks in order) added in thread order, as
 * the GEMM and implicit GEMM paths do.
 *
 * Numerics: the transforms weigh the terms by |B|, |G|, |A| (entries up to 8)
 * and G's entries (1/3, 1/9, 1/6, 1/24, ...) are rounded to float32: a larger
 * error bound than the GEMM path's (tests/test_winograd_lanes.py derives and
 * checks it).
 *
 * The switches, read at every call ("1", "0" or unset/empty for the default,
 * any other value DP_ERR_VALUE): DPCORE_WINOGRAD "0" turns every Winograd
 * path off, as for winograd.h. F(3x3, 5x5) runs only in the fast precision
 * (dpcore.set_precision('fast')), for its error of several times float32
 * GEMM's; DPCORE_WINOGRAD_F35 "1"/"0" overrides that for A/B work.
 * DPCORE_WINOGRAD_F43 "1" gives the 3x3 layers above to F(4x4, 3x3); off by
 * default: on ResNet-18's step it is slower than F(2x2, 3x3), and its
 * rounding moves the PyTorch fixture to the edge of its tolerances.
 */
#ifndef DP_WINOGRAD_LANES_H
#define DP_WINOGRAD_LANES_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* Passes run so far by F(3x3, 5x5) and by F(4x4, 3x3) (debug_counters). */
void dp_wl_counts(long long *f35, long long *f43);

/* The passes, for dp_wl_scratch_floats. */
enum { DP_WL_FORWARD = 0, DP_WL_BACKWARD = 1 };

/* *takes = 1 when the switches are on and g is one of the two kinds above
 * (any padding) with planes that fit the chunk's buffers; DP_ERR_VALUE for a
 * bad switch value. fast: the device's fast_conv (dp_set_fast_convolutions),
 * which F(3x3, 5x5) needs unless DPCORE_WINOGRAD_F35 says otherwise. */
DP_MUST_CHECK dp_status dp_wl_takes(const dp_conv_geom *g, int fast, int *takes);

/* Floats of scratch (64-byte aligned) that a pass needs for N samples on
 * nthreads threads. */
size_t dp_wl_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads, int pass);

/* y (N, O, OH, OW) = conv(x, w) + b (b may be NULL). */
DP_MUST_CHECK dp_status dp_wl_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                      const float *b, float *y, int nthreads, float *scratch);

/* dx (N, C, H, W) (dx may be NULL), dw (O, C, KH, KW) and db (O) (db may be
 * NULL) of y = conv(x, w), from dy (N, O, OH, OW): one pass over the chunks,
 * each tile's A dY A^T computed once for both gradients. */
DP_MUST_CHECK dp_status dp_wl_backward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                       const float *dy, float *dx, float *dw, float *db, int nthreads,
                                       float *scratch);

#endif
