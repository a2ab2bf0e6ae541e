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
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ranklog._version import __version__
from ranklog.errors import ConfigError, RanklogError

if TYPE_CHECKING:
    from ranklog.spool._inspect import SpoolSummary

__all__ = ["build_parser", "main"]

#: where parsed target option values go in the namespace (``opt_run_name`` ...)
_OPT = "opt_"


def _inspect(args: argparse.Namespace) -> int:
    from ranklog.spool._inspect import format_summary, summarize

    spool = Path(args.spool)
    if not spool.is_dir():
        raise ConfigError(f"{spool}: no such spool directory")
    summary = summarize(spool)
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


def _long_running() -> None:
    """Tune the collector for a shipper process, once its backend library is imported.

    What a shipper allocates (events, values, steps) is acyclic and freed by reference
    counting; what it imported (a backend's modules: MLflow and SQLAlchemy hold about a
    million objects) stays for good. Frozen, those are never traversed again, and full
    collections come a hundred times less often: they were a third of MLflow shipping.
    """
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    if "pyarrow" in sys.modules and not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        # Compaction and replay allocate and free columns all the time; the system
        # allocator measured up to twice as fast as mimalloc for that (the user's
        # ARROW_DEFAULT_MEMORY_POOL, when set, wins).
        import pyarrow as pa

        pa.set_memory_pool(pa.system_memory_pool())
    if "pyarrow" in sys.modules and "pandas" not in sys.modules:
        _pyarrow_without_pandas()


def _pyarrow_without_pandas() -> None:
    """Spare a compaction or replay the ~0.25 s of importing pandas, which it never uses.

    pyarrow imports pandas (when installed) on its first conversion, to check whether an
    input is a pandas object. Shown absent for that one check, pyarrow stops asking;
    pandas itself stays importable, and anything that needs it in pyarrow imports it then.
    """
    import pyarrow as pa

    class NoPandas:  # `import pandas` fails, for the one check
        @staticmethod
        def find_spec(name: str, *args: object) -> None:
            if name == "pandas":
                raise ImportError("pandas is not needed here")

    blocker = NoPandas()
    sys.meta_path.insert(0, blocker)
    try:
        pa.array([0])
    finally:
        sys.meta_path.remove(blocker)


def _log_to_stderr() -> None:
    """ranklog's own messages on stderr, one line each; libraries' only when they are errors.

    Called again once a target is built: importing MLflow configures its loggers anew.
    """
    ours = logging.getLogger("ranklog")
    if not any(isinstance(h, _Stderr) for h in ours.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("ranklog: %(message)s"))
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False
    # a library's retry bookkeeping (urllib3's "Retrying (Retry(total=...))") never reaches
    # the terminal: the shipper says in one line what failed and what it does about it
    for name in ("urllib3", "requests", "mlflow", "wandb", "alembic", "sqlalchemy", "git"):
        logging.getLogger(name).setLevel(logging.ERROR)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to whatever ``sys.stderr`` is at the time of each record."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


