"""The bookkeeping for parameters without gradient (zero/unused.py) runs in every step of every
model with a unit of several parameters, so on a GPU each value it reads back (tolist, item,
bool, float of a tensor) stalls the step. Counted here on CPU, where those calls are the same:
with every parameter used a step makes no torch call from unused.py at all (one process; two
ranks in test_zero_unused.py), and with a parameter never called (zero_model's `unused`) a
step reads twice however many units hold one (the flags, the step counts) while the weights
still match torch's AdamW."""

from __future__ import annotations

import collections
import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F
from zero_model import batches, make_model

import tierlift
from tierlift.zero import unused

pytestmark = pytest.mark.usefixtures("one_thread")

# What reads a tensor's value on the host: a device sync for a GPU tensor.
READS = frozenset({"tolist", "item", "__bool__", "__float__", "__int__", "__index__"})
# Tensor methods counted besides (device work when called from unused.py).
METHODS = READS | {"any", "clone", "detach", "to", "copy_", "__getitem__", "__setitem__"}
# Host-side only: whether grad mode is on.
METADATA = frozenset({"is_grad_enabled"})
OPT = dict(lr=3e-3, weight_decay=0.1)


class Calls:
    """Counts, by name, the torch functions (torch.X) and the tensor methods (METHODS) that
    unused.py itself calls, in every thread (the backward's hooks included)."""

    def __init__(self, monkeypatch) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.on = False
        for name in METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(unused, "torch", _Torch(self))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if self.on and sys._getframe(1).f_code.co_filename == unused.__file__:
                self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    def __enter__(self):
        self.counts.clear()
        self.on = True
        return self

    def __exit__(self, *exc) -> None:
        self.on = False


class _Torch:
    """unused.py's `torch`, counting the functions called through it."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls

    def __getattr__(self, name):
        v = getattr(torch, name)
        if not callable(v) or isinstance(v, type):
            return v  # modules, classes (torch.Tensor for isinstance), dtypes
        calls = self._calls

        def counted(*args, **kwargs):
            if calls.on:
                calls.counts[name] += 1
            return v(*args, **kwargs)

        return counted


def _reads(counts) -> int:
    return sum(n for k, n in counts.items() if k in READS)


def _device_work(counts) -> dict:
    return {k: n for k, n in counts.items() if k not in METADATA}


def _all_used(model):
    for block in model.blocks:
        del block.unused  # every parameter left gets a gradient
    return model


def _step(model, opt, seq) -> None:
    opt.zero_grad(set_to_none=True)
    idx, tgt = seq[:, :-1], seq[:, 1:]
    F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()).backward()
    opt.step()


def _counted(monkeypatch, build, stage: int, steps: int = 3):
    """Per-step counts of the steps after the first (which creates the optimizer's state), and
    the largest relative difference of the weights from torch's AdamW on the unsharded model."""
    data = batches(steps, 4, seed=2)
    ref = build(make_model(seed=4))
    ref_opt = torch.optim.AdamW(ref.parameters(), **OPT)
    model = tierlift.zero.shard(build(make_model(seed=4)), stage=stage)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    calls, per_step = Calls(monkeypatch), []
    for i, seq in enumerate(data):
        _step(ref, ref_opt, seq)
        with calls:
            _step(model, opt, seq)
        if i:
            per_step.append(collections.Counter(calls.counts))
    sd, want = tierlift.zero.full_state_dict(model), ref.state_dict()
    rel = max(float((sd[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-6))
              for k in want if want[k].is_floating_point())
    return per_step, rel


@pytest.mark.parametrize("stage", [2, 3])
def test_every_parameter_used_no_device_reads(monkeypatch, stage):
    per_step, rel = _counted(monkeypatch, _all_used, stage)
    assert rel < 1e-5
    for counts in per_step:
        assert not _device_work(counts), dict(counts)  # no read, no tensor made


@pytest.mark.parametrize("stage", [2, 3])
def test_unused_parameter_few_reads_and_exact(monkeypatch, stage):
    per_step, rel = _counted(monkeypatch, lambda m: m, stage)
    assert rel < 1e-5
    units = len(make_model().blocks)  # one unit per block holds a never-called `unused`
    for counts in per_step:
        # Both of its parameters (weight, bias) checked in the backward, kept on the device.
        assert counts["any"] == 2 * units and counts["stack"] == units + 1, dict(counts)
        # Reads: the flags once, every unit's together, when the step settles them; then every
        # unit's step count before and after the step at once (CPU counts as torch's AdamW
        # keeps: no sync on a GPU either).
        assert counts["tolist"] == 2 and _reads(counts) == 2, dict(counts)


def test_step_counts_read_once_per_device_and_dtype(monkeypatch):
    steps = [torch.tensor(3.0), 2.0, None, torch.tensor(4.0), torch.tensor(5, dtype=torch.int64)]
    with Calls(monkeypatch) as calls:
        got = unused._floats(steps)
    assert got == [3.0, 2.0, None, 4.0, 5.0]
    assert all(type(v) is float for v in got if v is not None)
    assert calls.counts["tolist"] == 2 and _reads(calls.counts) == 2, dict(calls.counts)


class _Pair(torch.nn.Module):
    """One unit: `used` called, `extra` never (no gradient, not stepped)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.extra = torch.nn.Linear(6, 6), torch.nn.Linear(6, 2)

    def forward(self, x):
        return torch.tanh(self.used(x))


def _pairs(n: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_Pair() for _ in range(n)])


@pytest.mark.parametrize("blind", [False, True], ids=["hooks", "hooks_blind"])
@pytest.mark.parametrize("units", [1, 3, 8])
def test_reads_per_step_do_not_grow_with_units(monkeypatch, units, blind):
    """The reads a step makes are the same with 1, 3 or 8 units holding a parameter without
    gradient. hooks_blind: no gradient hook fires (watch() a no-op), so which entries got a
    gradient comes from local_grad's device checks alone, still exact."""
    if blind:
        monkeypatch.setattr(unused, "watch", lambda unit: None)
    ref = _pairs(units)
    ref_opt = torch.optim.AdamW(ref.parameters(), **OPT)
    model = tierlift.zero.shard(_pairs(units), stage=2, units=[str(i) for i in range(units)])
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    calls = Calls(monkeypatch)
    for i in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        for m, o in ((ref, ref_opt), (model, opt)):
            with calls if m is model and i else contextlib.nullcontext():
                o.zero_grad()
                m(x).sum().backward()
                o.step()
        if i:  # the flags once, the step counts once
            assert calls.counts["tolist"] == 2 and _reads(calls.counts) == 2, dict(calls.counts)
    sd = tierlift.zero.full_state_dict(model)
    for k, want in ref.state_dict().items():
        torch.testing.assert_close(sd[k], want, rtol=1e-6, atol=1e-7, msg=k)
