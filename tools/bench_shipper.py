"""Benchmark the shipper: throughput and memory of ``ranklog ship``, and step latency.

Run from the repository root::

    .venv/bin/python tools/bench_shipper.py           # full run, a few minutes
    .venv/bin/python tools/bench_shipper.py --quick   # smoke run, well under a minute
    # only the idle rows: 4,096 live rank files polled every second, measured for 30 s
    .venv/bin/python tools/bench_shipper.py --idle-only --idle-ranks 4096 --idle-poll poll \
        --idle-seconds 30

It prints one Markdown table measured in this run:

- throughput: a spool of 64 ranks x N steps x 20 float metrics, written directly
  with ``IncarnationWriter`` (not timed), shipped by ``ranklog ship SPOOL --to
  jsonl:OUT --once --quiet`` in a child process; at N and at 4N steps, so that
  peak memory can be seen not to grow with the spool. Wall time includes the
  child's interpreter start. Peak RSS and CPU time are the child's own, from
  ``os.wait4`` (its rusage alone, not the cumulative maximum over all children
  that ``RUSAGE_CHILDREN`` gives). The JSONL is checked: one line per step, every
  step complete, reduced values as expected;
- latency: 4 producer processes call ``log_metrics`` (20 keys) and ``step_end``
  every 50 ms while a following shipper (``ranklog ship SPOOL --to jsonl:OUT``)
  runs; the latency of step S is the time its JSONL line appeared (the file is
  polled every millisecond) minus the latest ``step_end`` return of S over the
  ranks. Once with the native observer (inotify on a local disk), once with
  ``--poll 1``. The shipper must exit by itself once every rank closed;
- idle cost: a following shipper (``--poll 1``, and the native observer) over
  ``--idle-ranks`` ranks (default 1,024) that each hold one open, unsealed segment
  and write nothing: its CPU time over wall time (share of one core) and its RSS.

The targets are checked at the end. This is a developer tool, not a test:
numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

if TYPE_CHECKING:
    from ranklog.spool import IncarnationWriter

METRICS: Final = 20
NAMES: Final = tuple(f"train/m{k:02d}" for k in range(METRICS))
STEPS_PER_FRAME: Final = 50
THROUGHPUT_RANKS: Final = 64
SCALE: Final = 4
LATENCY_RANKS: Final = 4
TAIL_POLL_S: Final = 0.001
PRODUCE_ARG: Final = "--_produce"  # internal: run as one producer rank (latency benchmark)
VERSIONS: Final = ("ranklog", "msgspec", "watchdog")

#: Runs a command as its child and writes "exit wall_s cpu_s maxrss_kib" to argv[1].
#: ru_maxrss survives exec (Linux keeps the old image's peak), so a child spawned by
#: this benchmark would report at least the benchmark's own peak RSS; spawned by this
#: small launcher (python -I -S, about 9 MB), the floor is the launcher's instead.
_LAUNCHER: Final = (
    "import os, sys, time\n"
    "t = time.perf_counter()\n"
    "pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)\n"
    "_, status, ru = os.wait4(pid, 0)\n"
    "wall = time.perf_counter() - t\n"
    "code = os.waitstatus_to_exitcode(status)\n"
    "with open(sys.argv[1], 'w') as f:\n"
    "    f.write(f'{code} {wall!r} {ru.ru_utime + ru.ru_stime!r} {ru.ru_maxrss}')\n"
)

TARGET_VALUES_PER_S: Final = 1_000_000
TARGET_RSS_MB: Final = 300.0
TARGET_RSS_GROWTH: Final = 1.25  # peak RSS at 4x the steps over peak RSS at 1x


@dataclass(frozen=True)
class Budget:
    """Sizes for one run of the benchmark."""

    steps: int
    latency_seconds: float
    step_interval_s: float
    ship_timeout_s: float


FULL: Final = Budget(steps=2_000, latency_seconds=10.0, step_interval_s=0.05, ship_timeout_s=300)
# 1,000 steps: each rank's segment (~430 KB) is larger than what the shipper reads from
# a segment per round (256 KB), so memory at 1x is already the bounded steady state.
QUICK: Final = Budget(steps=1_000, latency_seconds=2.0, step_interval_s=0.05, ship_timeout_s=60)


@dataclass(frozen=True)
class ChildRun:
    """A finished child process: its own wall time, CPU time and peak RSS."""

    returncode: int
    wall_s: float
    cpu_s: float
    maxrss_mb: float
    stderr: str


@dataclass(frozen=True)
class Row:
    """One line of the result table; None where a column does not apply."""

    name: str
    size: str
    wall_s: float | None = None
    values_per_s: float | None = None
    values_per_cpu_s: float | None = None
    cpu_s: float | None = None
    rss_mb: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    ok: bool = True
    note: str = ""


@dataclass(frozen=True)
class ProducerSpec:
    """What one producer process of the latency benchmark does."""

    spool: str
    rank: int
    world_size: int
    steps: int
    interval_s: float
    times_path: str


# -- helpers ----------------------------------------------------------------------------


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _values(rank: int, step: int) -> dict[str, float]:
    """The 20 values a rank logs for a step: their mean over ranks is predictable."""
    base = rank + step * 1e-3
    return {name: base + k * 0.25 for k, name in enumerate(NAMES)}


def _expected_mean(ranks: int, step: int, k: int) -> float:
    return (ranks - 1) / 2 + step * 1e-3 + k * 0.25


def _ship_cmd(spool: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", f"jsonl:{out}",
            "--quiet", *extra]  # fmt: skip


def _launch(cmd: list[str], result: Path, stderr: IO[bytes]) -> subprocess.Popen[bytes]:
    """Start ``cmd`` under the launcher, in its own session (so a kill takes both)."""
    launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(result), *cmd]
    return subprocess.Popen(
        launcher, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
    )


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` and, when it leads its own session (the launcher), its child too."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    proc.wait()


def _collect(proc: subprocess.Popen[bytes], result: Path, stderr: IO[bytes]) -> ChildRun:
    """What the launcher measured (NaNs when it was killed before it could say)."""
    stderr.seek(0)
    text = stderr.read().decode(errors="replace")
    try:
        code, wall, cpu, maxrss_kib = result.read_text().split()
    except (FileNotFoundError, ValueError):
        return ChildRun(proc.returncode or -9, math.nan, math.nan, math.nan, text)
    return ChildRun(int(code), float(wall), float(cpu), int(maxrss_kib) / 1024, text)


def _run_measured(cmd: list[str], scratch: Path, timeout: float) -> ChildRun:
    """Run ``cmd`` to completion (killed after ``timeout``); stdout discarded."""
    result = scratch / "rusage.txt"
    with tempfile.TemporaryFile() as stderr:
        proc = _launch(cmd, result, stderr)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
        return _collect(proc, result, stderr)


def _short(text: str, limit: int = 100) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# -- throughput -------------------------------------------------------------------------


def _write_rank(
    spool: Path, rank: int, world_size: int, steps: int, *, end: bool = True
) -> IncarnationWriter | None:
    """One rank's incarnation: rank_start, then frames of STEPS_PER_FRAME steps, rank_end.

    With ``end=False`` the rank is still running: no rank_end, no seal, and its writer is
    returned with the segment still open (the caller closes it, unsealed, with ``abandon``).
    """
    from ranklog import __version__
    from ranklog.schemas import Event, Metrics, RankEnd, RankStart, StepEnd, encode_events
    from ranklog.spool import IncarnationWriter, SpoolLayout, ensure_run

    info = ensure_run(spool, world_size=world_size)
    writer = IncarnationWriter.create(SpoolLayout(spool), info, rank, world_size=world_size)
    t0 = info.created
    start = RankStart(t0, info.run_id, rank, world_size, rank % 8, platform.node(), os.getpid(),
                      writer.incarnation, __version__)  # fmt: skip
    writer.write_events(1, [encode_events([start])])
    for first in range(0, steps, STEPS_PER_FRAME):
        events: list[Event] = []
        for step in range(first, min(first + STEPS_PER_FRAME, steps)):
            ts = t0 + step * 0.1
            events.append(Metrics(ts, step, _values(rank, step)))
            events.append(StepEnd(ts + 0.05, step))
        writer.write_events(len(events), [encode_events(events)])
    if not end:  # a rank still running: no rank_end, no seal, the file open
        return writer
    writer.write_events(1, [encode_events([RankEnd(t0 + steps * 0.1, "ok", 0)])])
    writer.close(sync=False)
    return None


def _write_spool(spool: Path, ranks: int, steps: int) -> None:
    from ranklog.spool import ensure_run

    ensure_run(spool, world_size=ranks)
    for rank in range(ranks):
        _write_rank(spool, rank, ranks, steps)
    os.sync()  # the shipper should read from a settled page cache, not compete with writeback


def _dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def _check_jsonl(path: Path, ranks: int, steps: int) -> str:
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
            if abs(metrics[name] - _expected_mean(ranks, i, k)) > 1e-9:
                return f"step {i}: {name}={metrics[name]}, expected {_expected_mean(ranks, i, k)}"
    return ""


def _bench_throughput(base: Path, ranks: int, steps: int, timeout: float) -> Row:
    """Ship a closed spool of ``ranks`` x ``steps`` x METRICS values with ``--once``."""
    values = ranks * steps * METRICS
    size = f"{ranks} ranks x {steps:,} steps ({values / 1e6:.2f} M values)"
    with tempfile.TemporaryDirectory(prefix="ship-", dir=base) as tmp:
        spool, out = Path(tmp) / "spool", Path(tmp) / "out.jsonl"
        t0 = time.perf_counter()
        _write_spool(spool, ranks, steps)
        generated = time.perf_counter() - t0
        spool_mb = _dir_mb(spool)
        run = _run_measured(_ship_cmd(spool, out, "--once"), Path(tmp), timeout)
        problem = f"exit {run.returncode}: {_short(run.stderr)}" if run.returncode else ""
        problem = problem or _check_jsonl(out, ranks, steps)
    note = f"spool {spool_mb:,.0f} MB (written in {generated:.1f} s, not timed)"
    return Row(
        "ship --once (jsonl)",
        size,
        wall_s=run.wall_s,
        values_per_s=values / run.wall_s,
        values_per_cpu_s=values / run.cpu_s if run.cpu_s else None,
        cpu_s=run.cpu_s,
        rss_mb=run.maxrss_mb,
        ok=not problem,
        note=f"FAILED: {problem}; {note}" if problem else f"{steps:,} step lines OK; {note}",
    )


TARGET_BYTES_PER_VALUE: Final = 4.0


def _bench_archive(base: Path, ranks: int, steps: int, timeout: float) -> tuple[list[Row], float]:
    """Compaction and replay of the throughput spool; replay must equal live shipping."""
    values = ranks * steps * METRICS
    size = f"{ranks} ranks x {steps:,} steps ({values / 1e6:.2f} M values)"
    with tempfile.TemporaryDirectory(prefix="archive-", dir=base) as name:
        tmp = Path(name)
        spool, pq, live, again = tmp / "spool", tmp / "pq", tmp / "live.jsonl", tmp / "replay.jsonl"
        _write_spool(spool, ranks, steps)
        ship = _run_measured(_ship_cmd(spool, live, "--once"), tmp, timeout)
        comp = _run_measured(
            [sys.executable, "-m", "ranklog.cli", "compact", str(spool), "--out", str(pq)],
            tmp,
            timeout,
        )
        metrics_bytes = sum(p.stat().st_size for p in (pq / "metrics").glob("*.parquet"))
        total_bytes = sum(p.stat().st_size for p in pq.rglob("*.parquet"))
        rep = _run_measured(
            [sys.executable, "-m", "ranklog.cli", "replay", str(pq), "--to", f"jsonl:{again}"],
            tmp,
            timeout,
        )
        same = live.is_file() and again.is_file() and live.read_bytes() == again.read_bytes()
    rows = []
    for label, run, extra in (
        ("compact (parquet)", comp,
         f"{metrics_bytes / values:.2f} B/value in metrics, {total_bytes / values:.2f} B/value "
         "with every table"),
        ("replay (jsonl)", rep,
         "JSONL byte-identical to live shipping" if same else "FAILED: JSONL differs from live"),
        ("ship --once (jsonl), same spool", ship, "live shipping, for comparison"),
    ):  # fmt: skip
        problem = f"exit {run.returncode}: {_short(run.stderr)}" if run.returncode else ""
        rows.append(
            Row(
                label,
                size,
                wall_s=run.wall_s,
                values_per_s=values / run.wall_s,
                values_per_cpu_s=values / run.cpu_s if run.cpu_s else None,
                cpu_s=run.cpu_s,
                rss_mb=run.maxrss_mb,
                ok=not problem and (same or label != "replay (jsonl)"),
                note=f"FAILED: {problem}" if problem else extra,
            )
        )
    return rows, metrics_bytes / values


#: backend targets compared on the same spool; {tmp} is the run's temp directory
BACKENDS: Final = {
    "tensorboard": "tensorboard:{tmp}/tb",
    "mlflow": "mlflow:sqlite:///{tmp}/mlflow.db",
    "wandb": "wandb:bench",
}


def _bench_targets(base: Path, ranks: int, steps: int, timeout: float) -> list[Row]:
    """The same spool shipped with ``--once`` to each backend: steps/s and values/s."""
    values = ranks * steps * METRICS
    size = f"{ranks} ranks x {steps:,} steps ({values / 1e6:.2f} M values)"
    rows = []
    with tempfile.TemporaryDirectory(prefix="targets-", dir=base) as tmp:
        spool = Path(tmp) / "spool"
        _write_spool(spool, ranks, steps)
        for kind, spec in BACKENDS.items():
            cmd = _ship_cmd(spool, Path(tmp) / "unused.jsonl", "--once")
            cmd[cmd.index("--to") + 1] = spec.format(tmp=tmp)
            cmd += ["--mode", "offline", "--dir", tmp, "--name", kind]
            run = _run_measured(cmd, Path(tmp), timeout)
            problem = f"exit {run.returncode}: {_short(run.stderr)}" if run.returncode else ""
            rows.append(
                Row(
                    f"ship --once ({kind})",
                    size,
                    wall_s=run.wall_s,
                    values_per_s=values / run.wall_s,
                    values_per_cpu_s=values / run.cpu_s if run.cpu_s else None,
                    cpu_s=run.cpu_s,
                    rss_mb=run.maxrss_mb,
                    ok=not problem,
                    note=f"FAILED: {problem}"
                    if problem
                    else f"{steps / run.wall_s:,.0f} reduced steps/s ({METRICS} values each)",
                )
            )
    return rows


def _startup_row(base: Path, timeout: float) -> Row:
    """The fixed cost inside every wall time above: a child interpreter running the CLI."""
    with tempfile.TemporaryDirectory(prefix="startup-", dir=base) as tmp:
        cmd = [sys.executable, "-m", "ranklog.cli", "--version"]
        run = _run_measured(cmd, Path(tmp), timeout)
    return Row(
        "python -m ranklog.cli --version",
        "-",
        wall_s=run.wall_s,
        cpu_s=run.cpu_s,
        rss_mb=run.maxrss_mb,
        ok=run.returncode == 0,
        note="interpreter start + CLI import: the fixed part of each wall time"
        if run.returncode == 0
        else f"FAILED: exit {run.returncode}: {_short(run.stderr)}",
    )


# -- latency ----------------------------------------------------------------------------


def _produce(spec: ProducerSpec) -> int:
    """One rank: wait for the start time on stdin, then log and close a step every interval."""
    import ranklog

    run = ranklog.init(spec.spool, rank=spec.rank, world_size=spec.world_size, durability="step")
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    done: list[float] = []
    for step in range(spec.steps):
        delay = start + step * spec.interval_s - time.time()
        if delay > 0:
            time.sleep(delay)
        run.log_metrics(_values(spec.rank, step), step=step)
        run.step_end(step)
        done.append(time.time())
    run.close()
    Path(spec.times_path).write_text(json.dumps(done))
    return 0


def _start_producers(
    spool: Path, tmp: Path, budget: Budget, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Start the producer processes (into ``procs``), then release them all at once."""
    steps = round(budget.latency_seconds / budget.step_interval_s)
    for rank in range(LATENCY_RANKS):
        spec = ProducerSpec(str(spool), rank, LATENCY_RANKS, steps, budget.step_interval_s,
                            str(tmp / f"times-{rank}.json"))  # fmt: skip
        cmd = [sys.executable, str(Path(__file__).resolve()), PRODUCE_ARG, json.dumps(asdict(spec))]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"producer {proc.args!r} did not start")
    start = f"{time.time() + 0.2!r}\n".encode()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(start)
        proc.stdin.close()


