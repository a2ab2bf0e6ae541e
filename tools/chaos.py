"""Chaos run of ranklog: a job of N ranks and a shipper per target, faults injected at random.

    python tools/chaos.py --seed 3 --ranks 4 --steps 300 --trials 2 \\
        --targets jsonl,tensorboard,mlflow [--duration S]

Each rank (``python tools/chaos.py --_rank ...``) calls ``ranklog.init(spool, rank=r,
world_size=N, durability="step")`` and per step logs ``train/loss = r + step/1000 +
0.25*(incarnation-1)`` and the timer ``step_time = 0.01*(r+1) + 0.0001*incarnation``, calls
``step_end`` and sleeps; it prints the step once ``flush()`` says its bytes are in the OS.
One follow-mode ``ranklog ship`` process per target forwards reduced steps. A seeded
``random.Random`` (one per trial) injects, for ``--duration`` seconds:

- rank kills: SIGKILL, then a new incarnation resuming 0-5 steps before the step after its
  last printed one (a requeue from a checkpoint); values depend on the incarnation, so
  re-logged steps differ and only the first closed values may ship;
- shipper kills: SIGKILL, restarted at once (it resumes from its cursor);
- torn tails: after about every other rank kill, random bytes, zeros or a truncated copy of the
  last frame appended past the last complete frame of the dead incarnation's last segment
  (a crash mid-write: nothing closed is lost);
- disk full (once): the spool is on a 64 MiB tmpfs that a ballast file fills for 1-3 s
  (root and a mountable tmpfs only; otherwise skipped, and the trial says so);
- backend outage (once, ``mlflow`` target): the real ``mlflow server`` (sqlite) is SIGKILLed
  with its process group for 2-5 s, then restarted on the same port and store.

Oracle. Once the ranks finished, the follow shippers exited and each ran again ``--once``,
the spool's ``step_end`` events say which incarnation closed each (rank, step) first; only
its values ship, so a step's ``train/loss`` must be the mean and ``timing/step_time`` the max
over ranks of the formulas above for those incarnations (computed, not read back). A step a
rank printed that the spool does not hold closed by that incarnation is *lost*. Each target,
read back (``read_jsonl``; ``EventAccumulator`` with and without its purge; MLflow's
``get_metric_history``), must hold every step once: missing is *lost*, more than once
*duplicated*, another value, a partial JSONL step or a step no full set of ranks closed
*wrong*. The final line's ``steps`` is trials x steps (each checked in every target). Exit
status 1 if lost, duplicated or wrong is non-zero or a process failed.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _chaos_io import MlflowServer, Tmpfs, child_env, compare, mlflow_server, read_back, tear_tail

FAULTS = ("rank_kills", "shipper_kills", "torn_tails", "disk_full", "backend_outage")


def values(rank: int, step: int, incarnation: int) -> tuple[float, float]:
    """(loss, step_time) that incarnation ``incarnation`` of ``rank`` logs for ``step``."""
    return rank + step / 1000 + 0.25 * (incarnation - 1), 0.01 * (rank + 1) + 1e-4 * incarnation


def produce(spool: str, rank: int, world: int, start: int, steps: int, sleep: float) -> None:
    """One rank's incarnation: prints ``inc K``, then each step once it is in the OS."""
    import ranklog

    run = ranklog.init(spool, rank=rank, world_size=world, durability="step")
    print("inc", run.incarnation, flush=True)
    for step in range(start, steps):
        loss, seconds = values(rank, step, run.incarnation)
        run.log_metrics({"loss": loss}, step=step, prefix="train")
        run.log_timing("step_time", seconds, step=step)
        run.step_end(step)
        if run.flush():  # False while the disk refuses: the step is only in memory
            print(step, flush=True)
        time.sleep(sleep)
    run.close()


@dataclass
class Config:
    seed: int = 0
    ranks: int = 4
    steps: int = 300
    trials: int = 1
    targets: tuple[str, ...] = ("jsonl", "tensorboard")
    duration: float | None = None  # seconds of faults per trial (default: steps x step_sleep)
    step_sleep: float = 0.02
    disk_full: bool = True  # fill the spool's disk once (root and a tmpfs only)


