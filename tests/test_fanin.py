"""The Ray fan-in: partials merge exactly, and ``ranklog ship --ray`` equals one shipper.

The Ray tests run against a real local head (``tests/ray_cluster.py``: 127.0.0.1,
``num_cpus=2``); the spool is written by a separate process of 16 ranks, and the
single-process shipper's JSONL is the oracle, byte for byte.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ranklog.schemas import Gpu, Metrics, Text, Timer
from ranklog.shippers._fanin import FanIn, RayTails, TailReader
from ranklog.shippers._reduce import Partial, exact_parts
from ranklog.shippers._steps import Contribution, StepAcc, StepPartial
from ranklog.shippers.targets.jsonl import read_jsonl
from ranklog.spool import read_run

from .conftest import ROOT
from .ray_cluster import RayHead, ray_env
from .shiphelp import lines, reduce_step

WORLD = 16

floats = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.floats(min_value=-1e6, max_value=1e6),
    st.sampled_from([0.1, 0.2, 0.3, 1e16, -1e16, 1.0, math.nan, math.inf]),
)


def write_job(spool: str, steps: int, pace: float) -> None:
    """16 ranks on two "hosts" logging every kind of step event; ``pace`` s per step."""
    import ranklog

    class HostGpus:
        """Two GPUs of one host; utilisation follows the sample count."""

        name = "fake"

        def __init__(self, host: str) -> None:
            self.host, self.n = host, 0

        def sample(self) -> list[Gpu]:
            self.n += 1
            return [
                Gpu(time.time(), self.host, i, util=float((self.n * 7 + i) % 100),
                    mem_used=(self.n % 5 + 1) << 30, mem_total=80 << 30, name="H200")
                for i in range(2)
            ]  # fmt: skip

        def close(self) -> None: ...

    rng = random.Random(11)
    runs = [
        ranklog.init(
            spool, rank=r, world_size=WORLD, local_rank=r % 8, handle_signals=False,
            gpu=HostGpus(f"node{r // 8}") if r % 8 == 0 else "off", gpu_interval=0.02,
        )
        for r in range(WORLD)
    ]  # fmt: skip
    runs[0].log_hyperparams({"lr": 3e-4, "model": {"layers": 4}})
    for step in range(steps):
        for r, run in enumerate(runs):
            vals = {f"m{i}": rng.random() * 10 ** rng.randint(-8, 8) for i in range(6)}
            vals["gnorm"] = math.nan if (r == 3 and step % 37 == 0) else rng.gauss(1.0, 0.5)
            run.log_metrics(vals, step=step)
            run.log_metrics(
                {"loss": rng.random()}, step=step,
                reduce=("mean", "median", "std", "min", "max", "last", "count", "sum"),
            )  # fmt: skip
            run.log_timing("fwd", rng.random(), step)
            if step % 25 == 0:
                run.log_text("sample", f"rank {r} at {step}", step)
                run.log_histogram("weights", [rng.gauss(0, 1) for _ in range(8)], step)
            run.step_end(step)
        if step == steps // 2:
            runs[1].log_hyperparams({"lr": 1e-4})  # a change mid-run, from another rank
        if pace:
            time.sleep(pace)
    for run in runs:
        run.close()


def spawn_job(spool: Path, steps: int, pace: float) -> subprocess.Popen[bytes]:
    code = f"from tests.test_fanin import write_job; write_job({str(spool)!r}, {steps}, {pace})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ray_env())


def ship(spool: Path, out: Path, *extra: str, timeout: float = 240) -> None:
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", f"jsonl:{out}",
           "--quiet", "--dead-after", "600", *extra]  # fmt: skip
    res = subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, timeout=timeout,
                         check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]


class TestExactMerge:
    @given(st.lists(floats, max_size=40), st.integers(1, 5), st.randoms(use_true_random=False))
    @settings(max_examples=300, deadline=None)
    def test_merged_exact_sum_is_the_one_pass_sum(
        self, values: list[float], groups: int, rnd: random.Random
    ) -> None:
        """Partials of any split of the values merge into fsum's correctly rounded sum."""
        parts = [values[i::groups] for i in range(groups)]
        rnd.shuffle(parts)
        ops = ("mean", "sum", "min", "max", "count")
        merged = Partial.of(parts[0], last=(0.0, 0, 0.0), ops=ops, exact=True)
        for p in parts[1:]:
            merged = merged.merge(Partial.of(p, last=(0.0, 0, 0.0), ops=ops, exact=True))
        whole = Partial.of(values, last=(0.0, 0, 0.0), ops=ops)
        for op in ops:
            a, b = merged.result(op), whole.result(op)
            assert a == b or (math.isnan(a) and math.isnan(b)), (op, a, b)

    def test_exact_parts_hold_what_rounding_loses(self) -> None:
        """1e16 + 1.0 + 1.0 keeps both ones, as math.fsum does."""
        assert math.fsum(exact_parts([1e16, 1.0, 1.0])) == math.fsum([1e16, 1.0, 1.0]) == 1e16 + 2
        assert math.fsum(exact_parts([1e16, 1.0]) + exact_parts([1.0])) == 1e16 + 2


