"""task=sft: conversations read and checked, rendered by a chat template with a mask on the
assistant's tokens, laid out in rows (packed or padded), scored only on those tokens in
training and evaluation; one end-to-end run through flaxlm-train, replies in chat mode from
flaxlm-generate --chat and, with torch, from transformers on the exported model."""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    TINY,
    TOKENIZER_TEXT,
    config_node,
    in_memory_dataset,
    make_tokenizer,
    trained_run,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import approx

from flaxlm.config import LongConversations
from flaxlm.data.chat import conversations_of, turns_reader
from flaxlm.data.chat_packing import encode_conversations, layout_rows
from flaxlm.data.chat_template import (
    CHATML_TEMPLATE,
    IM_END,
    encode_chat,
    stop_token_ids,
    with_chat_template,
)
from flaxlm.data.documents import INPUT_IDS, POSITIONS, SEGMENT_IDS, TARGET_MASK
from flaxlm.data.drills import drill_conversations
from flaxlm.data.tables import text_dataset
from flaxlm.errors import FlaxlmError
from flaxlm.training import step
from flaxlm.training.step import eval_step, lm_objective

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "sat on the mat"},
        {"role": "user", "content": "the dog"},
        {"role": "assistant", "content": "ate the cat"}]


def byte_tokenizer():
    """A byte-level BPE with every byte in its alphabet (as flaxlm trains them; conftest's
    make_tokenizer has only the letters of its text, and no newline)."""
    import tokenizers
    import transformers

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    model.train_from_iterator(TOKENIZER_TEXT, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
        unk_token="<unk>", mask_token="<mask>")


@pytest.fixture(scope="module")
def chat_tokenizer():
    return with_chat_template(byte_tokenizer(), None, vocab_size=512)


def task_config(**changes):
    return config_node("task", ["task=sft", "task.drills=10"], **changes)


# --- the template and the mask -------------------------------------------------------------------


def test_chatml_targets_are_each_reply_and_its_end_of_turn_and_nothing_else(chat_tokenizer):
    ids, mask = encode_chat(chat_tokenizer, CHAT, "test")
    # The ids are what transformers' apply_chat_template gives the exported tokenizer.
    assert ids.tolist() == chat_tokenizer.apply_chat_template(CHAT, tokenize=True,
                                                              return_dict=True)["input_ids"]
    targets = chat_tokenizer.decode(ids[mask])
    assert targets == f"sat on the mat{IM_END}\nate the cat{IM_END}\n"
    prompt = chat_tokenizer.decode(ids[~mask])
    assert "Be brief." in prompt and "the dog" in prompt and "<|im_start|>assistant\n" in prompt
    assert stop_token_ids(chat_tokenizer)[0] == chat_tokenizer.convert_tokens_to_ids(IM_END)


def test_a_template_that_does_not_render_or_rewrites_earlier_turns_is_refused(chat_tokenizer):
    with pytest.raises(FlaxlmError, match="task.chat_template does not render"):
        with_chat_template(make_tokenizer(), "{% for message in messages %}{{ message.role ",
                           vocab_size=512)
    # Renders only the last turn: the conversation's start is not the start of its text.
    last_only = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    rewriting = with_chat_template(make_tokenizer(), last_only, vocab_size=512)
    with pytest.raises(FlaxlmError, match="rewrites earlier turns"):
        encode_chat(rewriting, CHAT, "chats.jsonl, conversation 1")


