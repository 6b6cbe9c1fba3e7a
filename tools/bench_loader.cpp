// bench_loader: how many CIFAR-sized images per second data::ImageLoader delivers (random crop with padding 4,
// horizontal flip, normalisation; batch 128, shuffled), for several numbers of worker threads. A benchmark program,
// not a test. The images are random uint8 values (50,000 of them by default, CIFAR-10's training set size).
//
//   bench_loader [--images 50000] [--batch 128] [--workers 0,1,2,4] [--epochs 2]
#include <CLI/CLI.hpp>
#include <chrono>
#include <vector>

#include <fmt/format.h>

#include "data/loader.h"
#include "halfgrad.h"
#include "tools/cli_checks.h"

using namespace halfgrad;

int main(int argc, char** argv) {
  int64_t images = 50000, batch = 128;
  int epochs = 2;
  std::vector<int> workers = {0, 1, 2, 4};
  CLI::App app{"images per second through data::ImageLoader with the CIFAR training transform"};
  app.add_option("--images", images, "images in the synthetic dataset")->check(cli::integer_in<int64_t>(1));
  app.add_option("--batch", batch, "batch size")->check(cli::integer_in<int64_t>(1));
  app.add_option("--workers", workers, "worker counts to try")->delimiter(',')->check(cli::integer_in<int>(0, 256));
  app.add_option("--epochs", epochs, "epochs per row (the first one is timed too)")->check(cli::integer_in<int>(1));
  CLI11_PARSE(app, argc, argv);

  data::ImageDataset d;
  d.images = (rand({images, 3, 32, 32}) * 256).to(kUInt8);
  d.labels = randint(0, 10, {images});
  fmt::print("bench_loader: {} images of 3x32x32, batch {}, pad-4 crop + flip + normalise, {} epochs per row, {} "
             "hardware threads\n", images, batch, epochs, std::thread::hardware_concurrency());
  fmt::print("{:>8} {:>14} {:>12}\n", "workers", "images/s", "ms/batch");
  for (int w : workers) {
    data::ImageLoader loader(d, data::ImageTransform::cifar_train(), {.batch_size = batch, .shuffle = true, .workers = w});
    const auto t0 = std::chrono::steady_clock::now();
    int64_t seen = 0, batches = 0;
    for (int e = 0; e < epochs; ++e) {
      for (const data::Batch& b : loader.epoch(e)) {
        seen += b.inputs.size(0);
        ++batches;
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("{:>8} {:>14.0f} {:>12.3f}\n", w, double(seen) / s, 1e3 * s / double(batches));
  }
  return 0;
}
