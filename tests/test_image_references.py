"""Images kept as references (``image_storage: reference``): the store holds, per distinct image, the absolute URL
it was read from and its size instead of its bytes; every reader reads the file there and checks it against the
image's hash, so a referenced file that changed or vanished is named; ``daskgen verify`` checks the references;
a resume may switch how images are kept.  Real runs of the tiny Qwen2-VL (as tests/test_images.py makes them)."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import daskgen
from daskgen.analysis.export import export, image_file
from daskgen.analysis.summary import status_report
from daskgen.errors import ImageReferenceError
from daskgen.formats.multimodal import StoreImages
from daskgen.store.generation_store import GenerationStore
from daskgen.store.images import COPY, REFERENCE, blob_key, keep_image, reference_key, stored_images
from daskgen.store.location import locate
from daskgen.store.records.requeue import add_requeue
from daskgen.store.tools.image_checks import stored_image_problems
from daskgen.store.tools.verify import verify
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
from tests.test_object_store import s3, s3_server  # noqa: F401 - fixtures (moto's S3 server)

pytestmark = pytest.mark.timeout(600)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vl_model, images):  # noqa: F811
    """The same rows run twice, once with ``image_storage: copy`` and once with ``reference``: a photo named by a
    path relative to the prompt file, a row with two images (a ``file://`` URL, and a ``data:`` URL, which has no
    file to point at), a text-only row.  Returns the folder (holding the images) and the two stores."""
    folder = tmp_path_factory.mktemp("refs")
    shutil.copy(images["grace_hopper"], folder / "photo.jpg")
    shutil.copy(images["noise"], folder / "noise.png")
    data_url = "data:image/png;base64," + base64.b64encode(images["gradient"].read_bytes()).decode()
    rows = [
        {"id": "photo", "messages": user(image_part("photo.jpg"), {"type": "text", "text": QUESTION})},
        {"id": "two", "prompt": QUESTION, "images": [f"file://{folder / 'noise.png'}", data_url]},
        {"id": "text", "prompt": QUESTION},
    ]
    prompts = write_rows(folder / "prompts.jsonl", rows)
    stores = {}
    for mode in (COPY, REFERENCE):
        stores[mode] = folder / f"{mode}.zarr"
        result = run_cli(*run_args(prompts, stores[mode], vl_model, "--image-storage", mode))
        assert result.returncode == 0, result.stdout + result.stderr
    return folder, stores


def test_a_reference_store_keeps_no_image_bytes_and_reads_back_the_same_images(runs, tmp_path) -> None:
    """The reference store holds a reference per file image (absolute path, size) and the data: URL's bytes; read
    back, exported, and made into a follower's pixels, its images equal the copy store's, and both verify sound;
    status and verify say the images are references."""
    folder, stores = runs
    photo, noise = (folder / "photo.jpg").read_bytes(), (folder / "noise.png").read_bytes()
    kept = stored_images(GenerationStore.open(stores[REFERENCE]).location)
    assert stored_images(GenerationStore.open(stores[COPY]).location) == dict.fromkeys(kept, COPY)
    assert len(kept) == 3 and kept[sha(photo)] == kept[sha(noise)] == REFERENCE, kept
    (data_hash,) = [h for h, kind in kept.items() if kind == COPY]  # the data: URL's image: its bytes
    assert (
        not (stores[REFERENCE] / blob_key(sha(photo))).exists() and (stores[REFERENCE] / blob_key(data_hash)).exists()
    )
    reference = json.loads((stores[REFERENCE] / reference_key(sha(photo))).read_text())
    assert reference == {"url": str((folder / "photo.jpg").resolve()), "size": len(photo)}
    assert json.loads((stores[REFERENCE] / reference_key(sha(noise))).read_text())["url"].endswith("noise.png")
    for digest in kept:
        assert daskgen.read_image(stores[REFERENCE], digest) == daskgen.read_image(stores[COPY], digest)
    assert daskgen.read_image(stores[REFERENCE], sha(photo)) == photo
    tables = {}
    for mode, store in stores.items():
        export(store, tmp_path / f"{mode}.parquet", "parquet", text=False, images="bytes")
        tables[mode] = _image_table(image_file(tmp_path / f"{mode}.parquet"))
    assert tables[REFERENCE] == tables[COPY] and set(tables[COPY]) == set(kept)
    assert tables[REFERENCE][sha(noise)] == noise and tables[REFERENCE][data_hash] == daskgen.read_image(
        stores[COPY], data_hash
    )
    pixels = {mode: StoreImages(GenerationStore.open(store)).pixels(sha(photo)) for mode, store in stores.items()}
    assert np.array_equal(pixels[REFERENCE][0].numpy(), pixels[COPY][0].numpy())
    assert pixels[REFERENCE][1] == pixels[COPY][1]
    for store in stores.values():
        report = verify(str(store), progress=False)
        assert report.sound, report.lines()
    assert any(
        "2 as references to files outside the store" in n for n in verify(str(stores[REFERENCE]), progress=False).notes
    )
    assert "images:   3 distinct, 3 stored as bytes, 0 as references" in status_report(stores[COPY])
    assert "images:   3 distinct, 1 stored as bytes, 2 as references" in status_report(stores[REFERENCE])


def _image_table(path: Path) -> dict[str, bytes]:
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    return {row["image_hash"]: row["image_bytes"] for row in table}


def test_a_changed_or_deleted_referenced_file_is_named_by_readers_and_verify(runs, vl_model) -> None:  # noqa: F811
    """The photo's file changed (longer; then the same size, other bytes) and then deleted: read_image and a
    follower's pixels fail with the image's hash and the file's path, what was expected and what was found;
    ``daskgen verify`` finds a changed size and a missing file, ``--deep`` also a change of the same size; the
    reference rewritten to where the file lies now reads it again."""
    folder, stores = runs
    store, path = stores[REFERENCE], folder / "photo.jpg"
    original = path.read_bytes()
    digest = sha(original)
    try:
        path.write_bytes(original + b"more")
        with pytest.raises(ImageReferenceError) as changed:
            daskgen.read_image(store, digest)
        text = str(changed.value)
        assert digest in text and str(path) in text and "changed since the run read it" in text, text
        assert f"expected {len(original)} bytes" in text and f"found {len(original) + 4} bytes" in text, text
        with pytest.raises(ImageReferenceError, match="changed since the run read it"):
            StoreImages(GenerationStore.open(store)).image(digest)
        result = run_cli("verify", store, "--no-progress")
        assert result.returncode == 1 and digest in result.stdout and str(path) in result.stdout, result.stdout
        assert f"{len(original) + 4} bytes, the run read {len(original)}" in result.stdout, result.stdout

        path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # the same size: only a hash finds it
        assert verify(str(store), progress=False).sound
        result = run_cli("verify", store, "--deep", "--no-progress")
        assert result.returncode == 1 and "changed since the run read it" in result.stdout, result.stdout
        assert digest in result.stdout and str(path) in result.stdout, result.stdout

        path.unlink()
        with pytest.raises(ImageReferenceError) as deleted:
            daskgen.read_image(store, digest)
        text = str(deleted.value)
        assert digest in text and str(path) in text and "not found" in text and "Put the file back" in text, text
        report = verify(str(store), progress=False)
        (problem,) = report.problems
        assert problem.chunk == reference_key(digest) and str(path) in problem.detail, report.lines()
        assert "cannot be found" in problem.detail, problem.detail

        moved = folder / "moved" / "photo.jpg"  # the fix the error names: the reference told where the file lies
        moved.parent.mkdir()
        moved.write_bytes(original)
        (store / reference_key(digest)).write_text(json.dumps({"url": str(moved), "size": len(original)}))
        assert daskgen.read_image(store, digest) == original and verify(str(store), progress=False).sound
    finally:
        path.write_bytes(original)
        (store / reference_key(digest)).write_text(json.dumps({"url": str(path.resolve()), "size": len(original)}))
    assert daskgen.read_image(store, digest) == original


def test_a_resume_may_switch_how_images_are_kept(runs, vl_model, tmp_path) -> None:  # noqa: F811
    """A reference store resumed with ``image_storage: copy`` (its photo row sent back for generation): the photo,
    which the resumed run read again, is stored as bytes and its reference dropped; the other file image stays a
    reference; readers and verify take the mixed store, and its answers stay those of the copy run."""
    folder, stores = runs
    store = tmp_path / "mixed.zarr"
    shutil.copytree(stores[REFERENCE], store)
    opened = GenerationStore.open(store)
    add_requeue(opened.location, [(0, int(opened.array("commit_seq")[0]))])
    result = run_cli(*run_args(folder / "prompts.jsonl", store, vl_model, "--image-storage", COPY))
    assert result.returncode == 0, result.stdout + result.stderr
    photo, noise = sha((folder / "photo.jpg").read_bytes()), sha((folder / "noise.png").read_bytes())
    kept = stored_images(GenerationStore.open(store).location)
    assert kept[photo] == COPY and kept[noise] == REFERENCE, kept
    assert not (store / reference_key(photo)).exists()
    for digest in kept:
        assert daskgen.read_image(store, digest) == daskgen.read_image(stores[COPY], digest)
    report = verify(str(store), progress=False)
    assert report.sound and any("2 stored as bytes, 1 as references" in n for n in report.notes), report.lines()
    mixed = GenerationStore.open(store).read_region(0, 3, ("response_ids", "status"))
    copied = GenerationStore.open(stores[COPY]).read_region(0, 3, ("response_ids",))
    assert (mixed["status"] == 1).all() and np.array_equal(mixed["response_ids"], copied["response_ids"])


def test_a_reference_to_object_storage_is_read_and_checked_there(s3, s3_server, tmp_path) -> None:  # noqa: F811
    """An image on S3 (moto's server on loopback) kept as a reference: read back with the reader's storage options,
    its size checked with a HEAD request; overwritten with other bytes, the reader and verify name it."""
    import boto3

    bucket, _ = s3
    client, data = boto3.client("s3", endpoint_url=s3_server), b"the image's bytes"
    client.put_object(Bucket=bucket, Key="pics/a.png", Body=data)
    url, options, location = f"s3://{bucket}/pics/a.png", {"endpoint": s3_server}, locate(tmp_path / "store")
    assert keep_image(location, sha(data), data, url, REFERENCE)
    assert not keep_image(location, sha(data), data, url, REFERENCE), "kept once"
    assert json.loads(location.read_bytes(reference_key(sha(data)))) == {"url": url, "size": len(data)}
    assert daskgen.read_image(tmp_path / "store", sha(data), options) == data
    assert stored_image_problems(location, options)[0] == []
    client.put_object(Bucket=bucket, Key="pics/a.png", Body=b"other bytes")
    with pytest.raises(ImageReferenceError, match="changed since the run read it") as changed:
        daskgen.read_image(tmp_path / "store", sha(data), options)
    assert url in str(changed.value)
    ((key, why),) = stored_image_problems(location, options)[0]
    assert key == reference_key(sha(data)) and url in why and "11 bytes, the run read 17" in why, why
