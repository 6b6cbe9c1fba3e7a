// cumsum (ops/cumsum.h): PyTorch's values and dtype rules, sums kept wider than float16, the gradient against finite
// differences, the in-place method, autocast, and CUDA against the CPU.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "core/autocast.h"
#include "core/cuda.h"
#include "halfgrad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;
using halfgrad::testing::values;

namespace {
// Running sums of a float64 [outer, length, inner] along the middle dim, one by one.
std::vector<double> running_sums(const std::vector<double>& v, int64_t outer, int64_t length, int64_t inner) {
  std::vector<double> out(v.size());
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t j = 0; j < inner; ++j) {
      double sum = 0;
      for (int64_t i = 0; i < length; ++i) {
        const size_t at = size_t((o * length + i) * inner + j);
        sum += v[at];
        out[at] = sum;
      }
    }
  }
  return out;
}
}  // namespace

TEST_CASE("cumsum: running sums along a dim, int64 for integers and bool, as PyTorch's") {
  const Tensor x = tensor<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  CHECK(values(x.cumsum(1)) == std::vector<double>{1, 3, 6, 4, 9, 15});
  CHECK(values(x.cumsum(-1)) == std::vector<double>{1, 3, 6, 4, 9, 15});
  CHECK(values(x.cumsum(0)) == std::vector<double>{1, 2, 3, 5, 7, 9});
  const Tensor counts = tensor<int32_t>({3, 4, 5}).cumsum(0);
  CHECK(counts.dtype() == kInt64);
  CHECK(values(counts) == std::vector<double>{3, 7, 12});
  const Tensor flags = tensor<bool>({true, false, true, true}).cumsum(0);
  CHECK(flags.dtype() == kInt64);
  CHECK(values(flags) == std::vector<double>{1, 1, 2, 3});
  const Tensor wide = cumsum(tensor<float>({0.1f, 0.2f}), 0, kFloat64);
  CHECK(wide.dtype() == kFloat64);
  CHECK(values(wide) == std::vector<double>{double(0.1f), double(0.1f) + double(0.2f)});
  CHECK(values(cumsum(tensor<uint8_t>({200, 100}), 0, kUInt8)) == std::vector<double>{200, 44});  // wraps
  const Tensor zero_d = scalar_tensor(5.0).cumsum(0);
  CHECK(zero_d.dim() == 0);
  CHECK(values(zero_d) == std::vector<double>{5});
  CHECK(zeros({2, 0}).cumsum(1).shape() == Shape{2, 0});
  CHECK(x.t().cumsum(1).is_contiguous());  // a strided input: a contiguous result
  CHECK(values(x.t().cumsum(1)) == std::vector<double>{1, 5, 2, 7, 3, 9});
}

TEST_CASE("cumsum keeps float16's sums in float32 and rounds each output once") {
  // 4,096 ones: float16 sums would stop at 2048 (2048 + 1 rounds back to 2048); float32 sums reach 4096.
  const Tensor sums = ones({4096}, {.dtype = kFloat16}).cumsum(0);
  CHECK(sums.dtype() == kFloat16);
  const std::vector<double> v = values(sums);
  CHECK(v[2047] == 2048);
  CHECK(v[2048] == 2048);  // 2049 rounded to float16
  CHECK(v[4095] == 4096);
}

TEST_CASE("the CPU's cumsum over many threads equals the sums taken one by one, along every dim") {
  manual_seed(911);
  const Tensor x = randint(-9, 10, {3, 2000, 70}).to(kFloat64);
  const std::vector<double> v = values(x);
  CHECK(values(x.cumsum(1)) == running_sums(v, 3, 2000, 70));
  CHECK(values(x.cumsum(0)) == running_sums(v, 1, 3, 2000 * 70));
  CHECK(values(x.cumsum(2)) == running_sums(v, 3 * 2000, 70, 1));
}

TEST_CASE("cumsum's gradient: the output's gradient summed from the end") {
  Tensor x = tensor<double>({1, 2, 3}).requires_grad_();
  x.cumsum(0).mul(tensor<double>({1, 10, 100})).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{111, 110, 100});
  manual_seed(912);
  for (int64_t dim : {0, 1, 2, -1}) {
    CAPTURE(dim);
    gradcheck([&](const TensorList& in) { return in[0].cumsum(dim); }, {leaf({3, 4, 5})});
  }
  gradcheck([&](const TensorList& in) { return in[0].transpose(0, 1).cumsum(1); }, {leaf({4, 3})});
  // A wider result's gradient comes back in x's dtype; float16 in float16.
  Tensor f = tensor<float>({1, 2}).requires_grad_();
  cumsum(f, 0, kFloat64).sum().backward();
  CHECK(f.grad().dtype() == kFloat32);
  CHECK(values(f.grad()) == std::vector<double>{2, 1});
  Tensor h = ones({3}, {.dtype = kFloat16}).requires_grad_();
  h.cumsum(0).sum().backward();
  CHECK(h.grad().dtype() == kFloat16);
  CHECK(values(h.grad()) == std::vector<double>{3, 2, 1});
  // A narrower result: the gradient is summed in x's dtype, where float16 would overflow past 65504 (PyTorch's rule).
  Tensor wide = ones({70000}, {.dtype = kFloat64}).requires_grad_();
  cumsum(wide, 0, kFloat16).sum().backward();
  const std::vector<double> g = values(wide.grad());
  CHECK(g[0] == 70000);
  CHECK(g[69999] == 1);
}

