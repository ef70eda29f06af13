"""tierlift.hf.Trainer under everyday TrainingArguments options and Trainer overrides, against
transformers.Trainer on the same script (one process, config-only Llama, ZeRO stage 3).

- A create_optimizer override grouping model.named_parameters() by get_decay_parameter_names
  (the stock Trainer's own idiom): the names are the shards', so the split is the Trainer's.
  On a model sharded without that split, with weight decay, it is refused before any step.
- optim names other than AdamW are refused before any step.
- Options that need nothing of tierlift give the stock losses, learning rates and weights:
  accumulation with max_grad_norm and ragged labels through a compute_loss taking
  num_items_in_batch; cosine_with_restarts; reduce_lr_on_plateau with step evaluation; label
  smoothing with NEFTune; load_best_model_at_end (an earlier step's weights) with
  save_total_limit (the same checkpoints kept); evaluate / predict / save_model after
  training, a callback reading model.parameters().
- Two ranks whose micro-batches count different label tokens (average_tokens_across_devices):
  the same losses, norms and weights as one process.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_worker as W  # noqa: E402

import tierlift  # noqa: E402
import tierlift.hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class _Ragged(torch.utils.data.Dataset):
    """Rows whose first few labels are -100, a different count per row (padding, prompts)."""

    def __init__(self):
        self.x = W.Data().x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        labels = self.x[i].clone()
        labels[: (i * 5) % 14] = -100
        return {"input_ids": self.x[i], "labels": labels}


class _SumLoss:
    """compute_loss with the num_items_in_batch signature: a sum over the micro-batch divided
    by the Trainer's token count of the whole accumulated step."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        logits, labels = out.logits[:, :-1].float(), inputs["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                 labels.reshape(-1), reduction="sum")
        loss = loss / num_items_in_batch
        return (loss, out) if return_outputs else loss


class _GroupedAdamW:
    """The create_optimizer override scripts copy from transformers.Trainer."""

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            decay = self.get_decay_parameter_names(self.model)
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(
                [{"params": [p for n, p in named if n in decay],
                  "weight_decay": self.args.weight_decay},
                 {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}],
                lr=self.args.learning_rate)
        return self.optimizer


class _Norms(transformers.TrainerCallback):
    def __init__(self):
        self.norms = []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.norms.append(float(torch.linalg.vector_norm(
            torch.cat([p.detach().reshape(-1) for p in model.parameters()]))))


def _fresh_accelerate() -> None:
    import accelerate

    accelerate.state.AcceleratorState._reset_state(True)


def _trainer(out, zero: bool, *, mixin=None, data=None, model=None, trainer_kw=None, **extra):
    W.quiet()
    _fresh_accelerate()
    kw = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
              learning_rate=1e-2, weight_decay=0.5, seed=0, use_cpu=True, report_to="none",
              disable_tqdm=True, save_strategy="no", dataloader_num_workers=0)
    kw.update(extra)
    base = tierlift.hf.Trainer if zero else transformers.Trainer
    cls = type("T", (mixin, base), {}) if mixin is not None else base
    more = dict(trainer_kw or {})
    if zero and model is None:
        more["zero"] = tierlift.hf.ZeroConfig(stage=3)
    return cls(model=model if model is not None else W.build("llama"),
               args=transformers.TrainingArguments(**kw), train_dataset=data or W.Data(), **more)


def _weights(trainer, zero: bool) -> dict:
    if zero:
        return tierlift.hf.gathered_state_dict(trainer.model)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _same_weights(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-6, msg=k)


def _logs(trainer) -> list[dict]:
    keep = ("step", "loss", "grad_norm", "learning_rate", "eval_loss")
    return [{k: e[k] for k in keep if k in e} for e in trainer.state.log_history]


def _same_logs(got: list[dict], want: list[dict]) -> None:
    assert [sorted(e) for e in got] == [sorted(e) for e in want]
    for g, w in zip(got, want, strict=True):
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=0), (k, g, w)


def test_create_optimizer_override_grouping_by_decay_names(tmp_path):
    ref = _trainer(tmp_path / "stock", False, mixin=_GroupedAdamW)
    ref.train()
    run = _trainer(tmp_path / "run", True, mixin=_GroupedAdamW)
    run.train()
    decay = set(run.get_decay_parameter_names(run.model))
    for group, wd in zip(run.optimizer.param_groups, (0.5, 0.0), strict=True):
        assert group["weight_decay"] == wd and group["params"]
        # each shard is one side of the split: the decayed ones are named as such
        assert all(tierlift.zero.is_shard(p) for p in group["params"])
    assert {n for n, p in run.model.named_parameters()
            if any(p is q for q in run.optimizer.param_groups[0]["params"])} == decay
    _same_logs(_logs(run), _logs(ref))
    _same_weights(_weights(run, True), _weights(ref, False))


