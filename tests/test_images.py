"""Images in prompts (daskgen.images): checked at the input scan, stored once by hash, preprocessed on the
worker, placed in the prompt with their spans, and generated from by the transformers engine exactly as the
model's own ``generate`` with the same pixels does.  A tiny seeded Qwen2-VL (daskgen.models.build_tiny_vl_model)
and images that ship with matplotlib or are generated."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path
from typing import NamedTuple

import dask
import numpy as np
import pytest

import daskgen
from daskgen.client.plan import prepare
from daskgen.config import RunConfig
from daskgen.errors import ConfigError, InputError, StoreMismatchError
from daskgen.input.image_refs import template_messages
from daskgen.input.image_tokens import expand, mrope_delta
from daskgen.store.generation_store import GenerationStore
from daskgen.store.images import REFERENCE, blob_key, stored_hashes, stored_images
from daskgen.store.objects.image_urls import read_image_bytes
from daskgen.store.tools.verify import verify
from tests.conftest import run_cli
from tests.test_object_store import s3, s3_server  # noqa: F401 - fixtures (moto's S3 server)

pytestmark = pytest.mark.timeout(600)

QUESTION = "What is in the picture?"


def image_part(path: Path | str) -> dict:
    return {"type": "image_url", "image_url": {"url": str(path)}}


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


@pytest.fixture(scope="module")
def vl_model() -> Path:
    from daskgen.models import build_tiny_vl_model

    return build_tiny_vl_model()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    from daskgen.testing.images import sample_image_paths

    return sample_image_paths(tmp_path_factory.mktemp("images"))


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_args(prompts: Path, store: Path, model: Path, *extra: str) -> list[str]:
    return [
        *("run", "--prompts", prompts, "--store", store, "--model", model, "--engine", "transformers"),
        *("--max-new-tokens", "6", "--temperature", "0", "--n-samples", "2", "--partition-size", "2"),
        *("--n-workers", "1", "--no-progress", *extra),
    ]


@pytest.fixture(scope="module")
def image_run(tmp_path_factory, vl_model, images):
    """One run over rows that name images every way (relative paths, file://, data:), share them, and mix in a
    text-only row; returns the folder, the rows and the store."""
    folder = tmp_path_factory.mktemp("run")
    shutil.copy(images["gradient"], folder / "gradient.png")
    from PIL import Image, ImageOps

    ImageOps.mirror(Image.open(images["gradient"])).save(folder / "mirrored.png")  # same size, other pixels
    photo = images["grace_hopper"].read_bytes()
    data_url = "data:image/jpeg;base64," + base64.b64encode(photo).decode()
    rows = [
        {"id": "photo", "messages": user(image_part(images["grace_hopper"]), {"type": "text", "text": QUESTION})},
        {"id": "relative", "messages": user(image_part("gradient.png"), {"type": "text", "text": QUESTION})},
        {"id": "two", "prompt": QUESTION, "images": [f"file://{images['noise']}", data_url]},
        {"id": "text", "prompt": QUESTION},
        {"id": "turn2", "messages": [
            {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi. Show me."},
            *user(image_part(images["checkerboard"]), {"type": "text", "text": QUESTION})]},
        {"id": "mirrored", "messages": user(image_part("mirrored.png"), {"type": "text", "text": QUESTION})},
    ]  # fmt: skip
    prompts = write_rows(folder / "prompts.jsonl", rows)
    store = folder / "out.zarr"
    result = run_cli(*run_args(prompts, store, vl_model))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is not recognized as a component" not in result.stderr, result.stderr  # the image objects are the store's
    return folder, rows, GenerationStore.open(store)


class Reference(NamedTuple):
    """What the model itself makes of a prompt with images: the expanded prompt ids, the greedy tokens after them,
    and its mRoPE rope delta and ``(3, len(expanded))`` positions of the prompt."""

    expanded: list[int]
    tokens: list[int]
    delta: int
    positions: np.ndarray


def reference_generate(
    model_path: Path, messages_or_prompt, image_paths: list[Path], max_new_tokens: int, adapter=None
) -> Reference:
    """The model's own ``generate`` on ``image_paths``, built with transformers alone (processor, tokenizer,
    placeholder expansion by hand); ``adapter``: a LoRA adapter merged into the weights first."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    processor = AutoImageProcessor.from_pretrained(model_path)
    model = AutoModelForImageTextToText.from_pretrained(model_path).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    out = processor(images=[Image.open(p).convert("RGB") for p in image_paths], return_tensors="pt")
    grids = out["image_grid_thw"].tolist()
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    if isinstance(messages_or_prompt, str):
        block = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
        ids = block * len(image_paths) + tokenizer(messages_or_prompt)["input_ids"]
    else:
        encoded = tokenizer.apply_chat_template(messages_or_prompt, add_generation_prompt=True, tokenize=True)
        ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    expanded, k = [], 0
    for token in ids:
        if token == pad:
            t, h, w = grids[k]
            expanded += [pad] * (t * h * w // processor.merge_size**2)
            k += 1
        else:
            expanded.append(token)
    new, (positions, delta) = generate_with_pixels(model, out, expanded, pad, max_new_tokens)
    return Reference(expanded, new, delta, positions)


def generate_with_pixels(
    model, processed, expanded: list[int], pad: int, max_new_tokens: int
) -> tuple[list[int], tuple[np.ndarray, int]]:
    """Greedy tokens of ``model.generate`` after the expanded ids ``expanded`` with the processor's output
    ``processed`` (its pixel values and grids), and the model's ``get_rope_index`` of those ids: their
    ``(3, len(expanded))`` mRoPE positions and rope delta."""
    import torch

    input_ids = torch.tensor([expanded])
    types = (input_ids == pad).int()  # 1: an image token (without them generate's positions stay 1-D)
    with torch.no_grad():
        generated = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=processed["pixel_values"],
            image_grid_thw=processed["image_grid_thw"], mm_token_type_ids=types, max_new_tokens=max_new_tokens,
            do_sample=False,
        )  # fmt: skip
        positions, deltas = model.model.get_rope_index(input_ids, types, image_grid_thw=processed["image_grid_thw"])
    return generated[0, len(expanded) :].tolist(), (positions[:, 0].numpy(), int(deltas[0]))


