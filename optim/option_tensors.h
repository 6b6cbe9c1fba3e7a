#pragma once
// Options (and small state) as a checkpoint keeps them: each by its name as a tensor, numbers and flags 0-d
// (float64, int64, bool), lists 1-d (float64, int64). Schedulers and the GradScaler write theirs with option_tensors
// and read them back with read_option_tensors, which refuses an entry of another dtype or shape instead of converting
// it (an int64 scale of 2^62 would otherwise read as a scale of 4.6e18).
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "optim/optimizer.h"  // NamedTensors

namespace halfgrad::optim {

struct NamedOption {
  const char* name;
  std::variant<double*, int64_t*, bool*, std::vector<double>*, std::vector<int64_t>*> value;
};

// The options as named tensors, `prefix` before each name.
NamedTensors option_tensors(const std::vector<NamedOption>& options, std::string_view prefix = "");

// Reads the entries of `named` called prefix + an option's name into that option. An entry of another dtype or shape,
// or one named twice, is appended to `errors` and read into nothing. Returns the names (with the prefix) of the options
// `named` lacks; entries naming no option are the caller's.
std::vector<std::string> read_option_tensors(const std::vector<NamedOption>& options, const NamedTensors& named,
                                             std::vector<std::string>& errors, std::string_view prefix = "");

// The one error of a refused load: "<who>: cannot load the <what> (2 problems):\n  - ...\n  - ...".
[[noreturn]] void fail_loading(std::string_view who, std::string_view what, const std::vector<std::string>& errors);

}  // namespace halfgrad::optim
