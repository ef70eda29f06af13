"""ZeRO over tierlift's offloaded AdamW where a parameter of a unit gets no gradient (zero_model's
`blocks[i].unused`, never called): torch skips it, and so must every copy of it the offload tiers
keep. Each mode that keeps its own fp32 master (NVMe, host memory with overlap, NVMe with
overlap) against torch.optim.AdamW on the unsharded model: the
losses and weights of continued training, of a checkpoint loaded into a fresh model and
optimizer, and of opt.state_dict() loaded into a fresh optimizer; and what the saved state holds
for the skipped parameter (its master is its value, what the next step starts from)."""

from __future__ import annotations

import os

import pytest
import torch
from zero_model import batches, make_model, train

import tierlift
from tierlift.checkpoint.format import load_tensors
from tierlift.zero.hooks import _state

pytestmark = pytest.mark.usefixtures("one_thread")

OPT = dict(lr=3e-3, weight_decay=0.1)
DATA = batches(4, 4, seed=3)
MODES = {
    "nvme": lambda d: dict(offload="nvme", nvme_path=d, cpu_budget=120_000),
    "cpu-overlap": lambda d: dict(offload="cpu", overlap=True),
    "nvme-overlap": lambda d: dict(offload="nvme", nvme_path=d, overlap=True, cpu_budget=400_000),
}


def _fresh(tmp, mode, stage=3, dtype=torch.float32, lr=OPT["lr"], full=None):
    model = make_model(seed=5).to(dtype)
    if full is not None:
        model.load_state_dict(full)
    model = tierlift.zero.shard(model, stage=stage)
    d = os.path.join(tmp, f"nvme{len(os.listdir(tmp))}")
    os.makedirs(d)
    return model, tierlift.optim.AdamW(model.parameters(), **{**OPT, "lr": lr}, **MODES[mode](d))


def _unused_ranges(model, opt) -> list:
    """(optimizer param index, a, b) of every never-called parameter (one rank: whole shards)."""
    units = _state(model).unit_of
    out = []
    for i, p in enumerate(opt.param_groups[0]["params"]):
        unit = units.get(id(p))  # None: frozen
        for e in unit.entries if unit is not None else ():
            if ".unused." in e.names[0]:
                out.append((i, e.offset, e.offset + e.numel))
    assert len(out) == 6  # weight and bias of three blocks
    return out


def _weights(model) -> dict:
    return {k: v.clone() for k, v in tierlift.zero.full_state_dict(model).items()}


@pytest.mark.parametrize("stage", [3, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_continued_and_resumed_training_match_torch(tmp_path, mode, stage):
    ref = make_model(seed=5)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **OPT)
    ref_losses = train(ref, ref_opt, DATA, accum=1, clip=None)
    want = ref.state_dict()

    model, opt = _fresh(str(tmp_path), mode, stage)
    losses = train(model, opt, DATA[:2], accum=1, clip=None, zero=True)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    saved, sd = _weights(model), opt.state_dict()
    # An fp32 parameter's saved master is the parameter itself, the skipped ones' included.
    tensors = load_tensors(ck, 0)
    for i, _, _ in _unused_ranges(model, opt):
        master = tensors[f"unit{i}.master"] if f"unit{i}.master" in tensors else None
        if master is not None:
            assert torch.equal(master, tensors[f"unit{i}.param"]), i
    from test_checkpoint_reshard import _full_state
    for (i, k), v in _full_state(ck).items():
        if k == "master":
            assert torch.equal(v, tensors[f"unit{i}.param"].view(-1)[:v.numel()]), i
    losses += train(model, opt, DATA[2:], accum=1, clip=None, zero=True)
    # The step after starts from those masters: none refreshed, no overlapped chunk redone.
    stats = opt.last_step_stats
    assert stats.get("masters_refreshed", 0) == stats.get("overlap_redone_chunks", 0) == 0
    got = _weights(model)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for k in want:
        if ".unused." in k:
            assert torch.equal(got[k], want[k]), k  # never stepped, as under torch
        else:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5)

    m2, o2 = _fresh(str(tmp_path), mode, stage)
    tierlift.checkpoint.load(ck, m2, o2)
    assert train(m2, o2, DATA[2:], accum=1, clip=None, zero=True) == losses[2:]
    m3, o3 = _fresh(str(tmp_path), mode, stage, full=saved)
    o3.load_state_dict(sd)
    assert train(m3, o3, DATA[2:], accum=1, clip=None, zero=True) == losses[2:]
    for m in (m2, m3):
        after = _weights(m)
        assert all(torch.equal(after[k], got[k]) for k in got)
    for o in (opt, o2, o3):
        o.close()
