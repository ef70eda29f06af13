"""Paths that run only on a GPU, checked here on the CPU through stand-ins (and on the device
by the `gpu` tests):

- activations: a forward's RAM-tier copies still in flight when its graph is dropped before
  backward (a step given up on a NaN loss, an evaluation with grad), and backward's NVMe
  read-ahead queue when a backward stops above tensors it read ahead (backward(inputs=...),
  grad() of part of the graph). Both held saved-tensor records, which hold the forward's
  session: a cycle that only the garbage collector's next full pass freed, with the spill file,
  its descriptors, the pinned buffers and the GPU tensors. On the CPU nothing is in flight.
  The `gpu` tests also check an in-place edit raced by a side-stream copy, on real streams.
- GradScaler over tierlift.zero: the found-inf agreement of one optimizer over models on two
  devices runs each model's collective on that model's device.
- copy.deepcopy of a CUDA FeatureStore: an independent store, not a pickled (rowless) one.
- offloaded AdamW over channels_last and transposed parameters on their device, as torch's
  AdamW, layout kept, optimizer.state[p].items() reading torch's moments.
- FeatureStore on each device: features given new memory refused, share_memory_() not a change
  (a pin="inplace" CUDA store: the same rows or a refusal).
- a converted nn.TransformerEncoderLayer in bf16 eval runs its FP8 linears, not the fused path."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conformance_util import CHUNK, assert_matches_torch
from test_activations_user import SideStreamCopier, spill_fds
from test_lowp_idioms import _no_fast_path
from test_offload_user_idioms import HYPER, Net
from torch import nn

import tierlift
import tierlift.activations.session as session_module
from tierlift._shards import any_rank_found
from tierlift.activations import offload
from tierlift.activations.device import CpuCopier, CudaCopier, Layout
from tierlift.gnn import FeatureStore
from tierlift.lowp import Float8Linear, convert
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


@contextlib.contextmanager
def no_gc():
    """Only reference counts free anything inside."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def watched_sessions(ctx: offload) -> list:
    """Weak references to the sessions `ctx` opens from now on."""
    refs = []
    make = ctx.session

    def session():
        s = make()
        refs.append(weakref.ref(s))
        return s

    ctx.session = session
    return refs


def test_a_forward_dropped_with_copies_in_flight_frees_its_session_and_spill_at_once(
        monkeypatch, tmp_path):
    copier = SideStreamCopier()
    monkeypatch.setattr(session_module, "copier_for", lambda device: copier)
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    # The first saved tensor fits the RAM tier (its copy stays queued: the saves after it go
    # to NVMe, which a CPU tensor reaches without the copier); the rest spill.
    ctx = offload(cpu_budget=64 * 64 * 4, nvme_path=tmp_path, min_bytes=0)
    sessions = watched_sessions(ctx)
    with no_gc():
        with ctx:
            a = torch.tanh(torch.randn(64, 64) @ w)
            loss = (torch.tanh(a @ w) ** 2).sum()
        del a
        stats = dict(ctx.last_stats)
        assert copier.queued and stats["ram_bytes"] > 0 and stats["nvme_bytes"] > 0, stats
        assert spill_fds(tmp_path) == 3  # the file and the engine's two descriptors of it
        del loss
        assert sessions[0]() is None, "the session outlived its graph"
        assert spill_fds(tmp_path) == 0, "the spill file outlived its graph"
    # The same context still trains exactly.
    copier.flush()
    want = torch.autograd.grad((torch.tanh(torch.tanh(torch.ones(64, 64) @ w) @ w) ** 2).sum(),
                               w)[0]
    with ctx:
        loss = (torch.tanh(torch.tanh(torch.ones(64, 64) @ w) @ w) ** 2).sum()
    copier.flush()
    assert torch.equal(torch.autograd.grad(loss, w)[0], want)
    ctx.close()


class LandsWhenWaited:
    """An NVMe read still in flight: done only once waited for, as a read that has not
    landed when backward stops."""

    def __init__(self, handle):
        self.handle, self.waited = handle, False

    def done(self):
        return self.waited

    def wait(self):
        self.waited = True
        return self.handle.wait()


