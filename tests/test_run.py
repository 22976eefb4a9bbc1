"""End-to-end runs of the real CLI on a real LocalCluster (worker processes) and real stores."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import numpy as np
import pytest
import xarray as xr

from daskgen import store
from daskgen.analysis.accessor import open_store
from tests.conftest import popen_cli, run_cli, write_prompts
from tests.fault_tally import count, logged_requests, record
from tests.test_top_logprobs import check_stored_top_logprobs

pytestmark = pytest.mark.timeout(300)

SIM = [
    "--engine",
    "daskgen.testing.engines:RecordingEngine",
    "--engine-arg",
    "inner=simulated",
    "--model",
    "sim",
    "--max-new-tokens",
    "16",
    "--max-prompt-tokens",
    "128",
]


def sim_args(tmp_path, store_path, *extra, log="calls.log", step=0.0):
    return [
        *SIM,
        "--engine-arg",
        f"log_path={tmp_path / log}",
        "--engine-arg",
        f"time_scale={step}",
        "--store",
        store_path,
        *extra,
    ]


def calls(path) -> Counter:
    """How often each request id reached the engine (the RecordingEngine's ``<id> <pid>`` lines at ``path``)."""
    if not path.exists():
        return Counter()
    return Counter(line.split()[0] for line in path.read_text().splitlines() if line.strip())


@pytest.mark.slow
def test_transformers_end_to_end(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    prompts = write_prompts(tmp_path / "p.jsonl", 10)
    out = tmp_path / "out.zarr"
    res = run_cli(
        "run",
        "--prompts",
        prompts,
        "--model",
        tiny_model,
        "--store",
        out,
        "--n-samples",
        "2",
        "--max-new-tokens",
        "24",
        "--partition-size",
        "4",
        "--temperature",
        "1.0",
        "--logprobs",
        "--top-logprobs",
        "4",
        "--seed",
        "3",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "10 done, 0 failed, 0 pending of 10 prompts" in res.stdout
    ds = xr.open_zarr(out)
    assert ds.sizes["prompt"] == 10 and ds.sizes["sample"] == 2 and ds.sizes["response_position"] == 24
    assert (ds.status.values == store.DONE).all()
    lengths = ds.response_length.values
    assert ((lengths >= 1) & (lengths <= 24)).all()
    reasons = ds.finish_reason.values
    assert set(np.unique(reasons)) <= {0, 1} and ((reasons == 1) == (lengths == 24)).all()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids, mask, lp = ds.response_ids.values, ds.response_mask.values, ds.logprobs.values
    for i in range(10):
        plen = int(ds.prompt_length.values[i])
        prompt = tok.decode(ds.prompt_ids.values[i, :plen])
        assert f"Question {i}:" in prompt
        assert (ds.prompt_ids.values[i, plen:] == tok.pad_token_id).all()
        for s in range(2):
            n = lengths[i, s]
            assert mask[i, s, :n].all() and not mask[i, s, n:].any()
            assert (ids[i, s, n:] == tok.pad_token_id).all()
            assert np.isfinite(lp[i, s, :n]).all() and (lp[i, s, :n] <= 0).all() and np.isnan(lp[i, s, n:]).all()
            if reasons[i, s] == 0:
                assert ids[i, s, n - 1] == tok.eos_token_id
            assert isinstance(tok.decode(ids[i, s, :n]), str)
    check_stored_top_logprobs(ds, tiny_model, 4)


def test_resume_after_sigkill_regenerates_nothing_finished(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 48)
    common = [
        "--prompts",
        prompts,
        "--n-samples",
        "2",
        "--partition-size",
        "4",
        "--seed",
        "7",
        "--temperature",
        "1.0",
        "--window",
        "1",
        "--no-progress",
    ]
    ref = run_cli("run", *sim_args(tmp_path, tmp_path / "ref.zarr", *common, log="ref.log"))
    assert ref.returncode == 0, ref.stdout + ref.stderr

    out = tmp_path / "out.zarr"
    proc = popen_cli("run", *sim_args(tmp_path, out, *common, log="first.log", step=1.0))
    done_at_kill = _wait_for_some_done(out, proc, minimum=8)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = store.GenerationStore.open(out).read_status() == store.DONE  # the store the resume starts from
    assert done_at_kill.sum() <= done_before.sum() and not (done_at_kill & ~done_before).any()
    assert 0 < done_before.sum() < 48, "the resume must start from a partial store (done and pending rows)"

    res = run_cli("run", *sim_args(tmp_path, out, *common, log="second.log"))
    assert res.returncode == 0, res.stdout + res.stderr
    second = calls(tmp_path / "second.log")
    rows_second = {int(k[1:].split("-")[0]) for k in second}
    regenerated = {k for k in second if done_before[int(k[1:].split("-")[0])]}
    assert regenerated == set(), f"finished prompts were generated again: {sorted(regenerated)[:5]}"
    assert max(second.values()) == 1, "a sample was generated twice in the resumed run"
    rows_first = {int(k[1:].split("-")[0]) for k in calls(tmp_path / "first.log")}
    pending = set(np.flatnonzero(~done_before).tolist())
    assert rows_second and rows_second <= pending
    assert pending - rows_second <= rows_first, "a pending row was neither generated before nor by the resume"
    assert (store.GenerationStore.open(out).read_status() == store.DONE).all()
    a, b = xr.open_zarr(tmp_path / "ref.zarr"), xr.open_zarr(out)
    for name in ("status", "response_ids", "response_length", "finish_reason", "prompt_ids"):
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
    worked_before = rows_second & rows_first  # pending rows the killed run had started: generated again
    tally = count(logged_requests(tmp_path / "first.log"), logged_requests(tmp_path / "second.log"))
    assert tally.regenerated == len(worked_before), tally
    record("SIGKILL of the client (whole process tree), rerun", rows=48, tally=tally)


def _wait_for_some_done(path, proc, minimum, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run ended before the kill: {proc.stdout.read()}"
        if store.read_store_attrs(path) is not None:
            status = store.GenerationStore.open(path).read_status()
            if (status == store.DONE).sum() >= minimum:
                return status == store.DONE
        time.sleep(0.05)
    raise AssertionError("no partition finished in time")


def test_reading_while_a_run_writes_shows_finished_rows(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    out = tmp_path / "out.zarr"
    proc = popen_cli(
        "run",
        "--prompts",
        prompts,
        *sim_args(tmp_path, out, "--partition-size", "4", "--window", "1", "--no-progress", step=1.0),
    )
    try:
        done = _wait_for_some_done(out, proc, minimum=4)
        ds = open_store(out)
        status = ds.status.values
        lengths = ds.response_length.values
        assert (status == store.DONE).sum() >= done.sum()
        assert (lengths[status == store.DONE] > 0).all()
        assert proc.poll() is None, "the run should still be going"
    finally:
        proc.wait(timeout=240)
    assert proc.returncode == 0


def test_poison_prompt_fails_alone_exit_nonzero_and_retry_failed(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 12)
    out = tmp_path / "out.zarr"
    base = ["--prompts", prompts, "--partition-size", "4", "--max-retries", "1", "--no-progress"]
    # time_scale 1: other partitions are in flight when the poison restarts the engine; their aborted
    # requests must be retried, not left pending
    res = run_cli("run", *sim_args(tmp_path, out, *base, step=1.0), "--engine-arg", "poison_rows=[5]")
    assert res.returncode == 1, res.stdout + res.stderr
    # the poison row is isolated: the rest of its partition is done
    assert "11 done, 1 failed, 0 pending of 12" in res.stdout and "--retry-failed" in res.stdout
    status = run_cli("status", out)
    assert "failed 1" in status.stdout and "row 5: " in status.stdout and "poison prompt crashed" in status.stdout
    assert calls(tmp_path / "calls.log")["p4-s0"] >= 2, "partition retried as a whole first"
    retry = run_cli("run", *sim_args(tmp_path, out, *base, log="retry.log"), "--retry-failed")
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert "12 done, 0 failed" in retry.stdout
    assert sorted(calls(tmp_path / "retry.log")) == ["p5-s0"]


def test_rerun_with_other_settings_or_input_is_refused(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    out = tmp_path / "out.zarr"
    base = ["--prompts", prompts, "--partition-size", "4", "--no-progress"]
    assert run_cli("run", *sim_args(tmp_path, out, *base)).returncode == 0
    res = run_cli("run", *sim_args(tmp_path, out, *base), "--temperature", "0.5")
    assert res.returncode == 2
    assert "temperature: store has 1.0, this run has 0.5" in res.stderr and "new --store" in res.stderr
    other = write_prompts(tmp_path / "other.jsonl", 9)
    res = run_cli("run", *sim_args(tmp_path, out, "--prompts", other, "--partition-size", "4"))
    assert res.returncode == 2 and "fingerprint" in res.stderr
    assert "n_prompts: store has 8, this run has 9" in res.stderr


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"prompt": "ok"}\n{"prompt": \n', "line 2: not valid JSON"),
        ('{"messages": []}\n', "row 0: column 'messages': empty conversation"),
        ('{"text": "hi"}\n', "row 0: missing column 'messages' or 'prompt'"),
        ("", "is empty"),
    ],
)
def test_bad_input_fails_before_any_engine_starts(tmp_path, content, fragment):
    (tmp_path / "p.jsonl").write_text(content)
    res = run_cli("run", "--prompts", tmp_path / "p.jsonl", *sim_args(tmp_path, tmp_path / "out.zarr"))
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert not (tmp_path / "out.zarr").exists()
    assert not (tmp_path / "calls.log").exists()


def test_overlong_prompts_error_or_are_recorded_failed(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "short"}\n{"prompt": "' + "long " * 100 + '"}\n')
    args = ["--prompts", tmp_path / "p.jsonl", *sim_args(tmp_path, tmp_path / "out.zarr", "--no-progress")]
    res = run_cli("run", *args)
    assert res.returncode == 2 and "row 1: column" in res.stderr and "--skip-overlong" in res.stderr
    res = run_cli("run", *args, "--skip-overlong")
    assert res.returncode == 1 and "1 done, 1 failed" in res.stdout
    ds = open_store(tmp_path / "out.zarr")
    assert "more than max_prompt_tokens=128" in str(ds.error.values[1])
