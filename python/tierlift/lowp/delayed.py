"""Delayed scaling for Float8Linear (Float8Recipe.amax_history_len > 0).

A delayed layer keeps two fp32 buffers of amax_history_len entries, newest first
(TransformerEngine's layout): `fp8_amax_history_x` (its input, E4M3) and `fp8_amax_history_g`
(grad_output, E5M2). An entry never written holds -1 (no amax is negative); a history whose
max is not above 0 is "never filled" (one that saw only all-zero tensors, an empty batch,
counts as never filled: its scale 1 would quantize the next small tensor coarsely). A step's
scale is scale_from_amax(max(history)), computed on the device inside the quantize
(ops.fp8_quantize_from_history), which reads x once, returning the amax for the history. The
weight keeps its just-in-time scale: a weight loaded or edited mid-training, and ZeRO-3's FP8
all-gather (which quantizes it at gather time), keep their exact scale, and at training shapes
its amax read is a small part of the step.

Nothing about a history lives on the host but the amaxes not yet in it, so whatever writes the
buffers (load_state_dict, tierlift.checkpoint and zero.load_full_state_dict copying into
state_dict()'s tensors, ZeRO's buffer broadcast, activation offload restoring them for a
recompute) leaves a consistent state, and no step reads a device value on the host.

A never-filled history gives the quantizer the largest scale of the format's rule (FLT_MAX, or
2^127 with power-of-two scales: the rule's scale for the smallest amax): any finite non-zero
value whose own scale is smaller clips under it, so the quantizer takes x's own scale, i.e.
exactly the just-in-time quantize (tests/python/test_lowp_delayed.py checks every amax around
the threshold). A tensor without a finite non-zero value has the same codes under any scale; its
scale is set to the just-in-time 1 (so a GEMM never multiplies its Inf codes by a tiny inverse
scale a GPU may flush to zero).

When amaxes enter: x's at that forward's backward, g's once g is quantized there; both are
queued and put into the histories at the layer's next forward that is not a recompute (one run
inside a backward: torch.utils.checkpoint, reentrant or not, and tierlift's recompute tier) and
that no earlier forward with grad of the layer still awaits its backward, or at a save
(state_dict(), deepcopy, pickle: the saved histories hold them), which changes no step: until
that next forward, quantizes read the histories as they were before the save. So a recompute
sees the history its forward saw and is bit-identical to it, also when other micro-batches'
forwards and backwards interleave (1F1B); forwards without grad read the history and add
nothing. A second backward of one forward (retain_graph) adds g's amax again, not x's. Gradient
accumulation: with each micro-batch's forward right before its backward, each forward takes in
the amaxes of the backwards before it; with all forwards first (or interleaved), they wait for
the last backward and enter, in backward order, at the next forward. A forward with grad whose
graph is kept alive without a backward holds the queue until the graph is freed (the queue keeps
each history's newest amax_history_len amaxes, all that a flush would write, and warns once it
has held HELD_WARNING times as many). Reentrant checkpointing runs its first forward without
grad, so it is not counted: interleaved with other micro-batches' backwards (1F1B) its recompute
could see amaxes its forward did not; use use_reentrant=False there.

Under torch.distributed (world size > 1, reduce_amax) each amax is all-reduced (MAX, default
group, async_op) when queued and waited for when put into its history: every rank holds the
same history, the one a single process would build from the whole global batch. Every rank must
then run the same delayed layers' backwards in the same order (data parallelism; not experts
routed per rank, which should use reduce_amax=False).

Pairing check: the k-th reductions of two ranks must be the same layer's same history, else
amaxes of unrelated layers would mix. Each reduction is [amax, tag, -tag] (fp32, 12 bytes
instead of 4), tag = 2 * the layer's number + (0 for x, 1 for g), the number counting the
delayed layers this process built (Float8Linear, from_linear, convert), which is the same on
every rank that runs the same model code. After the MAX, the pairing held iff tag == -(-tag)
(every rank sent the same tag). CPU tensors are checked on the host at the wait (which has
synchronized anyway): a mismatch raises RuntimeError before any of the layer's queued amaxes
enters a history, and at every flush after (state_dict too) until a load replaces the
histories. CUDA tensors are checked with torch._assert_async (no host sync): a mismatch is a
device-side assert, which stops the process before any later kernel (the history write) runs.
Ranks that built different delayed layers before this one (a delayed model built on one rank
only) number them differently and are refused the same way; ranks that build different layers
under the same numbers (pipeline stages each building only its own blocks) are not told apart:
reduce_amax=False there.
"""

from __future__ import annotations

import itertools
import warnings

import torch
import torch.distributed as dist
from torch import nn

from tierlift import _extension, ops
from tierlift.lowp.recipe import Float8Recipe

