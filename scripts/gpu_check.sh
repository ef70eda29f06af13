#!/usr/bin/env bash
# GPU verification in device calls of at most 6 minutes each (15 minutes of device time in all,
# machine start included, for a GPU session):
#
#   bash scripts/gpu_check.sh 2   the headline first: fine-tuning a 1.1B Llama with the optimizer
#                                 state in host RAM, tierlift vs torch's AdamW-on-CPU recipe vs
#                                 DeepSpeed ZeRO-3 and ZeRO-2 offload_optimizer=cpu, tierlift with
#                                 part of the state on the GPU; then the NVMe tier, tierlift vs
#                                 DeepSpeed ZeRO-3 offload_optimizer=nvme (builds first if
#                                 needed)
#   bash scripts/gpu_check.sh 3   7B with its state in RAM (tierlift overlapped in one generation
#                                 plus spare chunks, --cpu-budget), the kernel rows (AdamW, FP8/FP4,
#                                 gather), then DeepSpeed at 7B, tierlift's compact state at 7B
#                                 (two generations fit), the 7B split, the checkpoint (run
#                                 right after stage 2: the machine is given back ~30 s after a
#                                 call, and a fresh one builds again)
#   bash scripts/gpu_check.sh 1   unpack .devdeps, build for sm_90, every `-m gpu` test,
#                                 example smoke runs (a few steps each)
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh 1|2|3
#                                 no GPU, no build: runs every other line and checks that each
#                                 script and flag exists and that the carried DeepSpeed wheels
#                                 resolve for the GPU machine's Python (scripts/gpu_check_argv.py)
#
# Every part runs under `timeout` and within the stage's budget (GPU_CHECK_BUDGET seconds, 345 by
# default), so a part cut off still leaves its log and the stage still ends in time. Results go
# under $OUT (default ./gpu_out): summary.txt (one line per part), the logs, results/*.json named
# with the GPU, and after stage 1 the built extension (stripped). GPU_CHECK_TESTS adds pytest
# args; GPU_CHECK_SKIP="name|name" skips parts by their summary name (parts measured earlier).
#
# Here, before the device calls: bash scripts/fetch_devdeps.sh (once per checkout: .devdeps is
# ignored by git and the GPU machine has no network; 8 s on the development VM), then bash
# scripts/prebuild_gpu.sh (tierlift's extension for the GPU machine's Python and torch, into
# .devdeps/prebuilt, used there only where its manifest matches the tree: a minute of the GPU
# machine saved). fetch_devdeps.sh's top lists what is carried: the liburing and libaio debs,
# the pytest-timeout and expecttest wheels, DeepSpeed built without ops plus the dependencies
# torch's environment there lacks, for Python 3.12, and torchao's pure-Python wheel.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
STAGE=${1:-}
[[ $STAGE == 1 || $STAGE == 2 || $STAGE == 3 ]] || {
  echo "usage: $0 1|2|3 (see the script's top)" >&2
  exit 2
}
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
  rm -rf "${RUN_SCRATCH:-${SCRATCH:?}}"/*  # leftovers of a part cut off must not fill the disk
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
  # SuperOffload moves 8 B/param through /dev/shm (a small one would end its row with SIGBUS)
  note "host: $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB RAM," \
    "/dev/shm $(df -h /dev/shm | awk 'NR == 2 {print $2 " (" $4 " free)"}')"
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
# import it), from the wheels carried in .devdeps, for the GPU tests of stages 1 and 2.
if [[ $DRY != 1 && $STAGE != 3 ]] && ls .devdeps/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --upgrade --no-index --no-deps --target "$SCRATCH-site" .devdeps/*.whl
fi
[[ -d $SCRATCH-site ]] && export PYTHONPATH=$PYTHONPATH:$SCRATCH-site
TIMEOUT_FLAG=()
if $PY -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_FLAG=(--timeout=60); fi
# gpu_tests NAME CAP ARGS...: the GPU tests among ARGS as one part (five failures stop it)
gpu_tests() {
  local name=$1 cap=$2
  shift 2
  run "$name" pytest.log "$cap" $PY -m pytest -q --maxfail=5 -m gpu -p no:cacheprovider \
    "${TIMEOUT_FLAG[@]}" "$@"
}

# DeepSpeed (stages 2 and 3) from the wheels carried in .devdeps/deepspeed: pip resolves them,
# offline, against what this Python already has, and only what is missing goes into a site dir
# of its own, so nothing the machine has is shadowed (the tierlift and torch cases import none
# of it). ninja: the machine's, else the carried one (PATH's end).
DS_SITE=$SCRATCH-ds-site
export TORCH_EXTENSIONS_DIR=$SCRATCH-torch-ext  # DeepSpeed's JIT-built ops, kept between stages
export PYTHONPATH=$PYTHONPATH:$DS_SITE PATH=$PATH:$DS_SITE/bin
ds_install() {
  local need
  if ! ls .devdeps/deepspeed/deepspeed-*.whl >/dev/null 2>&1; then
    note "deepspeed: no wheels in .devdeps/deepspeed (scripts/fetch_devdeps.sh): left out"
    return 1
  fi
  need=$($PY -m pip install --dry-run -q --no-index --find-links .devdeps/deepspeed --report - \
    deepspeed 2>>"$OUT/deepspeed.log" | $PY -c 'import json, sys, urllib.parse as u
print(*(u.unquote(u.urlparse(i["download_info"]["url"]).path)
        for i in json.load(sys.stdin)["install"]))') || {
    note "deepspeed: the carried wheels do not resolve here (see deepspeed.log): left out"
    return 1
  }
  [[ -z $need ]] && { note "deepspeed: already installed"; return 0; }
  # shellcheck disable=SC2086  # one path per wheel
  $PY -m pip install -q --no-index --no-deps --target "$DS_SITE" $need \
    >>"$OUT/deepspeed.log" 2>&1 || { note "deepspeed: install FAILED (see deepspeed.log)"; return 1; }
  note "deepspeed: installed $(for w in $need; do basename "$w" | cut -d- -f1-2; done | xargs)"
}
# DeepSpeed's ops build here, by its own JIT, for this machine's CPU (its CPU Adam compiles with
# -march=native and picks its SIMD width from the CPU it builds on: one built elsewhere would not
# be the DeepSpeed its users run). Its CPU Adam (ninja and the host compiler, ~45 s on 16 cores:
# two translation units took 111 s of CPU on the 2-core development VM) and its async_io op
# (deepspeed-nvme's alone; libaio from the carried debs, CPATH / LIBRARY_PATH above; its
# pin_memory op, then 12 translation units at -O0: 462 s of CPU on the 2-core VM, ~30-40 s
# estimated on 16 cores) build in the background, bounded, their times in deepspeed.log, while
# the parts that need neither run; the configs are checked against DeepSpeed's schema in the same
# call, and the DeepSpeed contenders run only if all that worked. Where tierlift builds here too,
# only the CPU Adam builds beside it, and async_io later, right before the NVMe row
# (ds_aio_build), so it takes no cores from tierlift's build. Its CUDA build links -lcuda: where
# the driver brought only libcuda.so.1 (a container), the toolkit's stub of that soname is last
# on the link path.
DS_PID=
DS_STATE=none  # none | started | ready | failed
DS_AIO_OK=$SCRATCH-ds-aio-ok  # beside $SCRATCH: each part's end empties $SCRATCH
DS_ENV=()
ds_check_start() {  # ds_check_start AIO_SECONDS: 0 leaves async_io to ds_aio_build
  [[ $STAGE != 1 && $DS_STATE == none ]] || return 0
  if [[ $DRY != 1 ]] && ! ds_install; then DS_STATE=failed; return 0; fi
  rm -f "$TORCH_EXTENSIONS_DIR"/*/lock  # a build cut off leaves its lock: the next would wait
  local nvcc stubs
  nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
  stubs=$(dirname "$(dirname "$nvcc")")/lib64/stubs
  [[ -d $stubs ]] && DS_ENV=(env "LIBRARY_PATH=${LIBRARY_PATH:+$LIBRARY_PATH:}$stubs")
  # its own scratch folder: each foreground part's end empties $SCRATCH, and this one's its own
  mkdir -p "$SCRATCH-ds"
  RUN_SCRATCH=$SCRATCH-ds run "deepspeed build" deepspeed.log $(($1 + 150)) "${DS_ENV[@]}" $PY \
    benchmarks/bench_offload.py --deepspeed-check --aio-timeout "$1" --aio-ok "$DS_AIO_OK" \
    --dir "$SCRATCH-ds" &
  DS_PID=$!
  DS_STATE=started
}
ds_wait() {  # sets DS (",deepspeed") once DeepSpeed is installed and its CPU Adam built
  if [[ $DS_STATE == started ]]; then
    if wait "$DS_PID"; then DS_STATE=ready; else DS_STATE=failed; fi
  fi
  DS=
  [[ $DS_STATE == ready || $DRY == 1 ]] && DS=,deepspeed
  return 0
}
# ds_aio_build: DeepSpeed's async_io op (libaio from the carried debs), then 8 MiB through it
# under $SCRATCH, bounded; writes $DS_AIO_OK where that worked (deepspeed-nvme can run). The CPU
# Adam is cached by then. A part of its own, so its time and failure show in summary.txt.
ds_aio_build() {
  [[ -f $DS_AIO_OK ]] && return 0  # built beside the parts before
  run "deepspeed aio build" deepspeed.log 75 "${DS_ENV[@]}" $PY benchmarks/bench_offload.py \
    --deepspeed-check --aio-timeout 60 --aio-ok "$DS_AIO_OK" --dir "$SCRATCH"
}

