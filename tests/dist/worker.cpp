// One rank of the process-group tests: tests/dist/run.sh starts N of these with RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT set, each running the scenario named by argv[1] on the backend argv[2] names (gloo, the default, with
// CPU tensors; nccl with CUDA tensors on GPU RANK, where the scenario takes one). A rank prints what failed and exits
// 1; it exits 0 when every check held, printing "SKIP: ..." first when the backend cannot run here (no GPU).
//
//   collectives       every collective, every dtype it takes, exact expected values that depend on the rank; strings
//                     of every length through all_gather_string
//   dead_rank         rank 1 exits after a barrier; rank 0's next all_reduce must fail within the timeout,
//                     with an error that names the collective and the rank
//   store             the TcpStore alone: values, a counter, waits, and a key no rank sets (an error in 2 s)
//   bad_environment   (one process) init_process_group refuses missing and malformed settings, naming them
//   ddp_training      DistributedDataParallel on shards equals one process on the global batch (float64, 5 SGD
//                     steps and 2 accumulated backward passes; one bucket, a bucket per parameter, gradients as bucket
//                     views); the buckets, their order and launch points
//   ddp_no_sync       gradient accumulation: no_sync keeps each rank's gradient local; the next backward reduces the sum;
//                     a backward that fails midway leaves the next one exact
//   ddp_unused        a parameter without a gradient: an error naming it; with find_unused_parameters, zeros in its
//                     place, and no gradient where no rank used it
//   ddp_mismatch      ranks with different models: every rank fails at the start, naming the first difference
//   ddp_half          a float16 model: its gradients reduced in float16, the mean of the ranks' own gradients
//   scaler_agrees     GradScaler with the group: one rank's overflow makes every rank skip the step and back off
//   replicas          replica_mismatches: none for equal models; with one element one ulp off on the last rank, every
//                     rank names exactly that parameter; a buffer changed on rank 0 is named only with_buffers; +0
//                     against -0 is a difference; a rank with more tensors is an error everywhere (nccl: one rank,
//                     nothing differs)
//   agreed_stop       train::agreed_stop: a stop one rank asks for is every rank's answer at the interval's step,
//                     counted over the copies the epochs take (each epoch's options copy the function)
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <functional>
#include <limits>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "core/autograd.h"
#include "core/cuda.h"
#include "core/error.h"
#include "core/tensor.h"
#include "dist/data_parallel.h"
#include "dist/process_group.h"
#include "nn/layers.h"
#include "ops/elementwise.h"
#include "ops/loss.h"
#include "optim/grad_scaler.h"
#include "optim/sgd.h"
#include "train/loops.h"

using namespace halfgrad;
using namespace halfgrad::dist;

namespace {

int g_rank = -1;
std::string g_backend = "gloo";

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("rank " + std::to_string(g_rank) + ": " + what);
}

std::vector<double> values(const Tensor& t) {
  const Tensor d = t.to(kFloat64).cpu().contiguous();
  return std::vector<double>(d.data<double>(), d.data<double>() + d.numel());
}

// The group of this test: the backend asked for, nccl on GPU RANK.
std::shared_ptr<ProcessGroup> test_group(std::chrono::milliseconds timeout) {
  ProcessGroupOptions o{.backend = g_backend, .timeout = timeout};
  if (g_backend == "nccl") o.device_index = std::atoi(std::getenv("RANK"));
  return init_process_group(o);
}

Device g_device = Device::cpu();  // the group's
Tensor make(const std::vector<double>& v, DType dtype) { return tensor(v).to(dtype).to(g_device); }