def on_gpu(t):
    """Every saved tensor's layout says cuda, so its NVMe reads take the GPU's read-ahead
    queue (read, then H2D by the copier stand-in) while the bytes stay on the CPU."""
    return dataclasses.replace(Layout.of(t), device=torch.device("cuda"))


def test_a_backward_that_stops_with_reads_ahead_in_flight_frees_its_session_and_spill_at_once(
        monkeypatch, tmp_path):
    # grad() of part of the graph (or backward(inputs=...)) stops above the first layers, whose
    # saved tensors were read ahead: on a GPU their reads wait in a queue that held the records,
    # which hold the session, until the garbage collector's next full pass.
    monkeypatch.setattr(session_module, "copier_for", lambda device: CpuCopier())
    monkeypatch.setattr(session_module, "Layout", SimpleNamespace(of=on_gpu))
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64)
    ctx = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=0)
    engine = ctx._engines.get()
    read = engine.read
    monkeypatch.setattr(engine, "read", lambda *a: LandsWhenWaited(read(*a)))
    sessions = watched_sessions(ctx)
    a = torch.tanh(x @ w)
    want, = torch.autograd.grad((torch.tanh(a @ w) ** 2).sum(), a)
    with no_gc():
        with ctx:
            a = torch.tanh(x @ w)
            loss = (torch.tanh(a @ w) ** 2).sum()
        assert ctx.last_stats["nvme_bytes"] > 0 and spill_fds(tmp_path) == 3
        got, = torch.autograd.grad(loss, a)
        assert torch.equal(got, want)
        assert ctx.last_stats["reads_ahead"] > 0, ctx.last_stats
        session = sessions[0]()
        assert session is not None and session._reading, "no read ahead left in flight"
        del session
        del loss, a
        assert sessions[0]() is None, "the session outlived its graph"
        assert spill_fds(tmp_path) == 0, "the spill file outlived its graph"
    # The same context still trains exactly, its reads landing on their own.
    monkeypatch.setattr(engine, "read", read)
    want = torch.autograd.grad((torch.tanh(torch.tanh(x @ w) @ w) ** 2).sum(), w)[0]
    with ctx:
        loss = (torch.tanh(torch.tanh(x @ w) @ w) ** 2).sum()
    assert torch.equal(torch.autograd.grad(loss, w)[0], want)
    ctx.close()


# ---- on the GPU --------------------------------------------------------------------------------

SPIN = 20_000_000  # GPU cycles (~10 ms) the side stream spends before each copy to host


class SlowSideStream(CudaCopier):
    """The real side-stream copier, whose stream is busy before each copy: the compute stream
    runs on meanwhile, as it does whenever the copies fall behind."""

    def to_host(self, t, host):
        with torch.cuda.stream(self.d2h):
            torch.cuda._sleep(SPIN)
        return super().to_host(t, host)


@pytest.fixture
def slow_side_stream(monkeypatch):
    monkeypatch.setattr(session_module, "copier_for",
                        lambda d: SlowSideStream(d) if d.type == "cuda" else CpuCopier())


def _edited_on_gpu(ctx, edit: bool, settle: bool):
    torch.manual_seed(0)
    w = torch.randn(256, 256, device="cuda", requires_grad=True)
    x = torch.randn(128, 256, device="cuda")
    with ctx:
        h = x @ w
        loss = (h * h).sum()  # saves h; its copy waits behind the side stream's spin
        if edit:
            h.add_(1)  # on the compute stream, before the copy has read h
        del h
        if settle:  # the copy has run (holding the edit); the next save sees it done and
            torch.cuda.synchronize()  # lets h go: only the version taken then can tell
        loss = loss + torch.tanh(x @ w).sum()
    loss.backward()
    return w.grad


