"""Every rank must start from the same weights: checked when a model is sharded.

Each rank slices its shard out of the weights it built. A script that seeds its ranks
differently (for data order or augmentation) before building the model would otherwise train a
patchwork of several models, silently. DDP broadcasts rank 0's weights and DeepSpeed builds
them on rank 0; here shard() compares a 64-bit content fingerprint of every parameter across
the ranks (one small all-gather) and refuses, on every rank and before anything changes, naming
the first parameter that differs. A model built on the meta device is filled by shard() itself
(the same recording or files on every rank), so it is not checked.
"""

from __future__ import annotations

import torch

from tierlift.zero.gathered import _fingerprint

_MASK = (1 << 63) - 1


def _digest(p: torch.Tensor) -> int:
    """One int64 from a parameter's shape, dtype and bytes."""
    fp = _fingerprint(p)
    if isinstance(fp, torch.Tensor):  # without the compiled extension: a copy of the bytes
        fp = (int(fp.to(torch.int64).sum()), fp.numel())
    # A tuple of ints hashes alike in every process (str hashes are salted per process).
    return hash((*p.shape, p.element_size(), p.is_floating_point(), *fp)) & _MASK


def check_same_init(comm, named: list[tuple[str, torch.Tensor]], device) -> None:
    """Refuses weights that differ between the ranks of `comm` (a collective: every rank)."""
    if comm.world == 1:
        return
    mine = torch.tensor([len(named)] + [_digest(p.detach()) for _, p in named],
                        dtype=torch.int64)
    counts = torch.empty(comm.world, dtype=torch.int64, device=device)
    comm.wait(comm.all_gather(counts, mine[:1].to(device)))
    counts = counts.cpu()
    if bool((counts != counts[0]).any()):
        raise ValueError(f"the ranks hold models with different numbers of parameters "
                         f"({counts.tolist()} by rank): every rank must build the same model "
                         "before tierlift.zero.shard()")
    every = torch.empty(comm.world * mine.numel(), dtype=torch.int64, device=device)
    comm.wait(comm.all_gather(every, mine.to(device)))
    every = every.cpu().view(comm.world, -1)[:, 1:]
    differ = (every != every[0]).any(dim=0).nonzero()
    if differ.numel():
        i = int(differ[0])
        rank = int((every[:, i] != every[0, i]).nonzero()[0])
        raise ValueError(
            f"parameter {named[i][0]!r} differs between rank 0 and rank {rank} (and "
            f"{differ.numel() - 1} more): every rank must start from the same weights, or each "
            "would train its own slice of a different model. Seed the model's construction the "
            "same on every rank (torch.manual_seed(seed) before building it; seed data order "
            "per rank afterwards), or load the same weights on every rank, before shard()")
