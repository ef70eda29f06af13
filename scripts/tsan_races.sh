#!/usr/bin/env bash
# The race run over the simulated CUDA threads: a ThreadSanitizer build's simulator tests, limited
# to the tests that finish in about a minute there. CI (scripts/test.sh) and the TSan mode of
# scripts/mutate_kernels.py both run this file, so their filter and limits cannot drift apart.
# It is also the one place that says how any TSan test binary runs (TSAN_OPTIONS, setarch -R):
# with --all-tests it runs the binary's whole suite that way (scripts/test.sh: the C++ core's
# tests, whose I/O engine and thread pool threads TSan watches).
#
#   bash scripts/tsan_races.sh build/tsan/tierlift_cudasim_tests [more gtest flags]
#   bash scripts/tsan_races.sh --all-tests build/tsan/tierlift_tests [more gtest flags]
#
# Selected: the simulator's own tests (CudaSim*, planted races included) and KernelRaces*
# (tests/cudasim/test_kernel_races.cc): every kernel in csrc/cuda with an atomic, a barrier,
# shared memory or a warp collective, on small shapes with several blocks contending on each
# atomic. The whole suite takes far too long under TSan (every block a fresh OS thread, every
# simulated thread fresh TSan state): run it without the filter after changing a kernel's
# synchronization (docs/cudasim.md).
set -euo pipefail
RACE_FILTER='CudaSim*:KernelRaces*'
# halt_on_error: the first report fails the run. history_size=4: enough for the small tests,
# less memory and time than the default.
RACE_TSAN_OPTIONS='halt_on_error=1 history_size=4'

filter=(--gtest_filter="$RACE_FILTER")
if [ "${1:-}" = "--all-tests" ]; then
  filter=()
  shift
fi
binary=${1:?usage: bash scripts/tsan_races.sh [--all-tests] TSAN_BUILD/TEST_BINARY [gtest flags]}
shift
# setarch -R: older libtsan refuses the high-entropy address layouts of newer kernels.
TSAN_OPTIONS="$RACE_TSAN_OPTIONS" exec setarch "$(uname -m)" -R \
  "$binary" --gtest_brief=1 "${filter[@]}" "$@"
