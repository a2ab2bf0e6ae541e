"""NeMo RL's ``nemo_rl.utils.timer``: Timer, ThreadSafeTimer, TimeoutChecker.

A NeMo program keeps its timing metrics: ``timer.get_timing_metrics(reduction_op="sum")``
gives the flat ``{label: seconds}`` dict NeMo logs under ``timing/train``, and
:func:`ranklog.nemo.install` makes ``nemo_rl.utils.timer`` resolve to this module.
Reductions are computed without numpy (``std`` is the population deviation, as numpy's).
Its DEBUG records (``start``, ``end elapsed=``, ``record elapsed=``, ``mark``) are NeMo's,
on NeMo's logger ``nemo_rl.utils.timer``, so ``NRL_LOG_LEVEL=DEBUG`` shows them.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import socket
import statistics
import sys
import threading
import time as _time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["ThreadSafeTimer", "TimeoutChecker", "Timer", "convert_to_seconds"]

#: NeMo RL's own name for these records (``nemo_rl/utils/timer.py``): the ``nemo_rl``
#: logger's level (``NRL_LOG_LEVEL``) and its users' handlers apply to them as to NeMo's
logger = logging.getLogger("nemo_rl.utils.timer")


def _std(values: Sequence[float]) -> float:
    return statistics.pstdev(values) if len(values) > 1 else 0.0


class Timer:
    """Named durations (``start``/``stop``, ``time()`` blocks, ``record``) and markers."""

    _REDUCTION_FUNCTIONS: dict[str, Callable[[Sequence[float]], float]] = {  # noqa: RUF012
        "mean": lambda v: math.fsum(v) / len(v),
        "median": statistics.median,
        "min": min,
        "max": max,
        "std": _std,
        "sum": math.fsum,
        "count": len,
    }

    def __init__(self, context: dict[str, object] | None = None) -> None:
        self._timers: dict[str, list[float]] = {}
        self._start_times: dict[str, float] = {}
        self._markers: dict[str, list[tuple[float, dict[str, Any] | None]]] = {}
        self._context: dict[str, object] = context if context is not None else {}
        self._context.setdefault("hostname", socket.gethostname())

    def _fmt(self, label: str, event: str) -> str:
        ts = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        ctx = " ".join(f"{k}={v}" for k, v in self._context.items())
        return f"[{ctx}] {label} {event} ts={ts}" if ctx else f"{label} {event} ts={ts}"

    def start(self, label: str, should_log: bool = True) -> None:
        """Start timing ``label`` (ValueError if it is running)."""
        if label in self._start_times:
            raise ValueError(f"Timer '{label}' is already running")
        self._start_times[label] = _time.perf_counter()
        if should_log:
            logger.debug(self._fmt(label, "start"))

    def stop(self, label: str, should_log: bool = True) -> float:
        """Stop timing ``label``; record and return the seconds it ran."""
        if label not in self._start_times:
            raise ValueError(
                f"Timer '{label}' is not running. Running times: {self._start_times.keys()}"
            )
        elapsed = _time.perf_counter() - self._start_times.pop(label)
        self._timers.setdefault(label, []).append(elapsed)
        if should_log:
            logger.debug(self._fmt(label, f"end elapsed={elapsed:.4f}s"))
        return elapsed

    def record(self, label: str, elapsed: float) -> None:
        """Record a duration measured elsewhere."""
        self._timers.setdefault(label, []).append(elapsed)
        logger.debug(self._fmt(label, f"record elapsed={elapsed:.4f}s"))

    def mark(self, label: str, metadata: dict[str, Any] | None = None) -> float:
        """Record that ``label`` happened now (epoch seconds, returned) with ``metadata``."""
        ts = _time.time()
        self._markers.setdefault(label, []).append((ts, metadata))
        logger.debug(self._fmt(label, f"mark meta={metadata}" if metadata else "mark"))
        return ts

    def get_markers(
        self, label: str | None = None
    ) -> dict[str, list[tuple[float, dict[str, Any] | None]]]:
        """Copies of the markers: all, or ``label``'s (empty when it has none)."""
        if label is not None:
            return {label: list(self._markers.get(label, []))}
        return {k: list(v) for k, v in self._markers.items()}

    @contextmanager
    def time(self, label: str, should_log: bool = True) -> Generator[None, None, None]:
        """Time the block (recorded even when it raises)."""
        self.start(label, should_log)
        try:
            yield
        finally:
            self.stop(label, should_log)

    def get_elapsed(self, label: str) -> list[float]:
        """Every duration of ``label`` (KeyError when none was recorded)."""
        if label not in self._timers:
            raise KeyError(f"No timings recorded for '{label}'")
        return self._timers[label]

    def get_latest_elapsed(self, label: str) -> float:
        """The last duration of ``label``."""
        values = self.get_elapsed(label)
        if not values:
            raise IndexError(f"No measurements recorded for '{label}'")
        return values[-1]

    def reduce(self, label: str, operation: str = "mean") -> float:
        """``label``'s durations reduced: mean, median, min, max, std, sum or count."""
        if operation not in self._REDUCTION_FUNCTIONS:
            valid = ", ".join(self._REDUCTION_FUNCTIONS)
            raise ValueError(f"Invalid operation '{operation}'. Valid options are: {valid}")
        return self._REDUCTION_FUNCTIONS[operation](self.get_elapsed(label))

    def get_timing_metrics(
        self, reduction_op: str | dict[str, str] = "mean"
    ) -> dict[str, float | list[float]]:
        """``{label: value}``: one op for all, or per label (an unknown op gives the list)."""
        if isinstance(reduction_op, str):
            return {label: self.reduce(label, reduction_op) for label in self._timers}
        out: dict[str, float | list[float]] = {}
        for label, values in self._timers.items():
            op = reduction_op.get(label)
            if op is not None and op in self._REDUCTION_FUNCTIONS:
                out[label] = self.reduce(label, op)
            else:
                out[label] = values
        return out

    def reset(self, label: str | None = None) -> None:
        """Forget ``label`` (durations, running start, markers), or everything."""
        if label:
            self._timers.pop(label, None)
            self._start_times.pop(label, None)
            self._markers.pop(label, None)
        else:
            self._timers.clear()
            self._start_times.clear()
            self._markers.clear()


