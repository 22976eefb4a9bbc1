"""The simulated engine: conformance suite plus its timing model."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from daskgen.engines import create_engine
from daskgen.engines.base import FinishReason, GenerationRequest, SamplingParams
from daskgen.engines.simulated import SimulatedEngine
from daskgen.engines.simulated.plan import plan_output, plan_outputs
from daskgen.errors import ConfigError
from daskgen.testing import harness
from daskgen.testing.conformance import EngineConformance


class TestSimulatedConformance(EngineConformance):
    """The shared suite, with a real-time step loop so that aborts catch requests in flight."""

    engine_class = SimulatedEngine
    model = "simulated-test"
    not_applicable = {
        "test_feature_min_p": "a timing model: of the sampling settings only max_new_tokens, seed and stop ids "
        "shape its output (temperature, top-k, top-p and min-p have no effect)",
        "test_feature_penalties": "a timing model: penalties have no effect on its made-up tokens",
        "test_top_logprobs_equal_a_forward_pass": "a timing model: no weights to run a forward pass of, its top-k "
        "entries are made up by its own rule (checked in tests/test_top_logprobs.py)",
    }
    engine_args = {
        "time_scale": 1.0,
        "step_time_base_s": 0.002,
        "step_time_per_seq_s": 0.0,
        "length_dist": "lognormal",
        "length_mean": 300,
        "length_sigma": 0.8,
        "max_batch": 64,
        "max_model_len": 2048,
    }
    timeout_s = 60.0


class _OneAtATime(EngineConformance):
    """Test double of an engine with a static batch barrier: the simulated engine running one request at
    a time (``max_batch: 1``), so a short request waits for the long ones sent before it.  Not collected
    (no ``Test`` prefix): used by the test below to show that the arrival-order check catches it."""

    engine_class = SimulatedEngine
    model = "simulated-one-at-a-time"
    engine_args = {
        "time_scale": 1.0,
        "step_time_base_s": 0.0005,
        "step_time_per_seq_s": 0.0,
        "length_dist": "lognormal",
        "length_mean": 60,
        "length_sigma": 0.5,
        "max_batch": 1,
    }
    probe_max_new_tokens = 32  # lengths here are around 60: some probe must run 32 tokens
    long_max_new_tokens = 400
    timeout_s = 60.0


@pytest.mark.timeout(120)
def test_the_arrival_check_fails_an_engine_with_a_batch_barrier() -> None:
    _OneAtATime.setup_class()
    try:
        with pytest.raises(AssertionError, match="never came back first in 3 tries"):
            _OneAtATime().test_results_arrive_as_each_finishes()
    finally:
        _OneAtATime.teardown_class()


@pytest.mark.timeout(300)
def test_run_conformance_runs_every_check_outside_pytest_on_one_engine(monkeypatch) -> None:
    """``run_conformance`` reports every check; the shared engine starts once, as the shutdown check runs last."""
    from daskgen.testing.conformance import run_conformance

    starts = []
    start = SimulatedEngine.start

    async def counted_start(self):
        await start(self)
        starts.append(self)  # started (a start refused after shutdown, or for an unknown option, is not counted)

    monkeypatch.setattr(SimulatedEngine, "start", counted_start)
    tunables = {k: getattr(TestSimulatedConformance, k) for k in ("not_applicable", "timeout_s")}
    report = run_conformance(SimulatedEngine, "sim", TestSimulatedConformance.engine_args, **tunables)
    checks = sorted(n for n in dir(TestSimulatedConformance) if n.startswith("test_"))
    assert sorted(report) == checks and list(report)[-1] == "test_shutdown_is_idempotent", list(report)
    failed = {name: outcome for name, outcome in report.items() if outcome.startswith(("failed", "skipped"))}
    assert not failed, failed
    assert sum(outcome.startswith("not applicable") for outcome in report.values()) >= 3, report
    assert len(starts) == 1, starts


class _VersionString(str):
    """A ``str`` subclass, as torch's ``TorchVersion`` is: unpickling it imports the module defining it."""


