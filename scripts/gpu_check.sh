#!/usr/bin/env bash
# One command for the GPU machine (no network there; see ../shared/GPU.md): unpack the carried
# Debian packages, build the extension for Hopper, run the GPU tests and the GPU benchmarks, and
# leave logs and JSON results under $OUT (default: ./gpu_out).
#
# Here, once per checkout (keeps .devdeps out of git):
#   echo /.devdeps/ >> .git/info/exclude
#   mkdir -p .devdeps && (cd .devdeps && apt-get download liburing2 liburing-dev)
# Then through the device tool: run `bash scripts/gpu_check.sh` with carry [".devdeps"].
#
# GPU_CHECK_BENCH=0 skips the benchmarks; GPU_CHECK_TESTS="-k adam" narrows pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if ls .devdeps/*.deb >/dev/null 2>&1; then
  for f in .devdeps/*.deb; do dpkg -x "$f" /opt/devdeps; done
  export CPATH=/opt/devdeps/usr/include
  export LIBRARY_PATH=/opt/devdeps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  echo "note: no .devdeps/*.deb carried: building without io_uring" | tee -a "$OUT/summary.txt"
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
echo "== build" | tee -a "$OUT/summary.txt"
TIERLIFT_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
  python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
  || { echo "BUILD FAILED (see build.log)" | tee -a "$OUT/summary.txt"; tail -40 "$OUT/build.log"; exit 1; }
python3 -m tierlift info | tee -a "$OUT/summary.txt"

echo "== GPU tests" | tee -a "$OUT/summary.txt"
python3 -m pytest -q -ra -m gpu tests/python ${GPU_CHECK_TESTS:-} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
tail -1 "$OUT/pytest_gpu.log" >> "$OUT/summary.txt"

if [ "${GPU_CHECK_BENCH:-1}" = "1" ]; then
  echo "== GPU benchmarks" | tee -a "$OUT/summary.txt"
  for bench in benchmarks/bench_*.py; do
    echo "-- $bench" | tee -a "$OUT/summary.txt"
    timeout 300 python3 "$bench" 2>&1 | tee "$OUT/$(basename "$bench" .py).log" | tail -20
  done
  cp benchmarks/results/*gpu*.json "$OUT/" 2>/dev/null || true
fi
cat "$OUT/summary.txt"
