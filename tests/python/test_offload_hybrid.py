"""offload="hybrid" (state split between host memory and NVMe by whole chunks) and
nvme_generations=1 (NVMe chunks rewritten in place): exactness against offload="none", the
budgets (host memory, disk bytes), overlap, checkpoints, and what a failure leaves behind."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_offload import SHAPES, _grads, _params

import tierlift
from tierlift.io import ChecksumError
from tierlift.offload.tiers import HybridTier, NvmeTier
from tierlift.optim import Adam, AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

BUDGET = 600_000  # about half of the 12 B/param state of SHAPES, pool included
BUDGET_COMPACT = 350_000
# One generation holds no master for fp32 host parameters (m and v only): smaller budgets
# keep about half of it in RAM.
BUDGET_1GEN = {"fp32": 400_000, "bf16": 200_000}


def _train(cls, steps=4, dtype=torch.float32, params=None, opt=None, first=0, **kw):
    params = _params(dtype) if params is None else params
    opt = cls(params, lr=1e-2, weight_decay=0.1, **kw) if opt is None else opt
    for i in range(first, first + steps):
        _grads(params, i)
        opt.step()
    return params, opt


def _kw(tmp_path, layout: str, budget: int | None = None, state_dtype: str = "fp32") -> dict:
    if budget is None and layout == "hybrid-1gen":
        budget = BUDGET_1GEN[state_dtype]
    if budget is None:  # compact state (7 B/param): about half of it in RAM too
        budget = BUDGET if state_dtype == "fp32" else BUDGET_COMPACT
    return {"hybrid": dict(offload="hybrid", nvme_path=str(tmp_path), cpu_budget=budget),
            "hybrid-1gen": dict(offload="hybrid", nvme_path=str(tmp_path), cpu_budget=budget,
                                nvme_generations=1),
            "nvme-1gen": dict(offload="nvme", nvme_path=str(tmp_path), cpu_budget=200_000,
                              nvme_generations=1)}[layout]


LAYOUTS = ["hybrid", "hybrid-1gen", "nvme-1gen"]


def _assert_same_state(opt, ref_opt):
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, st in ref_sd["state"].items():
        assert st.keys() == sd["state"][i].keys()
        for k, v in st.items():
            assert torch.equal(v, sd["state"][i][k]), (i, k)


@pytest.mark.parametrize("cls", [Adam, AdamW])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bit_identical_to_no_offload(tmp_path, cls, amsgrad, dtype, layout):
    ref, ref_opt = _train(cls, dtype=dtype, amsgrad=amsgrad)
    got, opt = _train(cls, dtype=dtype, amsgrad=amsgrad, **_kw(tmp_path, layout))
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    _assert_same_state(opt, ref_opt)
    tier = opt._offload.tiers[0]
    if layout.startswith("hybrid"):  # both parts hold chunks
        assert isinstance(tier, HybridTier) and 0 < tier.n_ram < len(tier.gen)
        assert opt.last_step_stats["ram_chunks"] == tier.n_ram
        assert opt.last_step_stats["nvme_read_bytes"] > 0


def test_the_ram_part_takes_what_the_budget_leaves_after_the_pool(tmp_path):
    small = AdamW(_params(), **_kw(tmp_path, "hybrid", 300_000))._offload
    large = AdamW(_params(), **_kw(tmp_path, "hybrid", 2_000_000))._offload
    for off, budget in ((small, 300_000), (large, 2_000_000)):
        tier = off.tiers[0]
        assert off.pool_bytes + tier.resident_bytes <= budget
        # one more chunk in RAM would not fit
        room = budget - off.pool_bytes - tier.resident_bytes
        assert tier.n_ram == len(tier.gen) or room < off.chunk_elems * 4 * len(tier.kinds)
    assert 0 < small.tiers[0].n_ram < len(small.tiers[0].gen)
    assert large.tiers[0].n_ram == len(large.tiers[0].gen)
    assert large.tiers[0].disk_bytes == 0


def _allocated(d):
    return sum(os.stat(os.path.join(r, f)).st_blocks * 512 for r, _, fs in os.walk(d)
               for f in fs if not f.endswith(".json"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_generation_takes_half_the_disk_or_less(tmp_path, dtype):
    """Two generations hold master, m and v twice. One generation holds them once, and fp32
    host parameters are their own master there (a failed in-place step is not undone from
    it anyway), so m and v only: a third. bf16 parameters keep their fp32 master: a half."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    two = AdamW(_params(dtype), offload="nvme", nvme_path=str(tmp_path / "a"),
                cpu_budget=200_000)
    one = AdamW(_params(dtype), **_kw(tmp_path / "b", "nvme-1gen"))
    t1, t2 = one._offload.tiers[0], two._offload.tiers[0]
    share = 3 if dtype == torch.float32 else 2
    assert t2.kinds == ["master", "exp_avg", "exp_avg_sq"]
    assert t1.kinds == (["exp_avg", "exp_avg_sq"] if dtype == torch.float32 else t2.kinds)
    assert _allocated(tmp_path / "b") == t1.disk_bytes
    assert _allocated(tmp_path / "a") == t2.disk_bytes
    # The chunk size follows what the pool's slots hold, so compare with the parameters.
    n = sum(-(-max(torch.Size(s).numel(), 1) // 1024) * 1024 for s in SHAPES)
    assert 24 * n <= t2.disk_bytes <= 24 * n * 1.1
    assert 24 / share * n <= t1.disk_bytes <= 24 / share * n * 1.1
    # the pipeline's slots hold no master either
    assert ("master" in one._offload._slots[0]) == (dtype != torch.float32)


def fit_overlapped(state_dtype: str, kw: dict):
    """Four real backward+step rounds of a small MLP with AdamW(**kw): the weights, and how
    many chunks overlap stepped during backward and kept."""
    torch.manual_seed(3)
    init = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Tanh(),
                               torch.nn.Linear(512, 300), torch.nn.Tanh(),
                               torch.nn.Linear(300, 4)).state_dict()
    model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Tanh(),
                                torch.nn.Linear(512, 300), torch.nn.Tanh(),
                                torch.nn.Linear(300, 4))
    model.load_state_dict(init)
    opt = AdamW(model.parameters(), lr=1e-2, state_dtype=state_dtype, **kw)
    g, kept = torch.Generator().manual_seed(7), 0
    for _ in range(4):
        model(torch.randn(8, 32, generator=g)).square().mean().backward()
        opt.step()
        kept += opt.last_step_stats.get("overlap_kept_chunks", 0)
        model.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], kept


