"""The preference pairs of `task=dpo` and `task=reward`, loaded, checked and laid out in rows.

A pair is a prompt and two replies to it, the preferred (`chosen`) and the other (`rejected`),
in task.prompt_column, task.chosen_column and task.rejected_column. Each is a string (the
prompt one user turn, a reply one assistant turn) or a list of {role, content} turns; a reply
that repeats the prompt's turns before its own (UltraFeedback's layout) has them removed. The
data come from JSON lines / parquet files (task.files, task.eval_files), a Hub dataset
(task.hub_path), or pairs generated in code (task.drills, data/preference_drills.py); without
eval files or an eval split the last task.eval_fraction of the pairs are held out.

Each pair becomes one row of two sequences, prompt + chosen and prompt + rejected, each with a
target mask on its reply's tokens only: the arrays are (pairs, 2, max_seq_length). A pair with
a sequence longer than a row is cut to it (both sequences) or dropped (task.long_conversations);
one whose two replies are the same is dropped, since it says nothing about which is better and
its loss is a constant log 2. The counts are kept for the banner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from flaxlm.config import LongConversations, TaskConfig
from flaxlm.data.chat import check_turns, hold_out, hub_table, rows_from_files
from flaxlm.data.chat_packing import layout_rows
from flaxlm.data.chat_template import encode_chat
from flaxlm.data.datasets_cache import keep_datasets_cache_under
from flaxlm.data.preference_drills import preference_drills
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module

datasets = lazy_module("datasets")

Turns = list[dict[str, str]]
REFERENCE_LOGPS = "reference_logps"  # (pairs, 2): the reference model's log-probs, once


@dataclasses.dataclass(frozen=True)
class Pair:
    prompt: Turns
    chosen: Turns  # the reply's turns only
    rejected: Turns


@dataclasses.dataclass(frozen=True)
class Preferences:
    train: list[Pair]
    eval: list[Pair]
    origin: str  # for the banner


def load_preferences(task: TaskConfig, cache_dir: str | None = None) -> Preferences:
    """Both splits of the pairs `task` names, every one checked; copies of files in a bucket
    are kept in `cache_dir`, and what `datasets` builds."""
    keep_datasets_cache_under(cache_dir)
    if task.drills > 0:
        drills = [Pair([{"role": "user", "content": prompt}],
                       [{"role": "assistant", "content": chosen}],
                       [{"role": "assistant", "content": rejected}])
                  for prompt, chosen, rejected in preference_drills(task.drills, seed=0)]
        train, held = hold_out(drills, task.eval_fraction, "task.drills", PAIR)
        return Preferences(train, held, f"{task.drills} generated preference pairs")
    if task.files:
        train = _from_files(task.files, "task.files", task, cache_dir)
        if task.eval_files:
            return Preferences(train,
                               _from_files(task.eval_files, "task.eval_files", task, cache_dir),
                               "task.files")
        return Preferences(*hold_out(train, task.eval_fraction, "task.files", PAIR), "task.files")
    if task.hub_path:
        origin = f"{task.hub_path} split {task.hub_split}"
        train = _from_hub(task, task.hub_split)
        if task.hub_eval_split:
            return Preferences(train, _from_hub(task, task.hub_eval_split), origin)
        return Preferences(*hold_out(train, task.eval_fraction, "task.hub_path", PAIR), origin)
    raise FlaxlmError(NO_DATA)


PAIR = "preference pair"  # what messages call a row
NO_DATA = (
    "task=dpo needs preference pairs: set task.files=[pairs.jsonl] (JSON lines or parquet with "
    "`prompt`, `chosen` and `rejected` columns, each a string or a list of {role, content} "
    "turns), task.hub_path to a Hub preference dataset (e.g. experiment=dpo-smollm-ultrafeedback), "
    "or task.drills=4000 for generated offline pairs (experiment=dpo-llama-tiny-offline).")


def _from_files(patterns: list[str], setting: str, task: TaskConfig, cache_dir: str | None
                ) -> list[Pair]:
    return rows_from_files(patterns, setting, lambda table, where: pairs_of(table, task, where),
                           cache_dir)


def _from_hub(task: TaskConfig, split: str) -> list[Pair]:
    table, where = hub_table(task, split, "UltraFeedback: task.hub_path="
                             "HuggingFaceH4/ultrafeedback_binarized, splits train_prefs and "
                             "test_prefs")
    return pairs_of(table, task, where)


def pairs_of(table: datasets.Dataset, task: TaskConfig, where: str) -> list[Pair]:
    """The rows of `table` as checked pairs."""
    columns = (task.prompt_column, task.chosen_column, task.rejected_column)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise FlaxlmError(
            f"{where} has no column {', '.join(map(repr, missing))}; its columns are "
            f"{table.column_names}. task={task.name} reads the prompt from task.prompt_column="
            f"{task.prompt_column!r} and the two replies from task.chosen_column="
            f"{task.chosen_column!r} and task.rejected_column={task.rejected_column!r}: set "
            "them to the data's column names.")
    return [pair_of(row, task, f"{where}, row {index + 1}") for index, row in enumerate(table)]


def pair_of(row: dict, task: TaskConfig, where: str) -> Pair:
    prompt = _turns(row[task.prompt_column], "user", f"{where}, {task.prompt_column!r}")
    if not prompt:
        raise FlaxlmError(f"{where}: the prompt ({task.prompt_column!r}) is empty. Give every "
                          "pair a prompt, or remove the row.")
    # The roles and texts checked as sft checks a conversation's, which must hold a reply.
    check_turns([*prompt, {"role": "assistant", "content": ""}], where)
    replies = []
    for column in (task.chosen_column, task.rejected_column):
        reply = _turns(row[column], "assistant", f"{where}, {column!r}")
        if reply[: len(prompt)] == prompt:  # a whole conversation: its reply follows the prompt
            reply = reply[len(prompt):]
        if not any(turn["role"] == "assistant" for turn in reply):
            raise FlaxlmError(
                f"{where}: the {column!r} reply has no assistant turn (after the prompt's), so "
                "there is nothing to compare. Give both replies, or remove the row.")
        check_turns(reply, where)
        replies.append(reply)
    return Pair(prompt, *replies)


def _turns(value, role: str, where: str) -> Turns:
    """A column's value as turns: a string is one turn of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, Sequence) and all(isinstance(turn, dict) for turn in value):
        return [{"role": turn.get("role"), "content": turn.get("content")} for turn in value]
    raise FlaxlmError(
        f"{where} is {value!r}: a prompt or reply is a string or a list of {{role, content}} "
        "turns. Fill it in, or remove the row.")


