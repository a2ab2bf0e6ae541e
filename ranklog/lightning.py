"""A PyTorch Lightning logger that logs from every rank into a ranklog spool.

::

    from ranklog.lightning import RanklogLogger

    trainer = L.Trainer(logger=RanklogLogger("/nfs/runs/exp1/spool"), strategy="ddp", ...)
    trainer.fit(model)                # self.log("train/loss", loss): no sync_dist needed

Lightning's own loggers decorate their methods with ``rank_zero_only``; this one does
not, so every rank writes what ``self.log(...)`` gave it, and ``ranklog ship`` reduces
each step across ranks (``mean`` unless ``reduce=`` says otherwise). The step is the
one Lightning logs with (the number of optimizer-stepping batches); ``"epoch"`` comes
along as Lightning adds it.

Steps are closed (``step_end``) when a rank logs a later step, and at the end of
``fit``/``validate``/``test`` (``finalize``) or of the process. Steps never go back: a
value Lightning logs for a lower step (step-level validation metrics count validation
batches; ``trainer.test()`` after ``fit`` logs at the last, already closed step) is
logged at the step this rank is in, or the next one.

``name`` is the spool's run name and ``version`` its run id, so the default checkpoint
directory, ``save_dir/name/version/checkpoints``, is the same on every rank and again
when the job restarts in the same spool: ``trainer.fit(model, ckpt_path="last")`` finds
it, and the restarted ranks continue the same run (as new incarnations).

Importing this module imports ``lightning`` (``pip install 'ranklog[lightning]'``);
``import ranklog`` does not.
"""

from __future__ import annotations

import os
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ranklog
from ranklog._adapters import OpenStep, Reduce, spool_of
from ranklog.errors import ExtraMissingError
from ranklog.spool import RunInfo, ensure_run

try:
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning.pytorch.callbacks import Checkpoint
    from lightning.pytorch.loggers import Logger
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ExtraMissingError("lightning", "lightning") from exc

__all__ = ["RanklogLogger"]


class RanklogLogger(Logger):
    """Lightning's ``Logger`` over a ranklog spool, called and writing on every rank.

    ``spool``: the spool directory (default ``$RANKLOG_SPOOL``). ``name``: the run's
    name when this creates the spool. ``save_dir``: where Lightning puts checkpoints
    (``save_dir/name/version/checkpoints``; default: the Trainer's
    ``default_root_dir``). ``reduce``: the cross-rank reduction, one op, several, or a
    map from metric name to op(s) (names it leaves out: ``mean``). ``rank`` and
    ``world_size`` override what Lightning and the launcher say. Other keyword
    arguments (``durability``, ``gpu``, ``flush_interval``, ...) go to
    :func:`ranklog.init` when the logger opens its spool file: when the Trainer sets up,
    or at the first call that needs it.
    """

    def __init__(
        self,
        spool: str | os.PathLike[str] | None = None,
        *,
        name: str | None = None,
        save_dir: str | os.PathLike[str] | None = None,
        reduce: Reduce = "mean",
        rank: int | None = None,
        world_size: int | None = None,
        **init_kwargs: Any,
    ) -> None:
        super().__init__()
        spool = spool_of(spool, "RanklogLogger")
        self._spool = Path(spool)
        self._name = name
        self._save_dir = None if save_dir is None else os.fspath(save_dir)
        self._reduce = reduce
        self._rank = rank
        self._world_size = world_size
        self._init_kwargs = init_kwargs
        self._info: RunInfo | None = None
        self._run: ranklog.Run | None = None
        self._steps = OpenStep()

    # -- Lightning's identity properties -----------------------------------------------------

    @property
    def name(self) -> str:
        """The run's name, as the spool records it (the same on every rank)."""
        return self._run_info().name

    @property
    def version(self) -> str:
        """The run id: the same on every rank, and after a restart in the same spool."""
        return self._run_info().run_id

    @property
    def save_dir(self) -> str | None:
        """Where Lightning saves checkpoints (``None``: the Trainer's ``default_root_dir``)."""
        return self._save_dir

    @property
    def root_dir(self) -> str | None:
        """``save_dir/name``, or ``None`` without a ``save_dir``."""
        return None if self._save_dir is None else os.path.join(self._save_dir, self.name)

    @property
    def log_dir(self) -> str:
        """The spool directory: where every rank's values go."""
        return str(self._spool)

    @property
    def experiment(self) -> ranklog.Run:
        """This rank's :class:`ranklog.Run` (opened on first use): ``log_text``, ``timer``, ..."""
        return self._open_run()

    # -- logging ------------------------------------------------------------------------------

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log this rank's values for ``step``; the shipper reduces them across ranks."""
        run = self._open_run()
        at = self._steps.at(self._steps.open if step is None else step)
        if metrics:
            run.log_metrics(metrics, step=at, reduce=self._reduce)

    def log_hyperparams(
        self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any
    ) -> None:
        """Log hyperparameters (nested dicts flattened with ".", secret-looking keys redacted)."""
        self._open_run().log_hyperparams(vars(params) if isinstance(params, Namespace) else params)

    def save(self) -> None:
        """Nothing to do: closed steps are in the OS already (``step_end``), the rest follows."""

    def finalize(self, status: str) -> None:
        """Close the step this rank is in and flush (end of fit, validate or test); after
        a success, the rank ends ``ok`` at exit."""
        if self._run is not None:
            self._steps.close()
            self._run.flush()
            if status == "success":
                self._run._ended_well()

    def after_save_checkpoint(self, checkpoint_callback: Checkpoint) -> None:
        """Flush, so that what was logged before the checkpoint is in the OS (rank 0 only)."""
        if self._run is not None:
            self._run.flush()

    def close(self) -> None:
        """Close the open step and this rank's run (also done at exit)."""
        if self._run is not None:
            self._steps.close()
            self._run.close()

    # -- internals ----------------------------------------------------------------------------

    def _run_info(self) -> RunInfo:
        if self._run is not None:
            return self._run.info
        if self._info is None:
            self._info = ensure_run(self._spool, name=self._name)
        return self._info

    def _open_run(self) -> ranklog.Run:
        if self._run is None:
            rank, world, local = self._who()
            self._run = ranklog.init(self._spool, rank=rank, world_size=world, local_rank=local,
                                     name=self._name, **self._init_kwargs)  # fmt: skip
            self._steps.attach(self._run)
        return self._run

    def _who(self) -> tuple[int | None, int | None, int | None]:
        """(rank, world size, local rank); None: let :func:`ranklog.init` read the launcher."""
        local = os.environ.get("LOCAL_RANK")
        local_rank = int(local) if local and local.isdigit() else None
        if self._rank is not None:
            return self._rank, self._world_size, local_rank
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), local_rank
        if local is not None and "RANK" not in os.environ:
            # a process Lightning's "ddp" launcher started, before the process group exists
            world = os.environ.get("WORLD_SIZE", "")
            rank = int(getattr(rank_zero_only, "rank", 0) or 0)
            return rank, int(world) if world.isdigit() else self._world_size, local_rank
        return None, self._world_size, None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for ``ddp_spawn``: each worker opens its own run."""
        state = dict(self.__dict__)
        state.update(_run=None, _steps=OpenStep())
        return state
