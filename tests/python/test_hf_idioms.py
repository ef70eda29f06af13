"""Everyday Accelerate / Trainer idioms on a model sharded by tierlift.zero.shard, against the
same script without tierlift: one spawn of 2 gloo ranks runs every case, one process gives
the references.

- accelerator.register_save_state_pre_hook / register_load_state_pre_hook: the hooks
  (diffusers' scripts save each model there, pop its weights, and load it back by position)
  see every prepared model, the sharded one too (with its full weights when saving).
- A frozen base with hand-written LoRA adapters, accelerator.accumulate over a prepared loader
  whose last accumulation is short, clip_grad_value_: the same weights as one process.
- Trainer with activation (gradient) checkpointing and an epoch whose micro-batches are not a
  multiple of gradient_accumulation_steps: the same losses and weights as one process.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_worker as W  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

ACCUM_LORA, ROWS_LORA, CLIP_VALUE = 4, 24, 0.01  # 6 micro-batches per rank: the last step has 2


class _Lora(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def _lora_llama():
    model = W.build("llama")
    model.requires_grad_(False)
    torch.manual_seed(5)
    for layer in model.model.layers:
        layer.self_attn.q_proj = _Lora(layer.self_attn.q_proj)
        layer.self_attn.v_proj = _Lora(layer.self_attn.v_proj)
    return model


def _lora_loop(model, opt, accelerator, loader) -> None:
    for x in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=x, labels=x).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_value_(model.parameters(), CLIP_VALUE)
            opt.step()
            opt.zero_grad()


def _trainer_args(out: str, batch: int):
    # 64 rows, 4 per global micro-batch: 16 micro-batches, the sixth step takes one
    return W.training_args(out, batch=batch, max_steps=-1, num_train_epochs=1,
                           gradient_accumulation_steps=3, save_strategy="no",
                           activation_checkpointing=True)


def _fresh_accelerate() -> None:
    import accelerate

    accelerate.state.AcceleratorState._reset_state(True)


def _save_hook_case(rank: int, tmp: str) -> dict:
    from safetensors.torch import load_file, save_file

    import tierlift.hf

    _fresh_accelerate()
    model = tierlift.zero.shard(W.build("llama"), stage=3)
    torch.manual_seed(7)
    head = torch.nn.Linear(4, 3)  # an unsharded model prepared next to it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = tierlift.hf.Accelerator(cpu=True)
    model, head, opt = accelerator.prepare(model, head, opt)
    seen = []

    def hook(models, weights, output_dir):
        seen.append(len(models))
        if accelerator.is_main_process:
            save_file(weights[0], os.path.join(output_dir, "hooked.safetensors"))
        weights.pop(0)  # written here: accelerate leaves it out

    def load_hook(models, input_dir):  # takes its model by position, as it saved it
        model = models.pop(0)
        loaded.append(tierlift.zero.is_shard(next(model.parameters())))
        model.load_state_dict(load_file(os.path.join(input_dir, "hooked.safetensors")))

    loaded = []
    accelerator.register_save_state_pre_hook(hook)
    accelerator.register_load_state_pre_hook(load_hook)
    where = os.path.join(tmp, "state")
    accelerator.save_state(where)
    full = tierlift.hf.gathered_state_dict(model)
    head_weights = {k: v.clone() for k, v in accelerator.unwrap_model(head).state_dict().items()}
    with torch.no_grad():  # load_state must put both back
        for p in list(model.parameters()) + list(head.parameters()):
            p.add_(1.0)
    try:
        accelerator.load_state(where)
    except Exception as e:  # noqa: BLE001 - every rank fails alike; the test names it
        return {"seen": seen, "load_error": repr(e)}
    return {"seen": seen, "loaded": loaded,
            "first_is_sharded": tierlift.zero.is_shard(next(model.parameters())),
            "full": full, "head": head_weights,
            "head_restored": accelerator.unwrap_model(head).state_dict(),
            "restored": tierlift.hf.gathered_state_dict(model)}


def _lora_case() -> dict:
    import tierlift.hf

    _fresh_accelerate()
    model = tierlift.zero.shard(_lora_llama(), stage=3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    accelerator = tierlift.hf.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM_LORA)
    loader = torch.utils.data.DataLoader(W.Data().x[:ROWS_LORA], batch_size=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    _lora_loop(model, opt, accelerator, loader)
    return tierlift.hf.gathered_state_dict(model)


def _trainer_case(tmp: str) -> dict:
    import tierlift.hf

    _fresh_accelerate()
    trainer = tierlift.hf.Trainer(model=W.build("llama"),
                                  args=_trainer_args(os.path.join(tmp, "trainer"), W.PER_RANK),
                                  train_dataset=W.Data(), zero=tierlift.hf.ZeroConfig(stage=3))
    trainer.train()
    return {"history": W.history(trainer),
            "weights": tierlift.hf.gathered_state_dict(trainer.model)}


def _cases(rank: int, world: int, tmp: str) -> dict:
    W.quiet()
    # what torchrun sets, for accelerate and TrainingArguments (the group is up already)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    return {"save_hook": _save_hook_case(rank, tmp), "lora": _lora_case(),
            "trainer": _trainer_case(tmp)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from zero_model import spawn_ranks

    tmp = str(tmp_path_factory.mktemp("hf_idioms"))
    return spawn_ranks(_cases, tmp)[0], tmp


def _same(a: dict, b: dict, atol: float) -> None:
    assert sorted(a) == sorted(b)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def test_state_hooks_see_the_sharded_model_and_its_full_weights(ranks):
    from safetensors.torch import load_file

    out, tmp = ranks
    case = out["save_hook"]
    assert case["seen"] == [2], case["seen"]
    assert "load_error" not in case, case["load_error"]
    assert case["loaded"] == [True]
    assert case["first_is_sharded"]
    full = case["full"]
    assert sorted(full) == sorted(W.build("llama").state_dict())
    _same(load_file(os.path.join(tmp, "state", "hooked.safetensors")), full, atol=0)
    # what the hook left (the unsharded model) accelerate wrote as before
    saved = load_file(os.path.join(tmp, "state", "model.safetensors"))
    assert sorted(v.shape for v in saved.values()) == sorted(
        v.shape for v in case["head"].values())
    _same(case["head_restored"], case["head"], atol=0)
    _same(case["restored"], full, atol=0)


def test_lora_accumulate_short_last_step_clip_value_equals_one_process(ranks):
    import accelerate

    _fresh_accelerate()
    torch.set_num_threads(1)
    model = _lora_llama()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM_LORA)
    # a 2-rank loader of batch 2 takes rows [0:2] on rank 0 and [2:4] on rank 1, and so on
    loader = torch.utils.data.DataLoader(W.Data().x[:ROWS_LORA], batch_size=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    _lora_loop(model, opt, accelerator, loader)
    _fresh_accelerate()
    ref = model.state_dict()
    trained = ranks[0]["lora"]
    _same(trained, ref, atol=2e-6)
    moved = max(float((ref[k] - v).abs().max()) for k, v in _lora_llama().state_dict().items())
    assert moved > 1e-3  # the adapters did train


def test_trainer_checkpointed_activations_short_last_step_equal_one_process(ranks, tmp_path):
    from transformers import Trainer

    W.quiet()
    torch.set_num_threads(1)
    _fresh_accelerate()
    trainer = Trainer(model=W.build("llama"), args=_trainer_args(str(tmp_path), 2 * W.PER_RANK),
                      train_dataset=W.Data())
    trainer.train()
    _fresh_accelerate()
    got = ranks[0]["trainer"]
    ref = W.history(trainer)
    assert sorted(got["history"]["loss"]) == list(range(1, 7))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(list(got["history"][key].values())),
                                   torch.tensor(list(ref[key].values())), rtol=1e-5, atol=0)
    _same(got["weights"], trainer.model.state_dict(), atol=2e-6)
