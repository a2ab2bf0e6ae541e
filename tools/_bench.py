"""What the benchmarks in tools/ share: timing, measured child processes, generated spools, output.

- timing in-process: :func:`time_calls` (GC paused, nanoseconds), :func:`percentile`;
- a command in a child process, measured by a tiny launcher: :func:`run_measured`
  gives its own wall time, CPU time and peak RSS (``os.wait4``), see :data:`LAUNCHER`;
- the generated spool every shipper benchmark uses: :func:`write_spool` (``ranks`` x
  ``steps`` x :data:`METRICS` float values, :data:`STEPS_PER_FRAME` steps per frame)
  and :func:`check_jsonl`, which says what is wrong with a shipped JSONL, if anything;
- output: :func:`fmt`, :func:`rate`, :func:`verdict`, :func:`version`.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import importlib.metadata
import io
import json
import math
import os
import platform
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

if TYPE_CHECKING:
    from ranklog.spool import IncarnationWriter

METRICS: Final = 20


NAMES: Final = tuple(f"train/m{k:02d}" for k in range(METRICS))


STEPS_PER_FRAME: Final = 50


LAUNCHER: Final = (
    "import os, sys, time\n"
    "t = time.perf_counter()\n"
    "pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)\n"
    "_, status, ru = os.wait4(pid, 0)\n"
    "wall = time.perf_counter() - t\n"
    "code = os.waitstatus_to_exitcode(status)\n"
    "with open(sys.argv[1], 'w') as f:\n"
    "    f.write(f'{code} {wall!r} {ru.ru_utime + ru.ru_stime!r} {ru.ru_maxrss}')\n"
)


@dataclass(frozen=True)
class ChildRun:
    """A finished child process: its own wall time, CPU time and peak RSS."""

    returncode: int
    wall_s: float
    cpu_s: float
    maxrss_mb: float
    stderr: str


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_calls(call: Callable[[int], object], calls: int, warmup: int) -> list[int]:
    """Time ``call(i)`` once per i, after ``warmup`` untimed calls; nanoseconds."""
    for i in range(warmup):
        call(i)
    clock = time.perf_counter_ns
    samples = [0] * calls
    with gc_paused():
        for i in range(warmup, warmup + calls):
            t0 = clock()
            call(i)
            samples[i - warmup] = clock() - t0
    return samples


def clock_overhead_ns(calls: int = 10_000) -> float:
    """Median cost of the two back-to-back clock reads around every timed call."""
    clock = time.perf_counter_ns
    samples = [0] * calls
    for i in range(calls):
        t0 = clock()
        samples[i] = clock() - t0
    return statistics.median(samples)


def names(metrics: int) -> tuple[str, ...]:
    """The metric names of a generated spool with ``metrics`` values per rank and step."""
    return NAMES if metrics == METRICS else tuple(f"train/m{k:04d}" for k in range(metrics))


def values(rank: int, step: int, metrics: int = METRICS) -> dict[str, float]:
    """The values a rank logs for a step: their mean over ranks is predictable."""
    base = rank + step * 1e-3
    return {name: base + k * 0.25 for k, name in enumerate(names(metrics))}


def expected_mean(ranks: int, step: int, k: int) -> float:
    return (ranks - 1) / 2 + step * 1e-3 + k * 0.25


def launch(cmd: list[str], result: Path, stderr: IO[bytes]) -> subprocess.Popen[bytes]:
    """Start ``cmd`` under the launcher, in its own session (so a kill takes both)."""
    launcher = [sys.executable, "-I", "-S", "-c", LAUNCHER, str(result), *cmd]
    return subprocess.Popen(
        launcher, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
    )


def kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` and, when it leads its own session (the launcher), its child too."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    proc.wait()


def collect(proc: subprocess.Popen[bytes], result: Path, stderr: IO[bytes]) -> ChildRun:
    """What the launcher measured (NaNs when it was killed before it could say)."""
    stderr.seek(0)
    text = stderr.read().decode(errors="replace")
    try:
        code, wall, cpu, maxrss_kib = result.read_text().split()
    except (FileNotFoundError, ValueError):
        return ChildRun(proc.returncode or -9, math.nan, math.nan, math.nan, text)
    return ChildRun(int(code), float(wall), float(cpu), int(maxrss_kib) / 1024, text)


def run_measured(cmd: list[str], scratch: Path, timeout: float) -> ChildRun:
    """Run ``cmd`` to completion (killed after ``timeout``); stdout discarded."""
    result = scratch / "rusage.txt"
    with tempfile.TemporaryFile() as stderr:
        proc = launch(cmd, result, stderr)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill(proc)
        return collect(proc, result, stderr)


def profile_lines(call: Callable[[], object], title: str, top: int = 12) -> list[str]:
    """Run ``call`` under cProfile: its top functions by own time, as Markdown lines."""
    prof = cProfile.Profile()
    prof.runcall(call)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    body = [line for line in text.getvalue().splitlines() if line.strip()][-top - 1 :]
    return ["", f"{title}, own time:", "", "```", *body, "```"]


def short(text: str, limit: int = 100) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


#: the segment format the generated spools are written in: 2 (metrics packed, as the
#: producer writes them) unless a benchmark asks for 1 (every metrics event a map)
FORMAT: Final = 2


def write_rank(
    spool: Path, rank: int, world_size: int, steps: int, *, end: bool = True,
    metrics: int = METRICS, fmt: int = FORMAT, per_frame: int = STEPS_PER_FRAME,
) -> IncarnationWriter | None:  # fmt: skip
    """One rank's incarnation: rank_start, then frames of ``per_frame`` steps, rank_end.

    With ``end=False`` the rank is still running: no rank_end, no seal, and its writer is
    returned with the segment still open (the caller goes on with :func:`write_steps`, and
    closes it, unsealed, with ``abandon``).
    """
    from ranklog import __version__
    from ranklog.schemas import RankEnd, RankStart, encoder
    from ranklog.spool import IncarnationWriter, SpoolLayout, ensure_run

    info = ensure_run(spool, world_size=world_size)
    writer = IncarnationWriter.create(SpoolLayout(spool), info, rank, world_size=world_size)
    t0 = info.created
    start = RankStart(t0, info.run_id, rank, world_size, rank % 8, platform.node(), os.getpid(),
                      writer.incarnation, __version__)  # fmt: skip
    writer.write_events(1, [encoder.encode([start])])
    write_steps(writer, rank, t0, range(steps), metrics, fmt, per_frame)
    if not end:  # a rank still running: no rank_end, no seal, the file open
        return writer
    writer.write_events(1, [encoder.encode([RankEnd(t0 + steps * 0.1, "ok", 0)])])
    writer.close(sync=False)
    return None


def write_steps(
    writer: IncarnationWriter, rank: int, t0: float, steps: range, metrics: int = METRICS,
    fmt: int = FORMAT, per_frame: int = STEPS_PER_FRAME,
) -> None:  # fmt: skip
    """``steps`` of one rank (metrics and step_end), in frames of ``per_frame`` steps (1:
    as durability ``step`` writes them); ``fmt`` 2: the metrics packed as the producer
    packs them (the layout's names record in the incarnation's first frame of steps, which
    is flagged so)."""
    import struct

    from ranklog.schemas import Event, Metrics, Names, Packed, StepEnd, encoder

    pack = struct.Struct(f"<{metrics}d").pack
    for first in range(steps.start, steps.stop, per_frame):
        events: list[Event | Names | Packed] = []
        flagged = fmt == 2 and first == steps.start and first == 0
        if flagged:
            record = Names(t0, 0, list(names(metrics)), "mean")
            writer.add_names(encoder.encode(record))
            events.append(record)
        for step in range(first, min(first + per_frame, steps.stop)):
            ts = t0 + step * 0.1
            vals = values(rank, step, metrics)
            if fmt == 2:
                events.append(Packed(round(step * 100), step, 0, pack(*vals.values())))
            else:
                events.append(Metrics(ts, step, vals))
            events.append(StepEnd(ts + 0.05, step, 1))  # as the producer: it closes the step
        writer.write_events(len(events), [encoder.encode(events)], names=flagged)


def write_spool(
    spool: Path, ranks: int, steps: int, metrics: int = METRICS, fmt: int = FORMAT,
    per_frame: int = STEPS_PER_FRAME,
) -> None:  # fmt: skip
    from ranklog.spool import ensure_run

    ensure_run(spool, world_size=ranks)
    for rank in range(ranks):
        write_rank(spool, rank, ranks, steps, metrics=metrics, fmt=fmt, per_frame=per_frame)
    os.sync()  # the shipper should read from a settled page cache, not compete with writeback


def dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def check_jsonl(path: Path, ranks: int, steps: int) -> str:
    """Why the shipped JSONL is wrong, or '' when every step is there, complete and correct."""
    lines = [json.loads(raw) for raw in path.read_bytes().splitlines()]
    got = [obj for obj in lines if "step" in obj]
    if len(got) != steps:
        return f"{len(got)} step lines, expected {steps}"
    for i, obj in enumerate(got):
        if obj["step"] != i or not obj["complete"] or obj["ranks"] != ranks:
            return f"line {i}: step {obj['step']} complete={obj['complete']} ranks={obj['ranks']}"
        metrics = obj["metrics"]
        if len(metrics) != METRICS:
            return f"step {i}: {len(metrics)} metrics, expected {METRICS}"
        for k, name in enumerate(NAMES):
            if abs(metrics[name] - expected_mean(ranks, i, k)) > 1e-9:
                return f"step {i}: {name}={metrics[name]}, expected {expected_mean(ranks, i, k)}"
    return ""


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if value < 100 else f"{value:,.0f}"


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.2f} M"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def write_json(
    path: Path | None, section: str, rows: Sequence[object], checks: Sequence[object]
) -> None:
    """Merge one benchmark's rows and checks into the JSON file at ``path`` (under ``section``).

    Rows and checks are dataclasses or dicts; the file keeps other sections it holds.
    """
    if path is None:
        return
    from dataclasses import asdict, is_dataclass

    def plain(x: object) -> object:
        return asdict(x) if is_dataclass(x) and not isinstance(x, type) else x

    data = json.loads(path.read_text()) if path.is_file() else {}
    data["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "python": platform.python_version()}  # fmt: skip
    data[section] = {"rows": [plain(r) for r in rows], "checks": [plain(c) for c in checks]}
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
