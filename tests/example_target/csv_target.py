"""``csv:PATH``: ``step,name,value`` rows of each reduced step (the example of docs/targets.md).

Each step's rows end with a row of its own, ``step,,`` (no name): a step is in the
file once that row is. A crash can tear a step's rows; ``open`` cuts them off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ranklog.schemas import ParamValue
from ranklog.shippers import Option, ShippedStep, TargetContext, TargetKind
from ranklog.spool import RunInfo


class CsvTarget:
    """Appends rows to a CSV file, unbuffered (a killed shipper wrote what the OS has)."""

    kind = "csv"

    def __init__(self, path: Path, delimiter: str) -> None:
        self.path, self.sep = path, delimiter
        self.spec = f"csv:{path}"
        self._file: Any = None

    def open(self, run: RunInfo) -> int | None:
        """Cut whatever follows the last complete step; return that step (None: none)."""
        data = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        end, last = 0, None
        pos = 0
        for row in data.splitlines(keepends=True):
            pos += len(row)
            step, name, _ = row.rstrip("\n").split(self.sep, 2)
            if not name and row.endswith("\n"):  # a step's closing row
                end, last = pos, int(step)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115
        self._file.truncate(end)
        return last

    def write_params(self, params: dict[str, ParamValue]) -> None:
        pass  # a CSV of values has no place for them

    def write(self, steps: list[ShippedStep]) -> None:
        d = self.sep
        for s in steps:
            rows = [f"{s.step}{d}{name}{d}{value!r}\n" for name, value in s.metrics.items()]
            self._file.write(("".join(rows) + f"{s.step}{d}{d}\n").encode())

    def flush(self) -> None:
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None


def build(arg: str, context: TargetContext, options: Mapping[str, Any]) -> CsvTarget:
    """The target of ``csv:PATH`` (``context`` and ``options`` as declared below)."""
    return CsvTarget(Path(arg), options["csv_delimiter"] or ",")


TARGET = TargetKind(
    kind="csv",
    arg="PATH",
    help="step,name,value rows of each reduced step",
    build=build,
    options=(Option("csv_delimiter", "the CSV field delimiter (default ,)", metavar="C"),),
)
