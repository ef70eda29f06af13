"""Compact optimizer state (state_dtype="bf16") in the offload tiers: bit-identical to the
in-memory compact optimizer for every layout, state dicts converting to and from fp32 state,
checkpoints, and the bytes the compact kinds take on the drive. The fault paths are the
parametrised tests of test_offload.py and test_offload_hybrid.py."""

from __future__ import annotations

import os

import pytest
import torch
from test_offload import _grads, _params
from test_offload_hybrid import fit_overlapped

import tierlift
from tierlift.offload.layout import IO_ALIGN, SCALE_BLOCK
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def _layout(tmp_path, name: str) -> dict:
    nvme = dict(nvme_path=str(tmp_path), cpu_budget=200_000)
    hybrid = dict(nvme_path=str(tmp_path), cpu_budget=400_000)
    return {"cpu": dict(offload="cpu"),
            "nvme": dict(offload="nvme", **nvme),
            "nvme-1gen": dict(offload="nvme", nvme_generations=1, **nvme),
            "hybrid": dict(offload="hybrid", **hybrid),
            "hybrid-1gen": dict(offload="hybrid", nvme_generations=1, **hybrid)}[name]


LAYOUTS = ["cpu", "nvme", "nvme-1gen", "hybrid", "hybrid-1gen"]


def _train(params, opt, steps=4, first=0):
    for i in range(first, first + steps):
        _grads(params, i)
        opt.step()


def _opt(params, **kw):
    return AdamW(params, lr=1e-2, weight_decay=0.1, state_dtype="bf16", **kw)


def _assert_same(opt, ref_opt):
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, st in ref_sd["state"].items():
        assert st.keys() == sd["state"][i].keys()
        for k, v in st.items():
            assert v.dtype == sd["state"][i][k].dtype and torch.equal(v, sd["state"][i][k]), k


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bit_identical_to_in_memory_compact_state(tmp_path, layout, dtype, overlap):
    ref = _params(dtype)
    ref_opt = _opt(ref)
    _train(ref, ref_opt)
    params = _params(dtype)
    opt = _opt(params, overlap=overlap, **_layout(tmp_path, layout))
    _train(params, opt)
    for a, b in zip(ref, params):
        assert torch.equal(a, b)
    _assert_same(opt, ref_opt)
    st = opt.state_dict()["state"][3]
    assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq_codes"].dtype == torch.uint8
    assert "exp_avg_sq" not in st  # torch.optim.AdamW raises on it instead of misreading codes
    if layout != "cpu":
        assert len(opt._offload.layouts[0].chunks) > 2  # several chunks streamed


def test_overlap_with_backward_is_exact_and_kept(tmp_path):
    """All on NVMe, two generations (the hybrid layouts are in test_offload_hybrid)."""
    ref, _ = fit_overlapped("bf16", {})
    got, kept = fit_overlapped("bf16", dict(offload="nvme", nvme_path=str(tmp_path),
                                            cpu_budget=200_000, overlap=True))
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert kept > 0


@pytest.mark.parametrize("layout", ["cpu", "nvme", "hybrid-1gen"])
def test_state_dict_round_trip_and_conversion(tmp_path, layout):
    params = _params()
    opt = _opt(params, **_layout(tmp_path, layout))
    _train(params, opt, steps=2)
    # compact -> compact offloaded: exact, and both continue the same
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = _opt(twin, **_layout(tmp_path, layout))
    fresh.load_state_dict(opt.state_dict())
    _assert_same(fresh, opt)
    _train(params, opt, steps=2, first=2)
    _train(twin, fresh, steps=2, first=2)
    for a, b in zip(params, twin):
        assert torch.equal(a, b)
    # fp32 state (torch's AdamW) is quantized as the in-memory compact optimizer does it
    torch_params = _params()
    torch_opt = torch.optim.AdamW(torch_params, lr=1e-2, weight_decay=0.1)
    _train(torch_params, torch_opt, steps=2)
    mem = _opt([torch.nn.Parameter(p.detach().clone()) for p in torch_params])
    mem.load_state_dict(torch_opt.state_dict())
    off = _opt([torch.nn.Parameter(p.detach().clone()) for p in torch_params],
               **_layout(tmp_path, layout))
    off.load_state_dict(torch_opt.state_dict())
    _assert_same(off, mem)
    # compact -> an fp32-state offloaded optimizer: dequantized, as without offload
    f32_mem = AdamW(_params(), lr=1e-2, weight_decay=0.1)
    f32_mem.load_state_dict(opt.state_dict())
    f32_off = AdamW(_params(), lr=1e-2, weight_decay=0.1, **_layout(tmp_path, layout))
    f32_off.load_state_dict(opt.state_dict())
    _assert_same(f32_off, f32_mem)


