"""Histograms and images of a shipped step, in each backend's form.

Shared by the targets: a histogram's buckets and summary statistics, an image's
size read from its PNG header, and the tag an image goes under when several
ranks logged one of the same name (``name/rank00003``).
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from ranklog.schemas import HOST_INDEX, ParamScalar
from ranklog.shippers._registry import Option
from ranklog.shippers._target import ImageItem, ShippedStep, TableItem

__all__ = [
    "DIR_HELP",
    "GPU_NAMES",
    "GPU_NAMES_OPTION",
    "GROUP_HELP",
    "NOTES_HELP",
    "TAGS_HELP",
    "Buckets",
    "buckets",
    "code_markdown",
    "gpu_metrics",
    "image_size",
    "percentile",
    "rank_tags",
    "summary",
    "table_markdown",
]

_PNG = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True, slots=True)
class Buckets:
    """A histogram as TensorBoard stores it: upper edges and counts, plus statistics."""

    lo: float
    hi: float
    count: int
    total: float
    total_sq: float
    limits: list[float]
    counts: list[float]


def buckets(values: list[float], bins: int = 30) -> Buckets | None:
    """Equal-width buckets over the finite values (None when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    lo, hi = min(finite), max(finite)
    width = (hi - lo) / bins if hi > lo else 1.0
    counts = [0.0] * bins
    for v in finite:
        counts[min(bins - 1, int((v - lo) / width))] += 1
    limits = [lo + width * (i + 1) for i in range(bins)]
    limits[-1] = hi if hi > lo else lo + 1.0
    return Buckets(lo, hi, len(finite), math.fsum(finite), math.fsum(v * v for v in finite),
                   limits, counts)  # fmt: skip


def summary(values: list[float]) -> dict[str, float]:
    """count, min, max, mean, std, p50, p90 of the finite values (MLflow's view of a histogram).

    Percentiles interpolate linearly between the two nearest values, as numpy's default.
    """
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return {"count": float(len(values))}
    mean = math.fsum(finite) / len(finite)
    var = math.fsum((v - mean) * (v - mean) for v in finite) / len(finite)
    return {"count": float(len(finite)), "min": finite[0], "max": finite[-1], "mean": mean,
            "std": math.sqrt(var), "p50": percentile(finite, 0.5),
            "p90": percentile(finite, 0.9)}  # fmt: skip


def percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted values, interpolated linearly as numpy's default."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def image_size(data: bytes) -> tuple[int, int, int]:
    """(height, width, channels) from a PNG header; zeros when it is not a PNG."""
    if len(data) < 26 or not data.startswith(_PNG):
        return 0, 0, 0
    width, height = struct.unpack(">II", data[16:24])
    channels = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}.get(data[25], 3)
    return height, width, channels


def rank_tags(items: Sequence[ImageItem | TableItem]) -> list[str]:
    """The tag of each image (or table): its name, or ``name/rankNNNNN`` when ranks share it."""
    shared = Counter(i.name for i in items)
    return [i.name if shared[i.name] == 1 else f"{i.name}/rank{i.rank:05d}" for i in items]


def table_markdown(t: TableItem, *, max_rows: int = 1000) -> str:
    """A table as a Markdown table (TensorBoard's text plugin draws it), at most ``max_rows``."""

    def cell(v: object) -> str:
        text = "" if v is None else str(v)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(cell(c) for c in t.columns) + " |",
             "|" + "---|" * len(t.columns)]  # fmt: skip
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in t.rows[:max_rows]]
    if len(t.rows) > max_rows:
        lines.append(f"\n({len(t.rows) - max_rows} more rows not shown)")
    return "\n".join(lines)


#: the GPU series names a target can use (``--gpu-names``)
GPU_NAMES: Final = ("ranklog", "nemo")
#: the option every target with GPU series declares
GPU_NAMES_OPTION: Final = Option(
    "gpu_names", "GPU series named as ranklog names them, or as NeMo RL's Ray monitor does "
    "(ray/node.N.gpu.M.util, ...; default: ranklog)", choices=GPU_NAMES,
)  # fmt: skip
#: ``--group`` and ``--dir``, shared by the targets that take them (W&B, trackio)
GROUP_HELP: Final = (
    "the group of runs (W&B, trackio, SwanLab; default: --run-name, else the run's name)"
)
DIR_HELP: Final = (
    "local directory for the backend's files (under replay SPOOL is the current directory; "
    "W&B: default SPOOL; SwanLab: SPOOL/swanlog; "
    "trackio: TRACKIO_DIR, where `trackio show` looks)"
)
RUN_ID_HELP: Final = (
    "the backend's run id to write into (W&B id, MLflow run id; default: derived from the "
    "ranklog run id, MLflow: the run found by its tag, else a new one)"
)
TAGS_HELP: Final = "the run's tags, comma-separated (W&B, SwanLab; default: none)"
NOTES_HELP: Final = "the run's notes (W&B; SwanLab's description; default: none)"
_GIB: Final = 1024.0**3


