"""Delayed scaling's amax all-reduce pairs each rank's k-th reduction with the others' k-th: when
the ranks ran different delayed layers' backwards (experts routed per rank), the reduction would
mix unrelated layers' amaxes. Each reduction carries its layer's tag; a mismatch is refused at
the next forward (and save) with the histories unchanged, until a load, also when the queue had
dropped that reduction unwritten. reduce_amax=False trains such routing. Two gloo ranks, one
spawn."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from tierlift.lowp import RECIPES, Float8Linear, delayed
from tierlift.reference import lowp as ref

DELAYED = RECIPES["fp8-tensorwise-delayed"]
LOCAL = dataclasses.replace(DELAYED, name="local", reduce_amax=False)


def _experts(recipe):
    torch.manual_seed(0)
    return nn.ModuleList(Float8Linear(16, 16, bias=False, recipe=recipe) for _ in range(2))


def _buffers(layer):  # read directly: state_dict() would flush (and raise) first
    return {w: layer._buffers[delayed.buffer_name(w)].clone() for w in delayed.HISTORIES}


def _step(layer, x):
    layer(x).square().sum().backward()


def test_layers_are_numbered_in_construction_order_and_copies_keep_theirs():
    a, b = (Float8Linear(16, 16, recipe=DELAYED) for _ in range(2))
    na, nb = delayed.pending(a).number, delayed.pending(b).number
    assert nb == na + 1
    assert delayed.pending(copy.deepcopy(a)).number == na
    assert delayed.tag_of(nb, "g") == 2 * nb + 1
    assert delayed.describe_tag(2 * nb + 1) == f"delayed layer #{nb}'s g"
    assert delayed.pending(Float8Linear(16, 16, recipe=LOCAL)).number > nb


class _Done:  # a finished reduction's Work
    def wait(self):
        return True


def test_a_mispaired_reduction_dropped_from_a_full_queue_still_refuses():
    # A held graph keeps the queue at the history's length: its oldest reduction is dropped
    # unwritten, but it was paired with another layer's, so the layer is refused until a load.
    short = dataclasses.replace(DELAYED, name="short", amax_history_len=1)
    layer = Float8Linear(16, 16, recipe=short)
    queue = delayed.pending(layer)
    own = delayed.tag_of(queue.number, "x")
    queue.items.append(("x", torch.tensor([2.0, own + 2.0, -own]), _Done()))  # reduced as MAX
    queue.push("x", torch.tensor([1.0]), False, 1)
    assert len(queue.items) == 1 and queue.refused is not None
    before = _buffers(layer)
    paired = f"reduced with delayed layer #{queue.number + 1}'s x"
    for call in (lambda: layer(torch.randn(4, 16)), layer.state_dict,
                 lambda: copy.deepcopy(layer)):
        with pytest.raises(RuntimeError, match=paired):
            call()
    assert all(torch.equal(before[w], _buffers(layer)[w]) for w in delayed.HISTORIES)
    layer.load_state_dict(Float8Linear(16, 16, recipe=short).state_dict())
    layer(torch.randn(4, 16))
    assert queue.refused is None


def _routed(rank, world, recipe, steps):
    """A dense step (both experts on every rank), then `steps` steps where each rank runs its own
    expert only (MoE routing). Returns the experts, the inputs this rank's expert saw in the
    routed steps, and its histories as they were after their first forward."""
    experts = _experts(recipe)
    gen = torch.Generator().manual_seed(1)
    for e in experts:
        _step(e, torch.randn(8 * world, 16, generator=gen).chunk(world)[rank])
    seen = []
    before = None
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen) * (1 + rank)
        y = experts[rank](x)
        if before is None:  # the dense step's amaxes have entered
            before = _buffers(experts[rank])
        y.square().sum().backward()
        seen.append(x)
    return experts, seen, before


def _dist_cases(rank, world, tmp):
    import torch.distributed as dist

    out = {}
    calls = []
    real = dist.all_reduce

    def recording(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((tuple(tensor.shape), tensor.dtype))
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = recording
    try:
        experts, _, before = _routed(rank, world, DELAYED, steps=1)
    finally:
        dist.all_reduce = real
    out["calls"] = calls
    out["before"] = before
    refusals = {}
    for i, e in enumerate(experts):  # the next forward of each expert, then a save of it
        for what, call in (("forward", lambda e=e: e(torch.randn(8, 16))),
                           ("state_dict", e.state_dict)):
            try:
                call()
            except RuntimeError as err:
                refusals[(i, what)] = str(err)
    out["refusals"] = refusals
    out["after"] = _buffers(experts[rank])
    out["numbers"] = [delayed.pending(e).number for e in experts]
    # a load clears the refusal: the experts train densely again, the same on both ranks
    fresh = _experts(DELAYED)
    for e, f in zip(experts, fresh, strict=True):
        e.load_state_dict(f.state_dict())
        for c in (1.0, 2.0):
            _step(e, torch.randn(8, 16) * c * (1 + rank))
    out["reloaded"] = [{k: v.clone() for k, v in e.state_dict().items()} for e in experts]

    local, seen, _ = _routed(rank, world, LOCAL, steps=3)
    out["local"] = local[rank].state_dict()["fp8_amax_history_x"]
    out["local_want"] = torch.stack([ref.block_amax(x, "tensor").reshape(()) for x in seen[::-1]])
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from zero_model import spawn_ranks

    return spawn_ranks(_dist_cases, str(tmp_path_factory.mktemp("lowp_pairing")))


def test_routed_experts_are_refused_before_their_histories_change(ranks):
    for rank, out in enumerate(ranks):
        own, other = out["numbers"][rank], out["numbers"][1 - rank]
        # rank r ran expert r's backward only: expert r's forward and save are refused, the
        # other expert (nothing queued on this rank) is not
        assert set(out["refusals"]) == {(rank, "forward"), (rank, "state_dict")}, out["refusals"]
        msg = out["refusals"][(rank, "forward")]
        assert f"on rank {rank}, delayed layer #{own}'s g amax" in msg
        assert f"reduced with delayed layer #{other}'s g amax from another rank" in msg
        assert "reduce_amax=False" in msg and "Nothing entered" in msg
        assert all(torch.equal(out["before"][w], out["after"][w]) for w in delayed.HISTORIES)
        assert all((out["after"][w] > 0).sum() == 1 for w in delayed.HISTORIES)  # dense step
    assert ranks[0]["numbers"] == ranks[1]["numbers"]


def test_a_load_clears_the_refusal(ranks):
    a, b = (out["reloaded"] for out in ranks)
    for ea, eb in zip(a, b, strict=True):
        assert all(torch.equal(ea[k], eb[k]) for k in ea)
        assert all((ea[f"fp8_amax_history_{w}"] > 0).sum() == 2 for w in delayed.HISTORIES)


def test_reductions_carry_their_tags_in_twelve_bytes(ranks):
    # the routed step: g's and x's reductions of one expert, after the dense step's four
    for out in ranks:
        assert out["calls"] == [((3,), torch.float32)] * 6


def test_per_rank_experts_train_without_reduction(ranks):
    for out in ranks:
        assert torch.equal(out["local"][:3], out["local_want"])
