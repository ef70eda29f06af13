"""A parameter's state tensors have its shape: checked for a loaded state dict and, at each
step, for a parameter whose data was replaced after its state was made."""

from __future__ import annotations

import torch

from tierlift.optim.hyper import CODES_KEY

# State tensors of the parameter's shape (the compact state's scales are per block).
SHAPED_KEYS = ("exp_avg", "exp_avg_sq", CODES_KEY, "max_exp_avg_sq", "master")


def _first_mismatch(p: torch.Tensor, state: dict):
    """(key, tensor) of the first state tensor whose shape is not p's, else None."""
    for k in SHAPED_KEYS:
        v = state.get(k)
        if isinstance(v, torch.Tensor) and v.shape != p.shape:
            return k, v
    return None


def check_loaded_shapes(p: torch.Tensor, saved: dict, index) -> None:
    """A loaded moment or master must have its parameter's shape, as torch's state does: one
    of the same size but another shape (a transposed weight, another model's config) would
    otherwise be stepped as if its elements lined up."""
    bad = _first_mismatch(p, saved)
    if bad is not None:
        k, v = bad
        raise ValueError(f"the loaded state {k!r} of parameter {index} has shape "
                         f"{tuple(v.shape)} but the parameter has shape {tuple(p.shape)}: "
                         "a state dict saved for another model or parameter order")


def check_state_follows(name: str, p: torch.Tensor, state: dict) -> None:
    """Refuses a parameter whose state tensors no longer have its shape: its data was replaced
    (`p.data = x`: an embedding grown, a weight stored transposed) after its state was made.
    The kernel steps flat memory, so a state of the same size would pair each element with
    another element's moments (torch's step raises on it), and one of another size would be
    refused by the kernel only after the step counts advanced."""
    bad = _first_mismatch(p, state)
    if bad is not None:
        k, v = bad
        raise RuntimeError(
            f"{name} has shape {tuple(p.shape)} but its optimizer state {k!r} has shape "
            f"{tuple(v.shape)}: its data was replaced (p.data = ...) after its state was "
            "made, and its moments no longer line up with its elements. Undo the change, "
            "or change each tensor of optimizer.state[p] the same way, or call "
            "optimizer.state[p].clear() to restart its moments. Nothing was changed")
