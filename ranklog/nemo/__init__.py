"""A drop-in for NeMo RL's ``nemo_rl.utils.logger``: every public name, the same config.

::

    import ranklog.nemo
    ranklog.nemo.install()          # before NeMo RL is imported
    # ... NeMo RL's own code: from nemo_rl.utils.logger import Logger -> ranklog's

or ``python -m ranklog.nemo examples/run_grpo.py ...``, or change one import
(``from ranklog.nemo import Logger``). Every rank that builds a ``Logger`` writes a
ranklog spool under ``log_dir/spool``; shipper processes forward closed steps to
TensorBoard, W&B and MLflow where NeMo RL's backends would write. docs/nemo.md lists
what differs from NeMo RL, one line each.
"""

from __future__ import annotations

import logging as _logging
import os as _os

from ranklog.nemo._backends import (
    LoggerInterface,
    MLflowLogger,
    RayGpuMonitorLogger,
    SwanlabLogger,
    TensorboardLogger,
    WandbLogger,
)
from ranklog.nemo._config import (
    GpuMetricSnapshot,
    GPUMonitoringConfig,
    LoggerConfig,
    MLflowConfig,
    SwanlabConfig,
    TensorboardConfig,
    WandbConfig,
)
from ranklog.nemo._helpers import (
    configure_rich_logging,
    flatten_dict,
    get_next_experiment_dir,
    log_container_init_timing,
    print_message_log_samples,
    should_log_nemo_gym_full_result_tables,
)
from ranklog.nemo._helpers import (
    merge_generation_logger_workers as _merge_generation_logger_workers,
)
from ranklog.nemo._helpers import summarize_list as _summarize_list
from ranklog.nemo._install import install, uninstall
from ranklog.nemo._logger import Logger

__all__ = [
    "GPUMonitoringConfig",
    "GpuMetricSnapshot",
    "Logger",
    "LoggerConfig",
    "LoggerInterface",
    "MLflowConfig",
    "MLflowLogger",
    "RayGpuMonitorLogger",
    "SwanlabConfig",
    "SwanlabLogger",
    "TensorboardConfig",
    "TensorboardLogger",
    "WandbConfig",
    "WandbLogger",
    "_merge_generation_logger_workers",
    "_summarize_list",
    "configure_rich_logging",
    "flatten_dict",
    "get_next_experiment_dir",
    "install",
    "log_container_init_timing",
    "print_message_log_samples",
    "should_log_nemo_gym_full_result_tables",
    "uninstall",
]

# NeMo RL's package sets its logger's level from NRL_LOG_LEVEL (INFO by default) when it
# is imported; ranklog.nemo's records go to NeMo's logger names, so the same variable
# turns them on where NeMo RL itself is not imported (a level already set is kept)
if _logging.getLogger("nemo_rl").level == _logging.NOTSET:
    _logging.getLogger("nemo_rl").setLevel(_os.environ.get("NRL_LOG_LEVEL", "INFO").upper())
