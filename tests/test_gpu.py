"""GPU sampling: the NVML and Ray sources, the sampler thread, one sampler per host."""

from __future__ import annotations

import http.server
import logging
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ranklog.errors import ConfigError, ExtraMissingError, RanklogWarning
from ranklog.producer._gpu import (
    MIB,
    GpuSampler,
    HostMemory,
    NvmlSource,
    RaySource,
    backoff,
    elect_sampler,
    node_metrics,
    open_source,
    parse_prometheus,
    parse_prometheus_text,
    release_election,
)
from ranklog.schemas import Gpu

from .conftest import run_python

FIXTURE = Path(__file__).parent / "data" / "ray_metrics.prom"
H100_TOTAL = 85_520_809_984  # bytes, as NVML reports an H100 80GB HBM3 (81559 MiB)


class NVMLError(Exception):
    """pynvml's base error class."""


def fake_pynvml(
    count: int = 2, *, init_error: bool = False, broken: dict[str, set[int]] | None = None
) -> types.ModuleType:
    """A stand-in for nvidia-ml-py: device 1 has no power reading; ``broken`` adds failures."""
    broken = broken or {}
    calls = {"init": 0, "shutdown": 0, "name": 0}

    def check(what: str, h: tuple[str, int]) -> int:
        if h[1] in broken.get(what, set()):
            raise NVMLError(f"{what}: Not Supported")
        return h[1]

    def init() -> None:
        if init_error:
            raise NVMLError("NVML Shared Library Not Found")
        calls["init"] += 1

    def shutdown() -> None:
        calls["shutdown"] += 1

    def memory(h: tuple[str, int]) -> types.SimpleNamespace:
        used = [73_348 * MIB, 3 * MIB][check("memory", h)]
        return types.SimpleNamespace(total=H100_TOTAL, used=used, free=H100_TOTAL - used)

    def temperature(h: tuple[str, int], sensor: int) -> int:
        assert sensor == 0  # NVML_TEMPERATURE_GPU
        return [64, 41][check("temp", h)]

    def power(h: tuple[str, int]) -> int:
        if h[1] == 1:
            raise NVMLError("Not Supported")
        return [312_456][check("power", h)]

    def name(h: tuple[str, int]) -> bytes | str:
        calls["name"] += 1
        return (b"NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3")[h[1]]

    mod = types.ModuleType("pynvml")
    mod.__dict__.update(
        NVMLError=NVMLError,
        NVML_TEMPERATURE_GPU=0,
        calls=calls,
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", check("handle", ("handle", i))),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(
            gpu=[87, 3][check("util", h)], memory=40
        ),
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetTemperature=temperature,
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetName=name,
    )
    return mod


def fake_ray(nodes: list[dict[str, Any]], *, initialized: bool = True, me: str = "a") -> Any:
    """A stand-in for ray: ``nodes()`` as given, this process on node ``me``."""
    mod = types.ModuleType("ray")
    context = types.SimpleNamespace(get_node_id=lambda: me)
    mod.__dict__.update(
        is_initialized=lambda: initialized,
        nodes=lambda: nodes,
        get_runtime_context=lambda: context,
    )
    return mod


@pytest.fixture
def no_gpu_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither pynvml nor ray can be imported."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "ray", None)


