"""What ``tools/chaos.py`` does to the world outside its processes, and reads back from it.

Faults that need more than a signal: a disk that fills up (:class:`Tmpfs`), an MLflow server
that goes away (:class:`MlflowServer`), a torn tail on a killed rank's segment
(:func:`tear_tail`). Each acts only on what the tool started or created: its own tmpfs
mount, its own ``mlflow server`` process group, segments of incarnations it killed and
reaped. Then each target is read back with its own reader (:func:`read_back`) as
``{key: [(step, value), ...]}`` and held against the oracle (:func:`compare`).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from ranklog.spool import HEADER_SIZE, SpoolLayout, read_segment

__all__ = [
    "KEYS",
    "MlflowServer",
    "Tmpfs",
    "child_env",
    "compare",
    "mlflow_server",
    "read_back",
    "tear_tail",
]

#: the reduced metrics checked in every target: mean of the loss, max of the timer
KEYS = ("train/loss", "timing/step_time")
Series = dict[str, list[tuple[int, float]]]  # key -> [(step, value)] as a target holds them
Expected = dict[int, dict[str, float]]  # step -> key -> the oracle's reduced value

_LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"}
ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a child process: no launcher variables, this checkout importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARS and not k.startswith(("OMPI_", "PMI_"))
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def tear_tail(spool: Path, rank: int, incarnation: int, rng: random.Random) -> str | None:
    """Append a torn tail past the last complete frame of a dead incarnation's last segment.

    One of: random bytes, zeros, or a truncated copy of the segment's last frame (what a
    write cut short by a crash leaves). Nothing before the tail changes, so no closed
    event is lost. Returns the kind, or None when the incarnation has no segment.
    """
    segments = [s for s in SpoolLayout(spool).segments(rank) if s.incarnation == incarnation]
    if not segments:
        return None
    path = segments[-1].path
    if os.path.getsize(path) < HEADER_SIZE:
        return None  # killed before its header was written: nothing to tear
    res = read_segment(path, writer_gone=True)
    kind = rng.choice(["garbage", "zeros", "torn_frame"])
    if kind == "torn_frame" and res.frames:
        last = res.frames[-1]
        with open(path, "rb") as f:
            f.seek(last.offset)
            frame = f.read(last.end - last.offset)
        tail = frame[: rng.randint(1, len(frame) - 1)]
    elif kind == "zeros":
        tail = bytes(rng.randint(1, 4096))
    else:
        kind = "garbage"
        tail = rng.randbytes(rng.randint(1, 512))
    with open(path, "ab") as f:
        f.write(tail)
    return kind


class Tmpfs:
    """A small tmpfs this tool mounted (root only), and a ballast file that fills it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ballast = path / "ballast"

    @classmethod
    def mount(cls, path: Path, size: str = "64m") -> tuple[Tmpfs | None, str]:
        """Mount one at ``path``; (None, why) where this machine does not allow it."""
        if os.geteuid() != 0:
            return None, "not root: cannot mount a tmpfs"
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            return None, f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"
        return cls(path), ""

    def fill(self) -> int:
        """Write the ballast until the filesystem refuses (ENOSPC); returns its size."""
        size = 0
        with open(self.ballast, "wb", buffering=0) as f:
            for chunk in (1 << 20, 4096, 1):
                block = b"\xba" * chunk
                with contextlib.suppress(OSError):
                    while True:
                        size += f.write(block) or 0
        return size

    def full_for(self, seconds: float, ready: Callable[[], bool]) -> None:
        """Fill the disk for ``seconds`` once ``ready()`` (no rank in ``init``), then free it."""
        deadline = time.monotonic() + 30
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)  # a rank inside init() could not create its first segment
        self.fill()
        time.sleep(seconds)
        self.free()

    def free(self) -> None:
        """Delete the ballast: the space is back."""
        with contextlib.suppress(FileNotFoundError):
            self.ballast.unlink()

    def unmount(self) -> None:
        """Unmount (lazily if something still holds a file open)."""
        self.free()
        done = subprocess.run(["umount", str(self.path)], capture_output=True, check=False)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)


