#pragma once
// What this build of halfgrad is: its version and the backends compiled in.
#include <string>

namespace halfgrad {

const char* version();  // "0.1.0"
bool built_with_cuda();
std::string build_summary();  // one line: version, backends, OpenMP threads, Eigen version

}  // namespace halfgrad
