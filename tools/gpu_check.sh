#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build halfgrad (Release, Ninja, CUDA for one architecture), run the whole
# ctest suite (the CUDA tests included: on this machine they run instead of skipping), then the GPU
# benchmark (build-gpu/bench_cuda, and tools/bench_torch_cuda.py when PyTorch is installed). Ends with a
# summary; exits non-zero if the build or a test failed.
#
#   bash tools/gpu_check.sh                       # sm_90 (H100/H200), into build-gpu/
#   CUDA_ARCH=80 bash tools/gpu_check.sh          # another GPU generation
#   SKIP_BENCH=1 bash tools/gpu_check.sh          # build and test only
#   SANITIZE=1 bash tools/gpu_check.sh            # also the GPU test cases under compute-sanitizer memcheck
#   SANITIZE=racecheck|both ...                   # racecheck instead, or both (tools/gpu_sanitize.sh)
#   SANITIZE_CASES='*batch_norm*' ...             # only the test cases matching (doctest filter)
#   CTEST_REGEX='cuda|CUDA' CUDA_RERUN=0 ...      # only the GPU tests, once
#   BENCHES='bench_batch_norm' ...                # only these benchmarks (default: all six)
#   LM_ARGS='--tf32' LM_HALFGRAD_ARGS='--rnn-loop steps' ...  # more flags for the language-model rows: both
#                                                 # sides, or bench_lm_step alone
#   NCU=1 ...                                     # also Nsight Compute figures for the float16 channels-last
#                                                 # batch_norm kernels (appended to bench_layers.log)
#   TORCH_BENCH=0 bash tools/gpu_check.sh         # skip the PyTorch comparison rows
#   TRAIN=1 CIFAR_DIR=dir bash tools/gpu_check.sh # also train on the GPU: a short FP32/AMP/O2/FP16 sweep on the
#                                                 # CIFAR-10 binary files in dir (if given), a longer O1 run on
#                                                 # them (TRAIN_LONG_EPOCHS, 15), and one short epoch of
#                                                 # the WikiText-2 language model at O0 and O1
#
# Logs go to $OUT when it is set (the device tool's output folder), else to build-gpu/logs. A machine
# without Eigen, fmt, spdlog, doctest and CLI11 that cannot install them uses the copies that
# tools/pack_gpu_deps.sh puts in .deps/ (carry that folder along).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
build=${BUILD_DIR:-build-gpu}
arch=${CUDA_ARCH:-90}
logs=${OUT:-$root/$build/logs}
mkdir -p "$logs"
export PATH="/usr/local/cuda/bin:$PATH"
jobs=$(nproc)
t0=$SECONDS
summary=()
failed=0

step() { printf '\n=== %s (%ds)\n' "$*" $((SECONDS - t0)); }

step "machine"
{
  date -u '+%Y-%m-%d %H:%M:%S UTC'
  git -C "$root" rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  nvcc --version | tail -n 2
  cmake --version | head -n 1
  g++ --version | head -n 1
  echo "$jobs cores"
} 2>&1 | tee "$logs/configure.log"

# PyTorch brings its own cuDNN: the comparison scripts run with the library path this script was started with,
# not the one it sets up for halfgrad (a system cuDNN older than PyTorch's stops PyTorch's cuDNN calls).
inherited_library_path=${LD_LIBRARY_PATH:-}
torch_python() { LD_LIBRARY_PATH=$inherited_library_path python3 "$@"; }

cmake_args=(-S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch"
            -DHALFGRAD_CUDA=ON)
if [[ -d .deps/usr ]]; then
  echo "using the dependencies carried in .deps/usr"
  cmake_args+=(-DCMAKE_PREFIX_PATH="$root/.deps/usr")
  export LD_LIBRARY_PATH="$root/.deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# cuDNN: CMake looks in the toolkit and the system folders; else take it from wherever it is (a Python