class TestStepPartial:
    @staticmethod
    def acc(rng: random.Random, ranks: list[int]) -> StepAcc:
        acc = StepAcc()
        for r in ranks:
            c = Contribution(0)
            c.events.append(Metrics(100.0 + rng.random(), 4, {"a": rng.random() * 1e8,
                            "b": rng.choice([0.1, 0.2, 0.3])}, "mean,median,last"))  # fmt: skip
            c.events.append(Timer(101.0 + rng.random(), 4, "fwd", rng.choice([1.0, 2.0])))
            c.events.append(Text(102.0, 4, "t", f"r{r}"))
            if r % 4 == 0:
                c.events.append(Gpu(103.0, f"h{r // 4}", 0, util=float(r), mem_used=r))
            acc.ranks[r] = c
        return acc

    @pytest.mark.parametrize("shards", [1, 2, 3, 7])
    def test_shards_merge_into_the_single_step(self, shards: int) -> None:
        """Any sharding of the ranks, merged in any order, finishes into the same step."""
        rng = random.Random(shards)
        whole = self.acc(rng, list(range(16)))
        expected = reduce_step(4, whole, closed=16, world_size=16, per_rank=True)
        pieces = []
        for i in range(shards):
            sub = StepAcc({r: c for r, c in whole.ranks.items() if r % shards == i})
            pieces.append(StepPartial.build(4, sub, per_rank=True, exact=True))
        rng.shuffle(pieces)
        merged = pieces[0]
        for p in pieces[1:]:
            merged = merged.merge(p)
        assert merged.finish(closed=16, world_size=16) == expected


def write_mixed(spool: Path) -> None:
    """4 ranks that disagree on reduce specs, a NaN timer, late values and a requeue."""
    from .shiphelp import rank

    specs = ["mean,median,std,last", "mean", "mean,median,std,last", "mean"]
    runs = [rank(spool, r, 4) for r in range(4)]
    runs[0].log_hyperparams({"lr": 0.1})
    for step in range(20):
        for r, run in enumerate(runs):
            run.log_metrics({"x": float(r * 3 + step)}, step=step, reduce=specs[r])
            run.log_timing("fwd", math.nan if r == 1 else float(r % 3), step, reduce="mean")
            run.step_end(step)
        if step == 10:
            with pytest.warns(UserWarning, match="reported as late"):
                runs[2].log_metrics({"x": 99.0}, step=3)  # late: rank 2 closed step 3
            with pytest.warns(UserWarning, match="reported as late"):  # other ops, other reader
                runs[1].log_metrics({"x": 7.0}, step=3, reduce="median,std,last")
            runs[3].log_hyperparams({"lr": 0.05})
        if step == 12:
            runs[1].close()
            runs[1] = rank(spool, 1, 4)  # requeued: a new incarnation, resumed at step 9
            for again in range(9, 13):
                runs[1].log_metrics({"x": -1.0}, step=again, reduce=specs[1])  # re-logged
                runs[1].step_end(again)
    for run in runs:
        run.close()


class InProcessTails(RayTails):
    """The fan-in's root side over TailReader objects in this process: restarts on demand."""

    def __init__(
        self, spool: Path, readers: int, faults: dict[tuple[str, int], int], late: str = "count"
    ) -> None:
        super().__init__(
            str(spool), "fan", FanIn(readers=readers), poll=None, dead_after=3600, late=late
        )
        self.faults = faults  # (method, nth call) -> reader that starts a new life first
        self.calls: dict[str, int] = {}

    def open(self, run: Any, cursor: Any) -> None:
        self.cursor = cursor
        self.readers = [self._life(i) for i in range(self.layout.readers)]
        self._tokens = [""] * len(self.readers)
        self._committed = [cursor.last_step] * len(self.readers)

    def _life(self, i: int) -> TailReader:
        return TailReader(self.spool, self.name, (i, self.layout.readers), None, 3600, self.late)

    def _all(self, method: str, *args: Any, readers: list[Any] | None = None) -> list[Any]:
        self.calls[method] = n = self.calls.get(method, 0) + 1
        who = self.faults.get((method, n))
        if who is not None:  # as Ray does: the call goes to the new life
            old, self.readers[who] = self.readers[who], self._life(who)
            readers = (
                None if readers is None else [self.readers[who] if r is old else r for r in readers]
            )
        return [getattr(r, method)(*args) for r in (self.readers if readers is None else readers)]

    def close(self) -> None:
        self.readers = []