def test_the_description_check_names_a_value_of_a_str_subclass() -> None:
    engine = SimulatedEngine("sim", time_scale=0)
    describe = engine.describe
    engine.describe = lambda: {**describe(), "extra": [1, {"torch_version": _VersionString("2.13.0")}]}
    with pytest.raises(AssertionError, match=r"info\['extra'\]\[1\]\['torch_version'\]: .*_VersionString"):
        harness.check_description(engine)
    engine.describe = describe
    harness.check_description(engine)


def run(coro, timeout: float = 60.0):
    """Run ``coro`` in a fresh event loop with a timeout."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def req(rid: str, prompt: list[int], **params) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(**params))


async def _started(**args) -> SimulatedEngine:
    engine = SimulatedEngine("sim", **args)
    await engine.start()
    return engine


def test_registered_and_labelled() -> None:
    engine = create_engine("simulated", "m", time_scale=0)
    assert isinstance(engine, SimulatedEngine)
    assert engine.simulated and engine.supports_seed
    assert engine.describe()["simulated"] is True


@pytest.mark.parametrize(
    "args",
    [
        {"max_batch": 0},
        {"time_scale": -1},
        {"length_dist": "zipf"},
        {"length_mean": 0},
        {"vocab_size": 1},
        {"eos_token_id": 50, "vocab_size": 10},
        {"step_time_base_s": float("nan")},
        {"length_prompt_share": 1.5},
        {"length_prompt_share": -0.1},
    ],
)
def test_invalid_args(args) -> None:
    with pytest.raises(ConfigError):
        SimulatedEngine("sim", **args)


def test_unknown_arg_lists_valid_ones() -> None:
    with pytest.raises(ConfigError, match="max_batch"):
        SimulatedEngine("sim", batch=3)


@pytest.mark.parametrize("dist", ["fixed", "uniform", "lognormal"])
def test_lengths_and_finish_reasons(dist: str) -> None:
    args = SimulatedEngine("sim", length_dist=dist, length_mean=20, length_sigma=0.5, time_scale=0).args
    plans = [plan_output(req(f"r{i}", [i, 1], max_new_tokens=25, seed=i), args) for i in range(300)]
    for plan in plans:
        assert 1 <= len(plan.tokens) <= 25
        if plan.finish == FinishReason.STOP:
            assert plan.tokens[-1] == args.eos_token_id
            assert args.eos_token_id not in plan.tokens[:-1]
        else:
            assert len(plan.tokens) == 25 and args.eos_token_id not in plan.tokens
    mean = sum(len(p.tokens) for p in plans) / len(plans)
    assert 14 < mean < 21, mean
    if dist == "fixed":
        assert {len(p.tokens) for p in plans} == {20}


def _lengths(share: float, prompts: int, samples: int) -> np.ndarray:
    args = SimulatedEngine("sim", length_mean=200, length_sigma=1.0, length_prompt_share=share, time_scale=0).args
    return np.array(
        [
            [len(plan_output(req("r", [p, 7], max_new_tokens=100_000, seed=s), args).tokens) for s in range(samples)]
            for p in range(prompts)
        ]
    )


def test_length_prompt_share_makes_samples_of_one_prompt_alike_and_keeps_the_mean() -> None:
    independent, alike, same = _lengths(0.0, 200, 8), _lengths(0.8, 200, 8), _lengths(1.0, 40, 4)
    assert (same == same[:, :1]).all()  # all of the log-variance is the prompt's
    assert (independent != independent[:, :1]).any(axis=1).mean() > 0.9

    def within_share(lengths: np.ndarray) -> float:  # share of log-length variance within prompts
        logs = np.log(lengths)
        return float(logs.var(axis=1).mean() / logs.var())

    assert within_share(independent) > 0.75 and within_share(alike) < 0.4
    for lengths in (independent, alike):  # the mean stays length_mean (200) either way
        assert 150 < lengths.mean() < 260, lengths.mean()


def test_outputs_are_deterministic_and_prefix_consistent() -> None:
    args = SimulatedEngine("sim", length_dist="fixed", length_mean=50, time_scale=0).args
    long = plan_output(req("a", [1, 2, 3], max_new_tokens=40, seed=5, logprobs=True), args)
    short = plan_output(req("b", [1, 2, 3], max_new_tokens=10, seed=5, logprobs=True), args)
    assert short.tokens == long.tokens[:10] and short.logprobs == long.logprobs[:10]
    assert all(-5 < x <= 0 for x in long.logprobs)
    other_seed = plan_output(req("c", [1, 2, 3], max_new_tokens=40, seed=6), args)
    assert other_seed.tokens != long.tokens
    greedy = [plan_output(req("g", [1, 2, 3], max_new_tokens=40, temperature=0, seed=s), args) for s in (1, 2)]
    assert greedy[0].tokens == greedy[1].tokens
    signed = [plan_output(req("n", [1, 2, 3], max_new_tokens=40, seed=s), args).tokens for s in (-1, 1, -5, 0)]
    assert len({tuple(t) for t in [*signed, greedy[0].tokens, long.tokens]}) == 6  # every seed its own stream


@pytest.mark.parametrize("dist", ["fixed", "uniform", "lognormal"])
def test_a_batch_plans_each_request_as_it_would_alone(dist: str) -> None:
    args = SimulatedEngine("sim", length_dist=dist, length_mean=12, length_prompt_share=0.5, time_scale=0).args
    requests = [
        req(f"r{i}", [i % 7, 3], max_new_tokens=4 + i % 20, seed=i // 2, logprobs=i % 2 == 0, temperature=i % 3)
        for i in range(60)
    ]
    requests.append(GenerationRequest("k", [5, 6], SamplingParams(max_new_tokens=30, seed=1, top_logprobs=3)))
    requests.append(GenerationRequest("s", [5, 6], SamplingParams(max_new_tokens=30, seed=1, stop_token_ids=[9])))
    alone = [plan_output(r, args) for r in requests]
    together = plan_outputs(requests, args)
    assert together == alone
    assert plan_outputs(list(reversed(requests)), args) == list(reversed(alone))
    assert {p.finish for p in alone} == {FinishReason.STOP, FinishReason.LENGTH}
    assert len(alone[-2].top_logprobs) == len(alone[-2].tokens) and alone[-1].logprobs is None


def test_each_request_ends_at_the_first_of_its_own_stop_ids() -> None:
    """In one batch, requests with different stop ids (or none) each end at the first of their own stop ids, as
    the same request without stop ids would have gone on, and a neighbour's stop ids never cut them."""
    args = SimulatedEngine("sim", vocab_size=12, eos_token_id=0, length_mean=20, time_scale=0).args
    stop_sets = [(), (3,), (3, 7), (11,), (5, 6, 7, 8)]
    requests = [
        req(f"r{i}", [i % 5, 2], max_new_tokens=5 + i % 30, seed=i, stop_token_ids=stop_sets[i % len(stop_sets)])
        for i in range(80)
    ]
    uncut = plan_outputs(
        [dataclasses.replace(r, params=dataclasses.replace(r.params, stop_token_ids=())) for r in requests], args
    )
    cut_somewhere = 0
    for request, plan, full in zip(requests, plan_outputs(requests, args), uncut, strict=True):
        stops = set(request.params.stop_token_ids)
        first = next((k for k, t in enumerate(full.tokens) if t in stops), None)
        if first is None:
            assert (plan.tokens, plan.finish) == (full.tokens, full.finish)
        else:
            assert (plan.tokens, plan.finish) == (full.tokens[: first + 1], FinishReason.STOP)
            cut_somewhere += first + 1 < len(full.tokens)
    assert cut_somewhere > 10


