"""Nanny preload for dask-jobqueue workers: keep glibc's dynamic malloc threshold; drain before stopping.

Dask's default ``distributed.nanny.pre-spawn-environ`` exports ``MALLOC_TRIM_THRESHOLD_=65536`` to the
worker process.  A fixed threshold switches off glibc's dynamic mmap threshold, so an inference engine
maps and unmaps every large buffer of every step (1.6-1.8x fewer tokens/s for the ``transformers``
engine on CPU, ``benchmarks/overhead.py``).  On a local cluster the client changes that setting before
it starts the nannies (``daskgen.deploy``); the nannies of HPC jobs run elsewhere with their own
configuration, so :mod:`daskgen.deploy` starts them with ``--preload-nanny daskgen.worker.nanny_preload``.
"""

from __future__ import annotations

from typing import Any

DROPPED = ("MALLOC_TRIM_THRESHOLD_",)


def dask_setup(nanny: Any) -> None:
    """Drop :data:`DROPPED` from what the nanny exports to the worker it is about to spawn."""
    for name in DROPPED:
        nanny.pre_spawn_env.pop(name, None)
        nanny.env.pop(name, None)


async def dask_teardown(nanny: Any) -> None:
    """Before the nanny stops its worker (e.g. ``dask worker`` got SIGTERM), let it hand back its work."""
    from daskgen.worker.drain import drain_from_nanny

    await drain_from_nanny(nanny)