@pytest.mark.gpu
@pytest.mark.parametrize("settle", [False, True], ids=["copy_pending", "copy_seen_done"])
def test_gpu_tensor_edited_while_its_copy_to_host_waits_is_refused(slow_side_stream, settle):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _edited_on_gpu(contextlib.nullcontext(), True, settle)  # plain autograd refuses it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _edited_on_gpu(offload(cpu_budget=1 << 30, min_bytes=0), True, settle)
    want = _edited_on_gpu(contextlib.nullcontext(), False, settle)
    got = _edited_on_gpu(offload(cpu_budget=1 << 30, min_bytes=0), False, settle)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_forward_dropped_before_backward_frees_its_device_memory_at_once(slow_side_stream):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512)).cuda()
    x = torch.randn(256, 512, device="cuda")
    model(x).pow(2).mean().backward()  # cuBLAS workspaces and gradients exist before `base`
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    ctx = offload(cpu_budget=1 << 30, min_bytes=0)
    sessions = watched_sessions(ctx)
    with no_gc():
        with ctx:
            loss = model(x).pow(2).mean()
        assert ctx.last_stats["ram_bytes"] >= 256 * 2048 * 4
        del loss
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # frees blocks whose side-stream copies are done (stats)
        held = torch.cuda.memory_allocated() - base
        assert sessions[0]() is None, "the session outlived its graph"
        assert held < 256 * 512 * 4, held  # less than the smallest saved activation


# ---- GradScaler's found-inf agreed over models on different devices ---------------------------


class TwoRankGroup:
    """A model's process group of two ranks, the other rank's found-inf flag given: the MAX
    all-reduce, on the device the backend takes (a meta tensor keeps no value: recorded only)."""

    world = 2

    def __init__(self, device: str, peer: float = 0.0):
        self.device, self.peer, self.seen = torch.device(device), peer, []

    def all_reduce(self, t, op):
        assert op == torch.distributed.ReduceOp.MAX
        self.seen.append(t.device)
        assert t.device == self.device, f"a {t.device} tensor for a group on {self.device}"
        if t.device.type != "meta":
            t.copy_(torch.maximum(t, torch.tensor(self.peer, device=t.device)))
        return None

    def wait(self, work):
        pass


def sharded_model_on(device: str, group) -> SimpleNamespace:
    """What any_rank_found reads of a sharded model's state: its units' device and its group."""
    return SimpleNamespace(units=[SimpleNamespace(device=torch.device(device))], world_comm=group)


def test_found_inf_is_agreed_on_each_models_own_device():
    one_rank = SimpleNamespace(world=1)
    # A single-rank model first (nothing to agree on, on a device no group here takes): the
    # flag goes to the first model that reduces, and the other rank's inf reaches this one.
    first = TwoRankGroup("cpu", peer=1.0)
    found = any_rank_found([sharded_model_on("meta", one_rank), sharded_model_on("cpu", first)],
                           [torch.zeros(())])
    assert first.seen == [torch.device("cpu")] and found.item() == 1.0
    # Two models in two groups on two devices: each collective gets its own device's tensor
    # (before, the second got the first model's: NCCL refuses a CPU tensor).
    on_cpu, on_meta = TwoRankGroup("cpu", peer=0.0), TwoRankGroup("meta")
    found = any_rank_found([sharded_model_on("cpu", on_cpu), sharded_model_on("meta", on_meta)],
                           [torch.ones(())])
    assert on_cpu.seen == [torch.device("cpu")] and on_meta.seen == [torch.device("meta")]
    assert found.device.type == "meta"
    # Two groups on one device: the flag is or-ed through both, exactly.
    for mine, peers, want in ((0.0, (0.0, 0.0), 0.0), (1.0, (0.0, 0.0), 1.0),
                              (0.0, (0.0, 1.0), 1.0), (0.0, (1.0, 0.0), 1.0)):
        groups = [TwoRankGroup("cpu", peer) for peer in peers]
        found = any_rank_found([sharded_model_on("cpu", g) for g in groups],
                               [torch.tensor(mine)])
        assert found.item() == want and found.dtype == torch.float32
    assert any_rank_found([sharded_model_on("cpu", one_rank)], [torch.ones(())]) is None
    # No gradient on this rank: it still takes part, and follows the other rank.
    assert any_rank_found([sharded_model_on("cpu", TwoRankGroup("cpu", 1.0))], []).item() == 1.0


@pytest.mark.gpu
def test_gpu_found_inf_is_agreed_over_models_on_the_cpu_and_the_gpu():
    for devices in (("cpu", "cuda"), ("cuda", "cpu")):
        for peers, want in (((0.0, 0.0), 0.0), ((0.0, 1.0), 1.0), ((1.0, 0.0), 1.0)):
            groups = [TwoRankGroup(d, p) for d, p in zip(devices, peers)]
            found = any_rank_found([sharded_model_on(d, g) for d, g in zip(devices, groups)],
                                   [torch.zeros((), device="cuda"), torch.zeros(())])
            assert [g.seen for g in groups] == [[torch.device(d)] for d in devices]
            assert found.item() == want, (devices, peers)


