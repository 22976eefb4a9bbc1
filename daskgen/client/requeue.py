"""Taking the requeue record (:mod:`daskgen.store.records.requeue`): prompts a follower sent back are generated again.

For each entry ``(row, seq)`` of the record: a row still done by commit ``seq`` is committed back to pending
(the client's commit path, :func:`~daskgen.client.commit.reset_rows`); its stored samples are then cleared
(fill values, so the new attempt keeps none of them, :mod:`daskgen.worker.samples.continuation`); then the entries
leave the record.  An entry whose row was generated again since, or failed, is dropped.  Each step is safe to
repeat, so a crash anywhere in between loses nothing and regenerates nothing twice.  The new attempt's commit
has a newer sequence number than any cursor's position, so every follower receives the regenerated prompt once.

The record is taken twice over:

* **At the start** of a run (:func:`take_requeued`, under the store's lock, before anything is scheduled).  A
  pending row still listed (a run stopped between the steps above) is cleared again.
* **While the run streams** (:class:`LiveRequeue`): once per ``daskgen.requeue.poll-interval`` (one small read),
  at once when a follower on the run's cluster announces an addition (a Dask event on :data:`REQUEUE_TOPIC`),
  and once more when every row is finished, before the run ends.  The rows reset go back into the run's pending
  work (one task per partition).  A partition that has a task in flight, waiting for a retry or not yet
  submitted is left listed until it has none: its worker rewrites the partition's whole region, which must
  not race the clearing.  A pending row still listed is not cleared here (it is being generated again): a
  follower that read an older commit log sent it back late, and its entry is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from daskgen import tunables
from daskgen.client.commit import reset_rows
from daskgen.client.plan import pending_rows
from daskgen.errors import StoreError
from daskgen.store.commit_log import REQUEUE_KEY, REQUEUE_TOPIC
from daskgen.store.layout import DONE, PENDING, empty_region
from daskgen.store.location import announced_for
from daskgen.store.records.requeue import Entry, drop_requeue, read_requeue

if TYPE_CHECKING:
    from daskgen.client.live import LiveRun
    from daskgen.worker.task import PartitionTask

logger = logging.getLogger(__name__)


def take_requeued(run: LiveRun) -> int:
    """At the start of a run: reset the requeued prompts of the record to pending and clear their samples (and
    those of pending rows still listed); how many were reset."""
    return len(_take(run, read_requeue(run.plan.store.location), clear_pending=True))


def _take(run: LiveRun, entries: set[Entry], clear_pending: bool) -> list[int]:
    """Reset the ``entries`` still done by their commit, clear their samples, drop the entries; the rows reset.

    ``clear_pending``: also clear the samples of listed rows already pending (at the start of a run only)."""
    if not entries:
        return []
    store = run.plan.store
    reset = sorted(r for r, s in entries if run.status[r] == DONE and run.commit_seq[r] == s)
    if reset and store.attrs.packed:
        raise StoreError(
            f"{store.url!r} is packed and its requeue record ({REQUEUE_KEY}) sends {len(reset)} prompt(s) back for "
            "generation: a packed store's partitions share shard files, so workers may not write them. Run "
            f"`daskgen unpack {store.url}`, then the run again (or delete {REQUEUE_KEY} to keep those prompts done)."
        )
    if reset:
        reset_rows(run, reset)
    _clear_samples(run, sorted({r for r, _ in entries if run.status[r] == PENDING}) if clear_pending else reset)
    drop_requeue(store.location, entries)
    if reset:
        run.count_requeued(len(reset))
        logger.info("%s: %d requeued prompt(s) are pending again, to be generated anew", store.url, len(reset))
    return reset


def _clear_samples(run: LiveRun, rows: list[int]) -> None:
    """Write fill values over the samples of ``rows`` (contiguous runs at once), ``finish_reason`` first: a
    cleared finish reason is what makes a new attempt generate the row from scratch."""
    store, layout = run.plan.store, run.plan.layout
    ranked = np.asarray(rows, dtype=np.int64)
    for part in np.split(ranked, np.flatnonzero(np.diff(ranked) != 1) + 1):
        if len(part):
            region = empty_region(layout, len(part))
            start = int(part[0])
            store.write_region(start, {"finish_reason": region.pop("finish_reason")})
            store.write_region(start, region)


class LiveRequeue:
    """A streaming run's look at the requeue record: the rows followers send back, regenerated in the same run.

    Parameters
    ----------
    client:
        The run's ``distributed.Client`` (followers on its cluster announce additions on :data:`REQUEUE_TOPIC`).
    run:
        The live run.
    busy:
        The partition starts that have a task in flight or waiting for a retry (the driver's).
    wake:
        Called (from the client's event loop) when a follower announces an addition: ends the driver's wait.
    """

    def __init__(
        self, client: Any, run: LiveRun, busy: Callable[[], set[int]], wake: Callable[[], None] | None = None
    ) -> None:
        self.client, self.run, self.busy, self.wake = client, run, busy, wake
        self.interval = tunables.seconds("requeue.poll-interval")
        self.announced = threading.Event()
        self.looked = time.monotonic()
        self.unstarted: set[int] | None = None  # partitions the run's task stream has yet to hand out
        client.subscribe_topic(REQUEUE_TOPIC, self._on_event)

    def _on_event(self, event: tuple[float, Any]) -> None:
        if announced_for(event, self.run.plan.store.location) is not None:
            self.announced.set()
            if self.wake is not None:
                self.wake()

    def track(self, tasks: Iterator[PartitionTask]) -> Iterator[PartitionTask]:
        """``tasks`` (the run's lazy task stream, which computes its pending rows as it starts), noting the
        partitions it has yet to hand out."""
        pending = np.flatnonzero(pending_rows(self.run.plan, self.run.status))
        self.unstarted = set(self.run.plan.layout.partitions_of(pending))
        for task in tasks:
            self.unstarted.discard(task.start)
            yield task

    def due(self, force: bool = False) -> bool:
        """True when the record is to be read now: a follower announced an addition, it was last read a poll
        interval ago, or ``force``; never during a stop (what is listed then waits for the next run)."""
        if self.unstarted is None or self.run.stop.stopping:
            return False
        return force or self.announced.is_set() or time.monotonic() - self.looked >= self.interval

    def take(self, force: bool = False) -> list[int]:
        """When :meth:`due` (``force``: the run is about to end): reset the rows the record sends back whose
        partitions are idle, clear their samples, drop their entries; the rows reset (to generate again)."""
        if not self.due(force):
            return []
        self.announced.clear()
        self.looked = time.monotonic()
        entries = read_requeue(self.run.plan.store.location)
        if not entries:
            return []
        busy, layout = self.busy() | (self.unstarted or set()), self.run.plan.layout
        return _take(self.run, {(r, s) for r, s in entries if layout.partition_of(r) not in busy}, clear_pending=False)

    def close(self) -> None:
        """Stop listening."""
        try:
            self.client.unsubscribe_topic(REQUEUE_TOPIC)
        except Exception:  # the client may be closing
            logger.debug("unsubscribe from %s failed", REQUEUE_TOPIC, exc_info=True)