// The error message of fn, or "" when it does not throw.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void collectives() {
  auto pg = test_group(std::chrono::seconds(30));
  const int r = pg->rank(), n = pg->size();
  g_rank = r;
  g_device = pg->device();
  require(pg->backend() == g_backend, "backend " + pg->backend());
  const double triangle = n * (n + 1) / 2.0;  // 1 + 2 + ... + n

  for (DType dtype : {kFloat64, kFloat32, kFloat16, kBFloat16, kInt64, kInt32, kUInt8}) {
    const std::string name = dtype_name(dtype);
    // sum: rank r holds (r + 1)(i + 1); every rank ends with (i + 1) n (n + 1) / 2 (exact: at most 6 x 5)
    Tensor t = make({1 * (r + 1.0), 2 * (r + 1.0), 3 * (r + 1.0), 4 * (r + 1.0), 5 * (r + 1.0)}, dtype);
    pg->all_reduce(t)->wait();
    for (int i = 0; i < 5; ++i) require(values(t)[size_t(i)] == (i + 1) * triangle, name + " sum");
    // max, min, product over r + 1 + i
    for (ReduceOp op : {ReduceOp::Max, ReduceOp::Min, ReduceOp::Product}) {
      Tensor m = make({r + 1.0, r + 2.0}, dtype);
      pg->all_reduce(m, op)->wait();
      for (int i = 0; i < 2; ++i) {
        double expected = op == ReduceOp::Max ? n + i : op == ReduceOp::Min ? 1 + i : 1;
        if (op == ReduceOp::Product)
          for (int k = 0; k < n; ++k) expected *= k + 1 + i;
        require(values(m)[size_t(i)] == expected, name + " " + reduce_op_name(op));
      }
    }
    // broadcast from the last rank
    Tensor b = make({double(r), double(r) + 1}, dtype);
    pg->broadcast(b, n - 1)->wait();
    require(values(b) == std::vector<double>{double(n - 1), double(n)}, name + " broadcast");
    // all_gather: part k is rank k's [k, 2k]
    std::vector<Tensor> parts;
    for (int k = 0; k < n; ++k) parts.push_back(zeros({2}, {.dtype = dtype, .device = g_device}));
    pg->all_gather(parts, make({double(r), 2.0 * r}, dtype))->wait();
    for (int k = 0; k < n; ++k) require(values(parts[size_t(k)]) == std::vector<double>{double(k), 2.0 * k},
                                        name + " all_gather part " + std::to_string(k));
    // reduce_scatter: rank r gives (r + 1)(k + 1) to part k; rank k ends with (k + 1) n (n + 1) / 2
    std::vector<Tensor> inputs;
    for (int k = 0; k < n; ++k) inputs.push_back(make({(r + 1.0) * (k + 1), (r + 1.0) * (k + 1)}, dtype));
    Tensor mine = zeros({2}, {.dtype = dtype, .device = g_device});
    pg->reduce_scatter(mine, inputs)->wait();
    require(values(mine) == std::vector<double>{(r + 1) * triangle, (r + 1) * triangle}, name + " reduce_scatter");
  }

  // Asynchronous: three all_reduces issued at once, waited for in reverse; each its own result.
  std::vector<Tensor> many;
  std::vector<std::shared_ptr<Work>> works;
  for (int k = 0; k < 3; ++k) {
    many.push_back(full({1000}, double(k + 1), {.device = g_device}));
    works.push_back(pg->all_reduce(many.back()));
  }
  for (int k = 2; k >= 0; --k) {
    works[size_t(k)]->wait();  // nccl: the current stream waits, not the host (dist/process_group.h)
    for (double v : values(many[size_t(k)])) require(v == (k + 1.0) * n, "async all_reduce " + std::to_string(k));
    // Reading the values waited for the stream, and so for the collective.
    require(works[size_t(k)]->is_completed(), "a waited-for Work whose result was read says it is not completed");
  }
  // Empty tensors and the barrier.
  Tensor empty_tensor = zeros({0}, {.device = g_device});
  pg->all_reduce(empty_tensor)->wait();
  pg->barrier()->wait();

  // Strings: rank r's holds r + 1 copies of "ab", a zero byte and "c" (rank 0 the empty string), each back whole.
  auto string_of = [](int rank) {
    std::string s;
    if (rank > 0)
      for (int k = 0; k <= rank; ++k) s += std::string("ab\0c", 4);
    return s;
  };
  const std::vector<std::string> gathered = all_gather_string(*pg, string_of(r));
  require(int(gathered.size()) == n, "all_gather_string returned " + std::to_string(gathered.size()) + " strings");
  for (int k = 0; k < n; ++k)
    require(gathered[size_t(k)] == string_of(k),
            "all_gather_string: rank " + std::to_string(k) + "'s string came back as \"" + gathered[size_t(k)] + "\"");

  // Bad calls are refused before anything is sent, naming the op and the tensor.
  Tensor wide = zeros({2, 3}, {.device = g_device});
  Tensor strided = wide.transpose(0, 1);
  require(error_of([&] { pg->all_reduce(strided); }).find("all_reduce (" + g_backend + "): float32[3, 2] " +
                                                           g_device.str() + " is not contiguous") != std::string::npos,
          "a strided tensor is refused: " + error_of([&] { pg->all_reduce(strided); }));
  Tensor elsewhere = g_device.is_cpu() ? Tensor() : zeros({2});
  if (elsewhere.defined())
    require(error_of([&] { pg->all_reduce(elsewhere); }).find("is not on " + g_device.str()) != std::string::npos,
            "a tensor on another device is refused");
  std::vector<Tensor> too_few(size_t(n + 1), zeros({2}, {.device = g_device}));
  require(error_of([&] { pg->all_gather(too_few, zeros({2}, {.device = g_device})); })
                  .find("has " + std::to_string(n + 1) + " tensors") != std::string::npos,
          "a wrong number of parts is refused");
  Tensor flags = zeros({2}, {.dtype = kBool, .device = g_device});
  require(!error_of([&] { pg->all_reduce(flags); }).empty(), "a bool all_reduce is refused");
  require(error_of([&] { pg->broadcast(wide, n); }).find("root " + std::to_string(n) + " is not a rank") !=
              std::string::npos, "a root past the ranks is refused");
  pg->barrier()->wait();
}

