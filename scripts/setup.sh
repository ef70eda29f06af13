#!/usr/bin/env bash
# Installs everything tierlift needs on a fresh Debian machine (apt + pip) and builds it in
# place (editable). Safe to re-run: installed packages are skipped, the build reuses ccache.
#
#   bash scripts/setup.sh
#
# Environment: TIERLIFT_TORCH (pip spec for torch, default torch==2.15.0), plus the build
# switches documented at the top of setup.py (TIERLIFT_CUDA, TORCH_CUDA_ARCH_LIST, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

# libaio-dev: DeepSpeed's async_io op (its NVMe contender in tests/python/test_bench_deepspeed.py)
APT_PACKAGES=(build-essential cmake ninja-build ccache clang-format liburing-dev libgtest-dev
  libbenchmark-dev fio libaio-dev)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== apt-get install ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
echo "== pip install torch and test dependencies"
$PY -m pip install -q --disable-pip-version-check "${TIERLIFT_TORCH:-torch==2.15.0}" \
  numpy tqdm pytest expecttest ninja setuptools wheel ruff torch-geometric transformers accelerate \
  peft safetensors matplotlib trl

# DeepSpeed, the offload benchmark's peer, into build/deepspeed-site for its CPU test only.
bash scripts/setup_deepspeed.sh

echo "== build tierlift (pip install --no-build-isolation -e .)"
MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps -e .
$PY -m tierlift info
