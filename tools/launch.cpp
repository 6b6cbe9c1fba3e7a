// `halfgrad launch` and the ranks' side of it (tools/launch.h).
#include "tools/launch.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <csignal>
#include <filesystem>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"

namespace halfgrad::cli {
namespace {

// The ranks' process ids, for the signal handler (which may only touch such plain data).
constexpr int kMaxLocalRanks = 1024;
pid_t g_children[kMaxLocalRanks];
volatile sig_atomic_t g_child_count = 0;

extern "C" void pass_signal_on(int signal) {
  for (int k = 0; k < g_child_count; ++k)
    if (g_children[k] > 0) ::kill(g_children[k], signal);
}

// "exit 3", "signal 9 (Killed)"; the shell's status for it.
std::pair<std::string, int> describe_status(int status) {
  if (WIFSIGNALED(status))
    return {fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status))),
            128 + WTERMSIG(status)};
  return {fmt::format("exited with status {}", WEXITSTATUS(status)), WEXITSTATUS(status)};
}

}  // namespace

int launch(const LaunchOptions& o, const std::vector<std::string>& command) {
  HG_CHECK(!command.empty(), "launch: no command to run (halfgrad launch --nproc-per-node N -- train-lm --device cuda "
           "...)");
  HG_CHECK(o.nproc_per_node >= 1 && o.nproc_per_node <= kMaxLocalRanks, "launch: --nproc-per-node must be in 1..{}, "
           "got {}", kMaxLocalRanks, o.nproc_per_node);
  HG_CHECK(o.nnodes >= 1 && o.node_rank >= 0 && o.node_rank < o.nnodes, "launch: --node-rank {} is not in 0..{} "
           "(--nnodes {})", o.node_rank, o.nnodes - 1, o.nnodes);
  HG_CHECK(o.master_port >= 1 && o.master_port <= 65535, "launch: --master-port must be in 1..65535, got {}",
           o.master_port);
  // The commands that run as ranks of one run (bench: its timed suites, data-parallel); others (sweep-classifier,
  // generate) would be N copies of one job.
  HG_CHECK(command[0] == "train-classifier" || command[0] == "train-lm" || command[0] == "bench" ||
           command[0] == "info", "launch: `{}` does not run data-parallel; the ranks run train-classifier, train-lm or "
           "bench (or info, to see the ranks' settings)", command[0]);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const int world = o.nproc_per_node * o.nnodes;

  // Each rank's argv and environment, made before forking (between fork and exec only async-signal-safe calls).
  std::vector<char*> argv{const_cast<char*>(self.c_str())};
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::vector<std::string>> settings(size_t(o.nproc_per_node));
  std::vector<std::vector<char*>> environments(size_t(o.nproc_per_node));
  const char* const ours[] = {"RANK=", "LOCAL_RANK=", "WORLD_SIZE=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT="};
  for (int local = 0; local < o.nproc_per_node; ++local) {
    auto& set = settings[size_t(local)];
    set = {fmt::format("RANK={}", o.node_rank * o.nproc_per_node + local), fmt::format("LOCAL_RANK={}", local),
           fmt::format("WORLD_SIZE={}", world), fmt::format("LOCAL_WORLD_SIZE={}", o.nproc_per_node),
           "MASTER_ADDR=" + o.master_addr, fmt::format("MASTER_PORT={}", o.master_port)};
    auto& env = environments[size_t(local)];
    for (char** e = environ; *e; ++e) {
      bool replaced = false;
      for (const char* name : ours) replaced = replaced || std::strncmp(*e, name, std::strlen(name)) == 0;
      if (!replaced) env.push_back(*e);
    }
    for (std::string& v : set) env.push_back(v.data());
    env.push_back(nullptr);
  }

  std::signal(SIGINT, pass_signal_on);
  std::signal(SIGTERM, pass_signal_on);
  std::fflush(nullptr);  // nothing buffered twice
  const pid_t launcher = ::getpid();
  std::vector<pid_t> pids;
  for (int local = 0; local < o.nproc_per_node; ++local) {
    const pid_t pid = ::fork();
    if (pid < 0) {  // the ranks already started cannot meet the missing one: they go
      for (pid_t p : pids) ::kill(p, SIGKILL);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      HG_FAIL("launch: fork failed for local rank {}: {}", local, std::strerror(errno));
    }
    if (pid == 0) {
      // A process group of its own: a terminal's Ctrl-C reaches the launcher, which passes it on once. The rank goes
      // when the launcher does, even killed outright.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) std::_Exit(1);
      std::signal(SIGINT, SIG_DFL);
      std::signal(SIGTERM, SIG_DFL);
      ::execve(self.c_str(), argv.data(), environments[size_t(local)].data());
      static const char message[] = "halfgrad launch: could not start the rank's program\n";
      [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, message, sizeof message - 1);
      std::_Exit(127);
    }
    pids.push_back(pid);
    g_children[local] = pid;
    g_child_count = local + 1;
  }

  int result = 0, running = o.nproc_per_node;
  bool stopping = false;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) {
      if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
        for (pid_t p : pids)
          if (p > 0) ::kill(p, SIGKILL);
        stop_deadline = std::chrono::steady_clock::time_point::max();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    int local = 0;
    while (local < int(pids.size()) && pids[size_t(local)] != pid) ++local;
    if (local == int(pids.size())) continue;  // not one of ours
    pids[size_t(local)] = -1;
    g_children[local] = -1;
    --running;
    if (status == 0) continue;
    const auto [how, code] = describe_status(status);
    if (result == 0) result = code;
    if (!stopping) {
      stopping = true;
      fmt::print(stderr, "halfgrad launch: rank {} (local rank {}, pid {}) {}{}\n", o.node_rank * o.nproc_per_node + local,
                 local, pid, how, running > 0 ? "; stopping the other ranks" : "");
      for (pid_t p : pids)
        if (p > 0) ::kill(p, SIGTERM);
      stop_deadline = std::chrono::steady_clock::now() +
                      std::chrono::milliseconds(int64_t(o.grace_seconds * 1000));
    }
  }
  g_child_count = 0;
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  return result;
}

