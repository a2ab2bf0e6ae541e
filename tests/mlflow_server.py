"""A real ``mlflow server`` on 127.0.0.1 for tests: started, killed, restarted and stopped by pid.

The server itself is the chaos tool's (``tools/_chaos_io.MlflowServer``): it runs in
its own process group (``mlflow server`` starts uvicorn as a child), so stopping it
signals exactly the processes it started, and its sqlite store and artifacts live in
a directory the test owns, so a restart on the same port finds the same data.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from _chaos_io import MlflowServer, free_port

__all__ = ["MlflowServer", "free_port", "running_server"]


@contextlib.contextmanager
def running_server(root: Path) -> Iterator[MlflowServer]:
    """A started server, stopped at the end (also when the test fails)."""
    server = MlflowServer(root)
    try:
        server.start()
        yield server
    finally:
        server.stop()