def _wall_waits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float]]:
    """Record every ``(steps, wall seconds per step)`` the engine waits for (a spy: the real wait still runs)."""
    waits: list[tuple[int, float]] = []
    original = SimulatedEngine.wait_steps

    async def recording(self, steps: int, wall_per_step: float) -> int:
        waits.append((steps, wall_per_step))
        return await original(self, steps, wall_per_step)

    monkeypatch.setattr(SimulatedEngine, "wait_steps", recording)
    return waits


def test_instant_mode_never_waits_on_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    waits = _wall_waits(monkeypatch)

    async def main() -> None:
        engine = await _started(time_scale=0, length_mean=64)
        requests = [req(f"r{i}", [1, i % 50, 7], max_new_tokens=128, seed=i) for i in range(5000)]
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        assert [r.request_id for r in results] == [r.request_id for r in requests]
        stats = engine.stats()
        assert stats["requests_finished"] == 5000 and stats["busy_fraction"] is None
        assert stats["tokens_generated"] == sum(len(r.output_ids) for r in results)
        assert stats["busy_s"] > 0  # model time is still accounted
        await engine.shutdown()

    run(main())
    assert waits == []


def test_makespan_follows_step_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 requests of 20 tokens, 3 at a time: waves of 3, 3 and 2 requests (model time, not wall time)."""
    base, per_seq = 0.01, 0.001
    waits = _wall_waits(monkeypatch)

    async def main() -> dict:
        engine = await _started(
            time_scale=1.0,
            step_time_base_s=base,
            step_time_per_seq_s=per_seq,
            length_dist="fixed",
            length_mean=20,
            max_batch=3,
        )
        await asyncio.gather(*(engine.generate(req(f"r{i}", [1, 2], max_new_tokens=100, seed=i)) for i in range(8)))
        stats = engine.stats()
        await engine.shutdown()
        return stats

    stats = run(main())
    expected = 20 * (base + 3 * per_seq) * 2 + 20 * (base + 2 * per_seq)
    assert stats["busy_s"] == pytest.approx(expected)
    assert stats["batch_size_hist"] == {3: 40, 2: 20}
    assert stats["steps"] == 60 and stats["mean_batch_size"] == pytest.approx(160 / 60)
    assert sum(steps * wall for steps, wall in waits) == pytest.approx(expected)  # time_scale 1: wall = model
    assert stats["elapsed_s"] >= stats["busy_s"] * 0.999 and 0 < stats["busy_fraction"] <= 1.0


def test_time_scale_scales_the_wall_time_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    waits = _wall_waits(monkeypatch)

    async def main() -> dict:
        engine = await _started(
            time_scale=0.1, step_time_base_s=0.05, step_time_per_seq_s=0.0, length_dist="fixed", length_mean=20
        )
        await engine.generate(req("r", [1], max_new_tokens=100))
        stats = engine.stats()
        await engine.shutdown()
        return stats

    stats = run(main())
    assert stats["busy_s"] == pytest.approx(1.0)  # 20 steps of 50 ms model time
    assert sum(steps for steps, _ in waits) == 20
    assert sum(steps * wall for steps, wall in waits) == pytest.approx(0.1)  # 1 model s x time_scale 0.1


def test_busy_fraction_counts_idle_time() -> None:
    async def main() -> dict:
        engine = await _started(
            time_scale=1.0, step_time_base_s=0.005, step_time_per_seq_s=0.0, length_dist="fixed", length_mean=20
        )
        await engine.generate(req("a", [1], max_new_tokens=50))
        await asyncio.sleep(0.1)  # idle: at least 0.1 s pass with nothing running
        stats = engine.stats()
        await engine.shutdown()
        return stats

    stats = run(main())
    assert stats["busy_s"] == pytest.approx(0.1)
    assert stats["elapsed_s"] >= 0.2 * 0.999  # busy for 0.1 model s (= wall s here), then idle for 0.1 s
    assert stats["busy_fraction"] == pytest.approx(stats["busy_s"] / stats["elapsed_s"], rel=0.05)
    assert stats["busy_fraction"] <= 0.5 + 1e-3, stats


def test_late_request_joins_running_batch() -> None:
    """A request arriving mid-run starts at the next step, not after the running ones finish."""

    async def main() -> tuple[list[str], dict]:
        engine = await _started(
            time_scale=1.0,
            step_time_base_s=0.002,
            step_time_per_seq_s=0.0,
            length_dist="fixed",
            length_mean=1000,
            max_batch=8,
        )
        order: list[str] = []

        async def generate(rid: str, prompt: list[int], tokens: int) -> None:
            await engine.generate(req(rid, prompt, max_new_tokens=tokens))
            order.append(rid)

        long = asyncio.ensure_future(generate("long", [1], 1000))
        while engine.current_step() < 10:  # the long request is running
            await asyncio.sleep(0.002)
        await generate("short", [2], 4)
        await long
        stats = engine.stats()
        await engine.shutdown()
        return order, stats

    order, stats = run(main())
    assert order == ["short", "long"]
    # the short request's 4 steps ran alongside the long one (batch of 2), not after it
    assert stats["batch_size_hist"] == {1: 996, 2: 4}, stats


def test_abort_waiting_and_running() -> None:
    async def main() -> list:
        engine = await _started(
            time_scale=1.0,
            step_time_base_s=0.002,
            step_time_per_seq_s=0.0,
            length_dist="fixed",
            length_mean=1000,
            max_batch=1,
        )
        tasks = [
            asyncio.ensure_future(engine.generate(req(r, [1], max_new_tokens=500, logprobs=True)))
            for r in ("running", "waiting")
        ]
        while engine.current_step() < 5:  # "running" has generated a few tokens
            await asyncio.sleep(0.002)
        await engine.abort("waiting")
        await engine.abort("running")
        results = await asyncio.gather(*tasks)
        assert engine.stats()["requests_aborted"] == 2
        await engine.shutdown()
        return results

    running, waiting = run(main(), timeout=5)
    assert running.finish_reason == waiting.finish_reason == FinishReason.ABORT
    assert 5 <= len(running.output_ids) < 500 and len(running.logprobs) == len(running.output_ids)
    assert waiting.output_ids == []


def test_cancelled_caller_frees_its_slot() -> None:
    async def main() -> None:
        engine = await _started(
            time_scale=1.0, step_time_base_s=0.002, length_dist="fixed", length_mean=1000, max_batch=1
        )
        first = asyncio.ensure_future(engine.generate(req("first", [1], max_new_tokens=1000)))
        await asyncio.sleep(0.02)
        first.cancel()
        result = await engine.generate(req("second", [2], max_new_tokens=3))
        assert len(result.output_ids) == 3
        await engine.shutdown()

    run(main(), timeout=5)


def test_shutdown_aborts_in_flight() -> None:
    async def main():
        engine = await _started(time_scale=1.0, step_time_base_s=0.01, length_dist="fixed", length_mean=1000)
        task = asyncio.ensure_future(engine.generate(req("r", [1], max_new_tokens=1000)))
        await asyncio.sleep(0.05)
        await engine.shutdown()
        return await task

    assert run(main(), timeout=5).finish_reason == FinishReason.ABORT


def test_engine_survives_a_new_event_loop() -> None:
    """Started under one loop, used under another (as after a closed test loop)."""
    engine = run(_started(time_scale=0))
    assert run(engine.generate(req("a", [1], max_new_tokens=3))).error is None
    assert run(engine.generate(req("b", [1], max_new_tokens=3))).error is None
    run(engine.shutdown())


@pytest.mark.proves("simulated", "refresh")
def test_a_published_folder_loads_in_place_and_changes_no_output(tmp_path) -> None:
    """No weights: ``refresh`` loads a version folder (or URL) at once; outputs stay what they were; a path that
    is no folder is refused as a model's engine would fail to read it."""
    from daskgen.errors import RefreshError

    async def scenario():
        engine = await _started(time_scale=0)
        try:
            before = (await engine.generate(req("a", [5, 6, 7], max_new_tokens=8, temperature=0.0))).output_ids
            await engine.update_weights(str(tmp_path))
            await engine.update_weights("s3://bucket/step-1")
            with pytest.raises(RefreshError, match="is not a folder"):
                await engine.update_weights(str(tmp_path / "missing"))
            after = (await engine.generate(req("b", [5, 6, 7], max_new_tokens=8, temperature=0.0))).output_ids
            return before, after
        finally:
            await engine.shutdown()

    before, after = run(scenario())
    assert "refresh" in SimulatedEngine.features and before == after and before
