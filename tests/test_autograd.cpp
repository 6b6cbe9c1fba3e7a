// The autograd engine: recording, backward order, accumulation, retain_graph, no_grad, hooks, versions.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <unordered_set>
#include <vector>

#include "halfgrad.h"
#include "tests/gradcheck.h"
#include "tests/testing.h"

using namespace halfgrad;
using halfgrad::testing::values;
using halfgrad::testing::gradcheck;
using halfgrad::testing::leaf;

TEST_CASE("backward of a scalar accumulates d(out)/d(leaf) into .grad") {
  Tensor x = tensor(std::vector<double>{1, 2, 3}).requires_grad_();
  Tensor y = (x * x * 3 + x).sum();  // dy/dx = 6x + 1
  y.backward();
  CHECK(values(x.grad()) == std::vector<double>{7, 13, 19});
  CHECK(x.is_leaf());
  CHECK_FALSE(y.is_leaf());
  CHECK(y.grad_fn()->name() == "SumBackward");
}

TEST_CASE("gradients accumulate across backward calls until reset") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  (x * 2).sum().backward();
  (x * 3).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{5, 5});
  x.set_grad(Tensor());
  (x * 4).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{4, 4});
}

TEST_CASE("a tensor used twice gets the sum of both paths, and shared gradients are not aliased") {
  Tensor a = tensor(std::vector<double>{1, 2}).requires_grad_();
  Tensor b = tensor(std::vector<double>{3, 4}).requires_grad_();
  (a + b).sum().backward();  // add's backward hands one gradient tensor to both inputs
  a.grad().mul_(10);
  CHECK(values(b.grad()) == std::vector<double>{1, 1});
  Tensor x = tensor(std::vector<double>{2}).requires_grad_();
  Tensor h = x * x;
  (h * h + h).sum().backward();  // d/dx (x^4 + x^2) = 4x^3 + 2x
  CHECK(values(x.grad()) == std::vector<double>{36});
}

// GradContext::accumulated: the engine hands a backward the gradient its input already has, to add into, only when
// nothing else holds that tensor. An op of this test's own, k * x, whose backward adds into it when it can.
TEST_CASE("a backward may add into its input's gradient so far, handed over only where nothing else holds it") {
  bool took = false;
  auto scale_into = [&took](const Tensor& x, double k) {
    Tensor out = x.detach().mul(k);
    record("ScaleInto", {x}, {out}, [k, &took](const GradContext& ctx) -> TensorList {
      const Tensor& sum = ctx.accumulated(0);
      if (!sum.defined()) return {ctx[0].mul(k)};
      ctx.take_accumulated(0);
      Tensor(sum).add_(ctx[0].mul(k));
      took = true;
      return {sum};
    });
    return out;
  };
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  SUBCASE("the other consumer's gradient is a tensor of its own: taken, and the sum is right") {
    Tensor h = x.mul(1.0);
    const Tensor scaled = scale_into(h, 5.0);
    const Tensor tripled = h.mul(3.0);  // made later, so its backward runs first and delivers h's first gradient
    (scaled + tripled).sum().backward();
    CHECK(took);
    CHECK(values(x.grad()) == std::vector<double>{8, 8});
  }
  SUBCASE("it is also the node's own output gradient (add's backward passes one tensor to both): not handed") {
    Tensor h = x.mul(1.0);
    Tensor y = scale_into(h, 5.0) + h;
    y.sum().backward();
    CHECK_FALSE(took);
    CHECK(values(x.grad()) == std::vector<double>{6, 6});
  }
  SUBCASE("a broadcast view (mean's gradient) overlaps itself: not handed") {
    Tensor h = x.mul(1.0);
    const Tensor scaled = scale_into(h, 5.0);
    const Tensor average = h.mean();  // made later: its expanded gradient reaches h first
    (scaled.sum() + average).backward();
    CHECK_FALSE(took);
    CHECK(values(x.grad()) == std::vector<double>{5.5, 5.5});
  }
  SUBCASE("a backward that takes it must return it") {
    Tensor h = x.mul(1.0);
    Tensor out = h.detach().mul(5.0);
    record("TakesAndDrops", {h}, {out}, [](const GradContext& ctx) -> TensorList {
      if (ctx.accumulated(0).defined()) ctx.take_accumulated(0);
      return {ctx[0].mul(5.0)};
    });
    const Tensor tripled = h.mul(3.0);
    CHECK_THROWS_WITH_AS((out + tripled).sum().backward(),
                         doctest::Contains("TakesAndDrops: backward took the gradient"), Error);
  }
}

TEST_CASE("backward runs nodes in reverse topological order on a diamond graph") {
  Tensor x = leaf({3});
  gradcheck(
      [](const TensorList& in) {
        Tensor a = in[0].exp(), b = in[0] * 2;
        Tensor c = a * b, d = (a + c).tanh();
        return d * b + c;
      },
      {x});
}

TEST_CASE("a second backward through a freed graph is an error, retain_graph keeps it") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  Tensor y = (x.exp() * 2).sum();
  y.backward(Tensor(), /*retain_graph=*/true);
  y.backward();
  CHECK(values(x.grad()) == values(x.detach().exp() * 4));
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("backward through the graph a second time"), Error);
}

TEST_CASE("backward of a non-scalar needs a gradient of the output's shape") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  Tensor y = x * 3;
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("single-element"), Error);
  CHECK_THROWS_WITH_AS(y.backward(ones({3}, {.dtype = kFloat64})), doctest::Contains("does not match"), Error);
  y.backward(tensor(std::vector<double>{1, 10}));
  CHECK(values(x.grad()) == std::vector<double>{3, 30});
  CHECK_THROWS_WITH_AS(ones({1}).backward(), doctest::Contains("does not require grad"), Error);
}

TEST_CASE("requires_grad propagates, detach and NoGradGuard stop it") {
  Tensor x = ones({2}, {.requires_grad = true});
  Tensor c = ones({2});
  CHECK((x + c).requires_grad());
  CHECK_FALSE((c * 2).requires_grad());
  CHECK_FALSE(x.detach().requires_grad());
  CHECK(x.detach().storage() == x.storage());
  {
    NoGradGuard no_grad;
    CHECK_FALSE((x * 2).requires_grad());
    {
      NoGradGuard nested;
      CHECK_FALSE(GradMode::is_enabled());
    }
    CHECK_FALSE(GradMode::is_enabled());
  }
  CHECK(GradMode::is_enabled());
  CHECK_THROWS_WITH_AS(ones({2}, {.dtype = kInt64}).requires_grad_(), doctest::Contains("floating"), Error);
  CHECK_THROWS_WITH_AS((x * 2).requires_grad_(false), doctest::Contains("leaf"), Error);
}