@pytest.mark.proves("transformers", "images")
def test_greedy_answers_equal_the_models_own_generate_with_the_same_pixels(image_run, vl_model, images) -> None:
    folder, rows, store = image_run
    data = store.read_region(0, 6, ("prompt_ids", "prompt_length", "response_ids", "response_length", "rope_delta"))
    cases = {
        0: (rows[0]["messages"], [images["grace_hopper"]]),
        1: (rows[1]["messages"], [folder / "gradient.png"]),
        2: (QUESTION, [images["noise"], images["grace_hopper"]]),
        4: (rows[4]["messages"], [images["checkerboard"]]),  # the image in the conversation's second user turn
        5: (rows[5]["messages"], [folder / "mirrored.png"]),
    }
    for row, (prompt, paths) in cases.items():
        template_view = template_messages(prompt) if isinstance(prompt, list) else prompt
        expanded, tokens, delta, _ = reference_generate(vl_model, template_view, paths, 6)
        stored = data["prompt_ids"][row, : data["prompt_length"][row]].tolist()
        assert stored == expanded, f"row {row}: the stored prompt is not the one the model saw"
        for s in range(2):
            assert data["response_ids"][row, s, : data["response_length"][row, s]].tolist() == tokens, (row, s)
        assert int(data["rope_delta"][row]) == delta, f"row {row}: rope_delta is not the model's own"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen2_5_vl_and_qwen3_vl_answer_as_their_own_generate(tmp_path, images, family) -> None:
    """The family's other classes (Qwen2.5-VL's windowed vision tower; Qwen3-VL's 16-pixel patches, deepstack and
    interleaved mRoPE): the stored prompts, greedy answers and rope deltas are the model's own, and the mRoPE
    positions computed from the stored spans equal its get_rope_index."""
    from daskgen.formats.mrope import mrope_positions
    from daskgen.models import build_tiny_vl_model

    model_path = build_tiny_vl_model(family=family)
    photo = user(image_part(images["grace_hopper"]), {"type": "text", "text": QUESTION})
    rows = [{"messages": photo}, {"prompt": QUESTION, "images": [str(images["noise"]), str(images["checkerboard"])]}]
    store = tmp_path / "out.zarr"
    result = run_cli(*run_args(write_rows(tmp_path / "p.jsonl", rows), store, model_path, "--n-samples", "1"))
    assert result.returncode == 0, result.stdout + result.stderr
    spans = ("image_offset", "image_length", "image_grid")
    names = ("prompt_ids", "prompt_length", "response_ids", "response_length", "rope_delta", *spans)
    data = GenerationStore.open(store).read_region(0, 2, names)
    cases = [
        (template_messages(photo), [images["grace_hopper"]]),
        (QUESTION, [images["noise"], images["checkerboard"]]),
    ]
    for row, (prompt, paths) in enumerate(cases):
        reference = reference_generate(model_path, prompt, paths, 6)
        assert data["prompt_ids"][row, : data["prompt_length"][row]].tolist() == reference.expanded, row
        assert data["response_ids"][row, 0, : data["response_length"][row, 0]].tolist() == reference.tokens, row
        assert int(data["rope_delta"][row]) == reference.delta, row
        used = data["image_length"][row] > 0
        ours = mrope_positions(len(reference.expanded), *(data[name][row][used] for name in spans))
        np.testing.assert_array_equal(ours, reference.positions)


