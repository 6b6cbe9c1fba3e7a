// GEMM on CUDA: the kernel behind gemm_kernel (ops/matmul.h), through cuBLAS.
//
//   float16 / bfloat16   tensor cores, products accumulated in float32 (CUBLAS_COMPUTE_32F; the handle
//                        also forbids reduced-precision split-K reductions, see core/cuda.cpp)
//   float32              full float32 by default; TF32 tensor cores after cuda::set_allow_tf32(true)
//   float64              CUBLAS_COMPUTE_64F
//   integers             a plain CUDA kernel (no BLAS does integer GEMM), wrapping on overflow as the CPU
// A large tensor-core product whose matrices are not 16-byte aligned runs on zero-padded copies (padded_problem).
// Our matrices are row-major and cuBLAS's column-major: a row-major C = op(A) op(B) is the column-major
// C^T = op(B)^T op(A)^T, so the call swaps the operands and m with n (GemmArgs in ops/matmul.h).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include "core/cuda.h"
#include "ops/copy_matrix.cuh"
#include "ops/matmul.h"

namespace halfgrad {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::Float16: return CUDA_R_16F;
    case DType::BFloat16: return CUDA_R_16BF;
    case DType::Float32: return CUDA_R_32F;
    case DType::Float64: return CUDA_R_64F;
    default: HG_FAIL("matmul: no cuBLAS type for {}", dtype_name(t));
  }
}

cublasOperation_t cublas_op(Trans t) { return t == Trans::Yes ? CUBLAS_OP_T : CUBLAS_OP_N; }

void check_int(int64_t v, const char* what) {
  HG_CHECK(v >= 0 && v <= INT_MAX, "matmul: {} = {} is beyond what cuBLAS takes (a 32-bit int)", what, v);
}

// ---- tensor-core products of odd sizes (float16, bfloat16, float32 as TF32): run on zero-padded copies
//
// cuBLAS runs a tensor-core GEMM on its fast kernels only when the contiguous extent of every matrix (the columns of
// our row-major ones) is a multiple of 16 bytes (8 16-bit or 4 float32 elements), as are the leading dimensions and
// the addresses. The word language model's decoder is not: [700, 650] x [650, 33,278] in float16 ran at 170 TFLOP/s
// on the H200 and at 554 with 656 and 33,280; padding the leading dimensions alone gained nothing
// (docs/benchmarks.md). Its recurrent layers' float32 input products with TF32 ran at ~50 TFLOP/s on the unaligned
// kernels. So a product large enough to pay for the copies runs on copies whose contiguous extents are rounded up to
// multiples of 16 bytes and zero-filled: zero columns and rows add nothing to the sums over k, and C's padding is
// dropped on the way back. float32 without TF32 runs as it is: its CUDA-core kernels gain nothing from alignment
// that pays for the copies.

// Below this the copies' launches cost more than the faster kernel saves. A language model's decoder products are
// 9-30 GFLOP; its recurrent layers' input products at 650 units 2.4 (65 TFLOP/s unpadded).
constexpr double kMinPaddedFlops = 1e9;
// The copies move bytes at ~3 TB/s; the padded kernel saves ~4e-15 s a flop in 16 bits (170 -> 550 TFLOP/s) and
// ~1e-14 in TF32 (~50 -> ~90-100 TFLOP/s for the language model's input products): pay off from about 80 flops per
// byte copied in 16 bits, fewer in TF32; 64 counts the saved launches of cuBLAS's slower split kernels too.
constexpr double kMinFlopsPerCopiedByte = 64;

// A stored row-major matrix of a GEMM and the padded shape it is run with.
struct StoredMatrix {
  const void* data;
  int64_t rows, cols, ld;
  int64_t padded_rows, padded_cols;
  size_t element_size;
  bool needs_copy() const {
    return padded_rows != rows || padded_cols != cols || ld % (kGemmAlignBytes / int64_t(element_size)) != 0 ||
           reinterpret_cast<uintptr_t>(data) % kGemmAlignBytes != 0;
  }
  int64_t padded_bytes() const { return padded_rows * padded_cols * int64_t(element_size); }
};

struct PaddedProblem {
  StoredMatrix a, b, c;
  int64_t m, n, k;  // padded
  int64_t copied_bytes() const {
    int64_t bytes = 0;
    for (const StoredMatrix* x : {&a, &b, &c})
      if (x->needs_copy()) bytes += x->padded_bytes() + x->rows * x->cols * int64_t(x->element_size);
    return bytes;
  }
};

