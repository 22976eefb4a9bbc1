"""The follower: batches of newly finished prompt groups, each acknowledged once.

:class:`Follower` iterates :class:`Batch` objects.  A batch holds up to ``batch_prompts`` done prompt
groups (all samples of a prompt together) not delivered before, plus the failed prompts among them
(reported with their errors, never dropped), in commit order or in input order within a sliding window
(:mod:`daskgen.stream.order`).  Acknowledging a batch
(:meth:`Batch.ack`, or the next iteration with ``auto_ack``) saves the cursor (:mod:`daskgen.store.records.cursors`):
a follower started again with the same cursor name resumes after the last acknowledged batch, so after
an ack nothing is delivered twice and nothing is skipped (order and completeness: :mod:`daskgen.stream.log`).
A batch that was delivered but not acknowledged is delivered again, with the same :attr:`Batch.number`.
With ``max_staleness`` (:mod:`daskgen.stream.staleness`) too-stale samples are flagged, or their prompts are
sent back for generation (requeue record written before the batch is handed out) and not delivered.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import numpy as np

from daskgen import tunables
from daskgen.errors import FollowTimeout, StoreError
from daskgen.formats.read import PromptIds, read_rows
from daskgen.store.commit_log import read_head
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import DONE, FAILED, STALE_FIELD
from daskgen.store.location import StoreRef, locate
from daskgen.store.records.cursors import Ahead, Cursor, CursorState, Position
from daskgen.store.records.requeue import add_requeue, read_requeue
from daskgen.stream.events import CommitEvents
from daskgen.stream.formats import BatchImages, batch_data, fields_to_read
from daskgen.stream.log import Snapshot, read_snapshot, writer_live
from daskgen.stream.options import FollowOptions
from daskgen.stream.order import HeadClock, WindowStats, counted, eligible, held_back, take
from daskgen.stream.staleness import Staleness

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    """One delivery: done prompt groups (in the follower's order), and the failed prompts among them.

    Attributes
    ----------
    data:
        The done prompts' samples in the follower's format (xarray ``Dataset`` over ``prompt``,
        ``TensorDict`` / ``DataProto`` / list of dicts with one entry per generated sample).
    prompts, prompt_ids:
        Row indices (``prompt_index``) and ids of the done prompts, in delivery order.
    failed:
        ``{prompt_index: error}`` of the failed prompts delivered with them.
    number:
        The cursor's batch number (0, 1, ...): a batch delivered again after a crash has the same number,
        so a sink can name its output by it and overwrite a half-finished one.
    start, end, ahead:
        The cursor's commit-order position before and after the batch, and the commits after ``end`` that
        are delivered once this batch is (``order="window"`` delivers out of commit order).
    head, head_wait:
        With ``order="window"``: the window's head once this batch is delivered (the first prompt, in input
        order, not delivered), and the seconds committed prompts were held back by the head before it.
    stale, requeued:
        With ``max_staleness``: the samples delivered flagged ``stale``, and the row indices of the prompts sent
        back for generation (``stale="regenerate"``) instead of being delivered.
    """

    data: Any
    prompts: np.ndarray
    prompt_ids: np.ndarray
    failed: dict[int, str]
    number: int
    start: Position
    end: Position
    follower: Follower = field(repr=False)
    ahead: Ahead = ()
    head: int | None = None
    head_wait: float = 0.0
    stale: int = 0
    requeued: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    acked: bool = False

    @property
    def name(self) -> str:
        """``batch-00000042``: a stable name for outputs written per batch."""
        return f"batch-{self.number:08d}"

    @property
    def n_failed(self) -> int:
        """Failed prompts reported in this batch."""
        return len(self.failed)

    def __len__(self) -> int:
        return len(self.prompts)

    def ack(self) -> None:
        """Record durably that this batch (and every batch before it) was consumed."""
        self.follower.ack(self)


class Follower:
    """Iterator of :class:`Batch` es of a store's newly finished prompts; see :func:`daskgen.follow`.

    ``options`` (:class:`~daskgen.stream.options.FollowOptions`), with the ``given`` ones replaced, say how
    the store is read.
    """

    def __init__(self, store: StoreRef, options: FollowOptions | None = None, **given: Any) -> None:
        options = replace(options, **given) if options else FollowOptions(**given)
        self.location = locate(store, options.storage_options)
        self.batch_prompts, self.format, self.order = options.batch_prompts, options.format, options.order
        self.pad, self.images = options.pad, BatchImages(options.multi_modal, options.image_model)
        window = options.window or int(tunables.get("follow.window"))
        self.window = window if self.order == "window" else None
        self.clock = HeadClock(window) if self.window else None
        self.fields = tuple(options.fields) if options.fields else None
        self.wait, self.timeout, self.auto_ack = options.wait, options.timeout, options.auto_ack
        k = options.max_staleness
        self.staleness = None if k is None else Staleness(k, options.stale)
        self.cursor = Cursor(self.location, options.cursor, options.cursor_dir)
        self.state = self.cursor.load()
        self.position, self.ahead, self.number = self.state.position, self.state.ahead, self.state.batches
        self.outstanding: list[Batch] = []
        self.store: GenerationStore | None = None
        self.snapshot: Snapshot | None = None
        self.prompt_ids: PromptIds | None = None
        self.saw_writer = False
        self.pending_at_end = 0
        self.poll_interval = tunables.seconds("follow.poll-interval")
        self.wake = threading.Event()
        self.events = None if options.client is None else CommitEvents(options.client, self.location, self.wake)

    # --- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Follower:
        return self

    def __next__(self) -> Batch:
        previous = self.outstanding[-1] if self.auto_ack and self.outstanding else None
        saving = None if previous is None or previous.acked else self._save_in_background(previous)
        try:
            batch = self._next_batch()
        finally:  # the previous batch is acknowledged (durably) before the next one is handed out
            if saving is not None:
                self._acknowledged(previous, saving.result())  # type: ignore[arg-type]
        self.position, self.ahead, self.number = batch.end, batch.ahead, batch.number + 1
        self.outstanding.append(batch)
        return batch

    def _next_batch(self) -> Batch:
        """The next batch, read (not yet handed out), waiting for it as the options say."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            batch = self._try_batch()
            if batch is not None:
                return batch
            self._sleep(deadline)

    def _save_in_background(self, batch: Batch) -> Future[CursorState]:
        """Start saving the cursor after ``batch`` in a thread: the write and its flush to disk overlap with
        reading the next batch, which is handed out only once the save returned."""
        state = self._state_after(batch)

        def save() -> CursorState:
            self.cursor.save(state)
            return state

        return _saver().submit(save)

    def _try_batch(self) -> Batch | None:
        """The next batch if one is ready now; raises ``StopIteration`` when there will be none."""
        snap = self._refresh()
        if snap is None:
            if not self.wait:
                raise StoreError(f"{self.location.url!r} is not a daskgen store (yet): nothing to follow.")
            return None
        todo = snap.unacknowledged(self.delivered)
        ended = not self.wait or self._ended(snap)
        if self.clock is not None and self.window is not None:
            head, held = held_back(snap, todo, self.window)
            self.clock.observe(head, 0 if ended else held)
        counts, stale, bound = counted(snap), np.zeros(len(snap.rows), dtype=bool), None
        if self.staleness is not None:
            assert self.store is not None
            bound = self.staleness.oldest_allowed(self.store)  # the newest version, read as the batch is formed
            if self.staleness.regenerate:
                stale[todo] = self.staleness.stale_prompts(self.store, snap, todo, bound)
                counts &= ~stale  # a batch counts the prompts it delivers
        candidates = eligible(snap, todo, self.window, ended, self.batch_prompts, counts)
        ready = np.count_nonzero(counts[candidates]) >= self.batch_prompts
        if len(candidates) and (ended or ready):
            return self._deliver(snap, take(candidates, self.batch_prompts, counts), stale[candidates], bound)
        if not len(todo) and ended:
            self._finish(snap)
            raise StopIteration
        return None

    def _sleep(self, deadline: float | None) -> None:
        """Wait for the next poll (or a commit event); :class:`FollowTimeout` once ``timeout`` passed."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise FollowTimeout(
                f"no batch of {self.batch_prompts} prompt(s) of {self.location.url!r} became ready within "
                f"{self.timeout} s (cursor {self.cursor.name!r} is at {self.position}). Nothing was lost: "
                "follow again to go on, or pass a longer timeout (None waits while a run writes the store)."
            )
        interval = self.poll_interval
        if self.events is not None:
            interval = self.events.poll_interval(interval, tunables.seconds("follow.end-poll-interval"))
        self.wake.wait(interval if left is None else min(interval, left))
        self.wake.clear()

    @property
    def delivered(self) -> CursorState:
        """What this follower delivered so far (acknowledged or not), as a cursor would record it."""
        return CursorState(self.position, ahead=self.ahead)

    @property
    def stats(self) -> WindowStats | None:
        """Where the window is and how long its head held prompts back (``order="window"``; else None)."""
        return None if self.clock is None else self.clock.stats

    # --- reading the commit log ---------------------------------------------------------------
    def _refresh(self) -> Snapshot | None:
        """The commit log now: re-read only when the lock or the head changed since the last read."""
        if self.store is None:
            self.store = GenerationStore.open_if_exists(self.location)
            if self.store is None:
                return None
        live, head = writer_live(self.store), read_head(self.location)
        self.saw_writer |= live
        if self.snapshot is None or (live, head) != (self.snapshot.live, self.snapshot.head):
            if self._swapped():
                return self._refresh()
            self.snapshot = read_snapshot(self.store)
            self.saw_writer |= self.snapshot.live
        return self.snapshot

    def _swapped(self) -> bool:
        """True when the store at the location is no longer the one opened (``daskgen pack``/``unpack`` swapped
        it in place: its arrays are laid out anew); then it is opened again (or not yet, mid-swap)."""
        assert self.store is not None
        now = GenerationStore.open_if_exists(self.location)
        if now is not None and now.version == self.store.version:
            return False
        self.store, self.snapshot, self.prompt_ids = now, None, None
        return True

    def _ended(self, snap: Snapshot) -> bool:
        """True when nothing more will be committed: no run holds the store and its run is over (every row
        finished, or a run was seen or recorded; a store with no run recorded yet is one that is starting)."""
        if snap.live:
            return False
        if not snap.pending or self.saw_writer:
            return True
        assert self.store is not None
        return bool(self.store.refresh_attrs().runs)

    def _finish(self, snap: Snapshot) -> None:
        self.pending_at_end = snap.pending
        if snap.pending and self.wait:
            logger.warning(
                "%s: %d prompt(s) are still pending and no run is writing the store; rerun it to finish them "
                "and follow again with cursor %r to receive them",
                self.location.url,
                snap.pending,
                self.cursor.name,
            )
        listed = len(read_requeue(self.location)) if self.staleness is not None and self.staleness.regenerate else 0
        if listed and self.wait:
            logger.warning(
                "%s: %d prompt(s) sent back for generation wait in its requeue record and no run is writing the "
                "store; rerun it to regenerate them and follow again with cursor %r to receive them",
                self.location.url,
                listed,
                self.cursor.name,
            )

    # --- delivering ---------------------------------------------------------------------------
    def _deliver(self, snap: Snapshot, idx: np.ndarray, stale: np.ndarray, bound: int | None) -> Batch | None:
        """Read the batch's rows and hand it out (unacknowledged); ``None`` when the store was swapped meanwhile.

        ``stale`` marks, per candidate (``idx`` is a prefix of the candidates), the prompts sent back instead of
        delivered (recorded before the batch is handed out); ``bound`` is the oldest version delivered unflagged."""
        store = self.store
        assert store is not None
        rows, status, stale = snap.rows[idx], snap.status[idx], stale[: len(idx)]
        end, ahead = snap.after_delivering(self.delivered, idx)
        fresh = (status == DONE) & ~stale
        done, failed, done_at = rows[fresh], rows[status == FAILED], idx[fresh]
        try:
            if self.prompt_ids is None:
                self.prompt_ids = PromptIds(store)
            ids = self.prompt_ids(done)
            errors: Any = read_rows(store, failed, ("error",))["error"] if len(failed) else []
            data = read_rows(store, done, fields_to_read(store, self.format, self.fields))
            flagged = self._flag(snap, done_at, bound, data)
        except Exception:
            if self._swapped():  # the old layout's metadata, the new layout's files: read again
                return None
            raise
        if self._swapped():  # read while pack swapped the store: maybe through the old layout; read again
            return None
        add_requeue(store.location, zip(rows[stale].tolist(), snap.seqs[idx][stale].tolist(), strict=True))
        if stale.any() and self.events is not None:  # the run on this cluster takes them at once
            self.events.requeued()
        batch = Batch(
            data=batch_data(self.format, store, done, ids, data, self.pad, self.images),
            prompts=done,
            prompt_ids=ids,
            failed={int(r): str(e) for r, e in zip(failed, errors, strict=True)},
            number=self.number,
            start=self.position,
            end=end,
            follower=self,
            ahead=ahead,
            head=None if self.clock is None else self._head_after(snap, end, ahead),
            head_wait=0.0 if self.clock is None else self.clock.charge(),
            stale=flagged,
            requeued=rows[stale],
        )
        return batch

    def _flag(self, snap: Snapshot, at: np.ndarray, bound: int | None, data: dict[str, np.ndarray]) -> int:
        """With ``max_staleness``: add the per-sample ``stale`` field to the batch's ``data`` (the rows at snapshot
        indices ``at``); the number of samples flagged."""
        if self.staleness is None or bound is None:
            return 0
        assert self.store is not None
        flags = self.staleness.stale_samples(self.store, snap, at, bound) & ~self.staleness.regenerate
        data[STALE_FIELD] = flags
        return int(flags.sum())

    @staticmethod
    def _head_after(snap: Snapshot, end: Position, ahead: Ahead) -> int:
        """The first prompt (input order) not delivered once the commits up to ``end`` and ``ahead`` are."""
        rows = snap.rows[snap.unacknowledged(CursorState(end, ahead=ahead))]
        return min(snap.first_waiting, int(rows.min(initial=snap.first_waiting)))

    def ack(self, batch: Batch) -> None:
        """Save the cursor after ``batch`` (acknowledging every earlier outstanding batch with it)."""
        if batch.acked:
            return
        state = self._state_after(batch)
        self.cursor.save(state)
        self._acknowledged(batch, state)

    def _state_after(self, batch: Batch) -> CursorState:
        """The cursor's state once ``batch`` and every outstanding batch before it are acknowledged."""
        covered = [b for b in self.outstanding if b.number <= batch.number]
        waits = [b.head_wait for b in covered]
        return CursorState(
            batch.end,
            batch.number + 1,
            self.state.prompts + sum(len(b) for b in covered),
            self.state.failed + sum(b.n_failed for b in covered),
            batch.ahead,
            self.order,
            self.window,
            batch.head,
            self.state.head_wait + sum(waits),
            max([self.state.max_head_wait, *waits]),
            None if self.staleness is None else self.staleness.max_staleness,
            self.state.stale + sum(b.stale for b in covered),
            self.state.requeued + sum(len(b.requeued) for b in covered),
        )

    def _acknowledged(self, batch: Batch, state: CursorState) -> None:
        """Record that the cursor was saved after ``batch`` (as ``state``)."""
        covered = [b for b in self.outstanding if b.number <= batch.number]
        self.state = state
        for b in covered:
            b.acked = True
        self.outstanding = [b for b in self.outstanding if not b.acked]

    # --- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop listening for commit events (unacknowledged batches stay unacknowledged)."""
        if self.events is not None:
            self.events.close()
            self.events = None

    def __enter__(self) -> Follower:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@functools.cache
def _saver() -> ThreadPoolExecutor:
    """The thread that saves cursors while the next batch is read."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="daskgen-follow-ack")
