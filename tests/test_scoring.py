"""Log-likelihood scoring (`flaxlm.scoring`): continuations read as branches of a shared
context, rows split over 8 devices, give each request the score of the plain forward pass
over that one context and continuation alone; truncation follows the harness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import model_config
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import approx, transformer

from flaxlm.errors import FlaxlmError
from flaxlm.models.build import build_lm
from flaxlm.models.layers import TransformerSpec
from flaxlm.run_model import local_mesh
from flaxlm.scoring import bucket, score

VOCAB, CONTEXT = 61, 32


def log_probability(expected: float, continuation: list[int]):
    """A sum of log-softmaxes, batched otherwise than the reference: each is a difference of
    numbers of about log VOCAB, computed through the models' 2 layers (GPT-2's MLP of 128 the
    widest reduction)."""
    return approx(expected, **transformer(2, 128), scale=len(continuation) * np.log(VOCAB))
# A large init makes a random model's predictions peaked, so a wrong position or mask shows.
FAMILIES = {
    family: model_config(family, name=f"{family}-score", vocab_size=VOCAB,
                         max_positions=CONTEXT, hidden_size=32, num_layers=2, num_heads=4,
                         initializer_range=0.3)
    for family in ("gpt2", "llama")
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    return build_lm(TransformerSpec(FAMILIES[request.param]), nnx.Rngs(0))


@nnx.jit
def _logprobs(model, ids_1xL):
    return jax.nn.log_softmax(model(ids_1xL).astype(jnp.float32), axis=-1)


def reference(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The plain forward pass over context + continuation (cut to the context length from the
    left, as the harness does), padded on the right to one shape."""
    ids = (context + continuation)[-(CONTEXT + 1):][:-1]
    padded = np.zeros((1, CONTEXT), np.int32)
    padded[0, :len(ids)] = ids
    logprobs_LxV = np.asarray(_logprobs(model, jnp.asarray(padded))[0])
    first = len(ids) - len(continuation)
    rows = logprobs_LxV[first:len(ids)]
    picked = rows[np.arange(len(continuation)), continuation]
    return float(picked.sum()), bool((rows.argmax(-1) == continuation).all())


tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
questions = st.lists(st.tuples(tokens, st.lists(tokens, min_size=1, max_size=5)),
                     min_size=1, max_size=4)


@settings(max_examples=6, deadline=None)
@given(questions=questions, batch_rows=st.sampled_from([1, 3, 8]))
def test_every_score_equals_the_forward_pass_over_that_pair_alone(model, questions,
                                                                   batch_rows):
    requests = [(context, choice) for context, choices in questions for choice in choices]
    scores = score(model, requests, batch_rows=batch_rows, mesh=local_mesh())
    for (context, continuation), (logprob, greedy) in zip(requests, scores):
        expected, expected_greedy = reference(model, context, continuation)
        assert logprob == log_probability(expected, continuation)
        assert greedy == expected_greedy


def test_a_long_request_keeps_its_last_tokens_and_the_greedy_flag_can_be_true(model):
    rng = np.random.default_rng(1)
    long_context = rng.integers(0, VOCAB, 3 * CONTEXT).tolist()
    ids = np.asarray(long_context[-CONTEXT:], np.int32)[None]
    greedy_next = int(np.argmax(np.asarray(_logprobs(model, jnp.asarray(ids))[0, -1])))
    requests = [(long_context, [greedy_next]), (long_context, rng.integers(0, VOCAB, 5).tolist()),
                (long_context[-5:], [greedy_next])]
    scores = score(model, requests)
    for request, (logprob, greedy) in zip(requests, scores):
        expected, expected_greedy = reference(model, *request)
        assert logprob == log_probability(expected, request[1])
        assert greedy == expected_greedy
    assert scores[0][1]


def test_unscorable_requests_are_refused(model):
    with pytest.raises(FlaxlmError, match="longer than the model's context"):
        score(model, [([1], list(range(CONTEXT + 1)))])
    with pytest.raises(FlaxlmError, match="at least one token"):
        score(model, [([], [1])])


def test_buckets_are_quarter_octaves():
    assert [bucket(n) for n in (1, 8, 9, 11, 13, 17, 33, 100, 129)] == [
        8, 8, 10, 12, 14, 20, 40, 112, 160]
    for n in range(1, 3000):
        assert n <= bucket(n) <= max(8, n * 1.25)
