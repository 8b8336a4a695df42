"""Chat templates: a conversation rendered to text and tokens, with the mask of the tokens the
model learns to write (the assistant's).

The template is task.chat_template, else the tokenizer's own (`chat_template` in
model.init_from's tokenizer_config.json), else flaxlm's default, ChatML:

    <|im_start|>user
    What is 2 + 5?<|im_end|>
    <|im_start|>assistant
    2 + 5 = 7.<|im_end|>

whose markers are special tokens (a BPE flaxlm trains gets them as such; a loaded tokenizer
without them gets them added, within the model's vocabulary). The exported tokenizer keeps the
template, so transformers' `apply_chat_template(..., add_generation_prompt=True)` encodes a
prompt exactly as flaxlm-generate --chat does.

Which tokens are the assistant's is found by rendering prefixes of the conversation: an
assistant turn's text is what rendering up to and including it adds to rendering the turns
before it with the generation prompt (`<|im_start|>assistant\n`). So the reply and the marker
that ends it (the stop token the model must learn to emit) are targets; the prompt, the other
roles' turns and the template's framing are not. This works for any template that renders a
conversation's prefixes as prefixes of its text, which is checked.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flaxlm.errors import FlaxlmError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_MARKERS = (IM_START, IM_END)


def with_chat_template(tokenizer, template: str | None, vocab_size: int):
    """`tokenizer` with its chat template set: `template` (task.chat_template), its own, or
    ChatML, whose markers are added as special tokens if it lacks them (checked to fit the
    model's `vocab_size`)."""
    chosen = template or tokenizer.chat_template or CHATML_TEMPLATE
    tokenizer.chat_template = chosen
    if chosen == CHATML_TEMPLATE:
        missing = [m for m in CHATML_MARKERS if m not in tokenizer.get_vocab()]
        if missing:
            tokenizer.add_special_tokens({"additional_special_tokens": missing})
        if len(tokenizer) > vocab_size:
            raise FlaxlmError(
                f"flaxlm's ChatML template needs the special tokens {', '.join(missing)}, and "
                f"adding them makes the tokenizer {len(tokenizer)} tokens, more than the "
                f"model's model.vocab_size={vocab_size} embeddings. Use a tokenizer with a "
                "chat template of its own (task.chat_template=...), or a model with spare "
                "embeddings."
            )
    render(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
           "task.chat_template" if template else "the tokenizer's chat template")
    return tokenizer


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokens that end a reply, the first the one the template closes a turn with: ChatML's
    <|im_end|> where the template uses it, then the EOS token."""
    ids = []
    if IM_END in (tokenizer.chat_template or "") and IM_END in tokenizer.get_vocab():
        ids.append(tokenizer.convert_tokens_to_ids(IM_END))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def render(tokenizer, turns: Sequence[dict], where: str,
           add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(list(turns), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as err:  # jinja2's TemplateError, and whatever the template raises
        raise FlaxlmError(
            f"{where} does not render a conversation ({type(err).__name__}: {err}). Fix the "
            "Jinja template (it receives `messages`, a list of {role, content}, and "
            "`add_generation_prompt`), or set task.chat_template=null for the tokenizer's own "
            "or flaxlm's ChatML default."
        ) from err


def encode_chat(tokenizer, turns: Sequence[dict], where: str,
                targets_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The conversation's token ids (int32) and target mask (bool, True on the assistant's
    tokens), as `apply_chat_template(turns, tokenize=True)` encodes it. `targets_from`: the
    first turn whose tokens may be targets (task=dpo scores the reply, not a multi-turn
    prompt's earlier assistant turns)."""
    text = render(tokenizer, turns, where)
    spans = []
    for index, turn in enumerate(turns):
        if turn["role"] != "assistant" or index < targets_from:
            continue
        before = render(tokenizer, turns[:index], where, add_generation_prompt=True)
        through = render(tokenizer, turns[: index + 1], where)
        if not (through.startswith(before) and text.startswith(through)):
            raise FlaxlmError(
                f"{where}: the chat template does not render the conversation's beginning as "
                "the beginning of its text (it rewrites earlier turns), so the assistant's "
                "tokens cannot be told apart. Use a template that appends each turn, e.g. "
                "task.chat_template=null for flaxlm's ChatML default."
            )
        spans.append((len(before), len(through)))
    encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    starts = np.array([start for start, _ in encoding.offsets], np.int64)
    mask = np.zeros(len(starts), bool)
    for low, high in spans:
        mask |= (starts >= low) & (starts < high)
    return np.asarray(encoding.ids, np.int32), mask


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A user turn `prompt` with the generation prompt after it, as token ids: what the model
    answers in chat mode."""
    text = render(tokenizer, [{"role": "user", "content": prompt}], "the chat template",
                  add_generation_prompt=True)
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
