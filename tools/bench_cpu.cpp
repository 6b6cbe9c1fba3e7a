// bench_cpu: halfgrad's CPU speed on the operations the linear-regression example is made of.
// A benchmark program, not a test: it prints a table. tools/bench_torch_cpu.py prints the same rows for
// PyTorch's CPU build, so the two outputs compare line by line (docs/benchmarks.md has both).
//
//   matmul / linear rows   GFLOP/s, counting 2*m*n*k flops per product
//   elementwise / sum rows GB/s, counting the bytes each op must read plus write (add: 3 x 4 B per element)
//   example row            wall time of examples/linear_regression.cpp's 500 iterations (the same loop)
// Each figure is the median of `--repeats` timed runs after warm-up runs.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <immintrin.h>
#include <omp.h>

#include "halfgrad.h"
#include "ops/loss.h"
#include "ops/matmul.h"
#include "optim/sgd.h"
#include "tools/cli_checks.h"

using namespace halfgrad;

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Median wall time of fn over `repeats` runs, after `warmup` untimed ones.
double median_seconds(const std::function<void()>& fn, int repeats, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(seconds_since(start));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void row(const std::string& name, const std::string& shape, double value, const char* unit, double seconds,
         const std::string& note = "") {
  fmt::print("{:<26} {:<26} {:>9.1f} {:<7} {:>10.3f} ms  {}\n", name, shape, value, unit, seconds * 1e3, note);
}

// "cpu MHz" of the first processor in /proc/cpuinfo (0 when unknown).
double cpu_mhz() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("cpu MHz", 0) == 0) return std::stod(line.substr(line.find(':') + 1));
  }
  return 0;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

// Measured fp32 FMA throughput of `threads` threads running at once: 12 independent accumulator chains per
// thread (more than FMA latency x FMA units on any current core), widest vectors the build allows. It shows
// what the cores really deliver, e.g. whether two vCPUs are two hyperthreads of one physical core.
double measured_fma_gflops(int threads, const char** isa) {
#if defined(__AVX512F__)
  using Vec = __m512;
  constexpr int kLanes = 16;
  auto set1 = [](float v) { return _mm512_set1_ps(v); };
  auto fma = [](Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); };
  *isa = "AVX-512";
#elif defined(__FMA__)
  using Vec = __m256;
  constexpr int kLanes = 8;
  auto set1 = [](float v) { return _mm256_set1_ps(v); };
  auto fma = [](Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); };
  *isa = "AVX2 FMA";
#else
  *isa = "none";
  (void)threads;
  return 0;
#endif
#if defined(__AVX512F__) || defined(__FMA__)
  constexpr int64_t kIterations = 20'000'000;
  double slowest = 0;
#pragma omp parallel num_threads(threads) reduction(max : slowest)
  {
    Vec acc[12];
    for (Vec& a : acc) a = set1(1.0f);
    const Vec m = set1(0.9999999f), add = set1(1e-7f);
    auto start = std::chrono::steady_clock::now();
    for (int64_t it = 0; it < kIterations; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = fma(acc[i], m, add);  // 12 chains, each kept in a register
    }
    // The results must exist before the clock stops: an empty asm that reads each accumulator register.
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) asm volatile("" : : "v"(acc[i]));
    slowest = seconds_since(start);
  }
  return double(threads) * kIterations * 12 * kLanes * 2 / slowest * 1e-9;
#endif
}

