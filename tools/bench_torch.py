#!/usr/bin/env python3
"""bench_torch: `halfgrad bench`'s suites in PyTorch on the same GPU, as JSON lines of the same form.

    python3 tools/bench_torch.py SUITE [--models resnet50,lstm-650x2] [--precisions fp32,amp] [--batch 256]
                                 [--steps 20] [--warmup 5] [--compile] [--nchw] [--vocab 33278] [--bptt 35]
                                 [--memory-budget 8GiB] [--max-batch 65536] [--out bench.jsonl]
                                 [--epochs 30 --data-dir CIFAR_FOLDER --seed 1]

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
With --epochs (vgg, resnet, lm) each configuration trains on real data instead, with halfgrad's recipes
(tools/bench.h): a classifier on the CIFAR-10 files of --data-dir, a language model on WikiText-2 as pytorch/examples'
main.py trains it; the line then has the final test accuracy or test perplexity, seconds and images or tokens per
second per epoch (the mean after the first), the peak allocated memory.
The models are those of tools/bench_train_step_torch.py and tools/bench_lm_step_torch.py. The project does not
depend on PyTorch: this script is only for comparing; without it (or without a GPU) it prints why and exits 0.
"""
import argparse
import datetime
import io
import json
import math
import os
import subprocess
import sys
import tarfile

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
    # As cmake/git_commit.cmake labels halfgrad's lines: "-dirty" with changes to tracked files.
    commit = "unknown"
    try:
        git = ["git", "-C", os.path.dirname(os.path.abspath(__file__))]
        commit = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        if subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                          check=True).stdout.strip():
            commit += "-dirty"
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"device": "cuda:0", "gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
            "cudnn": _cudnn_version(), "pytorch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _cudnn_version():
    v = torch.backends.cudnn.version() or 0
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"


def mixed_precision(precision):
    """The autocast context of a precision: float16 for amp, bfloat16 for bf16, off for the others (a fresh one per
    `with`)."""
    dtype = {"amp": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None)


def clipped_update(loss, model, opt, scaler):
    """A language model's update, main.py's with amp: backward through the scaler, unscale_, clipping at 0.25, the
    step (skipped by the scaler on an overflow), zero_grad."""
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def workload(suite, model_name, precision, batch, args):
    """(step, items per step, unit): a training step on synthetic data already on the GPU."""
    gpu = torch.device("cuda")
    torch.manual_seed(0)
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
            with mixed_precision(precision):
                output, state["hidden"] = forward(data, hidden)
                loss = F.cross_entropy(output.float(), target)
            clipped_update(loss, model, opt, scaler)

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
        with mixed_precision(precision):
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


# ---- accuracy (--epochs): the recipes of train/loops.cpp, as a PyTorch user writes them

def read_cifar10(folder, split):
    """(images uint8 [N, 3, 32, 32], labels int64 [N]) from the official binary files present in folder:
    data_batch_1..5.bin for training (as halfgrad's loader, those that exist), test_batch.bin for testing."""
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] if split == "train" else ["test_batch.bin"]
    paths = [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]
    if not paths:
        sys.exit(f"bench_torch: no CIFAR-10 {split} files ({', '.join(names)}) in {folder}")
    records = []
    for path in paths:
        raw = open(path, "rb").read()
        if len(raw) == 0 or len(raw) % 3073:
            sys.exit(f"bench_torch: {path} is {len(raw)} bytes, not a whole number of 3,073-byte CIFAR-10 records")
        records.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, 3073))
    data = torch.cat(records)
    return data[:, 1:].reshape(-1, 3, 32, 32).contiguous(), data[:, 0].long()


CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # data/cifar.h


def normalised(images, gpu):
    mean = torch.tensor(CIFAR10_MEAN, device=gpu).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, device=gpu).view(1, 3, 1, 1)
    return (images.to(gpu).float() / 255 - mean) / std


