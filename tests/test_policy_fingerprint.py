"""Fingerprints of policy versions: recorded when a version is published, checked where the tokens are made.

The publisher hashes every tensor of the checkpoint's safetensors files; the ``transformers`` engine hashes the
tensors its model holds, and the two agree tensor for tensor (float32 and bfloat16).  A labelled test double of
the engine's staged load (:class:`StaleLoadEngine`: it copies the staged checkpoint in, then silently puts one
tensor's old values back) is caught by the worker's refresher, whose check proves the engine holds the staged
bytes instead of hashing them: the version is refused, the engine loads its previous version
again and generates exactly what it did before, and the refusal shows in the refresher's status (the dashboard's
worker data), in the worker's record and in ``daskgen status``.  A good load is accepted and its results carry
the version's digest.
"""

from __future__ import annotations

import asyncio

import pytest

import daskgen
from daskgen import store
from daskgen.engines.base import GenerationRequest, SamplingParams
from daskgen.engines.fingerprint import fingerprint_tensors
from daskgen.engines.simulated import SimulatedEngine
from daskgen.engines.transformers import TransformersEngine
from daskgen.store.fingerprint import checkpoint_fingerprint, digest_number, mismatched, version_digest
from daskgen.store.policy import read_versions, read_worker_policies
from daskgen.worker.refresh import PolicyRefresher

pytestmark = pytest.mark.timeout(300)

#: The tensor the test double's loader leaves stale.
STALE = "model.layers.1.mlp.down_proj.weight"


class StaleLoadEngine(TransformersEngine):
    """TEST DOUBLE of the transformers engine's staged load: it copies a staged checkpoint in as the engine does,
    then silently puts the values :data:`STALE` held before back (a partial load that raises nothing)."""

    applied = 0

    async def apply_staged(self, staged) -> None:
        import torch

        from daskgen.engines.transformers.weights import checkpoint_tensors

        tensor = checkpoint_tensors(self._model)[STALE]
        before = tensor.detach().clone()
        await super().apply_staged(staged)
        with torch.no_grad():
            tensor.copy_(before)
        self.applied += 1


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """Two checkpoints of the tiny model's architecture with other weights (seeds 1 and 2)."""
    from daskgen.models import build_tiny_model

    root = tmp_path_factory.mktemp("policies")
    return build_tiny_model(root / "step1", seed=1), build_tiny_model(root / "step2", seed=2)


def test_the_published_fingerprint_equals_the_loaded_one_tensor_for_tensor(tiny_model, tmp_path):
    import torch
    from safetensors.torch import save_file

    published = checkpoint_fingerprint(tiny_model)
    assert published is not None and published.digest == version_digest(published.tensors)

    async def loaded():
        engine = TransformersEngine(str(tiny_model))
        await engine.start()
        try:
            return await engine.loaded_fingerprint({**dict.fromkeys(published.tensors, "F32"), "not.a.tensor": "F32"})
        finally:
            await engine.shutdown()

    held = asyncio.run(loaded())
    assert held.keys() == published.tensors.keys()  # every tensor, and no name the model lacks
    assert mismatched(published.tensors, held) == ([], len(held))
    assert all(published.tensors[name].startswith(f + "|") for name, f in held.items())  # float32 first
    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4)}
    (tmp_path / "bf16").mkdir()
    save_file(tensors, str(tmp_path / "bf16" / "model.safetensors"))
    found = checkpoint_fingerprint(tmp_path / "bf16")
    assert found is not None
    assert mismatched(found.tensors, fingerprint_tensors(tensors, {"a": "BF16", "b": "I64", "c": "F32"})) == ([], 3)
    widened = fingerprint_tensors({"a": tensors["a"].float()}, {"a": "BF16"})  # held in float32: converted back
    assert widened == {"a": found.tensors["a"]}
    changed = {**tensors, "a": tensors["a"].clone()}
    changed["a"][1, 2] += 1
    assert fingerprint_tensors(changed, {"a": "BF16"})["a"] != found.tensors["a"]  # one value changed: another hash
    narrowed = fingerprint_tensors({"c": tensors["c"].to(torch.bfloat16)}, {"c": "F32"})  # held with fewer bits
    assert narrowed["c"].startswith("BF16:") and narrowed["c"] in found.tensors["c"].split("|")


def test_publishing_records_every_tensors_fingerprint_and_the_versions_digest(tiny_model, tmp_path):
    out = tmp_path / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(store.Layout(1, 1, 4, 4, 1, 0)), ["q0"])
    (tmp_path / "no-weights").mkdir()
    entry = daskgen.publish_policy(out, str(tiny_model), 1)
    daskgen.publish_policy(out, str(tmp_path / "no-weights"), 2)
    first, second = read_versions(store.locate(out))
    expected = checkpoint_fingerprint(tiny_model)
    assert first == entry and (first.digest, first.tensors) == (expected.digest, expected.tensors)
    assert len(first.tensors) >= 20 and digest_number(first.digest) != 0
    assert (second.digest, second.tensors) == (None, None)  # nothing to fingerprint: loads unchecked


