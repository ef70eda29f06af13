"""ZeRO stages 1/2/3 on 2 and 4 gloo ranks against single-process training of the same model.

One spawn per world size runs every configuration (process start-up dominates on a 2-core
machine); the tests then compare what the ranks wrote back. Exactness: each rank averages
gradients of its slice of the batch, so the only difference from the single-process run is the
order of fp32 sums (1e-5 relative after 20 AdamW steps)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import tierlift
from zero_model import batches, free_port, init_gloo, make_model, train

STEPS, BATCH = 20, 8
CONFIGS = {
    # name: (stage, accum, clip, twice, extra shard kwargs)
    "s1": (1, 1, None, False, {}),
    "s2": (2, 1, None, False, {}),
    "s3": (3, 1, None, False, {}),
    "s1-acc-clip": (1, 2, 0.5, False, {}),
    "s2-acc-clip": (2, 2, 0.5, False, {}),
    "s3-acc-clip": (3, 2, 0.5, False, {}),
    "s3-twice-noprefetch": (3, 1, 0.5, True, {"prefetch": 0}),
    "s3-keep-after-forward": (3, 2, None, False, {"reshard_after_forward": False}),
}
WORLD4 = ["s1-acc-clip", "s2-acc-clip", "s3-acc-clip"]
OPT = dict(lr=3e-3, weight_decay=0.1)


def _bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


def _run_config(rank, world, name):
    stage, accum, clip, twice, kwargs = CONFIGS[name]
    model = tierlift.zero.shard(make_model(), stage=stage, **kwargs)
    state = model._tierlift_zero
    peak = {"params": 0}

    def track(*_):
        live = _bytes([u.shard for u in state.units])
        live += sum(u.full_bytes for u in state.units)
        peak["params"] = max(peak["params"], live)

    for u in state.units:
        u.module.register_forward_hook(track)
    opt = tierlift.optim.AdamW(model.parameters(), **OPT)
    losses = train(model, opt, batches(STEPS, BATCH), accum=accum, clip=clip, world=world,
                   rank=rank, zero=True, twice=twice)
    # Bytes after a backward, before the optimizer clears anything.
    seq = batches(1, BATCH, seed=7)[0].chunk(world)[rank]
    model(seq[:, :-1]).float().pow(2).mean().backward()
    mem = {
        "params_between_steps": _bytes([u.shard for u in state.units])
        + sum(u.full_bytes for u in state.units),
        "params_peak": peak["params"],
        "grads": _bytes([u.shard.grad for u in state.units])
        + _bytes([u.full.grad for u in state.units]) + _bytes([u.full_grad for u in state.units]),
        "optim": sum(_bytes(v for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
                     for s in opt.state.values()),
        "unit_bytes": [u.padded * 4 for u in state.units],
    }
    sd = tierlift.zero.full_state_dict(model)
    return {"losses": losses, "state": sd, "mem": mem}


def _worker(rank, world, port, names, out):
    init_gloo(rank, world, port)
    results = {n: _run_config(rank, world, n) for n in names}
    if rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


def _spawn(world, names, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"zero{world}") / "results.pt"
    mp.spawn(_worker, args=(world, free_port(), names, str(out)), nprocs=world)
    return torch.load(out, weights_only=True)


def _reference(name):
    stage, accum, clip, twice, _ = CONFIGS[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra threads only contend on a shared 2-core box
    try:
        model = make_model()
        opt = tierlift.optim.AdamW(model.parameters(), **OPT)
        losses = train(model, opt, batches(STEPS, BATCH), accum=accum, clip=clip, twice=twice)
    finally:
        torch.set_num_threads(threads)
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(2, list(CONFIGS), tmp_path_factory)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _spawn(4, WORLD4, tmp_path_factory)


def _compare(result, name):
    ref_losses, ref_state = _reference(name)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=0)
    assert list(result["state"]) == list(ref_state), "full_state_dict keys/order differ"
    for key, ref in ref_state.items():
        torch.testing.assert_close(result["state"][key], ref, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_process_world2(world2, name):
    _compare(world2[name], name)


@pytest.mark.parametrize("name", WORLD4)
def test_matches_single_process_world4(world4, name):
    _compare(world4[name], name)


def _total_param_bytes():
    model = make_model()
    return sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_bytes(world, world2, world4):
    results = {2: world2, 4: world4}[world]
    total = _total_param_bytes()
    for name, r in results.items():
        stage = CONFIGS[name][0]
        mem = r["mem"]
        pad = 4 * world * len(mem["unit_bytes"])  # at most world-1 padding elements per unit
        largest = max(mem["unit_bytes"])
        # Optimizer state: exp_avg + exp_avg_sq of this rank's shard only, at every stage.
        assert mem["optim"] <= 2 * (total / world + pad), (name, mem)
        if stage >= 2:
            # Gradients: the shard plus at most one unit in flight.
            assert mem["grads"] <= total / world + pad + largest, (name, mem)
        if stage == 3 and CONFIGS[name][4].get("reshard_after_forward", True):
            assert mem["params_between_steps"] <= total / world + pad, (name, mem)
            # During forward the root (tied embedding/head) and the running unit are gathered,
            # plus the prefetched one.
            root = mem["unit_bytes"][-1]
            assert mem["params_peak"] <= total / world + pad + root + 2 * largest, (name, mem)
