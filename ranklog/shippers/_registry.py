"""Target specs (``jsonl:PATH``, ``tensorboard:DIR``, ...) to target objects, and cursor names.

Every backend module is imported only when its target is asked for; a missing
extra raises :class:`ranklog.ExtraMissingError` naming ``pip install 'ranklog[NAME]'``.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ranklog.errors import ConfigError
from ranklog.shippers._target import Target

__all__ = ["TARGET_KINDS", "TargetOptions", "default_name", "make_target"]


@dataclass(frozen=True, slots=True)
class TargetOptions:
    """Options that ``ranklog ship`` passes to every target (each uses what applies)."""

    #: validation samples printed per step (console)
    samples: int = 2
    #: also log each rank's own values (TensorBoard sub-runs, MLflow child runs, W&B runs)
    per_rank: bool = False
    #: the backend's run name (default: the ranklog run's name)
    run_name: str | None = None
    #: MLflow experiment name (default: the ranklog run's name)
    experiment: str | None = None
    #: W&B entity
    entity: str | None = None
    #: W&B group (default: the run name)
    group: str | None = None
    #: W&B mode: "offline" or "online" (default: online when an API key is configured)
    mode: str | None = None
    #: where backends that keep local files put them (W&B); default: inside the spool
    dir: str | None = None


Factory = Callable[[str, Path, TargetOptions], Target]


def _jsonl(arg: str, spool: Path, opts: TargetOptions) -> Target:
    from ranklog.shippers.jsonl import JsonlTarget

    if not arg:
        raise ConfigError("jsonl target needs a path: jsonl:PATH")
    return JsonlTarget(Path(arg).expanduser())


def _console(arg: str, spool: Path, opts: TargetOptions) -> Target:
    from ranklog.shippers.console import ConsoleTarget

    try:
        every = int(arg) if arg else 1
    except ValueError:
        raise ConfigError(
            f"console:{arg}: expected console or console:N (every N-th step)"
        ) from None
    return ConsoleTarget(samples=opts.samples, every=every)


def _backend(module: str) -> Factory:
    """A factory that imports ``ranklog.shippers.<module>`` only when its target is used.

    Each backend module defines ``make(arg, spool, options) -> Target`` and imports
    its backend library lazily (ExtraMissingError when the extra is missing).
    """

    def factory(arg: str, spool: Path, opts: TargetOptions) -> Target:
        mod = importlib.import_module(f"ranklog.shippers.{module}")
        target: Target = mod.make(arg, spool, opts)
        return target

    return factory


#: kind -> factory(argument after the colon, spool, options)
TARGET_KINDS: dict[str, Factory] = {
    "jsonl": _jsonl,
    "console": _console,
    "tensorboard": _backend("tensorboard"),
    "mlflow": _backend("mlflow"),
    "wandb": _backend("wandb"),
}


def make_target(
    spec: str, spool: str | os.PathLike[str], options: TargetOptions | None = None
) -> Target:
    """Build the target a ``--to`` spec names."""
    kind, _, arg = spec.partition(":")
    factory = TARGET_KINDS.get(kind)
    if factory is None:
        raise ConfigError(
            f"unknown target {spec!r}: expected one of "
            + ", ".join(f"{k}:..." if k != "console" else k for k in TARGET_KINDS)
        )
    return factory(arg, Path(spool), options or TargetOptions())


def default_name(spec: str) -> str:
    """A stable cursor name for a target spec: its kind and a short hash of the spec."""
    kind = spec.partition(":")[0] or "target"
    if spec == kind:
        return kind
    digest = hashlib.sha1(spec.encode(), usedforsecurity=False).hexdigest()[:8]
    return f"{kind}-{digest}"
