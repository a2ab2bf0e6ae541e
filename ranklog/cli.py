"""The ``ranklog`` command.

::

    ranklog ship SPOOL --to TARGET [--to TARGET ...] [--once] [--poll S] [--dead-after S]
                 [--name N] [--per-rank] [--late count|ship] [--ray [ADDRESS]]
                 [target options]
    ranklog compact SPOOL --out DIR [--delete]
    ranklog replay DIR --to TARGET [--to TARGET ...] [--steps A:B] [--names GLOB]
                   [--relogged first|last] [--late count|ship] [target options]
    ranklog inspect SPOOL [--json]
    ranklog report DIR --out report.html
    ranklog demo [--out DIR] [--ranks N] [--steps N]

Target options (``--run-name``, ``--experiment``, ``--entity`` ...) come from the
targets' own declarations (:class:`ranklog.shippers.TargetKind`). An error a
user can cause (a bad path, option or target, an unreachable backend) is one
line on stderr and the exit code of its :class:`~ranklog.errors.RanklogError`
class, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ranklog._cli_run import OPT, check_options, log_to_stderr, long_running, options
from ranklog._version import __version__
from ranklog.errors import ConfigError, RanklogError

if TYPE_CHECKING:
    from ranklog.spool._inspect import SpoolSummary

__all__ = ["build_parser", "main"]


def _inspect(args: argparse.Namespace) -> int:
    from ranklog.spool import require_run
    from ranklog.spool._inspect import format_summary, summarize

    spool = Path(args.spool)
    require_run(spool)  # (a directory that is not a spool: exit 3, as ship and compact say)
    summary = summarize(spool, dead_after=args.dead_after)
    _add_shippers(summary)
    if args.json:
        json.dump(summary.to_dict(), sys.stdout, indent=1, default=str)
        print()
    else:
        print(format_summary(summary))
    return 0


def _add_shippers(summary: SpoolSummary) -> None:
    """Each shipper's cursor, with its lag behind what the ranks closed, and its lease."""
    from ranklog.shippers import list_cursors
    from ranklog.shippers._lease import read_leases
    from ranklog.spool import HEADER_SIZE
    from ranklog.spool._inspect import ShipperSummary

    top = max(
        (i.closed_step for i in summary.incarnations if i.closed_step is not None), default=-1
    )
    leases = {lease.target: lease for lease in read_leases(summary.spool)}
    for c in list_cursors(summary.spool):
        lag_bytes = sum(
            max(0, size - max(c.segments[k].offset if k in c.segments else 0, HEADER_SIZE))
            for k, size in summary.sizes.items()
        )
        lease = leases.pop(c.identity or c.target, None)
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
                state=lease.state() if lease is not None else "stopped",
                identity=c.identity,
                skipped_below=c.skipped_below,
                name_collisions=c.name_collisions,
            )
        )
    for lease in leases.values():  # running, nothing committed yet
        summary.shippers.append(
            ShipperSummary(
                name=lease.key, target=lease.target, last_step=-1, steps_shipped=0,
                lag_steps=max(0, top + 1), lag_bytes=sum(summary.sizes.values()), late_events=0,
                relogged_events=0, bad_ranges=0, updated=0.0,
                state=lease.state() + ", no cursor yet", identity=lease.target,
            )
        )  # fmt: skip


def _ship(args: argparse.Namespace) -> int:
    from ranklog._cli_ship import ship

    return ship(args)


