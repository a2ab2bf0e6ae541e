"""NeMo RL's module-level helpers: flattening, list summaries, experiment dirs, console output.

Each behaves as ``nemo_rl.utils.logger``'s function of the same name (see docs/nemo.md for
the commit followed); none imports numpy, rich or a backend.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ranklog.nemo._config import WandbConfig
from ranklog.shippers.targets._media import percentile

__all__ = [
    "configure_rich_logging",
    "flatten_dict",
    "get_next_experiment_dir",
    "log_container_init_timing",
    "merge_generation_logger_workers",
    "print_message_log_samples",
    "should_log_nemo_gym_full_result_tables",
    "summarize_list",
]

_rich_logging_configured = False


def should_log_nemo_gym_full_result_tables(
    *, wandb_enabled: bool, wandb_config: WandbConfig
) -> bool:
    """Whether NeMo-Gym's full result tables go to W&B: W&B on and the flag set."""
    return bool(wandb_enabled) and bool(wandb_config.get("log_nemo_gym_full_result_tables"))


def flatten_dict(d: Mapping[str, Any], sep: str = ".", expand_lists: bool = True) -> dict[str, Any]:
    """Nested dicts as ``parent{sep}child`` keys; lists by index unless ``expand_lists=False``.

    ``{"a": [1, 2], "b": {"c": 3}}`` gives ``{"a.0": 1, "a.1": 2, "b.c": 3}``; dicts inside
    lists are flattened under their index; empty dicts and lists vanish.
    """
    out: dict[str, Any] = {}
    _flatten(d, "", sep, expand_lists, out)
    return out


def _flatten(
    node: Mapping[Any, Any], parent: str, sep: str, lists: bool, out: dict[str, Any]
) -> None:
    for key, value in node.items():
        name = f"{parent}{sep}{key}" if parent else f"{key}"
        if isinstance(value, dict):
            _flatten(value, name, sep, lists, out)
        elif lists and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    _flatten(item, f"{name}{sep}{i}", sep, lists, out)
                else:
                    out[f"{name}{sep}{i}"] = item
        else:
            out[name] = value


def _is_number(v: object) -> bool:
    """An int or float (numpy's too), not a bool."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int | float):
        return True
    kind = getattr(getattr(v, "dtype", None), "kind", None)
    return kind in ("i", "u", "f") and getattr(v, "ndim", 1) == 0


def summarize_list(values: Sequence[Any]) -> dict[str, float]:
    """``mean``, ``p50``, ``p90`` and ``max`` of the numbers in ``values`` ({} if none)."""
    nums = sorted(float(v) for v in values if _is_number(v))
    if not nums:
        return {}
    return {
        "mean": math.fsum(nums) / len(nums),
        "p50": percentile(nums, 0.5),
        "p90": percentile(nums, 0.9),
        "max": nums[-1],
    }


def merge_generation_logger_workers(metrics: dict[str, Any]) -> dict[str, Any]:
    """``generation_logger_metrics`` ``{metric: {worker: [samples]}}`` as one list per metric.

    Returns a shallow copy (the input is left alone), or ``metrics`` itself when it holds
    no such dict.
    """
    per_metric = metrics.get("generation_logger_metrics")
    if not isinstance(per_metric, dict):
        return metrics
    merged: dict[str, Any] = {}
    for name, workers in per_metric.items():
        if not isinstance(workers, dict):
            merged[name] = workers
            continue
        samples: list[Any] = []
        for series in workers.values():
            if isinstance(series, list):
                samples.extend(series)
            else:
                samples.append(series)
        merged[name] = samples
    return {**metrics, "generation_logger_metrics": merged}


def configure_rich_logging(
    level: str = "INFO", show_time: bool = True, show_path: bool = True
) -> None:
    """Configure the root logger once: rich's handler when rich is installed, else plain."""
    global _rich_logging_configured
    if _rich_logging_configured:
        return
    handler: logging.Handler
    try:
        from rich.logging import RichHandler
    except ImportError:
        handler = logging.StreamHandler()
    else:
        handler = RichHandler(
            rich_tracebacks=True, show_time=show_time, show_path=show_path, markup=True
        )
    logging.basicConfig(
        level=level.upper(), format="%(message)s", datefmt="[%X]", handlers=[handler]
    )
    _rich_logging_configured = True


def _reward_mark(r: float) -> str:
    return "🔥" if r >= 0.7 else "✨" if r >= 0.3 else "🟠" if r >= -0.5 else "🔴"


