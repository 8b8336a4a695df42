"""task=dpo: preference pairs read and checked, each reply scored on its own tokens; the loss
and every metric equal the DPO formula computed here in numpy from two models' plain forward
passes; the reference log-probs are the starting weights' (with LoRA, the base's); one
end-to-end run through flaxlm-train whose held-out reward accuracy rises far above chance."""

from __future__ import annotations

import dataclasses
import json
import os

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config_node, in_memory_dataset, trained_run
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import assert_close, magnitude, transformer

from flaxlm.config import LongConversations, LoraConfig
from flaxlm.data.chat_template import IM_END, with_chat_template
from flaxlm.data.documents import INPUT_IDS, TARGET_MASK
from flaxlm.data.preference_drills import preference_drills
from flaxlm.data.preferences import (
    REFERENCE_LOGPS,
    Pair,
    encode_pairs,
    load_preferences,
    pairs_of,
)
from flaxlm.errors import FlaxlmError
from flaxlm.models.build import build_lm
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import make_mesh
from flaxlm.training.preference import (
    dpo_eval_step,
    dpo_objective,
    dpo_terms,
    reference_logps,
)

L = 48


def task_config(**changes):
    return config_node("task", ["task=dpo", "task.drills=10"], **changes)


@pytest.fixture(scope="module")
def tokenizer():
    import tokenizers
    import transformers

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    texts = [" ".join(pair) for pair in preference_drills(200)]
    model.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
        unk_token="<unk>", mask_token="<mask>")
    return with_chat_template(fast, None, vocab_size=320)


def as_pair(prompt: str, chosen: str, rejected: str) -> Pair:
    return Pair([{"role": "user", "content": prompt}], [{"role": "assistant", "content": chosen}],
                [{"role": "assistant", "content": rejected}])


def tiny_llama(rank: int | None = None, seed: int = 0):
    model = config_node("model", ["model=llama-tiny"], num_layers=2, hidden_size=32,
                        num_heads=4, num_kv_heads=2, vocab_size=320, max_positions=L,
                        mlp_size=64)
    model = dataclasses.replace(model, lora=LoraConfig(rank=rank))
    return build_lm(TransformerSpec(model), nnx.Rngs(params=seed))


def unpadded_logps(model, arrays) -> np.ndarray:
    """(pairs, 2): each reply's summed log-probs from a plain forward pass (no segment ids,
    positions or masks: the model is causal, so a position's logits do not depend on the
    padding after the sequence), the log-softmax taken in numpy float64."""
    P = arrays[INPUT_IDS].shape[0]
    ids_NxL = arrays[INPUT_IDS].reshape(2 * P, L)
    mask_NxL = arrays[TARGET_MASK].reshape(2 * P, L)
    logits_NxLxV = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids_NxL)),
                              np.float64)
    shifted = logits_NxLxV - logits_NxLxV.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    out = np.zeros(2 * P)
    for n in range(2 * P):
        for t in np.nonzero(mask_NxL[n])[0]:  # token t is predicted at position t - 1
            out[n] += log_probs[n, t - 1, ids_NxL[n, t]]
    return out.reshape(P, 2)


def numpy_dpo(policy, reference, beta):
    rewards = beta * (policy - reference)
    margins = rewards[:, 0] - rewards[:, 1]
    return {"loss": np.log1p(np.exp(-margins)), "rewards/chosen": rewards[:, 0],
            "rewards/rejected": rewards[:, 1], "rewards/accuracies": (margins > 0) * 1.0,
            "rewards/margins": margins, "logps/chosen": policy[:, 0],
            "logps/rejected": policy[:, 1]}


PAIRS = [as_pair("Repeat the last word: cat dog", "dog", "cat"),
         as_pair("Repeat the last word: sun moon fox", "fox", "moon"),
         as_pair("Repeat the last word: red", "red", "blue star")]


# --- reading and encoding ------------------------------------------------------------------------


