#!/usr/bin/env bash
# The PyTorch reference for `halfgrad train-lm`: pytorch/examples' word_language_model/main.py, run with its default
# flags (LSTM, emsize 200, nhid 200, 2 layers, lr 20, clip 0.25, batch 20, bptt 35, dropout 0.2, seed 1111) on the
# GPU for EPOCHS (6) epochs on the WikiText-2 that halfgrad ships (data/wikitext-2/wikitext-2.tar.xz, unpacked into a
# temporary folder: train.txt, valid.txt, test.txt, the files main.py's data.Corpus reads). Needs PyTorch (>= 2.6
# for the current main.py) and no network: main.py downloads nothing.
#
#   bash tools/ref_word_lm.sh                      # the default run, 6 epochs
#   EPOCHS=1 bash tools/ref_word_lm.sh --dry-run   # further arguments go to main.py (e.g. --model GRU --nhid 650)
#   ALLOW_CPU=1 ...                                # run even where PyTorch sees no GPU (main.py then uses the CPU)
#
# main.py is not part of halfgrad and is never committed: copy pytorch/examples' word_language_model/ (main.py,
# model.py, data.py, generate.py) into .ref/word_language_model/ (.ref/ is in .git/info/exclude). Being ignored, the
# folder does not travel to a device machine by itself: name .ref in the device tool's carry.
#
# The GPU flag: older main.py versions take --cuda, the current one (after pytorch/examples#1345) --accel
# (torch.accelerator); the script passes whichever this main.py knows. Logs go to $OUT when it is set (the device
# tool's output folder), else to build-gpu/logs: ref_word_lm.log. The model main.py saves (--save) goes to the
# temporary folder, not to the logs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
ref=$root/.ref/word_language_model
if [[ ! -f $ref/main.py || ! -f $ref/model.py || ! -f $ref/data.py ]]; then
  echo "ref_word_lm: $ref/{main,model,data}.py not found. Copy pytorch/examples' word_language_model/ there" \
       "(git clone https://github.com/pytorch/examples; cp examples/word_language_model/*.py .ref/word_language_model/)" \
       "and, on a device machine, carry .ref along." >&2
  exit 2
fi
archive=$root/data/wikitext-2/wikitext-2.tar.xz
[[ -f $archive ]] || { echo "ref_word_lm: $archive not found" >&2; exit 2; }
if ! python3 -c 'import torch' >/dev/null 2>&1; then
  echo "ref_word_lm: PyTorch is not importable by $(command -v python3)" >&2
  exit 2
fi
# --accel falls back to the CPU without a word when no accelerator is visible: a reference run wants the GPU.
if [[ -z ${ALLOW_CPU:-} ]] && ! python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; then
  echo "ref_word_lm: PyTorch sees no CUDA GPU (ALLOW_CPU=1 runs on the CPU anyway)" >&2
  exit 2
fi
logs=${OUT:-$root/build-gpu/logs}
mkdir -p "$logs"
log=$logs/ref_word_lm.log
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -xJf "$archive" -C "$tmp"
data=$tmp/wikitext-2
for f in train.txt valid.txt test.txt; do
  [[ -f $data/$f ]] || { echo "ref_word_lm: $archive holds no wikitext-2/$f" >&2; exit 2; }
done

if grep -q "'--cuda'" "$ref/main.py"; then
  gpu_flag=--cuda
elif grep -q "'--accel'" "$ref/main.py"; then
  gpu_flag=--accel
else
  echo "ref_word_lm: $ref/main.py knows neither --cuda nor --accel; which flag puts it on the GPU?" >&2
  exit 2
fi

args=("$ref/main.py" "$gpu_flag" --epochs "${EPOCHS:-6}" --data "$data" --save "$tmp/model.pt" "$@")
{
  date -u '+%Y-%m-%d %H:%M:%S UTC'
  git -C "$root" rev-parse --short HEAD 2>/dev/null | sed 's/^/halfgrad commit /'
  python3 -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN",
      torch.backends.cudnn.version(), "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
  (cd "$ref" && sha256sum main.py model.py data.py)
  echo "python3 ${args[*]}"
} 2>&1 | tee "$log"
start=$SECONDS
PYTHONUNBUFFERED=1 python3 "${args[@]}" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "ref_word_lm: main.py exited with $rc after $((SECONDS - start)) s (log: $log)" | tee -a "$log"
exit "$rc"
