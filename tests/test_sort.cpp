// sort, argsort and topk (ops/sort.h): PyTorch's order (NaN above every number, -0.0 equal to 0.0, ties in their
// order), values and indices along any dim, gradients through gather, errors, and CUDA against the CPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/cuda.h"
#include "halfgrad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;
using halfgrad::testing::values;

namespace {
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// NaN-aware equality of two value lists (NaN equals NaN).
bool same_values(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}
}  // namespace

TEST_CASE("sort orders each slice along dim, ties in their order, and returns where each value came from") {
  const Tensor x = tensor<double>({3, 1, 2, 1});
  const auto [up, up_at] = x.sort();
  CHECK(values(up) == std::vector<double>{1, 1, 2, 3});
  CHECK(values(up_at) == std::vector<double>{1, 3, 2, 0});
  CHECK(up_at.dtype() == kInt64);
  const auto [down, down_at] = x.sort(0, /*descending=*/true);
  CHECK(values(down) == std::vector<double>{3, 2, 1, 1});
  CHECK(values(down_at) == std::vector<double>{0, 2, 1, 3});
  CHECK(values(x.argsort()) == values(up_at));
  const Tensor m = tensor<int64_t>({5, 2, 9, 1, 7, 3}, {2, 3});
  const auto [by_row, by_row_at] = m.sort(1);
  CHECK(values(by_row) == std::vector<double>{2, 5, 9, 1, 3, 7});
  CHECK(values(by_row_at) == std::vector<double>{1, 0, 2, 0, 2, 1});
  const auto [by_column, by_column_at] = m.sort(0, true);
  CHECK(values(by_column) == std::vector<double>{5, 7, 9, 1, 2, 3});
  CHECK(values(by_column_at) == std::vector<double>{0, 1, 0, 1, 0, 1});
  CHECK(by_column.is_contiguous());
  CHECK(values(tensor<bool>({true, false, true}).sort().first) == std::vector<double>{0, 1, 1});
  CHECK(values(tensor<float>({2.5f, -1, 0.5f}).to(kFloat16).sort().first) == std::vector<double>{-1, 0.5, 2.5});
  const auto [one, one_at] = scalar_tensor(4.0).sort();
  CHECK(one.dim() == 0);
  CHECK(values(one_at) == std::vector<double>{0});
  CHECK(zeros({3, 0}).sort(1).first.shape() == Shape{3, 0});
  CHECK(zeros({0, 3}).argsort(1).shape() == Shape{0, 3});
}

TEST_CASE("sort puts NaN above every number, whatever its sign, and keeps -0.0 and 0.0 in their order") {
  const double negative_nan = std::copysign(kNan, -1.0);
  const Tensor x = tensor<double>({kNan, 1, -kInf, negative_nan, 0});
  const auto [up, up_at] = x.sort();
  CHECK(same_values(values(up), {-kInf, 0, 1, kNan, kNan}));
  CHECK(values(up_at) == std::vector<double>{2, 4, 1, 0, 3});
  const auto [down, down_at] = x.sort(0, true);
  CHECK(same_values(values(down), {kNan, kNan, 1, 0, -kInf}));
  CHECK(values(down_at) == std::vector<double>{0, 3, 1, 4, 2});
  const Tensor zeros_signed = tensor<double>({0.0, -0.0, -0.0, 0.0, -1.0});
  const auto [z, z_at] = zeros_signed.sort();
  CHECK(values(z_at) == std::vector<double>{4, 0, 1, 2, 3});
  const std::vector<double> zv = values(z);
  CHECK((!std::signbit(zv[1]) && std::signbit(zv[2]) && std::signbit(zv[3]) && !std::signbit(zv[4])));
}

TEST_CASE("topk: the k largest or smallest along dim, in order, with their positions") {
  const Tensor x = tensor<double>({1, 5, 3, 5, 2});
  const auto [top, top_at] = x.topk(2);
  CHECK(values(top) == std::vector<double>{5, 5});
  CHECK(values(top_at) == std::vector<double>{1, 3});
  const auto [low, low_at] = x.topk(2, 0, /*largest=*/false);
  CHECK(values(low) == std::vector<double>{1, 2});
  CHECK(values(low_at) == std::vector<double>{0, 4});
  CHECK(x.topk(0).first.shape() == Shape{0});
  const Tensor scores = tensor<float>({0.1f, 0.7f, 0.2f, 0.9f, 0.3f, 0.4f}, {2, 3});
  const auto [best, best_at] = scores.topk(1, 1);
  CHECK(best.shape() == Shape{2, 1});
  CHECK(values(best_at) == std::vector<double>{1, 0});
  CHECK(values(scores.topk(1, 0).second) == std::vector<double>{1, 0, 1});
  CHECK(scalar_tensor(3.0).topk(1).first.dim() == 0);
  CHECK_THROWS_WITH_AS(scalar_tensor(3.0).topk(1, 5), doctest::Contains("topk"), Error);
  CHECK_THROWS_WITH_AS(x.topk(6), doctest::Contains("topk: k 6 is out of range for dim 0 of size 5 of float64[5] cpu"),
                       Error);
  CHECK_THROWS_WITH_AS(x.topk(-1), doctest::Contains("topk: k -1 is out of range"), Error);
  CHECK_THROWS_WITH_AS(x.sort(1), doctest::Contains("sort"), Error);
  CHECK_THROWS_WITH_AS(Tensor().argsort(), doctest::Contains("argsort: the input is an undefined tensor"), Error);
}

