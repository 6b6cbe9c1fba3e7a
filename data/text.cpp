// Word-level corpora (data/text.h).
#include "data/text.h"

#include <dlfcn.h>

#include <cstdlib>
#include <fstream>

#include "core/error.h"
#include "ops/shape.h"

namespace halfgrad::data {

int64_t Vocabulary::add(std::string_view word) {
  auto it = ids_.find(word);
  if (it != ids_.end()) return it->second;
  const int64_t id = size();
  words_.emplace_back(word);
  ids_.emplace(words_.back(), id);
  return id;
}

int64_t Vocabulary::id(std::string_view word) const {
  auto it = ids_.find(word);
  HG_CHECK(it != ids_.end(), "Vocabulary: \"{}\" is not among its {} words", word, size());
  return it->second;
}

bool Vocabulary::contains(std::string_view word) const { return ids_.find(word) != ids_.end(); }

const std::string& Vocabulary::word(int64_t id) const {
  HG_CHECK(id >= 0 && id < size(), "Vocabulary: id {} is out of range for {} words", id, size());
  return words_[size_t(id)];
}

Tensor tokenize(const std::filesystem::path& file, Vocabulary& vocab) {
  std::ifstream in(file, std::ios::binary);
  HG_CHECK(in.good(), "tokenize: cannot open {}", file.string());
  std::vector<int64_t> ids;
  std::string line;
  while (std::getline(in, line)) {
    // str.split(): runs of whitespace separate tokens, leading and trailing whitespace ignored.
    size_t at = 0;
    for (;;) {
      at = line.find_first_not_of(" \t\r\v\f", at);
      if (at == std::string::npos) break;
      const size_t end = std::min(line.find_first_of(" \t\r\v\f", at), line.size());
      ids.push_back(vocab.add(std::string_view(line).substr(at, end - at)));
      at = end;
    }
    ids.push_back(vocab.add("<eos>"));  // after the line's words: the id order of data.py's Dictionary
  }
  HG_CHECK(in.eof(), "tokenize: reading {} failed after {} tokens", file.string(), ids.size());
  return tensor(ids);
}

Corpus load_corpus(const std::filesystem::path& directory) {
  Corpus c;
  for (const char* name : {"train.txt", "valid.txt", "test.txt"}) {
    HG_CHECK(std::filesystem::is_regular_file(directory / name), "load_corpus: {} not found", (directory / name).string());
  }
  c.train = tokenize(directory / "train.txt", c.vocab);
  c.valid = tokenize(directory / "valid.txt", c.vocab);
  c.test = tokenize(directory / "test.txt", c.vocab);
  return c;
}

std::filesystem::path default_data_directory() {
  if (const char* dir = std::getenv("HALFGRAD_DATA_DIR"); dir != nullptr && *dir != '\0') return dir;
  // An installed libhalfgrad finds the data beside itself (<prefix>/lib -> <prefix>/share/halfgrad/data).
  Dl_info self{};
  if (dladdr(reinterpret_cast<const void*>(&default_data_directory), &self) != 0 && self.dli_fname != nullptr) {
    std::error_code error;
    const std::filesystem::path library = std::filesystem::canonical(self.dli_fname, error);
    if (!error) {
      const std::filesystem::path installed = library.parent_path() / HALFGRAD_INSTALLED_DATA_DIR;
      if (std::filesystem::is_directory(installed, error)) return installed.lexically_normal();
    }
  }
  return HALFGRAD_DATA_DIR;  // the build tree, where CMake extracted it
}

Tensor batchify(const Tensor& ids, int64_t batch_size) {
  HG_CHECK(ids.defined() && ids.dim() == 1 && ids.dtype() == kInt64,
           "batchify: expected int64 token ids [T], got {}", ids.defined() ? ids.meta() : "an undefined tensor");
  HG_CHECK(batch_size >= 1 && ids.size(0) >= batch_size,
           "batchify: batch_size must be in 1..{} (the number of tokens), got {}", ids.size(0), batch_size);
  const int64_t rows = ids.size(0) / batch_size;
  return ids.narrow(0, 0, rows * batch_size).view({batch_size, rows}).t().contiguous();
}

TextBatch bptt_batch(const Tensor& source, int64_t i, int64_t bptt) {
  HG_CHECK(source.defined() && source.dim() == 2, "bptt_batch: expected a batchified source [rows, batch], got {}",
           source.defined() ? source.meta() : "an undefined tensor");
  HG_CHECK(bptt >= 1, "bptt_batch: bptt must be >= 1, got {}", bptt);
  const int64_t rows = source.size(0);
  HG_CHECK(i >= 0 && i + 1 < rows, "bptt_batch: row {} has no next row to predict (rows 0..{} do)", i, rows - 2);
  const int64_t len = std::min(bptt, rows - 1 - i);
  return {source.narrow(0, i, len), source.narrow(0, i + 1, len).reshape({-1})};
}

}  // namespace halfgrad::data