TEST_CASE("retain_grad keeps a non-leaf's gradient, non-leaves have none by default") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  Tensor h = x * 2;
  Tensor k = h * 3;
  h.retain_grad();
  (k * k).sum().backward();  // d/dh (3h)^2 = 18 h
  CHECK(values(h.grad()) == std::vector<double>{36, 72});
  CHECK_FALSE(k.grad().defined());
}

TEST_CASE("hooks see the gradient and may replace it") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  std::vector<double> seen;
  x.register_hook([&](const Tensor& g) {
    seen = values(g);
    return g * 10;
  });
  Tensor h = x * 2;
  h.register_hook([](const Tensor& g) { return g + 1; });
  h.sum().backward();  // dL/dh = 1 -> hook -> 2; dL/dx = 2*2 = 4 -> leaf hook -> 40
  CHECK(seen == std::vector<double>{4, 4});
  CHECK(values(x.grad()) == std::vector<double>{40, 40});
}


TEST_CASE("post-accumulate hooks see the leaf with its summed .grad, once per backward pass") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  std::vector<std::vector<double>> seen;
  x.register_post_accumulate_grad_hook([&](const Tensor& leaf) { seen.push_back(values(leaf.grad())); });
  (x * 3 + x * x).sum().backward();  // two paths into x, one accumulation: 3 + 2x
  REQUIRE(seen.size() == 1);
  CHECK(seen[0] == std::vector<double>{5, 7});
  (x * 2).sum().backward();  // the second pass adds into .grad: the hook sees the running sum
  REQUIRE(seen.size() == 2);
  CHECK(seen[1] == std::vector<double>{7, 9});
  Tensor y = x * 2;
  CHECK_THROWS_WITH_AS(y.register_post_accumulate_grad_hook([](const Tensor&) {}), doctest::Contains("not a leaf"),
                       Error);
}

TEST_CASE("queue_callback runs after every node of the pass, in order, and only inside a pass") {
  Tensor a = tensor(std::vector<double>{1}).requires_grad_();
  Tensor b = tensor(std::vector<double>{2}).requires_grad_();
  std::vector<std::string> events;
  a.register_post_accumulate_grad_hook([&](const Tensor&) {
    events.push_back("a");
    queue_callback([&] {
      events.push_back("first callback");
      queue_callback([&] { events.push_back("queued by a callback"); });
    });
    queue_callback([&] { events.push_back("second callback"); });
  });
  b.register_post_accumulate_grad_hook([&](const Tensor&) { events.push_back("b"); });
  (a * 2 + b * 3).sum().backward();
  REQUIRE(events.size() == 5);
  CHECK(events[3] == "second callback");
  CHECK(events[2] == "first callback");
  CHECK(events[4] == "queued by a callback");
  CHECK(std::count(events.begin(), events.begin() + 2, "a") == 1);
  CHECK(std::count(events.begin(), events.begin() + 2, "b") == 1);
  CHECK_THROWS_WITH_AS(queue_callback([] {}), doctest::Contains("no backward pass is running"), Error);
}
TEST_CASE("modifying a saved tensor in place makes backward fail loudly") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  Tensor y = x.exp();  // exp saves its output
  Tensor z = y.sum();
  {
    NoGradGuard no_grad;
    y.detach().mul_(2);  // the detached alias shares storage and version counter
  }
  CHECK_THROWS_WITH_AS(z.backward(), doctest::Contains("modified by an in-place operation"), Error);
}

TEST_CASE("in-place ops bump the version counter and rebase history") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  Tensor y = x * 2;
  uint64_t v = y.version();
  y.add_(1).mul_(3);  // y = 3 (2x + 1)
  CHECK(y.version() == v + 2);
  y.sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{6, 6});
  CHECK(values(y.detach()) == std::vector<double>{9, 15});
}

TEST_CASE("an in-place write that autograd records on a view joins its base's history (CopySlices), as PyTorch's") {
  Tensor w = ones({1}, {.dtype = kFloat64, .requires_grad = true});
  Tensor x = zeros({3}, {.dtype = kFloat64});  // no history until the writes
  Tensor view = x.slice(0, 0, 1);
  view.add_(w * 2);
  x.select(0, 1).copy_(w.squeeze(0));
  CHECK(values(x.detach()) == std::vector<double>{2, 1, 0});
  REQUIRE(x.grad_fn() != nullptr);
  CHECK(x.grad_fn()->name() == "CopySlices");
  CHECK(view.grad_fn()->name() == "AsStridedBackward");  // the view's history is now a view of its base's
  (x * tensor<double>({1, 10, 100})).sum().backward();
  CHECK(values(w.grad()) == std::vector<double>{2 + 10});
  // A view's old values get no gradient where the write replaced them, and the rest of the base keeps its own.
  Tensor a = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor u = full({1}, 5.0, {.dtype = kFloat64, .requires_grad = true});
  Tensor y = a * 2;
  y.narrow(0, 1, 1).mul_(u);
  y.narrow(0, 0, 1).copy_(zeros({1}, {.dtype = kFloat64}));
  y.sum().backward();
  CHECK(values(a.grad()) == std::vector<double>{0, 10, 2});
  CHECK(values(u.grad()) == std::vector<double>{4});
  // Writes through views of views, a transposed one among them, against finite differences.
  gradcheck(
      [](const TensorList& in) {
        Tensor out = in[0] * 1;  // a tensor with a history to write into
        out.narrow(1, 1, 2).mul_(in[1]);
        out.select(0, 0).add_(in[2]);
        out.t().narrow(0, 0, 1).copy_(in[3] * 3);
        return out;
      },
      {leaf({3, 4}), leaf({3, 2}), leaf({4}), leaf({1, 3})});
  // detach()'s alias is a tensor of its own to autograd: the op records on it as on any tensor.
  Tensor d = zeros({2}, {.dtype = kFloat64}).detach();
  d.mul_(w);
  CHECK(d.grad_fn()->name() == "MulBackward");
}

