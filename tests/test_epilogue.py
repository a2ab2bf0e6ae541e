"""The epilogue (``ranklog ship SPOOL --once``, no ``--to``) needs nothing it cannot trust.

It re-creates each target from its cursor's identity, with the options of its own
command line. How it could break, and what each test tries:

- options: the epilogue's ``--dead-after 1`` must apply, not the 120 s the live shipper
  was started with (else the killed ranks' last steps stay unshipped, exit 0);
- a recorded working directory that no longer exists (node-local, deleted): the
  epilogue runs where the user is and ships to the identity's absolute path;
- a cursor cut short (a full disk, a hostile user): one line naming it and a non-zero
  exit, the other targets still shipped — never skipped in silence;
- names and argv planted in a cursor (the spool is shared): ``name: ../../x``, an
  ``argv`` naming another file, an option or a ``--name``: none is obeyed; nothing is
  written outside ``SPOOL/cursors`` and the identity's place;
- ``--name ../../x`` or an absolute ``--name`` at the command line: refused (exit 2);
- the replay command printed after ``compact --delete`` removed unshipped segments: it
  runs as printed from any directory (absolute target), and the epilogue then ends 0;
- it ends with one line per target: where it stands.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ranklog
from ranklog.testing import crash

from .conftest import python_env
from .shiphelp import age, lines, log_steps, rank


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ranklog.cli", *args], cwd=cwd, env=python_env(),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _job(spool: Path, steps: range) -> None:
    with ranklog.init(spool, rank=0, world_size=1, handle_signals=False) as run:
        for s in steps:
            run.log_metrics({"loss": s / 10}, step=s)
            run.step_end(s)


def _steps(path: Path) -> list[int]:
    return [x["step"] for x in lines(path)]


def test_the_epilogues_dead_after_applies(tmp_path: Path) -> None:
    """A shipper recorded with --dead-after 120; rank 1 killed at step 49: the epilogue's
    --dead-after 1 ships its last 50 steps (partial), not the recorded 120 s."""
    spool, out = tmp_path / "spool", tmp_path / "o.jsonl"
    runs = [rank(spool, r, 2) for r in range(2)]
    for run in runs:
        log_steps(run, range(50))
    assert cli("ship", str(spool), "--once", "--quiet", "--to", f"jsonl:{out}").returncode == 0
    crash(runs[1])  # SIGKILL as it were: no rank_end
    log_steps(runs[0], range(50, 100))
    runs[0].close()
    age(spool, 1, 30)
    res = cli("ship", str(spool), "--once", "--quiet", "--dead-after", "1")
    assert res.returncode == 0, res.stderr
    assert _steps(out) == list(range(100))
    assert f"jsonl:{out}: shipped up to step 99" in res.stderr


def test_a_recorded_directory_that_is_gone_is_not_needed(tmp_path: Path) -> None:
    """A cursor whose recorded cwd no longer exists (an older release's record): the
    epilogue ships to the identity's absolute path from where the user is."""
    spool, out = tmp_path / "spool", tmp_path / "o.jsonl"
    _job(spool, range(3))
    assert cli("ship", str(spool), "--once", "--quiet", "--to", f"jsonl:{out}").returncode == 0
    path = next((spool / "cursors").glob("*.json"))
    raw = json.loads(path.read_text())
    raw["cwd"] = str(tmp_path / "gone" / "node-local")
    path.write_text(json.dumps(raw))
    _job(spool, range(3, 6))
    res = cli("ship", str(spool), "--once", "--quiet")
    assert res.returncode == 0, res.stderr
    assert _steps(out) == list(range(6))


def test_a_cursor_cut_short_is_one_line_and_not_zero(tmp_path: Path) -> None:
    """One of two cursors cut short: one line naming it, exit 3; the other target ships."""
    spool, a, b = tmp_path / "spool", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _job(spool, range(3))
    for out in (a, b):
        assert cli("ship", str(spool), "--once", "--quiet", "--to", f"jsonl:{out}").returncode == 0
    _job(spool, range(3, 6))
    cursors = sorted((spool / "cursors").glob("*.json"))
    broken = next(p for p in cursors if json.loads(p.read_text())["identity"].endswith("a.jsonl"))
    broken.write_bytes(broken.read_bytes()[:60])
    res = cli("ship", str(spool), "--once", "--quiet")
    assert res.returncode == 3, res.stderr
    said = [line for line in res.stderr.splitlines() if str(broken) in line]
    assert len(said) == 1 and "unreadable cursor" in said[0], res.stderr
    assert _steps(b) == list(range(6))
    assert _steps(a) == list(range(3))


def test_names_and_argv_planted_in_a_cursor_are_not_obeyed(tmp_path: Path) -> None:
    """A cursor whose name, argv and cwd were rewritten by someone else: the epilogue ships
    to the identity's file only; nothing is written elsewhere."""
    spool, out, evil = tmp_path / "spool", tmp_path / "o.jsonl", tmp_path / "evil"
    evil.mkdir()
    _job(spool, range(3))
    assert cli("ship", str(spool), "--once", "--quiet", "--to", f"jsonl:{out}").returncode == 0
    path = next((spool / "cursors").glob("*.json"))
    raw = json.loads(path.read_text())
    raw.update(name="../../evil/planted", cwd=str(evil),
               argv=["--to", f"jsonl:{evil / 'x.jsonl'}", "--name", "../evil/n",
                     "--late", "ship", "--dead-after", "0"])  # fmt: skip
    path.write_text(json.dumps(raw))
    _job(spool, range(3, 6))
    res = cli("ship", str(spool), "--once", "--quiet")
    assert res.returncode == 0, res.stderr
    assert _steps(out) == list(range(6))
    assert list(evil.iterdir()) == []
    assert sorted(p.name for p in (spool / "cursors").iterdir()) == [path.name]
    assert not list(tmp_path.glob("*.json")) and not list(spool.glob("*.json"))[1:]


@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "a/b", ".hidden", ".."])
def test_a_name_that_is_not_a_plain_file_name_is_refused(tmp_path: Path, name: str) -> None:
    """--name with a separator, a leading dot or ``..``: exit 2, one line, nothing written."""
    spool = tmp_path / "spool"
    _job(spool, range(2))
    res = cli("ship", str(spool), "--once", "--to", f"jsonl:{tmp_path / 'o.jsonl'}",
              "--name", name)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "plain file name" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (spool / "cursors").exists() or not list((spool / "cursors").iterdir())