void dead_rank() {
  const auto timeout = std::chrono::seconds(5);
  auto pg = init_process_group({.timeout = timeout});
  g_rank = pg->rank();
  pg->barrier()->wait();
  if (pg->rank() == 1) std::_Exit(0);  // gone, without a word to the others
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  for (int k = 0; k < 100 && error.empty(); ++k) {
    Tensor t = ones({1 << 16});
    error = error_of([&] { pg->all_reduce(t)->wait(); });
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  require(!error.empty(), "all_reduce went on with a rank gone");
  require(error.find("all_reduce (gloo): rank 0 of 2") != std::string::npos, "the error names the op and rank: " + error);
  require(seconds < 3 * 5.0, "the error came after " + std::to_string(seconds) + " s");
  // The group is broken from then on: the next collective says so at once.
  Tensor again = ones({1});
  const std::string next = error_of([&] { pg->all_reduce(again)->wait(); });
  require(next.find("the group failed earlier") != std::string::npos, "a later collective: " + next);
  std::cout << "rank 0: the other rank's exit ended all_reduce after " << seconds << " s: " << error << "\n";
}

void store() {
  const int r = std::atoi(std::getenv("RANK")), n = std::atoi(std::getenv("WORLD_SIZE"));
  g_rank = r;
  TcpStore st({.host = std::getenv("MASTER_ADDR"), .port = std::atoi(std::getenv("MASTER_PORT")), .rank = r,
               .timeout = std::chrono::seconds(2)});
  // A counter every rank adds to, and a value each rank sets and every rank reads.
  st.add("sum", r + 1);
  const std::string mine = "from rank " + std::to_string(r);
  st.set("value/" + std::to_string(r), std::vector<char>(mine.begin(), mine.end()));
  for (int k = 0; k < n; ++k) {
    const std::vector<char> theirs = st.get("value/" + std::to_string(k));
    require(std::string(theirs.begin(), theirs.end()) == "from rank " + std::to_string(k), "value of rank " +
            std::to_string(k));
  }
  st.set("read/" + std::to_string(r), {});
  for (int k = 0; k < n; ++k) st.wait({"read/" + std::to_string(k)});
  require(st.add("sum", 0) == n * (n + 1) / 2, "the counter is the sum of every rank's add");
  // A key no rank sets: an error after the timeout, naming the key and the rank.
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of([&] { st.get("never"); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  require(error.find("TcpStore::get(\"never\"): no rank set the key within 2000 ms (rank " + std::to_string(r)) !=
              std::string::npos, "a missing key's error: " + error);
  require(seconds >= 1.9 && seconds < 10, "the missing key's wait took " + std::to_string(seconds) + " s");
  // Rank 0 serves the store: it stays until every rank is done with it.
  st.add("finished", 1);
  while (r == 0 && st.add("finished", 0) < n) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

void bad_environment() {
  g_rank = 0;
  ::unsetenv("RANK");
  require(error_of([] { init_process_group(); }).find("RANK is not set") != std::string::npos, "RANK missing");
  ::setenv("RANK", "zero", 1);
  require(error_of([] { init_process_group(); }).find("RANK=\"zero\" is not an integer") != std::string::npos,
          "RANK malformed");
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  require(error_of([] { init_process_group(); }).find("rank 2 is not in 0..1") != std::string::npos,
          "RANK past WORLD_SIZE");
  ::setenv("RANK", "0", 1);
  ::setenv("MASTER_PORT", "70000", 1);
  require(error_of([] { init_process_group(); }).find("MASTER_PORT=\"70000\" is not an integer in 1..65535") !=
              std::string::npos, "MASTER_PORT out of range");
  require(error_of([] { init_process_group({.backend = "mpi"}); }).find("unknown backend \"mpi\"") != std::string::npos,
          "unknown backend");
}


// ---- DistributedDataParallel

// Linear(4, hidden) - ReLU - Linear(hidden, 3), its initial values drawn from `seed`.
std::shared_ptr<nn::Sequential> mlp(uint64_t seed, DType dtype = kFloat64, int64_t hidden = 6) {
  manual_seed(seed);
  auto m = nn::sequential({std::make_shared<nn::Linear>(4, hidden), std::make_shared<nn::ReLU>(),
                           std::make_shared<nn::Linear>(hidden, 3)});
  m->to(dtype);
  return m;
}

// The global batch of a step: the same on every rank (drawn from the step's seed).
std::pair<Tensor, Tensor> global_batch(uint64_t step, int64_t rows, DType dtype = kFloat64) {
  manual_seed(1000 + step);
  return {randn({rows, 4}).to(dtype), randint(0, 3, {rows})};
}

Tensor shard(const Tensor& t, int rank, int size) {
  const int64_t per_rank = t.size(0) / size;
  return t.narrow(0, per_rank * rank, per_rank);
}

double max_difference(const TensorList& a, const TensorList& b) {
  require(a.size() == b.size(), "tensor lists of different lengths");
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    require(a[i].defined() == b[i].defined(), "tensor " + std::to_string(i) + " defined on one side only");
    if (!a[i].defined()) continue;
    const auto x = values(a[i]), y = values(b[i]);
    for (size_t k = 0; k < x.size(); ++k) worst = std::max(worst, std::abs(x[k] - y[k]));
  }
  return worst;
}

TensorList grads_of(const nn::Module& m) {
  TensorList out;
  for (const Tensor& p : m.parameters()) out.push_back(p.grad());
  return out;
}

// Every rank's copy of `t`'s sum of values, which must all be equal.
void require_same_on_every_rank(dist::ProcessGroup& pg, const TensorList& ts, const std::string& what) {
  double sum = 0;
  for (const Tensor& t : ts)
    for (double v : values(t)) sum += v;
  std::vector<Tensor> parts;
  for (int k = 0; k < pg.size(); ++k) parts.push_back(zeros({1}, {.dtype = kFloat64}));
  for (Tensor& part : parts) part = part.to(pg.device());
  pg.all_gather(parts, tensor(std::vector<double>{sum}).to(pg.device()))->wait();
  for (int k = 0; k < pg.size(); ++k)
    require(values(parts[size_t(k)])[0] == sum, what + ": rank " + std::to_string(k) + " differs");
}

void ddp_training() {
  auto pg = test_group(std::chrono::seconds(30));
  const int r = pg->rank(), n = pg->size();
  g_rank = r;
  g_device = pg->device();
  const int64_t rows = 12;  // 6 or 4 a rank
  struct Setup {
    double cap_mb;
    bool as_view, aligned;
  };
  // aligned: the weights laid out as aligned rows (5 hidden units: the second weight, [3, 5], is padded to 6
  // columns), whose gradients reach the buckets and come back by copies, in their layout.
  for (auto [cap_mb, as_view, aligned] : {Setup{25.0, false, false}, Setup{1e-6, false, false},
                                          Setup{25.0, true, false}, Setup{25.0, true, true}}) {
    const std::string label = std::string(cap_mb > 1 ? "one bucket" : "a bucket per parameter") +
                              (as_view ? ", gradients as bucket views" : "") + (aligned ? ", aligned rows" : "");
    const int64_t hidden = aligned ? 5 : 6;
    auto model = mlp(100 + r, kFloat64, hidden);  // each rank its own initial values: rank 0's must win
    auto reference = mlp(100, kFloat64, hidden);  // rank 0's, trained on the whole global batch in one process
    model->to(g_device);
    reference->to(g_device);
    if (aligned) {
      model->to(MemoryFormat::AlignedRows);
      reference->to(MemoryFormat::AlignedRows);
    }
    auto ddp = std::make_shared<nn::DistributedDataParallel>(
        model, pg, nn::DistributedDataParallelOptions{.bucket_cap_mb = cap_mb, .gradient_as_bucket_view = as_view});
    require(max_difference(model->parameters(), reference->parameters()) == 0,
            label + ": the parameters after construction are not rank 0's");
    const optim::SGDOptions sgd{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3};
    optim::SGD opt(model->parameters(), sgd), ref_opt(reference->parameters(), sgd);
    for (uint64_t step = 0; step < 5; ++step) {
      auto [x_cpu, y_cpu] = global_batch(step, rows);
      const Tensor x = x_cpu.to(g_device), y = y_cpu.to(g_device);
      cross_entropy((*ddp)(shard(x, r, n)), shard(y, r, n)).backward();
      opt.step();
      opt.zero_grad();
      cross_entropy((*reference)(x), y).backward();
      ref_opt.step();
      ref_opt.zero_grad();
      const double diff = max_difference(model->parameters(), reference->parameters());
      require(diff < 1e-12, label + ": step " + std::to_string(step) + " differs from one process by " +
              std::to_string(diff));
    }
    require_same_on_every_rank(*pg, model->parameters(), label + ": parameters after 5 steps");
    // Two backward passes without zero_grad accumulate the averages, as one process accumulates its gradients; as
    // bucket views, every gradient then lives in the one bucket's flat tensor.
    for (uint64_t step = 5; step < 7; ++step) {
      auto [x_cpu, y_cpu] = global_batch(step, rows);
      const Tensor x = x_cpu.to(g_device), y = y_cpu.to(g_device);
      cross_entropy((*ddp)(shard(x, r, n)), shard(y, r, n)).backward();
      cross_entropy((*reference)(x), y).backward();
    }
    require(max_difference(grads_of(*model), grads_of(*reference)) < 1e-12, label + ": accumulated gradients differ");
    if (as_view) {  // the contiguous parameters' gradients: views of the one bucket; an aligned one's in its layout
      const TensorList params = model->parameters(), grads = grads_of(*model);
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].is_contiguous()) {
          require(grads[i].storage().get() == grads[0].storage().get(), label + ": a gradient is not a view of the "
                  "bucket");
        } else {
          require(is_aligned_rows(params[i]) && is_aligned_rows(grads[i]), label + ": an aligned weight's gradient "
                  "is not laid out as the weight");
        }
      }
    }
    opt.zero_grad();
    ref_opt.zero_grad();

    const auto names = ddp->bucket_parameter_names();
    const auto points = ddp->last_launch_points();
    using Names = std::vector<std::vector<std::string>>;
    if (cap_mb > 1) {
      require(names == Names{{"2.bias", "2.weight", "0.bias", "0.weight"}}, "one bucket, last layer first");
      require(points == std::vector<size_t>{4}, "one bucket launches when all 4 gradients are ready");
    } else {
      require(names == Names{{"2.bias"}, {"2.weight"}, {"0.bias"}, {"0.weight"}}, "a bucket per parameter, last "
              "layer first");
      // The last layer's bucket was on its way while backward still had the first layer's gradients to compute.
      require(points == std::vector<size_t>{1, 2, 3, 4}, "each bucket launches as soon as its gradient is ready");
    }
  }
}

