"""An offloaded tierlift.optim.AdamW reserves no optimizer state (host RAM, NVMe) for frozen
parameters, as torch creates none for a parameter without gradients: on a ZeRO model with half
of its weights frozen (stage 1: frozen weights stay plain parameters; stage 3: frozen units)
it reserves exactly what an optimizer given only the trainable parameters reserves (in one
process: about half of the all-trainable model's), and trains as torch.optim.AdamW does. A
parameter unfrozen after the optimizer was built (or given state by a load) is refused with what
to do."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from zero_model import free_port, init_gloo, shutdown

import tierlift

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

WIDTH, LAYERS, STEPS, BATCH, WORLD = 96, 4, 3, 8, 2
OPT = dict(lr=1e-2, weight_decay=0.1)
CONFIGS = {"s1-cpu": (1, "cpu"), "s1-nvme": (1, "nvme"), "s3-cpu": (3, "cpu"),
           "s3-nvme": (3, "nvme")}


def make_net(frozen: bool) -> nn.Module:
    """LAYERS equal Linear layers; frozen=True freezes every other one (half the weights)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                          for _ in range(LAYERS)])
    if frozen:
        for i in range(0, LAYERS, 2):
            net[i].requires_grad_(False)
    return net


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
            for _ in range(STEPS)]


def fit(model, opt, world: int = 1, rank: int = 0) -> list[float]:
    losses = []
    for x, y in data():
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def reserved(opt) -> int:
    """Bytes the offloaded state holds: host memory and NVMe files of every tier."""
    return sum(getattr(t, "resident_bytes", 0) + getattr(t, "disk_bytes", 0)
               for t in opt._offload.tiers)


def _adamw(params, offload: str, path: str):
    kw = {"nvme_path": path} if offload == "nvme" else {}
    return tierlift.optim.AdamW(params, offload=offload, **kw, **OPT)


def _worker(rank, world, port, tmp):
    init_gloo(rank, world, port)
    out = {}
    for name, (stage, offload) in CONFIGS.items():
        path = os.path.join(tmp, f"nvme-{name}-{rank}")
        os.makedirs(path)
        sizes = {}
        for case in ("half", "trainable_only"):
            model = tierlift.zero.shard(make_net(frozen=True), stage=stage)
            params = [p for p in model.parameters()
                      if case != "trainable_only" or p.requires_grad]
            opt = _adamw(params, offload, path)
            sizes[case] = reserved(opt)
            if case == "half":
                out[f"{name}_losses"] = fit(model, opt, world, rank)
                out[f"{name}_state"] = tierlift.zero.full_state_dict(model)
                out[f"{name}_has_state"] = sorted(
                    i for i, p in enumerate(params) if opt.state.get(p))
                out[f"{name}_frozen"] = sorted(
                    i for i, p in enumerate(params) if not p.requires_grad)
            opt.close()
            tierlift.zero.close(model)
        out[f"{name}_sizes"] = sizes
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))
    shutdown()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero_frozen_state"))
    mp.spawn(_worker, args=(WORLD, free_port(), tmp), nprocs=WORLD)
    return [torch.load(os.path.join(tmp, f"out{r}.pt"), weights_only=False)
            for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference():
    model = make_net(frozen=True)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    return fit(model, opt), model.state_dict()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_frozen_shards_reserve_no_state(ranks, name):
    for out in ranks:
        sizes = out[f"{name}_sizes"]
        assert sizes["half"] == sizes["trainable_only"] > 0, sizes
        assert out[f"{name}_frozen"]  # the optimizer was given frozen parameters
        assert not set(out[f"{name}_frozen"]) & set(out[f"{name}_has_state"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_half_frozen_trains_as_torch(ranks, reference, name):
    ref_losses, ref_state = reference
    for out in ranks:
        torch.testing.assert_close(torch.tensor(out[f"{name}_losses"]),
                                   torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for k, v in ref_state.items():
            torch.testing.assert_close(out[f"{name}_state"][k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_one_process_reserves_half_and_equals_torch(tmp_path, offload):
    model, ref = make_net(frozen=True), make_net(frozen=True)
    opt = _adamw(model.parameters(), offload, str(tmp_path))
    full = _adamw(make_net(frozen=False).parameters(), offload, str(tmp_path))
    assert 0.4 < reserved(opt) / reserved(full) < 0.6
    fit(model, opt)
    fit(ref, torch.optim.AdamW(ref.parameters(), **OPT))
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    assert not opt.state.get(model[0][0].weight)


def test_unfrozen_later_is_refused(tmp_path):
    model = make_net(frozen=True)
    opt = _adamw(model.parameters(), "cpu", str(tmp_path))
    fit(model, opt)
    # A state dict with state for the frozen layers (from an all-trainable run) is refused.
    other = make_net(frozen=False)
    other_opt = tierlift.optim.AdamW(other.parameters(), **OPT)
    fit(other, other_opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'params'\]\[0\] was frozen \(requires_grad=False\) "
                                         "when the optimizer was built"):
        opt.load_state_dict(other_opt.state_dict())
    # Unfrozen after the optimizer was built: step() refuses before changing anything.
    model[0].requires_grad_(True)
    x, y = data()[0]
    F.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="Unfreeze it before building the optimizer"):
        opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