def test_the_model_sees_the_image(image_run) -> None:
    """Rows 1 and 5 ask the same question of an image and its mirror image: the same prompt ids (the same size,
    so the same placeholders), other pixels, and their answers differ."""
    _, _, store = image_run
    data = store.read_region(0, 6, ("response_ids", "prompt_ids", "prompt_length", "image_hash"))
    assert data["prompt_ids"][1].tolist() == data["prompt_ids"][5].tolist()
    assert data["prompt_length"][1] == data["prompt_length"][5] and data["image_hash"][1, 0] != data["image_hash"][5, 0]
    assert data["response_ids"][1, 0].tolist() != data["response_ids"][5, 0].tolist()


def test_each_distinct_image_is_stored_once_and_spans_cover_exactly_the_placeholders(image_run, images) -> None:
    folder, _, store = image_run
    arrays = store.read_region(0, 6, ("image_hash", "image_offset", "image_length", "image_grid", "prompt_ids"))
    hashes = arrays["image_hash"]
    photo = hashlib.sha256(images["grace_hopper"].read_bytes()).hexdigest()
    expected = [
        [photo, ""],
        [hashlib.sha256((folder / "gradient.png").read_bytes()).hexdigest(), ""],
        [hashlib.sha256(images["noise"].read_bytes()).hexdigest(), photo],
        ["", ""],
        [hashlib.sha256(images["checkerboard"].read_bytes()).hexdigest(), ""],
        [hashlib.sha256((folder / "mirrored.png").read_bytes()).hexdigest(), ""],
    ]
    assert hashes.tolist() == expected
    assert stored_hashes(store.location) == {h for row in expected for h in row if h}  # the photo once, for 2 rows
    assert store.location.read_bytes(blob_key(photo)) == images["grace_hopper"].read_bytes()
    assert (arrays["image_offset"][3] == -1).all() and (arrays["image_length"][3] == 0).all()
    report = verify(store.url, progress=False)
    assert report.sound, report.lines()


def test_verify_finds_a_span_that_misses_its_placeholders_and_a_damaged_image(image_run, tmp_path) -> None:
    folder, _, store = image_run
    copy = tmp_path / "copy.zarr"
    shutil.copytree(store.url, copy)
    damaged = GenerationStore.open(copy)
    offsets = damaged.array("image_offset", writable=True)
    offsets[0, 0] = int(offsets[0, 0]) - 1  # the span now starts one token before the placeholders
    digest = str(damaged.read_region(2, 4, ("image_hash",))["image_hash"][0, 0])
    (copy / blob_key(digest)).write_bytes(b"not the image")
    report = verify(str(copy), progress=False)
    text = "\n".join(report.lines())
    assert 0 in report.rows() and "span" in text, text
    assert any(p.kind == "image" and digest in p.chunk for p in report.problems), text


def test_a_rerun_resumes_and_a_changed_image_is_refused(image_run, vl_model, images) -> None:
    folder, _, store = image_run
    settings = {"prompts": str(folder / "prompts.jsonl"), "store": store.url, "model": str(vl_model)}
    settings |= {"engine": "transformers", "max_new_tokens": 6, "temperature": 0, "n_samples": 2, "partition_size": 2}
    prepare(RunConfig(**settings))  # the same input and images: the store resumes
    original = (folder / "gradient.png").read_bytes()
    shutil.copy(images["checkerboard"], folder / "gradient.png")
    try:
        with pytest.raises(StoreMismatchError, match="images: store has"):
            prepare(RunConfig(**settings))
    finally:
        (folder / "gradient.png").write_bytes(original)


