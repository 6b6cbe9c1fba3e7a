// Elementwise ops: values against a float64 reference, broadcasting, strides, dtypes, and gradchecks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>

#include "core/int_divider.h"
#include "halfgrad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::values;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

// max |a - b| / max(1, |b|) over all elements.
static double max_rel_error(const Tensor& a, const Tensor& b) {
  std::vector<double> x = values(a), y = values(b);
  REQUIRE(x.size() == y.size());
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(x[i] - y[i]) / std::max(1.0, std::abs(y[i])));
  return worst;
}

// Tolerance of a dtype's rounding: float16 keeps 11 bits, bfloat16 8.
static double tolerance(DType t) {
  switch (t) {
    case kFloat16: return 2e-3;
    case kBFloat16: return 1.6e-2;
    case kFloat32: return 1e-6;
    default: return 1e-12;
  }
}

TEST_CASE("unary ops match the float64 reference in every floating dtype") {
  struct Case {
    std::string name;
    Tensor (*op)(const Tensor&);
    double (*ref)(double);
    bool positive;
  };
  std::vector<Case> cases = {
      {"neg", neg, [](double x) { return -x; }, false},
      {"abs", abs, [](double x) { return std::abs(x); }, false},
      {"exp", exp, [](double x) { return std::exp(x); }, false},
      {"log", log, [](double x) { return std::log(x); }, true},
      {"sqrt", sqrt, [](double x) { return std::sqrt(x); }, true},
      {"rsqrt", rsqrt, [](double x) { return 1 / std::sqrt(x); }, true},
      {"tanh", tanh, [](double x) { return std::tanh(x); }, false},
      {"sigmoid", sigmoid, [](double x) { return 1 / (1 + std::exp(-x)); }, false},
      {"relu", relu, [](double x) { return x > 0 ? x : 0.0; }, false},
      {"sign", sign, [](double x) { return double((0 < x) - (x < 0)); }, false},
  };
  manual_seed(1);
  for (const Case& c : cases) {
    for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16}) {
      CAPTURE(c.name);
      CAPTURE(std::string(dtype_name(dt)));
      Tensor x = randn({37, 5}, {.dtype = kFloat64});
      if (c.positive) x = x.abs() + 0.1;
      Tensor xd = x.to(dt);
      std::vector<double> in = values(xd), expected;
      for (double v : in) expected.push_back(c.ref(v));
      Tensor y = c.op(xd);
      CHECK(y.dtype() == dt);
      CHECK(max_rel_error(y, tensor(expected, {37, 5})) <= tolerance(dt));
    }
  }
}

TEST_CASE("binary ops broadcast over strided inputs and match the reference") {
  manual_seed(2);
  Tensor a = randn({4, 1, 6}, {.dtype = kFloat64});
  Tensor b = randn({6, 5}, {.dtype = kFloat64}).t();  // [5, 6], non-contiguous
  Tensor bp = b.abs() + 0.5;
  std::vector<double> av = values(a.expand({4, 5, 6})), bv = values(b.expand({4, 5, 6})),
                      bpv = values(bp.expand({4, 5, 6}));
  auto reference = [&](auto f, const std::vector<double>& y) {
    std::vector<double> out;
    for (size_t i = 0; i < av.size(); ++i) out.push_back(f(av[i], y[i]));
    return tensor(out, {4, 5, 6});
  };
  CHECK(max_rel_error(a + b, reference(std::plus<>(), bv)) < 1e-15);
  CHECK(max_rel_error(a - b, reference(std::minus<>(), bv)) < 1e-15);
  CHECK(max_rel_error(a * b, reference(std::multiplies<>(), bv)) < 1e-15);
  CHECK(max_rel_error(a / bp, reference(std::divides<>(), bpv)) < 1e-15);
  CHECK(max_rel_error(pow(bp, a), reference([](double x, double y) { return std::pow(y, x); }, bpv)) < 1e-14);
  CHECK(max_rel_error(maximum(a, b), reference([](double x, double y) { return std::max(x, y); }, bv)) == 0);
  CHECK(max_rel_error(minimum(a, b), reference([](double x, double y) { return std::min(x, y); }, bv)) == 0);
  CHECK(max_rel_error(lt(a, b), reference([](double x, double y) { return double(x < y); }, bv)) == 0);
  CHECK(lt(a, b).dtype() == kBool);
  CHECK(max_rel_error(add(a, b, 2.5), reference([](double x, double y) { return x + 2.5 * y; }, bv)) < 1e-15);
}

TEST_CASE("elementwise ops over channels-last, permuted and mixed layouts equal the NCHW results") {
  // The loop walks the output's memory order: a channels-last problem is one flat run, a mix of layouts or a
  // broadcast bias over channels last is strided. Every element must land where its indices say.
  manual_seed(3);
  Tensor a = randn({3, 8, 5, 7}, {.dtype = kFloat64}), b = randn({3, 8, 5, 7}, {.dtype = kFloat64});
  Tensor bias = randn({8, 1, 1}, {.dtype = kFloat64});
  Tensor a_cl = contiguous_channels_last(a), b_cl = contiguous_channels_last(b);
  Tensor sum = a_cl + b_cl;
  CHECK(sum.stride(1) == 1);  // the result stays channels last
  CHECK(values(sum) == values(a + b));
  CHECK(values(relu(a_cl)) == values(relu(a)));
  CHECK(values(where(a_cl.gt(0.0), a_cl, b_cl)) == values(where(a.gt(0.0), a, b)));
  CHECK(values(a_cl + bias) == values(a + bias));
  CHECK(values(a_cl * b) == values(a * b));
  Tensor p = randn({7, 5, 8, 3}, {.dtype = kFloat64});  // [3, 8, 5, 7] over [7, 5, 8, 3] memory
  CHECK(values(p.permute({3, 2, 1, 0}) - b_cl) == values(p.permute({3, 2, 1, 0}).contiguous() - b));
  Tensor y = contiguous_channels_last(a.clone());
  REQUIRE(y.stride(1) == 1);
  y.add_(b);  // in place into channels-last memory from an NCHW operand
  CHECK(values(y) == values(a + b));
}

TEST_CASE("float16 elementwise ops over blocks of widened values give float32's results rounded to float16") {
  // Contiguous float16 runs are widened 512 values at a time; 1,500 values leave a partial last block, and a
  // transposed view takes the one-value-at-a-time path. Each result is float32's, rounded once.
  manual_seed(4);
  Tensor a32 = randn({1500}), b32 = randn({1500});
  Tensor a = a32.to(kFloat16), b = b32.to(kFloat16);
  Tensor a_exact = a.to(kFloat32), b_exact = b.to(kFloat32);  // the float16 values, in float32
  CHECK(values(a + b) == values((a_exact + b_exact).to(kFloat16)));
  CHECK(values(a * b) == values((a_exact * b_exact).to(kFloat16)));
  CHECK(values(relu(a)) == values(relu(a_exact).to(kFloat16)));
  CHECK(values(exp(a)) == values(exp(a_exact).to(kFloat16)));
  CHECK(values(a.gt(b)) == values(a_exact.gt(b_exact)));
  CHECK(values(where(a.gt(0.0), a, b)) == values(where(a_exact.gt(0.0), a_exact, b_exact).to(kFloat16)));
  Tensor at = a.view({30, 50}).t(), bt = b.view({30, 50}).t();
  CHECK(values(at + bt) == values((a_exact.view({30, 50}).t() + b_exact.view({30, 50}).t()).to(kFloat16)));
}

