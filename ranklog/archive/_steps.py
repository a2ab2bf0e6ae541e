"""Replay from a dataset's ``steps`` table: the engine's own calls, handed to it again.

``ranklog compact`` ships the spool into ``DS/steps/`` with the ``parquet:`` target, so the
table holds every step as the engine shipped it (late values with their carrier), every
params call with the step it went before, and the job's end. :class:`StepsTails` gives
those to the engine (:class:`~ranklog.shippers.Shipper`) as a reading half whose steps
are finished: the engine still decides what a target holds, where params go, what
``--below-last`` and ``--late`` leave out, and how the target ends; it reduces nothing.
So replay from the table ships what live shipping shipped, by construction.

The table is used only when it is whole: its last call is the job's end (a dataset
compacted while the job ran has its later steps in the raw tables only: replay reads
those through the engine, :class:`~ranklog.archive._replay.ParquetSource`). ``--per-rank``
and ``--relogged last`` need the raw rows too.

How it could break (tests/test_steps_table.py): a file missing or damaged (refused, naming
it); a table of another run (refused); params whose step is in a later file (due before
that file's first step: the step after this file's last); a carrier with nothing of its own
(its late values ship after it, as live); a replay that fails half way and starts again
(the target says what it holds; nothing twice).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from ranklog.archive._manifest import Manifest, StepsMark
from ranklog.errors import ArchiveError, RanklogError
from ranklog.shippers._cursor import Cursor
from ranklog.shippers._ranks import ParamsRead, RankView, StepGap, TailCommit, TailPoll
from ranklog.shippers._steps_table import STEPS_VERSION, read_calls, step_files
from ranklog.shippers._target import ShippedStep
from ranklog.spool import RunInfo

__all__ = ["COMPACT_PREFIX", "STEPS_DIR", "StepsTails", "mark_steps", "ship_steps", "whole_table"]

log = logging.getLogger("ranklog.replay")

#: the table's directory in a dataset
STEPS_DIR: Final = "steps"
#: a rank's end status that gives each job status back (job_status)
_RANK_STATUS: Final = {"finished": "ok", "failed": "error", "killed": "signal"}


def _files(dataset: Path) -> list[Path]:
    """The table's files in order; another file there refuses the table."""
    try:
        files, others = step_files(dataset / STEPS_DIR)
    except OSError as exc:
        raise ArchiveError(f"{dataset / STEPS_DIR}: cannot list it ({exc})") from exc
    if others:
        raise ArchiveError(f"{dataset / STEPS_DIR} holds {others[0]!r}, which is not a "
                           "ranklog steps file: move it away")  # fmt: skip
    return files


