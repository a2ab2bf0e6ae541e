"""A drop-in for NeMo RL's ``Logger``: change one import, keep the config.

::

    # from nemo_rl.utils.logger import Logger
    from ranklog.nemo import Logger

    logger = Logger(cfg["logger"])          # the same dict NeMo RL takes
    logger.log_hyperparams(cfg)
    logger.log_metrics({"loss": loss}, step, prefix="train", step_finished=True)
    logger.finish()

Every process that creates a ``Logger`` writes to a ranklog spool under
``log_dir/spool``; the process that owns the run (rank 0 unless
``cfg["ranklog"]["owner_rank"]`` says otherwise) starts one shipper process per
enabled backend (TensorBoard under ``log_dir/tensorboard``, MLflow at
``mlflow.tracking_uri`` or ``sqlite:///log_dir/mlflow.db``, W&B with
``wandb.project``/``name``), and, when ``num_val_samples_to_print`` > 0, a
console shipper that prints that many validation samples per step. Training
never waits on a backend; a crash loses nothing that was closed
(``step_finished=True``, or a later step).

Config keys read: ``log_dir``, ``wandb_enabled``, ``tensorboard_enabled``,
``mlflow_enabled``, ``wandb`` (``project``, ``name``, ``entity``, ``group``,
``mode``), ``mlflow`` (``experiment_name``,
``run_name``, ``tracking_uri``), ``monitor_gpus``, ``gpu_monitoring``,
``num_val_samples_to_print``, and ranklog's own ``ranklog`` section
(``durability``, ``owner_rank``, ``shutdown_timeout``).

``monitor_gpus`` in a Ray driver (NeMo RL's single controller: ``ray.init()`` was
called in this process) samples every node of the cluster through Ray's metrics, as
NeMo RL's ``RayGpuMonitorLogger`` does; elsewhere this host's GPUs (``gpu="auto"``).
"""

from __future__ import annotations

import abc
import json
import logging
import numbers
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ranklog

__all__ = ["Logger", "LoggerInterface"]

log = logging.getLogger("ranklog.nemo")


