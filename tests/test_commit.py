"""Batched commits: every partition that is ready is committed with one write per coarse chunk."""

from __future__ import annotations

import dask
import numpy as np
import pytest

from daskgen import store
from daskgen.client.commit import CommitBatch, Outcome, commit_outcomes
from daskgen.client.live import LiveRun
from daskgen.client.plan import Plan
from daskgen.config import RunConfig
from daskgen.settings import resolve


@pytest.fixture
def plan(tmp_path, monkeypatch):
    # small coarse chunks: 4 partitions of 4 rows each
    monkeypatch.setitem(dask.config.config["daskgen"], "coarse-chunk", 16)
    layout = store.Layout(
        n_prompts=40, n_samples=1, max_prompt_tokens=4, max_new_tokens=4, partition_size=4, pad_token_id=0
    )
    path = tmp_path / "s.zarr"
    created = store.GenerationStore.create(path, store.StoreAttrs(layout), [f"r{i}" for i in range(40)])
    settings = resolve(RunConfig(model="m", store=str(path), engine="simulated"), [])
    return LiveRun(Plan(settings, None, created), created.read_status(), committed_at=np.full(40, np.nan))


def test_outcomes_in_one_or_several_coarse_chunks_are_committed_exactly(plan):
    path = plan.plan.config.store
    plan.status[8] = store.FAILED  # failed in an earlier run; not in this batch: kept with its message
    store.GenerationStore.open(path).commit(8, plan.status[8:9], ["old failure"], None)
    outcomes = [
        Outcome(0, 4, done=[0, 1, 3], failed={2: "bad prompt"}, notes={}),
        Outcome(12, 16, done=[12, 13, 14, 15], failed={}, notes={13: "verifier raised"}),
        Outcome(20, 24, done=[21], failed={}, notes={}),  # rows 20, 22, 23 aborted: stay pending
        Outcome(36, 40, done=[36, 37, 38, 39], failed={}, notes={}),
    ]
    commit_outcomes(plan, outcomes)
    status = store.GenerationStore.open(path).read_status()
    expected = np.full(40, store.PENDING, dtype=status.dtype)
    expected[[0, 1, 3, 12, 13, 14, 15, 21, 36, 37, 38, 39]] = store.DONE
    expected[[2, 8]] = store.FAILED
    np.testing.assert_array_equal(status, expected)
    np.testing.assert_array_equal(plan.status, expected)
    errors = [str(e) for e in store.GenerationStore.open(path).read_region(0, 40, ("error",))["error"]]
    assert errors[2] == "bad prompt" and errors[8] == "old failure" and errors[13] == "verifier raised"
    assert all(errors[i] == "" for i in range(40) if i not in (2, 8, 13))
    committed = store.GenerationStore.open(path).read_region(0, 40, ("committed_at",))["committed_at"]
    now = expected != store.PENDING
    now[8] = False  # committed earlier (without a time): untouched
    assert np.isfinite(committed[now]).all() and np.isnan(committed[~now]).all()


def test_commit_batch_commits_the_first_at_once_then_at_most_once_per_interval(plan):
    assert dask.config.get("daskgen.commit-interval") == "0.5s"  # the shipped default (docs/architecture.md)
    with dask.config.set({"daskgen.commit-interval": "1h"}):  # read when the batch is made, once per run
        batch = CommitBatch(plan)
    assert batch.due_in() == float("inf")  # nothing queued
    batch.add([Outcome(0, 4, done=[0, 1, 2, 3], failed={}, notes={})])
    assert batch.due_in() == 0.0  # the first commit goes at once
    batch.flush()
    assert (store.GenerationStore.open(plan.plan.config.store).read_status()[:4] == store.DONE).all()
    batch.add([Outcome(4, 8, done=[4, 5, 6, 7], failed={}, notes={})])
    assert batch.due_in() > 3000  # the next waits for the interval (1 h here) ...
    batch.flush()
    assert (store.GenerationStore.open(plan.plan.config.store).read_status()[4:8] == store.PENDING).all()
    batch.flush(force=True)  # ... unless forced (a stop, the end of the run)
    assert (store.GenerationStore.open(plan.plan.config.store).read_status()[4:8] == store.DONE).all()
