#!/usr/bin/env python3
"""bench_lm_step_torch: tools/bench_lm_step.cpp's measurement in PyTorch (eager) on the same GPU, in the same rows.

    python3 tools/bench_lm_step_torch.py [--model lstm|gru|rnn_tanh|rnn_relu] [--nhid 200] [--nlayers 2]
                                         [--batch 20] [--bptt 35] [--vocab 33278] [--opt-levels O0,O1]
                                         [--warmup 5] [--steps 20] [--repeats 3] [--device cuda|cpu]

The model is pytorch/examples' word_language_model RNNModel (embedding, nn.LSTM / nn.GRU / nn.RNN with cuDNN,
dropout 0.2 after the embedding, between the layers and before the decoder, a linear decoder over the vocabulary;
the same initialisation), written out here so that nothing else is needed. One step, as main.py's train() with
random tokens and targets made once on the device: hidden = repackage_hidden(hidden) (detach); output, hidden =
model(data, hidden); loss = cross_entropy(output [T*B, vocab] in float32, targets) (main.py: NLLLoss of log_softmax,
the same value); backward; clip_grad_norm_(0.25); SGD lr 20 without momentum (torch.optim.SGD, its default foreach
implementation: the same p -= lr * grad as main.py's per-parameter loop); zero_grad. Levels: O0 float32; O1
torch.autocast(float16) with a GradScaler (unscale_ before clipping); O2 and O3 have no equivalent here. TF32 off
(halfgrad's float32 GEMMs may use TF32: then the O0 rows are not like for like). Timing: --warmup steps, then per
round --steps steps between two synchronisations, CUDA events around them; ms = the round's time / steps, tokens/s =
bptt * batch / ms, host ms = the host's time to issue a step. Peak memory: torch.cuda.max_memory_allocated over the
steps after the first. The project does not depend on PyTorch: this script is only for comparing.
"""
import argparse
import statistics
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:  # not an error: the comparison is optional
    print(f"bench_lm_step_torch: PyTorch is not importable by {sys.executable} ({e}); nothing to compare.")
    sys.exit(0)


class RNNModel(nn.Module):
    """pytorch/examples word_language_model/model.py's RNNModel, returning logits (no log_softmax)."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ("lstm", "gru"):
            self.rnn = (nn.LSTM if rnn_type == "lstm" else nn.GRU)(ninp, nhid, nlayers, dropout=dropout)
        else:
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=rnn_type[len("rnn_"):], dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(input)), hidden)
        return self.decoder(self.drop(output)).view(-1, self.ntoken), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "lstm":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def time_round(step, steps, gpu):
    """(ms, host_ms) per step over one round of `steps` steps between two synchronisations."""
    if gpu:
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(steps):
            step()
        stop.record()
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / steps, host / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    return ms, ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["lstm", "gru", "rnn_tanh", "rnn_relu"], default="lstm")
    parser.add_argument("--nhid", type=int, default=None, help="hidden size and emsize (default 200; 32 on the CPU)")
    parser.add_argument("--nlayers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--vocab", type=int, default=33278)
    parser.add_argument("--opt-levels", default=None, help="O0 (float32), O1 (autocast + GradScaler); default O0,O1 "
                        "(O0 on the CPU)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--tf32", action="store_true", help="float32 matmuls and cuDNN RNNs on TF32 tensor cores")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("bench_lm_step_torch: no CUDA GPU is visible to PyTorch; nothing to compare.")
        return
    nhid = args.nhid if args.nhid is not None else (200 if gpu else 32)
    levels = (args.opt_levels or ("O0,O1" if gpu else "O0")).split(",")
    lr, clip = 20.0, 0.25
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    device = torch.device(args.device)
    name = f"{args.model} {nhid}x{args.nlayers}"
    where = torch.cuda.get_device_name(0) if gpu else f"the CPU ({torch.get_num_threads()} threads)"
    print(f"bench_lm_step_torch: PyTorch {torch.__version__} word language model training step ({name}, emsize = "
          f"nhid, vocab {args.vocab}, dropout {args.dropout}, bptt {args.bptt}, SGD lr {lr:g}, clip {clip:g}, "
          f"TF32 {'on' if args.tf32 else 'off'}) on "
          f"{where}, data on the device, {args.repeats} round(s) of {args.steps} steps after {args.warmup} warm-up "
          f"steps")
    print(f"{'model':<14} {'batch':>6} {'bptt':>5} {'level':<6} {'round':>6} {'ms':>9} {'tokens/s':>10} "
          f"{'host ms':>9} {'peak MiB':>9}")
    tokens = args.bptt * args.batch
    for level in levels:
        if level not in ("O0", "O1"):
            print(f"{name:<14} {args.batch:>6} {args.bptt:>5} {level:<6} (no PyTorch equivalent here)")
            continue
        amp = level == "O1"
        torch.manual_seed(0)
        model = RNNModel(args.model, args.vocab, nhid, nhid, args.nlayers, args.dropout).to(device)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler(args.device, enabled=amp)
        data = torch.randint(0, args.vocab, (args.bptt, args.batch), device=device)
        targets = torch.randint(0, args.vocab, (args.bptt * args.batch,), device=device)
        state = {"hidden": model.init_hidden(args.batch)}

        def step():
            hidden = repackage_hidden(state["hidden"])
            with torch.autocast(args.device, dtype=torch.float16, enabled=amp):
                output, state["hidden"] = model(data, hidden)
                loss = F.cross_entropy(output.float(), targets)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        step()  # the first allocations and cuDNN's set-up stay out of the peak
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            step()
        ms, tps, host = [], [], []

        def row(rnd, m, t, h):
            peak = f"{torch.cuda.max_memory_allocated() / 2**20:.0f}" if gpu else "-"
            print(f"{name:<14} {args.batch:>6} {args.bptt:>5} {level:<6} {rnd:>6} {m:>9.2f} {t:>10.0f} {h:>9.2f} "
                  f"{peak:>9}", flush=True)

        for r in range(args.repeats):
            m, h = time_round(step, args.steps, gpu)
            ms.append(m)
            tps.append(tokens / (m * 1e-3))
            host.append(h)
            row(str(r + 1), m, tps[-1], h)
        row("median", statistics.median(ms), statistics.median(tps), statistics.median(host))


if __name__ == "__main__":
    main()
