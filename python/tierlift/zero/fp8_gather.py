"""FP8 all-gather of Float8Linear weights under ZeRO-3 (shard(..., fp8_all_gather=True)).

Without it a unit all-gathers every parameter in the compute dtype (bf16) and each Float8Linear
then quantizes its gathered weight to E4M3. With it the unit gathers its Float8Linear weights
already quantized, one byte per element, and everything else as before:

  1. amax: each rank computes the partial amax of its slice of every FP8 weight (one value per
     weight for tensorwise scaling, one per output row for rowwise: a row may straddle two
     ranks' slices) and ONE all-reduce(MAX) over the concatenated vector gives the true amax.
  2. quantize: each rank quantizes its slice with the shared scales. It quantizes exactly what
     the bf16 path would quantize (the fp32 master shard cast to the compute dtype) with the
     same scale rule (tierlift.reference.lowp, bit-exact with the C++/CUDA quantizers), so the
     codes are bit-identical to those Float8Linear would compute from the gathered bf16 weight.
  3. one all-gather of bytes: rank r sends [its non-FP8 elements in the compute dtype | its FP8
     codes], padded to the largest rank's byte count; every rank unpacks the non-FP8 elements
     into the unit's `full` buffer and the codes into one uint8 buffer (in flat order, so each
     rank's codes are one contiguous piece of it).
The Float8Linear layers of the unit then read a GatheredFloat8Weight (codes + scales) while it
is current. Their weight attribute stays a view of `full` (the autograd input, so the weight
gradient still lands in full.grad); its FP8 part of `full` is filled with the dequantized
codes, so anything else that reads the weight sees the FP8 round trip, not stale memory.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tierlift.lowp.linear import Float8Linear, GatheredFloat8Weight
from tierlift.lowp.recipe import Float8Recipe
from tierlift.reference.lowp import FP8_MAX, cast_to_fp8, scale_from_amax

_ALIGN = 16  # bytes: each rank's piece starts aligned (dtype views, NCCL)


@dataclass(kw_only=True)
class _Fp8Weight:
    """One Float8Linear weight of a unit, gathered in FP8."""

    offset: int        # in the unit's flat buffer
    rows: int
    cols: int
    recipe: Float8Recipe
    code_offset: int   # in the unit's code buffer
    amax_offset: int   # in the amax vector
    modules: list      # weakrefs of the Float8Linear layers using it

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def amax_len(self) -> int:
        return 1 if self.recipe.scaling == "tensor" else self.rows


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))


def _rows_of(x: torch.Tensor, lo: int, cols: int) -> torch.Tensor:
    """The flat piece x = W.flatten()[lo:lo + len(x)] zero-padded to whole rows: [rows, cols]."""
    front = lo % cols
    back = -(front + x.numel()) % cols
    return torch.nn.functional.pad(x, (front, back)).view(-1, cols)


class Fp8Gather:
    """The FP8 all-gather of one FlatUnit (see the module docstring)."""

    def __init__(self, unit, weights: list[_Fp8Weight]):
        self._unit = weakref.ref(unit)
        self.weights = weights
        self.dtype = unit.compute_dtype
        el = torch.empty((), dtype=self.dtype).element_size()
        self.n_codes = sum(w.numel for w in weights)
        self.n_amax = sum(w.amax_len for w in weights)
        world, size = unit.comm.world, unit.shard_numel
        ranges = [(w.offset, w.offset + w.numel) for w in weights]
        # Per rank: its high-precision segments of `full`, its code range, its byte counts.
        self.hp_segments: list[list[tuple[int, int]]] = []
        self.code_start: list[int] = []
        self.hp_count: list[int] = []
        self.fp8_count: list[int] = []
        codes_before = 0
        for r in range(world):
            lo, hi = r * size, (r + 1) * size
            segs, pos, n8 = [], lo, 0
            for a, b in ranges:
                a, b = max(a, lo), min(b, hi)
                if a >= b:
                    continue
                if a > pos:
                    segs.append((pos, a))
                n8 += b - a
                pos = b
            if pos < hi:
                segs.append((pos, hi))
            self.hp_segments.append(segs)
            self.code_start.append(codes_before)
            self.fp8_count.append(n8)
            self.hp_count.append(size - n8)
            codes_before += n8
        self.hp_bytes = [n * el for n in self.hp_count]
        need = max(h + n for h, n in zip(self.hp_bytes, self.fp8_count, strict=True))
        self.piece_bytes = -(-need // _ALIGN) * _ALIGN
        self.current: list[GatheredFloat8Weight] | None = None
        ref = weakref.ref(self)
        for i, w in enumerate(weights):
            for m in w.modules:
                m().gathered_weight_fn = _source(ref, i)

    @property
    def unit(self):
        return self._unit()

    @property
    def gather_bytes(self) -> int:
        """Bytes one gather of this unit receives (compute-dtype elements plus FP8 codes)."""
        return self.piece_bytes * len(self.hp_count)

    # ---- the gather ----
    def all_gather(self, unit, async_op: bool):
        """Steps 1-2 and the start of step 3; returns (work, state for unpack())."""
        rank, size = unit.comm.rank, unit.shard_numel
        lo = rank * size
        shard = unit.shard.detach()
        amax = torch.zeros(self.n_amax, dtype=torch.float32, device=unit.device)
        mine = []  # (weight, start in its own element index, this rank's piece)
        for w in self.weights:
            a, b = max(w.offset, lo), min(w.offset + w.numel, lo + size)
            if a >= b:
                continue
            x = shard[a - lo:b - lo].to(self.dtype)
            a -= w.offset
            b -= w.offset
            mine.append((w, a, x))
            if w.recipe.scaling == "tensor":
                amax[w.amax_offset] = _finite_abs(x).max()
            else:
                r0 = a // w.cols
                part = _finite_abs(_rows_of(x, a, w.cols)).amax(dim=1)
                amax[w.amax_offset + r0:w.amax_offset + r0 + part.numel()] = part
        unit.comm.wait(unit.comm.all_reduce(amax, op=dist.ReduceOp.MAX))
        scales = [self._scales(w, amax) for w in self.weights]
        parts = [shard[a - lo:b - lo].to(self.dtype).view(torch.uint8).reshape(-1)
                 for a, b in self.hp_segments[rank]]
        index = {id(w): i for i, w in enumerate(self.weights)}
        for w, a, x in mine:
            s = scales[index[id(w)]]
            f8 = w.recipe.forward_dtype
            if w.recipe.scaling == "tensor":
                q = cast_to_fp8(x.float() * s.reshape(()), f8)
            else:
                r0, front = a // w.cols, a % w.cols
                rows = _rows_of(x, a, w.cols)
                y = rows.float() * s[r0:r0 + rows.shape[0]]
                q = cast_to_fp8(y, f8).reshape(-1)[front:front + x.numel()]
            parts.append(q.view(torch.uint8))
        send = torch.zeros(self.piece_bytes, dtype=torch.uint8, device=unit.device)
        used = sum(p.numel() for p in parts)
        if parts:
            torch.cat(parts, out=send[:used])
        recv = torch.empty(self.piece_bytes * unit.comm.world, dtype=torch.uint8,
                           device=unit.device)
        work = unit.comm.all_gather(recv, send, async_op=async_op)
        return work, (send, recv, scales)

    def _scales(self, w: _Fp8Weight, amax: torch.Tensor) -> torch.Tensor:
        a = amax[w.amax_offset:w.amax_offset + w.amax_len]
        s = scale_from_amax(a, w.recipe.forward_dtype, w.recipe.pow2_scale)
        return s.reshape(-1, 1)  # [1, 1] tensorwise, [rows, 1] rowwise

    def unpack(self, unit, state) -> None:
        """Step 3's end: gathered bytes -> `full` and the code buffer; attach the FP8 weights."""
        _, recv, scales = state
        full = unit.full.data
        codes = torch.empty(self.n_codes, dtype=torch.uint8, device=unit.device)
        for r in range(len(self.hp_count)):
            piece = recv[r * self.piece_bytes:(r + 1) * self.piece_bytes]
            hp = piece[:self.hp_bytes[r]].view(self.dtype)
            pos = 0
            for a, b in self.hp_segments[r]:
                full[a:b].copy_(hp[pos:pos + b - a])
                pos += b - a
            c0, n8 = self.code_start[r], self.fp8_count[r]
            codes[c0:c0 + n8].copy_(piece[self.hp_bytes[r]:self.hp_bytes[r] + n8])
        current = []
        for w, s in zip(self.weights, scales, strict=True):
            q = codes[w.code_offset:w.code_offset + w.numel].view(w.recipe.forward_dtype)
            q = q.view(w.rows, w.cols)
            full[w.offset:w.offset + w.numel].view(w.rows, w.cols).copy_(q.float() / s)
            current.append(GatheredFloat8Weight(data=q, scale=s, recipe=w.recipe))
        self.current = current

    def release(self) -> None:
        """The unit was freed: its FP8 weights go too (saved-for-backward copies stay)."""
        self.current = None

    def weight(self, i: int) -> GatheredFloat8Weight | None:
        """Weight i's FP8 copy if it is the one of the unit's current weights, else None."""
        unit = self.unit
        if (self.current is None or unit is None or unit.pending is not None
                or unit.needs_gather()):
            return None
        return self.current[i]


