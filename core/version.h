#pragma once
// What this build of halfgrad is: its version and the backends compiled in.
#include <string>

namespace halfgrad {

const char* version();  // "0.1.0"
// The git commit this library was built from ("a1b2c3d4e5f6", "-dirty" appended when tracked files had changes; or
// "unknown" when not built from a git checkout).
const char* git_commit();
bool built_with_cuda();
std::string build_summary();  // one line: version, backends, OpenMP threads, the CPU cache's limit, Eigen version

}  // namespace halfgrad
