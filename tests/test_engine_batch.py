"""Batches of requests: ``Engine.generate_batch`` (the default and the simulated engine's own) and
``EngineHandle.generate_batch``, the path a partition's plain samples take on a worker."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from daskgen.agents import EngineHandle
from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult, SamplingParams
from daskgen.engines.batch import FinishedGroups, each_as_finished
from daskgen.engines.simulated import SimulatedEngine
from daskgen.errors import EngineError
from daskgen.testing.harness import batch_results

pytestmark = pytest.mark.timeout(60)


def requests(n: int, max_new_tokens: int = 24, **params) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"r{i}", [3, 4, 5, i % 50], SamplingParams(max_new_tokens=max_new_tokens, seed=i, **params))
        for i in range(n)
    ]


async def started(**args) -> SimulatedEngine:
    engine = SimulatedEngine("sim", **{"time_scale": 0, "length_dist": "uniform", "length_mean": 12, **args})
    await engine.start()
    return engine


async def stepped(engine: SimulatedEngine, steps: int = 2) -> None:
    """Until the engine's step loop ran ``steps`` steps (the requests admitted have tokens)."""
    while engine.current_step() < steps:
        await asyncio.sleep(0.01)


async def one_by_one(engine, batch: list[GenerationRequest]) -> list[GenerationResult]:
    return list(await asyncio.gather(*(engine.generate(r) for r in batch)))


def test_a_simulated_batch_gives_each_request_once_equal_to_its_own_generate() -> None:
    async def main():
        engine = await started(max_batch=8)
        batch = [*requests(40, logprobs=True), GenerationRequest("bad", [], SamplingParams(max_new_tokens=4))]
        groups = []
        async for group in engine.generate_batch(batch):
            groups.append(len(group))
        in_batch, alone = await batch_results(engine, batch), await one_by_one(engine, batch)
        await engine.shutdown()
        return groups, in_batch, alone, engine.stats()

    groups, in_batch, alone, stats = asyncio.run(main())
    assert sum(groups) == 41 and len(groups) > 1, groups  # a batch of 8 slots finishes in several groups
    for got, want in zip(in_batch, alone, strict=True):
        assert (got.request_id, got.output_ids, got.finish_reason, got.logprobs, got.error) == (
            want.request_id,
            want.output_ids,
            want.finish_reason,
            want.logprobs,
            want.error,
        )
    assert in_batch[-1].finish_reason == FinishReason.ERROR and "empty" in (in_batch[-1].error or "").lower()
    assert stats["running"] == 0 and stats["waiting"] == 0


def test_an_abort_ends_a_running_batch_request_and_a_caller_that_stops_early_leaves_nothing_running() -> None:
    async def main():
        engine = await started(time_scale=1.0, step_time_base_s=0.01, length_dist="fixed", length_mean=400)
        batch = requests(6, max_new_tokens=400)
        seen: dict[int, GenerationResult] = {}
        groups = engine.generate_batch(batch)
        first = asyncio.ensure_future(groups.__anext__())
        await stepped(engine)
        await engine.abort("r2")
        for index, result in await first:
            seen[index] = result
        await groups.aclose()  # the other five still run: closing drops them
        await asyncio.sleep(0.05)
        stats = engine.stats()
        await engine.shutdown()
        return seen, stats

    seen, stats = asyncio.run(main())
    assert list(seen) == [2] and seen[2].finish_reason == FinishReason.ABORT
    assert 0 < len(seen[2].output_ids) < 400
    assert stats["running"] == 0 and stats["waiting"] == 0, stats


def test_a_subclass_that_changes_generate_keeps_it_for_batches() -> None:
    class Counting(SimulatedEngine):
        calls = 0

        async def generate(self, request):
            Counting.calls += 1
            return await super().generate(request)

    async def main():
        engine = Counting("sim", time_scale=0)
        await engine.start()
        results = await batch_results(engine, requests(5))
        await engine.shutdown()
        return results

    assert len(asyncio.run(main())) == 5 and Counting.calls == 5


def test_each_as_finished_raises_the_first_failure_and_cancels_the_rest() -> None:
    cancelled = []

    async def call(i: int) -> int:
        if i == 3:
            await asyncio.sleep(0.05)
            raise RuntimeError("request 3 broke the engine")
        try:
            await asyncio.sleep(0 if i < 3 else 30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    async def main():
        got = []
        with pytest.raises(RuntimeError, match="request 3"):
            async for group in each_as_finished(call, range(6)):
                got += group
        await asyncio.sleep(0)
        return got

    got = asyncio.run(main())
    assert sorted(i for i, _ in got) == [0, 1, 2] and sorted(cancelled) == [4, 5]


def test_finished_groups_take_results_added_from_another_thread() -> None:
    async def main():
        groups = FinishedGroups(3)
        threads = [threading.Thread(target=groups.add, args=(i, f"result {i}")) for i in range(3)]
        for thread in threads:
            thread.start()
        got = [pair async for group in groups.each() for pair in group]
        for thread in threads:
            thread.join()
        return got

    assert sorted(asyncio.run(main())) == [(0, "result 0"), (1, "result 1"), (2, "result 2")]


async def handle_batch(handle: EngineHandle, batch) -> dict[int, GenerationResult]:
    out = {}
    async with contextlib.aclosing(handle.generate_batch(batch)) as groups:
        async for group in groups:
            out.update(group)
    return out


def test_a_handle_batch_tracks_requests_in_flight_and_abort_all_ends_them() -> None:
    async def main():
        engine = await started(time_scale=1.0, step_time_base_s=0.01, length_dist="fixed", length_mean=400)
        handle = EngineHandle(engine)
        batch = requests(4, max_new_tokens=400)
        task = asyncio.ensure_future(handle_batch(handle, batch))
        await stepped(engine)
        in_flight = set(handle.in_flight)
        await handle.abort_all()
        out = await task
        later = await handle_batch(handle, requests(2))  # a stopped handle sends nothing more
        await engine.shutdown()
        return in_flight, handle.in_flight, out, later

    in_flight, after, out, later = asyncio.run(main())
    assert in_flight == {"r0", "r1", "r2", "r3"} and after == set()
    assert all(r.finish_reason == FinishReason.ABORT and 0 < len(r.output_ids) < 400 for r in out.values()), out
    assert all(r.finish_reason == FinishReason.ABORT and not r.output_ids for r in later.values()) and len(later) == 2


def test_a_handle_batch_aborts_requests_of_a_replaced_engine_and_raises_when_the_backend_died() -> None:
    class Broken(SimulatedEngine):
        death: str | None = None

        def died(self):
            return self.death

    async def main():
        engine = Broken("sim", time_scale=0)
        await engine.start()
        await engine.shutdown()  # every request now comes back as an error
        replaced = await handle_batch(EngineHandle(engine, live=lambda: None), requests(3))
        engine.death = "EngineCore process exited with -9"
        with pytest.raises(EngineError, match="died while request 'r0' ran: EngineCore process exited"):
            await handle_batch(EngineHandle(engine, live=lambda: engine), requests(3))
        return replaced

    replaced = asyncio.run(main())
    assert sorted(replaced) == [0, 1, 2] and all(r.finish_reason == FinishReason.ABORT for r in replaced.values())
