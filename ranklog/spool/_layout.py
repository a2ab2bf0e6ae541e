"""Where things live in a spool directory, and the run identity in ``run.json``.

::

    SPOOL/
      run.json                                     run_id, created, name (created once)
      ranks/<rank:05d>/<incarnation:04d>-<segment:06d>.rlog
      cursors/<shipper-name>.json
      deleted.json                                 segments ``compact --delete`` removed,
                                                   and the dataset that holds each
      claims/<rank:05d>.<host>                     the lock a live rank of that host holds

Listing never follows symbolic links: a link in the spool is reported, not read.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from ranklog._fs import DIR_MODE, FILE_MODE, create_once
from ranklog.errors import ConfigError, SpoolFormatError
from ranklog.spool._segid import SegmentId

__all__ = [
    "MAX_INCARNATION",
    "DeletedSegment",
    "RunInfo",
    "SegmentName",
    "SpoolLayout",
    "default_run_name",
    "deleted_incarnation",
    "deleted_segments",
    "ensure_run",
    "read_run",
    "record_deleted",
    "require_run",
    "write_run",
]

_SEGMENT_RE: Final = re.compile(r"^(\d{4,})-(\d{6,})\.rlog$")
_RANK_RE: Final = re.compile(r"^\d{5,}$")


@dataclass(frozen=True, slots=True, order=True)
class SegmentName:
    """A segment's place, parsed from its file name: sorts in write order."""

    rank: int
    incarnation: int
    segment: int
    path: Path

    @property
    def id(self) -> SegmentId:
        """The segment's identity (rank, incarnation, segment)."""
        return SegmentId(self.rank, self.incarnation, self.segment)


@dataclass(frozen=True, slots=True)
class RunInfo:
    """The identity every rank of a run agrees on, stored in ``run.json``."""

    run_id: str
    created: float
    name: str
    world_size: int | None = None
    format: int = 1

    def to_json(self) -> bytes:
        """The file contents of ``run.json``."""
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode() + b"\n"


