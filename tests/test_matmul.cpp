// Matrix products: matmul / bmm / linear against a naive float64 reference for every dtype, rank
// combination, broadcast and stride pattern; their errors; half precision accumulation; gradchecks.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <string>

#include "halfgrad.h"
#include "ops/matmul.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::check_close;
using halfgrad::testing::check_matches;
using halfgrad::testing::error_of;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;
using halfgrad::testing::values;
using halfgrad::testing::Reference;

namespace {

// torch.matmul computed the obvious way, in float64, from the operands' values. Also returns, per output
// element, sum_p |a_ip| |b_pj|: the scale that a floating-point dot product's rounding error is relative to.
Reference reference_matmul(const Tensor& a, const Tensor& b) {
  Shape sa = a.shape(), sb = b.shape();
  const bool a_vector = sa.size() == 1, b_vector = sb.size() == 1;
  if (a_vector) sa.insert(sa.begin(), 1);
  if (b_vector) sb.push_back(1);
  const int64_t m = sa[sa.size() - 2], k = sa.back(), n = sb.back();
  REQUIRE(sb[sb.size() - 2] == k);
  Shape batch_a(sa.begin(), sa.end() - 2), batch_b(sb.begin(), sb.end() - 2);
  Shape batch = broadcast_shapes(batch_a, batch_b, "reference");
  std::vector<double> av = to_vector<double>(a), bv = to_vector<double>(b);

  // Row-major index into a batch of `shape` (aligned to the right of `batch`, size-1 dims broadcast).
  auto batch_index = [&](const Shape& shape, const Shape& idx) {
    int64_t linear = 0;
    const size_t lead = batch.size() - shape.size();
    for (size_t d = 0; d < shape.size(); ++d) linear = linear * shape[d] + (shape[d] == 1 ? 0 : idx[lead + d]);
    return linear;
  };

  Reference r;
  r.shape = batch;
  if (!a_vector) r.shape.push_back(m);
  if (!b_vector) r.shape.push_back(n);
  const int64_t count = numel_of(batch);
  Shape idx(batch.size(), 0);
  for (int64_t bi = 0; bi < count; ++bi) {
    int64_t rem = bi;
    for (size_t d = batch.size(); d-- > 0;) {
      idx[d] = rem % batch[d];
      rem /= batch[d];
    }
    const double* A = av.data() + batch_index(batch_a, idx) * m * k;
    const double* B = bv.data() + batch_index(batch_b, idx) * k * n;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0, mag = 0;
        for (int64_t p = 0; p < k; ++p) {
          sum += A[i * k + p] * B[p * n + j];
          mag += std::abs(A[i * k + p] * B[p * n + j]);
        }
        r.values.push_back(sum);
        r.magnitude.push_back(mag);
      }
    }
  }
  return r;
}

// linear(x, w, bias) = x w^T + bias on every row, from reference_matmul.
Reference reference_linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  Reference ref = reference_matmul(x, w.t());
  const std::vector<double> bv = to_vector<double>(bias);
  for (size_t i = 0; i < ref.values.size(); ++i) {
    ref.values[i] += bv[i % bv.size()];
    ref.magnitude[i] += std::abs(bv[i % bv.size()]);
  }
  return ref;
}

// Random values of a dtype: normal for floats, small integers for integer types (products stay exact).
Tensor random(const Shape& shape, DType dtype) {
  if (is_floating(dtype)) return randn(shape, {.dtype = kFloat64}).to(dtype);
  return randint(dtype == kUInt8 ? 0 : -5, 6, shape, {.dtype = dtype});
}

const std::vector<DType> kGemmDtypes = {kFloat64, kFloat32, kFloat16, kBFloat16, kInt64, kInt32, kUInt8};

