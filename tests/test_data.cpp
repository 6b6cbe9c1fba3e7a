// data/: the CIFAR binary readers on files the tests write in the official format, and the image loader (epoch order,
// batches, transforms, workers) against direct computations.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <limits>
#include <set>

#include "data/cifar.h"
#include "data/loader.h"
#include "data/text.h"
#include "halfgrad.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::bit_equal;
using halfgrad::testing::contains;
using halfgrad::testing::error_of;
using halfgrad::testing::error_of_without_waiting;
using halfgrad::testing::make_fifo;
using halfgrad::testing::TempDir;

namespace {

constexpr int64_t kPixels = 3072;

// The pixel value of (image i, byte b) in the files the tests write: distinct across nearby images and bytes.
uint8_t pixel(int64_t i, int64_t b) { return uint8_t((i * 7 + b * 13 + b / 1024) % 251); }

// Writes `labels.size()` records in the official layout: the label bytes, then 3072 pixels.
void write_records(const std::string& path, int64_t first_image, const std::vector<std::vector<uint8_t>>& labels) {
  std::ofstream out(path, std::ios::binary);
  for (size_t r = 0; r < labels.size(); ++r) {
    for (uint8_t l : labels[r]) out.put(char(l));
    for (int64_t b = 0; b < kPixels; ++b) out.put(char(pixel(first_image + int64_t(r), b)));
  }
}

std::vector<std::vector<uint8_t>> cifar10_labels(int64_t n, int64_t first) {
  std::vector<std::vector<uint8_t>> labels;
  for (int64_t i = 0; i < n; ++i) labels.push_back({uint8_t((first + i) % 10)});
  return labels;
}

// A dataset of n images whose pixel (i, b) is pixel(i, b), labels i % 10.
data::ImageDataset synthetic(int64_t n) {
  data::ImageDataset d;
  d.images = empty({n, 3, 32, 32}, {.dtype = kUInt8});
  d.labels = empty({n}, {.dtype = kInt64});
  for (int64_t i = 0; i < n; ++i) {
    d.labels.data<int64_t>()[i] = i % 10;
    for (int64_t b = 0; b < kPixels; ++b) d.images.data<uint8_t>()[i * kPixels + b] = pixel(i, b);
  }
  return d;
}

std::vector<int64_t> plain_order(int64_t n) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[size_t(i)] = i;
  return order;
}

}  // namespace

TEST_CASE("read_cifar10 reads every record of every file in order: labels and channel-first pixels") {
  TempDir dir;
  write_records(dir.file("a.bin"), 0, cifar10_labels(5, 0));
  write_records(dir.file("b.bin"), 5, cifar10_labels(3, 5));
  data::ImageDataset d = data::read_cifar10({dir.file("a.bin"), dir.file("b.bin")});
  REQUIRE(d.size() == 8);
  CHECK(d.images.shape() == Shape{8, 3, 32, 32});
  CHECK(d.images.dtype() == kUInt8);
  CHECK(d.labels.dtype() == kInt64);
  CHECK(d.classes == data::cifar10_classes());
  CHECK(d.classes[3] == "cat");
  for (int64_t i = 0; i < 8; ++i) {
    CHECK(to_vector<int64_t>(d.labels)[size_t(i)] == i % 10);
    // byte b of a record is channel b / 1024, row (b % 1024) / 32, column b % 32
    for (int64_t b : {int64_t(0), int64_t(31), int64_t(32), int64_t(1023), int64_t(1024), int64_t(2048 + 5 * 32 + 7)}) {
      const int64_t c = b / 1024, y = (b % 1024) / 32, x = b % 32;
      CHECK(int(d.images[i][c][y][x].item<uint8_t>()) == int(pixel(i, b)));
    }
  }
}