def whole_table(dataset: Path, run: RunInfo, manifest: Manifest) -> tuple[list[Path], str] | None:
    """(files, the job's end status) when ``dataset`` has a steps table of ``run`` that
    covers every frame its raw tables hold (the manifest says so) and ends with the job's
    end; None otherwise, the reason logged. A file of another run or damaged is refused
    (:class:`ArchiveError`, naming it)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    files = _files(dataset)
    if not files:
        return None
    f = files[-1]
    try:
        for f in files:
            meta = pq.read_schema(f).metadata or {}
            if meta.get(b"ranklog.steps") != STEPS_VERSION.encode():
                log.info("replay of %s through the engine: %s is a steps table of another "
                         "version", dataset, f)  # fmt: skip
                return None
            if meta.get(b"ranklog.run_id", b"").decode(errors="replace") != run.run_id:
                raise ArchiveError(f"{f} holds another run's steps than {dataset}'s "
                                   f"({run.run_id}): move {dataset / STEPS_DIR} away")  # fmt: skip
        if not manifest.steps_cover(len(files)):
            log.info("replay of %s through the engine: its steps table does not cover every "
                     "frame the raw tables hold (compacted while the job ran, or a compaction "
                     "stopped before its steps)", dataset)  # fmt: skip
            return None
        table = pq.read_table(files[-1], columns=["kind", "name"])
        last = table.slice(max(table.num_rows - 1, 0))
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"{f} is damaged ({exc}): run `ranklog compact --steps "
                           f"{dataset}` to write the steps table again") from exc  # fmt: skip
    kinds = pc.cast(last.column("kind"), pa.string()).to_pylist()
    if kinds != ["end"]:
        log.info("replay of %s through the engine: its steps table ends before the job did "
                 "(compacted while it ran)", dataset)  # fmt: skip
        return None
    return files, str(last.column("name")[0].as_py())


#: the cursor names of compaction's steps shippers start so: the epilogue (``ranklog ship
#: SPOOL`` without ``--to``) leaves them to ``ranklog compact``
COMPACT_PREFIX: Final = "compact-"


def ship_steps(spool: Path, dataset: Path, *, dead_after: float = 120.0) -> tuple[int, int] | None:
    """Ship ``spool`` into ``dataset``'s steps table with the engine, as a shipper would
    (its own cursor and lease; what is not complete yet ships at a later compaction):
    (steps shipped in all, the last step shipped). None when the spool cannot be written
    (a read-only copy): a shipper keeps its cursor there, so the table is left as it is
    (replay reads the raw rows; ``ranklog compact --steps`` writes it from them)."""
    import os

    from ranklog.errors import CursorError
    from ranklog.shippers import Shipper, make_target
    from ranklog.shippers._retry import ONCE_RETRY_FOR

    cursors = spool / "cursors"
    if not os.access(cursors if cursors.is_dir() else spool, os.W_OK):
        return None

    target = make_target(f"parquet:{dataset / STEPS_DIR}", spool)
    name = _cursor_name(spool, target)
    if not _files(dataset):  # a new dataset (or its table removed): this spool's cursor
        _forget_cursor(spool, name)  # for that path is of a table that is gone
    shipper = Shipper(str(spool), target, name=name, late="ship", retry_for=ONCE_RETRY_FOR,
                      dead_after=dead_after, start_grace=min(60.0, dead_after))  # fmt: skip
    try:
        shipper.run_forever(once=True)
    except CursorError as exc:  # segments --delete removed: the dataset's rows hold them
        raise CursorError(
            f"{dataset / STEPS_DIR}: the spool no longer holds every segment "
            f"(compact --delete removed some): write the steps table from the "
            f"dataset with `ranklog compact --steps {dataset}` ({exc})"
        ) from exc
    return shipper.stats.steps_shipped, shipper.shipped_upto


def mark_steps(spool: Path, dataset: Path, manifest: Manifest) -> None:
    """Record in ``manifest`` how far the steps table covers the spool's segments: what its
    shipper's cursor consumed (with what an earlier compaction recorded: segments only
    grow), and how many files the table holds. The caller saves the manifest."""
    from ranklog.shippers import load_cursor, make_target
    from ranklog.spool import SegmentId

    target = make_target(f"parquet:{dataset / STEPS_DIR}", spool)
    cursor = load_cursor(spool, _cursor_name(spool, target))
    old = manifest.steps.covered if manifest.steps is not None else {}
    covered = dict(old)
    for key, seg in (cursor.segments if cursor is not None else {}).items():
        stem = SegmentId.parse(key).stem
        covered[stem] = max(covered.get(stem, 0), seg.offset)
    manifest.steps = StepsMark(len(_files(dataset)), covered)


def _cursor_name(spool: Path, target: Any) -> str:
    from ranklog.shippers import default_name, target_identity
    from ranklog.spool import read_run

    return COMPACT_PREFIX + default_name(target_identity(target, read_run(spool)))


def _forget_cursor(spool: Path, name: str) -> None:
    """Remove compaction's cursor ``name`` from ``spool``, if any."""
    from ranklog.shippers._cursor import cursor_path

    path = cursor_path(spool, name)
    if path.exists():
        log.info("%s has no steps table: %s (of a table that is gone) removed, the steps "
                 "are written again", path.parent.parent, path.name)  # fmt: skip
        path.unlink()


