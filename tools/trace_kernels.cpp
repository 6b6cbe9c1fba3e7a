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
//
// A program that starts others passes LD_PRELOAD on (a shell, `timeout`, torch.compile's compile workers): the first
// process of the run empties TRACE_KERNELS_OUT, the first of them to have records claims it (under a lock, while it is
// still empty), each other one that has records writes TRACE_KERNELS_OUT.<pid>, and one with none (the workers: they
// launch no kernel) writes nothing. They once all truncated and wrote the one file, which came back with megabytes of
// zero bytes in it. A forked copy that does not start a new program writes nothing.
#include <cupti.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;

std::mutex out_mutex;
std::string out_path;       // where this process's records go
int out = -1;               // its descriptor, once opened
bool writing = false;       // false: the file could not be opened or written
// Set in the child of a fork, alone on its thread: the parent's file and records are the parent's (O_CLOEXEC closes
// the descriptor at the child's exec), and the mutex may have been held by a thread the child does not have.
bool forked_copy = false;
unsigned long long incomplete = 0;  // records handed over before their kernel ended, left out

bool open_failed(const std::string& path) {
  std::fprintf(stderr, "trace_kernels: cannot write %s; nothing is traced\n", path.c_str());
  writing = false;
  return false;
}

// At the first record: TRACE_KERNELS_OUT if no process of the run has claimed it yet (empty, and no one holds its lock,
// which this process then holds to its end), else TRACE_KERNELS_OUT.<pid>.
bool open_out() {
  const int shared = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  struct stat st{};
  if (shared >= 0 && ::flock(shared, LOCK_EX | LOCK_NB) == 0 && ::fstat(shared, &st) == 0 && st.st_size == 0) {
    out = shared;
    return true;
  }
  if (shared >= 0) ::close(shared);  // and the lock with it, where it was taken
  out_path += "." + std::to_string(::getpid());
  out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  return out >= 0 || open_failed(out_path);
}

void write_all(const std::string& text) {
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(out, text.data() + done, text.size() - done);
    if (n <= 0) {
      std::fprintf(stderr, "trace_kernels: writing %s failed; the rest of the run is not traced\n", out_path.c_str());
      writing = false;
      return;
    }
    done += size_t(n);
  }
}

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

void append(std::string& text, unsigned long long start, unsigned long long end, unsigned graph,
            unsigned long long node, const char* kind, const char* name) {
  if (start == 0 || end < start) {  // not yet run when its buffer was handed over: CUPTI gives no times
    ++incomplete;
    return;
  }
  char numbers[96];
  std::snprintf(numbers, sizeof numbers, "%llu,%llu,%u,%llu,", start, end, graph, node);
  text.append(numbers).append(kind).append(",").append(name ? name : "?").append("\n");
}

// A buffer's records, written with one write(2) and no stdio buffer, which a forked copy would write a second time.
void CUPTIAPI take_buffer(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(out_mutex);
  std::string text;
  CUpti_Activity* record = nullptr;
  while (writing && !forked_copy && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel9*>(record);
      append(text, k->start, k->end, k->graphId, k->graphNodeId, "kernel", k->name);
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      append(text, m->start, m->end, m->graphId, m->graphNodeId, "memset", "memset");
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      append(text, m->start, m->end, m->graphId, m->graphNodeId, "memcpy", "memcpy");
    }
  }
  if (writing && !text.empty() && (out >= 0 || open_out())) write_all(text);
  std::free(buffer);
}

void stop_writing_in_forked_copy() { forked_copy = true; }

// Set up when the library is loaded, before the program's first CUDA call: CUPTI must be enabled before the context
// it is to watch exists.
struct Tracer {
  Tracer() {
    const char* path = std::getenv("TRACE_KERNELS_OUT");
    out_path = path ? path : "trace_kernels.csv";
    writing = true;
    if (!std::getenv("TRACE_KERNELS_RUN")) {  // the run's first process: no earlier run's records stay
      ::setenv("TRACE_KERNELS_RUN", std::to_string(::getpid()).c_str(), 1);
      const int emptied = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (emptied < 0) {
        open_failed(out_path);
        return;
      }
      ::close(emptied);
    }
    pthread_atfork(nullptr, nullptr, stop_writing_in_forked_copy);
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
    if (forked_copy) return;
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    std::lock_guard<std::mutex> lock(out_mutex);
    if (out >= 0) ::close(out);
    out = -1;
    writing = false;
    if (incomplete) std::fprintf(stderr, "trace_kernels: %llu records without times left out\n", incomplete);
  }
} tracer;

}  // namespace
