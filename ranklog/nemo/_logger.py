"""``Logger``: NeMo RL's logger facade, writing one ranklog spool under ``log_dir``.

It takes NeMo's ``logger`` config unchanged. Each process that builds one writes to
``<log_dir>/spool``; the one that owns the job (rank 0 unless ``ranklog.owner_rank``
says otherwise) starts a ``ranklog ship`` process per enabled backend, each writing
where NeMo's backend writes (``<log_dir>/tensorboard``, ``<log_dir>/wandb`` ...), and,
when ``num_val_samples_to_print`` > 0, a console shipper printing validation samples.
Training never waits on a backend; a crash loses nothing already closed.

ranklog's own keys go in an optional ``ranklog`` section of the logger config:
``durability``, ``owner_rank``, ``rank``, ``world_size``, ``shutdown_timeout``,
``close_after`` (the prefixes whose call ends a step; default ``["timing/train"]``),
``late`` and ``leave_out`` (per backend section, the kinds of values it is not given:
``{"tensorboard": ["histograms", "texts"]}``; docs/nemo.md).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ranklog.nemo._backends import (
    GpuSamplerMonitor,
    LoggerInterface,
    MLflowLogger,
    OnSession,
    SwanlabLogger,
    TensorboardLogger,
    WandbLogger,
)
from ranklog.nemo._config import LoggerConfig
from ranklog.nemo._plots import plot_per_worker_timeline, plot_token_mult_prob_error
from ranklog.nemo._session import (
    Session,
    leave_out_flags,
    ship_command,
    write_batched_jsonl,
    write_string_lines,
)

__all__ = ["Logger"]

log = logging.getLogger("ranklog.nemo")


class Logger(OnSession):
    """NeMo RL's ``Logger`` on top of ranklog: the same config, every method NeMo calls."""

    def __init__(self, cfg: LoggerConfig) -> None:
        c: Mapping[str, Any] = cfg
        self.loggers: list[LoggerInterface] = []
        self.wandb_logger: WandbLogger | None = None
        self.swanlab_logger: SwanlabLogger | None = None
        self.gpu_monitor: GpuSamplerMonitor | None = None
        self.base_log_dir: str = c["log_dir"]
        os.makedirs(self.base_log_dir, exist_ok=True)
        self.log_dir = Path(self.base_log_dir)
        gpu_cfg: Mapping[str, Any] = c.get("gpu_monitoring") or {}
        monitor = bool(c.get("monitor_gpus"))
        collect = float(gpu_cfg.get("collection_interval") or 10.0)
        flush = float(gpu_cfg.get("flush_interval") or 10.0)
        self._session = Session(
            self.log_dir / "spool",
            self.shipper_commands(c),
            c.get("ranklog") or {},
            name=_run_name(c),
            gpu=_gpu_source() if monitor else "off",
            gpu_interval=collect,
            flush_interval=min(1.0, flush),
        )
        #: this rank's ranklog run (``logger.run.log_metrics(...)`` for ranklog's own API)
        self.run = self._session.run
        for section in ("wandb", "swanlab", "tensorboard", "mlflow"):  # NeMo's order
            if not c.get(f"{section}_enabled"):
                continue
            backend_dir = self.log_dir / section
            backend_dir.mkdir(parents=True, exist_ok=True)
            section_cfg: Mapping[str, Any] = c.get(section) or {}
            if section == "wandb":
                self.wandb_logger = WandbLogger._attached(
                    self._session, section_cfg, str(backend_dir)
                )
                self.loggers.append(self.wandb_logger)
            elif section == "swanlab":
                self.swanlab_logger = SwanlabLogger._attached(
                    self._session, section_cfg, str(backend_dir)
                )
                self.loggers.append(self.swanlab_logger)
            else:
                cls = TensorboardLogger if section == "tensorboard" else MLflowLogger
                self.loggers.append(cls._attached(self._session, section_cfg, str(backend_dir)))
        if monitor:
            if self.wandb_logger is not None:  # NeMo's x-axis of its GPU series
                prefix = GpuSamplerMonitor.metric_prefix
                self.wandb_logger.define_metric(f"{prefix}/*", GpuSamplerMonitor.step_metric)
            self.gpu_monitor = GpuSamplerMonitor(self._session, collect, flush)
        if not self.loggers:
            print("No loggers initialized")

    # -- shippers -----------------------------------------------------------------------

    @staticmethod
    def shipper_commands(cfg: Mapping[str, Any]) -> list[list[str]]:
        """The ``ranklog ship`` command of each enabled backend (and the console's).

        Each target declares its NeMo config section and keys (``TargetKind.nemo_*``,
        ``Option.nemo``): the commands follow from those declarations.
        """
        from ranklog.shippers import target_kinds

        log_dir = Path(cfg["log_dir"])
        base = ship_command(log_dir / "spool", cfg.get("ranklog") or {})
        cmds: list[list[str]] = []
        own = cfg.get("ranklog") or {}
        for kind in target_kinds().values():
            flags = kind.nemo_command(cfg, log_dir)
            if flags is not None:
                cmds.append([*base, *flags, *leave_out_flags(own, kind.nemo_section)])
        samples = int(cfg.get("num_val_samples_to_print") or 0)
        if samples > 0:  # every step with text (validation samples) and every partial step
            cmds.append([*base, "--to", f"console:{10**9}", "--samples", str(samples)])
        return cmds

    # -- NeMo's own plots and files -----------------------------------------------------

    def log_plot_token_mult_prob_error(self, data: dict[str, Any], step: int, name: str) -> None:
        """Plot the sample whose token multiplicative probability error is largest."""
        plot_token_mult_prob_error(data, step, name, self.log_plot)

    def log_plot_per_worker_timeline_metrics(
        self,
        metrics: dict[int, list[Any]],
        step: int,
        prefix: str,
        name: str,
        timeline_interval: float,
    ) -> None:
        """Plot per-worker samples taken every ``timeline_interval`` s, and their average."""
        plot_per_worker_timeline(metrics, step, prefix, name, timeline_interval, self.log_plot)

    def log_batched_dict_as_jsonl(self, to_log: Mapping[str, Any], filename: str) -> None:
        """Write ``to_log`` (equal-length columns) to ``<log_dir>/filename``, a line a row."""
        write_batched_jsonl(to_log, Path(self.base_log_dir, filename))

    def log_string_list_as_jsonl(self, to_log: list[str], filename: str) -> None:
        """Append JSON strings to ``<log_dir>/filename``, one per line."""
        write_string_lines(to_log, Path(self.base_log_dir, filename))

    def finish(self) -> None:
        """End logging: close the open step and the spool; the owner waits for its shippers."""
        monitor = getattr(self, "gpu_monitor", None)
        if monitor is not None:
            monitor.stop()
        session = getattr(self, "_session", None)
        if session is not None:
            session.finish()

    def __del__(self) -> None:
        monitor = getattr(self, "gpu_monitor", None)
        if monitor is not None:
            try:
                monitor.stop()
            except Exception as exc:  # at exit: nothing left to tell
                log.debug("ranklog.nemo: stopping the GPU monitor: %s", exc)


def _run_name(cfg: Mapping[str, Any]) -> str:
    for section, key in (("wandb", "name"), ("mlflow", "run_name")):
        value = (cfg.get(section) or {}).get(key)
        if value:
            return str(value)
    return Path(cfg["log_dir"]).name


def _gpu_source() -> Any:
    """Every node's GPUs and memory from a Ray driver (as NeMo RL's monitor), else this host's."""
    ray = sys.modules.get("ray")  # never imported here: only a process that uses Ray has it
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        from ranklog.producer._gpu import RaySource

        return RaySource(scope="cluster", host_memory=True)
    return "auto"
