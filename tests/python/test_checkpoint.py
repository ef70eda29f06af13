"""tierlift.checkpoint: round trip, resharding 2 -> 1 -> 4 -> 2, export, atomicity, safety and
mismatch errors. The resharding chain checks the optimizer state too: training resumed on the
new world size must give the losses that the original run got."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from zero_model import DIM, batches, free_port, init_gloo, make_model, shutdown, train

import tierlift
from tierlift.checkpoint import format as fmt

BATCH = 8
OPT = dict(lr=3e-3, weight_decay=0.1)
DATA = batches(5, BATCH, seed=3)


def _fresh(stage=3, group=None):
    model = tierlift.zero.shard(make_model(seed=5), stage=stage, process_group=group)
    return model, tierlift.optim.AdamW(model.parameters(), **OPT)


def _world2_save(rank, world, port, ckpt, out):
    init_gloo(rank, world, port)
    model, opt = _fresh(stage=2)
    train(model, opt, DATA[:3], accum=1, clip=1.0, world=world, rank=rank, zero=True)
    tierlift.checkpoint.save(ckpt, model, opt)
    sd = tierlift.zero.full_state_dict(model)
    losses = train(model, opt, DATA[3:], accum=1, clip=1.0, world=world, rank=rank, zero=True)
    if rank == 0:
        torch.save({"state": sd, "losses": torch.tensor(losses)}, out)
    shutdown()


def _world4_load_save(rank, world, port, src, dst, out):
    init_gloo(rank, world, port)
    model, opt = _fresh(stage=3)
    tierlift.checkpoint.load(src, model, opt)
    losses4 = train(model, opt, DATA[3:], accum=1, clip=1.0, world=world, rank=rank, zero=True)
    model, opt = _fresh(stage=3)
    tierlift.checkpoint.load(src, model, opt)
    tierlift.checkpoint.save(dst, model, opt)
    # 4 -> 2: ranks 0 and 1 shard over a subgroup and resume from the 4-rank checkpoint.
    pair = dist.new_group([0, 1])
    losses2 = None
    if rank < 2:
        model, opt = _fresh(stage=1, group=pair)
        tierlift.checkpoint.load(dst, model, opt)
        losses2 = train(model, opt, DATA[3:], accum=1, clip=None, world=2, rank=rank,
                        zero=True, group=pair)
        if rank == 0:
            # clip=None differs from the original run: compare against a world-1 replay below.
            torch.save({"losses4": torch.tensor(losses4), "losses2": torch.tensor(losses2)}, out)
    dist.barrier()
    shutdown()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    a, b, c = str(root / "a"), str(root / "b"), str(root / "c")
    mp.spawn(_world2_save, args=(2, free_port(), a, str(root / "w2.pt")), nprocs=2)
    w2 = torch.load(root / "w2.pt", weights_only=True)
    torch.set_num_threads(1)
    # 2 -> 1: a single process (no process group) resumes and saves again.
    model, opt = _fresh(stage=3)
    tierlift.checkpoint.load(a, model, opt)
    loaded = tierlift.zero.full_state_dict(model)
    losses1 = train(model, opt, DATA[3:], accum=1, clip=1.0, zero=True)
    model, opt = _fresh(stage=3)
    tierlift.checkpoint.load(a, model, opt)
    tierlift.checkpoint.save(b, model, opt)
    replay = train(model, opt, DATA[3:], accum=1, clip=None, zero=True)
    mp.spawn(_world4_load_save, args=(4, free_port(), b, c, str(root / "w4.pt")), nprocs=4)
    w4 = torch.load(root / "w4.pt", weights_only=True)
    return dict(dirs=(a, b, c), w2=w2, loaded=loaded, losses1=losses1, replay=replay, w4=w4)


def test_2_to_1_round_trip(chain):
    for key, ref in chain["w2"]["state"].items():
        torch.testing.assert_close(chain["loaded"][key], ref, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(chain["losses1"]), chain["w2"]["losses"],
                               rtol=1e-5, atol=0)


def test_1_to_4(chain):
    torch.testing.assert_close(chain["w4"]["losses4"], chain["w2"]["losses"], rtol=1e-5, atol=0)


def test_4_to_2(chain):
    torch.testing.assert_close(chain["w4"]["losses2"], torch.tensor(chain["replay"]),
                               rtol=1e-5, atol=0)


def test_export_plain_state_dict(chain, tmp_path):
    from tierlift.checkpoint.__main__ import main

    out = tmp_path / "model.pt"
    assert main(["export", chain["dirs"][2], str(out)]) == 0
    sd = torch.load(out, weights_only=True)
    plain = make_model()
    plain.load_state_dict(sd)  # strict: every key, right shapes
    assert list(sd) == list(chain["w2"]["state"])
    for key, ref in chain["w2"]["state"].items():
        torch.testing.assert_close(sd[key], ref, rtol=0, atol=0)


def test_mismatch_names_first_tensor(chain):
    other = make_model(seed=5)
    other.blocks[1].fc = nn.Linear(DIM, 3 * DIM)
    other.blocks[1].out = nn.Linear(3 * DIM, DIM)
    model = tierlift.zero.shard(other, stage=3)
    with pytest.raises(ValueError, match=r"'blocks\.1\.fc\.weight'"):
        tierlift.checkpoint.load(chain["dirs"][0], model)


def test_save_is_atomic(chain, tmp_path, monkeypatch):
    dst = str(tmp_path / "ck")
    model, opt = _fresh(stage=3)
    tierlift.checkpoint.load(chain["dirs"][0], model, opt)
    tierlift.checkpoint.save(dst, model, opt)
    before = tierlift.checkpoint.full_state_dict(dst)
    train(model, opt, DATA[3:4], accum=1, clip=None, zero=True)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        tierlift.checkpoint.save(dst, model, opt)
    monkeypatch.undo()
    after = tierlift.checkpoint.full_state_dict(dst)
    for key in before:
        assert torch.equal(before[key], after[key])
    # A save killed between its two renames leaves only dst.old, which load() falls back to.
    fmt.move_aside(dst, dst + ".old")
    fresh, _ = _fresh(stage=3)
    tierlift.checkpoint.load(dst, fresh)
    assert torch.equal(tierlift.zero.full_state_dict(fresh)["tok.weight"], before["tok.weight"])


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_never_unpickles_code(chain, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(chain["dirs"][1], bad)
    torch.save({"unit0.param": _Evil()}, os.path.join(bad, "rank00000.pt"))
    # Whoever can write the file can write its checksums: weights_only must still refuse it.
    from tierlift.checkpoint.format import sha256

    with open(os.path.join(bad, "rank00000.sha256"), "w") as f:
        f.write(sha256(os.path.join(bad, "rank00000.pt")))
    from tierlift.checkpoint import manifest

    manifest.write(bad)  # and the manifest
    model, _ = _fresh(stage=3)
    with pytest.raises(pickle.UnpicklingError):
        tierlift.checkpoint.load(bad, model)


def test_not_a_checkpoint(tmp_path):
    model, _ = _fresh(stage=3)
    with pytest.raises(FileNotFoundError, match="not a tierlift checkpoint"):
        tierlift.checkpoint.load(str(tmp_path), model)


def test_corrupt_or_truncated_file_is_named(chain, tmp_path):
    import shutil

    for damage in ("flip", "truncate"):
        bad = str(tmp_path / damage)
        shutil.copytree(chain["dirs"][2], bad)
        file = os.path.join(bad, "rank00002.pt")
        data = bytearray(open(file, "rb").read())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        open(file, "wb").write(bytes(data))
        model, _ = _fresh(stage=3)
        with pytest.raises(ValueError, match=r"rank00002\.pt is corrupt or truncated"):
            tierlift.checkpoint.load(bad, model)


@pytest.mark.parametrize("save_offload,load_offload", [("nvme", "nvme"), ("none", "cpu")])
def test_offloaded_optimizer_state_round_trips(tmp_path, save_offload, load_offload):
    """An offloading optimizer keeps exp_avg/exp_avg_sq in its tiers, not in optimizer.state:
    the checkpoint must still carry them, so a resumed run continues bit-identically."""
    torch.set_num_threads(1)

    def fresh(offload):
        model = tierlift.zero.shard(make_model(seed=5), stage=3)
        extra = {} if offload == "none" else dict(offload=offload)
        if offload == "nvme":
            extra["nvme_path"] = str(tmp_path)
        return model, tierlift.optim.AdamW(model.parameters(), **OPT, **extra)

    model, opt = fresh(save_offload)
    train(model, opt, DATA[:3], accum=1, clip=None, zero=True)
    tierlift.checkpoint.save(tmp_path / "ck", model, opt)
    expected = train(model, opt, DATA[3:], accum=1, clip=None, zero=True)
    model, opt = fresh(load_offload)
    tierlift.checkpoint.load(tmp_path / "ck", model, opt)
    assert train(model, opt, DATA[3:], accum=1, clip=None, zero=True) == expected


def test_mismatched_param_groups_change_nothing(tmp_path):
    model, opt = _fresh(stage=3)
    train(model, opt, DATA[:2], accum=1, clip=None, zero=True)
    tierlift.checkpoint.save(tmp_path / "ck", model, opt)
    other = tierlift.zero.shard(make_model(seed=6), stage=3)
    before = tierlift.zero.full_state_dict(other)
    shards = list(other.parameters())
    two_groups = tierlift.optim.AdamW([{"params": shards[:1]}, {"params": shards[1:]}])
    with pytest.raises(ValueError, match="param groups"):
        tierlift.checkpoint.load(tmp_path / "ck", other, two_groups)
    after = tierlift.zero.full_state_dict(other)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not two_groups.state
