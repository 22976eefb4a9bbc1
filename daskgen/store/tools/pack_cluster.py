"""The copy tasks of ``daskgen pack`` and ``unpack`` on a Dask cluster: submitted, waited for with a bound, and on the
pack's own local cluster given a new cluster once when they stall.

Each task copies whole shards and verifies them (:mod:`daskgen.store.tools.pack`), so a block whose task was lost with
its cluster is simply copied again; the blocks that finished are recorded as they finish, so nothing copied is lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from daskgen import tunables
from daskgen.errors import PackStalled

logger = logging.getLogger(__name__)

#: A block to copy: (array name, first row, end row).
Block = tuple[str, int, int]
#: New local clusters a stalled pack starts before it stops (its own cluster only: a user's cluster is theirs).
LOCAL_RESTARTS = 1


@dataclass
class CopyJob:
    """The blocks of one pack or unpack: ``copy(name, start, stop, recorded)`` runs as a Dask task per block, each
    finished block is added to ``done`` and ``record(done)`` saves it as they finish (``mode``: ``pack`` or
    ``unpack``; ``target``: the copy's URL, for messages)."""

    copy: Callable[..., Any]
    blocks: list[Block]
    done: set[str]
    record: Callable[[set[str]], None]
    mode: str
    target: str

    def left(self) -> list[Block]:
        """The blocks not yet copied."""
        return [block for block in self.blocks if f"{block[0]}/{block[1]}" not in self.done]


def copy_on_clusters(job: CopyJob, scheduler_address: str | None, n_workers: int | None) -> None:
    """Copy every block of ``job`` on ``scheduler_address``, or on a local cluster of ``n_workers`` started here.

    With no copy finished for ``daskgen.pack.stall-timeout``, a local cluster is closed and a new one copies the
    blocks left (:data:`LOCAL_RESTARTS` times); on the user's cluster, or after that, :class:`PackStalled`.
    """
    attempts = 1 if scheduler_address else 1 + LOCAL_RESTARTS
    for attempt in range(1, attempts + 1):
        try:
            with cluster_client(scheduler_address, n_workers) as client:
                copy_all(client, job)
            return
        except PackStalled as exc:
            if attempt == attempts:
                raise
            logger.warning(
                "%s into %s: no copy task finished in %.0f s; closing the local cluster and copying the %d blocks "
                "left on a new one",
                job.mode,
                job.target,
                exc.stall_s,
                len(job.left()),
            )


def copy_all(client: Any, job: CopyJob) -> None:
    """One copy task per block of ``job`` on ``client``'s cluster; :class:`PackStalled` when none finishes for
    ``daskgen.pack.stall-timeout`` (the blocks copied are recorded first)."""
    from distributed import as_completed

    futures = {}
    for name, start, stop in job.blocks:
        key, recorded = f"daskgen-{job.mode}-{name}-{start}", f"{name}/{start}" in job.done
        futures[client.submit(job.copy, name, start, stop, recorded, pure=False, key=key)] = (name, start, stop)
    finished = as_completed(futures, loop=client.loop)  # this client's loop, whatever the default client is
    stall, last = tunables.seconds("pack.stall-timeout"), time.monotonic()
    progressed = last
    while futures:
        if not ready_within(finished, 1.0):
            if time.monotonic() - progressed > stall:
                job.record(job.done)
                raise stalled(client, futures.values(), len(job.done), stall, f"{job.mode} into {job.target!r}")
            continue
        future = next(finished)
        future.result()
        name, start, _ = futures.pop(future)
        job.done.add(f"{name}/{start}")
        progressed = time.monotonic()
        if progressed - last > 2.0 or not futures:
            job.record(job.done)
            last = time.monotonic()


def ready_within(finished: Any, seconds: float) -> bool:
    """Whether ``as_completed`` has a finished future, waiting up to ``seconds`` for one."""
    with finished.thread_condition:  # checked under the lock: a future queued after the check notifies the wait
        if not finished.has_ready():
            finished.thread_condition.wait(seconds)
    return bool(finished.has_ready())


def stalled(client: Any, left: Any, copied: int, stall: float, what: str) -> PackStalled:
    """The error for a copy (``what``: e.g. ``pack into 'out.zarr'``) in which no task finished for ``stall`` s."""
    blocks = sorted(f"{name}[{start}:{stop}]" for name, start, stop in left)
    workers = len(client.scheduler_info().get("workers", {}))
    return PackStalled(
        f"the {what} stopped: no copy task finished in {stall:.0f} s (daskgen.pack.stall-timeout), {len(blocks)} "
        f"blocks left ({', '.join(blocks[:5])}{', ...' if len(blocks) > 5 else ''}) on {workers} worker(s). The "
        f"{copied} blocks copied are recorded; rerun the same command to copy the rest (raise "
        f"daskgen.pack.stall-timeout if the storage is that slow).",
        stall,
    )


def cluster_client(scheduler_address: str | None, n_workers: int | None) -> contextlib.AbstractContextManager[Any]:
    """A client of ``scheduler_address``, or of a local cluster of ``n_workers`` processes (default: the cores, at
    most 4) closed with it."""
    from distributed import Client

    if scheduler_address:
        return Client(scheduler_address)
    return _local_client(n_workers or max(1, min(4, os.cpu_count() or 1)))


@contextlib.contextmanager
def _local_client(workers: int) -> Iterator[Any]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        yield client
