#!/usr/bin/env python3
"""plot_sweep: the figure of a mixed-precision sweep, from the CSV that `halfgrad sweep-classifier --csv` writes.

    python3 tools/plot_sweep.py sweep.csv [more.csv ...] -o sweep.svg [--title "ResNet-18, CIFAR-10, H200"]

Three panels side by side, one group of bars per batch size and one bar per precision (FP32, AMP, O2, FP16):
training throughput (images/s), peak GPU memory (MiB) and final test accuracy. A run that did not fit in memory is
drawn as an empty bar marked "OOM". Several CSV files (runs of the same sweep) are averaged row by row.
The output is a self-contained SVG written with the standard library alone (no matplotlib), so the script runs
wherever Python 3 does; an SVG opens in any browser and converts to PDF or PNG with common tools.
"""
import argparse
import csv
import math
import sys
from collections import OrderedDict
from xml.sax.saxutils import escape

COLOURS = {"FP32": "#4c72b0", "AMP": "#55a868", "O2": "#c44e52", "FP16": "#8172b2"}
PANELS = [("images_per_second", "training throughput (images/s)"),
          ("peak_memory_mib", "peak GPU memory (MiB)"),
          ("final_test_accuracy", "final test accuracy")]


def read_rows(paths):
    """{(precision, batch): {field: mean value, 'oom': bool}} in first-seen order, averaged over the files."""
    sums = OrderedDict()
    for path in paths:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            needed = {"precision", "batch_size", "out_of_memory", "images_per_second", "peak_memory_bytes",
                      "final_test_accuracy"}
            missing = needed - set(reader.fieldnames or [])
            if missing:
                sys.exit(f"plot_sweep: {path} lacks the columns {sorted(missing)} (is it a sweep-classifier CSV?)")
            for line, row in enumerate(reader, start=2):
                try:
                    key = (row["precision"], int(row["batch_size"]))
                    entry = sums.setdefault(key, {"n": 0, "oom": False, "images_per_second": 0.0,
                                                  "peak_memory_mib": 0.0, "final_test_accuracy": 0.0})
                    if row["out_of_memory"] == "1":
                        entry["oom"] = True
                        continue
                    entry["n"] += 1
                    entry["images_per_second"] += float(row["images_per_second"])
                    entry["peak_memory_mib"] += float(row["peak_memory_bytes"]) / 2**20
                    entry["final_test_accuracy"] += float(row["final_test_accuracy"])
                except (KeyError, ValueError) as e:
                    sys.exit(f"plot_sweep: {path} line {line}: {e}")
    for entry in sums.values():
        for field, _ in PANELS:
            entry[field] = entry[field] / entry["n"] if entry["n"] else 0.0
    return sums


def nice_max(value):
    """A round axis maximum at or above value: 1, 2, 2.5 or 5 times a power of ten."""
    if value <= 0:
        return 1.0
    scale = 10.0 ** math.floor(math.log10(value))
    return next(step * scale for step in (1, 2, 2.5, 5, 10) if step * scale >= value)


def panel_svg(rows, field, label, x0, width, height):
    precisions = list(OrderedDict.fromkeys(p for p, _ in rows))
    batches = sorted({b for _, b in rows})
    top = nice_max(max((e[field] for e in rows.values()), default=0))
    left, bottom, plot_h = x0 + 60, 40 + height, height
    group_w = (width - 70) / max(len(batches), 1)
    bar_w = group_w * 0.8 / max(len(precisions), 1)
    out = [f'<text x="{x0 + width / 2}" y="20" text-anchor="middle" font-size="14">{escape(label)}</text>',
           f'<line x1="{left}" y1="{bottom}" x2="{x0 + width - 10}" y2="{bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="40" x2="{left}" y2="{bottom}" stroke="black"/>']
    for k in range(5):
        v = top * k / 4
        y = bottom - plot_h * k / 4
        out.append(f'<text x="{left - 5}" y="{y + 4}" text-anchor="end" font-size="10">{v:g}</text>')
        out.append(f'<line x1="{left}" y1="{y}" x2="{x0 + width - 10}" y2="{y}" stroke="#ddd"/>')
    for g, batch in enumerate(batches):
        gx = left + g * group_w + group_w * 0.1
        out.append(f'<text x="{gx + group_w * 0.4}" y="{bottom + 15}" text-anchor="middle" font-size="11">'
                   f'batch {batch}</text>')
        for i, precision in enumerate(precisions):
            entry = rows.get((precision, batch))
            if entry is None:
                continue
            x = gx + i * bar_w
            if entry["oom"] and entry["n"] == 0:
                out.append(f'<rect x="{x:.1f}" y="{bottom - 12}" width="{bar_w * 0.9:.1f}" height="12" fill="none" '
                           f'stroke="{COLOURS.get(precision, "#888")}" stroke-dasharray="3,2"/>')
                out.append(f'<text x="{x + bar_w * 0.45:.1f}" y="{bottom - 15}" text-anchor="middle" '
                           f'font-size="9">OOM</text>')
                continue
            h = plot_h * entry[field] / top
            out.append(f'<rect x="{x:.1f}" y="{bottom - h:.1f}" width="{bar_w * 0.9:.1f}" height="{h:.1f}" '
                       f'fill="{COLOURS.get(precision, "#888")}"><title>{escape(precision)}, batch {batch}: '
                       f'{entry[field]:.4g}</title></rect>')
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+", help="CSV files written by halfgrad sweep-classifier --csv")
    parser.add_argument("-o", "--output", required=True, help="the SVG file to write")
    parser.add_argument("--title", default="", help="a line above the panels")
    args = parser.parse_args()
    rows = read_rows(args.csv)
    if not rows:
        sys.exit("plot_sweep: the CSV files hold no rows")
    panel_w, panel_h = 330, 220
    width, height = panel_w * len(PANELS) + 20, panel_h + 120
    body = []
    for k, (field, label) in enumerate(PANELS):
        body += panel_svg(rows, field, label, 10 + k * panel_w, panel_w, panel_h)
    precisions = list(OrderedDict.fromkeys(p for p, _ in rows))
    for i, precision in enumerate(precisions):
        x = 80 + i * 90
        body.append(f'<rect x="{x}" y="{height - 30}" width="12" height="12" fill="{COLOURS.get(precision, "#888")}"/>')
        body.append(f'<text x="{x + 16}" y="{height - 20}" font-size="12">{escape(precision)}</text>')
    if args.title:
        body.append(f'<text x="{width - 10}" y="{height - 20}" text-anchor="end" font-size="12">'
                    f'{escape(args.title)}</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">\n'
           f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")
    with open(args.output, "w") as f:
        f.write(svg)
    print(f"plot_sweep: {len(rows)} runs from {len(args.csv)} file(s) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
