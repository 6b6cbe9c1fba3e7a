#!/usr/bin/env bash
# ctest: --csv and --jsonl lose nothing. A run that fails before its first line (a missing corpus) leaves an existing
# log as it was, and no new one; a log that names the --resume checkpoint is refused before anything is read or written,
# the checkpoint whole; a log path that cannot be written is refused at start, naming the option. And file options and
# the bench budget are what they say: `--save=` does not take the next argument as its file, --memory-budget outside
# max-batch is refused, a folder where a corpus file should be is named as one. No file the command writes may be one it
# reads (a data file, generate's checkpoint); bench --with-pytorch refuses a device PyTorch's side would not use. Output
# to a standard output that cannot take it is an error; launch refuses a grace period past a day.
#   cli_logs.sh HALFGRAD WORK_DIR
set -u
halfgrad=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir" && cd "$dir" || exit 1
fail() { echo "FAIL: $*"; exit 1; }

printf 'epoch,lr\n1,20\n' > keep.csv
printf '{"event":"epoch"}\n' > keep.jsonl
"$halfgrad" train-lm --data-dir no_such_corpus --csv keep.csv --jsonl keep.jsonl > missing.log 2>&1 && fail "ran"
grep -q 'load_corpus: no_such_corpus/train.txt not found' missing.log || { cat missing.log; fail "no corpus error"; }
[[ $(cat keep.csv) == $'epoch,lr\n1,20' && $(cat keep.jsonl) == '{"event":"epoch"}' ]] || fail "the logs were changed"
"$halfgrad" train-lm --data-dir no_such_corpus --csv new.csv --jsonl new.jsonl > new.log 2>&1 && fail "ran"
[[ ! -e new.csv && ! -e new.jsonl ]] || fail "a failed run left empty logs behind"
ln -sf no_such_target dangling.csv  # a link to nothing yet: the link is the user's, and stays
"$halfgrad" train-lm --data-dir no_such_corpus --csv dangling.csv > dangling.log 2>&1 && fail "ran"
[[ -L dangling.csv && ! -e no_such_target ]] || fail "a failed run removed a --csv symlink, or left its target"

printf 'a checkpoint' > run.safetensors
"$halfgrad" train-lm --emsize 8 --nhid 8 --resume run.safetensors --csv ./run.safetensors > same.log 2>&1 && fail "ran"
grep -q 'train-lm: --csv and --resume name the same file, ./run.safetensors' same.log ||
  { cat same.log; fail "no refusal"; }
[[ $(cat run.safetensors) == 'a checkpoint' ]] || fail "the checkpoint was changed"
"$halfgrad" train-lm --emsize 8 --nhid 8 --csv same.log --jsonl same.log > twice.log 2>&1 && fail "ran"
grep -q 'train-lm: --csv and --jsonl name the same file' twice.log || { cat twice.log; fail "no refusal of one file"; }

mkdir -p folder
"$halfgrad" train-classifier --data-dir . --csv folder > folder.log 2>&1 && fail "ran"
grep -q 'train-classifier: --csv folder is a folder' folder.log || { cat folder.log; fail "no folder error"; }
"$halfgrad" train-lm --jsonl no_such_folder/run.jsonl > nofolder.log 2>&1 && fail "ran"
grep -q 'train-lm: cannot write --jsonl no_such_folder/run.jsonl' nofolder.log || { cat nofolder.log; fail "no error"; }
"$halfgrad" train-lm --save= --dry-run --data-dir no_such_corpus > empty.log 2>&1 && fail "ran"
grep -q -- "--save: '--dry-run' is an option, not a file name" empty.log ||
  { cat empty.log; fail "--save= took --dry-run"; }
[[ ! -e ./--dry-run ]] || fail "a file named --dry-run was written"
"$halfgrad" bench lm --device cpu --memory-budget 8GiB --models no_such_model > budget.log 2>&1 && fail "ran"
grep -q 'bench: --memory-budget is the max-batch suite' budget.log || { cat budget.log; fail "the budget was ignored"; }
"$halfgrad" bench all --device cpu --memory-budget 8GiB --models no_such_model > all.log 2>&1 && fail "ran"
grep -q 'memory-budget' all.log && { cat all.log; fail "the budget was refused for all, which holds max-batch"; }
"$halfgrad" train-lm --csv /dev/null --jsonl /dev/null --data-dir no_such_corpus > streams.log 2>&1 && fail "ran"
grep -q 'load_corpus' streams.log || { cat streams.log; fail "two logs on /dev/null were refused"; }
mkdir -p corpus/test.txt && printf 'a b\n' > corpus/train.txt && printf 'a b\n' > corpus/valid.txt
"$halfgrad" train-lm --data-dir corpus > corpus.log 2>&1 && fail "ran"
grep -q 'load_corpus: corpus/test.txt is not a regular file' corpus.log || { cat corpus.log; fail "no folder error"; }
# A written file that is one the command reads: refused before anything is read or written.
mkdir -p cifar && printf 'not images' > cifar/test_batch.bin
"$halfgrad" train-classifier --data-dir cifar --csv cifar/test_batch.bin > data.log 2>&1 && fail "ran"
grep -q "train-classifier: --csv and --data-dir's test_batch.bin name the same file, cifar/test_batch.bin" data.log ||
  { cat data.log; fail "a log over a data file was not refused"; }
