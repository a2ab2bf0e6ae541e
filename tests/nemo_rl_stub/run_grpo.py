"""NeMo RL's examples/run_grpo.py, reduced to its logging: ``python run_grpo.py LOG_ROOT``."""

from __future__ import annotations

import sys

from nemo_rl.algorithms.grpo import grpo_train, setup
from nemo_rl.utils.logger import get_next_experiment_dir, log_container_init_timing


def main() -> None:
    log_container_init_timing()
    root, tracking_uri = sys.argv[1], sys.argv[2]
    config = {
        "policy": {"model_name": "Qwen/Qwen2.5-1.5B", "layers": [4, 8],
                   "generation": {"backend": "vllm", "temperature": 1.0}},
        "grpo": {"max_num_steps": 20, "num_prompts_per_step": 8},
        "logger": {
            "log_dir": root,
            "num_val_samples_to_print": 1,
            "wandb_enabled": True,
            "tensorboard_enabled": True,
            "mlflow_enabled": True,
            "swanlab_enabled": True,
            "monitor_gpus": False,
            "wandb": {"project": "grpo-dev", "name": "grpo-dev-logger", "id": "grpodev0001",
                      "tags": ["grpo", "ranklog"], "notes": "drop-in check", "group": "g1",
                      "log_nemo_gym_full_result_tables": True},
            "tensorboard": {"log_dir": "tb_logs"},
            "swanlab": {"project": "grpo-dev", "name": "grpo-dev-swanlab"},
            "mlflow": {"experiment_name": "grpo-dev", "run_name": "grpo-dev-logger",
                       "tracking_uri": tracking_uri},
            "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
        },
    }  # fmt: skip
    config["logger"]["log_dir"] = get_next_experiment_dir(config["logger"]["log_dir"])
    print(f"Using log directory: {config['logger']['log_dir']}")
    logger = setup(config)
    grpo_train(logger, config)
    # the user's own final evaluation, at the last step after it was finished: NeMo's
    # TensorBoard and MLflow loggers take it, W&B drops it (a step below its current one)
    logger.log_metrics({"final_accuracy": 0.7}, 20, prefix="validation")
    logger.log_string_list_as_jsonl(['{"trajectory": 1}'], "trajectory_collection.jsonl")
    # NeMo's GRPO script ends here without logger.finish(): the exit hook drains


if __name__ == "__main__":
    main()
