// ImageLoader (data/loader.h): epoch order, per-sample transform, worker threads.
#include "data/loader.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/random.h"

namespace halfgrad::data {

namespace {

// Counter domains of the loader's Philox streams, so that the shuffle and the augmentation never share numbers.
constexpr uint64_t kShuffleDomain = uint64_t(1) << 62;
constexpr uint64_t kAugmentDomain = uint64_t(2) << 62;

// A uniform integer in [0, n) from 64 random bits (a multiply-high: bias below n / 2^64).
int64_t below(const Philox::U4& r, int64_t n) {
  const uint64_t bits = (uint64_t(r.x[0]) << 32) | r.x[1];
  return int64_t((static_cast<unsigned __int128>(bits) * uint64_t(n)) >> 64);
}

// A uniform integer in [0, n) from one 32-bit word (n is small: a crop offset).
int64_t below(uint32_t word, int64_t n) { return int64_t((uint64_t(word) * uint64_t(n)) >> 32); }

}  // namespace

ImageTransform ImageTransform::cifar_train(const float (&mean)[3], const float (&std)[3]) {
  return {4, true, {mean[0], mean[1], mean[2]}, {std[0], std[1], std[2]}};
}

ImageTransform ImageTransform::cifar_eval(const float (&mean)[3], const float (&std)[3]) {
  return {0, false, {mean[0], mean[1], mean[2]}, {std[0], std[1], std[2]}};
}

ImageLoader::ImageLoader(ImageDataset dataset, ImageTransform transform, LoaderOptions options)
    : dataset_(std::move(dataset)), transform_(std::move(transform)), options_(options) {
  const Tensor& images = dataset_.images;
  HG_CHECK(images.defined() && images.dim() == 4 && images.dtype() == kUInt8 && images.device().is_cpu(),
           "ImageLoader: images must be a uint8 [N, C, H, W] CPU tensor, got {}",
           images.defined() ? images.meta() : "an undefined tensor");
  HG_CHECK(dataset_.labels.defined() && dataset_.labels.dim() == 1 && dataset_.labels.dtype() == kInt64 &&
               dataset_.labels.size(0) == images.size(0),
           "ImageLoader: labels must be int64 [N] with N = {} (the images' count), got {}", images.size(0),
           dataset_.labels.defined() ? dataset_.labels.meta() : "an undefined tensor");
  dataset_.images = images.contiguous();
  dataset_.labels = dataset_.labels.contiguous();
  const int64_t channels = images.size(1);
  for (const auto* v : {&transform_.mean, &transform_.std}) {
    HG_CHECK(v->empty() || int64_t(v->size()) == channels,
             "ImageLoader: the transform's mean and std need one value per channel ({}), got {} and {}", channels,
             transform_.mean.size(), transform_.std.size());
  }
  for (float s : transform_.std) HG_CHECK(s > 0, "ImageLoader: std values must be positive, got {}", s);
  HG_CHECK(transform_.crop_padding >= 0, "ImageLoader: crop_padding must be >= 0, got {}", transform_.crop_padding);
  HG_CHECK(options_.batch_size >= 1, "ImageLoader: batch_size must be >= 1, got {}", options_.batch_size);
  HG_CHECK(options_.world_size >= 1 && options_.rank >= 0 && options_.rank < options_.world_size,
           "ImageLoader: rank {} is not in 0..{} (world_size {})", options_.rank, options_.world_size - 1,
           options_.world_size);
  HG_CHECK(options_.workers >= 0 && options_.prefetch >= 1,
           "ImageLoader: workers must be >= 0 and prefetch >= 1, got workers = {}, prefetch = {}", options_.workers,
           options_.prefetch);
}

int64_t ImageLoader::samples_per_epoch() const {
  const int64_t n = dataset_.size(), w = options_.world_size;
  return n / w + (n % w != 0);
}

int64_t ImageLoader::batches_per_epoch() const {
  const int64_t n = samples_per_epoch(), b = options_.batch_size;
  return options_.drop_last ? n / b : n / b + (n % b != 0);  // not (n + b - 1) / b: b may be near INT64_MAX
}

std::vector<int64_t> ImageLoader::order(int64_t epoch) const {
  std::vector<int64_t> order(size_t(dataset_.size()));
  std::iota(order.begin(), order.end(), int64_t(0));
  if (options_.shuffle) {
    // Fisher-Yates, position i swapped with a uniform j <= i drawn from counter (epoch, i).
    const uint64_t base = kShuffleDomain + uint64_t(epoch) * uint64_t(order.size());
    for (int64_t i = int64_t(order.size()) - 1; i > 0; --i) {
      std::swap(order[size_t(i)], order[size_t(below(Philox::generate(options_.seed, base + uint64_t(i)), i + 1))]);
    }
  }
  if (options_.world_size == 1 || order.empty()) return order;
  // This rank's shard: positions rank, rank + world_size, ... of the order padded with its own start.
  std::vector<int64_t> shard(static_cast<size_t>(samples_per_epoch()));
  for (size_t k = 0; k < shard.size(); ++k)
    shard[k] = order[(size_t(options_.rank) + k * size_t(options_.world_size)) % order.size()];
  return shard;
}

Batch ImageLoader::make_batch(int64_t epoch, int64_t k) const {
  HG_CHECK(k >= 0 && k < batches_per_epoch(), "ImageLoader: asked for batch {} of an epoch of {}", k,
           batches_per_epoch());
  return make_batch(order(epoch), epoch, k);
}

Batch ImageLoader::make_batch(const std::vector<int64_t>& all, int64_t epoch, int64_t k) const {
  const int64_t first = k * options_.batch_size;
  const int64_t count = std::min<int64_t>(options_.batch_size, int64_t(all.size()) - first);
  const int64_t C = dataset_.images.size(1), H = dataset_.images.size(2), W = dataset_.images.size(3);
  const int64_t pad = transform_.crop_padding, n = dataset_.size();

  Batch batch{empty({count, C, H, W}), empty({count}, {.dtype = kInt64}), k};
  const uint8_t* pixels = dataset_.images.data<uint8_t>();
  const int64_t* labels = dataset_.labels.data<int64_t>();
  float* out = batch.inputs.data<float>();
  int64_t* targets = batch.targets.data<int64_t>();
  std::vector<float> scale(static_cast<size_t>(C)), shift(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) {
    const float mean = transform_.mean.empty() ? 0.0f : transform_.mean[size_t(c)];
    const float std = transform_.std.empty() ? 1.0f : transform_.std[size_t(c)];
    scale[size_t(c)] = 1.0f / (255.0f * std);  // (p / 255 - mean) / std = p * scale + shift
    shift[size_t(c)] = -mean / std;
  }
  for (int64_t b = 0; b < count; ++b) {
    const int64_t index = all[size_t(first + b)];
    targets[b] = labels[index];
    // The crop window's offset in the padded image and the flip: three words of counter (epoch, index).
    const Philox::U4 r = Philox::generate(options_.seed, kAugmentDomain + uint64_t(epoch) * uint64_t(n) + uint64_t(index));
    const int64_t dy = pad > 0 ? below(r.x[0], 2 * pad + 1) - pad : 0;
    const int64_t dx = pad > 0 ? below(r.x[1], 2 * pad + 1) - pad : 0;
    const bool flip = transform_.horizontal_flip && (r.x[2] >> 31) != 0;
    const uint8_t* image = pixels + index * C * H * W;
    float* o = out + b * C * H * W;
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t y = 0; y < H; ++y) {
        const int64_t sy = y + dy;
        for (int64_t x = 0; x < W; ++x) {
          // Output x shows column xs of the cropped image; flipping mirrors the cropped window.
          const int64_t xs = flip ? W - 1 - x : x, sx = xs + dx;
          const bool inside = sy >= 0 && sy < H && sx >= 0 && sx < W;
          const float p = inside ? float(image[(c * H + sy) * W + sx]) : 0.0f;
          o[(c * H + y) * W + x] = p * scale[size_t(c)] + shift[size_t(c)];
        }
      }
    }
  }
  return batch;
}

