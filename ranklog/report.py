"""``ranklog report DIR --out report.html``: one self-contained HTML page about a compacted run.

Metric curves, a rank x step heatmap of step time, GPU use, a timeline of every rank's
incarnations, the latest text samples (validation generations, say) and the params; the
plots are base64 PNGs drawn by matplotlib (the ``report`` extra, imported
only to draw, without pyplot). The data behind each plot comes from a public function that
aggregates with pyarrow compute, never row by row.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from ranklog.archive import (
    MANIFEST,
    SCHEMAS,
    TABLES,
    check_files,
    load_manifest,
    not_a_dataset,
    table_files,
)
from ranklog.errors import ArchiveError, ExtraMissingError
from ranklog.schemas import is_meta_key
from ranklog.shippers._meta import code_line, records

try:
    import numpy as np
    import numpy.typing as npt
except ImportError as exc:  # pragma: no cover - numpy comes with matplotlib
    raise ExtraMissingError("matplotlib", "report") from exc

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["STRAGGLER", "Bar", "Curve", "GpuSeries", "Sample", "gpu_series", "median_of_others",
           "metric_curves", "metric_names", "step_time_matrix", "step_timer", "stragglers",
           "text_samples", "timeline_bars", "write_report"]  # fmt: skip

F64 = npt.NDArray[np.float64]
MAX_COLUMNS: Final = 600  # heatmap columns: more steps than this are binned
MAX_LINES: Final = 16  # GPUs drawn as lines; more are drawn as GPU x time heatmaps
MAX_SAMPLE_CHARS: Final = 4000  # a text sample longer than this is cut in the report
STATUS_COLORS: Final = {"ok": "#3a9d5d", "error": "#d1453b", "signal": "#f28e2b",
                        "exit": "#8e6bbf", None: "#b8bcc4"}  # fmt: skip
_PREFIXES: Final = ("train/", "val/", "eval/", "test/")
_GIB, _BLUE, _RED, _GREY, _X, _DASH = 2.0**30, "#3b6fb6", "#d1453b", "#8a8f99", "\xd7", "\u2013"


def _read(root: Path, table: str, cols: list[str], where: Any = None, names: bool = False) -> Any:
    """``cols`` of one table, filtered by ``where``; ``name`` as a dictionary if ``names``."""
    schema, text = SCHEMAS[table], pa.dictionary(pa.int32(), pa.string()) if names else pa.string()
    schema = schema.set(schema.get_field_index("name"), pa.field("name", text)) if names else schema
    files = table_files(root, table)
    if not (root / table).is_dir() or not files:
        return schema.empty_table().select(cols)
    fmt = ds.ParquetFileFormat(read_options={"dictionary_columns": ["name"] if names else []})
    return ds.dataset(files, format=fmt, schema=schema).to_table(cols, filter=where)


def _floats(col: Any, ts: bool = False) -> F64:
    """A column as float64 (nulls as NaN); timestamps as Unix seconds."""
    col = pc.cast(col, pa.int64()) if ts else col
    out = np.asarray(pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False), np.float64)
    return out / 1e6 if ts else out


def _counts(dataset: Path, table: str, where: Any = None) -> dict[str, int]:
    counts = pc.value_counts(_read(dataset, table, ["name"], where, names=True)["name"])
    names = counts.field(0).dictionary_decode().to_pylist()
    return dict(zip(names, counts.field(1).to_pylist(), strict=True))


class Curve(NamedTuple):
    """One metric per step: the mean, min and max across ranks of each rank's mean."""

    name: str
    steps: F64
    mean: F64
    lo: F64
    hi: F64


def metric_names(dataset: Path, limit: int = 12) -> list[str]:
    """Metrics worth a plot: train/, val/, eval/, test/ first, then losses, others; by name."""
    names = _counts(dataset, "metrics", pc.is_finite(pc.field("value")))
    group = {n: next((i for i, p in enumerate(_PREFIXES) if n.startswith(p)), 4 + ("loss" not in n))
             for n in names}  # fmt: skip
    return sorted(names, key=lambda n: (group[n], n))[:limit]


