"""``daskgen.follow`` on real stores: commit order, acknowledgements, cursors, failed rows, waiting.

Stores are written through the client's real commit path (``client.commit.commit_rows`` on a
``LiveRun``) under the real store lock, so the commit log (``commit_seq``, the head object) is the one
a run writes; the end-to-end tests beside real ``daskgen run`` processes are in test_follow_processes.py.
verl (for ``DataProto``) is imported inside the tests that use it, plainly: the sglang and vllm lanes,
whose virtualenvs lack it, still collect this module.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import zarr

import daskgen
from daskgen import store
from daskgen.analysis.accessor import open_store
from daskgen.client.commit import commit_rows
from daskgen.client.live import LiveRun
from daskgen.client.plan import Plan
from daskgen.config import RunConfig
from daskgen.errors import FollowError, FollowTimeout
from daskgen.settings import resolve
from daskgen.store.commit_log import HEAD_KEY, read_head
from daskgen.store.layout import empty_region
from daskgen.store.records.lock import StoreLock
from daskgen.stream import Position
from tests.conftest import run_cli, simulated_run, write_prompts

pytestmark = pytest.mark.timeout(120)

N, PART, SAMPLES = 16, 4, 2


def new_run(tmp_path, n: int = N) -> LiveRun:
    """An empty store of ``n`` prompts and the client's live run over it."""
    layout = store.Layout(
        n_prompts=n, n_samples=SAMPLES, max_prompt_tokens=4, max_new_tokens=4, partition_size=PART, pad_token_id=0
    )
    path = tmp_path / "s.zarr"
    created = store.GenerationStore.create(path, store.StoreAttrs(layout), [f"q{i}" for i in range(n)])
    return LiveRun(
        Plan(resolve(RunConfig(model="m", store=str(path), engine="simulated"), []), None, created),
        created.read_status(),
        np.full(n, np.nan),
    )


def finish(run: LiveRun, start: int, failed: tuple[int, ...] = ()) -> None:
    """A partition's data lands (response tokens ``row * 10 + sample``), then the client commits it."""
    region = empty_region(run.plan.layout, PART)
    rows = np.arange(start, start + PART)
    region["prompt_length"][:] = 2
    region["prompt_ids"][:, :2] = rows[:, None]
    region["response_length"][:] = 3
    region["finish_reason"][:] = 0
    region["num_turns"][:] = 1
    region["policy_version"][:] = (rows % 3)[:, None]  # sample s continued onto version + s at position 2
    region["policy_version_end"][:] = region["policy_version"] + np.arange(SAMPLES)[None, :]
    region["version_changed_at"][:] = np.where(np.arange(SAMPLES) > 0, 2, -1)[None, :]
    region["response_ids"][:, :, :3] = (rows[:, None] * 10 + np.arange(SAMPLES)[None, :])[:, :, None]
    region["response_mask"][:, :, :3] = 1
    run.plan.store.write_region(start, region)
    done = [int(r) for r in rows if r not in failed]
    commit_rows(run, start, start + PART, {r: f"boom {r}" for r in failed}, done=done)


def rows_of(batches) -> list[list[int]]:
    return [b.prompts.tolist() for b in batches]


def test_batches_follow_commit_order_and_a_cursor_resumes_after_its_last_ack(tmp_path):
    run = new_run(tmp_path)
    path = run.plan.config.store
    with StoreLock(path):  # a live run holds the store
        for start in (8, 0, 12, 4):  # partitions finish out of index order
            finish(run, start)
        assert read_head(run.plan.store.location) == 4
        first = list(daskgen.follow(path, batch_prompts=4, wait=False, auto_ack=False))
        assert rows_of(first) == [[8, 9, 10, 11], [0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7]]
        assert [b.number for b in first] == [0, 1, 2, 3]
        first[1].ack()  # acknowledges batches 0 and 1
        again = daskgen.follow(path, batch_prompts=4, wait=False, auto_ack=False)
        nxt = next(again)
        assert (nxt.number, nxt.prompts.tolist(), nxt.start) == (2, [12, 13, 14, 15], Position(2, 3))
    saved = json.loads((tmp_path / "s.zarr" / "daskgen.cursors" / "default.json").read_text())
    assert (saved["seq"], saved["row"], saved["batches"], saved["prompts"]) == (2, 3, 2, 8)


