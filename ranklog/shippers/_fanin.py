"""The fan-in on Ray: reader actors tail shards of the spool, a root actor merges and ships.

For jobs too large for one shipper process (tens of thousands of rank files)::

    SPOOL/ranks/00000 00002 ...  --> reader 0 --\\   partial aggregates per step
    SPOOL/ranks/00001 00003 ...  --> reader 1 ----> root: merge, completeness, reduce,
                                 ...         --/         ship to the target, cursor

Each reader actor is a :class:`~ranklog.shippers._tail.RankTail` over the ranks
``r % n == i``: it reads their segments and, per ready step, sends a
:class:`~ranklog.shippers._steps.StepPartial` whose sums are exact, so the
root's merged result is bit for bit what one shipper computes. The root actor
runs the ordinary :class:`~ranklog.shippers.Shipper` with :class:`RayTails` in
place of a local tail: completeness, params, the target and the cursor are
the single-process code.

Restarts: actors are created with ``max_restarts`` and retried calls. A reader
in a new life answers nothing until the root hands it the root's own cursor
(kept current in memory after every accepted batch), then rebuilds its ranks
from the spool; the root notices the new life by its token, drops the round
and reads again. Counters travel with commits, params are taken once by where
they were read: a reader killed at any point changes nothing in the output.
The root is pinned to the node ``ranklog ship`` runs on (its target writes
local files there); a restarted root starts new readers. Nothing here imports
ray until a fan-in is started.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec

from ranklog.errors import ConfigError, TailRestartedError
from ranklog.shippers._cursor import Cursor
from ranklog.shippers._lease import DEFAULT_TTL
from ranklog.shippers._progress import Progress
from ranklog.shippers._ranks import StepGap, TailCommit, TailPoll
from ranklog.shippers._reduce import parse_ops
from ranklog.shippers._registry import make_target
from ranklog.shippers._source import SpoolSource
from ranklog.shippers._steps import StepPartial
from ranklog.shippers._tail import RankTail
from ranklog.spool import RunInfo, read_run

__all__ = ["NAMESPACE", "FanIn", "RayTails", "TailReader", "reader_name", "ship_on_ray"]

log = logging.getLogger("ranklog.ship")

#: the Ray namespace of ranklog's actors
NAMESPACE: Final = "ranklog"


def reader_name(run_id: str, name: str, index: int) -> str:
    """The Ray actor name of reader ``index`` of shipper ``name`` for run ``run_id``."""
    return f"ranklog:{run_id}:{name}:reader:{index}"


@dataclass(frozen=True, slots=True)
class FanIn:
    """How a fan-in is laid out on the cluster."""

    #: reader actors (each tails ranks r with r % readers == its index)
    readers: int = 2
    #: logical CPUs each reader asks Ray for
    reader_cpus: float = 1.0
    #: restarts of each actor before Ray gives up (-1: no limit)
    max_restarts: int = -1


# What crosses between actors is msgpack (bytes): an order of magnitude cheaper than
# pickling thousands of small dataclasses per round.
_encode = msgspec.msgpack.Encoder().encode
_poll_decoder = msgspec.msgpack.Decoder(TailPoll)
_partials_decoder = msgspec.msgpack.Decoder(list[StepPartial | None])
_commit_decoder = msgspec.msgpack.Decoder(TailCommit)
_cursor_decoder = msgspec.msgpack.Decoder(Cursor)


def _spec_votes(
    decoded: list[list[StepPartial | None]], i: int
) -> list[tuple[str, str, list[str]]]:
    """For step ``i``: (``m:``/``t:`` name, spec of the lowest rank, every reader's spec).

    Names of the late values the step carries are keyed ``late:<step>:m:<name>``.
    """
    seen: dict[str, list[tuple[int, str]]] = {}
    for parts in decoded:
        part = parts[i]
        if part is None:
            continue
        for prefix, one in [("", part), *((f"late:{s}:", p) for s, p in part.late.items())]:
            for name, named in one.named().items():
                seen.setdefault(f"{prefix}m:{name}", []).append((named.rank, named.spec))
            for name, named in one.timers.items():
                seen.setdefault(f"{prefix}t:{name}", []).append((named.rank, named.spec))
    return [(k, min(v)[1], [spec for _, spec in v]) for k, v in seen.items() if len(v) > 1]


class TailReader:
    """A reader actor: one shard of the spool's ranks (use through ``ray.remote``).

    A new life of the actor starts empty and answers ``b""`` until the root hands it
    the root's own cursor (:meth:`restore`): the one the root holds in memory, which a
    restart between the root's commit and its cursor file cannot leave behind.
    """

    def __init__(
        self,
        spool: str,
        name: str,
        shard: tuple[int, int],
        poll: float | None,
        dead_after: float,
        late: str = "count",
    ) -> None:
        self.token = uuid.uuid4().hex  # a new one per life of the actor
        self.tail = RankTail(
            SpoolSource(spool, poll=poll, shard=shard),
            read_run(spool),
            dead_after=dead_after,
            shard=shard,
            late=late,
        )
        self.restored = False

    def restore(self, cursor: bytes, committed: int, shipped_upto: int) -> str:
        """Carry on from the root's cursor (its shard's segments and ranks).

        ``committed`` is the last step this shard's state in the cursor covers; the
        root has shipped up to ``shipped_upto``: the steps between were shipped from
        what an earlier life read, and are not late when read again.
        """
        if not self.restored:
            self.tail.restore(_cursor_decoder.decode(cursor))
            self.tail.restore_gap = StepGap(committed, shipped_upto)
            self.restored = True
        return self.token

    def poll(self, shipped_upto: int, gap: StepGap, floor: int | None) -> tuple[str, bytes]:
        """One read round of this shard (an encoded TailPoll)."""
        if not self.restored:
            return self.token, b""
        self.tail.sync(shipped_upto, gap)
        return self.token, _encode(self.tail.poll(floor))

    def partials(
        self, steps: list[int], per_rank: bool, specs: dict[int, dict[str, str]] | None = None
    ) -> tuple[str, bytes]:
        """Mergeable partials of ``steps`` over this shard's ranks (encoded)."""
        parts = self.tail.partials(steps, per_rank=per_rank, exact=True, specs=specs)
        return self.token, _encode(parts)

    def commit(self, shipped_upto: int, gap: StepGap, params_pending: bool) -> tuple[str, bytes]:
        """Consume what was shipped; the shard's cursor state (an encoded TailCommit)."""
        if not self.restored:
            return self.token, b""
        self.tail.sync(shipped_upto, gap)
        return self.token, _encode(self.tail.commit(shipped_upto, params_pending=params_pending))


