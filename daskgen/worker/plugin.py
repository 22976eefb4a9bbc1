"""``EnginePlugin``: one persistent inference engine per Dask worker.

The engine loads in the background so the worker's event loop (heartbeats) keeps running.
Only when it has started and passed a health check that really generates does the worker
advertise the ``daskgen-engine`` resource; partition tasks require that resource, so a worker whose engine failed
to start takes no partitions.  The amount advertised is the per-worker in-flight window.  A crashed or hung engine
is restarted in place; a worker whose restart fails withdraws the resource.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import traceback
from collections.abc import AsyncIterator
from typing import Any

from distributed import WorkerPlugin

from daskgen import tunables
from daskgen.dashboard.metrics import WORKER_TOPIC, WorkerMeter
from daskgen.engines.cpus import export_memory_limit
from daskgen.errors import EngineError, EngineUnavailable
from daskgen.gc_tuning import collector_settings, thaw_collector, tune_collector
from daskgen.worker.admission import AUTO_DEFAULT_CAPACITY, WINDOW_TOPIC, Admission, resolve_window, wanted_window
from daskgen.worker.drain import Draining
from daskgen.worker.gpu import export_local_rank
from daskgen.worker.images import PREPROCESS_RESOURCE, image_metrics
from daskgen.worker.prefix_order import AlternatingOrder
from daskgen.worker.slot import PartitionSlot
from daskgen.worker.thread_slots import offer_no_slot_yet, partitions_hold_threads, start_admitted_tasks
from daskgen.worker.writers.pool import WriterPool, start_writers, stop_writers

logger = logging.getLogger(__name__)

PLUGIN_NAME = "daskgen-engine"
RESOURCE = "daskgen-engine"


class PluginState(str, enum.Enum):
    """Where a worker's engine is: ``new`` -> ``starting`` -> ``ready`` (-> ``restarting`` -> ``ready``) or
    ``failed``; ``closed`` after teardown.  Partitions run only while it is ``ready``.  ``preprocess``: a worker
    that preprocesses images and runs no engine (:data:`~daskgen.worker.images.PREPROCESS_RESOURCE`)."""

    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    CLOSED = "closed"
    PREPROCESS = "preprocess"


class EnginePlugin(Draining, WorkerPlugin):
    """Hold one engine per worker for the whole run.

    Parameters
    ----------
    engine, model, engine_args:
        Which engine to build (registry name or ``module:Class``) and its options.
    window:
        Partitions this worker may run at once (advertised as the resource amount), or
        ``"auto"``: sized from the engine's capacity by :func:`resolve_window` once it started.
    requests_per_partition:
        Engine requests one partition makes (prompts x samples), for ``window="auto"``.
    adapters:
        The run's LoRA adapters (name -> folder), given to the engine as its ``adapters`` argument when any.
    """

    name = PLUGIN_NAME

    def __init__(
        self,
        engine: str,
        model: str,
        engine_args: dict[str, Any] | None = None,
        window: int | str = "auto",
        requests_per_partition: int = 1,
        drain_timeout_s: float = 20.0,
        refresh: str | None = None,
        policy_store: Any = None,
        adapters: dict[str, str] | None = None,
    ):
        self.engine_name, self.model = engine, model
        self.engine_args = dict(engine_args or {})
        self.adapters = dict(adapters or {})
        self.window = window
        self.requests_per_partition = requests_per_partition
        self.resolved_window: int | None = None
        self.wanted_window: int | None = None  # what the engine wants, before the task slots cap it
        self.slots: int | None = None  # the worker's task slots when partitions hold one, else None
        self.engine: Any = None
        self.state = PluginState.NEW
        self.error: str | None = None
        self.gpu: str | None = None
        self._worker: Any = None
        self._ready: asyncio.Event | None = None
        self._starter: asyncio.Task | None = None
        self._advertised = False
        self.stopping = False
        self.draining = False
        self.drain_timeout_s = drain_timeout_s
        self.handles: set[Any] = set()
        self.running = 0  # partition tasks executing on this worker
        self.outstanding = 0  # their samples not finished yet (requests running or queued in the engine)
        self.admission_ticks = 0  # times ``window: auto`` applied its rule to a measured occupancy
        self.held_readings = 0  # readings in a row at which the engine held its occupancy target
        self._leaving: asyncio.Task | None = None
        self._admitter: asyncio.Task | None = None
        self._reporter: asyncio.Task | None = None
        self.meter = WorkerMeter()  # what the dashboard shows of this worker (daskgen.dashboard.metrics)
        self.prompt_order = AlternatingOrder()  # the direction of its partitions' prompt order (prefix dispatch)
        self.refresh, self.policy_store = refresh, policy_store  # ``refresh`` runs: daskgen.worker.refresh
        self.refresher: Any = None
        self._policy_follower: asyncio.Task | None = None
        self.writers: WriterPool | None = None  # daskgen.writer-processes: started in setup (worker/writers/)

    @property
    def ready_event(self) -> asyncio.Event:
        """Set while the engine is ready (created in :meth:`setup`, on the worker's event loop)."""
        if self._ready is None:
            raise EngineError("the daskgen engine plugin is not set up on a worker yet")
        return self._ready

    async def setup(self, worker: Any) -> None:
        """Start loading the engine in the background and return at once (not on a preprocessing worker).  Also
        makes the worker hand back its in-flight work before it goes (:mod:`daskgen.worker.drain`): retirement, a
        nanny closing its worker and a SIGTERM to its process drain it first."""
        from daskgen.worker.drain import install_worker_hooks

        if worker.state.total_resources.get(PREPROCESS_RESOURCE):  # a CPU worker preprocessing images
            self._worker, self._ready, self.state = worker, asyncio.Event(), PluginState.PREPROCESS
            return

        self._worker = worker
        offer_no_slot_yet(worker, RESOURCE)
        self._ready = asyncio.Event()
        self._tokenizer_lock = threading.Lock()  # the warm-up and a first partition may both ask
        if self.refresh is not None:
            from daskgen.worker.refresh import PolicyRefresher, listen_for_versions

            self.refresher = PolicyRefresher(self.policy_store, self.refresh, self.live_engine, str(worker.name))
            listen_for_versions(worker, self.refresher)
            self._policy_follower = asyncio.create_task(self.refresher.follow(self._refresh_failed))
        collector_settings()  # a bad daskgen.worker-gc setting fails here, before the engine loads
        self.writers = start_writers()
        self._starter = asyncio.create_task(self._start())
        if tunables.get("dashboard.enabled"):
            self._reporter = asyncio.create_task(self._report_metrics())
        install_worker_hooks(worker, self)

    async def _start(self) -> None:
        """Start the engine and, on its first start, advertise this worker's partition slots."""
        self.state, self.error = PluginState.STARTING, None
        try:
            await self._load_engine()
            await asyncio.to_thread(self._warm_up)  # after: transformers' lazy imports are not thread-safe
        except Exception as exc:  # recorded and shown to the client; the worker takes no partitions
            self.state, self.error = PluginState.FAILED, f"{type(exc).__name__}: {exc}"
            logger.error("daskgen engine failed to start on %s:\n%s", self._worker.address, traceback.format_exc())
            if self._advertised:  # a restart failed: stop taking partitions for good
                await self._worker.set_resources(**{RESOURCE: 0.0})
            return
        finally:
            self.ready_event.set()
        self.state = PluginState.READY
        tune_collector()  # after every start: what the engine loaded is frozen too
        if self.refresher is not None:  # the newest policy version before the first request (and after restarts)
            await self.refresher.check(self._refresh_failed)
        if not self._advertised:
            await self._advertise(self.engine.capacity)

    async def _load_engine(self) -> None:
        """Pin this worker's GPU (once), then create, start and health-check the engine."""
        from daskgen.engines import resolve_engine_class

        if self.gpu is None:
            self.gpu = _pin_gpu(self._worker.name)
            export_local_rank(self._worker.name)  # for engines that bind CPU threads (daskgen.engines.cpus)
            export_memory_limit(self._worker.memory_manager.memory_limit)  # for engines that size caches from it
        lora = {"adapters": self.adapters} if self.adapters else {}
        self.engine = resolve_engine_class(self.engine_name)(self.model, **self.engine_args, **lora)
        await self.engine.start()
        await asyncio.wait_for(self.engine.health(), tunables.seconds("health-timeout"))

    async def _advertise(self, capacity: int | None) -> None:
        """Resolve the window for an engine of ``capacity``, offer that many slots, follow occupancy under ``auto``."""
        self.slots = self._worker.state.nthreads if partitions_hold_threads() else None
        self.wanted_window = wanted_window(self.window, capacity, self.requests_per_partition)
        self.resolved_window = resolve_window(self.window, capacity, self.requests_per_partition, self.slots)
        logger.info(
            "daskgen engine ready on %s: %d partitions in flight (window %s, engine capacity %s, %d requests each)",
            *(self._worker.address, self.resolved_window, self.window, capacity, self.requests_per_partition),
        )
        await self._set_window(self.resolved_window)
        self._advertised = True
        if self.window == "auto":
            admission = Admission.for_engine(capacity, self.requests_per_partition, self.slots)
            self._admitter = asyncio.create_task(self._follow_occupancy(admission))

    async def _follow_occupancy(self, admission: Admission) -> None:
        """``window: auto``: re-size the window from the engine's occupancy (:mod:`daskgen.worker.admission`)."""
        while True:
            await asyncio.sleep(tunables.seconds("admission-interval"))
            if self.state is not PluginState.READY or self.draining or self.stopping or not self.running:
                self.held_readings = 0  # idle: nothing measured, keep the window; a gap ends a run of readings
                continue
            self.wanted_window, self.held_readings = admission.follow(
                self.running, self.outstanding, self.wanted_window or 0, self.held_readings
            )
            self.admission_ticks += 1
            window = admission.capped(self.wanted_window)
            if window != self.resolved_window:
                await self._set_window(window)

    async def _set_window(self, window: int) -> None:
        """Offer ``window`` partition slots (the ``daskgen-engine`` resource) and tell the client."""
        self.resolved_window = window
        await self._worker.set_resources(**{RESOURCE: float(window)})
        if window:
            start_admitted_tasks(self._worker)
        self._announce_window()

    def _refresh_failed(self, message: str) -> None:
        """A policy refresh failed: the engine keeps its version; the dashboard shows the error."""
        self.meter.last_error = message

    def _announce_window(self) -> None:
        """Tell the client (subscribed to :data:`WINDOW_TOPIC`) how many partitions this worker admits."""
        self._worker.log_event(WINDOW_TOPIC, {"worker": self._worker.address, "window": self.resolved_window})

    async def _report_metrics(self) -> None:
        """Publish this worker's engine counts for the dashboard once per ``daskgen.dashboard.interval``."""
        while True:
            await asyncio.sleep(tunables.seconds("dashboard.interval"))
            self._worker.log_event(WORKER_TOPIC, self.metrics_report())

    def metrics_report(self) -> dict[str, Any]:
        """This worker's message for the dashboard (:meth:`daskgen.dashboard.metrics.WorkerMeter.report`)."""
        engine = self.live_engine()
        return self.meter.report(
            self._worker.address,
            state=self.state.value,
            outstanding=self.outstanding,
            capacity=(engine.capacity or AUTO_DEFAULT_CAPACITY) if engine is not None else 0,
            window=self.resolved_window,
            running=self.running,
            wanted=self.wanted_window,
            slots=self.slots,
            **(self.refresher.status() if self.refresher is not None else {}),
            **image_metrics(),
        )

    async def get_engine(self) -> Any:
        """The started engine (waiting while it restarts); raises :class:`EngineUnavailable` when it failed."""
        await self.ready_event.wait()
        if self.state is not PluginState.READY:
            raise EngineUnavailable(f"engine on worker {self._worker.address} is {self.state.value}: {self.error}")
        return self.engine

    async def came_back(self) -> bool:
        """After a failure: wait for a restart in progress; true when the engine is running (again)."""
        await self.ready_event.wait()
        return self.state is PluginState.READY

    def live_engine(self) -> Any:
        """The running engine, or ``None`` while it is restarting, failed or closed."""
        return self.engine if self.state is PluginState.READY else None

    async def mark_broken(self, reason: str) -> None:
        """Stop taking partitions and restart the engine (after a crash or failed health check)."""
        if self.state is not PluginState.READY:
            return
        logger.error("daskgen engine on %s is broken (%s); restarting it", self._worker.address, reason)
        # Partitions that arrive meanwhile wait in get_engine().  (Dropping the resource to 0
        # here would strand retried tasks: the scheduler does not revisit them when it returns.)
        self.state, self.error = PluginState.RESTARTING, reason
        self.meter.restarted(reason)
        self.ready_event.clear()
        await _quietly_shutdown(self.engine)
        self._starter = asyncio.create_task(self._start())

    async def check_health(self, timeout: float | None = None) -> bool:
        """Generate one token; on failure or timeout (default ``daskgen.health-timeout``) mark it broken (restart)."""
        if self.state is not PluginState.READY:
            return False
        timeout = tunables.seconds("health-timeout") if timeout is None else timeout
        try:
            await asyncio.wait_for(self.engine.health(), timeout)
        except asyncio.TimeoutError:
            await self.mark_broken(f"health check failed: no token within {timeout:g} s (daskgen.health-timeout)")
            return False
        except Exception as exc:
            await self.mark_broken(f"health check failed: {type(exc).__name__}: {exc}")
            return False
        return True

    def tokenizer(self) -> Any:
        """The model's tokenizer on this worker (loaded once), e.g. to decode for verifiers."""
        with self._tokenizer_lock:
            if getattr(self, "_tokenizer", None) is None:
                from daskgen.engines.tokenizer import load_tokenizer

                self._tokenizer = load_tokenizer(self.model, self.engine_name, self.engine_args)
        return self._tokenizer

    def _warm_up(self) -> None:
        """Load what the first partition needs besides the engine (its tokenizer, Zarr), so that its requests reach
        the engine without that delay.  A failure here is left to the partition that needs the part."""
        from daskgen.store.generation_store import import_zarr

        import_zarr()
        try:
            self.tokenizer()
        except Exception as exc:  # e.g. a remote engine's model name with no local tokenizer
            logger.debug("no tokenizer loaded ahead of the first partition: %s", exc)

    @contextlib.asynccontextmanager
    async def partition(self, samples: int) -> AsyncIterator[PartitionSlot]:
        """Run one partition of ``samples`` samples on this worker, counted as running until the block ends; the
        slot hands out the engine and counts its samples (:class:`~daskgen.worker.slot.PartitionSlot`)."""
        self.running += 1
        slot = PartitionSlot(self, samples)
        try:
            yield slot
        finally:
            slot.release()
            self.running -= 1
            self.meter.partitions += 1

    async def stop_run(self) -> int:
        """Run-level stop (target/budget/deadline reached): abort every request in flight.  Partitions already
        running finish at once with ``abort`` samples; later ones generate nothing.  Returns the requests aborted."""
        self.stopping = True
        aborted = 0
        for handle in list(self.handles):
            aborted += len(handle.in_flight)
            await handle.abort_all()
        return aborted

    def status(self) -> dict[str, Any]:
        """Small summary for the client."""
        return {
            "state": self.state.value,
            "error": self.error,
            "gpu": self.gpu,
            "engine": self.engine_name,
            "window": self.resolved_window,
            "wanted": self.wanted_window,
            "slots": self.slots,
            "capacity": getattr(self.engine, "capacity", None),
            "admission_ticks": self.admission_ticks,
            **(self.refresher.status() if self.refresher is not None else {}),
        }

    async def teardown(self, worker: Any) -> None:
        """Shut the engine down when the worker closes or the plugin is replaced."""
        for task in (self._starter, self._admitter, self._reporter, self._policy_follower):
            if task is not None and not task.done():
                task.cancel()
        await _quietly_shutdown(self.engine)
        stop_writers(self.writers)
        self.state = PluginState.CLOSED


async def _quietly_shutdown(engine: Any) -> None:
    try:
        if engine is not None:
            await engine.shutdown()
    except Exception:  # shutting down a broken engine may fail; never mask the original problem
        logger.warning("engine shutdown raised", exc_info=True)
    thaw_collector()  # what was frozen with the engine can be freed now


def _pin_gpu(worker_name: Any) -> str:
    """Give this worker its own GPU when several are visible (before any CUDA initialisation)."""
    from daskgen.worker.gpu import pin_gpu

    description = pin_gpu(worker_name).describe()
    logger.info(description)
    return description


async def stop_run_on_worker(dask_worker: Any) -> int:
    """Run on every worker via ``client.run`` when the client stops the run early."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return 0 if plugin is None else await plugin.stop_run()


def engine_description(dask_worker: Any) -> dict[str, Any] | None:
    """Run on a worker via ``client.run``: the ready engine's ``describe()`` (no secrets)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is None or plugin.state is not PluginState.READY:
        return None
    return plugin.engine.describe()


def metrics_report(dask_worker: Any) -> dict[str, Any] | None:
    """Run on a worker via ``client.run`` at the end of a run: its last dashboard report, or ``None``."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return None if plugin is None else plugin.metrics_report()


def plugin_status(dask_worker: Any) -> dict[str, Any]:
    """Run on a worker via ``client.run`` to report the plugin's state."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return {"state": "missing", "error": None} if plugin is None else plugin.status()