# ------------------------------------------------------------------ rows


@dataclasses.dataclass(frozen=True)
class PreferenceRows:
    """Pairs as rows, and what became of the ones that did not fit."""

    arrays: dict[str, np.ndarray]  # CHAT_KEYS → (pairs, 2, max_seq_length); [:, 0] chosen
    truncated: int
    dropped: int  # too long with long_conversations=drop, or no reply token left once cut
    identical: int  # chosen == rejected

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def describe(self, name: str, policy: LongConversations) -> str:
        """'380 train pairs (3 truncated, 1 dropped: ..., 2 with identical replies dropped)'."""
        notes = []
        if self.truncated or self.dropped:
            changed = [f"{self.truncated} truncated"] * bool(self.truncated) + [
                f"{self.dropped} dropped"] * bool(self.dropped)
            notes.append(f"{', '.join(changed)}: task.long_conversations={policy.value}")
        if self.identical:
            notes.append(f"{self.identical} with identical replies dropped")
        return f"{len(self)} {name} pairs" + (f" ({'; '.join(notes)})" if notes else "")


def encode_pairs(tokenizer, pairs: Sequence[Pair], max_seq_length: int,
                 policy: LongConversations, where: str, pad_id: int) -> PreferenceRows:
    """Each pair's two sequences encoded with a target mask on the reply, cut or dropped when
    longer than a row, one sequence per row padded (`layout_rows`)."""
    encoded, truncated, dropped, identical = [], 0, 0, 0
    for index, pair in enumerate(pairs):
        if pair.chosen == pair.rejected:
            identical += 1
            continue
        pair_where = f"{where}, pair {index + 1}"
        both = [encode_chat(tokenizer, [*pair.prompt, *reply], pair_where,
                            targets_from=len(pair.prompt))
                for reply in (pair.chosen, pair.rejected)]
        if any(len(ids) > max_seq_length for ids, _ in both):
            if policy == LongConversations.drop:
                dropped += 1
                continue
            both = [(ids[:max_seq_length], mask[:max_seq_length]) for ids, mask in both]
            truncated += 1
        if not all(mask[1:].any() for _, mask in both):  # a reply cut away entirely
            dropped += 1
            continue
        encoded += both
    flat = layout_rows(encoded, max_seq_length, pad_id, pack=False)  # chosen, rejected, ...
    arrays = {key: values.reshape(-1, 2, max_seq_length) for key, values in flat.items()}
    return PreferenceRows(arrays, truncated, dropped, identical)
