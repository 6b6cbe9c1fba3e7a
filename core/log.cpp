#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cctype>
#include <cstdlib>
#include <string>

namespace halfgrad {

std::optional<spdlog::level::level_enum> parse_log_level(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  // spdlog's from_str answers "off" for any name it does not know: only "off" itself may mean off.
  const spdlog::level::level_enum level = spdlog::level::from_str(lower);
  if (level == spdlog::level::off && lower != "off") return std::nullopt;
  return level;
}

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stdout_color_mt("halfgrad");
    l->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
    l->set_level(spdlog::level::info);
    const char* value = std::getenv("HALFGRAD_LOG");
    if (value != nullptr && *value != '\0') {
      if (const auto level = parse_log_level(value)) {
        l->set_level(*level);
      } else {
        l->warn("HALFGRAD_LOG={}: not a log level; use one of trace, debug, info, warn, error, critical, off (in "
                "any case). Logging at info.", value);
      }
    }
    return l;
  }();
  return *instance;
}

}  // namespace halfgrad
