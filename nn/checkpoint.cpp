// Model and training checkpoints. See nn/checkpoint.h.
#include "nn/checkpoint.h"

#include <algorithm>
#include <charconv>
#include <string_view>

namespace halfgrad::nn {

namespace {
constexpr const char* kFormatKey = "halfgrad.format";
constexpr const char* kTrainingFormat = "training_checkpoint/1";
constexpr const char* kModelPrefix = "model.";
constexpr const char* kOptimizerPrefix = "optimizer.";

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

uint64_t parse_uint(const Metadata& metadata, const std::string& key, const std::string& path) {
  auto it = metadata.find(key);
  HG_CHECK(it != metadata.end(), "load_training_checkpoint: '{}': metadata \"{}\" is missing", path, key);
  const std::string& s = it->second;
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  HG_CHECK(ec != std::errc::result_out_of_range, "load_training_checkpoint: '{}': metadata \"{}\" is \"{}\", more "
           "than a uint64 holds", path, key, s);
  HG_CHECK(ec == std::errc() && end == s.data() + s.size() && !s.empty(),
           "load_training_checkpoint: '{}': metadata \"{}\" is \"{}\", not a non-negative integer", path, key, s);
  return value;
}
}  // namespace

void save(const Module& module, const std::string& path, Metadata metadata) {
  metadata.emplace("format", "pt");
  save_safetensors(path, module.state_dict(), metadata);
}

LoadResult load(Module& module, const std::string& path, const LoadOptions& options) {
  SafetensorsContents contents = load_safetensors(path);
  try {
    return module.load_state_dict(contents.tensors, options);
  } catch (const Error& e) {
    HG_FAIL("nn::load: '{}': {}", path, e.what());
  }
}

void save_training_checkpoint(const std::string& path, const TrainingCheckpoint& checkpoint) {
  NamedTensors all;
  for (const auto& [name, t] : checkpoint.model) all.emplace_back(kModelPrefix + name, t);
  for (const auto& [name, t] : checkpoint.optimizer) all.emplace_back(kOptimizerPrefix + name, t);
  for (const auto& [name, t] : checkpoint.extra) {
    HG_CHECK(!starts_with(name, kModelPrefix) && !starts_with(name, kOptimizerPrefix),
             "save_training_checkpoint: extra tensor '{}' uses a prefix reserved for the model or the optimizer", name);
    all.emplace_back(name, t);
  }
  Metadata metadata;
  for (const auto& [key, value] : checkpoint.metadata) {
    HG_CHECK(!starts_with(key, "halfgrad."), "save_training_checkpoint: metadata key '{}' is reserved", key);
    metadata[key] = value;
  }
  metadata[kFormatKey] = kTrainingFormat;
  HG_CHECK(checkpoint.epoch >= 0 && checkpoint.step >= 0, "save_training_checkpoint: epoch {} and step {} must be >= 0",
           checkpoint.epoch, checkpoint.step);
  metadata["halfgrad.epoch"] = std::to_string(checkpoint.epoch);
  metadata["halfgrad.step"] = std::to_string(checkpoint.step);
  // Strings, not numbers: safetensors metadata values are strings, and a 64-bit seed does not survive a
  // round trip through a JSON reader that uses doubles.
  metadata["halfgrad.rng.seed"] = std::to_string(checkpoint.rng.seed);
  metadata["halfgrad.rng.offset"] = std::to_string(checkpoint.rng.offset);
  save_safetensors(path, all, metadata);
}

TrainingCheckpoint load_training_checkpoint(const std::string& path) {
  SafetensorsContents contents = load_safetensors(path);
  auto format = contents.metadata.find(kFormatKey);
  HG_CHECK(format != contents.metadata.end(), "load_training_checkpoint: '{}' is not a halfgrad training checkpoint "
           "(no \"{}\" in its metadata; a model checkpoint is read with nn::load)", path, kFormatKey);
  HG_CHECK(format->second == kTrainingFormat, "load_training_checkpoint: '{}' has format \"{}\"; this halfgrad reads "
           "\"{}\"", path, format->second, kTrainingFormat);

  TrainingCheckpoint ck;
  uint64_t epoch = parse_uint(contents.metadata, "halfgrad.epoch", path);
  uint64_t step = parse_uint(contents.metadata, "halfgrad.step", path);
  HG_CHECK(epoch <= uint64_t(INT64_MAX) && step <= uint64_t(INT64_MAX),
           "load_training_checkpoint: '{}': epoch or step out of range", path);
  ck.epoch = int64_t(epoch);
  ck.step = int64_t(step);
  ck.rng.seed = parse_uint(contents.metadata, "halfgrad.rng.seed", path);
  ck.rng.offset = parse_uint(contents.metadata, "halfgrad.rng.offset", path);
  for (auto& [key, value] : contents.metadata)
    if (!starts_with(key, "halfgrad.")) ck.metadata[key] = value;

  // The file lists tensors in data order; give each group back sorted by name, a stable order to compare.
  std::sort(contents.tensors.begin(), contents.tensors.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [name, t] : contents.tensors) {
    if (starts_with(name, kModelPrefix)) ck.model.emplace_back(name.substr(std::string_view(kModelPrefix).size()), t);
    else if (starts_with(name, kOptimizerPrefix)) ck.optimizer.emplace_back(name.substr(std::string_view(kOptimizerPrefix).size()), t);
    else ck.extra.emplace_back(name, t);
  }
  return ck;
}

}  // namespace halfgrad::nn
