#pragma once
// Word-level language-model data in the format of pytorch/examples' word_language_model (WikiText-2): tokens are
// separated by whitespace and every line ends with an "<eos>" token (data.py: line.split() + ['<eos>']), so the
// same files give the same ids, vocabulary and batches as that example. As Python's text files and str.split():
// lines end at \n, \r\n or a lone \r; whitespace is ASCII's (space, \t, \v, \f, \r and the separators \x1c-\x1f).
// Python's str.split() also splits at Unicode spaces (U+0085, U+00A0, U+3000, ...), which WikiText-2 does not contain
// (its counts below match data.py's), but another corpus might.
//
//   data::Corpus corpus = data::load_corpus(data::default_data_directory() / "wikitext-2");
//   Tensor train = data::batchify(corpus.train, 20);            // [rows, 20]
//   for (int64_t i = 0; i + 1 < train.size(0); i += 35) {
//     data::TextBatch b = data::bptt_batch(train, i, 35);      // input [<=35, 20], target [<=35 * 20]
//     ...
//   }
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"

namespace halfgrad::data {

// Words and their ids, ids given in first-seen order.
class Vocabulary {
 public:
  int64_t add(std::string_view word);         // the word's id, new or existing
  int64_t id(std::string_view word) const;    // an error naming the word when it is not in the vocabulary
  bool contains(std::string_view word) const;
  const std::string& word(int64_t id) const;  // an error when id is out of range
  int64_t size() const { return int64_t(words_.size()); }

 private:
  // Looked up by string_view (C++20 heterogeneous lookup): no std::string is built for a word already known.
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, int64_t, Hash, std::equal_to<>> ids_;
  std::vector<std::string> words_;
};

// The int64 ids of a text file's tokens, adding new words to `vocab`; an error naming the file if it cannot be read, and
// then `vocab` is as it was.
Tensor tokenize(const std::filesystem::path& file, Vocabulary& vocab);

struct Corpus {
  Vocabulary vocab;
  Tensor train, valid, test;  // int64 [tokens]
};

// train.txt, valid.txt and test.txt of `directory` (kCorpusFiles), tokenized in that order into one vocabulary
// (WikiText-2: 2,088,628 / 217,646 / 245,569 tokens, 33,278 words).
inline const std::vector<std::string> kCorpusFiles = {"train.txt", "valid.txt", "test.txt"};
Corpus load_corpus(const std::filesystem::path& directory);
// `directory`, or where it is empty the WikiText-2 halfgrad ships (default_data_directory() / "wikitext-2"): the
// corpus a language-model run reads.
std::filesystem::path corpus_directory(const std::filesystem::path& directory);

// Where the data halfgrad ships lives: $HALFGRAD_DATA_DIR when set; else, for an installed libhalfgrad,
// <prefix>/share/halfgrad/data beside it; else the build tree's data folder (CMake extracts WikiText-2 there, as
// wikitext-2/).
std::filesystem::path default_data_directory();

// ids [T] as batch_size columns, [T / batch_size, batch_size]: column j is the j-th contiguous piece of the text; the
// last T % batch_size tokens are dropped (pytorch/examples' batchify).
Tensor batchify(const Tensor& ids, int64_t batch_size);

struct TextBatch {
  Tensor input;   // int64 [len, batch]
  Tensor target;  // int64 [len * batch]: the token after each input token, rows flattened
};

// The window of truncated backpropagation through time at row i of a batchified source: input = rows [i, i + len),
// target = rows [i + 1, i + 1 + len), len = min(bptt, rows - 1 - i) (pytorch/examples' get_batch). Needs
// 0 <= i < rows - 1.
TextBatch bptt_batch(const Tensor& source, int64_t i, int64_t bptt);

}  // namespace halfgrad::data
