// The NCCL backend of ProcessGroup (dist/process_group.h): CUDA tensors, one GPU a rank, NCCL's collectives on a
// stream of the group's own. Built where the CUDA build finds NCCL (CMakeLists.txt).
//
// Ordering, as PyTorch's ProcessGroupNCCL: a collective waits on the caller's current stream (an event), so it reads
// what the caller's kernels wrote; it runs on the group's stream, so the caller's later kernels overlap it; Work::wait
// makes the caller's current stream wait for it (the host goes on). A Work keeps its tensors alive until it is done.
//
// Failures: the communicator is non-blocking, so nothing in this file waits on NCCL without a deadline. A watchdog
// thread looks at every collective in flight; one that has not finished within the timeout, or an asynchronous
// error NCCL reports (a peer gone), aborts the communicator (ncclCommAbort ends its kernels), is written to stderr at
// once, and fails every later call on this group with an error naming the collective, the rank and the cause.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "core/cuda.h"
#include "core/error.h"
#include "dist/process_group.h"

namespace halfgrad::dist {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_dtype(DType dtype, const char* op) {
  switch (dtype) {
    case kFloat64: return ncclFloat64;
    case kFloat32: return ncclFloat32;
    case kFloat16: return ncclFloat16;
    case kBFloat16: return ncclBfloat16;
    case kInt64: return ncclInt64;
    case kInt32: return ncclInt32;
    case kUInt8: return ncclUint8;
    default: HG_FAIL("{} (nccl): {} tensors cannot be reduced by NCCL", op, dtype_name(dtype));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Product: return ncclProd;
    case ReduceOp::Min: return ncclMin;
    case ReduceOp::Max: return ncclMax;
  }
  return ncclSum;
}

class NcclGroup;

// A CUDA event, destroyed when the last of its holders (a Work, the watchdog) lets go of it.
struct Event {
  cudaEvent_t event = nullptr;
  Event() { HG_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "nccl"); }
  ~Event() { cudaEventDestroy(event); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclGroup> group, const char* name, TensorList keep)
      : group_(std::move(group)), name_(name), keep_(std::move(keep)) {}
  ~NcclWork() override;
  bool is_completed() const override;
  void wait() override;

  std::shared_ptr<Event> done = std::make_shared<Event>();  // recorded on the group's stream after the collective

 private:
  std::shared_ptr<NcclGroup> group_;
  const char* name_;
  TensorList keep_;  // the tensors NCCL reads and writes, alive until the stream that uses them has passed `done`
  bool waited_ = false;
};

