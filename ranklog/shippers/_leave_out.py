"""``--leave-out KINDS``: what a target is not given, by the user's choice.

A user who wants a backend to hold only what another logger would put there (NeMo RL's,
say: docs/nemo.md) names the kinds of values it should not receive:

- ``histograms``: distributions (TensorBoard histograms, MLflow summaries, W&B histograms);
- ``texts``: text values (validation samples);
- ``tables``: tables;
- ``images``: images and plots;
- ``derived``: values ranklog derives: ``timing/<name>/slowest_rank`` and
  ``ranklog/ranks_reporting`` (on a partial step);
- ``code``: the code's git state (run records ``code/*``).

Nothing else changes: steps, their metrics and params are shipped as always. The shipper
says once, at its start, what it leaves out.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import msgspec

from ranklog.errors import ConfigError
from ranklog.schemas import ParamScalar, ParamValue
from ranklog.shippers._target import ShippedStep, Target

__all__ = ["KINDS", "LeaveOut", "parse_leave_out"]

log = logging.getLogger("ranklog.ship")

#: what ``--leave-out`` takes
KINDS: Final = ("histograms", "texts", "tables", "images", "derived", "code")
_SLOWEST: Final = "/slowest_rank"
_REPORTING: Final = "ranklog/ranks_reporting"


def parse_leave_out(text: str) -> frozenset[str]:
    """The kinds a comma-separated ``--leave-out`` value names (ConfigError naming a bad one)."""
    kinds = frozenset(k.strip() for k in text.split(",") if k.strip())
    bad = sorted(kinds - set(KINDS))
    if bad:
        raise ConfigError(
            f"--leave-out {text!r}: {', '.join(bad)} is not one of {', '.join(KINDS)}"
        )
    return kinds


def _derived(metrics: dict[str, float]) -> set[str]:
    """The names ranklog derived in a step: ``ranklog/ranks_reporting`` and each timer's
    ``timing/<name>/slowest_rank``, which is ``...slowest_rank.derived`` where a logged
    value holds the plain name (that one is the user's, and kept)."""
    out = {_REPORTING} & metrics.keys()
    for name in metrics:
        if not name.startswith("timing/"):
            continue
        renamed = name.endswith(_SLOWEST + ".derived")
        if renamed or (name.endswith(_SLOWEST) and name + ".derived" not in metrics):
            out.add(name)
    return out


class LeaveOut:
    """A target given everything but the kinds named; every other attribute is the target's."""

    def __init__(self, target: Target, kinds: frozenset[str]) -> None:
        self._target = target
        self.kinds = kinds
        log.info("%s: leaving out %s (--leave-out)", target.spec, ", ".join(sorted(kinds)))

    #: a step whose values were all left out may go out empty, and some backends record
    #: no empty step (SwanLab): what the target holds is then no measure of what it was
    #: sent (no check against the cursor)
    held_known = False

    def __getattr__(self, name: str) -> Any:  # kind, spec, identity, end, takes_late ...
        return getattr(self._target, name)

    def open(self, run: Any) -> Any:
        return self._target.open(run)

    def write_params(self, params: dict[str, ParamValue]) -> None:
        self._target.write_params(params)

    def write_meta(self, meta: dict[str, ParamScalar]) -> list[str]:
        """Records but those left out, to the target's ``write_meta`` (if it has one)."""
        keep = {k: v for k, v in meta.items() if not ("code" in self.kinds and k[:5] == "code/")}
        write_meta = getattr(self._target, "write_meta", None)
        if not keep:
            return []
        if not callable(write_meta):
            return list(keep)
        return list(write_meta(keep) or ())

    def write(self, steps: list[ShippedStep]) -> None:
        self._target.write([self._strip(s) for s in steps])

    def _strip(self, s: ShippedStep) -> ShippedStep:
        k, changes = self.kinds, dict[str, Any]()
        if "histograms" in k and s.histograms:
            changes["histograms"] = {}
        if "texts" in k and s.texts:
            changes["texts"] = []
        if "tables" in k and s.tables:
            changes["tables"] = []
        if "images" in k and s.images:
            changes["images"] = []
        if "derived" in k and (derived := _derived(s.metrics)):
            changes["metrics"] = {n: v for n, v in s.metrics.items() if n not in derived}
        return msgspec.structs.replace(s, **changes) if changes else s

    def flush(self) -> None:
        self._target.flush()

    def close(self) -> None:
        self._target.close()
