"""The Ray GPU source against a real local Ray head (``tests/ray_cluster.py``).

The head has no GPU: its own endpoint gives host memory and no GPU line, so the GPU
lines come from the recorded ``tests/data/ray_metrics.prom``, served over HTTP while the
node list still comes from the real head.
"""

from __future__ import annotations

import http.server
import logging
import os
import sys
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

import ranklog
from ranklog.errors import ConfigError
from ranklog.producer._gpu import (
    MIB,
    GpuSampler,
    HostMemory,
    RaySource,
    node_metrics,
    open_source,
    parse_prometheus,
    parse_prometheus_text,
)
from ranklog.schemas import Gpu, Metrics, RankEnd, RankStart, StepEnd
from ranklog.testing import read_events

from .test_gpu import fake_pynvml

if TYPE_CHECKING:
    from .ray_cluster import RayHead

# The head (ray_head) is registered once, in conftest.py: one head for every Ray test module.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported: see ray_cluster

ray = pytest.importorskip("ray", reason="ray is installed by ./tools/test (extra ranklog[ray])")

FIXTURE = Path(__file__).parent / "data" / "ray_metrics.prom"


@pytest.fixture(scope="module")
def head(ray_driver: RayHead) -> RayHead:
    """The session's Ray head, this process connected to it (``tests/ray_cluster.py``)."""
    return ray_driver


