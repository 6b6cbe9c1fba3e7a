#pragma once
// rnn: a whole recurrent stack (RNN tanh/relu, GRU, LSTM; unidirectional) over a whole sequence as ONE op and
// ONE autograd node, as torch's _cudnn_rnn: inputs, initial states and every layer's weights in; the last layer's
// output at every step and each layer's final states out. nn::RNN / GRU / LSTM (nn/rnn.h) are built on it.
//
// Path from the op to its kernels (ops/rnn.cpp):
//   rnn              ->  per layer: one GEMM for the input projections of all T steps (gemm_kernel[device]),
//                        then rnn_loop_forward_kernel[device], the T steps: each the recurrent product, then one
//                        pass that adds the biases and runs every gate nonlinearity and the state update
//   RnnBackward      ->  per layer: rnn_loop_backward_kernel[device], the steps in reverse (the recurrent
//                        gradient's product, then the gates' gradients); then one GEMM each for the input gradient
//                        and the two weight gradients over all steps, and a sum over rows for each bias; in a pass
//                        with create_graph, the recurrence formed again in ops that record and differentiated by a
//                        pass of its own (rnn_backward_recorded)
// The gate arithmetic itself is written once, for both devices, in ops/rnn_cell.h; the CPU loops are in
// ops/rnn.cpp (per step a GEMM and a pass over the units), the CUDA ones in ops/rnn.cu (a persistent kernel, or
// per step cuBLAS and a cell kernel replayed as a CUDA graph; set_rnn_cuda_loop below). Dropout between
// layers is dropout_kernel with its own Philox counters (ops/dropout.h), the same stream the dropout op would draw.
//
// Precision: every GEMM takes its operands in the storage dtype (the input's: float16, bfloat16, float32 or
// float64) and accumulates in float32 (float64 for float64); the gate pre-activations, the cell state and all
// gate arithmetic are float32 (float64). On the CPU float16/bfloat16 operands are widened to float32 once per
// call and the results rounded back at the end; on CUDA the hidden state of each step is stored in the storage
// dtype (the next step's GEMM operand), as cuDNN does. Autocast category: "lower precision".
#include <cstdint>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// The recurrence (torch.nn's equations; W x + b terms per gate; gate orders as PyTorch's and cuDNN's):
//   RNNTanh  h' = tanh(W_ih x + b_ih + W_hh h + b_hh)                    (RNNReLU: relu instead of tanh)
//   GRU      r = σ(.. r ..), z = σ(.. z ..), n = tanh(W_in x + b_in + r (W_hn h + b_hn)), h' = (1 - z) n + z h
//   LSTM     i, f, o = σ(..), g = tanh(..), c' = f c + i g, h' = o tanh(c')
enum class RnnKind { RNNTanh, RNNReLU, GRU, LSTM };
const char* rnn_kind_name(RnnKind kind);  // "RNN_TANH", "RNN_RELU", "GRU", "LSTM"
int64_t rnn_gates(RnnKind kind);          // 1, 1, 3, 4

struct RnnOptions {
  RnnKind kind = RnnKind::LSTM;
  int64_t num_layers = 1;
  double dropout = 0;  // on the output of every layer but the last, when training; in [0, 1)
  bool training = true;
};

struct RnnResult {
  Tensor output;  // [T, B, H]: the last layer's h at every step
  Tensor h;       // [num_layers, B, H]: each layer's h after the last step
  Tensor c;       // LSTM: [num_layers, B, H], each layer's cell state after the last step; else undefined
  TensorList tensors() const { return c.defined() ? TensorList{output, h, c} : TensorList{output, h}; }
};

// input [T, B, I]; h0 (and, for an LSTM, c0) [num_layers, B, H] or undefined for zeros; weights: per layer
// w_ih [G H, in], w_hh [G H, H] and, with biases, b_ih [G H], b_hh [G H] (4 tensors a layer, or 2 without
// biases), in torch.nn.RNNBase's order; in = I for layer 0, H above. Every tensor has the input's floating dtype
// and device.
RnnResult rnn(const Tensor& input, const Tensor& h0, const Tensor& c0, const TensorList& weights,
              const RnnOptions& options);

