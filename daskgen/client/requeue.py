"""Taking the requeue record (:mod:`daskgen.store.requeue`): prompts a follower sent back are generated again.

A run starting on a store (under its lock, before it schedules anything) reads the record and, for each
entry ``(row, seq)``: a row still done by commit ``seq`` is committed back to pending (the client's commit
path, :func:`~daskgen.client.commit.reset_rows`); its stored samples are then cleared (fill values, so the
new attempt keeps none of them, :mod:`daskgen.worker.continuation`); then the entries leave the record.  A
pending row still listed (a run stopped between those steps) is cleared again; an entry whose row was
generated again since, or failed, is dropped.  Each step is safe to repeat, so a crash anywhere in between
loses nothing and regenerates nothing twice.  The new attempt's commit has a newer sequence number than any
cursor's position, so every follower receives the regenerated prompt once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from daskgen.client.commit import reset_rows
from daskgen.errors import StoreError
from daskgen.store.commit_log import REQUEUE_KEY
from daskgen.store.layout import DONE, PENDING, empty_region
from daskgen.store.requeue import drop_requeue, read_requeue

if TYPE_CHECKING:
    from daskgen.client.live import LiveRun

logger = logging.getLogger(__name__)


def take_requeued(run: LiveRun) -> int:
    """Reset the requeued prompts of the record to pending and clear their samples; how many were reset."""
    store = run.plan.store
    entries = read_requeue(store.location)
    if not entries:
        return 0
    reset = sorted(r for r, s in entries if run.status[r] == DONE and run.commit_seq[r] == s)
    if reset and store.attrs.packed:
        raise StoreError(
            f"{store.url!r} is packed and its requeue record ({REQUEUE_KEY}) sends {len(reset)} prompt(s) back for "
            "generation: a packed store's partitions share shard files, so workers may not write them. Run "
            f"`daskgen unpack {store.url}`, then the run again (or delete {REQUEUE_KEY} to keep those prompts done)."
        )
    if reset:
        reset_rows(run, reset)
    clear = sorted({r for r, _ in entries if run.status[r] == PENDING})
    _clear_samples(run, clear)
    drop_requeue(store.location, entries)
    if reset:
        logger.info("%s: %d requeued prompt(s) are pending again, to be generated anew", store.url, len(reset))
    return len(reset)


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
