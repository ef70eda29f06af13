"""A unit holding weights gathered before its shard changed must not hand them to the next call:
a stage-3 prefetch left in flight (by a module called on its own, or by a forward that raised
partway) across a step or a load, and a module called on its own after the shards were written
through `.data` (a stage-3 unit a raised forward left gathered; stages 1/2 in a compute dtype
of their own). Each case runs on 2 gloo ranks (same batch on both, so the averaged gradient is
torch's) and is compared with plain torch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from zero_model import spawn_ranks

import tierlift

LR = 0.5


def _models():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    model = copy.deepcopy(plain)
    model = tierlift.zero.shard(model, stage=3, units=[model[0], model[2], model[4]],
                                prefetch=1)
    return plain, model


def _raise_in_layer(model, x) -> None:
    """A forward that raises in its second unit (a bad batch), caught by the training loop."""
    def bad_batch(*args):
        raise ValueError("bad batch")

    handle = model[2].register_forward_hook(bad_batch)
    try:
        with torch.no_grad():
            model(x)
    except ValueError:
        pass
    finally:
        handle.remove()


def _case(how: str) -> float:
    """How far (max abs) the sharded model's output after the step is from torch's."""
    plain, model = _models()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    popt = torch.optim.SGD(plain.parameters(), lr=LR)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    for m in (model, plain):
        m(x).square().mean().backward()
    if how == "module_no_grad":
        with torch.no_grad():
            model[0](x)  # prefetches model[2]
    elif how == "module_grad":
        model[0](x)
    elif how in ("raised", "raised_then_load"):
        _raise_in_layer(model, x)  # model[4] prefetched, model[2] left gathered
    opt.step()
    popt.step()
    if how == "raised_then_load":
        # Then a load: the shards change again, with the prefetch still held.
        _raise_in_layer(model, x)
        with torch.no_grad():
            for p in plain.parameters():
                p.mul_(0.5)
        tierlift.zero.load_full_state_dict(model, plain.state_dict())
    with torch.no_grad():
        return (model(x) - plain(x)).abs().max().item()


def _module_after_data_write(stage: int) -> float:
    """How far a module called on its own after a `.data` write of the shards is from torch's
    (stage 3: the unit a raised forward left gathered; stage 2: gathered in bf16, a copy)."""
    plain, _ = _models()
    dtype = torch.float32 if stage == 3 else torch.bfloat16
    model = copy.deepcopy(plain)
    model = tierlift.zero.shard(
        model, stage=stage, units=[model[0], model[2], model[4]], prefetch=1,
        mixed_precision=tierlift.zero.MixedPrecision(param_dtype=dtype))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    h = torch.randn(3, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    if stage == 3:
        _raise_in_layer(model, x)
    else:
        with torch.no_grad():
            model(x)
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(0.5)  # an EMA swap-in writes the same way
        for p in plain.parameters():
            p.mul_(0.5)
        return (model[2](h).float() - plain.to(dtype)[2](h).float()).abs().max().item()


HOWS = ("module_no_grad", "module_grad", "raised", "raised_then_load")
STAGES = (3, 2)


def _cases(rank, world, tmp):
    out = {how: _case(how) for how in HOWS}
    out.update({stage: _module_after_data_write(stage) for stage in STAGES})
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_stale_gathered")))


@pytest.mark.parametrize("how", HOWS)
def test_forward_after_step_uses_stepped_weights(ranks, how):
    for rank, out in enumerate(ranks):
        assert out[how] <= 1e-6, (rank, how, out[how])


@pytest.mark.parametrize("stage", STAGES)
def test_module_called_alone_after_data_write_uses_new_weights(ranks, stage):
    for rank, out in enumerate(ranks):
        assert out[stage] <= 1e-6, (rank, stage, out[stage])
