"""task=reward: a sequence-scoring head on a causal LM trained on preference pairs with the
Bradley–Terry loss. The loss is the formula; a score is the head's output at the last non-pad
token; every held-out pair is scored exactly once; bad settings stop the run before any data
is read; the offline preset learns to rank the preferred reply far above chance; and
transformers scores the exported AutoModelForSequenceClassification as flaxlm does."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compose, config_node, in_two_processes, trained_run
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import approx, assert_close, magnitude, transformer
from omegaconf import OmegaConf

from flaxlm.config import LoraConfig
from flaxlm.data.documents import INPUT_IDS
from flaxlm.errors import FlaxlmError
from flaxlm.job import check_settings
from flaxlm.models.build import build_classifier
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import make_mesh
from flaxlm.tasks.registry import task_named
from flaxlm.tasks.reward import bradley_terry, held_out_scores, pair_scores, reward_metrics

PRESET = "experiment=reward-llama-tiny-offline"
# The preset's run as it goes on two CPU cores, 4 pairs on each, whatever the devices the tests
# fake (a step over 8 of them costs more than its arithmetic on two cores).
RUN = [PRESET, "logger=none", "hardware.num_devices=2"]
PAD = 1


def config_of(*overrides: str):
    return OmegaConf.to_object(compose(list(overrides)))


def tiny_scorer(family: str = "llama", rank: int | None = None, seed: int = 0):
    option = {"llama": "llama-tiny", "gpt2": "gpt2-tiny"}[family]
    model = config_node("model", [f"model={option}"], num_layers=1, hidden_size=16, num_heads=2,
                        num_kv_heads=2 if family == "llama" else None, mlp_size=32,
                        vocab_size=40, max_positions=12, lora=LoraConfig(rank=rank))
    return model, build_classifier(TransformerSpec(model), 1, nnx.Rngs(params=seed))


# --- the loss and the score ----------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
# Scores that float32 holds and no subnormal ones: XLA on a CPU flushes those to zero, where
# (0, -2.5e-39) becomes a tie.
@given(scores=st.lists(st.tuples(st.floats(-30, 30, width=32, allow_subnormal=False),
                                 st.floats(-30, 30, width=32, allow_subnormal=False)),
                       min_size=1, max_size=9))
def test_the_loss_is_bradley_terry_and_a_tie_is_not_a_right_ranking(scores):
    scores = np.asarray(scores, np.float64)
    terms = bradley_terry(jnp.asarray(scores, jnp.float32))
    margins = scores[:, 0] - scores[:, 1]
    # float32 scores of magnitude ≤ 30 and their difference: two roundings of that scale; −log σ
    # has slope ≤ 1.
    close = dict(depth=2, scale=max(magnitude(scores), 1.0))
    assert_close(terms["margin"], margins, **close)
    assert_close(terms["loss"], np.logaddexp(0.0, -margins), **close)
    right = np.asarray(terms["accuracy"])
    float32_margins = np.float32(scores[:, 0]) - np.float32(scores[:, 1])
    np.testing.assert_array_equal(right, (float32_margins > 0).astype(np.float32))
    metrics = reward_metrics(scores)
    assert metrics["eval/accuracy"] == np.mean(margins > 0)
    assert metrics["eval/margin"] == approx(np.mean(margins), dtype=np.float64,
                                            terms=len(margins), scale=magnitude(margins))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_score_is_the_heads_output_at_the_last_non_pad_token(family):
    """Right-padded pairs of sequences of different lengths score as the same sequences
    followed by other tokens, read at the position their length gives: the score is the
    head's output at the last real token, which causal attention keeps from what follows."""
    _, model = tiny_scorer(family)
    rng = np.random.default_rng(0)
    lengths = np.asarray([[12, 3], [1, 7], [5, 5]])
    real = np.arange(12)[None, None] < lengths[..., None]
    tokens = rng.integers(2, 40, (3, 2, 12)).astype(np.int32)  # never the pad id
    scores = pair_scores(model, {INPUT_IDS: jnp.asarray(np.where(real, tokens, PAD))}, PAD)
    assert scores.shape == (3, 2) and scores.dtype == jnp.float32
    # The same tokens where the padding was, the last real one named by a mask instead.
    expected = model(jnp.asarray(tokens.reshape(6, 12)),
                     jnp.asarray(real.reshape(6, 12).astype(np.int32)))
    assert_close(scores, np.asarray(expected).reshape(3, 2), **transformer(1, 32))