@pytest.mark.proves("transformers", "policy_fingerprint")
def test_a_load_that_keeps_a_stale_tensor_is_refused_and_the_old_version_kept(tiny_model, policies, tmp_path):
    out = tmp_path / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(store.Layout(1, 1, 4, 4, 1, 0)), ["q0"])
    location, errors = store.locate(out), []
    prompt, params = [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=12, temperature=0.0)

    async def answer(engine, refresher, request_id):
        return await refresher.generate(engine, GenerationRequest(request_id, prompt, params), lambda: False)

    async def scenario():
        stale, good = StaleLoadEngine(str(tiny_model)), TransformersEngine(str(tiny_model))
        await stale.start()
        await good.start()
        try:
            refresher = PolicyRefresher(location, "drain", lambda: stale, "w0")
            await refresher.check(errors.append)
            before = await answer(stale, refresher, "before")
            daskgen.publish_policy(out, str(policies[0]), 1)
            await refresher.check(errors.append)
            after = await answer(stale, refresher, "after")
            refused = (refresher.version, refresher.status(), read_worker_policies(location))
            healthy = PolicyRefresher(location, "drain", lambda: good, "w1")
            await healthy.check(errors.append)
            loaded = await answer(good, healthy, "loaded")
            return before, after, refused, loaded, healthy.status(), stale.applied
        finally:
            await stale.shutdown()
            await good.shutdown()

    before, after, (version, status, states), loaded, healthy, applied = asyncio.run(scenario())
    assert applied == 1  # the refresher took the staged path
    assert version == 0 and after.meta["policy_versions"] == [(0, 0)] and after.meta["policy_fingerprints"] == {0: 0}
    assert after.output_ids == before.output_ids  # the previous version was loaded again, every tensor of it
    why = f"differ from its published fingerprint in 1 of {len(read_versions(location)[0].tensors)} tensors ({STALE})"
    assert len(errors) == 1 and why in errors[0] and "refused, version 0 loaded again" in errors[0], errors
    assert status["refresh_error"] == errors[0] and status["policy_fingerprint"] == 0  # the dashboard's worker data
    (state,) = [s for s in states if s.worker == "w0"]
    assert (state.state, state.version, state.asked, state.error) == ("failed", 0, 1, errors[0])
    from daskgen.analysis.summary import status_report

    assert f"worker w0: version 0, loading version 1 failed: {errors[0]}" in status_report(str(out))
    digest = digest_number(read_versions(location)[0].digest)
    assert loaded.meta["policy_versions"] == [(0, 1)] and loaded.meta["policy_fingerprints"] == {1: digest}
    assert healthy["policy_fingerprint"] == digest and healthy["refresh_error"] is None
    (good,) = [s for s in read_worker_policies(location) if s.worker == "w1"]
    assert good.state == "running" and good.stage_seconds > 0 and good.load_seconds < good.paused_seconds
    assert loaded.output_ids != before.output_ids  # the accepted version generates with its own weights


def test_verify_names_a_sample_whose_fingerprint_is_not_its_versions_digest(tiny_model, tmp_path):
    """A finished store whose samples claim version 1: the ones with its digest (or 0: unchecked) are sound, one
    labelled with other weights' fingerprint is a problem naming its row, array and version."""
    from daskgen.analysis.summary import status_report
    from daskgen.store.tools.verify import verify
    from tests.conftest import run_cli, simulated_run, write_prompts

    out = tmp_path / "out.zarr"
    res = run_cli("run", "--prompts", write_prompts(tmp_path / "p.jsonl", 8), "--store", out, *simulated_run())
    assert res.returncode == 0, res.stdout + res.stderr
    entry = daskgen.publish_policy(out, str(tiny_model), 1)
    assert f", fingerprint {entry.digest} of {len(entry.tensors)} tensors" in status_report(str(out))
    made, digest = store.GenerationStore.open(out), digest_number(entry.digest)
    region = made.read_region(0, 4, made.layout.data_arrays())
    region["policy_version"][:] = region["policy_version_end"][:] = 1
    region["policy_fingerprint"][:] = region["policy_fingerprint_end"][:] = digest
    region["policy_fingerprint"][3, 1] = 0  # unchecked: not a problem
    region["policy_fingerprint_end"][2, 0] = digest ^ 1
    made.write_region(0, region)
    report = verify(out, progress=False)
    (problem,) = report.problems
    assert (problem.kind, problem.start, problem.stop) == ("invariant", 2, 3)
    assert problem.detail == f"policy_fingerprint_end differs from version 1's published digest {digest}"
    region["policy_fingerprint_end"][2, 0] = digest
    made.write_region(0, region)
    assert verify(out, progress=False).sound


