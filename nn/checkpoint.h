#pragma once
// Checkpoints in the safetensors format (core/serialize.h): files that Python's safetensors and PyTorch read.
//
// Model checkpoints hold a module's state_dict(): parameters and persistent buffers by dotted name, exactly
// what `safetensors.torch.save_file(model.state_dict(), path)` writes for the same architecture:
//
//   nn::save(model, "resnet18.safetensors");
//   nn::load(model, "resnet18.safetensors");   // checks names, shapes, dtypes; reports every mismatch
//
// Training checkpoints add what resuming needs: optimizer state, loss-scaler state, epoch and step, and
// the random generator's state, so that a resumed run draws the same dropout masks and shuffles as an
// uninterrupted one:
//
//   nn::TrainingCheckpoint ck{.model = model.state_dict(), .optimizer = opt.state_tensors(),
//                             .extra = scaler_tensors, .epoch = epoch, .step = step,
//                             .rng = generator_state()};
//   nn::save_training_checkpoint("run/last.safetensors", ck);
//   ...
//   nn::TrainingCheckpoint ck = nn::load_training_checkpoint("run/last.safetensors");
//   model.load_state_dict(ck.model);
//   opt.load_state_tensors(ck.optimizer);
//   set_generator_state(ck.rng);
//
// In the file, the model's tensors are named "model.<name>", the optimizer's "optimizer.<name>", extra
// tensors keep their own names (by convention a prefix per owner: "scaler.scale", "scaler.growth_tracker");
// epoch, step and the generator state are metadata strings under "halfgrad.*" keys. Every write is atomic.
#include <string>

#include "core/random.h"
#include "core/serialize.h"
#include "nn/module.h"

namespace halfgrad::nn {

// ---- model checkpoints
// Writes module.state_dict() and `metadata` (plus "format": "pt", which Hugging Face loaders look for).
void save(const Module& module, const std::string& path, Metadata metadata = {});
// Loads a file written by save() (or by PyTorch for the same architecture) into `module`, in place. Errors
// name the file; a mismatch error lists every missing, unexpected, misshapen and mistyped tensor at once.
LoadResult load(Module& module, const std::string& path, const LoadOptions& options = {});

// ---- training checkpoints

struct TrainingCheckpoint {
  NamedTensors model{};    // module.state_dict()
  NamedTensors optimizer{};  // the optimizer's state tensors (optim/optimizer.h)
  NamedTensors extra{};    // anything else by its own full name, e.g. "scaler.scale" (0-d tensors are fine)
  int64_t epoch = 0;
  int64_t step = 0;
  GeneratorState rng{.seed = 0, .offset = 0};  // generator_state() at save time
  Metadata metadata{};     // the caller's own strings; keys starting with "halfgrad." are reserved
};

void save_training_checkpoint(const std::string& path, const TrainingCheckpoint& checkpoint);
// Reads a file written by save_training_checkpoint. An error names the file when it is not one.
TrainingCheckpoint load_training_checkpoint(const std::string& path);

}  // namespace halfgrad::nn
