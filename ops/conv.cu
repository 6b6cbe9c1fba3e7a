// conv2d on CUDA through cuDNN's graph API (the backend API PyTorch reaches through cudnn-frontend): forward,
// backward data and backward filter, each a one-operation graph.
//
//   candidates   the engine configurations cuDNN's heuristics rank for the graph (modes A and FALLBACK), less
//                those whose numerics we do not accept (below), the first ten (kCandidateLimit) and one that
//                needs no workspace; for float16/bfloat16 1x1 convolutions with stride 1, also the same product
//                as one cuBLAS GEMM (ops/conv.cpp, conv2d_pointwise_*); for float16/bfloat16 windows of at most 32
//                values (an RGB input under a 3x3 kernel), also our kernels of ops/conv_few_channels.cu (forward
//                and weight gradient)
//   autotuning   the first time a thread sees a problem every candidate runs on the real buffers (one warm-up, then
//                the median of three, timed with CUDA events) and the fastest is cached for the problem: device,
//                direction, dtype, layout, all sizes, stride/padding/dilation, TF32 permission and the operands'
//                address alignment (an engine may need 16-byte aligned data). PyTorch's cudnn.benchmark does the
//                same over its top candidates. With set_conv_benchmark(false), the first candidate that fits.
//   knobs        unless set_conv_knob_search({.enabled = false}), autotuning goes on where a cuDNN engine won: the
//                knobs cuDNN's heuristics leave to that engine (tile and cluster shapes, split-K, stages) are
//                searched, and a setting that computes the same result at least 2% faster replaces the engine's own
//                (search_knobs)
//   numerics     accepted: tensor cores for float16/bfloat16, and for float32 only when conv_allow_tf32();
//                refused: engines that down-convert inputs or reduce in reduced precision (float16/bfloat16
//                products accumulate in float32, as on the CPU)
//   workspace    a uint8 tensor from the caching allocator (no cudaMalloc per call)
//   layouts      NCHW or NHWC strides on the same [N, C, H, W] descriptors (the op layer hands dense operands of
//                one format); NHWC is what the tensor-core kernels read natively. float64 NHWC problems run in
//                NCHW (cuDNN has no float64 engines for NHWC) and the result is copied into the NHWC output.
//
// The bias is added afterwards (out += bias per channel); its gradient is a sum over (N, H, W) done by the op
// layer. Run with HALFGRAD_LOG=debug to see each problem's candidates and choice.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/cuda.h"
#include "core/log.h"
#include "core/random.h"
#include "ops/conv.h"
#include "ops/conv_few_channels.h"
#include "ops/copy.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"

namespace halfgrad {
namespace {

cudnnDataType_t cudnn_type(DType t) {
  switch (t) {
    case DType::Float16: return CUDNN_DATA_HALF;
    case DType::BFloat16: return CUDNN_DATA_BFLOAT16;
    case DType::Float32: return CUDNN_DATA_FLOAT;
    case DType::Float64: return CUDNN_DATA_DOUBLE;
    default: throw_unsupported_dtype("conv2d (cuda)", t);
  }
}

// ---- backend descriptors (RAII): created with a type, filled with attributes, finalized

class Descriptor {
 public:
  Descriptor(cudnnBackendDescriptorType_t type, const char* op) : op_(op) {
    HG_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &desc_), op);
  }
  ~Descriptor() {
    if (desc_ != nullptr) cudnnBackendDestroyDescriptor(desc_);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;

  cudnnBackendDescriptor_t get() const { return desc_; }
  cudnnBackendDescriptor_t* address() { return &desc_; }

  template <typename T> Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                                       int64_t count, const T* values) {
    HG_CUDNN_CHECK(cudnnBackendSetAttribute(desc_, name, type, count, values), op_);
    return *this;
  }
  Descriptor& set(cudnnBackendAttributeName_t name, const Descriptor& value) {
    cudnnBackendDescriptor_t d = value.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d);
  }
  Descriptor& set(cudnnBackendAttributeName_t name, int64_t value) { return set(name, CUDNN_TYPE_INT64, 1, &value); }
  void finalize() { HG_CUDNN_CHECK(cudnnBackendFinalize(desc_), op_); }
  // For descriptors that may legitimately not finalize (an engine that does not support the problem).
  bool try_finalize() { return cudnnBackendFinalize(desc_) == CUDNN_STATUS_SUCCESS; }

 private:
  cudnnBackendDescriptor_t desc_ = nullptr;
  const char* op_;
};

// ---- one problem: three operands in the forward's roles (x [N, C, H, W], w [O, C/g, kH, kW], y [N, O, OH, OW]),
// whichever of them is being computed

enum class Direction { Forward, BackwardData, BackwardFilter };

const char* name_of(Direction d) {
  switch (d) {
    case Direction::Forward: return "conv2d";
    case Direction::BackwardData: return "conv2d backward (input)";
    case Direction::BackwardFilter: return "conv2d backward (weight)";
  }
  return "conv2d";
}

// The variant pack's names for the operands.
constexpr int64_t kUidX = 'x', kUidW = 'w', kUidY = 'y';

// NHWC only (a tensor with C == 1 or H == W == 1 is dense in both layouts and may be described as either).
bool strictly_channels_last(const Tensor& t) { return is_channels_last(t) && !t.is_contiguous(); }

// The largest power of two (at most 16) that divides the address: engines that load 16 bytes at a time need it.
int64_t alignment_of(const Tensor& t) {
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t a = 16;
  while (a > 1 && address % uintptr_t(a) != 0) a /= 2;
  return a;
}

using ProblemKey = std::array<int64_t, 25>;

struct Problem {
  Direction direction;
  const Tensor& x;
  const Tensor& w;
  const Tensor& y;
  const Conv2dParams& params;
  bool accumulate;  // the computed operand is added into (beta = 1), not written
  bool nhwc;
  DType dtype;

