// sort and topk on CUDA: the kernels behind sort_kernel and top_kernel (ops/sort.h). Each value becomes an unsigned
// integer key whose order is PyTorch's (NaN of either sign above +inf, -0.0 equal to 0.0, negative numbers below
// positive ones), so that any sort of the keys, by comparison or by radix, agrees; then (key, position) pairs are
// sorted stably:
//   few long rows (few_long_rows, ops/cub_rows.cuh): cub::DeviceRadixSort a row, all the GPU on each;
//   rows of kBlockSortLeast to kBlockSortMost: a block a row, sorted in its registers and shared memory
//   (cub::BlockRadixSort), read and written once, as PyTorch's sort of rows of up to 4,096;
//   the rest: cub::DeviceSegmentedSort, a segment a row (a warp's merge sort for short rows, one block's radix sort
//   for long ones).
// topk with k at most half a row and at most kMostSelected selects first (select_kernel: a radix selection, a block a
// chunk of a row; rows longer than a chunk keep each chunk's k and select again from those) and sorts the k; else it
// sorts whole rows.
#include <cuda_runtime.h>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_sort.cuh>
#include <cstring>
#include <type_traits>

#include "core/cuda.h"
#include "ops/cub_rows.cuh"
#include "ops/sort.h"

namespace halfgrad {
namespace {

constexpr int kThreads = 256;

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

// order[rows, n] = the positions `at` of each row's keys `in` (rows of n, segments [starts[r], starts[r + 1])) sorted
// stably by key, ascending or descending; `out` receives the sorted keys.
template <typename K>
void sort_pairs(int64_t* order, const K* in, K* out, const int64_t* at, const int64_t* starts, int64_t rows, int64_t n,
                bool descending, Device device, cudaStream_t stream) {
  const int64_t count = rows * n;
  const bool one_row_at_a_time = few_long_rows(rows, n);
  // One call for every row, or (few long rows) one for row r.
  run_with_cub_scratch(device, one_row_at_a_time ? rows : 1, [&](void* scratch, size_t& bytes, int64_t r) {
    if (one_row_at_a_time) {
      const int64_t o = r * n;
      return descending ? cub::DeviceRadixSort::SortPairsDescending(scratch, bytes, in + o, out + o, at + o, order + o,
                                                                    int(n), 0, int(8 * sizeof(K)), stream)
                        : cub::DeviceRadixSort::SortPairs(scratch, bytes, in + o, out + o, at + o, order + o, int(n),
                                                          0, int(8 * sizeof(K)), stream);
    }
    return descending ? cub::DeviceSegmentedSort::StableSortPairsDescending(
                            scratch, bytes, in, out, at, order, int(count), int(rows), starts, starts + 1, stream)
                      : cub::DeviceSegmentedSort::StableSortPairs(scratch, bytes, in, out, at, order, int(count),
                                                                  int(rows), starts, starts + 1, stream);
  });
}

// Rows of kBlockSortLeast to kBlockSortMost elements are sorted a block a row (block_sort_kernel); shorter ones by
// cub's segmented sort, whose warps sort them with fewer idle threads.
constexpr int64_t kBlockSortLeast = 513, kBlockSortMost = 16 * kThreads;  // 16 keys a thread at most

// order[row, :n] = the positions of the row's keys sorted stably, ascending or descending: kThreads x kItems keys
// in registers, ranked by cub::BlockRadixSort (stable), the positions past n given the key that sorts last, so that
// they follow every real key.
template <typename T, int kItems>
__global__ void __launch_bounds__(kThreads)
    block_sort_kernel(int64_t* order, const T* source, int64_t n, bool descending) {
  using K = KeyOf<T>;
  using Sort = cub::BlockRadixSort<K, kThreads, kItems, int>;
  __shared__ typename Sort::TempStorage storage;
  const T* row = source + int64_t(blockIdx.x) * n;
  K keys[kItems];
  int positions[kItems];
  for (int i = 0; i < kItems; ++i) {  // blocked: thread t holds positions t kItems ...
    const int j = int(threadIdx.x) * kItems + i;
    positions[i] = j;
    keys[i] = j < n ? ordered_key(row[j]) : descending ? K(0) : K(~K(0));
  }
  if (descending) {
    Sort(storage).SortDescendingBlockedToStriped(keys, positions);
  } else {
    Sort(storage).SortBlockedToStriped(keys, positions);
  }
  int64_t* out = order + int64_t(blockIdx.x) * n;
  for (int i = 0; i < kItems; ++i) {  // striped: item i of thread t has rank i kThreads + t
    const int rank = i * kThreads + int(threadIdx.x);
    if (rank < n) out[rank] = positions[i];
  }
}

// Room on the device for `count` keys of type K.
template <typename K> Tensor key_buffer(int64_t count, Device device) {
  return empty({count * int64_t(sizeof(K))}, {.dtype = kUInt8, .device = device});
}

void check_count(const char* op, int64_t rows, int64_t n) {
  HG_CHECK(rows * n < (int64_t(1) << 31), "{}: the CUDA kernel orders fewer than 2^31 elements at once, got {} rows "
           "of {}", op, rows, n);
}

void sort_cuda(const Tensor& indices, const Tensor& keys, bool descending) {
  const int64_t rows = keys.size(0), n = keys.size(1), count = rows * n;
  if (count == 0) return;
  check_count("sort (argsort, topk)", rows, n);
  cuda::DeviceGuard guard(keys.device());
  cudaStream_t stream = cuda::current_stream(keys.device());
  dispatch_all(keys.dtype(), "sort", [&]<typename T>() {
    using K = KeyOf<T>;
    if (n >= kBlockSortLeast && n <= kBlockSortMost) {
      auto launch = [&](auto kernel) {
        kernel<<<unsigned(rows), kThreads, 0, stream>>>(indices.data<int64_t>(), keys.data<T>(), n, descending);
      };
      if (n <= 4 * kThreads) launch(block_sort_kernel<T, 4>);
      else if (n <= 8 * kThreads) launch(block_sort_kernel<T, 8>);
      else launch(block_sort_kernel<T, 16>);
      HG_CUDA_CHECK_LAUNCH("sort");
      return;
    }
    Tensor ordered = key_buffer<K>(count, keys.device()), sorted_keys = key_buffer<K>(count, keys.device());
    Tensor positions = empty({count}, {.dtype = kInt64, .device = keys.device()});
    Tensor starts = empty({rows + 1}, {.dtype = kInt64, .device = keys.device()});
    prepare_kernel<T><<<unsigned((count + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        static_cast<K*>(ordered.data_ptr()), keys.data<T>(), positions.data<int64_t>(), starts.data<int64_t>(),
        count, n);
    HG_CUDA_CHECK_LAUNCH("sort");
    sort_pairs(indices.data<int64_t>(), static_cast<const K*>(ordered.data_ptr()),
               static_cast<K*>(sorted_keys.data_ptr()), positions.data<int64_t>(), starts.data<int64_t>(), rows, n,
               descending, keys.device(), stream);
  });
}

// ---- topk

// The key topk ranks by, the k largest first: the ordered key for the largest, its complement for the smallest.
template <typename T> __device__ __forceinline__ KeyOf<T> rank_key(T v, bool largest) {
  const KeyOf<T> key = ordered_key(v);
  return largest ? key : KeyOf<T>(~key);
}

// Block b selects from chunk b % chunks of row b / chunks of the candidates (candidate j of row r: position
// from[r m + j] of x's row r, or j itself where `from` is null; -1: no candidate) the k with the largest rank keys,
// all of them where the chunk holds fewer, ties at the k-th key broken by the lowest candidate (as a stable sort
// would), and writes their positions in candidate order to chosen[b k ...], -1 after them. A radix selection, 8 bits
// a pass from the top: a pass counts the next digit of the candidates that share the digits found so far and keeps
// the digit that holds the k-th key; a last pass in candidate order writes those above that key and as many equal
// to it as are wanted.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    select_kernel(int64_t* chosen, const T* x, int64_t n, const int64_t* from, int64_t m, int64_t chunk,
                  int64_t chunks, int k, bool largest) {
  using K = KeyOf<T>;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ unsigned histogram[256];
  __shared__ K found_key;
  __shared__ int found_wanted, found_taking;
  __shared__ typename Scan::TempStorage scan_storage;
  const int64_t r = blockIdx.x / chunks, begin = (blockIdx.x % chunks) * chunk, end = min(begin + chunk, m);
  const T* row = x + r * n;
  const int64_t* candidates = from ? from + r * m : nullptr;
  int64_t* out = chosen + int64_t(blockIdx.x) * k;
  auto position_of = [&](int64_t j) { return candidates ? candidates[j] : j; };

  K prefix = 0, mask = 0;  // the digits of the k-th key found so far, and where they are
  int wanted = k, taking = k;  // how many of the keys that share the prefix to take; how many to take in all
  for (int shift = 8 * int(sizeof(K)) - 8; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kThreads) histogram[b] = 0;
    __syncthreads();
    for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
      const int64_t p = position_of(j);
      if (p < 0) continue;
      const K key = rank_key(row[p], largest);
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xff], 1u);
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // lane l holds digits 8l .. 8l + 7; the counts of the lanes above it, by a suffix scan
      const int lane = threadIdx.x;
      int own = 0;
      for (int b = 0; b < 8; ++b) own += int(histogram[8 * lane + b]);
      int above = own;
      for (int offset = 1; offset < 32; offset *= 2) {
        const int v = __shfl_down_sync(0xffffffffu, above, offset);
        if (lane + offset < 32) above += v;
      }
      const int total = __shfl_sync(0xffffffffu, above, 0), want = min(wanted, total);
      above -= own;
      if (want == 0 && lane == 0) {  // nothing to take (top_cuda's chunks all hold a candidate; kept for safety)
        found_key = K(~K(0));
        found_wanted = found_taking = 0;
      } else if (above < want && want <= above + own) {
        int b = 8 * lane + 7;
        for (; b > 8 * lane && above + int(histogram[b]) < want; --b) above += int(histogram[b]);
        found_key = prefix | K(K(b) << shift);
        found_wanted = want - above;
        found_taking = mask == 0 ? want : taking;  // the first pass: fewer than k where the chunk holds fewer
      }
    }
    __syncthreads();
    prefix = found_key;
    wanted = found_wanted;
    taking = found_taking;
    mask = K(mask | K(K(0xff) << shift));
  }
  // prefix is the k-th key: every key above it is taken, and the first `wanted` equal to it.
  int written = 0, equal_taken = 0;
  for (int64_t base = begin; base < end && written < taking; base += kThreads) {
    const int64_t j = base + threadIdx.x;
    int64_t p = -1;
    int greater = 0, equal = 0;
    if (j < end && (p = position_of(j)) >= 0) {
      const K key = rank_key(row[p], largest);
      greater = key > prefix;
      equal = key == prefix;
    }
    int before, total;  // greater in the high 16 bits, equal in the low: a tile holds kThreads < 2^16
    Scan(scan_storage).ExclusiveSum((greater << 16) | equal, before, total);
    const int left = wanted - equal_taken, equal_before = before & 0xffff;
    if (greater || (equal && equal_before < left)) out[written + (before >> 16) + min(equal_before, left)] = p;
    written += (total >> 16) + min(total & 0xffff, left);
    equal_taken += min(total & 0xffff, left);
    __syncthreads();
  }
  for (int s = written + threadIdx.x; s < k; s += kThreads) out[s] = -1;
}

