"""tierlift::flatten_pack_ / unflatten_ against the pure-torch reference, opcheck, bad input."""

import pytest
import torch

from tierlift import _extension, ops, reference

pytestmark = pytest.mark.skipif(not _extension.available(), reason="extension not built")

SHAPES = [[(3,)], [(7,), (2, 5), (1,)], [(33, 65), (4099,), (1,), (0,)], [(1 << 17,), (9, 1000)]]


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pad", [0, 1, 5])
def test_pack_unpack_matches_reference(shapes, dtype, pad):
    tensors = [torch.randn(s).to(dtype) for s in shapes]
    n = sum(t.numel() for t in tensors) + pad
    flat = torch.full((n,), float("nan"), dtype=dtype)
    expected = torch.full((n,), float("nan"), dtype=dtype)
    ops.flatten_pack_(flat, tensors)
    reference.flatten_pack_(expected, tensors)
    assert torch.equal(flat, expected)
    assert torch.equal(flat[n - pad:], torch.zeros(pad, dtype=dtype))
    outs = [torch.empty(s, dtype=dtype) for s in shapes]
    ops.unflatten_(flat, outs)
    for t, o in zip(tensors, outs, strict=False):
        assert torch.equal(t, o)


def test_pack_noncontiguous_source():
    t = torch.randn(6, 4).t()
    flat = torch.empty(24)
    ops.flatten_pack_(flat, [t])
    assert torch.equal(flat, t.reshape(-1))


def test_opcheck():
    flat = torch.empty(40)
    tensors = [torch.randn(3, 4), torch.randn(25)]
    torch.library.opcheck(torch.ops.tierlift.flatten_pack_.default, (flat, tensors))
    outs = [torch.empty(3, 4), torch.empty(25)]
    torch.library.opcheck(torch.ops.tierlift.unflatten_.default, (torch.randn(40), outs))


@pytest.mark.parametrize("fn", [ops.flatten_pack_, reference.flatten_pack_])
def test_bad_input(fn):
    with pytest.raises(ValueError, match="flat"):
        fn(torch.empty(4), [torch.randn(5)])
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        fn(torch.empty(10), [torch.randn(2), torch.randn(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="1-D"):
        fn(torch.empty(2, 5), [torch.randn(2)])


def test_unflatten_needs_contiguous_outputs():
    with pytest.raises(ValueError, match=r"tensors\[0\]"):
        ops.unflatten_(torch.randn(24), [torch.empty(4, 6).t()])


@pytest.mark.gpu
def test_cuda_matches_cpu():
    tensors = [torch.randn(s) for s in [(7,), (33, 65), (1,)]]
    n = sum(t.numel() for t in tensors) + 3
    cpu = torch.empty(n)
    ops.flatten_pack_(cpu, tensors)
    gpu = torch.full((n,), float("nan"), device="cuda")
    ops.flatten_pack_(gpu, [t.cuda() for t in tensors])
    assert torch.equal(gpu.cpu(), cpu)
    outs = [torch.empty_like(t, device="cuda") for t in tensors]
    ops.unflatten_(gpu, outs)
    for t, o in zip(tensors, outs, strict=False):
        assert torch.equal(o.cpu(), t)
