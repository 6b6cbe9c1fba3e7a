// nn: Module registration and traversal, modes, conversion, Sequential, every layer against its functional op,
// default initialisation, BatchNorm2d's running statistics, printing.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>

#include "core/cuda.h"
#include "core/random.h"
#include "halfgrad.h"
#include "nn/checkpoint.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "ops/batch_norm.h"
#include "ops/conv.h"
#include "ops/dropout.h"
#include "ops/embedding.h"
#include "ops/pool.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::values;
using halfgrad::testing::bit_equal;
using halfgrad::testing::check_close;
using halfgrad::testing::contains;
using halfgrad::testing::error_of;

namespace {
std::vector<std::string> names(const NamedTensors& named) {
  std::vector<std::string> out;
  for (const auto& [name, t] : named) out.push_back(name);
  return out;
}

// torchvision's ResNet BasicBlock, reduced: the names its parameters get are the point.
struct BasicBlock : nn::Module {
  explicit BasicBlock(int64_t channels)
      : conv1(register_module("conv1", std::make_shared<nn::Conv2d>(channels, channels, 3,
                                                                    nn::Conv2dOptions{.padding = {1, 1}}, false))),
        bn1(register_module("bn1", std::make_shared<nn::BatchNorm2d>(channels))) {}
  Tensor forward(const Tensor& x) override { return (bn1->forward(conv1->forward(x)) + x).relu(); }
  std::string type_name() const override { return "BasicBlock"; }
  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::BatchNorm2d> bn1;
};

struct TinyResNet : nn::Module {
  TinyResNet()
      : conv1(register_module("conv1", std::make_shared<nn::Conv2d>(3, 4, 3, nn::Conv2dOptions{.padding = {1, 1}}))),
        layer1(register_module("layer1", nn::sequential({std::make_shared<BasicBlock>(4), std::make_shared<BasicBlock>(4)}))),
        pool(register_module("pool", std::make_shared<nn::AdaptiveAvgPool2d>(1))),
        fc(register_module("fc", std::make_shared<nn::Linear>(4, 10))) {}
  Tensor forward(const Tensor& x) override {  // x: (N, 3, H, W)
    return fc->forward(pool->forward(layer1->forward(conv1->forward(x))).flatten(1));  // (N, 10)
  }
  std::string type_name() const override { return "TinyResNet"; }
  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::Sequential> layer1;
  std::shared_ptr<nn::AdaptiveAvgPool2d> pool;
  std::shared_ptr<nn::Linear> fc;
};
}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Registration and traversal

TEST_CASE("named_parameters and state_dict use PyTorch's dotted names and order") {
  TinyResNet net;
  CHECK(names(net.named_parameters()) == std::vector<std::string>{
                                             "conv1.weight", "conv1.bias",                    //
                                             "layer1.0.conv1.weight", "layer1.0.bn1.weight", "layer1.0.bn1.bias",
                                             "layer1.1.conv1.weight", "layer1.1.bn1.weight", "layer1.1.bn1.bias",
                                             "fc.weight", "fc.bias"});
  CHECK(names(net.named_buffers()) == std::vector<std::string>{
                                          "layer1.0.bn1.running_mean", "layer1.0.bn1.running_var",
                                          "layer1.0.bn1.num_batches_tracked", "layer1.1.bn1.running_mean",
                                          "layer1.1.bn1.running_var", "layer1.1.bn1.num_batches_tracked"});
  // state_dict: each module's parameters, then its buffers, then its children (torch's order).
  std::vector<std::string> state = names(net.state_dict());
  CHECK(state.size() == 16);
  CHECK(state[2] == "layer1.0.conv1.weight");
  CHECK(state[5] == "layer1.0.bn1.running_mean");
  CHECK(state[7] == "layer1.0.bn1.num_batches_tracked");
  CHECK(net.parameters().size() == 10);
  CHECK(net.named_parameters(/*recurse=*/false).empty());
  CHECK(net.fc->named_parameters(false).size() == 2);

  std::vector<std::string> module_names;
  for (auto& [name, m] : net.named_modules()) module_names.push_back(name + ":" + m->type_name());
  CHECK(module_names == std::vector<std::string>{":TinyResNet", "conv1:Conv2d", "layer1:Sequential",
                                                 "layer1.0:BasicBlock", "layer1.0.conv1:Conv2d", "layer1.0.bn1:BatchNorm2d",
                                                 "layer1.1:BasicBlock", "layer1.1.conv1:Conv2d", "layer1.1.bn1:BatchNorm2d",
                                                 "pool:AdaptiveAvgPool2d", "fc:Linear"});
  CHECK(net.children().size() == 4);
  CHECK(net.tensor_at("layer1.1.bn1.running_var").same(
      std::static_pointer_cast<BasicBlock>((*net.layer1)[1])->bn1->running_var));
  CHECK_THROWS_WITH_AS(net.tensor_at("layer1.7.bn1.weight"), doctest::Contains("no submodule '7'"), Error);
}

TEST_CASE("state_dict's entries are detached handles of the model's tensors: edited in place, the model changes") {
  nn::Linear lin(2, 2);
  const NamedTensors state = lin.state_dict();
  CHECK_FALSE(state[0].second.requires_grad());  // as PyTorch's: a leaf that requires grad refuses mul_
  CHECK(state[0].second.storage() == lin.weight.storage());
  const std::vector<double> before = values(lin.weight);
  Tensor(state[0].second).mul_(2.0);
  for (size_t k = 0; k < before.size(); ++k) CHECK(values(lin.weight)[k] == 2 * before[k]);
  CHECK(lin.weight.requires_grad());
  // A slot registered without a tensor (a Linear without a bias) is an error at tensor_at, not an undefined tensor.
  nn::Linear no_bias(2, 2, /*bias=*/false);
  CHECK_THROWS_WITH_AS(no_bias.tensor_at("bias"), doctest::Contains("Linear's 'bias' is registered but holds no tensor"),
                       Error);
}

TEST_CASE("registration refuses empty, dotted and duplicate names and non-leaf parameters") {
  nn::Module m;
  m.register_parameter("w", zeros({2}));
  CHECK_THROWS_WITH_AS(m.register_parameter("w", zeros({2})), doctest::Contains("already registered"), Error);
  CHECK_THROWS_WITH_AS(m.register_buffer("w", zeros({2})), doctest::Contains("already registered"), Error);
  CHECK_THROWS_WITH_AS(m.register_module("w", std::make_shared<nn::ReLU>()), doctest::Contains("already registered"),
                       Error);
  CHECK_THROWS_WITH_AS(m.register_parameter("a.b", zeros({2})), doctest::Contains("contains a '.'"), Error);
  CHECK_THROWS_WITH_AS(m.register_parameter("", zeros({2})), doctest::Contains("empty"), Error);
  Tensor leaf = ones({2}).requires_grad_();
  CHECK_THROWS_WITH_AS(m.register_parameter("y", leaf * 2), doctest::Contains("leaf"), Error);
  CHECK(m.named_parameters()[0].second.requires_grad());
  Tensor& frozen = m.register_parameter("frozen", zeros({2}), /*requires_grad=*/false);
  CHECK_FALSE(frozen.requires_grad());
}