# tierlift's extension: kept from an earlier call on this (warm) machine, else the build made
# ahead on the development machine (scripts/prebuild_gpu.sh, carried in .devdeps/prebuilt),
# else built here (~60 s, the first minute of a fresh machine). Each counts only where its
# manifest (scripts/gpu_prebuilt.py) matches this tree's sources, this Python and this torch, so
# a stale binary is never tested or measured as this tree's; $BUILT_STAMP holds the manifest of
# what python/tierlift holds now.
PREBUILT=${GPU_CHECK_PREBUILT:-.devdeps/prebuilt}
BUILT_STAMP=build/gpu-check-built
built() {  # one process: each imports torch
  $PY -c "import sys; sys.path.insert(0, 'scripts'); import gpu_prebuilt, tierlift
sys.exit(not (tierlift._extension.has_cuda_kernels() and gpu_prebuilt.check('$BUILT_STAMP')[0]))" \
    2>/dev/null
}
use_prebuilt() {
  local why so=("$PREBUILT"/_C.*.so)
  [[ -f ${so[0]} ]] || { note "build: nothing prebuilt in $PREBUILT (scripts/prebuild_gpu.sh)"
    return 1; }
  if [[ $DRY == 1 ]]; then  # this machine is not the GPU's: its sources alone
    if why=$($PY scripts/gpu_prebuilt.py check --sources-only "$PREBUILT"); then
      note "dry run: the prebuilt extension's sources are this tree's ($why)"
    else
      note "dry run: warning: the prebuilt extension will not be used ($why): rerun" \
        "scripts/prebuild_gpu.sh, or the GPU machine builds (~60 s)"
    fi
    return 0
  fi
  why=$($PY scripts/gpu_prebuilt.py check "$PREBUILT") || {
    note "build: the prebuilt extension does not fit ($why)"; return 1; }
  mkdir -p "$BUILT_STAMP" && cp "$PREBUILT/manifest.json" "$BUILT_STAMP/" &&
    cp "${so[0]}" python/tierlift/ && built && {
    note "build: the prebuilt extension ($why)"; return 0; }
  note "build: the prebuilt extension does not load here (see build.log)"
  $PY -c "import tierlift._C" >>"$OUT/build.log" 2>&1
  rm -f "python/tierlift/$(basename "${so[0]}")" "$BUILT_STAMP/manifest.json"
  return 1
}
# build_ext --inplace: the objects stay in build/, so a rerun on a warm machine recompiles nothing.
BUILD=(env TIERLIFT_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 "$PY" setup.py build_ext --inplace)
NEED_BUILD=1
if [[ $DRY == 1 ]]; then
  if ! [[ -f setup.py ]] || ! $PY -c "import setuptools"; then note "dry: no setuptools"; fi
  use_prebuilt