def test_decay_names_of_a_model_sharded_without_the_split_are_refused(tmp_path):
    model = tierlift.zero.shard(W.build("llama"), stage=3)
    before = [p.detach().clone() for p in model.parameters()]
    run = _trainer(tmp_path / "run", True, mixin=_GroupedAdamW, model=model)
    with pytest.raises(ValueError, match="sharded without the Trainer's weight-decay split"):
        run.train()
    assert run.state.global_step == 0
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    # without weight decay the names do not matter: every shard is listed
    run = _trainer(tmp_path / "run0", True, mixin=_GroupedAdamW, model=model, weight_decay=0.0)
    assert run.get_decay_parameter_names(model) == [n for n, _ in model.named_parameters()]


def test_optim_other_than_adamw_refused_before_any_step(tmp_path):
    run = _trainer(tmp_path / "run", True, optim="adafactor")
    before = _weights(run, True)
    with pytest.raises(ValueError, match="optim='adafactor' is not AdamW"):
        run.train()
    assert run.state.global_step == 0
    _same_weights(_weights(run, True), before)


_OPTIONS = {
    "accum_clip_num_items": dict(mixin=_SumLoss, data=_Ragged(), gradient_accumulation_steps=3,
                                 max_grad_norm=0.3),
    "cosine_with_restarts": dict(lr_scheduler_type="cosine_with_restarts", warmup_steps=1,
                                 lr_scheduler_kwargs={"num_cycles": 2}),
    "plateau_eval_steps": dict(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps",
                               eval_steps=1, lr_scheduler_kwargs={"patience": 0, "factor": 0.5}),
    "smoothing_neftune": dict(label_smoothing_factor=0.1, neftune_noise_alpha=5.0),
    "best_model_limit": dict(eval_strategy="steps", eval_steps=1, save_strategy="steps",
                             save_steps=1, load_best_model_at_end=True,
                             metric_for_best_model="loss", greater_is_better=True,
                             save_total_limit=1),
}


@pytest.mark.parametrize("name", list(_OPTIONS))
def test_training_options_match_the_stock_trainer(name, tmp_path):
    extra = dict(_OPTIONS[name])
    if "eval_strategy" in extra:
        extra["trainer_kw"] = {"eval_dataset": W.Data()}
        extra["per_device_eval_batch_size"] = 16
    runs = {}
    for zero in (False, True):
        trainer = _trainer(tmp_path / str(zero), zero, **extra)
        trainer.train()
        runs[zero] = trainer
    _same_logs(_logs(runs[True]), _logs(runs[False]))
    _same_weights(_weights(runs[True], True), _weights(runs[False], False))
    if "save_total_limit" in extra:
        kept = {z: sorted(d for d in os.listdir(tmp_path / str(z)) if d.startswith("checkpoint"))
                for z in runs}
        best = os.path.basename(runs[False].state.best_model_checkpoint)
        # not the last: the weights compared above are loaded from it
        assert best != "checkpoint-4" and best in kept[False]
        assert kept[True] == kept[False]
        assert os.path.basename(runs[True].state.best_model_checkpoint) == best


def test_evaluate_predict_save_model_and_a_norm_callback(tmp_path):
    out = {}
    for zero in (False, True):
        norms = _Norms()
        trainer = _trainer(tmp_path / str(zero), zero, trainer_kw={"callbacks": [norms]},
                           per_device_eval_batch_size=16)
        trainer.train()
        saved = tmp_path / f"saved{zero}"
        trainer.save_model(str(saved))
        out[zero] = {"eval": trainer.evaluate(W.Data())["eval_loss"],
                     "pred": torch.as_tensor(trainer.predict(W.Data()).predictions),
                     "norms": norms.norms,
                     "loaded": transformers.LlamaForCausalLM.from_pretrained(saved).state_dict()}
    got, want = out[True], out[False]
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-6)
    torch.testing.assert_close(got["pred"], want["pred"], rtol=0, atol=1e-5)
    # one process: the flat shards hold every weight (padding is zero), so the norm is the same
    assert got["norms"] == pytest.approx(want["norms"], rel=1e-6)
    _same_weights(got["loaded"], want["loaded"])


def _ragged_on_two_ranks(rank: int, world: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    # what torchrun sets, for accelerate and TrainingArguments (the group is up already)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    trainer = _trainer(os.path.join(tmp, "run"), True, **_RAGGED)
    trainer.train()
    return {"logs": _logs(trainer), "weights": _weights(trainer, True)}


_RAGGED = dict(data=_Ragged(), gradient_accumulation_steps=3, max_grad_norm=0.3, max_steps=2)


@pytest.mark.slow  # two spawned ranks importing transformers
def test_ragged_labels_on_two_ranks_equal_one_process(tmp_path):
    """Each rank's micro-batches count different label tokens: the Trainer divides by the
    count over both ranks (average_tokens_across_devices) and scales by the world size, which
    the sharded gradients' average must undo exactly as DDP's does."""
    from zero_model import spawn_ranks

    got = spawn_ranks(_ragged_on_two_ranks, str(tmp_path))[0]
    ref = _trainer(tmp_path / "stock", False, per_device_train_batch_size=4, **_RAGGED)
    ref.train()
    _same_logs(got["logs"], _logs(ref))
    _same_weights(got["weights"], _weights(ref, False))
