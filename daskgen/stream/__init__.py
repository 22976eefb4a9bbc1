"""Streaming finished samples to a trainer while the run goes on: ``daskgen.follow``.

* :mod:`~daskgen.stream.batches`: the :class:`Follower` iterator and its :class:`Batch` es;
* :mod:`~daskgen.stream.log`: reading the store's commit log (order, completeness);
* :mod:`~daskgen.store.cursors`: durable, atomic per-name consumer positions (kept with the store);
* :mod:`~daskgen.stream.formats`: xarray, TensorDict, verl ``DataProto`` and rows;
* :mod:`~daskgen.stream.events`: waking on a run's commit events on the same Dask cluster.

See docs/streaming.md.
"""

from __future__ import annotations

from typing import Any

from daskgen.store.cursors import Position
from daskgen.store.location import StoreRef
from daskgen.stream.batches import Batch, Follower
from daskgen.stream.formats import FORMATS

__all__ = ["FORMATS", "Batch", "Follower", "Position", "follow"]


def follow(
    store: StoreRef,
    *,
    batch_prompts: int = 64,
    cursor: str = "default",
    fields: tuple[str, ...] | list[str] | None = None,
    format: str = "xarray",
    wait: bool = True,
    timeout: float | None = None,
    auto_ack: bool = True,
    client: Any = None,
    cursor_dir: StoreRef | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Follower:
    """Iterate batches of newly finished prompt groups of ``store``, in commit order, each exactly once.

    Parameters
    ----------
    store:
        A daskgen store (folder or URL), also one a run is writing or is about to create.
    batch_prompts:
        Done prompt groups (all samples of a prompt) per batch.  While a run writes the store, a batch
        is handed out once this many are committed; the last batch may be smaller.
    cursor:
        The name of the durable position (independent names follow independently).
    fields:
        Data arrays to read (default: all for ``xarray``; the tensor and row formats always read the token
        arrays they are built from).
    format:
        ``"xarray"`` (a ``Dataset`` over ``prompt``), ``"tensordict"``, ``"dataproto"`` (verl) or ``"rows"``
        (a list of dicts, one per generated sample).
    wait:
        True: wait while a run writes the store (or one is starting); False: deliver what is committed
        now, then stop.
    timeout:
        Seconds to wait for one batch; then :class:`~daskgen.errors.FollowTimeout` (the cursor keeps the
        last acknowledged position).  ``None`` waits as long as a run writes the store.
    auto_ack:
        Acknowledge each batch when the next one is asked for (and the last when the iteration ends);
        False: call :meth:`Batch.ack` yourself (acknowledging a batch acknowledges the ones before it).
    client:
        A ``distributed.Client`` of the run's cluster: commits are then noticed through the run's commit
        events at once, not only at the next poll (the tunable ``daskgen.follow.poll-interval``).
    cursor_dir:
        Keep the cursor in this folder or URL instead of inside the store.
    storage_options:
        obstore options of an object-storage ``store`` (as for ``daskgen run``).

    Returns
    -------
    Follower
        An iterator of :class:`Batch`; ``batch.data`` is in ``format``, ``batch.failed`` maps each failed
        prompt's index to its error.
    """
    return Follower(
        store,
        batch_prompts=batch_prompts,
        cursor=cursor,
        fields=fields,
        format=format,
        wait=wait,
        timeout=timeout,
        auto_ack=auto_ack,
        client=client,
        cursor_dir=cursor_dir,
        storage_options=storage_options,
    )
