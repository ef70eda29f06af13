"""Weights set through `.data` on a sharded model (2 gloo ranks, stages 1/2/3, fp32 and
MixedPrecision(param_dtype=bf16)), each against one process doing the same to the plain model:

- through the shards (model.parameters()): `p.data.copy_(x)`, `p.data = x`,
  torch.nn.utils.vector_to_parameters, and an EMA swap-in / swap-back (`saved = p.data;
  p.data = ema; ...; p.data = saved`) reach the masters and the next forward;
- model.load_state_dict of edited full weights, likewise;
- through a module attribute (`model.l1.fc.weight.data = x`), which is a view of the gathered
  weights put back at every forward: refused at the next forward or full_state_dict, before
  anything changes, and fine again once set back;
- in place through a module attribute's .data (`model.l1.fc.weight.data.mul_(0.5)`): exact in
  fp32 (the attribute holds the masters), refused with bf16 compute (a copy), as an in-place
  edit of the attribute itself is."""

from __future__ import annotations

import pytest
import torch
from test_zero_unused import _make
from zero_model import raised, spawn_ranks

import tierlift

BF16 = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16)
USE = (True, True)
MODES = [(s, p) for s in (1, 2, 3) for p in ("fp32", "bf16")]


def _half(t: torch.Tensor) -> torch.Tensor:
    return t.detach() * 0.5


def _copy(m):
    for p in m.parameters():
        p.data.copy_(_half(p))


def _assign(m):
    for p in m.parameters():
        p.data = _half(p)


def _vector(m):
    v = torch.nn.utils.parameters_to_vector(m.parameters())
    torch.nn.utils.vector_to_parameters(v * 0.5, m.parameters())


def _load(m):
    m.load_state_dict({k: v * 0.5 for k, v in tierlift.zero.full_state_dict(m).items()})


IDIOMS = {"copy": _copy, "assign": _assign, "vector": _vector, "load_state_dict": _load}


def _shard(stage: int, precision: str):
    mp = BF16 if precision == "bf16" else None
    return tierlift.zero.shard(_make(), stage=stage, mixed_precision=mp, units=["l1", "l2", "head"])


def _rel(y: torch.Tensor, want: torch.Tensor) -> float:
    return float((y.detach().float() - want).abs().max() / want.abs().max())


def _sd_err(sd: dict, ref: dict) -> float:
    return max(float((sd[k] - v).abs().max()) for k, v in ref.items())


