"""Writer processes: a worker's finished partitions written to the store beside its event loop.

A worker's event loop drives its engine and every partition it has in flight; a finished partition's
samples are placed into its padded region in a thread of the worker, and writing the region to the store
(Zarr's codecs, checksums and I/O, much of it Python) is the larger part of the CPU a sample costs after
the engine.  In a thread of the worker it competes with the loop for the interpreter lock.  With
``daskgen.writer-processes`` set to N > 0, each worker starts N processes that write: the partition's
region goes to one of them through shared memory (:mod:`daskgen.worker.writers.shared_regions`: one copy of its
arrays' bytes, no pipe), and the task ends when that process answered, so a partition still finishes only
after its data landed.  Worth it where a worker has cores to spare (GPU nodes usually have many cores per
GPU); where every core already runs a worker, it only adds the hand-over.

The processes are spawned (a Dask worker runs threads, so it is not forked) from the worker's event-loop
thread, which needs a non-daemonic worker process, as daskgen's clusters and job scripts start them.  On
Linux each dies with its worker (``PR_SET_PDEATHSIG``), so no write outlives the worker that asked for it; a
writer process that died is replaced and its partition written again by the new one (a region write is
idempotent).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import numpy as np

from daskgen import tunables
from daskgen.errors import ConfigError, StoreWriteError
from daskgen.worker.writers.shared_regions import Block, Handover, SharedBlocks, write_shared

logger = logging.getLogger(__name__)

T = TypeVar("T")
_PR_SET_PDEATHSIG = 1


def writer_processes() -> int:
    """``daskgen.writer-processes``: how many writer processes each worker starts (0: none)."""
    value = tunables.get("writer-processes")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"daskgen.writer-processes must be a whole number >= 0 (0: a worker writes its partitions in a thread of "
            f"its own), got {value!r}; set it with DASK_DASKGEN__WRITER_PROCESSES=2 or dask.config.set."
        )
    return value


class WriterPool:
    """``processes`` spawned writer processes of one worker, each dying with it."""

    def __init__(self, processes: int):
        if multiprocessing.current_process().daemon:
            raise ConfigError(
                f"daskgen.writer-processes={processes} needs a non-daemonic worker process (a daemonic one cannot "
                "start processes), found a daemonic one. Start workers with DASK_DISTRIBUTED__WORKER__DAEMON=False "
                "(daskgen's clusters and job scripts do), or set daskgen.writer-processes to 0."
            )
        self.processes = processes
        self.written = 0  # partitions the processes wrote
        self.replaced = 0  # times a process died and the pool was started again
        self.blocks = SharedBlocks(keep=processes + 1)
        self._pool = self._new_pool()
        for _ in range(processes):  # start them (and import the writing code) while the engine starts
            self._pool.submit(_import_writer)

    def _new_pool(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(self.processes, mp_context=context, initializer=_die_with, initargs=(os.getpid(),))

    async def run(self, fn: Callable[..., T], *args: Any, block: Block | None = None) -> T:
        """``fn(*args)`` in a writer process; once more in a new pool when a process of the pool died.

        ``block``: a shared-memory block the call reads, held until the process is done with it."""
        for attempt in (1, 2):
            pool = self._pool
            try:
                out = await asyncio.wrap_future(self._submit(pool, block, fn, *args))
            except BrokenProcessPool as exc:
                if attempt == 2:
                    raise StoreWriteError(
                        f"a daskgen writer process died twice while writing one partition ({exc}); the partition is "
                        "run again. If it keeps happening, look at the processes' memory use, or set "
                        "daskgen.writer-processes to 0 to write in the worker itself."
                    ) from exc
                self._replace(pool, exc)
            else:
                self.written += 1
                return out
        raise AssertionError("unreachable")

    def hand_over(self, arrays: dict[str, np.ndarray]) -> Handover:
        """Any thread: the region made ready for a writer process (copied into shared memory,
        :mod:`daskgen.worker.writers.shared_regions`, or kept to be pickled where there is no room there)."""
        return Handover(self.blocks, arrays)

    async def write(self, store: Any, start: int, handover: Handover) -> None:
        """``store.write_region(start, arrays)`` of the handed-over region, in a writer process."""
        if handover.region is None:
            await self.run(store.write_region, start, handover.arrays)
            return
        try:
            await self.run(write_shared, store, start, handover.region, block=handover.block)
        finally:
            handover.release()

    async def write_region(self, store: Any, start: int, arrays: dict[str, np.ndarray]) -> None:
        """:meth:`hand_over` then :meth:`write`, both on the calling loop."""
        await self.write(store, start, self.hand_over(arrays))

    def _submit(self, pool: ProcessPoolExecutor, block: Block | None, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Submit ``fn(*args)``; ``block`` is held until it has run (or was cancelled before it started)."""
        future = pool.submit(fn, *args)
        if block is not None:
            self.blocks.hold(block)
            future.add_done_callback(lambda _: self.blocks.drop(block))
        return future

    def _replace(self, broken: ProcessPoolExecutor, exc: BaseException) -> None:
        """Start a new pool in place of ``broken`` (once: the first partition that found it broken does)."""
        if self._pool is broken:
            logger.warning("a daskgen writer process died (%s); starting new ones and writing again", exc)
            broken.shutdown(wait=False, cancel_futures=True)
            self._pool, self.replaced = self._new_pool(), self.replaced + 1

    def close(self) -> None:
        """Stop the processes (a write in progress ends with its worker anyway)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.blocks.close()


def start_writers() -> WriterPool | None:
    """The worker's writer processes under ``daskgen.writer-processes``, or ``None`` when it is 0."""
    processes = writer_processes()
    return WriterPool(processes) if processes else None


def stop_writers(pool: WriterPool | None) -> None:
    """Stop the worker's writer processes, if it has any."""
    if pool is not None:
        pool.close()


def _die_with(parent: int) -> None:
    """Writer process start: die when the worker ``parent`` does (Linux), or now if it is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _import_writer() -> int:
    """Import what a writer process runs (the store and Zarr), and say which process this is."""
    from daskgen.store.generation_store import import_zarr

    import_zarr()  # ahead of the first partition

    return os.getpid()