void ddp_no_sync() {
  auto pg = init_process_group({.timeout = std::chrono::seconds(30)});
  const int r = pg->rank(), n = pg->size();
  g_rank = r;
  auto model = mlp(7);
  auto ddp = std::make_shared<nn::DistributedDataParallel>(model, pg);
  auto [xa, ya] = global_batch(1, 12);
  auto [xb, yb] = global_batch(2, 12);
  {
    auto guard = ddp->no_sync();
    cross_entropy((*ddp)(shard(xa, r, n)), shard(ya, r, n)).backward();
  }
  // Still this rank's own gradient.
  auto local = mlp(7);
  cross_entropy((*local)(shard(xa, r, n)), shard(ya, r, n)).backward();
  require(max_difference(grads_of(*model), grads_of(*local)) == 0, "under no_sync the gradient was changed");
  cross_entropy((*ddp)(shard(xb, r, n)), shard(yb, r, n)).backward();
  // The sum of both micro-batches' gradients, averaged over the ranks: the global batches' gradients, summed.
  auto reference = mlp(7);
  cross_entropy((*reference)(xa), ya).backward();
  cross_entropy((*reference)(xb), yb).backward();
  const double diff = max_difference(grads_of(*model), grads_of(*reference));
  require(diff < 1e-12, "the accumulated gradient differs from one process's by " + std::to_string(diff));

  // A backward that fails after the last layer's gradients were reduced leaves nothing behind: the next one is exact.
  {
    auto layers = mlp(9);
    auto failing = std::make_shared<nn::DistributedDataParallel>(
        layers, pg, nn::DistributedDataParallelOptions{.bucket_cap_mb = 1e-6});
    auto [x, y] = global_batch(5, 12);
    Tensor hidden = (*layers)[1]->forward((*layers)[0]->forward(shard(x, r, n)));
    hidden.register_hook([](const Tensor&) -> Tensor { throw Error("a failure inside backward"); });
    const std::string error = error_of([&] { cross_entropy((*layers)[2]->forward(hidden), shard(y, r, n)).backward(); });
    require(error.find("a failure inside backward") != std::string::npos, "the failing backward: " + error);
    require(failing->last_launch_points().front() == 1, "the failed pass launched the last layer's bucket");
    layers->zero_grad();
    cross_entropy((*failing)(shard(x, r, n)), shard(y, r, n)).backward();
    auto one = mlp(9);
    cross_entropy((*one)(x), y).backward();
    const double after = max_difference(grads_of(*layers), grads_of(*one));
    require(after < 1e-12, "the backward after a failed one differs from one process's by " + std::to_string(after));
  }
}

