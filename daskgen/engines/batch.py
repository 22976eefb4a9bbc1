"""Many requests at once: their results handed back in groups, as they finish.

:meth:`daskgen.engines.base.Engine.generate_batch` takes a partition's requests in one call and yields
``(index, result)`` pairs (``index`` into the requests) in groups: whatever finished since the caller last
looked.  Its caller handles a group in one go (one wake-up, one pass of bookkeeping) instead of one
coroutine chain per request.  :func:`each_as_finished` is the default for any engine: one task per request
through the engine's own ``generate``.  An engine that can do better (the simulated engine resolves every
request from its step loop) fills a :class:`FinishedGroups` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

_R = TypeVar("_R")

#: Finished requests of a batch: ``(index into the batch's requests, result)``.
Finished = list[tuple[int, Any]]


class FinishedGroups:
    """Where the results of ``total`` requests land as they finish, and from where their caller takes them.

    :meth:`add` may be called from another thread (it then hands the result to the caller's loop); a
    failure given to :meth:`fail` is raised by the next :meth:`take`.
    """

    def __init__(self, total: int) -> None:
        self.left = total
        self._ready: Finished = []
        self._failure: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def add(self, index: int, result: Any) -> None:
        """Request ``index`` finished with ``result``."""
        if self._on_own_loop():
            self._ready.append((index, result))
            self._event.set()
        else:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits any more
                self._loop.call_soon_threadsafe(self.add, index, result)

    def fail(self, exc: BaseException) -> None:
        """A request raised ``exc``: the caller's next :meth:`take` raises it."""
        if self._on_own_loop():
            self._failure = self._failure or exc
            self._event.set()
        else:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.fail, exc)

    async def take(self) -> Finished:
        """The requests finished since the last call (waits for at least one)."""
        while not self._ready and self._failure is None:
            self._event.clear()
            await self._event.wait()
        if self._failure is not None:
            raise self._failure
        group, self._ready = self._ready, []
        self.left -= len(group)
        return group

    async def each(self) -> AsyncGenerator[Finished, None]:
        """:meth:`take` until every request finished."""
        while self.left > 0:
            yield await self.take()

    def _on_own_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False


async def each_as_finished(
    call: Callable[[_R], Awaitable[Any]], requests: Sequence[_R]
) -> AsyncGenerator[Finished, None]:
    """``call(request)`` for every request at once (one task each); their results in groups as they finish.

    The first exception a call raises is raised here; when the caller stops early (an exception, a
    cancellation, :func:`contextlib.aclosing`), the calls still running are cancelled.
    """
    groups = FinishedGroups(len(requests))

    def settle(index: int, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if (exc := task.exception()) is not None:
            groups.fail(exc)
        else:
            groups.add(index, task.result())

    tasks = [asyncio.ensure_future(call(request)) for request in requests]
    for index, task in enumerate(tasks):
        task.add_done_callback(functools.partial(settle, index))
    try:
        async for group in groups.each():
            yield group
    finally:
        for task in tasks:
            task.cancel()
