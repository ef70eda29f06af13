"""tierlift.optim.Adam/AdamW with offload="cpu"|"nvme": exactness against offload="none" and
torch, the cpu_budget as a hard limit, state_dict in torch's format, and every fault path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tierlift
from tierlift.io import ChecksumError
from tierlift.optim import Adam, AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

SHAPES = [(37, 51), (3000,), (5,), (70000,)]


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(params, i):
    g = torch.Generator().manual_seed(100 + i)
    for j, p in enumerate(params):
        p.grad = None if (i == 1 and j == 2) else torch.randn(p.shape, generator=g).to(p.dtype)


def _train(cls, steps=4, dtype=torch.float32, **kw):
    params = _params(dtype)
    opt = cls(params, lr=1e-2, weight_decay=0.1, **kw)
    for i in range(steps):
        _grads(params, i)
        opt.step()
    return params, opt


def _nvme(tmp_path, budget=200_000):
    return dict(offload="nvme", nvme_path=str(tmp_path), cpu_budget=budget)


@pytest.mark.parametrize("cls", [Adam, AdamW])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_bit_identical_to_no_offload(tmp_path, cls, amsgrad, dtype, tier):
    ref, ref_opt = _train(cls, dtype=dtype, amsgrad=amsgrad)
    kw = _nvme(tmp_path) if tier == "nvme" else dict(offload="cpu")
    got, opt = _train(cls, dtype=dtype, amsgrad=amsgrad, **kw)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    # Several chunks were streamed: the budget forced chunks smaller than the state.
    if tier == "nvme":
        assert opt._offload.chunk_elems * 3 < sum(p.numel() for p in got)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, st in ref_sd["state"].items():
        assert st.keys() == sd["state"][i].keys()
        for k, v in st.items():
            assert torch.equal(v, sd["state"][i][k]), (i, k)
    # the tiers hold the state: optimizer.state[p] only yields it
    assert not dict.keys(opt.state[got[0]]) - {"step"}


def test_matches_torch_adamw_20_steps_with_budget_a_third_of_the_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    twin = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    n = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * n  # master, m, v
    opt = AdamW(model.parameters(), lr=1e-3, **_nvme(tmp_path, state_bytes // 3))
    ref = torch.optim.AdamW(twin, lr=1e-3)
    for _ in range(20):
        x = torch.randn(16, 64)
        model.zero_grad()
        model(x).square().mean().backward()
        for p, q in zip(model.parameters(), twin):
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    assert opt._offload.pool_bytes <= state_bytes // 3
    for p, q in zip(model.parameters(), twin):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_pool_never_exceeds_budget(tmp_path):
    budget = 150_000
    params, opt = _train(AdamW, steps=2, **_nvme(tmp_path, budget))
    eng = opt._offload._engine
    assert opt._offload.pool_bytes <= budget
    assert eng.config.pool_bytes <= budget and eng.pool_in_use <= budget
    assert eng.pool_tensor(4096, block=False) is None  # the slots use the whole pool


def test_load_state_dict_round_trip_and_torch_interop(tmp_path):
    params, opt = _train(AdamW, steps=3, **_nvme(tmp_path))
    sd = opt.state_dict()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    tq = torch.optim.AdamW(twin, lr=1e-2, weight_decay=0.1)
    tq.load_state_dict(sd)  # torch's own optimizer takes our checkpoint
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = AdamW(fresh, lr=1e-2, weight_decay=0.1, offload="cpu")
    ours.load_state_dict(tq.state_dict())
    for i in range(3, 6):
        for group in (params, twin, fresh):
            _grads(group, i)
        opt.step()
        ours.step()
        tq.step()
    for a, b, c in zip(params, fresh, twin):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)


def test_bad_arguments(tmp_path):
    p = [torch.nn.Parameter(torch.randn(10))]
    with pytest.raises(ValueError, match="offload must be one of"):
        AdamW(p, offload="disk")
    with pytest.raises(ValueError, match="needs nvme_path"):
        AdamW(p, offload="nvme")
    with pytest.raises(ValueError, match="nvme_path .* is not an existing directory"):
        AdamW(p, offload="nvme", nvme_path=str(tmp_path / "missing"))
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ValueError, match="not an existing directory"):
        AdamW(p, offload="nvme", nvme_path=str(tmp_path / "file"))
    with pytest.raises(ValueError, match="only used with offload='nvme'"):
        AdamW(p, offload="cpu", nvme_path=str(tmp_path))
    with pytest.raises(TypeError, match="cpu_budget must be an int"):
        AdamW(p, offload="cpu", cpu_budget=1.5)
    with pytest.raises(ValueError, match="cpu_budget must be > 0"):
        AdamW(p, offload="cpu", cpu_budget=0)
    with pytest.raises(ValueError, match="smallest budget that works is 36864 bytes"):
        AdamW(p, **_nvme(tmp_path, 36863))
    AdamW(p, **_nvme(tmp_path, 36864))
    with pytest.raises(ValueError, match="use offload='hybrid' or 'nvme'"):
        AdamW([torch.nn.Parameter(torch.randn(10_000))], offload="cpu", cpu_budget=1000)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_non_finite_gradient_skips_the_step(tmp_path, tier):
    """With skip_nonfinite=True; without it the step writes NaN, as torch's
    (test_offload_torch_idioms.py)."""
    kw = _nvme(tmp_path) if tier == "nvme" else dict(offload="cpu")
    params, opt = _train(AdamW, steps=2, skip_nonfinite=True, **kw)
    before = [p.detach().clone() for p in params]
    sd = opt.state_dict()
    _grads(params, 5)
    params[3].grad[17] = float("nan")
    with pytest.warns(RuntimeWarning, match="NaN/Inf"):
        opt.step()
    assert opt.last_step_stats["skipped"]
    if tier == "nvme":  # the first chunks were being read when the check failed
        assert opt.last_step_stats["early_read_chunks"] > 0
    for a, b in zip(before, params):
        assert torch.equal(a, b)
    after = opt.state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(v, after["state"][i][k])
    params[3].grad[17] = float("inf")
    with pytest.warns(RuntimeWarning):
        opt.step()
    params[3].grad[17] = 0.0
    opt.step()
    assert not opt.last_step_stats["skipped"]
    # Finite gradients whose sum overflows (the fast check's sum is inf): confirmed finite by
    # the element-wise check, so the step runs.
    params[3].grad.fill_(3e38)
    opt.step()
    assert not opt.last_step_stats["skipped"]


def test_error_before_the_update_drains_the_early_reads(tmp_path):
    """The first chunks are read before the gradient check and the hyperparameter check; an
    error there leaves no read in flight into the slots and changes nothing."""
    ref, _ = _train(AdamW, steps=3)
    params, opt = _train(AdamW, steps=2, **_nvme(tmp_path))
    before = [p.detach().clone() for p in params]
    _grads(params, 2)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
    for a, b in zip(before, params):
        assert torch.equal(a, b)
    opt.param_groups[0]["amsgrad"] = False
    opt.step()
    assert opt.last_step_stats["early_read_chunks"] > 0
    for a, b in zip(ref, params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("state_dtype, kind", [("fp32", "exp_avg_sq"), ("bf16", "exp_avg_sq"),
                                               ("bf16", "exp_avg_sq_scale")])
def test_corrupt_state_file_names_the_tensor(tmp_path, state_dtype, kind):
    params, opt = _train(AdamW, steps=2, state_dtype=state_dtype, **_nvme(tmp_path))
    tier = opt._offload.tiers[0]
    ci = len(tier.gen) - 1  # the last chunk holds params[3] only
    path = tier.paths[(kind, tier.gen[ci])]
    with open(path, "r+b") as f:
        f.seek(ci * tier.kind_chunk_bytes[kind] + 4)
        b = f.read(1)
        f.seek(ci * tier.kind_chunk_bytes[kind] + 4)
        f.write(bytes([b[0] ^ 0xFF]))
    opt._offload._engine.forget(path)
    before = [p.detach().clone() for p in params]
    _grads(params, 3)
    with pytest.raises(ChecksumError, match=kind + r" of param_groups\[0\]\['params'\]\[3\]"):
        opt.step()
    for a, b in zip(before, params):
        assert torch.equal(a, b)


_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, torch
    sys.path.insert(0, {python!r})
    from tierlift.optim import AdamW
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(200_000, generator=g))]
    opt = AdamW(params, lr=1e-2, offload="nvme", nvme_path={path!r}, cpu_budget=400_000)
    ref = AdamW([torch.nn.Parameter(params[0].detach().clone())], lr=1e-2)
    def grad(i):
        return torch.randn(200_000, generator=torch.Generator().manual_seed(i))
    params[0].grad = grad(0); opt.step()
    ref.param_groups[0]["params"][0].grad = grad(0); ref.step()
    before = params[0].detach().clone()
    # Writes past 64 KiB now fail with EFBIG, like a disk that filled up mid-step.
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
    params[0].grad = grad(1)
    try:
        opt.step()
        raise SystemExit("step did not fail")
    except OSError as e:
        assert "parameters and optimizer state are as they were" in str(e), e
        print("ERROR:", e)
    assert torch.equal(before, params[0]), "parameters changed by a failed step"
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    opt.step()  # space is back: the same step succeeds
    ref.param_groups[0]["params"][0].grad = grad(1); ref.step()
    assert torch.equal(ref.param_groups[0]["params"][0], params[0])
    print("OK")
""")