@settings(max_examples=20, deadline=None)
@given(num_pairs=st.integers(1, 37), per_device=st.integers(1, 4),
       devices=st.sampled_from([1, 2, 4, 8]))
def test_every_held_out_pair_is_scored_exactly_once_in_order(num_pairs, per_device, devices):
    """Whatever the number of pairs, the batch and the devices that share it: one score per
    pair and side, in the pairs' order (the last batch's filler rows never counted)."""
    ids = np.arange(num_pairs * 2 * 3, dtype=np.int32).reshape(num_pairs, 2, 3) + 7
    scores = held_out_scores(_first_token, ids, per_device * devices, make_mesh(devices))
    np.testing.assert_array_equal(scores, ids[:, :, 0])


@jax.jit
def _first_token(batch):
    """A stand-in scorer: a pair's scores name its sequences (their first token), so any pair
    lost, repeated or reordered shows."""
    return batch[INPUT_IDS][:, :, 0].astype(jnp.float32)


# --- settings ------------------------------------------------------------------------------------


def test_the_task_names_its_metrics_and_ranks_by_accuracy():
    config = config_of(PRESET)
    metrics = task_named("reward").eval_metrics(config)
    assert metrics.logged == ("eval/loss", "eval/accuracy", "eval/margin")
    assert metrics.default == "eval/accuracy" and metrics.lower_is_better == ("eval/loss",)
    assert check_settings(config, num_devices=2) == 32


@pytest.mark.parametrize(("overrides", "names"), [
    (["model=bert-tiny"], ["task=reward", "model=bert-tiny", "encoder", "task=classify"]),
    (["task.drills=0"], ["task=reward needs preference pairs", "task.files", "task.hub_path",
                         "task.drills"]),
    (["task.streaming=true"], ["task.streaming=true", "task.streaming=false"]),
    (["eval.harness.tasks=[hellaswag]"], ["eval.harness.tasks", "task=reward"]),
    (["task.max_seq_length=64"], ["task.max_seq_length=64", "model.max_positions=32"]),
])
def test_bad_settings_are_refused_before_any_data_is_read(overrides, names):
    with pytest.raises(FlaxlmError) as raised:
        check_settings(config_of(PRESET, *overrides), num_devices=2)
    for name in names:
        assert name in str(raised.value), str(raised.value)


@pytest.mark.parametrize(("override", "named"), [("model=bert-tiny", "model=bert-tiny"),
                                                 ("task.drills=0", "task.files")])