# wheel, /opt, ...), header and library.
if [[ -z ${CUDNN_ROOT:-} ]] && ! ls /usr/local/cuda/include/cudnn.h /usr/include/cudnn.h \
     /usr/include/x86_64-linux-gnu/cudnn.h >/dev/null 2>&1; then
  header=$(find /usr /opt -name cudnn.h -not -path '*/proc/*' 2>/dev/null | head -n 1)
  if [[ -n $header ]]; then
    include_dir=$(dirname "$header")
    library=$(find "$(dirname "$include_dir")" /usr/lib /usr/local/lib -name 'libcudnn.so*' 2>/dev/null | sort | head -n 1)
    echo "cuDNN: $include_dir, ${library:-library not found}" | tee -a "$logs/configure.log"
    cmake_args+=(-DCUDNN_INCLUDE_DIR="$include_dir")
    if [[ -n $library ]]; then
      cmake_args+=(-DCUDNN_LIBRARY="$library")
      export LD_LIBRARY_PATH="$(dirname "$library")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
  fi
fi

step "configure"
if ! cmake "${cmake_args[@]}" >>"$logs/configure.log" 2>&1; then
  tail -n 40 "$logs/configure.log"
  echo "gpu_check: configure FAILED (log: $logs/configure.log)"
  exit 1
fi
grep -E "halfgrad [0-9.]+:" "$logs/configure.log"

step "build (-j$jobs)"
# -k 0: when one target fails, build the others anyway (the library, the benchmark, the test objects).
tests_bin="$build/halfgrad_tests"
if cmake --build "$build" -j "$jobs" -- -k 0 >"$logs/build.log" 2>&1; then
  summary+=("build: ok ($(grep -c 'warning' "$logs/build.log") warning lines)")
  grep -E 'warning' "$logs/build.log" | sort -u | head -n 20
else
  grep -E -A12 'FAILED' "$logs/build.log" | head -n 100
  summary+=("build: FAILED (see build.log)")
  failed=1
  [[ -e $build/libhalfgrad.so ]] || { echo "gpu_check: the library did not build"; exit 1; }
  # Another test file failing to compile must not hide the CUDA tests: link those alone.
  if [[ ! -x $tests_bin && -f $build/CMakeFiles/halfgrad_tests.dir/tests/test_cuda.cpp.o ]]; then
    (cd "$build" && ninja -t commands halfgrad_tests | tail -n 1 | python3 -c '
import re, subprocess, sys
parts = sys.stdin.read().split(" && ")
link = next(p for p in parts if "-o halfgrad_tests" in p)
for obj in re.findall(r"CMakeFiles/halfgrad_tests.dir/tests/\S+[.]o", link):
    if not obj.endswith(("/main.cpp.o", "/test_cuda.cpp.o")):
        link = link.replace(" " + obj, "", 1)
sys.exit(subprocess.call(link.replace("-o halfgrad_tests", "-o halfgrad_cuda_tests"), shell=True))') \
      && tests_bin="$build/halfgrad_cuda_tests" && echo "gpu_check: linked the CUDA tests alone: $tests_bin"
  fi
fi

if [[ -x $build/halfgrad_tests ]]; then
  step "tests (ctest)"
  # Half the cores as test processes, two OpenMP threads each: 16 processes of 16 threads made the CPU
  # training tests take 5 minutes each. CTEST_REGEX picks tests by name (e.g. 'cuda|CUDA': the GPU ones).
  OMP_NUM_THREADS=${CTEST_THREADS:-2} ctest --test-dir "$build" --output-on-failure -j $(( (jobs + 1) / 2 )) \
    --timeout ${CTEST_TIMEOUT:-600} ${CTEST_REGEX:+-R "$CTEST_REGEX"} >"$logs/ctest.log" 2>&1
  ctest_rc=$?
  grep -E 'tests passed|tests failed|\*\*\*Failed|\*\*\*Exception|Timeout|Not Run' "$logs/ctest.log" | head -n 40
  summary+=("ctest: $(grep -E 'tests passed' "$logs/ctest.log" || echo 'no summary')")
  [[ $ctest_rc -eq 0 ]] || failed=1
else
  summary+=("ctest: NOT RUN (halfgrad_tests did not build)")
fi
# The CUDA cases once more in one process, for their messages (device, errors measured, allocator); CUDA_RERUN=0
# leaves this out.
if [[ ${CUDA_RERUN:-1} != 0 ]]; then
  step "CUDA tests ($tests_bin)"
  "$tests_bin" --test-case='cuda:*' >"$logs/cuda_tests.log" 2>&1
  cuda_rc=$?
  grep -E 'MESSAGE|GPU 0|error [0-9]|skipped|test cases|assertions' "$logs/cuda_tests.log" | head -n 40
  summary+=("cuda tests: $(grep -E '^\[doctest\] test cases' "$logs/cuda_tests.log" | tr -s ' ')")
  [[ $cuda_rc -eq 0 ]] || failed=1
fi

# SANITIZE=1 (or memcheck, racecheck, both): the GPU test cases again under compute-sanitizer, one process a case
# (tools/gpu_sanitize.sh says how each tool is run and why).
if [[ -n ${SANITIZE:-} ]] && command -v compute-sanitizer >/dev/null; then
  case $SANITIZE in racecheck) sanitizer_tools=(racecheck) ;; both) sanitizer_tools=(memcheck racecheck) ;; *) sanitizer_tools=(memcheck) ;; esac
  for tool in "${sanitizer_tools[@]}"; do
    step "GPU test cases under compute-sanitizer $tool"
    bash tools/gpu_sanitize.sh "$tool" "$tests_bin" "$logs/$tool" >"$logs/$tool.log" 2>&1
    sanitizer_rc=$?
    grep -E 'FAILED|TIMEOUT' "$logs/$tool.log" | head -n 20
    summary+=("$tool: $(tail -n 1 "$logs/$tool.log")")
    [[ $sanitizer_rc -eq 0 ]] || failed=1
  done
