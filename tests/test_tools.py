"""Developer tools keep working (their numbers are read by people, not asserted here)."""

from __future__ import annotations

import subprocess
import sys

from .conftest import ROOT, python_env


class TestBenchProducer:
    def test_quick_run_prints_the_table(self) -> None:
        """``tools/bench_producer.py --quick`` runs against the real peers and prints its table."""
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "bench_producer.py"), "--quick"],
            env=python_env(),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        for row in ("ranklog log_metrics (step)", "wandb run.log", "tensorboard", "mlflow"):
            assert row in proc.stdout
        assert "not installed" not in proc.stdout
        assert "heavy modules loaded: none" in proc.stdout
