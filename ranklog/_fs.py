"""Crash-safe file replacement: write a temporary file, fsync it, rename it, fsync the directory.

Every file ranklog replaces in place (a shipper's cursor, a Parquet file and the
dataset manifest, TensorBoard's hparams file, the report) goes through
:func:`atomic_write`, so a crash at any moment leaves either the old file or the
new one, never a mix, and the rename itself survives a power loss once the
directory is fsync'd.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Final

__all__ = ["DIR_MODE", "FILE_MODE", "atomic_write", "create_once", "fsync_dir", "fsync_file"]

#: files ranklog creates (under the caller's umask)
FILE_MODE: Final = 0o640
#: directories ranklog creates
DIR_MODE: Final = 0o750


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that a create or rename in it survives a crash (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync a file another writer wrote (a read-only descriptor suffices on Linux); its
    errors are the caller's: a file that cannot be made durable is not."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | Callable[[str], None],
    *,
    mode: int = FILE_MODE,
    sync_dir: bool = True,
) -> None:
    """Replace ``path`` with ``data`` (bytes, or a function writing the file it is given).

    The temporary file sits next to ``path`` (same filesystem, so the rename is
    atomic), is fsync'd before the rename and removed if anything fails. With
    ``sync_dir=False`` the caller fsyncs the directory itself, once for several files.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, bytes | bytearray | memoryview):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            data(str(tmp))
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if sync_dir:
        fsync_dir(path.parent)


def create_once(path: str | os.PathLike[str], data: bytes, *, mode: int = FILE_MODE) -> bool:
    """Create ``path`` holding ``data`` unless it exists; whether this call created it.

    The data goes to a private temporary file first (fsync'd), which is then ``link()``ed
    to ``path``: that fails with EEXIST when the name exists, atomically, also on NFS,
    and unlike ``O_CREAT | O_EXCL`` it never shows anyone a half-written file.
    """
    path = Path(path)
    tmp = path.with_name(
        f".{path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    )
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        return _create_excl(path, data, mode)  # a file system without hard links
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fsync_dir(path.parent)
    return True


#: what link() fails with where a file system has no hard links (some FUSE, SMB, object
#: store mounts)
_NO_LINKS: Final = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def _create_excl(path: Path, data: bytes, mode: int) -> bool:
    """:func:`create_once` with ``O_CREAT | O_EXCL`` (a reader may see the file before its
    bytes: the readers of such files treat a short or empty one as not written yet)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except FileExistsError:
        return False
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    return True
