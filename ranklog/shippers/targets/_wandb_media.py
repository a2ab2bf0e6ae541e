"""What the W&B target logs besides numbers: media values and metric definitions.

``media_values`` turns a step's distributions, tables, images and Plotly charts into
wandb's objects; ``gpu_definitions`` are the ``define_metric`` calls that give GPU series
their own X axis (:mod:`ranklog.shippers.targets.wandb` explains why).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Final, NamedTuple

from ranklog.errors import ExtraMissingError
from ranklog.shippers._target import ShippedStep

__all__ = [
    "GPU_STEP", "GPU_SUMMARY", "NEMO_GPU_DEFINITIONS", "MetricDef", "escape_dots",
    "gpu_definitions", "media_values", "wandb_module",
]  # fmt: skip

log = logging.getLogger("ranklog.ship")

#: the X axis of the GPU series: seconds since the ranklog run was created (no dot in it:
#: wandb-core splits step metric names at dots when it tracks their latest value)
GPU_STEP: Final = "gpu/runtime"
#: the summary of each GPU series, by the last dotted part of its W&B name
GPU_SUMMARY: Final = {
    "gpu": "mean", "memoryAllocatedBytes": "max", "memoryAllocatedBytesMax": "max",
    "temp": "max", "powerWatts": "mean",
}  # fmt: skip


def wandb_module() -> Any:
    try:
        import wandb
    except ImportError:
        raise ExtraMissingError("wandb", "wandb") from None
    return wandb


def media_values(s: ShippedStep) -> dict[str, Any]:
    """Histograms as ``wandb.Histogram``, tables as ``wandb.Table``, images as ``wandb.Image``."""
    import io

    from ranklog.shippers.targets._media import rank_tags

    wandb, out = wandb_module(), dict[str, Any]()
    for name, values in s.histograms.items():
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            out[name] = wandb.Histogram(finite)
    for tag, t in zip(rank_tags(s.tables), s.tables, strict=True):
        # as logged; mixed cell types in a column are the logger's choice, not an error here
        out[tag] = wandb.Table(columns=t.columns, data=t.rows, allow_mixed_types=True)
    if s.images:
        try:
            from PIL import Image as PILImage
        except ImportError:  # pragma: no cover - pillow comes with wandb's media extras
            log.warning("Pillow is not installed: images are not sent to W&B")
            return out
        for tag, img in zip(rank_tags(s.images), s.images, strict=True):
            chart = _plotly(img.plotly) if img.plotly else None
            out[tag] = wandb.Image(PILImage.open(io.BytesIO(img.data))) if chart is None else chart
    return out


def _plotly(text: str) -> Any:
    """A ``wandb.Plotly`` of a Plotly figure's JSON; None (the image is sent) without plotly,
    or when this plotly cannot read it (another version wrote it: said once)."""
    try:
        import plotly.io
    except ImportError:
        return None
    try:
        return wandb_module().Plotly(plotly.io.from_json(text))
    except Exception as exc:  # plotly's validation: the PNG beside it is sent instead
        if not _PLOTLY_SAID:
            _PLOTLY_SAID.append(True)
            log.warning("a Plotly chart this plotly cannot read is sent as its image (%s)",
                        str(exc).splitlines()[0][:200])  # fmt: skip
        return None


_PLOTLY_SAID: list[bool] = []


class MetricDef(NamedTuple):
    """One ``run.define_metric`` call."""

    name: str
    step_metric: str | None = None
    summary: str | None = None
    hidden: bool = False

    def options(self) -> dict[str, Any]:
        """The keyword arguments of the call (only those set)."""
        out: dict[str, Any] = {}
        if self.step_metric:
            out["step_metric"] = self.step_metric
        if self.summary:
            out["summary"] = self.summary
        if self.hidden:
            out["hidden"] = True
        return out


#: NeMo RL's definition of its GPU monitor's series (``--gpu-names nemo``)
NEMO_GPU_DEFINITIONS: Final = (MetricDef("ray/*", "ray/ray_step"),)


def escape_dots(name: str) -> str:
    """A key as a defined name that wandb-core does not split into nested parts."""
    return name.replace(".", "\\.")


def gpu_definitions(step: ShippedStep, keys: dict[str, float]) -> list[MetricDef]:
    """The definitions a run needs before a row with these GPU ``keys`` (see the module doc).

    The X axis first, then one glob per host (``<host>/gpu.*``, ``gpu.all.*``), then
    each key's summary. Names are stable, so a caller skips those it already gave.
    """
    out = [MetricDef(GPU_STEP, hidden=True)]
    prefixes = {f"{g.host}/gpu." for g in step.gpu}
    if any(k.startswith("gpu.all.") for k in keys):
        prefixes.add("gpu.all.")
    # W&B allows "*" only as a glob's last character: a host named with one gets no glob
    out += [MetricDef(p + "*", GPU_STEP) for p in sorted(prefixes) if "*" not in p]
    for key in sorted(k for k in keys if "*" not in k):
        summary = GPU_SUMMARY.get(key.rsplit(".", 1)[-1])
        out.append(MetricDef(escape_dots(key), GPU_STEP, summary))
    return out
