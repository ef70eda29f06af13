#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh), then runs every test: lint, GoogleTest (plain and
# under AddressSanitizer + UBSan and ThreadSanitizer; the C++ core, and every CUDA kernel in the CPU
# simulator, also with the warp-ahead schedule) and pytest. This is what CI runs
# (.ci/run).
#
#   bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# The time of each stage, printed at the end (also when a stage fails).
stages=()
last=$start
stage() {
  local now
  now=$(date +%s)
  [ -n "${current:-}" ] && stages+=("$(printf '%6d s  %s' $((now - last)) "$current")")
  current=$1
  last=$now
  if [ -n "$1" ]; then echo "== $1"; fi
}
report() {
  stage ""
  echo "== time per stage"
  printf '%s\n' "${stages[@]}"
  echo "$(printf '%6d s  total' $(( $(date +%s) - start )))"
}
trap report EXIT
stage "setup (apt, pip, build)"
bash scripts/setup.sh
PY=${PYTHON:-python3}
jobs=$(nproc)

stage "lint (ruff, clang-format)"
$PY -m ruff check python tests benchmarks examples
git ls-files '*.h' '*.cc' '*.cpp' '*.cu' '*.cuh' | xargs clang-format --dry-run -Werror

stage "GoogleTest (build and run)"
cmake -S . -B build/cmake -G Ninja -DTIERLIFT_BENCHMARKS=ON >/dev/null
cmake --build build/cmake -j "$jobs"
./build/cmake/tierlift_tests --gtest_brief=1
stage "CUDA kernels in the CPU simulator (csrc/cudasim)"
./build/cmake/tierlift_cudasim_tests --gtest_brief=1

stage "GoogleTest under AddressSanitizer + UndefinedBehaviorSanitizer"
cmake -S . -B build/asan -G Ninja -DTIERLIFT_SANITIZE=ON >/dev/null
cmake --build build/asan -j "$jobs"
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
./build/asan/tierlift_tests --gtest_brief=1
./build/asan/tierlift_cudasim_tests --gtest_brief=1
unset ASAN_OPTIONS UBSAN_OPTIONS

stage "CUDA kernels in the CPU simulator: warp-ahead schedule"
TIERLIFT_CUDASIM_SCHEDULE=warp ./build/cmake/tierlift_cudasim_tests --gtest_brief=1
stage "GoogleTest under ThreadSanitizer (the I/O engine's threads, the pool; the kernels' race run)"
cmake -S . -B build/tsan -G Ninja -DTIERLIFT_TSAN=ON -DTIERLIFT_BENCHMARKS=OFF >/dev/null
cmake --build build/tsan -j "$jobs" --target tierlift_tests tierlift_cudasim_tests
# TSAN_OPTIONS and setarch -R for every TSan binary live in scripts/tsan_races.sh.
bash scripts/tsan_races.sh --all-tests ./build/tsan/tierlift_tests
# The race run: the simulator's own tests and the small-shape race tests of every kernel with an
# atomic, a barrier or a warp collective (its filter and limits live in that one script, which
# scripts/mutate_kernels.py runs too; the whole suite is far too slow under TSan).
bash scripts/tsan_races.sh ./build/tsan/tierlift_cudasim_tests

stage "pytest"
$PY -m pytest -q -ra --durations=25 tests/python "$@"

stage "pytest under the GPU machine's Python 3.12 and torch 2.11 (a subset; its build is carried)"
bash scripts/test_torch211.sh
