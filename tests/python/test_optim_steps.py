"""tierlift::advance_steps_, the one call that advances a param group's step counts, against its
pure-torch reference (tierlift.reference.advance_steps_), and the optimizer's counts with it."""

import pytest
import torch

from tierlift import ops, reference
from tierlift.optim import AdamW

needs_op = pytest.mark.skipif(not ops._HAS_ADVANCE_STEPS,
                              reason="the compiled extension has no advance_steps_ op")


def _counts():
    """Every kind of count step() may meet: torch's 0-d fp32, a 1-element 1-D view, fp64 (an
    old checkpoint), large and fractional values, and one tensor listed twice."""
    shared = torch.tensor(7.0)
    return [torch.tensor(0.0), torch.tensor([41.0]), torch.tensor(3.0, dtype=torch.float64),
            torch.tensor(2.0**24 - 1), torch.tensor(2.5), shared, shared]


@needs_op
def test_advance_steps_matches_reference():
    ours, ref = _counts(), _counts()
    ref[-1] = ref[-2]
    versions = [t._version for t in ours]
    got = torch.ops.tierlift.advance_steps_(ours)
    want = reference.advance_steps_(ref)
    assert got == want == [1, 42, 4, 16777216, 3, 8, 9]
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # An in-place change for autograd and everything else that watches version counters.
    assert all(t._version > v for t, v in zip(ours, versions))


@pytest.mark.parametrize("bad", ["two_elements", "nan", "inf"])
@pytest.mark.parametrize("impl", ["op", "reference"])
def test_advance_steps_refuses_before_any_change(bad, impl):
    if impl == "op" and not ops._HAS_ADVANCE_STEPS:
        pytest.skip("the compiled extension has no advance_steps_ op")
    fn = torch.ops.tierlift.advance_steps_ if impl == "op" else reference.advance_steps_
    value = {"two_elements": torch.tensor([1.0, 2.0]), "nan": torch.tensor(float("nan")),
             "inf": torch.tensor(float("inf"))}[bad]
    first, last = torch.tensor(5.0), torch.tensor(6.0)
    with pytest.raises(ValueError):
        fn([first, value, last])
    assert first.item() == 5.0 and last.item() == 6.0


@needs_op
def test_advance_steps_opcheck():
    # Schema (the mutation is declared) and autograd registration only: the op cannot be traced
    # (next test); a compiled step uses adam_group_step_ (test_optim_compile.py).
    torch.library.opcheck(torch.ops.tierlift.advance_steps_.default,
                          ([torch.tensor(1.0), torch.tensor(5.0)],),
                          test_utils=("test_schema", "test_autograd_registration"))


@needs_op
def test_advance_steps_refuses_tracing_clearly():
    # torch.compile cannot functionalize integers returned by an op that mutates its inputs;
    # traced, the op once failed the compile with torch's unrelated "alias annotations" error.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        steps = [torch.empty(())]  # not a constant the mode would run the real op on
        with pytest.raises(RuntimeError, match="advance_steps_ cannot be traced"):
            torch.ops.tierlift.advance_steps_(steps)


def test_counts_follow_torch_with_skipped_params():
    # A parameter without a gradient keeps its count; the others advance (one fused call per
    # count), as in torch's AdamW.
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt, ref = AdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    for step in range(4):
        for k, (p, q) in enumerate(zip(ours, theirs)):
            g = torch.randn(5) if not (k == 1 and step % 2) else None
            p.grad, q.grad = g, (None if g is None else g.clone())
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        assert opt.state[p]["step"].item() == ref.state[q]["step"].item()
        assert opt.state[p]["step"].dtype == torch.float32
        torch.testing.assert_close(p.detach(), q.detach())