  Problem(Direction d, const Tensor& x_, const Tensor& w_, const Tensor& y_, const Conv2dParams& p, bool add = false)
      : direction(d), x(x_), w(w_), y(y_), params(p), accumulate(add),
        // The op layer hands all operands dense in one format: NHWC if any of them is NHWC only.
        nhwc(strictly_channels_last(x_) || strictly_channels_last(w_) || strictly_channels_last(y_)),
        dtype(x_.dtype()) {}

  const char* op() const { return name_of(direction); }
  int device() const { return x.device().index; }
  bool tf32() const { return dtype == kFloat32 && params.allow_tf32; }

  ProblemKey key() const {
    return {int64_t(direction), device(), int64_t(x.dtype()), int64_t(w.dtype()), int64_t(y.dtype()), int64_t(nhwc),
            x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(1), w.size(2), w.size(3), params.stride[0],
            params.stride[1], params.padding[0], params.padding[1], params.dilation[0], params.dilation[1],
            int64_t(tf32()), alignment_of(x), alignment_of(w), alignment_of(y), int64_t(accumulate)};
  }

  std::string str() const {
    return fmt::format("input {}, weight {}, output {}, stride ({}, {}), padding ({}, {}), dilation ({}, {}), "
                       "groups {}, layout {}{}", x.meta(), w.meta(), y.meta(), params.stride[0], params.stride[1],
                       params.padding[0], params.padding[1], params.dilation[0], params.dilation[1], params.groups,
                       nhwc ? "NHWC" : "NCHW", accumulate ? ", adding into the result" : "");
  }
};

// A [N, C, H, W]-ordered descriptor with the dense strides of the problem's layout (size-1 dims of a dense
// tensor may carry any stride; cuDNN wants the canonical ones).
void describe(Descriptor& d, const Tensor& t, int64_t uid, bool nhwc) {
  const int64_t n = t.size(0), c = t.size(1), h = t.size(2), w = t.size(3);
  const std::array<int64_t, 4> dims{n, c, h, w};
  const std::array<int64_t, 4> strides = nhwc ? std::array<int64_t, 4>{h * w * c, 1, w * c, c}
                                              : std::array<int64_t, 4>{c * h * w, h * w, w, 1};
  const cudnnDataType_t type = cudnn_type(t.dtype());
  d.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type)
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data())
      .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data())
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid)
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, alignment_of(t));
  d.finalize();
}

// Each direction's operation and the attribute names of its operands: x, w and y in the forward's roles (the
// backward data operation computes x from y and w, the backward filter operation w from x and y).
struct OperationAttributes {
  cudnnBackendDescriptorType_t type;
  cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
};

const OperationAttributes& operation_attributes(Direction d) {
  static const OperationAttributes forward{
      CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA};
  static const OperationAttributes backward_data{
      CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA};
  static const OperationAttributes backward_filter{
      CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA};
  switch (d) {
    case Direction::Forward: return forward;
    case Direction::BackwardData: return backward_data;
    case Direction::BackwardFilter: return backward_filter;
  }
  return forward;
}

// The problem as a finalized one-operation graph; the descriptors it refers to live as long as it does.
struct Graph {
  Descriptor x, w, y, conv, operation, graph;

  Graph(const Problem& pb, cudnnHandle_t handle)
      : x(CUDNN_BACKEND_TENSOR_DESCRIPTOR, pb.op()),
        w(CUDNN_BACKEND_TENSOR_DESCRIPTOR, pb.op()),
        y(CUDNN_BACKEND_TENSOR_DESCRIPTOR, pb.op()),
        conv(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, pb.op()),
        operation(operation_attributes(pb.direction).type, pb.op()),
        graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, pb.op()) {
    describe(x, pb.x, kUidX, pb.nhwc);
    describe(w, pb.w, kUidW, pb.nhwc);  // groups follow from x's C over w's C / groups
    describe(y, pb.y, kUidY, pb.nhwc);

    // Products of float16/bfloat16 (and float32) operands accumulate in float32; float64 in float64.
    const bool is_double = pb.dtype == kFloat64;
    const cudnnDataType_t compute = is_double ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
    const Conv2dParams& p = pb.params;
    conv.set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, int64_t(2))
        .set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute)
        .set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode)
        .set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, p.stride.data())
        .set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, p.padding.data())
        .set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, p.padding.data())
        .set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, p.dilation.data());
    conv.finalize();

    // alpha = 1, and beta = 0 (the output is written, never read) or 1 (added into).
    const float f_one = 1, f_zero = 0;
    const double d_one = 1, d_zero = 0;
    const cudnnBackendAttributeType_t scalar = is_double ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT;
    const void* one = is_double ? static_cast<const void*>(&d_one) : &f_one;
    const void* zero = is_double ? static_cast<const void*>(&d_zero) : &f_zero;
    const OperationAttributes& names = operation_attributes(pb.direction);
    operation.set(names.x, x)
        .set(names.w, w)
        .set(names.y, y)
        .set(names.conv, conv)
        .set(names.alpha, scalar, 1, one)
        .set(names.beta, scalar, 1, pb.accumulate ? one : zero);
    operation.finalize();
    cudnnBackendDescriptor_t op = operation.get();
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &op)
        .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    graph.finalize();
  }
};

// ---- candidates

// One way to compute a problem: a finalized cuDNN execution plan (with the engine configuration and graph it was
// built from), the cuBLAS GEMM of a pointwise convolution, or our few-channels kernels.
enum class Implementation { Cudnn, PointwiseGemm, FewChannels };

