#pragma once
#include <fmt/format.h>

#include <compare>
#include <string>

namespace halfgrad {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;  // the GPU's ordinal; always 0 for the CPU

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool operator==(const Device&) const = default;
  auto operator<=>(const Device&) const = default;  // so devices can key maps
  std::string str() const { return is_cpu() ? "cpu" : fmt::format("cuda:{}", index); }
};

inline constexpr int kNumDeviceTypes = 2;

}  // namespace halfgrad

template <> struct fmt::formatter<halfgrad::Device> : fmt::formatter<std::string> {
  auto format(const halfgrad::Device& d, format_context& ctx) const {
    return fmt::formatter<std::string>::format(d.str(), ctx);
  }
};
