"""The device part of an offloaded optimizer (OffloadConfig.device_fraction, DeepSpeed
ZeRO-Offload++'s "ratio"): a prefix of the parameters, by elements, keeps its optimizer state
beside the parameter instead of in the tiers, and is stepped by the optimizer's own
non-offloaded path (the fused CUDA kernel for CUDA parameters, the SIMD CPU kernel for CPU
ones) once the offloaded part has stepped.

The prefix starts at the first parameter of the first param group: in a usual backward those
gradients arrive last, so the overlap's worker would step their chunks after backward with
the device idle. Whole parameters only, as many as fit in `fraction` of all the elements that
get state (frozen ones get none either way).

Everything the offloaded step decides applies to the device part as to the rest: it is checked
with the others, before anything changes; the clip's norm and scaling already cover every
parameter (gradients.clip walks the param groups); a skipped step leaves it as it was; its
state is allocated before the offloaded part steps (a failure there, or in the offloaded part,
takes the fresh state back) and its kernels run after the offloaded part committed.
"""

from __future__ import annotations

import torch

from tierlift._shards import all_ranks_agree
from tierlift.offload.checks import every_finite
from tierlift.offload.layout import SCALE_KIND, kind_elems, reserves


def choose(groups: list[dict], fraction: float) -> list[set[int]]:
    """Per group, the indices of the parameters in the device part: from the first group's
    first parameter on, whole parameters while their elements stay within `fraction` of
    every parameter that gets state."""
    total = sum(p.numel() for g in groups for p in g["params"] if reserves(p))
    budget = fraction * total
    chosen: list[set[int]] = [set() for _ in groups]
    taken = 0
    for gi, group in enumerate(groups):
        for pi, p in enumerate(group["params"]):
            if not reserves(p):  # frozen: no state in either part
                continue
            if taken + p.numel() > budget:
                return chosen
            taken += p.numel()
            chosen[gi].add(pi)
    return chosen


def kept_kinds(p: torch.Tensor, kinds: list[str]) -> list[str]:
    """The kinds of its group's `kinds` that a device-part parameter keeps in
    optimizer.state: no master for an fp32 one (the parameter is its own)."""
    return [k for k in kinds if k != "master" or p.dtype != torch.float32]


