"""The job hands each task its context; the tasks are found by name and check their own
settings before any data is read."""

from __future__ import annotations

import pytest
from conftest import compose
from omegaconf import OmegaConf

from flaxlm.errors import FlaxlmError
from flaxlm.job import check_settings
from flaxlm.tasks.registry import TASKS, task_named


def config_of(*overrides: str):
    return OmegaConf.to_object(compose(list(overrides)))


def test_every_task_option_names_a_registered_task():
    for name in ("clm", "classify"):
        assert task_named(config_of(f"task={name}").task.name) is TASKS[name]


def test_an_unknown_task_name_is_one_clear_error():
    with pytest.raises(FlaxlmError, match=r"task.name='mlm'.*task=clm.*task=classify"):
        task_named("mlm")


def test_a_classify_run_carries_no_corpus():
    config = config_of("experiment=glue-mrpc")
    assert config.language is None
    assert "language" in OmegaConf.to_container(compose(["task=classify"]))
    assert OmegaConf.to_container(compose(["task=classify"]))["language"] is None


def test_a_corpus_given_to_a_classify_run_is_refused():
    config = config_of("task=classify", "language=is", "task.hub_path=nyu-mll/glue")
    with pytest.raises(FlaxlmError, match=r"task.hub_path or task.files, so language=is"):
        check_settings(config, num_devices=8)


def test_clm_without_a_corpus_is_refused():
    config = config_of("~language")
    with pytest.raises(FlaxlmError, match=r"task=clm needs a corpus.*language=en-builtin"):
        check_settings(config, num_devices=8)


def test_clm_refuses_an_encoder_before_reading_data():
    config = config_of("model=bert-tiny")
    with pytest.raises(FlaxlmError, match=r"model=bert-tiny") as raised:
        check_settings(config, num_devices=8)
    assert "model=tiny" not in str(raised.value)


def test_each_task_returns_its_sequence_length():
    assert check_settings(config_of("task.max_seq_length=32"), num_devices=8) == 32
    assert check_settings(config_of("experiment=glue-mrpc", "task.max_seq_length=96"),
                          num_devices=8) == 96


# --- what each task says about itself ------------------------------------------------------------


def test_the_job_and_the_shared_code_never_name_a_task():
    """A new task is a module and a registry entry: the job, the objective and the loop ask the
    task (`Task.eval_metrics`, ...) instead of branching on its name."""
    import ast
    from pathlib import Path

    import flaxlm

    package = Path(flaxlm.__file__).parent
    shared = [package / "job.py", package / "tasks" / "base.py", package / "tasks" / "objective.py",
              package / "tasks" / "pipeline.py",
              *sorted((package / "training").rglob("*.py"))]
    named = [(path.name, node.value) for path in shared
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Constant) and node.value in TASKS]
    assert named == []


def test_every_task_states_its_parts_and_runs_none_itself():
    """Each task is a `Task` of the one pipeline (tasks/pipeline.py: `run`), which calls its
    parts in order: no task has a run of its own."""
    from flaxlm.tasks.pipeline import Task

    for task in TASKS.values():
        assert isinstance(task, Task)
        assert not any("run" in vars(cls) for cls in type(task).__mro__)


@pytest.mark.parametrize(("overrides", "logged", "default"), [
    ((), ("eval/loss", "eval/perplexity", "eval/bits_per_byte"), "eval/loss"),
    (("experiment=glue-mrpc",), ("eval/loss", "eval/accuracy", "eval/f1"), "eval/f1"),
    (("task=classify", "task.num_labels=1"), ("eval/loss", "eval/pearson", "eval/spearman"),
     "eval/pearson"),
    (("task=classify", "task.num_labels=null", "task.metrics=[]"), ("eval/loss",), "eval/loss"),
])
def test_each_task_names_the_eval_metrics_it_logs_and_its_default_objective(overrides, logged,
                                                                             default):
    config = config_of(*overrides)
    metrics = task_named(config.task.name).eval_metrics(config)
    assert (metrics.logged, metrics.default) == (logged, default)
    assert "eval/loss" in metrics.lower_is_better
    assert set(metrics.lower_is_better) <= set(metrics.logged)


# GPT-2's, BERT's and Llama's parameter names of the tables an embedding lookup reads: the
# token table, the position table (absent with rotary positions) and BERT's segment table.
TOKEN_TABLES = ("wte", "word_embeddings", "embed_tokens")
OTHER_TABLES = ("wpe", "position_embeddings", "token_type_embeddings")


def multiplying_params(model) -> int:
    """Parameters that multiply, read off the parameter tree: every one but the lookup tables.
    A token table multiplies as well where it is an LM's tied head: an LM without an lm_head
    of its own."""
    import jax
    from flax import nnx

    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    paths = [[str(key.key) for key in path] for path, _ in leaves]
    tied_head = (hasattr(model, "decode")  # a language model
                 and not any("lm_head" in path for path in paths))
    lookups = OTHER_TABLES if tied_head else OTHER_TABLES + TOKEN_TABLES
    return sum(leaf.size for path, (_, leaf) in zip(paths, leaves)
               if not any(name in lookups for name in path))


# (model option, language model?): every family's classifier, and the families with an LM head.
HEADS = [("gpt2-tiny", True), ("llama-tiny", True), ("gpt2-tiny", False), ("llama-tiny", False),
         ("bert-tiny", False)]


@pytest.mark.parametrize(("option", "lm"), HEADS)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("seq_len", [16, 128])
def test_each_family_counts_its_training_flops_per_token(option, lm, tied, seq_len):
    """6 FLOPs per multiplying weight and token, plus attention's 12·layers·width·length, for
    every family and both heads, without the task naming the family."""
    import dataclasses

    from flaxlm.models import build
    from flaxlm.models.layers import TransformerSpec, count_params

    model_config = dataclasses.replace(config_of(f"model={option}").model,
                                       tie_word_embeddings=tied)
    spec = TransformerSpec(model_config)
    if lm:
        model = build.abstract_network(lambda rngs: build.build_lm(spec, rngs))
        flops = build.lm_flops_per_token(model_config, count_params(model), seq_len)
    else:
        model = build.abstract_network(lambda rngs: build.build_classifier(spec, 3, rngs))
        flops = build.classifier_flops_per_token(model_config, count_params(model), seq_len)
    attention = 12 * model_config.num_layers * model_config.hidden_size * seq_len
    assert flops == 6 * multiplying_params(model) + attention
