"""Errors and warnings raised by ranklog.

Every exception ranklog raises on purpose derives from :class:`RanklogError`.
Input errors additionally derive from the built-in they stand for, so code that
catches ``TypeError`` or ``ValueError`` keeps working::

    RanklogError
    ├── ConfigError(ValueError)          bad argument, environment variable or spool path
    ├── InvalidValueError(TypeError)     a logged value that is not a real number (names the key)
    ├── InvalidStepError(ValueError)     a step that is negative or not an int
    ├── SpoolError                       the spool on disk
    │   ├── SpoolFormatError             a file that is not a segment, or a damaged header
    │   ├── SpoolWriteError(OSError)     a write the producer could not complete (kept, retried)
    │   └── RunMismatchError             a segment or run.json of another run
    └── ExtraMissingError(ImportError)   an optional backend is not installed

    RanklogWarning(UserWarning)          once-per-cause warnings: late steps, backpressure,
                                          an unwritable spool, a corrupt frame skipped

Corrupt bytes in a spool are never raised: readers report them as
:class:`ranklog.spool.BadRange` records naming the file and the offset.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ExtraMissingError",
    "InvalidStepError",
    "InvalidValueError",
    "RanklogError",
    "RanklogWarning",
    "RunMismatchError",
    "SpoolError",
    "SpoolFormatError",
    "SpoolWriteError",
]


class RanklogError(Exception):
    """Base class of every error ranklog raises on purpose."""


class ConfigError(RanklogError, ValueError):
    """A bad argument, environment variable or spool location."""


class InvalidValueError(RanklogError, TypeError):
    """A logged value that is not a real number; the message names the key."""


class InvalidStepError(RanklogError, ValueError):
    """A step that is negative or not an integer."""


class SpoolError(RanklogError):
    """Something about the spool directory or its files."""


class SpoolFormatError(SpoolError):
    """A file that is not a ranklog segment, or whose header is damaged."""


class SpoolWriteError(SpoolError, OSError):
    """A write to the spool failed; the producer keeps the bytes and retries."""


class RunMismatchError(SpoolError):
    """A segment or run.json that belongs to another run."""


class ExtraMissingError(RanklogError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(f"{module} is not installed: pip install 'ranklog[{extra}]'", name=module)
        self.extra = extra


class RanklogWarning(UserWarning):
    """Warnings ranklog emits (each cause at most once per process)."""