ImageLoader::Epoch ImageLoader::epoch(int64_t epoch, int64_t first_batch) const& {
  return Epoch(*this, epoch, first_batch);
}

ImageLoader::Epoch::Epoch(const ImageLoader& loader, int64_t epoch, int64_t first_batch)
    : loader_(loader),
      epoch_(epoch),
      total_(loader.batches_per_epoch()),
      next_to_make_(first_batch),
      next_to_give_(first_batch),
      window_(int64_t(std::max(loader.options().workers, 1)) * loader.options().prefetch),
      order_(loader.order(epoch)) {
  HG_CHECK(first_batch >= 0 && first_batch <= total_, "ImageLoader: epoch {} has batches 0..{}, asked to start at {}",
           epoch, total_ - 1, first_batch);
  try {
    for (int w = 0; w < loader.options().workers; ++w) workers_.emplace_back([this] { work(); });
  } catch (...) {  // a thread that could not start: stop and join the ones that did, then report
    stop_workers();
    throw;
  }
}

ImageLoader::Epoch::~Epoch() { stop_workers(); }

void ImageLoader::Epoch::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  room_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void ImageLoader::Epoch::work() {
  for (;;) {
    int64_t k = 0;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      room_.wait(lock, [&] { return stopping_ || error_ || next_to_make_ >= total_ || next_to_make_ < next_to_give_ + window_; });
      if (stopping_ || error_ || next_to_make_ >= total_) return;
      k = next_to_make_++;
    }
    try {
      Batch b = loader_.make_batch(order_, epoch_, k);
      std::lock_guard<std::mutex> lock(mutex_);
      ready_.emplace(k, std::move(b));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_ || k < error_batch_) {  // the first batch in order that failed is the one to report
        error_ = std::current_exception();
        error_batch_ = k;
      }
    }
    made_.notify_all();
    room_.notify_all();
  }
}

std::optional<Batch> ImageLoader::Epoch::next() {
  if (next_to_give_ >= total_) return std::nullopt;
  if (workers_.empty()) {
    try {
      Batch b = loader_.make_batch(order_, epoch_, next_to_give_);
      ++next_to_give_;
      return b;
    } catch (const std::exception& e) {
      HG_FAIL("ImageLoader: making batch {} of epoch {} failed: {}", next_to_give_, epoch_, e.what());
    }
  }
  std::unique_lock<std::mutex> lock(mutex_);
  made_.wait(lock, [&] { return ready_.count(next_to_give_) > 0 || (error_ && error_batch_ <= next_to_give_); });
  auto it = ready_.find(next_to_give_);
  if (it == ready_.end()) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      HG_FAIL("ImageLoader: making batch {} of epoch {} failed: {}", error_batch_, epoch_, e.what());
    }
  }
  Batch b = std::move(it->second);
  ready_.erase(it);
  ++next_to_give_;
  lock.unlock();
  room_.notify_all();
  return b;
}

}  // namespace halfgrad::data
