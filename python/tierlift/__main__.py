"""Command line: `python -m tierlift info` prints what this build and machine can do;
`python -m tierlift plan ...` where training state will live and the expected step time."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierlift")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="build and machine capabilities as JSON")
    from tierlift.plan.cli import add_parser as add_plan_parser

    add_plan_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "plan":
        from tierlift.plan.cli import run as run_plan

        try:
            return run_plan(args)
        except ValueError as err:
            parser.error(str(err))
    if args.command == "info":
        import tierlift

        print(json.dumps(tierlift.build_info(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
