"""tierlift.activations on the CPU (the same machinery as on a GPU, with host tensors going to
RAM buffers and NVMe files): gradients bit-identical to training without offload over several
steps of a GPT block stack for every tier and policy, fp32 and bf16; composition with
torch.utils.checkpoint, tierlift's offloaded AdamW, FP8/FP4 layers and ZeRO; parameters never
copied; layouts restored; peak RSS within the budgets; and the faults: a full disk or an I/O
error, an unusable nvme_path, budgets too small (with the smallest that works). Tests marked gpu
run the side-stream path on a GPU."""

from __future__ import annotations

import contextlib
import copy
import errno
import gc
import os
import sys
from pathlib import Path

import pytest
import torch

import tierlift
from tierlift.activations import (
    ActivationsDiscardedError,
    BudgetError,
    Policy,
    offload,
    offload_blocks,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

STEPS = 3
SMALL = 1024  # min_bytes: every activation of the tiny model is offloaded, biases are not


def make_model(dtype=torch.float32, layers=3):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, dim=64, seq_len=32, n_head=4)).to(dtype)


def batch(step, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, 256, (4, 32), generator=g).to(device),
            torch.randint(0, 256, (4, 32), generator=g).to(device))


def train(model, context=contextlib.nullcontext, steps=STEPS, opt=None):
    """Grads of every step and the final params; `context()` wraps each forward."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    device = next(model.parameters()).device
    grads = []
    for step in range(steps):
        x, y = batch(step, device)
        opt.zero_grad(set_to_none=True)
        with context():
            loss = model(x, y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def assert_identical(a, b):
    (ga, pa), (gb, pb) = a, b
    for step, (x, y) in enumerate(zip(ga, gb, strict=True)):
        assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True)), f"step {step} grads"
    assert all(torch.equal(u, v) for u, v in zip(pa, pb, strict=True)), "params differ"


DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def reference():
    return {dtype: train(make_model(dtype)) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("tiers", ["ram", "nvme", "ram+nvme"])
def test_context_manager_is_exact(tmp_path, reference, dtype, tiers):
    kw = {"ram": dict(cpu_budget=1 << 30),
          "nvme": dict(cpu_budget=0, nvme_path=tmp_path),
          "ram+nvme": dict(cpu_budget=200_000, nvme_path=tmp_path, io_bytes=150_000)}[tiers]
    tl = offload(min_bytes=SMALL, **kw)
    got = train(make_model(dtype), lambda: tl)
    assert_identical(got, reference[dtype])
    s = tl.last_stats
    assert (s["ram_bytes"] > 0) == ("ram" in tiers) and (s["nvme_bytes"] > 0) == ("nvme" in tiers)
    assert s["ram_bytes"] <= kw["cpu_budget"]
    assert os.listdir(tmp_path) == []  # the NVMe file never has a name


POLICIES = {
    "keep": "keep", "ram": "ram", "nvme": "nvme", "recompute": "recompute", "auto": "auto",
    "mixed": ("nvme", "recompute", "ram"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_offload_blocks_is_exact_for_every_policy(tmp_path, reference, dtype, policy):
    model = make_model(dtype)
    # A block saves about 0.56 MB: RAM for all three blocks, or for one and a half (auto).
    budget = 2_000_000 if policy == "ram" else 800_000
    handle = offload_blocks(model, POLICIES[policy], cpu_budget=budget, nvme_path=tmp_path,
                            io_bytes=1_200_000, min_bytes=SMALL)
    got = train(model)
    assert_identical(got, reference[dtype])
    s = handle.last_stats
    tiers = set(handle.policy.tiers)
    assert (s["nvme_bytes"] > 0) == bool(tiers & {"nvme", "auto"}), s
    assert (s["ram_bytes"] > 0) == bool(tiers & {"ram", "auto"}), s
    if policy == "nvme":  # each block was read ahead of its backward, none waited for on demand
        assert s["reads_ahead"] > 0 and s["reads_on_demand"] == 0, s
    handle.remove()
    assert "forward" not in model.blocks[0].__dict__


@pytest.mark.parametrize("reentrant", [False, True])
def test_composes_with_torch_checkpoint(tmp_path, reference, reentrant):
    """Blocks checkpointed by torch inside the context: the recomputation in backward is exact
    and the tensors torch's checkpoint saves (reentrant: its inputs) are offloaded too."""
    model = make_model()

    def forward(idx, targets):
        pos = torch.arange(idx.shape[1])
        x = model.tok(idx) + model.pos(pos)
        for block in model.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        logits = model.head(model.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                 targets.view(-1))

    model.forward = forward
    tl = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=SMALL)
    assert_identical(train(model, lambda: tl), reference[torch.float32])
    assert tl.last_stats["nvme_bytes"] > 0


