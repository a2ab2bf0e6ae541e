"""``swanlab:PROJECT``: reduced steps into a SwanLab run, written offline for ``swanlab sync``.

SwanLab (``pip install ranklog[swanlab]``, the fourth backend of NeMo RL's logger) is
written in its ``offline`` mode, the one that needs no account and no network: each
session of a run is a folder ``<dir>/run-<time>-<id>`` holding a ``run-<id>.swanlab``
record file (and ``files/config.yaml``), which ``swanlab sync <dir>/run-*-<id>`` uploads
as one run (it resumes the run by its id). ``--dir`` is SwanLab's log directory (default
``SPOOL/swanlog``; NeMo RL: ``log_dir/swanlab``).

Mapping: one SwanLab run per ranklog run, its id the ranklog run id (``--run-id`` to
write another), named ``--run-name`` or the run's name, grouped ``--group``, tagged
``--tags``, described ``--notes``; params as the run's config (nested, as logged), with
``_ranklog`` (the ranklog run and the names a replay wrote); each step's values
``run.log(values, step=S)``; its texts ``swanlab.Text`` and its images (plots)
``swanlab.Image`` under their name (``name/rankNNNNN`` where ranks share it); GPU series
under TensorBoard's names (``--gpu-names nemo``: NeMo's ``ray/...``). Distributions are
not written (SwanLab has no histogram type; NeMo RL's SwanLab logger leaves them out too),
nor are tables (NeMo RL hands them to W&B only): each said once. Late values and
``--per-rank`` are not written (SwanLab's sessions cannot take them back once synced): the
engine leaves late values out with one warning, ``--per-rank`` is refused.

Exactly once: SwanLab writes its record file from a background thread and only
``finish()`` closes it, so nothing is durable before a session ends. ``write`` keeps the
steps; ``flush`` runs one session (``init``, ``log`` each step, ``finish``), reads the
new file back with SwanLab's own reader (``DataStoreReader``) until it holds every step
and the ``finish`` record, then fsyncs it: only then does the cursor move. ``open()``
reads the steps held from every finished session of the run; a session without its
``finish`` record (a shipper killed during it) is moved to ``<dir>/.torn/`` before
anything else is written, so that ``swanlab sync`` never uploads its part of a batch that
the next session writes whole (a Ctrl-C during a session: SwanLab's own handler finishes
it "aborted", and the steps it holds count as held). SwanLab's terminal capture is off
(``SWANLAB_TERMINAL_PROXY_TYPE=none``), and so are its probes (git, packages, hardware,
system monitor): they would describe the shipper's machine, not the job's. Sessions are
named ``run-<time>-<nnnn>-<id>`` (SwanLab's own names collide within a second).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple

from ranklog._fs import fsync_dir, fsync_file
from ranklog.errors import (
    ConfigError,
    ExtraMissingError,
    TargetError,
    TargetHeldError,
    TransientTargetError,
)
from ranklog.schemas import ParamValue
from ranklog.shippers._held import ALL_NAMES, Holding, StepSet, refuse_other
from ranklog.shippers._registry import Option, TargetContext, TargetKind
from ranklog.shippers._target import ShippedStep
from ranklog.shippers.targets._media import (
    DIR_HELP,
    GPU_NAMES_OPTION,
    GROUP_HELP,
    NOTES_HELP,
    RUN_ID_HELP,
    TAGS_HELP,
    gpu_metrics,
    rank_tags,
)
from ranklog.shippers.targets._wandb_config import nest
from ranklog.spool import RunInfo

__all__ = ["TARGET", "Session", "SwanlabTarget", "read_session", "record_file"]

log = logging.getLogger("ranklog.ship")

#: the config key recording the ranklog run a SwanLab run holds
RUN_KEY: Final = "_ranklog"
#: SwanLab's own keys (its system monitor), never ranklog's
_OWN: Final = "__swanlab__."
#: one SwanLab session at a time in a process: the package keeps one current run
_SESSION = threading.Lock()
_QUIET_ENV: Final = {"SWANLAB_TERMINAL_PROXY_TYPE": "none"}
#: runs whose folders and ``swanlab sync`` command this process said
_SAID: set[str] = set()


def _swanlab() -> Any:
    try:
        import swanlab
    except ImportError:
        raise ExtraMissingError("swanlab", "swanlab") from None
    return swanlab


class Session(NamedTuple):
    """What one session's record file holds, as SwanLab's reader reads it."""

    #: step -> {key: value}: numbers for scalars, the media files' names for texts, images
    steps: dict[int, dict[str, Any]]
    #: it ends with SwanLab's ``finish`` record (``finish()`` closed it)
    finished: bool
    #: the project its start record names ("" when it has none)
    project: str


def record_file(folder: Path) -> Path | None:
    """The session's record file (SwanLab names it after a sanitised run id: one per folder)."""
    found = sorted(folder.glob("run-*.swanlab"))
    return found[0] if len(found) == 1 else None


