# halfgrad: thin wrapper around CMake.
#   make run    build everything, then `halfgrad demo`: the language model in float32 and in mixed precision
#   make test   build everything, then run the test suite through ctest
#   make fuzz   build the libFuzzer targets (clang, ASan + UBSan, in build-fuzz/) and run each FUZZ_SECONDS (60)
#   make sanitize  build the CPU library, tests and CLI under ASan + UBSan (build-sanitize/) and run the tests
#               (SANITIZE_SUBSET=ci: all but the tests that train models for minutes; .ci/run runs this)
#   make tsan   build the CPU library and tests under ThreadSanitizer (build-tsan/) and run the threaded tests
# Variables: CMAKE_ARGS (extra configure arguments, e.g. CMAKE_ARGS="-DHALFGRAD_CUDA=OFF"),
#            JOBS (parallel jobs, default: nproc), BUILD_DIR (default: build), ARGS (passed to run/bench).

SHELL := /bin/bash
.DEFAULT_GOAL := build

BUILD_DIR  ?= build
BUILD_TYPE ?= Release
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_ARGS ?=
ARGS       ?=

# nvcc usually lives here and is often not on PATH; CMake needs it to enable the CUDA backend.
export PATH := /usr/local/cuda/bin:$(PATH)

GENERATOR := $(if $(shell command -v ninja 2>/dev/null),Ninja,Unix Makefiles)
ARGS_STAMP := $(BUILD_DIR)/.halfgrad_cmake_args

.PHONY: all deps configure build test run bench fuzz sanitize tsan clean

all: build

deps:
	@tools/install_deps.sh

# Configure only when needed: no build system yet, or new CMAKE_ARGS. Otherwise CMake itself
# re-configures during the build when CMakeLists.txt (or a globbed folder) changes.
configure: deps
	@set -e; \
	if [ ! -f "$(BUILD_DIR)/CMakeCache.txt" ]; then \
	  echo "cmake -S . -B $(BUILD_DIR) -G \"$(GENERATOR)\" -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS)"; \
	  cmake -S . -B "$(BUILD_DIR)" -G "$(GENERATOR)" -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS); \
	  printf '%s\n' "$(CMAKE_ARGS)" > "$(ARGS_STAMP)"; \
	elif [ ! -f "$(BUILD_DIR)/build.ninja" ] && [ ! -f "$(BUILD_DIR)/Makefile" ]; then \
	  echo "cmake -S . -B $(BUILD_DIR) $(CMAKE_ARGS)   # previous configure did not finish"; \
	  cmake -S . -B "$(BUILD_DIR)" $(CMAKE_ARGS); \
	  printf '%s\n' "$(CMAKE_ARGS)" > "$(ARGS_STAMP)"; \
	elif [ -n "$(strip $(CMAKE_ARGS))" ] && [ "$$(cat "$(ARGS_STAMP)" 2>/dev/null)" != "$(CMAKE_ARGS)" ]; then \
	  echo "cmake -S . -B $(BUILD_DIR) $(CMAKE_ARGS)   # new CMAKE_ARGS"; \
	  cmake -S . -B "$(BUILD_DIR)" $(CMAKE_ARGS); \
	  printf '%s\n' "$(CMAKE_ARGS)" > "$(ARGS_STAMP)"; \
	fi

build: configure
	cmake --build "$(BUILD_DIR)" -j$(JOBS)

# OMP_WAIT_POLICY=passive: the idle threads of one test's OpenMP team sleep instead of spinning on the cores that the
# other tests run on (ctest -j$(JOBS) on as many cores): the suite took 301 s instead of 351 on 2 cores (2026-12-03).
test: build
	OMP_WAIT_POLICY=passive ctest --test-dir "$(BUILD_DIR)" --output-on-failure -j$(JOBS)

run: build
	@if [ -x "$(BUILD_DIR)/halfgrad" ]; then \
	  echo "$(BUILD_DIR)/halfgrad demo $(ARGS)"; \
	  "$(BUILD_DIR)/halfgrad" demo $(ARGS); \
	else \
	  echo "make run: $(BUILD_DIR)/halfgrad was not built (HALFGRAD_BUILD_TOOLS=OFF?)" >&2; \
	  exit 1; \
	fi

bench: build
	@if [ -f tools/bench_cpu.cpp ] && [ -x "$(BUILD_DIR)/bench_cpu" ]; then \
	  echo "$(BUILD_DIR)/bench_cpu $(ARGS)"; \
	  "$(BUILD_DIR)/bench_cpu" $(ARGS); \
	else \
	  echo "make bench: $(BUILD_DIR)/bench_cpu was not built (tools/bench_cpu.cpp does not exist yet)" >&2; \
	  exit 1; \
	fi

