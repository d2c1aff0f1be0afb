/* layers.h — the layer kinds, as one table (layers.c).
 *
 * Per kind: its name (the first item of a dp.models layer tuple), its
 * arguments (names, types, defaults), its shape inference (64-bit, checked by
 * shapes.c), its tensors (PyTorch's state_dict names, buffer, shape and
 * init rule), and how it joins its sources, splits over devices and views its
 * input. The model builds layers from it (dp_model_add_layer), the binding
 * parses layer tuples and reports layouts and shapes from it, and the Python
 * package reads it through _core.layer_kinds() and _core.layer_shapes()
 * (initialisation, checkpoints, pipeline and layerwise splits) and names no
 * kind itself.
 *
 * A new kind is an enum value here, its entry in the table, and its forward
 * and backward in model.c over the backend's kernels
 * (tests/test_layer_kinds.py lists these sites).
 */
#ifndef DP_LAYERS_H
#define DP_LAYERS_H

#include <stdint.h>

#include "dp_status.h"

typedef enum dp_layer_kind {
  DP_LAYER_CONV2D,
  DP_LAYER_DENSE,
  DP_LAYER_RELU,
  DP_LAYER_AVGPOOL,
  DP_LAYER_MAXPOOL,
  DP_LAYER_FLATTEN,
  DP_LAYER_BATCHNORM,
  DP_LAYER_ADD,            /* output = source + source2 */
  DP_LAYER_GLOBAL_AVGPOOL  /* (C, H, W) -> (C, 1, 1) */
} dp_layer_kind;
/* Not an enumerator, so that a switch over the kinds (model.c's forward and
 * backward) is warned about (-Wswitch) for a kind it misses and for no other. */
#define DP_LAYER_KIND_COUNT (DP_LAYER_GLOBAL_AVGPOOL + 1)

typedef struct dp_layer {
  dp_layer_kind kind;
  int src, src2;            /* producing layers (-1: the model input); src2 for add only */
  int in_c, in_h, in_w;     /* per-sample input shape (dense: in_c features, h = w = 1) */
  int out_c, out_h, out_w;  /* per-sample output shape */
  int k, stride, pad;       /* conv (square kernel) and pooling */
  /* into the flat buffers: the kind's first parameter tensor at w_off, its
   * second at b_off (w_len == 0: no parameters); its state tensors one after
   * another from state_off (dp_layer_tensor_offset) */
  int64_t w_off, w_len;     /* batchnorm: w = gamma, b = beta */
  int64_t b_off, b_len;
  int64_t state_off;        /* batchnorm: running mean (C) then running var (C) in m->state */
  float eps, momentum;      /* batchnorm */
  int fused;                /* set by dp_model_finalize: a relu whose one reader, the next layer, is an
                             * avgpool, or a batchnorm or an add whose one reader, the next layer, is a
                             * relu; the two run as one op (backend.h: relu_avgpool_forward,
                             * bn_apply_relu, add_relu) */
} dp_layer;

#define DP_LAYER_MAX_ARGS 4
#define DP_LAYER_MAX_TENSORS 4
#define DP_LAYER_MAX_PARAM_TENSORS 2 /* w_off and b_off */

typedef enum dp_layer_arg_type {
  DP_ARG_INT,   /* int64: the layer checks the range it supports, naming the argument */
  DP_ARG_FLOAT  /* double, stored as float */
} dp_layer_arg_type;

typedef union dp_layer_arg_value {
  int64_t i;
  double f;
} dp_layer_arg_value;

typedef struct dp_layer_arg {
  const char *name;  /* "padding": how errors and dp.models name it */
  dp_layer_arg_type type;
  int optional;      /* 1: may be left out, and then is `fallback` */
  dp_layer_arg_value fallback;
} dp_layer_arg;

typedef enum dp_layer_buffer { DP_BUFFER_PARAMS, DP_BUFFER_STATE } dp_layer_buffer;

/* The extents a tensor's shape is made of. */
typedef enum dp_layer_dim { DP_DIM_OUT_C, DP_DIM_IN_C, DP_DIM_K, DP_DIM_COUNT } dp_layer_dim;

/* How a tensor starts, under each of dp.models' init modes. fan_in is the
 * layer's first tensor's size over its first extent (PyTorch's fan_in). */
typedef enum dp_init_rule {
  DP_INIT_ZEROS,
  DP_INIT_ONES,
  DP_INIT_NORMAL,          /* N(0, init_std) */
  DP_INIT_FAN_IN_UNIFORM,  /* U(-1/sqrt(fan_in), 1/sqrt(fan_in)): PyTorch's default for conv and linear */
  DP_INIT_RULE_COUNT
} dp_init_rule;

