#pragma once
// Multi-tensor apply on CUDA, as PyTorch's: one launch updates a batch of tensors elementwise. For each tensor the
// pointers of its DEPTH operands (param, grad, state...), its size and its own scalars (Adam's bias corrections) travel
// by value in the kernel's argument (`TensorBatch`, under the classic 4 KB limit: 59 Adam tensors, 79 SGD-with-momentum
// tensors a batch; 53 and 68 where the step writes the parameters' casts too), so there is no host-to-device copy and
// no allocation. Each tensor is cut into chunks of kChunk elements; the blocks of the launch walk the batch's chunks
// (grid-stride), finding a chunk's tensor by binary search over the entries' first chunk. Inside a chunk each thread
// loads kVec-element vectors of every operand (when all are aligned), runs the update in registers in opmath_t, and
// stores the operands the update writes. Used by the fused optimizers and the grad norm (optim/fused.cu), the loss
// scaler's unscale (optim/grad_scaler.cu) and the copies and casts of many tensors at once (copy_each_ and cast_each,
// ops/copy.cu).
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <type_traits>

#include "core/cuda.h"
#include "core/dispatch.h"
#include "core/tensor.h"

// The tensor list is read in place from the kernel's parameter space: without __grid_constant__, indexing
// it with a run-time value could make each thread copy all 4 KB of it to local memory.
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 11 || __CUDACC_VER_MINOR__ >= 7)
#define HG_GRID_CONSTANT __grid_constant__
#else
#define HG_GRID_CONSTANT
#endif

namespace halfgrad::multi_tensor {

constexpr int kBlock = 512;            // threads per block
constexpr int64_t kChunk = 16384;      // elements a block takes at a time: 8 vectors per thread
constexpr int kVec = 4;                // elements per vector load
constexpr size_t kBatchBytes = 3840;   // the tensor list's share of the 4 KB kernel-argument limit

// ---- the tensor list

template <int DEPTH, typename Extra> struct TensorEntry {
  void* ptr[DEPTH];     // param, grad, state tensors (in the order the update names them)
  int64_t numel;
  int64_t first_chunk;  // chunks of the entries before this one in the batch
  Extra extra;          // per-tensor scalars
};

template <int DEPTH, typename Extra> struct TensorBatch {
  using Entry = TensorEntry<DEPTH, Extra>;
  static constexpr int kCapacity = int((kBatchBytes - 16) / sizeof(Entry));
  Entry entries[kCapacity];
  int num_tensors;
  int64_t num_chunks;
};

struct NoExtra {};

// An update may also write each tensor's operand 0 (a parameter) rounded to CastT, a second place (its kept
// float16/bfloat16 cast, optim/fused.h: StepTensors::param_casts): the entry's Extra is then WithCast, which carries
// where (nullptr: nowhere) beside the op's own Extra.
template <typename CastT, typename Extra> struct WithCast {
  Extra extra;
  CastT* cast;
};
template <typename Extra> struct CastOf {  // the type operand 0 is also written as, or void
  using type = void;
  static __device__ __forceinline__ const Extra& op_extra(const Extra& e) { return e; }
};
template <typename CastT, typename Extra> struct CastOf<WithCast<CastT, Extra>> {
  using type = CastT;
  static __device__ __forceinline__ const Extra& op_extra(const WithCast<CastT, Extra>& e) { return e.extra; }
  static __device__ __forceinline__ CastT* cast(const WithCast<CastT, Extra>& e) { return e.cast; }
};

template <int DEPTH, typename Extra>
__device__ __forceinline__ const TensorEntry<DEPTH, Extra>& entry_of_chunk(const TensorBatch<DEPTH, Extra>& batch,
                                                                            int64_t chunk) {
  int lo = 0, hi = batch.num_tensors - 1;  // the last entry whose first chunk is <= chunk
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (batch.entries[mid].first_chunk <= chunk)
      lo = mid;
    else
      hi = mid - 1;
  }
  return batch.entries[lo];
}

// Fills batches with the non-empty tensors of `lists` (lists[d][i] is operand d of tensor i) and calls
// launch(batch) for each full batch and the last one.
template <int DEPTH, typename Extra, typename ExtraOf, typename Launch>
void for_each_batch(const std::array<const TensorList*, DEPTH>& lists, const ExtraOf& extra_of, const Launch& launch) {
  using Batch = TensorBatch<DEPTH, Extra>;
  Batch batch;
  batch.num_tensors = 0;
  batch.num_chunks = 0;
  const TensorList& first = *lists[0];
  for (size_t i = 0; i < first.size(); ++i) {
    const int64_t numel = first[i].numel();
    if (numel == 0) continue;
    auto& e = batch.entries[batch.num_tensors++];
    for (int d = 0; d < DEPTH; ++d) e.ptr[d] = (*lists[d])[i].data_ptr();
    e.numel = numel;
    e.first_chunk = batch.num_chunks;
    e.extra = extra_of(i);
    batch.num_chunks += (numel + kChunk - 1) / kChunk;
    if (batch.num_tensors == Batch::kCapacity) {
      launch(batch);
      batch.num_tensors = 0;
      batch.num_chunks = 0;
    }
  }
  if (batch.num_tensors > 0) launch(batch);
}

template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// ---- the elementwise multi-tensor kernel: `op(values, extra)` updates one element's operands in place

