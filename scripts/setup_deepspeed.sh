#!/usr/bin/env bash
# DeepSpeed, the offload fine-tune's peer (benchmarks/offload_finetune.py), for its CPU test
# (tests/python/test_bench_deepspeed.py), into a site dir of its own: build/deepspeed-site, put on
# PYTHONPATH by that test only. It gets DeepSpeed (built without ops, DS_BUILD_OPS=0: its CPU Adam
# is JIT-built by the test) and only the dependencies this Python lacks; one that this Python has
# in a version DeepSpeed refuses would shadow it for the other tests, so that is an error, as is
# torch. A re-run with the same version installed does nothing. Run by scripts/setup.sh.
#
#   bash scripts/setup_deepspeed.sh
#
# Where it cannot install (no network, a refused dependency), it says why in
# build/deepspeed-site.failed and exits 0: the rest of the setup goes on, and the test fails with
# that reason instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DS_VERSION=0.19.8
SITE=build/deepspeed-site
FAILED=$SITE.failed
# The stamp names the Python too: the site holds compiled dependencies (msgpack) built for it.
stamp="deepspeed==$DS_VERSION $($PY -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"

if [[ -f $SITE/INSTALLED && $(cat "$SITE/INSTALLED") == "$stamp" ]]; then
  echo "== deepspeed: $stamp already in $SITE"
  rm -f "$FAILED"
  exit 0
fi

echo "== deepspeed: pip install $stamp into $SITE (only what this Python lacks)"
mkdir -p build
rm -f "$FAILED"
tmp=$(mktemp -d build/deepspeed-site.tmp.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "$1" >"$FAILED"
  echo "== WARNING deepspeed NOT installed: $1" >&2
  echo "== (tests/python/test_bench_deepspeed.py fails with this reason until it is)" >&2
  exit 0
}

# No build isolation: DeepSpeed's setup.py records the torch it was built against, and an
# isolated build would have none (or fetch one). DS_BUILD_OPS=0: no op is compiled at install.
export DS_BUILD_OPS=0
pip_args=(-q --disable-pip-version-check --no-build-isolation)
# What pip would install into this Python: DeepSpeed and the dependencies it lacks, or has in a
# version DeepSpeed refuses (refused by deepspeed_need.py, as is torch).
$PY -m pip install "${pip_args[@]}" --dry-run --report "$tmp/report.json" \
  "deepspeed==$DS_VERSION" >"$tmp/pip.log" 2>&1 ||
  fail "pip could not resolve deepspeed==$DS_VERSION (no network?): $(tail -n 3 "$tmp/pip.log")"
need=$($PY scripts/deepspeed_need.py "$tmp/report.json" 2>&1) || fail "$need"

# shellcheck disable=SC2086  # one requirement per word
$PY -m pip install "${pip_args[@]}" --no-deps --target "$tmp/site" $need >"$tmp/pip.log" 2>&1 ||
  fail "pip install --target of $need failed: $(tail -n 3 "$tmp/pip.log")"
echo "$stamp" >"$tmp/site/INSTALLED"
# Swapped in whole: an install cut off half-way leaves no site that looks complete.
rm -rf "$SITE"
mv "$tmp/site" "$SITE"
echo "== deepspeed: installed $need"
