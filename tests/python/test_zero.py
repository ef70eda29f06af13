"""ZeRO stages 1/2/3 on 2 and 4 gloo ranks against single-process training of the same model.

One spawn per world size runs every configuration (process start-up dominates on a 2-core
machine); the tests then compare what the ranks wrote back. Exactness: each rank averages
gradients of its slice of the batch, so the only difference from the single-process run is the
order of fp32 sums (1e-5 relative after 20 AdamW steps)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from zero_model import batches, free_port, init_gloo, make_model, shutdown, train

import tierlift

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
    """Bytes of the distinct storages behind `tensors` (stage 1/2 shards live inside `full`)."""
    storages = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _run_config(rank, world, name):
    stage, accum, clip, twice, kwargs = CONFIGS[name]
    model = tierlift.zero.shard(make_model(), stage=stage, **kwargs)
    state = model._tierlift_zero
    peak = {"params": 0}

    def track(*_):
        live = _bytes([u.shard for u in state.units] + [u.full for u in state.units])
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
        "params_between_steps": _bytes([u.shard for u in state.units]
                                       + [u.full for u in state.units]),
        "params_peak": peak["params"],
        "grads": _bytes([u.shard.grad for u in state.units] + [u.full.grad for u in state.units]
                        + [u.full_grad for u in state.units]),
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
    shutdown()


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
        else:
            # Stage 1 keeps the averaged full gradient; the fp32 shard is a view of it.
            assert mem["grads"] <= total + pad, (name, mem)
        if stage == 3 and CONFIGS[name][4].get("reshard_after_forward", True):
            # Stage 3 shards the frozen `pos` too.
            frozen = make_model().pos.numel() * 4
            assert mem["params_between_steps"] <= (total + frozen) / world + pad, (name, mem)
            # During forward the root (tied embedding/head) and the running unit are gathered,
            # plus the prefetched one.
            root = mem["unit_bytes"][-2] + mem["unit_bytes"][-1]  # trainable and frozen
            assert mem["params_peak"] <= (total + frozen) / world + pad + root + 2 * largest, \
                (name, mem)


# ---- a rank that dies or hangs ----


def _failing_worker(rank, world, port, mode, out):
    import time

    init_gloo(rank, world, port, timeout_s=4.0)
    model = tierlift.zero.shard(make_model(), stage=3)
    opt = tierlift.optim.AdamW(model.parameters(), **OPT)
    data = batches(3, BATCH)
    try:
        train(model, opt, data[:2], accum=1, clip=None, world=world, rank=rank, zero=True)
        if rank == 1:
            if mode == "dies":
                import os

                os._exit(3)
            time.sleep(30)  # hangs
        train(model, opt, data[2:], accum=1, clip=None, world=world, rank=rank, zero=True)
    except tierlift.zero.RankFailureError as exc:
        with open(out, "w") as f:
            f.write(str(exc))


@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_dead_rank_is_named(mode, tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = tmp_path / "error.txt"
    port = free_port()
    procs = [ctx.Process(target=_failing_worker, args=(r, 2, port, mode, str(out)))
             for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(timeout=60)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert out.exists(), "rank 0 did not report the failure"
    text = out.read_text()
    assert "rank 1 stopped answering" in text, text


# ---- API errors and single-process use ----


def test_shard_bad_arguments():
    with pytest.raises(ValueError, match="stage"):
        tierlift.zero.shard(make_model(), stage=4)
    with pytest.raises(TypeError, match="model"):
        tierlift.zero.shard("not a model", stage=1)
    with pytest.raises(ValueError, match="prefetch"):
        tierlift.zero.shard(make_model(), stage=3, prefetch=-1)
    with pytest.raises(TypeError, match="mixed_precision"):
        tierlift.zero.shard(make_model(), stage=3, mixed_precision=torch.bfloat16)
    with pytest.raises(TypeError, match="param_dtype"):
        tierlift.zero.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"units\[0\]"):
        tierlift.zero.shard(make_model(), stage=3, units=["nope"])
    with pytest.raises(ValueError, match="nested"):
        tierlift.zero.shard(make_model(), stage=3, units=["blocks", "blocks.0"])
    with pytest.raises(TypeError, match="unexpected keyword"):
        tierlift.zero.MixedPrecision(param_type=torch.bfloat16)
    model = tierlift.zero.shard(make_model(), stage=2)
    with pytest.raises(ValueError, match="already sharded"):
        tierlift.zero.shard(model, stage=2)
    with pytest.raises(ValueError, match="not sharded"):
        tierlift.zero.clip_grad_norm_(make_model(), 1.0)
    with pytest.raises(ValueError, match="max_norm"):
        tierlift.zero.clip_grad_norm_(model, float("nan"))


def test_default_units_are_blocks():
    names = tierlift.zero.default_units(make_model())
    assert names == ["tok", "blocks.0", "blocks.1", "blocks.2", "head"]
    # tok and head share their weight, so it goes to the root unit with ln_f.
    # The frozen `pos` is sharded at stage 3 too, in a root unit of its own.
    model = tierlift.zero.shard(make_model(), stage=3)
    assert [(u.name, u.frozen) for u in model._tierlift_zero.units] == [
        ("blocks.0", False), ("blocks.1", False), ("blocks.2", False), ("<root>", False),
        ("<root>", True)]


@pytest.mark.parametrize("stage", [2, 3])
def test_parameters_are_shards_and_frozen(stage):
    model = tierlift.zero.shard(make_model(), stage=stage)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    assert len(trainable) == 4 and all(p.dim() == 1 and p.dtype == torch.float32
                                       for p in trainable)
    frozen = [p for p in params if not p.requires_grad]
    if stage == 2:  # replicated
        assert frozen == [model.pos]
    else:
        assert len(frozen) == 1 and frozen[0].shape == (model.pos.numel(),)


def test_stage1_gradient_shard_is_a_view_and_accumulates():
    """Stage 1's fp32 shard gradient is a view of the kept full gradient (one buffer, not
    two); two synced backwards still sum exactly as stage 2's copied shards do, and the first
    backward's buffer is let go."""
    grads = {}
    for stage in (1, 2):
        model = tierlift.zero.shard(make_model(), stage=stage)
        seq = batches(2, 4)
        for s in seq:
            F.cross_entropy(model(s[:, :-1]).flatten(0, 1), s[:, 1:].flatten()).backward()
        units = model._tierlift_zero.units
        grads[stage] = [u.shard.grad.clone() for u in units]
        if stage == 1:
            for u in units:
                assert u.shard.grad.untyped_storage().data_ptr() == \
                    u.full_grad.untyped_storage().data_ptr()
    for a, b in zip(grads[1], grads[2], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_single_process_bf16_trains(stage):
    # World of one without init_process_group; bf16 compute, fp32 master shards.
    torch.set_num_threads(1)
    mp_cfg = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.float32)
    model = tierlift.zero.shard(make_model(), stage=stage, mixed_precision=mp_cfg)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train(model, opt, batches(8, 4), accum=2, clip=1.0, zero=True)
    assert losses[-1] < losses[0]
    ref_model = make_model()
    ref = train(ref_model, tierlift.optim.AdamW(ref_model.parameters(), lr=1e-2),
                batches(8, 4), accum=2, clip=1.0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=3e-2, atol=0)
    sd = tierlift.zero.full_state_dict(model)
    assert sd["tok.weight"].dtype == torch.float32 and sd["head.weight"] is sd["tok.weight"]


