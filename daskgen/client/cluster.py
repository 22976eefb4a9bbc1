"""Getting a Dask client for a run: an existing scheduler, a cluster daskgen builds, or a LocalCluster.

Starting and watching the engines on it is :mod:`daskgen.client.engines`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from daskgen.config import RunConfig
from daskgen.errors import SchedulerLost
from daskgen.worker.admission import AUTO_MAX_WINDOW

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def connect(config: RunConfig) -> Iterator[tuple[Any, Any]]:
    """Yield ``(client, info)``: an existing scheduler (``info`` None), an HPC cluster or a LocalCluster.

    ``info`` is the :class:`daskgen.deploy.ClusterInfo` of a cluster daskgen started.
    """
    import dask
    from distributed import Client

    # Engines such as SGLang start subprocesses: worker processes must not be daemonic.
    with dask.config.set({"distributed.worker.daemon": False}):
        if config.scheduler_address:
            from daskgen.deploy.security import client_security

            security = client_security(config.scheduler_address, config.tls_ca, config.tls_cert, config.tls_key)
            with Client(config.scheduler_address, security=security) as client, _closing_quietly(client):
                yield client, None
            return
        cluster, info = _make_cluster(config)
        with cluster, Client(cluster) as client, _closing_quietly(client):
            yield client, info


class _ConnectionLossFilter(logging.Filter):
    """Drops the tracebacks the client's event loop logs when a connection to the scheduler closes under a
    background fetch: the run reports a lost scheduler itself (:mod:`daskgen.client.scheduler_watch`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from distributed.comm.core import CommClosedError

        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, CommClosedError)


@contextlib.contextmanager
def _closing_quietly(client: Any) -> Iterator[None]:
    """While the client runs, connection-loss tracebacks of background fetches are not logged; after the
    scheduler was lost, the client is closed at once without ``distributed`` logging the traceback of
    its cancelled reconnection attempt (the run already said what happened)."""
    loop_log, quiet = logging.getLogger("tornado.application"), _ConnectionLossFilter()
    loop_log.addFilter(quiet)
    try:
        yield
    except SchedulerLost:
        client_log = logging.getLogger("distributed.client")
        level = client_log.level
        client_log.setLevel(logging.CRITICAL)
        try:
            client.close(timeout=5)
        finally:
            client_log.setLevel(level)
        raise
    finally:
        loop_log.removeFilter(quiet)


def _make_cluster(config: RunConfig) -> tuple[Any, Any]:
    from daskgen.deploy import apply_cli_overrides, make_cluster

    spec = apply_cli_overrides(
        config.cluster or {"kind": "local"}, min_workers=config.min_workers, max_workers=config.max_workers
    )
    if spec.get("kind", "local") == "local" and config.n_workers:
        spec["n_workers"] = config.n_workers
    # Task slots per worker: the window (partition tasks are async, an idle slot costs nothing) + 1.
    spec.setdefault("threads_per_worker", (AUTO_MAX_WINDOW if config.window == "auto" else int(config.window)) + 1)
    cluster, info = make_cluster(spec)
    logger.info("started %s", info)
    return cluster, info
