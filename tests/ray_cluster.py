"""A real local Ray head for tests: ``ray start --head`` on 127.0.0.1, 2 CPUs, stopped at the end.

``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before anything imports ray: with it,
Ray binds to 127.0.0.1 and not to the machine's external address. The metrics export
port is fixed (a free port picked here), so the node's Prometheus endpoint is known
and ``ray.nodes()`` reports it as ``MetricsExportPort``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from _chaos_io import free_port

__all__ = ["RayHead", "ray_env"]

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def ray_env() -> dict[str, str]:
    """Environment for a child process that uses the test's Ray head."""
    env = dict(os.environ)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass(frozen=True)
class RayHead:
    """A running head node: its GCS address and its metrics endpoint."""

    address: str
    metrics_port: int

    @property
    def metrics_url(self) -> str:
        """The node's Prometheus endpoint."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


def _ray_bin() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def _stop() -> None:
    subprocess.run([_ray_bin(), "stop", "--force"], env=ray_env(), capture_output=True,
                   timeout=60, check=False)  # fmt: skip


@pytest.fixture(scope="session")
def ray_head() -> Iterator[RayHead]:
    """Start a local Ray head (num_cpus=2) for the session; stop it at the end."""
    pytest.importorskip("ray", reason="ray is installed by ./tools/test (extra ranklog[ray])")
    port, metrics = free_port(), free_port()
    cmd = [
        _ray_bin(), "start", "--head", "--node-ip-address", "127.0.0.1",
        "--port", str(port), "--num-cpus", "2", "--num-gpus", "0",
        "--metrics-export-port", str(metrics), "--include-dashboard", "false",
        "--disable-usage-stats",
    ]  # fmt: skip
    out = subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, timeout=120,
                         check=False)  # fmt: skip
    if out.returncode != 0:
        _stop()
        raise RuntimeError(f"ray start failed:\n{out.stdout}\n{out.stderr}")
    head = RayHead(f"127.0.0.1:{port}", metrics)
    try:
        deadline = time.monotonic() + 60
        while True:  # the metrics agent comes up a little after the head
            try:
                with urllib.request.urlopen(head.metrics_url, timeout=2) as r:
                    if b"ray_node_mem_total" in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no node metrics at {head.metrics_url} after 60 s")
            time.sleep(0.5)
        yield head
    finally:
        _stop()
