// One rank of the process-group tests: tests/dist/run.sh starts N of these with RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT set, each running the scenario named by argv[1]. A rank prints what failed and exits 1; it exits 0 when
// every check held.
//
//   collectives       every collective, every dtype it takes, exact expected values that depend on the rank
//   dead_rank         rank 1 exits after a barrier; rank 0's next all_reduce must fail within the timeout,
//                     with an error that names the collective and the rank
//   store             the TcpStore alone: values, a counter, waits, and a key no rank sets (an error in 2 s)
//   bad_environment   (one process) init_process_group refuses missing and malformed settings, naming them
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "dist/process_group.h"

using namespace halfgrad;
using namespace halfgrad::dist;

namespace {

int g_rank = -1;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("rank " + std::to_string(g_rank) + ": " + what);
}

std::vector<double> values(const Tensor& t) {
  const Tensor d = t.to(kFloat64).contiguous();
  return std::vector<double>(d.data<double>(), d.data<double>() + d.numel());
}

Tensor make(const std::vector<double>& v, DType dtype) { return tensor(v).to(dtype); }

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
  auto pg = init_process_group({.timeout = std::chrono::seconds(30)});
  const int r = pg->rank(), n = pg->size();
  g_rank = r;
  require(pg->backend() == "gloo", "backend " + pg->backend());
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
    for (int k = 0; k < n; ++k) parts.push_back(zeros({2}, {.dtype = dtype}));
    pg->all_gather(parts, make({double(r), 2.0 * r}, dtype))->wait();
    for (int k = 0; k < n; ++k) require(values(parts[size_t(k)]) == std::vector<double>{double(k), 2.0 * k},
                                        name + " all_gather part " + std::to_string(k));
    // reduce_scatter: rank r gives (r + 1)(k + 1) to part k; rank k ends with (k + 1) n (n + 1) / 2
    std::vector<Tensor> inputs;
    for (int k = 0; k < n; ++k) inputs.push_back(make({(r + 1.0) * (k + 1), (r + 1.0) * (k + 1)}, dtype));
    Tensor mine = zeros({2}, {.dtype = dtype});
    pg->reduce_scatter(mine, inputs)->wait();
    require(values(mine) == std::vector<double>{(r + 1) * triangle, (r + 1) * triangle}, name + " reduce_scatter");
  }

  // Asynchronous: three all_reduces issued at once, waited for in reverse; each its own result.
  std::vector<Tensor> many;
  std::vector<std::shared_ptr<Work>> works;
  for (int k = 0; k < 3; ++k) {
    many.push_back(full({1000}, double(k + 1)));
    works.push_back(pg->all_reduce(many.back()));
  }
  for (int k = 2; k >= 0; --k) {
    works[size_t(k)]->wait();
    require(works[size_t(k)]->is_completed(), "a waited-for Work says it is not completed");
    for (double v : values(many[size_t(k)])) require(v == (k + 1.0) * n, "async all_reduce " + std::to_string(k));
  }
  // Empty tensors and the barrier.
  Tensor empty_tensor = zeros({0});
  pg->all_reduce(empty_tensor)->wait();
  pg->barrier()->wait();

  // Bad calls are refused before anything is sent, naming the op and the tensor.
  Tensor wide = zeros({2, 3});
  Tensor strided = wide.transpose(0, 1);
  require(error_of([&] { pg->all_reduce(strided); }).find("all_reduce (gloo): float32[3, 2] cpu is not contiguous") !=
              std::string::npos, "a strided tensor is refused: " + error_of([&] { pg->all_reduce(strided); }));
  std::vector<Tensor> too_few(size_t(n + 1), zeros({2}));
  require(error_of([&] { pg->all_gather(too_few, zeros({2})); }).find("has " + std::to_string(n + 1) + " tensors") !=
              std::string::npos, "a wrong number of parts is refused");
  Tensor flags = zeros({2}, {.dtype = kBool});
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

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  try {
    if (scenario == "collectives") collectives();
    else if (scenario == "dead_rank") dead_rank();
    else if (scenario == "store") store();
    else if (scenario == "bad_environment") bad_environment();
    else throw std::runtime_error("unknown scenario \"" + scenario + "\" (collectives, dead_rank, store, "
                                  "bad_environment)");
  } catch (const std::exception& e) {
    std::cerr << "FAILED: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
