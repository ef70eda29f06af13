"""The blockwise-quantized all-reduce (tierlift.zero.quant_comm) against its numpy reference.

Quantization is checked bit for bit and against its error bound in one process; the collective
runs on real gloo ranks: one spawn of 4 processes holds groups of 2, 3 and 4 ranks (process
start-up dominates on a 2-core machine), every rank writes what it got and the tests compare."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from zero_model import free_port, init_gloo, shutdown

from tierlift.reference.quant_comm import quantize_dequantize, quantized_all_reduce
from tierlift.zero.comm import Comm
from tierlift.zero.quant_comm import QuantizedAllReduce, dequantize_blocks, quantize_blocks

MODES = ("int8", "fp8")
SPAWN_WORLD = 4
WORLDS = (2, 3, 4)
NODES = {2: [0, 1], 3: [0, 1, 1], 4: [0, 0, 1, 1]}  # bytes are counted on both kinds of link


class Case(NamedTuple):
    mode: str
    block: int
    length: Callable[[int], int]  # of the world size; never a multiple of world * block
    bad: tuple | None = None  # (rank, index, value) put into that rank's input
    poll: bool = False  # wait with done() first
    spread: bool = True  # magnitudes 1e-40..1e6 (else all near 1: rank order changes bits)


CASES = {
    "int8": Case("int8", 256, lambda w: 8 * w * 256 + 300),
    "fp8-polled": Case("fp8", 256, lambda w: 2 * w * 256 + 5, poll=True),
    "int8-one-magnitude": Case("int8", 64, lambda w: 16 * w * 64 + 1, spread=False),
    "fp8-one-magnitude": Case("fp8", 64, lambda w: 16 * w * 64 + 63, spread=False),
    "int8-block64-nan": Case("int8", 64, lambda w: 3 * w * 64 + 33, bad=(1, 100, float("nan"))),
    "fp8-block32-inf": Case("fp8", 32, lambda w: 5 * w * 32 + 7, bad=(0, 5, float("inf")),
                            poll=True),
    "int8-shorter-than-a-chunk": Case("int8", 256, lambda w: 10),
}


def gradient_like(n: int, seed: int) -> torch.Tensor:
    """Gaussian values whose magnitude jumps between stretches of 64 (1e-40 to 1e6: subnormal
    fp32 included), with exact zeros and a zero stretch."""
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-40, 7, (-(-n // 64),), generator=gen).repeat_interleave(64)[:n]
    x = torch.randn(n, generator=gen) * torch.pow(10.0, exponents.double()).float()
    x[torch.rand(n, generator=gen) < 0.1] = 0.0
    x[n // 3:n // 3 + 70] = 0.0
    return x


def bits(x: torch.Tensor) -> torch.Tensor:
    """Compared as bits: NaN equals NaN (any payload: a GPU's arithmetic makes 0x7fffffff, a
    CPU's 0x7fc00000), -0.0 differs from +0.0."""
    x = x.cpu()
    x = torch.where(x.isnan(), torch.full_like(x, float("nan")), x)
    return x.contiguous().view(torch.int32)


# ---- quantize / dequantize ---------------------------------------------------------------


def _roundtrip(x, mode, block):
    codes, scales = quantize_blocks(x, mode, block)
    return dequantize_blocks(codes, scales, block)


def _magnitudes():
    gen = torch.Generator().manual_seed(7)
    for scale in (1e-44, 1e-39, 1e-30, 1e-3, 1.0, 3e3, 1e30):
        yield torch.randn(1024, generator=gen) * scale
    yield gradient_like(2048, seed=3)
    x = torch.randn(1024, generator=gen)
    x[::5] = 0.0
    x[256:512] = 0.0  # a whole block of zeros
    x[600] = 1e20  # one outlier flattens the rest of its block
    yield x


@pytest.mark.parametrize("block", [256, 32])
@pytest.mark.parametrize("mode", MODES)
def test_quantize_matches_reference_bitwise(mode, block):
    for x in _magnitudes():
        got = _roundtrip(x, mode, block)
        assert torch.equal(bits(got), bits(quantize_dequantize(x, mode, block)))


@pytest.mark.parametrize("mode", MODES)
def test_codes_and_scales(mode):
    x = torch.randn(1024)
    x[256:512] = 0.0
    codes, scales = quantize_blocks(x, mode)
    assert codes.dtype == (torch.int8 if mode == "int8" else torch.float8_e4m3fn)
    assert codes.shape == (1024,) and scales.shape == (4,) and scales.dtype == torch.float32
    qmax = 127.0 if mode == "int8" else 448.0
    assert torch.equal(scales[1], torch.tensor(0.0)) and not codes[256:512].float().any()
    amax = x.view(4, 256).abs().amax(dim=1)
    assert torch.equal(scales, amax / torch.full_like(amax, qmax))
    assert codes.float().abs().amax() == qmax  # the largest value of a block maps to qmax


def test_int8_rounds_half_to_even():
    # amax 127 makes the scale exactly 1, so x / scale is x and the ties are exact.
    x = torch.zeros(16)
    x[:10] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5])
    codes, scales = quantize_blocks(x, "int8", block=16)
    assert scales.item() == 1.0
    assert codes[:10].tolist() == [127, 0, 2, 2, 0, -2, -2, 4, 126, -126]
    assert torch.equal(bits(dequantize_blocks(codes, scales, 16)),
                       bits(quantize_dequantize(x, "int8", 16)))


