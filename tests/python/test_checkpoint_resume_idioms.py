"""Resumes as users write them, each against torch.save/torch.load of the plain model and
torch.optim.AdamW (same seeds, same data): the optimizer's state loaded before the weights or
after them, or with the model and optimizer in one load(); another offload tier than the
one saved (cpu to nvme and back); a model cast with .to(torch.bfloat16) since; a model with
new parameters (load() refuses it and changes nothing; strict=False through
full_state_dict() takes what the checkpoint has); two saves of one path in one step, and a
save while the save of another path is still in flight; a save whose writer fails after some
files leaves the checkpoint before it to resume from exactly."""

from __future__ import annotations

import copy

import pytest
import torch

import tierlift
from tierlift.checkpoint import writer as ckpt_writer
from tierlift.optim import AdamW

HYPER = dict(lr=1e-2, weight_decay=0.01)
TOL = dict(rtol=0, atol=1e-6)  # tierlift's AdamW against torch's, a few steps


def _model(seed: int = 0, head: bool = False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if head:
        model.add_module("head", torch.nn.Linear(4, 2))
    return model


def _optimizer(model, tier: str, tmp_path):
    if tier == "torch":
        return torch.optim.AdamW(model.parameters(), **HYPER)
    nvme = dict(nvme_path=str(tmp_path)) if tier == "nvme" else {}
    return AdamW(model.parameters(), **HYPER, offload=tier, **nvme)


def _steps(model, opt, first: int, last: int) -> None:
    dtype = next(model.parameters()).dtype
    for i in range(first, last):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + i))
        model(x.to(dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _close(opt) -> None:
    if hasattr(opt, "close"):
        opt.close()


def _torch_resumed(dtype=torch.float32):
    """Plain torch: 2 steps, torch.save/torch.load of model and AdamW into a fresh pair (cast
    to `dtype` first), 2 more steps."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    _steps(model, opt, 0, 2)
    saved = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    again = _model(1).to(dtype)
    opt = torch.optim.AdamW(again.parameters(), **HYPER)
    again.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    _steps(again, opt, 2, 4)
    return again


def _close_to(model, want) -> None:
    for (name, a), b in zip(model.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def _saved(tmp_path, tier: str) -> str:
    model = _model()
    opt = _optimizer(model, tier, tmp_path)
    _steps(model, opt, 0, 2)
    ck = str(tmp_path / f"ck_{tier}")
    tierlift.checkpoint.save(ck, model, opt)
    _close(opt)
    return ck


LOADS = {
    "load": lambda ck, m, o: tierlift.checkpoint.load(ck, m, o),
    "optimizer_first": lambda ck, m, o: (
        o.load_state_dict(tierlift.checkpoint.optimizer_state_dict(ck)),
        m.load_state_dict(tierlift.checkpoint.full_state_dict(ck))),
    "weights_first": lambda ck, m, o: (
        m.load_state_dict(tierlift.checkpoint.full_state_dict(ck)),
        o.load_state_dict(tierlift.checkpoint.optimizer_state_dict(ck))),
}


@pytest.mark.parametrize("saved,loaded,how", [
    ("cpu", "nvme", "load"), ("nvme", "cpu", "load"), ("cpu", "cpu", "optimizer_first"),
    ("nvme", "nvme", "weights_first"), ("none", "cpu", "optimizer_first"),
])
def test_a_resume_in_either_order_and_on_another_tier_continues_as_torch(tmp_path, saved,
                                                                         loaded, how):
    ck = _saved(tmp_path, saved)
    model = _model(1)
    opt = _optimizer(model, loaded, tmp_path)
    LOADS[how](ck, model, opt)
    _steps(model, opt, 2, 4)
    _close_to(model, _torch_resumed())
    _close(opt)


@pytest.mark.parametrize("tier", ["none", "cpu"])
def test_an_fp32_checkpoint_into_a_bf16_model_takes_the_weights_as_torch_casts_them(tmp_path,
                                                                                    tier):
    ck = _saved(tmp_path, "none")
    model = _model(1).to(torch.bfloat16)
    opt = _optimizer(model, tier, tmp_path)
    tierlift.checkpoint.load(ck, model, opt)
    want = _torch_resumed(torch.bfloat16)  # its load_state_dict casts the same way
    saved = tierlift.checkpoint.full_state_dict(ck)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, saved[name].bfloat16()), name
    # tierlift keeps the moments and an fp32 master (torch: bf16 moments, no master), so the
    # steps after differ from torch's by bf16 rounding; every tier takes the same ones
    _steps(model, opt, 2, 4)
    for a, b in zip(model.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
    other = _model(1).to(torch.bfloat16)
    other_opt = _optimizer(other, "cpu" if tier == "none" else "none", tmp_path)
    tierlift.checkpoint.load(ck, other, other_opt)
    _steps(other, other_opt, 2, 4)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    _close(opt)
    _close(other_opt)


def test_a_model_with_new_parameters(tmp_path):
    ck = _saved(tmp_path, "none")
    model = _model(1, head=True)
    opt = _optimizer(model, "none", tmp_path)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="'head.weight' exists only in the model"):
        tierlift.checkpoint.load(ck, model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt.state
    # strict=False takes the saved weights, as torch's does from a torch.save'd state dict
    saved = tierlift.checkpoint.full_state_dict(ck)
    got = model.load_state_dict(saved, strict=False)
    plain = _model(1, head=True)
    want = plain.load_state_dict(copy.deepcopy(saved), strict=False)
    assert got == want and got.missing_keys == ["head.weight", "head.bias"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, plain.state_dict()[k]), k
        assert torch.equal(v, saved[k] if k in saved else before[k]), k


def test_saves_of_one_path_in_one_step_and_of_another_in_flight(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu", tmp_path)
    _steps(model, opt, 0, 2)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tierlift.checkpoint.save(a, model, opt, extra={"n": 1}, blocking=False)
    tierlift.checkpoint.save(a, model, opt, extra={"n": 2})  # the same step, at once
    tierlift.checkpoint.save(b, model, opt, extra={"n": 3}, blocking=False)
    tierlift.checkpoint.save(a, model, opt, extra={"n": 4}, blocking=False)  # b in flight
    _steps(model, opt, 2, 3)  # training goes on while a is written
    tierlift.checkpoint.close()
    want = _torch_resumed()
    for ck, n in ((a, 4), (b, 3)):
        again = _model(1)
        again_opt = _optimizer(again, "cpu", tmp_path)
        assert tierlift.checkpoint.load(ck, again, again_opt) == {"n": n}
        _steps(again, again_opt, 2, 4)
        _close_to(again, want)
        _close(again_opt)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name in ("a", "b")) == ["a", "b"]
    _close(opt)


def test_a_save_whose_writer_fails_midway_leaves_the_one_before_exact(tmp_path, monkeypatch):
    model = _model()
    opt = _optimizer(model, "cpu", tmp_path)
    _steps(model, opt, 0, 2)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
    submit, written = ckpt_writer.Writer._submit, []

    def dies_after_some(self, buf, runs):
        submit(self, buf, runs[:3])  # some files of the new save written, then it dies
        written.extend(r.out.path for r in runs[:3])
        raise RuntimeError("writer died")

    monkeypatch.setattr(ckpt_writer.Writer, "_submit", dies_after_some)
    _steps(model, opt, 2, 3)
    with pytest.raises(RuntimeError, match="writer died"):
        tierlift.checkpoint.save(ck, model, opt, extra={"step": 3})
    monkeypatch.undo()
    assert len(written) == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ck")) == ["ck"]
    again = _model(1)
    again_opt = _optimizer(again, "cpu", tmp_path)
    assert tierlift.checkpoint.load(ck, again, again_opt) == {"step": 2}
    _steps(again, again_opt, 2, 4)
    _close_to(again, _torch_resumed())
    _close(again_opt)
    _close(opt)
