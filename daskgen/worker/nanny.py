"""What runs in a worker's nanny process: the preload of dask-jobqueue workers' nannies, which keeps glibc's
dynamic malloc threshold and drains the worker before stopping it.

Dask's default ``distributed.nanny.pre-spawn-environ`` exports ``MALLOC_TRIM_THRESHOLD_=65536`` to the
worker process.  A fixed threshold switches off glibc's dynamic mmap threshold, so an inference engine
maps and unmaps every large buffer of every step (1.6-1.8x fewer tokens/s for the ``transformers``
engine on CPU, ``benchmarks/overhead.py``).  On a local cluster the client changes that setting before
it starts the nannies (``daskgen.deploy``); the nannies of HPC jobs run elsewhere with their own
configuration, so :mod:`daskgen.deploy` starts them with ``--preload-nanny daskgen.worker.nanny``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from daskgen.worker.drain import RPC_SLACK_S, drain_rpc

logger = logging.getLogger(__name__)

DROPPED = ("MALLOC_TRIM_THRESHOLD_",)


def dask_setup(nanny: Any) -> None:
    """Drop :data:`DROPPED` from what the nanny exports to the worker it is about to spawn."""
    for name in DROPPED:
        nanny.pre_spawn_env.pop(name, None)
        nanny.env.pop(name, None)


async def dask_teardown(nanny: Any) -> None:
    """Before the nanny stops its worker (e.g. ``dask worker`` got SIGTERM), let it hand back its work."""
    await drain_from_nanny(nanny)


async def drain_from_nanny(nanny: Any, timeout: float | None = None) -> None:
    """Ask the nanny's worker to drain before the nanny stops it (best effort)."""
    address = getattr(nanny, "worker_address", None)
    if not address or nanny.process is None:
        return
    try:
        await asyncio.wait_for(drain_rpc(nanny.rpc, address, timeout), (timeout or 60.0) + RPC_SLACK_S)
    except Exception as exc:  # the worker may be gone already or not run daskgen: nothing to hand back
        logger.debug("daskgen: drain of %s from its nanny skipped: %s", address, exc)