@pytest.mark.parametrize("layout", ["hybrid", "hybrid-1gen", "nvme-1gen"])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_overlap_equals_the_plain_step(state_dtype, tmp_path, layout):
    ref, _ = fit_overlapped(state_dtype, {})
    got, kept = fit_overlapped(state_dtype,
                               dict(_kw(tmp_path, layout, 1 << 20, state_dtype), overlap=True))
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    # Two-generation NVMe chunks are stepped during backward; one-generation ones never are.
    assert (kept > 0) == (layout == "hybrid")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_state_dict_round_trip_and_torch_interop(state_dtype, tmp_path, layout):
    _, ref_opt = _train(AdamW, state_dtype=state_dtype, steps=2)
    kw = _kw(tmp_path, layout, state_dtype=state_dtype)
    params, opt = _train(AdamW, state_dtype=state_dtype, steps=2, **kw)
    sd = opt.state_dict()
    _assert_same_state(opt, ref_opt)
    # torch's AdamW state loads into a fresh hybrid optimizer, and both continue the same.
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = AdamW(twin, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype,
                  **_kw(tmp_path, layout, state_dtype=state_dtype))
    fresh.load_state_dict(ref_opt.state_dict())
    _train(AdamW, state_dtype=state_dtype, steps=2, params=params, opt=opt, first=2)
    _train(AdamW, state_dtype=state_dtype, steps=2, params=twin, opt=fresh, first=2)
    for a, b in zip(params, twin):
        assert torch.equal(a, b)
    assert sd["state"].keys() == opt.state_dict()["state"].keys()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_checkpoint_save_and_load(state_dtype, tmp_path, layout):
    (tmp_path / "state").mkdir()
    kw = _kw(tmp_path / "state", layout, state_dtype=state_dtype)
    params, opt = _train(AdamW, state_dtype=state_dtype, steps=2, **kw)
    model = torch.nn.ParameterList(params)
    tierlift.checkpoint.save(str(tmp_path / "ck"), model, opt)
    _train(AdamW, state_dtype=state_dtype, steps=2, params=params, opt=opt, first=2)
    after = [p.detach().clone() for p in params]
    fresh_params = _params()
    fresh = AdamW(fresh_params, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, **kw)
    tierlift.checkpoint.load(str(tmp_path / "ck"), torch.nn.ParameterList(fresh_params), fresh)
    _train(AdamW, state_dtype=state_dtype, steps=2, params=fresh_params, opt=fresh, first=2)
    for a, b in zip(after, fresh_params):
        assert torch.equal(a, b)
    _assert_same_state(fresh, opt)