class _Tail:
    """Follows a JSONL file and notes when each step's line became complete."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: dict[int, float] = {}
        self._fd: int | None = None
        self._offset = 0
        self._partial = b""

    def poll(self) -> None:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return
        data = os.pread(self._fd, 1 << 20, self._offset)
        now = time.time()
        if not data:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for raw in lines:
            obj = json.loads(raw)
            if "step" in obj:
                self.seen.setdefault(obj["step"], now)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _follow(shipper: subprocess.Popen[bytes], tail: _Tail, deadline: float) -> bool:
    """Poll the JSONL until the shipper exits (True) or ``deadline`` passes (False)."""
    while time.monotonic() < deadline:
        tail.poll()
        if shipper.poll() is not None:
            tail.poll()
            return True
        time.sleep(TAIL_POLL_S)
    return False


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the shipper opened its target (so its observer is up), or it died."""
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def _latencies(tmp: Path, seen: dict[int, float]) -> tuple[list[float], int]:
    """Sorted latencies in ms of the steps that shipped, and how many steps did not."""
    per_rank = [json.loads((tmp / f"times-{r}.json").read_text()) for r in range(LATENCY_RANKS)]
    closed = [max(times) for times in zip(*per_rank, strict=True)]
    lat = sorted((seen[s] - t) * 1e3 for s, t in enumerate(closed) if s in seen)
    return lat, len(closed) - len(lat)


