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
  scheduler plugin :class:`DrainBeforeRetire` drains the workers before the scheduler retires them
  (the scheduler itself would reschedule their running tasks at once);
* **a nanny closing its worker** (``dask worker`` got SIGTERM/SIGINT, e.g. at the end of a batch job):
  :func:`drain_from_nanny`, called by the ``daskgen.worker.nanny_preload`` teardown;
* **SIGTERM to a nanny-spawned worker process** (SLURM signals every process of a job): the handler
  installed by :func:`install_worker_hooks` drains the worker, then retires it gracefully.

A hard kill (SIGKILL, node loss) still loses that worker's in-flight tokens — never committed work.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import time
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from daskgen.worker.placement import keep_resource_restrictions

logger = logging.getLogger(__name__)

#: Worker RPC handler name (added by :func:`install_worker_hooks`).
HANDLER = "daskgen_drain"
#: Extra seconds an RPC waits for a worker's drain beyond the drain's own timeout.
RPC_SLACK_S = 5.0
#: ``Scheduler.workers_to_close`` options that ``retire_workers`` accepts.
_TO_CLOSE_KEYS = ("memory_ratio", "n", "key", "minimum", "target", "attribute")


def install_worker_hooks(worker: Any, plugin: Any) -> None:
    """Register the drain RPC handler; in nanny-spawned worker processes also SIGTERM/SIGINT handlers.

    SIGTERM drains and then retires the worker; SIGINT is ignored there, because a Ctrl-C in a
    terminal reaches every process of the group and the client stops the run itself.
    """
    worker.handlers[HANDLER] = plugin.drain
    if multiprocessing.parent_process() is None:  # the client's or `dask worker --no-nanny`'s own process
        return
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, plugin.leave_on_sigterm, worker)
        loop.add_signal_handler(signal.SIGINT, lambda: None)
    except (RuntimeError, ValueError, NotImplementedError):  # loop not in the main thread
        logger.debug("daskgen: no signal handlers on worker %s (its loop is not in the main thread)", worker.address)


async def drain_from_nanny(nanny: Any, timeout: float | None = None) -> None:
    """Ask the nanny's worker to drain before the nanny stops it (best effort)."""
    address = getattr(nanny, "worker_address", None)
    if not address or nanny.process is None:
        return
    try:
        await asyncio.wait_for(_drain_rpc(nanny.rpc, address, timeout), (timeout or 60.0) + RPC_SLACK_S)
    except Exception as exc:  # the worker may be gone already or not run daskgen: nothing to hand back
        logger.debug("daskgen: drain of %s from its nanny skipped: %s", address, exc)


async def _drain_rpc(pool: Any, address: str, timeout: float | None) -> Any:
    kwargs = {} if timeout is None else {"timeout": timeout}
    return await getattr(pool(address), HANDLER)(**kwargs)


class DrainBeforeRetire(SchedulerPlugin):
    """Scheduler plugin: drain daskgen workers before ``retire_workers`` removes them.

    It wraps the scheduler's ``retire_workers`` (the RPC handler that ``client.retire_workers`` and a
    worker's ``close_gracefully`` call, and the method adaptive scaling calls): the target workers
    are resolved as the scheduler would, drained (:meth:`EnginePlugin.drain`, at most ``timeout``
    seconds), then retired by the original implementation.

    Parameters
    ----------
    timeout:
        Longest wait for one drain, in seconds.
    """

    name = "daskgen-drain-before-retire"

    def __init__(self, timeout: float = 20.0) -> None:
        self.timeout = timeout

    async def start(self, scheduler: Any) -> None:
        """Install the wrapper (idempotent: a re-registered plugin wraps the original again)."""
        original = getattr(scheduler, "_daskgen_retire_workers", None) or scheduler.retire_workers
        scheduler._daskgen_retire_workers = original

        async def retire_workers(
            workers: list[str] | None = None,
            *,
            names: list | None = None,
            close_workers: bool = False,
            remove: bool = True,
            stimulus_id: str | None = None,
            **kwargs: Any,
        ) -> dict[str, Any]:
            targets = _targets(scheduler, workers, names, kwargs)
            await self.drain(scheduler, targets)
            return await original(workers=targets, close_workers=close_workers, remove=remove, stimulus_id=stimulus_id)

        scheduler.retire_workers = retire_workers
        scheduler.handlers["retire_workers"] = retire_workers
        _schedule_unrunnable_on_new_resources(scheduler)
        keep_resource_restrictions(scheduler)

    async def drain(self, scheduler: Any, addresses: list[str]) -> None:
        """Drain every worker in ``addresses`` at once (workers without daskgen answer with an error)."""

        async def one(address: str) -> None:
            try:
                result = await asyncio.wait_for(
                    _drain_rpc(scheduler.rpc, address, self.timeout), self.timeout + RPC_SLACK_S
                )
                logger.info("daskgen: drained %s before retiring it: %s", address, result)
            except Exception as exc:
                logger.info("daskgen: %s not drained before retiring it: %s", address, exc)

        await asyncio.gather(*(one(a) for a in addresses))


def _schedule_unrunnable_on_new_resources(scheduler: Any) -> None:
    """Let tasks waiting for a resource run once a worker advertises it.

    A partition rescheduled while no worker offered ``daskgen-engine`` (e.g. every worker of a job
    left at once and the replacement job's engines are still loading) sits in the scheduler's
    ``no-worker`` state; the scheduler revisits those tasks when a worker joins, not when a worker
    sets its resources later (which our workers do once their engine is ready), so the run would
    wait for ever.  This wraps the ``set_resources`` handler to revisit them.
    """
    original = getattr(scheduler, "_daskgen_add_resources", None) or scheduler.handlers["set_resources"]
    scheduler._daskgen_add_resources = original

    def set_resources(worker: str, resources: dict | None = None) -> str:
        if worker not in scheduler.workers:  # a draining worker the scheduler already removed: nothing to update
            return "OK"
        result = original(worker=worker, resources=resources)
        _revisit_unrunnable(scheduler, worker)
        return result

    scheduler.handlers["set_resources"] = set_resources


def _revisit_unrunnable(scheduler: Any, worker: str) -> None:
    """Place the tasks waiting for a resource again, if the running ``worker`` may now offer it."""
    ws = scheduler.workers.get(worker)
    if ws is not None and ws in scheduler.running and scheduler.unrunnable:
        # every waiting task goes through the scheduler's own placement again (loose worker
        # restrictions included); a task no worker can take stays where it was
        stimulus = f"daskgen-resources-{time.time()}"
        scheduler.transitions({ts.key: "processing" for ts in list(scheduler.unrunnable)}, stimulus)


def _targets(scheduler: Any, workers: list[str] | None, names: list | None, kwargs: dict[str, Any]) -> list[str]:
    """Addresses ``retire_workers`` would retire, resolved the way the scheduler resolves them."""
    if workers is not None and names is not None:
        raise TypeError("names and workers are mutually exclusive")
    if workers is not None:
        return list(workers)
    if names is not None:
        wanted = {str(n) for n in names}
        return [ws.address for ws in scheduler.workers.values() if str(ws.name) in wanted]
    unknown = sorted(set(kwargs) - set(_TO_CLOSE_KEYS))
    if unknown:
        raise TypeError(f"retire_workers got unexpected options {unknown}")
    return list(scheduler.workers_to_close(**kwargs))
