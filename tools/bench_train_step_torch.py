#!/usr/bin/env python3
"""bench_train_step_torch: tools/bench_train_step.cpp's measurement in PyTorch on the same GPU, in the same rows.

    python3 tools/bench_train_step_torch.py [--model resnet18|...|vgg16] [--batch 128,512] [--opt-levels O0,O1,O3]
                                            [--nchw] [--compile] [--iters 30] [--warmup 5]

One step: logits = model(x); loss = cross_entropy(logits, y); backward; SGD step (momentum 0.9, weight decay 5e-4,
PyTorch's default foreach implementation); zero_grad. The models are torchvision's ResNets with the CIFAR stem (3x3
stride-1 convolution, no max pool) and VGG with BatchNorm and one Linear classifier (models/vgg.h), written out here
so that torchvision is not needed. --compile: the model through torch.compile(mode="reduce-overhead") (Inductor's
fused kernels, CUDA graphs), compiled during the warm-up steps (at least 10). Levels: O0 float32; O1
torch.autocast(float16) with a GradScaler; O3 the model and inputs in float16. O2 (half model with float32 master
weights) has no PyTorch equivalent without apex: its rows are left out. cudnn.benchmark on, TF32 on for
convolutions and off for matrix products: PyTorch's defaults, and halfgrad's (ops/conv.h, core/cuda.h). Timing:
tools/torch_bench_layers.py. The project does not
depend on PyTorch: this script is only for comparing.
"""
import argparse
import sys

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch_bench_layers import time_steps
except ImportError as e:  # not an error: the comparison is optional
    print(f"bench_train_step_torch: PyTorch is not importable by {sys.executable} ({e}); nothing to compare.")
    sys.exit(0)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.downsample = None
        if stride != 1 or in_planes != planes * 4:
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes * 4, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes * 4))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


VGG_CONFIGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(self, config, classes=10):
        super().__init__()
        layers, channels = [], 3
        for v in config:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            layers += [nn.Conv2d(channels, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
            channels = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


RESNETS = {"resnet18": (BasicBlock, (2, 2, 2, 2)), "resnet34": (BasicBlock, (3, 4, 6, 3)),
           "resnet50": (Bottleneck, (3, 4, 6, 3)), "resnet101": (Bottleneck, (3, 4, 23, 3)),
           "resnet152": (Bottleneck, (3, 8, 36, 3))}


def make_model(name):
    """The model, initialised as halfgrad's (models/resnet.cpp, models/vgg.cpp) and torchvision's: convolutions
    kaiming_normal_(fan_out, relu) with zero biases; BatchNorm and Linear keep PyTorch's defaults."""
    model = VGG(VGG_CONFIGS[name]) if name in VGG_CONFIGS else ResNet(*RESNETS[name])
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


class ResNet(nn.Module):
    def __init__(self, block, blocks, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, in_planes = [], 64
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), blocks)):
            for j in range(n):
                layers.append(block(in_planes, planes, 2 if (i > 0 and j == 0) else 1))
                in_planes = planes * block.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(in_planes, classes)

    def forward(self, x):
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(RESNETS) + list(VGG_CONFIGS), default="resnet18")
    parser.add_argument("--batch", default="128,512")
    parser.add_argument("--opt-levels", default="O0,O1,O3")
    parser.add_argument("--nchw", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    warmup = max(args.warmup, 10) if args.compile else args.warmup
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = torch.device("cuda")
    fmt = torch.contiguous_format if args.nchw else torch.channels_last
    print(f"bench_train_step_torch: PyTorch {torch.__version__} {args.model} training step (CIFAR, 10 classes) on "
          f"{torch.cuda.get_device_name(0)}, {'NCHW' if args.nchw else 'channels_last'}, data on the GPU"
          f"{', torch.compile(mode=reduce-overhead)' if args.compile else ''}, median of {args.iters} steps after "
          f"{warmup} warm-up steps")
    print(f"{'model':<9} {'batch':>6} {'level':<6} {'ms':>9} {'images/s':>10} {'host ms':>9} {'peak MiB':>9}")
    for batch in (int(b) for b in args.batch.split(",")):
        for level in args.opt_levels.split(","):
            if level not in ("O0", "O1", "O3"):
                print(f"{args.model:<9} {batch:>6} {level:<6} (no PyTorch equivalent without apex)")
                continue
            torch.manual_seed(0)
            model = make_model(args.model).to(gpu, memory_format=fmt)
            half = level == "O3"
            if half:
                model.half()
            forward = torch.compile(model, mode="reduce-overhead") if args.compile else model
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
            scaler = torch.amp.GradScaler("cuda", enabled=level == "O1")
            x = torch.randn(batch, 3, 32, 32, device=gpu).contiguous(memory_format=fmt)
            if half:
                x = x.half()
            y = torch.randint(0, 10, (batch,), device=gpu)

            def step():
                with torch.autocast("cuda", dtype=torch.float16, enabled=level == "O1"):
                    loss = F.cross_entropy(forward(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)

            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ms, host_ms = time_steps(step, warmup, args.iters)
            peak = torch.cuda.max_memory_allocated() / 2**20
            print(f"{args.model:<9} {batch:>6} {level:<6} {ms:>9.2f} {batch / (ms * 1e-3):>10.0f} {host_ms:>9.2f} "
                  f"{peak:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