def test_bad_images_are_refused_at_the_scan_naming_the_row_and_the_image(tmp_path, vl_model, images) -> None:
    (tmp_path / "broken.png").write_bytes(b"\x89PNG but not really")
    rows = [
        {"messages": user(image_part(tmp_path / "missing.png"), {"type": "text", "text": "a"})},
        {"prompt": "b", "images": [str(tmp_path / "broken.png")]},
        {"messages": user({"type": "image_url", "image_url": {}}, {"type": "text", "text": "c"})},
        {"prompt": "d", "images": [str(images["large"])]},
        {"prompt": "e", "images": [str(images["tiny"])] * 3},
        {"messages": user({"type": "video", "video": "x.mp4"})},
        {"prompt": "g", "images": [str(_wide_image(tmp_path / "wide.png"))]},
        {"prompt": "h", "images": [str(_png_header_only(tmp_path / "huge.png", 20_000, 10_000))]},
    ]
    prompts = write_rows(tmp_path / "p.jsonl", rows)
    config = RunConfig(prompts=str(prompts), store=str(tmp_path / "s.zarr"), model=str(vl_model), engine="transformers")
    limits = {"daskgen.images.max-pixels": 1_000_000, "daskgen.images.max-per-prompt": 2}
    with dask.config.set(limits), pytest.raises(InputError) as refused:
        prepare(config)
    text = str(refused.value)
    assert "row 0: column 'messages'[0].content[0]: image" in text and "not found" in text
    assert "row 1: column 'images'[0]: not an image Pillow can read" in text
    assert "row 2: column 'messages'[0].content[0]: expected an image URL" in text
    assert "row 3: column 'images'[0]: image" in text and "2000x1500 = 3000000 pixels" in text
    assert "row 4: 3 images, more than daskgen.images.max-per-prompt=2" in text
    assert "row 5: column 'messages'[0].content[0]: expected a content part" in text
    assert "row 6: column 'images'[0]: image" in text and "wide.png' is 5000x20 pixels, which the model's image" in text
    assert "aspect ratio must be smaller than 200" in text and "crop, pad or resize the image" in text
    assert "row 7: column 'images'[0]: too large for Pillow to open (Image size (200000000 pixels)" in text
    assert not (tmp_path / "s.zarr").exists()


def _wide_image(path: Path) -> Path:
    """An image the Qwen2-VL processor refuses (aspect ratio over 200)."""
    from PIL import Image

    Image.new("RGB", (5000, 20), (200, 30, 30)).save(path)
    return path


def _png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header names ``width`` x ``height`` pixels (its data is not that image)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body)
    return path


def test_an_image_the_processor_refuses_stops_the_cli_before_any_engine_naming_the_row(tmp_path, vl_model) -> None:
    prompts = write_rows(tmp_path / "p.jsonl", [{"prompt": "g", "images": [str(_wide_image(tmp_path / "w.png"))]}])
    res = run_cli(*run_args(prompts, tmp_path / "s.zarr", vl_model))
    output = res.stdout + res.stderr
    assert res.returncode == 2 and "row 0: column 'images'[0]: image" in output and "aspect ratio" in output, output
    assert "Traceback" not in output and not (tmp_path / "s.zarr").exists(), output