def _pick(rewards: Sequence[float], n: int) -> list[int]:
    """NeMo's choice: the best n//2, the worst n//2, and the median when n is odd."""
    if len(rewards) <= n:
        return list(range(len(rewards)))
    order = sorted(range(len(rewards)), key=lambda i: rewards[i], reverse=True)
    half = n // 2
    picked = order[:half] + order[-half:] if half else list(order)
    if n % 2:
        picked.append(order[len(order) // 2])
    return picked[:n]


def print_message_log_samples(
    message_logs: list[Any],
    rewards: list[float],
    num_samples: int = 5,
    step: int = 0,
) -> None:
    """Print reward statistics and ``num_samples`` conversations (best, worst, median)."""
    configure_rich_logging(level="INFO")
    out = sys.stdout
    if not message_logs or not rewards:
        print("⚠️  No message logs or rewards to display", file=out)
        return
    if num_samples <= 0:
        return
    assert len(message_logs) == len(rewards), "Message logs and rewards must have the same length"
    values = [float(r) for r in rewards]
    lines = [f"{'=' * 30} TRAINING STEP {step} {'=' * 30}", "Reward Statistics",
             "Batch Summary", f"Total Samples: {len(values)}",
             f"Avg Reward: {math.fsum(values) / len(values):.4f}",
             f"Min: {min(values):.4f} | Max: {max(values):.4f}",
             "Discrete Reward Levels:"]  # fmt: skip
    counts: dict[float, int] = {}
    for r in values:
        counts[r] = counts.get(r, 0) + 1
    top = max(counts.values())
    for r in sorted(counts):
        bar = "█" * int(counts[r] / top * 20)
        lines.append(f"  {_reward_mark(r)} Reward {r:.4f}: {bar} ({counts[r]} samples)")
    lines += ["", "Sample Conversations"]
    for k, i in enumerate(_pick(values, min(num_samples, len(values))), 1):
        lines.append(f"--- {_reward_mark(values[i])} Sample {k} | Reward: {values[i]:.4f} ---")
        turns = [
            f"{str(m['role']).upper()}: {m['content']}"
            for m in message_logs[i]
            if isinstance(m, dict) and "role" in m and "content" in m
        ]
        lines.append("\n\n".join(turns) if turns else "No message content to display")
        lines.append("")
    lines.append(f"{'=' * 30} End of Samples {'=' * 30}")
    print("\n".join(lines), file=out, flush=True)


_EXP = re.compile(r"exp_(\d+)")


def get_next_experiment_dir(base_log_dir: str) -> str:
    """Create and return ``base_log_dir/exp_NNN``, one past the highest existing number."""
    ids = [
        int(m[1]) for p in glob.glob(os.path.join(base_log_dir, "exp_*")) if (m := _EXP.search(p))
    ]
    path = os.path.join(base_log_dir, f"exp_{max(ids, default=0) + 1:03d}")
    os.makedirs(path, exist_ok=True)
    return path


def _epoch(name: str) -> float | None:
    raw = os.environ.get(name)
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def log_container_init_timing() -> None:
    """Print how long SLURM's prologue, the cluster and the driver took to start.

    Reads ``SLURM_JOB_START_TIME``, ``NRL_JOB_START_EPOCH`` and ``NRL_RAY_READY_EPOCH``
    (epoch seconds); without ``NRL_JOB_START_EPOCH`` it only warns.
    """
    job = _epoch("NRL_JOB_START_EPOCH")
    if job is None:
        logging.warning(
            "Cannot detect container startup time: NRL_JOB_START_EPOCH not set. Ensure the "
            "launch script exports this variable for init timing."
        )
        return
    now, slurm, ray_ready = (
        time.time(),
        _epoch("SLURM_JOB_START_TIME"),
        _epoch("NRL_RAY_READY_EPOCH"),
    )
    lines = ["=" * 60, " " * 14 + "CONTAINER INIT TIMING"]
    start = job
    if slurm is not None:
        lines.append(f"  slurm_prologue: {job - slurm:.1f}s")
        start = slurm
    if ray_ready is not None:
        lines.append(f"  cluster_startup (orchestrator+container+ray): {ray_ready - job:.1f}s")
        lines.append(f"  driver_startup (launch+python+imports): {now - ray_ready:.1f}s")
    lines += [f"  total: {now - start:.1f}s", "=" * 60]
    print("\n".join(lines), flush=True)
