"""A small torch.distributed.checkpoint for the import-dcp tests: the model it holds and the
save (one process, no process group). conftest.py's dcp_dir fixture is one of it."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def model(seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def save(state: dict, where):
    """dcp.save(state) into `where` (returned); its warning that torch.distributed is not
    initialized (a single process) is expected here."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(where))
    return where
