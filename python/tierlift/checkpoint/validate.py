"""The values a checkpoint's JSON and step tensors hold, checked before anything is loaded as
the optimizer's constructor checks its arguments (lr >= 0 and finite, 0 <= beta < 1, eps >= 0,
weight_decay >= 0 and finite, a step a whole number >= 0), whether or not the checkpoint has a
manifest: a value no optimizer accepts is an error naming the file and the value, never a
NaN learning rate or a negative step taken into training. JSON parses NaN and Infinity, so
they are refused here. A saved group's value must also be of the kind the optimizer's group
holds (a number where it has a number, a flag where it has a flag) (fits()).
"""

from __future__ import annotations

import math
import numbers
import re

import torch

# key: (the least value, whether the least value itself is allowed)
_BOUNDS = {"lr": (0.0, True), "eps": (0.0, True), "weight_decay": (0.0, True),
           "momentum": (0.0, True), "dampening": (None, True), "alpha": (0.0, True),
           "initial_lr": (0.0, True)}
_FLAGS = ("amsgrad", "maximize", "nesterov", "capturable", "differentiable",
          "decoupled_weight_decay", "foreach", "fused")  # foreach/fused may be None
_STEP_KEY = re.compile(r"(optim\.\d+|unit\d+)\.step")  # rank file keys (format.py, replicated.py)


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _number(where: str, key: str, value, least, inclusive: bool) -> None:
    if not _real(value) or not math.isfinite(value):
        raise ValueError(f"{where}: {key} is {value!r}; it must be a finite number")
    if least is not None and (value < least or value == least and not inclusive):
        raise ValueError(f"{where}: {key} is {value!r}; it must be >= {least}")


def param_group(group: dict, where: str) -> None:
    """Raises a ValueError naming the first value of saved param group `group` that the
    optimizers' constructors refuse."""
    if not isinstance(group, dict):
        raise ValueError(f"{where} is not a JSON object")
    for key, value in group.items():
        if key in _BOUNDS:
            _number(where, key, value, *_BOUNDS[key])
        elif key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise ValueError(f"{where}: betas is {value!r}; it must be a pair")
            for i, b in enumerate(value):
                _number(where, f"betas[{i}]", b, 0.0, True)
                if b >= 1.0:
                    raise ValueError(f"{where}: betas[{i}] is {b!r}; it must be in [0, 1)")
        elif key in _FLAGS:
            if not (isinstance(value, bool) or value is None and key in ("foreach", "fused")):
                raise ValueError(f"{where}: {key} is {value!r}; it must be true or false")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}: {key} is {value!r}; it must be a finite number")


def step(value, where: str) -> None:
    """Raises a ValueError unless `value` (a number or a one-element tensor) is a step count:
    a whole number >= 0."""
    if hasattr(value, "numel"):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{where}: the step is a tensor of shape {tuple(value.shape)} "
                             f"and dtype {value.dtype}; it must be one number")
        value = value.item()
    if not _real(value) or not math.isfinite(value) or value < 0 or value != int(value):
        raise ValueError(f"{where}: the step is {value!r}; it must be a whole number >= 0")


def metadata(meta: dict, file: str) -> None:
    """The values of a metadata.json (format.py, replicated.py) that load() takes."""
    groups = meta.get("param_groups", [])
    if not isinstance(groups, list):
        raise ValueError(f"{file}: param_groups is not a list")
    for gi, group in enumerate(groups):
        param_group(group, f"{file}: param_groups[{gi}]")
    scalars = meta.get("optimizer_scalars") or {}
    if not isinstance(scalars, dict):
        raise ValueError(f"{file}: optimizer_scalars is not a JSON object")
    for key, value in scalars.items():
        if key.endswith(".step"):
            step(value, f"{file}: optimizer_scalars[{key!r}]")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{file}: optimizer_scalars[{key!r}] is {value!r}; it must be a "
                             "finite number")


def step_tensors(tensors: dict, file: str) -> None:
    """The step counts among a rank file's tensors ("optim.3.step", "unit2.step")."""
    for key, value in tensors.items():
        if _STEP_KEY.fullmatch(key):
            step(value, f"{file}: {key}")


def fits(saved: list[dict], groups: list[dict], where: str) -> None:
    """Raises a ValueError naming the first saved hyperparameter whose kind differs from the
    value the optimizer's group holds (a number where it has a flag, a pair where it has one
    number): load() sets them on the optimizer as they are."""
    for gi, (mine, theirs) in enumerate(zip(groups, saved)):
        for key, value in theirs.items():
            if key not in mine or key == "params":
                continue
            have = mine[key]
            if not _same_kind(have, value):
                raise ValueError(f"{where}: param_groups[{gi}][{key!r}] is {value!r} in the "
                                 f"checkpoint, but the optimizer holds {have!r} there (another "
                                 "kind of value)")


def _same_kind(have, value) -> bool:
    if isinstance(have, bool):
        return isinstance(value, bool) or value is None  # foreach/fused: None is "default"
    if _real(have) or isinstance(have, torch.Tensor):
        return _real(value)
    if isinstance(have, (list, tuple)):
        return isinstance(value, list) and len(value) == len(have)
    return True