def read_session(path: Path) -> Session:
    """A session (its folder, or its record file), read with SwanLab's own reader.

    A torn tail ends the reading (SwanLab's reader stops at a bad checksum); a missing
    file, or one too short for its header, holds nothing.
    """
    record: Any = importlib.import_module("swanlab.proto.swanlab.record.v1.record_pb2")
    store: Any = importlib.import_module("swanlab.sdk.internal.core_python.store")
    steps: dict[int, dict[str, Any]] = {}
    finished, project = False, ""
    file = record_file(path) if path.is_dir() else path
    if file is None:
        return Session(steps, False, "")
    reader = store.DataStoreReader()
    try:
        reader.open(str(file))
    except (AssertionError, OSError, ValueError):
        return Session(steps, False, "")
    try:
        with contextlib.suppress(Exception):  # a torn or damaged tail: what came before
            for raw in reader:
                rec = record.Record()
                rec.ParseFromString(raw)
                if rec.HasField("scalar") and not rec.scalar.key.startswith(_OWN):
                    steps.setdefault(rec.scalar.step, {})[rec.scalar.key] = rec.scalar.value.number
                elif rec.HasField("media"):
                    files = [i.filename for i in rec.media.value.items]
                    steps.setdefault(rec.media.step, {})[rec.media.key] = files
                elif rec.HasField("start"):
                    project = rec.start.project
                elif rec.HasField("finish"):
                    finished = True
    finally:
        with contextlib.suppress(Exception):
            reader.close()
    return Session(steps, finished, project)


