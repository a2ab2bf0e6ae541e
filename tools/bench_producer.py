"""Benchmark ranklog's producer hot path against the loggers it replaces.

Run from the repository root::

    .venv/bin/python tools/bench_producer.py           # full run, a few minutes
    .venv/bin/python tools/bench_producer.py --quick   # smoke run, well under a minute
    .venv/bin/python tools/bench_producer.py --gpu     # only: GPU sampler on vs off (~2 min)

It prints one Markdown table measured in this run: ``Run.log_metrics`` (10 float
keys) at each durability level; the same 10 keys through ``wandb`` (offline),
TensorBoard's ``EventFileWriter`` and ``mlflow`` (sqlite store); ``Run.step_end``
alone at each durability level; and the time of ``import ranklog`` in a fresh
interpreter. ``--gpu`` prints another table instead: ``log_metrics`` with the GPU
sampler off and on (every 0.1 s, to exaggerate), runs interleaved, medians over runs.
Every call is timed on its own with ``time.perf_counter_ns`` while
the garbage collector is paused. The targets are checked at the end.

This is a developer tool, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (
    clock_overhead_ns,
    fmt,
    gc_paused,
    percentile,
    time_calls,
    verdict,
    version,
    write_json,
)

if TYPE_CHECKING:
    from ranklog import Durability

KEYS: Final = (
    "train/loss",
    "train/accuracy",
    "train/lr",
    "train/grad_norm",
    "train/tokens_per_s",
    "train/loss_scale",
    "train/mfu",
    "mem/allocated_gb",
    "mem/reserved_gb",
    "time/step_s",
)
CALLS_PER_STEP: Final = 100
HEAVY_MODULES: Final = (
    "pyarrow",
    "wandb",
    "mlflow",
    "tensorboard",
    "ray",
    "torch",
    "numpy",
    "pandas",
)
DURABILITIES: Final[tuple[Durability, ...]] = ("buffered", "step", "fsync")
PEER_VERSIONS: Final = ("ranklog", "wandb", "tensorboard", "mlflow")

TARGET_LOG_P50_US: Final = 3.0
TARGET_WANDB_RATIO: Final = 30.0
TARGET_STEP_END_P50_US: Final = 15.0
TARGET_IMPORT_MS: Final = 150.0

_IMPORT_PROBE: Final = (
    "import json, sys, time\n"
    "t = time.perf_counter()\n"
    "import ranklog\n"
    "dt = time.perf_counter() - t\n"
    f"heavy = [m for m in {HEAVY_MODULES!r} if m in sys.modules]\n"
    "print(json.dumps({'seconds': dt, 'heavy': heavy}))\n"
)


@dataclass(frozen=True)
class Budget:
    """Iteration counts for one run of the benchmark."""

    log_calls: int
    log_warmup: int
    step_end_calls: int
    step_end_seconds: float
    wandb_calls: int
    tensorboard_calls: int
    mlflow_calls: int
    peer_warmup: int
    import_runs: int
    gpu_rounds: int  # --gpu: runs per sampler mode, interleaved
    gpu_seconds: float  # --gpu: length of one run


FULL: Final = Budget(
    log_calls=20_000,
    log_warmup=2_000,
    step_end_calls=5_000,
    step_end_seconds=20.0,
    wandb_calls=3_000,
    tensorboard_calls=20_000,
    mlflow_calls=300,
    peer_warmup=50,
    import_runs=5,
    gpu_rounds=5,
    gpu_seconds=2.0,
)
QUICK: Final = Budget(
    log_calls=2_000,
    log_warmup=200,
    step_end_calls=500,
    step_end_seconds=3.0,
    wandb_calls=300,
    tensorboard_calls=2_000,
    mlflow_calls=30,
    peer_warmup=10,
    import_runs=3,
    gpu_rounds=3,
    gpu_seconds=0.5,
)


@dataclass(frozen=True)
class Row:
    """One line of the result table; times in microseconds, None when not measured."""

    name: str
    calls: int = 0
    p50_us: float | None = None
    p99_us: float | None = None
    mean_us: float | None = None
    note: str = ""
    comparable: bool = True  # whether the ratio to ranklog log_metrics means anything

    @classmethod
    def from_ns(cls, name: str, samples: Sequence[int], note: str = "") -> Row:
        ordered = sorted(samples)
        return cls(
            name,
            len(ordered),
            percentile(ordered, 0.50) / 1e3,
            percentile(ordered, 0.99) / 1e3,
            statistics.fmean(ordered) / 1e3,
            note,
        )


@dataclass(frozen=True)
class ImportResult:
    """``import ranklog`` in fresh interpreters."""

    median_ms: float
    runs_ms: list[float]
    heavy: list[str]


def _payloads(count: int = 64, seed: int = 0) -> list[dict[str, float]]:
    """Distinct 10-key dicts of floats, cycled through by every benchmark."""
    rng = random.Random(seed)
    return [{key: rng.uniform(0.0, 10.0) for key in KEYS} for _ in range(count)]


# -- ranklog ----------------------------------------------------------------------------


def _bench_log_metrics(base: Path, durability: Durability, budget: Budget) -> Row:
    """``log_metrics`` of 10 keys; the step advances every CALLS_PER_STEP calls, no step_end."""
    import ranklog

    payloads = _payloads()
    with tempfile.TemporaryDirectory(prefix=f"log-{durability}-", dir=base) as spool:
        run = ranklog.init(spool, rank=0, world_size=1, durability=durability)
        log = run.log_metrics
        clock = time.perf_counter_ns
        for i in range(budget.log_warmup):
            log(payloads[i % len(payloads)], step=i // CALLS_PER_STEP)
        first_step = budget.log_warmup // CALLS_PER_STEP + 1
        samples = [0] * budget.log_calls
        with gc_paused():
            for i in range(budget.log_calls):
                metrics = payloads[i % len(payloads)]
                step = first_step + i // CALLS_PER_STEP
                t0 = clock()
                log(metrics, step=step)
                samples[i] = clock() - t0
        run.close()
    return Row.from_ns(f"ranklog log_metrics ({durability})", samples)


def _bench_step_end(base: Path, durability: Durability, budget: Budget) -> Row:
    """``step_end`` alone; one untimed 1-key ``log_metrics`` precedes each call."""
    import ranklog

    with tempfile.TemporaryDirectory(prefix=f"step-{durability}-", dir=base) as spool:
        run = ranklog.init(spool, rank=0, world_size=1, durability=durability)
        log, step_end = run.log_metrics, run.step_end
        clock = time.perf_counter_ns
        warmup = max(10, budget.step_end_calls // 20)
        for step in range(warmup):
            log({"train/loss": 1.0}, step=step)
            step_end(step)
        samples: list[int] = []
        deadline = time.monotonic() + budget.step_end_seconds
        with gc_paused():
            for step in range(warmup, warmup + budget.step_end_calls):
                log({"train/loss": float(step)}, step=step)
                t0 = clock()
                step_end(step)
                samples.append(clock() - t0)
                if time.monotonic() > deadline:
                    break
        run.close()
    note = "" if len(samples) == budget.step_end_calls else "stopped by the time limit"
    return Row.from_ns(f"ranklog step_end ({durability})", samples, note)


def _measure_import(runs: int) -> ImportResult:
    """``import ranklog`` in ``runs`` fresh interpreters; the heavy modules it pulled in."""
    seconds: list[float] = []
    heavy: set[str] = set()
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", _IMPORT_PROBE],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        seconds.append(result["seconds"])
        heavy.update(result["heavy"])
    runs_ms = [s * 1e3 for s in seconds]
    return ImportResult(statistics.median(runs_ms), runs_ms, sorted(heavy))


# -- the GPU sampler: log_metrics with it off and on -----------------------------------

GPU_INTERVAL: Final = 0.1  # seconds: 100x the default, to exaggerate the sampler's cost
FAKE_GPUS: Final = 8
NVML_READINGS: Final = 6  # per GPU: handle, utilization, memory, temperature, power, name
DRIVER_WAIT_S: Final = 20e-6  # asked of time.sleep per reading; Linux rounds up to ~70 µs
#: the main thread between steps (every CALLS_PER_STEP calls): never lets go of the GIL
#: ("tight": the sampler thread waits a switch interval, 5 ms, for every GIL hand-back), or
#: sleeps 1 ms with it released, as a training loop does while it waits for the GPU
PACES: Final = {"tight": 0.0, "paced": 1e-3}
RAY_PROM: Final = Path(__file__).resolve().parent.parent / "tests" / "data" / "ray_metrics.prom"


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class FakeNvml:
    """A GPU source that costs what ``NvmlSource`` (pynvml) costs on an 8-GPU host.

    Per GPU, six readings, each one ctypes call that fills a struct (what a pynvml
    call does on the Python side) and then a wait with the GIL released (the driver
    round trip, during which ctypes releases the GIL as well); then one Gpu event.
    """

    name = "fake-nvml"

    def __init__(self, host: str = "bench", gpus: int = FAKE_GPUS) -> None:
        self.host, self.gpus = host, gpus
        self._clock = ctypes.CDLL(None, use_errno=True).clock_gettime
        self.calls = 0

    def _reading(self) -> int:
        ts = _Timespec()
        if self._clock(1, ctypes.byref(ts)) != 0:  # CLOCK_MONOTONIC
            raise OSError(ctypes.get_errno(), "clock_gettime")
        time.sleep(DRIVER_WAIT_S)
        return int(ts.tv_nsec)

    def sample(self) -> list[Any]:
        from ranklog.schemas import Gpu

        self.calls += 1
        now, out = time.time(), []
        for i in range(self.gpus):
            r = [self._reading() for _ in range(NVML_READINGS)]
            out.append(Gpu(now, self.host, i, float(r[1] % 101), r[2] % 2**36, 2**36,
                           float(r[3] % 90), float(r[4] % 700), None, "fake"))  # fmt: skip
        return out

    def close(self) -> None: ...


@contextlib.contextmanager
def _ray_endpoint(base: Path) -> Iterator[str]:
    """``http://127.0.0.1:PORT/metrics`` serving RAY_PROM, from a separate process
    (a Ray metrics agent is another process too)."""
    with tempfile.TemporaryDirectory(prefix="ray-metrics-", dir=base) as tmp:
        (Path(tmp) / "metrics").write_bytes(RAY_PROM.read_bytes())
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
             "--directory", tmp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=1) as resp:
                        resp.read()
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise
                    time.sleep(0.05)
            yield url
        finally:
            server.terminate()
            server.wait(5)


def _ray_source(url: str) -> Any:
    """ranklog's RaySource, reading ``url`` instead of asking Ray for its nodes."""
    from ranklog.producer._gpu import RaySource

    class LocalRay(RaySource):
        calls = 0

        def endpoints(self) -> list[tuple[str, str]]:
            return [("127.0.0.1", url)]

        def sample(self) -> list[Any]:
            self.calls += 1
            return super().sample()

    return LocalRay()


