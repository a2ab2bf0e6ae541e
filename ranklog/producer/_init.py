"""``ranklog.init``: where the spool is, which rank this is, and the :class:`Run` for it."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ranklog.errors import ConfigError
from ranklog.producer._env import detect_rank
from ranklog.producer._run import SPOOL_ENV, Durability, Run
from ranklog.spool import DEFAULT_SEGMENT_BYTES

__all__ = ["init"]


def init(
    spool: str | os.PathLike[str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    durability: Durability = "step",
    flush_interval: float = 1.0,
    max_buffer_bytes: int = 64 * 1024 * 1024,
    heartbeat_interval: float = 10.0,
    max_segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    name: str | None = None,
    handle_signals: bool = True,
    gpu: Any = "off",
    gpu_interval: float = 10.0,
    host: str | None = None,
    redact: Iterable[str] = (),
    code: bool | None = None,
) -> Run:
    """Start logging this rank into ``spool`` (default: ``$RANKLOG_SPOOL``).

    Rank, world size and local rank come from the arguments, else from torchrun,
    SLURM, Open MPI or PMI variables, else rank 0 of 1. A restarted rank (SLURM
    requeue, restart from checkpoint) writes a new incarnation in the same spool.

    ``gpu`` (``"off"``, ``"auto"``, ``"nvml"``, ``"ray"`` or a source object) starts a
    background GPU sampler every ``gpu_interval`` seconds on one process per host (local
    rank 0, or whoever holds the host's lock in the spool when local ranks are unknown).
    ``host`` names this machine in ``rank_start`` and GPU events and keys that election
    (default: the hostname; :func:`ranklog.ray.init` passes the Ray node's IP).
    ``redact``: shell globs of hyperparameter keys to redact besides the built-in rule
    (and ``$RANKLOG_REDACT``), e.g. ``["*.db_url"]``.
    ``code``: rank 0 records the git commit, branch, dirty flag and diff of the repository
    it runs in (docs/producer.md); default: on, unless ``$RANKLOG_CODE`` is ``0``.
    """
    if spool is None:
        spool = os.environ.get(SPOOL_ENV)
        if not spool:
            raise ConfigError(f"no spool given: pass ranklog.init(PATH) or set ${SPOOL_ENV}")
    who = detect_rank(rank, world_size, local_rank)
    return Run(
        spool,
        rank=who.rank,
        world_size=who.world_size,
        local_rank=who.local_rank,
        durability=durability,
        flush_interval=flush_interval,
        max_buffer_bytes=max_buffer_bytes,
        heartbeat_interval=heartbeat_interval,
        max_segment_bytes=max_segment_bytes,
        name=name,
        handle_signals=handle_signals,
        gpu=gpu,
        gpu_interval=gpu_interval,
        host=host,
        redact=redact,
        code=code,
    )
