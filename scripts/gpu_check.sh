#!/usr/bin/env bash
# One command for the GPU machine (no network there; see ../shared/GPU.md): unpack the carried
# Debian packages and wheels, build the extension for Hopper, run the GPU tests and each
# benchmark in its GPU mode, and leave logs and JSON results under $OUT (default: ./gpu_out).
#
# Here, once per checkout (keeps .devdeps out of git):
#   echo /.devdeps/ >> .git/info/exclude
#   mkdir -p .devdeps && (cd .devdeps && apt-get download liburing2 liburing-dev)
#   pip wheel --no-deps -w .devdeps deepspeed        # the peer (its ops are JIT-built there)
#   pip download --no-deps -d .devdeps --python-version 3.12 --only-binary=:all: \
#       hjson py-cpuinfo msgpack einops                # DeepSpeed's deps the machine lacks
# Then through the device tool, with carry [".devdeps"]. One device call may run 10 minutes, so
# split the work into stages (the machine keeps the build between calls while it stays warm):
#   GPU_CHECK_STAGES="build tests" bash scripts/gpu_check.sh
#   GPU_CHECK_STAGES="bench" GPU_CHECK_BENCHES="lowp gather optim io zero" bash scripts/gpu_check.sh
#   GPU_CHECK_STAGES="bench" GPU_CHECK_BENCHES="offload" bash scripts/gpu_check.sh
# Defaults: every stage and every benchmark. GPU_CHECK_TESTS="-k adam" narrows pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES=${GPU_CHECK_STAGES:-build tests bench}
BENCHES=${GPU_CHECK_BENCHES:-lowp gather optim io zero offload activations checkpoint}

# Each benchmark's GPU mode (bench_zero_offload is CPU-only: it is not run here).
gpu_args() {
  case "$1" in
    lowp) echo "--device cuda" ;;
    zero) echo "--cuda --nproc $(nvidia-smi -L | wc -l)" ;;
    offload) mkdir -p "$OUT/nvme"; echo "--gpu --dir $OUT/nvme --timeout 270" ;;
    activations) mkdir -p "$OUT/nvme"; echo "--device cuda --layers 16 --dim 2048 --seq-len 4096 --batch 1 --dir $OUT/nvme" ;;
    checkpoint) mkdir -p "$OUT/nvme"; echo "--params 2e8 --ranks 1 --dir $OUT/nvme" ;;
    *) echo "" ;;  # gather, optim, io: they use the GPU when there is one
  esac
}

if ls .devdeps/*.deb >/dev/null 2>&1; then
  for f in .devdeps/*.deb; do dpkg -x "$f" /opt/devdeps; done
  export CPATH=/opt/devdeps/usr/include
  export LIBRARY_PATH=/opt/devdeps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  echo "note: no .devdeps/*.deb carried: building without io_uring" | tee -a "$OUT/summary.txt"
fi
if ls .devdeps/*.whl >/dev/null 2>&1 && ! python3 -c "import deepspeed" 2>/dev/null; then
  python3 -m pip install --no-index --no-deps .devdeps/*.whl >"$OUT/wheels.log" 2>&1 \
    || echo "note: the carried wheels did not install (wheels.log)" | tee -a "$OUT/summary.txt"
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
if [[ " $STAGES " == *" build "* ]]; then
  echo "== build" | tee -a "$OUT/summary.txt"
  TIERLIFT_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
    python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
    || { echo "BUILD FAILED (see build.log)" | tee -a "$OUT/summary.txt"; tail -40 "$OUT/build.log"; exit 1; }
fi
python3 -m tierlift info | tee -a "$OUT/summary.txt"

if [[ " $STAGES " == *" tests "* ]]; then
  echo "== GPU tests" | tee -a "$OUT/summary.txt"
  python3 -m pytest -q -ra -m gpu tests/python ${GPU_CHECK_TESTS:-} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
  tail -1 "$OUT/pytest_gpu.log" >> "$OUT/summary.txt"
fi

if [[ " $STAGES " == *" bench "* ]]; then
  echo "== GPU benchmarks: $BENCHES" | tee -a "$OUT/summary.txt"
  for name in $BENCHES; do
    bench=benchmarks/bench_$name.py
    echo "-- $bench $(gpu_args "$name")" | tee -a "$OUT/summary.txt"
    # shellcheck disable=SC2046
    timeout 570 python3 "$bench" $(gpu_args "$name") 2>&1 | tee "$OUT/bench_$name.log" | tail -20
  done
  cp benchmarks/results/*.json "$OUT/" 2>/dev/null || true
fi
cat "$OUT/summary.txt"