NEVER_WRITTEN = -1.0
# amaxes queued per history entry before a held queue is warned about (a 1F1B step's
# micro-batches queue their amaxes for as long as the step lasts, far fewer)
HELD_WARNING = 64
HISTORIES = ("x", "g")
# numbers of the delayed layers this process builds, in order: a layer's pairing tag; below
# 2^23 so that the tags (up to 2 * number + 1) stay integers a float32 holds exactly
_layer_numbers = itertools.count()
_NUMBER_LIMIT = 2**23


def buffer_name(which: str) -> str:
    return f"fp8_amax_history_{which}"


def is_history_name(key: str) -> bool:
    """Whether a state_dict key names a delayed layer's amax history."""
    return any(key == buffer_name(w) or key.endswith("." + buffer_name(w)) for w in HISTORIES)


def new_history(length: int, device) -> torch.Tensor:
    return torch.full((length,), NEVER_WRITTEN, dtype=torch.float32, device=device)


def tag_of(number: int, which: str) -> int:
    return 2 * number + HISTORIES.index(which)


def describe_tag(tag: int) -> str:
    number, which = divmod(int(tag), 2)
    return f"delayed layer #{number}'s {HISTORIES[which]}"


class PendingAmaxes:
    """A layer's amaxes from finished backwards, not yet in their history (module docstring)."""

    # The histories as they were before a save (state_dict, deepcopy, pickle) wrote the queue
    # into them: what a backward, recompute or forward runs on until the next forward that takes
    # the queue in, so that a save changes no step's numbers. A class default: pickles made
    # before it lack it.
    seen: dict[str, torch.Tensor] | None = None
    # The histories the layer's last forward that was not a recompute read: what a recompute
    # reads (the forwards awaiting their backward all read them: none takes the queue in while
    # one awaits), also where the module holds other tensors by then (torch.func.functional_call
    # given the histories has put its own back before the backward runs).
    forward_view: dict[str, torch.Tensor] | None = None
    held = 0
    number = 0  # the layer's number in construction order (pairing tags); pickles before it: 0
    refused: str | None = None  # a reduction paired with other layers': every flush raises this
    _tags: dict | None = None  # (which, device) -> [tag, -tag], made once per device

    def __init__(self, number: int = 0) -> None:
        # (which, amax [1] or, reduced, [amax, tag, -tag], its Work or None once waited for)
        self.items: list[tuple[str, torch.Tensor, object]] = []
        self.awaiting = 0  # forwards with grad whose backward has not run (their graph lives)
        self.held = 0  # amaxes queued since the histories last took the queue in
        self.number = number

    def __getstate__(self):  # a copy awaits no backward: no autograd context holds it
        return dict(self.__dict__, awaiting=0, seen=None, forward_view=None, _tags=None)

    def tagged(self, which: str, amax: torch.Tensor) -> torch.Tensor:
        """[amax, tag, -tag]: after the MAX over ranks, tag == -(-tag) iff all sent this tag."""
        if self._tags is None:
            self._tags = {}
        key = (which, amax.device)
        if key not in self._tags:  # made once: no host-to-device copy per reduction
            tag = tag_of(self.number, which)
            self._tags[key] = torch.tensor([tag, -tag], dtype=torch.float32, device=amax.device)
        return torch.cat([amax, self._tags[key]])

    def push(self, which: str, amax: torch.Tensor, reduce: bool, length: int) -> None:
        """Queues an amax of history `which` (of `length` entries). Only its newest `length`
        are kept: a flush of more writes the history from them alone, so a queue held by a
        graph that lives on (an exception's traceback kept by a notebook) stays bounded."""
        amax = amax.detach().float().reshape(1)
        work = None
        if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # issued in backward order, the same on every rank; waited for at the next write
            amax = self.tagged(which, amax)  # a new tensor, reduced in place
            work = dist.all_reduce(amax, op=dist.ReduceOp.MAX, async_op=True)
        else:
            amax = amax.clone()
        self.items.append((which, amax, work))
        self.held += 1
        same = [i for i, item in enumerate(self.items) if item[0] == which]
        if len(same) > length:
            oldest = self.items.pop(same[0])
            self.check_pairing(*oldest)  # dropped, but a mispairing still refuses the layer
        if self.held == HELD_WARNING * length:
            warnings.warn(
                f"{self.held} amaxes from a delayed FP8 layer's backwards have not entered its "
                f"histories: a forward of it with grad still awaits its backward (its graph "
                f"is kept alive, e.g. by an output or an exception's traceback held on to), so "
                f"its scales come from the history before it; free that graph", stacklevel=2)

    def check_pairing(self, which: str, packed: torch.Tensor, work) -> None:
        """Waits for a reduction and checks its tags (module docstring): on the host for CPU
        tensors (a mismatch is kept in `refused`), with a device-side assert otherwise."""
        if work is None:
            return
        work.wait()
        if packed.device.type != "cpu":
            torch._assert_async(packed[1] == -packed[2], _mispaired_message(
                self.number, which, None))
            return
        if self.refused is None and packed[1].item() != -packed[2].item():
            self.refused = _mispaired_message(self.number, which, packed)

    def flush(self, layer: nn.Module) -> None:
        """Puts the queued amaxes into the layer's histories, oldest first, once every
        reduction among them is checked (a mispaired one raises, the histories unchanged).
        Each history becomes a new tensor rather than being written in place: tierlift's
        recompute tier restores, for the recompute, the buffers a block's forward wrote in
        place to their values before it, which here would be the history without the amaxes
        this forward took in."""
        self.held = 0
        checked = []
        for which, amax, work in self.items:
            self.check_pairing(which, amax, work)
            checked.append((which, amax, None))  # waited for: a refused queue waits no more
        self.items = checked
        if self.refused is not None:
            raise RuntimeError(f"{layer.__class__.__name__}(in_features={layer.in_features}, "
                               f"out_features={layer.out_features}): {self.refused}")
        if not self.items:
            return
        if self.seen is None:
            self.seen = {w: layer._buffers[buffer_name(w)] for w in HISTORIES}
        items, self.items = self.items, []
        # a forward under torch.inference_mode (evaluation) would otherwise make them inference
        # tensors, which refuse the in-place writes of loads and buffer broadcasts (DDP, ZeRO)
        with torch.no_grad(), torch.inference_mode(False):
            for which, amax, _ in items:
                name = buffer_name(which)
                h = layer._buffers[name]
                layer._buffers[name] = torch.cat([amax[:1].to(device=h.device, dtype=h.dtype),
                                                  h[:-1]])

    def take_in(self, layer: nn.Module) -> None:
        """A forward's flush: the queue enters and every reader sees the histories from now on."""
        self.flush(layer)
        self.seen = None

    def drop(self) -> None:
        """Forgets the queue and a refusal (a load replaces the histories); reductions in
        flight complete."""
        for _, _, work in self.items:
            if work is not None:
                work.wait()
        self.items = []
        self.seen = None
        self.held = 0
        self.refused = None


