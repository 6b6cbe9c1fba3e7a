// A program outside halfgrad's tree, built against the installed package (find_package(halfgrad), see
// CMakeLists.txt): it fits a small regression with nn::Linear and SGD, and reads the WikiText-2 that halfgrad
// installs beside its library. Exits 0 when the loss fell a hundredfold and the corpus has its 33,278 words.
#include <cstdio>

#include "halfgrad.h"

using namespace halfgrad;

int main() {
  manual_seed(0);
  const Tensor x = randn({256, 8});
  const Tensor y = matmul(x, randn({8, 1})) + 0.5;  // a linear target the layer can fit exactly
  nn::Linear model(8, 1);
  optim::SGD sgd(model.parameters(), {.lr = 0.1});
  double first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    Tensor loss = mse_loss(model.forward(x), y);
    sgd.zero_grad();
    loss.backward();
    sgd.step();
    last = loss.item<double>();
    if (step == 0) first = last;
  }
  std::printf("consumer: halfgrad %s, Linear(8, 1) by SGD: mse %.6f -> %.2e\n", version(), first, last);

  const data::Corpus corpus = data::load_corpus(data::default_data_directory() / "wikitext-2");
  std::printf("consumer: WikiText-2 from %s: %lld words, %lld training tokens\n",
              data::default_data_directory().string().c_str(), (long long)corpus.vocab.size(),
              (long long)corpus.train.numel());
  return last < first / 100 && corpus.vocab.size() == 33278 ? 0 : 1;
}
