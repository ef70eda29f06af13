"""Pure-torch reference of tierlift::gather_rows: out[i] = table[index[i]], with the same bounds
check (IndexError naming the first bad position) before any row is read, or with bad_index the
deferred check (the first bad position and its value recorded, the good rows gathered)."""

from __future__ import annotations

import torch


def gather_rows(table, index, cache_table, cache_slots, out, bad_index=None) -> None:
    rows = table.shape[0]
    bad = ((index < 0) | (index >= rows)).nonzero()
    if bad.numel():
        pos = int(bad[0, 0])
        if bad_index is None:
            raise IndexError(f"gather_rows: index[{pos}] = {int(index[pos])} is out of range "
                             f"for a table of {rows} rows")
        if int(bad_index[0]) == -1:  # deferred check: record, gather the good rows
            bad_index.copy_(torch.tensor([pos, int(index[pos])]))
        good = ((index >= 0) & (index < rows)).nonzero().flatten()
        part = torch.empty((good.numel(), *out.shape[1:]), dtype=out.dtype, device=out.device)
        gather_rows(table, index[good], cache_table, cache_slots, part)
        out[good.to(out.device)] = part
        return
    idx = index.to(table.device, torch.long)
    rows_out = table.index_select(0, idx)
    if cache_table is not None:
        slots = cache_slots.to(table.device)[idx].long()
        hit = slots >= 0
        rows_out[hit] = cache_table.to(table.device).index_select(0, slots[hit])
    out.copy_(rows_out)