// Two heads on one input; `b` is used only where asked, `never` nowhere.
class TwoHeads : public nn::Module {
 public:
  TwoHeads() {
    manual_seed(5);
    a = register_module("a", std::make_shared<nn::Linear>(4, 3));
    b = register_module("b", std::make_shared<nn::Linear>(4, 3));
    never = register_module("never", std::make_shared<nn::Linear>(4, 3));
    to(kFloat64);
  }
  Tensor forward(const Tensor& x) override { return use_b ? a->forward(x) + b->forward(x) : a->forward(x); }
  std::shared_ptr<nn::Linear> a, b, never;
  bool use_b = true;
};

void ddp_unused() {
  auto pg = init_process_group({.timeout = std::chrono::seconds(30)});
  const int r = pg->rank(), n = pg->size();
  g_rank = r;
  auto [x, y] = global_batch(3, 6);
  {
    auto model = std::make_shared<TwoHeads>();
    auto ddp = std::make_shared<nn::DistributedDataParallel>(model, pg);
    const std::string error = error_of([&] { cross_entropy((*ddp)(x), y).backward(); });
    require(error.find("received no gradient in this backward pass: never.weight, never.bias") != std::string::npos &&
                error.find("find_unused_parameters") != std::string::npos, "an unused parameter's error: " + error);
  }
  // find_unused_parameters: rank 0 alone uses b; nobody uses `never`.
  auto model = std::make_shared<TwoHeads>();
  model->use_b = r == 0;
  auto ddp = std::make_shared<nn::DistributedDataParallel>(
      model, pg, nn::DistributedDataParallelOptions{.find_unused_parameters = true});
  cross_entropy((*ddp)(x), y).backward();
  auto with_b = std::make_shared<TwoHeads>(), without_b = std::make_shared<TwoHeads>();
  without_b->use_b = false;
  cross_entropy((*with_b)(x), y).backward();
  cross_entropy((*without_b)(x), y).backward();
  // a: rank 0's gradient (with b) and n - 1 others' (without), averaged; b: rank 0's alone, divided by n.
  TensorList expected_a, expected_b;
  for (const Tensor& p : with_b->a->parameters()) expected_a.push_back(p.grad() / double(n));
  for (size_t k = 0; k < expected_a.size(); ++k)
    expected_a[k] = expected_a[k] + without_b->a->parameters()[k].grad() * (double(n - 1) / n);
  for (const Tensor& p : with_b->b->parameters()) expected_b.push_back(p.grad() / double(n));
  require(max_difference(grads_of(*model->a), expected_a) < 1e-12, "a's gradient is not the average");
  require(max_difference(grads_of(*model->b), expected_b) < 1e-12, "b's gradient is not rank 0's over the ranks");
  require(!model->never->weight.grad().defined() && !model->never->bias.grad().defined(),
          "a parameter no rank used got a gradient");
}

