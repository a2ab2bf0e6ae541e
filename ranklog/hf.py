"""A Hugging Face ``Trainer`` callback that logs from every process into a ranklog spool.

::

    from ranklog.hf import RanklogCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[RanklogCallback("/nfs/runs/exp1/spool")])

``import ranklog.hf`` also registers the callback under the name ``"ranklog"`` in
transformers' table of reporting integrations, so ``TrainingArguments(report_to=
["ranklog"])`` adds it too (spool: ``$RANKLOG_SPOOL``, else ``<output_dir>/ranklog``).
That table is not a public plug-in API of transformers: ``callbacks=[...]`` is the
supported way.

The Trainer calls callbacks on every process; the stock integrations return early
unless ``state.is_world_process_zero``, this one does not. Every process logs the
``logs`` dict of each ``on_log`` at ``state.global_step`` under the names the stock
TensorBoard and W&B integrations use (``eval_loss`` -> ``eval/loss``, ``test_*`` ->
``test/*``, anything else -> ``train/<name>``), plus, with ``step_time=True``, its own
step time (``timing/step_time``: the slowest process, and which one it was). Values
are reduced with ``mean`` across processes, ``*runtime`` values with ``max``. The
Trainer averages ``loss`` over processes itself before logging it (a collective), so
``train/loss`` is the same on every process; per-process values come from the timer,
the ``eval/*_per_second`` figures, and from what you log through :attr:`run`.

A step is closed (``step_end``) when the next optimizer step ends, at the end of
training, or after an ``evaluate()`` outside training. ``args.to_sanitized_dict()``
goes to the hyperparameters (``hub_token`` masked by transformers, secret-looking
keys redacted by ranklog).

Importing this module imports ``transformers`` (``pip install 'ranklog[hf]'``);
``import ranklog`` does not.
"""

from __future__ import annotations

import logging
import numbers
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ranklog
from ranklog._adapters import OpenStep, Reduce, is_scalar
from ranklog.errors import ExtraMissingError
from ranklog.producer._run import SPOOL_ENV

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ExtraMissingError("transformers", "hf") from exc

__all__ = ["RanklogCallback", "metric_name"]

log = logging.getLogger("ranklog.hf")


def metric_name(key: str) -> str:
    """The name a key of the Trainer's ``logs`` gets, as the stock TensorBoard/W&B callbacks do."""
    for prefix in ("eval", "test"):
        if key.startswith(f"{prefix}_"):
            return f"{prefix}/{key[len(prefix) + 1 :]}"
    return f"train/{key}"


class RanklogCallback(TrainerCallback):
    """Logs the Trainer's ``logs``, step times and arguments from every process.

    ``spool``: the spool directory (default ``$RANKLOG_SPOOL``, else
    ``<output_dir>/ranklog``). ``name``: the run's name when this creates the spool
    (default ``args.run_name``). ``reduce``: one op, several, or a map from name to
    op(s) for every value (default: ``mean``, ``max`` for ``*runtime``).
    ``step_time``: log each process's optimizer-step time. Other keyword arguments
    (``durability``, ``gpu``, ...) go to :func:`ranklog.init`, called at the first
    event (``on_train_begin``), once the process group exists.
    """

    def __init__(
        self,
        spool: str | os.PathLike[str] | None = None,
        *,
        name: str | None = None,
        reduce: Reduce | None = None,
        step_time: bool = True,
        **init_kwargs: Any,
    ) -> None:
        self._spool = spool
        self._name = name
        self._reduce = reduce
        self._step_time = step_time
        self._init_kwargs = init_kwargs
        self._run: ranklog.Run | None = None
        self._steps = OpenStep()
        self._training = False
        self._started: float | None = None
        self._skipped: set[str] = set()

    @property
    def run(self) -> ranklog.Run | None:
        """This process's :class:`ranklog.Run` once training began (``None`` before)."""
        return self._run

    # -- the Trainer's events -----------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Open this process's run and log the training arguments."""
        self._training = True
        self._open_run(args).log_hyperparams(args.to_sanitized_dict())

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Start timing an optimizer step."""
        if self._started is None:
            self._started = time.perf_counter()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Close the previous step; log this process's step time."""
        run = self._open_run(args)
        step = state.global_step
        if self._step_time and self._started is not None:
            run.log_timing("step_time", time.perf_counter() - self._started, self._steps.at(step))
        elif self._steps.open is not None and self._steps.open < step:
            self._steps.close()
        self._started = None

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Log this process's ``logs`` at ``state.global_step``."""
        if not logs:
            return
        run = self._open_run(args)
        step = self._steps.at(state.global_step)
        values: dict[str, Any] = {}
        for key, value in logs.items():
            name = metric_name(str(key))
            if isinstance(value, numbers.Real) or is_scalar(value):
                values[name] = value
            elif isinstance(value, str):
                run.log_text(name, value, step)
            elif key not in self._skipped:
                self._skipped.add(key)
                log.info("ranklog.hf: %r is not a number (%s); not logged", key,
                         type(value).__name__)  # fmt: skip
        if values:
            run.log_metrics(values, step, reduce=self._reduce_for(values))

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """After ``trainer.evaluate()`` outside training, close its step (its values came in
        ``on_log``)."""
        if not self._training:
            self._steps.close()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Close the last step and flush; the process's rank then ends ``ok`` at exit."""
        self._training = False
        self._steps.close()
        if self._run is not None:
            self._run.flush()
            self._run._ended_well()

    def close(self) -> None:
        """Close the open step and this process's run (also done at exit)."""
        self._steps.close()
        if self._run is not None:
            self._run.close()

    # -- internals ----------------------------------------------------------------------------

    def _open_run(self, args: TrainingArguments) -> ranklog.Run:
        if self._run is None:
            spool = self._spool or os.environ.get(SPOOL_ENV)
            spool = spool or Path(args.output_dir or ".") / "ranklog"
            # Accelerate without a distributed setup says "process 0 of 1" on every
            # process: then the launcher's variables (torchrun, SLURM) say who is who
            distributed = int(args.world_size) > 1
            self._run = ranklog.init(
                spool,
                rank=int(args.process_index) if distributed else None,
                world_size=int(args.world_size) if distributed else None,
                local_rank=int(args.local_process_index) if distributed else None,
                name=self._name or args.run_name or None,
                **self._init_kwargs,
            )
            self._steps.attach(self._run)
        return self._run

    def _reduce_for(self, values: Mapping[str, Any]) -> Reduce:
        if self._reduce is not None:
            return self._reduce
        slowest = {name: "max" for name in values if name.endswith("runtime")}
        return slowest or "mean"


def _register() -> None:
    """Make ``report_to=["ranklog"]`` add the callback, where transformers allows it."""
    try:
        from transformers.integrations import integration_utils
    except ImportError:  # pragma: no cover - an older or trimmed transformers
        return
    table = getattr(integration_utils, "INTEGRATION_TO_CALLBACK", None)
    if isinstance(table, dict):
        table.setdefault("ranklog", RanklogCallback)


_register()
