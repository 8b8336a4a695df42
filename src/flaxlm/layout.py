"""The names of what a run directory holds: the one module that knows its layout.

    <run_dir>/
      config.yaml         the resolved config the run started with (checked on resume)
      model_config.yaml   the model's shape as trained (after model.init_from, if set)
      metrics.jsonl       one JSON object per logged step: `step`, `time`, `tokens_seen`
                          (training tokens so far) and the metrics
      status.json         how the run ended (finished, preempted, failed, and why), or that
                          it is running: written by process 0 (flaxlm.run_records)
      wandb_run_id        the W&B run a resumed run continues
      tensorboard/        TensorBoard event files (logger=tensorboard)
      .lock               held while a process trains in the directory
      checkpoints/<step>/ orbax checkpoints (a damaged one set aside as <step>.damaged-<time>)
      model/              the run's Hugging Face export: tokenizer and config from the start,
                          weights and model card at the end
      predictions.jsonl   task=classify: the last evaluation's prediction for every example
"""

from __future__ import annotations

import os

CONFIG_FILE = "config.yaml"
MODEL_CONFIG_FILE = "model_config.yaml"
METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"
STATUS_FILE = "status.json"
LOCK_FILE = ".lock"
CHECKPOINT_SUBDIR = "checkpoints"
MODEL_SUBDIR = "model"
PREDICTIONS_FILE = "predictions.jsonl"
TENSORBOARD_SUBDIR = "tensorboard"

# metrics.jsonl's second x axis beside `step`: runs with different batch sizes compare by it.
TOKENS_SEEN = "tokens_seen"

RUN_FILES = (METRICS_FILE, CONFIG_FILE, LOCK_FILE)  # every run directory has these


def run_path(run_dir: str, name: str) -> str:
    """`name` (one of the constants above) inside `run_dir`."""
    return os.path.join(run_dir, name)
