"""Checkpoints of offloaded optimizer state (tierlift.checkpoint.stream, replicated.py): the
state streams through the Offloader's pool (peak RSS measured), resumes bit-identically with and
without ZeRO (world 1, and 2 gloo ranks), loads under another cpu_budget, into offload="none"
and into torch.optim.AdamW, and a corrupt or truncated file is an error naming it that leaves
the model and the optimizer as they were."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import rss_probe
import torch
import torch.multiprocessing as mp
from zero_model import batches, free_port, init_gloo, make_model, shutdown, train

import tierlift

ROOT = Path(__file__).resolve().parents[2]
OPT = dict(lr=3e-3, weight_decay=0.1)
DATA = batches(6, 8, seed=3)


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _fresh(tmp, divisor=3, zero=False, **kw):
    model = make_model(seed=5)
    if zero:
        model = tierlift.zero.shard(model, stage=3)
    if not kw:
        kw = dict(offload="nvme", nvme_path=str(tmp),
                  cpu_budget=int(12 * _numel(model) / divisor))
    return model, tierlift.optim.AdamW(model.parameters(), **OPT, **kw)


def _train(model, opt, data, zero=False):
    return train(model, opt, data, accum=1, clip=None if zero else 1.0, zero=zero)


def _weights(model, zero=False):
    sd = tierlift.zero.full_state_dict(model) if zero else model.state_dict()
    return {k: v.detach().clone() for k, v in sd.items()}


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("zero", [False, True], ids=["plain", "zero3"])
def test_resume_is_bit_identical_under_another_budget(tmp_path, zero):
    model, opt = _fresh(tmp_path, 3, zero)
    _train(model, opt, DATA[:3], zero)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 3, "losses": [1.5, 1.25]})
    ref = _train(model, opt, DATA[3:], zero)
    ref_w = _weights(model, zero)
    opt.close()
    # a smaller budget (so smaller chunks), state 5x the budget
    model, opt = _fresh(tmp_path, 5, zero)
    assert tierlift.checkpoint.load(ck, model, opt) == {"step": 3, "losses": [1.5, 1.25]}
    assert _train(model, opt, DATA[3:], zero) == ref
    _assert_same(_weights(model, zero), ref_w)
    opt.close()


def test_loads_into_offload_none_cpu_and_torch_adamw(tmp_path):
    model, opt = _fresh(tmp_path)
    _train(model, opt, DATA[:3])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    saved = opt.state_dict()
    ref = _train(model, opt, DATA[3:])
    ref_w = _weights(model)
    for kw in (dict(offload="none"), dict(offload="cpu"), dict(offload="cpu", overlap=True)):
        m, o = _fresh(tmp_path, **kw)
        tierlift.checkpoint.load(ck, m, o)
        assert _train(m, o, DATA[3:]) == ref, kw
        _assert_same(_weights(m), ref_w)
    # torch.optim.AdamW through the converter, and the CLI writing the same thing
    m = make_model(seed=5)
    o = torch.optim.AdamW(m.parameters(), **OPT)
    tierlift.checkpoint.load(ck, m, o)
    got = o.state_dict()
    assert got["state"].keys() == {i for i, st in saved["state"].items() if st}
    for i, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    assert got["param_groups"][0]["lr"] == OPT["lr"]
    _train(m, o, DATA[3:4])
    from tierlift.checkpoint.__main__ import main

    out = tmp_path / "optim.pt"
    assert main(["export-optimizer", ck, str(out)]) == 0
    o2 = torch.optim.AdamW(make_model(seed=5).parameters(), **OPT)
    o2.load_state_dict(torch.load(out, weights_only=True))
    assert torch.equal(o2.state_dict()["state"][2]["exp_avg"], saved["state"][2]["exp_avg"])


def _flip_byte(file: str) -> None:
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("damage,name", [
    ("flip", "optim/g0.exp_avg_sq.f32"), ("truncate", "optim/g0.master.f32"),
    ("flip", "rank00000.pt")])
def test_corrupt_file_is_named_and_nothing_changes(tmp_path, damage, name):
    model, opt = _fresh(tmp_path)
    _train(model, opt, DATA[:2])
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(str(ck), model, opt)
    _train(model, opt, DATA[2:4])
    before_w, before_o = _weights(model), opt.state_dict()
    file = str(ck / name)
    if damage == "flip":
        _flip_byte(file)
    else:
        os.truncate(file, os.path.getsize(file) - 4096)
    with pytest.raises(ValueError, match=os.path.basename(name).replace(".", r"\.")):
        tierlift.checkpoint.load(str(ck), model, opt)
    _assert_same(_weights(model), before_w)
    after_o = opt.state_dict()
    for i, st in before_o["state"].items():
        for k, v in st.items():
            assert torch.equal(after_o["state"][i][k], v), (i, k)
    assert _train(model, opt, DATA[4:5])  # still trains


def test_mismatched_optimizer_is_refused(tmp_path):
    model, opt = _fresh(tmp_path)
    _train(model, opt, DATA[:1])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    m = make_model(seed=5)
    o = tierlift.optim.AdamW([p for p in m.parameters() if p.requires_grad][:3], offload="nvme",
                             nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="param group 0 has"):
        tierlift.checkpoint.load(ck, m, o)
    o.close()



@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_state_for_another_parameter_order_goes_by_name(tmp_path, offload):
    """An optimizer built over the same model's parameters in another order: the streamed state
    of a (64, 32) weight went into the (32, 64) one (same element count) and training went on
    with moments out of line. The saved names put each parameter's state back into it."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False),
                                   torch.nn.Linear(64, 32, bias=False))

    def opt_over(params):
        kw = dict(nvme_path=str(tmp_path)) if offload == "nvme" else {}
        return tierlift.optim.AdamW(params, **OPT, offload=offload, chunk_bytes=4096, **kw)

    model = net()
    opt = opt_over(list(model.parameters()))
    for _ in range(2):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    m = net()
    o = opt_over(list(m.parameters())[::-1])
    m(torch.randn(8, 32)).square().mean().backward()
    o.step()
    try:
        tierlift.checkpoint.load(ck, m, o)
        saved, got = opt.state_dict()["state"], o.state_dict()["state"]
        for i in (0, 1):  # this optimizer's parameter i is the saved one's 1 - i
            _assert_same(saved[1 - i], got[i])
    finally:
        opt.close()
        o.close()