def gpu_metrics(step: ShippedStep, style: str, *, started: float | None = None) -> dict[str, float]:
    """A step's GPU statistics named the way each ecosystem names them.

    ``tensorboard``: ``gpu/<host>/<i>/utilization`` ...; ``mlflow``: MLflow's system
    metrics, ``system/<host>/gpu_<i>_utilization_percentage`` ...; ``wandb``: W&B's,
    ``<host>/gpu.<i>.gpu``, ``<host>/gpu.<i>.memoryAllocatedBytes`` .... Across all GPUs
    of the job: mean utilisation and peak memory. ``nemo``: NeMo RL's Ray monitor's,
    ``ray/node.<n>.gpu.<i>.util`` and ``.mem_gb``, ``ray/node.<n>.mem_gb`` and
    ``.mem_total_gb`` (the host's memory), nodes numbered in host order, and
    ``ray/ray_step``: whole seconds from ``started`` (the run's creation) to the step.
    """
    if not step.gpu:
        return {}
    if style == "nemo":
        return _nemo_gpu_metrics(step, started)
    names = _GPU_NAMES[style]
    out: dict[str, float] = {}
    for g in [g for g in step.gpu if g.index != HOST_INDEX]:
        fields = {"util": g.util, "mem": g.mem_used, "temp": g.temp, "power": g.power}
        for field, value in fields.items():
            if value is not None:
                scale = 1e-6 if style == "mlflow" and field == "mem" else 1.0
                out[names[field].format(host=g.host, i=g.index)] = float(value) * scale
    utils = [g.util for g in step.gpu if g.util is not None and g.index != HOST_INDEX]
    mems = [g.mem_used for g in step.gpu if g.mem_used is not None and g.index != HOST_INDEX]
    if utils:
        out[names["all_util"]] = math.fsum(utils) / len(utils)
    if mems:
        out[names["all_mem"]] = float(max(mems)) * (1e-6 if style == "mlflow" else 1.0)
    return out


def _nemo_gpu_metrics(step: ShippedStep, started: float | None) -> dict[str, float]:
    node = {host: n for n, host in enumerate(sorted({g.host for g in step.gpu}))}
    out: dict[str, float] = {}
    for g in step.gpu:
        n = node[g.host]
        if g.index == HOST_INDEX:
            if g.mem_used is not None:
                out[f"ray/node.{n}.mem_gb"] = g.mem_used / _GIB
            if g.mem_total is not None:
                out[f"ray/node.{n}.mem_total_gb"] = g.mem_total / _GIB
            continue
        if g.util is not None:
            out[f"ray/node.{n}.gpu.{g.index}.util"] = g.util
        if g.mem_used is not None:
            out[f"ray/node.{n}.gpu.{g.index}.mem_gb"] = g.mem_used / _GIB
    if out and started is not None and math.isfinite(step.ts - started):
        out["ray/ray_step"] = float(int(step.ts - started))
    return out


_GPU_NAMES: dict[str, dict[str, str]] = {
    "tensorboard": {
        "util": "gpu/{host}/{i}/utilization",
        "mem": "gpu/{host}/{i}/memory_used_bytes",
        "temp": "gpu/{host}/{i}/temperature",
        "power": "gpu/{host}/{i}/power_watts",
        "all_util": "gpu/all/utilization",
        "all_mem": "gpu/all/memory_used_bytes_max",
    },
    "mlflow": {
        "util": "system/{host}/gpu_{i}_utilization_percentage",
        "mem": "system/{host}/gpu_{i}_memory_usage_megabytes",
        "temp": "system/{host}/gpu_{i}_temperature_celsius",
        "power": "system/{host}/gpu_{i}_power_usage_watts",
        "all_util": "system/gpu_utilization_percentage",
        "all_mem": "system/gpu_memory_usage_megabytes_max",
    },
    "wandb": {
        "util": "{host}/gpu.{i}.gpu",
        "mem": "{host}/gpu.{i}.memoryAllocatedBytes",
        "temp": "{host}/gpu.{i}.temp",
        "power": "{host}/gpu.{i}.powerWatts",
        "all_util": "gpu.all.gpu",
        "all_mem": "gpu.all.memoryAllocatedBytesMax",
    },
}


def code_markdown(meta: Mapping[str, ParamScalar]) -> str:
    """The ``code/*`` run records of ``meta`` as Markdown ("" when it has none): commit,
    branch, remote, whether the tree was dirty, then the diff against the commit."""
    from ranklog.shippers._meta import records

    code = records(meta, "code")
    if not code:
        return ""
    lines = [f"**commit** `{code.get('commit', '?')}`"]
    if code.get("branch"):
        lines.append(f"**branch** `{code['branch']}`")
    if code.get("remote"):
        lines.append(f"**remote** `{code['remote']}`")
    lines.append(f"**root** `{code.get('root', '?')}`")
    dirty = bool(code.get("dirty"))
    lines.append("**dirty**: uncommitted changes, below" if dirty else "**clean**: no changes")
    text = "  \n".join(lines)
    diff = str(code.get("diff") or "")
    if diff:
        fence = "````" if "```" in diff else "```"
        text += f"\n\n{fence}diff\n{diff.rstrip(chr(10))}\n{fence}"
        if code.get("diff_truncated"):
            text += f"\n\n(the first {len(diff.encode())} of {code.get('diff_bytes')} bytes)"
    return text