def test_chatml_markers_that_do_not_fit_the_models_vocabulary_are_refused():
    tokenizer = make_tokenizer()
    with pytest.raises(FlaxlmError, match=f"model.vocab_size={len(tokenizer)} embeddings"):
        with_chat_template(tokenizer, None, vocab_size=len(tokenizer))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_changing_the_non_target_tokens_targets_changes_neither_loss(seed):
    """A model whose logits do not depend on its input: the loss then depends on the labels
    only, and changing every label whose token is not a target (a user's, the template's)
    changes neither the training loss nor the eval sums; changing one target's label does."""
    rng = np.random.default_rng(seed)
    B, L, V = 3, 9, 7
    logits_BxLxV = jnp.asarray(rng.normal(size=(B, L, V)), jnp.float32)
    model = lambda inputs_BxL, rngs=None, **documents: logits_BxLxV  # noqa: E731
    mask_BxL = rng.random((B, L)) < 0.4
    mask_BxL[0, 3] = True  # at least one target with a position before it
    inputs_BxL = rng.integers(0, V, (B, L)).astype(np.int32)
    changed_BxL = np.where(mask_BxL, inputs_BxL, rng.integers(0, V, (B, L))).astype(np.int32)

    def batch(inputs):
        return {INPUT_IDS: jnp.asarray(inputs), SEGMENT_IDS: jnp.zeros((B, L), jnp.int32),
                POSITIONS: jnp.tile(jnp.arange(L), (B, 1)), TARGET_MASK: jnp.asarray(mask_BxL)}

    def losses(inputs):
        loss = lm_objective(model, batch(inputs), None)[0]
        sums = eval_step_of(model, batch(inputs))
        return float(loss), float(sums["loss_sum"]), float(sums["tokens"])

    before = losses(inputs_BxL)
    # Means and sums of up to B × L log-sum-exps over V.
    settings = dict(terms=B * L, depth=2)
    assert losses(changed_BxL) == approx(before, **settings)
    # Token-weighted: the mean over the targets that have a position before them.
    assert before[2] == mask_BxL[:, 1:].sum()
    assert before[0] == approx(before[1] / before[2], **settings)
    flipped = inputs_BxL.copy()
    flipped[0, 3] = (flipped[0, 3] + 1) % V
    assert losses(flipped)[0] != approx(before[0], **settings)


def eval_step_of(model, batch):
    """The eval step's sums for a stand-in model: the step merges its model from a graphdef
    and parameters, which a plain function has none of."""
    with mock.patch.object(step.nnx, "merge", lambda graphdef, params: model):
        B = batch[INPUT_IDS].shape[0]
        return eval_step(None, batch, jnp.ones(B), jnp.ones(7), graphdef=None)


# --- conversations and rows ----------------------------------------------------------------------