class FakeSource:
    """A source that fails its first ``fail`` samples, then returns one Gpu per call."""

    name = "fake"

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.calls: list[float] = []
        self.closed = False

    def sample(self) -> list[Gpu]:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.fail:
            raise OSError(f"endpoint timed out ({len(self.calls)})")
        return [Gpu(time.time(), "h", 0, util=50.0), Gpu(time.time(), "h", 1, util=60.0)]

    def close(self) -> None:
        self.closed = True


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class TestNvml:
    def test_two_devices_one_without_power(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Each GPU becomes one Gpu event in bytes, percent, °C and watts; no power is None."""
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
        before = time.time()
        g0, g1 = NvmlSource("node7").sample()
        assert g0 == Gpu(
            g0.ts, "node7", 0, 87.0, 73_348 * MIB, H100_TOTAL, 64.0, 312.456, None,
            "NVIDIA H100 80GB HBM3",
        )  # fmt: skip
        assert g1 == Gpu(
            g1.ts, "node7", 1, 3.0, 3 * MIB, H100_TOTAL, 41.0, None, None, "NVIDIA H100 80GB HBM3"
        )
        assert before <= g0.ts == g1.ts <= time.time()
        assert isinstance(g0.mem_used, int) and isinstance(g0.util, float)

    def test_each_failing_reading_is_none(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A reading that raises NVMLError is None; the other readings are kept."""
        broken = {"util": {0}, "memory": {1}, "temp": {1}}
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(broken=broken))
        g0, g1 = NvmlSource("n").sample()
        assert (g0.util, g0.mem_used, g0.temp) == (None, 73_348 * MIB, 64.0)
        assert (g1.util, g1.mem_used, g1.mem_total, g1.temp) == (3.0, None, None, None)

    def test_lost_gpu_and_lost_driver(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A GPU NVML cannot reach is skipped; a failing device count re-initialises NVML."""
        nv = fake_pynvml(broken={"handle": {0}})
        monkeypatch.setitem(sys.modules, "pynvml", nv)
        source = NvmlSource("n")
        assert [g.index for g in source.sample()] == [1]

        def driver_gone() -> int:
            raise NVMLError("Driver Not Loaded")

        monkeypatch.setattr(nv, "nvmlDeviceGetCount", driver_gone)
        with pytest.raises(NVMLError):
            source.sample()
        monkeypatch.setattr(nv, "nvmlDeviceGetCount", lambda: 2)
        assert len(source.sample()) == 1
        assert (nv.calls["init"], nv.calls["shutdown"]) == (2, 1)

    def test_init_once_shutdown_at_close(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """NVML is initialised once however often it is sampled, and shut down at close."""
        nv = fake_pynvml()
        monkeypatch.setitem(sys.modules, "pynvml", nv)
        source = NvmlSource("n")
        for _ in range(3):
            source.sample()
        source.close()
        source.close()
        assert nv.calls == {"init": 1, "shutdown": 1, "name": 6}

    def test_explicit_without_package(self, no_gpu_packages: None) -> None:
        """Asking for nvml without nvidia-ml-py names the extra to install."""
        with pytest.raises(ExtraMissingError, match=r"ranklog\[gpu\]"):
            GpuSampler(lambda e: None, source="nvml")
        with pytest.raises(ExtraMissingError, match=r"ranklog\[ray\]"):
            GpuSampler(lambda e: None, source="ray")


class TestAuto:
    def test_picks_nvml(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """With a GPU visible to NVML, auto samples through NVML."""
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
        assert GpuSampler(lambda e: None, host="n").source_name == "nvml"

    def test_nothing_to_sample(
        self, no_gpu_packages: None, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Without pynvml and ray, the sampler says so once and starts no thread."""
        got: list[Gpu] = []
        sampler = GpuSampler(got.append, interval=0.01)
        with caplog.at_level(logging.INFO, logger="ranklog"):
            sampler.start()
            sampler.start()
        assert sampler.source_name == "none"
        assert [r.message for r in caplog.records if "no GPU" in r.message] == [
            f"ranklog: no GPU to sample on {sampler.host} (no NVML device, no Ray)"
        ]
        assert sampler._thread is None
        sampler.stop()
        assert got == []

    def test_driver_missing_is_nothing(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """pynvml installed but no driver (nvmlInit fails), and no ray: nothing to sample."""
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=True))
        monkeypatch.setitem(sys.modules, "ray", None)
        assert open_source("auto", "n") is None

    def test_no_device_then_ray(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """No NVML device but an initialised Ray: auto reads Ray; an uninitialised one is none."""
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(count=0))
        monkeypatch.setitem(sys.modules, "ray", fake_ray([]))
        assert GpuSampler(lambda e: None).source_name == "ray"
        monkeypatch.setitem(sys.modules, "ray", fake_ray([], initialized=False))
        assert GpuSampler(lambda e: None).source_name == "none"

    def test_bad_arguments(self) -> None:
        """An unknown source name or a non-positive interval is a ConfigError."""
        with pytest.raises(ConfigError, match="gpu source"):
            GpuSampler(lambda e: None, source="rocm")
        for bad in (0, -1.0, math.nan, math.inf):
            with pytest.raises(ConfigError, match="interval"):
                GpuSampler(lambda e: None, source=FakeSource(), interval=bad)