def metric_curves(dataset: Path, names: list[str] | None = None) -> list[Curve]:
    """Across-rank mean and min-max band per step of ``names`` (default :func:`metric_names`)."""
    curves = []
    for name in metric_names(dataset) if names is None else names:
        where = (pc.field("name") == name) & pc.is_finite(pc.field("value"))
        rows = _read(dataset, "metrics", ["rank", "step", "value"], where)
        per_rank = rows.group_by(["step", "rank"]).aggregate([("value", "mean")])
        stats = [("value_mean", "mean"), ("value_mean", "min"), ("value_mean", "max")]
        agg = per_rank.group_by("step").aggregate(stats).sort_by("step")
        if agg.num_rows:
            cols = ["step", "value_mean_mean", "value_mean_min", "value_mean_max"]
            curves.append(Curve(name, *(_floats(agg[c]) for c in cols)))
    return curves


def step_timer(dataset: Path) -> str | None:
    """The timer that measures a step: ``step_time`` if logged, else the one with most rows."""
    counts = _counts(dataset, "timers")
    best = sorted(counts, key=lambda n: (-counts[n], n))
    return "step_time" if "step_time" in counts else (best[0] if best else None)


def step_time_matrix(
    dataset: Path, timer: str | None = None, max_columns: int = MAX_COLUMNS
) -> tuple[list[int], F64, F64]:
    """(ranks, first step of each column, mean seconds [rank row, column]; NaN where none)."""
    where = (pc.field("name") == (timer or step_timer(dataset))) & pc.is_finite(pc.field("value"))
    rows = _read(dataset, "timers", ["rank", "step", "value"], where)
    if not rows.num_rows:
        return [], np.zeros(0), np.zeros((0, 0))
    lo, hi = (int(x.as_py()) for x in pc.min_max(rows["step"]).values())
    width = max(1, -(-(hi - lo + 1) // max_columns))
    col = pc.divide(pc.subtract(rows["step"], lo), width)  # integer division
    cells = pa.table({"rank": rows["rank"], "col": col, "value": rows["value"]})
    agg = cells.group_by(["rank", "col"]).aggregate([("value", "mean")])
    ranks = np.unique(agg["rank"].to_numpy())
    matrix = np.full((len(ranks), (hi - lo) // width + 1), np.nan)
    matrix[np.searchsorted(ranks, agg["rank"].to_numpy()), agg["col"].to_numpy()] = _floats(
        agg["value_mean"])  # fmt: skip
    return [int(r) for r in ranks], lo + width * np.arange(matrix.shape[1], dtype=float), matrix


class GpuSeries(NamedTuple):
    """The samples of one GPU in time order (Unix seconds, utilisation %, memory bytes)."""

    host: str
    gpu: int  # its index on the host
    name: str
    ts: F64
    util: F64
    mem_used: F64
    mem_total: float


def gpu_series(dataset: Path) -> list[GpuSeries]:
    """One series per GPU, ordered by (host, index)."""
    cols = ["host", "index", "gpu_name", "ts", "util", "mem_used", "mem_total"]
    order = [("host", "ascending"), ("index", "ascending"), ("ts", "ascending")]
    rows = _read(dataset, "gpu", cols, where=ds.field("index") >= 0).sort_by(order)  # GPUs only
    keys = rows.group_by(["host", "index"]).aggregate([("ts", "count")]).sort_by(order[:2])
    ts, util, used, total = (_floats(rows["ts"], ts=True), *(_floats(rows[c]) for c in cols[4:]))
    out, start = [], 0
    hosts, gpus, counts = (keys[c].to_pylist() for c in ["host", "index", "ts_count"])
    for host, gpu, n in zip(hosts, gpus, counts, strict=True):
        s, name = slice(start, start + n), rows["gpu_name"][start].as_py() or ""
        out.append(GpuSeries(host, gpu, name, ts[s], util[s], used[s], np.fmax.reduce(total[s])))
        start += n
    return out


class Bar(NamedTuple):
    """One incarnation of a rank: rank_start to rank_end, or to its last event if it has none."""

    rank: int
    incarnation: int
    start: float
    end: float
    status: str | None  # None: no rank_end (died or still running)
    exit_code: int | None = None


def timeline_bars(dataset: Path) -> list[Bar]:
    """Every (rank, incarnation) seen in any table, in that order."""
    by = ["rank", "incarnation"]
    tables = [_read(dataset, name, [*by, "ts"]) for name in TABLES]
    spans = [t.group_by(by).aggregate([("ts", "min"), ("ts", "max")]) for t in tables if t.num_rows]
    if not spans:
        return []
    span = pa.concat_tables(spans).group_by(by).aggregate([("ts_min", "min"), ("ts_max", "max")])
    where = pc.field("kind").isin(["rank_start", "rank_end"])
    marks = _read(dataset, "ranks", ["kind", *by, "ts", "status", "exit_code"], where).to_pylist()
    found = {(m["kind"], m["rank"], m["incarnation"]): m for m in marks}  # 2 per incarnation
    bars = []
    for s in sorted(span.to_pylist(), key=lambda s: (s["rank"], s["incarnation"])):
        key = (s["rank"], s["incarnation"])
        start, end = found.get(("rank_start", *key), {}), found.get(("rank_end", *key), {})
        bars.append(Bar(*key, (start.get("ts") or s["ts_min_min"]).timestamp(),
                        (end.get("ts") or s["ts_max_max"]).timestamp(), end.get("status"),
                        end.get("exit_code")))  # fmt: skip
    return bars


class Sample(NamedTuple):
    """A text logged for one step: by ``rank``, or alike by the ranks ``ranks`` (``rank``
    None)."""

    name: str
    step: int
    rank: int | None
    text: str
    #: the ranks that logged it (one: ``rank``'s)
    ranks: tuple[int, ...] = ()


def text_samples(dataset: Path, latest: int = 3) -> list[Sample]:
    """The texts of each name's ``latest`` steps, newest first; one sample per step where
    every rank that logged it logged the same text, else one per rank. Names in order."""
    live = pc.invert(pc.field("relogged"))  # a relaunch's re-logged value never shipped
    pairs = _read(dataset, "text", ["name", "step"], live).group_by(["name", "step"]).aggregate([])
    steps: dict[str, list[int]] = {}
    for name, step in zip(pairs["name"].to_pylist(), pairs["step"].to_pylist(), strict=True):
        steps.setdefault(name, []).append(step)
    out: list[Sample] = []
    for name in sorted(steps):
        keep = sorted(steps[name], reverse=True)[:latest]
        where = live & (pc.field("name") == name) & pc.field("step").isin(keep)
        rows = _read(dataset, "text", ["step", "rank", "text"], where).sort_by(
            [("step", "descending"), ("rank", "ascending")]
        )
        by_step: dict[int, list[tuple[int, str]]] = {}
        for step, r, text in zip(*(rows[c].to_pylist() for c in ("step", "rank", "text")),
                                 strict=True):  # fmt: skip
            by_step.setdefault(step, []).append((r, text))
        for step, texts in by_step.items():
            ranks = tuple(r for r, _ in texts)
            if len({t for _, t in texts}) == 1 and len(ranks) > 1:
                out.append(Sample(name, step, None, texts[0][1], ranks))
            else:
                out.extend(Sample(name, step, r, t, (r,)) for r, t in texts)
    return out


def _who(s: Sample, world: int | None) -> str:
    """Which ranks logged a sample: ``rank 0 of 2``, ``ranks 0, 2 of 4``, ``all 8 ranks``."""
    of = f" of {world}" if world else ""
    if s.rank is not None:
        return f"rank {s.rank}{of}"
    if world and len(s.ranks) == world:
        return f"all {world} ranks alike"
    shown = ", ".join(map(str, s.ranks[:8])) + (", ..." if len(s.ranks) > 8 else "")
    return f"ranks {shown}{of} alike"


def _samples_html(samples: list[Sample], world: int | None = None) -> str:
    parts, name = [], None
    for s in samples:
        if s.name != name:
            name = s.name
            parts.append(f"<h3>{html.escape(s.name)}</h3>")
        who = _who(s, world)
        text = s.text if len(s.text) <= MAX_SAMPLE_CHARS else s.text[:MAX_SAMPLE_CHARS] + " [...]"
        parts.append(f"<p class=who>step {s.step}, {who}</p><pre>{html.escape(text)}</pre>")
    return "<div class=samples>" + "".join(parts) + "</div>"


def _figure(height: float) -> Figure:
    from matplotlib.figure import Figure  # drawn by Agg when saved as PNG; no pyplot

    return Figure(figsize=(11.0, height), dpi=110, layout="constrained")


def _figure_html(name: str, fig: Figure, caption: str) -> str:
    fig.savefig(buf := io.BytesIO(), format="png")
    data, cap = base64.b64encode(buf.getvalue()).decode("ascii"), html.escape(caption)
    return (f'<figure data-plot="{name}"><img alt="{cap}" src="data:image/png;base64,{data}">'
            f"<figcaption>{cap}</figcaption></figure>")  # fmt: skip


def _rows(ax: Axes, labels: list[Any], name: str) -> None:
    """Rows 0..n-1 top to bottom, labelled every 2**k rows (at most 16 labels)."""
    every = 1 << max(0, math.ceil(math.log2(len(labels) / 16)))
    ax.set_yticks(range(0, len(labels), every), [str(x) for x in labels[::every]])
    ax.set(ylim=(len(labels) - 0.5, -0.5), ylabel=name)


def _heat(ax: Axes, m: F64, x: tuple[float, float], cmap: str, lim: Any, rows: list[Any]) -> Any:
    """``m`` as a heatmap (rows top to bottom) spanning ``x``; returns the image."""
    im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap=cmap, vmin=lim[0],
                   vmax=lim[1], extent=(*x, len(m) - 0.5, -0.5))  # fmt: skip
    _rows(ax, rows, "host:GPU" if ":" in str(rows[0]) else "rank")
    ax.set_facecolor("#e6e7ea")  # NaN cells: grey
    return im


def _metrics_html(curves: list[Curve]) -> str:
    ncols, nrows = min(3, len(curves)), -(-len(curves) // 3)
    fig = _figure(0.4 + 2.6 * nrows)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    for ax, c in zip(axes, curves, strict=False):
        band = f"min{_DASH}max of ranks"
        ax.fill_between(c.steps, c.lo, c.hi, color=_BLUE, alpha=0.22, lw=0, label=band)
        ax.plot(c.steps, c.mean, color=_BLUE, lw=1.6, marker="o" if len(c.steps) < 3 else "",
                label="mean of ranks")  # fmt: skip
        ax.set(title=c.name, xlabel="step")
        ax.locator_params(axis="x", integer=True)
        ax.grid(alpha=0.3)
    for ax in axes[len(curves) :]:
        ax.set_visible(False)
    axes[0].legend(loc="best", fontsize=8)
    caption = (f"{len(curves)} metric{'s' * (len(curves) > 1)}: per step, the mean across ranks "
               "of each rank's mean (line) and the lowest to highest rank (band).")  # fmt: skip
    return _figure_html("metrics", fig, caption)


def _heatmap_html(timer: str | None, ranks: list[int], steps: F64, m: F64) -> str:
    n, width = len(ranks), (steps[1] - steps[0]) if len(steps) > 1 else 1.0
    fig = _figure(min(8.0, max(2.8, 1.3 + 0.2 * n)))
    ax, side = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [7, 1]})
    lim = np.percentile(m[np.isfinite(m)], [0.5, 99.5])
    im = _heat(ax, m, (steps[0] - width / 2, steps[-1] + width / 2), "magma", lim, ranks)
    fig.colorbar(im, ax=side, label=f"{timer} (s)", extend="both", fraction=0.5, aspect=30)
    median = np.array([np.median(r[np.isfinite(r)]) if np.isfinite(r).any() else np.nan
                       for r in m])  # fmt: skip
    slow = stragglers(median)
    overall, worst = float(np.nanmedian(median)), int(np.nanargmax(median))
    side.barh(range(n), np.nan_to_num(median), height=0.8 if n <= 64 else 1.0,
              color=np.where(slow, _RED, _GREY))  # fmt: skip
    side.axvline(overall, color="black", lw=0.8, ls="--")
    side.set_xlabel("median (s)")
    ax.set_xlabel("step")
    ax.locator_params(axis="x", integer=True)
    binned = f", {int(width)} steps per column" if width > 1 else ""
    others = median_of_others(median)[worst]
    flagged = [ranks[i] for i in np.flatnonzero(slow)]
    red = ", ".join(map(str, flagged[:16])) + (", ..." if len(flagged) > 16 else "")
    red = ("rank " if len(flagged) == 1 else "ranks ") + red if flagged else "none"
    caption = (f"{timer} per rank and step (mean per cell{binned}; grey: none logged). Slowest "
               f"rank {ranks[worst]}: median {median[worst]:.3g} s, "
               f"{median[worst] / others:.2f}{_X} the median of the other ranks. Red, slower "
               f"than {STRAGGLER}{_X} the other ranks' median: {red}.")  # fmt: skip
    return _figure_html("step_time", fig, caption)


#: a rank is a straggler when its median step time passes this many times the median
#: of the other ranks' (against the others, a 2-rank job's slow rank shows)
STRAGGLER: Final = 1.2


def median_of_others(median: F64) -> F64:
    """For each rank, the median of the other ranks' values (NaN: no other finite one);
    exact, in O(n log n): the sorted values, less the rank's own place."""
    out = np.full(len(median), np.nan)
    ok = np.flatnonzero(np.isfinite(median))
    n = len(ok)
    if n < 2:
        return out
    x = median[ok]
    order = np.argsort(x, kind="stable")
    s, pos = x[order], np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)

    def nth(j: int) -> F64:  # the j-th smallest of the others, for each rank
        picked: F64 = np.where(j < pos, s[j], s[min(j + 1, n - 1)])
        return picked

    out[ok] = (nth((n - 2) // 2) + nth((n - 1) // 2)) / 2
    return out


def stragglers(median: F64) -> Any:
    """Which ranks are stragglers: their median above :data:`STRAGGLER` times the others'."""
    others = median_of_others(median)
    with np.errstate(invalid="ignore"):
        return np.isfinite(others) & (median > STRAGGLER * others)


def _gpu_html(series: list[GpuSeries], t0: float, t1: float, div: float, unit: str) -> str:
    many = len(series) > MAX_LINES
    total = max((g.mem_total for g in series if g.mem_total > 0), default=0.0) / _GIB
    top = total or max(1.0, *(np.nan_to_num(np.fmax.reduce(g.mem_used)) / _GIB for g in series))
    fig = _figure(5.4 if not many else min(10.0, max(5.4, 2.0 + 0.016 * len(series))))
    axes = fig.subplots(2, 1, sharex=True)
    ys = [
        ("utilisation (%)", [g.util for g in series], (0.0, 100.0), "viridis"),
        ("memory used (GiB)", [g.mem_used / _GIB for g in series], (0.0, top), "cividis"),
    ]
    for ax, (label, values, lim, cmap) in zip(axes, ys, strict=True):
        if many:  # GPUs x time bins of about 2 samples: the mean of the samples in each bin
            bins = min(400, max(1, int(np.median([len(g.ts) for g in series])) // 2))
            grid, scale = np.full((len(series), bins), np.nan), bins / max(t1 - t0, 1e-9)
            for row, g, v in zip(grid, series, values, strict=True):
                ok, col = np.isfinite(v), np.minimum(((g.ts - t0) * scale).astype(int), bins - 1)
                with np.errstate(invalid="ignore"):
                    row[:] = np.bincount(col[ok], v[ok], bins) / np.bincount(col[ok], None, bins)
            rows = [f"{g.host}:{g.gpu}" for g in series]
            fig.colorbar(_heat(ax, grid, (0, (t1 - t0) / div), cmap, lim, rows), ax=ax, label=label)
            continue
        for g, v in zip(series, values, strict=True):  # NaN in gaps, so no line bridges them
            cut = np.flatnonzero(np.diff(g.ts) > 5 * np.median(np.diff(g.ts))) if len(v) > 2 else 0
            x, y = np.insert((g.ts - t0) / div, cut + 1, np.nan), np.insert(v, cut + 1, np.nan)
            ax.plot(x, y, lw=1.2, label=f"{g.host}:{g.gpu}")
        ax.set(ylabel=label, ylim=(lim[0], lim[1] * 1.04))
        ax.grid(alpha=0.3)
    axes[1].set_xlabel(f"time since the first event ({unit})")
    if not many:
        axes[1].axhline(total, color="black", lw=0.8, ls="--", visible=total > 0)
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    how = "mean per GPU and time bin; grey: no samples" if many else "dashed: memory size"
    caption = (f"{len(series)} GPUs ({series[0].name or 'model unknown'}): utilisation and "
               f"memory used over time ({how}).")  # fmt: skip
    return _figure_html("gpu", fig, caption)


def _timeline_html(bars: list[Bar], t0: float, t1: float, div: float, unit: str) -> str:
    ranks = sorted({b.rank for b in bars})
    row, n = {r: i for i, r in enumerate(ranks)}, len(ranks)
    fig = _figure(min(7.0, max(2.4, 1.3 + 0.2 * n)))
    ax = fig.subplots()
    for status in sorted({b.status for b in bars}, key=lambda s: (s is None, str(s))):
        group, died = [b for b in bars if b.status == status], status is None
        y, left = [row[b.rank] for b in group], np.array([(b.start - t0) / div for b in group])
        width = np.maximum([(b.end - b.start) / div for b in group], (t1 - t0) / div / 300)
        label = "no rank_end: died or still running" if died else f"ended: {status}"
        ax.barh(y, width, left=left, height=0.72 if n <= 64 else 1.0, label=label, lw=0.6,
                color=STATUS_COLORS.get(status, "#a0785a"), hatch="////" if died else None,
                edgecolor="#555b66" if died else "white" if n <= 64 else "none")  # fmt: skip
        if died:
            ax.scatter(left + width, y, marker="x", color="#22252b", s=22, zorder=3, lw=1.2)
    _rows(ax, ranks, "rank")
    ax.set_xlabel(f"time since the first event ({unit})")
    ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=8)
    caption = (f"{n} ranks, {len(bars)} incarnations, {sum(b.status is None for b in bars)} "
               f"without rank_end (died or still running, marked {_X}); a requeued rank has "
               "one bar per incarnation.")  # fmt: skip
    return _figure_html("timeline", fig, caption)


def _params_html(pairs: list[dict[str, str]]) -> str:
    values: dict[str, list[str]] = {}
    for p in pairs:
        v = json.loads(p["value"])
        name = p["name"][1:] if p["name"][:2] == "@@" else p["name"]  # "@@x": param "@x"
        values.setdefault(name, []).append(v if isinstance(v, str) else json.dumps(v))
    body = "".join(f"<tr><td>{html.escape(k)}<td class=v>{html.escape(' | '.join(v))}"
                   f"{' <i>(differs across ranks)</i>' if len(v) > 1 else ''}</tr>"
                   for k, v in values.items())  # fmt: skip
    return f"<div class=params><table><tr><th>name<th>value</tr>{body}</table></div>"


_CSS: Final = """
body{font:15px/1.45 system-ui,sans-serif;margin:0;background:#f3f4f7;color:#1d2330}
main{max-width:1180px;margin:0 auto;padding:24px 28px}h1{margin:0;font-size:26px}figure{margin:0}
.id{color:#667;font:13px monospace}h2{font-size:17px;margin:2px 0 8px}.card span{font-size:17px}
.cards{display:grid;gap:10px;margin-bottom:18px;grid-template-columns:repeat(auto-fit,minmax(9em,1fr))}
.card,section{background:#fff;border:1px solid #e0e3e9;border-radius:8px;padding:8px 14px 14px}
.card b{display:block;font-size:11px;color:#6b7280;text-transform:uppercase;letter-spacing:.05em}
section{margin:0 0 16px}figcaption,.none{color:#4b5563;font-size:13px}.none{font-style:italic}
figure img{width:100%;display:block}table{border-collapse:collapse;font-size:13px}td.v{font:13px
monospace}td,th{padding:3px 18px 3px 0;text-align:left;border-bottom:1px solid #eceef2}
.params{max-height:340px;overflow:auto}.samples{max-height:520px;overflow:auto}
h3{font-size:14px;margin:10px 0 2px}.who{color:#4b5563;font-size:12px;margin:6px 0 2px}
pre{white-space:pre-wrap;background:#f6f7f9;border-radius:4px;padding:6px 8px;margin:0;
font-size:12px}
"""


def write_report(dataset: Path, out: Path) -> Path:
    """Write the HTML report of the Parquet dataset ``dataset`` to ``out``; returns ``out``."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ExtraMissingError("matplotlib", "report") from exc
    dataset, out = Path(dataset), Path(out)
    if not (dataset / MANIFEST).is_file() and (
        (dataset / "run.json").is_file() or not any((dataset / t).is_dir() for t in TABLES)
    ):
        raise ArchiveError(not_a_dataset(dataset))
    manifest = load_manifest(dataset)
    check_files(dataset, manifest)  # a damaged file: named in one line, not a traceback
    bars = timeline_bars(dataset)
    t0, t1 = min((b.start for b in bars), default=0.0), max((b.end for b in bars), default=0.0)
    span = t1 - t0
    div, unit = (1.0, "s") if span < 180 else (60.0, "min") if span < 3 * 3600 else (3600.0, "h")
    steps = [c for t in ("metrics", "timers") for c in _read(dataset, t, ["step"])["step"].chunks]
    lo, hi = (x.as_py() for x in pc.min_max(pa.chunked_array(steps, pa.int64())).values())
    nranks = len({b.rank for b in bars})
    cards = {
        "world size": str(manifest.world_size or "unknown"),
        "ranks seen": f"{nranks} (restarts: {len(bars) - nranks})",
        "steps": "none" if lo is None else f"{lo} {_DASH} {hi}",
        "started": datetime.fromtimestamp(t0, UTC).strftime("%Y-%m-%d %H:%M UTC") if bars else "-",
        "duration": f"{span / div:.3g} {unit}" if bars else "-",
    }
    with matplotlib.rc_context({"font.size": 9, "axes.titlesize": 10, "axes.titleweight": "bold",
                                "axes.titlelocation": "left", "axes.spines.top": False,
                                "axes.spines.right": False, "text.parse_math": False}):  # fmt: skip
        curves, gpus, timer = metric_curves(dataset), gpu_series(dataset), step_timer(dataset)
        samples = text_samples(dataset)
        ranks, firsts, m = step_time_matrix(dataset, timer)
        params = _read(dataset, "params", ["name", "value"]).group_by(["name", "value"])
        rows = params.aggregate([]).sort_by("name").to_pylist()
        pairs = [p for p in rows if not is_meta_key(p["name"])]  # "@...": run records
        meta = {p["name"][1:]: json.loads(p["value"]) for p in rows if is_meta_key(p["name"])}
        if line := code_line(records(meta, "code")):
            cards["code"] = line
        none = "<p class=none>No {} in this run.</p>".format
        sections = {
            "Metrics": _metrics_html(curves) if curves else none("finite metric values"),
            "Step time": _heatmap_html(timer, ranks, firsts, m) if ranks else none("timers"),
            "GPUs": _gpu_html(gpus, t0, t1, div, unit) if gpus else none("GPU samples"),
            "Timeline": _timeline_html(bars, t0, t1, div, unit) if bars else none("rank events"),
            "Samples": _samples_html(samples, manifest.world_size or nranks)
            if samples
            else none("text samples"),
            "Params": _params_html(pairs) if pairs else none("params"),
        }
    title, run_id = (html.escape(x or "unknown") for x in (manifest.name, manifest.run_id))
    boxes = "".join(f"<div class=card><b>{k}</b><span>{html.escape(v)}</span></div>"
                    for k, v in cards.items())  # fmt: skip
    body = "".join(f"<section><h2>{h}</h2>{html_}</section>" for h, html_ in sections.items())
    page = (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{title} - ranklog"
            f"</title><style>{_CSS}</style></head><body><main><h1>{title}</h1><p class=id>run "
            f"{run_id}</p><div class=cards>{boxes}</div>{body}</main></body></html>\n")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out
