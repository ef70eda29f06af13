"""ZeRO-Infinity: tierlift.zero.shard() + tierlift.optim.AdamW(offload="cpu"|"nvme", overlap=True)
and stage-3 parameter offload (offload_params="cpu", gpu_budget).

Exactness: the overlapped, offloaded step gives bit-identical weights to the plain step
(offload="none", clipping with tierlift.zero.clip_grad_norm_), and both match torch.optim.AdamW
on the unsharded model after 20 steps. The overlap must really happen under ZeRO: every chunk is
stepped during backward and kept, none redone (unless clipping scales the gradients)."""

from __future__ import annotations

import contextlib
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zero_model import run_torchrun

import tierlift

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

VOCAB, DIM, HIDDEN, LAYERS, SEQ = 97, 64, 256, 3, 8
STEPS, BATCH, LR, WD = 20, 8, 3e-3, 0.1
CLIP = 0.05  # small enough that it scales every step


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Net(nn.Module):
    """Tied embedding / head (root unit), 3 blocks (one unit each), an odd-sized bias."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)  # bias of 97 elements: not divisible by 2
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def data(steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def state_bytes(model) -> int:
    """fp32 master, exp_avg and exp_avg_sq of this rank's parameters."""
    return 12 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def fit(model, opt, *, world=1, rank=0, zero=True, clip=None, accum=1, steps=STEPS,
        device="cpu"):
    """Trains on `data()`; clip is applied outside the optimizer (zero/torch clip_grad_norm_).
    Returns (kept, redone) overlap chunk counts summed over the steps."""
    kept = redone = 0
    for seq in data(steps):
        opt.zero_grad(set_to_none=True)
        for m, micro in enumerate(seq.chunk(accum)):
            local = micro.chunk(world)[rank].to(device)
            sync = not zero or m == accum - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                logits = model(local[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), local[:, 1:].flatten()) / accum
                loss.backward()
        if clip is not None:
            if zero:
                tierlift.zero.clip_grad_norm_(model, clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        stats = getattr(opt, "last_step_stats", {})
        kept += stats.get("overlap_kept_chunks", 0)
        redone += stats.get("overlap_redone_chunks", 0)
    return int(kept), int(redone)


def offload_kw(tier: str, model, tmp) -> dict:
    if tier == "cpu":
        return dict(offload="cpu", overlap=True)
    return dict(offload="nvme", nvme_path=str(tmp), cpu_budget=state_bytes(model) // 3,
                overlap=True)


def run_plain(stage, clip, world=1, rank=0, accum=1, device_fraction=0.0, **shard_kw):
    model = tierlift.zero.shard(make_net(), stage=stage, **shard_kw)
    opt = tierlift.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    fit(model, opt, world=world, rank=rank, clip=clip, accum=accum)
    return tierlift.zero.full_state_dict(model)


def run_offload(stage, tier, clip, tmp, world=1, rank=0, accum=1, device_fraction=0.0,
                **shard_kw):
    model = tierlift.zero.shard(make_net(), stage=stage, **shard_kw)
    kw = offload_kw(tier, model, tmp)
    if device_fraction:  # each rank keeps the state of its first shards beside them
        kw["device_fraction"] = device_fraction
    opt = tierlift.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=clip,
                               **kw)
    kept, redone = fit(model, opt, world=world, rank=rank, accum=accum)
    sd = tierlift.zero.full_state_dict(model)
    stats = dict(model._tierlift_zero.stats,
                 device_part_params=opt.last_step_stats.get("device_part_params", 0))
    return sd, kept, redone, stats