class TestSampler:
    def test_appends_at_the_interval_and_stops(self) -> None:
        """Every 0.05 s each GPU is appended; after stop() nothing more arrives."""
        got: list[Gpu] = []
        source = FakeSource()
        sampler = GpuSampler(got.append, source=source, interval=0.05, host="h")
        assert sampler.source_name == "fake"
        t0 = time.monotonic()
        sampler.start()
        wait_for(lambda: len(source.calls) >= 1)
        assert source.calls[0] - t0 < 0.5  # the first sample is taken at once
        time.sleep(0.6)
        t1 = time.monotonic()
        sampler.stop()
        assert time.monotonic() - t1 < 1.0
        assert sampler._thread is not None and not sampler._thread.is_alive()
        assert source.closed
        n = len(source.calls)
        assert 6 <= n <= 16
        gaps = [b - a for a, b in zip(source.calls, source.calls[1:], strict=False)]
        assert min(gaps) >= 0.04
        assert len(got) == sampler.appended == 2 * n
        assert {e.index for e in got} == {0, 1} and all(e.step is None for e in got)
        time.sleep(0.2)
        assert len(got) == 2 * n and len(source.calls) == n

    def test_stop_is_quick_with_a_long_interval(self) -> None:
        """stop() does not wait for the interval to run out."""
        sampler = GpuSampler(lambda e: None, source=FakeSource(), interval=60)
        sampler.start()
        t0 = time.monotonic()
        sampler.stop()
        assert time.monotonic() - t0 < 1.0

    def test_backoff_schedule(self) -> None:
        """After n failures the wait is 2**n times the interval, at most 10 times."""
        assert [backoff(1.0, n) for n in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]

    def test_failing_source_backs_off_and_warns_once(self) -> None:
        """A source that raises is retried with growing waits, warned about once, never raised."""
        got: list[Gpu] = []
        source = FakeSource(fail=4)
        sampler = GpuSampler(got.append, source=source, interval=0.05)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler.start()
            wait_for(lambda: len(got) >= 4)
            sampler.stop()
        ours = [w for w in caught if issubclass(w.category, RanklogWarning)]
        assert len(ours) == 1
        assert "GPU sampling (fake) failed" in str(ours[0].message)
        assert "endpoint timed out (1)" in str(ours[0].message)
        gaps = [b - a for a, b in zip(source.calls, source.calls[1:], strict=False)]
        for gap, expected in zip(gaps, [0.1, 0.2, 0.4, 0.5], strict=False):
            assert gap >= expected * 0.9  # 2x, 4x, 8x, then capped at 10x
        assert gaps[3] < 0.75  # capped: uncapped would be 0.8
        assert sampler.failures == 0

    def test_failing_append_is_contained(self) -> None:
        """An append that raises is handled like a failing source: warned once, retried."""
        calls: list[Gpu] = []

        def append(e: Gpu) -> None:
            calls.append(e)
            raise RuntimeError("sink gone")

        sampler = GpuSampler(append, source=FakeSource(), interval=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler.start()
            wait_for(lambda: len(calls) >= 3)
            sampler.stop()
        assert len([w for w in caught if issubclass(w.category, RanklogWarning)]) == 1
        assert sampler._thread is not None and not sampler._thread.is_alive()


def expected_fixture_gpus() -> list[tuple[str, int, float | None, int, int, str]]:
    h100, a100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"
    return [
        ("10.0.0.11", 0, 97.0, 73_348 * MIB, 81_559 * MIB, h100),
        ("10.0.0.11", 1, 54.0, 40_960 * MIB, 81_559 * MIB, h100),
        ("10.0.0.12", 0, 0.0, 3 * MIB, 40_960 * MIB, a100),
        ("10.0.0.12", 1, None, 20_480 * MIB, 40_960 * MIB, a100),  # Ray's -1: unknown
    ]


def summary(events: list[Gpu]) -> list[tuple[str, int, float | None, int, int, str]]:
    out = []
    for e in events:
        assert e.mem_used is not None and e.mem_total is not None
        assert (e.temp, e.power, e.step) == (None, None, None)
        out.append((e.host, e.index, e.util, e.mem_used, e.mem_total, e.name))
    return out


class TestPrometheus:
    def test_fixture_to_gpu_events(self) -> None:
        """Ray's export becomes one Gpu per node and GpuIndex, MiB turned into bytes."""
        gpus, memory = node_metrics(parse_prometheus(FIXTURE.read_text()), "fallback")
        assert summary(gpus) == expected_fixture_gpus()
        assert memory == [
            HostMemory("10.0.0.11", 137_438_953_472, 2_199_023_255_552),
            HostMemory("10.0.0.12", 68_719_476_736, 2_199_023_255_552),
        ]

    def test_own_parser_on_the_fixture(self) -> None:
        """Our parser reads every line of the fixture: labels, escapes, NaN, +Inf buckets."""
        samples = list(parse_prometheus_text(FIXTURE.read_text()))
        assert len(samples) == 31
        by_name = {(n, lab.get("State", lab.get("le", ""))): (lab, v) for n, lab, v in samples}
        labels, value = by_name[("ray_tasks", "RUNNING")]
        assert labels["Name"] == 'PolicyWorker.train("grpo")' and value == 8.0
        labels, _ = by_name[("ray_tasks", "FINISHED")]
        assert labels["Name"] == "C:\\tmp\\{odd} name, with = signs"
        assert by_name[("ray_grpc_server_req_process_time_ms_bucket", "+Inf")][1] == 41.0
        nan = [v for n, _, v in samples if n == "ray_node_disk_utilization_percentage"]
        assert math.isnan(nan[0]) and nan[1] == 41.7
        gpus, _ = node_metrics(samples, "x")
        assert summary(gpus) == expected_fixture_gpus()

    def test_own_parser_details(self) -> None:
        """Escapes, infinities, timestamps, no labels, a trailing comma and spacing are read."""
        text = (
            "# HELP m A help text with \\\\ and \\n\n"
            "# TYPE m gauge\n"
            "\n"
            "m 1\n"
            'm{a="x\\ny",b="q\\"uote\\\\"} +Inf 1712345678000\n'
            'm{ a = "1" , } -Inf\n'
            "m{} NaN\n"
            'x_total{code="200"} 1.5e3\r\n'
        )
        got = list(parse_prometheus_text(text))
        assert [(n, lab) for n, lab, _ in got] == [
            ("m", {}),
            ("m", {"a": "x\ny", "b": 'q"uote\\'}),
            ("m", {"a": "1"}),
            ("m", {}),
            ("x_total", {"code": "200"}),
        ]
        values = [v for *_, v in got]
        assert values[0] == 1 and values[1] == math.inf and values[2] == -math.inf
        assert math.isnan(values[3]) and values[4] == 1500.0

    @pytest.mark.parametrize(
        "line", ["m", "m{a=1} 2", 'm{a="1" b="2"} 3', 'm{a="1"} two', "1m 2", 'm{a="1} 2']
    )
    def test_own_parser_refuses_bad_lines(self, line: str) -> None:
        """A line that is not a sample raises ValueError naming its number."""
        with pytest.raises(ValueError, match="line 2"):
            list(parse_prometheus_text("# ok\n" + line + "\n"))

    def test_matches_prometheus_client(self) -> None:
        """Where prometheus_client is installed, its parser and ours agree on the fixture."""
        pytest.importorskip("prometheus_client", reason="a test extra: ./tools/test installs it")
        text = FIXTURE.read_text()
        ours = node_metrics(parse_prometheus_text(text), "x")[0]
        theirs = node_metrics(parse_prometheus(text), "x")[0]
        assert summary(ours) == summary(theirs)

    def test_unknown_readings_are_none(self) -> None:
        """NaN or negative readings, and series without GpuIndex, give no value."""
        samples = [
            ("ray_node_gpus_utilization", {"GpuIndex": "0", "ip": "a"}, math.nan),
            ("ray_node_gram_used", {"GpuIndex": "0", "ip": "a"}, -1.0),
            ("ray_node_gram_available", {"GpuIndex": "0", "ip": "a"}, 10.0),
            ("ray_node_gram_used", {"ip": "a"}, 5.0),  # Ray < 2.10: per-node sums
        ]
        (g,) = node_metrics(samples, "x")[0]
        assert (g.host, g.index, g.util, g.mem_used, g.mem_total, g.name) == (
            "a", 0, None, None, None, ""
        )  # fmt: skip


class _Metrics(http.server.BaseHTTPRequestHandler):
    body: ClassVar[bytes] = b""
    paths: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[tuple[int, list[str]]]:
    """A local HTTP server serving the fixture; yields its port and the paths requested."""

    class Handler(_Metrics):
        body = FIXTURE.read_bytes()
        paths: ClassVar[list[str]] = []

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1]), Handler.paths
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node(node_id: str, port: int | None, *, alive: bool = True) -> dict[str, Any]:
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": "127.0.0.1",
        "NodeManagerHostname": f"host-{node_id}",
        "MetricsExportPort": port,
        "Resources": {"CPU": 64.0, "GPU": 2.0},
    }