def test_full_disk_mid_step_changes_nothing_and_training_continues(tmp_path):
    python = os.path.join(os.path.dirname(tierlift.__file__), "..")
    script = _FULL_DISK.format(python=os.path.abspath(python), path=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout and "File too large" in out.stdout


_RSS = textwrap.dedent("""
    import resource, sys, torch
    sys.path.insert(0, {python!r})
    from tierlift.optim import AdamW
    torch.set_num_threads(1)
    n = 4_000_000
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    budget = 12 * n // 3
    opt = AdamW([p], lr=1e-3, offload="nvme", nvme_path={path!r}, cpu_budget=budget)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for i in range(3):
        opt.step()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(grown, budget)
    assert grown <= budget + (8 << 20), (grown, budget)
""")


def test_peak_rss_stays_within_budget(tmp_path):
    python = os.path.join(os.path.dirname(tierlift.__file__), "..")
    script = _RSS.format(python=os.path.abspath(python), path=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_files_are_removed_on_close(tmp_path):
    params, opt = _train(AdamW, steps=1, **_nvme(tmp_path))
    assert len(os.listdir(tmp_path)) == 1
    opt._offload.close()
    assert os.listdir(tmp_path) == []


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Tanh(), torch.nn.Linear(512, 300),
                               torch.nn.Tanh(), torch.nn.Linear(300, 4))


def _fit(opt_kw, steps=4, clip=None, accumulate=1, inside=False, dtype=torch.float32):
    model = _model().to(dtype)
    if inside:
        opt_kw = dict(opt_kw, max_grad_norm=clip)
    opt = AdamW(model.parameters(), lr=1e-2, **opt_kw)
    g = torch.Generator().manual_seed(7)
    kept = 0
    for _ in range(steps):
        for _ in range(accumulate):
            model(torch.randn(8, 32, generator=g).to(dtype)).square().mean().backward()
        if clip is not None and not inside:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        kept += opt.last_step_stats.get("overlap_kept_chunks", 0)
        model.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], kept


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("clip,accumulate,inside,keeps", [
    (None, 1, False, True),   # plain overlap: speculation kept
    # Two backwards per step: a chunk stepped on the first micro-batch's gradients is redone;
    # one the worker reached after the second backward read the final ones and is kept.
    (None, 2, False, None),
    (1e-3, 1, True, False),   # max_grad_norm that scales: redone with the clipped grads
    (1e9, 1, True, True),     # max_grad_norm that does not scale: kept
    (1e9, 1, False, True),    # clip_grad_norm_ under its threshold scales by 1.0: same bits
    (1e-3, 1, False, None),   # clip_grad_norm_ that scales: redone unless not yet stepped
])
def test_overlap_equals_the_plain_step(tmp_path, tier, clip, accumulate, inside, keeps):
    ref, _ = _fit({}, clip=clip, accumulate=accumulate)
    kw = _nvme(tmp_path, 1 << 20) if tier == "nvme" else dict(offload="cpu")
    got, kept = _fit(dict(kw, overlap=True), clip=clip, accumulate=accumulate, inside=inside)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    if keeps is not None:
        assert (kept > 0) == keeps