def run_torch(clip, accum=1):
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    fit(model, opt, zero=False, clip=clip, accum=accum)
    return model.state_dict()


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_close_to_torch(sd: dict, ref: dict, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    for k, v in ref.items():
        torch.testing.assert_close(sd[k], v, rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{k}: {m}")


_PLAIN: dict = {}


def plain(stage, clip, **kw):
    key = (stage, clip, tuple(sorted(kw.items())))
    if key not in _PLAIN:
        _PLAIN[key] = run_plain(stage, clip, **kw)
    return _PLAIN[key]


# ---- 1. shard() + offloaded, overlapped AdamW, single process ----------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("clip", [None, CLIP])
def test_overlap_under_zero_is_exact(tmp_path, stage, tier, clip):
    torch.set_num_threads(1)
    sd, kept, redone, stats = run_offload(stage, tier, clip, tmp_path)
    assert_same(sd, plain(stage, clip))
    assert_close_to_torch(sd, run_torch(clip))
    if clip is None:
        # Every chunk was stepped during backward and kept.
        assert kept > 0 and redone == 0
        assert stats["grads_ready_early"] > 0
    else:
        assert redone > 0  # the clip scaled the gradients: redone, and still exact


def test_max_grad_norm_that_does_not_scale_keeps_the_overlap(tmp_path):
    sd, kept, redone, _ = run_offload(3, "nvme", 1e9, tmp_path)
    assert_same(sd, plain(3, 1e9))
    assert kept > 0 and redone == 0


def test_gradient_accumulation_notifies_only_after_the_synced_backward(tmp_path):
    model = tierlift.zero.shard(make_net(), stage=3)
    calls = []
    handles = [tierlift.zero.on_shard_grad_ready(p, calls.append) for p in model.parameters()]
    seq = data(1)[0]
    with model.no_sync():
        F.cross_entropy(model(seq[:4, :-1]).flatten(0, 1), seq[:4, 1:].flatten()).backward()
    assert calls == []
    F.cross_entropy(model(seq[4:, :-1]).flatten(0, 1), seq[4:, 1:].flatten()).backward()
    assert sorted(map(id, calls)) == sorted(map(id, model.parameters()))
    assert all(p.grad is not None for p in calls)
    for h in handles:
        h.remove()
    # And the accumulated result through the offloaded optimizer is exact.
    sd, kept, redone, _ = run_offload(3, "cpu", None, tmp_path, accum=2)
    assert_same(sd, plain(3, None, accum=2))
    assert kept > 0 and redone == 0


def test_global_grad_norm_of_shards_matches_torch():
    model, ref = tierlift.zero.shard(make_net(), stage=2), make_net()
    seq = data(1)[0]
    for m in (model, ref):
        F.cross_entropy(m(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten()).backward()
    got = tierlift.zero.global_grad_norm(list(model.parameters()))
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    extra = nn.Parameter(torch.ones(3))
    extra.grad = torch.full((3,), 2.0)
    both = tierlift.zero.global_grad_norm([*model.parameters(), extra])
    torch.testing.assert_close(both, (want ** 2 + 12.0).sqrt(), rtol=1e-6, atol=0)


def test_on_shard_grad_ready_needs_a_shard():
    with pytest.raises(ValueError, match="not a shard"):
        tierlift.zero.on_shard_grad_ready(nn.Parameter(torch.ones(2)), print)


# ---- 2. stage-3 parameter offload --------------------------------------------------------------
def unit_sizes(model) -> tuple[int, int]:
    units = model._tierlift_zero.units
    root = sum(u.gather_bytes for u in units if u.module is model)
    return root, max(u.gather_bytes for u in units if u.module is not model)


@pytest.mark.parametrize("mp", [None, tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32)])
def test_offload_params_cpu_is_bit_identical(mp):
    sd = run_plain(3, CLIP, offload_params="cpu", mixed_precision=mp)
    assert_same(sd, plain(3, CLIP, mixed_precision=mp))
    model = tierlift.zero.shard(make_net(), stage=3, offload_params="cpu", mixed_precision=mp)
    assert all(p.device.type == "cpu" for p in model.parameters())
    # One host arena holds every shard (one allocation, page-locked once with CUDA).
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1
    if torch.cuda.is_available():
        assert all(p.is_pinned() for p in model.parameters())
    opt = tierlift.optim.AdamW(model.parameters(), lr=LR)
    fit(model, opt, steps=1)
    stats = model._tierlift_zero.stats
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0


def test_device_params_keep_the_first_units_on_the_device():
    """device_params: whole units, in model order, up to that many parameters stay; the rest
    are offloaded into a host arena of their size; training is the same bits."""
    probe = tierlift.zero.shard(make_net(), stage=3)
    sizes = [sum(e.numel for e in u.entries) for u in probe._tierlift_zero.units]
    keep = sizes[0] + sizes[1]
    for device_params, stays in ((0, 0), (keep - 1, 1), (keep, 2), (10**9, len(sizes))):
        model = tierlift.zero.shard(make_net(), stage=3, offload_params="cpu",
                                    device_params=device_params)
        units = model._tierlift_zero.units
        assert [u.offload is None for u in units] == [i < stays for i in range(len(units))]
        assert model._tierlift_zero.offload.arena.numel() == sum(
            u.shard_numel for u in units if u.offload is not None)
    sd = run_plain(3, CLIP, offload_params="cpu", device_params=keep)
    assert_same(sd, plain(3, CLIP))


def test_offload_params_with_offloaded_optimizer(tmp_path):
    sd, kept, redone, _ = run_offload(3, "nvme", None, tmp_path, offload_params="cpu")
    assert_same(sd, plain(3, None))
    assert kept > 0 and redone == 0


def test_gpu_budget_caps_the_gathered_bytes():
    probe = tierlift.zero.shard(make_net(), stage=3)
    root, largest = unit_sizes(probe)
    fit(probe, tierlift.optim.AdamW(probe.parameters(), lr=LR), steps=2)
    unbounded = probe._tierlift_zero.stats["peak_resident_bytes"]
    smallest = root + largest
    assert unbounded > smallest  # prefetch holds two units next to the root without a budget
    with pytest.raises(ValueError, match=f"smallest budget that works is {smallest} bytes"):
        tierlift.zero.shard(make_net(), stage=3, gpu_budget=smallest - 1)
    sd = run_plain(3, None, offload_params="cpu", gpu_budget=smallest)
    assert_same(sd, plain(3, None))
    model = tierlift.zero.shard(make_net(), stage=3, offload_params="cpu", gpu_budget=smallest)
    fit(model, tierlift.optim.AdamW(model.parameters(), lr=LR), steps=3)
    stats = model._tierlift_zero.stats
    assert 0 < stats["peak_resident_bytes"] <= smallest
    assert stats["prefetch_skipped"] > 0
    # A budget with room for two blocks prefetches again and stays within it.
    roomy = root + 2 * largest
    model = tierlift.zero.shard(make_net(), stage=3, gpu_budget=roomy)
    fit(model, tierlift.optim.AdamW(model.parameters(), lr=LR), steps=3)
    stats = model._tierlift_zero.stats
    assert smallest < stats["peak_resident_bytes"] <= roomy
    assert stats["prefetch_skipped"] == 0


@pytest.mark.parametrize("kw,exc,match", [
    (dict(offload_params="nvme"), ValueError, "offload_params='nvme' needs nvme_path="),
    (dict(offload_params="gpu"), ValueError, "offload_params must be one of"),
    (dict(stage=2, offload_params="cpu"), ValueError, "offload_params='cpu' needs stage=3"),
    (dict(gpu_budget="1G"), TypeError, "gpu_budget must be an int"),
    (dict(gpu_budget=0), ValueError, "gpu_budget must be > 0"),
    (dict(stage=1, gpu_budget=1 << 30), ValueError, "gpu_budget needs stage=3"),
    (dict(device_params=1000), ValueError, "device_params keeps some shards on the device"),
    (dict(offload_params="cpu", device_params=-1), ValueError, "device_params must be an int"),
    (dict(offload_params="cpu", device_params=1.5), ValueError, "device_params must be an int"),
    (dict(gpu_budget=1 << 30, reshard_after_forward=False), ValueError,
     "gpu_budget needs reshard_after_forward=True"),
])
def test_bad_arguments(kw, exc, match):
    kw = dict(dict(stage=3), **kw)
    with pytest.raises(exc, match=match):
        tierlift.zero.shard(make_net(), **kw)


@pytest.mark.gpu
def test_offload_params_on_cuda(tmp_path):
    """The copy stream, events and pinned staging for real: bf16 compute on the GPU, fp32
    shards in pinned RAM, state in RAM with overlap; against the same model without parameter
    offload (stepped by the CUDA kernel) and within a gpu_budget. No clipping: a norm summed on
    the GPU and one summed on the CPU differ in the last bit, which bf16 compute then spreads."""
    mp = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    probe = tierlift.zero.shard(make_net().cuda(), stage=3, mixed_precision=mp)
    root, largest = unit_sizes(probe)
    out = {}
    for op in ("none", "cpu"):
        model = tierlift.zero.shard(make_net().cuda(), stage=3, mixed_precision=mp,
                                    offload_params=op, gpu_budget=root + largest)
        params = list(model.parameters())
        assert all(p.is_pinned() for p in params) if op == "cpu" else all(p.is_cuda
                                                                           for p in params)
        kw = dict(offload="cpu", overlap=True) if op == "cpu" else {}
        opt = tierlift.optim.AdamW(params, lr=LR, weight_decay=WD, **kw)
        fit(model, opt, steps=5, device="cuda")
        torch.cuda.synchronize()
        stats = model._tierlift_zero.stats
        assert stats["peak_resident_bytes"] <= root + largest
        if op == "cpu":
            assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0
        out[op] = {k: v.float().cpu() for k, v in tierlift.zero.full_state_dict(model).items()}
    # The CUDA kernel and the CPU's SIMD kernel give the same bits (test_optim_amp); what is
    # left is the GPU's own run-to-run order of sums (embedding backward), hence a tolerance.
    for k, v in out["none"].items():
        torch.testing.assert_close(out["cpu"][k], v, rtol=1e-5, atol=1e-6)


# ---- under torchrun, 2 gloo ranks --------------------------------------------------------------
CONFIGS = [  # (stage, tier, clip, shard kwargs)
    (1, "cpu", None, {}), (1, "nvme", CLIP, {}),
    (2, "cpu", CLIP, {}), (2, "nvme", None, {}),
    (3, "cpu", None, {}), (3, "nvme", CLIP, {}),
    (3, "nvme", None, {"offload_params": "cpu"}),
    (3, "cpu", CLIP, {"device_fraction": 0.4}),
]

SCRIPT = textwrap.dedent("""
    from test_zero_offload import CONFIGS, run_offload, run_plain
    out = {{}}
    for i, (stage, tier, clip, kw) in enumerate(CONFIGS):
        tmp = tempfile.mkdtemp(dir={tmp!r})
        sd, kept, redone, st = run_offload(stage, tier, clip, tmp, world=world, rank=rank, **kw)
        ref = run_plain(stage, clip, world=world, rank=rank, **kw)
        out[i] = dict(sd=sd, ref=ref, kept=kept, redone=redone,
                      device_part=st["device_part_params"])
""")


def test_torchrun_two_ranks(tmp_path):
    results = run_torchrun(SCRIPT, tmp_path, tmp=str(tmp_path))
    torch.set_num_threads(1)
    refs = {}
    for i, (_, _, clip, _) in enumerate(CONFIGS):
        r = results[i]
        assert_same(r["sd"], r["ref"])
        if clip not in refs:
            refs[clip] = run_torch(clip)
        # Two ranks sum the gradient halves in another order than one process does: a few
        # elements differ by ~1e-5 relative (Adam's division by sqrt(v) amplifies the last bit
        # where v is tiny: up to ~1e-6 absolute near zero); each tensor as a whole stays within
        # 1e-6. Against torch at the same world size (assert_same above) it is bit-exact.
        assert_close_to_torch(r["sd"], refs[clip], rtol=1e-5, atol=4e-6)
        for k, v in refs[clip].items():
            assert (r["sd"][k] - v).norm() <= 1e-6 * v.norm(), (i, k)
        if clip is None:
            assert r["kept"] > 0 and r["redone"] == 0, i
        else:
            assert r["redone"] > 0, i
        assert (r["device_part"] > 0) == bool(CONFIGS[i][3].get("device_fraction")), i


def test_only_live_shards_are_shards():
    import copy

    model = tierlift.zero.shard(make_net(), stage=3)
    shard = next(model.parameters())
    assert tierlift.zero.is_shard(shard)
    assert not tierlift.zero.is_shard(copy.deepcopy(shard))
    assert not tierlift.zero.is_shard(nn.Parameter(torch.ones(1)))
    del model
    assert not tierlift.zero.is_shard(shard)  # the model's state is gone


# ---- bf16 gradient shards (MixedPrecision(grad_dtype=torch.bfloat16)) ------------------------
BF16 = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16)
BF16_GRADS = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16,
                                          grad_dtype=torch.bfloat16)


