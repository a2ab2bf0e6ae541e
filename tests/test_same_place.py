"""Identity is what the operating system says is the same.

A target is leased by its identity (canonical text) and by its place (device and inode
of a file or directory, a server's resolved address). How two shippers could still
write one place, and what each test tries:

- a JSONL file reached through a hard link (two real paths, one inode): the second
  follower is refused (exit 3, one line naming the holder), each step written once;
- a TensorBoard directory seen through a bind mount (root): the same;
- an MLflow server as ``http://127.0.0.1:P`` and ``http://localhost:P``: the second is
  refused before it creates anything — no empty RUNNING run left behind;
- the place is looked at after the file exists (created with the run line, as open
  creates it), so a link made after the first shipper started still meets its lease.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ranklog

from .conftest import python_env
from .shiphelp import lines, log_steps, rank
from .test_tensorboard import tb_back


def _follow(spool: Path, spec: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", spec, "--quiet",
         "--poll", "0.1", "--dead-after", "3600"],
        env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _once(spool: Path, spec: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", spec, "--once",
         "--quiet", "--dead-after", "3600"],
        env=python_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _wait(cond: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _stop(p: subprocess.Popen[str]) -> str:
    if p.poll() is None:
        p.terminate()
    return p.communicate(timeout=60)[1]


def _refused_by(res: subprocess.CompletedProcess[str], pid: int) -> None:
    assert res.returncode == 3, res.stderr
    said = res.stderr.strip().splitlines()
    assert len(said) == 1 and f"pid {pid}" in said[0], res.stderr


def test_a_hard_link_to_the_file_meets_the_same_lease(spool: Path, tmp_path: Path) -> None:
    """A follower of a.jsonl; b.jsonl hard-linked to it: a second shipper of b is refused,
    every step is in the file once."""
    run = rank(spool, 0, 1)
    log_steps(run, range(5))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first = _follow(spool, f"jsonl:{a}")
    try:
        _wait(lambda: len(lines(a)) == 5)
        os.link(a, b)
        _refused_by(_once(spool, f"jsonl:{b}"), first.pid)
        log_steps(run, range(5, 10))
        _wait(lambda: len(lines(a)) == 10)
    finally:
        _stop(first)
    assert [x["step"] for x in lines(b)] == list(range(10))


def _no_bind_mount(why: str) -> None:
    """Skip where a bind mount cannot be made (not root: a developer's machine); in CI,
    which runs as root, fail: the test must run there."""
    if os.environ.get("CI"):
        pytest.fail(f"CI: {why}: this test needs a bind mount, and CI runs as root")
    pytest.skip(why)


def test_a_bind_mount_of_the_directory_meets_the_same_lease(spool: Path, tmp_path: Path) -> None:
    """A TensorBoard follower of tb/; alias/ a bind mount of it: the second is refused."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        _no_bind_mount("not root, or no mount command")
    run = rank(spool, 0, 1)
    log_steps(run, range(5))
    tb, alias = tmp_path / "tb", tmp_path / "alias"
    tb.mkdir()
    alias.mkdir()
    made = subprocess.run(["mount", "--bind", str(tb), str(alias)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if made.returncode:
        _no_bind_mount(f"mount --bind refused: {made.stderr.strip()}")
    try:
        first = _follow(spool, f"tensorboard:{tb}")
        try:
            _wait(lambda: len(tb_back(tb)) == 5)
            _refused_by(_once(spool, f"tensorboard:{alias}"), first.pid)
            log_steps(run, range(5, 8))
            _wait(lambda: len(tb_back(tb)) == 8)
        finally:
            _stop(first)
    finally:
        subprocess.run(["umount", str(alias)], check=False)
    assert [s for s, _ in tb_back(tb)] == list(range(8))


def test_localhost_and_127_0_0_1_are_one_mlflow_server(spool: Path, tmp_path: Path) -> None:
    """A follower on http://127.0.0.1:P; one on http://localhost:P is refused, and the
    server holds one run for the ranklog run, nothing left RUNNING and empty."""
    from mlflow.tracking import MlflowClient

    from .mlflow_server import running_server

    with ranklog.init(spool, rank=0, world_size=1, handle_signals=False) as run:
        for s in range(5):
            run.log_metrics({"loss": s / 10}, step=s)
            run.step_end(s)
        with running_server(tmp_path / "server") as srv:
            first = _follow(spool, f"mlflow:http://127.0.0.1:{srv.port}")
            client = MlflowClient(tracking_uri=srv.uri)
            try:

                def shipped() -> bool:
                    exps = [e.experiment_id for e in client.search_experiments()]
                    runs = client.search_runs(exps) if exps else []
                    return (
                        bool(runs)
                        and len(client.get_metric_history(runs[0].info.run_id, "loss")) == 5
                    )

                _wait(shipped, timeout=120)
                for host in ("localhost", "[::1]", "127.0.0.1"):
                    _refused_by(_once(spool, f"mlflow:http://{host}:{srv.port}/"), first.pid)
            finally:
                _stop(first)
            exps = [e.experiment_id for e in client.search_experiments()]
            runs = client.search_runs(exps)
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]
