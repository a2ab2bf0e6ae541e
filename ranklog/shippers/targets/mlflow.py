"""``mlflow:URI``: reduced steps into one MLflow run, through ``MlflowClient``.

``URI`` is a tracking URI (``http://host:5000``, ``sqlite:///path.db``, ...);
``mlflow:`` alone means ``sqlite:///SPOOL/mlflow.db``. How ranklog maps onto MLflow:

- Run: one MLflow run per ranklog run, in the experiment ``--experiment`` (default:
  the ranklog run's name; created if missing), named ``--run-name`` (default: the
  ranklog run's name). It is tagged ``ranklog.run_id`` and found again by that tag on
  restart; also tagged ``ranklog.role`` (``main``), ``ranklog.world_size`` and
  ``ranklog.version``. A sqlite store keeps artifacts in ``mlflow-artifacts/`` beside it.
- Metrics: ``log_batch`` (at most 1000 metrics a request), ``step`` = the ranklog step,
  timestamp = the step's own event time in ms, so a retried request is an exact repeat,
  which MLflow's SQL store ignores (the row's key is key, step, timestamp and value).
- Params: ``write_params`` logs each key once, as a string (6000 chars at most). MLflow
  params cannot change: a later different value is logged as a warning and as the tag
  ``ranklog.param_changed.<key>`` (the latest value); the param keeps its first value.
- Names: metric and param keys not valid in MLflow (``^[/\\w.\\- :]*$``, at most 250
  chars, not a path that normalises to something else, no ``..``) get invalid characters
  replaced by ``_`` and ``_<sha1 of the name, 8 hex>`` appended; the artifact
  ``ranklog/key_map.json`` maps each renamed original to its MLflow key.
- Texts: one artifact per name and step, ``text/<name>/step_<step:08d>.md`` (the text as
  logged; where several ranks logged the name in the step, each under ``### rank R``):
  MLflow's artifact view lists a name's steps in one folder and shows each as Markdown.
- Tables: each is the artifact ``tables/step_<step:08d>/<name>.json`` in the JSON form
  of MLflow's ``log_table`` (``<name>/rankNNNNN.json`` where ranks share the name).
- Late values (``--late ship``): points at their own step; their texts, tables and images
  end in ``.late<carrier:08d>`` before the extension, beside the step's first ones.
- Per rank (``--per-rank``): one child run per rank (tags ``mlflow.parentRunId``,
  ``ranklog.run_id``, ``ranklog.role`` = ``rank``, ``ranklog.rank``; named
  ``<run name>-rank<r>``) holding that rank's own values; found again by tag.

Exactly once: for each batch of steps the texts and the child runs' metrics are sent
first; then the run's metrics, cut into requests of 1,000 in order; then the steps the
run now holds, as the text of its tags ``ranklog.steps`` (``0-99,120-130``; ``10-500/10``
for every 10th step; a long text goes on in ``ranklog.steps.1``, ...). A request is sent
only once the one before it returned, so the tags never name a step before all of its
metrics are stored. ``open()`` reads them back: the steps held (a set: a replay that
fills a gap left by a windowed one writes only the missing steps); a step whose
requests were only partly stored is not among them: it is sent again, and what was
stored is repeated exactly, which the store ignores (a metric row's key is key, step,
timestamp and value). Nothing of this bookkeeping is a metric: the run's charts are the
run's own values. (Runs written by earlier releases hold their steps as the history of
a ``ranklog/step`` metric, read as well.)

The experiment is tagged ``mlflow.experimentKind = custom_model_development`` (unless it
has a kind already), which MLflow 3's UI reads to show it as model training, with the
runs table and charts, rather than as GenAI evaluation runs.

Run status: once every rank ended and everything was shipped, the run (and each rank's
child run) ends ``FINISHED`` when every rank ended ok, ``FAILED`` when one failed or went
silent, ``KILLED`` when one was stopped by a signal (``set_terminated``, at the time of
the last step written). A run written to again (a requeued job, a replay) is
``RUNNING`` again until then. A replay with ``--names`` tags the run
``ranklog.names``; a run holding steps of another selection is refused.
Requests are synchronous and committed by the server when they return; ``flush()``
has nothing left to do. A server that is down or answers 5xx/429 raises
:class:`TransientTargetError` after the client's own retries, shortened here (unless
set in the environment) to 2 retries and a 20 s timeout; any other refusal (4xx: no
permission, a deleted run) raises :class:`TargetError`, which stops the shipper.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import tempfile
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from ranklog._version import __version__
from ranklog.errors import (
    ExtraMissingError,
    TargetError,
    TransientTargetError,
)
from ranklog.schemas import ParamScalar, ParamValue
from ranklog.shippers._held import ALL_NAMES, Holding, StepSet, refuse_other
from ranklog.shippers._place import file_place, server_place
from ranklog.shippers._registry import Option, TargetContext, TargetKind
from ranklog.shippers._target import ShippedStep
from ranklog.shippers.targets._media import GPU_NAMES_OPTION, RUN_ID_HELP
from ranklog.shippers.targets._mlflow_rows import (
    HISTOGRAM_STATS,
    MARKER,
    _chunks,
    _late,
    _ms,
    _rank_rows,
    _rows,
    _table_files,
    _text_files,
    _with_histograms,
    chunk_text,
    code_tags_and_files,
    decode_steps,
    encode_steps,
    held_by,
    histogram_stat_list,
    sanitize_key,
)
from ranklog.shippers.targets._mlflow_runs import (
    adopt,
    create,
    experiment,
    nemo_arg,
    nemo_options,
    oldest,
    search,
)
from ranklog.spool import RunInfo

__all__ = ["MARKER", "STEPS_TAG", "TARGET", "MlflowTarget", "held_steps", "sanitize_key"]

log = logging.getLogger("ranklog.ship")

#: the artifact mapping each renamed metric or param name to its MLflow key
KEY_MAP: Final = "ranklog/key_map.json"
_MAX_METRICS: Final = 1000
_MAX_PARAMS_TAGS: Final = 100
_MAX_PARAM_VALUE: Final = 6000
_MAX_TAG_VALUE: Final = 8000
#: the run's tag holding the steps it holds (``0-99,120-130``; ``10-500/10``: every 10th);
#: a long list goes on in ``ranklog.steps.1``, ``ranklog.steps.2``, ...
STEPS_TAG: Final = "ranklog.steps"
_STEPS_CHUNK: Final = 7900
#: runs whose place in the UI this process said
_SAID: set[str] = set()
#: MLflow's own HTTP retries (default 7 with backoff: minutes) shortened, so that a down
#: server reaches the engine's backoff in seconds; the environment can still override
_HTTP_DEFAULTS: Final = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


def _param_text(v: ParamValue) -> str:
    """A param as MLflow stores it (text): a list as its JSON text, else ``str``."""
    return json.dumps(v) if isinstance(v, list) else str(v)


@contextlib.contextmanager
def _guard(what: str) -> Iterator[None]:
    """Map MLflow's errors: server down, 5xx, 429 -> TransientTargetError; 4xx -> TargetError."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        err: Any = exc  # (untyped in mlflow)
        status = int(err.get_http_status_code())
        if status >= 500 or status in (408, 429):
            raise TransientTargetError(f"mlflow {what}: {exc}") from exc
        raise TargetError(f"mlflow {what} failed: {exc}") from exc
    except (OSError, TargetError):
        raise  # requests' errors are OSErrors: retried by the engine
    except Exception as exc:
        if type(exc).__module__.split(".")[0] in ("sqlalchemy", "urllib3", "requests"):
            raise TransientTargetError(f"mlflow {what}: {exc}") from exc
        raise