@pytest.mark.parametrize("optim", ["cpu", "nvme-overlap"])
def test_composes_with_tierlift_adamw_offload(tmp_path, optim):
    """Optimizer state offloaded too; with overlap, its steps run inside the backward that
    reads the activations back."""
    kw = (dict(offload="cpu") if optim == "cpu" else
          dict(offload="nvme", nvme_path=tmp_path, overlap=True, max_grad_norm=1.0))

    def run(context):
        model = make_model()
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2, **kw)
        try:
            return train(model, context, opt=opt)
        finally:
            if hasattr(opt, "close"):
                opt.close()

    tl = offload(cpu_budget=100_000, nvme_path=tmp_path, min_bytes=SMALL)
    assert_identical(run(lambda: tl), run(contextlib.nullcontext))
    assert tl.last_stats["nvme_bytes"] > 0


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp4-quartet"])
def test_composes_with_low_precision_layers(tmp_path, recipe):
    def model():
        m = make_model()
        tierlift.lowp.convert(m, recipe=recipe, min_features=0)
        return m

    ref = train(model())
    tl = offload(cpu_budget=100_000, nvme_path=tmp_path, min_bytes=SMALL)
    assert_identical(train(model(), lambda: tl), ref)
    m = model()
    handle = offload_blocks(m, "nvme", cpu_budget=0, nvme_path=tmp_path, min_bytes=SMALL)
    assert_identical(train(m), ref)
    assert tl.last_stats["nvme_bytes"] > 0 and handle.last_stats["nvme_bytes"] > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_composes_with_zero_sharding(tmp_path, stage):
    """One process (a world of one): ZeRO's gathered parameters are still recognized as
    parameters (not copied), and losses and the full state after 4 steps are bit-identical."""
    from zero_model import batches
    from zero_model import make_model as tiny
    from zero_model import train as zero_train

    torch.set_num_threads(1)

    def run(act):
        model = tierlift.zero.shard(tiny(), stage=stage)
        handle = (offload_blocks(model, "nvme", cpu_budget=0, nvme_path=tmp_path, min_bytes=0)
                  if act else None)
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2)
        losses = zero_train(model, opt, batches(4, 4), accum=2, clip=1.0, zero=True)
        return losses, tierlift.zero.full_state_dict(model), handle

    (la, sa, handle), (lb, sb, _) = run(True), run(False)
    assert la == lb and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert handle.last_stats["nvme_bytes"] > 0 and handle.last_stats["skipped_params"] > 0


_ZERO3_RANKS = """
import tierlift
from zero_model import batches, make_model, train
from tierlift.activations import offload_blocks
def run(act):
    model = tierlift.zero.shard(make_model(), stage=3)
    if act:
        offload_blocks(model, "nvme", cpu_budget=0, nvme_path={path!r}, min_bytes=0)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train(model, opt, batches(4, 4), accum=2, clip=1.0, world=world, rank=rank,
                   zero=True)
    return losses, tierlift.zero.full_state_dict(model)
out = {{"with": run(True), "without": run(False)}}
"""


def test_composes_with_zero3_on_two_ranks(tmp_path):
    from zero_model import run_torchrun

    out = run_torchrun(_ZERO3_RANKS, tmp_path, path=str(tmp_path))
    (la, sa), (lb, sb) = out["with"], out["without"]
    assert la == lb and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["torchrun_out.pt", "torchrun_script.py"]


