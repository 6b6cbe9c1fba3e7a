#pragma once
// 2-D pooling: max_pool2d, avg_pool2d, adaptive_avg_pool2d (torch.nn.functional semantics), forward and
// backward, on CPU (ops/pool.cpp, OpenMP over the N*C planes) and CUDA (ops/pool.cu, one thread per
// output element for the forward and per input element for the backward: gathers, no atomics; max pooling over
// windows that tile a channels-last input, a thread per output position and 16-byte vector of channels).
//
// Inputs are [N, C, H, W] or unbatched [C, H, W], of a floating dtype, in any strided layout; the output
// has the input's memory format (a channels_last input gives a channels_last output, ops/conv.h).
// float16/bfloat16 sums are accumulated in float32. Autocast category of all three: "unchanged".
#include <cstdint>
#include <optional>
#include <utility>

#include "core/dispatch.h"
#include "core/tensor.h"
#include "ops/conv.h"  // Pair2d, MemoryFormat

namespace halfgrad {

struct MaxPool2dOptions {
  Pair2d stride = {0, 0};  // {0, 0}: the kernel size (PyTorch's stride=None)
  Pair2d padding = {0, 0};  // implicit -inf on each side; at most half the kernel size
  Pair2d dilation = {1, 1};
  bool ceil_mode = false;  // round the output size up (windows that start inside the input or left padding)
};

struct AvgPool2dOptions {
  Pair2d stride = {0, 0};  // {0, 0}: the kernel size
  Pair2d padding = {0, 0};  // implicit zeros on each side; at most half the kernel size
  bool ceil_mode = false;
  bool count_include_pad = true;  // divide by the window size including padding (PyTorch's default)
  std::optional<int64_t> divisor_override = std::nullopt;  // where given, every window's sum is divided by it (not 0)
};

// Maximum over each kernel window:
//   max_pool2d(x, {2, 2});                                       // stride 2
//   max_pool2d(x, {3, 3}, {.stride = {2, 2}, .padding = {1, 1}});
// The gradient goes to the window's maximum: the first one on ties; a nan is the maximum when present, the last nan of
// several (as PyTorch's CPU and CUDA kernels pick).
// For its backward it keeps where each maximum lies within its window, one byte an output element (windows of up to
// kMaxWindowPositions elements), where the flat indices of max_pool2d_with_indices take eight: at VGG16's first
// pooling at batch 2048 that is 34 MB to write and read back instead of 268.
Tensor max_pool2d(const Tensor& input, Pair2d kernel_size, const MaxPool2dOptions& options = {});
// Also returns where each maximum came from: int64, index h * W + w within its [H, W] plane (PyTorch's
// return_indices=True convention).
std::pair<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, Pair2d kernel_size,
                                                  const MaxPool2dOptions& options = {});

// Mean over each kernel window. With count_include_pad the divisor is the window's size clipped to the
// padded input; without, the number of input elements it covers; divisor_override replaces both.
Tensor avg_pool2d(const Tensor& input, Pair2d kernel_size, const AvgPool2dOptions& options = {});

// Mean over windows that tile the input into output_size cells (PyTorch's rule: cell o of n covers input
// rows [floor(o * H / n), ceil((o + 1) * H / n)) ). adaptive_avg_pool2d(x, {1, 1}) is global average pooling.
Tensor adaptive_avg_pool2d(const Tensor& input, Pair2d output_size);

// One spatial dim of a pooling output (PyTorch's pooling_output_shape): may be <= 0, which callers reject.
int64_t pool_output_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation, bool ceil_mode);

// ---- kernels (core/dispatch.h)
// All tensors are 4-D [N, C, H, W] (indices and outputs [N, C, OH, OW]) of one floating dtype (indices:
// int64 or uint8, below) and may have any strides; outputs are written, never read. A kernel walks its outputs in
// the order of their memory format (is_channels_last), so that neighbouring threads touch neighbouring memory.
struct Pool2dParams {
  Pair2d kernel = {1, 1};
  Pair2d stride = {1, 1};
  Pair2d padding = {0, 0};
  Pair2d dilation = {1, 1};
  bool count_include_pad = true;  // avg only
  int64_t divisor_override = 0;    // avg only: where nonzero, the divisor of every window
};

// What max pooling's kernels write into `indices` and its backward reads, by the tensor's dtype:
//   int64  the flat index ih * W + iw of each maximum in its input plane (max_pool2d_with_indices' result)
//   uint8  its position within the window, kh * kernel_w + kw (max_pool2d's own record for its backward), or
//          kNoWindowPosition where the window holds no input element (padding and dilation can leave one empty;
//          its output is -inf, as where the flat index is -1)
constexpr int64_t kMaxWindowPositions = 255;  // window elements, positions 0 to 254
constexpr uint8_t kNoWindowPosition = 255;

