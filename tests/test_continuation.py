"""Token-exact continuation, proven end to end: an interrupted, resumed greedy run sends the engine prompt + stored
prefix, and equals an uninterrupted answer token for token (real tiny model, CLI, LocalCluster). A continuation that
re-sent only the prompt fails both checks. The uninterrupted answer is a second run's where the stop lands anywhere;
where the test holds chosen rows part-way (:class:`Pause`), it is the answer of a copy of each held row, appended to
the same input and not held, which the interrupted run finishes before the stop. What is engine-specific in it (an
abort keeps a prefix of the answer; prompt + prefix continues to the uninterrupted answer, per request feature) is
proven on every engine by the conformance suite (``test_abort``, :mod:`daskgen.testing.continuation`); with images,
which the conformance suite's text models do not have, on each engine that takes them in process (``vllm`` in the
vllm lane)."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from importlib.util import find_spec

import numpy as np
import pytest
from transformers import AutoTokenizer

from daskgen import store
from daskgen.client.interrupt import EXIT_INTERRUPTED
from daskgen.engines.base import FinishReason
from daskgen.testing.probes import read_events, row_of
from tests.conftest import popen_cli, run_cli, write_prompts
from tests.test_preemption import _group_gone, _partials
from tests.test_run import _wait_for_some_done

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

N = 16  # prompts: enough that some requests are mid-response when the run is stopped
COMPARED = ("response_ids", "response_length", "response_mask", "finish_reason", "prompt_ids", "prompt_length")


RECORDING, PROBE = "daskgen.testing.engines:RecordingEngine", "daskgen.testing.probes:ProbeEngine"


def _args(model, prompts, out, log, inner="transformers", engine_args=(), new_tokens=160, engine=RECORDING, extra=()):
    return [
        "run",
        *("--prompts", prompts, "--model", model, "--store", out),
        *("--engine", engine, "--engine-arg", f"inner={inner}"),
        *("--engine-arg", f"prompts_log={log}"),
        *(a for arg in engine_args for a in ("--engine-arg", arg)),
        *("--partition-size", "2", "--max-new-tokens", str(new_tokens), "--temperature", "0"),
        *("--no-progress", "--n-workers", "1", "--grace", "60s"),
        *extra,
    ]


@dataclass(frozen=True)
class Pause:
    """Rows whose first request stops after ``after`` tokens and waits there (the probe engine's gate, closed
    for the interrupted run): the stop then finds them mid-response whatever the engine's speed."""

    rows: tuple[int, ...]
    after: int
    prompts: int
    new_tokens: int

    def engine(self, tmp_path) -> tuple[str, ...]:
        """Engine args of the probe engine that replaces the recording one (``inner`` and ``prompts_log``
        are the same; the gate opens before the resumed run)."""
        return (
            f"events_path={tmp_path / 'events.log'}",
            f"gate_path={tmp_path / 'gate'}",
            f"gate_rows={list(self.rows)}",
            f"pause_after={self.after}",
        )

    def copy_rows(self, prompts) -> dict[int, int]:
        """Append to the prompt file a copy of each paused row, not held (its id suffixed ``-again``); return
        paused row -> its copy's row.  The copy's answer is the uninterrupted answer the resumed row must equal."""
        rows = [json.loads(line) for line in prompts.read_text().splitlines()]
        assert len(rows) == self.prompts, (len(rows), self.prompts)
        copies = [{**rows[r], **({"id": f"{rows[r]['id']}-again"} if "id" in rows[r] else {})} for r in self.rows]
        with prompts.open("a") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in copies)
        return {r: self.prompts + i for i, r in enumerate(self.rows)}

    def wait(self, tmp_path, proc, timeout, n) -> None:
        """Wait until every paused row's request waits part-way (or finished within its first tokens: an attempt
        that failed or was aborted there is retried, and pauses), and each of the other ``n`` rows' requests
        ended: the stop then finds only paused rows mid-response."""
        deadline = time.monotonic() + timeout
        settled = ("pause", "early-stop", "early-length")
        others = set(range(n)) - set(self.rows)
        while True:
            events = read_events(tmp_path / "events.log")
            paused = {row_of(e.request_id) for e in events if e.kind in settled}
            ended = {row_of(e.request_id) for e in events if e.kind == "end"}
            if paused >= set(self.rows) and ended >= others:
                return
            assert proc.poll() is None, f"run ended before the stop: {proc.stdout.read()}"
            text = (tmp_path / "events.log").read_text() if (tmp_path / "events.log").exists() else ""
            assert time.monotonic() < deadline, (
                f"within {timeout} s, rows {self.rows} did not all pause or rows {sorted(others - ended)} did not "
                f"end: {text}"
            )
            time.sleep(0.05)


