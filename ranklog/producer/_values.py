"""Checking and normalising what users log: numbers, steps, names, hyperparameters, tables."""

from __future__ import annotations

import json
import math
import numbers
import re
import types
from collections.abc import Iterable, Mapping
from typing import Any, Final

from ranklog.errors import InvalidStepError, InvalidValueError
from ranklog.producer._redact import Redactor
from ranklog.schemas import META_PREFIX, REDUCE_OPS, ParamScalar, ParamValue, TableCell

__all__ = [
    "MAX_NAME_CHARS",
    "MAX_STEP",
    "REDACTED",
    "Redactor",
    "as_float",
    "check_name",
    "check_step",
    "check_table",
    "flatten_params",
    "op_spec",
]

REDACTED: Final = "<redacted>"
#: the most cells one table may hold
MAX_TABLE_CELLS: Final = 1_000_000
#: the longest name (metric, timer, text, image, hyperparameter) accepted
MAX_NAME_CHARS: Final = 1024
#: the highest step: every backend and Parquet stores steps as signed 64-bit integers
MAX_STEP: Final = 2**63 - 1
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: the integers a hyperparameter keeps as a number (every backend's: signed 64-bit)
_PARAM_INT_MIN: Final = -(2**63)
_PARAM_INT_MAX: Final = 2**63 - 1


def as_float(key: object, value: object) -> float:
    """``value`` as a float, or InvalidValueError naming ``key``.

    Accepts Python and numpy reals (bool and int included), and numpy arrays or
    torch tensors of exactly one element. NaN and infinities are kept.
    """
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:  # an int past float's range (10**400)
            raise InvalidValueError(
                f"metric {key!r}: {_short(value)} is beyond the range of a float (about "
                "1.8e308): log it as a float, or scale it"
            ) from None
    numel = getattr(value, "numel", None)  # torch.Tensor
    size = numel() if callable(numel) else getattr(value, "size", None)  # numpy.ndarray
    item = getattr(value, "item", None)
    if isinstance(size, int) and callable(item):
        if size == 1:
            scalar = item()
            if isinstance(scalar, numbers.Real):
                return float(scalar)
        else:
            raise InvalidValueError(
                f"metric {key!r}: expected a real number, got a {type(value).__name__} "
                f"of {size} elements (log one element, or reduce it first)"
            )
    raise InvalidValueError(
        f"metric {key!r}: expected a real number, got {type(value).__name__} {_short(value)}"
    )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_step(step: object) -> int:
    """``step`` as an int from 0 to 2**63-1 (numpy integers too), or InvalidStepError."""
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise InvalidStepError(
            f"step must be a non-negative int, got {type(step).__name__} {step!r}"
        )
    value = int(step.__index__())
    if value < 0:
        raise InvalidStepError(f"step must be a non-negative int, got {value}")
    if value > MAX_STEP:
        raise InvalidStepError(f"step {value} does not fit in a signed 64-bit integer")
    return value


def check_name(what: str, name: object) -> str:
    """``name`` if it is fit to name a metric, timer, text or image; InvalidValueError if not.

    Any non-empty str of at most :data:`MAX_NAME_CHARS` characters, without control
    characters (NUL, newlines, escapes), that encodes to UTF-8. ``/`` groups names;
    characters a backend cannot take in a key or a file name are its target's business.
    """
    if not isinstance(name, str) or not name:
        raise InvalidValueError(f"{what} name {_short(name)} is not a non-empty str")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidValueError(
            f"{what} name {_short(name)} has {len(name)} characters, more than {MAX_NAME_CHARS}"
        )
    if _CONTROL.search(name):
        raise InvalidValueError(f"{what} name {name!r} contains a control character")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise InvalidValueError(f"{what} name {name!r} is not valid Unicode") from None
    return name


def op_spec(reduce: object, *, what: str = "reduce") -> str:
    """Canonical op spec (``"mean"`` or ``"mean,max"``) for one op or a sequence of ops."""
    ops: list[str]
    if isinstance(reduce, str):
        ops = [p.strip() for p in reduce.split(",")]
    elif isinstance(reduce, Iterable) and not isinstance(reduce, Mapping):
        ops = [str(p) for p in reduce]
    else:
        raise InvalidValueError(f"{what}: expected an op or a tuple of ops, got {reduce!r}")
    bad = [o for o in ops if o not in REDUCE_OPS]
    if not ops or bad:
        raise InvalidValueError(
            f"{what}: unknown reduce op {bad or ops!r}; choose from {sorted(REDUCE_OPS)}"
        )
    return ",".join(dict.fromkeys(ops))


def flatten_params(
    params: Mapping[str, Any] | Any, *, sep: str = ".", redactor: Redactor | None = None
) -> dict[str, ParamValue]:
    """Flatten nested mappings into ``a.b.c`` keys; redact secrets (:mod:`._redact`).

    Objects with ``__dict__`` (``argparse.Namespace``, simple dataclasses) are flattened
    like mappings. Lists and tuples of scalars stay lists; a sequence holding anything
    else, and other objects, become their text. Integers beyond 64 bits, NaN and
    infinities become their text too (no backend stores them as numbers).
    """
    out: dict[str, ParamValue] = {}
    _flatten(_as_mapping(params), "", sep, out, redactor or Redactor(env=True))
    return out


def _as_mapping(obj: Any) -> Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    if hasattr(obj, "__dataclass_fields__"):
        return {k: getattr(obj, k) for k in obj.__dataclass_fields__}
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    raise InvalidValueError(f"hyperparameters must be a mapping, got {type(obj).__name__}")


def _flatten(
    node: Mapping[str, Any],
    prefix: str,
    sep: str,
    out: dict[str, ParamValue],
    red: Redactor,
    depth: int = 0,
) -> None:
    for k, v in node.items():
        key = check_name("hyperparameter", f"{prefix}{k}")
        if key.startswith(META_PREFIX):
            raise InvalidValueError(
                f"hyperparameter {key!r}: a name starting with {META_PREFIX!r} is a ranklog run "
                "record's (define_metric, log_summary, code): rename the key"
            )
        if _nested(v) and depth < _MAX_DEPTH:
            _flatten(_as_mapping(v), key + sep, sep, out, red, depth + 1)
        elif red.key(key):
            out[key] = REDACTED
        else:
            value = _param_value(v)
            if isinstance(value, list):
                value = [red.text(key, x) if isinstance(x, str) else x for x in value]
            elif isinstance(value, str):
                value = red.text(key, value)
            out[key] = value


#: nesting flattened at most (a config that refers to itself stops there, as text)
_MAX_DEPTH: Final = 32


def _nested(v: Any) -> bool:
    """Whether ``v`` is flattened into keys: a mapping, a dataclass instance, or a namespace
    (``argparse.Namespace``, ``types.SimpleNamespace``); other objects are their text."""
    if isinstance(v, Mapping | types.SimpleNamespace):
        return True
    if any(c.__name__ == "Namespace" and c.__module__ == "argparse" for c in type(v).__mro__):
        return True  # (argparse itself not imported: import ranklog stays light)
    return hasattr(v, "__dataclass_fields__") and not isinstance(v, type)


def _param_value(v: Any) -> ParamValue:
    if isinstance(v, list | tuple):
        items = [_scalar(x) for x in v]
        if all(x is not _NOT_SCALAR for x in items):
            return items  # type: ignore[return-value]  # (the check above)
        return _text(v)
    scalar = _scalar(v)
    return str(v) if scalar is _NOT_SCALAR else scalar  # type: ignore[return-value]


_NOT_SCALAR: Final = object()


def _scalar(v: Any) -> ParamScalar | object:
    """``v`` as a hyperparameter scalar (big ints and non-finite floats as text), or
    :data:`_NOT_SCALAR`."""
    if v is None or type(v) in (str, bool):
        return v  # type: ignore[no-any-return]
    if isinstance(v, str):  # numpy.str_ and other subclasses: plain str for the encoder
        return str(v)
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, numbers.Integral):
        i = int(v)
        return i if _PARAM_INT_MIN <= i <= _PARAM_INT_MAX else str(i)
    if isinstance(v, numbers.Real):
        f = float(v)
        return f if math.isfinite(f) else str(f)
    return _NOT_SCALAR


