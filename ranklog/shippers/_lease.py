"""One shipper per (spool, target) at a time: a lease file that its holder keeps renewing.

``flock`` is not reliable on NFS, so the lease is a small file,
``SPOOL/cursors/<target>.lease``, holding who holds it and a renewal counter::

    {"holder": "node7:4242:9f1c...", "host": "node7", "pid": 4242, "renewals": 17,
     "target": "jsonl:/out/m.jsonl", "ttl": 30.0}

- **Acquire.** Create it exclusively (``link()`` of a private file: atomic on NFS). If it
  exists, its holder is alive when its counter moves within ``ttl`` seconds; it is dead
  at once when it names a process of this host that is gone. A live holder means
  :class:`~ranklog.errors.LeaseHeldError` for the newcomer, with who holds it. A dead or
  silent one is taken over: a new lease is renamed over it and read back after a pause;
  of several shippers taking over at once, the one whose lease is there then holds it.
- **Hold.** A thread renews the counter every ``ttl / 5`` seconds, reading first: a lease
  that is no longer its own (a shipper that was stopped longer than ``ttl`` and taken
  over) is *lost*; the shipper checks :meth:`Lease.check` before it writes to its target
  and before it commits, and stops with ``LeaseHeldError``.
- **Release.** The holder removes the file when it stops.

No clock is compared across machines: only whether the counter moved.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Final, NamedTuple

from ranklog._fs import DIR_MODE, FILE_MODE
from ranklog._proc import process_running
from ranklog.errors import LeaseHeldError, SpoolError
from ranklog.shippers._reopen import check_name
from ranklog.shippers._retry import RetryClock, describe, is_permanent
from ranklog.spool import SpoolLayout

__all__ = ["DEFAULT_TTL", "Lease", "LeaseInfo", "LeasePair", "hold", "read_leases"]

log = logging.getLogger("ranklog.ship")

#: seconds without a renewal after which a lease is taken over
DEFAULT_TTL: Final = 30.0


def hold(lease: Lease, place: str | None, clock: RetryClock) -> Lease | LeasePair:
    """``lease`` (a target's identity's) held, and with it the lease of the target's place
    (``place``: its key, ``<kind>-<hash>``) where it has one: a hard link, a bind mount,
    another name of the same server meet the same lease, and a second shipper is refused
    as for a second spelling. What holds them both, for the shipper to check and release."""
    if place is None:
        lease.acquire_waiting(clock)
        return lease
    where = lease.path.with_name(f"{place}.place")
    pair = LeasePair(lease, Lease("", "", target=lease.target, ttl=lease.ttl, path=where))
    pair.acquire_waiting(clock)
    return pair


class LeasePair:
    """The lease of a target's identity and the lease of its place (what the operating
    system says is the same file or server: a hard link, a bind mount, ``localhost`` for
    ``127.0.0.1``), held together: lost when either is. Taken together too: a killed
    shipper leaves both, and the next takes both over with one pause, not two."""

    def __init__(self, first: Lease, second: Lease) -> None:
        self.first, self.second = first, second

    def acquire_waiting(self, clock: RetryClock) -> None:
        """Hold both (one :attr:`Lease.settle_time` for any takeovers); ``LeaseHeldError``
        naming the holder if either is held, with neither kept."""
        _acquire_together([self.first, self.second], clock)

    def check(self) -> None:
        self.first.check()
        self.second.check()

    def release(self) -> None:
        try:
            self.second.release()
        finally:
            self.first.release()


class Lease:
    """The lease of one target of one spool, held by this process."""

    def __init__(
        self,
        spool: str | os.PathLike[str],
        key: str,
        *,
        target: str,
        ttl: float = DEFAULT_TTL,
        path: Path | None = None,
    ) -> None:
        #: ``path``: a lease kept elsewhere than the spool's cursors (a dataset's lock)
        self.path = path or SpoolLayout(spool).cursors_dir / f"{check_name(key)}.lease"
        self.target = target
        self.ttl = ttl
        self.host = socket.gethostname()
        self.holder = f"{self.host}:{os.getpid()}:{uuid.uuid4().hex}"
        self._renewals = 0
        self._renewed = time.monotonic()
        self._lost: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # -- acquiring ------------------------------------------------------------------------

    def acquire(self) -> None:
        """Hold the lease, taking over a dead holder's; ``LeaseHeldError`` if one is alive."""
        if self._begin():
            time.sleep(self.settle_time)  # let a concurrent taker's rename land
            self._settle()
        self._start()

    @property
    def settle_time(self) -> float:
        """How long a takeover waits before it reads the lease back."""
        return min(1.0, self.ttl / 10)

    def _begin(self) -> bool:
        """Create the lease, or take over a dead holder's; whether it was taken over (then
        :meth:`_settle` after :attr:`settle_time`). ``LeaseHeldError`` if one is alive."""
        self.path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        while not self._create():
            current = self._read()
            if current is None:
                continue  # removed meanwhile (its holder stopped): try again
            if self._alive(current):
                raise LeaseHeldError(
                    f"another shipper holds {self.path} (host {current.get('host')}, pid "
                    f"{current.get('pid')}, target {current.get('target')}): one shipper per "
                    f"target; it is taken over once silent for {self.ttl:g}s"
                )
            log.warning("taking over the lease of a dead shipper (host %s, pid %s)",
                        current.get("host"), current.get("pid"))  # fmt: skip
            self._write(replace=True)
            return True
        return False

    def _settle(self) -> None:
        after = self._read()
        if after is None or after.get("holder") != self.holder:
            raise LeaseHeldError(f"another shipper took over {self.path} at the same time")

    def _start(self) -> None:
        self._renewed = time.monotonic()
        self._thread = threading.Thread(target=self._renew_loop, name="ranklog-lease", daemon=True)
        self._thread.start()

    def acquire_waiting(self, clock: RetryClock) -> None:
        """:meth:`acquire`, waiting out a spool that cannot be written yet (a full disk)
        for as long as ``clock`` allows; a permanent failure is a SpoolError at once."""
        _acquire_together([self], clock)

    def _create(self) -> bool:
        """Create the lease if there is none (atomically, also on NFS)."""
        tmp = self._write(replace=False)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _alive(self, current: dict[str, Any]) -> bool:
        """Whether the holder renews its lease (a gone local process is dead at once)."""
        pid = current.get("pid")
        if current.get("host") == self.host and isinstance(pid, int) and not process_running(pid):
            return False
        seen = current.get("renewals")
        deadline = time.monotonic() + self.ttl
        step = max(0.05, min(1.0, self.ttl / 20))
        while time.monotonic() < deadline:
            time.sleep(step)
            now = self._read()
            if now is None or now.get("holder") != current.get("holder"):
                return True  # it changed hands or went away: someone is active; let them
            if now.get("renewals") != seen:
                return True
        return False

    # -- holding --------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``LeaseHeldError`` if the lease was lost to another shipper.

        When the last renewal is older than half the ttl (this process was stopped, or
        its renewing thread starved), the lease is read (and renewed) here and now.
        """
        if self._lost is None and time.monotonic() - self._renewed > self.ttl / 2:
            with self._lock:
                self._renew()
        if self._lost is not None:
            raise LeaseHeldError(self._lost)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 5) and self._lost is None:
            with self._lock:
                try:
                    self._renew()
                except OSError as exc:  # a filesystem hiccup: try again next time
                    log.warning("renewing %s failed: %s", self.path, exc)

    def _renew(self) -> None:
        current = self._read()
        if current is None or current.get("holder") != self.holder:
            who = "nobody" if not current else f"pid {current.get('pid')} on {current.get('host')}"
            self._lost = f"lost the lease {self.path} to {who}: another shipper ships this target"
            return
        self._renewals += 1
        self._write(replace=True)
        self._renewed = time.monotonic()

    def release(self) -> None:
        """Stop renewing and remove the lease, if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        current = self._read()
        if current is not None and current.get("holder") == self.holder:
            with contextlib.suppress(OSError):
                self.path.unlink()

    # -- the file -------------------------------------------------------------------------

    def _write(self, *, replace: bool) -> Path:
        """Write the lease to a private file; rename it over the lease when ``replace``."""
        tmp = self.path.with_name(f".{self.path.name}.{self.holder.replace(':', '-')}")
        body = {
            "holder": self.holder, "host": self.host, "pid": os.getpid(),
            "renewals": self._renewals, "target": self.target, "ttl": self.ttl,
        }  # fmt: skip
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.write(fd, json.dumps(body).encode())
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, self.path)
        return tmp

    def _read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being replaced, or damaged: no holder anyone can name
        return data if isinstance(data, dict) else {}


