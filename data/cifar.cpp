// CIFAR binary readers (data/cifar.h).
#include "data/cifar.h"
#include "data/files.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <system_error>

#include <fmt/ranges.h>

#include "core/error.h"
#include "core/log.h"

namespace halfgrad::data {

namespace {

constexpr int64_t kPixels = 3 * 32 * 32;

struct Format {
  const char* name;     // for errors
  int64_t label_bytes;  // before the pixels
  int64_t label_byte;   // which of them is the label
  int64_t classes;      // labels are 0 .. classes - 1
  std::vector<std::string> names;
  std::vector<int64_t> label_limits;  // per label byte: each is checked, the one not used too (CIFAR-100's)
};


// The records of a CIFAR file, from its size alone: nothing is read or allocated before the size is known to be a
// whole number of records (a 64 GB sparse file, or any file cut short, is an error at once).
int64_t records_in(const std::filesystem::path& path, const Format& f) {
  regular_file_at(path, f.name);  // refuses a folder or a FIFO; where nothing is, file_size says so
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  HG_CHECK(!ec, "{}: cannot open {}: {}", f.name, path.string(), ec.message());
  const auto record = std::uintmax_t(f.label_bytes + kPixels);
  HG_CHECK(size > 0, "{}: {} is empty (0 bytes: no images)", f.name, path.string());
  HG_CHECK(size % record == 0,
           "{}: {} has {} bytes, not a whole number of {}-byte records: the record at offset {} is cut short "
           "(truncated or not a {} binary file)",
           f.name, path.string(), size, record, size / record * record, f.name);
  return int64_t(size / record);
}

ImageDataset read_records(const std::vector<std::filesystem::path>& files, const Format& f) {
  HG_CHECK(!files.empty(), "{}: no files given", f.name);
  const int64_t record = f.label_bytes + kPixels;
  std::vector<int64_t> records;
  int64_t count = 0;
  for (const auto& path : files) count += records.emplace_back(records_in(path, f));
  ImageDataset d;
  d.images = empty({count, 3, 32, 32}, {.dtype = kUInt8});
  d.labels = empty({count}, {.dtype = kInt64});
  d.classes = f.names;
  auto* pixels = d.images.data<uint8_t>();
  auto* labels = d.labels.data<int64_t>();
  // Read a few thousand records at a time, straight on into the tensors: no second copy of the dataset.
  constexpr int64_t kChunkRecords = 4096;
  std::vector<char> chunk;
  int64_t n = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    std::ifstream in(files[i], std::ios::binary);
    HG_CHECK(in.good(), "{}: cannot open {}: {}", f.name, files[i].string(), std::strerror(errno));
    for (int64_t first = 0; first < records[i]; first += kChunkRecords) {
      const int64_t m = std::min(kChunkRecords, records[i] - first);
      chunk.resize(size_t(m * record));
      in.read(chunk.data(), std::streamsize(m * record));
      HG_CHECK(in.gcount() == m * record, "{}: {} ended at offset {}, before the {} bytes it had when its size was "
               "read (changed while being read?)", f.name, files[i].string(), first * record + int64_t(in.gcount()),
               records[i] * record);
      for (int64_t j = 0; j < m; ++j, ++n) {
        const char* at = chunk.data() + j * record;
        const int64_t r = first + j;
        for (int64_t b = 0; b < f.label_bytes; ++b) {
          const int64_t value = static_cast<uint8_t>(at[b]);
          HG_CHECK(value < f.label_limits[size_t(b)], "{}: {} offset {}: label {} is not in 0..{}", f.name,
                   files[i].string(), r * record + b, value, f.label_limits[size_t(b)] - 1);
        }
        labels[n] = static_cast<uint8_t>(at[f.label_byte]);
        std::memcpy(pixels + n * kPixels, at + f.label_bytes, kPixels);
      }
    }
  }
  return d;
}

Format cifar100_format(Cifar100Labels labels) {
  return labels == Cifar100Labels::Fine ? Format{"cifar100", 2, 1, 100, cifar100_fine_classes(), {20, 100}}
                                        : Format{"cifar100", 2, 0, 20, cifar100_coarse_classes(), {20, 100}};
}

std::vector<std::filesystem::path> existing(const std::filesystem::path& dir, const std::vector<std::string>& names,
                                            const char* what) {
  std::vector<std::filesystem::path> files;
  for (const auto& name : names) {
    files.push_back(dir / name);
    HG_CHECK(regular_file_at(files.back(), what), "{}: {} not found (expected the official binary files in {})",
             what, files.back().string(), dir.string());
  }
  return files;
}

}  // namespace

ImageDataset read_cifar10(const std::vector<std::filesystem::path>& files) {
  return read_records(files, Format{"cifar10", 1, 0, 10, cifar10_classes(), {10}});
}

ImageDataset read_cifar100(const std::vector<std::filesystem::path>& files, Cifar100Labels labels) {
  return read_records(files, cifar100_format(labels));
}

