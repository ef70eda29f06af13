"""The overlap's check rides on passes step() makes anyway (tierlift.offload.overlap): host
gradients are fingerprinted by the finite check, fp32 host parameters by the pass that publishes
them. One flipped bit after the chunks were stepped ahead, where no version counter sees it,
must still send exactly that chunk back to be stepped again, with the plain step's result; and
the fused passes themselves (tierlift._C.io.fingerprints_finite, copy_checked) must give the
plain fingerprint and never write a group they refuse."""

import numpy as np
import pytest
import torch

import tierlift
from tierlift.offload.watch import copy_checked, fingerprints, fingerprints_finite
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="needs the compiled extension")

_INF = {torch.float32: (np.int32, 0x7F800000), torch.bfloat16: (np.int16, 0x7F80),
        torch.float16: (np.int16, 0x7C00)}


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as integers of its element width (writes go to the tensor)."""
    return t.detach().view(torch.int32 if t.element_size() == 4 else torch.int16).numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 300, 1040])
def test_finite_pass_gives_the_fingerprint_and_finds_every_inf_and_nan(dtype, n):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 100).to(dtype)
    t[0] = torch.finfo(dtype).max  # largest finite: exponent all ones but one bit
    t[-1] = torch.finfo(dtype).tiny / 2  # subnormal
    values, flags = fingerprints_finite([t, t[1:]])
    assert values == fingerprints([t, t[1:]]) and flags == [True, True]
    _, exp = _INF[dtype]
    width = 8 * t.element_size()
    quiet = (exp >> 1) & ~exp  # the top mantissa bit
    for at in sorted({0, n // 2, n - 1}):  # first, middle, last (the padded tail stripe)
        for bad in (exp, exp | 1, exp | quiet):  # Inf, a signalling NaN, a quiet NaN
            for sign in (0, 1):
                u = t.clone()
                word = bad | (sign << (width - 1))
                _bits(u)[at] = word - (1 << width) if word >> (width - 1) else word
                assert not bool(u[at].isfinite())
                values, flags = fingerprints_finite([t, u])
                assert flags == [True, False], (at, hex(bad), sign)
                assert values[1] == fingerprints([u])[0]


def test_finite_pass_refuses_other_dtypes():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        fingerprints_finite([torch.zeros(4, dtype=torch.float64)])


def test_copy_checked_copies_whole_groups_or_nothing():
    g = torch.Generator().manual_seed(1)
    src = [torch.randn(n, generator=g) for n in (5, 1000, 4099, 64)]
    dst = [torch.randn(s.numel(), generator=g) for s in src]
    was = [d.clone() for d in dst]
    want = fingerprints(dst)
    # group 0: checks pass; group 1: the second dst's check fails; group 2: no checks
    groups = [[(dst[0], src[0], want[0]), (dst[1], src[1], None)],
              [(dst[2], src[2], want[2]), (dst[3], src[3], want[3] ^ 1)]]
    got = copy_checked(groups)
    assert got[0] == fingerprints(src[:2]) and got[1] is None
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[1])
    assert torch.equal(dst[2], was[2]) and torch.equal(dst[3], was[3])  # nothing written
    assert copy_checked([[]]) == [[]]
    with pytest.raises(ValueError, match="bytes"):
        copy_checked([[(dst[0], src[1], None)]])
    with pytest.raises(ValueError, match="overlap"):
        copy_checked([[(src[1][:10], src[1][5:15], None)]])


def test_copy_checked_sees_any_one_flipped_bit():
    g = torch.Generator().manual_seed(2)
    dst, src = torch.randn(300, generator=g), torch.randn(300, generator=g)
    want = fingerprints([dst])[0]
    raw = dst.view(torch.uint8).numpy()
    for bit in range(0, 300 * 32, 7):
        raw[bit // 8] ^= 1 << (bit % 8)
        assert copy_checked([[(dst, src, want)]]) == [None], bit
        raw[bit // 8] ^= 1 << (bit % 8)
    assert copy_checked([[(dst, src, want)]]) == [fingerprints([src])]


def _model(dtype):
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Tanh(),
                               torch.nn.Linear(512, 300), torch.nn.Tanh(),
                               torch.nn.Linear(300, 4)).to(dtype)


def _flip(t: torch.Tensor, at: int) -> None:
    """Flips the lowest bit of element `at` through numpy: no version counter sees it."""
    _bits(t).reshape(-1)[at] ^= 1


def _fit(kw, edit, scaler=False, dtype=torch.float32):
    model = _model(dtype)
    opt = AdamW(model.parameters(), lr=1e-2, **kw)
    amp = torch.amp.GradScaler("cpu") if scaler else None
    g = torch.Generator().manual_seed(7)
    kept = redone = 0
    for i in range(3):
        loss = model(torch.randn(8, 32, generator=g).to(dtype)).float().square().mean()
        (amp.scale(loss) if amp else loss).backward()
        if opt._offload is not None and opt._offload.overlap is not None:
            opt._offload.overlap.wait()  # every chunk stepped ahead
        p = model[2].weight  # the middle of the largest parameter
        if i > 0 and edit:  # a gradient or a weight changed after the chunks were stepped
            _flip(p.grad if edit == "grad" else p, p.numel() // 2 + i)
        if amp:
            amp.step(opt)
            amp.update()
        else:
            opt.step()
        st = opt.last_step_stats
        if i > 0:  # the first step assumed no GradScaler scale
            kept += st.get("overlap_kept_chunks", 0)
            redone += st.get("overlap_redone_chunks", 0)
        model.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], kept, redone


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("edit,scaler,dtype", [
    ("grad", False, torch.float32),   # fingerprinted by the finite check
    ("grad", True, torch.float32),    # GradScaler checked them: fingerprinted on their own
    ("param", False, torch.float32),  # checked by the pass that publishes it
    ("param", True, torch.bfloat16),  # a bf16 weight: checked before the publish
])
def test_one_flipped_bit_redoes_exactly_its_chunk(tmp_path, tier, edit, scaler, dtype):
    ref, _, _ = _fit({}, edit, scaler, dtype)  # the in-memory optimizer follows the edit too
    kw = dict(offload=tier, overlap=True, chunk_bytes=1 << 16)
    if tier == "nvme":
        kw.update(nvme_path=str(tmp_path), cpu_budget=1 << 21)
    got, kept, redone = _fit(kw, edit, scaler, dtype)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert redone == 2 and kept > 10  # one chunk on each of the two edited steps


@pytest.mark.parametrize("clip,keeps", [(1e-3, False), (1e9, True)])
def test_gradscaler_fingerprints_taken_beside_the_norm(clip, keeps):
    """Under a GradScaler the gradients are fingerprinted while step() computes their norm; a
    clip that scales them drops those values (the chunks are redone), one that does not keeps
    the chunks. Either way the plain offloaded step's result."""
    kw = dict(offload="cpu", chunk_bytes=1 << 16, max_grad_norm=clip)
    ref, _, _ = _fit(kw, None, scaler=True)
    got, kept, redone = _fit(dict(kw, overlap=True), None, scaler=True)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert (kept > 10 and redone == 0) if keeps else (kept == 0 and redone > 10)


