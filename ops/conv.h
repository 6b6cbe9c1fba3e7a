#pragma once
// 2-D convolution (torch.nn.functional.conv2d) and the channels_last (NHWC) memory format.
//
// Path from the public op to the kernels (ops/conv.cpp):
//   conv2d                 ->  conv2d_forward_kernel[device]          CPU: im2col + Eigen GEMM (ops/conv.cpp)
//   Conv2dBackward (node)  ->  conv2d_backward_input_kernel[device]   CUDA: cuDNN's graph API, engines autotuned
//                          ->  conv2d_backward_weight_kernel[device]        once per problem, cached (ops/conv.cu)
//                          ->  grad_output.sum({0, 2, 3}) for the bias
//                              (with create_graph: conv2d_backward_input / _weight, which record)
//
// channels_last: halfgrad tensors are strided, so an NHWC tensor is a [N, C, H, W] tensor whose strides are
// [H*W*C, 1, W*C, C]. conv2d keeps the layout of its input: a channels_last input gives a channels_last
// output (and gradient), which on CUDA runs cuDNN's NHWC kernels, the layout tensor cores want.
#include <array>
#include <cstdint>
#include <string>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// (height, width): stride, padding, dilation, kernel and output sizes of 2-D ops.
using Pair2d = std::array<int64_t, 2>;
std::string pair_str(const Pair2d& p);  // "(3, 3)": how error messages and module descriptions print a pair

// ---- memory format (MemoryFormat, is_channels_last, suggest_memory_format: core/tensor.h)

// t laid out as NHWC: itself when already is_channels_last, else a copy (differentiable, like contiguous()).
Tensor contiguous_channels_last(const Tensor& t);
// t laid out in `format` (itself when already so; differentiable): contiguous_channels_last, contiguous_aligned_rows
// (ops/copy.h) or contiguous().
Tensor contiguous(const Tensor& t, MemoryFormat format);
// ---- conv2d

struct Conv2dOptions {
  Pair2d stride = {1, 1};
  Pair2d padding = {0, 0};  // zeros on each side
  Pair2d dilation = {1, 1};
  int64_t groups = 1;
};

// torch.nn.functional.conv2d: input [N, C, H, W] (or unbatched [C, H, W]), weight [O, C/groups, kH, kW],
// bias [O] or undefined (no bias) -> [N, O, OH, OW] with OH = (H + 2 pH - dH (kH - 1) - 1) / sH + 1 (and
// OW likewise). Input, weight and bias must share a floating dtype and a device. The output has the
// input's memory format (suggest_memory_format). Autocast category: "lower precision".
//   conv2d(x, w);                                                  // stride 1, no padding
//   conv2d(x, w, b, {.stride = {2, 2}, .padding = {1, 1}});
//   conv2d(x, w, {}, {.padding = {1, 1}, .groups = 32});           // no bias
// float16/bfloat16 accumulate in float32 on both devices. On CUDA, float32 convolutions may use TF32
// tensor cores (as PyTorch's torch.backends.cudnn.allow_tf32, on by default): set_conv_allow_tf32(false)
// computes in full float32.
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias = Tensor(),
              const Conv2dOptions& options = {});

// The two halves of conv2d's backward pass, as torch.nn.grad.conv2d_input / conv2d_weight. The gradient has the
// memory format suggested by grad_output (input grad) or input (weight grad). Differentiable (each one's backward is
// conv2d and the other): what conv2d's backward runs in a pass with create_graph, so that its gradients can be
// differentiated again, to any order.
Tensor conv2d_backward_input(const Tensor& grad_output, const Tensor& weight, const Shape& input_shape,
                             const Conv2dOptions& options = {});
Tensor conv2d_backward_weight(const Tensor& grad_output, const Tensor& input, const Shape& weight_shape,
                              const Conv2dOptions& options = {});

// Whether float32 convolutions on CUDA may run on TF32 tensor cores (10-bit mantissa products, float32
// accumulation). Default true, as PyTorch's cuDNN setting; cuda::set_allow_tf32 is the separate matmul switch.
void set_conv_allow_tf32(bool allow);
bool conv_allow_tf32();

// Whether a CUDA convolution problem seen for the first time times its candidate engines (ops/conv.cu: the ten
// best-ranked, as PyTorch's cudnn.benchmark_limit) and keeps the fastest
// (default true, as PyTorch's torch.backends.cudnn.benchmark = True), or takes the first candidate whose workspace
// fits (false: no timing): the cuBLAS GEMM for a half 1x1 convolution, else the engine cuDNN's heuristics rank first,
// the choice PyTorch makes by default. Each setting keeps its own choices. bench max-batch searches with it off: each probe's new batch size would otherwise autotune again.
void set_conv_benchmark(bool benchmark);
bool conv_benchmark();