def test_an_unacknowledged_batch_comes_again_with_its_number_and_auto_ack_acks_on_the_next(tmp_path):
    run = new_run(tmp_path)
    for start in (0, 4, 8, 12):
        finish(run, start)
    path = run.plan.config.store
    for batch in daskgen.follow(path, batch_prompts=6, wait=False):
        assert (batch.number, len(batch)) == (0, 6)
        break  # auto_ack acknowledges a batch only when the next is asked for: this one was not
    numbers = [(b.number, b.prompts.tolist()) for b in daskgen.follow(path, batch_prompts=6, wait=False)]
    assert numbers == [(0, [0, 1, 2, 3, 4, 5]), (1, [6, 7, 8, 9, 10, 11]), (2, [12, 13, 14, 15])]
    assert list(daskgen.follow(path, batch_prompts=6, wait=False)) == [], "the last batch was acknowledged at the end"


def test_auto_ack_acknowledges_a_batch_once_the_next_is_asked_for_even_if_its_step_was_not_durable(tmp_path):
    """docs/reliability.md case 19: the default gives at most once for what the trainer had not made durable."""
    run = new_run(tmp_path)
    for start in (0, 4, 8, 12):
        finish(run, start)
    path = run.plan.config.store
    seen = []
    for batch in daskgen.follow(path, batch_prompts=6, wait=False):
        seen.append(batch.number)
        if batch.number == 1:
            break  # the trainer dies during step 1; step 0 ended but its checkpoint was never written
    assert seen == [0, 1]
    again = [b.number for b in daskgen.follow(path, batch_prompts=6, wait=False)]
    assert again == [1, 2], "batch 0 was acknowledged when batch 1 was asked for, so it does not come again"


def test_named_cursors_are_independent(tmp_path):
    run = new_run(tmp_path)
    for start in (0, 4):
        finish(run, start)
    path = run.plan.config.store
    assert rows_of(daskgen.follow(path, batch_prompts=8, cursor="a", wait=False)) == [list(range(8))]
    finish(run, 8)
    assert rows_of(daskgen.follow(path, batch_prompts=8, cursor="a", wait=False)) == [[8, 9, 10, 11]]
    assert rows_of(daskgen.follow(path, batch_prompts=8, cursor="b", wait=False)) == [list(range(8)), [8, 9, 10, 11]]
    finish(run, 12)
    shown = run_cli("status", path).stdout  # where each consumer is
    assert "a: 12 prompts acknowledged (0 failed) in 2 batches, 4 finished prompts after it" in shown, shown
    assert "b: 12 prompts acknowledged (0 failed) in 2 batches, 4 finished prompts after it" in shown, shown


def test_failed_prompts_are_reported_and_a_retried_prompt_comes_once_done(tmp_path):
    run = new_run(tmp_path)
    path = run.plan.config.store
    finish(run, 0, failed=(1, 2))
    finish(run, 4)
    batches = list(daskgen.follow(path, batch_prompts=3, wait=False, format="rows"))
    assert rows_of(batches) == [[0, 3, 4], [5, 6, 7]]
    assert batches[0].failed == {1: "boom 1", 2: "boom 2"} and batches[1].failed == {}
    assert {r["prompt_index"] for r in batches[0].data} == {0, 3, 4} and len(batches[0].data) == 3 * SAMPLES
    saved = json.loads((tmp_path / "s.zarr" / "daskgen.cursors" / "default.json").read_text())
    assert (saved["prompts"], saved["failed"]) == (6, 2)
    finish(run, 0)  # --retry-failed: rows 1 and 2 done now; 0 and 3 stay done and are not delivered again
    retried = list(daskgen.follow(path, batch_prompts=3, wait=False))
    assert rows_of(retried) == [[1, 2]] and retried[0].failed == {}


def test_a_commit_counts_only_after_its_head_while_a_run_holds_the_lock(tmp_path):
    run = new_run(tmp_path)
    path, st = run.plan.config.store, run.plan.store
    finish(run, 0)
    with StoreLock(path):
        # a commit whose status landed but whose head write did not (yet): commit_seq 2 > head 1
        st.commit(4, np.full(PART, store.DONE, "int8"), None, seq=np.full(PART, 2), head=None)
        assert rows_of(daskgen.follow(path, batch_prompts=8, wait=False)) == [[0, 1, 2, 3]]
        st.location.write_object(HEAD_KEY, json.dumps({"seq": 2}).encode())
        assert rows_of(daskgen.follow(path, batch_prompts=8, wait=False)) == [[4, 5, 6, 7]]
        st.commit(8, np.full(PART, store.DONE, "int8"), None, seq=np.full(PART, 3), head=None)
    # the writer crashed before that head; with no live run the store is stable and every commit counts
    assert rows_of(daskgen.follow(path, batch_prompts=8, wait=False)) == [[8, 9, 10, 11]]


