"""Torch's module-level mechanisms on a sharded model (one process, world size 1), each exact
against plain torch or refused before anything runs or changes:

- torch.func.functional_call / torch.nn.utils.stateless (per-sample gradients, MAML) given the
  names model.named_parameters() yields (the flat shards) or the original names: refused in
  the first forward hook, before any unit is gathered; the model is intact and trains exactly
  afterwards. Also on a unit module called on its own.
- forward pre-hooks registered before shard() that read the weights (old-style weight_norm,
  pruning, a user's hook) see the gathered weights at every stage, and forward hooks
  registered after shard() read them before a stage-3 unit frees them.
- pruning, weight_norm and parametrizations applied to a sharded weight after shard(), and
  model.to(dtype) / .half() / .double() / .to(device): refused before any module changes;
  model.to(torch.device("cpu", 0)) (Accelerate's multi-process CPU device) changes nothing, so
  Accelerate's prepare() reaches its DDP wrap, which is refused (2 gloo ranks).
- nn.Embedding / nn.EmbeddingBag with sparse=True: refused by shard(), model untouched.
"""

from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch
import torch.nn.utils.prune as prune
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import parametrizations, parametrize, stateless
from torch.optim.optimizer import register_optimizer_step_post_hook
from zero_model import raised, spawn_ranks

import tierlift

STAGES = [1, 2, 3]
STEPS = 3


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _bn_mlp() -> nn.Module:
    """A BatchNorm first (its weights in the root unit, its buffers converted first by .to())."""
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _shard(model: nn.Module, stage: int) -> nn.Module:
    units = [m for m in model if isinstance(m, nn.Linear)]
    return tierlift.zero.shard(model, stage=stage, units=units)


def _batches(n: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 8, generator=g) for _ in range(n)]


def _train(model: nn.Module, data, sharded: bool, make_opt=None):
    opt = (make_opt or (lambda ps: torch.optim.AdamW(ps, lr=1e-2)))(model.parameters())
    losses = []
    for x in data:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = tierlift.zero.full_state_dict(model) if sharded else model.state_dict()
    return losses, {k: v.detach().clone() for k, v in weights.items()}


def _assert_same(got, want) -> None:
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=0)
    assert sorted(got[1]) == sorted(want[1])
    for key, value in want[1].items():
        torch.testing.assert_close(got[1][key], value, rtol=1e-6, atol=1e-7, msg=key)


def _count_gathers(model: nn.Module) -> list:
    """Every unit gather the model's hooks issue from now on (a collective at world > 1)."""
    state = model._tierlift_zero
    calls, gather = [], state._gather
    state._gather = lambda unit, *a, **k: (calls.append(unit.name), gather(unit, *a, **k))[1]
    return calls


# ---- functional_call ---------------------------------------------------------------------------
def _shard_name_calls(model, x):
    zeros = {k: torch.zeros_like(v) for k, v in model.named_parameters()}

    def reparametrized():
        with stateless._reparametrize_module(model, zeros):
            return model(x)

    def per_sample_grads():
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, xi):
            return functional_call(model, p, (xi.unsqueeze(0),)).square().sum()

        return vmap(grad(loss), in_dims=(None, 0))(params, x)

    return {
        "func": lambda: functional_call(model, zeros, (x,)),
        "func-untied-strict": lambda: functional_call(model, zeros, (x,), tie_weights=False,
                                                      strict=True),
        "func-parameters": lambda: functional_call(
            model, {k: nn.Parameter(v) for k, v in zeros.items()}, (x,)),
        "stateless": lambda: stateless.functional_call(model, zeros, (x,)),  # deprecated
        "reparametrize": reparametrized,
        "per-sample-grads": per_sample_grads,
    }


