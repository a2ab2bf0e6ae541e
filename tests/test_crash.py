"""Crashes and disk trouble: what a killed or starved producer leaves in the spool."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ranklog.schemas import Metrics, RankEnd, StepEnd
from ranklog.testing import bad_ranges, events_by_incarnation, read_events

from .conftest import python_env, run_python

# A rank that prints each step once step_end has returned, as fast as it can.
PRINTING_RANK = """
import sys, ranklog
run = ranklog.init(sys.argv[1], rank=int(sys.argv[2]), world_size=int(sys.argv[3]),
                   durability="step", flush_interval=3600)
step = 0
while True:
    run.log_metrics({"loss": 1.0 / (step + 1), "rank": float(run.rank)}, step=step)
    run.log_timing("step_time", 0.001 * step, step=step)
    run.step_end(step)
    print(step, flush=True)
    step += 1
"""


def _start(spool: Path, rank: int, world: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PRINTING_RANK, str(spool), str(rank), str(world)],
        env=python_env(),
        stdout=subprocess.PIPE,
        text=True,
    )


def _kill_after(proc: subprocess.Popen[str], seconds: float) -> int:
    """SIGKILL ``proc`` after ``seconds``; return the last step it printed."""
    time.sleep(seconds)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    printed = [int(x) for x in out.split()]
    assert printed, "the rank printed nothing before it was killed"
    return printed[-1]


def _check_everything_printed_is_there(spool: Path, rank: int, last: int) -> None:
    events = read_events(spool, rank=rank)
    closed = {e.step for e in events if isinstance(e, StepEnd)}
    metrics = {e.step for e in events if isinstance(e, Metrics)}
    assert set(range(last + 1)) <= closed, f"rank {rank} lost a closed step"
    assert set(range(last + 1)) <= metrics
    assert not any(isinstance(e, RankEnd) for e in events)


class TestSigkill:
    @pytest.mark.parametrize("seed", [1, 2, 3])
    def test_nothing_closed_is_lost(self, spool: Path, seed: int) -> None:
        """SIGKILL at a random moment loses nothing up to the last step_end that returned."""
        proc = _start(spool, 0, 1)
        last = _kill_after(proc, random.Random(seed).uniform(0.3, 1.5))
        _check_everything_printed_is_there(spool, 0, last)
        assert bad_ranges(spool) == [] or all(
            b.reason == "incomplete frame at end" for b in bad_ranges(spool)
        )

    def test_eight_ranks_at_once(self, spool: Path) -> None:
        """Eight ranks killed at once: each keeps every step it had closed."""
        procs = [_start(spool, r, 8) for r in range(8)]
        time.sleep(1.5)
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for rank, p in enumerate(procs):
            out, _ = p.communicate(timeout=30)
            printed = [int(x) for x in out.split()]
            assert printed
            _check_everything_printed_is_there(spool, rank, printed[-1])

    def test_restart_after_kill_is_a_new_incarnation(self, spool: Path) -> None:
        """A killed rank started again writes incarnation 2; incarnation 1 stays intact."""
        last = _kill_after(_start(spool, 0, 1), 0.5)
        proc = _start(spool, 0, 1)
        _kill_after(proc, 0.5)
        incs = events_by_incarnation(spool)
        assert sorted(incs) == [(0, 1), (0, 2)]
        closed = {e.step for e in incs[(0, 1)] if isinstance(e, StepEnd)}
        assert set(range(last + 1)) <= closed


class TestSigterm:
    def test_closes_and_chains_the_users_handler(self, spool: Path) -> None:
        """SIGTERM writes rank_end, then runs the handler the user had installed."""
        code = """
import os, signal, sys, time, ranklog
def handler(signum, frame):
    print("user handler ran", flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, handler)
run = ranklog.init(sys.argv[1], rank=0, world_size=1)
run.log_metrics({"x": 1.0}, step=0)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(10)
"""
        proc = run_python(code, str(spool))
        assert proc.returncode == 7 and "user handler ran" in proc.stdout
        end = read_events(spool)[-1]
        assert isinstance(end, RankEnd) and end.status == "signal" and end.exit_code == 143

    def test_default_action_still_terminates(self, spool: Path) -> None:
        """Without a user handler, SIGTERM still kills the process, after rank_end is written."""
        code = """
