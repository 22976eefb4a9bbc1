"""``daskgen verify [--repair]`` on real stores written by real runs (CLI, LocalCluster, simulated engine)."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from daskgen import store
from daskgen.store.tools.verify import verify
from tests.conftest import run_cli, simulated_run, write_prompts
from tests.fault_tally import count, logged_requests, record, recorded

pytestmark = pytest.mark.timeout(300)

RUN = simulated_run()


def _run(tmp_path, out, log="first.log"):
    res = run_cli("run", "--prompts", tmp_path / "p.jsonl", "--store", out, *recorded(RUN, tmp_path / log))
    assert res.returncode == 0, res.stdout + res.stderr
    return res


@pytest.fixture
def finished(tmp_path):
    """A store of 20 prompts (5 partitions of 4), every row done, and a copy of its arrays."""
    write_prompts(tmp_path / "p.jsonl", 20)
    out = tmp_path / "out.zarr"
    _run(tmp_path, out)
    opened = store.GenerationStore.open(out)
    return out, opened.read_region(0, 20, opened.layout.data_arrays()), opened.read_region(0, 20, ("committed_at",))


def _flip_byte(path, offset=7):
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_fresh_store_is_sound_and_checksummed(finished):
    out, _, _ = finished
    res = run_cli("verify", out, "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "sound" in res.stdout and "20 done rows checked" in res.stdout
    status = run_cli("status", out)
    assert "checksums: CRC32C on every chunk" in status.stdout


def test_a_flipped_byte_is_found_repaired_and_regenerated_alone(finished, tmp_path):
    out, before, times = finished
    _flip_byte(out / "response_ids" / "c" / "2" / "0" / "0")  # partition rows 8..11
    res = run_cli("verify", out, "--no-progress")
    assert res.returncode == 1
    assert "checksum: response_ids chunk response_ids/c/2/0/0, rows 8..11 (id 'q8', 'q9', 'q10', ...)" in res.stdout
    res = run_cli("verify", out, "--repair", "--no-progress")
    assert res.returncode == 1 and "repaired: 1 partition(s)" in res.stdout, res.stdout
    status = store.GenerationStore.open(out).read_status()
    assert (status[8:12] == store.PENDING).all() and (np.delete(status, range(8, 12)) == store.DONE).all()
    assert store.read_store_attrs(out).runs[-1]["kind"] == "repair"
    assert run_cli("verify", out, "--no-progress").returncode == 0, "repaired rows are pending and empty"
    _run(tmp_path, out, log="rerun.log")  # the rerun regenerates rows 8..11 only
    after = store.GenerationStore.open(out)
    assert (after.read_status() == store.DONE).all()
    kept = np.delete(np.arange(20), range(8, 12))
    new_times = after.read_region(0, 20, ("committed_at",))["committed_at"]
    np.testing.assert_array_equal(new_times[kept], times["committed_at"][kept])
    assert (new_times[8:12] > times["committed_at"][8:12]).all()
    for name, values in after.read_region(0, 20, after.layout.data_arrays()).items():
        np.testing.assert_array_equal(values, before[name], err_msg=name)  # seeded: the same tokens again
    assert run_cli("verify", out, "--no-progress").returncode == 0
    tally = count(logged_requests(tmp_path / "first.log"), logged_requests(tmp_path / "rerun.log"))
    assert (tally.kept, tally.regenerated) == (16, 4), tally
    record("a flipped byte in a finished chunk: verify --repair, rerun", rows=20, tally=tally)


def test_a_corrupted_status_chunk_makes_its_rows_pending_never_a_crash(finished, tmp_path):
    out, before, _ = finished
    _flip_byte(out / "status" / "c" / "0", offset=3)
    report = verify(out, progress=False)
    assert not report.sound and [p.array for p in report.problems] == ["status"]
    assert report.rows() == list(range(20)) and report.done_rows == 0
    res = run_cli("verify", out, "--repair", "--no-progress")
    assert "1 commit chunk(s)" in res.stdout, res.stdout
    assert (store.GenerationStore.open(out).read_status() == store.PENDING).all()
    _run(tmp_path, out, log="rerun.log")
    after = store.GenerationStore.open(out)
    assert (after.read_status() == store.DONE).all()
    np.testing.assert_array_equal(after.read_region(0, 20, ("response_ids",))["response_ids"], before["response_ids"])
    assert verify(out, progress=False).sound
    tally = count(logged_requests(tmp_path / "first.log"), logged_requests(tmp_path / "rerun.log"))
    assert (tally.kept, tally.regenerated) == (20, 0), tally  # sound data: the rerun keeps every finished sample
    record("a corrupted status chunk: verify --repair, rerun", rows=20, tally=tally)


def test_broken_invariants_and_missing_chunks_name_their_rows(finished):
    out, _, _ = finished
    lengths = zarr.open_array(str(out), path="response_length", mode="r+")
    lengths[13, 1] = 99  # beyond max_new_tokens (16)
    r = 5
    assert lengths[r, 0] >= 1
    mask = zarr.open_array(str(out), path="response_mask", mode="r+")
    mask[r, 0, 0] = 0  # a single-turn response is the model's tokens only
    (out / "finish_reason" / "c" / "4" / "0").unlink()  # partition rows 16..19
    report = verify(out, progress=False)
    found = {(p.kind, p.start): p.detail for p in report.problems}
    assert found[("invariant", 13)] == "response_length outside 0..max_new_tokens"
    assert found[("invariant", r)] == "response_mask 0 inside a single-turn response"
    assert ("missing chunk", 16) in found and any(p.chunk == "finish_reason/c/4/0" for p in report.problems)
    assert report.ids[13] == "q13" and set(range(16, 20)) <= set(report.rows())
    assert {r, 13} <= set(report.rows()) and len(report.rows()) == 6


def test_verify_runs_on_a_dask_cluster(finished):
    from distributed import LocalCluster

    out, _, _ = finished
    _flip_byte(out / "prompt_ids" / "c" / "1" / "0")
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=None) as cluster:
        report = verify(out, scheduler_address=cluster.scheduler_address, progress=False)
    assert [(p.kind, p.array, p.start, p.stop) for p in report.problems] == [("checksum", "prompt_ids", 4, 8)]


def test_a_packed_store_is_verified_but_repair_asks_for_unpack(finished):
    out, _, _ = finished
    res = run_cli("pack", out, "--n-workers", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert store.GenerationStore.open(out).checksummed
    assert verify(out, progress=False).sound
    shard = next((out / "response_ids" / "c").rglob("*"))
    while shard.is_dir():
        shard = next(shard.iterdir())
    _flip_byte(shard, offset=20)
    res = run_cli("verify", out, "--repair", "--no-progress")
    assert res.returncode == 2 and "daskgen unpack" in res.stderr, res.stdout + res.stderr


def test_a_store_without_checksums_still_verifies(tmp_path, monkeypatch):
    from zarr.codecs import ZstdCodec

    from daskgen.store import generation_store

    # a store as daskgen wrote them before chunk checksums: Zstandard only
    monkeypatch.setattr(generation_store, "compressors", lambda: [ZstdCodec(level=3)])
    layout = store.Layout(8, 1, 4, 4, 4, 0)
    made = store.GenerationStore.create(tmp_path / "old.zarr", store.StoreAttrs(layout), [f"r{i}" for i in range(8)])
    monkeypatch.undo()
    assert not store.GenerationStore.open(made.location).checksummed
    report = verify(made.location, progress=False)
    assert report.sound and not report.checksummed
    assert "no chunk checksums" in report.lines()[-1]
    chunk = made.location.path / "prompt_id" / "c" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-5])  # truncated: without a checksum, only decoding can tell
    found = [(p.kind, p.array, p.start) for p in verify(made.location, progress=False).problems]
    assert found == [("decode", "prompt_id", 0)], found
