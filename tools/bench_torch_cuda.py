#!/usr/bin/env python3
"""The rows of tools/bench_cuda.cpp, measured with PyTorch on the same GPU, for comparison.

Same sizes, same byte and flop counts, medians of CUDA-event timings after warm-up, random data.
Usage: python3 tools/bench_torch_cuda.py [--elements N] [--repeats R] [--gemm-sizes 4096 8192] [--only index gemm]
"""
import argparse

import torch
import torch.nn.functional as F


def median_ms(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def row(group, name, shape, value, unit, ms, pct=None):
    p = f"{pct:5.1f}%" if pct is not None else ""
    print(f"{group:<11} {name:<34} {shape:<22} {value:>9.1f} {unit:<7} {ms:>9.3f} ms  {p}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 27)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--gemm-sizes", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--only", nargs="*", choices=("elementwise", "reduction", "norm", "index", "gemm"),
                    help="only these parts (the copy row always runs)")
    args = ap.parse_args()

    def want(part):
        return not args.only or part in args.only

    n, reps = args.elements // 4096 * 4096, args.repeats
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; {n} elements, medians of {reps} runs")

    a32 = torch.randn(n, device=dev)
    b32 = torch.empty_like(a32)
    ms = median_ms(lambda: b32.copy_(a32), reps)
    copy = 2 * n * 4 / (ms * 1e-3) / 1e9
    row("copy", "copy_ device to device", f"{n * 4 >> 20} MiB", copy, "GB/s", ms, 100.0)

    def bw(group, name, shape, nbytes, fn):
        ms = median_ms(fn, reps)
        gbs = nbytes / (ms * 1e-3) / 1e9
        row(group, name, shape, gbs, "GB/s", ms, 100 * gbs / copy)

    if want("elementwise"):
        for dt, tname in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
            s = torch.tensor([], dtype=dt).element_size()
            a = torch.randn(n, device=dev).to(dt)
            b = torch.randn(n, device=dev).to(dt)
            c = torch.randn(n, device=dev) > 0
            sh = f"[{n}]"
            bw("elementwise", f"{tname} add a + b", sh, 3 * n * s, lambda: a + b)
            bw("elementwise", f"{tname} mul x * 2.5 (scalar)", sh, 2 * n * s, lambda: a * 2.5)
            bw("elementwise", f"{tname} relu", sh, 2 * n * s, lambda: torch.relu(a))
            if dt == torch.float32:
                bw("elementwise", f"{tname} exp", sh, 2 * n * s, lambda: torch.exp(a))
                bw("elementwise", f"{tname} sigmoid", sh, 2 * n * s, lambda: torch.sigmoid(a))
                bw("elementwise", f"{tname} where(c, a, b)", sh, n * (1 + 3 * s), lambda: torch.where(c, a, b))
                bw("elementwise", f"{tname} fill_", sh, n * s, lambda: a.fill_(1.5))
                a = torch.randn(n, device=dev)
                bw("cast", "float32 -> bfloat16", sh, n * 6, lambda: a.to(torch.bfloat16))
                h = a.to(torch.bfloat16)
                bw("cast", "bfloat16 -> float32", sh, n * 6, lambda: h.to(torch.float32))
                cols, rows = 4096, n // 4096
                m, v, m2 = a.view(rows, cols), torch.randn(cols, device=dev), b.view(rows, cols)
                bw("elementwise", f"{tname} add [R, C] + [C] (broadcast)", f"[{rows}, {cols}]", (2 * n + cols) * s,
                   lambda: m + v)
                bw("elementwise", f"{tname} add, both transposed", f"[{cols}, {rows}]", 3 * n * s,
                   lambda: m.t() + m2.t())
                bw("elementwise", f"{tname} contiguous() of a transpose", f"[{cols}, {rows}]", 2 * n * s,
                   lambda: m.t().contiguous())
                st = a[::2]
                bw("elementwise", f"{tname} relu of x[::2]", f"[{n // 2}]", n * s, lambda: torch.relu(st))

    if want("reduction"):
        for dt, tname in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
            s = torch.tensor([], dtype=dt).element_size()
            x = torch.randn(n, device=dev).to(dt)
            cols, rows = 4096, n // 4096
            m, mt = x.view(rows, cols), x.view(cols, rows)
            bw("reduction", f"{tname} sum()", f"[{n}]", n * s, lambda: x.sum())
            bw("reduction", f"{tname} sum(dim 1) (rows)", f"[{rows}, {cols}]", n * s, lambda: m.sum(1))
            bw("reduction", f"{tname} sum(dim 0) (columns)", f"[{cols}, {rows}]", n * s, lambda: mt.sum(0))
            bw("reduction", f"{tname} max(dim 1) values+indices", f"[{rows}, {cols}]", n * s, lambda: m.max(1))
            bw("reduction", f"{tname} var(dim 1)", f"[{rows}, {cols}]", n * s, lambda: m.var(1))
            bw("reduction", f"{tname} argmax over 4096 rows", f"[{cols}, {rows}]", n * s, lambda: mt.argmax(1))
    if want("norm"):
        for dt, tname in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
            s = torch.tensor([], dtype=dt).element_size()
            for cols in (1024, 4096):
                rows = n // cols
                x = torch.randn(rows, cols, device=dev).to(dt).requires_grad_()
                g = torch.randn(rows, cols, device=dev).to(dt)
                w = torch.randn(cols, device=dev).to(dt).requires_grad_()
                b = torch.randn(cols, device=dev).to(dt).requires_grad_()

                def ln_forward():
                    with torch.no_grad():
                        F.layer_norm(x, (cols,), w, b)

                def ln_both():
                    x.grad = w.grad = b.grad = None
                    F.layer_norm(x, (cols,), w, b).backward(g)

                bw("norm", f"{tname} layer_norm forward", f"[{rows}, {cols}]", 2 * n * s, ln_forward)
                bw("norm", f"{tname} layer_norm forward+backward", f"[{rows}, {cols}]", 5 * n * s, ln_both)
            x = torch.randn(n, device=dev).to(dt).requires_grad_()
            g = torch.randn(n, device=dev).to(dt)
            for name, op in (("gelu", F.gelu), ("gelu tanh", lambda v: F.gelu(v, approximate="tanh")),
                             ("silu", F.silu)):
                def act_forward():
                    with torch.no_grad():
                        op(x)

                def act_both():
                    x.grad = None
                    op(x).backward(g)

                bw("activation", f"{tname} {name} forward", f"[{n}]", 2 * n * s, act_forward)
                bw("activation", f"{tname} {name} forward+backward", f"[{n}]", 5 * n * s, act_both)
    if want("index"):
        cols, rows = 4096, n // 4096
        x = torch.randn(rows, cols, device=dev)
        index = torch.randint(0, cols, (rows, cols), device=dev)
        bw("index", "float32 gather(dim 1)", f"[{rows}, {cols}]", 16 * n, lambda: torch.gather(x, 1, index))
        into = torch.zeros(1024, cols, device=dev)
        target_rows = torch.randint(0, 1024, (rows, cols), device=dev)
        bw("index", "float32 scatter_add_(dim 0), 1024 rows", f"[{rows}, {cols}]", 12 * n,
           lambda: into.scatter_add_(0, target_rows, x))
        columns = torch.randint(0, cols, (16,), device=dev)
        bw("index", "float32 index_select(dim 1), 16 columns", f"[{rows}, 16]", 8 * rows * 16,
           lambda: x.index_select(1, columns))
        del index, into, target_rows
        bw("scan", "float32 cumsum(dim 1) (rows)", f"[{rows}, {cols}]", 8 * n, lambda: torch.cumsum(x, 1))
        xt = x.view(cols, rows)
        bw("scan", "float32 cumsum(dim 0) (columns)", f"[{cols}, {rows}]", 8 * n, lambda: torch.cumsum(xt, 0))
        flat = x.view(n)
        bw("scan", "float32 cumsum of one row", f"[{n}]", 8 * n, lambda: torch.cumsum(flat, 0))
        few_columns = flat[:n // 128].view(n // 512, 4)
        bw("scan", "float32 cumsum(dim 0), 4 columns", f"[{n // 512}, 4]", 8 * n // 128,
           lambda: torch.cumsum(few_columns, 0))
        m = max(cols, n // 8 // cols * cols)
        keys = flat[:m].view(m // cols, cols)
        bw("sort", "float32 sort(dim 1)", f"[{m // cols}, {cols}]", 16 * m, lambda: torch.sort(keys, 1))
        one_row = keys.view(m)
        bw("sort", "float32 sort of one row", f"[{m}]", 16 * m, lambda: torch.sort(one_row, 0))
        bw("sort", "float32 topk(16, dim 1)", f"[{m // cols}, {cols}]", 4 * m, lambda: torch.topk(keys, 16, 1))
        del x, xt, flat, keys, one_row
        images = n // (64 * 64 * 64)
        if images >= 1:  # not one image in so few elements
            image = torch.randn(images, 64, 64, 64, device=dev)
            image_bytes, padded_bytes = 4 * image.numel(), 4 * images * 64 * 70 * 70
            ish = f"[{images}, 64, 64, 64]"
            bw("pad", "float32 reflection pad 3, forward", ish, image_bytes + padded_bytes,
               lambda: F.pad(image, (3, 3, 3, 3), mode="reflect"))
            leaf_image = image.detach().requires_grad_()
            padded_grad = torch.randn(images, 64, 70, 70, device=dev)

            def pad_both():
                leaf_image.grad = None
                F.pad(leaf_image, (3, 3, 3, 3), mode="reflect").backward(padded_grad)

            bw("pad", "float32 reflection pad 3, forward+backward", ish, 2 * (image_bytes + padded_bytes), pad_both)
            bw("pad", "float32 zero pad 1, forward", ish, image_bytes + 4 * images * 64 * 66 * 66,
               lambda: F.pad(image, (1, 1, 1, 1)))
            del image, leaf_image, padded_grad
    del a32, b32

    if want("gemm"):
        for size in args.gemm_sizes:
            for name, dt, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                   ("fp16", torch.float16, False), ("bf16", torch.bfloat16, False)):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                a = torch.randn(size, size, device=dev).to(dt)
                b = torch.randn(size, size, device=dev).to(dt)
                r = max(3, reps // 2 if size >= 8192 and dt == torch.float32 else reps)
                ms = median_ms(lambda: a @ b, r)
                row("gemm", f"{name} torch.matmul", f"{size}^3", 2 * size ** 3 / (ms * 1e-3) / 1e12, "TFLOP/s", ms)
        torch.backends.cuda.matmul.allow_tf32 = False


if __name__ == "__main__":
    main()
