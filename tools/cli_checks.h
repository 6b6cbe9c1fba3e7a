#pragma once
// The checks of every command line in tools/ (halfgrad and the bench_* programs), applied when the line is parsed.
// Numbers: CLI11's own (PositiveNumber, Range) let inf, nan, hex and octal through, and clamp or wrap out-of-range
// integers; tests/cli_hostile_numbers.sh tries them on the halfgrad command. File names: see file_name.
#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

namespace halfgrad::cli {

// An integer in [min, max] (max: T's largest by default), written in plain decimal: digits after an optional '-',
// no leading zeros. -1 is refused where it would wrap to 2^64 - 1 (a seed) or read as "all" (a limit), a number beyond
// T's range where CLI11 would clamp it, and hex, exponents and leading zeros, which CLI11 (strtoll, base 0) would read
// as hex or octal: "010" would be 8.
template <typename T> CLI::Validator integer_in(T min, T max = std::numeric_limits<T>::max()) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        const bool negative = !text.empty() && text[0] == '-';
        const std::string digits = text.substr(negative ? 1 : 0);
        if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
            (digits[0] == '0' && (digits.size() > 1 || negative)))
          return fmt::format("{} is not an integer in plain decimal", text);
        if (negative && std::is_unsigned_v<T>) return fmt::format("{} must be >= {}", text, min);
        T value{};
        const auto error = std::from_chars(text.data(), text.data() + text.size(), value).ec;
        if (error == std::errc::result_out_of_range)
          return negative ? fmt::format("{} must be >= {}", text, min)
                          : fmt::format("{} is out of range (at most {})", text, max);
        if (value < min) return fmt::format("{} must be >= {}", text, min);
        if (value > max) return fmt::format("{} is out of range (at most {})", text, max);
        return {};
      },
      max == std::numeric_limits<T>::max() ? fmt::format("INTEGER >= {}", min)
                                           : fmt::format("INTEGER in [{}, {}]", min, max));
}

// A validator of finite numbers: inf, nan and 1e400 are refused when the command line is parsed (CLI::PositiveNumber
// lets inf through, CLI::Range nan: every comparison with it is false); then `rule` says what else is wrong with the
// value, if anything.
inline CLI::Validator finite(std::function<std::string(const std::string& text, double value)> rule, std::string name) {
  return CLI::Validator(
      [rule = std::move(rule)](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v))
          return fmt::format("{} is not a finite number", text);
        return rule(text, v);
      },
      std::move(name));
}

// A finite number in [lo, hi].
inline CLI::Validator finite_in(double lo, double hi) {
  return finite([lo, hi](const std::string& text, double v) {
    return v < lo || v > hi ? fmt::format("{} is not in [{}, {}]", text, lo, hi) : std::string();
  }, fmt::format("FINITE in [{}, {}]", lo, hi));
}

// A finite number >= min (or > min when `strictly`).
inline CLI::Validator finite_at_least(double min, bool strictly = false) {
  return finite([min, strictly](const std::string& text, double v) {
    return (strictly ? v <= min : v < min) ? fmt::format("{} must be {} {}", text, strictly ? ">" : ">=", min)
                                           : std::string();
  }, fmt::format("FINITE {} {}", strictly ? ">" : ">=", min));
}

// A file or folder name that is not an option: CLI11 reads `--save= --dry-run` as --save with the value "--dry-run"
// (an empty value after '=' takes the next argument), which would write a file of that name and drop the flag.
inline CLI::Validator file_name() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        return text.starts_with("-") ? fmt::format("'{}' is an option, not a file name (an empty value is written as "
                                                   "\"\", not with '=' and nothing after it; a file whose name "
                                                   "starts with '-' as ./{})", text, text)
                                     : std::string();
      },
      "");
}

}  // namespace halfgrad::cli
