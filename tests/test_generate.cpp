// `halfgrad generate` (train/loops.h: generate_words) and the language model checkpoint it reads
// (models/language_model_checkpoint.h): a tiny model trained on a text the test writes, saved by
// train_language_model, sampled back; files that are not such checkpoints are errors naming the file.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "halfgrad.h"
#include "models/language_model_checkpoint.h"
#include "nn/checkpoint.h"
#include "tests/testing.h"
#include "train/loops.h"

using namespace halfgrad;
using halfgrad::testing::contains;
using halfgrad::testing::error_of;
using halfgrad::testing::TempDir;
using halfgrad::testing::write_splits;

namespace {

const char* const kWords[] = {"the", "cat", "sat", "on", "a", "mat", "and", "then", "slept", "well"};

// Lines of ten words where each word is followed by the next of kWords (or by the line's end); as train.txt,
// valid.txt and test.txt of `dir`.
void write_corpus(const TempDir& dir) {
  std::string text;
  for (int line = 0; line < 60; ++line) {
    for (int w = 0; w < 10; ++w) text += std::string(kWords[(line + w) % 10]) + " ";
    text += "\n";
  }
  write_splits(dir, text);
}

// A GRU language model trained for `epochs` on that corpus, saved as dir/lm.safetensors (train-lm --save).
std::string train_tiny_model(const TempDir& dir, int64_t epochs) {
  write_corpus(dir);
  const std::string path = dir.file("lm.safetensors");
  // lr 5, not main.py's 20: at 20 a model this small learns chaotically, well or badly by the rounding of the
  // CPU's vector width (tests/test_train.cpp).
  train::LanguageModelConfig config{.rnn = "gru", .data_dir = dir.path, .embedding_size = 16, .hidden_size = 16,
                                    .num_layers = 1, .dropout = 0, .epochs = epochs, .batch_size = 4,
                                    .eval_batch_size = 2, .bptt = 8, .lr = 5, .checkpoint = path};
  train::train_language_model(config);
  return path;
}

// An untrained LSTM model over the same vocabulary, saved as dir/lm.safetensors (the format without the training).
std::string save_untrained_model(const TempDir& dir) {
  data::Vocabulary vocab;
  for (const char* w : kWords) vocab.add(w);
  vocab.add("<eos>");
  models::LanguageModel model(vocab.size(), {.embedding_size = 4, .hidden_size = 4, .num_layers = 1, .dropout = 0});
  const std::string path = dir.file("lm.safetensors");
  models::save_language_model(model, vocab, path);
  return path;
}

}  // namespace

TEST_CASE("generate: a seed gives the same words every time, another seed others, all from the vocabulary") {
  TempDir dir;
  const std::string path = train_tiny_model(dir, 1);
  train::GenerateConfig config{.checkpoint = path, .words = 50, .temperature = 1.0, .seed = 7};
  std::vector<std::string> streamed;
  const std::vector<std::string> words =
      train::generate_words(config, [&](int64_t i, const std::string& w) {
        CHECK(i == int64_t(streamed.size()));
        streamed.push_back(w);
      });
  REQUIRE(words.size() == 50);
  CHECK(streamed == words);
  std::set<std::string> vocabulary(std::begin(kWords), std::end(kWords));
  vocabulary.insert("<eos>");
  for (const std::string& w : words) CHECK(vocabulary.count(w) == 1);

  CHECK(train::generate_words(config) == words);
  config.seed = 8;
  CHECK(train::generate_words(config) != words);
  config.words = 0;
  CHECK(train::generate_words(config).empty());
}

TEST_CASE("generate: the text is written as generate.py writes it, a newline after every 20th word") {
  CHECK(train::generated_text({}) == "");
  std::vector<std::string> words(45, "w");
  words[19] = "<eos>";
  const std::string text = train::generated_text(words);
  CHECK(text.substr(0, 8) == "w w w w ");
  CHECK(text.find('\n') == 19 * 2 + 5);  // after "<eos>", the 20th word
  CHECK(std::count(text.begin(), text.end(), '\n') == 2);  // after words 20 and 40
  CHECK(text.substr(text.size() - 4) == "w w ");  // the last line is not ended, as in generate.py
}

TEST_CASE("generate: a trained model's samples at a low temperature follow the text it learned") {
  TempDir dir;
  // 8 epochs: after 4, one training seed in the nine tried gave a model that wrote only <eos>; after 8 all nine
  // followed the text at every transition.
  const std::string path = train_tiny_model(dir, 8);
  const std::vector<std::string> words =
      train::generate_words({.checkpoint = path, .words = 100, .temperature = 0.05, .seed = 3});
  // In the corpus a word is followed by the next of kWords or by <eos> (the line's end); what follows <eos> depends
  // on the line before, which the recurrent state has to carry.
  int64_t follows = 0, transitions = 0;
  for (size_t i = 0; i + 1 < words.size(); ++i) {
    const auto* at = std::find(std::begin(kWords), std::end(kWords), words[i]);
    if (at == std::end(kWords)) continue;
    ++transitions;
    const std::string next = kWords[(at - std::begin(kWords) + 1) % 10];
    if (words[i + 1] == next || words[i + 1] == "<eos>") ++follows;
  }
  CHECK(transitions > 50);
  CHECK(follows >= transitions * 9 / 10);
}

