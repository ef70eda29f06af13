"""Hierarchical ZeRO-3 across two "nodes" of two ranks each: two torchrun agents on this
machine meeting at a c10d rendezvous, as on a two-node cluster. Same losses as plain ZeRO-3 on
four ranks and as one process; far fewer bytes across nodes; quantized cross-node gradients;
a checkpoint saved on 2x2 loading on 1x2 and 1x4; a node killed mid-step named by the
survivors."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tierlift.plan.comm import CommLayout, inter_node_bytes_per_rank

TRAIN = textwrap.dedent("""
    import tierlift
    from zero_model import batches, make_model, train
    out = {{}}
    runs = [("hier", dict(hierarchy="node")), ("plain", {{}}),
            ("int8", dict(hierarchy="node", grad_comm="int8")),
            ("fp8", dict(hierarchy="node", grad_comm="fp8")),
            ("hier-stage1", dict(hierarchy="node", stage=1)),
            ("hier-stage2", dict(hierarchy="node", stage=2))]
    for name, kw in runs:
        kw.setdefault("stage", 3)
        model = tierlift.zero.shard(make_model(), **kw)
        opt = tierlift.optim.AdamW(model.parameters(), lr=3e-3)
        losses = train(model, opt, batches(4, 8), accum=2, clip=0.5, world=world, rank=rank,
                       zero=True)
        st = model._tierlift_zero
        out[name] = dict(losses=torch.tensor(losses), sent=tierlift.zero.last_step_stats(model),
                         shard_world=st.comm.world,
                         shard_numels=[u.shard_numel for u in st.units if not u.frozen],
                         frozen_numels=[u.shard_numel for u in st.units if u.frozen])
        if name == "hier":
            tierlift.checkpoint.save({ckpt!r}, model, opt)
""")

# Run in TRAIN's job (one torchrun start for both): 100 steps of a learnable task on 2x2 ranks,
# fp32 and quantized cross-node gradients.
CONVERGE_STEPS = 100
CONVERGE = textwrap.dedent("""
    from zero_model import VOCAB, SEQ

    def pattern_batches(steps, batch):
        # Learnable sequences: each token follows from the previous one, one in five is noise.
        g = torch.Generator().manual_seed(3)
        out = []
        for _ in range(steps):
            x = torch.empty(batch, SEQ + 1, dtype=torch.long)
            x[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
            for t in range(SEQ):
                x[:, t + 1] = (7 * x[:, t] + 3) % VOCAB
            noise = torch.rand(batch, SEQ + 1, generator=g) < 0.2
            x[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)
            out.append(x)
        return out

    data = pattern_batches({steps}, 8)
    out["converge"] = {{}}
    for mode in (None, "int8", "fp8"):
        model = tierlift.zero.shard(make_model(), stage=3, hierarchy="node", grad_comm=mode)
        opt = tierlift.optim.AdamW(model.parameters(), lr=3e-3)
        out["converge"][str(mode)] = torch.tensor(train(model, opt, data, accum=1, clip=1.0,
                                                        world=world, rank=rank, zero=True))
""")

LOAD = textwrap.dedent("""
    import tierlift
    from zero_model import batches, make_model, train
    model = tierlift.zero.shard(make_model(seed=5), stage=3)
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-3)
    tierlift.checkpoint.load({ckpt!r}, model, opt)
    sd = tierlift.zero.full_state_dict(model)
    losses = train(model, opt, batches(2, 8, seed=7), accum=2, clip=0.5, world=world,
                   rank=rank, zero=True)
    out = dict(sd=sd, losses=torch.tensor(losses))