// The first k of sort's values and positions along dim: what topk must give.
std::pair<Tensor, Tensor> first_k_of_sort(const Tensor& x, int64_t k, int64_t dim, bool largest) {
  const auto [sorted, at] = x.sort(dim, largest);
  return {sorted.narrow(dim, 0, k), at.narrow(dim, 0, k)};
}

TEST_CASE("topk equals the first k of a stable sort: ties by position, NaN above every number, any k and dim") {
  manual_seed(924);
  const std::vector<double> special = {kNan, 1, -kInf, std::copysign(kNan, -1.0), 0, -0.0, kInf, 2};
  for (const Shape& shape : {Shape{40, 300}, Shape{300, 40}, Shape{2, 3, 50}}) {
    const std::vector<double> plain = values(randint(0, 4, shape));  // few distinct values: ties everywhere
    std::vector<double> with_special = plain;
    for (size_t i = 0; i < plain.size(); i += 7) with_special[i] = special[(i / 7) % special.size()];
    for (DType dt : {kFloat64, kFloat32, kBFloat16, kInt64, kUInt8}) {
      const Tensor x = tensor<double>(is_floating(dt) ? with_special : plain, shape).to(dt);
      for (int64_t dim : {int64_t(-1), int64_t(0)}) {
        const int64_t n = x.size(dim);
        for (int64_t k : {int64_t(1), std::min<int64_t>(3, n), n / 2, n}) {
          for (bool largest : {true, false}) {
            CAPTURE(shape_str(shape));
            CAPTURE(std::string(dtype_name(dt)));
            CAPTURE(dim);
            CAPTURE(k);
            CAPTURE(largest);
            const auto [top, top_at] = x.topk(k, dim, largest);
            const auto [want, want_at] = first_k_of_sort(x, k, dim, largest);
            REQUIRE(values(top_at) == values(want_at));
            REQUIRE(same_values(values(top), values(want)));
          }
        }
      }
    }
  }
}

TEST_CASE("sort's and topk's gradients go back to the positions the values came from") {
  Tensor x = tensor<double>({3, 1, 2}).requires_grad_();
  x.sort().first.mul(tensor<double>({1, 10, 100})).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{100, 1, 10});
  x.set_grad(Tensor());
  x.topk(2).first.mul(tensor<double>({1, 10})).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{1, 0, 10});
  manual_seed(921);
  gradcheck([](const TensorList& in) { return in[0].sort(1, true).first; }, {leaf({3, 5})});
  gradcheck([](const TensorList& in) { return in[0].topk(2, 0).first; }, {leaf({4, 3})});
}

TEST_CASE("the CPU's sort over many rows equals a stable sort of each row") {
  manual_seed(922);
  const Tensor x = randint(0, 50, {300, 500});
  const auto [sorted, at] = x.sort(1);
  const std::vector<double> v = values(x), s = values(sorted), a = values(at);
  for (int64_t r = 0; r < 300; r += 37) {
    std::vector<int64_t> order(500);
    for (int64_t j = 0; j < 500; ++j) order[size_t(j)] = j;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t p, int64_t q) { return v[size_t(r * 500 + p)] < v[size_t(r * 500 + q)]; });
    for (int64_t j = 0; j < 500; ++j) {
      REQUIRE(a[size_t(r * 500 + j)] == double(order[size_t(j)]));
      REQUIRE(s[size_t(r * 500 + j)] == v[size_t(r * 500 + order[size_t(j)])]);
    }
  }
}

