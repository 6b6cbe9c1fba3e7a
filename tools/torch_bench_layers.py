"""What the PyTorch comparison scripts (bench_conv_torch.py, bench_batch_norm_torch.py) share, as tools/bench_layers.h
for the C++ benchmarks: the common options, the loop over dtypes and layouts, and step timing (CUDA events around
each step on the current stream, steps not synchronized one by one, medians; host_ms is the median wall time the host
took to issue one step)."""
import statistics
import time

import torch


def add_layer_arguments(parser, iters):
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--net", choices=["all", "resnet18", "resnet50"], default="all")
    parser.add_argument("--dtype", choices=["all", "fp32", "fp16"], default="all")
    parser.add_argument("--layout", choices=["all", "nchw", "nhwc"], default="all")


def cases(args):
    """(dtype name, dtype, layout name, memory format) for the cases the arguments select, in the rows' order."""
    for dname, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        if args.dtype not in ("all", dname):
            continue
        for lname, memory_format in (("NCHW", torch.contiguous_format), ("NHWC", torch.channels_last)):
            if args.layout in ("all", lname.lower()):
                yield dname, dtype, lname, memory_format


def time_steps(step, warmup, iters):
    """(ms, host_ms): medians over `iters` steps after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stop = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    host = []
    for i in range(iters):
        start[i].record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        stop[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, stop)), statistics.median(host)
