"""A run writing the store takes the requeue record while it streams: prompts a follower sends back as too stale
(``follow(..., stale="regenerate")``) are generated again in the same run and delivered once.

The unit test drives :class:`daskgen.client.requeue.LiveRequeue` on a store written through the client's real
commit path (test_follow.py's helpers) with a real Dask client for the announcements.  The live tests run a real
``daskgen run --refresh drain`` (the simulated engine behind the probe engine, which holds chosen rows at gates)
on a LocalCluster beside a follower with ``max_staleness=0``; a policy version published mid-run makes the
prompts committed before the refresh too stale.  The last row is held until the run has taken the record, so
the run takes it while it streams (by the follower's announcement, or by polling the record), not at its end; or
it is released at once, and the run takes the record in its last look before it ends.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from dataclasses import replace

import dask
import numpy as np
import pytest

import daskgen
from daskgen import store
from daskgen.client.commit import reset_rows
from daskgen.client.plan import row_tasks
from daskgen.client.requeue import LiveRequeue, take_requeued
from daskgen.input.rows import InputScan
from daskgen.store.commit_log import REQUEUE_TOPIC
from daskgen.store.layout import DONE, PENDING
from daskgen.store.policy import read_worker_policies
from daskgen.store.records.requeue import add_requeue, read_requeue
from tests.conftest import popen_cli, runs_cluster, write_prompts
from tests.probing import probe_args, wait_for_arrival
from tests.test_follow import PART, N, finish, new_run
from tests.test_follow_staleness import next_run, regenerate

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster():
    with runs_cluster() as (lc, client):
        yield lc, client


def wait_until(check, what: str, proc=None, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert proc is None or proc.poll() is None, f"the run ended before {what}: {proc.stdout.read()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)
    return found


def test_rows_sent_back_mid_run_go_pending_and_are_committed_again_with_a_newer_seq(tmp_path, cluster):
    _, client = cluster
    run = new_run(tmp_path)
    texts = [f"Question {i}" for i in range(N)]
    run = replace(run, plan=replace(run.plan, prompts=InputScan(texts, N, [f"q{i}" for i in range(N)], "texts")))
    for start in range(0, N, PART):
        finish(run, start)
    location, busy = run.plan.store.location, {PART}  # the second partition has a task in flight
    live = LiveRequeue(client, run, lambda: set(busy))
    assert live.take(force=True) == [], "nothing is taken before the run's task stream starts"
    assert list(live.track(iter([]))) == [] and live.unstarted == set()
    old = run.commit_seq.copy()
    add_requeue(location, [(1, int(old[1])), (PART + 1, int(old[PART + 1])), (2, 999)])  # row 2: another commit
    assert live.take() == [], "not due: the poll interval has not passed and nothing was announced"
    with dask.config.set({"daskgen.requeue.poll-interval": "600s"}):
        announced = LiveRequeue(client, run, lambda: set(busy), wake=threading.Event().set)
    assert not announced.due(), "its task stream has not started"
    list(announced.track(iter([])))
    assert not announced.due(), "nothing announced, the poll interval is long"
    client.log_event(REQUEUE_TOPIC, {"store": run.plan.store.url})  # as a follower on the cluster does
    assert announced.announced.wait(30) and announced.due()
    announced.close()

    assert live.take(force=True) == [1], "the busy partition's row waits; the outdated entry is dropped"
    (task,) = row_tasks(run.plan, [1])  # what the driver queues for it: its partition, that row alone
    assert (task.start, task.rows, task.inputs) == (0, [1], [{"prompt": texts[1]}])
    assert run.status[1] == PENDING and run.commit_seq[1] > old.max(), "a new commit, after every earlier one"
    stored = run.plan.store
    np.testing.assert_array_equal(stored.read_status(), run.status)
    assert (stored.read_region(1, 2, ("finish_reason",))["finish_reason"] == -1).all(), "its samples are cleared"
    assert read_requeue(location) == {(PART + 1, int(old[PART + 1]))} and run.requeued_prompts == 1
    reset_seq = int(run.commit_seq[1])
    regenerate(run, 0, version=1)  # the run generates the row again and commits it
    assert run.status[1] == DONE and run.commit_seq[1] > reset_seq
    assert stored.read_region(1, 2, ("policy_version",))["policy_version"].tolist() == [[1, 1]]

    add_requeue(location, [(1, int(old[1]))])  # a follower that read an older commit log sends it back late
    busy.clear()
    assert live.take(force=True) == [PART + 1], "the late entry is dropped; the partition now idle is taken"
    assert run.status[1] == DONE and not read_requeue(location) and run.requeued_prompts == 2
    assert (stored.read_region(1, 2, ("finish_reason",))["finish_reason"] >= 0).all(), "the new attempt is kept"
    live.close()


def test_a_run_killed_between_the_reset_and_the_clearing_leaves_the_next_run_to_clear_it(tmp_path):
    """The mid-run take's first step landed (the row committed pending), the run died before clearing its samples
    and dropping the entry: the next run, as it starts, clears the samples (none is kept) and drops the entry."""
    run = new_run(tmp_path)
    for start in range(0, N, PART):
        finish(run, start)
    add_requeue(run.plan.store.location, [(3, int(run.commit_seq[3]))])
    reset_rows(run, [3])  # then killed
    assert (run.plan.store.read_region(3, 4, ("finish_reason",))["finish_reason"] >= 0).all()
    assert take_requeued(next_run(run)) == 0, "nothing left to reset"
    assert run.plan.store.read_status()[3] == PENDING and not read_requeue(run.plan.store.location)
    assert (run.plan.store.read_region(3, 4, ("finish_reason",))["finish_reason"] == -1).all(), "cleared"


N_LIVE = 10
FIRST = 4  # rows 0..3 are generated on version 0 before the publish; row 4 is in flight (held) during it


def touch(gates, rows) -> None:
    for row in rows:
        (gates / str(row)).touch()


#: How the run notices what the follower sends back: its announcement (the record is polled too rarely to matter),
#: polling the record, or the run's last look before it ends (the last row is released while the entries wait).
WAYS = {"announced": (True, "600s"), "polled": (False, "0.1s"), "last look": (False, "600s")}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_live_run_regenerates_what_its_follower_sends_back_and_the_follower_gets_each_prompt_once(
    tmp_path, cluster, way
):
    lc, client = cluster
    announce, poll = WAYS[way]
    gates, step1 = tmp_path / "gates", tmp_path / "step1"
    gates.mkdir(), step1.mkdir()
    prompts, out = write_prompts(tmp_path / "p.jsonl", N_LIVE), tmp_path / "out.zarr"
    touch(gates, range(FIRST))
    proc = popen_cli(
        "run", "--prompts", prompts,
        *probe_args(tmp_path, out, "--engine-arg", f"gate_path={gates / '{row}'}", "--refresh", "drain"),
        *("--partition-size", "1", "--window", "1", "--n-samples", "2", "--no-progress"),
        *("--scheduler-address", lc.scheduler_address),
        env={"DASK_DASKGEN__POLICY__POLL_INTERVAL": "0.1s", "DASK_DASKGEN__REQUEUE__POLL_INTERVAL": poll},
    )  # fmt: skip
    try:
        follower = daskgen.follow(
            out, batch_prompts=2, max_staleness=0, stale="regenerate", client=client if announce else None, timeout=60
        )
        with follower:
            first = next(follower)  # two of rows 0..3, fresh: nothing was published yet
            location = store.locate(out)
            wait_for_arrival(tmp_path / "events.log", proc, FIRST)
            daskgen.publish_policy(out, str(step1), 1)
            wait_until(lambda: _worker(out, "loading", 0), "a refresh waiting for the held row", proc)
            touch(gates, [FIRST])  # finishes on version 0 (drain), then version 1 loads
            wait_until(lambda: _worker(out, "running", 1), "the worker on version 1", proc)
            touch(gates, range(FIRST + 1, N_LIVE - 1))  # the last row stays held
            batches, requeued = [first], []
            for batch in follower:
                batches.append(batch)
                requeued += batch.requeued.tolist()
                if requeued and not (gates / str(N_LIVE - 1)).exists():
                    if way == "last look":  # listed (the follower wrote it before handing the batch out)
                        assert read_requeue(location) and proc.poll() is None
                    else:
                        wait_until(lambda: not read_requeue(location), "record taken while the run streams", proc)
                    touch(gates, [N_LIVE - 1])
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    stale = set(range(FIRST + 1)) - set(first.prompts.tolist())
    assert sorted(requeued) == sorted(stale), "each prompt generated on version 0 and not delivered is sent back"
    delivered = Counter(r for b in batches for r in b.prompts.tolist())
    assert set(delivered) == set(range(N_LIVE)) and set(delivered.values()) == {1}, delivered
    versions = {int(r["prompt_index"]): r["policy_version"] for b in batches[1:] for r in _rows(b)}
    assert all(v == 1 for v in versions.values()), versions
    assert f"{len(stale)} prompts requeued by followers, regenerated" in output, output
    assert not read_requeue(store.locate(out)) and (store.GenerationStore.open(out).read_status() == DONE).all()


def _worker(out, state: str, version: int) -> bool:
    return any(w.state == state and w.version == version for w in read_worker_policies(store.locate(out)))


def _rows(batch) -> list[dict]:
    ds = batch.data
    return [
        {"prompt_index": int(i), "policy_version": int(v)}
        for i, row in zip(ds.prompt_index.values, ds.policy_version.values, strict=True)
        for v in row
    ]