// (shape of a, shape of b): every rank combination torch.matmul accepts, broadcast batch dims included.
const std::vector<std::pair<Shape, Shape>> kRankCases = {
    {{5}, {5}},                    // dot product -> 0-d
    {{5}, {5, 3}},                 // vector x matrix
    {{4, 5}, {5}},                 // matrix x vector
    {{4, 5}, {5, 3}},              // matrix x matrix
    {{5}, {2, 5, 3}},              // vector x stack
    {{2, 4, 5}, {5}},              // stack x vector
    {{2, 4, 5}, {5, 3}},           // stack x shared matrix (folded into one GEMM)
    {{4, 5}, {2, 5, 3}},           // shared matrix x stack
    {{2, 4, 5}, {2, 5, 3}},        // same batch
    {{2, 1, 4, 5}, {3, 5, 2}},     // broadcast batch dims: [2, 1] with [3] -> [2, 3]
    {{1, 3, 4, 5}, {2, 1, 5, 2}},  // broadcast on both sides
    {{3, 1, 5}, {3, 5, 1}},        // batched dot products
    {{0, 4, 5}, {5, 3}},           // empty batch
    {{4, 0}, {0, 3}},              // empty inner dim: zeros
};

}  // namespace

TEST_CASE("matmul matches a float64 reference for every rank combination and dtype") {
  manual_seed(11);
  for (DType dt : kGemmDtypes) {
    for (const auto& [sa, sb] : kRankCases) {
      CAPTURE(std::string(dtype_name(dt)));
      CAPTURE(shape_str(sa));
      CAPTURE(shape_str(sb));
      Tensor a = random(sa, dt), b = random(sb, dt);
      check_matches(matmul(a, b), reference_matmul(a, b), dt);
      check_matches(a.matmul(b), reference_matmul(a, b), dt);
    }
  }
}

TEST_CASE("matmul of large operands matches the reference (blocked and multi-threaded GEMM paths)") {
  manual_seed(12);
  // 130 x 257 x 65: not multiples of any SIMD width or block size; batched small and large products.
  for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16, kInt32}) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor a = random({130, 257}, dt), b = random({257, 65}, dt);
    check_matches(matmul(a, b), reference_matmul(a, b), dt);
    Tensor sa = random({9, 13, 17}, dt), sb = random({9, 17, 7}, dt);  // many small: threads over the batch
    check_matches(matmul(sa, sb), reference_matmul(sa, sb), dt);
    Tensor la = random({3, 150, 140}, dt), lb = random({3, 140, 130}, dt);  // few large: threads inside each
    check_matches(matmul(la, lb), reference_matmul(la, lb), dt);
  }
}

TEST_CASE("float32 products larger than the GEMM's cache blocks match the reference, in every layout") {
  // The float32 kernel (ops/gemm_blocked.cpp) blocks m by up to 4096, n by 512 and k by 256 and computes tiles of
  // 6 x 64 (AVX-512) or 6 x 16 (AVX2): these sizes cross every block boundary, with partial tiles at each edge.
  manual_seed(20);
  Tensor a = random({4099, 260}, kFloat32), b = random({260, 530}, kFloat32);
  check_matches(matmul(a, b), reference_matmul(a, b), kFloat32);
  // Transposed storage of either operand (the kernel packs both layouts), with k > 256.
  Tensor at = random({520, 70}, kFloat32).t(), bt = random({100, 520}, kFloat32).t();  // [70, 520], [520, 100]
  Tensor a2 = random({70, 520}, kFloat32), b2 = random({520, 100}, kFloat32);
  check_matches(matmul(at, b2), reference_matmul(at, b2), kFloat32);
  check_matches(matmul(a2, bt), reference_matmul(a2, bt), kFloat32);
  check_matches(matmul(at, bt), reference_matmul(at, bt), kFloat32);
  // Accumulating onto C (beta = 1): linear's fused bias, over several k blocks.
  Tensor x = random({70, 600}, kFloat32), w = random({100, 600}, kFloat32), bias = random({100}, kFloat32);
  check_matches(linear(x, w, bias), reference_linear(x, w, bias), kFloat32);
}

