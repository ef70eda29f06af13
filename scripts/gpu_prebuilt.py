"""Whether an extension built elsewhere may stand in for building one here.

The GPU machine's minutes are few and building tierlift there takes one of them, so
scripts/prebuild_gpu.sh builds it ahead on the development machine, against the GPU machine's
Python and torch, and writes a manifest beside it. scripts/gpu_check.sh uses that build only
where this check passes: the same sources (every file the build reads), the same Python ABI and
the same torch and CUDA. Anything else builds from source, so a stale binary can never be
measured or tested as if it were the tree's.

  python scripts/gpu_prebuilt.py record DIR   write DIR/manifest.json for this tree and Python
  python scripts/gpu_prebuilt.py check DIR    exit 0 when DIR's build fits this tree and Python
                                              (prints why not, else what it matched)
  ... check --sources-only DIR                the sources alone (a dry run, on another machine)
"""

import argparse
import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = "manifest.json"
# Every input of setup.py's build: its own flags and every source and header it compiles.
BUILD_INPUTS = ("setup.py", "csrc")


def source_digest(root: str = ROOT) -> str:
    """sha256 over the path and bytes of every build input, in a fixed order."""
    h = hashlib.sha256()
    paths = []
    for entry in BUILD_INPUTS:
        top = os.path.join(root, entry)
        if os.path.isfile(top):
            paths.append(entry)
            continue
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            paths += [os.path.relpath(os.path.join(folder, f), root) for f in files]
    for rel in sorted(paths):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


def runtime() -> dict:
    """What a compiled extension is bound to: the Python ABI, torch's version and its CUDA."""
    import torch

    return {"python": f"cp{sys.version_info.major}{sys.version_info.minor}",
            "torch": torch.__version__.split("+")[0], "cuda": torch.version.cuda}


def manifest(root: str = ROOT) -> dict:
    return {"sources": source_digest(root), **runtime()}


def mismatch(recorded: dict, current: dict) -> list:
    """What differs: the sources, or 'key: built for X, here Y'."""
    return ["the sources changed since it was built" if k == "sources" else
            f"{k}: built for {recorded.get(k)}, here {v}"
            for k, v in current.items() if recorded.get(k) != v]


def check(folder: str, root: str = ROOT, sources_only: bool = False) -> tuple:
    """(usable, why): usable when folder's manifest matches this tree and this Python (or, with
    sources_only, this tree alone)."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            recorded = json.load(f)
    except (OSError, ValueError) as e:
        return False, f"no readable {path} ({type(e).__name__})"
    current = {"sources": source_digest(root)} if sources_only else manifest(root)
    wrong = mismatch(recorded, current)
    if wrong:
        return False, "; ".join(wrong)
    return True, (f"sources {current['sources'][:12]}, {recorded.get('python')}, torch "
                  f"{recorded.get('torch')}, CUDA {recorded.get('cuda')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["record", "check"])
    p.add_argument("folder")
    p.add_argument("--sources-only", action="store_true")
    args = p.parse_args(argv)
    if args.action == "record":
        os.makedirs(args.folder, exist_ok=True)
        with open(os.path.join(args.folder, MANIFEST), "w") as f:
            json.dump(manifest(), f, indent=1)
            f.write("\n")
        return 0
    ok, why = check(args.folder, sources_only=args.sources_only)
    print(why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
