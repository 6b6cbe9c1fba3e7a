// conv2d on CUDA through cuDNN: forward (cudnnConvolutionForward), backward data and backward filter.
//
//   algorithms   benchmarked once per problem with cudnnFind*AlgorithmEx (every algorithm run on the real
//                buffers, the fastest that fits the workspace kept) and cached in a map keyed by the whole
//                problem: device, dtype, layout, all sizes, stride/padding/dilation/groups, math mode
//   workspace    a uint8 tensor from the caching allocator (no cudaMalloc per call)
//   half         float16/bfloat16 on tensor cores (CUDNN_TENSOR_OP_MATH), accumulated in float32 (compute
//                type float); float32 may use TF32 tensor cores when conv_allow_tf32(), else FMA only
//   layouts      NCHW or NHWC descriptors (the op layer hands dense operands of one format); NHWC is what
//                the tensor-core kernels read natively. float64 NHWC problems run in NCHW (cuDNN has no
//                algorithms for them).
//   pointwise    float16/bfloat16 1x1 convolutions with stride 1 are cuBLAS GEMMs instead (ops/conv.h,
//                conv2d_pointwise_*), except the NCHW weight gradient, which is no single GEMM
//
// The bias is added with cudnnAddTensor; its gradient is a sum over (N, H, W) done by the op layer.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <climits>
#include <string>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/autograd.h"
#include "core/cuda.h"
#include "ops/conv.h"
#include "ops/copy.h"
#include "ops/elementwise.h"

namespace halfgrad {
namespace {

// ---- the cuDNN handle: one per (device, host thread), created on first use, bound to the current stream
// at each use. core/cuda.h has no cuDNN handle (only cuBLAS's); this is conv's own. Handles are never
// destroyed: at process exit the CUDA context may already be gone.
cudnnHandle_t cudnn_handle(int device) {
  thread_local std::unordered_map<int, cudnnHandle_t> handles;
  auto it = handles.find(device);
  if (it == handles.end()) {
    cudnnHandle_t handle = nullptr;
    HG_CUDNN_CHECK(cudnnCreate(&handle), "conv2d");
    it = handles.emplace(device, handle).first;
  }
  HG_CUDNN_CHECK(cudnnSetStream(it->second, cuda::current_stream(device)), "conv2d");
  return it->second;
}

cudnnDataType_t cudnn_type(DType t) {
  switch (t) {
    case DType::Float16: return CUDNN_DATA_HALF;
    case DType::BFloat16: return CUDNN_DATA_BFLOAT16;
    case DType::Float32: return CUDNN_DATA_FLOAT;
    case DType::Float64: return CUDNN_DATA_DOUBLE;
    default: throw_unsupported_dtype("conv2d (cuda)", t);
  }
}

// ---- descriptors (RAII)

struct TensorDesc {
  cudnnTensorDescriptor_t desc = nullptr;
  // A dense 4-D tensor in NCHW or NHWC (size-1 dims' strides do not matter for a dense tensor).
  TensorDesc(const Tensor& t, bool nhwc) {
    HG_CUDNN_CHECK(cudnnCreateTensorDescriptor(&desc), "conv2d");
    HG_CUDNN_CHECK(cudnnSetTensor4dDescriptor(desc, nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                              cudnn_type(t.dtype()), int(t.size(0)), int(t.size(1)),
                                              int(t.size(2)), int(t.size(3))),
                   "conv2d");
  }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(desc); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
};

struct FilterDesc {
  cudnnFilterDescriptor_t desc = nullptr;
  FilterDesc(const Tensor& w, bool nhwc) {
    HG_CUDNN_CHECK(cudnnCreateFilterDescriptor(&desc), "conv2d");
    HG_CUDNN_CHECK(cudnnSetFilter4dDescriptor(desc, cudnn_type(w.dtype()), nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                              int(w.size(0)), int(w.size(1)), int(w.size(2)), int(w.size(3))),
                   "conv2d");
  }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(desc); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
};

// The math mode the problem may use: tensor cores for the half types; TF32 or strict FMA for float32.
cudnnMathType_t math_type(DType t, bool allow_tf32) {
  if (t == kFloat16 || t == kBFloat16) return CUDNN_TENSOR_OP_MATH;
  if (t == kFloat32) return allow_tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
  return CUDNN_DEFAULT_MATH;
}

struct ConvDesc {
  cudnnConvolutionDescriptor_t desc = nullptr;
  ConvDesc(const Conv2dParams& p, DType dtype) {
    HG_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&desc), "conv2d");
    // Products of float16/bfloat16 (and float32) operands accumulate in float32; float64 in float64.
    const cudnnDataType_t compute = dtype == kFloat64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    HG_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(desc, int(p.padding[0]), int(p.padding[1]), int(p.stride[0]),
                                                   int(p.stride[1]), int(p.dilation[0]), int(p.dilation[1]),
                                                   CUDNN_CROSS_CORRELATION, compute),
                   "conv2d");
    HG_CUDNN_CHECK(cudnnSetConvolutionGroupCount(desc, int(p.groups)), "conv2d");
    HG_CUDNN_CHECK(cudnnSetConvolutionMathType(desc, math_type(dtype, p.allow_tf32)), "conv2d");
  }
  ~ConvDesc() { cudnnDestroyConvolutionDescriptor(desc); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
};

