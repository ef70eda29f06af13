"""The NVMe pipeline's shape: more, smaller slots read further ahead inside the same cpu_budget
(a hard limit for every slot count), equal chunks, only the used part of a chunk is read,
written and checksummed, and the I/O request size setting."""

from __future__ import annotations

import pytest
import torch

import tierlift
from tierlift.io import ChecksumError
from tierlift.offload import OffloadConfig, Offloader, sizing
from tierlift.offload.layout import ALIGN_ELEMS, build_layout, even_chunk_elems
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

SHAPES = [(37, 51), (3000,), (5,), (70000,)]


def _params():
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(params, i):
    g = torch.Generator().manual_seed(100 + i)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.fixture(autouse=True)
def _small_slots(monkeypatch):
    # These states are tiny: let every slot count be used with chunks of a few KiB.
    monkeypatch.setattr(sizing, "MIN_SLOT_CHUNK_BYTES", 4096)


def _nvme_opt(params, tmp_path, **cfg):
    """AdamW with an Offloader built from an explicit OffloadConfig (the slot count and the
    request size are OffloadConfig settings)."""
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    opt._offload = Offloader(opt, OffloadConfig(offload="nvme", nvme_path=str(tmp_path), **cfg))
    return opt


def _state_bytes():
    return 12 * sum(torch.Size(s).numel() for s in SHAPES)


@pytest.mark.parametrize("slots", [3, 4, 6, 9])
def test_slots_are_bit_identical_and_within_budget(tmp_path, slots):
    budget = _state_bytes() // 3
    ref = _params()
    ref_opt = AdamW(ref, lr=1e-2, weight_decay=0.1)
    got = _params()
    opt = _nvme_opt(got, tmp_path, cpu_budget=budget, pipeline_slots=slots)
    off = opt._offload
    for i in range(4):
        _grads(ref, i)
        _grads(got, i)
        ref_opt.step()
        opt.step()
        # the budget is a hard limit whatever the slot count
        assert off._engine.pool_in_use <= budget
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert off.n_slots == slots and len(off._slots) == slots
    assert off.pool_bytes <= budget and off._engine.config.pool_bytes <= budget
    assert len(off.layouts[0].chunks) > slots  # the read-ahead had chunks to run ahead of
    off.close()


