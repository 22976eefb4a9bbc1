"""Refreshing the policy while a run goes on: every worker's engine loads a published version in place.

A ``daskgen run --refresh drain`` of the tiny model on a LocalCluster: a probe engine holds one row at a gate
while a new checkpoint (other seeded weights, ``save_pretrained``) is published; once the worker records that it
is loading the version (it stopped admitting and waits for the held row), the row is released.  Every sample
records the version that generated it (and the published digest of version 1, checked against the weights the
worker's engine loaded), and each equals that version's own greedy answer token for token (a
greedy probe against the checkpoint loaded in this process).  In process: ``continue`` aborts a request mid-way
and continues it from its tokens on the new weights; a checkpoint that does not fit is refused and the engine
keeps its version.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import daskgen
from daskgen import store
from daskgen.engines.base import GenerationRequest, SamplingParams
from daskgen.engines.transformers import TransformersEngine
from daskgen.store.fingerprint import digest_number
from daskgen.store.policy import read_versions, read_worker_policies, write_worker_policy
from daskgen.store.tools.verify import verify
from daskgen.testing.harness import EventLoopThread
from daskgen.testing.probes import read_events, row_of
from daskgen.worker.refresh import PolicyRefresher
from tests.conftest import popen_cli, write_prompts
from tests.probing import gate_args, wait_for_arrival, wait_until

pytestmark = pytest.mark.timeout(600)

HELD = 2
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def new_policy(tmp_path_factory):
    """A checkpoint of the tiny model's architecture with other weights (seed 1), saved with save_pretrained."""
    from daskgen.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("policy") / "step1", seed=1)


