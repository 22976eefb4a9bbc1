"""Getting a Dask client for a run and starting one engine per worker on it."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from tqdm.auto import tqdm

from daskgen import tunables
from daskgen.config import RunConfig
from daskgen.errors import EngineError, RunInterrupted
from daskgen.worker.plugin import AUTO_MAX_WINDOW, RESOURCE, EnginePlugin, plugin_status

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
            with Client(config.scheduler_address, security=security) as client:
                yield client, None
            return
        cluster, info = _make_cluster(config)
        with cluster, Client(cluster) as client:
            yield client, info


def _make_cluster(config: RunConfig) -> tuple[Any, Any]:
    from daskgen.deploy import apply_cli_overrides, make_cluster

    spec = apply_cli_overrides(
        config.cluster or {"kind": "local"}, min_workers=config.min_workers, max_workers=config.max_workers
    )
    if spec.get("kind", "local") == "local" and config.n_workers:
        spec["n_workers"] = config.n_workers
    # Task slots per worker: the window (partition tasks are async, an idle slot costs nothing) + 1.
    spec.setdefault("threads_per_worker", (AUTO_MAX_WINDOW if config.window == "auto" else config.window) + 1)
    cluster, info = make_cluster(spec)
    logger.info("started %s", info)
    return cluster, info


def start_engines(client: Any, config: RunConfig, interrupt: Any = None) -> int:
    """Register the engine plugin and wait until at least one engine is ready.

    Returns the number of workers with a ready engine.  Raises :class:`EngineError` with every
    worker's error when all engines failed, or when none is ready within the timeout, and
    :class:`RunInterrupted` when ``interrupt`` (a :class:`daskgen.client.interrupt.Interrupt`) is requested.
    """
    drain_s = config.grace_seconds() * 0.5  # a drained worker hands back within half the grace period
    plugin = EnginePlugin(
        config.engine,
        str(config.model),
        config.engine_args,
        window=config.window,
        requests_per_partition=config.partition_size * config.n_samples,
        drain_timeout_s=drain_s,
    )
    client.register_plugin(plugin, name=plugin.name)
    _drain_before_retire(client, drain_s)
    deadline = time.monotonic() + tunables.seconds("engine-start-timeout")
    with tqdm(
        total=0,
        desc="engines ready",
        disable=not config.progress,
        bar_format="{desc}: {n_fmt}/{total_fmt} workers [{elapsed}]",
    ) as bar:
        delay = 0.25
        while True:
            states = client.run(plugin_status)
            ready = [w for w, s in states.items() if s["state"] == "ready"]
            bar.total = len(states)
            bar.update(len(ready) - bar.n)
            if ready and _resource_visible(client):
                return len(ready)
            if interrupt is not None and interrupt.requested:
                raise RunInterrupted(f"{interrupt.reason} while the engines were starting")
            _raise_if_all_failed(config, states, deadline)
            time.sleep(delay)
            delay = min(2.0, delay * 1.5)  # model loads take seconds to minutes; spare big clusters


def _drain_before_retire(client: Any, timeout: float) -> None:
    """Make the scheduler drain daskgen workers before retiring them (:mod:`daskgen.worker.drain`)."""
    from daskgen.worker.drain import DrainBeforeRetire

    try:
        client.register_plugin(DrainBeforeRetire(timeout), name=DrainBeforeRetire.name)
    except Exception as exc:  # e.g. a scheduler without daskgen installed
        logger.warning(
            "could not install daskgen's drain-before-retire plugin on the scheduler (%s): retiring a "
            "worker will restart its in-flight partitions elsewhere (finished work is safe). Install "
            "daskgen where the scheduler runs to hand back partial responses instead.",
            exc,
        )


def _raise_if_all_failed(config: RunConfig, states: dict[str, Any], deadline: float) -> None:
    failed = {w: s["error"] for w, s in states.items() if s["state"] == "failed"}
    if states and len(failed) == len(states):
        details = "\n  ".join(f"{w}: {e}" for w, e in failed.items())
        raise EngineError(f"the {config.engine!r} engine failed to start on every worker:\n  {details}")
    if time.monotonic() > deadline:
        raise EngineError(
            f"no engine became ready within {tunables.seconds('engine-start-timeout'):.0f} s; "
            f"worker states: {states}. Raise the Dask config daskgen.engine-start-timeout "
            f"(e.g. DASK_DASKGEN__ENGINE_START_TIMEOUT=30m) or check the worker logs."
        )


def check_engines(client: Any, config: RunConfig) -> None:
    """Raise :class:`EngineError` when every worker's engine has failed (nothing can progress)."""
    states = client.run(plugin_status)
    failed = {w: s["error"] for w, s in states.items() if s["state"] in ("failed", "missing")}
    if states and len(failed) == len(states):
        details = "\n  ".join(f"{w}: {e}" for w, e in failed.items())
        raise EngineError(
            f"the {config.engine!r} engine has failed on every worker; finished work is saved, "
            f"rerun the same command to resume once fixed:\n  {details}"
        )


def _resource_visible(client: Any) -> bool:
    info = client.scheduler_info(n_workers=-1)["workers"]
    return any(w.get("resources", {}).get(RESOURCE, 0) > 0 for w in info.values())
