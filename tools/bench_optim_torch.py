#!/usr/bin/env python3
"""bench_optim_torch: tools/bench_optim.cpp's measurements in PyTorch, printed in the same rows.

The optimizer step over ResNet-50's parameters (161 tensors, 25,557,032 elements) with PyTorch's
multi-tensor implementations: foreach=True (horizontally fused kernels, a few per op) and fused=True (one
fused kernel per step, like halfgrad's). Each row is the median over --repeats steps, timed with CUDA events
around optimizer.step(), exactly as bench_optim times halfgrad's.

    python3 tools/bench_optim_torch.py [--device cuda|cpu] [--dtype float32] [--repeats 100]

The project does not depend on PyTorch: this script is only for comparing (docs/benchmarks.md).
"""
import argparse
import statistics
import sys
import time

try:
    import torch
except ImportError as e:  # not an error: the comparison is optional
    print(f"bench_optim_torch: PyTorch is not importable by {sys.executable} ({e}); nothing to compare.")
    sys.exit(0)


def resnet50_parameter_shapes():
    """torchvision's resnet50().parameters() shapes, written out from the architecture (as bench_optim.cpp)."""
    shapes = []

    def conv_bn(out, inp, k):
        shapes.extend([(out, inp, k, k), (out,), (out,)])

    conv_bn(64, 3, 7)
    inp = 64
    for blocks, width in zip([3, 4, 6, 3], [64, 128, 256, 512]):
        out = 4 * width
        for b in range(blocks):
            conv_bn(width, inp, 1)
            conv_bn(width, width, 3)
            conv_bn(out, width, 1)
            if b == 0:
                conv_bn(out, inp, 1)
            inp = out
    shapes.extend([(1000, 2048), (1000,)])
    return shapes


def median_ms(device, fn, repeats, warmup):
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            torch.cuda.current_stream().synchronize()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def row(name, ms, nbytes):
    print(f"{name:<44} {ms:>10.3f} ms {nbytes / (ms * 1e-3) / 1e9:>9.1f} GB/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    params = []
    for s in resnet50_parameter_shapes():
        p = (torch.randn(s) * 0.01).to(device, dtype).requires_grad_()
        p.grad = (torch.randn(s) * 1e-3).to(device, dtype)
        params.append(p)
    numel = sum(p.numel() for p in params)
    element = params[0].element_size()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"optimizer step over ResNet-50's parameters: {len(params)} tensors, {numel} elements, {args.dtype}, "
          f"{name} (torch {torch.__version__})")
    print(f"{'':<44} {'median':>13} {'bandwidth':>14}")

    def bench(label, make, accesses):
        for impl in ("foreach", "fused"):
            try:
                opt = make(**{impl: True})
                opt.step()  # some refuse a device only at the first step: fused Adagrad on CUDA (torch 2.11)
            except (RuntimeError, TypeError, ValueError) as e:  # e.g. fused SGD needs torch >= 2.3 (CUDA)
                print(f"{'torch ' + label + ' (' + impl + ')':<44} unavailable: {str(e).splitlines()[0]}")
                continue
            row(f"torch {label} ({impl})", median_ms(device, opt.step, args.repeats, args.warmup),
                accesses * element * numel)

    bench("SGD momentum=0.9", lambda **kw: torch.optim.SGD(params, lr=0.1, momentum=0.9, **kw), 5)
    bench("SGD nesterov, weight_decay",
          lambda **kw: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True, **kw), 5)
    bench("Adam", lambda **kw: torch.optim.Adam(params, lr=1e-3, **kw), 7)
    bench("AdamW", lambda **kw: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, **kw), 7)
    bench("RMSprop", lambda **kw: torch.optim.RMSprop(params, lr=1e-3, **kw), 5)
    bench("RMSprop centered, momentum",
          lambda **kw: torch.optim.RMSprop(params, lr=1e-3, momentum=0.9, centered=True, **kw), 9)
    bench("Adagrad", lambda **kw: torch.optim.Adagrad(params, lr=1e-2, **kw), 5)
    row("torch clip_grad_norm_ (2-norm, foreach)",
        median_ms(device, lambda: torch.nn.utils.clip_grad_norm_(params, 1e30, foreach=True), args.repeats,
                  args.warmup),
        3 * element * numel)


if __name__ == "__main__":
    main()
