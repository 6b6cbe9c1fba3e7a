// gather and the scatters on CUDA: the kernel behind indexed_kernel (ops/gather.h).
//
// One thread per position p of index's shape. The three operands' byte offsets at p come from the elementwise loops'
// offset calculator (ops/cuda_loops.cuh), with `indexed` given stride 0 along dim: its offset is then q's but for
// dim's term, which index[p] times dim's stride adds. A value of index outside [0, size of dim) stops the kernel with
// a device-side assertion after printing it (checking on the host would synchronise the device on every call).
// scatter_add adds atomically: the hardware's atomicAdd for 4- and 8-byte types, a compare-and-swap loop on the
// aligned 32-bit word around a 1- or 2-byte element (as PyTorch's).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <type_traits>

#include "core/cuda.h"
#include "ops/cuda_loops.cuh"
#include "ops/gather.h"

namespace halfgrad {
namespace {

// *address += value, atomically; float16/bfloat16 sums computed in float and rounded, integers wrapping.
template <typename T> __device__ void atomic_add(T* address, T value) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, int32_t>) {
    atomicAdd(address, value);
  } else if constexpr (std::is_same_v<T, int64_t>) {
    atomicAdd(reinterpret_cast<unsigned long long*>(address), static_cast<unsigned long long>(value));
  } else {
    static_assert(sizeof(T) == 1 || sizeof(T) == 2, "a 1- or 2-byte type in the compare-and-swap loop");
    using Bits = std::conditional_t<sizeof(T) == 1, uint8_t, uint16_t>;
    const uintptr_t at = reinterpret_cast<uintptr_t>(address);
    unsigned int* word = reinterpret_cast<unsigned int*>(at & ~uintptr_t(3));
    const unsigned int shift = unsigned(at & 3) * 8u, mask = ((1u << (8 * sizeof(T))) - 1u) << shift;
    unsigned int old = *word, assumed;
    do {
      assumed = old;
      const Bits current_bits = Bits((assumed & mask) >> shift);
      T current;
      memcpy(&current, &current_bits, sizeof(T));
      const T sum = T(opmath_t<T>(current) + opmath_t<T>(value));
      Bits sum_bits;
      memcpy(&sum_bits, &sum, sizeof(T));
      old = atomicCAS(word, assumed, (assumed & ~mask) | (unsigned(sum_bits) << shift));
    } while (old != assumed);
  }
}

template <typename T, IndexedOp Op>
__global__ void __launch_bounds__(cuda::kElementwiseBlock)
    indexed_kernel_cuda(uint32_t n, cuda::OffsetCalculator<3> calc, char* dense, char* indexed, const char* index,
                        int64_t indexed_step, int64_t size) {
  const uint32_t p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= n) return;
  int64_t offsets[3];
  calc.get(p, offsets);
  const int64_t q = *reinterpret_cast<const int64_t*>(index + offsets[2]);
  if (q < 0 || q >= size) {
    printf("%s: index %lld is out of range for a dim of size %lld\n",
           Op == IndexedOp::Gather ? "gather" : Op == IndexedOp::Scatter ? "scatter" : "scatter_add", (long long)q,
           (long long)size);
    __assert_fail("index in [0, size of dim)", __FILE__, __LINE__, __func__);
  }
  T* at_p = reinterpret_cast<T*>(dense + offsets[0]);
  T* at_q = reinterpret_cast<T*>(indexed + offsets[1] + q * indexed_step);
  if constexpr (Op == IndexedOp::Gather) {
    *at_p = *at_q;
  } else if constexpr (Op == IndexedOp::Scatter) {
    *at_q = *at_p;
  } else {
    atomic_add(at_q, *at_p);
  }
}

void indexed_cuda(IndexedOp op, const Tensor& indexed, int64_t dim, const Tensor& index, const Tensor& dense) {
  if (index.numel() == 0) return;
  const char* name = indexed_op_name(op);
  cuda::DeviceGuard guard(indexed.device());
  cudaStream_t stream = cuda::current_stream(indexed.device());
  // indexed in index's shape (its larger dims are never reached: q agrees with p there) with stride 0 along dim.
  Shape indexed_strides = indexed.strides();
  indexed_strides[size_t(dim)] = 0;
  const int64_t element = int64_t(element_size(dense.dtype()));
  const std::array<const Shape*, 3> strides{&dense.strides(), &indexed_strides, &index.strides()};
  const cuda::StridedProblem<3> problem{
      coalesce_dims<3>(index.shape(), strides, {element, element, int64_t(sizeof(int64_t))}),
      {static_cast<char*>(dense.data_ptr()), static_cast<char*>(indexed.data_ptr()),
       static_cast<char*>(index.data_ptr())}};
  HG_CHECK(int(problem.sizes.size()) <= cuda::kMaxCoalescedDims,
           "{}: index {} has {} dims that cannot be merged; the CUDA kernel handles up to {}", name, index.meta(),
           problem.sizes.size(), cuda::kMaxCoalescedDims);
  const int64_t indexed_step = indexed.stride(dim) * element, size = indexed.size(dim);
  auto launch = [&]<typename T, IndexedOp Op>() {
    cuda::for_each_32bit_piece<3>(problem, [&](const cuda::StridedProblem<3>& piece) {
      const uint32_t count = uint32_t(piece.numel());
      const unsigned blocks = (count + cuda::kElementwiseBlock - 1) / cuda::kElementwiseBlock;
      indexed_kernel_cuda<T, Op><<<blocks, cuda::kElementwiseBlock, 0, stream>>>(
          count, cuda::offset_calculator(piece), piece.base[0], piece.base[1], piece.base[2], indexed_step, size);
      HG_CUDA_CHECK_LAUNCH(name);
    });
  };
  switch (op) {
    case IndexedOp::Gather:
      dispatch_all(dense.dtype(), name, [&]<typename T>() { launch.template operator()<T, IndexedOp::Gather>(); });
      return;
    case IndexedOp::Scatter:
      dispatch_all(dense.dtype(), name, [&]<typename T>() { launch.template operator()<T, IndexedOp::Scatter>(); });
      return;
    case IndexedOp::ScatterAdd:
      dispatch_numeric(dense.dtype(), name,
                       [&]<typename T>() { launch.template operator()<T, IndexedOp::ScatterAdd>(); });
      return;
  }
}

}  // namespace

HG_REGISTER_KERNEL(indexed_kernel, CUDA, indexed_cuda);

}  // namespace halfgrad
