"""Hostile and odd input: refused at log time with the key named, or skipped and reported in
spool data; never a crash, a hang, a file outside a target's directory, or a script run."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest

import ranklog
from ranklog.errors import ConfigError, InvalidStepError, InvalidValueError, RanklogWarning
from ranklog.producer._values import MAX_NAME_CHARS
from ranklog.shippers import Shipper, make_target
from ranklog.shippers._source import SpoolSource
from ranklog.shippers.targets.jsonl import JsonlTarget
from ranklog.spool import IncarnationWriter, SpoolLayout, ensure_run, read_run
from ranklog.spool._inspect import summarize
from ranklog.testing import bad_ranges, read_events

from .conftest import python_env
from .shiphelp import lines, log_steps, rank, ship
from .spoolgen import step_events, write_frame


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "out.jsonl"


class TestNames:
    @pytest.mark.parametrize(
        ("key", "says"),
        [
            ("a\x00b", "contains a control character"),
            ("loss\n", "contains a control character"),
            ("\x1b[31mred", "contains a control character"),
            ("x" * (MAX_NAME_CHARS + 1), f"more than {MAX_NAME_CHARS}"),
            ("bad\udc80", "is not valid Unicode"),
            ("", "is not a non-empty str"),
        ],
        ids=["nul", "newline", "escape", "10k", "surrogate", "empty"],
    )
    def test_refused_with_the_key_named_and_nothing_logged(
        self, spool: Path, key: str, says: str
    ) -> None:
        """A bad name in any logging call raises naming it; nothing of the call is written."""
        run = rank(spool, 0, 1)
        run.log_metrics({"ok": 1.0}, step=0)
        calls = [
            lambda: run.log_metrics({"fine": 1.0, key: 2.0}, step=1),
            lambda: run.log_timing(key, 0.1, step=1),
            lambda: run.log_text(key, "t", step=1),
            lambda: run.log_histogram(key, [1.0], step=1),
            lambda: run.log_image(key, b"\x89PNG", step=1),
            lambda: run.log_hyperparams({key: 1}),
        ]
        if key:  # an empty prefix is no prefix
            calls.append(lambda: run.log_metrics({"fine": 1.0}, step=1, prefix=key))
        for call in calls:
            with pytest.raises(InvalidValueError, match=says) as info:
                call()
            assert isinstance(info.value, TypeError)
        run.close()
        kinds = [type(e).__name__ for e in read_events(spool)]
        assert kinds == ["RankStart", "Metrics", "RankEnd"]

    def test_odd_but_fine_names_ship_as_given(self, spool: Path, out: Path) -> None:
        """Slashes, dots, unicode and 1,024-character names are names like any other."""
        names = ["a/b/c", "../../etc/passwd", "loss ✓ λ", "x" * MAX_NAME_CHARS, "a..b", "/lead"]
        run = rank(spool, 0, 1)
        run.log_metrics(dict.fromkeys(names, 1.5), step=0)
        run.step_end(0)
        run.close()
        ship(spool, out)
        assert lines(out)[0]["metrics"] == dict.fromkeys(sorted(names), 1.5)

    def test_image_format_is_a_file_extension(self, spool: Path) -> None:
        """An image format that is not a plain extension (a path, say) is refused."""
        run = rank(spool, 0, 1)
        with pytest.raises(InvalidValueError, match="is not a file extension"):
            run.log_image("plot", b"\x89PNG", step=0, format="png/../../x")
        run.close()


class TestSizes:
    def test_100k_keys_in_one_call(self, spool: Path, out: Path) -> None:
        """One call with 100,000 keys is logged and shipped whole, reduced across ranks."""
        keys = [f"k{i:06d}" for i in range(100_000)]
        for r in range(2):
            run = rank(spool, r, 2)
            run.log_metrics(dict.fromkeys(keys, float(r)), step=0)
            run.step_end(0)
            run.close()
        ship(spool, out)
        (line,) = lines(out)
        assert line["complete"] and len(line["metrics"]) == 100_000
        assert set(line["metrics"].values()) == {0.5}

    def test_more_than_a_frame_is_refused_whole(self, spool: Path) -> None:
        """A call larger than the 16 MiB frame cap raises; nothing of it is written."""
        run = rank(spool, 0, 1)
        big = {f"key-{i:09d}-{'p' * 16}": 1.0 for i in range(700_000)}
        with pytest.raises(InvalidValueError, match="more than a frame holds"):
            run.log_metrics(big, step=0)
        run.close()
        assert [type(e).__name__ for e in read_events(spool)] == ["RankStart", "RankEnd"]


class TestSteps:
    def test_largest_step_and_numpy_steps(self, spool: Path, out: Path, tmp_path: Path) -> None:
        """Step 2**63-1 and numpy integer steps are steps; 2**63 does not fit and is refused."""
        run = rank(spool, 0, 1)
        run.log_metrics({"x": 1.0}, step=np.int64(5))
        run.step_end(np.uint32(5))
        run.log_metrics({"x": 2.0}, step=2**63 - 1)
        with pytest.raises(InvalidStepError, match="64-bit"):
            run.log_metrics({"x": 3.0}, step=2**63)
        with pytest.raises(InvalidStepError):
            run.step_end(2**64)
        run.step_end(2**63 - 1)
        run.close()
        ship(spool, out)
        assert [x["step"] for x in lines(out)] == [5, 2**63 - 1]
        from ranklog.archive import compact

        compact(spool, tmp_path / "pq")  # int64 columns take it


class TestConcurrency:
    def test_threads_logging_at_once(self, spool: Path, out: Path) -> None:
        """Eight threads logging each step at once: every value there, every step whole."""
        run = rank(spool, 0, 1)
        steps, threads_n, calls = 20, 8, 50

        def work(t: int, step: int) -> None:
            for _ in range(calls):
                run.log_metrics({f"t{t}": float(t)}, step=step)
                run.log_metrics({"all": 1.0}, step=step, reduce="sum")

        for step in range(steps):
            threads = [threading.Thread(target=work, args=(t, step)) for t in range(threads_n)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            run.step_end(step)
        run.close()
        ship(spool, out)
        got = lines(out)
        assert [x["step"] for x in got] == list(range(steps))
        for x in got:
            assert x["complete"]
            assert x["metrics"]["all"] == float(threads_n * calls)
            assert x["metrics"]["t3"] == 3.0

    def test_counts_hold_under_threads(self, spool: Path, out: Path) -> None:
        """Threads logging while step_end closes steps: counts agree, no step marked partial."""
        run = rank(spool, 0, 1, durability="buffered")
        stop = threading.Event()

        def noise() -> None:
            while not stop.is_set():
                run.log_metrics({"noise": 1.0}, step=10**6)  # a far step: always open

        th = threading.Thread(target=noise)
        th.start()
        for s in range(200):
            run.log_metrics({"x": 1.0}, step=s)
            run.step_end(s)
        stop.set()
        th.join()
        run.close()
        ship(spool, out)
        assert all(x["complete"] for x in lines(out) if x["step"] < 200)

    def test_fork_after_init_leaves_the_parent_alone(self, spool: Path, out: Path) -> None:
        """A forked child's logging is ignored (one warning); the parent's segment is intact."""
        run = rank(spool, 0, 1)
        run.log_metrics({"x": 1.0}, step=0)
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for s in range(50):
                        run.log_metrics({"x": 99.0}, step=s)
                        run.step_end(s)
                    run.close()
                code = 0 if any("forked child" in str(w.message) for w in caught) else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        run.step_end(0)
        run.log_metrics({"x": 2.0}, step=1)
        run.step_end(1)
        run.close()
        assert bad_ranges(spool) == []
        ship(spool, out)
        assert [(x["step"], x["metrics"]["x"]) for x in lines(out)] == [(0, 1.0), (1, 2.0)]


class TestSameRankTwice:
    HOLD = """