def _source(ref, i: int):
    def fn():
        g = ref()
        return None if g is None else g.weight(i)
    return fn


def _fp8_owner(entry) -> tuple[list, Float8Recipe] | None:
    """(modules, recipe) when every owner of the parameter is a Float8Linear's weight with one
    recipe whose scaling the FP8 gather supports, else None (gathered in the compute dtype)."""
    mods = [(m(), a) for m, a in entry.owners]
    if not mods or any(not isinstance(m, Float8Linear) or a != "weight" for m, a in mods):
        return None
    recipes = {m.recipe for m, _ in mods}
    if len(recipes) != 1 or len(entry.shape) != 2:
        return None
    recipe = next(iter(recipes))
    if recipe.scaling not in ("tensor", "row") or recipe.forward_dtype not in FP8_MAX:
        return None
    return [weakref.ref(m) for m, _ in mods], recipe


def enable_fp8_all_gather(units) -> int:
    """Attach an Fp8Gather to every unit holding Float8Linear weights; returns how many weights
    are gathered in FP8."""
    count = 0
    for unit in units:
        weights, code_off, amax_off = [], 0, 0
        for e in unit.entries:
            found = _fp8_owner(e)
            if found is None:
                continue
            mods, recipe = found
            w = _Fp8Weight(offset=e.offset, rows=e.shape[0], cols=e.shape[1], recipe=recipe,
                           code_offset=code_off, amax_offset=amax_off, modules=mods)
            weights.append(w)
            code_off += w.numel
            amax_off += w.amax_len
        if weights:
            unit.fp8_gather = Fp8Gather(unit, weights)
            count += len(weights)
    return count
