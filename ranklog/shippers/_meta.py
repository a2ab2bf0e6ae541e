"""Run records on their way to a target: hyperparameters and records parted.

Run records (metric definitions, summary values, the code's git state: see
:mod:`ranklog.producer._records`) travel with the hyperparameters, keyed with a leading
``@``, so they are read, ordered, committed, compacted and replayed exactly as params
are. Here, at the target, they part: params to ``write_params``, records (keys without
the ``@``) to the target's optional ``write_meta``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from ranklog.schemas import ParamValue, split_meta
from ranklog.shippers._target import Target

__all__ = ["code_line", "fingerprint", "records", "write_params"]

log = logging.getLogger("ranklog.ship")

#: run records by kind, as said when a target has no place for them
KINDS: Final = {
    "summary": "summary values",
    "code": "the code's git state",
    "define": "metric definitions",
}


def records(meta: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The run records of one kind (``code``, ``summary``, ``define``), by their own key:
    ``records({"code/commit": "4f1c"}, "code") == {"commit": "4f1c"}``."""
    prefix = kind + "/"
    return {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}


def code_line(code: Mapping[str, Any]) -> str:
    """A run's code in one line, ``4f1c2e9d8b7a on main (uncommitted changes)``, from its
    ``code`` records ("" without a commit)."""
    if not code.get("commit"):
        return ""
    where = f" on {code['branch']}" if code.get("branch") else ""
    dirty = " (uncommitted changes)" if code.get("dirty") else ""
    return f"{str(code['commit'])[:12]}{where}{dirty}"


#: a text longer than this is kept in the engine and its cursor by its digest
FINGERPRINT_OVER: Final = 1024


def fingerprint(value: ParamValue) -> ParamValue:
    """``value``, or for a long text (the code's diff: up to 1 MiB) a short stand-in that
    is equal exactly when the texts are: what the engine compares and the cursor keeps."""
    if isinstance(value, str) and len(value) > FINGERPRINT_OVER:
        import hashlib

        return "\x00sha256:" + hashlib.sha256(value.encode()).hexdigest()
    return value


def write_params(target: Target, group: dict[str, ParamValue], said: set[str]) -> None:
    """Hand ``group`` to ``target``: params to ``write_params``, records to ``write_meta``.

    ``write_meta(meta)`` returns the keys it has no place for (None: it took them all); a
    target without it has no place for any. Records left out are said once per key
    (``said`` keeps which), a line per kind: summary values with a warning (training
    logged them), the code's git state and metric definitions at INFO (ranklog's own, or
    display only).
    """
    params, meta = split_meta(group)
    if params:
        target.write_params(params)
    if not meta:
        return
    write_meta = getattr(target, "write_meta", None)
    left = list(meta) if not callable(write_meta) else list(write_meta(meta) or ())
    new = [k for k in left if k not in said]
    said.update(new)
    for kind in sorted({k.split("/", 1)[0] for k in new}):
        keys = sorted(k.split("/", 1)[1] for k in new if k.startswith(kind + "/"))
        shown = ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")
        level = logging.WARNING if kind == "summary" else logging.INFO
        log.log(level, "%s: %s left out (%s): %s has no place for them; JSONL and Parquet "
                "keep them (docs/producer.md, run records)", target.spec,
                KINDS.get(kind, kind), shown, target.kind)  # fmt: skip
