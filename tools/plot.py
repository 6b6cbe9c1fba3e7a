#!/usr/bin/env python3
"""plot: the experiments' figures from the JSON lines of `halfgrad bench` (and tools/bench_torch.py).

    python3 tools/plot.py bench.jsonl [more.jsonl ...] --out-dir docs/figures [--title "H200"]
    python3 tools/plot.py sweep_seed1.jsonl sweep_seed2.jsonl ... --out-dir figures  # sweep-classifier --jsonl

One figure per suite found in the lines, each written as PNG and SVG:
  vgg.{png,svg}        per precision, step time and peak memory against batch size (the VGG16 benchmark's figure);
                       the largest batch that ran is where a precision's line ends, out-of-memory batches are marked
  resnet.{png,svg}     per model, step time of each precision, and each precision's speed-up over fp32
  lm.{png,svg}         per language model, tokens per second of each precision
  max-batch.{png,svg}  per model, the largest batch of each precision under the memory budget
  sweep.{png,svg}      from `halfgrad sweep-classifier --jsonl` (its "row" lines; its other events are skipped): per
                       batch size and precision, training throughput, peak GPU memory and final test accuracy, each
                       the mean over the files given (runs of other seeds) with their spread as error bars
  <suite>-accuracy.{png,svg}  from `halfgrad bench --epochs` lines: the same panels per model and batch (language
                       models: tokens per second and test perplexity), the mean over the lines of a configuration
                       (seeds) with their spread
Lines of another framework (PyTorch) are drawn dashed next to halfgrad's, and CUDA-graph or torch.compile runs
dotted as series of their own ("halfgrad graph", "pytorch compile"), so that every comparison comes from the files
given. Later lines of the same configuration replace earlier ones. Needs matplotlib (Debian's
python3-matplotlib); exits with 77 without it, which the ctest counts as skipped.
"""
import argparse
import json
import os
import re
import sys
from collections import OrderedDict

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("plot: matplotlib is not importable (apt install python3-matplotlib); no figures", file=sys.stderr)
    sys.exit(77)

PRECISIONS = ["fp32", "amp", "o2", "fp16", "bf16"]
COLOURS = {"fp32": "#4c72b0", "amp": "#55a868", "o2": "#c44e52", "fp16": "#8172b2", "bf16": "#ccb974"}
STYLE = {"halfgrad": "-", "pytorch": "--"}


SWEEP_FIELDS = ("precision", "batch_size", "out_of_memory", "images_per_second", "peak_memory_bytes",
                "final_test_accuracy")


def sweep_row(line, where):
    missing = [k for k in SWEEP_FIELDS if k not in line]
    if missing:
        sys.exit(f"plot: {where}: the sweep row has no {', '.join(missing)}")
    return line


def trained_row(line):
    """A `bench --epochs` line as a row of a training run: its series (the model and its epochs, and the framework and
    the CUDA graph where it is not halfgrad's eager run), precision, batch and figures."""
    framework = line.get("framework", "halfgrad")
    series = f"{line['model']} {line['epochs']} ep"
    series += "" if framework == "halfgrad" else f" ({framework})"
    series += " graph" if line.get("cuda_graph") else ""
    row = {"model": series, "precision": line["precision"], "batch_size": line["batch"],
           "out_of_memory": line.get("out_of_memory", False)}
    for key in ("images_per_second", "tokens_per_second", "final_test_accuracy", "test_perplexity"):
        if key in line:
            row[key] = line[key]
    if "peak_allocated_bytes" in line:  # none on the CPU
        row["peak_memory_bytes"] = line["peak_allocated_bytes"]
    return row


def read_lines(paths):
    """({suite: OrderedDict{(framework, model, precision, batch): line}}, the last line of a configuration winning;
    [sweep rows]; {suite: [rows of `bench --epochs` runs: the last line of a configuration and seed winning, the
    seeds of a configuration averaged]})."""
    suites = OrderedDict()
    sweep = []
    trained = OrderedDict()
    for path in paths:
        with open(path) as f:
            for number, text in enumerate(f, 1):
                text = text.strip()
                if not text:
                    continue
                try:
                    line = json.loads(text)
                except json.JSONDecodeError as e:
                    sys.exit(f"plot: {path}:{number}: not a JSON line ({e})")
                if "event" in line:  # halfgrad's --jsonl: a sweep's rows are drawn, its progress lines are not
                    if line["event"] == "row":
                        sweep.append(sweep_row(line, f"{path}:{number}"))
                    continue
                for key in ("suite", "model", "precision", "batch"):
                    if key not in line:
                        sys.exit(f"plot: {path}:{number}: the line has no \"{key}\"")
                if line.get("epochs"):  # trained on real data: accuracy, not step time
                    row = trained_row(line)
                    key = (row["model"], row["precision"], row["batch_size"], line.get("seed"))
                    trained.setdefault(line["suite"], OrderedDict())[key] = row
                    continue
                # A CUDA-graph or torch.compile run is a series of its own ("halfgrad graph", "pytorch compile").
                framework = line.get("framework", "halfgrad")
                framework += " graph" if line.get("cuda_graph") else ""
                framework += " compile" if line.get("compile") else ""
                key = (framework, line["model"], line["precision"], line["batch"])
                suites.setdefault(line["suite"], OrderedDict())[key] = line
    return suites, sweep, trained