void ddp_mismatch() {
  auto pg = init_process_group({.timeout = std::chrono::seconds(30)});
  const int r = pg->rank();
  g_rank = r;
  auto model = mlp(1, kFloat64, r == 1 ? 7 : 6);
  const std::string error = error_of([&] { nn::DistributedDataParallel ddp(model, pg); });
  require(error.find("the ranks' models differ") != std::string::npos, "no mismatch error: " + error);
  if (r == 1)
    require(error.find("rank 0 has \"parameter 0.weight float64[6, 4]\" where rank 1 has \"parameter 0.weight "
                       "float64[7, 4]\"") != std::string::npos, "the error names the difference: " + error);
  else
    require(error.find("rank 1 differs from rank 0") != std::string::npos, "the error names the rank: " + error);
}

void ddp_half() {
  auto pg = init_process_group({.timeout = std::chrono::seconds(30)});
  const int r = pg->rank(), n = pg->size();
  g_rank = r;
  auto model = mlp(3, kFloat16);
  auto ddp = std::make_shared<nn::DistributedDataParallel>(model, pg);
  auto [x, y] = global_batch(4, 12, kFloat16);
  cross_entropy((*ddp)(shard(x, r, n)).to(kFloat32), shard(y, r, n)).backward();
  // Every rank's own float16 gradient, gathered, averaged in float64.
  auto local = mlp(3, kFloat16);
  cross_entropy((*local)(shard(x, r, n)).to(kFloat32), shard(y, r, n)).backward();
  const TensorList mine = grads_of(*model), own = grads_of(*local);
  for (size_t k = 0; k < mine.size(); ++k) {
    require(mine[k].dtype() == kFloat16, "a float16 gradient came back as " + std::string(dtype_name(mine[k].dtype())));
    std::vector<Tensor> parts;
    for (int q = 0; q < n; ++q) parts.push_back(zeros(own[k].shape(), {.dtype = kFloat16}));
    pg->all_gather(parts, own[k].contiguous())->wait();
    Tensor mean = zeros(own[k].shape(), {.dtype = kFloat64});
    for (const Tensor& part : parts) mean = mean + part.to(kFloat64) / double(n);
    const auto got = values(mine[k]), want = values(mean);
    for (size_t i = 0; i < got.size(); ++i)
      require(std::abs(got[i] - want[i]) <= 2e-3 * std::abs(want[i]) + 1e-6, "float16 gradient " + std::to_string(k) +
              " element " + std::to_string(i) + ": " + std::to_string(got[i]) + " against " + std::to_string(want[i]));
  }
}

