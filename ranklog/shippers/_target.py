"""The small protocol every backend adapter (a *target*) implements, and what it receives.

A shipper drives a target like this::

    held = target.open(run)            # the steps of this run the backend durably holds
    target.write_params(params)        # hyperparameters, whenever new ones arrive
    target.write(steps)                # reduced steps, in increasing step order, each once
    target.flush()                     # after it returns, everything written is durable
    ...                                # the cursor is committed only after flush()
    target.end(status)                 # optional: the job ended ("finished", "failed", "killed")
    target.close()

``open`` returns a :class:`~ranklog.shippers.StepSet` of the steps it holds, read back
from its own storage after any crash (a torn write counts as not written), or an int,
the older form: every step up to it. The engine never sends a step the target holds
or a step below one already sent in this session, so a target needs no deduplication
of its own. A target that cannot hold another run in the same place (one JSONL file,
one TensorBoard directory, one MLflow or W&B run id) refuses it in ``open`` with
:class:`~ranklog.errors.TargetHeldError`.

Optional attributes the engine reads with ``getattr``:

- ``identity(run) -> str``: what the target writes to, canonical (the real path of a
  file, tracking URI + experiment + run for MLflow): the lease and the cursor are keyed
  on it, so two spellings of one target are one target. Default: ``spec``.
- ``steps_in_order = True``: the backend cannot write a step below its last one (W&B):
  a step the target does not hold below its last is refused before anything is written
  (or left out, counted, with ``--below-last skip``).
- ``takes_late = True``: see below.
- ``held_known = False``: ``open`` cannot tell which steps it holds (the console; W&B
  online beyond the server's last step). Otherwise the engine refuses a target that
  holds fewer steps than its cursor counts as shipped to it (deleted, cut short, rolled
  back): ``None`` from ``open`` means it holds none.
- ``end(status)``: called once every rank ended and everything was shipped.

The one exception to step order is a *late* step (``carrier`` set, only with
``--late ship``): values for an earlier step, which follow their carrier step in the
same ``write``; a target that can store them at their own step does (TensorBoard,
MLflow, JSONL), one that cannot write a step it has passed leaves them out, as
its own client would (W&B). A carrier counts as held once its late steps are.
Errors raised by ``write``/``flush`` are retried with backoff by the engine,
with the cursor held back (permanent ones, see :mod:`ranklog.shippers._retry`, are not).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import msgspec

from ranklog.schemas import ParamValue, TableCell
from ranklog.shippers._held import StepSet
from ranklog.spool import RunInfo

__all__ = [
    "JOB_STATUSES",
    "GpuStat",
    "ImageItem",
    "ShippedStep",
    "TableItem",
    "Target",
    "TextItem",
    "job_status",
    "target_identity",
    "target_place",
]

#: how a job ended, as ``Target.end`` is told: every rank ended ok; a rank failed (an
#: error, or it went silent: killed by the OOM killer or a dead node); a rank was stopped
#: by a signal or Ctrl-C (and no requeue brought it back)
JOB_STATUSES = ("finished", "failed", "killed")


class TextItem(msgspec.Struct, frozen=True):
    """One text event of a step: which rank logged it, under which name."""

    rank: int
    name: str
    text: str


class TableItem(msgspec.Struct, frozen=True):
    """One table of a step (a ``wandb.Table``): which rank logged it, its name and cells."""

    rank: int
    name: str
    columns: list[str]
    rows: list[list[TableCell]]


class ImageItem(msgspec.Struct, frozen=True):
    """One image of a step (a plot): which rank logged it, its name, its encoded bytes."""

    rank: int
    name: str
    data: bytes
    format: str = "png"
    #: the plot as a Plotly figure's JSON ("" when the producer made none)
    plotly: str = ""


class GpuStat(msgspec.Struct, frozen=True):
    """One GPU over one step: the samples its host's sampler took while the step ran."""

    host: str
    index: int
    name: str
    samples: int
    util: float | None  # mean, percent
    mem_used: int | None  # peak, bytes
    mem_total: int | None
    temp: float | None  # peak, °C
    power: float | None  # mean, W


