"""Guard rails of tierlift.zero on 2 gloo ranks: DDP, FSDP1 and FSDP2 around a sharded model are
refused before they change anything, shard tensors of another rank or world size never load,
full weights load exactly through model.load_state_dict (with torch's missing and unexpected
keys of the unsharded model), freed stage-3 weights raise instead of crashing, gathered()
reads and writes back (then training matches one process given the same edit) and refuses
edits of a read-only block (through `.data` too), clipping with max_norm=inf only measures,
and num_parameters counts the full model.

One spawn runs every case (process start-up dominates on a 2-core machine); each rank writes
what it saw and the tests check it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zero_model import batches, make_model, spawn_ranks, train

import tierlift

STEPS, BATCH = 4, 8
OPT = dict(lr=3e-3, weight_decay=0.1)
GATHER_CONFIGS = {"s1": (1, {}), "s2": (2, {}), "s3": (3, {}),
                  "s3-offload": (3, {"offload_params": "cpu"}),
                  "s3-nvme": (3, {"offload_params": "nvme"})}


def _edit(model, rank: int) -> None:
    """The edit under test: rank 0's is the one kept (modifier_rank=0); rank 1's differs."""
    with torch.no_grad():
        if rank == 0:
            model.tok.weight[3].fill_(0.25)          # tied with the head: root unit
            model.blocks[1].fc.weight.mul_(0.5)      # a block unit
        else:
            model.tok.weight.zero_()                 # discarded


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _raises(fn, exc=RuntimeError) -> str:
    try:
        fn()
    except exc as e:
        return str(e)
    return "<no error>"


def _ddp(rank, out):
    model = tierlift.zero.shard(make_model(), stage=3)
    before = _flat(model)
    out["ddp"] = _raises(lambda: nn.parallel.DistributedDataParallel(model))
    out["ddp_wrapped"] = _raises(
        lambda: nn.parallel.DistributedDataParallel(nn.Sequential(model)))
    out["ddp_unchanged"] = torch.equal(before, _flat(model))
    s1 = tierlift.zero.shard(make_model(), stage=1)
    before = _flat(s1)
    out["ddp_s1"] = _raises(lambda: nn.parallel.DistributedDataParallel(s1))
    out["ddp_s1_unchanged"] = torch.equal(before, _flat(s1))
    # An unsharded model still wraps (the hook leaves everything else alone).
    nn.parallel.DistributedDataParallel(make_model())
    out["ddp_plain_ok"] = True


def _fsdp(rank, out):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    seq = batches(1, BATCH, seed=3)[0].chunk(2)[rank][:, :-1]
    model = tierlift.zero.shard(make_model(), stage=3)
    before, names = _flat(model), [n for n, _ in model.named_parameters()]
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    cpu = torch.device("cpu")
    wraps = {
        "fsdp1": lambda: FSDP(model, device_id=cpu),
        "fsdp1_orig": lambda: FSDP(model, device_id=cpu, use_orig_params=True),
        "fsdp1_auto": lambda: FSDP(model, device_id=cpu, use_orig_params=True,
                                   auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])})),
        "fsdp1_outer": lambda: FSDP(nn.Sequential(model), device_id=cpu, use_orig_params=True),
        "fsdp2": lambda: fully_shard(model),
        "fsdp2_block": lambda: fully_shard(model.blocks[0]),
        "fsdp2_outer": lambda: fully_shard(nn.Sequential(model)),
        "dcp_state_dict": lambda: get_model_state_dict(model),
    }
    for key, fn in wraps.items():
        out[key] = _raises(fn)
    out["fsdp_unchanged"] = (torch.equal(before, _flat(model))
                             and names == [n for n, _ in model.named_parameters()]
                             and hooks == sum(len(m._forward_pre_hooks) for m in model.modules()))
    fresh = tierlift.zero.shard(make_model(), stage=3)
    with torch.no_grad():
        out["fsdp_forward_same"] = torch.equal(model(seq), fresh(seq))
    # An unsharded model still takes FSDP2 (the registry answers only for sharded modules).
    fully_shard(nn.Linear(4, 4))
    out["fsdp2_plain_ok"] = True


def _state_dicts(rank, world, tmp, out):
    model = tierlift.zero.shard(make_model(), stage=3)
    own = model.state_dict()
    torch.save(own, os.path.join(tmp, f"sd{rank}.pt"))
    dist.barrier()
    before = _flat(model)
    # Every rank loads rank 0's shards (torch.save keeps the record of whose they are).
    sd0 = torch.load(os.path.join(tmp, "sd0.pt"), weights_only=True)
    out["load_rank0"] = _raises(lambda: model.load_state_dict(sd0, strict=False))
    out["load_rank0_unchanged"] = torch.equal(before, _flat(model))
    # Its own shards load back.
    mine = torch.load(os.path.join(tmp, f"sd{rank}.pt"), weights_only=True)
    out["load_own"] = _raises(lambda: model.load_state_dict(mine))
    # A rebuilt dict (as safetensors would give) has no record: refused on every rank.
    out["load_plain_dict"] = _raises(
        lambda: model.load_state_dict({k: v.clone() for k, v in own.items()}, strict=False))
    # Shards of a world-size-1 sharding of the same model.
    groups = [dist.new_group([r]) for r in range(world)]
    solo = tierlift.zero.shard(make_model(), stage=3, process_group=groups[rank])
    out["load_world1"] = _raises(lambda: model.load_state_dict(solo.state_dict(), strict=False))
    # Through a unit module on its own.
    block = model.blocks[0].state_dict()
    torch.save(block, os.path.join(tmp, f"block{rank}.pt"))
    dist.barrier()
    other = torch.load(os.path.join(tmp, f"block{1 - rank}.pt"), weights_only=True)
    out["load_block_other"] = _raises(lambda: model.blocks[0].load_state_dict(other))
    out["refusals_unchanged"] = torch.equal(before, _flat(model))
    # Full weights: each rank takes its slice, exactly as load_full_state_dict.
    full = make_model(seed=5).state_dict()
    # (A copy: torch records assign=True in the dict's own _metadata.)
    out["assign"] = _raises(lambda: model.load_state_dict(dict(full), assign=True))
    mixed = dict(full, **{"blocks.0._zero_flat_shard": own["blocks.0._zero_flat_shard"]})
    out["mixed"] = _raises(lambda: model.load_state_dict(mixed, strict=False))
    out["full_refusals_unchanged"] = torch.equal(before, _flat(model))
    out["load_full"] = str(model.load_state_dict(full))
    out["full_after"] = tierlift.zero.full_state_dict(model)
    # Only some units given (strict=False): those load, the others stay.
    only = {k: v for k, v in make_model(seed=6).state_dict().items() if k.startswith("blocks.2.")}
    res = model.load_state_dict(only, strict=False)
    out["only_missing"] = res.missing_keys
    out["only_after"] = tierlift.zero.full_state_dict(model)


def _mismatched(full: dict) -> dict:
    """State dicts of full weights whose keys do not match the model's (strict=False loads)."""
    tied = dict(full, **{"head.weight": full["head.weight"] + 1.0})  # torch: the last one wins
    return {
        "unit_absent": dict({k: v for k, v in full.items() if not k.startswith("blocks.1.")},
                            **{"extra.zzz": torch.zeros(1)}),
        "unit_partial": {k: v for k, v in full.items() if k != "blocks.1.fc.weight"},
        "tied_one_name": {k: v for k, v in tied.items() if k != "tok.weight"},
        "tied_both": tied,
        "prefixed": {"model." + k: v for k, v in full.items()},
        "empty": {},
    }