// ranked[i] = the rank key of row i / k's value at chosen[i]; starts[r] = r k, the rows' bounds (starts[rows] = count).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rank_chosen_kernel(KeyOf<T>* ranked, int64_t* starts, const T* x, const int64_t* chosen, int64_t count, int64_t n,
                       int64_t k, bool largest) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  ranked[i] = rank_key(x[i / k * n + chosen[i]], largest);
  if (i % k == 0) starts[i / k] = i;
  if (i == 0) starts[count / k] = count;
}

// Selection is for k up to kMostSelected: a block's chunk then holds at most kSelectChunk candidates (a multiple of k,
// so that a chunk of kept candidates starts with a chunk's first, and at least 4k, so that each round keeps at most a
// quarter plus k). A larger k would make a block's chunk long and few blocks busy: such rows are sorted whole.
constexpr int64_t kSelectChunk = 4096, kMostSelected = 1024;
int64_t select_chunk(int64_t k) { return kSelectChunk / k * k; }

void top_cuda(const Tensor& top, const Tensor& keys, bool largest) {
  const int64_t rows = keys.size(0), n = keys.size(1), k = top.size(1);
  if (rows == 0 || k == 0) return;
  cuda::DeviceGuard guard(keys.device());
  if (2 * k > n || k > kMostSelected) {  // a sort of the rows, and their first k
    Tensor order = empty({rows, n}, {.dtype = kInt64, .device = keys.device()});
    sort_cuda(order, keys, largest);
    Tensor(top).copy_(order.narrow(1, 0, k));
    return;
  }
  check_count("topk", rows, k);
  HG_CHECK(n < (int64_t(1) << 31), "topk: the CUDA kernel selects from rows of fewer than 2^31 elements, got {}", n);
  cudaStream_t stream = cuda::current_stream(keys.device());
  dispatch_all(keys.dtype(), "topk", [&]<typename T>() {
    using K = KeyOf<T>;
    const int64_t chunk = select_chunk(k);
    Tensor candidates;  // undefined: every position of the row
    for (int64_t m = n;;) {
      const int64_t chunks = m <= chunk ? 1 : (m + chunk - 1) / chunk;
      HG_CHECK(rows * chunks < (int64_t(1) << 31), "topk: {} rows of {} are more chunks of {} than one launch takes",
               rows, m, chunk);
      Tensor kept = empty({rows, chunks * k}, {.dtype = kInt64, .device = keys.device()});
      select_kernel<T><<<unsigned(rows * chunks), kThreads, 0, stream>>>(
          kept.data<int64_t>(), keys.data<T>(), n, candidates.defined() ? candidates.data<int64_t>() : nullptr, m,
          chunks == 1 ? m : chunk, chunks, int(k), largest);
      HG_CUDA_CHECK_LAUNCH("topk");
      candidates = kept;
      if (chunks == 1) break;
      m = chunks * k;
    }
    const int64_t count = rows * k;
    Tensor ranked = key_buffer<K>(count, keys.device()), sorted_keys = key_buffer<K>(count, keys.device());
    Tensor starts = empty({rows + 1}, {.dtype = kInt64, .device = keys.device()});
    rank_chosen_kernel<T><<<unsigned((count + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        static_cast<K*>(ranked.data_ptr()), starts.data<int64_t>(), keys.data<T>(), candidates.data<int64_t>(), count,
        n, k, largest);
    HG_CUDA_CHECK_LAUNCH("topk");
    sort_pairs(top.data<int64_t>(), static_cast<const K*>(ranked.data_ptr()), static_cast<K*>(sorted_keys.data_ptr()),
               candidates.data<int64_t>(), starts.data<int64_t>(), rows, k, /*descending=*/true, keys.device(),
               stream);
  });
}

}  // namespace

HG_REGISTER_KERNEL(sort_kernel, CUDA, sort_cuda);
HG_REGISTER_KERNEL(top_kernel, CUDA, top_cuda);

}  // namespace halfgrad