import sys, time, ranklog
run = ranklog.init(sys.argv[1], rank=0, world_size=2, heartbeat_interval=0.2, host=sys.argv[2])
run.log_metrics({"x": 1.0}, step=0)
run.step_end(0)
print("ready", flush=True)
time.sleep(float(sys.argv[3]))
run.close()
"""

    def test_an_init_that_fails_gives_the_rank_back(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """init failing after its claim (no thread could start) leaves no claim behind."""
        import ranklog
        from ranklog.producer import _run

        def no_thread(*_: object, **__: object) -> None:
            raise RuntimeError("can't start new thread")

        with monkeypatch.context() as m:
            m.setattr(_run, "SpoolSink", no_thread)
            with pytest.raises(RuntimeError, match="new thread"):
                ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)  # not refused
        run.close()

    def test_a_second_live_process_on_this_host_is_refused(self, spool: Path) -> None:
        """While a process of this host writes rank 0, init(rank=0) elsewhere is a ConfigError."""
        import socket

        proc = subprocess.Popen([sys.executable, "-c", self.HOLD, str(spool),
                                 socket.gethostname(), "30"], env=python_env(),
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            with pytest.raises(ConfigError, match=f"rank 0 is being written by pid {proc.pid}"):
                ranklog.init(spool, rank=0, world_size=2, handle_signals=False)
            assert len(list((spool / "ranks" / "00000").glob("*.rlog"))) == 1  # nothing claimed
        finally:
            proc.kill()
            proc.wait()
        ranklog.init(spool, rank=0, world_size=2, handle_signals=False).close()  # once it died

    def test_the_first_process_warns_when_another_takes_its_rank(self, spool: Path) -> None:
        """A rank taken by a process elsewhere (or at the same moment): the older one warns."""
        proc = subprocess.Popen([sys.executable, "-c", self.HOLD, str(spool), "node-a", "3"],
                                env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with pytest.warns(RanklogWarning, match="by pid .* on node-a"):  # the newer one too
            other = ranklog.init(spool, rank=0, world_size=2, handle_signals=False, host="node-b")
        _, err = proc.communicate(timeout=30)
        other.close()
        assert "another process started as rank 0 (incarnation 2)" in err
        (first, second) = summarize(spool).incarnations
        assert first.state.startswith("conflict: still written after incarnation 2 started")
        assert second.state == "ended (ok)"

    RACE = """