TEST_CASE("read_cifar100 takes the fine or the coarse label byte, the class tables match the official meta data") {
  TempDir dir;
  write_records(dir.file("train.bin"), 0, {{11, 19}, {10, 49}, {4, 0}});
  data::ImageDataset fine = data::read_cifar100({dir.file("train.bin")});
  data::ImageDataset coarse = data::read_cifar100({dir.file("train.bin")}, data::Cifar100Labels::Coarse);
  CHECK(to_vector<int64_t>(fine.labels) == std::vector<int64_t>{19, 49, 0});
  CHECK(to_vector<int64_t>(coarse.labels) == std::vector<int64_t>{11, 10, 4});
  CHECK(fine.classes[19] == "cattle");
  CHECK(fine.classes[49] == "mountain");
  CHECK(coarse.classes[10] == "large_natural_outdoor_scenes");
  CHECK(data::cifar100_fine_classes().size() == 100);
  CHECK(data::cifar100_coarse_classes().size() == 20);
  // The superclass of each fine class, as the official table pairs them (and the files here agree).
  CHECK(data::cifar100_coarse_of(19) == 11);
  CHECK(data::cifar100_coarse_of(49) == 10);
  CHECK(data::cifar100_coarse_of(0) == 4);
  std::vector<int> per_coarse(20, 0);
  for (int64_t f = 0; f < 100; ++f) per_coarse[size_t(data::cifar100_coarse_of(f))]++;
  CHECK(std::all_of(per_coarse.begin(), per_coarse.end(), [](int n) { return n == 5; }));
  CHECK(int(fine.images[1][2][31][31].item<uint8_t>()) == int(pixel(1, kPixels - 1)));
  CHECK(contains(error_of([] { data::cifar100_coarse_of(100); }), "fine label 100 is not in 0..99"));
}

TEST_CASE("CIFAR files that are cut short, hold a bad label or are missing are errors naming the file and offset") {
  TempDir dir;
  write_records(dir.file("short.bin"), 0, cifar10_labels(2, 0));
  std::filesystem::resize_file(dir.file("short.bin"), 3073 + 100);
  std::string e = error_of([&] { data::read_cifar10({dir.file("short.bin")}); });
  CHECK(contains(e, "cifar10"));
  CHECK(contains(e, "short.bin"));
  CHECK(contains(e, "has 3173 bytes, not a whole number of 3073-byte records"));
  CHECK(contains(e, "offset 3073"));

  write_records(dir.file("label.bin"), 0, {{3}, {12}});
  e = error_of([&] { data::read_cifar10({dir.file("label.bin")}); });
  CHECK(contains(e, "label.bin offset 3073: label 12 is not in 0..9"));
  // The same file is fine as CIFAR-100 coarse labels? No: its records are 3073 bytes, not 3074.
  CHECK(contains(error_of([&] { data::read_cifar100({dir.file("label.bin")}); }), "3074-byte records"));

  e = error_of([&] { data::load_cifar10(dir.path, data::Split::Test); });
  CHECK(contains(e, "test_batch.bin not found"));
  CHECK(contains(error_of([&] { data::read_cifar10({dir.file("nothing.bin")}); }), "cannot open"));
  CHECK(contains(error_of([] { data::read_cifar10({}); }), "no files given"));
}