TEST_CASE("a layer's member tensors and its registry are the same slots") {
  nn::Linear lin(3, 2);
  CHECK(lin.weight.same(lin.named_parameters()[0].second));
  // Assigning the member replaces the registered parameter too...
  Tensor replacement = zeros({2, 3}).requires_grad_();
  lin.weight = replacement;
  CHECK(lin.named_parameters()[0].second.same(replacement));
  // ...and conversion writes the member.
  lin.to(kFloat64);
  CHECK(lin.weight.dtype() == kFloat64);
  CHECK(lin.weight.same(lin.named_parameters()[0].second));
  CHECK(lin.bias.same(lin.tensor_at("bias")));
  nn::Linear no_bias(3, 2, /*bias=*/false);
  CHECK_FALSE(no_bias.bias.defined());
  CHECK(names(no_bias.named_parameters()) == std::vector<std::string>{"weight"});
}

TEST_CASE("train() and eval() reach every descendant") {
  TinyResNet net;
  for (nn::Module* m : net.modules()) CHECK(m->is_training());
  net.eval();
  for (nn::Module* m : net.modules()) CHECK_FALSE(m->is_training());
  net.layer1->train();
  CHECK_FALSE(net.is_training());
  CHECK(net.layer1->is_training());
  CHECK((*net.layer1)[0]->is_training());
  CHECK(std::static_pointer_cast<BasicBlock>((*net.layer1)[1])->bn1->is_training());
}

TEST_CASE("apply visits every module, parents before children") {
  TinyResNet net;
  std::vector<std::string> seen;
  net.apply([&](nn::Module& m) { seen.push_back(m.type_name()); });
  CHECK(seen.size() == 11);
  CHECK(seen.front() == "TinyResNet");
  CHECK(seen[2] == "Sequential");
  CHECK(seen[3] == "BasicBlock");
}

// ---------------------------------------------------------------------------------------------------------
// Conversion

TEST_CASE("a module registered twice is listed and visited once, nn::Sequential still runs each entry") {
  auto linear = std::make_shared<nn::Linear>(2, 2, false);
  auto seq = nn::sequential({linear, linear});
  std::vector<std::string> names;
  for (const auto& [name, m] : seq->named_modules()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"", "0"});
  CHECK(seq->children().size() == 1);
  CHECK(seq->named_children().size() == 1);
  CHECK(seq->size() == 2);
  const std::vector<double> before = values(linear->weight);
  seq->apply([](nn::Module& m) {
    if (auto* l = dynamic_cast<nn::Linear*>(&m)) {
      NoGradGuard no_grad;
      l->weight.mul_(2.0);
    }
  });
  const std::vector<double> after = values(linear->weight);
  for (size_t i = 0; i < before.size(); ++i) CHECK(after[i] == 2 * before[i]);  // once, not once per parent slot
  const Tensor x = randn({3, 2});
  check_close(values(seq->forward(x)), values(linear->forward(linear->forward(x))), 0);  // both entries run
  // Under two parents: once overall, where PyTorch's apply visits it once per parent.
  auto top = nn::sequential({nn::sequential({linear}), nn::sequential({linear})});
  names.clear();
  for (const auto& [name, m] : top->named_modules()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"", "0", "0.0", "1"});
}

TEST_CASE("replace_module puts a new submodule where the old one was registered, as PyTorch's model.fc = ...") {
  auto model = models::resnet18();
  model->fc = model->replace_module("fc", std::make_shared<nn::Linear>(512, 100));
  CHECK(model->forward(randn({2, 3, 32, 32})).shape() == Shape{2, 100});
  CHECK(model->tensor_at("fc.weight").shape() == Shape{100, 512});
  CHECK(model->named_parameters().back().second.shape() == Shape{100});  // fc.bias, the new one
  model->to(kFloat64);
  CHECK(model->fc->weight.dtype() == kFloat64);  // the registry reaches it
  model->eval();
  CHECK_FALSE(model->fc->is_training());
  const std::string missing = error_of([&] { model->replace_module("head", std::make_shared<nn::Linear>(512, 10)); });
  CHECK(contains(missing, "ResNet: replace_module: no submodule is registered as 'head' (its submodules: conv1, bn1, "));
  CHECK(contains(missing, ", avgpool, fc)"));
  CHECK(contains(error_of([&] { model->replace_module("fc", std::shared_ptr<nn::Linear>()); }),
                 "replace_module: 'fc' is null"));
}

TEST_CASE("to(dtype) converts floating parameters and buffers, keeps requires_grad, grads and int buffers") {
  TinyResNet net;
  Tensor x = randn({2, 3, 4, 4});
  net.forward(x).sum().backward();
  Tensor old_weight = net.fc->weight;
  std::vector<double> old_values = values(old_weight);

  net.to(kFloat64);
  for (auto& [name, p] : net.named_parameters()) {
    CAPTURE(name);
    CHECK(p.dtype() == kFloat64);
    CHECK(p.requires_grad());
    CHECK(p.is_leaf());
    REQUIRE(p.grad().defined());
    CHECK(p.grad().dtype() == kFloat64);
  }
  CHECK(values(net.fc->weight) == old_values);
  CHECK_FALSE(net.fc->weight.same(old_weight));  // a new tensor: the old one (an optimizer's) is untouched
  CHECK(old_weight.dtype() == kFloat32);
  auto bn = std::static_pointer_cast<BasicBlock>((*net.layer1)[0])->bn1;
  CHECK(bn->running_mean.dtype() == kFloat64);
  CHECK(bn->num_batches_tracked.dtype() == kInt64);  // not floating: left alone

  // Already in the target dtype: nothing changes, not even the tensor objects.
  Tensor same_weight = net.fc->weight;
  net.to(kFloat64);
  CHECK(net.fc->weight.same(same_weight));
  CHECK_THROWS_WITH_AS(net.to(kInt32), doctest::Contains("floating"), Error);

  // The converted model still runs, in float64.
  CHECK(net.forward(x.to(kFloat64)).dtype() == kFloat64);
}

TEST_CASE("to(MemoryFormat::ChannelsLast) lays out the 4-D floating tensors NHWC with their gradients, and back") {
  TinyResNet net;
  Tensor x = randn({2, 3, 4, 4});
  net.forward(x).sum().backward();
  const Tensor old_conv = net.conv1->weight, old_fc = net.fc->weight;
  const std::vector<double> conv_values = values(old_conv), conv_grad = values(old_conv.grad());

  net.to(MemoryFormat::ChannelsLast);
  for (auto& [name, p] : net.named_parameters()) {
    CAPTURE(name);
    CHECK(p.requires_grad());
    CHECK(p.is_leaf());
    REQUIRE(p.grad().defined());
    const bool nhwc = p.dim() == 4;
    CHECK(is_channels_last(p) == nhwc);
    CHECK(p.is_contiguous() != nhwc);  // 3 x 3 kernels: NHWC and NCHW differ
    CHECK(is_channels_last(p.grad()) == nhwc);
  }
  CHECK(values(net.conv1->weight) == conv_values);  // the same values in another order in memory
  CHECK(values(net.conv1->weight.grad()) == conv_grad);
  CHECK_FALSE(net.conv1->weight.same(old_conv));  // a new tensor, as to(dtype) makes
  CHECK(old_conv.is_contiguous());
  CHECK(net.fc->weight.same(old_fc));  // 2-D: left alone

  // to(dtype) keeps the layout; already channels_last, nothing is replaced.
  net.to(kFloat64);
  CHECK(is_channels_last(net.conv1->weight));
  CHECK_FALSE(net.conv1->weight.is_contiguous());
  Tensor same = net.conv1->weight;
  net.to(MemoryFormat::ChannelsLast);
  CHECK(net.conv1->weight.same(same));

  // The model computes what it computed, on NCHW and on NHWC inputs.
  TinyResNet reference;
  reference.to(kFloat64);
  reference.load_state_dict(net.state_dict());
  reference.eval();
  net.eval();
  const Tensor x64 = x.to(kFloat64);
  CHECK(values(net.forward(x64)) == values(reference.forward(x64)));
  CHECK(values(net.forward(contiguous_channels_last(x64))) == values(reference.forward(x64)));

  net.to(MemoryFormat::Contiguous);
  for (auto& [name, p] : net.named_parameters()) CHECK_MESSAGE(p.is_contiguous(), name);
  CHECK(values(net.conv1->weight) == conv_values);
}