/* normal: the book's N(0, init_std) weights, zero biases (d2l 12.5's LeNet); torch: PyTorch's
 * defaults; d2l: PyTorch's modules re-initialised as d2l 12.6's train() does (weights N(0, init_std),
 * biases PyTorch's) */
typedef enum dp_init_mode { DP_INIT_MODE_NORMAL, DP_INIT_MODE_TORCH, DP_INIT_MODE_D2L, DP_INIT_MODE_COUNT } dp_init_mode;

typedef struct dp_layer_tensor {
  const char *name;         /* PyTorch's state_dict suffix: "weight", "running_var" */
  dp_layer_buffer buffer;
  int rank;
  dp_layer_dim dims[4];
  dp_init_rule init[DP_INIT_MODE_COUNT];  /* state tensors: the same rule in every mode */
} dp_layer_tensor;

/* How a layerwise split (ModelParallelStrategy, python/dpcore/tensor_parallel.py)
 * runs a kind over k devices. */
typedef enum dp_layer_split {
  DP_SPLIT_NONE,     /* not split: a view or a join (below), done on the gathered activations */
  DP_SPLIT_OUTPUT,   /* its first argument and its tensors' first extent are its output channels: each device
                      * computes a slice of them from the whole input */
  DP_SPLIT_CHANNELS  /* acts on each channel alone: each device runs it on its slice of the channels */
} dp_layer_split;

/* What a kind that reads several sources makes of them. */
typedef enum dp_layer_join {
  DP_JOIN_NONE,  /* one source */
  DP_JOIN_SUM    /* the elementwise sum of its sources (of one shape); each source's gradient is the output's */
} dp_layer_join;

typedef struct dp_layer_kind_info {
  const char *name;  /* the layer tuple's first item: "avgpool" */
  const char *op;    /* the single op it computes (dp.ops), which its errors name: "avg_pool2d" */
  int nargs;
  dp_layer_arg args[DP_LAYER_MAX_ARGS];
  /* how many leading arguments are layer indices (-1: the model input) that
   * it reads; 0: it reads the layer chosen by dp_model_set_source */
  int sources;
  dp_layer_join joins;
  dp_layer_split split;
  /* 1: its output is its source's memory seen in its own shape (no copy,
   * nothing of its own to allocate); its gradient is the output's, reshaped */
  int view;
  /* 1: in training it normalises each channel with its batch's statistics,
   * which needs more than one value per channel (dp_model_check_batchnorm_batch) */
  int batch_stats;
  int ntensors;
  dp_layer_tensor tensors[DP_LAYER_MAX_TENSORS]; /* parameters first, then state */
  /* Sets l's output shape and its kind's fields from args (all nargs of
   * them: defaults filled in). l's input shape is set; in2 is the second
   * source's shape (C, H, W) when sources == 2, else NULL. Errors start with
   * `what`, "conv2d (layer 3)", and name the argument or size at fault. */
  DP_MUST_CHECK dp_status (*infer)(dp_layer *l, const dp_layer_arg_value *args, const int *in2, const char *what);
} dp_layer_kind_info;

const char *dp_layer_split_name(dp_layer_split s); /* "output", "channels", NULL */
const char *dp_layer_join_name(dp_layer_join j);    /* "sum", NULL */
/* The table entry of kind k (k < DP_LAYER_KIND_COUNT). */
const dp_layer_kind_info *dp_layer_kind_info_of(dp_layer_kind k);
/* The kind named name, or -1. */
int dp_layer_kind_find(const char *name);
const char *dp_layer_dim_name(dp_layer_dim d);
const char *dp_init_rule_name(dp_init_rule r);
const char *dp_init_mode_name(dp_init_mode m);
/* The extent d of layer l. */
int64_t dp_layer_dim_of(const dp_layer *l, dp_layer_dim d);
/* out[0..nargs of kind k) = args[0..nargs), then the defaults of the
 * arguments left out; DP_ERR_VALUE, naming them, for a count kind k does not take. */
DP_MUST_CHECK dp_status dp_layer_args_fill(dp_layer_kind k, const char *what, const dp_layer_arg_value *args, int nargs,
                                           dp_layer_arg_value out[DP_LAYER_MAX_ARGS]);
/* The values of tensor t of layer l (the product of its extents). */
int64_t dp_layer_tensor_size(const dp_layer *l, int t);
/* Where tensor t of a laid-out layer l starts in its buffer (params or state). */
int64_t dp_layer_tensor_offset(const dp_layer *l, int t);

#endif
