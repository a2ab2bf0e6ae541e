"""The :class:`Run` object a training process logs through, and :func:`init`."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Final, Literal

from ranklog._version import __version__
from ranklog.errors import ConfigError, RanklogWarning
from ranklog.producer._dupes import claim_rank, other_host_writer, running_writer
from ranklog.producer._media import RunValues
from ranklog.producer._names import NameBook
from ranklog.producer._records import CODE_ENV
from ranklog.producer._sink import DURABILITY_LEVELS, DeadSink, SpoolSink
from ranklog.producer._values import (
    MAX_STEP,
    Redactor,
    as_float,
    check_name,
    check_step,
    op_spec,
)
from ranklog.schemas import (
    Gpu,
    RankEnd,
    RankStart,
    Timer,
)
from ranklog.spool import IncarnationWriter, SpoolLayout, ensure_run

__all__ = ["SPOOL_ENV", "Durability", "Run"]

Durability = Literal["buffered", "step", "fsync"]
#: a cross-rank reduction: one op, several, or per name (names left out: ``mean``)
Reduce = str | tuple[str, ...] | Mapping[str, str | tuple[str, ...]]
SPOOL_ENV: Final = "RANKLOG_SPOOL"
_NAME_CACHE_MAX: Final = 100_000
_live_runs: weakref.WeakSet[Run] = weakref.WeakSet()


class _Timer:
    """Context manager returned by :meth:`Run.timer`."""

    __slots__ = ("_name", "_reduce", "_run", "_start", "_step", "seconds")

    def __init__(self, run: Run, name: str, step: int, reduce: str) -> None:
        self._run = run
        self._name = name
        self._step = step
        self._reduce = reduce
        self._start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> _Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
        self._run._sink.append(
            Timer(time.time(), self._step, self._name, self.seconds, self._reduce),
            step=self._step,
        )


class Run(RunValues):
    """One incarnation of one rank, appending events to its own segment files.

    Create it with :func:`ranklog.init`. Logging methods never perform I/O in
    the calling thread, except :meth:`step_end` at durability ``step`` (the
    step's bytes are handed to the OS before it returns) and ``fsync`` (and
    fsync'd). A disk error never raises out of a logging call.
    """

    def __init__(
        self,
        spool: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int | None,
        local_rank: int | None,
        durability: Durability,
        flush_interval: float,
        max_buffer_bytes: int,
        heartbeat_interval: float,
        max_segment_bytes: int,
        name: str | None,
        handle_signals: bool,
        gpu: Any = "off",
        gpu_interval: float = 10.0,
        host: str | None = None,
        redact: Iterable[str] = (),
        code: bool | None = None,
    ) -> None:
        if durability not in DURABILITY_LEVELS:
            raise ConfigError(f"durability must be one of {DURABILITY_LEVELS}, got {durability!r}")
        if flush_interval <= 0 or heartbeat_interval <= 0:
            raise ConfigError("flush_interval and heartbeat_interval must be positive")
        if max_buffer_bytes < 1024:
            raise ConfigError(f"max_buffer_bytes={max_buffer_bytes} is too small")
        if host is not None and (not isinstance(host, str) or not host.strip()):
            raise ConfigError(f"host must be a non-empty str, got {host!r}")
        self.spool = Path(spool)
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.durability: Durability = durability
        if isinstance(redact, str):
            redact = [redact]
        self._redactor = Redactor(redact)
        self.layout = SpoolLayout(self.spool)
        self.info = ensure_run(self.spool, name=name, world_size=world_size)
        self._host = host or socket.gethostname()
        self._gpu: Any = None
        self._gpu_lock = False
        self._claim: tuple[str, int] = (os.path.realpath(self.spool), rank)
        self._claim_fd = self._claim_rank(rank)
        writer: IncarnationWriter | None = None
        try:
            if gpu != "off":
                self._gpu = self._gpu_sampler(gpu, gpu_interval, local_rank)
            writer = IncarnationWriter.create(
                self.layout,
                self.info,
                rank,
                world_size=world_size,
                max_segment_bytes=max_segment_bytes,
            )
            self._sink: SpoolSink | DeadSink = SpoolSink(
                writer,
                flush_interval=flush_interval,
                max_buffer_bytes=max_buffer_bytes,
                heartbeat_interval=heartbeat_interval,
            )
        except BaseException:  # (no thread could start, a full disk): give everything back
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.abandon()
            self._stop_gpu()
            self._release_claim()
            raise
        self.incarnation = writer.incarnation
        self._sync_step = durability != "buffered"
        self._fsync = durability == "fsync"
        self._closed_step = -1
        self._next_step = 0  # the step a call is usually for (after step_end(S): S + 1)
        #: the step this rank is in, when a call found it by skipping steps (every 10th
        #: step logged); -1: not known; and the name its first value had (for the warning)
        self._in_step, self._in_name = -1, ""
        self._late_warned = False
        self._ahead_warned = False
        self._closed = False
        self._well = False  # a framework saw training end normally (_ended_well)
        self._names: dict[str | None, dict[str, str]] = {}
        self._timer_names: set[str] = set()
        self._book = NameBook(rank)
        self._ops: dict[object, str] = {}
        #: string specs of several ops (kept out of _ops): (the spec, names checked with it)
        self._several_ops: dict[str, tuple[str, set[str]]] = {}
        self._sink.append(
            RankStart(
                time.time(),
                self.info.run_id,
                rank,
                world_size,
                local_rank,
                self._host,
                os.getpid(),
                self.incarnation,
                __version__,
            )
        )
        if code is None:
            code = os.environ.get(CODE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
        if code and rank == 0:
            self._record_code()
        self._sink.flush(sync=self._fsync)
        _live_runs.add(self)
        if self._gpu is not None:
            self._gpu.start()
        atexit.register(self._atexit)
        _watch_uncaught()
        self._prev_handler: Any = None
        if handle_signals and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, OSError):
                self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _claim_rank(self, rank: int) -> int | None:
        """This host's claim on ``rank`` (see :mod:`._dupes`); ConfigError when a Run of
        this process, or another live process of this host, writes it."""
        if any(r._claim == self._claim for r in list(_live_runs)):
            raise ConfigError(
                f"rank {rank} of {self.spool} is already open in this process: log through "
                "that Run (ranklog.init returned it), or close() it first"
            )
        fd = claim_rank(self.layout, rank, self._host)
        elsewhere = other_host_writer(self.layout, rank, self._host)
        if elsewhere is not None:
            inc, pid, host = elsewhere
            warnings.warn(
                f"ranklog: rank {rank} was written in the last minute by pid {pid} on {host} "
                f"(incarnation {inc}, not ended): if that process still runs, two processes "
                "have the same rank id and their values mix; set RANK, or init(rank=...)",
                RanklogWarning,
                stacklevel=3,
            )
        running = running_writer(self.layout, rank, self._host)
        if running is not None:
            if fd is not None:
                os.close(fd)
            inc, pid, path = running
            raise ConfigError(
                f"rank {rank} is being written by pid {pid} on this host (incarnation {inc}, "
                f"{path}): two processes with the same rank id? set RANK, or init(rank=...)"
            )
        return fd

    def __repr__(self) -> str:
        return (
            f"<ranklog.Run spool={str(self.spool)!r} rank={self.rank} "
            f"world_size={self.world_size} incarnation={self.incarnation}>"
        )

    # -- identity ----------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        """The run id every rank of this spool shares."""
        return self.info.run_id

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    # -- logging -----------------------------------------------------------------------

    def log_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int,
        *,
        prefix: str | None = None,
        reduce: Reduce = "mean",
    ) -> None:
        """Log values for ``step``; across ranks each is reduced with ``reduce``.

        ``reduce`` is one op (``"mean"``), several (``("mean", "max")``, each
        shipped as ``name/op``) or a map from metric name to op(s). Raises
        TypeError naming the key for a value that is not a real number (nothing
        of the call is logged then), ValueError for a bad step.
        """
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            step = check_step(step)
        names = self._names.get(prefix)
        if names is None:
            names = self._names[prefix] = {}
        values: dict[str, float] = {}
        for key, value in metrics.items():
            name = names.get(key)
            if name is None:
                name = self._name(names, prefix, key)
            values[name] = value if type(value) is float else as_float(name, value)
        op = self._ops.get(reduce) if type(reduce) is str else None
        if op is None:  # (a spec of several ops: its new names are checked for derived ones)
            op = self._reduce(reduce, prefix, values)
        if step != self._next_step and self._next_step:  # (0: no step closed yet)
            self._off_step(step, next(iter(values), ""))
        self._sink.append_metrics(time.time(), step, values, op)

    def _name(self, names: dict[str, str], prefix: str | None, key: object) -> str:
        """The name ``key`` logs under with ``prefix``, checked once and then cached."""
        key = check_name("metric", key)
        name = check_name("metric", f"{prefix}/{key}" if prefix else key)
        self._book.logged(name)
        if len(names) < _NAME_CACHE_MAX:
            names[key] = name
        return name

    def _reduce(self, reduce: object, prefix: str | None, values: dict[str, float]) -> Any:
        """The op spec of a call; names a spec of several ops derives are noted."""
        if isinstance(reduce, Mapping):
            out: dict[str, str] = {}
            for key, ops in reduce.items():
                name = f"{prefix}/{key}" if prefix else str(key)
                out[name] = spec = op_spec(ops, what=f"reduce for {name!r}")
                if "," in spec and name in values:
                    self._book.several({name: 0.0}, spec)
            return out
        if not isinstance(reduce, str):
            several = op_spec(reduce)
            if "," in several:
                self._book.several(values, several)
            return several
        known = self._several_ops.get(reduce)
        if known is None:
            spec = op_spec(reduce)
            if "," not in spec:
                self._ops[reduce] = spec
                return spec
            known = self._several_ops[reduce] = (spec, set())
        spec, checked = known
        if not checked.issuperset(values):  # a name not yet checked with this spec
            self._book.several(values, spec)
            if len(checked) < _NAME_CACHE_MAX:
                checked.update(values)
        return spec

    def _off_step(self, step: int, name: str) -> None:
        """A value for a step other than the one a call is usually for: late (this rank
        closed it), the step it is in (steps need not be consecutive: a loop that logs and
        closes every 10th step), or ahead of that step (found ahead when a lower step
        comes after it, or is closed with step_end)."""
        if step <= self._closed_step:
            self._late(step)
        elif self._in_step < 0:  # the first value since step_end: the step the rank is in
            self._in_step, self._in_name, self._next_step = step, name, step
        elif step > self._in_step:
            self._ahead(name, step, self._in_step, stacklevel=4)
        else:  # what it logged before was ahead of this step
            self._ahead(self._in_name, self._in_step, step, stacklevel=4)
            self._in_step, self._in_name, self._next_step = step, name, step

    def _ahead(self, name: str, step: int, before: int, *, stacklevel: int) -> None:
        if self._ahead_warned:
            return
        self._ahead_warned = True
        warnings.warn(
            f"ranklog: rank {self.rank} logged {name!r} for step {step} ahead of step "
            f"{before}, which it closes first: the value waits in its step, which ships once "
            "step_end() closes it (or the rank ends); the steps before it ship as step_end() "
            "closes them",
            RanklogWarning,
            stacklevel=stacklevel,
        )

    def _late(self, step: int) -> None:
        if not self._late_warned:
            self._late_warned = True
            warnings.warn(
                f"ranklog: rank {self.rank} logged step {step} after closing step "
                f"{self._closed_step}; it is recorded and reported as late "
                "(and shipped by `ranklog ship --late ship`)",
                RanklogWarning,
                stacklevel=3,
            )

    def log_timing(self, name: str, seconds: float, step: int, *, reduce: str = "max") -> None:
        """Log a duration in seconds; reduced with ``max`` across ranks by default."""
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            step = check_step(step)
        if name not in self._timer_names:
            self._new_timer(name)
        if type(seconds) is not float:
            seconds = as_float(name, seconds)
        if step != self._next_step and self._next_step:
            self._off_step(step, name)
        self._sink.append(
            Timer(time.time(), step, name, seconds, self._timer_op(reduce)), step=step
        )

    def _timer_op(self, reduce: str) -> str:
        op = self._ops.get(reduce)
        if op is None:
            op = op_spec(reduce, what="timer reduce")
            self._ops[reduce] = op
        return op

    def timer(self, name: str, step: int, *, reduce: str = "max") -> _Timer:
        """Context manager timing its block with ``perf_counter`` and logging it for ``step``."""
        if name not in self._timer_names:
            self._new_timer(name)
        return _Timer(self, name, check_step(step), self._timer_op(reduce))

    def _new_timer(self, name: str) -> None:
        check_name("timer", name)
        self._book.timer(name)
        if len(self._timer_names) < _NAME_CACHE_MAX:  # bounded, as the metric names
            self._timer_names.add(name)

    def step_end(self, step: int) -> None:
        """Close every step up to ``step``: the shipper may reduce and ship them.

        At durability ``step`` the bytes are in the OS when this returns (a
        SIGKILL loses nothing up to here); at ``fsync`` they are also on disk.
        """
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            step = check_step(step)
        if step > self._closed_step:
            if self._in_step > step:  # what it logged since the last step_end was ahead
                self._ahead(self._in_name, self._in_step, step, stacklevel=3)
            self._closed_step = step
            self._next_step = step + 1
            self._in_step = -1
        else:
            self._late(step)
        self._sink.append_step_end(time.time(), step)
        if self._sync_step:
            self._sink.flush(sync=self._fsync)

    def flush(self) -> bool:
        """Write everything buffered now (fsync'd at durability ``fsync``)."""
        return self._sink.flush(sync=self._fsync)

    # -- closing -----------------------------------------------------------------------

    def close(self, status: str = "ok", exit_code: int | None = 0) -> None:
        """Write ``rank_end``, flush, seal and fsync. Idempotent; also runs at exit."""
        sink = self._detach("after close()")
        if sink is not None:
            try:
                sink.close(RankEnd(time.time(), status, exit_code))
            finally:
                self._release_claim()

    def _release_claim(self) -> None:
        """Let another process claim this rank (a relaunch)."""
        fd, self._claim_fd = self._claim_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _detach(self, why: str) -> SpoolSink | DeadSink | None:
        """Stop logging here (later calls warn ``why``); the sink to finish (None: done)."""
        if self._closed:
            return None
        self._closed = True
        _live_runs.discard(self)
        with contextlib.suppress(Exception):
            atexit.unregister(self._atexit)
        self._stop_gpu()
        sink, self._sink = self._sink, DeadSink(why)
        return sink

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("interrupted", 130)
        else:
            self.close("error", 1)

    def _ended_well(self) -> None:
        """A framework saw training end normally (Lightning's ``finalize("success")``, the
        Trainer's ``on_train_end``): a rank closed at exit then ends ``ok``, as a script's
        ``close()`` does, not ``exit`` (a script that just stopped)."""
        self._well = True

    def _atexit(self) -> None:
        died = _died_of()
        if died is None:
            if self._well:
                self.close()
            else:
                self.close("exit", None)
        elif issubclass(died, KeyboardInterrupt):
            self.close("interrupted", 130)
        else:
            self.close("error", 1)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        sink = self._sink
        if isinstance(sink, SpoolSink) and sink.busy_here():  # amid a write of this thread:
            sink.defer(lambda: self._on_sigterm(signum, frame))  # right after it, not in it
            return
        self.close("signal", 128 + signum)
        prev = self._prev_handler
        if callable(prev):
            prev(signum, frame)
        elif prev in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _gpu_sampler(self, gpu: Any, interval: float, local_rank: int | None) -> Any:
        """The GPU sampler of this host, if this process is the one that samples it."""
        from ranklog.producer._gpu import GpuSampler, elect_sampler, release_election

        if not elect_sampler(self.spool, self._host, local_rank):
            return None
        self._gpu_lock = local_rank is None
        try:
            return GpuSampler(self._append_gpu, source=gpu, interval=interval, host=self._host)
        except BaseException:
            if self._gpu_lock:
                release_election(self.spool, self._host)
            raise

    def _append_gpu(self, event: Gpu) -> None:
        self._sink.append(event, wait=False)

    def _stop_gpu(self) -> None:
        if self._gpu is None:
            return
        self._gpu.stop(timeout=1.0)
        self._gpu = None
        if self._gpu_lock:
            from ranklog.producer._gpu import release_election

            release_election(self.spool, self._host)

    def _crash(self) -> None:
        """End as a killed process would (see :func:`ranklog.testing.crash`)."""
        sink = self._detach("after a simulated crash")
        if isinstance(sink, SpoolSink):
            sink.abandon()
        self._release_claim()  # as the kernel does for a killed process

    def _forget_after_fork(self) -> None:
        """In a forked child: never touch the parent's files."""
        self._gpu = None  # the thread did not survive the fork; the lock is the parent's
        self._release_claim()  # the child's copy: the parent keeps its claim
        self._closed = True
        self._sink = DeadSink("from a forked child of a rank")
        with contextlib.suppress(Exception):
            atexit.unregister(self._atexit)


#: the type of the exception the program is dying of (set by :func:`_excepthook`)
_uncaught: type[BaseException] | None = None


def _excepthook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """Note the exception that ends the program, then print it as before."""
    global _uncaught
    _uncaught = tp
    _previous_hook(tp, value, tb)


_previous_hook = sys.excepthook


def _watch_uncaught() -> None:
    """Chain :func:`_excepthook` in front of ``sys.excepthook`` (once)."""
    global _previous_hook
    if sys.excepthook is not _excepthook:
        _previous_hook, sys.excepthook = sys.excepthook, _excepthook


def _died_of() -> type[BaseException] | None:
    """The exception the program ends with, if any.

    None in a REPL or IPython: an error there is printed and the session goes on. Else
    ``sys.excepthook`` tells; a hook installed after ours (rich's, say) hides it, and then
    ``sys.last_value``, which the interpreter sets when it prints an uncaught exception.
    """
    if hasattr(sys, "ps1") or "IPython" in sys.modules:
        return None
    if _uncaught is not None:
        return _uncaught
    last = getattr(sys, "last_value", None)
    return None if last is None else type(last)


def _after_fork_in_child() -> None:
    for run in list(_live_runs):
        run._forget_after_fork()
    _live_runs.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
