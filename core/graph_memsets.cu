// memsets_as_kernels (core/graph_memsets.h): each small memset node of a captured graph becomes a kernel node.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/error.h"
#include "core/graph_memsets.h"

namespace halfgrad::cuda {
namespace {

constexpr int kThreads = 256;

// A memset of `rows` rows of `row_bytes` bytes, `pitch` bytes apart, a byte a thread: each byte is the byte of
// `pattern` (the value repeated over 4 bytes) at its address modulo 4, since a memset's rows start at multiples of its
// element size (1, 2 or 4 bytes).
__global__ void __launch_bounds__(kThreads)
    memset_node_kernel(char* dst, size_t pitch, size_t row_bytes, size_t rows, unsigned int pattern) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= row_bytes * rows) return;
  char* p = dst + (i / row_bytes) * pitch + i % row_bytes;
  *p = char(pattern >> (8 * (reinterpret_cast<uintptr_t>(p) % 4)));
}

unsigned int repeated(unsigned int value, unsigned int element_size) {
  if (element_size == 1) return (value & 0xffu) * 0x01010101u;
  if (element_size == 2) return (value & 0xffffu) * 0x00010001u;
  return value;
}

// The nodes before (dependencies) or after (dependents) `node`. The graph API gained edge data in CUDA 12.3 (the _v2
// calls, which CUDA 13 renamed to the plain names); the edges' data are asked for too where it exists, as a query
// without them fails where an edge carries some.
std::vector<cudaGraphNode_t> neighbours(cudaGraphNode_t node, bool before) {
  size_t n = 0;
#if CUDART_VERSION >= 12030
#if CUDART_VERSION >= 13000
  auto query = [&](cudaGraphNode_t* nodes, cudaGraphEdgeData* edges, size_t* count) {
    return before ? cudaGraphNodeGetDependencies(node, nodes, edges, count)
                  : cudaGraphNodeGetDependentNodes(node, nodes, edges, count);
  };
#else
  auto query = [&](cudaGraphNode_t* nodes, cudaGraphEdgeData* edges, size_t* count) {
    return before ? cudaGraphNodeGetDependencies_v2(node, nodes, edges, count)
                  : cudaGraphNodeGetDependentNodes_v2(node, nodes, edges, count);
  };
#endif
  HG_CUDA_CHECK(query(nullptr, nullptr, &n), "cuda graph: memsets as kernels");
  std::vector<cudaGraphNode_t> nodes(n);
  std::vector<cudaGraphEdgeData> edges(n);
  HG_CUDA_CHECK(query(nodes.data(), edges.data(), &n), "cuda graph: memsets as kernels");
#else
  auto query = [&](cudaGraphNode_t* nodes, size_t* count) {
    return before ? cudaGraphNodeGetDependencies(node, nodes, count)
                  : cudaGraphNodeGetDependentNodes(node, nodes, count);
  };
  HG_CUDA_CHECK(query(nullptr, &n), "cuda graph: memsets as kernels");
  std::vector<cudaGraphNode_t> nodes(n);
  HG_CUDA_CHECK(query(nodes.data(), &n), "cuda graph: memsets as kernels");
#endif
  return nodes;
}

// An edge `from` -> `to` without data.
cudaError_t add_edge(cudaGraph_t graph, cudaGraphNode_t from, cudaGraphNode_t to) {
#if CUDART_VERSION >= 13000
  return cudaGraphAddDependencies(graph, &from, &to, nullptr, 1);
#elif CUDART_VERSION >= 12030
  return cudaGraphAddDependencies_v2(graph, &from, &to, nullptr, 1);
#else
  return cudaGraphAddDependencies(graph, &from, &to, 1);
#endif
}

}  // namespace

MemsetsRewritten memsets_as_kernels(cudaGraph_t graph) {
  MemsetsRewritten done;
  size_t count = 0;
  HG_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count), "cuda graph: memsets as kernels");
  std::vector<cudaGraphNode_t> nodes(count);
  HG_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count), "cuda graph: memsets as kernels");
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    HG_CUDA_CHECK(cudaGraphNodeGetType(node, &type), "cuda graph: memsets as kernels");
    if (type != cudaGraphNodeTypeMemset) continue;
    cudaMemsetParams memset{};
    HG_CUDA_CHECK(cudaGraphMemsetNodeGetParams(node, &memset), "cuda graph: memsets as kernels");
    char* dst = static_cast<char*>(memset.dst);
    size_t row_bytes = memset.width * memset.elementSize, rows = memset.height, pitch = memset.pitch;
    unsigned int pattern = repeated(memset.value, memset.elementSize);
    const size_t bytes = row_bytes * rows;
    if (bytes == 0 || bytes > kRewrittenMemsetBytes) continue;

    void* args[] = {&dst, &pitch, &row_bytes, &rows, &pattern};  // copied by cudaGraphAddKernelNode
    cudaKernelNodeParams kernel{};
    kernel.func = reinterpret_cast<void*>(&memset_node_kernel);
    kernel.gridDim = dim3(unsigned((bytes + kThreads - 1) / kThreads));
    kernel.blockDim = dim3(kThreads);
    kernel.kernelParams = args;
    const std::vector<cudaGraphNode_t> before = neighbours(node, true), after = neighbours(node, false);
    const std::string what = fmt::format("cuda graph: the memset of {} rows of {} values of {} bytes as a kernel",
                                         rows, memset.width, memset.elementSize);
    cudaGraphNode_t replacement = nullptr;
    HG_CUDA_CHECK(cudaGraphAddKernelNode(&replacement, graph, before.data(), before.size(), &kernel), what.c_str());
    for (cudaGraphNode_t next : after) HG_CUDA_CHECK(add_edge(graph, replacement, next), what.c_str());
    HG_CUDA_CHECK(cudaGraphDestroyNode(node), what.c_str());
    ++done.nodes;
    done.bytes += bytes;
  }
  return done;
}

}  // namespace halfgrad::cuda
