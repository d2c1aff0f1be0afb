/* cudnn_shapes.c — cuDNN's own shape inference for dpcore's convolutions.
 *
 * The CUDA backend describes every convolution to cuDNN with these same
 * descriptors (NCHW float32 tensors, a KCRS filter, cross-correlation, which
 * is what PyTorch and dpcore's CPU backend compute). Descriptor creation and
 * cudnnGetConvolution2dForwardOutputDim need no GPU and no cudnnHandle, so
 * the CPU test suite checks, for every convolution of LeNet and ResNet-18,
 * that cuDNN infers the output shape dpcore computes.
 * Reference: cuDNN API, cudnnSetConvolution2dDescriptor (pad, stride,
 * dilation; mode CUDNN_CROSS_CORRELATION) and
 * cudnnGetConvolution2dForwardOutputDim (outputDim = 1 + (in + 2*pad -
 * ((filter - 1)*dilation + 1)) / stride).
 */
#include "cudnn_shapes.h"

#include "backend.h"
#include "cuda_check.h"

#ifdef DP_HAVE_CUDNN

void dp_cudnn_conv_descs_destroy(dp_cudnn_conv_descs *d) {
  if (d->x) cudnnDestroyTensorDescriptor(d->x);
  if (d->y) cudnnDestroyTensorDescriptor(d->y);
  if (d->w) cudnnDestroyFilterDescriptor(d->w);
  if (d->conv) cudnnDestroyConvolutionDescriptor(d->conv);
  d->x = d->y = NULL;
  d->w = NULL;
  d->conv = NULL;
}

dp_status dp_cudnn_conv_descs_make(const dp_conv_geom *g, int N, dp_cudnn_conv_descs *d) {
  DP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d->x));
  DP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d->y));
  DP_CUDNN_CHECK(cudnnCreateFilterDescriptor(&d->w));
  DP_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&d->conv));
  DP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d->x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, g->C, g->H, g->W));
  DP_CUDNN_CHECK(cudnnSetFilter4dDescriptor(d->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, g->O, g->C, g->KH, g->KW));
  DP_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(d->conv, g->pad, g->pad, g->stride, g->stride, 1, 1,
                                                 CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  /* float32 results comparable with the CPU backend: CUDNN_FMA_MATH restricts
   * cuDNN to FMA kernels, while CUDNN_DEFAULT_MATH permits TF32 tensor cores
   * on Ampere and newer (cuDNN API reference, cudnnMathType_t). */
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(d->conv, CUDNN_FMA_MATH));
  int n, c, h, w;
  DP_CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(d->conv, d->x, d->w, &n, &c, &h, &w));
  DP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d->y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c, h, w));
  return DP_OK;
}

dp_status dp_cudnn_conv_output_dim(const dp_conv_geom *g, int N, int out[4]) {
  dp_cudnn_conv_descs d = {0};
  dp_status st = dp_cudnn_conv_descs_make(g, N, &d);
  if (st == DP_OK) {
    /* read back the output descriptor the backend would use */
    cudnnDataType_t type;
    int ns, cs, hs, ws;
    cudnnStatus_t s = cudnnGetTensor4dDescriptor(d.y, &type, &out[0], &out[1], &out[2], &out[3], &ns, &cs, &hs, &ws);
    if (s != CUDNN_STATUS_SUCCESS)
      st = DP_FAIL(DP_ERR_CUDA, "cudnnGetTensor4dDescriptor failed: %s (%d)", cudnnGetErrorString(s), (int)s);
  }
  dp_cudnn_conv_descs_destroy(&d);
  return st;
}

size_t dp_cudnn_version(void) { return cudnnGetVersion(); }

#else

dp_status dp_cudnn_conv_output_dim(const dp_conv_geom *g, int N, int out[4]) {
  (void)g;
  (void)N;
  (void)out;
  return DP_FAIL(DP_ERR_UNSUPPORTED, "dpcore was built without cuDNN");
}

size_t dp_cudnn_version(void) { return 0; }

#endif