TEST_CASE("a copy within one dtype keeps every bit, NaN payloads and signed zeros, in any layout") {
  // A float16 clone once widened and narrowed its values, which turns every NaN into the canonical one.
  std::vector<uint16_t> bits = {0x7c01, 0x7d00, 0xfe01, 0x8000, 0x0001, 0x3c00, 0x7bff, 0xfc00};
  Tensor h = empty({8}, {.dtype = kFloat16});
  std::memcpy(h.data_ptr(), bits.data(), bits.size() * sizeof(uint16_t));
  auto bits_of = [](const Tensor& t) {
    Tensor c = t.is_contiguous() ? t : t.contiguous();
    std::vector<uint16_t> out(size_t(c.numel()));
    std::memcpy(out.data(), c.data_ptr(), out.size() * sizeof(uint16_t));
    return out;
  };
  CHECK(bits_of(h.clone()) == bits);
  Tensor back = h.view({2, 4}).t().contiguous().t().contiguous();  // through the strided path and back
  CHECK(bits_of(back) == bits);
}

TEST_CASE("copy_each_ copies every pair as copy_ does: casts, strides, empty tensors, a mismatched pair is an error") {
  TensorList src = {randn({3, 4}), randn({5}).to(kFloat16), randn({2, 3}).t(), randint(0, 9, {7}), randn({0}),
                    randn({4})};
  TensorList dst = {empty({3, 4}), empty({5}, {.dtype = kFloat16}), empty({3, 2}), empty({7}, {.dtype = kInt64}),
                    empty({0}), empty({4}, {.dtype = kFloat64})};  // a transposed source; a cast
  copy_each_(dst, src);
  for (size_t i = 0; i < src.size(); ++i) {
    CAPTURE(i);
    CHECK(values(dst[i]) == values(src[i].to(dst[i].dtype())));
  }
  CHECK_THROWS_WITH(copy_each_({empty({2}), empty({2})}, {empty({2}), empty({3})}),
                    doctest::Contains("copy_each_: pair 1: float32[2] cpu <- float32[3] cpu"));
  CHECK_THROWS_WITH(copy_each_({empty({2})}, {}), doctest::Contains("copy_each_: 1 destinations for 0 sources"));
}

TEST_CASE("scalar operands on either side") {
  Tensor x = tensor(std::vector<double>{1, 2, 4});
  CHECK(values(x + 1) == std::vector<double>{2, 3, 5});
  CHECK(values(1 - x) == std::vector<double>{0, -1, -3});
  CHECK(values(x * 0.5) == std::vector<double>{0.5, 1, 2});
  CHECK(values(8 / x) == std::vector<double>{8, 4, 2});
  CHECK(values(x.pow(2)) == std::vector<double>{1, 4, 16});
  CHECK(values(pow(2, x)) == std::vector<double>{2, 4, 16});
  CHECK(values(x.gt(1.5)) == std::vector<double>{0, 1, 1});
  CHECK(values(arange(5).pow(2)) == std::vector<double>{0, 1, 4, 9, 16});
  CHECK(arange(5).pow(2).dtype() == kInt64);
}

TEST_CASE("float16 and bfloat16 arithmetic reads a number in float32, comparisons and pow read it in their dtype") {
  // PyTorch 2.11 on an H100: float16(1000) * 1e-8 is 1.0013580322265625e-05 on CUDA and on the CPU. 1e-8 rounded to
  // float16 first would be 0. The result is float16 (168 of its subnormal steps of 2^-24).
  const double product = 1.0013580322265625e-05;
  const Tensor x = full({2}, 1000.0, {.dtype = kFloat16});
  CHECK((x * 1e-8).dtype() == kFloat16);
  CHECK(values(x * 1e-8) == std::vector<double>{product, product});
  CHECK(values(1e-8 * x) == std::vector<double>{product, product});
  CHECK(values(x * scalar_tensor(1e-8, {.dtype = kFloat64})) == std::vector<double>{product, product});  // a 0-d tensor
  Tensor y = x.clone();
  y.mul_(1e-8);
  CHECK(values(y) == std::vector<double>{product, product});
  // 70000 is inf in float16: x / 70000 would be 0; in float32 it is 1000 / 70000, rounded once to float16.
  CHECK(values(x / 70000.0) == std::vector<double>{0.0142822265625, 0.0142822265625});
  // A 0-d float16 tensor beside a number stays float16, and reads it the same way.
  const Tensor x0 = scalar_tensor(1000.0, {.dtype = kFloat16});
  CHECK((x0 * 1e-8).dtype() == kFloat16);
  CHECK((x0 * 1e-8).item<double>() == product);
  CHECK((1e-8 * x0).item<double>() == product);  // the number on the left of a 0-d tensor too
  // bfloat16: 3 * 0.3 is 0.9 in float32, 0.8984375 in bfloat16; with 0.3 rounded first (0.30078125), 0.90234375.
  CHECK(values(full({1}, 3.0, {.dtype = kBFloat16}) * 0.3) == std::vector<double>{0.8984375});
  const Tensor b0 = scalar_tensor(3.0, {.dtype = kBFloat16});
  CHECK((0.3 * b0).item<double>() == 0.8984375);
  CHECK((0.3 - b0).item<double>() == (0.3 - full({1}, 3.0, {.dtype = kBFloat16})).item<double>());
  // Comparisons read it in the tensor's dtype, as PyTorch's comparison kernels (scalar_value<scalar_t>): float16's 0.1
  // (0.0999755859375) equals the number 0.1 rounded so, where in float32 it would be below it.
  const Tensor tenth = full({1}, 0.1, {.dtype = kFloat16});
  CHECK(tenth.eq(0.1).item<bool>());
  CHECK_FALSE(tenth.lt(0.1).item<bool>());
  CHECK(tenth.ge(scalar_tensor(0.1, {.dtype = kFloat64})).item<bool>());
  // pow too (PyTorch's pow_tensor_scalar_kernel takes exp_scalar.to<scalar_t>()): 19 ** float16(0.1), 0.0999755859375.
  CHECK(pow(full({1}, 19.0, {.dtype = kFloat16}), 0.1).item<double>() == 1.341796875);
  // The gradient of x * number: the incoming gradient times the number, in float32, then float16.
  Tensor w = full({1}, 1.0, {.dtype = kFloat16, .requires_grad = true});
  (w * 70000.0 * 1e-4).sum().backward();
  CHECK(w.grad().dtype() == kFloat16);
  CHECK(values(w.grad()) == std::vector<double>{7.0});
}

