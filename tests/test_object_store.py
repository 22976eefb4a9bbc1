"""Stores on object storage: a real S3-protocol server (moto's standalone server) on loopback.

The server is moto's (a test stand-in for AWS S3, labelled as such); the client side is the real
one daskgen uses in production: obstore through ``zarr.storage.ObjectStore``, real CLI processes,
real LocalCluster workers.  ``memory://`` stores are exercised in-process.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import dask
import numpy as np
import pytest
import xarray as xr
import zarr

from daskgen import store
from daskgen.analysis.accessor import open_store
from daskgen.errors import StoreError, StoreLockedError
from daskgen.store.location import LocalLocation, ObjectLocation, locate
from daskgen.store.records.lock import LOCK_NAME, StoreLock
from tests.conftest import popen_cli, run_cli, write_prompts
from tests.probing import gate_args, probe_args, wait_for_arrival
from tests.test_reliability import COMPARED
from tests.test_run import sim_args

pytestmark = pytest.mark.timeout(300)

SECRET = "S3-SECRET-planted-0123456789"


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on a free loopback port, for the whole module."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket; the standard AWS environment points at the server (also for CLI subprocesses)."""
    import boto3

    env = {
        "AWS_ACCESS_KEY_ID": "daskgen-test",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_REGION": "us-east-1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    bucket = f"daskgen-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    return bucket, env


def _objects(bucket: str, endpoint: str) -> dict[str, bytes]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _same(a, b) -> None:
    x, y = open_store(a), open_store(b)
    for name in COMPARED:
        np.testing.assert_array_equal(x[name].values, y[name].values, err_msg=name)


def test_locate_tells_urls_from_paths(tmp_path):
    assert isinstance(locate("s3://bucket/run.zarr"), ObjectLocation)
    assert isinstance(locate(tmp_path / "run.zarr"), LocalLocation)
    assert isinstance(locate(f"file://{tmp_path}/run.zarr"), LocalLocation)
    with pytest.raises(Exception, match="storage_options apply to object storage"):
        locate(tmp_path / "run.zarr", {"endpoint": "http://x"})


@pytest.mark.parametrize(
    ("answer", "meaning"),
    [
        ("GET http://h:1/b in 30.240316ms - HTTP error: error sending request", "could not be reached"),
        ("Error performing GET http://h:1/b: status 403 Forbidden", "access was refused"),
        ("<Code>InvalidAccessKeyId</Code>", "access was refused"),
        ("<Code>NoSuchBucket</Code>", "the bucket does not exist"),
        ("status 500: the service fell over", "did not answer as expected"),
    ],
)
def test_an_object_store_failure_is_named_by_its_cause(answer, meaning, monkeypatch):
    """Each failure names its own cause; digits inside a duration never read as an HTTP status."""
    where = ObjectLocation("s3://bucket/run.zarr", {"endpoint": "http://h:1"})

    def refuse(self):
        raise RuntimeError(answer)

    monkeypatch.setattr(ObjectLocation, "is_empty", refuse)
    with pytest.raises(StoreError, match=meaning):
        where.check_reachable()


def test_a_local_listing_never_shows_or_trips_on_writes_in_progress(tmp_path):
    """A writer replaces an object over and over (each write: a temporary file renamed into place) while another
    thread lists the folder, as a follower reads the workers' policy records during a run: every listing shows the
    object alone, never its temporary file, and never fails on a file renamed between listing and reading it."""
    import threading

    location, stop = LocalLocation(tmp_path / "s"), threading.Event()
    location.write_object("workers/0.json", b"{}")

    def write_again() -> None:
        while not stop.is_set():
            location.write_object("workers/0.json", b'{"state": "running"}')

    writer = threading.Thread(target=write_again)
    writer.start()
    try:
        listings = [list(location.files("workers")) for _ in range(3000)]
    finally:
        stop.set()
        writer.join()
    assert {tuple(key for key, _ in listing) for listing in listings} == {("workers/0.json",)}


def test_memory_store_create_commit_read_and_xarray():
    loc = locate(f"memory:///{uuid.uuid4().hex}")
    layout = store.Layout(10, 2, 8, 4, 5, 0)
    store.GenerationStore.create(
        loc, store.StoreAttrs(layout, **{"identity": {"model": "m"}}), [f"q{i}" for i in range(10)]
    )
    assert store.read_store_attrs(locate(loc.url)).identity == {"model": "m"}, "one process, one memory store per URL"
    store.GenerationStore.open(loc).write_region(5, {"response_length": np.full((5, 2), 3, "int32")})
    store.GenerationStore.open(loc).commit(5, np.full(5, store.DONE, "int8"), None)
    ds = open_store(loc)
    assert ds.status.values.tolist() == [0] * 5 + [1] * 5
    assert int(ds.response_length.sum()) == 30
    with pytest.raises(Exception, match="non-empty location"):
        store.GenerationStore.create(loc, store.StoreAttrs(layout), [""] * 10)


def test_s3_run_status_report_export_match_a_local_run(tmp_path, s3):
    bucket, env = s3
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    common = ["--prompts", prompts, "--n-samples", "2", "--partition-size", "4", "--seed", "7", "--no-progress"]
    local = tmp_path / "local.zarr"
    assert run_cli("run", *sim_args(tmp_path, local, *common, log="a.log")).returncode == 0
    url = f"s3://{bucket}/runs/out.zarr"
    res = run_cli("run", *sim_args(tmp_path, url, *common, log="b.log"), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "24 done, 0 failed" in res.stdout
    objects = _objects(bucket, env["AWS_ENDPOINT_URL"])
    assert "runs/out.zarr/zarr.json" in objects and f"runs/out.zarr/{LOCK_NAME}" not in objects
    assert not [k for k, v in objects.items() if SECRET.encode() in v], "credentials must never reach the store"
    _same(local, url)
    status = run_cli("status", url, env=env)
    assert status.returncode == 0 and "done 24" in status.stdout, status.stdout + status.stderr
    out = tmp_path / "out.jsonl"
    exported = run_cli("export", url, "--format", "jsonl", "--out", out, "--no-text", "--no-raw-prompts", env=env)
    assert exported.returncode == 0, exported.stderr
    assert len(out.read_text().splitlines()) == 48
    zipped = tmp_path / "out.zarr.zip"
    assert run_cli("export", url, "--format", "zip", "--out", zipped, env=env).returncode == 0
    with zarr.storage.ZipStore(zipped, mode="r") as zs:
        assert (xr.open_zarr(zs).status.values == store.DONE).all()
    report = run_cli("report", url, "--out", tmp_path / "r.html", env=env)
    assert report.returncode == 0 and (tmp_path / "r.html").stat().st_size > 1000, report.stderr


def test_storage_options_in_the_config_are_used_and_never_stored(tmp_path, s3, monkeypatch):
    bucket, env = s3
    for key in env:
        monkeypatch.delenv(key)
    options = {
        "endpoint": env["AWS_ENDPOINT_URL"],
        "access_key_id": env["AWS_ACCESS_KEY_ID"],
        "secret_access_key": SECRET,
        "region": "us-east-1",
    }
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"storage_options": options}))
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    url = f"s3://{bucket}/cfg.zarr"
    clean = {k: "" for k in env}  # the CLI must not find credentials in its environment
    res = run_cli(
        "run", *sim_args(tmp_path, url, "--prompts", prompts, "--partition-size", "4", "--config", cfg), env=clean
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert SECRET not in res.stdout + res.stderr
    objects = _objects(bucket, options["endpoint"])
    assert not [k for k, v in objects.items() if SECRET.encode() in v or b'"storage_options"' in v]
    assert (store.GenerationStore.open(ObjectLocation(url, options)).read_status() == store.DONE).all()


def test_object_lock_refuses_a_second_client_takes_over_stale_and_detects_loss(s3):
    bucket, _ = s3
    loc = locate(f"s3://{bucket}/lock.zarr")
    first = StoreLock(loc).acquire()
    with pytest.raises(StoreLockedError, match="in use by another daskgen run"):
        StoreLock(loc).acquire()
    # a lock of another host whose heartbeat stopped is taken over with a conditional (If-Match) write
    data, version = loc.read_versioned(LOCK_NAME)
    stale = {**json.loads(data), "host": "elsewhere", "heartbeat": time.time() - 999}
    assert loc.replace_object(LOCK_NAME, json.dumps(stale).encode(), version) is not None
    second = StoreLock(loc).acquire()
    assert second.took_over["host"] == "elsewhere"
    with pytest.raises(StoreLockedError, match="lost the lock"):
        first.heartbeat(force=True)  # the first client's next write finds out it lost the lock
    second.heartbeat(force=True)  # still ours
    second.release()
    assert loc.read_bytes(LOCK_NAME) is None


def test_s3_second_client_refused_client_killed_then_resumed(tmp_path, s3):
    bucket, env = s3
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    common = ["--prompts", prompts, "--partition-size", "4", "--window", "1", "--seed", "3", "--no-progress"]
    local = tmp_path / "local.zarr"
    assert run_cli("run", *sim_args(tmp_path, local, *common, log="ref.log")).returncode == 0
    url, gate = f"s3://{bucket}/kill.zarr", tmp_path / "gate"
    # the probe engine holds the last partition until `gate` exists (never): the first run is still going
    first = popen_cli("run", *probe_args(tmp_path, url, *common, *gate_args(gate, [36, 37, 38, 39])), env=env)
    try:
        wait_for_arrival(tmp_path / "events.log", first, row=36)
        _wait_done(url, first, minimum=36)
        assert locate(url).read_bytes(LOCK_NAME) is not None, "the first run holds the lock"
        second = run_cli("run", *probe_args(tmp_path, url, *common, events="second.log"), env=env)
        assert first.poll() is None, "the first run was still going while the second one started"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert second.returncode == 2, second.stdout + second.stderr
    assert "in use by another daskgen run" in second.stderr and f"pid {first.pid}" in second.stderr
    assert not (tmp_path / "second.log").exists(), "the refused run generated nothing"
    assert (store.GenerationStore.open(url).read_status() == store.DONE).sum() == 36, (
        "all but the held partition committed"
    )
    assert locate(url).read_bytes(LOCK_NAME) is not None, "a killed client leaves its lock behind"
    third = run_cli("run", *probe_args(tmp_path, url, *common, events="third.log"), env=env)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "40 done" in third.stdout and locate(url).read_bytes(LOCK_NAME) is None
    _same(local, url)


def test_s3_worker_sigkill_mid_run_completes(tmp_path, s3, monkeypatch):
    import dask
    from distributed import Client, LocalCluster

    bucket, env = s3
    prompts = write_prompts(tmp_path / "p.jsonl", 64)
    common = [
        "--prompts",
        prompts,
        "--n-samples",
        "2",
        "--partition-size",
        "4",
        "--seed",
        "11",
        "--window",
        "1",
        "--no-progress",
    ]
    local = tmp_path / "local.zarr"
    assert run_cli("run", *sim_args(tmp_path, local, *common, log="ref.log")).returncode == 0
    url = f"s3://{bucket}/workers.zarr"
    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        proc = popen_cli(
            "run",
            *sim_args(tmp_path, url, *common, "--scheduler-address", lc.scheduler_address, log="run.log", step=1.0),
            env=env,
        )
        _wait_done(url, proc, minimum=8)
        victim = sorted(client.run(os.getpid).items())[0][1]
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=240) == 0, proc.stdout.read()
    _same(local, url)


def _wait_done(url: str, proc, minimum: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run ended before the kill: {proc.stdout.read()}"
        if (
            store.read_store_attrs(url) is not None
            and (store.GenerationStore.open(url).read_status() == store.DONE).sum() >= minimum
        ):
            return
        time.sleep(0.1)
    raise AssertionError("no partition finished in time")


def test_pack_on_object_storage_needs_out_and_reads_the_same(tmp_path, s3):
    from daskgen.errors import PackError
    from daskgen.store.tools.pack import pack

    bucket, env = s3
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    url = f"s3://{bucket}/src.zarr"
    res = run_cli("run", *sim_args(tmp_path, url, "--prompts", prompts, "--partition-size", "4"), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    with pytest.raises(PackError, match="cannot rename: pass --out"):
        pack(url, n_workers=1)
    # a copy task that never finishes (about one pack in twenty here) gets a new local cluster within the test's limit
    with dask.config.set({"daskgen.pack.stall-timeout": "60s"}):
        result = pack(url, f"s3://{bucket}/packed.zarr", n_workers=1)
    assert result.files_after < result.files_before
    _same(url, f"s3://{bucket}/packed.zarr")
    assert store.read_store_attrs(f"s3://{bucket}/packed.zarr").packed
