// `halfgrad launch` and the ranks' side of it (tools/launch.h).
#include "tools/launch.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
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
  HG_CHECK(command[0] != "launch", "launch: the command is itself `launch`: give the halfgrad command each rank runs");
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const int world = o.nproc_per_node * o.nnodes;

  std::signal(SIGINT, pass_signal_on);
  std::signal(SIGTERM, pass_signal_on);
  std::fflush(nullptr);  // nothing buffered twice
  std::vector<pid_t> pids;
  for (int local = 0; local < o.nproc_per_node; ++local) {
    const pid_t pid = ::fork();
    HG_CHECK(pid >= 0, "launch: fork failed for local rank {}", local);
    if (pid == 0) {
      std::signal(SIGINT, SIG_DFL);
      std::signal(SIGTERM, SIG_DFL);
      auto set = [](const char* name, const std::string& value) { ::setenv(name, value.c_str(), 1); };
      set("RANK", std::to_string(o.node_rank * o.nproc_per_node + local));
      set("LOCAL_RANK", std::to_string(local));
      set("WORLD_SIZE", std::to_string(world));
      set("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node));
      set("MASTER_ADDR", o.master_addr);
      set("MASTER_PORT", std::to_string(o.master_port));
      std::vector<char*> argv{const_cast<char*>(self.c_str())};
      for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(self.c_str(), argv.data());
      std::fprintf(stderr, "halfgrad launch: could not start %s for local rank %d\n", self.c_str(), local);
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
