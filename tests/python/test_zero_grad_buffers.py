"""A ZeRO unit's backward builds its flat gradient in one buffer of the unit, not one per
parameter, and the gradient is plain torch's bit for bit.

A unit's weights are views of its flat `full`. Sliced one by one, each view's backward zeroed a
buffer of the whole unit, scattered its parameter's gradient into it, and autograd summed those
out of place: a unit of k parameters made 2k - 1 unit-size buffers per backward (three alive at
once at the peak: tests/python/test_plan_gaps.py measures it), and the zeros around each one
turned a -0.0 gradient into +0.0. The views now come from one split of `full`, whose backward is
a single concatenation. Counted on CPU with a dispatch mode (world 1, no process group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import tierlift
from tierlift.zero.unit import FlatUnit

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

D = 16


class _NewBuffers(TorchDispatchMode):
    """Counts the storages of `nbytes` that aten ops make (not views or in-place results of
    their inputs) until `stop()`."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes = nbytes
        self.made: list[str] = []
        self.counting = True

    def stop(self) -> None:
        self.counting = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting:
            given = {t.untyped_storage().data_ptr()
                     for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() == self.nbytes \
                        and t.untyped_storage().data_ptr() not in given:
                    self.made.append(str(func))
        return out


class _Net(nn.Module):
    """A block of four parameters (the unit counted), a head in the root unit."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.block(x))


def _gradient_buffers(unit_name: str, model: nn.Module, x: torch.Tensor) -> list[str]:
    """The unit-size buffers the second backward makes before the unit's gradient reaches
    `full` (the first records the unit order)."""
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    unit = next(u for u in model._tierlift_zero.units if u.name == unit_name)
    loss = model(x).sum()
    mode = _NewBuffers(unit.padded * unit.full.element_size())
    handle = unit.full.register_hook(lambda grad: mode.stop())
    try:
        with mode:
            loss.backward()
    finally:
        handle.remove()
    assert not mode.counting, "the unit got no gradient"
    return mode.made


@pytest.mark.parametrize("stage,dtype", [(2, torch.float32), (2, torch.bfloat16),
                                         (3, torch.float32), (3, torch.bfloat16)])
def test_backward_makes_one_unit_size_gradient_buffer(stage, dtype):
    """Four parameters: one concatenation (the sliced views made 4 zeroed buffers and 3 sums);
    a unit of one weight that fills it: only the weight's own gradient (its view's gradient
    is the unit's: the split's concatenation would copy it)."""
    torch.manual_seed(0)
    mp = tierlift.zero.MixedPrecision(param_dtype=dtype)
    # Stage 3 keeps the units gathered after forward: no gather inside the count.
    keep = {"reshard_after_forward": False} if stage == 3 else {}
    model = tierlift.zero.shard(_Net(), stage=stage, units=["block", "head"],
                                mixed_precision=mp, **keep)
    try:
        made = _gradient_buffers("block", model, torch.randn(4, D, dtype=dtype))
    finally:
        tierlift.zero.close(model)
    assert made == ["aten.cat.default"], made

    one = tierlift.zero.shard(nn.Sequential(nn.Linear(D, D, bias=False), nn.Linear(D, 1)),
                              stage=stage, units=["0", "1"], mixed_precision=mp, **keep)
    try:
        made = _gradient_buffers("0", one, torch.randn(4, D, dtype=dtype))
    finally:
        tierlift.zero.close(one)
    assert made == ["aten.mm.default"], made  # the weight's gradient itself, no copy of it


class _Tied(nn.Module):
    """A tied weight used twice, an unused parameter, and a gradient of -0.0."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.b.weight = self.a.weight
        self.unused = nn.Linear(D, 3)
        self.gain = nn.Parameter(torch.ones(D))

    def forward(self, x):
        # gain's gradient is 1 x -0.0: -0.0 in torch, +0.0 once added to zero padding
        return self.b(torch.relu(self.a(x))).sum() + (self.gain * x.new_full((D,), -0.0)).sum()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32)


def _one_unit(model: nn.Module, world: int) -> FlatUnit:
    """Every parameter of `model` in one FlatUnit, padded for a world of `world` (this rank 0;
    no collective runs: the weights stay gathered)."""
    found: dict[int, tuple] = {}
    for mname, mod in model.named_modules():
        for attr, p in mod.named_parameters(recurse=False):
            _, names, owners = found.setdefault(id(p), (p, [], []))
            names.append(f"{mname}.{attr}" if mname else attr)
            owners.append((mod, attr))
    return FlatUnit(name="all", module=model, params=list(found.values()),
                    comm=SimpleNamespace(world=world, rank=0), compute_dtype=torch.float32,
                    keep_full=True)