def _fail_nvme_writes(monkeypatch, after: int):
    real, calls = NvmeTier.write_all, [0]

    def failing(self, ci, bufs, gen):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(errno.EIO, "injected: I/O error")
        return real(self, ci, bufs, gen)

    monkeypatch.setattr(NvmeTier, "write_all", failing)
    return calls


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_a_failure_in_the_nvme_part_changes_nothing_and_the_step_can_be_retried(
        state_dtype, tmp_path, monkeypatch):
    ref, ref_opt = _train(AdamW, state_dtype=state_dtype, steps=3)
    kw = _kw(tmp_path, "hybrid", state_dtype=state_dtype)
    params, opt = _train(AdamW, state_dtype=state_dtype, steps=2, **kw)
    before = [p.detach().clone() for p in params]
    sd = opt.state_dict()
    _grads(params, 2)
    _fail_nvme_writes(monkeypatch, after=2)
    with pytest.raises(OSError, match="as they were before this step"):
        opt.step()
    for a, b in zip(before, params):  # the RAM chunks were not stepped either
        assert torch.equal(a, b)
    after = opt.state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(v, after["state"][i][k]), (i, k)
    monkeypatch.undo()
    opt.step()
    for a, b in zip(ref, params):
        assert torch.equal(a, b)
    _assert_same_state(opt, ref_opt)


@pytest.mark.parametrize("layout", ["hybrid-1gen", "nvme-1gen"])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_a_failure_while_rewriting_in_place_refuses_steps_until_a_load(
        state_dtype, tmp_path, monkeypatch, layout):
    ref, _ = _train(AdamW, state_dtype=state_dtype, steps=4)
    kw = _kw(tmp_path, layout, state_dtype=state_dtype)
    params, opt = _train(AdamW, state_dtype=state_dtype, steps=2, **kw)
    sd = opt.state_dict()
    saved = [p.detach().clone() for p in params]
    _grads(params, 2)
    _fail_nvme_writes(monkeypatch, after=1)
    with pytest.raises(RuntimeError, match="partly at the new step"):
        opt.step()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="Load a checkpoint"):
        opt.step()
    # Loading the last good state (weights and optimizer) makes it step exactly again.
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    opt.load_state_dict(sd)
    _train(AdamW, state_dtype=state_dtype, steps=2, params=params, opt=opt, first=2)
    for a, b in zip(ref, params):
        assert torch.equal(a, b)