class SwanlabTarget:
    """Writes reduced steps into one SwanLab run, a finished offline session per flush."""

    kind = "swanlab"

    def __init__(
        self,
        project: str,
        directory: Path,
        *,
        spec: str | None = None,
        run_name: str | None = None,
        group: str | None = None,
        run_id: str | None = None,
        tags: list[str] | None = None,
        notes: str | None = None,
        gpu_names: str = "ranklog",
        names: str = ALL_NAMES,
    ) -> None:
        if not re.fullmatch(r"[0-9a-zA-Z_\-+.]{1,100}", project):
            raise ConfigError(f"swanlab:{project}: a SwanLab project is 1 to 100 of "
                              "A-Z a-z 0-9 _ - + . (no spaces)")  # fmt: skip
        self.project, self.dir = project, directory.expanduser().absolute()
        self.spec = spec or f"swanlab:{project}"
        self.run_name, self.group, self.given_run_id = run_name, group, run_id
        self.tags, self.notes, self.gpu_names, self.names = tags, notes, gpu_names, names
        self.run_id = ""
        self._name = ""
        self._config: dict[str, Any] = {}
        self._pending: list[ShippedStep] = []
        self._config_due = False
        self._said_histograms = self._said_tables = False

    # -- the Target protocol ------------------------------------------------------------

    def identity(self, run: RunInfo) -> str:
        """SwanLab's log directory (its real path), the project and the run id."""
        run_id = self.given_run_id or run.run_id
        return f"swanlab:{os.path.realpath(self.dir)}#project={self.project}&run={run_id}"

    def open(self, run: RunInfo) -> StepSet:
        _swanlab()
        self.run_id = self.given_run_id or run.run_id
        if re.search(r'[<>:"/\\|?*#%\x00-\x1f]', self.run_id):
            raise ConfigError(f"{self.spec}: {self.run_id!r} is no SwanLab run id")
        self._name = self.run_name or run.name
        self._pending = []
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TargetError(f"swanlab: cannot create {self.dir}: {exc.strerror}") from exc
        held: set[int] = set()
        finished: list[Path] = []
        for folder in self._sessions():
            session = read_session(folder)
            if not session.finished:
                self._set_aside(folder)
                continue
            if session.project and session.project != self.project:
                raise TargetHeldError(
                    f"SwanLab run {self.run_id} in {self.dir} belongs to project "
                    f"{session.project!r}, not {self.project!r}: use another --dir or --run-id"
                )
            held.update(session.steps)
            finished.append(folder)
        # the latest session's config (an earlier one's where it has none readable)
        config = next((c for f in reversed(finished) if (c := _read_config(f))), {})
        mark = config.get(RUN_KEY)
        theirs = None
        if isinstance(mark, dict):
            theirs = Holding(str(mark.get("run_id")), str(mark.get("name", "")),
                             str(mark.get("names", ALL_NAMES)))  # fmt: skip
        mine = Holding(run.run_id, run.name, self.names)
        refuse_other(
            f"SwanLab run {self.run_id} in {self.dir}", theirs, mine, StepSet(held),
            remedy="use another --run-id or --dir (without one, each ranklog run gets its own)",
        )  # fmt: skip
        self._config = {k: v for k, v in config.items() if k != RUN_KEY}
        self._config[RUN_KEY] = {"run_id": run.run_id, "name": run.name, "names": self.names}
        self._config_due = theirs != mine
        return StepSet(held)

    def write_params(self, params: dict[str, ParamValue]) -> None:
        nested = nest(params)
        if any(self._config.get(k) != v for k, v in nested.items()):
            _merge(self._config, nested)
            self._config_due = True

    def write(self, steps: list[ShippedStep]) -> None:
        """Kept until :meth:`flush`: SwanLab holds nothing durably before a session ends."""
        self._pending.extend(s for s in steps if s.carrier is None)

    def flush(self) -> None:
        """One SwanLab session with every step written since the last: init, log, finish,
        read back, fsync."""
        if not self._pending and not self._config_due:
            return
        swanlab = _swanlab()
        for name, value in _QUIET_ENV.items():
            os.environ.setdefault(name, value)
        with _SESSION:
            before = set(self._sessions())
            folder = self._next_folder(before)
            # nothing of the shipper's machine (git, packages, hardware): it is not the job's
            probe = dict.fromkeys(("hardware", "runtime", "requirements", "conda", "git",
                                   "monitor"), False)  # fmt: skip
            logged: dict[int, set[str]] = {}
            banner = io.StringIO()  # SwanLab's own lines: this target says where, once
            with contextlib.redirect_stdout(banner), tempfile.TemporaryDirectory() as tmp:
                run = _call("init", lambda: swanlab.init(
                    project=self.project, id=self.run_id, name=self._name, mode="offline",
                    logdir=str(self.dir), group=self.group or self._name,
                    tags=self.tags or None, description=self.notes or None,
                    config=self._config, reinit=True,
                    settings=swanlab.Settings(probe=probe, run={"dir": folder}),
                ))  # fmt: skip
                try:
                    for s in self._pending:
                        values = self._values(swanlab, s, Path(tmp))
                        if values:
                            _call("log", lambda v=values, st=s.step: run.log(v, step=st))
                            logged[s.step] = set(values)
                finally:
                    _call("finish", run.finish)
            new = [f for f in self._sessions() if f not in before]
        if len(new) != 1:
            raise TransientTargetError(f"swanlab wrote {len(new)} new sessions under "
                                       f"{self.dir}, not one")  # fmt: skip
        session = read_session(new[0])
        if not session.finished:
            self._set_aside(new[0])
            raise TransientTargetError(f"swanlab: {new[0]} lacks its finish record after finish()")
        for step, keys in logged.items():  # what SwanLab refused (it only says so itself)
            stored = set(session.steps.get(step, {}))  # SwanLab strips ' ./' at the ends
            dropped = {k for k in keys if k not in stored and k.strip(" ./") not in stored}
            if dropped:
                log.warning("%s: SwanLab did not keep %s at step %d (it refuses names with "
                            "control characters, or empty once ' ./' are stripped)", self.spec,
                            ", ".join(map(repr, sorted(dropped))), step)  # fmt: skip
        _fsync_tree(new[0])
        self._say_where(new[0])
        self._pending = []
        self._config_due = False

    def close(self) -> None:
        """Steps written and not flushed are dropped: the cursor never passed them."""
        self._pending = []

    # -- helpers ------------------------------------------------------------------------

    def _sessions(self) -> list[Path]:
        """This run's session folders, oldest first: ``run-<time>-<nnnn>-<id>`` (this
        target's) or ``run-<time>-<id>`` (SwanLab's own names)."""
        pattern = re.compile(r"run-\d{8}_\d{6}(?:-\d{4})?-" + re.escape(self.run_id))
        return sorted(p for p in self.dir.iterdir() if pattern.fullmatch(p.name) and p.is_dir())

    def _next_folder(self, existing: set[Path]) -> str:
        """A new session's folder name: ``run-<time>-<nnnn>-<id>``, nnnn above every
        session's (SwanLab's own names collide within a second; it would empty one)."""
        seq = [int(m.group(1)) for p in existing if (m := re.search(r"-(\d{4})-", p.name))]
        n = max(seq, default=0) + 1
        stamp = time.strftime("%Y%m%d_%H%M%S")
        while (self.dir / f"run-{stamp}-{n:04d}-{self.run_id}").exists():
            n += 1
        return f"run-{stamp}-{n:04d}-{self.run_id}"

    def _values(self, swanlab: Any, s: ShippedStep, tmp: Path) -> dict[str, Any]:
        """A step as ``run.log`` takes it: numbers, ``swanlab.Text``, ``swanlab.Image``."""
        values: dict[str, Any] = dict(s.metrics)
        if s.gpu:
            style = "nemo" if self.gpu_names == "nemo" else "tensorboard"
            values.update(gpu_metrics(s, style))
        if s.tables and not self._said_tables:
            self._said_tables = True
            log.warning("%s: tables (%s) are not written: SwanLab takes numbers, texts and "
                        "images (NeMo RL hands tables to W&B only)", self.spec,
                        ", ".join(sorted({t.name for t in s.tables})))  # fmt: skip
        if s.histograms and not self._said_histograms:
            self._said_histograms = True
            log.warning("%s: distributions (%s) are not written: SwanLab has no histogram "
                        "(NeMo RL's SwanLab logger leaves them out too); the other targets and "
                        "the Parquet dataset hold them", self.spec,
                        ", ".join(sorted(s.histograms)))  # fmt: skip
        media: dict[str, list[Any]] = {}  # a name a rank logged twice: a list under it
        for t, tag in zip(s.texts, rank_tags(s.texts), strict=True):  # type: ignore[arg-type]
            media.setdefault(tag, []).append(swanlab.Text(t.text))
        for i, (im, tag) in enumerate(zip(s.images, rank_tags(s.images), strict=True)):
            path = tmp / f"{s.step}-{i}.{im.format or 'png'}"  # a step is once in a session
            path.write_bytes(im.data)  # SwanLab copies it into the session's media folder
            media.setdefault(tag, []).append(swanlab.Image(str(path), caption=tag))
        for tag, items in media.items():
            key = tag
            if key in values:  # a text or plot named as a metric: SwanLab keeps one type a key
                key = f"{tag}/media"
                log.warning("%s: step %d has a metric and a text or image named %r: the "
                            "latter is written as %r", self.spec, s.step, tag, key)  # fmt: skip
            values[key] = items[0] if len(items) == 1 else items
        return values

    def _set_aside(self, folder: Path) -> None:
        """A session that did not finish: out of ``swanlab sync``'s way, kept for a look."""
        torn = self.dir / ".torn"
        torn.mkdir(exist_ok=True)
        to, n = torn / folder.name, 1
        while to.exists():
            to, n = torn / f"{folder.name}.{n}", n + 1
        os.replace(folder, to)
        log.warning("%s: SwanLab session %s did not finish (its shipper was stopped); moved "
                    "to %s, its steps are written again", self.spec, folder.name, torn)  # fmt: skip

    def _say_where(self, folder: Path) -> None:
        if self.run_id in _SAID:
            return
        _SAID.add(self.run_id)
        log.info("%s: SwanLab run %s is offline, in %s (one folder per session, one run): "
                 "upload it with `swanlab sync %s/run-*-%s` to see it (SwanLab's cloud or your "
                 "own server; `swanlab watch`, its deprecated local dashboard, reads only its "
                 "'local' mode's database, not offline runs)", self.spec, self.run_id, folder,
                 self.dir, self.run_id)  # fmt: skip


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _read_config(folder: Path) -> dict[str, Any] | None:
    """A session's config (``files/config.yaml``: ``{key: {value: ...}}``)."""
    yaml: Any = importlib.import_module("yaml")
    path = folder / "files" / "config.yaml"
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    return {k: v.get("value") if isinstance(v, dict) else v for k, v in raw.items()}


