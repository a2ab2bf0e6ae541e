"""One compaction at a time per dataset: a lock the dataset holds.

``ranklog compact`` (and ``--delete``, and the merge of parts) writes part files and
the manifest of ``DIR``: two runs at once would each list, write and remove parts the
other does not know of (rows doubled, parts deleted under the other). So a run holds
``DIR/.compact.lock`` from its first write to its last:

- **flock** where the file system takes locks (local disks; NFS v4 and v3 with lockd):
  the kernel drops it when the process dies, however it dies; a process paused
  (SIGSTOP) keeps it, so a run resumed after another tried is never overlapped. The
  file holds who holds it (host, pid, start time), for the refusal's message.
- **a lease** like the shippers' (host, pid, a renewal counter; taken over when its
  holder is gone from this host, or silent for its ttl on another) where ``flock`` is
  refused (some FUSE mounts). Its holder checks it before each save of the manifest.

A second run is refused in one line naming the holder (:class:`LeaseHeldError`, exit 3).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

from ranklog._fs import FILE_MODE
from ranklog.errors import LeaseHeldError

if TYPE_CHECKING:
    from ranklog.shippers._lease import Lease

__all__ = ["LOCK_NAME", "DatasetLock"]

#: the lock's file in the dataset directory (a dot file: no table, no reader lists it)
LOCK_NAME: Final = ".compact.lock"
#: flock errors that mean "this file system takes no locks" (the lease is used instead)
_NO_LOCKS: Final = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class DatasetLock:
    """Held by one ``compact`` of a dataset at a time (a context manager)."""

    def __init__(self, dataset: Path) -> None:
        self.path = dataset / LOCK_NAME
        self._fd: int | None = None
        self._lease: Lease | None = None

    def __enter__(self) -> DatasetLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Hold the lock; :class:`LeaseHeldError` naming the holder if another run has it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _NO_LOCKS:
                os.close(fd)
                self._take_lease()
                return
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise LeaseHeldError(self._held(holder)) from None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": round(time.time(), 3)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
        self._fd = fd

    def _take_lease(self) -> None:
        from ranklog.shippers._lease import Lease  # (only here: compact starts without it)

        lease = Lease(self.path.parent, "", target=str(self.path.parent),
                      path=self.path.with_name(LOCK_NAME + ".lease"))  # fmt: skip
        try:
            lease.acquire()
        except LeaseHeldError:
            current = lease.path.read_bytes() if lease.path.exists() else b""
            raise LeaseHeldError(self._held(_describe(current))) from None
        self._lease = lease

    def _held(self, holder: str) -> str:
        return (
            f"another compaction of {self.path.parent} is running ({holder}): one compaction "
            "at a time per dataset; run this one again when it has ended"
        )

    def check(self) -> None:
        """Raise :class:`LeaseHeldError` if the lock was lost (a lease taken over while
        this process was stopped past its ttl); a flock is never lost."""
        if self._lease is not None:
            self._lease.check()

    def release(self) -> None:
        """Let the next run in (the file stays: removing it would race a new holder)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)  # (still held: no holder named once it ended)
            finally:
                os.close(fd)
        if self._lease is not None:
            lease, self._lease = self._lease, None
            lease.release()


def _describe(raw: bytes) -> str:
    """Who holds the lock, from its file's text (data, not trusted: only shown)."""
    try:
        info = json.loads(raw)
        host, pid, since = str(info["host"])[:64], int(info["pid"]), info.get("since")
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
    started = ""
    if isinstance(since, int | float):
        started = time.strftime(", since %H:%M:%S", time.localtime(float(since)))
    return f"pid {pid} on {host}{started}"
