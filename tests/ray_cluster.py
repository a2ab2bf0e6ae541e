"""A real local Ray head for tests: 127.0.0.1, ``num_cpus=2``, one per session.

The head itself is the benchmarks' (``tools/_ray_head.RayHeadProcess``): its own
process group and temp dir, stopped exactly (never ``ray stop``, which would stop
every Ray on the machine). ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before
anything imports ray, so that Ray binds to 127.0.0.1. The metrics export port is
fixed, so ``ray.nodes()`` reports it as ``MetricsExportPort``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from _ray_head import RayHeadProcess, ray_env

__all__ = ["RayHead", "ray_driver", "ray_env", "ray_head"]

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


@dataclass(frozen=True)
class RayHead:
    """A running head node: its GCS address and its metrics endpoint."""

    address: str
    metrics_port: int

    @property
    def metrics_url(self) -> str:
        """The node's Prometheus endpoint."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@pytest.fixture(scope="session")
def ray_head() -> Iterator[RayHead]:
    """Start a local Ray head (num_cpus=2) for the session; stop it at the end."""
    pytest.importorskip("ray", reason="ray is installed by ./tools/test (extra ranklog[ray])")
    head = RayHeadProcess(num_cpus=2)
    head.start()
    try:
        yield RayHead(head.address, head.metrics_port)
    finally:
        head.stop()


@pytest.fixture(scope="module")
def ray_driver(ray_head: RayHead) -> Iterator[RayHead]:
    """The session's head, with this (pytest) process connected to it as a driver."""
    import ray

    ray.init(address=ray_head.address, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray_head
    finally:
        ray.shutdown()
