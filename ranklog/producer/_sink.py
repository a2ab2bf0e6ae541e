"""The producer's buffer and its background writer.

The training thread encodes an event and appends the bytes to the open chunk
under a short lock: no I/O. A chunk becomes one frame. The background thread
writes sealed chunks every ``flush_interval`` (and sends heartbeats when the
rank is quiet); :meth:`SpoolSink.flush` writes them at once in the caller's
thread, which is what ``step_end`` does at durability ``step`` and ``fsync``.

A metrics call is not encoded by the caller: the sink keeps the call's own values and
whoever writes the chunk packs it (segment format 2, :mod:`ranklog.producer._pack`).

Write errors (ENOSPC, EFBIG, EIO, ...) never reach the caller: the bytes stay
in the buffer, a warning is issued once, and the background thread retries with
backoff until the disk takes them. Past ``max_buffer_bytes`` of unwritten events
the caller waits (and is warned once): events are never dropped silently.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import msgspec

from ranklog.errors import InvalidValueError, RanklogWarning, SpoolError
from ranklog.producer._dupes import later_incarnation
from ranklog.producer._pack import PACK_MAX_NAMES, Call, Chunk, Packer, call_size
from ranklog.schemas import Event, Heartbeat, Metrics, StepEnd
from ranklog.spool import MAX_FRAME_BYTES, IncarnationWriter
from ranklog.spool._format import msgpack_array_header

__all__ = ["DURABILITY_LEVELS", "DeadSink", "SpoolSink"]

log = logging.getLogger("ranklog")

DURABILITY_LEVELS: Final = ("buffered", "step", "fsync")
#: A chunk is sealed into a frame once it holds this many bytes.
FRAME_TARGET: Final = 1024 * 1024
_MAX_EVENT: Final = MAX_FRAME_BYTES - 64


class SpoolSink:
    """Buffers encoded events of one incarnation and writes them as frames."""

    def __init__(
        self,
        writer: IncarnationWriter,
        *,
        flush_interval: float,
        max_buffer_bytes: int,
        heartbeat_interval: float,
    ) -> None:
        self.writer = writer
        self.flush_interval = flush_interval
        self.max_buffer_bytes = max_buffer_bytes
        self.heartbeat_interval = heartbeat_interval
        self._encode = msgspec.msgpack.Encoder().encode
        self._lock = threading.RLock()  # buffers; re-entrant for signal handlers
        self._io_lock = threading.RLock()  # the writer
        self._drainer: int | None = None  # the thread writing chunks, while it does
        #: what a signal handler asked of this thread amid its write: done right after it
        self._deferred: list[Callable[[], object]] = []
        self._cur = Chunk()
        self._cur_bytes = 0
        # the watermark rule, applied in stream order: highest step_end, highest step event
        self._closed_step = -1
        self._max_step = -1
        #: open step -> step events appended for it (not late by the watermark)
        self._counts: dict[int, int] = {}
        self._chunks: deque[Chunk] = deque()
        self._held_bytes = 0
        self._appended = 0
        self._written_events = 0
        self._packer = Packer(writer, self._encode, _MAX_EVENT)
        self._error: OSError | None = None
        self._warned: set[str] = set()
        self._closed = False
        self._abandoned = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ranklog-writer", daemon=True)
        self._thread.start()

    # -- the hot path ------------------------------------------------------------------

    def append(self, event: Event, *, wait: bool = True, step: int | None = None) -> None:
        """Buffer one event (no I/O); waits only when the buffer is full (and ``wait``).

        ``step``: the event is a step event of that step (counted for its step_end).
        """
        try:
            data = self._encode(event)
        except UnicodeEncodeError as exc:
            what = getattr(event, "name", None) or type(event).__name__.lower()
            raise InvalidValueError(
                f"{what!r}: text that is not valid Unicode ({exc.reason})"
            ) from None
        if len(data) > _MAX_EVENT:
            what = getattr(event, "name", None) or type(event).__name__.lower()
            raise InvalidValueError(
                f"{what!r}: an event of {len(data):,} bytes, more than a frame holds "
                f"({_MAX_EVENT:,} bytes); nothing of it was logged"
            )
        with self._lock:
            if step is not None:
                self._count_locked(step)
            self._add_locked(data, len(data))
            over = self._held_bytes + self._cur_bytes > self.max_buffer_bytes
        if over and wait:
            self._backpressure()

    def append_metrics(self, ts: float, step: int, values: dict[str, float], op: Any) -> None:
        """Buffer the metrics of one call (``op``: its reduce spec): kept as they are, and
        packed by whoever writes them (:mod:`ranklog.producer._pack`). ``values`` is the
        call's own dict (never changed after). A reduce map, or a call of more than
        ``PACK_MAX_NAMES`` names, is encoded at once as a Metrics event."""
        if type(op) is not str or not 0 < len(values) <= PACK_MAX_NAMES:
            self.append(Metrics(ts, step, values, op), step=step)
            return
        with self._lock:
            self._count_locked(step)
            self._add_locked((ts, step, values, op), call_size(values))
            over = self._held_bytes + self._cur_bytes > self.max_buffer_bytes
        if over:
            self._backpressure()

    def _count_locked(self, step: int) -> None:
        """A step event of ``step``: counted for its step_end unless late by the watermark."""
        top = self._max_step
        if step > self._closed_step and step >= top:
            self._counts[step] = self._counts.get(step, 0) + 1
        if step > top:
            self._max_step = step

    def append_step_end(self, ts: float, step: int) -> None:
        """Buffer ``StepEnd(step)``, with the count of ``step``'s events when it closes it."""
        with self._lock:
            first = step > self._closed_step and step >= self._max_step
            count = self._counts.pop(step, 0) if first else -1
            if self._counts and min(self._counts) <= step:
                for s in [s for s in self._counts if s <= step]:
                    del self._counts[s]  # closed too (by this step_end): never counted
            if step > self._closed_step:
                self._closed_step = step
            data = self._encode(StepEnd(ts, step, count))
            self._add_locked(data, len(data))
            over = self._held_bytes + self._cur_bytes > self.max_buffer_bytes
        if over:
            self._backpressure()

    def _add_locked(self, item: bytes | Call, size: int) -> None:
        if self._cur_bytes + size > _MAX_EVENT:
            self._seal_locked()  # a frame never exceeds the cap
        self._cur.append(item)
        self._cur_bytes += size
        self._appended += 1
        if self._cur_bytes >= FRAME_TARGET:
            self._seal_locked()

    def _seal_locked(self) -> None:
        cur = self._cur
        if not cur:
            return
        if not self._chunks or self._chunks[-1] is not cur:
            cur.nbytes = self._cur_bytes
            self._chunks.append(cur)
            self._held_bytes += self._cur_bytes
        self._cur = Chunk()
        self._cur_bytes = 0

    def _backpressure(self) -> None:
        self._warn_once(
            "backpressure",
            f"ranklog: more than {self.max_buffer_bytes} bytes of events are waiting to be "
            f"written to {self.writer.path.parent}; logging calls now wait for the disk",
        )
        delay = 0.002
        while True:
            with self._lock:
                if self._held_bytes + self._cur_bytes <= self.max_buffer_bytes or self._closed:
                    return
            if self.flush():  # write in this thread: it has to wait for the disk anyway
                delay = 0.002
            else:
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    # -- writing -----------------------------------------------------------------------

    @property
    def pending_bytes(self) -> int:
        """Encoded bytes not yet handed to the OS."""
        return self._held_bytes + self._cur_bytes

    @property
    def error(self) -> OSError | None:
        """The last write error, or None once writes succeed again."""
        return self._error

    def flush(self, *, sync: bool = False) -> bool:
        """Write every buffered event now, in this thread. False if the disk refused."""
        try:
            return self._drain(sync=sync)
        except (OSError, SpoolError) as exc:
            self._on_error(exc if isinstance(exc, OSError) else OSError(str(exc)))
            self._wake.set()
            return False

    def _drain(self, *, sync: bool) -> bool:
        """Write every chunk; False, writing nothing, when called from within a write of this
        very thread (a signal handler that closes the run): that write's state is half done."""
        with self._io_lock:
            if self._drainer is not None:
                return False
            self._drainer = threading.get_ident()
            try:
                self._drain_locked(sync=sync)
            finally:
                self._drainer = None
                while self._deferred:  # (a handler that interrupted the write, now it is done)
                    self._deferred.pop(0)()
            return True

    def busy_here(self) -> bool:
        """Whether this very thread is amid a write (a signal handler interrupted it)."""
        return self._drainer == threading.get_ident()

    def defer(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once this thread's write is done (see :meth:`busy_here`)."""
        self._deferred.append(fn)

    def _drain_locked(self, *, sync: bool) -> None:
        with self._lock:
            self._seal_locked()
        wrote = False
        while True:
            with self._lock:
                if not self._chunks:
                    break
                chunk = self._chunks[0]
            frames = chunk.frames
            if frames is None:  # packed once: a retry writes the same bytes
                frames = self._packer.frames(chunk)
            while chunk.written < len(frames):
                count, body, names = frames[chunk.written]
                self.writer.write_events(count, [msgpack_array_header(count), body],
                                         names=names)  # fmt: skip
                chunk.written += 1
                wrote = True
            with self._lock:
                if self._chunks and self._chunks[0] is chunk:
                    self._chunks.popleft()
                    self._held_bytes -= chunk.nbytes
                    self._written_events += len(chunk)
        if sync and (wrote or self._error is not None):
            self.writer.sync()
        if self._error is not None:
            self._recovered()

    def _on_error(self, exc: OSError) -> None:
        first = self._error is None
        self._error = exc
        if first:
            log.debug("spool write failed: %s", exc)
        self._warn_once(
            "write-error",
            f"ranklog: cannot write to {self.writer.path} ({exc.strerror or exc}); "
            f"events are kept in memory (up to {self.max_buffer_bytes} bytes) and retried",
        )

    def _recovered(self) -> None:
        self._error = None
        log.warning("ranklog: spool %s is writable again", self.writer.path.parent)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RanklogWarning, stacklevel=3)

    # -- the background thread ---------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._loop_body()
        except Exception as exc:  # never die silently, never raise into anyone
            self._warn_once(
                "writer-thread",
                f"ranklog: the background writer for {self.writer.path.parent} stopped: {exc!r}; "
                "events are written at step_end and close only",
            )

    def _loop_body(self) -> None:
        seen = -1
        quiet_since = checked = time.monotonic()
        backoff = 0.0
        while not self._stop.is_set():
            self._wake.wait(backoff or self.flush_interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            now = time.monotonic()
            if self._appended != seen:
                seen = self._appended
                quiet_since = now
            elif now - quiet_since >= self.heartbeat_interval:
                self.append(Heartbeat(time.time()), wait=False)
                seen = self._appended
                quiet_since = now
            if now - checked >= self.heartbeat_interval:
                checked = now
                self._check_rank_taken()
            if self.pending_bytes or self._error is not None:
                if self.flush():
                    backoff = 0.0
                else:
                    backoff = min(max(backoff * 2, 0.05), max(self.flush_interval, 1.0))

    def _check_rank_taken(self) -> None:
        """Warn once if another process started as this rank while this one still runs."""
        w = self.writer
        try:
            newer = later_incarnation(w.layout, w.rank, w.incarnation)
        except OSError:
            return
        if newer is not None:
            self._warn_once(
                "rank-taken",
                f"ranklog: another process started as rank {w.rank} (incarnation {newer}) "
                f"while this one (incarnation {w.incarnation}) still runs: two processes with "
                "the same rank id mix their values; set RANK, or init(rank=...)",
            )

    def abandon(self) -> None:
        """Stop the writer thread and close the file unsealed, as a killed process would."""
        self._closed = self._abandoned = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        with self._io_lock:
            self.writer.abandon()

    def close(self, final: Event | None, *, timeout: float = 30.0) -> int:
        """Append ``final``, write everything (retrying up to ``timeout``), seal and sync.

        Returns the number of events that could not be written (0 normally).
        """
        if self._abandoned:
            return 0
        if self.busy_here():  # a signal handler, amid this thread's write: close right after it
            self.defer(lambda: self.close(final, timeout=timeout))
            with self._lock:
                return sum(len(c) for c in self._chunks) + len(self._cur)
        self._closed = True  # from here on, nothing waits on a full buffer
        if final is not None:
            self.append(final, wait=False)
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        deadline = time.monotonic() + timeout
        delay = 0.05
        while not self.flush(sync=False):
            if time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        with self._lock:
            lost = sum(len(c) for c in self._chunks) + len(self._cur)
        try:
            with self._io_lock:
                self.writer.close(seal=lost == 0, sync=True)
        except OSError as exc:
            self._on_error(exc)
        if lost:
            warnings.warn(
                f"ranklog: {lost} events could not be written to {self.writer.path} "
                f"before close ({self._error})",
                RanklogWarning,
                stacklevel=2,
            )
        return lost


class DeadSink:
    """Stands in for the sink of a closed run, or of a run inherited by a forked child.

    Logging there is ignored with one warning: nothing can be written any more
    (a forked child must never write its parent's files).
    """

    def __init__(self, why: str) -> None:
        self._why = why
        self._warned = False

    def append(self, event: object, *, wait: bool = True, step: int | None = None) -> None:
        self._warn()

    def append_metrics(self, ts: float, step: int, values: object, op: object) -> None:
        self._warn()

    def append_step_end(self, ts: float, step: int) -> None:
        self._warn()

    def _warn(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"ranklog: logging {self._why} is ignored; call ranklog.init() to log again",
                RanklogWarning,
                stacklevel=4,  # the caller of the Run method
            )

    def flush(self, *, sync: bool = False) -> bool:
        return False

    def close(self, final: object, *, timeout: float = 0.0) -> int:
        return 0
