"""Where a target writes, as the operating system sees it: what two spellings share.

A target's identity is canonical text (a real path, a lower-cased URL). Two spellings
can still be one place that text does not show: a hard link or a bind mount (same
device and inode, two real paths), ``localhost``, ``127.0.0.1``, ``[::1]`` and the host's
own name for one server. A target's ``place(run)`` says that place; the engine holds a
lease on it beside the identity's (:class:`~ranklog.shippers._lease.LeasePair`), so the
second shipper is refused as for a second spelling.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import urllib.parse
from pathlib import Path

__all__ = ["dir_place", "file_place", "server_place"]


def file_place(path: Path) -> str | None:
    """``file:<device>:<inode>`` of an existing file (None: it cannot be looked at)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"file:{st.st_dev}:{st.st_ino}"


def dir_place(path: Path) -> str | None:
    """``dir:<device>:<inode>`` of a directory, made if missing (as the target's open makes
    it); None when it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        st = os.stat(path)
    except OSError:
        return None
    return f"dir:{st.st_dev}:{st.st_ino}"


def server_place(url: str) -> str | None:
    """``<scheme>://<host>:<port><path>``, every name of this machine (``localhost``, a
    loopback address, its own name or address) made ``localhost``; another host is its
    name as given (two servers behind one address, told apart by name, stay two). None
    for a URL with no host."""
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower()
    if not host or parts.scheme.lower() not in ("http", "https"):
        return None
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        return None
    where = _canonical_host(host, port)
    return f"{parts.scheme.lower()}://{where}:{port}{parts.path.rstrip('/')}"


def _canonical_host(host: str, port: int) -> str:
    if host == "localhost":
        return host
    addresses = _addresses(host, port)
    if addresses and all(_local(a) for a in addresses):
        return "localhost"
    own = {socket.gethostname().lower(), socket.getfqdn().lower()}
    if host in own:
        return "localhost"
    mine = set().union(*(_addresses(h, port) for h in own))
    return "localhost" if addresses and addresses <= mine else host


def _addresses(host: str, port: int) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {str(info[4][0]) for info in infos}


def _local(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    if mapped is not None:
        ip = mapped
    return ip.is_loopback or ip.is_unspecified