def _key_reports(rank, out):
    """Each mismatched full state dict into a fresh sharded model: what load_state_dict reports
    (strict=False), the weights it leaves, and strict=True's error."""
    full = make_model(seed=5).state_dict()
    for name, (stage, kw) in {"s1": (1, {}), "s3": (3, {}),
                              "s3-offload": (3, {"offload_params": "cpu"})}.items():
        for case, sd in _mismatched(full).items():
            model = tierlift.zero.shard(make_model(), stage=stage, **kw)
            res = model.load_state_dict(dict(sd), strict=False)
            out[f"keys_{name}_{case}"] = (res.missing_keys, res.unexpected_keys,
                                          tierlift.zero.full_state_dict(model))
            strict = tierlift.zero.shard(make_model(), stage=stage, **kw)
            out[f"strict_{name}_{case}"] = _raises(lambda m=strict, sd=sd: m.load_state_dict(sd))
        # A unit module loaded on its own, given part of its weights.
        model = tierlift.zero.shard(make_model(), stage=stage, **kw)
        block = {k[len("blocks.1."):]: v for k, v in full.items()
                 if k.startswith("blocks.1.") and k != "blocks.1.fc.weight"}
        res = model.blocks[1].load_state_dict(block, strict=False)
        out[f"keys_{name}_block"] = (res.missing_keys, res.unexpected_keys,
                                     tierlift.zero.full_state_dict(model))