def test_pairs_read_from_strings_and_from_conversations_that_repeat_the_prompt():
    task = task_config()
    prompt = [{"role": "user", "content": "Hi?"}]
    table = in_memory_dataset([
        {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go away."}])
    assert pairs_of(table, task, "t") == [as_pair("Hi?", "Hello.", "Go away.")]
    # UltraFeedback's layout: each reply a whole conversation, the prompt's turns first.
    table = in_memory_dataset([{
        "prompt": "Hi?",
        "chosen": [*prompt, {"role": "assistant", "content": "Hello."}],
        "rejected": [*prompt, {"role": "assistant", "content": "Go away."}]}])
    assert pairs_of(table, task, "t") == [as_pair("Hi?", "Hello.", "Go away.")]


def test_a_hub_dataset_in_ultrafeedbacks_layout_gives_both_splits(monkeypatch):
    def conversation(prompt, reply):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]

    splits = {split: in_memory_dataset([
        {"prompt": f"{split} {i}?", "prompt_id": str(i), "score_chosen": 8.0,
         "chosen": conversation(f"{split} {i}?", "good"),
         "rejected": conversation(f"{split} {i}?", "bad")} for i in range(3)])
        for split in ("train_prefs", "test_prefs")}
    asked = []

    def load_dataset(path, name=None, split=None):
        asked.append((path, split))
        return splits[split]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    task = dataclasses.replace(task_config(), drills=0,
                               hub_path="HuggingFaceH4/ultrafeedback_binarized",
                               hub_split="train_prefs", hub_eval_split="test_prefs")
    loaded = load_preferences(task)
    assert [split for _, split in asked] == ["train_prefs", "test_prefs"]
    assert loaded.train[1] == as_pair("train_prefs 1?", "good", "bad")
    assert loaded.eval[0] == as_pair("test_prefs 0?", "good", "bad")


def test_missing_columns_and_values_are_refused_naming_the_row():
    task = task_config()
    with pytest.raises(FlaxlmError, match="no column 'rejected'.*task.rejected_column"):
        pairs_of(in_memory_dataset([{"prompt": "a", "chosen": "b"}]), task, "f")
    table = in_memory_dataset([{"prompt": "a", "chosen": "b", "rejected": "c"},
                                        {"prompt": "a", "chosen": None, "rejected": "c"}])
    with pytest.raises(FlaxlmError, match="f, row 2, 'chosen' is None"):
        pairs_of(table, task, "f")


def test_each_reply_is_the_only_target_and_odd_pairs_are_counted(tokenizer):
    long = as_pair("Repeat the last word: " + "cat " * 60, "dog", "cat")
    same = as_pair("Repeat the last word: cat", "cat", "cat")
    rows = encode_pairs(tokenizer, [*PAIRS, long, same], L, LongConversations.drop, "t", 1)
    assert (len(rows), rows.dropped, rows.identical, rows.truncated) == (3, 1, 1, 0)
    ids, mask = rows.arrays[INPUT_IDS], rows.arrays[TARGET_MASK]
    assert ids.shape == (3, 2, L)
    assert tokenizer.decode(ids[1, 0][mask[1, 0]]) == f"fox{IM_END}\n"
    assert tokenizer.decode(ids[1, 1][mask[1, 1]]) == f"moon{IM_END}\n"
    assert "sun moon fox" in tokenizer.decode(ids[1, 0][~mask[1, 0]])
    # Truncated, the long pair's replies are cut away: dropped all the same, and counted.
    cut = encode_pairs(tokenizer, [long], L, LongConversations.truncate, "t", 1)
    assert (len(cut), cut.truncated, cut.dropped) == (0, 1, 1)


# --- the loss ------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), beta=st.floats(0.01, 2.0))
def test_the_terms_are_the_dpo_formula(seed, beta):
    rng = np.random.default_rng(seed)
    policy, reference = rng.normal(-20, 5, (6, 2)), rng.normal(-20, 5, (6, 2))
    terms = dpo_terms(jnp.asarray(policy, jnp.float32), jnp.asarray(reference, jnp.float32),
                      beta)
    for name, expected in numpy_dpo(policy, reference, beta).items():
        # Differences of float32 log-probabilities near −20: their roundings, × β, are the
        # error of the rewards and margins (and, through log σ of slope ≤ 1, of the loss).
        assert_close(np.asarray(terms[name]), expected, depth=4, err_msg=name,
                     scale=max(magnitude(expected), beta * magnitude(policy, reference)))


def test_loss_and_metrics_equal_the_formula_from_two_models_plain_forward_passes(tokenizer):
    beta = 0.3
    rows = encode_pairs(tokenizer, PAIRS, L, LongConversations.truncate, "t", 1)
    policy_model, reference_model = tiny_llama(seed=0), tiny_llama(seed=1)
    policy = unpadded_logps(policy_model, rows.arrays)
    reference = unpadded_logps(reference_model, rows.arrays)
    batch = {key: jnp.asarray(value) for key, value in rows.arrays.items()}
    batch[REFERENCE_LOGPS] = jnp.asarray(reference, jnp.float32)
    expected = numpy_dpo(policy, reference, beta)

    loss, metrics = dpo_objective(policy_model, batch, nnx.Rngs(dropout=0), beta=beta)
    # A log-probability sums L tokens' log-softmax over the vocabulary, from another program
    # than unpadded_logps'; rewards and margins are β × differences of them.
    settings = dict(**transformer(2, 320), scale=beta * magnitude(policy, reference))
    assert_close(float(loss), expected["loss"].mean(), **settings)
    for name, value in metrics.items():
        assert_close(float(value), expected[name].mean(), err_msg=name, **settings)
    # The eval step's sums: a padding row (mask 0) counts for nothing.
    graphdef, params = nnx.split(policy_model, nnx.Param)
    sums = dpo_eval_step(params, batch, jnp.asarray([1, 1, 0]), graphdef=graphdef, beta=beta)
    assert float(sums["pairs"]) == 2
    for name, values in expected.items():
        assert_close(float(sums[name]), values[:2].sum(), err_msg=name, **settings)


def test_reference_logps_are_the_starting_weights_and_with_lora_the_bases(tokenizer):
    rows = encode_pairs(tokenizer, PAIRS, L, LongConversations.truncate, "t", 1)
    mesh = make_mesh(2)
    model = tiny_llama(seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    logps = reference_logps(params, graphdef, rows.arrays, 2, mesh)  # 3 pairs: a padded batch
    logp = transformer(2, 320)  # a sum of L log-softmaxes over the vocabulary, batched apart
    assert_close(logps, unpadded_logps(model, rows.arrays), **logp)
    # With adapters that have learnt something, the reference is still the base exactly.
    adapted = tiny_llama(rank=4, seed=0)
    state = nnx.state(adapted, nnx.LoRAParam)
    rng = np.random.default_rng(1)
    nnx.update(adapted, jax.tree.map(
        lambda p: jnp.asarray(0.1 * rng.standard_normal(p.shape), p.dtype), state))
    graphdef, params = nnx.split(adapted, nnx.Param)
    adapted_logps = reference_logps(params, graphdef, rows.arrays, 2, mesh)
    assert_close(adapted_logps, logps, **logp)
    assert not np.allclose(unpadded_logps(adapted, rows.arrays), logps, rtol=1e-3)


# --- the run -------------------------------------------------------------------------------------


def metrics_records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as file:
        return [json.loads(line) for line in file if line.strip()]


@pytest.mark.slow
def test_the_offline_preset_learns_the_preference(tmp_path_factory):
    run_dir = trained_run(tmp_path_factory, "dpo-run",
                          ["experiment=dpo-llama-tiny-offline", "logger=none",
                           "trainer.max_steps=200", "trainer.eval_every_steps=100"])
    records = metrics_records(run_dir)
    evaluations = [r for r in records if "eval/rewards/accuracies" in r]
    trained = [r for r in records if "train/loss" in r]
    assert trained[-1]["train/rewards/accuracies"] > 0.8  # the train step's own, TRL's names
    assert {f"train/{name}" for name in ("rewards/margins", "logps/chosen")} <= set(trained[-1])
    first, last = evaluations[0], evaluations[-1]
    assert first["eval/loss"] == pytest.approx(np.log(2), abs=1e-4)  # the policy is the reference
    assert last["eval/rewards/accuracies"] > 0.8
    assert last["eval/rewards/margins"] > 0.5 and last["eval/loss"] < 0.5
    model_dir = os.path.join(run_dir, "model")
    with open(os.path.join(model_dir, "chat_template.jinja")) as file:
        assert "<|im_start|>" in file.read()
    assert os.path.exists(os.path.join(model_dir, "model.safetensors"))
    assert os.path.exists(os.path.join(run_dir, "reference_logps.npz"))


def test_bad_settings_are_refused_before_any_data_is_read():
    from conftest import compose
    from omegaconf import OmegaConf

    from flaxlm.tasks.registry import task_named

    config = OmegaConf.to_object(compose(["experiment=dpo-llama-tiny-offline", "task.beta=0"]))
    with pytest.raises(FlaxlmError, match=r"task.beta=0.0 must be a positive number"):
        task_named("dpo").check_settings(config)


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [None, 4])
def test_a_stopped_run_resumes_on_the_same_reference(tmp_path, monkeypatch, capsys, lora_rank):
    """Stopped and resumed, a run ends as the one never stopped: without LoRA its reference
    log-probs come back from the run directory (its start's weights are gone), with LoRA from
    the frozen base."""
    from conftest import assert_resumes_as_never_stopped

    monkeypatch.setenv("FLAXLM_CACHE", str(tmp_path / "cache"))
    overrides = ["experiment=dpo-llama-tiny-offline", "logger=none", "task.drills=400",
                 "trainer.max_steps=6", "trainer.log_every_steps=1",
                 "trainer.eval_every_steps=3", "optimizer.warmup_steps=0", "samples.prompts=[]",
                 f"model.lora.rank={lora_rank or 'null'}"]
    assert_resumes_as_never_stopped(overrides, tmp_path, monkeypatch, capsys, stop_step=3)


def test_a_mixture_of_experts_policy_adds_its_routers_losses_and_logs_its_loads(tokenizer):
    """DPO on an MoE (moe-tiny's family, cut small) adds the router's balancing and z-losses
    × their coefficients to the DPO loss, as pre-training does, and logs the router's
    signals (the per-layer loads the loss-free bias moves by among them)."""
    beta = 0.3
    rows = encode_pairs(tokenizer, PAIRS, L, LongConversations.truncate, "t", 1)
    batch = {key: jnp.asarray(value) for key, value in rows.arrays.items()}
    batch[REFERENCE_LOGPS] = jnp.zeros(rows.arrays[INPUT_IDS].shape[:2], jnp.float32)

    def objective(**coefficients):
        model = config_node("model", ["model=moe-tiny"], num_layers=2, hidden_size=32,
                            num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=320,
                            max_positions=L, mlp_size=64)
        model = dataclasses.replace(model, moe=dataclasses.replace(model.moe, **coefficients))
        policy = build_lm(TransformerSpec(model), nnx.Rngs(params=0))
        return dpo_objective(policy, batch, nnx.Rngs(dropout=0), beta=beta)

    plain, plain_metrics = objective(aux_loss_coef=0.0, z_loss_coef=0.0)
    loss, metrics = objective(aux_loss_coef=0.5, z_loss_coef=0.25)
    router = 0.5 * metrics["moe/balance_loss"] + 0.25 * metrics["moe/router_z_loss"]
    # The same forward pass (the coefficients weigh the loss only): exact to float32's
    # rounding of one addition.
    assert_close(float(loss), float(plain + router), terms=2, depth=1)
    assert float(router) > 0
    assert {"moe/load_max", "moe/layer_0/load_max", "moe/load"} <= set(metrics)
    assert {"rewards/margins", "logps/chosen"} <= set(plain_metrics)