// ---- one problem: the operands' descriptors, built once per call

// NHWC only (a tensor with C == 1 or H == W == 1 is dense in both layouts and may be described as either).
bool strictly_channels_last(const Tensor& t) { return is_channels_last(t) && !t.is_contiguous(); }

struct Problem {
  const char* op;
  int device;
  bool nhwc;
  DType dtype;
  Conv2dParams params;
  // x [N, C, H, W], w [O, C/g, kH, kW], y [N, O, OH, OW]: the forward's roles, whichever is being computed.
  TensorDesc x, y;
  FilterDesc w;
  ConvDesc conv;
  std::array<int64_t, 20> key;
  const Tensor& input_;  // for error messages (the problem lives only during the call)
  const Tensor& weight_;
  const Tensor& output_;

  Problem(const char* op_name, const Tensor& input, const Tensor& weight, const Tensor& output, const Conv2dParams& p)
      : op(op_name),
        device(input.device().index),
        // The op layer hands all operands dense in one format: NHWC if any of them is NHWC only.
        nhwc(strictly_channels_last(input) || strictly_channels_last(weight) || strictly_channels_last(output)),
        dtype(input.dtype()),
        params(p),
        x(input, nhwc),
        y(output, nhwc),
        w(weight, nhwc),
        conv(p, input.dtype()),
        key{device, int64_t(dtype), int64_t(nhwc), input.size(0), input.size(1), input.size(2), input.size(3),
            weight.size(0), weight.size(2), weight.size(3), p.stride[0], p.stride[1], p.padding[0], p.padding[1],
            p.dilation[0], p.dilation[1], p.groups, int64_t(math_type(input.dtype(), p.allow_tf32)), 0, 0},
        input_(input),
        weight_(weight),
        output_(output) {}

  std::string str() const {
    return fmt::format("input {}, weight {}, output {}, stride ({}, {}), padding ({}, {}), dilation ({}, {}), "
                       "groups {}, layout {}", input_.meta(), weight_.meta(), output_.meta(), params.stride[0],
                       params.stride[1], params.padding[0], params.padding[1], params.dilation[0], params.dilation[1],
                       params.groups, nhwc ? "NHWC" : "NCHW");
  }
};

// The legacy cuDNN API takes int sizes, and its kernels index with 32-bit offsets.
void check_sizes(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    HG_CHECK(t->numel() <= INT_MAX,
             "{} (cuda): {} has more than 2^31 - 1 elements, which cuDNN's convolutions do not take; split the "
             "batch", op, t->meta());
  }
}

// ---- algorithm choice: benchmarked once per problem, then cached

struct Choice {
  int algo = 0;
  size_t workspace = 0;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
};

template <typename Perf> struct AlgoCache {
  std::mutex mutex;
  std::map<std::array<int64_t, 20>, Choice> choices;

  bool find(const std::array<int64_t, 20>& key, Choice& out) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = choices.find(key);
    if (it == choices.end()) return false;
    out = it->second;
    return true;
  }
  void insert(const std::array<int64_t, 20>& key, const Choice& c) {
    std::lock_guard<std::mutex> lock(mutex);
    choices[key] = c;
  }
};

AlgoCache<cudnnConvolutionFwdAlgoPerf_t> forward_cache;
AlgoCache<cudnnConvolutionBwdDataAlgoPerf_t> backward_data_cache;
AlgoCache<cudnnConvolutionBwdFilterAlgoPerf_t> backward_filter_cache;

