"""Guard rails of tierlift.zero that must hold on every rank at once (2 gloo ranks):

- an edit inside a read-only tierlift.zero.gathered() block made on ONE rank raises the same
  error on every rank, and nothing is written back anywhere (the ranks still agree); an
  exception inside a block (read-only or not) on one rank raises on the others too, and
  nothing is written back;
- tied names given together load by torch's rule (the last in model order wins) through both
  load_full_state_dict and model.load_state_dict, sharded or not (frozen tied weights stay
  unsharded at stage 1);
- fully_shard / replicate / FSDP around an OUTER module holding a sharded model are refused
  and leave the outer module as it was (a second call is refused the same way).

One spawn runs every case; each rank writes what it saw and the tests check it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_model import batches, make_model, raised, spawn_ranks, train

import tierlift

BATCH = 8
OPT = dict(lr=3e-3, weight_decay=0.1)
READ_ONLY = {"s1": (1, {}), "s3": (3, {}), "s3-offload": (3, {"offload_params": "cpu"})}


# ---- read-only gathered(): an edit on one rank ----
def _data_edit_on_rank1(model, rank):
    with tierlift.zero.gathered(model.blocks[1]):
        if rank == 1:
            model.blocks[1].fc.weight.data[0, :3] = 7.0  # escapes the version counter


def _inplace_edit_on_rank0(model, rank):
    with tierlift.zero.gathered(model):
        if rank == 0:
            with torch.no_grad():
                model.tok.weight[3].fill_(0.25)  # the tied root unit


def _raise_on_rank0(model, rank):
    with tierlift.zero.gathered(model.blocks[0]):
        if rank == 0:
            raise KeyError("boom")


def _raise_in_writable(model, rank, who):
    with tierlift.zero.gathered(model, modifier_rank=0):
        with torch.no_grad():
            model.blocks[1].fc.weight.mul_(0.5)  # an edit every rank makes
        if rank == who:
            raise KeyError("boom")


def _read_only(rank, out):
    seq = batches(1, BATCH, seed=3)[0].chunk(2)[rank][:, :-1]
    for name, (stage, kw) in READ_ONLY.items():
        model = tierlift.zero.shard(make_model(), stage=stage, **kw)
        ref = tierlift.zero.shard(make_model(), stage=stage, **kw)
        before = tierlift.zero.full_state_dict(model)
        with torch.no_grad():
            logits = model(seq)
        out[f"ro_{name}_data"] = raised(lambda m=model: _data_edit_on_rank1(m, rank))
        out[f"ro_{name}_inplace"] = raised(lambda m=model: _inplace_edit_on_rank0(m, rank))
        out[f"ro_{name}_raised"] = raised(lambda m=model: _raise_on_rank0(m, rank))
        for who in (0, 1):  # the modifier rank, another rank
            out[f"rw_{name}_raised{who}"] = raised(
                lambda m=model, w=who: _raise_in_writable(m, rank, w))
        after = tierlift.zero.full_state_dict(model)
        with torch.no_grad():
            same_logits = torch.equal(model(seq), logits)
        out[f"ro_{name}_unchanged"] = same_logits and all(
            torch.equal(after[k], v) for k, v in before.items())
        # Still in step with the other rank: trains exactly as an untouched model.
        opt = tierlift.optim.AdamW(model.parameters(), **OPT)
        ref_opt = tierlift.optim.AdamW(ref.parameters(), **OPT)
        data = batches(2, BATCH, seed=4)
        out[f"ro_{name}_losses"] = (
            train(model, opt, data, accum=1, clip=None, world=2, rank=rank, zero=True),
            train(ref, ref_opt, data, accum=1, clip=None, world=2, rank=rank, zero=True))
        tierlift.zero.close(model)
        tierlift.zero.close(ref)


# ---- tied names ----
def tied_state_dict(head_first: bool) -> dict:
    """Full weights whose tied names disagree (head.weight = tok.weight + 1); head_first puts
    head.weight before tok.weight in the dict (model order is tok, then head)."""
    full = make_model(seed=5).state_dict()
    sd = dict(full, **{"head.weight": full["tok.weight"] + 1.0})
    if head_first:
        sd = {"head.weight": sd.pop("head.weight"), **sd}
    return sd


def make_frozen_tied() -> nn.Module:
    model = make_model()
    model.tok.weight.requires_grad_(False)  # tied: the head's weight too
    return model


def _tied(rank, out):
    for stage in (1, 3):
        for frozen in (False, True):
            build = make_frozen_tied if frozen else make_model
            for head_first in (False, True):
                key = f"tied_s{stage}_{'frozen' if frozen else 'trained'}_{int(head_first)}"
                sd = tied_state_dict(head_first)
                a = tierlift.zero.shard(build(), stage=stage)
                tierlift.zero.load_full_state_dict(a, dict(sd))
                b = tierlift.zero.shard(build(), stage=stage)
                b.load_state_dict(dict(sd))
                out[key] = (tierlift.zero.full_state_dict(a), tierlift.zero.full_state_dict(b))


# ---- FSDP around an outer module ----
def _marks(module: nn.Module) -> tuple:
    """What a distributed API may leave on a module: its __dict__ entries (the composable
    API's state and registry among them, with their contents), class, hooks and names."""
    entries = {}
    for k, v in module.__dict__.items():
        if isinstance(v, dict):
            entries[k] = (type(v).__name__, list(v.keys()))
        elif not isinstance(v, torch.Tensor):
            entries[k] = type(v).__name__
    hooks = tuple(len(getattr(module, h)) for h in (
        "_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
        "_state_dict_hooks", "_load_state_dict_pre_hooks"))
    return (type(module).__name__, entries, hooks,
            [n for n, _ in module.named_parameters()])


def _fsdp_outer(rank, out):
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    seq = batches(1, BATCH, seed=3)[0].chunk(2)[rank][:, :-1]
    after_shard = nn.Sequential(tierlift.zero.shard(make_model(), stage=3))
    before_shard = nn.Sequential(make_model())  # the outer module existed before shard()
    tierlift.zero.shard(before_shard[0], stage=3)
    inner = tierlift.zero.shard(make_model(), stage=3)
    fresh = tierlift.zero.shard(make_model(), stage=3)
    cpu = torch.device("cpu")
    apis = {"fully_shard": fully_shard, "fsdp1": lambda m: FSDP(m, device_id=cpu,
                                                                use_orig_params=True)}
    for case, outer in {"after": after_shard, "before": before_shard, "inner": inner}.items():
        marks = [_marks(m) for m in outer.modules()]
        for api, fn in apis.items():
            out[f"outer_{case}_{api}"] = [raised(lambda o=outer, f=fn: f(o)) for _ in range(2)]
        out[f"outer_{case}_unchanged"] = marks == [_marks(m) for m in outer.modules()]
        with torch.no_grad():
            out[f"outer_{case}_forward"] = torch.equal(outer(seq), fresh(seq))
    # Composable replicate() on the sharded model is refused at once; on an outer module torch
    # looks at no submodule until the first forward, which raises before DDP's broadcast.
    marks = [_marks(m) for m in inner.modules()]
    out["replicate_inner"] = [raised(lambda: replicate(inner)) for _ in range(2)]
    out["replicate_inner_unchanged"] = [_marks(m) for m in inner.modules()] == marks
    outer = nn.Sequential(inner)
    out["replicate_outer"] = raised(lambda: replicate(outer))
    out["replicate_outer_forward"] = raised(lambda: outer(seq))
    with torch.no_grad():
        out["replicate_inner_forward"] = torch.equal(inner(seq), fresh(seq))
    # The outer module takes fully_shard once the sharded model is out of it.
    plain = nn.Sequential(nn.Linear(4, 4))
    out["outer_plain"] = raised(lambda: fully_shard(plain))


def _cases(rank, world, tmp):
    out = {}
    _read_only(rank, out)
    _tied(rank, out)
    _fsdp_outer(rank, out)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_guards_ranks")))


@pytest.mark.parametrize("name", list(READ_ONLY))
def test_read_only_edit_on_one_rank_raises_on_every_rank(ranks, name):
    r0, r1 = ranks
    for out in ranks:
        for case in ("data", "inplace"):
            msg = out[f"ro_{name}_{case}"]
            assert msg.startswith("RuntimeError: ") and "without modifier_rank" in msg, msg
            assert "nothing was written back" in msg and "modifier_rank=<the rank" in msg
        assert out[f"ro_{name}_unchanged"]
        mine, ref = out[f"ro_{name}_losses"]
        assert mine == ref  # nothing written back: trains exactly as an untouched model
    # The rank that edited says so; the other names it and the unit.
    unit = "'blocks.1' ('blocks.1.ln1.weight'...) was edited on"
    assert f"{unit} this rank" in r1[f"ro_{name}_data"]
    assert f"{unit} rank 1 " in r0[f"ro_{name}_data"]
    assert "was edited on this rank" in r0[f"ro_{name}_inplace"]
    assert "was edited on rank 0 " in r1[f"ro_{name}_inplace"]
    # An exception on one rank inside the block: its own there, the others are told.
    assert r0[f"ro_{name}_raised"] == "KeyError: 'boom'"
    assert r1[f"ro_{name}_raised"].startswith(
        "RuntimeError: rank 0 raised inside a tierlift.zero.gathered() block"), r1
    for who in (0, 1):  # with modifier_rank=0 too: nothing written back (unchanged above)
        assert ranks[who][f"rw_{name}_raised{who}"] == "KeyError: 'boom'"
        assert ranks[1 - who][f"rw_{name}_raised{who}"].startswith(
            f"RuntimeError: rank {who} raised inside a tierlift.zero.gathered() block")
    assert r0[f"ro_{name}_losses"] == r1[f"ro_{name}_losses"]


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("head_first", [False, True])
def test_tied_names_load_as_torch_loads_them(ranks, stage, frozen, head_first):
    sd = tied_state_dict(head_first)
    ref = make_frozen_tied() if frozen else make_model()
    ref.load_state_dict(dict(sd))
    want = ref.state_dict()
    assert torch.equal(want["tok.weight"], sd["head.weight"])  # torch: the last in model order
    key = f"tied_s{stage}_{'frozen' if frozen else 'trained'}_{int(head_first)}"
    for out in ranks:
        full, through_load_state_dict = out[key]
        for k, v in want.items():
            assert torch.equal(full[k], v), k
            assert torch.equal(through_load_state_dict[k], v), k


@pytest.mark.parametrize("case", ["after", "before", "inner"])
def test_fsdp_on_an_outer_module_leaves_it_unchanged(ranks, case):
    for out in ranks:
        for api in ("fully_shard", "fsdp1"):
            for msg in out[f"outer_{case}_{api}"]:  # the second call is refused the same way
                assert msg.startswith("RuntimeError: torch FSDP (FullyShardedDataParallel"), \
                    (api, msg)
                assert "tierlift.zero.shard" in msg
        assert out[f"outer_{case}_unchanged"]
        assert out[f"outer_{case}_forward"]
        assert out["outer_plain"] == "<no error>"


def test_replicate_refused_before_any_broadcast(ranks):
    for out in ranks:
        for msg in out["replicate_inner"]:
            assert msg.startswith("RuntimeError: torch FSDP (FullyShardedDataParallel"), msg
        assert out["replicate_inner_unchanged"] and out["replicate_inner_forward"]
        assert out["replicate_outer"] == "<no error>"  # torch does not look inside yet
        assert out["replicate_outer_forward"].startswith(
            "RuntimeError: torch FSDP (FullyShardedDataParallel"), out["replicate_outer_forward"]