def _cases(rank: int, world: int, tmp: str) -> dict:
    out = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    plain = _make()
    halved = _make()
    with torch.no_grad():
        for p in halved.parameters():
            p.mul_(0.5)
    want, want_half = plain(x, USE).detach(), halved(x, USE).detach()
    for stage, precision in MODES:
        xin = x.to(torch.bfloat16) if precision == "bf16" else x
        for name, idiom in IDIOMS.items():
            model = _shard(stage, precision)
            model(xin, USE)  # gathered, as in training
            with torch.no_grad():
                idiom(model)
            key = f"{name}/s{stage}/{precision}"
            out[key] = (
                _rel(model(xin, USE), want_half),
                _sd_err(tierlift.zero.full_state_dict(model), halved.state_dict()),
            )
        # EMA swap-in and back through the shards, as EMA helpers over model.parameters() do.
        model = _shard(stage, precision)
        model(xin, USE)
        ema = [_half(p) for p in model.parameters()]
        saved = [p.data for p in model.parameters()]
        for p, e in zip(model.parameters(), ema, strict=True):
            p.data = e
        swapped = _rel(model(xin, USE), want_half)
        for p, s in zip(model.parameters(), saved, strict=True):
            p.data = s
        out[f"ema/s{stage}/{precision}"] = (
            swapped,
            _rel(model(xin, USE), want),
            _sd_err(tierlift.zero.full_state_dict(model), plain.state_dict()),
        )
        # A module attribute given other data: refused, nothing changed, fine once set back.
        model = _shard(stage, precision)
        model(xin, USE)
        w = model.l1.fc.weight
        before = w.data if stage < 3 else None
        w.data = torch.zeros(w.shape, dtype=w.dtype)
        calls = {
            "forward": lambda m=model, xin=xin: m(xin, USE),
            "full_state_dict": lambda m=model: tierlift.zero.full_state_dict(m),
        }
        for then, call in calls.items():
            out[f"attr/s{stage}/{precision}/{then}"] = raised(call)
        masters = [p.detach().clone() for p in model.parameters()]
        if stage < 3:
            w.data = before
        else:  # the stand-in of a freed stage-3 weight: put back by hand
            model._tierlift_zero.units[0].install_freed()
        out[f"attr/s{stage}/{precision}/after"] = (
            _rel(model(xin, USE), want),
            all(torch.equal(a, b) for a, b in zip(masters, model.parameters(), strict=True)),
        )
    # In place through a module attribute's .data: exact in fp32 (the attribute holds the
    # masters), refused with bf16 compute (a copy); a read through .data is no edit.
    plain_w = _make()
    with torch.no_grad():
        plain_w.l1.fc.weight.mul_(0.5)
    want_w = plain_w(x, USE).detach()
    for stage, precision in [m for m in MODES if m[0] < 3]:
        xin = x.to(torch.bfloat16) if precision == "bf16" else x
        model = _shard(stage, precision)
        model(xin, USE)
        float(model.l1.fc.weight.data.norm())
        model.l1.fc.weight.data.mul_(0.5)
        key = f"attr_copy/s{stage}/{precision}"
        if precision == "fp32":
            out[key] = _rel(model(xin, USE), want_w)
        else:
            out[key] = raised(lambda m=model, xin=xin: m(xin, USE))
    model = _shard(2, "bf16")
    model(x.to(torch.bfloat16), USE)
    float(model.l1.fc.weight.data.norm())
    out["attr_read"] = raised(lambda m=model: m(x.to(torch.bfloat16), USE))
    model = _shard(2, "fp32")
    p = next(model.parameters())
    out["wrong_dtype"] = raised(lambda: setattr(p, "data", p.detach().double()))
    out["wrong_dtype/unchanged"] = p.dtype == torch.float32
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_data_swap")))


def _tol(precision: str) -> float:
    return 2e-2 if precision == "bf16" else 1e-6


@pytest.mark.parametrize(("stage", "precision"), MODES)
@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_data_write_through_shards_reaches_masters_and_forward(ranks, idiom, stage, precision):
    for out in ranks:
        fwd, sd = out[f"{idiom}/s{stage}/{precision}"]
        assert fwd < _tol(precision) and sd == 0.0, (fwd, sd)


@pytest.mark.parametrize(("stage", "precision"), MODES)
def test_ema_swap_in_and_back_through_shards(ranks, stage, precision):
    for out in ranks:
        swapped, back, sd = out[f"ema/s{stage}/{precision}"]
        assert swapped < _tol(precision) and back < _tol(precision) and sd == 0.0


@pytest.mark.parametrize(("stage", "precision"), MODES)
@pytest.mark.parametrize("then", ["forward", "full_state_dict"])
def test_attribute_given_other_data_refused(ranks, stage, precision, then):
    for out in ranks:
        msg = out[f"attr/s{stage}/{precision}/{then}"]
        assert msg.startswith("RuntimeError:") and "l1.fc.weight" in msg, msg
        assert "`.data = ...`" in msg and "model.parameters()" in msg, msg
        fwd, unchanged = out[f"attr/s{stage}/{precision}/after"]
        assert unchanged and fwd < _tol(precision)


def test_shard_data_of_another_dtype_refused(ranks):
    for out in ranks:
        assert out["wrong_dtype"].startswith("ValueError:") and "copy_" in out["wrong_dtype"]
        assert out["wrong_dtype/unchanged"]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_attribute_data_edit_exact_in_fp32_refused_in_bf16(ranks, stage, precision):
    for out in ranks:
        got = out[f"attr_copy/s{stage}/{precision}"]
        if precision == "fp32":
            assert got < 1e-6
        else:
            assert got.startswith("RuntimeError:") and "(or its .data)" in got, got
        assert out["attr_read"] == "<no error>"
