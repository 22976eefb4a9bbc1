"""A partition task's worker thread slot: given back as soon as the task starts.

Dask runs at most ``nthreads`` tasks of a worker at once, ``async`` ones included, although those run
on the worker's event loop and use no thread.  A partition task spends its whole run awaiting its
engine, so holding a slot would cap the partitions in flight at the worker's thread count
(``dask worker --nthreads``, 1 to a few on workers a user started) however many the engine wants.
:func:`leave_thread_slot` turns the running partition task into a *long-running* one, as
``distributed.secede`` does for a task in a thread: the worker starts its next task at once, and the
task keeps its ``daskgen-engine`` resource, so the worker's window (:mod:`daskgen.worker.admission`)
alone bounds its partitions in flight.  ``daskgen.partitions-hold-threads: true`` keeps Dask's default.
"""

from __future__ import annotations

import time
from typing import Any

from daskgen import tunables


def partitions_hold_threads() -> bool:
    """Whether partition tasks keep their thread slot for their whole run (``daskgen.partitions-hold-threads``)."""
    return bool(tunables.get("partitions-hold-threads"))


def leave_thread_slot(worker: Any, key: str) -> bool:
    """Let the task ``key``, executing on ``worker`` (call from the worker's event loop), give back its
    thread slot; false when it is not executing there (or tasks hold their slots)."""
    from distributed.worker_state_machine import SecedeEvent

    if not key or partitions_hold_threads():
        return False
    task = worker.state.tasks.get(key)
    if task is None or task.state != "executing":
        return False
    started = getattr(task, "start_time", None) or time.time()
    worker.handle_stimulus(
        SecedeEvent(key=key, compute_duration=time.time() - started, stimulus_id=f"daskgen-leave-slot-{time.time()}")
    )
    return True


def start_admitted_tasks(worker: Any) -> None:
    """After the worker's window changed: start the partition tasks it holds that the window now admits.

    A worker re-checks its waiting tasks only when a task arrives or ends; when a window shrinks below
    the partitions it already received, some wait although part of the window is free.  Nothing is done
    while the worker is paused (memory): it resumes them itself.
    """
    from distributed.worker_state_machine import UnpauseEvent

    if worker.state.running:
        worker.handle_stimulus(UnpauseEvent(stimulus_id=f"daskgen-window-{time.time()}"))


def offer_no_slot_yet(worker: Any, resource: str) -> None:
    """Give ``worker`` the ``resource`` at 0 until its engine is ready (only if it has none yet).

    The scheduler may still hand such a worker a partition (a loose worker preference); with the resource
    known at 0 the task waits for its slot, where an unknown resource fails the worker's state machine
    (``KeyError``) and the scheduler loses the worker.
    """
    worker.state.total_resources.setdefault(resource, 0.0)
    worker.state.available_resources.setdefault(resource, 0.0)
