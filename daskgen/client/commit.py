"""Client-side commits: ``error``, ``committed_at``, ``commit_seq``, then ``status`` (the checkpoint) of
finished rows, then the commit log's head (:mod:`daskgen.store.commit_log`).

The client is the only writer of ``status``; it writes a row's status only after the row's data
landed (the partition task returned), so a row marked done always has its data.  Every commit has the
next sequence number; the rows whose status it changes record it in ``commit_seq``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from daskgen import tunables
from daskgen.store.layout import DONE, FAILED, PENDING

if TYPE_CHECKING:
    from daskgen.client.live import LiveRun


def commit_overlong(run: LiveRun) -> None:
    """Commit the prompts longer than ``max_prompt_tokens`` (with ``--skip-overlong``) as failed with the reason."""
    overlong, layout = run.plan.prompts.overlong, run.plan.layout
    pending = [i for i in overlong if run.status[i] == PENDING]
    for start in layout.partitions_of(pending):
        stop = min(start + layout.partition_size, layout.n_prompts)
        rows = [i for i in pending if start <= i < stop]
        commit_rows(run, start, stop, {i: overlong[i] for i in rows})


@dataclass
class Outcome:
    """Rows of one finished partition to commit."""

    start: int
    stop: int
    done: list[int]
    failed: dict[int, str]
    notes: dict[int, str]
    tokens: int = 0  # response tokens of the partition's samples


def commit_outcomes(run: LiveRun, outcomes: list[Outcome]) -> None:
    """Commit finished partitions with one write of ``status`` (and ``error``/``committed_at``) per
    coarse chunk they fall in, instead of one per partition.

    Rows in between keep their in-memory status (the client is the only writer of ``status``).
    """
    groups: dict[int, list[Outcome]] = {}
    rows = run.plan.store.commit_chunk_rows
    for o in outcomes:
        groups.setdefault(o.start // rows, []).append(o)
    for chunk, group in groups.items():
        start = chunk * rows  # the whole coarse chunk: written without reading it back
        stop = min(start + rows, run.plan.layout.n_prompts)
        failed = {r: m for o in group for r, m in o.failed.items()}
        notes = {r: m for o in group for r, m in o.notes.items()}
        done = [r for o in group for r in o.done]
        commit_rows(run, start, stop, failed, done=done, notes=notes)
        run.count_committed(len(done) + len(failed), sum(o.tokens for o in group), failed)


def commit_rows(
    run: LiveRun,
    start: int,
    stop: int,
    failed: dict[int, str],
    done: Sequence[int] = (),
    notes: dict[int, str] | None = None,
) -> None:
    """Write error, commit times, then status of rows ``[start, stop)``; update the in-memory mask.

    The in-memory ``run.status``/``run.committed_at`` are authoritative (the client is the only
    writer), so the rows in between are written back unchanged.  ``notes`` (e.g. verifier
    exceptions) go into ``error`` of rows that are nevertheless done.
    """
    new = _new_status(run, start, stop, failed, done)
    errors = _new_errors(run, start, stop, failed, done, notes)
    now, rows = time.time(), [*done, *failed]
    times = _new_commit_times(run, start, stop, rows, now)
    seq, head = _new_commit_seq(run, start, new)
    run.plan.store.commit(start, new, errors, times, seq, head)
    run.record_commit(start, new, rows, now, seq)


def reset_rows(run: LiveRun, rows: Sequence[int]) -> None:
    """Commit ``rows`` back to pending (a follower requeued them, :mod:`daskgen.client.requeue`): one commit per
    coarse chunk, the rows losing their commit time; their stored samples are cleared by the caller."""
    size = run.plan.store.commit_chunk_rows
    for chunk in sorted({r // size for r in rows}):
        start = chunk * size
        stop = min(start + size, run.plan.layout.n_prompts)
        mine = [r for r in rows if start <= r < stop]
        new = run.status[start:stop].copy()
        new[[r - start for r in mine]] = PENDING
        run.clear_commit_times(mine)
        seq, head = _new_commit_seq(run, start, new)
        run.plan.store.commit(start, new, None, run.committed_at[start:stop].copy(), seq, head)
        run.record_commit(start, new, [], time.time(), seq)


def _new_commit_seq(run: LiveRun, start: int, new: np.ndarray) -> tuple[np.ndarray, int]:
    """``commit_seq`` of rows ``[start, start + len(new))`` after this commit, and this commit's number.

    Rows whose status this commit changes get the next sequence number; the others keep theirs, so a
    follower (:mod:`daskgen.stream`) delivers each new outcome of a row once, in commit order.
    """
    seq, number = run.commit_seq[start : start + len(new)].copy(), run.next_seq()
    seq[new != run.status[start : start + len(new)]] = number
    return seq, number


def _new_status(run: LiveRun, start: int, stop: int, failed: dict[int, str], done: Sequence[int]) -> np.ndarray:
    """The ``status`` of rows ``[start, stop)`` after this commit: ``done`` rows done, ``failed`` rows failed."""
    new = run.status[start:stop].copy()
    for i in done:
        new[i - start] = DONE
    for i in failed:
        new[i - start] = FAILED
    return new


def _new_commit_times(run: LiveRun, start: int, stop: int, rows: list[int], now: float) -> np.ndarray:
    """``committed_at`` of rows ``[start, stop)`` after this commit: ``now`` for the committed ``rows``."""
    times = run.committed_at[start:stop].copy()
    times[[r - start for r in rows]] = now
    return times


def _new_errors(
    run: LiveRun, start: int, stop: int, failed: dict[int, str], done: Sequence[int], notes: dict[int, str] | None
) -> list[str] | None:
    """The ``error`` column of rows ``[start, stop)`` after this commit, or ``None`` when it stays as it is.

    Failed rows get their message, done rows their note (or an empty string, clearing an earlier failure).
    """
    if not (failed or notes or np.any(run.status[list(done)] == FAILED)):
        return None
    errors = [str(e) for e in run.plan.store.read_region(start, stop, ("error",))["error"]]
    for i in done:
        errors[i - start] = (notes or {}).get(i, "")
    for i, msg in failed.items():
        errors[i - start] = msg
    return errors


class CommitBatch:
    """Finished partitions waiting to be committed together: at most one commit per
    ``daskgen.commit-interval`` (0.5 s; the first at once), each covering everything that finished since.

    One commit costs the client a few ms of CPU whatever it covers (Zarr chunk writes of ``status``
    and ``committed_at``), so the interval bounds the commits' share of the client's core (about 1 %
    at 0.5 s).  A crash loses at most the commits of one interval, not the data: those rows stay
    pending and the next run keeps their stored samples instead of regenerating them; a stop
    (target, deadline, signal) commits at once."""

    def __init__(self, run: LiveRun, on_commit: Callable[[int], None] | None = None) -> None:
        self.run = run
        self.on_commit = on_commit  # called with the newest commit's sequence number after each flush
        self.interval = tunables.seconds("commit-interval")  # read once per run
        self.outcomes: list[Outcome] = []
        self.since: float | None = None
        self.last = float("-inf")  # time.monotonic() of the last commit

    def add(self, outcomes: list[Outcome]) -> None:
        """Queue finished partitions."""
        if outcomes and self.since is None:
            self.since = time.monotonic()
        self.outcomes += outcomes

    def due_in(self) -> float:
        """Seconds until the queued partitions must be committed (``inf`` when none are queued)."""
        if self.since is None:
            return float("inf")
        return max(0.0, self.last + self.interval - time.monotonic())

    def flush(self, force: bool = False) -> None:
        """Commit the queued partitions if they are due (or ``force``)."""
        if self.outcomes and (force or self.due_in() == 0.0):
            outcomes, self.outcomes, self.since = self.outcomes, [], None
            self.last = time.monotonic()
            commit_outcomes(self.run, outcomes)
            if self.on_commit is not None:
                self.on_commit(self.run.last_seq)
