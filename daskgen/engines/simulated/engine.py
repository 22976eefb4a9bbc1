"""``simulated`` engine: a timing model of a continuous-batching server.

**Not a model.**  Its tokens are pseudo-random ids and its logprobs are made up; stores it
writes are marked ``simulated``.  It exists for benchmarks of the pipeline around the engine
(Dask scheduling, storage, resume) and for capacity planning.

The model
---------
* Up to ``max_batch`` requests run at once; the rest wait in FIFO order and join at the next
  step boundary when a slot frees up.
* One asyncio step loop advances every running request by one token per step (that is what
  makes it continuous batching: requests join and leave between steps).  A step costs
  ``step_time_base_s + step_time_per_seq_s * running`` model seconds; wall time is model time
  times ``time_scale`` (``0`` = instant: the loop jumps from one finish to the next, handing the
  event loop back every :data:`INSTANT_SLICE_S` wall seconds, and thousands of requests per second go
  through).
* A request's natural length is drawn from ``length_dist`` (``"fixed"``: ``length_mean``;
  ``"uniform"``: integers 1 .. ``2 * length_mean - 1``; ``"lognormal"``: mean ``length_mean``,
  log-space standard deviation ``length_sigma``; ``length_prompt_share`` of its log-variance is
  drawn once per prompt, so samples of one prompt have similar lengths, as with real models).
  A length within ``max_new_tokens`` ends with ``eos_token_id`` (``STOP``); a longer one is cut at
  ``max_new_tokens`` (``LENGTH``).  A token in ``stop_token_ids`` also ends the request (``STOP``).
* Everything is a pure function of the prompt ids and the seed (greedy requests ignore the seed;
  sampled requests without a seed get a random one), so reruns reproduce outputs whatever the
  batching.  ``temperature``, ``top_p`` and ``top_k`` otherwise have no effect.
* Logprobs, when asked, are deterministic fake values in (-5, 0] (**simulated**, not model
  probabilities).
* It has no weights: a policy version published to a ``refresh`` run (docs/async-rl.md) loads at once when
  its folder exists and changes no output, so the refresh around the engine (the drain or the continuation,
  the versions recorded per sample) runs as with a model.
* Prefill (off by default): each prompt token the engine computes costs ``prefill_time_per_token_s``
  model seconds, paid before the next step; tokens its prefix cache holds
  (:mod:`~daskgen.engines.simulated.prefix_cache`, ``prefix_cache_tokens``) are not computed again; a
  result's ``meta["cached_tokens"]`` says how many of its prompt's the cache held (with a cache only).
  Images (the worker expands their placeholder tokens in the prompt) cost their tokens' prefill, plus
  ``image_token_time_s`` per image token for the vision encoder.

:meth:`SimulatedEngine.stats` reports steps, busy time, busy fraction and per-step batch sizes.
The options (:class:`~daskgen.engines.simulated.plan.SimulatedArgs`) and the output model
(:func:`~daskgen.engines.simulated.plan.plan_outputs`) live in :mod:`daskgen.engines.simulated.plan`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import math
import os
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import asdict
from typing import Any

from daskgen.engines.args import parse_engine_args
from daskgen.engines.base import (
    Engine,
    EngineStatus,
    GenerationRequest,
    GenerationResult,
    error_result,
    set_result,
    started,
)
from daskgen.engines.batch import Finished, FinishedGroups
from daskgen.engines.request_check import request_error
from daskgen.engines.simulated.inflight import SimRequest, SimStats
from daskgen.engines.simulated.plan import OutputPlan, SimulatedArgs, plan_outputs
from daskgen.engines.simulated.prefix_cache import PrefixCache
from daskgen.errors import RefreshError

__all__ = ["SimulatedEngine"]

#: Instant mode: the step loop runs finish after finish for up to this many wall seconds before it lets the
#: event loop run its callers (one pass of the loop per finish would cost more than the finishes).
INSTANT_SLICE_S = 0.002

# --------------------------------------------------------------------------- engine


class SimulatedEngine(Engine):
    """Timing model of a continuous-batching server (see the module docstring)."""

    name = "simulated"
    simulated = True
    supports_seed = True
    #: A timing model: a row's max_new_tokens, seed and stop ids shape its output; it has no text to stop on.
    features = frozenset({"per_row_sampling", "stop_token_ids", "top_logprobs", "refresh", "images"})
    #: A continuation is drawn from its position on (penalties have no effect on a timing model).
    continues = frozenset({"seed", "output_penalties"})

    def __init__(self, model: str = "simulated", **engine_args: Any) -> None:
        super().__init__(model, **engine_args)
        self.args = parse_engine_args(self.name, SimulatedArgs, engine_args)
        self._waiting: deque[SimRequest] = deque()
        self._finishing: list[tuple[int, int, SimRequest]] = []  # heap of (finish_step, order, sim)
        self._running = 0
        self._order = itertools.count()
        self._by_id: dict[str, list[SimRequest]] = {}
        self._step = 0
        self._boundary_wall = 0.0  # wall time of the last step boundary (time_scale > 0)
        self._wall_per_step = 0.0  # of the step(s) in progress
        self._stats = SimStats()
        self._cache = PrefixCache(self.args.prefix_cache_tokens, self.args.prefix_cache_block)
        self._prefill_s = 0.0  # of the requests admitted since the last step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def capacity(self) -> int:
        """``max_batch``: requests stepped together."""
        return self.args.max_batch

    async def load(self) -> None:
        """Nothing to load; starts the statistics clock."""
        self._stats = SimStats()

    async def unload(self) -> None:
        """Stop the step loop; requests in flight end with ``ABORT``."""
        for sims in list(self._by_id.values()):
            for sim in list(sims):
                self._drop(sim, aborted=True)
        if self._task is not None and not self._task.done():
            if self._loop is asyncio.get_running_loop():
                self._task.cancel()
            elif self._loop is not None:  # set with the task
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._task.cancel)
        self._task = None

    async def update_weights(self, path: str) -> None:
        """No weights to load: a version whose path is a folder (or a URL) "loads" at once, changing no output.

        Raises
        ------
        RefreshError
            ``path`` is neither an existing folder nor a URL (as a model's engine would fail to read it).
        """
        if "://" not in path and not os.path.isdir(path):
            raise RefreshError(
                f"engine {self.name!r}: the policy path {path!r} is not a folder; publish a checkpoint folder"
            )

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Queue the request and await its simulated completion."""
        if (refused := self._refused(request)) is not None:
            return refused
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerationResult] = loop.create_future()
        sim = self._queue(request, functools.partial(set_result, future))
        self._ensure_stepper(loop)
        self._wake()
        try:
            return await future
        except asyncio.CancelledError:
            self._drop(sim, aborted=False)
            raise

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> AsyncGenerator[Finished, None]:
        """Queue every request at once; the step loop hands their results to one :class:`FinishedGroups`
        (a subclass that changes :meth:`generate` keeps it: one :meth:`generate` per request)."""
        if type(self).generate is not SimulatedEngine.generate:
            return super().generate_batch(requests)
        return self._batch(requests)

    async def _batch(self, requests: Sequence[GenerationRequest]) -> AsyncGenerator[Finished, None]:
        groups, sims, taken = FinishedGroups(len(requests)), [], []
        for index, request in enumerate(requests):
            if (refused := self._refused(request)) is not None:
                groups.add(index, refused)
            else:
                taken.append((index, request))
        plans = plan_outputs([request for _, request in taken], self.args)  # all at once: a few array operations
        for (index, request), plan in zip(taken, plans, strict=True):
            sims.append(self._queue(request, functools.partial(groups.add, index), plan))
        self._ensure_stepper(asyncio.get_running_loop())
        self._wake()
        try:
            async for group in groups.each():
                yield group
        finally:  # the caller stopped early: drop what still runs
            for sim in sims:
                self._drop(sim, aborted=False)

    def _refused(self, request: GenerationRequest) -> GenerationResult | None:
        """The error result of a request the engine cannot take now (not running, or invalid), else ``None``."""
        problem = self.not_serving() or request_error(
            request, vocab_size=self.args.vocab_size, max_total_tokens=self.max_total_tokens
        )
        return None if problem is None else error_result(request, problem)

    def _queue(
        self, request: GenerationRequest, deliver: Callable[[GenerationResult], None], plan: OutputPlan | None = None
    ) -> SimRequest:
        """Queue ``request`` (planned when it joins the batch unless ``plan`` is given); its result goes to
        ``deliver``."""
        sim = SimRequest(request, deliver, plan)
        self._by_id.setdefault(request.request_id, []).append(sim)
        self._waiting.append(sim)
        return sim

    async def abort(self, request_id: str) -> None:
        """End the request(s) with this id at once with ``ABORT`` and the tokens produced so far."""
        for sim in list(self._by_id.get(request_id, ())):
            self._drop(sim, aborted=True)
        self._wake()

    def _drop(self, sim: SimRequest, aborted: bool) -> None:
        """Remove ``sim`` from the queue or the batch; resolve it as aborted when asked."""
        if sim.done:
            return
        if sim.start_step < 0:
            with contextlib.suppress(ValueError):
                self._waiting.remove(sim)
            done = 0
        else:
            self._running -= 1
            done = self.current_step() - sim.start_step
        self._forget(sim)
        if sim.plan is not None:  # it ran: the tokens it produced before it was dropped count as generated
            self._stats.tokens += max(0, min(done, len(sim.plan.tokens) - 1))
        if aborted:
            self._stats.aborted += 1
            sim.resolve(tokens_done=done)
        sim.done = True

    def _forget(self, sim: SimRequest) -> None:
        sims = self._by_id.get(sim.request.request_id)
        if sims is not None:
            with contextlib.suppress(ValueError):
                sims.remove(sim)
            if not sims:
                del self._by_id[sim.request.request_id]

    def current_step(self) -> int:
        """Steps completed by now, counting those elapsed inside the current (scaled) sleep."""
        if self._wall_per_step <= 0:
            return self._step
        return self._step + int((time.perf_counter() - self._boundary_wall) / self._wall_per_step)

    # ------------------------------------------------------------------ the step loop

    def _ensure_stepper(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the step loop on ``loop`` unless it already runs on a live loop."""
        task, task_loop = self._task, self._loop
        if task is not None and not task.done() and task_loop is not None and not task_loop.is_closed():  # alive
            return
        self._loop, self._wakeup = loop, asyncio.Event()
        self._task = loop.create_task(self._run(), name="daskgen-simulated-steps")

    @property
    def _step_wakeup(self) -> asyncio.Event:
        """The step loop's wake-up event (set with the loop's task)."""
        return started(self.name, self._wakeup)

    def _wake(self) -> None:
        if self._wakeup is None or self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._wakeup.set()
        else:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._wakeup.set)

    async def _run(self) -> None:
        self._boundary_wall = yield_at = time.perf_counter()
        while self.status is EngineStatus.RUNNING:
            self._admit()
            if self._running == 0:
                self._step_wakeup.clear()
                await self._step_wakeup.wait()
                self._boundary_wall = time.perf_counter()
                continue
            if not await self._advance() and time.perf_counter() >= yield_at:
                await asyncio.sleep(0)  # instant mode: let callers queue more requests and take their results
                yield_at = time.perf_counter() + INSTANT_SLICE_S

    def _admit(self) -> None:
        joining = []
        while self._waiting and self._running < self.args.max_batch:
            sim = self._waiting.popleft()
            sim.start_step = self._step
            self._running += 1
            joining.append(sim)
        unplanned = [sim for sim in joining if sim.plan is None]  # planned together, with the others joining now
        for sim, plan in zip(unplanned, plan_outputs([sim.request for sim in unplanned], self.args), strict=True):
            sim.plan = plan
        for sim in joining:
            heapq.heappush(self._finishing, (sim.finish_step, next(self._order), sim))
            self._prefill(sim)

    def _prefill(self, sim: SimRequest) -> None:
        """Count a joining request's prompt: cached tokens (in its result's ``meta["cached_tokens"]`` when the
        engine has a prefix cache), and the prefill time of the others."""
        prompt = sim.request.prompt_ids
        cached = self._cache.admit(prompt)
        if self._cache.enabled:
            sim.meta["cached_tokens"] = cached
        self._stats.prompt_tokens += len(prompt)
        self._stats.cached_tokens += cached
        self._prefill_s += (len(prompt) - cached) * self.args.prefill_time_per_token_s
        self._prefill_s += sum(image.span[1] for image in sim.request.params.images) * self.args.image_token_time_s

    def _next_finish(self) -> int:
        while self._finishing[0][2].done:
            heapq.heappop(self._finishing)
        return self._finishing[0][0]

    async def _advance(self) -> bool:
        """Run steps with the current batch until the next finish (or a wake-up); account them.

        Returns whether it slept (``False`` in instant mode).
        """
        if self._prefill_s > 0:  # the joining requests' prefill delays the next step
            prefill, self._prefill_s = self._prefill_s, 0.0
            self._stats.busy_s += prefill
            self._stats.prefill_s += prefill
            if self.args.time_scale > 0:
                await asyncio.sleep(prefill * self.args.time_scale)
                self._boundary_wall = time.perf_counter()
        batch = self._running
        step_s = self.args.step_time_base_s + self.args.step_time_per_seq_s * batch
        steps = self._next_finish() - self._step
        slept = self.args.time_scale > 0 and step_s > 0
        if slept:
            steps = await self.wait_steps(steps, step_s * self.args.time_scale)
        self._step += steps
        stats = self._stats
        stats.steps += steps
        stats.busy_s += steps * step_s
        stats.batch_steps[batch] += steps
        self._finish_due()
        return slept

    async def wait_steps(self, steps: int, wall_per_step: float) -> int:
        """Sleep through up to ``steps`` steps; on a wake-up stop at the end of the step in progress."""
        self._wall_per_step = wall_per_step
        self._step_wakeup.clear()
        deadline = self._boundary_wall + steps * wall_per_step
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._step_wakeup.wait(), timeout=max(0.0, deadline - time.perf_counter()))
            elapsed = time.perf_counter() - self._boundary_wall
            steps = min(steps, max(1, math.ceil(elapsed / wall_per_step)))
            await asyncio.sleep(max(0.0, self._boundary_wall + steps * wall_per_step - time.perf_counter()))
        self._boundary_wall += steps * wall_per_step
        self._wall_per_step = 0.0
        return steps

    def _finish_due(self) -> None:
        while self._finishing and self._finishing[0][0] <= self._step:
            _, _, sim = heapq.heappop(self._finishing)
            if sim.done:
                continue
            self._running -= 1
            self._forget(sim)
            self._stats.finished += 1
            self._stats.tokens += sim.finish_step - sim.start_step
            sim.resolve()

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, Any]:
        """Steps, busy time and per-step batch sizes since start (or :meth:`reset_stats`).

        ``busy_s`` and ``elapsed_s`` are model seconds (wall seconds / ``time_scale``);
        ``busy_fraction = busy_s / elapsed_s`` is ``None`` when ``time_scale == 0``.
        ``batch_size_hist`` maps a batch size to the number of steps run at that size; ``prompt_tokens``,
        ``cached_prompt_tokens`` and ``prefill_tokens`` count the prompts admitted (computed = prompt - cached).
        """
        s = self._stats
        elapsed = None
        if self.args.time_scale > 0:
            elapsed = (time.perf_counter() - s.since) / self.args.time_scale
        weighted = sum(size * n for size, n in s.batch_steps.items())
        return {
            "simulated": True,
            "steps": s.steps,
            "busy_s": s.busy_s,
            "elapsed_s": elapsed,
            "busy_fraction": None if not elapsed else min(1.0, s.busy_s / elapsed),
            "mean_batch_size": weighted / s.steps if s.steps else 0.0,
            "batch_size_hist": dict(sorted(s.batch_steps.items())),
            "requests_finished": s.finished,
            "requests_aborted": s.aborted,
            "tokens_generated": s.tokens,
            "prompt_tokens": s.prompt_tokens,
            "cached_prompt_tokens": s.cached_tokens,
            "prefill_tokens": s.prompt_tokens - s.cached_tokens,
            "prefill_s": s.prefill_s,
            "running": self._running,
            "waiting": len(self._waiting),
        }

    def reset_stats(self) -> None:
        """Start a new statistics window (e.g. after a benchmark's warm-up)."""
        self._stats = SimStats()

    def health_token_id(self) -> int:
        """Token 0 (valid for any vocabulary)."""
        return 0

    @property
    def vocab_size(self) -> int:
        """``engine_args['vocab_size']``: generated ids are drawn below it."""
        return self.args.vocab_size

    @property
    def max_total_tokens(self) -> int | None:
        """``engine_args['max_model_len']`` (``None`` when 0: no limit)."""
        return self.args.max_model_len or None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """``engine_args['eos_token_id']``, which ends every naturally finished output."""
        return frozenset({self.args.eos_token_id})

    def describe(self) -> dict[str, Any]:
        """Engine name, ``simulated: True``, the model label and the timing model's options."""
        info = super().describe()
        info["model"] = self.model
        info["engine_args"] = asdict(self.args)
        return info
