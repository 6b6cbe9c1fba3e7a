// libFuzzer target: CIFAR-10 and CIFAR-100 binary files (data/cifar.h), as training and test splits.
#include "data/cifar.h"
#include "tests/fuzz/fuzz_input.h"

using namespace halfgrad;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (const char* name : {"data_batch_1.bin", "test_batch.bin", "train.bin", "test.bin"})
    fuzz::write_input(name, data, size);
  const std::filesystem::path& dir = fuzz::work_dir();
  for (data::Split split : {data::Split::Train, data::Split::Test}) {
    fuzz::expect_error_or_success([&] { data::load_cifar10(dir, split); });
    for (data::Cifar100Labels labels : {data::Cifar100Labels::Fine, data::Cifar100Labels::Coarse})
      fuzz::expect_error_or_success([&] { data::load_cifar100(dir, split, labels); });
  }
  return 0;
}