# ---- copy.deepcopy of a FeatureStore ----------------------------------------------------------
# A CUDA store's deepcopy went through pickling, which leaves a CUDA copy rowless (for another
# process): the copy then refused to gather, saying it "was pickled into another process".


def test_deepcopy_of_a_store_does_not_pickle_and_copies_the_rows(monkeypatch):
    def pickled(self):
        raise AssertionError("deepcopy went through pickling")

    x = torch.randn(30, 4)
    index = torch.tensor([29, 0, 7])
    store = FeatureStore(x, device="cpu")
    with monkeypatch.context() as m:
        m.setattr(FeatureStore, "__getstate__", pickled)
        twin = copy.deepcopy(store)
    assert torch.equal(twin.gather(index), x[index])
    assert twin._table.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    twin._table.add_(1)  # the copy's own rows, edited in place: the copy refuses, as built
    with pytest.raises(RuntimeError, match="modified in place"):
        twin.gather(index)
    assert torch.equal(store.gather(index), x[index])
    # Deep-copied with its features, it holds the copied features, as the original held them.
    got = copy.deepcopy({"x": x, "store": store})
    assert got["store"]._table is got["x"]
    assert torch.equal(got["store"].gather(index), x[index])
    got["x"][0] = 5
    with pytest.raises(RuntimeError, match="modified in place"):
        got["store"].gather(index)
    # A store that refuses to gather is refused before anything is copied.
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        copy.deepcopy(store)
    store.close()
    assert copy.deepcopy(store).closed


def test_shallow_copy_of_a_cuda_store_is_refused_and_of_a_cpu_store_shares_its_rows():
    x = torch.randn(10, 3)
    store = FeatureStore(x, device="cpu")
    twin = copy.copy(store)
    assert twin._table is x and torch.equal(twin.gather(torch.tensor([4])), x[4:5])
    x.add_(1)  # the copy watches the same features, at the same version
    with pytest.raises(RuntimeError, match="modified in place"):
        twin.gather(torch.tensor([4]))
    store.device = torch.device("cuda")  # stands in for an open CUDA store
    with pytest.raises(TypeError, match=r"copy\.copy of a FeatureStore\(device='cuda'\)"):
        copy.copy(store)
    store.device = torch.device("cpu")
    store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("pin", ["inplace", "copy"])
@pytest.mark.parametrize("cache", ["none", "degree", "frequency"])
def test_gpu_deepcopy_of_a_cuda_store_gathers_the_same_rows_on_its_own(pin, cache):
    torch.manual_seed(0)
    x = torch.randn(300, 8)
    kw = {"none": {}, "degree": dict(cache=0.1, degrees=torch.arange(300)),
          "frequency": dict(cache=0.1, cache_policy="frequency")}[cache]
    store = FeatureStore(x.clone(), pin=pin, **kw)
    index = torch.randint(0, 300, (64,))
    for _ in range(5):  # part of the frequency policy's warm-up: the copy finishes it alone
        store.gather(index)
    twin = copy.deepcopy(store)
    assert twin._table.data_ptr() != store._table.data_ptr()
    assert torch.equal(twin.cached_rows(), store.cached_rows())
    for _ in range(5):
        assert torch.equal(twin.gather(index).cpu(), x[index])
        assert torch.equal(twin.gather(index.cuda()).cpu(), x[index])
    if cache == "frequency":  # the copy finished the warm-up alone
        assert store.cached_rows().numel() == 0 and twin.cached_rows().numel() == twin.cache_rows
    else:
        assert torch.equal(twin.cached_rows(), store.cached_rows())
    store.close()  # the copy keeps its own registered or pinned rows and cache
    assert torch.equal(twin.gather(index).cpu(), x[index])
    with pytest.raises(TypeError, match="copy.copy"):
        copy.copy(twin)
    twin.close()