def _encoded(image, fmt: str, **save) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def test_images_decode_as_shown_and_blend_transparency_onto_white_as_the_processor_does(vl_model) -> None:
    """Each image's pixels equal the model's own processor given the file as a viewer shows it: transparency
    blended onto white (the processor's own rule for an image with alpha, not Pillow's drop of the alpha band),
    EXIF orientation applied, and the scan's token count from the turned size."""
    import io

    from PIL import Image, ImageOps

    from daskgen.images.processor import ImageProcessing
    from daskgen.input.image_decoding import DECODING, oriented_size

    processing = ImageProcessing(str(vl_model))
    own = processing.processor
    rng = np.random.default_rng(7)
    rgba = Image.fromarray(rng.integers(0, 256, (40, 56, 4), dtype=np.uint8), "RGBA")
    rgba.putpixel((0, 0), (0, 0, 0, 0))  # a transparent black pixel: white once blended, black with the alpha dropped
    files = {
        "RGBA png": _encoded(rgba, "PNG"),
        "LA png": _encoded(rgba.convert("LA"), "PNG"),
        "RGBA webp": _encoded(rgba, "WEBP", lossless=True),
        "P png with a transparent index": _encoded(rgba.convert("RGB").convert("P"), "PNG", transparency=0),
        "CMYK jpeg": _encoded(rgba.convert("CMYK"), "JPEG"),
        "16-bit grey png": _encoded(Image.fromarray(rng.integers(0, 65535, (40, 56), dtype=np.uint16)), "PNG"),
    }
    for name, data in files.items():
        expected = np.asarray(own(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"])
        np.testing.assert_allclose(processing.process(data).pixel_values, expected, err_msg=name)
    dropped = np.asarray(
        own(images=[Image.open(io.BytesIO(files["RGBA png"])).convert("RGB")], return_tensors="np")["pixel_values"]
    )
    assert not np.allclose(processing.process(files["RGBA png"]).pixel_values, dropped)

    stored = Image.fromarray(rng.integers(0, 256, (112, 56, 3), dtype=np.uint8), "RGB")  # 56 wide, 112 high
    exif = stored.getexif()
    exif[0x0112] = 6  # shown turned a quarter: 112 wide, 56 high
    turned = _encoded(stored, "JPEG", exif=exif)
    shown = ImageOps.exif_transpose(Image.open(io.BytesIO(turned)))
    assert oriented_size(Image.open(io.BytesIO(turned))) == shown.size == (112, 56)
    processed = processing.process(turned)
    expected = own(images=[shown], return_tensors="np")
    np.testing.assert_allclose(processed.pixel_values, np.asarray(expected["pixel_values"]))
    assert processed.grid == tuple(int(v) for v in expected["image_grid_thw"][0])
    assert processed.grid != tuple(int(v) for v in own(images=[stored], return_tensors="np")["image_grid_thw"][0])
    assert processing.tokens_for(*oriented_size(Image.open(io.BytesIO(turned)))) == processed.tokens
    for orientation in range(1, 9):  # each way a camera records a turn or a mirror: as Pillow's exif_transpose shows it
        exif[0x0112] = orientation
        data = _encoded(stored, "PNG", exif=exif)
        shown = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
        expected = own(images=[shown], return_tensors="np")["pixel_values"]
        np.testing.assert_allclose(processing.process(data).pixel_values, np.asarray(expected), err_msg=orientation)
        assert oriented_size(Image.open(io.BytesIO(data))) == shown.size, orientation
    assert processing.identity()["decoding"] == DECODING


def test_an_engine_or_model_without_vision_is_refused_before_any_engine_starts(tmp_path, vl_model, images) -> None:
    from daskgen.models import build_tiny_model

    prompts = write_rows(tmp_path / "p.jsonl", [{"prompt": "x", "images": [str(images["noise"])]}])
    settings = {"prompts": str(prompts), "store": str(tmp_path / "s.zarr")}
    with pytest.raises(ConfigError) as no_images:
        prepare(RunConfig(**settings, model=str(vl_model), engine="openai", engine_args={"base_url": "http://x:1"}))
    assert "images in prompts" in str(no_images.value) and "transformers" in str(no_images.value)
    from daskgen.engines.features import engines_serving

    served = engines_serving("images")  # what the refusal names (docs/engines.md's images row)
    assert {"transformers", "simulated", "vllm", "sglang"} <= set(served)
    with pytest.raises(ConfigError, match="has no image processor"):
        prepare(RunConfig(**settings, model=str(build_tiny_model(tmp_path / "tiny")), engine="transformers"))
    llava = _llava_like_folder(build_tiny_model(tmp_path / "tiny"), tmp_path / "llava")
    with pytest.raises(ConfigError, match=r"\(CLIPImageProcessor\w*\) that gives no patch grid per image"):
        prepare(RunConfig(**settings, model=str(llava), engine="transformers"))


def _llava_like_folder(text_model: Path, out: Path) -> Path:
    """A LLaVA configuration with a CLIP image processor beside a tiny model's tokenizer (no weights: the plan
    refuses it before any engine would load them)."""
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlavaConfig

    tokenizer = AutoTokenizer.from_pretrained(text_model)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.save_pretrained(out)
    text = json.loads((text_model / "config.json").read_text())
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    image = tokenizer.convert_tokens_to_ids("<image>")
    LlavaConfig(text_config=text, vision_config=vision.to_dict(), image_token_index=image).save_pretrained(out)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(out)
    return out


def test_placeholders_expand_to_each_images_tokens_and_the_delta_follows_the_grid() -> None:
    ids, spans = expand([1, 9, 2, 9, 3], 9, [4, 2])
    assert ids == [1, 9, 9, 9, 9, 2, 9, 9, 3] and spans == [(1, 4), (6, 2)]
    with pytest.raises(ValueError, match="rendered 2 image placeholder"):
        expand([1, 9, 2, 9], 9, [4])
    assert mrope_delta([(1, 34, 28)], 2) == 17 - 238  # 17 x 14 tokens advance the positions by 17
    assert mrope_delta([], 2) == 0


def test_image_urls_read_from_files_file_urls_and_data_urls(tmp_path) -> None:
    (tmp_path / "a.bin").write_bytes(b"abc")
    assert read_image_bytes(str(tmp_path / "a.bin")) == b"abc"
    assert read_image_bytes(f"file://{tmp_path / 'a.bin'}") == b"abc"
    assert read_image_bytes("data:image/png;base64," + base64.b64encode(b"abc").decode()) == b"abc"
    with pytest.raises(InputError, match="must be base64"):
        read_image_bytes("data:image/png,abc")
    with pytest.raises(InputError, match="scheme 'ftp' is not read"):
        read_image_bytes("ftp://host/a.png")


def test_text_parts_only_become_one_string_and_image_parts_the_templates_image() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template_messages(messages) == [{"role": "user", "content": "ab"}]
    with_image = [{"role": "user", "content": [image_part("x.png"), {"type": "text", "text": "a"}]}]
    assert template_messages(with_image)[0]["content"] == [{"type": "image"}, {"type": "text", "text": "a"}]
    from daskgen.input.image_refs import content_errors, image_refs

    parts = [{"type": "image", key: f"{key}.png"} for key in ("image", "url", "path")]  # transformers' spellings too
    assert [ref.url for ref in image_refs({"messages": user(*parts, image_part("last.png"))})] == [
        "image.png",
        "url.png",
        "path.png",
        "last.png",
    ]
    assert template_messages(user(*parts))[0]["content"] == [{"type": "image"}] * 3
    assert content_errors([{"type": "image", "link": "x.png"}], "m") == [
        "m.content[0]: expected an image URL or file path (a non-empty string), found None"
    ]


def test_image_urls_read_from_object_storage_and_http(s3, s3_server) -> None:  # noqa: F811
    """An image on S3 (moto's server on loopback) read with the run's storage options, and over plain HTTP."""
    import boto3

    bucket, _ = s3
    boto3.client("s3", endpoint_url=s3_server).put_object(
        Bucket=bucket, Key="pics/a b.png", Body=b"png bytes", ACL="public-read"
    )
    assert read_image_bytes(f"s3://{bucket}/pics/a b.png", {"endpoint": s3_server}) == b"png bytes"
    assert read_image_bytes(f"{s3_server}/{bucket}/pics/a%20b.png") == b"png bytes"
    with pytest.raises(InputError, match="not found"):
        read_image_bytes(f"s3://{bucket}/pics/missing.png", {"endpoint": s3_server})


def make_vl_adapter(model_path: Path, path: Path) -> Path:
    """A seeded LoRA adapter on the language model's attention projections of the tiny Qwen2-VL."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.5 if "lora_B" in name else 0.3))
    peft_model.save_pretrained(str(path))
    return path


def test_rows_with_images_generate_with_their_lora_adapter_equal_to_the_merged_model(tmp_path, vl_model, images):
    adapter = make_vl_adapter(vl_model, tmp_path / "lora")
    photo = [image_part(images["grace_hopper"]), {"type": "text", "text": QUESTION}]
    rows = [{"messages": user(*photo), "adapter": "style"}, {"messages": user(*photo)}]
    prompts = write_rows(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out.zarr"
    result = run_cli(*run_args(prompts, out, vl_model, "--adapter-path", f"style={adapter}"))
    assert result.returncode == 0, result.stdout + result.stderr
    data = GenerationStore.open(out).read_region(0, 2, ("response_ids", "response_length"))
    got = [data["response_ids"][r, 0, : data["response_length"][r, 0]].tolist() for r in range(2)]
    view = template_messages(user(*photo))
    assert got[0] == reference_generate(vl_model, view, [images["grace_hopper"]], 6, adapter)[1]
    assert got[1] == reference_generate(vl_model, view, [images["grace_hopper"]], 6)[1]
    assert got[0] != got[1], "the adapter changes the answer"


@pytest.mark.proves("simulated", "images")
def test_the_simulated_engine_charges_image_tokens_prefill_and_encoder_time(tmp_path, vl_model, images) -> None:
    """A run with the simulated engine stores the images like any other; each image token costs its prefill plus
    ``image_token_time_s`` of vision encoder in the engine's time model."""
    import asyncio

    from daskgen.engines.base import GenerationRequest, SamplingParams
    from daskgen.engines.media import ImageInput
    from daskgen.engines.simulated import SimulatedEngine

    async def prefill_seconds(images: tuple) -> float:
        engine = SimulatedEngine("sim", time_scale=0, prefill_time_per_token_s=0.001, image_token_time_s=0.01)
        await engine.start()
        params = SamplingParams(max_new_tokens=2, images=images)
        await engine.generate(GenerationRequest("r", [5] * 30, params))
        seconds = engine.stats()["prefill_s"]
        await engine.shutdown()
        return seconds

    image = ImageInput("h", b"", None, (1, 4, 5), (2, 20))
    assert asyncio.run(prefill_seconds(())) == pytest.approx(0.03)
    assert asyncio.run(prefill_seconds((image,))) == pytest.approx(0.03 + 0.2)
    rows = [{"prompt": QUESTION, "images": [str(images["noise"])]}]
    prompts = write_rows(tmp_path / "p.jsonl", rows)
    args = run_args(prompts, tmp_path / "out.zarr", vl_model)
    args[args.index("transformers")] = "simulated"
    result = run_cli(*args, "--engine-arg", "vocab_size=49156", "--engine-arg", "time_scale=0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert verify(str(tmp_path / "out.zarr"), progress=False).sound


def test_preprocessing_is_counted_cached_by_hash_and_shown_on_the_dashboard(tmp_path, vl_model, images) -> None:
    """A worker's preparer preprocesses each distinct image once (two rows naming one image, then the same rows
    again from its cache), stores it once, and counts images and wait time; the dashboard's worker table shows
    images preprocessed per second and the wait."""
    import asyncio

    from daskgen.dashboard.metrics import WORKER_TOPIC
    from daskgen.dashboard.page import workers_html
    from daskgen.dashboard.state import DashboardState
    from daskgen.store.location import locate
    from daskgen.worker.images import ImagePreparer, image_metrics

    preparer = ImagePreparer(str(vl_model))
    rows = [{"image_urls": [str(images["noise"])]}, {"image_urls": [str(images["noise"]), str(images["gradient"])]}]
    block = [preparer.vision.start, preparer.vision.image, preparer.vision.end]
    prompts = [block + [5], block + block + [6]]
    location = locate(tmp_path / "store")
    expanded, placed = asyncio.run(preparer.prepare(rows, prompts, location))
    assert preparer.counters.processed == 2 and preparer.counters.cache_hits == 1
    assert stored_hashes(location) == {
        hashlib.sha256(images[n].read_bytes()).hexdigest() for n in ("noise", "gradient")
    }
    assert placed[1].images[0].pixel_values is placed[0].images[0].pixel_values, "one copy of an image per worker"
    asyncio.run(preparer.prepare(rows, prompts, location))
    assert preparer.counters.processed == 2 and preparer.counters.cache_hits == 4 and preparer.counters.stored == 2
    metrics = image_metrics()
    assert metrics["images"] >= 2 and metrics["image_wait_s"] > 0
    state = DashboardState()
    base = {"samples": 0, "partitions": 0, "restarts": 0, "error": None, "lengths": {}, "state": "ready"}
    for t, count in ((1000.0, 0), (1002.0, 10)):
        report = {**base, "worker": "tcp://a:1", "time": t, "tokens": 0, "images": count, "image_wait_s": 1.5}
        state.ingest(WORKER_TOPIC, report)
    (row,) = state.worker_rows(1002.0)
    assert row["images"] == 10 and row["images_per_s"] == pytest.approx(5.0) and row["image_wait_s"] == 1.5
    page = workers_html([row])
    assert "images preprocessed" in page and "10 (5.0/s)" in page and "1.5 s" in page


def test_verify_deep_runs_the_processor_again_and_finds_other_preprocessing(image_run, vl_model, tmp_path) -> None:
    """``verify --deep`` on the store passes; against a processor that resizes to fewer pixels, every image's
    stored grid and span differ from what it gives, and the recorded processor identity differs too."""
    from daskgen.images.deep_check import deep_image_problems

    _, _, store = image_run
    result = run_cli("verify", store.url, "--deep", "--no-progress")
    assert result.returncode == 0, result.stdout + result.stderr
    other = tmp_path / "model"
    shutil.copytree(vl_model, other)
    config = json.loads((other / "preprocessor_config.json").read_text())
    config["max_pixels"] = config["size"]["longest_edge"] = 112 * 112
    (other / "preprocessor_config.json").write_text(json.dumps(config))
    problems, notes = deep_image_problems(store, str(other))
    assert {p.start for p in problems} == {0, 1, 2, 4, 5} and "the processor gives" in problems[0].detail
    assert notes and "not the one the store recorded" in notes[0]


def images_by_role(prompts: Path, store: Path, model: Path, *extra: str) -> dict[str, dict[str, float]]:
    """A run of ``prompts`` on a cluster with one engine worker and one preprocessing worker (the
    ``daskgen-preprocess`` resource, no engine); each worker's image metrics, by its state (``ready``: the engine
    worker, ``preprocess``)."""
    from daskgen.deploy.local import add_preprocess_workers
    from daskgen.worker.images import image_metrics
    from daskgen.worker.plugin import plugin_status
    from tests.conftest import runs_cluster

    with runs_cluster() as (cluster, client):
        add_preprocess_workers(cluster, 1)
        client.wait_for_workers(2)
        result = run_cli(*run_args(prompts, store, model)[:-3], "--no-progress", *extra,
                         "--scheduler-address", cluster.scheduler_address)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        done = {name: metrics for name, metrics in client.run(image_metrics).items()}
        states = {address: status["state"] for address, status in client.run(plugin_status).items()}
    return {states[address]: metrics for address, metrics in done.items()}


def answers(store: Path, rows: int) -> list[list[int]]:
    """The first sample's answer of each of the first ``rows`` rows."""
    data = GenerationStore.open(store).read_region(0, rows, ("response_ids", "response_length"))
    return [data["response_ids"][r, 0, : data["response_length"][r, 0]].tolist() for r in range(rows)]


def remote_code_processor(model: Path, out: Path) -> Path:
    """A copy of ``model`` whose image processor is the folder's own code (``auto_map``; a subclass of the
    model's processor that changes nothing): transformers loads it only with ``trust_remote_code``."""
    shutil.copytree(model, out)
    (out / "tiny_processor.py").write_text(
        "from transformers import Qwen2VLImageProcessorPil\n\n\n"
        "class RemoteTinyProcessor(Qwen2VLImageProcessorPil):\n    pass\n"
    )
    config = json.loads((out / "preprocessor_config.json").read_text())
    config["image_processor_type"] = "RemoteTinyProcessor"
    config["auto_map"] = {"AutoImageProcessor": "tiny_processor.RemoteTinyProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(config))
    return out


def test_cpu_workers_preprocess_the_images_for_the_engine_worker_with_the_models_own_processor(
    tmp_path, vl_model, images
) -> None:
    """A cluster with a preprocessing worker, images kept as references, a model whose image processor is its own
    code (loaded with ``--engine-arg trust_remote_code=true``, as the client and the engine worker load it): the
    images are read, recorded and preprocessed on the preprocessing worker with that processor, the engine worker
    preprocesses none, the store records the processor and holds a reference to each file (no bytes) that reads
    back as the file, it verifies sound, and the answers equal the model's own (the processor changes nothing)."""
    from transformers import AutoImageProcessor

    model = remote_code_processor(vl_model, tmp_path / "remote-vl")
    with pytest.raises(ValueError, match="trust_remote_code"):  # the folder's processor is its own code
        AutoImageProcessor.from_pretrained(model)
    photo = [image_part(images["grace_hopper"]), {"type": "text", "text": QUESTION}]
    rows = [{"messages": user(*photo)}, {"prompt": QUESTION, "images": [str(images["noise"])]}]
    prompts = write_rows(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out.zarr"
    trust = ("--engine-arg", "trust_remote_code=true")
    by_role = images_by_role(prompts, out, model, "--image-storage", REFERENCE, *trust)
    assert by_role["preprocess"]["images"] == 2, by_role
    assert by_role["ready"].get("images", 0) == 0, "the engine worker preprocessed nothing itself"
    recorded = GenerationStore.open(out).attrs.input["image_processor"]
    assert recorded["class"] == "RemoteTinyProcessor", recorded
    files = [images["grace_hopper"], images["noise"]]
    digests = [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    assert stored_images(GenerationStore.open(out).location) == dict.fromkeys(digests, REFERENCE)
    assert not any((out / blob_key(d)).exists() for d in digests), "a reference store keeps no image bytes"
    assert [daskgen.read_image(out, d) for d in digests] == [f.read_bytes() for f in files]
    assert verify(str(out), progress=False).sound
    expected = [
        reference_generate(vl_model, template_messages(user(*photo)), [images["grace_hopper"]], 6)[1],
        reference_generate(vl_model, QUESTION, [images["noise"]], 6)[1],
    ]
    assert answers(out, 2) == expected


def test_a_vision_request_that_cannot_be_prepared_fails_alone(vl_model) -> None:
    """An image without pixels (never preprocessed) fails its own request with the cause; the engine's generation
    thread goes on, serves the next request and stays healthy (a failure before ``model.generate`` once ended the
    thread and with it every request queued behind)."""
    import asyncio

    from daskgen.engines import create_engine
    from daskgen.engines.base import FinishReason, GenerationRequest, SamplingParams
    from daskgen.engines.media import ImageInput

    unprepared = (ImageInput("h", b"", None, (1, 4, 4), (1, 4)),)

    async def scenario():
        engine = create_engine("transformers", str(vl_model))
        await engine.start()
        try:
            bad = SamplingParams(max_new_tokens=4, temperature=0.0, images=unprepared)
            failed = await engine.generate(GenerationRequest("bad", [1, 2, 3, 4, 5, 6], bad))
            good = SamplingParams(max_new_tokens=4, temperature=0.0, min_new_tokens=4)
            served = await engine.generate(GenerationRequest("good", [1, 2, 3], good))
            await engine.health()
            return failed, served
        finally:
            await engine.shutdown()

    failed, served = asyncio.run(scenario())
    assert failed.finish_reason == FinishReason.ERROR and "cannot be concatenated" in (failed.error or ""), failed
    assert served.error is None and len(served.output_ids) == 4, served
