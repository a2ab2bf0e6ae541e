"""Two processes given the same rank id: refused at ``init`` on one host, warned about anywhere.

A rank that starts again after a crash or a requeue is normal: it writes a new
incarnation. Two *live* processes writing the same rank are a misconfiguration
(``RANK`` unset, a copied launcher line) that would mix their values silently:

- :func:`claim_rank`: ``init`` takes this host's lock on the rank
  (``SPOOL/claims/<rank>.<host>``, ``flock``) and holds it for the Run's life: a second
  process of this host claiming the same rank, even at the same instant, is refused with
  :class:`~ranklog.errors.ConfigError` naming the holder's pid;
- :func:`running_writer`: the rank's newest incarnation is looked at too; if it is not
  sealed and its ``rank_start`` names a live process of this host (one of an older
  ranklog, which took no lock), ``init`` is refused the same way; if it names a process
  of another host and was written to in the last minute, ``init`` warns
  (:func:`other_host_writer`: it may be a crash's relaunch, or a second process);
- :func:`later_incarnation`: the writer thread of a live rank lists its rank directory
  every heartbeat; a newer incarnation while it still runs means another process
  took the same rank id (on another host, or starting at the same moment), and it
  warns once.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from ranklog._fs import DIR_MODE, FILE_MODE
from ranklog._proc import process_running
from ranklog.errors import ConfigError
from ranklog.schemas import RankStart
from ranklog.spool import HEADER_SIZE, SegmentName, SegmentReader, SpoolLayout

__all__ = ["claim_rank", "later_incarnation", "other_host_writer", "running_writer"]

#: a segment written to this recently, by a live-looking process elsewhere, may be live
_RECENT_S = 60.0

#: how much of a segment's end is read to find its seal
_TAIL_BYTES = 8192


def claim_rank(layout: SpoolLayout, rank: int, host: str) -> int | None:
    """Take this host's lock on ``rank`` (its descriptor: hold it open for the Run's life).

    :class:`ConfigError` when another live process of this host holds it; None where the
    filesystem takes no locks (then only :func:`running_writer` guards).
    """
    d = layout.root / "claims"
    d.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    path = d / f"{rank:05d}.{host}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise ConfigError(
                f"rank {rank} is being written by pid {holder} on this host (it holds {path}): "
                "two processes with the same rank id? set RANK, or init(rank=...)"
            ) from None
        return None  # no locks here (some FUSE mounts)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def running_writer(layout: SpoolLayout, rank: int, host: str) -> tuple[int, int, str] | None:
    """(incarnation, pid, path) of a live process of ``host`` writing ``rank``, if any."""
    segs = layout.segments(rank)
    if not segs:
        return None
    newest = segs[-1].incarnation
    mine = [s for s in segs if s.incarnation == newest]
    start = _rank_start(mine[0])
    if start is None or start.host != host or start.pid == os.getpid():
        return None
    if not process_running(start.pid) or _sealed(mine[-1]):
        return None
    return newest, start.pid, str(mine[-1].path)


def other_host_writer(layout: SpoolLayout, rank: int, host: str) -> tuple[int, int, str] | None:
    """(incarnation, pid, host) of a process of *another* host that may still write
    ``rank``: its newest incarnation is not sealed and was written to in the last minute
    (a relaunch after a crash looks the same: the caller only warns)."""
    segs = layout.segments(rank)
    if not segs:
        return None
    newest = segs[-1].incarnation
    mine = [s for s in segs if s.incarnation == newest]
    start = _rank_start(mine[0])
    if start is None or start.host == host or _sealed(mine[-1]):
        return None
    try:
        age = time.time() - mine[-1].path.stat(follow_symlinks=False).st_mtime
    except OSError:
        return None
    return (newest, start.pid, start.host) if age < _RECENT_S else None


def later_incarnation(layout: SpoolLayout, rank: int, incarnation: int) -> int | None:
    """The newest incarnation of ``rank`` if it is later than ``incarnation``."""
    segs = layout.segments(rank)
    newest = segs[-1].incarnation if segs else 0
    return newest if newest > incarnation else None


def _rank_start(seg: SegmentName) -> RankStart | None:
    res = SegmentReader(seg.path).read(0, max_bytes=4096)
    for frame in res.frames[:1]:
        for ev in frame.events:
            if isinstance(ev, RankStart):
                return ev
    return None


def _sealed(seg: SegmentName) -> bool:
    try:
        size = seg.path.stat(follow_symlinks=False).st_size
    except OSError:
        return True
    # (its frames undecoded, no layouts looked for: whether it ends with a seal, read fast)
    reader = SegmentReader(seg.path, decode=False, layouts=False)
    res = reader.read(max(HEADER_SIZE, size - _TAIL_BYTES))
    return res.sealed