def test_waiting_for_a_full_batch_times_out_and_the_last_batch_may_be_smaller(tmp_path):
    run = new_run(tmp_path)
    path = run.plan.config.store
    with StoreLock(path):
        finish(run, 0)
        follower = daskgen.follow(path, batch_prompts=8, timeout=0.5)
        with pytest.raises(FollowTimeout, match="no batch of 8"):
            next(follower)
        for start in (4, 8, 12):
            finish(run, start)
        assert next(follower).prompts.tolist() == list(range(8))
    run.plan.store.append_run({"kind": "run"})  # the run ended (its lock is gone): the rest comes at once
    assert [len(b) for b in follower] == [8]


def test_a_follower_waits_for_a_store_that_a_run_is_about_to_create(tmp_path):
    follower = daskgen.follow(tmp_path / "later.zarr", timeout=0.3)
    with pytest.raises(FollowTimeout):
        next(follower)
    with pytest.raises(daskgen.errors.StoreError, match="not a daskgen store"):
        next(daskgen.follow(tmp_path / "later.zarr", wait=False))


def test_a_store_from_before_commit_sequence_numbers_is_followed_in_row_order(tmp_path):
    run = new_run(tmp_path)
    path = tmp_path / "s.zarr"
    shutil.rmtree(path / "commit_seq")  # as written by an older daskgen
    zarr.consolidate_metadata(str(path))
    st = store.GenerationStore.open(path)
    assert not st.has_array("commit_seq")
    for start in (8, 0):
        finish(run, start)  # the commit path skips the missing array
    assert rows_of(daskgen.follow(path, batch_prompts=8, wait=False)) == [[0, 1, 2, 3, 8, 9, 10, 11]]
    assert st.checksummed and daskgen.verify(path, progress=False).sound, "status and verify read older stores"
    assert run.plan.layout.n_prompts == N


def test_formats_hold_the_same_samples(tmp_path):
    from verl.protocol import DataProto  # plain import, inside the test: the sglang/vllm lanes collect this module

    run = new_run(tmp_path)
    for start in (4, 0):
        finish(run, start)
    path = run.plan.config.store

    def one(fmt: str):
        return next(daskgen.follow(path, batch_prompts=8, wait=False, format=fmt, cursor=fmt)).data

    ds, rows, td, dp = one("xarray"), one("rows"), one("tensordict"), one("dataproto")
    assert isinstance(dp, DataProto) and len(dp) == len(rows) == td.batch_size[0] == 8 * SAMPLES
    assert ds.prompt_index.values.tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    expected = [[r * 10 + s] * 3 for r in ds.prompt_index.values for s in range(SAMPLES)]
    assert [r["response_ids"] for r in rows] == expected
    assert dp.batch["responses"][:, :3].tolist() == expected and td["responses"][:, :3].tolist() == expected
    assert td["prompt_index"].tolist() == dp.non_tensor_batch["prompt_index"].tolist()
    assert dp.non_tensor_batch["uid"].tolist() == [f"q{r}" for r in ds.prompt_index.values for _ in range(SAMPLES)]
    assert dp.batch["responses"].shape[1] == run.plan.layout.max_new_tokens, "the store's width: batches concatenate"
    versions = {
        "policy_version": [r % 3 for r in ds.prompt_index.values for _ in range(SAMPLES)],
        "policy_version_end": [r % 3 + s for r in ds.prompt_index.values for s in range(SAMPLES)],
        "version_changed_at": [2 if s else -1 for _ in ds.prompt_index.values for s in range(SAMPLES)],
    }
    for name, values in versions.items():
        assert dp.non_tensor_batch[name].tolist() == td[name].tolist() == [r[name] for r in rows] == values, name


def test_bad_requests_name_the_fix(tmp_path):
    run = new_run(tmp_path)
    finish(run, 0)
    path = run.plan.config.store
    with pytest.raises(FollowError, match="cursor name '../x' is not allowed"):
        daskgen.follow(path, cursor="../x")
    with pytest.raises(FollowError, match="unknown follow format 'csv'"):
        next(daskgen.follow(path, format="csv", wait=False))
    with pytest.raises(FollowError, match=r"unknown field\(s\) \['nope'\]"):
        next(daskgen.follow(path, fields=["nope"], wait=False))
    with pytest.raises(FollowError, match="batch_prompts must be an integer >= 1"):
        daskgen.follow(path, batch_prompts=0)


