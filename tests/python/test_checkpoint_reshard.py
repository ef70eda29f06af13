"""Loads of streamed optimizer state (tierlift.checkpoint.restore, reshard): all-or-nothing on every
tier when the reader fails half-way (an I/O error, a file cut short after its SHA-256 was checked,
a mismatch only the optimizer notices), and a ZeRO checkpoint saved on 2 gloo ranks loads on 1
and on 3 with the exact saved state, streamed within cpu_budget (peak RSS measured)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import rss_probe
import torch
import torch.multiprocessing as mp
from zero_model import batches, free_port, init_gloo, make_model, shutdown, train

import tierlift
from tierlift.checkpoint import restore

ROOT = Path(__file__).resolve().parents[2]
OPT = dict(lr=3e-3, weight_decay=0.1)
DATA = batches(5, 8, seed=3)
TIERS = {  # host memory with one generation, with two (overlap), NVMe in several chunks
    "cpu": lambda tmp: dict(offload="cpu"),
    "cpu-overlap": lambda tmp: dict(offload="cpu", overlap=True),
    "nvme": lambda tmp: dict(offload="nvme", nvme_path=str(tmp), cpu_budget=120_000),
}


def _fresh(tmp, tier, zero, **extra):
    model = make_model(seed=5)
    if zero:
        model = tierlift.zero.shard(model, stage=3)
    return model, tierlift.optim.AdamW(model.parameters(), **OPT, **{**TIERS[tier](tmp), **extra})


def _train(model, opt, data, zero):
    return train(model, opt, data, accum=1, clip=None, zero=zero)


def _snapshot(model, opt, zero) -> dict:
    sd = tierlift.zero.full_state_dict(model) if zero else model.state_dict()
    st = opt.state_dict()["state"]
    return {"model": {k: v.detach().clone() for k, v in sd.items()},
            "optim": {i: {k: torch.as_tensor(v).clone() for k, v in s.items()}
                      for i, s in st.items()}}


def _assert_same(a: dict, b: dict):
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for i in a["optim"]:
        assert a["optim"][i].keys() == b["optim"][i].keys(), i
        for k in a["optim"][i]:
            assert torch.equal(a["optim"][i][k], b["optim"][i][k]), (i, k)


def _fail_after(monkeypatch, k: int, fault: str) -> list:
    """The reader fails on its (k+1)-th read, after k reads changed the state."""
    calls = [0]
    real = restore.read_into

    def flaky(f, arr):
        calls[0] += 1
        if calls[0] > k:
            if fault == "eio":
                raise OSError(errno.EIO, "injected read error", f.name)
            os.truncate(f.name, f.tell())  # cut short after its SHA-256 was checked
        real(f, arr)

    monkeypatch.setattr(restore, "read_into", flaky)
    return calls


@pytest.mark.parametrize("fault", ["eio", "truncate"])
@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("zero", [False, True], ids=["plain", "zero3"])
def test_a_load_failing_half_way_changes_nothing(tmp_path, monkeypatch, zero, tier, fault):
    model, opt = _fresh(tmp_path, tier, zero)
    _train(model, opt, DATA[:2], zero)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    saved = _snapshot(model, opt, zero)
    _train(model, opt, DATA[2:4], zero)
    before = _snapshot(model, opt, zero)
    bad = str(tmp_path / "bad")
    shutil.copytree(ck, bad)  # "truncate" damages it
    calls = _fail_after(monkeypatch, 7, fault)
    with pytest.raises(OSError if fault == "eio" else ValueError,
                       match="injected" if fault == "eio" else "truncated"):
        tierlift.checkpoint.load(bad, model, opt)
    assert calls[0] >= 8  # 7 reads went into the state before the fault
    _assert_same(_snapshot(model, opt, zero), before)
    monkeypatch.undo()
    tierlift.checkpoint.load(ck, model, opt)  # the same optimizer loads it once the reads work
    _assert_same(_snapshot(model, opt, zero), saved)
    model2, opt2 = _fresh(tmp_path, tier, zero)
    tierlift.checkpoint.load(ck, model2, opt2)
    _assert_same(_snapshot(model2, opt2, zero), saved)
    opt.close()
    opt2.close()


def test_a_mismatch_found_by_the_optimizer_leaves_the_sharded_model_as_it_was(tmp_path):
    model, opt = _fresh(tmp_path, "nvme", True)
    _train(model, opt, DATA[:1], True)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    opt.close()
    _train(model, tierlift.optim.AdamW(model.parameters(), **OPT), DATA[1:3], True)
    before = {k: v.clone() for k, v in tierlift.zero.full_state_dict(model).items()}
    o = tierlift.optim.AdamW(model.parameters(), amsgrad=True, offload="cpu")
    with pytest.raises(ValueError, match=r"no \[.max_exp_avg_sq.\] .*amsgrad=False"):
        tierlift.checkpoint.load(ck, model, o)
    after = tierlift.zero.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---- resharding: saved on 2 ranks, loaded on 1 and on 3 -----------------------------------
def _full_state(path: str) -> dict:
    """{(unit, kind): the unit's whole flat state, (unit, "step"): step} from a checkpoint's
    streamed files, concatenated over its ranks (test-side reader, small models only)."""
    meta = tierlift.checkpoint.io.fmt.read_metadata(path)
    parts: dict = {}
    for r in range(meta["world_size"]):
        d = os.path.join(path, f"rank{r:05d}.optim")
        sj = tierlift.checkpoint.stream.read_state_json(d)
        for gi, g in enumerate(sj["groups"]):
            for e in g["params"]:
                i = int(e["name"][len("unit"):])
                parts.setdefault((i, "step"), set()).add(e["step"])
                for k in g["kinds"]:
                    a = np.fromfile(os.path.join(d, f"g{gi}.{k}.f32"), dtype=np.float32)
                    parts.setdefault((i, k), []).append(a[e["offset"]:e["offset"] + e["numel"]])
    out = {}
    for (i, k), v in parts.items():
        numel = meta["units"][i]["numel"]
        out[(i, k)] = v if k == "step" else torch.from_numpy(np.concatenate(v)[:numel].copy())
    return out


def _assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if key[1] == "step":
            assert a[key] == b[key] and len(a[key]) == 1, key
        else:
            assert torch.equal(a[key], b[key]), key


def _save2(rank, world, port, root):
    init_gloo(rank, world, port)
    nvme = os.path.join(root, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    model, opt = _fresh(nvme, "nvme", True, cpu_budget=100_000)
    train(model, opt, DATA[:3], accum=1, clip=1.0, world=world, rank=rank, zero=True)
    tierlift.checkpoint.save(os.path.join(root, "ck"), model, opt)
    opt.close()
    shutdown()


def _load3(rank, world, port, root):
    init_gloo(rank, world, port)
    nvme = os.path.join(root, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    model, opt = _fresh(nvme, "nvme", True, cpu_budget=80_000)
    tierlift.checkpoint.load(os.path.join(root, "ck"), model, opt)
    tierlift.checkpoint.save(os.path.join(root, "ck3"), model, opt)  # what it loaded
    opt.close()
    shutdown()


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("w2"))
    mp.spawn(_save2, args=(2, free_port(), root), nprocs=2)
    return root


@pytest.mark.parametrize("tier", ["nvme", "cpu"])
def test_two_ranks_to_one_loads_the_exact_state(saved_on_two, tmp_path, tier):
    ck = os.path.join(saved_on_two, "ck")
    torch.set_num_threads(1)
    extra = dict(cpu_budget=60_000) if tier == "nvme" else {}
    model, opt = _fresh(tmp_path, tier, True, **extra)
    tierlift.checkpoint.load(ck, model, opt)
    got = str(tmp_path / "ck1")
    tierlift.checkpoint.save(got, model, opt)
    _assert_same_state(_full_state(got), _full_state(ck))
    full = tierlift.checkpoint.full_state_dict(ck)
    mine = tierlift.zero.full_state_dict(model)
    assert all(torch.equal(full[k], mine[k]) for k in full)
    opt.close()


def test_two_ranks_to_three_loads_the_exact_state(saved_on_two):
    mp.spawn(_load3, args=(3, free_port(), saved_on_two), nprocs=3)
    ck, ck3 = (os.path.join(saved_on_two, n) for n in ("ck", "ck3"))
    assert tierlift.checkpoint.io.fmt.read_metadata(ck3)["world_size"] == 3
    _assert_same_state(_full_state(ck3), _full_state(ck))
    a, b = tierlift.checkpoint.full_state_dict(ck), tierlift.checkpoint.full_state_dict(ck3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resharding_load_failing_half_way_changes_nothing(saved_on_two, tmp_path,
                                                            monkeypatch):
    model, opt = _fresh(tmp_path, "cpu", True)
    _train(model, opt, DATA[:2], True)
    before = _snapshot(model, opt, True)
    _fail_after(monkeypatch, 5, "eio")
    with pytest.raises(OSError, match="injected"):
        tierlift.checkpoint.load(os.path.join(saved_on_two, "ck"), model, opt)
    _assert_same(_snapshot(model, opt, True), before)


# ---- peak RSS of a resharding load: the state streams, it is never built in RAM ------------
WIDTH = 1024  # two 1024x1024 linear units: 2.1M parameters, 25 MiB of fp32 master, m and v


def _big_model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))


def _save_big(rank, world, port, root):
    init_gloo(rank, world, port)
    nvme = os.path.join(root, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    model = tierlift.zero.shard(_big_model(), stage=3)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="nvme", nvme_path=nvme,
                               cpu_budget=2 << 20)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, WIDTH, generator=g)).pow(2).mean().backward()
        opt.step()
    tierlift.checkpoint.save(os.path.join(root, "ck"), model, opt)
    opt.close()
    shutdown()


_RSS = r"""
root, budget, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(7)  # _big_model()
lin = torch.nn.Linear
model = tierlift.zero.shard(torch.nn.Sequential(lin(width, width), lin(width, width)), stage=3)
opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="nvme", nvme_path=root,
                           cpu_budget=budget)