fi

benches=" ${BENCHES:-bench_cuda bench_conv bench_batch_norm bench_optim bench_train_step bench_lm_step} "
if [[ -z ${SKIP_BENCH:-} && $benches == *" bench_cuda "* ]]; then
  step "benchmark (bench_cuda)"
  "$build/bench_cuda" --csv "$logs/bench_cuda.csv" 2>&1 | tee "$logs/bench_cuda.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] && summary+=("bench_cuda: ok") || summary+=("bench_cuda: FAILED")
  if [[ ${TORCH_BENCH:-1} != 0 ]] && python3 -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
    step "benchmark (PyTorch, same rows)"
    torch_python tools/bench_torch_cuda.py 2>&1 | tee "$logs/bench_torch_cuda.log"
  fi
fi
if [[ -z ${SKIP_BENCH:-} ]]; then
  # The layer, optimizer and training-step benchmarks, each next to PyTorch's rows, in one log (the
  # device tool brings back at most eight files).
  for bench in bench_conv bench_batch_norm bench_optim bench_train_step; do
    [[ $benches == *" $bench "* && -x $build/$bench ]] || continue
    step "benchmark ($bench)"
    "$build/$bench" 2>&1 | tee -a "$logs/bench_layers.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] && summary+=("$bench: ok") || summary+=("$bench: FAILED")
    if [[ ${TORCH_BENCH:-1} != 0 && -f tools/${bench}_torch.py ]] && python3 -c 'import torch' >/dev/null 2>&1; then
      step "benchmark ($bench, PyTorch)"
      torch_python tools/${bench}_torch.py 2>&1 | tee -a "$logs/bench_layers.log"
    fi
  done
  # The word language model's training step (O0, O1; PyTorch float32 and autocast + GradScaler), per model: model,
  # nhid (= emsize), layers, batch. Appended to the same log (the eight-file limit).
  if [[ $benches == *" bench_lm_step "* && -x $build/bench_lm_step ]]; then
    lm_ok=1
    for config in "lstm 200 2 20" "lstm 650 2 20" "gru 650 2 20" "lstm 1500 2 64"; do
      read -r lm_model lm_nhid lm_layers lm_batch <<<"$config"
      lm_args=(--model "$lm_model" --nhid "$lm_nhid" --nlayers "$lm_layers" --batch "$lm_batch")
      # LM_ARGS: more flags for both sides (--tf32); LM_HALFGRAD_ARGS: for bench_lm_step alone (--rnn-loop steps)
      # shellcheck disable=SC2206
      lm_args+=(${LM_ARGS:-})
      step "benchmark (bench_lm_step ${lm_args[*]})"
      # shellcheck disable=SC2086
      "$build/bench_lm_step" "${lm_args[@]}" ${LM_HALFGRAD_ARGS:-} 2>&1 | tee -a "$logs/bench_layers.log"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || lm_ok=0
      if [[ ${TORCH_BENCH:-1} != 0 ]] && python3 -c 'import torch' >/dev/null 2>&1; then
        step "benchmark (bench_lm_step ${lm_args[*]}, PyTorch)"
        torch_python tools/bench_lm_step_torch.py "${lm_args[@]}" 2>&1 | tee -a "$logs/bench_layers.log"
      fi
    done
    [[ $lm_ok -eq 1 ]] && summary+=("bench_lm_step: ok") || summary+=("bench_lm_step: FAILED")
  fi
