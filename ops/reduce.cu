// Reductions on CUDA: the kernel behind reduce_kernel (ops/reduce.h). The op layer (ops/reduce.cpp) hands
// over a contiguous [outer, reduced, inner] input; output (o, i) reduces input[o, :, i].
//
// Two kernels, one per layout, and a third that finishes split reductions:
//   rows    (inner == 1): TX threads share a row, reading it in 16-byte vectors; a block holds 256 / TX rows
//                         (short rows: many per block; long rows: one per block of 256 threads).
//   columns (inner > 1):  BX threads across the row (coalesced loads of neighbouring columns) times BY
//                         threads down the reduced dim; each thread accumulates a strided run.
//   partials:             when there are too few outputs to fill the GPU, the reduced dim is cut into
//                         `splits` pieces reduced by separate blocks; each writes its state, and one thread
//                         per output merges them in a second launch.
// Accumulation: float32 for float16/bfloat16/float32 input, float64 for float64, int64 for integers and
// bool; var is Welford's one-pass algorithm with Chan's merge (no second pass over the input).
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <type_traits>
#include <vector>

#include "core/cuda.h"
#include "ops/cuda_loops.cuh"
#include "ops/reduce.h"

namespace halfgrad {
namespace {

constexpr int kReduceThreads = 256;
constexpr int kMaxSplits = 1024;
constexpr int64_t kMinPerThread = 8;  // a split gives each thread at least this many vectors or elements

template <typename T>
constexpr bool kIsFloat = std::is_floating_point_v<T> || std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

// What every reducer gets besides its state: where to write and the op's options.
struct ReduceParams {
  void* values;      // output values, or nullptr (argmax/argmin)
  int64_t* indices;  // output indices, or nullptr
  int64_t reduced;
  int64_t correction;  // var
  bool flag;           // sum: divide by the count (mean); logical: all (else any)
};

// (halfgrad::min, the reduction, hides CUDA's min)
__device__ __forceinline__ int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename V> __device__ __forceinline__ bool is_nan(V v) {
  if constexpr (std::is_floating_point_v<V>) {
    return v != v;
  } else {
    return false;
  }
}

// ---- reducers: identity, add (one element and its index along the reduced dim), merge, write

// Sum and mean.
template <typename T> struct SumReducer {
  static constexpr bool kVectorAdd = false;
  using Acc = std::conditional_t<kIsFloat<T>, opmath_t<T>, int64_t>;
  using Out = std::conditional_t<kIsFloat<T>, T, int64_t>;
  struct State {
    Acc sum;
  };
  __device__ static State identity(const ReduceParams&) { return {Acc(0)}; }
  __device__ static void add(State& s, T x, int64_t, const ReduceParams&) { s.sum += Acc(opmath_t<T>(x)); }
  __device__ static void merge(State& a, const State& b, const ReduceParams&) { a.sum += b.sum; }
  __device__ static void write(const State& s, int64_t pos, const ReduceParams& p) {
    Out* out = static_cast<Out*>(p.values);
    if constexpr (kIsFloat<T>) {
      out[pos] = Out(p.flag ? s.sum / Acc(p.reduced) : s.sum);  // mean of nothing: 0/0 = nan
    } else {
      out[pos] = s.sum;
    }
  }
};

// Variance: Welford's running mean and sum of squared deviations; Chan et al.'s formula merges two.
template <typename T> struct VarReducer {
  static constexpr bool kVectorAdd = true;
  using Acc = opmath_t<T>;
  struct State {
    Acc mean, m2;
    int64_t n;
  };
  __device__ static State identity(const ReduceParams&) { return {Acc(0), Acc(0), 0}; }
  __device__ static void add(State& s, T x, int64_t, const ReduceParams&) {
    const Acc v = Acc(x);
    s.n += 1;
    const Acc d = v - s.mean;
    s.mean += d / Acc(s.n);
    s.m2 += d * (v - s.mean);
  }
  // A whole vector at once: its own mean and squared deviations (two passes over registers), merged with
  // Chan's formula: one division per vector instead of one per element (which made var compute-bound).
  template <int VEC>
  __device__ static void add_vec(State& s, const cuda::Vec<T, VEC>& x, int64_t, const ReduceParams& p) {
    Acc v[VEC], sum = Acc(0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      v[e] = Acc(x.v[e]);
      sum += v[e];
    }
    const Acc mean = sum * (Acc(1) / Acc(VEC));
    Acc m2 = Acc(0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) m2 += (v[e] - mean) * (v[e] - mean);
    merge(s, State{mean, m2, VEC}, p);
  }
  __device__ static void merge(State& a, const State& b, const ReduceParams&) {
    if (b.n == 0) return;
    if (a.n == 0) {
      a = b;
      return;
    }
    const int64_t n = a.n + b.n;
    const Acc d = b.mean - a.mean, fb = Acc(b.n) / Acc(n);
    a.mean += d * fb;
    a.m2 += b.m2 + d * d * Acc(a.n) * fb;
    a.n = n;
  }
  __device__ static void write(const State& s, int64_t pos, const ReduceParams& p) {
    const int64_t divisor = p.reduced - p.correction > 0 ? p.reduced - p.correction : 0;
    static_cast<T*>(p.values)[pos] = T(s.m2 / Acc(divisor));  // nothing to divide by: nan (or inf)
  }
};

// Max (MAX) or min with the index of its first occurrence; a nan beats every number. The merge is
// symmetric (ties go to the lower index), so the order in which threads combine does not matter; add() relies
// on each thread seeing its elements in increasing index order (both kernels walk them so), so a strictly
// better value is all it needs to test.
template <typename T, bool MAX> struct ExtremeReducer {
  static constexpr bool kVectorAdd = false;
  using V = opmath_t<T>;
  struct State {
    V v;
    int64_t i;  // < 0: nothing seen yet
  };
  __device__ static State identity(const ReduceParams&) { return {V(0), -1}; }
  __device__ static void merge(State& a, const State& b, const ReduceParams&) {
    if (b.i < 0) return;
    if (a.i < 0) {
      a = b;
      return;
    }
    const bool a_nan = is_nan(a.v), b_nan = is_nan(b.v);
    if (a_nan || b_nan) {
      if (b_nan && (!a_nan || b.i < a.i)) a = b;
    } else if ((MAX ? b.v > a.v : b.v < a.v) || (b.v == a.v && b.i < a.i)) {
      a = b;
    }
  }
  __device__ static void add(State& s, T x, int64_t index, const ReduceParams&) {
    const V v = V(x);
    if (s.i < 0 || (MAX ? v > s.v : v < s.v) || (is_nan(v) && !is_nan(s.v))) s = State{v, index};
  }
  __device__ static void write(const State& s, int64_t pos, const ReduceParams& p) {
    if (p.values) static_cast<T*>(p.values)[pos] = T(s.v);
    if (p.indices) p.indices[pos] = s.i;
  }
};

// All or any: whether the elements are nonzero (nan counts as nonzero).
template <typename T> struct LogicalReducer {
  static constexpr bool kVectorAdd = false;
  struct State {
    uint8_t v;
  };
  __device__ static State identity(const ReduceParams& p) { return {uint8_t(p.flag ? 1 : 0)}; }
  __device__ static void add(State& s, T x, int64_t, const ReduceParams& p) {
    const uint8_t nonzero = opmath_t<T>(x) != opmath_t<T>(0);
    s.v = p.flag ? (s.v & nonzero) : (s.v | nonzero);
  }
  __device__ static void merge(State& a, const State& b, const ReduceParams& p) {
    a.v = p.flag ? (a.v & b.v) : (a.v | b.v);
  }
  __device__ static void write(const State& s, int64_t pos, const ReduceParams& p) {
    static_cast<bool*>(p.values)[pos] = s.v != 0;
  }
};

// ---- kernels

// Merges the states of a block's threads along one axis, in shared memory: `lane` runs over `lanes`
// (a power of two), `group` picks the set of `lanes` states merged together. Returns lane 0's result.
template <typename R>
__device__ typename R::State block_merge(typename R::State s, int lane, int lanes, int group, const ReduceParams& p,
                                         bool lane_major) {
  using State = typename R::State;
  __shared__ alignas(16) unsigned char raw[kReduceThreads * sizeof(State)];
  State* states = reinterpret_cast<State*>(raw);
  const int groups = kReduceThreads / lanes;
  auto at = [&](int l) -> State& { return lane_major ? states[l * groups + group] : states[group * lanes + l]; };
  __syncthreads();  // a previous call's readers of the buffer are done
  at(lane) = s;
  __syncthreads();
  for (int stride = lanes / 2; stride > 0; stride /= 2) {
    if (lane < stride) {
      State other = at(lane + stride);
      R::merge(at(lane), other, p);
    }
    __syncthreads();
  }
  return at(0);
}

// inner == 1. Block (TX, TY): row o = blockIdx.x * TY + threadIdx.y; split blockIdx.y of gridDim.y covers
// [split * chunk, split * chunk + chunk) of the row (chunk is a multiple of VEC).
template <typename R, typename T, int VEC>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_rows_kernel(const T* in, int64_t outer, int64_t reduced, int64_t chunk, ReduceParams p,
                       typename R::State* partial) {
  using State = typename R::State;
  const int tx = int(threadIdx.x), TX = int(blockDim.x);
  const int64_t o = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const int split = int(blockIdx.y), splits = int(gridDim.y);
  State s = R::identity(p);
  if (o < outer) {
    const int64_t lo = int64_t(split) * chunk, hi = smaller(reduced, lo + chunk);
    const T* row = in + o * reduced;
    if (lo < hi) {
      // Elements before the first 16-byte boundary, then whole vectors, then the rest.
      const int64_t misaligned = int64_t(reinterpret_cast<uintptr_t>(row + lo) / sizeof(T)) % VEC;
      const int64_t head = smaller(hi - lo, misaligned ? VEC - misaligned : 0);
      for (int64_t j = lo + tx; j < lo + head; j += TX) R::add(s, row[j], j, p);
      const int64_t start = lo + head, vectors = (hi - start) / VEC;
      const auto* v = reinterpret_cast<const cuda::Vec<T, VEC>*>(row + start);
#pragma unroll 4
      for (int64_t k = tx; k < vectors; k += TX) {
        const cuda::Vec<T, VEC> x = v[k];
        if constexpr (R::kVectorAdd) {
          R::template add_vec<VEC>(s, x, start + k * VEC, p);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) R::add(s, x.v[e], start + k * VEC + e, p);
        }
      }
      for (int64_t j = start + vectors * VEC + tx; j < hi; j += TX) R::add(s, row[j], j, p);
    }
  }
  const State r = block_merge<R>(s, tx, TX, int(threadIdx.y), p, /*lane_major=*/false);
  if (tx == 0 && o < outer) {
    if (splits == 1) {
      R::write(r, o, p);
    } else {
      partial[o * splits + split] = r;
    }
  }
}

// inner > 1. Block (BX, BY): each thread owns CV adjacent columns i .. i + CV - 1, i = (tile * BX +
// threadIdx.x) * CV, of row block o, where blockIdx.x = o * tiles + tile; threadIdx.y walks the reduced dim of
// split blockIdx.y in steps of BY. CV > 1 for 8- and 16-bit types (inner a multiple of CV): one 4-byte load
// covers the CV columns, instead of 1- or 2-byte loads that leave the memory system underused.
template <typename R, typename T, int CV>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_columns_kernel(const T* in, int64_t reduced, int64_t inner, int64_t tiles, int64_t chunk, ReduceParams p,
                          typename R::State* partial) {
  using State = typename R::State;
  const int BX = int(blockDim.x), BY = int(blockDim.y), ty = int(threadIdx.y);
  const int64_t o = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int64_t i = (tile * BX + threadIdx.x) * CV;
  const int split = int(blockIdx.y), splits = int(gridDim.y);
  State s[CV];
#pragma unroll
  for (int c = 0; c < CV; ++c) s[c] = R::identity(p);
  if (i < inner) {
    const int64_t lo = int64_t(split) * chunk, hi = smaller(reduced, lo + chunk);
    const T* column = in + o * reduced * inner + i;
#pragma unroll 4
    for (int64_t r = lo + ty; r < hi; r += BY) {
      const cuda::Vec<T, CV> x = *reinterpret_cast<const cuda::Vec<T, CV>*>(column + r * inner);
#pragma unroll
      for (int c = 0; c < CV; ++c) R::add(s[c], x.v[c], r, p);
    }
  }
#pragma unroll
  for (int c = 0; c < CV; ++c) {
    const State r = block_merge<R>(s[c], ty, BY, int(threadIdx.x), p, /*lane_major=*/true);
    if (ty == 0 && i < inner) {
      const int64_t pos = o * inner + i + c;
      if (splits == 1) {
        R::write(r, pos, p);
      } else {
        partial[pos * splits + split] = r;
      }
    }
  }
}

// Block (TX, TY): output pos = blockIdx.x * TY + threadIdx.y; its `splits` states are merged by TX threads
// (strided), then across them. (Merges are symmetric, so the order does not matter.)
template <typename R>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_partials_kernel(const typename R::State* partial, int64_t outputs, int splits, ReduceParams p) {
  const int tx = int(threadIdx.x), TX = int(blockDim.x);
  const int64_t pos = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  typename R::State s = R::identity(p);
  if (pos < outputs) {
    for (int k = tx; k < splits; k += TX) R::merge(s, partial[pos * splits + k], p);
  }
  const typename R::State r = block_merge<R>(s, tx, TX, int(threadIdx.y), p, /*lane_major=*/false);
  if (tx == 0 && pos < outputs) R::write(r, pos, p);
}

// ---- launch

// Columns per thread in the columns kernel: as many as one 4-byte load holds.
template <typename T> constexpr int kColumnVector = sizeof(T) < 4 ? int(4 / sizeof(T)) : 1;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How many pieces to cut the reduced dim into so that `blocks` blocks become enough to fill the GPU,
// while each thread still gets at least kMinPerThread items of `per_item` elements.
int64_t choose_splits(int64_t blocks, int64_t reduced, int64_t threads_along, int64_t per_item, int device) {
  const int64_t target = 8 * int64_t(cuda::multiprocessor_count(device));  // 8 blocks of 256 threads fill an SM
  if (blocks >= target || reduced <= threads_along * per_item * kMinPerThread) return 1;
  return std::clamp<int64_t>(std::min(ceil_div(target, blocks), reduced / (threads_along * per_item * kMinPerThread)),
                             1, kMaxSplits);
}

template <typename R, typename T> void run_reduction(const ReduceArgs& a, const ReduceParams& p, const char* name) {
  using State = typename R::State;
  const int64_t outputs = a.outer * a.inner;
  if (outputs == 0) return;
  const int device = a.input.device().index;
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  const T* in = static_cast<const T*>(a.input.data_ptr());

  dim3 grid, block;
  int64_t chunk = a.reduced, tiles = 0;
  int column_vector = 1;
  constexpr int VEC = int(16 / sizeof(T));
  if (a.inner == 1) {
    int TX = 1;
    while (TX < kReduceThreads && int64_t(TX) * VEC * 4 < a.reduced) TX *= 2;
    const int TY = kReduceThreads / TX;
    const int64_t groups = ceil_div(a.outer, TY);
    int64_t splits = choose_splits(groups, a.reduced, TX, VEC, device);
    if (splits > 1) {
      chunk = ceil_div(ceil_div(a.reduced, splits), VEC) * VEC;
      splits = ceil_div(a.reduced, chunk);
    }
    grid = dim3(unsigned(groups), unsigned(splits));
    block = dim3(unsigned(TX), unsigned(TY));
  } else {
    // Columns in groups of kColumnVector<T> when the rows allow 4-byte loads.
    if (kColumnVector<T> > 1 && a.inner % kColumnVector<T> == 0 &&
        reinterpret_cast<uintptr_t>(in) % (kColumnVector<T> * sizeof(T)) == 0)
      column_vector = kColumnVector<T>;
    const int64_t groups = a.inner / column_vector;
    const int BX = int(std::min<int64_t>(32, std::bit_ceil(uint64_t(groups))));
    const int BY = kReduceThreads / BX;
    tiles = ceil_div(groups, BX);
    int64_t splits = choose_splits(a.outer * tiles, a.reduced, BY, 1, device);
    if (splits > 1) {
      chunk = ceil_div(a.reduced, splits);
      splits = ceil_div(a.reduced, chunk);
    }
    grid = dim3(unsigned(a.outer * tiles), unsigned(splits));
    block = dim3(unsigned(BX), unsigned(BY));
  }

  const int splits = int(grid.y);
  Tensor workspace;
  State* partial = nullptr;
  if (splits > 1) {
    workspace = empty({outputs * splits * int64_t(sizeof(State))}, {.dtype = kUInt8, .device = a.input.device()});
    partial = static_cast<State*>(workspace.data_ptr());
  }
  if (a.inner == 1) {
    reduce_rows_kernel<R, T, VEC><<<grid, block, 0, stream>>>(in, a.outer, a.reduced, chunk, p, partial);
  } else {
    if (column_vector > 1) {
      reduce_columns_kernel<R, T, kColumnVector<T>><<<grid, block, 0, stream>>>(in, a.reduced, a.inner, tiles, chunk,
                                                                                p, partial);
    } else {
      reduce_columns_kernel<R, T, 1><<<grid, block, 0, stream>>>(in, a.reduced, a.inner, tiles, chunk, p, partial);
    }
  }
  HG_CUDA_CHECK_LAUNCH(name);
  if (splits > 1) {
    const int TX = int(std::min<uint64_t>(kReduceThreads, std::bit_ceil(uint64_t(splits)))), TY = kReduceThreads / TX;
    reduce_partials_kernel<R><<<unsigned(ceil_div(outputs, TY)), dim3(unsigned(TX), unsigned(TY)), 0, stream>>>(
        partial, outputs, splits, p);
    HG_CUDA_CHECK_LAUNCH(name);
  }
  // `workspace` goes back to the caching allocator here; later work on this stream is ordered after the
  // kernels above, so it is safe to reuse.
}

void reduce_cuda(const ReduceArgs& a) {
  const char* name = reduce_op_name(a.op);
  HG_CHECK(a.input.is_cuda() && (a.input.numel() == 0 || a.input.is_contiguous()) &&
               a.input.numel() == a.outer * a.reduced * a.inner,
           "{}: reduce_cuda expects a contiguous [outer, reduced, inner] CUDA input, got {} for [{}, {}, {}]", name,
           a.input.meta(), a.outer, a.reduced, a.inner);
  for (const Tensor* t : {&a.values, &a.indices}) {
    HG_CHECK(!t->defined() || (t->device() == a.input.device() && t->is_contiguous()),
             "{}: output {} must be contiguous and on the input's device {}", name, t->meta(), a.input.device().str());
  }
  ReduceParams p{a.values.defined() ? a.values.data_ptr() : nullptr,
                 a.indices.defined() ? static_cast<int64_t*>(a.indices.data_ptr()) : nullptr, a.reduced, a.correction,
                 false};
  dispatch_all(a.input.dtype(), name, [&]<typename T>() {
    switch (a.op) {
      case ReduceOp::Sum:
      case ReduceOp::Mean:
        if constexpr (kIsFloat<T>) {
          p.flag = a.op == ReduceOp::Mean;
        } else if (a.op == ReduceOp::Mean) {
          throw_unsupported_dtype(name, a.input.dtype());
        }
        run_reduction<SumReducer<T>, T>(a, p, name);
        return;
      case ReduceOp::Var:
        if constexpr (kIsFloat<T>) {
          run_reduction<VarReducer<T>, T>(a, p, name);
        } else {
          throw_unsupported_dtype(name, a.input.dtype());
        }
        return;
      case ReduceOp::Max:
      case ReduceOp::ArgMax:
      case ReduceOp::Min:
      case ReduceOp::ArgMin:
        if (a.op == ReduceOp::Max || a.op == ReduceOp::ArgMax) {
          run_reduction<ExtremeReducer<T, true>, T>(a, p, name);
        } else {
          run_reduction<ExtremeReducer<T, false>, T>(a, p, name);
        }
        return;
      case ReduceOp::All:
      case ReduceOp::Any:
        p.flag = a.op == ReduceOp::All;
        run_reduction<LogicalReducer<T>, T>(a, p, name);
        return;
    }
  });
}

}  // namespace

HG_REGISTER_KERNEL(reduce_kernel, CUDA, reduce_cuda);

}  // namespace halfgrad