def _sent(log) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        out.setdefault(entry["id"], []).append(entry["prompt"])
    return out


def test_a_resumed_greedy_run_sends_prompt_plus_prefix_and_equals_an_uninterrupted_one(tmp_path, tiny_model):
    """SIGTERM wherever the run is (no row held): the interrupted run's processes are all gone, its committed rows
    stay done, each stored partial response keeps its tokens and logprobs, and is continued (``continued_tokens``)
    unless it had ended with its stop token."""
    check_continuation(tmp_path, str(tiny_model), extra=("--logprobs",))


#: The engines an image run is continued on, with their engine args: transformers here, vLLM in the vllm lane.
IMAGE_ENGINES = [
    pytest.param("transformers", (), id="transformers"),
    pytest.param(
        "vllm",
        ("dtype=float32", "max_model_len=2048"),
        id="vllm",
        marks=[
            pytest.mark.vllm,
            pytest.mark.skipif(find_spec("vllm") is None, reason="vllm is not installed (the vllm lane)"),
        ],
    ),
]


@pytest.mark.parametrize(("inner", "inner_args"), IMAGE_ENGINES)
def test_a_resumed_run_with_images_continues_prompt_plus_prefix_with_the_same_images(tmp_path, inner, inner_args):
    """Rows naming images (the tiny Qwen2-VL), stopped part-way: the resumed run sends the expanded prompt and the
    stored prefix, with the row's images, and equals an uninterrupted answer."""
    from daskgen.models import build_tiny_vl_model
    from daskgen.testing.images import write_generated_images

    images = list(write_generated_images(tmp_path / "images").values())
    rows = [
        {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(images[i % len(images)])}},
            {"type": "text", "text": f"Question {i}?"}]}]}
        for i in range(4)
    ]  # fmt: skip
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pause = Pause(rows=(2, 3), after=8, prompts=4, new_tokens=24)
    extra = ("--min-new-tokens", "20")
    model = str(build_tiny_vl_model())
    check_continuation(tmp_path, model, inner, inner_args, pause=pause, extra=extra, prompts=prompts)


def test_a_resumed_run_continues_rows_with_their_adapter_and_what_is_left_of_min_new_tokens(tmp_path, tiny_model):
    """Rows with and without a LoRA adapter, stopped part-way below their ``min_new_tokens``: the resumed run
    continues prompt + prefix with the row's adapter and with the tokens the row still had to make, and equals an
    uninterrupted answer (a continuation without the adapter would not; one that kept the whole minimum, above the
    budget left, would fail every such row)."""
    from daskgen.testing.lora import make_adapter

    adapter = make_adapter(tiny_model, tmp_path / "lora", seed=1)
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    prompts.write_text(
        "".join(json.dumps({**r, **({"adapter": "a"} if i % 2 else {})}) + "\n" for i, r in enumerate(rows))
    )
    pause = Pause(rows=(1, 2, 3), after=8, prompts=6, new_tokens=24)  # rows 4 and 5 finish: the stop comes then
    extra = ("--adapter-path", f"a={adapter}", "--min-new-tokens", "20")
    check_continuation(tmp_path, str(tiny_model), pause=pause, extra=extra, prompts=prompts)


def test_a_long_answer_near_the_context_limit_resumes_to_the_uninterrupted_tokens(tmp_path, tiny_model):
    """Prompts of about 1,200 tokens and answers of up to 700 (the tiny model's context is 2,048), stopped
    with SIGTERM once the rows of the second partition stored about 590 tokens each: the resumed run continues
    prompt + prefix near the limit and equals an uninterrupted answer.  The random model ends its greedy answers to
    these prompts after about 70 tokens, so ``--min-new-tokens`` keeps them going to the limit."""
    pause = Pause(rows=(2, 3), after=590, prompts=4, new_tokens=700)
    extra = ("--max-prompt-tokens", "1320", "--min-new-tokens", "660")
    check_continuation(tmp_path, str(tiny_model), start_s=480, pause=pause, extra=extra, words=340)


