"""``ranklog.ray`` against a real local Ray head: actors as ranks, one GPU sampler per node."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import ranklog.ray
from ranklog.errors import ConfigError
from ranklog.schemas import Gpu, Metrics, RankEnd, RankStart
from ranklog.testing import events_by_incarnation

from .conftest import python_env

if TYPE_CHECKING:
    from .ray_cluster import RayHead

# The head (ray_head) is registered once, in conftest.py: one head for every Ray test module.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported: see ray_cluster

ray = pytest.importorskip("ray", reason="ray is installed by ./tools/test (extra ranklog[ray])")

STEPS = 5


@pytest.fixture(scope="module")
def head(ray_driver: RayHead) -> RayHead:
    """The session's Ray head, this process connected to it (``tests/ray_cluster.py``)."""
    return ray_driver


class PidGpu:
    """A GPU source whose one GPU is named after the process that samples it."""

    name = "fake"

    def sample(self) -> list[Gpu]:
        return [Gpu(time.time(), "fake-host", 0, util=50.0, name=f"sampled by {os.getpid()}")]

    def close(self) -> None: ...


class Trainer:
    """A training worker: ``loss = rank + step / 100`` for a few steps, then close."""

    def __init__(self, spool: str, **kw: Any) -> None:
        kw.setdefault("gpu_interval", 0.05)
        self.run = ranklog.ray.init(spool, gpu=PidGpu(), **kw)

    def sampling(self) -> bool:
        """Whether this actor's producer samples the node's GPUs."""
        return self.run._gpu is not None

    def train(self, steps: int) -> tuple[int, int | None, int | None]:
        for step in range(steps):
            self.run.log_metrics({"loss": self.run.rank + step / 100}, step=step)
            self.run.step_end(step)
            time.sleep(0.05)  # the sampler (if this is it) samples meanwhile
        self.run.close()
        return self.run.rank, self.run.world_size, self.run.local_rank


def train_fn(config: dict[str, Any]) -> None:
    """A Ray Train training function: ranks from the Train context."""
    Trainer(config["spool"]).train(STEPS)


def init_in_task(spool: str, **kw: Any) -> None:
    """In a Ray task: ranklog.ray.init, closed at once."""
    ranklog.ray.init(spool, gpu="off", **kw).close()


def ranks_of(spool: Path) -> dict[int, list[Any]]:
    """Events per rank (one incarnation each)."""
    got = events_by_incarnation(spool)
    assert all(inc == 1 for _, inc in got), sorted(got)
    return {rank: events for (rank, _), events in got.items()}