// How CUDA runs a layer's time loop (ops/rnn.cu). Persistent: one kernel per layer and direction wherever the
// problem fits it: every block keeps a slice of W_hh on chip for all T steps and owns a few hidden units, and the
// blocks meet at a grid-wide barrier after each step. Steps: per step a cuBLAS GEMM and a cell kernel, the T steps
// captured once as a CUDA graph and replayed. Fastest (the default): the first time a problem is met both run and
// the faster is kept, as conv2d and batch_norm choose their algorithms. All three compute the same arithmetic.
enum class RnnCudaLoop { Fastest, Persistent, Steps };
void set_rnn_cuda_loop(RnnCudaLoop loop);
RnnCudaLoop rnn_cuda_loop();

// How many groups of batch rows the persistent kernels split a batch into (ops/rnn.cu): a block then owns its units
// for one group's rows, and reads only those rows of h (forward) or of the gate gradients (backward) from L2 each
// step, with twice the units per block for two groups. 0 (the default) chooses: 2 groups from a batch of 16 up where
// the kernels take them, else 1. Other values are for measuring and testing the partitions against each other.
void set_rnn_batch_groups(int groups);
int rnn_batch_groups();

// ---- kernels (core/dispatch.h): one layer's whole time loop, T steps over a batch of B rows and H hidden units.
// Pointers are raw and dense: rows of G H values (gate k's unit j at k H + j) or of H values; a sequence [T, ...]
// is its T steps' rows one after the other. `S` is the storage dtype (GEMM operands: h, weights, gradients of the
// pre-activations), `A` = float32 (float64 for float64) the accumulation dtype (pre-activations, cell states,
// saved gates). ops/rnn_cell.h says what the cell computes.
//
// A step is the recurrent product and the cell: forward gh = h_prev W_hh^T, then the cell; backward dh +=
// dgh_next W_hh (the gradient reaching h through the next step's product), then the cell's backward.
struct RnnLoopForwardArgs {
  RnnKind kind;
  DType storage;
  Device device;
  int64_t steps, batch, hidden;
  const void* w_hh;  // S [G H, H]
  const void* gi;    // A [T, B, G H]: W_ih x (no bias)
  void* gh;          // A [B, G H]: scratch for each step's W_hh h_prev (no bias), read by the cell (the per-step
                     // loop; the persistent kernel keeps its products on chip)
  const void* b_ih;  // S [G H] or null
  const void* b_hh;  // S [G H] or null
  const void* h0;    // S [B, H]
  void* out;         // S [T, B, H]: h after each step
  void* cells;       // A [T + 1, B, H] (LSTM): in, c0 in row 0; out, c after each step in rows 1..T
  void* gates;       // A [T, B, G H]: the activations, saved for backward; null when not training a graph
  void* hn;          // A [T, B, H]: GRU's W_hn h + b_hn, saved for backward; null likewise
};

struct RnnLoopBackwardArgs {
  RnnKind kind;
  DType storage;
  Device device;
  int64_t steps, batch, hidden;
  const void* w_hh;   // S [G H, H]
  const void* dy;     // S [T, B, H]: the gradient of each step's output from above
  void* dh;           // A [B, H]: in, the final state's gradient; out, the part of h0's gradient that does not go
                      // through the first step's W_hh (GRU dh z, else 0)
  void* dc;           // A [B, H] (LSTM): in, c_T's gradient; out, c0's
  const void* gates;  // A [T, B, G H]: saved activations
  const void* cells;  // A [T + 1, B, H] (LSTM): c0, then c after each step
  const void* h0;     // S [B, H]
  const void* out;    // S [T, B, H]: h after each step (GRU's h_prev)
  const void* hn;     // A [T, B, H] (GRU)
  void* dgi;          // S [T, B, G H]: the gradients of W_ih x's pre-activations
  void* dgh;          // S [T, B, G H]: GRU, of W_hh h's (differs in the n gate); null for the others (== dgi)
};

using RnnLoopForwardKernel = void (*)(const RnnLoopForwardArgs&);
using RnnLoopBackwardKernel = void (*)(const RnnLoopBackwardArgs&);
extern KernelTable<RnnLoopForwardKernel> rnn_loop_forward_kernel;
extern KernelTable<RnnLoopBackwardKernel> rnn_loop_backward_kernel;



}  // namespace halfgrad
