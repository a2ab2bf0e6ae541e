"""A GRPO-shaped training loop: NeMo RL's logger calls, in its order, on made-up numbers."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from nemo_rl.utils.logger import (
    Logger,
    LoggerConfig,
    print_message_log_samples,
    should_log_nemo_gym_full_result_tables,
)
from nemo_rl.utils.timer import TimeoutChecker, Timer

VAL_EVERY = 5


def loss(step: int) -> float:
    return 2.0 * math.exp(-step / 8)


def setup(master_config: dict[str, Any]) -> Logger:
    logger_config: LoggerConfig = master_config["logger"]
    logger = Logger(logger_config)
    logger.log_hyperparams(master_config)
    logger.log_metrics({"total_setup_time_s": 1.5, "policy_init_time_s": 0.5}, step=0,
                       prefix="timing/setup")  # fmt: skip
    return logger


def validate(step: int, logger: Logger, master_config: dict[str, Any]) -> tuple[dict, dict]:
    timer = Timer(context={"worker": "validator"})
    with timer.time("total_validation_time"):
        logs = [
            [
                {"role": "user", "content": f"question {step}.{i}"},
                {"role": "assistant", "content": f"answer {step}.{i}"},
            ]
            for i in range(4)
        ]
        rewards = [1.0, 0.0, 1.0, 0.0]
    n = min(master_config["logger"]["num_val_samples_to_print"], len(logs))
    print_message_log_samples(logs, rewards, num_samples=n, step=step)
    logger.log_batched_dict_as_jsonl({"content": logs, "rewards": rewards},
                                     f"val_data_step{step}.jsonl")  # fmt: skip
    timings = timer.get_timing_metrics(reduction_op="sum")
    timer.reset()
    return {"accuracy": 0.5 + step / 100, "avg_length": 12.0}, timings


def _token_data(step: int) -> dict[str, torch.Tensor]:
    gen = torch.log(torch.linspace(0.3, 0.9, 10)).unsqueeze(0)
    prev = gen.clone()
    prev[0, 5] -= 0.1 * step
    return {"prompt_lengths": torch.tensor([2]), "full_lengths": torch.tensor([8]),
            "generation_logprobs": gen, "prev_logprobs": prev,
            "token_mask": torch.ones(1, 10), "sample_mask": torch.ones(1)}  # fmt: skip


def grpo_train(logger: Logger, master_config: dict[str, Any]) -> None:
    timer = Timer(context={"worker": "driver"})
    timeout = TimeoutChecker(timeout=None, fit_last_save_time=True)
    timeout.start_iterations()
    wandb_on = master_config["logger"]["wandb_enabled"]
    full_tables = should_log_nemo_gym_full_result_tables(
        wandb_enabled=wandb_on, wandb_config=master_config["logger"]["wandb"]
    )
    val_metrics, val_timings = validate(0, logger, master_config)
    logger.log_metrics(val_metrics, 0, prefix="validation")
    logger.log_metrics(val_timings, 0, prefix="timing/validation")
    for total_steps in range(master_config["grpo"]["max_num_steps"]):
        step = total_steps + 1
        with timer.time("total_step_time"):
            with timer.time("generation"):
                rollout = {"mean_gen_tokens_per_sample": 100.0 + step, "num_samples": 8}
            logger.log_metrics(rollout, step, prefix="train")
            advantages = torch.linspace(-1, 1, 16) * step
            logger.log_histogram(advantages.numpy(), step, "train/advantages/histogram")
            if step % VAL_EVERY == 0:
                val_metrics, val_timings = validate(step, logger, master_config)
                logger.log_metrics(val_timings, step, prefix="timing/validation")
                logger.log_metrics(val_metrics, step, prefix="validation")
            with timer.time("checkpointing"):
                pass
            logger.log_batched_dict_as_jsonl(
                {"content": [f"sample {step}.{i}" for i in range(3)], "rewards": [1.0, 0.0, 1.0],
                 "token_ids": [[1, 2], [3, 4], [5, 6]]},
                f"train_data_step{step}.jsonl",
            )  # fmt: skip
        timing_metrics = timer.get_timing_metrics(reduction_op="sum")
        metrics: dict[str, Any] = {
            "loss": loss(step),
            "reward": np.float64(step / 20),
            "grad_norm": torch.tensor(0.25),
            "token_mult_prob_error": 1.1 if step % 7 == 0 else 1.01,
            "generation_logger_metrics": {"kv_cache": {0: [0.1, 0.2], 1: [0.3, 0.4]}},
            "histogram/gen_lengths": [10, 20, 30],
        }
        if full_tables:  # NeMo-Gym's table of each rollout's result, as JSON text
            from wandb import Table

            results = [{"reward": step / 20, "turns": i} for i in range(2)]
            metrics["full_result_table"] = Table(
                data=[[json.dumps(r, separators=(",", ":"))] for r in results],
                columns=["Full result"],
            )
        if metrics["token_mult_prob_error"] > 1.05:
            logger.log_plot_token_mult_prob_error(
                _token_data(step), step, name="train/token_mult_prob_error_plot_sample"
            )
        if step % 10 == 0:
            logger.log_plot_per_worker_timeline_metrics(
                {0: [0.1, 0.2, 0.3], 1: [0.3, 0.4, 0.5]}, step=step,
                prefix="generation_metrics", name="kv_cache", timeline_interval=0.5,
            )  # fmt: skip
        performance = {"tokens_per_sec": 1000.0 * step}
        logger.log_metrics(metrics, step, prefix="train")
        logger.log_metrics(performance, step, prefix="performance")
        logger.log_metrics(timing_metrics, step, prefix="timing/train", step_finished=True)
        timer.reset()
        timeout.mark_iteration()
