"""The README and docs/: short, self-contained, and every link goes somewhere real."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import ROOT, python_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=False).stdout.split()  # fmt: skip
    return [ROOT / p for p in out] or [p for p in ROOT.rglob("*") if ".venv" not in p.parts]


class TestDocs:
    def test_readme_first_screen_is_for_users(self) -> None:
        """At most ~200 lines; its first screen (40 lines) says what ranklog is, the pip
        install of a backend's extra, the training-loop snippet, one ``ranklog ship`` and
        the demo; the contributors' ./tools/test comes later, with .venv/bin."""
        text = (ROOT / "README.md").read_text()
        assert len(text.splitlines()) <= 200
        screen = "\n".join(text.splitlines()[:45])
        for needed in ('pip install "ranklog[tensorboard]"', "ranklog.init(", "run.step_end(",
                       "ranklog ship ", "./tools/demo"):  # fmt: skip
            assert needed in screen, needed
        assert "./tools/test" not in screen
        rest = text[text.index("./tools/test") :]
        assert ".venv/bin" in rest

    @pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
    def test_relative_links_resolve(self, page: Path) -> None:
        """Every relative link of a page names a file or folder of the repository."""
        for target, _ in _LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            assert (page.parent / target).resolve().exists(), f"{page.name}: {target}"

    def test_nothing_points_outside_the_repository(self) -> None:
        """No tracked file refers to a path above the repository (a user never has one)."""
        shared = "shared"  # spelled apart, so that this file does not match itself
        outside = re.compile(rf"\.\./{shared}|{shared}/DESIGN|{shared}/seeds")
        bad = [
            str(p.relative_to(ROOT))
            for p in _tracked()
            if p.is_file() and p.suffix in {".md", ".py", ".toml", ".sh", ".sbatch", ""}
            and outside.search(p.read_text(errors="ignore"))
        ]  # fmt: skip
        assert not bad


class TestNemoDifferences:
    """docs/nemo.md's additions and differences: each line names the test that checks it."""

    SECTIONS = ("## What ranklog adds", "## Differences from NeMo RL")
    _REF = re.compile(r"`(tests/[\w/]+\.py)::([\w:]+)`")

    def lines(self) -> list[str]:
        text = (ROOT / "docs" / "nemo.md").read_text()
        out = []
        for head in self.SECTIONS:
            body = text[text.index(head) :].split("\n## ", 1)[0]
            out += [ln for ln in body.splitlines() if ln.startswith("- ")]
        return out

    def test_each_line_names_a_test_that_exists(self) -> None:
        """Every bullet ends with ``tests/FILE.py::Class::test`` naming a test of that file."""
        import ast

        lines = self.lines()
        assert len(lines) >= 20
        for line in lines:
            refs = self._REF.findall(line)
            assert refs, f"no test named: {line[:80]}"
            for path, name in refs:
                tree = ast.parse((ROOT / path).read_text())
                scope: list[ast.stmt] = tree.body
                for part in name.split("::"):
                    found = [n for n in scope if isinstance(n, ast.ClassDef | ast.FunctionDef)
                             and n.name == part]  # fmt: skip
                    assert found, f"{path}::{name} does not exist ({line[:60]})"
                    scope = found[0].body
                assert name.split("::")[-1].startswith("test_"), name


# -- the code blocks: each says what it is; the runnable ones run ---------------------------

