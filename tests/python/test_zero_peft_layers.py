"""peft idioms beyond merge_and_unload on a model sharded by tierlift.zero.shard, at stages 1, 2
and 3 on 2 gloo ranks (one spawn), against the same script on one unsharded model.

Refused before anything changes (the model then trains as the unsharded one does): a LoRA
layer's own merge() / unmerge(), add_adapter, add_weighted_adapter, load_adapter (a new
adapter, or into one the model has, which would load nothing), switches that would make a
frozen adapter trainable (also on leaving disable_adapter()) or freeze the trained one in use,
save_pretrained without the full weights (an empty adapter file), get_peft_model_state_dict /
set_peft_model_state_dict on it (no adapter weight found or loaded), and on a model merged
before shard() any switch that unmerges.
Exact: evaluating the other adapter with inference_mode=True, disable_adapter() around a
reference forward while training, disable/enable_adapter_layers, and save_pretrained given
tierlift.zero.full_state_dict(model)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from zero_model import raised, spawn_ranks

import tierlift

pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

STAGES = (1, 2, 3)
WORLD = 2


def _config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj", "up_proj"])


def _two_adapters():
    """The tiny LoRA Llama with a second adapter, "other": frozen and inactive (as add_adapter
    leaves it), with an effect of its own."""
    from test_zero_frozen import _peft_model

    model = _peft_model()
    model.add_adapter("other", _config())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B.other" in n:
                p.normal_(std=0.05)
    return model


def _layers(model) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _snapshot(model) -> dict:
    layers = _layers(model)
    return {"adapters": sorted(model.peft_config), "active": model.active_adapter,
            "layers_active": [tuple(m.active_adapters) for m in layers],
            "disabled": [m.disable_adapters for m in layers],
            "merged": [tuple(m.merged_adapters) for m in layers],
            "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
            "modules": len(list(model.modules()))}


def _out(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def _refused_calls(model, saved: str, empty: str) -> dict:
    """Each refused idiom: (its error, whether the model is as it was after it). saved: an
    adapter saved by an unsharded model; empty: where save_pretrained must write nothing."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from peft.utils import load_peft_weights

    calls = {
        "merge": lambda: [m.merge() for m in _layers(model)],
        "set_adapter": lambda: model.base_model.set_adapter(["default", "other"]),
        "set_adapter other": lambda: model.set_adapter("other"),
        "set_adapter default frozen": lambda: model.set_adapter("default", inference_mode=True),
        "set_adapter per layer": lambda: [m.set_adapter("other") for m in _layers(model)],
        "set_requires_grad": lambda: model.set_requires_grad("other", True),
        "add_adapter": lambda: model.add_adapter("new", _config()),
        "add_weighted_adapter": lambda: model.add_weighted_adapter(
            ["default", "other"], [0.5, 0.5], "combo", combination_type="linear"),
        "load_adapter": lambda: model.load_adapter(saved, adapter_name="loaded"),
        "load_adapter existing": lambda: model.load_adapter(saved, adapter_name="default",
                                                            is_trainable=True),
        "save_pretrained": lambda: model.save_pretrained(empty),
        "get_peft_model_state_dict": lambda: get_peft_model_state_dict(model),
        "set_peft_model_state_dict": lambda: set_peft_model_state_dict(
            model, load_peft_weights(saved)),
    }
    before = _snapshot(model)
    out = {}
    for name, call in calls.items():
        error = raised(call)
        out[name] = (error, _snapshot(model) == before)
    out["nothing written"] = not os.path.exists(empty)
    return out


def _allowed(model, x, halves, step) -> list[torch.Tensor]:
    """Evaluate the other adapter, then train with a disable_adapter() reference forward and
    evaluate with the adapter layers disabled: the outputs seen on the way."""
    seen = []
    model.set_adapter("other", inference_mode=True)
    seen.append(_out(model, x))
    model.set_adapter("default")
    seen.append(_out(model, x))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        with model.disable_adapter(), torch.no_grad():
            seen.append(model(input_ids=x).logits)
        step(model, halves)
        opt.step()
    model.base_model.disable_adapter_layers()
    seen.append(_out(model, x))
    model.base_model.enable_adapter_layers()
    seen.append(_out(model, x))
    return seen


def _stage(stage: int, rank: int, tmp: str, x) -> dict:
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    halves = x.chunk(WORLD)
    model = _two_adapters()
    plain = copy.deepcopy(model)
    model = tierlift.zero.shard(model, stage=stage)
    out = {"refused": _refused_calls(model, os.path.join(tmp, "adapter"),
                                     os.path.join(tmp, f"empty{stage}-{rank}"))}

    def plain_step(m, parts):  # the ranks average the mean losses of their halves
        (sum(m(input_ids=h, labels=h).loss for h in parts) / WORLD).backward()

    def sharded_step(m, parts):
        m(input_ids=parts[rank], labels=parts[rank]).loss.backward()

    want = _allowed(plain, x, halves, plain_step)
    got = _allowed(model, x, halves, sharded_step)
    out["allowed_diff"] = max((a - b).abs().max().item() for a, b in zip(want, got, strict=True))
    full = tierlift.zero.full_state_dict(model)  # a collective: every rank
    ref = plain.state_dict()
    out["weights_diff"] = max((full[k] - ref[k]).abs().max().item() for k in ref)
    out["trained"] = (want[-1] - want[1]).abs().max().item()  # the adapter did change
    path = os.path.join(tmp, f"saved{stage}")
    if rank == 0:
        model.save_pretrained(path, state_dict=full)
    dist.barrier()
    written = load_file(os.path.join(path, "adapter_model.safetensors"))
    expect = get_peft_model_state_dict(plain)
    out["saved_keys_same"] = sorted(written) == sorted(expect)
    out["saved_diff"] = max((written[k] - expect[k]).abs().max().item() for k in expect)
    out["merged"] = _merged_before_shard(stage, x)
    out["frozen_active"] = _frozen_active(stage, x)
    return out