// A workspace of up to `bytes` from the caching allocator; when that much is not available, the largest
// power-of-two fraction of it that is (the benchmark then skips the algorithms that need more).
Tensor workspace_up_to(size_t bytes, Device device, size_t& got) {
  got = bytes;
  while (got > 0) {
    try {
      return empty({int64_t(got)}, {.dtype = kUInt8, .device = device});
    } catch (const OutOfMemory&) {
      got /= 2;
    }
  }
  return Tensor();
}

Tensor workspace(size_t bytes, Device device) {
  if (bytes == 0) return Tensor();
  return empty({int64_t(bytes)}, {.dtype = kUInt8, .device = device});
}

void* data_of(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// The fastest algorithm that ran successfully; its own math mode (cuDNN may report a narrower one than
// the descriptor allowed) is kept with it.
template <typename Perf> Choice best_of(const std::vector<Perf>& perf, int returned, const Problem& pb) {
  for (int i = 0; i < returned; ++i) {
    const Perf& p = perf[size_t(i)];
    if (p.status != CUDNN_STATUS_SUCCESS) continue;
    // Strict float32: never accept a result obtained on tensor cores.
    if (pb.dtype == kFloat32 && !pb.params.allow_tf32 && p.mathType == CUDNN_TENSOR_OP_MATH) continue;
    return Choice{int(p.algo), p.memory, p.mathType};
  }
  HG_FAIL("{} (cuda): cuDNN found no algorithm that runs for {} ({} tried)", pb.op, pb.str(), returned);
}

// Scaling factors: float for float/half/bfloat16 data, double for double.
struct Scalars {
  float f_one = 1, f_zero = 0;
  double d_one = 1, d_zero = 0;
  bool is_double;
  explicit Scalars(DType t) : is_double(t == kFloat64) {}
  const void* one() const { return is_double ? static_cast<const void*>(&d_one) : &f_one; }
  const void* zero() const { return is_double ? static_cast<const void*>(&d_zero) : &f_zero; }
};

// ---- forward

Choice forward_algorithm(cudnnHandle_t handle, const Problem& pb, const Tensor& x, const Tensor& w, const Tensor& y) {
  Choice choice;
  if (forward_cache.find(pb.key, choice)) return choice;
  size_t most = 0;
  for (int a = 0; a < CUDNN_CONVOLUTION_FWD_ALGO_COUNT; ++a) {
    size_t bytes = 0;
    if (cudnnGetConvolutionForwardWorkspaceSize(handle, pb.x.desc, pb.w.desc, pb.conv.desc, pb.y.desc,
                                                cudnnConvolutionFwdAlgo_t(a), &bytes) == CUDNN_STATUS_SUCCESS)
      most = std::max(most, bytes);
  }
  size_t got = 0;
  Tensor ws = workspace_up_to(most, x.device(), got);
  int count = 0, returned = 0;
  HG_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(handle, &count), pb.op);
  std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(size_t(std::max(count, 1)));
  HG_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(handle, pb.x.desc, x.data_ptr(), pb.w.desc, w.data_ptr(),
                                                        pb.conv.desc, pb.y.desc, y.data_ptr(), int(perf.size()),
                                                        &returned, perf.data(), data_of(ws), got),
                 pb.op);
  choice = best_of(perf, returned, pb);
  forward_cache.insert(pb.key, choice);
  return choice;
}

// cuDNN has no float64 algorithms for NHWC (PyTorch never asks it for them either): such problems are
// computed in NCHW and the result copied into the NHWC output.
bool float64_nhwc(const Tensor& a, const Tensor& b, const Tensor& c) {
  return a.dtype() == kFloat64 && (strictly_channels_last(a) || strictly_channels_last(b) || strictly_channels_last(c));
}

