"""``daskgen.follow(order="window")``: input order within a sliding window, on real stores.

The window's rule checked on delivered indices (:func:`check_window`): when a prompt is delivered, it is
less than ``window`` prompts past the first prompt not delivered yet (failed prompts count as delivered
once reported).  Stores are written through the client's real commit path under the real store lock
(test_follow.py's helpers) for exact control of what is committed when; a real ``daskgen run`` (its
own LocalCluster) beside a consumer SIGKILLed and restarted checks the window and exactly-once together.
"""

from __future__ import annotations

import json

import pytest

import daskgen
from daskgen.errors import FollowError, FollowTimeout
from daskgen.store.records.lock import StoreLock
from daskgen.stream import Position
from tests.conftest import run_cli
from tests.test_follow import finish, new_run, rows_of
from tests.test_follow_processes import events, follow_beside_a_run

pytestmark = pytest.mark.timeout(300)

N = 16


def check_window(batches: list[tuple[list[int], list[int]]], window: int, n: int) -> None:
    """Each batch's (done prompts, failed prompts), in delivery order: every prompt, taken in input order
    within its batch, is less than ``window`` past the first prompt not delivered before it."""
    undelivered = set(range(n))
    for done, failed in batches:
        for row in sorted([*done, *failed]):
            head = min(undelivered)
            assert row < head + window, f"prompt {row} delivered while prompt {head} (the head) was not"
            undelivered.discard(row)


def take_ready(follower) -> list:
    """The batches a waiting follower hands out now (it stops at its first timeout)."""
    got = []
    while True:
        try:
            got.append(next(follower))
        except FollowTimeout:
            return got


def test_window_order_delivers_in_input_order_within_the_window_and_resumes_exactly(tmp_path):
    run = new_run(tmp_path, 32)
    path = run.plan.config.store
    window, commit_order = 8, (12, 4, 28, 0, 8, 20, 16, 24)  # partitions finish out of index order
    follower = daskgen.follow(path, batch_prompts=4, order="window", window=window, timeout=0.3, auto_ack=False)
    delivered = []
    with StoreLock(path):
        for start in commit_order[:5]:
            finish(run, start)
            delivered += take_ready(follower)
        assert rows_of(delivered) == [[4, 5, 6, 7], [0, 1, 2, 3], [12, 13, 14, 15], [8, 9, 10, 11]]
        delivered[1].ack()  # rows 4..7 (commit 2) and 0..3 (commit 4): commit 1 (rows 12..15) is not acknowledged
        saved = json.loads((tmp_path / "s.zarr" / "daskgen.cursors" / "default.json").read_text())
        assert (saved["seq"], saved["row"], saved["ahead"]) == (0, -1, [[2, 4, 7], [4, 0, 3]])
        assert (saved["order"], saved["window"], saved["head"]) == ("window", 8, 8)
        # a follower started again from the cursor gets the unacknowledged prompts again, under the same batch
        # numbers; the window has moved since, so in input order now
        again = daskgen.follow(path, batch_prompts=4, order="window", window=window, timeout=0.3, auto_ack=False)
        redelivered = take_ready(again)
        assert [(b.number, b.prompts.tolist()) for b in redelivered] == [(2, [8, 9, 10, 11]), (3, [12, 13, 14, 15])]
        redelivered[-1].ack()
        assert redelivered[-1].end == Position(2, 7), "the position moves over commits 1 and 2, now acknowledged"
        saved = json.loads((tmp_path / "s.zarr" / "daskgen.cursors" / "default.json").read_text())
        assert saved["ahead"] == [[4, 0, 3], [5, 8, 11]] and saved["batches"] == 4
        later = []
        for start in commit_order[5:]:
            finish(run, start)
            later += take_ready(again)
        assert rows_of(later) == [[20, 21, 22, 23], [16, 17, 18, 19], [28, 29, 30, 31], [24, 25, 26, 27]]
    check_window([(b.prompts.tolist(), list(b.failed)) for b in (*delivered[:2], *redelivered, *later)], window, 32)
    commit = rows_of(daskgen.follow(path, batch_prompts=4, cursor="c", wait=False))
    assert commit[:2] == [[12, 13, 14, 15], [4, 5, 6, 7]], "commit order of the same store, for contrast"
    later[-1].ack()
    assert list(daskgen.follow(path, order="window", wait=False)) == [], "everything acknowledged once"
    assert json.loads((tmp_path / "s.zarr" / "daskgen.cursors" / "default.json").read_text())["seq"] == 8