// What the product `g` would be run as with its contiguous extents padded; nullopt when it runs as it is (already
// aligned, too small, batched, not on tensor cores, or the copies would cost more than they save).
std::optional<PaddedProblem> padded_problem(const GemmArgs& g) {
  const bool tensor_cores =
      g.ab_dtype == kFloat16 || g.ab_dtype == kBFloat16 || (g.ab_dtype == kFloat32 && cuda::allow_tf32());
  if (!tensor_cores || g.batch != 1) return std::nullopt;
  const double flops = 2.0 * double(g.m) * double(g.n) * double(g.k);
  if (flops < kMinPaddedFlops) return std::nullopt;
  const int64_t per_vector = kGemmAlignBytes / int64_t(element_size(g.ab_dtype));
  auto round_up = [&](int64_t v) { return (v + per_vector - 1) / per_vector * per_vector; };
  const bool ta = g.trans_a == Trans::Yes, tb = g.trans_b == Trans::Yes;
  // An extent is padded where it is some matrix's contiguous one: k for A as stored or B transposed, m for A
  // transposed, n always (C's columns). A k that only counts rows (A^T B) is left alone.
  const int64_t m = ta ? round_up(g.m) : g.m, n = round_up(g.n), k = !ta || tb ? round_up(g.k) : g.k;
  const size_t ab_size = element_size(g.ab_dtype), c_size = element_size(g.c_dtype);
  PaddedProblem p{
      .a = {g.a, ta ? g.k : g.m, ta ? g.m : g.k, g.lda, ta ? k : m, ta ? m : k, ab_size},
      .b = {g.b, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb, tb ? n : k, tb ? k : n, ab_size},
      .c = {g.c, g.m, g.n, g.ldc, m, n, c_size},
      .m = m, .n = n, .k = k};
  if (!p.a.needs_copy() && !p.b.needs_copy() && !p.c.needs_copy()) return std::nullopt;
  if (flops < kMinFlopsPerCopiedByte * double(p.copied_bytes())) return std::nullopt;
  return p;
}

// Every row of C (of each batch entry) starts as g.bias.
void write_bias_rows(const GemmArgs& g, void* c, int64_t ldc, cudaStream_t stream) {
  const size_t size = element_size(g.c_dtype);
  for (int64_t b = 0; b < g.batch; ++b)
    copy_matrix(size, static_cast<char*>(c) + b * g.stride_c * int64_t(size), g.m, g.n, ldc, {g.bias, g.m, g.n, 0},
                stream, "matmul");
}

void gemm_cublas(const GemmArgs& g);

// g on the padded copies of p: A and B (where they need it) and C (copied in first when beta reads it, or started
// as the bias rows) in one workspace from the caching allocator; the product; C's corner copied back.
void gemm_padded(const GemmArgs& g, const PaddedProblem& p) {
  cuda::DeviceGuard guard(g.device);
  cudaStream_t stream = cuda::current_stream(g.device);
  auto slot = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  int64_t total = 0;
  for (const StoredMatrix* x : {&p.a, &p.b, &p.c})
    if (x->needs_copy()) total += slot(x->padded_bytes());
  const Tensor workspace = empty({total}, {.dtype = kUInt8, .device = g.device});
  char* next = static_cast<char*>(workspace.data_ptr());
  auto place = [&](const StoredMatrix& x, bool fill) -> void* {
    if (!x.needs_copy()) return const_cast<void*>(x.data);
    void* dst = next;
    next += slot(x.padded_bytes());
    if (fill)
      copy_matrix(x.element_size, dst, x.padded_rows, x.padded_cols, x.padded_cols, {x.data, x.rows, x.cols, x.ld},
                  stream, "matmul");
    return dst;
  };
  GemmArgs padded = g;
  padded.a = place(p.a, true);
  padded.b = place(p.b, true);
  padded.c = place(p.c, g.beta != 0);
  padded.lda = p.a.needs_copy() ? p.a.padded_cols : g.lda;
  padded.ldb = p.b.needs_copy() ? p.b.padded_cols : g.ldb;
  padded.ldc = p.c.needs_copy() ? p.c.padded_cols : g.ldc;
  if (g.bias) {
    write_bias_rows(g, padded.c, padded.ldc, stream);  // the unpadded rows and columns: the rest is dropped
    padded = start_from_bias(padded);
  }
  padded.m = p.m, padded.n = p.n, padded.k = p.k;
  gemm_cublas(padded);
  if (p.c.needs_copy())
    copy_matrix(p.c.element_size, g.c, g.m, g.n, g.ldc, {padded.c, p.c.padded_rows, p.c.padded_cols, p.c.padded_cols},
                stream, "matmul");
}

