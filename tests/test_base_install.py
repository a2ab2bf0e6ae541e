"""``pip install ranklog`` with no extra: every command works, or names the extra it needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.slow

SPOOL = """
import sys, ranklog
for r in range(2):
    run = ranklog.init(sys.argv[1], rank=r, world_size=2, handle_signals=False)
    run.log_hyperparams({"lr": 0.1})
    for s in range(5):
        run.log_metrics({"loss": r + s / 10}, step=s)
        run.step_end(s)
    run.close()
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding ranklog and only its core dependencies (from the package registry)."""
    venv = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_REQUIRE", "VIRTUAL"))}
    proc = subprocess.run(
        [str(venv / "bin/python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         str(ROOT)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    if proc.returncode != 0 and "Could not find a version" in proc.stderr:
        pytest.skip(f"the package registry cannot be reached: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr
    return venv


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(venv / "bin/ranklog"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


class TestBaseInstall:
    def test_no_extra_is_installed(self, base: Path) -> None:
        """The venv really has no backend, no matplotlib, no pandas."""
        code = ("import importlib.util as u; print([m for m in ('tensorboard', 'mlflow', "
                "'wandb', 'matplotlib', 'ray', 'pandas') if u.find_spec(m)])")  # fmt: skip
        out = subprocess.run([str(base / "bin/python"), "-c", code], capture_output=True,
                             text=True, check=True, env={"PATH": os.environ["PATH"]})  # fmt: skip
        assert out.stdout.strip() == "[]"

    def test_every_command(self, base: Path, tmp_path: Path) -> None:
        """ship (JSONL, console), compact, replay, inspect run; a backend or the report says
        in one line which extra to install (exit 6)."""
        env = {"PATH": os.environ["PATH"]}
        subprocess.run([str(base / "bin/python"), "-c", SPOOL, str(tmp_path / "exp" / "spool")],
                       check=True, env=env, timeout=120)  # fmt: skip
        spool, ds = str(tmp_path / "exp" / "spool"), str(tmp_path / "ds")
        for args in (
            ["ship", spool, "--to", "jsonl:o.jsonl", "--once", "--quiet"],
            ["ship", spool, "--to", "console", "--once", "--quiet", "--name", "c"],
            ["compact", spool, "--out", ds],
            ["replay", ds, "--to", "jsonl:r.jsonl"],
            ["inspect", spool],
            ["inspect", spool, "--json"],
        ):
            res = _run(base, *args, cwd=tmp_path)
            assert res.returncode == 0, (args, res.stderr)
        assert (tmp_path / "o.jsonl").read_text().count('"step"') == 5
        for args, extra in (
            (["report", ds, "--out", "r.html"], "report"),
            (["ship", spool, "--to", f"tensorboard:{tmp_path / 'tb'}", "--once"], "tensorboard"),
            (["ship", spool, "--to", "mlflow:", "--once"], "mlflow"),
            (["ship", spool, "--to", "wandb:p", "--once"], "wandb"),
            (["ship", spool, "--to", "jsonl:x.jsonl", "--ray", "--once"], "ray"),
        ):
            res = _run(base, *args, cwd=tmp_path)
            assert res.returncode == 6, (args, res.stderr)
            (line,) = res.stderr.strip().splitlines()
            assert f"pip install 'ranklog[{extra}]'" in line, (args, line)

    def test_demo(self, base: Path, tmp_path: Path) -> None:
        """The demo runs on what is installed (JSONL, console) and says what it left out."""
        res = _run(base, "demo", "--out", str(tmp_path / "d"), "--ranks", "2", "--steps", "20",
                   cwd=tmp_path)  # fmt: skip
        assert res.returncode == 0, res.stdout + res.stderr
        assert "pip install 'ranklog[report]'" in res.stdout
        assert (tmp_path / "d" / "replayed.jsonl").is_file()