def augmented(x, generator):
    """data::ImageTransform::cifar_train on a normalised batch: a random 32x32 window of the image padded by 4 zeros
    on each side, then a horizontal flip with probability 1/2, per image."""
    n = x.shape[0]
    padded = F.pad(x, (4, 4, 4, 4))
    dy = torch.randint(0, 9, (n,), device=x.device, generator=generator)
    dx = torch.randint(0, 9, (n,), device=x.device, generator=generator)
    flip = torch.rand(n, device=x.device, generator=generator) < 0.5
    ar = torch.arange(32, device=x.device)
    rows = (dy[:, None] + ar)[:, None, :, None]
    cols = dx[:, None] + ar
    cols = torch.where(flip[:, None], cols.flip(1), cols)[:, None, None, :]
    return padded[torch.arange(n, device=x.device)[:, None, None, None], torch.arange(3, device=x.device)[None, :, None, None],
                  rows, cols]


def steady_seconds(seconds):
    """Seconds an epoch in the steady state: the mean over the epochs after the first (halfgrad's steady_state)."""
    steady = seconds[1:] or seconds
    return sum(steady) / len(steady)


def train_classifier(model_name, precision, batch, args, line):
    """sweep-classifier's recipe: SGD (momentum 0.9 cycled by the schedule, weight decay 5e-4), OneCycleLR to lr 0.1
    (pct_start 0.3, div_factor 25), pad-4 crops and flips, batch `batch`, the last smaller batch kept; the final
    model evaluated once on the test files; augmentation on the GPU. Seconds per epoch (the training part) and the peak
    allocated memory: the mean and the most over the epochs after the first."""
    gpu = torch.device("cuda")
    torch.manual_seed(args.seed)
    generator = torch.Generator(device=gpu)
    generator.manual_seed(args.seed)
    train_x, train_y = read_cifar10(args.data_dir, "train")
    test_x, test_y = read_cifar10(args.data_dir, "test")
    train_x, train_y, test_x, test_y = normalised(train_x, gpu), train_y.to(gpu), normalised(test_x, gpu), test_y.to(gpu)
    layout = torch.contiguous_format if args.nchw else torch.channels_last
    model = make_model(model_name).to(gpu, memory_format=layout)
    half = precision == "fp16"
    if half:
        model.half()
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "amp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = (len(train_y) + batch - 1) // batch
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=args.epochs, steps_per_epoch=steps_per_epoch,
                                                   pct_start=0.3, div_factor=25)
    seconds = []
    for epoch in range(args.epochs):
        if epoch <= 1:  # the peak of the epochs after the first (cudnn.benchmark's trials), as halfgrad's lines
            torch.cuda.reset_peak_memory_stats()
        model.train()
        order = torch.randperm(len(train_y), device=gpu, generator=generator)
        correct = torch.zeros((), dtype=torch.int64, device=gpu)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(0, len(train_y), batch):
            index = order[i:i + batch]
            x = augmented(train_x[index], generator).contiguous(memory_format=layout)
            y = train_y[index]
            with mixed_precision(precision):
                logits = model(x.half() if half else x)
                loss = F.cross_entropy(logits.float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            schedule.step()
            correct += (logits.argmax(1) == y).sum()
        stop.record()
        torch.cuda.synchronize()
        seconds.append(start.elapsed_time(stop) / 1000)
    model.eval()
    test_loss, test_correct = 0.0, 0
    with torch.no_grad(), mixed_precision(precision):
        for i in range(0, len(test_y), batch):
            x = test_x[i:i + batch].contiguous(memory_format=layout)
            logits = model(x.half() if half else x).float()
            test_loss += F.cross_entropy(logits, test_y[i:i + batch], reduction="sum").item()
            test_correct += (logits.argmax(1) == test_y[i:i + batch]).sum().item()
    per_epoch = steady_seconds(seconds)
    line.update({"final_test_accuracy": test_correct / len(test_y), "final_test_loss": test_loss / len(test_y),
                 "final_train_accuracy": correct.item() / len(train_y), "seconds_per_epoch": per_epoch,
                 "images_per_second": len(train_y) / per_epoch,
                 "peak_allocated_bytes": torch.cuda.max_memory_allocated()})


def read_corpus(folder):
    """pytorch/examples' data.Corpus: words split on whitespace, "<eos>" after each line, ids in order of first
    appearance over train, valid and test. Reads folder/{train,valid,test}.txt, or halfgrad's shipped archive."""
    texts = {}
    if folder:
        for split in ("train", "valid", "test"):
            with open(os.path.join(folder, f"{split}.txt"), encoding="utf-8") as f:
                texts[split] = f.read()
    else:
        archive = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "wikitext-2",
                               "wikitext-2.tar.xz")
        with tarfile.open(archive, "r:xz") as tar:
            for split in ("train", "valid", "test"):
                texts[split] = tar.extractfile(f"wikitext-2/{split}.txt").read().decode("utf-8")
    ids, splits = {}, {}
    for split in ("train", "valid", "test"):
        tokens = []
        for text_line in io.StringIO(texts[split]):  # lines as main.py's file iteration gives them
            for word in text_line.split() + ["<eos>"]:
                tokens.append(ids.setdefault(word, len(ids)))
        splits[split] = torch.tensor(tokens, dtype=torch.int64)
    return splits, len(ids)