std::string launched_environment() {
  auto get = [](const char* name) {
    const char* value = std::getenv(name);
    return std::string(value ? value : "?");
  };
  if (!std::getenv("WORLD_SIZE")) return "";
  return fmt::format("rank {} of {} (local rank {} of {}), rendezvous at {}:{}", get("RANK"), get("WORLD_SIZE"),
                     get("LOCAL_RANK"), get("LOCAL_WORLD_SIZE"), get("MASTER_ADDR"), get("MASTER_PORT"));
}

std::shared_ptr<dist::ProcessGroup> join_launched_group(Device& device, const char* command) {
  const char* world = std::getenv("WORLD_SIZE");
  if (!world || !*world) return nullptr;
  dist::ProcessGroupOptions options{.backend = device.is_cuda() ? "nccl" : "gloo"};
  if (device.is_cuda()) {
    const char* local = std::getenv("LOCAL_RANK");
    HG_CHECK(local && *local, "{}: started by a launcher (WORLD_SIZE is set) without LOCAL_RANK, which picks each "
             "rank's GPU", command);
    HG_CHECK(device.index == 0, "{}: under a launcher --device cuda gives each rank its own GPU (cuda:LOCAL_RANK); "
             "got {}", command, device.str());
  }
  auto group = dist::init_process_group(options);
  if (device.is_cuda()) device = group->device();
  if (group->rank() != 0) {
    std::fflush(stdout);
    HG_CHECK(std::freopen("/dev/null", "w", stdout) != nullptr, "{}: rank {} could not silence its output", command,
             group->rank());
  }
  return group;
}

}  // namespace halfgrad::cli