def _bench_latency(base: Path, budget: Budget, poll: float | None) -> Row:
    from ranklog.spool import ensure_run

    mode = "native observer" if poll is None else f"--poll {poll:g}"
    size = f"{LATENCY_RANKS} ranks, step every {budget.step_interval_s * 1e3:.0f} ms"
    size += f", {budget.latency_seconds:g} s"
    producers: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="latency-", dir=base) as name:
        tmp = Path(name)
        spool, out = tmp / "spool", tmp / "out.jsonl"
        ensure_run(spool, world_size=LATENCY_RANKS)
        extra = [] if poll is None else ["--poll", str(poll)]
        with tempfile.TemporaryFile() as stderr:
            shipper = _launch(_ship_cmd(spool, out, *extra), tmp / "rusage.txt", stderr)
            tail = _Tail(out)
            try:
                _wait_for(out, shipper, timeout=30)
                _start_producers(spool, tmp, budget, producers)
                exited = _follow(shipper, tail, time.monotonic() + budget.latency_seconds + 30)
                codes = [p.wait(timeout=30) for p in producers]
            finally:
                tail.close()
                for proc in [shipper, *producers]:
                    if proc.poll() is None:
                        _kill(proc)
            run = _collect(shipper, tmp / "rusage.txt", stderr)
        lat, missing = _latencies(tmp, tail.seen) if not any(codes) else ([], -1)
    problems = []
    if not exited:
        problems.append("shipper did not exit by itself; killed")
    elif run.returncode:
        problems.append(f"shipper exit {run.returncode}: {_short(run.stderr)}")
    if any(codes):
        problems.append(f"producer exit codes {codes}")
    elif missing:
        problems.append(f"{missing} steps never shipped")
    note = f"{len(lat)} steps; shipper RSS/CPU over the whole run"
    return Row(
        f"step_end -> JSONL line ({mode})",
        size,
        cpu_s=run.cpu_s if exited else None,
        rss_mb=run.maxrss_mb if exited else None,
        p50_ms=_percentile(lat, 0.50) if lat else None,
        p99_ms=_percentile(lat, 0.99) if lat else None,
        ok=not problems,
        note=f"FAILED: {', '.join(problems)}; {note}" if problems else note,
    )


