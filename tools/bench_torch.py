#!/usr/bin/env python3
"""bench_torch: `halfgrad bench`'s suites in PyTorch on the same GPU, as JSON lines of the same form.

    python3 tools/bench_torch.py SUITE [--models resnet50,lstm-650x2] [--precisions fp32,amp] [--batch 256]
                                 [--steps 20] [--warmup 5] [--compile] [--nchw] [--vocab 33278] [--bptt 35]
                                 [--memory-budget 8GiB] [--max-batch 65536] [--out bench.jsonl]

The suites, models, precisions, data and steps are tools/bench.h's (vgg, resnet, lm, max-batch, all): the same
configurations in the same order, the same synthetic data (standard-normal CIFAR-shaped images, random labels and
tokens, made once on the GPU), the same step (forward, cross entropy in float32, backward, SGD momentum 0.9 and
weight decay 5e-4 for images; clipping at 0.25 and SGD lr 20 for language models; zero_grad). PyTorch as its users run
it: channels_last with cudnn.benchmark, TF32 where halfgrad's defaults use it (float32 convolutions: cudnn.allow_tf32
on, as halfgrad's conv_allow_tf32; matrix products and the language models' cuDNN RNNs: off, as halfgrad's
cuda::allow_tf32), and with --compile the model through
torch.compile(mode="reduce-overhead") (compiled in warm-up steps, at least 10). Precisions: fp32; amp
(torch.autocast float16 with a GradScaler, unscale_ before clipping); bf16 (autocast bfloat16, no scaler); fp16 (the
model and inputs in float16); o2 (apex's O2) has no PyTorch equivalent: its configurations are lines saying so.
Each line: "framework": "pytorch", the case, "ms" {median, min, p10, p90, max} of the timed steps (CUDA events around
each), images or tokens per second, "peak_allocated_bytes" / "peak_reserved_bytes" (torch.cuda's peaks over the timed
steps), "out_of_memory"; max-batch: the largest batch under the budget (torch.cuda.set_per_process_memory_fraction).
The models are those of tools/bench_train_step_torch.py and tools/bench_lm_step_torch.py. The project does not
depend on PyTorch: this script is only for comparing; without it (or without a GPU) it prints why and exits 0.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import torch
    import torch.nn.functional as F
    from bench_lm_step_torch import RNNModel, repackage_hidden
    from bench_train_step_torch import RESNETS, VGG_CONFIGS, make_model
except ImportError as e:  # not an error: the comparison is optional
    print(f"bench_torch: PyTorch is not importable by {sys.executable} ({e}); nothing to compare.", file=sys.stderr)
    sys.exit(0)

SUITES = ["vgg", "resnet", "lm", "max-batch", "all"]
PRECISIONS = ["fp32", "amp", "o2", "fp16", "bf16"]
CLASSIFIERS = list(RESNETS) + list(VGG_CONFIGS)
DEFAULTS = {  # tools/bench.cpp's suite_cases
    "vgg": (["vgg16"], ["fp32", "fp16", "amp"], [128, 256, 512, 1024, 2048]),
    "resnet": (list(RESNETS), ["fp32", "amp", "o2", "bf16"], [256]),
    "lm": (["lstm-200x2", "lstm-650x2", "gru-200x2", "gru-650x2"], ["fp32", "amp"], [20]),
    "max-batch": (list(RESNETS), ["fp32", "amp", "o2", "fp16"], [64]),
}


def language_model_shape(name):
    """"lstm-650x2" -> ("lstm", 650, 2), or None."""
    kind, _, size = name.partition("-")
    hidden, _, layers = size.partition("x")
    if kind not in ("lstm", "gru", "rnn_tanh", "rnn_relu") or not hidden.isdigit() or not layers.isdigit():
        return None
    if int(hidden) < 1 or int(layers) < 1:
        return None
    return kind, int(hidden), int(layers)


def suite_cases(suite, models, precisions, batches):
    if suite == "all":
        return [c for one in ("vgg", "resnet", "lm", "max-batch") for c in suite_cases(one, models, precisions, batches)]
    m, p, b = DEFAULTS[suite]
    m, p, b = models or m, precisions or p, batches or b
    for model in m:
        if suite == "lm" and language_model_shape(model) is None:
            sys.exit(f"bench_torch lm: \"{model}\" is not a language model (\"lstm-650x2\")")
        if suite != "lm" and model not in CLASSIFIERS:
            sys.exit(f"bench_torch {suite}: \"{model}\" is not an image classifier ({', '.join(CLASSIFIERS)})")
    for precision in p:
        if precision not in PRECISIONS:
            sys.exit(f"bench_torch: unknown precision \"{precision}\" ({', '.join(PRECISIONS)})")
    return [(suite, model, precision, batch) for model in m for precision in p for batch in b]


def parse_bytes(text):
    units = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9,
             "TB": 1e12}
    number = text.rstrip("KMGTiB")
    try:
        return int(round(float(number) * units[text[len(number):]]))
    except (ValueError, KeyError):
        sys.exit(f"bench_torch: \"{text}\" is not a size (say 8GiB, 512MiB, 1.5GB or a number of bytes)")


def environment():
    commit = "unknown"
    try:
        commit = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short=12",
                                 "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"device": "cuda:0", "gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
            "cudnn": _cudnn_version(), "pytorch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _cudnn_version():
    v = torch.backends.cudnn.version() or 0
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"


def workload(suite, model_name, precision, batch, args):
    """(step, items per step, unit): a training step on synthetic data already on the GPU."""
    gpu = torch.device("cuda")
    torch.manual_seed(0)
    autocast = {"amp": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "amp")
    if suite == "lm":
        kind, hidden, layers = language_model_shape(model_name)
        model = RNNModel(kind, args.vocab, hidden, hidden, layers, 0.2).to(gpu)
        if precision == "fp16":
            model.half()
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=20)
        data = torch.randint(0, args.vocab, (args.bptt, batch), device=gpu)
        target = torch.randint(0, args.vocab, (args.bptt * batch,), device=gpu)
        state = {"hidden": model.init_hidden(batch)}
        forward = torch.compile(model, mode="reduce-overhead") if args.compile else model

        def step():
            hidden = repackage_hidden(state["hidden"])
            with torch.autocast("cuda", dtype=autocast or torch.float16, enabled=autocast is not None):
                output, state["hidden"] = forward(data, hidden)
                loss = F.cross_entropy(output.float(), target)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        return step, args.bptt * batch, "tokens_per_second"
    layout = torch.contiguous_format if args.nchw else torch.channels_last
    model = make_model(model_name).to(gpu, memory_format=layout)
    x = torch.randn(batch, 3, 32, 32, device=gpu).contiguous(memory_format=layout)
    if precision == "fp16":
        model.half()
        x = x.half()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    y = torch.randint(0, 10, (batch,), device=gpu)
    forward = torch.compile(model, mode="reduce-overhead") if args.compile else model

    def step():
        with torch.autocast("cuda", dtype=autocast or torch.float16, enabled=autocast is not None):
            loss = F.cross_entropy(forward(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step, batch, "images_per_second"


def spread(ms):
    ms = sorted(ms)
    at = lambda q: ms[round(q * (len(ms) - 1))]
    return {"median": at(0.5), "min": ms[0], "p10": at(0.1), "p90": at(0.9), "max": ms[-1]}


def measure(suite, model, precision, batch, args, line):
    step, items, unit = workload(suite, model, precision, batch, args)
    step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # cudnn.benchmark's workspaces out of the reserved figure, as halfgrad's bench does
    torch.cuda.reset_peak_memory_stats()
    for _ in range(max(args.warmup, 10) if args.compile else args.warmup):
        step()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(args.steps)]
    for start, stop in events:
        start.record()
        step()
        stop.record()
    torch.cuda.synchronize()
    line["ms"] = spread([start.elapsed_time(stop) for start, stop in events])
    line[unit] = items / (line["ms"]["median"] * 1e-3)
    line["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    line["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()


def fits(suite, model, precision, batch, args):
    try:
        step, _, _ = workload(suite, model, precision, batch, args)
        step()
        step()
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def search_max_batch(suite, model, precision, start, args, line):
    total = torch.cuda.get_device_properties(0).total_memory
    budget = args.memory_budget or total
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    torch.backends.cudnn.benchmark = False  # as halfgrad's search: each probe is a new batch size
    good, bad, probes, b = 0, 0, 0, max(1, start)
    try:
        while b <= args.max_batch:
            probes += 1
            if not fits(suite, model, precision, b, args):
                bad = b
                break
            good, b = b, b * 2
        bad = bad or args.max_batch + 1
        while bad - good > max(1, good // 100):
            mid = good + (bad - good) // 2
            probes += 1
            if fits(suite, model, precision, mid, args):
                good = mid
            else:
                bad = mid
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.backends.cudnn.benchmark = True
    line.update({"max_batch": good, "memory_budget_bytes": budget, "probes": probes,
                 "reached_ceiling": good == args.max_batch})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--models", default="")
    parser.add_argument("--precisions", default="")
    parser.add_argument("--batch", default="")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--nchw", action="store_true")
    parser.add_argument("--vocab", type=int, default=33278)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--memory-budget", default="")
    parser.add_argument("--max-batch", type=int, default=65536)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_torch: no CUDA GPU is visible to PyTorch; nothing to compare.", file=sys.stderr)
        return
    args.memory_budget = parse_bytes(args.memory_budget) if args.memory_budget else 0
    split = lambda text: [t for t in text.split(",") if t]
    cases = suite_cases(args.suite, split(args.models), split(args.precisions), [int(b) for b in split(args.batch)])
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    env = environment()
    out = open(args.out, "a") if args.out else None
    for i, (suite, model, precision, batch) in enumerate(cases):
        print(f"bench_torch {suite}: [{i + 1}/{len(cases)}] {model} {precision} batch {batch}", file=sys.stderr)
        torch.backends.cudnn.allow_tf32 = suite != "lm"  # convolutions yes, cuDNN RNNs no: halfgrad's defaults
        line = {"framework": "pytorch", "suite": suite, "model": model, "precision": precision, "batch": batch,
                "dataset": "synthetic", **env, "compile": args.compile, "out_of_memory": False}
        if suite != "max-batch":
            line.update({"warmup": args.warmup, "steps": args.steps})
        if precision == "o2":
            line["error"] = "apex's O2 (a half model with float32 master weights) has no PyTorch equivalent"
        else:
            try:
                if suite == "max-batch":
                    search_max_batch(suite, model, precision, batch, args, line)
                else:
                    measure(suite, model, precision, batch, args, line)
            except torch.cuda.OutOfMemoryError as e:
                line.update({"out_of_memory": True, "error": str(e).splitlines()[0]})
            torch.cuda.empty_cache()
        text = json.dumps(line)
        print(text, flush=True)
        if out:
            out.write(text + "\n")
            out.flush()


if __name__ == "__main__":
    main()