struct Candidate {
  std::shared_ptr<Graph> graph;               // these three: Cudnn only
  std::shared_ptr<Descriptor> config, plan;
  int64_t workspace = 0;
  std::string label;  // "engine 12", "cuBLAS GEMM", "few-channels kernel" or "engine 12 with knobs 27=2 28=1"
  Implementation implementation = Implementation::Cudnn;
  int64_t engine_index = -1;  // Cudnn: the engine's global index
  // A configuration search_knobs made refers to its engine and knob-choice descriptors: they live as long as it.
  std::vector<std::shared_ptr<Descriptor>> referred;
};

bool takes_few_channels(const Problem& pb) {
  return pb.direction != Direction::BackwardData && few_channels_conv_takes(pb.x, pb.w, pb.y, pb.params);
}

bool is_pointwise_gemm(const Problem& pb) {
  if (!is_half(pb.dtype) || !conv2d_is_pointwise(pb.w.shape(), pb.params)) return false;
  // The NCHW weight gradient is no single GEMM (ops/conv.h).
  return pb.direction != Direction::BackwardFilter || (is_channels_last(pb.y) && is_channels_last(pb.x));
}

// Whether an engine's numerics fit the problem's contract.
bool acceptable(const Descriptor& engine, const Problem& pb) {
  std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
  int64_t count = 0;
  if (cudnnBackendGetAttribute(engine.get(), CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               int64_t(notes.size()), &count, notes.data()) != CUDNN_STATUS_SUCCESS) {
    return false;
  }
  for (int64_t i = 0; i < count; ++i) {
    switch (notes[size_t(i)]) {
      case CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS:
      case CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION: return false;
      case CUDNN_NUMERICAL_NOTE_TENSOR_CORE:
        if (pb.dtype == kFloat32 && !pb.params.allow_tf32) return false;
        break;
      default: break;
    }
  }
  return true;
}

// At most this many cuDNN engines per problem, the best ranked first, as torch.backends.cudnn.benchmark_limit's
// default: finalizing and timing the plans far down the ranking cost the most and win the least. With every candidate,
// `halfgrad bench vgg` (15 configurations) took 290 s on the H200, with ten 37 s, the step times unchanged
// (2026-12-02, docs/benchmarks.md). Past the limit the ranking is still searched for one engine that needs no
// workspace, so that a problem under memory pressure (bench max-batch's probes) always has an engine that runs.
constexpr size_t kCandidateLimit = 10;

size_t engines_in(const std::vector<Candidate>& candidates) {
  auto is_engine = [](const Candidate& c) { return c.implementation == Implementation::Cudnn; };
  return size_t(std::count_if(candidates.begin(), candidates.end(), is_engine));
}
bool has_workspace_free(const std::vector<Candidate>& candidates) {
  return std::any_of(candidates.begin(), candidates.end(), [](const Candidate& c) { return c.workspace == 0; });
}

int64_t int64_attribute(const Descriptor& d, cudnnBackendAttributeName_t name, const char* op) {
  int64_t value = 0, got = 0;
  HG_CUDNN_CHECK(cudnnBackendGetAttribute(d.get(), name, CUDNN_TYPE_INT64, 1, &got, &value), op);
  return value;
}

// The execution plan of an engine configuration, or null where the engine does not take the problem.
std::shared_ptr<Descriptor> plan_of(const Descriptor& config, cudnnHandle_t handle, const char* op) {
  auto plan = std::make_shared<Descriptor>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, op);
  plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config)
      .set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  return plan->try_finalize() ? plan : nullptr;
}

// The engine configurations cuDNN's heuristics rank for the graph in `mode`, finalized into plans where the
// engine supports the problem and its numerics are acceptable: kCandidateLimit engines, then (if none of the
// candidates needs no workspace) the first that needs none.
void add_candidates(std::vector<Candidate>& out, const std::shared_ptr<Graph>& graph, const Problem& pb,
                    cudnnHandle_t handle, cudnnBackendHeurMode_t mode) {
  Descriptor heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, pb.op());
  heuristics.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph->graph)
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
  if (!heuristics.try_finalize()) return;
  int64_t count = 0;
  HG_CUDNN_CHECK(cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                          CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
                 pb.op());
  std::vector<std::shared_ptr<Descriptor>> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.push_back(std::make_shared<Descriptor>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, pb.op()));
    raw.push_back(configs.back()->get());
  }
  int64_t returned = 0;
  HG_CUDNN_CHECK(cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                          CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned, raw.data()),
                 pb.op());
  for (int64_t i = 0; i < returned && (engines_in(out) < kCandidateLimit || !has_workspace_free(out)); ++i) {
    Descriptor engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR, pb.op());
    int64_t got = 0;
    if (cudnnBackendGetAttribute(configs[size_t(i)]->get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got, engine.address()) != CUDNN_STATUS_SUCCESS ||
        !acceptable(engine, pb)) {
      continue;
    }
    // -1 where cuDNN does not say: the engine is still a candidate, but the knob search cannot build it again.
    int64_t index = -1;
    if (cudnnBackendGetAttribute(engine.get(), CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &got, &index) !=
        CUDNN_STATUS_SUCCESS)
      index = -1;
    std::shared_ptr<Descriptor> plan = plan_of(*configs[size_t(i)], handle, pb.op());
    if (!plan) continue;  // the engine does not take this problem
    const int64_t workspace = int64_attribute(*plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, pb.op());
    if (engines_in(out) >= kCandidateLimit && workspace > 0) continue;  // past the limit: only a workspace-free one
    out.push_back(Candidate{.graph = graph, .config = configs[size_t(i)], .plan = plan, .workspace = workspace,
                            .label = fmt::format("engine {}", index), .engine_index = index});
  }
}

void run_gemm(const Problem& pb) {
  switch (pb.direction) {
    case Direction::Forward: conv2d_pointwise_forward(pb.y, pb.x, pb.w); break;
    case Direction::BackwardData: conv2d_pointwise_backward_input(pb.x, pb.y, pb.w, pb.accumulate); break;
    case Direction::BackwardFilter: conv2d_pointwise_backward_weight(pb.w, pb.y, pb.x); break;
  }
}

