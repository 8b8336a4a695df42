"""Log-likelihoods of continuations given contexts: what a multiple-choice or perplexity
benchmark asks of a language model (`flaxlm.harness`), computed in as few token positions as
the requests allow.

Requests that share a context (the choices of one question) are read in one row: the context
once, then each continuation as a branch of the KV cache's tree (`layers.decode_step`) that
sees the context and itself only, at the positions it would have alone. The vocabulary-wide
head runs only where a continuation token is predicted. Rows are sorted by length and padded
to a few bucketed shapes, so a benchmark compiles a handful of programs; their rows are split
over every device of the mesh (all hosts: each process feeds its own rows and reads every
result).

    from flaxlm.scoring import score
    [(logprob, is_greedy), ...] = score(model, [(context_ids, continuation_ids), ...])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from flaxlm.errors import FlaxlmError
from flaxlm.generate import LanguageModel
from flaxlm.parallel import BATCH_AXES, global_batch, process_rows, replicated
from flaxlm.tool_defaults import DEFAULT_BATCH_ROWS

MIN_BUCKET = 8


@dataclasses.dataclass
class _Row:
    """One context and some of its continuations, laid out as model input: the context's
    tokens (branch 0), then each continuation but its last token (branch 1, 2, ...). Each
    continuation token is predicted from the hidden state at `reads[i]`."""

    ids: list[int]
    branches: list[int]
    reads: list[int]  # which position predicts each scored token
    targets: list[int]  # the scored tokens
    owners: list[int]  # the continuation (index into the unique ones) each scored token is of


def score(model: LanguageModel, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
          batch_rows: int = DEFAULT_BATCH_ROWS, mesh: Mesh | None = None
          ) -> list[tuple[float, bool]]:
    """(log P(continuation | context), whether greedy decoding would write the continuation)
    for each (context ids, continuation ids) request, as lm-evaluation-harness defines them.

    A request longer than the model's context keeps its last `context_length + 1` tokens (the
    context is cut from the left). A batch holds as many positions as `batch_rows` rows of
    the requests' typical length (`_batches`); `mesh`: where the rows are split (None: one
    device)."""
    max_length = model.context_length
    contexts: dict[tuple[int, ...], dict[tuple[int, ...], int]] = {}
    request_keys = []
    for context, continuation in requests:
        context, continuation = _truncated(list(context), list(continuation), max_length)
        choices = contexts.setdefault(tuple(context), {})
        choices.setdefault(tuple(continuation), len(choices))
        request_keys.append((tuple(context), tuple(continuation)))

    unique = [(context, continuation) for context, choices in contexts.items()
              for continuation in choices]
    index_of = {key: i for i, key in enumerate(unique)}
    rows = [row for context, choices in contexts.items()
            for row in _rows(context, list(choices), [index_of[(context, c)] for c in choices],
                             max_length)]
    logprobs = np.zeros(len(unique), np.float64)
    greedy = np.ones(len(unique), bool)
    for batch, padded_rows in _batches(rows, batch_rows, _shards(mesh)):
        token_logprobs_BxT, token_greedy_BxT = _run(model, batch, padded_rows, mesh)
        for row, row_logprobs, row_greedy in zip(batch, token_logprobs_BxT, token_greedy_BxT):
            count = len(row.targets)
            np.add.at(logprobs, row.owners, row_logprobs[:count])
            np.logical_and.at(greedy, row.owners, row_greedy[:count])
    return [(float(logprobs[index_of[key]]), bool(greedy[index_of[key]]))
            for key in request_keys]


def _truncated(context: list[int], continuation: list[int], max_length: int):
    if not context or not continuation:
        raise FlaxlmError(
            "Every log-likelihood request needs a context and a continuation of at least one "
            "token each (an empty context is the document-start token, which the harness "
            "adds)."
        )
    if len(continuation) > max_length:
        raise FlaxlmError(
            f"A continuation of {len(continuation)} tokens is longer than the model's context "
            f"of {max_length} positions (model.max_positions), so it cannot be scored. Use a "
            "task whose answers are shorter, or a model with a longer context."
        )
    keep = max_length + 1 - len(continuation)  # the harness cuts the context from the left
    return context[-keep:], continuation


def _rows(context: tuple[int, ...], continuations: list[tuple[int, ...]], owners: list[int],
          max_length: int) -> list[_Row]:
    """The rows of one context: its continuations, as many per row as fit in twice the
    model's context (each row repeats the context)."""
    rows: list[_Row] = []
    row = None
    for continuation, owner in zip(continuations, owners):
        if row is not None and len(row.ids) + len(continuation) - 1 > 2 * max_length:
            row = None
        if row is None:
            row = _Row(list(context), [0] * len(context), [], [], [])
            rows.append(row)
        branch = max(row.branches) + 1
        start = len(row.ids)
        row.ids.extend(continuation[:-1])
        row.branches.extend([branch] * (len(continuation) - 1))
        row.reads.extend([len(context) - 1] + list(range(start, start + len(continuation) - 1)))
        row.targets.extend(continuation)
        row.owners.extend([owner] * len(continuation))
    return rows


