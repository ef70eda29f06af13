"""Pure-torch reference of tierlift::gather_rows: out[i] = table[index[i]], with the same bounds
check (IndexError naming the first bad position) before any row is read."""

from __future__ import annotations

import torch


def gather_rows(table, index, cache_table, cache_slots, out) -> None:
    rows = table.shape[0]
    bad = ((index < 0) | (index >= rows)).nonzero()
    if bad.numel():
        pos = int(bad[0, 0])
        raise IndexError(f"gather_rows: index[{pos}] = {int(index[pos])} is out of range for a "
                         f"table of {rows} rows")
    idx = index.to(table.device, torch.long)
    rows_out = table.index_select(0, idx)
    if cache_table is not None:
        slots = cache_slots.to(table.device)[idx].long()
        hit = slots >= 0
        rows_out[hit] = cache_table.to(table.device).index_select(0, slots[hit])
    out.copy_(rows_out)
