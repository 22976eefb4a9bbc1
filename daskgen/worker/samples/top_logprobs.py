"""Top-k logprobs between trajectories and a partition's region (``top_logprob_ids``/``top_logprobs``).

A trajectory holds, per response token, its ``(token_id, logprob)`` pairs, most likely first
(:data:`~daskgen.engines.base.TopLogprobs`); the region holds them as two ``(..., response_position,
k)`` arrays, padded with :data:`~daskgen.store.layout.NO_TOKEN` and NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.engines.base import TopLogprobs
from daskgen.store.layout import NO_TOKEN

__all__ = ["TOP_UNAVAILABLE", "lacks_top", "place_top_logprobs", "stored_top_logprobs"]

#: The note a row gets (its ``error`` column, the row still done) when the engine gave no top-k entries for a token it
#: generated (``meta["top_logprobs"] = "unavailable"``: e.g. ``transformers serve``); ``daskgen verify`` then expects
#: no top-k chunk for it.
TOP_UNAVAILABLE = "top_logprobs unavailable: the engine gave no top-k entries for tokens it generated"


def place_top_logprobs(region: dict[str, np.ndarray], index: tuple[int, ...], top: TopLogprobs | None, n: int) -> None:
    """Store the first ``n`` tokens' entries of ``top`` at ``index`` of a region that has the arrays."""
    if "top_logprobs" not in region:
        return
    ids, values = region["top_logprob_ids"][index], region["top_logprobs"][index]
    ids[...], values[...] = NO_TOKEN, np.nan
    rows, k = (top or [])[:n], ids.shape[-1]
    if rows and all(len(entries) == k for entries in rows):  # the usual case: one conversion for all tokens
        pairs = np.asarray(rows, dtype=np.float64)
        ids[: len(rows)], values[: len(rows)] = pairs[..., 0], pairs[..., 1]
        return
    for position, entries in enumerate(rows):
        for rank, (token, logprob) in enumerate(entries[:k]):
            ids[position, rank], values[position, rank] = token, logprob


def stored_top_logprobs(region: dict[str, np.ndarray], index: tuple[int, ...], n: int) -> TopLogprobs | None:
    """The first ``n`` tokens' stored entries at ``index``, or ``None`` when the region has none."""
    if "top_logprobs" not in region:
        return None
    ids, values = region["top_logprob_ids"][index][:n].tolist(), region["top_logprobs"][index][:n].tolist()
    return [
        [(t, v) for t, v in zip(row_ids, row_values, strict=True) if t != NO_TOKEN]
        for row_ids, row_values in zip(ids, values, strict=True)
    ]


def lacks_top(traj: Any) -> bool:
    """Whether a trajectory (:class:`~daskgen.agents.base.Trajectory`) has a generated token without top-k entries."""
    top = traj.top_logprobs or []
    generated = [p for p, m in enumerate(traj.response_mask) if m == 1]
    return any(p >= len(top) or not top[p] for p in generated)