TEST_CASE("a recorded in-place write on a view of a leaf that requires grad is refused before it writes") {
  Tensor w = ones({2, 2}, {.dtype = kFloat64, .requires_grad = true});
  Tensor v = full({2}, 3.0, {.dtype = kFloat64, .requires_grad = true});
  const uint64_t version = w.version();
  CHECK_THROWS_WITH_AS(w.select(0, 0).mul_(v), doctest::Contains("mul_: float64[2] cpu is a view of a leaf tensor "
                                                                 "(float64[2, 2] cpu) and requires grad: an in-place "
                                                                 "operation that autograd records is refused on it"),
                       Error);
  CHECK_THROWS_WITH_AS(w.t().copy_(zeros({2, 2}, {.dtype = kFloat64})),
                       doctest::Contains("is a view of a leaf tensor (float64[2, 2] cpu) and requires grad"),
                       Error);
  CHECK(values(w.detach()) == std::vector<double>{1, 1, 1, 1});
  CHECK(w.version() == version);
  {
    NoGradGuard no_grad;  // nothing records: an optimizer's write
    w.select(0, 0).mul_(v);
  }
  CHECK(values(w.detach()) == std::vector<double>{3, 3, 1, 1});
  // A view of an expanded tensor: which of the elements that share a location the write changes is not one answer.
  Tensor expanded = zeros({1, 2}, {.dtype = kFloat64}).expand({2, 2}).detach();
  CHECK_THROWS_WITH_AS(expanded.select(0, 0).add_(v), doctest::Contains("add_: float64[2] cpu is a view of an "
                                                                        "expanded tensor (float64[2, 2] cpu)"),
                       Error);
  // A view taken under a NoGradGuard of a tensor that requires grad has no history for the values a write replaces.
  Tensor b = w * 2, quiet;
  {
    NoGradGuard no_grad;
    quiet = b.select(0, 1);
  }
  CHECK_THROWS_WITH_AS(quiet.mul_(v), doctest::Contains("mul_: float64[2] cpu is a view taken where autograd recorded "
                                                        "nothing (under a NoGradGuard) of a tensor that requires grad "
                                                        "(float64[2, 2] cpu)"),
                       Error);
  CHECK(values(b.detach()) == std::vector<double>{6, 6, 2, 2});
  // A view made a leaf of its own: a write into a view of it would take its gradient away; the base's writes do not.
  Tensor flat = zeros({5}, {.dtype = kFloat64});
  Tensor p = flat.narrow(0, 0, 3).requires_grad_();  // as a flattened parameter's piece
  Tensor y = (p * 3).sum();
  CHECK_THROWS_WITH_AS(p.narrow(0, 1, 1).add_(1.0), doctest::Contains("add_: float64[1] cpu is a view of a leaf "
                                                                      "tensor (float64[5] cpu) and requires grad"),
                       Error);
  flat.add_(v.sum());  // recorded: flat's history is v's now; p stays a leaf, its gradient its own
  CHECK(p.is_leaf());
  (y + (p * 1).sum()).backward();
  CHECK(values(p.grad()) == std::vector<double>{4, 4, 4});
}

TEST_CASE("views taken before an in-place write take their base's new history, as PyTorch's regenerated views") {
  Tensor a = ones({3}, {.dtype = kFloat64, .requires_grad = true});
  Tensor b = a * 2;
  Tensor before = b.slice(0, 0, 2);
  Tensor used = before.sum();  // used before the write: its gradient is that of the values it read
  b.mul_(3);
  CHECK(before.grad_fn()->name() == "AsStridedBackward");
  CHECK(values(autograd::grad({before.unsqueeze(0).sum()}, {a}, {}, /*retain_graph=*/true)[0]) ==
        std::vector<double>{6, 6, 0});
  (before.sum() + used).backward();
  CHECK(values(a.grad()) == std::vector<double>{8, 8, 0});  // 6 through the view's new history, 2 through its old one
  // The source of copy_ a view of the written tensor: read before the write, its history taken after it.
  Tensor c = tensor<double>({1, 2, 3, 4}).requires_grad_();
  Tensor m = c.view({2, 2}) * 1, mt = m.t();
  m.copy_(mt);  // m = m^T, so mt's values are m's old ones
  (mt * tensor<double>({1, 2, 3, 4}).view({2, 2})).sum().backward();
  CHECK(values(c.grad()) == std::vector<double>{1, 2, 3, 4});
  Tensor d = tensor<double>({1, 2, 3, 4}).requires_grad_();
  Tensor e = d * 2, left = e.narrow(0, 0, 2), right = e.narrow(0, 1, 2);
  left.copy_(right);  // e = [2 d2, 2 d2, 2 d2, 2 d3]: right is [e2, e2] now
  right.sum().backward();
  CHECK(values(d.grad()) == std::vector<double>{0, 0, 4, 0});
  // A view of a base whose elements share locations keeps its history: no write gives such a base a new one.
  Tensor shared = tensor<double>({1, 2, 3, 4});
  Tensor rows = shared.expand({2, 4}).detach().requires_grad_();
  Tensor first_row = rows.narrow(0, 0, 1);
  shared.mul_(full({4}, 2.0, {.dtype = kFloat64, .requires_grad = true}));  // a recorded write to their storage
  first_row.sum().backward();
  CHECK(values(rows.grad()) == std::vector<double>{1, 1, 1, 1, 0, 0, 0, 0});
  // An expanded view takes the sum of its gradient over the locations it repeats.
  Tensor f = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor h = f * 1, expanded = h.expand({2, 3});
  h.mul_(2);
  expanded.sum().backward();
  CHECK(values(f.grad()) == std::vector<double>{4, 4, 4});
  // A write that autograd does not record leaves a view's history as it was: a view of a leaf after an optimizer's
  // write still leads to the leaf.
  Tensor w = ones({2, 2}, {.dtype = kFloat64, .requires_grad = true});
  Tensor wt = w.t();
  const std::string node = wt.grad_fn()->name();
  {
    NoGradGuard no_grad;
    w.sub_(1);
  }
  CHECK(wt.grad_fn()->name() == node);
  (wt * 3).sum().backward();
  CHECK(values(w.grad()) == std::vector<double>{3, 3, 3, 3});
}