elif [[ $STAGE != 1 ]] && built; then
  NEED_BUILD=0
  note "build: kept from an earlier call on this machine (its manifest matches this tree)"
elif [[ $STAGE != 1 ]] && use_prebuilt; then
  NEED_BUILD=0
fi
# DeepSpeed's check: beside tierlift's build (its CPU Adam only), or with nothing to wait for, in
# stage 2 its async_io op too; stage 3 (no NVMe row) starts it before the kernel rows, which
# leave the CPU cores to it, not before the 7B row, whose CPU Adam needs them all.
if ((NEED_BUILD)); then
  ds_check_start 0
elif [[ $STAGE == 2 ]]; then
  ds_check_start 75
fi
if ((NEED_BUILD)) && [[ $DRY != 1 ]]; then
  run build build.log 200 "${BUILD[@]}" || {
    [[ -n $DS_PID ]] && wait "$DS_PID"
    cat "$OUT/summary.txt"
    exit 1
  }
  # what python/tierlift now holds is this tree's (not where GPU_CHECK_SKIP left out the build)
  [[ "|${GPU_CHECK_SKIP:-}|" == *"|build|"* ]] || $PY scripts/gpu_prebuilt.py record "$BUILT_STAMP"
  $PY -m tierlift info | tee -a "$OUT/summary.txt"
  built || { note "BUILD: the extension does not load, has no CUDA kernels, or is not this" \
    "tree's (see build.log)"; exit 1; }
  # A compiler that links libstdc++ into the extension: setup.py keeps that copy's symbols local.
  for so in python/tierlift/_C.*.so; do
    ldd "$so" | grep -q 'libstdc++' || note "note: $(basename "$so") has libstdc++ linked in"
  done
  if [[ $STAGE == 1 ]]; then  # to carry into a fresh machine for stage 2 (see docs)
    for so in python/tierlift/_C.*.so; do strip -g -o "$OUT/$(basename "$so")" "$so"; done
  fi