def _fit_shards(mp, opt_kw=None, clip=None, accum=1, steps=6, **shard_kw):
    model = tierlift.zero.shard(make_net(), mixed_precision=mp, **shard_kw)
    opt = tierlift.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **(opt_kw or {}))
    fit(model, opt, clip=clip, accum=accum, steps=steps)
    grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    return model, tierlift.zero.full_state_dict(model), grads


@pytest.mark.parametrize("stage,offload_params", [(1, "none"), (2, "none"), (3, "none"),
                                                  (3, "cpu")])
def test_bf16_grad_shards_train_bit_identically(stage, offload_params):
    """A bf16 reduction's sum has bf16 precision: keeping it in bf16 loses nothing, with
    gradient accumulation inside no_sync() too."""
    kw = dict(stage=stage, offload_params=offload_params, accum=2)
    ref_model, ref, ref_grads = _fit_shards(BF16, **kw)
    model, got, grads = _fit_shards(BF16_GRADS, **kw)
    assert ref_grads == {torch.float32} and grads == {torch.bfloat16}
    assert_same(got, ref)
    if offload_params == "cpu":  # half the bytes come down, and are held, as gradients
        ref_stats, stats = ref_model._tierlift_zero.stats, model._tierlift_zero.stats
        assert stats["h2d_bytes"] == ref_stats["h2d_bytes"]
        assert 2 * stats["d2h_bytes"] == ref_stats["d2h_bytes"]
        assert all(p.grad.device.type == "cpu" and p.grad.element_size() == 2
                   for p in model.parameters())


