"""A parameter that gets no gradient in a step (a branch not taken, a head unused this step) but
shares its unit's flat shard with parameters that did: torch leaves its .grad None and AdamW
skips it (no weight decay, no moment update, no step count). 2 gloo ranks at stages 1/2/3, with
torch's AdamW, Adam(amsgrad) and SGD and tierlift's AdamW over the shards, each against the same
torch optimizer in one process over the whole batch (DDP's gradient where ranks differ). Where
the optimizer's state is out of reach (tierlift's offloaded or compact state) a step that cannot
be exact is refused before anything changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_model import raised, spawn_ranks

import tierlift

STEPS = 3
OPT = dict(lr=1e-2, weight_decay=0.1)


class Two(nn.Module):
    """One unit: `fc` always used, `extra` only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.extra = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_extra: bool):
        y = torch.tanh(self.fc(x))
        return y + torch.tanh(self.extra(x)) if use_extra else y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.head = Two(), Two(), nn.Linear(8, 1)

    def forward(self, x, use: tuple[bool, bool]):
        return self.head(self.l2(self.l1(x, use[0]), use[1]))


def _make(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _data(steps: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 8, generator=g) for _ in range(steps)]


def _train(model, opt, xs, plan, world=1, rank=None) -> None:
    """plan[step][rank]: which Two's `extra` that rank's forward uses. rank=None: one process
    over every rank's slice, averaging their losses (DDP's gradient)."""
    for x, uses in zip(xs, plan, strict=True):
        opt.zero_grad()
        ranks = range(world) if rank is None else [rank]
        loss = sum(model(x.chunk(world)[r], uses[r]).pow(2).mean() for r in ranks)
        (loss / len(ranks)).backward()
        opt.step()


def _max_rel(sd: dict, ref: dict) -> float:
    return max(
        float((sd[k] - ref[k]).abs().max() / ref[k].abs().max().clamp(min=1e-6)) for k in ref
    )


U, N = (True, False), (False, False)  # l1.extra used / neither extra used
PLANS = {
    "never": [[U, U]] * STEPS,  # l2.extra: never a gradient
    "late": [[N, N]] + [[U, U]] * (STEPS - 1),  # l1.extra: first from the second step on
    "gap": [[U, U], [N, N], [U, U], [U, U]],  # l1.extra: state kept over a skipped step
    "one_rank": [[U, N]] * STEPS,  # l1.extra: only rank 0 uses it
    # l2.extra: only rank 0 uses it, which got every gradient (it sends ones, reads nothing)
    "all_on_one": [[(True, True), U]] * STEPS,
}
OPTIMIZERS = {
    "torch": (torch.optim.AdamW, torch.optim.AdamW, OPT),
    "tierlift": (tierlift.optim.AdamW, torch.optim.AdamW, OPT),
    "adam_amsgrad": (torch.optim.Adam, torch.optim.Adam, dict(OPT, amsgrad=True)),
    "sgd": (torch.optim.SGD, torch.optim.SGD, dict(OPT, lr=0.1, momentum=0.9)),
    "offload": (
        lambda ps, **kw: tierlift.optim.AdamW(ps, offload="cpu", **kw),
        torch.optim.AdamW,
        OPT,
    ),
    "compact": (lambda ps, **kw: tierlift.optim.AdamW(ps, state_dtype="bf16", **kw), None, OPT),
}
# (plan, optimizer, stages) compared with torch; torch's AdamW at every plan and stage.
RUNS = (
    [(plan, "torch", (1, 2, 3)) for plan in PLANS]
    + [
        (plan, opt, (1, 3))
        for plan in ("late", "gap")
        for opt in ("tierlift", "adam_amsgrad", "sgd")
    ]
    + [("never", "offload", (2,))]
)


def _run(stage, opt_name, plan, world, rank):
    cls, _, kw = OPTIMIZERS[opt_name]
    model = tierlift.zero.shard(_make(), stage=stage, units=["l1", "l2", "head"])
    _train(model, cls(model.parameters(), **kw), _data(len(plan)), plan, world, rank)
    return tierlift.zero.full_state_dict(model)