fi
if [[ $DRY == 1 ]]; then  # the dry run checks the DeepSpeed contenders' names too
  ds_wait
  ls .devdeps/libaio-dev_*.deb >/dev/null 2>&1 ||
    note "dry run: warning: no libaio debs in .devdeps (scripts/fetch_devdeps.sh): deepspeed-nvme left out"
fi

# torchao (stage 2's lowp part) from the wheel carried in .devdeps/torchao, into a site dir of its
# own at PYTHONPATH's end, unless this Python has a torchao. Dry run: the wheel must install on
# the GPU machine's Python 3.12 (pip --dry-run with its tags).
AO_SITE=$SCRATCH-ao-site
ao_install() {
  local whls=(.devdeps/torchao/torchao-*.whl) whl
  whl=${whls[-1]}
  if [[ $DRY != 1 ]] && $PY -c "import torchao" 2>/dev/null; then
    note "torchao: $($PY -c 'import torchao; print(torchao.__version__)') (this machine's)"
    return 0
  fi
  [[ -f $whl ]] || { note "torchao: no wheel in .devdeps/torchao (scripts/fetch_devdeps.sh): left out"
    return 1; }
  if [[ $DRY == 1 ]]; then
    if $PY -m pip install --dry-run -q --no-index --no-deps --only-binary=:all: \
      --target "$AO_SITE" --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
      --abi none --platform manylinux_2_28_x86_64 --platform any "$whl" >/dev/null 2>&1; then
      note "dry run: $(basename "$whl") installs for Python 3.12"
    else
      note "dry run: $(basename "$whl") does not install for Python 3.12"
      AO_DRY_PROBLEM=1
    fi
    return 0
  fi
  $PY -m pip install -q --upgrade --no-index --no-deps --target "$AO_SITE" "$whl" \
    >>"$OUT/bench.log" 2>&1 || { note "torchao: install FAILED (see bench.log)"; return 1; }
  export PYTHONPATH=$PYTHONPATH:$AO_SITE
  note "torchao: installed $(basename "$whl" | cut -d- -f1-2)"
}

# --- stage 1: GPU tests, then example smoke runs -----------------------------------------------
if [[ $STAGE == 1 ]]; then
  # 471 tests; a module that fails to import does not stop the others, five failures do;
  # --durations names the slow ones for the next run.
  # shellcheck disable=SC2086  # GPU_CHECK_TESTS: several pytest arguments
  gpu_tests "pytest -m gpu" 150 --continue-on-collection-errors -ra --durations=15 tests/python \
    ${GPU_CHECK_TESTS:-}
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

