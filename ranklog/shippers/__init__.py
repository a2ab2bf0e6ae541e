"""Shippers: tail a spool, reduce each step across ranks, forward it exactly once.

The engine, by role::

    _source.py    discovery (inotify, or polling on network filesystems) and tailing
    _tail.py      read ranks' segments, apply events: per-step contributions, watermarks
    _lost.py      lost frames: the steps they may have held marked partial, and cleared
    _ranks.py     what a tail knows and tells of its ranks (views, a round's findings)
    _engine.py    the root: completeness, params, ship, commit the cursor
    _params.py    hyperparameters: which are new, and before which step each is written
    _waited.py    completeness: what a round's rank views say may ship, found once
    _fanin.py     the same root over Ray reader actors (``ranklog ship --ray``)
    _steps.py     per-step partials (mergeable), built from what ranks logged
    _finish.py    a step's partial reduced into the ShippedStep a target receives
    _reduce.py    mergeable partial aggregates and the reduce ops
    _cursor.py    the cursor file (tmp -> fsync -> rename)
    _lease.py     one shipper per target: the lease file
    _held.py      what a target holds: a set of steps, the run and names it records
    _retry.py     which failures are retried, for how long, and how they are named
    _progress.py  the status line
    _target.py    the protocol every target implements, and what it receives
    _registry.py  targets' declarations (TargetKind, Option), found and built from specs
    targets/      the targets, one module each

Nothing here is imported by ``import ranklog``; the engine never imports a target
module by name (the registry finds them).
"""

from ranklog.shippers._cursor import Cursor, list_cursors, load_cursor
from ranklog.shippers._engine import Shipper
from ranklog.shippers._held import Holding, StepSet
from ranklog.shippers._progress import Progress
from ranklog.shippers._reduce import Partial
from ranklog.shippers._registry import (
    Option,
    TargetContext,
    TargetKind,
    all_options,
    default_name,
    make_target,
    target_kinds,
)
from ranklog.shippers._target import (
    GpuStat,
    ImageItem,
    ShippedStep,
    TableItem,
    Target,
    TextItem,
    target_identity,
)

__all__ = [
    "Cursor",
    "GpuStat",
    "Holding",
    "ImageItem",
    "Option",
    "Partial",
    "Progress",
    "ShippedStep",
    "Shipper",
    "StepSet",
    "TableItem",
    "Target",
    "TargetContext",
    "TargetKind",
    "TextItem",
    "all_options",
    "default_name",
    "list_cursors",
    "load_cursor",
    "make_target",
    "target_identity",
    "target_kinds",
]
