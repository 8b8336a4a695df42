"""The data of a task on preference pairs (task=dpo): the pairs read (data/preferences.py),
the tokenizer with its chat template (as task=sft's), one row per pair (prompt + chosen and
prompt + rejected, a target mask on each reply), checked and in a loader. Any task that learns
from which of two replies is preferred reads its pairs here, as task=dpo does."""

from __future__ import annotations

import dataclasses

from flaxlm.data.chat_packing import chat_rows
from flaxlm.data.fingerprint import arrays_fingerprint
from flaxlm.data.loader import RowLoader
from flaxlm.data.preferences import PreferenceRows, encode_pairs, load_preferences
from flaxlm.errors import FlaxlmError
from flaxlm.tasks.language_model import chat_tokenizer, pad_id
from flaxlm.tasks.pipeline import Run, TaskData


@dataclasses.dataclass(kw_only=True)
class PairData(TaskData):
    """Pairs laid out in rows: `arrays` of (pairs, 2, max_seq_length), chosen first."""

    train_rows: PreferenceRows
    eval_rows: PreferenceRows
    batch_unit: str = "pairs"


def pair_data(run: Run) -> PairData:
    """Every pair read, checked and laid out in rows up front."""
    config, seq_len, batch_size = run.config, run.seq_len, run.batch_size
    task = config.task
    pairs = load_preferences(task, config.cache_dir)
    tokenizer = chat_tokenizer(config, run.start, [[*pair.prompt, *pair.chosen, *pair.rejected]
                                                   for pair in pairs.train])
    train_rows, eval_rows = (
        encode_pairs(tokenizer, rows, seq_len, task.long_conversations, where, pad_id(tokenizer))
        for rows, where in ((pairs.train, "the training pairs"),
                            (pairs.eval, "the held-out pairs")))
    if len(eval_rows) == 0:
        raise FlaxlmError(
            f"No held-out preference pair is left to evaluate on ({eval_rows.dropped} dropped "
            f"as longer than task.max_seq_length={seq_len} tokens with task.long_conversations="
            f"{task.long_conversations.value}, or with no reply token left once cut; "
            f"{eval_rows.identical} with identical replies). Raise "
            "task.max_seq_length, set task.long_conversations=truncate, or hold out more.")
    if len(train_rows) < batch_size:
        raise FlaxlmError(
            f"The training preference pairs make {len(train_rows)} row(s) of {seq_len} tokens "
            f"({train_rows.dropped} dropped as too long or with no reply token left, "
            f"{train_rows.identical} with identical replies), fewer than one global batch of "
            f"{batch_size} (per-device batch × devices × trainer.grad_accum_steps). Use more "
            "pairs, raise task.max_seq_length, or lower hardware.per_device_batch_size.")
    fingerprint = {"training pairs": arrays_fingerprint(train_rows.arrays),
                   "held-out pairs": arrays_fingerprint(eval_rows.arrays)}
    # The loader reads `train_rows.arrays` at each batch: a task may add arrays to them (DPO:
    # the reference log-probs) once the starting weights exist, before the first batch.
    loader = RowLoader(len(train_rows), batch_size, config.seed,
                       chat_rows(train_rows.arrays, batch_size, run.job.mesh),
                       kind="preference pairs", rows_key="num_examples")
    policy = task.long_conversations
    trains_on = (f"{train_rows.describe('train', policy)} / "
                 f"{eval_rows.describe('held-out', policy)}, each reply with its prompt in a "
                 f"row of {seq_len} tokens, scored on the reply | from {pairs.origin}")
    return PairData(tokenizer=tokenizer, loader=loader, fingerprint=fingerprint,
                    trains_on=trains_on, train_rows=train_rows, eval_rows=eval_rows)