TEST_CASE("cumsum_ writes the running sums into the tensor in its own dtype, recorded where it has history") {
  Tensor counts = tensor<int32_t>({1, 2, 3});
  counts.cumsum_(0);
  CHECK(counts.dtype() == kInt32);
  CHECK(values(counts) == std::vector<double>{1, 3, 6});
  Tensor base = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor y = base * 2;
  y.cumsum_(0);
  CHECK(values(y) == std::vector<double>{2, 6, 12});
  y.mul(tensor<double>({1, 10, 100})).sum().backward();
  CHECK(values(base.grad()) == std::vector<double>{222, 220, 200});
}

TEST_CASE("cumsum refuses what it cannot sum, naming the op, and runs in float32 under autocast") {
  CHECK_THROWS_WITH_AS(zeros({2, 3}).cumsum(2), doctest::Contains("cumsum"), Error);
  CHECK_THROWS_WITH_AS(cumsum(zeros({2}), 0, kBool),
                       doctest::Contains("cumsum: running sums cannot be held in bool; got dtype bool for float32[2]"),
                       Error);
  CHECK_THROWS_WITH_AS(cumsum(Tensor(), 0), doctest::Contains("cumsum: the input is an undefined tensor"), Error);
  Tensor flags = tensor<bool>({true, false});
  CHECK_THROWS_WITH_AS(flags.cumsum_(0), doctest::Contains("cumsum_: running sums cannot be held in bool; got bool[2]"),
                       Error);
  amp::AutocastGuard autocast(kFloat16);
  CHECK(ones({3}, {.dtype = kFloat16}).cumsum(0).dtype() == kFloat32);
}

TEST_CASE("CUDA cumsum matches the CPU: rows of many tiles, columns, every dtype, and its gradient") {
  SKIP_WITHOUT_GPU();
  manual_seed(913);
  // {shape, dim}: rows of several block tiles; one element; short rows (a thread each); few long rows (cub's device
  // scan a row); few long columns (moved last, scanned as rows: of one tile, of several, few long ones); many columns
  // (a thread each); short columns.
  const std::vector<std::pair<Shape, int64_t>> cases = {
      {{3, 5000}, 1},  {{1, 1}, 1},        {{7, 1025}, -1},  {{5000, 10}, 1},  {{2, 70000}, 1},  {{70000}, 0},
      {{500, 6}, 0},   {{5, 3000, 4}, 1},  {{70000, 2}, 0},  {{100, 9000}, 0}, {{4, 30, 5}, 1},  {{5}, 0}};
  for (const auto& [shape, dim] : cases) {
    for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64, kInt64, kInt32, kUInt8, kBool}) {
      CAPTURE(shape_str(shape));
      CAPTURE(dim);
      CAPTURE(std::string(dtype_name(dt)));
      const Tensor x = (dt == kBool ? rand(shape).gt(0.5) : randint(-4, 5, shape).to(dt));
      const Tensor want = x.cumsum(dim), got = x.cuda().cumsum(dim).cpu();
      REQUIRE(got.dtype() == want.dtype());
      CHECK(values(got) == values(want));  // sums of small integers: exact in any order, rounded once to dt
    }
  }
  Tensor xc = randn({6, 3000}).requires_grad_(), xg = xc.detach().cuda().requires_grad_();
  const Tensor g = randn({6, 3000});
  xc.cumsum(1).backward(g);
  xg.cumsum(1).backward(g.cuda());
  halfgrad::testing::check_close(values(xg.grad().cpu()), values(xc.grad()), 1e-4);
  // reversed: the gradient of few long rows, and of short ones
  for (const Shape& shape : {Shape{2, 70000}, Shape{3000, 9}}) {
    Tensor lc = randint(-3, 4, shape).to(kFloat32).requires_grad_(), lg = lc.detach().cuda().requires_grad_();
    const Tensor seed = randint(-3, 4, shape).to(kFloat32);
    lc.cumsum(1).backward(seed);
    lg.cumsum(1).backward(seed.cuda());
    CHECK(values(lg.grad().cpu()) == values(lc.grad()));  // integer sums: exact in any order
  }
  CHECK(values(cumsum(tensor<int32_t>({100, 100, 100}).cuda(), 0, kUInt8).cpu()) == std::vector<double>{100, 200, 44});
  Tensor cc = randn({40, 7}).requires_grad_(), cg = cc.detach().cuda().requires_grad_();
  const Tensor g2 = randn({40, 7});
  cc.cumsum(0).backward(g2);
  cg.cumsum(0).backward(g2.cuda());
  CHECK(values(cg.grad().cpu()) == values(cc.grad()));  // short columns add in order on both devices
  Tensor fc = randint(-3, 4, {5000, 3}).to(kFloat32).requires_grad_(), fg = fc.detach().cuda().requires_grad_();
  const Tensor g3 = randint(-3, 4, {5000, 3}).to(kFloat32);
  fc.cumsum(0).backward(g3);
  fg.cumsum(0).backward(g3.cuda());
  CHECK(values(fg.grad().cpu()) == values(fc.grad()));  // few long columns reversed: integer sums, exact
}