def test_a_blocked_head_holds_the_window_and_its_wait_is_reported_until_a_failure_moves_it(tmp_path):
    run = new_run(tmp_path)
    path = run.plan.config.store
    follower = daskgen.follow(path, batch_prompts=4, order="window", window=8, timeout=0.3, auto_ack=False)
    with StoreLock(path):
        for start in (4, 8, 12):
            finish(run, start)
        first = next(follower)
        assert first.prompts.tolist() == [4, 5, 6, 7] and first.head == 0
        with pytest.raises(FollowTimeout):
            next(follower)  # rows 8..15 are committed but past the window: the head (row 0) holds them
        stats = follower.stats
        assert (stats.head, stats.held, stats.window) == (0, 8, 8) and stats.head_wait > 0.2
        finish(run, 0, failed=(0, 1))  # the head fails: reported, and the window moves past it
        moved = next(follower)
        assert (moved.prompts.tolist(), moved.failed) == ([2, 3, 8, 9], {0: "boom 0", 1: "boom 1"})
        assert moved.head_wait > 0.2 and moved.head == 10
        assert follower.stats.held == 0
        moved.ack()
    saved = json.loads((tmp_path / "s.zarr" / "daskgen.cursors" / "default.json").read_text())
    assert saved["head"] == 10 and saved["head_wait_s"] > 0.2 and saved["max_head_wait_s"] == saved["head_wait_s"]
    shown = run_cli("status", path).stdout
    assert "window of 8 prompts, head at prompt 10, prompts held back by the head" in shown, shown
    assert "8 prompts acknowledged (2 failed) in 2 batches, 6 finished prompts after it" in shown, shown


def test_prompts_never_generated_do_not_block_the_window_once_the_run_stopped(tmp_path):
    run = new_run(tmp_path)
    path = run.plan.config.store
    follower = daskgen.follow(path, batch_prompts=3, order="window", window=4, timeout=0.3)
    with StoreLock(path):  # the run generates rows 4..7 and 12..15, then is stopped
        finish(run, 12)
        finish(run, 4)
        with pytest.raises(FollowTimeout):
            next(follower)  # all past the window of the head, row 0
    run.plan.store.append_run({"kind": "run"})  # no run writes the store: the rest comes, in input order
    assert rows_of(follower) == [[4, 5, 6], [7, 12, 13], [14, 15]]
    assert follower.pending_at_end == 8
    finish(run, 0)  # a later run generates rows 0..3: the same cursor receives them
    assert rows_of(daskgen.follow(path, order="window", window=4, wait=False)) == [[0, 1, 2, 3]]
    res = run_cli("follow", path, "--order", "window", "--window", "4", "--batch", "5", "--no-wait", "--cursor", "cli")
    assert res.returncode == 0, res.stderr
    assert [json.loads(line)["prompt_index"] for line in res.stdout.splitlines()][::2] == [*range(8), *range(12, 16)]
    assert "12 prompts in 3 batches" in res.stderr and "window of 4: prompts held back by its head" in res.stderr


def test_a_window_cursor_survives_packing_and_a_torn_one_is_a_clear_error(tmp_path):
    from daskgen.store.tools import pack as pack_module

    run = new_run(tmp_path)
    path = run.plan.config.store
    for start in (8, 0, 12, 4):
        finish(run, start)
    first = next(daskgen.follow(path, batch_prompts=4, order="window", wait=False, auto_ack=False))
    first.ack()
    assert (first.prompts.tolist(), first.end, first.ahead) == (
        [0, 1, 2, 3],
        Position(0, -1),
        ((2, 0), (2, 1), (2, 2), (2, 3)),
    )
    pack_module.pack(path, n_workers=1)
    rest = daskgen.follow(path, batch_prompts=4, order="window", wait=False)
    assert [(b.number, b.prompts.tolist()) for b in rest] == [
        (1, [4, 5, 6, 7]),
        (2, [8, 9, 10, 11]),
        (3, [12, 13, 14, 15]),
    ]
    cursor = tmp_path / "s.zarr" / "daskgen.cursors" / "default.json"
    doc = json.loads(cursor.read_text())
    assert (doc["seq"], doc["row"], doc.get("ahead")) == (4, 7, None), "every commit acknowledged: nothing ahead"
    cursor.write_text(json.dumps({**doc, "ahead": [[2, 3, 0]]}))
    with pytest.raises(FollowError, match=r"is not a daskgen cursor: ValueError: 'ahead' range \[2, 3, 0\]") as info:
        daskgen.follow(path, order="window")
    assert '"ahead": [[seq, first_row, last_row], ...]' in str(info.value)
    with pytest.raises(FollowError, match="unknown follow order 'random'"):
        daskgen.follow(path, order="random")
    with pytest.raises(FollowError, match="window must be an integer >= 1"):
        daskgen.follow(path, order="window", window=0)


@pytest.mark.slow
def test_a_killed_window_order_trainer_consumes_a_live_run_exactly_once_within_its_window(tmp_path, monkeypatch):
    window = 12
    monkeypatch.setenv("CONSUMER_ORDER", "window")
    monkeypatch.setenv("CONSUMER_WINDOW", str(window))
    store = str(tmp_path / "out.zarr")
    follow_beside_a_run(tmp_path, store, 48)  # killed mid-step, then anywhere: exactly once
    last: dict[int, tuple[list[int], list[int]]] = {}
    acked = []
    for e in events(tmp_path / "consumer.log"):
        if e["event"] == "delivered":
            last[e["number"]] = (e["prompts"], e["failed"])
        elif e["event"] == "acked":
            acked.append(last[e["number"]])
    check_window(acked, window, 48)
    shown = run_cli("status", store).stdout
    assert f"trainer: 48 prompts acknowledged (0 failed) in {len(acked)} batches" in shown, shown
    assert "window of 12 prompts, head at prompt 48" in shown, shown
