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

#: Worker RPC handler name (added by :func:`install_worker_hooks`).
HANDLER = "daskgen_drain"
#: Extra seconds an RPC waits for a worker's drain beyond the drain's own timeout.
RPC_SLACK_S = 5.0


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


async def drain_rpc(pool: Any, address: str, timeout: float | None) -> Any:
    """Ask the worker at ``address`` (through the RPC ``pool`` of a nanny or the scheduler) to drain."""
    kwargs = {} if timeout is None else {"timeout": timeout}
    return await getattr(pool(address), HANDLER)(**kwargs)
