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
them, run records (metric definitions, summary values, the code's git state: see
docs/producer.md) one line ``{"meta": {"code/commit": "...", "summary/best": 0.9}}``.
Late values (``--late ship``) are a line of the step they were logged for, with
``"shipped_with": S`` last: the step they were shipped with, whose own line comes
right after them (``{"shipped_with": S}`` alone when S holds no values of its own).
NaN and infinities are written as the JSON extensions ``NaN``, ``Infinity`` and
``-Infinity`` (Python's ``json`` reads them back).

Which run the lines belong to is a line of its own, written before the first line of
a run in the file (and again before a run's lines that follow another run's, with
``--append-run``)::

    {"ranklog": {"run_id": "9f1c...", "name": "exp1", "names": "*"}}

``names`` is a replay's ``--names`` glob (``*``: every name). Lines before any such
line (written by an older ranklog) belong to the run the file's run lines name, if
they name one run or none, else to an unknown run.

On open the file is read back whole: the steps of this run it holds (a set: a windowed
replay followed by a wider one writes only the missing steps, appended after the lines
already there) and the params it holds (a params line carries only new or changed
values). A torn last line (a crash mid-write) is cut off, so the file stays valid JSONL.
Another run's lines refuse the file (:class:`~ranklog.errors.TargetHeldError`) unless
``--append-run``, given once: a run whose lines the file already holds beside another's
goes on without it; this run's lines written with another ``--names`` refuse it too.
A new file is created holding its run line (``link``: atomic, also on NFS), so two runs
starting on one new file never both write into it; a run that finds another one's lines
appended after its own (``--append-run``) writes its run line again before its next lines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import msgspec

from ranklog._fs import create_once
from ranklog._kept import Kept
from ranklog.errors import TargetError, TargetHeldError
from ranklog.schemas import META_PREFIX, ParamScalar, ParamValue
from ranklog.shippers._held import ALL_NAMES, Holding, StepSet, refuse_other
from ranklog.shippers._place import file_place
from ranklog.shippers._registry import TargetContext, TargetKind
from ranklog.shippers._target import ShippedStep
from ranklog.shippers.targets._media import summary
from ranklog.spool import RunInfo

__all__ = ["TARGET", "JsonlScan", "JsonlTarget", "read_jsonl", "scan_jsonl"]

log = logging.getLogger("ranklog.ship")

_TAIL = 1 << 20


#: one encoder for every line (``json.dumps`` with arguments builds one per call)
_ENCODE = json.JSONEncoder(separators=(", ", ": "), allow_nan=True).encode


def _line(obj: dict[str, Any]) -> bytes:
    return (_ENCODE(obj) + "\n").encode()


#: the names of a usual step (as shipped, in order) -> its line with ``%s`` in place of
#: each value (and ``%d`` of step, ranks and world size, ``%s`` of complete)
_FRAMES: Final[Kept[tuple[str, ...], bytes]] = Kept(100_000)


def _frame(names: tuple[str, ...]) -> bytes:
    """The line of a usual step of ``names``, its numbers left as ``%`` fields; each
    name as ``json`` writes it (escaped, ASCII)."""
    known = _FRAMES.get(names)
    if known is None:
        keys = ", ".join(_ENCODE(name).replace("%", "%%") + ": %s" for name in names)
        line = f'{{"step": %d, "metrics": {{{keys}}}, "ranks": %d, "world_size": %d, '
        known = _FRAMES.keep(names, (line + '"complete": %s}\n').encode())
    return known


def step_bytes(s: ShippedStep) -> bytes:
    """The line of a shipped step: the bytes of ``_line(step_line(s))``.

    A step of metrics only (the usual one) is written here: its values as one msgspec
    list, which formats a float as ``float.__repr__`` does (shortest round trip: most of
    ``json``'s time) but in exponent form, below 1e-4 and for NaN and infinities (then
    the line goes through ``json``, as any other step does), put into the line of its
    names (:func:`_frame`).
    """
    metrics = s.metrics
    if (
        s.texts or s.histograms or s.gpu or s.images or s.tables or s.per_rank is not None
        or s.carrier is not None or not metrics
    ):  # fmt: skip
        return _line(step_line(s))
    values = _ENCODE_FAST(list(metrics.values()))
    if b"e" in values or b"null" in values or b"0.0000" in values:
        return _line(step_line(s))  # (a value like 10.00001 comes here too: as correct)
    done = b"true" if s.complete else b"false"
    return _frame(tuple(metrics)) % (s.step, *values[1:-1].split(b","), s.ranks,
                                     s.world_size, done)  # fmt: skip


#: msgspec's JSON encoder (the usual step line: :func:`step_bytes`)
_ENCODE_FAST: Final = msgspec.json.Encoder().encode


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

    def __init__(
        self, path: str | os.PathLike[str], *, names: str = ALL_NAMES, append_run: bool = False
    ) -> None:
        self.path = Path(path)
        self.spec = f"jsonl:{self.path}"
        self.names, self.append_run = names, append_run
        self._fd: int | None = None
        #: the run line to write before this session's first line (None: not needed)
        self._run_line: bytes | None = None
        #: params this run's lines hold (a params line carries only what changed)
        self._params: dict[str, ParamValue] = {}
        self._mine = b""
        self._end = 0  # the file's size after this target's last append

    def identity(self, run: RunInfo) -> str:
        """The file's real path (links and ``..`` resolved as far as they exist)."""
        return f"jsonl:{os.path.realpath(self.path.expanduser())}"

    def place(self, run: RunInfo) -> str | None:
        """The file's device and inode (a hard link is the same file): made first, as
        :meth:`open` makes it."""
        try:
            self._make(run)
        except OSError:
            return None  # open() says why
        return file_place(self.path)

    def _make(self, run: RunInfo) -> Holding:
        """Create the file holding this run's line if it does not exist; this run's holding."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = Holding(run.run_id, run.name, self.names)
        _create(self.path, _line({"ranklog": _run_obj(mine)}))
        return mine

    def open(self, run: RunInfo) -> StepSet:
        """Cut a torn tail; read back which steps of ``run`` the file holds."""
        self.close()
        mine = self._make(run)
        fd = _open_ours(self.path)
        try:
            _repair(fd)
            scan = scan_jsonl(fd)
            # this run's lines already beside another run's: --append-run was given once
            # (or the other run followed this one with it): the run goes on without it
            shared = self.append_run or _key(mine) in scan.named
            for other, theirs in scan.others(mine):
                refuse_other(
                    str(self.path), other, mine, theirs, append=shared,
                    remedy="ship into another file, or add --append-run to write this run "
                    "after it",
                )  # fmt: skip
            if scan.adopts(mine):
                log.info("%s: its lines before any run line are taken as run %s's (an older "
                         "ranklog's file)", self.path, run.run_id)  # fmt: skip
            steps, params = scan.held_by(mine)
            self._end = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._params = fd, params
        self._mine = _line({"ranklog": _run_obj(mine)})
        self._run_line = None if scan.mine(mine) else self._mine
        return steps

    def write_params(self, params: dict[str, ParamValue]) -> None:
        new = {k: v for k, v in params.items() if not _same(self._params, k, v)}
        if new:
            self._write(_line({"params": new}))
            self._params.update(new)

    def write_meta(self, meta: dict[str, ParamScalar]) -> None:
        """Run records (definitions, summary values, the code's git state): a meta line."""
        new = {k: v for k, v in meta.items() if not _same(self._params, META_PREFIX + k, v)}
        if new:
            self._write(_line({"meta": new}))
            self._params.update({META_PREFIX + k: v for k, v in new.items()})

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
            data = step_bytes(s)
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
        if start != self._end:  # another process appended (--append-run): say whose follow
            self._run_line = self._mine
        if self._run_line is not None:  # this run's first line here: say whose lines follow
            data = self._run_line + data
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):  # open() cuts a torn last line anyway
                os.ftruncate(fd, start)
            raise
        self._run_line = None
        self._end = start + len(data)

    def flush(self) -> None:
        os.fsync(self._require())

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _require(self) -> int:
        if self._fd is None:
            raise TargetError(f"{self.spec} is not open")
        return self._fd


#: how every line ranklog writes into a JSONL target starts (older releases wrote no run
#: line: their files start with a step, params or meta line)
_OURS: Final = (b'{"ranklog": ', b'{"step": ', b'{"params": ', b'{"meta": ', b'{"shipped_with": ')


def _open_ours(path: Path) -> int:
    """Open ``path`` for appending if it is a file ranklog wrote (or an empty one).

    A file that is not ours (the user's JSON, a CSV, a device, a pipe) is refused,
    never "repaired": :class:`TargetHeldError`, nothing written. It is looked at before it
    is opened (opening a device may do something); an OSError (a file system's hiccup, or
    a permanent one) is the engine's to judge, as for any write.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise TargetHeldError(
            f"not a ranklog JSONL file: {path} is {what}; choose another path"
        )  # fmt: skip
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # (replaced between the two looks)
            raise TargetHeldError(f"not a ranklog JSONL file: {path}; choose another path")
        head = os.pread(fd, 64, 0)
        if head and not _starts_ours(head):
            raise TargetHeldError(
                f"not a ranklog JSONL file: {path} (its first line is not one ranklog "
                "writes); choose another path"
            )  # fmt: skip
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _starts_ours(head: bytes) -> bool:
    """Whether a file's first bytes start a line ranklog writes (a first line cut short by
    a crash while an older release wrote it counts: it is a start of one)."""
    first = head.split(b"\n", 1)[0]
    if len(first) < len(head):  # a whole first line: it starts like one of ours
        return first.startswith(_OURS)
    return any(head.startswith(p) or p.startswith(head) for p in _OURS)


def _create(path: Path, first: bytes) -> None:
    """Create ``path`` holding ``first`` (its run line) if it does not exist, atomically.

    Two runs shipping to one new file at once: one creates it with its run line, the
    other finds that line and is refused, never both writing their lines into it.
    """
    if not path.exists():
        create_once(path, first, mode=0o644)


def _repair(fd: int) -> None:
    """Cut a torn last line and an incomplete late group off the end of the file."""
    size = os.fstat(fd).st_size
    if not size:
        return
    start = max(0, size - _TAIL)
    data = os.pread(fd, size - start, start)
    held, keep = _last_held(data)
    if held is None and start > 0:  # no step line in the last MiB (rare: huge params)
        data, start = os.pread(fd, size, 0), 0
        held, keep = _last_held(data)
    if start + keep < size:
        os.ftruncate(fd, start + keep)
        os.fsync(fd)


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


def _run_obj(h: Holding) -> dict[str, str]:
    return {"run_id": h.run_id, "name": h.name, "names": h.names}


def _same(params: dict[str, ParamValue], key: str, value: ParamValue) -> bool:
    """Whether ``params`` already holds ``value`` for ``key`` (NaN equal to NaN)."""
    if key not in params:
        return False
    old = params[key]
    return old == value or (old != old and value != value)


_STEP = b'{"step": '
_CARRIER = b'{"shipped_with": '
_RUN = b'{"ranklog": '
_PARAMS = b'{"params": '
_META = b'{"meta": '
#: a line of late values ends with its carrier (a per-rank value's dict would end "}}")
_LATE = re.compile(rb', "shipped_with": -?\d+\}\Z')


class JsonlScan:
    """What a JSONL target file holds, run by run: steps, params, run lines."""

    def __init__(self) -> None:
        #: per run line (None: lines before any): the steps and params its lines hold
        self.steps: dict[Holding | None, StepSet] = {}
        self.params: dict[Holding | None, dict[str, ParamValue]] = {}
        #: the run of the file's last run line (None: no run line)
        self.last_run: Holding | None = None
        self.runs: set[str] = set()
        #: each holding (run id, names) as its last run line named it (for messages)
        self.named: dict[Holding, Holding] = {}

    @property
    def unnamed(self) -> bool:
        """Whether lines before any run line hold steps (a file of an older ranklog)."""
        return bool(self.steps.get(None))

    def adopts(self, mine: Holding) -> bool:
        """Whether unnamed lines count as ``mine``'s: the run lines name no other run."""
        return self.unnamed and self.runs <= {mine.run_id}

    def mine(self, mine: Holding) -> bool:
        """Whether the file's last run line is ``mine``'s (the next lines need no other)."""
        return self.last_run is not None and _key(self.last_run) == _key(mine)

    def held_by(self, mine: Holding) -> tuple[StepSet, dict[str, ParamValue]]:
        """The steps and params of ``mine`` (and of unnamed lines it adopts)."""
        keys: list[Holding | None] = [_key(mine), *([None] if self.adopts(mine) else [])]
        steps, params = StepSet(), dict[str, ParamValue]()
        for key in keys:
            steps = steps.union(self.steps.get(key, StepSet()))
            params.update(self.params.get(key, {}))
        return steps, params

    def others(self, mine: Holding) -> Iterator[tuple[Holding, StepSet]]:
        """Every other holding: another run (a run line is enough: its shipper may not have
        written a step yet), or this run's steps written with other names."""
        for key, steps in self.steps.items():
            if key is None:
                if steps and not self.adopts(mine):
                    yield Holding("(unknown: lines before any run line)"), steps
            elif key != _key(mine) and (steps or key.run_id != mine.run_id):
                yield self.named.get(key, key), steps


