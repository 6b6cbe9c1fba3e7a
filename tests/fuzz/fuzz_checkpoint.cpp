// libFuzzer target: safetensors files as every reader of them takes them — the raw reader, training checkpoints
// (then their optimizer state into an SGD shaped like their model) and language-model checkpoints.
#include "halfgrad.h"
#include "models/language_model_checkpoint.h"
#include "nn/checkpoint.h"
#include "tests/fuzz/fuzz_input.h"

using namespace halfgrad;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input("input.safetensors", data, size);
  fuzz::expect_error_or_success([&] { load_safetensors(path); });
  fuzz::expect_error_or_success([&] {
    const nn::TrainingCheckpoint ck = nn::load_training_checkpoint(path);
    TensorList params;
    for (const auto& [name, t] : ck.model)
      if (t.is_floating_point()) params.push_back(zeros(t.shape(), {.dtype = t.dtype()}).requires_grad_());
    if (params.empty()) return;
    optim::SGD sgd(params, {.lr = 0.1, .momentum = 0.9});
    sgd.load_state_tensors(ck.optimizer);
  });
  fuzz::expect_error_or_success([&] { models::load_language_model(path); });
  return 0;
}
