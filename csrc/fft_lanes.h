/* fft_lanes.h — convolution by 16 x 16 two-dimensional FFTs with the samples
 * in vector lanes, for the CPU backend's 5x5 (and larger) stride-1 layers on
 * small planes (LeNet's 20 -> 50 on 13x13): the forward pass and both
 * gradients, in the default precision.
 *
 * Why an FFT and not Winograd: F(3x3, 5x5) is 5-16x float32 GEMM's error per
 * pass (its transforms weigh terms by up to 8 and cancel), and no float32
 * Winograd form for 5x5 comes within 2x (benchmarks/RESULTS.md "Precision").
 * The DFT is unitary up to a scale, so its rounding error stays a few units
 * of float32 normwise: the same order as the GEMM's, where F(3x3, 5x5)'s is
 * not. The price is complex products: 144 points of the half spectrum, 4 real
 * multiplies each, 576 a (sample, output channel, input channel) where the
 * direct form does OH*OW*r*r (2,025 on LeNet's layer).
 *
 * A padded input plane of up to 16 x 16 is one transform (no tiling): the
 * layer's circular correlation over 16 equals the linear one on the valid
 * outputs (no wrap-around) because every input index i + u < H + 2 pad <= 16.
 *
 *   y  = IDFT[ sum over c of X_c . conj(W_oc) ]          (forward)
 *   dx = IDFT[ sum over o of DY_o . W_oc ]   (dx in the padded plane's coordinates)
 *   dw = IDFT[ sum over samples of X_c . conj(DY_o) ]    (the r x r corner)
 *
 * Each point's complex sum is one real GEMM on gemm_kernel.h's micro-kernel:
 * a channel's real and imaginary parts are two rows, so K = 2C (forward),
 * 2O (dx) or 2 x 16 lanes (dw). Lanes, threads and the order of dw's sums
 * as winograd_lanes.h's: a sample's y and dx depend on that sample alone;
 * dw and db are each thread's partial sums added in thread order.
 *
 * The switch: DPCORE_FFT "1"/"0" (unset or empty: on), read at every call;
 * any other value DP_ERR_VALUE. Independent of DPCORE_WINOGRAD (this is not a
 * Winograd form). In the fast precision F(3x3, 5x5) takes the 5x5 layers
 * first (winograd_lanes.h), being faster.
 */
#ifndef DP_FFT_LANES_H
#define DP_FFT_LANES_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* Passes run so far by this path (debug_counters). */
long long dp_fft_count(void);
/* Forward outputs recomputed directly so far, for want of a sign (fft_lanes.c: fl_forward). */
long long dp_fft_redone(void);

enum { DP_FFT_FORWARD = 0, DP_FFT_BACKWARD = 1 };

/* *takes = 1 when DPCORE_FFT is on and g is a square r x r kernel, r >= 5,
 * stride 1, padded plane at most 16 x 16, at least DP_FFT_MIN_IN input
 * channels, enough outputs per plane to beat the direct form's multiplies,
 * and O * C within the scratch's limit; DP_ERR_VALUE for a bad switch. */
DP_MUST_CHECK dp_status dp_fft_takes(const dp_conv_geom *g, int *takes);

/* Floats of scratch (64-byte aligned) that a pass needs. */
size_t dp_fft_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads, int pass);

/* y (N, O, OH, OW) = conv(x, w) + b (b may be NULL). */
DP_MUST_CHECK dp_status dp_fft_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                       const float *b, float *y, int nthreads, float *scratch);

/* dx (may be NULL), dw and db (may be NULL) of y = conv(x, w), from dy. */
DP_MUST_CHECK dp_status dp_fft_backward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                        const float *dy, float *dx, float *dw, float *db, int nthreads,
                                        float *scratch);

#endif
