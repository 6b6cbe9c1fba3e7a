// bench_cuda: halfgrad's CUDA speed, printed next to the device's ceilings. A benchmark program, not a test.
//
//   copy row                  the ceiling of memory-bound ops: a device-to-device cudaMemcpyAsync, counting
//                             bytes read plus bytes written
//   elementwise / cast rows   GB/s counting the bytes each op must read plus write once (add: 3 x element
//                             size per element); "% copy" is that over the copy row
//   reduction rows            GB/s counting the input bytes (the outputs are small)
//   norm / activation rows    layer_norm, gelu and silu, forward alone and forward + backward, GB/s counting the
//                             bytes each pass must read plus write once
//   index / pad / scan /      gather, index_select, scatter_add_, pad, cumsum, sort, topk (float32, int64 indices),
//   sort rows                 GB/s counting the bytes each must read plus write once (indices included)
//   GEMM rows                 TFLOP/s counting 2*m*n*k, through halfgrad::matmul; "% cuBLAS" is that over the
//                             same cublasGemmEx call made directly on the same buffers
// Every figure is the median of --repeats runs timed with CUDA events after warm-up runs, on random data
// (never zeros: a matrix product of zeros runs faster than of real data).
// tools/bench_torch_cuda.py prints the same rows for PyTorch, for comparison.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/cuda_allocator.h"
#include "halfgrad.h"

#if HALFGRAD_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

using namespace halfgrad;

