"""The loaded fingerprint of the lane engines (vLLM, in-process sglang, a managed sglang server): after a refresh,
what the engine holds is what was published.

Per engine (in process, and the ``openai`` engine with ``managed=true`` for the server), greedy, float32 (the
dtype of the tiny model's checkpoints): a worker's policy refresher brings the engine from the run's model to a
published checkpoint with other weights; the tensors the engine reads back from its own model
(:meth:`~daskgen.engines.base.Engine.loaded_fingerprint`) equal the published ones, every result generated after
the refresh carries the published version's digest (what the worker stores per sample as ``policy_fingerprint``),
and its tokens are the new checkpoint's greedy answer.  Which tensors each engine can compare is stated in
docs/async-rl.md: vLLM on a CPU the embeddings, norms and ``lm_head`` (it packs its linear layers' weights for its
kernels, emptying their parameters; the fused ``qkv_proj`` and ``gate_up_proj`` are never checkpoint names),
sglang every tensor (it maps the fused ones itself) but, for this model's ``head_dim``, q/k/v.
"""

from __future__ import annotations

import asyncio
from importlib.util import find_spec
from pathlib import Path

import pytest

import daskgen
from daskgen import store
from daskgen.engines import get_engine_class
from daskgen.engines.base import GenerationRequest, SamplingParams
from daskgen.store.fingerprint import digest_number, mismatched
from daskgen.store.policy import read_versions
from daskgen.worker.refresh import PolicyRefresher

_SGLANG = [pytest.mark.sglang, pytest.mark.skipif(find_spec("sglang") is None, reason="needs sglang (its lane)")]
_VLLM = [pytest.mark.vllm, pytest.mark.skipif(find_spec("vllm") is None, reason="needs vllm (its lane)")]
#: case -> (lane marks, engine args, parts of the names of the checkpoint tensors it compares)
ENGINES = {
    # on a CPU, vLLM packs its linear layers' weights for its kernels and empties their parameters
    "vllm": (
        _VLLM,
        {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True},
        ("embed_tokens", "norm", "lm_head"),
    ),
    # every tensor (it maps the fused ones itself) but q/k/v: the model's head_dim is not hidden_size / heads
    "sglang": (_SGLANG, {}, ("embed_tokens", "norm", "lm_head", "o_proj", "mlp.")),
    # a managed sglang server (the openai engine with managed=true): the same reads, over HTTP
    "openai": (
        _SGLANG,
        {"managed": True, "server_start_timeout_s": 600},
        ("embed_tokens", "norm", "lm_head", "o_proj", "mlp."),
    ),
}
CASES = [
    pytest.param(name, marks=[*marks, pytest.mark.proves(name, "policy_fingerprint"), pytest.mark.timeout(900)])
    for name, (marks, _, _) in ENGINES.items()
]


@pytest.mark.parametrize("engine_name", CASES)
def test_after_a_refresh_the_engine_holds_the_published_tensors(engine_name, tmp_path):
    """In process, sglang loads the staged tensors from host memory (no fallback to the folder was logged), and
    its start leaves the root logger's level and handlers as they were (sglang's launch reconfigures them); vLLM
    reloads from the copy it staged in ``daskgen.policy.stage-dir``, removed after; the managed server loads the
    published folder.  (``update_weights`` is watched, and runs as it is.)  A second version, published as a delta
    on the first, is rebuilt in the node's cache and loaded the same way, and holds its own published tensors."""
    import logging.handlers

    import dask.config

    from daskgen.models import build_tiny_model
    from tests.test_policy_refresh import greedy

    _, engine_args, compared = ENGINES[engine_name]
    base = build_tiny_model(tmp_path / "base", seed=0, head_dim=32)  # vLLM's CPU attention needs head_dim 32
    step1 = build_tiny_model(tmp_path / "step1", seed=1, head_dim=32)
    step2 = build_tiny_model(tmp_path / "step2", seed=2, head_dim=32)  # published as a delta on version 1
    out = tmp_path / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(store.Layout(1, 1, 4, 4, 1, 0)), ["q0"])
    location, errors = store.locate(out), []
    prompt, params = [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0)

    stage_dir, reloads = tmp_path / "shm", []
    stage_dir.mkdir()

    async def scenario():
        engine = get_engine_class(engine_name)(str(base), **engine_args)
        reload = engine.update_weights

        async def watched(path: str) -> None:
            reloads.append(path)
            await reload(path)

        engine.update_weights = watched
        await engine.start()
        try:
            refresher = PolicyRefresher(location, "drain", lambda: engine, "w0")
            await refresher.check(errors.append)
            daskgen.publish_policy(out, str(step1), 1)
            await refresher.check(errors.append)
            published = read_versions(location)[0]
            loaded = await engine.loaded_fingerprint(dict.fromkeys(published.tensors, "F32"))
            result = await refresher.generate(engine, GenerationRequest("r", prompt, params), lambda: False)
            daskgen.publish_policy(out, str(step2), 2, delta=True)  # rebuilt in the node's cache, then loaded
            await refresher.check(errors.append)
            delta = read_versions(location)[1]
            after = await refresher.generate(engine, GenerationRequest("s", prompt, params), lambda: False)
            held = await engine.loaded_fingerprint(dict.fromkeys(delta.tensors, "F32"))
            return published, loaded, result, (delta, held, after, refresher.version)
        finally:
            await engine.shutdown()

    logged, root = logging.handlers.BufferingHandler(capacity=1000), logging.getLogger()
    logging.getLogger("daskgen").addHandler(logged)
    level, handlers = root.level, list(root.handlers)
    try:
        settings = {"daskgen.policy.stage-dir": str(stage_dir), "daskgen.policy.cache-dir": str(tmp_path / "cache")}
        with dask.config.set(settings):
            published, loaded, result, (delta, held, after, version) = asyncio.run(scenario())
    finally:
        logging.getLogger("daskgen").removeHandler(logged)
    rebuilt = tmp_path / "cache"
    reloaded = {"vllm": [stage_dir, stage_dir], "sglang": [], "openai": [step1, rebuilt]}[engine_name]
    shown = [p.parent if engine_name == "vllm" else p for p in map(Path, reloads)]
    assert [rebuilt if rebuilt in p.parents else p for p in shown] == reloaded, reloads
    assert list(stage_dir.iterdir()) == [], "the staged copy is removed once loaded"
    assert (root.level, root.handlers) == (level, handlers), "the engine's start left the root logger as it was"
    assert errors == [] and version == 2 and delta.delta is not None and delta.base == 1
    expected = {n: f for n, f in published.tensors.items() if any(part in n for part in compared)}
    assert loaded.keys() == expected.keys(), sorted(set(loaded) ^ set(expected))
    assert mismatched(expected, loaded) == ([], len(expected))  # each the published float32 hash (listed first)
    assert all(expected[name].startswith(f + "|") for name, f in loaded.items())
    assert result.meta["policy_versions"] == [(0, 1)]
    assert result.meta["policy_fingerprints"] == {1: digest_number(published.digest)} != {1: 0}
    assert result.output_ids == greedy(step1, [prompt], params)[0]
    assert not [r.getMessage() for r in logged.buffer if "from memory" in r.getMessage()]
    # the delta version, rebuilt from version 1 and its delta, is what the engine holds and answers with
    expected = {n: f for n, f in delta.tensors.items() if any(part in n for part in compared)}
    assert held.keys() == expected.keys() and mismatched(expected, held) == ([], len(expected))
    assert after.meta["policy_fingerprints"] == {2: digest_number(delta.digest)}
    assert after.output_ids == greedy(step2, [prompt], params)[0] != result.output_ids
