// The word-level language model (models/language_model.h).
#include "models/language_model.h"

#include "nn/init.h"
#include "ops/linear_cross_entropy.h"

namespace halfgrad::models {

LanguageModel::LanguageModel(int64_t vocab_size, LanguageModelOptions opts) : vocab_size(vocab_size), options(opts) {
  HG_CHECK(vocab_size >= 1, "LanguageModel: vocab_size must be >= 1, got {}", vocab_size);
  HG_CHECK(!opts.tie_weights || opts.embedding_size == opts.hidden_size,
           "LanguageModel: tied weights need embedding_size == hidden_size, got {} and {}", opts.embedding_size,
           opts.hidden_size);
  // pytorch/examples' registration order: drop, encoder, rnn, decoder.
  drop = register_module("drop", std::make_shared<nn::Dropout>(opts.dropout));
  encoder = register_module("encoder", std::make_shared<nn::Embedding>(vocab_size, opts.embedding_size));
  rnn = register_module("rnn", std::make_shared<nn::Recurrent>(
                                   opts.kind, opts.embedding_size, opts.hidden_size,
                                   nn::RecurrentOptions{.num_layers = opts.num_layers, .dropout = opts.dropout}));
  decoder = register_module("decoder", std::make_shared<nn::Linear>(opts.hidden_size, vocab_size));
  nn::init::uniform_(encoder->weight, -0.1, 0.1);
  nn::init::zeros_(decoder->bias);
  nn::init::uniform_(decoder->weight, -0.1, 0.1);
  if (opts.tie_weights) decoder->weight = encoder->weight;  // one tensor in both slots
}

LanguageModel::Output LanguageModel::forward(const Tensor& tokens, const Tensor& h0, const Tensor& c0) {
  Features f = features(tokens, h0, c0);
  return {decoder->forward(f.features), f.h, f.c};
}

LanguageModel::Features LanguageModel::features(const Tensor& tokens, const Tensor& h0, const Tensor& c0) {
  HG_CHECK(tokens.dim() == 2 && tokens.dtype() == kInt64, "LanguageModel: expected int64 tokens [T, B], got {}",
           tokens.meta());
  const Tensor embedded = drop->forward(encoder->forward(tokens));
  nn::RecurrentOutput r = rnn->forward(embedded, h0, c0);
  return {drop->forward(r.output), r.h, r.c};
}

Tensor LanguageModel::loss(const Tensor& features, const Tensor& targets) {
  HG_CHECK(features.dim() == 3 && features.size(2) == options.hidden_size,
           "LanguageModel::loss: expected features [T, B, {}] from features(), got {}", options.hidden_size,
           features.meta());
  return linear_cross_entropy(features.reshape({-1, options.hidden_size}), decoder->weight, decoder->bias, targets);
}

void LanguageModel::align_decoder() {
  if (decoder->weight.is_cuda() && !options.tie_weights) decoder->to(MemoryFormat::AlignedRows);
}

}  // namespace halfgrad::models
