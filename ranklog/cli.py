"""The ``ranklog`` command.

::

    ranklog inspect SPOOL [--json]
    ranklog demo [--out DIR] [--ranks N] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ranklog._version import __version__

__all__ = ["main"]


def _inspect(args: argparse.Namespace) -> int:
    from ranklog.spool._inspect import format_summary, summarize

    spool = Path(args.spool)
    if not spool.is_dir():
        print(f"ranklog inspect: {spool} is not a directory", file=sys.stderr)
        return 2
    summary = summarize(spool)
    if args.json:
        json.dump(summary.to_dict(), sys.stdout, indent=1, default=str)
        print()
    else:
        print(format_summary(summary))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ranklog._demo import run_demo

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ranklog-demo-"))
    spool = out / "spool"
    code = run_demo(spool, ranks=args.ranks, steps=args.steps, step_seconds=args.step_seconds)
    print(f"\nlook at: {spool}  (ranklog inspect {spool})")
    return code


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    p = argparse.ArgumentParser(
        prog="ranklog", description="Crash-resilient metrics logging for distributed training."
    )
    p.add_argument("--version", action="version", version=f"ranklog {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    ins = sub.add_parser("inspect", help="ranks, incarnations, steps, ends and damage of a spool")
    ins.add_argument("spool")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.set_defaults(func=_inspect)

    demo = sub.add_parser("demo", help="a short multi-process job on this machine")
    demo.add_argument("--out", help="directory for the demo's outputs (default: a temp dir)")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--step-seconds", type=float, default=0.01)
    demo.set_defaults(func=_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ranklog`` console script."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