TEST_CASE("language model checkpoints keep the architecture, the vocabulary in id order and the tensors") {
  TempDir dir;
  data::Vocabulary vocab;
  for (const char* w : {"b", "a", "<eos>", "\"quoted\"", "back\\slash", "caf\xc3\xa9"}) vocab.add(w);
  manual_seed(0);
  models::LanguageModel model(vocab.size(), {.kind = nn::RecurrentKind::RNNReLU, .embedding_size = 6,
                                             .hidden_size = 6, .num_layers = 2, .dropout = 0.35, .tie_weights = true});
  models::save_language_model(model, vocab, dir.file("lm.safetensors"));

  const SafetensorsContents file = load_safetensors(dir.file("lm.safetensors"));
  CHECK(file.metadata.at("halfgrad.format") == "language_model/1");
  CHECK(file.metadata.at("halfgrad.rnn") == "rnn_relu");
  CHECK(file.metadata.at("halfgrad.vocab") == "b\na\n<eos>\n\"quoted\"\nback\\slash\ncaf\xc3\xa9\n");
  CHECK(file.metadata.at("format") == "pt");
  CHECK(file.find("encoder.weight").defined());  // PyTorch's state_dict names, loadable by RNNModel
  CHECK(file.find("rnn.weight_ih_l1").defined());

  const models::LoadedLanguageModel loaded = models::load_language_model(dir.file("lm.safetensors"));
  REQUIRE(loaded.vocab.size() == vocab.size());
  for (int64_t id = 0; id < vocab.size(); ++id) CHECK(loaded.vocab.word(id) == vocab.word(id));
  const models::LanguageModelOptions& o = loaded.model->options;
  CHECK(o.kind == nn::RecurrentKind::RNNReLU);
  CHECK((o.embedding_size == 6 && o.hidden_size == 6 && o.num_layers == 2 && o.tie_weights));
  CHECK(o.dropout == 0.35);
  CHECK(loaded.model->decoder->weight.same(loaded.model->encoder->weight));  // still tied
  const NamedTensors want = model.state_dict(), got = loaded.model->state_dict();
  REQUIRE(want.size() == got.size());
  for (size_t k = 0; k < want.size(); ++k) {
    CHECK(got[k].first == want[k].first);
    CHECK(testing::bit_equal(got[k].second, want[k].second));
  }

  data::Vocabulary short_vocab;
  short_vocab.add("a");
  CHECK(contains(error_of([&] { models::save_language_model(model, short_vocab, dir.file("x.safetensors")); }),
                 "the vocabulary has 1 words, the model 6"));
}

