// The Gloo backend of ProcessGroup (dist/process_group.h): CPU tensors, a full mesh of TCP connections that Gloo
// sets up through our TcpStore, and Gloo's collective algorithms. The reductions are ours (one function per dtype and
// op, half types through float), so every dtype halfgrad has is reduced the same way on every rank.
//
// Collectives run one after another on the group's own thread, in the order they were issued; the caller gets a Work
// and goes on. reduce_scatter is an all_reduce of the inputs followed by each rank keeping its part: simple, and
// size() times the bytes a ring reduce-scatter would move (Gloo 0.5's new-style API has none).
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/context.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include "core/error.h"
#include "dist/process_group.h"

namespace halfgrad::dist {
namespace {

// Gloo's rendezvous store on ours.
class GlooStore : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(std::shared_ptr<TcpStore> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override { store_->set(key, data); }
  std::vector<char> get(const std::string& key) override { return store_->get(key); }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override { store_->wait(keys); }

 private:
  std::shared_ptr<TcpStore> store_;
};

// c[i] = a[i] op b[i] for n elements of T, in T's opmath type (float for the 16-bit types).
template <typename T, ReduceOp kOp> void reduce_elements(void* c, const void* a, const void* b, size_t n) {
  using A = opmath_t<T>;
  T* out = static_cast<T*>(c);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) {
    const A u = A(x[i]), v = A(y[i]);
    A r;
    if constexpr (kOp == ReduceOp::Sum) r = u + v;
    else if constexpr (kOp == ReduceOp::Product) r = u * v;
    else if constexpr (kOp == ReduceOp::Min) r = v < u ? v : u;
    else r = v > u ? v : u;
    out[i] = T(r);
  }
}

gloo::AllreduceOptions::Func reduce_function(DType dtype, ReduceOp op, const char* name) {
  return dispatch_numeric(dtype, name, [&]<typename T>() -> gloo::AllreduceOptions::Func {
    switch (op) {
      case ReduceOp::Sum: return reduce_elements<T, ReduceOp::Sum>;
      case ReduceOp::Product: return reduce_elements<T, ReduceOp::Product>;
      case ReduceOp::Min: return reduce_elements<T, ReduceOp::Min>;
      case ReduceOp::Max: return reduce_elements<T, ReduceOp::Max>;
    }
    HG_FAIL("{}: unknown reduce op", name);
  });
}

class GlooWork : public Work {
 public:
  bool is_completed() const override {
    std::lock_guard lock(mutex_);
    return done_;
  }
  void wait() override {
    std::unique_lock lock(mutex_);
    finished_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  void finish(std::exception_ptr error) {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
      error_ = std::move(error);
    }
    finished_.notify_all();
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  std::exception_ptr error_;
};

// The address this rank's Gloo connections use: GLOO_SOCKET_IFNAME's interface when set (as in PyTorch), the
// loopback address when the store is on this machine's loopback (every rank on one machine), else this machine's
// host name.
gloo::transport::tcp::attr transport_address(const std::string& store_host) {
  gloo::transport::tcp::attr attr;
  if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface && *iface) {
    attr.iface = iface;
  } else if (store_host == "localhost" || store_host.rfind("127.", 0) == 0) {
    attr.hostname = "127.0.0.1";
  } else {
    char name[256] = {};
    HG_CHECK(::gethostname(name, sizeof name - 1) == 0, "init_process_group: gethostname failed");
    attr.hostname = name;
  }
  return attr;
}

class GlooGroup : public ProcessGroup {
 public:
  GlooGroup(std::shared_ptr<TcpStore> store, const std::string& prefix, int rank, int size,
            std::chrono::milliseconds timeout)
      : ProcessGroup(rank, size), store_(std::move(store)), timeout_(timeout) {
    try {
      auto device = gloo::transport::tcp::CreateDevice(transport_address(store_->options().host));
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
      context->setTimeout(timeout);
      GlooStore gloo_store(store_);
      gloo::rendezvous::PrefixStore prefixed(prefix, gloo_store);
      context->connectFullMesh(prefixed, device);
      context_ = std::move(context);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      HG_FAIL("init_process_group (gloo): rank {} of {} could not connect to the other ranks: {}", rank, size,
              e.what());
    }
    worker_ = std::thread([this] { run(); });
  }

  ~GlooGroup() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    queued_.notify_all();
    worker_.join();
  }

