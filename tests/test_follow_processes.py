"""Following a live run with real processes: a trainer-like consumer (verl ``DataProto`` per batch) beside a
real ``daskgen run``, SIGKILLed and restarted twice, on a local store and on S3 (moto's server on
loopback, a labelled stand-in for AWS); ``daskgen follow`` to a Parquet folder, killed and restarted;
a follower woken by the run's commit events on a shared Dask cluster.

The run uses the simulated engine with real time (``time_scale=1``, 8 requests at once, lognormal
lengths) so that partitions finish out of index order while the consumer is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import dask
import numpy as np
import pyarrow.parquet as pq
import pytest

import daskgen
from daskgen.analysis.accessor import open_store
from daskgen.client.interrupt import EXIT_INTERRUPTED
from tests.conftest import REPO, cli_env, popen_cli, run_cli, runs_cluster, write_prompts
from tests.test_object_store import s3, s3_server  # noqa: F401 - the moto server and bucket fixtures

pytestmark = pytest.mark.timeout(300)

LIVE_RUN = [
    *("--engine", "simulated", "--model", "sim", "--engine-arg", "time_scale=1", "--engine-arg", "max_batch=8"),
    *("--engine-arg", "length_dist=lognormal", "--engine-arg", "length_mean=10"),
    *("--max-new-tokens", "32", "--max-prompt-tokens", "128", "--partition-size", "4", "--n-samples", "2"),
    *("--n-workers", "1", "--no-progress"),
]
SLOW_STEPS = ("--engine-arg", "step_time_base_s=0.06")


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def wait_until(check, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start_consumer(store: str, out: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "follow_consumer.py"), store, str(out), str(log)],
        env=cli_env(),
        start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> None:
    assert proc.poll() is None, "the consumer ended before the test could kill it"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def count(log: Path, kind: str) -> int:
    return sum(e["event"] == kind for e in events(log))


def store_samples(store: str) -> dict[tuple[str, int], list[int]]:
    """Every generated sample of the store's done prompts: (prompt id, sample) -> padded response ids."""
    ds = open_store(store)
    done = np.flatnonzero(ds.status.values == 1)
    ids, reasons, responses = ds.prompt_id.values, ds.finish_reason.values, ds.response_ids.values
    return {
        (str(ids[r]), s): responses[r, s].tolist()
        for r in done
        for s in range(ds.sizes["sample"])
        if reasons[r, s] >= 0
    }


def check_exactly_once(store: str, out: Path, log: Path) -> None:
    """Every finished sample was consumed exactly once, the batches concatenate to the store's content, and
    nothing acknowledged was ever delivered again."""
    from verl.protocol import DataProto  # plain import, inside the test: the sglang/vllm lanes collect this module

    files = sorted(out.glob("batch-*.pkl"))
    assert [f.name for f in files] == [f"batch-{i:08d}.pkl" for i in range(len(files))]
    merged = DataProto.concat([DataProto.load_from_disk(f) for f in files])
    keys = list(
        zip(merged.non_tensor_batch["prompt_id"].tolist(), merged.non_tensor_batch["sample"].tolist(), strict=True)
    )
    assert Counter(keys).most_common(1)[0][1] == 1, "a sample was consumed twice"
    expected = store_samples(store)
    assert set(keys) == set(expected), "the consumed samples are the store's finished samples"
    assert all(merged.batch["responses"][i].tolist() == expected[k] for i, k in enumerate(keys))
    acked: set[tuple[str, int]] = set()
    delivered_last: dict[int, list] = {}
    for e in events(log):
        if e["event"] == "delivered":
            again = {tuple(s) for s in e["samples"]} & acked
            assert not again, f"acknowledged samples delivered again in batch {e['number']}: {sorted(again)[:3]}"
            delivered_last[e["number"]] = e["samples"]
        elif e["event"] == "acked":
            acked |= {tuple(s) for s in delivered_last[e["number"]]}
    assert acked == set(expected)


def follow_beside_a_run(tmp_path: Path, store: str, n_prompts: int = 120) -> None:
    """A run of ``n_prompts`` and a consumer (tests/follow_consumer.py, its log at ``tmp_path/consumer.log``)
    killed twice and restarted: every sample consumed exactly once."""
    prompts = write_prompts(tmp_path / "p.jsonl", n_prompts)
    out, log = tmp_path / "batches", tmp_path / "consumer.log"
    run = popen_cli("run", "--prompts", prompts, "--store", store, *LIVE_RUN)
    try:
        consumer = start_consumer(store, out, log)
        # first kill: in the middle of a training step (a batch delivered, not acknowledged)
        wait_until(lambda: count(log, "acked") >= 2 and count(log, "delivered") > count(log, "acked"), "a step")
        kill(consumer)
        acked = count(log, "acked")
        consumer = start_consumer(store, out, log)
        wait_until(lambda: count(log, "acked") >= acked + 2, "two more acks")  # second kill: anywhere
        kill(consumer)
        consumer = start_consumer(store, out, log)
        assert consumer.wait(timeout=200) == 0
        output, _ = run.communicate(timeout=200)
        assert run.returncode == 0, output
    finally:
        for proc in (run, consumer):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    starts = [e for e in events(log) if e["event"] == "start"]
    assert len(starts) == 3 and events(log)[-1]["event"] == "end"
    redelivered = Counter(e["number"] for e in events(log) if e["event"] == "delivered")
    assert max(redelivered.values()) == 2, "the batch killed mid-step was delivered again, once"
    check_exactly_once(store, out, log)