def ship_in_process(spool: Path, out: Path, tails: Any = None, late: str = "count") -> Any:
    from ranklog.shippers import Shipper
    from ranklog.shippers.targets.jsonl import JsonlTarget

    name = "fan" if tails is not None else "one"
    shipper = Shipper(str(spool), JsonlTarget(out), name=name, dead_after=3600, start_grace=0,
                      tails=tails, late=late)  # fmt: skip
    shipper.run_forever(once=True)
    return shipper


class TestFanInRounds:
    """The fan-in's rounds without Ray: readers in this process, restarted at chosen calls."""

    @pytest.mark.parametrize("late", ["count", "ship"])
    @pytest.mark.parametrize(
        "faults",
        [{}, {("poll", 2): 0}, {("partials", 1): 1}, {("partials", 2): 0}, {("commit", 1): 1},
         {("commit", 2): 0, ("poll", 4): 1}],
        ids=["none", "poll", "partials-1", "partials-2", "commit", "commit-then-poll"],
    )  # fmt: skip
    def test_restarts_change_nothing(
        self,
        tmp_path: Path,
        faults: dict[tuple[str, int], int],
        late: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Readers restarted at any call: output and counters equal the single shipper's."""
        import ranklog.shippers._engine as engine

        monkeypatch.setattr(engine, "BATCH_STEPS", 4)  # many rounds, many commits
        spool = tmp_path / "spool"
        write_mixed(spool)
        one = ship_in_process(spool, tmp_path / "one.jsonl", late=late)
        tails = InProcessTails(spool, 2, faults, late)
        fan = ship_in_process(spool, tmp_path / "fan.jsonl", tails, late=late)
        assert (tmp_path / "fan.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
        carried = [x for x in lines(tmp_path / "one.jsonl") if "shipped_with" in x]
        assert [(x["step"], x["shipped_with"]) for x in carried] == (
            [(3, 11), (9, 13), (10, 13), (11, 13), (12, 13)] if late == "ship" else []
        )
        assert (fan.stats.late_events, fan.stats.relogged_events) == (
            one.stats.late_events, one.stats.relogged_events,
        ) == (2, 4)  # fmt: skip
        if late == "ship":  # the lowest rank's ops, as one shipper reduces them
            assert carried[0]["metrics"] == {"x/median": 53.0, "x/std": 46.0, "x/last": 7.0}

    def test_specs_and_nan_timers_as_one_shipper(self, tmp_path: Path) -> None:
        """Ranks of different readers asking for other ops, and NaN timers: same values."""
        spool = tmp_path / "spool"
        write_mixed(spool)
        ship_in_process(spool, tmp_path / "one.jsonl")
        ship_in_process(spool, tmp_path / "fan.jsonl", InProcessTails(spool, 2, {}))
        one = [x for x in read_jsonl(tmp_path / "one.jsonl") if "step" in x]
        fan = [x for x in read_jsonl(tmp_path / "fan.jsonl") if "step" in x]
        assert one[5]["metrics"]["x/median"] == statistics.median([5.0, 8.0, 11.0, 14.0])
        assert one[5]["metrics"]["timing/fwd/slowest_rank"] == 2.0  # NaN never the slowest
        assert json.dumps(fan) == json.dumps(one)


@pytest.fixture
def head(ray_head: RayHead) -> RayHead:
    return ray_head


class TestRayFanIn:
    def test_sixteen_ranks_equal_the_single_shipper(self, tmp_path: Path, head: RayHead) -> None:
        """16 ranks shipped with --ray and 2 readers: the single shipper's JSONL, byte for byte."""
        spool = tmp_path / "spool"
        job = spawn_job(spool, steps=120, pace=0.0)
        assert job.wait(timeout=180) == 0
        ship(spool, tmp_path / "one.jsonl", "--once")
        ship(spool, tmp_path / "ray.jsonl", "--once", "--ray", head.address, "--readers", "2")
        one = (tmp_path / "one.jsonl").read_bytes()
        assert b'{"step": 119, ' in one and b'"gpu": [' in one and b'"lr": 0.0001' in one
        assert b'{"step": 120, ' not in one  # GPU samples after the last step make no step
        assert (tmp_path / "ray.jsonl").read_bytes() == one

    def test_append_run_reaches_the_root_actor(self, tmp_path: Path, head: RayHead) -> None:
        """``--ray --append-run``: the second run follows the first in one file, as without Ray."""
        from .shiphelp import log_steps, rank

        out, spools = tmp_path / "o.jsonl", [tmp_path / "a", tmp_path / "b"]
        for spool in spools:
            run = rank(spool, 0, 1)
            log_steps(run, range(3))
            run.close()
        ship(spools[0], out, "--once")
        ship(spools[1], out, "--once", "--ray", head.address, "--append-run")
        runs = [x["ranklog"]["run_id"] for x in read_jsonl(out) if "ranklog" in x]
        assert runs == [read_run(s).run_id for s in spools]
        assert [x["step"] for x in lines(out)] == [0, 1, 2, 0, 1, 2]

    def test_a_reader_killed_mid_run_changes_nothing(self, tmp_path: Path, head: RayHead) -> None:
        """A reader actor killed (and restarted by Ray) while a live job ships changes no byte."""
        import ray

        spool = tmp_path / "spool"
        out = tmp_path / "ray.jsonl"
        job = spawn_job(spool, steps=300, pace=0.02)
        deadline = time.monotonic() + 60
        while not (spool / "run.json").exists():
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.05)
        cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", f"jsonl:{out}",
               "--quiet", "--dead-after", "600", "--start-grace", "600", "--ray", head.address,
               "--readers", "2", "--name", "live"]  # fmt: skip
        shipper = subprocess.Popen(cmd, env=ray_env(), stderr=subprocess.PIPE)
        from ranklog.shippers._fanin import NAMESPACE, reader_name

        run_id = read_run(spool).run_id
        ray.init(address=head.address, namespace=NAMESPACE, log_to_driver=False)
        try:
            deadline = time.monotonic() + 120
            while True:  # some steps shipped, many to go
                shipped = out.read_bytes().count(b'"step": ') if out.exists() else 0
                if shipped >= 20:
                    break
                assert time.monotonic() < deadline, "the fan-in shipped nothing"
                assert shipper.poll() is None, shipper.stderr.read() if shipper.stderr else ""
                time.sleep(0.05)
            reader = ray.get_actor(reader_name(run_id, "live", 1), namespace=NAMESPACE)
            ray.kill(reader, no_restart=False)
            assert job.wait(timeout=180) == 0
            _, err = shipper.communicate(timeout=240)
            assert shipper.returncode == 0, err.decode()[-4000:]
        finally:
            ray.shutdown()
            if shipper.poll() is None:
                shipper.kill()
        assert 20 <= shipped < 300, "the reader was not killed mid-run"
        ship(spool, tmp_path / "one.jsonl", "--once")
        assert out.read_bytes() == (tmp_path / "one.jsonl").read_bytes()


