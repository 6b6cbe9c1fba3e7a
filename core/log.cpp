#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>

namespace halfgrad {

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stdout_color_mt("halfgrad");
    const char* level = std::getenv("HALFGRAD_LOG");
    l->set_level(level ? spdlog::level::from_str(level) : spdlog::level::info);
    l->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
    return l;
  }();
  return *instance;
}

}  // namespace halfgrad
