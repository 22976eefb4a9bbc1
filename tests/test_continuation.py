"""Token-exact continuation, proven: an interrupted, resumed greedy run sends the engine prompt + stored
prefix, and equals an uninterrupted run token for token (real tiny model, CLI, LocalCluster), with each
in-process engine: transformers here, vLLM in the vllm lane, SGLang in the sglang lane.  A continuation
that re-sent only the prompt fails both checks."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from transformers import AutoTokenizer

from daskgen import store
from daskgen.client.interrupt import EXIT_INTERRUPTED
from daskgen.engines.base import FinishReason
from tests.conftest import popen_cli, run_cli, write_prompts
from tests.test_preemption import _partials
from tests.test_run import _wait_for_some_done

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

N = 48  # prompts: enough that many requests are mid-response when the run is stopped
COMPARED = ("response_ids", "response_length", "response_mask", "finish_reason", "prompt_ids", "prompt_length")


def _args(model, prompts, out, log, inner="transformers", engine_args=()):
    return [
        "run",
        *("--prompts", prompts, "--model", model, "--store", out),
        *("--engine", "daskgen.testing.engines:RecordingEngine", "--engine-arg", f"inner={inner}"),
        *("--engine-arg", f"prompts_log={log}"),
        *(a for arg in engine_args for a in ("--engine-arg", arg)),
        *("--partition-size", "2", "--max-new-tokens", "160", "--temperature", "0"),
        *("--no-progress", "--n-workers", "1", "--grace", "60s"),
    ]


def _sent(log) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        out.setdefault(entry["id"], []).append(entry["prompt"])
    return out


def test_a_resumed_greedy_run_sends_prompt_plus_prefix_and_equals_an_uninterrupted_one(tmp_path, tiny_model):
    check_continuation(tmp_path, str(tiny_model))


@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_vllm_continues_token_exactly(tmp_path):
    """The same proof with the in-process vLLM engine (the tiny model with 32-wide heads, as vLLM's CPU
    kernels need)."""
    from tests.test_engine_vllm import tiny_model_path

    check_continuation(tmp_path, tiny_model_path(), "vllm", ("dtype=float32", "max_model_len=2048"), start_s=900)


@pytest.mark.sglang
@pytest.mark.timeout(2400)
def test_sglang_continues_token_exactly(tmp_path):
    """The same proof with the in-process SGLang engine (greedy: sglang has no seeds on a CPU, and needs none here)."""
    from tests.test_engine_sglang import tiny_model_path

    check_continuation(tmp_path, tiny_model_path(), "sglang", start_s=600)


def check_continuation(tmp_path, model, inner="transformers", engine_args=(), start_s=240):
    """Interrupt a greedy run with SIGTERM, resume it, run it uninterrupted; compare what was sent and stored.

    ``start_s``: how long the first run may take to commit its first rows (engine start included).
    """
    prompts = write_prompts(tmp_path / "p.jsonl", N)
    out, whole = tmp_path / "out.zarr", tmp_path / "whole.zarr"

    def args(store_path, log_name):
        return _args(model, prompts, store_path, tmp_path / log_name, inner, engine_args)

    proc = popen_cli(*args(out, "first.jsonl"))
    try:
        _wait_for_some_done(out, proc, minimum=1, timeout=start_s)
        os.kill(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_INTERRUPTED, output
    saved = _partials(out)
    opened = store.GenerationStore.open(out)
    prompt_ids, prompt_length = (opened.read_region(0, N, (n,))[n] for n in ("prompt_ids", "prompt_length"))
    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    continued = {key: ids for key, (ids, _) in saved.items() if len(ids) and ids[-1] != eos}
    assert continued, "the interruption must leave some response partial (the precondition of this test)"
    res = run_cli(*args(out, "second.jsonl"), timeout=600 + start_s)
    assert res.returncode == 0 and f"{N} done" in res.stdout, res.stdout + res.stderr[-4000:]
    sent = _sent(tmp_path / "second.jsonl")
    for (r, s), ids in continued.items():
        prompt = prompt_ids[r, : prompt_length[r]].tolist()
        assert sent[f"p{r}-s{s}"] == [prompt + ids.tolist()], f"row {r} sample {s}: not prompt + stored prefix"
    res = run_cli(*args(whole, "whole.jsonl"), timeout=600 + start_s)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    resumed, uninterrupted = store.GenerationStore.open(out), store.GenerationStore.open(whole)
    for name in COMPARED:
        np.testing.assert_array_equal(
            resumed.read_region(0, N, (name,))[name], uninterrupted.read_region(0, N, (name,))[name], err_msg=name
        )
    reasons = resumed.read_region(0, N, ("finish_reason",))["finish_reason"]
    assert not (reasons == FinishReason.ABORT).any()