def _compact(args: argparse.Namespace) -> int:
    from ranklog.archive import compact

    long_running()
    if args.steps:
        return _add_steps(args)
    if args.out is None:
        raise ConfigError("compact needs --out DIR (the dataset), or --steps DATASET")
    res = compact(args.spool, args.out, delete=args.delete, force=args.force, repair=args.repair)
    for rel in res.repaired:
        print(f"  repaired from the spool: {args.out}/{rel} (the damaged file kept in "
              f"{args.out}/.damaged/{rel})")  # fmt: skip
    rows = ", ".join(f"{t} {n:,}" for t, n in sorted(res.rows.items())) or "nothing new"
    print(f"compacted {res.files} files into {args.out}: {rows}")
    shipped, last = res.steps
    if res.steps_left:
        print(f"  steps table: not written: {res.steps_left}")
    else:
        print(f"  steps table: {shipped:,} steps as shipped, up to step {last}"
              if last >= 0 else "  steps table: no step complete yet")  # fmt: skip
    for b in res.bad:
        print(f"  corrupt: {b}")
    if res.merged:
        print(f"  merged {len(res.merged)} small files into larger ones")
    for path in res.deleted:
        print(f"  deleted (verified): {path}")
    for why in res.kept:
        print(f"  kept: {why}")
    return 0


def _add_steps(args: argparse.Namespace) -> int:
    """``ranklog compact --steps DS``: the steps table of a dataset that lacks a whole one."""
    from ranklog.archive import write_steps

    given = [f for f, v in (("--out", args.out), ("--delete", args.delete),
                            ("--repair", args.repair)) if v]  # fmt: skip
    if given:
        raise ConfigError(f"compact --steps DATASET takes no {given[0]}: it adds the steps "
                          "table to a dataset, from its own rows")  # fmt: skip
    log_to_stderr()
    done = write_steps(args.spool)
    if done is None:
        print(f"{args.spool}: its steps table is whole already (nothing to do)")
    else:
        print(f"{args.spool}: steps table written from the raw rows: {done[0]:,} steps, up "
              f"to step {done[1]}")  # fmt: skip
    return 0


def _steps(text: str) -> tuple[int | None, int | None]:
    """``A:B`` (either may be empty) as an argparse type."""
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError(text)
        return (int(lo) if lo else None, int(hi) if hi else None)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected A:B (steps A <= step < B; either may be empty)"
        ) from None


def _replay(args: argparse.Namespace) -> int:
    from ranklog.archive import replay, require_manifest
    from ranklog.shippers import make_target, target_identity
    from ranklog.spool import RunInfo

    if not args.to:
        raise ConfigError("replay needs a target: --to TARGET")
    check_options(args, args.to)
    manifest = require_manifest(args.dataset)
    log_to_stderr()
    code = 0
    run = RunInfo(manifest.run_id, manifest.created, manifest.name, manifest.world_size)
    for spec in args.to:
        # a target's default place (an MLflow store, W&B or SwanLab files) is under the
        # current directory, never in the dataset: said in one line
        target = make_target(spec, Path.cwd(), options(args), per_rank=args.per_rank,
                             names=args.names, append_run=args.append_run)  # fmt: skip
        print(f"replaying {args.dataset} into {target_identity(target, run)}", flush=True)
        log_to_stderr()
        long_running()
        code = max(code, replay(args.dataset, target, steps=args.steps, names=args.names,
                                per_rank=args.per_rank, relogged=args.relogged,
                                late=args.late, below_last=args.below_last,
                                retry_for=args.retry_for))  # fmt: skip
        print(f"replayed {args.dataset} into {spec}")
    return code


