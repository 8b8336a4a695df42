"""The conversations of `task=sft`, loaded and checked.

A conversation is a list of turns `{"role": ..., "content": ...}`, roles among `ROLES`, at
least one of them the assistant's (the turns the model learns to write). The data come from
local JSON lines / parquet files (task.files, task.eval_files), a Hub dataset (task.hub_path),
or the drills generated in code (task.drills, data/drills.py). A row holds a conversation in
task.messages_column (HF chat datasets, such as UltraChat's `messages`) or, when the data has
no such column, one user turn in task.prompt_column and the reply in task.response_column.
The held-out conversations are task.eval_files, the Hub's task.hub_eval_split, or (neither
given) the last task.eval_fraction of the training rows.
"""

from __future__ import annotations

import dataclasses
import math

from flaxlm.config import TaskConfig
from flaxlm.data.datasets_cache import keep_datasets_cache_under
from flaxlm.data.drills import drill_conversations
from flaxlm.data.examples import read_data_file
from flaxlm.data.files import expand_patterns, root_cause
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module

datasets = lazy_module("datasets")

ROLES = ("system", "user", "assistant")
Conversation = list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class Conversations:
    train: list[Conversation]
    eval: list[Conversation]
    origin: str  # where the training conversations came from, for the banner


def load_conversations(task: TaskConfig, cache_dir: str | None = None) -> Conversations:
    """Both splits of the conversations `task` names, every turn checked (`check_turns`);
    copies of files in a bucket are kept in `cache_dir`, and what `datasets` builds."""
    keep_datasets_cache_under(cache_dir)
    if task.drills > 0:
        rows = drill_conversations(task.drills, seed=0)
        train, evaluation = hold_out(rows, task.eval_fraction, "task.eval_fraction")
        return Conversations(train, evaluation, f"{task.drills} generated drills")
    if task.files:
        train = _from_files(task.files, "task.files", task, cache_dir)
        if task.eval_files:
            return Conversations(train,
                                 _from_files(task.eval_files, "task.eval_files", task, cache_dir),
                                 "task.files")
        train, evaluation = hold_out(train, task.eval_fraction, "task.files")
        return Conversations(train, evaluation, "task.files")
    if task.hub_path:
        train = _from_hub(task, task.hub_split)
        if task.hub_eval_split:
            return Conversations(train, _from_hub(task, task.hub_eval_split),
                                 f"{task.hub_path} split {task.hub_split}")
        train, evaluation = hold_out(train, task.eval_fraction, "task.hub_path")
        return Conversations(train, evaluation, f"{task.hub_path} split {task.hub_split}")
    raise FlaxlmError(
        "task=sft needs conversations: set task.files=[chats.jsonl] (JSON lines or parquet "
        "with a `messages` column of {role, content} turns, or `prompt` and `response` "
        "columns), task.hub_path to a Hub chat dataset (e.g. "
        "task.hub_path=HuggingFaceH4/ultrachat_200k task.hub_split=train_sft "
        "task.hub_eval_split=test_sft), or task.drills=2000 for generated offline drills."
    )


def hold_out(rows: list, fraction: float, setting: str, noun: str = "conversation"):
    """The last `fraction` of `rows` (at least one) held out for evaluation, and the rest;
    `noun` names a row in the messages (conversations, preference pairs)."""
    if not 0 < fraction < 1:
        raise FlaxlmError(f"task.eval_fraction={fraction} must be between 0 and 1 (exclusive).")
    if len(rows) < 2:
        raise FlaxlmError(
            f"{setting} holds {len(rows)} {noun}(s): with no eval files or eval split, "
            "task.eval_fraction of them are held out for evaluation, which needs at least two. "
            f"Add {noun}s, or give task.eval_files.")
    held = max(1, math.floor(len(rows) * fraction))
    return rows[:-held], rows[-held:]


def rows_from_files(patterns: list[str], setting: str, rows_of, cache_dir: str | None) -> list:
    """`rows_of(table, where)` of every file `patterns` (the setting `setting`) names."""
    rows: list = []
    for path in expand_patterns(patterns, setting, cache_dir):
        rows += rows_of(read_data_file(path, setting), repr(str(path)))
    return rows


def hub_table(task: TaskConfig, split: str, example: str) -> tuple[datasets.Dataset, str]:
    """The Hub dataset task.hub_path's `split`, and how messages name it; `example`: a
    dataset of the right kind and its split names, for the error when it does not load."""
    where = f"task.hub_path={task.hub_path!r} (task.hub_config={task.hub_config!r}) split {split!r}"
    try:
        table = datasets.load_dataset(task.hub_path, task.hub_config, split=split)
    except Exception as err:  # not found, offline, unknown config or split, bad files
        raise FlaxlmError(
            f"Could not load {where}: {root_cause(err)}. Check the dataset, config and split "
            f"names ({example}), and that this machine can reach the Hub or, with "
            "HF_HUB_OFFLINE=1, has the dataset in its cache; or use local files "
            "(task.files)."
        ) from err
    return table, where