void* data_of(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

void run_few_channels(const Problem& pb, const Tensor& workspace) {
  if (pb.direction == Direction::Forward)
    few_channels_conv_forward(pb.y, pb.x, pb.w, pb.params);
  else
    few_channels_conv_backward_weight(pb.w, pb.y, pb.x, pb.params, workspace);
}

// Runs one candidate on the problem's buffers with `workspace` (at least c.workspace bytes).
void execute(const Candidate& c, const Problem& pb, cudnnHandle_t handle, const Tensor& workspace) {
  if (c.implementation == Implementation::PointwiseGemm) {
    run_gemm(pb);
    return;
  }
  if (c.implementation == Implementation::FewChannels) {
    run_few_channels(pb, workspace);
    return;
  }
  const std::array<int64_t, 3> uids{kUidX, kUidW, kUidY};
  const std::array<void*, 3> pointers{pb.x.data_ptr(), pb.w.data_ptr(), pb.y.data_ptr()};
  void* ws = data_of(workspace);
  Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, pb.op());
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids.data())
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, pointers.data())
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  pack.finalize();
  HG_CUDNN_CHECK(cudnnBackendExecute(handle, c.plan->get(), pack.get()), pb.op());
}

// A workspace of up to `bytes` from the caching allocator; when that much is not available, the largest
// power-of-two fraction of it that is (autotuning then skips the candidates that need more).
Tensor workspace_up_to(int64_t bytes, Device device, int64_t& got) {
  got = bytes;
  while (got > 0) {
    try {
      return empty({got}, {.dtype = kUInt8, .device = device});
    } catch (const OutOfMemory&) {
      got /= 2;
    }
  }
  return Tensor();
}

// Milliseconds per run of a candidate (cuda::median_run_ms), or a negative number when it failed to run (that
// candidate is then skipped, not the problem).
float time_candidate(const Candidate& c, const Problem& pb, cudnnHandle_t handle, const Tensor& workspace) {
  try {
    return cuda::median_run_ms(pb.device(), [&] { execute(c, pb, handle, workspace); }, pb.op());
  } catch (const Error& e) {
    logger().debug("{}: {} failed to run ({}); skipped", pb.op(), c.label, e.what());
    return -1;
  }
}

// ---- the engine's knobs (set_conv_knob_search)
//
// An engine configuration holds the engine's knob choices (tile and cluster shape, split-K, stages), as many as cuDNN's
// heuristics set; the engine picks the others itself. Other choices can do better: on the H200, 15 of ResNet-18's 30
// convolution problems (batch 256, float16 NHWC) ran up to 13.5% faster with knobs set, always those of the engine
// already fastest (docs/benchmarks.md, "cuDNN's engine knobs"). search_knobs looks for such a setting of the
// autotuner's winner by coordinate descent, as that probe did where an engine had many settings: from the
// configuration's own knob choices (or, where it holds none, every knob at its lowest value), each knob in turn over
// its values with the others held, moving to the fastest setting so far, two passes. It runs on operands of its own,
// random values of the problem's shapes and layout, so that neither the step's data (zeros, or the infinities of a
// first loss-scaled backward) nor its buffers are involved. Before it is timed, a setting's result must match the
// engine's own (an engine may take a setting it then computes wrongly, or not at all). The fastest setting is timed
// again against the engine's own choice, alternately, and replaces it only if it saves the required share of its time
// (2%): the timings of one run each are noisy, and a search that keeps noise is worse than none. A setting that faults
// on the GPU (an illegal address: a sticky error) would end the process, as any failing kernel does; the probe's ~4,600
// plans ran without one.

struct Knob {
  cudnnBackendKnobType_t type;
  std::vector<int64_t> values;  // lowest, lowest + stride, ..., highest; a bounded number, spread evenly
};

// One value per knob (knobs_of's order), or none: the engine's own choice for that knob.
using KnobSetting = std::vector<std::optional<int64_t>>;

constexpr size_t kKnobSettings = 256;  // settings tried a problem, those cuDNN refuses included
constexpr int kKnobPasses = 2;
constexpr size_t kKnobValues = 32;  // values a knob at most; fewer where many knobs share kKnobSettings
constexpr int kKnobRetimes = 4;     // rounds of the final comparison, which of the two runs first alternating

// Whether the engine compiles its kernels at run time (NVRTC): every setting would compile anew.
bool compiles_at_run_time(const Descriptor& engine) {
  std::array<cudnnBackendBehaviorNote_t, CUDNN_BEHAVIOR_NOTE_TYPE_COUNT> notes{};
  int64_t count = 0;
  if (cudnnBackendGetAttribute(engine.get(), CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                               int64_t(notes.size()), &count, notes.data()) != CUDNN_STATUS_SUCCESS) {
    return true;  // unknown: not searched
  }
  const auto end = notes.begin() + std::clamp<int64_t>(count, 0, int64_t(notes.size()));
  return std::find(notes.begin(), end, CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION) != end;
}

// A descriptor attribute that is an array of descriptors of `type` (at most CUDNN_KNOB_TYPE_COUNTS of them: an
// engine's knob infos, a configuration's knob choices), read into descriptors made for it.
std::vector<std::unique_ptr<Descriptor>> knob_descriptors(const Descriptor& of, cudnnBackendAttributeName_t name,
                                                          cudnnBackendDescriptorType_t type, const char* op) {
  std::vector<std::unique_ptr<Descriptor>> out;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int i = 0; i < CUDNN_KNOB_TYPE_COUNTS; ++i) {
    out.push_back(std::make_unique<Descriptor>(type, op));
    raw.push_back(out.back()->get());
  }
  int64_t count = 0;
  HG_CUDNN_CHECK(cudnnBackendGetAttribute(of.get(), name, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(raw.size()), &count,
                                          raw.data()),
                 op);
  out.resize(size_t(std::clamp<int64_t>(count, 0, int64_t(out.size()))));
  return out;
}