class NcclGroup : public ProcessGroup, public std::enable_shared_from_this<NcclGroup> {
 public:
  NcclGroup(std::shared_ptr<TcpStore> store, const std::string& prefix, int rank, int size,
            std::chrono::milliseconds timeout, int device_index)
      : ProcessGroup(rank, size), store_(std::move(store)), timeout_(timeout), device_(Device::cuda(device_index)) {
    HG_CHECK(device_index >= 0 && device_index < cuda::device_count(), "init_process_group (nccl): rank {} was given "
             "GPU {}, but {} GPU(s) are visible (LOCAL_RANK picks the GPU of a rank: one GPU per rank on each machine)",
             rank, device_index, cuda::device_count());
    cuda::DeviceGuard guard(device_index);
    // The unique id: rank 0 makes it, the others read it from the store (which times out if rank 0 never does).
    ncclUniqueId id;
    const std::string key = prefix + "/nccl_unique_id";
    if (rank == 0) {
      check_init(ncclGetUniqueId(&id), "ncclGetUniqueId");
      store_->set(key, std::vector<char>(id.internal, id.internal + sizeof id.internal));
    } else {
      const std::vector<char> bytes = store_->get(key);
      HG_CHECK(bytes.size() == sizeof id.internal, "init_process_group (nccl): the store's NCCL id has {} bytes, not {}",
               bytes.size(), sizeof id.internal);
      std::memcpy(id.internal, bytes.data(), bytes.size());
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns at once; wait_ready() polls with a deadline
    check_init(ncclCommInitRankConfig(&comm_, size, id, rank, &config), "ncclCommInitRankConfig");
    wait_ready("init_process_group", Clock::now());
    HG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "init_process_group (nccl)");
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclGroup() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    watchdog_.join();
    cuda::DeviceGuard guard(device_.index);
    if (comm_) {  // null once aborted
      // Queued collectives finish first (within the timeout, else the communicator is aborted): ncclCommFinalize
      // flushes them, then the communicator can go.
      const auto started = Clock::now();
      while (cudaStreamQuery(stream_) == cudaErrorNotReady && Clock::now() - started < timeout_)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (cudaStreamQuery(stream_) == cudaErrorNotReady) {
        ncclCommAbort(comm_);
      } else {
        try {
          if (ncclCommFinalize(comm_) == ncclInProgress) wait_ready("~ProcessGroup", Clock::now());
          ncclCommDestroy(comm_);
        } catch (const Error&) {  // wait_ready aborted it: a destructor says so and goes on
          std::fprintf(stderr, "halfgrad: NCCL process group, rank %d: finalizing timed out; aborted\n", rank());
        }
      }
    }
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string backend() const override { return "nccl"; }
  Device device() const override { return device_; }

  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op) override {
    check_tensor(tensor, "all_reduce");
    const ncclDataType_t type = nccl_dtype(tensor.dtype(), "all_reduce");
    return launch("all_reduce", {tensor}, [&] {
      return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), size_t(tensor.numel()), type, nccl_op(op), comm_,
                           stream_);
    });
  }

  std::shared_ptr<Work> broadcast(Tensor& tensor, int root) override {
    check_tensor(tensor, "broadcast");
    HG_CHECK(root >= 0 && root < size(), "broadcast (nccl): root {} is not a rank (0..{})", root, size() - 1);
    const ncclDataType_t type = nccl_dtype(tensor.dtype(), "broadcast");
    return launch("broadcast", {tensor}, [&] {
      return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), size_t(tensor.numel()), type, root, comm_, stream_);
    });
  }

  // One broadcast from each rank, grouped: the parts need not be one buffer.
  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override {
    check_tensor(input, "all_gather");
    check_parts(outputs, input, "all_gather", "outputs");
    const ncclDataType_t type = nccl_dtype(input.dtype(), "all_gather");
    TensorList keep(outputs.begin(), outputs.end());
    keep.push_back(input);
    return launch("all_gather", keep, [&] {
      ncclResult_t r = ncclGroupStart();
      for (int k = 0; k < size() && r == ncclSuccess; ++k) {
        const void* send = k == rank() ? input.data_ptr() : outputs[size_t(k)].data_ptr();
        r = ncclBroadcast(send, outputs[size_t(k)].data_ptr(), size_t(input.numel()), type, k, comm_, stream_);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  // One reduce to each rank, grouped.
  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs, ReduceOp op) override {
    check_tensor(output, "reduce_scatter");
    check_parts(inputs, output, "reduce_scatter", "inputs");
    const ncclDataType_t type = nccl_dtype(output.dtype(), "reduce_scatter");
    TensorList keep(inputs.begin(), inputs.end());
    keep.push_back(output);
    return launch("reduce_scatter", keep, [&] {
      ncclResult_t r = ncclGroupStart();
      for (int k = 0; k < size() && r == ncclSuccess; ++k) {
        void* receive = k == rank() ? output.data_ptr() : nullptr;  // used on the root alone
        r = ncclReduce(inputs[size_t(k)].data_ptr(), receive, size_t(output.numel()), type, nccl_op(op), k, comm_,
                       stream_);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  // An all_reduce of one value that the host waits for (within the timeout): every rank has reached it.
  std::shared_ptr<Work> barrier() override {
    Tensor token = zeros({1}, {.dtype = kInt32, .device = device_});
    auto work = all_reduce(token, ReduceOp::Sum);
    const auto deadline = Clock::now() + timeout_;
    while (!work->is_completed()) {
      throw_if_broken("barrier");
      HG_CHECK(Clock::now() < deadline, "barrier (nccl): rank {} of {}: the other ranks did not arrive within {} ms",
               rank(), size(), timeout_.count());
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return work;
  }

  void throw_if_broken(const char* name) const {
    std::lock_guard lock(mutex_);
    HG_CHECK(broken_.empty(), "{} (nccl): rank {} of {}: the group failed earlier: {}", name, rank(), size(), broken_);
  }
  bool broken() const {
    std::lock_guard lock(mutex_);
    return !broken_.empty();
  }
  Device device_of_group() const { return device_; }

 private:
  // Queues a collective: after the caller's current stream, on the group's stream, watched until done.
  template <typename Call> std::shared_ptr<Work> launch(const char* name, TensorList keep, Call&& call) {
    throw_if_broken(name);
    cuda::DeviceGuard guard(device_.index);
    std::lock_guard comm_lock(comm_mutex_);
    HG_CHECK(comm_ != nullptr, "{} (nccl): rank {} of {}: the communicator was aborted", name, rank(), size());
    auto work = std::make_shared<NcclWork>(shared_from_this(), name, std::move(keep));
    cudaEvent_t ready = nullptr;
    HG_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), name);
    HG_CUDA_CHECK(cudaEventRecord(ready, cuda::current_stream(device_.index)), name);
    HG_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0), name);
    cudaEventDestroy(ready);  // destroying a recorded event is safe: the wait above already holds it
    const auto started = Clock::now();
    ncclResult_t r = call();
    if (r == ncclInProgress) r = wait_ready(name, started);
    HG_CHECK(r == ncclSuccess, "{} (nccl): rank {} of {}: {} ({})", name, rank(), size(), ncclGetErrorString(r),
             ncclGetLastError(comm_));
    HG_CUDA_CHECK(cudaEventRecord(work->done->event, stream_), name);
    {
      std::lock_guard lock(mutex_);
      in_flight_.push_back({name, work->done, started});
    }
    wake_.notify_all();
    return work;
  }

  static void check_init(ncclResult_t r, const char* call) {
    HG_CHECK(r == ncclSuccess || r == ncclInProgress, "init_process_group (nccl): {} failed: {}", call,
             ncclGetErrorString(r));
  }

  // A non-blocking communicator's last call done, within the timeout (else the communicator is aborted).
  ncclResult_t wait_ready(const char* name, Clock::time_point started) {
    ncclResult_t state = ncclInProgress;
    while (true) {
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclInProgress) break;
      if (Clock::now() - started > timeout_) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        HG_FAIL("{} (nccl): rank {} of {}: NCCL did not finish within {} ms (a rank has exited, was never started, or "
                "stopped answering)", name, rank(), size(), timeout_.count());
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    HG_CHECK(state == ncclSuccess, "{} (nccl): rank {} of {}: {}", name, rank(), size(), ncclGetErrorString(state));
    return state;
  }


  // The watchdog: every collective in flight, until it is done; a late one or an asynchronous error breaks the group.
  // It never holds mutex_ (the queue) and comm_mutex_ (the communicator) together: launch() takes them the other way.
  void watch() {
    cuda::DeviceGuard guard(device_.index);
    while (true) {
      Flight oldest;
      {
        std::unique_lock lock(mutex_);
        wake_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_; });
        if (stopping_) return;
        while (!in_flight_.empty() && cudaEventQuery(in_flight_.front().done->event) != cudaErrorNotReady)
          in_flight_.pop_front();
        if (in_flight_.empty() || !broken_.empty()) continue;
        oldest = in_flight_.front();
      }
      std::string cause;
      {
        std::lock_guard comm_lock(comm_mutex_);
        if (!comm_) continue;
        ncclResult_t state = ncclSuccess;
        ncclCommGetAsyncError(comm_, &state);
        if (state != ncclSuccess && state != ncclInProgress)
          cause = fmt::format("{} failed: {}", oldest.name, ncclGetErrorString(state));
        else if (Clock::now() - oldest.started > timeout_)
          cause = fmt::format("{} did not finish within {} ms (a rank has exited or stopped answering)", oldest.name,
                              timeout_.count());
        if (cause.empty()) continue;
        ncclCommAbort(comm_);  // ends the stuck kernels, so nothing waits on them forever
        comm_ = nullptr;
      }
      std::fprintf(stderr, "halfgrad: NCCL process group, rank %d of %d: %s; the communicator was aborted\n", rank(),
                   size(), cause.c_str());
      std::lock_guard lock(mutex_);
      broken_ = cause;
      in_flight_.clear();
    }
  }

  // A collective in flight. The watchdog holds its event until it is done, Work or no Work: a host that waits on the
  // result some other way (a copy to the CPU) is still watched.
  struct Flight {
    const char* name = "";
    std::shared_ptr<Event> done;
    Clock::time_point started;
  };

  std::shared_ptr<TcpStore> store_;
  std::chrono::milliseconds timeout_;
  Device device_;
  ncclComm_t comm_ = nullptr;  // null once aborted; used under comm_mutex_ once the watchdog runs
  std::mutex comm_mutex_;
  cudaStream_t stream_ = nullptr;
  mutable std::mutex mutex_;  // in_flight_, broken_, stopping_
  std::condition_variable wake_;
  std::deque<Flight> in_flight_;
  std::string broken_;
  bool stopping_ = false;
  std::thread watchdog_;
};

NcclWork::~NcclWork() {
  if (waited_) return;
  // Whoever reuses these tensors' memory next must not overtake the collective: the caller's stream waits for it.
  const int device = group_->device_of_group().index;
  cuda::DeviceGuard guard(device);
  cudaStreamWaitEvent(cuda::current_stream(device), done->event, 0);
}

bool NcclWork::is_completed() const { return cudaEventQuery(done->event) == cudaSuccess; }

void NcclWork::wait() {
  group_->throw_if_broken(name_);
  const int device = group_->device_of_group().index;
  cuda::DeviceGuard guard(device);
  HG_CUDA_CHECK(cudaStreamWaitEvent(cuda::current_stream(device), done->event, 0), name_);
  waited_ = true;
}

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<TcpStore> store, const std::string& prefix, int rank,
                                              int size, std::chrono::milliseconds timeout, int device_index) {
  HG_CHECK(store != nullptr, "make_nccl_group: no store");
  HG_CHECK(size >= 1 && rank >= 0 && rank < size, "make_nccl_group: rank {} is not in 0..{}", rank, size - 1);
  return std::make_shared<NcclGroup>(std::move(store), prefix, rank, size, timeout, device_index);
}

}  // namespace halfgrad::dist