def _merged_before_shard(stage: int, x) -> dict:
    """A model merged before shard(): a switch that would unmerge it is refused."""
    from test_zero_frozen import _peft_model

    model = _peft_model()
    model.merge_adapter()
    want = _out(model, x)
    model = tierlift.zero.shard(model, stage=stage)
    before = _snapshot(model)

    def disabled_forward():
        with model.disable_adapter():
            model(input_ids=x)

    errors = {"disable_adapter": raised(disabled_forward),
              "unmerge": raised(lambda: [m.unmerge() for m in _layers(model)]),
              "set_adapter": raised(lambda: model.set_adapter("default"))}
    return {"errors": errors, "same": _snapshot(model) == before,
            "out_diff": (_out(model, x) - want).abs().max().item()}


def _frozen_active(stage: int, x) -> dict:
    """The active adapter frozen before shard() (another one trains): leaving disable_adapter()
    or enable_adapter_layers() would set it trainable, so both are refused up front."""
    model = _two_adapters()
    model.set_requires_grad("default", False)
    model.set_requires_grad("other", True)
    want = _out(model, x)
    model = tierlift.zero.shard(model, stage=stage)
    model.base_model.disable_adapter_layers()  # freezes nothing in use: let through
    disabled = _out(model, x)
    before = _snapshot(model)

    def reference_forward():
        with model.disable_adapter():
            model(input_ids=x)

    errors = {"disable_adapter": raised(reference_forward),
              "enable_adapter_layers": raised(model.base_model.enable_adapter_layers)}
    return {"errors": errors, "same": _snapshot(model) == before,
            "out_diff": (_out(model, x) - disabled).abs().max().item(),
            "adapter_had_effect": (want - disabled).abs().max().item()}


def _cases(rank, world, tmp):
    if rank == 0:  # an adapter to load, saved by an unsharded model
        from test_zero_frozen import _peft_model

        _peft_model().save_pretrained(os.path.join(tmp, "adapter"))
    dist.barrier()
    torch.manual_seed(1)
    x = torch.randint(0, 32, (4, 8))
    return {s: _stage(s, rank, tmp, x) for s in STAGES}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("peft_layers")), world=WORLD)


@pytest.mark.parametrize("stage", STAGES)
def test_refused_before_any_change(results, stage):
    for rank in range(WORLD):
        got = results[rank][stage]["refused"]
        for name, (error, same) in ((k, v) for k, v in got.items() if k != "nothing written"):
            call = name.split()[0]
            assert error.startswith(f"RuntimeError: peft's {call} on a model sharded by "
                                    "tierlift.zero.shard"), (name, error)
            assert "nothing was" in error, (name, error)
            assert same, name
        assert got["nothing written"]


@pytest.mark.parametrize("stage", STAGES)
def test_refusals_say_what_to_do(results, stage):
    got = {k: v[0] for k, v in results[0][stage]["refused"].items() if k != "nothing written"}
    assert "before tierlift.zero.shard(model)" in got["merge"]
    assert "frozen when tierlift.zero.shard() ran" in got["set_adapter"]
    assert "inference_mode=True" in got["set_adapter other"]
    assert "torch.no_grad()" in got["set_adapter default frozen"]
    assert "would load nothing" in got["load_adapter existing"]
    assert "PeftModel.from_pretrained" in got["add_weighted_adapter"]
    assert "state_dict=full" in got["save_pretrained"]
    assert "state_dict=tierlift.zero.full_state_dict(model)" in got["get_peft_model_state_dict"]
    assert "would load nothing" in got["set_peft_model_state_dict"]


@pytest.mark.parametrize("stage", STAGES)
def test_switches_that_keep_trainability_are_exact(results, stage):
    for rank in range(WORLD):
        got = results[rank][stage]
        assert got["trained"] > 1e-3
        assert got["allowed_diff"] <= 1e-5, got["allowed_diff"]
        assert got["weights_diff"] <= 1e-6, got["weights_diff"]


@pytest.mark.parametrize("stage", STAGES)
def test_save_pretrained_given_full_weights(results, stage):
    got = results[0][stage]
    assert got["saved_keys_same"]
    assert got["saved_diff"] == 0.0


@pytest.mark.parametrize("stage", STAGES)
def test_merged_model_refuses_switches(results, stage):
    got = results[0][stage]["merged"]
    for name, error in got["errors"].items():
        assert error.startswith(f"RuntimeError: peft's {name} on a model sharded by "
                                "tierlift.zero.shard"), (name, error)
    assert got["same"]
    assert got["out_diff"] <= 1e-6


@pytest.mark.parametrize("stage", STAGES)
def test_frozen_active_adapter_is_not_set_trainable(results, stage):
    got = results[0][stage]["frozen_active"]
    for name, error in got["errors"].items():
        assert error.startswith(f"RuntimeError: peft's {name} on a model sharded by "
                                "tierlift.zero.shard would make adapter 'default'"), error
    assert got["same"]
    assert got["adapter_had_effect"] > 1e-3
    assert got["out_diff"] <= 1e-6
