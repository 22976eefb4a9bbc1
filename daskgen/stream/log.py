"""Reading the commit log of a store: which prompts were committed after a position, in commit order.

Order is ``(commit_seq, row)``.  A run writes, per commit, ``commit_seq`` of the rows whose status it
changes, then ``status``, then the head (the commit's number, :mod:`daskgen.store.commit_log`).  A
reader reads whether a live run holds the store's lock, then the head, then ``status``, then
``commit_seq``: every row with ``status`` done or failed and a ``commit_seq`` at or below the head is then
a finished commit's row, with its data complete.  Rows of later commits are left for the next read, so a
position never passes a row that is still to come (commits get ever larger numbers).  With no live run
the store does not change, and every committed row counts.

Stores from before commit sequence numbers have no ``commit_seq``: their rows are all of "commit 0",
ordered by row, and are delivered once no run writes the store (a run of this version adds the array
when it resumes one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from daskgen.store.commit_log import read_head
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import DONE, FAILED, PENDING
from daskgen.store.records.cursors import Ahead, CursorState, Position, not_acknowledged
from daskgen.store.records.lock import live_holder


@dataclass
class Snapshot:
    """The committed rows after a position, in commit order, as read at one moment.

    Attributes
    ----------
    rows, seqs, status:
        Row indices, their commit sequence numbers and their status (done or failed), in commit order.
    pending:
        Rows of the store still pending.
    live:
        True when a live run held the store's lock while it was read.
    head:
        The commit log's head when read (what a cheap poll compares).
    first_waiting:
        The first row (input order) not committed yet (pending, or of a commit newer than the head);
        the number of rows when there is none.
    """

    rows: np.ndarray
    seqs: np.ndarray
    status: np.ndarray
    pending: int
    live: bool
    head: int
    first_waiting: int

    def unacknowledged(self, state: CursorState) -> np.ndarray:
        """Indices (commit order) of the committed rows that ``state`` did not acknowledge."""
        return np.flatnonzero(not_acknowledged(state, self.seqs, self.rows))

    def after_delivering(self, state: CursorState, taken: np.ndarray) -> tuple[Position, Ahead]:
        """What is acknowledged once ``state``'s commits and the ``taken`` indices are: the position moves
        over every delivered commit with nothing undelivered before it; the rest is ``ahead``."""
        at = state.position
        todo = np.flatnonzero((self.seqs > at.seq) | ((self.seqs == at.seq) & (self.rows > at.row)))
        if not state.ahead and np.array_equal(todo[: len(taken)], taken):  # commit order: a prefix
            return (Position(int(self.seqs[taken[-1]]), int(self.rows[taken[-1]])) if len(taken) else at), ()
        delivered = np.isin(todo, taken) | ~not_acknowledged(state, self.seqs[todo], self.rows[todo])
        gap = np.flatnonzero(~delivered)
        upto = len(todo) if not len(gap) else int(gap[0])
        position = state.position
        if upto:
            last = todo[upto - 1]
            position = Position(int(self.seqs[last]), int(self.rows[last]))
        later = todo[upto:][delivered[upto:]]
        pairs = {(int(self.seqs[i]), int(self.rows[i])) for i in later}
        pairs |= {pair for pair in state.ahead if pair > (position.seq, position.row)}
        return position, tuple(sorted(pairs))


def writer_live(store: GenerationStore) -> bool:
    """True when a live run holds the store's lock (a dead or stale lock does not count)."""
    return live_holder(store.location) is not None


def read_snapshot(store: GenerationStore) -> Snapshot:
    """Read the commit log once (lock, head, ``status``, ``commit_seq``, in that order; see the module doc)."""
    live = writer_live(store)
    head = read_head(store.location)
    status = store.read_status()
    has_seq = store.has_array("commit_seq")
    seqs = store.read_region(0, len(status), ("commit_seq",))["commit_seq"] if has_seq else np.zeros(len(status))
    seqs = seqs.astype(np.int64)
    live = live or writer_live(store)  # a run that started while the arrays were read: trust only its head
    horizon = head if live else max(head, int(seqs.max(initial=0)))
    if live and not has_seq:
        horizon = -1  # an older daskgen writes it: no order to trust until it is done
    committed = np.isin(status, (DONE, FAILED)) & (seqs <= horizon)
    rows = np.flatnonzero(committed)
    order = np.lexsort((rows, seqs[rows]))
    rows = rows[order]
    pending = int(np.count_nonzero(status == PENDING))
    waiting = np.flatnonzero(~committed)
    first_waiting = int(waiting[0]) if len(waiting) else len(status)
    return Snapshot(rows, seqs[rows], status[rows], pending, live, head, first_waiting)
