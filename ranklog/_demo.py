"""``ranklog demo``: a short multi-process job on this machine, then a look at its spool.

Each rank is a separate process launched the way torchrun launches workers
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in its environment), logging every kind
ranklog ships: synthetic training metrics, timers, hyperparameters, validation samples
(text), a distribution of gradient values, an image of the loss so far, a table of
evaluation results, and GPU samples where a GPU is (``gpu="auto"``). The run has one
name everywhere, :data:`NAME`: the spool, every backend, the report.
"""

from __future__ import annotations

import math
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["NAME", "rank_main", "run_demo"]

#: the demo run's name, in every backend and the report
NAME = "ranklog-demo"


def _png(values: list[float], width: int = 120, height: int = 48) -> bytes:
    """A small grey-scale PNG of ``values`` as a line (no imaging library needed)."""
    import struct
    import zlib

    lo, hi = min(values), max(values)
    rows = [bytearray([255] * width) for _ in range(height)]
    for x in range(width):
        v = values[min(len(values) - 1, x * len(values) // width)]
        y = int((hi - v) / ((hi - lo) or 1.0) * (height - 1))
        for dy in (0, 1):
            rows[min(height - 1, y + dy)][x] = 30
    raw = b"".join(b"\x00" + bytes(r) for r in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))  # fmt: skip


def rank_main(spool: str, steps: int, step_seconds: float) -> None:
    """Body of one demo rank (run in its own process)."""
    import ranklog

    run = ranklog.init(spool, gpu="auto")
    rng = random.Random(run.rank)
    losses: list[float] = []
    run.log_hyperparams(
        {
            "model": {"name": "tiny-gpt", "layers": 4, "hidden": 256},
            "optim": {"lr": 3e-4, "betas": [0.9, 0.95]},
            "wandb": {"api_key": "not-a-real-key"},
            "steps": steps,
        }
    )
    straggler = run.world_size is not None and run.rank == run.world_size - 1
    slow = 1.5 if straggler else 1.0
    for step in range(steps):
        with run.timer("step_time", step=step):
            with run.timer("data_wait", step=step):
                time.sleep(step_seconds * 0.1 * rng.random())
            time.sleep(step_seconds * slow * (0.8 + 0.4 * rng.random()))
        loss = 2.5 * math.exp(-step / (steps / 3)) + 0.05 * rng.gauss(0, 1) + 0.01 * run.rank
        run.log_metrics(
            {"loss": loss, "acc": 1 - loss / 3, "lr": 3e-4 * min(1.0, (step + 1) / 20)},
            step=step,
            prefix="train",
        )
        run.log_metrics(
            {"tokens": 4096.0, "grad_norm": abs(rng.gauss(1.0, 0.3))},
            step=step,
            prefix="train",
            reduce=("sum", "max"),
        )
        losses.append(loss)
        if step % 10 == 9:  # a distribution of this rank's gradient values
            grads = [rng.gauss(0.0, 0.1 * math.exp(-step / steps)) for _ in range(256)]
            run.log_histogram("train/grad_values", grads, step=step)
        if step % 50 == 49:
            run.log_text(
                "val/sample_0",
                f"**prompt**: what is {step} + {run.rank}?\n\n**answer**: {step + run.rank}",
                step=step,
            )
            if run.rank == 0:  # one image and one table a validation, from the first rank
                run.log_image("val/loss_so_far", _png(losses), step=step)
                rows = [[f"q{i}", round(1 - loss / 3 + 0.01 * i, 4)] for i in range(3)]
                run.log_table("val/results", ["question", "score"], rows, step=step)
        run.step_end(step)
    run.close()


def run_demo(spool: Path, *, ranks: int = 4, steps: int = 300, step_seconds: float = 0.01) -> int:
    """Launch ``ranks`` processes into ``spool`` with live shippers, then inspect the spool.

    Returns the exit code: 0 when every rank and every shipper succeeded.
    """
    from ranklog.spool import ensure_run

    out = spool.parent
    # the run exists before the shipper starts (`ranklog ship` refuses a directory that is
    # not a spool yet); the ranks find it, as ranks find the one their first rank created
    ensure_run(spool, name=NAME, world_size=ranks)
    print(f"demo: {ranks} ranks x {steps} steps into {spool}", flush=True)
    every = max(1, steps // 6)
    targets = [f"jsonl:{out / 'metrics.jsonl'}", f"console:{every}", *_backends(out)]
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--quiet", "--samples", "1"]
    if any(t.startswith("wandb:") for t in targets):  # (the run's name: NAME, in every one)
        cmd += ["--mode", "offline", "--dir", str(out)]
    cmd += ["--exit-with", str(os.getpid())]  # this process dies: they ship what is closed
    shipper = subprocess.Popen([*cmd, *(a for t in targets for a in ("--to", t))])
    procs = []
    t0 = time.monotonic()
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r))
        code = (
            "import sys; from ranklog._demo import rank_main; "
            "rank_main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))"
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, str(spool), str(steps), str(step_seconds)], env=env
            )
        )
    codes = [p.wait() for p in procs]
    print(f"demo: ranks exited with {codes} after {time.monotonic() - t0:.1f}s", flush=True)
    shipped = shipper.wait()
    print(f"demo: shippers exited with {shipped}\n")
    _ranklog("inspect", str(spool))
    archived = _archive(spool, out)
    print("\nopen the results:")
    print(f"  reduced steps      {out / 'metrics.jsonl'}")
    for line in _how_to_open(out):
        print(f"  {line}")
    return 0 if not any(codes) and shipped == 0 and archived else 1


