"""The next-token loss: chunked over the sequence it is the loss of the whole logits (values and
gradients, any chunk size, with documents and padded evaluation rows, GPT-2 and Llama); the
z-loss adds its coefficient × the mean log²Z and is logged; bad settings are named."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SHORT, TINY, compose, metrics_of
from conftest import model_config as family_config
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numerics import assert_close, assert_trees_close, transformer
from omegaconf import OmegaConf

from flaxlm.data.documents import with_documents
from flaxlm.errors import FlaxlmError
from flaxlm.job import check_settings
from flaxlm.models.build import build_lm
from flaxlm.models.layers import TransformerSpec
from flaxlm.training.step import (
    LossSettings,
    chunked_token_losses,
    eval_step,
    lm_loss,
    lm_objective,
    next_token_losses,
    token_losses,
)

FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VOCAB, LENGTH = 61, 12
SHAPE = dict(vocab_size=VOCAB, max_positions=16, hidden_size=16, num_layers=1, num_heads=2,
             initializer_range=0.5)
MODELS = {
    "gpt2": family_config("gpt2", **SHAPE),
    "llama-untied": family_config("llama", **SHAPE, num_kv_heads=1, mlp_size=24,
                                  tie_word_embeddings=False),
    "llama-tied": family_config("llama", **SHAPE, num_kv_heads=1, mlp_size=24,
                                tie_word_embeddings=True),
}
# A chunk size that leaves a remainder of LENGTH: the head's test above covers every other case
# of the chunking; the models' test checks what reaches the head (tied or own weights, documents).
CHUNK = 5
# The widest reduction of the models' losses: GPT-2's MLP (4 × 16), the vocabulary, the targets.
WIDEST = max(4 * SHAPE["hidden_size"], VOCAB, 2 * (LENGTH - 1))


# --- the chunked loss of a head ------------------------------------------------------------------


@functools.cache
def head_losses(length: int, chunk_size: int | None):
    """Jitted (losses, log Z, gradients w.r.t. hidden states and head) of a linear head."""

    def losses(hidden_BxLxD, kernel_DxV, labels_BxL, cotangents):
        def scored(hidden_BxLxD, kernel_DxV):
            head = lambda x_BxCxD: x_BxCxD @ kernel_DxV  # noqa: E731
            if chunk_size is None:
                return token_losses(head(hidden_BxLxD), labels_BxL, with_log_z=True)
            return chunked_token_losses(hidden_BxLxD, head, labels_BxL, chunk_size, True)

        out, pullback = jax.vjp(scored, hidden_BxLxD, kernel_DxV)
        return out, pullback(cotangents)

    return jax.jit(losses)


@pytest.mark.slow
@FEW
@given(length=st.sampled_from([1, 6, 9]), chunk_size=st.integers(1, 11), seed=st.integers(0, 99))
def test_chunked_losses_and_gradients_are_the_whole_logits(length, chunk_size, seed):
    """Any chunk size, dividing the length or not (the last L mod C positions are one smaller
    chunk), or longer than the sequence: the same per-position cross-entropy and log Z, and
    the same gradients for any weighting of them, as one (B, L, V) array of logits."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(2, length, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(8, 13)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 13, (2, length)), jnp.int32)
    cotangents = tuple(jnp.asarray(rng.normal(size=(2, length)), jnp.float32) for _ in range(2))
    (whole, whole_grads) = head_losses(length, None)(hidden, kernel, labels, cotangents)
    (chunked, chunked_grads) = head_losses(length, chunk_size)(hidden, kernel, labels,
                                                               cotangents)
    for a, b in zip([*whole, *whole_grads], [*chunked, *chunked_grads]):
        # A product of 8, a log-sum-exp of 13 and back; the kernel's gradient sums 2 × length.
        assert_close(b, a, terms=max(13, 2 * length), depth=4)


