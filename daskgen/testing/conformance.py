"""The engine conformance suite: the behaviour every daskgen engine must show.

Use it from pytest by subclassing :class:`EngineConformance` in a ``test_*.py`` module::

    from daskgen.testing.conformance import EngineConformance

    class TestMyEngine(EngineConformance):
        engine_class = MyEngine
        model = "/path/to/model"
        engine_args = {"device": "cpu"}

pytest collects the ``test_*`` methods.  One engine is started per class (``setup_class``) on
a background event loop that lives as long as the class, as an engine lives on a Dask
worker's loop, and is shut down in ``teardown_class`` (or by the checks of :mod:`daskgen.testing.lifecycle`, which run
last).  Every engine call runs under a timeout,
so a hung engine fails instead of hanging.  Tunables (class attributes) let an engine adapt
prompts, lengths and timeouts; see :class:`EngineConformance`.

Without pytest, :func:`run_conformance` runs the same checks and returns a report.  This
module imports neither pytest nor torch.  A check that cannot apply to an engine (e.g. seeds on
an engine without seed support) is declared in the subclass's ``not_applicable`` mapping with the
reason: the project's ``tests/conftest.py`` deselects it and lists the reason, and
:func:`run_conformance` reports it as ``"not applicable: <reason>"``.  A check that meets an engine
it does not apply to *without* such a declaration raises :class:`unittest.SkipTest` (pytest: skipped),
which the CI lanes count as a failure.  Feature checks (:mod:`daskgen.testing.features`, ``.effects``) of features
the engine does not declare are not applicable by themselves; the top-k, continuation and context-limit checks
(:mod:`daskgen.testing.top_logprobs`, ``.continuation``, ``.long_context``) are mixed in too."""

from __future__ import annotations

import asyncio
import math
import unittest
from collections.abc import Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

from daskgen.engines.base import Engine, EngineStatus, FinishReason, GenerationRequest, GenerationResult, SamplingParams
from daskgen.testing import harness
from daskgen.testing.continuation import ContinuationChecks
from daskgen.testing.effects import EffectChecks
from daskgen.testing.features import FeatureChecks
from daskgen.testing.harness import EventLoopThread, batch_results, check_result, gather, longest_running, run_checks
from daskgen.testing.lifecycle import LifecycleChecks
from daskgen.testing.long_context import LongContextChecks
from daskgen.testing.top_logprobs import TopLogprobsCheck

__all__ = ["EngineConformance", "EventLoopThread", "longest_running", "run_conformance"]

_T = TypeVar("_T")