class RayTails:
    """The root's side of the fan-in: the :class:`~ranklog.shippers._engine.Tails` protocol."""

    def __init__(
        self,
        spool: str,
        name: str,
        layout: FanIn,
        *,
        poll: float | None,
        dead_after: float,
        late: str = "count",
    ) -> None:
        self.spool, self.name, self.layout = spool, name, layout
        self.poll_interval = poll if poll is not None else 1.0
        self._poll, self.dead_after, self.late = poll, dead_after, late
        self.readers: list[Any] = []
        self._tokens: list[str] = []
        self.cursor: Cursor | None = None
        #: per reader, the shipped step its last commit covered
        self._committed: list[int] = []

    @property
    def mode(self) -> str:
        """For status lines."""
        return f"Ray fan-in, {len(self.readers)} readers"

    def open(self, run: RunInfo, cursor: Cursor | None) -> None:
        """Start the reader actors; each starts from ``cursor`` (the root's, kept current)."""
        import ray

        self.cursor = cursor if cursor is not None else Cursor(name=self.name)  # the root's
        remote: Any = ray.remote(TailReader)
        n = self.layout.readers
        for i in range(n):
            actor_name = reader_name(run.run_id, self.name, i)
            _kill_stale(actor_name)
            handle = remote.options(
                name=actor_name,
                namespace=NAMESPACE,
                num_cpus=self.layout.reader_cpus,
                max_restarts=self.layout.max_restarts,
                max_task_retries=-1,
                scheduling_strategy="SPREAD",
            ).remote(self.spool, self.name, (i, n), self._poll, self.dead_after, self.late)
            self.readers.append(handle)
        self._tokens = [""] * n
        self._committed = [self.cursor.last_step] * n

    def _all(self, method: str, *args: Any, readers: list[Any] | None = None) -> list[Any]:
        import ray

        targets = self.readers if readers is None else readers
        return list(ray.get([getattr(r, method).remote(*args) for r in targets]))

    def poll(self, shipped_upto: int, gap: StepGap, floor: int | None) -> TailPoll:
        """Every reader reads one round at the same time; their findings together."""
        answers = self._all("poll", shipped_upto, gap, floor)
        while True:  # a reader in a new life first gets the root's cursor, then reads
            empty = [i for i, (_, raw) in enumerate(answers) if not raw]
            if not empty:
                break
            assert self.cursor is not None
            log.info("reader(s) %s started (again): restoring them from the cursor", empty)
            again = [self.readers[i] for i in empty]
            raw_cursor = _encode(self.cursor)
            for i in empty:
                self._all("restore", raw_cursor, self._committed[i], shipped_upto,
                          readers=[self.readers[i]])  # fmt: skip
            for i, answer in zip(empty, self._all("poll", shipped_upto, gap, floor,
                                                  readers=again), strict=True):  # fmt: skip
                answers[i] = answer
        self._tokens = [token for token, _ in answers]
        out = TailPoll(False, [], [], [])
        steps: set[int] = set()
        for _, raw in answers:
            p = _poll_decoder.decode(raw)
            out.progressed = out.progressed or p.progressed
            out.views += p.views
            steps.update(p.steps)
            out.params += p.params
            out.lag_bytes += p.lag_bytes
        out.steps = sorted(steps)
        return out

    def partials(self, steps: list[int], *, per_rank: bool) -> list[StepPartial | None]:
        """Each reader's partials, merged step by step.

        A name's reduce spec is that of the lowest rank logging it in the whole job;
        where a reader built its partial with another spec (its own lowest rank asked
        for other ops), that reader builds the step again with the winning spec.
        """
        decoded = self._partials(steps, per_rank, None)
        specs: dict[int, dict[str, str]] = {}
        for i, step in enumerate(steps):
            for key, winner, others in _spec_votes(decoded, i):
                if any(parse_ops(o) != parse_ops(winner) for o in others):
                    specs.setdefault(step, {})[key] = winner
        if specs:
            again = [s for s in steps if s in specs]
            redone = self._partials(again, per_rank, specs)
            for j, step in enumerate(again):
                i = steps.index(step)
                for parts, new in zip(decoded, redone, strict=True):
                    parts[i] = new[j]
        out: list[StepPartial | None] = []
        for i in range(len(steps)):
            merged: StepPartial | None = None
            for parts in decoded:
                part = parts[i]
                if part is not None:
                    merged = part if merged is None else merged.merge(part)
            out.append(merged)
        return out

    def _partials(
        self, steps: list[int], per_rank: bool, specs: dict[int, dict[str, str]] | None
    ) -> list[list[StepPartial | None]]:
        answers = self._all("partials", steps, per_rank, specs)
        if [token for token, _ in answers] != self._tokens:
            raise TailRestartedError("a reader actor restarted during the round")
        return [_partials_decoder.decode(raw) for _, raw in answers]

    def commit(self, shipped_upto: int, gap: StepGap, *, params_pending: bool) -> TailCommit:
        """Every reader's segments, ranks and counters (a reader in a new life: none yet)."""
        answers = self._all("commit", shipped_upto, gap, params_pending)
        out = TailCommit({}, {})
        for i, (_, raw) in enumerate(answers):
            if not raw:
                continue
            self._committed[i] = shipped_upto
            c = _commit_decoder.decode(raw)
            out.segments.update(c.segments)
            out.ranks.update(c.ranks)
            out.late_events += c.late_events
            out.relogged_events += c.relogged_events
            out.bad += c.bad
        return out

    def wait(self, timeout: float) -> None:
        """Readers poll: sleep for the poll interval."""
        time.sleep(min(timeout, self.poll_interval))

    def close(self) -> None:
        """Stop the readers."""
        import ray

        for r in self.readers:
            try:
                ray.kill(r, no_restart=True)
            except Exception as exc:  # already gone
                log.debug("stopping a reader: %s", exc)
        self.readers = []