def _call(what: str, fn: Any) -> Any:
    """One call into SwanLab; what it refuses (a value, a setting) stops the shipper, one line."""
    try:
        return fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        raise TargetError(f"swanlab {what} failed: {exc}") from exc


def _fsync_tree(folder: Path) -> None:
    """Every file of a session, its folders, and the log directory, on disk."""
    for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):
        if path.is_file():
            fsync_file(path)
        else:
            fsync_dir(path)
    fsync_dir(folder)
    fsync_dir(folder.parent)


def _build(arg: str, context: TargetContext, options: Mapping[str, Any]) -> SwanlabTarget:
    _swanlab()
    if context.per_rank:
        raise ConfigError("swanlab: --per-rank is not supported (one SwanLab run per ranklog "
                          "run); use it with tensorboard, mlflow or wandb")  # fmt: skip
    where, tags = options.get("dir"), options.get("tags")
    return SwanlabTarget(
        arg, Path(where) if where else context.spool / "swanlog", spec=f"swanlab:{arg}",
        run_name=options.get("run_name"), group=options.get("group"),
        run_id=options.get("run_id"), notes=options.get("notes"),
        tags=[t for t in tags.split(",") if t] if tags else None,
        gpu_names=options.get("gpu_names") or "ranklog", names=context.names,
    )  # fmt: skip


TARGET = TargetKind(
    kind="swanlab",
    arg="PROJECT",
    help="a SwanLab run, offline, for `swanlab sync` (default dir: SPOOL/swanlog)",
    build=_build,
    options=(
        Option("run_name", "the backend run's name (default: the spool's run name)", nemo="name"),
        Option("group", GROUP_HELP),
        Option("dir", DIR_HELP, metavar="DIR"),
        Option(
            "run_id",
            RUN_ID_HELP,
        ),
        Option("tags", TAGS_HELP),
        Option("notes", NOTES_HELP),
        GPU_NAMES_OPTION,
    ),
    extra="swanlab",
    nemo_section="swanlab",
    nemo_arg=lambda section, backend_dir: str(section.get("project") or "nemo-rl"),
    nemo_options=lambda section, backend_dir: {"dir": str(backend_dir), "gpu_names": "nemo"},
)