class ShippedStep(msgspec.Struct):
    """One step reduced across ranks: what every target receives."""

    step: int
    #: reduced values: ``name`` or ``name/op``, ``timing/<name>``, ``timing/<name>/slowest_rank``,
    #: and ``ranklog/ranks_reporting`` when the step is partial
    metrics: dict[str, float]
    #: ranks that closed this step
    ranks: int
    #: the job's world size (ranks seen when unknown)
    world_size: int
    #: every expected rank closed the step
    complete: bool
    #: latest event time in the step (Unix seconds): targets use it as the timestamp
    ts: float
    texts: list[TextItem] = msgspec.field(default_factory=list)
    #: distributions: name -> every rank's values pooled (rank order)
    histograms: dict[str, list[float]] = msgspec.field(default_factory=dict)
    images: list[ImageItem] = msgspec.field(default_factory=list)
    #: per GPU, over the step (``gpu_metrics`` names them for each backend)
    gpu: list[GpuStat] = msgspec.field(default_factory=list)
    #: each rank's own values (``--per-rank``): rank -> name -> value
    per_rank: dict[int, dict[str, float]] | None = None
    #: tables, in rank order
    tables: list[TableItem] = msgspec.field(default_factory=list)
    #: None for a step shipped once it was complete. Otherwise these are *late* values
    #: (``ranklog ship --late ship``): logged for ``step`` after it had been closed and
    #: shipped, and sent, reduced across the ranks that logged them, right after step
    #: ``carrier`` (the step those ranks were in; itself shipped only if it holds values)
    carrier: int | None = None


class Target(Protocol):
    """A backend adapter. See the module docstring for the call sequence."""

    #: short kind, e.g. "jsonl"
    kind: str
    #: the spec it was made from, e.g. "jsonl:/tmp/out.jsonl"
    spec: str
    # Optional: ``takes_late = True`` says the target handles late steps (``carrier``
    # set); the engine leaves them out, with a warning, for a target that does not say so.

    def open(self, run: RunInfo) -> StepSet | int | None:
        """Prepare to receive steps; return the steps of ``run`` durably held (see above)."""
        ...

    def write_params(self, params: dict[str, ParamValue]) -> None:
        """Record hyperparameters (called with the new or changed ones)."""
        ...

    def write(self, steps: list[ShippedStep]) -> None:
        """Record reduced steps (increasing, each once)."""
        ...

    def flush(self) -> None:
        """Make everything written durable; the cursor moves only after this returns."""
        ...

    def close(self) -> None:
        """Release resources (flush first if needed)."""
        ...


def target_place(target: Target, run: RunInfo) -> str | None:
    """Where ``target`` writes as the operating system sees it (``file:<dev>:<inode>``, a
    server's resolved address), or None: its ``place(run)``, which may create what
    :meth:`Target.open` creates first (a file, a directory) to learn its inode."""
    place = getattr(target, "place", None)
    return str(place(run)) if callable(place) else None


def target_identity(target: Target, run: RunInfo) -> str:
    """What ``target`` writes to, canonical (its ``identity(run)``, else its spec)."""
    ident = getattr(target, "identity", None)
    return str(ident(run)) if callable(ident) else target.spec


def job_status(statuses: Iterable[str | None]) -> str:
    """How a job ended (one of :data:`JOB_STATUSES`), from its ranks' end statuses.

    A rank that failed (``error``), went silent (``dead``) or left no ``rank_end``
    (``unknown``, in a replay) fails the job; one stopped by a signal or Ctrl-C, with
    no requeue after it, kills it; ``ok`` and ``exit`` (the script ended) finish it.
    """
    seen = set(statuses)
    if seen & {"error", "dead", "unknown"}:
        return "failed"
    if seen & {"signal", "interrupted"}:
        return "killed"
    return "finished"