def _key(h: Holding) -> Holding:
    """What tells holdings apart: the run id and the names (not the run's display name)."""
    return Holding(h.run_id, "", h.names)


def scan_jsonl(source: int | str | os.PathLike[str]) -> JsonlScan:
    """Read a JSONL target file (a descriptor or a path) for what it holds, run by run."""
    out = JsonlScan()
    current: Holding | None = None
    steps = out.steps.setdefault(None, StepSet())
    for line in _lines(source):
        try:
            if line.startswith(_STEP):
                if not _LATE.search(line, len(line) - 48):  # late: held with their carrier
                    steps.add(int(line[len(_STEP) : line.index(b",", len(_STEP))]))
            elif line.startswith(_CARRIER):
                steps.add(int(line[len(_CARRIER) : line.index(b"}")]))
            elif line.startswith(_RUN):
                raw = json.loads(line)["ranklog"]
                named = Holding(str(raw["run_id"]), str(raw.get("name", "")),
                                str(raw.get("names", ALL_NAMES)))  # fmt: skip
                current = _key(named)
                out.runs.add(current.run_id)
                out.last_run = out.named[current] = named
                steps = out.steps.setdefault(current, StepSet())
            elif line.startswith(_PARAMS):
                out.params.setdefault(current, {}).update(json.loads(line)["params"])
            elif line.startswith(_META):
                meta = json.loads(line)["meta"]
                out.params.setdefault(current, {}).update(
                    {META_PREFIX + k: v for k, v in meta.items()}
                )
        except (ValueError, KeyError, TypeError):
            continue  # not a line of ours: ignored, as readers ignore it
    return out


def _lines(source: int | str | os.PathLike[str]) -> Iterator[bytes]:
    """The complete lines of a file, read in 4 MiB blocks."""
    fd = source if isinstance(source, int) else os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pos, rest = 0, b""
        while block := os.pread(fd, 4 << 20, pos):
            pos += len(block)
            parts = (rest + block).split(b"\n")
            rest = parts.pop()
            yield from parts
    finally:
        if not isinstance(source, int):
            os.close(fd)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete line of a JSONL target file, parsed."""
    out: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for raw in f:
            if raw.endswith(b"\n"):
                out.append(json.loads(raw))
    return out


def _build(arg: str, context: TargetContext, options: Mapping[str, Any]) -> JsonlTarget:
    return JsonlTarget(Path(arg).expanduser(), names=context.names, append_run=context.append_run)


TARGET = TargetKind(
    kind="jsonl",
    arg="PATH",
    help="one JSON line per shipped step, appended to PATH",
    build=_build,
)
