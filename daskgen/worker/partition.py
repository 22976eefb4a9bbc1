"""The Dask task: generate one partition on a worker and write its chunk-aligned region.

A partition covers store rows ``[start, stop)`` (one chunk along ``prompt``).  Each (row,
sample) runs through the run's agent loop (``single_turn`` by default), which returns one or
more trajectories.  Rows that are already done stay untouched: their data is read back and
rewritten unchanged, so a rerun of the task (Dask reschedules tasks of dead workers) is
idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from daskgen.agents import AgentLoop, EngineHandle, SingleTurn, Trajectory, create_agent
from daskgen.engines.base import FinishReason, GenerationRequest, SamplingParams
from daskgen.errors import EngineError, EngineUnavailable
from daskgen.store.layout import empty_region
from daskgen.worker.images import place_images
from daskgen.worker.prefix_order import gather_in_prompt_order
from daskgen.worker.rounds import RowOutcome, sample_in_rounds
from daskgen.worker.samples.continuation import sample_with_prefix, stored_samples
from daskgen.worker.samples.fast_path import PlainTurns, Samples, TurnBatch, as_trajectories
from daskgen.worker.samples.region import place_prompts, place_samples
from daskgen.worker.samples.row_inputs import input_format, place_row_texts, tokenize_inputs
from daskgen.worker.samples.row_sampling import apply_stops, place_row_settings, sample_params
from daskgen.worker.samples.seeds import sample_seeds, with_seed
from daskgen.worker.slot import PartitionSlot
from daskgen.worker.task import PartitionResult, PartitionTask
from daskgen.worker.thread_slots import leave_thread_slot

if TYPE_CHECKING:
    from daskgen.worker.plugin import EnginePlugin
    from daskgen.worker.writers.pool import WriterPool
    from daskgen.worker.writers.shared_regions import Handover


def fill_region(
    region: dict[str, np.ndarray],
    task: PartitionTask,
    samples: Samples,
    rounds: list[RowOutcome] | None = None,
) -> PartitionResult:
    """Place prompts and trajectories (and verifier scores) into the region; collect per-row failures.

    Every sample of the partition is placed at once (:mod:`daskgen.worker.samples.region`)."""
    out = PartitionResult(task.start, task.stop, list(task.rows))
    _record_rounds(region, task, rounds or [], out)
    place_row_settings(region, task.start, task.rows, task.row_settings)
    layout = task.layout
    assert task.prompts is not None, "the worker tokenizes a task's inputs before filling its region"
    offsets = [row - task.start for row in task.rows]
    out.prompt_tokens = place_prompts(region, offsets, task.prompts, layout.pad_token_id)
    place_row_texts(region, task, offsets)
    if task.images is not None:
        place_images(region, offsets, task.images)
    counts = place_samples(region, task.rows, offsets, task.n_samples, samples, layout)
    out.failed, out.aborted, out.notes = counts.failed, counts.aborted, {**counts.notes, **out.notes}
    out.response_tokens, out.carried_tokens = counts.response_tokens, counts.carried_tokens
    out.partial_samples, out.partial_tokens = counts.partial_samples, counts.partial_tokens
    return out


def _record_rounds(
    region: dict[str, np.ndarray], task: PartitionTask, rounds: list[RowOutcome], out: PartitionResult
) -> None:
    """Store each row's verifier scores and samples used; keep its verifier notes in ``out``."""
    for i, outcome in enumerate(rounds):
        r = task.rows[i] - task.start
        region["score"][r] = outcome.scores
        region["samples_used"][r] = outcome.used
        if outcome.notes:
            out.notes[task.rows[i]] = "; ".join(outcome.notes)