TEST_CASE("a CIFAR file's size is checked before a byte of it is read: a 64 GiB sparse file is an error at once") {
  TempDir dir;
  const std::string huge = dir.file("data_batch_1.bin");
  std::ofstream(huge).close();
  std::filesystem::resize_file(huge, uint64_t(64) << 30);  // sparse: no disk, but reading it would need 64 GiB
  const std::string e = error_of([&] { data::read_cifar10({huge}); });
  CHECK(contains(e, "data_batch_1.bin has 68719476736 bytes, not a whole number of 3073-byte records"));
  std::filesystem::resize_file(huge, 3073 * 10'000);  // a whole number of records, read a chunk at a time
  write_records(dir.file("data_batch_2.bin"), 0, cifar10_labels(2, 3));
  const data::ImageDataset d = data::read_cifar10({huge, dir.file("data_batch_2.bin")});
  CHECK(d.size() == 10'002);
  CHECK(to_vector<int64_t>(d.labels.narrow(0, 9'999, 3)) == std::vector<int64_t>{0, 3, 4});  // zeros, then file 2
  CHECK(int(d.images[10'001][2][31][31].item<uint8_t>()) == int(pixel(1, kPixels - 1)));
}

TEST_CASE("a CIFAR batch whose status cannot be read is an error with the reason, not a batch left out as missing") {
  TempDir dir;
  write_records(dir.file("data_batch_2.bin"), 0, cifar10_labels(2, 0));
  std::filesystem::create_symlink("data_batch_1.bin", dir.file("data_batch_1.bin"));  // a loop of links (ELOOP)
  const std::string e = error_of([&] { data::load_cifar10(dir.path, data::Split::Train); });
  CHECK(contains(e, "cifar10: cannot read " + dir.file("data_batch_1.bin") + ": Too many levels of symbolic links"));
  std::filesystem::remove(dir.file("data_batch_1.bin"));
  CHECK(data::load_cifar10(dir.path, data::Split::Train).size() == 2);  // missing: trained without it, with a warning
}

TEST_CASE("a FIFO in a CIFAR file's place is refused at once, not waited on for a writer") {
  TempDir dir;
  const std::string fifo = make_fifo(dir, "test_batch.bin");
  for (const std::function<void()>& read : std::vector<std::function<void()>>{
           [&] { data::read_cifar10({fifo}); },
           [&] { data::read_cifar100({fifo}); },
           [&] { data::load_cifar10(dir.path, data::Split::Test); },
       }) {
    CHECK(contains(error_of_without_waiting(fifo, read), "test_batch.bin is not a regular file"));
  }
  std::filesystem::rename(fifo, dir.file("data_batch_1.bin"));
  CHECK(contains(error_of_without_waiting(dir.file("data_batch_1.bin"),
                                          [&] { data::load_cifar10(dir.path, data::Split::Train); }),
                 "data_batch_1.bin is not a regular file"));
}

TEST_CASE("an empty CIFAR file, a folder in a file's place and CIFAR-100's unused label byte out of range are errors") {
  TempDir dir;
  std::ofstream(dir.file("data_batch_1.bin")).close();  // 0 bytes
  CHECK(contains(error_of([&] { data::load_cifar10(dir.path, data::Split::Train); }),
                 "data_batch_1.bin is empty (0 bytes: no images)"));
  std::filesystem::create_directory(dir.file("test_batch.bin"));
  CHECK(contains(error_of([&] { data::load_cifar10(dir.path, data::Split::Test); }),
                 "test_batch.bin is not a regular file"));
  std::filesystem::create_directory(dir.file("data_batch_2.bin"));
  CHECK(contains(error_of([&] { data::load_cifar10(dir.path, data::Split::Train); }),
                 "data_batch_2.bin is not a regular file"));
  // Fine labels read, but the coarse byte (offset 0 of each record) must still be a coarse class.
  write_records(dir.file("train.bin"), 0, {{3, 40}, {200, 41}});
  CHECK(contains(error_of([&] { data::read_cifar100({dir.file("train.bin")}, data::Cifar100Labels::Fine); }),
                 "train.bin offset 3074: label 200 is not in 0..19"));
}

TEST_CASE("load_cifar10 and load_cifar100 read the official file names") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k) write_records(dir.file(fmt::format("data_batch_{}.bin", k)), 2 * (k - 1), cifar10_labels(2, 2 * (k - 1)));
  write_records(dir.file("test_batch.bin"), 100, cifar10_labels(3, 0));
  write_records(dir.file("test.bin"), 0, {{1, 2}});
  CHECK(data::load_cifar10(dir.path, data::Split::Train).size() == 10);
  data::ImageDataset test = data::load_cifar10(dir.path, data::Split::Test);
  CHECK(test.size() == 3);
  CHECK(int(test.images[0][0][0][0].item<uint8_t>()) == int(pixel(100, 0)));
  CHECK(to_vector<int64_t>(data::load_cifar100(dir.path, data::Split::Test).labels) == std::vector<int64_t>{2});
}

TEST_CASE("load_cifar10 trains on the batches that exist, in order, and refuses a folder with none") {
  TempDir dir;
  write_records(dir.file("data_batch_3.bin"), 30, cifar10_labels(2, 4));
  write_records(dir.file("data_batch_1.bin"), 10, cifar10_labels(1, 7));
  const data::ImageDataset train = data::load_cifar10(dir.path, data::Split::Train);
  CHECK(train.size() == 3);
  CHECK(to_vector<int64_t>(train.labels) == std::vector<int64_t>{7, 4, 5});  // batch 1, then batch 3
  TempDir empty;
  const std::string e = error_of([&] { data::load_cifar10(empty.path, data::Split::Train); });
  CHECK(contains(e, "no training batch"));
  CHECK(contains(e, "data_batch_1.bin .. data_batch_5.bin"));
}

TEST_CASE("an epoch visits every sample once, in batches of batch_size, shuffled per epoch and seed") {
  data::ImageLoader plain(synthetic(10), {}, {.batch_size = 4, .workers = 0});
  CHECK(plain.batches_per_epoch() == 3);
  CHECK(plain.order(0) == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  std::vector<int64_t> sizes, targets;
  for (const data::Batch& b : plain.epoch(0)) {
    sizes.push_back(b.inputs.size(0));
    for (int64_t t : to_vector<int64_t>(b.targets)) targets.push_back(t);
  }
  CHECK(sizes == std::vector<int64_t>{4, 4, 2});
  CHECK(targets == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});

  data::ImageLoader dropping(synthetic(10), {}, {.batch_size = 4, .drop_last = true, .workers = 0});
  CHECK(dropping.batches_per_epoch() == 2);

  data::ImageLoader shuffled(synthetic(50), {}, {.batch_size = 8, .shuffle = true, .seed = 7});
  const std::vector<int64_t> e0 = shuffled.order(0), e1 = shuffled.order(1);
  std::vector<int64_t> sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == plain_order(50));
  CHECK(e0 != e1);
  CHECK(e0 != plain_order(50));
  CHECK(data::ImageLoader(synthetic(50), {}, {.shuffle = true, .seed = 7}).order(0) == e0);  // same seed, same order
  CHECK(data::ImageLoader(synthetic(50), {}, {.shuffle = true, .seed = 8}).order(0) != e0);
  // The batches follow the order: the labels of epoch 1 are those of its order.
  std::vector<int64_t> seen;
  for (const data::Batch& b : shuffled.epoch(1))
    for (int64_t t : to_vector<int64_t>(b.targets)) seen.push_back(t);
  REQUIRE(seen.size() == 50);
  for (size_t i = 0; i < 50; ++i) CHECK(seen[i] == e1[i] % 10);
}

TEST_CASE("data parallel: the ranks' shards of an epoch cover it, padded to equal length, reshuffled each epoch") {
  // 10 images over 3 ranks: 4 each, the order's first 2 indices repeated at the end (torch's DistributedSampler).
  data::ImageLoader whole(synthetic(10), {}, {.batch_size = 3, .workers = 0});
  std::vector<std::vector<int64_t>> shards;
  for (int64_t rank = 0; rank < 3; ++rank) {
    data::ImageLoader part(synthetic(10), {}, {.batch_size = 3, .workers = 0, .rank = rank, .world_size = 3});
    CHECK(part.samples_per_epoch() == 4);
    CHECK(part.batches_per_epoch() == 2);  // 3 + 1
    shards.push_back(part.order(0));
    std::vector<int64_t> seen;
    for (const data::Batch& b : part.epoch(0))
      for (int64_t t : to_vector<int64_t>(b.targets)) seen.push_back(t);
    CHECK(seen.size() == 4);
    for (size_t i = 0; i < seen.size(); ++i) CHECK(seen[i] == shards.back()[i] % 10);
  }
  CHECK(shards[0] == std::vector<int64_t>{0, 3, 6, 9});
  CHECK(shards[1] == std::vector<int64_t>{1, 4, 7, 0});
  CHECK(shards[2] == std::vector<int64_t>{2, 5, 8, 1});

  // Shuffled: every rank draws the same order from the shared seed and keeps its positions; a new order each epoch.
  for (int64_t epoch : {0, 1}) {
    const std::vector<int64_t> order =
        data::ImageLoader(synthetic(10), {}, {.shuffle = true, .seed = 5}).order(epoch);
    std::vector<int64_t> together;
    for (int64_t rank = 0; rank < 3; ++rank) {
      const std::vector<int64_t> shard =
          data::ImageLoader(synthetic(10), {}, {.shuffle = true, .seed = 5, .rank = rank, .world_size = 3}).order(epoch);
      for (size_t k = 0; k < shard.size(); ++k) CHECK(shard[k] == order[(size_t(rank) + 3 * k) % 10]);
      together.insert(together.end(), shard.begin(), shard.end());
    }
    std::sort(together.begin(), together.end());
    together.erase(std::unique(together.begin(), together.end()), together.end());
    CHECK(together == plain_order(10));  // every image in some shard
  }
  CHECK(data::ImageLoader(synthetic(10), {}, {.shuffle = true, .seed = 5, .rank = 1, .world_size = 3}).order(0) !=
        data::ImageLoader(synthetic(10), {}, {.shuffle = true, .seed = 5, .rank = 1, .world_size = 3}).order(1));
  // More ranks than images: each rank still gets one, the padding wrapping around.
  CHECK(data::ImageLoader(synthetic(2), {}, {.rank = 4, .world_size = 5}).order(0) == std::vector<int64_t>{0});
  CHECK(contains(error_of([] { data::ImageLoader(synthetic(2), {}, {.rank = 3, .world_size = 3}); }),
                 "ImageLoader: rank 3 is not in 0..2 (world_size 3)"));
  CHECK(contains(error_of([] { data::ImageLoader(synthetic(2), {}, {.world_size = 0}); }), "world_size 0"));
}

TEST_CASE("the evaluation transform scales to [0, 1] and normalises per channel") {
  data::ImageLoader loader(synthetic(3), data::ImageTransform::cifar_eval(), {.batch_size = 3, .workers = 0});
  data::Batch b = loader.make_batch(0, 0);
  CHECK(b.inputs.dtype() == kFloat32);
  CHECK(b.inputs.shape() == Shape{3, 3, 32, 32});
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t c = 0; c < 3; ++c) {
      for (int64_t y : {0, 17, 31}) {
        for (int64_t x : {0, 5, 31}) {
          const double p = pixel(i, c * 1024 + y * 32 + x);
          const double want = (p / 255.0 - data::kCifar10Mean[c]) / data::kCifar10Std[c];
          CHECK(b.inputs[i][c][y][x].item<float>() == doctest::Approx(want).epsilon(1e-5));
        }
      }
    }
  }
}

TEST_CASE("the training transform is a crop of the zero-padded image, mirrored or not, the same for all channels") {
  const int64_t n = 40;
  data::ImageDataset d = synthetic(n);
  data::ImageLoader loader(d, data::ImageTransform::cifar_train(), {.batch_size = n, .workers = 0, .seed = 3});
  data::Batch b = loader.make_batch(0, 0);
  std::set<std::pair<int64_t, int64_t>> offsets;
  int flips = 0;
  for (int64_t i = 0; i < n; ++i) {
    // Find the (dy, dx, flip) that reproduces the output image exactly: there must be one.
    bool found = false;
    for (int64_t dy = -4; dy <= 4 && !found; ++dy) {
      for (int64_t dx = -4; dx <= 4 && !found; ++dx) {
        for (bool flip : {false, true}) {
          bool same = true;
          for (int64_t c = 0; c < 3 && same; ++c) {
            for (int64_t y = 0; y < 32 && same; ++y) {
              for (int64_t x = 0; x < 32 && same; ++x) {
                const int64_t sy = y + dy, sx = (flip ? 31 - x : x) + dx;
                const double p = sy >= 0 && sy < 32 && sx >= 0 && sx < 32 ? pixel(i, c * 1024 + sy * 32 + sx) : 0.0;
                const double want = (p / 255.0 - data::kCifar10Mean[c]) / data::kCifar10Std[c];
                same = std::abs(b.inputs.data<float>()[((i * 3 + c) * 32 + y) * 32 + x] - want) < 1e-5;
              }
            }
          }
          if (same) {
            found = true;
            offsets.insert({dy, dx});
            flips += flip;
            break;
          }
        }
      }
    }
    CHECK(found);
  }
  // Different samples get different windows and about half are flipped.
  CHECK(offsets.size() > 10);
  CHECK(flips > 5);
  CHECK(flips < 35);
  // A new epoch draws new windows; the same epoch draws the same ones.
  CHECK(!bit_equal(loader.make_batch(1, 0).inputs, b.inputs));
  CHECK(bit_equal(loader.make_batch(0, 0).inputs, b.inputs));
}

TEST_CASE("workers give the same batches in the same order as the calling thread, for any number of workers") {
  const data::ImageDataset d = synthetic(103);
  auto run = [&](int workers, int prefetch) {
    data::ImageLoader loader(d, data::ImageTransform::cifar_train(),
                             {.batch_size = 10, .shuffle = true, .workers = workers, .prefetch = prefetch, .seed = 11});
    std::vector<std::pair<Tensor, Tensor>> batches;
    for (int64_t epoch = 0; epoch < 2; ++epoch)
      for (const data::Batch& b : loader.epoch(epoch)) batches.push_back({b.inputs, b.targets});
    return batches;
  };
  const auto reference = run(0, 1);
  REQUIRE(reference.size() == 22);
  for (auto [workers, prefetch] : {std::pair{1, 1}, std::pair{3, 2}, std::pair{8, 4}}) {
    CAPTURE(workers);
    const auto got = run(workers, prefetch);
    REQUIRE(got.size() == reference.size());
    for (size_t k = 0; k < got.size(); ++k) {
      CHECK(bit_equal(got[k].first, reference[k].first));
      CHECK(bit_equal(got[k].second, reference[k].second));
    }
  }
  // Leaving an epoch early stops its workers (the destructor joins them).
  data::ImageLoader loader(d, {}, {.batch_size = 1, .workers = 4});
  {
    auto epoch = loader.epoch(0);
    CHECK(epoch.next().has_value());
  }
  CHECK(loader.epoch(0).next()->index == 0);
}

TEST_CASE("the image loader checks its dataset, transform and options") {
  data::ImageDataset d = synthetic(4);
  CHECK(contains(error_of([&] { data::ImageLoader({d.images.to(kFloat32), d.labels, {}}, {}); }),
                 "images must be a uint8 [N, C, H, W] CPU tensor, got float32[4, 3, 32, 32]"));
  CHECK(contains(error_of([&] { data::ImageLoader({d.images, d.labels.narrow(0, 0, 3), {}}, {}); }),
                 "labels must be int64 [N] with N = 4"));
  CHECK(contains(error_of([&] { data::ImageLoader(d, {.mean = {0.5f}, .std = {0.5f}}); }),
                 "one value per channel (3), got 1 and 1"));
  CHECK(contains(error_of([&] { data::ImageLoader(d, {.mean = {0, 0, 0}, .std = {1, 0, 1}}); }),
                 "std values must be positive"));
  CHECK(contains(error_of([&] { data::ImageLoader(d, {}, {.batch_size = 0}); }), "batch_size must be >= 1"));
  CHECK(contains(error_of([&] { data::ImageLoader(d, {}, {.batch_size = 2}).make_batch(0, 2); }),
                 "asked for batch 2 of an epoch of 2"));
}

TEST_CASE("a batch size near INT64_MAX is one batch of every image, not an overflow to no batches") {
  data::ImageDataset d = synthetic(4);
  data::ImageLoader loader(d, {}, {.batch_size = std::numeric_limits<int64_t>::max()});
  CHECK(loader.batches_per_epoch() == 1);
  CHECK(loader.make_batch(0, 0).inputs.size(0) == 4);
  data::ImageLoader dropping(d, {}, {.batch_size = std::numeric_limits<int64_t>::max(), .drop_last = true});
  CHECK(dropping.batches_per_epoch() == 0);
}

TEST_CASE("tokenize splits on whitespace and ends every line with <eos>, ids in first-seen order (data.py)") {
  TempDir dir;
  {
    std::ofstream(dir.file("train.txt")) << " \n = Title = \n the cat  sat\t on the mat \n";
    std::ofstream(dir.file("valid.txt")) << " the dog \n";
    std::ofstream(dir.file("test.txt")) << " a cat";  // no final line break: still one line
  }
  data::Corpus c = data::load_corpus(dir.path);
  // " \n" is only <eos>; then "=", "Title", "=", <eos>; ...
  CHECK(c.vocab.id("<eos>") == 0);
  CHECK(c.vocab.id("=") == 1);
  CHECK(c.vocab.id("Title") == 2);
  CHECK(to_vector<int64_t>(c.train) == std::vector<int64_t>{0, 1, 2, 1, 0, 3, 4, 5, 6, 3, 7, 0});
  CHECK(to_vector<int64_t>(c.valid) == std::vector<int64_t>{3, 8, 0});
  CHECK(to_vector<int64_t>(c.test) == std::vector<int64_t>{9, 4, 0});
  CHECK(c.vocab.size() == 10);
  CHECK(c.vocab.word(8) == "dog");
  CHECK(contains(error_of([&] { c.vocab.id("bird"); }), "\"bird\" is not among its 10 words"));
  CHECK(contains(error_of([&] { c.vocab.word(10); }), "id 10 is out of range"));
  std::filesystem::remove(dir.file("test.txt"));
  CHECK(contains(error_of([&] { data::load_corpus(dir.path); }), "test.txt not found"));
  CHECK(contains(error_of([&] { data::load_corpus(dir.file("train.txt")); }),
                 "load_corpus: " + dir.file("train.txt") + " is not a folder (it should hold train.txt, valid.txt and "
                 "test.txt)"));
}

TEST_CASE("tokenize ends lines at \\n, \\r\\n and a lone \\r, and splits at ASCII's separators too, as Python's text "
          "files and str.split()") {
  TempDir dir;
  const std::string file = dir.file("lines.txt");
  auto words = [&](const std::string& text) {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << text;
    data::Vocabulary vocab;
    std::vector<std::string> out;
    for (int64_t id : to_vector<int64_t>(data::tokenize(file, vocab))) out.push_back(vocab.word(id));
    return out;
  };
  using Words = std::vector<std::string>;
  CHECK(words("a b\rc d\n") == Words{"a", "b", "<eos>", "c", "d", "<eos>"});  // old Mac line ends
  CHECK(words("a\r\nb\r\n") == Words{"a", "<eos>", "b", "<eos>"});           // Windows'
  CHECK(words("a\r\r\nb\r") == Words{"a", "<eos>", "<eos>", "b", "<eos>"});  // \r, then \r\n; a last lone \r
  CHECK(words("a\x1f" "b\x1c" "c\x1d\x1e\n") == Words{"a", "b", "c", "<eos>"});
  CHECK(words("a\x01" "b\n") == Words{"a\x01" "b", "<eos>"});  // a control character that Python does not split at
}

TEST_CASE("tokenize refuses a FIFO at once, and a folder, naming the path") {
  TempDir dir;
  data::Vocabulary vocab;
  const std::string fifo = testing::make_fifo(dir, "fifo.txt");
  CHECK(contains(testing::error_of_without_waiting(fifo, [&] { data::tokenize(fifo, vocab); }), fifo));
  CHECK(contains(error_of([&] { data::tokenize(dir.path, vocab); }), dir.path.string()));
  CHECK(contains(error_of([&] { data::tokenize(dir.file("missing.txt"), vocab); }),
                 "tokenize: cannot open " + dir.file("missing.txt")));
}

TEST_CASE("tokenize takes UTF-8 words and refuses a file that is not UTF-8, naming it and the byte's offset") {
  TempDir dir;
  std::ofstream(dir.file("valid.txt")) << " the dog \n";
  std::ofstream(dir.file("test.txt")) << " a cat\n";
  // Two-, three- and four-byte characters (é, €, 𝄞) and the largest code point, U+10FFFF, are words like any other.
  std::ofstream(dir.file("train.txt")) << "caf\xc3\xa9 \xe2\x82\xac \xf0\x9d\x84\x9e \xf4\x8f\xbf\xbf\n";
  const data::Corpus c = data::load_corpus(dir.path);
  CHECK(c.vocab.word(0) == "caf\xc3\xa9");
  CHECK(c.vocab.word(3) == "\xf4\x8f\xbf\xbf");
  // What Python's strict codec (data.py's open(..., encoding="utf8")) stops at, at the offset it reports: where the
  // bad sequence starts.
  const std::pair<std::string, std::string> bad[] = {
      {"ok\n\x80 stray", "byte 0x80 at offset 3 (line 2)"},  // a continuation byte alone
      {"ab\xc3", "byte 0xc3 at offset 2"},                     // a sequence cut short by the line's end
      {"\xc3(", "byte 0xc3 at offset 0"},                       // a lead byte without its continuation
      {"\xc0\xaf", "byte 0xc0 at offset 0"},                    // an overlong "/"
      {"\xe0\x80\xaf", "byte 0xe0 at offset 0"},                // overlong, three bytes
      {"\xed\xa0\x80", "byte 0xed at offset 0"},                // a surrogate, U+D800
      {"\xf4\x90\x80\x80", "byte 0xf4 at offset 0"},            // past U+10FFFF
      {"a b\n\xff", "byte 0xff at offset 4 (line 2)"},
      {"a\rb\r\n\r\xff", "byte 0xff at offset 6 (line 4)"},  // lone \r line ends counted, \r\n once
  };
  for (const auto& [text, where] : bad) {
    CAPTURE(where);
    std::ofstream(dir.file("train.txt"), std::ios::binary | std::ios::trunc) << text;
    const std::string error = error_of([&] { data::load_corpus(dir.path); });
    CHECK(contains(error, dir.file("train.txt") + " is not valid UTF-8"));
    CHECK(contains(error, where));
  }
}

TEST_CASE("tokenize leaves the vocabulary as it was when the file fails half-way, and names why a file cannot open") {
  TempDir dir;
  data::Vocabulary vocab;
  vocab.add("x");
  vocab.add("<eos>");
  std::ofstream(dir.file("bad.txt"), std::ios::binary) << "good words\nfoo bar\r\xff" "baz\n";
  CHECK(contains(error_of([&] { data::tokenize(dir.file("bad.txt"), vocab); }), "byte 0xff at offset 19 (line 3)"));
  CHECK(vocab.size() == 2);  // "good" and "words" were read before the bad byte: not added
  std::ofstream(dir.file("bad.txt"), std::ios::binary | std::ios::trunc) << "good words\n";
  CHECK(to_vector<int64_t>(data::tokenize(dir.file("bad.txt"), vocab)) == std::vector<int64_t>{2, 3, 1});
  CHECK(contains(error_of([&] { data::tokenize(dir.file("none.txt"), vocab); }),
                 "cannot open " + dir.file("none.txt") + ": No such file or directory"));
}

TEST_CASE("batchify lays the text out in columns, bptt_batch gives inputs and next-token targets") {
  Tensor ids = arange(0, 26);
  Tensor source = data::batchify(ids, 4);  // 26 tokens -> 6 rows of 4 columns, 2 dropped
  CHECK(source.shape() == Shape{6, 4});
  CHECK(to_vector<int64_t>(source.select(1, 0)) == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
  CHECK(to_vector<int64_t>(source.select(1, 3)) == std::vector<int64_t>{18, 19, 20, 21, 22, 23});
  data::TextBatch b = data::bptt_batch(source, 0, 3);
  CHECK(b.input.shape() == Shape{3, 4});
  CHECK(to_vector<int64_t>(b.target) == to_vector<int64_t>(source.narrow(0, 1, 3).reshape({-1})));
  CHECK(to_vector<int64_t>(b.input[2]) == std::vector<int64_t>{2, 8, 14, 20});
  data::TextBatch tail = data::bptt_batch(source, 3, 3);  // rows 3, 4 predict rows 4, 5
  CHECK(tail.input.size(0) == 2);
  CHECK(to_vector<int64_t>(tail.target) == std::vector<int64_t>{4, 10, 16, 22, 5, 11, 17, 23});
  CHECK(contains(error_of([&] { data::bptt_batch(source, 5, 3); }), "row 5 has no next row to predict"));
  CHECK(contains(error_of([&] { data::bptt_batch(source.narrow(0, 0, 1), 0, 3); }),
                 "bptt_batch: the source has 1 row; a window needs at least 2"));
  CHECK(contains(error_of([&] { data::batchify(ids, 27); }), "batch_size must be in 1..26"));
  CHECK(contains(error_of([&] { data::batchify(arange(0, 0), 1); }), "batchify: there are no token ids to batch"));
  CHECK(contains(error_of([&] { data::bptt_batch(source, std::numeric_limits<int64_t>::max(), 1); }),
                 "has no next row to predict"));  // i + 1 would overflow
  CHECK(contains(error_of([&] { data::batchify(ids.to(kFloat32), 2); }), "expected int64 token ids"));
}

TEST_CASE("the WikiText-2 that halfgrad ships is the pytorch/examples corpus: token counts and vocabulary") {
  const auto dir = data::default_data_directory() / "wikitext-2";
  REQUIRE(std::filesystem::is_regular_file(dir / "train.txt"));
  data::Corpus c = data::load_corpus(dir);
  CHECK(c.train.size(0) == 2088628);
  CHECK(c.valid.size(0) == 217646);
  CHECK(c.test.size(0) == 245569);
  CHECK(c.vocab.size() == 33278);
  CHECK(c.vocab.word(0) == "<eos>");
  CHECK(c.vocab.word(c.train[1].item<int64_t>()) == "=");
  CHECK(c.vocab.word(c.train[2].item<int64_t>()) == "Valkyria");
}