class MlflowTarget:
    """Logs reduced steps to one MLflow run (and one child run per rank with ``per_rank``)."""

    kind = "mlflow"
    #: late values (``--late ship``) are handled: see :class:`~ranklog.shippers.Target`
    takes_late = True

    def __init__(
        self,
        uri: str,
        *,
        spec: str | None = None,
        run_name: str | None = None,
        experiment: str | None = None,
        per_rank: bool = False,
        artifact_root: str | None = None,
        run_id: str | None = None,
        image_layout: str = "steps",
        gpu_names: str = "ranklog",
        names: str = ALL_NAMES,
        histogram_stats: str | None = None,
    ) -> None:
        self.spec = spec or f"mlflow:{uri}"
        #: the statistics a distribution becomes (``name/<stat>``), in this order
        self.histogram_stats = histogram_stat_list(histogram_stats)
        self.names = names
        self.uri, self._db = uri, None
        db = uri.removeprefix("sqlite:///")
        if db != uri and db and db != ":memory:":  # a sqlite file: absolute, artifacts beside it
            self._db = Path(db).expanduser().resolve()
            self.uri = f"sqlite:///{self._db}"
            artifact_root = artifact_root or (self._db.parent / "mlflow-artifacts").as_uri()
        self.run_name = run_name
        self.experiment = experiment
        self.per_rank = per_rank
        self.artifact_root = artifact_root
        #: an existing MLflow run to write into (NeMo's ``run_id``), instead of one found by tag
        self.given_run_id = run_id
        #: ``steps``: ``images/step_<step>/<name>``; ``latest``: ``plots/<name>`` (NeMo's)
        self.image_layout = image_layout
        self.gpu_names = gpu_names
        self._client: Any = None
        self._started: float | None = None
        self._exp_id = ""
        self._ranklog_id = ""
        self._name = ""
        self.run_id = ""
        self._children: dict[int, str] = {}
        self._params: dict[str, str] = {}
        self._world = ""
        self._keys: dict[str, str] = {}  # every name seen -> its MLflow key
        self._renamed: dict[str, str] = {}  # the key map artifact: renamed originals only
        self._status = "RUNNING"  # the main run's status when opened
        self._last_ts: float | None = None  # the latest step written: the run's end time
        self._held = StepSet()  # the steps the run holds
        self._step_tags: dict[str, str] = {}  # the ranklog.steps tags as stored

    # -- the Target protocol ------------------------------------------------------------

    def place(self, run: RunInfo) -> str | None:
        """A server's resolved address (``localhost`` and ``127.0.0.1`` are one server), or
        the sqlite file's device and inode, with the experiment or run as in the identity."""
        where = self.identity(run).rpartition("#")[2]
        if self._db is not None:  # (made empty first, as the store's open makes it)
            with contextlib.suppress(OSError):
                self._db.parent.mkdir(parents=True, exist_ok=True)
                os.close(os.open(self._db, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        at = file_place(self._db) if self._db is not None else server_place(self.uri)
        return None if at is None else f"mlflow:{at}#{where}"

    def identity(self, run: RunInfo) -> str:
        """Tracking URI (a sqlite file's real path, a server's lower-cased host) and the
        experiment, or the MLflow run id when one is given."""
        uri = self.uri
        if self._db is not None:
            uri = f"sqlite:///{os.path.realpath(self._db)}"
        elif "://" in uri:
            parts = urllib.parse.urlsplit(uri)
            uri = urllib.parse.urlunsplit(
                (parts.scheme.lower(), parts.netloc.lower(), parts.path.rstrip("/"), "", "")
            )
        where = (
            f"run={self.given_run_id}" if self.given_run_id
            else f"experiment={self.experiment or run.name}"
        )  # fmt: skip
        return f"mlflow:{uri}#{where}"

    def open(self, run: RunInfo) -> StepSet:
        from mlflow.tracking import MlflowClient

        for name, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        if self._db is not None:
            self._db.parent.mkdir(parents=True, exist_ok=True)
        with _guard("open"):
            self._client = MlflowClient(tracking_uri=self.uri)
            self._ranklog_id = run.run_id
            self._started = run.created
            self._name = self.run_name or run.name
            tags = {"ranklog.role": "main", "ranklog.version": __version__}
            if self.names != ALL_NAMES:
                tags["ranklog.names"] = self.names
            if run.world_size is not None:
                tags["ranklog.world_size"] = str(run.world_size)
            if self.given_run_id:
                main = adopt(self._client, self.given_run_id, self._ranklog_id, tags)
                self._exp_id = str(main.info.experiment_id)
                runs = search(self._client, self._exp_id, self._ranklog_id)
            else:
                name = self.experiment or run.name
                self._exp_id = experiment(self._client, name, self.artifact_root)
                runs = search(self._client, self._exp_id, self._ranklog_id)
                mains = [r for r in runs if r.data.tags.get("ranklog.role") == "main"]
                main = oldest(mains) if mains else self._create(self._name, tags)
            self.run_id = main.info.run_id
            self._params = dict(main.data.params)
            self._world = main.data.tags.get("ranklog.world_size", "")
            self._children = {}
            for r in sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id)):
                rank = r.data.tags.get("ranklog.rank")
                if r.data.tags.get("ranklog.role") == "rank" and rank is not None:
                    self._children.setdefault(int(rank), r.info.run_id)
            self._renamed = self._load_key_map()
            self._keys = dict(self._renamed)
            self._status = str(main.info.status)
            self._step_tags = {
                k: v for k, v in main.data.tags.items()
                if k == STEPS_TAG or k.startswith(STEPS_TAG + ".")
            }  # fmt: skip
            held = held_steps(main.data.tags).union(
                StepSet(int(m.step) for m in self._client.get_metric_history(self.run_id, MARKER))
            )  # fmt: skip (the marker metric of runs an earlier release wrote)
            self._held = StepSet.of_ranges(held.ranges())  # the engine's copy is its own
            mine = Holding(run.run_id, run.name, self.names)
            theirs = Holding(
                main.data.tags.get("ranklog.run_id", run.run_id), run.name,
                main.data.tags.get("ranklog.names", ALL_NAMES),
            )  # fmt: skip
            refuse_other(
                f"MLflow run {self.run_id}", theirs, mine, held,
                remedy="use another --run-id (without one, each ranklog run gets its own)",
            )  # fmt: skip
            self._say_where()
            if theirs.names != mine.names:  # it holds no step yet: it takes this selection
                from mlflow.entities import RunTag

                tag = RunTag("ranklog.names", mine.names)
                self._client.log_batch(self.run_id, tags=[tag], synchronous=True)
            return held

    def _say_where(self) -> None:
        """Once per process and run: where to see the run in MLflow's UI (its training view:
        MLflow 3 opens in its GenAI view unless the link says ``workflowType``)."""
        if self.run_id in _SAID:
            return
        _SAID.add(self.run_id)
        page = f"#/experiments/{self._exp_id}/runs/{self.run_id}?workflowType=machine_learning"
        if self._db is not None:
            where = (f"`mlflow ui --backend-store-uri {self.uri}`, then "
                     f"http://127.0.0.1:5000/{page}")  # fmt: skip
        else:
            where = f"{self.uri.rstrip('/')}/{page}"
        log.info("%s: MLflow run %r (id %s): see it with %s", self.spec.rstrip(":"), self._name,
                 self.run_id, where)  # fmt: skip

    def _running(self) -> None:
        """A run that had ended (an earlier job, a replay) runs again once written to."""
        if self._status != "RUNNING":
            self._client.update_run(self.run_id, status="RUNNING")
            self._status = "RUNNING"

    def write_params(self, params: dict[str, ParamValue]) -> None:
        with _guard("write_params"):
            from mlflow.entities import Param, RunTag
            from mlflow.exceptions import MlflowException

            self._running()
            keys = self._map_keys(list(params))
            values = {keys[k]: _param_text(v)[:_MAX_PARAM_VALUE] for k, v in params.items()}
            for attempt in range(2):
                new, tags = [], []
                for key, value in values.items():
                    old = self._params.get(key)
                    if old is None:
                        new.append(Param(key, value))
                    elif old != value:
                        msg = "mlflow: param %r changed from %r to %r (kept: the first; tagged)"
                        log.warning(msg, key, old, value)
                        tag = sanitize_key(f"ranklog.param_changed.{key}")
                        tags.append(RunTag(tag, value[:_MAX_TAG_VALUE]))
                try:
                    for chunk in _chunks(new, _MAX_PARAMS_TAGS):
                        self._client.log_batch(self.run_id, params=chunk, synchronous=True)
                except MlflowException as exc:  # params we did not know of: read them, again
                    if attempt or exc.error_code != "INVALID_PARAMETER_VALUE":
                        raise
                    self._params = dict(self._client.get_run(self.run_id).data.params)
                    continue
                self._params.update((p.key, p.value) for p in new)
                for chunk in _chunks(tags, _MAX_PARAMS_TAGS):
                    self._client.log_batch(self.run_id, tags=chunk, synchronous=True)
                return

    def write_meta(self, meta: dict[str, ParamScalar]) -> list[str]:
        """The code's git state: MLflow's ``mlflow.source.git.*`` tags, and artifacts
        ``code/git.json`` and ``code/uncommitted_changes_diff.txt``. MLflow has no metric
        definitions or run summary: those keys are returned (left out, said once)."""
        tags, files = code_tags_and_files(meta)
        if tags or files:
            from mlflow.entities import RunTag

            with _guard("write_meta"):
                self._running()
                batch = [RunTag(k, v[:_MAX_TAG_VALUE]) for k, v in tags.items()]
                self._client.log_batch(self.run_id, tags=batch, synchronous=True)
                for path, text in files.items():
                    self._client.log_text(self.run_id, text, path)
        return [k for k in meta if not k.startswith("code/")]

    def write(self, steps: list[ShippedStep]) -> None:
        from mlflow.entities import Metric, RunTag

        if not steps:
            return
        with _guard("write"):
            self._running()
            self._last_ts = steps[-1].ts if math.isfinite(steps[-1].ts) else self._last_ts
            client = self._client
            started = self._started
            stats = self.histogram_stats
            values_of = [_with_histograms(s, self.gpu_names, started, stats) for s in steps]
            names: set[str] = set()
            for values in values_of:
                names.update(values)
            for s in steps if self.per_rank else ():
                for values in (s.per_rank or {}).values():
                    names.update(values)
            self._map_keys(sorted(names.difference(self._keys)))  # only names not seen yet
            keys = self._keys
            for s in steps:  # texts and images first: the marker vouches for them too
                for path, text in (_text_files(s) if s.texts else []) + (
                    _table_files(s) if s.tables else []
                ):
                    client.log_text(self.run_id, text, path)
                if s.images:
                    self._log_images(s)
            if self.per_rank:
                for r in sorted({r for s in steps if s.per_rank for r in s.per_rank}):
                    self._send(self._child(r), _rank_rows(Metric, steps, r, keys))
            world = str(steps[-1].world_size)
            if world != self._world:
                tag = RunTag("ranklog.world_size", world)
                client.log_batch(self.run_id, tags=[tag], synchronous=True)
                self._world = world
            # every metric first; then the steps held, in tags: a tag is stored only after
            # every metric it vouches for (a request sent again after a crash is an exact
            # repeat, which the store ignores)
            self._send(self.run_id, _rows(Metric, steps, values_of, keys))
            for step in held_by(steps):
                self._held.add(step)
            self._tag_held()

    def flush(self) -> None:
        """Nothing to do: every request was committed by the store before it returned."""

    def _tag_held(self) -> None:
        """The ``ranklog.steps`` tags that changed, from the steps now held."""
        from mlflow.entities import RunTag

        chunks = chunk_text(encode_steps(self._held.ranges()), _STEPS_CHUNK)
        names = [STEPS_TAG, *(f"{STEPS_TAG}.{i}" for i in range(1, len(chunks)))]
        tags = [RunTag(k, v) for k, v in zip(names, chunks, strict=True)
                if self._step_tags.get(k) != v]  # fmt: skip
        for chunk in _chunks(tags, _MAX_PARAMS_TAGS):
            self._client.log_batch(self.run_id, tags=chunk, synchronous=True)
        self._step_tags.update((t.key, t.value) for t in tags)

    def end(self, status: str) -> None:
        """The job ended: the run (and each rank's child run) ends FINISHED, FAILED or KILLED,
        at the time of the last step written (now, if this session wrote none)."""
        state = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}[status]
        if state == self._status:
            return  # ended so already (a second shipper at the end of a job): keep its time
        end = _ms(self._last_ts) if self._last_ts is not None else None
        with _guard("end"):
            for run_id in (*self._children.values(), self.run_id):
                self._client.set_terminated(run_id, status=state, end_time=end or None)
        self._status = state

    def close(self) -> None:
        self._client = None

    # -- helpers ------------------------------------------------------------------------

    def _log_images(self, step: ShippedStep) -> None:
        """Each image as an artifact ``images/step_<step>/<name>.<format>``."""
        import tempfile

        from ranklog.shippers.targets._media import rank_tags

        top = "plots" if self.image_layout == "latest" else f"images/step_{step.step:08d}"
        for tag, img in zip(rank_tags(step.images), step.images, strict=True):
            parts = sanitize_key(tag).split("/")
            folder = "/".join([top, *parts[:-1]])
            with tempfile.TemporaryDirectory() as tmp:
                late = _late(step) if self.image_layout != "latest" else ""
                path = Path(tmp) / f"{parts[-1]}{late}.{img.format or 'png'}"
                path.write_bytes(img.data)
                self._client.log_artifact(self.run_id, str(path), folder)

    def _send(self, run_id: str, metrics: Iterable[Any]) -> None:
        """Requests of at most 1,000 metrics, in order, each one's ``Metric`` objects made
        only when it is sent (a large write never holds them all)."""
        rows = iter(metrics)
        while chunk := list(itertools.islice(rows, _MAX_METRICS)):
            self._client.log_batch(run_id, metrics=chunk, synchronous=True)

    def _create(self, name: str, tags: dict[str, str], extra: str = "") -> Any:
        return create(self._client, self._exp_id, self._ranklog_id, name, tags,
                      started=self._started, extra=extra)  # fmt: skip

    def _child(self, rank: int) -> str:
        run_id = self._children.get(rank)
        if run_id is None:
            tags = {"mlflow.parentRunId": self.run_id, "ranklog.role": "rank",
                    "ranklog.rank": str(rank), "ranklog.version": __version__}  # fmt: skip
            extra = f" and tags.\"ranklog.rank\" = '{rank}'"
            run_id = self._create(f"{self._name}-rank{rank}", tags, extra).info.run_id
            self._children[rank] = run_id
        return run_id

    def _map_keys(self, names: list[str]) -> dict[str, str]:
        """MLflow keys of ``names``; renamed ones are added to the key map artifact first."""
        new = {
            n: sanitize_key(n if n != MARKER else f"{n}\0") for n in names if n not in self._keys
        }
        fresh = {n: key for n, key in new.items() if key != n}
        if fresh:  # (the marker's own name is taken: a metric of that name is renamed)
            self._client.log_dict(self.run_id, {**self._renamed, **fresh}, KEY_MAP)
            self._renamed.update(fresh)
        self._keys.update(new)
        return {n: self._keys[n] for n in names}

    def _load_key_map(self) -> dict[str, str]:
        listed = self._client.list_artifacts(self.run_id, KEY_MAP.rpartition("/")[0])
        if not any(f.path == KEY_MAP for f in listed):
            return {}
        with tempfile.TemporaryDirectory(prefix="ranklog-mlflow-") as tmp:
            path = self._client.download_artifacts(self.run_id, KEY_MAP, tmp)
            loaded = json.loads(Path(path).read_text())
        return {str(k): str(v) for k, v in loaded.items()}


