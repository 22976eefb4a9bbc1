"""Shared helpers of the daskgen benchmarks: the scripts' ``main``, scratch folders, engine probes.

Every benchmark script imports this module (it sits next to them in ``benchmarks/``); the record
helpers of :mod:`records` are reached through it.  Functions that run on Dask workers (engine
statistics, the utilisation sampler, the synchronous-batch shard) live here and are pickled by value,
so workers need not import ``benchmarks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import cloudpickle
from distributed.diagnostics.plugin import WorkerPlugin
from records import DASKGEN_SRC as DASKGEN_SRC
from records import HERE as HERE
from records import REPO as REPO
from records import Record as Record
from records import add_common_args as add_common_args
from records import fmt as fmt
from records import plot_folder as plot_folder
from records import record_folder as record_folder

if str(DASKGEN_SRC) not in sys.path:  # scripts run as ``python benchmarks/x.py`` from anywhere
    sys.path.insert(0, str(DASKGEN_SRC))

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Name under which the utilisation sampler plugin is registered on workers.
SAMPLER_NAME = "daskgen-bench-sampler"
ENGINE_PLUGIN = "daskgen-engine"


# --------------------------------------------------------------------------- script mains


def run_parts(a: Any, title: str, parts: dict[str, Callable[[Any, Path, Record], Any]]) -> int:
    """The ``main`` of a script with ``--part``: run the chosen parts in order into one record, print
    it and write it to the results folder (unless ``--no-record``)."""
    quiet_logs()
    chosen = {p.strip() for p in a.part.split(",") if p.strip()}
    if chosen - set(parts):
        raise SystemExit(f"unknown part(s) {sorted(chosen - set(parts))}; choose from {', '.join(parts)}")
    rec = Record(title)
    with workdir(a.workdir) as work:
        for name, run_part in parts.items():
            if name in chosen:
                run_part(a, work, rec)
    rec.finish(record_folder(a))
    return 0


@contextlib.contextmanager
def workdir(path: Path | None) -> Iterator[Path]:
    """``path`` (created) or a temporary directory removed afterwards."""
    import tempfile

    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="daskgen-bench-") as tmp:
        yield Path(tmp)


def quiet_logs() -> None:
    """Keep Dask's and daskgen's INFO chatter out of benchmark output."""
    import logging
    import warnings

    for name in ("distributed", "daskgen", "transformers", "asyncio"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# --------------------------------------------------------------------------- worker-side probes


def engine_stats(dask_worker: Any) -> dict[str, Any] | None:
    """``client.run`` target: the worker's engine statistics (``SimulatedEngine.stats``), if any."""
    plugin = dask_worker.plugins.get(ENGINE_PLUGIN)
    engine = getattr(plugin, "engine", None)
    stats = getattr(engine, "stats", None)
    return stats() if callable(stats) else None


def reset_engine_stats(dask_worker: Any) -> bool:
    """``client.run`` target: start a new statistics window on the worker's engine."""
    plugin = dask_worker.plugins.get(ENGINE_PLUGIN)
    reset = getattr(getattr(plugin, "engine", None), "reset_stats", None)
    if callable(reset):
        reset()
        return True
    return False


class UtilisationSampler(WorkerPlugin):
    """Worker plugin that samples the engine's running/waiting requests and tokens every ``period`` s.

    Registered next to daskgen's ``EnginePlugin``; it only reads the engine's public ``stats()``.
    """

    name = SAMPLER_NAME

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.samples: list[tuple[float, int, int, int]] = []
        self._task: asyncio.Task | None = None

    async def setup(self, worker: Any) -> None:
        """Start sampling on the worker's event loop."""
        self.samples = []
        self._task = asyncio.create_task(self._loop(worker))

    async def _loop(self, worker: Any) -> None:
        while True:
            stats = engine_stats(worker)
            if stats is not None:
                self.samples.append(
                    (time.time(), int(stats["running"]), int(stats["waiting"]), int(stats["tokens_generated"]))
                )
            await asyncio.sleep(self.period)

    async def teardown(self, worker: Any) -> None:
        """Stop sampling."""
        if self._task is not None:
            self._task.cancel()


def sampler_samples(dask_worker: Any) -> list[tuple[float, int, int, int]]:
    """``client.run`` target: the sampler's samples on this worker."""
    plugin = dask_worker.plugins.get(SAMPLER_NAME)
    return list(plugin.samples) if plugin is not None else []