def _freed(rank, out):
    model = tierlift.zero.shard(make_model(), stage=3)
    seq = batches(1, BATCH, seed=3)[0].chunk(2)[rank]
    model(seq[:, :-1]).float().pow(2).mean().backward()
    w = model.blocks[0].qkv.weight
    out["freed_shape"] = tuple(w.shape)
    out["freed_sum"] = _raises(lambda: w.sum(), tierlift.zero.NotGatheredError)
    out["freed_index"] = _raises(lambda: model.tok.weight[:2].clone(),
                                 tierlift.zero.NotGatheredError)
    before = _flat(model)
    out["replace_embedding"] = _raises(lambda: setattr(model, "tok", nn.Embedding(70, 20)))
    out["add_trainable"] = _raises(lambda: setattr(model, "extra", nn.Linear(2, 2)))
    out["swap_unchanged"] = torch.equal(before, _flat(model)) and isinstance(
        model.tok, nn.Embedding) and model.tok.num_embeddings == 61
    model.frozen_extra = nn.Linear(2, 2).requires_grad_(False)  # frozen: replicated, allowed
    # Inside gathered(): `.data` of another shape (as resize_token_embeddings assigns) is refused
    # on every rank; of the same shape it is an edit; a forward is refused.
    before = _flat(model)
    out["resize_in_block"] = _raises(lambda: _resize_in_block(model, rank))
    out["resize_unchanged"] = torch.equal(before, _flat(model))
    with tierlift.zero.gathered(model.blocks[0], modifier_rank=0):
        if rank == 0:
            model.blocks[0].proj.bias.data = torch.full((20,), 0.5)
    out["data_edit"] = tierlift.zero.full_state_dict(model)["blocks.0.proj.bias"]
    out["forward_in_block"] = _raises(lambda: _forward_in_block(model, seq))
    # Still trains after all this.
    model(seq[:, :-1]).float().pow(2).mean().backward()
    out["freed_after_forward"] = type(model.blocks[0].qkv.weight).__name__


def _resize_in_block(model, rank):
    with tierlift.zero.gathered(model, modifier_rank=0):
        if rank == 0:
            model.tok.weight.data = torch.zeros(70, 20)


def _forward_in_block(model, seq):
    with tierlift.zero.gathered(model):
        model(seq[:, :-1])