// The engine's knobs and the values searched for each: all of a knob's values where they fit its share of
// kKnobSettings, else that many spread from its lowest to its highest.
std::vector<Knob> knobs_of(const Descriptor& engine, const char* op) {
  struct Range {
    cudnnBackendKnobType_t type;
    int64_t lowest, stride, last;  // values lowest + stride * i for i in [0, last]
  };
  std::vector<Range> ranges;
  for (const auto& info :
       knob_descriptors(engine, CUDNN_ATTR_ENGINE_KNOB_INFO, CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR, op)) {
    Range r{};
    int64_t got = 0;
    HG_CUDNN_CHECK(
        cudnnBackendGetAttribute(info->get(), CUDNN_ATTR_KNOB_INFO_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &got, &r.type), op);
    r.lowest = int64_attribute(*info, CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE, op);
    const int64_t highest = int64_attribute(*info, CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE, op);
    r.stride = int64_attribute(*info, CUDNN_ATTR_KNOB_INFO_STRIDE, op);
    // How split sums are reduced stays the engine's choice: the numerics refuse reductions in reduced precision, and
    // the engine's notes (acceptable) describe its own choice, not a setting's.
    if (r.type == CUDNN_KNOB_TYPE_REDUCTION_MODE) continue;
    int64_t span = 0;
    if (r.stride <= 0 || highest < r.lowest || __builtin_sub_overflow(highest, r.lowest, &span)) continue;  // no range
    r.last = span / r.stride;
    ranges.push_back(r);
  }
  if (ranges.empty()) return {};
  const int64_t per_knob =
      std::clamp<int64_t>(int64_t(kKnobSettings / (kKnobPasses * ranges.size())), 2, int64_t(kKnobValues));
  std::vector<Knob> knobs;
  for (const Range& r : ranges) {
    Knob knob{.type = r.type, .values = {}};
    const int64_t taken = std::min(r.last, per_knob - 1) + 1;
    for (int64_t j = 0; j < taken; ++j) {
      const int64_t step = taken == r.last + 1 ? j : int64_t(double(j) * double(r.last) / double(taken - 1));
      knob.values.push_back(r.lowest + r.stride * std::min(step, r.last));
    }
    knobs.push_back(std::move(knob));
  }
  return knobs;
}

// The knob choices a configuration holds, as a setting of `knobs` (none where it holds none of them).
KnobSetting choices_of(const Descriptor& config, const std::vector<Knob>& knobs, const char* op) {
  KnobSetting setting(knobs.size());
  for (const auto& choice :
       knob_descriptors(config, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, op)) {
    cudnnBackendKnobType_t type{};
    int64_t got = 0;
    HG_CUDNN_CHECK(
        cudnnBackendGetAttribute(choice->get(), CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &got, &type),
        op);
    const int64_t value = int64_attribute(*choice, CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, op);
    for (size_t k = 0; k < knobs.size(); ++k)
      if (knobs[k].type == type) setting[k] = value;
  }
  return setting;
}

// The operand a problem computes: y forward, x backward data, w backward filter.
const Tensor& computed(const Problem& pb) {
  switch (pb.direction) {
    case Direction::Forward: return pb.y;
    case Direction::BackwardData: return pb.x;
    case Direction::BackwardFilter: return pb.w;
  }
  return pb.y;
}

// How far a setting's result may lie from the engine's own, relative to the largest |value| of the engine's: the
// bounds tests/test_conv.cpp puts on CUDA against the CPU (another split of the sums, another order of adding).
double knob_tolerance(const Problem& pb) {
  switch (pb.dtype) {
    case kFloat64: return 1e-10;
    case kFloat32: return pb.tf32() ? 1e-2 : 1e-4;
    case kFloat16: return 4e-3;
    default: return 3e-2;  // bfloat16
  }
}

// The search's operands: values uniform in [-1, 1), element i of a buffer from Philox counter i / 4 of a seed per
// operand (`operand`: 0, 1, 2), drawn on the device. The global generator is neither read nor advanced, so the user's
// random stream (and other threads' draws) go on as without the search.
constexpr int kOperandThreads = 256;
constexpr uint64_t kOperandSeed = 0x6b6e6f62;  // "knob"

template <typename T>
__global__ void __launch_bounds__(kOperandThreads) search_operand_kernel(T* out, int64_t n, uint64_t seed) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c * 4 >= n) return;
  const Philox::U4 r = Philox::generate(seed, uint64_t(c));
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (c * 4 + k < n) out[c * 4 + k] = T(opmath_t<T>(2.0f * Philox::uniform(r.x[k]) - 1.0f));
  }
}

// A fresh tensor of t's shape, dtype and device in the problem's layout, filled as above.
Tensor search_operand(const Tensor& t, bool nhwc, int operand) {
  Tensor out = empty(t.shape(), {.dtype = t.dtype(), .device = t.device()},
                     nhwc ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous);
  const int64_t n = out.numel(), counters = (n + 3) / 4;
  if (n == 0) return out;
  dispatch_floating(out.dtype(), "conv2d knob search", [&]<typename T>() {
    search_operand_kernel<T>
        <<<unsigned((counters + kOperandThreads - 1) / kOperandThreads), kOperandThreads, 0,
           cuda::current_stream(t.device().index)>>>(out.data<T>(), n, kOperandSeed + uint64_t(operand));
    HG_CUDA_CHECK_LAUNCH("conv2d knob search");
  });
  return out;
}