def test_fp8_rounds_half_to_even():
    # amax 448: scale 1. Between 16 and 32 e4m3 steps by 2: 17 and 19 are ties (to 16 and 20,
    # the even mantissas); 449 would be NaN in e4m3 and saturates to 448 instead.
    x = torch.zeros(8)
    x[:6] = torch.tensor([448.0, 17.0, 19.0, -17.0, -19.0, 448.0])
    codes, scales = quantize_blocks(x, "fp8", block=8)
    assert scales.item() == 1.0
    assert codes[:6].float().tolist() == [448.0, 16.0, 20.0, -16.0, -20.0, 448.0]


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_block_reads_as_nan(mode):
    x = torch.randn(1024)
    x[10], x[700] = float("nan"), -float("inf")
    got = _roundtrip(x, mode, 256).view(4, 256)
    assert got[0].isnan().all() and got[2].isnan().all()
    assert got[1].isfinite().all() and got[3].isfinite().all()
    assert torch.equal(bits(got.reshape(-1)), bits(quantize_dequantize(x, mode, 256)))


def _normal_range_blocks(block):
    # Scales stay normal fp32 numbers (amax / 448 >= 2**-126): below that the scale itself
    # loses bits and no relative bound holds.
    gen = torch.Generator().manual_seed(11)
    rows = [torch.randn(block, generator=gen) * 10.0 ** e for e in range(-30, 31, 3)]
    rows.append(torch.rand(block, generator=gen) * 2 - 1)  # many values near the ties
    rows.append(torch.linspace(-1, 1, block))
    return torch.stack(rows)


def test_int8_error_within_half_a_step():
    # |code * scale - x| <= scale / 2 = amax / 254, up to a few fp32 roundings (x / scale,
    # amax / 127, code * scale: well under 2**-14 relative).
    blocks = _normal_range_blocks(256)
    got = _roundtrip(blocks.reshape(-1), "int8", 256).view_as(blocks)
    amax = blocks.abs().amax(dim=1)
    worst = (got - blocks).abs().amax(dim=1)
    assert (worst <= amax / 254 * (1 + 2**-14)).all(), (worst / amax).max()
    assert (worst > amax / 1000).all()  # the bound is tight, not vacuous