def test_the_chunked_loss_holds_one_chunks_logits_at_a_time():
    """The loss of 256 positions in chunks of 16 over a 2048-word vocabulary, forward and
    backward, needs a fraction of the temporary memory of the 256 × 2048 logits of the whole
    path (the compiler's own figure)."""
    hidden = jax.ShapeDtypeStruct((1, 256, 8), jnp.float32)
    kernel = jax.ShapeDtypeStruct((8, 2048), jnp.float32)
    labels = jax.ShapeDtypeStruct((1, 256), jnp.int32)

    def temporaries(chunk_size):
        def loss(hidden_BxLxD, kernel_DxV, labels_BxL):
            head = lambda x: x @ kernel_DxV  # noqa: E731
            if chunk_size is None:
                return token_losses(head(hidden_BxLxD), labels_BxL)[0].sum()
            return chunked_token_losses(hidden_BxLxD, head, labels_BxL, chunk_size)[0].sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return grad.lower(hidden, kernel, labels).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = 256 * 2048 * 4
    assert temporaries(None) >= logits_bytes
    assert temporaries(16) < logits_bytes / 4


# --- the models' loss ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return build_lm(TransformerSpec(MODELS[request.param]), nnx.Rngs(0))


def a_batch(documents: bool, seed: int = 0):
    """Two rows of LENGTH tokens; with `documents`, cut into documents of a few tokens."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, (2, LENGTH)).astype(np.int32)
    if not documents:
        return jnp.asarray(ids)
    starts = np.zeros((2, LENGTH), bool)
    starts[0, [0, 3, 4, 9]] = starts[1, [0, 7]] = True
    return {k: jnp.asarray(v) for k, v in with_documents(ids, starts).items()}


@functools.cache
def objective_and_grads(graphdef, loss: LossSettings):
    def objective(params, batch):
        return lm_objective(nnx.merge(graphdef, params), batch, None, loss)

    return jax.jit(jax.value_and_grad(objective, has_aux=True))


# Four of the six (model, batch) pairs: each LM head (GPT-2's tied, Llama's own and tied) and
# each batch (plain rows, documents) with both families. The two sides of the comparison share
# the family's `hidden_states`; what the chunked side adds is how step.py hands it the batch
# (the same code for every family: the batch decides it) and the head it runs chunk by chunk,
# which sees hidden states only (the batch does not reach it). So Llama's own head on plain
# rows and its tied head on documents take no path the four do not.
@pytest.mark.slow
@pytest.mark.parametrize("model, documents", [
    ("gpt2", False), ("gpt2", True), ("llama-untied", True), ("llama-tied", False),
], indirect=["model"], ids=["gpt2-plain", "gpt2-documents", "llama-untied-documents",
                            "llama-tied-plain"])
def test_a_models_chunked_loss_and_gradients_are_the_whole_logits(model, documents):
    """GPT-2 (tied head), Llama with its own LM head and with a tied one: the training
    objective (with a z-loss) and every parameter's gradient, chunked or not, plain rows or
    packed documents (segment ids and positions)."""
    graphdef, params = nnx.split(model, nnx.Param)
    batch = a_batch(documents)
    (whole, whole_metrics), whole_grads = objective_and_grads(graphdef, LossSettings(0.1))(
        params, batch)
    (chunked, metrics), grads = objective_and_grads(graphdef, LossSettings(0.1, CHUNK))(
        params, batch)
    # The same head, its sums over the positions split into chunks: reordered.
    assert_close(chunked, whole, **transformer(SHAPE["num_layers"], WIDEST))
    assert_close(metrics["z_loss"], whole_metrics["z_loss"],
                 **transformer(SHAPE["num_layers"], WIDEST))
    assert_trees_close(grads, whole_grads,
                       **transformer(SHAPE["num_layers"], WIDEST, backward=True))


def test_the_z_loss_is_its_coefficient_times_the_mean_squared_log_normaliser(model):
    """Computed from the full logits in the test: the objective is the mean cross-entropy
    plus 0.1 × mean(logsumexp(logits)²) over the positions that have a next token, and the
    metric is that term; with the coefficient 0 the objective is the plain loss, exactly, and
    there is no metric."""
    batch = a_batch(documents=False)
    logits = np.asarray(model(batch), np.float64)[:, :-1]
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    cross_entropy = float(next_token_losses(model(batch), batch).mean())
    loss, metrics = lm_objective(model, batch, None, LossSettings(z_loss=0.1))
    # float32 log-sum-exps of VOCAB logits and their mean against float64; squaring log Z
    # doubles its relative error.
    settings = dict(terms=max(VOCAB, 2 * LENGTH), depth=2, amplification=2)
    assert_close(metrics["z_loss"], 0.1 * np.mean(log_z**2), **settings)
    assert_close(loss, cross_entropy + 0.1 * np.mean(log_z**2), **settings)
    plain, none = lm_objective(model, batch, None)
    assert none == {} and float(plain) == float(lm_loss(model, batch, None)) == cross_entropy


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
def test_evaluation_sums_the_same_chunked_or_not(model, documents):
    """The eval step (loss, tokens, bytes summed over real rows: the second row is padding)
    in chunks of 5 of 12 positions is the unchunked one's."""
    graphdef, params = nnx.split(model, nnx.Param)
    batch, row_mask = a_batch(documents, seed=1), jnp.asarray([1.0, 0.0])
    token_bytes = jnp.arange(VOCAB, dtype=jnp.float32) % 4 + 1
    whole, chunked = (eval_step(params, batch, row_mask, token_bytes, graphdef=graphdef,
                                chunk_size=chunk_size) for chunk_size in (None, 5))
    assert float(chunked["tokens"]) == float(whole["tokens"]) == LENGTH - 1
    assert float(chunked["bytes"]) == float(whole["bytes"])
    assert_close(chunked["loss_sum"], whole["loss_sum"], **transformer(SHAPE["num_layers"], WIDEST))