void gemm_cublas(const GemmArgs& g) {
  const bool half_inputs = g.ab_dtype == kFloat16 || g.ab_dtype == kBFloat16;
  HG_CHECK(g.c_dtype == g.ab_dtype || (half_inputs && g.c_dtype == kFloat32),
           "matmul (cuda): operands {} with output {} are not supported", dtype_name(g.ab_dtype), dtype_name(g.c_dtype));
  for (auto [v, what] : {std::pair{g.m, "m"}, {g.n, "n"}, {g.k, "k"}, {g.lda, "lda"}, {g.ldb, "ldb"}, {g.ldc, "ldc"},
                         {g.batch, "batch"}})
    check_int(v, what);

  cublasComputeType_t compute;
  const void* alpha;
  const void* beta;
  float alpha32 = float(g.alpha), beta32 = float(g.beta);
  double alpha64 = g.alpha, beta64 = g.beta;
  if (g.ab_dtype == kFloat64) {
    compute = CUBLAS_COMPUTE_64F;
    alpha = &alpha64;
    beta = &beta64;
  } else {
    compute = g.ab_dtype == kFloat32 && cuda::allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    alpha = &alpha32;
    beta = &beta32;
  }
  if (g.device_scalars) {
    alpha = g.device_scalars;
    beta = static_cast<const char*>(g.device_scalars) + (g.ab_dtype == kFloat64 ? sizeof(double) : sizeof(float));
  }
  const cudaDataType_t ab = cuda_type(g.ab_dtype), c = cuda_type(g.c_dtype);

  cuda::DeviceGuard guard(g.device);
  cublasHandle_t handle = cuda::cublas_handle(g.device.index);
  // The handle is shared: its pointer mode goes back to the host's however the call ends.
  struct PointerMode {
    cublasHandle_t handle;
    bool device;
    PointerMode(cublasHandle_t h, bool d) : handle(h), device(d) {
      if (device) HG_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_DEVICE), "matmul");
    }
    ~PointerMode() {
      if (device) cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST);
    }
  } pointer_mode(handle, g.device_scalars != nullptr);
  // Column-major view: C^T (n x m) = op(B)^T (n x k) * op(A)^T (k x m).
  const int m = int(g.n), n = int(g.m), k = int(g.k);
  if (g.batch == 1) {
    HG_CUBLAS_CHECK(cublasGemmEx(handle, cublas_op(g.trans_b), cublas_op(g.trans_a), m, n, k, alpha, g.b, ab,
                                 int(g.ldb), g.a, ab, int(g.lda), beta, g.c, c, int(g.ldc), compute,
                                 CUBLAS_GEMM_DEFAULT),
                    "matmul");
  } else {
    HG_CUBLAS_CHECK(cublasGemmStridedBatchedEx(handle, cublas_op(g.trans_b), cublas_op(g.trans_a), m, n, k, alpha, g.b,
                                               ab, int(g.ldb), g.stride_b, g.a, ab, int(g.lda), g.stride_a, beta, g.c, c,
                                               int(g.ldc), g.stride_c, int(g.batch), compute, CUBLAS_GEMM_DEFAULT),
                    "matmul");
  }
}

// ---- integers: one thread per output element; unsigned arithmetic so that overflow wraps (as the CPU)

struct IntGemm {
  bool trans_a, trans_b;
  int64_t m, n, k, batch;
  const void* a;
  int64_t lda, stride_a;
  const void* b;
  int64_t ldb, stride_b;
  void* c;
  int64_t ldc, stride_c;
};

template <typename T> __global__ void gemm_integer_kernel(IntGemm g, std::make_unsigned_t<T> alpha,
                                                          std::make_unsigned_t<T> beta, bool use_beta) {
  using U = std::make_unsigned_t<T>;
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
  if (i >= g.m || j >= g.n) return;
  for (int64_t bi = blockIdx.z; bi < g.batch; bi += gridDim.z) {
    const T* a = static_cast<const T*>(g.a) + bi * g.stride_a;
    const T* b = static_cast<const T*>(g.b) + bi * g.stride_b;
    T* c = static_cast<T*>(g.c) + bi * g.stride_c;
    U acc = 0;
    for (int64_t p = 0; p < g.k; ++p) {
      const U av = U(g.trans_a ? a[p * g.lda + i] : a[i * g.lda + p]);
      const U bv = U(g.trans_b ? b[j * g.ldb + p] : b[p * g.ldb + j]);
      acc += av * bv;
    }
    U v = alpha * acc;
    if (use_beta) v += beta * U(c[i * g.ldc + j]);
    c[i * g.ldc + j] = T(v);
  }
}