def _wait_for_overlap(opt) -> None:
    """Lets every chunk stepped during backward finish, so an edit after it is one the
    speculation cannot have seen (the cases above depend on the worker's timing)."""
    opt._offload.overlap.wait()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("edit", ["data", "numpy", "clip", "clip_by_one", "weights"])
def test_overlap_checks_its_inputs_by_content(tmp_path, tier, edit):
    """Edits after the chunks ran: the version counter sees none of the first two, so the
    check is by content; a clip by exactly 1.0 changes no bit and keeps the chunks."""
    def edited(model, opt):
        if opt is not None and opt._offload is not None:
            _wait_for_overlap(opt)
        with torch.no_grad():
            if edit == "data":
                for p in model.parameters():
                    p.grad.data.mul_(0.5)
            elif edit == "numpy":
                for p in model.parameters():
                    p.grad.numpy()[...] *= 0.5
            elif edit in ("clip", "clip_by_one"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3 if edit == "clip" else 1e9)
            else:  # a weight changed after backward, before step
                for p in model.parameters():
                    p.data.mul_(0.9)

    def fit(kw):
        model = _model()
        opt = AdamW(model.parameters(), lr=1e-2, **kw)
        g = torch.Generator().manual_seed(7)
        kept = redone = 0
        for _ in range(3):
            model(torch.randn(8, 32, generator=g)).square().mean().backward()
            edited(model, opt)
            opt.step()
            kept += opt.last_step_stats.get("overlap_kept_chunks", 0)
            redone += opt.last_step_stats.get("overlap_redone_chunks", 0)
            model.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()], kept, redone

    ref, _, _ = fit({})
    kw = _nvme(tmp_path, 1 << 20) if tier == "nvme" else dict(offload="cpu")
    got, kept, redone = fit(dict(kw, overlap=True))
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    if edit == "clip_by_one":
        assert kept > 0 and redone == 0
    else:
        assert kept == 0 and redone > 0