def _ranklog(*args: str) -> int:
    """Run a ``ranklog`` command in its own process (as a user would); its exit code."""
    sys.stdout.flush()
    return subprocess.call([sys.executable, "-m", "ranklog.cli", *args])


def _archive(spool: Path, out: Path) -> bool:
    """Compact the spool, replay it into a fresh TensorBoard directory, write the report."""
    print()
    ok = _ranklog("compact", str(spool), "--out", str(out / "parquet")) == 0
    replay_to = f"tensorboard:{out / 'replayed-tensorboard'}"
    if not _installed("tensorboard"):  # a base install: replay into JSONL instead
        replay_to = f"jsonl:{out / 'replayed.jsonl'}"
    ok = ok and _ranklog("replay", str(out / "parquet"), "--to", replay_to) == 0
    if not _installed("matplotlib"):  # the report extra
        print("report: not written (it needs matplotlib: pip install 'ranklog[report]')")
        return ok
    return ok and _ranklog("report", str(out / "parquet"), "--out", str(out / "report.html")) == 0


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _backends(out: Path) -> list[str]:
    """The backend targets whose packages are installed (the demo installs all three)."""
    specs = {
        "tensorboard": f"tensorboard:{out / 'tensorboard'}",
        "mlflow": f"mlflow:sqlite:///{out / 'mlflow.db'}",
        "wandb": f"wandb:{NAME}",
    }
    return [t for mod, t in specs.items() if _installed(mod)]


def command(name: str) -> str:
    """``name`` as the user types it to run this Python's own copy: its full path where it
    lies beside this interpreter (``.venv/bin/tensorboard``, not on the user's PATH
    unless the venv is activated), else the bare name."""
    here = Path(sys.executable).parent / name
    return shlex.quote(str(here)) if here.is_file() else name


def _how_to_open(out: Path) -> list[str]:
    tb, mlflow, wandb = command("tensorboard"), command("mlflow"), command("wandb")
    lines = [f"Parquet dataset    {out / 'parquet'}   (DuckDB, Polars, pyarrow)"]
    if (out / "report.html").is_file():
        lines.append(f"report             {out / 'report.html'}")
    if (out / "replayed-tensorboard").is_dir():
        lines.append(f"replayed           {tb} --logdir {out / 'replayed-tensorboard'}")
    if (out / "tensorboard").is_dir():
        lines.append(f"TensorBoard        {tb} --logdir {out / 'tensorboard'}")
    if (out / "mlflow.db").is_file():
        store = f"sqlite:///{out / 'mlflow.db'}"
        lines.append(f"MLflow             {mlflow} ui --backend-store-uri {store}")
    runs = sorted((out / "wandb").glob("offline-run-*"))
    if runs:
        lines.append(f"W&B (offline)      {wandb} sync {runs[-1]}   (uploads it; needs an API key)")
    return lines