import os, sys, time, ranklog
from ranklog.errors import ConfigError
while time.time() < float(sys.argv[2]):
    pass
try:
    run = ranklog.init(sys.argv[1], rank=0, world_size=1, handle_signals=False)
except ConfigError as exc:
    print("refused:", exc, flush=True)
    sys.exit(0)
print("claimed", flush=True)
time.sleep(1.5)
run.close()
"""

    @pytest.mark.parametrize("trial", range(3))
    def test_two_processes_at_the_same_instant(self, spool: Path, trial: int) -> None:
        """Two processes of this host claim rank 0 at once: exactly one gets it."""
        ranklog.init(spool, rank=1, world_size=2, handle_signals=False).close()  # run.json
        at = str(time.time() + 1.0)
        procs = [subprocess.Popen([sys.executable, "-c", self.RACE, str(spool), at],
                                  env=python_env(), stdout=subprocess.PIPE, text=True)
                 for _ in range(2)]  # fmt: skip
        outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
        assert outs[0] == "claimed", outs
        assert outs[1].startswith("refused: rank 0 is being written by pid"), outs
        assert len(list((spool / "ranks" / "00000").glob("*.rlog"))) == 1

    def test_init_twice_in_one_process(self, spool: Path) -> None:
        """init(rank=0) while this process's rank 0 is open is refused; after close() it is not."""
        first = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        with pytest.raises(ConfigError, match="already open in this process"):
            ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        first.close()
        ranklog.init(spool, rank=0, world_size=1, handle_signals=False).close()


