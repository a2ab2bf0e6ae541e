"""A real ``mlflow server`` on 127.0.0.1 for tests: started, killed, restarted and stopped by pid.

The server runs in its own process group (``mlflow server`` starts uvicorn as a
child), so stopping it signals exactly the processes this helper started. Its
sqlite store and artifacts live in a directory the test owns, so a restart on
the same port finds the same data.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from .conftest import python_env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """One ``mlflow server --host 127.0.0.1`` over a sqlite store in ``root``."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.db = root / "server.db"
        self.artifacts = root / "artifacts"
        self.log = root / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        """Start the server and wait until ``/health`` answers."""
        assert self.proc is None, "already running"
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--workers", "1"]
        cmd += ["--backend-store-uri", f"sqlite:///{self.db}"]
        cmd += ["--artifacts-destination", str(self.artifacts)]
        # no background job runner (a dozen huey processes): this machine has 2 cores
        env = python_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: uvicorn dies with it
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"mlflow server exited ({code}): {self.tail()}")
            if self.healthy():
                return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer in {timeout}s: {self.tail()}")

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's process group and reap the server."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)  # the group this helper created (pgid == pid)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # a child left behind by SIGTERM
        self.proc = None

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL)."""
        self.kill(signal.SIGTERM)

    def tail(self, n: int = 3000) -> str:
        """The end of the server's log, for failure messages."""
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@contextlib.contextmanager
def running_server(root: Path) -> Iterator[MlflowServer]:
    """A started server, stopped at the end (also when the test fails)."""
    server = MlflowServer(root)
    try:
        server.start()
        yield server
    finally:
        server.stop()
