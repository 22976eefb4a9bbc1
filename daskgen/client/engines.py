"""The client's side of the engines: install one per worker, wait until they are ready, watch for failure.

:func:`start_engines` registers :class:`~daskgen.worker.plugin.EnginePlugin` on every worker (each
loads and health-checks its engine in the background) and the scheduler plugin that drains workers
before they retire, then waits until some engine is ready; :class:`EngineWatch` stops a run whose
engines have all failed or whose workers are all gone.  What happens on the worker is :mod:`daskgen.worker.plugin`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tqdm.auto import tqdm

from daskgen import tunables
from daskgen.config import RunConfig
from daskgen.errors import EngineError, RunInterrupted
from daskgen.settings import RunSettings
from daskgen.worker.plugin import RESOURCE, EnginePlugin, PluginState, plugin_status

logger = logging.getLogger(__name__)

#: States of a worker's plugin that can no longer generate ("missing": no plugin on that worker).
DEAD_STATES = (PluginState.FAILED.value, "missing")


def start_engines(
    client: Any, settings: RunSettings | RunConfig, interrupt: Any = None, engine_args: dict[str, Any] | None = None
) -> int:
    """Register the engine plugin and wait until at least one engine is ready.

    The engines start with ``engine_args`` (default: the run's; a plan dispatched by prefix may add some).

    Returns the number of workers with a ready engine.  Raises :class:`EngineError` with every
    worker's error when all engines failed, or when none is ready within the timeout, and
    :class:`RunInterrupted` when ``interrupt`` (a :class:`daskgen.client.interrupt.Interrupt`) is requested.
    """
    if isinstance(settings, RunSettings):
        config, grace_s, location = settings.options, settings.grace_s, settings.location
        window, adapters = settings.window, settings.adapters
    else:  # options only: derived here
        config, grace_s, location = settings, settings.grace_seconds(), settings.location()
        canonical = settings.to_dict()
        window, adapters = canonical["window"], canonical["adapters"]
    drain_s = grace_s * 0.5  # a drained worker hands back within half the grace period
    plugin = EnginePlugin(
        config.engine,
        str(config.model),
        config.engine_args if engine_args is None else engine_args,
        window=window,
        requests_per_partition=config.partition_size * config.n_samples,
        drain_timeout_s=drain_s,
        refresh=config.refresh,
        policy_store=location if config.refresh else None,
        adapters=adapters,
    )
    client.register_plugin(plugin, name=plugin.name)
    _drain_before_retire(client, drain_s)
    return _wait_until_ready(client, config, interrupt)


def _wait_until_ready(client: Any, config: RunConfig, interrupt: Any) -> int:
    """Poll the workers' engine states, ever less often, until one engine is ready; the number of ready ones."""
    deadline = time.monotonic() + tunables.seconds("engine-start-timeout")
    with _ready_bar(config.progress) as bar:
        delay = 0.25
        while True:
            states = client.run(plugin_status)
            ready = [w for w, s in states.items() if s["state"] == PluginState.READY.value]
            bar.total = len(states)
            bar.update(len(ready) - bar.n)
            if ready and _resource_visible(client):
                return len(ready)
            if interrupt is not None and interrupt.requested:
                raise RunInterrupted(f"{interrupt.reason} while the engines were starting")
            _raise_if_all_failed(config, states, deadline)
            time.sleep(delay)
            delay = min(2.0, delay * 1.5)  # model loads take seconds to minutes; spare big clusters


def _ready_bar(progress: bool) -> Any:
    """A progress bar of workers with a ready engine (hidden unless ``progress``); its total grows as workers join."""
    return tqdm(
        total=0,
        desc="engines ready",
        disable=not progress,
        bar_format="{desc}: {n_fmt}/{total_fmt} workers [{elapsed}]",
    )


def _drain_before_retire(client: Any, timeout: float) -> None:
    """Make the scheduler drain daskgen workers before retiring them (:mod:`daskgen.worker.scheduler`)."""
    from daskgen.worker.scheduler import DrainBeforeRetire

    try:
        client.register_plugin(DrainBeforeRetire(timeout), name=DrainBeforeRetire.name)
    except Exception as exc:  # e.g. a scheduler without daskgen installed
        logger.warning(
            "could not install daskgen's drain-before-retire plugin on the scheduler (%s): retiring a "
            "worker will restart its in-flight partitions elsewhere (finished work is safe). Install "
            "daskgen where the scheduler runs to hand back partial responses instead.",
            exc,
        )


def with_engines(states: dict[str, Any]) -> dict[str, Any]:
    """The workers' plugin states but the preprocessing workers' (they run no engine)."""
    return {w: s for w, s in states.items() if s["state"] != PluginState.PREPROCESS.value}


def _raise_if_all_failed(config: RunConfig, states: dict[str, Any], deadline: float) -> None:
    states = with_engines(states)
    failed = {w: s["error"] for w, s in states.items() if s["state"] == PluginState.FAILED.value}
    if states and len(failed) == len(states):
        details = "\n  ".join(f"{w}: {e}" for w, e in failed.items())
        raise EngineError(f"the {config.engine!r} engine failed to start on every worker:\n  {details}")
    if time.monotonic() > deadline:
        raise EngineError(
            f"no engine became ready within {tunables.seconds('engine-start-timeout'):.0f} s; "
            f"worker states: {states}. Raise the Dask config daskgen.engine-start-timeout "
            f"(e.g. DASK_DASKGEN__ENGINE_START_TIMEOUT=30m) or check the worker logs."
        )


class EngineWatch:
    """Stops a run that can no longer generate: every worker's engine failed, or no worker is left.

    Parameters
    ----------
    client:
        The run's client.
    config:
        The run's options (the engine's name for messages).
    info:
        The :class:`daskgen.deploy.ClusterInfo` of a cluster the run started (``None``: an existing scheduler).

    With no worker at all the run waits ``daskgen.engine-start-timeout`` for one to join (jobs of a batch cluster
    may wait in its queue), saying so once; it stops at once when the run's own local cluster is fixed-size and
    every worker process it started has closed (nothing would start another).
    """

    def __init__(self, client: Any, config: RunConfig, info: Any = None) -> None:
        self.client, self.config, self.info = client, config, info
        self._empty_since: float | None = None

    def check(self) -> None:
        """Raise :class:`EngineError` when nothing can progress (finished work is saved either way)."""
        states = with_engines(self.client.run(plugin_status))
        if not states:
            self._no_worker()
            return
        self._empty_since = None
        failed = {w: s["error"] for w, s in states.items() if s["state"] in DEAD_STATES}
        if len(failed) == len(states):
            details = "\n  ".join(f"{w}: {e}" for w, e in failed.items())
            raise EngineError(
                f"the {self.config.engine!r} engine has failed on every worker; finished work is saved, "
                f"rerun the same command to resume once fixed:\n  {details}"
            )

    def _no_worker(self) -> None:
        timeout = tunables.seconds("engine-start-timeout")
        now = time.monotonic()
        if self._empty_since is None:
            self._empty_since = now
            logger.warning(
                "no worker with an engine is connected to the scheduler: the run waits up to %.0f s "
                "(daskgen.engine-start-timeout) for one to join; see the worker logs for why they left",
                timeout,
            )
        if workers_closed_for_good(self.client, self.info):
            raise EngineError(
                "every worker of the run's cluster has closed and none will start again (a fixed-size cluster): "
                "see the messages above and the worker logs for why. Finished work is saved; rerun the same "
                "command to resume once fixed."
            )
        if now - self._empty_since > timeout:
            raise EngineError(
                f"no worker with an engine has been connected to the scheduler for {now - self._empty_since:.0f} s "
                f"(daskgen.engine-start-timeout: {timeout:.0f} s): finished work is saved; start workers (or raise "
                "the timeout, e.g. DASK_DASKGEN__ENGINE_START_TIMEOUT=2h) and rerun the same command to resume."
            )


def workers_closed_for_good(client: Any, info: Any) -> bool:
    """True when ``client`` runs on a fixed-size local cluster the run started (``info``) whose every worker process
    has closed: its nannies are closed, or already forgotten (``distributed.deploy.lost-worker-timeout`` after their
    workers left), and nothing starts others.  Batch clusters are always adaptive (they resubmit expired jobs)."""
    from distributed.core import Status

    cluster = getattr(client, "cluster", None)
    if info is None or info.kind != "local" or info.adaptive or cluster is None:
        return False
    gone = (Status.closing, Status.closed, Status.failed, Status.closing_gracefully)
    return all(getattr(w, "status", None) in gone for w in getattr(cluster, "workers", {}).values())


def thread_slots_note(client: Any) -> str | None:
    """One line (also logged as a warning) when some workers' thread slots cap their partitions in flight
    below what their engine wants, naming the slots, the wanted window and the fix; else ``None``.

    Only workers whose partition tasks hold a thread slot (``daskgen.partitions-hold-threads: true`` where
    they run) report ``slots``.
    """
    states = client.run(plugin_status).values()
    short = [s for s in states if s.get("slots") is not None and (s.get("wanted") or 0) > s["slots"]]
    if not short:
        return None
    slots = min(s["slots"] for s in short)
    wanted = max(s["wanted"] for s in short)
    capacity = max(s.get("capacity") or 0 for s in short)
    note = (
        f"{len(short)} of {len(states)} workers run {slots} partitions at most (their thread slots) but their "
        f"engine (capacity {capacity} requests) wants {wanted} in flight, so it runs underfed; fix: start the "
        f"workers with `dask worker ADDRESS --nthreads {wanted}`, or set daskgen.partitions-hold-threads: "
        "false where they run"
    )
    logger.warning(note)
    return note


def _resource_visible(client: Any) -> bool:
    info = client.scheduler_info(n_workers=-1)["workers"]
    return any(w.get("resources", {}).get(RESOURCE, 0) > 0 for w in info.values())