def _acquire_together(leases: list[Lease], clock: RetryClock) -> None:
    """Hold every one of ``leases`` (their takeovers settled with one pause), or none:
    ``LeaseHeldError`` naming a live holder; a spool that cannot be written yet (a full
    disk) is waited out for as long as ``clock`` allows, a permanent failure is a
    SpoolError at once."""
    backoff = 0.5
    while True:
        held: list[Lease] = []
        try:
            taken = False
            for lease in leases:
                taken = lease._begin() or taken
                held.append(lease)
            if taken:
                time.sleep(leases[0].settle_time)  # let a concurrent taker's rename land
                for lease in held:
                    lease._settle()
            for lease in held:
                lease._start()
            return
        except OSError as exc:
            for lease in held:
                lease.release()
            path = leases[0].path
            if is_permanent(exc) or (clock.failed() and clock.expired()):
                raise SpoolError(f"cannot write the lease {path}: {describe(exc)}") from exc
            log.warning("cannot write the lease %s (%s); retrying in %.1fs",
                        path, describe(exc), backoff)  # fmt: skip
            time.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
        except BaseException:
            for lease in held:
                lease.release()
            raise


class LeaseInfo(NamedTuple):
    """A lease file as ``ranklog inspect`` reads it: who holds which target, and how lately."""

    key: str
    target: str
    host: str
    pid: int | None
    ttl: float
    #: seconds since the lease file was last renewed (by this machine's clock)
    age: float

    def state(self, here: str | None = None) -> str:
        """``running (pid P)``, ``running on H (renewed Ns ago)``, ``silent on H for Ns``."""
        here = socket.gethostname() if here is None else here
        if self.host == here and self.pid is not None:
            return f"running (pid {self.pid})" if process_running(self.pid) else "stopped"
        if self.age <= self.ttl:
            return f"running on {self.host} (pid {self.pid}, renewed {self.age:.0f}s ago)"
        return f"silent on {self.host} for {self.age:.0f}s (pid {self.pid}): taken over by the next"


def read_leases(spool: str | os.PathLike[str]) -> list[LeaseInfo]:
    """Every readable lease of a spool (a shipper running, or one that died holding it)."""
    out = []
    d = SpoolLayout(spool).cursors_dir
    for path in sorted(d.glob("*.lease")) if d.is_dir() else []:
        try:
            body = json.loads(path.read_bytes())
            age = max(0.0, time.time() - path.stat().st_mtime)
        except (OSError, ValueError):
            continue
        if not isinstance(body, dict):
            continue
        pid = body.get("pid")
        out.append(LeaseInfo(
            path.name.removesuffix(".lease"), str(body.get("target", "")),
            str(body.get("host", "?")), pid if isinstance(pid, int) else None,
            float(body.get("ttl", DEFAULT_TTL)), age,
        ))  # fmt: skip
    return out