def test_parameters_and_their_views_are_never_copied():
    w = torch.nn.Parameter(torch.randn(512, 512))  # 1 MiB
    frozen = torch.randn(512, 512)  # a frozen weight: a leaf that does not require grad
    x = torch.randn(8, 512, requires_grad=True)
    h = torch.randn(8, 512).requires_grad_()
    a_bytes = 8 * 512 * 4

    def forward():
        a = x * 2  # an activation (16 KiB): copied
        return ((a @ w.t()).sum()  # saves a and w.t(), a view of w
                + (x * w[:8]).sum()  # saves x (a leaf that requires grad) and a view of w
                + (torch.tanh(h) @ frozen).sum())  # saves tanh's output (16 KiB) and frozen

    tl = offload(cpu_budget=1 << 30, min_bytes=0)
    with tl:
        forward()
    assert tl.last_stats["skipped_params"] == 3
    assert tl.last_stats["ram_bytes"] == 2 * a_bytes + frozen.nbytes
    tl = offload(cpu_budget=1 << 30, min_bytes=0, params=[w, frozen])
    with tl:
        forward()
    assert tl.last_stats["skipped_params"] == 4  # the frozen weight is known as one now
    assert tl.last_stats["ram_bytes"] == 2 * a_bytes


def test_nested_strides_dtypes_and_retain_graph(tmp_path):
    """Saved tensors come back with their strides (transposed, sliced, expanded), any dtype,
    and a second backward (retain_graph) reads them again."""
    x = torch.randn(64, 48, dtype=torch.float64, requires_grad=True)
    w = torch.randn(64, 48, dtype=torch.float64, requires_grad=True)

    def f():
        t = (x * 3).t()  # saved non-contiguous
        s = (w * 2)[::2]
        return (t.sin() * t).sum() + (s @ s.t()).exp().sum() * 1e-3

    f().backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=0):
        out = f()
    out.backward(retain_graph=True)
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])
    out.backward()
    assert torch.equal(x.grad, 2 * want[0]) and torch.equal(w.grad, 2 * want[1])


class SavesAView(torch.autograd.Function):
    """Saves a transposed slice of its input and records, in backward, the layout it got back."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x[:, 1:].t())
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        SavesAView.seen.append((t.shape, t.stride(), t.clone()))
        return grad


@pytest.mark.parametrize("nvme", [False, True])
def test_saved_tensors_come_back_with_their_strides(tmp_path, nvme):
    a = torch.randn(64, 33, requires_grad=True)
    y = a * 2
    want = y[:, 1:].t()
    SavesAView.seen.clear()
    with offload(cpu_budget=0 if nvme else 1 << 30, nvme_path=tmp_path if nvme else None,
                 min_bytes=0) as tl:
        out = SavesAView.apply(y)
    out.sum().backward()
    assert tl.last_stats["nvme_bytes" if nvme else "ram_bytes"] == want.numel() * 4
    shape, stride, values = SavesAView.seen[0]
    assert shape == want.shape and stride == want.stride() and torch.equal(values, want)


def test_a_deep_copy_of_the_model_runs_its_own_blocks():
    """copy.deepcopy (an EMA model, a twin for evaluation) binds the copy's wrapped forwards to
    the copy's blocks, not to the original's weights."""
    model = make_model()
    offload_blocks(model, "ram", cpu_budget=1 << 30, min_bytes=SMALL)
    twin, plain = copy.deepcopy(model), make_model()
    with torch.no_grad():
        for p, q in zip(twin.parameters(), plain.parameters(), strict=True):
            p.mul_(0.5)
            q.mul_(0.5)
    assert_identical(train(twin, steps=2), train(plain, steps=2))


def test_no_grad_forward_is_untouched(tmp_path):
    model = make_model()
    handle = offload_blocks(model, "nvme", cpu_budget=0, nvme_path=tmp_path, min_bytes=SMALL)
    with torch.no_grad():
        model(*batch(0))
    assert handle.last_stats == {}  # no forward session was opened


def spilled_bytes(directory) -> int:
    """Bytes on the drive held by this process's open files under `directory` (the anonymous
    activation files have no name, only a descriptor)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
                total += os.stat(f"/proc/self/fd/{fd}").st_blocks * 512
        except OSError:
            pass
    return total