TEST_CASE("CUDA sort in every dtype, argsort with NaN, signed zeros and long rows, and topk match the CPU") {
  SKIP_WITHOUT_GPU();
  manual_seed(923);
  const std::vector<std::pair<Shape, int64_t>> cases = {
      {{1, 1}, 1}, {{7, 300}, 1}, {{300, 7}, 0}, {{3, 100000}, -1}, {{5, 4, 6}, 1}, {{9}, 0}, {{3, 4096}, 1}};
  for (const auto& [shape, dim] : cases) {
    for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64, kInt64, kInt32, kUInt8, kBool}) {
      for (bool descending : {false, true}) {
        CAPTURE(shape_str(shape));
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(descending);
        // few distinct values: many ties, whose order the stable sort keeps on both devices
        const Tensor x = dt == kBool ? rand(shape).gt(0.5) : randint(0, 9, shape).to(dt);
        const auto [values_cpu, at_cpu] = x.sort(dim, descending);
        const auto [values_gpu, at_gpu] = x.cuda().sort(dim, descending);
        CHECK(values(at_gpu.cpu()) == values(at_cpu));
        CHECK(values(values_gpu.cpu()) == values(values_cpu));
      }
    }
  }
  // NaN of either sign, infinities and signed zeros, in rows short enough for cub's merge sort (8), between (100),
  // a block's sort a row in registers (513 to 4,096: 4, 8 and 16 keys a thread), rows for cub's radix sort (5,000),
  // many rows (600), and few long rows (2 x 70,000: a device-wide sort a row).
  const std::vector<double> special = {kNan, 1, -kInf, std::copysign(kNan, -1.0), 0, -0.0, kInf, 0, -2.5};
  for (const Shape& shape : {Shape{1, 8}, Shape{5, 100}, Shape{3, 513}, Shape{3, 1000}, Shape{2, 2048}, Shape{3, 2049},
                             Shape{2, 4096}, Shape{2, 5000}, Shape{600, 9}, Shape{2, 70000}}) {
    std::vector<double> v(size_t(numel_of(shape)));
    const std::vector<double> noise = values(randint(-3, 4, shape));
    for (size_t i = 0; i < v.size(); ++i) v[i] = i % 3 == 0 ? special[(i / 3) % special.size()] : noise[i];
    for (DType dt : {kFloat64, kFloat32, kFloat16, kBFloat16}) {
      CAPTURE(shape_str(shape));
      CAPTURE(std::string(dtype_name(dt)));
      const Tensor x = tensor<double>(v, shape).to(dt);
      for (bool descending : {false, true}) {
        CAPTURE(descending);
        CHECK(values(x.cuda().argsort(1, descending).cpu()) == values(x.argsort(1, descending)));
      }
    }
  }
  const Tensor long_ints = randint(-1000, 1000, {2, 70000});
  CHECK(values(long_ints.cuda().argsort(1, true).cpu()) == values(long_ints.argsort(1, true)));
}

TEST_CASE("CUDA topk matches the CPU: one round of selection or several, chunks short of k, ties, NaN, every dtype") {
  SKIP_WITHOUT_GPU();
  manual_seed(925);
  // (shape, k): rows within one chunk (4,096); rows of 25 chunks whose kept 125 are selected again; a last chunk of 7,
  // fewer than k; 1,000 of 200,000 (chunks of 4,000: four rounds); 1,024 of 4 x 4,096 + 3, whose second round has a
  // chunk of 3 positions and 1,021 empty places; k above half a row, and k above 1,024 (whole sorts, the second of
  // few long rows a row at a time); k = 0 and n.
  const std::vector<std::pair<Shape, int64_t>> cases = {
      {{300, 64}, 5},      {{64, 4096}, 16},         {{3, 100000}, 5},   {{4, 3 * 4096 + 7}, 16},
      {{2, 200000}, 1000}, {{3, 4 * 4096 + 3}, 1024}, {{6, 1000}, 700},   {{2, 200000}, 70000},
      {{5, 40}, 0},        {{5, 40}, 40}};
  const std::vector<double> special = {kNan, 1, -kInf, std::copysign(kNan, -1.0), 0, -0.0, kInf, 2};
  for (const auto& [shape, k] : cases) {
    const std::vector<double> ties = values(randint(0, 3, shape)), spread = values(randn(shape).mul(50));
    std::vector<double> ties_special = ties, spread_special = spread;
    for (size_t i = 0; i < ties.size(); i += 11)
      ties_special[i] = spread_special[i] = special[(i / 11) % special.size()];
    for (DType dt : {kFloat32, kFloat16, kBFloat16, kFloat64, kInt64, kInt32, kUInt8, kBool}) {
      const bool floating = is_floating(dt);
      for (const std::vector<double>* v : {floating ? &ties_special : &ties, floating ? &spread_special : &spread}) {
        for (bool largest : {true, false}) {
          CAPTURE(shape_str(shape));
          CAPTURE(k);
          CAPTURE(std::string(dtype_name(dt)));
          CAPTURE(v == &ties || v == &ties_special);
          CAPTURE(largest);
          const Tensor x = tensor<double>(*v, shape).to(dt);
          const auto [top, top_at] = x.cuda().topk(k, 1, largest);
          const auto [want, want_at] = x.topk(k, 1, largest);
          REQUIRE(values(top_at.cpu()) == values(want_at));
          REQUIRE(same_values(values(top.cpu()), values(want)));
        }
      }
    }
  }
  const Tensor columns = randn({5000, 3});  // dim 0: the rows are x's columns
  CHECK(values(columns.cuda().topk(7, 0).second.cpu()) == values(columns.topk(7, 0).second));
  Tensor xc = randn({6, 50}).requires_grad_(), xg = xc.detach().cuda().requires_grad_();
  const Tensor g = randn({6, 4});
  xc.topk(4, 1).first.backward(g);
  xg.topk(4, 1).first.backward(g.cuda());
  CHECK(values(xg.grad().cpu()) == values(xc.grad()));
}
