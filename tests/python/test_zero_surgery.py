"""Model surgery and re-initialisation after tierlift.zero.shard(), stages 1/2/3, each against
one process training the plain model with torch.optim.AdamW over the whole batch:

- a trainable parameter added after shard() (register_parameter, `model.x = nn.Parameter(...)`,
  a frozen one or a frozen head added and then unfrozen): outside every unit, so each rank
  stepped it with its own gradient, never averaged (on 2 ranks 0.03 and 0.05 off the plain run
  after three steps, the ranks apart). Refused when the optimizer is built, or at the first
  step after unfreezing, before anything changes (one process: the refusal is the same on any
  number of ranks). A frozen parameter added after shard() that stays frozen trains exactly.
- activation checkpointing (torch.utils.checkpoint, reentrant or not) switched on after the
  first step, as gradient_checkpointing_enable() mid-run does: exact. Blocks wrapped by torch's
  checkpoint_wrapper before shard() train exactly, and full_state_dict gives the names the
  model's state_dict gives (the wrapper drops `_checkpoint_wrapped_module.`; full_state_dict
  kept it, so neither the plain nor the wrapped model loaded it). Wrapping after shard() swaps
  the blocks, which is refused (test_zero_guards).
- a buffer registered after shard() with different values per rank: rank 0's is broadcast
  before the next forward, as DDP does; exact against one process using rank 0's.
- an init function (model.apply, as post_init / _init_weights) at stage 3 reads and writes freed
  weights: refused (NotGatheredError), the shards unchanged; inside
  tierlift.zero.gathered(model, modifier_rank=0) it is exact. (Stages 1/2 in fp32: exact, see
  test_zero_scripts; with bf16 compute refused, see test_zero_idioms.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint
from zero_model import raised, spawn_ranks

import tierlift

STEPS, BATCH = 3, 8
OPT = dict(lr=1e-2, weight_decay=0.1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.reentrant = None  # None: no activation checkpointing

    def _body(self, x):
        return x + self.out(torch.tanh(self.fc(self.ln(x))))

    def forward(self, x):
        if self.reentrant is None:
            return self._body(x)
        return checkpoint(self._body, x, use_reentrant=self.reentrant)


class Net(nn.Module):
    """Uses `extra` (a scale), `gate` (a layer) and `bscale` (a buffer) once they are added."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        for name in ("extra", "bscale"):
            if hasattr(self, name):
                h = h * getattr(self, name)
        if hasattr(self, "gate"):
            h = self.gate(h)
        return self.head(h)


def _make() -> Net:
    torch.manual_seed(0)
    return Net()


def _wrapped() -> Net:
    """Blocks wrapped by torch's checkpoint_wrapper (apply_activation_checkpointing)."""
    model = _make()
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: isinstance(m, Block))
    return model


def _shard(stage: int, make=_make) -> Net:
    return tierlift.zero.shard(make(), stage=stage)


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _train(model, world=1, rank=0, edit=None, between=None):
    """`edit(model)` before the optimizer is built; `between(model)` before the second step."""
    if edit is not None:
        edit(model)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    for i, (x, y) in enumerate(_data()):
        if i == 1 and between is not None:
            between(model)
        opt.zero_grad()
        F.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    return model


def _max_abs(sd: dict, ref: dict) -> float:
    assert sd.keys() == ref.keys(), (sorted(sd), sorted(ref))
    return max(float((sd[k] - ref[k]).abs().max()) for k in ref)


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)


def _checkpointing(reentrant: bool):
    def enable(model):
        for block in model.blocks:
            block.reentrant = reentrant
    return enable


def _add_frozen(model) -> None:
    model.extra = nn.Parameter(torch.full((8,), 1.5), requires_grad=False)