@pytest.mark.parametrize("layout", ["hybrid-1gen", "nvme-overlap"])
def test_bf16_grad_shards_with_the_offloaded_optimizer(tmp_path, layout):
    """Parameters offloaded, the optimizer streaming its state (own-master one generation in
    RAM and on the drive, or two generations with overlap): the same bits as fp32 gradients."""
    def opt_kw(sub):
        (tmp_path / sub).mkdir()
        if layout == "hybrid-1gen":
            return dict(offload="hybrid", nvme_path=str(tmp_path / sub), cpu_budget=200_000,
                        nvme_generations=1, state_dtype="bf16")
        return dict(offload="nvme", nvme_path=str(tmp_path / sub), cpu_budget=300_000,
                    overlap=True)

    _, ref, _ = _fit_shards(BF16, opt_kw("a"), stage=3, offload_params="cpu")
    model, got, grads = _fit_shards(BF16_GRADS, opt_kw("b"), stage=3, offload_params="cpu")
    assert grads == {torch.bfloat16}
    assert_same(got, ref)


def test_bf16_grad_shards_clipped_in_bf16():
    """Clipping scales the gradient where it is held, so a bf16 gradient is rounded to bf16
    once more: close to the fp32 gradients' training, not the same bits."""
    _, ref, _ = _fit_shards(BF16, stage=3, clip=CLIP)
    _, got, _ = _fit_shards(BF16_GRADS, stage=3, clip=CLIP)
    assert any(not torch.equal(got[k], ref[k]) for k in ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=2 * LR * 6)


