"""The simulated long-tail workload and its exact models: settings, computed sync batches, emulated streaming.

Shared by ``longtail.py``, ``tail.py`` and ``scaleout_workers.py``.  :func:`computed_sync` gives the
model-time makespan of synchronous global batches from the engine class in instant mode;
:func:`emulate_streaming` is an exact event simulation of daskgen's streaming with zero pipeline overhead.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import cli
from .workers import contiguous_shards

#: The step model of the long-tail workload: model seconds per step, fixed part and per running request.
STEP_BASE_S = 0.02
STEP_PER_SEQ_S = 0.0002


def add_engine_flags(p: argparse.ArgumentParser, time_scale: float) -> None:
    """The simulated engine's step-model flags of the long-tail workload, and ``--time-scale``."""
    cli.add_flags(p, max_batch=256, step_base=STEP_BASE_S, step_per_seq=STEP_PER_SEQ_S, time_scale=time_scale)


def lognormal_engine(time_scale: float, length_mean: float, length_sigma: float, **extra: Any) -> dict[str, Any]:
    """``engine_args`` of a simulated engine with lognormal response lengths (``extra``: more of its options)."""
    lengths = {"length_dist": "lognormal", "length_mean": length_mean, "length_sigma": length_sigma}
    return {"time_scale": time_scale, **lengths, **extra}


def simulated_capacity(max_batch: int, base_s: float, per_seq_s: float) -> float:
    """Peak tokens per model second of one simulated engine (every step at ``max_batch``)."""
    return max_batch / (base_s + per_seq_s * max_batch)


def engine_args(a: argparse.Namespace) -> dict[str, Any]:
    """The simulated engine's options shared by every side."""
    return {
        "max_batch": a.max_batch,
        "step_time_base_s": a.step_base,
        "step_time_per_seq_s": a.step_per_seq,
        "time_scale": a.time_scale,
        "length_dist": "lognormal",
        "length_mean": a.length_mean,
        "length_sigma": a.length_sigma,
        "length_prompt_share": getattr(a, "length_prompt_share", 0.0),
    }


def auto_window(a: argparse.Namespace) -> int:
    """The window daskgen's ``window: auto`` picks for this engine (capacity = ``max_batch``)."""
    from daskgen.worker.admission import AUTO_MAX_WINDOW, resolve_window

    return resolve_window("auto", a.max_batch, a.partition_size * a.n_samples, AUTO_MAX_WINDOW)


def make_config(a: argparse.Namespace, store: Path, window: int) -> Any:
    """The run configuration of the streaming side (the sync side reuses its engine settings)."""
    from daskgen.config import RunConfig

    return RunConfig(
        model="simulated-longtail",
        engine="simulated",
        engine_args=engine_args(a),
        store=str(store),
        n_samples=a.n_samples,
        max_new_tokens=a.max_new_tokens,
        max_prompt_tokens=96,
        temperature=1.0,
        seed=a.seed,
        partition_size=a.partition_size,
        n_workers=a.workers,
        window=window,
        progress=False,
    )


async def instant_shard(requests: list[Any], args: dict[str, Any]) -> dict[str, Any]:
    """Run ``requests`` at once on the simulated engine in instant mode; its statistics and output lengths."""
    from daskgen.engines.simulated import SimulatedEngine

    engine = SimulatedEngine("simulated-longtail", **{**args, "time_scale": 0})
    await engine.start()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    stats = engine.stats()
    await engine.shutdown()
    stats["lengths"] = [len(r.output_ids) for r in results]
    return stats


def computed_sync(requests: list[Any], args: dict[str, Any], workers: int, batch_requests: int) -> dict[str, Any]:
    """Model-time makespan of synchronous global batches, from the engine in instant mode.

    Each global batch of ``batch_requests`` requests is split into ``workers`` contiguous shards; a
    shard's model time is its engine's ``busy_s`` (an engine given the whole shard at once never idles
    until the shard is done); the batch lasts as long as its slowest shard.
    """
    total, busy, lengths, steps, weighted = 0.0, 0.0, [], 0, 0.0
    for start in range(0, len(requests), batch_requests):
        batch = requests[start : start + batch_requests]
        shards = contiguous_shards(batch, workers)
        stats = [asyncio.run(instant_shard(s, args)) for s in shards if s]
        total += max(s["busy_s"] for s in stats)
        busy += sum(s["busy_s"] for s in stats)
        for s in stats:
            lengths.extend(s["lengths"])
            steps += s["steps"]
            weighted += s["mean_batch_size"] * s["steps"]
    return {"makespan": total, "busy": busy, "lengths": lengths, "mean_batch": weighted / max(steps, 1)}


