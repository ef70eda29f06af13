"""A ZeRO checkpoint resumed in another configuration than it was saved in: the training after
the load matches an uninterrupted run exactly, or the load is refused before anything
changes. Two Linear(4, 4) layers and a buffer, one unit each (min_unit_numel=1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tierlift

X = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("shift", torch.arange(4.0))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.shift


def _train(model, opt, xs) -> None:
    for x in xs:
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _plain(net):
    return tierlift.zero.shard(net, stage=3, min_unit_numel=1)


def _compiled_inside(net):  # sharded through the wrapper: `_orig_mod.` in every name
    return tierlift.zero.shard(torch.compile(net), stage=3, min_unit_numel=1)


def _compiled_outside(net):  # the sharded model compiled: state_dict() keys get `_orig_mod.`
    return torch.compile(tierlift.zero.shard(net, stage=3, min_unit_numel=1))


def _full(model) -> dict:
    return {k.replace("_orig_mod.", ""): v for k, v in tierlift.zero.full_state_dict(model).items()}


WRAPS = {"plain": _plain, "compiled-inside": _compiled_inside,
         "compiled-outside": _compiled_outside}


@pytest.mark.parametrize(("saved", "loaded"), [
    ("compiled-inside", "plain"), ("compiled-outside", "plain"),
    ("plain", "compiled-inside"), ("plain", "compiled-outside"),
    ("compiled-inside", "compiled-outside"),
])
def test_compiled_zero_model_resumes_in_the_plain_one(tmp_path, one_thread, saved, loaded):
    """Saved through torch.compile (`_orig_mod.` names), loaded without it (or the reverse):
    every unit, the buffer and the optimizer state go to their parameters. The layers train
    through the module inside the wrapper (the hooks are there), so nothing is compiled."""
    net = Net()
    model = WRAPS[saved](net)
    opt = tierlift.optim.AdamW(model.parameters(), lr=0.05)
    _train(net, opt, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    _train(net, opt, X[2:])
    net2 = Net()
    with torch.no_grad():
        net2.shift.add_(5.0)  # the buffer must come from the checkpoint
    model2 = WRAPS[loaded](net2)
    opt2 = tierlift.optim.AdamW(model2.parameters(), lr=0.05)
    tierlift.checkpoint.load(ck, model2, opt2)
    _train(net2, opt2, X[2:])
    ref, got = _full(model), _full(model2)
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)
