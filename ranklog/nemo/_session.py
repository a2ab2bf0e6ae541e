"""What a NeMo ``Logger`` (or a backend class used on its own) does underneath: one spool.

A :class:`Session` is one ranklog run in ``<dir>/spool`` plus, in the process that owns
the job, one ``ranklog ship`` process per backend. NeMo's calls become ranklog events:

* numbers (Python, numpy, one-element tensors; bools as 0/1) -> metrics, mean across ranks;
* strings -> text; nested dicts -> flattened with ``/`` (MLflow's NeMo rule);
* numeric lists, arrays and tensors -> histograms (MLflow ships them as
  ``/mean,/p50,/p90,/max``, as NeMo's MLflow logger summarises lists);
* matplotlib figures -> images; ``wandb.Table`` -> tables (W&B gets a ``wandb.Table``
  back, MLflow a table artifact, TensorBoard a text table); anything else (``None``, a
  table with media in its cells) is skipped with one warning naming the key.

Steps: values go to the step they name. A step is closed (``step_end``: the shippers
reduce and forward it) by ``step_finished=True``, by a call under a prefix listed in
``ranklog.close_after`` (default ``timing/train``, the last call of every NeMo loop's
step), by the first value of a later step, or at :meth:`finish`. Calls with a
``step_metric`` (a custom x-axis, as the GPU monitor's seconds) never move the step.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import ranklog
from ranklog._adapters import is_scalar
from ranklog.errors import InvalidValueError
from ranklog.nemo._helpers import flatten_dict, merge_generation_logger_workers
from ranklog.producer import Run
from ranklog.producer._values import as_float, check_name, check_step, check_table
from ranklog.schemas import TableCell

__all__ = [
    "Session", "leave_out_flags", "ship_command", "write_batched_jsonl", "write_string_lines",
]  # fmt: skip

log = logging.getLogger("ranklog.nemo")

#: prefixes whose call is the last of a NeMo step (closes it)
CLOSE_AFTER = ("timing/train",)


class Session:
    """One rank's ranklog run for NeMo calls, and the shippers when this rank owns the job."""

    def __init__(
        self,
        spool: Path,
        commands: Sequence[Sequence[str]],
        own: Mapping[str, Any],
        *,
        name: str | None = None,
        gpu: Any = "off",
        gpu_interval: float = 10.0,
        flush_interval: float = 1.0,
    ) -> None:
        self.spool = spool
        self.run: Run = ranklog.init(
            spool,
            rank=own.get("rank"),
            world_size=own.get("world_size"),
            durability=own.get("durability", "step"),
            flush_interval=flush_interval,
            name=name,
            gpu=gpu,
            gpu_interval=gpu_interval,
        )
        self.close_after = tuple(own.get("close_after", CLOSE_AFTER))
        self.shutdown_timeout = float(own.get("shutdown_timeout", 120.0))
        self.commands = [list(c) for c in commands]
        self.open: int | None = None  # the step values went to, not closed yet
        self.closed = -1  # the highest step closed
        self._skipped: set[str] = set()
        #: the hyperparameters logged here, as given (``wandb_logger.run.config`` reads them)
        self.config: dict[str, Any] = {}
        self._shippers: list[subprocess.Popen[bytes]] = []
        if self.run.rank == int(own.get("owner_rank", 0)):
            spool.parent.mkdir(parents=True, exist_ok=True)
            # they follow this process: killed with the job, they ship what was closed and
            # exit within seconds (the next Logger on this log_dir, or `ranklog ship SPOOL
            # --once`, ships the rest)
            follow = ["--exit-with", str(os.getpid())]
            self._shippers = [subprocess.Popen([*cmd, *follow]) for cmd in self.commands]
        # NeMo's scripts end without finish(): at exit, close the last step and let the
        # shippers drain (registered after the run's own hook, so it runs first)
        atexit.register(self.finish)

    # -- steps --------------------------------------------------------------------------

    def _at(self, step: int, moves: bool = True) -> int:
        """The step to log at: ``step``, closing the open one when ``step`` is later."""
        if type(step) is not int:
            step = check_step(step)
        if not moves:
            return self.open if self.open is not None else self.closed + 1
        if self.open is not None and step > self.open:
            self._close(self.open)
        if step > self.closed and (self.open is None or step > self.open):
            self.open = step
        return step

    def current_step(self) -> int:
        """The step a value logged now without one goes to: the open step, else the next."""
        return self._at(0, moves=False)

    def _close(self, step: int) -> None:
        if not self.run.closed:
            self.run.step_end(step)
        self.closed = max(self.closed, step)
        if self.open is not None and self.open <= step:
            self.open = None

    # -- values -------------------------------------------------------------------------

    def log_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        """NeMo's ``log_metrics``: every value by its kind (module docstring)."""
        got = self._sort(metrics, prefix or "", step_metric)
        at = self._at(step, moves=not step_metric)
        run = self.run
        if got.numbers:
            run.log_metrics(got.numbers, at)
        for name, text in got.texts.items():
            run.log_text(name, text, at)
        for name, values in got.lists.items():
            run.log_histogram(name, values, at)
        for name, fig in got.figures.items():
            run.log_image(name, fig, at)
        for name, (columns, rows) in got.tables.items():
            run.log_table(name, columns, rows, at)
        if step_finished or (prefix and prefix in self.close_after):
            self._close(at)

    def _sort(
        self, metrics: Mapping[str, Any], prefix: str, step_metric: str | None = None
    ) -> _Sorted:
        """The values by kind and full name; others skipped, with one warning per name.

        Every name and number is checked here, before anything of the call is written.
        The ``step_metric`` key keeps its name, unprefixed (NeMo's W&B rule: the GPU
        monitor's ``ray/ray_step`` under prefix ``ray``).
        """
        if not isinstance(metrics, Mapping):
            raise InvalidValueError(f"metrics must be a dict, got {type(metrics).__name__}")
        merged = merge_generation_logger_workers(dict(metrics))
        out = _Sorted({}, {}, {}, {}, {})
        for key, value in flatten_dict(merged, sep="/", expand_lists=False).items():
            full = f"{prefix}/{key}" if prefix and key != step_metric else key
            name = check_name("metric", full)
            why = _LOGGED
            if isinstance(value, bool | int | float) or is_scalar(value):
                out.numbers[name] = as_float(name, value)
                continue
            if isinstance(value, str):
                out.texts[name] = value
                continue
            if hasattr(value, "savefig"):
                out.figures[name] = value
                continue
            if _is_table(value):
                try:
                    out.tables[name] = check_table(name, value.columns, value.data)
                    continue
                except InvalidValueError as exc:  # media in cells: W&B only, not shipped
                    why = str(exc)
            elif (series := _numeric_list(value)) is not None:
                if series:
                    out.lists[name] = series
                continue
            if name not in self._skipped:
                self._skipped.add(name)
                log.warning("ranklog.nemo: skipping %r (%s): %s", name, type(value).__name__, why)
        return out

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Params flattened as NeMo's TensorBoard and MLflow loggers do (lists by index)."""
        self.run.log_hyperparams(flatten_dict(params))
        self.config.update(params)

    def log_text(self, name: str, text: str, step: int) -> None:
        """A text at ``step``."""
        self.run.log_text(name, text, self._at(step))

    def log_histogram(self, histogram: Any, step: int, name: str) -> None:
        """A distribution at ``step`` (an empty one as the value 0, as NeMo's W&B logger)."""
        at = self._at(step)
        series = _numeric_list(histogram)
        if series is None:
            raise InvalidValueError(
                f"histogram {name!r}: expected real numbers, got {type(histogram).__name__}"
            )
        if series:
            self.run.log_histogram(name, series, at)
        else:
            self.run.log_metrics({name: 0.0}, at)

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        """A matplotlib figure at ``step``, as an image."""
        self.run.log_image(name, figure, self._at(step))

    # -- the end ------------------------------------------------------------------------

    def finish(self) -> None:
        """Close the open step and the run; the owner waits for its shippers to drain.

        Called again (at exit, after an explicit call) it does nothing.
        """
        atexit.unregister(self.finish)
        if self.open is not None:
            self._close(self.open)
        if not self.run.closed:
            self.run.close()
        for proc in self._shippers:
            try:
                proc.wait(timeout=self.shutdown_timeout)
            except subprocess.TimeoutExpired:
                log.warning("ranklog.nemo: shipper %s still busy after %.0fs; stopping it "
                            "(the spool keeps everything: run `ranklog ship` later)",
                            proc.args, self.shutdown_timeout)  # fmt: skip
                proc.terminate()
                proc.wait(timeout=30)
        self._shippers.clear()


