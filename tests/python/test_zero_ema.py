"""Model averaging (EMA / SWA) on a sharded model, and pre-hooks that read weights, on 2 gloo
ranks at stages 1/2/3 (one spawn), each against one process training the plain model on the
whole batch (what DDP computes):

- forward pre-hooks registered after shard() with prepend=True, and global module pre-hooks
  (register_module_forward_pre_hook), that read module weights: at stage 3 they raised
  NotGatheredError, and at stages 1/2, after an EMA swapped in through the shards' `.data`,
  the global one read the weights from before the swap. They now run after tierlift's
  pre-hooks and read what the plain model's hooks read.
- torch.optim.swa_utils.AveragedModel (SWA, and EMA through get_ema_multi_avg_fn) built before
  shard(): update_parameters(model) zipped the copy with the flat shards (torch's shape error,
  or a wrong average where a shard's length broadcast). It now averages the full weights;
  with BatchNorm and use_buffers=True, the rank's own buffers, as DDP (run on the same ranks
  as the reference there), and update_bn on the sharded model gives DDP's statistics.
- a shadow EMA of model.parameters() after shard() (diffusers' EMAModel: step, store, copy_to
  for an eval, restore): elementwise over the shards, exact as it was; proved here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn
from zero_model import spawn_ranks

import tierlift

STAGES = [1, 2, 3]
STEPS = 3


def _mlp(norm=nn.LayerNorm) -> nn.Module:
    """The norm's weights are in the root unit, the Linears units of their own. LayerNorm
    normalizes each row: the mean loss over the ranks' slices is the full batch's."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), norm(16), nn.Tanh(), nn.Linear(16, 4))


def _shard(model: nn.Module, stage: int) -> nn.Module:
    return tierlift.zero.shard(model, stage=stage, units=[model[0], model[3]])


def _batches(n: int, rows: int = 6):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 8, generator=g) for _ in range(n)]


# ---- pre-hooks that read weights ---------------------------------------------------------------
def _reading_hooks(model: nn.Module, seen: list) -> list:
    """A unit's pre-hook and a root pre-hook (with kwargs) put first, and a global pre-hook on
    the root and every Linear: each records the weights it reads."""

    def on_unit(m, args):
        seen.append(("unit", m.weight.detach().clone()))

    def on_root(m, args, kwargs):
        seen.append(("root", m[1].weight.detach().clone()))

    def on_any(m, args):
        if m is model:
            seen.append(("global root", m[1].weight.detach().clone()))
        elif isinstance(m, nn.Linear):
            seen.append(("global", m.weight.detach().clone()))

    return [model[0].register_forward_pre_hook(on_unit, prepend=True),
            model.register_forward_pre_hook(on_root, prepend=True, with_kwargs=True),
            torch.nn.modules.module.register_module_forward_pre_hook(on_any)]