def _from_files(patterns: list[str], setting: str, task: TaskConfig, cache_dir: str | None
                ) -> list[Conversation]:
    return rows_from_files(patterns, setting,
                           lambda table, where: conversations_of(table, task, where), cache_dir)


def _from_hub(task: TaskConfig, split: str) -> list[Conversation]:
    table, where = hub_table(task, split, "UltraChat: task.hub_path="
                             "HuggingFaceH4/ultrachat_200k, splits train_sft and test_sft")
    return conversations_of(table, task, where)


def conversations_of(table: datasets.Dataset, task: TaskConfig, where: str) -> list[Conversation]:
    """The rows of `table` as checked conversations (`turns_reader`)."""
    turns_of = turns_reader(task, table.column_names, where)
    return [turns_of(row, f"{where}, row {index + 1}") for index, row in enumerate(table)]


def turns_reader(task: TaskConfig, columns: list[str], where: str):
    """`turns_of(row, row_where)`: a row's checked conversation, from its
    task.messages_column, or from a user turn in task.prompt_column and an assistant turn in
    task.response_column; which, the data's `columns` say."""
    if task.messages_column in columns:
        def turns_of(row: dict, row_where: str) -> Conversation:
            turns = [{"role": turn.get("role"), "content": turn.get("content")}
                     for turn in (row[task.messages_column] or [])]
            check_turns(turns, row_where)
            return turns
        return turns_of
    if task.prompt_column in columns and task.response_column in columns:
        def turns_of(row: dict, row_where: str) -> Conversation:
            turns = [{"role": "user", "content": row[task.prompt_column]},
                     {"role": "assistant", "content": row[task.response_column]}]
            check_turns(turns, row_where)
            return turns
        return turns_of
    raise FlaxlmError(
        f"{where} has neither task.messages_column={task.messages_column!r} nor both "
        f"task.prompt_column={task.prompt_column!r} and "
        f"task.response_column={task.response_column!r}; its columns are {columns}. Set "
        "task.messages_column to the column of [{role, content}] turns, or "
        "task.prompt_column and task.response_column to the columns of one exchange."
    )


def open_conversation_stream(task: TaskConfig, cache_dir: str | None = None):
    """task.streaming: the held-out conversations (task.eval_files or task.hub_eval_split,
    read whole), the training split as a stream, and its rows' `turns_of`; what `datasets`
    keeps, under `cache_dir`."""
    keep_datasets_cache_under(cache_dir)
    if not (task.eval_files or (task.hub_path and task.hub_eval_split)):
        raise FlaxlmError(
            "task.streaming=true reads the held-out conversations from task.eval_files or "
            "task.hub_eval_split (a stream has no end to hold out from). Set one of them.")
    if task.files:
        paths = expand_patterns(task.files, "task.files", cache_dir)
        builders = {_STREAM_BUILDERS.get(path.suffix.lower()) for path in paths}
        if None in builders or len(builders) > 1:
            raise FlaxlmError(
                f"task.streaming=true streams JSON lines or parquet files of one kind; "
                f"task.files={list(task.files)} holds {sorted(p.suffix for p in paths)}. "
                "Convert them, or set task.streaming=false.")
        stream = datasets.load_dataset(builders.pop(), data_files=[str(p) for p in paths],
                                       split="train", streaming=True)
        evaluation = _from_files(task.eval_files, "task.eval_files", task, cache_dir)
        where = "task.files"
    else:
        where = f"task.hub_path={task.hub_path!r} split {task.hub_split!r} (streamed)"
        try:
            stream = datasets.load_dataset(task.hub_path, task.hub_config,
                                           split=task.hub_split, streaming=True)
        except Exception as err:  # not found, offline, unknown config or split
            raise FlaxlmError(f"Could not stream {where}: {root_cause(err)}. Check the "
                              "dataset, config and split names, and that the Hub is "
                              "reachable.") from err
        evaluation = (_from_files(task.eval_files, "task.eval_files", task, cache_dir)
                      if task.eval_files else _from_hub(task, task.hub_eval_split))
    first = next(iter(stream), None)
    if first is None:
        raise FlaxlmError(f"{where} holds no conversation. Add some, or point to other data.")
    return evaluation, stream, turns_reader(task, list(first), where)


_STREAM_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def check_turns(turns: Conversation, where: str) -> None:
    """Every turn a known role with text, and at least one assistant turn to learn from."""
    for turn in turns:
        if turn["role"] not in ROLES:
            raise FlaxlmError(
                f"{where}: a turn has the role {turn['role']!r}; task=sft knows the roles "
                f"{', '.join(ROLES)}. Rename the role in the data (e.g. 'human' → 'user', "
                "'gpt' → 'assistant'), or remove the row."
            )
        if not isinstance(turn["content"], str):
            raise FlaxlmError(
                f"{where}: a {turn['role']} turn's content is {turn['content']!r}, not text. "
                "Give every turn a string `content` (\"\" for an empty one), or remove the row."
            )
    if not any(turn["role"] == "assistant" for turn in turns):
        raise FlaxlmError(
            f"{where}: the conversation has no assistant turn, so there is nothing to learn "
            "from it (the loss is taken on assistant tokens only). Add the assistant's reply, "
            "or remove the row."
        )
