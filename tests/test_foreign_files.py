"""ranklog writes only into files it made: a JSONL target that is not ours is refused.

How this could break, and what each test tries:

- a user's own JSON, CSV or text file given as ``--to jsonl:PATH``: its last line looks
  torn (or its lines unknown) and would be cut and appended to — refused in one line
  (exit 5, "not a ranklog JSONL file"), the file byte for byte as it was;
- ``/dev/null``, a FIFO, a directory: not regular files — refused the same way, at once,
  never retried for ever (a FIFO is never opened for reading, so nothing blocks);
- an empty file (``touch out.jsonl``) is taken;
- a file an older release wrote (step lines, no run line; its first line cut by a crash)
  is recognised by its lines, as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ranklog

from .conftest import python_env
from .shiphelp import lines


def _spool(spool: Path) -> None:
    with ranklog.init(spool, rank=0, world_size=1, handle_signals=False) as run:
        for s in range(3):
            run.log_metrics({"loss": float(s)}, step=s)
            run.step_end(s)


def _ship(spool: Path, target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--once", "--to", target],
        env=python_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "body",
    [b'{"lr": 0.1,\n "batch": 32}', b"step,loss\n0,1.5\n1,1.2", b"notes\nmore notes",
     b'{"lr": 0.1}\n'],
    ids=["json", "csv", "text", "json-line"],
)  # fmt: skip
def test_a_users_file_is_refused_and_left_as_it_was(tmp_path: Path, body: bytes) -> None:
    """The user's JSON, CSV or text at the target path: exit 5, one line, bytes untouched."""
    spool, path = tmp_path / "spool", tmp_path / "config.json"
    _spool(spool)
    path.write_bytes(body)
    p = _ship(spool, f"jsonl:{path}")
    assert p.returncode == 5, p.stderr
    assert "not a ranklog JSONL file" in p.stderr and str(path) in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert path.read_bytes() == body


@pytest.mark.parametrize("kind", ["devnull", "fifo", "dir"])
def test_a_file_that_is_not_regular_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    """/dev/null, a FIFO and a directory: exit 5 in one line naming it, no retry loop."""
    spool = tmp_path / "spool"
    _spool(spool)
    path = tmp_path / "out"
    if kind == "devnull":
        path = Path("/dev/null")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    p = _ship(spool, f"jsonl:{path}")
    assert p.returncode == 5, p.stderr
    assert "not a ranklog JSONL file" in p.stderr and str(path) in p.stderr, p.stderr


def test_an_empty_file_is_taken(tmp_path: Path) -> None:
    """``touch out.jsonl`` then ship: the run line and every step are written into it."""
    spool, path = tmp_path / "spool", tmp_path / "out.jsonl"
    _spool(spool)
    path.touch()
    assert _ship(spool, f"jsonl:{path}").returncode == 0
    assert [x["step"] for x in lines(path)] == [0, 1, 2]


@pytest.mark.parametrize("first", [b'{"step": 0, "metrics": {"loss": 0.0}}\n', b'{"ste'])
def test_an_older_releases_file_is_recognised(tmp_path: Path, first: bytes) -> None:
    """A file with step lines and no run line (an older ranklog's), or one whose only line
    a crash cut: taken as before, the steps it holds not written again."""
    spool, path = tmp_path / "spool", tmp_path / "out.jsonl"
    _spool(spool)
    path.write_bytes(first)
    assert _ship(spool, f"jsonl:{path}").returncode == 0, path.read_text()
    assert sorted(x["step"] for x in lines(path)) == [0, 1, 2]
