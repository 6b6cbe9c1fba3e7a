#!/usr/bin/env python3
"""bench_batch_norm_torch: tools/bench_batch_norm.cpp's measurements in PyTorch on the same GPU, in the same rows.

    python3 tools/bench_batch_norm_torch.py [--batch 256] [--iters 100] [--warmup 10] [--net all|resnet18|resnet50]
                                            [--dtype all|fp32|fp16] [--layout all|nchw|nhwc]

One step is y = F.batch_norm(x, running_mean, running_var, weight, bias, training=True); y.backward(dy), with the
gradients reset before each step; weight, bias and the running statistics are float32 whatever x's dtype (what
autocast hands BatchNorm). Timing: tools/torch_bench_layers.py (CUDA events, medians). The project does not depend on
PyTorch: this script is only for comparing.
"""
import argparse
import sys

try:
    import torch
    import torch.nn.functional as F
    from torch_bench_layers import add_layer_arguments, cases, time_steps
except ImportError as e:  # not an error: the comparison is optional
    print(f"bench_batch_norm_torch: PyTorch is not importable by {sys.executable} ({e}); nothing to compare.")
    sys.exit(0)

# (net, channels, size): the same list, in the same order, as kShapes in tools/bench_batch_norm.cpp.
SHAPES = [
    ("resnet18", 64, 32), ("resnet18", 128, 16), ("resnet18", 256, 8), ("resnet18", 512, 4),
    ("resnet50", 64, 32), ("resnet50", 256, 32), ("resnet50", 128, 32), ("resnet50", 128, 16),
    ("resnet50", 512, 16), ("resnet50", 256, 16), ("resnet50", 256, 8), ("resnet50", 1024, 8),
    ("resnet50", 512, 8), ("resnet50", 512, 4), ("resnet50", 2048, 4),
]


def run_shape(channels, size, dtype, memory_format, args):
    dev = torch.device("cuda")
    x = torch.randn(args.batch, channels, size, size, device=dev).to(dtype).to(memory_format=memory_format)
    dy = torch.randn(args.batch, channels, size, size, device=dev).to(dtype).to(memory_format=memory_format)
    x.requires_grad_(True)
    weight = (torch.rand(channels, device=dev) + 0.5).requires_grad_(True)
    bias = torch.randn(channels, device=dev).requires_grad_(True)
    running_mean = torch.zeros(channels, device=dev)
    running_var = torch.ones(channels, device=dev)

    def step():
        x.grad = None
        weight.grad = None
        bias.grad = None
        y = F.batch_norm(x, running_mean, running_var, weight, bias, training=True)
        y.backward(dy)

    return time_steps(step, args.warmup, args.iters)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_arguments(parser, iters=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_batch_norm_torch: no CUDA GPU is visible to PyTorch; this benchmark needs one.", file=sys.stderr)
        return 1
    torch.backends.cudnn.benchmark = True

    print(f"bench_batch_norm_torch: PyTorch {torch.__version__} (cuDNN {torch.backends.cudnn.version()}) batch_norm "
          f"forward + backward (training) on {torch.cuda.get_device_name(0)}, batch {args.batch}, median of "
          f"{args.iters} steps after {args.warmup} warm-up steps; parameters and statistics in float32")
    print(f"{'net':<9} {'shape (N, C, HxW)':<20} {'dtype':<8} {'layout':<6} {'ms':>10} {'GB/s':>9} {'host ms':>8}")
    for net, channels, size in SHAPES:
        if args.net not in ("all", net):
            continue
        for dname, dtype, lname, memory_format in cases(args):
            ms, host_ms = run_shape(channels, size, dtype, memory_format, args)
            nbytes = 5.0 * args.batch * channels * size * size * torch.tensor([], dtype=dtype).element_size()
            shape = f"{args.batch}, {channels}, {size}x{size}"
            print(f"{net:<9} {shape:<20} {dname:<8} {lname:<6} {ms:>10.3f} {nbytes / (ms * 1e-3) / 1e9:>9.0f} "
                  f"{host_ms:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