import os, signal, sys, time, ranklog
run = ranklog.init(sys.argv[1], rank=0, world_size=1)
run.log_metrics({"x": 1.0}, step=0)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(10)
print("survived")
"""
        proc = run_python(code, str(spool))
        assert proc.returncode == -signal.SIGTERM and "survived" not in proc.stdout
        assert [type(e).__name__ for e in read_events(spool)][-2:] == ["Metrics", "RankEnd"]

    def test_atexit_closes(self, spool: Path) -> None:
        """A script that never calls close() still ends its incarnation cleanly at exit."""
        proc = run_python(
            "import sys, ranklog; ranklog.init(sys.argv[1], rank=0).step_end(0)", str(spool)
        )
        assert proc.returncode == 0, proc.stderr
        end = read_events(spool)[-1]
        assert isinstance(end, RankEnd) and end.status == "exit"


class TestHowTheProgramEnded:
    """The status rank_end records at exit: what the program died of, if it did."""

    @pytest.mark.parametrize(
        ("tail", "status"),
        [("raise ValueError('boom')", "error"), ("raise KeyboardInterrupt", "interrupted"),
         ("sys.excepthook = lambda *a: print('own hook')\nraise ValueError('boom')", "error")],
        ids=["exception", "ctrl-c", "a-hook-of-its-own"],
    )  # fmt: skip
    def test_an_uncaught_exception(self, spool: Path, tail: str, status: str) -> None:
        """Dying of an exception (a hook of its own installed later too): error; of Ctrl-C:
        interrupted."""
        code = f"import sys, ranklog\nranklog.init(sys.argv[1], rank=0).step_end(0)\n{tail}\n"
        proc = run_python(code, str(spool))
        assert proc.returncode != 0
        end = read_events(spool)[-1]
        assert isinstance(end, RankEnd) and end.status == status, proc.stderr

    def test_an_error_in_a_repl_session_that_went_on(self, spool: Path) -> None:
        """In a REPL an error is printed and the session goes on: its exit is no failure."""
        code = "import sys, ranklog; ranklog.init(sys.argv[1], rank=0).step_end(0)"
        proc = subprocess.run(
            [sys.executable, "-i", "-c", code, str(spool)], input="1/0\nprint('went on')\n",
            env=python_env(), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0 and "ZeroDivisionError" in proc.stderr, proc.stderr
        assert "went on" in proc.stdout
        end = read_events(spool)[-1]
        assert isinstance(end, RankEnd) and end.status == "exit"


# The training loop keeps going while writes fail, then the disk recovers.
FSIZE_RANK = """
import resource, signal, sys, warnings, ranklog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # EFBIG instead of death
run = ranklog.init(sys.argv[1], rank=0, world_size=1, flush_interval=0.05)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(300):
        run.log_metrics({"loss": float(step), "pad": 1.0}, step=step)
        run.step_end(step)                           # must not raise
print("warnings:", len(caught), [str(w.message)[:60] for w in caught], flush=True)
print("error:", run._sink.error is not None, flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))   # the disk "recovers"
run.close()
print("closed", flush=True)
"""


class TestDiskTrouble:
    def test_file_size_limit_then_recovery(self, spool: Path) -> None:
        """Writes failing with EFBIG never reach training; everything is written after recovery."""
        proc = run_python(FSIZE_RANK, str(spool))
        assert proc.returncode == 0, proc.stderr
        assert "error: True" in proc.stdout and "closed" in proc.stdout
        assert "warnings: 1 " in proc.stdout and "cannot write" in proc.stdout
        steps = [e.step for e in read_events(spool) if isinstance(e, Metrics)]
        assert steps == list(range(300))
        assert isinstance(read_events(spool)[-1], RankEnd)
        assert bad_ranges(spool) == []

    @pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
    def test_full_tmpfs_then_space_freed(self, tmp_path: Path) -> None:
        """On a full filesystem (ENOSPC) training goes on; freeing space writes the backlog."""
        mnt = tmp_path / "small"
        mnt.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            check=False,
        )
        if mounted.returncode != 0:
            pytest.skip(f"this sandbox cannot mount a tmpfs: {mounted.stderr.strip()}")
        try:
            code = """
