"""Noticing a run's commits at once on the same Dask cluster: the run's commit events.

A run announces each commit as a Dask event on :data:`~daskgen.store.commit_log.COMMIT_TOPIC`
(``Client.log_event``); a follower given a ``distributed.Client`` of that cluster subscribes to the
topic and wakes as soon as one for its store arrives, instead of at its next poll.  When the run stops
streaming it announces its end; the follower then re-reads the store at least every
``daskgen.follow.end-poll-interval`` until the run's lock is gone, so that it ends soon after the run does
even with a long poll interval.  Events are only a hint: what is delivered is always read from the store's
commit log.  The other way, such a follower announces what it adds to the requeue record on
:data:`~daskgen.store.commit_log.REQUEUE_TOPIC`, so that the run takes it at once instead of at its next look
(:class:`daskgen.client.requeue.LiveRequeue`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from daskgen.store.commit_log import COMMIT_TOPIC, REQUEUE_TOPIC
from daskgen.store.location import StoreLocation, announced_for


class CommitEvents:
    """A subscription to a cluster's commit events that sets ``wake`` for commits of one store."""

    def __init__(self, client: Any, location: StoreLocation, wake: threading.Event) -> None:
        self.client, self.location, self.wake = client, location, wake
        self.seen = 0  # events of this store received
        self.ended_at: float | None = None  # monotonic time the run announced its end
        client.subscribe_topic(COMMIT_TOPIC, self._handle)

    def _handle(self, event: Any) -> None:
        msg = announced_for(event, self.location)
        if msg is not None:
            self.seen += 1
            if msg.get("ending"):
                self.ended_at = time.monotonic()
            self.wake.set()

    def poll_interval(self, interval: float, end_interval: float, watch: float = 60.0) -> float:
        """How long to wait for the next read: ``interval``, or at most ``end_interval`` for ``watch`` seconds
        after the run announced its end (its lock is released once its cluster and summary are done)."""
        if self.ended_at is not None and time.monotonic() - self.ended_at < watch:
            return min(interval, end_interval)
        return interval

    def requeued(self) -> None:
        """Tell the run writing the store that prompts were added to its requeue record."""
        self.client.log_event(REQUEUE_TOPIC, {"store": self.location.url})

    def close(self) -> None:
        """Stop listening."""
        self.client.unsubscribe_topic(COMMIT_TOPIC)