# --- stage 2: the headline first, then the NVMe tier, the kernel rows, the checkpoint --------
# Batch: 8 x 2048 = 16,384 tokens per step for the 1.1B (batch 1 gave ~0.03 s of GPU compute
# against a ~1 s host step: nothing for the overlap to hide behind). Memory per contender
# (finetune_sizing.py): GPU 4 B/param of bf16 params + grads (4.4 GB; DeepSpeed's partition and
# buckets counted the same) + activations 39.6 GB by activation_bytes() (which errs high: the
# H200 run peaked at 6.99 GB for batch 1, 4.4 of it params and grads) = 44 GB of 141: 3x room.
# RAM, each case in its own process: tierlift 24 B/param (two generations, 26.5 GB, pinned at
# its size), torch's recipe 18 B (20 GB), DeepSpeed 16 B.
# No clipping for any contender (--max-grad-norm 0): above the threshold every chunk the overlap
# stepped is redone (docs/offload-overlap.md) and, on NVMe, read and written twice, and a randomly
# initialized model on random tokens sits above 1.0 (the tiny one of --finetune-check: 1.87);
# the torch row records the 1.1B's norm.
# Estimates (H200, 16 cores; ~8 s of process start per case; GPU compute ~1.2e14 FLOP a step,
# ~0.3 s at 400 TFLOPS, not measured; warmup 1 + 3 steps):
#   build            ~5 s with the prebuilt extension (scripts/prebuild_gpu.sh: loading it and
#                    checking its manifest), else ~60 s when the machine is fresh (62 s on the
#                    H200 run). DeepSpeed's CPU Adam and async_io (~45 s) build in the
#                    background during offload exact (~30 s): the DeepSpeed rows wait ~15 s
#   offload exact    ~30 s: the offloaded step's GPU tests (bit-exact against plain AdamW); cap 80 s
#   offload 1B ram   ~250 s: tierlift (params on the GPU, overlap) ~30 s (pinning 26.5 GB, steps
#                    ~1 s); DeepSpeed SuperOffload (ZeRO-3; its speculative CPU Adam in a worker
#                    process, overlapped with backward: DeepSpeed's own answer to the same
#                    problem; 8 B/param through /dev/shm) ~50 s; DeepSpeed ZeRO-2 (ZeRO-Offload's
#                    own recipe: no parameter gathering on one GPU) ~35 s; torch's AdamW on CPU
#                    4 x (1.09 + 0.3) s + ~12 s set-up ~25 s; the ceiling (torch-gpu: nothing
#                    offloaded, fp32 masters and state on the GPU, 62 GB; tierlift's forward +
#                    backward against its own) ~20 s; DeepSpeed ZeRO-3 (init, 18 GB of
#                    state, steps ~1.8 s) ~45 s; tierlift ZeRO-3 with params in RAM ~30 s. Most
#                    telling first: a cap cuts the last. Cap 290 s, 75 s per case.
#   offload 1B ram split ~30 s: tierlift with device_fraction from the row above (skipped when
#                    none of its CPU Adam was exposed). Cap 60 s.
#   disk             ~15 s: 1 GiB written and read through the engine (the NVMe row's roofline)
#   offload 1B nvme  ~60 s: 12 B/param of state read and written per step (13 GB each way): at
#                    ~2.5 GB/s ~10 s a step, warmup 1 + 2 steps and ~15 s set-up; the step over
#                    (bytes read + written) / the disk part's bandwidth, target <= 1.25x (no disk
#                    JSON, e.g. that part failed: refused). Then DeepSpeed ZeRO-3 with its state
#                    on NVMe (deepspeed-nvme, ZeRO-Infinity's optimizer side, its documented aio
#                    settings), where its async_io op built: its swap files hold fp32 master, m,
#                    v and gradient, 16 B/param (17.7 GB; tierlift's two generations, 26.5 GB,
#                    are deleted before it starts, each case in its own folder), all read and
#                    written each step (35 GB: ~14 s a step at 2.5 GB/s) through 17 GB of pinned
#                    swap buffers (4 x the 1e9-parameter sub-group); its bytes are counted at its
#                    aio handle and set against the same roofline. Its op builds first (~40 s,
#                    cap 75 s), then ~90 s (set-up ~30 s: writing its initial state). Each row
#                    its own part (cap 100 s), tierlift's first.
#   offload 1B ram split deepspeed ~100 s: the split row's peers with the same share of the state
#                    on the GPU, ZeRO-Offload++ (ratio) and SuperOffload with that ratio
# Total ~330 s to the split row on a fresh machine with the prebuilt extension (~375 s without);
# the NVMe rows and the split's DeepSpeed peers fit only in a call of their own
# (GPU_CHECK_SKIP="offload exact|offload 1B ram|offload 1B ram split", with what device time is
# left; it still runs "deepspeed build", which the DeepSpeed rows need, or finds its ops built).
# The kernel rows are in stage 3, after the 7B row: two calls of 345 s and the machine's start fit 15 minutes, three do not.
# The fused CUDA AdamW's own check after the offload tests: the device staging test and
# test_gpu_paths_review compare with offload="none" (that kernel, reworked since its last GPU
# run) after comparing with the host kernel, so a kernel regression shows there without hiding
# the offload results. Then the other GPU paths changed since the last GPU run (a ZeRO step
# under set_sync_debug_mode("error"), the recompute tier's kept buffers, the gather's checks; a
# few seconds, in this pytest run to save a start).
OFFLOAD_GPU_TESTS="tests/python/test_offload.py tests/python/test_offload_h2d.py
  tests/python/test_offload_d2h.py tests/python/test_offload_watch.py tests/python/test_pinned.py
  tests/python/test_offload_device_staging.py tests/python/test_gpu_paths_review.py
  tests/python/test_offload_device_fraction.py tests/python/test_offload_leftovers.py
  tests/python/test_offload_abandon.py tests/python/test_offload_worker_threads.py
  tests/python/test_optim.py::test_cuda_kernel_matches_cpu_kernel
  tests/python/test_zero_sync_step.py tests/python/test_zero.py::test_cuda_world1_matches_plain_training
  tests/python/test_gpu_paths_round.py tests/python/test_gpu_paths_next.py
  tests/python/test_gnn_checks.py tests/python/test_gnn_user.py"