def test_reads_run_slots_minus_two_chunks_ahead(tmp_path):
    slots = 5
    params = _params()
    opt = _nvme_opt(params, tmp_path, cpu_budget=_state_bytes() // 3, pipeline_slots=slots)
    off, tier = opt._offload, opt._offload.tiers[0]
    events = []
    read_all, step_chunk = tier.read_all, off._step_chunk

    def logged_read(ci, bufs, what):
        events.append(("read", ci))
        return read_all(ci, bufs, what)

    def logged_step(gi, group, params_, grads, steps, chunk, *a, **k):
        events.append(("step", chunk.ci))
        return step_chunk(gi, group, params_, grads, steps, chunk, *a, **k)

    tier.read_all, off._step_chunk = logged_read, logged_step
    _grads(params, 0)
    opt.step()
    n = len(off.layouts[0].chunks)
    for pos, (kind, ci) in enumerate(events):
        if kind == "step":
            issued = {c for k, c in events[:pos] if k == "read"}
            assert issued == set(range(min(n, ci + slots - 1))), (ci, sorted(issued))
    off.close()


def test_chunks_are_even_and_only_used_bytes_move(tmp_path):
    total = 100 * ALIGN_ELEMS + 1  # one element more than 100 blocks of 4 KiB
    # 3 chunks of 34 blocks, not 50 + 50 + 1 element
    assert even_chunk_elems(total, 50 * ALIGN_ELEMS) == 34 * ALIGN_ELEMS
    assert even_chunk_elems(total, 200 * ALIGN_ELEMS) == 101 * ALIGN_ELEMS
    lay = build_layout([torch.empty(total)], 60 * ALIGN_ELEMS)
    assert [lay.used_elems(c.ci) for c in lay.chunks] == [60 * ALIGN_ELEMS, 41 * ALIGN_ELEMS]

    params = _params()
    opt = _nvme_opt(params, tmp_path, cpu_budget=_state_bytes() // 3)
    off = opt._offload
    lay, tier = off.layouts[0], off.tiers[0]
    used = [lay.used_elems(c.ci) for c in lay.chunks]
    assert tier.used == used and sum(used) == lay.used
    assert used[-1] < off.chunk_elems  # the last chunk is partly empty here...
    assert min(used[:-1]) == off.chunk_elems
    _grads(params, 0)
    opt.step()
    _grads(params, 1)
    opt.step()
    stats = opt.last_step_stats
    moved = 4 * len(tier.kinds) * sum(used)  # ...and only its used part is read and written
    assert stats["nvme_read_bytes"] == moved and stats["nvme_write_bytes"] == moved
    assert stats["nvme_sync_s"] <= stats["nvme_write_wait_s"]
    # a corrupt byte in the used part of that last chunk is still caught
    ci = len(used) - 1
    path = tier.paths[("exp_avg", tier.gen[ci])]
    with open(path, "r+b") as f:
        f.seek(ci * tier.kind_chunk_bytes["exp_avg"] + 4 * used[ci] - 8)
        b = f.read(1)
        f.seek(ci * tier.kind_chunk_bytes["exp_avg"] + 4 * used[ci] - 8)
        f.write(bytes([b[0] ^ 0xFF]))
    off._engine.forget(path)
    before = [p.detach().clone() for p in params]
    _grads(params, 2)
    with pytest.raises(ChecksumError, match=r"exp_avg of param_groups\[0\]\['params'\]\[3\]"):
        opt.step()
    for a, b in zip(before, params):
        assert torch.equal(a, b)
    off.close()


def test_block_bytes_sets_the_engine_request_size(tmp_path):
    params = _params()
    opt = _nvme_opt(params, tmp_path, cpu_budget=_state_bytes() // 3, block_bytes=8192)
    assert opt._offload._engine.config.block_size == 8192
    opt._offload.close()


def test_small_budgets_get_fewer_slots_down_to_three(tmp_path, monkeypatch):
    monkeypatch.setattr(sizing, "MIN_SLOT_CHUNK_BYTES", 1 << 20)
    params = _params()
    opt = _nvme_opt(params, tmp_path, cpu_budget=5 * (3 << 20), pipeline_slots=8)
    assert opt._offload.n_slots == 5  # 1 MiB per kind (3 kinds) and slot
    opt._offload.close()
    opt = _nvme_opt(params, tmp_path, cpu_budget=_state_bytes() // 3, pipeline_slots=8)
    assert opt._offload.n_slots == 3
    opt._offload.close()
    with pytest.raises(ValueError, match=f"smallest budget that works is {36864} bytes"):
        _nvme_opt(params, tmp_path, cpu_budget=30_000, pipeline_slots=8)


@pytest.mark.parametrize("kw, err, match", [
    (dict(pipeline_slots=2), ValueError, "pipeline_slots"),
    (dict(pipeline_slots=65), ValueError, "pipeline_slots"),
    (dict(pipeline_slots=True), TypeError, "pipeline_slots"),
    (dict(pipeline_slots=4.0), TypeError, "pipeline_slots"),
    (dict(block_bytes=1000), ValueError, "block_bytes"),
    (dict(block_bytes=0), ValueError, "block_bytes"),
])
def test_bad_pipeline_settings(tmp_path, kw, err, match):
    with pytest.raises(err, match=match):
        OffloadConfig(offload="nvme", nvme_path=str(tmp_path), **kw)



def test_pool_starts_on_a_huge_page_boundary(tmp_path):
    # the engine maps its pool 2 MiB-aligned and advises huge pages, so O_DIRECT requests see
    # physically contiguous memory where the kernel grants them
    opt = _nvme_opt(_params(), tmp_path, cpu_budget=_state_bytes() // 3)
    first = min(t.data_ptr() for slot in opt._offload._slots for t in slot.values())
    assert first % (2 << 20) == 0
    opt._offload.close()