// An op may name an operand whose zero leaves every operand as it is (Op::kUnchangedWhereZero: plain SGD's
// gradient) and say at run time whether that holds (op.unchanged_where_zero<DEPTH>()): where a vector of that operand
// is all zero bits, the others are neither read nor written. A language model's embedding gradient is zero outside
// the step's few hundred words: SGD then moves 8 bytes an element less over most of its 21.6M (WikiText-2, 650 wide).
template <typename Op> constexpr int unchanged_where_zero_operand() {
  if constexpr (requires { Op::kUnchangedWhereZero; })
    return Op::kUnchangedWhereZero;
  else
    return -1;
}

template <typename T, int N> __device__ __forceinline__ bool all_zero_bits(const Vec<T, N>& x) {
  static_assert(sizeof(x) % 8 == 0, "whole 8-byte words");
  unsigned long long bits = 0;
#pragma unroll
  for (size_t w = 0; w < sizeof(x) / 8; ++w) bits |= reinterpret_cast<const unsigned long long*>(&x)[w];
  return bits == 0;
}

// skip: nullptr, or a flag that, when nonzero, leaves every operand as it is (SGDStepArgs::found_inf).
template <typename T, int DEPTH, typename Extra, typename Op>
__global__ void __launch_bounds__(kBlock)
    multi_tensor_kernel(const HG_GRID_CONSTANT TensorBatch<DEPTH, Extra> batch, const Op op, const float* skip) {
  using M = opmath_t<T>;
  using CastT = typename CastOf<Extra>::type;
  if (skip != nullptr && *skip != 0) return;
  for (int64_t chunk = blockIdx.x; chunk < batch.num_chunks; chunk += gridDim.x) {
    const TensorEntry<DEPTH, Extra>& e = entry_of_chunk(batch, chunk);
    const auto extra = CastOf<Extra>::op_extra(e.extra);
    const int64_t begin = (chunk - e.first_chunk) * kChunk;
    const int64_t n = min(kChunk, e.numel - begin);
    T* ptr[DEPTH];
    bool aligned = true;
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      ptr[d] = static_cast<T*>(e.ptr[d]) + begin;
      aligned = aligned && reinterpret_cast<uintptr_t>(ptr[d]) % (sizeof(T) * kVec) == 0;
    }
    [[maybe_unused]] CastT* cast = nullptr;
    if constexpr (!std::is_void_v<CastT>) {
      if (CastOf<Extra>::cast(e.extra) != nullptr) {
        cast = CastOf<Extra>::cast(e.extra) + begin;
        aligned = aligned && reinterpret_cast<uintptr_t>(cast) % (sizeof(CastT) * kVec) == 0;
      }
    }
    int64_t done = 0;
    if (aligned) {
      constexpr int kZero = unchanged_where_zero_operand<Op>();
      bool zero_skips = false;
      if constexpr (kZero >= 0) zero_skips = op.template unchanged_where_zero<DEPTH>();
      const int64_t vectors = n / kVec;
      for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
        M r[kVec][DEPTH];
        if constexpr (kZero >= 0) {
          const Vec<T, kVec> x = reinterpret_cast<const Vec<T, kVec>*>(ptr[kZero])[v];
          if (zero_skips && all_zero_bits(x)) continue;
#pragma unroll
          for (int k = 0; k < kVec; ++k) r[k][kZero] = M(x.v[k]);
        }
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
          if (d == kZero) continue;
          const Vec<T, kVec> x = reinterpret_cast<const Vec<T, kVec>*>(ptr[d])[v];
#pragma unroll
          for (int k = 0; k < kVec; ++k) r[k][d] = M(x.v[k]);
        }
#pragma unroll
        for (int k = 0; k < kVec; ++k) op(r[k], extra);
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
          if (!Op::writes(d)) continue;
          Vec<T, kVec> x;
#pragma unroll
          for (int k = 0; k < kVec; ++k) x.v[k] = T(r[k][d]);
          reinterpret_cast<Vec<T, kVec>*>(ptr[d])[v] = x;
        }
        if constexpr (!std::is_void_v<CastT>) {
          if (cast != nullptr) {
            Vec<CastT, kVec> x;
#pragma unroll
            for (int k = 0; k < kVec; ++k) x.v[k] = CastT(r[k][0]);
            reinterpret_cast<Vec<CastT, kVec>*>(cast)[v] = x;
          }
        }
      }
      done = vectors * kVec;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
      M r[DEPTH];
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) r[d] = M(ptr[d][i]);
      op(r, extra);
#pragma unroll
      for (int d = 0; d < DEPTH; ++d)
        if (Op::writes(d)) ptr[d][i] = T(r[d]);
      if constexpr (!std::is_void_v<CastT>) {
        if (cast != nullptr) cast[i] = CastT(r[0]);
      }
    }
  }
}

template <typename T, int DEPTH, typename Extra, typename Op, typename ExtraOf>
void launch_multi_tensor(const char* name, Device device, const std::array<const TensorList*, DEPTH>& lists,
                         const ExtraOf& extra_of, const Op& op, const float* skip = nullptr) {
  static_assert(sizeof(TensorBatch<DEPTH, Extra>) + sizeof(Op) <= 4096, "kernel arguments over 4 KB");
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  for_each_batch<DEPTH, Extra>(lists, extra_of, [&](const TensorBatch<DEPTH, Extra>& batch) {
    multi_tensor_kernel<T, DEPTH, Extra, Op><<<unsigned(batch.num_chunks), kBlock, 0, stream>>>(batch, op, skip);
    HG_CUDA_CHECK_LAUNCH(name);
  });
}

}  // namespace halfgrad::multi_tensor
