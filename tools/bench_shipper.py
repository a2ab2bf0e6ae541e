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
  jsonl:OUT --once --quiet`` in a child process; at N and at 4N steps, and (full run)
  at 100 M values (~2.2 GB of spool), so that peak memory can be seen not to grow with
  the spool. Wall time includes the
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
- other shapes: one rank whose one segment is nearly the rotation size, and 4,096
  ranks x 10 steps x 100 metrics, each shipped, compacted and replayed once, beside the
  limit of a replay of its Parquet files (pyarrow opening each and reading the columns
  replay uses, once);
- incremental compaction: ``ranklog compact`` of 64 live ranks (open, unsealed
  segments) from scratch, then of N/10 new steps on every rank, three times, then of
  nothing new; on datasets of N/4 and 2N steps, whose rounds of new steps should cost
  the same (O(new data), not O(dataset));
- idle cost: a following shipper (``--poll 1``, and the native observer) over
  ``--idle-ranks`` ranks (default 1,024) that each hold one open, unsealed segment
  and write nothing: its CPU time over wall time (share of one core) and its RSS.

The targets are checked at the end. This is a developer tool, not a test:
numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (
    FORMAT,
    METRICS,
    STEPS_PER_FRAME,
    check_jsonl,
    collect,
    dir_mb,
    fmt,
    kill,
    launch,
    percentile,
    profile_lines,
    rate,
    run_measured,
    short,
    values,
    verdict,
    version,
    write_json,
    write_rank,
    write_spool,
    write_steps,
)

if TYPE_CHECKING:
    from _bench import ChildRun

    from ranklog.spool import IncarnationWriter

THROUGHPUT_RANKS: Final = 64
#: values of the largest throughput spool (issue 14: RSS flat on a 100 M-value spool), ~2.2 GB
HUGE_VALUES: Final = 100_000_000
LIMIT: Final = "limit: pyarrow reads each file once"
SCALE: Final = 4
LATENCY_RANKS: Final = 4
TAIL_POLL_S: Final = 0.001
PRODUCE_ARG: Final = "--_produce"  # internal: run as one producer rank (latency benchmark)
VERSIONS: Final = ("ranklog", "msgspec", "watchdog")


TARGET_VALUES_PER_S: Final = 5_000_000  # issue 14; wall time here includes the interpreter start
TARGET_RSS_MB: Final = 300.0
TARGET_RSS_GROWTH: Final = 1.25  # peak RSS at 4x the steps over peak RSS at 1x


@dataclass(frozen=True)
class Budget:
    """Sizes for one run of the benchmark."""

    steps: int
    latency_seconds: float
    step_interval_s: float
    ship_timeout_s: float
    #: steps of a third, much larger throughput spool (0: none)
    huge_steps: int = 0