# --- runs and settings ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_with_chunked_loss_and_z_loss_logs_the_z_loss(tmp_path):
    """A TINY run with trainer.z_loss and trainer.loss_chunk_size trains, logs train/z_loss
    beside train/loss (which includes it) and evaluates the cross-entropy alone."""
    from flaxlm.job import train

    config = compose([*TINY, "trainer.max_steps=4", "trainer.log_every_steps=2",
                      "trainer.eval_before_training=false", "trainer.z_loss=1e-3",
                      "trainer.loss_chunk_size=24", "samples.prompts=[]"],
                     run_dir=str(tmp_path / "run"))
    train(config)
    logged = [m for m in metrics_of(tmp_path / "run") if "train/loss" in m]
    assert len(logged) == 2
    for record in logged:
        assert 0 < record["train/z_loss"] < record["train/loss"]
    evaluated = [m for m in metrics_of(tmp_path / "run") if "eval/loss" in m]
    assert evaluated and all("eval/z_loss" not in m for m in evaluated)


@pytest.mark.parametrize("override", ["trainer.z_loss=-0.1", "trainer.z_loss=nan",
                                      "trainer.z_loss=inf", "trainer.loss_chunk_size=0",
                                      "trainer.loss_chunk_size=-8"])
def test_bad_loss_settings_are_named_before_any_data(override):
    config = OmegaConf.to_object(compose([*SHORT, override]))
    with pytest.raises(FlaxlmError) as info:
        check_settings(config, num_devices=8)
    assert override.split("=")[0] in str(info.value)


def test_the_defaults_keep_todays_loss():
    """No z-loss and the whole logits unless asked: the quickstart's numbers stay."""
    trainer = OmegaConf.to_object(compose(TINY)).trainer
    assert trainer.z_loss == 0 and trainer.loss_chunk_size is None
