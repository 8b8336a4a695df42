"""Text generation with a language model's KV cache: prefill the prompts once, then one token per
step inside a single jitted `lax.while_loop`.

Prompts of different lengths are left-padded into one batch (right-aligned), so every row's
next token lands in the same cache slot; the cache's `filled` mask keeps the padding out of
attention and out of the position ids, so a padded row generates what it would alone. Prompt
lengths are rounded up to a few buckets, so a new prompt rarely compiles anything: the loop
compiles once per (batch size, prompt bucket, max_new_tokens, greedy or top_k).

    from flaxlm.generate import GenerationSettings, generate
    texts = generate(model, tokenizer, ["Return the", "A list is"],
                     GenerationSettings(max_new_tokens=40, temperature=0.8, top_k=50))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from flaxlm.data.chat_template import chat_prompt_ids, stop_token_ids
from flaxlm.data.tokenizer import prompt_tokenizer
from flaxlm.errors import FlaxlmError
from flaxlm.models.layers import KVCache
from flaxlm.tool_defaults import GenerationSettings
from flaxlm.training.keys import seed_key

MIN_PROMPT_BUCKET = 16


class LanguageModel(Protocol):
    """What generation needs of a model; every family's LM (GPT2LMHeadModel, LlamaForCausalLM)
    has it."""

    context_length: int  # the most positions a sequence may have (model.max_positions)

    def init_cache(self, batch_size: int, num_slots: int) -> KVCache: ...

    def decode(self, input_ids_BxL: jax.Array, cache: KVCache,
               input_mask_BxL: jax.Array | None = None,
               branches_BxL: jax.Array | None = None) -> tuple[jax.Array, KVCache]: ...

    def decode_hidden_states(self, input_ids_BxL: jax.Array, cache: KVCache,
                             input_mask_BxL: jax.Array | None = None,
                             branches_BxL: jax.Array | None = None
                             ) -> tuple[jax.Array, KVCache]: ...

    def lm_head_logits(self, x_BxLxD: jax.Array) -> jax.Array: ...


def generate(model: LanguageModel, tokenizer, prompts: Sequence[str],
             settings: GenerationSettings, *, own_conventions: bool = False) -> list[str]:
    """Completions of `prompts` (the new text only, up to and without the first EOS).

    Each prompt is read as the start of a document (`encode_prompts`).
    """
    prompt_ids = encode_prompts(tokenizer, prompts, own_conventions=own_conventions)
    new_ids = generate_ids(model, prompt_ids, settings, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in new_ids]


def generate_chat(model: LanguageModel, tokenizer, prompts: Sequence[str],
                  settings: GenerationSettings) -> list[str]:
    """The model's replies to `prompts`, each a user's turn rendered by the tokenizer's chat
    template with the generation prompt after it; a reply ends at the template's end of turn
    or at EOS (`chat_template.stop_token_ids`). What transformers' `apply_chat_template(...,
    add_generation_prompt=True)` and `generate` give with the exported model."""
    new_ids = generate_ids(model, encode_prompts(tokenizer, prompts, chat=True), settings,
                           eos_token_id=stop_token_ids(tokenizer),
                           pad_token_id=tokenizer.pad_token_id)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in new_ids]


def encode_prompts(tokenizer, prompts: Sequence[str], *,
                   own_conventions: bool = False, chat: bool = False) -> list[list[int]]:
    """The ids of each prompt read as the start of a document: after the EOS token that
    separates documents in the packed training stream (`with_document_start`), or, for a model
    that keeps its tokenizer's own conventions (a model from someone else's weights), as the
    tokenizer encodes it (its BOS, if it adds one). The exported tokenizer encodes a prompt the
    same way. An empty prompt that gets no token starts from BOS (else EOS), as transformers'
    `generate` does without input ids. With `chat`, each prompt is a user's turn in the
    tokenizer's chat template, followed by its generation prompt (`chat_prompt_ids`)."""
    if chat:
        return [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
    encoder = prompt_tokenizer(tokenizer, own_conventions)
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    empty = [start] if start is not None else []
    return [encoder(prompt)["input_ids"] or empty for prompt in prompts]


def generate_ids(model: LanguageModel, prompt_ids: Sequence[Sequence[int]],
                 settings: GenerationSettings, *, eos_token_id: int | Sequence[int] | None,
                 pad_token_id: int | None = None) -> list[list[int]]:
    """New token ids for each prompt (a list of ids, at least one), up to and without the first
    `eos_token_id` (or the first of several: a chat model stops at the end of its turn or at
    EOS, as transformers does with a list), at most `settings.max_new_tokens`."""
    check_prompts(settings, prompt_ids, model.context_length)
    pad = pad_token_id if pad_token_id is not None else 0
    ids_BxP, mask_BxP = left_pad(prompt_ids, pad)
    eos = ((-1,) if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int)
           else tuple(eos_token_id))
    graphdef, params = nnx.split(model)
    tokens_BxT = _generate_tokens(
        # Host values as they are: each `jnp` conversion or `jax.random.key` here would
        # compile a program of its own beside the generation's.
        graphdef, params, ids_BxP, mask_BxP,
        seed_key(settings.seed), np.float32(max(settings.temperature, 1e-6)),
        np.float32(settings.top_p), max_new_tokens=settings.max_new_tokens,
        greedy=settings.is_greedy, top_k=settings.top_k,
        stop_ids=eos, pad_token_id=pad,
    )
    return [_until_eos(row, eos) for row in np.asarray(tokens_BxT).tolist()]


def check_prompts(settings: GenerationSettings, prompt_ids: Sequence[Sequence[int]],
                   max_positions: int) -> None:
    if not prompt_ids or any(len(ids) == 0 for ids in prompt_ids):
        raise FlaxlmError("Generation needs at least one prompt, each of at least one token.")
    longest = max(len(ids) for ids in prompt_ids)
    if longest + settings.max_new_tokens > max_positions:
        raise FlaxlmError(
            f"The longest prompt ({longest} tokens) plus max_new_tokens="
            f"{settings.max_new_tokens} exceeds the model's context of {max_positions} positions "
            "(model.max_positions). Shorten the prompt or lower max_new_tokens."
        )


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_token_id: int):
    """Prompts right-aligned in a (B, P) array, P rounded up to a bucket, and their mask."""
    P = prompt_bucket(max(len(ids) for ids in prompt_ids))
    ids_BxP = np.full((len(prompt_ids), P), pad_token_id, np.int32)
    mask_BxP = np.zeros((len(prompt_ids), P), bool)
    for row, ids in enumerate(prompt_ids):
        ids_BxP[row, P - len(ids):] = ids
        mask_BxP[row, P - len(ids):] = True
    return ids_BxP, mask_BxP


def prompt_bucket(length: int) -> int:
    """The next power of two (at least MIN_PROMPT_BUCKET): few shapes, at most 2× padding."""
    return max(MIN_PROMPT_BUCKET, 1 << (length - 1).bit_length())


@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy", "top_k", "stop_ids",
                              "pad_token_id")
)
def _generate_tokens(graphdef, params, ids_BxP, mask_BxP, key, temperature, top_p, *,
                     max_new_tokens: int, greedy: bool, top_k: int, stop_ids: tuple[int, ...],
                     pad_token_id: int):
    """(B, max_new_tokens) new tokens; after a row's first of `stop_ids` (its EOS),
    `pad_token_id`. The loop stops early once every row has emitted one."""
    model = nnx.merge(graphdef, params)
    B, P = ids_BxP.shape
    T = max_new_tokens

    def pick(logits_BxV, step):
        if greedy:
            return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        return sample(logits_BxV, jax.random.fold_in(key, step), temperature, top_k, top_p)

    cache = model.init_cache(B, P + T)
    logits_BxPxV, cache = model.decode(ids_BxP, cache, mask_BxP)
    tokens_BxT = jnp.full((B, T), pad_token_id, jnp.int32)

    def keep_going(carry):
        step, _, done_B, _, _ = carry
        return (step < T) & ~jnp.all(done_B)

    def one_token(carry):
        step, token_B, done_B, tokens_BxT, cache = carry
        token_B = jnp.where(done_B, pad_token_id, token_B)
        tokens_BxT = tokens_BxT.at[:, step].set(token_B)
        done_B = done_B | jnp.isin(token_B, jnp.asarray(stop_ids))
        # After the last token this decode is wasted, but skipping it under a `cond` would
        # trace the model twice; the cache has a slot for it.
        logits_Bx1xV, cache = model.decode(token_B[:, None], cache)
        return step + 1, pick(logits_Bx1xV[:, 0], step + 1), done_B, tokens_BxT, cache

    first_B = pick(logits_BxPxV[:, -1], 0)  # right-aligned: the last slot is every row's last token
    carry = (jnp.int32(0), first_B, jnp.zeros(B, bool), tokens_BxT, cache)
    return lax.while_loop(keep_going, one_token, carry)[3]


def sample(logits_BxV: jax.Array, key: jax.Array, temperature, top_k: int,
           top_p) -> jax.Array:
    """One token per row from softmax(logits / temperature), cut to the `top_k` likeliest
    tokens, then to the fewest whose probability reaches `top_p` (the order transformers
    applies them in; the token that crosses top_p is kept, so the likeliest always is).

    `top_k` is a Python int (0: no cut), fixed per compiled program: `lax.top_k` then finds
    the candidates without sorting the whole vocabulary, which dominates a sampling step
    otherwise; only top_k 0 sorts everything. Ties at a cut-off are broken by token id."""
    logits_BxV = logits_BxV.astype(jnp.float32) / temperature
    V = logits_BxV.shape[-1]
    K = top_k if 0 < top_k < V else V
    candidates_BxK, ids_BxK = lax.top_k(logits_BxV, K)  # descending
    probs_BxK = jax.nn.softmax(candidates_BxK, axis=-1)
    before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK  # probability of the likelier ones
    kept_BxK = jnp.where(before_BxK < top_p, candidates_BxK, -jnp.inf)
    choice_B = jax.random.categorical(key, kept_BxK)
    return jnp.take_along_axis(ids_BxK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _until_eos(tokens: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    ends = [index for index, token in enumerate(tokens) if token in stop_ids]
    return tokens[: ends[0]] if ends else tokens


def settings_from_samples(samples) -> GenerationSettings:
    """The `samples` config group (flaxlm.config.SamplesConfig) as GenerationSettings; built
    when a run starts, so a bad setting fails before training rather than after it."""
    return GenerationSettings(
        max_new_tokens=samples.max_new_tokens, temperature=samples.temperature,
        top_k=samples.top_k, top_p=samples.top_p, seed=samples.seed,
    )


def log_samples(model: LanguageModel, tokenizer, prompts: Sequence[str],
                settings: GenerationSettings, tracker, step: int, *,
                own_conventions: bool = False, chat: bool = False) -> list[str]:
    """End-of-run samples: printed, and logged through `tracker` as table `samples` (prompt,
    completion). max_new_tokens is cut to what the context leaves, so a run never fails here.
    With `chat` each prompt is a user's turn and the completion the model's reply
    (`generate_chat`)."""
    if not prompts:
        return []
    longest = max(len(ids) for ids in encode_prompts(tokenizer, prompts, chat=chat,
                                                     own_conventions=own_conventions))
    room = model.context_length - longest
    if room < 1:
        print("flaxlm: no samples: the longest sample prompt fills the whole context")
        return []
    settings = dataclasses.replace(settings, max_new_tokens=min(settings.max_new_tokens, room))
    completions = (generate_chat(model, tokenizer, prompts, settings) if chat else
                   generate(model, tokenizer, prompts, settings, own_conventions=own_conventions))
    for prompt, completion in zip(prompts, completions):
        said = f"user: {prompt} | assistant: {completion}" if chat else f"{prompt}{completion}"
        print(f"flaxlm: sample | {said}".replace("\n", "⏎ "))
    tracker.log_table("samples", ["prompt", "completion"],
                      [[p, c] for p, c in zip(prompts, completions)], step=step)
    return completions