def test_flaxlm_train_refuses_bad_input_in_one_line_and_exits_2(train_cli, tmp_path, override,
                                                                named):
    """An encoder, or no pairs: one paragraph naming the setting and its fix, exit code 2."""
    result = train_cli(PRESET, override, "logger=none", f"run_dir={tmp_path / 'run'}",
                       cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("flaxlm: error: task=reward"), result.stderr
    assert named in lines[0], lines[0]
    assert result.stderr.count("flaxlm: error:") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --- the run -------------------------------------------------------------------------------------


def session_cache(monkeypatch, tmp_path_factory) -> None:
    """The session's flaxlm cache, as `trained_run`'s: the preset's compiled steps are reused."""
    monkeypatch.setenv("FLAXLM_CACHE", str(tmp_path_factory.getbasetemp() / "flaxlm-cache"))


def records_of(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as file:
        return [json.loads(line) for line in file if line.strip()]


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory):
    """The offline preset, two thirds of its steps (enough to be far above chance)."""
    return trained_run(tmp_path_factory, "reward-run",
                       [*RUN, "trainer.max_steps=1000",
                        "trainer.eval_every_steps=500"])


@pytest.mark.slow
def test_the_offline_preset_learns_to_rank_the_preferred_reply(preset_run):
    records = records_of(preset_run)
    evaluations = [r for r in records if "eval/accuracy" in r]
    first, last = evaluations[0], evaluations[-1]
    assert first["step"] == 0 and abs(first["eval/accuracy"] - 0.5) < 0.15  # a fresh head
    assert last["step"] == 1000 and last["eval/accuracy"] > 0.9
    assert last["eval/margin"] > 2 and last["eval/loss"] < 0.3
    trained = [r for r in records if "train/loss" in r]
    assert {"train/accuracy", "train/margin"} <= set(trained[-1])
    with open(os.path.join(preset_run, "model", "config.json")) as file:
        exported = json.load(file)
    assert exported["architectures"] == ["LlamaForSequenceClassification"]
    assert len(exported["id2label"]) == 1  # transformers' num_labels
    assert os.path.exists(os.path.join(preset_run, "model", "chat_template.jinja"))


@pytest.mark.slow
@pytest.mark.torch
def test_transformers_scores_the_export_as_flaxlm_does(preset_run):
    """AutoModelForSequenceClassification loads model/ with nothing missing or unused; its
    scores of the held-out pairs, rendered by the exported tokenizer's chat template, are the
    scores of flaxlm's network, and give the run's last held-out metrics."""
    torch = pytest.importorskip("torch")
    import transformers

    from flaxlm.config import LongConversations
    from flaxlm.data.preferences import encode_pairs, load_preferences
    from flaxlm.models import pretrained

    model_dir = os.path.join(preset_run, "model")
    theirs, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, output_loading_info=True)
    assert not any(info.values()), info
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    config = config_of(PRESET)
    pairs = load_preferences(config.task)
    rows = encode_pairs(tokenizer, pairs.eval, 32, LongConversations.truncate, "held out",
                        theirs.config.pad_token_id)
    ids_NxL = rows.arrays[INPUT_IDS].reshape(-1, 32)
    with torch.no_grad():
        expected = theirs.eval()(torch.from_numpy(ids_NxL.astype(np.int64)),
                                 attention_mask=torch.from_numpy(
                                     (ids_NxL != theirs.config.pad_token_id).astype(np.int64))
                                 ).logits.numpy().reshape(-1, 2)

    model_config = pretrained.pretrained_model_config(model_dir, config.model)
    ours = build_classifier(TransformerSpec(model_config), 1, nnx.Rngs(0))
    pretrained.load_pretrained_weights(ours, model_dir, source=model_dir)
    scores = pair_scores(ours, {INPUT_IDS: jnp.asarray(rows.arrays[INPUT_IDS])},
                         theirs.config.pad_token_id)
    # Against transformers' float32 kernels: 2 layers, the MLP's 192 the widest reduction.
    numerics = transformer(model_config.num_layers, model_config.mlp_size)
    assert_close(scores, expected, **numerics)
    last = [r for r in records_of(preset_run) if "eval/accuracy" in r][-1]
    recomputed = reward_metrics(expected)
    margins = expected[:, 0] - expected[:, 1]
    assert recomputed["eval/margin"] == approx(last["eval/margin"], **numerics,
                                               scale=magnitude(expected))
    if np.min(np.abs(margins)) > 1e-3 * magnitude(expected):  # no pair on the fence
        assert recomputed["eval/accuracy"] == last["eval/accuracy"]