TEST_CASE("to(MemoryFormat::AlignedRows) lays out the 2-D floating tensors with their gradients, saved as values") {
  manual_seed(16);
  nn::Linear fc(7, 5);
  const Tensor x = randn({3, 7});
  fc.forward(x).sum().backward();
  const std::vector<double> weight = values(fc.weight), weight_grad = values(fc.weight.grad());
  const Tensor old_bias = fc.bias;

  fc.to(MemoryFormat::AlignedRows);
  CHECK(is_aligned_rows(fc.weight));
  CHECK((fc.weight.is_leaf() && fc.weight.requires_grad()));
  CHECK(is_aligned_rows(fc.weight.grad()));
  CHECK(values(fc.weight) == weight);
  CHECK(values(fc.weight.grad()) == weight_grad);
  CHECK(fc.bias.same(old_bias));  // 1-D: left alone
  const Tensor same = fc.weight;
  fc.to(MemoryFormat::AlignedRows);
  CHECK(fc.weight.same(same));  // already laid out: nothing replaced

  // to(dtype) keeps the layout, at float64's extents; the layer computes what it computed.
  fc.to(kFloat64);
  CHECK(is_aligned_rows(fc.weight));
  CHECK(fc.weight.stride(0) == 8);
  nn::Linear reference(7, 5);
  reference.to(kFloat64);
  reference.load_state_dict(fc.state_dict());
  CHECK(reference.weight.is_contiguous());
  CHECK(values(fc.forward(x.to(kFloat64))) == values(reference.forward(x.to(kFloat64))));

  // A checkpoint holds the values; loading copies them into an aligned weight, which stays aligned.
  testing::TempDir dir;
  const std::string path = (dir.path / "fc.safetensors").string();
  nn::save(fc, path);
  nn::Linear loaded(7, 5);
  loaded.to(kFloat64);
  loaded.to(MemoryFormat::AlignedRows);
  nn::load(loaded, path);
  CHECK(is_aligned_rows(loaded.weight));
  CHECK(values(loaded.weight) == values(fc.weight));

  fc.to(MemoryFormat::Contiguous);
  CHECK(fc.weight.is_contiguous());
  CHECK(values(fc.weight) == values(reference.weight));
}

TEST_CASE("LanguageModel::align_decoder lays out the decoder weight on CUDA only, and not when it is tied") {
  models::LanguageModel lm(30, {.embedding_size = 6, .hidden_size = 6, .num_layers = 1});
  lm.align_decoder();
  CHECK(lm.decoder->weight.is_contiguous());  // the CPU's fused op reads it densely
  if (!cuda::is_available()) return;
  lm.to(Device::cuda());
  lm.align_decoder();
  CHECK(is_aligned_rows(lm.decoder->weight));
  models::LanguageModel tied(30, {.embedding_size = 6, .hidden_size = 6, .num_layers = 1, .tie_weights = true});
  tied.to(Device::cuda());
  tied.align_decoder();
  CHECK(tied.decoder->weight.same(tied.encoder->weight));
  CHECK(tied.decoder->weight.is_contiguous());
}

TEST_CASE("to(dtype, select) converts only the modules chosen: the model in half except BatchNorm") {
  TinyResNet net;
  net.to(kFloat16, [](const nn::Module& m) { return !dynamic_cast<const nn::BatchNorm2d*>(&m); });
  for (auto& [name, t] : net.state_dict()) {
    CAPTURE(name);
    if (name.find("bn1.num_batches_tracked") != std::string::npos) CHECK(t.dtype() == kInt64);
    else if (name.find("bn1") != std::string::npos) CHECK(t.dtype() == kFloat32);
    else CHECK(t.dtype() == kFloat16);
  }
}

namespace {
// The output layer reuses the embedding matrix, as language models do.
struct Tied : nn::Module {
  std::shared_ptr<nn::Embedding> emb = register_module("emb", std::make_shared<nn::Embedding>(10, 4));
  std::shared_ptr<nn::Linear> out = register_module("out", std::make_shared<nn::Linear>(4, 10, false));
  Tied() { out->weight = emb->weight; }
};
}  // namespace

TEST_CASE("tied weights are listed once and stay tied through to()") {
  Tied m;
  CHECK(names(m.named_parameters()) == std::vector<std::string>{"emb.weight"});
  CHECK(names(m.state_dict()) == std::vector<std::string>{"emb.weight", "out.weight"});
  m.to(kFloat64);
  CHECK(m.emb->weight.dtype() == kFloat64);
  CHECK(m.out->weight.same(m.emb->weight));
  // Converting only one of the two owners converts the tensor for both: the tie holds, and the model still lists
  // one parameter, whichever owner is chosen.
  for (bool choose_embedding : {true, false}) {
    CAPTURE(choose_embedding);
    Tied half;
    half.to(kFloat16, [&](const nn::Module& owner) {
      return choose_embedding ? dynamic_cast<const nn::Embedding*>(&owner) != nullptr
                              : dynamic_cast<const nn::Linear*>(&owner) != nullptr;
    });
    CHECK(half.emb->weight.dtype() == kFloat16);
    CHECK(half.out->weight.same(half.emb->weight));
    CHECK(half.parameters().size() == 1);
  }
}

TEST_CASE("load_state_dict refuses two different values for one tied tensor, and takes equal ones") {
  Tied m;
  const Tensor before = m.emb->weight.clone();
  const Tensor a = randn({10, 4}), b = randn({10, 4});
  CHECK_THROWS_WITH_AS(m.load_state_dict({{"emb.weight", a}, {"out.weight", b}}),
                       doctest::Contains("'emb.weight' and 'out.weight' are one tensor in the model (tied), but the "
                                         "state gives them different values"), Error);
  CHECK(bit_equal(m.emb->weight, before));  // nothing was loaded
  m.load_state_dict({{"emb.weight", a}, {"out.weight", a.clone()}});
  CHECK(bit_equal(m.out->weight, a));
}