@dataclass
class TrialResult:
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    order: int = 0  # steps a target holds after a higher one
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    errors: list[str] = field(default_factory=list)  # processes that failed
    notes: list[str] = field(default_factory=list)  # faults skipped, slow shippers
    details: list[str] = field(default_factory=list)  # what was lost, duplicated, wrong
    seconds: float = 0.0
    steps: int = 0  # steps of the job, each checked in every target


@dataclass
class ChaosResult:
    trials: list[TrialResult] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return sum(t.lost for t in self.trials)

    @property
    def duplicated(self) -> int:
        return sum(t.duplicated for t in self.trials)

    @property
    def wrong(self) -> int:
        return sum(t.wrong for t in self.trials)

    @property
    def order(self) -> int:
        return sum(t.order for t in self.trials)

    @property
    def faults(self) -> dict[str, int]:
        return {k: sum(t.faults[k] for t in self.trials) for k in FAULTS}

    @property
    def ok(self) -> bool:
        return not any(
            t.lost or t.duplicated or t.wrong or t.order or t.errors for t in self.trials
        )


class Job:
    """The processes of one trial: ranks, restarted as new incarnations; a shipper per target."""

    def __init__(
        self, cfg: Config, work: Path, disk: Tmpfs | None, server: MlflowServer | None
    ) -> None:
        self.cfg, self.work, self.disk, self.server = cfg, work, disk, server
        self.spool = (disk.path if disk else work) / "spool"
        targets = {"jsonl": f"jsonl:{work / 'out.jsonl'}", "tensorboard": f"tensorboard:{work}/tb"}
        targets["mlflow"] = f"mlflow:{server.uri if server else ''}"
        self.specs = {t: targets[t] for t in cfg.targets}
        self.ranks: dict[int, subprocess.Popen[bytes] | None] = {}
        self.logs: dict[int, Path] = {}
        self.last = dict.fromkeys(range(cfg.ranks), -1)  # last step printed, any incarnation
        self.printed: dict[tuple[int, int], set[int]] = defaultdict(set)  # (rank, inc) -> steps
        self.shippers: dict[str, subprocess.Popen[bytes]] = {}
        self.errors: list[str] = []
        self.starts = 0

    def start_rank(self, rank: int, start: int) -> None:
        self.starts += 1
        self.logs[rank] = log = self.work / f"rank{rank}-{self.starts}"
        args = [self.spool, rank, self.cfg.ranks, start, self.cfg.steps, self.cfg.step_sleep]
        cmd = [sys.executable, __file__, "--_rank", *map(str, args)]
        with open(f"{log}.out", "wb") as out, open(f"{log}.err", "wb") as err:
            self.ranks[rank] = subprocess.Popen(cmd, env=child_env(), stdout=out, stderr=err)

    def reap_rank(self, rank: int) -> int | None:
        """Wait for a stopped rank and record what it printed; returns its incarnation."""
        proc = self.ranks[rank]
        assert proc is not None
        proc.wait()
        self.ranks[rank] = None
        words = [line.split() for line in Path(f"{self.logs[rank]}.out").read_text().splitlines()]
        inc = next((int(w[1]) for w in words if len(w) == 2 and w[0] == "inc"), None)
        steps = {int(w[0]) for w in words if len(w) == 1 and w[0].isdigit()}
        if inc is not None:
            self.printed[(rank, inc)] |= steps
        self.last[rank] = max([self.last[rank], *steps])
        return inc

    def resume(self, rank: int, rng: random.Random) -> None:
        """Start ``rank`` again as a requeue would: from a checkpoint 0-5 steps back."""
        self.start_rank(rank, max(0, self.last[rank] + 1 - rng.randint(0, 5)))

    def live(self) -> list[int]:
        return [r for r, p in self.ranks.items() if p is not None and p.poll() is None]

    def ready(self) -> bool:
        """Every running rank is past ``init`` (it printed its incarnation)."""
        return all(Path(f"{self.logs[r]}.out").stat().st_size > 0 for r in self.live())

    def ship_cmd(self, target: str, *flags: str) -> list[str]:
        cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(self.spool), "--quiet"]
        cmd += ["--to", self.specs[target], "--dead-after", "600", "--start-grace", "600"]
        return cmd + (["--experiment", "chaos"] if target == "mlflow" else []) + list(flags)

    def start_shipper(self, target: str) -> None:
        with open(self.work / f"ship-{target}.log", "ab") as log:
            cmd = self.ship_cmd(target)
            self.shippers[target] = subprocess.Popen(cmd, env=child_env(), stderr=log)

    def watch(self, rng: random.Random) -> None:
        """Reap ranks that ended by themselves; restart any process that failed."""
        for rank, proc in list(self.ranks.items()):
            if proc is not None and proc.poll() is not None:
                self.reap_rank(rank)
                if proc.returncode != 0:
                    self.errors.append(f"rank {rank} exited {proc.returncode}: {self.logs[rank]}")
                    self.resume(rank, rng)
        for target, ship in self.shippers.items():
            if ship.poll() not in (None, 0):
                self.errors.append(f"shipper {target} exited {ship.returncode}")
                self.start_shipper(target)

    def kill_rank(self, rng: random.Random, faults: dict[str, int]) -> None:
        """SIGKILL a rank that has steps left, tear every other one's tail, restart it."""
        left = [r for r in self.live() if self.last[r] < self.cfg.steps - 1]
        if left:
            rank = rng.choice(left)
            proc = self.ranks[rank]
            assert proc is not None
            proc.send_signal(signal.SIGKILL)
            inc = self.reap_rank(rank)
            faults["rank_kills"] += 1
            torn = faults["torn_tails"] * 2 < faults["rank_kills"]  # about every other one
            if inc and torn and tear_tail(self.spool, rank, inc, rng):
                faults["torn_tails"] += 1
            self.resume(rank, rng)

    def kill_shipper(self, rng: random.Random, faults: dict[str, int]) -> None:
        alive = [t for t, p in self.shippers.items() if p.poll() is None]
        if alive:
            target = rng.choice(alive)
            self.shippers[target].send_signal(signal.SIGKILL)
            self.shippers[target].wait()
            faults["shipper_kills"] += 1
            self.start_shipper(target)

    def finish(self, rng: random.Random, timeout: float, notes: list[str]) -> None:
        """Wait for the ranks and the follow shippers, then run each shipper ``--once``."""
        deadline = time.monotonic() + timeout
        while any(p is not None for p in self.ranks.values()):
            if time.monotonic() > deadline:
                self.errors.append(f"ranks still running after {timeout:.0f} s")
                return
            self.watch(rng)
            time.sleep(0.1)
        for target, ship in self.shippers.items():
            try:
                ship.wait(timeout=120)
            except subprocess.TimeoutExpired:
                notes.append(f"follow shipper {target} still running 120 s after the job ended")
                ship.kill()
                ship.wait()
        for target in self.shippers:
            with open(self.work / f"ship-{target}.log", "ab") as log:
                cmd = self.ship_cmd(target, "--once")
                done = subprocess.run(cmd, env=child_env(), stderr=log, timeout=600, check=False)
            if done.returncode != 0:
                self.errors.append(f"shipper {target} --once exited {done.returncode}")

    def stop(self) -> None:
        """Kill whatever this job still has running (after a failure)."""
        for proc in [*self.ranks.values(), *self.shippers.values()]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def inject(job: Job, rng: random.Random, faults: dict[str, int], duration: float) -> None:
    """Faults until ``duration`` is over (and the disk was full once) or every rank finished."""
    t0, disk, server = time.monotonic(), job.disk, job.server
    down: list[threading.Thread] = []  # outages in progress
    disk_at = rng.uniform(0.1, 0.4) * duration if disk else math.inf
    outage_at = rng.uniform(0.1, 0.5) * duration if server else math.inf
    while job.live() and (time.monotonic() - t0 < duration or disk_at < math.inf):
        time.sleep(rng.uniform(0.1, 0.5))
        job.watch(rng)
        now = time.monotonic() - t0
        if server is not None and now >= outage_at:
            outage_at = math.inf
            down.append(server.outage(rng.uniform(2, 5), job.errors))
        if disk is not None and now >= disk_at:
            disk_at = math.inf
            disk.full_for(rng.uniform(1, 3), job.ready)
            faults["disk_full"] += 1
        elif not faults["rank_kills"] or (faults["shipper_kills"] and rng.random() < 0.6):
            job.kill_rank(rng, faults)  # each kind at least once, then 60:40
        else:
            job.kill_shipper(rng, faults)
    if server is not None and outage_at < math.inf:  # the job was quicker: shippers still ship
        down.append(server.outage(rng.uniform(2, 5), job.errors))
    for thread in down:
        thread.join()
    faults["backend_outage"] += len(down)


