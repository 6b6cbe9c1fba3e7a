#pragma once
// Batches of an in-memory image dataset for training and evaluation, made ahead of the training loop by worker
// threads (torch.utils.data.DataLoader with torchvision's RandomCrop(padding), RandomHorizontalFlip, ToTensor and
// Normalize, for uint8 [N, C, H, W] images).
//
//   ImageLoader loader(data::load_cifar10(dir, data::Split::Train), data::ImageTransform::cifar_train(),
//                      {.batch_size = 128, .shuffle = true, .workers = 4, .seed = 1});
//   for (int64_t epoch = 0; epoch < epochs; ++epoch)
//     for (const data::Batch& batch : loader.epoch(epoch)) { ... batch.inputs.cuda() ... }
//
// Reproducible: the order of an epoch and each sample's crop and flip are functions of (seed, epoch, sample index)
// only (Philox counters, core/random.h), so any number of workers gives the same batches in the same order.
// Batches come out in order; at most workers * prefetch are made ahead. An exception in a worker is rethrown by the
// loop that asks for that batch, naming it.
#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "core/tensor.h"
#include "data/cifar.h"

namespace halfgrad::data {

// What happens to each image on its way into a batch: random crop after zero padding, random horizontal flip, then
// scaling to [0, 1] and per-channel normalisation: out = (pixel / 255 - mean[c]) / std[c] (padding pixels are 0).
struct ImageTransform {
  int64_t crop_padding = 0;      // 0: no crop; p: pad each side by p, then take a random window of the original size
  bool horizontal_flip = false;  // mirror left-right with probability 1/2
  std::vector<float> mean, std;  // per channel; empty: 0 and 1

  // The usual CIFAR recipe: pad 4 + crop + flip for training, normalisation only for evaluation.
  static ImageTransform cifar_train(const float (&mean)[3] = kCifar10Mean, const float (&std)[3] = kCifar10Std);
  static ImageTransform cifar_eval(const float (&mean)[3] = kCifar10Mean, const float (&std)[3] = kCifar10Std);
};

struct LoaderOptions {
  int64_t batch_size = 128;
  bool shuffle = false;    // a new random order each epoch
  bool drop_last = false;  // leave out a last batch smaller than batch_size
  int workers = 2;         // threads that make batches; 0: made in the calling thread when asked for
  int prefetch = 2;        // batches in flight per worker
  uint64_t seed = 0;       // shuffling and augmentation
  // Data parallel (torch's DistributedSampler): rank `rank` of `world_size` loads its shard of each epoch: the
  // epoch's order (the same on every rank: same seed), padded with its own first indices to a multiple of
  // world_size, then every world_size-th index from position `rank`. Every rank has the same number of batches.
  int64_t rank = 0, world_size = 1;
};

struct Batch {
  Tensor inputs;      // float32 [B, C, H, W], transformed
  Tensor targets;     // int64 [B]
  int64_t index = 0;  // which batch of the epoch
};

class ImageLoader {
 public:
  ImageLoader(ImageDataset dataset, ImageTransform transform, LoaderOptions options = {});

  int64_t batches_per_epoch() const;
  const ImageDataset& dataset() const { return dataset_; }
  const LoaderOptions& options() const { return options_; }

  // Batch k of an epoch, made in the calling thread (what the workers run).
  Batch make_batch(int64_t epoch, int64_t k) const;
  // The dataset indices of an epoch (this rank's shard of them), in the order the batches take them.
  std::vector<int64_t> order(int64_t epoch) const;
  int64_t samples_per_epoch() const;  // order(epoch).size(): the dataset's size, or a shard's

  class Epoch;
  // One pass over the data, from batch first_batch on (a run resumed within an epoch); the workers start now and
  // stop when the Epoch is destroyed. The Epoch refers to this loader, which must outlive it (hence no epoch() on a
  // temporary loader).
  Epoch epoch(int64_t epoch, int64_t first_batch = 0) const&;
  Epoch epoch(int64_t epoch, int64_t first_batch = 0) const&& = delete;

 private:
  Batch make_batch(const std::vector<int64_t>& order, int64_t epoch, int64_t k) const;

  ImageDataset dataset_;
  ImageTransform transform_;
  LoaderOptions options_;
};

class ImageLoader::Epoch {
 public:
  Epoch(const ImageLoader& loader, int64_t epoch, int64_t first_batch = 0);
  ~Epoch();
  Epoch(const Epoch&) = delete;
  Epoch& operator=(const Epoch&) = delete;
  Epoch(Epoch&&) = delete;

  // The next batch in order, or nothing once the epoch is done.
  std::optional<Batch> next();

  struct Iterator {
    Epoch* epoch;
    std::optional<Batch> current;
    const Batch& operator*() const { return *current; }
    const Batch* operator->() const { return &*current; }
    Iterator& operator++() {
      current = epoch->next();
      return *this;
    }
    bool operator==(std::default_sentinel_t) const { return !current.has_value(); }
  };
  Iterator begin() { return Iterator{this, next()}; }
  std::default_sentinel_t end() { return {}; }

 private:
  void work();
  void stop_workers();

  const ImageLoader& loader_;
  int64_t epoch_, total_;
  std::mutex mutex_;
  std::condition_variable made_, room_;
  std::map<int64_t, Batch> ready_;
  int64_t next_to_make_ = 0, next_to_give_ = 0;
  int64_t window_;
  bool stopping_ = false;
  std::exception_ptr error_;
  int64_t error_batch_ = -1;
  const std::vector<int64_t> order_;
  std::vector<std::thread> workers_;  // last: started once everything above is ready
};

}  // namespace halfgrad::data