FUZZ_DIR     ?= build-fuzz
FUZZ_SECONDS ?= 60
# The parsers of outside input under libFuzzer (tests/fuzz/README.md): the CPU library alone, every object under
# AddressSanitizer and UndefinedBehaviorSanitizer.
fuzz:
	CC=clang CXX=clang++ cmake -S . -B "$(FUZZ_DIR)" -G "$(GENERATOR)" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DHALFGRAD_FUZZ=ON -DHALFGRAD_CUDA=OFF -DHALFGRAD_BUILD_TESTS=OFF -DHALFGRAD_BUILD_EXAMPLES=OFF \
	  -DHALFGRAD_BUILD_TOOLS=OFF
	cmake --build "$(FUZZ_DIR)" -j $(JOBS) --target fuzz_checkpoint fuzz_cifar fuzz_text
	tools/run_fuzz.sh "$(FUZZ_DIR)" $(FUZZ_SECONDS)

SANITIZE_DIR     ?= build-sanitize
# Left out: the consumer project (it links the sanitized library without the sanitizers' runtime). A regex for ctest -E.
SANITIZE_EXCLUDE ?= ^install:
# CI's subset (.ci/run): also left out, the tests that train models or run whole commands (the launcher's 2-rank runs
# of train-classifier, train-lm and bench among them), 10 s to 2.5 minutes each under the sanitizers; the code they run
# is the code the other tests check (the process-group scenarios of tests/dist/ stay), which took 4.6 minutes on 2
# cores with those three launcher runs in (2026-12-03). The plot tests go with the bench line they draw.
_sanitize_ci_exclude := ^install:|^sweep_classifier |^train_classifier |^train_classifier_epoch|\
  ^ResNet-18 and VGG-11 learn|^cli: train-lm takes|^cli: train-lm --jsonl|^bench --epochs: a classifier|\
  ^cli: Ctrl-C|^image_classifier builds|^ResNet parameter counts|^cli: demo|^bench lines|^cli: bench writes|\
  ^cli: bench --with-pytorch|^train_language_model runs on the shipped|^plot:|^launch: 2 ranks of
# (the spaces of the line breaks taken out of the regex)
SANITIZE_CI_EXCLUDE := $(strip $(subst | ,|,$(_sanitize_ci_exclude)))|^cli: the benchmark programs refuse
# What `make sanitize` builds: the programs the tests run (CMake's halfgrad_test_programs). CI's subset leaves out the
# two benchmark programs, whose one test (their numbers' parsing, checked unsanitised by make test) does not pay for
# their 74 s of sanitised compiling (2 cores, 2026-12-03).
SANITIZE_TARGETS ?= halfgrad_test_programs
ifeq ($(SANITIZE_SUBSET),ci)
  SANITIZE_EXCLUDE := $(SANITIZE_CI_EXCLUDE)
  SANITIZE_TARGETS := halfgrad_test_programs_without_benchmarks
endif
# The CPU library, its tests and the programs they run (CMake's halfgrad_test_programs: the CLI, two benchmark
# programs, the process-group tests' worker, the fuzz targets' replay programs), under AddressSanitizer and UndefinedBehaviorSanitizer (gcc; leaks
# checked too): a report fails its test. Built at -O1 with assertions on:
# 6.8 minutes on the 2-core development machine (2026-12-02) against 15 at -O3; the whole suite then took 11.5
# minutes, CI's subset 1.6 (1.9 with 741 entries, 2026-12-07).
sanitize: deps
	cmake -S . -B "$(SANITIZE_DIR)" -G "$(GENERATOR)" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O1 \
	  -DHALFGRAD_SANITIZE=ON -DHALFGRAD_CUDA=OFF -DHALFGRAD_BUILD_EXAMPLES=OFF
	cmake --build "$(SANITIZE_DIR)" -j $(JOBS) --target $(SANITIZE_TARGETS)
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 OMP_WAIT_POLICY=passive \
	  ctest --test-dir "$(SANITIZE_DIR)" --output-on-failure -j $(JOBS) -E '$(SANITIZE_EXCLUDE)'

TSAN_DIR   ?= build-tsan
# The tests whose threads are halfgrad's own: the image loader's workers, alone and under the training loops.
TSAN_TESTS ?= *workers*,*image loader*,*epoch visits every sample*,train_classifier learns*,train_classifier --resume*
# The CPU library and its tests under ThreadSanitizer (gcc), running TSAN_TESTS: a data race fails the run. One
# OpenMP thread: libgomp is not instrumented, so its threads would be reported falsely. Not in CI (a build of its own).
tsan: deps
	cmake -S . -B "$(TSAN_DIR)" -G "$(GENERATOR)" -DCMAKE_BUILD_TYPE=Release -DHALFGRAD_SANITIZE_THREAD=ON \
	  -DHALFGRAD_CUDA=OFF -DHALFGRAD_BUILD_EXAMPLES=OFF -DHALFGRAD_BUILD_TOOLS=OFF
	cmake --build "$(TSAN_DIR)" -j $(JOBS) --target halfgrad_tests
	OMP_NUM_THREADS=1 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
	  "$(TSAN_DIR)/halfgrad_tests" --test-case="$(TSAN_TESTS)"

clean:
	rm -rf "$(BUILD_DIR)"