def train_language_model(model_name, precision, batch, args, line):
    """pytorch/examples' main.py with its defaults (dropout 0.2, lr 20 quartered when the validation loss does not
    improve, clipping 0.25, evaluation batch 10, the best model tested), as train-lm trains: amp through autocast
    float16 and a GradScaler (unscale_ before clipping), the update SGD's. Perplexities after args.epochs epochs."""
    gpu = torch.device("cuda")
    torch.manual_seed(args.seed)
    splits, vocab = read_corpus(args.data_dir)

    def batchify(data, size):
        n = data.size(0) // size
        return data[:n * size].view(size, n).t().contiguous().to(gpu)

    train, valid, test = batchify(splits["train"], batch), batchify(splits["valid"], 10), batchify(splits["test"], 10)
    kind, hidden, layers = language_model_shape(model_name)
    model = RNNModel(kind, vocab, hidden, hidden, layers, 0.2).to(gpu)
    if precision == "fp16":
        model.half()
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "amp")
    lr = 20.0
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def evaluate(source):
        model.eval()
        total, state = 0.0, model.init_hidden(10)
        with torch.no_grad(), mixed_precision(precision):
            for i in range(0, source.size(0) - 1, args.bptt):
                n = min(args.bptt, source.size(0) - 1 - i)
                output, state = model(source[i:i + n], state)
                total += n * F.cross_entropy(output.float(), source[i + 1:i + 1 + n].reshape(-1)).item()
        return total / (source.size(0) - 1)

    best, best_state, seconds = float("inf"), None, []
    for epoch in range(args.epochs):
        if epoch <= 1:
            torch.cuda.reset_peak_memory_stats()
        model.train()
        state = model.init_hidden(batch)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(0, train.size(0) - 1, args.bptt):
            n = min(args.bptt, train.size(0) - 1 - i)
            state = repackage_hidden(state)
            with mixed_precision(precision):
                output, state = model(train[i:i + n], state)
                loss = F.cross_entropy(output.float(), train[i + 1:i + 1 + n].reshape(-1))
            clipped_update(loss, model, opt, scaler)
        stop.record()
        torch.cuda.synchronize()
        seconds.append(start.elapsed_time(stop) / 1000)
        valid_loss = evaluate(valid)
        if valid_loss < best:
            best, best_state = valid_loss, {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            lr /= 4
            for group in opt.param_groups:
                group["lr"] = lr
    final_valid = valid_loss
    if best_state is None:
        line["error"] = "no epoch had a finite validation loss"
        return
    model.load_state_dict(best_state)
    per_epoch = steady_seconds(seconds)
    line.update({"test_perplexity": math.exp(evaluate(test)), "final_valid_perplexity": math.exp(final_valid),
                 "seconds_per_epoch": per_epoch, "tokens_per_second": (train.size(0) - 1) * batch / per_epoch,
                 "peak_allocated_bytes": torch.cuda.max_memory_allocated()})


def fits(suite, model, precision, batch, args, smaller_fit, limit):
    """Whether two steps at `batch` fit. Out of memory: no. Another error after a smaller batch ran is a size limit
    of the implementation (as tools/bench.cpp's fits): no, its message appended to `limit`."""
    try:
        step, _, _ = workload(suite, model, precision, batch, args)
        step()
        step()
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    except RuntimeError as e:
        if not smaller_fit:
            raise
        limit.append(str(e).splitlines()[0])
        return False
    finally:
        torch.cuda.empty_cache()


def search_max_batch(suite, model, precision, start, args, line):
    total = torch.cuda.get_device_properties(0).total_memory
    budget = args.memory_budget or total
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    torch.backends.cudnn.benchmark = False  # as halfgrad's search: each probe is a new batch size
    good, bad, probes, b = 0, 0, 0, max(1, start)
    limit = []
    try:
        while b <= args.max_batch:
            probes += 1
            if not fits(suite, model, precision, b, args, good > 0, limit):
                bad = b
                break
            good, b = b, b * 2
        bad = bad or args.max_batch + 1
        while bad - good > max(1, good // 100):
            mid = good + (bad - good) // 2
            probes += 1
            if fits(suite, model, precision, mid, args, good > 0, limit):
                good = mid
            else:
                bad = mid
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.backends.cudnn.benchmark = True
    line.update({"max_batch": good, "memory_budget_bytes": budget, "probes": probes,
                 "reached_ceiling": good == args.max_batch})
    if limit:
        line["limited_by"] = limit[-1]


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
    parser.add_argument("--epochs", type=int, default=0, help="train on real data instead of timing steps")
    parser.add_argument("--data-dir", default="", help="with --epochs: the CIFAR-10 files' folder; for lm a folder "
                        "of train/valid/test.txt (default: the WikiText-2 halfgrad ships)")
    parser.add_argument("--seed", type=int, default=0, help="with --epochs: the runs' seed")
    args = parser.parse_args()
    if args.epochs < 0 or (args.epochs > 0 and args.suite in ("max-batch", "all")):
        sys.exit(f"bench_torch {args.suite}: --epochs {args.epochs}: trained runs are for vgg, resnet and lm, epochs >= 1")
    if args.epochs > 0 and args.suite != "lm" and not args.data_dir:
        sys.exit(f"bench_torch {args.suite}: --epochs trains on the CIFAR-10 files: give their folder with --data-dir")
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
        dataset = "synthetic" if not args.epochs else "cifar10" if suite != "lm" else \
            "text" if args.data_dir else "wikitext-2"
        line = {"framework": "pytorch", "suite": suite, "model": model, "precision": precision, "batch": batch,
                "dataset": dataset, **env, "compile": args.compile, "out_of_memory": False}
        if args.epochs:
            line.update({"data_dir": args.data_dir, "epochs": args.epochs, "seed": args.seed})
        elif suite != "max-batch":
            line.update({"warmup": args.warmup, "steps": args.steps})
        if suite == "lm":
            line["bptt"] = args.bptt
        if precision == "o2":
            line["error"] = "apex's O2 (a half model with float32 master weights) has no PyTorch equivalent"
        else:
            try:
                if suite == "max-batch":
                    search_max_batch(suite, model, precision, batch, args, line)
                elif args.epochs:
                    (train_language_model if suite == "lm" else train_classifier)(model, precision, batch, args, line)
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
