"""The ``ranklog`` command.

::

    ranklog ship SPOOL --to TARGET [--to TARGET ...] [--once] [--poll S] [--dead-after S]
                 [--name N] [--samples N]
    ranklog compact SPOOL --out DIR [--delete]
    ranklog replay DIR --to TARGET [--to TARGET ...] [--steps A:B] [--names GLOB]
                   [--relogged first|last]
    ranklog inspect SPOOL [--json]
    ranklog report DIR --out report.html
    ranklog demo [--out DIR] [--ranks N] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ranklog._version import __version__

if TYPE_CHECKING:
    from ranklog.shippers import TargetOptions
    from ranklog.spool._inspect import SpoolSummary

__all__ = ["main"]


def _inspect(args: argparse.Namespace) -> int:
    from ranklog.spool._inspect import format_summary, summarize

    spool = Path(args.spool)
    if not spool.is_dir():
        print(f"ranklog inspect: {spool} is not a directory", file=sys.stderr)
        return 2
    summary = summarize(spool)
    _add_shippers(summary)
    if args.json:
        json.dump(summary.to_dict(), sys.stdout, indent=1, default=str)
        print()
    else:
        print(format_summary(summary))
    return 0


def _add_shippers(summary: SpoolSummary) -> None:
    """Each shipper's cursor, with its lag behind what the ranks closed."""
    from ranklog.shippers import list_cursors
    from ranklog.spool import HEADER_SIZE
    from ranklog.spool._inspect import ShipperSummary

    top = max(
        (i.closed_step for i in summary.incarnations if i.closed_step is not None), default=-1
    )
    for c in list_cursors(summary.spool):
        lag_bytes = sum(
            max(0, size - max(c.segments[k].offset if k in c.segments else 0, HEADER_SIZE))
            for k, size in summary.sizes.items()
        )
        summary.shippers.append(
            ShipperSummary(
                name=c.name,
                target=c.target,
                last_step=c.last_step,
                steps_shipped=c.steps_shipped,
                lag_steps=max(0, top - c.last_step),
                lag_bytes=lag_bytes,
                late_events=c.late_events,
                relogged_events=c.relogged_events,
                bad_ranges=c.bad_ranges,
                updated=c.updated,
            )
        )


def _ship(args: argparse.Namespace) -> int:
    from ranklog.errors import RanklogError
    from ranklog.shippers import Progress, Shipper, default_name, make_target

    targets: list[str] = args.to
    if len(targets) > 1 and not args.in_process:
        return _ship_each(args, targets)
    logging.basicConfig(level=logging.INFO, format="ranklog: %(message)s", stream=sys.stderr)
    spool = Path(args.spool)
    if not (spool / "run.json").is_file():
        print(f"ranklog ship: {spool} is not a spool (no run.json)", file=sys.stderr)
        return 2
    code = 0
    for spec in targets:
        try:
            name = args.name if args.name and len(targets) == 1 else default_name(spec)
            if args.ray is not None:
                _ship_on_ray(args, spec, name)
                continue
            target = make_target(spec, spool, _options(args))
            shipper = Shipper(
                str(spool),
                target,
                name=name,
                poll=args.poll,
                dead_after=args.dead_after,
                start_grace=args.start_grace,
                per_rank=args.per_rank,
                progress=None if args.quiet else Progress(),
            )
            code = max(code, shipper.run_forever(once=args.once))
        except RanklogError as exc:
            print(f"ranklog ship: {exc}", file=sys.stderr)
            code = 2
    return code


def _ship_on_ray(args: argparse.Namespace, spec: str, name: str) -> None:
    from ranklog.errors import ConfigError
    from ranklog.shippers._fanin import FanIn, ship_on_ray

    if args.readers < 1:
        raise ConfigError(f"--readers must be at least 1, got {args.readers}")
    ship_on_ray(
        args.ray or None,
        args.spool,
        spec,
        _options(args),
        FanIn(readers=args.readers, reader_cpus=args.reader_cpus),
        name=name,
        poll=args.poll,
        dead_after=args.dead_after,
        start_grace=args.start_grace,
        per_rank=args.per_rank,
        once=args.once,
        quiet=args.quiet,
    )


