"""Hyperparameters on their way to a target: which are new, and before which step each goes.

The tails report every params event they read (:class:`~ranklog.shippers._ranks.ParamsRead`),
with the first step it applies to: the one after the highest its rank had logged or
closed. :class:`ParamsQueue` keeps the new and changed keys, in log order, until they are
written just before the first shipped step at or after that step (or at the very end):
the same place live and in replay. Keys shipped are remembered by their fingerprint (a
long text, a diff, stays small in the cursor); a params event read again (a tail that
restarted) or handled by an earlier shipper process is taken once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ranklog.schemas import ParamValue
from ranklog.shippers._meta import fingerprint
from ranklog.shippers._ranks import ParamsRead

__all__ = ["Due", "ParamsQueue"]

#: a param due: (the step before which it is written, key, value)
Due = tuple[int, str, ParamValue]


class ParamsQueue:
    """The params a shipper knows, has shipped, and has still to write (see the module)."""

    __slots__ = ("_read", "due", "known", "shipped")

    def __init__(self) -> None:
        #: every param (and run record) known, as its fingerprint
        self.known: dict[str, ParamValue] = {}
        #: those the target accepted, as their fingerprint (kept in the cursor)
        self.shipped: dict[str, ParamValue] = {}
        #: new or changed params, in log order
        self.due: list[Due] = []
        #: where each params event this process took in was (segment@frame end)
        self._read: set[str] = set()

    def restore(self, shipped: Mapping[str, ParamValue]) -> None:
        """Carry on from a cursor's params (those an earlier process shipped)."""
        self.shipped = dict(shipped)
        self.known = dict(shipped)

    def take(self, reads: Iterable[ParamsRead], shipped_upto: int) -> None:
        """Take in what a read round found (each rank's in read order)."""
        for read in sorted(reads, key=lambda p: p.rank):
            effective = read.effective
            if read.where in self._read:
                continue  # read again by a tail that restarted: this process has it
            self._read.add(read.where)
            if not read.fresh and effective <= shipped_upto:
                continue  # handled by an earlier shipper process: shipped with its step
            # fresh, for a step already shipped (its rank was released, or came back as a
            # new incarnation): written before the next step shipped, never dropped
            effective = max(effective, shipped_upto + 1)
            for k, v in read.values.items():
                kept = fingerprint(v)
                if k not in self.known or self.known[k] != kept:
                    self.known[k] = kept
                    self.due.append((effective, k, v))

    def in_order(self) -> list[Due]:
        """The params due, by the step before which each goes (log order kept within one)."""
        return sorted(self.due, key=lambda d: d[0])

    def accepted(self, sent: list[Due]) -> None:
        """``sent`` (from :meth:`in_order`) were written and flushed: shipped, not due."""
        for _, k, v in sent:
            self.shipped[k] = fingerprint(v)
        done = set(map(id, sent))
        self.due = [d for d in self.due if id(d) not in done]