#if HALFGRAD_WITH_CUDA
namespace {

struct Row {
  std::string group, name, shape;
  double value;  // GB/s or TFLOP/s
  std::string unit;
  double ms;
  double percent;  // of the reference (copy bandwidth, or direct cuBLAS); < 0: none
};
std::vector<Row> rows;

void print_row(const Row& r) {
  std::string pct = r.percent >= 0 ? fmt::format("{:5.1f}%", r.percent) : std::string("      ");
  fmt::print("{:<11} {:<34} {:<22} {:>9.1f} {:<7} {:>9.3f} ms  {}\n", r.group, r.name, r.shape, r.value, r.unit, r.ms,
             pct);
  std::fflush(stdout);
}

void add_row(Row r) {
  print_row(r);
  rows.push_back(std::move(r));
}

// Median time of fn in milliseconds: CUDA events around each run on the current stream, after warm-up.
double median_ms(const std::function<void()>& fn, int repeats, int warmup = 3) {
  cudaStream_t stream = cuda::current_stream(0);
  for (int i = 0; i < warmup; ++i) fn();
  cuda::synchronize();
  cudaEvent_t start, stop;
  HG_CUDA_CHECK(cudaEventCreate(&start));
  HG_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < repeats; ++i) {
    HG_CUDA_CHECK(cudaEventRecord(start, stream));
    fn();
    HG_CUDA_CHECK(cudaEventRecord(stop, stream));
    HG_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    HG_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  HG_CUDA_CHECK(cudaEventDestroy(start));
  HG_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

const Device kGpu = Device::cuda(0);

Tensor random_gpu(const Shape& shape, DType dt) { return randn(shape, {.dtype = kFloat32}).to(kGpu, dt); }

std::string shape_of(const Shape& s) { return shape_str(s); }

// ---- memory-bound ops

double copy_bandwidth(int64_t bytes, int repeats) {
  Tensor a = random_gpu({bytes / 4}, kFloat32);
  Tensor b = empty_like(a);
  double ms = median_ms([&] {
    HG_CUDA_CHECK(cudaMemcpyAsync(b.data_ptr(), a.data_ptr(), size_t(bytes), cudaMemcpyDeviceToDevice,
                                  cuda::current_stream(0)));
  }, repeats);
  double gbs = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
  add_row({"copy", "cudaMemcpyAsync device to device", fmt::format("{} MiB", bytes >> 20), gbs, "GB/s", ms, 100.0});
  return gbs;
}

void bandwidth_row(const std::string& group, const std::string& name, const Shape& shape, double bytes,
                   const std::function<void()>& fn, int repeats, double copy_gbs) {
  double ms = median_ms(fn, repeats);
  double gbs = bytes / (ms * 1e-3) / 1e9;
  add_row({group, name, shape_of(shape), gbs, "GB/s", ms, 100.0 * gbs / copy_gbs});
}

void elementwise_rows(int64_t n, int repeats, double copy_gbs) {
  for (DType dt : {kFloat32, kBFloat16, kFloat16}) {
    const double s = double(element_size(dt));
    const std::string t = dtype_name(dt);
    const Shape shape{n};
    Tensor a = random_gpu(shape, dt), b = random_gpu(shape, dt);
    Tensor c = random_gpu(shape, kFloat32).gt(0);
    const double N = double(n);
    bandwidth_row("elementwise", t + " add a + b", shape, 3 * N * s, [&] { Tensor r = a + b; }, repeats, copy_gbs);
    bandwidth_row("elementwise", t + " mul x * 2.5 (scalar)", shape, 2 * N * s, [&] { Tensor r = a * 2.5; }, repeats,
                  copy_gbs);
    bandwidth_row("elementwise", t + " relu", shape, 2 * N * s, [&] { Tensor r = relu(a); }, repeats, copy_gbs);
    if (dt == kFloat32) {
      bandwidth_row("elementwise", t + " exp", shape, 2 * N * s, [&] { Tensor r = exp(a); }, repeats, copy_gbs);
      bandwidth_row("elementwise", t + " sigmoid", shape, 2 * N * s, [&] { Tensor r = sigmoid(a); }, repeats, copy_gbs);
      bandwidth_row("elementwise", t + " where(c, a, b)", shape, N * (1 + 3 * s), [&] { Tensor r = where(c, a, b); },
                    repeats, copy_gbs);
      bandwidth_row("elementwise", t + " fill_", shape, N * s, [&] { a.fill_(1.5); }, repeats, copy_gbs);
      a = random_gpu(shape, dt);
      bandwidth_row("cast", "float32 -> bfloat16", shape, N * (4 + 2), [&] { Tensor r = a.to(kBFloat16); }, repeats,
                    copy_gbs);
      Tensor h = a.to(kBFloat16);
      bandwidth_row("cast", "bfloat16 -> float32", shape, N * (2 + 4), [&] { Tensor r = h.to(kFloat32); }, repeats,
                    copy_gbs);
      // Broadcast and strided operands (the strided kernel, with offsets from magic-number division).
      const int64_t cols = 4096, rows = n / cols;
      Tensor m = a.view({rows, cols}), v = random_gpu({cols}, dt);
      bandwidth_row("elementwise", t + " add [R, C] + [C] (broadcast)", {rows, cols}, (2 * N + cols) * s,
                    [&] { Tensor r = m + v; }, repeats, copy_gbs);
      Tensor m2 = b.view({rows, cols});
      bandwidth_row("elementwise", t + " add, both transposed", {cols, rows}, 3 * N * s,
                    [&] { Tensor r = m.t() + m2.t(); }, repeats, copy_gbs);
      bandwidth_row("elementwise", t + " contiguous() of a transpose", {cols, rows}, 2 * N * s,
                    [&] { Tensor r = m.t().contiguous(); }, repeats, copy_gbs);
      Tensor strided = a.slice(0, 0, n, 2);
      bandwidth_row("elementwise", t + " relu of x[::2]", {n / 2}, N * s, [&] { Tensor r = relu(strided); }, repeats,
                    copy_gbs);
    }
  }
}

void reduction_rows(int64_t n, int repeats, double copy_gbs) {
  for (DType dt : {kFloat32, kBFloat16}) {
    const double bytes = double(n) * double(element_size(dt));
    const std::string t = dtype_name(dt);
    Tensor x = random_gpu({n}, dt);
    const int64_t cols = 4096, rows = n / cols;
    Tensor m = x.view({rows, cols}), mt = x.view({cols, rows});
    bandwidth_row("reduction", t + " sum()", {n}, bytes, [&] { Tensor r = x.sum(); }, repeats, copy_gbs);
    bandwidth_row("reduction", t + " sum(dim 1) (rows)", {rows, cols}, bytes, [&] { Tensor r = m.sum({1}); }, repeats,
                  copy_gbs);
    bandwidth_row("reduction", t + " sum(dim 0) (columns)", {cols, rows}, bytes, [&] { Tensor r = mt.sum({0}); },
                  repeats, copy_gbs);
    bandwidth_row("reduction", t + " max(dim 1) values+indices", {rows, cols}, bytes, [&] { auto r = m.max(1); },
                  repeats, copy_gbs);
    bandwidth_row("reduction", t + " var(dim 1)", {rows, cols}, bytes, [&] { Tensor r = m.var({1}); }, repeats,
                  copy_gbs);
    bandwidth_row("reduction", t + " argmax over 4096 rows", {cols, rows}, bytes, [&] { Tensor r = mt.argmax(1); },
                  repeats, copy_gbs);
  }
}

// layer_norm and the activations, forward alone and forward + backward (the gradient of every input that has one;
// .grad reset before each run, so that it is assigned, not accumulated). Bytes: what each pass must read and write
// once: layer_norm's forward reads x and writes y, its backward reads g and x and writes dx (the parameters' [C]
// vectors are left out); an activation's forward reads x and writes y, its backward reads g and x and writes dx.
void norm_and_activation_rows(int64_t n, int repeats, double copy_gbs) {
  for (DType dt : {kFloat32, kBFloat16}) {
    const double s = double(element_size(dt)), N = double(n);
    const std::string t = dtype_name(dt);
    for (int64_t cols : {int64_t(1024), int64_t(4096)}) {
      const Shape shape{n / cols, cols};
      Tensor x = random_gpu(shape, dt).requires_grad_(), g = random_gpu(shape, dt);
      Tensor w = random_gpu({cols}, dt).requires_grad_(), b = random_gpu({cols}, dt).requires_grad_();
      bandwidth_row("norm", t + " layer_norm forward", shape, 2 * N * s, [&] {
        NoGradGuard no_grad;
        Tensor y = layer_norm(x, {cols}, w, b);
      }, repeats, copy_gbs);
      bandwidth_row("norm", t + " layer_norm forward+backward", shape, 5 * N * s, [&] {
        for (Tensor* p : {&x, &w, &b}) p->set_grad(Tensor());
        layer_norm(x, {cols}, w, b).backward(g);
      }, repeats, copy_gbs);
    }
    const Shape shape{n};
    Tensor x = random_gpu(shape, dt).requires_grad_(), g = random_gpu(shape, dt);
    for (const auto& [name, op] : std::vector<std::pair<std::string, std::function<Tensor(const Tensor&)>>>{
             {"gelu", [](const Tensor& v) { return gelu(v); }},
             {"gelu tanh", [](const Tensor& v) { return gelu(v, "tanh"); }},
             {"silu", [](const Tensor& v) { return silu(v); }}}) {
      bandwidth_row("activation", t + " " + name + " forward", shape, 2 * N * s, [&] {
        NoGradGuard no_grad;
        Tensor y = op(x);
      }, repeats, copy_gbs);
      bandwidth_row("activation", t + " " + name + " forward+backward", shape, 5 * N * s, [&] {
        x.set_grad(Tensor());
        op(x).backward(g);
      }, repeats, copy_gbs);
    }
  }
}

// pad: images [B, 64, 64, 64] padded by 3 on each side (a 7x7 convolution's reflection padding) or by 1 with zeros;
// bytes: the input read and the output written once (forward + backward: twice each).
void pad_rows(int64_t n, int repeats, double copy_gbs) {
  const int64_t images = n / (64 * 64 * 64);
  if (images < 1) return;  // not one image in so few elements
  Tensor image = random_gpu({images, 64, 64, 64}, kFloat32);
  const double image_bytes = 4 * double(image.numel()), padded_bytes = 4 * double(images * 64 * 70 * 70);
  bandwidth_row("pad", "float32 reflection pad 3, forward", image.shape(), image_bytes + padded_bytes,
                [&] { Tensor r = pad(image, {3, 3, 3, 3}, PadMode::Reflect); }, repeats, copy_gbs);
  Tensor leaf_image = image.detach().requires_grad_();
  Tensor padded_grad = random_gpu({images, 64, 70, 70}, kFloat32);
  bandwidth_row("pad", "float32 reflection pad 3, forward+backward", image.shape(), 2 * (image_bytes + padded_bytes),
                [&] {
                  leaf_image.set_grad(Tensor());
                  pad(leaf_image, {3, 3, 3, 3}, PadMode::Reflect).backward(padded_grad);
                }, repeats, copy_gbs);
  bandwidth_row("pad", "float32 zero pad 1, forward", image.shape(),
                image_bytes + 4 * double(images * 64 * 66 * 66), [&] { Tensor r = pad(image, {1, 1, 1, 1}); }, repeats,
                copy_gbs);
}

// gather, index_select, scatter_add_, cumsum, sort and topk, float32 values and int64 indices drawn at random. Bytes:
// gather reads the index and the values it picks and writes the output (16 a position; index_select 8, its index
// small); scatter_add_ reads the index and src
// (12 a position: the 1024 destination rows stay in cache); cumsum reads and writes once; sort reads the keys and
// writes the values and the int64 indices (16 an element); topk reads the keys (its k outputs are small). The sorts
// run on an eighth of the elements.
void index_scan_sort_rows(int64_t n, int repeats, double copy_gbs) {
  const double N = double(n);
  const int64_t cols = 4096, rows = n / cols;
  Tensor x = random_gpu({rows, cols}, kFloat32);
  Tensor index = randint(0, cols, {rows, cols}).to(kGpu);
  bandwidth_row("index", "float32 gather(dim 1)", {rows, cols}, 16 * N, [&] { Tensor r = gather(x, 1, index); },
                repeats, copy_gbs);
  const int64_t targets = 1024;
  Tensor into = zeros({targets, cols}, {.device = kGpu});
  Tensor target_rows = randint(0, targets, {rows, cols}).to(kGpu);
  bandwidth_row("index", "float32 scatter_add_(dim 0), 1024 rows", {rows, cols}, 12 * N,
                [&] { into.scatter_add_(0, target_rows, x); }, repeats, copy_gbs);
  Tensor columns = randint(0, cols, {16}).to(kGpu);
  bandwidth_row("index", "float32 index_select(dim 1), 16 columns", {rows, 16}, 8 * double(rows) * 16,
                [&] { Tensor r = x.index_select(1, columns); }, repeats, copy_gbs);
  index = target_rows = into = Tensor();
  bandwidth_row("scan", "float32 cumsum(dim 1) (rows)", {rows, cols}, 8 * N, [&] { Tensor r = cumsum(x, 1); },
                repeats, copy_gbs);
  Tensor xt = x.view({cols, rows});
  bandwidth_row("scan", "float32 cumsum(dim 0) (columns)", {cols, rows}, 8 * N, [&] { Tensor r = cumsum(xt, 0); },
                repeats, copy_gbs);
  Tensor flat = x.view({n});
  bandwidth_row("scan", "float32 cumsum of one row", {n}, 8 * N, [&] { Tensor r = cumsum(flat, 0); }, repeats,
                copy_gbs);
  Tensor few_columns = flat.slice(0, 0, n / 128).view({n / 512, 4});
  bandwidth_row("scan", "float32 cumsum(dim 0), 4 columns", {n / 512, 4}, 8 * N / 128,
                [&] { Tensor r = cumsum(few_columns, 0); }, repeats, copy_gbs);
  const int64_t m = std::max(cols, n / 8 / cols * cols);
  Tensor keys = x.view({n}).slice(0, 0, m).view({m / cols, cols});
  bandwidth_row("sort", "float32 sort(dim 1)", {m / cols, cols}, 16 * double(m), [&] { auto r = sort(keys, 1); },
                repeats, copy_gbs);
  Tensor one_row = keys.view({m});
  bandwidth_row("sort", "float32 sort of one row", {m}, 16 * double(m), [&] { auto r = sort(one_row, 0); }, repeats,
                copy_gbs);
  bandwidth_row("sort", "float32 topk(16, dim 1)", {m / cols, cols}, 4 * double(m),
                [&] { auto r = topk(keys, 16, 1); }, repeats, copy_gbs);
}

// ---- GEMM

void gemm_rows(const std::vector<int64_t>& sizes, int repeats) {
  struct Variant {
    const char* name;
    DType dtype;
    bool tf32;
    cublasComputeType_t compute;
  };
  const Variant variants[] = {{"fp32", kFloat32, false, CUBLAS_COMPUTE_32F},
                              {"tf32", kFloat32, true, CUBLAS_COMPUTE_32F_FAST_TF32},
                              {"fp16", kFloat16, false, CUBLAS_COMPUTE_32F},
                              {"bf16", kBFloat16, false, CUBLAS_COMPUTE_32F}};
  for (int64_t s : sizes) {
    for (const Variant& v : variants) {
      Tensor a = random_gpu({s, s}, v.dtype), b = random_gpu({s, s}, v.dtype);
      Tensor c = empty({s, s}, {.dtype = v.dtype, .device = kGpu});
      const double flops = 2.0 * double(s) * double(s) * double(s);
      cuda::set_allow_tf32(v.tf32);
      const int reps = std::max(3, s >= 8192 && v.dtype == kFloat32 ? repeats / 2 : repeats);
      double ms = median_ms([&] { Tensor r = matmul(a, b); }, reps);
      // The same product straight through cublasGemmEx (C^T = B^T A^T in column-major terms).
      const cudaDataType_t type = v.dtype == kFloat32 ? CUDA_R_32F : v.dtype == kFloat16 ? CUDA_R_16F : CUDA_R_16BF;
      const float alpha = 1, beta = 0;
      const int n = int(s);
      double direct_ms = median_ms([&] {
        HG_CUBLAS_CHECK(cublasGemmEx(cuda::cublas_handle(0), CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, b.data_ptr(),
                                     type, n, a.data_ptr(), type, n, &beta, c.data_ptr(), type, n, v.compute,
                                     CUBLAS_GEMM_DEFAULT));
      }, reps);
      cuda::set_allow_tf32(false);
      double tflops = flops / (ms * 1e-3) / 1e12, direct = flops / (direct_ms * 1e-3) / 1e12;
      add_row({"gemm", fmt::format("{} matmul", v.name), fmt::format("{}^3", s), tflops, "TFLOP/s", ms,
               100.0 * tflops / direct});
      add_row({"gemm", fmt::format("{} cublasGemmEx direct", v.name), fmt::format("{}^3", s), direct, "TFLOP/s",
               direct_ms, -1});
    }
  }
}

}  // namespace
#endif

int main(int argc, char** argv) {
  CLI::App app{"bench_cuda: halfgrad CUDA kernels (GB/s, TFLOP/s) next to the device's ceilings"};
  int64_t elements = int64_t(1) << 27;
  int repeats = 20;
  bool skip_gemm = false;
  std::vector<int64_t> gemm_sizes = {4096, 8192};
  std::string csv;
  app.add_option("--elements", elements, "elements per tensor in the memory-bound rows (a multiple of 4096)");
  app.add_option("--repeats", repeats, "timed runs per row (the median is reported)");
  app.add_option("--gemm-sizes", gemm_sizes, "square GEMM sizes");
  app.add_flag("--no-gemm", skip_gemm, "skip the GEMM rows");
  std::vector<std::string> parts;
  app.add_option("--only", parts, "only these parts (the copy row always runs)")
      ->check(CLI::IsMember({"elementwise", "reduction", "norm", "index", "gemm"}));
  app.add_option("--csv", csv, "also write the rows to this CSV file");
  CLI11_PARSE(app, argc, argv);

  if (!cuda::is_available()) {
    fmt::print("bench_cuda: no GPU available{}; nothing to measure\n",
#if HALFGRAD_WITH_CUDA
               ""
#else
               " (halfgrad was built without CUDA)"
#endif
    );
    return 0;
  }
#if HALFGRAD_WITH_CUDA
  elements = std::max<int64_t>(4096, elements / 4096 * 4096);
  cudaDeviceProp prop{};
  HG_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  HG_CUDA_CHECK(cudaDriverGetVersion(&driver));
  HG_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  fmt::print("device: {} (sm_{}{}, {} SMs, {:.1f} GiB, L2 {} MiB), driver {}.{}, runtime {}.{}, cuBLAS {}\n",
             prop.name, prop.major, prop.minor, prop.multiProcessorCount, double(prop.totalGlobalMem) / (1 << 30),
             prop.l2CacheSize >> 20, driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10,
             cublasGetCudartVersion());
  fmt::print("ceilings (H200 reference): device copy ~4.3 TB/s measured here before (4.8 TB/s datasheet); dense bf16 "
             "~790 TFLOP/s measured (989 datasheet)\n");
  fmt::print("memory-bound tensors: {} elements; medians of {} runs\n\n", elements, repeats);
  fmt::print("{:<11} {:<34} {:<22} {:>9} {:<7} {:>12}  {}\n", "group", "op", "shape", "value", "unit", "time",
             "% copy / % cuBLAS");

  manual_seed(2024);
  auto wanted = [&](const char* part) {
    return parts.empty() || std::find(parts.begin(), parts.end(), part) != parts.end();
  };
  const double copy_gbs = copy_bandwidth(elements * 4, repeats);
  if (wanted("elementwise")) elementwise_rows(elements, repeats, copy_gbs);
  if (wanted("reduction")) reduction_rows(elements, repeats, copy_gbs);
  if (wanted("norm")) norm_and_activation_rows(elements, repeats, copy_gbs);
  if (wanted("index")) {
    index_scan_sort_rows(elements, repeats, copy_gbs);
    pad_rows(elements, repeats, copy_gbs);
  }
  if (wanted("gemm") && !skip_gemm) gemm_rows(gemm_sizes, repeats);
  fmt::print("\nallocator: {}\n", cuda::memory_stats_str(0));

  if (!csv.empty()) {
    std::ofstream out(csv);
    out << "group,op,shape,value,unit,ms,percent\n";
    for (const Row& r : rows)
      out << fmt::format("{},\"{}\",\"{}\",{:.2f},{},{:.4f},{:.1f}\n", r.group, r.name, r.shape, r.value, r.unit, r.ms,
                         r.percent);
  }
#endif
  return 0;
}
