"""torch.compile of a sharded model (one process): dynamo leaves the ZeRO hooks alone.

Each unit's hooks are the same code bound to another unit index; dynamo traced them, and every
unit after the first was a recompilation of that code: past its recompile limit (8) on any model
of more than 8 units it warned and gave up, after seconds of tracing, for hooks that gather,
reduce and set module attributes, which no graph holds. They now run eagerly at a graph break;
the losses and weights stay those of the eager sharded model and of plain torch."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import tierlift

LAYERS = 10  # units: more than dynamo's recompile limit of 8


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


def _train(model, steps: int = 2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("stage", [2, 3])
def test_compiled_sharded_model_no_hook_recompiles(stage):
    units = [f"layers.{i}" for i in range(LAYERS)]
    ref = _Net()
    plain = _train(ref)
    eager_model = tierlift.zero.shard(_Net(), stage=stage, units=units)
    eager = _train(eager_model)
    model = tierlift.zero.shard(_Net(), stage=stage, units=units)
    torch._dynamo.reset()
    counters.clear()
    records = _Records()
    log = logging.getLogger("torch._dynamo")
    log.addHandler(records)
    try:
        compiled = _train(torch.compile(model, backend="eager"))
    finally:
        log.removeHandler(records)
        torch._dynamo.reset()
    assert not [m for m in records.messages if "recompile_limit" in m]
    # One frame per module's forward and its resumes, none per hook and unit (was ~50).
    assert counters["frames"]["total"] < LAYERS
    assert compiled == eager
    assert max(abs(a - b) / b for a, b in zip(compiled, plain, strict=True)) < 1e-5
    got = tierlift.zero.full_state_dict(model)
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), k
