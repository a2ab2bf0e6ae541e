"""Run records: what a run says about itself besides values and hyperparameters.

Three kinds travel in a params event's ``meta`` map (``ranklog.schemas.Params``), each
key once per run (a later one replaces it), shipped before the next step as params are:

- ``define/<glob>``: a metric definition (W&B's ``define_metric``), its options as JSON;
- ``summary/<key>``: a summary value (W&B's ``run.summary``);
- ``code/<field>``: the code the run came from (:func:`code_record`), recorded by rank 0
  at ``init``: ``commit``, ``branch``, ``dirty``, ``remote``, ``root``, ``diff`` (against
  ``HEAD``, tracked files only, at most :data:`MAX_DIFF_BYTES`), ``diff_bytes`` (its whole
  size) and ``diff_truncated``; credential-shaped tokens in the diff are ``<redacted>``
  (``diff_redacted``: how many).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any, Final

from ranklog.errors import InvalidValueError
from ranklog.producer._redact import redact_text
from ranklog.producer._values import as_float, check_name
from ranklog.schemas import ParamScalar

__all__ = [
    "CODE_ENV",
    "MAX_DIFF_BYTES",
    "code_record",
    "definition",
    "summary_values",
]

log = logging.getLogger("ranklog")

#: ``RANKLOG_CODE=0`` turns code provenance off (as ``ranklog.init(code=False)``)
CODE_ENV: Final = "RANKLOG_CODE"
#: the most of ``git diff HEAD`` a run records (cut at a line end; ``diff_truncated``)
MAX_DIFF_BYTES: Final = 1024 * 1024
#: the time each git command may take (a repository on a slow shared filesystem)
GIT_TIMEOUT: Final = 10.0
#: W&B's summary aggregations that ``define_metric(summary=...)`` takes
SUMMARIES: Final = frozenset({"min", "max", "mean", "best", "last", "first", "none"})


def definition(
    name: str, step_metric: str | None, summary: str | None, hidden: bool,
    goal: str | None = None,
) -> tuple[str, str]:  # fmt: skip
    """The record of one ``define_metric`` call: (``define/<name>``, options as JSON)."""
    check_name("metric definition", name)
    if "*" in name[:-1]:
        raise InvalidValueError(
            f"metric definition {name!r}: '*' may only end a glob (as in W&B: 'ray/*')"
        )
    options: dict[str, Any] = {}
    if step_metric is not None:
        options["step_metric"] = check_name("step metric", step_metric)
    if summary is not None:
        ops = summary.split(",") if isinstance(summary, str) else [summary]
        bad = [op for op in ops if op not in SUMMARIES]
        if bad:
            raise InvalidValueError(
                f"metric definition {name!r}: summary {summary!r} is not one of "
                f"{sorted(SUMMARIES)} (several joined by commas)"
            )
        options["summary"] = summary
    if hidden:
        options["hidden"] = True
    if goal is not None:
        if goal not in ("minimize", "maximize"):
            raise InvalidValueError(
                f"metric definition {name!r}: goal {goal!r} is not 'minimize' or 'maximize'"
            )
        options["goal"] = goal
    return f"define/{name}", json.dumps(options, sort_keys=True)


def summary_values(values: Mapping[str, Any]) -> dict[str, ParamScalar]:
    """``summary/<key>`` records of a summary update: numbers, strings, bools, None."""
    if not isinstance(values, Mapping):
        raise InvalidValueError(f"summary must be a dict, got {type(values).__name__}")
    out: dict[str, ParamScalar] = {}
    for key, v in values.items():
        name = check_name("summary", key)
        if v is None or isinstance(v, bool | str) or (isinstance(v, int) and -(2**63) <= v < 2**63):
            out[f"summary/{name}"] = v
        else:  # a float, a numpy or torch scalar; anything else is refused naming the key
            try:
                out[f"summary/{name}"] = as_float(name, v)
            except InvalidValueError as exc:
                raise InvalidValueError(str(exc).replace("metric", "summary", 1)) from None
    return out


def _git(args: list[str], cwd: str) -> str | None:
    import subprocess  # here: ``import ranklog`` stays light

    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, env=env, capture_output=True, timeout=GIT_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("git %s: %s", " ".join(args), exc)
        return None
    if done.returncode != 0:
        return None
    return done.stdout.decode("utf-8", "replace")


def _without_credentials(url: str) -> str:
    """A remote URL without the user and password an https URL may carry."""
    return re.sub(r"^([a-z][a-z0-9+.-]*://)[^/@]*@", r"\1", url.strip())


def code_record(cwd: str | None = None) -> dict[str, ParamScalar]:
    """``code/<field>`` records of the git repository ``cwd`` is in; {} outside one.

    Runs git with optional locks off (``git status`` of many jobs never contends for the
    index lock), each command bounded by :data:`GIT_TIMEOUT` seconds. Untracked files
    are neither in the diff nor make the tree dirty.
    """
    where = cwd or os.getcwd()
    top = _git(["rev-parse", "--show-toplevel", "HEAD"], where)
    if top is None:
        return {}
    lines = top.splitlines()  # a path may hold spaces
    if len(lines) != 2:
        return {}  # a repository without a commit yet
    root, commit = lines
    branch = (_git(["rev-parse", "--abbrev-ref", "HEAD"], where) or "").strip()
    status = _git(["status", "--porcelain", "--untracked-files=no"], where)
    diff = _git(["diff", "HEAD", "--no-color", "--no-ext-diff"], where) or ""
    remote = _git(["remote", "get-url", "origin"], where)
    raw = diff.encode()
    truncated = len(raw) > MAX_DIFF_BYTES
    if truncated:
        cut = raw[:MAX_DIFF_BYTES]
        end = cut.rfind(b"\n")
        diff = cut[: end + 1 if end >= 0 else len(cut)].decode("utf-8", "ignore")
    diff, hidden = redact_text(diff)  # a token in a tracked file never leaves the machine
    out: dict[str, ParamScalar] = {
        "code/commit": commit,
        "code/branch": "" if branch == "HEAD" else branch,  # detached: no branch
        "code/dirty": bool(status and status.strip()) if status is not None else bool(diff),
        "code/root": root,
        "code/diff": diff,
        "code/diff_bytes": len(raw),
        "code/diff_truncated": truncated,
    }
    if remote:
        out["code/remote"] = _without_credentials(remote)
    if hidden:
        out["code/diff_redacted"] = hidden
    return out
