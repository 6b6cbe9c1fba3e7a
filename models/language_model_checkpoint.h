#pragma once
// A word language model's checkpoint with everything needed to use it again: the state_dict (the tensors
// pytorch/examples' RNNModel has, by the same names, so safetensors.torch.load_file reads it into that model), and,
// in the safetensors header's "__metadata__" strings, the architecture and the vocabulary. `halfgrad train-lm
// --save` writes one; `halfgrad generate` reads it.
//
//   models::save_language_model(model, corpus.vocab, "lm.safetensors");
//   models::LoadedLanguageModel lm = models::load_language_model("lm.safetensors", Device::cuda(0));
//   lm.model->eval();  ...  lm.vocab.word(id)
//
// Metadata (all values strings, as safetensors requires):
//   "halfgrad.format"      "language_model/1"
//   "halfgrad.rnn"         lstm, gru, rnn_tanh or rnn_relu        (main.py's --model, lower case)
//   "halfgrad.emsize", "halfgrad.nhid", "halfgrad.nlayers"        decimal integers
//   "halfgrad.dropout"     a decimal number                       (irrelevant in eval mode, kept for the record)
//   "halfgrad.tied"        "true" or "false"
//   "halfgrad.vocab_size"  the number of words
//   "halfgrad.vocab"       the words in id order, each followed by '\n' (words cannot contain '\n': the tokenizer
//                          splits at whitespace)
//   "format"               "pt" (nn::save; Hugging Face loaders look for it)
#include <memory>
#include <string>

#include "core/device.h"
#include "data/text.h"
#include "models/language_model.h"

namespace halfgrad::models {

// Writes model.state_dict() and the metadata above to `path`, atomically. An error when vocab.size() is not the
// model's vocab_size or a word contains '\n'.
void save_language_model(const LanguageModel& model, const data::Vocabulary& vocab, const std::string& path);

struct LoadedLanguageModel {
  std::shared_ptr<LanguageModel> model;  // float32 (a half checkpoint, from O2/O3, is converted), on `device`
  data::Vocabulary vocab;                // vocab.size() == model->vocab_size
};

// Rebuilds the model and vocabulary a save_language_model file describes. Every error is a halfgrad::Error that
// names the file and what is wrong with it: not readable, not safetensors, truncated, not a language model
// checkpoint (no "halfgrad.format"), a missing or malformed metadata entry, a vocabulary of the wrong size, missing,
// unexpected or misshapen tensors.
LoadedLanguageModel load_language_model(const std::string& path, Device device = Device::cpu());

}  // namespace halfgrad::models
