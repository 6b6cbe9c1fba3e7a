// trace_kernels: what each kernel of a run takes on the GPU, CUDA-graph replays included, without serialising them.
// A library to preload into any program (a benchmark, the halfgrad command):
//
//   TRACE_KERNELS_OUT=run.csv LD_PRELOAD=build/libtrace_kernels.so build/bench_lm_step --cuda-graph ...
//   python3 tools/trace_kernels.py run.csv            (each graph's replays: its nodes in order, median µs)
//
// Why not ncu: ncu replays each kernel alone with the caches flushed. Inside a replayed step, kernels meet caches
// that the kernels before them filled or dirtied, and ncu's figures did not hold there: the language model's
// decoder gradient copy took 81 µs under ncu and 96 in the graph (docs/benchmarks.md, session 39). nsys is not
// usable on the project's GPU machine. CUPTI's concurrent-kernel activity records every kernel's start and end on
// the GPU's clock, graph nodes with their graph and node ids, and leaves the kernels running as they would.
//
// Each record is one CSV line, written when CUPTI hands over its buffer: a buffer whose records are all complete
// comes back when full or at an unforced flush every 200 ms, the rest at exit (a forced flush; a program that keeps
// the GPU busy to its end depends on that one, made while its CUDA context may already be gone):
// start_ns,end_ns,graph_id,graph_node_id,kind,name (kind: kernel, memset or memcpy; graph_id 0 outside graphs).
#include <cupti.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;

std::mutex out_mutex;
FILE* out = nullptr;
unsigned long long incomplete = 0;  // records handed over before their kernel ended, left out

void check(CUptiResult result, const char* what) {
  if (result == CUPTI_SUCCESS) return;
  const char* message = nullptr;
  cuptiGetResultString(result, &message);
  std::fprintf(stderr, "trace_kernels: %s failed: %s\n", what, message ? message : "unknown CUPTI error");
}

void CUPTIAPI give_buffer(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void write(unsigned long long start, unsigned long long end, unsigned graph, unsigned long long node, const char* kind,
           const char* name) {
  if (start == 0 || end < start) {  // not yet run when its buffer was handed over: CUPTI gives no times
    ++incomplete;
    return;
  }
  std::fprintf(out, "%llu,%llu,%u,%llu,%s,%s\n", start, end, graph, node, kind, name ? name : "?");
}

void CUPTIAPI take_buffer(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(out_mutex);
  CUpti_Activity* record = nullptr;
  while (out && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel9*>(record);
      write(k->start, k->end, k->graphId, k->graphNodeId, "kernel", k->name);
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      write(m->start, m->end, m->graphId, m->graphNodeId, "memset", "memset");
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      write(m->start, m->end, m->graphId, m->graphNodeId, "memcpy", "memcpy");
    }
  }
  if (out) std::fflush(out);
  std::free(buffer);
}

// Set up when the library is loaded, before the program's first CUDA call: CUPTI must be enabled before the context
// it is to watch exists.
struct Tracer {
  Tracer() {
    const char* path = std::getenv("TRACE_KERNELS_OUT");
    out = std::fopen(path ? path : "trace_kernels.csv", "w");
    if (!out) {
      std::fprintf(stderr, "trace_kernels: cannot write %s; nothing is traced\n", path ? path : "trace_kernels.csv");
      return;
    }
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enabling kernel records");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enabling memset records");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enabling memcpy records");
    check(cuptiActivityRegisterCallbacks(give_buffer, take_buffer), "registering the buffer callbacks");
    // Buffers come back when full or flushed. At exit the CUDA context may already be gone, and with it the records
    // still held, so they are flushed now and then while the program runs. Not forced: a forced flush also hands over
    // the records of kernels still queued, without times (a program that queues 300 ms of graph replays between two
    // synchronisations lost nearly all of them so).
    std::thread([] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        cuptiActivityFlushAll(0);
      }
    }).detach();
  }
  ~Tracer() {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    std::lock_guard<std::mutex> lock(out_mutex);
    if (out) std::fclose(out);
    out = nullptr;
    if (incomplete) std::fprintf(stderr, "trace_kernels: %llu records without times left out\n", incomplete);
  }
} tracer;

}  // namespace
