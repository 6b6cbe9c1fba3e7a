#pragma once
// Logging through spdlog. The level comes from the environment variable HALFGRAD_LOG (trace, debug, info,
// warn, error, critical, off); info when unset.
#include <spdlog/spdlog.h>

namespace halfgrad {

spdlog::logger& logger();  // the "halfgrad" logger, created on first use

}  // namespace halfgrad