TEST_CASE("load_state_dict takes a state without a BatchNorm2d's num_batches_tracked, which keeps its count (as "
          "PyTorch's), and nothing else may be left out") {
  manual_seed(11);
  auto make = [] {
    return nn::sequential({std::make_shared<nn::Conv2d>(3, 4, 3), std::make_shared<nn::BatchNorm2d>(4)});
  };
  auto dst = make(), src = make();
  auto* bn = dynamic_cast<nn::BatchNorm2d*>(dst->registered_children()[1].second.get());
  REQUIRE(bn != nullptr);
  dst->forward(randn({2, 3, 5, 5}));  // one training batch: dst's count is 1
  NamedTensors state;
  for (const auto& [name, t] : src->state_dict())
    if (name != "1.num_batches_tracked") state.emplace_back(name, t + 1);  // every other tensor is floating
  const nn::LoadResult loaded = dst->load_state_dict(state);
  CHECK(loaded.missing_keys.empty());
  CHECK(bn->num_batches_tracked.item<int64_t>() == 1);
  CHECK(bit_equal(bn->running_var, src->tensor_at("1.running_var") + 1));
  // non-strict: not reported missing either; the running mean may not be left out
  CHECK(dst->load_state_dict(state, {.strict = false}).missing_keys.empty());
  NamedTensors without_mean;
  for (const auto& [name, t] : state)
    if (name != "1.running_mean") without_mean.emplace_back(name, t);
  CHECK_THROWS_WITH_AS(dst->load_state_dict(without_mean),
                       doctest::Contains("missing from the state (1): 1.running_mean"), Error);
}

TEST_CASE("zero_grad forgets every parameter's gradient") {
  nn::Linear lin(3, 2);
  lin.forward(randn({4, 3})).sum().backward();
  CHECK(lin.weight.grad().defined());
  CHECK(lin.bias.grad().defined());
  lin.zero_grad();
  CHECK_FALSE(lin.weight.grad().defined());
  CHECK_FALSE(lin.bias.grad().defined());
}

// ---------------------------------------------------------------------------------------------------------
// Sequential and forward

TEST_CASE("Sequential runs its children in order and names them by position") {
  manual_seed(1);
  auto l1 = std::make_shared<nn::Linear>(4, 8);
  auto l2 = std::make_shared<nn::Linear>(8, 3);
  auto seq = nn::sequential({l1, std::make_shared<nn::ReLU>(), l2});
  CHECK(seq->size() == 3);
  CHECK((*seq)[2] == l2);
  CHECK(names(seq->named_parameters()) == std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});
  Tensor x = randn({5, 4});
  Tensor expected = linear(relu(linear(x, l1->weight, l1->bias)), l2->weight, l2->bias);
  CHECK(bit_equal((*seq)(x), expected));
  seq->push_back(std::make_shared<nn::Identity>());
  CHECK(seq->named_children().back().first == "3");
  CHECK_THROWS_WITH_AS((*seq)[4], doctest::Contains("out of range"), Error);

  // Gradients reach every parameter through the chain.
  seq->forward(x).sum().backward();
  for (auto& [name, p] : seq->named_parameters()) CHECK_MESSAGE(p.grad().defined(), name);

  // A module without a single-tensor forward says so.
  nn::Module plain;
  CHECK_THROWS_WITH_AS(plain.forward(x), doctest::Contains("no forward"), Error);
}

// ---------------------------------------------------------------------------------------------------------
// Each layer against its functional op