def test_a_corrupt_one_generation_chunk_says_the_state_is_partly_stepped(tmp_path):
    """Its CRC is checked when it is read, after the chunks before it were rewritten in place:
    the ChecksumError names the file and says so, and steps are refused until a load."""
    params, opt = _train(AdamW, steps=2, **_kw(tmp_path, "nvme-1gen"))
    tier = opt._offload.tiers[0]
    ci = len(tier.gen) - 1
    assert ci > 0
    path = tier.paths[("exp_avg", tier.gen[ci])]
    with open(path, "r+b") as f:
        f.seek((ci - tier.first) * tier.kind_chunk_bytes["exp_avg"] + 4)
        b = f.read(1)
        f.seek((ci - tier.first) * tier.kind_chunk_bytes["exp_avg"] + 4)
        f.write(bytes([b[0] ^ 0xFF]))
    opt._offload._engine.forget(path)
    _grads(params, 2)
    with pytest.raises(ChecksumError, match=r"(?s)exp_avg.*corrupt.*partly at the new step"):
        opt.step()
    with pytest.raises(RuntimeError, match="Load a checkpoint"):
        opt.step()


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_a_failed_load_into_one_generation_refuses_steps_until_a_load_succeeds(
        state_dtype, tmp_path, monkeypatch):
    kw = _kw(tmp_path, "nvme-1gen", state_dtype=state_dtype)
    params, opt = _train(AdamW, state_dtype=state_dtype, steps=2, **kw)
    sd = opt.state_dict()
    _fail_nvme_writes(monkeypatch, after=1)
    with pytest.raises(OSError, match="injected"):
        opt.load_state_dict(sd)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="load a checkpoint"):
        opt.step()
    opt.load_state_dict(sd)
    _grads(params, 2)
    opt.step()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_non_finite_gradient_skips_the_step(state_dtype, tmp_path, layout):
    """skip_nonfinite=True: nothing changes, in the RAM part as on NVMe."""
    kw = _kw(tmp_path, layout, state_dtype=state_dtype)
    params, opt = _train(AdamW, state_dtype=state_dtype, steps=2, skip_nonfinite=True, **kw)
    before = [p.detach().clone() for p in params]
    sd = opt.state_dict()
    _grads(params, 5)
    params[0].grad[0, 3] = float("nan")  # a parameter in the RAM part of the hybrids
    with pytest.warns(RuntimeWarning, match="NaN/Inf"):
        opt.step()
    for a, b in zip(before, params):
        assert torch.equal(a, b)
    after = opt.state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(v, after["state"][i][k])


def test_bad_arguments(tmp_path):
    p = _params()
    with pytest.raises(ValueError, match="offload='hybrid' needs cpu_budget"):
        AdamW(p, offload="hybrid", nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="offload='hybrid' needs nvme_path"):
        AdamW(p, offload="hybrid", cpu_budget=1 << 20)
    with pytest.raises(ValueError, match="nvme_generations must be 1 or 2"):
        AdamW(p, offload="nvme", nvme_path=str(tmp_path), nvme_generations=3)
    with pytest.raises(ValueError, match="nvme_generations is only used with"):
        AdamW(p, offload="cpu", nvme_generations=1)
    with pytest.raises(ValueError, match="smallest budget that works"):
        AdamW(p, offload="hybrid", nvme_path=str(tmp_path), cpu_budget=1000)


_RSS = textwrap.dedent("""
    import resource, sys, torch
    sys.path.insert(0, {python!r})
    from tierlift.optim import AdamW
    torch.set_num_threads(1)
    n = 4_000_000
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    budget = 12 * n // 2
    opt = AdamW([p], lr=1e-3, offload="hybrid", nvme_path={path!r}, cpu_budget=budget,
                nvme_generations={gens})
    tier = opt._offload.tiers[0]
    assert 0 < tier.n_ram < len(tier.gen), tier.n_ram
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for i in range(3):
        opt.step()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(grown, budget)
    # the RAM part was allocated (zeros, untouched) before `base`: it counts once touched
    assert grown <= budget + (8 << 20), (grown, budget)
""")


@pytest.mark.parametrize("gens", [1, 2])
def test_peak_rss_stays_within_budget(tmp_path, gens):
    python = os.path.join(os.path.dirname(tierlift.__file__), "..")
    script = _RSS.format(python=os.path.abspath(python), path=str(tmp_path), gens=gens)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