def _report(args: argparse.Namespace) -> int:
    from ranklog.archive import require_manifest
    from ranklog.report import write_report

    require_manifest(args.dataset)
    print(f"report: {write_report(Path(args.dataset), Path(args.out))}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ranklog._demo import run_demo

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ranklog-demo-"))
    spool = out / "spool"
    code = run_demo(spool, ranks=args.ranks, steps=args.steps, step_seconds=args.step_seconds)
    from ranklog._demo import command

    print(f"\nlook at: {spool}  ({command('ranklog')} inspect {spool.resolve()})")
    return code


def _to_help() -> str:
    from ranklog.shippers import target_kinds

    kinds = "; ".join(f"{k.usage}: {k.help}" for k in target_kinds().values())
    return f"where to ship, repeatable (one process per target): {kinds}"


def _target_flags(p: argparse.ArgumentParser) -> None:
    """``--to``, ``--per-rank``, ``--late`` and every option the targets declare."""
    from ranklog.shippers import all_options
    from ranklog.shippers._ranks import LATE_POLICIES

    p.add_argument("--to", action="append", metavar="TARGET", help=_to_help())
    p.add_argument(
        "--append-run", action="store_true",
        help="write into a target that holds another run's steps (JSONL: this run's lines "
        "follow, after a line naming it); without it such a target is refused",
    )  # fmt: skip
    p.add_argument(
        "--below-last", choices=("refuse", "skip"), default="refuse",
        help="a target that cannot write below its last step (W&B) and lacks steps below "
        "it: refuse before writing (default), or leave those steps out (counted)",
    )  # fmt: skip
    p.add_argument(
        "--retry-for", type=float, metavar="S",
        help="give up after S seconds of transient target failures (exit 5; default: 120 "
        "with --once and replay, else retry for ever); permanent ones fail at once",
    )  # fmt: skip
    p.add_argument(
        "--per-rank", action="store_true",
        help="also log each rank's own values (TensorBoard rankNNNNN/ sub-runs, MLflow child "
        "runs, one W&B run per rank grouped by run name)",
    )  # fmt: skip
    p.add_argument(
        "--late", choices=LATE_POLICIES, default="count",
        help="values logged for a step after it was closed (or re-logged after a restart): "
        "count them only (default), or ship them too, at their own step, right after the "
        "step their rank was in (as a program logging to the backend directly would)",
    )  # fmt: skip
    group = p.add_argument_group("target options (each target uses those it declares)")
    for name, (opt, kinds) in all_options().items():
        text = f"{opt.help} [{', '.join(kinds)}]"
        try:
            if opt.type is bool:
                group.add_argument(opt.flag, dest=OPT + name, action="store_true", help=text)
            else:
                group.add_argument(
                    opt.flag, dest=OPT + name, type=opt.parse, help=text,
                    metavar=opt.metavar or (" | ".join(opt.choices) if opt.choices else None)
                    or name.upper(),
                )  # fmt: skip
        except argparse.ArgumentError as exc:  # a plug-in's option shadowing a ranklog flag
            logging.getLogger("ranklog").warning("target option %s ignored: %s", opt.flag, exc)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests).

    With ``command`` other than ``ship`` or ``replay``, their flags that need the shipper
    engine and every target's options are left out: ``ranklog compact`` starts without
    importing them.
    """
    shipping = command is None or command in ("ship", "replay")
    p = argparse.ArgumentParser(
        prog="ranklog", description="Crash-resilient metrics logging for distributed training."
    )
    p.add_argument("--version", action="version", version=f"ranklog {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    ship = sub.add_parser("ship", help="reduce each step across ranks and forward it")
    ship.add_argument("spool")
    ship.add_argument(
        "--once", action="store_true",
        help="ship what is ready, then exit (0 when shipped; 5 when the target failed); "
        "without --to: every target this spool's shippers recorded (a job's epilogue)",
    )  # fmt: skip
    ship.add_argument(
        "--exit-with", type=int, metavar="PID",
        help="ship what is closed and exit once process PID ends (a shipper started by "
        "the training process; default: follow the job until every rank ended)",
    )  # fmt: skip
    ship.add_argument(
        "--poll", type=float, metavar="S", help="poll every S seconds (default: inotify, "
        "or polling every 1 s on network filesystems)"
    )  # fmt: skip
    ship.add_argument(
        "--dead-after", type=float, default=120.0, metavar="S",
        help="a rank silent this long is declared dead; its steps ship as partial (default "
        "120)",
    )  # fmt: skip
    ship.add_argument(
        "--start-grace", type=float, default=60.0, metavar="S",
        help="with a known world size, wait this long after the run starts for every rank "
        "(default 60)",
    )  # fmt: skip
    ship.add_argument("--name", help="cursor name (default: derived from the target)")
    if shipping:
        from ranklog.shippers._lease import DEFAULT_TTL

        ship.add_argument(
            "--lease-ttl", type=float, default=DEFAULT_TTL, metavar="S",
            help="one shipper per target: a second one exits with status 3 while the first "
            "renews its lease; a holder silent this long is taken over (default 30)",
        )  # fmt: skip
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
    if shipping:
        _target_flags(ship)
    ship.set_defaults(func=_ship)

    comp = sub.add_parser("compact", help="write the spool's events as a Parquet dataset")
    comp.add_argument("spool", help="the spool (with --steps: the dataset)")
    comp.add_argument("--out", help="dataset directory (created if missing; required but "
                      "with --steps)")  # fmt: skip
    comp.add_argument(
        "--steps", action="store_true",
        help="SPOOL is a dataset: write its steps table (the steps as shipped, which replay "
        "reads) from its raw rows, for a dataset of an older release or whose table is not "
        "whole (default: off)",
    )  # fmt: skip
    comp.add_argument(
        "--delete", action="store_true",
        help="delete sealed segments once their rows are verified in Parquet and every "
        "shipper the spool knows shipped them",
    )  # fmt: skip
    comp.add_argument(
        "--repair", action="store_true",
        help="rewrite the dataset's damaged files from the spool's segments (the damaged "
        "ones are moved to DIR/.damaged/); refused when a segment they hold is gone",
    )  # fmt: skip
    comp.add_argument(
        "--force", action="store_true",
        help="with --delete: delete verified segments even if a shipper has not shipped them "
        "(it then says to replay them from the dataset)",
    )  # fmt: skip
    comp.set_defaults(func=_compact)

    rep = sub.add_parser("replay", help="ship a compacted dataset into any target")
    rep.add_argument("dataset")
    rep.add_argument("--steps", type=_steps, metavar="A:B",
                     help="only steps A <= step < B (default: every step)")  # fmt: skip
    rep.add_argument(
        "--names", metavar="GLOB",
        help="only metrics, timers and text matching (default: every name)",
    )  # fmt: skip
    rep.add_argument(
        "--relogged", choices=["first", "last"], default="first",
        help="steps a rank logged again after a restart: keep the values shipped first (as "
        "live backends did; the default) or the last ones (the branch training continued "
        "from)",
    )  # fmt: skip
    if shipping:
        _target_flags(rep)
    rep.set_defaults(func=_replay)

    ins = sub.add_parser("inspect", help="ranks, incarnations, steps, ends and damage of a spool")
    ins.add_argument("spool")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument(
        "--dead-after", type=float, default=120.0, metavar="S",
        help="a rank silent this long is dead, as `ranklog ship --dead-after` judges it: "
        "say it as the shipper does (default 120)",
    )  # fmt: skip
    ins.set_defaults(func=_inspect)

    rpt = sub.add_parser("report", help="an HTML report of a compacted dataset")
    rpt.add_argument("dataset")
    rpt.add_argument("--out", default="report.html",
                     help="the HTML file to write (default: report.html)")  # fmt: skip
    rpt.set_defaults(func=_report)

    demo = sub.add_parser("demo", help="a short multi-process job on this machine")
    demo.add_argument("--out", help="directory for the demo's outputs (default: a temp dir)")
    demo.add_argument("--ranks", type=int, default=4, help="ranks of the job (default: 4)")
    demo.add_argument("--steps", type=int, default=300, help="steps it logs (default: 300)")
    demo.add_argument("--step-seconds", type=float, default=0.01,
                      help="seconds a step takes (default: 0.01)")  # fmt: skip
    demo.set_defaults(func=_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ranklog`` console script: an exit code, never a traceback."""
    argv = sys.argv[1:] if argv is None else argv
    # the subcommand: the first word (ranklog's own options take no value)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:  # `ranklog inspect | head`: the reader had enough; say nothing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except RanklogError as exc:
        print(f"ranklog {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a file or directory the system refused: say which
        print(f"ranklog {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