def held_steps(tags: Mapping[str, str]) -> StepSet:
    """The steps a run holds, from its ``ranklog.steps`` tags (every chunk; a chunk left
    from an earlier, longer text holds steps held still: held steps only grow)."""
    ranges = [
        r for k, v in tags.items() if k == STEPS_TAG or k.startswith(STEPS_TAG + ".")
        for r in decode_steps(v)
    ]  # fmt: skip
    return StepSet.of_ranges(ranges)


def _build(arg: str, context: TargetContext, options: Mapping[str, Any]) -> MlflowTarget:
    names = context.names
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise ExtraMissingError("mlflow", "mlflow") from None
    return MlflowTarget(
        arg or f"sqlite:///{(context.spool / 'mlflow.db').resolve()}",
        spec=f"mlflow:{arg}",  # (as typed before: older cursors are named after it)
        run_name=options.get("run_name"),
        experiment=options.get("experiment"),
        per_rank=context.per_rank,
        artifact_root=options.get("artifact_location"),
        run_id=options.get("run_id"),
        image_layout=options.get("image_layout") or "steps",
        gpu_names=options.get("gpu_names") or "ranklog",
        names=names,
        histogram_stats=options.get("histogram_stats"),
    )


TARGET = TargetKind(
    kind="mlflow",
    arg="URI",
    arg_optional=True,
    help="an MLflow run at tracking URI (default: sqlite:///SPOOL/mlflow.db; under replay "
    "./mlflow.db)",
    build=_build,
    options=(
        Option(
            "run_name", "the backend run's name (default: the spool's run name)", nemo="run_name"
        ),
        Option("experiment", "MLflow experiment (default: the run name)", nemo="experiment_name"),
        Option(
            "run_id",
            RUN_ID_HELP,
            nemo="run_id",
        ),
        Option(
            "artifact_location",
            "artifact location of an MLflow experiment it creates (default: mlflow-artifacts/ "
            "beside a sqlite store, else the server's)",
            metavar="URI",
        ),
        Option(
            "image_layout",
            "MLflow images: images/step_N/NAME per step (the default), or plots/NAME (the "
            "latest, as NeMo RL)",
            choices=("steps", "latest"),
        ),
        GPU_NAMES_OPTION,
        Option(
            "histogram_stats",
            "MLflow: the statistics each distribution becomes (NAME/STAT), comma-separated "
            f"from {','.join(HISTOGRAM_STATS)} (default: all; under NeMo: mean,p50,p90,max)",
            metavar="STATS",
        ),
    ),
    extra="mlflow",
    nemo_section="mlflow",
    nemo_arg=nemo_arg,
    nemo_options=nemo_options,
)
