#!/usr/bin/env python3
"""bench_torch_cpu: tools/bench_cpu.cpp's measurements in PyTorch's CPU build, printed in the same rows.

Run it with the Python that has torch (Debian's python3-torch installs for /usr/bin/python3):
    /usr/bin/python3 tools/bench_torch_cpu.py [--repeats 20] [--example-runs 3]
The project does not depend on PyTorch: this script is only for comparing (docs/benchmarks.md).
"""
import argparse
import math
import os
import statistics
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # not an error: the comparison is optional
    print(f"bench_torch_cpu: PyTorch is not importable by {sys.executable} ({e}); nothing to compare. "
          "On Debian: apt-get install python3-torch, then run this with /usr/bin/python3.")
    sys.exit(0)


def median_seconds(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(name, shape, value, unit, seconds, note=""):
    print(f"{name:<26} {shape:<26} {value:>9.1f} {unit:<7} {seconds * 1e3:>10.3f} ms  {note}")


def cpu_info():
    model, mhz = "unknown CPU", 0.0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("cpu MHz") and mhz == 0.0:
                    mhz = float(line.split(":", 1)[1])
    except OSError:
        pass
    return model, mhz


def linear_regression_seconds(iterations):
    """examples/linear_regression.cpp in PyTorch: the same shapes, init, loss, optimiser and loss reads."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 1024), torch.randn(64, 512)
    layer = torch.nn.Linear(1024, 512)  # U(-1/sqrt(in), 1/sqrt(in)) for weight and bias, as ours
    sgd = torch.optim.SGD(layer.parameters(), lr=1e-3)
    final_loss = 0.0
    start = time.perf_counter()
    for it in range(iterations):
        loss = F.mse_loss(layer(x), y)
        sgd.zero_grad()  # set_to_none=False in 1.13 (zeros); the default changed to None in 2.0
        loss.backward()
        sgd.step()
        if it % 100 == 0 or it == iterations - 1:
            final_loss = loss.item()
    return time.perf_counter() - start, final_loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per figure (the median is printed)")
    parser.add_argument("--example-runs", type=int, default=3, help="runs of the 500-iteration example (0 skips)")
    args = parser.parse_args()

    torch.set_num_threads(os.cpu_count())
    cores = os.cpu_count()
    model, mhz = cpu_info()
    peak = cores * mhz * 1e-3 * 2 * 16 * 2
    print(f"torch {torch.__version__} bench_torch_cpu: {model} | {cores} cores | {mhz:.0f} MHz | "
          f"{torch.get_num_threads()} threads | BLAS: {blas_info()}")
    print(f"fp32 peak assumed: {cores} cores x {mhz * 1e-3:.3f} GHz x 64 flop/cycle (AVX-512: 2 FMA x 16 lanes x 2)"
          f" = {peak:.1f} GFLOP/s; target for matmul: half of it, {peak / 2:.1f} GFLOP/s")
    print(f"{'benchmark':<26} {'shape':<26} {'value':>9} {'unit':<7} {'median':>13}  note")

    torch.manual_seed(1)
    with torch.no_grad():
        def gemm_row(name, shape, flops, fn):
            t = median_seconds(fn, args.repeats)
            gflops = flops / t * 1e-9
            row(name, shape, gflops, "GFLOP/s", t, f"{100 * gflops / peak:.0f}% of peak")

        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        gemm_row("matmul fp32", "1024x1024 @ 1024x1024", 2.0 * 1024 ** 3, lambda: torch.matmul(a, b))
        x, w, bias, g = torch.randn(64, 1024), torch.randn(512, 1024), torch.randn(512), torch.randn(64, 512)
        flops = 2.0 * 64 * 1024 * 512
        gemm_row("linear fwd (x W^T + b)", "64x1024 @ (512x1024)^T", flops, lambda: F.linear(x, w, bias))
        gemm_row("linear bwd dW = g^T x", "(64x512)^T @ 64x1024", flops, lambda: g.t().matmul(x))
        gemm_row("linear bwd dx = g W", "64x512 @ 512x1024", flops, lambda: g.matmul(w))

        n = 1 << 24
        a, b = torch.randn(n), torch.randn(n)
        nbytes = 4.0 * n

        def bw_row(name, traffic, fn, shape="16M fp32"):
            t = median_seconds(fn, args.repeats)
            row(name, shape, traffic / t * 1e-9, "GB/s", t)

        bw_row("add (a + b)", 3 * nbytes, lambda: a + b)
        bw_row("mul by scalar (a * 2)", 2 * nbytes, lambda: a * 2.0)
        bw_row("exp", 2 * nbytes, lambda: torch.exp(a))
        bw_row("relu", 2 * nbytes, lambda: torch.relu(a))
        bw_row("sum (all elements)", nbytes, lambda: a.sum().item())
        a_cl = a.view(64, 64, 64, 64).contiguous(memory_format=torch.channels_last)
        b_cl = b.view(64, 64, 64, 64).contiguous(memory_format=torch.channels_last)
        bw_row("add, channels last", 3 * nbytes, lambda: a_cl + b_cl)
        bw_row("relu, channels last", 2 * nbytes, lambda: torch.relu(a_cl))
        a16, b16 = a.half(), b.half()
        bw_row("add, float16", 3 * nbytes / 2, lambda: a16 + b16, "16M fp16")
        bw_row("relu, float16", 2 * nbytes / 2, lambda: torch.relu(a16), "16M fp16")

    if args.example_runs > 0:
        linear_regression_seconds(20)  # warm-up
        runs = [linear_regression_seconds(500) for _ in range(args.example_runs)]
        t = statistics.median(r[0] for r in runs)
        loss = runs[-1][1]
        row("linear example, 500 it", "64x1024 -> 512, MSE, SGD", t, "s", t,
            f"{t / 500 * 1e3:.3f} ms/iteration, final loss {loss:.4f}")
    return 0


def blas_info():
    config = torch.__config__.show()
    for part in config.replace(",", "\n").splitlines():
        if "BLAS_INFO" in part:
            return part.split("=", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