void conv2d_forward_cuda(const Tensor& out, const Tensor& input, const Tensor& weight, const Tensor& bias,
                         const Conv2dParams& params) {
  if (float64_nhwc(out, input, weight)) {
    NoGradGuard no_grad;
    Tensor nchw = empty(out.shape(), {.dtype = out.dtype(), .device = out.device()});
    conv2d_forward_cuda(nchw, input.contiguous(), weight.contiguous(), bias, params);
    copy_kernel[out.device()](out, nchw);
    return;
  }
  if (is_half(out.dtype()) && conv2d_is_pointwise(weight.shape(), params)) {
    // cuBLAS runs these memory-bound products near the bandwidth limit; cuDNN's legacy algorithms for them
    // were 2-4x slower in float16 on an H200 (tools/bench_conv, ResNet-50's 1x1 layers).
    conv2d_pointwise_forward(out, input, weight);
    if (bias.defined()) {
      NoGradGuard no_grad;
      Tensor(out).add_(bias.view({1, -1, 1, 1}));  // a handle copy: the same tensor
    }
    return;
  }
  check_sizes("conv2d", {&out, &input, &weight});
  cuda::DeviceGuard guard(input.device());
  cudnnHandle_t handle = cudnn_handle(input.device().index);
  Problem pb("conv2d", input, weight, out, params);
  const Choice c = forward_algorithm(handle, pb, input, weight, out);
  HG_CUDNN_CHECK(cudnnSetConvolutionMathType(pb.conv.desc, c.math), "conv2d");
  Tensor ws = workspace(c.workspace, input.device());
  const Scalars s(input.dtype());
  HG_CUDNN_CHECK(cudnnConvolutionForward(handle, s.one(), pb.x.desc, input.data_ptr(), pb.w.desc, weight.data_ptr(),
                                         pb.conv.desc, cudnnConvolutionFwdAlgo_t(c.algo), data_of(ws), c.workspace,
                                         s.zero(), pb.y.desc, out.data_ptr()),
                 "conv2d");
  if (bias.defined()) {
    // [1, O, 1, 1]: the same memory in either layout.
    cudnnTensorDescriptor_t bias_desc = nullptr;
    HG_CUDNN_CHECK(cudnnCreateTensorDescriptor(&bias_desc), "conv2d");
    cudnnStatus_t status = cudnnSetTensor4dDescriptor(bias_desc, pb.nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                                      cudnn_type(bias.dtype()), 1, int(bias.size(0)), 1, 1);
    if (status == CUDNN_STATUS_SUCCESS) {
      status = cudnnAddTensor(handle, s.one(), bias_desc, bias.data_ptr(), s.one(), pb.y.desc, out.data_ptr());
    }
    cudnnDestroyTensorDescriptor(bias_desc);
    HG_CUDNN_CHECK(status, "conv2d (bias)");
  }
}

// ---- backward data: grad_input from grad_output and the weight

Choice backward_data_algorithm(cudnnHandle_t handle, const Problem& pb, const Tensor& w, const Tensor& dy,
                               const Tensor& dx) {
  Choice choice;
  if (backward_data_cache.find(pb.key, choice)) return choice;
  size_t most = 0;
  for (int a = 0; a < CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT; ++a) {
    size_t bytes = 0;
    if (cudnnGetConvolutionBackwardDataWorkspaceSize(handle, pb.w.desc, pb.y.desc, pb.conv.desc, pb.x.desc,
                                                     cudnnConvolutionBwdDataAlgo_t(a), &bytes) == CUDNN_STATUS_SUCCESS)
      most = std::max(most, bytes);
  }
  size_t got = 0;
  Tensor ws = workspace_up_to(most, dx.device(), got);
  int count = 0, returned = 0;
  HG_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle, &count), pb.op);
  std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(size_t(std::max(count, 1)));
  HG_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(handle, pb.w.desc, w.data_ptr(), pb.y.desc, dy.data_ptr(),
                                                             pb.conv.desc, pb.x.desc, dx.data_ptr(), int(perf.size()),
                                                             &returned, perf.data(), data_of(ws), got),
                 pb.op);
  choice = best_of(perf, returned, pb);
  backward_data_cache.insert(pb.key, choice);
  return choice;
}

void conv2d_backward_input_cuda(const Tensor& grad_input, const Tensor& grad_output, const Tensor& weight,
                                const Conv2dParams& params) {
  if (float64_nhwc(grad_input, grad_output, weight)) {
    NoGradGuard no_grad;
    Tensor nchw = empty(grad_input.shape(), {.dtype = grad_input.dtype(), .device = grad_input.device()});
    conv2d_backward_input_cuda(nchw, grad_output.contiguous(), weight.contiguous(), params);
    copy_kernel[grad_input.device()](grad_input, nchw);
    return;
  }
  if (is_half(grad_input.dtype()) && conv2d_is_pointwise(weight.shape(), params)) {
    conv2d_pointwise_backward_input(grad_input, grad_output, weight);
    return;
  }
  check_sizes("conv2d backward", {&grad_input, &grad_output, &weight});
  cuda::DeviceGuard guard(grad_input.device());
  cudnnHandle_t handle = cudnn_handle(grad_input.device().index);
  Problem pb("conv2d backward (input)", grad_input, weight, grad_output, params);
  const Choice c = backward_data_algorithm(handle, pb, weight, grad_output, grad_input);
  HG_CUDNN_CHECK(cudnnSetConvolutionMathType(pb.conv.desc, c.math), "conv2d backward (input)");
  Tensor ws = workspace(c.workspace, grad_input.device());
  const Scalars s(grad_input.dtype());
  HG_CUDNN_CHECK(cudnnConvolutionBackwardData(handle, s.one(), pb.w.desc, weight.data_ptr(), pb.y.desc,
                                              grad_output.data_ptr(), pb.conv.desc,
                                              cudnnConvolutionBwdDataAlgo_t(c.algo), data_of(ws), c.workspace,
                                              s.zero(), pb.x.desc, grad_input.data_ptr()),
                 "conv2d backward (input)");
}

