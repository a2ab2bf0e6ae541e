"""``parquet:DIR``: the reduced steps as shipped, a Parquet table DuckDB and Polars read live.

::

    DIR/steps-00000001.parquet      one file per flush, in order
    DIR/steps-00000002.parquet      (rows: see ranklog.shippers._steps_table)

Every call the engine makes (steps, params, the job's end) is a row group of the
table, in call order; a flush writes the rows since the last one as the next file,
whole or not at all (written aside, fsync'd, then linked to its name, which fails if
the name exists: two writers never share a file). ``ranklog compact`` writes a
dataset's ``steps/`` with this target, and ``ranklog replay`` ships such a table into
any target.

On open every file's footer and ``step``/``carrier``/``kind`` columns are read: the steps
this run holds (a late value's carrier included), and whose run the files are. Another
run's files refuse the directory (:class:`~ranklog.errors.TargetHeldError`); so does
this run's written with another ``--names``. A file that is not a steps file of ours
(another program's, damaged, or a later version's) refuses it too
(:class:`~ranklog.errors.TargetError`, naming the file): ranklog writes only into a
directory it made, an empty one, or its own. ``--per-rank`` values are not kept here (the
dataset's raw tables hold each rank's rows).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from ranklog._fs import DIR_MODE, create_once, fsync_dir
from ranklog.errors import TargetError, TargetHeldError
from ranklog.schemas import ParamScalar, ParamValue
from ranklog.shippers._held import StepSet
from ranklog.shippers._place import dir_place
from ranklog.shippers._registry import TargetContext, TargetKind
from ranklog.shippers._steps_table import FILE, STEPS_VERSION, StepsBuffer
from ranklog.shippers._steps_table import step_files as listed
from ranklog.shippers._target import ShippedStep
from ranklog.spool import RunInfo

__all__ = ["ParquetTarget", "held_steps", "step_files"]

ALL_NAMES: Final = "*"


def step_files(path: Path) -> list[Path]:
    """Every steps file in ``path``, in order; a file of another name (other than a
    writer's hidden temporary one) refuses the directory."""
    try:
        files, others = listed(path)
    except OSError as exc:
        raise TargetError(f"parquet:{path}: cannot list the directory ({exc})") from exc
    if others:
        raise TargetError(
            f"parquet:{path} holds {others[0]!r}, which is not a ranklog steps file: "
            "parquet: writes into an empty directory or its own (give another DIR)"
        )
    return files


def held_steps(file: Path, run_id: str, names: str) -> StepSet:
    """The steps of ``run_id`` a steps file holds (its footer must name that run)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(file) as pf:  # (opened once: its footer, then its step columns)
            _check_steps_file(file, pf.schema_arrow.metadata or {}, run_id, names)
            t = pf.read(columns=["kind", "step", "carrier"])
    except (OSError, pa.ArrowException) as exc:
        raise TargetError(f"{file} is damaged ({exc}): move it away, then ship again "
                          "(its steps are shipped again)") from exc  # fmt: skip
    kinds = pc.cast(t.column("kind"), pa.string())
    steps = t.filter(pc.equal(kinds, "step"))
    own = pc.fill_null(steps.column("carrier"), steps.column("step"))
    return StepSet(own.to_pylist())


def _check_steps_file(file: Path, meta: dict[bytes, bytes], run_id: str, names: str) -> None:
    """Refuse a steps file of another version, another run or another ``--names``."""
    if meta.get(b"ranklog.steps") != STEPS_VERSION.encode():
        version = meta.get(b"ranklog.steps", b"none").decode(errors="replace")
        raise TargetError(f"{file} is not a ranklog steps file of this release "
                          f"(version {version}): give another DIR")  # fmt: skip
    theirs = meta.get(b"ranklog.run_id", b"").decode(errors="replace")
    if theirs != run_id:
        raise TargetHeldError(f"parquet:{file.parent} holds run {theirs}'s steps, not this "
                              f"run's ({run_id}): give another DIR")  # fmt: skip
    named = meta.get(b"ranklog.names", b"*").decode(errors="replace")
    if named != names:
        raise TargetHeldError(f"parquet:{file.parent} holds this run's steps with --names "
                              f"{named!r}, not {names!r}: give another DIR")  # fmt: skip


class ParquetTarget:
    """Writes the engine's calls as the ``steps`` table in one directory (see the module)."""

    kind = "parquet"
    #: late values are rows of their own step, after their carrier
    takes_late = True

    def __init__(self, path: str | os.PathLike[str], *, names: str = ALL_NAMES) -> None:
        self.path = Path(path)
        self.names = names
        self.spec = f"parquet:{self.path}"
        self._run: RunInfo | None = None
        self._next = 1
        self._rows = StepsBuffer()

    def identity(self, run: RunInfo) -> str:
        """The directory's real path."""
        return f"parquet:{os.path.realpath(self.path.expanduser())}"

    def place(self, run: RunInfo) -> str | None:
        """The directory's device and inode (a bind mount is the same directory)."""
        return dir_place(self.path.expanduser())

    def open(self, run: RunInfo) -> StepSet:
        try:
            self.path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        except OSError as exc:
            raise TargetError(f"{self.spec}: cannot make the directory ({exc})") from exc
        held = StepSet()
        files = step_files(self.path)
        for file in files:
            held = held.union(held_steps(file, run.run_id, self.names))
        self._run, self._rows = run, StepsBuffer()
        m = FILE.fullmatch(files[-1].name) if files else None
        self._next = int(m.group(1)) + 1 if m else 1
        return held

    def write_params(self, params: dict[str, ParamValue]) -> None:
        self._require()
        self._rows.params(params)

    def write_meta(self, meta: dict[str, ParamScalar]) -> None:
        """Run records are kept as they came (None: every key has its place)."""
        self._require()
        self._rows.params(meta, meta=True)

    def write(self, steps: list[ShippedStep]) -> None:
        self._require()
        self._rows.steps(steps)

    def end(self, status: str) -> None:
        """The job ended: a row of its own, so that a replay ends the same way."""
        self._require()
        self._rows.end(status)
        self.flush()

    def flush(self) -> None:
        run = self._require()
        if not len(self._rows):
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        meta = {"ranklog.run_id": run.run_id, "ranklog.names": self.names}
        table = self._rows.table(meta)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd", row_group_size=1 << 20)
        name = self.path / f"steps-{self._next:08d}.parquet"
        try:
            made = create_once(name, sink.getvalue().to_pybytes())
        except OSError as exc:
            raise TargetError(f"{self.spec}: cannot write {name.name} ({exc})") from exc
        if not made:
            raise TargetHeldError(f"{self.spec}: {name.name} was written by another process "
                                  "meanwhile: one writer per directory")  # fmt: skip
        fsync_dir(self.path)
        self._next += 1

    def close(self) -> None:
        self._run = None

    def _require(self) -> RunInfo:
        if self._run is None:
            raise TargetError(f"{self.spec} is not open")
        return self._run


def _build(arg: str, context: TargetContext, options: Mapping[str, Any]) -> ParquetTarget:
    return ParquetTarget(Path(arg).expanduser(), names=context.names)


TARGET = TargetKind(
    kind="parquet",
    arg="DIR",
    help="the reduced steps as shipped, a Parquet table in DIR (DuckDB, Polars, replay)",
    build=_build,
)