void scaler_agrees() {
  auto pg = init_process_group({.timeout = std::chrono::seconds(30)});
  const int r = pg->rank();
  g_rank = r;
  Tensor w = ones({3}).requires_grad_();
  optim::SGD opt({w}, {.lr = 0.5});
  amp::GradScaler scaler({.init_scale = 1024});
  scaler.set_process_group(pg);
  // Rank 1's gradient overflows; the others' are clean.
  Tensor loss = (w * (r == 1 ? std::numeric_limits<double>::infinity() : 1.0)).sum();
  scaler.scale(loss).backward();
  scaler.step(opt);
  scaler.update();
  require(values(w) == std::vector<double>{1, 1, 1}, "a rank stepped although rank 1 overflowed");
  require(scaler.get_scale() == 512, "the scale did not back off on every rank: " + std::to_string(scaler.get_scale()));
  // A clean step everywhere moves every rank's weights.
  w.set_grad(Tensor());
  scaler.scale((w * 2.0).sum()).backward();
  scaler.step(opt);
  scaler.update();
  require(values(w) == std::vector<double>{0, 0, 0}, "the clean step did not move the weights");
}

void agreed_stop() {
  auto pg = test_group(std::chrono::seconds(30));
  g_rank = pg->rank();
  const std::function<bool()> run = train::agreed_stop(pg.get(), 3);
  std::function<bool()> first_epoch = run, second_epoch = run;  // what each epoch's options hold
  if (g_rank == 1) train::request_stop();
  require(!first_epoch() && !first_epoch(), "a stop answered before the interval's step");
  require(second_epoch(), "the run's third step (the second epoch's first) did not stop every rank");
  train::clear_stop();
}

