"""The Adam ops' out-of-place sources (`params_from`, `exp_avgs_from`, ...): the CPU op reads the
old weights and moments there and writes the new ones to params/exp_avgs/...; bit for bit the
in-place step, for fp32 and compact state, amsgrad, bf16 gradients and copies, a GradScaler
scale; the sources are left as they were, and so is the reference. What is refused (a partial
overlap, a wrong length, dtype or numel, refresh_from_copies with params_from) is refused before
anything changes. The offloaded step relies on it (offload/runner.py: _run_direct). The SIMD
paths one by one: tests/cpp/test_adam_out_of_place.cc."""

from __future__ import annotations

import pytest
import torch

import tierlift
from tierlift import ops, reference

needs_ext = pytest.mark.skipif(not tierlift._extension.available(), reason="needs the extension")
SIZES = [1, 300, 1031, 70000]
KW = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
          maximize=False)


def bits(t):
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def state(compact: bool, amsgrad: bool, grad_dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    s = dict(p=[torch.randn(n, generator=gen) for n in SIZES],
             g=[(torch.randn(n, generator=gen) * 1e-2).to(grad_dtype) for n in SIZES])
    if compact:
        s["m"] = [(torch.randn(n, generator=gen) * 1e-2).bfloat16() for n in SIZES]
        v = [torch.rand(n, generator=gen) * 1e-4 for n in SIZES]
        q = [reference.optim_compact.quantize_exp_avg_sq(x) for x in v]
        s["v"] = [c for c, _ in q]
        s["x"] = [sc for _, sc in q]  # the scales
    else:
        s["m"] = [torch.randn(n, generator=gen) * 1e-2 for n in SIZES]
        s["v"] = [torch.rand(n, generator=gen) * 1e-4 for n in SIZES]
        s["x"] = [t * 2 for t in s["v"]] if amsgrad else []  # max_exp_avg_sq
    s["c"] = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    return s


def clone(s: dict) -> dict:
    return {k: [t.clone() for t in v] for k, v in s.items()}


def garbage(s: dict) -> dict:
    """Destinations of the same shapes and dtypes, full of values the step must overwrite."""
    out = {}
    for k, v in s.items():
        out[k] = [torch.full_like(t, 3) if t.is_floating_point() else torch.full_like(t, 7)
                  for t in v]
    out["g"] = s["g"]
    return out


def run(fn, dst: dict, compact: bool, amsgrad: bool, src: dict | None = None, **extra):
    kw = dict(KW, step=3, **extra)
    if src is not None:
        kw.update(params_from=src["p"], exp_avgs_from=src["m"], exp_avg_sqs_from=src["v"])
        kw["exp_avg_sq_scales_from" if compact else "max_exp_avg_sqs_from"] = (
            src["x"] if (compact or amsgrad) else None)
    if compact:
        fn(dst["p"], dst["g"], dst["m"], dst["v"], dst["x"], dst["c"], **kw)
    else:
        fn(dst["p"], dst["g"], dst["m"], dst["v"], dst["x"], dst["c"], amsgrad=amsgrad, **kw)


def compact_ops(compact: bool):
    if compact:
        return ops.adam_compact_step_, reference.adam_compact_step_
    return ops.adam_step_, reference.adam_step_


def assert_same(a: dict, b: dict, keys) -> None:
    for k in keys:
        for x, y in zip(a[k], b[k]):
            assert torch.equal(bits(x), bits(y)), k


CASES = [(False, False), (False, True), (True, False)]
IDS = ["fp32", "fp32-amsgrad", "compact"]


@needs_ext
@pytest.mark.parametrize("compact,amsgrad", CASES, ids=IDS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
def test_out_of_place_is_the_in_place_step(compact, amsgrad, grad_dtype, scaled):
    kernel, ref = compact_ops(compact)
    extra = {"grad_scale": torch.tensor([1024.0])} if scaled else {}
    keys = ["p", "m", "v", "c"] + (["x"] if compact or amsgrad else [])
    src = state(compact, amsgrad, grad_dtype)
    before = clone(src)
    in_place = clone(src)
    run(kernel, in_place, compact, amsgrad, **extra)
    for fn in (kernel, ref):
        dst = garbage(src)
        run(fn, dst, compact, amsgrad, src=src, **extra)
        assert_same(in_place, dst, keys)
        assert_same(before, src, keys)  # the sources are only read
    # A source that is its destination is an in-place step.
    same = clone(src)
    run(kernel, same, compact, amsgrad, src=same, **extra)
    assert_same(in_place, same, keys)


@needs_ext
@pytest.mark.parametrize("compact", [False, True], ids=["fp32", "compact"])
def test_bad_sources_are_refused_before_any_change(compact):
    kernel, ref = compact_ops(compact)
    src = state(compact, False, torch.float32)
    dst = garbage(src)
    keep = clone(dst)
    big = torch.randn(2 * SIZES[-1])
    partial = clone(src)
    partial["p"][-1] = big[:SIZES[-1]]
    dst_overlap = garbage(src)
    dst_overlap["p"][-1] = big[SIZES[-1] // 2:SIZES[-1] // 2 + SIZES[-1]]
    bad = {
        "partly overlaps": (partial, dst_overlap),
        "one tensor per param": ({**src, "p": src["p"][:-1]}, dst),
        "elements": ({**src, "m": src["m"][:-1] + [src["m"][-1][:-1]]}, dst),
        "must be": ({**src, "p": [p.double() for p in src["p"]]}, dst),
    }
    for match, (s, d) in bad.items():
        keep_d = clone(d)
        with pytest.raises((ValueError, TypeError), match=match):
            run(kernel, d, compact, False, src=s)
        assert_same(keep_d, d, ["p", "m", "v"])
    with pytest.raises(ValueError, match="refresh_from_copies"):
        run(kernel, dst, compact, False, src=src, refresh_from_copies=True)
    with pytest.raises(ValueError, match="refresh_from_copies"):
        run(ref, dst, compact, False, src=src, refresh_from_copies=True)
    assert_same(keep, dst, ["p", "m", "v"])


@pytest.mark.parametrize("compact", [False, True], ids=["fp32", "compact"])
def test_a_later_bad_source_is_refused_before_params_from_is_read(compact):
    """Every source list is checked before any is copied: a short exp_avg_sqs_from leaves the
    destinations as they were, params included (params_from comes first in the list)."""
    kernel, ref = compact_ops(compact)
    src = state(compact, False, torch.float32)
    short = {**src, "v": src["v"][:-1]}
    for fn in [ref] + ([kernel] if tierlift._extension.available() else []):
        dst = garbage(src)
        keep = clone(dst)
        with pytest.raises(ValueError, match="exp_avg_sqs_from must be None or hold one tensor "
                                             "per param, got 3 for 4"):
            run(fn, dst, compact, False, src=short)
        assert_same(keep, dst, ["p", "m", "v", "x"])


@pytest.mark.parametrize("compact", [False, True], ids=["fp32", "compact"])
def test_short_param_copies_are_refused_like_the_compiled_ops(compact):
    """One param_copies tensor missing: refused before any change, by the reference as by the
    compiled ops (it used to step the others and leave the last param's copy unwritten)."""
    kernel, ref = compact_ops(compact)
    src = state(compact, False, torch.float32)
    for fn in [ref] + ([kernel] if tierlift._extension.available() else []):
        dst = garbage(src)
        dst["c"] = dst["c"][:-1]
        keep = clone(dst)
        with pytest.raises((ValueError, RuntimeError), match="param_copies must be empty or one "
                                                             "per param"):
            run(fn, dst, compact, False)
        assert_same(keep, dst, ["p", "m", "v", "x", "c"])


@needs_ext
@pytest.mark.parametrize("compact", [False, True], ids=["fp32", "compact"])
def test_opcheck_out_of_place(compact):
    src = state(compact, False, torch.float32)
    dst = garbage(src)
    op = torch.ops.tierlift.adam_compact_step_ if compact else torch.ops.tierlift.adam_step_
    flags = (True, False) if compact else (True, False, False)
    names = ("params_from", "exp_avgs_from", "exp_avg_sqs_from",
             "exp_avg_sq_scales_from" if compact else "max_exp_avg_sqs_from")
    lists = (src["p"], src["m"], src["v"], src["x"] if compact else None)
    torch.library.opcheck(
        op.default,
        (dst["p"], dst["g"], dst["m"], dst["v"], dst["x"], dst["c"], 1e-2, 0.9, 0.999, 1e-8, 0.1,
         1, *flags), {k: v for k, v in zip(names, lists) if v is not None})
