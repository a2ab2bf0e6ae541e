"""ranklog: crash-resilient metrics logging for distributed training.

Every rank appends its events to its own segment files in a spool directory;
shipper processes reduce each step across ranks and forward it to TensorBoard,
MLflow, Weights & Biases or JSONL, exactly once.

``import ranklog`` is light: it imports neither pyarrow nor any backend.
"""

from ranklog._version import __version__
from ranklog.errors import (
    ArchiveError,
    ConfigError,
    CursorError,
    ExtraMissingError,
    InvalidStepError,
    InvalidValueError,
    LeaseHeldError,
    RanklogError,
    RanklogWarning,
    RunMismatchError,
    SpoolError,
    SpoolFormatError,
    SpoolWriteError,
    TailRestartedError,
    TargetError,
    TargetHeldError,
    TransientTargetError,
    UnsupportedError,
)
from ranklog.producer import Durability, Run, init

__all__ = [
    "ArchiveError",
    "ConfigError",
    "CursorError",
    "Durability",
    "ExtraMissingError",
    "InvalidStepError",
    "InvalidValueError",
    "LeaseHeldError",
    "RanklogError",
    "RanklogWarning",
    "Run",
    "RunMismatchError",
    "SpoolError",
    "SpoolFormatError",
    "SpoolWriteError",
    "TailRestartedError",
    "TargetError",
    "TargetHeldError",
    "TransientTargetError",
    "UnsupportedError",
    "__version__",
    "init",
]