def check_continuation(
    tmp_path, model, inner="transformers", engine_args=(), start_s=240, pause=None, extra=(), words=0, prompts=None
):
    """Interrupt a greedy run with SIGTERM, resume it; compare what was sent and stored with the uninterrupted
    answers (a second run's; with ``pause``, those of the held rows' copies in the same run).

    ``start_s``: how long the first run may take to commit its first rows (engine start included).
    ``pause``: a :class:`Pause` (rows held part-way until the stop, fewer prompts and tokens); without it the
    stop lands wherever the engine is, which takes many long prompts to find some mid-response.  ``extra``: more
    ``daskgen run`` arguments, the same for the three runs.  ``words``: prompts that long (in numbered words)
    instead of short questions.  ``prompts``: a prompt file of ``pause.prompts`` rows to use instead.
    """
    n, new_tokens = (N, 160) if pause is None else (pause.prompts, pause.new_tokens)
    prompts = prompts or write_prompts(tmp_path / "p.jsonl", n, words=words)
    out, whole = tmp_path / "out.zarr", tmp_path / "whole.zarr"
    copies: dict[int, int] = {}
    if pause is not None:
        engine_args = (*engine_args, *pause.engine(tmp_path))
        copies = pause.copy_rows(prompts)
        n += len(copies)

    def args(store_path, log_name):
        engine = RECORDING if pause is None else PROBE
        return _args(model, prompts, store_path, tmp_path / log_name, inner, engine_args, new_tokens, engine, extra)

    proc = popen_cli(*args(out, "first.jsonl"))
    try:
        done_before = _wait_for_some_done(out, proc, minimum=1, timeout=start_s)
        if pause is not None:
            pause.wait(tmp_path, proc, timeout=start_s, n=n)
        os.kill(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_INTERRUPTED, output
    assert _group_gone(proc.pid), "a process of the interrupted run was left behind"
    if pause is not None:
        (tmp_path / "gate").touch()  # the resumed run is not held
    saved = _partials(out)
    opened = store.GenerationStore.open(out)
    prompt_ids, prompt_length = (opened.read_region(0, n, (name,))[name] for name in ("prompt_ids", "prompt_length"))
    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    unfinished = {key: ids for key, (ids, _) in saved.items() if len(ids) and ids[-1] != eos}
    # an abort that raced the last token leaves no budget: the resumed run finishes it from the store, sends nothing
    spent = {key for key, ids in unfinished.items() if len(ids) >= new_tokens}
    continued = {key: ids for key, ids in unfinished.items() if key not in spent}
    precondition = "the interruption must leave some response partial (the precondition of this test)"
    events = (tmp_path / "events.log").read_text() if (tmp_path / "events.log").exists() else "(no probe events)"
    assert continued, (
        f"{precondition}; stored partial responses: {saved}; the probe's events:\n{events[-2000:]}\n"
        f"the run said: {output[-3000:]}"
    )
    res = run_cli(*args(out, "second.jsonl"), timeout=600 + start_s)
    assert res.returncode == 0 and f"{n} done" in res.stdout, res.stdout + res.stderr[-4000:]
    sent = _sent(tmp_path / "second.jsonl")
    assert not {f"p{r}-s{s}" for r, s in spent} & set(sent), "a response with no budget left was sent again"
    for (r, s), ids in continued.items():
        prompt = prompt_ids[r, : prompt_length[r]].tolist()
        assert sent[f"p{r}-s{s}"] == [prompt + ids.tolist()], f"row {r} sample {s}: not prompt + stored prefix"
    resumed = store.GenerationStore.open(out)
    got = resumed.read_region(0, n, COMPARED)
    if pause is not None:  # each continued row equals its copy, which the first run generated without a stop
        assert {r for r, _ in continued} <= set(copies), (sorted(continued), copies)
        for name in COMPARED:
            for row, copy in copies.items():
                np.testing.assert_array_equal(
                    got[name][row], got[name][copy], err_msg=f"{name}: row {row}, copy {copy}"
                )
    else:
        res = run_cli(*args(whole, "whole.jsonl"), timeout=600 + start_s)
        assert res.returncode == 0, res.stdout + res.stderr[-4000:]
        uninterrupted = store.GenerationStore.open(whole).read_region(0, n, COMPARED)
        for name in COMPARED:
            np.testing.assert_array_equal(got[name], uninterrupted[name], err_msg=name)
    check_kept(resumed, n, done_before, saved, eos)


def check_kept(resumed, n, done_before, saved, eos) -> None:
    """After the resume: rows done before the stop still done, each stored partial response's tokens and logprobs
    (NaN where the run keeps none) kept, counted as continued unless it had ended with its stop token; no sample
    left aborted."""
    names = ("finish_reason", "response_ids", "logprobs", "continued_tokens", "response_length")
    got = resumed.read_region(0, n, names)
    assert (resumed.read_status()[done_before] == store.DONE).all()
    assert not (got["finish_reason"] == FinishReason.ABORT).any()
    for (r, s), (ids, logprobs) in saved.items():
        np.testing.assert_array_equal(got["response_ids"][r, s, : len(ids)], ids)
        np.testing.assert_array_equal(got["logprobs"][r, s, : len(ids)], logprobs)  # NaN equals NaN here
        if ids[-1] == eos:  # aborted right after its stop token: already finished, kept as it is
            assert got["continued_tokens"][r, s] == 0 and got["finish_reason"][r, s] == FinishReason.STOP
            assert got["response_length"][r, s] == len(ids)
        else:
            assert got["continued_tokens"][r, s] == len(ids), (r, s)