// Whether autotuning (conv_benchmark() on) goes on to search the knobs of the fastest cuDNN engine (its tile and
// cluster shapes, split-K, stages, which cuDNN's heuristics leave partly to the engine) and keeps a setting that
// computes the same result in at least `required_gain` less time (ops/conv.cu, search_knobs). On by default: on an
// H200 it took 9 of ResNet-18's 34 problems (b256 float16) and its step from 3.47 to 3.44 ms, for ~0.6 s more in the
// first step; on an H100 ResNet-50's from 13.97 to 13.88 ms, for ~1.5 s (at most 256 settings a problem;
// docs/benchmarks.md). Choices made with the search are
// cached apart from those made without it (each problem's first choice under the search is kept, whatever
// required_gain is later). A required_gain below 0 takes a slower setting too (the tests use it to run one). Run with
// HALFGRAD_LOG=debug to see each search.
struct ConvKnobSearch {
  bool enabled = true;
  double required_gain = 0.02;  // a share of the engine's own time, < 1
};
void set_conv_knob_search(const ConvKnobSearch& search);
ConvKnobSearch conv_knob_search();

// One spatial dim of the output: (in + 2 pad - dilation (kernel - 1) - 1) / stride + 1; may be <= 0,
// which callers report as an error.
int64_t conv_output_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation);

// ---- kernels (core/dispatch.h)
// Every tensor is 4-D and dense in the same memory format (all NCHW-contiguous or all channels_last; the
// op layer arranges that) and of one floating dtype; `out` / `grad_*` are written, never read. bias is
// undefined or a contiguous [O]. Shapes are consistent with the params (the op layer checked them).
struct Conv2dParams {
  Pair2d stride = {1, 1};
  Pair2d padding = {0, 0};
  Pair2d dilation = {1, 1};
  int64_t groups = 1;
  bool allow_tf32 = true;  // float32 on CUDA only
};

using Conv2dForwardKernel = void (*)(const Tensor& out, const Tensor& input, const Tensor& weight,
                                     const Tensor& bias, const Conv2dParams& params);
// accumulate: grad_input holds a gradient already, and the kernel adds the input's gradient into it (GradContext::
// accumulated: cuDNN's beta = 1, a GEMM's beta = 1) instead of writing it.
using Conv2dBackwardInputKernel = void (*)(const Tensor& grad_input, const Tensor& grad_output,
                                           const Tensor& weight, const Conv2dParams& params, bool accumulate);
using Conv2dBackwardWeightKernel = void (*)(const Tensor& grad_weight, const Tensor& grad_output,
                                            const Tensor& input, const Conv2dParams& params);

extern KernelTable<Conv2dForwardKernel> conv2d_forward_kernel;
extern KernelTable<Conv2dBackwardInputKernel> conv2d_backward_input_kernel;
extern KernelTable<Conv2dBackwardWeightKernel> conv2d_backward_weight_kernel;

// ---- pointwise convolutions as matrix products (for the kernels of both devices; ops/conv.cpp)
// A 1x1 convolution with stride 1, no padding and one group is a GEMM through gemm_kernel[device]
// (ops/matmul.h): in NHWC, y [N*H*W, O] = x [N*H*W, C] w^T; in NCHW, one product per sample,
// y[n] [O, H*W] = w [O, C] x[n] [C, H*W], as one strided-batched GEMM. Operands as the kernels above get
// them; no bias. An operand that is dense in both layouts (C == 1 or H == W == 1) has the same memory either
// way. The weight gradient is a single GEMM only in NHWC (dw = dy^T x over all N*H*W rows):
// conv2d_pointwise_backward_weight requires is_channels_last operands.
bool conv2d_is_pointwise(const Shape& weight_shape, const Conv2dParams& params);
void conv2d_pointwise_forward(const Tensor& out, const Tensor& input, const Tensor& weight);
void conv2d_pointwise_backward_input(const Tensor& grad_input, const Tensor& grad_output, const Tensor& weight,
                                     bool accumulate = false);
void conv2d_pointwise_backward_weight(const Tensor& grad_weight, const Tensor& grad_output, const Tensor& input);

}  // namespace halfgrad