@pytest.mark.parametrize("stage", STAGES)
def test_functional_call_with_shard_names_is_refused_before_any_gather(stage):
    x = torch.randn(3, 8)
    want = _train(_mlp(), _batches(), sharded=False)
    model = _shard(_mlp(), stage)
    shards = dict(model.named_parameters())
    before = model(x).detach()
    gathers = _count_gathers(model)
    for name, call in _shard_name_calls(model, x).items():
        with pytest.raises(RuntimeError, match="functional_call") as err:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                call()
        assert "_zero_flat_shard" in str(err.value) and "full_state_dict" in str(err.value), name
        assert gathers == [], name  # refused in the root's first hook, before any unit
        assert all(p is shards[k] for k, p in model.named_parameters()), name
    torch.testing.assert_close(model(x).detach(), before, rtol=0, atol=0)
    # The shards themselves (MAML's dict(model.named_parameters())): the model's own forward.
    same = functional_call(model, dict(model.named_parameters()), (x,)).detach()
    torch.testing.assert_close(same, before, rtol=0, atol=0)
    _assert_same(_train(model, _batches(), sharded=True), want)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("given", ["tensors", "parameters"])
def test_functional_call_with_original_names_is_refused_naming_it(stage, given):
    """Given the original names, functional_call sets the module attributes: refused, naming
    functional_call. An nn.Parameter given is registered by torch: after the refusal the module
    is as it was (torch's restore would have put the weight's view into `_parameters`, where no
    later forward could set it: TypeError at every forward after)."""
    x = torch.randn(3, 8)
    want = _train(_mlp(), _batches(), sharded=False)
    model = _shard(_mlp(), stage)
    keys = {id(m): list(m._parameters) for m in model.modules()}
    wrap = nn.Parameter if given == "parameters" else (lambda t: t)
    zeros = {"0.weight": wrap(torch.zeros(16, 8)), "0.bias": wrap(torch.zeros(16))}
    with pytest.raises(RuntimeError, match="functional_call .* original parameter names"):
        functional_call(model, zeros, (x,))
    assert {id(m): list(m._parameters) for m in model.modules()} == keys
    _assert_same(_train(model, _batches(), sharded=True), want)


@pytest.mark.parametrize("stage", STAGES)
def test_functional_call_on_a_unit_called_alone_is_refused(stage):
    """A unit's module called on its own runs no root hook: its own hook checks it (before, the
    call returned the model's own output, 16.35 instead of 0 for all-zero weights)."""
    x = torch.randn(3, 8)
    model = _shard(_mlp(), stage)
    alone = model[0](x).detach()
    gathers = _count_gathers(model)
    shard_key = {"_zero_flat_shard": torch.zeros_like(model[0]._zero_flat_shard)}
    with pytest.raises(RuntimeError, match="flat shard parameter '_zero_flat_shard'"):
        functional_call(model[0], shard_key, (x,))
    original = {"weight": torch.zeros(16, 8), "bias": torch.zeros(16)}
    with pytest.raises(RuntimeError, match="functional_call"):
        functional_call(model[0], original, (x,))
    assert gathers == []
    torch.testing.assert_close(model[0](x).detach(), alone, rtol=0, atol=0)


# ---- forward hooks that read the weights -------------------------------------------------------
def _reparametrized(kind: str, seen: list) -> nn.Module:
    model = _bn_mlp()
    if kind == "weight_norm":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated, still used
            torch.nn.utils.weight_norm(model[1])
    elif kind == "prune":
        prune.l1_unstructured(model[1], "weight", amount=0.5)
    elif kind == "user-hooks":
        model[1].register_forward_pre_hook(lambda m, a: seen.append(m.weight.sum().item()))
        model.register_forward_pre_hook(lambda m, a: seen.append(m[0].weight.sum().item()))
    return model


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["weight_norm", "prune", "user-hooks"])
def test_pre_hooks_registered_before_shard_see_the_gathered_weights(stage, kind):
    """Stage 3 raised NotGatheredError at the first forward: the units' gathering hooks ran
    after these."""
    plain_seen, seen = [], []
    want = _train(_reparametrized(kind, plain_seen), _batches(), sharded=False)
    got = _train(_shard(_reparametrized(kind, seen), stage), _batches(), sharded=True)
    _assert_same(got, want)
    assert seen == plain_seen


@pytest.mark.parametrize("stage", STAGES)
def test_forward_hooks_registered_after_shard_see_the_gathered_weights(stage):
    """Stage 3 freed the unit in its forward hook before a hook registered after shard() ran:
    NotGatheredError. The root's weights (the BatchNorm's, in the root unit) too."""
    plain_seen, seen = [], []
    plain, model = _bn_mlp(), _shard(_bn_mlp(), stage)
    for m, out in ((plain, plain_seen), (model, seen)):
        m[1].register_forward_hook(lambda mod, a, y, out=out: out.append(mod.weight.sum().item()))
        m.register_forward_hook(lambda mod, a, y, out=out: out.append(mod[0].weight.sum().item()))
    _assert_same(_train(model, _batches(), sharded=True), _train(plain, _batches(), False))
    assert seen == plain_seen and len(seen) == 2 * STEPS