@dataclass(frozen=True)
class GpuRun:
    """One timed run of log_metrics; times in microseconds."""

    calls: int
    p50: float
    p99: float
    p999: float
    max: float
    samples: int  # GPU samples the sampler took during the run


def _log_with_sampler(base: Path, source: Any, seconds: float, pause: float) -> GpuRun:
    """``log_metrics`` of 10 keys for ``seconds`` (durability step), each call timed; every
    CALLS_PER_STEP calls, untimed: ``step_end`` (so the buffer never fills up and makes a
    call wait for the disk) and ``pause`` seconds of GIL-free sleep."""
    import ranklog

    payloads = _payloads()
    with tempfile.TemporaryDirectory(prefix="gpu-", dir=base) as spool:
        run = ranklog.init(spool, rank=0, world_size=1, local_rank=0, handle_signals=False,
                           gpu="off" if source is None else source,
                           gpu_interval=GPU_INTERVAL)  # fmt: skip
        log, clock = run.log_metrics, time.perf_counter_ns
        for i in range(2_000):
            log(payloads[i % len(payloads)], step=i // CALLS_PER_STEP)
        first = 2_000 // CALLS_PER_STEP + 1
        before = 0 if source is None else source.calls
        samples: list[int] = []
        append = samples.append
        deadline = clock() + int(seconds * 1e9)
        with gc_paused():
            i = 0
            while True:
                t0 = clock()
                log(payloads[i & 63], step=first + i // CALLS_PER_STEP)
                t1 = clock()
                append(t1 - t0)
                i += 1
                if t1 > deadline:
                    break
                if i % CALLS_PER_STEP == 0:  # a step ends: its bytes go to the OS (untimed)
                    run.step_end(first + i // CALLS_PER_STEP - 1)
                    if pause:
                        time.sleep(pause)
        taken = 0 if source is None else source.calls - before
        run.close()
    ordered = sorted(samples)
    return GpuRun(len(ordered), percentile(ordered, 0.5) / 1e3, percentile(ordered, 0.99) / 1e3,
                  percentile(ordered, 0.999) / 1e3, ordered[-1] / 1e3, taken)  # fmt: skip


def _sample_cost_us(source: Any, n: int = 30) -> float:
    """Median wall time of one ``sample()`` with nothing else running, in microseconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        source.sample()
        times.append(time.perf_counter_ns() - t0)
    source.calls -= n
    return statistics.median(times) / 1e3


def _bench_gpu_sampler(base: Path, budget: Budget, quick: bool) -> list[str]:
    """The --gpu table: off and each source, runs interleaved (rotated order), medians."""
    with contextlib.ExitStack() as stack:
        modes: list[tuple[str, Any, str]] = [("off", None, 'gpu="off": no sampler thread')]
        fake = FakeNvml()
        modes.append(("on: fake-nvml", fake, f"{FAKE_GPUS} GPUs x {NVML_READINGS} ctypes "
                      f"calls + GIL-free sleep({DRIVER_WAIT_S * 1e6:.0f} µs) each"))  # fmt: skip
        try:
            ray = _ray_source(stack.enter_context(_ray_endpoint(base)))
            modes.append(("on: ray-http", ray, f"RaySource over HTTP to a local server of "
                          f"tests/data/ray_metrics.prom ({len(RAY_PROM.read_text().splitlines())}"
                          " lines, 2 nodes x 2 GPUs)"))  # fmt: skip
        except Exception as exc:  # no ray installed, no port
            print(f"(ray-http left out: {type(exc).__name__}: {exc})", file=sys.stderr)
        cost = {name: _sample_cost_us(src) for name, src, _ in modes if src is not None}
        runs: dict[tuple[str, str], list[GpuRun]] = {}
        for r in range(budget.gpu_rounds):
            k = r % len(modes)
            for pace, pause in PACES.items():
                for name, src, _ in modes[k:] + modes[:k]:
                    got = _log_with_sampler(base, src, budget.gpu_seconds, pause)
                    runs.setdefault((pace, name), []).append(got)

    def med(key: tuple[str, str], field: str) -> str:
        values = [getattr(x, field) for x in runs[key]]
        return f"{fmt(statistics.median(values))} [{fmt(min(values))}..{fmt(max(values))}]"

    expected = budget.gpu_seconds / GPU_INTERVAL
    lines = [
        f"# ranklog log_metrics with the GPU sampler off / on{' (--quick)' if quick else ''}",
        "",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; no GPU: the sources below stand in for one",
        f"- {budget.gpu_rounds} runs per mode of {budget.gpu_seconds:g} s each, modes "
        "interleaved (order rotated every round); 10 float keys per call, durability step, "
        f"GC paused; sampler interval {GPU_INTERVAL:g} s (default 10 s)",
        f"- loop: step_end (untimed) every {CALLS_PER_STEP} calls; tight = calls back to back, "
        "the main thread never releases the GIL; paced = "
        f"{PACES['paced'] * 1e3:g} ms GIL-free sleep (untimed) every {CALLS_PER_STEP} calls, "
        "as while a training step waits for the GPU",
        "- cells: median over runs [min..max over runs] of each run's percentile, µs",
        "",
        "| loop | sampler | calls/run | p50 µs | p99 µs | p99.9 µs | max µs "
        f"| samples/run (of {expected:g}) | sample() alone µs | source |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for pace in PACES:
        for name, _, what in modes:
            key = (pace, name)
            samples = statistics.median(x.samples for x in runs[key])
            lines.append(
                f"| {pace} | {name} | {statistics.median(x.calls for x in runs[key]):,.0f} "
                f"| {med(key, 'p50')} | {med(key, 'p99')} | {med(key, 'p999')} "
                f"| {med(key, 'max')} | {'-' if name == 'off' else f'{samples:g}'} "
                f"| {fmt(cost.get(name))} | {what} |"
            )
    lines.append("")
    for pace in PACES:
        off = {f: statistics.median(getattr(x, f) for x in runs[(pace, "off")])
               for f in ("p50", "p99")}  # fmt: skip
        for name, _, _ in modes[1:]:
            on = {f: statistics.median(getattr(x, f) for x in runs[(pace, name)])
                  for f in ("p50", "p99")}  # fmt: skip
            lines.append(
                f"- {pace}, {name} vs off: median p50 {fmt(on['p50'])} vs {fmt(off['p50'])} µs "
                f"({(on['p50'] - off['p50']) * 1e3:+,.0f} ns), median p99 {fmt(on['p99'])} vs "
                f"{fmt(off['p99'])} µs"
            )
    return lines


# -- peers ------------------------------------------------------------------------------


def _bench_wandb(base: Path, budget: Budget) -> list[Row]:
    name = "wandb run.log (offline)"
    try:
        import wandb
    except ImportError:
        return [Row(name, note="not installed")]
    settings = wandb.Settings(
        silent=True,
        quiet=True,
        console="off",
        show_info=False,
        show_warnings=False,
        disable_git=True,
        disable_code=True,
        save_code=False,
        x_disable_stats=True,
        x_disable_meta=True,
        x_save_requirements=False,
    )
    payloads = _payloads()
    with tempfile.TemporaryDirectory(prefix="wandb-", dir=base) as tmp:
        run = wandb.init(mode="offline", dir=tmp, project="bench", settings=settings)
        try:
            samples = time_calls(
                lambda i: run.log(payloads[i % len(payloads)], step=i),
                budget.wandb_calls,
                budget.peer_warmup,
            )
        finally:
            run.finish()
            wandb.teardown()
    return [Row.from_ns(name, samples, "stats/meta/git/code capture off")]


def _bench_tensorboard(base: Path, budget: Budget) -> list[Row]:
    names = ("tensorboard add_event (prebuilt Event)", "tensorboard build Event + add_event")
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        return [Row(name, note="not installed") for name in names]

    def build(i: int, metrics: dict[str, float]) -> Any:
        values = [Summary.Value(tag=key, simple_value=value) for key, value in metrics.items()]
        return Event(wall_time=time.time(), step=i, summary=Summary(value=values))

    payloads = _payloads()
    prebuilt = [build(i, metrics) for i, metrics in enumerate(payloads)]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="tb-", dir=base) as tmp:
        writer = EventFileWriter(tmp)
        try:
            samples = time_calls(
                lambda i: writer.add_event(prebuilt[i % len(prebuilt)]),
                budget.tensorboard_calls,
                budget.peer_warmup,
            )
            rows.append(Row.from_ns(names[0], samples, "serialize + enqueue only"))
            samples = time_calls(
                lambda i: writer.add_event(build(i, payloads[i % len(payloads)])),
                budget.tensorboard_calls,
                budget.peer_warmup,
            )
            rows.append(Row.from_ns(names[1], samples, "what add_scalar x10 has to do"))
        finally:
            writer.close()
    return rows


def _bench_mlflow(base: Path, budget: Budget) -> list[Row]:
    name = "mlflow log_metrics (sqlite)"
    try:
        import mlflow
    except ImportError:
        return [Row(name, note="not installed")]
    _silence_loggers()  # mlflow installs its own handlers and levels on import
    payloads = _payloads()
    with tempfile.TemporaryDirectory(prefix="mlflow-", dir=base) as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        os.environ["MLFLOW_TRACKING_URI"] = uri
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("bench")
        try:
            with mlflow.start_run():
                samples = time_calls(
                    lambda i: mlflow.log_metrics(payloads[i % len(payloads)], step=i),
                    budget.mlflow_calls,
                    budget.peer_warmup,
                )
        finally:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
    return [Row.from_ns(name, samples, "synchronous; tracking store in a temp dir")]


# -- NeMo RL: the drop-in against direct fan-out to the three backends -------------------


def _bench_nemo(base: Path, budget: Budget) -> list[Row]:
    """One NeMo-style ``log_metrics(metrics, step, prefix, step_finished=True)`` per step.

    ranklog's drop-in writes the step to its spool (durability ``step``); shipping to
    the backends happens in other processes. NeMo RL's own ``Logger`` calls each
    enabled backend in the training process: ``wandb.log``, TensorBoard's
    ``SummaryWriter.add_scalar`` per value, ``mlflow.log_metrics``.
    """
    from ranklog.nemo import Logger

    payloads = _payloads()
    calls = budget.mlflow_calls
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="nemo-", dir=base) as tmp:
        cfg = {"log_dir": tmp, "wandb_enabled": False, "swanlab_enabled": False,
               "tensorboard_enabled": False, "mlflow_enabled": False, "monitor_gpus": False,
               "wandb": {}, "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
               "ranklog": {"rank": 0, "world_size": 1}}  # fmt: skip
        logger = Logger(cfg)  # type: ignore[arg-type]
        samples = time_calls(
            lambda i: logger.log_metrics(payloads[i % len(payloads)], i, "train", None, True),
            calls * 10,
            budget.peer_warmup,
        )
        logger.finish()
        rows.append(Row.from_ns("ranklog.nemo Logger.log_metrics, step_finished", samples,
                                "spool only; shippers run in other processes"))  # fmt: skip
    rows.append(_bench_nemo_direct(base, budget))
    return rows


def _bench_nemo_direct(base: Path, budget: Budget) -> Row:
    name = "NeMo-style direct: wandb.log + add_scalar x10 + mlflow.log_metrics"
    try:
        import mlflow
        import wandb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        return Row(name, note="a backend is not installed")
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    _silence_loggers()
    payloads = _payloads()
    with tempfile.TemporaryDirectory(prefix="nemo-direct-", dir=base) as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("bench-nemo")
        writer = EventFileWriter(tmp)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        run = wandb.init(mode="offline", dir=tmp, project="bench-nemo", settings=settings)

        def add_scalar(tag: str, value: float, step: int) -> None:  # SummaryWriter.add_scalar
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
            writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

        def log(i: int) -> None:
            metrics = {f"train/{k}": v for k, v in payloads[i % len(payloads)].items()}
            run.log(metrics, step=i)
            for tag, value in metrics.items():
                add_scalar(tag, value, i)
            mlflow.log_metrics(metrics, step=i)

        try:
            with mlflow.start_run():
                samples = time_calls(log, budget.mlflow_calls, budget.peer_warmup)
        finally:
            writer.close()
            run.finish()
            wandb.teardown()
    return Row.from_ns(name, samples, "all three in the training process, as NeMo RL does")


def _run_peer(bench: Callable[[Path, Budget], list[Row]], base: Path, budget: Budget) -> list[Row]:
    """Run one peer benchmark; a peer that breaks gives a row saying so, not a crash."""
    try:
        return bench(base, budget)
    except Exception as exc:
        label = bench.__name__.removeprefix("_bench_")
        return [Row(label, note=f"failed: {type(exc).__name__}: {exc}"[:120])]


# -- output -----------------------------------------------------------------------------


def _quiet_peers() -> None:
    """Keep wandb, mlflow and alembic from drowning the table in log lines."""
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    os.environ.setdefault("WANDB_DISABLE_GIT", "true")
    os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    warnings.filterwarnings("ignore", module=r"(wandb|mlflow|alembic|sqlalchemy|google)\b.*")
    _silence_loggers()


def _silence_loggers() -> None:
    """Raise the peers' logger levels; again after an import that configures its own."""
    for logger in ("wandb", "mlflow", "alembic", "sqlalchemy", "tensorboard", "git"):
        logging.getLogger(logger).setLevel(logging.ERROR)


def _header(budget: Budget, base: Path, quick: bool) -> list[str]:
    versions = ", ".join(f"{name} {version(name)}" for name in PEER_VERSIONS)
    return [
        f"# ranklog producer benchmark{' (--quick)' if quick else ''}",
        "",
        f"- machine: {platform.platform()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"- versions: {versions}",
        f"- temp dir: {base}; 10 float keys per call; GC paused while timing; "
        f"clock overhead ~{clock_overhead_ns():.0f} ns per call (not subtracted)",
        f"- calls: log_metrics {budget.log_calls} (step advances every {CALLS_PER_STEP}), "
        f"step_end {budget.step_end_calls}, wandb {budget.wandb_calls}, "
        f"tensorboard {budget.tensorboard_calls}, mlflow {budget.mlflow_calls}",
        "",
    ]


def _table(rows: Sequence[Row], reference_p50: float | None) -> list[str]:
    lines = [
        "| benchmark | calls | p50 µs | p99 µs | mean µs | p50 / ranklog(step) | note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        ratio = "-"
        if row.comparable and row.p50_us is not None and reference_p50:
            ratio = f"{row.p50_us / reference_p50:,.1f}x"
        lines.append(
            f"| {row.name} | {row.calls or '-'} | {fmt(row.p50_us)} | {fmt(row.p99_us)} "
            f"| {fmt(row.mean_us)} | {ratio} | {row.note} |"
        )
    return lines


def _p50(rows: Sequence[Row], name: str) -> float | None:
    return next((row.p50_us for row in rows if row.name == name), None)


#: the checks of the last _targets call, for --json
_CHECKS: list[dict[str, object]] = []


def _targets(rows: Sequence[Row], imported: ImportResult) -> list[str]:
    log_p50 = _p50(rows, "ranklog log_metrics (step)")
    wandb_p50 = _p50(rows, "wandb run.log (offline)")
    step_p50 = _p50(rows, "ranklog step_end (step)")
    ratio = wandb_p50 / log_p50 if wandb_p50 is not None and log_p50 else None
    checks = [
        (
            f"log_metrics p50 <= {TARGET_LOG_P50_US:g} µs per 10-key call (durability=step)",
            f"{fmt(log_p50)} µs",
            None if log_p50 is None else log_p50 <= TARGET_LOG_P50_US,
        ),
        (
            f">= {TARGET_WANDB_RATIO:g}x below wandb run.log p50",
            "-" if ratio is None else f"{ratio:,.1f}x",
            None if ratio is None else ratio >= TARGET_WANDB_RATIO,
        ),
        (
            f"step_end p50 <= {TARGET_STEP_END_P50_US:g} µs (durability=step)",
            f"{fmt(step_p50)} µs",
            None if step_p50 is None else step_p50 <= TARGET_STEP_END_P50_US,
        ),
        (
            f"import ranklog < {TARGET_IMPORT_MS:g} ms",
            f"{imported.median_ms:.1f} ms",
            imported.median_ms < TARGET_IMPORT_MS,
        ),
        (
            "no heavy module after import ranklog",
            ", ".join(imported.heavy) or "none",
            not imported.heavy,
        ),
    ]
    _CHECKS[:] = [{"what": what, "figure": got, "ok": ok} for what, got, ok in checks]
    lines = ["", "## Targets", ""]
    lines += [f"- {verdict(ok)}: {what}: {got}" for what, got, ok in checks]
    if ratio is not None:
        lines.append(
            f"\nwandb run.log p50 / ranklog log_metrics(step) p50 = {ratio:,.1f}x "
            f"({fmt(wandb_p50)} µs / {fmt(log_p50)} µs)"
        )
    return lines


def _import_row(imported: ImportResult) -> Row:
    runs = ", ".join(f"{ms:.1f}" for ms in imported.runs_ms)
    heavy = ", ".join(imported.heavy) or "none"
    return Row(
        "import ranklog (fresh interpreter)",
        len(imported.runs_ms),
        imported.median_ms * 1e3,
        note=f"median of {runs} ms; heavy modules loaded: {heavy}",
        comparable=False,
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="few iterations: a smoke run in well under a minute"
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="only log_metrics with the GPU sampler off vs on (a fake source, no GPU needed)",
    )
    parser.add_argument(
        "--tmp-dir",
        type=Path,
        default=None,
        help="where the spools and peer files go (default: the system temp dir)",
    )
    parser.add_argument("--json", type=Path, default=None, help="merge figures into this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    budget = QUICK if args.quick else FULL
    _quiet_peers()
    base = Path(args.tmp_dir or tempfile.gettempdir()).resolve()
    base.mkdir(parents=True, exist_ok=True)
    if args.gpu:
        print("\n".join(_bench_gpu_sampler(base, budget, args.quick)), flush=True)
        return 0
    lines = _header(budget, base, args.quick)
    imported = _measure_import(budget.import_runs)
    rows = [_bench_log_metrics(base, level, budget) for level in DURABILITIES]
    for bench in (_bench_wandb, _bench_tensorboard, _bench_mlflow):
        rows += _run_peer(bench, base, budget)
    rows += [_bench_step_end(base, level, budget) for level in DURABILITIES]
    rows += _run_peer(_bench_nemo, base, budget)
    rows.append(_import_row(imported))
    lines += _table(rows, _p50(rows, "ranklog log_metrics (step)"))
    lines += _targets(rows, imported)
    print("\n".join(lines), flush=True)
    write_json(args.json, "producer", rows, _CHECKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
