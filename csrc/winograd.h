/* winograd.h — Winograd F(2x2, 3x3) for the CPU backend's 3x3, stride-1,
 * pad-1 convolutions (ResNet-18's): the forward pass and both gradients.
 *
 * Each 2x2 block of outputs comes from the 4x4 input tile around it
 * (tiles at stride 2): y = A^T [ (G g G^T) . (B^T d B) ] A, summed over the
 * input channels, that is 16 GEMMs M_xi (O, T) = U_xi (O, C) . V_xi (C, T)
 * over the tiles T: 4 multiplies per output and input channel where im2col +
 * GEMM does 9. Odd output sizes pad the tile grid with zeros and drop the
 * outputs past the edge. dx of such a convolution is the same kind of
 * convolution of dy with the flipped, transposed filter (wt[c, o] = flip(w[o, c])),
 * computed by the same routine. dw is the forward pass transposed:
 * dU_xi (O, C) = sum over the batch's tiles of (A dY A^T)_xi (B^T d B)_xi,
 * 16 GEMMs, then dw = G^T dU G.
 *
 * Threads: every GEMM runs single-threaded inside a parallel region that
 * always has all the device's nthreads threads (so a lone sample's GEMM is the
 * same single-threaded call as in a batch). Wide planes (OH*OW >= 64, as
 * backend_cpu.c's CONV_NARROW): thread t takes the samples [N*t/nt, N*(t+1)/nt),
 * one sample per GEMM, so a sample's y and dx are the same bits whatever else
 * is in the batch. Narrow planes (ResNet-18's 7x7 and 4x4), and their dw: the
 * batch in chunks of samples, a chunk's tiles side by side in each GEMM and the
 * 16 GEMMs dealt to the threads, as the GEMM path groups narrow planes (with
 * AVX-512 each thread also transforms the entries of its own GEMMs, so a GEMM
 * reads what its core wrote). dw of wide planes: the batch in up to 8 groups
 * of consecutive samples (their number set by the batch and the plane, not the
 * threads), each thread transforming only its own groups' samples and summing
 * their partial dU, the partials added in group order. The products run on dpcore's own GEMM kernel
 * where the build has it (small_gemm.h; DPCORE_OWN_GEMM=0: the BLAS); with
 * AVX-512 the tiles' transforms run 15 or 16 tiles a step in registers, the
 * same arithmetic in the same order as the scalar code.
 *
 * The switch: DPCORE_WINOGRAD (which also switches winograd_lanes.h),
 * read with getenv at every call (so that a test
 * may set it between calls in one process: CPython's os.environ writes reach
 * getenv): "1" on, "0" off, unset or empty the default (DP_WINOGRAD_DEFAULT,
 * chosen by benchmarks/bench_winograd.py's whole-step A/B); any other value is
 * DP_ERR_VALUE. A process that trains must not change it between the warm-up
 * and the steps (the scratch is sized by the warm-up).
 *
 * Numerics: the transforms add roundings and weigh the terms by |B|, |G|, |A|
 * (tests/test_winograd.py derives and checks the bounds); measured, the errors
 * are within 2x of the GEMM path's, far inside the suite's tolerances.
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
 * layer's is worth keeping (memory for the time of a filter transform: the
 * layers of at least DP_WINOGRAD_KEEP_PAIRS (O, C) pairs, where the transform
 * is a memory-bound pass of U's size: 16 MB at 512 channels). */
size_t dp_winograd_u_floats(const dp_conv_geom *g);
int dp_winograd_worth_keeping(const dp_conv_geom *g);

/* y (N, O, OH, OW) = conv(x, w) + b (b may be NULL). u_keep (NULL: none,
 * else dp_winograd_u_floats floats, 64-byte aligned): the filter transform
 * written there instead of into the scratch, for dp_winograd_backward_dx. */
DP_MUST_CHECK dp_status dp_winograd_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                            const float *b, float *y, int nthreads, float *scratch, float *u_keep);

/* dx (N, C, H, W) of y = conv(x, w), from dy (N, O, OH, OW). u_kept (NULL:
 * none): a forward pass's u_keep with this w, used instead of transforming w
 * again (the same bits). */
DP_MUST_CHECK dp_status dp_winograd_backward_dx(const dp_conv_geom *g, int64_t N, const float *w, const float *dy,
                                                float *dx, int nthreads, float *scratch, const float *u_kept);

/* dw (O, C, 3, 3) and db (O) (db may be NULL) of y = conv(x, w), from dy, over
 * the batch: dU_xi (O, C) = sum over the tiles of (A dY A^T)_xi (B^T d B)_xi,
 * dw = G^T dU G. Narrow planes: the batch in chunks of samples (the same
 * chunks whatever the thread count), the 16 GEMMs dealt to the threads; wide
 * planes: groups of samples, a partial dU each (above). */
DP_MUST_CHECK dp_status dp_winograd_backward_dw(const dp_conv_geom *g, int64_t N, const float *x, const float *dy,
                                                float *dw, float *db, int nthreads, float *scratch);

/* Sums over a batch by groups of samples (this bias gradient, the CPU
 * backend's BatchNorm sums): the batch in dp_sample_groups(N) fixed groups,
 * each thread its groups' samples whole (the samples its own core's pass
 * before wrote, where a channel at a time across the batch read the other
 * core's: BatchNorm's sums took 0.59 ms a pass on ResNet-18's 64x28x28
 * activations at batch 64 that way, 0.33 ms this way), a double partial per
 * group and channel, the partials added in group order: the same bits
 * whatever the thread count. */
#define DP_SAMPLE_GROUPS 8
static inline int64_t dp_sample_groups(int64_t N) { return N < DP_SAMPLE_GROUPS ? (N < 1 ? 1 : N) : DP_SAMPLE_GROUPS; }

/* db[o] = the sum of dy (N, O, P) over n and p: the Winograd paths' bias
 * gradient (winograd_s2.c's too), by groups of samples (above), each plane's
 * sum in double (16 lanes, added pairwise); part: DP_SAMPLE_GROUPS * O
 * doubles, 64-byte aligned (the callers' dU once read). Worksharing loops of
 * a parallel region. */
void dp_winograd_bias_grad(const float *dy, int64_t N, int O, int64_t P, double *part, float *db);

#endif