def _options(args: argparse.Namespace) -> TargetOptions:
    from ranklog.shippers import TargetOptions

    return TargetOptions(
        samples=args.samples,
        per_rank=args.per_rank,
        run_name=args.run_name,
        experiment=args.experiment,
        entity=args.entity,
        group=args.group,
        mode=args.mode,
        dir=args.dir,
    )


_PASSED_ON = ("run_name", "experiment", "entity", "group", "mode", "dir")


def _ship_each(args: argparse.Namespace, targets: list[str]) -> int:
    """One process per target: a slow or broken target never holds another back."""
    base = [sys.executable, "-m", "ranklog.cli", "ship", args.spool]
    flags = ["--dead-after", str(args.dead_after), "--start-grace", str(args.start_grace)]
    flags += ["--samples", str(args.samples)]
    if args.once:
        flags.append("--once")
    if args.poll is not None:
        flags += ["--poll", str(args.poll)]
    if args.quiet:
        flags.append("--quiet")
    if args.per_rank:
        flags.append("--per-rank")
    if args.ray is not None:
        flags += [f"--ray={args.ray}", "--readers", str(args.readers)]
        flags += ["--reader-cpus", str(args.reader_cpus)]
    for key in _PASSED_ON:
        value = getattr(args, key)
        if value is not None:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    procs = []
    for spec in targets:
        name = f"{args.name}-{spec.partition(':')[0]}" if args.name else None
        cmd = [*base, "--to", spec, *flags, *(["--name", name] if name else [])]
        procs.append(subprocess.Popen(cmd, env=dict(os.environ)))
    try:
        return max(p.wait() for p in procs)
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        return max(p.wait() for p in procs)


def _compact(args: argparse.Namespace) -> int:
    from ranklog.spool.parquet import compact

    spool = Path(args.spool)
    if not (spool / "run.json").is_file():
        print(f"ranklog compact: {spool} is not a spool (no run.json)", file=sys.stderr)
        return 2
    res = compact(spool, args.out, delete=args.delete)
    rows = ", ".join(f"{t} {n:,}" for t, n in sorted(res.rows.items())) or "nothing new"
    print(f"compacted {res.files} files into {args.out}: {rows}")
    for b in res.bad:
        print(f"  corrupt: {b}")
    for path in res.deleted:
        print(f"  deleted (verified): {path}")
    for why in res.kept:
        print(f"  kept: {why}")
    return 0


def _parse_steps(text: str | None) -> tuple[int | None, int | None] | None:
    if not text:
        return None
    lo, sep, hi = text.partition(":")
    if not sep:
        raise SystemExit(f"ranklog replay: --steps {text!r}: expected A:B (either may be empty)")
    return (int(lo) if lo else None, int(hi) if hi else None)


def _replay(args: argparse.Namespace) -> int:
    from ranklog.shippers import make_target
    from ranklog.spool.replay import replay

    dataset = Path(args.dataset)
    if not (dataset / "_manifest.json").is_file():
        print(f"ranklog replay: {dataset} is not a compacted dataset", file=sys.stderr)
        return 2
    steps = _parse_steps(args.steps)
    code = 0
    for spec in args.to:
        target = make_target(spec, dataset, _options(args))
        code = max(code, replay(dataset, target, steps=steps, names=args.names,
                                per_rank=args.per_rank, relogged=args.relogged))  # fmt: skip
        print(f"replayed {dataset} into {spec}")
    return code


