"""Shippers: tail a spool, reduce each step across ranks, forward it exactly once.

The pipeline, by role::

    _source.py    discovery (inotify, or polling on network filesystems) and tailing
    _tail.py      read ranks' segments, apply events: per-step contributions, watermarks
    _engine.py    the root: completeness, params, ship, commit the cursor
    _fanin.py     the same root over Ray reader actors (``ranklog ship --ray``)
    _steps.py     per-step partials (mergeable) and their reduction into a ShippedStep
    _reduce.py    mergeable partial aggregates and the reduce ops
    _cursor.py    the cursor file (tmp -> fsync -> rename)
    _target.py    the target protocol every backend adapter implements
    jsonl.py, console.py, ...   the targets

Nothing here is imported by ``import ranklog``.
"""

from ranklog.shippers._cursor import Cursor, list_cursors, load_cursor
from ranklog.shippers._engine import Shipper
from ranklog.shippers._progress import Progress
from ranklog.shippers._reduce import Partial
from ranklog.shippers._registry import TARGET_KINDS, TargetOptions, default_name, make_target
from ranklog.shippers._target import ShippedStep, Target, TextItem

__all__ = [
    "TARGET_KINDS",
    "Cursor",
    "Partial",
    "Progress",
    "ShippedStep",
    "Shipper",
    "Target",
    "TargetOptions",
    "TextItem",
    "default_name",
    "list_cursors",
    "load_cursor",
    "make_target",
]
