"""Targets declare themselves: the registry finds them, plug-ins too, and the walk-through holds."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ranklog
from ranklog.errors import ConfigError
from ranklog.shippers import Option, TargetKind, all_options, make_target, target_kinds

from .conftest import ROOT, python_env

EXAMPLE = ROOT / "tests" / "example_target" / "csv_target.py"


def _spool(spool: Path) -> None:
    for r in range(2):
        with ranklog.init(spool, rank=r, world_size=2, handle_signals=False) as run:
            for step in range(3):
                run.log_metrics({"loss": r + step}, step=step)
                run.step_end(step)


def _site_with_plugin(site: Path, value: str = "csv_target:TARGET") -> Path:
    """A directory that, on sys.path, holds an installed distribution adding the csv target."""
    site.mkdir()
    shutil.copy(EXAMPLE, site / "csv_target.py")
    dist = site / "ranklog_csv_example-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ranklog-csv-example\n"
                                   "Version: 1.0\n")  # fmt: skip
    (dist / "entry_points.txt").write_text(f"[ranklog.targets]\ncsv = {value}\n")
    return site


def _cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = python_env()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-m", "ranklog.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


class TestRegistry:
    def test_builtin_targets_declare_themselves(self) -> None:
        """Every public module of ranklog/shippers/targets/ is a target kind, named as its file."""
        files = {p.stem for p in (ROOT / "ranklog/shippers/targets").glob("[!_]*.py")}
        assert files == {"jsonl", "parquet", "console", "tensorboard", "mlflow", "wandb", "trackio",
                         "swanlab"}  # fmt: skip
        assert {k for k in target_kinds() if k in files} == files

    def test_options_are_shared_by_name(self) -> None:
        """An option several targets declare is one flag, listing the targets that take it."""
        opts = all_options()
        assert opts["run_name"][1] == ["mlflow", "swanlab", "tensorboard", "trackio", "wandb"]
        assert opts["samples"][1] == ["console"] and opts["samples"][0].type is int

    def test_a_target_gets_only_its_own_options(self, tmp_path: Path) -> None:
        """Options of other targets are left out of what a target is built with."""
        seen = {}

        def build(arg: str, context: object, options: dict[str, object]) -> object:
            seen.update(options)
            return object()

        kind = TargetKind("probe", "X", "a probe", build, options=(Option("depth", "d", int),))
        kind.make("x", make_context(tmp_path), {"depth": 3, "entity": "e"})
        assert seen == {"depth": 3}

    def test_choices_are_checked_outside_the_cli_too(self, tmp_path: Path) -> None:
        """A value outside an option's choices is a ConfigError naming the flag."""
        with pytest.raises(ConfigError, match="--mode 'shared': expected one of online, offline"):
            make_target("wandb:p", tmp_path, {"mode": "shared"})


def make_context(tmp_path: Path) -> object:
    from ranklog.shippers import TargetContext

    return TargetContext(tmp_path)


class TestWalkThrough:
    def test_the_page_shows_the_tested_file(self) -> None:
        """docs/targets.md carries tests/example_target/csv_target.py verbatim."""
        page = (ROOT / "docs" / "targets.md").read_text()
        m = re.search(r"<!-- example: tests/example_target/csv_target.py -->\n```python\n(.*?)```",
                      page, re.S)  # fmt: skip
        assert m is not None
        assert m.group(1) == EXAMPLE.read_text()

    def test_a_plugin_ships_from_the_cli(self, spool: Path, tmp_path: Path) -> None:
        """Installed with an entry point, the example is a --to kind with its own flag."""
        _spool(spool)
        site = _site_with_plugin(tmp_path / "site")
        out = tmp_path / "out.csv"
        proc = _cli(site, "ship", str(spool), "--to", f"csv:{out}", "--csv-delimiter", ";",
                    "--once", "--quiet")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert out.read_text().splitlines() == [
            "0;loss;0.5", "0;;", "1;loss;1.5", "1;;", "2;loss;2.5", "2;;",
        ]  # fmt: skip
        help_text = " ".join(_cli(site, "ship", "--help").stdout.split())
        assert "csv:PATH: step,name,value rows of each reduced step" in help_text
        assert "--csv-delimiter C the CSV field delimiter (default ,) [csv]" in help_text

    def test_a_broken_plugin_is_skipped(self, spool: Path, tmp_path: Path) -> None:
        """A plug-in that cannot be imported is reported once; the built-in targets still work."""
        _spool(spool)
        site = _site_with_plugin(tmp_path / "site", value="no_such_module:TARGET")
        out = tmp_path / "out.jsonl"
        proc = _cli(site, "ship", str(spool), "--to", f"jsonl:{out}", "--once", "--quiet")
        assert proc.returncode == 0, proc.stderr
        assert len(out.read_text().splitlines()) == 4  # the run line, then 3 steps
        assert "target entry point csv (no_such_module:TARGET) cannot be loaded" in proc.stderr
