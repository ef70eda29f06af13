"""A resume keeps each parameter's own step count: the "gap" plan of test_zero_unused (l1.extra
skips the second step, l2.extra every step, so their Adam bias correction differs from their
shard's) saved after two steps and resumed for two more, against torch's AdamW on the unsharded
model (which saves a per-parameter "step"): through tierlift.checkpoint (same world size, and
resharded from 2 ranks to 1) and through optimizer.state_dict() with full_state_dict. A state
without the counts where the model's units lag is refused before anything changes; a
checkpoint saved without them (as before they were saved) still loads. The counts never sit in
optimizer.state (whose values stay tensors and numbers), and tierlift's offloaded AdamW, whose
load drops keys it does not know, gets them too: a resumed run refuses what the original one
would."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_zero_unused import OPT, PLANS, _data, _make, _max_rel, _train
from zero_model import raised, spawn_ranks

import tierlift
from tierlift.checkpoint import io as ckpt_io
from tierlift.zero import unused

PLAN = PLANS["gap"]
UNITS = ["l1", "l2", "head"]
XS = _data(len(PLAN))


def _sharded(stage: int = 2):
    model = tierlift.zero.shard(_make(), stage=stage, units=UNITS)
    return model, torch.optim.AdamW(model.parameters(), **OPT)


def _reference() -> dict:
    ref = _make()
    _train(ref, torch.optim.AdamW(ref.parameters(), **OPT), XS, PLAN, 2)
    return ref.state_dict()


def _cases(rank: int, world: int, tmp: str) -> dict:
    ref, out = _reference(), {}
    model, opt = _sharded()
    _train(model, opt, XS[:2], PLAN[:2], world, rank)
    tierlift.checkpoint.save(os.path.join(tmp, "ckpt"), model, opt)
    with pytest.MonkeyPatch.context() as mp:  # as saved before the counts were
        mp.setattr(ckpt_io, "_counts", lambda unit, optimizer: {})
        tierlift.checkpoint.save(os.path.join(tmp, "old"), model, opt)
    sd, weights = opt.state_dict(), tierlift.zero.full_state_dict(model)
    out["carried"] = sorted(i for i, st in sd["state"].items() if unused.KEY in st)

    for name in ("ckpt", "old"):
        m2, o2 = _sharded()
        tierlift.checkpoint.load(os.path.join(tmp, name), m2, o2)
        out[f"{name}/plain"] = _plain(o2)
        _train(m2, o2, XS[2:], PLAN[2:], world, rank)
        out[name] = _max_rel(tierlift.zero.full_state_dict(m2), ref)

    m3, o3 = _sharded()
    tierlift.zero.load_full_state_dict(m3, weights)
    o3.load_state_dict(torch.load(_saved(sd, tmp, rank), weights_only=True))
    out["state_dict/plain"] = _plain(o3)
    _train(m3, o3, XS[2:], PLAN[2:], world, rank)
    out["state_dict"] = _max_rel(tierlift.zero.full_state_dict(m3), ref)

    # Without the counts, into the optimizer whose units lag: refused before loading.
    bare = {**sd, "state": {i: {k: v for k, v in st.items() if k != unused.KEY}
                            for i, st in sd["state"].items()}}
    before = {i: {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
              for i, st in opt.state_dict()["state"].items()}
    out["refused_load"] = raised(lambda: opt.load_state_dict(bare))
    now = opt.state_dict()["state"]
    out["refused_load/unchanged"] = all(torch.equal(v, now[i][k]) for i, st in before.items()
                                        for k, v in st.items())
    # ... and into a new optimizer of a model whose units lag: its first step is refused.
    o4 = torch.optim.AdamW(model.parameters(), **OPT)
    o4.load_state_dict(bare)
    w = [p.detach().clone() for p in model.parameters()]
    out["refused_step"] = raised(lambda: _train(model, o4, XS[2:3], PLAN[2:3], world, rank))
    out["refused_step/unchanged"] = all(torch.equal(a, b) for a, b in
                                        zip(w, model.parameters(), strict=True))
    return out


def _plain(opt) -> bool:
    """optimizer.state holds tensors and numbers only: the counts went onto the units."""
    return all(torch.is_tensor(v) or isinstance(v, (int, float))
               for st in opt.state.values() for v in st.values())


def _saved(sd: dict, tmp: str, rank: int) -> str:
    """Through torch.save and a weights-only load, as a user saves it."""
    f = os.path.join(tmp, f"optim{rank}.pt")
    torch.save(sd, f)
    return f


def _resharded(rank: int, world: int, tmp: str) -> dict:
    """The world-2 checkpoint on one rank, which computes both ranks' halves (the same
    gradient)."""
    model, opt = _sharded()
    tierlift.checkpoint.load(os.path.join(tmp, "ckpt"), model, opt)
    _train(model, opt, XS[2:], PLAN[2:], 2)
    return {"resharded": _max_rel(tierlift.zero.full_state_dict(model), _reference())}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero_unused_resume"))
    out = spawn_ranks(_cases, tmp)
    with open(os.path.join(tmp, "ckpt", "metadata.json")) as f:
        lags = [u.get("lag") for u in json.load(f)["units"]]
    return out, lags, spawn_ranks(_resharded, tmp, world=1)[0]


def test_checkpoint_records_counts_only_where_they_differ(ranks):
    _, lags, _ = ranks
    # after [U, U], [N, N]: l1.extra skipped once; l2.extra never stepped (rank 1 never uses it)
    assert lags == [{"lag": [0, 0, 1, 1], "stepped": [True, True, True, True]},
                    {"lag": [0, 0, 2, 2], "stepped": [True, True, False, False]}, None]


@pytest.mark.parametrize("path", ["ckpt", "state_dict"])
def test_resume_steps_as_torch(ranks, path):
    for out in ranks[0]:
        assert out[path] < 1e-5, out
        assert out[f"{path}/plain"], out
        assert out["carried"] == [0, 1]


def test_resume_across_world_sizes_steps_as_torch(ranks):
    assert ranks[2]["resharded"] < 1e-5


def test_checkpoint_without_counts_still_loads(ranks):
    for out in ranks[0]:
        assert out["old"] > 1e-4  # each parameter at its shard's count, as before


def test_state_without_counts_refused_where_units_lag(ranks):
    for out in ranks[0]:
        for key in ("refused_load", "refused_step"):
            msg = out[key]
            assert msg.startswith("RuntimeError:") and unused.KEY in msg, msg
            assert "l1.extra.weight" in msg and "tierlift.checkpoint" in msg, msg
            assert out[f"{key}/unchanged"]


def _offloaded(stage: int):
    model = tierlift.zero.shard(_make(), stage=stage, units=UNITS)
    return model, tierlift.optim.AdamW(model.parameters(), offload="cpu", **OPT)


@pytest.mark.parametrize("path", ["ckpt", "state_dict"])
def test_offloaded_resume_keeps_counts(tmp_path, path):
    """One rank, l1.extra and l2.extra never used for two steps: their counts lag, so the
    offloaded optimizer (which cannot correct a count) refuses a step that uses l1.extra. The
    resumed run refuses it too (dropping the counts would step it at the shard's count)."""
    plan, later = [[(False, False)]] * 2, [[(True, False)]]
    model, opt = _offloaded(2)
    _train(model, opt, XS[:2], plan)
    tierlift.checkpoint.save(str(tmp_path / "ck"), model, opt)
    sd, weights = opt.state_dict(), tierlift.zero.full_state_dict(model)
    m2, o2 = _offloaded(2)
    if path == "ckpt":
        tierlift.checkpoint.load(str(tmp_path / "ck"), m2, o2)
    else:
        tierlift.zero.load_full_state_dict(m2, weights)
        o2.load_state_dict(sd)
    assert _plain(o2)
    assert unused.KEY not in str(o2.state_dict()["state"][2])  # head: nothing lags
    assert torch.equal(o2.state_dict()["state"][0][unused.KEY], sd["state"][0][unused.KEY])
    for m, o in ((model, opt), (m2, o2)):
        w = [p.detach().clone() for p in m.parameters()]
        msg = raised(lambda m=m, o=o: _train(m, o, XS[2:3], later))
        assert msg.startswith("RuntimeError:") and "l1.extra.weight" in msg, msg
        assert "lag the shard's" in msg, msg
        assert all(torch.equal(a, b) for a, b in zip(w, m.parameters(), strict=True))