#: what a fenced block may be: code that runs (python, sh), data that parses (json, toml),
#: SQL run by tests/test_analysis.py, or text (output, layouts, diagrams, synopses)
LANGS = {"python", "sh", "json", "toml", "sql", "text"}
_BLOCK = re.compile(r"(?:^<!-- (\w+)(?::\s*([^>]*?))?\s*-->\n)?^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    """One fenced block of a page, with the marker on the line above it, if any."""

    page: Path
    line: int
    lang: str
    marker: str  # "fragment" (ARG: the complete file), "query", "example", or ""
    arg: str
    body: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        """Run by this test: python and sh blocks not marked otherwise."""
        return self.lang in ("python", "sh") and not self.marker


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, m.start(3)) + 1, m.group(3), m.group(1) or "",
              m.group(2) or "", m.group(4))
        for m in _BLOCK.finditer(text)
    ]  # fmt: skip


ALL = [b for page in PAGES for b in blocks(page)]


def _commands(body: str) -> list[list[str]]:
    """The ``ranklog ...`` command lines of a shell block, as argument lists."""
    joined = body.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "ranklog":
            out.append(words[1:])
    return out


class TestBlocks:
    def test_every_block_says_what_it_is(self) -> None:
        """Every fenced block names its language: python, sh, json, toml, sql or text."""
        bad = [f"{b} ```{b.lang}" for b in ALL if b.lang not in LANGS]
        assert not bad
        assert len(ALL) > 40 and sum(b.runs for b in ALL) >= 5

    def test_fragments_point_to_a_complete_file(self) -> None:
        """A block marked ``<!-- fragment: PATH -->`` names a file of the repository."""
        frags = [b for b in ALL if b.marker == "fragment"]
        assert frags
        bad = [f"{b}: {b.arg!r}" for b in frags if not b.arg or not (ROOT / b.arg).is_file()]
        assert not bad
        assert {b.marker for b in ALL} <= {"", "fragment", "query", "example"}

    def test_every_example_is_run_by_a_test(self) -> None:
        """Each script of examples/ is named by a test, which runs it."""
        tests = " ".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
        scripts = [p for p in (ROOT / "examples").rglob("*") if p.suffix in (".py", ".sbatch")]
        assert len(scripts) >= 7
        assert not [p.name for p in scripts if p.name not in tests]

    @pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python"], ids=str)
    def test_python_blocks_compile(self, block: Block) -> None:
        """Every Python block, a fragment too, is valid Python."""
        compile(block.body, str(block), "exec")

    @pytest.mark.parametrize("block", [b for b in ALL if b.lang in ("json", "toml")], ids=str)
    def test_data_blocks_parse(self, block: Block) -> None:
        """JSON and TOML blocks parse."""
        if block.lang == "json":
            json.loads(block.body)
        else:
            tomllib.loads(block.body)

    @pytest.mark.parametrize("block", [b for b in ALL if b.lang == "sh"], ids=str)
    def test_ranklog_commands_parse(self, block: Block) -> None:
        """Every ``ranklog`` command of a shell block, a fragment too, is one the CLI takes
        (its subcommand and flags exist, its values fit)."""
        from ranklog.cli import build_parser

        for words in _commands(block.body):
            with contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    build_parser().parse_args(words)
                except SystemExit:
                    pytest.fail(f"{block}: ranklog {' '.join(words)}: {err.getvalue()}")


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """The documented layout under ``tmp/nfs/runs/exp1``: a finished run's spool (from
    examples/quickstart.py), shipped once to JSONL, compacted to ``parquet/``."""
    exp = tmp_path / "nfs" / "runs" / "exp1"
    env = python_env(HOME=str(tmp_path / "home"))
    for cmd in (
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), str(exp / "spool")],
        [sys.executable, "-m", "ranklog.cli", "ship", str(exp / "spool"), "--to",
         f"jsonl:{exp / 'metrics.jsonl'}", "--once", "--quiet"],
        [sys.executable, "-m", "ranklog.cli", "compact", str(exp / "spool"), "--out",
         str(exp / "parquet")],
    ):  # fmt: skip
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert res.returncode == 0, res.stdout + res.stderr
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(b.runs for b in blocks(p))],
                         ids=lambda p: p.name)  # fmt: skip
def test_runnable_blocks_run(page: Path, layout: Path) -> None:
    """A page's python and sh blocks not marked as fragments run as written, in order, in
    one directory, with ``/nfs/runs/`` (the documented layout) in a temporary directory."""
    bin_dir = str(Path(sys.executable).parent)
    env = python_env(
        HOME=str(layout / "home"), PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
        WANDB_MODE="offline", WANDB_SILENT="true", MPLBACKEND="Agg",
    )  # fmt: skip
    for var in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI", "RANKLOG_SPOOL"):
        env.pop(var, None)
    for block in [b for b in blocks(page) if b.runs]:
        body = block.body.replace("/nfs/runs/", f"{layout}/nfs/runs/")
        cmd = [sys.executable, "-c", body] if block.lang == "python" else [
            "bash", "-euo", "pipefail", "-c", body]  # fmt: skip
        res = subprocess.run(cmd, cwd=layout, env=env, capture_output=True, text=True,
                             timeout=300, check=False)  # fmt: skip
        assert res.returncode == 0, f"{block}:\n{body}\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