def test_a_killed_trainer_consumes_every_sample_of_a_live_run_exactly_once(tmp_path):
    follow_beside_a_run(tmp_path, str(tmp_path / "out.zarr"))


def test_a_killed_trainer_consumes_a_live_run_on_s3_exactly_once(tmp_path, s3):  # noqa: F811
    bucket, _ = s3
    follow_beside_a_run(tmp_path, f"s3://{bucket}/out.zarr")


def test_a_trainer_follows_an_interrupted_and_resumed_run_exactly_once(tmp_path):
    """The run is stopped (SIGTERM, exit 3) while the consumer follows it: the consumer ends with prompts still
    pending; the rerun finishes the job and the restarted consumer receives exactly the samples it lacked."""
    prompts = write_prompts(tmp_path / "p.jsonl", 120)
    store = str(tmp_path / "out.zarr")
    out, log = tmp_path / "batches", tmp_path / "consumer.log"
    # steps three times slower than LIVE_RUN's: the run must outlast the consumer's start on a loaded machine
    run = popen_cli("run", "--prompts", prompts, "--store", store, *LIVE_RUN, *SLOW_STEPS)
    consumer = start_consumer(store, out, log)
    try:
        wait_until(lambda: count(log, "acked") >= 2, "two acknowledged batches")
        assert run.poll() is None, "the run finished before the test could stop it"
        os.kill(run.pid, signal.SIGTERM)
        output, _ = run.communicate(timeout=200)
        assert run.returncode == EXIT_INTERRUPTED, output
        assert consumer.wait(timeout=200) == 0
        stopped = events(log)[-1]
        assert stopped["event"] == "end" and stopped["pending"] > 0, stopped
        rerun = run_cli("run", "--prompts", prompts, "--store", store, *LIVE_RUN, *SLOW_STEPS, timeout=200)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        consumer = start_consumer(store, out, log)
        assert consumer.wait(timeout=200) == 0
    finally:
        for proc in (run, consumer):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    finished = events(log)[-1]
    assert finished["event"] == "end" and finished["pending"] == 0, finished
    check_exactly_once(store, out, log)


def test_cli_follow_writes_each_sample_once_into_a_parquet_folder_across_a_kill(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 80)
    store, out = str(tmp_path / "out.zarr"), tmp_path / "parquet"
    run = popen_cli("run", "--prompts", prompts, "--store", store, *LIVE_RUN)
    follow = ["follow", store, "--cursor", "cli", "--format", "parquet-dir", "--batch", "8", "--out", out]
    try:
        first = popen_cli(*follow)
        wait_until(lambda: len(list(out.glob("batch-*.parquet"))) >= 2, "two parquet batches")
        kill(first)
        res = run_cli(*follow, timeout=200)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "0 failed prompts (cursor 'cli')" in res.stderr
        output, _ = run.communicate(timeout=200)
        assert run.returncode == 0, output
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    table = pq.ParquetDataset(sorted(str(p) for p in out.glob("batch-*.parquet"))).read()
    keys = list(zip(table["prompt_id"].to_pylist(), table["sample"].to_pylist(), strict=True))
    assert Counter(keys).most_common(1)[0][1] == 1
    expected = store_samples(store)
    assert set(keys) == set(expected)
    lengths = dict(zip(keys, table["response_ids"].to_pylist(), strict=True))
    assert all(expected[k][: len(ids)] == ids for k, ids in lengths.items())
    assert not list(out.glob("*.tmp")), "no half-written batch is left"


@pytest.fixture
def own_cluster():
    with runs_cluster() as (lc, client):
        yield lc, client


def test_a_follower_on_the_runs_cluster_is_woken_by_its_commit_events(tmp_path, own_cluster):
    """With a poll interval of 10 minutes, only the run's commit events can deliver within the timeout, and
    the run's announced end lets the follower end soon after the run (not at its timeout)."""
    cluster, client = own_cluster
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    store = str(tmp_path / "out.zarr")
    run = popen_cli(
        "run", "--prompts", prompts, "--store", store, *LIVE_RUN, "--scheduler-address", cluster.scheduler_address
    )
    try:
        with dask.config.set({"daskgen.follow.poll-interval": "600s"}):
            follower = daskgen.follow(store, batch_prompts=8, client=client, timeout=120, format="rows")
        with follower:
            got = [(r["prompt_id"], r["sample"]) for batch in follower for r in batch.data]
            seen = follower.events.seen if follower.events else 0
            ended = follower.events.ended_at if follower.events else None
        output, _ = run.communicate(timeout=200)
        assert run.returncode == 0, output
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert seen > 0
    assert ended is not None, "the run's end was not announced: the follower waited for its timeout"
    assert sorted(got) == sorted(store_samples(store))
