"""``tensorboard:DIR``: TensorBoard event files, written with the ``tensorboard`` package alone.

DIR is one TensorBoard run (``tensorboard --logdir`` DIR or a parent)::

    DIR/events.out.tfevents.<time>.<host>.<pid>.<n>     one file per shipper session
    DIR/events.out.tfevents.0000000000.ranklog.hparams  hparams session + experiment
    DIR/rank00003/events.out.tfevents.<...>              --per-rank: rank 3's own values

TFRecords (u64 length, masked CRC-32C, ``Event``, masked CRC-32C). A session file starts
with ``file_version`` and a ``SessionLog.START`` (message ``ranklog run <run_id>``). A step
is ONE record, ``Event(wall_time=ts, step=step)``: each reduced scalar a float32
``simple_value`` (NaN/inf kept; out of range: inf), each text a text-plugin string tensor
(markdown; several ranks' texts of one name share the tag, a block per rank: **rank R**),
each table a text-plugin Markdown table (``name/rankNNNNN`` where ranks share a name),
each ``timing/<timer>/slowest_rank`` a scalar series per rank, ``.../slowest_rank/rank00003``
= 3.0 at the steps rank 3 was slowest (smoothing would turn one series of rank indices
into fractions; a text per step is sampled, 100 a tag).

Hyperparameters: ``write_params`` appends a ``session_start_info`` (group ``--run-name``
or the run's name). Readers keep a tag's first metadata in a run, so the hparams file,
read first, is replaced (tmp, fsync, rename) whenever params or reduced metric names are
new, before the steps holding them: the latest session_start_info and the experiment
config (params as hparams, every reduced metric so far). It needs params.

Resume: ``open()`` reads this run's session files (another ranklog run's are an error,
other writers' ignored), cuts a torn last record off and reports the steps they hold (a
:class:`~ranklog.shippers.StepSet`: a windowed replay may leave gaps). A session's file
starts with ``SessionLog.START`` at its first step, and is named so that files sort in
step order (see :class:`_Run`): a reader's purge drops nothing and shows each step once;
rank sub-runs resume alike from their own files. Writes are unbuffered (one per batch and
run); ``flush()`` fsyncs.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import mmap
import os
import socket
import time
from collections.abc import Mapping
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from ranklog._fs import atomic_write, fsync_dir
from ranklog.errors import TargetError
from ranklog.schemas import ParamScalar, ParamValue
from ranklog.shippers._held import ALL_NAMES, Holding, StepSet, refuse_other
from ranklog.shippers._place import dir_place
from ranklog.shippers._registry import Option, TargetContext, TargetKind
from ranklog.shippers._target import ShippedStep
from ranklog.shippers.targets._media import GPU_NAMES_OPTION
from ranklog.shippers.targets._tb_values import (
    LATE_SOURCE,
    META_LENGTH,
    Scalars,
    event_record,
    hparam_value,
    media_values,
    meta_digest,
    meta_source,
    split_slowest,
    table_values,
    tb_protos,
    text_value,
    text_values,
)  # fmt: skip
from ranklog.shippers.targets._tfrecord import crc32c, records, spans
from ranklog.spool import RunInfo

if TYPE_CHECKING:
    pass

__all__ = ["HPARAMS_FILE", "TARGET", "TensorBoardTarget", "crc32c"]

log = logging.getLogger("ranklog.ship")

HPARAMS_FILE: Final = "events.out.tfevents.0000000000.ranklog.hparams"
_RUN_TAG: Final = "ranklog run "
_SSI_TAG: Final = "_hparams_/session_start_info"
_SSI_BYTES: Final = _SSI_TAG.encode()
_seq = count()


def _build(arg: str, context: TargetContext, options: Mapping[str, Any]) -> TensorBoardTarget:
    tb_protos()
    return TensorBoardTarget(
        Path(arg).expanduser(), per_rank=context.per_rank, name=options.get("run_name"),
        gpu_names=options.get("gpu_names") or "ranklog", names=context.names,
    )  # fmt: skip


TARGET = TargetKind(
    kind="tensorboard",
    arg="DIR",
    help="TensorBoard event files in DIR (one run; --per-rank adds DIR/rankNNNNN sub-runs)",
    build=_build,
    options=(
        Option("run_name", "the backend run's name (default: the spool's run name)"),
        GPU_NAMES_OPTION,
    ),
    extra="tensorboard",
    nemo_section="tensorboard",
    nemo_arg=lambda section, backend_dir: str(backend_dir),  # NeMo ignores tensorboard.log_dir
    nemo_options=lambda section, backend_dir: {"gpu_names": "nemo"},
)


class _File(NamedTuple):
    """One session file of a run: its name, the ranklog run it holds, its steps, and the
    digests of the run records it holds (:func:`meta_source`)."""

    name: str
    holding: Holding | None
    steps: StepSet
    metas: frozenset[str] = frozenset()


def _owner(msg: str) -> Holding | None:
    """The run a session's ``SessionLog`` message names: ``ranklog run ID``, then lines
    ``name=NAME`` (the run's name; absent in an older release's files) and
    ``names=GLOB`` (a replay's selection; absent: every name)."""
    if not msg.startswith(_RUN_TAG):
        return None
    run_id, *lines = msg[len(_RUN_TAG) :].split("\n")
    fields = dict(line.partition("=")[::2] for line in lines)
    return Holding(run_id, name=fields.get("name", ""), names=fields.get("names") or ALL_NAMES)


def _start_message(h: Holding) -> str:
    name = f"\nname={h.name}" if h.name and "\n" not in h.name else ""
    return _RUN_TAG + h.run_id + name + ("" if h.names == ALL_NAMES else f"\nnames={h.names}")


def _scan(path: Path) -> _File:
    """The run a session file holds and the steps of its records (its torn tail cut off).

    A step is held by a record of ranklog's own shape (``wall_time``, ``step``, then a
    summary), other than hparams' ``session_start_info`` and late values (held with their
    carrier's record, which follows them: late records after the last carrier are cut).
    Another writer's file (no ranklog ``SessionLog``) holds nothing.
    """
    event, holding, steps = tb_protos().event_pb2.Event, None, StepSet()
    metas: set[str] = set()
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else memoryview(b"") as mm:
            found = spans(mm, size)
            for a, b in found[:3]:
                if (owner := _owner(str(event.FromString(mm[a:b]).session_log.msg))) is not None:
                    holding = owner
                    break
            if holding is None:  # another writer's file: leave it alone
                return _File(path.name, None, steps)
            good = found[-1][1] + 4
            late_from = None  # the first late record after the last carrier
            for a, b in found:
                step = _step_of(mm, a, b)
                if step is None:
                    continue
                if mm[b - len(LATE_SOURCE) : b] == LATE_SOURCE:
                    late_from = a if late_from is None else late_from
                    continue
                if (digest := meta_digest(bytes(mm[max(a, b - META_LENGTH - 4) : b]))) is not None:
                    metas.add(digest)  # a run record (the code's text): no step
                    continue
                late_from = None
                steps.add(step)
            if late_from is not None:  # late values whose carrier never made it: cut
                good = late_from - 12
        if good < size:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
    return _File(path.name, holding, steps, frozenset(metas))


def _step_of(mm: Any, a: int, b: int) -> int | None:
    """The step of a record of ranklog's own shape holding a step, else None.

    ``Event{1: wall_time (fixed64), 2: step (varint), 5: summary}`` as :func:`event_record`
    writes it; a ``SessionLog``, the file version or ``session_start_info`` is no step.
    """
    if b - a < 12 or mm[a] != 0x09 or mm[a + 9] != 0x10:
        return None
    step, shift, i = 0, 0, a + 10
    while True:
        byte = mm[i]
        step |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            break
        shift += 7
    if i >= b or mm[i] != 0x2A:
        return None  # not a summary: a SessionLog (START) record
    if _SSI_BYTES in mm[i : min(b, i + 64)]:
        return None
    return int(step)


class _Run:
    """A TensorBoard run directory appended to: the main run or a rank's sub-run.

    Readers load a run's files in name order, and a ``SessionLog.START`` at step S drops
    what they loaded before it at steps >= S. So the steps of a run's files follow their
    names: a session that writes above every step the run holds starts a file named after
    the time (it sorts last); one that fills a gap below (a replay after a windowed one)
    starts a file named right after the file holding the steps below the gap, and a new
    file again where the gap ends.
    """

    def __init__(self, path: Path, mine: Holding, where: str) -> None:
        self.path, self.mine = path, mine
        self.fd: int | None = None
        self.ceiling: int | None = None  # the open file takes steps below this one only
        path.mkdir(parents=True, exist_ok=True)
        names = [p for p in sorted(path.glob("events.out.tfevents.*")) if p.name != HPARAMS_FILE]
        files = [_scan(p) for p in names if p.is_file()]
        self.files = [f for f in files if f.holding is not None and f.steps]
        #: digests of the run records this run's files hold (written once)
        self.metas = {d for f in files if f.holding is not None
                      and f.holding.run_id == mine.run_id for d in f.metas}  # fmt: skip
        # another ranklog run, or this one with another --names: named with every step it
        # holds across its files (a run written before and after a Ctrl-C is two files)
        held_by: dict[tuple[str, str], tuple[Holding, StepSet]] = {}
        for f in self.files:
            assert f.holding is not None
            key = (f.holding.run_id, f.holding.names)
            holding, steps = held_by.get(key, (f.holding, StepSet()))
            if not holding.name and f.holding.name:
                holding = f.holding
            held_by[key] = (holding, steps.union(f.steps))
        for holding, steps in held_by.values():
            refuse_other(
                where, holding, mine, steps,
                remedy="use another directory (TensorBoard shows each directory under "
                "--logdir as a run of its own)",
            )  # fmt: skip
        self.held = StepSet()
        for f in self.files:
            self.held = self.held.union(f.steps)
        stamps = [int(t) for p in names if (t := p.name.split(".")[3]).isdigit()]
        self.stamp = max(stamps, default=0)  # readers load files in name order: sort new ones last
        self._rotated: list[int] = []  # files this session closed, fsync'd by flush()
        #: records without a step, written before the next step record (or by flush())
        self._pending: list[bytes] = []

    def _name(self, first: int, now: float) -> str:
        """A new session file's name: after every file holding steps below ``first`` and
        before every one holding steps above it."""
        last = self.held.last
        if last is None or first > last:
            self.stamp = max(int(now), self.stamp + 1)
            return f"events.out.tfevents.{self.stamp:010d}.{socket.gethostname()}.{os.getpid()}"
        after = max((f.name for f in self.files if f.steps.below(first)), default=HPARAMS_FILE)
        return f"{after}.fill{first:012d}"

    def _start(self, first: int) -> bytes:
        """Open a new session file for steps from ``first``; its version and START records."""
        if self.fd is not None:
            self._rotated.append(self.fd)
            self.fd = None
        ev, now = tb_protos().event_pb2, time.time()
        log = ev.SessionLog(status=ev.SessionLog.START, msg=_start_message(self.mine))
        version = ev.Event(wall_time=now, file_version="brain.Event:2").SerializeToString()
        start = ev.Event(wall_time=now, step=first, session_log=log).SerializeToString()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        name = self._name(first, now)
        while self.fd is None:
            with contextlib.suppress(FileExistsError):
                full = f"{name}.{next(_seq)}"
                self.fd = os.open(self.path / full, flags, 0o644)
        fsync_dir(self.path)
        self.files.append(_File(full, self.mine, StepSet()))
        self.ceiling = self.held.after(first)
        return records([version, start])

    def append(self, recs: list[bytes], steps: list[int | None]) -> None:
        """Append records; ``steps``: the step each holds (None: no step of its own).

        A record without a step goes where the next step record goes (late values with
        their carrier); records with no step after them and no file open yet (a
        ``session_start_info``) wait for the next step record, or :meth:`flush`, so that
        a session's file is always opened for the step it starts with.
        """
        none: list[int | None] = [None] * len(self._pending)
        recs, steps = self._pending + recs, none + steps
        self._pending = []
        at: int | None = None
        eff: list[int | None] = [None] * len(steps)  # each record's own step, or its carrier's
        for k in range(len(steps) - 1, -1, -1):
            at = steps[k] if steps[k] is not None else at
            eff[k] = at
        if self.fd is None and at is None:
            self._pending = recs
            return
        i, n = 0, len(recs)
        while i < n:
            step, top = eff[i], self.ceiling
            if self.fd is None or (step is not None and top is not None and step >= top):
                last = self.held.last
                head = self._start(step if step is not None else 0 if last is None else last + 1)
                top = self.ceiling
            else:
                head = b""
            j = i + 1
            while j < n and (top is None or (e := eff[j]) is None or e < top):
                j += 1
            self._write(head + records(recs[i:j]))
            for s in steps[i:j]:
                if s is not None:
                    self.held.add(s)
                    self.files[-1].steps.add(s)
            i = j

    def _write(self, data: bytes) -> None:
        assert self.fd is not None
        view = memoryview(data)  # after a failed write the engine re-opens: the tail is cut
        while view:
            view = view[os.write(self.fd, view) :]

    def flush(self) -> None:
        """fsync what this session wrote (files it moved on from, then the open one)."""
        if self._pending:  # records with no step: a file of their own, after every step
            recs, self._pending = self._pending, []
            last = self.held.last
            self._write(self._start(0 if last is None else last + 1) + records(recs))
        for fd in self._rotated:
            os.fsync(fd)
            os.close(fd)
        self._rotated = []
        if self.fd is not None:
            os.fsync(self.fd)

    def close(self) -> None:
        """Close the files (not fsync'd: flush() does that)."""
        for fd in (*self._rotated, *([self.fd] if self.fd is not None else [])):
            os.close(fd)
        self._rotated, self.fd = [], None


class TensorBoardTarget:
    """Writes shipped steps as TensorBoard event files in one directory (see the module doc)."""

    kind = "tensorboard"
    #: late values (``--late ship``) are handled: see :class:`~ranklog.shippers.Target`
    takes_late = True

    def __init__(
        self, path: str | os.PathLike[str], *, per_rank: bool = False, name: str | None = None,
        gpu_names: str = "ranklog", names: str = ALL_NAMES,
    ) -> None:  # fmt: skip
        self.path, self.per_rank, self.name = Path(path), per_rank, name
        self.names = names
        self.gpu_names = gpu_names
        self.spec = f"tensorboard:{self.path}"
        self._run: RunInfo | None = None
        self._main: _Run | None = None
        self._ranks: dict[int, _Run] = {}
        self._templates: dict[tuple[bool, tuple[str, ...]], Scalars] = {}
        self._params: dict[str, ParamValue] = {}
        self._nulls: set[str] = set()  # params whose None value was said left out
        self._metrics: set[str] = set()
        self._mine = Holding("")

    def identity(self, run: RunInfo) -> str:
        """The directory's real path."""
        return f"tensorboard:{os.path.realpath(self.path.expanduser())}"

    def place(self, run: RunInfo) -> str | None:
        """The directory's device and inode (a bind mount is the same directory)."""
        return dir_place(self.path.expanduser())

    def open(self, run: RunInfo) -> StepSet:
        self._close_files()
        self._run, self._templates = run, {}
        self._mine = Holding(run.run_id, run.name, self.names)
        self._main = _Run(self.path, self._mine, str(self.path))
        self._params, self._metrics = self._load_hparams()
        return self._main.held.union(StepSet())  # a copy: the run's own set grows as it writes

    def write_params(self, params: dict[str, ParamValue]) -> None:
        main = self._require()
        self._params.update(params)
        if ssi := self._save_hparams():
            main.append([event_record(time.time(), 0, ssi)], [None])

    def write_meta(self, meta: dict[str, ParamScalar]) -> list[str]:
        """The code's git state as a text entry ``code/git`` at step 0 (Markdown, the diff in
        a code block). TensorBoard has no metric definitions or run summary: those keys
        are returned (left out, said once)."""
        from ranklog.shippers.targets._media import code_markdown

        main = self._require()
        if text := code_markdown(meta):
            digest = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:12]
            if digest not in main.metas:  # written before a crash, the cursor not committed
                value = text_value("code/git", text)
                main.append([event_record(time.time(), 0, value, source=meta_source(digest))],
                            [None])  # fmt: skip
                main.metas.add(digest)
        return [k for k in meta if not k.startswith("code/")]

    def write(self, steps: list[ShippedStep]) -> None:
        """One record per step and run; rank sub-runs are written first, each with one write."""
        main = self._require()
        todo: dict[_Run, tuple[list[bytes], list[int | None]]] = {}
        #: (step, record) of the main run's last step, written after the late values it
        #: carries: the file's last record is always the step held (open() reads it back)
        own: tuple[int, bytes] | None = None
        for s in steps:
            per_rank = s.per_rank if self.per_rank and s.carrier is None else None
            for rank, values in (per_rank or {}).items():
                sub = self._ranks.get(rank)
                if sub is None:
                    where = str(self.path / f"rank{rank:05d}")
                    sub = self._ranks[rank] = _Run(Path(where), self._mine, where)
                if s.step not in sub.held:
                    summary = self._pack(values, main=False)
                    recs, at = todo.setdefault(sub, ([], []))
                    recs.append(event_record(s.ts, s.step, summary))
                    at.append(s.step)
            held = s.step if s.carrier is None else s.carrier  # late values: with their carrier
            if held not in main.held:  # else held already (never sent)
                values, slowest = split_slowest(s.metrics)
                if s.gpu:
                    from ranklog.shippers.targets._media import gpu_metrics

                    style = "nemo" if self.gpu_names == "nemo" else "tensorboard"
                    started = self._run.created if self._run is not None else None
                    values = {**values, **gpu_metrics(s, style, started=started)}
                summary = self._pack(values, main=True) + (text_values(s.texts) if s.texts else b"")
                if slowest:  # not in the hparams' metrics: one tag per rank
                    summary += self._pack(slowest, main=False)
                if s.tables:
                    summary += table_values(s.tables)
                if s.histograms or s.images:
                    summary += media_values(s)
                recs, at = todo.setdefault(main, ([], []))
                if s.carrier is None:
                    if own is not None:
                        recs.append(own[1])
                        at.append(own[0])
                    own = (s.step, event_record(s.ts, s.step, summary))
                else:
                    if own is not None and own[0] != s.carrier:
                        recs.append(own[1])
                        at.append(own[0])
                        own = None
                    recs.append(event_record(s.ts, s.step, summary, late=True))
                    at.append(None)  # held with its carrier, whose record follows
                    if own is None:
                        # a carrier with nothing of its own: an empty record marks it held
                        own = (s.carrier, event_record(s.ts, s.carrier, b""))
        if own is not None:
            recs, at = todo[main]
            recs.append(own[1])
            at.append(own[0])
        for run in sorted(todo, key=lambda r: r is main):
            run.append(*todo[run])

    def _pack(self, values: dict[str, float], *, main: bool) -> bytes:
        key = (main, tuple(values))
        tmpl = self._templates.get(key)
        if tmpl is None:
            if len(self._templates) >= 256:  # bounded, whatever the names
                self._templates.clear()
            tmpl = self._templates[key] = Scalars(key[1])
            if main and not self._metrics.issuperset(key[1]):
                self._metrics.update(key[1])
                self._save_hparams()  # before the steps: the experiment lists all they hold
        return tmpl.pack(values.values())

    def flush(self) -> None:
        main = self._require()
        for sub in (*self._ranks.values(), main):
            sub.flush()

    def close(self) -> None:
        try:
            if self._main is not None:
                self.flush()
        finally:
            self._close_files()

    def _close_files(self) -> None:
        for sub in (*self._ranks.values(), self._main):
            if sub is not None:
                sub.close()
        self._main, self._ranks = None, {}

    def _require(self) -> _Run:
        if self._main is None:
            raise TargetError(f"{self.spec} is not open")
        return self._main

    def _save_hparams(self) -> bytes:
        """Replace the hparams file (version, session_start_info, experiment); the SSI summary."""
        if not self._params or self._run is None:
            return b""
        tb, run, infos = tb_protos(), self._run, []
        hp = tb.hparams_summary_v2
        # None as TensorBoard's own writer (SummaryWriter.add_hparams) takes it: left out,
        # the HParams dashboard has no null (said once per key; other backends keep it)
        values = {k: hparam_value(v) for k, v in sorted(self._params.items()) if v is not None}
        nulls = sorted(k for k, v in self._params.items() if v is None and k not in self._nulls)
        if nulls:
            self._nulls.update(nulls)
            log.info("%s: hyperparameters whose value is None left out of the HParams "
                     "dashboard, as SummaryWriter.add_hparams leaves them: %s", self.spec,
                     ", ".join(nulls[:10]) + (" ..." if len(nulls) > 10 else ""))  # fmt: skip
        if not values:
            return b""
        pb = hp.hparams_pb(values, trial_id=self.name or run.name, start_time_secs=run.created)
        for k, v in values.items():
            if isinstance(v, str | bool):
                domain = hp.Discrete([v])
            else:
                domain = hp.RealInterval(float(v), float(v)) if math.isfinite(v) else None
            infos.append(hp.HParam(k, domain))
        metrics = [hp.Metric(m) for m in sorted(self._metrics)]
        config = hp.hparams_config_pb(infos, metrics, run.created).SerializeToString()
        version = tb.event_pb2.Event(wall_time=run.created, file_version="brain.Event:2")
        ssi = bytes(pb.SerializeToString())
        data = (
            version.SerializeToString(),
            event_record(run.created, 0, ssi),
            event_record(run.created, 0, config),
        )
        atomic_write(self.path / HPARAMS_FILE, records(list(data)), mode=0o644)
        return ssi

    def _load_hparams(self) -> tuple[dict[str, ParamValue], set[str]]:
        """The params and metric names the hparams file lists (after a restart)."""
        params: dict[str, ParamValue] = {}
        metrics: set[str] = set()
        path, tb = self.path / HPARAMS_FILE, tb_protos()
        data = path.read_bytes() if path.is_file() else b""
        for a, b in spans(data, len(data)):
            for v in tb.event_pb2.Event.FromString(data[a:b]).summary.value:
                content = v.metadata.plugin_data.content
                if v.tag == _SSI_TAG:
                    info = tb.hparams_metadata.parse_session_start_info_plugin_data(content)
                    for k, val in info.hparams.items():
                        params[str(k)] = getattr(val, str(val.WhichOneof("kind")))
                elif v.tag == "_hparams_/experiment":
                    exp = tb.hparams_metadata.parse_experiment_plugin_data(content)
                    metrics.update(str(m.name.tag) for m in exp.metric_infos)
        return params, metrics