def _text(v: Any) -> str:
    """A sequence that holds more than scalars (a list of dicts), as text: JSON where it
    can be, else ``str``."""
    try:
        return json.dumps(v, default=str)
    except (TypeError, ValueError):
        return str(v)


def check_table(
    name: str, columns: object, rows: object
) -> tuple[list[str], list[list[TableCell]]]:
    """``columns`` and ``rows`` as a table's (names, rows of cells); else InvalidValueError.

    A cell is a string, a real number (numpy scalars and one-element arrays included), a
    bool or None; every row has one cell per column. The error names the table, the row
    and the column, so nothing of a bad table is logged.
    """
    if isinstance(columns, str) or not isinstance(columns, Iterable):
        raise InvalidValueError(f"table {name!r}: columns must be a list of str")
    cols = list(columns)
    for i, c in enumerate(cols):
        if not isinstance(c, str):
            raise InvalidValueError(
                f"table {name!r}: column {i} must be a str, got {type(c).__name__}"
            )
    if len(set(cols)) != len(cols):
        raise InvalidValueError(f"table {name!r}: column names repeat: {cols}")
    if isinstance(rows, str | bytes) or not isinstance(rows, Iterable):
        raise InvalidValueError(f"table {name!r}: rows must be a list of rows")
    out: list[list[TableCell]] = []
    for r, row in enumerate(rows):
        cells = list(row) if isinstance(row, list | tuple) else None
        if cells is None or len(cells) != len(cols):
            raise InvalidValueError(
                f"table {name!r}: row {r} must be a list of {len(cols)} cells (one per column)"
            )
        out.append([_cell(name, r, cols[c], v) for c, v in enumerate(cells)])
    if len(out) * max(len(cols), 1) > MAX_TABLE_CELLS:
        raise InvalidValueError(f"table {name!r} has more than {MAX_TABLE_CELLS} cells")
    return cols, out


