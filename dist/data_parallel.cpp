// nn::DistributedDataParallel (dist/data_parallel.h): the start-up checks and broadcast, the buckets, and the reducer
// that the parameters' post-accumulate hooks drive during backward.
#include "dist/data_parallel.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>

#include "core/autograd.h"
#include "core/error.h"
#include "ops/copy.h"

namespace halfgrad::nn {

namespace {

// One line per tensor, "kind name dtype[shape]", for comparing models across ranks (not the device: each rank's GPU
// is its own).
std::string describe(const NamedTensors& params, const NamedTensors& buffers) {
  std::string text;
  for (const auto& [name, t] : params)
    text += fmt::format("parameter {} {}{}\n", name, dtype_name(t.dtype()), shape_str(t.shape()));
  for (const auto& [name, t] : buffers)
    text += fmt::format("buffer {} {}{}\n", name, dtype_name(t.dtype()), shape_str(t.shape()));
  return text;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

// Rank 0's bytes on every rank (two broadcasts: the length, then the bytes).
std::string broadcast_text(dist::ProcessGroup& group, const std::string& text) {
  Tensor length = tensor(std::vector<int64_t>{int64_t(text.size())}).to(group.device());
  group.broadcast(length, 0)->wait();
  const int64_t n = length.cpu().data<int64_t>()[0];
  Tensor bytes = zeros({n}, {.dtype = kUInt8});
  if (group.rank() == 0) std::copy(text.begin(), text.end(), bytes.data<uint8_t>());
  bytes = bytes.to(group.device());
  group.broadcast(bytes, 0)->wait();
  bytes = bytes.cpu();
  return std::string(reinterpret_cast<const char*>(bytes.data<uint8_t>()), size_t(n));
}

// splitmix64's finaliser: every input bit moves every output bit.
uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The tensor's bytes in 8-byte words (the tail zero-padded), each mixed before it is folded in FNV-1a's way, then the
// byte count. Unmixed, a word's top bit (a float64's sign) passes through the multiplications unchanged, and two words
// differing only there would cancel.
uint64_t content_hash(const Tensor& t) {
  const Tensor host = t.detach().cpu().contiguous();
  const size_t n = size_t(host.numel()) * element_size(host.dtype());
  const auto* bytes = static_cast<const unsigned char*>(host.data_ptr());
  constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t word = 0;
    std::memcpy(&word, bytes + i, std::min<size_t>(8, n - i));
    h = (h ^ mix(word)) * kPrime;
  }
  return mix(h ^ n);
}

}  // namespace

void broadcast_from_rank0(dist::ProcessGroup& group, const TensorList& tensors) {
  if (group.size() == 1) return;
  NoGradGuard no_grad;
  std::map<std::pair<int, std::string>, TensorList> groups;
  for (const Tensor& t : tensors) groups[{int(t.dtype()), t.device().str()}].push_back(t);
  for (auto& [key, members] : groups) {
    int64_t total = 0;
    for (const Tensor& t : members) total += t.numel();
    Tensor flat = empty({total}, {.dtype = members[0].dtype(), .device = members[0].device()});
    int64_t offset = 0;
    for (const Tensor& t : members) {
      flat.narrow(0, offset, t.numel()).view(t.shape()).copy_(t);
      offset += t.numel();
    }
    group.broadcast(flat, 0)->wait();
    offset = 0;
    for (Tensor t : members) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.shape()));
      offset += t.numel();
    }
  }
}

void broadcast_from_rank0(dist::ProcessGroup& group, const Module& module) {
  TensorList everything = module.parameters();
  for (const Tensor& b : module.buffers()) everything.push_back(b);
  broadcast_from_rank0(group, everything);
}