@pytest.mark.parametrize("form", ["context", "blocks"])
def test_spill_goes_as_backward_consumes_it_while_loss_lives_on(tmp_path, form):
    """The usual loop keeps `loss` until the next forward reassigns it: each block's spill must
    go once its backward is done, not when `loss` is dropped (that needed twice the drive)."""
    model = make_model(layers=3)
    during = []

    def read_when_reached(module, args, out):  # as backward reaches each block, last first
        if out.requires_grad:
            out.register_hook(lambda g: during.append(spilled_bytes(tmp_path)))

    for block in model.blocks:
        block.register_forward_hook(read_when_reached)
    if form == "blocks":
        handle = offload_blocks(model, "nvme", cpu_budget=0, nvme_path=tmp_path,
                                min_bytes=SMALL)
        context = contextlib.nullcontext
    else:
        def context():
            return offload(0, tmp_path, min_bytes=SMALL)
    for step in range(3):
        during.clear()
        with context():
            loss = model(*batch(step))
        full = spilled_bytes(tmp_path)
        assert full > 0
        loss.backward()
        assert spilled_bytes(tmp_path) == 0, "spill kept after backward while loss lives"
        assert during[0] <= full and during[0] > during[1] > during[2] > 0, during
    del loss
    if form == "blocks":
        handle.close()


# ---- faults ------------------------------------------------------------------------------------

def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class FailingWrites:
    """Makes the offload's engine fail its k-th write with EIO (as a dying drive would)."""

    def __init__(self, tl, k):
        self.engine = tl._engines.get()
        self.real, self.k, self.calls = self.engine.write, k, 0
        self.engine.write = self

    def __call__(self, tensor, path, offset=0):
        self.calls += 1
        if self.calls < self.k:
            return self.real(tensor, path, offset)

        class Failed:
            def done(self):
                return True

            def wait(self):
                raise OSError(errno.EIO, "Input/output error", path)

        return Failed()

    def undo(self):
        del self.engine.write


@pytest.mark.parametrize("form", ["context", "blocks"])
def test_eio_in_forward_abandons_the_step_and_leaves_nothing(tmp_path, form):
    model = make_model()
    ref = train(copy.deepcopy(model), steps=1)
    if form == "context":
        tl = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=SMALL)
        context = lambda: tl  # noqa: E731
    else:
        tl = offload_blocks(model, "nvme", cpu_budget=0, nvme_path=tmp_path,
                            min_bytes=SMALL)._offload
        context = contextlib.nullcontext
    fault = FailingWrites(tl, k=5)
    gc.collect()  # earlier tests' garbage (engines in reference cycles) freed now, not mid-test
    fds = open_fds()  # with the engine's own (its ring, its threads)
    with pytest.raises(OSError, match="activation offload to nvme_path .* failed writing") as e:
        with context():
            model(*batch(0))
    assert e.value.errno == errno.EIO and "forward was abandoned" in str(e.value)
    assert all(p.grad is None for p in model.parameters())  # no gradients written
    assert os.listdir(tmp_path) == [] and open_fds() == fds  # no file, no descriptor left
    fault.undo()
    assert_identical(train(model, context, steps=1), ref)  # the next step runs, exactly


def test_backward_after_an_abandoned_forward_raises(tmp_path):
    """A forward that fails after its graph escaped (here: an error in the user's code inside
    the context) is abandoned: backward on that graph raises before computing anything."""
    x = torch.randn(256, 256, requires_grad=True)
    tl = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=0)
    kept = []
    with pytest.raises(KeyError):
        with tl:
            kept.append((x.sin() * x.cos()).sum())
            raise KeyError("user code failed")
    with pytest.raises(ActivationsDiscardedError, match="failed and was abandoned .*KeyError"):
        kept[0].backward()
    assert x.grad is None


_FULL_DISK = """
import os, resource, signal, sys, torch
sys.path.insert(0, {examples!r})
from gpt_model import GPT, GPTConfig
import tierlift.activations as A
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=3, dim=64, seq_len=32, n_head=4))
x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
tl = A.offload(cpu_budget=0, nvme_path={path!r}, min_bytes=1024)
tl._engines.get()  # the engine's own descriptors are there before and after
fds = set(os.listdir("/proc/self/fd"))
# Writes past 64 KiB now fail with EFBIG, like a disk that filled up in forward.
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
try:
    with tl:
        model(x, y)
    raise SystemExit("forward did not fail")
except OSError as e:
    assert "forward was abandoned" in str(e), e
    print("ERROR:", e)
assert all(p.grad is None for p in model.parameters())
assert os.listdir({path!r}) == [] and set(os.listdir("/proc/self/fd")) == fds
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
with tl:
    loss = model(x, y)
loss.backward()
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad(set_to_none=True)
model(x, y).backward()
assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
print("OK")
"""


