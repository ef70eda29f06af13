"""Flat layout of one param group's optimizer state, cut into fixed-size chunks.

Every parameter gets a range of a flat element space, starting at a 1024-element boundary;
the space is cut into chunks of `chunk_elems` elements (a multiple of 1024), so a chunk is one
aligned, fixed-size read or write per state kind. Adam is elementwise, so stepping a parameter
slice by slice, in any chunking, gives the same bits as stepping it whole.

State kinds differ in bytes per element: fp32 kinds take 4, compact state (state_dtype="bf16")
keeps exp_avg in bf16 (2), exp_avg_sq as uint8 codes (1) and one fp32 scale per 256 elements
(the kind "exp_avg_sq_scale"). A 1024-element boundary is a 256-element one, so no scale block
straddles two parameters or two chunks, and a chunk's scales are the chunk's elements / 256.
Each kind of a chunk is stored at a stride rounded up to 4 KiB (O_DIRECT), which costs nothing
for fp32 kinds and at most 4 KiB per chunk and kind otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ALIGN_ELEMS = 1024
IO_ALIGN = 4096  # bytes: O_DIRECT offsets and lengths
SCALE_KIND = "exp_avg_sq_scale"
SCALE_BLOCK = 256  # elements per exp_avg_sq scale (tierlift.reference.optim_compact.BLOCK)


def state_kinds(amsgrad: bool, state_dtype: str = "fp32") -> dict[str, torch.dtype]:
    """{kind: dtype} of one param group's offloaded state, in storage order."""
    if state_dtype == "bf16":
        return {"master": torch.float32, "exp_avg": torch.bfloat16,
                "exp_avg_sq": torch.uint8, SCALE_KIND: torch.float32}
    kinds = ["master", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    return dict.fromkeys(kinds, torch.float32)


def kind_elems(kind: str, n: int) -> int:
    """How many values of `kind` describe `n` parameter elements."""
    return -(-n // SCALE_BLOCK) if kind == SCALE_KIND else n


def kind_slice(kind: str, lo: int, hi: int) -> slice:
    """The values of `kind` for parameter (or chunk) elements [lo, hi); lo a multiple of 256."""
    return slice(lo // SCALE_BLOCK, -(-hi // SCALE_BLOCK)) if kind == SCALE_KIND else slice(lo, hi)


def kind_bytes(kind: str, dtype: torch.dtype, n: int, aligned: bool = True) -> int:
    """Bytes of `kind` for `n` elements; `aligned`: rounded up to IO_ALIGN (stored on disk)."""
    nbytes = kind_elems(kind, n) * dtype.itemsize
    return -(-nbytes // IO_ALIGN) * IO_ALIGN if aligned else nbytes


def chunk_bytes(kinds: dict[str, torch.dtype], n: int, aligned: bool = True) -> int:
    """Bytes of one chunk of `n` elements of every kind in `kinds`."""
    return sum(kind_bytes(k, d, n, aligned) for k, d in kinds.items())


@dataclass(kw_only=True)
class Segment:
    """Elements [plo, phi) of parameter `pi` sit at [clo, chi) of chunk `ci`."""

    pi: int
    plo: int
    phi: int
    clo: int
    chi: int


@dataclass(kw_only=True)
class Chunk:
    ci: int
    segments: list[Segment] = field(default_factory=list)


@dataclass(kw_only=True)
class GroupLayout:
    chunk_elems: int
    starts: list[int]  # flat start of each parameter
    numels: list[int]
    chunks: list[Chunk]
    used: int = 0  # elements of the flat space in use (the last chunk may be partly empty)
    reserved: list[bool] = field(default_factory=list)  # per parameter: it has a range

    @property
    def total_elems(self) -> int:
        return len(self.chunks) * self.chunk_elems

    def used_elems(self, ci: int) -> int:
        """Elements of chunk `ci` in use, a multiple of ALIGN_ELEMS: only these are read,
        written and checksummed, so a nearly empty last chunk costs no full-chunk I/O."""
        return max(0, min(self.chunk_elems, self.used - ci * self.chunk_elems))

    def chunks_of(self, pi: int) -> list[Chunk]:
        first = self.starts[pi] // self.chunk_elems
        last = (self.starts[pi] + max(self.numels[pi], 1) - 1) // self.chunk_elems
        return self.chunks[first:last + 1]


def even_chunk_elems(total: int, chunk_elems: int) -> int:
    """The smallest multiple of ALIGN_ELEMS that cuts `total` elements into as few chunks as
    `chunk_elems` does: the chunks come out (nearly) equal instead of several full chunks and a
    nearly empty last one, so every pipeline stage moves about the same bytes."""
    if total <= 0:
        return chunk_elems
    n = -(-total // chunk_elems)
    return min(chunk_elems, -(-total // (n * ALIGN_ELEMS)) * ALIGN_ELEMS)


def reserves(p: torch.Tensor) -> bool:
    """Whether an offloaded optimizer reserves state for `p`: not for a frozen parameter
    (requires_grad=False when the optimizer is built), which torch never creates state for."""
    return p.requires_grad


def reserved_elems(params: list[torch.Tensor]) -> int:
    """Elements of the flat space `params` take (each reserved one from a 1024 boundary)."""
    return sum(-(-max(p.numel(), 1) // ALIGN_ELEMS) * ALIGN_ELEMS for p in params if reserves(p))


def not_reserved(name: str, offload: str, now: str) -> str:
    """The refusal for a parameter that got no state (frozen when the optimizer was built)."""
    return (f"{name} was frozen (requires_grad=False) when the optimizer was built, so "
            f"offload={offload!r} reserved no optimizer state for it (torch creates none for a "
            f"parameter without gradients); it {now}. Unfreeze it before building the "
            "optimizer (offloaded state is laid out once, at construction), or keep it out of "
            "the optimizer")


def build_layout(params: list[torch.Tensor], chunk_elems: int,
                 reserved: list[bool] | None = None) -> GroupLayout:
    """reserved[i] False (the optimizer passes reserves(p)): parameter i gets an empty range and
    no segments. None: every parameter gets its range."""
    if chunk_elems <= 0 or chunk_elems % ALIGN_ELEMS:
        raise ValueError(f"chunk_elems must be a positive multiple of {ALIGN_ELEMS}")
    reserved = [True] * len(params) if reserved is None else list(reserved)
    starts, numels, pos = [], [], 0
    for p, keep in zip(params, reserved, strict=True):
        starts.append(pos)
        numels.append(p.numel() if keep else 0)
        if keep:
            pos += -(-max(p.numel(), 1) // ALIGN_ELEMS) * ALIGN_ELEMS
    n_chunks = -(-pos // chunk_elems) if pos else 0
    chunks = [Chunk(ci=i) for i in range(n_chunks)]
    for pi, (start, n) in enumerate(zip(starts, numels)):
        lo = 0
        while lo < n:
            ci, off = divmod(start + lo, chunk_elems)
            take = min(n - lo, chunk_elems - off)
            chunks[ci].segments.append(Segment(pi=pi, plo=lo, phi=lo + take, clo=off,
                                               chi=off + take))
            lo += take
    return GroupLayout(chunk_elems=chunk_elems, starts=starts, numels=numels, chunks=chunks,
                       used=pos, reserved=reserved)