TEST_CASE("layers compute what their functional ops compute") {
  manual_seed(2);
  Tensor image = randn({2, 4, 7, 7});  // (N, C, H, W)

  SUBCASE("Linear") {
    nn::Linear lin(7, 5);
    CHECK(bit_equal(lin.forward(image), linear(image, lin.weight, lin.bias)));
  }
  SUBCASE("Conv2d with stride, padding, dilation and groups") {
    const Conv2dOptions o{.stride = {2, 1}, .padding = {1, 2}, .dilation = {1, 2}, .groups = 2};
    nn::Conv2d conv(4, 6, Pair2d{3, 2},
                    {.stride = o.stride, .padding = o.padding, .dilation = o.dilation, .groups = o.groups});
    CHECK(conv.weight.shape() == Shape{6, 2, 3, 2});
    CHECK(bit_equal(conv.forward(image), conv2d(image, conv.weight, conv.bias, o)));
    nn::Conv2d no_bias(4, 6, 3, {}, false);
    CHECK(bit_equal(no_bias.forward(image), conv2d(image, no_bias.weight)));
  }
  SUBCASE("Conv2d's padding_mode pads the input with pad() and convolves it without padding, as PyTorch's") {
    for (PadMode mode : {PadMode::Reflect, PadMode::Replicate, PadMode::Circular}) {
      CAPTURE(std::string(pad_mode_name(mode)));
      nn::Conv2d conv(4, 3, 3, {.stride = {2, 1}, .padding = {1, 2}, .padding_mode = mode});
      CHECK(conv.forward(image).shape() == Shape{2, 3, 4, 9});
      CHECK(bit_equal(conv.forward(image),
                      conv2d(pad(image, {2, 2, 1, 1}, mode), conv.weight, conv.bias, {.stride = {2, 1}})));
    }
  }
  SUBCASE("Conv2d's padding \"same\": the input's size, the odd element after, in zeros or a padding_mode") {
    nn::Conv2d odd(4, 3, 3, {.padding_same = true});  // 1 on each side: conv2d's own
    CHECK(bit_equal(odd.forward(image), conv2d(image, odd.weight, odd.bias, {.padding = {1, 1}})));
    nn::Conv2d even(4, 3, Pair2d{4, 2}, {.dilation = {1, 3}, .padding_same = true});  // (1, 2) rows, (1, 2) columns
    CHECK(even.forward(image).shape() == Shape{2, 3, 7, 7});
    CHECK(bit_equal(even.forward(image), conv2d(pad(image, {0, 1, 0, 1}), even.weight, even.bias,
                                                {.padding = {1, 1}, .dilation = {1, 3}})));
    nn::Conv2d reflect(4, 3, 4, {.padding_mode = PadMode::Reflect, .padding_same = true});
    CHECK(bit_equal(reflect.forward(image),
                    conv2d(pad(image, {1, 2, 1, 2}, PadMode::Reflect), reflect.weight, reflect.bias)));
    // In a Sequential whose BatchNorm2d takes the convolution's bias, the padding is the same.
    const nn::Conv2dOptions circular{.padding = {1, 1}, .padding_mode = PadMode::Circular};
    auto seq = nn::sequential({std::make_shared<nn::Conv2d>(4, 3, 3, circular), std::make_shared<nn::BatchNorm2d>(3)});
    const auto* c = dynamic_cast<const nn::Conv2d*>(seq->registered_children()[0].second.get());
    auto* bn = dynamic_cast<nn::BatchNorm2d*>(seq->registered_children()[1].second.get());
    const Tensor want = batch_norm(conv2d(pad(image, {1, 1, 1, 1}, PadMode::Circular), c->weight, c->bias),
                                   bn->running_mean.clone(), bn->running_var.clone(), bn->weight, bn->bias, true);
    check_close(values(seq->forward(image)), values(want), 1e-5);
  }
  SUBCASE("the padding layers are pad() with their padding, in PyTorch's names") {
    CHECK(bit_equal(nn::ReflectionPad2d(2).forward(image), pad(image, {2, 2, 2, 2}, PadMode::Reflect)));
    const Tensor rows = image.select(0, 0);  // [4, 7, 7]: a batch of 4 of 7 channels of 7
    CHECK(bit_equal(nn::ReplicationPad1d({1, 3}).forward(rows), pad(rows, {1, 3}, PadMode::Replicate)));
    CHECK(bit_equal(nn::ZeroPad2d({1, 1, 2, 0}).forward(image), pad(image, {1, 1, 2, 0})));
    CHECK(bit_equal(nn::ConstantPad3d(1, 3.5).forward(image), pad(image, {1, 1, 1, 1, 1, 1}, PadMode::Constant, 3.5)));
    CHECK(bit_equal(nn::CircularPad2d({1, 0, 0, 2}).forward(image), pad(image, {1, 0, 0, 2}, PadMode::Circular)));
    CHECK(nn::ReflectionPad2d(2).repr() == "ReflectionPad2d((2, 2, 2, 2))");
    CHECK(nn::ZeroPad2d({1, 1, 2, 0}).repr() == "ZeroPad2d((1, 1, 2, 0))");
    CHECK(nn::ConstantPad1d(1, 3.5).repr() == "ConstantPad1d(padding=(1, 1), value=3.5)");
    CHECK(nn::ConstantPad2d(1, 3).repr() == "ConstantPad2d(padding=(1, 1, 1, 1), value=3.0)");  // a Python float
    CHECK(nn::ReplicationPad3d(1).parameters().empty());
    CHECK_THROWS_WITH_AS(nn::ReflectionPad2d(7).forward(image),
                         doctest::Contains("pad: reflect padding (7, 7) of dim 3 of float32[2, 4, 7, 7] cpu must be "
                                           "less than its size, 7"),
                         Error);
  }
  SUBCASE("ReLU, Flatten, Identity") {
    CHECK(bit_equal(nn::ReLU().forward(image), relu(image)));
    CHECK(nn::Flatten().forward(image).shape() == Shape{2, 4 * 7 * 7});
    CHECK(nn::Flatten(2, 3).forward(image).shape() == Shape{2, 4, 49});
    CHECK(nn::Identity().forward(image).same(image));
  }
  SUBCASE("pooling") {
    MaxPool2dOptions mo{.stride = {2, 2}, .padding = {1, 1}};
    CHECK(bit_equal(nn::MaxPool2d(3, mo).forward(image), max_pool2d(image, {3, 3}, mo)));
    AvgPool2dOptions ao{.padding = {1, 1}, .count_include_pad = false};
    CHECK(bit_equal(nn::AvgPool2d(Pair2d{2, 3}, ao).forward(image), avg_pool2d(image, {2, 3}, ao)));
    CHECK(bit_equal(nn::AdaptiveAvgPool2d(Pair2d{3, 2}).forward(image), adaptive_avg_pool2d(image, {3, 2})));
    CHECK(nn::AdaptiveAvgPool2d(1).forward(image).shape() == Shape{2, 4, 1, 1});
  }
  SUBCASE("Dropout: the seeded op in training, the identity in eval") {
    nn::Dropout drop(0.3);
    manual_seed(5);
    Tensor a = drop.forward(image);
    manual_seed(5);
    CHECK(bit_equal(a, dropout(image, 0.3, true)));
    CHECK(values(a) != values(image));
    drop.eval();
    CHECK(bit_equal(drop.forward(image), image));
    CHECK_THROWS_AS(nn::Dropout(1.5), Error);
  }
  SUBCASE("Embedding, with a padding row that starts at zero") {
    nn::Embedding emb(10, 3, /*padding_idx=*/-1);
    CHECK(emb.padding_idx == 9);
    CHECK(values(emb.weight[9]) == std::vector<double>{0, 0, 0});
    Tensor idx = tensor(std::vector<int64_t>{1, 9, 4, 1}, Shape{2, 2});
    CHECK(bit_equal(emb.forward(idx), embedding(idx, emb.weight, 9)));
    CHECK(emb.forward(idx).shape() == Shape{2, 2, 3});
  }
  SUBCASE("BatchNorm2d in training and eval") {
    nn::BatchNorm2d bn(4);
    {
      NoGradGuard no_grad;
      bn.weight.copy_(tensor(std::vector<float>{1, 2, 3, 4}));
      bn.bias.copy_(tensor(std::vector<float>{0, -1, 1, 0.5}));
    }
    Tensor mean = zeros({4}), var = ones({4});
    Tensor expected = batch_norm(image, mean, var, bn.weight, bn.bias, true, 0.1, 1e-5);
    CHECK(bit_equal(bn.forward(image), expected));
    CHECK(bit_equal(bn.running_mean, mean));
    CHECK(bit_equal(bn.running_var, var));
    bn.eval();
    CHECK(bit_equal(bn.forward(image), batch_norm(image, mean, var, bn.weight, bn.bias, false, 0.1, 1e-5)));
  }
}

// ---------------------------------------------------------------------------------------------------------
// BatchNorm2d's running statistics, by hand

TEST_CASE("BatchNorm2d updates running_mean/var with momentum and counts batches") {
  // One channel, values 1..8 over (N=2, H=2, W=2): mean 4.5, unbiased variance 6.
  Tensor x = arange(1, 9, 1, {.dtype = kFloat32}).view({2, 1, 2, 2});
  nn::BatchNorm2d bn(1);
  bn.forward(x);
  CHECK(values(bn.running_mean)[0] == doctest::Approx(0.9 * 0 + 0.1 * 4.5));
  CHECK(values(bn.running_var)[0] == doctest::Approx(0.9 * 1 + 0.1 * 6.0));
  CHECK(bn.num_batches_tracked.item<int64_t>() == 1);
  bn.forward(x + 1.0);  // mean 5.5, variance 6
  CHECK(values(bn.running_mean)[0] == doctest::Approx(0.9 * 0.45 + 0.1 * 5.5));
  CHECK(values(bn.running_var)[0] == doctest::Approx(0.9 * 1.5 + 0.1 * 6.0));
  CHECK(bn.num_batches_tracked.item<int64_t>() == 2);

  // Eval: normalise with the running statistics, which stay as they are.
  bn.eval();
  double rm = values(bn.running_mean)[0], rv = values(bn.running_var)[0];
  Tensor y = bn.forward(x);
  CHECK(values(y)[0] == doctest::Approx((1 - rm) / std::sqrt(rv + 1e-5)).epsilon(1e-5));
  CHECK(values(bn.running_mean)[0] == rm);
  CHECK(bn.num_batches_tracked.item<int64_t>() == 2);

  bn.reset_running_stats();
  CHECK(values(bn.running_mean)[0] == 0);
  CHECK(values(bn.running_var)[0] == 1);
  CHECK(bn.num_batches_tracked.item<int64_t>() == 0);
}

TEST_CASE("BatchNorm2d with momentum = nullopt keeps a cumulative average of the batch statistics") {
  Tensor x = arange(1, 9, 1, {.dtype = kFloat32}).view({2, 1, 2, 2});
  nn::BatchNorm2d bn(1, {.momentum = std::nullopt});
  bn.forward(x);          // mean 4.5
  bn.forward(x + 3.0);    // mean 7.5
  bn.forward(x - 3.0);    // mean 1.5
  CHECK(values(bn.running_mean)[0] == doctest::Approx((4.5 + 7.5 + 1.5) / 3));
  CHECK(values(bn.running_var)[0] == doctest::Approx(6.0));
}

