"""Run-level policies: bounded memory, early stop (target / budget / deadline), keep-partial continuation."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from daskgen import store
from daskgen.config import RunConfig
from daskgen.errors import ConfigError
from daskgen.testing.probes import in_flight_after, peak_in_flight, read_events, row_of
from tests.conftest import run_cli, write_prompts
from tests.test_run import calls, sim_args

pytestmark = pytest.mark.timeout(300)


def test_prompts_in_memory_stay_under_the_cap(tmp_path):
    """The engine itself never holds more prompts than ``max_prompts_in_memory``, and the cap really binds.

    Observed by a probe engine (daskgen.testing.probes) that records every request reaching the engine:
    the window (8 partitions of 4) alone would allow 32 prompts in flight; the cap of 12 allows 3
    partitions, and requests last long enough (20 steps) that those 3 overlap.
    """
    from daskgen.client.runner import run

    events = tmp_path / "events.log"
    cfg = RunConfig(
        prompts=str(write_prompts(tmp_path / "p.jsonl", 120)),
        model="sim",
        store=str(tmp_path / "out.zarr"),
        engine="daskgen.testing.probes:ProbeEngine",
        engine_args={"events_path": str(events), "length_dist": "fixed", "length_mean": 20, "time_scale": 1.0},
        max_new_tokens=20,
        max_prompt_tokens=128,
        partition_size=4,
        window=8,
        n_workers=1,
        max_prompts_in_memory=12,
        progress=False,
    )
    summary = run(cfg, handle_signals=False)
    assert summary.done == 120
    seen = read_events(events)
    assert {row_of(e.request_id) for e in seen} == set(range(120)), "every prompt reached the engine"
    peak = peak_in_flight(seen)
    assert 8 < peak <= 12, f"the engine held at most {peak} prompts at once (cap 12, three partitions of 4)"


def test_target_done_stops_early_and_keeps_groups_pending(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 80)
    out = tmp_path / "out.zarr"
    common = ["--prompts", prompts, "--partition-size", "4", "--n-samples", "2", "--window", "1", "--no-progress"]
    res = run_cli("run", *sim_args(tmp_path, out, *common, step=1.0), "--target-done", "8")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "stopped early: target of 8 done prompts reached" in res.stdout
    ds = xr.open_zarr(out)
    status = ds.status.values
    assert 8 <= (status == store.DONE).sum() < 80
    # groups are never split: a done prompt has both samples finished, a pending one has no commit
    done = status == store.DONE
    assert (ds.finish_reason.values[done] >= 0).all()
    res = run_cli("run", *sim_args(tmp_path, out, *common, log="rest.log"))
    assert res.returncode == 0 and "80 done" in res.stdout
    regenerated = {int(k[1:].split("-")[0]) for k in calls(tmp_path / "rest.log")}
    assert not any(done[sorted(regenerated)])


@pytest.fixture
def own_cluster():
    """A cluster started by the test, so that a run joining it does not count cluster start-up."""
    import dask
    from distributed import Client, LocalCluster

    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(n_workers=1, threads_per_worker=4, processes=True, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        client.wait_for_workers(1)
        yield lc


def test_deadline_aborts_in_flight_and_keep_partial_continues_the_prefix(tmp_path, own_cluster):
    """A deadline aborts the requests in flight; their partial responses are kept and continued.

    The run joins the test's own cluster, so the deadline (8 s) counts only the run's own start
    (reading prompts, starting the simulated engine); each response takes 500 steps of 0.1 s
    (50 s), so a deadline after the first request reached the engine lands mid-generation.  A probe
    engine (daskgen.testing.probes) records what really was in flight.
    """
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    out, events = tmp_path / "out.zarr", tmp_path / "events.log"
    common = [
        *PROBE,
        "--engine-arg",
        f"events_path={events}",
        "--prompts",
        prompts,
        "--store",
        out,
        "--partition-size",
        "4",
        "--max-new-tokens",
        "500",
        "--no-progress",
        "--engine-arg",
        "length_dist=fixed",
        "--engine-arg",
        "length_mean=500",
        "--keep-partial",
        "--scheduler-address",
        own_cluster.scheduler_address,
    ]
    res = run_cli("run", *common, "--engine-arg", "time_scale=5.0", "--deadline", "8s")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "stopped early: deadline 8s reached" in res.stdout
    first = read_events(events)
    arrived = {row_of(e.request_id) for e in first if e.kind == "arrive"}
    assert arrived, "no request reached the engine before the deadline"
    assert in_flight_after(first) == {e.pid: set() for e in first}, "every request in flight ended (aborted)"
    ds = xr.open_zarr(out)
    assert (ds.status.values == store.PENDING).all(), "aborted prompts stay pending"
    partial, reason = ds.response_length.values[:, 0], ds.finish_reason.values[:, 0]
    started = reason == 2
    assert set(np.flatnonzero(started).tolist()) == arrived, "exactly the requests in flight hold partial responses"
    assert ((partial[started] > 0) & (partial[started] < 500)).all(), partial
    assert (reason[~started] == -1).all()
    prefix = {i: ds.response_ids.values[i, 0, : partial[i]].copy() for i in np.flatnonzero(started)}
    res = run_cli("run", *common, "--engine-arg", "time_scale=0")
    assert res.returncode == 0 and "8 done" in res.stdout, res.stdout + res.stderr
    ds = xr.open_zarr(out)
    # continued to the full budget (the simulated natural length is 500 from the start, so the tail hits length)
    assert (ds.response_length.values[:, 0] == 500).all() and (ds.finish_reason.values[:, 0] >= 0).all()
    for i, ids in prefix.items():
        np.testing.assert_array_equal(ds.response_ids.values[i, 0, : len(ids)], ids)


PROBE = [
    "--engine",
    "daskgen.testing.probes:ProbeEngine",
    "--engine-arg",
    "inner=simulated",
    "--model",
    "sim",
    "--max-prompt-tokens",
    "128",
]


def test_policy_settings_are_validated():
    with pytest.raises(ConfigError, match="keep_partial continues single-turn"):
        RunConfig(keep_partial=True, agent="tool")
    with pytest.raises(ConfigError, match="neither a duration"):
        RunConfig(deadline="tomorrow")
    assert RunConfig(deadline="90m").deadline_timestamp(1000.0) == 1000.0 + 5400
    assert RunConfig(deadline=30).deadline_timestamp(0.0) == 30.0


def test_multi_round_verifier_stops_satisfied_prompts_early(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "out.zarr"
    cfg = tmp_path / "run.yaml"
    cfg.write_text("verifier: tests.verifiers:even_first_token\nround_size: 2\nuntil_correct: 1\n")
    res = run_cli(
        "run",
        *sim_args(
            tmp_path,
            out,
            "--prompts",
            prompts,
            "--partition-size",
            "4",
            "--n-samples",
            "8",
            "--config",
            cfg,
            "--temperature",
            "1.0",
            "--no-progress",
            "--engine-arg",
            "length_mean=6",
        ),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    ds = xr.open_zarr(out)
    used, score, reason = ds.samples_used.values, ds.score.values, ds.finish_reason.values
    assert set(np.unique(used)) <= {2, 4, 6, 8} and (used < 8).any()
    log = calls(tmp_path / "calls.log")
    for i in range(24):
        assert sum(1 for k in log if k.startswith(f"p{i}-")) == used[i], "satisfied prompts stop consuming"
        assert np.isfinite(score[i, : used[i]]).all() and np.isnan(score[i, used[i] :]).all()
        assert (reason[i, used[i] :] == -1).all()
        if used[i] < 8:
            truncated = reason[i, : used[i]] == 1
            assert (score[i, used[i] - 2 : used[i]] >= 1).any() or truncated.all()
    assert ds.attrs["daskgen"]["identity"]["verifier"] == "tests.verifiers:even_first_token"


def test_verifier_exceptions_are_recorded_not_fatal(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    out = tmp_path / "out.zarr"
    res = run_cli(
        "run",
        *sim_args(
            tmp_path,
            out,
            "--prompts",
            prompts,
            "--partition-size",
            "4",
            "--n-samples",
            "2",
            "--no-progress",
            "--config",
            _yaml(tmp_path, PICKY),
        ),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    ds = xr.open_zarr(out)
    assert (ds.status.values == store.DONE).all()
    assert np.isnan(ds.score.values[3]).all()
    assert "verifier raised ValueError: cannot grade q3" in str(ds.error.values[3])
    assert (ds.score.values[0, :1] == 1.0).all() and ds.samples_used.values[0] == 1


PICKY = "verifier: tests.verifiers:picky\nuntil_correct: 1\ncount_truncated: true\n"


def _yaml(tmp_path, text):
    path = tmp_path / "v.yaml"
    path.write_text(text)
    return path
