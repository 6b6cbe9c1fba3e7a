#pragma once
// CIFAR-10 and CIFAR-100 in their official binary format, read into memory.
//
//   CIFAR-10 record:   1 label byte (0-9), then 3072 pixel bytes       (data_batch_1..5.bin, test_batch.bin)
//   CIFAR-100 record:  1 coarse label byte (0-19), 1 fine label byte (0-99), then 3072 pixel bytes
//                      (train.bin, test.bin)
//   pixels:            1024 red, 1024 green, 1024 blue, each a 32x32 image in row-major order
//
// An ImageDataset keeps the pixels as stored, uint8 [N, 3, 32, 32] (channels first), and the labels as int64 [N];
// data/loader.h turns them into normalised, augmented float batches. A file whose size is not a whole number of
// records, or a label out of range, is an error naming the file and the byte offset; nothing is returned then.
#include <filesystem>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace halfgrad::data {

struct ImageDataset {
  Tensor images;                     // uint8 [N, C, H, W]
  Tensor labels;                     // int64 [N]
  std::vector<std::string> classes;  // name of label i
  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
};

enum class Split { Train, Test };
enum class Cifar100Labels { Fine, Coarse };

// The records of every file, in order (e.g. the five training batches).
ImageDataset read_cifar10(const std::vector<std::filesystem::path>& files);
ImageDataset read_cifar100(const std::vector<std::filesystem::path>& files, Cifar100Labels labels = Cifar100Labels::Fine);

// The official file names in `directory` (the extracted cifar-10-batches-bin / cifar-100-binary folder): CIFAR-10
// train = those of data_batch_1.bin .. data_batch_5.bin that exist (a warning names the missing ones; none is an
// error), test = test_batch.bin; CIFAR-100 train.bin / test.bin. Another missing file is an error that names it.
ImageDataset load_cifar10(const std::filesystem::path& directory, Split split);
ImageDataset load_cifar100(const std::filesystem::path& directory, Split split,
                           Cifar100Labels labels = Cifar100Labels::Fine);
// The file names those read for a split (CIFAR-10's training split: all five batches it may read), for code that
// must know a run's input files (the command line refuses to write over them).
std::vector<std::string> cifar10_file_names(Split split);
std::vector<std::string> cifar100_file_names(Split split);

// Class names in label order, and CIFAR-100's fine -> coarse label map (the official meta data).
const std::vector<std::string>& cifar10_classes();
const std::vector<std::string>& cifar100_fine_classes();
const std::vector<std::string>& cifar100_coarse_classes();
int64_t cifar100_coarse_of(int64_t fine_label);

// Per-channel mean and standard deviation of the CIFAR-10 / CIFAR-100 training images scaled to [0, 1]: the usual
// normalisation constants (as in the papers' and torchvision's recipes).
constexpr float kCifar10Mean[3] = {0.4914f, 0.4822f, 0.4465f};
constexpr float kCifar10Std[3] = {0.2470f, 0.2435f, 0.2616f};
constexpr float kCifar100Mean[3] = {0.5071f, 0.4865f, 0.4409f};
constexpr float kCifar100Std[3] = {0.2673f, 0.2564f, 0.2762f};

}  // namespace halfgrad::data