def test_full_disk_in_forward_is_a_clear_error_and_the_next_step_runs(tmp_path):
    import subprocess

    root = Path(__file__).resolve().parents[2]
    script = _FULL_DISK.format(examples=str(root / "examples"), path=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(root / "python")})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout and "File too large" in out.stdout


def test_unusable_nvme_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nvme_path .*missing.* does not exist"):
        offload(cpu_budget=0, nvme_path=tmp_path / "missing")
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        offload(cpu_budget=0, nvme_path=tmp_path / "afile")
    tl = offload(cpu_budget=0, nvme_path="/proc", min_bytes=0)  # no regular files there
    x = torch.randn(256, 256, requires_grad=True)
    with pytest.raises(OSError, match="cannot create an activation file under nvme_path '/proc'"):
        with tl:
            x.exp().sum()
    with pytest.raises(ValueError, match="cpu_budget must be an int >= 0"):
        offload(cpu_budget=-1)
    with pytest.raises(ValueError, match="the policy sends blocks to NVMe but no nvme_path"):
        offload_blocks(make_model(), "nvme", cpu_budget=0)


def test_budget_too_small_names_the_smallest_that_works():
    model = make_model()
    ref = train(copy.deepcopy(model), steps=1)
    handle = offload_blocks(model, "ram", cpu_budget=10_000, min_bytes=SMALL)
    with pytest.raises(BudgetError, match=r"cpu_budget=10000 bytes is too small .* largest block "
                       r"\(blocks\.\d\) saves \d+ bytes. The smallest cpu_budget that works is "
                       r"\d+ \(or give nvme_path") as e:
        model(*batch(0))
    assert all(p.grad is None for p in model.parameters())
    handle.remove()
    handle = offload_blocks(model, "ram", cpu_budget=e.value.smallest, min_bytes=SMALL)
    assert_identical(train(model, steps=1), ref)  # exactly that budget works
    assert handle.last_stats["ram_bytes"] == e.value.smallest
    handle.remove()
    with pytest.raises(BudgetError, match="cpu_budget=.* too small"):
        offload_blocks(model, "ram", cpu_budget=e.value.smallest - 1, min_bytes=SMALL)
        model(*batch(0))


def test_io_window_too_small_for_a_tensor(tmp_path):
    x = torch.randn(512, 512, requires_grad=True)  # 1 MiB activations
    tl = offload(cpu_budget=0, nvme_path=tmp_path, io_bytes=4096, min_bytes=0)
    with pytest.raises(BudgetError, match="io_bytes=4096 is too small .* smallest io_bytes that "
                       "works is 1048576") as e:
        with tl:
            (x.exp() * 2).sum()
    assert e.value.argument == "io_bytes" and e.value.smallest == x.nbytes
    tl = offload(cpu_budget=0, nvme_path=tmp_path, io_bytes=e.value.smallest, min_bytes=0)
    with tl:
        out = (x.exp() * 2).sum()
    out.backward()
    assert torch.equal(x.grad, 2 * x.detach().exp())


def test_gpu_budget_counts_the_whole_storage_a_kept_view_holds():
    """q, k and v split from one qkv output: keeping q keeps all three alive, so it costs the
    qkv tensor's bytes, and k and v then stay for free. (Counting a third per view let an
    H200 run hold 8 MiB more than its gpu_budget.)"""
    n = 64 * 256 * 4  # bytes of each of q, k, v

    def run(gpu_budget):
        x = torch.randn(64, 3 * 256, generator=torch.Generator().manual_seed(0),
                        requires_grad=True)
        tl = offload(cpu_budget=1 << 20, gpu_budget=gpu_budget, min_bytes=1024)
        with tl:
            q, k, v = (x * 2.0).split(256, dim=1)
            out = (q * k * v).sum()  # saves q, k, then q * k and v
        out.backward()
        return tl.last_stats, x.grad

    plain_x = torch.randn(64, 3 * 256, generator=torch.Generator().manual_seed(0),
                          requires_grad=True)
    q, k, v = (plain_x * 2.0).split(256, dim=1)
    (q * k * v).sum().backward()
    stats, grad = run(2 * n)  # less than qkv's 3n: q, k, v move, only q * k (n bytes) stays
    assert (stats["kept_bytes"], stats["ram_bytes"]) == (n, 3 * n)
    assert torch.equal(grad, plain_x.grad)
    stats, grad = run(3 * n)  # qkv stays whole; q * k no longer fits
    assert (stats["kept_bytes"], stats["ram_bytes"]) == (3 * n, n)
    assert torch.equal(grad, plain_x.grad)