def _refused(opt_name: str, rank: int, world: int) -> tuple[str, bool]:
    """The "gap" plan: its second step (l1.extra, stepped by the first, skipped now) is refused
    before any weight or state changes."""
    cls, _, kw = OPTIMIZERS[opt_name]
    model = tierlift.zero.shard(_make(), stage=2, units=["l1", "l2", "head"])
    opt = cls(model.parameters(), **kw)
    plan = PLANS["gap"]
    _train(model, opt, _data(1), plan[:1], world, rank)
    opt.zero_grad()
    model(_data(2)[1].chunk(world)[rank], plan[1][rank]).pow(2).mean().backward()
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    weights = [p.detach().clone() for p in model.parameters()]
    msg = raised(opt.step)
    after = opt.state_dict()["state"][0]
    same = all(torch.equal(before[k], after[k]) for k in before) and all(
        torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True)
    )
    return msg, same


def _cases(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for plan_name, opt_name, stages in RUNS:
        _, ref_cls, kw = OPTIMIZERS[opt_name]
        plan = PLANS[plan_name]
        ref = _make()
        _train(ref, ref_cls(ref.parameters(), **kw), _data(len(plan)), plan, world)
        for stage in stages:
            out[f"{plan_name}/s{stage}/{opt_name}"] = _max_rel(
                _run(stage, opt_name, plan, world, rank), ref.state_dict()
            )
    # A compiled optimizer step (its hooks run outside the graph): the same numbers.
    plan = PLANS["gap"]
    ref = _make()
    _train(ref, torch.optim.AdamW(ref.parameters(), **OPT), _data(len(plan)), plan, world)
    model = tierlift.zero.shard(_make(), stage=2, units=["l1", "l2", "head"])
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    opt.step = torch.compile(opt.step, backend="eager")
    _train(model, opt, _data(len(plan)), plan, world, rank)
    out["compiled_step"] = _max_rel(tierlift.zero.full_state_dict(model), ref.state_dict())
    for name in ("offload", "compact"):
        out[f"refused/{name}"], out[f"refused/{name}/unchanged"] = _refused(name, rank, world)
    out["syncs"] = _syncs(rank, world)
    return out


def _syncs(rank: int, world: int) -> list:
    """What unused.py calls in each step (test_zero_unused_syncs.Calls): two with every
    parameter used on every rank, two of the "all_on_one" plan, then two where no rank uses
    either `extra` (two units hold a parameter without gradient)."""
    from test_zero_unused_syncs import Calls

    plan = [[(True, True)] * world] * 2 + PLANS["all_on_one"][:2] + [[N] * world] * 2
    model = tierlift.zero.shard(_make(), stage=2, units=["l1", "l2", "head"])
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    counts = []
    with pytest.MonkeyPatch.context() as mp:
        calls = Calls(mp)
        for x, uses in zip(_data(len(plan)), plan, strict=True):
            with calls:
                _train(model, opt, [x], [uses], world, rank)
            counts.append(dict(calls.counts))
    return counts


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_unused")))


@pytest.mark.parametrize(
    ("plan", "stage", "opt"), [(p, s, o) for p, o, stages in RUNS for s in stages]
)
def test_param_without_gradient_steps_as_torch(ranks, plan, stage, opt):
    for out in ranks:
        assert out[f"{plan}/s{stage}/{opt}"] < 1e-5


@pytest.mark.parametrize("name", ["offload", "compact"])
def test_state_out_of_reach_refused_before_step(ranks, name):
    for out in ranks:
        msg = out[f"refused/{name}"]
        assert msg.startswith("RuntimeError:") and "l1.extra.weight" in msg, msg
        assert "units=[" in msg and "moments would change" in msg, msg
        assert out[f"refused/{name}/unchanged"]


def test_no_device_reads_where_every_local_parameter_got_a_gradient(ranks):
    from test_zero_unused_syncs import METADATA, READS

    for rank, out in enumerate(ranks):
        for step, counts in enumerate(out["syncs"]):
            work = {k: n for k, n in counts.items() if k not in METADATA}
            if step >= 4:  # both units' flags read at once, then every step count at once
                assert work["tolist"] == 2 and "__float__" not in work, (rank, step, counts)
                assert sum(n for k, n in work.items() if k in READS) == 2, (rank, step, counts)
            elif step < 2 or rank == 0:  # every flag set here: ones made on the device, no read
                assert work == {"ones": 1}, (rank, step, counts)
            else:  # l2.extra unseen: its gradient checked on the device, the agreed flags read
                assert sum(n for k, n in work.items() if k in READS) == 1, (rank, step, counts)
                assert work["tolist"] == 1 and "ones" not in work, (rank, step, counts)


def test_compiled_step_steps_as_torch(ranks):
    for out in ranks:
        assert out["compiled_step"] < 1e-5
