"""Scheduler side: a task that asks for a resource is placed only on a worker that offers it.

The client prefers a worker for each partition loosely (``workers=[w], allow_other_workers=True``,
:func:`daskgen.client.driver.submit`) and asks for the ``daskgen-engine`` resource.  When every preferred
worker is gone or offers no such resource, distributed's ``decide_worker`` falls back to *any* running
worker and drops the resource restriction with the worker restriction: a worker process that a nanny has
just restarted (its engine still loading, no resource advertised yet) is then chosen, the scheduler fails in
``acquire_resources`` with ``KeyError: 'daskgen-engine'`` and the task is stuck in ``no-worker`` for good.
:func:`keep_resource_restrictions` corrects that choice: among the running workers that offer every
resource the task asks for, or none (the task waits in ``no-worker`` until a worker advertises the
resource: the scheduler plugin :class:`daskgen.worker.drain.DrainBeforeRetire`, which installs this, revisits
such tasks then).
"""

from __future__ import annotations

import functools
from typing import Any


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