FULL: Final = Budget(steps=2_000, latency_seconds=10.0, step_interval_s=0.05, ship_timeout_s=300,
                     huge_steps=HUGE_VALUES // (THROUGHPUT_RANKS * METRICS))  # fmt: skip
# 1,000 steps: each rank's segment (~430 KB) is larger than what the shipper reads from
# a segment per round (256 KB), so memory at 1x is already the bounded steady state.
QUICK: Final = Budget(steps=1_000, latency_seconds=2.0, step_interval_s=0.05, ship_timeout_s=60)


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


def _ship_cmd(spool: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", f"jsonl:{out}",
            "--quiet", *extra]  # fmt: skip


def _compact_cmd(spool: Path, pq: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ranklog.cli", "compact", str(spool), "--out", str(pq), *extra]


def _replay_cmd(pq: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "ranklog.cli", "replay", str(pq), "--to", f"jsonl:{out}"]


def _run_row(
    label: str, size: str, run: ChildRun, values: int, note: str, problem: str = ""
) -> Row:
    """The row of one measured command that handled ``values`` values; FAILED when it
    exited non-zero (its stderr) or with ``problem``."""
    problem = (f"exit {run.returncode}: {short(run.stderr)}" if run.returncode else "") or problem
    return Row(
        label, size, wall_s=run.wall_s, values_per_s=values / run.wall_s,
        values_per_cpu_s=values / run.cpu_s if run.cpu_s else None, cpu_s=run.cpu_s,
        rss_mb=run.maxrss_mb, ok=not problem, note=f"FAILED: {problem}" if problem else note,
    )  # fmt: skip


# -- throughput -------------------------------------------------------------------------


def _bench_throughput(
    base: Path, ranks: int, steps: int, timeout: float, form: int = FORMAT,
    per_frame: int = STEPS_PER_FRAME,
) -> Row:  # fmt: skip
    """Ship a closed spool of ``ranks`` x ``steps`` x METRICS values with ``--once``
    (``form``: its segment format; 1, the format before metrics were packed; ``per_frame``
    steps a frame: 1 as durability ``step``, the default, writes them)."""
    values = ranks * steps * METRICS
    size = f"{ranks} ranks x {steps:,} steps ({values / 1e6:.2f} M values)"
    with tempfile.TemporaryDirectory(prefix="ship-", dir=base) as tmp:
        spool, out = Path(tmp) / "spool", Path(tmp) / "out.jsonl"
        t0 = time.perf_counter()
        write_spool(spool, ranks, steps, fmt=form, per_frame=per_frame)
        generated = time.perf_counter() - t0
        spool_mb = dir_mb(spool)
        run = run_measured(_ship_cmd(spool, out, "--once"), Path(tmp), timeout)
        problem = f"exit {run.returncode}: {short(run.stderr)}" if run.returncode else ""
        problem = problem or check_jsonl(out, ranks, steps)
    note = f"spool {spool_mb:,.0f} MB (written in {generated:.1f} s, not timed)"
    label = "ship --once (jsonl)"
    if form != FORMAT:
        label += f", segment format {form}"
    if per_frame != STEPS_PER_FRAME:
        label += f", {per_frame} step{'s' if per_frame > 1 else ''} a frame"
    return Row(
        label,
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
TARGET_SPOOL_BYTES: Final = 10.0  # issue 32: spool bytes per metric value, 24-character names
SPOOL_BYTES_STEPS: Final = 2_000


def _spool_bytes(base: Path) -> dict[str, Any]:
    """Spool bytes per metric value, 20 values of 24-character names a step: segment format
    1 and 2 written alike (frames of STEPS_PER_FRAME steps, a step_end per step), and
    format 2 as ``log_metrics`` + ``step_end`` write it at durability ``step`` (a frame a
    step) and ``buffered``."""
    import struct

    import ranklog
    from ranklog.schemas import Event, Metrics, Names, Packed, StepEnd, encoder
    from ranklog.spool import IncarnationWriter, SpoolLayout, ensure_run

    names = [f"train/layer_{k:02d}/grad_norm" for k in range(METRICS)]
    assert {len(n) for n in names} == {24}
    count = SPOOL_BYTES_STEPS * METRICS
    pack = struct.Struct(f"<{METRICS}d").pack
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bytes-", dir=base) as name:
        for form in (1, 2):
            spool = Path(name) / f"format{form}"
            w = IncarnationWriter.create(SpoolLayout(spool), ensure_run(spool, world_size=1), 0)
            record = Names(1e9, 0, names, "mean")
            w.add_names(encoder.encode(record))
            for first in range(0, SPOOL_BYTES_STEPS, STEPS_PER_FRAME):
                events: list[Event | Names | Packed] = [record] if form == 2 and not first else []
                for step in range(first, first + STEPS_PER_FRAME):
                    vals = [step * 1e-3 + k * 0.25 for k in range(METRICS)]
                    if form == 2:
                        events.append(Packed(step * 100, step, 0, pack(*vals)))
                    else:
                        events.append(
                            Metrics(1e9 + step * 0.1, step, dict(zip(names, vals, strict=True)))
                        )
                    events.append(StepEnd(1e9 + step * 0.1, step))
                w.write_events(len(events), [encoder.encode(events)], names=form == 2 and not first)
            w.close(sync=False)
            out[f"format {form}"] = dir_mb(spool / "ranks") * 1e6 / count
        for durability in ("step", "buffered"):
            spool = Path(name) / durability
            run = ranklog.init(spool, rank=0, world_size=1, durability=durability, code=False,
                               handle_signals=False)  # fmt: skip
            for step in range(SPOOL_BYTES_STEPS):
                run.log_metrics({n: step * 1e-3 + k * 0.25 for k, n in enumerate(names)}, step=step)
                run.step_end(step)
            run.close()
            out[f"log_metrics, durability {durability}"] = dir_mb(spool / "ranks") * 1e6 / count
    figure = ", ".join(f"{v:.2f} ({k})" for k, v in out.items())
    return {"what": f"<= {TARGET_SPOOL_BYTES:g} spool bytes per metric value, 20 values of "
                    "24-character names a step, segment format 2 (format 1 beside it)",
            "figure": figure, "ok": out["format 2"] <= TARGET_SPOOL_BYTES}  # fmt: skip


TARGET_COMPACT: Final = 3_000_000  # values/s
ARCHIVE_ROUNDS: Final = 3  # live, compact and replay, interleaved; medians


def _bench_archive(base: Path, ranks: int, steps: int, timeout: float) -> tuple[list[Row], float]:
    """Compaction and replay of the throughput spool; replay must equal live shipping."""
    values = ranks * steps * METRICS
    size = f"{ranks} ranks x {steps:,} steps ({values / 1e6:.2f} M values)"
    with tempfile.TemporaryDirectory(prefix="archive-", dir=base) as name:
        tmp = Path(name)
        spool, pq, live, again = tmp / "spool", tmp / "pq", tmp / "live.jsonl", tmp / "replay.jsonl"
        write_spool(spool, ranks, steps)
        ships, comps, reps = [], [], []
        same = True
        for _ in range(ARCHIVE_ROUNDS):  # interleaved rounds, medians: the machine is noisy
            for path in (live, again):
                path.unlink(missing_ok=True)
            shutil.rmtree(spool / "cursors", ignore_errors=True)
            shutil.rmtree(spool / "leases", ignore_errors=True)
            shutil.rmtree(pq, ignore_errors=True)
            ships.append(run_measured(_ship_cmd(spool, live, "--once"), tmp, timeout))
            comps.append(run_measured(_compact_cmd(spool, pq), tmp, timeout))
            metrics_bytes = sum(p.stat().st_size for p in (pq / "metrics").glob("*.parquet"))
            total_bytes = sum(p.stat().st_size for p in pq.rglob("*.parquet"))
            reps.append(run_measured(_replay_cmd(pq, again), tmp, timeout))
            same = same and live.is_file() and again.is_file()
            same = same and live.read_bytes() == again.read_bytes()
        ship, comp, rep = (sorted(r, key=lambda x: x.wall_s)[len(r) // 2]
                           for r in (ships, comps, reps))  # fmt: skip
    differs = "" if same else "JSONL differs from live"
    rows = [
        _run_row("compact (parquet)", size, comp, values,
                 f"{metrics_bytes / values:.2f} B/value in metrics, "
                 f"{total_bytes / values:.2f} B/value with every table"),
        _run_row("replay (jsonl)", size, rep, values, "JSONL byte-identical to live shipping",
                 differs),
        _run_row("ship --once (jsonl), same spool", size, ship, values,
                 "live shipping, for comparison"),
    ]  # fmt: skip
    return rows, metrics_bytes / values


def _bench_shapes(base: Path, budget: Budget) -> list[Row]:
    """Live shipping, compaction and replay of two other spools than the throughput one.

    One rank whose one segment is nearly the rotation size (64 MiB): what compaction and
    replay hold in memory for a big segment. And 4,096 ranks with 10 steps of 100
    metrics each: what each segment's fixed cost (files, manifest entries) comes to.
    """
    rows = []
    quick = budget is QUICK
    for ranks, steps, metrics in ((1, 75 * budget.steps, METRICS),
                                  (1_024 if quick else 4_096, 10, 100)):  # fmt: skip
        values = ranks * steps * metrics
        size = (
            f"{ranks:,} ranks x {steps:,} steps x {metrics} metrics ({values / 1e6:.2f} M values)"
        )
        with tempfile.TemporaryDirectory(prefix="shapes-", dir=base) as name:
            tmp = Path(name)
            spool, pq, live, again = tmp / "spool", tmp / "pq", tmp / "live.jsonl", tmp / "r.jsonl"
            write_spool(spool, ranks, steps, metrics)
            biggest = max(p.stat().st_size for p in (spool / "ranks").rglob("*.rlog"))
            runs = {
                "ship --once (jsonl)": run_measured(_ship_cmd(spool, live, "--once"), tmp,
                                                    budget.ship_timeout_s),
                "compact (parquet)": run_measured(_compact_cmd(spool, pq), tmp,
                                                  budget.ship_timeout_s),
                "replay (jsonl)": run_measured(_replay_cmd(pq, again), tmp,
                                               budget.ship_timeout_s),
            }  # fmt: skip
            same = {
                pq: live.is_file() and again.is_file() and live.read_bytes() == again.read_bytes(),
            }
            files = {pq: _files_per_table(pq)}
            floor = _read_limit(pq, size, values)
            queries = _queries(pq, size, values) if ranks > 1 else []
        for label, run in runs.items():
            replayed = label.startswith("replay")
            dataset = pq
            note = f"largest segment {biggest / 2**20:.1f} MiB"
            if label.startswith("compact"):
                note += f"; {files[dataset]} files per table (most)"
            if replayed:
                note += "; JSONL byte-identical to live shipping"
            problem = "JSONL differs from live shipping" if replayed and not same[dataset] else ""
            rows.append(_run_row(label, size, run, values, note, problem))
        rows.append(floor)
        rows.extend(queries)
    return rows


def _files_per_table(dataset: Path) -> int:
    """The most Parquet files any table of ``dataset`` holds."""
    return max((sum(1 for _ in d.glob("*.parquet")) for d in dataset.iterdir() if d.is_dir()),
               default=0)  # fmt: skip


def _queries(dataset: Path, size: str, values: int) -> list[Row]:
    """What an analyst runs on the dataset, in this process, timed: a DuckDB ``GROUP BY
    step`` mean over every metric value, and a Polars ``scan_parquet`` filter on a tenth of
    the steps (pruned by the row groups' step statistics)."""
    import duckdb
    import polars as pl

    glob = str(dataset / "metrics" / "*.parquet")
    out = []
    c0, w0 = time.process_time(), time.perf_counter()
    steps = duckdb.sql(f"SELECT step, avg(value) FROM read_parquet('{glob}') GROUP BY step"
                       ).fetchall()  # fmt: skip
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    out.append(Row("DuckDB: GROUP BY step, avg(value)", size, wall, values / wall, None, cpu,
                   note=f"{len(steps):,} steps; in-process, threads of its own"))  # fmt: skip
    top = max(s for s, _ in steps)
    lo, hi = top // 2, top // 2 + max(top // 10, 0)
    c0, w0 = time.process_time(), time.perf_counter()
    got = pl.scan_parquet(glob).filter(pl.col("step").is_between(lo, hi)).collect()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    out.append(Row(f"Polars: scan_parquet, steps {lo}..{hi}", size, wall, None, None, cpu,
                   note=f"{got.height:,} rows; in-process, threads of its own"))  # fmt: skip
    return out


def _read_limit(dataset: Path, size: str, values: int) -> Row:
    """Every file of ``dataset``'s steps table read once, in this process: what a replay
    from it cannot beat."""
    import pyarrow.parquet as pq

    paths = sorted((dataset / "steps").glob("steps-*.parquet"))
    c0, w0 = time.process_time(), time.perf_counter()
    for path in paths:
        pq.ParquetFile(path, pre_buffer=False).read(use_threads=False)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return Row(LIMIT, size, wall, values / wall, values / cpu, cpu,
               note=f"{len(paths):,} files of the steps table read once, in-process")  # fmt: skip


INCREMENTS: Final = 3  # rounds of new steps compacted on top of each dataset; medians
#: a rerun with the same new data on an 8x bigger dataset may cost this much more at most
TARGET_INCREMENTAL_GROWTH: Final = 1.25


def _bench_incremental(
    base: Path, ranks: int, steps: int, timeout: float
) -> tuple[list[Row], dict[str, object]]:
    """``ranklog compact`` of the same new steps on a small and on an 8x bigger dataset.

    Every rank is live (its segment open and unsealed, as during training): each round
    appends ``steps // 10`` steps to every rank and compacts again. The cost of a round
    should follow the new data, not the dataset: the rounds on the big dataset are
    compared with those on the small one. A last run finds nothing new.
    """
    from ranklog.spool import read_run

    delta = steps // 10
    rows: list[Row] = []
    medians: dict[int, float] = {}
    for first in (steps // 4, 2 * steps):
        with tempfile.TemporaryDirectory(prefix="incremental-", dir=base) as name:
            tmp = Path(name)
            spool, pq = tmp / "spool", tmp / "pq"
            writers = [write_rank(spool, r, ranks, first, end=False) for r in range(ranks)]
            t0 = read_run(spool).created
            cmd = _compact_cmd(spool, pq)
            full = run_measured(cmd, tmp, timeout)
            runs, top = [], first
            for _ in range(INCREMENTS):
                for rank, writer in enumerate(writers):
                    assert writer is not None
                    write_steps(writer, rank, t0, range(top, top + delta))
                top += delta
                os.sync()
                runs.append(run_measured(cmd, tmp, timeout))
            idle = run_measured(cmd, tmp, timeout)
            for writer in writers:
                assert writer is not None
                writer.abandon()
            files = sum(1 for _ in pq.rglob("*.parquet"))
        inc = sorted(runs, key=lambda r: r.wall_s)[len(runs) // 2]
        medians[first] = inc.wall_s
        dataset = ranks * first * METRICS
        new = ranks * delta * METRICS
        failed = [r for r in (full, *runs, idle) if r.returncode]
        problem = f"exit {failed[0].returncode}: {short(failed[0].stderr)}" if failed else ""
        for label, run, values_done, note in (
            (f"compact, a {dataset / 1e6:.2f} M-value dataset from scratch", full, dataset,
             "every rank live (open, unsealed segments)"),
            (f"compact +{delta:,} steps on it (median of {INCREMENTS})", inc, new,
             f"values/s of the new data; {files:,} files in the dataset at the end"),
            ("compact, nothing new", idle, 0, "the fixed cost of a run: start, manifest, listing"),
        ):  # fmt: skip
            rows.append(Row(
                label, f"{ranks} ranks x {first:,} steps", wall_s=run.wall_s,
                values_per_s=values_done / run.wall_s if values_done else None,
                values_per_cpu_s=values_done / run.cpu_s if values_done and run.cpu_s else None,
                cpu_s=run.cpu_s, rss_mb=run.maxrss_mb, ok=not problem,
                note=f"FAILED: {problem}" if problem else note,
            ))  # fmt: skip
    small, big = (medians[k] for k in sorted(medians))
    growth = big / small if small else float("inf")
    check = {
        "what": "incremental compaction costs O(new data): the same new steps on an 8x bigger "
        f"dataset take <= {TARGET_INCREMENTAL_GROWTH:g}x the time",
        "figure": f"{big:.2f} s vs {small:.2f} s ({growth:.2f}x)",
        "ok": all(r.ok for r in rows) and growth <= TARGET_INCREMENTAL_GROWTH,
    }
    return rows, check


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
        write_spool(spool, ranks, steps)
        for kind, spec in BACKENDS.items():
            cmd = _ship_cmd(spool, Path(tmp) / "unused.jsonl", "--once")
            cmd[cmd.index("--to") + 1] = spec.format(tmp=tmp)
            cmd += ["--name", kind]
            if kind == "wandb":  # (an option no --to takes is refused)
                cmd += ["--mode", "offline", "--dir", tmp]
            run = run_measured(cmd, Path(tmp), timeout)
            rows.append(_run_row(f"ship --once ({kind})", size, run, values,
                                 f"{steps / run.wall_s:,.0f} reduced steps/s "
                                 f"({METRICS} values each)"))  # fmt: skip
    return rows


def _startup_row(base: Path, timeout: float) -> Row:
    """The fixed cost inside every wall time above: a child interpreter running the CLI."""
    with tempfile.TemporaryDirectory(prefix="startup-", dir=base) as tmp:
        cmd = [sys.executable, "-m", "ranklog.cli", "--version"]
        run = run_measured(cmd, Path(tmp), timeout)
    return Row(
        "python -m ranklog.cli --version",
        "-",
        wall_s=run.wall_s,
        cpu_s=run.cpu_s,
        rss_mb=run.maxrss_mb,
        ok=run.returncode == 0,
        note="interpreter start + CLI import: the fixed part of each wall time"
        if run.returncode == 0
        else f"FAILED: exit {run.returncode}: {short(run.stderr)}",
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
        run.log_metrics(values(spec.rank, step), step=step)
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
            shipper = launch(_ship_cmd(spool, out, *extra), tmp / "rusage.txt", stderr)
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
                        kill(proc)
            run = collect(shipper, tmp / "rusage.txt", stderr)
        lat, missing = _latencies(tmp, tail.seen) if not any(codes) else ([], -1)
    problems = []
    if not exited:
        problems.append("shipper did not exit by itself; killed")
    elif run.returncode:
        problems.append(f"shipper exit {run.returncode}: {short(run.stderr)}")
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
        p50_ms=percentile(lat, 0.50) if lat else None,
        p99_ms=percentile(lat, 0.99) if lat else None,
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
                writer = write_rank(spool, rank, ranks, 2, end=False)
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
                kill(proc)
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


def _archive_profile(
    base: Path, ranks: int, steps: int, *, compaction: bool, replay: bool, top: int = 12
) -> list[str]:
    """Top functions (own time) of an in-process compaction and replay below their targets.

    Replay's reader thread is not in the profile (cProfile follows the calling thread).
    """
    from ranklog._cli_run import long_running as _long_running
    from ranklog.archive import compact
    from ranklog.archive import replay as replay_dataset
    from ranklog.shippers.targets.jsonl import JsonlTarget

    _long_running()  # the collector and allocator as the CLI commands tune them
    out = []
    with tempfile.TemporaryDirectory(prefix="profile-", dir=base) as name:
        tmp = Path(name)
        write_spool(tmp / "spool", ranks, steps)
        runs = []
        if compaction:
            runs.append(("compaction", lambda: compact(tmp / "spool", tmp / "pq")))
        else:
            compact(tmp / "spool", tmp / "pq")
        if replay:
            runs.append(("replay", lambda: replay_dataset(tmp / "pq", JsonlTarget(tmp / "r"))))
        for what, call in runs:
            out += profile_lines(call, f"Profile of {what} ({ranks} ranks x {steps} steps)", top)
    return out


def _header(budget: Budget, base: Path, quick: bool) -> list[str]:
    from ranklog.shippers._source import filesystem_of

    versions = ", ".join(f"{name} {version(name)}" for name in VERSIONS)
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
        "rusage (os.wait4 in a small launcher process, see LAUNCHER)",
        f"- latency: {LATENCY_RANKS} producer processes (durability=step), {steps} steps each; "
        f"JSONL polled every {TAIL_POLL_S * 1e3:g} ms; latency = line seen - last step_end return",
        "",
    ]


def _table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| benchmark | size | wall s | values/s | values/CPU-s | CPU s | peak RSS MB "
        "| p50 ms | p99 ms | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {row.size} | {fmt(row.wall_s)} | {rate(row.values_per_s)} "
            f"| {rate(row.values_per_cpu_s)} | {fmt(row.cpu_s)} | {fmt(row.rss_mb, 1)} "
            f"| {fmt(row.p50_ms, 1)} | {fmt(row.p99_ms, 1)} | {row.note} |"
        )
    return lines


def _values(row: Row) -> str:
    """The values of a throughput row (its size says "... (2.56 M values)")."""
    return row.size.rsplit("(", 1)[-1].rstrip(")")


def _targets(small: Row, larger: Sequence[Row], latency: Sequence[Row]) -> list[str]:
    """The shipper's checks: ``small`` the 1x throughput spool, ``larger`` the bigger ones."""
    peaks = [r.rss_mb for r in larger if r.rss_mb]
    growth = max(peaks) / small.rss_mb if small.rss_mb and len(peaks) == len(larger) else None
    every = [small, *larger]
    checks: list[tuple[str, str, bool | None]] = [
        (
            "shipped JSONL correct (every step once, complete, expected means)",
            "yes" if all(r.ok for r in every) else "no",
            all(r.ok for r in every),
        ),
    ]
    for row in every:
        got = row.values_per_s or 0.0
        checks.append((
            f">= {TARGET_VALUES_PER_S / 1e6:g} M values/s, wall time ({row.size})",
            f"{rate(row.values_per_s)} values/s ({rate(row.values_per_cpu_s)} per CPU-s)",
            got >= TARGET_VALUES_PER_S,
        ))  # fmt: skip
    for row in every:
        checks.append((
            f"peak RSS < {TARGET_RSS_MB:g} MB ({row.size})",
            f"{fmt(row.rss_mb, 1)} MB",
            None if row.rss_mb is None else row.rss_mb < TARGET_RSS_MB,
        ))  # fmt: skip
    checks.append((
        f"peak RSS with {' and '.join(_values(r) for r in larger)} <= {TARGET_RSS_GROWTH:g}x "
        f"peak RSS with {_values(small)}",
        "-" if growth is None else f"{growth:.2f}x",
        None if growth is None else growth <= TARGET_RSS_GROWTH,
    ))  # fmt: skip
    checks += [
        (f"{row.name}: shipper exits by itself, every step shipped", "-", row.ok) for row in latency
    ]
    lines = ["", "## Targets", ""]
    lines += [f"- {verdict(ok)}: {what}: {got}" for what, got, ok in checks]
    lines += [
        f"- info: {row.name}: p50 {fmt(row.p50_ms, 1)} ms, p99 {fmt(row.p99_ms, 1)} ms (no target)"
        for row in latency
    ]
    return lines


def _idle_targets(idle: Sequence[Row]) -> list[str]:
    return [
        f"- {verdict(row.ok)}: {row.name} < {TARGET_IDLE_CPU * 100:g} % of a core: {row.note}"
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
    parser.add_argument("--json", type=Path, default=None, help="merge figures into this file")
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
    format1 = _bench_throughput(base, THROUGHPUT_RANKS, budget.steps, budget.ship_timeout_s, 1)
    # a frame per step, as durability step (the default) writes: what a frame costs
    per_step = _bench_throughput(
        base, THROUGHPUT_RANKS, budget.steps, budget.ship_timeout_s, per_frame=1
    )
    spool_bytes = _spool_bytes(base)
    large = _bench_throughput(base, THROUGHPUT_RANKS, SCALE * budget.steps, budget.ship_timeout_s)
    larger = [large]
    if budget.huge_steps:
        larger.append(
            _bench_throughput(base, THROUGHPUT_RANKS, budget.huge_steps, budget.ship_timeout_s)
        )
    latency = [_bench_latency(base, budget, poll) for poll in (None, 1.0)]
    archive, bytes_per_value = _bench_archive(
        base, THROUGHPUT_RANKS, budget.steps, budget.ship_timeout_s
    )
    shapes = _bench_shapes(base, budget)
    incremental, incremental_check = _bench_incremental(
        base, THROUGHPUT_RANKS, budget.steps, budget.ship_timeout_s
    )
    backends = _bench_targets(base, THROUGHPUT_RANKS, budget.steps // 4, budget.ship_timeout_s)
    idle = [_bench_idle(base, idle_seconds, p, n) for n in args.idle_ranks for p in polls]
    rows = [small, format1, per_step, *larger, *archive, *shapes, *incremental, *backends,
            _startup_row(base, budget.ship_timeout_s),
            *latency, *idle]  # fmt: skip
    lines += _table(rows)
    lines += _targets(small, larger, latency)
    lines += _idle_targets(idle)
    comp, rep, live = archive
    comps = [comp, *(r for r in shapes if r.name.startswith("compact"))]
    reps = [rep, *(r for r in shapes if r.name.startswith("replay ("))]
    # issue 32, item 2: the job of many ranks
    wide = [r for r in shapes if r.size.startswith(("4,096 ranks", "1,024 ranks"))]
    wide_comp = next(r for r in wide if r.name == "compact (parquet)")
    wide_files = int(wide_comp.note.split("; ")[1].split()[0])
    live_of = {r.size: r for r in shapes if r.name.startswith("ship")}
    limit_of = {r.size: r for r in shapes if r.name == LIMIT}
    gain = (small.values_per_cpu_s or 0) / (format1.values_per_cpu_s or 1)
    archive_checks = [
        {"what": f"compaction >= {TARGET_COMPACT / 1e6:g} M values/s (wall, interpreter start "
                 "included)", "figure": f"{rate(comp.values_per_s)} values/s",
         "ok": (comp.values_per_s or 0) >= TARGET_COMPACT},
        {"what": f"compaction peak RSS <= {TARGET_RSS_MB:g} MB, whatever the spool's shape",
         "figure": ", ".join(f"{fmt(r.rss_mb)} MB ({r.size})" for r in comps),
         "ok": all((r.rss_mb or 0) <= TARGET_RSS_MB for r in comps)},
        {"what": f"<= {TARGET_BYTES_PER_VALUE:g} bytes per metric value on disk",
         "figure": f"{bytes_per_value:.2f}", "ok": bytes_per_value <= TARGET_BYTES_PER_VALUE},
        {"what": "replay at least as fast as live shipping, same data",
         "figure": f"{rate(rep.values_per_s)} vs {rate(live.values_per_s)} values/s ({rep.note})",
         "ok": rep.ok and (rep.values_per_s or 0) >= (live.values_per_s or 0)},
        {"what": f"replay peak RSS <= {TARGET_RSS_MB:g} MB, whatever the dataset's shape",
         "figure": ", ".join(f"{fmt(r.rss_mb)} MB ({r.size})" for r in reps),
         "ok": all((r.rss_mb or 0) <= TARGET_RSS_MB for r in reps)},
        {"what": "replay of the other spools: byte-identical to live shipping",
         "figure": "yes" if all(r.ok for r in reps) else "no",
         "ok": all(r.ok for r in reps)},
        {"what": "replay of the other spools at least as fast as live shipping",
         "figure": ", ".join(f"{rate(r.values_per_s)} vs {rate(live_of[r.size].values_per_s)} "
                             f"values/s, limit {rate(limit_of[r.size].values_per_s)} ({r.size})"
                             for r in reps[1:]),
         "ok": all((r.values_per_s or 0) >= (live_of[r.size].values_per_s or 0)
                   for r in reps[1:])},
        {"what": f"{wide_comp.size}: compaction >= 2 M values/s, <= 16 files per table",
         "figure": f"{rate(wide_comp.values_per_s)} values/s, {wide_files} files per table",
         "ok": (wide_comp.values_per_s or 0) >= 2e6 and wide_files <= 16},
        incremental_check,
        spool_bytes,
        {"what": "shipper: segment format 2 against format 1, same data, per CPU-second",
         "figure": f"{rate(small.values_per_cpu_s)} vs {rate(format1.values_per_cpu_s)} values "
                   f"per CPU-s ({gain:.2f}x; issue 32 asks 3x)",
         "ok": gain >= 3},
    ]  # fmt: skip
    lines += [f"- {verdict(c['ok'])}: {c['what']}: {c['figure']}" for c in archive_checks]
    if not archive_checks[0]["ok"] or not archive_checks[3]["ok"]:
        lines += _archive_profile(base, THROUGHPUT_RANKS, budget.steps,
                                  compaction=not archive_checks[0]["ok"],
                                  replay=not archive_checks[3]["ok"])  # fmt: skip
    print("\n".join(lines), flush=True)
    write_json(args.json, "shipper", rows, archive_checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
