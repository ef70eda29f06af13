"""The cells and markdown tables every section of scripts/gpu_report.py is built from: numbers
rounded the same way everywhere, targets judged the same way, errors gathered from the same keys.
"""

from __future__ import annotations

import math

NONE = "—"


def num(x, sig: int = 3) -> str:
    """x to `sig` significant digits, never in exponent notation; whole numbers in full."""
    if not isinstance(x, float) or not math.isfinite(x):
        return NONE if x is None or (isinstance(x, float) and math.isnan(x)) else str(x)
    r = x if abs(x) >= 10 ** (sig - 1) else float(f"{x:.{sig}g}")  # 0.99999997: 1.00
    return f"{r:.{max(0, sig - 1 - math.floor(math.log10(abs(r))))}f}" if r else "0"


times = lambda x: NONE if x is None else num(x) + "x"
pct = lambda x: NONE if x is None else f"{100 * x:.0f}%"
gb = lambda nbytes: NONE if nbytes is None else num(nbytes / 1e9)
at_least = lambda goal: f">= {goal}x" if goal else ""


def verdict(value, target, at_most: bool = False) -> str:  # "" where there is no target
    if target is None or value is None:
        return "" if target is None else "no result"
    return "met" if (value <= target if at_most else value >= target) else "not met"


def first_line(message, limit: int = 200) -> str:
    text = (str(message).strip().splitlines() or ["(no message)"])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


is_error_key = lambda key: key == "error" or key.endswith(("_error", " error"))


def table(header: list[str], rows: list[list]) -> list[str]:
    cell = lambda c: str(c).replace("|", "\\|").replace("\n", " ")
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(c) for c in row) + " |" for row in rows), ""]


def errors_of(row: dict) -> list[str]:  # `error`, `<name>_error`, `<name> error`
    return [f"{k}: {first_line(v)}" for k, v in row.items() if is_error_key(k)]


def plain_table(rows: list[dict]) -> list[str]:  # every key a column, the errors in a note
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if not is_error_key(k)]
    return table(keys + ["note"], [[num(r.get(k)) for k in keys] + ["; ".join(errors_of(r))]
                                   for r in rows]) if rows else []
