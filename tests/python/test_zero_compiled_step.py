"""torch's "compiled optimizer" recipe (torch.compile(optimizer.step), or a compiled function
that calls it) over the shards of a model sharded by tierlift.zero, at stages 1/2/3, with
torch's AdamW (tensor and float lr) and SGD and tierlift's AdamW, with a parameter that gets no
gradient in some steps (put back after the step) and clip_grad_norm_ before it.

tierlift's step hooks (checks of module weights, the unused-parameter agreement and put-backs,
the all-gathers that end a stage 1/2 step) run eagerly at one graph break around the compiled
math, so the compiled step gives the eager step's numbers. torch's own compiled AdamW is not
torch's eager AdamW bit for bit (traced, it takes the bias corrections from the fp32 step tensor,
eager from Python floats: ~1e-6 apart after four steps, with or without ZeRO), so torch's AdamW
is held to torch's compiled step (within rounding), the others to the eager ZeRO step bit for
bit, also over 2 gloo ranks. fullgraph=True cannot hold those hooks: it is refused while dynamo
traces, by a message that says why and what to do, before anything changed. Backend "eager"
(dynamo only) keeps compilation short."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics
from zero_model import spawn_ranks

import tierlift

STEPS = 4
SKIPPED = (1, 2)  # steps in which `extra` gets no gradient: its count lags at step 3
CLIP = 0.05  # below every step's gradient norm here: clip_grad_norm_ scales every step
KINDS = ("adamw_tensor_lr", "adamw_float_lr", "sgd", "tierlift_adamw")


class _Net(nn.Module):
    """`a` and `extra` share the root unit (several parameters: the unused-parameter
    bookkeeping is on); `b` is a unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.extra, self.b = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, use_extra: bool):
        h = torch.tanh(self.a(x))
        if use_extra:
            h = h + torch.tanh(self.extra(x))
        return self.b(h)


def _optimizer(kind: str, params):
    if kind == "adamw_tensor_lr":
        return torch.optim.AdamW(params, lr=torch.tensor(1e-2), weight_decay=0.1)
    if kind == "adamw_float_lr":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1)
    return tierlift.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _model(stage: int | None) -> _Net:
    model = _Net()
    if stage is not None:
        tierlift.zero.shard(model, stage=stage, units=["b"])
    return model


def _weights(model, stage) -> dict:
    if stage is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return tierlift.zero.full_state_dict(model)


def _train(stage, kind, *, compiled: bool, rank: int = 0, skipped=SKIPPED):
    """Losses, full weights and dynamo's frame count after each step (compiled: reset first, so
    no earlier optimizer's cache entries count against the recompile limit)."""
    model = _model(stage)
    opt = _optimizer(kind, model.parameters())
    if compiled:
        torch._dynamo.reset()
        counters.clear()
    step = opt.step
    if compiled and kind == "sgd":  # the recipe's other form: a compiled function that steps
        step = torch.compile(lambda: opt.step(), backend="eager")
    elif compiled:
        step = torch.compile(opt.step, backend="eager")
    g = torch.Generator().manual_seed(1 + rank)
    losses, frames = [], []
    for i in range(STEPS):
        loss = model(torch.randn(3, 8, generator=g), i not in skipped).square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP
        step()
        opt.zero_grad()
        losses.append(loss.item())
        frames.append(counters["frames"]["total"])
    if compiled:
        assert counters["stats"]["unique_graphs"] >= 1  # the step was compiled, not run eagerly
    return losses, _weights(model, stage), frames


def _max_diff(a, b) -> float:
    return max(max(abs(x - y) for x, y in zip(a[0], b[0], strict=True)),
               max((a[1][k] - b[1][k]).abs().max().item() for k in a[1]))


