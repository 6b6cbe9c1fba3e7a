// init_process_group (dist/process_group.h): the settings from the options and torchrun's environment names, the
// store, the backend.
#include "dist/process_group.h"

#include <algorithm>
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

void ProcessGroup::check_tensor(const Tensor& t, const char* op) const {
  HG_CHECK(t.defined(), "{} ({}): the tensor is undefined", op, backend());
  HG_CHECK(t.device() == device(), "{} ({}): {} is not on {}, where this group's collectives take their tensors (gloo: "
           "CPU tensors; nccl: CUDA tensors on the rank's GPU)", op, backend(), t.meta(), device().str());
  HG_CHECK(t.is_contiguous(), "{} ({}): {} is not contiguous: pass t.contiguous() and copy back", op, backend(),
           t.meta());
}

void ProcessGroup::check_parts(const std::vector<Tensor>& parts, const Tensor& like, const char* op,
                               const char* what) const {
  HG_CHECK(int64_t(parts.size()) == size(), "{} ({}): {} has {} tensors, the group {} ranks", op, backend(), what,
           parts.size(), size());
  for (size_t r = 0; r < parts.size(); ++r) {
    check_tensor(parts[r], op);
    HG_CHECK(parts[r].dtype() == like.dtype() && parts[r].shape() == like.shape(), "{} ({}): {}[{}] is {}, unlike {}",
             op, backend(), what, r, parts[r].meta(), like.meta());
  }
}

std::vector<std::string> all_gather_string(ProcessGroup& group, const std::string& value) {
  // The lengths first, so that every rank pads to the longest and each value comes back whole, whatever its bytes.
  const Tensor mine_length = tensor(std::vector<int64_t>{int64_t(value.size())}).to(group.device());
  std::vector<Tensor> lengths;
  for (int r = 0; r < group.size(); ++r) lengths.push_back(empty({1}, {.dtype = kInt64, .device = group.device()}));
  group.all_gather(lengths, mine_length)->wait();
  std::vector<int64_t> length_of;
  for (const Tensor& l : lengths) length_of.push_back(l.cpu().data<int64_t>()[0]);
  const int64_t width = std::max<int64_t>(1, *std::max_element(length_of.begin(), length_of.end()));
  Tensor mine = zeros({width}, {.dtype = kUInt8});
  std::copy(value.begin(), value.end(), mine.data<uint8_t>());
  mine = mine.to(group.device());
  std::vector<Tensor> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(empty({width}, {.dtype = kUInt8, .device = group.device()}));
  group.all_gather(all, mine)->wait();
  std::vector<std::string> values;
  for (size_t r = 0; r < all.size(); ++r) {
    const Tensor bytes = all[r].cpu();
    values.emplace_back(reinterpret_cast<const char*>(bytes.data<uint8_t>()), size_t(length_of[r]));
  }
  return values;
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

bool backend_available(const std::string& backend) {
#ifdef HALFGRAD_HAVE_GLOO
  if (backend == "gloo") return true;
#endif
#ifdef HALFGRAD_HAVE_NCCL
  if (backend == "nccl") return true;
#endif
  return false;
}

std::shared_ptr<ProcessGroup> init_process_group(ProcessGroupOptions o) {
  HG_CHECK(o.backend == "gloo" || o.backend == "nccl", "init_process_group: unknown backend \"{}\" (gloo for CPU "
           "tensors, nccl for CUDA tensors)", o.backend);
  HG_CHECK(backend_available(o.backend), "init_process_group: this halfgrad was built without the {} backend's "
           "library ({}) and must be built again with it", o.backend,
           o.backend == "gloo" ? "Gloo: apt install libgloo-dev" : "NCCL: a CUDA build, with the CUDA toolkit's NCCL, "
           "libnccl-dev, or NCCL_ROOT");
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  if (o.world_size < 0) o.world_size = env_int("WORLD_SIZE", std::nullopt, 1, kMaxInt);
  if (o.rank < 0) o.rank = env_int("RANK", std::nullopt, 0, kMaxInt);
  if (o.master_addr.empty()) {
    const char* addr = std::getenv("MASTER_ADDR");
    o.master_addr = addr && *addr ? addr : "127.0.0.1";
  }
  if (o.master_port < 0) o.master_port = env_int("MASTER_PORT", 29500, 1, 65535);
  if (o.device_index < 0) o.device_index = env_int("LOCAL_RANK", 0, 0, kMaxInt);
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
#ifdef HALFGRAD_HAVE_NCCL
  if (o.backend == "nccl") return make_nccl_group(store, "default", o.rank, o.world_size, o.timeout, o.device_index);
#endif
#ifdef HALFGRAD_HAVE_GLOO
  if (o.backend == "gloo") return make_gloo_group(store, "default", o.rank, o.world_size, o.timeout);
#endif
  HG_FAIL("init_process_group: no {} backend in this build", o.backend);
}

}  // namespace halfgrad::dist