# -- idle cost --------------------------------------------------------------------------

IDLE_RANKS: Final = 1024  # default of --idle-ranks
TARGET_IDLE_CPU: Final = 0.10  # of one core


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident set size of a live process in MB, from /proc."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    kib = [int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")]
    return kib[0] / 1024, kib[1] / 1024


def _bench_idle(base: Path, seconds: float, poll: float | None, ranks: int = IDLE_RANKS) -> Row:
    """CPU and memory of a following shipper while ``ranks`` live ranks write nothing.

    Each rank has one segment, open in this process (no seal, no rank_end): steps 0
    and 1 closed, then silence. The shipper (``--dead-after 3600``: nobody is declared
    dead) ships those two steps, then is measured for ``seconds``: its CPU time (user +
    sys, /proc/PID/stat) over wall time, and its RSS (VmRSS at the end, VmHWM peak).
    """
    from ranklog.spool import ensure_run

    mode = "native observer" if poll is None else f"--poll {poll:g}"
    writers: list[IncarnationWriter] = []
    with tempfile.TemporaryDirectory(prefix="idle-", dir=base) as name:
        tmp = Path(name)
        spool, out = tmp / "spool", tmp / "out.jsonl"
        ensure_run(spool, world_size=ranks)
        try:
            for rank in range(ranks):
                writer = _write_rank(spool, rank, ranks, 2, end=False)
                assert writer is not None
                writers.append(writer)
            extra = ["--dead-after", "3600"] + ([] if poll is None else ["--poll", str(poll)])
            t0 = time.monotonic()
            proc = subprocess.Popen(_ship_cmd(spool, out, *extra), stderr=subprocess.DEVNULL)
            try:
                deadline = t0 + 60 + ranks / 20
                while (not out.exists() or out.stat().st_size == 0) and time.monotonic() < deadline:
                    time.sleep(0.05)  # until the first round read every rank
                first = time.monotonic() - t0
                time.sleep(2.0)
                cpu0, wall0 = _cpu_seconds(proc.pid), time.monotonic()
                time.sleep(seconds)
                cpu = _cpu_seconds(proc.pid) - cpu0
                wall = time.monotonic() - wall0
                rss, peak = _rss_mb(proc.pid)
                alive = proc.poll() is None
            finally:
                _kill(proc)
        finally:
            for writer in writers:
                writer.abandon()
    share = cpu / wall
    return Row(
        f"idle shipper, {ranks:,} live rank files ({mode})",
        f"{ranks:,} ranks, {wall:.0f} s",
        wall_s=wall,
        cpu_s=cpu,
        rss_mb=peak,
        ok=alive and share < TARGET_IDLE_CPU,
        note=f"{share * 100:.1f} % of a core; RSS {rss:.1f} MB at the end; steps 0-1 shipped "
        f"{first:.1f} s after start" + ("" if alive else "; FAILED: shipper exited"),
    )


