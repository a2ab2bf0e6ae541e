"""Screenshots of what a user sees of a shipped run in MLflow, TensorBoard and trackio.

    .venv/bin/python tools/ui_screenshots.py [--out docs/img]

Two ranks log 30 steps (a loss, a timer, a validation sample every 10 steps) into a
spool in a temporary directory; ``ranklog ship`` sends it to a real ``mlflow server``
on 127.0.0.1 and to a trackio project; headless Chromium (Debian's ``chromium``) takes
the pages docs/shipping.md shows: MLflow's runs table and run charts in its training
view, a sample in MLflow's artifact view, TensorBoard's time series of the slowest rank
(``tensorboard --logdir``, as it starts by default), and trackio's dashboard. Nothing leaves the
machine; the servers are stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from _chaos_io import MlflowServer, free_port  # noqa: E402

import ranklog  # noqa: E402

PROJECT, NAME = "exp1", "exp1"


def make_spool(spool: Path) -> None:
    """Two ranks, 30 steps: train/loss (mean), step_time (max; rank 0 the slower one in steps
    10 to 19, rank 1 otherwise), a sample every 10 steps."""
    runs = [ranklog.init(spool, rank=r, world_size=2, name=NAME, handle_signals=False)
            for r in range(2)]  # fmt: skip
    runs[0].log_hyperparams({"optim": {"lr": 1e-3, "name": "adamw"}, "batch_size": 32})
    for s in range(30):
        for run in runs:
            with run.timer("step_time", step=s):
                time.sleep(0.006 if run.rank == (1 if s // 10 != 1 else 0) else 0.001)
            run.log_metrics({"loss": 1 / (s + 1) + run.rank / 20}, step=s, prefix="train")
            if s % 10 == 0:
                text = f"**Q:** 2 + {s} = ?\n\n**A:** {2 + s} (rank {run.rank})"
                run.log_text("val/sample", text, step=s)
            run.step_end(s)
    for run in runs:
        run.close()


def ship(spool: Path, *args: str) -> str:
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--once", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
    return res.stderr


def shoot(browser: str, url: str, png: Path, profile: Path, height: int = 900) -> None:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--no-first-run", "--disable-background-networking", f"--user-data-dir={profile}",
           "--virtual-time-budget=20000", f"--window-size=1400,{height}",
           f"--screenshot={png}", url]  # fmt: skip
    subprocess.run(cmd, capture_output=True, check=True, timeout=180)
    with contextlib.suppress(ImportError):  # a palette PNG: a fifth of the size
        from PIL import Image

        Image.open(png).convert("RGB").quantize(64).save(png, optimize=True)
    print(f"{png}  <- {url}")


@contextlib.contextmanager
def tensorboard(logdir: Path, log: Path) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
           "127.0.0.1", "--port", str(port)]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
        while True:
            with contextlib.suppress(OSError):
                if json.load(urllib.request.urlopen(f"{url}/data/plugin/scalars/tags")):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"tensorboard did not start:\n{log.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def trackio_dashboard(directory: Path, log: Path) -> Iterator[str]:
    env = {**os.environ, "TRACKIO_DIR": str(directory), "GRADIO_SERVER_PORT": str(free_port()),
           "BROWSER": "true", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    exe = str(Path(sys.executable).with_name("trackio"))
    with log.open("w") as out:
        proc = subprocess.Popen([exe, "show", "--project", PROJECT], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (m := re.search(r"(http://127\.0\.0\.1:\d+)/", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"trackio show did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield m.group(1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    a = p.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ranklog-ui-") as tmp:
        d = Path(tmp)
        make_spool(d / "spool")
        server = MlflowServer(d / "mlflow")
        server.start()
        try:
            ship(d / "spool", "--to", f"mlflow:{server.uri}")
            exp = json.load(urllib.request.urlopen(
                f"{server.uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name={NAME}"
            ))["experiment"]["experiment_id"]  # fmt: skip
            body = json.dumps({"experiment_ids": [exp]}).encode()
            req = urllib.request.Request(f"{server.uri}/api/2.0/mlflow/runs/search", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            run_id = json.load(urllib.request.urlopen(req))["runs"][0]["info"]["run_id"]
            base, view = f"{server.uri}/#/experiments/{exp}", "?workflowType=machine_learning"
            shoot(browser, f"{base}/runs{view}", a.out / "mlflow-runs.png", d / "p1", 420)
            shoot(browser, f"{base}/runs/{run_id}/model-metrics{view}",
                  a.out / "mlflow-charts.png", d / "p2", 1100)  # fmt: skip
            shoot(browser, f"{base}/runs/{run_id}/artifacts/text/val/sample/step_00000010.md"
                  f"{view}", a.out / "mlflow-sample.png", d / "p3", 520)  # fmt: skip
        finally:
            server.stop()
        ship(d / "spool", "--to", f"tensorboard:{d / 'tb'}")
        with tensorboard(d / "tb", d / "tensorboard.log") as url:
            shoot(browser, f"{url}/#scalars&tagFilter=slowest_rank%2Frank",
                  a.out / "tensorboard-slowest.png", d / "p5", 480)  # fmt: skip
        ship(d / "spool", "--to", f"trackio:{PROJECT}", "--dir", str(d / "trackio"))
        with trackio_dashboard(d / "trackio", d / "trackio.log") as url:
            shoot(browser, f"{url}/?project={PROJECT}", a.out / "trackio.png", d / "p4", 560)


if __name__ == "__main__":
    main()
