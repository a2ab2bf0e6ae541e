"""A target re-created from its identity alone: what the job's epilogue ships to.

``ranklog ship SPOOL --once`` with no ``--to`` (a job's epilogue) starts one shipper per
cursor of the spool. The spool is shared, so a cursor is data, never instructions: what
a shipper writes to is rebuilt from the cursor's *identity* (absolute, canonical: see
each target's ``identity``), parsed strictly per kind into ``--to`` and the options that
name the place (``--experiment``, ``--run-id``, ``--dir``...). Nothing else of the cursor
becomes a flag: the shipper's options are the epilogue's own command line. The shipper
then checks that the target it built has that very identity (the cursor's owner check),
so a forged identity can at most be refused. Each flag is written ``--flag=VALUE``: a
value that starts with ``-`` stays a value.

A target's presentation options (``--gpu-names``, ``--histogram-stats``,
``--image-layout``, ``--leave-out``, ...: how its values are named and drawn, which must
not change in the middle of a run) are taken from the cursor's record of the command
that started it (:func:`kept_options`), and only those: each one the target's kind
declares, checked as the command line checks it; never one that names a place (those
come from the identity), never a shipper option.

Cursor and lease names are plain file names inside ``SPOOL/cursors``
(:func:`check_name`).
"""

from __future__ import annotations

import re
from typing import Final

from ranklog.errors import ConfigError

__all__ = ["check_name", "kept_options", "reopen_flags"]

#: options that name where a target writes: the identity's alone say that
_PLACE_OPTIONS: Final = frozenset({"dir", "run_id", "entity", "mode", "experiment",
                                   "artifact_location"})  # fmt: skip

#: an absolute path as an identity holds it (no NUL, no line break, no ``#``)
_ABS: Final = r"/[^\x00\n\r#]*"
_VALUE: Final = r"[^\x00\n\r]+"
_PATTERNS: Final = {
    "mlflow": re.compile(
        rf"(sqlite:///{_ABS}|databricks(?:-uc)?(?:://[^\s#]+)?|(?!sqlite:|file:)[a-z][a-z0-9+.\-]*://[^\s#]+)"
        rf"#(experiment|run)=({_VALUE})"
    ),
    "wandb": re.compile(rf"([^/\x00\n\r]*)/([^/\x00\n\r]+)/([^/@\x00\n\r]+)(?:@({_ABS}))?"),
    "swanlab": re.compile(rf"({_ABS})#project=([^&\x00\n\r]+)&run=({_VALUE})"),
    "trackio": re.compile(rf"({_ABS})/([^/\x00\n\r#]+)\.db#run=({_VALUE})"),
}


def reopen_flags(identity: str) -> list[str]:
    """The ``ranklog ship`` flags that build the target whose identity is ``identity``.

    :class:`ConfigError` when it is not one this release can rebuild (an older cursor
    with no identity, a plug-in target named by a relative path, a damaged cursor).
    """
    kind, sep, rest = identity.partition(":")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", kind) or "\x00" in identity or "\n" in identity:
        raise ConfigError(f"{identity!r} is no target identity")
    if kind == "console" and re.fullmatch(r"\d*", rest):
        return [f"--to={identity}"]
    pattern = _PATTERNS.get(kind)
    m = pattern.fullmatch(rest) if pattern is not None else None
    if kind == "mlflow" and m:
        uri, where, value = m.groups()
        option = "--experiment" if where == "experiment" else "--run-id"
        return [f"--to=mlflow:{uri}", f"{option}={value}"]
    if kind == "wandb" and m:
        entity, project, run_id, root = m.groups()
        flags = [f"--to=wandb:{project}", f"--run-id={run_id}"]
        flags += [f"--entity={entity}"] if entity else []
        return flags + (["--mode=offline", f"--dir={root}"] if root else ["--mode=online"])
    if kind == "swanlab" and m:
        where, project, run_id = m.groups()
        return [f"--to=swanlab:{project}", f"--dir={where}", f"--run-id={run_id}"]
    if kind == "trackio" and m:
        where, project, run_id = m.groups()
        return [f"--to=trackio:{project}", f"--dir={where}", f"--run-id={run_id}"]
    if pattern is None and sep and re.fullmatch(_ABS, rest):  # jsonl, tensorboard, plug-ins
        return [f"--to={identity}"]
    raise ConfigError(f"{identity!r} is no {kind} target this ranklog can re-create")


def kept_options(kind: str, recorded: list[str]) -> list[str]:
    """The presentation options of a ``kind`` target in ``recorded`` (a cursor's record of
    the arguments that started its shipper), validated, as ``--flag=VALUE``; anything else
    in it (a shipper option, a place, a path, an unknown flag, a bad value) is dropped."""
    from ranklog.shippers._registry import LEAVE_OUT, target_kinds

    declared = target_kinds().get(kind)
    if declared is None:
        return []
    options = {o.flag: o for o in (*declared.options, LEAVE_OUT) if o.name not in _PLACE_OPTIONS}
    out: dict[str, str] = {}
    i = 0
    while i < len(recorded):
        token = str(recorded[i])
        flag, eq, text = token.partition("=")
        opt = options.get(flag)
        i += 1
        if opt is None:
            continue
        if opt.type is bool:
            out[opt.flag] = opt.flag
            continue
        if not eq:
            if i >= len(recorded):
                break
            text, i = str(recorded[i]), i + 1
        try:
            opt.parse(text)
        except ConfigError:
            continue
        if "\x00" not in text and "\n" not in text:
            out[opt.flag] = f"{opt.flag}={text}"
    return list(out.values())


def check_name(name: str) -> str:
    """``name`` if it is a plain file name for a cursor or lease inside ``SPOOL/cursors``;
    else :class:`ConfigError` (a separator, ``..``, a leading dot, a control character)."""
    if not name or len(name) > 200 or name.startswith(".") or re.search(r"[/\\\x00-\x1f]", name):
        raise ConfigError(
            f"shipper name {name!r} is not a plain file name (no /, no leading dot, no "
            "control character, at most 200 characters): choose another --name"
        )
    return name