TEST_CASE("a view taken before an in-place write gave its base a history takes that history, through any op") {
  Tensor w = ones({3}, {.dtype = kFloat64, .requires_grad = true});
  Tensor v = full({3}, 5.0, {.dtype = kFloat64, .requires_grad = true});
  Tensor buffer = zeros({2, 3}, {.dtype = kFloat64});
  Tensor row = buffer.select(0, 1), row_of_row = row.slice(0, 0, 2);  // views of a tensor without a history
  Tensor detached_row = buffer.detach().select(0, 1);  // a view of detach()'s alias, related to buffer by nothing
  CHECK_FALSE(row.requires_grad());
  buffer.copy_((w * 2).expand({2, 3}));  // buffer now has a history, w -> buffer; row's values are 2 w
  CHECK(row.requires_grad());
  CHECK(values(autograd::grad({(row_of_row * v.slice(0, 0, 2)).sum()}, {w}, {}, /*retain_graph=*/true)[0]) ==
        std::vector<double>{10, 10, 0});
  Tensor doubled = row * 2;  // an op that asks whether its input requires grad, not a view: PyTorch's 4 v
  (doubled * v).sum().backward();
  CHECK(values(w.grad()) == std::vector<double>{20, 20, 20});
  CHECK_FALSE(detached_row.requires_grad());
  CHECK(values((detached_row * v).sum().detach()) == std::vector<double>{30});
  // A view of detach()'s alias takes the history that a recorded write gives the alias; the tensor it aliases does not.
  Tensor other = zeros({2, 3}, {.dtype = kFloat64});
  Tensor alias = other.detach();
  Tensor alias_row = alias.select(0, 0);
  alias.copy_(v.expand({2, 3}));
  CHECK_FALSE(other.requires_grad());
  CHECK(values(autograd::grad({(alias_row * 2).sum()}, {v})[0]) == std::vector<double>{2, 2, 2});
  // A write that autograd does not record gives no history: earlier views are as they were.
  Tensor plain = zeros({3}, {.dtype = kFloat64});
  Tensor plain_view = plain.view({3});
  plain.add_(ones({3}, {.dtype = kFloat64}));
  {
    NoGradGuard no_grad;
    plain.add_(w);
  }
  CHECK_FALSE(plain_view.requires_grad());
}

// Every node reachable from t's history, held weakly.
std::vector<std::weak_ptr<Node>> graph_nodes(const Tensor& t) {
  std::vector<std::weak_ptr<Node>> nodes;
  std::unordered_set<Node*> seen;
  std::vector<std::shared_ptr<Node>> stack = {t.grad_fn()};
  while (!stack.empty()) {
    std::shared_ptr<Node> n = stack.back();
    stack.pop_back();
    if (!n || !seen.insert(n.get()).second) continue;
    nodes.push_back(n);
    for (const Edge& e : n->next_edges) stack.push_back(e.node);
  }
  return nodes;
}

TEST_CASE("a graph is freed with the tensors that hold it, backward run or not: no node or view keeps itself alive") {
  manual_seed(5);
  auto resnet = models::resnet18();
  models::LanguageModel lm(20, {.embedding_size = 8, .hidden_size = 8, .num_layers = 2, .dropout = 0.2});
  const Tensor w = randn({4, 3}).requires_grad_();
  const std::vector<std::function<Tensor()>> losses = {
      [&] { return cross_entropy(resnet->forward(randn({2, 3, 32, 32})), tensor(std::vector<int64_t>{1, 7})); },
      [&] { return lm.forward(randint(0, 20, {5, 3})).sum(); },
      [&] {  // writes into views: CopySlices, and views that take their base's new history
        Tensor out = zeros({3, 4, 3});
        Tensor first = out.select(0, 0);
        for (int64_t t = 0; t < 3; ++t) out.select(0, t).copy_(w * double(t));
        out.narrow(1, 1, 2).mul_(2);
        return (out.sum() + first.sum()) * w.t().sum();
      }};
  for (size_t i = 0; i < losses.size(); ++i) {
    for (const bool run_backward : {false, true}) {
      CAPTURE(i);
      CAPTURE(run_backward);
      std::vector<std::weak_ptr<Node>> nodes;
      {
        Tensor loss = losses[i]();
        nodes = graph_nodes(loss);
        REQUIRE(nodes.size() > 5);
        if (run_backward) loss.backward();
      }
      CHECK(std::count_if(nodes.begin(), nodes.end(), [](const auto& n) { return !n.expired(); }) == 0);
    }
  }
}

TEST_CASE("a deep graph is freed without recursion: 100,000 in-place writes, rows filled one by one, a product") {
  const Tensor w = ones({1}, {.dtype = kFloat64, .requires_grad = true});
  {
    Tensor x = w * 1;
    for (int i = 0; i < 100000; ++i) x.add_(w);
    x.sum().backward();  // (the nodes are freed after backward: retain_graph is false, and then as x goes)
  }
  CHECK(values(w.grad()) == std::vector<double>{100001});
  {
    Tensor rows = zeros({30000, 1}, {.dtype = kFloat64});
    for (int64_t i = 0; i < 30000; ++i) rows.select(0, i).copy_(w);
  }  // a chain of 90,000 nodes, freed unused
  {
    Tensor x = w * 1;
    for (int i = 0; i < 100000; ++i) x = x * w;
  }  // each node saved x, with the history of x: the node before it, held by the edge and what was saved (freed first)
}

TEST_CASE("an in-place write into an expanded view is refused: its elements share memory") {
  Tensor b = zeros({1, 3});
  Tensor expanded = b.expand({4, 3});
  CHECK_THROWS_WITH_AS(expanded.add_(ones({4, 3})), doctest::Contains("add_: float32[4, 3] cpu is an expanded view"),
                       Error);
  CHECK_THROWS_WITH_AS(expanded.copy_(ones({4, 3})), doctest::Contains("copy_: float32[4, 3] cpu is an expanded view"),
                       Error);
  CHECK_THROWS_WITH_AS(expanded.relu_(), doctest::Contains("relu_: float32[4, 3] cpu is an expanded view"), Error);
  CHECK_THROWS_WITH_AS(expanded.fill_(1), doctest::Contains("fill_: float32[4, 3] cpu is an expanded view"), Error);
  CHECK_THROWS_WITH_AS(expanded.zero_(), doctest::Contains("is an expanded view"), Error);
  CHECK(values(b) == std::vector<double>{0, 0, 0});
}

