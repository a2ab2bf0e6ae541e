"""One shipper per (spool, target): a second is refused, a dead one's lease is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ranklog
from ranklog.errors import LeaseHeldError
from ranklog.shippers import default_name
from ranklog.shippers._lease import Lease

from .conftest import python_env
from .shiphelp import lines, rank


def _shipper(spool: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", f"jsonl:{out}",
           "--quiet", "--poll", "0.1", "--dead-after", "3600", *extra]  # fmt: skip
    return subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for(cond: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def live(spool: Path) -> Iterator[ranklog.Run]:
    """A live rank (never closed while the test runs) that has closed steps 0..9."""
    run = rank(spool, 0, 1)
    for step in range(10):
        run.log_metrics({"loss": float(step)}, step=step)
        run.step_end(step)
    yield run
    run.close()


def _more(run: ranklog.Run, steps: range) -> None:
    for step in steps:
        run.log_metrics({"loss": float(step)}, step=step)
        run.step_end(step)


def _exactly_once(out: Path, n: int) -> None:
    assert [x["step"] for x in lines(out)] == list(range(n))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


class TestLease:
    def test_a_second_shipper_is_refused(
        self, spool: Path, tmp_path: Path, live: ranklog.Run
    ) -> None:
        """While one shipper follows a target, another for it exits 3 naming the holder."""
        out = tmp_path / "out.jsonl"
        first = _shipper(spool, out, "--lease-ttl", "5")
        try:
            _wait_for(lambda: len(lines(out)) == 10)
            for extra in ([], ["--name", "other"]):  # another cursor name: same target
                second = _shipper(spool, out, "--lease-ttl", "5", *extra)
                _, err = second.communicate(timeout=60)
                assert second.returncode == 3, err
                assert "another shipper holds" in err and f"pid {first.pid}" in err
            _more(live, range(10, 20))
            _wait_for(lambda: len(lines(out)) == 20)
            _exactly_once(out, 20)
        finally:
            _stop(first)

    def test_a_killed_holder_is_taken_over_at_once(
        self, spool: Path, tmp_path: Path, live: ranklog.Run
    ) -> None:
        """A holder SIGKILLed on this host is dead: the next shipper takes over without waiting."""
        out = tmp_path / "out.jsonl"
        first = _shipper(spool, out, "--lease-ttl", "60")
        _wait_for(lambda: len(lines(out)) == 10)
        first.kill()
        first.wait()
        _more(live, range(10, 15))
        started = time.monotonic()
        second = _shipper(spool, out, "--lease-ttl", "60")
        try:
            _wait_for(lambda: len(lines(out)) == 15)
            assert time.monotonic() - started < 20  # not the 60 s of a silent holder
            _exactly_once(out, 15)
        finally:
            _stop(second)

    def test_a_silent_holder_elsewhere_is_taken_over_after_the_ttl(
        self, spool: Path, tmp_path: Path, live: ranklog.Run
    ) -> None:
        """A lease of another host that is never renewed is taken over once ttl passed."""
        out = tmp_path / "out.jsonl"
        lease = spool / "cursors" / f"{default_name(f'jsonl:{out}')}.lease"
        lease.parent.mkdir(parents=True, exist_ok=True)
        lease.write_text(json.dumps({"holder": "gone:1:x", "host": "gone", "pid": 1,
                                     "renewals": 0}))  # fmt: skip
        started = time.monotonic()
        proc = _shipper(spool, out, "--lease-ttl", "1.5", "--once")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert time.monotonic() - started >= 1.5
        assert "taking over the lease of a dead shipper (host gone, pid 1)" in err
        _exactly_once(out, 10)
        assert not lease.exists()  # released at the end

    def test_a_stopped_holder_loses_and_sends_nothing_more(
        self, spool: Path, tmp_path: Path, live: ranklog.Run
    ) -> None:
        """A holder stopped past its ttl is taken over; resumed, it stops without a write."""
        out = tmp_path / "out.jsonl"
        first = _shipper(spool, out, "--lease-ttl", "1")
        second = None
        try:
            _wait_for(lambda: len(lines(out)) == 10)
            os.kill(first.pid, signal.SIGSTOP)
            _more(live, range(10, 20))
            second = _shipper(spool, out, "--lease-ttl", "1")
            _wait_for(lambda: len(lines(out)) == 20)
            os.kill(first.pid, signal.SIGCONT)
            _, err = first.communicate(timeout=60)
            assert first.returncode == 3, err
            assert "lost the lease" in err
            _more(live, range(20, 25))
            _wait_for(lambda: len(lines(out)) == 25)
            _exactly_once(out, 25)
        finally:
            os.kill(first.pid, signal.SIGCONT) if first.poll() is None else None
            _stop(first)
            if second is not None:
                _stop(second)


class TestLeaseObject:
    def test_two_takers_one_winner(self, spool: Path) -> None:
        """Of several processes taking over a dead lease at once, exactly one holds it."""
        ranklog.init(spool, rank=0, handle_signals=False).close()
        dead = Lease(spool, "t", target="t", ttl=1.0)
        dead.path.parent.mkdir(parents=True, exist_ok=True)
        dead._write(replace=True)  # a lease whose holder never renews it
        results: list[str] = []

        def take() -> None:
            lease = Lease(spool, "t", target="t", ttl=1.0)
            lease.host = "elsewhere"  # not this host: liveness by renewals only
            try:
                lease.acquire()
                results.append("held")
                time.sleep(2.0)
                lease.check()
                results.append("kept")
                lease.release()
            except LeaseHeldError:
                results.append("refused")

        threads = [threading.Thread(target=take) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results).count("kept") == 1, results