TEST_CASE("BatchNorm2d without running stats or affine parameters") {
  Tensor x = randn({3, 2, 4, 4});
  nn::BatchNorm2d bn(2, {.affine = false, .track_running_stats = false});
  CHECK(bn.parameters().empty());
  CHECK(bn.buffers().empty());
  bn.eval();  // no running stats: batch statistics even in eval, as PyTorch
  CHECK(bit_equal(bn.forward(x), batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true)));
}

TEST_CASE("BatchNorm2d takes float16 activations with float32 parameters (O2's BatchNorm)") {
  nn::BatchNorm2d bn(2);
  Tensor x = randn({4, 2, 3, 3});
  Tensor y = bn.forward(x.to(kFloat16));
  CHECK(y.dtype() == kFloat16);
  CHECK(bn.running_mean.dtype() == kFloat32);
  CHECK(bn.num_batches_tracked.item<int64_t>() == 1);
}

// ---------------------------------------------------------------------------------------------------------
// Initialisation

TEST_CASE("Linear and Conv2d default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias") {
  manual_seed(0);
  nn::Linear lin(400, 300);
  double bound = 1.0 / std::sqrt(400.0);  // kaiming_uniform(a = sqrt(5)) reduces to this
  std::vector<double> w = values(lin.weight);
  double sum = 0, sq = 0, lo = 1, hi = -1;
  for (double v : w) {
    sum += v, sq += v * v;
    lo = std::min(lo, v), hi = std::max(hi, v);
  }
  double mean = sum / double(w.size()), var = sq / double(w.size()) - mean * mean;
  CHECK(lo >= -bound);
  CHECK(hi <= bound);
  CHECK(hi > 0.99 * bound);  // 120000 draws: the extremes come close to the bound
  CHECK(lo < -0.99 * bound);
  CHECK(std::abs(mean) < 0.01 * bound);           // std of the mean: bound / sqrt(3 * 120000) ~ 0.0017 bound
  CHECK(var == doctest::Approx(bound * bound / 3).epsilon(0.02));  // uniform variance b^2 / 3
  for (double v : values(lin.bias)) CHECK(std::abs(v) <= bound);

  nn::Conv2d conv(16, 32, 3);  // fan_in = 16 * 3 * 3
  double conv_bound = 1.0 / std::sqrt(16.0 * 9);
  for (double v : values(conv.weight)) CHECK(std::abs(v) <= conv_bound);
  for (double v : values(conv.bias)) CHECK(std::abs(v) <= conv_bound);
  CHECK(values(conv.weight.abs().max())[0] > 0.95 * conv_bound);
}

TEST_CASE("default init is reproducible under manual_seed") {
  manual_seed(42);
  nn::Linear a(10, 10);
  nn::Embedding ea(5, 4);
  manual_seed(42);
  nn::Linear b(10, 10);
  nn::Embedding eb(5, 4);
  CHECK(bit_equal(a.weight, b.weight));
  CHECK(bit_equal(a.bias, b.bias));
  CHECK(bit_equal(ea.weight, eb.weight));
  nn::Linear c(10, 10);
  CHECK_FALSE(bit_equal(a.weight, c.weight));
}

TEST_CASE("BatchNorm2d starts at weight 1, bias 0, mean 0, var 1, Embedding at N(0, 1)") {
  nn::BatchNorm2d bn(3);
  CHECK(values(bn.weight) == std::vector<double>{1, 1, 1});
  CHECK(values(bn.bias) == std::vector<double>{0, 0, 0});
  CHECK(values(bn.running_mean) == std::vector<double>{0, 0, 0});
  CHECK(values(bn.running_var) == std::vector<double>{1, 1, 1});
  CHECK(bn.num_batches_tracked.dim() == 0);
  CHECK(bn.num_batches_tracked.item<int64_t>() == 0);

  manual_seed(3);
  nn::Embedding emb(1000, 100);
  std::vector<double> w = values(emb.weight);
  double sum = 0, sq = 0;
  for (double v : w) sum += v, sq += v * v;
  double mean = sum / double(w.size()), var = sq / double(w.size()) - mean * mean;
  CHECK(std::abs(mean) < 0.01);  // std of the mean of 1e5 draws: 0.003
  CHECK(var == doctest::Approx(1.0).epsilon(0.02));
}

TEST_CASE("kaiming and xavier initialisers have the documented spread") {
  manual_seed(7);
  auto stats = [](const Tensor& t) {
    std::vector<double> v = values(t);
    double sum = 0, sq = 0, absmax = 0;
    for (double x : v) sum += x, sq += x * x, absmax = std::max(absmax, std::abs(x));
    double mean = sum / double(v.size());
    return std::tuple{mean, std::sqrt(sq / double(v.size()) - mean * mean), absmax};
  };
  Tensor w = empty({256, 128, 3, 3});  // fan_in 1152, fan_out 2304
  double fan_in = 128 * 9, fan_out = 256 * 9;

  nn::init::kaiming_normal_(w, 0, nn::init::FanMode::FanIn, nn::init::Nonlinearity::ReLU);
  auto [m1, s1, a1] = stats(w);
  CHECK(s1 == doctest::Approx(std::sqrt(2.0 / fan_in)).epsilon(0.01));
  CHECK(std::abs(m1) < 0.01 * s1);  // std of the mean of 295k draws: s / 543

  nn::init::kaiming_normal_(w, 0, nn::init::FanMode::FanOut, nn::init::Nonlinearity::ReLU);
  auto [m2, s2, a2] = stats(w);
  CHECK(s2 == doctest::Approx(std::sqrt(2.0 / fan_out)).epsilon(0.01));

  nn::init::kaiming_uniform_(w, 0, nn::init::FanMode::FanIn, nn::init::Nonlinearity::ReLU);
  auto [m3, s3, a3] = stats(w);
  CHECK(a3 <= std::sqrt(6.0 / fan_in));
  CHECK(s3 == doctest::Approx(std::sqrt(2.0 / fan_in)).epsilon(0.01));

  nn::init::xavier_uniform_(w, 2.0);
  auto [m4, s4, a4] = stats(w);
  CHECK(a4 <= 2.0 * std::sqrt(6.0 / (fan_in + fan_out)));
  CHECK(a4 > 0.99 * 2.0 * std::sqrt(6.0 / (fan_in + fan_out)));

  nn::init::xavier_normal_(w);
  auto [m5, s5, a5] = stats(w);
  CHECK(s5 == doctest::Approx(std::sqrt(2.0 / (fan_in + fan_out))).epsilon(0.01));

  CHECK(nn::init::calculate_gain(nn::init::Nonlinearity::Tanh) == doctest::Approx(5.0 / 3));
  CHECK(nn::init::calculate_gain(nn::init::Nonlinearity::LeakyReLU, std::sqrt(5.0)) == doctest::Approx(std::sqrt(1.0 / 3)));
  CHECK(nn::init::fan_in_and_fan_out(empty({5, 3})) == std::pair<int64_t, int64_t>{3, 5});
  Tensor vec = empty({5});
  CHECK_THROWS_WITH_AS(nn::init::xavier_uniform_(vec), doctest::Contains("2 dims"), Error);
  CHECK_THROWS_WITH_AS(nn::init::uniform_(vec, 1, 0), doctest::Contains("nn::init::uniform_: expected low <= high, a "
                                                                        "finite range, got low 1 and high 0"), Error);
  CHECK_THROWS_WITH_AS(nn::init::normal_(vec, 0, -1), doctest::Contains("nn::init::normal_: expected std >= 0, got -1"),
                       Error);
  CHECK_THROWS_WITH_AS(nn::init::uniform_(vec, -INFINITY, INFINITY), doctest::Contains("a finite range"), Error);
  // A half tensor's values stay in [low, high) (low as the dtype rounds it): rounded to the dtype, a draw can reach
  // high (float16 on [1, 2)).
  for (DType dt : {kBFloat16, kFloat16}) {
    for (const auto& [low, high] : {std::pair{0.0, 1.0}, std::pair{1.0, 2.0}, std::pair{0.9, 1.0}}) {
      Tensor half = empty({256, 256}, {.dtype = dt});
      nn::init::uniform_(half, low, high);
      const std::vector<double> v = values(half);
      CHECK(*std::max_element(v.begin(), v.end()) < high);
      CHECK(*std::min_element(v.begin(), v.end()) >= values(full({1}, low, {.dtype = dt}))[0]);
    }
  }
}

