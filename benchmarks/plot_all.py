"""Regenerate docs/img/*.png from the committed JSON in benchmarks/results/ (needs matplotlib).

    python benchmarks/plot_all.py                 # every figure the docs embed
    python benchmarks/plot_all.py --out /tmp/img  # somewhere else

Each figure is drawn by the same function the benchmark's --plot flag uses, from the same JSON;
a benchmark whose JSON is not committed (e.g. a GPU run) is skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plots  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
IMG = HERE.parent / "docs" / "img"

# JSON file name pattern in benchmarks/results/ -> (plot function, the bench that writes it).
FIGURES = [
    ("bench_optim-*.json", plots.plot_optim, "bench_optim.py"),
    ("bench_io.json", plots.plot_io, "bench_io.py"),
    ("bench_gather_*.json", plots.plot_gather, "bench_gather.py"),
    ("bench_offload-*.json", plots.plot_offload, "bench_offload.py"),
    ("bench_offload_finetune-*.json", plots.plot_offload_finetune, "bench_offload.py --gpu"),
    ("zero_offload.json", plots.plot_zero_offload, "bench_zero_offload.py"),
    ("bench_zero-*.json", plots.plot_zero, "bench_zero.py"),
    ("bench_lowp-*.json", plots.plot_lowp, "bench_lowp.py"),
    ("bench_checkpoint-*.json", plots.plot_checkpoint, "bench_checkpoint.py"),
    ("bench_activations-*.json", plots.plot_activations, "bench_activations.py"),
    ("bench_held_state-*.json", plots.plot_held_state, "bench_held_state.py"),
    ("bench_zero_load*.json", plots.plot_zero_load, "bench_zero_load.py"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS), help="directory of benchmark JSON")
    ap.add_argument("--out", default=str(IMG), help="directory for the PNGs")
    args = ap.parse_args(argv)
    plots.pyplot()  # fail early, with the install hint, when matplotlib is missing
    results, out = Path(args.results), Path(args.out)
    wrote = 0
    for pattern, plot, bench in FIGURES:
        found = sorted(results.glob(pattern))
        if not found:
            print(f"skip {pattern}: not in {results} (run benchmarks/{bench})")
            continue
        for path in found:
            png = plots.plot_json(plot, path, out / f"{path.stem}.png")
            print(f"wrote {png} ({png.stat().st_size // 1024} KiB) from {path.name}")
            wrote += 1
    return 0 if wrote else 1


if __name__ == "__main__":
    raise SystemExit(main())
