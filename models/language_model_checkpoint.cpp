// Language model checkpoints with their architecture and vocabulary (models/language_model_checkpoint.h).
#include "models/language_model_checkpoint.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <string_view>
#include <system_error>

#include "core/error.h"
#include "core/serialize.h"
#include "nn/checkpoint.h"
#include "ops/rnn.h"

namespace halfgrad::models {

namespace {

constexpr const char* kFormatKey = "halfgrad.format";
constexpr const char* kFormat = "language_model/1";

constexpr std::pair<nn::RecurrentKind, const char*> kKindNames[] = {
    {nn::RecurrentKind::LSTM, "lstm"},
    {nn::RecurrentKind::GRU, "gru"},
    {nn::RecurrentKind::RNNTanh, "rnn_tanh"},
    {nn::RecurrentKind::RNNReLU, "rnn_relu"},
};

const char* kind_name(nn::RecurrentKind kind) {
  for (const auto& [k, name] : kKindNames)
    if (k == kind) return name;
  HG_FAIL("save_language_model: unknown recurrent kind {}", int(kind));
}

// Reads the "halfgrad.*" entries of one file; every error names the file and the entry.
struct MetadataReader {
  const Metadata& metadata;
  const std::string& path;

  const std::string& text(const std::string& key) const {
    auto it = metadata.find(key);
    HG_CHECK(it != metadata.end(), "load_language_model: '{}': metadata \"{}\" is missing", path, key);
    return it->second;
  }
  template <typename T> T number(const std::string& key, T min) const {
    const std::string& s = text(key);
    T value{};
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
    HG_CHECK(!s.empty() && ec == std::errc() && end == s.data() + s.size() && value >= min,
             "load_language_model: '{}': metadata \"{}\" is \"{}\", not a number >= {}", path, key, s, min);
    return value;
  }
  bool boolean(const std::string& key) const {
    const std::string& s = text(key);
    HG_CHECK(s == "true" || s == "false", "load_language_model: '{}': metadata \"{}\" is \"{}\", not true or false",
             path, key, s);
    return s == "true";
  }
  nn::RecurrentKind kind(const std::string& key) const {
    const std::string& s = text(key);
    for (const auto& [k, name] : kKindNames)
      if (s == name) return k;
    HG_FAIL("load_language_model: '{}': metadata \"{}\" is \"{}\", not lstm, gru, rnn_tanh or rnn_relu", path, key, s);
  }
};

}  // namespace

void save_language_model(const LanguageModel& model, const data::Vocabulary& vocab, const std::string& path) {
  HG_CHECK(vocab.size() == model.vocab_size, "save_language_model: '{}': the vocabulary has {} words, the model {}",
           path, vocab.size(), model.vocab_size);
  std::string words;
  for (int64_t id = 0; id < vocab.size(); ++id) {
    const std::string& word = vocab.word(id);
    HG_CHECK(word.find('\n') == std::string::npos, "save_language_model: '{}': word {} contains a newline", path, id);
    words += word;
    words += '\n';
  }
  const LanguageModelOptions& o = model.options;
  nn::save(model, path,
           {{kFormatKey, kFormat},
            {"halfgrad.rnn", kind_name(o.kind)},
            {"halfgrad.emsize", std::to_string(o.embedding_size)},
            {"halfgrad.nhid", std::to_string(o.hidden_size)},
            {"halfgrad.nlayers", std::to_string(o.num_layers)},
            {"halfgrad.dropout", fmt::format("{}", o.dropout)},  // shortest text that reads back as the same double
            {"halfgrad.tied", o.tie_weights ? "true" : "false"},
            {"halfgrad.vocab_size", std::to_string(vocab.size())},
            {"halfgrad.vocab", std::move(words)}});
}

LoadedLanguageModel load_language_model(const std::string& path, Device device) {
  SafetensorsContents contents = load_safetensors(path);  // names the file when it is unreadable or not safetensors
  auto format = contents.metadata.find(kFormatKey);
  HG_CHECK(format != contents.metadata.end(), "load_language_model: '{}' is not a halfgrad language model checkpoint "
           "(no \"{}\" in its metadata; `halfgrad train-lm --save` writes one)", path, kFormatKey);
  HG_CHECK(format->second == kFormat, "load_language_model: '{}' has format \"{}\", not a language model checkpoint "
           "(\"{}\")", path, format->second, kFormat);

  const MetadataReader meta{contents.metadata, path};
  const LanguageModelOptions options{.kind = meta.kind("halfgrad.rnn"),
                                     .embedding_size = meta.number<int64_t>("halfgrad.emsize", 1),
                                     .hidden_size = meta.number<int64_t>("halfgrad.nhid", 1),
                                     .num_layers = meta.number<int64_t>("halfgrad.nlayers", 1),
                                     .dropout = meta.number<double>("halfgrad.dropout", 0),
                                     .tie_weights = meta.boolean("halfgrad.tied")};
  const int64_t vocab_size = meta.number<int64_t>("halfgrad.vocab_size", 1);

  LoadedLanguageModel loaded;
  const std::string_view words = meta.text("halfgrad.vocab");
  for (size_t at = 0; at < words.size();) {
    const size_t end = words.find('\n', at);
    HG_CHECK(end != std::string_view::npos, "load_language_model: '{}': metadata \"halfgrad.vocab\" does not end "
             "with a newline", path);
    const int64_t before = loaded.vocab.size();
    HG_CHECK(loaded.vocab.add(words.substr(at, end - at)) == before, "load_language_model: '{}': metadata "
             "\"halfgrad.vocab\" lists \"{}\" twice", path, words.substr(at, end - at));
    at = end + 1;
  }
  HG_CHECK(loaded.vocab.size() == vocab_size, "load_language_model: '{}': metadata \"halfgrad.vocab\" has {} words, "
           "\"halfgrad.vocab_size\" says {}", path, loaded.vocab.size(), vocab_size);

  // The sizes against the tensors before anything is built: corrupt metadata must not allocate a huge model.
  const std::map<std::string, const Tensor*> tensors = [&] {
    std::map<std::string, const Tensor*> by_name;
    for (const auto& [name, t] : contents.tensors) by_name.emplace(name, &t);
    return by_name;
  }();
  auto check_shape = [&](const std::string& name, const Shape& shape, const std::string& why_expected) {
    auto t = tensors.find(name);
    HG_CHECK(t != tensors.end(), "load_language_model: '{}' holds no tensor \"{}\"{}", path, name, why_expected);
    HG_CHECK(t->second->shape() == shape, "load_language_model: '{}': \"{}\" is {}, but the metadata's sizes make it "
             "{}", path, name, t->second->meta(), shape_str(shape));
  };
  // Every layer's tensors are in the file, so the layer count cannot exceed the file's tensors: checked first, so that
  // a huge count is refused before it is walked.
  HG_CHECK(options.num_layers <= int64_t(tensors.size()), "load_language_model: '{}': metadata \"halfgrad.nlayers\" "
           "says {} layers, more than the file's {} tensors", path, options.num_layers, tensors.size());
  check_shape("encoder.weight", {vocab_size, options.embedding_size}, "");
  const int64_t gates = rnn_gates(options.kind);
  for (int64_t layer = 0; layer < options.num_layers; ++layer) {
    check_shape(fmt::format("rnn.weight_hh_l{}", layer), {gates * options.hidden_size, options.hidden_size},
                fmt::format(" (metadata \"halfgrad.nlayers\" says {})", options.num_layers));
  }
  const std::string past_last = fmt::format("rnn.weight_hh_l{}", options.num_layers);
  HG_CHECK(!tensors.count(past_last), "load_language_model: '{}' holds \"{}\", a layer past the {} that metadata "
           "\"halfgrad.nlayers\" says", path, past_last, options.num_layers);
  try {
    loaded.model = std::make_shared<LanguageModel>(vocab_size, options);
    // Checks every name and shape (the metadata's sizes against the tensors'); O2/O3 files hold half tensors.
    loaded.model->load_state_dict(contents.tensors, {.convert_dtypes = true});
    loaded.model->to(device);
  } catch (const Error& e) {
    HG_FAIL("load_language_model: '{}': {}", path, e.what());
  }
  return loaded;
}

}  // namespace halfgrad::models