def _gathered(rank, tmp, out):
    full_ref = {}
    for name, (stage, kw) in GATHER_CONFIGS.items():
        if kw.get("offload_params") == "nvme":
            kw = dict(kw, nvme_path=os.path.join(tmp, f"nvme{rank}"))
            os.makedirs(kw["nvme_path"], exist_ok=True)
        model = tierlift.zero.shard(make_model(), stage=stage, **kw)
        opt = tierlift.optim.AdamW(model.parameters(), **OPT)
        # One step first, so stages 1/2 hold stale gathered weights the block must not show.
        train(model, opt, batches(1, BATCH, seed=9), accum=1, clip=None, world=2, rank=rank,
              zero=True)
        expect = tierlift.zero.full_state_dict(model)
        with tierlift.zero.gathered(model):
            seen = {k: getattr(model.get_submodule(k.rpartition(".")[0]),
                               k.rpartition(".")[2]).clone()
                    for k in ("tok.weight", "head.weight", "blocks.1.fc.weight")}
            tied = model.head.weight is model.tok.weight
        out[f"{name}_read"] = all(torch.equal(seen[k], expect[k]) for k in seen) and tied
        before = _flat(model)
        with tierlift.zero.gathered(model.blocks[1], modifier_rank=None):
            out[f"{name}_read_block"] = torch.equal(model.blocks[1].fc.weight,
                                                    expect["blocks.1.fc.weight"])
        out[f"{name}_readonly_edit"] = _raises(lambda m=model: _readonly_edit(m))
        out[f"{name}_readonly_data"] = _raises(lambda m=model: _readonly_data_edit(m))
        out[f"{name}_readonly_unchanged"] = torch.equal(before, _flat(model))
        with tierlift.zero.gathered(model, modifier_rank=0):
            _edit(model, rank)
        losses = train(model, opt, batches(STEPS, BATCH), accum=1, clip=None, world=2,
                       rank=rank, zero=True)
        out[f"{name}_losses"] = losses
        full_ref[name] = tierlift.zero.full_state_dict(model)
        tierlift.zero.close(model)
    out["gathered_state"] = full_ref
    model = tierlift.zero.shard(make_model(), stage=3)
    out["bad_modifier"] = _raises(lambda: tierlift.zero.gathered(model, 2).__enter__(),
                                  ValueError)


def _readonly_edit(model):
    with tierlift.zero.gathered(model.blocks[0]):
        model.blocks[0].proj.weight.add_(1.0)


def _readonly_data_edit(model):
    with tierlift.zero.gathered(model.blocks[1]):
        model.blocks[1].fc.weight.data[0, :3] = 7.0  # escapes the version counter