TEST_CASE("a 0-d tensor beside one with dims promotes as a number does: only a higher category decides the dtype") {
  const Tensor half = ones({3}, {.dtype = kFloat16});
  CHECK((half * scalar_tensor(2.0, {.dtype = kFloat64})).dtype() == kFloat16);
  CHECK((ones({3}) + scalar_tensor(0.5, {.dtype = kFloat64})).dtype() == kFloat32);
  CHECK((ones({3}, {.dtype = kInt32}) + scalar_tensor(5, {.dtype = kInt64})).dtype() == kInt32);
  CHECK((ones({3}, {.dtype = kInt32}) + scalar_tensor(0.5, {.dtype = kFloat64})).dtype() == kFloat64);  // floating
  CHECK((ones({3}, {.dtype = kBool}) + scalar_tensor(2, {.dtype = kInt64})).dtype() == kInt64);  // above bool
  const Tensor wrapped = tensor(std::vector<uint8_t>{0, 5}) + scalar_tensor(-1, {.dtype = kInt64});
  CHECK(wrapped.dtype() == kUInt8);
  CHECK(values(wrapped) == std::vector<double>{255, 4});
  // compared in float16, where 0.1 rounds to the same value as the tensor's (a comparison reads a number so)
  CHECK(full({1}, 0.1, {.dtype = kFloat16}).eq(scalar_tensor(0.1, {.dtype = kFloat64})).item<bool>());
  CHECK(where(half.gt(0), half, scalar_tensor(0.0, {.dtype = kFloat32})).dtype() == kFloat16);
  {  // autocast's mixed-input rule reads a 0-d tensor the same way (PyTorch's autocast leaves mul alone)
    amp::AutocastGuard autocast(kFloat16);
    CHECK((half * scalar_tensor(2.0, {.dtype = kFloat32})).dtype() == kFloat16);
    CHECK((half * ones({3})).dtype() == kFloat32);
  }
  // two 0-d tensors, or two with dims, promote by dtype alone
  CHECK((scalar_tensor(1.0, {.dtype = kFloat16}) * scalar_tensor(2.0, {.dtype = kFloat64})).dtype() == kFloat64);
  CHECK((half * ones({1}, {.dtype = kFloat64})).dtype() == kFloat64);
}

TEST_CASE("pow of integers refuses negative integer exponents, x^0.5 and x^-0.5 are sqrt and rsqrt, as in PyTorch") {
  const Tensor i = tensor(std::vector<int64_t>{2, 1, -1, 0});
  CHECK_THROWS_WITH_AS(i.pow(-1), doctest::Contains("pow: integers to negative integer powers are not allowed "
                                                    "(int64[4] cpu to the power -1)"), Error);
  CHECK_THROWS_WITH_AS(ones({2}, {.dtype = kBool}).pow(-2), doctest::Contains("negative integer powers"), Error);
  CHECK(values(i.pow(tensor(std::vector<int64_t>{-1, -1, -1, 2}))) == std::vector<double>{0, 1, -1, 0});  // tensors
  CHECK(values(i.pow(-1.0)) == std::vector<double>{0.5, 1, -1, INFINITY});  // a float exponent: a float result
  for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16}) {
    const Tensor x = tensor<double>({-INFINITY, -0.0, 4}).to(dt);
    const std::vector<double> root = values(x.pow(0.5)), inverse = values(x.pow(-0.5));
    CHECK(std::isnan(root[0]));
    CHECK((root[1] == 0 && std::signbit(root[1])));
    CHECK(root[2] == 2);
    CHECK(std::isnan(inverse[0]));
    CHECK(inverse[1] == -INFINITY);
    CHECK(inverse[2] == 0.5);
  }
}

TEST_CASE("fill_ and full refuse a value their dtype cannot hold, by PyTorch's rule, infinities, a wrapping uint8 pass") {
  CHECK_THROWS_WITH_AS(full({1}, 300, {.dtype = kUInt8}), doctest::Contains("full: 300 cannot be converted to uint8 "
                                                                           "without overflow"), Error);
  Tensor half = zeros({2}, {.dtype = kFloat16});
  CHECK_THROWS_WITH_AS(half.fill_(1e6), doctest::Contains("fill_: 1000000 cannot be converted to float16[2] cpu "
                                                          "without overflow"), Error);
  CHECK(values(half) == std::vector<double>{0, 0});  // refused before anything was written
  CHECK_THROWS_WITH_AS(zeros({1}, {.dtype = kInt32}).fill_(int64_t(1) << 40), doctest::Contains("int32"), Error);
  CHECK_THROWS_WITH_AS(zeros({1}, {.dtype = kInt64}).fill_(NAN), doctest::Contains("nan cannot be converted"), Error);
  CHECK_THROWS_WITH_AS(zeros({1}, {.dtype = kInt64}).fill_(0x1p63), doctest::Contains("int64"), Error);
  half.fill_(-INFINITY);
  CHECK(values(half) == std::vector<double>{-INFINITY, -INFINITY});
  CHECK(values(half.fill_(65504)) == std::vector<double>{65504, 65504});
  CHECK(values(zeros({1}, {.dtype = kUInt8}).fill_(-1)) == std::vector<double>{255});  // two's complement
  CHECK_THROWS_WITH_AS(zeros({1}, {.dtype = kUInt8}).fill_(-256), doctest::Contains("uint8"), Error);
  CHECK(values(zeros({1}, {.dtype = kInt32}).fill_(-2.75)) == std::vector<double>{-2});  // truncated, as a cast
  CHECK(values(zeros({1}, {.dtype = kBool}).fill_(7)) == std::vector<double>{1});
  CHECK(values(full({1}, int64_t(INT64_MAX), {.dtype = kInt64})) == std::vector<double>{double(INT64_MAX)});
  CHECK_THROWS_WITH_AS(full({1}, 255.5, {.dtype = kUInt8}), doctest::Contains("255.5 cannot be converted"), Error);
  // a float does not wrap, as an integer does
  CHECK_THROWS_WITH_AS(full({1}, -1.0, {.dtype = kUInt8}), doctest::Contains("-1 cannot be converted"), Error);
  // A number beside a tensor is an operand, not a write: no overflow check. Arithmetic reads it in float32 (the
  // product is what overflows float16); where() takes it in its result's dtype, where -1e9 is -inf.
  const Tensor h = ones({2}, {.dtype = kFloat16});
  CHECK(values(h * 1e6) == std::vector<double>{INFINITY, INFINITY});
  CHECK(values(where(h.gt(2), h, -1e9)) == std::vector<double>{-INFINITY, -INFINITY});
  for (DType dt : {kFloat16, kBFloat16}) {  // a mean's gradient is divided in float32 (70000 is inf in float16)
    Tensor many = ones({70000}, {.dtype = dt, .requires_grad = true});
    many.mean().backward();
    CHECK(many.grad().dtype() == dt);
    CHECK(values(many.grad())[69999] == values(scalar_tensor(1.0 / 70000).to(dt))[0]);
    CHECK(values(many.grad())[0] > 0);
  }
  // A squared error's 2 / count too: rounded to float16 first (a subnormal, 479 x 2^-24), it was 0.08% off, which a
  // gradient of 1000 x that factor shows (0.028549 for 0.028571).
  Tensor input = full({70000}, 1000.0, {.dtype = kFloat16, .requires_grad = true});
  mse_loss(input, zeros({70000}, {.dtype = kFloat16})).backward();
  CHECK(values(input.grad())[0] == doctest::Approx(2000.0 / 70000).epsilon(4e-4));
}