def _two_group_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])


def _groups(model, lr=1e-2):
    layers = list(model)
    return [{"params": [p for m in layers[:2] for p in m.parameters()], "lr": lr},
            {"params": [p for m in layers[2:] for p in m.parameters()], "lr": lr / 2}]


def _backward(model, seed):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def test_each_group_is_checked_once_per_step_not_per_gradient(monkeypatch):
    """The optimizer's group checks run on the thread that launches backward: once per group
    at its first gradient, not at each of the 16 hooks."""
    from tierlift.offload import overlap
    calls = []
    real = overlap.check_group
    monkeypatch.setattr(overlap, "check_group",
                        lambda opt, gi, *a: calls.append(gi) or real(opt, gi, *a))
    ref_model, model = _two_group_model(), _two_group_model()
    ref = AdamW(_groups(ref_model))
    opt = AdamW(_groups(model), offload="cpu", overlap=True, chunk_bytes=4096)
    for seed in range(3):
        for m, o in ((ref_model, ref), (model, opt)):
            _backward(m, seed)
            o.step()
            o.zero_grad(set_to_none=True)
        assert sorted(calls) == [0, 1], calls
        calls.clear()
    assert opt.last_step_stats["overlap_kept_chunks"] > 0
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()


def test_a_group_refused_at_its_first_gradient_is_left_to_step():
    """A group whose settings step() would refuse when backward starts is not stepped ahead;
    put right before step(), step() steps it itself, exactly."""
    ref_model, model = _two_group_model(), _two_group_model()
    ref = AdamW(_groups(ref_model))
    opt = AdamW(_groups(model), offload="cpu", overlap=True, chunk_bytes=4096)
    for m, o in ((ref_model, ref), (model, opt)):
        _backward(m, 0)
        o.step()
        o.zero_grad(set_to_none=True)
    opt.param_groups[1]["lr"] = -1.0  # refused by the optimizer's checks
    _backward(model, 1)
    opt.param_groups[1]["lr"] = ref.param_groups[1]["lr"]
    opt.step()
    st = opt.last_step_stats
    assert st["overlap_kept_chunks"] > 0  # group 0's
    chunks = [len(lay.chunks) for lay in opt._offload.layouts]
    assert st["overlap_kept_chunks"] + st.get("overlap_redone_chunks", 0) <= chunks[0]
    _backward(ref_model, 1)
    ref.step()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()