def _clip_and_count(rank, out):
    model = tierlift.zero.shard(make_model(), stage=3)
    seq = batches(1, BATCH, seed=4)[0]
    local = seq.chunk(2)[rank]
    torch.nn.functional.cross_entropy(model(local[:, :-1]).flatten(0, 1),
                                      local[:, 1:].flatten()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    out["norm2"] = tierlift.zero.clip_grad_norm_(model, float("inf")).item()
    out["norminf"] = tierlift.zero.clip_grad_norm_(model, float("inf"), norm_type="inf").item()
    out["clip_unchanged"] = all(torch.equal(a, p.grad) for a, p in zip(
        grads, [p for p in model.parameters() if p.grad is not None], strict=True))
    out["clip_nan"] = _raises(lambda: tierlift.zero.clip_grad_norm_(model, float("nan")),
                              ValueError)
    out["count"] = tierlift.zero.num_parameters(model)
    out["count_trainable"] = tierlift.zero.num_parameters(model, only_trainable=True)
    out["count_no_emb"] = tierlift.zero.num_parameters(model, exclude_embeddings=True)
    out["count_wrapped"] = tierlift.zero.num_parameters(nn.ModuleDict({"m": model}))
    out["full_numel"] = sum(getattr(p, "full_numel", p.numel()) for p in model.parameters())
    out["shard_numel"] = sum(p.numel() for p in model.parameters())


def _cases(rank, world, tmp):
    out = {}
    _ddp(rank, out)
    _fsdp(rank, out)
    _state_dicts(rank, world, tmp, out)
    _key_reports(rank, out)
    _freed(rank, out)
    _gathered(rank, tmp, out)
    _clip_and_count(rank, out)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_guards")))


def test_ddp_refused_before_any_broadcast(ranks):
    for out in ranks:
        for key in ("ddp", "ddp_wrapped", "ddp_s1"):
            assert "DistributedDataParallel was given a model sharded by tierlift.zero" in \
                out[key], out[key]
            assert "do not wrap it" in out[key] and "tierlift.hf.Trainer" in out[key]
        assert out["ddp_unchanged"] and out["ddp_s1_unchanged"]
        assert out["ddp_plain_ok"]


def test_foreign_shards_never_load(ranks):
    r0, r1 = ranks
    assert r0["load_rank0"] == "<no error>"   # rank 0 loading its own shards
    assert "shards of rank 0 of 2; this is rank 1 of 2" in r1["load_rank0"]
    assert "tierlift.checkpoint.load" in r1["load_rank0"]
    assert r1["load_rank0_unchanged"]
    for out in ranks:
        assert out["load_own"] == "<no error>"
        assert "no record of the rank and world size" in out["load_plain_dict"]
        assert "shards of rank 0 of 1" in out["load_world1"]
        assert "shards of rank" in out["load_block_other"]
        assert out["refusals_unchanged"]


def test_full_state_dict_loads_exactly_through_load_state_dict(ranks):
    full = make_model(seed=5).state_dict()
    other = make_model(seed=6).state_dict()
    for out in ranks:
        assert "assign=True" in out["assign"]
        assert "both shards" in out["mixed"]
        assert out["full_refusals_unchanged"]
        assert out["load_full"] == "<All keys matched successfully>"
        for k, v in full.items():
            assert torch.equal(out["full_after"][k], v), k
        # Units not given stay; the given one is replaced; torch reports the rest as missing.
        for k, v in full.items():
            want = other[k] if k.startswith("blocks.2.") else v
            assert torch.equal(out["only_after"][k], want), k
        # The weights torch names for the unsharded model, not the shards that hold them.
        only = {k: v for k, v in other.items() if k.startswith("blocks.2.")}
        assert out["only_missing"] == make_model().load_state_dict(only,
                                                                   strict=False).missing_keys
        assert "blocks.0.qkv.weight" in out["only_missing"]


@pytest.mark.parametrize("name", ["s1", "s3", "s3-offload"])
def test_mismatched_keys_reported_as_torch_does(ranks, name):
    full = make_model(seed=5).state_dict()
    for case, sd in _mismatched(full).items():
        ref = make_model()
        res = ref.load_state_dict(dict(sd), strict=False)
        strict = _raises(lambda sd=sd: make_model().load_state_dict(sd))
        for out in ranks:
            missing, unexpected, after = out[f"keys_{name}_{case}"]
            assert missing == res.missing_keys, case
            assert unexpected == res.unexpected_keys, case
            for k, v in ref.state_dict().items():  # loaded what torch loads, kept the rest
                assert torch.equal(after[k], v), (case, k)
            assert out[f"strict_{name}_{case}"] == strict, case
    assert any(res.missing_keys for res in [make_model().load_state_dict(sd, strict=False)
                                            for sd in _mismatched(full).values()])
    ref = make_model()
    block = {k[len("blocks.1."):]: v for k, v in full.items()
             if k.startswith("blocks.1.") and k != "blocks.1.fc.weight"}
    res = ref.blocks[1].load_state_dict(block, strict=False)
    assert res.missing_keys == ["fc.weight"]
    for out in ranks:
        missing, unexpected, after = out[f"keys_{name}_block"]
        assert (missing, unexpected) == (res.missing_keys, res.unexpected_keys)
        for k, v in ref.state_dict().items():
            assert torch.equal(after[k], v), k


def test_fsdp_refused_before_any_change(ranks):
    keys = ("fsdp1", "fsdp1_orig", "fsdp1_auto", "fsdp1_outer", "fsdp2", "fsdp2_block",
            "fsdp2_outer", "dcp_state_dict")
    for out in ranks:
        for key in keys:
            assert "torch FSDP (FullyShardedDataParallel / fully_shard, or replicate) was " \
                "given a model sharded by tierlift.zero.shard" in out[key], (key, out[key])
            assert "do not wrap it" in out[key] and "tierlift.hf.Trainer" in out[key]
        assert out["fsdp_unchanged"] and out["fsdp_forward_same"]
        assert out["fsdp2_plain_ok"]


def test_freed_weights_raise_instead_of_crashing(ranks):
    assert "'tok.weight' was given shape (70, 20) inside gathered()" in ranks[0]["resize_in_block"]
    assert "rank 0 (modifier_rank) gave a gathered weight another shape" in \
        ranks[1]["resize_in_block"]
    for out in ranks:
        assert out["freed_shape"] == (60, 20)
        assert "'blocks.0.qkv.weight' is sharded by tierlift.zero (stage 3) and not gathered" \
            in out["freed_sum"]
        assert "tierlift.zero.gathered" in out["freed_sum"]
        assert "not gathered" in out["freed_index"]
        assert "cannot replace submodule 'tok'" in out["replace_embedding"]
        assert "cannot add submodule 'extra' with trainable parameters" in out["add_trainable"]
        assert out["swap_unchanged"]
        assert out["freed_after_forward"] == "FreedWeight"
        assert out["resize_unchanged"]
        assert torch.equal(out["data_edit"], torch.full((20,), 0.5))
        assert "forward inside tierlift.zero.gathered()" in out["forward_in_block"]


def _reference(name):
    model = make_model()
    opt = tierlift.optim.AdamW(model.parameters(), **OPT)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(model, opt, batches(1, BATCH, seed=9), accum=1, clip=None)
        _edit(model, 0)
        losses = train(model, opt, batches(STEPS, BATCH), accum=1, clip=None)
    finally:
        torch.set_num_threads(threads)
    return losses, model.state_dict()


@pytest.mark.parametrize("name", list(GATHER_CONFIGS))
def test_gathered_reads_and_writes_back(ranks, name):
    ref_losses, ref_sd = _reference(name)
    for out in ranks:
        assert out[f"{name}_read"] and out[f"{name}_read_block"]
        assert "without modifier_rank" in out[f"{name}_readonly_edit"]
        data = out[f"{name}_readonly_data"]
        assert "without modifier_rank" in data and "through .data" in data, data
        assert "modifier_rank=<the rank whose edits to keep>" in data
        assert out[f"{name}_readonly_unchanged"]
        torch.testing.assert_close(torch.tensor(out[f"{name}_losses"]),
                                   torch.tensor(ref_losses), rtol=1e-5, atol=0)
        state = out["gathered_state"][name]
        for k, v in ref_sd.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k: f"{k}: {m}")
    assert "modifier_rank must be None or a rank" in ranks[0]["bad_modifier"]


