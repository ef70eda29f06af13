"""peft's merge_and_unload / unload / merge_adapter / unmerge_adapter / delete_adapter on a
model sharded by tierlift.zero.shard: refused before anything changes, at every stage (peft
would otherwise merge the first layer in place, or drop adapters, before a later step fails).
Merging before shard() still works.

One spawn of a single gloo rank runs every case; each compares the sharded model's full
weights and output after the refused call with a plain copy of the model taken before
shard()."""

from __future__ import annotations

import copy

import pytest
import torch
from zero_model import raised, spawn_ranks

import tierlift

pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

STAGES = (1, 2, 3)
CALLS = ("merge_and_unload", "unload", "merge_adapter", "delete_adapter", "unmerge_adapter")


def _merged_layers(model) -> int:
    return sum(getattr(m, "merged", False) is True for m in model.modules())


def _call(model, name):
    args = ("default",) if name == "delete_adapter" else ()
    return lambda: getattr(model, name)(*args)


def _case(stage: int, name: str, x) -> dict:
    from test_zero_frozen import _peft_model

    model = _peft_model()
    if name == "unmerge_adapter":
        model.merge_adapter()  # merged before shard(): unmerging would write the shards' weights
    plain = copy.deepcopy(model)
    want = plain(input_ids=x).logits.detach()
    model = tierlift.zero.shard(model, stage=stage)
    error = raised(_call(model, name))
    try:  # without the guard, the changed model may fail here: report it, as a wrong result
        full = tierlift.zero.full_state_dict(model)
        ref = plain.state_dict()
        return {
            "error": error,
            "keys_same": list(full) == list(ref),
            "weights_diff": max((full[k] - ref[k]).abs().max().item() for k in ref if k in full),
            "out_diff": (model(input_ids=x).logits.detach() - want).abs().max().item(),
            "merged": (_merged_layers(model), _merged_layers(plain)),
            "adapters": sorted(getattr(model, "peft_config", {})),
        }
    except Exception as e:  # noqa: BLE001 - sent back to the test
        return {"error": error, "after": f"{type(e).__name__}: {e}"}


def _unmerged_unmerge(stage: int, x) -> dict:
    """unmerge_adapter with nothing merged changes nothing, so it is let through."""
    from test_zero_frozen import _peft_model

    model = _peft_model()
    want = model(input_ids=x).logits.detach()
    model = tierlift.zero.shard(model, stage=stage)
    error = raised(model.unmerge_adapter)
    return {"error": error,
            "out_diff": (model(input_ids=x).logits.detach() - want).abs().max().item()}


def _merge_then_shard(stage: int, x) -> dict:
    from test_zero_frozen import _peft_model

    model = _peft_model()
    want = model(input_ids=x).logits.detach()
    merged = model.merge_and_unload().requires_grad_(True)  # the base, to train on in full
    plain = copy.deepcopy(merged)
    sharded = tierlift.zero.shard(merged, stage=stage)
    full = tierlift.zero.full_state_dict(sharded)
    return {"merged_vs_adapter": (plain(input_ids=x).logits.detach() - want).abs().max().item(),
            "out_diff": (sharded(input_ids=x).logits.detach() - want).abs().max().item(),
            "weights_diff": max((full[k] - v).abs().max().item()
                                for k, v in plain.state_dict().items())}


def _cases(rank, world, tmp):
    torch.manual_seed(1)
    x = torch.randint(0, 32, (2, 8))
    return {"calls": {(s, n): _case(s, n, x) for s in STAGES for n in CALLS},
            "no_op_unmerge": {s: _unmerged_unmerge(s, x) for s in STAGES},
            "before_shard": {s: _merge_then_shard(s, x) for s in STAGES}}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("peft_merge")), world=1)[0]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", CALLS)
def test_refused_before_any_change(results, stage, name):
    got = results["calls"][(stage, name)]
    assert "after" not in got, got["after"]
    assert got["error"].startswith(f"RuntimeError: peft's {name} on a model sharded by "
                                   "tierlift.zero.shard"), got["error"]
    assert "before tierlift.zero.shard(model)" in got["error"]
    assert "full_state_dict" in got["error"] and "nothing was changed" in got["error"]
    assert got["keys_same"]
    assert got["weights_diff"] == 0.0
    assert got["out_diff"] <= 1e-6
    assert got["merged"][0] == got["merged"][1]  # no layer's merged flag changed
    assert got["adapters"] == ["default"]


@pytest.mark.parametrize("stage", STAGES)
def test_unmerge_with_nothing_merged_passes(results, stage):
    got = results["no_op_unmerge"][stage]
    assert got["error"] == "<no error>"
    assert got["out_diff"] <= 1e-6


@pytest.mark.parametrize("stage", STAGES)
def test_merge_before_shard(results, stage):
    got = results["before_shard"][stage]
    assert got["merged_vs_adapter"] <= 1e-5
    assert got["out_diff"] <= 1e-5
    assert got["weights_diff"] == 0.0
