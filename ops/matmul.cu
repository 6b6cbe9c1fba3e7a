// GEMM on CUDA: the kernel behind gemm_kernel (ops/matmul.h), through cuBLAS.
//
//   float16 / bfloat16   tensor cores, products accumulated in float32 (CUBLAS_COMPUTE_32F; the handle
//                        also forbids reduced-precision split-K reductions, see core/cuda.cpp)
//   float32              full float32 by default; TF32 tensor cores after cuda::set_allow_tf32(true)
//   float64              CUBLAS_COMPUTE_64F
//   integers             a plain CUDA kernel (no BLAS does integer GEMM), wrapping on overflow as the CPU
// Our matrices are row-major and cuBLAS's column-major: a row-major C = op(A) op(B) is the column-major
// C^T = op(B)^T op(A)^T, so the call swaps the operands and m with n (GemmArgs in ops/matmul.h).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <type_traits>
#include <utility>

#include "core/cuda.h"
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
  const cudaDataType_t ab = cuda_type(g.ab_dtype), c = cuda_type(g.c_dtype);

  cuda::DeviceGuard guard(g.device);
  cublasHandle_t handle = cuda::cublas_handle(g.device.index);
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
  if (g.batch == 0 || g.m == 0 || g.n == 0) return;
  if (g.k == 0) {
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