import os, sys, time, ranklog
spool, ballast = sys.argv[1], sys.argv[2]
run = ranklog.init(spool, rank=0, world_size=1, flush_interval=0.05)
with open(ballast, "wb") as f:                     # fill the disk
    try:
        while True:
            f.write(b"x" * 65536); f.flush()
    except OSError:
        pass
for step in range(200):
    run.log_metrics({"loss": float(step)}, step=step)
    run.step_end(step)
print("error:", run._sink.error is not None, flush=True)
os.unlink(ballast)                                  # space is freed
run.close()
print("closed", flush=True)
"""
            spool = mnt / "spool"
            proc = run_python(code, str(spool), str(mnt / "ballast"))
            assert proc.returncode == 0, proc.stderr
            assert "error: True" in proc.stdout and "closed" in proc.stdout
            copy = tmp_path / "copy"
            shutil.copytree(spool, copy)
            steps = [e.step for e in read_events(copy) if isinstance(e, Metrics)]
            assert steps == list(range(200))
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


# The disk refuses for longer than a heartbeat interval with a tiny buffer: no deadlock.
STARVED_RANK = """
import resource, signal, sys, threading, time, warnings, ranklog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
run = ranklog.init(sys.argv[1], rank=0, world_size=1, flush_interval=0.05,
                   heartbeat_interval=0.1, max_buffer_bytes=4096)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (200, hard))
threading.Timer(1.0, lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))).start()
warnings.simplefilter("ignore")
for step in range(400):
    run.log_metrics({"loss": float(step), "pad": 1.0}, step=step)   # waits while the disk refuses
    run.step_end(step)
run.close()
print("done", flush=True)
"""


class TestStarvedDisk:
    def test_backpressure_and_heartbeats_never_deadlock(self, spool: Path) -> None:
        """With the buffer full and the disk refusing past a heartbeat, training resumes."""
        proc = run_python(STARVED_RANK, str(spool), timeout=60)
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
        steps = [e.step for e in read_events(spool) if isinstance(e, Metrics)]
        assert steps == list(range(400))


class TestWriterFailures:
    def test_roll_resumes_after_failures(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Opening the next segment and writing its header may fail; retries lose nothing."""
        import errno

        from ranklog.spool import IncarnationWriter, SpoolLayout, _writer, ensure_run, read_segment

        from .spoolgen import step_events, write_frame

        writer = IncarnationWriter.create(SpoolLayout(spool), ensure_run(spool), 0,
                                          max_segment_bytes=2048)  # fmt: skip
        real_open, real_pwritev = os.open, os.pwritev
        fail = {"open": 0, "header": 0}

        def flaky_open(path: object, flags: int, *a: object) -> int:
            if fail["open"] and str(path).endswith("-000002.rlog"):
                fail["open"] -= 1
                raise OSError(errno.EDQUOT, "quota exceeded")
            return real_open(path, flags, *a)  # type: ignore[arg-type]

        def flaky_pwritev(fd: int, bufs: list[bytes], offset: int) -> int:
            if fail["header"] and offset == 0:
                fail["header"] -= 1
                real_pwritev(fd, [bytes(bufs[0])[:10]], 0)  # a torn header reaches the disk
                raise OSError(errno.ENOSPC, "no space")
            return real_pwritev(fd, bufs, offset)

        monkeypatch.setattr(_writer.os, "open", flaky_open)
        monkeypatch.setattr(_writer.os, "pwritev", flaky_pwritev)
        written, step = [], 0
        fail["open"], fail["header"] = 2, 2
        while step < 40:
            try:
                write_frame(writer, step_events(step))
            except OSError:
                continue  # the producer retries the same frame later
            written.append(step_events(step))
            step += 1
        writer.close()
        assert fail == {"open": 0, "header": 0}
        frames = []
        for seg in SpoolLayout(spool).segments(0):
            res = read_segment(seg.path)
            assert res.bad == [] and res.sealed, seg.path
            frames += [f.events for f in res.frames]
        assert frames == written
