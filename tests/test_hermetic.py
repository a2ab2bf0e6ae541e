"""The suite passes whatever the user's home and environment hold (tests/conftest.py)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT

#: Ray, MLflow and W&B tests that read a home or an environment if they are given one
PROBES = [
    "tests/test_ray_helpers.py::TestNodeHost::test_the_ip_ray_labels_the_node_with",
    "tests/test_ray_gpu.py::TestRaySource::test_endpoint_from_ray_nodes",
    "tests/test_mlflow.py::TestCompliance::test_every_step_once",
    "tests/test_wandb.py::TestCompliance::test_every_step_once",
    "tests/test_cli.py::TestShip::test_ship_once_then_inspect_shows_the_cursor",
]


def _hostile_home(home: Path) -> None:
    """What a user's home may hold: a Ray token of another cluster, W&B and MLflow settings."""
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40)
    (home / ".config" / "wandb").mkdir(parents=True)
    (home / ".config" / "wandb" / "settings").write_text("[default]\nmode = online\n")


HOSTILE_ENV = {
    "RAY_ADDRESS": "127.0.0.1:1",
    "RAY_AUTH_MODE": "token",
    "RAY_NAMESPACE": "someone-else",
    "WANDB_MODE": "online",
    "WANDB_API_KEY": "x" * 40,
    "WANDB_BASE_URL": "http://127.0.0.1:9",
    "WANDB_DIR": "/nonexistent/wandb",
    "MLFLOW_TRACKING_URI": "http://127.0.0.1:9",
    "MLFLOW_EXPERIMENT_NAME": "someone-else",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "1",
    "RANK": "3",
    "WORLD_SIZE": "7",
    "SLURM_PROCID": "5",
    "RANKLOG_SPOOL": "/nonexistent/spool",
}


class TestHermetic:
    def test_backend_and_ray_tests_pass_in_a_hostile_home(self, tmp_path: Path) -> None:
        """With a planted ~/.ray/auth_token, a W&B key and hostile variables, tests still pass."""
        home = tmp_path / "home"
        _hostile_home(home)
        # (faulthandler: a native crash of the child, seen twice at its exit after every
        # probe passed, prints each thread's stack into the failure message)
        env = {**os.environ, **HOSTILE_ENV, "HOME": str(home), "PYTHONFAULTHANDLER": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PROBES],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
        assert f"{len(PROBES)} passed" in proc.stdout

    def test_the_session_has_a_home_of_its_own(self) -> None:
        """In this session HOME is an empty directory of the session's, not the user's."""
        assert Path(os.environ["HOME"]).name.startswith("ranklog-test-home-")
        assert not (Path(os.environ["HOME"]) / ".ray" / "auth_token").exists()