class NothingComparableEngine(SimulatedEngine):
    """TEST DOUBLE: a simulated engine that claims ``policy_fingerprint`` but holds no checkpoint tensor by name."""

    features = SimulatedEngine.features | {"policy_fingerprint"}

    async def loaded_fingerprint(self, dtypes: dict[str, str]) -> dict[str, str]:
        return {}


def test_an_engine_without_the_feature_loads_unchecked_and_one_with_nothing_to_compare_is_refused(tiny_model, tmp_path):
    out = tmp_path / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(store.Layout(1, 1, 4, 4, 1, 0)), ["q0"])
    location, errors = store.locate(out), []
    request = GenerationRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.0))

    async def scenario():
        plain, claiming = SimulatedEngine("sim", time_scale=0), NothingComparableEngine("sim", time_scale=0)
        await plain.start()
        await claiming.start()
        try:
            unchecked = PolicyRefresher(location, "drain", lambda: plain, "w0")
            refused = PolicyRefresher(location, "drain", lambda: claiming, "w1")
            daskgen.publish_policy(out, str(tiny_model), 1)
            await unchecked.check(errors.append)
            await refused.check(errors.append)
            result = await unchecked.generate(plain, request, lambda: False)
            return result, unchecked.version, refused.version
        finally:
            await plain.shutdown()
            await claiming.shutdown()

    result, unchecked_version, refused_version = asyncio.run(scenario())
    assert unchecked_version == 1 and result.meta["policy_fingerprints"] == {1: 0}  # loaded, labelled unchecked
    assert refused_version == 0 and len(errors) == 1
    assert "the engine holds none of version 1's" in errors[0] and "nothing to check the load against" in errors[0]


def test_vllm_checks_through_its_worker_extension_unless_the_run_sets_another():
    from daskgen.engines.vllm import VLLMEngine
    from daskgen.engines.vllm.fingerprint import EXTENSION, with_extension

    assert with_extension({"dtype": "float32"})["worker_extension_cls"] == EXTENSION
    assert with_extension({"worker_extension_cls": "mine.Ext"})["worker_extension_cls"] == "mine.Ext"
    assert "policy_fingerprint" in VLLMEngine.features_with({})
    assert "policy_fingerprint" not in VLLMEngine.features_with({"worker_extension_cls": "mine.Ext"})  # unchecked


@pytest.mark.parametrize("held", ["bfloat16", "float16"])
def test_a_float32_checkpoint_served_in_fewer_bits_is_checked_against_its_cast(tmp_path, held):
    """An engine serving a float32 checkpoint in bfloat16 or float16 holds the published values cast (round to
    nearest even): that matches; one changed value does not."""
    import torch
    from safetensors.torch import save_file

    from daskgen.engines.fingerprint import fingerprint_tensor
    from daskgen.store.fingerprint import dtype_of

    generator = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(64, 33, generator=generator), "b": torch.tensor([1.0, 1e-8, -3.5, 65504.0])}
    save_file(weights, str(tmp_path / "model.safetensors"))
    published = checkpoint_fingerprint(tmp_path).tensors
    assert all(f.count("|") == 2 for f in published.values())  # F32, and its BF16 and F16 casts

    def loaded(tensors):
        return {
            name: fingerprint_tensor(t.to(getattr(torch, held)), dtype_of(published[name]))
            for name, t in tensors.items()
        }

    assert mismatched(published, loaded(weights)) == ([], 2)
    changed = {**weights, "w": weights["w"].clone()}
    changed["w"][3, 7] += 0.5
    assert mismatched(published, loaded(changed)) == (["w"], 2)
    wider = {name: fingerprint_tensor(t.to(torch.float64), "F32") for name, t in weights.items()}
    assert mismatched(published, wider) == ([], 2), "a wider copy converts back to the published float32 exactly"


def test_sglang_compares_q_k_v_only_where_it_can_cut_them_out_of_its_fused_tensor(tmp_path):
    """sglang cuts ``q_proj``, ``k_proj`` and ``v_proj`` out of ``qkv_proj`` with ``hidden_size / heads`` as the
    width: a config with another ``head_dim`` leaves them out of the comparison; the lanes' shared engines (the
    tiny model, no other ``head_dim``) compare them."""
    import json

    from daskgen.engines.sglang.fingerprint import QKV_PARTS, unsliceable

    def folder(name: str, **config: int) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, **config}))
        return str(path)

    assert unsliceable(folder("wider", head_dim=32)) == QKV_PARTS
    assert unsliceable(folder("same", head_dim=16)) == unsliceable(folder("unset")) == ()
    assert unsliceable(str(tmp_path / "missing")) == ()
