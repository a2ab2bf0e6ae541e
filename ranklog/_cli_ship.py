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
import signal
import subprocess
import sys
from typing import Any

from ranklog._cli_run import log_to_stderr, long_running, options
from ranklog.errors import ConfigError

__all__ = ["ship"]


class _Stopped(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that the shipper stops like on Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Stopped


def ship(args: argparse.Namespace) -> int:
    """``ranklog ship``: its exit code."""
    from ranklog.shippers import Progress, Shipper, make_target
    from ranklog.shippers._retry import ONCE_RETRY_FOR
    from ranklog.spool import require_run

    targets: list[str] = args.to or []
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
    for key, value in options(args).items():
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
        argv = _ship_argv(args, spec, _cursor_name(args, spec, len(targets)))
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
