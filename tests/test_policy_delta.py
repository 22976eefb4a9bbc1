"""Delta policy versions: the encoding round trip, publishing, and the node-local rebuild.

The encoding (:mod:`daskgen.store.delta_codec`) takes a tensor's raw bytes to its new bytes exactly, in bfloat16
and float32, for unchanged, sparsely and fully changed tensors; checkpoints whose tensors differ in shape are
refused with an error saying to publish in full.  With the tiny model: version 1 is published in full and later
versions as deltas; a worker that starts late rebuilds the newest version from version 1 plus every delta (or
from its own cached rebuild plus the deltas after it), the rebuild has the published fingerprint, and the
workers of a node sharing a cache rebuild once, reading what the version needs from shared storage once
(``shared_bytes``).  A labelled test double flips one value of a stored delta: the
rebuild is refused by the fingerprint check and leaves nothing in the cache.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import dask.config
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import daskgen
from daskgen import store
from daskgen.errors import PolicyDeltaError
from daskgen.store.delta_codec import decode_tensor, encode_tensor, pack, unpack
from daskgen.store.fingerprint import checkpoint_fingerprint
from daskgen.store.policy import read_versions
from daskgen.store.policy_cache import cache_folder, checkpoint_for
from daskgen.store.policy_delta import make_delta
from tests.conftest import run_cli, write_prompts

pytestmark = pytest.mark.timeout(300)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype,code", [(torch.bfloat16, "BF16"), (torch.float32, "F32")])
@pytest.mark.parametrize("share", [0.0, 0.01, 1.0])
def test_a_tensor_delta_round_trips_exactly(dtype, code, share):
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(64, 33, generator=gen).to(dtype)
    new = old.clone().reshape(-1)
    picked = torch.randperm(new.numel(), generator=gen)[: int(share * new.numel())]
    new[picked] += 1.0  # every picked value changes (|value| < 128), in every dtype
    new = new.reshape(old.shape)
    delta = encode_tensor("w", code, tuple(old.shape), raw(old), raw(new))
    assert delta.changed == int((raw_words(old) != raw_words(new)).sum()) == len(picked)
    assert delta.kind == {0.0: "same", 0.01: "sparse", 1.0: "dense"}[share]
    assert (delta.payload == b"") == (share == 0.0)
    (back,) = unpack(pack(1, 2, [delta])).tensors.values()
    assert back == delta
    assert decode_tensor(back, raw(old)).tobytes() == raw(new)


def raw_words(t: torch.Tensor) -> np.ndarray:
    return np.frombuffer(raw(t), dtype=f"<u{t.element_size()}")


def test_a_sparse_bf16_delta_is_a_fraction_of_the_tensor():
    old = torch.randn(256, 256).to(torch.bfloat16)
    new = old.clone()
    new[::16, ::16] += 1  # 1/256 of the values
    delta = encode_tensor("w", "BF16", (256, 256), raw(old), raw(new))
    assert delta.kind == "sparse" and delta.changed == 256 and len(delta.payload) < 256 * 6


@pytest.mark.parametrize("changed,kind", [(999, "sparse"), (1000, "dense")])
def test_a_bf16_tensor_is_sparse_below_a_third_of_its_values_changed(changed, kind):
    old = torch.zeros(3000, dtype=torch.bfloat16)
    new = old.clone()
    new[:changed] = 1.0
    delta = encode_tensor("w", "BF16", (3000,), raw(old), raw(new))
    assert (delta.kind, delta.changed) == (kind, changed)
    assert decode_tensor(delta, raw(old)).tobytes() == raw(new)


def test_a_blob_that_is_not_a_delta_is_refused():
    with pytest.raises(PolicyDeltaError, match="not a daskgen policy delta"):
        unpack(b"PK\x03\x04 a zip file", "s3://b/x.delta")


def checkpoint(folder: Path, **tensors: torch.Tensor) -> Path:
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_checkpoints_with_other_shapes_or_names_are_refused_with_the_fix(tmp_path):
    a = checkpoint(tmp_path / "a", w=torch.zeros(4, 4), b=torch.zeros(4))
    wider = checkpoint(tmp_path / "wider", w=torch.zeros(4, 5), b=torch.zeros(4))
    renamed = checkpoint(tmp_path / "renamed", w=torch.zeros(4, 4), bias=torch.zeros(4))
    narrower = checkpoint(tmp_path / "narrower", w=torch.zeros(4, 4, dtype=torch.bfloat16), b=torch.zeros(4))
    with pytest.raises(PolicyDeltaError, match=r"w: F32\[4, 4\] -> BF16\[4, 4\]"):
        make_delta(a, narrower, 1, 2)
    with pytest.raises(PolicyDeltaError, match=r"w: F32\[4, 4\] -> F32\[4, 5\].*Publish this version in full"):
        make_delta(a, wider, 1, 2)
    with pytest.raises(PolicyDeltaError, match=r"missing \['b'\]; added \['bias'\]"):
        make_delta(a, renamed, 1, 2)


def derived(base: Path, out: Path, change) -> Path:
    """A copy of the checkpoint folder ``base`` whose tensors ``change`` edits in place (name -> tensor)."""
    from safetensors.torch import load_file

    shutil.copytree(base, out)
    tensors = load_file(str(base / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def nudge(name: str, rows: slice):
    def change(tensors):
        tensors[name][rows] += 0.25

    return change


@pytest.fixture
def published(tiny_model, tmp_path):
    """A store with version 1 (the tiny model, in full) and versions 2 and 3 published as deltas."""
    out = tmp_path / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(store.Layout(1, 1, 4, 4, 1, 0)), ["q0"])
    v2 = derived(tiny_model, tmp_path / "v2", nudge("model.layers.0.mlp.down_proj.weight", slice(0, 3)))
    v3 = derived(v2, tmp_path / "v3", nudge("model.norm.weight", slice(None)))
    entries = [
        daskgen.publish_policy(out, str(tiny_model), 1),
        daskgen.publish_policy(out, str(v2), 2, delta=True),
        daskgen.publish_policy(out, str(v3), 3, delta=True),
    ]
    return out, entries


def test_a_late_worker_rebuilds_the_newest_version_from_the_full_one_and_every_delta(published, tmp_path):
    out, (v1, v2, v3) = published
    location = store.locate(out)
    assert (v2.base, v3.base, v1.delta) == (1, 2, None) and v2.delta.startswith("daskgen.policy.deltas/")
    sizes = {key: size for key, size in location.files("daskgen.policy.deltas")}
    full = sum(f.stat().st_size for f in Path(v1.path).glob("*.safetensors"))
    assert sizes[v2.delta] < full / 20 and sizes[v3.delta] < full / 20
    assert read_versions(location) == [v1, v2, v3]
    assert checkpoint_for(location, v1).path == v1.path  # a full version loads from its folder, as it is
    with dask.config.set({"daskgen.policy.cache-dir": str(tmp_path / "late")}):
        late = checkpoint_for(location, v3)
        assert late.rebuilt and late.delta_bytes == sizes[v2.delta] + sizes[v3.delta]
        assert Path(late.path).parent == cache_folder(location) and (Path(late.path) / "config.json").is_file()
        again = checkpoint_for(location, v3)
        assert (again.path, again.rebuilt) == (late.path, False)
    assert checkpoint_fingerprint(late.path).digest == v3.digest
    with dask.config.set({"daskgen.policy.cache-dir": str(tmp_path / "kept-v2")}):
        checkpoint_for(location, v2)
        on = checkpoint_for(location, v3)  # from its own rebuild of version 2: only version 3's delta is read
    assert on.rebuilt and on.delta_bytes == sizes[v3.delta]
    assert checkpoint_fingerprint(on.path).digest == v3.digest


def test_the_workers_of_a_node_rebuild_once(published, tmp_path):
    out, (_, _, v3) = published
    location = store.locate(out)
    found, start = [], threading.Barrier(4)

    def worker():
        start.wait()
        found.append(checkpoint_for(location, v3))

    with dask.config.set({"daskgen.policy.cache-dir": str(tmp_path / "node")}):
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert len(found) == 4 and len({f.path for f in found}) == 1
    assert sorted(f.rebuilt for f in found) == [False, False, False, True]


def test_the_workers_of_a_node_read_a_versions_bytes_from_shared_storage_once(published, tmp_path):
    out, (v1, v2, v3) = published
    location = store.locate(out)
    sizes = dict(location.files("daskgen.policy.deltas"))
    weights = sum(f.stat().st_size for f in Path(v1.path).glob("*.safetensors"))
    every_file = sum(f.stat().st_size for f in Path(v1.path).iterdir() if f.is_file())

    def two_workers(entry):
        found, start = [], threading.Barrier(2)

        def worker():
            start.wait()
            found.append(checkpoint_for(location, entry).shared_bytes)

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        return sorted(found)

    with dask.config.set({"daskgen.policy.cache-dir": str(tmp_path / "node")}):
        assert two_workers(v1) == [weights, weights]  # a full version: each engine reads its weights
        assert two_workers(v2) == [0, every_file + sizes[v2.delta]]  # the full base once, then its delta
        assert two_workers(v3) == [0, sizes[v3.delta]]  # from the node's rebuild of version 2: one delta


def flip_one_value(location, entry) -> str:
    """TEST DOUBLE of a corrupt delta: rewrites ``entry``'s stored delta with one bit of one changed value
    flipped; the tensor it changed."""
    from numcodecs.zstd import Zstd

    delta = unpack(location.read_bytes(entry.delta))
    name, tensor = next((n, t) for n, t in sorted(delta.tensors.items()) if t.kind != "same")
    body = bytearray(Zstd().decode(tensor.payload))
    body[-1] ^= 1
    tensors = {**delta.tensors, name: type(tensor)(**{**vars(tensor), "payload": bytes(Zstd(level=3).encode(body))})}
    location.write_object(entry.delta, pack(delta.base, delta.version, list(tensors.values())))
    return name


def test_a_corrupt_delta_is_refused_by_the_fingerprint_check_and_never_cached(published, tmp_path):
    out, (_, v2, v3) = published
    location = store.locate(out)
    name = flip_one_value(location, v2)
    with dask.config.set({"daskgen.policy.cache-dir": str(tmp_path / "node")}):
        refused = rf"version 2 differ from its published fingerprint in 1 of \d+ tensors \({name}\).*refused before"
        with pytest.raises(PolicyDeltaError, match=refused):
            checkpoint_for(location, v2)
        with pytest.raises(PolicyDeltaError, match="version 3 differ"):  # built on the corrupt one: refused too
            checkpoint_for(location, v3)
        assert [p.name for p in cache_folder(location).iterdir()] == [".lock"]  # no rebuild, no temporary


def test_a_first_delta_has_nothing_to_apply_to(tiny_model, tmp_path):
    out = tmp_path / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(store.Layout(1, 1, 4, 4, 1, 0)), ["q0"])
    with pytest.raises(PolicyDeltaError, match=r"no version of the store has a fingerprint.*Publish it in full"):
        daskgen.publish_policy(out, str(tiny_model), 1, delta=True)
    assert read_versions(store.locate(out)) == []


@pytest.mark.parametrize("folder", ["gone", "changed"])
def test_the_next_delta_is_made_from_the_stores_versions_when_the_publishers_folder_is(folder, published, tmp_path):
    out, (_, _, v3) = published
    location = store.locate(out)
    v4 = derived(Path(v3.path), tmp_path / "v4", nudge("lm_head.weight", slice(0, 2)))
    shutil.rmtree(v3.path)  # the trainer kept only its newest checkpoint, or wrote another in its place
    if folder == "changed":
        derived(v4, Path(v3.path), nudge("model.norm.weight", slice(0, 1)))
    with dask.config.set({"daskgen.policy.cache-dir": str(tmp_path / "publisher")}):
        entry = daskgen.publish_policy(out, str(v4), 4, delta=True)  # version 3 rebuilt from the store
    with dask.config.set({"daskgen.policy.cache-dir": str(tmp_path / "worker")}):
        assert checkpoint_fingerprint(checkpoint_for(location, entry).path).digest == entry.digest


def test_a_delta_on_a_full_version_whose_folder_changed_is_refused(tiny_model, tmp_path):
    out = tmp_path / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(store.Layout(1, 1, 4, 4, 1, 0)), ["q0"])
    v1 = derived(tiny_model, tmp_path / "v1", nudge("model.norm.weight", slice(None)))
    daskgen.publish_policy(out, str(v1), 1)
    v2 = derived(v1, tmp_path / "v2", nudge("model.norm.weight", slice(0, 1)))
    shutil.rmtree(v1)
    derived(tiny_model, v1, nudge("model.embed_tokens.weight", slice(0, 1)))  # overwritten after publishing
    with pytest.raises(PolicyDeltaError, match=r"no longer holds version 1's tensor .*publish version 2 in full"):
        daskgen.publish_policy(out, str(v2), 2, delta=True)


def test_rebuilds_older_than_cache_keep_versions_are_deleted(published, tmp_path):
    out, (_, v2, v3) = published
    location = store.locate(out)
    with dask.config.set({"daskgen.policy.cache-dir": str(tmp_path / "node"), "daskgen.policy.cache-keep": 0}):
        checkpoint_for(location, v2)
        checkpoint_for(location, v3)
        assert [p.name for p in cache_folder(location).glob("v*")] == [f"v3-{v3.digest[:16]}"]


def test_pack_keeps_the_deltas(published, tmp_path):
    from daskgen.store.tools.pack import pack
    from tests.test_run import sim_args

    out, (_, _, v3) = published
    finished = tmp_path / "run.zarr"
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    assert run_cli("run", *sim_args(tmp_path, finished, "--prompts", prompts, "--no-progress")).returncode == 0
    for entry in read_versions(store.locate(out)):  # the same versions, published to the finished run's store
        folder = entry.path if entry.delta is None else str(tmp_path / f"v{entry.version}")
        daskgen.publish_policy(finished, folder, entry.version, delta=entry.delta is not None)
    pack(finished, n_workers=1)
    with dask.config.set({"daskgen.policy.cache-dir": str(tmp_path / "node")}):
        rebuilt = checkpoint_for(store.locate(finished), read_versions(store.locate(finished))[-1])
    assert rebuilt.rebuilt and checkpoint_fingerprint(rebuilt.path).digest == v3.digest
