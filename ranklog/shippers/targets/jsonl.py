"""``jsonl:PATH``: one JSON line per shipped step, in step order.

::

    {"step": 12, "metrics": {"train/loss": 0.41, "timing/step_time": 1.93},
     "ranks": 8, "world_size": 8, "complete": true}

Text events, when a step has some, are in ``"texts": [{"rank", "name", "text"}]``;
histograms as ``"histograms": {name: {count, min, max, mean, std}}`` of their finite
values (:func:`~ranklog.shippers.targets._media.summary`, as MLflow gets them) and images as
``"images": [{"rank", "name", "format", "bytes"}]`` (their contents stay in the spool),
tables as ``"tables": [{"rank", "name", "columns", "rows"}]``;
hyperparameters are one line ``{"params": {...}}`` before the step that follows
them. Late values (``--late ship``) are a line of the step they were logged for,
with ``"shipped_with": S`` last: the step they were shipped with, whose own line comes
right after them (``{"shipped_with": S}`` alone when S holds no values of its own).
NaN and infinities are written as the JSON extensions ``NaN``, ``Infinity`` and
``-Infinity`` (Python's ``json`` reads them back).

The last durable step is read back from the file itself; a torn last line (a
crash mid-write) is cut off on open, so the file stays valid JSONL.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ranklog.errors import TargetError
from ranklog.schemas import ParamValue
from ranklog.shippers._registry import TargetContext, TargetKind
from ranklog.shippers._target import ShippedStep
from ranklog.shippers.targets._media import summary
from ranklog.spool import RunInfo

__all__ = ["TARGET", "JsonlTarget", "read_jsonl"]

_TAIL = 1 << 20


#: one encoder for every line (``json.dumps`` with arguments builds one per call)
_ENCODE = json.JSONEncoder(separators=(", ", ": "), allow_nan=True).encode


def _line(obj: dict[str, Any]) -> bytes:
    return (_ENCODE(obj) + "\n").encode()


def step_line(s: ShippedStep) -> dict[str, Any]:
    """The JSONL object of a shipped step (key order is part of the format)."""
    obj: dict[str, Any] = {
        "step": s.step,
        "metrics": s.metrics,
        "ranks": s.ranks,
        "world_size": s.world_size,
        "complete": s.complete,
    }
    if s.texts:
        obj["texts"] = [{"rank": t.rank, "name": t.name, "text": t.text} for t in s.texts]
    if s.histograms:
        obj["histograms"] = {name: summary(v) for name, v in sorted(s.histograms.items())}
    if s.gpu:
        obj["gpu"] = [
            {"host": g.host, "index": g.index, "name": g.name, "util": g.util,
             "mem_used": g.mem_used, "mem_total": g.mem_total, "temp": g.temp,
             "power": g.power, "samples": g.samples}
            for g in s.gpu
        ]  # fmt: skip
    if s.images:
        obj["images"] = [
            {"rank": i.rank, "name": i.name, "format": i.format, "bytes": len(i.data)}
            for i in s.images
        ]
    if s.tables:
        obj["tables"] = [
            {"rank": t.rank, "name": t.name, "columns": t.columns, "rows": t.rows} for t in s.tables
        ]
    if s.per_rank is not None:
        obj["per_rank"] = {str(r): v for r, v in sorted(s.per_rank.items())}
    if s.carrier is not None:
        obj["shipped_with"] = s.carrier
    return obj


class JsonlTarget:
    """Appends one line per step to a file; durable after :meth:`flush` (fsync).

    Writes are unbuffered (one ``write`` per batch), so what a killed shipper
    wrote is exactly what the OS has.
    """

    kind = "jsonl"
    #: late values (``--late ship``) are handled: see :class:`~ranklog.shippers.Target`
    takes_late = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.spec = f"jsonl:{self.path}"
        self._fd: int | None = None

    def open(self, run: RunInfo) -> int | None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        last = _repair_and_last_step(self.path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o644)
        return last

    def write_params(self, params: dict[str, ParamValue]) -> None:
        self._write(_line({"params": params}))

    def write(self, steps: list[ShippedStep]) -> None:
        """One append of every line; a carrier's late lines go before the line that ends them.

        The engine sends a carrier step, then the late steps it carries. Here the late
        lines come first and the carrier's own line last (a ``{"shipped_with": T}`` line
        for a carrier with no values of its own), so a torn append can always be told
        apart on open: trailing late lines are an incomplete group, cut and sent again.
        """
        out: list[bytes] = []
        own: tuple[int, int] | None = None  # (step, index in out) of the last own line
        group: int | None = None  # carrier of late lines that still need their end line
        for s in steps:
            data = _line(step_line(s))
            if s.carrier is None:
                if group is not None:
                    out.append(_line({"shipped_with": group}))
                    group = None
                own = (s.step, len(out))
                out.append(data)
            elif own is not None and own[0] == s.carrier:
                out.insert(own[1], data)
                own = (own[0], own[1] + 1)
            else:
                if group is not None and group != s.carrier:
                    out.append(_line({"shipped_with": group}))
                group = s.carrier
                out.append(data)
        if group is not None:
            out.append(_line({"shipped_with": group}))
        self._write(b"".join(out))

    def _write(self, data: bytes) -> None:
        """Append ``data`` whole, or not at all (a failed write is truncated away)."""
        fd = self._require()
        start = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):  # open() cuts a torn last line anyway
                os.ftruncate(fd, start)
            raise

    def flush(self) -> None:
        os.fsync(self._require())

    def close(self) -> None:
        if self._fd is not None:
            try:
                self.flush()
            finally:
                os.close(self._fd)
                self._fd = None

    def _require(self) -> int:
        if self._fd is None:
            raise TargetError(f"{self.spec} is not open")
        return self._fd


def _repair_and_last_step(path: Path) -> int | None:
    """Cut a torn last line and an incomplete late group off ``path``; the last step held."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    with open(path, "r+b") as f:
        start = max(0, size - _TAIL)
        f.seek(start)
        data = f.read()
        held, keep = _last_held(data)
        if held is None and start > 0:  # no step line in the last MiB (rare: huge params)
            f.seek(0)
            data, start = f.read(), 0
            held, keep = _last_held(data)
        if start + keep < size:
            f.truncate(start + keep)
            f.flush()
            os.fsync(f.fileno())
    return held


