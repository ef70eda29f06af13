"""All-or-nothing fills of an Offloader's tiers, and the undo journal behind them.

A fill (a checkpoint load, Offloader.ingest of a state dict) writes NVMe chunks, and host
chunks with two generations, to the uncommitted generation and flips them all at the end; host
chunks with one generation are filled in place, the bytes each fill replaces going first to a
Journal, played back in reverse if anything fails (NVMe chunks with one generation are rewritten
in place with no undo: the Offloader then refuses to step until a fill succeeds).
tierlift.checkpoint uses the same Journal for the model tensors it loads in place.
"""

from __future__ import annotations

import contextlib
import tempfile

import numpy as np
import torch


class Journal:
    """The bytes in-place fills replace, in an unnamed temporary file (no host memory beyond one
    tensor's staging copy for device tensors), so the fills can be undone in reverse order.
    Holds numpy arrays or contiguous tensors of any dtype and device."""

    def __init__(self):
        self.file = None
        self.kept: list[tuple[np.ndarray | torch.Tensor, int]] = []

    def keep(self, arr: np.ndarray | torch.Tensor) -> None:
        if self.file is None:
            self.file = tempfile.TemporaryFile(prefix="tierlift-undo-")
        self.kept.append((arr, self.file.tell()))
        self.file.write(_bytes(arr.detach().cpu() if isinstance(arr, torch.Tensor) else arr))

    def undo(self) -> None:
        for arr, pos in reversed(self.kept):
            self.file.seek(pos)
            host = arr.detach() if isinstance(arr, torch.Tensor) else arr
            staged = isinstance(arr, torch.Tensor) and (arr.device.type != "cpu"
                                                        or not arr.is_contiguous())
            if staged:
                host = torch.empty_like(host, device="cpu")
            out = _bytes(host)
            if self.file.readinto(out) != out.nbytes:
                raise RuntimeError("the undo journal of a failed checkpoint load is short; the "
                                   "state is inconsistent")
            if staged:
                arr.detach().copy_(host)
        self.kept = []

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _bytes(arr: np.ndarray | torch.Tensor) -> np.ndarray:
    """A writable uint8 view of a contiguous host array or tensor (any dtype, bf16 included)."""
    if isinstance(arr, torch.Tensor):
        return arr.contiguous().reshape(-1).view(torch.uint8).numpy()
    return arr.reshape(-1).view(np.uint8)


@contextlib.contextmanager
def filling(engine, before_commit=None):
    """Yields (journal, flips) to a fill of an Offloader's tiers; at the end every write
    reaches the device, `before_commit` runs (the cross-rank vote), then the (tier, chunk)
    pairs in `flips` change generation. Anything raised on the way plays the journal back and
    flips nothing, so the fill is all-or-nothing."""
    journal, flips = Journal(), []
    try:
        yield journal, flips
        if engine is not None:
            engine.sync()
        if before_commit is not None:
            before_commit()
    except BaseException:
        journal.undo()
        raise
    finally:
        journal.close()
    for tier, ci in flips:
        tier.flip(ci)