@pytest.mark.parametrize("layout", ["cpu", "nvme", "hybrid"])
def test_checkpoint_round_trip_and_conversion(tmp_path, layout):
    (tmp_path / "state").mkdir()
    kw = _layout(tmp_path / "state", layout)
    params = _params(torch.bfloat16)
    opt = _opt(params, **kw)
    _train(params, opt, steps=2)
    tierlift.checkpoint.save(str(tmp_path / "ck"), torch.nn.ParameterList(params), opt)
    names = os.listdir(tmp_path / "ck" / "optim")
    assert {"g0.exp_avg.bf16", "g0.exp_avg_sq.u8", "g0.exp_avg_sq_scale.f32"} <= set(names)
    _train(params, opt, steps=2, first=2)
    fresh_params = _params(torch.bfloat16)
    fresh = _opt(fresh_params, **kw)
    tierlift.checkpoint.load(str(tmp_path / "ck"), torch.nn.ParameterList(fresh_params), fresh)
    _train(fresh_params, fresh, steps=2, first=2)
    for a, b in zip(params, fresh_params):
        assert torch.equal(a, b)
    _assert_same(fresh, opt)
    # into the in-memory compact optimizer, and into an fp32-state offloaded one (converted)
    mem_params = _params(torch.bfloat16)
    mem = _opt(mem_params)
    tierlift.checkpoint.load(str(tmp_path / "ck"), torch.nn.ParameterList(mem_params), mem)
    f32_params = _params(torch.bfloat16)
    f32 = AdamW(f32_params, lr=1e-2, weight_decay=0.1, **kw)
    tierlift.checkpoint.load(str(tmp_path / "ck"), torch.nn.ParameterList(f32_params), f32)
    f32_mem = AdamW(_params(torch.bfloat16), lr=1e-2, weight_decay=0.1)
    f32_mem.load_state_dict(mem.state_dict())
    _assert_same(f32, f32_mem)


@pytest.mark.parametrize("gens", [1, 2])
def test_disk_bytes_are_the_compact_layout(tmp_path, gens):
    n = 1 << 21
    params = [torch.nn.Parameter(torch.randn(n))]
    opt = _opt(params, offload="nvme", nvme_path=str(tmp_path), cpu_budget=24 << 20,
               nvme_generations=gens)
    off = opt._offload
    tier, n_chunks, chunk = off.tiers[0], len(off.layouts[0].chunks), off.chunk_elems
    assert n_chunks > 1

    def aligned(nbytes):
        return -(-nbytes // IO_ALIGN) * IO_ALIGN

    # every kind of every chunk 4 KiB aligned: master 4 B, m 2 B, v 1 B, a scale per 256;
    # one generation keeps no master of an fp32 host parameter (it is its own)
    master = aligned(4 * chunk) if gens == 2 else 0
    per_chunk = master + aligned(2 * chunk) + aligned(chunk) + aligned(4 * chunk // SCALE_BLOCK)
    assert tier.disk_bytes == gens * n_chunks * per_chunk
    allocated = sum(os.stat(os.path.join(r, f)).st_blocks * 512
                    for r, _, fs in os.walk(tmp_path) for f in fs if not f.endswith(".json"))
    assert allocated == tier.disk_bytes
    # 7.02 B/param per generation with the master (3.02 without; 12 and 8 with fp32 state),
    # plus chunk rounding
    per_param = 7.05 if gens == 2 else 3.05
    assert tier.disk_bytes / (gens * n) < per_param
    _grads(params, 0)
    opt.step()
    assert opt.last_step_stats["nvme_write_bytes"] / n < per_param
    opt.close()


def test_amsgrad_is_still_refused(tmp_path):
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW(_params(), amsgrad=True, state_dtype="bf16", offload="nvme",
              nvme_path=str(tmp_path), cpu_budget=200_000)
    opt = _opt(_params(), offload="cpu")
    opt.param_groups[0]["amsgrad"] = True
    _grads(opt.param_groups[0]["params"], 0)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