def test_bf16_grad_shards_refused_where_they_cannot_go(tmp_path):
    model = tierlift.zero.shard(make_net(), stage=3, mixed_precision=BF16_GRADS)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(TypeError, match=r"AdamW got torch.bfloat16 gradients of torch.float32 "
                                        r"shards .* use tierlift.optim"):
        fit(model, opt, steps=1)
    with pytest.raises(ValueError, match="grad_dtype=torch.bfloat16 cannot be combined with "
                                         "offload_params='nvme'"):
        tierlift.zero.shard(make_net(), stage=3, mixed_precision=BF16_GRADS,
                            offload_params="nvme", nvme_path=str(tmp_path))
    with pytest.raises(TypeError, match="grad_dtype must be float32, bfloat16 or float16"):
        tierlift.zero.MixedPrecision(grad_dtype=torch.float64)


# ---- weights loaded mid-training ---------------------------------------------------------------
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("offload_params", [None, "cpu"])
def test_a_state_dict_loaded_mid_training_is_stepped_from(tmp_path, tier, offload_params):
    """The offloaded optimizer keeps its own copy of every weight (two generations); a state
    dict loaded into the shards between steps is what the next step starts from, as torch."""
    other = make_net()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    ref = make_net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    fit(ref, ref_opt, zero=False, steps=3)
    ref.load_state_dict(other.state_dict())
    fit(ref, ref_opt, zero=False, steps=3)

    kw = {} if offload_params is None else dict(offload_params=offload_params)
    model = tierlift.zero.shard(make_net(), stage=3, **kw)
    opt = tierlift.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD,
                               **offload_kw(tier, model, tmp_path))
    fit(model, opt, steps=3)
    tierlift.zero.load_full_state_dict(model, other.state_dict())
    fit(model, opt, steps=3)
    assert_close_to_torch(tierlift.zero.full_state_dict(model), ref.state_dict())
