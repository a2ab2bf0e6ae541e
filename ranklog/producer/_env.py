"""Who am I: rank, world size and local rank from the launcher's environment.

Precedence: explicit arguments, then torchrun (``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``), SLURM (``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``),
Open MPI (``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``), PMI (``PMI_RANK``/
``PMI_SIZE``, local rank from ``MPI_LOCALRANKID``), else a single process
(rank 0 of 1). torchrun wins over SLURM because under ``srun torchrun`` the
SLURM variables describe the launcher, not the worker.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ranklog.errors import ConfigError

__all__ = ["RankInfo", "detect_rank"]

#: (source name, rank variable, world size variable, local rank variable)
_SOURCES: Final = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this process sits in the job, and which launcher said so."""

    rank: int
    world_size: int | None
    local_rank: int | None
    source: str


def _int_var(env: Mapping[str, str], name: str | None) -> int | None:
    if name is None or name not in env:
        return None
    raw = env[name].strip()
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < 0:
        raise ConfigError(f"environment variable {name}={raw!r} is negative")
    return value


def detect_rank(
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    env: Mapping[str, str] | None = None,
) -> RankInfo:
    """Resolve rank, world size and local rank; explicit arguments win over the environment."""
    env = os.environ if env is None else env
    source, names = "default", ("rank", "world_size", "local_rank")
    found: tuple[int | None, int | None, int | None] = (None, None, None)
    for name, rank_var, world_var, local_var in _SOURCES:
        if rank_var in env:
            source, names = name, (rank_var, world_var, local_var)
            found = (_int_var(env, rank_var), _int_var(env, world_var), _int_var(env, local_var))
            break
    if rank is not None:
        source, names = "argument", ("rank", "world_size", "local_rank")
    r = rank if rank is not None else (found[0] or 0)
    w = world_size if world_size is not None else found[1]
    lr = local_rank if local_rank is not None else found[2]
    for label, value, minimum in (("rank", r, 0), ("world_size", w, 1), ("local_rank", lr, 0)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < minimum
        ):
            raise ConfigError(f"{label} must be an int >= {minimum}, got {value!r}")
    if w is not None and r >= w:
        raise ConfigError(
            f"rank {r} ({names[0]}) is not below world size {w} ({names[1]}, from {source})"
        )
    if w is None and source == "default":
        w = 1
    return RankInfo(rank=r, world_size=w, local_rank=lr, source=source)
