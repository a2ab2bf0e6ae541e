"""Replay: a compacted Parquet dataset shipped again, through the same shipper as live.

A dataset whose steps table is whole (compaction shipped the job to its end) replays
from it (:class:`~ranklog.archive._steps.StepsTails`): the engine gets its own calls
back and decides nothing again. Any other (an older release's, one compacted while
the job ran, ``--per-rank``, ``--steps``, ``--names``, ``--relogged last``) is read event
by event: the rows are turned back into each rank's events, frame by frame, in the
order they were written (rank, incarnation, segment, seq, idx), and handed to the
same engine through :class:`ParquetSource`, a stand-in for the spool directory: same
events, same order, same rules. Every rank is treated as ended: an incarnation that
never wrote ``rank_end`` gets one (status ``unknown``), so nothing waits for a rank that
will never write again. What the raw rows cannot say, they do not: a frame that held
no value left no row (its rank's next steps are marked partial where live shipping
found them whole), and timestamps are rounded to the microsecond. The steps table
holds what live shipping shipped, to the bit.

After a requeue, steps a rank logged twice (between its last checkpoint and the kill)
replay by default as live shipping shipped them: the first closed values
(``--relogged first``). ``--relogged last`` rebuilds the branch training actually
continued from: the later incarnation's values for those steps.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ranklog.archive._files import GroupCache, Piece, RowGroups, Shared, read_rows, source_rows
from ranklog.archive._manifest import (
    Manifest,
    StepsMark,
    load_manifest,
    require_manifest,
    save_manifest,
)
from ranklog.archive._parts import check_files, pieces_of
from ranklog.archive._rows import COLUMNS, frame_events
from ranklog.archive._steps import STEPS_DIR, StepsTails, whole_table
from ranklog.archive._tables import STEP_TABLES, TABLES
from ranklog.errors import ConfigError, SpoolFormatError
from ranklog.schemas import SCHEMA_VERSION, RankEnd
from ranklog.shippers import Shipper, Target
from ranklog.shippers._retry import ONCE_RETRY_FOR
from ranklog.shippers._source import SegState
from ranklog.shippers._steps_table import step_files
from ranklog.spool import (
    HEADER_SIZE,
    Frame,
    ReadResult,
    RunInfo,
    SegmentHeader,
    SegmentId,
    SegmentName,
)
from ranklog.spool._layout import write_run

__all__ = ["ParquetSource", "replay", "write_steps"]

log = logging.getLogger("ranklog.replay")

#: rows turned into events per read: the engine reads in bounded slices, as from files
_ROWS_PER_READ: Final = 8_192  # about what 256 KiB of a segment holds
#: decoded row groups kept for every segment of a replay together
_CACHE_BYTES: Final = 32 * 1024 * 1024
#: decoded row groups of part files (layout 2) kept, split by segment
_SHARED_BYTES: Final = 96 * 1024 * 1024
#: parsed footers the event path keeps (it reads each segment's files through once)
_EVENT_FOOTERS: Final = 256


def _segment_files(dataset: Path, manifest: Manifest) -> dict[SegmentId, dict[str, list[Piece]]]:
    """Each source segment -> table -> where its rows are, in write order: its pieces of
    part files (layout 2), or its Parquet files (layout 1: names start with the
    segment's stem).

    Only files the manifest lists: a file a crashed compaction wrote but never listed is
    not part of the dataset (the next compaction removes it and writes its range again).
    """
    if manifest.layout >= 2:
        pieces: dict[SegmentId, dict[str, list[Piece]]] = {}
        for key, entry in manifest.segments.items():
            if entry.pieces:
                sid = SegmentId.parse(key)
                pieces[sid] = pieces_of(dataset, sid, entry)
        return dict(sorted(pieces.items()))
    listed = {f for entry in manifest.segments.values() for f in entry.files}
    out: dict[SegmentId, dict[str, list[Piece]]] = defaultdict(lambda: defaultdict(list))
    for name in TABLES:
        for path in sorted((dataset / name).glob("*.parquet")):
            if f"{name}/{path.name}" not in listed:
                continue
            try:
                seg = SegmentId.parse(path.name)
            except SpoolFormatError:
                continue  # not a file compaction wrote
            out[seg][name].append(Piece.whole(path, seg))
    return {sid: dict(tables) for sid, tables in sorted(out.items())}


class _ParquetReader:
    """Stands in for a SegmentReader: one original segment, rebuilt from its Parquet files.

    Offsets count frames (``HEADER_SIZE + i`` is the start of frame ``i``). Each read
    takes the next window of frames (about :data:`_ROWS_PER_READ` rows) from the row
    groups that hold them and turns it into events, so memory holds one window of Python
    objects per segment and the shared cache of decoded row groups, not the run.
    """

    def __init__(
        self,
        files: dict[str, list[Piece]],
        header: SegmentHeader,
        *,
        last: bool,
        steps: tuple[int | None, int | None] | None,
        names: str | None,
        cutoff: int | None = None,
        seal_seq: int | None = None,
        cache: GroupCache | None = None,
        shared: Shared | None = None,
    ) -> None:
        self.header: SegmentHeader | None = header
        #: the source segment's seal frame's sequence number, when it had one
        self._seal_seq = seal_seq
        self._files, self._last, self._steps, self._names = files, last, steps, names
        self._cutoff = cutoff
        self._loaded = False
        self._tables: dict[str, tuple[pa.Table | None, Any]] | None = None
        self._groups: dict[str, RowGroups] = {}
        self._cache = cache if cache is not None else GroupCache(_CACHE_BYTES)
        self._shared = shared if shared is not None else Shared(_CACHE_BYTES)
        #: each frame's seq, and the rows (all tables) up to and with it: 16 bytes a frame
        self._seqs: Any = np.zeros(0, np.int64)
        self._cum: Any = np.zeros(0, np.int64)
        self._end_frame = False  # a synthetic rank_end frame closes the rank
        self.size = HEADER_SIZE

    def resume_from(self, names: Sequence[int], offset: int) -> None:
        """(A dataset holds no names frames: nothing to find.)"""

    def names_before(self, offset: int) -> list[int]:
        """(A dataset holds no names frames.)"""
        return []

    def load(self) -> None:
        """Count the segment's frames from its ``seq`` columns alone (once)."""
        if self._loaded:
            return
        self._loaded = True
        seqs: list[Any] = []
        ended = False
        for name, files in self._files.items():
            for src in files:
                t = source_rows(src, name, ["seq", "kind"] if name == "ranks" else ["seq"],
                                self._shared)  # fmt: skip
                seqs.append(t["seq"].to_numpy())
                if name == "ranks":
                    ended = ended or bool(pc.any(pc.equal(t["kind"], "rank_end")).as_py())
            most = 4 * _ROWS_PER_READ  # larger groups (older datasets): read whole
            groups = RowGroups.of(files, name, COLUMNS[name], self._cache, most)
            if groups is not None:  # as compaction writes: read by row group
                self._groups[name] = groups
        if seqs:
            uniq, counts = np.unique(np.concatenate(seqs), return_counts=True)
            self._seqs, self._cum = uniq.astype(np.int64), np.cumsum(counts, dtype=np.int64)
        self._end_frame = self._last and not ended
        self.size = HEADER_SIZE + len(self._seqs) + self._end_frame

    def _window(self, lo: int, hi: int) -> dict[str, pa.Table | None]:
        """The segment's rows of frames ``lo..hi``: by row group, or from the whole table."""
        out: dict[str, pa.Table | None] = {}
        for name, files in self._files.items():
            groups = self._groups.get(name)
            if groups is not None:
                out[name] = groups.rows(lo, hi)
                continue
            if self._tables is None:
                self._tables = {}
            if name not in self._tables:  # files out of order: read whole, sorted
                t = read_rows(files, name, COLUMNS[name], self._shared)
                self._tables[name] = (t, None if t is None else t["seq"].to_numpy())
            t, seqs = self._tables[name]
            if t is None or seqs is None:
                out[name] = None
                continue
            a, b = np.searchsorted(seqs, [lo, hi + 1]).tolist()
            out[name] = None if a == b else t.slice(a, b - a)
        return out

    def _stop(self, start: int) -> int:
        """Where the read of frames from index ``start`` ends (exclusive).

        At the end of the metrics row group that holds frame ``start`` (each group is then
        decoded once), but never past 4 x :data:`_ROWS_PER_READ` rows of all tables (sparse
        metrics among many other rows); without metrics row groups, after about
        :data:`_ROWS_PER_READ` rows.
        """
        n = len(self._seqs)
        if start >= n:
            return start
        base = int(self._cum[start - 1]) if start else 0  # rows before frame `start`

        def after(rows: int) -> int:  # the stop once `rows` rows are read
            return int(np.searchsorted(self._cum, base + rows, side="left")) + 1

        groups = self._groups.get("metrics")
        hi = groups.end_of_group(int(self._seqs[start])) if groups is not None else None
        if hi is None:
            stop = after(_ROWS_PER_READ)
        else:
            stop = min(int(np.searchsorted(self._seqs, hi, side="right")),
                       after(4 * _ROWS_PER_READ))  # fmt: skip
        return max(min(stop, n), start + 1)

    def read(
        self, offset: int = 0, *, writer_gone: bool = False, max_bytes: int | None = None
    ) -> ReadResult:
        self.load()
        assert self.header is not None
        start = max(offset, HEADER_SIZE) - HEADER_SIZE
        stop = self._stop(start)
        window: list[int] = self._seqs[start:stop].tolist()
        frames: list[Frame] = []
        if window:
            h = self.header
            part = self._window(window[0], window[-1])
            by_seq = frame_events(
                part, h.rank, h.run_id, steps=self._steps, names=self._names, cutoff=self._cutoff
            )
            for i, seq in enumerate(window):
                pos = HEADER_SIZE + start + i
                frames.append(Frame(pos, pos + 1, seq, SCHEMA_VERSION, by_seq.get(seq, [])))
        end = HEADER_SIZE + start + len(frames)
        if self._end_frame and end == self.size - 1:
            last_ts = frames[-1].events[-1].ts if frames and frames[-1].events else 0.0
            frames.append(Frame(end, end + 1, -1, SCHEMA_VERSION,
                                [RankEnd(last_ts, "unknown", None)]))  # fmt: skip
            end += 1
        res = ReadResult(frames=frames, end=end, size=self.size)
        if end < self.size:
            res.more, res.pending = True, self.size - end
        else:
            res.seal, res.seal_seq = {"reason": "replay"}, self._seal_seq
            self._tables, self._groups = None, {}  # read to the end: let it all go
        return res


def _cutoffs(dataset: Path, listed: set[str]) -> dict[tuple[int, int], int]:
    """(rank, incarnation) -> the step a later incarnation of the rank resumed from.

    That incarnation's values from there on are what training actually continued from;
    the earlier incarnation's values for those steps are left out (``--relogged last``).
    """
    starts: dict[tuple[int, int], int] = {}
    for name in STEP_TABLES:
        files = sorted(f for f in (dataset / name).glob("*.parquet")
                       if f"{name}/{f.name}" in listed)  # fmt: skip
        if not files:
            continue
        t = pa.concat_tables(pq.read_table(f, columns=["rank", "incarnation", "step"])
                             for f in files)  # fmt: skip
        for row in t.group_by(["rank", "incarnation"]).aggregate([("step", "min")]).to_pylist():
            key = (row["rank"], row["incarnation"])
            starts[key] = min(starts.get(key, row["step_min"]), row["step_min"])
    out: dict[tuple[int, int], int] = {}
    for (rank, inc), _ in starts.items():
        later = [s for (r, i), s in starts.items() if r == rank and i > inc]
        if later:
            out[(rank, inc)] = min(later)
    return out


class ParquetSource:
    """Stands in for a spool directory: every rank's segments, from a compacted dataset."""

    polling = True
    network = False

    def __init__(
        self,
        dataset: str | os.PathLike[str],
        run: RunInfo,
        *,
        steps: tuple[int | None, int | None] | None = None,
        names: str | None = None,
        relogged: str = "first",
    ) -> None:
        if relogged not in ("first", "last"):
            raise ConfigError(f"relogged must be 'first' or 'last', got {relogged!r}")
        self.dataset = Path(dataset)
        self.segments: dict[str, SegState] = {}
        self.by_rank: dict[int, list[SegState]] = {}
        self._new: list[SegState] = []
        #: a replay of some names only lacks events that step_end counts: no counts check
        self.verify_counts = names is None
        self.step_range = steps
        manifest = load_manifest(self.dataset)
        listed = {f for entry in manifest.segments.values() for f in entry.files}
        files = _segment_files(self.dataset, manifest)
        last_of_rank = {k.rank: k for k in files}  # sorted: the last key of each rank wins
        cutoffs = _cutoffs(self.dataset, listed) if relogged == "last" else {}
        # footers of the last files read only: the engine reads each segment through once
        cache = GroupCache(_CACHE_BYTES, footers=_EVENT_FOOTERS, latest=True)
        shared = Shared(_SHARED_BYTES)  # layout 2: the groups a block's segments share
        for sid, tables in files.items():
            rank, inc, seg = sid
            header = SegmentHeader(rank, inc, seg, run.created, run.run_id, run.world_size)
            entry = manifest.segments.get(sid.stem)
            sealed = entry is not None and entry.sealed and entry.next_seq > 0
            reader = _ParquetReader(
                dict(tables), header, last=last_of_rank[rank] == sid,
                steps=steps, names=names, cutoff=cutoffs.get((rank, inc)),
                seal_seq=entry.next_seq - 1 if sealed and entry is not None else None,
                cache=cache, shared=shared,
            )  # fmt: skip
            path = self.dataset / sid.stem
            state = SegState(SegmentName(rank, inc, seg, path), sid.key, reader)
            self.segments[state.key] = state
            self.by_rank.setdefault(rank, []).append(state)
            self._new.append(state)

    @property
    def mode(self) -> str:
        return f"replay of {self.dataset}"

    def discover(self) -> list[SegState]:
        new, self._new = self._new, []
        return new

    def probe(self, seg: SegState) -> bool:
        reader = seg.reader
        assert isinstance(reader, _ParquetReader)
        reader.load()
        seg.size = reader.size
        seg.mtime = 0.0  # long silent: every rank is released once read to the end
        return bool(seg.size > seg.offset)

    def wait(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        return None


def replay(
    dataset: str | os.PathLike[str],
    target: Target,
    *,
    steps: tuple[int | None, int | None] | None = None,
    names: str | None = None,
    per_rank: bool = False,
    relogged: str = "first",
    late: str = "count",
    below_last: str = "refuse",
    retry_for: float | None = None,
) -> int:
    """Ship a dataset into ``target`` (a Target object) as live shipping would have.

    ``relogged="last"`` rebuilds instead the branch training continued from after a
    restart: for steps a rank logged again, the later incarnation's values count.
    ``late="ship"`` ships late and re-logged values as ``ranklog ship --late ship`` does.
    Steps the target already holds are not written again (a replay after a windowed one
    writes the rest); ``below_last="skip"`` leaves out steps a target cannot write below
    its last one (W&B) instead of refusing. Transient target failures are retried for
    ``retry_for`` seconds (default 120). ``names`` must be the selection the target was
    built with (``make_target(..., names=)``): it records which names its steps hold.
    """
    dataset = Path(dataset)
    built = getattr(target, "names", None)
    if names is not None and built is not None and built != names:
        raise ConfigError(
            f"replay with names={names!r} into a target built with names={built!r}: build "
            "it with the same selection (make_target(..., names=...))"
        )
    manifest = require_manifest(dataset)
    check_files(dataset, manifest)
    run = RunInfo(manifest.run_id, manifest.created, manifest.name, manifest.world_size)
    tails: Any = None
    if steps is None and names is None and not per_rank and relogged == "first":
        whole = whole_table(dataset, run, manifest)
        if whole is not None:
            tails = StepsTails(whole[0], whole[1], run, late=late)
    source = None
    if tails is None:
        source = ParquetSource(dataset, run, steps=steps, names=names, relogged=relogged)
    retry = ONCE_RETRY_FOR if retry_for is None else retry_for
    code, _ = _engine_once(run, target, name="replay", per_rank=per_rank, source=source,
                           tails=tails, late=late, below_last=below_last,
                           retry_for=retry)  # fmt: skip
    return code


def _engine_once(run: RunInfo, target: Target, **kw: Any) -> tuple[int, Shipper]:
    """The engine run once into ``target`` over a dataset's source or tails (``kw``: the
    Shipper's): its spool a scratch directory for run.json and the lease, its cursor kept
    in memory (the target's steps say where it stands)."""
    scratch = Path(tempfile.mkdtemp(prefix="ranklog-replay-"))
    try:
        write_run(scratch, run)
        try:
            shipper = Shipper(str(scratch), target, start_grace=0, keep_cursor=False, **kw)
        except BaseException:
            if kw.get("tails") is not None:
                kw["tails"].close()
            raise
        return shipper.run_forever(once=True), shipper
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_steps(dataset: str | os.PathLike[str]) -> tuple[int, int] | None:
    """Add the steps table to a dataset that has none, or not a whole one (an older
    release's, or one compacted while the job ran and whose spool is gone): the engine
    over the raw rows ships into ``DS/steps`` (the steps it holds already are kept).
    (steps written, the last step), or None when the table was whole already.

    One at a time per dataset, as compaction (:class:`~ranklog.archive._lock.DatasetLock`).
    """
    from ranklog.archive._lock import DatasetLock
    from ranklog.shippers import make_target

    dataset = Path(dataset)
    manifest = require_manifest(dataset)
    run = RunInfo(manifest.run_id, manifest.created, manifest.name, manifest.world_size)
    with DatasetLock(dataset):
        manifest = require_manifest(dataset)  # (as it is, now that it is locked)
        check_files(dataset, manifest)
        if whole_table(dataset, run, manifest) is not None:
            return None
        if (dataset / STEPS_DIR).is_dir():  # not whole: written again, from the raw rows
            shutil.rmtree(dataset / STEPS_DIR)
        target = make_target(f"parquet:{dataset / STEPS_DIR}", dataset)
        _, shipper = _engine_once(run, target, name="steps", source=ParquetSource(dataset, run),
                                  late="ship", retry_for=ONCE_RETRY_FOR)  # fmt: skip
        # every raw row went through the engine: the table covers every segment as compacted
        files = len(step_files(dataset / STEPS_DIR)[0])
        covered = {k: e.offset for k, e in manifest.segments.items()}
        manifest.steps = StepsMark(files, covered, source="rows")
        save_manifest(dataset, manifest)
        return shipper.stats.steps_shipped, shipper.shipped_upto
