"""Benchmark the offline half against its limits, the backends' own clients and scale.

Run from the repository root (``./tools/bench`` runs it with the other benchmarks)::

    .venv/bin/python tools/bench_scale.py            # a few minutes
    .venv/bin/python tools/bench_scale.py --quick    # smaller spools

It prints Markdown tables measured in this run:

- limits: what the shipper cannot beat on the same spool, in this process: reading and
  decoding every frame (``read_segment``: CRC + msgspec); that plus the least a reduction
  in Python does (each event routed to its step, each (step, name) summed by
  ``math.fsum``); and a bare numpy reduction of the same values (an array already built:
  the arithmetic alone);
- the shipper: ``Shipper.run_forever(once=True)`` in a fresh child process, timed alone
  (interpreter start and imports excluded), CPU seconds and peak RSS;
- backends: each target's reduced steps/s (the shipper as above)
  beside the backend's own client logging the same steps directly, in-process (MLflow
  ``log_batch`` of full 1,000-metric batches, TensorBoard's ``EventFileWriter`` with
  one prebuilt ``Summary`` per step, W&B ``run.log`` per step, offline);
- scale: ``ranklog ship --once`` values/s and reduced steps/s against the number of rank
  files (1 to 4,096, 100 metrics each) and against metrics per step (10 to 1,000);
- a profile (top functions, in-process) of any shipper figure below its target.

This is a developer tool, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (
    fmt,
    names,
    profile_lines,
    rate,
    run_measured,
    short,
    verdict,
    write_json,
    write_spool,
)

TARGET_SHIP: Final = 5_000_000  # values/s, JSONL target
TARGET_STEPS: Final = {"mlflow": 500, "tensorboard": 2_000, "wandb": 500}  # reduced steps/s
ROUNDS: Final = 3  # rounds of each backend measurement (medians)
BACKEND_METRICS: Final = 10
BACKEND_RANKS: Final = 8


@dataclass(frozen=True)
class Row:
    """One line of a table; None where a column does not apply."""

    name: str
    size: str
    seconds: float | None = None
    values_per_s: float | None = None
    steps_per_s: float | None = None
    rss_mb: float | None = None
    note: str = ""


@dataclass(frozen=True)
class Check:
    """A figure beside its anchor (the target) and the limit measured in the same run."""

    what: str
    figure: str
    anchor: str
    limit: str
    ok: bool | None


#: run in a child: one shipper in-process, timing run_forever alone (no interpreter start,
#: no imports), the process tuned as `ranklog ship` tunes it; prints {"cpu": s, "wall": s,
#: "rss_mb": peak} (VmHWM: ru_maxrss can carry the forking parent's peak across exec)
CHILD: Final = """
import json, resource, sys, time
from ranklog._cli_run import long_running as _long_running
from ranklog.shippers import Shipper, make_target
spool, spec, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
target = make_target(spec, spool, options)
_long_running()
shipper = Shipper(spool, target, name="bench", dead_after=3600, start_grace=0)
c0, w0 = time.process_time(), time.perf_counter()
code = shipper.run_forever(once=True)
cpu, wall = time.process_time() - c0, time.perf_counter() - w0
hwm = [x for x in open("/proc/self/status") if x.startswith("VmHWM:")]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rss = (int(hwm[0].split()[1]) if hwm else peak) / 1024
print(json.dumps({"cpu": cpu, "wall": wall, "rss_mb": rss, "code": code}))
"""


@dataclass(frozen=True)
class Shipped:
    """One shipper run in a child: CPU and wall seconds of run_forever alone, peak RSS."""

    ok: bool
    cpu: float
    wall: float
    rss_mb: float
    error: str = ""


def _ship(spool: Path, spec: str, options: dict[str, Any] | None = None) -> Shipped:
    """Ship ``spool`` to ``spec`` once, in a fresh child process (cursors removed first)."""
    shutil.rmtree(spool / "cursors", ignore_errors=True)
    shutil.rmtree(spool / "leases", ignore_errors=True)
    cmd = [sys.executable, "-c", CHILD, str(spool), spec, json.dumps(options or {})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    try:
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return Shipped(False, math.nan, math.nan, math.nan, short(proc.stderr[-500:]))
    return Shipped(got["code"] == 0, got["cpu"], got["wall"], got["rss_mb"])


# -- limits -----------------------------------------------------------------------------


def _decode_limit(spool: Path, values: int) -> Row:
    """Every segment read and decoded (frames, CRC, msgspec), nothing else: as the shipper
    reads them (packed values kept as their bytes, segment format 2)."""
    from ranklog.spool import SegmentReader

    paths = sorted(p for p in (spool / "ranks").rglob("*") if p.is_file())
    t0 = time.process_time()
    events = sum(len(SegmentReader(p, packed=True).read(0, writer_gone=True).events) for p in paths)
    took = time.process_time() - t0
    return Row("limit: read + decode every frame", f"{len(paths)} segments", took,
               values / took, note=f"{events:,} events, CPU time in-process")  # fmt: skip


def _python_limit(spool: Path, values: int) -> Row:
    """Decoding, then the least any reduction in Python does with the decoded events: each
    routed to its step, each (step, name)'s values gathered across ranks in C loops and
    summed by ``math.fsum`` (the correctly rounded sum that replay's byte-equality with live
    shipping rests on), the events freed. No watermark, no bookkeeping, no output."""
    from operator import itemgetter

    from ranklog.schemas import Metrics, MetricsPacked
    from ranklog.shippers._gather import le_floats
    from ranklog.spool import SegmentReader

    paths = sorted(p for p in (spool / "ranks").rglob("*") if p.is_file())
    t0 = time.process_time()
    by_step: dict[int, list[Any]] = {}
    for path in paths:
        for ev in SegmentReader(path, packed=True).read(0, writer_gone=True).events:
            if type(ev) is MetricsPacked:  # (segment format 2: the values' bytes)
                by_step.setdefault(ev.step, []).append(ev)
            elif type(ev) is Metrics:
                by_step.setdefault(ev.step, []).append(ev.values)
    sums = 0
    for got in by_step.values():
        if type(got[0]) is MetricsPacked:  # one C unpack per step, columns sliced
            n = len(got[0].names)
            flat = le_floats(b"".join(ev.packed for ev in got))
            sums += len(list(map(math.fsum, (flat[i::n] for i in range(n)))))
        else:
            rows = list(map(itemgetter(*got[0]), got))
            sums += len(list(map(math.fsum, zip(*rows, strict=True))))
    del by_step  # the decoded events freed: part of any reduction's cost
    took = time.process_time() - t0
    return Row("limit: decode + route + fsum per (step, name)", f"{sums:,} sums", took,
               values / took, note="a reduction's floor in Python, CPU in-process")  # fmt: skip


def _numpy_limit(ranks: int, steps: int, metrics: int) -> Row:
    """The mean over ranks of every (step, metric), from an array already built."""
    import numpy as np

    arr = np.random.default_rng(0).random((steps, ranks, metrics))
    t0 = time.process_time()
    for _ in range(5):
        arr.mean(axis=1)
    took = (time.process_time() - t0) / 5
    return Row("limit: numpy mean over ranks", f"array {steps}x{ranks}x{metrics}", took,
               arr.size / took, note="arithmetic alone, no decoding")  # fmt: skip


# -- backends, direct -------------------------------------------------------------------


def _direct_mlflow(tmp: Path, steps: int) -> float:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'direct.db'}")
    exp = client.create_experiment("direct")
    run_id = client.create_run(exp).info.run_id
    keys = names(BACKEND_METRICS)
    ms = int(time.time() * 1000)
    metrics = [Metric(k, s + i * 0.25, ms + s, s) for s in range(steps) for i, k in enumerate(keys)]
    t0 = time.perf_counter()
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i : i + 1000], synchronous=True)
    return steps / (time.perf_counter() - t0)


def _direct_tensorboard(tmp: Path, steps: int) -> float:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(tmp / "tb-direct"))
    keys = names(BACKEND_METRICS)
    now = time.time()
    t0 = time.perf_counter()
    for s in range(steps):
        summary = Summary(value=[Summary.Value(tag=k, simple_value=s + i * 0.25)
                                 for i, k in enumerate(keys)])  # fmt: skip
        writer.add_event(Event(wall_time=now + s, step=s, summary=summary))
    writer.close()
    return steps / (time.perf_counter() - t0)


def _direct_wandb(tmp: Path, steps: int) -> float:
    import wandb

    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True,
                              disable_git=True, reinit="create_new")  # fmt: skip
    run = wandb.init(mode="offline", dir=str(tmp), project="bench-direct", settings=settings)
    keys = names(BACKEND_METRICS)
    t0 = time.perf_counter()
    for s in range(steps):
        run.log({k: s + i * 0.25 for i, k in enumerate(keys)}, step=s)
    run.finish()
    return steps / (time.perf_counter() - t0)


DIRECT: Final[dict[str, Callable[[Path, int], float]]] = {
    "mlflow": _direct_mlflow,
    "tensorboard": _direct_tensorboard,
    "wandb": _direct_wandb,
}
SPECS: Final = {
    "mlflow": "mlflow:sqlite:///{tmp}/ranklog.db",
    "tensorboard": "tensorboard:{tmp}/tb",
    "wandb": "wandb:bench",
}


@contextlib.contextmanager
def _tuned(kind: str | None = None) -> Iterator[None]:
    """The collector tuned as `ranklog ship` tunes its process, for what runs in this one
    (a backend's own client, the profile): the backend imported, everything frozen, full
    collections rare."""
    if kind is not None:
        importlib.import_module(kind)
    gc.collect()
    gc.freeze()
    before = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def _bench_backends(base: Path, steps: int) -> tuple[list[Row], list[Check]]:
    """Each backend: ranklog's target and the backend's own client, same steps and metrics.

    The client is timed from its first logging call (its store, experiment and run made
    before). The shipper's run pays for importing the backend and making those; that
    fixed part is measured on a 1-step spool into a fresh store, and the figure is
    ``steps / (wall - fixed)``: the same scope as the client's. End-to-end wall is shown
    too. Each is the median of :data:`ROUNDS` interleaved rounds.
    """
    rows, checks = [], []
    size = f"{steps:,} steps x {BACKEND_METRICS} metrics ({BACKEND_RANKS} ranks reduced)"
    for kind, direct in DIRECT.items():
        fixes, runs, clients = [], [], []
        why = ""
        for _ in range(ROUNDS):  # interleaved rounds, medians: this machine is noisy
            with tempfile.TemporaryDirectory(prefix=f"backend-{kind}-", dir=base) as name:
                tmp = Path(name)
                first = tmp / "fixed"
                first.mkdir()
                write_spool(first / "spool", BACKEND_RANKS, 1, BACKEND_METRICS)
                opts = {"mode": "offline", "dir": str(first)} if kind == "wandb" else {}
                fixes.append(_ship(first / "spool", SPECS[kind].format(tmp=first), opts))
                spool = tmp / "spool"
                write_spool(spool, BACKEND_RANKS, steps, BACKEND_METRICS)
                opts = {"mode": "offline", "dir": str(tmp)} if kind == "wandb" else {}
                runs.append(_ship(spool, SPECS[kind].format(tmp=tmp), opts))
                try:
                    with _tuned(kind):
                        clients.append(direct(tmp, steps))
                except Exception as exc:  # a backend missing here: say so, keep going
                    clients.append(float("nan"))
                    why = f"direct client failed: {short(str(exc))}"
        ok = all(r.ok for r in runs + fixes)
        fixed = fixes[0] if not ok else sorted(fixes, key=lambda r: r.wall)[len(fixes) // 2]
        run = runs[0] if not ok else sorted(runs, key=lambda r: r.wall)[len(runs) // 2]
        ours = (steps - 1) / max(run.wall - fixed.wall, 1e-9) if ok else 0.0
        theirs = sorted(clients)[len(clients) // 2]
        note = (
            f"FAILED: {run.error or fixed.error}" if not ok
            else f"reading, reducing, writing; wall {run.wall:.2f} s end to end "
            f"({steps / run.wall:,.0f} steps/s), of which {fixed.wall:.2f} s fixed "
            "(import, store, run)"
        )  # fmt: skip
        rows.append(Row(f"ranklog ship ({kind})", size, run.wall - fixed.wall, None, ours,
                        run.rss_mb, note))  # fmt: skip
        rows.append(Row(f"{kind} client direct", size, steps / theirs if theirs else None, None,
                        theirs, None, why or "in-process, from the first log call"))  # fmt: skip
        ratio = ours / theirs if theirs == theirs and theirs else float("nan")
        checks.append(Check(f"{kind} reduced steps/s", f"{ours:,.0f} steps/s",
                            f">= {TARGET_STEPS[kind]:,}",
                            f"client direct {theirs:,.0f} steps/s (ratio {ratio:.2f})",
                            ours >= TARGET_STEPS[kind]))  # fmt: skip
    return rows, checks


# -- scale ------------------------------------------------------------------------------


def _scale_row(base: Path, ranks: int, steps: int, metrics: int, label: str) -> Row:
    values = ranks * steps * metrics
    with tempfile.TemporaryDirectory(prefix="scale-", dir=base) as name:
        tmp = Path(name)
        write_spool(tmp / "spool", ranks, steps, metrics)
        run = _ship(tmp / "spool", f"jsonl:{tmp / 'out.jsonl'}")
    note = "values per CPU-s; steps/s of wall time" if run.ok else f"FAILED: {run.error}"
    return Row(label, f"{ranks:,} ranks x {steps:,} steps x {metrics:,} metrics", run.cpu,
               values / run.cpu if run.ok else None, steps / run.wall if run.ok else None,
               run.rss_mb, note)  # fmt: skip


#: one case beyond this machine's habit (issue 32): ranks x steps x metrics
BEYOND: Final = (16_384, 2, 100)


def _beyond_rows(base: Path) -> list[Row]:
    """16,384 ranks x 2 steps x 100 metrics: shipped live, compacted and replayed, each as
    a CLI command in a child (wall time, CPU, peak RSS); replay checked against live."""
    ranks, steps, metrics = BEYOND
    values = ranks * steps * metrics
    size = f"{ranks:,} ranks x {steps} steps x {metrics} metrics"
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="beyond-", dir=base) as name:
        tmp = Path(name)
        write_spool(tmp / "spool", ranks, steps, metrics)
        cli = [sys.executable, "-m", "ranklog.cli"]
        live, again = tmp / "live.jsonl", tmp / "replay.jsonl"
        for label, cmd in (
            ("live: ship --once", [*cli, "ship", str(tmp / "spool"), "--to", f"jsonl:{live}",
                                   "--once", "--quiet"]),
            ("compact", [*cli, "compact", str(tmp / "spool"), "--out", str(tmp / "ds")]),
            ("replay", [*cli, "replay", str(tmp / "ds"), "--to", f"jsonl:{again}"]),
        ):  # fmt: skip
            run = run_measured(cmd, tmp, 900)
            same = label != "replay" or (
                again.is_file() and live.read_bytes() == again.read_bytes()
            )
            ok = run.returncode == 0 and same
            note = f"wall {run.wall_s:.2f} s, CLI (interpreter start included)"
            if label == "replay":
                note += "; JSONL byte-identical to live" if same else "; FAILED: differs from live"
            if run.returncode:
                note = f"FAILED: {short(run.stderr)}"
            rate_ = values / run.wall_s if ok else None
            steps_ = steps / run.wall_s if ok else None
            rows.append(Row(f"{label}, {ranks:,} ranks", size, run.wall_s, rate_, steps_,
                            run.maxrss_mb, note))  # fmt: skip
    return rows


def _bench_scale(base: Path, quick: bool) -> list[Row]:
    k = 10 if quick else 1
    rows = [
        _scale_row(base, r, s // k if r < 1024 else s, 100, f"ranks: {r:,}")
        for r, s in ((1, 2_000), (64, 200), (1_024, 20), (4_096, 10))
    ]
    rows += [
        _scale_row(base, 64, s // k if m < 1000 else s, m, f"metrics per step: {m:,}")
        for m, s in ((10, 2_000), (100, 200), (1_000, 20))
    ]
    if not quick:
        rows += _beyond_rows(base)
    return rows


def _profile(base: Path, ranks: int, steps: int, top: int = 12) -> list[str]:
    """Top functions (own time) of an in-process shipper over a generated spool."""
    from ranklog.shippers import Shipper
    from ranklog.shippers.targets.jsonl import JsonlTarget

    with tempfile.TemporaryDirectory(prefix="profile-", dir=base) as name:
        tmp = Path(name)
        write_spool(tmp / "spool", ranks, steps)
        shipper = Shipper(str(tmp / "spool"), JsonlTarget(tmp / "out.jsonl"), name="p",
                          dead_after=3600, start_grace=0)  # fmt: skip
        with _tuned():
            return profile_lines(
                lambda: shipper.run_forever(once=True),
                f"Profile of the shipper ({ranks} ranks x {steps} steps)",
                top,
            )


# -- output -----------------------------------------------------------------------------


def _table(rows: Sequence[Row]) -> list[str]:
    lines = ["| benchmark | size | s | values/s | steps/s | peak RSS MB | note |",
             "|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.name} | {r.size} | {fmt(r.seconds)} | {rate(r.values_per_s)} "
                     f"| {fmt(r.steps_per_s)} | {fmt(r.rss_mb, 1)} | {r.note} |")  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller spools")
    parser.add_argument("--tmp-dir", type=Path, default=None, help="where spools go")
    parser.add_argument("--json", type=Path, default=None, help="merge figures into this file")
    args = parser.parse_args(argv)
    base = Path(args.tmp_dir or tempfile.gettempdir()).resolve()
    ranks, steps = 64, 200 if args.quick else 1_000
    values = ranks * steps * 20
    with tempfile.TemporaryDirectory(prefix="limits-", dir=base) as name:
        spool = Path(name) / "spool"
        write_spool(spool, ranks, steps)
        live = _ship(spool, f"jsonl:{Path(name) / 'out.jsonl'}")
        decode = _decode_limit(spool, values)
        floor = _python_limit(spool, values)
    ship_row = Row("ranklog ship (jsonl)", f"{ranks} ranks x {steps:,} steps x 20 metrics",
                   live.cpu, values / live.cpu, steps / live.wall, live.rss_mb,
                   "values per CPU-s of run_forever in a child")  # fmt: skip
    limits = [ship_row, decode, floor, _numpy_limit(ranks, steps, 20)]
    backend_rows, checks = _bench_backends(base, 250 if args.quick else 1_000)
    scale = _bench_scale(base, args.quick)
    big = next(r for r in scale if r.name == "ranks: 4,096")
    checks.insert(0, Check("shipper values/s (JSONL)", f"{rate(ship_row.values_per_s)}/s",
                           f">= {TARGET_SHIP / 1e6:g} M/s",
                           f"read+decode {rate(decode.values_per_s)}/s, + route + fsum "
                           f"{rate(floor.values_per_s)}/s, numpy mean "
                           f"{rate(limits[3].values_per_s)}/s",
                           (ship_row.values_per_s or 0) >= TARGET_SHIP))  # fmt: skip
    checks.append(Check("4,096 ranks x 100 metrics: reduced steps/s", f"{fmt(big.steps_per_s)}",
                        ">= 1 (a step a second produced)", "-",
                        (big.steps_per_s or 0) >= 1))  # fmt: skip
    lines = ["# ranklog: limits, backends' own clients, scale", "", "## Limits", "",
             *_table(limits), "", "## Backends", "", *_table(backend_rows), "", "## Scale", "",
             *_table(scale), "", "## Targets", "",
             "| figure | measured | anchor | limit (same run) | verdict |",
             "|---|---:|---|---|---|"]  # fmt: skip
    lines += [f"| {c.what} | {c.figure} | {c.anchor} | {c.limit} | {verdict(c.ok)} |"
              for c in checks]  # fmt: skip
    if not checks[0].ok:
        lines += _profile(base, ranks, steps)
    print("\n".join(lines), flush=True)
    write_json(args.json, "scale", [*limits, *backend_rows, *scale], checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
