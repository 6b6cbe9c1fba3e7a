#pragma once
// What the libFuzzer targets share (tests/fuzz/README.md): the input written to a file of its own (every parser
// under test reads files), the logger silenced (a warning per execution would be most of the time), and the rule
// that a halfgrad::Error is the expected answer to bad input while anything else (another exception, a crash, a
// sanitizer report) is a finding.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "core/log.h"

namespace halfgrad::fuzz {

// A folder of this process's own in memory-backed storage where there is some (/dev/shm), else the temp folder.
inline const std::filesystem::path& work_dir() {
  static const std::filesystem::path dir = [] {
    const std::filesystem::path base =
        std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path();
    const std::filesystem::path d = base / ("halfgrad-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    logger().set_level(spdlog::level::off);
    return d;
  }();
  return dir;
}

// data[0, size) as the file `name` in work_dir(); its path.
inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::filesystem::path path = work_dir() / name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  return path.string();
}

// Runs fn; a halfgrad::Error (bad input, reported) is fine, anything else escapes to libFuzzer.
template <typename Fn> void expect_error_or_success(Fn&& fn) {
  try {
    fn();
  } catch (const Error&) {
  }
}

}  // namespace halfgrad::fuzz
