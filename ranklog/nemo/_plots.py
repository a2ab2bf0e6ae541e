"""The two figures NeMo RL's Logger draws itself: token-mult-prob-error and worker timelines.

Both take numpy or torch inputs, draw with matplotlib (imported here, only when a figure
is drawn) and hand the figure to ``log_plot``; their names and labels are NeMo's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["plot_per_worker_timeline", "plot_token_mult_prob_error"]

LogPlot = Callable[[Any, int, str], None]


def _array(x: Any) -> Any:
    import numpy as np

    if hasattr(x, "detach"):  # a torch tensor, on any device
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def plot_token_mult_prob_error(
    data: Mapping[str, Any], step: int, name: str, log_plot: LogPlot
) -> None:
    """Plot the sample with the largest token multiplicative probability error.

    ``data`` holds ``token_mask`` and the two logprobs ``[B, S]``, ``sample_mask``,
    ``prompt_lengths`` and ``full_lengths`` ``[B]``. The figure shows both logprobs of the
    generated tokens of the worst sample, their absolute difference, and the tokens with
    the largest absolute and relative (probability) errors.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    token_mask = _array(data["token_mask"])[:, 1:]
    sample_mask = _array(data["sample_mask"])
    gen = _array(data["generation_logprobs"])[:, 1:]
    prev = _array(data["prev_logprobs"])[:, 1:]
    prompt_lengths, full_lengths = _array(data["prompt_lengths"]), _array(data["full_lengths"])
    mask = token_mask * sample_mask[:, None]
    diff = np.abs(gen - prev) * token_mask
    with np.errstate(divide="ignore", invalid="ignore"):
        errors = (np.exp(diff) * mask).sum(axis=-1) / mask.sum(axis=-1)
    worst = int(np.nanargmax(np.where(np.isnan(errors), -np.inf, errors)))
    start, end = int(prompt_lengths[worst]) - 1, int(full_lengths[worst]) - 1
    if start >= end:
        print("Skipping token_mult_prob_error plot because generation_start_idx "
              f"({start}) >= generation_end_idx ({end})")  # fmt: skip
        return
    g = gen[worst, start:end]
    p = prev[worst, start:end] * mask[worst, start:end]
    d = diff[worst, start:end]
    xs = np.arange(start, end)
    abs_at = int(np.argmax(d))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs((np.exp(g) - np.exp(p)) / np.exp(g))
    rel_at = int(np.argmax(np.nan_to_num(rel, nan=-np.inf)))
    fig = plt.figure()
    plt.plot(xs, g, label="logprob (inference engine)")
    plt.plot(xs, p, label="logprob (reference policy)")
    plt.plot(xs, d, label=f"abs diff (token_mult_prob_error={errors[worst]:.2f})")
    plt.plot(xs[abs_at], d[abs_at], "ro", markersize=8, label=f"Max abs error: {d[abs_at]:.4f}")
    plt.plot(xs[rel_at], d[rel_at], "bo", markersize=8,
             label=f"Max rel error (prob): {rel[rel_at]:.4f}")  # fmt: skip
    plt.xlabel("Token Position (starting from prompt end)")
    plt.ylabel("Log Probability/Difference")
    plt.legend()
    plt.tight_layout()
    log_plot(fig, step, name)
    plt.close(fig)


def plot_per_worker_timeline(
    metrics: Mapping[int, list[Any]],
    step: int,
    prefix: str,
    name: str,
    timeline_interval: float,
    log_plot: LogPlot,
) -> None:
    """Two figures of samples taken every ``timeline_interval`` s by each worker.

    ``{prefix}/per_worker_{name}`` has one line per worker; ``{prefix}/average_{name}``
    their mean over the length every worker reached.
    """
    if not metrics:
        print(f"Skipping {name} per-worker timeline logging because no metrics were provided.")
        return
    if timeline_interval <= 0:
        raise ValueError(f"timeline_interval must be positive; received {timeline_interval}")
    if all(len(series) == 0 for series in metrics.values()):
        print(f"Skipping {name} per-worker timeline logging because all series were empty.")
        return
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots()
    for worker in sorted(metrics):
        ys = [float(v) for v in metrics[worker]]
        if ys:
            xs = [k * timeline_interval for k in range(len(ys))]
            ax.plot(xs, ys, label=f"worker_{worker}")
    _decorate(ax, name, f"{name} (per worker)")
    fig.tight_layout()
    log_plot(fig, step, f"{prefix}/per_worker_{name}")
    plt.close(fig)

    n = min(len(series) for series in metrics.values())
    fig, ax = plt.subplots()
    rows = np.array([[float(v) for v in metrics[w][:n]] for w in sorted(metrics)])
    ax.plot([k * timeline_interval for k in range(n)], rows.mean(axis=0), label="average")
    _decorate(ax, name, f"{name} (average)")
    fig.tight_layout()
    log_plot(fig, step, f"{prefix}/average_{name}")
    plt.close(fig)


def _decorate(ax: Any, title: str, ylabel: str) -> None:
    ax.set_xlabel("Time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.2)
    ax.legend()
