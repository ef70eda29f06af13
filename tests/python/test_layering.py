"""The import graph of python/tierlift has no cycle, and its packages depend one way: from the
front ends (checkpoint, optim, zero) down to offload, then io, ops and reference.

The graph comes from the source (ast), not from what happens to be imported: every `import` and
`from ... import` anywhere in a file counts, relative ones resolved, including those inside
functions (a lazy import hides a cycle from import time, it does not remove it).
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "tierlift"

# Compiled modules that `from tierlift import _C` names (present only once built): leaves.
EXTENSIONS = {"tierlift._C"}

# Top to bottom: a module may import modules of its own package and of packages in lower
# layers only (never of the same layer: two packages there are independent).
LAYERS = [
    ["__main__"],  # python -m tierlift
    [""],  # tierlift/__init__.py: re-exports the subpackages
    ["hf"],  # Hugging Face Trainer / Accelerate integration (imported by the user, not by "")
    ["checkpoint", "plan"],  # save/load models and optimizers; the placement planner
    ["optim", "zero"],  # the front ends: optimizers, ZeRO sharding
    ["offload", "activations", "gnn", "lowp"],  # optimizer state / saved activation tiers;
    # GNN features; FP8/FP4 layers
    ["_shards", "io", "ops", "_pinned"],  # ZeRO shard registry (for offload); NVMe I/O; op
    # wrappers; host memory pinned at its exact size
    ["_torch_patch", "_text", "_paths"],  # wrapping a private torch method; wording of error
    # messages; a user's folder made absolute
    ["reference"],  # pure-torch kernels
    ["_extension", "_plotting", "_peak_rss"],  # loads tierlift._C; imports matplotlib when a
    # plot is drawn; peak host memory of a piece of work (tests and benchmarks)
    ["_C"],
]


def module_name(root: pathlib.Path, file: pathlib.Path) -> str:
    parts = list(file.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: pathlib.Path, extensions=frozenset()) -> dict[str, dict[str, int]]:
    """{module: {imported module of the same top-level package: first line}} for every .py
    under `root` (a package directory)."""
    files = {module_name(root, f): f for f in sorted(root.rglob("*.py"))}
    known = set(files) | set(extensions)
    top = root.name

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {m: {} for m in files}
    for mod, file in files.items():
        is_pkg = file.name == "__init__.py"
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                # `from a import b` imports module a.b if there is one, else a (b is a name in it)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            else:
                continue
            for t in targets:
                if t != top and not t.startswith(top + "."):
                    continue
                r = resolve(t)
                if r is not None and r != mod:
                    graph[mod].setdefault(r, node.lineno)
    return graph


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def package_of(module: str) -> str:
    """tierlift.zero.api -> "zero", tierlift.ops -> "ops", tierlift -> "" (the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, list[str]]]:
    """{package: {package it imports: ["module:line -> module", ...]}} (across packages only)."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for mod, targets in graph.items():
        for t, line in targets.items():
            a, b = package_of(mod), package_of(t)
            if a != b:
                out[a][b].append(f"{mod}:{line} -> {t}")
    return out


def describe(comps, graph) -> str:
    lines = []
    for comp in comps:
        lines.append(" <-> ".join(comp))
        for a in comp:
            for b, where in sorted(graph[a].items()):
                if b in comp:
                    at = ", ".join(where) if isinstance(where, list) else f"line {where}"
                    lines.append(f"    {a} -> {b}: {at}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def graph():
    return import_graph(PACKAGE, EXTENSIONS)


def test_no_import_cycle_between_modules(graph):
    comps = cycles(graph)
    assert not comps, "import cycles between tierlift modules:\n" + describe(comps, graph)


def test_no_import_cycle_between_packages(graph):
    pg = package_graph(graph)
    comps = cycles(pg)
    assert not comps, "import cycles between tierlift packages:\n" + describe(comps, pg)


def test_packages_depend_only_on_lower_layers(graph):
    layer = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
    packages = {package_of(m) for m in graph} | {package_of(e) for e in EXTENSIONS}
    unplaced = sorted(packages - set(layer))
    assert not unplaced, f"packages missing from LAYERS in {__file__}: {unplaced}"
    upward = [f"{a} (layer {layer[a]}) -> {b} (layer {layer[b]}): {', '.join(where)}"
              for a, targets in sorted(package_graph(graph).items())
              for b, where in sorted(targets.items()) if layer[b] <= layer[a]]
    assert not upward, "imports that do not go down the layers:\n" + "\n".join(upward)


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    """The checks above can fail: a cycle closed by an import inside a function, written as a
    relative import, is found, as is the package cycle it makes."""
    pkg = tmp_path / "tierlift"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "__init__.py").write_text("from tierlift import a, b\n")
    (pkg / "a" / "__init__.py").write_text("from .x import f\n")
    (pkg / "a" / "x.py").write_text("from tierlift.b.y import g\n\ndef f():\n    return g\n")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "b" / "y.py").write_text("def g():\n    from ..a import x\n    return x\n")
    g = import_graph(pkg)
    assert g["tierlift.a.x"] == {"tierlift.b.y": 1}
    assert g["tierlift.b.y"] == {"tierlift.a.x": 2}
    assert g["tierlift.a"] == {"tierlift.a.x": 1}
    assert cycles(g) == [["tierlift.a.x", "tierlift.b.y"]]
    assert cycles(package_graph(g)) == [["a", "b"]]
