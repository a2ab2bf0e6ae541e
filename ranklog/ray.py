"""Ray helpers: a producer per Ray worker with the right rank, one GPU sampler per Ray node.

Call :func:`init` where the training code runs: in an actor's ``__init__``, in a task,
or in a Ray Train training function (rank, world size and local rank then come from
``ray.train.get_context()``)::

    import ray
    import ranklog.ray

    @ray.remote(num_gpus=1)
    class Trainer:
        def __init__(self, spool: str, rank: int, world_size: int) -> None:
            self.run = ranklog.ray.init(spool, rank=rank, world_size=world_size)

        def train_step(self, step: int) -> None:
            loss = ...
            self.run.log_metrics({"loss": loss}, step=step, prefix="train")
            self.run.step_end(step)

        def close(self) -> None:
            self.run.close()

    trainers = [Trainer.remote("/nfs/runs/exp1", r, 8) for r in range(8)]

Every process is named by its Ray node's IP (the ``ip`` label of Ray's own metrics), in
``rank_start`` and in GPU events, whichever source sampled them. One process per node
samples the GPUs: local rank 0 when local ranks are known (Ray Train, ``local_rank=``,
``LOCAL_RANK``), else the first to take the node's lock in the spool. ``gpu="auto"``
reads NVML (every GPU of the node, whatever ``CUDA_VISIBLE_DEVICES`` says) and falls back
to the node's Ray metrics endpoint. ``gpu="cluster"`` samples every node of the cluster
from this one process through Ray's metrics, as NeMo RL does from its driver: use it in a
single controller that logs for the whole job, and ``gpu="off"`` in the workers then.

``import ranklog.ray`` does not import ray; :func:`init` does (``pip install 'ranklog[ray]'``).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Final, TypedDict, Unpack

from ranklog.errors import ConfigError, ExtraMissingError
from ranklog.producer import Durability, Run, detect_rank
from ranklog.producer import init as _init

if TYPE_CHECKING:
    from ranklog.producer._gpu import GpuSource

__all__ = ["InitOptions", "init", "node_host"]

CLUSTER: Final = "cluster"


class InitOptions(TypedDict, total=False):
    """The keyword arguments :func:`init` passes on to :func:`ranklog.init` unchanged."""

    durability: Durability
    flush_interval: float
    max_buffer_bytes: int
    heartbeat_interval: float
    max_segment_bytes: int
    name: str | None
    handle_signals: bool
    gpu_interval: float


def init(
    spool: str | os.PathLike[str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    gpu: str | GpuSource = "auto",
    **options: Unpack[InitOptions],
) -> Run:
    """Start logging this Ray worker (or driver) as one rank of the job into ``spool``.

    Each of rank, world size and local rank comes from the argument, else from the Ray
    Train context (inside a training function), else from launcher variables in the
    environment (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, as NeMo RL and Ray Train's torch
    backend set them). A missing rank or world size is a ConfigError: a Ray actor has no
    rank of its own. Ray must be initialised (any worker is; a driver after ``ray.init``).

    ``gpu``: ``"auto"`` (NVML, else this node's Ray metrics), ``"nvml"``, ``"ray"``,
    ``"cluster"`` (every node's Ray metrics), ``"off"``, or a source object. The other
    keyword arguments are those of :func:`ranklog.init`.
    """
    ray = _ray()
    if not ray.is_initialized():
        raise ConfigError(
            "ranklog.ray.init() runs in a Ray task or actor, or in a driver after ray.init(); "
            "elsewhere use ranklog.init()"
        )
    t_rank, t_world, t_local = _train_ranks() or (None, None, None)
    rank = t_rank if rank is None else rank
    world_size = t_world if world_size is None else world_size
    local_rank = t_local if local_rank is None else local_rank
    who = detect_rank(rank, world_size, local_rank)  # launcher variables fill the rest
    guessed = who.source == "default"  # nothing given, no launcher variables: "rank 0 of 1"
    missing = [
        name
        for name, given, got in (
            ("rank", rank, who.rank),
            ("world_size", world_size, who.world_size),
        )
        if given is None and (got is None or guessed)
    ]
    if missing:
        raise ConfigError(
            f"ranklog.ray.init(): no {' and no '.join(missing)} for this Ray worker: pass "
            "rank= and world_size= (an actor's index and the number of actors, say), or "
            "call it inside a Ray Train training function"
        )
    source: Any = gpu
    if gpu == CLUSTER:
        from ranklog.producer._gpu import RaySource

        source = RaySource(scope="cluster")
    return _init(
        spool,
        rank=who.rank,
        world_size=who.world_size,
        local_rank=who.local_rank,
        gpu=source,
        host=node_host(),
        **options,
    )


def node_host() -> str:
    """This Ray node's IP, as Ray's metrics label it: the host :func:`init` logs under."""
    return str(_ray().util.get_node_ip_address())


def _ray() -> Any:
    try:
        import ray
        import ray.util
    except ImportError:
        raise ExtraMissingError("ray", "ray") from None
    return ray


def _train_ranks() -> tuple[int, int, int] | None:
    """(world rank, world size, local rank) from Ray Train; None outside a training function."""
    if "ray.train" not in sys.modules:  # a Train worker has imported it: spare others ~1 s
        return None
    try:
        import ray.train

        ctx = ray.train.get_context()  # Train v2: RuntimeError outside a training function
        if type(ctx).__module__ == "ray.train.context":  # Train v1: a context anywhere
            from ray.train._internal.session import get_session

            if get_session() is None:  # ... whose ranks outside a session are 0
                return None
        return int(ctx.get_world_rank()), int(ctx.get_world_size()), int(ctx.get_local_rank())
    except Exception:  # also Ray Tune's DeprecationWarning: pass the ranks explicitly there
        return None