TEST_CASE("generate: files that are not language model checkpoints are errors naming the file and the fault") {
  TempDir dir;
  const std::string good = save_untrained_model(dir);
  REQUIRE(train::generate_words({.checkpoint = good, .words = 5}).size() == 5);
  auto generate_error = [](const std::string& path) {
    return error_of([&] { train::generate_words({.checkpoint = path, .words = 5}); });
  };

  SUBCASE("a file that does not exist") {
    const std::string e = generate_error(dir.file("missing.safetensors"));
    CHECK(contains(e, dir.file("missing.safetensors")));
    CHECK(contains(e, "cannot open"));
  }
  SUBCASE("a checkpoint of another module") {
    nn::Linear linear(3, 2);
    nn::save(linear, dir.file("linear.safetensors"));
    const std::string e = generate_error(dir.file("linear.safetensors"));
    CHECK(contains(e, dir.file("linear.safetensors")));
    CHECK(contains(e, "is not a halfgrad language model checkpoint"));
  }
  SUBCASE("a truncated checkpoint") {
    std::filesystem::copy_file(good, dir.file("cut.safetensors"));
    std::filesystem::resize_file(dir.file("cut.safetensors"), std::filesystem::file_size(good) / 2);
    const std::string e = generate_error(dir.file("cut.safetensors"));
    CHECK(contains(e, dir.file("cut.safetensors")));
    CHECK(contains(e, "truncated"));
  }
  SUBCASE("not a safetensors file at all") {
    std::ofstream(dir.file("text.safetensors")) << "the cat sat on the mat\n";
    CHECK(contains(generate_error(dir.file("text.safetensors")), dir.file("text.safetensors")));
  }

  // The good file's contents, altered one way at a time.
  SafetensorsContents contents = load_safetensors(good);
  const std::string bad = dir.file("bad.safetensors");
  SUBCASE("a tensor missing") {
    NamedTensors tensors;
    for (const auto& [name, t] : contents.tensors)
      if (name != "decoder.bias") tensors.emplace_back(name, t);
    save_safetensors(bad, tensors, contents.metadata);
    const std::string e = generate_error(bad);
    CHECK(contains(e, bad));
    CHECK(contains(e, "decoder.bias"));
  }
  SUBCASE("a tensor of the wrong shape") {
    for (auto& [name, t] : contents.tensors)
      if (name == "encoder.weight") t = zeros({t.size(0) + 1, t.size(1)});
    save_safetensors(bad, contents.tensors, contents.metadata);
    const std::string e = generate_error(bad);
    CHECK(contains(e, bad));
    CHECK(contains(e, "encoder.weight"));
  }
  SUBCASE("a metadata entry missing or malformed") {
    contents.metadata.erase("halfgrad.nhid");
    save_safetensors(bad, contents.tensors, contents.metadata);
    CHECK(contains(generate_error(bad), fmt::format("'{}': metadata \"halfgrad.nhid\" is missing", bad)));
    contents.metadata["halfgrad.nhid"] = "sixteen";
    save_safetensors(bad, contents.tensors, contents.metadata);
    CHECK(contains(generate_error(bad), "metadata \"halfgrad.nhid\" is \"sixteen\", not a number >= 1"));
    contents.metadata["halfgrad.nhid"] = "16";
    contents.metadata["halfgrad.rnn"] = "transformer";
    save_safetensors(bad, contents.tensors, contents.metadata);
    CHECK(contains(generate_error(bad), "\"halfgrad.rnn\" is \"transformer\", not lstm, gru, rnn_tanh or rnn_relu"));
  }
  SUBCASE("a vocabulary that does not match its size") {
    contents.metadata["halfgrad.vocab"] += "extra\n";
    save_safetensors(bad, contents.tensors, contents.metadata);
    const std::string e = generate_error(bad);
    CHECK(contains(e, bad));
    CHECK(contains(e, "has 12 words, \"halfgrad.vocab_size\" says 11"));
  }
  SUBCASE("a layer count the tensors do not bear out: refused before a model of that many layers is built") {
    Tensor hh;
    for (const auto& [name, t] : contents.tensors)
      if (name == "rnn.weight_hh_l0") hh = t;
    NamedTensors gap = contents.tensors;  // layers 0 and 999999999 only
    gap.emplace_back("rnn.weight_hh_l999999999", hh);
    contents.metadata["halfgrad.nlayers"] = "1000000000";
    save_safetensors(bad, gap, contents.metadata);
    CHECK(contains(generate_error(bad), fmt::format("'{}': metadata \"halfgrad.nlayers\" says 1000000000 layers, more "
                                                    "than the file's", bad)));
    gap.emplace_back("rnn.weight_hh_l2", hh);  // layers 0 and 2 of 3
    contents.metadata["halfgrad.nlayers"] = "3";
    save_safetensors(bad, gap, contents.metadata);
    CHECK(contains(generate_error(bad), "holds no tensor \"rnn.weight_hh_l1\" (metadata \"halfgrad.nlayers\" says 3)"));
    contents.metadata["halfgrad.nlayers"] = "1";
    contents.tensors.emplace_back("rnn.weight_hh_l1", hh);
    save_safetensors(bad, contents.tensors, contents.metadata);
    CHECK(contains(generate_error(bad), "holds \"rnn.weight_hh_l1\", a layer past the 1 that metadata "
                                        "\"halfgrad.nlayers\" says"));
  }
  SUBCASE("tied in the metadata, where the file's encoder and decoder differ") {
    contents.metadata["halfgrad.tied"] = "true";
    save_safetensors(bad, contents.tensors, contents.metadata);
    const std::string e = generate_error(bad);
    CHECK(contains(e, bad));
    CHECK(contains(e, "are one tensor in the model (tied), but the state gives them different values"));
  }
  SUBCASE("a training checkpoint") {
    nn::save_training_checkpoint(bad, {.model = contents.tensors});
    CHECK(contains(generate_error(bad), fmt::format("'{}' has format \"training_checkpoint/1\"", bad)));
  }
}

TEST_CASE("generate: the temperature and the number of words are checked before the file is read") {
  CHECK(contains(error_of([] { train::generate_words({.checkpoint = "x", .temperature = 1e-4}); }),
                 "generate: temperature must be >= 1e-3, got 0.0001"));
  CHECK(contains(error_of([] { train::generate_words({.checkpoint = "x", .words = -1}); }),
                 "generate: words must be >= 0, got -1"));
}