def test_fp16_loss_scaler_skips_overflow(caplog):
    import torch.nn.functional as F

    torch.set_num_threads(1)
    mp_cfg = tierlift.zero.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    model = tierlift.zero.shard(make_model(), stage=3, mixed_precision=mp_cfg)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2)
    # 2**40 overflows fp16 gradients: the first steps are skipped until the scale is sane.
    scaler = tierlift.zero.LossScaler(model, tierlift.zero.LossScalerConfig(
        init_scale=2.0**40, backoff_factor=2.0**-8))
    before = tierlift.zero.full_state_dict(model)["blocks.0.fc.weight"].clone()
    ran = []
    losses = []
    for seq in batches(8, 4):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(seq[:, :-1]).float().flatten(0, 1), seq[:, 1:].flatten())
        scaler.scale(loss).backward()
        scaler.unscale_()
        tierlift.zero.clip_grad_norm_(model, 1.0)
        ran.append(scaler.step(opt))
        losses.append(loss.item())
        if not ran[-1] and len(ran) == 1:
            after = tierlift.zero.full_state_dict(model)["blocks.0.fc.weight"]
            assert torch.equal(after, before), "a skipped step changed the weights"
    assert ran[0] is False and scaler.skipped_steps >= 1 and any(ran)
    assert scaler.scale_value < 2.0**40
    assert "skipped an optimizer step" in caplog.text
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="backoff_factor"):
        tierlift.zero.LossScalerConfig(backoff_factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_world1_matches_plain_training(stage):
    def run(zero):
        model = make_model().cuda()
        if zero:
            tierlift.zero.shard(model, stage=stage)
        opt = tierlift.optim.AdamW(model.parameters(), **OPT)
        data = [b.cuda() for b in batches(6, BATCH)]
        losses = train(model, opt, data, accum=2, clip=0.5, zero=zero)
        sd = tierlift.zero.full_state_dict(model) if zero else model.state_dict()
        return losses, sd

    losses, sd = run(True)
    ref_losses, ref_sd = run(False)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for key, ref in ref_sd.items():
        torch.testing.assert_close(sd[key], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_bf16_stage3_trains():
    mp_cfg = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = tierlift.zero.shard(make_model().cuda(), stage=3, mixed_precision=mp_cfg)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train(model, opt, [b.cuda() for b in batches(8, 4)], accum=2, clip=1.0, zero=True)
    assert losses[-1] < losses[0]
    assert all(u.full_bytes == 0 for u in model._tierlift_zero.units)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torch_optimizer_and_named_units(stage):
    # A torch optimizer steps the shards too; user-named units (a module object and a name).
    torch.set_num_threads(1)
    model = make_model()
    tierlift.zero.shard(model, stage=stage, units=[model.blocks[0], "blocks.2"])
    # Stage 3 adds a root unit for the frozen `pos`.
    assert [u.name for u in model._tierlift_zero.units] == ["blocks.0", "blocks.2", "<root>"] \
        + ["<root>"] * (stage == 3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    losses = train(model, opt, batches(5, 4), accum=1, clip=None, zero=True)
    ref_model = make_model()
    ref = train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=3e-3, foreach=False),
                batches(5, 4), accum=1, clip=None)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)
    sd = tierlift.zero.full_state_dict(model)
    for key, value in ref_model.state_dict().items():
        torch.testing.assert_close(sd[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_load_full_state_dict(stage):
    torch.set_num_threads(1)
    donor = make_model(seed=9)
    model = tierlift.zero.shard(make_model(), stage=stage)
    idx = batches(1, 2)[0][:, :-1]
    model(idx)  # stage 1: gathered weights exist and must be refreshed by the load
    tierlift.zero.load_full_state_dict(model, donor.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(idx), donor(idx), rtol=1e-6, atol=1e-6)
    sd = tierlift.zero.full_state_dict(model)
    assert all(torch.equal(sd[k], v) for k, v in donor.state_dict().items())
    bad = donor.state_dict()
    bad["blocks.1.fc.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"blocks\.1\.fc\.weight"):
        tierlift.zero.load_full_state_dict(model, bad)


def test_load_full_state_dict_rejects_without_changing():
    model = tierlift.zero.shard(make_model(), stage=3)
    before = tierlift.zero.full_state_dict(model)
    bad = make_model(seed=9).state_dict()
    bad["ln_f.bias"] = torch.zeros(7)  # the root unit is loaded last: nothing may be loaded
    with pytest.raises(ValueError, match=r"ln_f\.bias"):
        tierlift.zero.load_full_state_dict(model, bad)
    after = tierlift.zero.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


class _Checkpointed(torch.nn.Module):
    """Runs `inner` under activation checkpointing: backward calls inner(...) again."""

    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _checkpointed_model(reentrant):
    model = make_model()
    model.blocks = torch.nn.ModuleList(_Checkpointed(b, reentrant) for b in model.blocks)
    return model


@pytest.mark.parametrize("reentrant", [False, True])
def test_stage3_with_activation_checkpointing(reentrant):
    torch.set_num_threads(1)
    units = [f"blocks.{i}.inner" for i in range(3)]  # the recomputed modules are the units
    model = tierlift.zero.shard(_checkpointed_model(reentrant), stage=3, units=units)
    opt = tierlift.optim.AdamW(model.parameters(), **OPT)
    losses = train(model, opt, batches(4, 4), accum=1, clip=None, zero=True)
    ref_model = _checkpointed_model(reentrant)
    ref = train(ref_model, tierlift.optim.AdamW(ref_model.parameters(), **OPT), batches(4, 4),
                accum=1, clip=None)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)
    sd = tierlift.zero.full_state_dict(model)
    for key, value in ref_model.state_dict().items():
        torch.testing.assert_close(sd[key], value, rtol=1e-5, atol=1e-6)
    assert all(u.full_bytes == 0 for u in model._tierlift_zero.units)


def test_recovers_from_a_failed_backward():
    torch.set_num_threads(1)
    model = tierlift.zero.shard(make_model(), stage=3)
    seq = batches(1, 4)[0]
    out = model(seq[:, :-1])

    def boom(grad):
        raise RuntimeError("boom")

    out.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        out.float().pow(2).mean().backward()
    opt = tierlift.optim.AdamW(model.parameters(), **OPT)
    losses = train(model, opt, batches(3, 4), accum=1, clip=None, zero=True)
    ref_model = make_model()
    ref = train(ref_model, tierlift.optim.AdamW(ref_model.parameters(), **OPT), batches(3, 4),
                accum=1, clip=None)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)
    assert all(u.full_bytes == 0 for u in model._tierlift_zero.units)
