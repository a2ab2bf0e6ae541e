"""Shared fixtures: a fresh spool directory, and a helper to run Python in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: fixtures shared by several modules, registered once (one Ray head per session)
pytest_plugins = ["tests.ray_cluster"]


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    """A path for a spool that does not exist yet."""
    return tmp_path / "spool"


def python_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python: no launcher variables leak in from the test runner."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"}
        and not k.startswith(("OMPI_", "PMI_"))
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_python(
    code: str, *args: str, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; returns the completed process (text mode)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=python_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
