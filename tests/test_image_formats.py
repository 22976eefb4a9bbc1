"""The trainer's side of images in prompts: every format carries each sample's image hashes, spans, grids and
mRoPE delta; verl's formats carry multi_modal_data and multi_modal_inputs built once per distinct image from the
stored images; a Parquet export names images by reference or writes their bytes once; daskgen.read_image and the
xarray view give an image back by hash.  A real run of the tiny Qwen2-VL (as tests/test_images.py makes one: a
photo, a relative path, a row with two images one of which is the photo again, a text-only row; two samples
each)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

import daskgen
from daskgen.analysis import export as ex
from daskgen.errors import ExportError, StoreError, StoreMismatchError
from daskgen.formats.images import ROW_IMAGE_FIELDS
from daskgen.store.generation_store import GenerationStore
from daskgen.store.images import blob_key
from tests.conftest import run_cli
from tests.test_images import (  # images, vl_model: fixtures (sample images, the tiny Qwen2-VL)
    QUESTION,
    image_part,
    images,  # noqa: F401
    run_args,
    user,
    vl_model,  # noqa: F401
    write_rows,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def image_run(tmp_path_factory, vl_model, images):  # noqa: F811
    """One run of 4 rows x 2 samples: a photo, a relative path, two images (the photo again, as a data: URL),
    text only; returns the folder, the rows and the store."""
    folder = tmp_path_factory.mktemp("trainer")
    shutil.copy(images["gradient"], folder / "gradient.png")
    data_url = "data:image/jpeg;base64," + base64.b64encode(images["grace_hopper"].read_bytes()).decode()
    rows = [
        {"id": "photo", "messages": user(image_part(images["grace_hopper"]), {"type": "text", "text": QUESTION})},
        {"id": "relative", "messages": user(image_part("gradient.png"), {"type": "text", "text": QUESTION})},
        {"id": "two", "prompt": QUESTION, "images": [f"file://{images['noise']}", data_url]},
        {"id": "text", "prompt": QUESTION},
    ]
    store = folder / "out.zarr"
    result = run_cli(*run_args(write_rows(folder / "prompts.jsonl", rows), store, vl_model))
    assert result.returncode == 0, result.stdout + result.stderr
    return folder, rows, GenerationStore.open(store)


def followed(store, fmt: str, **options):
    batches = daskgen.follow(store.url, batch_prompts=10, wait=False, format=fmt, auto_ack=False, **options)
    return [b.data for b in batches]


def original_bytes(folder, images) -> dict[str, list[bytes]]:  # noqa: F811 - the fixture's value
    """Each row's images as the input named them (the photo's data: URL holds the photo's bytes)."""
    photo, noise = images["grace_hopper"].read_bytes(), images["noise"].read_bytes()
    return {"photo": [photo], "relative": [(folder / "gradient.png").read_bytes()], "two": [noise, photo], "text": []}


def test_rows_and_arrow_carry_each_samples_image_spans_hashes_and_grids(image_run, images) -> None:  # noqa: F811
    """Per sample: the spans index exactly the image placeholder tokens of the sample's prompt, the hashes name the
    stored bytes of the input's images, the grids and rope_delta are the store's; Arrow holds the same values."""
    folder, _, store = image_run
    pad = store.attrs.input["image_token_id"]
    (records,) = followed(store, "rows")
    (table,) = followed(store, "arrow")
    assert len(records) == 8  # 4 prompts x 2 samples
    assert table.select(list(ROW_IMAGE_FIELDS)).to_pylist() == [{k: r[k] for k in ROW_IMAGE_FIELDS} for r in records]
    stored = store.read_region(0, 4, ("image_grid", "rope_delta"))
    originals = original_bytes(folder, images)
    for record in records:
        ids, row = record["prompt_ids"], record["prompt_index"]
        expected = originals[record["prompt_id"]]
        assert record["image_hash"] == [hashlib.sha256(b).hexdigest() for b in expected]
        assert record["image_key"] == [blob_key(h) for h in record["image_hash"]]
        assert record["image_modality"] == ["image"] * len(expected)
        covered = set()
        for offset, length in zip(record["image_offset"], record["image_length"], strict=True):
            assert length > 0 and set(ids[offset : offset + length]) == {pad}, (row, offset, length)
            assert ids[offset - 1] != pad and ids[offset + length] != pad  # the whole run of placeholders
            covered |= set(range(offset, offset + length))
        assert covered == {i for i, t in enumerate(ids) if t == pad}, f"row {row}: a placeholder outside the spans"
        assert record["image_grid"] == stored["image_grid"][row, : len(expected)].tolist()
        assert record["rope_delta"] == int(stored["rope_delta"][row])
        for digest, data in zip(record["image_hash"], expected, strict=True):
            assert daskgen.read_image(store.url, digest) == data
    assert any(r["rope_delta"] != 0 for r in records)
    assert [r["image_hash"] for r in records if r["prompt_id"] == "text"] == [[], []]


