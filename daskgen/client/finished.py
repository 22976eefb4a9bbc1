"""Finished partitions as they finish: ``as_completed`` with results fetched in the background.

While it waits, the runner's housekeeping runs every :data:`WAIT_S`: the store lock's heartbeat, the
deadline and signal checks, and every 30 s a check that some engine can still take work.  The wait
itself sleeps on a condition: a finished result, or :meth:`FinishedPartitions.wake` (a worker announced a
larger window), ends it at once, so the client idles instead of polling.  ``as_completed(with_results=True)``
fetches each result in the client's event loop as soon as its task finishes, so the runner never
pays one worker round trip per partition; a fetch that fails there (a worker lost while its result
was being fetched, then a failed recomputation) would leave the future undelivered for ever, so
futures finished long ago but never delivered are fetched here directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from daskgen import tunables

#: Longest sleep between housekeeping rounds while nothing finishes (also how late a signal,
#: the deadline or the end of the grace period may be noticed).  Results and :meth:`FinishedPartitions.wake`
#: end a sleep at once, so a longer period costs no latency, only fewer idle wake-ups of the client.
WAIT_S = 0.2
# Tunables (Dask config, daskgen/daskgen.yaml): daskgen.engine-check-interval (checks that some engine
# can still take work), daskgen.undelivered-after (a future finished this long ago but not delivered
# by ``as_completed`` is fetched directly) and daskgen.fetch-timeout (how long that fetch may take).


class FinishedPartitions:
    """Futures of submitted partitions, handed back with their results once finished.

    Parameters
    ----------
    client:
        The run's client: its futures are tracked on its event loop (``as_completed`` would otherwise take the
        process's default client's loop, and a default client that is not this one, e.g. one that failed to
        connect, would never deliver them).
    on_wait:
        Called every :data:`WAIT_S` while waiting (heartbeat, deadline, signals); a true return
        value ends the wait at once.
    check_engines:
        Called every ``daskgen.engine-check-interval`` (Dask config) while waiting; raises when no engine is left.
    """

    def __init__(
        self,
        client: Any,
        on_wait: Callable[[], bool | None] | None = None,
        check_engines: Callable[[], None] | None = None,
    ) -> None:
        from distributed import as_completed

        self._ac = as_completed(loop=client.loop, with_results=True, raise_errors=False)
        self._on_wait = on_wait
        self._check_engines = check_engines
        self._checked = time.monotonic()
        self._finished_at: dict[Any, float] = {}
        self._check_every = tunables.seconds("engine-check-interval")
        self._undelivered_after = tunables.seconds("undelivered-after")
        self._woken = False

    def wake(self) -> None:
        """End the current wait, or the next one if none is running, with ``[]`` (thread-safe; e.g. a
        worker admits more partitions)."""
        with self._ac.thread_condition:
            self._woken = True
            self._ac.thread_condition.notify_all()

    def add(self, future: Any) -> None:
        """Track a submitted future."""
        self._ac.add(future)

    def wait(self, outstanding: Iterable[Any], max_wait_s: float) -> list[tuple[Any, Any]]:
        """Every ``(future, value)`` ready now, waiting up to ``max_wait_s`` for the first.

        ``value`` is the result, or ``(type, exception, traceback)`` for a failed task, or an
        exception.  Returns ``[]`` after ``max_wait_s`` without any, or at once after :meth:`wake` (the
        caller may submit more).  ``outstanding`` are the futures the caller still waits for (to find
        undelivered ones).
        """
        until = time.monotonic() + max_wait_s
        while not self._ac.has_ready():
            left = until - time.monotonic()
            if left <= 0:
                return self._undelivered(outstanding)
            if self._sleep(min(WAIT_S, left)):
                return []  # woken: the caller has something to do now
            if self._on_wait is not None and self._on_wait():
                return []  # the caller has something to do now (e.g. a stop began)
            if self._check_engines is not None and time.monotonic() - self._checked > self._check_every:
                self._check_engines()
                self._checked = time.monotonic()
        ready = [next(self._ac), *self._ac.next_batch(block=False)]
        for future, _ in ready:
            self._finished_at.pop(future, None)
        return ready

    def _sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, less when a result is queued (as_completed notifies its condition) or
        :meth:`wake` is called; True when woken by :meth:`wake`."""
        condition = self._ac.thread_condition
        with condition:  # checked under the lock: a result queued after this check notifies the wait
            if not self._woken and not self._ac.has_ready():
                condition.wait(seconds)
            woken, self._woken = self._woken, False
        return woken

    def _undelivered(self, outstanding: Iterable[Any]) -> list[tuple[Any, Any]]:
        """Futures finished more than ``daskgen.undelivered-after`` ago that ``as_completed`` never delivered."""
        now, out = time.monotonic(), []
        for future in outstanding:
            if not future.done():
                continue
            since = self._finished_at.setdefault(future, now)
            if now - since > self._undelivered_after:
                del self._finished_at[future]
                out.append((future, _fetch(future)))
        return out


def _fetch(future: Any) -> Any:
    """The future's result, or the exception fetching it raised."""
    try:
        return future.result(timeout=tunables.seconds("fetch-timeout"))
    except Exception as exc:
        return exc
