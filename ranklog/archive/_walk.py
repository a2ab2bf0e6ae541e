"""The walk: every rank's events, in write order, checked against what the engine would do.

:func:`~ranklog.archive._plan.check` reads each rank's event *heads* (seq, idx, step and
an event code, per table and piece) and hands them here in batches of ranks.
:func:`streams` walks a batch at once, as numpy arrays, keeping each rank's running
watermark as the engine would, and raises :class:`_No` naming the first rank
whose stream departs from the plain one (late values, step_end counts that differ, GPU
samples or params for steps it had closed, frames missing: :func:`frame_gaps`). Otherwise it
fills in each rank's :class:`RankPlan`: its watermark, its GPU samples' steps, its params
with the step each applies to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from ranklog.archive._blocks import END, OTHER
from ranklog.archive._files import Piece
from ranklog.schemas import ParamValue
from ranklog.shippers._ranks import ParamsRead
from ranklog.spool import NO_STEP

__all__ = [
    "END",
    "GPU",
    "NULL_STEP",
    "OTHER",
    "PARAMS",
    "STEP",
    "WALK_EVENTS",
    "Head",
    "RankPlan",
    "Walk",
    "frame_gaps",
    "streams",
]

#: a GPU sample's step when it has none (the step its rank is in)
NULL_STEP: Final = -(2**62)
# event codes in a rank's stream
STEP, PARAMS, GPU = 0, 2, 4


class _No(Exception):
    """The dataset needs the event path; the message says why (caught by the plan's check,
    which returns the message: never raised to a caller)."""


@dataclass(slots=True)
class RankPlan:
    """What the engine would end with for one rank."""

    rank: int
    watermark: int
    ended: bool
    world_size: int | None
    #: the status of its last rank_end (``unknown``: none, as the event path's stand-in)
    status: str = "unknown"
    params: list[ParamsRead] = field(default_factory=list)
    #: the params events as (effective step, ((key, value as JSON text), ...)), in order
    said: list[tuple[int, tuple[tuple[str, str], ...]]] = field(default_factory=list)
    #: where the rank's GPU samples are (in write order) and how many each piece holds,
    #: and each sample's step (from the check)
    gpu_pieces: list[tuple[Piece, int]] = field(default_factory=list)
    gpu_steps: Any = None


#: one table's events of one piece: (seq, idx, step, code (one for all, or one each),
#: the events each step_end counts (None: none counts), the segment's place in its rank)
Head = tuple[Any, Any, Any, Any, Any, int]
#: one rank to walk: its plan, its events' heads per table and file, its params (by
#: (seq, idx)), where they were read (for the params' source), and its segments (stem,
#: and the frame number after its seal, 0: not sealed)
Walk = tuple[
    RankPlan, list[Head], dict[tuple[int, int], list[tuple[str, str]]], str, list[tuple[str, int]]
]
#: events walked at once (ranks are walked together, as one set of arrays, up to this many)
WALK_EVENTS: Final = 1 << 20


def streams(batch: list[Walk]) -> None:
    """Walk ranks' events in write order, as the engine's watermarks would: every rank of
    ``batch`` at once, its rows sorted by (rank, seq, idx) and each running maximum kept
    within its rank (an offset per rank). The first rank (in order) that departs from
    the plain stream is named, with the first of its departures; a rank whose frames are
    not numbered on without a gap (:func:`frame_gaps`) is named by that first."""
    heads = [h for w in batch for h in w[1]]
    lengths = [len(h[0]) for h in heads]
    who = np.repeat(np.arange(len(batch)), [sum(len(h[0]) for h in w[1]) for w in batch])
    if not heads or not who.size:
        frames = frame_gaps(batch, who, np.zeros(0, np.int64), np.zeros(0, np.int64))
        if frames is not None:
            raise _No(frames[3])
        return
    seq, idx, step = (np.concatenate([h[i] for h in heads]) for i in range(3))
    code = np.repeat([h[3] if type(h[3]) is int else 0 for h in heads], lengths).astype(np.int8)
    counted = np.full(len(seq), -1, np.int64)
    at = 0
    for h, n in zip(heads, lengths, strict=True):  # (one a segment: its ranks table)
        if type(h[3]) is not int:
            code[at : at + n] = h[3]
        if h[4] is not None:
            counted[at : at + n] = h[4]
        at += n
    frames = frame_gaps(batch, who, np.repeat([h[5] for h in heads], lengths), seq)
    order = np.lexsort((idx, seq, who))
    who, seq, idx = who[order], seq[order], idx[order]
    step, code, counted = step[order], code[order], counted[order]
    first = np.ones(len(who), bool)  # each rank's first event
    first[1:] = who[1:] != who[:-1]
    ends = np.flatnonzero(np.append(first[1:], True))  # each rank's last event
    is_end, is_step = code == END, code == STEP
    marked = np.where(is_end | is_step, step, NO_STEP)
    span = int(marked.max()) - NO_STEP + 1  # a rank's running maxima stay below the next's
    if len(batch) > 1 and span * len(batch) >= 2**62:  # (steps too far apart to offset:
        # one rank at a time; a rank alone has no offset, so it never comes here again)
        for w in batch:
            streams([w])
        return
    # one rank alone needs no offset (its steps may reach 2**63-1: no room for one)
    offset = who.astype(np.int64) * span if len(batch) > 1 else 0

    def running(values: Any) -> Any:  # the running maximum within each rank
        return np.maximum.accumulate(values + offset) - offset

    def before(values: Any) -> Any:  # the value at the event before, within its rank
        out = np.empty_like(values)
        out[1:] = values[:-1]
        out[first] = NO_STEP
        return out

    closed = running(np.where(is_end, step, NO_STEP))
    top = running(np.where(is_step, step, NO_STEP))
    before_closed, before_top = before(closed), before(top)
    # implied_after(): a step event above every step before it, no step_end before it,
    # closes the highest step before it; the running maximum of those
    moved = is_step & (step > before_top) & (before_closed == NO_STEP)
    implied = running(np.where(moved, before_top, NO_STEP))
    own = np.maximum(before_closed, before(implied))  # the watermark (watermark())
    #: (rank's place, check's place, event's place, why): the first of them is named
    failed: list[tuple[int, int, int, str]] = [] if frames is None else [frames]
    late = np.flatnonzero(is_step & (step <= own))
    if len(late):
        failed.append((int(who[late[0]]), 0, 0, "logged late values"))
    checked = is_end & (counted >= 0)
    if np.any(checked):
        # each (rank, step)'s step events against what its step_end counts
        key = step + (who.astype(np.int64) * span - NO_STEP if len(batch) > 1 else 0)
        keys, counts = np.unique(key[is_step], return_counts=True)
        want_key, want = key[checked], counted[checked]
        got = np.zeros(len(want_key), np.int64)
        if len(keys):
            at = np.minimum(np.searchsorted(keys, want_key), len(keys) - 1)
            got = np.where(keys[at] == want_key, counts[at], 0)
        wrong = np.flatnonzero(got != want)
        if len(wrong):
            failed.append((int(who[checked][wrong[0]]), 1, 0,
                           "a step_end counts other events than the dataset holds"))  # fmt: skip
    is_gpu = code == GPU
    steps_of: Any = None
    if np.any(is_gpu):  # the step a sample goes to: its own, or the one its rank is in
        raw, mine, gwho = step[is_gpu], own[is_gpu], who[is_gpu]
        given = raw != NULL_STEP
        bad = np.flatnonzero(given & (raw <= mine))
        if len(bad):
            failed.append((int(gwho[bad[0]]), 2, 0, "has GPU samples for steps it had closed"))
        steps_of = np.where(given, raw, mine + 1)
        down = np.flatnonzero((steps_of[1:] < steps_of[:-1]) & (gwho[1:] == gwho[:-1]))
        if len(down):
            failed.append((int(gwho[down[0] + 1]), 3, 0, "has GPU samples out of step order"))
    said = []  # (rank's place, effective step, seq, idx) of each params event
    for i in np.flatnonzero(code == PARAMS).tolist():
        effective = int(before_top[i]) + 1 if before_top[i] >= 0 else 0
        place = int(who[i])
        if effective <= own[i]:  # the step they apply to may be shipped when they are read
            why = f"logged params for step {effective}, which it had closed"
            failed.append((place, 4, i, why))
        said.append((place, effective, int(seq[i]), int(idx[i])))
    if failed:
        place, check, _, why = min(failed)
        if check < 0:  # (frames: their segment named)
            raise _No(why)
        rank = batch[place][0].rank
        raise _No(f"rank {rank}: {why}" if why.startswith("a ") else f"rank {rank} {why}")
    if steps_of is not None:
        gwho = who[is_gpu]
        cut = np.flatnonzero(gwho[1:] != gwho[:-1]) + 1
        for at, part in zip(gwho[np.concatenate(([0], cut))].tolist(), np.split(steps_of, cut),
                            strict=True):  # fmt: skip
            batch[at][0].gpu_steps = part
    last = np.maximum(closed[ends], implied[ends]).tolist()
    for place, mark in zip(who[ends].tolist(), last, strict=True):
        batch[place][0].watermark = int(mark)
    for place, effective, q, k in said:
        rp, _, params, where, _ = batch[place]
        items = params[(q, k)]
        values: dict[str, ParamValue] = {name: json.loads(text) for name, text in items}
        rp.params.append(ParamsRead(effective, rp.rank, values, True, f"{where}#{q}.{k}"))
        rp.said.append((effective, tuple(items)))


def frame_gaps(
    batch: list[Walk], who: Any, segno: Any, seq: Any
) -> tuple[int, int, int, str] | None:
    """The first segment (ranks in order, a rank's segments in order) whose frames (the
    ``seq`` of its events, whatever their table) are not those that follow the segments
    before it: numbered on from where they stopped, without a gap, a sealed segment's
    seal counted (its number the one after its last frame). As (rank's place, -1, 0,
    why), or None: every segment's frames are whole. ``who``, ``segno``: each event's
    rank (place in ``batch``) and segment (place in its rank)."""
    per_rank = [len(w[4]) for w in batch]
    rank_of = np.repeat(np.arange(len(batch)), per_rank)  # each segment's rank's place
    base = np.cumsum([0, *per_rank])[:-1].astype(np.int64)  # each rank's first segment
    gid = base[who] + segno  # each event's segment, as one number for the batch
    o = np.lexsort((seq, gid))
    g, q = gid[o], seq[o]
    new = np.ones(len(g), bool)
    new[1:] = (g[1:] != g[:-1]) | (q[1:] != q[:-1])
    g, q = g[new], q[new]  # each segment's frames, once each, in order
    count = np.bincount(g, minlength=len(rank_of))
    lo, hi = np.zeros(len(rank_of), np.int64), np.zeros(len(rank_of), np.int64)
    if len(g):
        firsts = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1])))
        lasts = np.append(firsts[1:] - 1, len(g) - 1)
        lo[g[firsts]], hi[g[lasts]] = q[firsts], q[lasts]
    seal = np.array([s for w in batch for _, s in w[4]], np.int64)
    taken = count + (seal > 0)  # the numbers each segment takes, its seal's included
    upto = np.concatenate(([0], np.cumsum(taken)))  # the numbers the segments before take
    start = upto[:-1] - np.repeat(upto[base], per_rank)  # where each segment's frames start
    missing = (count > 0) & ((lo != start) | (hi - lo + 1 != count))
    unsealed = ~missing & (seal > 0) & (seal - 1 != start + count)
    bad = np.flatnonzero(missing | unsealed)
    if not len(bad):
        return None
    i = int(bad[0])
    place = int(rank_of[i])
    stem = batch[place][4][i - int(base[place])][0]
    why = "frames are missing" if missing[i] else "frames before the seal are missing"
    return place, -1, 0, f"{stem}: {why}"