class TestInit:
    def test_four_actors_one_sampler(self, head: RayHead, spool: Path) -> None:
        """4 actors on one node log as ranks 0-3 of 4 under the node's IP; one samples its GPUs."""
        from .shiphelp import lines, ship  # here: a Ray worker importing this module needn't

        actor = ray.remote(Trainer).options(num_cpus=0)
        actors = [actor.remote(str(spool), rank=r, world_size=4) for r in range(4)]
        sampling = ray.get([a.sampling.remote() for a in actors], timeout=120)  # all running
        assert sum(sampling) == 1
        results = ray.get([a.train.remote(STEPS) for a in actors], timeout=120)
        assert results == [(r, 4, None) for r in range(4)]
        by_rank = ranks_of(spool)
        assert sorted(by_rank) == [0, 1, 2, 3]
        node_ip = ray.util.get_node_ip_address()
        samplers = []
        for rank, events in by_rank.items():
            start = events[0]
            assert isinstance(start, RankStart)
            assert (start.rank, start.world_size, start.local_rank, start.host) == (
                rank, 4, None, node_ip
            )  # fmt: skip
            metrics = [e for e in events if isinstance(e, Metrics)]
            assert [(m.step, m.values["loss"]) for m in metrics] == [
                (s, rank + s / 100) for s in range(STEPS)
            ]
            assert isinstance(events[-1], RankEnd) and events[-1].status == "ok"
            if gpus := [e for e in events if isinstance(e, Gpu)]:
                assert {g.name for g in gpus} == {f"sampled by {start.pid}"}
                samplers.append(rank)
        assert len(samplers) == 1 and sampling[samplers[0]]
        assert not list((spool / "gpu").glob("*.lock"))  # the sampler released the node
        out = spool.parent / "out.jsonl"
        ship(spool, out)  # reduced across the 4 ranks like any job's
        steps = [x for x in lines(out) if x["step"] < STEPS]  # (not a trailing GPU-only step)
        got = [(x["step"], x["ranks"], x["world_size"], x["complete"]) for x in steps]
        assert got == [(s, 4, 4, True) for s in range(STEPS)]
        assert [x["metrics"]["loss"] for x in steps] == pytest.approx(
            [1.5 + s / 100 for s in range(STEPS)]
        )

    def test_no_rank_is_a_config_error(self, head: RayHead, spool: Path) -> None:
        """In a plain Ray task, no rank or world size given or in the environment: ConfigError."""
        task = ray.remote(init_in_task).options(num_cpus=0, max_retries=0)
        with pytest.raises(ConfigError, match=r"no rank and no world_size for this Ray worker"):
            ray.get(task.remote(str(spool)), timeout=120)
        with pytest.raises(ConfigError, match=r"no world_size for this Ray worker: pass rank="):
            ray.get(task.remote(str(spool), rank=1), timeout=120)
        assert not (spool / "ranks").exists() or not any((spool / "ranks").iterdir())

    def test_ranks_from_launcher_variables(self, head: RayHead, spool: Path) -> None:
        """An actor whose environment has RANK/WORLD_SIZE/LOCAL_RANK (as NeMo RL sets) uses them."""
        env = {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}
        actor = ray.remote(Trainer).options(num_cpus=0, runtime_env={"env_vars": env})
        trainer = actor.remote(str(spool))
        assert ray.get(trainer.sampling.remote(), timeout=120)  # local rank 0
        assert ray.get(trainer.train.remote(1), timeout=120) == (2, 3, 0)
        (start,) = [e for e in events_by_incarnation(spool)[(2, 1)] if isinstance(e, RankStart)]
        assert (start.rank, start.world_size, start.local_rank) == (2, 3, 0)

    def test_cluster_gpu_in_the_driver(self, head: RayHead, spool: Path) -> None:
        """``gpu="cluster"`` in a driver samples every node's Ray metrics, under the node IP."""
        from ranklog.producer._gpu import RaySource

        run = ranklog.ray.init(spool, rank=0, world_size=1, gpu="cluster", gpu_interval=0.1,
                               handle_signals=False)  # fmt: skip
        source = run._gpu._source
        assert isinstance(source, RaySource) and source.scope == "cluster"
        run.close()
        (start,) = [e for e in events_by_incarnation(spool)[(0, 1)] if isinstance(e, RankStart)]
        assert start.host == ranklog.ray.node_host()

    def test_needs_ray_initialised(self, spool: Path) -> None:
        """Outside Ray (no ray.init), ranklog.ray.init says to use ranklog.init."""
        code = "import sys, ranklog.ray; ranklog.ray.init(sys.argv[1], rank=0, world_size=1)"
        out = subprocess.run([sys.executable, "-c", code, str(spool)], env=python_env(),
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert out.returncode == 1
        assert "ConfigError: ranklog.ray.init() runs in a Ray task or actor" in out.stderr

    @pytest.mark.slow
    @pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ray.data's own, at import
    def test_ray_train_context(self, head: RayHead, spool: Path, tmp_path: Path) -> None:
        """Under Ray Train, rank, world size and local rank come from its context."""
        pytest.importorskip("ray.train")
        from ray.train import RunConfig, ScalingConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        trainer = DataParallelTrainer(
            train_fn,
            train_loop_config={"spool": str(spool)},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.1}),
            run_config=RunConfig(storage_path=str(tmp_path / "train"), name="ranklog"),
        )
        assert trainer.fit().error is None
        by_rank = ranks_of(spool)
        starts = {r: events[0] for r, events in by_rank.items()}
        assert {r: (s.rank, s.world_size, s.local_rank) for r, s in starts.items()} == {
            0: (0, 2, 0),
            1: (1, 2, 1),
        }
        sampled = {r for r, events in by_rank.items() if any(isinstance(e, Gpu) for e in events)}
        local0 = next(r for r, s in starts.items() if s.local_rank == 0)
        assert sampled == {local0}


class TestNodeHost:
    def test_the_ip_ray_labels_the_node_with(self, head: RayHead) -> None:
        """node_host() is the node's address in ray.nodes() and the ip label of its metrics."""
        from ranklog.producer._gpu import RaySource

        source = RaySource()
        source.sample()
        ((addr, _),) = source.endpoints()
        assert ranklog.ray.node_host() == addr == source.host_memory[0].host == "127.0.0.1"
