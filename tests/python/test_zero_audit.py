"""Less-travelled tierlift.zero paths against plain torch on the same data, on 2 gloo ranks
(one spawn runs every case): weights= files that hold both names of a tied weight, or lack a
persistent buffer, or hold tensors the model's loader skips."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zero_model import TinyGPT, make_model, raised, spawn_ranks

import tierlift

pytest.importorskip("safetensors", reason="needs safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402


def _tied_file(rank: int, tmp: str) -> dict:
    """Files holding two different tensors under the two names of the model's tied weight:
    weights= keeps what torch's load_state_dict keeps (the last name in model order)."""
    path = os.path.join(tmp, "tied.safetensors")
    if rank == 0:
        sd = {k: v.clone() for k, v in make_model().state_dict().items()}
        sd["head.weight"] = sd["tok.weight"] + 1.0
        save_file(sd, path)
    dist.barrier()
    ref = make_model()
    ref.load_state_dict(load_file(path))
    out = {}
    for stage in (3, 1):
        with tierlift.zero.deferred_init():
            model = TinyGPT()
        model = tierlift.zero.shard(model, stage=stage, device="cpu", weights=path)
        sd = tierlift.zero.full_state_dict(model)
        out[stage] = [k for k, v in ref.state_dict().items() if not torch.equal(v, sd[k])]
    return out


class _BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.a(x))


def _missing_buffer(rank: int, tmp: str) -> dict:
    """Files without BatchNorm's running_mean: torch's strict load refuses the missing key;
    shard() kept the constructed zeros. Refused before anything changes, with a deferred_init()
    model (whose recording would make the zeros) and an init_empty_weights() one (real
    buffers)."""
    path = os.path.join(tmp, "bn.safetensors")
    if rank == 0:
        torch.manual_seed(0)
        m = _BN()
        m(torch.randn(16, 6))  # running statistics that differ from the constructed ones
        save_file({k: v for k, v in m.state_dict().items() if k != "bn.running_mean"}, path)
    dist.barrier()
    out = {"torch": raised(lambda: _BN().load_state_dict(load_file(path)))}
    from accelerate import init_empty_weights

    for how, ctx in (("deferred", tierlift.zero.deferred_init), ("empty", init_empty_weights)):
        with ctx():
            model = _BN()
        before = {n: (t.device, t.shape) for n, t in [*model.named_parameters(),
                                                         *model.named_buffers()]}
        out[how] = raised(lambda m=model: tierlift.zero.shard(m, stage=3, device="cpu",
                                                              weights=path))
        out[how + "-unchanged"] = before == {
            n: (t.device, t.shape) for n, t in [*model.named_parameters(),
                                                 *model.named_buffers()]} and not hasattr(
            model, "_tierlift_zero")
    return out


class _OldMasks(_BN):
    """A model whose files may hold tensors its loader skips, as Hugging Face's GPT-2 lists
    the attn.bias masks older checkpoints saved."""

    _keys_to_ignore_on_load_unexpected = [r"\.attn\.bias$"]


def _ignored_names(rank: int, tmp: str) -> dict:
    """Files holding a tensor named in the model's _keys_to_ignore_on_load_unexpected load (as
    from_pretrained skips it); any other extra tensor is still refused."""
    path, other = os.path.join(tmp, "masks.safetensors"), os.path.join(tmp, "other.safetensors")
    if rank == 0:
        torch.manual_seed(0)
        sd = dict(_OldMasks().state_dict())
        save_file({**sd, "h.0.attn.bias": torch.ones(4, 4)}, path)
        save_file({**sd, "h.0.mlp.bias": torch.ones(4)}, other)
    dist.barrier()
    ref = _OldMasks()
    ref.load_state_dict({k: v for k, v in load_file(path).items() if "attn" not in k})
    with tierlift.zero.deferred_init():
        model = _OldMasks()
    model = tierlift.zero.shard(model, stage=3, device="cpu", weights=path)
    sd = tierlift.zero.full_state_dict(model)
    with tierlift.zero.deferred_init():
        refused = _OldMasks()
    return {"same": all(torch.equal(v, sd[k]) for k, v in ref.state_dict().items()),
            "other": raised(lambda: tierlift.zero.shard(refused, stage=3, device="cpu",
                                                        weights=other))}


def _cases(rank: int, world: int, tmp: str) -> dict:
    return {"tied_file": _tied_file(rank, tmp), "missing_buffer": _missing_buffer(rank, tmp),
            "ignored": _ignored_names(rank, tmp)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("audit")))


def test_weights_tied_names_last_wins(ranks):
    for res in ranks:
        assert res["tied_file"] == {3: [], 1: []}


def test_weights_missing_persistent_buffer_refused(ranks):
    for res in ranks:
        r = res["missing_buffer"]
        assert "Missing key(s)" in r["torch"] and "bn.running_mean" in r["torch"]
        for how in ("deferred", "empty"):
            assert r[how].startswith("KeyError") and "'bn.running_mean'" in r[how], r[how]
            assert "persistent buffer" in r[how]
            assert r[how + "-unchanged"]


def test_weights_skip_what_the_models_loader_ignores(ranks):
    for res in ranks:
        assert res["ignored"]["same"]
        assert "h.0.mlp.bias" in res["ignored"]["other"], res["ignored"]["other"]
