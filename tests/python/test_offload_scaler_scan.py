"""GradScaler's inf/NaN check done by the overlapped optimizer's own pass
(tierlift.offload.scaler_scan): the same found_inf, gradients, scale and weights as torch's
check, the overlap's gradient fingerprints taken in that one pass, and torch's check wherever
something could change a gradient between the scaler's check and step()."""

import contextlib

import numpy as np
import pytest
import torch

import tierlift
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="needs the compiled extension")


def _model(dtype):
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 200), torch.nn.Tanh(),
                               torch.nn.Linear(200, 4)).to(dtype)


def _fit(kw, dtype=torch.float32, steps=4, edit=None, hook=None):
    """Trains with scaler.step(opt); returns (weights, grads after the last scaler step,
    scale per step, whether each step's gradients came from the scaler's pass)."""
    model = _model(dtype)
    opt = AdamW(model.parameters(), lr=1e-2, **kw)
    if hook is not None:
        opt.register_step_pre_hook(hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    g = torch.Generator().manual_seed(9)
    scales, seen, grads = [], [], None
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(torch.randn(8, 16, generator=g).to(dtype)).float().square().mean()
        scaler.scale(loss).backward()
        if edit is not None:
            edit(i, model)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        seen.append((getattr(opt, "last_step_stats", None) or {}).get("grads_seen_by_scaler"))
        grads = [p.grad.clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()], grads, scales, seen


def _equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def _kw(tier, tmp_path):
    kw = dict(offload=tier, overlap=True, chunk_bytes=1 << 15)
    if tier == "nvme":
        kw.update(nvme_path=str(tmp_path), cpu_budget=1 << 20)
    return kw


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scalers_check_is_the_overlaps_check(tmp_path, tier, dtype):
    ref = _fit({}, dtype)  # torch's own check, the in-memory optimizer
    got = _fit(_kw(tier, tmp_path), dtype)
    _equal(ref[0], got[0])
    _equal(ref[1], got[1])
    assert ref[2] == got[2]
    assert got[3] == [1.0] * 4  # every step took the fingerprints from the scaler's pass


def _poke(value, at=3):
    """An edit after backward: one gradient element set to `value` on step 1 (through numpy,
    which no version counter sees)."""
    def edit(i, model):
        if i == 1:
            g = model[2].weight.grad
            g.view(-1).numpy()[at] = value
    return edit


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -0.0, 1e-41])
def test_inf_nan_signed_zero_and_subnormal_as_torch(tmp_path, value):
    """inf/NaN: the step is skipped and the scale backs off exactly as under torch's check;
    -0.0 and a subnormal (left as they are by torch's multiply by 1.0): the chunk stepped
    ahead with the old value is redone."""
    ref = _fit({}, edit=_poke(value))
    got = _fit(_kw("cpu", tmp_path), edit=_poke(value))
    _equal(ref[0], got[0])
    _equal(ref[1], got[1])
    assert ref[2] == got[2]
    if value != value or value == float("inf"):
        assert got[2][1] == got[2][0] / 2


def test_switched_off_gets_torchs_check(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERLIFT_SCALER_SCAN", "0")
    ref = _fit({})
    got = _fit(_kw("cpu", tmp_path))
    _equal(ref[0], got[0])
    assert got[3] == [0.0] * 4


def test_a_step_pre_hook_gets_torchs_check(tmp_path):
    """A pre-hook runs between the scaler's check and step() and may change a gradient (here
    through numpy): the scaler's pass is not used, the result is still the plain step's."""
    def hook(opt, args, kwargs):
        p = opt.param_groups[0]["params"][2]
        p.grad.view(-1).numpy()[7] *= 0.5

    ref = _fit({}, hook=hook)
    got = _fit(_kw("cpu", tmp_path), hook=hook)
    _equal(ref[0], got[0])
    assert got[3] == [0.0] * 4


@contextlib.contextmanager
def _flush_denormals():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def test_flushed_denormals_get_torchs_check(tmp_path):
    """With denormals flushed torch's multiply by 1.0 zeroes subnormal gradients; the scaler's
    own check runs then, so the gradients and weights are torch's."""
    with _flush_denormals():
        got = _fit(_kw("cpu", tmp_path), edit=_poke(1e-41))
    with _flush_denormals():
        ref = _fit({}, edit=_poke(1e-41))
    _equal(ref[0], got[0])
    _equal(ref[1], got[1])
    assert got[3] == [0.0] * 4


def test_a_gradient_replaced_after_the_check_is_not_trusted(tmp_path):
    """The fingerprints are used only for the same gradient tensors at the same versions."""
    from tierlift.offload import scaler_scan

    model = _model(torch.float32)
    opt = AdamW(model.parameters(), lr=1e-2, **_kw("cpu", tmp_path))
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    assert scaler_scan.scan(opt) is True
    assert opt._offload.scaler_scan is not None
    p = model[0].weight
    p.grad = p.grad.clone()
    assert scaler_scan.take(opt) is None and opt._offload.scaler_scan is None
    assert scaler_scan.scan(opt) is True
    p.grad.add_(0.0)  # bumps the version
    assert scaler_scan.take(opt) is None
    assert scaler_scan.scan(opt) is True
    assert scaler_scan.take(opt) is not None  # unchanged: used, once
    assert scaler_scan.take(opt) is None
    opt.close()


def test_other_optimizers_keep_torchs_check(tmp_path):
    _fit(_kw("cpu", tmp_path), steps=1)  # the patch is in place
    model = _model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(8, 16)).square().mean()).backward()
    model[0].weight.grad.view(-1).numpy()[0] = np.inf
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)  # torch's check: found inf, its AdamW is not called
    scaler.update()
    _equal(before, [p.detach() for p in model.parameters()])
    assert scaler.get_scale() == 2.0 ** 15


@pytest.mark.gpu
def test_a_cuda_scaler_with_host_gradients(tmp_path, monkeypatch):
    """The scale on the GPU, the gradients on the host (as with ZeRO's offload_params): the
    found_inf is keyed by the host, as torch's check keys it, and summed onto the GPU."""
    real = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda _device, **kw: real("cuda", **kw))
    ref = _fit({}, edit=_poke(float("inf")))
    got = _fit(_kw("cpu", tmp_path), edit=_poke(float("inf")))
    _equal(ref[0], got[0])
    assert ref[2] == got[2] and got[2][1] == got[2][0] / 2
    assert got[3][:1] + got[3][2:] == [1.0] * 3  # step 1 was skipped


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_shards(tmp_path, stage):
    """tierlift.zero.shard: the optimizer's parameters are flat shards; the scaler's pass
    checks and fingerprints their gradients as it does a plain model's."""
    def fit(kw):
        model = tierlift.zero.shard(_model(torch.float32), stage=stage)
        opt = AdamW(model.parameters(), lr=1e-2, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        g = torch.Generator().manual_seed(9)
        seen = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = model(torch.randn(8, 16, generator=g)).square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            seen.append(getattr(opt, "last_step_stats", {}).get("grads_seen_by_scaler"))
        return tierlift.zero.full_state_dict(model), seen

    ref, _ = fit({})
    got, seen = fit(_kw("cpu", tmp_path))
    _equal(list(ref.values()), list(got.values()))
    assert seen == [1.0] * 3