def _mispaired_message(number: int, which: str, packed: torch.Tensor | None) -> str:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    own = tag_of(number, which)
    if packed is None:  # a device-side assert's: the reduced tags stay on the device
        paired = "another layer's"
    else:
        low, high = -packed[2].item(), packed[1].item()
        others = sorted({low, high} - {own})
        paired = " and ".join(describe_tag(t) for t in others) + (
            " (and possibly layers between)" if len(others) == 2 else "")
    return (f"the delayed FP8 amax all-reduce paired unrelated layers: on rank {rank}, "
            f"{describe_tag(own)} amax (layer numbers count the delayed layers each process "
            f"built) was reduced with {paired} amax from another rank, so their MAX would mix "
            f"the ranges of unrelated layers. Nothing entered this layer's histories. Every rank "
            f"must run the same delayed layers' backwards in the same order (data "
            f"parallelism); for experts routed per rank (MoE), pipeline stages or uneven "
            f"inputs use Float8Recipe(..., reduce_amax=False); ranks that built different "
            f"delayed layers (a delayed model built on one rank only) number them differently: "
            f"build the same ones in the same order on every rank. Loading a state_dict or "
            f"checkpoint into the model clears this")


def attach(layer: nn.Module, recipe: Float8Recipe, device) -> None:
    """Gives a Float8Linear of a delayed recipe its never-filled histories (on `device`) and its
    queue; a layer of another recipe gets nothing (its state_dict stays nn.Linear's)."""
    if not recipe.delayed:
        return
    for which in HISTORIES:
        layer.register_buffer(buffer_name(which), new_history(recipe.amax_history_len, device))
    layer._fp8_pending = PendingAmaxes(next(_layer_numbers) % _NUMBER_LIMIT)


def pending(layer: nn.Module) -> PendingAmaxes | None:
    return layer.__dict__.get("_fp8_pending")


def recomputing() -> bool:
    """A forward run inside a backward: a recompute (activation checkpointing)."""
    return torch._C._current_autograd_node() is not None


def flush_unless_recomputing(layer: nn.Module) -> None:
    """A forward's read of the histories: the queued amaxes enter first, except in a recompute,
    which must see what its forward saw, and while a forward awaits its backward (whose
    recompute must too)."""
    queue = pending(layer)
    if queue is None or recomputing():
        return
    if queue.awaiting == 0:
        queue.take_in(layer)
    queue.forward_view = {w: history(layer, w) for w in HISTORIES}


