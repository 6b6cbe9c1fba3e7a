#pragma once
// Process groups: the ranks of a data-parallel run and the collectives between them (torch.distributed's
// ProcessGroup). One small interface; the backends behind it:
//   gloo   CPU tensors, over TCP (Gloo, Debian's libgloo-dev): dist/process_group_gloo.cpp
//   nccl   CUDA tensors, one GPU a rank (NCCL, in a CUDA build): dist/process_group_nccl.cpp
//
// Every collective is asynchronous and returns a Work handle. Every rank must issue the same collectives in the same
// order with tensors of the same shape and dtype, as in PyTorch. The tensors stay alive (the Work holds them) and
// must stay unchanged until the collective is done.
// - gloo: the collectives run in turn on the group's own thread; wait() blocks the host until it is done and
//   rethrows its error.
// - nccl: a collective starts after the work already queued on the caller's current stream and runs on the group's
//   stream; wait() makes the caller's current stream wait for it (the host goes on, as PyTorch's) and throws if the
//   group has failed.
//
// A rank that dies, or a peer that stops answering, ends the collectives of every other rank within the group's
// timeout with a halfgrad::Error naming the collective, the rank and the cause; never a hang. (nccl: a watchdog thread
// aborts the communicator, which ends its kernels, and says why on stderr at once; the next call on the group throws.)
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/store.h"

namespace halfgrad::dist {

enum class ReduceOp { Sum, Product, Min, Max };
const char* reduce_op_name(ReduceOp op);

// The handle of a queued collective.
class Work {
 public:
  virtual ~Work() = default;
  virtual bool is_completed() const = 0;
  // gloo: returns when the collective is done. nccl: orders the current stream after it, as PyTorch's, and returns at
  // once: is_completed() stays false until the GPU gets there (reading the result, which waits for the stream, does).
  // Throws what the collective (gloo), or the group since it failed (nccl), reported: on every call.
  virtual void wait() = 0;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string backend() const = 0;
  // Where the tensors its collectives take live (the CPU for gloo).
  virtual Device device() const = 0;

  // In place: every rank's `tensor` becomes the reduction over the ranks.
  virtual std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op = ReduceOp::Sum) = 0;
  // In place: every rank's `tensor` becomes rank `root`'s.
  virtual std::shared_ptr<Work> broadcast(Tensor& tensor, int root = 0) = 0;
  // outputs[r] (size() tensors, each like `input`) becomes rank r's input.
  virtual std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) = 0;
  // `output` becomes the reduction over the ranks of their inputs[rank()] (size() tensors, each like `output`).
  virtual std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                               ReduceOp op = ReduceOp::Sum) = 0;
  virtual std::shared_ptr<Work> barrier() = 0;

 protected:
  ProcessGroup(int rank, int size) : rank_(rank), size_(size) {}
  // The checks of every backend's arguments: `t` defined, on device() and contiguous; `parts` size() tensors, each
  // like `like`. Errors name the collective ("all_reduce"), the backend and the tensor.
  void check_tensor(const Tensor& t, const char* op) const;
  void check_parts(const std::vector<Tensor>& parts, const Tensor& like, const char* op, const char* what) const;

 private:
  int rank_, size_;
};

struct ProcessGroupOptions {
  std::string backend = "gloo";
  int rank = -1, world_size = -1;  // -1: from RANK and WORLD_SIZE
  std::string master_addr{};       // empty: MASTER_ADDR, else 127.0.0.1
  int master_port = -1;            // -1: MASTER_PORT, else 29500
  int device_index = -1;           // nccl: the GPU of this rank; -1: LOCAL_RANK, else 0
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};  // rendezvous and each collective
};

// The group of this process: the options, with what they leave out taken from the environment names torchrun
// uses (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK). Meets the other ranks through a TcpStore at
// MASTER_ADDR:MASTER_PORT (rank 0 serves it). Missing or inconsistent settings are an error that names them.
std::shared_ptr<ProcessGroup> init_process_group(ProcessGroupOptions options = {});

// Every rank's `value`, rank r's at index r (torch.distributed.all_gather_object, for strings): two all_gathers, the
// lengths, then the bytes padded to the longest. Every rank of the group calls it.
std::vector<std::string> all_gather_string(ProcessGroup& group, const std::string& value);

// Whether this build has the backend ("gloo", "nccl").
bool backend_available(const std::string& backend);

// The Gloo backend on a store the caller made (tests, several groups on one store under different prefixes).
std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<TcpStore> store, const std::string& prefix, int rank,
                                              int size, std::chrono::milliseconds timeout);
// The NCCL backend (CUDA tensors on GPU `device_index`), its unique id shared through the store.
std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<TcpStore> store, const std::string& prefix, int rank,
                                              int size, std::chrono::milliseconds timeout, int device_index);

}  // namespace halfgrad::dist
