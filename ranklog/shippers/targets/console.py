"""``console``: a readable per-step summary on standard output.

``console:N`` prints every N-th step only (and every partial step, and every
step with text). Validation samples (text events whose name mentions ``sample``, ``val`` or
``generation``) are pretty-printed in a box, at most ``samples`` per step (the
role of NeMo RL's ``num_val_samples_to_print``); other text is one line each.
The console keeps nothing, so it reports no durable step: a restarted console
shipper carries on from its cursor.
"""

from __future__ import annotations

import math
import re
import shutil
import sys
from collections.abc import Mapping
from typing import Any, Final, TextIO

from ranklog.errors import ConfigError
from ranklog.schemas import ParamScalar, ParamValue
from ranklog.shippers._meta import code_line, records
from ranklog.shippers._registry import Option, TargetContext, TargetKind
from ranklog.shippers._target import ShippedStep, TextItem
from ranklog.spool import RunInfo

__all__ = ["TARGET", "ConsoleTarget"]

_SAMPLE_RE: Final = re.compile(r"sample|val|generation", re.IGNORECASE)
#: control characters a terminal would act on (escape sequences): shown as U+FFFD
_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _safe(text: str) -> str:
    """``text`` with the control characters a terminal would act on replaced."""
    return _CONTROL.sub("\ufffd", text)


def _fmt(v: float) -> str:
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4f}".rstrip("0").rstrip(".") if v != int(v) else str(int(v))


#: characters of a hyperparameter's value printed (the rest counted, not shown)
PARAM_CHARS: Final = 100


class ConsoleTarget:
    """Prints each shipped step; never durable."""

    kind = "console"
    #: late values (``--late ship``) are handled: see :class:`~ranklog.shippers.Target`
    takes_late = True

    def __init__(self, *, samples: int = 2, every: int = 1, stream: TextIO | None = None) -> None:
        self.samples = samples
        self.every = max(1, every)
        self.spec = "console" if every == 1 else f"console:{every}"
        self._out = stream
        self._run: RunInfo | None = None

    @property
    def out(self) -> TextIO:
        """Where lines go (standard output unless given)."""
        return self._out if self._out is not None else sys.stdout

    #: what it printed is gone: it cannot say which steps it holds (see Target)
    held_known = False

    def open(self, run: RunInfo) -> int | None:
        self._run = run
        print(f"ranklog: run {run.name} ({run.run_id})", file=self.out)
        return None

    def write_params(self, params: dict[str, ParamValue]) -> None:
        """A block: ``params`` and the count, then a line a key (sorted, aligned), values
        past :data:`PARAM_CHARS` cut with how many characters were left out."""
        if not params:
            return
        width = min(max(len(k) for k in params), 40)
        lines = [f"params  ({len(params)})"]
        for key, value in sorted(params.items()):
            text = _safe(str(value))
            if len(text) > PARAM_CHARS:
                text = f"{text[:PARAM_CHARS]}... ({len(text) - PARAM_CHARS} more characters)"
            lines.append(f"  {_safe(key):<{width}}  {text}")
        print("\n".join(lines), file=self.out)

    def write_meta(self, meta: dict[str, ParamScalar]) -> list[str]:
        """Run records, a line each: the code (commit, branch, whether the tree was dirty)
        and summary values; metric definitions are for W&B's charts (nothing to print)."""
        if line := code_line(records(meta, "code")):
            print(f"code    {_safe(line)}", file=self.out)
        if summary := records(meta, "summary"):
            items = "  ".join(f"{k}={v}" for k, v in summary.items())
            print(f"summary {_safe(items)}", file=self.out)
        return []

    def write(self, steps: list[ShippedStep]) -> None:
        for s in steps:
            if s.step % self.every == 0 or not s.complete or s.texts or s.carrier is not None:
                self._step(s)

    def _step(self, s: ShippedStep) -> None:
        flag = "" if s.complete else "  PARTIAL"
        if s.carrier is not None:
            flag = f"  LATE (with step {s.carrier})"
        parts = [f"step {s.step:>6}", f"ranks {s.ranks}/{s.world_size}{flag}"]
        for name in sorted(s.metrics):
            if name.endswith("/slowest_rank"):
                continue
            value = s.metrics[name]
            slowest = s.metrics.get(f"{name}/slowest_rank")
            text = f"{name} {_fmt(value)}"
            if slowest is not None:
                text += f" (rank {int(slowest)})"
            parts.append(text)
        print("  ".join(parts), file=self.out)
        shown = 0
        for t in s.texts:
            if _SAMPLE_RE.search(t.name):
                if shown < self.samples:
                    self._box(t)
                shown += 1
            else:
                print(f"  text {t.name} (rank {t.rank}): {_safe(t.text)}", file=self.out)
        if shown > self.samples:
            print(f"  ... {shown - self.samples} more samples not shown", file=self.out)
        for tb in s.tables:
            shape = f"{len(tb.rows)} rows x {len(tb.columns)} columns"
            print(f"  table {tb.name} (rank {tb.rank}): {shape} ({_safe(', '.join(tb.columns))})",
                  file=self.out)  # fmt: skip

    def _box(self, t: TextItem) -> None:
        width = max(40, min(100, shutil.get_terminal_size((100, 20)).columns - 4))
        title = f" {t.name} (rank {t.rank}) "
        print("  ┌" + title + "─" * max(0, width - len(title)), file=self.out)
        for line in _safe(t.text).splitlines() or [""]:
            while len(line) > width:
                print("  │ " + line[:width], file=self.out)
                line = line[width:]
            print("  │ " + line, file=self.out)
        print("  └" + "─" * width, file=self.out)

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.flush()


def _build(arg: str, context: TargetContext, options: Mapping[str, Any]) -> ConsoleTarget:
    try:
        every = int(arg) if arg else 1
    except ValueError:
        raise ConfigError(
            f"console:{arg}: expected console or console:N (every N-th step)"
        ) from None
    samples = options.get("samples")
    return ConsoleTarget(samples=2 if samples is None else samples, every=every)


TARGET = TargetKind(
    kind="console",
    arg="N",
    arg_optional=True,
    help="a readable line per N-th step (default every step) and boxed validation samples",
    build=_build,
    options=(
        Option(
            "samples",
            "validation samples printed per step (console; default 2)",
            type=int,
            metavar="N",
        ),
    ),
)
