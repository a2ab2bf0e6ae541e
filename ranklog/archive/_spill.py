"""The rows of a decoded row group that later windows of a replay need: kept, not re-read.

A metrics or timers row group spans many steps (8,192 rows: 410 steps of 20 metrics
on one rank, 82 steps of 100). When a window of steps is narrower than that (many
ranks: a window of ~400 K rows holds one step of 4,096 ranks x 100 metrics) a group
read for one window also holds rows of the next ones. Decoding it again for each of
them made a replay of many ranks cost ranks x (group span / window width) decodes;
a :class:`Rest` keeps those rows instead, already turned into the window's columns
(:data:`ROW`), so every row group is decoded once.

Rests are held in memory up to :data:`MEMORY_BYTES` in all; past that they go to
anonymous temporary files (``tempfile.TemporaryFile`` in ``$TMPDIR``: removed by the
system even if the process dies), appended to, and read back with one ``pread`` per
window and rank. A file is written up to :data:`FILE_BYTES`, then another is started;
an older file is closed (its space freed) once every rest on it is used up, and when
less than half of it is still waiting, what is (one long-lived rest keeps no more than
itself) is copied into the new file first. So disk use stays under twice the rows
waiting plus one file. About one row group per rank and table waits at once, 36 bytes
a row: ~1.2 GB at most for 4,096 ranks, ~130 MB for the 4,096 ranks x 10 steps x 100
metrics of the benchmark.

Spill file format: rests appended one after another, each its rows as packed
:data:`ROW` records (little-endian); what a rest spans (offset, rows, steps) is kept in
memory only. Nothing in a file outlives the replay that wrote it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import IO, Any, Final

import numpy as np

from ranklog.errors import ArchiveError

__all__ = ["FILE_BYTES", "MEMORY_BYTES", "ROW", "Rest", "Spill"]

#: one row of a window of metrics or timers: the columns the columnar reduce takes
ROW: Final = np.dtype([
    ("rank", "<i4"), ("ts", "<i8"), ("step", "<i8"), ("name", "<i4"), ("value", "<f8"),
    ("spec", "<i4"),
])  # fmt: skip
#: rests held in memory, in all; the next ones go to disk
MEMORY_BYTES: Final = 24 << 20
#: a spill file is not appended to past this size (a new one is started)
FILE_BYTES: Final = 64 << 20


@dataclass(slots=True, eq=False)
class Rest:
    """The rows of one lane (a rank's metrics or timers) that later windows need, in write
    order (their steps never go down)."""

    #: the rows, when in memory
    rows: Any
    #: the spill file holding them (None: in memory), and where they start in it
    file: _File | None
    offset: int
    #: the distinct steps of the rows, and the row each starts at
    steps: Any
    starts: Any
    #: rows in all, and the next row not taken yet
    count: int
    at: int = 0
    #: the next distinct step not taken yet (an index into ``steps``)
    step_at: int = 0
    #: the row group bytes (uncompressed, as its footer counts them) these rows stand for
    nbytes: float = 0.0

    @property
    def first(self) -> int:
        """The lowest step not taken yet."""
        return int(self.steps[self.step_at])

    @property
    def last(self) -> int:
        return int(self.steps[-1])

    def left_bytes(self) -> float:
        """The group bytes of the rows not taken yet."""
        return self.nbytes * (self.count - self.at) / self.count


@dataclass(slots=True, eq=False)
class _File:
    handle: IO[bytes]
    size: int = 0
    #: rests on it not used up yet
    rests: set[Rest] = field(default_factory=set)

    def waiting(self) -> int:
        """Bytes of its rests' rows not taken yet."""
        return sum((r.count - r.at) * ROW.itemsize for r in self.rests)


class Spill:
    """Where a replay's loader keeps rests: memory first, then temporary files."""

    def __init__(self, memory_bytes: int | None = None, file_bytes: int | None = None) -> None:
        self.memory_bytes = MEMORY_BYTES if memory_bytes is None else memory_bytes
        self.file_bytes = FILE_BYTES if file_bytes is None else file_bytes
        #: bytes of the rests held in memory now
        self.in_memory = 0
        #: bytes written to disk so far, in all (a replay reports it)
        self.spilled = 0
        self._file: _File | None = None
        self._files: list[_File] = []

    def keep(self, rows: Any, nbytes: float) -> Rest:
        """A rest of ``rows`` (:data:`ROW` records, steps never going down, at least one),
        which stand for ``nbytes`` of their row group."""
        step = rows["step"]
        cut = np.flatnonzero(step[1:] != step[:-1]) + 1
        starts = np.concatenate(([0], cut))
        steps = step[starts]
        count = len(rows)
        if self.in_memory + rows.nbytes <= self.memory_bytes:
            if rows.base is not None:  # a slice: copied, not to hold its whole group
                rows = rows.copy()
            self.in_memory += rows.nbytes
            return Rest(rows, None, 0, steps, starts, count, nbytes=nbytes)
        f = self._appending()
        rest = Rest(None, f, self._write(f, rows.tobytes()), steps, starts, count, nbytes=nbytes)
        f.rests.add(rest)
        return rest

    def take(self, rest: Rest, hi: int) -> Any:
        """The rows of ``rest`` for steps below ``hi`` not taken yet (None: none); a rest
        used up is let go (its memory, or its share of a file)."""
        j = int(np.searchsorted(rest.steps, hi, side="left"))
        end = int(rest.starts[j]) if j < len(rest.steps) else rest.count
        if end <= rest.at:
            return None
        a, rest.at, rest.step_at = rest.at, end, j
        if rest.file is None:
            rows = rest.rows[a:end]
            if end == rest.count:
                self.in_memory -= rest.rows.nbytes
                rest.rows = None
            return rows
        data = self._read(rest, a, end)
        if end == rest.count:
            self._used_up(rest)
        return np.frombuffer(data, ROW)

    def close(self) -> None:
        """Close every file (their space is freed)."""
        for f in self._files:
            f.handle.close()
        self._files = []
        self._file = None

    def _read(self, rest: Rest, a: int, end: int) -> bytes:
        """Rows ``a <= row < end`` of a rest on disk, as bytes."""
        assert rest.file is not None
        size = ROW.itemsize
        where = rest.offset + a * size
        data = os.pread(rest.file.handle.fileno(), (end - a) * size, where)
        if len(data) != (end - a) * size:
            raise ArchiveError(
                f"replay spill file (in {tempfile.gettempdir()}): read {len(data)} bytes "
                f"of {(end - a) * size} at offset {where}"
            )
        return data

    def _write(self, f: _File, data: bytes) -> int:
        """Append ``data`` to ``f``; where it starts."""
        offset = done = f.size
        view = memoryview(data)
        try:
            while done < offset + len(data):
                done += os.pwrite(f.handle.fileno(), view[done - offset :], done)
        except OSError as exc:
            raise ArchiveError(
                f"replay could not keep rows on disk in {tempfile.gettempdir()} ({exc}); "
                "point TMPDIR at a directory with room"
            ) from exc
        f.size = done
        self.spilled += len(data)
        return offset

    def _appending(self) -> _File:
        """The file to append to: a new one once the current is full (older files mostly
        used up are copied into it and closed)."""
        f = self._file
        if f is not None and f.size < self.file_bytes:
            return f
        # closed by _drop or close (a file outlives this call by design)
        handle = tempfile.TemporaryFile(prefix="ranklog-replay-")  # noqa: SIM115
        new = self._file = _File(handle)
        for old in list(self._files):
            if not old.rests:
                self._drop(old)
            elif 2 * old.waiting() < old.size:
                for rest in old.rests:  # its rows not taken yet, moved
                    moved = self._write(new, self._read(rest, rest.at, rest.count))
                    rest.file, rest.offset = new, moved - rest.at * ROW.itemsize
                    new.rests.add(rest)
                self._drop(old)
        self._files.append(new)
        return new

    def _used_up(self, rest: Rest) -> None:
        f = rest.file
        assert f is not None
        f.rests.discard(rest)
        if not f.rests and f is not self._file:
            self._drop(f)

    def _drop(self, f: _File) -> None:
        f.handle.close()
        self._files.remove(f)
