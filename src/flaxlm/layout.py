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
                          weights and model card at the end (model.lora: the adapters
                          merged into the base)
      adapter/            model.lora: the adapters alone, a PEFT adapter directory
      predictions.jsonl   task=classify: the last evaluation's prediction for every example

A multirun's sweep directory holds its jobs' run directories (named by job number) and:

    <sweep_dir>/
      job-status/<job folder>.json  one JSON object per job (flaxlm.run_records writes and
                          reads it): `job` (its number), `status` (JOB_RUNNING from its start,
                          then JOB_OK, JOB_FAILED or JOB_PREEMPTED), `reason` (one line),
                          `overrides` (its command-line overrides), `run_dir`, and for an ok
                          job `objective` and `objective_value`
      .sweep-lock         held (shared) by every flaxlm-train invocation that runs jobs there
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
ADAPTER_SUBDIR = "adapter"  # model.lora: the PEFT adapter directory, beside model/
EXPORT_MARKER = "flaxlm_export.json"  # in model/ and adapter/: written last by an export
PREDICTIONS_FILE = "predictions.jsonl"
TENSORBOARD_SUBDIR = "tensorboard"

# metrics.jsonl's second x axis beside `step`: runs with different batch sizes compare by it.
TOKENS_SEEN = "tokens_seen"

JOB_STATUS_SUBDIR = "job-status"  # in a sweep directory
SWEEP_LOCK_FILE = ".sweep-lock"  # in a sweep directory
JOB_RUNNING, JOB_OK, JOB_FAILED, JOB_PREEMPTED = "running", "ok", "failed", "preempted"

RUN_FILES = (METRICS_FILE, CONFIG_FILE, LOCK_FILE)  # every run directory has these


def run_path(run_dir: str, name: str) -> str:
    """`name` (one of the constants above) inside `run_dir`."""
    return os.path.join(run_dir, name)


def checkpoint_dir(run_dir: str, output_url: str | None = None) -> str:
    """Where a run's checkpoints are: `<output_url>/checkpoints` when the run has a folder in a
    bucket (output_url), `<run_dir>/checkpoints` otherwise."""
    if output_url:
        return f"{output_url.rstrip('/')}/{CHECKPOINT_SUBDIR}"
    return run_path(run_dir, CHECKPOINT_SUBDIR)


def job_status_path(sweep_dir: str, run_dir: str, job: int) -> str:
    """The status file of the job `job` of the sweep in `sweep_dir`, whose run is `run_dir`.
    Named by the job's folder, not its number: a continued Optuna study numbers its new jobs
    from 0 again."""
    name = os.path.basename(os.path.normpath(run_dir)) or str(job)
    return os.path.join(sweep_dir, JOB_STATUS_SUBDIR, f"{name}.json")
