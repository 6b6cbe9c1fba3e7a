#include "core/version.h"

#include <Eigen/Core>
#include <fmt/format.h>
#include <omp.h>

#include "core/storage.h"
#include "halfgrad_commit.h"  // generated at build time: cmake/git_commit.cmake

namespace halfgrad {

const char* version() { return "0.1.0"; }

const char* git_commit() { return HALFGRAD_GIT_COMMIT; }

bool built_with_cuda() {
#if HALFGRAD_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string build_summary() {
  return fmt::format("halfgrad {} | CPU: Eigen {}.{}.{}, {} OpenMP threads, a cache of {} MiB | CUDA backend: {}",
                     version(), EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION, omp_get_max_threads(),
                     cpu_cache_limit() >> 20, built_with_cuda() ? "compiled in" : "not built");
}

}  // namespace halfgrad