TEST_CASE("float32 products with a thin side match the reference: the language model's decoder and its gradients") {
  // The decoder's three products, scaled down: y = x W^T + b (k small), dx = g W (n = 32: A and B read in place)
  // and dW = g^T x (A transposed, packed 16 steps at a time), each over several k blocks and with partial tiles.
  manual_seed(21);
  Tensor x = random({70, 32}, kFloat32), w = random({3001, 32}, kFloat32), bias = random({3001}, kFloat32);
  Tensor g = random({70, 3001}, kFloat32);
  check_matches(linear(x, w, bias), reference_linear(x, w, bias), kFloat32);
  check_matches(matmul(g, w), reference_matmul(g, w), kFloat32);
  check_matches(matmul(g.t(), x), reference_matmul(g.t(), x), kFloat32);
  // k = 600 with a transposed A (3 k blocks, the last partial; 29 columns: a partial second tile).
  Tensor gt = random({600, 1003}, kFloat32).t(), x2 = random({600, 29}, kFloat32);
  check_matches(matmul(gt, x2), reference_matmul(gt, x2), kFloat32);
  // The same B under a row-major A: both read in place, but for B's partial panel (columns 16-28), which is packed.
  Tensor g2 = random({70, 600}, kFloat32);
  check_matches(matmul(g2, x2), reference_matmul(g2, x2), kFloat32);
  // The same on AVX-512's 64-wide panels: two whole ones (n = 128), and one whole and one partial (n = 100).
  for (int64_t n : {128, 100}) {
    Tensor b2 = random({600, n}, kFloat32);
    check_matches(matmul(g2, b2), reference_matmul(g2, b2), kFloat32);
  }
}

TEST_CASE("matmul reads transposed, strided and broadcast operands correctly") {
  manual_seed(13);
  for (DType dt : kGemmDtypes) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor at = random({5, 4}, dt).t(), bt = random({3, 5}, dt).t();  // column-major [4, 5] and [5, 3]
    check_matches(matmul(at, bt), reference_matmul(at, bt), dt);
    Tensor b = random({5, 3}, dt);
    check_matches(matmul(at, b), reference_matmul(at, b), dt);

    // Neither stride is 1 (every other row and column): copied to contiguous first.
    Tensor as = random({8, 10}, dt).slice(0, 0, 8, 2).slice(1, 0, 10, 2);  // [4, 5]
    check_matches(matmul(as, b), reference_matmul(as, b), dt);

    // Stacks with permuted dims: transposed matrices, batch dim in the middle of the storage order.
    Tensor ap = random({5, 2, 4}, dt).permute({1, 2, 0});  // [2, 4, 5], matrices column-major
    Tensor bp = random({3, 5, 2}, dt).permute({2, 1, 0});  // [2, 5, 3], batch stride 1
    check_matches(matmul(ap, bp), reference_matmul(ap, bp), dt);
    check_matches(matmul(ap, b), reference_matmul(ap, b), dt);  // a stack that cannot fold into one GEMM

    // Broadcast views: a stride-0 batch dim, a matrix whose rows are all the same (stride 0 rows).
    Tensor ae = random({1, 4, 5}, dt).expand({3, 4, 5});
    Tensor be = random({1, 5}, dt).expand({5, 5});
    check_matches(matmul(ae, be), reference_matmul(ae, be), dt);

    // Strided vectors.
    Tensor v = random({10}, dt).slice(0, 0, 10, 2);  // [5], stride 2
    check_matches(matmul(v, v), reference_matmul(v, v), dt);
    check_matches(matmul(at, v), reference_matmul(at, v), dt);
    check_matches(matmul(v, b), reference_matmul(v, b), dt);
  }
}

TEST_CASE("matmul accumulates float16 and bfloat16 products in float32") {
  // 4096 products of 1 * 1. A float16 running sum stops growing at 2048 (2049 is not representable:
  // the spacing there is 2), a bfloat16 one at 256; float32 accumulation gives exactly 4096, which both
  // half types represent exactly.
  for (DType dt : {kFloat16, kBFloat16}) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor a = ones({1, 4096}, {.dtype = dt}), b = ones({4096, 1}, {.dtype = dt});
    CHECK(matmul(a, b).item<double>() == 4096.0);
    CHECK(matmul(ones({4096}, {.dtype = dt}), ones({4096}, {.dtype = dt})).item<double>() == 4096.0);
    // Many small terms: a float16 running sum of 2^-11 stalls near 1, where the spacing becomes 2^-10.
    Tensor x = full({1, 4097}, 1.0 / 2048, {.dtype = dt});
    Tensor y = ones({4097, 1}, {.dtype = dt});
    CHECK(matmul(x, y).item<double>() == doctest::Approx(4097.0 / 2048).epsilon(halfgrad::testing::product_tolerance(dt)));
  }
}