# --------------------------------------------------------------------------- emulated streaming


@dataclass
class EngineState:
    """One emulated engine: running requests (remaining tokens, partition), FIFO queue, model clock."""

    remaining: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    partition: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    waiting: list[tuple[int, int]] = field(default_factory=list)
    clock: float = 0.0
    busy_tokens: int = 0


def emulate_streaming(
    partitions: list[np.ndarray],
    workers: int,
    window: int,
    max_batch: int,
    base_s: float,
    per_seq_s: float,
    occupancy: bool = False,
) -> dict[str, float]:
    """Model-time makespan of windowed partition streaming under the simulated engine's step model.

    An exact event simulation with **zero** pipeline overhead: each worker holds up to ``window``
    partitions; a partition's requests join its engine's FIFO queue at once; the engine runs at most
    ``max_batch`` requests, each step advancing all of them by one token at ``base_s + per_seq_s ×
    running`` model seconds; when a partition's last request finishes, the next partition of the job
    goes to that worker at that instant.  It isolates what the partition barrier and the window cost,
    separately from Dask and time-compression overheads.  With ``occupancy`` the window is daskgen's
    ``window: auto`` rule (:class:`daskgen.worker.admission.Admission`) applied at every event, starting at
    ``window``: more partitions while the engine's unfinished requests are below its target.
    """
    import heapq

    from daskgen.worker.admission import Admission

    todo = list(range(len(partitions)))[::-1]
    left = {p: len(partitions[p]) for p in range(len(partitions))}
    engines = [EngineState() for _ in range(workers)]
    rule = Admission.for_engine(max_batch, max(len(p) for p in partitions), 10**6) if occupancy else None
    held = [0] * workers  # partitions each engine holds

    def give(e: EngineState) -> None:
        p = todo.pop()
        e.waiting.extend((int(n), p) for n in partitions[p])
        held[next(i for i, x in enumerate(engines) if x is e)] += 1

    def top_up(w: int) -> None:
        e = engines[w]
        while rule is not None and todo and held[w] < rule.window(held[w], len(e.remaining) + len(e.waiting)):
            give(e)

    def admit(e: EngineState) -> None:
        free = max_batch - len(e.remaining)
        if free > 0 and e.waiting:
            take, e.waiting = e.waiting[:free], e.waiting[free:]
            e.remaining = np.concatenate([e.remaining, np.array([n for n, _ in take], dtype=np.int64)])
            e.partition = np.concatenate([e.partition, np.array([p for _, p in take], dtype=np.int64)])

    for _ in range(window):
        for e in engines:
            if todo:
                give(e)
    heap = []
    for w, e in enumerate(engines):
        top_up(w)
        admit(e)
        if len(e.remaining):
            heap.append((e.clock + int(e.remaining.min()) * (base_s + per_seq_s * len(e.remaining)), w))
    heapq.heapify(heap)
    while heap:
        _, w = heapq.heappop(heap)
        e = engines[w]
        k = int(e.remaining.min())
        e.clock += k * (base_s + per_seq_s * len(e.remaining))
        e.busy_tokens += k * len(e.remaining)
        e.remaining -= k
        done = e.remaining == 0
        for p in e.partition[done].tolist():
            left[p] -= 1
            if left[p] == 0:
                held[w] -= 1
                if todo and rule is None:
                    give(e)
        e.remaining, e.partition = e.remaining[~done], e.partition[~done]
        top_up(w)
        admit(e)
        if len(e.remaining):
            heapq.heappush(heap, (e.clock + int(e.remaining.min()) * (base_s + per_seq_s * len(e.remaining)), w))
    makespan = max(e.clock for e in engines)
    return {"makespan": makespan, "tokens": sum(e.busy_tokens for e in engines)}