# the FP8/FP4 quantizers, Float8Linear's GEMMs and the gather variants on the GPU against their
# CPU references (the fused AdamW's own check is in OFFLOAD_GPU_TESTS)
KERNEL_GPU_TESTS="tests/python/test_lowp_quant.py tests/python/test_lowp_delayed_op.py
  tests/python/test_lowp_history_op.py tests/python/test_optim_compact.py
  tests/python/test_lowp_fp4.py tests/python/test_lowp_linear.py tests/python/test_gather_variants.py"
FT=("$PY" benchmarks/bench_offload.py --gpu --gpu-mem 140 --seq-len 2048 --max-grad-norm 0
  --dir "$SCRATCH")
DISK_JSON=benchmarks/results/bench_io-disk.json
if [[ $STAGE == 2 || $STAGE == 3 ]]; then
  stamp=$SCRATCH-stamp && touch "$stamp"
fi
# fresh_row PART JSON: a split row reads the tierlift row PART writes, so an older JSON goes
# before PART runs; where PART is skipped (a rerun of a stage's tail) the JSON stays: copy the
# earlier call's $OUT/results/<name>.json to benchmarks/results/ here, and it travels along.
fresh_row() {
  [[ $DRY == 1 || "|${GPU_CHECK_SKIP:-}|" == *"|$1|"* ]] || rm -f "$2"
}
if [[ $STAGE == 2 ]]; then
  # First the offloaded step's exactness on this GPU (the paths the headline takes: device
  # gradients and weights, their copies on streams, fingerprints on the device, state pinned at
  # its size, new weights staged on the device during backward), so its numbers are of a step
  # known to train as plain AdamW does. ~25 s.
  # shellcheck disable=SC2086  # OFFLOAD_GPU_TESTS: several pytest arguments
  gpu_tests "offload exact" 80 $OFFLOAD_GPU_TESTS
  ds_wait  # DeepSpeed's ops built beside the tests above
  # targets: tierlift >= 2x torch's AdamW-on-CPU recipe, >= 1.5x DeepSpeed (TFLOPS, same run)
  RAM_JSON=benchmarks/results/bench_offload_finetune-1b-ram-gpu-$GPU.json
  fresh_row "offload 1B ram" "$RAM_JSON"
  run "offload 1B ram" bench.log 290 "${FT[@]}" --model 1b --tier cpu --overlap --batch-size 8 \
    --contenders "tierlift${DS:+,deepspeed-super,deepspeed-zero2},torch-cpu,torch-gpu$DS,tierlift-zero3" \
    --steps 3 \
    --warmup 1 --timeout 75 \
    --json-suffix 1b-ram
  # tierlift again with the state of the chunks its CPU Adam stepped after backward kept on the
  # GPU (device_fraction: that row's exposed share of its Adam), so Adam hides behind backward
  run "offload 1B ram split" bench.log 60 "${FT[@]}" --model 1b --tier cpu --overlap \
    --batch-size 8 --contenders tierlift --steps 3 --warmup 1 --timeout 55 \
    --device-fraction-from "$RAM_JSON" --json-suffix 1b-ram-split
  # the machine disk's speed through the engine: the NVMe rows' steps against their state bytes
  [[ $DRY == 1 ]] || rm -f "$DISK_JSON"  # an earlier run's file must not stand in for this disk
  run disk bench.log 30 $PY benchmarks/bench_io.py --dir "$SCRATCH" --size-mib 1024 --repeat 1 \
    --out "$DISK_JSON" --deepspeed-aio-ok "$DS_AIO_OK"
  # target: step <= 1.25 x (state bytes read and written) / (disk bandwidth above)
  run "offload 1B nvme" bench.log 100 "${FT[@]}" --model 1b --tier nvme --batch-size 8 \
    --contenders tierlift --steps 2 --warmup 1 --timeout 95 --disk-json "$DISK_JSON" \
    --json-suffix 1b-nvme
  # the split row's DeepSpeed peers, with the same share of the state on the GPU: ZeRO-Offload++
  # (deepspeed-ratio: its ratio and sub-groups set so that it keeps the same first parameters
  # there) and SuperOffload with that ratio (its examples' pairing); after tierlift's NVMe row
  if [[ -n $DS ]]; then
    run "offload 1B ram split deepspeed" bench.log 130 "${FT[@]}" --model 1b --tier cpu \
      --overlap --batch-size 8 --contenders deepspeed-ratio,deepspeed-super --steps 3 --warmup 1 \
      --timeout 65 --device-fraction-from "$RAM_JSON" --json-suffix 1b-ram-split-deepspeed
  fi
  # DeepSpeed ZeRO-Infinity's optimizer side as the NVMe row's peer, after tierlift's row: its
  # async_io op builds now (not beside tierlift's build), then its row against the same roofline
  if [[ -n $DS ]] && ds_aio_build &&
    { [[ $DRY == 1 ]] || [[ -f $DS_AIO_OK ]]; }; then
    run "offload 1B nvme deepspeed" bench.log 100 "${FT[@]}" --model 1b --tier nvme \
      --batch-size 8 --contenders deepspeed-nvme --steps 2 --warmup 1 --timeout 95 \
      --disk-json "$DISK_JSON" --json-suffix 1b-nvme-deepspeed
  elif [[ -n $DS ]]; then
    note "deepspeed async_io: not built (see deepspeed.log): deepspeed-nvme left out"
  fi
