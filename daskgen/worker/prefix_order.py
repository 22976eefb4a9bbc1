"""Prompt order: a partition's requests sent so that prompts sharing a prefix reach the engine together.

An engine's prefix cache (vLLM's automatic prefix caching, sglang's radix cache) reuses a computed prefix
only while it holds it; requests admitted one after the other that share a long prefix compute it once.
Sorting a partition's prompts (token ids, compared element by element) puts every group of prompts that
share a prefix, of any length, next to each other: no prefix length or key is needed on the worker.
Results are given back in row order, so nothing downstream changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any


def prompt_order(prompts: Sequence[Any], indices: Sequence[int], descending: bool = False) -> list[int]:
    """Positions in ``indices`` ordered by the prompts ``prompts[indices[k]]`` (ties keep row order)."""
    return sorted(range(len(indices)), key=lambda k: list(prompts[indices[k]]), reverse=descending)


class AlternatingOrder:
    """Prompt order for the partitions one engine runs, each sorted the other way from the one before.

    Sorting every partition the same way visits the shared prefixes in the same cycle each time: an engine
    whose prefix cache holds fewer of them than a partition brings (least recently used evicted first) then
    finds each one evicted just before it comes round again.  Alternating the direction starts each partition
    with the prefixes the engine computed last, which such a cache still holds.
    """

    def __init__(self) -> None:
        self.descending = False

    def order(self, prompts: Sequence[Any], indices: Sequence[int]) -> list[int]:
        """:func:`prompt_order` of this partition; the next one is sorted the other way."""
        out = prompt_order(prompts, indices, self.descending)
        self.descending = not self.descending
        return out


async def gather_in_prompt_order(calls: list[Awaitable[Any]], rows_order: list[int], per_row: int) -> list[Any]:
    """``asyncio.gather(*calls)``, the calls started in ``rows_order`` (positions of rows, e.g. a prompt order);
    results in the calls' order.

    ``calls`` holds ``per_row`` calls for each row, row after row (a row's samples together)."""
    order = [k * per_row + s for k in rows_order for s in range(per_row)]
    results = await asyncio.gather(*(calls[j] for j in order))
    out: list[Any] = [None] * len(calls)
    for j, result in zip(order, results, strict=True):
        out[j] = result
    return out
