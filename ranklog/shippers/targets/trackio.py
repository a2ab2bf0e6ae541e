"""``trackio:PROJECT``: each reduced step written once to a run of a local trackio project.

trackio (Hugging Face's local-first tracker, ``pip install ranklog[trackio]``) keeps a
project in one SQLite file, ``<dir>/<project>.db``; ``trackio show --project PROJECT``
opens its dashboard on it. ``--dir`` is that directory (default: trackio's own,
``TRACKIO_DIR``, else ``$HF_HOME/trackio``, where ``trackio show`` looks).

Mapping:

- Run: one trackio run per ranklog run, its id the ranklog run id (``--run-id`` to
  write into another), named ``--run-name`` or the run's name, grouped ``--group`` or
  the run name (trackio keeps the group in the config's ``_Group``). Two runs of one name
  are two runs, as with ``trackio.init(name=...)``.
- Steps: one metrics row per step, ``step`` = the ranklog step, timestamp = the step's
  own event time. Names trackio reserves (``step``, ``time``, ``run``, ``project``,
  ``timestamp``, ``metrics``, and any starting ``__``) get ``__`` in front, as
  ``trackio.log`` renames them (said once per name).
- The slowest rank of a timer (``timing/<timer>/slowest_rank``): a ``trackio.Markdown``
  text per step, ``rank 3 (1.25 s)``, which the dashboard's smoothing cannot bend.
- Distributions: a ``trackio.Histogram`` (64 bins) per name. Texts: one ``samples``
  ``trackio.Table`` (columns ``rank``, ``name``, ``text``) per step, as the W&B target
  does; tables logged: a ``trackio.Table`` under their name (``name/rankNNNNN`` where
  ranks share it). Images: ``trackio.Image`` files under ``<dir>/media``. GPU series:
  ``gpu/<host>/<i>/utilization`` ... (TensorBoard's names: one ``gpu`` group).
- Hyperparameters: the run's config (dotted keys as ranklog holds them; a key starting
  ``_``, which trackio keeps for itself, as ``param_...``, said once); the config's
  ``_ranklog`` records the ranklog run and the names a replay wrote (``--names``).
- ``--per-rank``: one run per rank (id ``<run id>-rank00003``, name ``<name>-rank00003``,
  same group) with that rank's own values.
- Late values (``--late ship``): a row at their own step, after their carrier's.

Exactly once: every row carries a ``log_id`` made of the run id and the step
(``ranklog:<run id>:<step>``, ``...:late<carrier>`` for late values), which trackio's
schema keeps unique (``INSERT OR IGNORE``): a batch written again after a crash adds
nothing. ``open()`` reads the steps held back from those rows (a set: a replay that
fills a gap writes only the missing steps). Each ``write`` is one SQLite transaction
per run (trackio's own ``bulk_log``, under its process lock), the ranks' runs first,
so a step held by the main run is held everywhere; the config is written in its own
transaction before ``flush()`` returns, and ``flush()`` fsyncs the database and its WAL
(trackio commits without an fsync). trackio has no run status: ``end`` records
none. A database that is locked or busy is retried (:class:`TransientTargetError`); a
directory that cannot be written stops the shipper.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import re
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from ranklog._fs import atomic_write, fsync_dir, fsync_file
from ranklog.errors import ExtraMissingError, TargetError, TransientTargetError
from ranklog.schemas import ParamValue
from ranklog.shippers._held import ALL_NAMES, Holding, StepSet, refuse_other
from ranklog.shippers._registry import Option, TargetContext, TargetKind
from ranklog.shippers._target import ShippedStep
from ranklog.shippers.targets._media import (
    DIR_HELP,
    GPU_NAMES_OPTION,
    GROUP_HELP,
    RUN_ID_HELP,
    gpu_metrics,
    rank_tags,
)
from ranklog.spool import RunInfo

__all__ = ["RESERVED", "TARGET", "TrackioTarget", "log_id", "trackio_key"]

log = logging.getLogger("ranklog.ship")

#: metric names ``trackio.log`` renames to ``__<name>`` (and any that start with ``__``)
RESERVED: Final = frozenset({"project", "run", "timestamp", "step", "time", "metrics"})
#: the config key recording the ranklog run a trackio run holds
RUN_KEY: Final = "_ranklog"
_BINS: Final = 64
_SLOWEST: Final = "/slowest_rank"
_LATE: Final = re.compile(r"^ranklog:(.+):(\d+):late(\d+)$")
#: trackio reads its directory once, at import; targets of other directories swap it
_DIR_LOCK = threading.RLock()
#: projects whose place and ``trackio show`` command this process said
_SAID: set[str] = set()


def trackio_key(name: str) -> str:
    """The key trackio stores a ranklog name under (``trackio.log``'s renaming rule)."""
    return f"__{name}" if name in RESERVED or name.startswith("__") else name


def log_id(run_id: str, step: int, carrier: int | None = None) -> str:
    """The row id of one step of one trackio run (late values: with their carrier)."""
    return f"ranklog:{run_id}:{step}" + (f":late{carrier}" if carrier is not None else "")


def _trackio() -> Any:
    try:
        import trackio
    except ImportError:
        raise ExtraMissingError("trackio", "trackio") from None
    return trackio


@contextlib.contextmanager
def _storage(directory: Path, what: str) -> Iterator[Any]:
    """trackio's ``SQLiteStorage`` over ``directory``; its errors mapped for the engine."""
    ss: Any = importlib.import_module("trackio.sqlite_storage")
    with _DIR_LOCK:
        before = ss.TRACKIO_DIR
        ss.TRACKIO_DIR = directory
        try:
            yield ss.SQLiteStorage
        except sqlite3.OperationalError as exc:
            text = str(exc)
            if re.search(r"locked|busy|disk I/O|full", text):  # a full disk: retried
                raise TransientTargetError(f"trackio {what}: {text}") from exc
            raise TargetError(f"trackio {what} failed: {text} ({directory})") from exc
        except sqlite3.DatabaseError as exc:
            raise TargetError(f"trackio {what} failed: {exc} ({directory})") from exc
        finally:
            ss.TRACKIO_DIR = before


class TrackioTarget:
    """Writes reduced steps into one trackio run (and one run per rank with ``per_rank``)."""

    kind = "trackio"
    #: late values (``--late ship``) are handled: see :class:`~ranklog.shippers.Target`
    takes_late = True

    def __init__(
        self,
        project: str,
        directory: Path | None = None,
        *,
        spec: str | None = None,
        run_name: str | None = None,
        group: str | None = None,
        run_id: str | None = None,
        per_rank: bool = False,
        gpu_names: str = "ranklog",
        names: str = ALL_NAMES,
    ) -> None:
        trackio = _trackio()
        trackio.sqlite_storage.SQLiteStorage.validate_project_name(project)
        self.project = project
        self.spec = spec or f"trackio:{project}"
        self.dir = (directory or Path(trackio.utils.TRACKIO_DIR)).expanduser().absolute()
        self.run_name, self.group, self.given_run_id = run_name, group, run_id
        self.per_rank, self.gpu_names, self.names = per_rank, gpu_names, names
        canonical = trackio.utils.canonical_project_name(project)
        self.db = self.dir / f"{canonical}.db"
        self.run_id = ""
        self._name = ""
        self._group = ""
        self._created = ""
        self._config: dict[str, Any] = {}
        self._config_due = False
        self._ranks: set[int] = set()  # the rank runs whose config is written
        self._renamed: set[str] = set()

    # -- the Target protocol ------------------------------------------------------------

    def identity(self, run: RunInfo) -> str:
        """The project's database file (its real path) and the trackio run id."""
        return f"trackio:{os.path.realpath(self.db)}#run={self.given_run_id or run.run_id}"

    def open(self, run: RunInfo) -> StepSet:
        self.run_id = self.given_run_id or run.run_id
        self._name = self.run_name or run.name
        self._group = self.group or self._name
        self._created = datetime.fromtimestamp(run.created, UTC).isoformat()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TargetError(f"trackio: cannot create {self.dir}: {exc.strerror}") from exc
        with _storage(self.dir, "open") as storage:
            storage.init_db(self.project)
            with contextlib.closing(sqlite3.connect(self.db, timeout=30)) as conn:
                rows = conn.execute(
                    "SELECT step, log_id FROM metrics WHERE run_id = ?", (self.run_id,)
                ).fetchall()
                found = conn.execute(
                    "SELECT config FROM configs WHERE run_id = ?", (self.run_id,)
                ).fetchone()
        held = StepSet(int(s) for s, lid in rows if lid == log_id(self.run_id, int(s)))
        self._config = json.loads(found[0]) if found else {}
        mark = self._config.get(RUN_KEY)
        theirs = None
        if isinstance(mark, dict):
            theirs = Holding(str(mark.get("run_id")), str(mark.get("name", "")),
                             str(mark.get("names", ALL_NAMES)))  # fmt: skip
        elif rows:  # a run trackio itself wrote (--run-id): not one ranklog can add to
            theirs = Holding("(not written by ranklog)", self._name)
        mine = Holding(run.run_id, run.name, self.names)
        refuse_other(
            f"trackio run {self.run_id} of project {self.project!r} ({self.db})", theirs, mine,
            held, remedy="use another --run-id (without one, each ranklog run gets its own)",
        )  # fmt: skip
        if theirs != mine or not found:
            self._config_due = True
        self._config.update({
            RUN_KEY: {"run_id": run.run_id, "name": run.name, "names": self.names},
            "_Group": self._group, "_Created": self._config.get("_Created", self._created),
        })  # fmt: skip
        if self._config_due:
            self._write_config()
        self._say_where()
        return held

    def write_params(self, params: dict[str, ParamValue]) -> None:
        params = {self._param_key(k): v for k, v in params.items()}
        changed = {k: v for k, v in params.items() if self._config.get(k) != v}
        if changed:
            self._config.update(changed)
            self._config_due = True

    def write(self, steps: list[ShippedStep]) -> None:
        if not steps:
            return
        if self._config_due:
            self._write_config()
        if self.per_rank:
            for r in sorted({r for s in steps if s.per_rank for r in s.per_rank}):
                self._write_rank(r, steps)
        rows = [self._row(s) for s in steps]
        self._bulk(self.run_id, self._name, steps, rows)

    def flush(self) -> None:
        """The config, if it changed, is written; then the database on disk: trackio commits
        in WAL mode with ``synchronous=NORMAL``, which does not fsync a commit."""
        if self._config_due:
            self._write_config()
        for path in (self.db, self.db.with_name(self.db.name + "-wal")):
            with contextlib.suppress(FileNotFoundError):
                fsync_file(path)
        fsync_dir(self.dir)

    def close(self) -> None:
        """Nothing is held open: each write opened and committed its own transaction."""

    # -- helpers ------------------------------------------------------------------------

    def _row(self, s: ShippedStep) -> dict[str, Any]:
        """One step's values as ``trackio.log`` stores them (media turned into dicts)."""
        trackio = _trackio()
        row: dict[str, Any] = {self._key(k): v for k, v in s.metrics.items()}
        for name in [n for n in s.metrics if n.endswith(_SLOWEST)]:
            # a rank index is no quantity: smoothing would draw rank 2.6; a text per step
            rank, secs = s.metrics[name], s.metrics.get(name.removesuffix(_SLOWEST))
            who = f"rank {int(rank)}" if math.isfinite(rank) else f"rank {rank}"
            text = who if secs is None else f"{who} ({secs:.4g} s)"
            row[self._key(name)] = {"_type": "trackio.markdown", "_value": text}
        if s.gpu:
            style = "nemo" if self.gpu_names == "nemo" else "tensorboard"
            row.update((self._key(k), v) for k, v in gpu_metrics(s, style).items())
        for name, values in s.histograms.items():
            finite = [v for v in values if math.isfinite(v)]
            try:
                row[self._key(name)] = trackio.Histogram(finite, num_bins=_BINS)._to_dict()
            except ValueError as exc:  # numpy cannot bin a range near the float limits
                log.warning("%s: step %d: distribution %r not written: %s", self.spec,
                            s.step, name, exc)  # fmt: skip
        suffix = "" if s.carrier is None else f".late{s.carrier}"
        if s.texts:
            table = trackio.Table(
                columns=["rank", "name", "text"], data=[[t.rank, t.name, t.text] for t in s.texts]
            )
            row["samples" + suffix] = table._to_dict(self.project, self._name, s.step)
        for t, tag in zip(s.tables, rank_tags(s.tables), strict=True):
            table = trackio.Table(columns=list(t.columns), data=[list(r) for r in t.rows])
            row[self._key(tag + suffix)] = table._to_dict(self.project, self._name, s.step)
        for im, tag in zip(s.images, rank_tags(s.images), strict=True):
            row[self._key(tag + suffix)] = self._image(s.step, tag + suffix, im.data, im.format)
        return row

    def _image(self, step: int, name: str, data: bytes, fmt: str) -> dict[str, Any]:
        """An image file where ``trackio.Image`` puts one, named after its step and name
        (written again after a crash, the same file)."""
        trackio = _trackio()
        canonical = trackio.utils.canonical_project_name(self.project)
        rel = Path(canonical, self._name, str(step), re.sub(r"[^\w.-]", "_", name) + f".{fmt}")
        path = self.dir / "media" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)
        return {"_type": "trackio.image", "file_path": str(rel), "caption": name}

    def _param_key(self, name: str) -> str:
        """trackio keeps config keys that start with ``_`` for itself (``_Group``, ...; and
        ``_ranklog`` is ranklog's): such a param is ``param_Group``, said once."""
        if not name.startswith("_"):
            return name
        key = "param" + name
        if name not in self._renamed:
            self._renamed.add(name)
            log.warning("%s: param %r is a config key trackio keeps for itself: written as "
                        "%r", self.spec, name, key)  # fmt: skip
        return key

    def _key(self, name: str) -> str:
        key = trackio_key(name)
        if key != name and name not in self._renamed:
            self._renamed.add(name)
            log.warning("%s: %r is a name trackio reserves: written as %r (as trackio.log "
                        "renames it)", self.spec, name, key)  # fmt: skip
        return key

    def _write_rank(self, rank: int, steps: list[ShippedStep]) -> None:
        rid, name = f"{self.run_id}-rank{rank:05d}", f"{self._name}-rank{rank:05d}"
        if rank not in self._ranks:
            config = {"_Group": self._group, "_Created": self._created,
                      RUN_KEY: {**self._config[RUN_KEY], "rank": rank}}  # fmt: skip
            self._put_config(rid, name, config)
            self._ranks.add(rank)
        mine = [s for s in steps if s.per_rank and rank in s.per_rank]
        rows = [{self._key(k): v for k, v in (s.per_rank or {})[rank].items()} for s in mine]
        self._bulk(rid, name, mine, rows)

    def _bulk(
        self, rid: str, name: str, steps: list[ShippedStep], rows: list[dict[str, Any]]
    ) -> None:
        """One transaction: the rows of ``steps`` of run ``rid``, each under its log id."""
        if not rows:
            return
        now = datetime.now(UTC).timestamp()
        stamps = [datetime.fromtimestamp(s.ts if math.isfinite(s.ts) else now, UTC).isoformat()
                  for s in steps]  # fmt: skip
        with _storage(self.dir, "write") as storage:
            storage.bulk_log(
                project=self.project, run=name, run_id=rid, metrics_list=rows,
                steps=[s.step for s in steps], timestamps=stamps,
                log_ids=[log_id(rid, s.step, s.carrier) for s in steps],
            )  # fmt: skip

    def _write_config(self) -> None:
        self._put_config(self.run_id, self._name, self._config)
        self._config_due = False

    def _put_config(self, rid: str, name: str, config: dict[str, Any]) -> None:
        """The run's config, replaced whole, as ``bulk_log`` writes it (one transaction)."""
        body = json.dumps(_trackio().utils.serialize_values(config))
        # (open() made the tables)
        with (
            _storage(self.dir, "write_params") as storage,
            storage._get_process_lock(self.project),
            contextlib.closing(sqlite3.connect(self.db, timeout=30)) as conn,
            conn,
        ):
            conn.execute(
                "INSERT OR REPLACE INTO configs (run_id, run_name, config, created_at) "
                "VALUES (?, ?, ?, ?)", (rid, name, body, self._created),
            )  # fmt: skip

    def _say_where(self) -> None:
        """Once per process and project: where the run is, and how to look at it."""
        if str(self.db) in _SAID:
            return
        _SAID.add(str(self.db))
        env = "" if self.dir == Path(_trackio().utils.TRACKIO_DIR) else f"TRACKIO_DIR={self.dir} "
        log.info("%s: trackio run %r (id %s) in %s: see it with `%strackio show --project %s`",
                 self.spec, self._name, self.run_id, self.db, env, self.project)  # fmt: skip


def _build(arg: str, context: TargetContext, options: Mapping[str, Any]) -> TrackioTarget:
    _trackio()
    where = options.get("dir")
    try:
        return TrackioTarget(
            arg, Path(where) if where else None, spec=f"trackio:{arg}",
            run_name=options.get("run_name"), group=options.get("group"),
            run_id=options.get("run_id"), per_rank=context.per_rank,
            gpu_names=options.get("gpu_names") or "ranklog", names=context.names,
        )  # fmt: skip
    except ValueError as exc:  # a project name trackio refuses
        from ranklog.errors import ConfigError

        raise ConfigError(f"trackio:{arg}: {exc}") from None


TARGET = TargetKind(
    kind="trackio",
    arg="PROJECT",
    help="a run of a local trackio project (see it with `trackio show`)",
    build=_build,
    options=(
        Option("run_name", "the backend run's name (default: the spool's run name)"),
        Option("group", GROUP_HELP),
        Option("dir", DIR_HELP, metavar="DIR"),
        Option(
            "run_id",
            RUN_ID_HELP,
        ),
        GPU_NAMES_OPTION,
    ),
    extra="trackio",
)
