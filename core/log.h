#pragma once
// Logging through spdlog. The level comes from the environment variable HALFGRAD_LOG, in any case: trace, debug,
// info, warn (or warning), error, critical, off; info when unset or empty. A value that names no level leaves
// info on and logs a warning listing the valid ones.
#include <spdlog/spdlog.h>

#include <optional>
#include <string_view>

namespace halfgrad {

spdlog::logger& logger();  // the "halfgrad" logger, created on first use

// The level a HALFGRAD_LOG value names ("debug", "DEBUG", "Warning"); nullopt when it names none.
std::optional<spdlog::level::level_enum> parse_log_level(std::string_view name);

}  // namespace halfgrad