def test_conversations_come_from_messages_or_from_prompt_and_response_columns():
    task = task_config()
    messages = in_memory_dataset({"messages": [CHAT], "id": [1]})
    assert conversations_of(messages, task, "a") == [CHAT]
    pairs = in_memory_dataset({"q": ["hi"], "a": ["hello"]})
    task = task_config(prompt_column="q", response_column="a")
    assert conversations_of(pairs, task, "b") == [[{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello"}]]
    with pytest.raises(FlaxlmError, match="task.messages_column='messages'.*columns are"):
        conversations_of(text_dataset(["x"]), task, "c.jsonl")


def test_a_hub_dataset_gives_its_train_and_eval_splits_and_a_split_to_hold_out_from(tmp_path):
    """A local directory laid out like a Hub dataset stands in for one (the Hub is offline)."""
    from flaxlm.data.chat import load_conversations

    hub = tmp_path / "hub"
    hub.mkdir()
    write_chats(hub / "train.jsonl", 20, seed=1)
    write_chats(hub / "test.jsonl", 3, seed=2)
    task = task_config(drills=0, hub_path=str(hub), hub_split="train", hub_eval_split="test")
    loaded = load_conversations(task)
    assert (loaded.train, loaded.eval) == (drill_conversations(20, 1), drill_conversations(3, 2))
    held = load_conversations(dataclasses.replace(task, hub_eval_split=None))
    assert (len(held.train), held.eval) == (19, drill_conversations(20, 1)[19:])


@pytest.mark.parametrize(("turns", "message"), [
    ([{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}],
     "role 'human'"),
    ([{"role": "user", "content": "hi"}], "no assistant turn"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "not text"),
])
def test_a_bad_conversation_is_refused_naming_its_file_and_row(turns, message):
    table = in_memory_dataset([{"messages": CHAT}, {"messages": turns}])
    with pytest.raises(FlaxlmError, match=f"'chats.jsonl', row 2: .*{message}"):
        conversations_of(table, task_config(), "'chats.jsonl'")


def test_packed_rows_keep_each_conversation_whole_in_a_segment_of_its_own():
    encoded = [(np.arange(1, n + 1, dtype=np.int32), np.arange(n) % 2 == 1) for n in (5, 4, 6, 3)]
    rows = layout_rows(encoded, 10, pad_id=0, pack=True)
    # 5+4 fit one row, 6+3 the next: next fit, in order.
    assert rows[INPUT_IDS].tolist() == [[1, 2, 3, 4, 5, 1, 2, 3, 4, 0],
                                        [1, 2, 3, 4, 5, 6, 1, 2, 3, 0]]
    assert rows[SEGMENT_IDS].tolist() == [[0] * 5 + [1] * 4 + [2], [0] * 6 + [1] * 3 + [2]]
    assert rows[POSITIONS][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
    assert not rows[TARGET_MASK][:, -1].any()  # padding is never a target
    assert rows[TARGET_MASK].sum() == sum(mask.sum() for _, mask in encoded)
    padded = layout_rows(encoded, 10, pad_id=0, pack=False)
    assert len(padded[INPUT_IDS]) == 4 and padded[SEGMENT_IDS][0].tolist() == [0] * 5 + [1] * 5


@pytest.mark.parametrize(("policy", "counts"), [(LongConversations.truncate, (4, 2, 0)),
                                                (LongConversations.drop, (2, 0, 2))])
def test_long_conversations_are_truncated_or_dropped_and_counted(chat_tokenizer, policy, counts):
    short = [{"role": "user", "content": "cat"}, {"role": "assistant", "content": "mat"}]
    long = [{"role": "user", "content": "the cat"},
            {"role": "assistant", "content": "the dog ate the cat on the mat " * 4}]
    length = len(encode_chat(chat_tokenizer, short, "t")[0])
    rows = encode_conversations(chat_tokenizer, [short, long, short, long], length + 4, policy,
                                "t", pad_id=0, pack=False)
    assert (rows.conversations, rows.truncated, rows.dropped) == counts
    assert f"task.long_conversations={policy.value}" in rows.describe("train", policy)


def test_a_streamed_shard_gives_the_materialised_rows_and_resumes_at_a_row(chat_tokenizer):
    from flaxlm.data.chat_stream import ChatStreamLoader
    from flaxlm.parallel import make_mesh

    conversations = drill_conversations(12, seed=4)
    stream = in_memory_dataset([{"messages": turns} for turns in conversations]
                                        ).to_iterable_dataset()
    task = task_config()
    turns_of = turns_reader(task, ["messages"], "stream")
    mesh = make_mesh(2)

    def loader():
        return ChatStreamLoader(stream, turns_of, chat_tokenizer, 128, task.long_conversations,
                                0, True, 2, mesh, max_steps=12)

    whole = encode_conversations(chat_tokenizer, conversations, 128, task.long_conversations,
                                 "t", pad_id=0, pack=True)
    streamed = loader()
    batches = [jax.device_get(batch) for batch in streamed.epoch(0)]
    ids = np.concatenate([batch[INPUT_IDS] for batch in batches])
    # Rows in stream order, as materialised; then a new pass from the shard's start.
    n = len(whole)
    assert whole.conversations > n and 2 * n <= len(ids)  # several conversations a row
    assert (ids[:n] == whole.arrays[INPUT_IDS]).all()
    assert (ids[n : 2 * n] == whole.arrays[INPUT_IDS]).all()

    first = loader()
    next(iter(first.epoch(0)))  # one batch: two rows
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    after = jax.device_get(next(iter(resumed.epoch(0, start_step=1))))
    assert (after[TARGET_MASK] == whole.arrays[TARGET_MASK][2:4]).all()


def test_the_drills_are_deterministic_and_right():
    conversations = drill_conversations(50, seed=3)
    assert conversations == drill_conversations(50, seed=3)
    for turns in conversations:
        for question, answer in zip(turns[::2], turns[1::2]):
            text = question["content"]
            if text.startswith("What is"):
                a, b = (int(x) for x in text.removeprefix("What is ").rstrip("?").split(" + "))
                assert answer["content"] == f"{a} + {b} = {a + b}."
            else:
                letters = text.removeprefix("Reverse: ").split()
                assert answer["content"].split() == letters[::-1]


# --- end to end ----------------------------------------------------------------------------------


def write_chats(path, count: int, seed: int) -> str:
    rows = [{"messages": turns} for turns in drill_conversations(count, seed)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


SFT_RUN = [*TINY, "task=sft", "model=llama-tiny", "model.num_layers=2", "model.hidden_size=64",
           "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_size=128",
           "model.max_positions=64", "task.max_seq_length=64", "trainer.max_steps=3",
           "checkpoint.every_steps=null", "samples.prompts=[What is 2 + 5?]",
           "samples.max_new_tokens=6", "samples.temperature=0"]


def sft_overrides(folder) -> list[str]:
    """task=sft on generated chat files (train and held-out) written into `folder`."""
    train = write_chats(folder / "train.jsonl", 120, seed=1)
    evaluation = write_chats(folder / "eval.jsonl", 10, seed=2)
    return [*SFT_RUN, f"task.files=[{train}]", f"task.eval_files=[{evaluation}]"]


@pytest.mark.slow
def test_flaxlm_train_task_sft_trains_on_a_chat_file_and_exports_its_template(tmp_path,
                                                                              train_cli):
    # With LoRA adapters: an sft run exports the merged model and the PEFT adapter too.
    result = train_cli(*sft_overrides(tmp_path), f"run_dir={tmp_path / 'run'}",
                       "model.lora.rank=4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    banner = next(line for line in result.stdout.splitlines() if "conversations in" in line)
    assert "120 train conversations" in banner and "10 held-out conversations" in banner
    assert "loss on assistant tokens" in banner
    # Replies before and after training.
    assert result.stdout.count("flaxlm: sample | user: What is 2 + 5? | assistant:") == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert any("eval/loss" in record for record in records)
    model_dir = tmp_path / "run" / "model"
    assert "<|im_start|>" in (model_dir / "chat_template.jinja").read_text()
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert len(generation["eos_token_id"]) == 2  # <|im_end|> and EOS
    adapter = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4

    from flaxlm.cli.generate import run as generate_run
    replies = generate_run([str(tmp_path / "run"), "--chat", "--greedy", "--prompt",
                            "What is 2 + 5?", "--max-new-tokens", "6"])
    assert len(replies) == 1 and "<|im_end|>" not in replies[0]


@pytest.mark.slow
@pytest.mark.torch
def test_transformers_answers_as_flaxlm_generate_chat_does(tmp_path_factory):
    """transformers' apply_chat_template(add_generation_prompt=True) + greedy generate on the
    export give the ids flaxlm-generate --chat gives, stopping where it stops."""
    torch = pytest.importorskip("torch")
    import transformers

    from flaxlm.cli.generate import run as generate_run
    from flaxlm.generate import encode_prompts
    from flaxlm.run_model import load_run_model, local_mesh

    folder = tmp_path_factory.mktemp("sft-torch")
    # Trained long enough to answer in the drills' form and end its turn: a fresh model (tied
    # embeddings) repeats the prompt's last token, which would compare nothing.
    run_dir = trained_run(tmp_path_factory, "sft-torch-run",
                          [*sft_overrides(folder), "optimizer.lr=3e-3", "trainer.max_steps=40"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(run_dir / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "model").eval()
    assert tokenizer.chat_template == CHATML_TEMPLATE
    prompts = ["What is 2 + 5?", "Reverse: a b c"]
    ours = generate_run([str(run_dir), "--chat", "--greedy", "--max-new-tokens", "12",
                         *(arg for prompt in prompts for arg in ("--prompt", prompt))])
    our_prompts = encode_prompts(load_run_model(str(run_dir), None, local_mesh()).tokenizer,
                                 prompts, chat=True)
    stops = set(model.generation_config.eos_token_id)
    for prompt, our_prompt, reply in zip(prompts, our_prompts, ours):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
        assert encoded["input_ids"][0].tolist() == our_prompt
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=12, do_sample=False)
        theirs = out[0, encoded["input_ids"].shape[1]:].tolist()
        theirs = theirs[: next((i for i, t in enumerate(theirs) if t in stops), len(theirs))]
        assert tokenizer.decode(theirs, skip_special_tokens=True) == reply