# ---- peak RSS: saves and the load stream through their budgets ----------------------------
_RSS = r"""
n, budget, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
p = torch.nn.Parameter(torch.zeros(n))
def make(b):
    return tierlift.optim.AdamW([p], lr=1e-3, offload="nvme", nvme_path=root, cpu_budget=b)
opt = make(budget)
for _ in range(2):
    p.grad = torch.randn(n)
    opt.step()
p.grad = None
ck = os.path.join(root, "ck")
model = torch.nn.ParameterList([p])
def background(name):
    tierlift.checkpoint.save(os.path.join(root, name), model, opt, blocking=False,
                             staging_budget=budget).wait()
background("warm")  # loads the code a save runs; close() frees its staging and engine
tierlift.checkpoint.close()
off = growth(lambda: background("bg"))
full = growth(lambda: tierlift.checkpoint.save(ck, model, opt))
opt2 = make(budget // 2)
back = growth(lambda: tierlift.checkpoint.load(ck, torch.nn.ParameterList([p]), opt2))
same = all(torch.equal(a, b) for a, b in zip(opt.state_dict()["state"][0].values(),
                                             opt2.state_dict()["state"][0].values()))
sd = growth(opt.state_dict)
print(off, full, back, sd, int(same))
"""


def test_save_and_load_peak_rss_stays_within_the_budget(tmp_path):
    n = 2 << 20  # 2M params: 24 MiB of fp32 master, exp_avg, exp_avg_sq
    budget = 4 << 20  # the state is 6x the budget
    off, full, back, sd, same = map(int, rss_probe.run(_RSS, n, budget, tmp_path).split())
    assert same == 1
    print(f"peak RSS growth, MiB: background save {off / 2**20:.1f}, save {full / 2**20:.1f}, load "
          f"{back / 2**20:.1f}, state_dict {sd / 2**20:.1f} (budget {budget / 2**20:.0f})")
    margin = 6 << 20  # interpreter and allocator noise, SHA-256 read blocks (4 MiB)
    model = 4 * n  # the model's tensor file is written and read by torch.save/load
    # staging_budget holds the model's bytes too; the writer engine's pool is 2 MiB
    assert off <= budget + (2 << 20) + margin, off
    assert full <= budget + model + margin, full
    assert back <= budget + model + margin, back
    # state_dict() builds exp_avg and exp_avg_sq (an fp32 param is its own master) in RAM:
    # the same probe sees that
    assert sd >= 7 * n, sd