namespace {
enum Small { kThree = 3 };  // an unscoped enum, as C code's constants
}  // namespace

TEST_CASE("a number of any integer type, or an unscoped enum, is a Scalar") {
  const Tensor x = tensor<double>({1, 2});
  CHECK(values(x * kThree) == std::vector<double>{3, 6});
  CHECK(values(x * size_t(2)) == std::vector<double>{2, 4});
  CHECK(values(x + (long long)-1) == std::vector<double>{0, 1});
  CHECK(values(x * uint8_t(4)) == std::vector<double>{4, 8});
}

TEST_CASE("integer and bool ops") {
  Tensor i = tensor(std::vector<int32_t>{-3, 0, 5});
  CHECK(values(i.abs()) == std::vector<double>{3, 0, 5});
  for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16}) {  // abs(-0) is +0, as PyTorch's; nan stays nan
    const std::vector<double> v = values(tensor<double>({-0.0, NAN, -2}).to(dt).abs());
    CHECK_FALSE(std::signbit(v[0]));
    CHECK(std::isnan(v[1]));
    CHECK(v[2] == 2);
  }
  CHECK((i + i).dtype() == kInt32);
  CHECK(values(i / 2) == std::vector<double>{-1.5, 0, 2.5});
  CHECK(i.exp().dtype() == kFloat32);
  CHECK(values(logical_not(i.eq(0))) == std::vector<double>{1, 0, 1});
  CHECK(values(logical_and(i.gt(-5), i.lt(3))) == std::vector<double>{1, 1, 0});
  CHECK(values(isfinite(tensor(std::vector<float>{1, INFINITY, NAN}))) == std::vector<double>{1, 0, 0});
  // alpha, as PyTorch: integral for an integral result; bool tensors subtract with no alpha either.
  CHECK(values(add(i, i, 2)) == std::vector<double>{-9, 0, 15});
  CHECK(add(i, i, 2).dtype() == kInt32);
  CHECK_THROWS_WITH_AS(add(i, i, 2.5), doctest::Contains("add: alpha 2.5 is a floating-point number, but int32[3] cpu "
                                                         "and int32[3] cpu are integral"), Error);
  CHECK(values(sub(i, tensor<float>({1, 1, 1}), 0.5)) == std::vector<double>{-3.5, -0.5, 4.5});  // a float result
  const Tensor flags = i.gt(0);
  CHECK_THROWS_WITH_AS(sub(flags, flags, 2), doctest::Contains("sub: not supported for bool tensors"), Error);
  // abs of bool is the tensor itself, on the CPU as on CUDA (where PyTorch's CPU refuses it); neg is refused.
  CHECK(abs(flags).dtype() == kBool);
  CHECK(values(abs(flags)) == std::vector<double>{0, 0, 1});
  CHECK_THROWS_WITH_AS(neg(flags), doctest::Contains("neg: not supported for bool tensors"), Error);
  CHECK_THROWS_WITH_AS(add(i, i, true), doctest::Contains("add: a bool alpha is for bool tensors only"), Error);
  // Bool tensors add in bool, alpha as its truth value: a or (alpha and b).
  const Tensor none = i.gt(5);
  CHECK(add(none, flags, 2).dtype() == kBool);
  CHECK(values(add(none, flags, 2)) == std::vector<double>{0, 0, 1});
  CHECK(values(add(flags, flags, 0)) == std::vector<double>{0, 0, 1});
  CHECK(values(add(none, flags, 0)) == std::vector<double>{0, 0, 0});
  Tensor seen = none.clone();
  seen.add_(flags, 3);
  CHECK(seen.dtype() == kBool);
  CHECK(values(seen) == std::vector<double>{0, 0, 1});
  Tensor counts = i.clone();
  CHECK_THROWS_WITH_AS(counts.add_(i, 1.0), doctest::Contains("add_: alpha 1.0 is a floating-point number"), Error);
  CHECK(values(counts) == values(i));  // refused before anything was written
  // A number is not a bool: an integral result into a bool tensor is refused, as PyTorch's can_cast.
  Tensor mask = flags.clone();
  CHECK_THROWS_WITH_AS(mask.add_(tensor(std::vector<int64_t>{1, 2, 0})), doctest::Contains("add_: result type int64 "
                                                                                         "can't be cast"), Error);
  CHECK_THROWS_WITH_AS(mask.mul_(2), doctest::Contains("mul_: result type int64 can't be cast"), Error);
  CHECK(values(mask) == values(flags));
}

TEST_CASE("where and clamp") {
  Tensor x = tensor(std::vector<double>{-2, -0.5, 0.5, 2});
  CHECK(values(where(x.gt(0), x, 0)) == std::vector<double>{0, 0, 0.5, 2});
  CHECK(values(x.clamp(-1, 1)) == std::vector<double>{-1, -0.5, 0.5, 1});
  CHECK(values(x.clamp(std::nullopt, 0)) == std::vector<double>{-2, -0.5, 0, 0});
  CHECK_THROWS_WITH_AS(where(x, x, x), doctest::Contains("where: condition must be bool"), Error);
}

TEST_CASE("where over long runs with broadcast operands matches the element-by-element definition") {
  // 1,300 values: several of the loop's 512-value blocks and a tail, with scalars in any operand position
  // (each is repeated into a block of its own so that the loop vectorises).
  manual_seed(5);
  Tensor a = randn({1300}, {.dtype = kFloat64}), b = randn({1300}, {.dtype = kFloat64});
  Tensor c = a.gt(b);
  const std::vector<double> av = values(a), bv = values(b);
  std::vector<double> want_ab, want_a0, want_0b;
  for (size_t i = 0; i < av.size(); ++i) {
    const bool ci = av[i] > bv[i];
    want_ab.push_back(ci ? av[i] : bv[i]);
    want_a0.push_back(ci ? av[i] : 0.0);
    want_0b.push_back(ci ? 0.0 : bv[i]);
  }
  CHECK(values(where(c, a, b)) == want_ab);
  CHECK(values(where(c, a, 0.0)) == want_a0);
  CHECK(values(where(c, 0.0, b)) == want_0b);
  Tensor all_true = ones({}, {.dtype = kBool}).expand({1300});  // a broadcast condition
  CHECK(values(where(all_true, a, b)) == av);
}