def _shards(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(np.prod([mesh.shape[axis] for axis in BATCH_AXES]))


def _batches(rows: list[_Row], batch_rows: int, shards: int):
    """The rows, longest first, in batches of about the same number of padded positions:
    `batch_rows` rows of the typical (median) length, fewer of longer ones, so that a few
    long rows do not pad a whole batch of short ones to their length. Each batch comes with
    the number of rows it is padded to: `shards` times a power of two, so batches compile one
    of few shapes."""
    rows = sorted(rows, key=lambda row: (len(row.ids), len(row.targets)), reverse=True)
    if not rows:
        return
    budget = batch_rows * bucket(len(rows[len(rows) // 2].ids))
    first = 0
    while first < len(rows):
        fits = max(1, budget // (bucket(len(rows[first].ids)) * shards))
        capacity = shards * (1 << (fits.bit_length() - 1))  # rows: shards × a power of two
        batch = rows[first:first + capacity]
        per_shard = -(-len(batch) // shards)
        yield batch, min(capacity, shards * (1 << (per_shard - 1).bit_length()))
        first += len(batch)


def bucket(length: int) -> int:
    """`length` rounded up to a quarter octave (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...):
    at most a quarter of a row is padding, and lengths share few compiled shapes."""
    if length <= MIN_BUCKET:
        return MIN_BUCKET
    step = 1 << max((length - 1).bit_length() - 3, 0)
    return -(-length // step) * step


def _run(model: LanguageModel, batch: list[_Row], B: int, mesh: Mesh | None):
    L = bucket(max(len(row.ids) for row in batch))
    T = bucket(max(len(row.targets) for row in batch))
    ids_BxL = np.zeros((B, L), np.int32)
    mask_BxL = np.zeros((B, L), bool)
    branches_BxL = np.zeros((B, L), np.int32)
    reads_BxT = np.zeros((B, T), np.int32)
    targets_BxT = np.zeros((B, T), np.int32)
    for i, row in enumerate(batch):
        ids_BxL[i, :len(row.ids)] = row.ids
        mask_BxL[i, :len(row.ids)] = True
        branches_BxL[i, :len(row.ids)] = row.branches
        reads_BxT[i, :len(row.reads)] = row.reads
        targets_BxT[i, :len(row.targets)] = row.targets
    inputs = (ids_BxL, mask_BxL, branches_BxL, reads_BxT, targets_BxT)
    graphdef, params = nnx.split(model)
    if mesh is None:
        outputs = _score_rows(graphdef, params, *map(jnp.asarray, inputs))
    else:
        first, count = process_rows(B, mesh)
        outputs = _score_rows_on(mesh)(
            graphdef, params, *(global_batch(x[first:first + count], mesh) for x in inputs))
    return (np.asarray(x)[:len(batch)] for x in outputs)


def _token_scores(graphdef, params, ids_BxL, mask_BxL, branches_BxL, reads_BxT, targets_BxT):
    """Each scored token's log-probability (B, T) and whether it is the most likely one."""
    model = nnx.merge(graphdef, params)
    B, L = ids_BxL.shape
    x_BxLxD, _ = model.decode_hidden_states(ids_BxL, model.init_cache(B, L), mask_BxL,
                                            branches_BxL)
    x_BxTxD = jnp.take_along_axis(x_BxLxD, reads_BxT[:, :, None], axis=1)
    logits_BxTxV = model.lm_head_logits(x_BxTxD).astype(jnp.float32)
    logprobs_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    token_logprobs_BxT = jnp.take_along_axis(logprobs_BxTxV, targets_BxT[:, :, None],
                                             axis=-1)[..., 0]
    return token_logprobs_BxT, jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT


_score_rows = jax.jit(_token_scores, static_argnames=("graphdef",))


@functools.cache
def _score_rows_on(mesh: Mesh):
    """`_score_rows` with every process reading the whole result."""
    out = replicated(mesh)
    return jax.jit(_token_scores, static_argnames=("graphdef",), out_shardings=(out, out))
