"""``daskgen pack`` / ``unpack``: real stores written by real runs, copies on a real LocalCluster."""

from __future__ import annotations

import contextlib
import math
import shutil

import numpy as np
import pytest
import zarr

from daskgen import store
from daskgen.errors import PackError, PackStalled
from daskgen.store.location import locate
from daskgen.store.tools import pack as packing
from daskgen.store.tools import pack_cluster
from tests.conftest import run_cli, write_prompts
from tests.test_run import sim_args

pytestmark = pytest.mark.timeout(300)

COMMON = ["--n-samples", "2", "--partition-size", "4", "--seed", "5", "--no-progress"]


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of 8 rows (2 partitions) so that a 40-row store has several shards per array."""
    monkeypatch.setattr(packing, "SHARD_ROWS", 8)
    monkeypatch.setattr(packing, "COARSE_SHARD_ROWS", 16)


def _run(tmp_path, out, *extra, log="calls.log", expect=0):
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    res = run_cli("run", *sim_args(tmp_path, out, "--prompts", prompts, *COMMON, *extra, log=log))
    assert res.returncode == expect, res.stdout + res.stderr
    return res


def _values(path, skip: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Every array of the store (but ``skip``), read with zarr itself (not through daskgen)."""
    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(arr[...]) for name, arr in group.arrays() if name not in skip}


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _files(path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file())


def _chunk_files(path) -> dict[str, int]:
    """Per array: its chunk (or shard) files on disk."""
    arrays = [d for d in path.iterdir() if (d / "zarr.json").is_file()]
    return {d.name: sum(1 for p in (d / "c").rglob("*") if p.is_file()) for d in arrays}


def test_pack_in_place_same_values_fewer_files_exports_the_same(tmp_path, small_shards):
    out = tmp_path / "out.zarr"
    _run(tmp_path, out)
    before, files_before, chunks_before = _values(out), _files(out), _chunk_files(out)
    assert chunks_before["response_ids"] == 10, "one file per partition of 4 rows (40 rows)"
    jsonl = tmp_path / "before.jsonl"
    assert run_cli("export", out, "-f", "jsonl", "--out", jsonl, "--no-text").returncode == 0
    result = packing.pack(out, n_workers=1)
    assert result.files_before == files_before and result.files_after == _files(out) < files_before
    assert not (tmp_path / "out.zarr.packing").exists() and not (tmp_path / "out.zarr.unpacked-old").exists()
    _assert_same(before, _values(out))
    arr = zarr.open_array(str(out), path="response_ids", mode="r")
    assert arr.shards[0] == 8 and arr.chunks[0] == 4, "shards of 2 partitions, partition-sized inner chunks"
    chunks_after = _chunk_files(out)
    assert chunks_after["response_ids"] == 5, "40 rows in shards of 8"
    for name, n in chunks_before.items():  # every array with data: one file per shard, none without
        arr = zarr.open_array(str(out), path=name, mode="r")
        grid = zip(arr.shape, arr.shards or arr.chunks, strict=True)
        shards = math.prod(math.ceil(size / rows) for size, rows in grid)
        assert chunks_after[name] == (shards if n else 0), (name, n, chunks_after[name])
    assert store.read_store_attrs(out).packed["shard_rows"]["response_ids"] == 8
    again = tmp_path / "after.jsonl"
    assert run_cli("export", out, "-f", "jsonl", "--out", again, "--no-text").returncode == 0
    assert again.read_text() == jsonl.read_text()
    status = run_cli("status", out)
    assert status.returncode == 0 and "done 40" in status.stdout
    report = run_cli("report", out, "--out", tmp_path / "r.html")
    assert report.returncode == 0 and (tmp_path / "r.html").stat().st_size > 1000, report.stderr
    with pytest.raises(PackError, match="already packed"):
        packing.pack(out, n_workers=1)


