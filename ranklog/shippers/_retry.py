"""Which failures a shipper retries, for how long, and how it names them in one line.

A failure is *permanent* when trying again cannot help: the target path is a
directory or lies under a regular file, permission is denied, the filesystem is
read-only, the host name does not resolve, the backend answered 4xx
(:class:`~ranklog.errors.TargetError`). The shipper stops at once, exit 5. Anything
else (a server that is down or answers 5xx, a full disk, a stale NFS handle, a time-out)
is *transient*: retried with backoff, for ever by a live shipper, for at most
``--retry-for`` seconds by ``--once`` (:class:`RetryClock`).

:func:`describe` turns an error into a short clause for that one line: the reason
(``connection refused by 127.0.0.1:5000``), never a library's retry bookkeeping.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import time
from typing import Final

from ranklog.errors import SpoolError, TargetError, TransientTargetError

__all__ = ["ONCE_RETRY_FOR", "RetryClock", "describe", "is_permanent", "permanent_error"]

#: how long ``ranklog ship --once`` retries a transient failure by default (seconds)
ONCE_RETRY_FOR: Final = 120.0

#: errno values that no retry can cure
_PERMANENT_ERRNOS: Final = frozenset(
    {
        errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
        errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL, errno.ENXIO, errno.ENODEV, errno.EEXIST,
        errno.EFBIG,
    }
)  # fmt: skip
#: what a host name that does not resolve looks like inside a library's error text
_UNKNOWN_HOST: Final = re.compile(
    r"NameResolutionError|Name or service not known|nodename nor servname|"
    r"No address associated with hostname|Failed to resolve"
)
_REFUSED: Final = re.compile(r"Connection refused|Errno 111|ECONNREFUSED")
_HOST_PORT: Final = re.compile(r"host='([^']+)', port=(\d+)")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors it was raised from, innermost last (cycles cut)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 16:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def is_permanent(exc: BaseException) -> bool:
    """Whether retrying ``exc`` cannot help (see the module docstring)."""
    if isinstance(exc, TargetError) and not isinstance(exc, TransientTargetError):
        return True
    for e in _chain(exc):
        if isinstance(e, socket.gaierror) and e.errno in (socket.EAI_NONAME, socket.EAI_FAIL):
            return True
        if isinstance(e, OSError) and not isinstance(e, socket.gaierror):
            if e.errno in _PERMANENT_ERRNOS:
                return True
            if e.errno is not None:
                return False  # a real errno that is not permanent: transient
    return bool(_UNKNOWN_HOST.search(str(exc)))


def describe(exc: BaseException, limit: int = 200) -> str:
    """One short clause for ``exc``: the reason, without a library's retry text."""
    text = str(exc)
    where = _HOST_PORT.search(text)
    at = f" {where[1]}:{where[2]}" if where else ""
    if _UNKNOWN_HOST.search(text):
        return f"unknown host{at}".rstrip()
    if _REFUSED.search(text):
        return f"connection refused{' by' + at if at else ''}"
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno is not None and e.strerror:
            name = f": {e.filename}" if e.filename else ""
            return f"{e.strerror}{name}"
    line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def permanent_error(spec: str, exc: BaseException) -> TargetError:
    """The :class:`TargetError` a permanent failure of ``spec`` ends the shipper with."""
    if isinstance(exc, TargetError) and not isinstance(exc, TransientTargetError):
        return exc
    return TargetError(f"{spec}: {describe(exc)} (not retried: trying again cannot help)")


class RetryClock:
    """How long transient failures have lasted, against a bound (None: for ever)."""

    def __init__(self, bound: float | None) -> None:
        self.bound = bound
        self._since: float | None = None

    def failed(self) -> float:
        """Note a failure; seconds since the first of this series."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        return now - self._since

    def expired(self) -> bool:
        """Whether failures have lasted longer than the bound."""
        return (
            self.bound is not None
            and self._since is not None
            and time.monotonic() - self._since > self.bound
        )

    def ok(self) -> None:
        """A success ends the series."""
        self._since = None

    def check(self, exc: BaseException, spec: str, spool: str, progress: str) -> None:
        """Raise the error that ends a shipper of ``spec`` failing with ``exc``, or return
        to retry it: permanent now (a file in ``spool``: a SpoolError), transient once it
        outlasted the bound (``progress`` says how far shipping got)."""
        if is_permanent(exc):
            name = str(getattr(exc, "filename", "") or "")
            if name and os.path.abspath(name).startswith(os.path.abspath(spool) + os.sep):
                raise SpoolError(f"{describe(exc)} (in the spool; not retried)") from exc
            raise permanent_error(spec, exc) from exc
        waited = self.failed()
        if self.expired():
            raise TargetError(
                f"{spec}: {describe(exc)}, still after {waited:.0f}s of retries (--retry-for "
                f"{self.bound:g}): {progress}; what follows is not shipped: run the same "
                "command again to resume"
            ) from exc