TEST_CASE("NaN propagates through relu, maximum and clamp as in PyTorch") {
  Tensor x = tensor(std::vector<float>{NAN, 1});
  CHECK(std::isnan(values(relu(x))[0]));
  CHECK(std::isnan(values(maximum(x, zeros({2})))[0]));
  CHECK(std::isnan(values(x.clamp(0, 0.5))[0]));
}

TEST_CASE("in-place ops write into the tensor, through views too") {
  Tensor x = arange(6, {.dtype = kFloat32}).view({2, 3});
  x.select(1, 0).add_(10);
  CHECK(values(x) == std::vector<double>{10, 1, 2, 13, 4, 5});
  x.mul_(2).sub_(1);
  CHECK(values(x) == std::vector<double>{19, 1, 3, 25, 7, 9});
  Tensor h = ones({3}, {.dtype = kFloat16});
  h.add_(ones({3}, {.dtype = kFloat32}));  // the result is cast to the target's dtype
  CHECK(h.dtype() == kFloat16);
  CHECK(values(h) == std::vector<double>{2, 2, 2});
  Tensor i = ones({2}, {.dtype = kInt64});
  CHECK_THROWS_WITH_AS(i.mul_(0.5), doctest::Contains("can't be cast"), Error);
  Tensor c = zeros({2, 3});
  c.copy_(tensor(std::vector<double>{1, 2, 3}));  // broadcast and cast
  CHECK(values(c) == std::vector<double>{1, 2, 3, 1, 2, 3});
}

TEST_CASE("large tensors are processed in parallel ranges without seams") {
  Tensor x = arange(1 << 20, {.dtype = kFloat32});
  Tensor y = (x * 2 + 1).view({1024, 1024}).t().contiguous().t();
  std::vector<double> v = values(y);
  bool ok = true;
  for (size_t i = 0; i < v.size(); ++i) ok = ok && v[i] == 2.0 * double(i) + 1;
  CHECK(ok);
}

TEST_CASE("gradcheck: unary ops") {
  gradcheck([](const TensorList& in) { return -in[0]; }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].abs(); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].exp(); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].log(); }, {leaf({3, 4}, 0.1, 2)});
  gradcheck([](const TensorList& in) { return in[0].sqrt(); }, {leaf({3, 4}, 0.1, 2)});
  gradcheck([](const TensorList& in) { return in[0].rsqrt(); }, {leaf({3, 4}, 0.1, 2)});
  gradcheck([](const TensorList& in) { return in[0].tanh(); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].sigmoid(); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].relu(); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].pow(3); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].clamp(-0.5, 0.5); }, {leaf({3, 4})});
}

TEST_CASE("gradients where the derivative is not defined: the values PyTorch gives, exactly") {
  // gradcheck draws random inputs, which never land on these points; the rules are stated here.
  auto grad_of = [](const Tensor& x, const std::function<Tensor(const Tensor&)>& f) {
    Tensor leaf = x.detach().requires_grad_();
    f(leaf).sum().backward();
    return testing::values(leaf.grad());
  };
  const Tensor x = tensor<double>({-1, 0, 2}, {3});
  CHECK(grad_of(x, [](const Tensor& t) { return relu(t); }) == std::vector<double>{0, 0, 1});  // 0 at 0
  CHECK(grad_of(x, [](const Tensor& t) { return t.abs(); }) == std::vector<double>{-1, 0, 1});  // sign(0) = 0
  // clamp passes the gradient on its boundaries too: [0, 2] includes both ends.
  CHECK(grad_of(x, [](const Tensor& t) { return t.clamp(0.0, 2.0); }) == std::vector<double>{0, 1, 1});
  // maximum and minimum split a tie evenly between the two sides; a nan on either side (no order) gives both sides
  // the whole gradient (PyTorch: where(a == b, g / 2, g) masked where strictly beaten).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor a = tensor<double>({1, 3, 5, nan, 1}, {5}), b = tensor<double>({2, 3, 4, 1, nan}, {5});
  for (bool is_max : {true, false}) {
    CAPTURE(is_max);
    Tensor la = a.detach().requires_grad_(), lb = b.detach().requires_grad_();
    (is_max ? maximum(la, lb) : minimum(la, lb)).sum().backward();
    CHECK(testing::values(la.grad()) ==
          (is_max ? std::vector<double>{0, 0.5, 1, 1, 1} : std::vector<double>{1, 0.5, 0, 1, 1}));
    CHECK(testing::values(lb.grad()) ==
          (is_max ? std::vector<double>{1, 0.5, 0, 1, 1} : std::vector<double>{0, 0.5, 1, 1, 1}));
  }
}

TEST_CASE("gradcheck: binary ops with broadcasting and non-contiguous inputs") {
  auto t = [](const Tensor& x) { return x.detach().t().requires_grad_(); };  // a transposed leaf
  gradcheck([](const TensorList& in) { return in[0] + in[1]; }, {leaf({3, 4}), leaf({4})});
  gradcheck([](const TensorList& in) { return sub(in[0], in[1], 0.5); }, {leaf({3, 1}), t(leaf({4, 3}))});
  gradcheck([](const TensorList& in) { return in[0] * in[1]; }, {t(leaf({4, 3})), leaf({1, 4})});
  gradcheck([](const TensorList& in) { return in[0] / in[1]; }, {leaf({3, 4}), leaf({4}, 0.1, 2)});
  gradcheck([](const TensorList& in) { return pow(in[0], in[1]); }, {leaf({3, 4}, 0.1, 2), leaf({3, 4})});
  gradcheck([](const TensorList& in) { return maximum(in[0], in[1]); }, {leaf({3, 4}), leaf({3, 4})});
  gradcheck([](const TensorList& in) { return minimum(in[0], in[1]); }, {leaf({3, 4}), leaf({4})});
  gradcheck([](const TensorList& in) { return where(in[0].gt(0), in[0], in[1]); }, {leaf({3, 4}), leaf({4})});
  gradcheck([](const TensorList& in) { return 2 / in[0] - 3 * in[0]; }, {leaf({5}, 0.1, 2)});
}

TEST_CASE("gradcheck: view ops") {
  gradcheck([](const TensorList& in) { return in[0].view({4, 3}); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].t().reshape({12}); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].permute({2, 0, 1}); }, {leaf({2, 3, 4})});
  gradcheck([](const TensorList& in) { return in[0].slice(1, 0, 4, 2) * 2; }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].narrow(0, 1, 2); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].select(1, -1); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].expand({2, 3, 4}); }, {leaf({3, 1})});
  gradcheck([](const TensorList& in) { return in[0].unsqueeze(1).squeeze(1).flatten(); }, {leaf({3, 4})});
  gradcheck([](const TensorList& in) { return cat({in[0], in[1]}, 1); }, {leaf({3, 2}), leaf({3, 4})});
  gradcheck([](const TensorList& in) { return in[0].clone() * in[0].contiguous(); }, {leaf({4, 3}).detach().t().requires_grad_()});
}