def test_the_printed_replay_command_runs_as_printed(tmp_path: Path) -> None:
    """A shipper started with a relative path in one directory; compact --delete --force
    removes what it had not shipped; the epilogue run elsewhere prints a replay command
    that, run as printed from there, fills the same file; the epilogue then exits 0."""
    spool, job_dir, user = tmp_path / "spool", tmp_path / "job", tmp_path / "user"
    job_dir.mkdir()
    user.mkdir()
    _job(spool, range(3))
    res = cli("ship", str(spool), "--once", "--quiet", "--to", "jsonl:o.jsonl", cwd=job_dir)
    assert res.returncode == 0, res.stderr
    _job(spool, range(3, 6))
    ds = tmp_path / "ds"
    assert cli("compact", str(spool), "--out", str(ds), "--delete", "--force").returncode == 0
    res = cli("ship", str(spool), "--once", "--quiet", cwd=user)
    assert res.returncode == 3, res.stderr
    command = res.stderr.split("`")[1]
    assert command.startswith("ranklog replay /") and f"--to=jsonl:{job_dir}/o.jsonl" in command
    args = command.split()[1:]
    again = cli(*args, cwd=user)
    assert again.returncode == 0, again.stderr
    assert not list(user.iterdir())
    assert _steps(job_dir / "o.jsonl") == list(range(6))
    res = cli("ship", str(spool), "--once", "--quiet", cwd=user)
    assert res.returncode == 0, res.stderr


def test_a_targets_presentation_options_are_kept_checked(tmp_path: Path) -> None:
    """Recorded target options the kind declares (``--gpu-names nemo``) are kept, checked
    as the command line checks them; a bad value, a place option and an unknown flag in
    the record are dropped; the epilogue's own option wins."""
    from ranklog.shippers._reopen import kept_options

    recorded = ["--to", "mlflow:x", "--gpu-names", "nemo", "--histogram-stats=mean,max",
                "--image-layout", "sideways", "--experiment", "other", "--exit-with", "1",
                "--per-rank", "--leave-out", "texts"]  # fmt: skip
    got = kept_options("mlflow", recorded)
    assert "--gpu-names=nemo" in got and "--leave-out=texts" in got
    assert not any(g.startswith(("--image-layout", "--experiment", "--exit-with", "--to"))
                   for g in got)  # fmt: skip
    assert kept_options("nosuchkind", recorded) == []


def test_a_run_appended_once_goes_on_in_the_epilogue(tmp_path: Path) -> None:
    """Run B shipped after run A into one file with --append-run, killed: the epilogue
    carries on (the file holds B's lines: --append-run was given once), every step of
    both once; a --below-last skip planted in the record is not obeyed."""
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "all.jsonl"
    _job(a, range(3))
    assert cli("ship", str(a), "--once", "--quiet", "--to", f"jsonl:{out}").returncode == 0
    _job(b, range(3))
    res = cli("ship", str(b), "--once", "--quiet", "--to", f"jsonl:{out}", "--append-run")
    assert res.returncode == 0, res.stderr
    _job(b, range(3, 6))
    path = next((b / "cursors").glob("*.json"))
    raw = json.loads(path.read_text())
    raw["argv"] += ["--below-last", "skip"]
    path.write_text(json.dumps(raw))
    res = cli("ship", str(b), "--once", "--quiet")
    assert res.returncode == 0, res.stderr
    assert _steps(out) == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    from ranklog._cli_ship import _kept_per_rank

    assert _kept_per_rank(argparse.Namespace(per_rank=False), raw["argv"]) == []


def test_other_mlflow_stores_are_re_created() -> None:
    """A Databricks workspace or a database store URI is re-created as recorded; a relative
    sqlite or a file store forged into a cursor is not."""
    from ranklog.errors import ConfigError
    from ranklog.shippers._reopen import reopen_flags

    assert reopen_flags("mlflow:databricks#experiment=/Users/me/e") == [
        "--to=mlflow:databricks", "--experiment=/Users/me/e"]  # fmt: skip
    assert reopen_flags("mlflow:postgresql://u@db/mlflow#run=abc")[0] == (
        "--to=mlflow:postgresql://u@db/mlflow")  # fmt: skip
    for forged in ("mlflow:sqlite:///rel.db#experiment=e", "mlflow:file:///x#experiment=e",
                   "jsonl:relative.jsonl", "jsonl:/a\nb"):  # fmt: skip
        with pytest.raises(ConfigError):
            reopen_flags(forged)
