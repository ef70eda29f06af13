"""A submodule's .parameters() after tierlift.zero.shard (one process): when it is a whole set of
units, clipping it (clip_grad_norm_, clip_grad_value_) gives torch's result on the unsharded
model; when some of the submodule's parameters live in an enclosing unit (a Llama's
model.model.norm.weight, in the root unit), clipping it, or building an optimizer group of it
with other settings, is refused before any gradient changes, naming what would be left out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from zero_model import batches, make_model

import tierlift
import tierlift.hf
from tierlift.zero import torch_calls

LOSSY_UNITS = ["blocks.0.fc", "blocks.1", "blocks.2"]  # blocks.0's other layers: root unit


def _backward(model, x):
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()


def _pair(units=None):
    x = batches(1, 4)[0]
    ref = make_model()
    _backward(ref, x)
    model = tierlift.zero.shard(make_model(), stage=3, units=units)
    _backward(model, x)
    return ref, model


def _norm(params) -> float:
    """The 2-norm of the local gradients, not through torch's (wrapped) clip_grad."""
    return sum(float(p.grad.double().square().sum()) for p in params
               if p.grad is not None) ** 0.5


@pytest.mark.parametrize("pick", [lambda m: m.blocks[0], lambda m: m.blocks])
def test_whole_units_clip_as_torch(pick):
    ref, model = _pair()
    want = torch.nn.utils.clip_grad_norm_(pick(ref).parameters(), 0.1)
    got = torch.nn.utils.clip_grad_norm_(pick(model).parameters(), 0.1)
    torch.testing.assert_close(got, want)
    # only the subset was scaled, as torch scales it: the whole model's norms agree after
    assert _norm(model.parameters()) == pytest.approx(_norm(ref.parameters()), rel=1e-5)
    got = tierlift.hf.clip_grad_norm_(list(pick(model).parameters()), float("inf"))
    assert float(got) == pytest.approx(0.1, rel=1e-4)


def test_whole_units_clip_value_as_torch():
    ref, model = _pair()
    torch.nn.utils.clip_grad_value_(ref.blocks[1].parameters(), 1e-3)
    torch.nn.utils.clip_grad_value_(model.blocks[1].parameters(), 1e-3)
    assert _norm(model.parameters()) == pytest.approx(_norm(ref.parameters()), rel=1e-5)


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("call", [
    lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1e-3),
    lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1e9),
    lambda ps: torch.nn.utils.get_total_norm([p.grad for p in ps]),
    lambda ps: torch.nn.utils.clip_grad_value_(ps, 1e-6),
    lambda ps: torch.nn.utils.clip_grads_with_norm_(ps, 1e-3, torch.tensor(1.0)),
    lambda ps: tierlift.hf.Accelerator(cpu=True).clip_grad_norm_(ps, 1e-3),
    lambda ps: tierlift.hf.clip_grad_norm_(ps, 1e9),
], ids=["clip_norm", "clip_norm_inactive", "get_total_norm", "clip_value",
        "clip_with_norm", "accelerator", "hf_inactive"])
def test_lossy_subset_refused_nothing_changed(call):
    ref, model = _pair(LOSSY_UNITS)
    # torch's norm of blocks.0 differs from the norm of the fc shard it yields after shard()
    assert _norm(model.blocks[0].parameters()) != pytest.approx(_norm(ref.blocks[0].parameters()))
    before = _grads(model)
    with pytest.raises(ValueError, match=r"blocks\.0\.ln1\.weight.*units="):
        call(list(model.blocks[0].parameters()))
    for a, b in zip(_grads(model), before, strict=True):
        assert torch.equal(a, b)
    # the other units are whole blocks: still exact
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model.blocks[1].parameters(), 1e9),
                               torch.nn.utils.clip_grad_norm_(ref.blocks[1].parameters(), 1e9))


@pytest.mark.parametrize("make", [torch.optim.AdamW, tierlift.optim.AdamW])
def test_lossy_param_group(make):
    model = tierlift.zero.shard(make_model(), stage=3, units=LOSSY_UNITS)
    rest = [p for p in model.parameters()
            if p.requires_grad and all(p is not q for q in model.blocks[0].parameters())]
    with pytest.raises(ValueError, match=r"optimizer param group 0 .*blocks\.0\.ln1\.weight"):
        make([{"params": list(model.blocks[0].parameters()), "lr": 1e-2},
              {"params": rest, "lr": 1e-3}])
    # the same settings for what it lacks: the same steps as torch's
    make([{"params": list(model.blocks[0].parameters())}, {"params": rest}], lr=1e-3)
    ok = tierlift.zero.shard(make_model(), stage=3)  # blocks.0 a unit: loses nothing
    make([{"params": list(ok.blocks[0].parameters()), "lr": 1e-2},
          {"params": [p for p in ok.parameters() if p.requires_grad
                      and all(p is not q for q in ok.blocks[0].parameters())]}], lr=1e-3)


def test_check_cached(monkeypatch):
    _, model = _pair(LOSSY_UNITS)
    calls = []
    real = torch_calls._lossy_modules
    monkeypatch.setattr(torch_calls, "_lossy_modules", lambda *a: calls.append(1) or real(*a))
    for _ in range(3):
        torch.nn.utils.clip_grad_norm_(model.blocks[1].parameters(), 1e9)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # the whole model: no lookup
    assert len(calls) == 1


def test_llama_model_model_refused():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    z = tierlift.zero.shard(transformers.LlamaForCausalLM(config), stage=3)
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    ref(input_ids=x, labels=x).loss.backward()
    z(input_ids=x, labels=x).loss.backward()
    with pytest.raises(ValueError, match=r"'model'.*model\.norm\.weight"):
        tierlift.hf.clip_grad_norm_(list(z.model.parameters()), 1e-3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        torch.nn.utils.clip_grad_norm_(z.model.parameters(), 1e9)
    got = torch.nn.utils.clip_grad_norm_(z.model.layers.parameters(), 1e9)
    torch.testing.assert_close(got, torch.nn.utils.clip_grad_norm_(ref.model.layers.parameters(),
                                                                   1e9))
