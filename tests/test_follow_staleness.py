"""``daskgen.follow(max_staleness=k)``: too-stale samples flagged, or their prompts sent back for generation.

Stores are written through the client's real commit path (test_follow.py's helpers): prompt ``r``'s samples
start on policy version ``r % 3``; the policy record's newest version is 3, so with ``max_staleness=1`` only
the prompts at version 2 are fresh.  With no run writing the store, the requeue record is taken by the next
run's client (:func:`daskgen.client.requeue.take_requeued`, on a live run read back from the store as
``daskgen run`` does), and once by a real ``daskgen run`` (the simulated engine) to check the run's own path.
A run writing the store takes it while it streams: test_requeue_live.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import numpy as np
import pytest

import daskgen
from daskgen import store
from daskgen.client.commit import commit_rows
from daskgen.client.live import LiveRun
from daskgen.client.requeue import take_requeued
from daskgen.errors import FollowError, StoreError
from daskgen.store.layout import DONE, PENDING
from daskgen.store.records.requeue import read_requeue
from tests.conftest import run_cli, simulated_run, write_prompts
from tests.test_follow import PART, SAMPLES, N, finish, new_run

pytestmark = pytest.mark.timeout(180)

FRESH = [r for r in range(N) if r % 3 == 2]  # version 2: one behind the newest (3)
STALE = [r for r in range(N) if r % 3 != 2]


@pytest.fixture
def written(tmp_path):
    """A store of N done prompts at versions r % 3, policy version 3 published."""
    run = new_run(tmp_path)
    for start in range(0, N, PART):
        finish(run, start)
    (tmp_path / "step3").mkdir()
    daskgen.publish_policy(run.plan.config.store, str(tmp_path / "step3"), 3)
    return run


def delivered(path, **options) -> list:
    return list(daskgen.follow(path, batch_prompts=4, wait=False, **options))


def test_flag_mode_delivers_everything_and_flags_samples_too_stale_in_every_format(written):
    from verl.protocol import DataProto

    path = written.plan.config.store
    batches = delivered(path, max_staleness=1, format="rows")
    rows = [r for b in batches for r in b.data]
    assert sorted({r["prompt_index"] for r in rows}) == list(range(N))
    assert all(r["stale"] == (r["policy_version"] < 2) for r in rows) and sum(r["stale"] for r in rows) == 22
    assert sum(b.stale for b in batches) == len(STALE) * SAMPLES and not any(len(b.requeued) for b in batches)
    ds = delivered(path, max_staleness=1, cursor="x")[0].data
    assert ds["stale"].dims == ("prompt", "sample")
    assert ds["stale"].values.any(axis=1).tolist() == [r % 3 != 2 for r in ds.prompt_index.values]
    dp = delivered(path, max_staleness=1, cursor="dp", format="dataproto")[0].data
    td = delivered(path, max_staleness=1, cursor="td", format="tensordict")[0].data
    assert isinstance(dp, DataProto) and dp.non_tensor_batch["stale"].tolist() == td["stale"].tolist()
    assert dp.non_tensor_batch["stale"].tolist() == (dp.non_tensor_batch["policy_version"] < 2).tolist()
    assert "stale" not in delivered(path, cursor="plain", format="rows")[0].data[0], "only with max_staleness"
    assert [r["stale"] for b in delivered(path, max_staleness=3, cursor="k3", format="rows") for r in b.data] == [
        False
    ] * N * SAMPLES
    saved = json.loads((path_of(written) / "daskgen.cursors" / "default.json").read_text())
    assert (saved["max_staleness"], saved["stale"], saved["requeued"]) == (1, 22, 0)
    assert not read_requeue(written.plan.store.location), "flag mode never sends anything back"


def path_of(run):
    from pathlib import Path

    return Path(run.plan.config.store)


def test_regenerate_sends_stale_groups_back_and_the_next_run_generates_them_exactly_once(written):
    path = written.plan.config.store
    batches = delivered(path, max_staleness=1, stale="regenerate")
    got = [r for b in batches for r in b.prompts.tolist()]
    assert sorted(got) == FRESH and all(len(b) == 4 for b in batches[:-1])
    assert sorted(r for b in batches for r in b.requeued.tolist()) == STALE
    assert all(not b.data["stale"].values.any() for b in batches)
    seqs = written.plan.store.read_region(0, N, ("commit_seq",))["commit_seq"]
    assert read_requeue(written.plan.store.location) == {(r, int(seqs[r])) for r in STALE}
    assert run_cli("status", path).stdout.count(
        f"max staleness 1: 0 stale samples delivered flagged, {len(STALE)} prompts requeued"
    )
    assert delivered(path, max_staleness=1, stale="regenerate") == [], "the cursor passed them: not again"

    nxt = next_run(written)  # the next run on the store takes the record
    assert take_requeued(nxt) == len(STALE) and take_requeued(nxt) == 0
    status = written.plan.store.read_status()
    assert np.flatnonzero(status == PENDING).tolist() == STALE and not read_requeue(written.plan.store.location)
    reasons = written.plan.store.read_region(0, N, ("finish_reason",))["finish_reason"]
    assert (reasons[STALE] == -1).all() and (reasons[FRESH] >= 0).all(), "stale samples cleared: none is kept"
    for start in range(0, N, PART):  # generated again, on version 3
        regenerate(nxt, start, version=3)
    again = delivered(path, max_staleness=1, stale="regenerate")
    assert sorted(r for b in again for r in b.prompts.tolist()) == STALE and not any(len(b.requeued) for b in again)
    assert sorted([*got, *(r for b in again for r in b.prompts.tolist())]) == list(range(N)), "each exactly once"


def next_run(run) -> LiveRun:
    """A live run over the store as a new ``daskgen run`` reads it (status, commit times and numbers)."""
    st = run.plan.store
    record = st.read_region(0, N, ("committed_at", "commit_seq"))
    seq = record["commit_seq"].astype("int64")
    return LiveRun(run.plan, st.read_status(), record["committed_at"], seq, int(seq.max()))


def regenerate(run: LiveRun, start: int, version: int) -> None:
    """The pending rows of a partition generated (as a worker does: the others kept), then committed."""
    st, stop = run.plan.store, start + PART
    pending = [r for r in range(start, stop) if run.status[r] == PENDING]
    if not pending:
        return
    region = st.read_region(start, stop, run.plan.layout.data_arrays())
    at = np.array(pending) - start
    region["policy_version"][at] = version
    region["finish_reason"][at] = 0
    region["response_length"][at] = 3
    st.write_region(start, region)
    commit_rows(run, start, stop, {}, done=pending)


def test_a_requeue_entry_for_a_row_generated_again_since_is_dropped(written):
    from daskgen.store.records.requeue import add_requeue

    add_requeue(written.plan.store.location, [(0, 999), (1, 1)])  # row 0: another commit; row 1: its own
    seq1 = int(written.plan.store.read_region(0, N, ("commit_seq",))["commit_seq"][1])
    assert seq1 == 1
    assert take_requeued(next_run(written)) == 1
    status = written.plan.store.read_status()
    assert (status[0], status[1]) == (DONE, PENDING) and not read_requeue(written.plan.store.location)


def test_bad_staleness_options_are_refused(written):
    path = written.plan.config.store
    with pytest.raises(FollowError, match="max_staleness must be an integer >= 0"):
        daskgen.follow(path, max_staleness=-1)
    with pytest.raises(FollowError, match="unknown stale mode 'drop'"):
        daskgen.follow(path, max_staleness=1, stale="drop")


def test_a_real_run_regenerates_what_a_follower_sent_back(tmp_path):
    prompts, out = write_prompts(tmp_path / "p.jsonl", 8), tmp_path / "out.zarr"
    assert run_cli("run", "--prompts", prompts, "--store", out, *simulated_run()).returncode == 0
    (tmp_path / "step2").mkdir()
    daskgen.publish_policy(out, str(tmp_path / "step2"), 2)  # the run's samples (version 0) are 2 behind
    res = run_cli("follow", out, "--max-staleness", "1", "--stale", "regenerate", "--no-wait", "--batch", "8")
    assert res.returncode == 0 and res.stdout.strip() == "", res.stderr
    assert "0 stale samples flagged, 8 prompts requeued for generation" in res.stderr, res.stderr
    assert len(read_requeue(store.locate(out))) == 8
    again = run_cli("run", "--prompts", prompts, "--store", out, *simulated_run())
    assert again.returncode == 0 and "8 prompts requeued by followers, regenerated" in again.stdout, again.stdout
    assert not read_requeue(store.locate(out))
    rows = [json.loads(line) for line in run_cli("follow", out, "--no-wait").stdout.splitlines()]
    assert sorted({r["prompt_index"] for r in rows}) == list(range(8)) and len(rows) == 8 * 2, "each once"


def test_a_packed_store_with_prompts_sent_back_asks_to_be_unpacked(written):
    path = written.plan.config.store
    assert run_cli("pack", path, "--n-workers", "1").returncode == 0
    assert sum(len(b.requeued) for b in delivered(path, max_staleness=1, stale="regenerate")) == len(STALE)
    reopened = replace(written.plan, store=store.GenerationStore.open(path))
    with pytest.raises(StoreError, match="daskgen unpack"):
        take_requeued(next_run(replace(written, plan=reopened)))
    assert (reopened.store.read_status() == DONE).all() and len(read_requeue(reopened.store.location)) == len(STALE)


def test_a_follower_ending_with_prompts_sent_back_and_no_run_says_so(written, caplog):
    path = written.plan.config.store
    with caplog.at_level(logging.WARNING, logger="daskgen.stream.batches"):
        batches = list(daskgen.follow(path, batch_prompts=4, max_staleness=1, stale="regenerate", timeout=60))
    assert sum(len(b.requeued) for b in batches) == len(STALE)
    assert f"{len(STALE)} prompt(s) sent back for generation wait in its requeue record" in caplog.text, caplog.text