# ---- ZeRO over 2 gloo ranks ---------------------------------------------------------------
def _world2(rank, world, port, root, out):
    init_gloo(rank, world, port)
    nvme = os.path.join(root, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    model, opt = _fresh(nvme, 2, zero=True)  # each rank's shard state is 2x its budget
    kw = dict(accum=1, clip=1.0, world=world, rank=rank, zero=True)
    train(model, opt, DATA[:3], **kw)
    ck = os.path.join(root, "ck")
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 3})
    saved = tierlift.zero.full_state_dict(model)
    ref = train(model, opt, DATA[3:], **kw)
    ref_w = tierlift.zero.full_state_dict(model)
    opt.close()
    model, opt = _fresh(nvme, 2.5, zero=True)
    assert tierlift.checkpoint.load(ck, model, opt) == {"step": 3}
    got = train(model, opt, DATA[3:], **kw)
    got_w = tierlift.zero.full_state_dict(model)
    opt.close()
    if rank == 0:
        torch.save({"ref": torch.tensor(ref), "got": torch.tensor(got), "saved": saved,
                    "ref_w": ref_w, "got_w": got_w}, out)
    shutdown()


def test_zero_two_ranks_resume_and_reshard_to_one(tmp_path):
    out = str(tmp_path / "w2.pt")
    mp.spawn(_world2, args=(2, free_port(), str(tmp_path), out), nprocs=2)
    r = torch.load(out, weights_only=True)
    assert torch.equal(r["ref"], r["got"])
    _assert_same(r["ref_w"], r["got_w"])
    # 2 -> 1: the streamed shard files of both ranks, mapped, into a one-process run
    torch.set_num_threads(1)
    model, opt = _fresh(tmp_path, 3, zero=True)
    tierlift.checkpoint.load(str(tmp_path / "ck"), model, opt)
    _assert_same(tierlift.zero.full_state_dict(model), r["saved"])
    losses = train(model, opt, DATA[3:], accum=1, clip=1.0, zero=True)
    torch.testing.assert_close(torch.tensor(losses), r["ref"], rtol=1e-5, atol=0)
    opt.close()


def test_bf16_master_weights_round_trip_into_offload_none(tmp_path):
    def fresh(**kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Linear(300, 7)).bfloat16()
        return model, tierlift.optim.AdamW(model.parameters(), **OPT, **kw)

    def steps(model, opt, seed, n=3):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            opt.zero_grad()
            model(torch.randn(4, 40, generator=g).bfloat16()).float().pow(2).mean().backward()
            opt.step()

    model, opt = fresh(offload="nvme", nvme_path=str(tmp_path), cpu_budget=200_000)
    steps(model, opt, 1)
    tierlift.checkpoint.save(str(tmp_path / "ck"), model, opt)
    masters = {i: st["master"].clone() for i, st in opt.state_dict()["state"].items()}
    steps(model, opt, 2)
    ref = _weights(model)
    m, o = fresh()
    tierlift.checkpoint.load(str(tmp_path / "ck"), m, o)
    got = o.state_dict()["state"]
    assert got.keys() == masters.keys()
    for i, master in masters.items():
        assert got[i]["master"].dtype == torch.float32 and torch.equal(got[i]["master"], master)
    steps(m, o, 2)
    _assert_same(_weights(m), ref)


