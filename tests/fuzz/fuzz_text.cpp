// libFuzzer target: word-level corpus files (data/text.h): tokenize, then batchify and the bptt windows over them.
#include "data/text.h"
#include "tests/fuzz/fuzz_input.h"

using namespace halfgrad;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input("train.txt", data, size);
  fuzz::expect_error_or_success([&] {
    data::Vocabulary vocab;
    const Tensor ids = data::tokenize(path, vocab);
    for (int64_t id : to_vector<int64_t>(ids)) (void)vocab.word(id);  // every id names a word
    const Tensor source = data::batchify(ids, 2);
    for (int64_t row = 0; row + 1 < source.size(0); row += 3) data::bptt_batch(source, row, 3);
  });
  return 0;
}