  std::string backend() const override { return "gloo"; }
  Device device() const override { return Device::cpu(); }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    check_tensor(tensor, "all_reduce");
    auto reduce = reduce_function(tensor.dtype(), op, "all_reduce");
    return enqueue("all_reduce", [this, tensor, reduce] {
      if (tensor.numel() == 0) return;  // the same on every rank: nothing to send
      gloo::AllreduceOptions o(context_);
      set_buffers(o, tensor.data_ptr(), size_t(tensor.numel()), tensor.dtype());
      o.setReduceFunction(reduce);
      o.setTag(next_tag());
      o.setTimeout(timeout_);
      gloo::allreduce(o);
    });
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    check_tensor(tensor, "broadcast");
    HG_CHECK(root >= 0 && root < size(), "broadcast: root {} is not a rank (0..{})", root, size() - 1);
    return enqueue("broadcast", [this, tensor, root] {
      gloo::BroadcastOptions o(context_);
      const size_t bytes = size_t(tensor.numel()) * element_size(tensor.dtype());
      if (bytes == 0) return;
      if (rank() == root) o.setInput(static_cast<char*>(tensor.data_ptr()), bytes);
      o.setOutput(static_cast<char*>(tensor.data_ptr()), bytes);
      o.setRoot(root);
      o.setTag(next_tag());
      o.setTimeout(timeout_);
      gloo::broadcast(o);
    });
  }

  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    check_tensor(input, "all_gather");
    check_parts(outputs, input, "all_gather", "outputs");
    // Gloo gathers into one buffer, rank by rank; the parts are copied out of it.
    return enqueue("all_gather", [this, outputs, input] {
      const size_t bytes = size_t(input.numel()) * element_size(input.dtype());
      if (bytes == 0) return;
      std::vector<char> gathered(bytes * size_t(size()));
      gloo::AllgatherOptions o(context_);
      o.setInput(static_cast<char*>(input.data_ptr()), bytes);
      o.setOutput(gathered.data(), gathered.size());
      o.setTag(next_tag());
      o.setTimeout(timeout_);
      gloo::allgather(o);
      for (int r = 0; r < size(); ++r)
        std::memcpy(outputs[size_t(r)].data_ptr(), gathered.data() + bytes * size_t(r), bytes);
    });
  }

  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs, ReduceOp op) override {
    check_tensor(output, "reduce_scatter");
    check_parts(inputs, output, "reduce_scatter", "inputs");
    auto reduce = reduce_function(output.dtype(), op, "reduce_scatter");
    return enqueue("reduce_scatter", [this, output, inputs, reduce] {
      const size_t bytes = size_t(output.numel()) * element_size(output.dtype());
      if (bytes == 0) return;
      std::vector<char> all(bytes * size_t(size()));
      for (int r = 0; r < size(); ++r)
        std::memcpy(all.data() + bytes * size_t(r), inputs[size_t(r)].data_ptr(), bytes);
      gloo::AllreduceOptions o(context_);
      set_buffers(o, all.data(), size_t(output.numel()) * size_t(size()), output.dtype());
      o.setReduceFunction(reduce);
      o.setTag(next_tag());
      o.setTimeout(timeout_);
      gloo::allreduce(o);
      std::memcpy(output.data_ptr(), all.data() + bytes * size_t(rank()), bytes);
    });
  }

  std::shared_ptr<Work> barrier() override {
    return enqueue("barrier", [this] {
      gloo::BarrierOptions o(context_);
      o.setTag(next_tag());
      o.setTimeout(timeout_);
      gloo::barrier(o);
    });
  }

 private:
  // An in-place all_reduce of n elements at `data`: Gloo's options take typed pointers (the reduction knows the dtype).
  static void set_buffers(gloo::AllreduceOptions& o, void* data, size_t n, DType dtype) {
    dispatch_numeric(dtype, "all_reduce", [&]<typename T>() {
      T* typed = static_cast<T*>(data);
      o.setInput(typed, n);
      o.setOutput(typed, n);
    });
  }


  uint32_t next_tag() { return tag_++; }

  std::shared_ptr<Work> enqueue(const char* name, std::function<void()> collective) {
    auto work = std::make_shared<GlooWork>();
    {
      std::lock_guard lock(mutex_);
      queue_.push_back({name, std::move(collective), work});
    }
    queued_.notify_one();
    return work;
  }

  // The group's thread: each collective in turn; its failure (a peer gone, a timeout) is the Work's error, and
  // poisons the group: every later collective fails with the first cause, as the ranks are no longer in step.
  void run() {
    while (true) {
      Task task;
      {
        std::unique_lock lock(mutex_);
        queued_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      if (!broken_.empty()) {
        error = std::make_exception_ptr(Error(fmt::format("{} (gloo): rank {} of {}: the group failed earlier: {}",
                                                          task.name, rank(), size(), broken_)));
      } else {
        try {
          task.run();
        } catch (const std::exception& e) {
          broken_ = fmt::format("{} failed: {}", task.name, e.what());
          error = std::make_exception_ptr(Error(fmt::format("{} (gloo): rank {} of {}: {} (a rank has exited or stopped "
                                                            "answering within the timeout, {} ms)", task.name, rank(),
                                                            size(), e.what(), timeout_.count())));
        }
      }
      task.work->finish(error);
    }
  }

  struct Task {
    const char* name = "";
    std::function<void()> run;
    std::shared_ptr<GlooWork> work;
  };

  // Kept for the group's life: on rank 0 it is the server the other ranks are still meeting through when this rank's
  // own rendezvous is done.
  std::shared_ptr<TcpStore> store_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::Context> context_;
  uint32_t tag_ = 0;
  std::string broken_;  // the first failure, read and written on the worker thread only
  std::mutex mutex_;
  std::condition_variable queued_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<TcpStore> store, const std::string& prefix, int rank,
                                              int size, std::chrono::milliseconds timeout) {
  HG_CHECK(store != nullptr, "make_gloo_group: no store");
  HG_CHECK(size >= 1 && rank >= 0 && rank < size, "make_gloo_group: rank {} is not in 0..{}", rank, size - 1);
  return std::make_shared<GlooGroup>(std::move(store), prefix, rank, size, timeout);
}

}  // namespace halfgrad::dist
