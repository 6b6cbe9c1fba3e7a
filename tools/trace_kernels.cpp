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
// A program that starts others passes LD_PRELOAD on (a shell, `timeout`, torch.compile's compile workers), and they
// share the file by these rules. TRACE_KERNELS_OUT is made absolute for them all. The run's first process (the first
// to see that path) empties it, unless a live process of another run holds it, and removes the files
// TRACE_KERNELS_OUT.pid<N> that processes no longer alive left. At its first record, a process claims TRACE_KERNELS_OUT
// if it is still empty and no one holds it (an exclusive flock, held to the process's end); else it writes
// TRACE_KERNELS_OUT.pid<N> and says so on stderr. A process without records (the compile workers launch no kernel)
// writes nothing. They once all truncated and wrote the one file, which came back with megabytes of zero bytes. A
// forked copy that does not exec a new program is not traced.
#include <cupti.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>

namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;

std::mutex out_mutex;
std::string main_path;  // TRACE_KERNELS_OUT, absolute
std::string out_path;   // where this process's records go, once it has any
int out = -1;           // its descriptor
bool writing = false;   // false: nothing is traced (the file could not be opened or written)
// Set in the child of a fork, alone on its thread: the parent's records are the parent's, and the mutex may have been
// held by a thread the child does not have.
bool forked_copy = false;
unsigned long long incomplete = 0;  // records handed over before their kernel ended, left out

bool fail(const std::string& what, const std::string& path) {
  std::fprintf(stderr, "trace_kernels: %s %s: %s; nothing more is traced\n", what.c_str(), path.c_str(),
               std::strerror(errno));
  writing = false;
  return false;
}

// The run's first process: main_path emptied and an earlier run's per-process files removed, unless another run's
// live process holds main_path (then every record of this run goes to per-process files).
bool start_run() {
  const int fd = ::open(main_path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return fail("cannot write", main_path);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    std::fprintf(stderr, "trace_kernels: %s is not this run's (%s); its records go to %s.pid<N> files\n",
                 main_path.c_str(), errno == EWOULDBLOCK ? "another traced process is writing it" : std::strerror(errno),
                 main_path.c_str());
    ::close(fd);
    return true;
  }
  if (::ftruncate(fd, 0) != 0) {
    ::close(fd);
    return fail("cannot empty", main_path);
  }
  // Still under the lock: TRACE_KERNELS_OUT.pid<N>[.<n>] of processes no longer alive (an earlier run's).
  namespace fs = std::filesystem;
  const fs::path main(main_path);
  const std::string prefix = main.filename().string() + ".pid";
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(main.parent_path(), error)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
        name.find_first_not_of("0123456789.", prefix.size()) != std::string::npos) {
      continue;
    }
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH && fs::remove(entry.path(), error)) {
      std::fprintf(stderr, "trace_kernels: removed %s, an earlier run's\n", entry.path().c_str());
    }
  }
  ::close(fd);  // and the lock: the first process with records claims the file
  return true;
}

// At the first record (under out_mutex): main_path if this process can claim it, else a file of its own,
// TRACE_KERNELS_OUT.pid<N> (.pid<N>.<n> where a process of the same pid left one earlier in the run).
bool open_out() {
  const int shared = ::open(main_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (shared >= 0) {
    struct stat st{};
    if (::flock(shared, LOCK_EX | LOCK_NB) == 0 && ::fstat(shared, &st) == 0 && st.st_size == 0) {
      out = shared, out_path = main_path;
      return true;
    }
    ::close(shared);  // and the lock with it, where it was taken
  }
  const std::string own = main_path + ".pid" + std::to_string(::getpid());
  for (int n = 0; out < 0; ++n) {
    out_path = n == 0 ? own : own + "." + std::to_string(n);
    out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    if (out < 0 && (errno != EEXIST || n == 1000)) return fail("cannot write", out_path);
  }
  std::fprintf(stderr, "trace_kernels: %s is another process's; the records of process %d go to %s\n",
               main_path.c_str(), int(::getpid()), out_path.c_str());
  return true;
}

// One buffer's records, appended whole or not at all: a failed write is cut back to where it began, so that the file
// ends with a whole line.
void write_all(const std::string& text) {
  const off_t start = ::lseek(out, 0, SEEK_END);
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(out, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      fail("writing failed:", out_path);
      if (start >= 0 && ::ftruncate(out, start) != 0) {
        std::fprintf(stderr, "trace_kernels: %s may end with a partial line\n", out_path.c_str());
      }
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
  if (forked_copy) {  // before the lock, which a thread the child does not have may hold
    std::free(buffer);
    return;
  }
  std::lock_guard<std::mutex> lock(out_mutex);
  std::string text;
  CUpti_Activity* record = nullptr;
  while (writing && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
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

// The child's copy of the descriptor is closed, so that a child outliving its parent does not keep the file's lock.
void stop_writing_in_forked_copy() {
  forked_copy = true;
  if (out >= 0) ::close(out);
  out = -1;
}

// The environment as libc has it: an executable's own getenv and setenv (bash has them) stand in for libc's, and a
// value set through bash's before its main would be overwritten by the environment it then imports.
const char* environment_value(const char* name) {
  const size_t length = std::strlen(name);
  for (char** entry = environ; entry && *entry; ++entry)
    if (std::strncmp(*entry, name, length) == 0 && (*entry)[length] == '=') return *entry + length + 1;
  return nullptr;
}
void set_environment_value(const char* name, const std::string& value) {
  using SetEnv = int (*)(const char*, const char*, int);
  static const auto libc_setenv = reinterpret_cast<SetEnv>(::dlsym(RTLD_NEXT, "setenv"));
  (libc_setenv ? libc_setenv : ::setenv)(name, value.c_str(), 1);
}

// Set up when the library is loaded, before the program's first CUDA call: CUPTI must be enabled before the context
// it is to watch exists.
struct Tracer {
  Tracer() {
    const char* path_variable = environment_value("TRACE_KERNELS_OUT");
    const char* run_variable = environment_value("TRACE_KERNELS_RUN");
    const std::string path = path_variable ? path_variable : "trace_kernels.csv", run = run_variable ? run_variable : "";
    std::error_code error;
    main_path = std::filesystem::absolute(path, error).lexically_normal().string();
    writing = true;
    if (run != main_path) {  // the first process of a run writing main_path
      set_environment_value("TRACE_KERNELS_RUN", main_path);
      if (!start_run()) return;
    }
    if (path != main_path) set_environment_value("TRACE_KERNELS_OUT", main_path);  // one file, whatever the folder
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