std::vector<std::string> replica_mismatches(dist::ProcessGroup& group, const Module& module, bool with_buffers) {
  NamedTensors everything = module.named_parameters();
  if (with_buffers)
    for (auto& named : module.named_buffers()) everything.push_back(std::move(named));
  std::vector<int64_t> hashes;  // int64 for the collectives: only equality matters
  for (const auto& [name, t] : everything) hashes.push_back(std::bit_cast<int64_t>(content_hash(t)));
  // The counts first: ranks holding different numbers of tensors would otherwise meet in all-reduces of different
  // sizes.
  Tensor counts = tensor(std::vector<int64_t>{int64_t(hashes.size()), -int64_t(hashes.size())}).to(group.device());
  group.all_reduce(counts, dist::ReduceOp::Max)->wait();
  counts = counts.cpu();
  HG_CHECK(counts.data<int64_t>()[0] == -counts.data<int64_t>()[1], "replica_mismatches: rank {} compares {} tensors, "
           "but the ranks hold between {} and {}: their models differ in structure", group.rank(), hashes.size(),
           -counts.data<int64_t>()[1], counts.data<int64_t>()[0]);
  std::vector<std::string> differ;
  if (hashes.empty()) return differ;
  Tensor smallest = tensor(hashes).to(group.device()), largest = smallest.clone();
  group.all_reduce(smallest, dist::ReduceOp::Min)->wait();
  group.all_reduce(largest, dist::ReduceOp::Max)->wait();
  const Tensor same = smallest.eq(largest).cpu();
  for (size_t i = 0; i < everything.size(); ++i)
    if (!same.data<bool>()[i]) differ.push_back(everything[i].first);
  return differ;
}

// The state the hooks share. Lives as long as the DistributedDataParallel (the hooks hold it weakly).
struct DistributedDataParallel::Reducer {
  struct Bucket {
    std::vector<size_t> members;  // indices into params
    std::vector<int64_t> offsets;  // where each member starts in flat
    Tensor flat;
    size_t pending = 0;  // gradients of this pass not yet ready
    size_t launch_point = 0;
    std::shared_ptr<dist::Work> work;
  };

  std::shared_ptr<dist::ProcessGroup> group;
  DistributedDataParallelOptions options;
  NamedTensors params;  // (name, parameter) in registration order
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;  // per parameter
  std::vector<bool> ready;        // per parameter, this pass
  size_t ready_count = 0;
  size_t next_bucket = 0;  // the next bucket to launch: buckets launch in index order on every rank
  uint64_t pass = 0;       // the backward pass being reduced (core/autograd.h's numbers); 0: none
  bool sync = true;        // false under no_sync()