class EngineConformance(
    FeatureChecks, EffectChecks, TopLogprobsCheck, ContinuationChecks, LongContextChecks, LifecycleChecks
):
    """Base class of the conformance tests; subclasses set the engine to test.

    Required class attributes: ``engine_class``, ``model`` (and ``engine_args``).  Tunables:

    ``timeout_s``
        Limit for one engine call (generation of a batch of requests counts as one).
    ``start_timeout_s``
        Limit for ``start()`` plus the first health check.
    ``prompt_vocab``
        Prompt token ids are drawn from ``[3, prompt_vocab)``.
    ``probe_max_new_tokens``, ``probe_prompts``
        Greedy length used to find prompts that do not stop early (abort and ordering checks),
        and how many prompts to try.
    ``long_max_new_tokens``
        Cap of the "long" requests that get aborted; must fit the engine's context.
    ``abort_delay_s``, ``abort_timeout_s``
        How long the long requests run before ``abort``, and how long to wait for them afterwards
        (a hang guard; the check is that they return ``ABORT`` before their cap).
    ``concurrency``
        Requests in the many-concurrent-requests check.
    ``arrival_attempts``
        Tries of the arrival-order check (one short-first order passes it).
    ``not_applicable``
        ``{check name: reason}`` for checks that do not apply to this engine (deselected, reported).
    ``runs_last``
        Checks that shut the shared engine down; they run after the others.
    """

    engine_class: ClassVar[type[Engine]]
    model: ClassVar[str] = ""
    engine_args: ClassVar[dict[str, Any]] = {}

    timeout_s: ClassVar[float] = 120.0
    start_timeout_s: ClassVar[float] = 600.0
    prompt_vocab: ClassVar[int] = 1000
    probe_max_new_tokens: ClassVar[int] = 128
    probe_prompts: ClassVar[int] = 16
    long_max_new_tokens: ClassVar[int] = 1024
    abort_delay_s: ClassVar[float] = 0.05
    abort_timeout_s: ClassVar[float] = 10.0
    concurrency: ClassVar[int] = 32
    arrival_attempts: ClassVar[int] = 3
    not_applicable: ClassVar[dict[str, str]] = {}

    runner: ClassVar[EventLoopThread]
    engine: ClassVar[Engine]

    # ------------------------------------------------------------------ fixtures (xunit style)

    @classmethod
    def make_engine(cls, **extra_args: Any) -> Engine:
        """A new, unstarted engine (``engine_args`` plus ``extra_args``)."""
        return cls.engine_class(cls.model, **{**cls.engine_args, **extra_args})

    @classmethod
    def setup_class(cls) -> None:
        """Start the shared engine on a background loop."""
        cls.runner = EventLoopThread()
        cls.engine = cls.make_engine()
        try:
            cls.runner.run(cls._start_and_check(cls.engine), cls.start_timeout_s)
        except BaseException:
            cls.teardown_class()
            raise

    def setup_method(self, method: Any = None) -> None:
        """Before each check: a new shared engine when an earlier check (one of ``runs_last``) shut it down."""
        cls = type(self)
        if cls.engine.status is EngineStatus.CLOSED:
            cls.engine = cls.make_engine()
            self.run(cls._start_and_check(cls.engine), cls.start_timeout_s)

    @staticmethod
    async def _start_and_check(engine: Engine) -> None:
        await engine.start()
        await engine.health()

    @classmethod
    def teardown_class(cls) -> None:
        """Shut the shared engine down and stop the loop."""
        runner = getattr(cls, "runner", None)
        engine = getattr(cls, "engine", None)
        if runner is None:
            return
        try:
            if engine is not None:
                runner.run(engine.shutdown(), cls.timeout_s)
        finally:
            runner.close()

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run ``coro`` on the engine's loop with a timeout."""
        return self.runner.run(coro, self.timeout_s if timeout is None else timeout)

    def prompt(self, index: int, length: int = 8) -> list[int]:
        """A deterministic prompt, different for each ``index``."""
        span = self.prompt_vocab - 3
        return [3 + (index * 7919 + j * 104729 + j * j * 31) % span for j in range(length)]

    def request(self, rid: str, index: int, **params: Any) -> GenerationRequest:
        """A request for prompt ``index`` with greedy defaults overridden by ``params``."""
        base = {"max_new_tokens": 16, "temperature": 0.0, **params}
        return GenerationRequest(rid, self.prompt(index), SamplingParams(**base))

    async def generate_all(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Submit ``requests`` in order (each after the previous was submitted) and gather results."""
        tasks = []
        for request in requests:
            tasks.append(asyncio.ensure_future(self.engine.generate(request)))
            await asyncio.sleep(0)
        return list(await asyncio.gather(*tasks))

    async def one(self, request: GenerationRequest) -> GenerationResult:
        """Generate ``request`` alone and check the result is well formed."""
        result = await self.engine.generate(request)
        check_result(request, result)
        return result

    async def _long_candidates(self, count: int) -> list[tuple[GenerationRequest, list[int]]]:
        """Greedy prompts that do not stop within ``probe_max_new_tokens``, with their outputs."""
        probes = [
            self.request(f"probe-{i}", 1000 + i, max_new_tokens=self.probe_max_new_tokens)
            for i in range(max(self.probe_prompts, count))
        ]
        found = []
        for request, result in zip(probes, await self.generate_all(probes), strict=True):
            check_result(request, result)
            if result.finish_reason == FinishReason.LENGTH:
                found.append((request, result.output_ids))
        if not found:
            raise AssertionError(
                f"no greedy prompt ran for {self.probe_max_new_tokens} tokens without stopping; "
                "lower probe_max_new_tokens or override prompt()"
            )
        return found[:count]

    async def _longest_request(self, request_id: str, tries: int = 4) -> GenerationRequest:
        """A greedy request capped at ``long_max_new_tokens`` that runs as long as any of ``tries`` candidates.

        A candidate only promises ``probe_max_new_tokens``; one that stops soon after could finish before a
        short request sent just after it is back, so up to ``tries`` of them run to the cap once (greedy: the
        same prompt runs as long again) and the longest is kept."""
        runs = [
            GenerationRequest(
                f"{request_id}-probe-{i}",
                request.prompt_ids,
                SamplingParams(max_new_tokens=self.long_max_new_tokens, temperature=0.0),
            )
            for i, (request, _) in enumerate(await self._long_candidates(tries))
        ]
        longest = await longest_running(self.engine, runs)
        return GenerationRequest(request_id, longest.prompt_ids, longest.params)

    # ------------------------------------------------------------------ the checks

    def test_start_and_health(self) -> None:
        """start() (in setup) worked; health() really generates, also twice at once."""
        self.run(self.engine.health())
        self.run(gather(self.engine.health(), self.engine.health()))

    def test_capacity(self) -> None:
        """capacity (batch slots, sizes ``window: auto``) is unknown (None) or a positive int."""
        capacity = self.engine.capacity
        assert capacity is None or (isinstance(capacity, int) and capacity >= 1), capacity

    def test_describe(self) -> None:
        """describe() names the engine and whether it is simulated, in JSON-safe builtin types only."""
        harness.check_description(self.engine)

    def test_length_cap(self) -> None:
        """Outputs never exceed max_new_tokens; hitting the cap without a stop token is LENGTH."""
        cap = 4
        requests = [self.request(f"cap-g{i}", i, max_new_tokens=cap) for i in range(8)]
        requests += [self.request(f"cap-s{i}", i, max_new_tokens=cap, temperature=1.0, seed=i) for i in range(8)]
        results = self.run(self.generate_all(requests))
        for request, result in zip(requests, results, strict=True):
            check_result(request, result)
            assert result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), result
            if result.finish_reason == FinishReason.LENGTH:
                assert len(result.output_ids) == cap, result
        assert any(r.finish_reason == FinishReason.LENGTH for r in results), "no request reached the length cap"

    def test_stop_token(self) -> None:
        """A stop token ends the output (kept as its last token) with STOP."""
        request = self.request("stop-probe", 3, max_new_tokens=16)
        base = self.run(self.one(request))
        assert base.output_ids, base
        token = base.output_ids[min(2, len(base.output_ids) - 1)]
        expected = base.output_ids[: base.output_ids.index(token) + 1]
        stopped = self.run(self.one(self.request("stop", 3, max_new_tokens=16, stop_token_ids=(token,))))
        assert stopped.output_ids == expected, (stopped.output_ids, expected)
        assert stopped.finish_reason == FinishReason.STOP, stopped

    def test_logprobs(self) -> None:
        """One finite logprob <= 0 per output token when asked; None when not; same tokens either way."""
        variants = [{"temperature": 0.0}]
        if self.engine.supports_seed:
            variants.append({"temperature": 1.0, "seed": 7})
        for params in variants:
            plain = self.run(self.one(self.request("lp-off", 5, max_new_tokens=12, **params)))
            with_lp = self.run(self.one(self.request("lp-on", 5, max_new_tokens=12, logprobs=True, **params)))
            assert plain.logprobs is None, plain
            assert with_lp.logprobs is not None and len(with_lp.logprobs) == len(with_lp.output_ids), with_lp
            assert all(math.isfinite(x) and x <= 1e-6 for x in with_lp.logprobs), with_lp.logprobs
            assert with_lp.output_ids == plain.output_ids, (params, with_lp.output_ids, plain.output_ids)

    def test_greedy_deterministic(self) -> None:
        """Greedy output is the same twice alone and inside a batch of other requests."""
        target = self.request("greedy", 11, max_new_tokens=20)
        first = self.run(self.one(target)).output_ids
        assert self.run(self.one(target)).output_ids == first
        others = [
            self.request(f"greedy-other-{i}", 20 + i, max_new_tokens=24, temperature=1.0, seed=i) for i in range(6)
        ]
        results = self.run(self.generate_all([*others, target]))
        assert results[-1].output_ids == first, (results[-1].output_ids, first)

    def test_seeded_reproducible(self) -> None:
        """A seeded sample is the same alone, in a batch, and in another submission order."""
        if not self.engine.supports_seed:
            raise unittest.SkipTest(f"{self.engine.name} does not support seeds")
        for extra in ({}, {"top_k": 20, "top_p": 0.9, "temperature": 0.8}):
            params = {"temperature": 1.0, "seed": 1234, "max_new_tokens": 24, **extra}
            target = self.request("seeded", 12, **params)
            alone = self.run(self.one(target)).output_ids
            others = [
                self.request(f"seeded-other-{i}", 30 + i, max_new_tokens=16 + 4 * i, temperature=1.0, seed=100 + i)
                for i in range(6)
            ]
            batched = self.run(self.generate_all([*others, target]))[-1].output_ids
            reordered = self.run(self.generate_all([target, *reversed(others)]))[0].output_ids
            assert batched == alone, (extra, batched, alone)
            assert reordered == alone, (extra, reordered, alone)
        seeds = [self.request(f"seed-{s}", 12, max_new_tokens=8, temperature=1.0, seed=s) for s in range(8)]
        outputs = {tuple(r.output_ids) for r in self.run(self.generate_all(seeds))}
        assert len(outputs) > 1, "eight different seeds gave identical samples"

    def test_many_concurrent_requests(self) -> None:
        """Many concurrent requests all complete, each with its own request id, cap and output, sent one by one
        and as one batch (``generate_batch``).

        The greedy ones with the longest caps are generated again alone: each concurrent result must be
        the output of its own request (a result handed to the wrong request would differ).
        """
        requests = [
            self.request(
                f"many-{i}", 40 + i, max_new_tokens=1 + i % 24, **({"temperature": 1.0, "seed": i} if i % 2 else {})
            )
            for i in range(self.concurrency)
        ]
        results = self.run(self.generate_all(requests))
        batched = self.run(batch_results(self.engine, requests))
        for request, result in zip(requests * 2, results + batched, strict=True):
            check_result(request, result)
            assert result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), result
        greedy = [(q, r, b) for q, r, b in zip(requests, results, batched, strict=True) if q.params.temperature == 0.0]
        checked = sorted(greedy, key=lambda item: -item[0].params.max_new_tokens)[:6]
        for request, result, in_batch in checked:
            alone = self.run(self.one(request)).output_ids
            assert result.output_ids == alone == in_batch.output_ids, (request.request_id, result, in_batch, alone)
        assert len({tuple(r.output_ids) for _, r, _ in checked}) > 1, "the checked outputs are all equal: no evidence"

    def test_results_arrive_as_each_finishes(self) -> None:
        """A short request submitted after a long one comes back first (no static batch barrier).

        The long request runs as long as the longest greedy candidate (``_longest_request``); once the
        short one is back it is aborted.  One overtaking proves there is no barrier (behind one the short
        request never comes back first), so the order is tried up to ``arrival_attempts`` times."""
        long_request = self.run(self._longest_request("long-arrival"))
        orders = []
        for attempt in range(self.arrival_attempts):
            this_long = GenerationRequest(f"long-{attempt}", long_request.prompt_ids, long_request.params)
            order, long_result, short_result = self.run(self._short_after_long(this_long))
            check_result(this_long, long_result)
            assert len(short_result.output_ids) == 1, short_result
            orders.append(order)
            if order[0] == "short":
                return
        raise AssertionError(
            f"a 1-token request sent after a long one never came back first in "
            f"{self.arrival_attempts} tries (orders {orders}): a static batch barrier?"
        )

    async def _short_after_long(
        self, long_request: GenerationRequest
    ) -> tuple[list[str], GenerationResult, GenerationResult]:
        """Send ``long_request``, then a 1-token request; abort the long one once the short is back.

        Returns the request ids in the order they came back and both results."""
        order: list[str] = []

        async def timed(request: GenerationRequest) -> GenerationResult:
            result = await self.engine.generate(request)
            order.append(request.request_id)
            return result

        pending = asyncio.ensure_future(timed(long_request))
        await asyncio.sleep(0)
        short = await timed(self.request("short", 2, max_new_tokens=1))
        await self.engine.abort(long_request.request_id)
        return order, await asyncio.wait_for(pending, self.abort_timeout_s), short

    def test_abort(self) -> None:
        """abort() ends long requests before their cap with ABORT and a prefix of their output."""
        candidates = self.run(self._long_candidates(2))
        longs = [
            GenerationRequest(
                f"long-{i}",
                request.prompt_ids,
                SamplingParams(max_new_tokens=self.long_max_new_tokens, temperature=0.0),
            )
            for i, (request, _) in enumerate(candidates)
        ]
        results = self.run(self._abort_after_delay(longs))
        for request, (_, probe), result in zip(longs, candidates, results, strict=True):
            check_result(request, result)
            assert result.finish_reason == FinishReason.ABORT, result
            n = len(result.output_ids)
            shared = min(n, len(probe))  # the abort may land after the probe's own cap: compare where both ran
            assert n < self.long_max_new_tokens, (n, self.long_max_new_tokens)
            assert result.output_ids[:shared] == probe[:shared], (result.output_ids, probe)
        self.run(self.engine.abort("no-such-request"))
        assert self.run(self.one(self.request("after-abort", 4, max_new_tokens=4))).error is None

    async def _abort_after_delay(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        tasks = [asyncio.ensure_future(self.engine.generate(r)) for r in requests]
        await asyncio.sleep(self.abort_delay_s)
        for request in requests:
            await self.engine.abort(request.request_id)
        # a hang guard, not a timing check: the check is that each returns ABORT with a prefix
        return list(await asyncio.wait_for(asyncio.gather(*tasks), self.abort_timeout_s))

    def test_request_errors_are_returned(self) -> None:
        """Bad requests come back with ``error`` set (not raised) and the engine keeps working."""
        bad = [
            GenerationRequest("empty", [], SamplingParams(max_new_tokens=4)),
            GenerationRequest("negative-id", [5, -1], SamplingParams(max_new_tokens=4)),
            GenerationRequest("huge-id", [5, 10**9], SamplingParams(max_new_tokens=4)),
            GenerationRequest("zero-tokens", [5, 6], SamplingParams(max_new_tokens=0)),
            GenerationRequest("bad-temperature", [5, 6], SamplingParams(max_new_tokens=4, temperature=-1.0)),
        ]
        for request in bad:
            result = self.run(self.engine.generate(request))
            assert result.request_id == request.request_id, result
            assert isinstance(result.error, str) and result.error, (request, result)
            assert result.finish_reason == FinishReason.ERROR, result
        self.run(self.engine.health())
        assert self.run(self.one(self.request("after-errors", 6, max_new_tokens=4))).error is None


def run_conformance(
    engine_class: type[Engine], model: str, engine_args: dict[str, Any] | None = None, **tunables: Any
) -> dict[str, str]:
    """Run every check outside pytest.

    Returns ``{check: "passed" | "not applicable: ..." | "skipped: ..." | "failed: ..."}``.
    """
    suite = type(
        "Conformance",
        (EngineConformance,),
        {"engine_class": engine_class, "model": model, "engine_args": dict(engine_args or {}), **tunables},
    )
    return run_checks(suite)
