#!/usr/bin/env python3
"""bench_conv_torch: tools/bench_conv.cpp's measurements in PyTorch on the same GPU, printed in the same rows.

    python3 tools/bench_conv_torch.py [--batch 256] [--iters 50] [--warmup 10] [--net all|resnet18|resnet50]
                                      [--dtype all|fp32|fp16] [--layout all|nchw|nhwc] [--no-tf32]

One step is y = F.conv2d(x, w, stride, padding); y.backward(dy): the forward, grad input (not for the
3-channel stem, whose input is the data) and grad weight, with x.grad and w.grad reset before each step.
torch.backends.cudnn.benchmark = True (each shape's algorithms are benchmarked during the warm-up, as halfgrad
does); NHWC tensors (x, w, dy) are made with memory_format=torch.channels_last. float32 convolutions may use
TF32 (PyTorch's default torch.backends.cudnn.allow_tf32 = True) unless --no-tf32 (then run bench_conv with
--tf32 false too). Timing: CUDA events around each step, the median of --iters steps after --warmup ones.
The project does not depend on PyTorch: this script is only for comparing.
"""
import argparse
import math
import sys

try:
    import torch
    import torch.nn.functional as F
    from torch_bench_layers import add_layer_arguments, cases, time_steps
except ImportError as e:  # not an error: the comparison is optional
    print(f"bench_conv_torch: PyTorch is not importable by {sys.executable} ({e}); nothing to compare.")
    sys.exit(0)

# (net, layer, in_channels, out_channels, kernel, stride, input size); padding = kernel // 2.
# The same list, in the same order, as kLayers in tools/bench_conv.cpp.
LAYERS = [
    # ResNet-18 (CIFAR stem: 3x3 conv, no max pool), BasicBlocks [2, 2, 2, 2]
    ("resnet18", "stem 3x3", 3, 64, 3, 1, 32),
    ("resnet18", "layer1 3x3", 64, 64, 3, 1, 32),
    ("resnet18", "layer2.0 3x3 s2", 64, 128, 3, 2, 32),
    ("resnet18", "layer2 3x3", 128, 128, 3, 1, 16),
    ("resnet18", "layer2.0 down 1x1 s2", 64, 128, 1, 2, 32),
    ("resnet18", "layer3.0 3x3 s2", 128, 256, 3, 2, 16),
    ("resnet18", "layer3 3x3", 256, 256, 3, 1, 8),
    ("resnet18", "layer3.0 down 1x1 s2", 128, 256, 1, 2, 16),
    ("resnet18", "layer4.0 3x3 s2", 256, 512, 3, 2, 8),
    ("resnet18", "layer4 3x3", 512, 512, 3, 1, 4),
    ("resnet18", "layer4.0 down 1x1 s2", 256, 512, 1, 2, 8),
    # ResNet-50 (CIFAR stem), Bottlenecks [3, 4, 6, 3], stride on the 3x3 (torchvision v1.5)
    ("resnet50", "stem 3x3", 3, 64, 3, 1, 32),
    ("resnet50", "layer1.0 1x1 in", 64, 64, 1, 1, 32),
    ("resnet50", "layer1 3x3", 64, 64, 3, 1, 32),
    ("resnet50", "layer1 1x1 out", 64, 256, 1, 1, 32),
    ("resnet50", "layer1.0 down 1x1", 64, 256, 1, 1, 32),
    ("resnet50", "layer1 1x1 in", 256, 64, 1, 1, 32),
    ("resnet50", "layer2.0 1x1 in", 256, 128, 1, 1, 32),
    ("resnet50", "layer2.0 3x3 s2", 128, 128, 3, 2, 32),
    ("resnet50", "layer2 1x1 out", 128, 512, 1, 1, 16),
    ("resnet50", "layer2.0 down 1x1 s2", 256, 512, 1, 2, 32),
    ("resnet50", "layer2 1x1 in", 512, 128, 1, 1, 16),
    ("resnet50", "layer2 3x3", 128, 128, 3, 1, 16),
    ("resnet50", "layer3.0 1x1 in", 512, 256, 1, 1, 16),
    ("resnet50", "layer3.0 3x3 s2", 256, 256, 3, 2, 16),
    ("resnet50", "layer3 1x1 out", 256, 1024, 1, 1, 8),
    ("resnet50", "layer3.0 down 1x1 s2", 512, 1024, 1, 2, 16),
    ("resnet50", "layer3 1x1 in", 1024, 256, 1, 1, 8),
    ("resnet50", "layer3 3x3", 256, 256, 3, 1, 8),
    ("resnet50", "layer4.0 1x1 in", 1024, 512, 1, 1, 8),
    ("resnet50", "layer4.0 3x3 s2", 512, 512, 3, 2, 8),
    ("resnet50", "layer4 1x1 out", 512, 2048, 1, 1, 4),
    ("resnet50", "layer4.0 down 1x1 s2", 1024, 2048, 1, 2, 8),
    ("resnet50", "layer4 1x1 in", 2048, 512, 1, 1, 4),
    ("resnet50", "layer4 3x3", 512, 512, 3, 1, 4),
]


