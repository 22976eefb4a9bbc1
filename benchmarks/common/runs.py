"""Timed daskgen runs: the runner instrumented from engines ready to the last commit, and the requests it sends.

:func:`instrument_run` wraps two client functions for the duration of a ``with`` block (nothing in daskgen
changes); :func:`timed_run` runs a configuration under it; :func:`run_streaming` is the streaming side of
the simulated-engine comparisons (:class:`SideResult`, makespan in model seconds).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import workers


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


def run_requests(config: Any, prompts: Any) -> list[Any]:
    """Every engine request a daskgen run of ``config`` would send, in row order, seeds included.

    Mirrors the partition task's single-turn loop: request id ``p{row}-s{sample}``, the task's
    sampling params with the per-sample seed ``sample_seed(seed, row, sample)``.
    """
    import dataclasses

    from daskgen.client.plan import pending_tasks, prepare
    from daskgen.engines.base import GenerationRequest
    from daskgen.input.rows import tokenize_rows
    from daskgen.worker.samples.row_sampling import sample_seed

    plan = prepare(config, prompts)
    out = []
    for task in pending_tasks(plan, plan.store.read_status()):
        ids = task.prompts if task.prompts is not None else tokenize_rows(task.inputs, plan.tokenizer)
        for row, prompt in zip(task.rows, ids, strict=True):
            for s in range(task.n_samples):
                params = dataclasses.replace(task.params, seed=sample_seed(task.seed, row, s))
                out.append(GenerationRequest(f"p{row}-s{s}", list(prompt), params))
    return out


def timed_run(
    config: Any,
    prompts: Any = None,
    on_ready: Callable[[Any], None] | None = None,
    on_done: Callable[[Any], Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """``runner.run(config, prompts)`` under :func:`instrument_run`; its summary and marks.  A run that does
    not finish ends the benchmark."""
    from daskgen.client.runner import run

    with instrument_run(on_ready, on_done) as marks:
        summary = run(config, prompts) if prompts is not None else run(config)
    if not summary.ok:
        raise SystemExit(f"daskgen run did not finish: {summary.line()}")
    return summary, marks


def partitions_of(summary: Any, partition_size: int) -> int:
    """Partitions a run generated (its generated prompts in partitions of ``partition_size``)."""
    return -(-summary.generated_prompts // partition_size)


def measured_side(
    config: Any,
    prompts: Any,
    on_ready: Callable[[Any], None] | None = None,
    on_done: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """:func:`timed_run`'s figures: ``seconds`` (engines ready to the last commit), ``prompts``, ``tokens``,
    ``partitions``, ``start_s`` (engine start), ``done``, and ``marks`` (the instrument's)."""
    summary, marks = timed_run(config, prompts, on_ready, on_done)
    return {
        "seconds": marks["generate_s"],
        "prompts": summary.generated_prompts,
        "tokens": summary.response_tokens,
        "partitions": partitions_of(summary, config.partition_size),
        "start_s": marks["start_s"],
        "done": summary.done,
        "marks": marks,
    }


@dataclass
class SideResult:
    """One measured side of a simulated-engine comparison (sync or streaming)."""

    name: str
    makespan_model_s: float
    wall_s: float
    tokens: int
    stats: list[dict[str, Any]] = field(default_factory=list)
    samples: dict[str, list[tuple[float, int, int, int]]] = field(default_factory=dict)
    t0_wall: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def busy_fraction(self) -> float:
        """Mean over engines of model seconds spent stepping / makespan."""
        busy = [s["busy_s"] for s in self.stats if s]
        return float(np.mean(busy) / self.makespan_model_s) if busy else float("nan")

    def mean_batch(self) -> float:
        """Step-weighted mean running batch over all engines."""
        steps = sum(s["steps"] for s in self.stats if s)
        weighted = sum(s["mean_batch_size"] * s["steps"] for s in self.stats if s)
        return weighted / steps if steps else float("nan")


def run_streaming(config: Any, prompts: list[str], time_scale: float, sample_period: float) -> SideResult:
    """daskgen's ``runner.run`` on a LocalCluster; timed from engines ready to the last commit, with the
    engines' statistics and utilisation samples (every ``sample_period`` wall seconds)."""

    def on_ready(client: Any) -> None:
        client.run(workers.reset_engine_stats)
        workers.start_sampler(client, sample_period)

    def on_done(client: Any) -> tuple[list[Any], dict[str, Any]]:
        return list(client.run(workers.engine_stats).values()), client.run(workers.sampler_samples)

    summary, marks = timed_run(config, prompts, on_ready, on_done)
    wall = marks["generate_s"]
    stats, samples = marks["on_done"]
    return SideResult(
        f"streaming (window {config.window})",
        wall / time_scale,
        wall,
        summary.response_tokens,
        stats,
        samples,
        marks["ready_wall"],
        {"window": config.window, "done": summary.done},
    )