// Along dim d (0: rows, 1: columns) of a window `p` (Pool2dParams, or the CUDA kernels' copy of its numbers): the
// input index of window offset k of output o, and of the element at window position `position` (kh * kernel_w + kw).
// Max pooling's forward visits the window by the first and its backward decodes its record by the second, on every
// device.
template <typename I, typename P> HG_HOST_DEVICE inline I window_input(const P& p, int d, I o, I k) {
  return o * I(p.stride[d]) - I(p.padding[d]) + k * I(p.dilation[d]);
}
template <typename I, typename P> HG_HOST_DEVICE inline I window_position_input(const P& p, int d, I o, I position) {
  const I kernel_w = I(p.kernel[1]);
  return window_input(p, d, o, d == 0 ? position / kernel_w : position % kernel_w);
}
// Calls f.template operator()<S>() with S the C++ type of `indices`: int64_t or uint8_t.
template <typename F> void dispatch_max_pool_indices(const Tensor& indices, F&& f) {
  if (indices.dtype() == kUInt8)
    f.template operator()<uint8_t>();
  else
    f.template operator()<int64_t>();
}

using MaxPool2dKernel = void (*)(const Tensor& out, const Tensor& indices, const Tensor& input,
                                 const Pool2dParams& params);
// grad_input[n, c, i] = sum of grad_output[n, c, o] over the outputs o whose maximum lies at i.
using MaxPool2dBackwardKernel = void (*)(const Tensor& grad_input, const Tensor& grad_output, const Tensor& indices,
                                         const Pool2dParams& params);
// out[n, c, o] = source[n, c, i] where output o's maximum lies at i, 0 where its window held no input element: the
// transpose of the backward, which is its backward in a pass with create_graph (and the other way round).
using MaxPool2dGatherKernel = void (*)(const Tensor& out, const Tensor& source, const Tensor& indices,
                                       const Pool2dParams& params);
using AvgPool2dKernel = void (*)(const Tensor& out, const Tensor& input, const Pool2dParams& params);
using AvgPool2dBackwardKernel = void (*)(const Tensor& grad_input, const Tensor& grad_output,
                                         const Pool2dParams& params);
using AdaptiveAvgPool2dKernel = void (*)(const Tensor& out, const Tensor& input);
using AdaptiveAvgPool2dBackwardKernel = void (*)(const Tensor& grad_input, const Tensor& grad_output);

extern KernelTable<MaxPool2dKernel> max_pool2d_kernel;
extern KernelTable<MaxPool2dBackwardKernel> max_pool2d_backward_kernel;
extern KernelTable<MaxPool2dGatherKernel> max_pool2d_gather_kernel;
extern KernelTable<AvgPool2dKernel> avg_pool2d_kernel;
extern KernelTable<AvgPool2dBackwardKernel> avg_pool2d_backward_kernel;
extern KernelTable<AdaptiveAvgPool2dKernel> adaptive_avg_pool2d_kernel;
extern KernelTable<AdaptiveAvgPool2dBackwardKernel> adaptive_avg_pool2d_backward_kernel;

// The window of output cell o among n over an input of size `in` (adaptive pooling): [start, end).
// (templates: the CUDA kernels compute them in 32 bits where the products fit)
template <typename I> HG_HOST_DEVICE inline I adaptive_start(I o, I in, I n) { return (o * in) / n; }
template <typename I> HG_HOST_DEVICE inline I adaptive_end(I o, I in, I n) { return ((o + 1) * in + n - 1) / n; }

// The window of avg_pool2d's output o along one dim: the input range [start, end) it averages and the size
// count_include_pad divides by (the window clipped to the padded input, as PyTorch).
struct AvgWindow {
  int64_t start, end, padded_size;
};
HG_HOST_DEVICE inline AvgWindow avg_window(int64_t o, int64_t in, int64_t kernel, int64_t stride, int64_t pad) {
  int64_t start = o * stride - pad;
  int64_t end = start + kernel < in + pad ? start + kernel : in + pad;
  const int64_t padded_size = end - start;
  start = start > 0 ? start : 0;
  end = end < in ? end : in;
  return {start, end, padded_size};
}
// What avg_pool2d divides the sum of the window h x w by, on every device (0 only for a window of no element
// without count_include_pad, whose output is 0).
HG_HOST_DEVICE inline int64_t avg_divisor(const Pool2dParams& p, const AvgWindow& h, const AvgWindow& w) {
  if (p.divisor_override != 0) return p.divisor_override;
  return p.count_include_pad ? h.padded_size * w.padded_size : (h.end - h.start) * (w.end - w.start);
}

}  // namespace halfgrad