[[ $(cat cifar/test_batch.bin) == 'not images' ]] || fail "the data file was changed"
"$halfgrad" train-lm --data-dir corpus --save corpus/train.txt > save.log 2>&1 && fail "ran"
grep -q "train-lm: --save and --data-dir's train.txt name the same file, corpus/train.txt" save.log ||
  { cat save.log; fail "--save over a corpus file was not refused"; }
printf 'a model' > model.safetensors
"$halfgrad" generate --checkpoint model.safetensors --outf ./model.safetensors > outf.log 2>&1 && fail "ran"
grep -q 'generate: --outf and --checkpoint name the same file' outf.log || { cat outf.log; fail "--outf not refused"; }
[[ $(cat model.safetensors) == 'a model' ]] || fail "the model was changed"
# --outf that cannot be written: refused before the checkpoint is read and the words are made, not after.
"$halfgrad" generate --checkpoint model.safetensors --outf no_such_dir/words.txt > outf_dir.log 2>&1 && fail "ran"
grep -q "generate: --outf: cannot write 'no_such_dir/words.txt': the folder 'no_such_dir' does not exist" outf_dir.log ||
  { cat outf_dir.log; fail "an --outf in a missing folder was not refused first"; }
"$halfgrad" bench lm --device cpu --with-pytorch --models no_such_model > torch.log 2>&1 && fail "ran"
grep -q 'bench --with-pytorch: tools/bench_torch.py times PyTorch on cuda:0 only' torch.log ||
  { cat torch.log; fail "--with-pytorch on the CPU was not refused"; }
# bench options the run would not use are refused, not ignored.
"$halfgrad" bench resnet --device cpu --seed 3 --models no_such_model > seed.log 2>&1 && fail "ran"
grep -q 'bench: --seed is for trained runs (--epochs N)' seed.log || { cat seed.log; fail "--seed without --epochs"; }
"$halfgrad" bench resnet --device cpu --torch-compile --models no_such_model > compile.log 2>&1 && fail "ran"
grep -q 'bench: --torch-compile is a setting of PyTorch' compile.log ||
  { cat compile.log; fail "--torch-compile alone"; }
"$halfgrad" bench lm --device cpu --max-batch 64 --models no_such_model > maxb.log 2>&1 && fail "ran"
grep -q 'bench: --max-batch is the max-batch suite' maxb.log || { cat maxb.log; fail "--max-batch outside max-batch"; }
refused() {  # refused EXPECTED ARGS...: bench with ARGS fails before running anything, saying EXPECTED
  local expected=$1; shift
  "$halfgrad" bench "$@" --device cpu --models no_such_model > refused.log 2>&1 && fail "bench $* ran"
  grep -qF -- "$expected" refused.log || { cat refused.log; fail "bench $*: expected \"$expected\""; }
}
refused 'bench: --vocab is the language models' resnet --vocab 100
refused 'bench: --bptt is the language models' vgg --bptt 10
refused 'bench: --nchw is for image batches; the lm suite has none' lm --nchw
refused 'bench: --workers is for image batches' lm --epochs 1 --workers 2
refused 'bench: --cuda-graph is not used by the max-batch suite' max-batch --cuda-graph
refused 'bench: --epochs is not used by the max-batch suite' max-batch --epochs 2
refused 'bench: --steps is for timed steps on synthetic data' resnet --epochs 1 --steps 5
refused 'bench: --vocab is for timed steps on synthetic data' lm --epochs 1 --vocab 50
# launch's grace period is a count of milliseconds inside: a value past a day is refused, not overflowed into none.
"$halfgrad" launch --grace-seconds 1e300 -- info > grace.log 2>&1 && fail "ran"
grep -q '1e300 is not in \[0, 86400\]' grace.log || { cat grace.log; fail "--grace-seconds 1e300 was not refused"; }
# Standard output that cannot be written (a full disk, here /dev/full) fails the command: what it printed is lost.
if [[ -w /dev/full ]]; then
  "$halfgrad" info > /dev/full 2> full.log && fail "info reported success with its output lost"
  grep -q 'writing to standard output failed' full.log || { cat full.log; fail "no error"; }
fi
echo "PASS: the logs lost nothing"