TEST_CASE("in-place arithmetic with an operand of a narrower dtype widens it first, as PyTorch") {
  Tensor a = zeros({4});
  a += tensor(std::vector<float>{1, 2, 3, 4}).to(kFloat16);
  CHECK(values(a) == std::vector<double>{1, 2, 3, 4});
  Tensor b = zeros({3});
  b.add_(arange(3));  // int64 into float32
  CHECK(values(b) == std::vector<double>{0, 1, 2});
  Tensor c = zeros({4}, {.dtype = kInt64});
  c += tensor(std::vector<uint8_t>{1, 2, 3, 4});
  CHECK(values(c) == std::vector<double>{1, 2, 3, 4});
  Tensor d = full({4}, 3.0);
  d.mul_(tensor(std::vector<float>{1, 0, 1, 0}).gt(0));  // a bool mask
  CHECK(values(d) == std::vector<double>{3, 0, 3, 0});
  Tensor e = zeros({2}, {.dtype = kFloat64});
  e -= scalar_tensor(2, {.dtype = kInt32});
  e /= tensor(std::vector<float>{4, 8}).to(kBFloat16);
  CHECK(values(e) == std::vector<double>{-0.5, -0.25});
}

TEST_CASE("in-place arithmetic and copy_ whose operand shares memory with the target read it as it was before the "
          "write") {
  Tensor a = arange(5, {.dtype = kFloat32});
  a.slice(0, 1, 5).add_(a.slice(0, 0, 4));  // each element plus its old left neighbour, not a running sum
  CHECK(values(a) == std::vector<double>{0, 1, 3, 5, 7});
  Tensor m = arange(4, {.dtype = kFloat32}).view({2, 2});
  m.add_(m.t());
  CHECK(values(m) == std::vector<double>{0, 3, 3, 6});
  Tensor n = arange(4, {.dtype = kFloat32}).view({2, 2});
  n.copy_(n.t());
  CHECK(values(n) == std::vector<double>{0, 2, 1, 3});
  Tensor s = arange(5, {.dtype = kFloat32});
  s.slice(0, 1, 5).copy_(s.slice(0, 0, 4));
  CHECK(values(s) == std::vector<double>{0, 0, 1, 2, 3});
  Tensor same = arange(3, {.dtype = kFloat32});
  same.mul_(same);  // the same view of the memory: each element reads only itself
  CHECK(values(same) == std::vector<double>{0, 1, 4});
}

TEST_CASE("pow's gradients where the base is 0: 0 for the exponent 0, and for the exponent's gradient where b >= 0") {
  Tensor a = zeros({1}, {.dtype = kFloat64, .requires_grad = true});
  a.pow(0.0).sum().backward();
  CHECK(values(a.grad()) == std::vector<double>{0});  // PyTorch: 0, not 0 * 0^-1 = nan
  Tensor base = zeros({3}, {.dtype = kFloat64, .requires_grad = true});
  Tensor exponent = tensor(std::vector<double>{0, 2, -1}).requires_grad_();
  pow(base, exponent).sum().backward();
  const std::vector<double> gb = values(base.grad()), ge = values(exponent.grad());
  CHECK(gb[0] == 0);   // exponent 0
  CHECK(gb[1] == 0);   // 2 * 0^1
  CHECK(std::isinf(gb[2]));  // -1 * 0^-2
  CHECK(ge[0] == 0);   // 0^0 log 0, masked
  CHECK(ge[1] == 0);
  CHECK(std::isinf(ge[2]));  // 0^-1 log 0 = inf * -inf: PyTorch masks only exponents >= 0
  Tensor c = zeros({1}, {.dtype = kFloat64, .requires_grad = true});
  Tensor d = c.pow(0.0);
  d.backward(full({1}, INFINITY, {.dtype = kFloat64}));  // the factor is masked, not g: inf passes, as in PyTorch
  CHECK(std::isnan(values(c.grad())[0]));               // inf * 0
}

TEST_CASE("add and sub with alpha make alpha * b in the result's arithmetic, not b's dtype, and round once") {
  // uint8 200 * 2 wrapped to 144 in b's dtype; float16 100 * 1000 overflowed to inf.
  const Tensor i64 = zeros({2}, {.dtype = kInt64}), u8 = tensor(std::vector<uint8_t>{200, 1});
  CHECK(values(add(i64, u8, 2)) == std::vector<double>{400, 2});
  CHECK(values(sub(i64, u8, -1)) == std::vector<double>{200, 1});
  CHECK(values(add(zeros({1}), tensor(std::vector<float>{100}).to(kFloat16), 1000)) == std::vector<double>{100000});
  // float16 operands: a + 0.3 b computed in float32 and rounded to float16 once (twice, 1543 of 10,000 differed).
  manual_seed(21);
  const Tensor a = randn({10000}).to(kFloat16), b = randn({10000}).to(kFloat16);
  const Tensor once = (a.to(kFloat32) + b.to(kFloat32) * 0.3).to(kFloat16);
  CHECK(values(add(a, b, 0.3)) == values(once));
  CHECK(values(sub(a, b, 0.3)) == values((a.to(kFloat32) - b.to(kFloat32) * 0.3).to(kFloat16)));
  Tensor c = a.clone();
  c.add_(b, 0.3);
  CHECK(values(c) == values(once));
  CHECK(add(a, b, 0.3).dtype() == kFloat16);
  gradcheck([](const TensorList& in) { return add(in[0], in[1], 2.5); }, {leaf({3}), leaf({3})});
}

TEST_CASE("an in-place op bumps its target's version only as it writes: a refused op leaves it, x.mul_(x) is refused") {
  // A refused in-place op left the version bumped, so a backward through a graph that saved the tensor failed.
  Tensor a = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor y = a * 1.0;
  Tensor z = y * y;
  CHECK_THROWS_AS(y.add_(ones({2, 3}, {.dtype = kFloat64})), Error);  // does not broadcast into [3]
  CHECK_THROWS_AS(y.fill_(0.0), Error);  // y requires grad
  z.sum().backward();
  CHECK(values(a.grad()) == std::vector<double>{2, 4, 6});
  // x.mul_(x): the operand is the target, saved at the version the write makes stale; as PyTorch, backward refuses
  // (it gave 2a + a^2's wrong gradient [2, 6, 12] without a word).
  Tensor b = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor x = b * 1.0;
  x.mul_(x);
  CHECK_THROWS_WITH_AS(x.sum().backward(), doctest::Contains("modified by an in-place operation"), Error);
}

