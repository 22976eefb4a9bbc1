"""Getting a Dask client for a run: an existing scheduler, a cluster daskgen builds, or a LocalCluster.

Starting and watching the engines on it is :mod:`daskgen.client.engines`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from daskgen import tunables
from daskgen.config import RunConfig
from daskgen.errors import RunInterrupted, SchedulerLost
from daskgen.settings import RunSettings, cluster_section

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def connect(settings: RunSettings | RunConfig, interrupt: Any = None) -> Iterator[tuple[Any, Any]]:
    """Yield ``(client, info)``: an existing scheduler (``info`` None), an HPC cluster or a LocalCluster.

    ``info`` is the :class:`daskgen.deploy.ClusterInfo` of a cluster daskgen started; its section is the
    settings' (or, given options only, theirs with the run's flags merged).  A cluster that fails to start after
    a stop was asked for (``interrupt``, a :class:`daskgen.client.interrupt.Interrupt`: e.g. a SIGTERM to the
    process group, which its starting workers got too) raises :class:`RunInterrupted`.
    """
    import dask
    from distributed import Client

    if isinstance(settings, RunSettings):
        config, section = settings.options, settings.cluster
    else:
        config, section = settings, cluster_section(settings)
    with dask.config.set(worker_settings()):
        if config.scheduler_address:
            from daskgen.deploy.security import client_security

            security = client_security(config.scheduler_address, config.tls_ca, config.tls_cert, config.tls_key)
            with Client(config.scheduler_address, security=security) as client, _closing_quietly(client):
                yield client, None
            return
        cluster, info = _make_cluster(section, interrupt)
        lost = False
        try:
            with Client(cluster) as client, _closing_quietly(client):
                yield client, info
        except SchedulerLost:
            lost = True
            raise
        finally:
            _close_cluster(cluster, lost)


def _close_cluster(cluster: Any, scheduler_lost: bool) -> None:
    """Close a cluster daskgen started; after its scheduler was lost, without waiting on it or logging
    the failed attempts to reach it (its workers and jobs are stopped all the same)."""
    if not scheduler_lost:
        cluster.close()
        return
    with _muted("distributed", "tornado.application"):
        try:
            cluster.close(timeout=10)
        except Exception as exc:  # the scheduler is gone: closing can only be partial
            logger.warning("the cluster did not close cleanly after losing its scheduler (%s)", exc)


@contextlib.contextmanager
def _muted(*names: str) -> Iterator[None]:
    """Loggers ``names`` report only critical records inside the block."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


#: Loggers that print a traceback when the client's connection to the scheduler closes: its event loop's
#: (a background fetch) and its batched stream's (a send in flight).
_CONNECTION_LOGGERS = ("tornado.application", "distributed.batched")


class _ConnectionLossFilter(logging.Filter):
    """Drops the tracebacks the client logs when its connection to the scheduler closes under a background
    fetch or send: the run reports a lost scheduler itself (:mod:`daskgen.client.scheduler_watch`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from distributed.comm.core import CommClosedError

        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, CommClosedError)


@contextlib.contextmanager
def _closing_quietly(client: Any) -> Iterator[None]:
    """While the client runs, connection-loss tracebacks of background fetches are not logged; after the
    scheduler was lost, the client is closed at once without ``distributed`` logging the traceback of
    its cancelled reconnection attempt (the run already said what happened)."""
    logs, quiet = [logging.getLogger(name) for name in _CONNECTION_LOGGERS], _ConnectionLossFilter()
    for log in logs:
        log.addFilter(quiet)
    try:
        yield
    except SchedulerLost:
        with _muted("distributed.client"):
            client.close(timeout=5)
        raise
    finally:
        for log in logs:
            log.removeFilter(quiet)


def worker_settings() -> dict[str, Any]:
    """Dask settings of the workers a run starts (a LocalCluster's workers receive the client's config)."""
    # Engines such as SGLang start subprocesses: worker processes must not be daemonic.
    settings: dict[str, Any] = {"distributed.worker.daemon": False}
    if not tunables.get("worker-profile"):  # Dask's stack sampling costs worker CPU on the result path
        settings["distributed.worker.profile.enabled"] = False
    return settings


def _make_cluster(section: dict[str, Any], interrupt: Any = None) -> tuple[Any, Any]:
    from daskgen.deploy import make_cluster

    try:
        cluster, info = make_cluster(dict(section))
    except Exception as exc:
        if interrupt is None or not interrupt.requested:
            raise
        logger.warning("the cluster did not start after the stop was asked for: %s: %s", type(exc).__name__, exc)
        raise RunInterrupted(f"{interrupt.reason} while the cluster was starting") from exc
    logger.info("started %s", info)
    return cluster, info