class _Done:
    """A step as the table holds it, in the shape the engine's partials have."""

    __slots__ = ("late", "own", "ranks")

    def __init__(self, own: ShippedStep | None) -> None:
        self.own = own
        self.ranks = 0 if own is None else own.ranks
        self.late: list[ShippedStep] = []

    damaged: tuple[int, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()

    def only_gpu(self) -> bool:
        return self.own is None

    def finish(self, *, closed: int, world_size: int) -> ShippedStep:
        assert self.own is not None
        return self.own

    def shipped_late(self, world_size: int) -> list[ShippedStep]:
        return self.late


class StepsTails:
    """The engine's reading half over a whole steps table (see the module)."""

    def __init__(self, files: list[Path], end: str, run: RunInfo, *, late: str) -> None:
        self._files = files
        self._calls = self._read_calls()
        self._status = _RANK_STATUS.get(end, "ok")
        self._late = late == "ship"
        self._world = run.world_size or 1
        self._built: dict[int, _Done] = {}
        self._last = -1  # the last step read so far
        self._where = str(files[0].parent) if files else ""
        self._done = False
        self._params_read = 0  # params calls read: each one's place, read once

    @property
    def mode(self) -> str:
        return "steps table"

    def open(self, run: RunInfo, cursor: Cursor | None) -> None:
        return None

    def _read_calls(self) -> Iterator[tuple[object, ...]]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for f in self._files:
            try:
                table = pq.read_table(f)
            except (OSError, pa.ArrowException) as exc:
                raise ArchiveError(f"{f} is damaged ({exc}): run `ranklog compact --steps "
                                   f"{f.parent.parent}` to write it again") from exc  # fmt: skip
            try:
                yield from read_calls(table, where=str(f))
            except RanklogError as exc:
                raise ArchiveError(str(exc)) from None
            yield ("file",)

    def poll(self, shipped_upto: int, gap: StepGap, floor: int | None) -> TailPoll:
        """The next file's steps once the last ones are shipped; params as they come."""
        self._drop(shipped_upto)
        params: list[ParamsRead] = []
        progressed = False
        while not self._built and not self._done:
            progressed = True
            for call in self._calls:
                kind = call[0]
                if kind == "file":
                    break
                if kind == "steps":
                    self._take(call[1])  # type: ignore[arg-type]
                elif kind == "params":
                    before = call[2] if call[2] is not None else self._last + 1
                    self._params_read += 1
                    where = f"steps@{self._params_read}"
                    params.append(ParamsRead(before, 0, call[1], True, where))  # type: ignore[arg-type]
            else:
                self._done = True
        views = [RankView(r, self._last, self._done, self._done, 0.0, self._world,
                          self._status if self._done else None)
                 for r in range(self._world)]  # fmt: skip
        return TailPoll(progressed, views, sorted(self._built), params, 0)

    def _take(self, steps: list[ShippedStep]) -> None:
        for s in steps:
            if s.carrier is None:
                if s.step <= self._last:  # written in increasing order: else not ours
                    raise ArchiveError(f"{self._where}: step {s.step} after step {self._last}: "
                                       "a steps table holds each step once, in order; run "
                                       f"`ranklog compact --steps` on the dataset")  # fmt: skip
                self._built[s.step] = _Done(s)
                self._last = s.step
            elif self._late:
                done = self._built.get(s.carrier)
                if done is None:  # a carrier with nothing of its own
                    done = self._built[s.carrier] = _Done(None)
                    self._last = max(self._last, s.carrier)
                done.late.append(s)

    def partials(self, steps: list[int], *, per_rank: bool) -> list[_Done | None]:
        return [self._built.get(s) for s in steps]

    def commit(self, shipped_upto: int, gap: StepGap, *, params_pending: bool) -> TailCommit:
        self._drop(shipped_upto)
        return TailCommit({}, {})

    def _drop(self, shipped_upto: int) -> None:
        if self._built and min(self._built) <= shipped_upto:
            for step in [s for s in self._built if s <= shipped_upto]:
                del self._built[step]

    def wait(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        self._built = {}
