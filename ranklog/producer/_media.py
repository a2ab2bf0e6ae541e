"""What a run logs besides metrics and timers: text, tables, distributions, images,
hyperparameters and run records (:mod:`ranklog.producer._records`).

:class:`RunValues` is a part of :class:`~ranklog.producer.Run`: each method checks its
input, naming the key, and appends one event to the run's sink (no I/O in the caller's
thread).
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from ranklog.errors import InvalidValueError, RanklogWarning
from ranklog.producer._records import code_record, definition, summary_values
from ranklog.producer._values import as_float, check_name, check_step, check_table, flatten_params
from ranklog.schemas import Histogram, Image, Params, Table, Text

if TYPE_CHECKING:
    from ranklog.producer._redact import Redactor
    from ranklog.producer._sink import DeadSink, SpoolSink

__all__ = ["MAX_HISTOGRAM_VALUES", "MAX_TEXT_BYTES", "RunValues", "plotly_json"]

MAX_TEXT_BYTES: Final = 8 * 1024 * 1024
MAX_HISTOGRAM_VALUES: Final = 1_000_000
_FORMAT: Final = re.compile(r"[A-Za-z0-9]{1,16}")


class RunValues:
    """Text, tables, histograms, images, hyperparameters and run records of a :class:`Run`."""

    _sink: SpoolSink | DeadSink
    _redactor: Redactor

    def log_text(self, name: str, text: str, step: int) -> None:
        """Log a piece of text (a validation sample, say) for ``step``."""
        step = check_step(step)
        check_name("text", name)
        if not isinstance(text, str):
            raise InvalidValueError(f"text {name!r}: expected str, got {type(text).__name__}")
        if len(text) > MAX_TEXT_BYTES // 4 and len(text.encode()) > MAX_TEXT_BYTES:
            raise InvalidValueError(f"text {name!r} is larger than {MAX_TEXT_BYTES} bytes")
        self._sink.append(Text(time.time(), step, name, text), step=step)

    def log_table(self, name: str, columns: Any, rows: Any, step: int) -> None:
        """Log a table (W&B's ``wandb.Table``: column names, rows of cells) for ``step``.

        Cells are strings, numbers, bools or None. W&B gets a ``wandb.Table``, MLflow a
        table artifact, TensorBoard a text table, JSONL the rows as they were logged.
        """
        step = check_step(step)
        check_name("table", name)
        cols, cells = check_table(name, columns, rows)
        self._sink.append(Table(time.time(), step, name, cols, cells), step=step)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        """Log a distribution (a list or array of real numbers) for ``step``.

        Shipped as a histogram (TensorBoard, W&B) or its summary (MLflow, JSONL); the
        values of every rank are pooled.
        """
        step = check_step(step)
        check_name("histogram", name)
        if hasattr(values, "tolist"):  # numpy arrays, torch tensors
            values = (
                values.detach().cpu().tolist() if hasattr(values, "detach") else values.tolist()
            )
        if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
            raise InvalidValueError(f"histogram {name!r}: expected a sequence of numbers")
        flat = [as_float(name, v) for v in _flatten(values)]
        if len(flat) > MAX_HISTOGRAM_VALUES:
            raise InvalidValueError(
                f"histogram {name!r} has {len(flat)} values, more than {MAX_HISTOGRAM_VALUES}"
            )
        self._sink.append(Histogram(time.time(), step, name, flat), step=step)

    def log_image(self, name: str, image: Any, step: int, *, format: str = "png") -> None:
        """Log an image for ``step``: encoded bytes, or a matplotlib figure (saved as PNG, and,
        with plotly installed, also as a Plotly chart for W&B: :func:`plotly_json`)."""
        step = check_step(step)
        check_name("image", name)
        if not isinstance(format, str) or not _FORMAT.fullmatch(format):
            raise InvalidValueError(f"image {name!r}: format {format!r} is not a file extension")
        plot = ""
        if hasattr(image, "savefig"):  # a matplotlib Figure
            import io

            buf = io.BytesIO()
            image.savefig(buf, format="png", bbox_inches="tight")
            data, format = buf.getvalue(), "png"
            plot = plotly_json(image)  # for W&B's interactive chart (the plots extra)
            if plot and len(data) + len(plot.encode()) > MAX_TEXT_BYTES:
                plot = ""  # too large to carry with the image: the image alone
        elif isinstance(image, bytes | bytearray | memoryview):
            data = bytes(image)
        else:
            raise InvalidValueError(
                f"image {name!r}: expected encoded bytes or a matplotlib figure, "
                f"got {type(image).__name__}"
            )
        if len(data) > MAX_TEXT_BYTES:
            raise InvalidValueError(f"image {name!r} is larger than {MAX_TEXT_BYTES} bytes")
        self._sink.append(Image(time.time(), step, name, data, format, plot), step=step)

    def log_hyperparams(self, params: Mapping[str, Any] | Any) -> None:
        """Log hyperparameters: nested dicts flattened with ``.``, secrets redacted (the
        rule: docs/producer.md), lists of scalars kept as lists."""
        flat = flatten_params(params, redactor=self._redactor)
        lists = {k: v for k, v in flat.items() if isinstance(v, list)}
        values = {k: v for k, v in flat.items() if not isinstance(v, list)}
        self._sink.append(Params(time.time(), values, lists))

    def define_metric(
        self, name: str, step_metric: str | None = None, *, summary: str | None = None,
        hidden: bool = False, goal: str | None = None,
    ) -> None:  # fmt: skip
        """Say how a metric is shown (W&B's ``define_metric``): ``name``, a key or a glob
        ending in ``*``, plotted against ``step_metric`` (a metric logged with it), with a
        ``summary`` (``min``, ``max``, ``mean``, ``last``, ``best`` with a ``goal``:
        ``minimize`` or ``maximize``), or ``hidden``.

        A run record (docs/producer.md): W&B gets the definition, JSONL and Parquet keep
        it; TensorBoard, MLflow, SwanLab and trackio have no such setting.
        """
        key, options = definition(name, step_metric, summary, hidden, goal)
        self._sink.append(Params(time.time(), {}, {}, {key: options}))

    def log_summary(self, values: Mapping[str, Any]) -> None:
        """Set summary values of the run (W&B's ``run.summary[key] = value``).

        Numbers, strings, bools or None; a later value of a key replaces it. A run record:
        W&B's summary gets them, JSONL and Parquet keep them; the other backends have no
        run summary and are told once that they are left out.
        """
        self._sink.append(Params(time.time(), {}, {}, summary_values(values)))

    def _record_code(self) -> None:
        """Record the git commit, branch, dirty flag and diff of the code (rank 0, at init)."""
        try:
            record = code_record()
        except Exception as exc:  # provenance never stops a run from starting
            warnings.warn(f"ranklog: the code's git state was not recorded: {exc}",
                          RanklogWarning, stacklevel=3)  # fmt: skip
            return
        if record:
            self._sink.append(Params(time.time(), {}, {}, record))


def plotly_json(figure: Any) -> str:
    """A matplotlib figure as a Plotly figure's JSON, as W&B converts one ("" when plotly
    is not installed, the figure holds images, or plotly cannot convert it)."""
    import importlib.util

    if importlib.util.find_spec("plotly") is None:
        return ""
    if any(getattr(ax, "images", None) for ax in getattr(figure, "axes", ())):
        return ""  # W&B logs such a figure as an image too
    try:
        from plotly.tools import mpl_to_plotly

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return str(mpl_to_plotly(figure).to_json())
    except Exception:  # what plotly's converter cannot do: the image stays
        return ""


def _flatten(values: Any) -> Iterator[Any]:
    for v in values:
        if isinstance(v, list | tuple):
            yield from _flatten(v)
        else:
            yield v
