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


def prompt_order(prompts: Sequence[Any], indices: Sequence[int]) -> list[int]:
    """Positions in ``indices`` ordered by the prompts ``prompts[indices[k]]`` (ties keep row order)."""
    return sorted(range(len(indices)), key=lambda k: list(prompts[indices[k]]))


async def gather_in_prompt_order(
    calls: list[Awaitable[Any]], prompts: Sequence[Any], indices: Sequence[int], per_row: int
) -> list[Any]:
    """``asyncio.gather(*calls)``, the calls started in prompt order; results in the calls' order.

    ``calls`` holds ``per_row`` calls for each of ``indices``, row after row (a row's samples together)."""
    order = [k * per_row + s for k in prompt_order(prompts, indices) for s in range(per_row)]
    results = await asyncio.gather(*(calls[j] for j in order))
    out: list[Any] = [None] * len(calls)
    for j, result in zip(order, results, strict=True):
        out[j] = result
    return out