void replicas() {
  auto pg = test_group(std::chrono::seconds(30));
  const int r = pg->rank(), n = pg->size();
  g_rank = r;
  g_device = pg->device();
  auto model = nn::sequential({std::make_shared<nn::Linear>(4, 6), std::make_shared<nn::BatchNorm2d>(6)});
  manual_seed(5);  // the same values on every rank
  for (Tensor p : model->parameters()) {
    NoGradGuard no_grad;
    p.copy_(randn(p.shape()));
  }
  model->to(g_device);
  require(nn::replica_mismatches(*pg, *model, true).empty(), "equal models were found to differ");
  if (n == 1) return;
  {
    NoGradGuard no_grad;
    Tensor bias = model->named_parameters()[1].second;  // "0.bias"
    if (r == n - 1) {
      Tensor host = bias.cpu();
      host.data<float>()[2] = std::nextafter(host.data<float>()[2], 1e30f);
      bias.copy_(host.to(g_device));
    }
  }
  const std::vector<std::string> differ = nn::replica_mismatches(*pg, *model);
  require(differ == std::vector<std::string>{"0.bias"},
          "one ulp in 0.bias: found " + std::to_string(differ.size()) + " names, the first " +
              (differ.empty() ? std::string("none") : differ[0]));
  {
    NoGradGuard no_grad;
    nn::broadcast_from_rank0(*pg, *model);  // equal again
    if (r == 0) model->named_buffers()[0].second.fill_(1.5);  // a running mean
  }
  require(nn::replica_mismatches(*pg, *model).empty(), "a changed buffer was found among the parameters");
  // Signs: +0 on rank 0 and -0 elsewhere, in two float64 elements (an unmixed FNV hash lets such pairs cancel).
  {
    NoGradGuard no_grad;
    auto pair = nn::sequential({std::make_shared<nn::Linear>(1, 2, false)});
    pair->to(kFloat64);
    pair->to(g_device);
    pair->parameters()[0].copy_(tensor(std::vector<double>{r == 0 ? 0.0 : -0.0, r == 0 ? 0.0 : -0.0}).view({2, 1}));
    require(nn::replica_mismatches(*pg, *pair) == std::vector<std::string>{"0.weight"}, "+0 against -0 went unseen");
  }
  // A rank with one more tensor: an error on every rank, not all-reduces of different sizes.
  auto uneven = r == n - 1 ? nn::sequential({std::make_shared<nn::Linear>(1, 2), std::make_shared<nn::Linear>(2, 1)})
                           : nn::sequential({std::make_shared<nn::Linear>(1, 2)});
  uneven->to(g_device);
  const std::string error = error_of([&] { nn::replica_mismatches(*pg, *uneven); });
  require(error.find("their models differ in structure") != std::string::npos, "uneven models: " + error);
  const std::vector<std::string> buffers = nn::replica_mismatches(*pg, *model, true);
  require(buffers == std::vector<std::string>{model->named_buffers()[0].first},
          "a changed buffer: found " + std::to_string(buffers.size()) + " names");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  g_backend = argc > 2 ? argv[2] : "gloo";
  if (g_backend == "nccl" && !cuda::is_available()) {
    std::cout << "SKIP: the nccl scenarios need a CUDA GPU, and none is visible\n";
    return 0;
  }
  try {
    if (scenario == "collectives") collectives();
    else if (scenario == "dead_rank") dead_rank();
    else if (scenario == "store") store();
    else if (scenario == "bad_environment") bad_environment();
    else if (scenario == "ddp_training") ddp_training();
    else if (scenario == "ddp_no_sync") ddp_no_sync();
    else if (scenario == "ddp_unused") ddp_unused();
    else if (scenario == "ddp_mismatch") ddp_mismatch();
    else if (scenario == "ddp_half") ddp_half();
    else if (scenario == "scaler_agrees") scaler_agrees();
    else if (scenario == "replicas") replicas();
    else if (scenario == "agreed_stop") agreed_stop();
    else throw std::runtime_error("unknown scenario \"" + scenario + "\" (see the list at the top of "
                                  "tests/dist/worker.cpp)");
  } catch (const std::exception& e) {
    std::cerr << "FAILED: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
