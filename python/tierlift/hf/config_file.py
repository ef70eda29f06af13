"""The config file of `python -m tierlift.hf.launch --config zero.json`: ZeroConfig's fields as
JSON (or YAML), plus how the script's from_pretrained loads.

    {"stage": 3, "offload_params": "cpu",
     "mixed_precision": {"param_dtype": "bfloat16"},
     "optimizer_kwargs": {"offload": "cpu"},
     "from_pretrained": "partitioned"}

Keys are ZeroConfig's fields (tierlift/hf/config.py) with JSON values: dtypes as strings
("bfloat16", "bf16", "float16", "fp16", "float32", "fp32"), mixed_precision as an object of
tierlift.zero.MixedPrecision's fields or null. A key the file does not know, or a value of the
wrong type, is an error naming the file and the key (never a silent default).
from_pretrained: "partitioned" (default: each rank reads its slices from the safetensors files,
the model is never whole on a rank) or "whole" (from_pretrained is left as it is and the
Trainer shards the loaded model: for scripts that change the model between from_pretrained and
the Trainer, e.g. peft's get_peft_model).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from tierlift.hf.config import ZeroConfig
from tierlift.zero import MixedPrecision

FROM_PRETRAINED = ("partitioned", "whole")
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}
# ZeroConfig's annotations (strings) as the JSON types that may stand for them.
_JSON_TYPES = {"int": (int,), "str": (str,), "bool": (bool,), "None": (type(None),),
               "dict[str, Any]": (dict,), "MixedPrecision": (dict,)}


@dataclasses.dataclass(kw_only=True, frozen=True)
class LaunchConfig:
    """What a config file says: the ZeroConfig the Trainer shards with, and how the script's
    from_pretrained loads ("partitioned" or "whole")."""

    zero: ZeroConfig
    from_pretrained: str = "partitioned"

    def __post_init__(self) -> None:
        if not isinstance(self.zero, ZeroConfig):
            raise TypeError(f"LaunchConfig.zero must be a ZeroConfig, got "
                            f"{type(self.zero).__name__}")
        if self.from_pretrained not in FROM_PRETRAINED:
            raise ValueError(f"from_pretrained must be one of {FROM_PRETRAINED}, got "
                             f"{self.from_pretrained!r}")


def _dtype(value, where: str) -> torch.dtype | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in _DTYPES:
        raise ValueError(f"{where} must be one of {sorted(_DTYPES)} (or null), got {value!r}")
    return _DTYPES[value.lower()]


def _check_type(value, annotation: str, where: str) -> None:
    allowed = []
    for part in annotation.split(" | "):
        if part not in _JSON_TYPES:  # a ZeroConfig field this reader does not know yet
            raise TypeError(f"{where}: ZeroConfig's type {annotation!r} has no JSON form here")
        allowed.extend(_JSON_TYPES[part])
    # JSON true is a bool, and bool is an int to Python: not a stage.
    if isinstance(value, bool) and bool not in allowed:
        ok = False
    else:
        ok = isinstance(value, tuple(allowed))
    if not ok:
        names = " or ".join("null" if t is type(None) else "object" if t is dict else t.__name__
                            for t in allowed)
        raise TypeError(f"{where} must be {names}, got {type(value).__name__} {value!r}")


def _mixed_precision(value: dict, where: str) -> MixedPrecision:
    known = {f.name for f in dataclasses.fields(MixedPrecision)}
    for key in value:
        if key not in known:
            raise ValueError(f"{where} has an unknown key {key!r}; MixedPrecision takes "
                             f"{sorted(known)}")
    return MixedPrecision(**{k: _dtype(v, f"{where}.{k}") for k, v in value.items()})


def _with_dtypes(kwargs: dict, where: str) -> dict:
    """Options whose name ends in _dtype take dtype strings (state_dtype="bfloat16")."""
    return {k: _dtype(v, f"{where}.{k}") if k.endswith("_dtype") and isinstance(v, str) else v
            for k, v in kwargs.items()}


def parse_config(data: Any, source: str = "config") -> LaunchConfig:
    """A LaunchConfig from the parsed file (a dict); `source` names it in errors."""
    if not isinstance(data, dict):
        raise TypeError(f"{source} must hold an object of ZeroConfig fields, got "
                        f"{type(data).__name__}")
    fields = {f.name: f.type for f in dataclasses.fields(ZeroConfig)}
    zero: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{source}: {key!r}"
        if key == "from_pretrained":
            _check_type(value, "str", where)
            continue
        if key not in fields:
            raise ValueError(f"{source} has an unknown key {key!r}; it takes "
                             f"{sorted([*fields, 'from_pretrained'])}")
        _check_type(value, fields[key], where)
        if key == "mixed_precision" and value is not None:
            value = _mixed_precision(value, where)
        elif key in ("shard_kwargs", "optimizer_kwargs"):
            value = _with_dtypes(value, where)
        zero[key] = value
    try:
        cfg = ZeroConfig(**zero)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{source}: {exc}") from exc
    return LaunchConfig(zero=cfg, from_pretrained=data.get("from_pretrained", "partitioned"))


def load_config(path: str | os.PathLike) -> LaunchConfig:
    """Reads a config file: JSON, or YAML when it ends in .yaml / .yml (needs pyyaml)."""
    path = os.fspath(path)
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as exc:
            raise ImportError(f"{path} is YAML, which needs pyyaml: pip install pyyaml (or "
                              "write the file as JSON)") from exc
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return parse_config(data, path)