TEST_CASE("copy_ over a tensor with a history gives that history a zero gradient, src or not requiring grad") {
  Tensor x = ones({2}, {.dtype = kFloat64, .requires_grad = true});
  Tensor y = x * 2;
  y.copy_(zeros({2}, {.dtype = kFloat64}));  // PyTorch: y's grad_fn is CopyBackwards, x.grad 0 (it was 2 here)
  y.sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{0, 0});
  Tensor w = full({2}, 3.0, {.dtype = kFloat64, .requires_grad = true});
  Tensor z = x * 2;
  z.copy_(w);
  (z * z).sum().backward();
  CHECK(values(w.grad()) == std::vector<double>{6, 6});
  CHECK(values(x.grad()) == std::vector<double>{0, 0});  // unchanged: z's old history got nothing
}

TEST_CASE("in-place on a leaf that requires grad is refused outside no_grad") {
  Tensor w = ones({2}, {.requires_grad = true});
  CHECK_THROWS_WITH_AS(w.add_(1), doctest::Contains("leaf tensor that requires grad"), Error);
  {
    NoGradGuard no_grad;
    w.add_(1);
  }
  CHECK(values(w) == std::vector<double>{2, 2});
}

TEST_CASE("broadcast gradients are reduced back to each input's shape") {
  gradcheck([](const TensorList& in) { return in[0] * in[1] + in[2]; }, {leaf({4, 1, 3}), leaf({5, 1}), leaf({3})});
  Tensor a = ones({2, 3}, {.dtype = kFloat64, .requires_grad = true});
  Tensor b = ones({3}, {.dtype = kFloat64, .requires_grad = true});
  (a * b).sum().backward();
  CHECK(b.grad().shape() == Shape{3});
  CHECK(values(b.grad()) == std::vector<double>{2, 2, 2});
}

TEST_CASE("a cast passes the gradient back in the input's dtype") {
  Tensor x = tensor(std::vector<float>{1, 2}).requires_grad_();
  Tensor h = x.to(kFloat16) * 3;
  CHECK(h.dtype() == kFloat16);
  h.to(kFloat32).sum().backward();
  CHECK(x.grad().dtype() == kFloat32);
  CHECK(values(x.grad()) == std::vector<double>{3, 3});
  gradcheck([](const TensorList& in) { return in[0].to(kFloat32).to(kFloat64) * 2; }, {leaf({3})}, 1e-3, 1e-3, 1e-3);
}

TEST_CASE("gradients cast to a leaf's dtype are cast together at the end of the pass, summed in their order") {
  // w's three gradients arrive (the last term's first) as 2^-24 through a float16 cast, 1 in float32, -1 through a
  // cast. Added in that order, (2^-24 + 1) - 1 = 0 in float32; the two others first, (1 - 1) + 2^-24 = 2^-24. The
  // engine holds the first cast for the end of the pass, and must add it before the second gradient as it did when it
  // cast each at once: a leaf with a hook, which it never holds, is the reference. u's post-accumulate hook runs while
  // v's cast is held (its AccumulateGrad ran first when casts were not held); m's gradient keeps m's channels_last.
  // On the CPU, and on a GPU where there is one (the casts in one launch of copy_each_'s kernel).
  auto grads_of = [](Device device, bool hooked) {
    Tensor u = tensor(std::vector<float>{5}).to(device).requires_grad_();
    Tensor w = tensor(std::vector<float>{1, 2}).to(device).requires_grad_();
    Tensor v = tensor(std::vector<float>{3, 4}).to(device).requires_grad_();
    Tensor m = contiguous_channels_last(randn({2, 3, 2, 2})).to(device).requires_grad_();
    if (hooked) {
      for (Tensor* t : {&w, &v, &m}) t->register_hook([](const Tensor& g) { return g; });
    }
    bool v_had_grad = false;
    u.register_post_accumulate_grad_hook([&](const Tensor&) { v_had_grad = v.grad().defined(); });
    const Tensor tiny = full({2}, std::ldexp(1.0, -24), {.dtype = kFloat16, .device = device});
    // One term a statement: the order the nodes are made in is the order they run in, backwards.
    Tensor loss = (u * 2).sum();
    loss = loss + (v.to(kFloat16) * 3).to(kFloat32).sum();
    loss = loss + (m.to(kFloat16) * 2).to(kFloat32).sum();
    loss = loss + (w.to(kFloat16) * -1).to(kFloat32).sum();
    loss = loss + w.sum();
    loss = loss + (w.to(kFloat16) * tiny).to(kFloat32).sum();
    loss.backward();
    CHECK(v_had_grad == hooked);
    CHECK(w.grad().dtype() == kFloat32);
    CHECK(m.grad().dtype() == kFloat32);
    CHECK(is_channels_last(m.grad()));
    return std::vector<std::vector<double>>{values(w.grad().cpu()), values(v.grad().cpu()), values(m.grad().cpu())};
  };
  std::vector<Device> devices = {Device::cpu()};
  if (cuda::is_available()) devices.push_back(Device::cuda());
  for (Device device : devices) {
    CAPTURE(device.str());
    const auto reference = grads_of(device, true), held = grads_of(device, false);
    CHECK(held == reference);
    CHECK(held[0] == std::vector<double>{0, 0});
    CHECK(held[1] == std::vector<double>{3, 3});
    CHECK(held[2] == std::vector<double>(24, 2));
  }
}

TEST_CASE("a gradient cast to a leaf's dtype is held only where its storage is small, a view's whole storage counted") {
  // cat's backward passes each input a view of the one gradient of its output. w's is 2 elements of a storage of
  // 4M + 2 float16 elements (the limit is 4M): held, it would keep 8 MB alive to the pass's end, so it is cast at
  // once, before u's AccumulateGrad runs; v's 2 float16 elements of its own are held (u's hook sees no gradient).
  auto w_and_v_had_grad = [](int64_t others) {
    Tensor u = tensor(std::vector<float>{5}).requires_grad_();
    Tensor w = tensor(std::vector<float>{1, 2}).requires_grad_();
    Tensor v = tensor(std::vector<float>{3, 4}).requires_grad_();
    Tensor big = zeros({others}, {.dtype = kFloat16, .requires_grad = true});
    std::pair<bool, bool> had_grad;
    u.register_post_accumulate_grad_hook([&](const Tensor&) { had_grad = {w.grad().defined(), v.grad().defined()}; });
    Tensor loss = (u * 2).sum();
    loss = loss + (v.to(kFloat16) * 3).to(kFloat32).sum();
    loss = loss + cat({w.to(kFloat16), big}, 0).to(kFloat32).sum();
    loss.backward();
    CHECK(values(w.grad()) == std::vector<double>{1, 1});
    CHECK(values(v.grad()) == std::vector<double>{3, 3});
    return had_grad;
  };
  CHECK(w_and_v_had_grad(int64_t(1) << 22) == std::pair{true, false});
  CHECK(w_and_v_had_grad(2) == std::pair{false, false});
}

