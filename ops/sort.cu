// sort on CUDA: the kernel behind sort_kernel (ops/sort.h). Each value becomes an unsigned integer key whose order is
// PyTorch's (NaN of either sign above +inf, -0.0 equal to 0.0, negative numbers below positive ones), so that any
// sort of the keys, by comparison or by radix, agrees; then (key, position) pairs are sorted stably:
//   few long rows (up to kFewRows rows of kLongRow or more): cub::DeviceRadixSort a row, all the GPU on each;
//   the rest: cub::DeviceSegmentedSort, a segment a row (a warp's merge sort for short rows, one block's radix sort
//   for long ones).
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_sort.cuh>
#include <cstring>
#include <type_traits>

#include "core/cuda.h"
#include "ops/sort.h"

namespace halfgrad {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kFewRows = 64, kLongRow = int64_t(1) << 16;

// The unsigned key of each storage type's size.
template <typename T> using KeyOf = std::conditional_t<
    sizeof(T) == 1, uint8_t, std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t,
                                                                                            uint64_t>>>;

// v's key: bool and uint8 as they are; signed integers with the sign bit flipped; floats (IEEE bits, sign first) with
// NaN made all ones, -0.0 made +0.0, negative numbers' bits all flipped and positive numbers' sign bit set.
template <typename T> __device__ __forceinline__ KeyOf<T> ordered_key(T v) {
  using K = KeyOf<T>;
  constexpr K sign = K(K(1) << (8 * sizeof(K) - 1));
  K bits;
  memcpy(&bits, &v, sizeof(K));
  if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, uint8_t>) {
    return bits;
  } else if constexpr (std::is_integral_v<T>) {
    return K(bits ^ sign);
  } else {
    const opmath_t<T> f = opmath_t<T>(v);
    if (f != f) return K(~K(0));
    if (f == opmath_t<T>(0)) bits = 0;
    return (bits & sign) ? K(~bits) : K(bits | sign);
  }
}

// keys[i] = ordered_key(source[i]); positions[i] = i % n; starts[r] = r n, the row segments' bounds (starts[rows] =
// count).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    prepare_kernel(KeyOf<T>* keys, const T* source, int64_t* positions, int64_t* starts, int64_t count, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  keys[i] = ordered_key(source[i]);
  positions[i] = i % n;
  if (i % n == 0) starts[i / n] = i;
  if (i == 0) starts[count / n] = count;
}

void sort_cuda(const Tensor& indices, const Tensor& keys, bool descending) {
  const int64_t rows = keys.size(0), n = keys.size(1), count = rows * n;
  if (count == 0) return;
  HG_CHECK(count < (int64_t(1) << 31), "sort (argsort, topk): the CUDA kernel orders fewer than 2^31 elements at "
           "once, got {} rows of {}", rows, n);
  cuda::DeviceGuard guard(keys.device());
  cudaStream_t stream = cuda::current_stream(keys.device());
  dispatch_all(keys.dtype(), "sort", [&]<typename T>() {
    using K = KeyOf<T>;
    const int64_t key_bytes = count * int64_t(sizeof(K));
    const TensorOptions bytes_on_device{.dtype = kUInt8, .device = keys.device()};
    Tensor ordered = empty({key_bytes}, bytes_on_device), sorted_keys = empty({key_bytes}, bytes_on_device);
    Tensor positions = empty({count}, {.dtype = kInt64, .device = keys.device()});
    Tensor starts = empty({rows + 1}, {.dtype = kInt64, .device = keys.device()});
    prepare_kernel<T><<<unsigned((count + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        static_cast<K*>(ordered.data_ptr()), keys.data<T>(), positions.data<int64_t>(), starts.data<int64_t>(),
        count, n);
    HG_CUDA_CHECK_LAUNCH("sort");
    const K* in = static_cast<const K*>(ordered.data_ptr());
    K* out = static_cast<K*>(sorted_keys.data_ptr());
    const int64_t* at = positions.data<int64_t>();
    int64_t* order = indices.data<int64_t>();
    const int64_t* begin = starts.data<int64_t>();
    const bool few_long_rows = rows <= kFewRows && n >= kLongRow;
    // One call for every row, or (few long rows) for row r; the first call with no scratch sizes it.
    auto run = [&](void* scratch, size_t& bytes, int64_t r) {
      if (few_long_rows) {
        const int64_t o = r * n;
        return descending ? cub::DeviceRadixSort::SortPairsDescending(scratch, bytes, in + o, out + o, at + o,
                                                                      order + o, int(n), 0, int(8 * sizeof(K)), stream)
                          : cub::DeviceRadixSort::SortPairs(scratch, bytes, in + o, out + o, at + o, order + o, int(n),
                                                            0, int(8 * sizeof(K)), stream);
      }
      return descending ? cub::DeviceSegmentedSort::StableSortPairsDescending(
                              scratch, bytes, in, out, at, order, int(count), int(rows), begin, begin + 1, stream)
                        : cub::DeviceSegmentedSort::StableSortPairs(scratch, bytes, in, out, at, order, int(count),
                                                                    int(rows), begin, begin + 1, stream);
    };
    size_t bytes = 0;
    HG_CUDA_CHECK(run(nullptr, bytes, 0));
    Tensor scratch = empty({int64_t(bytes)}, {.dtype = kUInt8, .device = keys.device()});
    for (int64_t r = 0; r < (few_long_rows ? rows : 1); ++r) HG_CUDA_CHECK(run(scratch.data_ptr(), bytes, r));
  });
}

}  // namespace

HG_REGISTER_KERNEL(sort_kernel, CUDA, sort_cuda);

}  // namespace halfgrad