# ---- policy ------------------------------------------------------------------------------------

def test_policy_forms_and_errors():
    assert Policy.of("ram", 3).tiers == ("ram",) * 3
    assert Policy.of(["keep", "nvme"], 2)[1] == "nvme"
    with pytest.raises(ValueError, match="unknown tier"):
        Policy(("ram", "disk"))
    with pytest.raises(ValueError, match="names 2 tiers but the model has 3 blocks"):
        Policy.of(("ram", "ram"), 3)


def test_policy_plan_fills_the_fast_tiers_from_the_last_block():
    p = Policy.plan(n_blocks=6, block_bytes=10, cpu_budget=20, gpu_budget=10, nvme=True)
    assert p.tiers == ("nvme", "nvme", "nvme", "ram", "ram", "keep")
    # A disk too slow to hide a block's round trip behind its compute: recompute instead.
    slow = Policy.plan(n_blocks=3, block_bytes=10, cpu_budget=0, nvme=True,
                       block_compute_s=1.0, nvme_bytes_per_s=2.0)
    assert slow.tiers == ("recompute", "recompute", "keep")
    fast = Policy.plan(n_blocks=3, block_bytes=10, cpu_budget=0, nvme=True,
                       block_compute_s=1.0, nvme_bytes_per_s=100.0)
    assert fast.tiers == ("nvme", "nvme", "keep")
    for bad in (dict(cpu_budget=-5 << 30), dict(gpu_budget=-1), dict(n_blocks=0),
                dict(block_bytes=-1), dict(cpu_budget=1.5), dict(cpu_budget=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Policy.plan(**{**dict(n_blocks=3, block_bytes=10, cpu_budget=0), **bad})
    # A time or speed that is not one would pick NVMe or recompute for no reason.
    speeds = dict(n_blocks=3, block_bytes=10, cpu_budget=0, nvme=True, block_compute_s=1.0,
                  nvme_bytes_per_s=2.0)
    for name, value in [("block_compute_s", -1.0), ("block_compute_s", float("nan")),
                        ("block_compute_s", float("inf")), ("block_compute_s", True),
                        ("nvme_bytes_per_s", 0.0), ("nvme_bytes_per_s", -2.0),
                        ("nvme_bytes_per_s", float("nan")), ("nvme_bytes_per_s", "2")]:
        what = "one block's forward time" if name == "block_compute_s" else "the NVMe bandwidth"
        with pytest.raises(ValueError, match=rf"{name} \({what}\) must be a finite number"):
            Policy.plan(**{**speeds, name: value})
    # A free forward: recomputing costs nothing.
    assert Policy.plan(**{**speeds, "block_compute_s": 0.0}).tiers == ("recompute",) * 2 + ("keep",)


# ---- memory ------------------------------------------------------------------------------------

def test_eio_in_backward_is_a_clear_error(tmp_path):
    x = torch.randn(256, 256, requires_grad=True)
    tl = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=0)
    engine = tl._engines.get()
    real = engine.read

    def failing_read(tensor, path, offset=0):
        handle = real(tensor, path, offset)
        handle.wait()
        raise OSError(errno.EIO, "Input/output error", path)

    engine.read = failing_read
    with tl:
        out = (x.exp() * x.sin()).sum()
    with pytest.raises(OSError, match="failed reading back .* Input/output error"):
        out.backward()
    del engine.read
    with tl:
        out = (x.exp() * x.sin()).sum()
    x.grad = None
    out.backward()
    assert torch.equal(x.grad, (x.exp() * x.sin() + x.exp() * x.cos()).detach())


_RSS = r'''
sys.path.insert(0, sys.argv[1])
from gpt_model import GPT, GPTConfig
import tierlift.activations as A
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=6, dim=256, seq_len=256, n_head=4))
x, y = torch.randint(0, 256, (8, 256)), torch.randint(0, 256, (8, 256))
for p in model.parameters():
    p.grad = torch.zeros_like(p)  # gradients are not activations: allocated before measuring
budget, io = int(sys.argv[3]), int(sys.argv[4])
tl = A.offload(cpu_budget=budget, nvme_path=sys.argv[2], io_bytes=io, min_bytes=1 << 16)
def step(offload):
    with tl if offload else contextlib.nullcontext():
        loss = model(x, y)
    loss.backward()
import contextlib
step(True)
print(growth(lambda: step(False)), growth(lambda: step(True)),
      tl.last_stats["ram_bytes"], tl.last_stats["nvme_bytes"])
'''


@pytest.mark.parametrize("budget,io", [(0, 32 << 20), (32 << 20, 16 << 20)],
                         ids=["nvme", "ram+nvme"])
def test_peak_rss_growth_stays_within_the_budgets(tmp_path, budget, io):
    """Forward + backward of a 6-block GPT whose saved activations take ~220 MB: with offload
    the process's peak RSS grows by at most cpu_budget + io_bytes + one block's activations
    (the block being computed), measured in a fresh interpreter."""
    import rss_probe

    examples = Path(__file__).resolve().parents[2] / "examples"
    plain, grown, ram, nvme = map(int, rss_probe.run(_RSS, examples, tmp_path, budget,
                                                     io).split())
    block = (ram + nvme) // 6
    assert ram <= budget and nvme > 0
    assert grown <= budget + io + block, (grown, budget, io, block)
    assert plain > 2 * grown, (plain, grown)  # without offload every block's activations stay


# ---- GPU (skipped without one) -----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["ram", "nvme", "auto", "mixed"])
def test_gpu_offload_blocks_is_exact(tmp_path, dtype, policy):
    """Side-stream D2H into pinned buffers, NVMe through the engine, H2D read ahead: bit for
    bit the gradients of the same GPU run without offload."""
    ref = train(make_model(dtype).cuda())
    model = make_model(dtype).cuda()
    # "ram" holds the whole forward: the GPU's attention saves more than the CPU's (1.68 MB in
    # fp32 on an H200, 0.8 MB on the CPU); the other policies spill the rest.
    budget = 2_000_000 if policy == "ram" else 800_000
    handle = offload_blocks(model, POLICIES[policy], cpu_budget=budget, nvme_path=tmp_path,
                            io_bytes=1_200_000, min_bytes=SMALL)
    assert_identical(train(model), ref)
    assert handle.last_stats["ram_bytes"] + handle.last_stats["nvme_bytes"] > 0


@pytest.mark.gpu
def test_gpu_context_manager_is_exact(tmp_path):
    ref = train(make_model().cuda())
    tl = offload(cpu_budget=100_000, nvme_path=tmp_path, io_bytes=200_000, min_bytes=SMALL)
    assert_identical(train(make_model().cuda(), lambda: tl), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_budget", [0, 32 << 20])
def test_gpu_saved_activation_memory_within_gpu_budget(tmp_path, gpu_budget):
    """What the graph holds on the GPU after forward: at most gpu_budget plus the tensors below
    min_bytes (measured with torch.cuda.memory_allocated, not assumed)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, dim=512, seq_len=512, n_head=8)).cuda()
    x = torch.randint(0, 256, (8, 512), device="cuda")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def held(context):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with context:
            loss = model(x, x)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # frees blocks whose side-stream copies are done (stats)
        kept = torch.cuda.memory_allocated() - base
        loss.backward()
        return kept

    plain = held(contextlib.nullcontext())
    tl = offload(cpu_budget=256 << 20, nvme_path=tmp_path, gpu_budget=gpu_budget,
                 min_bytes=1 << 16)
    kept = held(tl)
    s = tl.last_stats
    moved = s["ram_bytes"] + s["nvme_bytes"] + s["kept_bytes"]
    assert s["kept_bytes"] <= gpu_budget and s["nvme_bytes"] > 0
    assert kept <= gpu_budget + max(plain - moved, 0) + (4 << 20), (kept, plain, moved)
    assert kept < plain / 2
