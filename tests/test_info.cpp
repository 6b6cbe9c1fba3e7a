// What halfgrad says about itself: the HALFGRAD_LOG levels and `halfgrad info`'s GPU lines.
#include <doctest/doctest.h>

#include "core/cuda.h"
#include "core/log.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::contains;

TEST_CASE("HALFGRAD_LOG names a level in any case, warning is warn, anything else names none") {
  CHECK(parse_log_level("debug") == spdlog::level::debug);
  CHECK(parse_log_level("DEBUG") == spdlog::level::debug);  // the bug: upper case silenced all logging
  CHECK(parse_log_level("Trace") == spdlog::level::trace);
  CHECK(parse_log_level("warning") == spdlog::level::warn);
  CHECK(parse_log_level("WARN") == spdlog::level::warn);
  CHECK(parse_log_level("off") == spdlog::level::off);
  CHECK(parse_log_level("OFF") == spdlog::level::off);
  CHECK_FALSE(parse_log_level("verbose").has_value());
  CHECK_FALSE(parse_log_level("").has_value());
}

TEST_CASE("halfgrad info: one line of library versions, then a line per visible GPU or why none is visible") {
  const std::vector<std::string> lines = cuda::describe_devices();
  REQUIRE(lines.size() >= 2);
  if (cuda::device_count() == 0) {
    REQUIRE(lines.size() == 2);
    CHECK(contains(lines[1], "GPUs: none visible"));
  } else {
    REQUIRE(lines.size() == size_t(1 + cuda::device_count()));
    CHECK(contains(lines[0], "cuDNN"));
    for (int d = 0; d < cuda::device_count(); ++d) {
      CHECK(contains(lines[size_t(1 + d)], cuda::device_name(d)));
      CHECK(contains(lines[size_t(1 + d)], "compute capability"));
    }
  }
}
