#!/usr/bin/env bash
# Builds tierlift's extension here, ahead, for the GPU machine (Python 3.12, torch 2.11.0 with
# CUDA 13.0, sm_90, io_uring), so that scripts/gpu_check.sh does not spend that machine's first
# minute building it. The result goes to .devdeps/prebuilt (carried with .devdeps): the stripped
# extension and a manifest of the sources, Python and torch it was built from
# (scripts/gpu_prebuilt.py); gpu_check.sh uses it only where all three match there, else builds
# from source as before. Rerun after any change under csrc/ or to setup.py (the dry run of
# gpu_check.sh warns when it is stale).
#
#   bash scripts/prebuild_gpu.sh    8 s when built before (ccache), 3 min 51 s cold on 2 cores
#
# Needs a Python 3.12 (PY312, else pyenv's, else python3.12 on PATH; exit 3 without one), nvcc
# 13.x (torch's CUDA major must match) and liburing-dev; torch 2.11.0 and its CUDA wheels go into
# a virtual environment of their own under build/ (~5 GB, once; 55 s from pip's cache).
# DeepSpeed's ops are not built here: its CPU Adam compiles for the CPU it builds on
# (-march=native, its SIMD width), so it builds on the GPU machine, as its users' does.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.11.0}  # the GPU machine's (../shared/GPU.md)
ENV=build/gpu-prebuild-env
WORK=build/gpu-prebuild
OUT_DIR=.devdeps/prebuilt

# The first Python 3.12 that runs (a pyenv shim named python3.12 may exist and refuse to).
py312=
for c in ${PY312:-} "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/3.12.*/bin/python3 \
  python3.12; do
  if "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    py312=$c
    break
  fi
done
[[ -n $py312 ]] || { echo "prebuild_gpu: no Python 3.12 here (set PY312)" >&2; exit 3; }
[[ -x $ENV/bin/python ]] || "$py312" -m venv "$ENV"
if ! "$ENV/bin/python" -c "import torch, sys
sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "prebuild_gpu: installing torch $TORCH_VERSION into $ENV (once)"
  "$ENV/bin/pip" install -q "torch==$TORCH_VERSION" numpy ninja setuptools wheel
fi
cuda=$("$ENV/bin/python" -c "import torch; print(torch.version.cuda)")
nvcc_version=$(nvcc --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
[[ ${cuda%%.*} == "${nvcc_version%%.*}" ]] || {
  echo "prebuild_gpu: torch's CUDA $cuda and nvcc $nvcc_version differ in major" >&2; exit 1; }

t0=$SECONDS
# out of place: the tree's own build (this machine's Python) stays as it is
env PATH="$PWD/$ENV/bin:$PATH" TIERLIFT_CUDA=1 TIERLIFT_URING=1 TORCH_CUDA_ARCH_LIST=9.0 \
  MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$ENV/bin/python" setup.py -q build_ext \
  --build-temp "$WORK/temp" --build-lib "$WORK/lib"
so=$(ls "$WORK"/lib/tierlift/_C.cpython-312-*.so)
rm -rf "$OUT_DIR" && mkdir -p "$OUT_DIR"
strip -g -o "$OUT_DIR/$(basename "$so")" "$so"
"$ENV/bin/python" scripts/gpu_prebuilt.py record "$OUT_DIR"
# The package with the carried extension beside it (scripts/test_torch211.sh tests it too): it
# must load beside that torch (no GPU needed) and hold the CUDA kernels and the io_uring engine.
PKG=$WORK/python
rm -rf "$PKG" && mkdir -p "$PKG" && cp -r python/tierlift "$PKG/"
find "$PKG" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
cp "$OUT_DIR"/_C.*.so "$PKG/tierlift/"
PYTHONPATH=$PWD/$PKG "$ENV/bin/python" -c '
import torch, tierlift._C  # the loader says why where it does not load
import tierlift
assert tierlift._extension.has_cuda_kernels(), "the prebuilt extension has no CUDA kernels"
assert tierlift._extension.has_uring(), "the prebuilt extension has no io_uring engine"
print("prebuild_gpu: it loads under torch", torch.__version__)'
echo "prebuild_gpu: $OUT_DIR in $((SECONDS - t0)) s:"
ls -l "$OUT_DIR"
cat "$OUT_DIR/manifest.json"