// ---- backward filter: grad_weight from grad_output and the input

Choice backward_filter_algorithm(cudnnHandle_t handle, const Problem& pb, const Tensor& x, const Tensor& dy,
                                 const Tensor& dw) {
  Choice choice;
  if (backward_filter_cache.find(pb.key, choice)) return choice;
  size_t most = 0;
  for (int a = 0; a < CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT; ++a) {
    size_t bytes = 0;
    if (cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, pb.x.desc, pb.y.desc, pb.conv.desc, pb.w.desc,
                                                       cudnnConvolutionBwdFilterAlgo_t(a),
                                                       &bytes) == CUDNN_STATUS_SUCCESS)
      most = std::max(most, bytes);
  }
  size_t got = 0;
  Tensor ws = workspace_up_to(most, dw.device(), got);
  int count = 0, returned = 0;
  HG_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle, &count), pb.op);
  std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(size_t(std::max(count, 1)));
  HG_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(handle, pb.x.desc, x.data_ptr(), pb.y.desc,
                                                               dy.data_ptr(), pb.conv.desc, pb.w.desc, dw.data_ptr(),
                                                               int(perf.size()), &returned, perf.data(), data_of(ws),
                                                               got),
                 pb.op);
  choice = best_of(perf, returned, pb);
  backward_filter_cache.insert(pb.key, choice);
  return choice;
}

void conv2d_backward_weight_cuda(const Tensor& grad_weight, const Tensor& grad_output, const Tensor& input,
                                 const Conv2dParams& params) {
  if (float64_nhwc(grad_weight, grad_output, input)) {
    NoGradGuard no_grad;
    Tensor nchw = empty(grad_weight.shape(), {.dtype = grad_weight.dtype(), .device = grad_weight.device()});
    conv2d_backward_weight_cuda(nchw, grad_output.contiguous(), input.contiguous(), params);
    copy_kernel[grad_weight.device()](grad_weight, nchw);
    return;
  }
  if (is_half(grad_weight.dtype()) && conv2d_is_pointwise(grad_weight.shape(), params) &&
      is_channels_last(grad_output) && is_channels_last(input)) {
    conv2d_pointwise_backward_weight(grad_weight, grad_output, input);
    return;
  }
  check_sizes("conv2d backward", {&grad_weight, &grad_output, &input});
  cuda::DeviceGuard guard(input.device());
  cudnnHandle_t handle = cudnn_handle(input.device().index);
  Problem pb("conv2d backward (weight)", input, grad_weight, grad_output, params);
  const Choice c = backward_filter_algorithm(handle, pb, input, grad_output, grad_weight);
  HG_CUDNN_CHECK(cudnnSetConvolutionMathType(pb.conv.desc, c.math), "conv2d backward (weight)");
  Tensor ws = workspace(c.workspace, input.device());
  const Scalars s(input.dtype());
  HG_CUDNN_CHECK(cudnnConvolutionBackwardFilter(handle, s.one(), pb.x.desc, input.data_ptr(), pb.y.desc,
                                                grad_output.data_ptr(), pb.conv.desc,
                                                cudnnConvolutionBwdFilterAlgo_t(c.algo), data_of(ws), c.workspace,
                                                s.zero(), pb.w.desc, grad_weight.data_ptr()),
                 "conv2d backward (weight)");
}

}  // namespace

HG_REGISTER_KERNEL(conv2d_forward_kernel, CUDA, conv2d_forward_cuda);
HG_REGISTER_KERNEL(conv2d_backward_input_kernel, CUDA, conv2d_backward_input_cuda);
HG_REGISTER_KERNEL(conv2d_backward_weight_kernel, CUDA, conv2d_backward_weight_cuda);

}  // namespace halfgrad
