"""The ``transformers`` engine's staged refresh (:mod:`daskgen.engines.transformers.weights`).

A checkpoint is staged (read into host memory in the model's dtypes and fingerprinted) while the engine generates;
the load copies the staged tensors in place, and the check proves the model holds the staged bytes instead of
hashing them.  The proof compares bytes: a tensor holding ``-0.0`` where the checkpoint holds ``0.0`` is caught
(their values compare equal), and a tensor that is not proved is hashed as it is held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from pathlib import Path

import pytest

from daskgen.engines.fingerprint import fingerprint_tensors
from daskgen.engines.transformers import TransformersEngine
from daskgen.engines.transformers.weights import checkpoint_tensors, held_fingerprint, stage
from daskgen.errors import RefreshError
from daskgen.store.fingerprint import checkpoint_fingerprint, dtype_of, mismatched

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A checkpoint of the tiny model's architecture with other weights (seed 1), saved in bfloat16."""
    import torch
    from transformers import AutoModelForCausalLM

    from daskgen.models import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("staged") / "step1", seed=1)
    model = AutoModelForCausalLM.from_pretrained(str(folder)).to(torch.bfloat16)
    model.save_pretrained(str(folder))
    return folder


def test_a_staged_load_holds_the_published_fingerprint_proved_without_hashing(tiny_model, other):
    published = checkpoint_fingerprint(other)
    dtypes = {name: dtype_of(f) for name, f in published.tensors.items()}

    async def refreshed():
        engine = TransformersEngine(str(tiny_model))
        await engine.start()
        try:
            staged = await engine.stage_weights(str(other))
            before = await engine.loaded_fingerprint(dtypes)  # nothing applied: hashed as held
            started = time.monotonic()
            waited = await engine.apply_staged(staged)
            took = time.monotonic() - started
            held = await engine.loaded_fingerprint(dtypes)
            hashed = fingerprint_tensors(checkpoint_tensors(engine._model), dtypes)
            return staged, before, held, hashed, (waited, took)
        finally:
            await engine.shutdown()

    staged, before, held, hashed, (waited, took) = asyncio.run(refreshed())
    assert isinstance(waited, float) and 0 <= waited <= took  # the wait for the step in progress, part of the load
    assert set(dtypes.values()) == {"BF16"} and {t.dtype for t in staged.tensors.values()} == {_float32()}
    assert staged.fingerprint == held == hashed  # the model's float32 tensors, hashed in the published bfloat16
    assert mismatched(published.tensors, held) == ([], len(published.tensors))
    assert mismatched(published.tensors, before)[0]  # the engine's own weights before the load differ