TEST_CASE("outputs of an op that get no gradient are treated as zero") {
  Tensor x = tensor(std::vector<double>{1, 5, 3}).requires_grad_();
  auto [values_, indices] = x.max(0);
  (values_ * 2).backward();
  CHECK(to_vector<double>(x.grad()) == std::vector<double>{0, 2, 0});
  CHECK_FALSE(indices.requires_grad());
}

TEST_CASE("a gradient hook may change the gradient's values, not its shape, dtype or device") {
  Tensor a = ones({2}, {.requires_grad = true});
  a.register_hook([](const Tensor&) { return ones({5}); });
  CHECK_THROWS_WITH_AS((a * 1.0).sum().backward(), doctest::Contains("a gradient hook returned float32[5] cpu for the "
                                                                     "gradient float32[2] cpu"), Error);
  Tensor b = ones({2}, {.requires_grad = true});
  Tensor c = b * 2.0;
  c.register_hook([](const Tensor& g) { return g.to(kFloat64); });
  CHECK_THROWS_WITH_AS(c.sum().backward(), doctest::Contains("a gradient hook returned float64[2] cpu"), Error);
  Tensor d = ones({2}, {.requires_grad = true});
  d.register_hook([](const Tensor& g) { return g * 3.0; });
  (d * 1.0).sum().backward();
  CHECK(values(d.grad()) == std::vector<double>{3, 3});
}

TEST_CASE(".grad accumulates in place, as PyTorch's: a handle to it, or a buffer given by set_grad, sees the sum") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  (x * 2).sum().backward();
  const Tensor first = x.grad();
  (x * 3).sum().backward();
  CHECK(first.same(x.grad()));
  CHECK(values(first) == std::vector<double>{5, 5});
  Tensor buffer = zeros({2}, {.dtype = kFloat64});
  x.set_grad(buffer);
  (x * 4).sum().backward();
  CHECK(values(buffer) == std::vector<double>{4, 4});
  // A .grad that is an expanded view is summed out of place: in place, its one element would take both.
  x.set_grad(zeros({1}, {.dtype = kFloat64}).expand({2}));
  (x * 4).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{4, 4});
}

TEST_CASE("retain_grad keeps the gradient after the tensor's hooks, and follows the tensor through an in-place op") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  Tensor h = x * 1;
  h.retain_grad();
  h.register_hook([](const Tensor& g) { return g * 10; });
  h.sum().backward();
  CHECK(values(h.grad()) == std::vector<double>{10, 10});  // PyTorch 2: retains_grad hooks run after the others
  Tensor a = x * 1;
  a.retain_grad();
  a.mul_(2);
  a.sum().backward();
  CHECK(values(a.grad()) == std::vector<double>{1, 1});  // the gradient of a as it is now, after mul_
}

TEST_CASE("a hook may register hooks and retain gradients while it runs") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  Tensor h = x * 1;
  int later_calls = 0;
  h.register_hook([&](const Tensor&) {
    for (int i = 0; i < 100; ++i) h.register_hook([&](const Tensor&) { ++later_calls; return Tensor(); });
    h.retain_grad();
    return Tensor();
  });
  x.register_hook([&](const Tensor&) {
    for (int i = 0; i < 100; ++i) x.register_hook([](const Tensor&) { return Tensor(); });
    return Tensor();
  });
  h.sum().backward();
  CHECK(later_calls == 100);  // those registered during the pass run in it, as they come
  CHECK(values(h.grad()) == std::vector<double>{1, 1});  // retained from this pass on
  CHECK(values(x.grad()) == std::vector<double>{1, 1});
}

TEST_CASE("requires_grad_ on a non-leaf: true changes nothing, false is refused, a leaf set false gets no gradient") {
  Tensor x = tensor(std::vector<double>{1, 2}).requires_grad_();
  Tensor y = x * 2;
  CHECK(y.requires_grad_().requires_grad());
  CHECK_THROWS_WITH_AS(y.requires_grad_(false), doctest::Contains("only leaf tensors can change requires_grad"),
                       Error);
  Tensor z = (x * 3).sum();
  x.requires_grad_(false);  // after the forward: PyTorch's AccumulateGrad leaves .grad alone
  z.backward();
  CHECK_FALSE(x.grad().defined());
  CHECK_THROWS_WITH_AS(Tensor().retains_grad(), doctest::Contains("retains_grad"), Error);
  CHECK_THROWS_WITH_AS(Tensor().set_grad(Tensor()), doctest::Contains("set_grad"), Error);
}

TEST_CASE("item<T>() refuses a value T cannot hold, as libtorch's checked conversion") {
  CHECK_THROWS_WITH_AS(scalar_tensor(1e20, {.dtype = kFloat64}).item<int32_t>(),
                       doctest::Contains("item<int32>(): the value 1e+20 of float64[] cpu cannot be converted to int32 "
                                         "without overflow"), Error);
  CHECK_THROWS_WITH_AS(scalar_tensor(std::nan("")).item<int64_t>(), doctest::Contains("item<int64>()"), Error);
  CHECK_THROWS_WITH_AS(scalar_tensor(-1.0).item<uint8_t>(), doctest::Contains("item<uint8>()"), Error);
  CHECK_THROWS_WITH_AS(scalar_tensor(int64_t(300), {.dtype = kInt64}).item<uint8_t>(),
                       doctest::Contains("the value 300 of int64[] cpu cannot be converted to uint8"), Error);
  CHECK(scalar_tensor(-7.9).item<int32_t>() == -7);  // truncated toward zero, as static_cast
  CHECK(scalar_tensor(int64_t(1) << 40, {.dtype = kInt64}).item<int64_t>() == int64_t(1) << 40);
  CHECK(scalar_tensor(2.0).item<float>() == 2.0f);
}

TEST_CASE("cuda: a 0-d gradient on the CPU moves to its output's device, another is refused naming both") {
  SKIP_WITHOUT_GPU();
  Tensor x = tensor(std::vector<float>{1, 2}).cuda().requires_grad_();
  (x * 3).sum().backward(scalar_tensor(2.0f));
  CHECK(values(x.grad().cpu()) == std::vector<double>{6, 6});
  CHECK_THROWS_WITH_AS((x * 3).backward(ones({2})), doctest::Contains("backward: gradient float32[2] cpu for tensor 0 "
                                                                       "of the outputs is on another device"), Error);
}

