"""Where documents lie in packed blocks (task.document_masking): each token's document index
within its block (its segment id) and its position within that document.

Packing knows where every document starts; a block is a window of the token stream, so its
layout follows from which of its tokens start a document. The first token of a block always
starts a segment at position 0: when a block boundary cuts a document, its second piece is a
document of its own in the next block (it cannot see the first piece, which lies in another
block, so its positions restart too). Both the cached blocks (`packing`) and the streamed ones
(`streaming`) go through `layout`, so they agree token for token.

A batch with documents is a dict of (B, L) arrays under `DOCUMENT_KEYS`; one without is the
plain (B, L) token array, as before documents were recorded.
"""

from __future__ import annotations

import numpy as np

INPUT_IDS, SEGMENT_IDS, POSITIONS = "input_ids", "segment_ids", "positions"
DOCUMENT_KEYS = (INPUT_IDS, SEGMENT_IDS, POSITIONS)


def layout(starts_BxL: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions (int32, B×L) from the flags of the tokens that start a
    document; a block's first token starts one whatever its flag says."""
    starts_BxL = np.asarray(starts_BxL, bool).copy()
    starts_BxL[:, 0] = True
    segment_ids_BxL = np.cumsum(starts_BxL, axis=1, dtype=np.int32) - 1
    index_L = np.arange(starts_BxL.shape[1], dtype=np.int32)
    segment_start_BxL = np.maximum.accumulate(np.where(starts_BxL, index_L, 0), axis=1)
    return segment_ids_BxL, (index_L - segment_start_BxL).astype(np.int32)


def block_starts(document_starts: np.ndarray, rows: np.ndarray, block_length: int) -> np.ndarray:
    """Which tokens of blocks `rows` start a document (B×L bool), from the sorted offsets in
    the token stream where documents start (`packing.pack_blocks`); block r is the stream's
    tokens [r·L, (r+1)·L)."""
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