fi

# --- stage 3: 7B (6.74B params), optimizer state in host RAM, overlapped ---------------------
# RAM (128 GiB): the overlap's two generations (24 B/param, 162 GB) do not fit, so tierlift runs
# with --cpu-budget 100: one generation (12 B/param, 80.9 GB = 75.3 GiB) plus spare chunk blocks
# in the rest (~32% of the chunks, stepped ahead during backward; the others step() steps in
# place), pinned at their size (tierlift._pinned), + 0.4 GiB of staging slots; the process and
# CUDA context ~5 GiB, ~22 GiB left for the page cache and the system. The plan refuses a budget
# past 85% of --cpu-mem (108.8 GiB). DeepSpeed (its own
# process, after tierlift's exits) keeps 16 B/param pinned (108 GB, the tightest fit: an
# out-of-memory kill is its row's result); torch's recipe needs 18 B/param (121 GB): left out.
# The NVMe tier does not hold 7B either (24 B/param > the 64 GiB disk).
# GPU: batch 4 x 2048 = 8,192 tokens per step: 4 B/param (27 GB) + activations 61.7 GB by
# activation_bytes() = 88.6 GB of 141. GPU compute ~3.5e14 FLOP a step (~0.9 s at 400 TFLOPS).
# Estimates (warmup 1 + 3 steps): tierlift ~80 s (pinning and zeroing 100 GiB ~40 s, steps ~3 s:
# CPU Adam over 190 GB of state traffic, a third of it during backward); the kernels' GPU tests
# (~30 s: bit for bit against their CPU references before their speed); then the kernel rows,
# optim ~30 s, lowp ~35 s, gather ~40 s (as measured on the H100/H200 runs, plus the profiler
# split, torchao and the gather variants added since): ~215 s for what the issue's "done when"
# needs. DeepSpeed at 7B (~120 s: init, 108 GB of state, steps ~5 s) gets what is left (~130 s),
# tierlift's compact state at 7B, the 7B split and the checkpoint only what remains after it.
# Run it right after stage 2 (the machine keeps the build and DeepSpeed's op while warm).
if [[ $STAGE == 3 ]]; then
  RAM7_JSON=benchmarks/results/bench_offload_finetune-7b-ram-gpu-$GPU.json
  fresh_row "offload 7B ram" "$RAM7_JSON"
  run "offload 7B ram" bench.log 170 "${FT[@]}" --model 7b --tier cpu --overlap --cpu-budget 100 \
    --batch-size 4 --contenders tierlift --steps 3 --warmup 1 --timeout 160 \
    --json-suffix 7b-ram
  ds_check_start 0  # DeepSpeed's CPU Adam (cached on a warm machine) beside the kernel rows
  # the reworked kernels bit for bit against their CPU references first (not run on a GPU
  # since their rework): a speed measured for a kernel that is wrong would be worse than none
  # shellcheck disable=SC2086  # KERNEL_GPU_TESTS: several pytest arguments
  gpu_tests "kernels exact" 45 $KERNEL_GPU_TESTS
  # the kernel rows, each against its target (docs/gpu.md): the fused CUDA AdamW vs torch's
  run optim bench.log 50 $PY benchmarks/bench_optim.py --gpu-only --cuda-sizes 1e8,3e8,1e9
  # where one Float8Linear fwd+bwd spends its time (quantize, GEMM, layout copies, amax/scale:
  # profiler split) for each recipe, tierlift's and torchao's, beside bf16 nn.Linear; then the
  # FP8/FP4 quantize kernels vs D2D copy and the speedups (same process)
  ao_install
  run lowp bench.log 60 $PY benchmarks/bench_lowp.py --device cuda --sizes 8192
  run gather bench.log 60 $PY benchmarks/bench_gather.py --gpu-only --table-mib 1024
  # DeepSpeed at 7B in its own part, after what the issue's "done when" needs: 108 GB pinned is
  # the tightest fit in 128 GiB (an out-of-memory kill is its row's result)
  ds_wait
  if [[ -n $DS ]]; then
    run "offload 7B ram deepspeed" bench.log 160 "${FT[@]}" --model 7b --tier cpu --overlap \
      --cpu-budget 100 --batch-size 4 --contenders deepspeed --steps 3 --warmup 1 --timeout 150 \
      --json-suffix 7b-ram-deepspeed
  else
    note "offload 7B ram deepspeed: left out (DeepSpeed not installed or its CPU Adam not built)"
  fi
  # tierlift's compact state (--state-dtype bf16: fp32 master, bf16 m, 8-bit v; 7.02 B/param):
  # its two generations (88.1 GiB pinned) fit where fp32's do not, so every chunk is stepped
  # during backward; ~35 s of pinning and zeroing, then ~1.5 s steps by arithmetic
  run "offload 7B ram compact" bench.log 100 "${FT[@]}" --model 7b --tier cpu --overlap \
    --state-dtype bf16 --batch-size 4 --contenders tierlift --steps 3 --warmup 1 --timeout 95 \
    --json-suffix 7b-ram-compact
  # as stage 2's split; the fraction read is lowered to what fits the GPU beside 89 GB (at most
  # ~0.45 here)
  run "offload 7B ram split" bench.log 100 "${FT[@]}" --model 7b --tier cpu --overlap \
    --cpu-budget 100 --batch-size 4 --contenders tierlift --steps 3 --warmup 1 --timeout 95 \
    --device-fraction-from "$RAM7_JSON" --json-suffix 7b-ram-split
  # the 1.1B again with clipping at 1.0 (the Hugging Face Trainer's default): every step of a
  # random model clips, so the overlap's speculative chunks are left and Adam runs after
  # backward for both; the fairer DeepSpeed recipe beside it
  run "offload 1B ram clipped" bench.log 150 "${FT[@]}" --model 1b --tier cpu --overlap \
    --batch-size 8 --contenders "tierlift${DS:+,deepspeed-zero2,deepspeed-super}" --steps 3 \
    --warmup 1 --timeout 65 --max-grad-norm 1.0 --json-suffix 1b-ram-clipped
  # stage 2's tierlift row again with its CPU Adam on every thread while backward runs (by
  # default it leaves an eighth of them to the thread that launches the GPU's kernels): its
  # forward+backward and step against stage 2's row say what that share buys
  run "offload 1B ram all threads" bench.log 60 "${FT[@]}" --model 1b --tier cpu --overlap \
    --batch-size 8 --contenders tierlift --steps 3 --warmup 1 --timeout 55 \
    --overlap-threads "$(nproc)" --json-suffix 1b-ram-all-threads
  # background save vs DCP async_save of GPU-resident 1B state, the blocking save last
  run checkpoint bench.log 110 $PY benchmarks/bench_checkpoint.py --device cuda --params 1e9 \
    --ranks 1 --configs ram --contenders background dcp-async sync --repeat 1 --warmup 1 \
    --dir "$SCRATCH" --out benchmarks/results/bench_checkpoint-cuda.json
