"""How many partitions a worker admits at once: sized from its engine's occupancy.

A partition ends with its slowest sample, so the number of partitions that keeps an engine's batch
full depends on the length distribution, which nobody knows in advance.  With ``window: auto`` each
worker measures it instead: it counts the requests its engine holds (running or queued, i.e. every
sample of its running partitions that has not finished) and admits more partitions whenever that is
below :data:`OCCUPANCY_TARGET` × the engine's batch slots — so a heavy tail, whose partitions are mostly
finished samples waiting for one long one, gets many partitions in flight, and a light one few.  The window
shrinks only once the engine has held its target for :data:`SHRINK_AFTER_READINGS` readings in a row: a fast
engine (short answers, a small model) empties its queue faster than finished partitions are replaced, so its
readings swing between an empty queue and a full one, and it must keep the partitions it was given coming.
The amount is advertised as the worker's ``daskgen-engine`` resource (the scheduler then hands it
that many partitions at once) and announced to the client, which keeps the sum of all advertised
amounts submitted.  ``window: N`` fixes it at ``N``.

A partition task leaves its worker thread slot as soon as it starts (:mod:`daskgen.worker.thread_slots`),
so the window does not depend on the worker's thread count; with ``daskgen.partitions-hold-threads: true``
tasks keep their slot, the thread count caps the window, and the worker reports how many it wanted.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: Requests kept outstanding per batch slot: one batch running and about one batch queued behind it,
#: so a slot that frees up is refilled at the next step.
OCCUPANCY_TARGET = 2.0
#: Readings in a row at or above the target before the window comes down (one partition per reading from
#: then on).  Any reading below the target starts the count again: a queue that empties between two
#: readings is a pipeline that needs its partitions, not one that has too many.
SHRINK_AFTER_READINGS = 4
#: Capacity assumed for engines that do not report one (``Engine.capacity`` is ``None``).
AUTO_DEFAULT_CAPACITY = 256
#: The starting window (before the engine reports anything) is ``AUTO_FILL x capacity`` requests.
AUTO_FILL = 8
#: Bounds of an automatic window, in partitions per worker (the upper one also bounds memory:
#: a partition in flight holds its prompts; the client's ``max_prompts_in_memory`` caps the total).
AUTO_MIN_WINDOW, AUTO_MAX_WINDOW = 2, 64
#: Bounds of the starting window.
START_MAX_WINDOW = 16
#: Topic of the events by which workers announce their window to the client.
WINDOW_TOPIC = "daskgen-window"


def wanted_window(window: int | str, capacity: int | None, requests_per_partition: int) -> int:
    """Partitions a worker wants in flight when its engine starts, whatever its task slots.

    An integer ``window`` is used as given.  ``"auto"`` starts at ``AUTO_FILL x capacity`` requests
    divided by ``requests_per_partition``, rounded up and clipped to ``[2, 16]`` partitions; from
    then on :class:`Admission` follows the engine's occupancy.
    """
    if window == "auto":
        wanted = math.ceil(AUTO_FILL * (capacity or AUTO_DEFAULT_CAPACITY) / max(1, requests_per_partition))
        return min(START_MAX_WINDOW, max(AUTO_MIN_WINDOW, wanted))
    return max(1, int(window))


def resolve_window(window: int | str, capacity: int | None, requests_per_partition: int, slots: int | None) -> int:
    """Partitions a worker admits when its engine starts: :func:`wanted_window`, capped by ``slots``.

    ``slots`` is the worker's task slots (``nthreads``) when partition tasks hold one for their whole
    run (``daskgen.partitions-hold-threads``), else ``None``: partition tasks leave their slot as soon
    as they start (:mod:`daskgen.worker.thread_slots`), and nothing but the window bounds them.
    """
    wanted = wanted_window(window, capacity, requests_per_partition)
    if slots is not None and wanted > slots:
        logger.warning(
            "window %d is more than this worker's %d task slots; using %d. Give workers more threads "
            "(dask worker --nthreads %d), or let partitions leave their thread slot "
            "(daskgen.partitions-hold-threads: false).",
            wanted,
            slots,
            slots,
            wanted,
        )
        return max(1, slots)
    return wanted


@dataclass(frozen=True)
class Admission:
    """The occupancy rule of one worker.

    Attributes:
        capacity: the engine's batch slots (``Engine.capacity``, or :data:`AUTO_DEFAULT_CAPACITY`).
        requests_per_partition: engine requests one partition makes (prompts x samples).
        slots: the worker's task slots when partitions hold one (``None``: they do not), capping the window.
    """

    capacity: int
    requests_per_partition: int
    slots: int | None = None

    @classmethod
    def for_engine(cls, capacity: int | None, requests_per_partition: int, slots: int | None) -> Admission:
        """The rule for an engine with ``capacity`` slots on a worker with ``slots`` task slots (or unbounded)."""
        return cls(capacity or AUTO_DEFAULT_CAPACITY, max(1, requests_per_partition), slots)

    def at_target(self, outstanding_requests: int) -> bool:
        """Whether the engine holds its target (:data:`OCCUPANCY_TARGET` x its capacity) of outstanding requests."""
        return outstanding_requests >= OCCUPANCY_TARGET * self.capacity

    def wanted(self, running_partitions: int, outstanding_requests: int, current: int = 0, held: int = 0) -> int:
        """Partitions the engine wants now, within ``[2, 64]`` (task slots aside).

        Below its target (:data:`OCCUPANCY_TARGET` x its capacity outstanding), the running partitions plus
        enough new ones to reach it, and never fewer than the ``current`` window: fewer partitions running
        than admitted means the next ones are still on their way (the client and the scheduler answer a
        finished partition with a new one after a delay), and taking that as a reason to admit fewer would
        starve the engine further; an engine found empty while partitions run (every admitted one past its
        generation or still on its way) gets one partition more than that.  At or above the target, no new
        partitions; once the ``held`` readings before this one were at the target too
        (:data:`SHRINK_AFTER_READINGS` in a row with this one), the window comes down to the running ones, by
        at most one partition per reading (a fast engine's queue jumps by whole partitions between two
        readings, and one high reading must not empty the pipeline behind it).
        """
        if not self.at_target(outstanding_requests):
            deficit = OCCUPANCY_TARGET * self.capacity - outstanding_requests
            wanted = max(current, running_partitions + math.ceil(deficit / self.requests_per_partition))
            if outstanding_requests == 0 and running_partitions > 0:  # starved: the pipe to the engine is too short
                wanted += 1
        elif held + 1 < SHRINK_AFTER_READINGS:
            wanted = max(running_partitions, current)
        else:
            wanted = max(running_partitions, current - 1)
        return max(AUTO_MIN_WINDOW, min(AUTO_MAX_WINDOW, wanted))

    def follow(self, running_partitions: int, outstanding_requests: int, current: int, held: int) -> tuple[int, int]:
        """One reading of a worker's occupancy: :meth:`wanted` given the ``held`` readings in a row at the target
        before it, and the readings in a row at the target after it (0 when this one is below)."""
        wanted = self.wanted(running_partitions, outstanding_requests, current, held)
        return wanted, held + 1 if self.at_target(outstanding_requests) else 0

    def window(self, running_partitions: int, outstanding_requests: int, current: int = 0, held: int = 0) -> int:
        """Partitions to admit now: :meth:`wanted`, capped by the task slots."""
        return self.capped(self.wanted(running_partitions, outstanding_requests, current, held))

    def capped(self, wanted: int) -> int:
        """``wanted`` within this worker's task slots (unchanged when partitions hold none)."""
        return wanted if self.slots is None else max(1, min(wanted, self.slots))