# -- output -----------------------------------------------------------------------------


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _header(budget: Budget, base: Path, quick: bool) -> list[str]:
    from ranklog.shippers._source import filesystem_of

    versions = ", ".join(f"{name} {_version(name)}" for name in VERSIONS)
    steps = round(budget.latency_seconds / budget.step_interval_s)
    return [
        f"# ranklog shipper benchmark{' (--quick)' if quick else ''}",
        "",
        f"- machine: {platform.platform()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"- versions: {versions}",
        f"- temp dir: {base} ({filesystem_of(base)}); {METRICS} float metrics per rank and step, "
        f"{STEPS_PER_FRAME} steps per frame in generated spools",
        "- throughput: `ranklog ship SPOOL --to jsonl:OUT --once --quiet` in a child; "
        "wall time includes interpreter start; CPU (user+sys) and peak RSS: the child's own "
        "rusage (os.wait4 in a small launcher process, see _LAUNCHER)",
        f"- latency: {LATENCY_RANKS} producer processes (durability=step), {steps} steps each; "
        f"JSONL polled every {TAIL_POLL_S * 1e3:g} ms; latency = line seen - last step_end return",
        "",
    ]


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if value < 100 else f"{value:,.0f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.2f} M"


def _table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| benchmark | size | wall s | values/s | values/CPU-s | CPU s | peak RSS MB "
        "| p50 ms | p99 ms | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {row.size} | {_fmt(row.wall_s)} | {_rate(row.values_per_s)} "
            f"| {_rate(row.values_per_cpu_s)} | {_fmt(row.cpu_s)} | {_fmt(row.rss_mb, 1)} "
            f"| {_fmt(row.p50_ms, 1)} | {_fmt(row.p99_ms, 1)} | {row.note} |"
        )
    return lines


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def _targets(small: Row, large: Row, latency: Sequence[Row]) -> list[str]:
    growth = large.rss_mb / small.rss_mb if large.rss_mb and small.rss_mb else None
    checks: list[tuple[str, str, bool | None]] = [
        (
            "shipped JSONL correct (every step once, complete, expected means)",
            "yes" if small.ok and large.ok else "no",
            small.ok and large.ok,
        ),
    ]
    for row in (small, large):
        rate = row.values_per_s or 0.0
        checks.append((
            f">= {TARGET_VALUES_PER_S / 1e6:g} M values/s, wall time ({row.size})",
            f"{_rate(row.values_per_s)} values/s ({_rate(row.values_per_cpu_s)} per CPU-s)",
            rate >= TARGET_VALUES_PER_S,
        ))  # fmt: skip
    for row in (small, large):
        checks.append((
            f"peak RSS < {TARGET_RSS_MB:g} MB ({row.size})",
            f"{_fmt(row.rss_mb, 1)} MB",
            None if row.rss_mb is None else row.rss_mb < TARGET_RSS_MB,
        ))  # fmt: skip
    checks.append((
        f"peak RSS at {SCALE}x the steps <= {TARGET_RSS_GROWTH:g}x peak RSS at 1x",
        "-" if growth is None else f"{growth:.2f}x",
        None if growth is None else growth <= TARGET_RSS_GROWTH,
    ))  # fmt: skip
    checks += [
        (f"{row.name}: shipper exits by itself, every step shipped", "-", row.ok) for row in latency
    ]
    lines = ["", "## Targets", ""]
    lines += [f"- {_verdict(ok)}: {what}: {got}" for what, got, ok in checks]
    lines += [
        f"- info: {row.name}: p50 {_fmt(row.p50_ms, 1)} ms, p99 {_fmt(row.p99_ms, 1)} ms "
        "(no target)"
        for row in latency
    ]
    return lines