fi

if [[ $STAGE == 2 || $STAGE == 3 ]]; then
  # each JSON written in this stage, named with the GPU
  find benchmarks/results -name '*.json' -newer "$stamp" | while read -r f; do
    name=$(basename "$f" .json)
    [[ $name == *"$GPU"* ]] || name=$name-gpu-$GPU
    cp "$f" "$OUT/results/$name.json"
  done
fi

if [[ $DRY == 1 ]]; then
  WHEELS=()  # stages 2 and 3 carry DeepSpeed: its wheels must resolve for the GPU's Python
  [[ $STAGE != 1 ]] && WHEELS=(--wheels .devdeps/deepspeed)
  $PY scripts/gpu_check_argv.py "$OUT/dry_commands.txt" "${WHEELS[@]}" | tee -a "$OUT/summary.txt"
  rc=${PIPESTATUS[0]}
  [[ -n ${AO_DRY_PROBLEM:-} ]] && rc=1  # the carried torchao wheel does not fit Python 3.12
  rm -f "$OUT/dry_commands.txt"
  if [[ $STAGE != 1 ]] && ! $PY scripts/gpu_report.py "$OUT" >/dev/null; then
    note "dry run: scripts/gpu_report.py failed on this stage's summary"
    rc=1
  fi
  exit "$rc"
fi
if [[ $STAGE == 2 || $STAGE == 3 ]]; then
  # the tables for docs/gpu.md, each row against its target (JSON and text only: ~0.1 s)
  $PY scripts/gpu_report.py "$OUT" --out "$OUT/report.md" >/dev/null 2>>"$OUT/summary.txt" ||
    note "gpu_report: failed (its error above); the JSONs are under results/"
fi
cat "$OUT/summary.txt"
! grep -q "FAILED\|TIMED OUT" "$OUT/summary.txt"
