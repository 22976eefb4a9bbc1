"""The Dask task: generate one partition on a worker and write its chunk-aligned region.

A partition covers store rows ``[start, stop)`` (one chunk along ``prompt``).  Rows that are
already done stay untouched: their data is read back and rewritten unchanged, so a rerun of
the task (Dask reschedules tasks of dead workers) is idempotent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from daskgen import store
from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult, SamplingParams


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
    """Dask task body (``async``: runs on the worker's event loop, engine calls are awaited)."""
    from distributed import get_worker

    t0 = time.perf_counter()
    worker = get_worker()
    plugin = worker.plugins[task.plugin_name]
    engine = await plugin.get_engine()
    region = await asyncio.to_thread(_initial_region, task)
    try:
        results = await asyncio.gather(*(engine.generate(req) for req in build_requests(task)))
    except Exception as exc:
        await plugin.mark_broken(f"{type(exc).__name__}: {exc}")
        raise
    outcome = fill_region(region, task, list(results))
    if not task.params.logprobs:
        region.pop("logprobs")
    await asyncio.to_thread(store.write_region, task.store_path, task.start, region)
    outcome.seconds = time.perf_counter() - t0
    outcome.worker = worker.address
    return outcome


def _initial_region(task: PartitionTask) -> dict[str, np.ndarray]:
    """Existing data when some rows of the region are kept, otherwise fill values."""
    if len(task.rows) == task.stop - task.start:
        return empty_region(task.layout, task.stop - task.start)
    return store.read_region(task.store_path, task.start, task.stop)
