// The compiler and flags build what the source says. A regression test for a GCC 12 miscompilation on
// AVX-512 machines with -march=native (see CMakeLists.txt: -fno-tree-slp-vectorize).
#include <doctest/doctest.h>

#include <vector>

TEST_CASE("a constant initialiser with a repeated half is compiled as written") {
  std::vector<double> v{3000, 3000, 3000, 3000, 0, 0, 0, 0};
  CHECK(v == std::vector<double>{3000, 3000, 3000, 3000, 0, 0, 0, 0});
  CHECK(v[4] == 0);
}