async def run_partition(task: PartitionTask, preprocessed: Any = None) -> PartitionResult:
    """Dask task body (``async``: runs on the worker's event loop, engine calls are awaited).

    Normal mode runs every (row, sample) at once; an engine exception or a timeout fails the
    task (Dask retries it).  ``isolate`` mode (used after those retries) goes row by row and
    records a failing row as failed, so one poison prompt cannot take its partition down.
    The task gives back its worker thread slot first (:mod:`daskgen.worker.thread_slots`).  ``preprocessed``: its
    rows' images as a preprocessing worker prepared them (:func:`daskgen.worker.images.preprocess_images`).
    """
    from distributed import get_worker

    t0 = time.perf_counter()
    worker = get_worker()
    leave_thread_slot(worker, task.key)
    plugin = cast("EnginePlugin", worker.plugins[task.plugin_name])
    task.preprocessed = preprocessed
    agent = create_agent(task.agent, task.model, task.agent_args)
    async with plugin.partition(len(task.rows) * task.n_samples) as slot:
        region, prefixes = await _prepare_inputs(task, plugin)
        handle = await slot.engine_handle()
        if getattr(agent, "max_tool_images", 0):
            handle.media = _tool_images(task, plugin)
        generation = PartitionGeneration(plugin, handle, agent, task, prefixes, slot)
        results = await generation.run()
        rounds = results if task.verify is not None and isinstance(results, list) else None  # RowOutcomes
        samples = [t for o in rounds for t in o.samples] if rounds is not None else results
        if plugin.writers is None:  # placed and written in a thread of the worker
            outcome = await asyncio.to_thread(write_partition, task, region, samples, rounds)
        else:  # placed and handed over in a thread, written by a writer process (daskgen.worker.writers.pool)
            handover, outcome = await asyncio.to_thread(place_for_writer, plugin.writers, task, region, samples, rounds)
            await plugin.writers.write(task.store, task.start, handover)
    outcome.seconds, outcome.worker = time.perf_counter() - t0, worker.address
    return outcome


async def _prepare_inputs(
    task: PartitionTask, plugin: EnginePlugin
) -> tuple[dict[str, np.ndarray] | None, dict[tuple[int, int], Trajectory]]:
    """Tokenize the task's inputs (if the client did not) and read the stored samples it continues.

    Returns the stored region (``None`` unless the task continues partial samples) and the samples to keep.
    """
    if task.prompts is None:
        await tokenize_inputs(task, plugin)
    # Only a partition with stored samples of its pending rows (an earlier attempt was interrupted)
    # reads its region before generating; otherwise the padded region is allocated once the results
    # are in, so partitions waiting in a large in-flight window do not each hold one.
    region = await asyncio.to_thread(_stored_region, task) if task.continue_partial else None
    if region is None:
        return None, {}
    stops = set(task.params.stop_token_ids)
    return region, stored_samples(region, task.start, task.rows, task.n_samples, stops, task.params.logprobs)


def place_partition(
    task: PartitionTask,
    region: dict[str, np.ndarray] | None,
    samples: Samples,
    rounds: list[RowOutcome] | None,
) -> tuple[dict[str, np.ndarray], PartitionResult]:
    """The partition's region with its results placed, and its outcome.  ``region``: the stored one read before
    generating, or ``None``."""
    if region is None:
        region = _initial_region(task)
    outcome = fill_region(region, task, samples, rounds)
    if not task.params.logprobs:
        region.pop("logprobs")
    return region, outcome


def place_for_writer(
    writers: WriterPool,
    task: PartitionTask,
    region: dict[str, np.ndarray] | None,
    samples: Samples,
    rounds: list[RowOutcome] | None,
) -> tuple[Handover, PartitionResult]:
    """:func:`place_partition`, the region then made ready for one of ``writers`` (in the same thread)."""
    filled, outcome = place_partition(task, region, samples, rounds)
    return writers.hand_over(filled), outcome


def write_partition(
    task: PartitionTask,
    region: dict[str, np.ndarray] | None,
    samples: Samples,
    rounds: list[RowOutcome] | None,
) -> PartitionResult:
    """:func:`place_partition`, then write the region: the task finishes only after its data landed."""
    filled, outcome = place_partition(task, region, samples, rounds)
    task.store.write_region(task.start, filled)
    return outcome


