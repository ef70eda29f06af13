"""What scripts/setup_deepspeed.sh puts into build/deepspeed-site: from pip's --dry-run --report of
installing DeepSpeed into this Python, the requirements (name==version) it would install. Every one
must be missing from this Python: one it has (in a version DeepSpeed refuses) would be shadowed by
the site dir for every other test, and torch is never installed there. Either is refused, with the
reason on stderr and exit status 1.

    python3 scripts/deepspeed_need.py REPORT.json
"""

from __future__ import annotations

import importlib.metadata as md
import json
import sys

NEVER = {"torch"}  # this Python's own, from scripts/setup.sh; never a second copy in the site dir


def need(report: dict) -> list[str]:
    install = [i["metadata"] for i in report["install"]]
    refused = [f"{m['name']} (torch comes from scripts/setup.sh, never from the site dir)"
               for m in install if m["name"].lower() in NEVER]
    for m in install:
        if m["name"].lower() in NEVER:
            continue
        try:
            have = md.version(m["name"])
        except md.PackageNotFoundError:
            continue
        refused.append(f"{m['name']} {have} here, DeepSpeed wants {m['version']} (the site dir "
                       "would shadow it for every other test)")
    if refused:
        raise SystemExit("refused: " + "; ".join(refused))
    if not any(m["name"].lower() == "deepspeed" for m in install):
        raise SystemExit("pip's resolution has no deepspeed in it")
    return [f"{m['name']}=={m['version']}" for m in install]


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(" ".join(need(json.load(f))))