@pytest.mark.parametrize("stage", STAGES)
def test_pruning_again_after_shard(stage):
    """A weight pruned before shard() pruned again mid-training (iterative pruning) changes only
    the mask: exact at stages 1/2 and, inside gathered(), at stage 3; outside it, stage 3 is
    refused before the pruning hook is taken off."""

    def run(sharded: bool):
        model = _reparametrized("prune", [])
        if sharded:
            model = _shard(model, stage)
        data, out = _batches(2 * STEPS), []
        first = _train(model, data[:STEPS], sharded)[0]
        if sharded and stage == 3:
            hooks = list(model[1]._forward_pre_hooks.values())
            with pytest.raises(RuntimeError, match="inside `with tierlift.zero.gathered"):
                prune.l1_unstructured(model[1], "weight", amount=0.5)
            assert list(model[1]._forward_pre_hooks.values()) == hooks
            with tierlift.zero.gathered(model):
                prune.l1_unstructured(model[1], "weight", amount=0.5)
        else:
            prune.l1_unstructured(model[1], "weight", amount=0.5)
        out = _train(model, data[STEPS:], sharded)
        return first + out[0], out[1]

    _assert_same(run(True), run(False))


# ---- reparametrizations after shard() ----------------------------------------------------------
AFTER_SHARD = {
    "prune.l1_unstructured": lambda m: prune.l1_unstructured(m[1], "weight", 0.5),
    "prune.identity": lambda m: prune.identity(m[3], "bias"),
    "prune.global_unstructured": lambda m: prune.global_unstructured(
        [(m[1], "weight"), (m[3], "weight")], prune.L1Unstructured, amount=0.5),
    "weight_norm": lambda m: torch.nn.utils.weight_norm(m[1]),  # deprecated
    "parametrizations.weight_norm": lambda m: parametrizations.weight_norm(m[1]),
    "register_parametrization": lambda m: parametrize.register_parametrization(
        m[0], "weight", nn.Identity()),
}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("call", list(AFTER_SHARD))
def test_reparametrizing_a_sharded_weight_is_refused_and_changes_nothing(stage, call):
    """Pruning raised torch's TypeError (`cannot assign 'torch.FloatTensor' object to parameter
    'weight_orig'`), weight_norm a KeyError: now a refusal that names the fix, and the model
    trains exactly as if it had not been called."""
    if stage == 3 and call == "prune.global_unstructured":
        pytest.skip("reads every weight first: NotGatheredError, before torch changes anything")
    want = _train(_bn_mlp(), _batches(), sharded=False)
    model = _shard(_bn_mlp(), stage)
    hooks = {id(m): dict(m._forward_pre_hooks) for m in model.modules()}
    with pytest.raises(RuntimeError, match="before tierlift.zero.shard.*Nothing was changed"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            AFTER_SHARD[call](model)
    assert {id(m): dict(m._forward_pre_hooks) for m in model.modules()} == hooks
    assert type(model[0]) is nn.BatchNorm1d and type(model[1]) is nn.Linear
    _assert_same(_train(model, _batches(), sharded=True), want)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["prune", "weight_norm", "parametrization"])
