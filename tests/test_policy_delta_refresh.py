"""Delta policy versions refresh running engines: rebuilt in the node's cache, checked, then loaded.

A ``daskgen run --refresh drain`` of the tiny model (the ``transformers`` engine behind the probe engine, which
holds chosen rows at gates): version 1 is published in full while row 1 is held, version 2 as a delta
(``daskgen policy publish --delta``) while row 3 is held.  Every sample equals the greedy answer of the version
it records, token for token, and carries that version's published digest; the worker rebuilt version 2 in the
cache folder set by ``daskgen.policy.cache-dir``, reading version 1's files and the delta from shared storage,
as its state record and ``daskgen status`` say, with the seconds its engine paused.  In process: a worker that
starts after three versions were published (one full, two deltas) rebuilds and serves the newest; a delta with
one value flipped (a labelled test double) is refused before the engine loads anything, and the engine goes on
serving the version it had.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import dask.config
import numpy as np
import pytest

import daskgen
from daskgen import store
from daskgen.engines.base import GenerationRequest, SamplingParams
from daskgen.engines.transformers import TransformersEngine
from daskgen.store.fingerprint import digest_number
from daskgen.store.policy import read_versions, read_worker_policies
from daskgen.store.policy_cache import cache_folder
from daskgen.worker.refresh import PolicyRefresher
from tests.conftest import popen_cli, run_cli, write_prompts
from tests.probing import wait_for_arrival, wait_until
from tests.test_policy_delta import flip_one_value
from tests.test_policy_refresh import daskgen_status, greedy

pytestmark = pytest.mark.timeout(600)

NEW_TOKENS = 8


def mixed(base: Path, other: Path, out: Path, part: str) -> Path:
    """A copy of checkpoint ``base`` whose tensors with ``part`` in their name come from ``other``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    tensors, donor = load_file(str(base / "model.safetensors")), load_file(str(other / "model.safetensors"))
    save_file({n: donor[n] if part in n else t for n, t in tensors.items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Checkpoints 1 (seed 1), 2 (1 with seed 2's MLPs) and 3 (2 with seed 3's attention)."""
    from daskgen.models import build_tiny_model

    root = tmp_path_factory.mktemp("delta-policies")
    one, two, three = (build_tiny_model(root / f"seed{s}", seed=s) for s in (1, 2, 3))
    v2 = mixed(one, two, root / "v2", ".mlp.")
    return one, v2, mixed(v2, three, root / "v3", ".self_attn.")


@pytest.mark.proves("transformers", "refresh")
def test_a_run_serves_delta_versions_with_their_published_fingerprints(tiny_model, versions, tmp_path):
    out, events, gates, cache = tmp_path / "out.zarr", tmp_path / "events.log", tmp_path / "gates", tmp_path / "cache"
    gates.mkdir()
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    proc = popen_cli(
        *("run", "--prompts", prompts, "--store", out, "--model", tiny_model, "--refresh", "drain"),
        *("--engine", "daskgen.testing.probes:ProbeEngine", "--engine-arg", "inner=transformers"),
        *("--engine-arg", f"events_path={events}", "--engine-arg", f"gate_path={gates / '{row}'}"),
        *("--engine-arg", "gate_rows=[1, 3]"),
        *("--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--max-prompt-tokens", "128"),
        *("--partition-size", "1", "--window", "1", "--n-workers", "1", "--no-progress"),
        env={"DASK_DASKGEN__POLICY__POLL_INTERVAL": "0.1s", "DASK_DASKGEN__POLICY__CACHE_DIR": str(cache)},
    )
    location = store.locate(out)

    def loading(version: int):
        return [w for w in read_worker_policies(location) if w.state == "loading" and w.asked == version]

    try:
        for row, version in ((1, 1), (3, 2)):
            wait_for_arrival(events, proc, row, timeout=300)
            if version == 1:
                daskgen.publish_policy(out, str(versions[0]), 1)
            else:
                published = run_cli("policy", "publish", out, versions[1], "--version", "2", "--delta")
                assert published.returncode == 0, published.stdout + published.stderr
                assert "as a delta on version 1 (daskgen.policy.deltas/v2-on-v1-" in published.stdout
            wait_until(lambda v=version: loading(v), proc, f"the refresh to version {version}")
            (gates / str(row)).touch()
        assert proc.wait(timeout=300) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    made = store.GenerationStore.open(out)
    got = made.read_region(0, 6, made.layout.data_arrays())
    first = got["policy_version"][:, 0]
    assert set(first.tolist()) == {0, 1, 2} and (got["version_changed_at"] == -1).all()
    record = read_versions(location)
    assert record[1].delta is not None and record[1].base == 1
    digests = {0: 0, **{v.version: digest_number(v.digest) for v in record}}
    for name in ("policy_fingerprint", "policy_fingerprint_end"):
        np.testing.assert_array_equal(got[name][:, 0], [digests[int(v)] for v in first])
    prompt_ids = [got["prompt_ids"][r, : got["prompt_length"][r]].tolist() for r in range(6)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    answers = {v: greedy(m, prompt_ids, params) for v, m in ((0, tiny_model), (1, versions[0]), (2, versions[1]))}
    assert answers[1] != answers[2]  # the delta changed what the model answers
    for r in range(6):
        assert got["response_ids"][r, 0, : got["response_length"][r, 0]].tolist() == answers[int(first[r])][r], r
    with dask.config.set({"daskgen.policy.cache-dir": str(cache)}):
        rebuilt = [p.name for p in cache_folder(location).glob("v*")]
    assert rebuilt == [f"v2-{record[1].digest[:16]}"]  # the worker's rebuild, checked and renamed into place
    (state,) = read_worker_policies(location)
    assert (state.state, state.version, state.error) == ("running", 2, None)
    base_files = sum(f.stat().st_size for f in Path(versions[0]).iterdir() if f.is_file())
    assert state.shared_bytes == base_files + dict(location.files("daskgen.policy.deltas"))[record[1].delta]
    assert 0 < state.load_seconds < state.paused_seconds and 0 < state.check_seconds < state.paused_seconds
    assert 0 <= state.step_wait_seconds < state.load_seconds  # the wait for the step in progress, then the copy
    status = daskgen_status(out)
    assert f"; its refresh read {state.shared_bytes:,} bytes from shared storage, paused the engine " in status
    assert f", of it {state.step_wait_seconds:.3g} s for the step in progress to end)" in status, status
    assert f"  2: {versions[1]} (published " in status, status
    assert f"tensors, a delta on version 1 ({record[1].delta})" in status, status


def test_a_late_worker_serves_the_newest_delta_and_refuses_a_corrupt_one(tiny_model, versions, tmp_path):
    out = tmp_path / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(store.Layout(1, 1, 4, 4, 1, 0)), ["q0"])
    location = store.locate(out)
    one, v2, v3 = versions
    daskgen.publish_policy(out, str(one), 1)
    daskgen.publish_policy(out, str(v2), 2, delta=True)
    publishers = shutil.copytree(v3, tmp_path / "publishers-v3")
    entry3 = daskgen.publish_policy(out, str(publishers), 3, delta=True)
    shutil.rmtree(publishers)  # the workers never read the folder of a delta version
    prompt, errors = [1, 2, 3, 4, 5], []
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)

    async def scenario():
        engine = TransformersEngine(str(tiny_model))
        await engine.start()
        refresher = PolicyRefresher(location, "drain", lambda: engine, "w0")
        try:
            await refresher.check(errors.append)  # starts late: version 3, rebuilt from version 1 and 2 deltas
            on3 = await refresher.generate(engine, GenerationRequest("a", prompt, params), lambda: False)
            corrupt = daskgen.publish_policy(out, str(v2), 4, delta=True)  # version 2's weights, a delta on 3
            flip_one_value(location, corrupt)
            await refresher.check(errors.append)
            after = await refresher.generate(engine, GenerationRequest("b", prompt, params), lambda: False)
            return on3, after, refresher
        finally:
            await engine.shutdown()

    with dask.config.set({"daskgen.policy.cache-dir": str(tmp_path / "cache")}):
        on3, after, refresher = asyncio.run(scenario())
        cached = sorted(p.name for p in cache_folder(location).glob("v*"))
    assert cached == [f"v3-{entry3.digest[:16]}"]  # version 4 never renamed into the cache
    expected = greedy(v3, [prompt], params)[0]
    assert expected != greedy(v2, [prompt], params)[0]  # version 4 would answer otherwise
    for result in (on3, after):
        assert result.output_ids == expected
        assert result.meta["policy_versions"] == [(0, 3)]
        assert result.meta["policy_fingerprints"] == {3: digest_number(entry3.digest)}
    assert refresher.version == 3 and 4 not in refresher.fingerprints and refresher.refused == {4}
    assert "loading policy version 4 failed: PolicyDeltaError: the weights rebuilt for delta version 4" in errors[-1]
    assert "refused before loading" in refresher.status()["refresh_error"]
    (state,) = read_worker_policies(location)
    assert (state.state, state.version, state.asked) == ("failed", 3, 4)
