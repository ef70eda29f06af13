"""PyTorch's own Adam/AdamW test configurations (torch.testing._internal.common_optimizers:
optim_inputs_func_adam / optim_inputs_func_adamw) run through tierlift's Adam/AdamW and compared
with torch's, in every mode, with plain steps.

The CPU configurations are taken as they are. The ones torch lists for CUDA only (tensor lr,
tensor betas, capturable) are run too: tierlift accepts capturable and ignores it, as it does
foreach and fused, and documents a tensor lr. differentiable=True is refused at construction
(test_differentiable_is_refused). Compact state refuses amsgrad (test_compact_refuses_amsgrad)."""

from __future__ import annotations

import copy

import pytest
import torch
from conformance_util import (
    COMPACT_MODES,
    MODES,
    assert_bitwise,
    assert_same_snapshot,
    close,
    flat,
    num_threads,
    snapshot,
    timings,
    tl_opt,
)
from torch.testing._internal.common_optimizers import (
    optim_inputs_func_adam,
    optim_inputs_func_adamw,
)

import tierlift

pytestmark = [
    pytest.mark.skipif(not tierlift._extension.available(), reason="compiled extension not loaded"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

CLASSES = {"Adam": (tierlift.optim.Adam, torch.optim.Adam, optim_inputs_func_adam),
           "AdamW": (tierlift.optim.AdamW, torch.optim.AdamW, optim_inputs_func_adamw)}
STEPS = 4
SHAPES = [(37, 29), (700,), (5,)]  # per group: an odd matrix, a vector, a tail


def _configs(cls_name: str) -> list[tuple[str, dict]]:
    """(desc, kwargs): the CPU configurations, then the CUDA-only ones not already listed."""
    func = CLASSES[cls_name][2]
    cpu = [(oi.desc, oi.kwargs) for oi in func(device="cpu")]
    descs = {d for d, _ in cpu}
    return cpu + [(f"cuda-only {oi.desc}", oi.kwargs) for oi in func(device="cuda")
                  if oi.desc not in descs]


def _torch_kw(kw: dict) -> dict:
    """The reference: torch's fused CPU kernel (see conformance_util.TOL); capturable off (it
    changes only where the step count lives)."""
    kw = {k: v for k, v in copy.deepcopy(kw).items() if k not in ("capturable", "foreach")}
    kw["fused"] = True
    return kw


@pytest.fixture(autouse=True)
def _one_thread():
    with num_threads(1):
        yield


def _bank(n_groups: int, seed: int = 0) -> list[list[torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.nn.Parameter(torch.randn(s, generator=g) * 0.3) for s in SHAPES]
            for _ in range(n_groups)]


def _backward(params, step: int) -> None:
    """Gradients from backward (so overlap's hooks fire), t + 0.1 p: each depends on its weight
    only, so every group trains independently of the others."""
    g = torch.Generator().manual_seed(1000 + step)
    loss = sum((p * torch.randn(p.shape, generator=g)).sum() + 0.05 * p.square().sum()
               for p in params)
    loss.backward()


def _train(params, opts, steps: int = STEPS) -> None:
    for i in range(steps):
        _backward(params, i)
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _rel(got, ref) -> float:
    a, b = flat(got), flat(ref)
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("impl", ["default", "foreach", "fused"])
@pytest.mark.parametrize(("cls_name", "desc", "kw"), [
    pytest.param(c, d, kw, id=f"{c}-{d}") for c in CLASSES for d, kw in _configs(c)])
def test_torch_config_matches_torch(cls_name, desc, kw, impl):
    """Each configuration on its own optimizer (offload="none": the constructor's handling of
    tensor hyperparameters and flags; the offloaded modes: test_torch_configs_as_groups)."""
    tl_cls, torch_cls, _ = CLASSES[cls_name]
    ours, ref = _bank(1)[0], _bank(1)[0]
    tl_kw = copy.deepcopy(kw)
    if impl != "default":
        tl_kw[impl] = True
    opt = tl_cls(ours, **tl_kw)
    ref_opt = torch_cls(ref, **_torch_kw(kw))
    _train(ours, [opt])
    _train(ref, [ref_opt])
    err = _rel(ours, ref)
    assert err <= 1e-6, f"{cls_name} {desc} ({impl}): rel_err={err:.2e}"


def _groups(n_groups_per_class: dict, bank) -> tuple[list, list]:
    """tierlift param groups (one per configuration, Adam and AdamW as Adam's
    decoupled_weight_decay) and the matching torch optimizers, one per group."""
    groups, descs = [], []
    it = iter(bank)
    for cls_name, configs in n_groups_per_class.items():
        for desc, kw in configs:
            kw = copy.deepcopy(kw)
            kw.pop("capturable", None)
            kw.setdefault("lr", 1e-3)  # each class's defaults, explicit in the group
            kw.setdefault("weight_decay", 1e-2 if cls_name == "AdamW" else 0.0)
            groups.append({"params": next(it), **kw,
                           "decoupled_weight_decay": cls_name == "AdamW"})
            descs.append(f"{cls_name} {desc}")
    return groups, descs


def _config_groups(compact: bool = False) -> dict:
    """Per class, the configurations as groups: capturable dropped (it only says where the step
    count lives), then duplicates dropped; compact state without amsgrad."""
    out = {}
    for c in CLASSES:
        seen, out[c] = set(), []
        for d, kw in _configs(c):
            key = repr({k: v for k, v in kw.items() if k != "capturable"})
            if key not in seen and not (compact and kw.get("amsgrad")):
                seen.add(key)
                out[c].append((d, kw))
    return out


@pytest.mark.parametrize("case", timings(MODES, variants=False))
def test_torch_configs_as_groups(case, tmp_path):
    """Every configuration of both classes as one param group of one optimizer in each mode
    (tierlift.optim.Adam; AdamW's as groups with decoupled_weight_decay=True), against one
    torch optimizer per configuration."""
    mode, seed, threads = case
    configs = _config_groups()
    n = sum(len(v) for v in configs.values())
    with num_threads(threads):
        ours, ref = _bank(n, seed), _bank(n, seed)
        groups, descs = _groups(configs, ours)
        ref_groups, _ = _groups(configs, ref)
        ref_opts = [(torch.optim.AdamW if g["decoupled_weight_decay"] else torch.optim.Adam)(
            g["params"], **_torch_kw({k: v for k, v in g.items()
                                      if k not in ("params", "decoupled_weight_decay")}))
            for g in ref_groups]
        opt = tl_opt(mode, groups, tmp_path, cls=tierlift.optim.Adam)
        try:
            _train([p for g in ours for p in g], [opt])
            _train([p for g in ref for p in g], ref_opts)
            bad = {d: e for d, a, b in zip(descs, ours, ref) if (e := _rel(a, b)) > 1e-6}
            assert not bad, "rel_err per configuration: " + ", ".join(
                f"{d}: {e:.2e}" for d, e in bad.items())
        finally:
            close(opt)


@pytest.mark.parametrize("case", timings([m for m in COMPACT_MODES if m != "c_none"],
                                         variants=False))
def test_torch_configs_as_groups_compact_bitwise(case, tmp_path):
    """The same groups (but amsgrad) with compact state: bit-identical to the in-memory compact
    optimizer."""
    mode, seed, threads = case
    configs = _config_groups(compact=True)
    n = sum(len(v) for v in configs.values())
    with num_threads(threads):
        ours, ref = _bank(n, seed), _bank(n, seed)
        opt = tl_opt(mode, _groups(configs, ours)[0], tmp_path, cls=tierlift.optim.Adam)
        ref_opt = tl_opt("c_none", _groups(configs, ref)[0], tmp_path, cls=tierlift.optim.Adam)
        try:
            _train([p for g in ours for p in g], [opt])
            _train([p for g in ref for p in g], [ref_opt])
            assert_bitwise([p for g in ours for p in g], [p for g in ref for p in g])
            assert_same_snapshot((flat([p for g in ours for p in g]), opt.state_dict()),
                                 (flat([p for g in ref for p in g]), ref_opt.state_dict()),
                                 "compact state")
        finally:
            close(opt)


@pytest.mark.parametrize("mode", ["none", "cpu_ov", "nvme2"])
@pytest.mark.parametrize("cls_name", list(CLASSES))
def test_differentiable_is_refused(cls_name, mode, tmp_path):
    params = _bank(1)[0]
    before = flat(params).clone()
    with pytest.raises(ValueError, match="differentiable"):
        tl_opt(mode, params, tmp_path, cls=CLASSES[cls_name][0], differentiable=True)
    assert torch.equal(flat(params), before)


@pytest.mark.parametrize("mode", ["c_none", "c_nvme2_ov"])
def test_compact_refuses_amsgrad(mode, tmp_path):
    """At construction, and for a group switched to amsgrad later: before any change."""
    params = _bank(1)[0]
    with pytest.raises(ValueError, match="amsgrad"):
        tl_opt(mode, params, tmp_path, amsgrad=True)
    opt = tl_opt(mode, params, tmp_path)
    try:
        _train(params, [opt], steps=1)
        before = snapshot(torch.nn.ParameterList(params), opt)
        _backward(params, 1)
        opt.param_groups[0]["amsgrad"] = True
        with pytest.raises(ValueError, match="amsgrad"):
            opt.step()
        opt.param_groups[0]["amsgrad"] = False
        assert_same_snapshot(snapshot(torch.nn.ParameterList(params), opt), before, "refused step")
    finally:
        close(opt)