def test_the_proof_compares_bytes_and_hashes_what_it_cannot_prove(tiny_model):
    """A LABELLED staged checkpoint whose fingerprints are markers shows which tensors were proved (marker) and
    which were hashed."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    staged = stage(model, str(tiny_model))
    marked = dataclasses.replace(staged, fingerprint=dict.fromkeys(staged.fingerprint, "proved"))
    params = checkpoint_tensors(model)
    name, nan = "model.norm.weight", "model.layers.0.input_layernorm.weight"
    with torch.no_grad():
        for t in (params[name], staged.tensors[name]):
            t[0] = 0.0
        params[name][0] = -0.0  # equal as values, not as bytes
        for t in (params[nan], staged.tensors[nan]):
            t[1] = float("nan")  # the same bytes: proved
    held = held_fingerprint(model, marked, staged.dtypes)
    assert held[name] != "proved" and held[name] == fingerprint_tensors(params, {name: "F32"})[name]
    assert {n for n, f in held.items() if f != "proved"} == {name}
    assert held_fingerprint(model, marked, {**staged.dtypes, nan: "BF16"})[nan] != "proved"  # another dtype: hashed


def test_staging_copies_the_files_and_refuses_a_checkpoint_that_does_not_fit(tiny_model, tmp_path):
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    name = "model.norm.weight"
    shutil.copy(tiny_model / "model.safetensors", folder / "model.safetensors")
    staged = stage(model, str(folder))
    kept = staged.tensors[name].clone()
    save_file({name: torch.full_like(kept, 7.0)}, str(folder / "model.safetensors"))  # the file replaced
    assert torch.equal(staged.tensors[name], kept)  # the staged tensors are the process's own copy
    save_file({name: torch.zeros(3)}, str(folder / "model.safetensors"))
    with pytest.raises(RefreshError, match="does not fit the running model"):
        stage(model, str(folder))


def test_the_other_engines_stage_nothing_and_load_the_folder_in_the_pause(tmp_path):
    """``openai`` and ``simulated`` keep the defaults: ``stage_weights`` returns the folder and ``apply_staged`` is
    ``update_weights`` of it (run on the simulated engine).  ``transformers`` and the in-process ``sglang`` stage the
    tensors in host memory (sglang's: ``tests/refresh_fingerprint.py``, run in the sglang lane), ``vllm`` a copy of
    the folder (below)."""
    from daskgen.engines.base import Engine
    from daskgen.engines.openai import OpenAIEngine
    from daskgen.engines.sglang import SGLangEngine
    from daskgen.engines.simulated import SimulatedEngine

    assert SGLangEngine.stage_weights is not Engine.stage_weights
    (tmp_path / "bin").mkdir()  # weights in another format (or no folder): sglang loads them from disk in the pause
    assert asyncio.run(SGLangEngine("/m").stage_weights(str(tmp_path / "bin"))) == str(tmp_path / "bin")
    for cls in (OpenAIEngine, SimulatedEngine):
        assert (cls.stage_weights, cls.apply_staged) == (Engine.stage_weights, Engine.apply_staged), cls
    loaded = []

    class Recording(SimulatedEngine):  # TEST DOUBLE: records the folder update_weights is given
        async def update_weights(self, path: str) -> None:
            loaded.append(path)

    async def refreshed():
        engine = Recording("sim", time_scale=0)
        await engine.start()
        try:
            staged = await engine.stage_weights(str(tmp_path))
            assert await engine.apply_staged(staged) is None  # the default cannot tell its wait apart
            return staged
        finally:
            await engine.shutdown()

    assert asyncio.run(refreshed()) == str(tmp_path) and loaded == [str(tmp_path)]


def test_vllm_stages_a_copy_of_the_folder_in_host_memory_and_removes_it_once_loaded(tiny_model, tmp_path):
    """``vllm`` copies the version's folder into ``daskgen.policy.stage-dir`` while it generates and reloads from the
    copy in the pause, which is removed after, loaded or not; a folder that does not fit is loaded as it lies.  The
    reload itself is a test double here; the vllm lane's refresh tests load through the real one
    (``tests/refresh_fingerprint.py``, run on its conformance suite's engine)."""
    import dask.config

    from daskgen.engines.staged_folder import PREFIX, StagedFolder
    from daskgen.engines.vllm import VLLMEngine

    loaded: list[tuple[str, list[str]]] = []
    shm = tmp_path / "shm"
    shm.mkdir()

    class Recording(VLLMEngine):  # TEST DOUBLE: records what the reload is given (and what it would read)
        async def update_weights(self, path: str) -> None:
            loaded.append((path, sorted(f.name for f in Path(path).iterdir())))
            if "fail" in path:
                raise RefreshError(f"vLLM could not load policy checkpoint {path!r}")

    source = sorted(f.name for f in tiny_model.iterdir() if f.is_file())
    orphan = shm / f"{PREFIX}999999999-x"  # a staging process that is gone (no such pid)
    orphan.mkdir()
    with dask.config.set({"daskgen.policy.stage-dir": str(shm)}):
        engine = Recording(str(tiny_model))
        staged = asyncio.run(engine.stage_weights(str(tiny_model)))
        assert isinstance(staged, StagedFolder) and Path(staged.path).parent == shm and not orphan.exists()
        for name in source:
            assert (Path(staged.path) / name).read_bytes() == (tiny_model / name).read_bytes()
        asyncio.run(engine.apply_staged(staged))
        assert loaded == [(staged.path, source)] and not Path(staged.path).exists()

        failing = StagedFolder(str(tiny_model), str(shm / f"{PREFIX}fail"))
        shutil.copytree(tiny_model, failing.path)
        with pytest.raises(RefreshError, match=f"the copy of '{tiny_model}' in host memory"):
            asyncio.run(engine.apply_staged(failing))
        assert not Path(failing.path).exists()

        with dask.config.set({"daskgen.policy.stage-reserve": 1e12}):  # no file system keeps that much free
            assert asyncio.run(engine.stage_weights(str(tiny_model))) == str(tiny_model)
    with dask.config.set({"daskgen.policy.stage-dir": None}):
        assert asyncio.run(engine.stage_weights(str(tiny_model))) == str(tiny_model)
    assert list(shm.iterdir()) == []


def _float32():
    import torch

    return torch.float32