def test_verl_formats_carry_multi_modal_inputs_made_once_per_distinct_image(image_run, vl_model, images) -> None:  # noqa: F811
    """DataProto and TensorDict: multi_modal_inputs' pixel values equal the processor's output for the original
    images (concatenated for a row with two), grids and images_seqlens match; multi_modal_data holds the decoded
    images; a prompt's samples share one dict (the same tensors), a single image's tensor is shared across
    prompts, and each distinct image is processed once."""
    import torch
    from PIL import Image

    from daskgen.images.processor import ImageProcessing

    folder, _, store = image_run
    processing = ImageProcessing(str(vl_model))
    originals = original_bytes(folder, images)
    follower = daskgen.follow(store.url, batch_prompts=10, wait=False, format="dataproto", auto_ack=False)
    (proto,) = [b.data for b in follower]
    (reader,) = follower.images.readers.values()
    assert reader.processed == 3  # photo, gradient, noise: the photo of rows 0 and 2 once
    extra = proto.non_tensor_batch
    inputs, data, ids = extra["multi_modal_inputs"], extra["multi_modal_data"], list(extra["prompt_id"])
    for i, name in enumerate(ids):
        expected = [processing.process(b) for b in originals[name]]
        if not expected:
            assert inputs[i] == {} and data[i] == {}
            continue
        pixels = np.concatenate([e.pixel_values for e in expected])
        np.testing.assert_array_equal(inputs[i]["pixel_values"].numpy(), pixels)
        assert inputs[i]["image_grid_thw"].tolist() == [list(e.grid) for e in expected]
        assert inputs[i]["images_seqlens"].tolist() == [h * w for _, h, w in (e.grid for e in expected)]
        for pil, raw in zip(data[i]["images"], originals[name], strict=True):
            np.testing.assert_array_equal(np.asarray(pil), np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")))
    first = {name: ids.index(name) for name in ids}
    for i, name in enumerate(ids):  # a prompt's samples: the same dicts, no pixel copy
        assert inputs[i] is inputs[first[name]] and data[i] is data[first[name]]
    photo = inputs[first["photo"]]["pixel_values"]
    assert data[first["two"]]["images"][1] is data[first["photo"]]["images"][0]  # one decoded photo
    assert torch.equal(inputs[first["two"]]["pixel_values"][-len(photo) :], photo)
    np.testing.assert_array_equal(
        extra["image_hash"][first["two"]], [hashlib.sha256(b).hexdigest() for b in originals["two"]]
    )
    (records,) = followed(store, "rows")  # the verl layout: the same spans, padded to the store's image slots
    spans = {r["prompt_id"]: (r["image_offset"], r["image_length"]) for r in records}
    for i, name in enumerate(ids):
        offsets, lengths = spans[name]
        assert extra["image_offset"][i].tolist() == offsets + [-1] * (2 - len(offsets))
        assert extra["image_length"][i].tolist() == lengths + [0] * (2 - len(lengths))
    assert proto.batch["position_ids"].dim() == 2  # 1-D positions per sample; mRoPE from the grids and rope_delta
    (td,) = followed(store, "tensordict")
    assert td.get("image_hash").tolist() == extra["image_hash"].tolist()
    assert torch.equal(td["image_offset"], torch.from_numpy(extra["image_offset"]))
    assert (
        td.get("multi_modal_inputs").tolist()[0]["pixel_values"]
        is td.get("multi_modal_inputs").tolist()[1]["pixel_values"]
    )


def test_a_follower_processes_each_image_once_across_batches(image_run) -> None:  # noqa: F811
    _, _, store = image_run
    follower = daskgen.follow(store.url, batch_prompts=1, wait=False, format="tensordict", auto_ack=False)
    assert len([b for b in follower]) == 4
    (reader,) = follower.images.readers.values()
    assert reader.processed == 3  # the photo of two prompts, in two batches, once


def test_multi_modal_can_be_left_out_and_a_different_processor_is_refused(image_run, vl_model, tmp_path) -> None:  # noqa: F811
    _, _, store = image_run
    (proto,) = followed(store, "dataproto", multi_modal=False)
    assert "multi_modal_inputs" not in proto.non_tensor_batch and "image_hash" in proto.non_tensor_batch
    other = tmp_path / "other"
    shutil.copytree(vl_model, other)
    config = json.loads((other / "preprocessor_config.json").read_text())
    config["max_pixels"] = int(config.get("max_pixels", 12845056)) // 2
    (other / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(StoreMismatchError, match="not the one the run used"):
        followed(store, "tensordict", image_model=str(other))
    from daskgen.formats.multimodal import StoreImages

    recorded = store.attrs.input["image_processor"]
    assert recorded["decoding"] == "exif-orientation; alpha over white", recorded
    earlier = StoreImages(store)
    earlier.recorded.pop("decoding")  # as a store written before images were decoded by the recorded rule
    with pytest.raises(StoreMismatchError, match="decoded its images by 'an earlier rule'"):
        earlier.processing  # noqa: B018 - the check runs when the processing is first needed


def test_parquet_export_names_images_by_reference_or_writes_each_once(image_run, tmp_path) -> None:  # noqa: F811
    _, _, store = image_run
    plain = ex.export(store.url, tmp_path / "ref.parquet", "parquet", text=False, raw=False)
    table = pq.read_table(plain.path)
    assert {"image_hash", "image_key", "image_offset", "image_grid", "rope_delta"} <= set(table.column_names)
    assert not (tmp_path / "ref.images.parquet").exists() and plain.images == 0
    with_bytes = ex.export(store.url, tmp_path / "b.parquet", "parquet", text=False, raw=False, images="bytes")
    side = pq.read_table(ex.image_file(with_bytes.path)).to_pylist()
    referenced = {h for hashes in table.column("image_hash").to_pylist() for h in hashes}
    assert len(side) == with_bytes.images == len(referenced) == 3  # one row per distinct image, not per sample
    for row in side:
        assert hashlib.sha256(row["image_bytes"]).hexdigest() == row["image_hash"]
        assert row["image_key"] == blob_key(row["image_hash"])
    cli = run_cli("export", store.url, "--out", tmp_path / "c.parquet", "--no-text", "--images", "bytes")
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert pq.read_table(tmp_path / "c.images.parquet").num_rows == 3 and "3 images" in cli.stdout
    with pytest.raises(ExportError, match="with --format parquet"):
        ex.export(store.url, tmp_path / "x.jsonl", "jsonl", images="bytes")
    td = ex.load_tensordict(ex.export(store.url, tmp_path / "x.td", "tensordict", text=False, raw=False).path)
    assert {"image_hash", "image_offset", "image_length", "image_grid", "rope_delta"} <= set(td.keys())


def test_read_image_and_the_xarray_view_check_the_hash(image_run, tmp_path) -> None:  # noqa: F811
    from PIL import Image

    _, _, store = image_run
    ds = daskgen.open_store(store.url)
    digest = str(ds["image_hash"].values[0, 0])
    image = ds.daskgen.image(digest)
    assert (
        isinstance(image, Image.Image)
        and image.size == Image.open(io.BytesIO(daskgen.read_image(store.url, digest))).size
    )
    with pytest.raises(StoreError, match="holds no image"):
        daskgen.read_image(store.url, "0" * 64)
    copy = tmp_path / "copy.zarr"
    shutil.copytree(store.url, copy)
    (copy / blob_key(digest)).write_bytes(b"not the image")
    with pytest.raises(StoreError, match="damaged"):
        daskgen.open_store(copy).daskgen.image(digest)


def test_a_store_without_images_adds_no_image_fields(tmp_path) -> None:
    from daskgen import formats
    from daskgen.formats.images import IMAGE_ARRAYS, IMAGE_KEY, MULTI_MODAL_FIELDS
    from daskgen.formats.read import read_block
    from daskgen.store import GenerationStore, StoreAttrs
    from daskgen.store.layout import Layout

    store = GenerationStore.create(tmp_path / "t.zarr", StoreAttrs(Layout(1, 2, 4, 4, 1, 0)), ["q0"])
    store.write_region(0, {"finish_reason": np.zeros((1, 2), np.int8)})
    block = read_block(store, np.array([0]))
    new = {*IMAGE_ARRAYS, IMAGE_KEY, *MULTI_MODAL_FIELDS}
    assert not new & set(formats.build("rows", block)[0])
    assert not new & set(formats.build("arrow", block).column_names)
    assert not new & set(formats.build("tensordict", block).keys())


def test_mrope_positions_from_the_stored_spans_equal_the_models_own(image_run, vl_model) -> None:  # noqa: F811
    """vision_position_ids of a followed DataProto (prompt and response) equal the model's get_rope_index on the
    same ids and mask; the text after each prompt's images is rope_delta off its index."""
    import torch
    from transformers import AutoModelForImageTextToText

    from daskgen.formats.mrope import mrope_positions, vision_position_ids

    _, _, store = image_run
    (proto,) = followed(store, "dataproto", multi_modal=False)
    batch, extra = proto.batch, proto.non_tensor_batch
    width = batch["prompts"].shape[1]
    ours = vision_position_ids(
        batch["attention_mask"], width, extra["image_offset"], extra["image_length"], extra["image_grid"]
    )
    model = AutoModelForImageTextToText.from_pretrained(vl_model).eval()
    pad = store.attrs.input["image_token_id"]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    types = ((ids == pad) & (torch.arange(ids.shape[1]) < width)[None, :]).int()  # placeholders of the prompt only
    grids = torch.tensor([g for row in extra["image_grid"] for g in row.tolist() if g[0]], dtype=torch.int64)
    theirs, deltas = model.model.get_rope_index(ids, types, image_grid_thw=grids, attention_mask=mask)
    np.testing.assert_array_equal(ours, theirs.permute(1, 0, 2).numpy())
    np.testing.assert_array_equal(deltas.flatten().numpy(), extra["rope_delta"])
    assert (extra["rope_delta"] != 0).any()
    both = torch.cat([batch["position_ids"][:, None], torch.from_numpy(ours)], dim=1)  # verl's layout
    assert both.shape == (len(ids), 4, ids.shape[1])
    with pytest.raises(ValueError, match="does not fit its grid"):
        mrope_positions(10, [2], [5], [[1, 4, 4]])
