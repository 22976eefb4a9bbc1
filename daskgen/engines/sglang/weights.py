"""sglang's weight update when requests still ran: the weights loaded, the old weights' prefix cache kept.

sglang (0.5.23) answers ``update_weights_from_disk`` with ``success: false`` and a message saying the cache was
not flushed when requests were running or queued; the new weights are in place.  The in-process engine
(:mod:`daskgen.engines.sglang.engine`) and the managed HTTP server (:mod:`daskgen.engines.openai.server`) both
count that as loaded and drop the cache once the requests have finished (:func:`flush_when_idle`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from daskgen.errors import RefreshError

__all__ = ["FLUSH_CALL_S", "FLUSH_WAIT_S", "flush_when_idle", "loaded_but_not_flushed"]

#: The part of sglang's answer that says the weights loaded but the cache stayed.
_NOT_FLUSHED = "cache was not flushed"
#: How long one flush call lets sglang wait for running requests, and how long the flush waits in all.
FLUSH_CALL_S = 5
FLUSH_WAIT_S = 120


def loaded_but_not_flushed(message: str) -> bool:
    """Whether sglang's refusal ``message`` means the weights loaded and only the cache flush was refused."""
    return _NOT_FLUSHED in message


async def flush_when_idle(flush: Callable[[float], Awaitable[bool]], path: str, server: str) -> None:
    """Call ``flush(timeout_s)`` (sglang's ``flush_cache``, true once it flushed) until it flushes, for up to
    :data:`FLUSH_WAIT_S`; else :class:`~daskgen.errors.RefreshError` naming ``server`` and the checkpoint ``path``."""
    for _ in range(FLUSH_WAIT_S // FLUSH_CALL_S):
        if await flush(FLUSH_CALL_S):
            return
    raise RefreshError(
        f"{server} loaded {path!r} but kept serving requests for {FLUSH_WAIT_S} s, so its prefix cache of the old "
        "weights could not be dropped"
    )