def _idle_targets(idle: Sequence[Row]) -> list[str]:
    return [
        f"- {_verdict(row.ok)}: {row.name} < {TARGET_IDLE_CPU * 100:g} % of a core: {row.note}"
        for row in idle
    ]


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="small spools, short latency runs: well under a minute"
    )
    parser.add_argument(
        "--tmp-dir",
        type=Path,
        default=None,
        help="where the spools and JSONL files go (default: the system temp dir)",
    )
    parser.add_argument(
        "--idle-ranks",
        type=int,
        nargs="+",
        default=[IDLE_RANKS],
        metavar="N",
        help=f"live rank files of the idle-shipper rows (default: {IDLE_RANKS})",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=None,
        help="how long each idle shipper is measured (default: 10, --quick 4)",
    )
    parser.add_argument(
        "--idle-poll",
        choices=("both", "poll", "native"),
        default="both",
        help="idle rows with --poll 1, the native observer, or both (default)",
    )
    parser.add_argument(
        "--idle-only", action="store_true", help="only the idle-shipper rows (and their targets)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [PRODUCE_ARG]:
        return _produce(ProducerSpec(**json.loads(argv[1])))
    args = _parse_args(argv)
    budget = QUICK if args.quick else FULL
    base = Path(args.tmp_dir or tempfile.gettempdir()).resolve()
    base.mkdir(parents=True, exist_ok=True)
    idle_seconds = args.idle_seconds or (4.0 if args.quick else 10.0)
    polls = {"both": (1.0, None), "poll": (1.0,), "native": (None,)}[args.idle_poll]
    lines = _header(budget, base, args.quick)
    if args.idle_only:
        idle = [_bench_idle(base, idle_seconds, p, n) for n in args.idle_ranks for p in polls]
        what = (
            "- idle: `ranklog ship SPOOL --to jsonl:OUT --quiet --dead-after 3600 [--poll 1]` "
            "following N ranks, each with one open, unsealed segment (steps 0-1 closed, then "
            "nothing); CPU = the shipper's user+sys time over wall time of the window after "
            "those steps shipped (+2 s); RSS from /proc/PID/status (peak VmHWM in the table)"
        )
        lines = [*lines[:5], what, "", *_table(idle), "", "## Targets", "", *_idle_targets(idle)]
        print("\n".join(lines), flush=True)
        return 0
    small = _bench_throughput(base, THROUGHPUT_RANKS, budget.steps, budget.ship_timeout_s)
    large = _bench_throughput(base, THROUGHPUT_RANKS, SCALE * budget.steps, budget.ship_timeout_s)
    latency = [_bench_latency(base, budget, poll) for poll in (None, 1.0)]
    archive, bytes_per_value = _bench_archive(
        base, THROUGHPUT_RANKS, budget.steps, budget.ship_timeout_s
    )
    backends = _bench_targets(base, THROUGHPUT_RANKS, budget.steps // 4, budget.ship_timeout_s)
    idle = [_bench_idle(base, idle_seconds, p, n) for n in args.idle_ranks for p in polls]
    rows = [small, large, *archive, *backends, _startup_row(base, budget.ship_timeout_s),
            *latency, *idle]  # fmt: skip
    lines += _table(rows)
    lines += _targets(small, large, latency)
    lines += _idle_targets(idle)
    comp, rep, live = archive
    lines += [
        f"- {_verdict((comp.values_per_s or 0) >= TARGET_VALUES_PER_S)}: compaction >= 1 M "
        f"values/s: {_rate(comp.values_per_s)} values/s",
        f"- {_verdict(bytes_per_value <= TARGET_BYTES_PER_VALUE)}: <= "
        f"{TARGET_BYTES_PER_VALUE:g} bytes per metric value on disk: {bytes_per_value:.2f}",
        f"- {_verdict(rep.ok and (rep.values_per_s or 0) >= (live.values_per_s or 0))}: replay "
        f"at least as fast as live shipping: {_rate(rep.values_per_s)} vs "
        f"{_rate(live.values_per_s)} values/s ({rep.note})",
    ]
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