def natural(text):
    """"resnet101" after "resnet18": digits compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(text))]


def ordered(values, order):
    return sorted(values, key=lambda v: (order.index(v) if v in order else len(order), natural(v)))


def median_ms(line):
    return None if line.get("out_of_memory") or "ms" not in line else line["ms"]["median"]


def save(fig, out_dir, name):
    for ext in ("png", "svg"):
        path = os.path.join(out_dir, f"{name}.{ext}")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        print(f"plot: wrote {path}")
    plt.close(fig)


def plot_vgg(lines, out_dir, title):
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4))
    groups = OrderedDict()
    for (framework, model, precision, batch), line in lines.items():
        groups.setdefault((framework, model, precision), []).append((batch, line))
    for (framework, model, precision), points in groups.items():
        points.sort()
        ran = [(b, line) for b, line in points if median_ms(line) is not None]
        label = f"{precision}" + ("" if framework == "halfgrad" else f" ({framework})")
        style = dict(color=COLOURS.get(precision, "grey"), linestyle=STYLE.get(framework, ":"), marker="o")
        if ran:
            time_ax.plot([b for b, _ in ran], [median_ms(l) for _, l in ran], label=label, **style)
            memory = [(b, l["peak_allocated_bytes"] / 2**20) for b, l in ran if "peak_allocated_bytes" in l]
            if memory:
                memory_ax.plot([b for b, _ in memory], [m for _, m in memory], label=label, **style)
        for b, line in points:
            if line.get("out_of_memory"):  # at the foot of the panel, whatever its scale
                time_ax.annotate("OOM", (b, 0.02), xycoords=("data", "axes fraction"), color=style["color"],
                                 ha="center", va="bottom", fontsize=8)
    for ax, what in ((time_ax, "ms per training step"), (memory_ax, "peak GPU memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # the CPU has no memory figures
            ax.legend(fontsize=8)
    fig.suptitle(f"VGG16 on CIFAR-shaped data{' - ' + title if title else ''}")
    save(fig, out_dir, "vgg")


def bars(ax, categories, series, ylabel):
    """Grouped bars: categories along x, one bar per (label, values, colour, hatch) of series."""
    width = 0.8 / max(1, len(series))
    for i, (label, values, colour, hatch) in enumerate(series):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))]
        heights = [v if v is not None else 0 for v in values]
        drawn = ax.bar(xs, heights, width, label=label, color=colour, hatch=hatch, edgecolor="white")
        for rect, v in zip(drawn, values):
            if v is None:
                ax.annotate("-", (rect.get_x() + rect.get_width() / 2, 0), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(categories, rotation=0)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, never over them


def series_by(lines, value, frameworks):
    models = ordered({m for _, m, _, _ in lines}, [])
    precisions = ordered({p for _, _, p, _ in lines}, PRECISIONS)
    series = []
    for framework in frameworks:
        for precision in precisions:
            values = []
            for model in models:
                found = [l for (f, m, p, _), l in lines.items() if (f, m, p) == (framework, model, precision)]
                values.append(value(found[-1]) if found else None)
            if any(v is not None for v in values):
                label = precision + ("" if framework == "halfgrad" else f" ({framework})")
                hatch = "" if framework == "halfgrad" else ".." if framework.startswith("halfgrad") else "//"
                series.append((label, values, COLOURS.get(precision, "grey"), hatch))
    return models, series


def plot_resnet(lines, out_dir, title, frameworks):
    fig, (time_ax, ratio_ax) = plt.subplots(1, 2, figsize=(12, 4))
    models, series = series_by(lines, median_ms, frameworks)
    bars(time_ax, models, series, "ms per training step")
    time_ax.get_legend().remove()  # the same series as the ratios' legend
    fp32 = {(f, m): median_ms(l) for (f, m, p, _), l in lines.items() if p == "fp32"}
    ratios = []
    for label, values, colour, hatch in series:
        framework = "halfgrad" if hatch == "" else label.split("(")[1].rstrip(")")
        ratios.append((label, [fp32.get((framework, m)) / v if v and fp32.get((framework, m)) else None
                               for m, v in zip(models, values)], colour, hatch))
    bars(ratio_ax, models, ratios, "speed-up over fp32 (x)")
    ratio_ax.axhline(1, color="black", linewidth=0.8)
    fig.suptitle(f"ResNets on CIFAR-shaped data{' - ' + title if title else ''}")
    save(fig, out_dir, "resnet")


def plot_lm(lines, out_dir, title, frameworks):
    fig, ax = plt.subplots(figsize=(8, 4))
    models, series = series_by(lines, lambda l: None if l.get("out_of_memory") else l.get("tokens_per_second"),
                               frameworks)
    bars(ax, models, series, "tokens per second")
    fig.suptitle(f"Word language models, one training step{' - ' + title if title else ''}")
    save(fig, out_dir, "lm")


def plot_max_batch(lines, out_dir, title, frameworks):
    fig, ax = plt.subplots(figsize=(10, 4))
    models, series = series_by(lines, lambda l: l.get("max_batch") or None, frameworks)
    bars(ax, models, series, "largest batch that fits")
    budgets = {l.get("memory_budget_bytes") for l in lines.values()}
    budget = f", {max(budgets) / 2**30:.0f} GiB" if len(budgets) == 1 and None not in budgets else ""
    fig.suptitle(f"Largest batch per precision{budget}{' - ' + title if title else ''}")
    save(fig, out_dir, "max-batch")


def plot_runs(rows, panels, out_dir, name, heading):
    """Training runs as bars, one panel per (field, scale, label): per configuration (model and batch) and precision
    the mean over the runs given (seeds), their spread as error bars."""
    runs = OrderedDict()  # (model, precision, batch) -> the rows of that configuration, one per run
    for r in rows:
        runs.setdefault((r.get("model", ""), r["precision"].lower(), r["batch_size"]), []).append(r)
    precisions = ordered({p for _, p, _ in runs}, PRECISIONS)
    configurations = sorted({(m, b) for m, _, b in runs}, key=lambda c: (natural(c[0]), c[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    width = 0.8 / max(1, len(precisions))
    for ax, (field, scale, label) in zip(axes, panels):
        for i, precision in enumerate(precisions):
            xs, means, low, high = [], [], [], []
            for c, (model, batch) in enumerate(configurations):
                x = c + (i - (len(precisions) - 1) / 2) * width
                found = runs.get((model, precision, batch), [])
                ran = [r[field] / scale for r in found if not r["out_of_memory"] and field in r]
                if not ran:
                    if any(r["out_of_memory"] for r in found):  # every run of it was out of memory
                        ax.annotate("OOM", (x, 0), ha="center", va="bottom", fontsize=8, rotation=90,
                                    color=COLOURS.get(precision, "grey"))
                    continue
                mean = sum(ran) / len(ran)
                xs.append(x)
                means.append(mean)
                low.append(mean - min(ran))
                high.append(max(ran) - mean)
            if xs:
                ax.bar(xs, means, width, yerr=[low, high], capsize=3, label=precision,
                       color=COLOURS.get(precision, "grey"), edgecolor="white")
        ax.set_xticks(range(len(configurations)))
        ax.set_xlim(-0.5, len(configurations) - 0.5)  # a configuration without bars (out of memory) stays in view
        ax.set_xticklabels([f"{m} batch {b}".strip() for m, b in configurations], rotation=20, ha="right")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    most = max(len(v) for v in runs.values())
    fig.suptitle(f"{heading}, {most} run(s) a configuration")
    save(fig, out_dir, name)


def plot_sweep(rows, out_dir, title):
    panels = (("images_per_second", 1, "training throughput (images/s)"),
              ("peak_memory_bytes", 2**20, "peak GPU memory (MiB)"),
              ("final_test_accuracy", 1, "final test accuracy"))
    plot_runs(rows, panels, out_dir, "sweep", f"Mixed-precision sweep{' - ' + title if title else ''}")


def plot_trained(suite, rows, out_dir, title):
    if suite == "lm":
        panels = (("tokens_per_second", 1, "training throughput (tokens/s)"),
                  ("peak_memory_bytes", 2**20, "peak GPU memory (MiB)"),
                  ("test_perplexity", 1, "test perplexity"))
    else:
        panels = (("images_per_second", 1, "training throughput (images/s)"),
                  ("peak_memory_bytes", 2**20, "peak GPU memory (MiB)"),
                  ("final_test_accuracy", 1, "final test accuracy"))
    plot_runs(rows, panels, out_dir, f"{suite}-accuracy",
              f"{suite}, trained on real data{' - ' + title if title else ''}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+",
                        help="JSON lines of halfgrad bench (and tools/bench_torch.py) or of sweep-classifier --jsonl")
    parser.add_argument("--out-dir", default=".", help="where the figures go")
    parser.add_argument("--title", default="", help="added to every figure's title (say, the GPU)")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    suites, sweep, trained = read_lines(args.files)
    if not suites and not sweep and not trained:
        sys.exit("plot: no bench lines or sweep rows in " + ", ".join(args.files))
    if sweep:
        plot_sweep(sweep, args.out_dir, args.title)
    for suite, rows in trained.items():
        plot_trained(suite, list(rows.values()), args.out_dir, args.title)
    for suite, lines in suites.items():
        frameworks = ordered({f for f, _, _, _ in lines}, ["halfgrad", "pytorch"])
        if suite == "vgg":
            plot_vgg(lines, args.out_dir, args.title)
        elif suite == "resnet":
            plot_resnet(lines, args.out_dir, args.title, frameworks)
        elif suite == "lm":
            plot_lm(lines, args.out_dir, args.title, frameworks)
        elif suite == "max-batch":
            plot_max_batch(lines, args.out_dir, args.title, frameworks)
        else:
            print(f"plot: no figure for suite \"{suite}\"", file=sys.stderr)


if __name__ == "__main__":
    main()
