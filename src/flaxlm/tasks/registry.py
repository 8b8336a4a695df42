"""The tasks flaxlm trains for, by the name `task.name` gives them. A new task is one module
with a subclass of `Task` (tasks/pipeline.py) and one entry here."""

from __future__ import annotations

from flaxlm.errors import FlaxlmError
from flaxlm.tasks.classify import Classification
from flaxlm.tasks.clm import CausalLM
from flaxlm.tasks.dpo import DirectPreferenceOptimisation
from flaxlm.tasks.pipeline import Task
from flaxlm.tasks.reward import RewardModelling
from flaxlm.tasks.sft import SupervisedFineTuning

TASKS: dict[str, Task] = {"clm": CausalLM(), "classify": Classification(),
                         "sft": SupervisedFineTuning(), "dpo": DirectPreferenceOptimisation(),
                         "reward": RewardModelling()}


def task_named(name: str) -> Task:
    if name not in TASKS:
        raise FlaxlmError(
            f"task.name={name!r} is not a task flaxlm runs. Pick task=clm (pre-train a causal "
            "LM), task=classify (fine-tune a classifier), task=sft (fine-tune a chat "
            "model on conversations), task=dpo (tune it on preference pairs) or task=reward "
            "(train a reward model on preference pairs)."
        )
    return TASKS[name]