def test_removing_a_reparametrization_after_shard_is_refused(stage, kind):
    """prune.remove / remove_weight_norm / remove_parametrizations would make the weight a
    parameter of its own again (torch raised KeyError after deleting the attribute)."""

    def build():
        model = _bn_mlp()
        if kind == "parametrization":
            parametrizations.weight_norm(model[1])
        else:
            model = _reparametrized(kind, [])
        return model

    removal = {"prune": lambda m: prune.remove(m[1], "weight"),
               "weight_norm": lambda m: torch.nn.utils.remove_weight_norm(m[1]),
               "parametrization": lambda m: parametrize.remove_parametrizations(m[1], "weight")}
    want = _train(build(), _batches(), sharded=False)
    model = _shard(build(), stage)
    with pytest.raises(RuntimeError, match="sharded by tierlift.zero.shard.*Nothing was changed"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            removal[kind](model)
    _assert_same(_train(model, _batches(), sharded=True), want)


# ---- dtype and device conversion ---------------------------------------------------------------
CONVERSIONS = {
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "half": lambda m: m.half(),
    "double": lambda m: m.double(),
    "to(meta)": lambda m: m.to("meta"),
    "submodule.half": lambda m: m[0].half(),  # its weights are in the root unit
    "wrapper.half": lambda m: nn.ModuleList([m]).half(),  # a module holding the model
    "to_empty": lambda m: m.to_empty(device="cpu"),  # uninitialised weights
    "share_memory": lambda m: m.share_memory(),  # moved the shards: refused at the next forward
    "copy": lambda m: m._apply(torch.clone),  # same dtype and device, new tensors
}
# What each storage-changing conversion's refusal says happened.
NEW_STORAGE = {"to_empty": "model.to_empty() (uninitialised memory), or a copy",
               "share_memory": "in place: model.share_memory()",
               "copy": "model.to_empty() (uninitialised memory), or a copy"}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("call", list(CONVERSIONS))
@pytest.mark.parametrize("swap", [False, True], ids=["set-data", "swap-tensors"])
def test_dtype_or_device_change_is_refused_before_any_module_converts(stage, call, swap):
    """torch converts child modules one by one: the refusal at the first shard came after the
    BatchNorm's buffers had turned bfloat16 (the message named `.data =`). Now nothing converts,
    also with torch.__future__.set_swap_module_params_on_conversion(True)."""
    want = _train(_bn_mlp(), _batches(), sharded=False)
    model = _shard(_bn_mlp(), stage)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        fix = "meta device" if call in NEW_STORAGE else "MixedPrecision"
        with pytest.raises(RuntimeError, match=f"{fix}.*Nothing was changed") as info:
            CONVERSIONS[call](model)
        assert NEW_STORAGE.get(call, "would turn the weights") in str(info.value)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {torch.float32}
    _assert_same(_train(model, _batches(), sharded=True), want)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("swap", [False, True], ids=["set-data", "swap-tensors"])
def test_conversions_that_change_nothing_still_work(stage, swap):
    """With swap_module_params_on_conversion torch swapped each parameter, which fails on a
    shard (`_apply(): Couldn't swap Linear._zero_flat_shard`) even for a no-op .float()."""
    want = _train(_bn_mlp(), _batches(), sharded=False)
    model = _shard(_bn_mlp(), stage)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    tensors = [(t, t.data_ptr()) for t in (*model.parameters(), *model.buffers())]
    try:
        model.float().to(torch.float32).cpu().to("cpu")
        model[1].float()
        # Accelerate's device on a multi-process CPU run: torch copies a CPU tensor sent there,
        # which was refused as to_empty()/share_memory()
        model.to(torch.device("cpu", 0)).to("cpu:0", torch.float32).to(device="cpu:1")
        nn.ModuleList([model]).to(torch.device("cpu", 0))
        assert torch.__future__.get_swap_module_params_on_conversion() is swap
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert all(type(p).__name__ == "ShardParameter" for p in model.parameters())
    # nothing was copied: the shards and buffers are the same tensors on the same storage
    now = [*model.parameters(), *model.buffers()]
    assert len(now) == len(tensors)
    assert all(t is u and t.data_ptr() == ptr for u, (t, ptr) in zip(now, tensors))
    _assert_same(_train(model, _batches(), sharded=True), want)


def test_unsharded_model_to_an_indexed_cpu_device_is_torchs_copy():
    """Only a sharded model's .to() leaves an indexed CPU device's copy out."""
    model = _mlp()
    weight = model[0].weight
    where = weight.data_ptr()
    model.to(torch.device("cpu", 0))
    assert model[0].weight is weight and weight.data_ptr() != where


@pytest.mark.parametrize("device", ["cpu:0", "cpu"])
def test_conversions_of_a_model_built_on_an_indexed_device_still_work(tmp_path, device):
    """shard(meta model, device="cpu:0") places the units on cpu:0, where torch's tensors
    report `cpu`: every conversion, even .float(), was refused as a device change (the same
    for device="cuda", whose tensors report cuda:0)."""
    from safetensors.torch import save_file

    want = _train(_mlp(), _batches(), sharded=False)
    save_file(_mlp().state_dict(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = _mlp()
    model = tierlift.zero.shard(model, stage=3, units=[model[0], model[2]], device=device,
                                weights=str(tmp_path))
    model.float().cpu().to("cpu").to(torch.device("cpu", 0))
    with pytest.raises(RuntimeError, match="MixedPrecision.*Nothing was changed"):
        model.half()
    _assert_same(_train(model, _batches(), sharded=True), want)


def _accelerate_prepare(rank: int, world: int, tmp: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    from accelerate import Accelerator

    model = _shard(_bn_mlp(), 3)
    accelerator = Accelerator(cpu=True)  # on a CPU-only machine, as `accelerate launch --cpu`
    out = {"device": str(accelerator.device), "prepare": raised(lambda: accelerator.prepare(model))}
    out["trained"] = _train(model, _batches(), sharded=True)  # every rank the same batches
    return out


def test_accelerate_multi_process_prepare_reaches_the_ddp_refusal(tmp_path):
    """Accelerate's multi-process prepare() moves the model to torch.device("cpu", 0), which was
    refused as to_empty()/share_memory(); now its DDP wrap is refused, naming DDP, and the model
    trains as torch after (2 gloo ranks, each the same batches)."""
    pytest.importorskip("accelerate", reason="needs accelerate (scripts/setup.sh installs it)")
    want = _train(_bn_mlp(), _batches(), sharded=False)
    for out in spawn_ranks(_accelerate_prepare, str(tmp_path)):
        assert out["device"] == "cpu:0"
        assert out["prepare"].startswith("RuntimeError: DistributedDataParallel was given a "
                                         "model sharded by tierlift.zero.shard"), out["prepare"]
        _assert_same(out["trained"], want)


# ---- sparse gradients --------------------------------------------------------------------------
def _embedding_model(cls, sparse: bool) -> nn.Module:
    torch.manual_seed(0)
    width = 16 if cls is nn.Embedding else 8  # Embedding: 2 tokens of 8; EmbeddingBag: 1 bag
    return nn.Sequential(cls(10, 8, sparse=sparse), nn.Flatten(), nn.Linear(width, 4))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("cls", [nn.Embedding, nn.EmbeddingBag])
def test_sparse_embedding_is_refused_by_shard_leaving_the_model_untouched(stage, cls):
    """Backward failed with torch's `reshape is not implemented for sparse tensors`."""
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 10, (3, 2), generator=g) for _ in range(STEPS)]

    def run(model, sharded):
        return _train(model, data, sharded, lambda ps: torch.optim.SGD(ps, lr=0.1))

    want = run(_embedding_model(cls, sparse=True), sharded=False)  # sparse SGD in plain torch
    model = _embedding_model(cls, sparse=True)
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="sparse=True.*sparse=False.*nothing was changed"):
        tierlift.zero.shard(model, stage=stage)
    assert not hasattr(model, "_tierlift_zero")
    assert list(model.named_parameters()) == params
    model[0].sparse = False  # fixed: shard again; dense SGD steps as sparse SGD does
    tierlift.zero.shard(model, stage=stage)
    _assert_same(run(model, sharded=True), want)


# ---- the model's global optimizer hooks --------------------------------------------------------
def test_a_model_collected_during_another_optimizers_step_breaks_nothing():
    """A sharded model in a reference cycle, freed by the garbage collector while an optimizer's
    step() runs the global step hooks (here a hook of the user's collects): removing its hooks
    there made step() raise `OrderedDict mutated during iteration`."""
    collect = register_optimizer_step_post_hook(lambda *a: gc.collect())
    try:
        model = _shard(_mlp(), 1)
        object.__setattr__(model, "cycle", [model])
        del model
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.SGD([p], lr=0.5).step()
        torch.testing.assert_close(p.detach(), torch.full((2,), 0.5))
    finally:
        collect.remove()
    live = _shard(_mlp(), 2)  # the next shard() takes the dead model's hooks off
    want = _train(_mlp(), _batches(), sharded=False)
    _assert_same(_train(live, _batches(), sharded=True), want)