def oracle(job: Job, details: list[str]) -> tuple[dict[int, dict[str, float]], int]:
    """Expected reduced values of each step, and the closed steps the spool lost."""
    from ranklog.schemas import StepEnd
    from ranklog.testing import events_by_incarnation

    first: dict[tuple[int, int], int] = {}  # (rank, step) -> first incarnation that closed it
    lost = 0
    for (rank, inc), events in sorted(events_by_incarnation(job.spool).items()):
        closed = {e.step for e in events if isinstance(e, StepEnd)}
        for step in closed:
            first.setdefault((rank, step), inc)
        if missing := job.printed.get((rank, inc), set()) - closed:
            lost += len(missing)
            details.append(f"spool: rank {rank} inc {inc} lost closed steps {sorted(missing)}")
    expected: dict[int, dict[str, float]] = {}  # step -> key -> reduced value
    for step in range(job.cfg.steps):
        incs = [first.get((r, step), 0) for r in range(job.cfg.ranks)]
        if 0 in incs:
            details.append(f"spool: step {step} never closed by rank {incs.index(0)}")
            continue
        vals = [values(r, step, inc) for r, inc in enumerate(incs)]
        loss = math.fsum(v[0] for v in vals) / len(vals)
        expected[step] = {"train/loss": loss, "timing/step_time": max(v[1] for v in vals)}
    return expected, lost


