/* winograd.h — Winograd F(2x2, 3x3) for the CPU backend's 3x3, stride-1,
 * pad-1 convolutions (ResNet-18's): the forward pass and both gradients.
 *
 * Each 2x2 block of outputs comes from the 4x4 input tile around it (tiles
 * at stride 2): y = A^T [ (G g G^T) . (B^T d B) ] A summed over the input
 * channels, that is 16 GEMMs M_xi (O, T) = U_xi (O, C) . V_xi (C, T) over the
 * tiles T: 4 multiplies per output and input channel where im2col + GEMM
 * does 9. Odd output sizes pad the tile grid with zeros. dx is the same kind
 * of convolution of dy with the flipped, transposed filter (wt[c, o] =
 * flip(w[o, c])), by the same routine. dw is the forward pass transposed:
 * dU_xi (O, C) = sum over the tiles of (A dY A^T)_xi (B^T d B)_xi, then
 * dw = G^T dU G. The GEMMs are small_gemm.h's.
 *
 * Threads: no result depends on the thread count. Every GEMM runs
 * single-threaded inside a parallel region of all the device's nthreads.
 * Wide planes (OH*OW >= 64, backend_cpu.c's CONV_NARROW): thread t takes the
 * samples [N*t/nt, N*(t+1)/nt), one GEMM per sample, so that a sample's y and
 * dx do not depend on the rest of the batch. Narrow planes, and their dw: the
 * batch in chunks, a chunk's tiles side by side in each GEMM, the 16 GEMMs
 * dealt to the threads. dw of wide planes: up to 8 groups of consecutive
 * samples (their number set by the batch and the plane), a partial dU per
 * group, the partials added in group order.
 *
 * The switch: DPCORE_WINOGRAD (winograd_lanes.h's too), read with getenv at
 * every call so that a test may set it between calls: "1" on, "0" off, unset
 * or empty the default (DP_WINOGRAD_DEFAULT), any other value DP_ERR_VALUE.
 * A process that trains must not change it between the warm-up and the
 * steps: the warm-up sizes the scratch.
 *
 * Numerics: the transforms add roundings and weigh the terms by |B|, |G|,
 * |A|; tests/test_winograd.py derives the bound and checks it.
 */
#ifndef DP_WINOGRAD_H
#define DP_WINOGRAD_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* *takes = 1 when the switch is on and g is 3x3, stride 1, pad 1 with at
 * least DP_WINOGRAD_MIN_CHANNELS input and output channels; DP_ERR_VALUE for a
 * DPCORE_WINOGRAD that is not "0", "1" or empty. */
DP_MUST_CHECK dp_status dp_winograd_takes(const dp_conv_geom *g, int *takes);

/* Floats of scratch (64-byte aligned) that dp_winograd_forward and
 * dp_winograd_backward_dx need for N samples on nthreads threads. */
size_t dp_winograd_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads);

/* Floats of the filter transform U (16 matrices (O, C), each padded) that
 * dp_winograd_forward can keep for dp_winograd_backward_dx; and whether a
 * layer's is worth keeping: from DP_WINOGRAD_KEEP_PAIRS (O, C) pairs, where
 * transforming again is a memory-bound pass as large as U itself. */
size_t dp_winograd_u_floats(const dp_conv_geom *g);
int dp_winograd_worth_keeping(const dp_conv_geom *g);

/* y (N, O, OH, OW) = conv(x, w) + b (b may be NULL). u_keep (NULL: none,
 * else dp_winograd_u_floats floats, 64-byte aligned): the filter transform
 * written there instead of into the scratch, for dp_winograd_backward_dx. */
DP_MUST_CHECK dp_status dp_winograd_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                            const float *b, float *y, int nthreads, float *scratch, float *u_keep);

/* dx (N, C, H, W) of y = conv(x, w), from dy (N, O, OH, OW). u_kept (NULL:
 * none): a forward pass's u_keep with this w, used instead of transforming w
 * again (the same result). */
DP_MUST_CHECK dp_status dp_winograd_backward_dx(const dp_conv_geom *g, int64_t N, const float *w, const float *dy,
                                                float *dx, int nthreads, float *scratch, const float *u_kept);

/* dw (O, C, 3, 3) and db (O) (db may be NULL) of y = conv(x, w), from dy,
 * over the batch (above: dU summed by chunks or groups of samples fixed by
 * the batch, never by the thread count). */
DP_MUST_CHECK dp_status dp_winograd_backward_dw(const dp_conv_geom *g, int64_t N, const float *x, const float *dy,
                                                float *dw, float *db, int nthreads, float *scratch);

/* Sums over a batch by groups of samples (the bias gradient below, the CPU
 * backend's BatchNorm sums): the batch in dp_sample_groups(N) fixed groups, a
 * double partial per group and channel, the partials added in group order,
 * so that the sums do not depend on the thread count. Each thread sums its
 * groups' samples whole: what its own core wrote in the pass before, where a
 * channel across the batch would read the other cores' writes. */
#define DP_SAMPLE_GROUPS 8
static inline int64_t dp_sample_groups(int64_t N) { return N < DP_SAMPLE_GROUPS ? (N < 1 ? 1 : N) : DP_SAMPLE_GROUPS; }

/* db[o] = the sum of dy (N, O, P) over n and p, by groups of samples
 * (above), each plane's sum in double: the Winograd paths' bias gradient
 * (winograd_s2.c's too). part: DP_SAMPLE_GROUPS * O doubles, 64-byte aligned
 * (the callers pass their dU once read). Called inside a parallel region: its
 * loops are worksharing loops. */
void dp_winograd_bias_grad(const float *dy, int64_t N, int O, int64_t P, double *part, float *db);

/* db[o] = the sum of dy (N, O, P) over n and p in double (16 lanes, as
 * dp_winograd_bias_grad's), a parallel loop over o on nthreads threads (the bias gradient of
 * winograd_lanes.c's and fft_lanes.c's layers; called outside a parallel
 * region). */
void dp_bias_grad_by_channel(const float *dy, int64_t N, int O, int64_t P, float *db, int nthreads);

#endif