class KnobSearch {
 public:
  KnobSearch(const Candidate& chosen, const Problem& problem, cudnnHandle_t handle, const Tensor& workspace,
             double required_gain)
      : chosen_(chosen),
        handle_(handle),
        workspace_(workspace),
        required_gain_(required_gain),
        x_(search_operand(problem.x, problem.nhwc, 0)),
        w_(search_operand(problem.w, problem.nhwc, 1)),
        y_(search_operand(problem.y, problem.nhwc, 2)),
        pb_(problem.direction, x_, w_, y_, problem.params, problem.accumulate) {}

  // The engine's own choice, or a setting of its knobs that computes the same result in less time.
  Candidate run() {
    if (chosen_.engine_index < 0) return keep("cuDNN did not give the engine's index");
    engine_ = std::make_shared<Descriptor>(CUDNN_BACKEND_ENGINE_DESCRIPTOR, pb_.op());
    engine_->set(CUDNN_ATTR_ENGINE_OPERATION_GRAPH, chosen_.graph->graph)
        .set(CUDNN_ATTR_ENGINE_GLOBAL_INDEX, chosen_.engine_index);
    if (!engine_->try_finalize()) return keep("cuDNN does not build the engine again by its index");
    if (compiles_at_run_time(*engine_)) return keep("the engine compiles its kernels at run time");
    knobs_ = knobs_of(*engine_, pb_.op());
    if (knobs_.empty()) return keep("the engine has no knobs");

    // Where the result is added into, the output starts from values of its own, the same for every run.
    if (pb_.accumulate) initial_ = computed(pb_).clone();
    // The engine's own result, against which every setting's is checked.
    prepare_output();
    execute(chosen_, pb_, handle_, workspace_);
    const Tensor& out = computed(pb_);
    reference_ = out.dtype() == wide() ? out.clone() : out.to(wide());
    scale_ = max(abs(reference_)).item<double>();
    if (!std::isfinite(scale_)) return keep("the engine's own result on random operands is not finite");

    // The engine's own time on these operands (the autotuner's was on the step's). The descent starts from the
    // configuration's own choices, where a setting must beat that time by the required share to move it, or from
    // every knob at its lowest value, taken even where cuDNN refuses it: its neighbours may run.
    const float own_ms = time_candidate(chosen_, pb_, handle_, workspace_);
    if (!(own_ms > 0)) return keep("the engine's own choice did not time on the search's operands");
    const double allowed_ms = (1 - required_gain_) * own_ms;
    current_ = choices_of(*chosen_.config, knobs_, pb_.op());
    if (std::any_of(current_.begin(), current_.end(), [](const auto& v) { return v.has_value(); })) {
      tried_.insert(current_);
      current_ms_ = allowed_ms;
    } else {
      for (size_t k = 0; k < knobs_.size(); ++k) current_[k] = knobs_[k].values.front();
      try_setting(current_);
    }
    for (int pass = 0; pass < kKnobPasses; ++pass) {
      const KnobSetting start = current_;
      for (size_t k = 0; k < knobs_.size(); ++k) {
        for (int64_t value : knobs_[k].values) {
          KnobSetting setting = current_;
          setting[k] = value;
          try_setting(setting);
        }
      }
      if (current_ == start) break;  // the next pass would try the same settings again
    }
    if (!best_ || current_ms_ > allowed_ms) return keep("no setting ran faster and computed the same result");

    // The winner of single timings, timed again alternately with the engine's own choice.
    float own = 0, set = 0;
    for (int round = 0; round < kKnobRetimes; ++round) {
      const bool own_first = round % 2 == 0;
      const float first = time_candidate(own_first ? chosen_ : *best_, pb_, handle_, workspace_);
      const float second = time_candidate(own_first ? *best_ : chosen_, pb_, handle_, workspace_);
      if (first < 0 || second < 0) return keep("the final timing failed");
      own += own_first ? first : second;
      set += own_first ? second : first;
    }
    const bool taken = set <= (1 - required_gain_) * own;
    logger().debug("{} (cuda): {}: knob search: {} -> {}: {:.3f} ms against {:.3f} ms for the engine's own "
                   "choice{} ({})",
                   pb_.op(), pb_.str(), chosen_.label, best_->label, set / kKnobRetimes, own / kKnobRetimes,
                   taken ? ", taken" : ", not taken: too little faster", counts());
    return taken ? *best_ : chosen_;
  }

 private:
  DType wide() const { return pb_.dtype == kFloat64 ? kFloat64 : kFloat32; }

  Candidate keep(const char* why) const {
    logger().debug("{} (cuda): {}: knob search: {} kept: {} ({})", pb_.op(), pb_.str(), chosen_.label, why, counts());
    return chosen_;
  }

  std::string counts() const {
    return fmt::format("{} settings tried: {} computed the same result, {} another, {} refused by cuDNN or failed to "
                       "run", matched_ + mismatched_ + refused_, matched_, mismatched_, refused_);
  }

  // The computed operand before a run: NaN where it is written, so that a plan that skips any of it fails the
  // check; the same starting values where it is added into.
  void prepare_output() {
    Tensor out = computed(pb_);
    if (pb_.accumulate)
      out.copy_(initial_);
    else
      out.fill_(std::numeric_limits<double>::quiet_NaN());
  }

