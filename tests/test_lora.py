"""LoRA adapters: a real ``daskgen run`` on a LocalCluster with the transformers engine and two adapters made with
peft on the tiny model, rows mixing no adapter, the run's adapter and their own; each greedy response equals the
merged model's (``merge_and_unload``) or, without an adapter, the base model's; the store keeps each row's adapter
and refuses a resume with changed adapter files or another run adapter; bad settings fail before any engine starts,
naming the adapter or the row, the name and the fix."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from daskgen.analysis.accessor import open_store
from daskgen.client.plan import prepare
from daskgen.config import RunConfig
from daskgen.engines.openai import OpenAIEngine
from daskgen.engines.transformers import TransformersEngine
from daskgen.errors import ConfigError, InputError, StoreMismatchError
from daskgen.input.adapters import adapter_digest
from daskgen.store.layout import Layout
from daskgen.testing.lora import make_adapter, merged_greedy
from tests.conftest import run_cli
from tests.test_sampling import CARRYING_FORMATS, carried

pytestmark = pytest.mark.timeout(600)

#: Per row, its own ``adapter`` column (None: no column, the base model).
ROW_ADAPTERS = ["b", None, "a", "b", None, "a"]
MAX_NEW = 10


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("adapters")
    return {name: str(make_adapter(tiny_model, tmp / name, seed=seed)) for name, seed in (("a", 1), ("b", 2))}


def rows() -> list[dict]:
    out = []
    for i, adapter in enumerate(ROW_ADAPTERS):
        row = {"id": f"r{i}", "prompt": f"Number {i} and {i * 7} make"}
        out.append(row if adapter is None else {**row, "adapter": adapter})
    return out


@pytest.fixture(scope="module")
def run(tiny_model, adapters, tmp_path_factory):
    """One real run through the CLI on a one-worker LocalCluster: the tiny model, two adapters, greedy."""
    tmp = tmp_path_factory.mktemp("lora-run")
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    options = {"model": str(tiny_model), "store": str(tmp / "out.zarr"), "engine": "transformers",
               "max_new_tokens": MAX_NEW, "temperature": 0.0, "partition_size": 3, "max_prompt_tokens": 64,
               "adapters": adapters, "engine_args": {"device": "cpu"}}  # fmt: skip
    flags = [f"--adapter-path={name}={path}" for name, path in adapters.items()]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in options.items() if k not in ("adapters", "engine_args")]
    result = run_cli("run", "--prompts", prompts, *flags, "--engine-arg", "device=cpu", "--n-workers", "1",
                     "--no-progress")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return prompts, options


def test_each_row_generates_with_its_adapter_equal_to_the_merged_model(run, adapters):
    """Rows with an adapter equal the merged model's greedy output, rows without one the base model's."""
    _, options = run
    ds = open_store(options["store"])
    assert list(ds["adapter"].values) == [name or "" for name in ROW_ADAPTERS]
    assert ds.attrs["daskgen"]["identity"]["adapters"] == {n: adapter_digest(p) for n, p in adapters.items()}
    outputs = {}
    for row, name in enumerate(ROW_ADAPTERS):
        prompt = ds["prompt_ids"][row, : int(ds["prompt_length"][row])].values.tolist()
        n = int(ds["response_length"][row, 0])
        got = ds["response_ids"][row, 0, :n].values.tolist()
        assert got == merged_greedy(options["model"], adapters.get(name or ""), prompt, MAX_NEW), (row, name)
        outputs[name] = got
    assert len({tuple(v) for v in outputs.values()}) == 3, "each adapter changes the greedy output"


@pytest.mark.parametrize("fmt", [f for f in CARRYING_FORMATS if f != "follow-cli"])  # the CLI prints follow-rows
def test_every_export_and_follow_format_carries_each_rows_adapter(run, fmt, tmp_path):
    """The per-prompt ``adapter`` goes with every sample, where the other per-row records go; a store without
    adapters has no such field."""
    _, options = run
    got = {str(pid): adapter for pid, adapter in carried(fmt, options["store"], tmp_path, ("adapter",))}
    assert got == {row["id"]: row.get("adapter", "") for row in rows()}, fmt
    assert "adapter" not in Layout(6, 1, 64, MAX_NEW, 3, 0).sample_records()
    assert "adapter" in Layout(6, 1, 64, MAX_NEW, 3, 0, adapters=True).sample_records()


def test_the_run_adapter_applies_to_rows_without_their_own(adapters, tiny_model, tmp_path):
    from daskgen.client.plan import pending_tasks

    config = RunConfig(model=str(tiny_model), store=str(tmp_path / "s.zarr"), adapters=adapters, adapter="a",
                       max_prompt_tokens=64, partition_size=8)  # fmt: skip
    plan = prepare(config, rows())
    (task,) = pending_tasks(plan, plan.store.read_status())
    assert [i.get("adapter") for i in task.inputs] == [name or "a" for name in ROW_ADAPTERS]
    assert task.params.adapter == "a"


def test_a_resume_with_changed_adapter_files_or_run_adapter_is_refused(run, adapters, tmp_path):
    prompts, options = run
    assert prepare(RunConfig(**options), prompts).layout.adapters  # the same settings resume
    with pytest.raises(StoreMismatchError, match="adapter"):
        prepare(RunConfig(**{**options, "adapter": "b"}), prompts)  # another run adapter
    changed = shutil.copytree(adapters["a"], tmp_path / "a")
    make_adapter(options["model"], changed, seed=9)  # same name and config, other weights
    with pytest.raises(StoreMismatchError, match="adapters"):
        prepare(RunConfig(**{**options, "adapters": {**adapters, "a": str(changed)}}), prompts)


def test_bad_adapter_settings_fail_naming_the_adapter_and_the_fix(adapters, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "ia3").mkdir()
    (tmp_path / "ia3" / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    saved_to = "give the folder a PEFT LoRA adapter was saved to"
    cases = {  # the folder: what is wrong with it, and the fix
        str(tmp_path / "nowhere"): ("does not exist", saved_to),
        str(tmp_path / "empty"): ("has no adapter_config.json", saved_to),
        str(tmp_path / "ia3"): ("peft_type 'IA3'", "only LoRA adapters (peft_type 'LORA') are served"),
    }
    for path, (reason, fix) in cases.items():
        with pytest.raises(ConfigError, match=reason) as info:
            RunConfig(model="m", adapters={"x": path})
        message = str(info.value)
        assert "adapter 'x'" in message, message  # the adapter's name
        assert fix in message, message
    with pytest.raises(ConfigError, match=r"'c' is not an adapter of this run; the adapters known are \['a', 'b'\]"):
        RunConfig(model="m", adapters=adapters, adapter="c")


def test_an_unknown_row_adapter_fails_at_input_scan_naming_row_name_and_known(tiny_model, adapters, tmp_path):
    bad = [{"prompt": "x", "adapter": "a"}, {"prompt": "y", "adapter": "math"}]
    config = RunConfig(model=str(tiny_model), store=str(tmp_path / "s.zarr"), adapters=adapters, max_prompt_tokens=64)
    with pytest.raises(InputError) as info:
        prepare(config, bad)
    assert "row 1: column 'adapter': 'math' is not an adapter of this run; the adapters known are ['a', 'b']" in str(
        info.value
    )
    assert "row 0" not in str(info.value) and not (tmp_path / "s.zarr").exists()


def test_an_engine_without_lora_is_refused_at_plan_time(adapters, tmp_path):
    config = RunConfig(model="sim", engine="simulated", store=str(tmp_path / "s.zarr"), adapters=adapters)
    with pytest.raises(ConfigError, match="lora: LoRA adapters") as info:
        prepare(config, [{"prompt": "hello", "adapter": "a"}])
    assert "transformers" in str(info.value) and not (tmp_path / "s.zarr").exists()


def test_sglang_with_adapters_on_a_cpu_is_refused_at_plan_time_with_the_reason(tiny_model, adapters, tmp_path):
    """sglang declares LoRA, but its LoRA layers need CUDA: on a CPU device the plan refuses the run (sglang is
    not imported); with a CUDA device the plan accepts it (the workers may have a GPU the client lacks)."""
    options = {"model": str(tiny_model), "engine": "sglang", "adapters": adapters}
    rows = [{"prompt": "hello", "adapter": "a"}]
    for extra in ({"engine_args": {"device": "cpu"}}, {"engine_args": {"device": "cpu"}, "refresh": "drain"}):
        config = RunConfig(**options, **extra, store=str(tmp_path / "s.zarr"))
        with pytest.raises(ConfigError, match="lora: LoRA adapters") as info:
            prepare(config, rows)
        message = str(info.value)
        assert "engine 'sglang' cannot serve" in message and "pin_memory=True" in message, message
        assert "device=cuda" in message and "'transformers'" in message and "'vllm'" in message, message
        assert ("refresh_with_lora: " in message) is ("refresh" in extra), message
        assert not (tmp_path / "s.zarr").exists()
    config = RunConfig(**options, engine_args={"device": "cuda"}, store=str(tmp_path / "gpu.zarr"))
    assert prepare(config, rows).layout.adapters
    managed = {"managed": True, "server_args": {"device": "cpu"}}  # a managed sglang server: the same layers
    config = RunConfig(**{**options, "engine": "openai"}, engine_args=managed, store=str(tmp_path / "m.zarr"))
    with pytest.raises(ConfigError, match="engine 'openai' cannot serve") as info:
        prepare(config, rows)
    assert "pin_memory=True" in str(info.value) and not (tmp_path / "m.zarr").exists()
    assert "lora" in OpenAIEngine.features_with({"base_url": "http://127.0.0.1:9"})  # someone else's server


class AdaptersWithoutRefresh(TransformersEngine):
    """The transformers engine declared as serving adapters and refresh, but not both at once."""

    features = TransformersEngine.features - {"refresh_with_lora"}


def test_an_engine_that_cannot_refresh_under_adapters_is_refused_at_plan_time(tiny_model, adapters, tmp_path):
    options = {"model": str(tiny_model), "engine": f"{__name__}:AdaptersWithoutRefresh", "adapters": adapters}
    config = RunConfig(**options, store=str(tmp_path / "s.zarr"))
    assert prepare(config, [{"prompt": "hello", "adapter": "a"}]).layout.adapters  # adapters alone: served
    refreshing = RunConfig(**options, store=str(tmp_path / "r.zarr"), refresh="drain")
    with pytest.raises(ConfigError, match="refresh_with_lora: loading published policy versions") as info:
        prepare(refreshing, [{"prompt": "hello", "adapter": "a"}])
    assert "engines that serve it: ['sglang', 'transformers'" in str(info.value), info.value
    assert not (tmp_path / "r.zarr").exists()


def test_the_adapter_digest_covers_names_and_bytes(tmp_path):
    folder = tmp_path / "x"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    first = adapter_digest(str(folder))
    (folder / "w.bin").write_bytes(np.zeros(4, "u1").tobytes())
    second = adapter_digest(str(folder))
    (folder / "w.bin").write_bytes(np.ones(4, "u1").tobytes())
    assert len({first, second, adapter_digest(str(folder))}) == 3


def test_each_engine_maps_adapters_to_its_own_settings(adapters):
    """vLLM: enable_lora and the smallest max_lora_rank it accepts; sglang (and its managed server): lora_paths,
    the CPU LoRA backend; engine args set by the user win; HTTP bodies name the adapter as the model (OpenAI,
    vLLM) or its lora_path (SGLang)."""
    from daskgen.engines.base import GenerationRequest, SamplingParams
    from daskgen.engines.openai.protocol import native_payload, openai_payload
    from daskgen.engines.openai.server import ManagedServer
    from daskgen.engines.openai.vllm_protocol import vllm_completions_payload
    from daskgen.engines.sglang.args import launch_kwargs as sglang_kwargs
    from daskgen.engines.vllm.args import launch_kwargs as vllm_kwargs

    vllm = vllm_kwargs("m", {}, False, adapters)
    assert vllm["enable_lora"] is True and vllm["max_lora_rank"] == 8 and vllm["max_loras"] == 3  # an empty slot
    assert vllm_kwargs("m", {"max_loras": 1}, True, adapters)["max_loras"] == 1  # engine args win
    assert "enable_lora" not in vllm_kwargs("m", {}, False, {})
    sglang = sglang_kwargs("m", {}, False, adapters)
    assert sglang["lora_paths"] == [f"{n}={p}" for n, p in adapters.items()] and sglang["max_loras_per_batch"] == 3
    assert sglang["lora_backend"] == "torch_native" and "lora_backend" not in sglang_kwargs("m", {}, True, adapters)
    command = ManagedServer("m", adapters=adapters).command(1234, False)
    assert "--enable-lora" in command and command[command.index("--lora-paths") + 1] == f"a={adapters['a']}"
    request = GenerationRequest("r", [1, 2], SamplingParams(adapter="b"))
    assert openai_payload("completions", "base", "hi", request, {})[1]["model"] == "b"
    assert vllm_completions_payload("base", request, {})["model"] == "b"
    assert native_payload(request, "rid", {})["lora_path"] == "b"
    plain = GenerationRequest("r", [1, 2], SamplingParams())
    assert vllm_completions_payload("base", plain, {})["model"] == "base" and "lora_path" not in native_payload(
        plain, "rid", {}
    )


@pytest.mark.proves("transformers", "refresh_with_lora")
def test_a_refresh_loads_new_base_weights_under_the_adapters_and_keeps_them(tiny_model, adapters, tmp_path):
    """A published checkpoint of the base model (``save_pretrained``, plain names) loads into the engine that holds
    the adapters: afterwards each adapter's rows equal that adapter merged into the new weights, the base rows
    the new model's."""
    import asyncio

    from daskgen.engines.base import GenerationRequest, SamplingParams
    from daskgen.engines.transformers import TransformersEngine
    from daskgen.models import build_tiny_model

    new_policy = build_tiny_model(tmp_path / "step1", seed=1)
    prompt = [5, 9, 13, 2, 7]

    async def outputs(engine) -> dict:
        got = {}
        for name in (None, "a", "b"):
            params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, adapter=name)
            got[name] = (await engine.generate(GenerationRequest(f"r{name}", prompt, params))).output_ids
        return got

    async def scenario():
        engine = TransformersEngine(str(tiny_model), adapters=adapters, device="cpu")
        await engine.start()
        try:
            before = await outputs(engine)
            await engine.update_weights(str(new_policy))
            return before, await outputs(engine)
        finally:
            await engine.shutdown()

    before, after = asyncio.run(scenario())
    for name in (None, "a", "b"):
        path = adapters.get(name or "")
        assert before[name] == merged_greedy(tiny_model, path, prompt, MAX_NEW), name
        assert after[name] == merged_greedy(new_policy, path, prompt, MAX_NEW), name
    assert before != after and len({tuple(v) for v in after.values()}) == 3
