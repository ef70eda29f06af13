#!/usr/bin/env bash
# GPU verification in two device calls of at most 6 minutes each, so that both and one rerun fit
# the 15 minutes of device time (machine start included) that a GPU session gets:
#
#   bash scripts/gpu_check.sh 1   unpack .devdeps, build for sm_90, every `-m gpu` test,
#                                 example smoke runs (a few steps each)
#   bash scripts/gpu_check.sh 2   benchmarks, most important first (builds first if needed)
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh 1|2
#                                 no GPU, no build: runs every other line and checks that each
#                                 script and flag exists (scripts/gpu_check_argv.py)
#
# Every part runs under `timeout` and within the stage's budget (GPU_CHECK_BUDGET seconds, 345 by
# default), so a part cut off still leaves its log and the stage still ends in time. Results go
# under $OUT (default ./gpu_out), at most 8 files as the device tool returns them:
# summary.txt (one line per part), the logs, results/*.json named with the GPU, and after stage 1
# the built extension (stripped) to carry into a fresh machine. GPU_CHECK_TESTS adds pytest args;
# GPU_CHECK_SKIP="name|name" skips parts by their summary name (parts measured on an earlier run).
#
# Here, once per checkout (.devdeps is ignored by git): the build's liburing headers and the
# per-test time limit, which the GPU machine (no network) lacks:
#   mkdir -p .devdeps && (cd .devdeps && apt-get download liburing2 liburing-dev &&
#     python3 -m pip download --no-deps --only-binary=:all: pytest-timeout expecttest)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
STAGE=${1:-}
[[ $STAGE == 1 || $STAGE == 2 ]] || { echo "usage: $0 1|2 (see the script's top)" >&2; exit 2; }
DRY=${GPU_CHECK_DRY:-0}
OUT=${OUT:-$PWD/gpu_out}
SCRATCH=${GPU_CHECK_SCRATCH:-/tmp/gpu_check}  # big files (NVMe state, checkpoints): never in $OUT
BUDGET=${GPU_CHECK_BUDGET:-345}
mkdir -p "$OUT/results" "$SCRATCH"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
PY=python3
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# run NAME LOG SECONDS CMD...: CMD under `timeout`, cut to what is left of the budget; appends its
# output to $OUT/LOG and one line to summary.txt. Dry run: only records CMD for the checker.
run() {
  local name=$1 log=$OUT/$2 cap=$3 left rc t0=$SECONDS
  shift 3
  if [[ $DRY == 1 ]]; then
    printf '%q ' "$@" >>"$OUT/dry_commands.txt" && echo >>"$OUT/dry_commands.txt"
    return 0
  fi
  if [[ "|${GPU_CHECK_SKIP:-}|" == *"|$name|"* ]]; then
    note "$name: skipped (GPU_CHECK_SKIP)"
    return 0
  fi
  left=$((BUDGET - SECONDS))
  ((cap > left)) && cap=$left
  ((cap < 15)) && { note "$name: SKIPPED (budget spent)"; return 1; }
  echo "===== $name (limit ${cap}s): $*" >>"$log"
  timeout -k 10 "$cap" "$@" >>"$log" 2>&1
  rc=$?
  case $rc in
    0) note "$name: ok ($((SECONDS - t0)) s)" ;;
    124 | 137) note "$name: TIMED OUT after ${cap} s (see $(basename "$log"))" ;;
    *) note "$name: FAILED rc=$rc ($((SECONDS - t0)) s, see $(basename "$log"))"; tail -15 "$log" ;;
  esac
  rm -rf "${SCRATCH:?}"/*  # leftovers of a part cut off must not fill the disk
  return $rc
}

# --- machine, carried packages, build ---------------------------------------------------------
: >"$OUT/summary.txt"
if [[ $DRY == 1 ]]; then
  : >"$OUT/dry_commands.txt"
  GPU=DRY_RUN
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    | tee -a "$OUT/summary.txt"
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
fi
DEVDEPS=$SCRATCH-devdeps
if ls .devdeps/*.deb >/dev/null 2>&1; then
  for f in .devdeps/*.deb; do dpkg -x "$f" "$DEVDEPS"; done
  export CPATH=$DEVDEPS/usr/include LIBRARY_PATH=$DEVDEPS/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} TIERLIFT_URING=1
else
  note "note: no .devdeps/*.deb carried: building without io_uring"
fi
# pytest-timeout (a per-test limit) and expecttest (torch.testing's optimizer configurations
# import it), from the wheels carried in .devdeps.
if [[ $DRY != 1 && $STAGE == 1 ]] && ls .devdeps/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --upgrade --no-index --no-deps --target "$SCRATCH-site" .devdeps/*.whl
fi
[[ -d $SCRATCH-site ]] && export PYTHONPATH=$PYTHONPATH:$SCRATCH-site
TIMEOUT_FLAG=()
if $PY -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_FLAG=(--timeout=60); fi

built() {
  $PY -c "import sys, tierlift; sys.exit(not tierlift._extension.has_cuda_kernels())" 2>/dev/null
}
# build_ext --inplace: the objects stay in build/, so a rerun on a warm machine recompiles nothing.
BUILD=(env TIERLIFT_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 "$PY" setup.py build_ext --inplace)
if [[ $DRY == 1 ]]; then
  if ! [[ -f setup.py ]] || ! $PY -c "import setuptools"; then note "dry: no setuptools"; fi
elif [[ $STAGE == 1 ]] || ! built; then
  run build build.log 200 "${BUILD[@]}" || { cat "$OUT/summary.txt"; exit 1; }
  $PY -m tierlift info | tee -a "$OUT/summary.txt"
  built || { note "BUILD has no CUDA kernels"; exit 1; }
  # A compiler that links libstdc++ into the extension: setup.py keeps that copy's symbols local.
  for so in python/tierlift/_C.*.so; do
    ldd "$so" | grep -q 'libstdc++' || note "note: $(basename "$so") has libstdc++ linked in"
  done
  if [[ $STAGE == 1 ]]; then  # to carry into a fresh machine for stage 2 (see docs)
    for so in python/tierlift/_C.*.so; do strip -g -o "$OUT/$(basename "$so")" "$so"; done
  fi
fi

# --- stage 1: GPU tests, then example smoke runs -----------------------------------------------
if [[ $STAGE == 1 ]]; then
  # 471 tests; a module that fails to import does not stop the others, five failures do;
  # --durations names the slow ones for the next run.
  # shellcheck disable=SC2086  # GPU_CHECK_TESTS: several pytest arguments
  run "pytest -m gpu" pytest.log 150 $PY -m pytest -q --maxfail=5 \
    --continue-on-collection-errors -ra -m gpu -p no:cacheprovider \
    "${TIMEOUT_FLAG[@]}" --durations=15 tests/python ${GPU_CHECK_TESTS:-}
  GPT=(examples/train_gpt.py --device cuda --dtype bf16 --steps 8 --compare-steps 0 --data-mb 1)
  run "gpt --zero 3" examples.log 45 $PY -m torch.distributed.run --standalone --nproc-per-node 1 \
    "${GPT[@]}" --zero 3
  # --offload always overlaps the step with backward (the example sets overlap=True).
  run "gpt --offload nvme" examples.log 40 $PY "${GPT[@]}" --offload nvme --nvme-path "$SCRATCH"
  # min-features 128: the example's small layers are converted too (the default skips < 1024).
  run "gpt --lowp fp8-rowwise" examples.log 40 $PY "${GPT[@]}" --lowp fp8-rowwise --dim 256 \
    --lowp-min-features 128
  run "graphsage" examples.log 45 $PY examples/train_graphsage.py --scale 13 --steps 10
fi

# --- stage 2: benchmarks in priority order ---------------------------------------------------
# Estimates for an H100 (from the work sizes, plus ~8 s of start-up per process): optim ~30 s
# (1e8-1e9 params in 64 tensors, 2 dtypes x 2 contenders x 7 steps of ~28 B/param at ~3 TB/s);
# gather ~40 s (7 row sizes, a 1 GiB host table filled per row); lowp ~20 s (fwd+bwd = 3 GEMMs of
# 8192^3, quantizers over 8192^2 bf16); offload ~130 s (1B Llama, 4 steps; the AdamW state,
# 12 B/param x 2 generations, under $SCRATCH: on an H200 7 steps did not finish in 80 s, so 4;
# each step's time is logged; then the torch peer at ~1.1 s/step);
# checkpoint ~85 s (1B params and AdamW state on the GPU, 12 GB per save at ~1.2 GB/s, 3 contenders
# x 2 saves, the blocking one last; the host-RAM case was measured on the H200 run).
# About 320 s; the budget cuts the rest.
if [[ $STAGE == 2 ]]; then
  stamp=$SCRATCH-stamp && touch "$stamp"
  run optim bench.log 50 $PY benchmarks/bench_optim.py --gpu-only --cuda-sizes 1e8,3e8,1e9
  run gather bench.log 60 $PY benchmarks/bench_gather.py --gpu-only --table-mib 1024
  # also the FP8/FP4 quantize kernels vs D2D copy (a few seconds, same process)
  run lowp bench.log 45 $PY benchmarks/bench_lowp.py --device cuda --sizes 8192
  # bounded parts first: the 1B offload run takes what is left of the budget
  # background save vs DCP async_save of GPU-resident state first: a cut run keeps those rows
  run checkpoint bench.log 110 $PY benchmarks/bench_checkpoint.py --device cuda --params 1e9 \
    --ranks 1 --configs ram --contenders background dcp-async sync --repeat 1 --warmup 1 \
    --dir "$SCRATCH" --out benchmarks/results/bench_checkpoint-cuda.json
  # the machine disk's speed through the engine (fio too if installed): says how much of the
  # 1B run's step is the 13 GB of optimizer state read and written per step
  run disk bench.log 30 $PY benchmarks/bench_io.py --dir "$SCRATCH" --size-mib 1024 --repeat 1 \
    --out benchmarks/results/bench_io-disk.json
  run "zero3 offload 1B" bench.log 170 $PY benchmarks/bench_offload.py --gpu --model 1b \
    --tier nvme --overlap --offload-params cpu --peer torch-cpu --steps 3 --warmup 1 \
    --seq-len 2048 --dir "$SCRATCH" --timeout 100
  # each JSON written in this stage, named with the GPU
  find benchmarks/results -name '*.json' -newer "$stamp" | while read -r f; do
    name=$(basename "$f" .json)
    [[ $name == *"$GPU"* ]] || name=$name-gpu-$GPU
    cp "$f" "$OUT/results/$name.json"
  done
fi

if [[ $DRY == 1 ]]; then
  $PY scripts/gpu_check_argv.py "$OUT/dry_commands.txt" | tee -a "$OUT/summary.txt"
  rc=${PIPESTATUS[0]}
  rm -f "$OUT/dry_commands.txt"
  exit "$rc"
fi
cat "$OUT/summary.txt"
! grep -q "FAILED\|TIMED OUT" "$OUT/summary.txt"