def test_fp8_error_within_half_an_e4m3_step():
    # e4m3 keeps 3 mantissa bits: a normal code is off by at most 1/16 of its value, a
    # subnormal one (below 2**-6) by at most half its spacing 2**-9; in units of x that is
    # max(|x| / 16, scale / 1024), with the same fp32 slack as int8.
    blocks = _normal_range_blocks(256)
    codes, scales = quantize_blocks(blocks.reshape(-1), "fp8")
    got = dequantize_blocks(codes, scales, 256).view_as(blocks)
    bound = torch.maximum(blocks.abs() / 16, scales[:, None] / 1024) * (1 + 2**-14)
    assert ((got - blocks).abs() <= bound).all()
    amax = blocks.abs().amax(dim=1)
    assert ((got - blocks).abs().amax(dim=1) <= amax / 16).all()


# ---- the collective on gloo ranks ---------------------------------------------------------


def _case_input(world, rank, name):
    case = CASES[name]
    seed = 1000 * world + 10 * rank + list(CASES).index(name)
    if case.spread:
        x = gradient_like(case.length(world), seed)
    else:
        x = torch.randn(case.length(world), generator=torch.Generator().manual_seed(seed))
    if case.bad is not None and case.bad[0] == rank:
        x[case.bad[1]] = case.bad[2]
    return x


def _run_case(comm, name):
    case = CASES[name]
    x = _case_input(comm.world, comm.rank, name)
    t = x.clone()
    before = comm.sent["intra_node"] + comm.sent["inter_node"]
    handle = QuantizedAllReduce(comm, case.mode, case.block).start(t)
    if case.poll:
        while not handle.done():
            time.sleep(1e-3)
        assert handle.done()
    result = handle.wait()
    sent = comm.sent["intra_node"] + comm.sent["inter_node"] - before
    fp32 = Comm(comm.group, NODES[comm.world])
    fp32.all_reduce(x.clone())
    return {"input": x, "output": t.clone(), "returned_t": result is t, "sent": sent,
            "fp32_sent": fp32.sent["intra_node"] + fp32.sent["inter_node"],
            "inter_node": comm.sent["inter_node"] > 0}


def _worker(rank, port, out_dir):
    init_gloo(rank, SPAWN_WORLD, port)
    groups = {w: dist.new_group(list(range(w))) for w in WORLDS}  # every rank must call it
    results = {}
    for world, group in groups.items():
        if rank < world:
            comm = Comm(group, NODES[world])
            results[world] = {name: _run_case(comm, name) for name in CASES}
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    shutdown()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("quant_comm")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=SPAWN_WORLD)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(SPAWN_WORLD)]


def _outcomes(ranks, world, name):
    return [ranks[r][world][name] for r in range(world)]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world", WORLDS)
def test_collective_matches_reference(ranks, world, name):
    mode, block, length = CASES[name][:3]
    outcomes = _outcomes(ranks, world, name)
    inputs = [o["input"] for o in outcomes]
    for rank, x in enumerate(inputs):  # the ranks ran on the inputs the test expects
        assert torch.equal(bits(x), bits(_case_input(world, rank, name)))
    expected = quantized_all_reduce(inputs, mode, block)
    assert expected.shape == (length(world),)
    for o in outcomes:
        assert o["returned_t"]
        assert torch.equal(bits(o["output"]), bits(expected))
    if CASES[name].bad is None:
        _assert_near_exact_sum(expected, inputs, mode, block)