def run_trial(cfg: Config, trial: int, work: Path, server: MlflowServer | None) -> TrialResult:
    """One job with faults, then every target against the oracle."""
    from ranklog.spool import read_run

    res, t0 = TrialResult(steps=cfg.steps), time.monotonic()
    rng = random.Random(f"ranklog-chaos:{cfg.seed}:{trial}")
    work.mkdir(parents=True)
    disk, why = Tmpfs.mount(work / "fs") if cfg.disk_full else (None, "")
    if disk is None and cfg.disk_full:
        res.notes.append(f"disk_full skipped: {why}")
    job = Job(cfg, work, disk, server)
    duration = cfg.duration if cfg.duration is not None else cfg.steps * cfg.step_sleep
    try:
        for rank in range(cfg.ranks):
            job.start_rank(rank, 0)
        deadline = time.monotonic() + 60  # a shipper needs run.json (rank errors are reported)
        while not (job.spool / "run.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for target in cfg.targets:
            job.start_shipper(target)
        inject(job, rng, res.faults, duration)
        job.finish(rng, 120 + 10 * duration, res.notes)
        expected, res.lost = oracle(job, res.details)
        res.wrong = cfg.steps - len(expected)
        run_id = read_run(job.spool).run_id
        for target in cfg.targets:
            got, rel = read_back(job.specs[target], run_id, cfg.ranks)
            lost, dup, wrong, order = compare(target, got, expected, rel, res.details)
            res.lost += lost
            res.duplicated += dup
            res.wrong += wrong
            res.order += order
    finally:
        job.stop()
        if disk is not None:
            disk.unmount()
    res.errors, res.seconds = job.errors, time.monotonic() - t0
    return res


def _counts(r: TrialResult | ChaosResult) -> str:
    faults = ", ".join(f"{k}:{r.faults[k]}" for k in FAULTS)
    return (
        f"lost={r.lost} duplicated={r.duplicated} wrong={r.wrong} order={r.order} "
        f"faults={{{faults}}}"
    )


def run_chaos(
    cfg: Config, workdir: Path | None = None, log: Callable[[str], None] = print
) -> ChaosResult:
    """Run ``cfg.trials`` trials: a summary line each through ``log``, then a final one."""
    result = ChaosResult()
    with tempfile.TemporaryDirectory(prefix="ranklog-chaos-") as tmp:
        work = workdir or Path(tmp)
        with mlflow_server(work / "mlflow", "mlflow" in cfg.targets) as server:
            for trial in range(cfg.trials):
                t = run_trial(cfg, trial, work / f"trial{trial}", server)
                result.trials.append(t)
                took = f"seconds={t.seconds:.1f}"
                log(f"chaos: trial={trial} seed={cfg.seed} steps={cfg.steps} {_counts(t)} {took}")
                for line in [*t.notes, *t.errors, *t.details[:20]]:
                    log(f"chaos:   {line}")
    log(f"chaos: trials={cfg.trials} steps={cfg.steps * cfg.trials} {_counts(result)}")
    return result


def soak_config(seed: int, trial: int, mlflow: bool) -> Config:
    """A small random job for trial ``trial`` of a soak: 2-4 ranks, 30-80 steps, random faults.

    JSONL always; TensorBoard in about a third of the trials; the MLflow server (and its
    outage) in about one in 25; a full disk in about one in four.
    """
    rng = random.Random(f"ranklog-soak:{seed}:{trial}")
    targets = ["jsonl"]
    if rng.random() < 0.3:
        targets.append("tensorboard")
    if mlflow and rng.random() < 0.04:
        targets.append("mlflow")
    steps, sleep = rng.randint(30, 80), rng.choice((0.005, 0.01))
    return Config(seed, rng.randint(2, 4), steps, 1, tuple(targets), steps * sleep, sleep,
                  disk_full=rng.random() < 0.25)  # fmt: skip


def run_soak(
    seed: int, trials: int, workdir: Path | None = None, log: Callable[[str], None] = print
) -> ChaosResult:
    """``trials`` small random trials; a progress line every 25, the failures, a final line."""
    result, t0 = ChaosResult(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ranklog-soak-") as tmp:
        work = workdir or Path(tmp)
        with mlflow_server(work / "mlflow", True) as server:
            for trial in range(trials):
                cfg = soak_config(seed, trial, server is not None)
                where = work / f"trial{trial}"
                t = run_trial(cfg, trial, where, server if "mlflow" in cfg.targets else None)
                result.trials.append(t)
                if t.lost or t.duplicated or t.wrong or t.order or t.errors:
                    log(f"chaos soak: trial={trial} FAILED {_counts(t)} (files: {where})")
                    for line in [*t.errors, *t.details[:20]]:
                        log(f"chaos soak:   {line}")
                else:
                    shutil.rmtree(where, ignore_errors=True)
                if trial % 25 == 24 or trial == trials - 1:
                    log(f"chaos soak: {trial + 1}/{trials} trials, {time.monotonic() - t0:.0f} s, "
                        f"{_counts(result)}")  # fmt: skip
    steps = sum(t.steps for t in result.trials)
    log(f"chaos soak: trials={trials} steps={steps} {_counts(result)} "
        f"seconds={time.monotonic() - t0:.0f}")  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_rank"]:
        spool, rank, world, start, steps, sleep = argv[1:7]
        produce(spool, int(rank), int(world), int(start), int(steps), float(sleep))
        return 0
    p = argparse.ArgumentParser(description="Chaos run of ranklog (see the module docstring).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--targets", default="jsonl,tensorboard", help="of jsonl,tensorboard,mlflow")
    p.add_argument("--duration", type=float, help="seconds of faults a trial (steps x sleep)")
    p.add_argument("--step-sleep", type=float, default=0.02, help="seconds between steps")
    p.add_argument("--workdir", type=Path, help="keep every file here (default: a temp dir)")
    p.add_argument(
        "--soak", action="store_true",
        help="many small random trials (default 1,000; --trials): every fault kind, a "
        "progress line every 25 trials, the failures kept in --workdir",
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.soak:
        trials = a.trials if "--trials" in argv else 1000
        return 0 if run_soak(a.seed, trials, a.workdir).ok else 1
    targets = tuple(a.targets.split(","))
    if not set(targets) <= {"jsonl", "tensorboard", "mlflow"}:
        p.error(f"unknown target in {a.targets!r}")
    cfg = Config(a.seed, a.ranks, a.steps, a.trials, targets, a.duration, a.step_sleep)
    return 0 if run_chaos(cfg, a.workdir).ok else 1


if __name__ == "__main__":
    sys.exit(main())
