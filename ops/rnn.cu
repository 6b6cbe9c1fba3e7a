// rnn on CUDA: the step kernels behind rnn_step_forward_kernel / rnn_step_backward_kernel (ops/rnn.h): cuBLAS for
// the recurrent product (gemm_dense), then cell_kernel, one thread per (row, hidden unit), running the arithmetic of
// ops/rnn_cell.h. ops/rnn.cpp drives them.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda.h"
#include "ops/matmul.h"
#include "ops/rnn.h"
#include "ops/rnn_cell.h"

namespace halfgrad {
namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)); }

cudaStream_t stream_of(Device device) { return cuda::current_stream(device); }

template <RnnKind K, typename Cell> __global__ void __launch_bounds__(kThreads) cell_kernel(Cell cell, int64_t n,
                                                                                           int64_t H) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    cell.template operator()<K>(e / H, e % H);
}

template <typename Cell> void launch_cell(const Cell& cell, RnnKind kind, int64_t B, int64_t H, Device device,
                                          const char* op) {
  const int64_t n = B * H;
  if (n == 0) return;
  rnn_cell::dispatch_kind(kind, [&]<RnnKind K>() {
    cell_kernel<K><<<grid_for(n), kThreads, 0, stream_of(device)>>>(cell, n, H);
    HG_CUDA_CHECK_LAUNCH(op);
  });
}

void rnn_step_forward_cuda(const RnnStepForwardArgs& a) {
  cuda::DeviceGuard guard(a.device);
  const int64_t GH = rnn_gates(a.kind) * a.hidden;
  gemm_dense(a.device, a.storage, rnn_acc_dtype(a.storage), a.batch, GH, a.hidden, a.h_prev, Trans::No, a.w_hh,
             Trans::Yes, a.gh, 0.0);
  dispatch_floating(a.storage, "rnn step", [&]<typename S>() {
    launch_cell(rnn_cell::Forward<S>(a), a.kind, a.batch, a.hidden, a.device, "rnn step");
  });
}

void rnn_step_backward_cuda(const RnnStepBackwardArgs& a) {
  cuda::DeviceGuard guard(a.device);
  const int64_t GH = rnn_gates(a.kind) * a.hidden;
  if (a.dgh_next) {
    gemm_dense(a.device, a.storage, rnn_acc_dtype(a.storage), a.batch, a.hidden, GH, a.dgh_next, Trans::No, a.w_hh,
               Trans::No, a.dh, 1.0);
  }
  dispatch_floating(a.storage, "rnn step backward", [&]<typename S>() {
    launch_cell(rnn_cell::Backward<S>(a), a.kind, a.batch, a.hidden, a.device, "rnn step backward");
  });
}

}  // namespace

HG_REGISTER_KERNEL(rnn_step_forward_kernel, CUDA, rnn_step_forward_cuda);
HG_REGISTER_KERNEL(rnn_step_backward_kernel, CUDA, rnn_step_backward_cuda);

}  // namespace halfgrad
