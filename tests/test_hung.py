"""A backend that accepts connections and never answers: training goes on, the shipper waits
with bounded memory, and once a real server answers on that port every step lands once."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ranklog.spool import ensure_run

from .conftest import python_env, run_python
from .mlflow_server import MlflowServer, free_port

pytest.importorskip("mlflow", reason="installed by ./tools/test (extra ranklog[mlflow])")

RANKS, STEPS, KEYS = 4, 300, 20

PRODUCER = """
import json, sys, time, ranklog
run = ranklog.init(sys.argv[1], rank=int(sys.argv[2]), world_size=int(sys.argv[3]))
worst = 0.0
for step in range(int(sys.argv[4])):
    t = time.perf_counter()
    run.log_metrics({f"m{k:02d}": run.rank + step / 1000 + k for k in range(20)}, step=step,
                    prefix="train")
    run.step_end(step)
    worst = max(worst, time.perf_counter() - t)
run.close()
print(json.dumps({"worst_s": worst}))
"""


class Silent:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", port))
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)  # held open, never read from, never answered

    def stop(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class TestHungBackend:
    def test_hung_mlflow_then_a_real_one(self, spool: Path, tmp_path: Path) -> None:
        """Producers never wait; the shipper's memory stays flat; after recovery, each step once."""
        from mlflow.tracking import MlflowClient

        port = free_port()
        silent = Silent(port)
        env = python_env(MLFLOW_HTTP_REQUEST_TIMEOUT="2", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
        target = f"mlflow:http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--quiet", "--to",
               target, "--poll", "0.2", "--start-grace", "120"]  # fmt: skip
        ensure_run(spool, world_size=RANKS)  # the shipper starts first, as in a real job
        shipper = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        server = None
        try:
            producers = [
                run_python(PRODUCER, str(spool), str(r), str(RANKS), str(STEPS), timeout=120)
                for r in range(RANKS)
            ]
            for p in producers:
                assert p.returncode == 0, p.stderr
                # a step never waited on the backend: the slowest call is a write to the OS
                assert json.loads(p.stdout)["worst_s"] < 1.0
            # measured once the shipper is past its start (mlflow's import can take seconds
            # on a busy machine) and talking to the hung backend
            deadline = time.monotonic() + 60
            while not silent.conns and time.monotonic() < deadline:
                time.sleep(0.1)
            assert silent.conns, "the shipper never reached the backend"
            time.sleep(1.0)
            rss = []
            for _ in range(8):  # the backend still hangs: the shipper waits, reads nothing
                assert shipper.poll() is None
                rss.append(_rss_mb(shipper.pid))
                time.sleep(1.0)
            assert max(rss) < 300 and rss[-1] - rss[1] < 20, rss
            silent.stop()
            server = MlflowServer(tmp_path / "server", port=port)
            server.start()
            _, err = shipper.communicate(timeout=240)  # every rank ended: it exits by itself
            assert shipper.returncode == 0, err[-3000:]
            assert "retrying in" in err
            client = MlflowClient(tracking_uri=server.uri)
            (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
            points = client.get_metric_history(run.info.run_id, "train/m07")
            assert sorted(p.step for p in points) == list(range(STEPS))  # each step once
            mean = {p.step: p.value for p in points}
            assert mean == pytest.approx({s: 1.5 + s / 1000 + 7 for s in range(STEPS)})
        finally:
            silent.stop()
            if shipper.poll() is None:
                shipper.kill()
                shipper.wait()
            if server is not None:
                server.stop()