def run_layer(layer, dtype, memory_format, args):
    _, _, cin, cout, k, stride, size = layer
    pad = k // 2
    input_grad = cin != 3  # the stem's input is the data
    out = (size + 2 * pad - (k - 1) - 1) // stride + 1
    dev = torch.device("cuda")
    x = torch.randn(args.batch, cin, size, size, device=dev).to(dtype).to(memory_format=memory_format)
    w = (torch.randn(cout, cin, k, k, device=dev) / math.sqrt(cin * k * k)).to(dtype)
    w = w.to(memory_format=memory_format)
    dy = torch.randn(args.batch, cout, out, out, device=dev).to(dtype).to(memory_format=memory_format)
    x.requires_grad_(input_grad)
    w.requires_grad_(True)

    def step():
        x.grad = None
        w.grad = None
        y = F.conv2d(x, w, None, stride, pad)
        y.backward(dy)

    return time_steps(step, args.warmup, args.iters)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_arguments(parser, iters=50)
    parser.add_argument("--no-tf32", action="store_true", help="full float32 convolutions (no TF32)")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("bench_conv_torch: no CUDA GPU is visible to PyTorch; this benchmark needs one.", file=sys.stderr)
        return 1
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = not args.no_tf32

    print(f"bench_conv_torch: PyTorch {torch.__version__} (cuDNN {torch.backends.cudnn.version()}) conv2d forward "
          f"+ backward on {torch.cuda.get_device_name(0)}, batch {args.batch}, median of {args.iters} steps after "
          f"{args.warmup} warm-up steps; float32 TF32 {'off' if args.no_tf32 else 'allowed'}; through autograd")
    print(f"{'net':<9} {'layer':<22} {'shape (C->O, k, s, HxW)':<26} {'dtype':<8} {'layout':<6} {'ms':>10} "
          f"{'TFLOP/s':>9} {'host ms':>8}")
    for layer in LAYERS:
        net, name, cin, cout, k, stride, size = layer
        if args.net not in ("all", net):
            continue
        for dname, dtype, lname, memory_format in cases(args):
            ms, host_ms = run_layer(layer, dtype, memory_format, args)
            out = (size + 2 * (k // 2) - (k - 1) - 1) // stride + 1
            flops = 2.0 * args.batch * cout * out * out * cin * k * k * (2 if cin == 3 else 3)
            shape = f"{cin}->{cout}, {k}x{k}, s{stride}, {size}x{size}"
            print(f"{net:<9} {name:<22} {shape:<26} {dname:<8} {lname:<6} {ms:>10.3f} "
                  f"{flops / (ms * 1e-3) / 1e12:>9.1f} {host_ms:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