@pytest.mark.slow
def test_with_lora_only_the_adapters_and_the_fresh_head_train():
    """model.lora: one train step changes the adapters and the score head, and no other
    weight (`trainable`, what the task hands the pipeline as Network.trainable)."""
    import optax

    from flaxlm.tasks.reward import compile_reward_steps, trainable
    from flaxlm.training.optimizer import make_optimizer
    from flaxlm.training.step import create_state

    model_config, model = tiny_scorer(rank=2)
    mesh = make_mesh(2)
    tx = make_optimizer(config_node("optimizer", ["optimizer=adamw"], lr=1e-2),
                        optax.constant_schedule(1e-2))
    graphdef, state = create_state(model, tx, mesh, trainable(model_config))
    before = nnx.to_pure_dict(jax.device_get(state.params))
    steps = compile_reward_steps(mesh, graphdef, tx, pad_id=PAD,
                                 trainable=trainable(model_config))
    ids = np.random.default_rng(0).integers(2, 40, (4, 2, 12)).astype(np.int32)
    state, metrics = steps.train(state, {INPUT_IDS: jnp.asarray(ids)}, jax.random.key(0))
    after = nnx.to_pure_dict(jax.device_get(state.params))
    paths = [".".join(map(str, path)) for path, _ in
             jax.tree_util.tree_flatten_with_path(before)[0]]
    changed = {path for path, old, new in zip(paths, jax.tree.leaves(before),
                                              jax.tree.leaves(after), strict=True)
               if not np.array_equal(old, new)}
    assert {"score" in path or "lora" in path for path in changed} == {True}
    assert any("score" in path for path in changed) and any("lora" in path for path in changed)
    assert {"accuracy", "margin"} <= set(metrics)


@pytest.mark.slow
def test_a_lora_run_exports_the_merged_one_label_classifier(tmp_path, tmp_path_factory,
                                                            monkeypatch, capsys):
    """Its end writes model/ merged; flaxlm-export makes the same model of its checkpoint,
    which holds the adapters and the head only, put back on the base its seed made."""
    from safetensors.numpy import load_file

    from flaxlm.cli.export import run as export
    from flaxlm.job import train

    session_cache(monkeypatch, tmp_path_factory)
    run_dir = tmp_path / "run"
    train(compose([*RUN, "task.drills=200", "model.lora.rank=4",
                   "trainer.max_steps=3", "trainer.eval_every_steps=3",
                   "optimizer.warmup_steps=0"], run_dir=run_dir))
    assert "of them trained" in capsys.readouterr().out
    weights = load_file(str(run_dir / "model" / "model.safetensors"))
    assert weights["score.weight"].shape == (1, 64)
    assert not any("lora" in name for name in weights)
    assert "eval/accuracy" in records_of(run_dir)[-1]
    exported = load_file(os.path.join(export([str(run_dir), "--out", str(tmp_path / "hf")]),
                                      "model.safetensors"))
    assert exported.keys() == weights.keys()
    for name, values in weights.items():  # merged on the mesh, or on the host: W + s·A·B
        assert_close(exported[name], values, terms=4, err_msg=name)


@pytest.mark.slow
def test_a_stopped_run_resumes_to_the_same_metrics(tmp_path, tmp_path_factory, monkeypatch,
                                                   capsys):
    """Stopped and resumed (the pipeline's checkpoints, nothing of the task's own), a run ends
    as the one never stopped."""
    from conftest import assert_resumes_as_never_stopped

    session_cache(monkeypatch, tmp_path_factory)
    overrides = [*RUN, "task.drills=400", "trainer.max_steps=6",
                 "trainer.log_every_steps=1", "trainer.eval_every_steps=3",
                 "optimizer.warmup_steps=0"]
    assert_resumes_as_never_stopped(overrides, tmp_path, monkeypatch, capsys, stop_step=3)


TWO_PROCESSES = """
import numpy as np
from flaxlm.data.documents import INPUT_IDS
from flaxlm.parallel import make_mesh
from flaxlm.tasks.reward import held_out_scores

mesh = make_mesh(None)
assert mesh.devices.size == 8 and jax.local_device_count() == 4
first_token = jax.jit(lambda batch: batch[INPUT_IDS][:, :, 0].astype(np.float32))
for num_pairs in (1, 7, 33, 64):
    for batch in (8, 24):
        ids = np.arange(num_pairs * 2 * 3, dtype=np.int32).reshape(num_pairs, 2, 3) + 7
        scores = held_out_scores(first_token, ids, batch, mesh)
        assert np.array_equal(scores, ids[:, :, 0]), (num_pairs, batch, scores)
print("process", jax.process_index(), "ok", flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_score_every_held_out_pair_once_in_order(tmp_path):
    """Two processes of 4 CPU devices, one 8-device mesh: each gets every pair's scores, each
    pair once, in order, whatever the batch."""
    in_two_processes(TWO_PROCESSES, tmp_path)