@contextlib.contextmanager
def mlflow_server(root: Path, wanted: bool) -> Iterator[MlflowServer | None]:
    """A started server (None if not ``wanted``), killed at the end, also on failure."""
    server = MlflowServer(root) if wanted else None
    try:
        if server is not None:
            server.start()
        yield server
    finally:
        if server is not None:
            server.kill()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 over a sqlite store, in its own process group."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.db = root / "server.db"
        self.artifacts = root / "artifacts"
        self.log = root / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        """Start it (same port, same store every time) and wait until ``/health`` answers."""
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--workers", "1"]
        cmd += ["--backend-store-uri", f"sqlite:///{self.db}"]
        cmd += ["--artifacts-destination", str(self.artifacts)]
        # no background job runner (a dozen huey processes): this machine has 2 cores
        env = child_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # pgid == pid: uvicorn dies with it
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"mlflow server exited: {self.tail()}")
            if self.healthy():
                return
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"mlflow server did not answer in {timeout}s: {self.tail()}")

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def outage(self, seconds: float, errors: list[str]) -> threading.Thread:
        """Go away (SIGKILL) now; a thread brings it back on the same port and store later."""
        self.kill()

        def come_back() -> None:
            time.sleep(seconds)
            try:
                self.start()
            except RuntimeError as exc:
                errors.append(str(exc))

        thread = threading.Thread(target=come_back, name="mlflow-outage")
        thread.start()
        return thread

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's own process group and reap the server."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # a child SIGTERM left behind
        self.proc = None

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL)."""
        self.kill(signal.SIGTERM)

    def tail(self, n: int = 2000) -> str:
        """The end of the server's log, for failure messages."""
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError as exc:
            return f"(no log: {errno.errorcode.get(exc.errno or 0, exc)})"


def read_jsonl(path: Path, world: int) -> Series:
    """The JSONL target; ``complete`` is 1.0 for a step that every rank of ``world`` made."""
    from ranklog.shippers.targets.jsonl import read_jsonl as read

    out: Series = {key: [] for key in (*KEYS, "complete")}
    for line in read(path) if path.exists() else []:
        if "step" in line:
            for key in KEYS:
                out[key].append((line["step"], line["metrics"].get(key, math.nan)))
            full = line["complete"] and line["ranks"] == world
            out["complete"].append((line["step"], 1.0 if full else 0.0))
    return out


def read_tensorboard(path: Path) -> Series:
    """As TensorBoard shows it, and as the raw files hold it (``raw:`` keys: no purge)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    out: Series = {}
    for prefix, purge in (("", True), ("raw:", False)):
        acc = ea.EventAccumulator(str(path), {ea.SCALARS: 0}, purge_orphaned_data=purge)
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        for key in KEYS:
            out[prefix + key] = [(e.step, e.value) for e in acc.Scalars(key)] if key in tags else []
    return out


def read_mlflow(uri: str, run_id: str) -> Series:
    """The MLflow run tagged ``ranklog.run_id``; a second main run would add its points."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, f"tags.\"ranklog.run_id\" = '{run_id}'")
    out: Series = {key: [] for key in KEYS}
    for run in runs:
        if run.data.tags.get("ranklog.role", "main") == "main":
            for key in KEYS:
                history = client.get_metric_history(run.info.run_id, key)
                out[key] += [(m.step, m.value) for m in history]
    return {key: sorted(points, key=lambda p: p[0]) for key, points in out.items()}  # by step


def read_back(spec: str, run_id: str, world: int) -> tuple[Series, float]:
    """What the target ``spec`` holds, and the relative tolerance of its values."""
    kind, _, where = spec.partition(":")
    if kind == "jsonl":
        return read_jsonl(Path(where), world), 1e-12
    if kind == "tensorboard":
        return read_tensorboard(Path(where)), 1e-6  # float32 simple_value
    return read_mlflow(where, run_id), 1e-12


def compare(
    name: str, got: Series, expected: Expected, rel: float, details: list[str]
) -> tuple[int, int, int, int]:
    """(lost, duplicated, wrong, out of order) steps of one target against the oracle.

    Out of order: a step held after a higher one, in the order the target holds them
    (JSONL lines; TensorBoard's raw files; MLflow orders its history by step itself).
    """
    lost: set[int] = set()
    dup: set[int] = set()
    wrong: set[int] = set()
    order: set[int] = set()
    for key, points in got.items():
        by_step: dict[int, list[float]] = defaultdict(list)
        top = -1
        for step, value in points:
            by_step[step].append(value)
            if step < top:
                order.add(step)
            top = max(top, step)
        lost |= expected.keys() - by_step.keys()
        dup |= {step for step, vs in by_step.items() if len(vs) > 1}
        for step, vs in by_step.items():
            want = expected.get(step, {}).get(key.removeprefix("raw:"), math.nan)
            want = 1.0 if key == "complete" and step in expected else want
            if bad := [v for v in vs if not math.isclose(v, want, rel_tol=rel, abs_tol=1e-9)]:
                wrong.add(step)
                details.append(f"{name}: step {step} {key} = {bad[0]!r}, expected {want!r}")
    for what, steps in (("lost", lost), ("duplicated", dup), ("out of order", order)):
        if steps:
            details.append(f"{name}: {len(steps)} steps {what}: {sorted(steps)[:10]}")
    return len(lost), len(dup), len(wrong), len(order)