TEST_CASE("fill_ into bool writes the number's truth, as PyTorch: 0.5 and nan are true") {
  CHECK(values(zeros({3}, {.dtype = kBool}).fill_(0.5)) == std::vector<double>{1, 1, 1});
  CHECK(values(full({2}, 0.25, {.dtype = kBool})) == std::vector<double>{1, 1});
  CHECK(values(zeros({1}, {.dtype = kBool}).fill_(std::nan(""))) == std::vector<double>{1});
  CHECK(values(ones({1}, {.dtype = kBool}).fill_(0.0)) == std::vector<double>{0});
}

TEST_CASE("integer arithmetic wraps on overflow without undefined behaviour (the sanitizer build checks)") {
  const int64_t big = std::numeric_limits<int64_t>::max(), small = std::numeric_limits<int64_t>::min();
  const Tensor t = tensor(std::vector<int64_t>{big, small});
  CHECK(to_vector<int64_t>(t + int64_t(1)) == std::vector<int64_t>{small, small + 1});
  CHECK(to_vector<int64_t>(t.neg()) == std::vector<int64_t>{small + 1, small});
  CHECK(to_vector<int64_t>(t.abs()) == std::vector<int64_t>{big, small});  // as PyTorch: |int64 min| wraps to itself
  CHECK(to_vector<int32_t>(tensor(std::vector<int32_t>{std::numeric_limits<int32_t>::max()}) * int32_t(2)) ==
        std::vector<int32_t>{-2});
  uint64_t power = 1;  // 3^41 modulo 2^64, as two's complement wraps it
  for (int k = 0; k < 41; ++k) power *= 3;
  CHECK(to_vector<int64_t>(pow(tensor(std::vector<int64_t>{3}), int64_t(41)))[0] == int64_t(power));
}

TEST_CASE("IntDivider's multiply-high, add and shift give n / d for every n and d below 2^31 tried") {
  // The strided CUDA kernels, batch norm's and pad's divide indices so (core/int_divider.h); the host computes the
  // same high word as the GPU's __umulhi, so these quotients are the kernels'.
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 4100; ++d) divisors.push_back(d);
  for (int k = 12; k <= 31; ++k) {  // powers of two, their neighbours, and the largest
    for (int64_t d : {(int64_t(1) << k) - 1, int64_t(1) << k, (int64_t(1) << k) + 1, (int64_t(1) << k) / 3 * 2 + 1})
      if (d < (int64_t(1) << 31)) divisors.push_back(uint32_t(d));
  }
  uint64_t state = 88172645463325252ull;  // xorshift64: random divisors and numerators
  auto next = [&] {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return uint32_t(state >> 33);  // below 2^31
  };
  for (int k = 0; k < 2000; ++k) divisors.push_back(std::max(next(), 1u));
  const uint32_t most = (uint32_t(1) << 31) - 1;
  int64_t wrong = 0;
  for (uint32_t d : divisors) {
    const IntDivider divider(d);
    std::vector<uint32_t> numerators = {0, 1, d - 1, d, most, most - d + 1, most / d * d, most / d * d - 1};
    if (d < most / 2) numerators.insert(numerators.end(), {d + 1, 2 * d - 1, 2 * d});
    for (int k = 0; k < 64; ++k) numerators.push_back(next());
    for (uint32_t n : numerators) wrong += divider.div(n) != n / d;
  }
  CHECK(wrong == 0);
  // No multiplier exists for 0, nor one this rule finds above 2^31: refused, not a division by zero.
  CHECK_THROWS_WITH_AS(IntDivider{0}, doctest::Contains("IntDivider: divisor 0 outside [1, 2^31]"), Error);
  CHECK_THROWS_WITH_AS(IntDivider{(uint32_t(1) << 31) + 1}, doctest::Contains("divisor 2147483649 outside"), Error);
  CHECK(IntDivider{uint32_t(1) << 31}.div(most) == 0);
}

TEST_CASE("a floating value converts to uint8 through int64, as PyTorch: -1.5 is 255 and 300 is 44") {
  CHECK(values(tensor(std::vector<float>{-1.5f, 300.0f, 7.9f}).to(kUInt8)) == std::vector<double>{255, 44, 7});
  CHECK(values(tensor(std::vector<float>{-1.5f, 300.0f}).to(kFloat16).to(kUInt8)) == std::vector<double>{255, 44});
}

TEST_CASE("cuda: a floating value converts to uint8 through int64 on the GPU as on the CPU") {
  SKIP_WITHOUT_GPU();
  const Tensor x = tensor(std::vector<float>{-1.5f, 300.0f, 7.9f, -200.0f});
  CHECK(values(x.cuda().to(kUInt8).cpu()) == values(x.to(kUInt8)));
  CHECK(values(x.to(kFloat16).cuda().to(kUInt8).cpu()) == values(x.to(kFloat16).to(kUInt8)));
}

TEST_CASE("math functions and division take bool as PyTorch does, in float32, and sign keeps bool") {
  const Tensor flags = tensor<bool>({true, false});
  auto check_float32 = [](const Tensor& got, const std::vector<double>& want) {
    CHECK(got.dtype() == kFloat32);
    const std::vector<double> v = values(got);
    REQUIRE(v.size() == want.size());
    for (size_t i = 0; i < v.size(); ++i) {
      CAPTURE(i);
      if (std::isnan(want[i])) CHECK(std::isnan(v[i]));
      else if (std::isinf(want[i])) CHECK(v[i] == want[i]);
      else CHECK(v[i] == doctest::Approx(want[i]).epsilon(1e-6));
    }
  };
  check_float32(exp(flags), {std::exp(1.0), 1});
  check_float32(log(flags), {0, -INFINITY});
  check_float32(sqrt(flags), {1, 0});
  check_float32(rsqrt(flags), {1, INFINITY});
  check_float32(tanh(flags), {std::tanh(1.0), 0});
  check_float32(sigmoid(flags), {1 / (1 + std::exp(-1.0)), 0.5});
  check_float32(div(flags, flags), {1, NAN});  // true division, as PyTorch's tensor([True, False]) / itself
  CHECK(sign(flags).dtype() == kBool);
  CHECK(values(sign(flags)) == std::vector<double>{1, 0});
  CHECK_THROWS_WITH_AS(relu(flags), doctest::Contains("relu: not supported for bool tensors"), Error);
  // In place, a float32 result cannot go into bool: refused, as PyTorch's.
  Tensor target = flags.clone();
  CHECK_THROWS_WITH_AS(target.div_(flags), doctest::Contains("div_: result type float32 can't be cast to the in-place "
                                                             "target bool[2] cpu"), Error);
  CHECK_THROWS_WITH_AS(target.exp_(), doctest::Contains("exp_: result type float32 can't be cast"), Error);
  CHECK(values(target) == std::vector<double>{1, 0});
}