  void gradient_ready(size_t i) {
    if (!sync) return;
    // A pass that ended in an error never ran its callback: a new pass starts afresh, whatever that one left.
    if (pass != current_backward_pass()) start_pass();
    HG_CHECK(!ready[i], "DistributedDataParallel: parameter {} received its gradient twice in one backward pass",
             params[i].first);
    ready[i] = true;
    ++ready_count;
    --buckets[bucket_of[i]].pending;
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) launch(next_bucket++);
  }

  void start_pass() {
    pass = current_backward_pass();
    std::fill(ready.begin(), ready.end(), false);
    ready_count = 0;
    next_bucket = 0;
    for (Bucket& b : buckets) {
      // A reduction left by a pass that failed still reads and writes the flat tensor: it finishes first. (Its error,
      // if any, is the group's, and the next collective reports it.)
      if (b.work) {
        try {
          b.work->wait();
        } catch (const std::exception&) {
        }
      }
      b.work.reset();
      b.pending = b.members.size();
    }
    // `this` outlives the pass: the DistributedDataParallel that owns it cannot be destroyed inside backward().
    queue_callback([this, pass = pass] {
      if (this->pass == pass) finish_pass();
    });
  }

  // The bucket's gradients into its flat tensor (zeros for a gradient this rank has not got), divided by the world
  // size, and its all-reduce launched.
  void launch(size_t b) {
    NoGradGuard no_grad;
    Bucket& bucket = buckets[b];
    TensorList parts, grads;  // copied in one launch a batch (copy_each_): a copy each cost ~0.8 ms a ResNet-50 step
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      const Tensor& p = params[bucket.members[k]].second;
      Tensor part = bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view(p.shape());
      const Tensor grad = p.grad();
      if (!grad.defined()) part.zero_();
      else if (grad.data_ptr() != part.data_ptr()) parts.push_back(part), grads.push_back(grad);
      // else: the bucket's view (gradient_as_bucket_view): what this pass added went into it in place
    }
    copy_each_(parts, grads);
    if (group->size() > 1) bucket.flat.mul_(1.0 / group->size());
    bucket.launch_point = ready_count;
    bucket.work = group->all_reduce(bucket.flat);
  }

  // The end of backward: every bucket launched (a parameter without a gradient is an error unless
  // find_unused_parameters), the reductions waited for, the averages written back into .grad.
  void finish_pass() {
    pass = 0;
    if (next_bucket < buckets.size()) {
      std::vector<std::string> missing;
      for (size_t i = 0; i < params.size(); ++i)
        if (!ready[i]) missing.push_back(params[i].first);
      HG_CHECK(options.find_unused_parameters, "DistributedDataParallel: rank {}: {} parameter(s) received no gradient "
               "in this backward pass: {}. Every rank's reductions wait for them. If the model does not use every "
               "parameter in every step, pass find_unused_parameters = true; else leave them out of the wrapped "
               "module", group->rank(), missing.size(), fmt::join(missing, ", "));
      while (next_bucket < buckets.size()) launch(next_bucket++);
    }
    // With find_unused_parameters, which parameters any rank used: one more (small) all-reduce, after the buckets.
    Tensor used_anywhere;
    if (options.find_unused_parameters) {
      std::vector<int32_t> used(params.size());
      // Used: a gradient from this pass, or one accumulated under no_sync since the last reduction.
      for (size_t i = 0; i < params.size(); ++i) used[i] = ready[i] || params[i].second.grad().defined() ? 1 : 0;
      used_anywhere = tensor(used).to(group->device());
      group->all_reduce(used_anywhere, dist::ReduceOp::Max)->wait();
      used_anywhere = used_anywhere.cpu();
    }
    NoGradGuard no_grad;
    for (Bucket& bucket : buckets) {
      bucket.work->wait();
      TensorList grads, averages;
      for (size_t k = 0; k < bucket.members.size(); ++k) {
        const size_t i = bucket.members[k];
        const Tensor& p = params[i].second;
        const bool used = p.grad().defined() || (used_anywhere.defined() && used_anywhere.data<int32_t>()[i] != 0);
        if (!used) continue;
        Tensor average = bucket.flat.narrow(0, bucket.offsets[k], p.numel()).view(p.shape());
        if (options.gradient_as_bucket_view && p.is_contiguous()) {  // .grad keeps its parameter's layout
          p.set_grad(average);
          continue;
        }
        if (!p.grad().defined()) {  // an aligned-rows parameter's gradient in its layout: the optimizer reads it there
          const bool aligned = kept_memory_format(p) == MemoryFormat::AlignedRows;
          p.set_grad(aligned ? empty(p.shape(), {.dtype = p.dtype(), .device = p.device()}, MemoryFormat::AlignedRows)
                             : empty_like(p));
        }
        grads.push_back(p.grad());
        averages.push_back(average);
      }
      copy_each_(grads, averages);
    }
  }
};