print(growth(lambda: tierlift.checkpoint.load(os.path.join(root, "ck"), model, opt)))
"""


def test_a_resharding_load_stays_within_the_budget(tmp_path):
    root = str(tmp_path)
    mp.spawn(_save_big, args=(2, free_port(), root), nprocs=2)
    budget = 4 << 20
    growth = int(rss_probe.run(_RSS, root, budget, WIDTH).split()[-1])
    n = 2 * (WIDTH * WIDTH + WIDTH)
    print(f"peak RSS growth of a 2 -> 1 load: {growth / 2**20:.1f} MiB (state "
          f"{12 * n / 2**20:.1f} MiB, budget {budget / 2**20:.0f} MiB)")
    # The pool (budget), the saved parameter shards (mapped file pages: the model, 4 bytes per
    # parameter), one unit's new parameter shard, and interpreter noise. Materializing the
    # state (as the load did before it streamed) is 46 MiB on this test.
    unit = 4 * n // 2
    assert growth <= budget + 4 * n + unit + (6 << 20), growth


# ---- a state dict into offloaded tiers (Offloader.ingest) -----------------------------------
@pytest.mark.parametrize("tier", list(TIERS))
def test_a_state_dict_load_failing_half_way_changes_nothing(tmp_path, monkeypatch, tier):
    model, opt = _fresh(tmp_path, tier, False)
    _train(model, opt, DATA[:2], False)
    params = opt.param_groups[0]["params"]
    loaded = {params[i]: {k: v for k, v in st.items() if k != "step"}
              for i, st in opt.state_dict()["state"].items()}
    _train(model, opt, DATA[2:4], False)
    before = _snapshot(model, opt, False)
    last = params[max(i for i, p in enumerate(params) if p in loaded)]
    bad = {**loaded, last: {**loaded[last], "exp_avg": loaded[last]["exp_avg"][:-1]}}
    with pytest.raises(ValueError, match=r"'exp_avg' of param_groups\[0\]\['params'\]"):
        opt._offload.ingest(bad)  # the bad one is the last: found before the first change
    _assert_same(_snapshot(model, opt, False), before)
    if tier == "nvme":  # a drive that fails (fills up) half-way through the writes
        from tierlift.offload.tiers import NvmeTier

        real, calls = NvmeTier.write_all, [0]

        def full(self, ci, bufs, gen):
            calls[0] += 1
            if calls[0] > 2:
                raise OSError(errno.ENOSPC, "injected: no space left on device")
            return real(self, ci, bufs, gen)

        monkeypatch.setattr(NvmeTier, "write_all", full)
        with pytest.raises(OSError, match="injected"):
            opt._offload.ingest(loaded)
        assert calls[0] == 3
        _assert_same(_snapshot(model, opt, False), before)
        monkeypatch.undo()
        opt._offload.ingest(loaded)  # and it loads once the drive has room
    opt.close()


def test_a_state_dict_checkpoint_that_does_not_fit_the_optimizer_changes_nothing(tmp_path):
    model = make_model(seed=5)
    opt = tierlift.optim.AdamW(model.parameters(), **OPT)  # state in RAM: "tensors"
    _train(model, opt, DATA[:2], False)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    m = make_model(seed=6)
    # a parameter outside the model (matched by position, unnamed) where tok.weight was
    ps, outside = list(m.parameters()), torch.nn.Parameter(torch.zeros(3))
    o = tierlift.optim.AdamW([ps[0], outside, *ps[2:]], **OPT, offload="cpu")
    _train(m, o, DATA[2:3], False)
    before = _snapshot(m, o, False)
    with pytest.raises(ValueError, match="does not match the optimizer: the state 'exp_avg'"):
        tierlift.checkpoint.load(ck, m, o)
    _assert_same(_snapshot(m, o, False), before)
