"""Generation with the KV cache: it equals recomputing the whole prefix every step (batched
prompts of different lengths included) and transformers' greedy search on the exported model;
sampling settings behave as documented."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import full_forward, greedy_by_recomputing, make_tokenizer, model_config
from flax import nnx
from numerics import assert_close, transformer

from flaxlm.errors import FlaxlmError
from flaxlm.generate import GenerationSettings, generate, generate_ids, left_pad
from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec

# Larger init than GPT-2's 0.02: a random model then prefers some tokens clearly, so greedy
# paths differ between prompts and an off-by-one position or mask shows.
CONFIG = model_config(name="t", vocab_size=97, max_positions=64, hidden_size=64, num_layers=2,
                      num_heads=4, initializer_range=0.2)
PROMPT_LENGTHS = (3, 9, 1, 20)
EOS = 5


@pytest.fixture(scope="module")
def model():
    return GPT2LMHeadModel(TransformerSpec(CONFIG), nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
    return [np.random.default_rng(n).integers(0, 97, n).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.slow
def test_cached_decode_matches_the_full_forward_pass_with_left_padding(model):
    ids_BxL = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 10)))
    full_BxLxV = full_forward(model, ids_BxL)
    padded_BxP, mask_BxP = left_pad([ids_BxL[0, :6].tolist(), ids_BxL[1, :4].tolist()], 0)
    cache = model.init_cache(2, padded_BxP.shape[1] + 1)
    decode = nnx.jit(lambda m, *args: m.decode(*args))  # eager op by op compiles for seconds
    logits_BxPxV, cache = decode(model, jnp.asarray(padded_BxP), cache, jnp.asarray(mask_BxP))
    # The cache's program and the full one's: the same sums, compiled apart.
    settings = transformer(CONFIG.num_layers, 4 * CONFIG.hidden_size)
    assert_close(logits_BxPxV[0, -6:], full_BxLxV[0, :6], **settings)
    assert_close(logits_BxPxV[1, -4:], full_BxLxV[1, :4], **settings)
    # One more token per row: row 1 continues at position 4 although it sits in slot P.
    next_Bx1 = jnp.asarray([[int(ids_BxL[0, 6])], [int(ids_BxL[1, 4])]])
    step_Bx1xV, cache = decode(model, next_Bx1, cache)
    assert_close(step_Bx1xV[0, 0], full_BxLxV[0, 6], **settings)
    assert_close(step_Bx1xV[1, 0], full_BxLxV[1, 4], **settings)
    assert int(cache.index) == padded_BxP.shape[1] + 1


@pytest.mark.slow
def test_greedy_with_the_cache_equals_recomputing_the_prefix(model, prompts):
    settings = GenerationSettings(max_new_tokens=16, greedy=True)
    batched = generate_ids(model, prompts, settings, eos_token_id=None)
    expected = [greedy_by_recomputing(model, p, 16, CONFIG.max_positions) for p in prompts]
    assert batched == expected
    assert len({tuple(row) for row in batched}) == len(prompts)  # the rows really differ
    alone = [generate_ids(model, [p], settings, eos_token_id=None)[0] for p in prompts[:2]]
    assert alone == expected[:2]


@pytest.mark.slow
def test_each_row_stops_at_its_own_eos(model, prompts):
    settings = GenerationSettings(max_new_tokens=16, greedy=True)
    free = generate_ids(model, prompts, settings, eos_token_id=None)
    eos = free[0][3]  # row 0 emits this token 4th: it must stop there
    stopped = generate_ids(model, prompts, settings, eos_token_id=eos)
    assert stopped[0] == free[0][: free[0].index(eos)]
    for row_free, row_stopped in zip(free, stopped):
        assert row_stopped == (row_free[: row_free.index(eos)] if eos in row_free else row_free)
    assert stopped == [greedy_by_recomputing(model, p, 16, CONFIG.max_positions, eos=eos)
                       for p in prompts]


@pytest.mark.slow
def test_sampling_settings(model, prompts):
    def run(**kwargs):
        return generate_ids(model, prompts, GenerationSettings(max_new_tokens=12, **kwargs),
                            eos_token_id=None)

    greedy = run(greedy=True)
    assert run(temperature=0.0) == greedy
    assert run(seed=3) == run(seed=3)
    assert run(seed=3) != run(seed=4)
    assert run(top_k=1, seed=3) == greedy
    assert run(top_p=1e-6, seed=3) == greedy
    assert run(temperature=0.7, seed=3) != run(temperature=1.5, seed=3)
    assert run(top_k=2, top_p=0.5, temperature=0.01, seed=3) == greedy  # cuts compose


@pytest.mark.slow
def test_top_k_and_top_p_keep_only_the_likeliest_tokens():
    import jax

    from flaxlm.generate import sample

    logits_BxV = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.key(0)
    top_k = np.asarray(sample(logits_BxV, keys, 1.0, 2, 1.0))
    assert set(top_k.tolist()) == {0, 1}
    top_p = np.asarray(sample(logits_BxV, keys, 1.0, 0, 0.7))  # 0.5 + 0.3 reaches 0.7
    assert set(top_p.tolist()) == {0, 1}
    assert abs((top_p == 0).mean() - 0.5 / 0.8) < 0.05
    everything = np.asarray(sample(logits_BxV, keys, 1.0, 0, 1.0))
    assert set(everything.tolist()) == {0, 1, 2, 3}


def test_errors_name_the_setting(model):
    with pytest.raises(FlaxlmError, match="max_new_tokens=60 exceeds"):
        generate_ids(model, [[1] * 10], GenerationSettings(max_new_tokens=60), eos_token_id=None)
    with pytest.raises(FlaxlmError, match="top_p=0"):
        GenerationSettings(top_p=0.0)
    with pytest.raises(FlaxlmError, match="max_new_tokens=0"):
        GenerationSettings(max_new_tokens=0)


@pytest.mark.slow
def test_text_generation_with_a_tokenizer(model):
    tokenizer = make_tokenizer(vocab_size=97)
    settings = GenerationSettings(max_new_tokens=8, seed=1)
    texts = generate(model, tokenizer, ["the cat", "", "a much longer prompt on the mat"], settings)
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
    assert texts == generate(model, tokenizer, ["the cat", "", "a much longer prompt on the mat"],
                             settings)


@pytest.mark.slow
@pytest.mark.torch
def test_greedy_equals_transformers_generate_on_the_export(model, prompts, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    from flaxlm.export import export_hf

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = export_hf(str(tmp_path / "hf"), params, CONFIG, make_tokenizer(vocab_size=97))
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    settings = GenerationSettings(max_new_tokens=16, greedy=True)
    ours = generate_ids(model, prompts, settings, eos_token_id=EOS)
    for prompt, our_tokens in zip(prompts, ours):
        with torch.no_grad():
            theirs = torch_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=16, eos_token_id=EOS, pad_token_id=1,
            )[0, len(prompt):].tolist()
        assert our_tokens == (theirs[: theirs.index(EOS)] if EOS in theirs else theirs)


@pytest.mark.slow
def test_larger_prompt_buckets_change_nothing(model, prompts):
    """Padding to a longer bucket (more left padding) gives the same tokens."""
    import flaxlm.generate as gen

    settings = GenerationSettings(max_new_tokens=8, greedy=True)
    expected = generate_ids(model, prompts, settings, eos_token_id=None)
    original = gen.MIN_PROMPT_BUCKET
    gen.MIN_PROMPT_BUCKET = 64
    try:
        assert generate_ids(model, prompts, settings, eos_token_id=None) == expected
    finally:
        gen.MIN_PROMPT_BUCKET = original

