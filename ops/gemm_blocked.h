#pragma once
// The CPU's float32 GEMM on AVX2 and AVX-512 machines: packed panels and a register-blocked micro-kernel
// (BLIS-style). gemm_cpu (ops/matmul.cpp) sends it the float32 products it suits; Eigen does the rest (float64,
// thin products, and builds for CPUs without AVX2 and FMA).
#include <cstdint>

#include "ops/matmul.h"

namespace halfgrad::gemm_blocked {

// Whether this build has the kernel (compiled for AVX2 + FMA or AVX-512) and the product is worth packing: at
// least a few full tiles. Thinner products (matrix-vector, tiny matrices) go to Eigen's dedicated paths.
bool suits(const GemmArgs& g);

// C = alpha op(A) op(B) + beta C (+ g.bias on every row, with beta 0) for one matrix of g (g's sizes, transposes
// and leading dimensions; a, b, c point at that matrix), k > 0; beta == 0 never reads C. threads > 1 splits the
// product across an OpenMP team.
void run(const GemmArgs& g, const float* a, const float* b, float* c, int threads);

}  // namespace halfgrad::gemm_blocked
