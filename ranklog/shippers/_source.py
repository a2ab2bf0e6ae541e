"""Finding and tailing segment files: the shipper's source.

Discovery uses watchdog's native observer (inotify) on local filesystems, and
polling on network filesystems, where inotify never sees writes made by another
machine (NFS, Lustre, GPFS, CIFS, FUSE mounts; detected from ``/proc/mounts``),
or whenever ``--poll`` is given. Growth of known segments is detected with
``stat`` locally, and with open + fstat on network filesystems so that NFS
attribute caching cannot hide it (close-to-open consistency).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from ranklog.spool import ReadResult, SegmentHeader, SegmentName, SegmentReader, SpoolLayout

__all__ = ["NETWORK_FS", "Reader", "SegState", "Source", "SpoolSource", "filesystem_of"]

NETWORK_FS: Final = frozenset(
    {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "beegfs",
     "panfs", "afs", "9p", "virtiofs"}
)  # fmt: skip


def filesystem_of(path: str | os.PathLike[str], mounts: str = "/proc/mounts") -> str:
    """The filesystem type of the mount holding ``path`` (``"unknown"`` if unreadable)."""
    target = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open(mounts) as f:
            lines = f.read().splitlines()
    except OSError:
        return fstype
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, fstype = mnt, parts[2]
    return fstype


def is_network_fs(fstype: str) -> bool:
    """Whether writes from other machines can happen without inotify seeing them."""
    return fstype in NETWORK_FS or fstype.startswith("fuse")


class Reader(Protocol):
    """What the engine reads a segment with (a file, or a Parquet dataset in replay)."""

    header: SegmentHeader | None

    def read(
        self, offset: int = 0, *, writer_gone: bool = False, max_bytes: int | None = None
    ) -> ReadResult:
        """Frames from ``offset`` on; see :meth:`ranklog.spool.SegmentReader.read`."""
        ...

    def resume_from(self, names: Sequence[int], offset: int) -> None:
        """Where the names frames before ``offset`` are (segment format 2)."""
        ...

    def names_before(self, offset: int) -> list[int]:
        """The offsets of the frames before ``offset`` that hold names records."""
        ...


@dataclass(slots=True, eq=False)
class SegState:
    """What the shipper knows of one segment file."""

    name: SegmentName
    key: str
    reader: Reader
    #: next byte to read
    offset: int = 0
    #: committed: every event before it belongs to a shipped step
    consumed: int = 0
    #: highest offset examined by any earlier shipper process (late events there are counted)
    seen: int = 0
    sealed: bool = False
    #: nothing more will ever be read from it
    exhausted: bool = False
    size: int = -1
    mtime: float = 0.0
    #: sequence number of the frame expected at ``offset`` (None: unknown)
    next_seq: int | None = None
    #: ... and at ``consumed``
    consumed_seq: int | None = None
    #: its place in its incarnation's sequence was checked (a missing segment before it)
    placed: bool = False
    #: frames read but not yet consumed: (end, max step in frame, holds params, next seq,
    #: the incarnation's (closed, max step, implied) after it)
    frames: list[tuple[int, int, bool, int | None, tuple[int, int, int]]] = field(
        default_factory=list
    )
    #: the incarnation's (closed, max step, implied) at ``consumed`` (None: not known)
    consumed_state: tuple[int, int, int] | None = None
    #: ... as a committed cursor saved it: the state re-reading starts from
    restore_state: tuple[int, int, int] | None = None
    #: restored from a cursor of a version that did not save that state: values re-read
    #: below ``seen`` are never carried as late (they may be values of steps shipped)
    legacy: bool = False


class Source(Protocol):
    """Where the engine's segments come from: a spool directory, or a Parquet dataset."""

    segments: dict[str, SegState]
    by_rank: dict[int, list[SegState]]
    #: step_end event counts are checked against what was read (off for a filtered replay)
    verify_counts: bool
    #: only steps lo <= step < hi exist in this source (None: all)
    step_range: tuple[int | None, int | None] | None

    @property
    def mode(self) -> str:
        """How changes are noticed, for status lines."""
        ...

    def discover(self) -> list[SegState]:
        """Segments not known yet."""
        ...

    def probe(self, seg: SegState) -> bool:
        """Refresh ``seg.size``/``seg.mtime``; True if unread bytes may be there."""
        ...

    def wait(self, timeout: float) -> None:
        """Sleep until something may have changed."""
        ...

    def close(self) -> None:
        """Release watchers."""
        ...


