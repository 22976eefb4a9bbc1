"""Handing back in-flight work when a worker goes away.

A worker that leaves with partitions running would lose every token generated for them: Dask
reschedules the tasks elsewhere from scratch.  Instead, before a worker goes, its
:class:`~daskgen.worker.plugin.EnginePlugin` *drains* it (:meth:`EnginePlugin.drain`): no new partitions,
every in-flight request aborted keeping its tokens, and the running partitions finish normally —
each writes its region (finished samples, partial responses) before its task returns, so the store
holds the work whatever happens to the worker next.  The client commits what finished and the next
attempt of the aborted rows continues the stored prefixes token-exactly (``keep_partial``).

Who triggers the drain:

* **retirement** — ``client.retire_workers``, a worker's ``--lifetime``, adaptive scale-down: the
  scheduler plugin :class:`~daskgen.worker.scheduler.DrainBeforeRetire` drains the workers before the
  scheduler retires them (the scheduler itself would reschedule their running tasks at once);
* **a nanny closing its worker** (``dask worker`` got SIGTERM/SIGINT, e.g. at the end of a batch job):
  :func:`~daskgen.worker.nanny.drain_from_nanny`, called by the nanny preload's teardown;
* **SIGTERM to a nanny-spawned worker process** (SLURM signals every process of a job): the handler
  installed by :func:`install_worker_hooks` drains the worker, then retires it gracefully.

A hard kill (SIGKILL, node loss) still loses that worker's in-flight tokens — never committed work.
This module is the worker's side (the RPC handler and its signal handlers) and the RPC the nanny and the
scheduler send it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from typing import Any

logger = logging.getLogger(__name__)

#: Worker RPC handler names (added by :func:`install_worker_hooks`): drain, and take partitions again after a drain
#: that was not followed by the worker's retirement.
HANDLER = "daskgen_drain"
RESUME_HANDLER = "daskgen_resume"
#: What distributed logs when a worker that retires itself is closed by its nanny or cluster meanwhile (the whole
#: job got SIGTERM): the scheduler's answer to the retirement finds the worker closing, or forgot it already.
#: Both are benign races of a worker that is leaving anyway, so a leaving worker does not log them.
LEAVING_RACES = ("Invalid Worker.status transition", "Scheduler was unaware of this worker")


class LeavingRaces(logging.Filter):
    """Drops :data:`LEAVING_RACES` records of a worker that is leaving."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LEAVING_RACES)


#: Extra seconds an RPC waits for a worker's drain beyond the drain's own timeout.
RPC_SLACK_S = 5.0


def install_worker_hooks(worker: Any, plugin: Any) -> None:
    """Register the drain RPC handler; in nanny-spawned worker processes also SIGTERM/SIGINT handlers.

    SIGTERM drains and then retires the worker; SIGINT is ignored there, because a Ctrl-C in a
    terminal reaches every process of the group and the client stops the run itself.
    """
    worker.handlers[HANDLER] = plugin.drain
    worker.handlers[RESUME_HANDLER] = plugin.resume
    if multiprocessing.parent_process() is None:  # the client's or `dask worker --no-nanny`'s own process
        return
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, plugin.leave_on_sigterm, worker)
        loop.add_signal_handler(signal.SIGINT, lambda: None)
    except (RuntimeError, ValueError, NotImplementedError):  # loop not in the main thread
        logger.debug("daskgen: no signal handlers on worker %s (its loop is not in the main thread)", worker.address)


async def drain_rpc(pool: Any, address: str, timeout: float | None) -> Any:
    """Ask the worker at ``address`` (through the RPC ``pool`` of a nanny or the scheduler) to drain."""
    kwargs = {} if timeout is None else {"timeout": timeout}
    return await getattr(pool(address), HANDLER)(**kwargs)


async def resume_rpc(pool: Any, address: str) -> Any:
    """Ask the drained worker at ``address`` (through an RPC ``pool``) to take partitions again."""
    return await getattr(pool(address), RESUME_HANDLER)()


class Draining:
    """The worker's side of a drain, mixed into :class:`~daskgen.worker.plugin.EnginePlugin` (whose state it uses:
    the worker, its running partitions, ``stop_run`` and the partition window it offers)."""

    draining = False
    _leaving: asyncio.Task | None = None
    _window_before_drain: int | None = 0
    _stopping_before_drain = False
    # the plugin's own state and methods this uses
    _worker: Any
    _advertised: bool
    running: int
    stopping: bool
    drain_timeout_s: float
    resolved_window: int | None

    async def stop_run(self) -> int:
        raise NotImplementedError

    async def _set_window(self, window: int) -> None:
        raise NotImplementedError

    def leave_on_sigterm(self, worker: Any) -> None:
        """SIGTERM to this worker's process: hand back in-flight work, then leave; a second SIGTERM closes now."""
        if self._leaving is None:
            logger.warning("daskgen: worker %s got SIGTERM: handing back in-flight work, then leaving", worker.address)
            self._leaving = asyncio.ensure_future(self._drain_and_leave(worker))
        else:
            logger.warning("daskgen: worker %s got SIGTERM again: closing now", worker.address)
            asyncio.ensure_future(worker.close(nanny=True, reason="daskgen: SIGTERM twice"))

    async def _drain_and_leave(self, worker: Any) -> None:
        await self.drain()
        logging.getLogger("distributed.worker").addFilter(LeavingRaces())
        await worker.close_gracefully(reason="daskgen: SIGTERM")

    async def drain(self, timeout: float | None = None) -> dict[str, int]:
        """Hand back this worker's work before it goes away (retirement, SIGTERM, allocation end).

        Takes no new partitions (the resource drops to 0), aborts every in-flight request keeping
        the tokens generated so far, and waits up to ``timeout`` seconds until the running
        partitions have written their regions (finished samples and partial responses) and
        returned; the client commits the finished rows and continues the partial ones elsewhere.
        Idempotent.  Returns ``{"aborted": requests aborted, "running": partitions still running}``.
        """
        timeout = self.drain_timeout_s if timeout is None else timeout
        if not self.draining:
            self._stopping_before_drain = self.stopping
            await self._stop_taking_partitions()
        aborted = await self.stop_run()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.running and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return {"aborted": aborted, "running": self.running}

    async def _stop_taking_partitions(self) -> None:
        """Mark the worker draining and drop its partition slots to 0, so the scheduler sends it nothing new."""
        self.draining = True
        logger.warning(
            "daskgen: draining worker %s: aborting in-flight requests (partial responses are kept)",
            getattr(self._worker, "address", "?"),
        )
        if self._advertised and self._worker is not None:
            self._window_before_drain = self.resolved_window
            await self._set_window(0)

    async def resume(self) -> bool:
        """Take partitions again after a drain that was not followed by this worker's retirement (the scheduler
        refused it, e.g. results only this worker holds could not move elsewhere): the window it offered before,
        the run's own stop as it was.  Not after a SIGTERM (the worker is leaving).  True when it was drained."""
        if not self.draining or self._leaving is not None:
            return False
        self.draining, self.stopping = False, self._stopping_before_drain
        logger.warning(
            "daskgen: worker %s was not retired after its drain: taking partitions again",
            getattr(self._worker, "address", "?"),
        )
        if self._advertised and self._window_before_drain:
            await self._set_window(self._window_before_drain)
        return True