def test_a_cursor_acknowledged_while_pack_swaps_the_store_in_is_kept(tmp_path, monkeypatch):
    """An ack that lands in the old store after pack copied the cursors (the last moment: right before the
    swap) is carried over: the follower goes on after it."""
    from daskgen.store.tools import pack as pack_module

    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "out.zarr"
    assert run_cli("run", "--prompts", prompts, "--store", out, *simulated_run()).returncode == 0
    follower = daskgen.follow(out, batch_prompts=10, wait=False, auto_ack=False)
    next(follower).ack()
    second = next(follower)
    swap = pack_module.swap_in

    def ack_then_swap(src, work):  # labelled test hook: the ack comes after the copy, before the swap
        second.ack()
        swap(src, work)

    monkeypatch.setattr(pack_module, "swap_in", ack_then_swap)
    pack_module.pack(out, n_workers=1)
    assert store.GenerationStore.open(out).attrs.packed
    assert [b.number for b in daskgen.follow(out, batch_prompts=10, wait=False)] == [2]


def test_a_packed_store_is_followed_and_its_cursors_survive_packing(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "out.zarr"
    res = run_cli("run", "--prompts", prompts, "--store", out, *simulated_run())
    assert res.returncode == 0, res.stdout + res.stderr
    follower = daskgen.follow(out, batch_prompts=10, wait=False, auto_ack=False)
    first = next(follower)
    first.ack()
    res = run_cli("pack", out, "--n-workers", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert store.GenerationStore.open(out).attrs.packed
    rest = list(daskgen.follow(out, batch_prompts=10, wait=False))
    assert [b.number for b in rest] == [1, 2]
    delivered = [*first.prompt_ids, *(i for b in rest for i in b.prompt_ids)]
    assert sorted(delivered) == sorted(open_store(out).prompt_id.values.tolist())


def test_cli_follow_prints_jsonl_once_per_cursor_and_cursors_may_live_elsewhere(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 12)
    out = tmp_path / "out.zarr"
    res = run_cli("run", "--prompts", prompts, "--store", out, *simulated_run())
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_cli("follow", out, "--batch", "5", "--no-wait")
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(records) == 24 and {r["prompt_id"] for r in records} == {f"q{i}" for i in range(12)}
    assert "24 samples of 12 prompts in 3 batches, 0 failed prompts (cursor 'default')" in res.stderr
    again = run_cli("follow", out, "--no-wait")
    assert again.returncode == 0 and again.stdout == "", "the default cursor acknowledged everything"
    elsewhere = tmp_path / "cursors"
    assert len(list(daskgen.follow(out, wait=False, cursor_dir=elsewhere))) == 1
    assert (elsewhere / "daskgen.cursors" / "default.json").exists()
    assert list(daskgen.follow(out, wait=False, cursor_dir=elsewhere)) == []


@pytest.fixture(scope="module")
def run_store(tmp_path_factory):
    """The prompts and store of a real finished run (24 prompts, 2 samples, logprobs); tests change copies."""
    folder = tmp_path_factory.mktemp("follow-run")
    prompts, out = write_prompts(folder / "p.jsonl", 24), folder / "out.zarr"
    res = run_cli("run", "--prompts", prompts, "--store", out, *simulated_run(), "--logprobs")
    assert res.returncode == 0, res.stdout + res.stderr
    return prompts, out


def copy_of(run_store, tmp_path):
    prompts, out = run_store
    shutil.copytree(out, tmp_path / "out.zarr")
    return prompts, tmp_path / "out.zarr"


def test_a_batch_delivered_again_equals_its_first_delivery_sample_for_sample(tmp_path, run_store):
    import xarray as xr

    _, out = copy_of(run_store, tmp_path)
    for _ in daskgen.follow(out, batch_prompts=10, wait=False, auto_ack=False):
        pass  # a consumer that takes every batch and dies before any ack
    redelivered = list(daskgen.follow(out, batch_prompts=10, wait=False, auto_ack=False))
    delivered = list(daskgen.follow(out, batch_prompts=10, wait=False))
    assert [b.number for b in delivered] == [b.number for b in redelivered] == [0, 1, 2]
    for first, again in zip(delivered, redelivered, strict=True):
        assert (first.start, first.end, first.prompts.tolist()) == (again.start, again.end, again.prompts.tolist())
        assert first.prompt_ids.tolist() == again.prompt_ids.tolist()
        xr.testing.assert_identical(first.data, again.data)  # every array: ids, tokens, logprobs, ...
        logprobs = first.data.logprobs.values[first.data.response_mask.values.astype(bool)]
        assert len(logprobs) and np.isfinite(logprobs).all() and (logprobs <= 0).all()


def test_rows_repaired_and_regenerated_are_delivered_again_once(tmp_path, run_store):
    prompts, out = copy_of(run_store, tmp_path)
    assert sum(len(b) for b in daskgen.follow(out, batch_prompts=10, wait=False)) == 24
    chunk = out / "response_ids" / "c" / "2" / "0" / "0"  # partition rows 8..11
    data = bytearray(chunk.read_bytes())
    data[7] ^= 0x10
    chunk.write_bytes(bytes(data))
    res = run_cli("verify", out, "--repair", "--no-progress")
    assert res.returncode == 1 and "repaired: 1 partition(s)" in res.stdout, res.stdout
    assert list(daskgen.follow(out, wait=False)) == [], "pending rows are not delivered"
    res = run_cli("run", "--prompts", prompts, "--store", out, *simulated_run(), "--logprobs")
    assert res.returncode == 0, res.stdout + res.stderr
    again = list(daskgen.follow(out, batch_prompts=10, wait=False, format="rows"))
    assert rows_of(again) == [[8, 9, 10, 11]] and again[0].failed == {}
    stored = open_store(out).isel(prompt=slice(8, 12))
    assert [r["response_ids"] for r in again[0].data] == [
        ids[:n].tolist()
        for ids, n in zip(stored.response_ids.values.reshape(8, -1), stored.response_length.values.ravel(), strict=True)
    ]
    assert list(daskgen.follow(out, wait=False)) == [], "delivered once"


def test_an_ack_while_pack_swaps_the_store_is_refused_and_the_follower_goes_on(tmp_path, run_store, monkeypatch):
    """``daskgen pack`` renames the store away, then its packed copy in: an ack in between raises a clear
    error and does not re-create the store's folder (pack's second rename would fail on it); nothing was
    acknowledged.  Acknowledged again after the swap, the same follower goes on through the packed layout."""
    from pathlib import Path

    from daskgen.store.tools import pack as pack_module

    _, out = copy_of(run_store, tmp_path)
    follower = daskgen.follow(out, batch_prompts=10, wait=False, auto_ack=False, format="rows")
    first = next(follower)
    rename, refused = Path.rename, []

    def rename_then_ack(self, target):  # labelled test hook: the ack lands between pack's two renames
        moved = rename(self, target)
        if self == out:
            with pytest.raises(FollowError, match=r"was not saved: the store's folder .* is gone") as info:
                first.ack()
            refused.append(info.value)
            assert not out.exists(), "the ack re-created the store's folder"
        return moved

    monkeypatch.setattr(Path, "rename", rename_then_ack)
    pack_module.pack(out, n_workers=1)
    monkeypatch.undo()
    assert refused and not first.acked and store.GenerationStore.open(out).attrs.packed
    first.ack()
    rest = list(follower)  # opened before the swap: it reads the packed store now
    assert [b.number for b in rest] == [1, 2]
    rest[-1].ack()
    records = [r for b in (first, *rest) for r in b.data]
    expected = open_store(out)
    assert sorted(r["prompt_index"] for r in records) == sorted([*range(24)] * SAMPLES)
    by_index = {(r["prompt_index"], r["sample"]): r["response_ids"] for r in records}
    for p in range(24):
        for s in range(SAMPLES):
            n = int(expected.response_length.values[p, s])
            assert by_index[p, s] == expected.response_ids.values[p, s, :n].tolist(), (p, s)
    assert list(daskgen.follow(out, wait=False)) == [], "every batch acknowledged once"


def test_a_torn_cursor_file_is_a_clear_error_naming_the_file_and_the_fix(tmp_path, run_store):
    _, out = copy_of(run_store, tmp_path)
    next(daskgen.follow(out, batch_prompts=10, wait=False, auto_ack=False)).ack()
    path = out / "daskgen.cursors" / "default.json"
    path.write_bytes(path.read_bytes()[:17])  # cut short, as by a file system that lost its tail
    with pytest.raises(FollowError) as info:
        daskgen.follow(out, wait=False)
    message = str(info.value)
    assert str(path) in message and "JSONDecodeError" in message and "17 bytes" in message, message
    assert "delete the file to start this cursor from the beginning" in message and '{"seq": S' in message
    path.write_text(json.dumps({"seq": 1, "row": 9, "batches": 1, "prompts": 10, "failed": 0}))
    assert next(daskgen.follow(out, batch_prompts=10, wait=False)).number == 1, "a rewritten cursor is read"