TEST_CASE("autograd::grad returns the gradients of the inputs and leaves every .grad as it was") {
  Tensor x = tensor<double>({1, 2, 3}).requires_grad_();
  Tensor w = tensor<double>({4, 5, 6}).requires_grad_();
  Tensor y = (x * w).sum() + (x * x).sum();
  const TensorList g = autograd::grad({y}, {x, w});
  REQUIRE(g.size() == 2);
  CHECK(values(g[0]) == std::vector<double>{6, 9, 12});  // w + 2x
  CHECK(values(g[1]) == std::vector<double>{1, 2, 3});   // x
  CHECK(!x.grad().defined());
  CHECK(!w.grad().defined());
  // The graph was freed (retain_graph false): a second pass through it is refused, as PyTorch's.
  CHECK_THROWS_WITH_AS(autograd::grad({y}, {x}), doctest::Contains("a second time"), Error);
  // With retain_graph, twice the same; then backward accumulates as always.
  Tensor z = (x * w).sum();
  CHECK(values(autograd::grad({z}, {w}, {}, /*retain_graph=*/true)[0]) == std::vector<double>{1, 2, 3});
  CHECK(values(autograd::grad({z}, {w}, {}, true)[0]) == std::vector<double>{1, 2, 3});
  z.backward();
  CHECK(values(x.grad()) == std::vector<double>{4, 5, 6});
}

TEST_CASE("autograd::grad of an intermediate tensor, with grad_outputs, several outputs, and the same input twice") {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor h = x * 3;
  Tensor y = h * h;  // dy/dh = 2h = (6, 12)
  const TensorList g = autograd::grad({y}, {h, x, h}, {tensor<double>({1, 10})});
  CHECK(values(g[0]) == std::vector<double>{6, 120});
  CHECK(values(g[1]) == std::vector<double>{18, 360});  // through h: 3 * 2h
  CHECK(values(g[2]) == values(g[0]));
  CHECK(!x.grad().defined());
  // Two outputs: their gradients add, as backward({a, b}).
  Tensor a = x.sum(), b = (x * x).sum();
  CHECK(values(autograd::grad({a, b}, {x})[0]) == std::vector<double>{3, 5});
  // The output itself is an input: its seed.
  Tensor s = (x * 2).sum();
  CHECK(values(autograd::grad({s}, {s})[0]) == std::vector<double>{1});
}

TEST_CASE("autograd::grad runs only the nodes that lead to an input, and no leaf accumulates") {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor w = tensor<double>({3, 4}).requires_grad_();
  int w_branch = 0;
  Tensor wx = w * 2;
  wx.register_hook([&](const Tensor&) {
    ++w_branch;
    return Tensor();
  });
  Tensor y = (x * wx).sum();
  CHECK(values(autograd::grad({y}, {x})[0]) == std::vector<double>{6, 8});
  CHECK(w_branch == 0);  // w's side of the graph did not run
  CHECK(!w.grad().defined());
  // An input's register_hook hooks change what is returned (a leaf's too), as they change what .grad would get.
  Tensor v = tensor<double>({1, 1}).requires_grad_();
  v.register_hook([](const Tensor& g) { return g * 10; });
  int accumulated = 0;
  v.register_post_accumulate_grad_hook([&](const Tensor&) { ++accumulated; });
  CHECK(values(autograd::grad({(v * 3).sum()}, {v})[0]) == std::vector<double>{30, 30});
  CHECK(accumulated == 0);
  CHECK(!v.grad().defined());
}

TEST_CASE("autograd::grad refuses inputs without grad and unused inputs, unless allow_unused") {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor unused = tensor<double>({5}).requires_grad_();
  Tensor constant = tensor<double>({1, 2});
  CHECK_THROWS_WITH_AS(autograd::grad({(x * 2).sum()}, {constant}),
                       doctest::Contains("autograd::grad: input 0 (float64[2] cpu) does not require grad"), Error);
  CHECK_THROWS_WITH_AS(autograd::grad({(x * 2).sum()}, {x, unused}),
                       doctest::Contains("autograd::grad: input 1 (float64[1] cpu) is not used in the graph of the "
                                         "outputs; pass allow_unused = true"), Error);
  const TensorList g = autograd::grad({(x * 2).sum()}, {unused, x}, {}, false, /*create_graph=*/false,
                                      /*allow_unused=*/true);
  CHECK(!g[0].defined());
  CHECK(values(g[1]) == std::vector<double>{2, 2});
  CHECK_THROWS_WITH_AS(autograd::grad({x * 2}, {x}), doctest::Contains("autograd::grad: a gradient can be left out "
                                                                        "only for single-element outputs"), Error);
  CHECK_THROWS_WITH_AS(autograd::grad({constant.sum()}, {x}),
                       doctest::Contains("autograd::grad: tensor 0 of the outputs (float64[] cpu) does not require "
                                         "grad"), Error);
}

TEST_CASE("autograd::grad matches backward's gradients through a small network, and a gradient penalty's first pass") {
  manual_seed(351);
  nn::Sequential net({std::make_shared<nn::Linear>(4, 8), std::make_shared<nn::GELU>(),
                      std::make_shared<nn::LayerNorm>(8), std::make_shared<nn::Linear>(8, 1)});
  net.to(kFloat64);
  const Tensor x = randn({5, 4}, {.dtype = kFloat64}).requires_grad_();
  const TensorList params = net.parameters();
  TensorList inputs = params;
  inputs.push_back(x);
  const TensorList g = autograd::grad({net(x).sum()}, inputs);
  net(x).sum().backward();
  for (size_t i = 0; i < params.size(); ++i) CHECK(values(g[i]) == values(params[i].grad()));
  CHECK(values(g.back()) == values(x.grad()));
}

TEST_CASE("autograd::grad with one output's graph through another output's counts both (a root under a root)") {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  Tensor h = x * 3;
  Tensor y = (h * h).sum();  // dy/dx = 18x
  const Tensor ones_h = tensor<double>({1, 1});
  CHECK(values(autograd::grad({h, y}, {x}, {ones_h, Tensor()}, true)[0]) == std::vector<double>{21, 39});
  CHECK(values(autograd::grad({y, h}, {x}, {Tensor(), ones_h}, true)[0]) == std::vector<double>{21, 39});
  CHECK(values(autograd::grad({h, y}, {h}, {ones_h, Tensor()})[0]) == std::vector<double>{7, 13});  // 1 + 2h
}