fi

if [[ -n ${NCU:-} ]] && command -v ncu >/dev/null; then
  step "Nsight Compute: batch_norm kernels, float16 channels_last"
  # Clocks left as they run (not locked to base): the figures then compare with the benchmark's.
  ncu --clock-control none -c 48 -k 'regex:reduce_rows|reduce_planes|finalize_|apply_' \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__occupancy_limit_registers \
    "$build/bench_batch_norm" --net resnet50 --dtype fp16 --layout nhwc --warmup 1 --iters 1 >>"$logs/bench_layers.log" 2>&1
  summary+=("ncu: rc $?")
fi

if [[ -n ${TRAIN:-} ]]; then
  cli="$build/halfgrad"
  if [[ -n ${CIFAR_DIR:-} ]]; then
    step "training sweep (ResNet-18, CIFAR-10 in $CIFAR_DIR)"
    "$cli" sweep-classifier --model resnet18 --data-dir "$CIFAR_DIR" --device cuda --epochs "${TRAIN_EPOCHS:-3}" \
      --opt-levels O0,O1,O2,O3 --batch-sizes "${TRAIN_BATCHES:-128,512}" --channels-last --workers 4 \
      --csv "$logs/sweep.csv" 2>&1 | tee "$logs/train.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] && summary+=("sweep: ok") || { summary+=("sweep: FAILED"); failed=1; }
  fi
  if [[ -n ${CIFAR_DIR:-} ]]; then
    step "training (ResNet-18, O1, ${TRAIN_LONG_EPOCHS:-15} epochs)"
    "$cli" train-classifier --model resnet18 --data-dir "$CIFAR_DIR" --device cuda --epochs "${TRAIN_LONG_EPOCHS:-15}" \
      --batch-size 128 --opt-level O1 --channels-last --workers 4 2>&1 | tee -a "$logs/train.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] && summary+=("train-classifier O1: ok") || { summary+=("train-classifier O1: FAILED"); failed=1; }
  fi
  for level in O0 O1; do
    step "language model ($level, one short epoch)"
    "$cli" train-lm --device cuda --opt-level $level --epochs 1 --limit-tokens "${TRAIN_TOKENS:-200000}" \
      --save "$logs/lm-$level.safetensors" 2>&1 \
      | tee -a "$logs/train.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] && summary+=("train-lm $level: ok") || { summary+=("train-lm $level: FAILED"); failed=1; }
  done
fi

step "summary"
printf '%s\n' "${summary[@]}"
echo "logs: $logs"
exit $failed