# ---- offloaded AdamW over non-contiguous parameters on their device ---------------------------
# A channels_last model and a transposed weight are stepped through a contiguous copy of each
# (offload/strided.py): on a GPU that copy, its write back into the parameter's own memory and
# the overlap worker's copy of a strided gradient run on the device. The same body runs on the
# CPU here.

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
STRIDED_OFFLOAD = {"cpu": dict(offload="cpu"), "nvme_ov": dict(offload="nvme", overlap=True)}


def strided_net(device: str) -> Net:
    model = Net().to(device).to(memory_format=torch.channels_last)
    w = model.head.weight
    w.data = w.data.t().contiguous().t()  # the same values, column-major
    return model


def fit_on_device(model: Net, opt, steps) -> None:
    device = next(model.parameters()).device
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, 3, 10, 10, generator=g).to(device, memory_format=torch.channels_last)
        y = torch.randn(4, 10, generator=g).to(device)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", list(STRIDED_OFFLOAD))
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_offloaded_adamw_steps_strided_params_on_their_device_as_torch(tmp_path, device, mode):
    ref, model = strided_net(device), strided_net(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **HYPER)
    layouts = [p.stride() for p in model.parameters()]
    kw = dict(STRIDED_OFFLOAD[mode], chunk_bytes=CHUNK)
    if kw["offload"] == "nvme":
        kw["nvme_path"] = str(tmp_path)
    opt = AdamW(model.parameters(), **HYPER, **kw)
    try:
        # TF32 would round the two models' weights (an ulp apart after a step) differently, and
        # a nondeterministic cuDNN algorithm their gradients: only the optimizers may differ.
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True,
                                        allow_tf32=False):
            for m, o in ((ref, ref_opt), (model, opt)):
                fit_on_device(m, o, range(4))
        assert [p.stride() for p in model.parameters()] == layouts
        assert all(p.device.type == device for p in model.parameters())
        assert model.conv2.weight.is_contiguous(memory_format=torch.channels_last)
        assert not model.conv2.weight.is_contiguous() and model.head.weight.stride() == (1, 10)
        assert_matches_torch(model, ref)
        # The moments a logging loop reads from optimizer.state[p] of a device parameter.
        for p, r in zip(model.parameters(), ref.parameters()):
            items, rst = dict(opt.state[p].items()), ref_opt.state[r]
            assert list(items) == ["exp_avg", "exp_avg_sq", "step"]
            assert float(items["step"]) == float(rst["step"]) == 4
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(items[k], rst[k].cpu(), rtol=1e-5, atol=1e-9)
                assert float(items[k].norm()) == pytest.approx(float(rst[k].norm()), rel=1e-5)
        if opt._offload.config.overlap:  # chunks were stepped during backward, and kept
            stats = opt.last_step_stats
            assert stats["overlap_kept_chunks"] > 0 and stats["overlap_redone_chunks"] == 0, stats
    finally:
        opt.close()


# ---- features given new memory under a FeatureStore, on each device ---------------------------
# A CUDA store's GPU cache and a pin="copy" copy keep the rows as built, so new memory put under
# the features is refused on every device; moving them to shared memory (what a spawned
# worker's pickling does) keeps their storage and values.

STORES = [pytest.param("cpu", "inplace", id="cpu"),
          pytest.param("cuda", "inplace", marks=pytest.mark.gpu, id="cuda-inplace"),
          pytest.param("cuda", "copy", marks=pytest.mark.gpu, id="cuda-copy")]
ROWS = torch.tensor([299, 0, 7, 7, 150])


def store_over(x: torch.Tensor, device: str, pin: str) -> FeatureStore:
    cached = {} if device == "cpu" else dict(cache=0.1, degrees=torch.arange(x.shape[0]))
    return FeatureStore(x, device=device, pin=pin, **cached)


def indices_on(device: str) -> list:
    """The rows asked for by a CPU index and, on a CUDA store, by a GPU one."""
    return [ROWS] + ([ROWS.to(device)] if device != "cpu" else [])


@pytest.mark.parametrize("device,pin", STORES)
def test_features_given_new_memory_are_refused_by_a_store_on_each_device(device, pin):
    torch.manual_seed(0)
    x = torch.randn(300, 8)
    store = store_over(x, device, pin)
    try:
        for index in indices_on(device):
            assert torch.equal(store.gather(index).cpu(), x[ROWS])
        x.data = x.clone()  # the same values in new memory: no version counted
        assert x._version == 0
        out = torch.zeros(len(ROWS), 8, device=device)
        for index in indices_on(device):
            with pytest.raises(RuntimeError, match="holds other memory"):
                store.gather(index, out=out)
        assert not out.any()  # refused before writing
    finally:
        store.close()
    with store_over(x, device, pin) as fresh:  # as the message says: closed, then built anew
        for index in indices_on(device):
            assert torch.equal(fresh.gather(index).cpu(), x[ROWS])


