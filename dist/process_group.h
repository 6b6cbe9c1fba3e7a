#pragma once
// Process groups: the ranks of a data-parallel run and the collectives between them (torch.distributed's
// ProcessGroup). One small interface; the backends behind it:
//   gloo   CPU tensors, over TCP (Gloo, Debian's libgloo-dev): dist/process_group_gloo.cpp
// (NCCL for CUDA tensors is the next backend; see issue 17.)
//
// Every collective is asynchronous: it is queued on the group's own thread, in the order the caller issued it, and
// returns a Work handle; wait() blocks until it is done and rethrows its error. Every rank must issue the same
// collectives in the same order with tensors of the same shape and dtype, as in PyTorch. A tensor must stay alive
// and unchanged until its Work is done.
//
// A rank that dies, or a peer that stops answering, ends the collectives of every other rank within the group's
// timeout with a halfgrad::Error naming the collective, the rank and the cause; never a hang.
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
  virtual void wait() = 0;  // rethrows the collective's error on every call
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string backend() const = 0;

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

 private:
  int rank_, size_;
};

struct ProcessGroupOptions {
  std::string backend = "gloo";
  int rank = -1, world_size = -1;  // -1: from RANK and WORLD_SIZE
  std::string master_addr{};       // empty: MASTER_ADDR, else 127.0.0.1
  int master_port = -1;            // -1: MASTER_PORT, else 29500
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};  // rendezvous and each collective
};

// The group of this process: the options, with what they leave out taken from the environment names torchrun
// uses (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Meets the other ranks through a TcpStore at
// MASTER_ADDR:MASTER_PORT (rank 0 serves it). Missing or inconsistent settings are an error that names them.
std::shared_ptr<ProcessGroup> init_process_group(ProcessGroupOptions options = {});

// The Gloo backend on a store the caller made (tests, several groups on one store under different prefixes).
std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<TcpStore> store, const std::string& prefix, int rank,
                                              int size, std::chrono::milliseconds timeout);

}  // namespace halfgrad::dist
