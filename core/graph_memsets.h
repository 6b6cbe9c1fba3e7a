#pragma once
// A captured CUDA graph's small memset nodes rewritten as kernel nodes, for cuda::Graph (core/cuda_graph.cpp) to call
// between the end of a capture and the instantiation: a step's graph and autotuning's timing graphs alike. Why: in a
// replayed ResNet-18 step (docs/benchmarks.md, session 60) the GPU idled ~1.3 µs before and ~2.2 µs after each of the
// 43-50 memsets cuDNN queues before its convolutions and batch norms (a few bytes each), where a kernel follows a
// kernel after ~0.6 µs; as kernel nodes they took the step from 3.53 to 3.46 ms on an H100. A large memset is left
// alone: its own time, not the idle time around it, is what it costs.
#include <cstddef>

typedef struct CUgraph_st* cudaGraph_t;  // as the CUDA headers declare it (core/cuda.h's way: no CUDA header here)

namespace halfgrad::cuda {

// Memsets of at most this many bytes are rewritten (cuDNN's zero a few counters each).
inline constexpr size_t kRewrittenMemsetBytes = 64 * 1024;

struct MemsetsRewritten {
  int nodes = 0;     // memset nodes replaced by kernel nodes
  size_t bytes = 0;  // what they write, in all
};

// Replaces each memset node of at most kRewrittenMemsetBytes at the top level of `graph` (not inside child graphs) by
// a kernel node that writes the same bytes, after the same nodes and before the same nodes. An edge that carried data
// (a port, a programmatic edge) becomes a plain one, which orders at least as much. Before instantiation.
MemsetsRewritten memsets_as_kernels(cudaGraph_t graph);

}  // namespace halfgrad::cuda