def greedy(model, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt's greedy answer from the checkpoint ``model``, loaded in this process."""
    with GreedyReference() as reference:
        return reference.answers(model, prompts, params)


class GreedyReference:
    """Greedy answers from checkpoints loaded in this process, each loaded once (when first asked) and kept until the
    ``with`` block ends: one engine start per checkpoint however many prompts are asked of it, and when."""

    def __init__(self) -> None:
        self.runner = EventLoopThread()
        self.engines: dict[str, TransformersEngine] = {}

    def __enter__(self) -> GreedyReference:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for engine in self.engines.values():
                self.runner.run(engine.shutdown(), 120)
        finally:
            self.runner.close()

    def answers(self, model, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Each prompt's greedy answer from the checkpoint ``model``, one request after the other."""
        return self.runner.run(self._answers(str(model), prompts, params), 600)

    async def _answers(self, model: str, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        if model not in self.engines:
            engine = TransformersEngine(model)
            await engine.start()
            self.engines[model] = engine
        engine = self.engines[model]
        return [
            (await engine.generate(GenerationRequest(f"g{i}", p, params))).output_ids for i, p in enumerate(prompts)
        ]


@pytest.mark.proves("transformers", "refresh")  # the probe engine passes the refresh to its inner engine
def test_a_run_refreshes_in_place_and_records_versions(tiny_model, new_policy, tmp_path):
    out, events, gate = tmp_path / "out.zarr", tmp_path / "events.log", tmp_path / "gate"
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    proc = popen_cli(
        *("run", "--prompts", prompts, "--store", out, "--model", tiny_model, "--refresh", "drain"),
        *("--engine", "daskgen.testing.probes:ProbeEngine", "--engine-arg", "inner=transformers"),
        *("--engine-arg", f"events_path={events}", *gate_args(gate, [HELD])),
        *("--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--max-prompt-tokens", "128"),
        *("--partition-size", "1", "--window", "1", "--n-workers", "1", "--no-progress"),
        env={"DASK_DASKGEN__POLICY__POLL_INTERVAL": "0.1s"},
    )
    try:
        wait_for_arrival(events, proc, HELD, timeout=300)
        daskgen.publish_policy(out, str(new_policy), 1)
        loading = wait_until(
            lambda: [w for w in read_worker_policies(store.locate(out)) if w.state == "loading"], proc, "refresh"
        )
        assert (loading[0].version, loading[0].asked) == (0, 1)  # the held row keeps the refresh waiting
        gate.touch()
        assert proc.wait(timeout=300) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    arrivals = [row_of(e.request_id) for e in read_events(events) if e.kind == "arrive"]
    after = set(arrivals[arrivals.index(HELD) + 1 :])
    made = store.GenerationStore.open(out)
    got = made.read_region(0, 6, made.layout.data_arrays())
    expected = {0: set(range(6)) - after, 1: after}
    assert after and {v: set(np.flatnonzero(got["policy_version"][:, 0] == v)) for v in (0, 1)} == expected
    np.testing.assert_array_equal(got["policy_version_end"], got["policy_version"])
    assert (got["version_changed_at"] == -1).all()
    digest = digest_number(read_versions(store.locate(out))[0].digest)  # checked against the loaded weights
    for name in ("policy_fingerprint", "policy_fingerprint_end"):
        np.testing.assert_array_equal(got[name], np.where(got["policy_version"] == 1, digest, 0))
    assert verify(out, progress=False).sound
    prompts_ids = [got["prompt_ids"][r, : got["prompt_length"][r]].tolist() for r in range(6)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    answers = {0: greedy(tiny_model, prompts_ids, params), 1: greedy(new_policy, prompts_ids, params)}
    for r in range(6):
        version = int(got["policy_version"][r, 0])
        assert got["response_ids"][r, 0, : got["response_length"][r, 0]].tolist() == answers[version][r], r
    assert answers[0] != answers[1]  # the probe tells the versions apart
    first = got["policy_version"][:, 0]
    record = made.attrs.runs[-1]["engines"]  # the dashboard's record of the run, from the workers' reports
    assert record["versions"] == {"version": [0, 1], "samples": [int((first == v).sum()) for v in (0, 1)],
                                  "continued": [0, 0]}  # fmt: skip
    (state,) = read_worker_policies(store.locate(out))
    assert (state.state, state.version, state.error) == ("running", 1, None)
    status = daskgen_status(out)
    assert f"  1: {new_policy}" in status and "samples per version (first token): " in status, status


def daskgen_status(out) -> str:
    from daskgen.analysis.summary import status_report

    return status_report(str(out))


def test_continue_carries_a_request_onto_the_new_weights(tiny_model, new_policy, tmp_path):
    layout = store.Layout(1, 1, 4, 4, 1, 0)
    out = tmp_path / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(layout), ["q0"])
    # n: the answer outlasts the refresh's staging (which runs while the engine generates) with a wide margin on a
    # loaded machine, so the abort finds the request in flight
    prompt, n = [1, 2, 3, 4, 5], 400
    params = SamplingParams(max_new_tokens=n, temperature=0.0, min_new_tokens=n)
    errors: list[str] = []

    async def scenario():
        engine = TransformersEngine(str(tiny_model))
        await engine.start()
        refresher = PolicyRefresher(store.locate(out), "continue", lambda: engine, "w0")
        await refresher.check(errors.append)
        daskgen.publish_policy(out, str(new_policy), 1)  # published now (hashing it takes a while), seen below
        running = asyncio.create_task(refresher.generate(engine, GenerationRequest("r", prompt, params), lambda: False))
        while not any(len(s.tokens) >= 4 for s in engine.sampler_table.sequences.values()):
            await asyncio.sleep(0.005)
        await refresher.check(errors.append)
        (loaded,) = read_worker_policies(store.locate(out))  # the refresh's record, once running on version 1
        result = await running
        empty = tmp_path / "not-a-checkpoint"
        empty.mkdir()
        daskgen.publish_policy(out, str(empty), 2)
        await refresher.check(errors.append)
        after = await refresher.generate(engine, GenerationRequest("s", prompt, params), lambda: False)
        await engine.shutdown()
        return result, after, refresher, loaded

    result, after, refresher, loaded = asyncio.run(scenario())
    (first, second) = result.meta["policy_versions"]
    k = second[0]
    assert first == (0, 0) and second[1] == 1 and 4 <= k < n and len(result.output_ids) == n
    assert (loaded.state, loaded.interrupted, loaded.interrupted_tokens) == ("running", 1, len(prompt) + k)
    rest = SamplingParams(max_new_tokens=n - k, temperature=0.0, min_new_tokens=n - k)
    with GreedyReference() as reference:
        assert result.output_ids[:k] == reference.answers(tiny_model, [prompt], params)[0][:k]
        assert result.output_ids[k:] == reference.answers(new_policy, [prompt + result.output_ids[:k]], rest)[0]
        assert after.output_ids == reference.answers(new_policy, [prompt], params)[0]  # still on version 1
    assert refresher.version == 1 and "loading policy version 2 failed" in errors[-1] and "RefreshError" in errors[-1]
    assert after.meta["policy_versions"] == [(0, 1)]
    assert read_worker_policies(store.locate(out))[0].state == "failed"
    write_worker_policy(store.locate(out), loaded)  # status shows it (the failed load of version 2 replaced it)
    assert f" to end); 1 requests continued, {len(prompt) + k:,} tokens to prefill again" in daskgen_status(out)


def test_a_version_announced_on_the_runs_cluster_loads_without_waiting_for_the_poll(tmp_path):
    """``daskgen policy publish --scheduler-address``: the run's worker, whose poll interval is 10 minutes, starts
    loading the version at once (its refresher is woken by the Dask event), and the run ends on it."""
    from tests.conftest import run_cli, runs_cluster
    from tests.probing import probe_args

    gates, step1, out = tmp_path / "gates", tmp_path / "step1", tmp_path / "out.zarr"
    gates.mkdir(), step1.mkdir()
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    location = store.locate(out)
    with runs_cluster(**{"daskgen.policy.poll-interval": "600s"}) as (cluster, _):
        proc = popen_cli(
            "run", "--prompts", prompts,
            *probe_args(tmp_path, out, "--engine-arg", f"gate_path={gates / '{row}'}", "--refresh", "drain"),
            *("--partition-size", "1", "--window", "1", "--no-progress"),
            *("--scheduler-address", cluster.scheduler_address),
        )  # fmt: skip
        try:
            wait_for_arrival(tmp_path / "events.log", proc, 0)  # row 0 is held at its gate
            wait_until(lambda: [w for w in read_worker_policies(location) if w.state == "running"], proc, "a look")
            published = run_cli(
                *("policy", "publish", out, step1, "--version", "1", "--scheduler-address", cluster.scheduler_address)
            )
            assert published.returncode == 0, published.stdout + published.stderr
            loading = wait_until(
                lambda: [w for w in read_worker_policies(location) if w.state == "loading"], proc, "the refresh", 60
            )
            assert (loading[0].version, loading[0].asked) == (0, 1)  # the held row keeps it waiting (drain)
            for row in range(3):
                (gates / str(row)).touch()
            assert proc.wait(timeout=120) == 0, proc.stdout.read()
        finally:
            if proc.poll() is None:
                proc.kill()
    (state,) = read_worker_policies(location)
    assert (state.state, state.version) == ("running", 1)
    assert (store.GenerationStore.open(out).read_region(0, 3, ("policy_version",))["policy_version"][1:] == 1).all()