class SpoolLayout:
    """Paths inside one spool directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.run_json = self.root / "run.json"
        self.ranks_dir = self.root / "ranks"
        self.cursors_dir = self.root / "cursors"
        self.deleted_json = self.root / "deleted.json"

    def __repr__(self) -> str:
        return f"SpoolLayout({str(self.root)!r})"

    def rank_dir(self, rank: int) -> Path:
        """Directory holding every segment of ``rank``."""
        return self.ranks_dir / f"{rank:05d}"

    def segment_path(self, rank: int, incarnation: int, segment: int) -> Path:
        """Path of one segment file."""
        return self.rank_dir(rank) / SegmentId(rank, incarnation, segment).filename

    def ranks(self) -> list[int]:
        """Ranks that have a directory, in order; links and stray names are ignored."""
        out: list[int] = []
        try:
            with os.scandir(self.ranks_dir) as it:
                for entry in it:
                    if _RANK_RE.match(entry.name) and entry.is_dir(follow_symlinks=False):
                        out.append(int(entry.name))
        except FileNotFoundError:
            return []
        return sorted(out)

    def segments(self, rank: int) -> list[SegmentName]:
        """Segments of ``rank`` in write order (incarnation, then segment number)."""
        return sorted(self._scan(rank)[0])

    def strays(self, rank: int) -> list[Path]:
        """Entries of a rank directory that are not segment files (links included)."""
        return self._scan(rank)[1]

    def _scan(self, rank: int) -> tuple[list[SegmentName], list[Path]]:
        segs: list[SegmentName] = []
        strays: list[Path] = []
        try:
            with os.scandir(self.rank_dir(rank)) as it:
                for entry in it:
                    m = _SEGMENT_RE.match(entry.name)
                    if m and entry.is_file(follow_symlinks=False):
                        segs.append(
                            SegmentName(rank, int(m.group(1)), int(m.group(2)), Path(entry.path))
                        )
                    elif not entry.name.startswith("."):
                        strays.append(Path(entry.path))
        except FileNotFoundError:
            pass
        return segs, strays

    def all_segments(self) -> list[SegmentName]:
        """Every segment of every rank, in (rank, incarnation, segment) order."""
        return [s for r in self.ranks() for s in self.segments(r)]


def read_run(root: str | os.PathLike[str]) -> RunInfo:
    """Read ``run.json``; raises :class:`SpoolFormatError` naming the file if damaged."""
    path = SpoolLayout(root).run_json
    try:
        raw = json.loads(path.read_bytes())
        return RunInfo(
            run_id=str(raw["run_id"]),
            created=float(raw["created"]),
            name=str(raw.get("name", "")),
            world_size=None if raw.get("world_size") is None else int(raw["world_size"]),
            format=int(raw.get("format", 1)),
        )
    except FileNotFoundError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise SpoolFormatError(f"{path}: not a valid run.json ({exc})") from exc


def require_run(root: str | os.PathLike[str]) -> RunInfo:
    """The run of an existing spool, for commands that read one.

    :class:`ConfigError` when ``root`` is not a directory, :class:`SpoolFormatError`
    when it holds no valid ``run.json`` (it is not a spool).
    """
    path = Path(root)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such spool directory")
    try:
        return read_run(path)
    except FileNotFoundError:
        raise SpoolFormatError(f"{path} is not a spool (no run.json)") from None


def write_run(root: str | os.PathLike[str], info: RunInfo) -> None:
    """Create ``run.json`` with the given identity (a replay's scratch spool); once only."""
    layout = SpoolLayout(root)
    layout.ranks_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    fd = os.open(layout.run_json, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        os.write(fd, info.to_json())
        os.fsync(fd)
    finally:
        os.close(fd)


#: spool folder names that say nothing of the run: it is named after the folder above
_GENERIC_NAMES: Final = frozenset(
    {"spool", "ranklog", "ranklog-spool", ".ranklog-spool", "logs", "log", "output", "outputs"}
)
#: SLURM job names that are no name (an interactive shell's)
_NO_JOB_NAMES: Final = frozenset({"bash", "sh", "zsh", "interactive", "sys/dashboard"})


def default_run_name(root: str | os.PathLike[str]) -> str:
    """A run's name when ``init`` is given none: the launcher's name for the job
    (``SLURM_JOB_NAME``; the script torchrun runs), else the spool's folder, or the one
    above it when the spool's own says nothing (``/nfs/runs/exp1/spool``: ``exp1``)."""
    job = os.environ.get("SLURM_JOB_NAME", "").strip()
    if job and job not in _NO_JOB_NAMES:
        return job
    script = sys.argv[0] if sys.argv else ""
    if os.environ.get("TORCHELASTIC_RUN_ID") and script not in ("", "-c", "-m"):
        return Path(script).stem
    here = Path(root).resolve()
    if here.name.lower() in _GENERIC_NAMES and here.parent.name:
        return here.parent.name
    return here.name


def ensure_run(
    root: str | os.PathLike[str], *, name: str | None = None, world_size: int | None = None
) -> RunInfo:
    """Create ``run.json`` once, or read the one another rank created first.

    All ranks may call this at once, on NFS too: each writes its candidate to a
    private temporary file and ``link()``s it to ``run.json``. ``link`` fails
    with EEXIST when the name exists, atomically, like ``O_CREAT|O_EXCL``, and
    unlike a plain exclusive create it never exposes a half-written file. The
    winner's contents are what every rank reads back. (Where the file system has no
    hard links, an exclusive create is the fallback: a run.json read empty or cut short
    is read again for a few seconds, the time its creator takes to write 200 bytes.)
    """
    layout = SpoolLayout(root)
    try:
        layout.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        layout.ranks_dir.mkdir(mode=DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create spool directory {layout.root}: {exc}") from exc
    if not layout.root.is_dir():
        raise ConfigError(f"spool {layout.root} is not a directory")
    try:
        return _read_written(root)
    except FileNotFoundError:
        pass
    info = RunInfo(
        run_id=uuid.uuid4().hex,
        created=time.time(),
        name=name or default_run_name(layout.root),
        world_size=world_size,
    )
    create_once(layout.run_json, info.to_json())
    return _read_written(root)


def _read_written(root: str | os.PathLike[str], wait: float = 5.0) -> RunInfo:
    """:func:`read_run`, reading a run.json that is empty or cut short again for ``wait``
    seconds (another rank's exclusive create, on a file system without ``link()``)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return read_run(root)
        except SpoolFormatError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@dataclass(frozen=True, slots=True)
class DeletedSegment:
    """A segment ``ranklog compact --delete`` removed, and the dataset that holds its rows."""

    segment: SegmentId
    dataset: str
    #: the steps it held values for, as inclusive ranges (None: unknown, an older
    #: release's deleted.json)
    steps: tuple[tuple[int, int], ...] | None = None


def deleted_segments(root: str | os.PathLike[str]) -> list[DeletedSegment]:
    """Every segment compaction deleted from this spool (``deleted.json``), in order.

    A damaged ``deleted.json`` is a :class:`SpoolFormatError` naming it.
    """
    path = SpoolLayout(root).deleted_json
    try:
        raw = json.loads(path.read_bytes())
        out = [_deleted(path, k, v) for k, v in raw["segments"].items()]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SpoolFormatError(f"{path}: not a valid deleted.json ({exc})") from exc
    return sorted(out, key=lambda d: d.segment)


def deleted_incarnation(root: str | os.PathLike[str], rank: int) -> int:
    """The highest incarnation of ``rank`` that ``deleted.json`` records (0: none).

    A new incarnation is numbered above it, so a requeue after ``compact --delete`` never
    reuses the number of one whose segments are gone (shippers' cursors still hold them
    as done). A damaged ``deleted.json`` is read for the segment keys it still shows:
    numbering a restart too high costs nothing, reusing one loses its steps.
    """
    path = SpoolLayout(root).deleted_json
    try:
        found = [d.segment.incarnation for d in deleted_segments(root) if d.segment.rank == rank]
    except SpoolFormatError:
        try:
            raw = path.read_bytes()
        except OSError:
            return 0
        found = [int(m.group(2)) for m in _DELETED_KEY.finditer(raw) if int(m.group(1)) == rank]
    # a number no writer could have made (a hostile or garbled file) is not followed
    return max((i for i in found if i < MAX_INCARNATION), default=0)


#: incarnations a rank can be numbered (its segment header holds 32 bits): a listing or a
#: deleted.json naming one at or past this was not written by ranklog, and is not followed
MAX_INCARNATION: Final = 2**31


#: a segment's key as deleted.json writes it (``"00003/0001-000001"``), for a damaged file
_DELETED_KEY: Final = re.compile(rb'"(\d{5,})/(\d{4,})-\d{6,}"')


def _deleted(path: Path, key: str, value: object) -> DeletedSegment:
    """One entry of deleted.json: ``"dataset"`` (version 1) or ``{"dataset", "steps"}``."""
    if isinstance(value, str):
        return DeletedSegment(SegmentId.parse(key), value)
    if not isinstance(value, dict):
        raise SpoolFormatError(f"{path}: not a valid deleted.json (segment {key}: {value!r})")
    steps = tuple((int(lo), int(hi)) for lo, hi in value["steps"])
    return DeletedSegment(SegmentId.parse(key), str(value["dataset"]), steps)


def record_deleted(
    root: str | os.PathLike[str],
    dataset: str | os.PathLike[str],
    segments: list[tuple[SegmentId, list[tuple[int, int]]]],
) -> None:
    """Add ``segments`` (about to be deleted, their rows in ``dataset``; each with the
    steps it holds values for, as inclusive ranges) to ``deleted.json``.

    Written (tmp, fsync, rename) before the files go: a shipper that finds a segment
    missing learns where its rows are instead of shipping nothing, and a shipper whose
    target holds those steps (a replay of the dataset wrote them) goes on.
    """
    from ranklog._fs import atomic_write

    if not segments:
        return
    where = str(Path(dataset).resolve())
    known: dict[str, object] = {}
    for d in deleted_segments(root):
        known[d.segment.key] = (
            d.dataset if d.steps is None else {"dataset": d.dataset, "steps": d.steps}
        )
    for seg, steps in segments:
        known[seg.key] = {"dataset": where, "steps": [list(r) for r in steps]}
    body = {"version": 2, "segments": dict(sorted(known.items()))}
    atomic_write(SpoolLayout(root).deleted_json, json.dumps(body, indent=1).encode() + b"\n")