@pytest.mark.parametrize("device,pin", STORES)
def test_features_moved_to_shared_memory_gather_exactly_or_are_refused(device, pin):
    torch.manual_seed(0)
    x = torch.randn(300, 8)
    store = store_over(x, device, pin)
    try:
        assert torch.equal(store.gather(ROWS).cpu(), x[ROWS])
        x.share_memory_()
        assert x.is_shared()
        out = torch.zeros(len(ROWS), 8, device=device)
        if device == "cpu" or pin == "copy":
            # Not a change: the CPU store reads x where it is now, a pin="copy" store its copy.
            for index in indices_on(device):
                assert torch.equal(store.gather(index, out=out).cpu(), x[ROWS])
            return
        # pin="inplace": the memory registered with CUDA was x's, and share_memory_() moved
        # x's bytes elsewhere: refused before anything is written.
        for index in indices_on(device):
            with pytest.raises(RuntimeError, match="bytes moved"):
                store.gather(index, out=out)
            assert not out.any()
    finally:
        store.close()


# ---- a converted nn.TransformerEncoderLayer in eval, bf16, on its device -----------------------
# Its inference fast path hands linear1/linear2's weights to one fused kernel; a converted layer
# carries a no-op pre-hook that keeps the layer on its regular path, where their forward runs.


def fp8_tensor_cores_or_skip(device: str) -> None:
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no FP8 tensor cores")


def counting_forward(monkeypatch, cls) -> list:
    """The modules whose cls.forward runs from now on (a hook would itself turn the fast path
    off)."""
    calls, forward = [], cls.forward

    def counted(self, *args, **kwargs):
        calls.append(self)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", counted)
    return calls


def regular_path(layer: nn.TransformerEncoderLayer, x: torch.Tensor) -> torch.Tensor:
    """What the layer's regular path computes in eval (post-norm, no masks, dropout off), from
    its submodules, the attention called as the layer calls it (so on the same kernels)."""
    a = layer.self_attn(x, x, x, attn_mask=None, key_padding_mask=None, need_weights=False,
                        is_causal=False)[0]
    h = layer.norm1(x + a)
    return layer.norm2(h + layer.linear2(layer.activation(layer.linear1(h))))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_converted_encoder_layer_in_bf16_eval_runs_its_converted_linears(monkeypatch, device):
    fp8_tensor_cores_or_skip(device)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    layer = layer.to(device, torch.bfloat16)
    plain = copy.deepcopy(layer).eval()
    assert convert(layer, "fp8-tensorwise", min_features=0).converted == ["linear1", "linear2"]
    layer.eval()
    x = torch.randn(2, 8, 64, device=device, dtype=torch.bfloat16)
    converted_calls = counting_forward(monkeypatch, Float8Linear)
    plain_calls = counting_forward(monkeypatch, nn.Linear)
    with torch.no_grad():
        y = layer(x)
        assert converted_calls == [layer.linear1, layer.linear2]
        # Bit for bit the regular path's output. (Beside the output with the fast path off, bf16
        # roundings in the attention's own fused kernel move the tensorwise FP8 scale: 1.2% off
        # on the CPU, the plain layer 1.7%, too close to tell the paths apart by value.)
        assert torch.equal(y, regular_path(layer, x))
        y_plain = plain(x)
        assert plain_calls == []  # the plain layer takes the fast path: the test can tell
        with _no_fast_path():
            want = layer(x)
            plain(x)
        assert plain_calls == [plain.linear1, plain.linear2]
    # The converted linears' FP8 error is what the fast path had dropped; beside the output
    # with it off, only bf16 and FP8 roundings (1.2% of the largest output on the CPU).
    assert (y_plain.float() - y.float()).abs().max() > 1e-2
    assert float((y.float() - want.float()).abs().max() / want.float().abs().max()) < 0.05
