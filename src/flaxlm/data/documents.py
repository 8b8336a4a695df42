"""Where documents lie in packed blocks (task.document_masking): each token's document index
within its block (its segment id) and its position within that document.

Which token opens a document's segment (`opening_tokens`): with flaxlm's convention (documents
joined by EOS alone) the EOS before the document, which then plays the part a BOS plays
elsewhere: a document is read after an EOS, exactly as a prompt is in generation
(`generate.encode_prompts`), and its first token is predicted from that EOS. With a tokenizer's
own conventions (a prefix, its BOS, before every document) the prefix opens it. Either way a
document's own EOS lies in its segment or is predicted from it, so every next-token prediction
of a block still counts, as without document masking: eval loss and bits per byte score the
same targets under both settings, each predicted from its own document only.

Packing records the offsets of the opening tokens; a block is a window of the token stream, so
its layout follows from which of its tokens open a segment. The first token of a block always
opens one, at position 0: when a block boundary cuts a document, its second piece is a document
of its own in the next block (it cannot see the first piece, which lies in another block, so
its positions restart too). Both the cached blocks (`packing`) and the streamed ones
(`streaming`) go through `opening_tokens` and `layout`, so they agree token for token.

A batch with documents is a dict of (B, L) arrays under `DOCUMENT_KEYS`; one without is the
plain (B, L) token array, as before documents were recorded.
"""

from __future__ import annotations

import numpy as np

INPUT_IDS, SEGMENT_IDS, POSITIONS = "input_ids", "segment_ids", "positions"
# True on the tokens the loss scores; a batch without it scores every next token. task=sft's
# batches carry it (data/chat_packing.py): only the assistant's tokens are targets.
TARGET_MASK = "target_mask"
DOCUMENT_KEYS = (INPUT_IDS, SEGMENT_IDS, POSITIONS)


def opening_tokens(lengths: np.ndarray, prefixed: bool, out: np.ndarray | None = None):
    """Offsets, from the first of these documents' tokens, of the tokens that open a segment:
    each document's first prefix token when documents are `prefixed`, else each document's
    closing EOS (which opens the next one; the first document is opened by the start of the
    stream, as every block's first token opens a segment). `lengths`: each document's tokens,
    prefix and EOS included (int64). Written into `out` if given (a memory map: the offsets of
    a corpus need not fit in memory)."""
    offsets = np.cumsum(lengths, dtype=np.int64, out=out)
    offsets -= lengths if prefixed else 1
    return offsets


def layout(starts_BxL: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions (int32, B×L) from the flags of the tokens that open a
    segment; a block's first token opens one whatever its flag says."""
    starts_BxL = np.asarray(starts_BxL, bool).copy()
    starts_BxL[:, 0] = True
    segment_ids_BxL = np.cumsum(starts_BxL, axis=1, dtype=np.int32) - 1
    index_L = np.arange(starts_BxL.shape[1], dtype=np.int32)
    segment_start_BxL = np.maximum.accumulate(np.where(starts_BxL, index_L, 0), axis=1)
    return segment_ids_BxL, (index_L - segment_start_BxL).astype(np.int32)


def block_starts(document_starts: np.ndarray, rows: np.ndarray, block_length: int) -> np.ndarray:
    """Which tokens of blocks `rows` open a segment (B×L bool), from the sorted offsets in the
    token stream of the tokens that open one (`opening_tokens`, as `packing.pack_blocks`
    records them); block r is the stream's tokens [r·L, (r+1)·L)."""
    starts_BxL = np.zeros((len(rows), block_length), bool)
    firsts = np.asarray(rows, np.int64) * block_length
    lows = np.searchsorted(document_starts, firsts)
    highs = np.searchsorted(document_starts, firsts + block_length)
    for row, (first, low, high) in enumerate(zip(firsts, lows, highs)):
        starts_BxL[row, document_starts[low:high] - first] = True
    return starts_BxL


def with_documents(tokens_BxL: np.ndarray, starts_BxL: np.ndarray) -> dict[str, np.ndarray]:
    """The batch a model attending within documents reads: tokens, segment ids, positions."""
    segment_ids_BxL, positions_BxL = layout(starts_BxL)
    return {INPUT_IDS: tokens_BxL, SEGMENT_IDS: segment_ids_BxL, POSITIONS: positions_BxL}