class _Stopped(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that the shipper stops like on Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Stopped


def _ship(args: argparse.Namespace) -> int:
    from ranklog.shippers import Progress, Shipper, make_target
    from ranklog.shippers._retry import ONCE_RETRY_FOR
    from ranklog.spool import require_run

    targets: list[str] = args.to or []
    require_run(args.spool)
    if not targets:
        return _ship_known(args)
    if len(targets) > 1 and not args.in_process:
        return _ship_each(args, targets)
    _log_to_stderr()
    if args.ray is not None and args.readers < 1:
        raise ConfigError(f"--readers must be at least 1, got {args.readers}")
    retry_for = args.retry_for
    if retry_for is None and args.once:
        retry_for = ONCE_RETRY_FOR
    code = 0
    for spec in targets:
        name = args.name if args.name and len(targets) == 1 else None
        argv = _ship_argv(args, spec)
        if args.ray is not None:
            _ship_on_ray(args, spec, name, retry_for=retry_for, argv=argv)
            continue
        target = make_target(
            spec, args.spool, _options(args), per_rank=args.per_rank, append_run=args.append_run
        )
        _log_to_stderr()
        _long_running()
        shipper = Shipper(
            args.spool,
            target,
            name=name,
            poll=args.poll,
            dead_after=args.dead_after,
            start_grace=args.start_grace,
            per_rank=args.per_rank,
            progress=None if args.quiet else Progress(),
            lease_ttl=args.lease_ttl,
            late=args.late,
            retry_for=retry_for,
            parent=args.exit_with,
            below_last=args.below_last,
            argv=argv,
        )
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            code = max(code, shipper.run_forever(once=args.once))
        except KeyboardInterrupt as exc:
            what = "terminated" if isinstance(exc, _Stopped) else "interrupted"
            print(
                f"ranklog ship: {what}; {spec} holds every step up to {shipper.shipped_upto} "
                f"({shipper.stats.steps_shipped} shipped); run the same command to resume",
                file=sys.stderr,
            )
            return 143 if isinstance(exc, _Stopped) else 130
        finally:
            signal.signal(signal.SIGTERM, previous)
    return code


def _ship_on_ray(args: argparse.Namespace, spec: str, name: str | None, **shipper: Any) -> None:
    from ranklog.shippers._fanin import FanIn, ship_on_ray

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
        lease_ttl=args.lease_ttl,
        late=args.late,
        below_last=args.below_last,
        **shipper,
    )


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The target options given on the command line (unset ones left out)."""
    return {
        key[len(_OPT) :]: value
        for key, value in vars(args).items()
        if key.startswith(_OPT) and value is not None and value is not False
    }


def _ship_argv(args: argparse.Namespace, spec: str) -> list[str]:
    """The ``ranklog ship SPOOL`` arguments that start this target's shipper again (kept in
    its cursor): the target and its options, never ``--once`` and the like."""
    from ranklog.shippers import all_options

    flags = ["--to", spec, "--dead-after", str(args.dead_after)]
    flags += ["--start-grace", str(args.start_grace), "--lease-ttl", str(args.lease_ttl)]
    flags += ["--late", args.late, "--below-last", args.below_last]
    flags += ["--per-rank"] * args.per_rank + ["--append-run"] * args.append_run
    if args.poll is not None:
        flags += ["--poll", str(args.poll)]
    if args.ray is not None:
        flags += [f"--ray={args.ray}", "--readers", str(args.readers)]
        flags += ["--reader-cpus", str(args.reader_cpus)]
    if args.name:
        flags += ["--name", args.name]
    declared = all_options()
    for key, value in _options(args).items():
        opt = declared[key][0]
        flags += [opt.flag] if value is True else [opt.flag, str(value)]
    return flags


def _invocation(args: argparse.Namespace) -> list[str]:
    """The flags of this command that are not part of a target's shipper (``--once``)."""
    flags = ["--once"] * args.once + ["--quiet"] * args.quiet
    if args.retry_for is not None:
        flags += ["--retry-for", str(args.retry_for)]
    if args.exit_with is not None:
        flags += ["--exit-with", str(args.exit_with)]
    return flags


def _children(cmds: list[tuple[list[str], str | None]]) -> int:
    """Run ``ranklog ship`` processes side by side; the highest exit code."""
    procs = [subprocess.Popen(cmd, env=dict(os.environ), cwd=cwd) for cmd, cwd in cmds]
    try:
        return max((p.wait() for p in procs), default=0)
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        return max(p.wait() for p in procs)


def _ship_each(args: argparse.Namespace, targets: list[str]) -> int:
    """One process per target: a slow or broken target never holds another back."""
    base = [sys.executable, "-m", "ranklog.cli", "ship", args.spool]
    cmds: list[tuple[list[str], str | None]] = []
    for spec in targets:
        argv = _ship_argv(args, spec)
        if args.name:  # one cursor name per target
            argv[argv.index("--name") + 1] = f"{args.name}-{spec.partition(':')[0]}"
        cmds.append(([*base, *argv, *_invocation(args)], None))
    return _children(cmds)


