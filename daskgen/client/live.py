"""The live state of a run: what changes while partitions stream, owned by one client-side object.

:class:`~daskgen.client.plan.Plan` is what was decided before any engine started and never changes;
:class:`LiveRun` is what the run learns as it goes: the checkpoint mask and commit times (the client is
their only writer), counters for the summary, rows aborted under restarts, and :class:`StopControl`,
whether and why the run stops and until when it still collects.  Other modules read these fields and
change them only through the methods below.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from daskgen.client.interrupt import Interrupt
    from daskgen.client.plan import Plan
    from daskgen.worker.partition import PartitionResult


@dataclass
class StopControl:
    """Whether the run is stopping: the reason, and the moment it stops waiting for partitions.

    ``interrupt`` watches signals; ``allocation_end`` is the end of the batch allocation (seconds since
    the epoch), or ``None``.
    """

    interrupt: Interrupt | None = None
    allocation_end: float | None = None
    reason: str | None = None
    collect_until: float | None = None  # time.monotonic() by which a stopped run stops waiting

    @property
    def stopping(self) -> bool:
        """True once a stop began."""
        return self.reason is not None

    def begin(self, reason: str, grace_s: float, collect_until: float | None = None) -> None:
        """Record a stop: nothing more is submitted; partitions are collected until the grace period ends."""
        self.reason = reason
        if collect_until is not None:
            self.collect_until = collect_until
        elif self.collect_until is None:
            self.collect_until = time.monotonic() + grace_s

    def grace_over(self) -> bool:
        """True when a stopped run must stop waiting for partitions."""
        return self.collect_until is not None and time.monotonic() >= self.collect_until

    def interrupted(self) -> str | None:
        """Why the run was interrupted from outside (a signal, the allocation's end), or ``None``."""
        return self.interrupt.reason if self.interrupt is not None and self.interrupt.requested else None


@dataclass
class LiveRun:
    """One run in progress, for a :class:`~daskgen.client.plan.Plan`.

    ``status`` and ``committed_at`` mirror the store's commit record (read under the lock; the client is
    their only writer), so they are authoritative for the rows in between commits.
    """

    plan: Plan
    status: np.ndarray
    committed_at: np.ndarray
    stop: StopControl = field(default_factory=StopControl)
    lock: Any = None
    peak_prompts: int = 0
    partial_samples: int = 0
    partial_tokens: int = 0
    carried_tokens: int = 0
    partial_starts: set[int] = field(default_factory=set)  # partitions left with partial responses
    generating_since: float | None = None
    aborts: dict[int, int] = field(default_factory=dict)  # row -> times requeued after an abort

    def record_commit(self, start: int, status: np.ndarray, rows: list[int], when: float) -> None:
        """Rows ``[start, start + len(status))`` now hold ``status``; ``rows`` were committed at ``when``."""
        self.committed_at[rows] = when
        self.status[start : start + len(status)] = status

    def count_result(self, result: PartitionResult) -> None:
        """Count what a finished partition carried over and left partial."""
        self.carried_tokens += result.carried_tokens
        if result.partial_samples:
            self.partial_starts.add(result.start)
        if self.stop.stopping:  # only a stop leaves partial responses in the store until the next run
            self.partial_samples += result.partial_samples
            self.partial_tokens += result.partial_tokens

    def count_abort(self, row: int) -> int:
        """One more abort of ``row`` in this run; returns how many it had."""
        self.aborts[row] = self.aborts.get(row, 0) + 1
        return self.aborts[row]

    def note_in_flight(self, prompts: int) -> None:
        """Prompts in flight now (the peak goes into the summary)."""
        self.peak_prompts = max(self.peak_prompts, prompts)

    def generating(self) -> None:
        """Engines are ready: the generating time starts (for the tail share)."""
        self.generating_since = time.time()