class SpoolSource:
    """Knows every segment of a spool and wakes the engine when something changed."""

    def __init__(
        self,
        spool: str | os.PathLike[str],
        *,
        poll: float | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self.layout = SpoolLayout(spool)
        #: (i, n): only ranks r with r % n == i are followed (a reader of a fan-in)
        self.shard = shard
        self.fstype = filesystem_of(spool)
        self.network = is_network_fs(self.fstype)
        self.polling = poll is not None or self.network
        self.poll_interval = poll if poll is not None else 1.0
        self.segments: dict[str, SegState] = {}
        self.by_rank: dict[int, list[SegState]] = {}
        self.verify_counts = True
        self.step_range: tuple[int | None, int | None] | None = None
        self._dir_seen: dict[str, tuple[int, float]] = {}
        #: each rank's directory, as a path string (listed every round: made once)
        self._rank_dirs: dict[int, str] = {}
        self._wake = threading.Event()
        self._observer: Any = None
        self._observing = False

    @property
    def mode(self) -> str:
        """``inotify`` or ``poll every N s (fstype)``, for status lines."""
        if self.polling:
            return f"polling every {self.poll_interval:g}s ({self.fstype})"
        return f"inotify ({self.fstype})"

    def _start_observer(self) -> None:
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:  # pragma: no cover - watchdog is a core dependency
            self.polling = True
            return
        wake = self._wake

        class _Handler(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                wake.set()

        self.layout.ranks_dir.mkdir(parents=True, exist_ok=True)
        observer = Observer()
        observer.schedule(_Handler(), str(self.layout.ranks_dir), recursive=True)
        observer.daemon = True
        try:
            observer.start()
        except OSError:  # inotify limits reached: fall back to polling
            self.polling = True
            return
        self._observer = observer

    def wait(self, timeout: float) -> None:
        """Sleep until a change is reported (native) or for the poll interval."""
        if not self.polling and not self._observing:
            self._observing = True  # started on first wait: a --once run never needs it
            self._start_observer()
        if self.polling:
            time.sleep(min(timeout, self.poll_interval))
        else:
            self._wake.wait(timeout)
            self._wake.clear()

    def close(self) -> None:
        """Stop the observer thread, if any."""
        if self._observer is not None:
            with contextlib.suppress(Exception):
                self._observer.stop()
                self._observer.join(timeout=2)
            self._observer = None

    def _unchanged(self, path: str, now: float | None = None) -> bool:
        """Whether directory ``path`` surely has no new entry since it was last listed.

        Its mtime must be unchanged *and* have been older than a second when it was
        listed: mtimes are coarse (one clock tick), so a file created in the same tick
        as the previous change leaves the mtime as it was ("racy" timestamps, as git).
        Network filesystems cache directory attributes: there every listing is redone.
        """
        try:
            mtime = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return True
        now = time.time() if now is None else now
        before = self._dir_seen.get(path)
        self._dir_seen[path] = (mtime, now)
        if self.network or before is None:
            return False
        return before[0] == mtime and before[1] - mtime / 1e9 > 1.0

    def discover(self) -> list[SegState]:
        """Find segments not known yet (only directories that may have changed are listed)."""
        new: list[SegState] = []
        if not self.layout.ranks_dir.is_dir():
            return new
        if not self._unchanged(str(self.layout.ranks_dir)):
            ranks = self.layout.ranks()
            if self.shard is not None:
                i, n = self.shard
                ranks = [r for r in ranks if r % n == i]
            added = {r: str(self.layout.rank_dir(r)) for r in ranks if r not in self._rank_dirs}
            if added:  # (in rank order)
                self._rank_dirs = dict(sorted({**self._rank_dirs, **added}.items()))
        now = time.time()  # (before the listings: a directory changed meanwhile is not
        # taken as settled; see _unchanged)
        for rank, path in self._rank_dirs.items():
            if self._unchanged(path, now):
                continue
            for seg in self.layout.segments(rank):
                key = seg.id.key
                if key in self.segments:
                    continue
                state = SegState(seg, key, SegmentReader(seg.path, packed=True))
                self.segments[key] = state
                lst = self.by_rank.setdefault(rank, [])
                lst.append(state)
                lst.sort(key=lambda s: (s.name.incarnation, s.name.segment))
                new.append(state)
        return new

    def probe(self, seg: SegState) -> bool:
        """Refresh size and mtime of ``seg``; True if it may have bytes not read yet."""
        try:
            if self.network:
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                fd = os.open(seg.name.path, flags)
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
            else:
                st = os.stat(seg.name.path, follow_symlinks=False)
        except OSError:
            return False
        seg.size = st.st_size
        seg.mtime = st.st_mtime
        return st.st_size > seg.offset