def _ship_known(args: argparse.Namespace) -> int:
    """``ranklog ship SPOOL`` with no ``--to``: every target this spool's shippers recorded.

    The epilogue of a job: whatever the shippers a training process started did not get
    to (they were killed with it), the same targets get now, with the same options.
    """
    from ranklog.shippers import list_cursors

    base = [sys.executable, "-m", "ranklog.cli", "ship", os.path.abspath(args.spool)]
    cmds: list[tuple[list[str], str | None]] = []
    unknown = []
    for c in list_cursors(args.spool):
        if not c.argv:
            unknown.append(c)
            continue
        cmds.append(([*base, *c.argv, *_invocation(args)], c.cwd or None))
    for c in unknown:
        print(f"ranklog ship: shipper {c.name} ({c.target}) was not started by `ranklog "
              f"ship` (or by an older ranklog): ship it with --to {c.target}",
              file=sys.stderr)  # fmt: skip
    if not cmds:
        raise ConfigError(
            f"no --to given and no shipper of {args.spool} recorded its target: name the "
            "targets with --to"
        )
    code = _children(cmds)
    return max(code, ConfigError.exit_code if unknown else 0)


def _compact(args: argparse.Namespace) -> int:
    from ranklog.archive import compact

    _long_running()
    res = compact(args.spool, args.out, delete=args.delete, force=args.force)
    rows = ", ".join(f"{t} {n:,}" for t, n in sorted(res.rows.items())) or "nothing new"
    print(f"compacted {res.files} files into {args.out}: {rows}")
    for b in res.bad:
        print(f"  corrupt: {b}")
    for path in res.deleted:
        print(f"  deleted (verified): {path}")
    for why in res.kept:
        print(f"  kept: {why}")
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
    from ranklog.shippers import make_target

    if not args.to:
        raise ConfigError("replay needs a target: --to TARGET")
    require_manifest(args.dataset)
    _log_to_stderr()
    code = 0
    for spec in args.to:
        target = make_target(spec, args.dataset, _options(args), per_rank=args.per_rank,
                             names=args.names, append_run=args.append_run)  # fmt: skip
        _log_to_stderr()
        _long_running()
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
    print(f"\nlook at: {spool}  (ranklog inspect {spool})")
    return code


def _to_help() -> str:
    from ranklog.shippers import target_kinds

    kinds = "; ".join(f"{k.usage}: {k.help}" for k in target_kinds().values())
    return f"where to ship, repeatable (one process per target): {kinds}"


def _target_flags(p: argparse.ArgumentParser) -> None:
    """``--to``, ``--per-rank``, ``--late`` and every option the targets declare."""
    from ranklog.shippers import all_options
    from ranklog.shippers._tail import LATE_POLICIES

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
                group.add_argument(opt.flag, dest=_OPT + name, action="store_true", help=text)
            else:
                group.add_argument(
                    opt.flag, dest=_OPT + name, type=opt.parse, help=text,
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
        "the training process)",
    )  # fmt: skip
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
    comp.add_argument("spool")
    comp.add_argument("--out", required=True, help="dataset directory (created if missing)")
    comp.add_argument(
        "--delete", action="store_true",
        help="delete sealed segments once their rows are verified in Parquet and every "
        "shipper the spool knows shipped them",
    )  # fmt: skip
    comp.add_argument(
        "--force", action="store_true",
        help="with --delete: delete verified segments even if a shipper has not shipped them "
        "(it then says to replay them from the dataset)",
    )  # fmt: skip
    comp.set_defaults(func=_compact)

    rep = sub.add_parser("replay", help="ship a compacted dataset into any target")
    rep.add_argument("dataset")
    rep.add_argument("--steps", type=_steps, metavar="A:B", help="only steps A <= step < B")
    rep.add_argument("--names", metavar="GLOB", help="only metrics, timers and text matching")
    rep.add_argument(
        "--relogged", choices=["first", "last"], default="first",
        help="steps a rank logged again after a restart: keep the values shipped first (as "
        "live backends did) or the last ones (the branch training continued from)",
    )  # fmt: skip
    if shipping:
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
