"""Client side of admission: the partitions every worker admits, as the workers announce them.

Each worker sizes its own window (:mod:`daskgen.worker.admission`) and announces it on
:data:`~daskgen.worker.admission.WINDOW_TOPIC`; the client's :class:`WindowBoard` keeps the sum
submitted and sends each partition to the worker with the most free admitted slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from daskgen.worker.admission import WINDOW_TOPIC

logger = logging.getLogger(__name__)


class WindowBoard:
    """Client side: the partitions every worker admits, kept current by the workers' announcements.

    Workers announce their window on :data:`WINDOW_TOPIC` whenever it changes; the client keeps the
    sum of the announced windows submitted.  :meth:`refresh` re-reads every worker's advertised
    resource from the scheduler (workers that joined or left).  Each announcement calls ``on_change``
    (from the client's event loop; the runner's :meth:`~daskgen.client.finished.FinishedPartitions.wake`), so that a
    waiting client submits at once.
    """

    def __init__(self, client: object, resource: str, on_change: Callable[[], None] | None = None) -> None:
        self.client, self.resource, self.on_change = client, resource, on_change
        self.windows: dict[str, int] = {}
        self.assigned: dict[str, str] = {}  # task key -> the worker it was sent to
        self.load: dict[str, int] = {}  # worker -> partitions sent to it and not collected yet
        client.subscribe_topic(WINDOW_TOPIC, self._on_event)  # type: ignore[attr-defined]

    def _on_event(self, event: tuple[float, dict]) -> None:
        _, msg = event
        self.windows[msg["worker"]] = int(msg["window"])
        if self.on_change is not None:
            self.on_change()

    def refresh(self) -> None:
        """Re-read every worker's advertised amount from the scheduler."""
        workers = self.client.scheduler_info(n_workers=-1)["workers"]  # type: ignore[attr-defined]
        self.windows = {addr: int(w.get("resources", {}).get(self.resource, 0)) for addr, w in workers.items()}

    def pick(self) -> str | None:
        """The worker with the most free admitted slots, or ``None`` when every worker is full.

        Partitions go to the worker that asked for them: left to itself the scheduler would send
        them to the least busy worker, which under ``window: auto`` is the one that admits the least.
        """
        best, free = None, 0
        for worker, window in self.windows.items():
            if window - self.load.get(worker, 0) > free:
                best, free = worker, window - self.load.get(worker, 0)
        return best

    def assign(self, key: str, worker: str | None) -> None:
        """Record that the task ``key`` goes to ``worker`` (``None``: anywhere); it takes a slot at once."""
        if worker is not None:
            self.assigned[key] = worker
            self.load[worker] = self.load.get(worker, 0) + 1

    def release(self, key: str) -> None:
        """The task ``key`` was collected: its worker has a slot again."""
        worker = self.assigned.pop(key, None)
        if worker is not None:
            self.load[worker] -= 1

    def total(self) -> int:
        """Partitions all workers admit together."""
        return sum(self.windows.values())

    def close(self) -> None:
        """Stop listening."""
        try:
            self.client.unsubscribe_topic(WINDOW_TOPIC)  # type: ignore[attr-defined]
        except Exception:  # the client may be closing
            logger.debug("unsubscribe from %s failed", WINDOW_TOPIC, exc_info=True)
