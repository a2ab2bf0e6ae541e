"""NeMo RL's backend logger classes, over ranklog's spool and shippers.

In NeMo RL each class holds its backend's client in the training process. Here the
backends live in ``ranklog ship`` processes, so a class is a view: inside a
:class:`~ranklog.nemo.Logger` it is listed in ``logger.loggers`` and writes through the
Logger's spool (to every enabled backend); built on its own it starts a spool and one
shipper for its backend, under ``log_dir`` as NeMo's class writes there.
:class:`RayGpuMonitorLogger` is NeMo's monitor itself (Ray's metrics agents, buffered,
flushed to a parent logger); ``Logger`` samples through ranklog's GPU sampler instead.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from ranklog.nemo._config import (
    GpuMetricSnapshot,
    MLflowConfig,
    SwanlabConfig,
    TensorboardConfig,
    WandbConfig,
)
from ranklog.nemo._objects import SummaryWriter, SwanlabRun, WandbRun
from ranklog.nemo._session import Session, leave_out_flags, ship_command

__all__ = [
    "GpuSamplerMonitor",
    "LoggerInterface",
    "MLflowLogger",
    "RayGpuMonitorLogger",
    "SwanlabLogger",
    "TensorboardLogger",
    "WandbLogger",
]

log = logging.getLogger("ranklog.nemo")


class LoggerInterface(abc.ABC):
    """NeMo RL's logger interface: metrics, hyperparameters, histograms and plots."""

    @abc.abstractmethod
    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        """Log a dictionary of metrics at ``step``, each name under ``prefix/``."""

    @abc.abstractmethod
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Log hyperparameters (a nested config)."""

    @abc.abstractmethod
    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        """Log a distribution of values at ``step``."""

    @abc.abstractmethod
    def log_plot(self, figure: Any, step: int, name: str) -> None:
        """Log a matplotlib figure at ``step``."""


class OnSession(LoggerInterface):
    """LoggerInterface's calls, each handed to ``self._session`` (a :class:`Session`)."""

    _session: Session

    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        """Log ``metrics`` at ``step`` under ``prefix/`` to every backend.

        Numbers are metrics (mean across ranks), strings text, numeric lists histograms,
        figures images, nested dicts flattened with ``/``; anything else is skipped with
        one warning naming the key. ``step_finished=True`` (or a ``timing/train`` call,
        or a later step) closes the step: the shippers forward it.
        """
        self._session.log_metrics(metrics, step, prefix, step_metric, step_finished)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Log the config: flattened with "." (lists by index); W&B shows it nested."""
        self._session.log_hyperparams(params)

    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        """Log a distribution: TensorBoard/W&B histogram, MLflow ``/mean,/p50,/p90,/max``."""
        self._session.log_histogram(histogram, step, name)

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        """Log a matplotlib figure: TensorBoard/W&B image, MLflow ``plots/<name>.png``."""
        self._session.log_plot(figure, step, name)


class _BackendLogger(OnSession):
    """A backend class of NeMo's: the Logger's spool, or one of its own with one shipper."""

    #: the NeMo config section, and ranklog's target kind
    SECTION: ClassVar[str]

    def __init__(self, cfg: Mapping[str, Any], log_dir: str | None = None) -> None:
        from ranklog.shippers import target_kinds

        self.cfg = dict(cfg)
        backend_dir = Path(log_dir or self.SECTION)
        self._backend_dir = backend_dir
        flags = target_kinds()[self.SECTION].nemo_backend_command(self.cfg, backend_dir)
        spool = backend_dir / ".ranklog-spool"
        own = self.cfg.get("ranklog") or {}
        flags += leave_out_flags(own, self.SECTION)
        self._session = Session(spool, [[*ship_command(spool, own), *flags]], own)
        self._own_session = True
        print(f"Initialized {type(self).__name__} at {backend_dir} (ranklog spool {spool})")

    @classmethod
    def _attached(cls, session: Session, cfg: Mapping[str, Any], log_dir: str | None = None) -> Any:
        """The view of this backend inside a Logger that owns ``session``."""
        self = cls.__new__(cls)
        self.cfg = dict(cfg)
        self._session = session
        self._own_session = False
        self._backend_dir = Path(log_dir or cls.SECTION)
        return self

    def finish(self) -> None:
        """On its own: close its spool and wait for its shipper (in a Logger: the Logger's)."""
        if self._own_session:
            self._session.finish()


class TensorboardLogger(_BackendLogger):
    """TensorBoard event files under ``log_dir`` (NeMo's Logger: ``<log_dir>/tensorboard``)."""

    SECTION = "tensorboard"

    def __init__(self, cfg: TensorboardConfig, log_dir: str | None = None) -> None:
        super().__init__(cfg, log_dir)
        self.writer = SummaryWriter(self._session, str(self._backend_dir))

    @classmethod
    def _attached(cls, session: Session, cfg: Mapping[str, Any], log_dir: str | None = None) -> Any:
        self = super()._attached(session, cfg, log_dir)
        self.writer = SummaryWriter(session, str(self._backend_dir))
        return self

    @staticmethod
    def _coerce_to_scalar(value: Any) -> int | float | bool | str | None:
        """What TensorBoard can plot: Python scalars as they are, one-element arrays' item."""
        if isinstance(value, bool | int | float | str):
            return value
        item, size = getattr(value, "item", None), getattr(value, "size", None)
        numel = getattr(value, "numel", None)
        if callable(numel):
            size = numel()
        if callable(item) and (size == 1 or size == ()):
            out = item()
            return out if isinstance(out, bool | int | float) else None
        return None


class _RunLogger(_BackendLogger):
    """A backend whose NeMo logger has a ``run`` (W&B, SwanLab): what is known of it here."""

    #: the class of ``run``
    RUN: ClassVar[type[WandbRun] | type[SwanlabRun]]

    def __init__(self, cfg: Mapping[str, Any], log_dir: str | None = None) -> None:
        super().__init__(cfg, log_dir)
        self.run: Any = self.RUN(self._session, self.cfg, str(self._backend_dir))

    @classmethod
    def _attached(cls, session: Session, cfg: Mapping[str, Any], log_dir: str | None = None) -> Any:
        self = super()._attached(session, cfg, log_dir)
        self.run = cls.RUN(session, self.cfg, str(self._backend_dir))
        return self

    def finish(self) -> None:
        super().finish()
        self.run = None


class WandbLogger(_RunLogger):
    """A W&B run (``cfg`` as NeMo passes it to ``wandb.init``: id, resume, tags, notes ...)."""

    SECTION = "wandb"
    RUN = WandbRun

    def __init__(self, cfg: WandbConfig, log_dir: str | None = None) -> None:
        super().__init__(cfg, log_dir)

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        """W&B's ``define_metric`` (a glob such as ``ray/*``, any step metric): recorded in
        the spool, given to the W&B run by its shipper (and to each later session of it)."""
        self._session.run.define_metric(name, step_metric)


class MLflowLogger(_BackendLogger):
    """An MLflow run (``tracking_uri``, ``run_id``, ``experiment_name``, ``artifact_location``)."""

    SECTION = "mlflow"

    #: how long ``run_id`` waits for the shipper to create the run
    FIND_TIMEOUT: ClassVar[float] = 60.0

    def __init__(self, cfg: MLflowConfig, log_dir: str | None = None) -> None:
        super().__init__(cfg, log_dir)
        self._found: str | None = None

    @classmethod
    def _attached(cls, session: Session, cfg: Mapping[str, Any], log_dir: str | None = None) -> Any:
        self = super()._attached(session, cfg, log_dir)
        self._found = None
        return self

    @property
    def run_id(self) -> str:
        """The MLflow run's id: the config's or ``MLFLOW_RUN_ID``, else the run the shipper
        created for this ranklog run, found in the tracking store by its ``ranklog.run_id``
        tag (imports mlflow; waits up to :attr:`FIND_TIMEOUT` s for the shipper)."""
        if self._found is None:
            named = self.cfg.get("run_id") or os.environ.get("MLFLOW_RUN_ID")
            self._found = str(named) if named else find_mlflow_run(
                self._session, self.cfg, self._backend_dir, self.FIND_TIMEOUT
            )  # fmt: skip
        return self._found

    @property
    def run(self) -> Any:
        """MLflow's ``Run`` (``.info.run_id``, ``.info.experiment_id``, ``.data.params`` ...),
        read from the tracking store now: a snapshot; log through the logger."""
        run_id = self.run_id
        with _mlflow_errors("MLflowLogger.run"):
            from mlflow import MlflowClient

            return MlflowClient(tracking_uri(self.cfg, self._backend_dir)).get_run(run_id)

    def __del__(self) -> None:
        session = getattr(self, "_session", None)
        if session is not None and getattr(self, "_own_session", False):
            try:
                session.finish()
            except Exception as exc:  # at exit: nothing left to tell
                log.debug("ranklog.nemo: finishing the MLflow logger: %s", exc)


class SwanlabLogger(_RunLogger):
    """A SwanLab run (``project``, ``name``), written offline under ``log_dir`` (NeMo's
    Logger: ``<log_dir>/swanlab``) for ``swanlab sync``."""

    SECTION = "swanlab"
    RUN = SwanlabRun

    def __init__(self, cfg: SwanlabConfig, log_dir: str | None = None) -> None:
        super().__init__(cfg, log_dir)


def tracking_uri(cfg: Mapping[str, Any], backend_dir: Path) -> str:
    """The tracking URI the MLflow shipper of this config writes to."""
    from ranklog.shippers import target_kinds

    uri = target_kinds()["mlflow"].nemo_arg
    assert uri is not None  # the MLflow target declares its NeMo section
    return str(uri(cfg, backend_dir))


def find_mlflow_run(
    session: Session, cfg: Mapping[str, Any], backend_dir: Path, timeout: float
) -> str:
    """The id of the MLflow run the shipper made for ``session``'s ranklog run (by its tag)."""
    with _mlflow_errors("MLflowLogger.run_id"):
        return _find_mlflow_run(session, cfg, backend_dir, timeout)


@contextlib.contextmanager
def _mlflow_errors(what: str) -> Iterator[None]:
    """MLflow missing, or its store failing, as errors of ranklog's tree naming ``what``."""
    from ranklog.errors import ExtraMissingError, RanklogError, TargetError

    try:
        yield
    except ImportError:
        raise ExtraMissingError("mlflow", "mlflow") from None
    except RanklogError:
        raise
    except Exception as exc:  # MlflowException, a store that cannot be reached
        raise TargetError(f"{what}: the MLflow store answered {exc}") from exc


def _find_mlflow_run(
    session: Session, cfg: Mapping[str, Any], backend_dir: Path, timeout: float
) -> str:
    from mlflow import MlflowClient

    from ranklog.errors import TargetError
    from ranklog.shippers import target_kinds
    from ranklog.shippers.targets._mlflow_runs import oldest, search

    options = target_kinds()["mlflow"].nemo_options
    assert options is not None  # the MLflow target declares its NeMo section
    uri = tracking_uri(cfg, backend_dir)
    name = options(cfg, backend_dir).get("experiment") or session.run.info.name
    client = MlflowClient(tracking_uri=uri)
    deadline = time.monotonic() + timeout
    while True:
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            runs = search(client, exp.experiment_id, session.run.info.run_id)
            mains = [r for r in runs if r.data.tags.get("ranklog.role") == "main"]
            if mains:
                return str(oldest(mains).info.run_id)
        if time.monotonic() > deadline:
            raise TargetError(
                f"MLflowLogger.run_id: no MLflow run of ranklog run {session.run.info.run_id} "
                f"in experiment {name!r} at {uri} after {timeout:.0f}s: is its shipper running? "
                f"(ranklog inspect {session.spool})"
            )
        time.sleep(0.2)


class GpuSamplerMonitor:
    """``Logger.gpu_monitor``: ranklog's GPU sampler of the run, with NeMo's monitor's face.

    Samples go into the spool every ``collection_interval`` seconds and reach the
    backends under NeMo's names (``ray/node.N.gpu.M.util`` ...) with the training steps.
    """

    metric_prefix = "ray"
    step_metric = "ray/ray_step"

    def __init__(self, session: Session, collection_interval: float, flush_interval: float):
        self._session = session
        self.collection_interval = collection_interval
        self.flush_interval = flush_interval
        self.parent_logger = None

    @property
    def is_running(self) -> bool:
        """Whether the sampler thread is sampling."""
        gpu = getattr(self._session.run, "_gpu", None)
        return gpu is not None and not self._session.run.closed

    def start(self) -> None:
        """The run started its sampler already."""

    def flush(self) -> None:
        """Hand what was sampled to the spool now."""
        if not self._session.run.closed:
            self._session.run.flush()

    def stop(self) -> None:
        """Stop sampling (what was sampled is kept)."""
        self._session.run._stop_gpu()


class Sample(NamedTuple):
    """One Prometheus sample (prometheus_client's ``Sample`` has the same fields)."""

    name: str
    labels: dict[str, str]
    value: float


class RayGpuMonitorLogger:
    """NeMo RL's GPU monitor: every Ray node's GPUs, buffered, flushed to ``parent_logger``.

    Every ``collection_interval`` s a thread reads each node's metrics agent; every
    ``flush_interval`` s (and at :meth:`stop`) the buffered snapshots are logged through
    ``parent_logger.log_metrics`` at step = seconds since :meth:`start`, with that step
    also under ``step_metric``.
    """

    def __init__(
        self,
        collection_interval: int | float,
        flush_interval: int | float,
        metric_prefix: str,
        step_metric: str,
        parent_logger: Any = None,
    ) -> None:
        self.collection_interval = collection_interval
        self.flush_interval = flush_interval
        self.metric_prefix = metric_prefix
        self.step_metric = step_metric
        self.parent_logger = parent_logger
        self.metrics_buffer: list[GpuMetricSnapshot] = []
        self.last_flush_time = time.time()
        self.is_running = False
        self.collection_thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.start_time: float = float("-inf")
        import urllib.request  # here: it costs ~30 ms to import

        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open

    @staticmethod
    def _ray() -> Any:
        import ray

        return ray

    def start(self) -> None:
        """Start collecting (ValueError when Ray is not initialised in this process)."""
        if not self._ray().is_initialized():
            raise ValueError("Ray must be initialized with nemo_rl.distributed.virtual_cluster."
                             "init_ray() before the GPU logging can begin.")  # fmt: skip
        if self.is_running:
            return
        self.start_time = time.time()
        self.is_running = True
        self.collection_thread = threading.Thread(target=self._collection_loop, daemon=True)
        self.collection_thread.start()
        print(f"GPU monitoring started with collection interval={self.collection_interval}s, "
              f"flush interval={self.flush_interval}s")  # fmt: skip

    def stop(self) -> None:
        """Stop collecting and flush what is buffered."""
        self.is_running = False
        if self.collection_thread is not None:
            self.collection_thread.join(timeout=self.collection_interval * 2)
        self.flush()
        print("GPU monitoring stopped")

    def _collection_loop(self) -> None:
        while self.is_running:
            try:
                now = time.time()
                metrics = self._collect_metrics()
                if metrics:
                    with self.lock:
                        self.metrics_buffer.append(
                            {"step": int(now - self.start_time), "metrics": metrics}
                        )
                now = time.time()
                if now - self.last_flush_time >= self.flush_interval:
                    self.flush()
                    self.last_flush_time = now
                time.sleep(self.collection_interval)
            except Exception as exc:
                print(f"Error in GPU monitoring collection loop or stopped abruptly: {exc}")
                time.sleep(self.collection_interval)

    def _parse_metric(self, sample: Any, node_idx: int) -> dict[str, Any]:
        """One sample as ``node.I.gpu.J.util|mem_gb`` or ``node.I.mem_gb|mem_total_gb``."""
        name, labels, value = sample.name, sample.labels, sample.value
        if name == "ray_node_gpus_utilization":
            return {f"node.{node_idx}.gpu.{labels['GpuIndex']}.util": value}
        if name == "ray_node_gram_used":
            return {f"node.{node_idx}.gpu.{labels['GpuIndex']}.mem_gb": value / 1024}
        if name == "ray_node_mem_used":
            return {f"node.{node_idx}.mem_gb": value / 1024**3}
        if name == "ray_node_mem_total":
            return {f"node.{node_idx}.mem_total_gb": value / 1024**3}
        return {}

    def _parse_gpu_sku(self, sample: Any, node_idx: int) -> dict[str, str]:
        """``node.I.gpu.J.type``: the device name of a GPU sample."""
        labels = sample.labels
        if "GpuIndex" not in labels or "GpuDeviceName" not in labels:
            return {}
        if sample.name not in ("ray_node_gpus_utilization", "ray_node_gram_used"):
            return {}
        return {f"node.{node_idx}.gpu.{labels['GpuIndex']}.type": labels["GpuDeviceName"]}

    def _collect_gpu_sku(self) -> dict[str, str]:
        return self._collect(sku=True)

    def _collect_metrics(self) -> dict[str, Any]:
        return self._collect(metrics=True)

    def _collect(self, metrics: bool = False, sku: bool = False) -> dict[str, Any]:
        assert metrics ^ sku, "collect either metrics or SKUs"
        parser = self._parse_metric if metrics else self._parse_gpu_sku
        try:
            ray = self._ray()
            if not ray.is_initialized():
                print("Ray is not initialized. Cannot collect GPU metrics.")
                return {}
            nodes = ray.nodes()
            if not nodes:
                print("No Ray nodes found.")
                return {}
            addresses = list(dict.fromkeys(
                f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}"
                for n in nodes if n.get("MetricsExportPort")
            ))  # fmt: skip
            out: dict[str, Any] = {}
            for idx, address in enumerate(addresses):
                out.update(self._fetch_and_parse_metrics(idx, address, parser))
            return out
        except Exception as exc:
            print(f"Error collecting GPU metrics: {exc}")
            return {}

    def _fetch_and_parse_metrics(
        self, node_idx: int, metric_address: str, parser_fn: Callable[[Any, int], dict[str, Any]]
    ) -> dict[str, Any]:
        from ranklog.producer._gpu import parse_prometheus

        try:
            with self._open(f"http://{metric_address}/metrics", timeout=5.0) as resp:
                if resp.status != 200:
                    print(f"Error: Status code {resp.status}")
                    return {}
                text = resp.read().decode("utf-8", "replace")
            out: dict[str, Any] = {}
            for name, labels, value in parse_prometheus(text):
                out.update(parser_fn(Sample(name, labels, value), node_idx))
            return out
        except Exception as exc:
            print(f"Error fetching metrics from {metric_address}: {exc}")
            return {}

    def flush(self) -> None:
        """Log every buffered snapshot through the parent logger, then empty the buffer."""
        with self.lock:
            if not self.metrics_buffer:
                return
            if self.parent_logger is not None:
                for snapshot in self.metrics_buffer:
                    snapshot["metrics"][self.step_metric] = snapshot["step"]
                    self.parent_logger.log_metrics(
                        snapshot["metrics"],
                        step=snapshot["step"],
                        prefix=self.metric_prefix,
                        step_metric=self.step_metric,
                    )
            self.metrics_buffer = []
