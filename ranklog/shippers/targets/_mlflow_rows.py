"""What an MLflow run receives, as plain data: keys, metric rows, artifact paths and files.

Pure functions of shipped steps, used by :mod:`ranklog.shippers.targets.mlflow`: keys
sanitised as MLflow accepts them, each step's ``Metric`` rows followed by the
``ranklog/step`` marker that vouches for them, and the paths and contents of text and
table artifacts.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from typing import Any, Final

from ranklog.shippers._target import ShippedStep, TextItem

__all__ = ["MARKER", "sanitize_key"]

#: the bookkeeping metric logged last for each step: ``open()`` reads it back
MARKER: Final = "ranklog/step"
_MAX_KEY: Final = 250
_BAD_CHAR = re.compile(r"[^/\w.\- :]")


def sanitize_key(name: str) -> str:
    """``name`` if MLflow accepts it as a key, else a valid key with a hash of ``name``."""
    out = _BAD_CHAR.sub("_", name)
    out = re.sub(r"\.(?=\.)", "_", out)  # no ".." anywhere
    out = "/".join(p if p not in ("", ".") else "_" for p in out.split("/"))
    if out == name and len(out) <= _MAX_KEY:
        return out
    digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8]
    return f"{out[: _MAX_KEY - 9]}_{digest}"


def _ms(ts: float) -> int:
    return int(ts * 1000) if math.isfinite(ts) else 0


def _chunks(items: list[Any], n: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _rows(
    metric: Any, steps: list[ShippedStep], values_of: list[dict[str, float]], keys: dict[str, str]
) -> Iterator[Any]:
    """The run's ``Metric`` rows of ``steps``: each step's values, then its marker.

    Late values (``carrier`` set) go at their own step, before the marker of the step
    they came with: the marker vouches for them too.
    """
    marker: tuple[int, int] | None = None  # (step, ts) of the marker due
    for s, values in zip(steps, values_of, strict=True):
        ts, step = _ms(s.ts), s.step
        held = step if s.carrier is None else s.carrier
        if marker is not None and marker[0] != held:
            yield metric(MARKER, float(marker[0]), marker[1], marker[0])
            marker = None
        for name, value in values.items():
            yield metric(keys[name], value, ts, step)
        if marker is None:
            marker = (held, ts)
    if marker is not None:
        yield metric(MARKER, float(marker[0]), marker[1], marker[0])


def _rank_rows(
    metric: Any, steps: list[ShippedStep], rank: int, keys: dict[str, str]
) -> Iterator[Any]:
    """Rank ``rank``'s own ``Metric`` rows of ``steps`` (for its child run)."""
    for s in steps:
        values = s.per_rank.get(rank) if s.per_rank else None
        if values:
            ts, step = _ms(s.ts), s.step
            for name, value in values.items():
                yield metric(keys[name], value, ts, step)


def _with_histograms(
    step: ShippedStep, gpu_names: str = "ranklog", started: float | None = None
) -> dict[str, float]:
    """The step's metrics plus each histogram's summary (``name/count``, ``/min``, ...)."""
    if not step.histograms and not step.gpu:
        return step.metrics
    from ranklog.shippers.targets._media import gpu_metrics, summary

    style = "nemo" if gpu_names == "nemo" else "mlflow"
    out = {**step.metrics, **gpu_metrics(step, style, started=started)}
    for name, values in step.histograms.items():
        out.update({f"{name}/{stat}": v for stat, v in summary(values).items()})
    return out


def _text_files(step: ShippedStep) -> list[tuple[str, str]]:
    """(artifact path, text) of each text event of a step."""
    by_name: dict[str, list[TextItem]] = {}
    for t in step.texts:
        by_name.setdefault(t.name, []).append(t)
    out = []
    for name, items in by_name.items():
        base = _step_path("text", step.step, name)
        seen: dict[int, int] = {}
        for t in items:
            n = seen[t.rank] = seen.get(t.rank, 0) + 1
            suffix = "" if len(items) == 1 else f".rank{t.rank}" + (f".{n}" if n > 1 else "")
            out.append((f"{base}{suffix}{_late(step)}.md", t.text))
    return out


def _table_files(step: ShippedStep) -> list[tuple[str, str]]:
    """(artifact path, JSON) of each table of a step, as MLflow's ``log_table`` writes it.

    ``{"columns": [...], "data": [[...]]}`` (pandas' split orient, non-finite numbers as
    null), written whole: a step sent again rewrites the same file, never appends rows.
    """
    from ranklog.shippers.targets._media import rank_tags

    def cell(v: object) -> object:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return [
        (f"{_step_path('tables', step.step, tag)}{_late(step)}.json",
         json.dumps({"columns": t.columns, "data": [[cell(v) for v in r] for r in t.rows]}))
        for tag, t in zip(rank_tags(step.tables), step.tables, strict=True)
    ]  # fmt: skip


def _late(step: ShippedStep) -> str:
    """The file name suffix of a late step's artifacts (``.late<carrier>``): never the
    first values' file (a relaunch's re-logged text must not overwrite it)."""
    return "" if step.carrier is None else f".late{step.carrier:08d}"


def _step_path(top: str, step: int, name: str) -> str:
    """``top/step_<step:08d>/<name>``: the name's parts sanitised, each under 121 bytes."""
    parts = sanitize_key(name).split("/")
    if any(len(p.encode()) > 120 for p in parts):  # file names: 255 bytes at most
        digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8]
        parts = [p.encode()[:120].decode(errors="ignore") for p in parts]
        parts[-1] += f"_{digest}"
    return f"{top}/step_{step:08d}/{'/'.join(parts)}"
