"""The Dask task: generate one partition on a worker and write its chunk-aligned region.

A partition covers store rows ``[start, stop)`` (one chunk along ``prompt``).  Rows that are
already done stay untouched: their data is read back and rewritten unchanged, so a rerun of
the task (Dask reschedules tasks of dead workers) is idempotent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daskgen import store
from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult, SamplingParams, error_result
from daskgen.errors import EngineError


@dataclass
class PartitionTask:
    """Everything a worker needs for one partition (small: token ids of pending rows only)."""

    store_path: str
    start: int
    stop: int
    rows: list[int]
    prompts: list[list[int]]
    n_samples: int
    params: SamplingParams
    seed: int
    layout: store.Layout
    plugin_name: str = "daskgen-engine"
    timeout_s: float | None = None
    isolate: bool = False


@dataclass
class PartitionResult:
    """What the client commits: per-row outcome plus counters."""

    start: int
    stop: int
    rows: list[int]
    failed: dict[int, str] = field(default_factory=dict)
    prompt_tokens: int = 0
    response_tokens: int = 0
    seconds: float = 0.0
    worker: str = ""


def sample_seed(seed: int, row: int, sample: int) -> int:
    """Per-sample seed from (run seed, prompt row, sample), stable across runs and machines."""
    state = np.random.SeedSequence([seed, row, sample]).generate_state(1, dtype=np.uint32)[0]
    return int(state) & 0x7FFFFFFF


def empty_region(layout: store.Layout, n_rows: int) -> dict[str, np.ndarray]:
    """Fill-valued arrays for ``n_rows`` rows of every data array."""
    specs = layout.array_specs()
    out = {}
    for name in store.DATA_ARRAYS:
        shape, _, dtype, fill, _ = specs[name]
        out[name] = np.full((n_rows, *shape[1:]), fill, dtype=dtype)
    return out


def build_requests(task: PartitionTask) -> list[GenerationRequest]:
    """n requests per pending row, each with its own derived seed."""
    requests = []
    for row, prompt in zip(task.rows, task.prompts, strict=True):
        for s in range(task.n_samples):
            params = SamplingParams(**{**task.params.__dict__, "seed": sample_seed(task.seed, row, s)})
            requests.append(GenerationRequest(f"p{row}-s{s}", list(prompt), params))
    return requests


def fill_region(region: dict[str, np.ndarray], task: PartitionTask,
                results: list[GenerationResult]) -> PartitionResult:
    """Place prompts and results into the region arrays; collect per-row failures."""
    out = PartitionResult(task.start, task.stop, list(task.rows))
    for i, (row, prompt) in enumerate(zip(task.rows, task.prompts, strict=True)):
        r = row - task.start
        region["prompt_ids"][r] = task.layout.pad_token_id
        region["prompt_ids"][r, : len(prompt)] = prompt
        region["prompt_length"][r] = len(prompt)
        out.prompt_tokens += len(prompt)
        for s in range(task.n_samples):
            res = results[i * task.n_samples + s]
            out.response_tokens += _place_sample(region, r, s, res, task.layout.max_new_tokens,
                                                 task.layout.pad_token_id)
            if res.error is not None:
                out.failed.setdefault(row, f"sample {s}: {res.error}")
    return out


def _place_sample(region: dict[str, np.ndarray], r: int, s: int, res: GenerationResult, width: int,
                  pad: int) -> int:
    ids = res.output_ids[:width]
    n = len(ids)
    region["response_ids"][r, s] = pad
    region["response_ids"][r, s, :n] = ids
    region["response_length"][r, s] = n
    region["response_mask"][r, s] = 0
    region["response_mask"][r, s, :n] = 1
    region["logprobs"][r, s] = np.nan
    if res.logprobs is not None:
        region["logprobs"][r, s, : min(n, len(res.logprobs))] = res.logprobs[:n]
    reason = FinishReason.ERROR if res.error is not None else res.finish_reason
    region["finish_reason"][r, s] = int(reason)
    region["num_turns"][r, s] = 1
    return n


async def run_partition(task: PartitionTask) -> PartitionResult:
    """Dask task body (``async``: runs on the worker's event loop, engine calls are awaited).

    Normal mode generates every request of the partition at once; an engine exception or a
    timeout fails the task (Dask retries it).  ``isolate`` mode (used after those retries)
    generates row by row and records a failing row as failed, so one poison prompt cannot
    take the rest of its partition down.
    """
    from distributed import get_worker

    t0 = time.perf_counter()
    worker = get_worker()
    plugin = worker.plugins[task.plugin_name]
    region = await asyncio.to_thread(_initial_region, task)
    requests = build_requests(task)
    if task.isolate:
        results = await _generate_isolated(plugin, task, requests)
    else:
        results = await _generate(plugin, task, requests)
    outcome = fill_region(region, task, results)
    if not task.params.logprobs:
        region.pop("logprobs")
    await asyncio.to_thread(store.write_region, task.store_path, task.start, region)
    outcome.seconds = time.perf_counter() - t0
    outcome.worker = worker.address
    return outcome


async def _generate(plugin: Any, task: PartitionTask, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """All requests at once; a crash or hang marks the engine broken (it restarts) and raises."""
    engine = await plugin.get_engine()
    calls = asyncio.gather(*(engine.generate(req) for req in requests))
    try:
        return list(await asyncio.wait_for(calls, task.timeout_s))
    except asyncio.TimeoutError:
        for req in requests:
            await engine.abort(req.request_id)
        await plugin.check_health()
        raise EngineError(f"{len(requests)} request(s) of rows {task.rows[0]}..{task.rows[-1]} did not finish "
                          f"within partition_timeout_s={task.timeout_s}") from None
    except Exception as exc:
        await plugin.mark_broken(f"{type(exc).__name__}: {exc}")
        raise


async def _generate_isolated(plugin: Any, task: PartitionTask,
                             requests: list[GenerationRequest]) -> list[GenerationResult]:
    """Row by row; a row whose generation raises gets error results instead of failing the task."""
    results: list[GenerationResult] = []
    n = task.n_samples
    for i in range(len(task.rows)):
        row_requests = requests[i * n : (i + 1) * n]
        try:
            results += await _generate(plugin, task, row_requests)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc} (failed again when retried alone)"
            results += [error_result(req, message) for req in row_requests]
    return results


def _initial_region(task: PartitionTask) -> dict[str, np.ndarray]:
    """Existing data when some rows of the region are kept, otherwise fill values."""
    if len(task.rows) == task.stop - task.start:
        return empty_region(task.layout, task.stop - task.start)
    return store.read_region(task.store_path, task.start, task.stop)