TEST_CASE("bmm multiplies matching batches and rejects anything else") {
  manual_seed(14);
  for (DType dt : {kFloat64, kFloat32, kBFloat16, kInt64}) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor a = random({3, 4, 5}, dt), b = random({3, 5, 2}, dt);
    check_matches(bmm(a, b), reference_matmul(a, b), dt);
    Tensor bt = random({3, 2, 5}, dt).transpose(1, 2);
    check_matches(bmm(a, bt), reference_matmul(a, bt), dt);
  }
  std::string batch = error_of([] { bmm(ones({3, 4, 5}), ones({2, 5, 2})); });
  CHECK(batch.find("bmm") != std::string::npos);
  CHECK(batch.find("[3, 4, 5]") != std::string::npos);
  CHECK(batch.find("[2, 5, 2]") != std::string::npos);
  CHECK_THROWS_WITH_AS(bmm(ones({4, 5}), ones({5, 2})), doctest::Contains("bmm: expected two 3-D tensors"), Error);
  CHECK_THROWS_WITH_AS(bmm(ones({1, 4, 5}), ones({1, 4, 2})), doctest::Contains("cannot be multiplied"), Error);
}

TEST_CASE("linear computes x W^T + b for any leading dims of x") {
  manual_seed(15);
  for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16, kInt32}) {
    CAPTURE(std::string(dtype_name(dt)));
    Tensor w = random({3, 5}, dt), bias = random({3}, dt);
    for (const Shape& xs : {Shape{5}, Shape{4, 5}, Shape{2, 4, 5}, Shape{2, 3, 1, 5}, Shape{0, 5}}) {
      CAPTURE(shape_str(xs));
      Tensor x = random(xs, dt);
      Reference ref = reference_matmul(x, w.t());
      check_matches(linear(x, w), ref, dt);
      // With bias: the reference adds the bias in float64; compare in the same way, bias included.
      Tensor got = linear(x, w, bias);
      std::vector<double> bv = to_vector<double>(bias);
      for (size_t i = 0; i < ref.values.size(); ++i) {
        ref.values[i] += bv[i % 3];
        ref.magnitude[i] += std::abs(bv[i % 3]);
      }
      check_matches(got, ref, dt);
    }
    // A non-contiguous x (transposed leading dims) and a transposed weight.
    Tensor x = random({4, 2, 5}, dt).transpose(0, 1);  // [2, 4, 5]
    Tensor wt = random({5, 3}, dt).t();                 // [3, 5], column-major
    check_matches(linear(x, wt), reference_matmul(x, wt.t()), dt);
  }
}

TEST_CASE("linear with a 1-D weight gives one feature and drops its dim, with or without a bias of one value") {
  Tensor x = tensor<float>({1, 2, 3, 4, 5, 6}).reshape({2, 3});
  Tensor w = tensor<float>({1, 0, -1});
  CHECK(linear(x, w).shape() == Shape{2});
  CHECK(to_vector<float>(linear(x, w)) == std::vector<float>{-2, -2});
  CHECK(to_vector<float>(linear(x, w, scalar_tensor(0.5f))) == std::vector<float>{-1.5, -1.5});
  CHECK(to_vector<float>(linear(x, w, tensor<float>({1}))) == std::vector<float>{-1, -1});
  Tensor dot = linear(tensor<float>({1, 2, 3}), w);  // a 1-D input: a 0-d result
  CHECK(dot.dim() == 0);
  CHECK(dot.item<float>() == -2);
  CHECK_THROWS_WITH_AS(linear(x, w, tensor<float>({1, 2})),
                       doctest::Contains("linear: with a 1-D weight [3] the bias must be one value (0-d or [1]), got "
                                         "shape [2]"), Error);
  CHECK_THROWS_WITH_AS(linear(x, w, tensor<double>({1})),
                       doctest::Contains("linear: expected weight and bias to have the same dtype, got float32[3] cpu "
                                         "and float64[1] cpu"), Error);
  manual_seed(20);
  gradcheck([](const TensorList& in) { return linear(in[0], in[1], in[2]); }, {leaf({4, 5}), leaf({5}), leaf({})});
  gradcheck([](const TensorList& in) { return linear(in[0], in[1]); }, {leaf({2, 3, 5}), leaf({5})});
}

