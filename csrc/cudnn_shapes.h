/* cudnn_shapes.h — the cuDNN descriptors of one dpcore convolution of N
 * samples (csrc/cudnn_shapes.c). Built without a handle or a GPU; the CUDA
 * backend plans every convolution with them. */
#ifndef DP_CUDNN_SHAPES_H
#define DP_CUDNN_SHAPES_H

#ifdef DP_HAVE_CUDNN
#include "backend.h"
#include "cuda_check.h"

typedef struct dp_cudnn_conv_descs {
  cudnnTensorDescriptor_t x;           /* (N, C, H, W) NCHW float */
  cudnnTensorDescriptor_t y;           /* (N, O, OH, OW), as cuDNN infers it */
  cudnnFilterDescriptor_t w;           /* (O, C, KH, KW) KCRS float */
  cudnnConvolutionDescriptor_t conv;   /* cross-correlation, FMA math (no TF32) */
} dp_cudnn_conv_descs;

/* On failure the descriptors made so far stay in d: call destroy either way. */
DP_MUST_CHECK dp_status dp_cudnn_conv_descs_make(const dp_conv_geom *g, int N, dp_cudnn_conv_descs *d);
void dp_cudnn_conv_descs_destroy(dp_cudnn_conv_descs *d);
#endif

#endif