def forward_history(layer: nn.Module, which: str) -> torch.Tensor:
    """The history a forward's quantize of `which` reads: a recompute reads the one its forward
    read (PendingAmaxes.forward_view), any other forward the current one."""
    queue = pending(layer)
    if recomputing() and queue.forward_view is not None:
        return queue.forward_view[which]
    return history(layer, which)


def history(layer: nn.Module, which: str) -> torch.Tensor:
    """The history a quantize of `which` reads: the one before a save's flush until the next
    forward takes the queue in (PendingAmaxes.seen), else the layer's buffer."""
    seen = pending(layer).seen
    return seen[which] if seen is not None else layer._buffers[buffer_name(which)]


class AwaitingBackward:
    """Held by the autograd context of a forward with grad: counted in its layer's queue until
    its backward runs or its graph is freed without one."""

    def __init__(self, queue: PendingAmaxes) -> None:
        self.queue = queue
        queue.awaiting += 1

    def done(self) -> None:
        if self.queue is not None:
            self.queue.awaiting -= 1
            self.queue = None

    __del__ = done


def quantize_from_history(t: torch.Tensor, history: torch.Tensor, fp8_dtype: torch.dtype,
                          pow2: bool, with_transposed: bool, transposed_copy: str):
    """(q, s, qt, st, amax) as lowp.linear's _quantize gives (qt, st None unless asked for),
    with the scale the history gives, taken where t is (on a GPU: four launches, no host sync);
    amax: t's finite amax [1]."""
    dual = with_transposed and transposed_copy == "dual"
    quantize = ops.fp8_quantize_from_history
    if t.is_meta and _extension.available():
        # the op's fake kernel gives the shapes; the pure-torch reference, which ops takes off
        # CPU and CUDA, reads the history's max on the host, which meta tensors have not
        quantize = torch.ops.tierlift.fp8_quantize_from_history
    q, s, qt, amax = quantize(t, history.detach().to(t.device), fp8_dtype, dual, pow2)
    return _outputs(q, s, qt, amax, with_transposed)


def _outputs(q, s, qt, amax, with_transposed: bool):
    if not with_transposed:
        return q, s, None, None, amax
    if qt is None:  # transposed_copy="separate": q's codes transposed, the same scale
        qt = q.t().contiguous()
    return q, s, qt, s, amax


def describes(state_dict: dict, prefix: str, layer: nn.Module) -> bool:
    """Whether a state_dict being loaded holds any entry of `layer` (at `prefix`)."""
    own = (*layer._parameters, *layer._buffers)
    if any(prefix + name in state_dict for name in own):
        return True
    # entries not named after the layer's own tensors (a parametrization's, extra state)
    return any(key.startswith(prefix) for key in state_dict)


def load_or_reset(layer: nn.Module, state_dict: dict, prefix: str,
                  missing_keys: list[str]) -> None:
    """After nn.Module's own load: a history the state_dict lacks (a plain nn.Linear or HF
    checkpoint) is reset to never filled, not reported missing (nor kept from before the load,
    nor read as zeros), also on a layer built on meta (assign=True). A layer the state_dict has
    no entry of (strict=False) is left alone. A history assign=True took from the dict in
    another dtype (a checkpoint saved in bf16) is widened to fp32, as a load without assign
    copies it: the quantizers read fp32 histories."""
    for which in HISTORIES:
        key = prefix + buffer_name(which)
        history = layer._buffers[buffer_name(which)]
        if key in state_dict:
            if history.dtype != torch.float32:
                layer._buffers[buffer_name(which)] = history.float()
            continue
        if key in missing_keys:
            missing_keys.remove(key)
        if history.is_meta:
            # built on meta and loaded with assign=True: the weights arrived, nothing can be
            # filled in place; the histories start never filled where the weight now is
            layer._buffers[buffer_name(which)] = new_history(history.numel(),
                                                             layer.weight.device)
            continue
        with torch.no_grad():
            history.fill_(NEVER_WRITTEN)


def keep_fp32(layer: nn.Module, before: dict[str, torch.Tensor]) -> None:
    """After Module._apply (.to(), .half(), to_empty()): the histories stay fp32 with their
    values (a cast to bf16 would round amaxes), on the new device; from meta (to_empty) they
    start never filled."""
    for which in HISTORIES:
        name = buffer_name(which)
        old, new = before.get(name), layer._buffers.get(name)
        if old is None or new is None or (new.dtype == torch.float32 and not old.is_meta):
            continue
        if old.is_meta:
            layer._buffers[name] = new_history(old.numel(), new.device)
        else:
            layer._buffers[name] = old.to(device=new.device, dtype=torch.float32)
