"""One batch of requests through a daskgen engine, as the GPU validation steps run them.

The engine is started, every request submitted at once (as a worker submits a partition's), and shut down; a
failed request stops the step, naming it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any


async def generate_all(
    engine: Any, requests: Sequence[Any], step: str, first: Callable[[Any], Awaitable[None]] | None = None
) -> list[Any]:
    """The results of ``requests`` on ``engine`` (started here and shut down); ``SystemExit`` naming ``step`` and the
    first error when any request failed.  ``first``: awaited with the started engine before the requests (another
    side of a comparison run on the same engine)."""
    await engine.start()
    try:
        if first is not None:
            await first(engine)
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.shutdown()
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"{step}: {len(errors)} requests failed, e.g. {errors[0]}")
    return list(results)