#: why a value of another kind is skipped
_LOGGED = "only numbers, strings, numeric lists, figures and tables are logged"


class _Sorted(NamedTuple):
    """One ``log_metrics`` call's values by kind, each by its full name."""

    numbers: dict[str, float]
    texts: dict[str, str]
    lists: dict[str, list[float]]
    figures: dict[str, Any]
    #: name -> (columns, rows), checked
    tables: dict[str, tuple[list[str], list[list[TableCell]]]]


def _is_table(value: Any) -> bool:
    """Whether ``value`` is a ``wandb.Table`` (or looks like one), without importing wandb."""
    return (
        type(value).__name__ == "Table"
        and isinstance(getattr(value, "columns", None), list)
        and isinstance(getattr(value, "data", None), list)
    )


def _numeric_list(value: Any) -> list[float] | None:
    """The numbers of a list, tuple, array or tensor (None: not all numbers, or not one)."""
    if hasattr(value, "tolist") and not isinstance(value, list | tuple):
        value = value.tolist()  # numpy arrays, torch tensors (on CPU)
        if not isinstance(value, list):
            return None
    if not isinstance(value, list | tuple):
        return None
    flat: list[float] = []
    stack = list(value)
    stack.reverse()
    while stack:
        item = stack.pop()
        if isinstance(item, list | tuple):
            stack.extend(reversed(item))
        elif isinstance(item, bool | int | float) or is_scalar(item):
            v = float(item)
            if not math.isfinite(v):
                return None
            flat.append(v)
        else:
            return None
    return flat