def test_overlap_bf16_params(tmp_path):
    ref, _ = _fit({}, dtype=torch.bfloat16)
    got, kept = _fit(dict(_nvme(tmp_path, 1 << 20), overlap=True), dtype=torch.bfloat16)
    assert kept > 0
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_overlap_needs_an_offload_tier():
    with pytest.raises(ValueError, match="need offload='cpu', 'nvme' or 'hybrid'"):
        AdamW([torch.nn.Parameter(torch.randn(3))], overlap=True)
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        AdamW([torch.nn.Parameter(torch.randn(3))], offload="cpu", max_grad_norm=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["cpu", "nvme", "nvme-1gen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_params_match_cpu_params_bit_for_bit(tmp_path, tier, dtype):
    # Same CPU kernel on the same fp32 state: GPU params only add the D2H and H2D legs.
    # With one generation an fp32 device parameter is its own master (no master stored).
    kw = _nvme(tmp_path, 1 << 20) if tier != "cpu" else dict(offload="cpu")
    if tier == "nvme-1gen":
        kw["nvme_generations"] = 1
    cpu, _ = _train(AdamW, dtype=dtype, **kw)
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params(dtype)]
    opt = AdamW(params, lr=1e-2, weight_decay=0.1, **kw)
    for i in range(4):
        host = [torch.nn.Parameter(torch.empty(p.shape, dtype=dtype)) for p in params]
        _grads(host, i)
        for p, h in zip(params, host):
            p.grad = None if h.grad is None else h.grad.cuda()
        opt.step()
    assert opt.last_step_stats["d2h_s"] > 0 and opt.last_step_stats["h2d_s"] > 0
    for a, b in zip(cpu, params):
        assert torch.equal(a, b.detach().cpu())
    own = tier == "nvme-1gen" and dtype == torch.float32
    assert ("master" in opt._offload.tiers[0].kinds) != own


def test_dropping_the_optimizer_removes_its_files(tmp_path):
    import gc

    model = _model()
    opt = AdamW(model.parameters(), overlap=True, **_nvme(tmp_path, 1 << 20))
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    assert len(os.listdir(tmp_path)) == 1
    del opt
    gc.collect()
    assert os.listdir(tmp_path) == []
    model(torch.randn(2, 32)).sum().backward()  # the hooks outlive the optimizer harmlessly


def test_close_releases_state_and_refuses_to_step(tmp_path):
    params, opt = _train(AdamW, steps=2, **_nvme(tmp_path))
    assert any(n.startswith("tierlift-offload-") for n in os.listdir(tmp_path))
    opt.close()
    assert not any(n.startswith("tierlift-offload-") for n in os.listdir(tmp_path))
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    opt.close()  # idempotent
    AdamW(params).close()  # a no-op without offload