def _cases(rank: int, world: int, tmp: str) -> dict:
    out = {}
    exact = {f"checkpoint_after_step/{k}": dict(between=_checkpointing(r))
             for k, r in (("reentrant", True), ("non_reentrant", False))}
    exact["frozen_added"] = dict(edit=_add_frozen)
    exact["checkpoint_wrapper"] = {}
    for name, kw in exact.items():
        make = _wrapped if name == "checkpoint_wrapper" else _make
        ref = _train(make(), **kw).state_dict()
        for stage in (1, 2, 3):
            model = _train(_shard(stage, make), world, rank, **kw)
            out[f"{name}/s{stage}"] = _max_abs(tierlift.zero.full_state_dict(model), ref)
    # A buffer registered after shard(), different on each rank: rank 0's wins.
    ref = _train(_make(), edit=lambda m: m.register_buffer("bscale", torch.full((8,), 0.7)))
    for stage in (1, 2, 3):
        model = _train(_shard(stage), world, rank, edit=lambda m: m.register_buffer(
            "bscale", torch.full((8,), 0.7 + 0.2 * rank)))
        out[f"buffer_added/s{stage}"] = _max_abs(tierlift.zero.full_state_dict(model),
                                                 ref.state_dict())
    # An init function at stage 3: refused on freed weights, exact inside gathered().
    ref = _make()
    torch.manual_seed(5)
    ref = _train(ref.apply(_init)).state_dict()
    model = _shard(3)
    before = [p.detach().clone() for p in model.parameters()]
    out["init/s3/refused"] = raised(lambda: model.apply(_init))
    out["init/s3/unchanged"] = all(torch.equal(a, b)
                                   for a, b in zip(before, model.parameters(), strict=True))
    with tierlift.zero.gathered(model, modifier_rank=0):
        torch.manual_seed(5)
        model.apply(_init)
    out["init/s3/gathered"] = _max_abs(tierlift.zero.full_state_dict(
        _train(model, world, rank)), ref)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_surgery")))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", ["checkpoint_after_step/reentrant",
                                  "checkpoint_after_step/non_reentrant", "checkpoint_wrapper",
                                  "frozen_added", "buffer_added"])
def test_surgery_that_trains_exactly(ranks, case, stage):
    for out in ranks:
        assert out[f"{case}/s{stage}"] < 1e-6, out[f"{case}/s{stage}"]


def test_init_at_stage3_refused_outside_gathered_exact_inside(ranks):
    for out in ranks:
        msg = out["init/s3/refused"]
        assert msg.startswith("NotGatheredError:") and "gathered(model, modifier_rank" in msg, msg
        assert out["init/s3/unchanged"]
        assert out["init/s3/gathered"] < 1e-6, out["init/s3/gathered"]


# ---- parameters added after shard(): refused before any step (one process) ----
def _register(model):
    model.register_parameter("extra", nn.Parameter(torch.full((8,), 1.5)))


def _assign(model):
    model.extra = nn.Parameter(torch.full((8,), 1.5))


def _unfreeze_param(model):
    _add_frozen(model)
    model.extra.requires_grad_(True)


def _unfreeze_module(model):
    model.gate = nn.Linear(8, 8).requires_grad_(False)  # a frozen submodule may be added
    model.gate.requires_grad_(True)


def _unfreeze_root(model):
    model.gate = nn.Linear(8, 8).requires_grad_(False)
    model.requires_grad_(True)  # changes no sharded weight: torch_calls lets it through


def _replace_weight(model):
    # A re-init that replaces the parameter: before, the optimizer stepped the new one, which
    # the next forward's refusal then took off the module.
    model.head.weight = nn.Parameter(torch.randn(3, 8) * 0.02)


_ADDED = "did not pack ({}): added after shard()"
ADDED = {"register_parameter": (_register, _ADDED.format("extra")),
         "assign": (_assign, _ADDED.format("extra")),
         "unfreeze_param": (_unfreeze_param, _ADDED.format("extra")),
         "unfreeze_module": (_unfreeze_module, _ADDED.format("gate.weight, gate.bias")),
         "unfreeze_root": (_unfreeze_root, _ADDED.format("gate.weight, gate.bias")),
         "replace_weight": (_replace_weight, "on head.weight, set to a new nn.Parameter")}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("idiom", list(ADDED))