def _last_held(data: bytes) -> tuple[int | None, int]:
    """(last step held, bytes of ``data`` to keep) of the end of a JSONL target file.

    A torn last line is dropped, and so are late lines (``step`` and ``shipped_with``) at
    the very end: the line that ends their carrier's group never made it, so the whole
    group counts as not written. A carrier's own line, or ``{"shipped_with": T}``, holds T.
    """
    keep = data.rfind(b"\n") + 1  # a torn last line (0: the only line in data) is dropped
    end = keep
    while end > 0:
        begin = data.rfind(b"\n", 0, end - 1) + 1
        try:
            obj = json.loads(data[begin:end])
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            step, carrier = obj.get("step"), obj.get("shipped_with")
            if isinstance(step, int) and carrier is not None:  # late: its group is cut
                keep = begin
            elif isinstance(step, int):
                return step, keep
            elif isinstance(carrier, int):
                return carrier, keep
        end = begin
    return None, keep


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete line of a JSONL target file, parsed."""
    out: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for raw in f:
            if raw.endswith(b"\n"):
                out.append(json.loads(raw))
    return out


def _build(arg: str, context: TargetContext, options: Mapping[str, Any]) -> JsonlTarget:
    return JsonlTarget(Path(arg).expanduser())


TARGET = TargetKind(
    kind="jsonl",
    arg="PATH",
    help="one JSON line per shipped step, appended to PATH",
    build=_build,
)