class LoggerInterface(abc.ABC):
    """NeMo RL's logger interface, as the methods this facade implements."""

    @abc.abstractmethod
    def log_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        """Log a dictionary of metrics."""

    @abc.abstractmethod
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Log hyperparameters."""


class Logger(LoggerInterface):
    """NeMo RL's ``Logger`` on top of ranklog: same config, same methods."""

    def __init__(
        self,
        cfg: Mapping[str, Any],
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.get("log_dir") or "logs")
        own = dict(cfg.get("ranklog") or {})
        self.spool = self.log_dir / "spool"
        name = _first(cfg, ("wandb", "name"), ("mlflow", "run_name")) or self.log_dir.name
        gpu_cfg = cfg.get("gpu_monitoring") or {}
        self.run = ranklog.init(
            self.spool,
            rank=rank,
            world_size=world_size,
            durability=own.get("durability", "step"),
            name=name,
            gpu=_gpu_source() if cfg.get("monitor_gpus") else "off",
            gpu_interval=float(gpu_cfg.get("collection_interval") or 10.0),
        )
        self.num_val_samples_to_print = int(cfg.get("num_val_samples_to_print") or 0)
        self.shutdown_timeout = float(own.get("shutdown_timeout", 120.0))
        self._skipped: set[str] = set()
        self._shippers: list[subprocess.Popen[bytes]] = []
        if self.run.rank == int(own.get("owner_rank", 0)):
            self._start_shippers()

    # -- shippers ---------------------------------------------------------------------------

    def shipper_commands(self) -> list[list[str]]:
        """The ``ranklog ship`` command line of each enabled backend.

        Each target declares its NeMo config section and keys (``TargetKind.nemo_*``,
        ``Option.nemo``): the commands follow from those declarations.
        """
        from ranklog.shippers import target_kinds

        base = [sys.executable, "-m", "ranklog.cli", "ship", str(self.spool), "--quiet"]
        cmds: list[list[str]] = []
        for kind in target_kinds().values():
            flags = kind.nemo_command(self.cfg, self.log_dir)
            if flags is not None:
                cmds.append([*base, *flags])
        if self.num_val_samples_to_print > 0:
            # every step with text (validation samples) and every partial step is printed
            cmds.append([*base, "--to", f"console:{10**9}", "--samples",
                         str(self.num_val_samples_to_print)])  # fmt: skip
        return cmds

    def _start_shippers(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for cmd in self.shipper_commands():
            self._shippers.append(subprocess.Popen(cmd))

    # -- LoggerInterface --------------------------------------------------------------------

    def log_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        """Log the numbers of ``metrics`` at ``step`` (strings as text; others skipped once).

        ``step_finished=True`` closes the step (ranklog's ``step_end``). ``step_metric``
        is accepted for compatibility: ranklog plots every value against ``step``.
        """
        numbers_: dict[str, Any] = {}
        for key, value in metrics.items():
            if isinstance(value, numbers.Real) or _is_scalar_array(value):
                numbers_[key] = value
            elif isinstance(value, str):
                name = f"{prefix}/{key}" if prefix else key
                self.run.log_text(name, value, step=step)
            elif key not in self._skipped:
                self._skipped.add(key)
                log.info("ranklog.nemo: %r is not a number (%s); not logged as a metric",
                         key, type(value).__name__)  # fmt: skip
        if numbers_:
            self.run.log_metrics(numbers_, step=step, prefix=prefix or None)
        if step_finished:
            self.run.step_end(step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Log hyperparameters (nested dicts flattened with ".", secrets redacted)."""
        self.run.log_hyperparams(params)

    def log_histogram(self, histogram: Any, step: int, name: str) -> None:
        """Log a distribution: a histogram in TensorBoard and W&B, summary stats in MLflow."""
        self.run.log_histogram(name, histogram, step=step)

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        """Log a matplotlib figure as an image (TensorBoard image, W&B image, MLflow artifact)."""
        self.run.log_image(name, figure, step=step)

    def log_batched_dict_as_jsonl(self, to_log: Mapping[str, Any], filename: str) -> None:
        """Write a dict of equal-length lists as JSONL, one line per index, under log_dir."""
        path = self.log_dir / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        n = max((len(v) for v in to_log.values() if isinstance(v, list)), default=0)
        with open(path, "w") as f:
            for i in range(n):
                row = {k: (v[i] if isinstance(v, list) else v) for k, v in to_log.items()}
                f.write(json.dumps(row, default=str) + "\n")

    def finish(self) -> None:
        """Close this rank; the owner then waits for its shippers to drain and stop."""
        self.run.close()
        for proc in self._shippers:
            try:
                proc.wait(timeout=self.shutdown_timeout)
            except subprocess.TimeoutExpired:
                log.warning("ranklog.nemo: shipper %s still busy after %.0fs; stopping it "
                            "(the spool keeps everything: run `ranklog ship` later)",
                            proc.args, self.shutdown_timeout)  # fmt: skip
                proc.terminate()
                proc.wait(timeout=30)
        self._shippers.clear()

    close = finish


def _first(cfg: Mapping[str, Any], *paths: tuple[str, str]) -> str | None:
    for section, key in paths:
        value = (cfg.get(section) or {}).get(key)
        if value:
            return str(value)
    return None


def _is_scalar_array(value: object) -> bool:
    size = getattr(value, "numel", None)
    n = size() if callable(size) else getattr(value, "size", None)
    return isinstance(n, int) and n == 1 and hasattr(value, "item")


def _gpu_source() -> Any:
    """Every node's GPUs from a Ray driver (as NeMo RL), else ``"auto"`` (this host's)."""
    ray = sys.modules.get("ray")  # never imported here: only a process that uses Ray has it
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        from ranklog.producer._gpu import RaySource

        return RaySource(scope="cluster")
    return "auto"
