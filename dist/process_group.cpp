// init_process_group (dist/process_group.h): the settings from the options and torchrun's environment names, the
// store, the backend.
#include "dist/process_group.h"

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <optional>

#include "core/error.h"

namespace halfgrad::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Product: return "product";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

namespace {

// An integer environment variable in [lo, hi]; `fallback` when unset (nullopt fallback: required).
int env_int(const char* name, std::optional<int> fallback, int lo, int hi) {
  const char* text = std::getenv(name);
  if (!text || !*text) {
    HG_CHECK(fallback.has_value(), "init_process_group: {} is not set (and not given): launch with `halfgrad launch` "
             "or torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT", name);
    return *fallback;
  }
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  HG_CHECK(errno == 0 && end != text && *end == '\0' && v >= lo && v <= hi,
           "init_process_group: {}=\"{}\" is not an integer in {}..{}", name, text, lo, hi);
  return int(v);
}

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(ProcessGroupOptions o) {
  HG_CHECK(o.backend == "gloo", "init_process_group: unknown backend \"{}\" (gloo; nccl is not built yet)", o.backend);
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  if (o.world_size < 0) o.world_size = env_int("WORLD_SIZE", std::nullopt, 1, kMaxInt);
  if (o.rank < 0) o.rank = env_int("RANK", std::nullopt, 0, kMaxInt);
  if (o.master_addr.empty()) {
    const char* addr = std::getenv("MASTER_ADDR");
    o.master_addr = addr && *addr ? addr : "127.0.0.1";
  }
  if (o.master_port < 0) o.master_port = env_int("MASTER_PORT", 29500, 1, 65535);
  HG_CHECK(o.world_size >= 1 && o.rank >= 0 && o.rank < o.world_size,
           "init_process_group: rank {} is not in 0..{} (world size {})", o.rank, o.world_size - 1, o.world_size);
  HG_CHECK(o.timeout.count() > 0, "init_process_group: the timeout must be positive, got {} ms", o.timeout.count());
  auto store = std::make_shared<TcpStore>(
      StoreOptions{.host = o.master_addr, .port = o.master_port, .rank = o.rank, .timeout = o.timeout});
  // Every rank says how many ranks it expects: a rank started with another WORLD_SIZE is named, not left to hang.
  const std::string expected = std::to_string(o.world_size);
  store->set("world_size_of/" + std::to_string(o.rank), std::vector<char>(expected.begin(), expected.end()));
  if (o.rank == 0) {
    for (int r = 1; r < o.world_size; ++r) {
      const std::vector<char> theirs = store->get("world_size_of/" + std::to_string(r));
      HG_CHECK(std::string(theirs.begin(), theirs.end()) == expected, "init_process_group: rank {} was started with "
               "WORLD_SIZE {}, rank 0 with {}", r, std::string(theirs.begin(), theirs.end()), expected);
    }
  }
  return make_gloo_group(store, "default", o.rank, o.world_size, o.timeout);
}

}  // namespace halfgrad::dist
