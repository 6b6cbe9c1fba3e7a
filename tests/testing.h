#pragma once
// Small helpers the op tests share (gradcheck has its own header, tests/gradcheck.h).
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <string>
#include <system_error>
#include <vector>

#include "core/cuda.h"
#include "halfgrad.h"

// The first line of every test that needs a GPU: it skips (with a message) when none is available, so the test
// passes in a build without CUDA and on a machine without a GPU (CI).
#define SKIP_WITHOUT_GPU()                       \
  do {                                           \
    if (!::halfgrad::cuda::is_available()) {     \
      MESSAGE("no GPU (or no CUDA): skipped");   \
      return;                                    \
    }                                            \
  } while (0)

namespace halfgrad::testing {

inline const std::vector<DType> kFloatTypes = {kFloat64, kFloat32, kFloat16, kBFloat16};

// randn drawn in float64, then rounded to `dtype`: the same values for every dtype of a comparison.
inline Tensor random(const Shape& shape, DType dtype) { return randn(shape, {.dtype = kFloat64}).to(dtype); }

// The message of the halfgrad::Error that f throws, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A fresh directory per test, removed afterwards (with whatever the test left in it).
struct TempDir {
  std::filesystem::path path;
  // in_memory: under /dev/shm where there is one, for tests that write thousands of small files.
  explicit TempDir(bool in_memory = false) {
    namespace fs = std::filesystem;
    static int counter = 0;
    const fs::path base = in_memory && fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    path = base / fmt::format("halfgrad_test_{}_{}", ::getpid(), counter++);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path, std::filesystem::perms::owner_all, std::filesystem::perm_options::add, ec);
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// A FIFO (named pipe) called `name` in `dir`, for readers that must refuse one where a file should be.
inline std::string make_fifo(const TempDir& dir, const std::string& name) {
  const std::string path = dir.file(name);
  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
  return path;
}

// error_of(f), where f reads the FIFO at `fifo`: a reader that opens it waits for a writer. If f has not returned
// after 10 s the check fails, and a writer opens and closes the FIFO so that f sees its end and returns.
inline std::string error_of_without_waiting(const std::string& fifo, const std::function<void()>& f) {
  std::future<std::string> error = std::async(std::launch::async, [&] { return error_of(f); });
  if (error.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    FAIL_CHECK("still waiting on the FIFO " << fifo << " after 10 s");
    const int fd = ::open(fifo.c_str(), O_WRONLY);
    if (fd >= 0) ::close(fd);
  }
  return error.get();
}

// train.txt, valid.txt and test.txt in `dir`, each holding `text`: a corpus for the language-model tests.
inline void write_splits(const TempDir& dir, const std::string& text) {
  for (const char* split : {"train.txt", "valid.txt", "test.txt"}) std::ofstream(dir.file(split)) << text;
}
// The same, each split `line` written `repeats` times.
inline void write_splits(const TempDir& dir, const std::string& line, int repeats) {
  std::string text;
  for (int i = 0; i < repeats; ++i) text += line;
  write_splits(dir, text);
}

// A CIFAR-10 binary file of n records: label i % 2; class 1 images bright, class 0 dark, with noise.
inline void write_cifar10(const std::string& path, int64_t n, uint64_t seed) {
  manual_seed(seed);
  const std::vector<double> noise = to_vector<double>(rand({n, 3072}) * 60.0);
  std::ofstream out(path, std::ios::binary);
  for (int64_t i = 0; i < n; ++i) {
    out.put(char(i % 2));
    for (int64_t b = 0; b < 3072; ++b) out.put(char(uint8_t((i % 2 ? 150 : 30) + noise[size_t(i * 3072 + b)])));
  }
}

// A tensor's values as float64, in row-major order (any dtype, device or layout).
inline std::vector<double> values(const Tensor& t) { return to_vector<double>(t); }

// The values an aligned-rows matrix's storage holds in its padding (MemoryFormat::AlignedRows: all zeros).
inline std::vector<double> aligned_padding(const Tensor& t) {
  const std::vector<double> storage = values(flat_storage_view(t));
  std::vector<double> padding;
  for (int64_t i = 0; i < int64_t(storage.size()); ++i)
    if (i / t.stride(0) >= t.size(0) || i % t.stride(0) >= t.size(1)) padding.push_back(storage[size_t(i)]);
  return padding;
}

// Same dtype, shape and values (each compared exactly, as float64).
inline bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && values(a) == values(b);
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Elementwise |got - want| <= tol (1 + |want|); reports the first five misses.
// A float64 reference result of a sum of products (a matrix product, a convolution): its values and, per element,
// the magnitude sum |a||b| that the rounding of a lower precision scales with.
struct Reference {
  Shape shape;
  std::vector<double> values, magnitude;
};

// The relative rounding error allowed per dtype against that magnitude. Half types accumulate in float32, so only the
// final rounding to 11 (float16) or 8 (bfloat16) significant bits shows; float32 sums of a few hundred products stay
// within ~1e-6 of the magnitude; float64 takes `float64` (the two callers: 1e-13 for products, 1e-12 for the
// convolutions' longer sums). Integers are exact.
inline double product_tolerance(DType t, double float64 = 1e-13) {
  switch (t) {
    case kFloat64: return float64;
    case kFloat32: return 1e-5;
    case kFloat16: return 1e-3;
    case kBFloat16: return 8e-3;
    default: return 0;
  }
}

// got (of `dtype`) against ref, element by element, within product_tolerance(dtype, float64) times the magnitude.
inline void check_matches(const Tensor& got, const Reference& ref, DType dtype, double float64 = 1e-13) {
  REQUIRE(got.shape() == ref.shape);
  REQUIRE(got.dtype() == dtype);
  const std::vector<double> g = to_vector<double>(got);
  REQUIRE(g.size() == ref.values.size());
  int failures = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double allowed = product_tolerance(dtype, float64) * ref.magnitude[i] + 1e-300;
    if (!(std::abs(g[i] - ref.values[i]) <= allowed) && failures++ < 3)
      FAIL_CHECK("element " << i << ": got " << g[i] << ", reference " << ref.values[i]);
  }
  CHECK(failures == 0);
}

inline void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  int failures = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= tol * (1 + std::abs(want[i]))) && failures++ < 5)
      FAIL_CHECK("element " << i << ": got " << got[i] << ", want " << want[i]);
  }
  CHECK(failures == 0);
}

}  // namespace halfgrad::testing
