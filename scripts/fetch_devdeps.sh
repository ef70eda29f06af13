#!/usr/bin/env bash
# Fetches what scripts/gpu_check.sh carries to the GPU machine, which has no network, into
# .devdeps (ignored by git, so once per checkout; a re-run fetches only what is missing):
#   - the liburing and libaio debs: io_uring headers for tierlift's build there, libaio for
#     DeepSpeed's async_io op (its NVMe contender);
#   - the pytest-timeout and expecttest wheels (the GPU tests' per-test limit; torch.testing's
#     optimizer configurations import expecttest);
#   - .devdeps/deepspeed: DeepSpeed built here without ops (DS_BUILD_OPS=0: its CPU Adam and
#     async_io build there, for that CPU) and the dependencies torch's environment there lacks,
#     as wheels for its Python 3.12 (numpy, the last one, is there with torch-geometric);
#   - .devdeps/torchao: torchao 0.17.0 (the release built for torch 2.11), its pure-Python wheel:
#     float8 training uses none of torchao's compiled kernels.
# Then, before the device calls: bash scripts/prebuild_gpu.sh (.devdeps/prebuilt).
#
#   bash scripts/fetch_devdeps.sh
#
# Ends with the list of what .devdeps holds and `GPU_CHECK_DRY=1 bash scripts/gpu_check.sh 2`'s
# summary, which says what the GPU run would leave out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DS_VERSION=0.19.8
AO_VERSION=0.17.0
DIR=.devdeps
mkdir -p "$DIR/deepspeed" "$DIR/torchao"
pip_q=(-q --disable-pip-version-check)

have() { compgen -G "$1" >/dev/null; }

debs=()
for pkg in liburing2 liburing-dev libaio1 libaio-dev; do
  have "$DIR/${pkg}_*.deb" || debs+=("$pkg")
done
if ((${#debs[@]})); then
  echo "== apt-get download ${debs[*]}"
  (cd "$DIR" && apt-get download "${debs[@]}")
fi

for whl in pytest_timeout expecttest; do
  have "$DIR/$whl-*.whl" && continue
  echo "== pip download ${whl//_/-}"
  $PY -m pip download "${pip_q[@]}" --no-deps --only-binary=:all: -d "$DIR" "${whl//_/-}"
done

if ! have "$DIR/deepspeed/deepspeed-$DS_VERSION-*.whl"; then
  echo "== pip wheel deepspeed==$DS_VERSION (DS_BUILD_OPS=0: no op compiled here)"
  DS_BUILD_OPS=0 $PY -m pip wheel "${pip_q[@]}" --no-deps -w "$DIR/deepspeed" \
    "deepspeed==$DS_VERSION"
fi
# pip skips what the folder already holds; the tags are the GPU machine's Python 3.12.
echo "== pip download DeepSpeed's dependencies for Python 3.12"
$PY -m pip download "${pip_q[@]}" -d "$DIR/deepspeed" --only-binary=:all: --implementation cp \
  --python-version 3.12 --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  einops hjson msgpack ninja psutil py-cpuinfo pydantic tqdm packaging

if ! have "$DIR/torchao/torchao-$AO_VERSION-*.whl"; then
  echo "== pip download torchao==$AO_VERSION"
  $PY -m pip download "${pip_q[@]}" --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation py --abi none --platform any -d "$DIR/torchao" "torchao==$AO_VERSION"
fi

echo "== $DIR holds ($(du -sh "$DIR" | cut -f1)):"
(cd "$DIR" && find . -type f \( -name '*.deb' -o -name '*.whl' \) | sort)
echo "== GPU_CHECK_DRY=1 bash scripts/gpu_check.sh 2"
dry_out=$(mktemp -d)
trap 'rm -rf "$dry_out"' EXIT
OUT=$dry_out GPU_CHECK_DRY=1 bash scripts/gpu_check.sh 2 >/dev/null 2>&1 || {
  cat "$dry_out/summary.txt"
  echo "fetch_devdeps: the dry run of stage 2 found problems (above)" >&2
  exit 1
}
cat "$dry_out/summary.txt"
