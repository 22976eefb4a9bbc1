"""Object-storage writes whose connection dropped after they were sent: retried here.

obstore (Rust ``object_store``) retries a request that got a 5xx answer or could not be sent, but a
request interrupted after it was sent (connection reset, timeout while waiting for the answer) only
when it counts the request as idempotent, and it does not count an S3 PUT so: one reset PUT would end
a run.  Every write daskgen makes can be repeated safely:

- a plain PUT replaces the whole object with the same bytes, and a DELETE of a deleted key is a no-op;
- a conditional PUT (create-if-absent, replace-if-version) that landed before its answer was lost
  fails its condition when repeated; the caller (:mod:`daskgen.store.location`) then reads the object
  back, and equal bytes mean the first attempt was ours.

The retries use the ``daskgen.object-store`` tunables (``max-retries``, ``retry-timeout``,
``init-backoff``, ``max-backoff``) through ``tenacity``, so one setting bounds both layers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import tenacity
from zarr.storage import ObjectStore

from daskgen import tunables

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The kinds of obstore's ``HttpError`` that it does not retry for a PUT (see the module docstring).
_SENT_THEN_LOST = ("kind: Interrupted", "kind: Timeout")


def interrupted(exc: BaseException) -> bool:
    """True when ``exc`` is an object-store request that was sent and then lost its connection or timed out."""
    from obstore.exceptions import BaseError

    if not isinstance(exc, BaseError):
        return False
    text = str(exc)  # obstore exposes the transport error's kind only in its debug text
    return any(kind in text for kind in _SENT_THEN_LOST)


def _policy() -> dict[str, Any]:
    def log(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        first_line = str(exc).split("\n")[0]
        logger.warning("object-store write dropped (attempt %d), again: %s", state.attempt_number, first_line)

    first = tunables.seconds("object-store.init-backoff")
    return {
        "stop": tenacity.stop_after_attempt(int(tunables.get("object-store.max-retries")) + 1)
        | tenacity.stop_after_delay(tunables.seconds("object-store.retry-timeout")),
        "wait": tenacity.wait_exponential(multiplier=first, max=tunables.seconds("object-store.max-backoff"))
        + tenacity.wait_random(0, first),
        "retry": tenacity.retry_if_exception(interrupted),
        "before_sleep": log,
        "reraise": True,
    }


def retry_write(write: Callable[[], T]) -> T:
    """Run ``write`` (a repeatable object-store write), again while its connection drops after sending."""
    return tenacity.Retrying(**_policy())(write)


async def retry_write_async(write: Callable[..., Awaitable[T]], *args: Any) -> T:
    """:func:`retry_write` for a coroutine function ``write`` called with ``args``."""
    return await tenacity.AsyncRetrying(**_policy())(write, *args)


class RetryingObjectStore(ObjectStore):
    """zarr's ``ObjectStore`` whose ``set``, ``set_if_not_exists`` and ``delete`` go through
    :func:`retry_write_async` (each is safe to repeat: see the module docstring)."""

    async def set(self, key: str, value: Any) -> None:
        await retry_write_async(ObjectStore.set, self, key, value)

    async def set_if_not_exists(self, key: str, value: Any) -> None:
        await retry_write_async(ObjectStore.set_if_not_exists, self, key, value)

    async def delete(self, key: str) -> None:
        await retry_write_async(ObjectStore.delete, self, key)
