"""mRoPE positions of samples with images, from the store's spans and grids alone (no model, no pixels).

A Qwen2-VL-class model places each image's tokens on a (t, h, w) grid of positions and lets the text after it
continue from the largest of them plus one; the store's ``rope_delta`` is what that leaves the text after the
prompt's last image off by.  :func:`mrope_positions` gives the three rows of positions (temporal, height, width)
of one sample from its images' placeholder spans and grids; :func:`vision_position_ids` does it for a batch in
verl's layout (left-padded prompts, right-padded responses: the attended tokens are contiguous), ``0`` on
padding, as the model's own ``get_rope_index`` gives them.  verl keeps ``position_ids`` of an mRoPE model as
``(rows, 4, width)``: the 1-D positions on top of these three rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def mrope_positions(
    n_tokens: int, offsets: Sequence[int], lengths: Sequence[int], grids: Sequence[Sequence[int]]
) -> np.ndarray:
    """The ``(3, n_tokens)`` int64 positions of a sample of ``n_tokens`` tokens whose images' placeholder tokens
    start at ``offsets`` and number ``lengths``, each of patch grid ``grids`` (t, h, w) as the image processor made
    it (empty slots: a length of 0).  ``ValueError`` when a span does not fit its grid or the sample."""
    out = np.empty((3, n_tokens), dtype=np.int64)
    at, position = 0, 0  # the next token, and the next text position
    for offset, length, grid in zip(offsets, lengths, grids, strict=True):
        offset, length = int(offset), int(length)
        if length <= 0:
            continue
        t, h, w = (int(v) for v in grid)
        merge = math.isqrt(t * h * w // length) if t * h * w >= length else 0
        if merge < 1 or t * (h // merge) * (w // merge) != length or not at <= offset <= n_tokens - length:
            raise ValueError(
                f"an image span (offset {offset}, length {length}) does not fit its grid {(t, h, w)} or a sample of "
                f"{n_tokens} tokens after the previous image (ending at {at}); pass the store's own image arrays."
            )
        out[:, at:offset] = position + np.arange(offset - at)
        position += offset - at
        grid_positions = np.indices((t, h // merge, w // merge)).reshape(3, -1)
        out[:, offset : offset + length] = position + grid_positions
        position += max(t, h // merge, w // merge)
        at = offset + length
    out[:, at:] = position + np.arange(n_tokens - at)
    return out


def vision_position_ids(attention_mask: Any, prompt_width: int, offsets: Any, lengths: Any, grids: Any) -> np.ndarray:
    """The ``(rows, 3, width)`` int64 mRoPE positions of a batch in verl's layout: ``attention_mask`` ``(rows,
    width)``, ``prompt_width`` (the left-padded prompt's columns) and the batch's ``image_offset``,
    ``image_length`` and ``image_grid`` (offsets into each unpadded prompt); ``0`` where the mask is 0."""
    mask = np.asarray(attention_mask).astype(bool)
    offsets, lengths, grids = np.asarray(offsets), np.asarray(lengths), np.asarray(grids)
    out = np.zeros((len(mask), 3, mask.shape[1]), dtype=np.int64)
    for i, row in enumerate(mask):
        attended = np.flatnonzero(row)
        if not len(attended):
            continue
        first = int(attended[0])
        pad = prompt_width - first  # the prompt's padding columns: spans index the unpadded prompt
        if pad < 0 or not np.array_equal(attended, np.arange(first, first + len(attended))):
            raise ValueError(f"row {i}: its attended tokens are not contiguous from a left-padded prompt")
        out[i][:, attended] = mrope_positions(len(attended), offsets[i], lengths[i], grids[i])
    return out
