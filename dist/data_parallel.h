#pragma once
// Data parallelism (torch.nn.parallel.DistributedDataParallel): every rank holds the same model, runs forward and
// backward on its own part of the global batch, and ends backward with the gradients averaged over the ranks, so the
// optimizer steps that follow keep every rank's parameters identical.
//
//   auto group = dist::init_process_group({.backend = "nccl"});   // or "gloo" for CPU tensors
//   auto ddp = std::make_shared<nn::DistributedDataParallel>(model, group);
//   for (...) {  // each rank its own shard of the data (data::LoaderOptions rank, world_size)
//     Tensor loss = cross_entropy((*ddp)(x), y);
//     loss.backward();      // gradients averaged over the ranks by the time backward() returns
//     opt.step();           // the optimizer over model->parameters(), as without data parallelism
//     opt.zero_grad();
//   }
//
// What happens, in order:
// - At construction every rank checks that its parameters and buffers have the same names, shapes and dtypes, in the
//   same order, as rank 0's (a mismatch is an error on every rank, naming the first difference), then takes rank
//   0's values, so every rank starts from the same model.
// - The parameters are put in buckets of at most bucket_cap_mb each (one dtype and device per bucket), in reverse
//   order of registration: roughly the order backward produces their gradients, last layer first.
// - Each parameter has a post-accumulate hook. When every gradient of a bucket is ready, and every earlier bucket has
//   been launched, the bucket's gradients are copied into one flat tensor, divided by the world size and all-reduced
//   asynchronously, while backward goes on with the earlier layers: communication overlaps computation. Every rank
//   launches the buckets in the same order, as the collectives require.
// - When backward has run its last node (autograd's queue_callback), the reductions are waited for and the averaged
//   gradients copied back into each parameter's .grad; with gradient_as_bucket_view, .grad becomes the view of its
//   bucket that holds the average instead (no copy back).
// Half gradients (a model in float16 or bfloat16, O2/O3) travel in their dtype: buckets hold one dtype each.
// Under no_sync() backward only accumulates into .grad; the first backward after it reduces the sum (gradient
// accumulation, as PyTorch's no_sync). A parameter with no gradient in a pass (a branch not taken) is an error
// naming it, unless find_unused_parameters: then its bucket is reduced with zeros in its place, and a parameter that
// no rank used keeps no gradient.
// Buffers (batch norm's running statistics) are rank 0's at the start of each forward() (broadcast_buffers); a model
// whose forward takes other arguments calls its own method through module() and sync_buffers() itself if it has
// buffers.
//
// Not thread-safe: one backward at a time per model, as in training loops.
#include <memory>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "nn/module.h"

namespace halfgrad::nn {

// Every rank's `tensors` (every rank the same list, in the same order) become rank 0's: one broadcast per dtype and
// device, through a flat copy. The module form: its parameters, then its buffers. (DistributedDataParallel does this
// at construction; a caller that copies the parameters elsewhere first, as mixed precision O2's float32 masters, calls
// it before making those copies.)
void broadcast_from_rank0(dist::ProcessGroup& group, const TensorList& tensors);
void broadcast_from_rank0(dist::ProcessGroup& group, const Module& module);

// The names of `module`'s parameters (and its buffers, with_buffers) whose contents differ between the ranks of `group`
// (empty: every rank holds the same, bit for bit). Each rank hashes each tensor's bytes on the host (a copy of the
// model leaves the device), and two all-reduces compare the hashes (their smallest and largest over the ranks); every
// rank gets the same answer. Buffers are left out by default: in training each rank's running statistics are its own
// between forwards (DistributedDataParallel broadcasts rank 0's at the start of each). What `--check-replicas N` runs
// every N steps, and bench's data-parallel lines once.
std::vector<std::string> replica_mismatches(dist::ProcessGroup& group, const Module& module, bool with_buffers = false);

struct DistributedDataParallelOptions {
  double bucket_cap_mb = 25;  // MiB of gradients per all-reduce (a larger parameter gets a bucket of its own)
  bool broadcast_buffers = true;
  bool find_unused_parameters = false;
  // As PyTorch's: after each reducing backward, a (contiguous) parameter's .grad is a view of its bucket's flat tensor,
  // which holds the average, instead of a copy of it: half the copies (a language model's two 86 MB gradients, ~0.12
  // ms a step on an H200). The caveat is PyTorch's too: the next reducing backward overwrites the buckets, so a .grad
  // kept from an earlier step (not set to none by zero_grad) changes with them.
  bool gradient_as_bucket_view = false;
};

class DistributedDataParallel : public Module {
 public:
  DistributedDataParallel(ModulePtr module, std::shared_ptr<dist::ProcessGroup> group,
                          DistributedDataParallelOptions options = {});
  ~DistributedDataParallel() override;

  // sync_buffers() (with broadcast_buffers), then the wrapped module's forward.
  Tensor forward(const Tensor& input) override;
  // Every rank's buffers become rank 0's.
  void sync_buffers();

  Module& module() { return *module_; }
  const ModulePtr& module_ptr() const { return module_; }
  dist::ProcessGroup& group() { return *group_; }

  // While a NoSync is alive, backward passes accumulate gradients locally without reducing them.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // The buckets, each as its parameters' names in the order they sit in the flat tensor.
  std::vector<std::vector<std::string>> bucket_parameter_names() const;
  // For each bucket of the last reducing backward pass: how many of the model's gradients were ready when it was
  // launched. A bucket launched before all of them were ready overlapped the rest of backward.
  std::vector<size_t> last_launch_points() const;

  std::string type_name() const override { return "DistributedDataParallel"; }

 private:
  struct Reducer;
  ModulePtr module_;
  std::shared_ptr<dist::ProcessGroup> group_;
  DistributedDataParallelOptions options_;
  std::shared_ptr<Reducer> reducer_;  // the hooks hold it weakly: they do nothing once this object is gone
};

}  // namespace halfgrad::nn
