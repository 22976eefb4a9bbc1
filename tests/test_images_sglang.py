"""Images on the sglang engine: the worker's pixel values and expanded prompt go to sglang as they are stored
(one ``processor_output`` item), and its greedy answers equal the model's own ``generate`` with the same pixels.

The run tests need the real sglang (the sglang lane: ``.ci/sglang-lane``, whose ``sgl_kernel`` shim provides the
placeholder torch ops sglang's Qwen-VL image processor looks up at import); the plan-time refusals run in every
lane.  The model is the tiny seeded Qwen2-VL (:func:`daskgen.models.build_tiny_vl_model`), the images are generated
(:func:`daskgen.testing.images.write_generated_images`).
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import pytest

from daskgen.client.plan import prepare
from daskgen.config import RunConfig
from daskgen.engines.features import engines_serving
from daskgen.engines.media import ImageInput
from daskgen.engines.sglang import SGLangEngine
from daskgen.engines.sglang.images import image_data
from daskgen.errors import ConfigError
from daskgen.store.generation_store import GenerationStore
from daskgen.store.verify import verify
from tests.conftest import run_cli

HAVE_SGLANG = find_spec("sglang") is not None
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


@pytest.fixture(scope="module")
def sglang_image_run(tmp_path_factory, vl_model, images):
    """A run on the sglang engine over rows with one image each (four different images, one as a content part of
    a ``messages`` row), a row with two images and a text-only row; returns the rows and the store."""
    folder = tmp_path_factory.mktemp("sglang-run")
    part = {"type": "image_url", "image_url": {"url": str(images["checkerboard"])}}
    rows = [
        {"id": "gradient", "prompt": QUESTION, "images": [str(images["gradient"])]},
        {"id": "noise", "prompt": QUESTION, "images": [str(images["noise"])]},
        {"id": "message", "messages": [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]},
        {"id": "two", "prompt": QUESTION, "images": [str(images["noise"]), str(images["gradient"])]},
        {"id": "text", "prompt": QUESTION},
        {"id": "mirrored", "prompt": QUESTION, "images": [str(images["mirrored"])]},
    ]
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = folder / "out.zarr"
    result = run_cli(
        *("run", "--prompts", prompts, "--store", store, "--model", vl_model, "--engine", "sglang"),
        *("--max-new-tokens", NEW_TOKENS, "--temperature", "0", "--partition-size", "3", "--n-workers", "1"),
        "--no-progress",
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "6 done, 0 failed" in result.stdout, result.stdout
    return rows, GenerationStore.open(store)


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed (run the sglang lane: .ci/sglang-lane)")
@pytest.mark.proves("sglang", "images")
def test_sglang_greedy_answers_equal_the_models_own_generate_with_the_same_pixels(
    sglang_image_run, vl_model, images
) -> None:
    from daskgen.input.image_refs import template_messages
    from tests.test_images import reference_generate

    rows, store = sglang_image_run
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
            expanded, _, _ = reference_generate(vl_model, prompt, paths, NEW_TOKENS)
            assert stored == expanded, f"row {row}: the stored prompt is not the one the model saw"
        answer = data["response_ids"][row, 0, : data["response_length"][row, 0]].tolist()
        assert answer == model_generate(vl_model, stored, paths), f"row {row}: sglang's answer is not the model's"


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed (run the sglang lane: .ci/sglang-lane)")
def test_sglang_sees_the_image_and_its_store_verifies(sglang_image_run) -> None:
    """The same question about different images gets different answers, also when only the pixels differ (the
    gradient and its mirror image: equal prompt ids); ``verify`` finds the spans and images."""
    _, store = sglang_image_run
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


@pytest.mark.parametrize(
    ("arg", "value"), [("enable_multimodal", False), ("language_model_only", True), ("language_only", True)]
)
def test_an_image_run_with_engine_args_that_turn_sglangs_images_off_is_refused_at_plan_time(
    tmp_path, vl_model, images, arg, value
) -> None:
    assert "images" in SGLangEngine.features_with({}) and "images" not in SGLangEngine.features_with({arg: value})
    assert "sglang" in engines_serving("images")  # named when an engine without images is refused
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "images": [str(images["noise"])]}) + "\n")
    config = RunConfig(
        prompts=str(prompts), store=str(tmp_path / "s.zarr"), model=str(vl_model), engine="sglang",
        engine_args={arg: value},
    )  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        prepare(config)
    assert f"engine arg {arg}={value!r}" in str(refused.value) and "remove it" in str(refused.value)
    assert not (tmp_path / "s.zarr").exists()
