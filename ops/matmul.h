#pragma once
// Matrix products: matmul (torch.matmul's rank rules), bmm, linear; and the GEMM kernel table they share.
//
// Every product ends in one call shape, a (batched, strided) GEMM
//     C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b]        b = 0 .. batch-1
// described by GemmArgs and run by gemm_kernel[device]. The CPU kernel (ops/matmul.cpp) is our AVX2/AVX-512 GEMM
// (ops/gemm_blocked.cpp) for float32 products large enough for it, Eigen's otherwise; the CUDA kernel is cuBLAS
// (cublasGemmStridedBatchedEx or cublasLt), whose arguments GemmArgs mirrors. conv2d's CPU kernels use it too.
#include <cstdint>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// ---- the GEMM problem

// Whether a GEMM operand is used as stored or transposed (CUBLAS_OP_N / CUBLAS_OP_T).
enum class Trans : uint8_t { No, Yes };

// All matrices are ROW-MAJOR, as our tensors are: element (r, c) of a stored matrix with leading dimension
// ld sits at ptr[r * ld + c].
//   op(A) is m x k: A is stored m x k (trans_a = No) or k x m (trans_a = Yes), with leading dimension lda.
//   op(B) is k x n: B is stored k x n (trans_b = No) or n x k (trans_b = Yes), with leading dimension ldb.
//   C is m x n, stored with leading dimension ldc (C is never transposed).
// Batch b uses a + b * stride_a (elements; 0 = the same A for every batch entry), likewise for B and C.
//
// For cuBLAS, which is column-major, a row-major C is a column-major C^T = op(B)^T op(A)^T: call it with
// the operands swapped, (m, n) -> (n, m), (A, lda, stride_a, trans_a) <-> (B, ldb, stride_b, trans_b).
// Leading dimensions and batch strides carry over unchanged.
//
// Types (cublasGemmEx's Atype/Btype/Ctype/computeType): A and B have `ab_dtype`, C has `c_dtype`; the
// products are accumulated in float32 for float16/bfloat16 operands (CUBLAS_COMPUTE_32F) and in the
// operands' own type otherwise. alpha and beta are in the compute type. beta == 0 means C is write-only:
// its old contents are never read (may be uninitialised memory, NaN included), as in BLAS.
struct GemmArgs {
  Trans trans_a = Trans::No;
  Trans trans_b = Trans::No;
  int64_t m = 0, n = 0, k = 0;
  int64_t batch = 1;
  DType ab_dtype = kFloat32;
  DType c_dtype = kFloat32;
  double alpha = 1.0;
  double beta = 0.0;
  const void* a = nullptr;
  int64_t lda = 0, stride_a = 0;
  const void* b = nullptr;
  int64_t ldb = 0, stride_b = 0;
  void* c = nullptr;
  int64_t ldc = 0, stride_c = 0;
  // Optional: n values of c_dtype, dense, added to every row of every C (linear's bias). Each kernel starts C as
  // these rows and accumulates onto them (start_from_bias), so beta must be 0.
  const void* bias = nullptr;
  // Optional, CUDA only: alpha and beta read from device memory when the product runs (cuBLAS's device pointer mode),
  // two values of the accumulation type (float; double for float64) at this address, the second 0; `alpha` and
  // `beta` must then be 1 and 0. For a scale the device computes and the host never sees: linear_cross_entropy's
  // upstream gradient.
  const void* device_scalars = nullptr;
  Device device = Device::cpu();
};

// The bias rule both kernels follow: once a kernel has written g.bias into every row of C, what is left to run is
// g with beta 1 and no bias. Checks that beta is 0.
GemmArgs start_from_bias(const GemmArgs& g);

// The row alignment cuBLAS's tensor-core products want: a row-major matrix whose rows (or leading dimension) are not
// a multiple of it runs on zero-padded copies (ops/matmul.cu); a caller that can shape its operands may avoid them.
constexpr int64_t kGemmAlignBytes = kAlignedRowBytes;  // MemoryFormat::AlignedRows's (core/tensor.h)

using GemmKernel = void (*)(const GemmArgs&);
extern KernelTable<GemmKernel> gemm_kernel;  // CPU: ops/matmul.cpp; CUDA: ops/matmul.cu (cuBLAS)

// The common case through gemm_kernel[device]: dense row-major C [m, n] = op(A) op(B) + beta C (+ bias on every
// row, GemmArgs::bias, with beta 0), A and B dense in `ab`, C in `c_dtype`, the leading dimensions those of dense
// operands (lda = k, or m transposed; ldb = n, or k; ldc = n). Nothing runs when m or n is 0. Used by kernels that
// compute on raw buffers (conv2d's CPU kernels, rnn, linear_cross_entropy).
void gemm_dense(Device device, DType ab, DType c_dtype, int64_t m, int64_t n, int64_t k, const void* a,
                Trans trans_a, const void* b, Trans trans_b, void* c, double beta = 0, const void* bias = nullptr,
                const void* device_scalars = nullptr);

// ---- ops
// Autocast category of all three: "lower precision" (under autocast they run in float16/bfloat16).

// torch.matmul: 1-D x 1-D is a dot product (0-d result); 2-D x 2-D a matrix product; a 1-D operand is
// made a matrix by prepending (left) or appending (right) a dim of 1, removed from the result; N-D operands
// are stacks of matrices whose batch dims (all but the last two) broadcast. Operands must have the same
// dtype and device.
Tensor matmul(const Tensor& a, const Tensor& b);

// Batched matrix product of 3-D tensors with the same batch size: [B, n, m] x [B, m, p] -> [B, n, p].
Tensor bmm(const Tensor& a, const Tensor& b);

// x W^T + bias, as torch.nn.functional.linear: x [..., in], weight [out, in], bias [out] or undefined
// (no bias) -> [..., out]. One GEMM over all leading dims of x, with the bias fused into it. A 1-D weight [in] (and a
// bias of one value) gives [...]: PyTorch's shape rule, where its eager linear refuses most such calls with a bias.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

}  // namespace halfgrad