""")


def _reference(steps_after: int = 0):
    from zero_model import batches, make_model, train

    import tierlift

    torch.set_num_threads(1)
    model = make_model()
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-3)
    losses = train(model, opt, batches(4, 8), accum=2, clip=0.5)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    more = train(model, opt, batches(2, 8, seed=7), accum=2, clip=0.5) if steps_after else []
    return losses, sd, more


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    from zero_model import run_torchrun

    root = tmp_path_factory.mktemp("hier")
    ckpt = root / "ckpt"
    out = run_torchrun(TRAIN + CONVERGE, root, timeout=400, nnodes=2, nproc=2, ckpt=str(ckpt),
                       steps=CONVERGE_STEPS)
    return out, ckpt


def test_hierarchical_matches_plain_and_one_process(two_by_two):
    out, _ = two_by_two
    ref, _, _ = _reference()
    assert out["hier"]["shard_world"] == 2 and out["plain"]["shard_world"] == 4
    torch.testing.assert_close(out["hier"]["losses"], torch.tensor(ref), rtol=1e-5, atol=0)
    for name in ("plain", "hier-stage1", "hier-stage2"):
        torch.testing.assert_close(out[name]["losses"], torch.tensor(ref), rtol=1e-5, atol=0)


def test_cross_node_bytes(two_by_two):
    out, _ = two_by_two
    hier, plain, int8 = (out[k]["sent"] for k in ("hier", "plain", "int8"))
    # Hierarchical: gathers and reduce-scatters stay inside the node; across nodes only the
    # fp32 all-reduce of each gradient shard (both halves to the one peer on the other node),
    # plus a few scalars (the step's skip vote).
    grads = sum(2 * -(-n // 2) * 4 for n in out["hier"]["shard_numels"])
    assert grads <= hier["inter_node_bytes"] <= grads + 256
    assert hier["intra_node_bytes"] > 0
    # Plain ZeRO-3 sends its gathers (forward and backward) and reduce-scatters across nodes.
    assert hier["inter_node_bytes"] < plain["inter_node_bytes"] / 4
    # The planner's model (python -m tierlift plan --nodes) counts the same bytes.
    fp32_flat = CommLayout(name="flat", hierarchical=False, weight_bytes=4, grad_bytes=4)
    fp32_hier = CommLayout(name="hier", hierarchical=True, weight_bytes=4, grad_bytes=4)
    params = sum(out["plain"]["shard_numels"]) * 4
    model = inter_node_bytes_per_rank(params, 2, 2, fp32_flat, micro_batches=2)
    # Stage 3 gathers the frozen `pos` too (never reduced).
    frozen = sum(out["plain"]["frozen_numels"]) * 4
    gathers_only = CommLayout(name="frozen", hierarchical=False, weight_bytes=4, grad_bytes=0)
    model += inter_node_bytes_per_rank(frozen, 2, 2, gathers_only, micro_batches=2)
    assert model <= plain["inter_node_bytes"] <= model + 256
    params = sum(out["hier"]["shard_numels"]) * 2
    assert inter_node_bytes_per_rank(params, 2, 2, fp32_hier) == grads
    # int8 codes plus one fp32 scale per 256 values: under a third of the fp32 sum.
    assert int8["inter_node_bytes"] < hier["inter_node_bytes"] / 3
    assert int8["intra_node_bytes"] == hier["intra_node_bytes"]


def test_quantized_gradients_stay_close(two_by_two):
    out, _ = two_by_two
    ref = out["hier"]["losses"]
    for mode in ("int8", "fp8"):
        q = out[mode]["losses"]
        assert not torch.equal(q[1:], ref[1:])  # it did quantize
        torch.testing.assert_close(q, ref, rtol=2e-2, atol=0)


@pytest.mark.parametrize("nproc", [2, 4])
def test_checkpoint_from_2x2_loads_on_one_node(two_by_two, tmp_path, nproc):
    from zero_model import run_torchrun

    _, ckpt = two_by_two
    out = run_torchrun(LOAD, tmp_path, timeout=200, nproc=nproc, ckpt=str(ckpt))
    _, sd, more = _reference(steps_after=2)
    for key, value in sd.items():
        torch.testing.assert_close(out["sd"][key], value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["losses"], torch.tensor(more), rtol=1e-4, atol=0)


KILL = textwrap.dedent("""
    import signal
    import tierlift
    from zero_model import batches, make_model, train
    model = tierlift.zero.shard(make_model(), stage=3, hierarchy="node")
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-3)
    error = None
    try:
        for step, seq in enumerate(batches(6, 8)):
            if step == 2 and os.environ["TEST_AGENT"] == "1":
                os.kill(os.getpid(), signal.SIGKILL)  # the whole second node, mid-run
            train(model, opt, [seq], accum=2, clip=0.5, world=world, rank=rank, zero=True)
    except tierlift.zero.RankFailureError as e:
        error = (type(e).__name__, str(e), step)
    if rank == 0:
        torch.save(error, {out!r})
    os._exit(0)
