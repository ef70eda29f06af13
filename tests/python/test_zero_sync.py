"""Host syncs in a ZeRO step: every value tierlift reads back from a tensor (tolist, item, bool,
float, int of a tensor, .cpu(), .to("cpu"), torch.equal) stalls the step on a GPU until the
device catches up. Counted on CPU, where those calls are the same, at the call sites in
tierlift's own files (torch's are checked on a GPU by test_zero_sync_step.py).

Here, 2 gloo ranks accumulating under no_sync(): where the synced backward reduces every unit
the leftover check reads nothing back (it used to read one small tensor per optimizer step),
nor where every rank summed the units the synced backward left (a branch only the micro-batches
inside no_sync() took); where some rank summed none of them it reads once. Training matches one
process over every rank's micro-batches."""

from __future__ import annotations

import collections
import contextlib
import os
import sys

import pytest
import torch
from torch import nn
from zero_model import spawn_ranks

import tierlift

# Reads of a tensor's value on the host: each a device sync for a GPU tensor.
READS = ("tolist", "item", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
PACKAGE = os.path.dirname(tierlift.__file__)
OPT = dict(lr=1e-2, weight_decay=0.1)
STEPS = 3


def _to_host(args, kwargs) -> bool:
    """.to("cpu") written out: a copy to the host wherever the tensor is (a torch.device
    argument is the model's own device in this code, a CPU one only on this machine)."""
    dev = kwargs.get("device", args[0] if args else None)
    return isinstance(dev, str) and dev.startswith("cpu")


class HostReads:
    """Counts, by "file:line function() name [device type]", the reads (READS, torch.equal,
    .to("cpu")) that tierlift's own code makes, in every thread (the backward's hooks included),
    while entered."""

    def __init__(self, monkeypatch) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.on = False
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        to = torch.Tensor.to
        monkeypatch.setattr(torch.Tensor, "to", self._wrap("to(cpu)", to, _to_host))
        monkeypatch.setattr(torch, "equal", self._wrap("torch.equal", torch.equal))

    def _wrap(self, name, fn, when=None):
        def counted(*args, **kwargs):
            if self.on:
                code = sys._getframe(1).f_code
                if code.co_filename.startswith(PACKAGE) and (
                        when is None or when(args[1:], kwargs)):
                    where = os.path.relpath(code.co_filename, PACKAGE)
                    dev = args[0].device.type if isinstance(args[0], torch.Tensor) else "?"
                    at = f"{where}:{sys._getframe(1).f_lineno} {code.co_name}()"
                    self.counts[f"{at} {name} [{dev}]"] += 1
            return fn(*args, **kwargs)

        return counted

    def __enter__(self):
        self.counts.clear()
        self.on = True
        return self

    def __exit__(self, *exc) -> None:
        self.on = False


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x, use_b):
        """use_b: True, False, or "drop" (b runs, its output is dropped: no gradient)."""
        h = torch.tanh(self.a(x))
        if use_b is True:
            h = h + torch.tanh(self.b(h))
        elif use_b == "drop":
            self.b(h)
        return self.c(h)


# Per plan, whether micro-batch 0 (inside no_sync()) and 1 (synced) use b, by rank (every rank
# runs the same units, whose gathers are collectives; "drop": b gets no gradient all the same).
PLANS = {
    "every_unit": lambda rank: (True, True),
    "b_in_no_sync": lambda rank: (True, False),
    "b_in_no_sync_on_rank0": lambda rank: (True if rank == 0 else "drop", False),
    "b_nowhere": lambda rank: (False, False),
}


def _data(world: int):
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(4, 8, generator=g) for _ in range(2)] for _ in range(STEPS * world)]


def _reference(plan: str, world: int) -> dict:
    """One process: every rank's micro-batches, each loss over the world (ZeRO's average)."""
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    data = _data(world)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world):
            for x, use_b in zip(data[step * world + rank], PLANS[plan](rank), strict=True):
                b = use_b is True  # a dropped output adds nothing
                (model(x, b).pow(2).mean() / 2 / world).backward()
        opt.step()
    return model.state_dict()


def _train(plan: str, stage: int, rank: int, world: int, reads: HostReads) -> tuple:
    torch.manual_seed(0)
    model = tierlift.zero.shard(Branchy(), stage=stage, units=["a", "b", "c"])
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    data, per_step = _data(world), []
    for step in range(STEPS):
        with reads if step else contextlib.nullcontext():  # the first step makes the state
            opt.zero_grad()
            for k, (x, use_b) in enumerate(zip(data[step * world + rank], PLANS[plan](rank),
                                               strict=True)):
                with model.no_sync() if k == 0 else contextlib.nullcontext():
                    (model(x, use_b).pow(2).mean() / 2).backward()
            opt.step()
        if step:
            per_step.append(dict(reads.counts))
    sd, ref = tierlift.zero.full_state_dict(model), _reference(plan, world)
    rel = max(float((sd[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)
    return per_step, rel


def _cases(rank: int, world: int, tmp: str) -> dict:
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        reads = HostReads(mp)
        for plan in PLANS:
            for stage in (1, 2, 3):
                out[f"{plan}/s{stage}"] = _train(plan, stage, rank, world, reads)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_sync")))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_sync_accumulation_reads_nothing_back_when_every_unit_reduced(ranks, stage):
    for rank, out in enumerate(ranks):
        per_step, rel = out[f"every_unit/s{stage}"]
        assert rel < 1e-5, (rank, rel)
        assert per_step == [{}] * (STEPS - 1), (rank, per_step)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unit_only_summed_in_no_sync_agreed_without_read(ranks, stage):
    # Every rank summed b: the agreement (a MAX of ones) needs no answer.
    for rank, out in enumerate(ranks):
        per_step, rel = out[f"b_in_no_sync/s{stage}"]
        assert rel < 1e-5, (rank, rel)
        assert per_step == [{}] * (STEPS - 1), (rank, per_step)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unit_summed_on_one_rank_reduced_there_read_on_the_other(ranks, stage):
    # Rank 0 summed b: sends ones, reads nothing. Rank 1 did not: reads the agreement, then
    # the per-parameter flags of b (unused.py: none of b's parameters got a gradient there).
    (per0, rel0), (per1, rel1) = (out[f"b_in_no_sync_on_rank0/s{stage}"] for out in ranks)
    assert rel0 < 1e-5 and rel1 < 1e-5, (rel0, rel1)
    assert per0 == [{}] * (STEPS - 1), per0
    for counts in per1:
        assert sorted(k.split(":")[0] for k in counts) == ["zero/hooks.py", "zero/unused.py"]
        assert all(n == 1 and k.endswith(" tolist [cpu]") for k, n in counts.items()), counts


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unit_summed_nowhere_agreed_with_one_read_and_not_stepped(ranks, stage):
    for rank, out in enumerate(ranks):
        per_step, rel = out[f"b_nowhere/s{stage}"]
        assert rel < 1e-5, (rank, rel)  # b keeps no gradient: no weight decay, as torch
        for counts in per_step:
            # The leftover sums' agreement, one read per optimizer step, and nothing else.
            assert sum(counts.values()) == 1, counts
            assert all(k.startswith("zero/hooks.py") and k.endswith(" tolist [cpu]")
                       for k in counts), counts
