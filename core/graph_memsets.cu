// memsets_as_kernels (core/graph_memsets.h): each small memset node of a captured graph becomes a kernel node.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/cuda.h"
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

std::vector<cudaGraphNode_t> neighbours(cudaGraphNode_t node, bool before) {
  auto query = [&](cudaGraphNode_t* nodes, cudaGraphEdgeData* edges, size_t* n) {
    return before ? cudaGraphNodeGetDependencies(node, nodes, edges, n)
                  : cudaGraphNodeGetDependentNodes(node, nodes, edges, n);
  };
  size_t n = 0;
  std::vector<cudaGraphEdgeData> edges;  // asked for too: a query without them fails where an edge has data
  HG_CUDA_CHECK(query(nullptr, nullptr, &n), "cuda graph: memsets as kernels");
  std::vector<cudaGraphNode_t> nodes(n);
  edges.resize(n);
  HG_CUDA_CHECK(query(nodes.data(), edges.data(), &n), "cuda graph: memsets as kernels");
  return nodes;
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
    cudaGraphNode_t replacement = nullptr;
    HG_CUDA_CHECK(cudaGraphAddKernelNode(&replacement, graph, before.data(), before.size(), &kernel),
                  "cuda graph: memsets as kernels");
    for (cudaGraphNode_t next : after)
      HG_CUDA_CHECK(cudaGraphAddDependencies(graph, &replacement, &next, nullptr, 1), "cuda graph: memsets as kernels");
    HG_CUDA_CHECK(cudaGraphDestroyNode(node), "cuda graph: memsets as kernels");
    ++done.nodes;
    done.bytes += bytes;
  }
  return done;
}

}  // namespace halfgrad::cuda