""")


def test_node_killed_mid_step_is_named(tmp_path):
    from zero_model import run_torchrun

    error = run_torchrun(KILL, tmp_path, timeout=200, nnodes=2, nproc=2, check=False)
    assert error is not None, "the survivors did not raise RankFailureError"
    name, message, step = error
    assert step == 2
    assert "rank 2, 3 stopped answering" in message or "rank 0, 1 stopped answering" in \
        message, message


MESH = textwrap.dedent("""
    import tierlift
    from torch.distributed.device_mesh import init_device_mesh
    from zero_model import batches, make_model, train
    out = {{}}
    for name, shape in [("mesh2", (2, 2)), ("mesh3", (2, 2, 1))]:
        mesh = init_device_mesh("cpu", shape)
        model = tierlift.zero.shard(make_model(), stage=3, mesh=mesh, grad_comm=None)
        opt = tierlift.optim.AdamW(model.parameters(), lr=3e-3)
        losses = train(model, opt, batches(4, 8), accum=2, clip=0.5, world=world, rank=rank,
                       zero=True)
        st = model._tierlift_zero
        out[name] = dict(losses=torch.tensor(losses), legs=[c.world for c in st.topology.legs],
                         crosses=[c.crosses_nodes for c in st.topology.legs],
                         sent=tierlift.zero.last_step_stats(model))
""")


def test_device_mesh_levels(tmp_path):
    """A 2-D mesh is hierarchy='node' spelt out; a 3-D one adds a replicate leg inside the
    node (here shards of one rank, so pairs of ranks in a node replicate and nodes replicate
    those), summed innermost first."""
    from zero_model import run_torchrun

    out = run_torchrun(MESH, tmp_path, timeout=200, nnodes=2, nproc=2)
    ref, _, _ = _reference()
    for name in ("mesh2", "mesh3"):
        torch.testing.assert_close(out[name]["losses"], torch.tensor(ref), rtol=1e-5, atol=0)
    assert out["mesh2"]["legs"] == [2] and out["mesh2"]["crosses"] == [True]
    assert out["mesh3"]["legs"] == [2, 2] and out["mesh3"]["crosses"] == [False, True]


COMPOSE = textwrap.dedent("""
    import tempfile
    import torch.nn.functional as F
    from torch import nn
    import tierlift

    def mlp(fp8):
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                            for _ in range(3)])
        if fp8:
            tierlift.lowp.convert(m, recipe="fp8-tensorwise", min_features=0)
        return m

    def run(model, opt):
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            x, y = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x.chunk(world)[rank]).float(), y.chunk(world)[rank])
            loss.backward()
            opt.step()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        return torch.tensor(losses)

    nvme = tempfile.mkdtemp()
    out = {{}}
    model = tierlift.zero.shard(mlp(False), stage=3, hierarchy="node", offload_params="cpu",
                                min_unit_numel=1)
    out["offload"] = run(model, tierlift.optim.AdamW(model.parameters(), lr=1e-2,
                                                     offload="nvme", nvme_path=nvme,
                                                     overlap=True))
    for name, kw in [("fp8-hier-int8", dict(hierarchy="node", grad_comm="int8")),
                     ("fp8-plain", {{}})]:
        model = tierlift.zero.shard(mlp(True), stage=3, fp8_all_gather=True,
                                    min_unit_numel=1, **kw)
        out[name] = run(model, tierlift.optim.AdamW(model.parameters(), lr=1e-2))
        out[name + "-inter"] = tierlift.zero.last_step_stats(model)["inter_node_bytes"]
