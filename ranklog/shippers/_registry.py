"""Target specs (``jsonl:PATH``, ``console``, ...) to target objects, and cursor names."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from ranklog.errors import ConfigError
from ranklog.shippers._target import Target

__all__ = ["TARGET_KINDS", "default_name", "make_target"]


def _jsonl(arg: str, spool: Path, samples: int) -> Target:
    from ranklog.shippers.jsonl import JsonlTarget

    if not arg:
        raise ConfigError("jsonl target needs a path: jsonl:PATH")
    return JsonlTarget(Path(arg).expanduser())


def _console(arg: str, spool: Path, samples: int) -> Target:
    from ranklog.shippers.console import ConsoleTarget

    try:
        every = int(arg) if arg else 1
    except ValueError:
        raise ConfigError(
            f"console:{arg}: expected console or console:N (every N-th step)"
        ) from None
    return ConsoleTarget(samples=samples, every=every)


#: kind -> factory(argument after the colon, spool, samples per step)
TARGET_KINDS: dict[str, Callable[[str, Path, int], Target]] = {
    "jsonl": _jsonl,
    "console": _console,
}


def make_target(spec: str, spool: str | os.PathLike[str], *, samples: int = 2) -> Target:
    """Build the target a ``--to`` spec names."""
    kind, _, arg = spec.partition(":")
    factory = TARGET_KINDS.get(kind)
    if factory is None:
        raise ConfigError(
            f"unknown target {spec!r}: expected one of "
            + ", ".join(f"{k}:..." if k != "console" else k for k in TARGET_KINDS)
        )
    return factory(arg, Path(spool), samples)


def default_name(spec: str) -> str:
    """A stable cursor name for a target spec: its kind and a short hash of the spec."""
    kind = spec.partition(":")[0] or "target"
    if spec == kind:
        return kind
    digest = hashlib.sha1(spec.encode(), usedforsecurity=False).hexdigest()[:8]
    return f"{kind}-{digest}"
