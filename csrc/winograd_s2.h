/* winograd_s2.h — Winograd for the CPU backend's 3x3 convolutions at stride
 * 2, pad 1 (ResNet-18's downsampling layers): the forward pass and both
 * gradients, where im2col + GEMM takes 9 multiplies per output and input
 * channel.
 *
 * Along one axis, two outputs of stride 2 read five inputs d0..d4
 * (y0 = g0 d0 + g1 d1 + g2 d2, y1 = g0 d2 + g1 d3 + g2 d4): the even taps
 * (g0, g2) run over the even inputs as a 2-tap filter at stride 1, whose
 * F(2, 2) takes 3 multiplies for the 2 outputs, and the odd tap g1 over the
 * odd inputs takes 2: 5 where the direct form takes 6. With
 *
 *   B^T d = (d0 - d2, d2, d4 - d2, d1, d3)
 *   G g   = (g0, g0 + g2, g2, g1, g1)
 *   A^T m = (m0 + m1 + m3, m1 + m2 + m4)
 *
 * y = A^T [(G g) . (B^T d)]; in two dimensions each 2x2 block of outputs
 * comes from the 5x5 input tile around it (tiles at stride 4, overlapping by
 * one row and column): y = A^T [ (G g G^T) . (B^T d B) ] A, 25 products per
 * block and input channel where the direct form takes 36. G's last two rows
 * are equal, so the transformed filter has 16 distinct entries (U: 16
 * matrices (O, C)), each shared by the 1, 2 or 4 of the 25 products whose
 * rows and columns map to it. The transforms only add and subtract:
 * every coefficient is 0 or +-1.
 *
 * The gradients are the same algorithm transposed:
 *
 *   dM = A dY A^T                               (5x5 from a 2x2 block of dy)
 *   dx += B [ U_xi^T dM_xi ] B^T                (each tile's, added where it lies)
 *   dU_k = sum over the products xi sharing U_k and the tiles of dM_xi . V_xi^T,
 *   dw = G'^T dU G'                             (G' the 4 distinct rows of G)
 *
 * Results: every output is the same arithmetic in the same order however
 * many threads run; on dpcore's GEMM kernel (each column summed alone) a
 * sample's y and dx depend on that sample alone (with the BLAS the GEMMs'
 * widths follow the batch, and so may their roundings).
 *
 * Layout: the samples in chunks of 16, one per vector lane (each chunk's
 * input transposed to (C, 4*th+1, 4*tw+1, 16), its border the padding's
 * zeros), so that every transform is 16-wide vector arithmetic whatever the
 * plane's size; the products are GEMMs over blocks of tiles. Forward: each
 * thread transforms, multiplies and transforms back its own share of the
 * tiles, a block that fits the L2 cache at a time. Backward, where U is small
 * (at most 2^18 floats) and the batch has 2 chunks or more: each thread takes
 * whole chunks, dw's partials in up to 8 groups of chunks added in group
 * order; else the threads transform a block together, then split the
 * products (dx by input channels, dw's 16 matrices whole).
 *
 * The last chunk's lanes past the batch, and the tiles past an odd plane's
 * edge, are multiplied for nothing: dp_s2_takes takes a layer and batch only
 * where the multiplies stay within 0.8 of the direct form's.
 *
 * The switches: DPCORE_WINOGRAD (winograd.h) "0" turns every Winograd path
 * off; DPCORE_WINOGRAD_S2 "0" this one alone (on by default). Read at every
 * call; "1", "0" or unset/empty, any other value DP_ERR_VALUE.
 *
 * Numerics: every transform coefficient is 0 or +-1, so the error bound has
 * the form of F(2x2, 3x3)'s (tests/test_winograd_s2.py derives and checks it).
 */
#ifndef DP_WINOGRAD_S2_H
#define DP_WINOGRAD_S2_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* *takes = 1 when the switches are on, g is 3x3, stride 2, pad 1 with at
 * least 32 channels in and out, N >= 16, and the multiplies (idle lanes and
 * blocks past the edge included) are at most 0.8 of the direct form's;
 * DP_ERR_VALUE for a malformed switch. */
DP_MUST_CHECK dp_status dp_s2_takes(const dp_conv_geom *g, int64_t N, int *takes);

enum { DP_S2_FORWARD = 0, DP_S2_BACKWARD = 1 };

/* Floats of scratch (64-byte aligned) a pass needs for N samples on nthreads threads. */
size_t dp_s2_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads, int pass);

/* y (N, O, OH, OW) = conv(x, w) + b (b may be NULL) */
DP_MUST_CHECK dp_status dp_s2_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                      const float *b, float *y, int nthreads, float *scratch);

/* dx (may be NULL), dw and db (may be NULL) of y = conv(x, w), from dy */
DP_MUST_CHECK dp_status dp_s2_backward(const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                       const float *dy, float *dx, float *dw, float *db, int nthreads,
                                       float *scratch);

#endif
