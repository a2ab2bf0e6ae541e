"""What an MLflow run receives, as plain data: keys, metric rows, artifact paths and files.

Pure functions of shipped steps, used by :mod:`ranklog.shippers.targets.mlflow`: keys
sanitised as MLflow accepts them, each step's ``Metric`` rows, the held steps as the
text of the ``ranklog.steps`` tags, and the paths and contents of text and table
artifacts.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any, Final

from ranklog.errors import ConfigError
from ranklog.schemas import ParamScalar
from ranklog.shippers._target import ShippedStep, TextItem

__all__ = [
    "HISTOGRAM_STATS",
    "MARKER",
    "chunk_text",
    "code_tags_and_files",
    "decode_steps",
    "encode_steps",
    "held_by",
    "histogram_stat_list",
    "sanitize_key",
]

#: the bookkeeping metric earlier releases logged after each step's metrics: ``open()``
#: still reads its history (runs they wrote), and a metric of that name is renamed
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
    """The run's ``Metric`` rows of ``steps``, each step's values (late values, ``carrier``
    set, at their own step)."""
    for s, values in zip(steps, values_of, strict=True):
        ts, step = _ms(s.ts), s.step
        for name, value in values.items():
            yield metric(keys[name], value, ts, step)


def held_by(steps: list[ShippedStep]) -> list[int]:
    """The steps a write of ``steps`` makes held: each step, a late one's carrier."""
    return [s.step if s.carrier is None else s.carrier for s in steps]


def encode_steps(ranges: list[tuple[int, int]]) -> str:
    """Held steps as text: ``lo-hi`` ranges and single steps, comma-separated; three or
    more single steps an equal stride apart as ``lo-hi/stride`` (steps logged every 10)."""
    parts: list[str] = []
    i = 0
    while i < len(ranges):
        lo, hi = ranges[i]
        j = i + 1
        if lo == hi and j < len(ranges) and ranges[j][0] == ranges[j][1]:
            stride = ranges[j][0] - lo
            while (j < len(ranges) and ranges[j][0] == ranges[j][1]
                   and ranges[j][0] - ranges[j - 1][0] == stride):  # fmt: skip
                j += 1
            if j - i >= 3:
                parts.append(f"{lo}-{ranges[j - 1][0]}/{stride}")
                i = j
                continue
        parts.append(str(lo) if lo == hi else f"{lo}-{hi}")
        i += 1
    return ",".join(parts)


def decode_steps(text: str) -> list[tuple[int, int]]:
    """The ranges of :func:`encode_steps`' text (a stride expanded into single steps)."""
    out: list[tuple[int, int]] = []
    for part in filter(None, text.split(",")):
        span, _, stride = part.partition("/")
        lo, _, hi = span.partition("-")
        first, last = int(lo), int(hi or lo)
        if stride:
            out.extend((s, s) for s in range(first, last + 1, int(stride)))
        else:
            out.append((first, last))
    return out


def chunk_text(text: str, size: int) -> list[str]:
    """``text`` cut at commas into pieces of at most ``size`` characters."""
    out: list[str] = []
    cur = ""
    for part in text.split(","):
        if cur and len(cur) + 1 + len(part) > size:
            out.append(cur)
            cur = part
        else:
            cur = f"{cur},{part}" if cur else part
    return [*out, cur] if cur or not out else out


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


#: the statistics a distribution can become in MLflow (:func:`~._media.summary`'s)
HISTOGRAM_STATS: Final = ("count", "min", "max", "mean", "std", "p50", "p90")


def histogram_stat_list(text: str | None) -> tuple[str, ...]:
    """The statistics ``--histogram-stats`` names (every one when None)."""
    if text is None:
        return HISTOGRAM_STATS
    stats = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [s for s in stats if s not in HISTOGRAM_STATS]
    if bad:
        raise ConfigError(
            f"--histogram-stats {text!r}: {', '.join(bad)} is not one of "
            f"{', '.join(HISTOGRAM_STATS)}"
        )
    return stats


def _with_histograms(
    step: ShippedStep, gpu_names: str = "ranklog", started: float | None = None,
    stats: tuple[str, ...] = HISTOGRAM_STATS,
) -> dict[str, float]:  # fmt: skip
    """The step's metrics plus each histogram's summary (``name/count``, ``/min``, ...)."""
    if not step.histograms and not step.gpu:
        return step.metrics
    from ranklog.shippers.targets._media import gpu_metrics, summary

    style = "nemo" if gpu_names == "nemo" else "mlflow"
    out = {**step.metrics, **gpu_metrics(step, style, started=started)}
    for name, values in step.histograms.items():
        got = summary(values)
        out.update({f"{name}/{stat}": got[stat] for stat in stats if stat in got})
    return out


def _text_files(step: ShippedStep) -> list[tuple[str, str]]:
    """(artifact path, text) of each text name of a step: ``text/<name>/step_<step>.md``,
    one file per name and step (MLflow's artifact view shows it as it is); where several
    ranks (or one rank several times) logged the name, each text under ``### rank R``."""
    by_name: dict[str, list[TextItem]] = {}
    for t in step.texts:
        by_name.setdefault(t.name, []).append(t)
    out = []
    for name, items in by_name.items():
        path = f"text/{_name_path(name)}/step_{step.step:08d}{_late(step)}.md"
        if len(items) == 1:
            out.append((path, items[0].text))
        else:
            out.append((path, "\n\n".join(f"### rank {t.rank}\n\n{t.text}" for t in items)))
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
    """``top/step_<step:08d>/<name>``, the name as :func:`_name_path` makes it."""
    return f"{top}/step_{step:08d}/{_name_path(name)}"


def _name_path(name: str) -> str:
    """``name`` as artifact folders: its parts sanitised, each under 121 bytes."""
    parts = sanitize_key(name).split("/")
    if any(len(p.encode()) > 120 for p in parts):  # file names: 255 bytes at most
        digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8]
        parts = [p.encode()[:120].decode(errors="ignore") for p in parts]
        parts[-1] += f"_{digest}"
    return "/".join(parts)


def code_tags_and_files(meta: Mapping[str, ParamScalar]) -> tuple[dict[str, str], dict[str, str]]:
    """The tags and artifact files (path -> text) of the ``code/*`` run records in ``meta``.

    Tags are MLflow's own, as its autologging sets them: ``mlflow.source.git.commit``,
    ``.branch``, ``.repoURL``; files ``code/git.json`` (every field but the diff) and
    ``code/uncommitted_changes_diff.txt`` when the tree differs from its commit.
    """
    from ranklog.shippers._meta import records

    code = records(meta, "code")
    if not code:
        return {}, {}
    tags: dict[str, str] = {}
    for field, tag in (("commit", "commit"), ("branch", "branch"), ("remote", "repoURL")):
        value = code.get(field)
        if value:
            tags[f"mlflow.source.git.{tag}"] = str(value)
    diff = code.pop("diff", None)
    files = {"code/git.json": json.dumps(code, indent=1, sort_keys=True)}
    if diff:
        files["code/uncommitted_changes_diff.txt"] = str(diff)
    return tags, files
