"""``DIR/_manifest.json``: what a compacted dataset holds, per source segment and incarnation.

The manifest is the dataset's commit record: Parquet files are written (tmp, fsync,
rename) before the manifest that lists them is replaced the same way, so a file the
manifest does not list was left by a crashed run and is removed before its range
is compacted again.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Final

import msgspec

from ranklog._fs import atomic_write
from ranklog.errors import ArchiveError, ConfigError
from ranklog.spool import NO_STEP, SegmentId, legacy_implied, watermark

__all__ = [
    "MANIFEST",
    "Manifest",
    "SegmentEntry",
    "StepsMark",
    "load_manifest",
    "require_manifest",
    "save_manifest",
    "table_files",
]

MANIFEST: Final = "_manifest.json"


class SegmentEntry(msgspec.Struct, forbid_unknown_fields=False):
    """What the manifest knows of one source segment."""

    offset: int = 0  # the next byte to compact
    sealed: bool = False
    done: bool = False  # nothing more will ever come from it
    files: list[str] = msgspec.field(default_factory=list)
    rows: dict[str, int] = msgspec.field(default_factory=dict)
    verified: bool = False
    deleted: bool = False
    #: the sequence number after the last frame compacted, the seal's included (-1: unknown)
    next_seq: int = -1
    #: offsets of the frames before ``offset`` that hold names records (segment format 2):
    #: the next run reads them alone (None: not saved; it follows frame headers)
    names: list[int] | None = None
    #: layout 2: per table, the row groups of the part files that hold its rows, as
    #: ``[part, generation, first group, end group]`` (``files`` names those files); empty
    #: in layout 1
    pieces: dict[str, list[list[int]]] = msgspec.field(default_factory=dict)


class StepsMark(msgspec.Struct, forbid_unknown_fields=False):
    """How far the steps table covers the raw tables, as of the last compaction."""

    #: the table's files then
    files: int = 0
    #: segment stem -> the bytes of it the steps table's shipper had consumed (everything
    #: before: shipped, or counted); a segment compacted further than this is not covered
    covered: dict[str, int] = msgspec.field(default_factory=dict)
    #: who wrote the table: ``spool`` (compaction's shipper) or ``rows`` (``compact
    #: --steps``, from the raw rows: a later compaction leaves it as it is)
    source: str = "spool"


class Manifest(msgspec.Struct, forbid_unknown_fields=False):
    """Which frames of which segment are in which files, and each incarnation's marks."""

    version: int = 1
    #: 1: a file per table per segment and chunk; 2: a few part files per table, rows
    #: sorted by step (:mod:`ranklog.archive._parts`). Absent (older datasets): 1
    layout: int = 1
    #: layout 2: the number of the next part
    parts: int = 0
    run_id: str = ""
    name: str = ""
    world_size: int | None = None
    created: float = 0.0
    #: segment stem (``00003-0001-000001``) -> what is compacted of it
    segments: dict[str, SegmentEntry] = msgspec.field(default_factory=dict)
    bad: list[str] = msgspec.field(default_factory=list)
    #: incarnation key (``3/1``) -> [highest step_end, highest step, implied close]: what
    #: it had closed (:func:`ranklog.spool.watermark`; older manifests: the first two)
    marks: dict[str, list[int]] = msgspec.field(default_factory=dict)
    #: the steps table (None: no compaction of this release wrote one)
    steps: StepsMark | None = None

    def steps_cover(self, files: int) -> bool:
        """Whether the steps table, holding ``files`` files, covers every frame the raw
        tables hold (then replay may read it instead of them)."""
        mark = self.steps
        if mark is None or mark.files != files:
            return False
        covered = mark.covered
        return all(entry.offset <= covered.get(stem, 0) or not entry.rows
                   for stem, entry in self.segments.items())  # fmt: skip

    def mark(self, seg: SegmentId) -> list[int]:
        """The (mutable) marks of ``seg``'s incarnation."""
        mark = self.marks.setdefault(seg.incarnation_key, [NO_STEP, NO_STEP, NO_STEP])
        if len(mark) < 3:  # (an older manifest: as it judged)
            mark.append(legacy_implied(mark[0], mark[1]))
        return mark

    def relogged_upto(self, rank: int, incarnation: int) -> int:
        """The highest step an earlier incarnation of ``rank`` had closed (-1: none).

        Incarnations are numbered from 1 (0 is looked up too): a lookup per earlier
        incarnation, not a pass over every rank's marks (which made compacting a job
        of N ranks cost O(N²)).
        """
        best = NO_STEP
        for inc in range(incarnation):
            mark = self.marks.get(SegmentId(rank, inc, 0).incarnation_key)
            if mark is not None:
                implied = mark[2] if len(mark) > 2 else legacy_implied(mark[0], mark[1])
                best = max(best, watermark(mark[0], implied))
        return best


_decoder: Final = msgspec.json.Decoder(Manifest)


def load_manifest(out: str | os.PathLike[str]) -> Manifest:
    """The manifest of a dataset directory (an empty one when there is none yet)."""
    path = Path(out) / MANIFEST
    try:
        return _decoder.decode(path.read_bytes())
    except FileNotFoundError:
        return Manifest()
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ArchiveError(f"{path}: unreadable manifest ({exc})") from exc


def require_manifest(dataset: str | os.PathLike[str]) -> Manifest:
    """The manifest of an existing dataset.

    :class:`ConfigError` when the directory does not exist, :class:`ArchiveError` when
    it is not a dataset.
    """
    path = Path(dataset)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such dataset directory")
    manifest = load_manifest(path)
    if not manifest.run_id:
        raise ArchiveError(not_a_dataset(path))
    return manifest


def not_a_dataset(path: Path) -> str:
    """Why ``path`` is no dataset, with the command that makes one where it is a spool."""
    if (path / "run.json").is_file() and (path / "ranks").is_dir():
        where = path.resolve()
        return (
            f"{path} is a spool, not a compacted ranklog dataset: make one with `ranklog "
            f"compact {shlex.quote(str(where))} --out {shlex.quote(str(where) + '-parquet')}`"
        )
    return (
        f"{path} is not a compacted ranklog dataset (no {MANIFEST}): `ranklog compact SPOOL "
        "--out DIR` makes one"
    )


def save_manifest(out: Path, manifest: Manifest) -> None:
    """Replace the manifest atomically."""
    atomic_write(out / MANIFEST, msgspec.json.format(msgspec.json.encode(manifest)))


def table_files(dataset: str | os.PathLike[str], table: str) -> list[Path] | Path:
    """The files of ``table`` the dataset's manifest lists (what a reader should scan: a
    file a run killed a moment ago left, or a part a merge replaced, is not listed); the
    table's directory when there is no manifest."""
    root = Path(dataset)
    manifest = load_manifest(root)
    if not manifest.run_id:
        return root / table
    listed = {f for entry in manifest.segments.values() for f in entry.files}
    return sorted(root / f for f in listed if f.startswith(f"{table}/"))
