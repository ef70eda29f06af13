"""Policy: where each block's saved activations go: keep (left in place), ram, nvme,
recompute (activation checkpointing: nothing saved, a second forward in backward), or auto (RAM
while cpu_budget lasts, then NVMe)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tierlift.activations.config import TIERS

CHOICES = (*TIERS, "auto")


@dataclass(frozen=True)
class Policy:
    tiers: tuple[str, ...]

    def __post_init__(self):
        tiers = tuple(self.tiers)
        object.__setattr__(self, "tiers", tiers)
        if not tiers:
            raise ValueError("a Policy needs one tier per block, got none")
        bad = [t for t in tiers if t not in CHOICES]
        if bad:
            raise ValueError(f"unknown tier(s) {bad}: each block's tier must be one of {CHOICES}")

    @classmethod
    def of(cls, spec: str | Sequence[str] | Policy, n_blocks: int) -> Policy:
        """One tier for every block (a string), one per block (a sequence), or a Policy whose
        length matches."""
        if isinstance(spec, str):
            return cls((spec,) * n_blocks)
        policy = spec if isinstance(spec, Policy) else cls(tuple(spec))
        if len(policy.tiers) != n_blocks:
            raise ValueError(f"the policy names {len(policy.tiers)} tiers but the model has "
                             f"{n_blocks} blocks")
        return policy

    @classmethod
    def plan(cls, *, n_blocks: int, block_bytes: int, cpu_budget: int, nvme: bool = False,
             gpu_budget: int = 0, block_compute_s: float | None = None,
             nvme_bytes_per_s: float | None = None) -> Policy:
        """A policy from sizes and measured speeds. Backward needs the last blocks first, so
        they are kept (as many as gpu_budget holds; the last one always, as nothing would hide
        its round trip), the next ones from the end go to RAM while cpu_budget lasts, and the
        rest to NVMe or recomputed, whichever costs less: recomputing costs one forward of the
        block (`block_compute_s`); the NVMe round trip (2x its bytes at `nvme_bytes_per_s`)
        overlaps the block's forward and backward (about 3 forwards), so it costs
        max(0, io - 3 * block_compute_s). Without the speeds, NVMe."""
        for name, value, least in (("n_blocks", n_blocks, 1), ("block_bytes", block_bytes, 0),
                                   ("cpu_budget", cpu_budget, 0), ("gpu_budget", gpu_budget, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        # A negative or NaN time would make every comparison below pick a tier for no reason.
        for name, what, value, positive in (
                ("block_compute_s", "one block's forward time", block_compute_s, False),
                ("nvme_bytes_per_s", "the NVMe bandwidth", nvme_bytes_per_s, True)):
            if value is None:
                continue
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not math.isfinite(value) or value < 0 or (positive and value == 0)):
                raise ValueError(f"{name} ({what}) must be a finite number "
                                 f"{'>' if positive else '>='} 0, got {value!r}")
        tiers = []
        kept = ram = 0
        for i in reversed(range(n_blocks)):
            if i == n_blocks - 1 or kept + block_bytes <= gpu_budget:
                tiers.append("keep")
                kept += block_bytes
            elif ram + block_bytes <= cpu_budget:
                tiers.append("ram")
                ram += block_bytes
            elif nvme and (block_compute_s is None or nvme_bytes_per_s is None
                           or 2 * block_bytes / nvme_bytes_per_s - 3 * block_compute_s
                           < block_compute_s):
                tiers.append("nvme")
            else:
                tiers.append("recompute")
        return cls(tuple(reversed(tiers)))

    def __len__(self) -> int:
        return len(self.tiers)

    def __getitem__(self, i: int) -> str:
        return self.tiers[i]