TEST_CASE("matmul, bmm and linear report mismatched shapes, dtypes and devices with the operands") {
  std::string shapes = error_of([] { matmul(ones({2, 3}), ones({4, 5})); });
  CHECK(shapes.find("matmul") != std::string::npos);
  CHECK(shapes.find("[2, 3]") != std::string::npos);
  CHECK(shapes.find("[4, 5]") != std::string::npos);

  std::string batch = error_of([] { matmul(ones({2, 3, 4}), ones({3, 4, 5})); });
  CHECK(batch.find("matmul") != std::string::npos);
  CHECK(batch.find("[2, 3, 4]") != std::string::npos);
  CHECK(batch.find("[3, 4, 5]") != std::string::npos);

  std::string dtypes = error_of([] { matmul(ones({2, 3}), ones({3, 4}, {.dtype = kFloat64})); });
  CHECK(dtypes.find("matmul") != std::string::npos);
  CHECK(dtypes.find("float32[2, 3] cpu") != std::string::npos);
  CHECK(dtypes.find("float64[3, 4] cpu") != std::string::npos);

  CHECK_THROWS_WITH_AS(matmul(ones({}), ones({3})), doctest::Contains("matmul: both arguments need at least 1"), Error);
  CHECK_THROWS_WITH_AS(matmul(ones({2, 2}, {.dtype = kBool}), ones({2, 2}, {.dtype = kBool})),
                       doctest::Contains("bool"), Error);
  CHECK_THROWS_WITH_AS(matmul(ones({3}), ones({4})), doctest::Contains("[3] and [4] cannot be multiplied"), Error);

  std::string lin = error_of([] { linear(ones({4, 6}), ones({3, 5})); });
  CHECK(lin.find("linear") != std::string::npos);
  CHECK(lin.find("[4, 6]") != std::string::npos);
  CHECK(lin.find("[3, 5]") != std::string::npos);
  std::string lin_dtype = error_of([] { linear(ones({4, 5}), ones({3, 5}, {.dtype = kFloat16})); });
  CHECK(lin_dtype.find("float32[4, 5] cpu") != std::string::npos);
  CHECK(lin_dtype.find("float16[3, 5] cpu") != std::string::npos);
  CHECK_THROWS_WITH_AS(linear(ones({4, 5}), ones({3, 5}), ones({4})), doctest::Contains("linear: bias shape [4]"),
                       Error);
  CHECK_THROWS_WITH_AS(linear(ones({4, 5}), ones({3, 5}), ones({3}, {.dtype = kFloat64})),
                       doctest::Contains("float64[3] cpu"), Error);
  CHECK_THROWS_WITH_AS(linear(ones({4, 5}), ones({3, 1, 5})), doctest::Contains("linear: weight must be 2-D"), Error);
  CHECK_THROWS_WITH_AS(linear(ones({4, 5}), ones({15})),
                       doctest::Contains("linear: input shape [4, 5] does not match weight shape [15]"), Error);
}

TEST_CASE("gemm with alpha and beta in device memory is an error on the CPU, naming it") {
  Tensor a = randn({2, 3}), b = randn({3, 4}), c = empty({2, 4}), scalars = tensor(std::vector<float>{2.0f, 0.0f});
  CHECK_THROWS_WITH_AS(gemm_dense(Device::cpu(), kFloat32, kFloat32, 2, 4, 3, a.data_ptr(), Trans::No, b.data_ptr(),
                                  Trans::No, c.data_ptr(), 0, nullptr, scalars.data_ptr()),
                       doctest::Contains("gemm (cpu): alpha and beta in device memory are for CUDA products"), Error);
}

// Gradchecks: float64, central differences (tests/gradcheck.h). Products are linear in each operand, so the
// finite differences are exact up to rounding and the default tolerances hold with a wide margin.
TEST_CASE("matmul gradients match finite differences for every rank combination") {
  manual_seed(16);
  for (const auto& [sa, sb] : kRankCases) {
    if (numel_of(sa) == 0 || numel_of(sb) == 0) continue;
    CAPTURE(shape_str(sa));
    CAPTURE(shape_str(sb));
    gradcheck([](const TensorList& in) { return matmul(in[0], in[1]); }, {leaf(sa), leaf(sb)});
  }
  // Transposed operands, and one side only requiring grad (the other product is skipped).
  gradcheck([](const TensorList& in) { return matmul(in[0].t(), in[1]); }, {leaf({5, 4}), leaf({5, 3})});
  gradcheck([](const TensorList& in) { return matmul(in[0], in[1]); },
            {leaf({2, 4, 5}), randn({5, 3}, {.dtype = kFloat64})});
  gradcheck([](const TensorList& in) { return matmul(in[0], in[1]); },
            {randn({2, 4, 5}, {.dtype = kFloat64}), leaf({5, 3})});
  // One side only, with a 1-D operand on either side (the backward has only the other operand's shape).
  auto product = [](const TensorList& in) { return matmul(in[0], in[1]); };
  gradcheck(product, {leaf({5}), randn({2, 5, 3}, {.dtype = kFloat64})});
  gradcheck(product, {randn({4, 5}, {.dtype = kFloat64}), leaf({5})});
  gradcheck(product, {randn({5}, {.dtype = kFloat64}), leaf({2, 5, 3})});
}

