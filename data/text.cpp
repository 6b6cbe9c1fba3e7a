// Word-level corpora (data/text.h).
#include "data/text.h"
#include "data/files.h"

#include <dlfcn.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
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

namespace {

// Where the first sequence that is not well-formed UTF-8 starts (what Python's strict "utf8" codec rejects, at the
// position it reports: stray continuation bytes, truncated sequences, overlong forms, surrogates, code points past
// U+10FFFF), or npos.
size_t first_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto byte = [&](size_t k) { return uint8_t(s[k]); };
    const uint8_t lead = byte(i);
    if (lead < 0x80) {
      ++i;
      continue;
    }
    // The sequence's length and the range its second byte must fall in (Unicode's table 3-7).
    size_t length;
    uint8_t low = 0x80, high = 0xbf;
    if (lead >= 0xc2 && lead <= 0xdf) {
      length = 2;
    } else if (lead >= 0xe0 && lead <= 0xef) {
      length = 3;
      if (lead == 0xe0) low = 0xa0;   // overlong below U+0800
      if (lead == 0xed) high = 0x9f;  // U+D800..U+DFFF, the surrogates
    } else if (lead >= 0xf0 && lead <= 0xf4) {
      length = 4;
      if (lead == 0xf0) low = 0x90;   // overlong below U+10000
      if (lead == 0xf4) high = 0x8f;  // past U+10FFFF
    } else {
      return i;  // a continuation byte, 0xc0/0xc1 (overlong), or 0xf5 and above
    }
    for (size_t k = 1; k < length; ++k) {
      if (i + k >= s.size()) return i;
      const uint8_t b = byte(i + k);
      if (k == 1 ? (b < low || b > high) : (b < 0x80 || b > 0xbf)) return i;
    }
    i += length;
  }
  return std::string_view::npos;
}

// What str.split() splits at, ASCII's part (text.h). \r: only a \r\n's reaches the split, which Python has made \n.
constexpr std::string_view kWhitespace = " \t\r\v\f\x1c\x1d\x1e\x1f";

}  // namespace

Tensor tokenize(const std::filesystem::path& file, Vocabulary& vocab) {
  regular_file_at(file, "tokenize");  // refuses a folder or a FIFO; where nothing is, the open below says so
  std::ifstream in(file, std::ios::binary);
  HG_CHECK(in.good(), "tokenize: cannot open {}: {}", file.string(), std::strerror(errno));
  // New words go into a copy, the caller's vocabulary taking it only when the whole file has been read: a file that
  // fails half-way (bad UTF-8 on line 3) adds none, so a retry with the mended file gives the same ids.
  Vocabulary grown = vocab;
  std::vector<int64_t> ids;
  std::string line;
  int64_t lines_before = 0, line_start = 0;  // of what getline read, for the UTF-8 error
  while (std::getline(in, line)) {
    // data.py opens the file as UTF-8 text, and Python stops at the first byte that is not: so do we. (Its line
    // counts the lone \r line ends before it: a \r before the bad byte is never the last one of a \r\n.)
    const size_t bad = first_invalid_utf8(line);
    HG_CHECK(bad == std::string_view::npos, "tokenize: {} is not valid UTF-8: byte 0x{:02x} at offset {} (line {})",
             file.string(), unsigned(uint8_t(line[bad])), line_start + int64_t(bad),
             lines_before + 1 + std::count(line.begin(), line.begin() + std::ptrdiff_t(bad), '\r'));
    line_start += int64_t(line.size()) + 1;
    // Python's universal newlines: a \r ends a line too, but the one before \n (or at the end of the file) is the
    // \r\n that getline has already ended.
    std::string_view rest(line);
    do {
      const size_t cr = rest.find('\r');
      const bool ends_here = cr == std::string_view::npos || cr + 1 == rest.size();
      const std::string_view text = ends_here ? rest : rest.substr(0, cr);
      rest = ends_here ? std::string_view() : rest.substr(cr + 1);
      ++lines_before;
      // str.split(): runs of whitespace separate tokens, leading and trailing whitespace ignored.
      for (size_t at = 0;;) {
        at = text.find_first_not_of(kWhitespace, at);
        if (at == std::string_view::npos) break;
        const size_t end = std::min(text.find_first_of(kWhitespace, at), text.size());
        ids.push_back(grown.add(text.substr(at, end - at)));
        at = end;
      }
      ids.push_back(grown.add("<eos>"));  // after the line's words: the id order of data.py's Dictionary
    } while (!rest.empty());
  }
  HG_CHECK(in.eof(), "tokenize: reading {} failed after {} tokens", file.string(), ids.size());
  vocab = std::move(grown);
  return tensor(ids);
}

Corpus load_corpus(const std::filesystem::path& directory) {
  Corpus c;
  std::error_code error;
  HG_CHECK(!std::filesystem::exists(directory, error) || std::filesystem::is_directory(directory, error),
           "load_corpus: {} is not a folder (it should hold {}, {} and {})", directory.string(), kCorpusFiles[0],
           kCorpusFiles[1], kCorpusFiles[2]);
  for (const std::string& name : kCorpusFiles) {
    const std::filesystem::path file = directory / name;
    HG_CHECK(regular_file_at(file, "load_corpus"), "load_corpus: {} not found", file.string());
  }
  c.train = tokenize(directory / kCorpusFiles[0], c.vocab);
  c.valid = tokenize(directory / kCorpusFiles[1], c.vocab);
  c.test = tokenize(directory / kCorpusFiles[2], c.vocab);
  return c;
}

std::filesystem::path corpus_directory(const std::filesystem::path& directory) {
  return directory.empty() ? default_data_directory() / "wikitext-2" : directory;
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
  HG_CHECK(ids.size(0) > 0, "batchify: there are no token ids to batch");
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
  HG_CHECK(rows >= 2, "bptt_batch: the source has {} row{}; a window needs at least 2 (its inputs and their next "
           "tokens)", rows, rows == 1 ? "" : "s");
  HG_CHECK(i >= 0 && i < rows - 1, "bptt_batch: row {} has no next row to predict (rows 0..{} do)", i, rows - 2);
  const int64_t len = std::min(bptt, rows - 1 - i);
  return {source.narrow(0, i, len), source.narrow(0, i + 1, len).reshape({-1})};
}

}  // namespace halfgrad::data