class TestWorldSize:
    def test_world_size_shrinks_between_incarnations(self, spool: Path, out: Path) -> None:
        """4 ranks, then 2 (elastic): later steps ship, partial against the largest world seen."""
        for r in range(4):
            run = rank(spool, r, 4)
            for s in range(5):
                run.log_metrics({"x": 1.0}, step=s)
                run.step_end(s)
            run.close()
        for r in range(2):
            run = rank(spool, r, 2)
            for s in range(5, 10):
                run.log_metrics({"x": 1.0}, step=s)
                run.step_end(s)
            run.close()
        ship(spool, out)
        got = [(x["step"], x["ranks"], x["world_size"], x["complete"]) for x in lines(out)]
        assert got == [(s, 4, 4, True) for s in range(5)] + [(s, 2, 4, False) for s in range(5, 10)]


class TestSegmentReplaced:
    def _spool(self, spool: Path) -> list[Path]:
        info = ensure_run(spool, world_size=1)
        w = IncarnationWriter.create(SpoolLayout(spool), info, 0, max_segment_bytes=1024)
        for s in range(40):
            write_frame(w, step_events(s))
        w.close()
        return sorted((spool / "ranks" / "00000").iterdir())

    def _ship_in_time(self, spool: Path, out: Path) -> Shipper:
        shipper = Shipper(str(spool), JsonlTarget(out), name="t", start_grace=0, dead_after=3600)
        th = threading.Thread(target=shipper.run_forever, kwargs={"once": True})
        th.start()
        th.join(timeout=30)
        assert not th.is_alive(), "the shipper hangs"
        return shipper

    @staticmethod
    def _replace(victim: Path, kind: str) -> None:
        victim.unlink()
        if kind == "fifo":
            os.mkfifo(victim)
        elif kind == "device":
            try:
                os.mknod(victim, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
            except PermissionError:
                pytest.skip("mknod needs root (CI runs the suite as root)")
        else:
            victim.symlink_to("/dev/zero")

    @pytest.mark.parametrize("kind", ["fifo", "device", "symlink"])
    def test_replaced_once_known(
        self, spool: Path, kind: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A segment the shipper knows, replaced by a FIFO, a device or a link: named, no hang."""
        import ranklog.shippers._tail as tail_mod

        segs = self._spool(spool)
        monkeypatch.setattr(tail_mod, "ROUND_BYTES", 128)  # a round reads a frame or two
        tail = tail_mod.RankTail(SpoolSource(spool), read_run(spool), dead_after=3600)
        tail.poll()  # segment 1 partly read; segments 2 and 3 known, not read
        self._replace(segs[1], kind)
        done = threading.Event()

        def drain() -> None:
            while tail.poll().progressed:
                pass
            done.set()

        threading.Thread(target=drain, daemon=True).start()
        assert done.wait(30), "the reader hangs"
        why = {b.reason for b in tail.commit(-1, params_pending=False).bad}
        assert why & {"not a regular file", "cannot open: symbolic link refused"}, why

    @pytest.mark.parametrize("kind", ["fifo", "device", "symlink"])
    def test_replaced_before_discovery(self, spool: Path, tmp_path: Path, kind: str) -> None:
        """Not a regular file, not a segment: steps of the others ship, the lost ones partial."""
        segs = self._spool(spool)
        self._replace(segs[1], kind)
        out = tmp_path / "a.jsonl"
        self._ship_in_time(spool, out)
        got = lines(out)
        assert got and all(x["complete"] == (x["ranks"] == 1) for x in got)
        assert any(not x["complete"] for x in got)  # the frames of segment 2: partial


class TestManyRanks:
    def test_5000_rank_files(self, spool: Path, out: Path) -> None:
        """5,000 ranks of one run: every step ships complete, reduced over all of them."""
        n = 5000
        info = ensure_run(spool, world_size=n)
        layout = SpoolLayout(spool)
        for r in range(n):
            w = IncarnationWriter.create(layout, info, r, world_size=n)
            write_frame(w, [*step_events(0, r), *step_events(1, r)])
            w.close(sync=False)
        ship(spool, out)
        got = lines(out)
        assert [(x["step"], x["ranks"], x["complete"]) for x in got] == [(0, n, True), (1, n, True)]
        assert got[0]["metrics"]["rank"] == pytest.approx((n - 1) / 2)


class TestBackendPaths:
    def test_names_never_become_paths_outside_the_target(self, spool: Path, tmp_path: Path) -> None:
        """Text and image names with ../ stay inside each backend's own directory."""
        pytest.importorskip("mlflow", reason="installed by ./tools/test (extra ranklog[mlflow])")
        pytest.importorskip("wandb", reason="installed by ./tools/test (extra ranklog[wandb])")
        escape = f"../../../../../../../../tmp/ranklog-escape-{uuid.uuid4().hex}"
        png = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02"
               b"\x00\x00\x00\x90wS\xde\x00\x00\x00\x0cIDATx\x9cc\xf8\xff\xff?\x00\x05\xfe\x02"
               b"\xfe\xa7\x35\x81\x84\x00\x00\x00\x00IEND\xaeB`\x82")  # fmt: skip
        run = rank(spool, 0, 1)
        run.log_text(escape, "<script>alert(1)</script>", step=0)
        run.log_image(escape, png, step=0)
        run.log_metrics({escape: 1.0}, step=0)
        run.step_end(0)
        run.close()
        work = tmp_path / "work"
        before = {p for p in tmp_path.rglob("*")}
        env_mode = os.environ.get("WANDB_MODE")
        os.environ["WANDB_MODE"] = "offline"
        try:
            for spec in (f"tensorboard:{work / 'tb'}", f"mlflow:sqlite:///{work / 'm.db'}",
                         "wandb:escape", f"jsonl:{work / 'o.jsonl'}"):  # fmt: skip
                opts = {"dir": str(work / "wandb")} if spec.startswith("wandb") else {}
                target = make_target(spec, work, opts)
                Shipper(str(spool), target, name=spec.partition(":")[0],
                        start_grace=0).run_forever(once=True)  # fmt: skip
        finally:
            if env_mode is None:
                os.environ.pop("WANDB_MODE", None)
            else:
                os.environ["WANDB_MODE"] = env_mode
        outside = {p for p in tmp_path.rglob("*") if work not in p.parents and p != work} - before
        assert not {p for p in outside if spool not in p.parents}, outside
        assert not Path(escape.split("/")[-1]).exists()
        assert not list(Path("/tmp").glob("ranklog-escape-*"))


class TestCursorDiskFull:
    """The spool's disk fills up while a shipper follows the job (its cursor cannot be written)."""

    @staticmethod
    def _failing_commits(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[int]:
        calls: list[int] = []
        real = Shipper._commit

        def commit(self: Shipper) -> None:
            calls.append(1)
            if len(calls) <= failures:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(self)

        monkeypatch.setattr(Shipper, "_commit", commit)
        return calls

    def test_full_disk_at_the_last_commit_is_waited_out(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """ENOSPC on the final cursor write is retried, not fatal; every step once."""
        run = rank(spool, 0, 1)
        log_steps(run, range(5))
        run.close()
        calls = self._failing_commits(monkeypatch, 2)
        shipper = ship(spool, tmp_path / "out.jsonl")
        assert len(calls) >= 3 and shipper.shipped_upto == 4
        assert [x["step"] for x in lines(tmp_path / "out.jsonl")] == list(range(5))

    def test_full_disk_in_the_loop_keeps_following(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """ENOSPC on a cursor write inside the loop is a retried failure, not an exit."""
        run = rank(spool, 0, 1)
        run.flush()  # the rank's start only: a first round reads frames and ships nothing
        calls = self._failing_commits(monkeypatch, 1)
        shipper = Shipper(str(spool), JsonlTarget(tmp_path / "out.jsonl"), name="t",
                          dead_after=3600, start_grace=0)  # fmt: skip
        monkeypatch.setattr(shipper, "_last_commit", -1e9)  # the periodic commit is due

        def finish_later() -> None:
            time.sleep(1.0)
            log_steps(run, range(6))
            run.close()

        writer = threading.Thread(target=finish_later)
        writer.start()
        assert shipper.run_forever(max_seconds=60) == 0
        writer.join()
        assert calls and [x["step"] for x in lines(tmp_path / "out.jsonl")] == list(range(6))
