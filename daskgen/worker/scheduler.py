"""What runs in the Dask scheduler process for daskgen's workers: draining workers before they are retired
(:class:`DrainBeforeRetire`, the scheduler plugin the client installs), and placing a task that asks for a resource
only on a worker that offers it.

The client prefers a worker for each partition loosely (``workers=[w], allow_other_workers=True``,
:func:`daskgen.client.driver.submit`) and asks for the ``daskgen-engine`` resource.  When every preferred
worker is gone or offers no such resource, distributed's ``decide_worker`` falls back to *any* running
worker and drops the resource restriction with the worker restriction: a worker process that a nanny has
just restarted (its engine still loading, no resource advertised yet) is then chosen, the scheduler fails in
``acquire_resources`` with ``KeyError: 'daskgen-engine'`` and the task is stuck in ``no-worker`` for good.
:func:`keep_resource_restrictions` corrects that choice: among the running workers that offer every
resource the task asks for, or none (the task waits in ``no-worker`` until a worker advertises the
resource: the scheduler plugin :class:`DrainBeforeRetire`, which installs this, revisits
such tasks then).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from daskgen.worker.drain import RPC_SLACK_S, drain_rpc, resume_rpc

logger = logging.getLogger(__name__)

#: ``Scheduler.workers_to_close`` options that ``retire_workers`` accepts.
_TO_CLOSE_KEYS = ("memory_ratio", "n", "key", "minimum", "target", "attribute")


def keep_resource_restrictions(scheduler: Any) -> None:
    """Wrap the scheduler's placement of tasks with restrictions (idempotent)."""
    original = getattr(scheduler, "_daskgen_decide_worker", None) or scheduler.decide_worker_non_rootish
    scheduler._daskgen_decide_worker = original

    def decide_worker_non_rootish(ts: Any) -> Any:
        ws = original(ts)
        if ws is None or offers(ws, ts.resource_restrictions):
            return ws
        able = [w for w in scheduler.running if offers(w, ts.resource_restrictions)]
        return min(able, key=functools.partial(scheduler.worker_objective, ts)) if able else None

    scheduler.decide_worker_non_rootish = decide_worker_non_rootish


def offers(ws: Any, wanted: dict[str, float] | None) -> bool:
    """True when the worker ``ws`` offers at least the ``wanted`` quantity of every resource."""
    return all(ws.resources.get(name, 0) >= quantity for name, quantity in (wanted or {}).items())


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
            retired = await original(
                workers=targets, close_workers=close_workers, remove=remove, stimulus_id=stimulus_id
            )
            await self.resume(scheduler, [a for a in targets if a not in retired and a in scheduler.workers])
            return retired

        scheduler.retire_workers = retire_workers
        scheduler.handlers["retire_workers"] = retire_workers
        _schedule_unrunnable_on_new_resources(scheduler)
        keep_resource_restrictions(scheduler)

    async def drain(self, scheduler: Any, addresses: list[str]) -> None:
        """Drain every worker in ``addresses`` at once (workers without daskgen answer with an error)."""

        async def one(address: str) -> None:
            try:
                result = await asyncio.wait_for(
                    drain_rpc(scheduler.rpc, address, self.timeout), self.timeout + RPC_SLACK_S
                )
                logger.info("daskgen: drained %s before retiring it: %s", address, result)
            except Exception as exc:
                logger.info("daskgen: %s not drained before retiring it: %s", address, exc)

        await asyncio.gather(*(one(a) for a in addresses))

    async def resume(self, scheduler: Any, addresses: list[str]) -> None:
        """Let drained workers that the scheduler did not retire take partitions again (e.g. results only they hold
        could not move elsewhere): a drained worker that stays would otherwise hold its engine idle for good."""

        async def one(address: str) -> None:
            try:
                resumed = await asyncio.wait_for(resume_rpc(scheduler.rpc, address), RPC_SLACK_S)
                logger.warning(
                    "daskgen: %s was not retired after its drain; it takes partitions again: %s", address, resumed
                )
            except Exception as exc:
                logger.info("daskgen: %s not resumed after a retirement that did not happen: %s", address, exc)

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