def test_unit_gradient_is_torchs_bit_for_bit_with_padding():
    """One unit of a tied weight, an unused parameter and padding to a world of 7: the flat
    gradient is torch's per-parameter gradients bit for bit (-0.0 kept), zeros for the unused
    parameter and the padding, summed over two forwards through fresh views."""
    torch.manual_seed(0)
    ref = _Tied()
    model = _Tied()
    model.load_state_dict(ref.state_dict())
    unit = _one_unit(model, world=7)
    assert unit.padded > unit.numel
    x = torch.randn(6, D)
    for _ in range(2):
        unit.install_views()
        model(x).backward()
        ref(x).backward()
    # the pieces are views of `full` itself (rewrites.is_installed tells them by that)
    assert all(getattr(m(), a)._base is unit.full for e in unit.entries for m, a in e.owners)
    grad = unit.full.grad
    assert torch.equal(_bits(grad[unit.numel:]), _bits(torch.zeros(unit.padded - unit.numel)))
    refs = dict(ref.named_parameters())
    assert torch.signbit(refs["gain"].grad).all() and not refs["gain"].grad.any()
    for e in unit.entries:
        want = refs[e.names[0]].grad
        want = torch.zeros(e.shape) if want is None else want
        assert torch.equal(_bits(grad[e.offset:e.offset + e.numel]), _bits(want)), e.names


class _Renormed(nn.Module):
    """nn.Embedding(max_norm=...) renormalizes its weight in place (under no_grad) inside its
    forward, then reads it in grad mode: torch refuses that read for the output of a
    multi-output view, which the split's pieces are unless made ordinary views."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, D, max_norm=1.0)
        self.out = nn.Linear(D, 1)

    def forward(self, idx):
        return self.out(self.emb(idx)).sum()


@pytest.mark.parametrize("stage", [2, 3])
def test_weights_changed_in_place_under_no_grad_keep_working(stage):
    """A weight renormalized in the forward: torch's gradients; a weight edited under no_grad
    between steps (stage 2 keeps the views), then another of its unit read in grad mode."""
    torch.manual_seed(0)
    ref = _Renormed()
    model = _Renormed()
    model.load_state_dict(ref.state_dict())
    model = tierlift.zero.shard(model, stage=stage, units=[])
    idx = torch.tensor([[1, 2, 3, 2]])
    try:
        model(idx).backward()
        ref(idx).backward()
        (unit,) = model._tierlift_zero.units
        for e in unit.entries:
            want = dict(ref.named_parameters())[e.names[0]].grad.reshape(-1)
            assert torch.equal(unit.shard.grad[e.offset:e.offset + e.numel], want), e.names
        if stage == 2:
            with torch.no_grad():
                model.out.weight.mul_(0.5)
            assert model.out.bias.sum().requires_grad
    finally:
        tierlift.zero.close(model)


class _Signed(nn.Module):
    """A weight and a gain whose gradient is 0.0 times what flows back: +0.0 or -0.0 by its
    sign."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gain = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return self.lin(x) + self.gain * x.new_full((D,), -0.0)


def _signed_model() -> nn.Module:
    return nn.Sequential(_Signed(), nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(),
                                                  nn.Linear(2 * D, D)), _Signed())


def test_zero3_gradients_are_torchs_bit_for_bit():
    """A ZeRO-3 model of several units (one rank): each shard's gradient is torch's
    per-parameter gradients bit for bit, the signs of zeros included."""
    torch.manual_seed(0)
    ref = _signed_model()
    model = _signed_model()
    model.load_state_dict(ref.state_dict())
    model = tierlift.zero.shard(model, stage=3, units=["0", "1", "2"])
    try:
        x = torch.randn(6, D)
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        refs = dict(ref.named_parameters())
        gain = refs["0.gain"].grad
        assert not gain.any() and torch.signbit(gain).any() and not torch.signbit(gain).all()
        for unit in model._tierlift_zero.units:
            for e in unit.entries:
                got = unit.shard.grad[e.offset:e.offset + e.numel]
                assert torch.equal(_bits(got), _bits(refs[e.names[0]].grad)), e.names
    finally:
        tierlift.zero.close(model)