std::vector<std::string> cifar10_file_names(Split split) {
  if (split == Split::Test) return {"test_batch.bin"};
  return {"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "data_batch_4.bin", "data_batch_5.bin"};
}

std::vector<std::string> cifar100_file_names(Split split) { return {split == Split::Train ? "train.bin" : "test.bin"}; }

ImageDataset load_cifar10(const std::filesystem::path& directory, Split split) {
  if (split == Split::Test) return read_cifar10(existing(directory, cifar10_file_names(split), "cifar10"));
  std::vector<std::filesystem::path> present;
  std::vector<std::string> missing;
  for (const std::string& name : cifar10_file_names(split)) {
    if (regular_file_at(directory / name, "cifar10")) {
      present.push_back(directory / name);
    } else {
      missing.push_back(name);
    }
  }
  HG_CHECK(!present.empty(), "cifar10: no training batch in {} (expected the official binary files data_batch_1.bin "
           ".. data_batch_5.bin)", directory.string());
  if (!missing.empty()) {
    logger().warn("cifar10: training on {} of the 5 batches in {}; {} not found", present.size(), directory.string(),
                  fmt::join(missing, ", "));
  }
  return read_cifar10(present);
}

ImageDataset load_cifar100(const std::filesystem::path& directory, Split split, Cifar100Labels labels) {
  return read_cifar100(existing(directory, cifar100_file_names(split), "cifar100"), labels);
}

const std::vector<std::string>& cifar10_classes() {
  static const std::vector<std::string> names = {"airplane", "automobile", "bird",  "cat",  "deer",
                                                 "dog",      "frog",       "horse", "ship", "truck"};
  return names;
}

const std::vector<std::string>& cifar100_fine_classes() {
  static const std::vector<std::string> names = {
      "apple",      "aquarium_fish", "baby",         "bear",       "beaver",      "bed",         "bee",
      "beetle",     "bicycle",       "bottle",       "bowl",       "boy",         "bridge",      "bus",
      "butterfly",  "camel",         "can",          "castle",     "caterpillar", "cattle",      "chair",
      "chimpanzee", "clock",         "cloud",        "cockroach",  "couch",       "crab",        "crocodile",
      "cup",        "dinosaur",      "dolphin",      "elephant",   "flatfish",    "forest",      "fox",
      "girl",       "hamster",       "house",        "kangaroo",   "keyboard",    "lamp",        "lawn_mower",
      "leopard",    "lion",          "lizard",       "lobster",    "man",         "maple_tree",  "motorcycle",
      "mountain",   "mouse",         "mushroom",     "oak_tree",   "orange",      "orchid",      "otter",
      "palm_tree",  "pear",          "pickup_truck", "pine_tree",  "plain",       "plate",       "poppy",
      "porcupine",  "possum",        "rabbit",       "raccoon",    "ray",         "road",        "rocket",
      "rose",       "sea",           "seal",         "shark",      "shrew",       "skunk",       "skyscraper",
      "snail",      "snake",         "spider",       "squirrel",   "streetcar",   "sunflower",   "sweet_pepper",
      "table",      "tank",          "telephone",    "television", "tiger",       "tractor",     "train",
      "trout",      "tulip",         "turtle",       "wardrobe",   "whale",       "willow_tree", "wolf",
      "woman",      "worm",
  };
  return names;
}

const std::vector<std::string>& cifar100_coarse_classes() {
  static const std::vector<std::string> names = {
      "aquatic_mammals",
      "fish",
      "flowers",
      "food_containers",
      "fruit_and_vegetables",
      "household_electrical_devices",
      "household_furniture",
      "insects",
      "large_carnivores",
      "large_man-made_outdoor_things",
      "large_natural_outdoor_scenes",
      "large_omnivores_and_herbivores",
      "medium_mammals",
      "non-insect_invertebrates",
      "people",
      "reptiles",
      "small_mammals",
      "trees",
      "vehicles_1",
      "vehicles_2",
  };
  return names;
}

int64_t cifar100_coarse_of(int64_t fine_label) {
  static const int64_t coarse[100] = {4,  1,  14, 8,  0,  6,  7,  7,  18, 3,  3,  14, 9,  18, 7,  11, 3,  9,  7,  11,
                                      6,  11, 5,  10, 7,  6,  13, 15, 3,  15, 0,  11, 1,  10, 12, 14, 16, 9,  11, 5,
                                      5,  19, 8,  8,  15, 13, 14, 17, 18, 10, 16, 4,  17, 4,  2,  0,  17, 4,  18, 17,
                                      10, 3,  2,  12, 12, 16, 12, 1,  9,  19, 2,  10, 0,  1,  16, 12, 9,  13, 15, 13,
                                      16, 19, 2,  4,  6,  19, 5,  5,  8,  19, 18, 1,  2,  15, 6,  0,  17, 8,  14, 13};
  HG_CHECK(fine_label >= 0 && fine_label < 100, "cifar100_coarse_of: fine label {} is not in 0..99", fine_label);
  return coarse[fine_label];
}

bool regular_file_at(const std::filesystem::path& path, const char* what) {
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  // Only a missing file (or folder on the way) is nothing there: a status that cannot be read (a loop of links, a
  // folder it may not search) is an error, where a reader taking it for missing would leave a batch out.
  HG_CHECK(status.type() != std::filesystem::file_type::none, "{}: cannot read {}: {}", what, path.string(),
           ec.message());
  HG_CHECK(!std::filesystem::exists(status) || std::filesystem::is_regular_file(status),
           "{}: {} is not a regular file (a folder, a FIFO or a device?)", what, path.string());
  return std::filesystem::is_regular_file(status);
}

}  // namespace halfgrad::data