def test_amsgrad_mismatch_and_layout_mismatch_are_refused(tmp_path):
    model, opt = _fresh(tmp_path)
    _train(model, opt, DATA[:1])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    m = make_model(seed=5)
    o = tierlift.optim.AdamW(m.parameters(), amsgrad=True, offload="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"no \[.max_exp_avg_sq.\] .*amsgrad=False"):
        tierlift.checkpoint.load(ck, m, o)
    o.close()
    sharded = tierlift.zero.shard(make_model(seed=5), stage=3)
    with pytest.raises(ValueError, match="unsharded model's checkpoint"):
        tierlift.checkpoint.load(ck, sharded)
    zck = str(tmp_path / "zck")
    tierlift.checkpoint.save(zck, sharded)
    with pytest.raises(ValueError, match="sharded"):
        tierlift.checkpoint.load(zck, make_model(seed=5))


def test_amsgrad_state_into_an_optimizer_without_amsgrad_is_refused(tmp_path):
    m = make_model(seed=5)
    o = tierlift.optim.AdamW(m.parameters(), amsgrad=True, offload="cpu")
    _train(m, o, DATA[:1])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, m, o)
    o.close()
    m2 = make_model(seed=5)
    o2 = tierlift.optim.AdamW(m2.parameters(), offload="cpu")
    before = _weights(m2)
    with pytest.raises(ValueError, match="saved with amsgrad=True .* build it with amsgrad=True"):
        tierlift.checkpoint.load(ck, m2, o2)
    _assert_same(_weights(m2), before)
    assert not o2.state_dict()["state"]
    o2.close()


def test_zero_offloaded_state_loads_into_a_zero_run_without_offload(tmp_path):
    model, opt = _fresh(tmp_path, 3, zero=True)
    _train(model, opt, DATA[:3], zero=True)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    ref = _train(model, opt, DATA[3:], zero=True)
    ref_w = _weights(model, zero=True)
    opt.close()
    model, opt = _fresh(tmp_path, zero=True, offload="none")
    tierlift.checkpoint.load(ck, model, opt)
    assert _train(model, opt, DATA[3:], zero=True) == ref
    _assert_same(_weights(model, zero=True), ref_w)


def _ddp(rank, world, port, root, out):
    init_gloo(rank, world, port)
    nvme = os.path.join(root, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    model, opt = _fresh(nvme)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    kw = dict(accum=1, clip=1.0, world=world, rank=rank)
    train(ddp, opt, DATA[:2], **kw)
    ck = os.path.join(root, "ck")
    tierlift.checkpoint.save(ck, ddp, opt, extra={"rank": rank})  # rank 0 writes
    ref = train(ddp, opt, DATA[2:4], **kw)
    opt.close()
    model, opt = _fresh(nvme, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    extra = tierlift.checkpoint.load(ck, ddp, opt)
    got = train(ddp, opt, DATA[2:4], **kw)
    opt.close()
    torch.save({"ref": ref, "got": got, "extra": extra}, f"{out}.{rank}")
    shutdown()


def test_replicated_ddp_rank0_writes_every_rank_loads(tmp_path):
    out = str(tmp_path / "r")
    mp.spawn(_ddp, args=(2, free_port(), str(tmp_path), out), nprocs=2)
    for rank in range(2):
        r = torch.load(f"{out}.{rank}", weights_only=True)
        assert r["extra"] == {"rank": 0} and r["got"] == r["ref"], rank


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_save_or_load_after_the_params_list_changed_is_refused(tmp_path, offload):
    """Offloaded state is laid out by position in the lists: a checkpoint of an optimizer
    whose list was filtered since is refused before anything is written or read."""
    import tierlift

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    kw = {"nvme_path": str(tmp_path / "nvme")} if offload == "nvme" else {}
    if offload == "nvme":
        (tmp_path / "nvme").mkdir()
    opt = tierlift.optim.AdamW(model.parameters(), offload=offload, **kw)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    tierlift.checkpoint.save(str(tmp_path / "ck"), model, opt)
    opt.param_groups[0]["params"] = opt.param_groups[0]["params"][2:]  # first block frozen
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\] is not the list"):
        tierlift.checkpoint.save(str(tmp_path / "ck2"), model, opt)
    assert not (tmp_path / "ck2").exists() and not (tmp_path / "ck2.tmp").exists()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\] is not the list"):
        tierlift.checkpoint.load(str(tmp_path / "ck"), model, opt)
