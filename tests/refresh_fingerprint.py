"""The loaded-fingerprint check of the lane engines (vLLM, in-process sglang, a managed sglang server), run on each
suite's shared engine: after a refresh, what the engine holds is what was published.

Greedy, float32 (the dtype of the tiny model's checkpoints): a worker's policy refresher brings the engine from the
suite's model to a published checkpoint with other weights (the same architecture, another seed); the tensors the
engine reads back from its own model (:meth:`~daskgen.engines.base.Engine.loaded_fingerprint`) equal the published
ones, every result generated after the refresh carries the published version's digest (what the worker stores per
sample as ``policy_fingerprint``), and its tokens are the new checkpoint's greedy answer.  A second version,
published as a delta on the first, is rebuilt in the node's cache and loaded the same way, and holds its own
published tensors.  The engine then loads the suite's model again, so the suite's other checks see it unchanged.
Which tensors each engine can compare is stated in docs/async-rl.md.
"""

from __future__ import annotations

import asyncio
import logging.handlers
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import daskgen
from daskgen import store
from daskgen.engines.base import Engine, GenerationRequest, SamplingParams
from daskgen.store.fingerprint import digest_number, mismatched
from daskgen.store.policy import read_versions
from daskgen.worker.refresh import PolicyRefresher

#: The parts of the checkpoint names each engine compares, on the tiny model (``head_dim`` = hidden size / heads).
#: vLLM on a CPU packs its linear layers' weights for its kernels, emptying their parameters, and never holds the
#: fused ``qkv_proj`` and ``gate_up_proj`` under checkpoint names; sglang maps the fused ones itself.
COMPARED = {
    "vllm": ("embed_tokens", "norm", "lm_head"),
    "sglang": ("embed_tokens", "norm", "lm_head", "o_proj", "mlp.", "q_proj", "k_proj", "v_proj"),
}

PROMPT, PARAMS = [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0)


@dataclass
class Refreshed:
    """What the scenario saw: the two published versions, what the engine held under each, and its answers."""

    published: Any
    loaded: dict[str, str]
    result: Any
    delta: Any
    held: dict[str, str]
    after: Any
    version: int


def check_a_refresh_holds_the_published_tensors(
    run: Callable[[Coroutine[Any, Any, Any], float], Any],
    engine: Engine,
    base: str,
    tmp_path: Path,
    *,
    compared: tuple[str, ...],
    reloads: Callable[[Path, Path, Path], list[Path]],
    head_dim: int | None = None,
) -> None:
    """Refresh ``engine`` (started on ``base``, driven through ``run(coro, timeout)``) to two published versions and
    check what it holds and answers; ``reloads(stage_dir, step1, rebuilt)`` are the folders its ``update_weights``
    is expected to read (in-process sglang loads from host memory: none)."""
    import dask.config

    from daskgen.models import build_tiny_model
    from tests.test_policy_refresh import greedy

    step1 = build_tiny_model(tmp_path / "step1", seed=2, head_dim=head_dim)  # no suite model has seed 2 or 3
    step2 = build_tiny_model(tmp_path / "step2", seed=3, head_dim=head_dim)  # published as a delta on version 1
    stage_dir, rebuilt = tmp_path / "shm", tmp_path / "cache"
    stage_dir.mkdir()
    logged = logging.handlers.BufferingHandler(capacity=1000)
    logging.getLogger("daskgen").addHandler(logged)
    calls: list[str] = []
    settings = {"daskgen.policy.stage-dir": str(stage_dir), "daskgen.policy.cache-dir": str(rebuilt)}
    try:
        with dask.config.set(settings):
            seen = run(_scenario(engine, base, (step1, step2), tmp_path / "out.zarr", calls), 900)
    finally:
        logging.getLogger("daskgen").removeHandler(logged)
    loads = [Path(p) for p in calls[:-1]]  # the last is the suite's model, loaded back
    shown = [p.parent if p.parent == stage_dir else p for p in loads]
    assert [rebuilt if rebuilt in p.parents else p for p in shown] == reloads(stage_dir, step1, rebuilt), calls
    assert list(stage_dir.iterdir()) == [], "the staged copy is removed once loaded"
    assert seen.version == 2 and seen.delta.delta is not None and seen.delta.base == 1
    expected = {n: f for n, f in seen.published.tensors.items() if any(part in n for part in compared)}
    assert seen.loaded.keys() == expected.keys(), sorted(set(seen.loaded) ^ set(expected))
    assert mismatched(expected, seen.loaded) == ([], len(expected))  # each the published float32 hash (listed first)
    assert all(expected[name].startswith(f + "|") for name, f in seen.loaded.items())
    assert seen.result.meta["policy_versions"] == [(0, 1)]
    assert seen.result.meta["policy_fingerprints"] == {1: digest_number(seen.published.digest)} != {1: 0}
    assert seen.result.output_ids == greedy(step1, [PROMPT], PARAMS)[0]
    assert not [r.getMessage() for r in logged.buffer if "from memory" in r.getMessage()]
    # the delta version, rebuilt from version 1 and its delta, is what the engine holds and answers with
    expected = {n: f for n, f in seen.delta.tensors.items() if any(part in n for part in compared)}
    assert seen.held.keys() == expected.keys() and mismatched(expected, seen.held) == ([], len(expected))
    assert seen.after.meta["policy_fingerprints"] == {2: digest_number(seen.delta.digest)}
    assert seen.after.output_ids == greedy(step2, [PROMPT], PARAMS)[0] != seen.result.output_ids


async def _scenario(engine: Engine, base: str, steps: tuple[Path, Path], out: Path, calls: list[str]) -> Refreshed:
    """The refresher's steps on ``engine`` with a new store ``out``: ``steps`` published as version 1 (in full) and
    version 2 (a delta), then ``base`` loaded again; each folder ``update_weights`` is given is appended to
    ``calls``."""
    store.GenerationStore.create(out, store.StoreAttrs(store.Layout(1, 1, 4, 4, 1, 0)), ["q0"])
    location, errors = store.locate(out), []
    reload = engine.update_weights

    async def watched(path: str) -> None:
        calls.append(path)
        await reload(path)

    engine.update_weights = watched  # type: ignore[method-assign]
    try:
        refresher = PolicyRefresher(location, "drain", lambda: engine, "w0")
        await refresher.check(errors.append)
        await asyncio.to_thread(daskgen.publish_policy, out, str(steps[0]), 1)
        await refresher.check(errors.append)
        published = read_versions(location)[0]
        loaded = await engine.loaded_fingerprint(dict.fromkeys(published.tensors, "F32"))
        result = await refresher.generate(engine, GenerationRequest("r", PROMPT, PARAMS), lambda: False)
        await asyncio.to_thread(daskgen.publish_policy, out, str(steps[1]), 2, delta=True)
        await refresher.check(errors.append)
        delta = read_versions(location)[1]
        after = await refresher.generate(engine, GenerationRequest("s", PROMPT, PARAMS), lambda: False)
        held = await engine.loaded_fingerprint(dict.fromkeys(delta.tensors, "F32"))
        assert errors == [], errors
        return Refreshed(published, loaded, result, delta, held, after, refresher.version)
    finally:
        try:
            await engine.update_weights(base)  # the suite's model again, for the suite's other checks
        finally:
            del engine.update_weights
