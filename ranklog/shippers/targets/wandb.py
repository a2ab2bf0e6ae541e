"""``wandb:PROJECT``: each reduced step logged once to a Weights & Biases run.

Mapping: one W&B run per ranklog run, with a stable id (the first 16 hex digits
of the ranklog run id), name ``--run-name`` or the run's name, group ``--group``
or the run's name. Hyperparameters go to ``run.config`` (``allow_val_change``);
each shipped step is one ``run.log(metrics, step=S, commit=True)``; a step's text
events are a ``wandb.Table(columns=["rank", "name", "text"])`` under ``samples``, and
each table logged is a ``wandb.Table`` under its name (``name/rankNNNNN`` where ranks
share it).
With ``--per-rank`` every rank also gets its own run (id ``<id>r<rank:05d>``,
name ``rank00003``, same group, ``job_type="rank"``): W&B's "one run per
process, grouped" pattern. wandb is imported only when a target is made.

GPU series: a step's GPU statistics (``<host>/gpu.<i>.gpu``, ``.memoryAllocatedBytes``,
``.temp``, ``.powerWatts``, ``gpu.all.gpu``, ``gpu.all.memoryAllocatedBytesMax``) go into
the same row as the step's metrics, with their own X axis :data:`GPU_STEP`
(``gpu/runtime``): the step's time (its latest event, as the ranks stamped it) in
seconds since the ranklog run was created. W&B's own ``_runtime``/``_timestamp``
are the shipper's clock, wrong for a shipper that lags, restarts or replays; the
events' time is the same in every replay. Before the first row that carries a host's
GPUs, each W&B run session gets ``define_metric`` records: ``gpu/runtime`` (hidden),
a glob ``<host>/gpu.*`` (and ``gpu.all.*``) with ``step_metric="gpu/runtime"``, and
per key a summary (``max`` for memory and temperature, ``mean`` for utilisation and
power) under the key's name with its dots escaped: wandb-core splits a defined
name at unescaped dots when it configures the summary (``runmetric.go``,
``splitEscapedDottedMetricName``), so a glob's or a plain name's summary never
reaches a dotted key. A run started again (offline restart, online resume) is
given the definitions again before its first GPU row; they are identical, so
harmless. Per-rank runs carry no GPU series and get no definitions.

Modes: ``--mode offline`` writes the run directories under ``--dir`` (default:
the spool) for a later ``wandb sync``; ``online`` talks to the server. The
default is online only when an API key is configured (``WANDB_MODE`` is honoured).

Durability point (offline): wandb's service process writes the run's ``.wandb``
transaction log on a timer (``x_transaction_log_flush_interval``, set here to
50 ms). :meth:`WandbTarget.flush` returns only once its own reader
(:mod:`ranklog.shippers.targets._wandb_log`) sees the last logged step and the latest
config in that file, then fsyncs it: a SIGKILL, or a node crash, after
``flush()`` loses nothing. Should the file not show them within 10 s (another
wandb version), the run is finished instead (``finish()`` writes and closes the
log) and started again at the next write. Online, ``flush()`` finishes the
runs, which returns once the server has the data; they are resumed
(``resume="allow"``) at the next write: slow, but the server then holds it.

Offline resume rule: wandb ignores ``resume=`` offline and starts a new
``offline-run-*-<id>`` directory at every ``init``, so :meth:`WandbTarget.open`
reads every ``.wandb`` file of the run's id under ``<dir>/wandb`` and returns
the steps they hold (with ``--per-rank``, those every rank's run holds). Each
run then logs only steps above the highest its own files hold, so W&B never
sees a step at or below its current one (it would drop it with a warning):
steps below it are left out or refused (``--below-last``). Before
reading, runs left open in this process by a dead target are finished and
processes still writing those files are waited for, so nothing lands after
the read; the target runs its own wandb-core (a ``WANDB_SERVICE`` inherited
from another process is dropped), which exits soon after a killed shipper.
Online, the step comes from the resumed run (``starting_step``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import netrc
import os
import re
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from ranklog.errors import TargetError, TransientTargetError
from ranklog.schemas import ParamScalar, ParamValue
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
)
from ranklog.shippers.targets._wandb_config import (
    META_KEY,
    RUN_KEY,
    config_set,
    flat_params,
    nest,
    scan_offline,
)
from ranklog.shippers.targets._wandb_log import LogReader, fsync_log, writers
from ranklog.shippers.targets._wandb_media import (
    GPU_STEP,
    NEMO_GPU_DEFINITIONS,
    MetricDef,
    gpu_definitions,
    media_values,
)
from ranklog.shippers.targets._wandb_media import wandb_module as _wandb
from ranklog.shippers.targets._wandb_meta import SUMMARY, WandbRecords, meta_of
from ranklog.spool import RunInfo

__all__ = [
    "GPU_STEP", "RUN_KEY", "TARGET", "MetricDef", "WandbTarget", "gpu_definitions", "scan_offline",
    "wandb_run_id",
]  # fmt: skip

log = logging.getLogger("ranklog.ship")

#: how often wandb-core writes its transaction log (seconds)
FLUSH_INTERVAL: Final = 0.05
#: how long flush() waits to see the data in the log before finishing the run instead
FLUSH_WAIT: Final = 10.0
#: how long open() waits for another process to stop writing this run's logs
WRITER_WAIT: Final = 10.0
_QUIET: Final = {
    "silent": True, "console": "off", "x_disable_stats": True, "x_disable_meta": True,
    "x_disable_machine_info": True, "disable_git": True, "disable_code": True,
    "save_code": False, "x_transaction_log_flush_interval": FLUSH_INTERVAL,
    "reinit": "create_new",
}  # fmt: skip
#: W&B runs of this process, by (root, id): a target that died leaves its runs here
_LIVE: dict[tuple[str, str], Any] = {}
#: offline runs whose folder and ``wandb sync`` command this process said
_SAID: set[str] = set()


def _build(arg: str, context: TargetContext, options: Mapping[str, Any]) -> WandbTarget:
    _wandb()
    where, tags = options.get("dir"), options.get("tags")
    return WandbTarget(
        arg, Path(where).expanduser() if where else context.spool, entity=options.get("entity"),
        run_name=options.get("run_name"), group=options.get("group"), mode=options.get("mode"),
        per_rank=context.per_rank, run_id=options.get("run_id"), resume=options.get("resume"),
        tags=[t for t in tags.split(",") if t] if tags else None, notes=options.get("notes"),
        gpu_names=options.get("gpu_names") or "ranklog", names=context.names,
    )  # fmt: skip


TARGET = TargetKind(
    kind="wandb",
    arg="PROJECT",
    help="a W&B run in PROJECT (offline unless an API key is configured)",
    build=_build,
    options=(
        Option("run_name", "the backend run's name (default: the spool's run name)", nemo="name"),
        Option("entity", "W&B entity (default: W&B's, from its settings)", nemo="entity"),
        Option("group", GROUP_HELP, nemo="group"),
        Option(
            "mode",
            "W&B mode (default: WANDB_MODE, else online with an API key configured, else offline)",
            choices=("online", "offline"),
            nemo="mode",
        ),
        Option("dir", DIR_HELP, metavar="DIR"),
        Option(
            "run_id",
            RUN_ID_HELP,
            nemo="id",
        ),
        Option(
            "resume",
            "W&B resume mode (default: W&B's)",
            choices=("allow", "must", "never", "auto"),
            nemo="resume",
        ),
        Option("tags", TAGS_HELP, nemo="tags"),
        Option("notes", NOTES_HELP, nemo="notes"),
        GPU_NAMES_OPTION,
    ),
    extra="wandb",
    nemo_section="wandb",
    nemo_arg=lambda section, backend_dir: str(section.get("project") or "nemo-rl"),
    nemo_options=lambda section, backend_dir: {"dir": str(backend_dir), "gpu_names": "nemo"},
)


def default_mode() -> str:
    """``offline`` unless ``WANDB_MODE`` says online or an API key is configured."""
    env = os.environ.get("WANDB_MODE", "")
    if env in ("offline", "dryrun", "online", "run"):
        return "offline" if env in ("offline", "dryrun") else "online"
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online"
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        auth = netrc.netrc(os.environ.get("NETRC")).authenticators(host.hostname or "")
    except (OSError, netrc.NetrcParseError):
        auth = None
    return "online" if auth and auth[2] else "offline"


def wandb_run_id(ranklog_run_id: str, rank: int | None = None) -> str:
    """The W&B run id of a ranklog run (``rank``: of that rank's own run)."""
    base = re.sub(r"[^0-9a-zA-Z]", "", ranklog_run_id)[:16]
    return base if rank is None else f"{base}r{rank:05d}"


class _Held:
    """One W&B run of the target: the live Run (or None) and what its log holds."""

    def __init__(self, wid: str, rank: int | None, durable: int) -> None:
        self.wid, self.rank = wid, rank
        self.run: Any = None
        self.reader: LogReader | None = None
        self.durable = self.sent = durable  # highest step durable / logged
        self.logged = -1  # highest step logged through the live run (this session)
        self.seen = -1  # highest step the live run's own log shows
        self.config_wait: dict[str, Any] = {}
        #: define_metric names already given to the live run (a new run needs them again),
        #: and the GPU keys they cover
        self.defined: set[str] = set()
        self.gpu_keys: set[str] = set()


class WandbTarget(WandbRecords):
    """Logs shipped steps to W&B runs; durable after :meth:`flush` (see the module docstring)."""

    kind = "wandb"
    #: whether ``open`` could tell which steps the run holds (set by it; see Target)
    held_known = True
    #: late values (``--late ship``) are handled: see :class:`~ranklog.shippers.Target`
    takes_late = True
    #: W&B drops a step below the run's current one: the engine refuses to send one
    steps_in_order = True

    def __init__(
        self, project: str, dir: str | os.PathLike[str], *, entity: str | None = None,
        run_name: str | None = None, group: str | None = None, mode: str | None = None,
        per_rank: bool = False, run_id: str | None = None, resume: str | None = None,
        tags: list[str] | None = None, notes: str | None = None, gpu_names: str = "ranklog",
        names: str = ALL_NAMES,
    ) -> None:  # fmt: skip
        self.project, self.root = project, Path(dir).absolute()
        self.entity, self.run_name, self.group = entity, run_name, group
        self.mode = mode or default_mode()
        self.per_rank = per_rank
        #: W&B's run id (default: derived from the ranklog run id), how to resume it
        self.run_id, self.resume = run_id, resume
        self.tags, self.notes = tags, notes
        self.gpu_names = gpu_names
        self.names = names
        self.spec = f"wandb:{project}"
        self._run: RunInfo | None = None
        self._held: dict[int | None, _Held] = {}
        self._late_warned = False
        self._config: dict[str, Any] = {}  # every param known: passed to each new init
        #: run records known (docs/producer.md), but the diff: kept in the config (META_KEY)
        #: so each new session (and a restarted shipper) gives them to W&B again
        self._meta: dict[str, ParamScalar] = {}
        self._exit_code: int | None = None  # how the job ended (end()): finish() says so

    # -- open -------------------------------------------------------------------------

    def identity(self, run: RunInfo) -> str:
        """entity/project/run id (and, offline, the real path of the files' directory)."""
        where = "" if self.mode == "online" else f"@{os.path.realpath(self.root)}"
        return f"wandb:{self.entity or ''}/{self.project}/{self._base(run)}{where}"

    def open(self, run: RunInfo) -> StepSet:
        self._run, self._held = run, {}
        self._exit_code = None
        base = self._base(run)
        for key in [k for k in _LIVE if k[0] == str(self.root) and k[1].startswith(base)]:
            with contextlib.suppress(Exception):  # a run a dead target of this process left
                _LIVE.pop(key).finish()
        if self.mode == "online":
            main = self._held[None] = _Held(base, None, -1)
            self._start(main)
            # the server says how far the run got, not of its per-rank runs: beyond that
            # it cannot be told what this run holds (no check against the cursor)
            self.held_known = not (self.per_rank or main.durable < 0)
            return StepSet.upto(None if self.per_rank or main.durable < 0 else main.durable)
        self.held_known = True
        self._wait_forwriters(base)
        mark: dict[str, Any] = {}
        steps, self._config = scan_offline(self.root, base, mark)
        self._meta = meta_of(self._config.pop(META_KEY, None))
        theirs = Holding(str(mark.get("run_id", run.run_id)), "", str(mark.get("names", ALL_NAMES)))
        refuse_other(
            f"W&B run {base} ({self.root / 'wandb'})", theirs,
            Holding(run.run_id, run.name, self.names), steps,
            remedy="use another --run-id (without one, each ranklog run gets its own)",
        )  # fmt: skip
        self._held[None] = _Held(base, None, -1 if steps.last is None else steps.last)
        if self.per_rank:
            pattern = re.compile(rf"run-{base}r(\d+)\.wandb")
            for path in self.root.glob(f"wandb/offline-run-*/run-{base}r*.wandb"):
                m = pattern.fullmatch(path.name)
                if m and int(m[1]) not in self._held:
                    wid = f"{base}r{int(m[1]):05d}"
                    held, _ = scan_offline(self.root, wid)
                    last = -1 if held.last is None else held.last
                    self._held[int(m[1])] = _Held(wid, int(m[1]), last)
            low = min(h.durable for h in self._held.values())
            # what every run holds: a rank that stopped early holds less than the main
            # run was sent, which is no loss (no check against the cursor)
            self.held_known = False
            return StepSet.upto(None if low < 0 else low)
        return steps

    def _wait_forwriters(self, base: str) -> None:
        """Wait until no process writes a recently changed log of this run (Linux only)."""
        now = time.time()
        recent = set()
        for p in self.root.glob(f"wandb/offline-run-*/run-{base}*.wandb"):
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime < WRITER_WAIT:
                    recent.add(os.path.realpath(p))
        deadline = time.monotonic() + WRITER_WAIT
        while recent and (pids := writers(recent)):
            if time.monotonic() > deadline:
                raise TransientTargetError(
                    f"{self.spec}: the run's log is still being written by process {min(pids)}"
                )
            time.sleep(0.1)

    # -- write ------------------------------------------------------------------------

    def _base(self, run: RunInfo) -> str:
        """The main run's W&B id: ``--run-id``, else derived from the ranklog run id."""
        return self.run_id or wandb_run_id(run.run_id)

    def write_params(self, params: dict[str, ParamValue]) -> None:
        self._config.update(params)
        main = self._require(None)
        if main.run is None:
            self._start(main)  # the config goes in with init
        else:
            self._call(main.run.config.update, nest(params), allow_val_change=True)
        main.config_wait.update(flat_params(params))

    def write(self, steps: list[ShippedStep]) -> None:
        main = self._require(None)
        for s in steps:
            if s.carrier is not None and s.step <= main.sent:
                self._late_left_out(s)
                continue
            if self.per_rank and s.per_rank:
                for rank, values in sorted(s.per_rank.items()):
                    held = self._held.get(rank)
                    if held is None:
                        assert self._run is not None
                        held = self._held[rank] = _Held(
                            f"{self._base(self._run)}r{rank:05d}", rank, -1
                        )
                    self._log(held, dict(values), s.step)
            row: dict[str, Any] = dict(s.metrics)
            if s.texts and s.step > main.sent:
                row["samples"] = _wandb().Table(
                    columns=["rank", "name", "text"],
                    data=[[t.rank, t.name, t.text] for t in s.texts],
                )
            if (s.histograms or s.images or s.tables) and s.step > main.sent:
                row.update(media_values(s))
            gpu: dict[str, float] = {}
            if s.gpu:
                from ranklog.shippers.targets._media import gpu_metrics

                assert self._run is not None
                nemo = self.gpu_names == "nemo"
                gpu = gpu_metrics(s, "nemo" if nemo else "wandb", started=self._run.created)
                row.update(gpu)
                runtime = s.ts - self._run.created
                if gpu and math.isfinite(runtime) and not nemo:
                    row[GPU_STEP] = round(runtime, 3)
            self._log(main, row, s.step, gpu=(s, gpu) if gpu else None)
            if self._meta and any(SUMMARY + k in self._meta for k in row):
                self._summary_logged(main, row)

    def _late_left_out(self, s: ShippedStep) -> None:
        """Late values for a step the run has passed: W&B cannot take them (warned once)."""
        if not self._late_warned:
            self._late_warned = True
            log.warning(
                "%s: late values for step %d (and any later ones) are left out: W&B cannot "
                "log a step below its current one (wandb.log would drop them too); the "
                "other targets and Parquet have them", self.spec, s.step,
            )  # fmt: skip

    def _log(
        self, held: _Held, row: dict[str, Any], step: int, *,
        gpu: tuple[ShippedStep, dict[str, float]] | None = None,
    ) -> None:  # fmt: skip
        if step <= held.sent:
            return  # this run already holds it: W&B would drop it with a warning
        if held.run is None:
            self._start(held)
        if gpu is not None and not held.gpu_keys.issuperset(gpu[1]):
            defs = NEMO_GPU_DEFINITIONS if self.gpu_names == "nemo" else gpu_definitions(*gpu)
            for d in defs:  # before the row: wandb-core applies them on logging
                if d.name not in held.defined:
                    self._call(held.run.define_metric, d.name, **d.options())
                    held.defined.add(d.name)
            held.gpu_keys.update(gpu[1])
        self._call(held.run.log, row, step=step, commit=True)
        held.sent = held.logged = step

    def _start(self, held: _Held) -> None:
        """Start (or, online, resume) the W&B run of ``held``."""
        wandb, run = _wandb(), self._run
        assert run is not None
        names = getattr(wandb.Settings, "model_fields", _QUIET)
        _own_service()
        rank = held.rank
        started = self._call(
            wandb.init, project=self.project, entity=self.entity, id=held.wid, dir=str(self.root),
            mode=self.mode, resume=self.resume or "allow",
            group=self.group or self.run_name or run.name,
            tags=self.tags, notes=self.notes,
            name=(self.run_name or run.name) if rank is None else f"rank{rank:05d}",
            job_type=None if rank is None else "rank",
            config=self._init_config() if rank is None else None,
            settings=wandb.Settings(**{k: v for k, v in _QUIET.items() if k in names}),
        )  # fmt: skip
        held.run = started
        held.defined, held.gpu_keys = set(), set()  # a new run (session) knows none of them
        _LIVE[(str(self.root), held.wid)] = started
        path = Path(started.settings.sync_file)
        if (
            self.mode == "offline"
            and path.parent.parent.resolve() != (self.root / "wandb").resolve()
        ):
            raise TargetError(f"wandb wrote to {path}, not under {self.root}: is it writable?")
        held.reader, held.seen, held.logged = LogReader(path), -1, -1
        if self.mode == "offline" and rank is None:
            self._say_where(path.parent, held.wid)
        if self.mode == "online" and held.durable < 0 and started.starting_step > 0:
            held.durable = held.sent = int(started.starting_step) - 1
        if rank is None:
            if self.mode == "online" and not self._meta:  # a resumed run holds them
                self._meta = meta_of(started.config.get(META_KEY))
            held.config_wait.update(flat_params(self._config))
            if self._meta:
                held.config_wait[META_KEY] = self._meta_json()
                self._apply_meta(held, self._meta)

    def _say_where(self, folder: Path, wid: str) -> None:
        """Once per process: where the offline run is, and the command that uploads it."""
        if wid in _SAID:
            return
        _SAID.add(wid)
        # this session's folder counted even before wandb-core has made it (it may not yet)
        found = {p.resolve() for p in self.root.glob(f"wandb/offline-run-*-{wid}")}
        folders = sorted(found | {folder.resolve()})
        pattern = self.root / "wandb" / f"offline-run-*-{wid}"
        if len(folders) > 1:
            log.info("%s: W&B run %s is offline, in %d folders (W&B starts one per session; "
                     "they are one run): upload them with `wandb sync %s`", self.spec, wid,
                     len(folders), pattern)  # fmt: skip
        else:
            log.info("%s: W&B run %s is offline, in %s: upload it with `wandb sync %s`",
                     self.spec, wid, folder, pattern)  # fmt: skip

    def _mark(self) -> dict[str, str]:
        """The ranklog run this W&B run holds (its config's ``_ranklog``)."""
        assert self._run is not None
        return {"run_id": self._run.run_id, "names": self.names}

    def end(self, status: str) -> None:
        """The job ended: each live run finishes with exit code 0 (finished) or 1."""
        self._exit_code = 0 if status == "finished" else 1
        for held in self._held.values():
            if held.run is not None:
                self._finish(held)
                held.durable = held.sent
                held.config_wait.clear()

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (TargetError, OSError):
            raise
        except Exception as exc:
            from wandb.errors import AuthenticationError, UnsupportedError, UsageError

            if isinstance(exc, UsageError | AuthenticationError | UnsupportedError):
                # a bad project name, a refused key: the same answer on every try
                why = f"{exc} (not retried: trying again cannot help)"
                raise TargetError(f"{self.spec}: {why}") from exc
            # wandb's other errors (its service, the network): the engine re-opens, retries
            raise TransientTargetError(f"{self.spec}: {exc}") from exc

    # -- flush, close -----------------------------------------------------------------

    def flush(self) -> None:
        deadline = time.monotonic() + FLUSH_WAIT
        for held in self._held.values():
            if held.run is None or (held.sent <= held.durable and not held.config_wait):
                continue
            if self.mode == "online" or not self._visible(held, deadline):
                self._finish(held)  # online, or a wandb that does not write on its timer
            else:
                fsync_log(held.reader.path if held.reader else None)
            held.durable = held.sent
            held.config_wait.clear()

    def _visible(self, held: _Held, deadline: float) -> bool:
        """Wait until the run's own log shows its last logged step and config."""
        assert held.reader is not None
        pause = 0.002
        while True:
            for rec in held.reader.read():
                if rec.WhichOneof("record_type") == "history":
                    held.seen = max(held.seen, rec.history.step.num)
                for key, value in config_set(rec):
                    want = held.config_wait.get(key, held)  # `held`: not waited for
                    nan = isinstance(want, float) and math.isnan(want) and value != value
                    if nan or (want is not held and want == value):
                        del held.config_wait[key]
            if held.seen >= held.logged and not held.config_wait:
                return True
            if time.monotonic() > deadline:
                log.warning("%s: %s not in the log after %.0fs; finishing the run instead",
                            self.spec, held.wid, FLUSH_WAIT)  # fmt: skip
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _finish(self, held: _Held) -> None:
        run, path = held.run, held.reader.path if held.reader else None
        held.run = held.reader = None
        _LIVE.pop((str(self.root), held.wid), None)
        code = self._exit_code
        self._call(run.finish, **({} if code is None else {"exit_code": code}))
        if self.mode == "offline":
            fsync_log(path)

    def close(self) -> None:
        errors = []
        for held in self._held.values():
            if held.run is not None:
                try:
                    self._finish(held)
                except Exception as exc:
                    errors.append(exc)
                else:
                    held.durable = held.sent
                    held.config_wait.clear()
        if errors:
            raise TransientTargetError(f"{self.spec}: closing failed: {errors[0]}")

    def _require(self, rank: int | None) -> _Held:
        if rank not in self._held:
            raise TargetError(f"{self.spec} is not open")
        return self._held[rank]


def _own_service() -> None:
    """Drop a ``WANDB_SERVICE`` inherited from another process: use a wandb-core of our own.

    A shared service outlives this process: after a crash it would keep the run's
    log open, and maybe write to it, while a restarted shipper reads it.
    """
    token = os.environ.get("WANDB_SERVICE", "")
    m = re.match(r"\d+-(\d+)-", token)
    if token and (m is None or int(m[1]) != os.getpid()):
        log.info("not using the wandb-core service of process %s", m[1] if m else "?")
        del os.environ["WANDB_SERVICE"]