def test_every_copy_task_owns_whole_target_shards(tmp_path, small_shards):
    out = tmp_path / "out.zarr"
    _run(tmp_path, out)
    plans = packing.plan_arrays(store.GenerationStore.open(out), packing=True)
    for name, start, stop in packing.copy_tasks(plans):
        shard = plans[name]["shards"][0]
        assert start % shard == 0 and (stop - start == shard or stop == plans[name]["shape"][0]), (name, start)


def test_packed_unfinished_store_is_refused_then_unpack_and_resume(tmp_path, small_shards):
    ref = tmp_path / "ref.zarr"
    _run(tmp_path, ref, log="ref.log")
    out = tmp_path / "out.zarr"
    _run(tmp_path, out, log="first.log")
    store.GenerationStore.open(out).commit(
        12, np.full(28, store.PENDING, "int8"), None
    )  # as if the run had stopped after 12 rows
    packed = run_cli("pack", out, "--n-workers", "1")  # the CLI: one shard per array here (40 rows)
    assert packed.returncode == 0 and "packed" in packed.stdout and "files" in packed.stdout, packed.stderr
    refused = _run(tmp_path, out, log="second.log", expect=2)
    assert "it is packed" in refused.stderr and f"daskgen unpack {out}" in refused.stderr
    res = run_cli("unpack", out, "--n-workers", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert store.read_store_attrs(out).packed is None
    assert zarr.open_array(str(out), path="response_ids", mode="r").shards is None
    resumed = _run(tmp_path, out, log="third.log")
    assert "40 done" in resumed.stdout, resumed.stdout
    when = ("committed_at", "commit_seq")  # the wall time and order of commits differ between two runs
    _assert_same(_values(ref, when), _values(out, when))


def test_interrupted_pack_and_interrupted_swap_resume(tmp_path, small_shards):
    out = tmp_path / "out.zarr"
    _run(tmp_path, out)
    before = _values(out)
    source, work = store.GenerationStore.open(out), locate(tmp_path / "out.zarr.packing")
    src = source.location
    plans = packing.plan_arrays(source, packing=True)
    tasks = packing.copy_tasks(plans)
    packing.prepare_target(src, work, plans, "pack")  # a pack that copied a third of its blocks, then died
    copied = [*tasks[: len(tasks) // 3], ("response_length", 0, 8)]
    for task in copied:
        packing.copy_block(source, work, *task)
    packing.record_progress(work, {f"{n}/{s}" for n, s, _ in copied}, src, "pack")
    assert store.read_store_attrs(work) is None, "an unfinished copy is not a daskgen store"
    # then the source changed (as a run would change it) in a block the interrupted pack had copied
    store.GenerationStore.open(out).write_region(0, {"response_length": before["response_length"][:4] + 1})
    before["response_length"][:4] += 1
    packing.pack(out, n_workers=1)
    _assert_same(before, _values(out))
    # a pack that finished its copy but stopped before the swap: the next pack re-checks it and swaps
    packing.pack(out, out=tmp_path / "out.zarr.packing", unpack=True, n_workers=1)
    packing.pack(out, unpack=True, n_workers=1)
    assert store.read_store_attrs(out).packed is None and not (tmp_path / "out.zarr.packing").exists()
    _assert_same(before, _values(out))
    packing.pack(out, n_workers=1)
    # a swap that stopped between its renames is finished by the next pack
    packing.pack(out, out=tmp_path / "copy.zarr", unpack=True, n_workers=1)
    shutil.move(out, tmp_path / "out.zarr.unpacked-old")
    shutil.move(tmp_path / "copy.zarr", tmp_path / "out.zarr.packing")
    packing.pack(out, unpack=True, n_workers=1)
    assert not (tmp_path / "out.zarr.unpacked-old").exists() and store.read_store_attrs(out).packed is None
    _assert_same(before, _values(out))


def test_output_in_the_way_is_refused(tmp_path):
    out = tmp_path / "out.zarr"
    _run(tmp_path, out)
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("x")
    with pytest.raises(PackError, match="is not an interrupted pack"):
        packing.pack(out, out=other, n_workers=1)
    with pytest.raises(PackError, match="not a daskgen store"):
        packing.pack(other, n_workers=1)


@contextlib.contextmanager
def _stalling(tmp_path):
    """A store of a run to pack, its values, and a cluster without workers (no copy task on it ever finishes: it
    stands for workers lost or stuck on their storage), with ``daskgen.pack.stall-timeout`` at 2 s."""
    import dask
    from distributed import LocalCluster

    out = tmp_path / "out.zarr"
    _run(tmp_path, out)
    with (
        LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as idle,
        dask.config.set({"daskgen.pack.stall-timeout": "2s"}),
    ):
        yield out, _values(out), idle


def test_a_pack_whose_copies_never_finish_stops_naming_the_blocks_left_and_a_rerun_completes(tmp_path, small_shards):
    """On the user's cluster no copy task finishes: the pack stops after ``daskgen.pack.stall-timeout`` instead of
    waiting for ever, leaves the source as it was, and the same pack run again copies everything."""
    with (
        _stalling(tmp_path) as (out, before, idle),
        pytest.raises(PackError, match=r"no copy task finished in 2 s .*blocks left \(.* on 0 worker") as err,
    ):
        packing.pack(out, scheduler_address=idle.scheduler_address)
    assert "rerun the same command to copy the rest" in str(err.value)
    assert store.read_store_attrs(out).packed is None
    _assert_same(before, _values(out))
    packing.pack(out, n_workers=1)
    assert store.read_store_attrs(out).packed
    _assert_same(before, _values(out))


def _stalling_clusters(monkeypatch, idle, stalls: int) -> list:
    """A test double of the pack's cluster start (the real one starts the cluster of every other pack here): its first
    ``stalls`` clusters are ``idle`` (no workers: no copy ever finishes), later ones real local clusters.  Returns the
    list of the scheduler addresses asked for, one per start."""
    from distributed import Client

    real, starts = pack_cluster.cluster_client, []

    @contextlib.contextmanager
    def start(address, n_workers):
        starts.append(address)
        with Client(idle) if len(starts) <= stalls else real(address, n_workers) as client:
            yield client

    monkeypatch.setattr(pack_cluster, "cluster_client", start)
    return starts


def test_a_copy_stalled_on_the_packs_own_cluster_goes_on_on_a_new_one(tmp_path, small_shards, monkeypatch, caplog):
    """The pack's own local cluster stops finishing copies: after ``daskgen.pack.stall-timeout`` the pack closes it,
    says so, and a new local cluster copies every block (a user's cluster stops the pack instead: the test above)."""
    import logging

    with _stalling(tmp_path) as (out, before, idle), caplog.at_level(logging.WARNING, logger=pack_cluster.__name__):
        starts = _stalling_clusters(monkeypatch, idle, stalls=1)
        packing.pack(out, n_workers=1)
    assert starts == [None, None]
    assert "no copy task finished in 2 s; closing the local cluster and copying the" in caplog.text
    assert store.read_store_attrs(out).packed
    _assert_same(before, _values(out))


def test_a_copy_that_stalls_on_its_new_cluster_too_stops_and_leaves_the_store_as_it_was(
    tmp_path, small_shards, monkeypatch
):
    """Stalled on the pack's own cluster and again on the new one: the pack stops with the error naming the fix (the
    same command again), after one new cluster, the source as it was."""
    with (
        _stalling(tmp_path) as (out, before, idle),
        pytest.raises(PackStalled, match="rerun the same command to copy the rest"),
    ):
        starts = _stalling_clusters(monkeypatch, idle, stalls=2)
        packing.pack(out, n_workers=1)
    assert starts == [None] * (1 + pack_cluster.LOCAL_RESTARTS)
    assert store.read_store_attrs(out).packed is None
    _assert_same(before, _values(out))