def test_parameter_added_after_shard_refused_when_optimizer_built(idiom, stage):
    edit, expected = ADDED[idiom]
    model = _shard(stage)
    edit(model)
    with pytest.raises(RuntimeError) as err:
        torch.optim.AdamW(model.parameters(), **OPT)
    assert expected in str(err.value) and "nothing was changed" in str(err.value), err.value


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unfrozen_after_optimizer_built_refused_at_step(stage):
    model = _shard(stage)
    _add_frozen(model)
    opt = torch.optim.AdamW(model.parameters(), **OPT)  # holds the frozen scale: no gradient
    (x, y), *_ = _data()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    model.extra.requires_grad_(True)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) .*did not pack \(extra\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model.extra.requires_grad_(False)  # frozen again: steps as before
    opt.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_wrapped_full_state_dict_has_the_models_names(stage):
    """torch's checkpoint_wrapper drops `_checkpoint_wrapped_module.` from its state_dict's
    names; full_state_dict kept it, so neither the plain model nor the wrapped one loaded it
    (missing keys) and load_full_state_dict refused their state dicts (KeyError)."""
    model = _shard(stage, _wrapped)
    want = _wrapped().state_dict()
    got = tierlift.zero.full_state_dict(model)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    _make().load_state_dict(got)
    edited = {k: v * 0.5 for k, v in _make().state_dict().items()}
    tierlift.zero.load_full_state_dict(model, edited)
    got = tierlift.zero.full_state_dict(model)
    assert list(got) == list(want) and all(torch.equal(got[k], edited[k]) for k in want)


def test_checkpoint_wrapper_after_shard_is_refused_naming_the_ways_that_work():
    model = _shard(2)
    before = list(model.named_modules())
    with pytest.raises(RuntimeError, match=r"cannot replace submodule .*before shard\(\) "
                       r"\(apply_activation_checkpointing\).*gradient_checkpointing_enable"):
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, Block))
    assert list(model.named_modules()) == before


def test_one_optimizer_over_two_sharded_models_and_a_plain_one_trains_exactly():
    """The check for unpacked parameters looks at every live sharded model: an optimizer over
    a stage-3 model, a stage-2 one and a plain head (a policy, a value model, a probe) holds
    only their shards and the head's own weights, and is not refused."""
    def three():
        torch.manual_seed(0)
        return Net(), Net(), nn.Linear(3, 3)

    def train(a, b, head):
        opt = torch.optim.AdamW([*a.parameters(), *b.parameters(), *head.parameters()], **OPT)
        for x, y in _data():
            opt.zero_grad()
            F.cross_entropy(head(a(x) + b(x)), y).backward()
            opt.step()

    ref = three()
    train(*ref)
    a, b, head = three()
    a, b = tierlift.zero.shard(a, stage=3), tierlift.zero.shard(b, stage=2)
    train(a, b, head)
    for got, want in zip((tierlift.zero.full_state_dict(a), tierlift.zero.full_state_dict(b),
                          head.state_dict()), (m.state_dict() for m in ref), strict=True):
        assert _max_abs(got, want) < 1e-6


def test_a_weight_tied_to_a_module_outside_the_sharded_model_is_refused_naming_the_tie():
    model = _make()
    outside = nn.Linear(4, 8)
    outside.weight = model.emb.weight  # tied before shard(): the tie cannot hold after it
    model = tierlift.zero.shard(model, stage=2)
    with pytest.raises(RuntimeError, match=r"replaced \(emb.weight\).*a module outside the "
                       r"sharded model still holds them"):
        torch.optim.AdamW([*model.parameters(), *outside.parameters()], **OPT)