TEST_CASE("cuda: math functions and division take bool on the GPU as on the CPU") {
  SKIP_WITHOUT_GPU();
  const Tensor flags = tensor<bool>({true, false}), on_gpu = flags.cuda();
  for (const auto& [gpu, cpu] : {std::pair{exp(on_gpu), exp(flags)}, std::pair{sigmoid(on_gpu), sigmoid(flags)},
                                  std::pair{rsqrt(on_gpu), rsqrt(flags)}}) {
    CHECK(gpu.dtype() == kFloat32);
    const std::vector<double> got = values(gpu.cpu()), want = values(cpu);  // each device's float32 math: ~1 ulp
    CHECK(got[0] == doctest::Approx(want[0]).epsilon(1e-6));
    CHECK(got[1] == want[1]);  // exp(0) 1, sigmoid(0) 0.5, rsqrt(0) inf: exact on both
  }
  CHECK(values(div(on_gpu, on_gpu).cpu().isfinite()) == std::vector<double>{1, 0});
  CHECK(sign(on_gpu).dtype() == kBool);
  CHECK(values(sign(on_gpu).cpu()) == std::vector<double>{1, 0});
}

TEST_CASE("copy_each_ refuses a pair whose destination shares part of its memory with its source") {
  Tensor x = arange(0, 6, 1, {.dtype = kFloat32});
  CHECK_THROWS_WITH_AS(copy_each_({x.narrow(0, 1, 5)}, {x.narrow(0, 0, 5)}),
                       doctest::Contains("copy_each_: pair 0: the destination float32[5] cpu and the source float32[5] "
                                         "cpu share some of their memory"), Error);
  CHECK(values(x) == std::vector<double>{0, 1, 2, 3, 4, 5});  // untouched
  Tensor d = zeros({5});
  copy_each_({d}, {x.narrow(0, 0, 5)});
  CHECK(values(d) == std::vector<double>{0, 1, 2, 3, 4});
  // A later pair refused (an expanded destination) leaves the earlier ones' versions: a backward that saved them runs.
  Tensor a = tensor<double>({1, 2}).requires_grad_();
  Tensor y = a * 1.0;
  Tensor z = y * y;
  {
    NoGradGuard no_grad;
    CHECK_THROWS_WITH_AS(copy_each_({y, zeros({1}, {.dtype = kFloat64}).expand({2})}, {ones({2}), ones({2})}),
                         doctest::Contains("expanded view"), Error);
  }
  z.sum().backward();
  CHECK(values(a.grad()) == std::vector<double>{2, 4});
  // copy_ refuses a source that does not broadcast, with the version as it was.
  Tensor b = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor u = b * 1.0, v = u * u;
  {
    NoGradGuard no_grad;
    CHECK_THROWS_AS(u.copy_(ones({2, 3})), Error);
  }
  v.sum().backward();
  CHECK(values(b.grad()) == std::vector<double>{2, 4, 6});
}

TEST_CASE("autocast runs rsqrt in float32, as PyTorch's autocast does") {
  amp::AutocastGuard guard(kFloat16);
  const Tensor r = rsqrt(full({1}, 1e-6, {.dtype = kFloat16}));
  CHECK(r.dtype() == kFloat32);
  CHECK(r.item<double>() == doctest::Approx(1.0 / std::sqrt(double(Half(1e-6f)))).epsilon(1e-6));
}

TEST_CASE("masked_fill writes the value where the mask is true, in the input's dtype, as PyTorch's") {
  const Tensor x = arange(6).view({2, 3});
  const Tensor mask = tensor<bool>({true, false, true});
  CHECK(values(x.masked_fill(mask, -1)) == std::vector<double>{-1, 1, -1, -1, 4, -1});
  CHECK(x.masked_fill(mask, 2.7).dtype() == kInt64);  // the value converted to int64, as fill_ converts it
  CHECK(values(x.masked_fill(mask, 2.7)) == std::vector<double>{2, 1, 2, 2, 4, 2});
  // Out of place, x and the mask broadcast together; in place, the mask must broadcast to x.
  const Tensor column = tensor<bool>({false, true}).view({2, 1, 1});
  CHECK(x.masked_fill(column, 0).shape() == Shape{2, 2, 3});
  Tensor y = zeros({2, 3});
  y.masked_fill_(tensor<bool>({true, false}).view({2, 1}), 5);
  CHECK(values(y) == std::vector<double>{5, 5, 5, 0, 0, 0});
  CHECK_THROWS_WITH_AS(y.masked_fill_(column, 1), doctest::Contains("masked_fill_: mask bool[2, 1, 1] cpu does not "
                                                                    "broadcast to the shape of float32[2, 3]"), Error);
  CHECK_THROWS_WITH_AS(x.masked_fill(arange(3), 1), doctest::Contains("masked_fill: expected a bool mask, got "
                                                                      "int64[3]"), Error);
  // Shapes that do not broadcast: the error names masked_fill, not the where it is made of.
  CHECK_THROWS_WITH_AS(x.masked_fill(tensor<bool>({true, false}), 1), doctest::Contains("masked_fill: shapes"), Error);
  CHECK_THROWS_WITH_AS(zeros({2}, {.dtype = kFloat16}).masked_fill(tensor<bool>({true, true}), 1e6),
                       doctest::Contains("masked_fill: 1000000 cannot be converted to float16[2] cpu without "
                                         "overflow"), Error);
  // A float32 number beside float16: -inf, the attention mask's usual value, is exact.
  CHECK(values(zeros({2}, {.dtype = kFloat16}).masked_fill(tensor<bool>({true, false}), -INFINITY)) ==
        std::vector<double>{-INFINITY, 0});
}

TEST_CASE("masked_fill's gradient is the input's where the mask is false, zero where it was filled") {
  Tensor x = tensor<double>({1, 2, 3}).requires_grad_();
  const Tensor mask = tensor<bool>({false, true, false});
  const Tensor filled = x.masked_fill(mask, 9);
  CHECK(filled.grad_fn()->name() == "MaskedFillBackward");  // its own node, as PyTorch's MaskedFillBackward0
  filled.mul(tensor<double>({4, 5, 6})).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{4, 0, 6});
  gradcheck([&](const TensorList& in) { return in[0].masked_fill(tensor<bool>({true, false, false, true}), 0.5); },
            {leaf({3, 4})});
  // In place on a computed tensor: recorded as any in-place op.
  Tensor z = tensor<double>({1, 2}).requires_grad_();
  Tensor h = z * 3;
  h.masked_fill_(tensor<bool>({true, false}), 0);
  h.sum().backward();
  CHECK(values(z.grad()) == std::vector<double>{0, 3});
}

TEST_CASE("cuda: masked_fill matches the CPU in every dtype, with a mask that broadcasts") {
  SKIP_WITHOUT_GPU();
  manual_seed(341);
  const Tensor mask = rand({5, 1, 7}).gt(0.5);
  for (DType dt : {kFloat32, kFloat16, kBFloat16, kInt64, kUInt8, kBool}) {
    CAPTURE(std::string(dtype_name(dt)));
    const Tensor x = (rand({5, 6, 7}) * 50).to(dt);
    CHECK(values(x.cuda().masked_fill(mask.cuda(), 1).cpu()) == values(x.masked_fill(mask, 1)));
  }
}
