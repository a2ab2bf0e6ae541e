"""A local Ray head for tests and benchmarks: started on 127.0.0.1, stopped exactly.

``ray start --head --block`` runs in its own process group with its own temp dir, so
stopping it signals that group and then whatever still names the temp dir: nothing
else on the machine (``ray stop`` would stop every Ray there, other runs' included).
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment makes Ray bind to
127.0.0.1 rather than the machine's external address; the metrics export port is
fixed, so the node's Prometheus endpoint is known.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

from _chaos_io import free_port

__all__ = ["RayHeadProcess", "ray_env"]

ROOT = Path(__file__).resolve().parent.parent
#: seconds a head is given to stop on SIGTERM before its group is killed (``ray start
#: --block`` on SIGTERM tears down for about 30 s; a test's or a benchmark's head holds
#: nothing worth that wait)
STOP_GRACE = 3.0


def ray_env() -> dict[str, str]:
    """Environment for a process that uses a local Ray head."""
    env = dict(os.environ)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _ray_bin() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class RayHeadProcess:
    """``ray start --head --block`` with ``num_cpus`` CPUs, on free ports of 127.0.0.1."""

    def __init__(self, num_cpus: int = 2) -> None:
        self.num_cpus = num_cpus
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.temp_dir = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = 90) -> None:
        """Start it and wait until the node's metrics endpoint answers."""
        # its own temp dir (short: Ray puts unix sockets there), so that nothing is shared
        self.temp_dir = tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp")
        cmd = [
            _ray_bin(), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
            "--port", str(self.port), "--num-cpus", str(self.num_cpus), "--num-gpus", "0",
            "--metrics-export-port", str(self.metrics_port), "--include-dashboard", "false",
            "--disable-usage-stats", "--temp-dir", self.temp_dir,
        ]  # fmt: skip
        self._log = open(os.path.join(self.temp_dir, "ray-start.log"), "wb")  # noqa: SIM115
        self._proc = subprocess.Popen(cmd, env=ray_env(), stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:  # the metrics agent comes up a little after the head
            if self._proc.poll() is not None:
                self._log.flush()
                text = Path(self.temp_dir, "ray-start.log").read_text(errors="replace")
                self.stop()
                raise RuntimeError(f"ray start exited:\n{text[-3000:]}")
            try:
                with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                    if b"ray_node_mem_total" in r.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"no node metrics at {self.metrics_url} after {timeout} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop exactly this head: its process group, then anything left using its temp dir."""
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:  # a head that takes longer to stop on SIGTERM is killed: it is a throwaway
                proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            self._proc = None
        if self.temp_dir:
            for _ in range(50):  # workers and agents may have left the group
                key = self.temp_dir.encode()
                left = [
                    int(d) for d in os.listdir("/proc") if d.isdigit() and key in _cmdline(int(d))
                ]
                if not left:
                    break
                for pid in left:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self._log is not None:
            self._log.close()
            self._log = None
