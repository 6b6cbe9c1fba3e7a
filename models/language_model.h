#pragma once
// The word-level language model of pytorch/examples' word_language_model (RNNModel): embedding, a multi-layer
// RNN/GRU/LSTM, a linear decoder over the vocabulary, dropout after the embedding and after the recurrent layers,
// optionally tied input and output embeddings (Press & Wolf 2016; Inan et al. 2016). Same parameter names
// (encoder.weight, rnn.weight_ih_l0, ..., decoder.weight, decoder.bias) and initialisation (encoder and decoder
// weights U(-0.1, 0.1), decoder bias 0).
//
//   models::LanguageModel lm(corpus.vocab.size(), {.kind = nn::RecurrentKind::LSTM});
//   auto out = lm.forward(batch.input, state.h, state.c);       // logits [T, B, vocab]
//   Tensor loss = cross_entropy(out.logits.reshape({-1, vocab}), batch.target);
// or, for training and evaluation, the same loss without the logits (the decoder and the loss as one op):
//   auto f = lm.features(batch.input, state.h, state.c);         // [T, B, hidden]
//   Tensor loss = lm.loss(f.features, batch.target);
#include <memory>

#include "nn/layers.h"
#include "nn/module.h"
#include "nn/rnn.h"

namespace halfgrad::models {

struct LanguageModelOptions {
  nn::RecurrentKind kind = nn::RecurrentKind::LSTM;
  int64_t embedding_size = 200;  // pytorch/examples' defaults: --emsize 200 --nhid 200 --nlayers 2 --dropout 0.2
  int64_t hidden_size = 200;
  int64_t num_layers = 2;
  double dropout = 0.2;
  bool tie_weights = false;  // the decoder uses the encoder's weight (needs embedding_size == hidden_size)
};

class LanguageModel : public nn::Module {
 public:
  LanguageModel(int64_t vocab_size, LanguageModelOptions options = {});

  struct Output {
    Tensor logits;  // [T, B, vocab_size]
    Tensor h, c;    // the recurrent state after the last step (c: LSTM only)
  };
  // tokens: int64 [T, B]; h0/c0: [num_layers, B, hidden] or undefined for zeros.
  Output forward(const Tensor& tokens, const Tensor& h0, const Tensor& c0 = Tensor());
  Tensor forward(const Tensor& tokens) override { return forward(tokens, Tensor(), Tensor()).logits; }

  struct Features {
    Tensor features;  // [T, B, hidden_size]: what the decoder reads (the last layer's output, after dropout)
    Tensor h, c;
  };
  // forward() up to the decoder.
  Features features(const Tensor& tokens, const Tensor& h0, const Tensor& c0 = Tensor());
  // The mean cross entropy of targets (int64 [T * B], main.py's targets) under the decoder's logits of `features`,
  // as cross_entropy(decoder(features).reshape({-1, vocab}), targets), through linear_cross_entropy: on the CPU
  // the logits are never written (ops/linear_cross_entropy.h).
  Tensor loss(const Tensor& features, const Tensor& targets);
  // On CUDA, lays the decoder's weight out as MemoryFormat::AlignedRows, which linear_cross_entropy's products take
  // with no padded copy of the weight in or of its gradient out (ops/linear_cross_entropy.h); nothing elsewhere, or
  // with tied weights (the encoder reads that matrix by rows). Call it after to(device) and before building the
  // optimizer, as nn::Module::to(MemoryFormat) (nn/module.h).
  void align_decoder();
  std::string type_name() const override { return "LanguageModel"; }

  const int64_t vocab_size;
  const LanguageModelOptions options;
  std::shared_ptr<nn::Dropout> drop;
  std::shared_ptr<nn::Embedding> encoder;
  std::shared_ptr<nn::Recurrent> rnn;
  std::shared_ptr<nn::Linear> decoder;
};

}  // namespace halfgrad::models