def _equal(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


_PLAIN_COMPILED: dict = {}


def _plain_compiled(kind):
    if kind not in _PLAIN_COMPILED:
        _PLAIN_COMPILED[kind] = _train(None, kind, compiled=True)
    return _PLAIN_COMPILED[kind]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_compiled_step_matches_the_eager_step(stage):
    for kind in KINDS:
        eager = _train(stage, kind, compiled=False)
        compiled = _train(stage, kind, compiled=True)
        # Nothing compiled after step 2 (SGD's momentum buffers are made at step 1 and
        # recompile step 2, as in torch).
        assert compiled[2][1] == compiled[2][-1], (kind, compiled[2])
        if kind.startswith("adamw"):
            # torch's compiled AdamW, within rounding: clip_grad_norm_'s norm over the shards
            # (~1e-8), and `extra`'s update after its skipped steps, recomputed with its own
            # count (unused.py) in eager arithmetic (~1e-7). The eager step is further off:
            # torch's compiled AdamW is not its eager AdamW (~5e-7 here).
            assert _max_diff(compiled, _plain_compiled(kind)) < 2.5e-7, kind
            assert _max_diff(compiled, eager) < 2e-6, kind
        else:
            assert _equal(compiled, eager), (kind, _max_diff(compiled, eager))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["adamw_tensor_lr", "tierlift_adamw"])
def test_fullgraph_step_refused_before_anything_changes(stage, kind):
    def setup():
        model = _model(stage)
        opt = _optimizer(kind, model.parameters())
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            model(torch.randn(3, 8, generator=g), True).square().mean().backward()
            if not opt.state:  # one eager step first: the refusal must leave its state
                opt.step()
                opt.zero_grad()
        return model, opt

    model, opt = setup()
    shards = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in enumerate(opt.state.values())}
    torch._dynamo.reset()
    if kind == "tierlift_adamw":
        @torch.compile(fullgraph=True, backend="eager")
        def step():
            opt.step()
    else:
        step = torch.compile(opt.step, fullgraph=True, backend="eager")
    why = "all-gathers" if stage != 3 else r"stage 3\)"
    with pytest.raises(RuntimeError, match=rf"(?s)tierlift.zero.*{why}.*compile the step without "
                       r"fullgraph=True.*Nothing was changed"):
        step()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), shards, strict=True))
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[i][k])), k
    opt.step()  # eager: as if the refused call never happened
    ref_model, ref_opt = setup()
    ref_opt.step()
    got, want = tierlift.zero.full_state_dict(model), tierlift.zero.full_state_dict(ref_model)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_compiled_model_and_step_no_recompiles():
    """torch.compile(model) and the compiled step together: the step hooks' work is a graph
    break, not traced (dynamo once compiled frames of the checks inside every step's hooks),
    and after step 2 nothing is compiled again."""
    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    model = _model(2)
    opt = _optimizer("adamw_tensor_lr", model.parameters())
    step = torch.compile(opt.step, backend="eager")
    forward = torch.compile(model, backend="eager")
    g = torch.Generator().manual_seed(1)
    frames = []
    for i in range(STEPS):
        forward(torch.randn(3, 8, generator=g), i not in SKIPPED).square().mean().backward()
        step()
        opt.zero_grad()
        frames.append(counters["frames"]["total"])
    assert frames[1] == frames[-1], frames  # step 2: the forward without `extra`
    traced = {m.co_name for m in get_compilation_metrics() if "tierlift/zero/" in m.co_filename}
    assert traced <= {"_before_step"}, traced  # replaced.py's: returns at once when compiled


def _ranks(rank, world, tmp):
    """2 gloo ranks: `extra` unused on rank 1 only at step 1 (used over the ranks: stepped) and
    on both at step 2 (put back); compiled against eager, and the frames per step."""
    out = {}
    skipped = (1, 2) if rank else (2,)
    for stage in (1, 2, 3):
        for kind in ("sgd", "tierlift_adamw"):
            eager = _train(stage, kind, compiled=False, rank=rank, skipped=skipped)
            compiled = _train(stage, kind, compiled=True, rank=rank, skipped=skipped)
            out[(stage, kind)] = (_equal(compiled, eager), _max_diff(compiled, eager),
                                  compiled[2])
    return out


def test_compiled_step_two_ranks(tmp_path):
    for out in spawn_ranks(_ranks, str(tmp_path)):
        for case, (equal, diff, frames) in out.items():
            assert equal, (case, diff)
            assert frames[1] == frames[-1], (case, frames)
