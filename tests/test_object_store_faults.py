"""Object storage that misbehaves: 503 SlowDown, 500, connection resets and slow answers on a share of
requests, an outage that outlasts the retries, refused credentials and a missing bucket.

Real parts: moto's S3 server on loopback (a test stand-in for AWS S3), a fault-injecting HTTP proxy in
front of it (``tests/s3_proxy.py``, a labelled test double), real ``daskgen run`` processes on a real
LocalCluster, obstore's own retries configured from the ``daskgen.object-store`` tunables.
"""

from __future__ import annotations

import numpy as np
import pytest

from daskgen.store.generation_store import GenerationStore
from tests.conftest import on_scheduler, popen_cli, run_cli, runs_cluster, simulated_run, write_prompts
from tests.fault_tally import Tally, count, logged_requests, record, recorded
from tests.s3_proxy import FAULTS, FaultProxy
from tests.test_object_store import _same, s3, s3_server  # noqa: F401 - the moto server and bucket fixtures

pytestmark = pytest.mark.timeout(300)

RUN = simulated_run()
#: Quick retries, so that the tests do not wait minutes (the defaults back off up to 15 s).
FAST_RETRIES = {"DASK_DASKGEN__OBJECT_STORE__INIT_BACKOFF": "10ms", "DASK_DASKGEN__OBJECT_STORE__MAX_BACKOFF": "200ms"}


def _run(prompts, url, endpoint, log=None, **env):
    """``daskgen run`` on ``url`` through ``endpoint``; with ``log``, the engine logs each request it is sent."""
    run = RUN if log is None else recorded(RUN, log)
    return run_cli(
        "run", "--prompts", prompts, "--store", url, *run, env={"AWS_ENDPOINT_URL": endpoint, **FAST_RETRIES, **env}
    )


def test_faults_on_a_share_of_requests_are_retried_and_the_data_is_exact(tmp_path, s3, s3_server):  # noqa: F811
    bucket, _ = s3
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    clean = _run(prompts, f"s3://{bucket}/clean.zarr", s3_server)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    with FaultProxy(s3_server, share=0.2, seed=1, slow_s=0.3) as proxy:
        faulty = _run(prompts, f"s3://{bucket}/faulty.zarr", proxy.url, log=tmp_path / "calls.log")
    assert faulty.returncode == 0, faulty.stdout + faulty.stderr
    assert all(proxy.injected[kind] > 0 for kind in FAULTS), proxy.injected  # every kind really happened
    _same(f"s3://{bucket}/clean.zarr", f"s3://{bucket}/faulty.zarr")
    tally = count(logged_requests(tmp_path / "calls.log"))  # the faults span the run: every request is "before"
    assert tally == Tally(kept=24, regenerated=0, continued=0), f"retried requests regenerate no row: {tally}"
    record("object store: 503 / 500 / reset on reads / slow answers on 20% of requests", rows=24, tally=tally)


def test_writes_whose_connection_drops_are_retried_and_the_data_is_exact(tmp_path, s3, s3_server):  # noqa: F811
    """Dropped writes: a PUT reset before it reached the server, or after the server stored it (its answer
    lost).  Chunk PUTs replace the object whole, so a retry is safe either way."""
    bucket, _ = s3
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    clean = _run(prompts, f"s3://{bucket}/clean.zarr", s3_server)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    with FaultProxy(s3_server, share=0.3, seed=3, reset_writes=True, methods=("PUT",)) as proxy:
        faulty = _run(prompts, f"s3://{bucket}/faulty.zarr", proxy.url, log=tmp_path / "calls.log")
    assert faulty.returncode == 0, faulty.stdout + faulty.stderr
    assert proxy.injected["reset-put"] > 0 and proxy.injected["reset-after-put"] > 0, proxy.injected
    _same(f"s3://{bucket}/clean.zarr", f"s3://{bucket}/faulty.zarr")
    tally = count(logged_requests(tmp_path / "calls.log"))  # the faults span the run: every request is "before"
    assert tally == Tally(kept=24, regenerated=0, continued=0), f"retried requests regenerate no row: {tally}"
    record("object store: PUT connection reset (before / after it landed)", rows=24, tally=tally)