def _assert_near_exact_sum(result, inputs, mode, block):
    # Each value is quantized twice: on its rank (error <= step * amax_i of its block) and
    # after the sum (<= step * amax of the summed block <= step * (1 + step) * sum_i amax_i).
    # The absolute slack covers blocks so tiny that their scale is a subnormal fp32.
    step = 1 / 254 if mode == "int8" else 1 / 16
    n = result.numel()
    padded = -(-n // block) * block
    stacked = torch.nn.functional.pad(torch.stack(inputs).double(), (0, padded - n))
    amax_sum = stacked.abs().view(len(inputs), -1, block).amax(dim=2).sum(0)
    bound = (amax_sum * step * (2 + step) * (1 + 2**-14)).repeat_interleave(block)[:n] + 1e-34
    assert ((result.double() - stacked.sum(0)[:n]).abs() <= bound).all()


@pytest.mark.parametrize("world", WORLDS)
def test_non_finite_on_one_rank_is_nan_on_all(ranks, world):
    for name in ("int8-block64-nan", "fp8-block32-inf"):
        block, index = CASES[name].block, CASES[name].bad[1]
        first = index // block * block
        for o in _outcomes(ranks, world, name):
            out = o["output"]
            assert out[first:first + block].isnan().all()
            assert out[:first].isfinite().all() and out[first + block:].isfinite().all()


@pytest.mark.parametrize("world", WORLDS)
def test_bytes_sent(ranks, world):
    block, length = CASES["int8"].block, CASES["int8"].length
    span = world * block
    chunk = -(-length(world) // span) * span // world
    # all-to-all and all-gather each send one chunk of codes and its scales to every peer.
    expected = 2 * (world - 1) * (chunk + chunk // block * 4)
    for o in _outcomes(ranks, world, "int8"):
        assert o["sent"] == expected
        assert o["fp32_sent"] == 2 * (world - 1) * -(-length(world) // world) * 4
        assert o["sent"] * 3 < o["fp32_sent"]
        assert o["inter_node"]


# ---- one process, bad arguments ----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_world_of_one_leaves_t_unchanged(mode):
    comm = Comm()
    t = gradient_like(1000, seed=5)
    before = t.clone()
    handle = QuantizedAllReduce(comm, mode).start(t)
    assert handle.done() and handle.wait() is t
    assert torch.equal(bits(t), bits(before))
    assert torch.equal(bits(quantized_all_reduce([before], mode)), bits(before))
    assert comm.sent == {"intra_node": 0, "inter_node": 0}


@pytest.mark.parametrize("bad, error", [
    (torch.arange(512, dtype=torch.int32), TypeError),
    (torch.zeros(512, dtype=torch.float64), TypeError),
    (torch.zeros(1024)[::2], ValueError),
    (torch.zeros(2, 256), ValueError),
    ([0.0] * 256, TypeError),
])
def test_bad_tensor(bad, error):
    with pytest.raises(error):
        QuantizedAllReduce(Comm(), "int8").start(bad)
    with pytest.raises(error):
        quantize_blocks(bad, "fp8")


@pytest.mark.parametrize("mode, block, error", [
    ("int4", 256, ValueError), ("INT8", 256, ValueError), ("int8", 0, ValueError),
    ("fp8", -4, ValueError), ("int8", 2.5, TypeError),
])
def test_bad_mode_or_block(mode, block, error):
    with pytest.raises(error):
        QuantizedAllReduce(Comm(), mode, block)
    with pytest.raises(error):
        quantize_blocks(torch.zeros(512), mode, block)


def test_length_not_a_multiple_of_block():
    with pytest.raises(ValueError, match="multiple of block"):
        quantize_blocks(torch.zeros(300), "int8", 256)
    codes, scales = quantize_blocks(torch.zeros(512), "int8", 256)
    with pytest.raises(ValueError):
        dequantize_blocks(codes, scales, 128)
    with pytest.raises(TypeError):
        dequantize_blocks(codes.float(), scales, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_cuda_quantizes_like_cpu(mode):
    x = gradient_like(1 << 16, seed=9)
    x[123] = float("nan")
    codes, scales = quantize_blocks(x.cuda(), mode)
    cpu_codes, cpu_scales = quantize_blocks(x, mode)
    assert torch.equal(codes.cpu().view(torch.uint8), cpu_codes.view(torch.uint8))
    assert torch.equal(bits(scales.cpu()), bits(cpu_scales))
    assert torch.equal(bits(dequantize_blocks(codes, scales, 256).cpu()),
                       bits(quantize_dequantize(x, mode)))
