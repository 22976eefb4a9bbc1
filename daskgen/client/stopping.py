"""Stopping a run before every prompt is done: stop conditions, signals, the grace period.

A stop (``target_done``/``token_budget``/``deadline`` reached, SIGTERM/SIGINT, the end of the batch
allocation) submits nothing more and aborts every in-flight request on every worker keeping its
tokens; the client then collects what the partitions hand back until the grace period is over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from daskgen import tunables
from daskgen.store.layout import DONE

if TYPE_CHECKING:
    from daskgen.client.live import LiveRun
    from daskgen.worker.task import PartitionTask

logger = logging.getLogger(__name__)


def wait_s(run: LiveRun) -> float:
    """How long one wait for finished partitions may block (at most ``daskgen.cap-refresh-interval``)."""
    refresh = tunables.seconds("cap-refresh-interval")
    if run.stop.collect_until is None:
        return refresh
    return max(0.0, min(refresh, run.stop.collect_until - time.monotonic()))


def abandon(client: Any, futures: dict[Any, PartitionTask]) -> None:
    """The grace period is over: stop waiting for partitions still running (their rows stay pending)."""
    logger.warning(
        "grace period over: %d partition(s) did not hand back in time; their rows stay pending "
        "(any data they wrote is kept and continued by the next run)",
        len(futures),
    )
    client.cancel(list(futures))
    futures.clear()


def housekeeping(client: Any, run: LiveRun, tasks: Iterator[PartitionTask], retry: list) -> bool:
    """While waiting for partitions: renew the store lock; stop the run the moment the deadline passes,
    a signal arrives or the allocation ends.  True tells the wait to return now (a stop began or the
    grace period is over)."""
    if run.lock is not None:
        run.lock.heartbeat()
    plan = run.plan
    deadline = plan.settings.deadline_at
    if not run.stop.stopping and deadline is not None and time.time() >= deadline:
        begin_stop(client, run, f"deadline {plan.config.deadline} reached", tasks, retry)
        return True
    if check_interrupt(client, run, tasks, retry):
        return True
    return run.stop.grace_over()


def check_interrupt(client: Any, run: LiveRun, tasks: Iterator[PartitionTask], retry: list) -> bool:
    """Begin the graceful stop when a signal arrived or the allocation is about to end; True if it began now."""
    stop = run.stop
    interrupt = stop.interrupt
    if interrupt is None or stop.stopping:
        return False
    if (
        not interrupt.requested
        and stop.allocation_end is not None
        and time.time() >= stop.allocation_end - interrupt.grace_s
    ):
        interrupt.request(f"the batch allocation ends in {max(0.0, stop.allocation_end - time.time()):.0f} s")
    if not interrupt.requested:
        return False
    reason = interrupt.reason or "interrupted"
    begin_stop(client, run, reason, tasks, retry, collect_until=interrupt.collect_until(), announce=False)
    return True


def stop_reason(run: LiveRun, tokens: int) -> str | None:
    """Why the run should stop now (target, token budget or deadline reached), or ``None``."""
    cfg = run.plan.config
    if cfg.target_done is not None and int((run.status == DONE).sum()) >= cfg.target_done:
        return f"target of {cfg.target_done} done prompts reached"
    if cfg.token_budget is not None and tokens >= cfg.token_budget:
        return f"token budget of {cfg.token_budget} reached ({tokens} generated)"
    deadline = run.plan.settings.deadline_at
    if deadline is not None and time.time() >= deadline:
        return f"deadline {cfg.deadline} reached"
    return None


def begin_stop(
    client: Any,
    run: LiveRun,
    reason: str,
    tasks: Iterator[PartitionTask],
    retry: list,
    collect_until: float | None = None,
    announce: bool = True,
) -> None:
    """Submit nothing more and abort every request in flight on every worker (``announce``: log the reason; an
    interruption announced itself when it came)."""
    from daskgen.worker.plugin import stop_run_on_worker

    if announce:
        logger.warning("stopping early: %s", reason)
    run.stop.begin(reason, run.plan.settings.grace_s, collect_until)
    retry.clear()  # and the lazy task stream is no longer pulled (see drive)
    client.run(stop_run_on_worker)
