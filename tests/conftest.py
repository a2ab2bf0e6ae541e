"""Shared fixtures: a fresh spool directory, and a helper to run Python in a subprocess.

The suite is hermetic: before anything runs, HOME points at an empty directory of
this session's, ``RANKLOG_CODE=0`` (tests of code provenance ask for it), and every
RAY_*, WANDB_*, MLFLOW_* and launcher variable of the caller is removed, so that a
token file in the user's ``~/.ray``, a W&B key in ``~/.netrc`` or an exported
``MLFLOW_TRACKING_URI`` never changes what a test sees (``tests/test_hermetic.py`` plants
all of them and runs backend and Ray tests).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: the caller's variables that would reach into backends, Ray or rank detection
FOREIGN_PREFIXES = ("RAY_", "WANDB_", "MLFLOW_", "SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_")
FOREIGN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "NETRC", "RANKLOG_SPOOL", "XDG_CONFIG_HOME", "XDG_CACHE_HOME",
                 "XDG_DATA_HOME", "XDG_STATE_HOME")  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    """A home of the session's own, and none of the caller's backend or launcher variables."""
    home = Path(tempfile.mkdtemp(prefix="ranklog-test-home-"))
    for key in list(os.environ):
        if key.startswith(FOREIGN_PREFIXES) or key in FOREIGN_NAMES:
            del os.environ[key]
    os.environ["HOME"] = str(home)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # ours, not the caller's: every Ray of the suite binds to 127.0.0.1 (tests/ray_cluster.py
    # sets it at import, which comes before this hook; without it a test module run alone,
    # e.g. test_fanin.py, would hang connecting its driver to the head)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # a run records the code's git state only where a test asks for it (init(code=True)):
    # the checkout is a git repository, and git per init would add up over the suite
    os.environ["RANKLOG_CODE"] = "0"
    if os.environ.get("CI"):  # every extra is installed there: a missing one is a failure
        pytest.importorskip = _importorfail  # type: ignore[assignment]


_importorskip = pytest.importorskip


def _importorfail(modname: str, *args: Any, **kwargs: Any) -> Any:
    """``pytest.importorskip`` in CI: ./tools/test installs every extra, so a module that
    cannot be imported fails the test (a skipped backend test is not a passing one)."""
    try:
        return _importorskip(modname, *args, **kwargs)
    except pytest.skip.Exception as exc:
        pytest.fail(
            f"CI: {modname} is not importable ({exc}): ./tools/test installs every "
            "extra, so a skip here would hide a test that did not run",
            pytrace=False,
        )


#: fixtures shared by several modules, registered once (one Ray head per session)
pytest_plugins = ["tests.ray_cluster"]


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    """A path for a spool that does not exist yet."""
    return tmp_path / "spool"


@pytest.fixture(params=[2], ids=["layout2"])
def dataset_layout(request: pytest.FixtureRequest) -> int:
    """The dataset layout ``compact`` writes (layout 1 is read, no longer written: the
    fixtures of tests/data hold datasets of it)."""
    return int(request.param)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """An empty directory for a target's backend storage (the compliance suites')."""
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


@pytest.fixture
def made(spool: Path) -> Path:
    """``spool`` written by :func:`tests.compliance.make_spool`: the compliance suites' job."""
    from .compliance import make_spool

    make_spool(spool)
    return spool


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


def chromium() -> str:
    """Chromium's path. A test that needs it is skipped without it; in CI, where
    ``./tools/test`` installs it, it fails."""
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        why = "chromium is not installed (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return browser


@contextlib.contextmanager
def bindfs(under: Path, mnt: Path, *options: str) -> Iterator[Path]:
    """``under`` seen through a bindfs FUSE mount at ``mnt`` (``options``: bindfs's, e.g.
    ``-r`` read-only), unmounted at the end. Skipped where bindfs cannot mount; in CI,
    where ``./tools/test`` installs it, it fails."""
    import shutil

    why = "bindfs is not installed (./tools/test installs it with apt-get as root)"
    if shutil.which("bindfs") is not None:
        proc = subprocess.run(["bindfs", *options, str(under), str(mnt)], capture_output=True,
                              text=True, check=False)  # fmt: skip
        why = "" if proc.returncode == 0 else f"bindfs could not mount: {proc.stderr.strip()}"
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    try:
        yield mnt
    finally:
        for cmd in (["fusermount", "-u", str(mnt)], ["umount", "-l", str(mnt)]):
            if subprocess.run(cmd, capture_output=True, check=False).returncode == 0:
                break


def headless_dom(url: str, profile: Path, *, height: int = 6000, wait_ms: int = 20000) -> str:
    """The page at ``url`` as headless Chromium renders it (scripts run for ``wait_ms`` of
    virtual time), as HTML."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", f"--virtual-time-budget={wait_ms}",
           f"--window-size=1400,{height}", "--dump-dom", url]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout
