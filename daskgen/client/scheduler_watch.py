"""Noticing that the Dask scheduler is gone, within a bounded time.

When the scheduler dies, the client's connection breaks at once (a killed process) or after the
operating system's TCP timeout (a lost node); ``distributed`` then cancels every future and tries to
reconnect.  Waiting for that to succeed would leave a run hanging, and treating the cancelled
partitions as failed would mark sound prompts failed.  A scheduler that hangs (a stopped process, a
machine that stops scheduling it) keeps its connection open and never answers.  :class:`SchedulerWatch`
turns all three into :class:`~daskgen.errors.SchedulerLost`: at once for a partition cancelled because
the connection was lost; after ``daskgen.scheduler-lost-after`` (Dask config, 20 s) of a client that is
not connected, or of a scheduler that stops answering pings (the client pings every quarter of the
limit while waiting, at most every :data:`PING_EVERY_S`, and gives each ping the rest of the limit).  So a
scheduler that dies or hangs is noticed within the limit of it, give or take one housekeeping round of
the client (``daskgen.client.finished.WAIT_S``).  The moment is logged
(:meth:`SchedulerWatch.lost`); the runner then commits what finished, releases the lock and exits as
interrupted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from daskgen import tunables
from daskgen.errors import SchedulerLost

logger = logging.getLogger(__name__)

#: Seconds between pings of the scheduler while the client waits for partitions.
PING_EVERY_S = 5.0


class SchedulerWatch:
    """Watches one client's connection to its scheduler."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.address = str(getattr(client.scheduler, "address", "") or "the scheduler")
        self.limit = tunables.seconds("scheduler-lost-after")
        self.ping_every = min(PING_EVERY_S, self.limit / 4)
        self._since: float | None = None
        self._pinged = time.monotonic()

    def connected(self) -> bool:
        """True while the client is connected to its scheduler."""
        return self.client.status == "running"

    def check(self) -> None:
        """Raise :class:`SchedulerLost` once the client has been disconnected for longer than the limit."""
        if self.connected():
            self._since = None
            self._ping()
            return
        now = time.monotonic()
        self._since = now if self._since is None else self._since
        if now - self._since >= self.limit:
            raise self.lost(f"no connection for {now - self._since:.0f} s")

    def _ping(self) -> None:
        """Every :attr:`ping_every`: ask the scheduler who it is.  A scheduler that hangs right after an
        answer is pinged again within :attr:`ping_every`; no answer within the rest of the limit means lost."""
        if time.monotonic() - self._pinged < self.ping_every:
            return
        self._pinged = time.monotonic()
        try:
            self.client.sync(asyncio.wait_for, self.client.scheduler.identity(), self.limit - self.ping_every)
        except Exception as exc:  # a timeout, or the connection breaking under the ping
            raise self.lost(f"it did not answer within {self.limit:g} s: {type(exc).__name__}") from exc

    def lost(self, why: str) -> SchedulerLost:
        """The error naming the lost scheduler; the moment it was noticed is logged."""
        logger.warning("the Dask scheduler %s is lost (%s): committing what finished, then stopping", self.address, why)
        return SchedulerLost(f"lost the Dask scheduler {self.address} ({why})")

    def check_cancelled(self, future: Any) -> None:
        """A partition came back cancelled: raise :class:`SchedulerLost` when the connection is what broke."""
        if future.status == "cancelled" and not self.connected():
            raise self.lost("the connection broke and its partitions were cancelled")
