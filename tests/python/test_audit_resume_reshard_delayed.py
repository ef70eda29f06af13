"""A ZeRO-3 model with FP8 delayed-scaling layers, saved by tierlift.checkpoint on 2 gloo ranks
(spawned) and resumed on 1: the weights and losses follow the 2-rank run (to float summation
order), the saved amax histories come back exactly, and the 1-rank steps add grad_output amaxes
of half the 2-rank size (each rank's mean loss is over half the batch), older entries kept."""

from __future__ import annotations

import torch
from torch import nn
from zero_model import spawn_ranks

import tierlift
from tierlift.lowp import convert

GEN = torch.Generator().manual_seed(4)
XS = [torch.randn(8, 32, generator=GEN) * c for c in (0.5, 0.8, 1.5, 0.3, 1.0, 0.6)]
SPLIT = 3
TOL = dict(rtol=1e-5, atol=1e-7)  # 2 ranks average their halves' gradients: another order


def _build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    convert(model, "fp8-tensorwise-delayed", min_features=0)
    model = tierlift.zero.shard(model, stage=3, min_unit_numel=1)
    return model, tierlift.optim.AdamW(model.parameters(), lr=1e-2, offload="cpu",
                                       overlap=True, device_fraction=0.3)


def _train(model, opt, xs, world: int = 1, rank: int = 0):
    import torch.distributed as dist

    losses = []
    for x in xs:
        opt.zero_grad()
        loss = model(x.chunk(world)[rank]).square().mean()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total)
    return losses


def _on_two(rank, world, tmp):
    torch.set_num_threads(1)
    model, opt = _build(0)
    _train(model, opt, XS[:SPLIT], world, rank)
    tierlift.checkpoint.save(f"{tmp}/ck", model, opt)
    saved = {k: v.clone() for k, v in tierlift.zero.full_state_dict(model).items()}
    losses = _train(model, opt, XS[SPLIT:], world, rank)
    return {"losses": losses, "saved": saved, "full": tierlift.zero.full_state_dict(model)}


def test_two_ranks_to_one(tmp_path, one_thread):
    two = spawn_ranks(_on_two, str(tmp_path))[0]
    model, opt = _build(9)
    tierlift.checkpoint.load(str(tmp_path / "ck"), model, opt)
    loaded = tierlift.zero.full_state_dict(model)
    for k, v in two["saved"].items():
        assert torch.equal(loaded[k], v), k
    losses = _train(model, opt, XS[SPLIT:])
    torch.testing.assert_close(torch.stack(losses), torch.stack(two["losses"]), **TOL)
    full = tierlift.zero.full_state_dict(model)
    n = len(XS) - SPLIT
    for k, v in two["full"].items():
        if k.endswith("amax_history_x"):
            assert torch.equal(full[k], v), k
        elif k.endswith("amax_history_g"):
            torch.testing.assert_close(full[k][:n] * 2, v[:n], **TOL)
            assert torch.equal(full[k][n:], two["saved"][k][:-n]), k
        else:
            torch.testing.assert_close(full[k], v, **TOL)
