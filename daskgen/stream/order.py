"""Which committed prompts a batch takes, and in which order: commit order or a sliding input window.

``order="commit"`` hands prompts out as they were committed (:mod:`daskgen.stream.log`).  Short
samples finish first, so a consumer that trains mid-run sees short samples first.  ``order="window"``
hands them out in input order within a sliding window of ``window`` prompts: its *head* is the first
prompt (input order) not yet delivered, and a committed prompt at or past ``head + window`` waits until
the head moves.  The head moves when its prompt is delivered done or reported failed, so a failed prompt
never blocks it; once no run writes the store (the run ended or was stopped), everything committed is
delivered, in input order, and prompts that will not be generated hold nothing back.

Within one read of the commit log the window moves as a batch takes prompts, so the prompts a batch may
take are those before ``first waiting + window``, where *first waiting* is the first prompt not
committed yet (:attr:`~daskgen.stream.log.Snapshot.first_waiting`).  :class:`HeadClock` measures how
long committed prompts were held back by the head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from daskgen.store.layout import DONE
from daskgen.stream.log import Snapshot


def eligible(
    snap: Snapshot, todo: np.ndarray, window: int | None, ended: bool, prompts: int, counts: np.ndarray
) -> np.ndarray:
    """The indices of ``todo`` a batch of ``prompts`` counted prompts may take, in delivery order: commit order
    (``window`` None), or input order within the window (all of them, in input order, once ``ended``); in
    input order only up to the ``prompts``-th counted one (sorting the rest would be wasted).  ``counts`` (per
    snapshot index) marks the prompts a batch counts: the done ones (:func:`counted`)."""
    if window is None:
        return todo
    rows = snap.rows[todo]
    keep = rows < snap.first_waiting + window if not ended else np.ones(len(rows), bool)
    done = rows[keep & counts[todo]]
    if len(done) > prompts:
        keep &= rows <= np.partition(done, prompts - 1)[prompts - 1]
    todo, rows = todo[keep], rows[keep]
    return todo[np.argsort(rows, kind="stable")]


def counted(snap: Snapshot) -> np.ndarray:
    """Per snapshot index: True for the done prompts (what a batch of ``batch_prompts`` counts)."""
    return snap.status == DONE


def take(candidates: np.ndarray, prompts: int, counts: np.ndarray) -> np.ndarray:
    """``candidates`` up to and including the ``prompts``-th counted one (or all of them)."""
    done = np.flatnonzero(counts[candidates])
    return candidates[: done[prompts - 1] + 1] if len(done) >= prompts else candidates


def held_back(snap: Snapshot, todo: np.ndarray, window: int) -> tuple[int, int]:
    """The window's head (the first prompt not delivered) and how many committed prompts wait past it."""
    rows = snap.rows[todo]
    head = min(snap.first_waiting, int(rows.min(initial=snap.first_waiting)))
    return head, int(np.count_nonzero(rows >= snap.first_waiting + window))


@dataclass
class WindowStats:
    """Where a window-order follower is (``Follower.stats``).

    Attributes
    ----------
    window:
        The window's size, in prompts.
    head:
        The first prompt (input order) not yet delivered.
    held:
        Committed prompts waiting past the window at the last read of the commit log.
    head_wait:
        Seconds since the current head began holding prompts back (0 when it holds none).
    total_head_wait, max_head_wait:
        Seconds prompts were held back by the head over this follower's batches, summed, and the
        longest wait before one batch.
    """

    window: int
    head: int = 0
    held: int = 0
    head_wait: float = 0.0
    total_head_wait: float = 0.0
    max_head_wait: float = 0.0


class HeadClock:
    """Times how long the window's head holds committed prompts back, between reads of the commit log."""

    def __init__(self, window: int) -> None:
        self.stats = WindowStats(window)
        self.since: float | None = None  # when the current head began holding prompts back
        self.last: float | None = None  # the previous observation, while holding
        self.pending = 0.0  # held-back seconds not yet charged to a batch

    def observe(self, head: int, held: int) -> None:
        """Record one read: the head and the prompts held past the window."""
        now = time.monotonic()
        if self.last is not None:
            self.pending += now - self.last
        if not held or head != self.stats.head:
            self.since = None
        if held and self.since is None:
            self.since = now
        self.last = now if held else None
        self.stats.head, self.stats.held = head, held
        self.stats.head_wait = 0.0 if self.since is None else now - self.since

    def charge(self) -> float:
        """The held-back seconds since the last batch (for the batch handed out now)."""
        waited, self.pending = self.pending, 0.0
        self.stats.total_head_wait += waited
        self.stats.max_head_wait = max(self.stats.max_head_wait, waited)
        return waited