def test_an_outage_that_outlasts_the_retries_stops_the_run_and_the_rerun_completes(tmp_path, s3, s3_server):  # noqa: F811
    bucket, _ = s3
    prompts = write_prompts(tmp_path / "p.jsonl", 80)
    url = f"s3://{bucket}/out.zarr"
    few = {"DASK_DASKGEN__OBJECT_STORE__MAX_RETRIES": "2", "DASK_DASKGEN__OBJECT_STORE__RETRY_TIMEOUT": "2s"}
    slow = ["--engine-arg", "time_scale=1", "--engine-arg", "max_batch=8"]  # one partition at a time, ~0.3 s each
    with FaultProxy(s3_server) as proxy:
        proxy.outage_after = ("/status/c/", 1)  # the outage begins after the first commit: mid-run on any machine
        env = {"AWS_ENDPOINT_URL": proxy.url, **FAST_RETRIES, **few}
        run = recorded(RUN, tmp_path / "first.log")
        client = popen_cli("run", "--prompts", prompts, "--store", url, *run, *slow, env=env)
        output, _ = client.communicate(timeout=200)
    assert client.returncode == 2, output
    error = [line for line in output.splitlines() if line.startswith("error: ")]
    assert error and "failed" in error[-1] and "rerun the same command" in error[-1], output[-3000:]
    assert "Debug source" not in error[-1] and len(error[-1]) < 1000, error[-1]
    assert proxy.injected["outage"] > 0
    before = GenerationStore.open(url, {"endpoint": s3_server})
    status, times = before.read_status(), before.read_region(0, 80, ("committed_at",))["committed_at"]
    kept = status == 1
    assert 4 <= kept.sum() < 80 and not (status == 2).any(), "no row may be failed by the outage"
    rerun = _run(prompts, url, s3_server, log=tmp_path / "rerun.log")  # the outage is over
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    after = GenerationStore.open(url, {"endpoint": s3_server})
    assert (after.read_status() == 1).all()
    again = after.read_region(0, 80, ("committed_at",))["committed_at"]
    np.testing.assert_array_equal(again[kept], times[kept])  # committed once: not committed again
    clean = _run(prompts, f"s3://{bucket}/clean.zarr", s3_server, **{"DASK_DASKGEN__OBJECT_STORE__MAX_RETRIES": "0"})
    assert clean.returncode == 0, clean.stderr
    _same(url, f"s3://{bucket}/clean.zarr")
    tally = count(logged_requests(tmp_path / "first.log"), logged_requests(tmp_path / "rerun.log"))
    assert tally.kept >= kept.sum(), tally  # every committed row, at least
    record("object-store outage outlasting the retries: exit 2, rerun", rows=80, tally=tally)


def test_refused_credentials_and_a_missing_bucket_are_clear_errors_before_any_engine(tmp_path, s3, s3_server):  # noqa: F811
    bucket, env = s3
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    with FaultProxy(s3_server) as proxy:
        proxy.refused_key = env["AWS_ACCESS_KEY_ID"]
        res = _run(prompts, f"s3://{bucket}/out.zarr", proxy.url)
    assert res.returncode == 2 and "access was refused" in res.stderr and "AWS_ACCESS_KEY_ID" in res.stderr, res.stderr
    assert "engines ready" not in res.stdout + res.stderr and proxy.forwarded == 0
    res = _run(prompts, f"s3://{bucket}-missing/out.zarr", s3_server)
    assert res.returncode == 2 and "the bucket does not exist" in res.stderr, res.stderr
    assert "engines ready" not in res.stdout + res.stderr


def _worker_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "worker-key", "AWS_ENDPOINT_URL": endpoint}


def test_workers_that_cannot_reach_the_store_stop_the_run_naming_the_worker(tmp_path, s3, s3_server):  # noqa: F811
    """The client reaches the store, its worker does not (credentials set where the client runs only): the run stops
    at once with an error naming the worker and the store (exit 2), no row failed, the worker still connected (a
    store opened while Dask unpickled the task would have broken the worker's connection and left the run waiting
    for a worker for ever)."""
    bucket, _ = s3
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    url = f"s3://{bucket}/out.zarr"
    with FaultProxy(s3_server) as proxy, runs_cluster(env=_worker_env(proxy.url)) as (cluster, client):
        proxy.refused_key = "worker-key"
        env = {"AWS_ENDPOINT_URL": proxy.url, **FAST_RETRIES}
        run = on_scheduler(RUN, cluster.scheduler_address)
        res = run_cli("run", "--prompts", prompts, "--store", url, *run, env=env)
        worker = next(iter(client.scheduler_info()["workers"]))
        assert proxy.injected["bad-key"] > 0
    assert res.returncode == 2, res.stdout + res.stderr
    error = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert error and f"on worker {worker}" in error[-1] and repr(url) in error[-1], res.stderr[-3000:]
    assert "rerun the same command" in error[-1] and "Debug source" not in error[-1]
    status = GenerationStore.open(url, {"endpoint": s3_server}).read_status()
    assert not (status == 2).any() and not (status == 1).any(), "no row may be failed (or done) by the workers' storage"


def test_the_lock_heartbeat_survives_a_failed_write_and_beats_again(s3, s3_server, caplog):  # noqa: F811
    """The heartbeat's write-failure branch: storage unreachable for a beat is a warning, not the end of the
    run; the next beat after the outage refreshes the lock (same owner, newer heartbeat)."""
    import json as _json
    import logging

    import dask

    from daskgen.store.location import ObjectLocation
    from daskgen.store.records.lock import LOCK_NAME, StoreLock

    bucket, _ = s3
    with (
        FaultProxy(s3_server) as proxy,
        dask.config.set(
            {
                "daskgen.object-store.max-retries": 1,
                "daskgen.object-store.retry-timeout": "1s",
                "daskgen.object-store.init-backoff": "10ms",
            }
        ),
    ):
        where = ObjectLocation(f"s3://{bucket}/lock-test.zarr", {"endpoint": proxy.url})
        lock = StoreLock(where).acquire()
        first = _json.loads(where.read_bytes(LOCK_NAME))
        lock.heartbeat_interval = 0.0  # every call beats (the interval is what the tunable bounds)
        proxy.outage = True
        with caplog.at_level(logging.WARNING, logger="daskgen.store.records.lock"):
            lock.heartbeat()  # must not raise
        assert proxy.injected["outage"] > 0 and "could not refresh the lock" in caplog.text
        proxy.outage = False
        lock.heartbeat()
        again = _json.loads(where.read_bytes(LOCK_NAME))
        assert again["pid"] == first["pid"] and again["heartbeat"] > first["heartbeat"]
        lock.release()
        assert where.read_bytes(LOCK_NAME) is None