TEST_CASE("nn::init::uniform_ keeps float16 values below high as the dtype holds it, as PyTorch's kernel") {
  // 0.1 is 0.0999755859375 in float16: a draw that rounds to it is at high, and goes to low.
  Tensor h = empty({1 << 20}, {.dtype = kFloat16});
  manual_seed(3);
  nn::init::uniform_(h, -0.1, 0.1);
  CHECK(h.max().item<double>() < 0.0999755859375);
  CHECK(h.min().item<double>() >= -0.0999755859375);
}

TEST_CASE("nn::init::uniform_ refuses bounds past the dtype's range, which would draw infinities (as PyTorch)") {
  Tensor h = empty({6}, {.dtype = kFloat16});
  CHECK_THROWS_WITH_AS(nn::init::uniform_(h, -1e5, 1e5),
                       doctest::Contains("uniform_: low -100000 and high 100000, and the span between them, must lie "
                                         "within float16"), Error);
  CHECK_THROWS_AS(nn::init::uniform_(empty({2}, {.dtype = kBFloat16}), -1e39, 0), Error);
  // The span too, as PyTorch's to - from <= max: 131008 is past float16's 65504.
  CHECK_THROWS_WITH_AS(nn::init::uniform_(h, -65504, 65504), doctest::Contains("and the span between them"), Error);
  CHECK_THROWS_AS(nn::init::uniform_(empty({2}), -3e38, 3e38), Error);
  CHECK_NOTHROW(nn::init::uniform_(h, -30000, 30000));
}

TEST_CASE("initialisers fill parameters in place, without recording autograd, in any dtype") {
  nn::Linear lin(4, 3, true, {.dtype = kFloat64});
  CHECK(lin.weight.dtype() == kFloat64);
  Tensor before = lin.weight;
  nn::init::normal_(lin.weight, 0, 0.02);
  CHECK(lin.weight.same(before));
  CHECK(lin.weight.is_leaf());
  CHECK(lin.weight.requires_grad());
  nn::init::constant_(lin.bias, 0.5);
  CHECK(values(lin.bias) == std::vector<double>{0.5, 0.5, 0.5});
  Tensor h = empty({8, 8}, {.dtype = kBFloat16});
  nn::init::uniform_(h, -1, 1);
  for (double v : values(h)) CHECK(std::abs(v) <= 1.0);
  nn::init::zeros_(h);
  CHECK(values(h.abs().max())[0] == 0);
  nn::init::ones_(h);
  CHECK(values(h.min())[0] == 1);
}

TEST_CASE("initialisers take a view, as libtorch's take the tensor by value: they fill the part it sees") {
  Tensor w = zeros({4, 3});
  nn::init::constant_(w.narrow(0, 1, 2), 2.5);  // a temporary view: rows 1 and 2
  CHECK(values(w) == std::vector<double>{0, 0, 0, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5, 0, 0, 0});
  manual_seed(7);
  const Tensor returned = nn::init::uniform_(w.select(1, 0), 10, 11);  // column 0, strided
  CHECK(returned.storage() == w.storage());  // the view it was given, returned
  for (int64_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(w.select(0, r).select(0, 0).item<double>() >= 10);
    CHECK(w.select(0, r).select(0, 0).item<double>() < 11);
    CHECK(w.select(0, r).select(0, 1).item<double>() == (r == 1 || r == 2 ? 2.5 : 0));
  }
  CHECK(values(returned) == values(w.select(1, 0)));
}

// ---------------------------------------------------------------------------------------------------------
// Printing

TEST_CASE("repr prints the module tree like PyTorch") {
  auto seq = nn::sequential({std::make_shared<nn::Linear>(4, 8), std::make_shared<nn::ReLU>(),
                             nn::sequential({std::make_shared<nn::Dropout>(0.1), std::make_shared<nn::Linear>(8, 2, false)})});
  CHECK(seq->repr() ==
        "Sequential(\n"
        "  (0): Linear(in_features=4, out_features=8, bias=True)\n"
        "  (1): ReLU()\n"
        "  (2): Sequential(\n"
        "    (0): Dropout(p=0.1, inplace=False)\n"
        "    (1): Linear(in_features=8, out_features=2, bias=False)\n"
        "  )\n"
        ")");
  CHECK(nn::Conv2d(3, 16, 3, {.stride = {2, 2}, .padding = {1, 1}}, false).repr() ==
        "Conv2d(3, 16, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), bias=False)");
  CHECK(nn::Conv2d(3, 16, 4, {.padding_mode = PadMode::Reflect, .padding_same = true}).repr() ==
        "Conv2d(3, 16, kernel_size=(4, 4), stride=(1, 1), padding=same, padding_mode=reflect)");
  CHECK(nn::BatchNorm2d(16).repr() == "BatchNorm2d(16, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)");
  // Floats as Python prints them: "1.0", not "1"; the shortest digits that read back.
  CHECK(nn::BatchNorm2d(4, {.eps = 1e-3, .momentum = 1}).extra_repr() ==
        "4, eps=0.001, momentum=1.0, affine=True, track_running_stats=True");
  CHECK(nn::BatchNorm2d(4, {.momentum = std::nullopt}).extra_repr() ==
        "4, eps=1e-05, momentum=None, affine=True, track_running_stats=True");
  CHECK(nn::Dropout(0).repr() == "Dropout(p=0.0, inplace=False)");
  CHECK(nn::Dropout(1.0 / 3).repr() == "Dropout(p=0.3333333333333333, inplace=False)");
  // Pooling prints a square argument as PyTorch prints an int one.
  CHECK(nn::MaxPool2d(2).repr() == "MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)");
  CHECK(nn::AvgPool2d(Pair2d{2, 3}, {.padding = {1, 1}}).repr() ==
        "AvgPool2d(kernel_size=(2, 3), stride=(2, 3), padding=1)");
  CHECK(nn::AdaptiveAvgPool2d(1).repr() == "AdaptiveAvgPool2d(output_size=1)");
}

// ---------------------------------------------------------------------------------------------------------
// CUDA