def _plain(value: Any) -> Any:
    """A tensor or array as a list (JSON can write it)."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


def _rows(to_log: Mapping[str, Any]) -> int:
    first = next(iter(to_log.values()), None)
    if first is None:
        return 0
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else len(first)


def write_batched_jsonl(to_log: Mapping[str, Any], path: Path) -> None:
    """NeMo's JSONL: one line per row, each value a one-row slice, then ``idx``; overwrites."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(_rows(to_log)):
            row = {k: _plain(v[i : i + 1]) for k, v in to_log.items()}
            row["idx"] = i
            f.write(json.dumps(row, default=str) + "\n")
    print(f"Logged data to {path}")


def write_string_lines(lines: Sequence[str], path: Path) -> None:
    """Append each string (already JSON) as a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for line in lines:
            f.write(line + "\n")
    print(f"Logged data to {path}")


def leave_out_flags(own: Mapping[str, Any], section: str | None) -> list[str]:
    """``--leave-out KINDS`` for a backend section from ``ranklog.leave_out``: a mapping of
    section to kinds, or a list of kinds for every backend ([] when none)."""
    spec = own.get("leave_out")
    if isinstance(spec, Mapping):
        spec = spec.get(section or "")
    if not spec:
        return []
    kinds = [spec] if isinstance(spec, str) else [str(k) for k in spec]
    return ["--leave-out", ",".join(kinds)]


def ship_command(spool: Path, own: Mapping[str, Any]) -> list[str]:
    """``ranklog ship SPOOL`` as this Python runs it, quiet, late values shipped.

    NeMo's backends take values logged for a step after ``step_finished`` (validation at
    the end, a relaunch logging its resume step again): so do the shippers, unless the
    ``ranklog`` section says ``late: count``.
    """
    late = str(own.get("late", "ship"))
    return [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--quiet", "--late", late]