def _report(args: argparse.Namespace) -> int:
    from ranklog.errors import ConfigError, ExtraMissingError

    dataset = Path(args.dataset)
    if not (dataset / "_manifest.json").is_file():
        print(f"ranklog report: {dataset} is not a compacted dataset", file=sys.stderr)
        return 2
    try:
        from ranklog.report import write_report

        path = write_report(dataset, Path(args.out))
    except (ExtraMissingError, ConfigError) as exc:
        print(f"ranklog report: {exc}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ranklog._demo import run_demo

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ranklog-demo-"))
    spool = out / "spool"
    code = run_demo(spool, ranks=args.ranks, steps=args.steps, step_seconds=args.step_seconds)
    print(f"\nlook at: {spool}  (ranklog inspect {spool})")
    return code


def _target_flags(p: argparse.ArgumentParser) -> None:
    """Options every target understands (each uses what applies to it)."""
    p.add_argument(
        "--samples", type=int, default=2, help="validation samples printed per step (console)"
    )
    p.add_argument(
        "--per-rank", action="store_true",
        help="also log each rank's own values (TensorBoard rankNNNNN/ sub-runs, MLflow child "
        "runs, one W&B run per rank grouped by run name)",
    )  # fmt: skip
    p.add_argument("--run-name", help="the backend run's name (default: the spool's run name)")
    p.add_argument("--experiment", help="MLflow experiment (default: the run name)")
    p.add_argument("--entity", help="W&B entity")
    p.add_argument("--group", help="W&B group (default: the run name)")
    p.add_argument("--mode", choices=["online", "offline"], help="W&B mode")
    p.add_argument("--dir", help="local directory for backend files (W&B; default: SPOOL)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    p = argparse.ArgumentParser(
        prog="ranklog", description="Crash-resilient metrics logging for distributed training."
    )
    p.add_argument("--version", action="version", version=f"ranklog {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    ship = sub.add_parser("ship", help="reduce each step across ranks and forward it")
    ship.add_argument("spool")
    ship.add_argument(
        "--to",
        action="append",
        required=True,
        metavar="TARGET",
        help="jsonl:PATH | console[:N] (every N-th step); repeatable: one process per target",
    )
    ship.add_argument("--once", action="store_true", help="ship what is ready, then exit 0")
    ship.add_argument(
        "--poll", type=float, metavar="S", help="poll every S seconds (default: inotify, "
        "or polling every 1 s on network filesystems)"
    )  # fmt: skip
    ship.add_argument(
        "--dead-after", type=float, default=120.0, metavar="S",
        help="a rank silent this long is declared dead; its steps ship as partial",
    )  # fmt: skip
    ship.add_argument(
        "--start-grace", type=float, default=60.0, metavar="S",
        help="with a known world size, wait this long after the run starts for every rank",
    )  # fmt: skip
    ship.add_argument("--name", help="cursor name (default: derived from the target)")
    ship.add_argument("--quiet", action="store_true", help="no status line")
    ship.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    ship.add_argument(
        "--ray", nargs="?", const="", metavar="ADDRESS",
        help="fan in on Ray: reader actors tail shards of the ranks, a root actor ships "
        "(ADDRESS of the cluster; default: RAY_ADDRESS, or a running local Ray, or a new one)",
    )  # fmt: skip
    ship.add_argument(
        "--readers", type=int, default=2, metavar="N", help="reader actors with --ray (default 2)"
    )
    ship.add_argument(
        "--reader-cpus", type=float, default=1.0, metavar="C",
        help="logical CPUs each reader asks Ray for (default 1)",
    )  # fmt: skip
    _target_flags(ship)
    ship.set_defaults(func=_ship)

    comp = sub.add_parser("compact", help="write the spool's events as a Parquet dataset")
    comp.add_argument("spool")
    comp.add_argument("--out", required=True, help="dataset directory (created if missing)")
    comp.add_argument(
        "--delete", action="store_true",
        help="delete sealed segments once their rows are verified in Parquet (and shipped)",
    )  # fmt: skip
    comp.set_defaults(func=_compact)

    rep = sub.add_parser("replay", help="ship a compacted dataset into any target")
    rep.add_argument("dataset")
    rep.add_argument("--to", action="append", required=True, metavar="TARGET")
    rep.add_argument("--steps", metavar="A:B", help="only steps A <= step < B")
    rep.add_argument("--names", metavar="GLOB", help="only metrics, timers and text matching")
    rep.add_argument(
        "--relogged", choices=["first", "last"], default="first",
        help="steps a rank logged again after a restart: keep the values shipped first (as "
        "live backends did) or the last ones (the branch training continued from)",
    )  # fmt: skip
    _target_flags(rep)
    rep.set_defaults(func=_replay)

    ins = sub.add_parser("inspect", help="ranks, incarnations, steps, ends and damage of a spool")
    ins.add_argument("spool")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.set_defaults(func=_inspect)

    rpt = sub.add_parser("report", help="an HTML report of a compacted dataset")
    rpt.add_argument("dataset")
    rpt.add_argument("--out", default="report.html", help="the HTML file to write")
    rpt.set_defaults(func=_report)

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
