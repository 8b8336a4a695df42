"""Downstream evaluation of a run: lm-evaluation-harness tasks (`flaxlm.harness`) on its model,
during training as a loop hook (`eval.harness`) or afterwards (flaxlm-eval), with the results
kept in the run directory and logged as `eval/<task>/<metric>`.

The harness's JSON of an evaluation at step S is `<run_dir>/eval/harness-S.json` (an existing
file is never replaced: a second evaluation of S is `harness-S.2.json`).
"""

from __future__ import annotations

import json
import os
import sys

from flax import nnx
from omegaconf import OmegaConf

from flaxlm import distributed
from flaxlm.config import HarnessConfig, LoggerConfig
from flaxlm.errors import FlaxlmError
from flaxlm.harness import FlaxlmLM, HarnessResults, evaluate
from flaxlm.layout import run_path
from flaxlm.models.build import lm_from_params
from flaxlm.run_model import saved_run_config
from flaxlm.runs import held_run_dir, wandb_run_id
from flaxlm.tracking import start_tracker
from flaxlm.training.loop import END, Hook, Loop

EVAL_SUBDIR = "eval"


def results_path(run_dir: str, step: int | None) -> str:
    """Where the results of an evaluation at `step` go: a name no earlier file has."""
    name = f"harness-{step if step is not None else 'final'}"
    stem = run_path(run_dir, os.path.join(EVAL_SUBDIR, name))
    path, count = f"{stem}.json", 1
    while os.path.exists(path):
        count += 1
        path = f"{stem}.{count}.json"
    return path


def write_results(run_dir: str, step: int | None, results: HarnessResults) -> str | None:
    """The harness's JSON into the run directory (process 0; written whole, then renamed)."""
    if not distributed.is_primary():
        return None
    path = results_path(run_dir, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump({"step": step, **results.raw}, f, indent=2, default=str)
    os.replace(temporary, path)
    return path


def record_bucket_results(url: str, local_dir: str, step: int | None,
                          results: HarnessResults) -> None:
    """After a bucket run (flaxlm-eval on its output_url): the JSON written in `local_dir`
    (the run's local copy) and copied to `<url>/eval/`; the run's metrics.jsonl and W&B run
    are left as they are (a resume of the run would copy its own metrics.jsonl over them)."""
    from flaxlm.storage import upload

    path = write_results(local_dir, step, results)
    if path is None:
        return
    remote = f"{url.rstrip('/')}/{os.path.relpath(path, local_dir)}"
    upload(path, remote, "RUN_DIR")
    print(f"flaxlm: results in {remote}", file=sys.stderr)


def record_results(run_dir: str, step: int | None, results: HarnessResults) -> None:
    """After the run (flaxlm-eval): the JSON, and the metrics at `step` in the run's
    metrics.jsonl, W&B run and TensorBoard files (those its logger had). While a run trains
    in the directory its files are its own: the metrics are then only in the JSON."""
    path = write_results(run_dir, step, results)
    if path is None:
        return
    print(f"flaxlm: results in {path}", file=sys.stderr)
    if step is None:
        return  # a final export without a recorded step: no point on the run's step axis
    config = saved_run_config(run_dir)
    with held_run_dir(run_dir) as held:
        if not held:
            print(f"flaxlm: a run is training in {run_dir}: the metrics are not logged to it "
                  "(they are in the JSON)", file=sys.stderr)
            return
        logger = OmegaConf.to_object(OmegaConf.merge(
            OmegaConf.structured(LoggerConfig(name="saved")), config.get("logger") or {}))
        tracker = start_tracker(logger, run_dir, config, name=None, group=None,
                                run_id=wandb_run_id(run_dir) if logger.wandb else None)
        try:
            tracker.log_after_the_run(results.metrics, step)
        finally:
            tracker.finish()


class HarnessEvaluation(Hook):
    """`eval.harness` during training: its tasks on the model every `every_steps` steps and
    after the last, logged at the step and written to `eval/harness-<step>.json`."""

    def __init__(self, harness: HarnessConfig, model_config, tokenizer, own_conventions: bool,
                 mesh, run_dir: str):
        super().__init__(harness.every_steps, at=(END,))
        self.harness, self.model_config, self.mesh, self.run_dir = (harness, model_config, mesh,
                                                                    run_dir)
        self.tokenizer, self.own_conventions = tokenizer, own_conventions

    def __call__(self, loop: Loop) -> None:
        model = lm_from_params(self.model_config, nnx.to_pure_dict(loop.state.params))
        lm = FlaxlmLM.of(model, self.tokenizer, own_conventions=self.own_conventions,
                         mesh=self.mesh, batch_size=self.harness.batch_size)
        limit = self.harness.limit
        results = evaluate(lm, self.harness.tasks,
                           limit=int(limit) if limit is not None and limit >= 1 else limit,
                           num_fewshot=self.harness.num_fewshot,
                           include_path=self.harness.include_path)
        loop.tracker.log(results.metrics, step=loop.step)
        write_results(self.run_dir, loop.step, results)
        loop.show(**{name.split("/", 1)[1]: f"{value:.3f}"
                     for name, value in results.metrics.items() if "stderr" not in name})


def check_harness(harness: HarnessConfig) -> None:
    """What can be checked of `eval.harness` before any data is read."""
    if harness.every_steps is not None and harness.every_steps < 1:
        raise FlaxlmError(f"eval.harness.every_steps={harness.every_steps} must be at least 1 "
                          "(or null: at the end of the run only).")
    if harness.batch_size < 1:
        raise FlaxlmError(f"eval.harness.batch_size={harness.batch_size} must be at least 1.")
    if harness.limit is not None and harness.limit <= 0:
        raise FlaxlmError(f"eval.harness.limit={harness.limit} must be positive: examples per "
                          "task, or below 1 a fraction of each task (null: all).")