def mem_total() -> int:
    """MemTotal of /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


@pytest.fixture
def fixture_server() -> Iterator[tuple[str, list[str]]]:
    """The recorded Ray export on a local HTTP server: its URL and the paths requested."""
    body = FIXTURE.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        paths: ClassVar[list[str]] = []

        def do_GET(self) -> None:
            type(self).paths.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", Handler.paths
    finally:
        server.shutdown()
        server.server_close()


class TestRaySource:
    def test_endpoint_from_ray_nodes(self, head: RayHead) -> None:
        """Both scopes find the head's metrics endpoint in ``ray.nodes()``: its address and port."""
        (node,) = [n for n in ray.nodes() if n["Alive"]]
        assert (node["NodeManagerAddress"], node["MetricsExportPort"]) == (
            "127.0.0.1",
            head.metrics_port,
        )
        for scope in ("local", "cluster"):
            source = RaySource(scope=scope)  # type: ignore[arg-type]
            assert source.endpoints() == [("127.0.0.1", head.metrics_url)], scope

    def test_real_head_gives_host_memory_and_no_gpu(self, head: RayHead) -> None:
        """A sample of the GPU-less head yields no Gpu, and its host memory in bytes."""
        source = RaySource()
        assert source.sample() == []
        (memory,) = source.host_memory
        assert memory.host == "127.0.0.1"
        assert memory.used is not None and memory.total is not None
        assert memory.total > memory.used > 0
        assert abs(memory.total - mem_total()) <= 0.01 * mem_total()

    def test_real_export_parses_alike(self, head: RayHead) -> None:
        """Our parser and prometheus_client read the head's real export (OTel labels) alike."""
        with urllib.request.urlopen(head.metrics_url, timeout=5) as resp:
            text = resp.read().decode()
        ours = list(parse_prometheus_text(text))
        assert len(ours) > 100 and any(n == "ray_node_mem_total" for n, _, _ in ours)
        gpus, memory = node_metrics(ours, "fallback")
        assert gpus == [] and [m.host for m in memory] == ["127.0.0.1"]
        pytest.importorskip("prometheus_client", reason="a test extra: ./tools/test installs it")
        assert sorted((n, sorted(lab.items())) for n, lab, _ in parse_prometheus(text)) == sorted(
            (n, sorted(lab.items())) for n, lab, _ in ours
        )

    def test_recorded_gpu_lines_with_the_real_node_list(
        self,
        head: RayHead,
        fixture_server: tuple[str, list[str]],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """GPU lines with Ray's real labels become Gpu events: MB of gram in bytes, -1 as None."""
        url, paths = fixture_server
        source = RaySource(scope="cluster")
        real = source.endpoints

        def recorded() -> list[tuple[str, str]]:
            return [(addr, url) for addr, _ in real()]  # the head's node, the recorded page

        monkeypatch.setattr(source, "endpoints", recorded)
        before = time.time()
        gpus = source.sample()
        assert paths == ["/metrics"]
        h100, a100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"
        assert [(g.host, g.index, g.name, g.util, g.mem_used, g.mem_total) for g in gpus] == [
            ("10.0.0.11", 0, h100, 97.0, 73_348 * MIB, (73_348 + 8_211) * MIB),
            ("10.0.0.11", 1, h100, 54.0, 40_960 * MIB, (40_960 + 40_599) * MIB),
            ("10.0.0.12", 0, a100, 0.0, 3 * MIB, (3 + 40_957) * MIB),
            ("10.0.0.12", 1, a100, None, 20_480 * MIB, (20_480 + 20_480) * MIB),
        ]
        assert gpus[0].mem_used == 76_910_952_448  # 73348 MiB (Ray says MB), in bytes
        assert all(isinstance(g.mem_used, int) and isinstance(g.mem_total, int) for g in gpus)
        assert all((g.temp, g.power, g.step) == (None, None, None) for g in gpus)
        assert all(before <= g.ts <= time.time() for g in gpus)
        assert source.host_memory == [
            HostMemory("10.0.0.11", 137_438_953_472, 2_199_023_255_552),
            HostMemory("10.0.0.12", 68_719_476_736, 2_199_023_255_552),
        ]


class TestProducerOnRay:
    def test_auto_falls_back_to_ray(self, head: RayHead, monkeypatch: pytest.MonkeyPatch) -> None:
        """With no NVML, ``gpu="auto"`` in a process connected to Ray samples through Ray."""
        monkeypatch.setitem(sys.modules, "pynvml", None)
        source = open_source("auto", "h")
        assert isinstance(source, RaySource) and source.scope == "local"
        assert GpuSampler(lambda e: None, host="h").source_name == "ray"

    def test_gpu_ray_in_a_driver(
        self, head: RayHead, spool: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """``gpu="ray"`` on the GPU-less head writes no gpu event, says so once, logs as usual."""
        with (
            caplog.at_level(logging.INFO, logger="ranklog"),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False, gpu="ray",
                               gpu_interval=0.2)  # fmt: skip
            sampler = run._gpu
            assert sampler is not None and sampler.source_name == "ray"
            for step in range(8):
                run.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
                run.step_end(step)
                time.sleep(0.1)
            run.close()
        assert sampler.failures == 0 and not caught
        assert sampler._source.host_memory[0].host == "127.0.0.1"  # it did sample
        said = [r.getMessage() for r in caplog.records if "no GPU" in r.getMessage()]
        assert said == [f"ranklog: ray reports no GPU on {sampler.host} (yet); sampling goes on"]
        events = read_events(spool)
        assert not [e for e in events if isinstance(e, Gpu)]
        metrics = [e for e in events if isinstance(e, Metrics)]
        assert [(m.step, m.values) for m in metrics] == [
            (s, {"loss": 1.0 / (s + 1)}) for s in range(8)
        ]
        assert [e.step for e in events if isinstance(e, StepEnd)] == list(range(8))
        assert isinstance(events[-1], RankEnd) and events[-1].status == "ok"
        assert not (spool / "gpu" / f"{sampler.host}.lock").exists()  # released at close

    def test_host_names_rank_start_gpu_events_and_lock(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``ranklog.init(host=...)`` (ranklog.ray passes the node IP) is the host everywhere."""
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(count=1))
        with pytest.raises(ConfigError, match="host"):
            ranklog.init(spool, rank=0, world_size=1, handle_signals=False, host="")
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False, gpu="nvml",
                           gpu_interval=0.05, host="10.0.0.11")  # fmt: skip
        assert (spool / "gpu" / "10.0.0.11.lock").exists()
        time.sleep(0.2)
        run.close()
        events = read_events(spool)
        assert [e.host for e in events if isinstance(e, RankStart)] == ["10.0.0.11"]
        gpus = [e for e in events if isinstance(e, Gpu)]
        assert gpus and {(g.host, g.index) for g in gpus} == {("10.0.0.11", 0)}


class TestNemoOnRay:
    def test_monitor_gpus_in_a_ray_driver_samples_the_cluster(
        self, head: RayHead, tmp_path: Path
    ) -> None:
        """NeMo's ``monitor_gpus`` in a Ray driver samples every node, as RayGpuMonitorLogger."""
        from ranklog.nemo import Logger

        cfg = {"log_dir": str(tmp_path / "logs"), "wandb_enabled": False,
               "swanlab_enabled": False, "tensorboard_enabled": False, "mlflow_enabled": False,
               "wandb": {}, "monitor_gpus": True, "ranklog": {"rank": 0, "world_size": 1},
               "gpu_monitoring": {"collection_interval": 0.2, "flush_interval": 5}}  # fmt: skip
        logger = Logger(cfg)  # type: ignore[arg-type]
        try:
            sampler = logger.run._gpu
            assert sampler is not None and sampler.interval == 0.2
            source = sampler._source
            assert isinstance(source, RaySource) and source.scope == "cluster"
            assert source.with_host_memory
            assert [a for a, _ in source.endpoints()] == ["127.0.0.1"]
            assert logger.gpu_monitor is not None and logger.gpu_monitor.is_running
            time.sleep(0.5)
        finally:
            logger.finish()
        hosts = [e for e in read_events(tmp_path / "logs" / "spool") if isinstance(e, Gpu)]
        assert hosts and all(e.index == -1 and e.mem_total for e in hosts)  # host memory

    def test_nemo_monitor_collects_from_the_real_head(self, head: RayHead) -> None:
        """NeMo's own monitor class reads the head's agent: node.0 memory, flushed to a parent."""
        from ranklog.nemo import RayGpuMonitorLogger

        calls: list[tuple[dict[str, Any], int, str]] = []

        class Parent:
            def log_metrics(self, metrics: dict[str, Any], step: int, prefix: str = "",
                            step_metric: str | None = None) -> None:  # fmt: skip
                calls.append((metrics, step, prefix))

        m = RayGpuMonitorLogger(0.1, 3600, "ray", "ray/ray_step", parent_logger=Parent())
        got = m._collect_metrics()
        assert got["node.0.mem_total_gb"] == pytest.approx(mem_total() / 1024**3, rel=0.05)
        m.start()
        deadline = time.monotonic() + 30
        while not m.metrics_buffer and time.monotonic() < deadline:
            time.sleep(0.1)
        m.stop()
        assert calls and calls[0][2] == "ray" and "ray/ray_step" in calls[0][0]
        assert "node.0.mem_gb" in calls[0][0]
