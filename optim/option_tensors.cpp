#include "optim/option_tensors.h"

#include <type_traits>

namespace halfgrad::optim {

namespace {
template <typename T>
constexpr bool is_list = std::is_same_v<T, std::vector<double>> || std::is_same_v<T, std::vector<int64_t>>;
template <typename T> constexpr DType dtype_of_option() {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, std::vector<double>>) return kFloat64;
  else if constexpr (std::is_same_v<T, bool>) return kBool;
  else return kInt64;
}
}  // namespace

NamedTensors option_tensors(const std::vector<NamedOption>& options, std::string_view prefix) {
  NamedTensors named;
  for (const NamedOption& option : options) {
    Tensor t = std::visit(
        [](auto* v) -> Tensor {
          using T = std::remove_pointer_t<decltype(v)>;
          if constexpr (is_list<T>) return tensor(*v);
          else return scalar_tensor(*v, {.dtype = dtype_of_option<T>()});
        },
        option.value);
    named.emplace_back(std::string(prefix) + option.name, std::move(t));
  }
  return named;
}

std::vector<std::string> read_option_tensors(const std::vector<NamedOption>& options, const NamedTensors& named,
                                             std::vector<std::string>& errors, std::string_view prefix) {
  std::vector<std::string> absent;
  for (const NamedOption& option : options) {
    const std::string name = std::string(prefix) + option.name;
    bool found = false;
    for (const auto& [entry, t] : named) {
      if (entry != name) continue;
      if (found) {
        errors.push_back(fmt::format("'{}' is there twice", name));
        continue;
      }
      found = true;
      std::visit(
          [&](auto* v) {
            using T = std::remove_pointer_t<decltype(v)>;
            constexpr DType dtype = dtype_of_option<T>();
            if (!t.defined() || t.dim() != (is_list<T> ? 1 : 0) || t.dtype() != dtype) {
              errors.push_back(fmt::format("'{}' must be a {} {}, got {}", name, is_list<T> ? "1-d" : "0-d",
                                           dtype_name(dtype), t.defined() ? t.meta() : "an undefined tensor"));
            } else if constexpr (is_list<T>) {
              *v = to_vector<typename T::value_type>(t);
            } else {
              *v = t.template item<T>();
            }
          },
          option.value);
    }
    if (!found) absent.push_back(name);
  }
  return absent;
}

void fail_loading(std::string_view who, std::string_view what, const std::vector<std::string>& errors) {
  HG_FAIL("{}: cannot load the {} ({} problem{}):\n  - {}", who, what, errors.size(), errors.size() == 1 ? "" : "s",
          fmt::join(errors, "\n  - "));
}

}  // namespace halfgrad::optim