TEST_CASE("to(cuda) moves a model, which computes what it computes on the CPU, and saves and loads from the GPU") {
  SKIP_WITHOUT_GPU();
  auto make = [] {
    manual_seed(8);
    return nn::sequential({std::make_shared<nn::Conv2d>(3, 8, 3, nn::Conv2dOptions{.padding = {1, 1}}),
                           std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2),
                           std::make_shared<nn::Conv2d>(8, 8, 3), std::make_shared<nn::AdaptiveAvgPool2d>(1),
                           std::make_shared<nn::Flatten>(), std::make_shared<nn::Dropout>(0.5),
                           std::make_shared<nn::Linear>(8, 4), std::make_shared<nn::BatchNorm2d>(4)});
  };
  auto cpu_net = make(), gpu_net = make();
  gpu_net->to(Device::cuda());
  for (auto& [name, t] : gpu_net->state_dict()) {
    CAPTURE(name);
    CHECK(t.is_cuda());
    CHECK(t.dtype() == cpu_net->tensor_at(name).dtype());  // the int64 num_batches_tracked moves too
    CHECK(values(t.cpu()) == values(cpu_net->tensor_at(name)));
  }
  for (auto& [name, p] : gpu_net->named_parameters()) CHECK_MESSAGE(p.requires_grad(), name);

  // Run all but the final BatchNorm2d (its own test follows), in eval so that dropout is the identity.
  cpu_net->eval();
  gpu_net->eval();
  auto run = [](nn::Sequential& net, Tensor x) {
    for (size_t i = 0; i + 1 < net.size(); ++i) x = net[i]->forward(x);
    return x;
  };
  Tensor x = randn({4, 3, 10, 10});
  Tensor y_cpu = run(*cpu_net, x), y_gpu = run(*gpu_net, x.cuda());
  CHECK(y_gpu.is_cuda());
  // float32 convolutions on the GPU may use TF32 (10-bit mantissa products): compare loosely.
  std::vector<double> a = values(y_cpu), b = values(y_gpu.cpu());
  for (size_t i = 0; i < a.size(); ++i) CHECK(b[i] == doctest::Approx(a[i]).epsilon(2e-2).scale(1));
  y_gpu.sum().backward();
  for (size_t i = 0; i + 1 < gpu_net->size(); ++i)
    for (auto& [name, p] : (*gpu_net)[i]->named_parameters()) {
      CAPTURE(name);
      REQUIRE(p.grad().defined());
      CHECK(p.grad().is_cuda());
    }

  // Checkpoints of a GPU model: saved from device memory, loaded into device memory.
  std::string path = (std::filesystem::temp_directory_path() / "halfgrad_test_nn_gpu.safetensors").string();
  nn::save(*gpu_net, path);
  manual_seed(77);
  auto back = make();
  back->to(Device::cuda());
  nn::load(*back, path);
  for (auto& [name, t] : gpu_net->state_dict()) {
    CAPTURE(name);
    CHECK(back->tensor_at(name).is_cuda());
    CHECK(values(back->tensor_at(name).cpu()) == values(t.cpu()));
  }
  std::filesystem::remove(path);
}

TEST_CASE("BatchNorm2d on the GPU normalises and updates its running statistics as on the CPU") {
  SKIP_WITHOUT_GPU();
  manual_seed(8);
  TinyResNet cpu_net, gpu_net;
  gpu_net.load_state_dict(cpu_net.state_dict());
  gpu_net.to(Device::cuda());
  Tensor x = randn({4, 3, 6, 6});
  Tensor y_cpu = cpu_net.forward(x), y_gpu = gpu_net.forward(x.cuda());
  std::vector<double> a = values(y_cpu), b = values(y_gpu.cpu());
  for (size_t i = 0; i < a.size(); ++i) CHECK(b[i] == doctest::Approx(a[i]).epsilon(2e-2).scale(1));
  auto bn_cpu = std::static_pointer_cast<BasicBlock>((*cpu_net.layer1)[0])->bn1;
  auto bn_gpu = std::static_pointer_cast<BasicBlock>((*gpu_net.layer1)[0])->bn1;
  CHECK(bn_gpu->running_mean.is_cuda());
  CHECK(bn_gpu->num_batches_tracked.cpu().item<int64_t>() == 1);
  std::vector<double> rm_cpu = values(bn_cpu->running_mean), rm_gpu = values(bn_gpu->running_mean.cpu());
  for (size_t i = 0; i < rm_cpu.size(); ++i) CHECK(rm_gpu[i] == doctest::Approx(rm_cpu[i]).epsilon(2e-2).scale(1));
  // float16 activations with the float32 BatchNorm of O2.
  gpu_net.to(kFloat16, [](const nn::Module& m) { return !dynamic_cast<const nn::BatchNorm2d*>(&m); });
  CHECK(gpu_net.forward(x.cuda().to(kFloat16)).dtype() == kFloat16);
  CHECK(bn_gpu->running_mean.dtype() == kFloat32);
}

TEST_CASE("a layer's negative size is an error naming the layer and the argument, a Linear of no inputs is built") {
  CHECK_THROWS_WITH_AS(nn::Linear(-1, 3), doctest::Contains("Linear: in_features must be at least 0, got -1"), Error);
  CHECK_THROWS_WITH_AS(nn::Conv2d(2, -4, 3), doctest::Contains("Conv2d: out_channels must be at least 0, got -4"),
                       Error);
  CHECK_THROWS_WITH_AS(nn::Conv2d(2, 4, Pair2d{3, 0}), doctest::Contains("Conv2d: kernel_size[1] must be at least 1"),
                       Error);
  for (int64_t groups : {0, -2}) {
    CAPTURE(groups);
    CHECK_THROWS_WITH_AS(nn::Conv2d(4, 4, 3, {.groups = groups}),
                         doctest::Contains(fmt::format("Conv2d: groups must be a positive integer, got {}", groups).c_str()),
                         Error);
  }
  CHECK_THROWS_WITH_AS(nn::Conv2d(4, 4, 3, {.stride = {2, 2}, .padding_same = true}),
                       doctest::Contains("Conv2d: padding \"same\" takes stride 1 and no padding of its own (PyTorch's "
                                         "rule), got stride (2, 2) and padding (0, 0)"), Error);
  CHECK_THROWS_WITH_AS(nn::Conv2d(4, 4, 3, {.padding = {1, 1}, .padding_same = true}),
                       doctest::Contains("Conv2d: padding \"same\" takes stride 1 and no padding of its own (PyTorch's "
                                         "rule), got stride (1, 1) and padding (1, 1)"), Error);
  CHECK_THROWS_WITH_AS(nn::Conv2d(4, 4, 3, {.padding = {-1, 0}, .padding_mode = PadMode::Reflect}),
                       doctest::Contains("Conv2d: padding must be >= 0, got (-1, 0)"), Error);
  CHECK_THROWS_WITH_AS(nn::Conv2d(4, 4, 3, {.dilation = {0, 1}, .padding_same = true}),
                       doctest::Contains("Conv2d: dilation must be >= 1, got (0, 1)"), Error);
  CHECK_THROWS_WITH_AS(nn::Embedding(-2, 3), doctest::Contains("Embedding: num_embeddings must be at least 0"), Error);
  CHECK_THROWS_WITH_AS(nn::BatchNorm2d(0), doctest::Contains("BatchNorm2d: num_features must be at least 1, got 0"),
                       Error);
  // As PyTorch: initialising no elements is a no-op, and the bias's bound is 0.
  nn::Linear empty_input(0, 3);
  CHECK(values(empty_input.bias) == std::vector<double>{0, 0, 0});
  CHECK(values(empty_input.forward(zeros({2, 0}))) == std::vector<double>(6, 0.0));
}
