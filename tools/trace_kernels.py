#!/usr/bin/env python3
"""Summarises a trace_kernels CSV (tools/trace_kernels.cpp): for each CUDA graph replayed at least --min-replays
times, a replay's span and kernel time (medians over the replays after the first quarter), then either its nodes in
launch order with their median µs (default) or the kernels grouped by name (--by-name). --match REGEX keeps the rows
whose demangled name matches. Names are demangled with c++filt where it is installed.

  python3 tools/trace_kernels.py run.csv [--by-name] [--match REGEX] [--top N]
"""
import argparse
import collections
import re
import shutil
import signal
import statistics
import subprocess
import sys


def read(path):
    records = []
    with open(path, errors="replace", newline="\n") as f:  # a \r in a name stays in it
        # A record is split at its first five commas and no further: a kernel name is written as it is, commas and
        # quotes and all (torch.compile's run has names with quotes), at any length (the csv module stops at 128 KiB).
        for line, text in enumerate(f, 1):
            where = f"trace_kernels.py: {path}:{line}:"
            if "\0" in text:
                sys.exit(f"{where} zero bytes: the file was written over while it was being written (by two "
                         "tracers at once?); trace again")
            row = text.rstrip("\n").split(",", 5)
            if len(row) < 6:
                sys.exit(f"{where} expected start,end,graph,node,kind,name; got {text[:120]!r}")
            try:
                start, end, graph, node = (int(v) for v in row[:4])
            except ValueError:
                sys.exit(f"{where} start, end, graph and node must be integers; got {','.join(row[:4])[:120]!r}")
            records.append((start, end, graph, node, row[5]))
    return records


def demangler(names):
    if not shutil.which("c++filt"):
        return lambda n: n
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    table = dict(zip(names, out))
    return lambda n: table.get(n, n).replace("(anonymous namespace)::", "").replace("halfgrad::", "")


def without_parameters(name):
    """A demangled name less its parameter list, the parenthesised group it ends with (template arguments such as
    (RnnKind)3 stay)."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i]
    return name


def replays(records):
    """The k-th launch of each node belongs to replay k; only replays with every node are kept."""
    nth = collections.Counter()
    by_replay = collections.defaultdict(list)
    for rec in sorted(records):
        by_replay[nth[rec[3]]].append(rec)
        nth[rec[3]] += 1
    nodes = len(nth)
    return nodes, [r for _, r in sorted(by_replay.items()) if len(r) == nodes]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--by-name", action="store_true", help="group the nodes by kernel name")
    parser.add_argument("--match", help="keep the rows whose demangled name matches this regular expression")
    parser.add_argument("--top", type=int, default=0, help="with --by-name: the N largest groups only")
    parser.add_argument("--min-replays", type=int, default=4)
    args = parser.parse_args()
    records = read(args.csv)
    name = demangler(sorted({r[4] for r in records}))
    match = re.compile(args.match) if args.match else None
    graphs = collections.defaultdict(list)
    for rec in records:
        if rec[2]:
            graphs[rec[2]].append(rec)
    if not graphs:
        print(f"{args.csv}: {len(records)} records, none in a CUDA graph")
    for graph, recs in sorted(graphs.items()):
        nodes, full = replays(recs)
        if len(full) < args.min_replays:
            continue
        full = full[len(full) // 4:]  # past the first replays
        spans = [max(r[1] for r in rp) - min(r[0] for r in rp) for rp in full]
        busy = [sum(r[1] - r[0] for r in rp) for rp in full]
        print(f"graph {graph}: {nodes} nodes, {len(full)} replays summarised; a replay spans "
              f"{statistics.median(spans) / 1e3:.1f} µs, its kernels run {statistics.median(busy) / 1e3:.1f} µs")
        durations, offsets = collections.defaultdict(list), collections.defaultdict(list)
        for rp in full:
            t0 = min(r[0] for r in rp)
            for start, end, _, node, n in rp:
                durations[(node, n)].append(end - start)
                offsets[(node, n)].append(start - t0)
        if args.by_name:
            groups = collections.defaultdict(lambda: [0.0, 0])
            for (node, n), d in durations.items():
                g = groups[without_parameters(name(n))]
                g[0] += statistics.median(d)
                g[1] += 1
            rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
            rows = [(n, t, c) for n, (t, c) in rows if not match or match.search(n)]
            for n, t, c in rows[: args.top or None]:
                print(f"  {t / 1e3:9.1f} µs {c:5d} x  {n[:140]}")
        else:
            print("  start µs   µs  kernel")
            for key in sorted(durations, key=lambda k: statistics.median(offsets[k])):
                n = name(key[1])
                if match and not match.search(n):
                    continue
                print(f"  {statistics.median(offsets[key]) / 1e3:8.1f} {statistics.median(durations[key]) / 1e3:7.1f}  "
                      f"{n[:140]}")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly, not with a traceback
    main()