@dataclass
class PartitionGeneration:
    """One partition's generation on its worker: the engine handle, agent loop, kept prefixes and slot.

    ``plugin`` is the worker's :class:`~daskgen.worker.plugin.EnginePlugin` (or anything with its ``get_engine``,
    ``tokenizer``, ``prompt_order``, ``check_health``, ``mark_broken`` and ``came_back``); :meth:`run` returns
    each sample's trajectories in row-major order (one :class:`~daskgen.worker.rounds.RowOutcome` per row
    with a verifier)."""

    plugin: Any
    handle: EngineHandle
    agent: AgentLoop
    task: PartitionTask
    prefixes: dict[tuple[int, int], Trajectory]
    slot: PartitionSlot

    async def run(self) -> list[Any] | PlainTurns:
        """Every row at once, or row by row in ``isolate`` mode."""
        if self.task.isolate:
            return await self.isolated()
        return await self.rows(range(len(self.task.rows)))

    async def rows(self, indices: range) -> list[Any] | PlainTurns:
        """All samples of the given rows at once; a crash or hang marks the engine broken and raises."""
        task, plugin = self.task, self.plugin
        self.handle.engine = await plugin.get_engine()  # the engine may have been restarted meanwhile
        started: Awaitable[Any]
        if self.batched:
            started = self.batch(indices)
        elif task.prefix_order and task.prompts is not None:  # shared prefixes reach the engine together
            per_row = task.n_samples if task.verify is None else 1
            rows_order = self.plugin.prompt_order.order(task.prompts, indices)
            started = gather_in_prompt_order(self.calls(indices), rows_order, per_row)
        else:
            started = asyncio.gather(*self.calls(indices))
        try:
            return await asyncio.wait_for(started, task.timeout_s)  # a list, or plain turns
        except asyncio.TimeoutError:
            await self.handle.abort_all()
            await plugin.check_health()
            raise EngineError(
                f"rows {task.rows[indices[0]]}..{task.rows[indices[-1]]} did not finish within "
                f"partition_timeout_s={task.timeout_s}"
            ) from None
        except Exception as exc:
            await plugin.mark_broken(f"{type(exc).__name__}: {exc}")
            raise

    def calls(self, indices: range) -> list[Any]:
        """The coroutines generating the given rows: one per sample, or one per row in verifier rounds."""
        task = self.task
        if task.verify is None:
            seeds = sample_seeds(task.seed, [task.rows[i] for i in indices], task.n_samples)
            n = task.n_samples
            return [self.one(i, s, seeds[k * n + s]) for k, i in enumerate(indices) for s in range(n)]
        assert task.rows_meta is not None, "tasks with a verifier carry their input rows"
        decode = self.plugin.tokenizer().decode
        return [
            sample_in_rounds(task.verify, task.n_samples, task.rows_meta[i], decode, functools.partial(self.one, i))
            for i in indices
        ]

    def one(self, i: int, s: int, seed: int | None = None) -> Any:
        """Sample ``s`` of the partition's ``i``-th row, seeded per sample, counted on the slot.

        ``seed``: the sample's seed under the run's settings (:func:`~daskgen.worker.samples.seeds.sample_seeds`),
        when the caller computed it with its neighbours'."""
        task, row = self.task, self.task.rows[i]
        assert task.prompts is not None
        prefix = self.prefixes.get((row, s)) if self.prefixes else None
        params = self.params(i, s, seed)
        sample = sample_with_prefix(self.agent, self.handle, f"p{row}-s{s}", list(task.prompts[i]), params, prefix)
        if (settings := self.settings(i)) is not None:  # a run with stops or per-row settings
            sample = self.stopped(sample, settings)
        return self.slot.counted(sample)

    def params(self, i: int, s: int, seed: int | None) -> SamplingParams:
        """The sampling params of sample ``s`` of the ``i``-th row: the run's with the sample's seed, or the row's
        own settings; the row's response format and adapter."""
        task, row = self.task, self.task.rows[i]
        own = self.own_settings(i)
        if own is None and seed is not None:
            params = with_seed(task.params, seed)
        else:
            params = sample_params(task.params, own, task.eos_ids, task.seed, row, s)
        if (row_format := input_format(task, i)) is not None and row_format is not params.response_format:
            params = dataclasses.replace(params, response_format=row_format)
        if task.inputs and (adapter := task.inputs[i].get("adapter")) != params.adapter:
            params = dataclasses.replace(params, adapter=adapter)
        if task.images is not None and (row_images := task.images[i]) is not None:
            params = dataclasses.replace(params, images=row_images.images)
        return params

    def own_settings(self, i: int) -> dict[str, Any] | None:
        """The ``i``-th row's own sampling settings, or ``None`` when it has none."""
        return self.task.row_settings[i] if self.task.row_settings is not None else None

    def settings(self, i: int) -> dict[str, Any] | None:
        """The stop and sampling settings of the ``i``-th row (its own or the run's); ``None``: a run with neither."""
        own = self.own_settings(i)
        return own if own is not None else self.task.run_settings

    @property
    def batched(self) -> bool:
        """Plain samples (one engine call each, nothing stored to continue, no verifier) go as one batch."""
        return self.task.verify is None and type(self.agent) is SingleTurn and not self.prefixes

    async def batch(self, indices: range) -> PlainTurns | list[list[Trajectory]]:
        """Every sample of the given rows as one batch of requests (:meth:`EngineHandle.generate_batch`), each
        finished group counted on the slot at once: kept as the engine's plain results while they all are
        (:mod:`daskgen.worker.samples.fast_path`), else made into trajectories and cut at their stops."""
        task, n = self.task, self.task.n_samples
        assert task.prompts is not None
        seeds = sample_seeds(task.seed, [task.rows[i] for i in indices], n)
        order = self.plugin.prompt_order.order(task.prompts, indices) if task.prefix_order else range(len(indices))
        where = [(k, s) for k in order for s in range(n)]
        requests = [self.request(indices[k], s, seeds[k * n + s]) for k, s in where]
        stops = [self.settings(i) for i in indices]  # per row; all None in a run with neither stops nor settings
        decode = self.plugin.tokenizer().decode if any(settings is not None for settings in stops) else None
        plain = decode is None and task.layout.n_trajectories == 1 and not task.layout.top_logprobs
        turns = TurnBatch([r.params for r in requests], [k * n + s for k, s in where], plain)
        async with contextlib.aclosing(self.handle.generate_batch(requests)) as groups:
            async for group in groups:
                kept, made = turns.add(group)
                for j, trajectories in made:
                    if decode is not None and (settings := stops[where[j][0]]) is not None:
                        apply_stops(trajectories, settings, decode)
                self.slot.count([trajectories for _, trajectories in made], kept)
        return turns.outcome()

    def request(self, i: int, s: int, seed: int) -> GenerationRequest:
        """The request of sample ``s`` of the ``i``-th row (its prompt, its params)."""
        assert self.task.prompts is not None
        return GenerationRequest(f"p{self.task.rows[i]}-s{s}", list(self.task.prompts[i]), self.params(i, s, seed))

    async def stopped(self, sample: Awaitable[list[Trajectory]], settings: dict[str, Any]) -> list[Trajectory]:
        """``sample``'s trajectories under the stop rule (:func:`~daskgen.worker.samples.row_sampling.apply_stops`)."""
        trajectories = await sample
        apply_stops(trajectories, settings, self.plugin.tokenizer().decode)
        return trajectories

    async def isolated(self) -> list:
        """Row by row; a row whose generation raises gets error trajectories instead of failing the task.

        Only when the worker's engine runs again afterwards (restarted, or it passed its health check):
        an engine that cannot be restarted (its server stopped answering) is no row's fault, and the
        task fails with :class:`~daskgen.errors.EngineUnavailable` (the client requeues it).
        """
        task, samples = self.task, list[Any]()
        for i in range(len(task.rows)):
            try:
                samples += as_trajectories(await self.rows(range(i, i + 1)))
            except EngineUnavailable:
                raise
            except Exception as exc:
                if not await self.plugin.came_back():
                    raise EngineUnavailable(
                        f"row {task.rows[i]} failed ({type(exc).__name__}: {exc}) and the engine on this worker "
                        f"could not be restarted: {self.plugin.error}"
                    ) from exc
                message = f"{type(exc).__name__}: {exc} (failed again when retried alone)"
                failed = [[Trajectory(error=message, finish_reason=FinishReason.ERROR)] for _ in range(task.n_samples)]
                outcome = RowOutcome(failed, [np.nan] * task.n_samples, task.n_samples)
                samples += [outcome] if task.verify is not None else failed
        return samples