class ThreadSafeTimer(Timer):
    """A :class:`Timer` whose methods hold one re-entrant lock."""

    def __init__(self, context: dict[str, object] | None = None) -> None:
        super().__init__(context)
        self._lock = threading.RLock()

    def start(self, label: str, should_log: bool = True) -> None:
        with self._lock:
            super().start(label, should_log)

    def stop(self, label: str, should_log: bool = True) -> float:
        with self._lock:
            return super().stop(label, should_log)

    def record(self, label: str, elapsed: float) -> None:
        with self._lock:
            super().record(label, elapsed)

    def mark(self, label: str, metadata: dict[str, Any] | None = None) -> float:
        with self._lock:
            return super().mark(label, metadata)

    def get_markers(
        self, label: str | None = None
    ) -> dict[str, list[tuple[float, dict[str, Any] | None]]]:
        with self._lock:
            return super().get_markers(label)

    def get_elapsed(self, label: str) -> list[float]:
        with self._lock:
            return super().get_elapsed(label)

    def get_latest_elapsed(self, label: str) -> float:
        with self._lock:
            return super().get_latest_elapsed(label)

    def reduce(self, label: str, operation: str = "mean") -> float:
        with self._lock:
            return super().reduce(label, operation)

    def get_timing_metrics(
        self, reduction_op: str | dict[str, str] = "mean"
    ) -> dict[str, float | list[float]]:
        with self._lock:
            return super().get_timing_metrics(reduction_op)

    def reset(self, label: str | None = None) -> None:
        with self._lock:
            super().reset(label)


def convert_to_seconds(time_string: str) -> int:
    """``"DD:HH:MM:SS"`` in seconds."""
    days, hours, minutes, seconds = (int(p) for p in time_string.split(":"))
    return days * 86400 + hours * 3600 + minutes * 60 + seconds


class TimeoutChecker:
    """Says once when a job must save: its time limit reached, or one more step won't fit."""

    def __init__(self, timeout: str | None = "00:03:45:00", fit_last_save_time: bool = False):
        self.last_save_time = convert_to_seconds(timeout) if timeout is not None else math.inf
        self.start_time = _time.time()
        self.last_saved = False
        self.iteration_times: list[float] = []
        self.previous_iteration_time: float | None = None
        self.fit_last_save_time = fit_last_save_time

    def check_save(self) -> bool:
        """True once: when the limit is reached (or would be, after one more mean step)."""
        sys.stdout.flush()
        sys.stderr.flush()
        if self.last_saved:
            return False
        elapsed = _time.time() - self.start_time
        if self.fit_last_save_time and self.iteration_times:
            mean = math.fsum(self.iteration_times) / len(self.iteration_times)
            if elapsed + mean >= self.last_save_time:
                self.last_saved = True
                return True
        if elapsed >= self.last_save_time:
            self.last_saved = True
            return True
        return False

    def start_iterations(self) -> None:
        """Start measuring steps."""
        self.previous_iteration_time = _time.time()

    def mark_iteration(self) -> None:
        """A step ended: record its duration."""
        sys.stdout.flush()
        sys.stderr.flush()
        now = _time.time()
        if self.previous_iteration_time is None:
            raise RuntimeError("mark_iteration() before start_iterations()")
        self.iteration_times.append(now - self.previous_iteration_time)
        self.previous_iteration_time = now
