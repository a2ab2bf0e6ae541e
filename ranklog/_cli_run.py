"""How a long-running ``ranklog`` command runs: its log lines, its collector, its options.

Shared by ``ranklog ship``, ``compact`` and ``replay`` (:mod:`ranklog.cli`,
:mod:`ranklog._cli_ship`). Nothing here imports more than the standard library until
it is called: ``ranklog compact`` starts without the shipper engine.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from typing import Any

__all__ = ["OPT", "check_options", "log_to_stderr", "long_running", "options"]

#: where parsed target option values go in the namespace (``opt_run_name`` ...)
OPT = "opt_"


def long_running() -> None:
    """Tune the collector for a shipper process, once its backend library is imported.

    What a shipper allocates (events, values, steps) is acyclic and freed by reference
    counting; what it imported (a backend's modules: MLflow and SQLAlchemy hold about a
    million objects) stays for good. Frozen, those are never traversed again, and full
    collections come a hundred times less often: they were a third of MLflow shipping.
    """
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    if "pyarrow" in sys.modules and not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        # Compaction and replay allocate and free columns all the time; the system
        # allocator measured up to twice as fast as mimalloc for that (the user's
        # ARROW_DEFAULT_MEMORY_POOL, when set, wins).
        import pyarrow as pa

        pa.set_memory_pool(pa.system_memory_pool())
    if "pyarrow" in sys.modules and "pandas" not in sys.modules:
        _pyarrow_without_pandas()


def _pyarrow_without_pandas() -> None:
    """Spare a compaction or replay the ~0.25 s of importing pandas, which it never uses.

    pyarrow imports pandas (when installed) on its first conversion, to check whether an
    input is a pandas object. Shown absent for that one check, pyarrow stops asking;
    pandas itself stays importable, and anything that needs it in pyarrow imports it then.
    """
    import pyarrow as pa

    class NoPandas:  # `import pandas` fails, for the one check
        @staticmethod
        def find_spec(name: str, *args: object) -> None:
            if name == "pandas":
                raise ImportError("pandas is not needed here")

    blocker = NoPandas()
    sys.meta_path.insert(0, blocker)
    try:
        pa.array([0])
    finally:
        sys.meta_path.remove(blocker)


def log_to_stderr() -> None:
    """ranklog's own messages on stderr, one line each; libraries' only when they are errors.

    Called again once a target is built: importing MLflow configures its loggers anew.
    """
    ours = logging.getLogger("ranklog")
    if not any(isinstance(h, _Stderr) for h in ours.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("ranklog: %(message)s"))
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    # a library's retry bookkeeping (urllib3's "Retrying (Retry(total=...))") never reaches
    # the terminal: the shipper says in one line what failed and what it does about it
    for name in ("urllib3", "requests", "mlflow", "wandb", "alembic", "sqlalchemy", "git"):
        logging.getLogger(name).setLevel(logging.ERROR)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to whatever ``sys.stderr`` is at the time of each record."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The target options given on the command line (unset ones left out)."""
    return {
        key[len(OPT) :]: value
        for key, value in vars(args).items()
        if key.startswith(OPT) and value is not None and value is not False
    }


def check_options(args: argparse.Namespace, specs: list[str]) -> None:
    """:class:`~ranklog.errors.ConfigError` (exit 2) for a target option that none of the
    targets ``specs`` takes (``--histogram-stats`` with a JSONL target): said, not ignored."""
    from ranklog.errors import ConfigError
    from ranklog.shippers import all_options

    kinds = {spec.partition(":")[0] for spec in specs}
    declared = all_options()
    for key in options(args):
        opt, takers = declared[key]
        if not kinds & set(takers):
            raise ConfigError(
                f"{opt.flag} is an option of {', '.join(sorted(set(takers)))} targets, and no "
                f"--to here is one ({', '.join(sorted(kinds))}): drop it, or add such a target"
            )
