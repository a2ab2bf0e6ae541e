"""Errors and warnings raised by ranklog: one tree, each class with its own CLI exit code.

Every exception ranklog raises on purpose derives from :class:`RanklogError`.
Errors of bad input also derive from the built-in they stand for, so code that
catches ``TypeError`` or ``ValueError`` keeps working::

    RanklogError                          exit 1   base class; never raised itself
    ├── ConfigError(ValueError)           exit 2   a bad argument, option, environment
    │                                              variable or path (spool, dataset, target)
    ├── InvalidValueError(TypeError)      -        a logged value or name that is not
    │                                              acceptable (the message names the key)
    ├── InvalidStepError(ValueError)      -        a step that is negative or not an int
    ├── SpoolError                        exit 3   the spool on disk
    │   ├── SpoolFormatError                       a file that is not a segment, or a
    │   │                                          damaged header or run.json
    │   ├── SpoolWriteError(OSError)               a write the producer could not complete
    │   │                                          (the bytes are kept and retried)
    │   ├── RunMismatchError                       a segment, cursor or dataset of another run
    │   ├── CursorError                            a shipper's cursor that cannot be used
    │   └── LeaseHeldError                         another shipper holds this (spool, target),
    │                                              or another compaction holds this dataset
    ├── ArchiveError                      exit 4   a Parquet dataset that is missing, damaged
    │                                              or not ranklog's
    ├── TargetError                       exit 5   a backend that refuses what it is sent
    │   ├── TransientTargetError                   worth retrying (server down or hung, rate
    │   │                                          limited, disk full): the shipper backs off,
    │   │                                          within --retry-for under --once
    │   └── TargetHeldError                        the target holds another run, or steps of
    │                                              this one it cannot take again (W&B below
    │                                              its last step): refused before writing
    ├── ExtraMissingError(ImportError)    exit 6   an optional dependency is not installed
    ├── UnsupportedError(AttributeError)  -        an attribute of a backend's client that
    │                                              ranklog.nemo's stand-in does not offer
    └── TailRestartedError                -        internal: a reader actor restarted during
                                                   a round; the shipper reads again

    RanklogWarning(UserWarning)           once-per-cause warnings: late steps, backpressure,
                                          an unwritable spool, a corrupt frame skipped

Corrupt bytes in a spool are never raised: readers report them as
:class:`ranklog.spool.BadRange` records naming the file and the offset.
The ``ranklog`` command prints a :class:`RanklogError` as one line on stderr and
exits with the class's :attr:`RanklogError.exit_code`; it never shows a traceback.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "ArchiveError",
    "ConfigError",
    "CursorError",
    "ExtraMissingError",
    "InvalidStepError",
    "InvalidValueError",
    "LeaseHeldError",
    "RanklogError",
    "RanklogWarning",
    "RunMismatchError",
    "SpoolError",
    "SpoolFormatError",
    "SpoolWriteError",
    "TailRestartedError",
    "TargetError",
    "TargetHeldError",
    "TransientTargetError",
    "UnsupportedError",
]


class RanklogError(Exception):
    """Base class of every error ranklog raises on purpose."""

    #: what ``ranklog`` exits with when this error ends a command
    exit_code: ClassVar[int] = 1


class ConfigError(RanklogError, ValueError):
    """A bad argument, option, environment variable or path."""

    exit_code = 2


class InvalidValueError(RanklogError, TypeError):
    """A logged value or name that is not acceptable; the message names the key."""

    exit_code = 2


class InvalidStepError(RanklogError, ValueError):
    """A step that is negative or not an integer."""

    exit_code = 2


class SpoolError(RanklogError):
    """Something about the spool directory or its files."""

    exit_code = 3


class SpoolFormatError(SpoolError):
    """A file that is not a ranklog segment, or whose header is damaged."""


class SpoolWriteError(SpoolError, OSError):
    """A write to the spool failed; the producer keeps the bytes and retries."""


class RunMismatchError(SpoolError):
    """A segment, cursor, dataset or run.json that belongs to another run."""


class CursorError(SpoolError):
    """A shipper's cursor that is unreadable, or belongs to another target."""


class LeaseHeldError(SpoolError):
    """Another live shipper holds the lease of this (spool, target), or another compaction
    the lock of this dataset."""


class ArchiveError(RanklogError):
    """A Parquet dataset that is missing, damaged, or not one ``ranklog compact`` wrote."""

    exit_code = 4


class TargetError(RanklogError):
    """A backend that refuses what it is sent, or a target used wrongly."""

    exit_code = 5


class TransientTargetError(TargetError):
    """A backend failure worth retrying (server down or hung, rate limited, disk full)."""


class TargetHeldError(TargetError):
    """A target that holds another run (or this run's steps with another ``--names``), or
    steps it cannot take (W&B below its last step): refused, nothing written."""


class ExtraMissingError(RanklogError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    exit_code = 6

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(f"{module} is not installed: pip install 'ranklog[{extra}]'", name=module)
        self.extra = extra


class UnsupportedError(RanklogError, AttributeError):
    """What a backend's client offers and ranklog.nemo's stand-in for it does not (the
    client lives in a shipper process): the message names the attribute and what to use."""


class TailRestartedError(RanklogError):
    """A tail lost its memory during a round (a reader actor restarted): read again."""


class RanklogWarning(UserWarning):
    """Warnings ranklog emits (each cause at most once per process)."""