class TestRayDiscovery:
    def test_cluster_scope_reads_alive_nodes(
        self, monkeypatch: pytest.MonkeyPatch, metrics_server: tuple[int, list[str]]
    ) -> None:
        """Alive nodes with a metrics port are read over HTTP; dead or portless ones are not."""
        port, paths = metrics_server
        nodes = [node("a", port), node("b", free_port(), alive=False), node("c", None)]
        monkeypatch.setitem(sys.modules, "ray", fake_ray(nodes))
        source = RaySource(scope="cluster")
        assert source.endpoints() == [("127.0.0.1", f"http://127.0.0.1:{port}/metrics")]
        assert summary(source.sample()) == expected_fixture_gpus()
        assert paths == ["/metrics"]
        assert [m.host for m in source.host_memory] == ["10.0.0.11", "10.0.0.12"]

    def test_local_scope_reads_this_node_only(
        self, monkeypatch: pytest.MonkeyPatch, metrics_server: tuple[int, list[str]]
    ) -> None:
        """The default scope reads only the node this process runs on."""
        port, paths = metrics_server
        other = free_port()
        monkeypatch.setitem(sys.modules, "ray", fake_ray([node("b", other), node("a", port)]))
        source = RaySource()
        assert [url for _, url in source.endpoints()] == [f"http://127.0.0.1:{port}/metrics"]
        assert len(source.sample()) == 4 and paths == ["/metrics"]

    def test_partial_and_total_failure(
        self, monkeypatch: pytest.MonkeyPatch, metrics_server: tuple[int, list[str]]
    ) -> None:
        """One unreachable node is skipped; when none answers, sample() raises."""
        port, _ = metrics_server
        dead = free_port()
        monkeypatch.setitem(sys.modules, "ray", fake_ray([node("a", port), node("b", dead)]))
        assert len(RaySource(scope="cluster").sample()) == 4
        monkeypatch.setitem(sys.modules, "ray", fake_ray([node("b", dead)]))
        with pytest.raises(OSError):
            RaySource(scope="cluster", timeout=0.5).sample()

    def test_uninitialised_ray_warns_through_the_sampler(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Ray asked for but not initialised: sample() raises, the sampler warns and retries."""
        monkeypatch.setitem(sys.modules, "ray", fake_ray([], initialized=False))
        with pytest.raises(ConfigError, match=r"needs ray\.init"):
            RaySource().sample()
        sampler = GpuSampler(lambda e: None, source="ray", interval=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler.start()
            wait_for(lambda: sampler.failures >= 2)
            sampler.stop()
        assert [str(w.message) for w in caught if w.category is RanklogWarning] == [
            "ranklog: GPU sampling (ray) failed: ConfigError('the Ray GPU source needs ray.init() "
            "in this process'); will retry"
        ]

    def test_sampler_over_http(
        self, monkeypatch: pytest.MonkeyPatch, metrics_server: tuple[int, list[str]]
    ) -> None:
        """The ray sampler appends the fixture's GPUs every interval."""
        port, paths = metrics_server
        monkeypatch.setitem(sys.modules, "ray", fake_ray([node("a", port)]))
        got: list[Gpu] = []
        sampler = GpuSampler(got.append, source="ray", interval=0.05)
        sampler.start()
        wait_for(lambda: len(got) >= 8)
        sampler.stop()
        assert summary(got[:4]) == summary(got[4:8]) == expected_fixture_gpus()
        assert len(paths) >= 2


def race(spool: str, hosts: list[str], barrier: Any, results: Any) -> None:
    """In a spawned process: elect a sampler for each host in step with the others."""
    for host in hosts:
        barrier.wait(60)
        results.put((host, os.getpid(), elect_sampler(Path(spool), host, None)))
    barrier.wait(60)  # nobody exits (leaving a stale lock) before all have elected


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def lock_of(spool: Path, host: str) -> Path:
    return spool / "gpu" / f"{host}.lock"


class TestElection:
    def test_local_ranks_known(self, spool: Path) -> None:
        """With local ranks known, local rank 0 samples and no lock file is made."""
        assert [elect_sampler(spool, "n1", lr) for lr in range(4)] == [True, False, False, False]
        assert not (spool / "gpu").exists()

    def test_same_process_again_and_release(self, spool: Path) -> None:
        """The holder is elected again, and release() removes its lock."""
        assert elect_sampler(spool, "n1", None)
        assert elect_sampler(spool, "n1", None)
        pid, start = lock_of(spool, "n1").read_text().split()
        assert int(pid) == os.getpid() and start.isdigit()
        release_election(spool, "n1")
        assert not lock_of(spool, "n1").exists()
        release_election(spool, "n1")  # idempotent

    @pytest.mark.slow
    def test_live_holder_keeps_the_lock(self, spool: Path) -> None:
        """A lock naming a live process (here: this one) is not taken by another pid."""
        assert elect_sampler(spool, "n1", None)
        code = (
            "import sys; from pathlib import Path; "
            "from ranklog.producer._gpu import elect_sampler; "
            "print(elect_sampler(Path(sys.argv[1]), 'n1', None))"
        )
        out = run_python(code, str(spool))
        assert (out.returncode, out.stdout.strip()) == (0, "False"), out.stderr

    def test_empty_or_garbage_lock_is_stale(self, spool: Path) -> None:
        """A lock whose writer died before writing, or holding garbage, is taken over."""
        for host, text in (("n1", ""), ("n2", "not a pid\n"), ("n3", "0 5\n")):
            lock_of(spool, host).parent.mkdir(parents=True, exist_ok=True)
            lock_of(spool, host).write_text(text)
            assert elect_sampler(spool, host, None)
            assert int(lock_of(spool, host).read_text().split()[0]) == os.getpid()

    @pytest.mark.slow
    def test_racing_processes(self, spool: Path) -> None:
        """4 spawned processes racing per host: exactly one wins, stale locks are taken over."""
        hosts = [f"node{i}" for i in range(60)]
        (spool / "gpu").mkdir(parents=True)
        gone = dead_pid()
        for i, host in enumerate(hosts):
            if i % 3 == 1:  # a crashed holder
                lock_of(spool, host).write_text(f"{gone} 12345\n")
            elif i % 3 == 2:  # a pid reused by another process (this one): start differs
                lock_of(spool, host).write_text(f"{os.getpid()} 1\n")
        ctx = multiprocessing.get_context("spawn")
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [
            ctx.Process(target=race, args=(str(spool), hosts, barrier, results)) for _ in "abcd"
        ]
        for p in procs:
            p.start()
        got = [results.get(timeout=120) for _ in range(4 * len(hosts))]
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        for host in hosts:
            winners = [pid for h, pid, won in got if h == host and won]
            assert len(winners) == 1, (host, got)
            assert int(lock_of(spool, host).read_text().split()[0]) == winners[0]
        assert not list((spool / "gpu").glob("*.tmp"))


class TestInit:
    def test_run_samples_into_its_spool(self, tmp_path: Path) -> None:
        """ranklog.init(gpu=...) writes gpu events from one process per host, until close."""
        import ranklog
        from ranklog.schemas import Gpu
        from ranklog.testing import read_events

        class Fake:
            name = "fake"

            def sample(self) -> list[Gpu]:
                return [Gpu(time.time(), "h", 0, 50.0, 1, 2, None, None, None, "G")]

        spool = tmp_path / "spool"
        with ranklog.init(spool, rank=0, world_size=2, local_rank=0, handle_signals=False,
                          gpu=Fake(), gpu_interval=0.02):  # fmt: skip
            time.sleep(0.2)
        other = ranklog.init(spool, rank=1, world_size=2, local_rank=1, handle_signals=False,
                             gpu=Fake(), gpu_interval=0.02)  # fmt: skip
        time.sleep(0.1)
        other.close()
        gpus = [e for e in read_events(spool) if isinstance(e, Gpu)]
        assert len(gpus) >= 3
        assert not [e for e in read_events(spool, rank=1) if isinstance(e, Gpu)]