def _kill_stale(actor_name: str) -> None:
    """A reader left by a root that died (its name would be taken): stop it."""
    import ray

    try:
        old = ray.get_actor(actor_name, namespace=NAMESPACE)
    except ValueError:
        return
    ray.kill(old, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the name is released a little after
        try:
            ray.get_actor(actor_name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


class ShipRoot:
    """The root actor: the ordinary shipper over :class:`RayTails` (use through ``ray.remote``)."""

    def __init__(self, cwd: str) -> None:
        os.chdir(cwd)  # relative target paths mean what they meant where ranklog ship ran

    def run(
        self,
        spool: str,
        spec: str,
        options: dict[str, Any],
        layout: FanIn,
        shipper_kw: dict[str, Any],
        once: bool,
        quiet: bool,
    ) -> dict[str, int]:
        """Ship until done (or, with ``once``, what is ready); return the counters."""
        from ranklog.shippers._engine import Shipper

        logging.basicConfig(level=logging.INFO, format="ranklog: %(message)s", stream=sys.stderr)
        from ranklog.shippers._registry import default_name
        from ranklog.shippers._target import target_identity
        from ranklog.spool import read_run

        kw = dict(shipper_kw)
        name, poll = kw.pop("name"), kw.pop("poll")
        append_run = bool(kw.pop("append_run", False))
        target = make_target(spec, spool, options, per_rank=kw["per_rank"], append_run=append_run)
        name = name or default_name(target_identity(target, read_run(spool)))
        tails = RayTails(
            spool, name, layout, poll=poll, dead_after=kw["dead_after"], late=kw["late"]
        )
        shipper = Shipper(
            spool,
            target,
            name=name,
            tails=tails,
            progress=None if quiet else Progress(sys.stderr),
            **kw,
        )
        shipper.run_forever(once=once)
        return {
            "steps_shipped": shipper.stats.steps_shipped,
            "partial_steps": shipper.stats.partial_steps,
            "late_events": shipper.stats.late_events,
            "bad_ranges": len(shipper.stats.bad),
        }


def ship_on_ray(
    address: str | None,
    spool: str,
    spec: str,
    options: dict[str, Any],
    layout: FanIn,
    *,
    name: str | None,
    poll: float | None,
    dead_after: float,
    start_grace: float,
    per_rank: bool,
    once: bool,
    quiet: bool,
    lease_ttl: float = DEFAULT_TTL,
    late: str = "count",
    **shipper: Any,
) -> dict[str, int]:
    """Connect to Ray (``address``; None: ``RAY_ADDRESS`` or a local instance), ship, return.

    ``shipper``: more :class:`~ranklog.shippers.Shipper` arguments (``retry_for``, ``argv``),
    and ``append_run`` for the target.
    """
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError:
        from ranklog.errors import ExtraMissingError

        raise ExtraMissingError("ray", "ray") from None
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address or None, namespace=NAMESPACE, log_to_driver=not quiet)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(f"cannot start or reach Ray at {address or 'auto'}: {exc}") from None
    try:
        here = ray.get_runtime_context().get_node_id()
        remote: Any = ray.remote(ShipRoot)
        root: Any = remote.options(
            num_cpus=0,
            max_restarts=layout.max_restarts,
            max_task_retries=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote(os.getcwd())
        kw = {
            "name": name,
            "poll": poll,
            "dead_after": dead_after,
            "start_grace": start_grace,
            "per_rank": per_rank,
            "lease_ttl": lease_ttl,
            "late": late,
            **shipper,
        }
        spool = str(Path(spool).resolve())
        result: dict[str, int] = ray.get(
            root.run.remote(spool, spec, options, layout, kw, once, quiet)
        )
        ray.kill(root, no_restart=True)
        return result
    finally:
        if started:
            ray.shutdown()