  // The engine with the setting's knob choices as a plan for the problem, or nothing where cuDNN refuses it or it
  // needs more workspace than the autotuner's candidates (the memory the problem was tuned within).
  std::optional<Candidate> plan_for(const KnobSetting& setting) {
    Candidate c{.graph = chosen_.graph, .label = chosen_.label + " with knobs", .engine_index = chosen_.engine_index};
    c.referred.push_back(engine_);
    std::vector<cudnnBackendDescriptor_t> choices;
    for (size_t k = 0; k < knobs_.size(); ++k) {
      if (!setting[k]) continue;
      auto choice = std::make_shared<Descriptor>(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, pb_.op());
      choice->set(CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &knobs_[k].type)
          .set(CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, *setting[k]);
      if (!choice->try_finalize()) return std::nullopt;
      choices.push_back(choice->get());
      c.referred.push_back(std::move(choice));
      c.label += fmt::format(" {}={}", int(knobs_[k].type), *setting[k]);
    }
    c.config = std::make_shared<Descriptor>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, pb_.op());
    c.config->set(CUDNN_ATTR_ENGINECFG_ENGINE, *engine_);
    if (!choices.empty()) {
      c.config->set(CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(choices.size()),
                    choices.data());
    }
    if (!c.config->try_finalize()) return std::nullopt;
    c.plan = plan_of(*c.config, handle_, pb_.op());
    if (!c.plan) return std::nullopt;
    c.workspace = int64_attribute(*c.plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, pb_.op());
    const int64_t have = workspace_.defined() ? workspace_.numel() : 0;
    if (c.workspace > have) return std::nullopt;
    return c;
  }

  // Checks and times one setting (once: a setting tried before is skipped, as is any past kKnobSettings); the
  // descent moves to it where it is the fastest so far.
  void try_setting(const KnobSetting& setting) {
    if (tried_.size() >= kKnobSettings || !tried_.insert(setting).second) return;
    try {
      std::optional<Candidate> c = plan_for(setting);
      if (!c) {
        ++refused_;
        return;
      }
      prepare_output();
      execute(*c, pb_, handle_, workspace_);
      const double off = max(abs(computed(pb_).to(wide()) - reference_)).item<double>();
      if (!(off <= knob_tolerance(pb_) * scale_)) {  // NaN (a part left unwritten) fails too
        ++mismatched_;
        logger().debug("{} (cuda): {}: {} differs from the engine's own result by {} (largest |value| {})", pb_.op(),
                       pb_.str(), c->label, off, scale_);
        return;
      }
      const float ms = time_candidate(*c, pb_, handle_, workspace_);
      if (ms < 0) {
        (void)cudaGetLastError();
        ++refused_;
        return;
      }
      ++matched_;
      if (ms < current_ms_) {
        current_ = setting;
        current_ms_ = ms;
        best_ = std::move(*c);
      }
    } catch (const OutOfMemory&) {
      throw;  // the search ends: the engine's own choice stands
    } catch (const Error&) {  // cuDNN refused an attribute or the plan failed to run: the next setting is tried
      (void)cudaGetLastError();  // a launch error is not left for the next kernel's check
      ++refused_;
    }
  }

  const Candidate& chosen_;
  cudnnHandle_t handle_;
  const Tensor& workspace_;
  const double required_gain_;
  const Tensor x_, w_, y_;  // the search's own operands
  const Problem pb_;        // the problem on them

  std::shared_ptr<Descriptor> engine_;
  std::vector<Knob> knobs_;
  Tensor initial_, reference_;
  double scale_ = 0;
  KnobSetting current_;  // the descent's point: the fastest setting so far, or its start
  double current_ms_ = std::numeric_limits<double>::infinity();
  std::optional<Candidate> best_;  // the plan of current_, once a setting ran faster than the engine's own choice
  std::set<KnobSetting> tried_;
  int matched_ = 0, mismatched_ = 0, refused_ = 0;
};

// The timed winner, or the same engine with its knobs set where that is faster (KnobSearch). The search's own ops
// (random operands, the checks' casts and reductions) are neither autocast nor traced, and no error leaves it: the
// timed choice stands.
Candidate search_knobs(const Candidate& chosen, const Problem& pb, cudnnHandle_t handle, const Tensor& workspace) {
  if (chosen.implementation != Implementation::Cudnn) return chosen;
  NoGradGuard no_grad;
  amp::detail::ApplyingGuard outside_autocast;
  try {
    return KnobSearch(chosen, pb, handle, workspace, conv_knob_search().required_gain).run();
  } catch (const std::exception& e) {
    (void)cudaGetLastError();
    logger().debug("{} (cuda): {}: the knob search failed ({}); {} kept", pb.op(), pb.str(), e.what(), chosen.label);
    return chosen;
  }
}

// ---- the choice per problem: autotuned once per host thread, then cached

// How a problem's candidate is chosen: the first that fits (conv_benchmark() off), the fastest (on), or the fastest
// with its knobs searched (conv_knob_search() on too). Each way keeps its own choices.
enum class Choosing { FirstFitting, Fastest, FastestWithKnobs };

// Per thread, as PyTorch's benchmark cache: a plan is finalized with its thread's cuDNN handle, and cuDNN does not
// promise that every engine's plan may run concurrently from several threads.
thread_local std::array<std::map<ProblemKey, Candidate>, size_t(Choosing::FastestWithKnobs) + 1> t_choices;

