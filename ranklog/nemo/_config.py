"""NeMo RL's logger configuration, as the TypedDicts ``nemo_rl.utils.logger`` declares."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

__all__ = [
    "GPUMonitoringConfig",
    "GpuMetricSnapshot",
    "LoggerConfig",
    "MLflowConfig",
    "SwanlabConfig",
    "TensorboardConfig",
    "WandbConfig",
]


class WandbConfig(TypedDict):
    """``logger.wandb``: passed to ``wandb.init`` (``id``, ``resume``, ``tags``, ... too)."""

    project: NotRequired[str]
    name: NotRequired[str]
    entity: NotRequired[str]
    log_nemo_gym_full_result_tables: NotRequired[bool]


class SwanlabConfig(TypedDict):
    """``logger.swanlab``."""

    project: NotRequired[str]
    name: NotRequired[str]


class TensorboardConfig(TypedDict):
    """``logger.tensorboard`` (NeMo RL writes to ``<log_dir>/tensorboard`` whatever it says)."""

    log_dir: NotRequired[str]


class MLflowConfig(TypedDict):
    """``logger.mlflow``: each falls back to its ``MLFLOW_*`` environment variable."""

    experiment_name: NotRequired[str | None]
    run_id: NotRequired[str | None]
    run_name: NotRequired[str | None]
    tracking_uri: NotRequired[str | None]
    artifact_location: NotRequired[str | None]


class GPUMonitoringConfig(TypedDict):
    """``logger.gpu_monitoring``: seconds between samples, and between flushes."""

    collection_interval: int | float
    flush_interval: int | float


class LoggerConfig(TypedDict):
    """``logger``: which backends, where, and GPU monitoring."""

    log_dir: str
    wandb_enabled: bool
    swanlab_enabled: bool
    tensorboard_enabled: bool
    mlflow_enabled: bool
    wandb: WandbConfig
    tensorboard: NotRequired[TensorboardConfig]
    swanlab: NotRequired[SwanlabConfig]
    mlflow: NotRequired[MLflowConfig]
    monitor_gpus: bool
    gpu_monitoring: GPUMonitoringConfig
    num_val_samples_to_print: NotRequired[int]


class GpuMetricSnapshot(TypedDict):
    """One collection of :class:`RayGpuMonitorLogger`: its step (seconds) and metrics."""

    step: int
    metrics: dict[str, Any]