void gemm_integer(const GemmArgs& g) {
  HG_CHECK(g.c_dtype == g.ab_dtype, "matmul (cuda): operands {} with output {} are not supported",
           dtype_name(g.ab_dtype), dtype_name(g.c_dtype));
  IntGemm p{g.trans_a == Trans::Yes, g.trans_b == Trans::Yes, g.m, g.n, g.k, g.batch, g.a, g.lda, g.stride_a,
            g.b, g.ldb, g.stride_b, g.c, g.ldc, g.stride_c};
  cuda::DeviceGuard guard(g.device);
  cudaStream_t stream = cuda::current_stream(g.device);
  const dim3 block(16, 16);
  const dim3 grid(unsigned((g.n + 15) / 16), unsigned((g.m + 15) / 16), unsigned(std::min<int64_t>(g.batch, 65535)));
  auto launch = [&]<typename T>() {
    using U = std::make_unsigned_t<T>;
    gemm_integer_kernel<T><<<grid, block, 0, stream>>>(p, U(T(g.alpha)), U(T(g.beta)), g.beta != 0);
    HG_CUDA_CHECK_LAUNCH("matmul");
  };
  switch (g.ab_dtype) {
    case DType::UInt8: launch.template operator()<uint8_t>(); break;
    case DType::Int32: launch.template operator()<int32_t>(); break;
    case DType::Int64: launch.template operator()<int64_t>(); break;
    default: throw_unsupported_dtype("matmul", g.ab_dtype);
  }
}

// k == 0, an empty sum: C = beta * C, and with beta == 0 C is write-only (zeros, whatever it held). Done
// here rather than trusting every BLAS to treat a zero inner dimension so.
template <typename T> __global__ void gemm_empty_sum_kernel(T* c, int64_t m, int64_t n, int64_t ldc, int64_t stride_c,
                                                            int64_t batch, opmath_t<T> beta) {
  const int64_t total = batch * m * n;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bi = e / (m * n), i = e / n % m, j = e % n;
    T& x = c[bi * stride_c + i * ldc + j];
    x = beta == opmath_t<T>(0) ? T(0) : T(beta * opmath_t<T>(x));
  }
}

void gemm_empty_sum(const GemmArgs& g) {
  HG_CHECK(g.c_dtype == g.ab_dtype || is_floating(g.c_dtype), "matmul (cuda): output {} is not supported",
           dtype_name(g.c_dtype));
  cuda::DeviceGuard guard(g.device);
  cudaStream_t stream = cuda::current_stream(g.device);
  const int64_t total = g.batch * g.m * g.n;
  const unsigned blocks = unsigned(std::min<int64_t>((total + 255) / 256, 65535));
  dispatch_numeric(g.c_dtype, "matmul", [&]<typename T>() {
    gemm_empty_sum_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<T*>(g.c), g.m, g.n, g.ldc, g.stride_c, g.batch,
                                                         opmath_t<T>(g.beta));
    HG_CUDA_CHECK_LAUNCH("matmul");
  });
}

void gemm_cuda(const GemmArgs& g) {
  HG_CHECK(g.device.is_cuda(), "matmul: CUDA kernel given device {}", g.device.str());
  HG_CHECK(!g.device_scalars || (is_floating(g.ab_dtype) && !g.bias && g.alpha == 1 && g.beta == 0),
           "matmul (cuda): alpha and beta in device memory take floating operands, no bias, and alpha 1 and beta 0 "
           "on the host (got {} operands, alpha {}, beta {}{})", dtype_name(g.ab_dtype), g.alpha, g.beta,
           g.bias ? ", a bias" : "");
  if (g.batch == 0 || g.m == 0 || g.n == 0) return;
  if (std::optional<PaddedProblem> p = padded_problem(g)) {
    gemm_padded(g, *p);
  } else if (g.bias) {
    cuda::DeviceGuard guard(g.device);
    write_bias_rows(g, g.c, g.ldc, cuda::current_stream(g.device));
    gemm_cuda(start_from_bias(g));
  } else if (g.k == 0) {
    gemm_empty_sum(g);
  } else if (is_floating(g.ab_dtype)) {
    gemm_cublas(g);
  } else {
    gemm_integer(g);
  }
}

}  // namespace

HG_REGISTER_KERNEL(gemm_kernel, CUDA, gemm_cuda);

}  // namespace halfgrad