""")


def test_composes_with_offload_and_fp8_gather(tmp_path):
    """Hierarchical sharding under parameter offload and an NVMe optimizer with overlap gives
    the plain single-process losses; with FP8 weight gathers and int8 cross-node gradients as
    well (all three ZeRO++ parts) it stays close to plain ZeRO-3 with FP8 gathers."""
    from zero_model import run_torchrun

    import tierlift

    out = run_torchrun(COMPOSE, tmp_path, timeout=200, nnodes=2, nproc=2)
    torch.manual_seed(0)
    ref_model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)) for _ in range(3)])
    opt = tierlift.optim.AdamW(ref_model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    ref = []
    for _ in range(4):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ref_model(x), y)
        loss.backward()
        opt.step()
        ref.append(loss.item())
    torch.testing.assert_close(out["offload"], torch.tensor(ref), rtol=1e-5, atol=0)
    torch.testing.assert_close(out["fp8-hier-int8"], out["fp8-plain"], rtol=2e-2, atol=0)
    assert out["fp8-hier-int8-inter"] < out["fp8-plain-inter"] / 4


def test_quantized_gradients_train_within_one_percent(two_by_two):
    """100 steps of a small GPT on 2x2 ranks: the final loss (mean of the last 20 steps) with
    int8 or fp8 cross-node gradients is within 1% of the fp32-gradient run's. (At 100 steps the
    loss is a fifth of its start; the gap there is 0.08% / 0.04%, and a quantizer broken by hand
    is further off than at 200 steps: codes rounded to 9 levels 4.9% (200 steps: 1.3%), the other
    node's gradients dropped 8.8% (2.9%).)"""
    out = two_by_two[0]["converge"]
    base = out["None"]
    assert len(base) == CONVERGE_STEPS
    assert base[-20:].mean() < 0.6 * base[:5].mean()  # it did learn
    for mode in ("int8", "fp8"):
        gap = abs(out[mode][-20:].mean() / base[-20:].mean() - 1).item()
        print(f"{mode}: final loss {out[mode][-20:].mean():.4f} vs fp32 "
              f"{base[-20:].mean():.4f}, gap {gap:.3%}")
        assert gap < 0.01, (mode, gap)


MESH3 = textwrap.dedent("""
    import tierlift
    from torch.distributed.device_mesh import init_device_mesh
    from zero_model import batches, make_model, train
    mesh = init_device_mesh("cpu", (2, 2, 2))  # nodes, pairs in a node, ranks in a pair
    model = tierlift.zero.shard(make_model(), stage=3, mesh=mesh, grad_comm="int8")
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-3)
    losses = train(model, opt, batches(4, 8), accum=1, clip=0.5, world=world, rank=rank,
                   zero=True)
    st = model._tierlift_zero
    out = dict(losses=torch.tensor(losses), shard=st.comm.world,
               legs=[(c.world, c.crosses_nodes) for c in st.topology.legs],
               quantized=[q is not None for q in st.replicas.quant])
""")


def test_three_levels_two_nodes_of_four(tmp_path):
    """Frontier-style three levels on 2 nodes x 4 ranks: shards within pairs, the pairs of a
    node summed in full precision, the nodes in int8."""
    from zero_model import batches, make_model, run_torchrun, train

    import tierlift

    out = run_torchrun(MESH3, tmp_path, timeout=300, nnodes=2, nproc=4)
    assert out["shard"] == 2
    assert out["legs"] == [(2, False), (2, True)]
    assert out["quantized"] == [False, True]
    torch.set_num_threads(1)
    model = make_model()
    ref = train(model, tierlift.optim.AdamW(model.parameters(), lr=3e-3), batches(4, 8),
                accum=1, clip=0.5)
    torch.testing.assert_close(out["losses"], torch.tensor(ref), rtol=2e-3, atol=0)


@pytest.mark.parametrize("kwargs, error", [
    (dict(hierarchy="rack"), "hierarchy must be"),
    (dict(hierarchy="node"), "needs torch.distributed initialized"),
    (dict(grad_comm="int8"), "pass hierarchy='node' or mesh="),
    (dict(grad_comm="int4"), "grad_comm must be"),
    (dict(mesh=object(), process_group=object()), "mesh= or process_group="),
    (dict(mesh=object(), hierarchy="node"), "mesh= or hierarchy="),
])
def test_bad_arguments(kwargs, error):
    from zero_model import make_model

    import tierlift

    with pytest.raises(ValueError, match=error):
        tierlift.zero.shard(make_model(), stage=3, **kwargs)