DistributedDataParallel::DistributedDataParallel(ModulePtr module, std::shared_ptr<dist::ProcessGroup> group,
                                                 DistributedDataParallelOptions options)
    : module_(register_module("module", std::move(module))), group_(std::move(group)), options_(options) {
  HG_CHECK(group_ != nullptr, "DistributedDataParallel: no process group");
  HG_CHECK(options_.bucket_cap_mb > 0, "DistributedDataParallel: bucket_cap_mb must be positive, got {}",
           options_.bucket_cap_mb);
  auto reducer = std::make_shared<Reducer>();
  reducer->group = group_;
  reducer->options = options_;
  for (auto& [name, p] : module_->named_parameters())
    if (p.requires_grad()) reducer->params.emplace_back(name, p);
  const NamedTensors buffers = module_->named_buffers();
  for (const auto& [name, t] : reducer->params)
    HG_CHECK(t.device() == group_->device(), "DistributedDataParallel: parameter {} is {}, but the {} group reduces "
             "tensors on {}", name, t.meta(), group_->backend(), group_->device().str());

  // The same model everywhere: rank 0's description against ours, then every rank learns whether any differs.
  const std::string mine = describe(reducer->params, buffers);
  const std::string theirs = broadcast_text(*group_, mine);
  std::string difference;
  if (mine != theirs) {
    const auto a = lines_of(theirs), b = lines_of(mine);
    size_t k = 0;
    while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
    difference = fmt::format("rank 0 has \"{}\" where rank {} has \"{}\"", k < a.size() ? a[k] : "nothing more",
                             group_->rank(), k < b.size() ? b[k] : "nothing more");
  }
  Tensor differs = tensor(std::vector<int32_t>{difference.empty() ? 0 : 1 + group_->rank()}).to(group_->device());
  group_->all_reduce(differs, dist::ReduceOp::Max)->wait();
  const int32_t first_different = differs.cpu().data<int32_t>()[0];
  HG_CHECK(first_different == 0, "DistributedDataParallel: the ranks' models differ (their parameters and buffers must "
           "have the same names, shapes and dtypes in the same order): {}", difference.empty()
               ? fmt::format("rank {} differs from rank 0 (its error says how)", first_different - 1) : difference);

  // Rank 0's values everywhere.
  broadcast_from_rank0(*group_, *module_);

  // Buckets: the parameters in reverse order, a new bucket when the dtype or device changes or the cap is reached.
  const double cap_bytes = options_.bucket_cap_mb * 1024 * 1024;
  reducer->bucket_of.resize(reducer->params.size());
  reducer->ready.resize(reducer->params.size());
  double bucket_bytes = 0;
  for (size_t n = reducer->params.size(); n-- > 0;) {
    const Tensor& p = reducer->params[n].second;
    const double bytes = double(p.numel()) * element_size(p.dtype());
    auto& bs = reducer->buckets;
    const bool fits = !bs.empty() && bucket_bytes + bytes <= cap_bytes &&
                      reducer->params[bs.back().members[0]].second.dtype() == p.dtype();
    if (!fits) {
      bs.emplace_back();
      bucket_bytes = 0;
    }
    bs.back().offsets.push_back(bs.back().members.empty() ? 0 : bs.back().offsets.back() +
                                reducer->params[bs.back().members.back()].second.numel());
    bs.back().members.push_back(n);
    bucket_bytes += bytes;
    reducer->bucket_of[n] = bs.size() - 1;
  }
  for (auto& bucket : reducer->buckets) {
    const Tensor& last = reducer->params[bucket.members.back()].second;
    bucket.flat = empty({bucket.offsets.back() + last.numel()}, {.dtype = last.dtype(), .device = last.device()});
  }

  std::weak_ptr<Reducer> weak = reducer;
  for (size_t i = 0; i < reducer->params.size(); ++i) {
    reducer->params[i].second.register_post_accumulate_grad_hook([weak, i](const Tensor&) {
      if (auto r = weak.lock()) r->gradient_ready(i);
    });
  }
  reducer_ = std::move(reducer);
}

DistributedDataParallel::~DistributedDataParallel() = default;

Tensor DistributedDataParallel::forward(const Tensor& input) {
  if (options_.broadcast_buffers) sync_buffers();
  return module_->forward(input);
}

void DistributedDataParallel::sync_buffers() { broadcast_from_rank0(*group_, module_->buffers()); }

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp) : ddp_(ddp), previous_(ddp.reducer_->sync) {
  ddp_.reducer_->sync = false;
}
DistributedDataParallel::NoSync::~NoSync() { ddp_.reducer_->sync = previous_; }

std::vector<std::vector<std::string>> DistributedDataParallel::bucket_parameter_names() const {
  std::vector<std::vector<std::string>> names;
  for (const auto& bucket : reducer_->buckets) {
    names.emplace_back();
    for (size_t i : bucket.members) names.back().push_back(reducer_->params[i].first);
  }
  return names;
}

std::vector<size_t> DistributedDataParallel::last_launch_points() const {
  std::vector<size_t> points;
  for (const auto& bucket : reducer_->buckets) points.push_back(bucket.launch_point);
  return points;
}

}  // namespace halfgrad::nn
