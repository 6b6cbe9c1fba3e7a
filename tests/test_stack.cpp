// stack: a new dim at any position, values, dtype promotion, errors, gradients.
#include <doctest/doctest.h>

#include <vector>

#include "core/autocast.h"
#include "halfgrad.h"
#include "ops/stack.h"
#include "tests/gradcheck.h"

using namespace halfgrad;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

TEST_CASE("cat keeps channels_last where every input is so, as PyTorch's, else gives a contiguous result") {
  const Tensor a = arange(120, {.dtype = kFloat32}).view({2, 3, 4, 5}), b = a * 2;
  const Tensor a_cl = contiguous_channels_last(a), b_cl = contiguous_channels_last(b);
  for (int64_t dim : {0, 1, 2, 3}) {
    CAPTURE(dim);
    const Tensor both = cat({a_cl, b_cl}, dim);
    CHECK(is_channels_last(both));
    CHECK(to_vector<float>(both) == to_vector<float>(cat({a, b}, dim)));
    CHECK(cat({a_cl, b}, dim).is_contiguous());  // mixed layouts: contiguous
  }
}

TEST_CASE("stack inserts a new dim at dim, counting negative dims from the end of the result") {
  Tensor a = tensor<float>({1, 2, 3, 4, 5, 6}, {2, 3}), b = tensor<float>({7, 8, 9, 10, 11, 12}, {2, 3});
  CHECK(stack({a, b}).shape() == Shape{2, 2, 3});
  CHECK(stack({a, b}, 1).shape() == Shape{2, 2, 3});
  CHECK(stack({a, b}, 2).shape() == Shape{2, 3, 2});
  CHECK(stack({a, b}, -1).shape() == Shape{2, 3, 2});
  CHECK(stack({a, b, a}, -3).shape() == Shape{3, 2, 3});
  CHECK(to_vector<float>(stack({a, b}, 0)) == std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  CHECK(to_vector<float>(stack({a, b}, 2)) == std::vector<float>{1, 7, 2, 8, 3, 9, 4, 10, 5, 11, 6, 12});
  CHECK(to_vector<float>(stack({scalar_tensor(1.0f), scalar_tensor(2.0f)})) == std::vector<float>{1, 2});
}

TEST_CASE("stack promotes mixed dtypes like cat") {
  Tensor s = stack({ones({2}, {.dtype = kFloat16}), ones({2}, {.dtype = kFloat32})});
  CHECK(s.dtype() == kFloat32);
  CHECK(stack({ones({2}, {.dtype = kInt64}), ones({2}, {.dtype = kInt64})}).dtype() == kInt64);
  amp::AutocastGuard guard(kFloat16);  // "promote": the widest floating input, even under autocast
  CHECK(stack({ones({2}, {.dtype = kFloat16}), ones({2}, {.dtype = kFloat32})}).dtype() == kFloat32);
}

TEST_CASE("stack errors name the mismatching tensors and shapes") {
  CHECK_THROWS_WITH_AS(stack({ones({2, 3}), ones({3, 2})}),
                       doctest::Contains("stack: expects each tensor to be of equal shape, but tensor 0 is float32[2, 3] cpu "
                                         "and tensor 1 is float32[3, 2] cpu"), Error);
  CHECK_THROWS_WITH_AS(stack({}), doctest::Contains("stack: expects a non-empty list"), Error);
  CHECK_THROWS_WITH_AS(stack({ones({2}), ones({2})}, 2), doctest::Contains("stack"), Error);
}

TEST_CASE("stack gradients match finite differences") {
  manual_seed(301);
  for (int64_t dim : {0, 1, -1}) {
    CAPTURE(dim);
    gradcheck([dim](const TensorList& in) { return stack(in, dim); }, {leaf({2, 3}), leaf({2, 3}), leaf({2, 3})});
  }
  // Only some inputs require grad.
  gradcheck([](const TensorList& in) { return stack(in, 1); }, {leaf({4}), randn({4}, {.dtype = kFloat64})});
}
