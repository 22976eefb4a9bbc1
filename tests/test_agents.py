"""Agent loops: parser, tools, the tool loop on a real tiny model (scripted turns labelled), store layout."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
import xarray as xr

from daskgen import store
from daskgen.agents import EngineHandle, SingleTurn, create_agent
from daskgen.agents.parsers import HermesParser, ToolCall
from daskgen.agents.tools import call_tool, load_tools
from daskgen.engines.base import FinishReason, SamplingParams
from daskgen.errors import ConfigError
from daskgen.testing.engines import ScriptedToolEngine
from tests.conftest import run_cli, write_prompts

TOOLS = {"add": "tests.agent_tools:add", "boom": "tests.agent_tools:boom", "slow": "tests.agent_tools:slow"}


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_hermes_parser():
    p = HermesParser()
    assert p.parse("no tools here") == []
    calls = p.parse("x " + call("add", a=1, b=2) + " y " + call("boom"))
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}), ("boom", {})]
    bad = p.parse('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>')
    assert bad[0].error.startswith("malformed tool call JSON")
    assert p.parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}')[0].arguments == {"a": 1}
    assert "must be" in p.parse('<tool_call>["add"]</tool_call>')[0].error


def test_tools_errors_and_timeouts_become_messages():
    tools = load_tools(TOOLS)
    run = lambda c: asyncio.run(call_tool(tools, c, 0.5))  # noqa: E731
    assert run(ToolCall("add", {"a": 2, "b": 3})) == "5"
    assert run(ToolCall("boom")) == "Error: tool 'boom' raised ValueError: the tool broke"
    assert run(ToolCall("slow")) == "Error: tool 'slow' timed out after 0.5 s"
    assert "unknown tool 'nope'" in run(ToolCall("nope"))
    assert run(ToolCall(None, error="malformed")) == "Error: malformed"
    shot = {"content": [{"type": "text", "text": "the page"}, {"type": "image_url", "image_url": {"url": "a.png"}}]}
    tools["screenshot"] = lambda: shot
    refused = "Error: tool 'screenshot' returned an image; this tool loop passes text results only"
    assert run(ToolCall("screenshot")) == refused
    page = {"content": [{"type": "text", "text": "the page"}], "kind": {"type": "image", "n": 2}, "x": {"type": []}}
    tools["page"] = lambda: page
    assert run(ToolCall("page")) == json.dumps(tools["page"]())  # no image part: a "type" alone is not one
    with pytest.raises(ConfigError, match="cannot import tool"):
        load_tools(["tests.agent_tools:missing"])


def test_agent_validation():
    with pytest.raises(ConfigError, match="unknown agent"):
        create_agent("nope", "m")
    with pytest.raises(ConfigError, match="valid"):
        create_agent("tool", "m", {"max_turn": 3})
    assert isinstance(create_agent("single_turn", "m"), SingleTurn)


@pytest.fixture(scope="module")
def loop_env(tiny_model):
    """A real tiny-model engine behind the scripted-turn test double, on one event loop."""
    from daskgen.testing.conformance import EventLoopThread

    thread = EventLoopThread()
    engines = {}

    def make(script):
        key = json.dumps(script, sort_keys=True)
        if key not in engines:
            eng = ScriptedToolEngine(str(tiny_model), inner="transformers", script=script)
            thread.run(eng.start(), timeout=300)
            engines[key] = eng
        return engines[key]

    yield thread, make, tiny_model
    for eng in engines.values():
        thread.run(eng.shutdown(), timeout=60)
    thread.close()


def run_loop(loop_env, script, agent_args, max_new_tokens=64, logprobs=True):
    thread, make, model = loop_env
    engine = make(script)
    agent = create_agent("tool", str(model), {"tools": TOOLS, **agent_args})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "add 2 and 3"}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.0, logprobs=logprobs, stop_token_ids=(tok.eos_token_id,)
    )
    return thread.run(agent.run(EngineHandle(engine), "p0-s0", prompt, params), timeout=300), tok, agent


def test_tool_loop_is_token_exact(loop_env):
    script = {"0": "Let me add. " + call("add", a=2, b=3)}
    (traj,), tok, agent = run_loop(loop_env, script, {"max_turns": 2})
    scripted = tok(script["0"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    obs = agent.observation_ids(["5"])
    n0, n1 = len(scripted), len(obs)
    assert traj.response_ids[:n0] == scripted
    assert traj.response_ids[n0 : n0 + n1] == obs and "5" in tok.decode(obs)
    assert traj.response_mask == [1] * n0 + [0] * n1 + [1] * (len(traj.response_ids) - n0 - n1)
    assert len(traj.response_ids) > n0 + n1, "turn 1 was generated by the real model"
    assert traj.num_turns == 2
    assert all(math.isnan(x) for x in traj.logprobs[n0 : n0 + n1])
    assert all(x <= 0 for x in traj.logprobs[n0 + n1 :])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (call("boom"), "raised ValueError: the tool broke"),
        (call("slow"), "timed out after 0.5 s"),
        ('<tool_call>{"name": "add", "arguments": {"a": </tool_call>', "malformed tool call JSON"),
    ],
)
def test_tool_failures_are_fed_back_to_the_model(loop_env, text, expected):
    (traj,), tok, _ = run_loop(loop_env, {"0": text}, {"max_turns": 2, "tool_timeout_s": 0.5})
    obs = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m == 0]
    assert expected in tok.decode(obs)
    assert traj.error is None and traj.num_turns == 2


def test_budget_runs_out_mid_turn(loop_env, tiny_model):
    from transformers import AutoTokenizer

    script = {"0": call("add", a=2, b=3)}
    budget = len(AutoTokenizer.from_pretrained(tiny_model)(script["0"], add_special_tokens=False)["input_ids"]) + 4
    (traj,), tok, _ = run_loop(loop_env, script, {"max_turns": 3}, max_new_tokens=budget)
    assert len(traj.response_ids) == budget and traj.finish_reason == FinishReason.LENGTH
    assert traj.response_mask[-1] == 0, "cut inside the tool result"


def test_context_reset_gives_several_trajectories(loop_env):
    script = {"0": call("delete_context", summary="the sum is 5"), "1": "The answer is 5."}
    trajs, tok, _ = run_loop(loop_env, script, {"max_turns": 3, "max_trajectories": 2})
    assert len(trajs) == 2
    assert trajs[0].num_turns == 1 and trajs[1].num_turns == 1
    assert "the sum is 5" in tok.decode(
        [t for t, m in zip(trajs[1].response_ids, trajs[1].response_mask, strict=True) if m == 0]
    )


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard: two runs (partial, then the resume), each with its own cluster
def test_tool_run_end_to_end_with_trajectory_axis_and_resume(tmp_path, tiny_model):
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    cfg = tmp_path / "run.yaml"
    script = {"0": call("add", a=2, b=3), "1": call("delete_context", summary="5")}
    cfg.write_text(
        json.dumps(
            {
                "engine": "daskgen.testing.engines:ScriptedToolEngine",
                "engine_args": {"inner": "transformers", "script": script},
                "agent": "tool",
                "agent_args": {"tools": TOOLS, "max_turns": 4, "max_trajectories": 2},
                "max_new_tokens": 128,
                "partition_size": 2,
                "n_samples": 2,
                "temperature": 0.0,
                "logprobs": True,
            }
        )
    )
    out = tmp_path / "out.zarr"
    args = ["run", "--config", cfg, "--prompts", prompts, "--model", tiny_model, "--store", out, "--no-progress"]
    first = run_cli(*args, "--window", "1", "--target-done", "2", timeout=380)  # stops early: a partial store
    assert first.returncode == 0, first.stdout + first.stderr
    status = store.GenerationStore.open(out).read_status()
    done_first = status == store.DONE
    assert 0 < done_first.sum() < 6 and (status == store.PENDING).any(), status
    kept = xr.open_zarr(out).response_ids.values[done_first]
    res = run_cli(*args, timeout=380)  # the resume
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"this run generated {6 - int(done_first.sum())} prompts" in res.stdout, res.stdout
    ds = xr.open_zarr(out)
    assert (ds.status.values == store.DONE).all()
    np.testing.assert_array_equal(ds.response_ids.values[done_first], kept)  # done rows untouched
    assert ds.attrs["daskgen"]["schema_version"] == 2
    assert ds.response_ids.dims == ("prompt", "sample", "trajectory", "response_position")
    assert (ds.num_trajectories.values == 2).all()
    mask = ds.response_mask.values
    assert (mask[:, :, 0] == 0).any() and (mask[:, :, 0] == 1).any()
    lp = ds.logprobs.values
    assert np.isnan(lp[mask == 0]).all() and np.isfinite(lp[mask == 1]).all()
    assert (ds.num_turns.values[:, :, 0] == 2).all()
    again = run_cli(*args, timeout=380)
    assert again.returncode == 0 and "this run generated 0 prompts" in again.stdout


def test_a_request_whose_engine_was_shut_down_for_a_restart_ends_abort_not_failed():
    """The race behind a flaky poison-prompt run: another request crashed the engine, the worker shut it
    down to restart it, and this request reached the closed engine (an error answer) or raised.  Its row
    must be requeued (``abort``), not failed like a bad request; on the live engine an error stays one."""
    from daskgen.engines.simulated import SimulatedEngine
    from daskgen.testing.engines import RecordingEngine

    async def scenario():
        engine = SimulatedEngine("sim", time_scale=0)
        await engine.start()
        current = [engine]
        handle = EngineHandle(engine, live=lambda: current[0])
        params = SamplingParams(max_new_tokens=4, logprobs=True)
        ok = await handle.generate("p0-s0", [5, 6], params)
        await engine.shutdown()  # closed, yet still the worker's engine: a real error
        on_live = await handle.generate("p1-s0", [5, 6], params)
        current[0] = None  # the worker began restarting it
        replaced = await handle.generate("p2-s0", [5, 6], params)
        poison = RecordingEngine("sim", inner="simulated", time_scale=0, poison_rows=[3])
        await poison.start()
        current[0] = poison
        crashing = EngineHandle(poison, live=lambda: current[0])
        with pytest.raises(RuntimeError, match="poison"):  # the live engine crashed: the task fails, is retried
            await crashing.generate("p3-s0", [5, 6], params)
        current[0] = None
        after_restart = await crashing.generate("p3-s0", [5, 6], params)
        await poison.shutdown()
        return ok, on_live, replaced, after_restart

    ok, on_live, replaced, after_restart = asyncio.run(scenario())
    assert ok.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and ok.output_ids
    assert on_live.finish_reason == FinishReason.ERROR and "closed" in on_live.error
    assert replaced.finish_reason == FinishReason.ABORT and replaced.error is None and replaced.logprobs == []
    assert after_restart.finish_reason == FinishReason.ABORT


def test_a_request_whose_engine_died_raises_so_the_partition_is_retried():
    """An error answer from a running engine whose backend died (its ``crash()`` hook says so, as vLLM's
    does once its EngineCore process is gone) is not the request's fault: the handle raises, so the
    partition fails, the worker restarts the engine and Dask retries it.  A bad request to a live engine,
    or a request to an engine that was shut down, stays an error answer."""
    from daskgen.engines.base import error_result
    from daskgen.engines.simulated import SimulatedEngine
    from daskgen.errors import EngineError

    class DyingEngine(SimulatedEngine):
        """Test double: the simulated engine whose backend can be declared dead (``death``)."""

        death: str | None = None

        def crash(self):
            return self.death

        async def generate(self, request):
            if self.death is not None:
                return error_result(request, f"crashed: {self.death}")
            return await super().generate(request)

    async def scenario():
        engine = DyingEngine("sim", time_scale=0)
        await engine.start()
        handle = EngineHandle(engine, live=lambda: engine)
        params = SamplingParams(max_new_tokens=4)
        bad = await handle.generate("p0-s0", [10**9], params)  # out of vocabulary: the request's fault
        engine.death = "its EngineCore process exited"
        with pytest.raises(EngineError, match="died while request 'p1-s0' ran: its EngineCore process exited"):
            await handle.generate("p1-s0", [5, 6], params)
        await engine.shutdown()
        closed = await handle.generate("p2-s0", [5, 6], params)
        return bad, closed

    bad, closed = asyncio.run(scenario())
    assert bad.finish_reason == FinishReason.ERROR and "vocab" in bad.error, bad
    assert closed.finish_reason == FinishReason.ERROR, closed
