"""The ``ranklog ship`` command: one shipper per target, each in its own process.

``ranklog ship SPOOL --to A --to B`` starts one ``ranklog ship`` process per target
(a slow or broken target never holds another back); each runs a
:class:`~ranklog.shippers.Shipper`, records in its cursor the arguments that start it
again, and says in one line where it stopped on Ctrl-C or SIGTERM.
``ranklog ship SPOOL`` with no ``--to`` starts again every shipper the spool's cursors
recorded: what a job's epilogue runs after the job was killed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from typing import Any

from ranklog._cli_run import check_options, log_to_stderr, long_running, options
from ranklog.errors import ConfigError

__all__ = ["ship"]


class _Stopped(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that the shipper stops like on Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Stopped


def ship(args: argparse.Namespace) -> int:
    """``ranklog ship``: its exit code."""
    from ranklog.shippers import Progress, Shipper, make_target
    from ranklog.shippers._reopen import check_name
    from ranklog.shippers._retry import ONCE_RETRY_FOR
    from ranklog.spool import require_run

    targets: list[str] = args.to or []
    if args.name is not None:
        check_name(args.name)
    if targets:
        check_options(args, targets)
    require_run(args.spool)
    if not targets:
        return _ship_known(args)
    if len(targets) > 1 and not args.in_process:
        return _ship_each(args, targets)
    log_to_stderr()
    if args.ray is not None and args.readers < 1:
        raise ConfigError(f"--readers must be at least 1, got {args.readers}")
    retry_for = args.retry_for
    if retry_for is None and args.once:
        retry_for = ONCE_RETRY_FOR
    code = 0
    for spec in targets:
        name = _cursor_name(args, spec, len(targets))
        argv = _ship_argv(args, spec, name)
        if args.ray is not None:
            _ship_on_ray(args, spec, name, retry_for=retry_for, argv=argv)
            continue
        target = make_target(
            spec, args.spool, options(args), per_rank=args.per_rank, append_run=args.append_run
        )
        log_to_stderr()
        long_running()
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
        options(args),
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
        append_run=args.append_run,
        **shipper,
    )


def _cursor_name(args: argparse.Namespace, spec: str, targets: int) -> str | None:
    """The shipper's name for ``spec``: ``--name``, or with several targets ``NAME-KIND``
    (one cursor per target; the same in one process or one process per target)."""
    if not args.name:
        return None
    return str(args.name) if targets == 1 else f"{args.name}-{spec.partition(':')[0]}"


def _ship_argv(args: argparse.Namespace, spec: str, name: str | None) -> list[str]:
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
    if name:  # the shipper's own name (--name names the only target's, not several)
        flags += ["--name", name]
    declared = all_options()
    kind = spec.partition(":")[0]
    for key, value in options(args).items():
        opt, takers = declared[key]
        if kind in takers:  # (each target's process gets the options its kind takes)
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


def _children(cmds: list[list[str]]) -> list[int]:
    """Run ``ranklog ship`` processes side by side (in this command's directory); the exit
    code of each."""
    procs = [subprocess.Popen(cmd, env=dict(os.environ)) for cmd in cmds]
    try:
        return [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        return [p.wait() for p in procs]


def _ship_each(args: argparse.Namespace, targets: list[str]) -> int:
    """One process per target: a slow or broken target never holds another back."""
    base = [sys.executable, "-m", "ranklog.cli", "ship", args.spool]
    cmds: list[list[str]] = []
    for spec in targets:
        argv = _ship_argv(args, spec, _cursor_name(args, spec, len(targets)))
        cmds.append([*base, *argv, *_invocation(args)])
    return max(_children(cmds), default=0)


def _kept_per_rank(args: argparse.Namespace, recorded: list[str]) -> list[str]:
    """``--per-rank`` when the cursor's record says the target was shipped with it (it
    holds each rank's runs too, which the tail of the job must reach), read as the
    command line reads it. Nothing of the record can leave a step out or merge runs:
    ``--below-last skip`` is the epilogue's own to give (else refused in one line), and a
    JSONL file that holds this run beside another's goes on without ``--append-run``."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--per-rank", action="store_true")
    try:
        got, _ = parser.parse_known_args([str(t) for t in recorded])
    except argparse.ArgumentError:
        return []  # (a damaged record: the command line's alone)
    return ["--per-rank"] * (got.per_rank and not args.per_rank)


def _shipper_flags(args: argparse.Namespace, kind: str) -> list[str]:
    """This command's shipper options, and the target options it was given that ``kind``
    takes, as ``--flag=VALUE``."""
    from ranklog.shippers import all_options

    flags = [f"--dead-after={args.dead_after}", f"--start-grace={args.start_grace}",
             f"--lease-ttl={args.lease_ttl}", f"--late={args.late}",
             f"--below-last={args.below_last}"]  # fmt: skip
    flags += ["--per-rank"] * args.per_rank + ["--append-run"] * args.append_run
    if args.poll is not None:
        flags.append(f"--poll={args.poll}")
    declared = all_options()
    for key, value in options(args).items():
        opt, kinds = declared[key]
        if kind in kinds:
            flags.append(opt.flag if value is True else f"{opt.flag}={value}")
    return flags


def _ship_known(args: argparse.Namespace) -> int:
    """``ranklog ship SPOOL`` with no ``--to``: every target this spool's shippers recorded.

    The epilogue of a job: whatever the shippers a training process started did not get
    to (they were killed with it), the same targets get now. Each target is re-created
    from its cursor's identity (:mod:`ranklog.shippers._reopen`), with the shipper options
    of this command line (and its presentation options, checked, as recorded); a cursor
    that cannot be read or re-created is one line and a non-zero exit. It ends with one
    line per target: where it stands.
    """
    from ranklog.errors import CursorError
    from ranklog.shippers import load_cursor
    from ranklog.shippers._reopen import check_name, kept_options, reopen_flags
    from ranklog.spool import SpoolLayout

    spool = os.path.abspath(args.spool)
    base = [sys.executable, "-m", "ranklog.cli", "ship", spool]
    d = SpoolLayout(spool).cursors_dir
    names = sorted(p.name[: -len(".json")] for p in d.glob("*.json")) if d.is_dir() else []
    cmds: list[list[str]] = []
    started: list[tuple[str, str]] = []  # (cursor name, identity)
    code = 0
    for name in names:
        try:
            cursor = load_cursor(spool, check_name(name))
        except (CursorError, ConfigError) as exc:
            print(f"ranklog ship: {exc}", file=sys.stderr)
            code = max(code, CursorError.exit_code)
            continue
        if cursor is None:
            continue
        if name.startswith("compact-") and re.fullmatch(r"parquet:/.*/steps", cursor.identity):
            continue  # a dataset's steps table: `ranklog compact` ships it
        try:
            flags = reopen_flags(cursor.identity)
        except ConfigError:
            print(f"ranklog ship: cursor {d / name}.json (target {cursor.target}) records no "
                  "target this ranklog can re-create (written by an older ranklog, or not by "
                  f"`ranklog ship`): ship it with --to {cursor.target}",
                  file=sys.stderr)  # fmt: skip
            code = max(code, ConfigError.exit_code)
            continue
        kind = cursor.identity.partition(":")[0]
        # the last of a flag given twice wins: the recorded presentation options, then
        # this command's (over them), and the identity's (over all: where it writes)
        cmds.append([*base, *kept_options(kind, cursor.argv), *_shipper_flags(args, kind),
                     *_kept_per_rank(args, cursor.argv), *flags, f"--name={name}",
                     *_invocation(args)])  # fmt: skip
        started.append((name, cursor.identity))
    if not cmds and not code:
        raise ConfigError(
            f"no --to given and no shipper of {args.spool} recorded its target: name the "
            "targets with --to"
        )
    for (name, identity), rc in zip(started, _children(cmds), strict=True):
        try:
            cursor = load_cursor(spool, name)
        except CursorError:
            cursor = None
        upto = "nothing" if cursor is None or cursor.last_step < 0 else cursor.last_step
        where = f"step {upto}" if isinstance(upto, int) else upto
        if rc == 0:
            print(f"ranklog ship: {identity}: shipped up to {where}", file=sys.stderr)
        else:
            print(f"ranklog ship: {identity}: stopped at {where} (exit {rc}, said above)",
                  file=sys.stderr)  # fmt: skip
        code = max(code, rc)
    return code