def start_sampler(client: Any, period: float = 0.05) -> None:
    """Register a fresh :class:`UtilisationSampler` on every worker."""
    client.register_plugin(UtilisationSampler(period), name=SAMPLER_NAME)


@contextlib.contextmanager
def instrument_run(
    on_ready: Callable[[Any], None] | None = None, on_done: Callable[[Any], Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Time a ``daskgen.client.runner.run`` from engines ready to the last commit, with hooks on its client.

    Wraps ``daskgen.client.engines.start_engines`` (called by ``driver.drive`` before the first submit) and
    ``daskgen.client.driver.drive`` for the duration of the ``with`` block; nothing in daskgen is changed.
    The yielded dict gets ``start_s`` (engine start), ``ready`` / ``done`` (``time.perf_counter``),
    ``ready_wall``, ``generate_s`` (= done - ready) and ``on_done`` (what ``on_done(client)``
    returned, called after the last commit while the cluster still runs).  ``on_ready(client)`` runs
    right before the first partition is submitted.
    """
    import daskgen.client.driver as driver
    import daskgen.client.engines as engines

    original_start, original_drive = engines.start_engines, driver.drive
    marks: dict[str, Any] = {}

    def start_engines(client: Any, config: Any, *args: Any) -> int:
        t0 = time.perf_counter()
        n = original_start(client, config, *args)
        if on_ready is not None:
            on_ready(client)
        marks.update(start_s=time.perf_counter() - t0, ready=time.perf_counter(), ready_wall=time.time())
        return n

    def drive(client: Any, *args: Any, **kwargs: Any) -> Any:
        out = original_drive(client, *args, **kwargs)
        marks["done"] = time.perf_counter()
        marks["generate_s"] = marks["done"] - marks["ready"]
        if on_done is not None:
            marks["on_done"] = on_done(client)
        return out

    engines.start_engines, driver.drive = start_engines, drive
    try:
        yield marks
    finally:
        engines.start_engines, driver.drive = original_start, original_drive


def as_client(connection: Any) -> Any:
    """The client from what ``daskgen.client.cluster.connect`` yields (a client, or ``(client, info)``)."""
    return connection[0] if isinstance(connection, tuple) else connection


def run_requests(config: Any, prompts: Any) -> list[Any]:
    """Every engine request a daskgen run of ``config`` would send, in row order, seeds included.

    Mirrors the partition task's single-turn loop: request id ``p{row}-s{sample}``, the task's
    sampling params with the per-sample seed ``sample_seed(seed, row, sample)``.
    """
    import dataclasses

    from daskgen.client.plan import pending_tasks, prepare
    from daskgen.engines.base import GenerationRequest
    from daskgen.input.rows import tokenize_rows
    from daskgen.worker.partition import sample_seed

    plan = prepare(config, prompts)
    out = []
    for task in pending_tasks(plan, plan.store.read_status()):
        ids = task.prompts if task.prompts is not None else tokenize_rows(task.inputs, plan.tokenizer)
        for row, prompt in zip(task.rows, ids, strict=True):
            for s in range(task.n_samples):
                params = dataclasses.replace(task.params, seed=sample_seed(task.seed, row, s))
                out.append(GenerationRequest(f"p{row}-s{s}", list(prompt), params))
    return out


def simulated_capacity(max_batch: int, base_s: float, per_seq_s: float) -> float:
    """Peak tokens per model second of one simulated engine (every step at ``max_batch``)."""
    return max_batch / (base_s + per_seq_s * max_batch)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


async def generate_on_worker(requests: list[Any]) -> list[int]:
    """Dask task: run ``requests`` on this worker's daskgen engine at once; return output lengths.

    This is how a synchronous rollout drives an engine: the whole shard is submitted together and
    the call returns when its longest sample is done.  Nothing is stored.
    """
    from distributed import get_worker

    plugin = get_worker().plugins[ENGINE_PLUGIN]
    engine = await plugin.get_engine()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    bad = [r.error for r in results if r.error is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed, first: {bad[0]}")
    return [len(r.output_ids) for r in results]


def contiguous_shards(items: Sequence[Any], n: int) -> list[list[Any]]:
    """Split ``items`` into ``n`` contiguous shards of (nearly) equal size, like a data-parallel dispatch."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        out.append(list(items[start:stop]))
        start = stop
    return out
