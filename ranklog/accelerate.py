"""An Accelerate tracker that logs from every process into a ranklog spool.

::

    from ranklog.accelerate import RanklogTracker, log

    tracker = RanklogTracker("/nfs/runs/exp1/spool")
    accelerator = Accelerator(log_with=[tracker])
    accelerator.init_trackers("exp1", config=cfg)      # hyperparameters (main process)
    for step, batch in enumerate(loader):
        ...
        log(accelerator, {"train/loss": loss.item()}, step=step)   # every process
    accelerator.end_training()

``Accelerator.log`` and ``init_trackers`` run on the main process only, whatever a
tracker's ``main_process_only`` says, so ``accelerator.log(...)`` reaches ranklog from
that process alone. For every process to log, call :func:`log` (a drop-in for
``accelerator.log``: every process to its ranklog trackers, the main process to the
others as well) or the tracker's own :meth:`RanklogTracker.log`. ``ranklog ship``
then reduces each step across processes (``mean`` unless ``reduce=`` says otherwise).

A step is closed (``step_end``) when the process logs a later step, at ``finish()``
(``accelerator.end_training()``, main process) or at exit. ``step=None`` logs at the
step after the last one (each such call is a new step, as in W&B). Steps never go
back: a value for a step this process already closed is logged at the next one.

Importing this module imports ``accelerate`` (``pip install 'ranklog[accelerate]'``);
``import ranklog`` does not.
"""

from __future__ import annotations

import logging
import numbers
import os
from collections.abc import Mapping
from typing import Any

import ranklog
from ranklog._adapters import OpenStep, Reduce, is_scalar, spool_of
from ranklog.errors import ExtraMissingError

try:
    from accelerate.tracking import GeneralTracker
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ExtraMissingError("accelerate", "accelerate") from exc

__all__ = ["RanklogTracker", "log"]

_log = logging.getLogger("ranklog.accelerate")


class RanklogTracker(GeneralTracker):  # type: ignore[misc]  # accelerate has no type hints
    """Accelerate's ``GeneralTracker`` over a ranklog spool, for every process.

    ``spool``: the spool directory (default ``$RANKLOG_SPOOL``). ``run_name``: the run's
    name when this creates the spool. ``reduce``: the cross-rank reduction, one op,
    several, or a map from name to op(s) (names it leaves out: ``mean``); ``log()``
    takes ``reduce=`` and ``prefix=`` per call too (``accelerator.log(...,
    log_kwargs={"ranklog": {"reduce": "sum"}})``). ``rank`` and ``world_size``
    override what Accelerate and the launcher say. Other keyword arguments
    (``durability``, ``gpu``, ...) go to :func:`ranklog.init`, called at the first use.
    """

    name = "ranklog"
    requires_logging_directory = False
    main_process_only = False

    def __init__(
        self,
        spool: str | os.PathLike[str] | None = None,
        *,
        run_name: str | None = None,
        reduce: Reduce = "mean",
        rank: int | None = None,
        world_size: int | None = None,
        **init_kwargs: Any,
    ) -> None:
        super().__init__()
        spool = spool_of(spool, "RanklogTracker")
        self._spool = spool
        self._run_name = run_name
        self._reduce = reduce
        self._rank = rank
        self._world_size = world_size
        self._init_kwargs = init_kwargs
        self._run: ranklog.Run | None = None
        self._steps = OpenStep()
        self._skipped: set[str] = set()

    @property
    def tracker(self) -> ranklog.Run:
        """This process's :class:`ranklog.Run` (opened on first use)."""
        return self._open_run()

    run = tracker

    def start(self) -> None:
        """Open this process's run (``init_trackers`` calls it, on the main process)."""
        self._open_run()

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Log hyperparameters (nested dicts flattened with ".", secret-looking keys redacted)."""
        self._open_run().log_hyperparams(values)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log this process's ``values`` for ``step``: numbers as metrics (dicts of numbers
        as ``key/sub``), strings as text; anything else is skipped with a note.

        ``reduce=`` and ``prefix=`` work as in :meth:`ranklog.Run.log_metrics`.
        """
        run = self._open_run()
        at = self._steps.at(step)
        prefix = kwargs.get("prefix")
        numbers_: dict[str, Any] = {}
        for key, value in _flat(values):
            if isinstance(value, numbers.Real) or is_scalar(value):
                numbers_[key] = value
            elif isinstance(value, str):
                run.log_text(f"{prefix}/{key}" if prefix else key, value, at)
            elif key not in self._skipped:
                self._skipped.add(key)
                _log.info("ranklog.accelerate: %r is not a number (%s); not logged", key,
                          type(value).__name__)  # fmt: skip
        if numbers_:
            run.log_metrics(numbers_, at, prefix=prefix, reduce=kwargs.get("reduce", self._reduce))

    def finish(self) -> None:
        """Close the open step and this process's run."""
        self._steps.close()
        if self._run is not None:
            self._run.close()

    # -- internals ----------------------------------------------------------------------------

    def _open_run(self) -> ranklog.Run:
        if self._run is None:
            rank, world, local = self._who()
            self._run = ranklog.init(self._spool, rank=rank, world_size=world, local_rank=local,
                                     name=self._run_name, **self._init_kwargs)  # fmt: skip
            self._steps.attach(self._run)
        return self._run

    def _who(self) -> tuple[int | None, int | None, int | None]:
        """(rank, world size, local rank); None: let :func:`ranklog.init` read the launcher."""
        if self._rank is not None:
            return self._rank, self._world_size, None
        from accelerate.state import PartialState

        if PartialState._shared_state:  # initialized (by the Accelerator): never create it here
            state = PartialState()
            if state.num_processes > 1:
                return state.process_index, state.num_processes, state.local_process_index
        # not distributed as far as Accelerate knows (on a CPU-only torchrun job without
        # Accelerator(cpu=True), every process thinks it is process 0 of 1): the launcher says
        return None, self._world_size, None


def log(
    accelerator: Any,
    values: Mapping[str, Any],
    step: int | None = None,
    log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """``accelerator.log(values, step, log_kwargs)``, with every process logging to ranklog.

    Every process logs to the accelerator's :class:`RanklogTracker` instances; the main
    process also logs to its other trackers, as ``accelerator.log`` does.
    """
    kwargs = log_kwargs or {}
    ours = [t for t in getattr(accelerator, "log_with", ()) if isinstance(t, RanklogTracker)]
    for tracker in ours:
        tracker.log(values, step=step, **kwargs.get(tracker.name, {}))
    if accelerator.is_main_process:
        for tracker in accelerator.trackers:
            if not isinstance(tracker, RanklogTracker):
                tracker.log(values, step=step, **kwargs.get(tracker.name, {}))


def _flat(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``{"a": {"b": 1}}`` -> ``[("a/b", 1)]`` (TensorBoard's ``add_scalars`` grouping)."""
    out: list[tuple[str, Any]] = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(_flat(value, f"{name}/"))
        else:
            out.append((name, value))
    return out
