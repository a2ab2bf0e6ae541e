"""The archive: a spool compacted into Parquet, read back, and replayed into any target.

::

    _compact.py    ranklog compact: segments -> one long-format table per kind, incremental
    _tables.py     the tables' schemas, and events of the other kinds turned into rows
    _block.py      many segments' reads turned into one set of tables at once
    _bulk.py       metric values read in bulk from their msgpack bytes (no dict per event)
    _parts.py      layout 2: blocks written as a few part files per table, rows by step
    _merge.py      layout 2: small parts merged into larger ones, crash-safely
    _delete.py     compact --delete: segments removed once their rows read back equal
    _manifest.py   DIR/_manifest.json: what is compacted, per segment and incarnation
    _files.py      where a segment's rows are (files, part pieces), read with bounded memory
    _rows.py       rows turned back into events, in write order
    _steps.py      the steps table: written by compaction's engine, handed to it by replay
    _replay.py     ranklog replay: the steps table, or the raw rows as the engine's source

It sits beside the pipeline (schemas -> spool -> shippers -> targets): it reads
the spool and drives the shipper engine, and nothing below it imports it.
Importing it imports pyarrow; ``import ranklog`` never does. Replay (and with it the
shipper engine) is imported on first use: ``ranklog compact`` starts without them.
"""

import importlib
from typing import TYPE_CHECKING, Any

from ranklog.archive._manifest import (
    MANIFEST,
    Manifest,
    load_manifest,
    not_a_dataset,
    require_manifest,
    table_files,
)
from ranklog.archive._tables import COMMON, SCHEMAS, STEP_TABLES, TABLES

if TYPE_CHECKING:
    from ranklog.archive._block import segment_tables
    from ranklog.archive._compact import CompactResult, compact
    from ranklog.archive._parts import check_files
    from ranklog.archive._replay import ParquetSource, replay, write_steps

#: names imported when first asked for, from the module that holds them: a replay does not
#: load compaction's modules, nor compaction replay's
_LAZY = {
    "ParquetSource": "_replay",
    "replay": "_replay",
    "write_steps": "_replay",
    "CompactResult": "_compact",
    "compact": "_compact",
    "segment_tables": "_block",
    "check_files": "_parts",
}

__all__ = [
    "COMMON",
    "MANIFEST",
    "SCHEMAS",
    "STEP_TABLES",
    "TABLES",
    "CompactResult",
    "Manifest",
    "ParquetSource",
    "check_files",
    "compact",
    "load_manifest",
    "not_a_dataset",
    "replay",
    "require_manifest",
    "segment_tables",
    "table_files",
    "write_steps",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