def test_clip_inf_and_counts(ranks):
    model = make_model()
    seq = batches(1, BATCH, seed=4)[0]
    halves = seq.chunk(2)
    loss = sum(torch.nn.functional.cross_entropy(model(h[:, :-1]).flatten(0, 1),
                                                 h[:, 1:].flatten()) for h in halves) / 2
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    ref2 = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0).item()
    refinf = torch.nn.utils.get_total_norm([p.grad for p in params], float("inf")).item()
    full = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for out in ranks:
        assert out["norm2"] == pytest.approx(ref2, rel=1e-5)
        assert out["norminf"] == pytest.approx(refinf, rel=1e-5)
        assert out["clip_unchanged"]
        assert "max_norm must be >= 0" in out["clip_nan"]
        assert out["count"] == full == out["count_wrapped"] == out["full_numel"]
        assert out["count_trainable"] == trainable
        assert out["count_no_emb"] == full - model.tok.weight.numel()
        assert out["shard_numel"] < full


class _ListModel(nn.Module):
    """Its layers' ModuleList holds between 1/32 and half of the model: it was picked as a unit,
    and a ModuleList is never called, so its weights were never gathered (stage 3 read freed
    memory) or refreshed after a step (stages 1/2)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(200, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16)])
        self.head = nn.Linear(16, 200)

    def forward(self, idx):
        x = self.tok(idx)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


@pytest.mark.parametrize("stage", [1, 3])
def test_module_list_is_never_a_unit(stage):
    assert tierlift.zero.default_units(_ListModel()) == ["tok", "layers.0", "head"]
    with pytest.raises(ValueError, match="ModuleList, which is never called"):
        tierlift.zero.shard(_ListModel(), stage=stage, units=["layers"])
    data = torch.randint(0, 200, (3, 4, 9))
    losses = []
    for sharded in (False, True):
        model = _ListModel()
        if sharded:
            model = tierlift.zero.shard(model, stage=stage)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        run = []
        for seq in data:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(seq[:, :-1]).flatten(0, 1),
                                               seq[:, 1:].flatten())
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5,
                               atol=0)