Candidate autotune(const Problem& pb, cudnnHandle_t handle, Choosing choosing) {
  std::vector<Candidate> candidates;
  if (is_pointwise_gemm(pb)) {
    candidates.push_back(Candidate{.label = "cuBLAS GEMM", .implementation = Implementation::PointwiseGemm});
  }
  auto graph = std::make_shared<Graph>(pb, handle);
  add_candidates(candidates, graph, pb, handle, CUDNN_HEUR_MODE_A);
  add_candidates(candidates, graph, pb, handle, CUDNN_HEUR_MODE_FALLBACK);
  // Last, so that without autotuning cuDNN's first engine is taken: ours were measured on an H200 only.
  if (takes_few_channels(pb)) {
    const int64_t workspace =
        pb.direction == Direction::BackwardFilter ? few_channels_weight_workspace(pb.x, pb.w, pb.y) : 0;
    candidates.push_back(Candidate{.workspace = workspace, .label = "few-channels kernel",
                                   .implementation = Implementation::FewChannels});
  }
  HG_CHECK(!candidates.empty(), "{} (cuda): cuDNN has no engine for {} whose numerics are acceptable", pb.op(),
           pb.str());

  int64_t most = 0;
  for (const Candidate& c : candidates) most = std::max(most, c.workspace);
  int64_t got = 0;
  Tensor workspace = workspace_up_to(most, pb.x.device(), got);
  // A backward that adds into the input's gradient is timed on zeros laid out as it: the timing runs must not add
  // into the result.
  const Tensor scratch =
      pb.accumulate ? empty(pb.x.shape(), {.dtype = pb.x.dtype(), .device = pb.x.device()},
                            pb.nhwc ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous).zero_()
                    : Tensor();
  const Problem timed(pb.direction, pb.accumulate ? scratch : pb.x, pb.w, pb.y, pb.params, pb.accumulate);
  const Candidate* best = nullptr;
  float best_ms = 0;
  std::string report;
  for (const Candidate& c : candidates) {
    if (c.workspace > got) continue;
    if (choosing == Choosing::FirstFitting) {  // the heuristics' order, no timing
      logger().debug("{} (cuda): {} -> {} (heuristic, not timed)", pb.op(), pb.str(), c.label);
      return c;
    }
    const float ms = time_candidate(c, timed, handle, workspace);
    report += fmt::format(" {} {:.3f} ms;", c.label, ms);
    if (ms >= 0 && (best == nullptr || ms < best_ms)) {
      best = &c;
      best_ms = ms;
    }
  }
  HG_CHECK(best != nullptr, "{} (cuda): none of the {} candidate engines ran for {} (workspace available: {} bytes)",
           pb.op(), candidates.size(), pb.str(), got);
  logger().debug("{} (cuda): {} -> {} ({:.3f} ms);{}", pb.op(), pb.str(), best->label, best_ms, report);
  return choosing == Choosing::FastestWithKnobs ? search_knobs(*best, pb, handle, workspace) : *best;
}

Candidate choice_for(const Problem& pb, cudnnHandle_t handle) {
  const ProblemKey key = pb.key();
  Choosing choosing = Choosing::FirstFitting;
  if (conv_benchmark()) choosing = conv_knob_search().enabled ? Choosing::FastestWithKnobs : Choosing::Fastest;
  std::map<ProblemKey, Candidate>& choices = t_choices[size_t(choosing)];
  auto it = choices.find(key);
  if (it == choices.end()) it = choices.emplace(key, autotune(pb, handle, choosing)).first;
  return it->second;
}

// The legacy-sized limit cuDNN's convolution kernels still index with.
void check_sizes(const Problem& pb) {
  for (const Tensor* t : {&pb.x, &pb.w, &pb.y}) {
    HG_CHECK(t->numel() <= INT_MAX,
             "{} (cuda): {} has more than 2^31 - 1 elements, which cuDNN's convolutions do not take; split the "
             "batch", pb.op(), t->meta());
  }
}

void run(Direction direction, const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& params,
         bool accumulate = false) {
  const Problem pb(direction, x, w, y, params, accumulate);
  check_sizes(pb);
  cuda::DeviceGuard guard(x.device());
  cudnnHandle_t handle = cuda::cudnn_handle(pb.device());
  const Candidate c = choice_for(pb, handle);
  const Tensor workspace = c.workspace > 0 ? empty({c.workspace}, {.dtype = kUInt8, .device = x.device()}) : Tensor();
  execute(c, pb, handle, workspace);
}

// cuDNN has no float64 engines for NHWC (PyTorch never asks it for them either): such problems are computed in
// NCHW and the result copied into the NHWC output.
bool float64_nhwc(const Tensor& a, const Tensor& b, const Tensor& c) {
  return a.dtype() == kFloat64 && (strictly_channels_last(a) || strictly_channels_last(b) || strictly_channels_last(c));
}

// ---- the three kernels

void conv2d_forward_cuda(const Tensor& out, const Tensor& input, const Tensor& weight, const Tensor& bias,
                         const Conv2dParams& params) {
  if (float64_nhwc(out, input, weight)) {
    NoGradGuard no_grad;
    Tensor nchw = empty(out.shape(), {.dtype = out.dtype(), .device = out.device()});
    conv2d_forward_cuda(nchw, input.contiguous(), weight.contiguous(), bias, params);
    copy_kernel[out.device()](out, nchw);
    return;
  }
  run(Direction::Forward, input, weight, out, params);
  if (bias.defined()) {
    NoGradGuard no_grad;
    Tensor(out).add_(bias.view({1, -1, 1, 1}));  // a handle copy: the same tensor
  }
}

void conv2d_backward_input_cuda(const Tensor& grad_input, const Tensor& grad_output, const Tensor& weight,
                                const Conv2dParams& params, bool accumulate) {
  if (float64_nhwc(grad_input, grad_output, weight)) {
    NoGradGuard no_grad;
    Tensor nchw = empty(grad_input.shape(), {.dtype = grad_input.dtype(), .device = grad_input.device()});
    conv2d_backward_input_cuda(nchw, grad_output.contiguous(), weight.contiguous(), params, false);
    if (accumulate)
      Tensor(grad_input).add_(nchw);
    else
      copy_kernel[grad_input.device()](grad_input, nchw);
    return;
  }
  run(Direction::BackwardData, grad_input, weight, grad_output, params, accumulate);
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
  run(Direction::BackwardFilter, input, grad_weight, grad_output, params);
}

}  // namespace

HG_REGISTER_KERNEL(conv2d_forward_kernel, CUDA, conv2d_forward_cuda);
HG_REGISTER_KERNEL(conv2d_backward_input_kernel, CUDA, conv2d_backward_input_cuda);
HG_REGISTER_KERNEL(conv2d_backward_weight_kernel, CUDA, conv2d_backward_weight_cuda);

}  // namespace halfgrad
