"""The objective: the eval metric a run returns to a sweeper (trainer.objective, or the task's
default), which way is better and which of the run's values counts. Each task says which eval
metrics it logs (`Task.eval_metrics`); this module checks the choice against them.
"""

from __future__ import annotations

import dataclasses
import math

from flaxlm.config import HarnessConfig, ObjectiveMode, ObjectiveValue, TrainConfig
from flaxlm.errors import FlaxlmError
from flaxlm.layout import METRICS_FILE, run_path
from flaxlm.run_records import read_metrics
from flaxlm.tasks.registry import task_named

# Downstream metrics for which lower is better (the harness's perplexities, bits per byte);
# every other one is better higher.
_LOWER_IS_BETTER = ("perplexity", "bits_per_byte", "loss")


@dataclasses.dataclass(frozen=True)
class Objective:
    """The eval metric a run returns to a sweeper, which way is better, and which value."""

    name: str
    mode: ObjectiveMode
    value: ObjectiveValue


def choose_objective(config: TrainConfig) -> Objective:
    """trainer.objective and its mode, checked against the eval metrics this run will log."""
    metrics = task_named(config.task.name).eval_metrics(config)
    name = config.trainer.objective or metrics.default
    downstream = harness_metric(name, config.eval.harness)
    if name not in metrics.logged and not downstream:
        raise FlaxlmError(
            f"trainer.objective={name} is not a metric this run logs: task={config.task.name} "
            f"evaluates {list(metrics.logged)}. Pick one of those (or null for "
            f"{metrics.default}); a classify metric must be in task.metrics (or, with none "
            "listed, among the defaults task.num_labels gives), or eval/<task>/<metric> of a "
            "task in eval.harness.tasks."
        )
    mode = config.trainer.objective_mode
    if mode is None:
        lower = lower_is_better(name) if downstream else name in metrics.lower_is_better
        mode = ObjectiveMode.min if lower else ObjectiveMode.max
    return Objective(name, mode, config.trainer.objective_value)


def harness_metric(name: str, harness: HarnessConfig) -> bool:
    """Whether `name` is a metric `eval.harness` logs (`eval/<task>/<metric>`)."""
    return any(name.startswith(f"eval/{task}/") for task in harness.tasks)


def lower_is_better(name: str) -> bool:
    return any(part in name.rsplit("/", 1)[-1] for part in _LOWER_IS_BETTER)


def objective_result(objective: Objective, run_dir: str, final: dict) -> float:
    """The objective's best or last value over the run's evaluations, read back from its
    metrics.jsonl (a resumed run's earlier evaluations included); a process without that file
    (not process 0) returns the final evaluation's."""
    values = [float(record[objective.name])
              for record in read_metrics(run_path(run_dir, METRICS_FILE)).records
              if isinstance(record.get(objective.name), (int, float))]
    if not values:
        return float(final.get(objective.name, math.nan))
    if objective.value == ObjectiveValue.last:
        return values[-1]
    finite = [v for v in values if math.isfinite(v)] or values
    return min(finite) if objective.mode == ObjectiveMode.min else max(finite)