TEST_CASE("matmul and bmm keep an operand only for the other's gradient: changing it in place is an error only then") {
  for (bool batched : {false, true}) {
    CAPTURE(batched);
    auto product = [&](const Tensor& a, const Tensor& b) { return batched ? bmm(a, b) : matmul(a, b); };
    const Shape sa = batched ? Shape{2, 2, 3} : Shape{2, 3}, sb = batched ? Shape{2, 3, 2} : Shape{3, 2};
    Tensor a = randn(sa), b = randn(sb).requires_grad_();
    Tensor y = product(a, b);
    {
      NoGradGuard no_grad;
      b.mul_(2.0);  // b's gradient is a^T g: b itself is not read
    }
    y.sum().backward();
    check_close(values(b.grad()), values(product(a.transpose(-1, -2), ones(y.shape()))), 1e-6);
    Tensor c = randn(sa).requires_grad_();
    Tensor z = product(c, b);
    {
      NoGradGuard no_grad;
      b.mul_(2.0);  // c's gradient reads b
    }
    CHECK_THROWS_WITH_AS(z.sum().backward(), doctest::Contains("modified by an in-place operation"), Error);
  }
}

TEST_CASE("bmm gradients match finite differences") {
  manual_seed(17);
  gradcheck([](const TensorList& in) { return bmm(in[0], in[1]); }, {leaf({3, 4, 5}), leaf({3, 5, 2})});
  gradcheck([](const TensorList& in) { return bmm(in[0], in[1].transpose(1, 2)); },
            {leaf({2, 3, 4}), leaf({2, 5, 4})});
}

TEST_CASE("linear gradients match finite differences with and without bias, for 1-D to 3-D inputs") {
  manual_seed(18);
  for (const Shape& xs : {Shape{5}, Shape{4, 5}, Shape{2, 3, 5}}) {
    CAPTURE(shape_str(xs));
    gradcheck([](const TensorList& in) { return linear(in[0], in[1], in[2]); }, {leaf(xs), leaf({3, 5}), leaf({3})});
    gradcheck([](const TensorList& in) { return linear(in[0], in[1]); }, {leaf(xs), leaf({3, 5})});
  }
  // Only the parameters need gradients (the usual training case: dx is never computed).
  gradcheck([](const TensorList& in) { return linear(in[0], in[1], in[2]); },
            {randn({2, 3, 5}, {.dtype = kFloat64}), leaf({3, 5}), leaf({3})});
}

TEST_CASE("linear's gradients equal those of the unfused matmul and add") {
  manual_seed(19);
  Tensor x = leaf({2, 3, 5}), w = leaf({4, 5}), b = leaf({4});
  Tensor r = randn({2, 3, 4}, {.dtype = kFloat64});
  (linear(x, w, b) * r).sum().backward();
  Tensor gx = x.grad(), gw = w.grad(), gb = b.grad();
  x.set_grad(Tensor());
  w.set_grad(Tensor());
  b.set_grad(Tensor());
  ((matmul(x, w.t()) + b) * r).sum().backward();
  auto close = [](const Tensor& p, const Tensor& q) {
    std::vector<double> u = to_vector<double>(p), v = to_vector<double>(q);
    REQUIRE(u.size() == v.size());
    for (size_t i = 0; i < u.size(); ++i) CHECK(u[i] == doctest::Approx(v[i]).epsilon(1e-12));
  };
  close(gx, x.grad());
  close(gw, w.grad());
  close(gb, b.grad());
}