class DevicePart:
    """The parameters of an Offloader whose state stays beside them (choose())."""

    def __init__(self, opt, fraction: float):
        self.opt = opt
        self.on = fraction > 0  # the same on every rank, unlike whether a rank holds any
        self.pis = choose(opt.param_groups, fraction)
        members = [g["params"][pi] for g, pis in zip(opt.param_groups, self.pis) for pi in pis]
        self.params = len(members)
        self.elems = sum(p.numel() for p in members)
        self._fresh: list = []  # parameters whose state prepare() created this step

    def __bool__(self) -> bool:
        return self.params > 0

    def holds(self, gi: int, pi: int) -> bool:
        return pi in self.pis[gi]

    def stats(self) -> dict:
        return {"device_part_params": self.params, "device_part_elems": self.elems}

    def _groups(self) -> list[tuple[int, dict]]:
        """(gi, the group restricted to its device parameters with a gradient) per group that
        has some: what Adam._check_group and _step_group take."""
        out = []
        for gi, group in enumerate(self.opt.param_groups):
            params = [group["params"][pi] for pi in sorted(self.pis[gi])
                      if group["params"][pi].grad is not None]
            if params:
                out.append((gi, {**group, "params": params}))
        return out

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for _, g in self._groups() for p in g["params"]]

    def finite(self, finite: bool, zero: bool, everyone: list) -> bool:
        """skip_nonfinite: whether the device part's gradients are finite too (the offloaded
        part's verdict `finite`); under ZeRO every rank agrees again."""
        if finite and self:
            grads = [g for g in self.grads() if g.numel()]
            finite = not grads or every_finite(grads)
        if zero and self.on:
            finite = all_ranks_agree(everyone, finite)
        return finite

    def check(self) -> None:
        """The optimizer's own checks of the device part (Adam._check_group), with the
        offloaded part's, before anything changes."""
        for gi, group in self._groups():
            self.opt._check_group(gi, group)

    def prepare(self) -> None:
        """Allocates the state of parameters stepping for the first time, before the offloaded
        part steps; taken back (forget()) if anything fails before launch()."""
        self._fresh = []
        try:
            for _, group in self._groups():
                for p in group["params"]:
                    if "exp_avg" not in self.opt.state.get(p, {}):
                        self._fresh.append(p)
                    # the kernels refresh masters themselves (Adam._step_group)
                    self.opt._init_state(p, group["amsgrad"], refresh=False)
        except BaseException:
            self.forget()
            raise

    def forget(self) -> None:
        """The step failed before launch(): the state prepare() created goes."""
        for p in self._fresh:
            self.opt.state.pop(p, None)
        self._fresh = []

    def launch(self, scale: torch.Tensor | None) -> None:
        """Steps the device part as the optimizer without offload would; `scale`: the
        GradScaler scale its gradients still carry (the offloaded part's), or None."""
        self._fresh = []
        for _, group in self._groups():
            self.opt._step_group(group, scale)

    def snapshot(self, sd: dict) -> None:
        """The device part's entries of a state dict become host copies, as the offloaded
        part's are (materialize()): a snapshot that later steps do not change."""
        i = 0
        for gi, group in enumerate(self.opt.param_groups):
            for pi in range(len(group["params"])):
                if pi in self.pis[gi] and i in sd["state"]:
                    sd["state"][i] = {k: v.detach().to("cpu", copy=True)
                                      if isinstance(v, torch.Tensor) else v
                                      for k, v in sd["state"][i].items()}
                i += 1

    def take(self, loaded: dict) -> dict:
        """Splits {param: state} being loaded: returns the device part's, removing it from
        `loaded` (what the tiers ingest)."""
        mine = {}
        for gi, group in enumerate(self.opt.param_groups):
            for pi in self.pis[gi]:
                p = group["params"][pi]
                if p in loaded:
                    mine[p] = loaded.pop(p)
        return mine

    def load(self, loaded: dict, kinds: list[list[str]]) -> None:
        """Puts the loaded state (in the optimizer's state format) beside each device
        parameter, on its device: the kinds its group's tier would hold (`kinds`, per group;
        no master for an fp32 parameter, its own), checked first. The optimizer's state holds
        only step counts here (Adam's load), in a dict that a failed load drops."""
        todo = []
        for gi, group in enumerate(self.opt.param_groups):
            for pi in sorted(self.pis[gi]):
                p = group["params"][pi]
                keep = kept_kinds(p, kinds[gi])
                for k, v in loaded.get(p, {}).items():
                    if k not in keep or not isinstance(v, torch.Tensor):
                        continue
                    want = kind_elems(k, p.numel())
                    if v.numel() != want:
                        raise ValueError(f"the state {k!r} of param_groups[{gi}]['params']"
                                         f"[{pi}] has {v.numel()} elements, {want} expected "
                                         f"(the parameter has {p.numel()})")
                    shape = p.shape if k != SCALE_KIND else (want,)
                    todo.append((p, k, v.detach().reshape(shape)))
        for p, k, v in todo:
            self.opt.state[p][k] = v.to(p.device, copy=True).contiguous()
        for p in loaded:  # its own count: steps add to it in place (Adam._step_group)
            step = self.opt.state[p].get("step")
            if isinstance(step, torch.Tensor):
                self.opt.state[p]["step"] = step.clone()

    def replace(self, loaded: dict) -> None:
        """A checkpoint load committed: each device parameter's state becomes its entry in
        `loaded` ({param: state}, ready on its device), or none (it starts fresh, as in
        torch, where the checkpoint has none)."""
        for gi, group in enumerate(self.opt.param_groups):
            for pi in self.pis[gi]:
                p = group["params"][pi]
                if p in loaded:
                    self.opt.state[p] = loaded[p]
                else:
                    self.opt.state.pop(p, None)