def _stored_region(task: PartitionTask) -> dict[str, np.ndarray] | None:
    """The partition's stored data when some pending row has stored samples to keep, else ``None``.

    Reads ``finish_reason`` (one small chunk) first; the whole region only when needed.
    """
    reasons = task.store.read_region(task.start, task.stop, ("finish_reason",))["finish_reason"]
    pending = np.asarray(task.rows) - task.start
    kept = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)
    if not np.isin(reasons[pending], kept).any():
        return None
    return task.store.read_region(task.start, task.stop, task.layout.data_arrays())


def _initial_region(task: PartitionTask) -> dict[str, np.ndarray]:
    """Existing data when some rows of the region are kept (or continued), otherwise fill values."""
    if len(task.rows) == task.stop - task.start:
        return empty_region(task.layout, task.stop - task.start)
    return task.store.read_region(task.start, task.stop, task.layout.data_arrays())


def _tool_images(task: PartitionTask, plugin: EnginePlugin) -> Any:
    """How the partition's tool loop places the images its tools return (:mod:`daskgen.worker.tool_images`)."""
    from daskgen.worker.images import preparer
    from daskgen.worker.tool_images import ToolImages

    trust = bool(plugin.engine_args.get("trust_remote_code", False))
    return ToolImages(preparer(str(plugin.model), trust), task.store.location, task.image_storage)
