"""bench_offload.py --clipped: the overlapped offload optimizer on steps whose gradients are
clipped (below the gradients' norm), where every chunk stepped during backward is stepped
again in step().

Contenders, each its own model and optimizer, timed in turn within each round:
  abandon   overlap=True with the optimizer's own max_grad_norm, as shipped: step() takes the
            clip's norm first and the worker leaves the chunks it has not started
  wait      the same with that switched off (step() waits for every chunk the worker queued
            during backward, then steps them all again): the behaviour before
  torch-clip  overlap=True, clipped by torch.nn.utils.clip_grad_norm_ between backward and
            step() (the Hugging Face Trainer's way): the chunks the worker stepped before the
            clip are stepped again, those it starts after it read the clipped gradients and
            are kept, so step() waits for them
  no-overlap  overlap=False, the optimizer's own max_grad_norm
The model stands in for a large one on a GPU: a stack of tables whose backward is a device's
(the host sleeps BWD_S per table, then the table's gradient lands), so the worker has the cores
during backward, as on a GPU machine, and backward is short against the CPU Adam of the chunks
(each table 4M parameters): the worker is behind when step() starts. Each row gives the median
step() (with the torch clip before it, where there is one) and whole iteration (forward +
backward + step) time, and the chunks the worker left and those step() kept.
"""

from __future__ import annotations

import statistics
import time

import torch

from common import machine, print_table, write_json
from tierlift.offload.overlap import Overlap
from tierlift.optim import AdamW

CONTENDERS = ("abandon", "wait", "torch-clip", "no-overlap")
MAX_NORM = 1e-8  # below any of these gradients' norms: every step clips


BWD_S = 0.001  # a table's backward on the device, the host waiting for it


class _DeviceTable(torch.autograd.Function):
    """A table's forward and backward as the host sees a device's: it waits, then the
    gradient is there."""

    @staticmethod
    def forward(ctx, table, grad):
        ctx.grad = grad
        return table[0].sum()

    @staticmethod
    def backward(ctx, _):
        time.sleep(BWD_S)
        return ctx.grad, None


class _Tables(torch.nn.Module):
    def __init__(self, params: float):
        super().__init__()
        rows, width = 4096, 1024
        n = max(2, round(params / (rows * width)))
        torch.manual_seed(0)
        self.tables = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(rows, width)) for _ in range(n))
        self.grads = [torch.randn(rows, width) for _ in range(n)]

    def forward(self) -> torch.Tensor:
        return sum(_DeviceTable.apply(t, g) for t, g in zip(self.tables, self.grads))


class _Case:
    def __init__(self, name: str, params: float):
        self.name = name
        self.model = _Tables(params)
        self.torch_clip = name.startswith("torch-clip")
        self.opt = AdamW(self.model.parameters(), lr=1e-4, offload="cpu",
                         overlap=name != "no-overlap",
                         max_grad_norm=None if self.torch_clip else MAX_NORM,
                         chunk_bytes=4 << 20)
        self.steps, self.iters, self.left, self.kept = [], [], [], []

    def run(self, record: bool) -> None:
        abandon = Overlap.abandon
        if self.name == "wait":
            Overlap.abandon = lambda self: None  # noqa: E731 - step() waits for every chunk
        try:
            t0 = time.perf_counter()
            self.model().backward()
            t = time.perf_counter()
            norm = (float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM))
                    if self.torch_clip else None)
            self.opt.step()
            end = time.perf_counter()
        finally:
            Overlap.abandon = abandon
        st = self.opt.last_step_stats
        self.opt.zero_grad(set_to_none=True)
        if record:
            assert (norm if self.torch_clip else st["grad_norm"]) > MAX_NORM, \
                "the case must clip"
            self.steps.append(end - t)
            self.iters.append(end - t0)
            self.left.append(st.get("overlap_abandoned_chunks", 0))
            self.kept.append(st.get("overlap_kept_chunks", 0))


def bench_clipped(args) -> int:
    cases = [_Case(name, args.params) for name in CONTENDERS]
    for case in cases:  # warm-up: state and masters are created on the first step
        case.run(record=False)
    for _ in range(args.repeats):
        for case in cases:
            case.run(record=True)
    chunks = sum(len(lay.chunks) for lay in cases[0].opt._offload.layouts)
    base = statistics.median(cases[-1].steps)
    rows = []
    for case in cases:
        step, it = statistics.median(case.steps), statistics.median(case.iters)
        rows.append({"contender": case.name, "step_ms": step * 1e3, "iter_ms": it * 1e3,
                     "step_vs_no_overlap": step / base,
                     "chunks_left": statistics.median(case.left),
                     "chunks_kept": statistics.median(case.kept), "chunks": chunks})
        case.opt.close()
    print_table(rows, ["contender", "step_ms", "iter_ms", "step_vs_no_overlap", "chunks_left",
                       "chunks_kept", "chunks"],
                f"Clipped steps, overlapped ({args.params / 1e6:.0f}M params, {args.repeats} "
                f"rounds; {machine()['cpu']})")
    write_json("offload_clipped", {"machine": machine(), "params": args.params, "rows": rows})
    return 0