// The loop of examples/linear_regression.cpp, timed: 500 iterations of forward, backward and SGD step.
double linear_regression_seconds(int iterations, double* final_loss) {
  manual_seed(0);
  Tensor x = randn({64, 1024}), y = randn({64, 512});
  const double bound = 1.0 / std::sqrt(1024.0);
  Tensor weight, bias;
  {
    NoGradGuard no_grad;
    weight = rand({512, 1024}) * (2 * bound) - bound;
    bias = rand({512}) * (2 * bound) - bound;
  }
  weight.requires_grad_();
  bias.requires_grad_();
  optim::SGD sgd({weight, bias}, {.lr = 1e-3});
  auto start = std::chrono::steady_clock::now();
  for (int it = 0; it < iterations; ++it) {
    Tensor loss = mse_loss(linear(x, weight, bias), y);
    sgd.zero_grad();
    loss.backward();
    sgd.step();
    if (it % 100 == 0 || it == iterations - 1) *final_loss = loss.item<double>();  // as the example prints
  }
  return seconds_since(start);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"halfgrad CPU benchmark: matmul, linear, elementwise, reduction, the linear-regression example"};
  int repeats = 20;
  int example_runs = 3;
  app.add_option("--repeats", repeats, "timed runs per figure (the median is printed)")->check(cli::integer_in<int>(1));
  app.add_option("--example-runs", example_runs, "runs of the 500-iteration example (median; 0 skips it)");
  CLI11_PARSE(app, argc, argv);

  const unsigned cores = std::thread::hardware_concurrency();
  const double mhz = cpu_mhz();
  // Assumed: AVX-512 FMA, 2 FMA units x 16 float32 lanes x 2 flops (multiply + add) per cycle per core.
  // (Cores that split 512-bit ops into two 256-bit halves, as AMD Zen 4 does, reach half of this.)
  const double peak_gflops = cores * mhz * 1e-3 * 2 * 16 * 2;
  fmt::print("halfgrad bench_cpu: {} | {} cores | {:.0f} MHz | {} OpenMP threads\n", cpu_model(), cores, mhz,
             omp_get_max_threads());
  fmt::print("fp32 peak assumed: {} cores x {:.3f} GHz x 64 flop/cycle (AVX-512: 2 FMA x 16 lanes x 2) = "
             "{:.1f} GFLOP/s; target for matmul: half of it, {:.1f} GFLOP/s\n",
             cores, mhz * 1e-3, peak_gflops, peak_gflops / 2);
  const char* isa = "";
  const double fma_one = measured_fma_gflops(1, &isa), fma_all = measured_fma_gflops(int(cores), &isa);
  fmt::print("fp32 peak measured ({} FMA loop): 1 thread {:.1f} GFLOP/s, {} threads {:.1f} GFLOP/s\n", isa, fma_one,
             cores, fma_all);
  fmt::print("{:<26} {:<26} {:>9} {:<7} {:>13}  {}\n", "benchmark", "shape", "value", "unit", "median", "note");

  manual_seed(1);
  auto gemm_row = [&](const std::string& name, const std::string& shape, double flops, const std::function<void()>& fn) {
    double t = median_seconds(fn, repeats);
    double gflops = flops / t * 1e-9;
    row(name, shape, gflops, "GFLOP/s", t, fmt::format("{:.0f}% of peak", 100 * gflops / peak_gflops));
  };
  {
    Tensor a = randn({1024, 1024}), b = randn({1024, 1024});
    gemm_row("matmul fp32", "1024x1024 @ 1024x1024", 2.0 * 1024 * 1024 * 1024, [&] { matmul(a, b); });
  }
  {
    // The linear example's three GEMMs: forward, and the two backward products (dW is the one training
    // needs; dx would be needed by a layer below).
    Tensor x = randn({64, 1024}), w = randn({512, 1024}), bias = randn({512}), g = randn({64, 512});
    const double flops = 2.0 * 64 * 1024 * 512;
    gemm_row("linear fwd (x W^T + b)", "64x1024 @ (512x1024)^T", flops, [&] { linear(x, w, bias); });
    gemm_row("linear bwd dW = g^T x", "(64x512)^T @ 64x1024", flops, [&] { g.t().matmul(x); });
    gemm_row("linear bwd dx = g W", "64x512 @ 512x1024", flops, [&] { g.matmul(w); });
  }
  {
    constexpr int64_t n = int64_t(1) << 24;  // 16M float32 = 64 MiB per tensor: far beyond the caches
    Tensor a = randn({n}), b = randn({n});
    const double bytes = 4.0 * double(n);
    auto bw_row = [&](const std::string& name, double traffic, const std::function<void()>& fn,
                      const char* shape = "16M fp32") {
      double t = median_seconds(fn, repeats);
      row(name, shape, traffic / t * 1e-9, "GB/s", t);
    };
    bw_row("add (a + b)", 3 * bytes, [&] { a.add(b); });
    bw_row("mul by scalar (a * 2)", 2 * bytes, [&] { a.mul(2.0); });
    bw_row("exp", 2 * bytes, [&] { a.exp(); });
    bw_row("relu", 2 * bytes, [&] { a.relu(); });
    bw_row("sum (all elements)", bytes, [&] { a.sum().item<double>(); });
    // The same 16M values as [64, 64, 64, 64] stored channels last (what channels-last training hands relu and the
    // residual add): the loop must walk them in memory order.
    Tensor a_cl = contiguous_channels_last(a.view({64, 64, 64, 64}));
    Tensor b_cl = contiguous_channels_last(b.view({64, 64, 64, 64}));
    bw_row("add, channels last", 3 * bytes, [&] { a_cl.add(b_cl); });
    bw_row("relu, channels last", 2 * bytes, [&] { a_cl.relu(); });
    // float16 storage, float32 arithmetic (what O1/O3 do on the CPU): half the bytes, two conversions per value.
    Tensor a16 = a.to(kFloat16), b16 = b.to(kFloat16);
    bw_row("add, float16", 3 * bytes / 2, [&] { a16.add(b16); }, "16M fp16");
    bw_row("relu, float16", 2 * bytes / 2, [&] { a16.relu(); }, "16M fp16");
  }
  if (example_runs > 0) {
    std::vector<double> times;
    double loss = 0;
    linear_regression_seconds(20, &loss);  // warm-up: first-touch allocations, thread pool start
    for (int r = 0; r < example_runs; ++r) times.push_back(linear_regression_seconds(500, &loss));
    std::sort(times.begin(), times.end());
    double t = times[times.size() / 2];
    row("linear example, 500 it", "64x1024 -> 512, MSE, SGD", t, "s", t,
        fmt::format("{:.3f} ms/iteration, final loss {:.4f}", t / 500 * 1e3, loss));
  }
  return 0;
}