TEST_CASE("autograd::grad asks a backward only for the gradients that lead to an input") {
  Tensor a = tensor<double>({1, 2}).requires_grad_(), b = tensor<double>({3, 4}).requires_grad_();
  Tensor out = empty({2}, {.dtype = kFloat64});
  {
    NoGradGuard no_grad;
    out.copy_(a * b);
  }
  std::vector<bool> asked;
  record("ProbeBackward", {a, b}, {out}, [&](const GradContext& g) -> TensorList {
    asked = {g.needs(0), g.needs(1)};
    return {g.needs(0) ? g[0] * 3.0 : Tensor(), g.needs(1) ? g[0] * 1.0 : Tensor()};
  });
  CHECK(values(autograd::grad({out.sum()}, {a}, {}, true)[0]) == std::vector<double>{3, 3});
  CHECK(asked == std::vector<bool>{true, false});
  out.sum().backward();
  CHECK(asked == std::vector<bool>{true, true});
}

TEST_CASE("autograd::grad runs a leaf's hooks once however often it is listed, and refuses empty lists") {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  int calls = 0;
  x.register_hook([&](const Tensor& g) {
    ++calls;
    return g * 2;
  });
  const TensorList g = autograd::grad({(x * 3).sum()}, {x, x});
  CHECK(calls == 1);
  CHECK(values(g[0]) == std::vector<double>{6, 6});
  CHECK(values(g[1]) == std::vector<double>{6, 6});
  CHECK_THROWS_WITH_AS(autograd::grad({(x * 3).sum()}, {}),
                       doctest::Contains("autograd::grad: needs outputs and inputs, got 1 and 0"), Error);
  CHECK_THROWS_WITH_AS(autograd::grad({}, {x}), doctest::Contains("autograd::grad: needs outputs and inputs"), Error);
}

TEST_CASE("autograd::grad: an output of a node that no gradient reached is unused, as PyTorch's") {
  Tensor x = tensor<double>({1, 2, 3, 4}).requires_grad_();
  const std::vector<Tensor> p = x.split(2);
  CHECK_THROWS_WITH_AS(autograd::grad({p[0].sum()}, {p[1]}, {}, true), doctest::Contains("is not used in the graph"),
                       Error);
  const TensorList g = autograd::grad({p[0].sum()}, {p[1], x}, {}, false, /*create_graph=*/false,
                                      /*allow_unused=*/true);
  CHECK(!g[0].defined());
  CHECK(values(g[1]) == std::vector<double>{1, 1, 0, 0});
}

TEST_CASE("register_hook's handle removes the hook, as PyTorch's RemovableHandle, on leaves and non-leaves") {
  Tensor x = tensor<double>({1, 2}).requires_grad_();
  int leaf_calls = 0, inner_calls = 0, accumulated = 0;
  HookHandle on_leaf = x.register_hook([&](const Tensor& g) {
    ++leaf_calls;
    return g * 10;
  });
  HookHandle after = x.register_post_accumulate_grad_hook([&](const Tensor&) { ++accumulated; });
  Tensor h = x * 2;
  HookHandle on_inner = h.register_hook([&](const Tensor& g) {
    ++inner_calls;
    return g + 1;
  });
  h.sum().backward(Tensor(), /*retain_graph=*/true);
  CHECK(values(x.grad()) == std::vector<double>{40, 40});  // ((1 + 1) * 2) * 10
  on_leaf.remove();
  on_inner.remove();
  after.remove();
  after.remove();  // a second remove does nothing
  x.set_grad(Tensor());
  h.sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{2, 2});
  CHECK(leaf_calls == 1);
  CHECK(inner_calls == 1);
  CHECK(accumulated == 1);
  // A hook that removes itself while it runs; a handle that outlives its tensor's graph.
  Tensor y = tensor<double>({1}).requires_grad_();
  int once = 0;
  HookHandle self;
  self = y.register_hook([&](const Tensor&) {
    ++once;
    self.remove();
    return Tensor();
  });
  (y * 3).sum().backward();
  (y * 3).sum().backward();
  CHECK(once == 1);
  HookHandle orphan;
  {
    Tensor z = tensor<double>({1}).requires_grad_();
    orphan = (z * 2).register_hook([](const Tensor& g) { return g; });
  }
  orphan.remove();  // the node is gone: nothing to do
  // A removed leaf hook no longer keeps the leaf's gradient out of the backward's batched casts: w's cast is held
  // past u's accumulation, as a hookless leaf's is (a live hook would have it cast at once).
  Tensor u = tensor(std::vector<float>{5}).requires_grad_();
  Tensor w = ones({2}).requires_grad_();
  w.register_hook([](const Tensor& g) { return g; }).remove();
  bool w_had_grad_at_u = true;
  u.register_post_accumulate_grad_hook([&](const Tensor&) { w_had_grad_at_u = w.grad().defined(); });
  Tensor loss = (u * 2).sum();
  loss = loss + (w.to(kFloat16) * 2).to(kFloat32).sum();
  loss.backward();
  CHECK(!w_had_grad_at_u);
  CHECK(values(w.grad()) == std::vector<double>{2, 2});
}

TEST_CASE("a backward that runs another node's backward itself gives that node all its inputs' needs") {
  // The engine's hand-over (needs, the accumulated gradients) is for the node it runs alone: a node of the same
  // number of inputs called from inside that backward must not inherit autograd::grad's pruning.
  Tensor a = tensor<double>({1, 2}).requires_grad_(), b = tensor<double>({3, 4}).requires_grad_();
  const Tensor m = a * b;  // MulBackward: two inputs
  Tensor p = tensor<double>({1, 1}).requires_grad_(), q = tensor<double>({1, 1}).requires_grad_();
  Tensor out = empty({2}, {.dtype = kFloat64});
  {
    NoGradGuard no_grad;
    out.fill_(0);
  }
  bool inner_both = false;
  record("OuterBackward", {p, q}, {out}, [&](const GradContext& g) -> TensorList {
    const TensorList inner = m.grad_fn()->apply({g[0]});
    inner_both = inner.size() == 2 && inner[0].defined() && inner[1].defined();
    return {g[0], g.needs(1) ? g[0] : Tensor()};
  });
  CHECK(values(autograd::grad({out.sum()}, {p})[0]) == std::vector<double>{1, 1});
  CHECK(inner_both);
}