#: the integers a cell can hold (msgpack's: signed and unsigned 64-bit)
_CELL_INT_MIN: Final = -(2**63)
_CELL_INT_MAX: Final = 2**64 - 1


def _cell(name: str, row: int, column: str, v: Any) -> TableCell:
    kind = type(v)
    if v is None or kind is str or kind is bool or kind is float:
        return v  # type: ignore[no-any-return]
    if kind is int:
        if _CELL_INT_MIN <= v <= _CELL_INT_MAX:
            return v  # type: ignore[no-any-return]
        raise InvalidValueError(
            f"table {name!r}: row {row}, column {column!r}: the integer {_short(v)} does not "
            "fit in 64 bits"
        )
    if isinstance(v, str):  # numpy.str_ and other subclasses: plain str for the encoder
        return str(v)
    if isinstance(v, numbers.Integral):
        return _cell(name, row, column, int(v))
    if isinstance(v, numbers.Real):
        return float(v)
    numel = getattr(v, "numel", None)  # numpy scalars and arrays, torch tensors of one element
    item = getattr(v, "item", None)
    if callable(item) and (numel() if callable(numel) else getattr(v, "size", None)) == 1:
        scalar = item()
        if type(scalar) in (str, bool, int, float):
            return _cell(name, row, column, scalar)
    raise InvalidValueError(
        f"table {name!r}: row {row}, column {column!r}: expected a str, number, bool or "
        f"None, got {type(v).__name__} {_short(v)}"
    )