def _run_reading(model: nn.Module, world: int = 1, rank: int = 0) -> list:
    """Trains STEPS steps (on this rank's slice of each batch), then swaps in the weights of
    step 1 through `.data` (an EMA's swap-in) and evaluates, recording what the hooks read."""
    seen: list = []
    handles = _reading_hooks(model, seen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        for i, x in enumerate(_batches(STEPS)):
            x = x.chunk(world)[rank]
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                early = [p.detach().clone() for p in model.parameters()]
        for p, e in zip(model.parameters(), early, strict=True):
            p.data.copy_(e)
        model.eval()
        with torch.no_grad():
            model(_batches(1)[0])
    finally:
        for h in handles:
            h.remove()
    return seen


# ---- averaging ---------------------------------------------------------------------------------
class _ShadowEma:
    """diffusers' EMAModel, reduced to what it does to the parameters it is given."""

    def __init__(self, parameters, decay: float) -> None:
        self.decay = decay
        self.shadow = [p.clone().detach() for p in parameters]
        self.stored = None

    @torch.no_grad()
    def step(self, parameters) -> None:
        for s, p in zip(self.shadow, parameters, strict=True):
            s.sub_((1 - self.decay) * (s - p))

    def copy_to(self, parameters) -> None:
        for s, p in zip(self.shadow, parameters, strict=True):
            p.data.copy_(s.to(p.device).data)

    def store(self, parameters) -> None:
        self.stored = [p.detach().cpu().clone() for p in parameters]

    def restore(self, parameters) -> None:
        for c, p in zip(self.stored, parameters, strict=True):
            p.data.copy_(c.data)
        self.stored = None


def _weights(model: nn.Module, sharded: bool) -> dict:
    sd = tierlift.zero.full_state_dict(model) if sharded else model.state_dict()
    return {k: v.detach().clone() for k, v in sd.items()}


def _train(model: nn.Module, data, after_step) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in data:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        after_step()
    return opt


def _averaged_models(model_fn, world: int = 1, rank: int = 0) -> dict:
    """AveragedModel (SWA, and EMA through multi_avg_fn) built before shard() (`model_fn`
    shards or not), updated after every step, and the SWA copy evaluated."""
    base = _mlp()
    swa = AveragedModel(base)
    ema = AveragedModel(base, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    model = model_fn(base)
    _train(model, [x.chunk(world)[rank] for x in _batches(STEPS)],
           lambda: (swa.update_parameters(model), ema.update_parameters(model)))
    out = {"swa": {k: v.clone() for k, v in swa.module.state_dict().items()},
           "ema": {k: v.clone() for k, v in ema.module.state_dict().items()}}
    with torch.no_grad():
        out["swa_eval"] = swa(_batches(1)[0])
    return out


def _shadow_ema(model: nn.Module, world: int = 1, rank: int = 0) -> dict:
    """A shadow EMA of model.parameters() (after shard(): of the shards) updated after every
    step, swapped in for an eval and swapped back; then training goes on one step."""
    sharded = any(tierlift.zero.is_shard(p) for p in model.parameters())
    shadow = _ShadowEma(model.parameters(), decay=0.8)
    data = [x.chunk(world)[rank] for x in _batches(STEPS + 1)]
    opt = _train(model, data[:STEPS], lambda: shadow.step(model.parameters()))
    out = {}
    shadow.store(model.parameters())
    shadow.copy_to(model.parameters())
    with torch.no_grad():
        out["shadow_eval"] = model(_batches(1)[0])
    out["shadow"] = _weights(model, sharded)
    shadow.restore(model.parameters())
    model(data[STEPS]).square().mean().backward()
    opt.step()
    out["trained"] = _weights(model, sharded)
    return out


def _batchnorm_averaged(model_fn, world: int, rank: int) -> dict:
    """With BatchNorm (each rank normalizes its own slice, so the reference is DDP, run on the
    same ranks): an EMA AveragedModel with use_buffers=True built before shard() (`model_fn`
    shards or wraps in DDP), then update_bn on the trained model itself and an eval."""
    base = _mlp(nn.BatchNorm1d)
    ema = AveragedModel(base, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    model = model_fn(base)
    _train(model, [x.chunk(world)[rank] for x in _batches(STEPS)],
           lambda: ema.update_parameters(base))
    out = {"ema": {k: v.clone() for k, v in ema.module.state_dict().items()}}
    update_bn([x.chunk(world)[rank] for x in _batches(2, rows=8)], model)
    out["stats"] = {k: v.clone() for k, v in base.named_buffers()}
    model.eval()
    with torch.no_grad():
        out["eval"] = model(_batches(1)[0])
    return out


def _cases(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for stage in STAGES:
        cases = {"reading": lambda st: _run_reading(_shard(_mlp(), st), world, rank),
                 "averaged": lambda st: _averaged_models(lambda m: _shard(m, st), world, rank),
                 "shadow": lambda st: _shadow_ema(_shard(_mlp(), st), world, rank),
                 "batchnorm": lambda st: _batchnorm_averaged(lambda m: _shard(m, st), world,
                                                             rank)}
        for name, case in cases.items():
            try:
                out[f"{name}/{stage}"] = case(stage)
            except Exception as e:  # noqa: BLE001 - sent back for the test to show
                out[f"{name}/{stage}"] = f"{type(e).__name__}: {e}"
    out["batchnorm/ddp"] = _batchnorm_averaged(
        lambda m: nn.parallel.DistributedDataParallel(m), world, rank)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_ema")))


def _results(ranks, key: str):
    """Each rank's result of the case `key` (a case that raised sent its error's text)."""
    for out in ranks:
        got = out[key]
        assert not isinstance(got, str), got
        yield got


@pytest.mark.parametrize("stage", STAGES)
def test_pre_hooks_put_first_on_two_ranks(ranks, stage):
    want = _run_reading(_mlp())
    for got in _results(ranks, f"reading/{stage}"):
        assert [k for k, _ in got] == [k for k, _ in want]
        for i, ((kind, g), (_, w)) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{kind} #{i}")



@pytest.mark.parametrize("stage", STAGES)
def test_global_pre_hook_that_raised_then_removed_leaves_no_skipped_gather(stage):
    """One process: a global pre-hook after tierlift's raised on a unit called on its own (its
    pre-hook had run early, the module's own did not), then was removed: the next forward's
    unit pre-hook skipped its gather and computed with weights from before a swap-in."""
    plain = _mlp()
    model = _mlp()
    # prefetch=0: a unit prefetched by the call that raised stays gathered, with the weights
    # from before the swap-in (not what this checks)
    model = tierlift.zero.shard(model, stage=stage, units=[model[0], model[3]], prefetch=0)
    x = _batches(1)[0]

    def failing(module, args):
        if module is model[0]:
            raise LookupError("a hook that gives up")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(failing)
    with pytest.raises(LookupError), torch.no_grad():
        model[0](x)
    handle.remove()
    with torch.no_grad():
        for p in [*model.parameters(), *plain.parameters()]:
            p.data = p.data * (1 + p.data)  # other weights swapped in (not a uniform shift,
            # which the LayerNorm after the unit would cancel)
        torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-6)


def _assert_close_dicts(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


@pytest.mark.parametrize("stage", STAGES)
def test_averaged_model_built_before_shard_averages_the_full_weights(ranks, stage):
    want = _averaged_models(lambda m: m)
    for got in _results(ranks, f"averaged/{stage}"):
        _assert_close_dicts(got["swa"], want["swa"], "swa")
        _assert_close_dicts(got["ema"], want["ema"], "ema")
        torch.testing.assert_close(got["swa_eval"], want["swa_eval"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", STAGES)
def test_shadow_ema_of_the_shards_swapped_in_and_back(ranks, stage):
    want = _shadow_ema(_mlp())
    for got in _results(ranks, f"shadow/{stage}"):
        _assert_close_dicts(got["shadow"], want["shadow"], "shadow")
        torch.testing.assert_close(got["shadow_eval"], want["shadow_eval"], rtol=1e-5,
                                   atol=1e-6)
        _assert_close_dicts(got["trained"], want["trained"], "trained after restore")


@pytest.mark.parametrize("stage", STAGES)
def test_batchnorm_averaged_and_update_bn_as_ddp(ranks, stage):
    for out in ranks:
        got, want = out[f"batchnorm/{stage}"], out["batchnorm/ddp"]
        assert not isinstance(got, str), got
        _assert_close_dicts(got["ema"], want["ema"], "ema")
        _assert_close_dicts(got["stats"], want["stats"], "update_bn")
        torch.testing.assert_close(got["eval"], want["eval"], rtol=1e-5, atol=1e-6)
    assert not torch.equal(ranks[0]["batchnorm/ddp"]["eval"], ranks[1]["batchnorm/ddp"]["eval"])


def test_averaged_model_of_another_model_refused_before_averaging():
    """One process: a copy whose names or shapes differ from the sharded model's is refused
    with nothing averaged; a wrapper around the sharded model (torch.compile's) pairs by the
    model's own names."""
    want = {k: v.clone() for k, v in _mlp().state_dict().items()}
    base = _mlp()
    swa = AveragedModel(base)
    other = AveragedModel(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(),
                                        nn.Linear(16, 5)))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    model = _shard(base, stage=3)
    with pytest.raises(ValueError, match=r"parameter '3.weight' \(5, 16\).*nothing was averaged"):
        other.update_parameters(model)
    _assert_close_dicts(other.state_dict(), before, "refused")
    with pytest.raises(RuntimeError, match=r"build the AveragedModel before shard\(\)"):
        AveragedModel(model)  # after shard(): a copy of the shards, refused naming the way
    swa.update_parameters(torch.compile(model))  # only wrapped, never run
    _assert_close_dicts(swa.module.state_dict(), want, "first average: a copy")
    assert swa.n_averaged.item() == 1


@pytest.mark.parametrize("stage", STAGES)
def test_averaged_model_without_use_buffers_copies_the_buffers(stage):
    """One process, BatchNorm, torch's default use_buffers=False: the buffers are copied as they
    are after every average (torch zips them strictly; it raised on every sharded model)."""
    def run(model_fn):
        base = _mlp(nn.BatchNorm1d)
        swa = AveragedModel(base)
        model = model_fn(base)
        _train(model, _batches(STEPS), lambda: swa.update_parameters(model))
        return {k: v.clone() for k, v in swa.module.state_dict().items()}

    _assert_close_dicts(run(lambda m: _shard(m, stage)), run(lambda m: m), "swa")