class TestExample:
    def test_ray_actors_example_logs_and_ships(self, tmp_path: Path, head: RayHead) -> None:
        """examples/ray_actors.py: 4 actors log as ranks 0-3, then --ray ships every step."""
        spool = tmp_path / "spool"
        cmd = [sys.executable, str(ROOT / "examples" / "ray_actors.py"), "--address",
               head.address, "--spool", str(spool), "--ranks", "4", "--steps", "30",
               "--ship"]  # fmt: skip
        res = subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, timeout=240,
                             check=False)  # fmt: skip
        assert res.returncode == 0, res.stderr[-4000:]
        steps = [x for x in read_jsonl(spool / "metrics.jsonl") if "step" in x]
        assert [x["step"] for x in steps] == list(range(30))
        assert all(x["complete"] and x["ranks"] == 4 for x in steps)
        assert steps[0]["metrics"]["train/tokens_per_s"] == 4006.0
        assert steps[0]["metrics"]["train/loss"] == pytest.approx(1.0 + 0.015)
        assert "timing/step/slowest_rank" in steps[0]["metrics"]

    @pytest.mark.slow
    def test_ray_actors_example_without_an_address(self, tmp_path: Path) -> None:
        """Without --address the example starts its own Ray and ships on it before it ends."""
        spool = tmp_path / "spool"
        cmd = [sys.executable, str(ROOT / "examples" / "ray_actors.py"), "--spool", str(spool),
               "--ranks", "2", "--steps", "5", "--ship"]  # fmt: skip
        env = {k: v for k, v in ray_env().items() if k != "RAY_ADDRESS"}
        # a local ray.init() writes a token into ~/.ray (Ray's token auth by default): its own
        env["HOME"] = str(tmp_path / "home")
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                             check=False)  # fmt: skip
        assert res.returncode == 0, res.stderr[-4000:]
        steps = [x for x in read_jsonl(spool / "metrics.jsonl") if "step" in x]
        assert [x["step"] for x in steps] == list(range(5))
