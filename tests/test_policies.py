"""Run-level policies: bounded memory, early stop (target / budget / deadline), keep-partial continuation."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from daskgen import store
from daskgen.config import RunConfig
from daskgen.errors import ConfigError
from tests.conftest import run_cli, write_prompts
from tests.test_run import calls, sim_args

pytestmark = pytest.mark.timeout(300)


def test_prompts_in_memory_stay_under_the_cap(tmp_path):
    from daskgen.runner import run

    prompts = write_prompts(tmp_path / "p.jsonl", 120)
    cfg = RunConfig(prompts=str(prompts), model="sim", store=str(tmp_path / "out.zarr"),
                    engine="simulated", engine_args={"time_scale": 0.0}, max_new_tokens=8, max_prompt_tokens=128,
                    partition_size=4, window=8, n_workers=1, max_prompts_in_memory=12, progress=False)
    from daskgen import runner

    seen = []
    original = runner.drive

    def spy(client, plan, tasks, info=None, n_pending=0):
        out = original(client, plan, tasks, info, n_pending)
        seen.append(plan.peak_prompts)
        return out

    runner.drive = spy
    try:
        summary = run(cfg)
    finally:
        runner.drive = original
    assert summary.done == 120
    assert 0 < seen[0] <= 12, f"peak prompts held {seen[0]} > cap 12 (input has 120)"


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


def test_deadline_aborts_in_flight_and_keep_partial_continues_the_prefix(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    out = tmp_path / "out.zarr"
    # long responses (fixed 200 tokens at ~0.02 s/step) so the deadline lands mid-generation
    common = ["--prompts", prompts, "--partition-size", "4", "--max-new-tokens", "200", "--no-progress",
              "--engine-arg", "length_dist=fixed", "--engine-arg", "length_mean=200", "--keep-partial"]
    res = run_cli("run", *sim_args(tmp_path, out, *common, step=1.0), "--deadline", "3s")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "stopped early: deadline 3s reached" in res.stdout
    ds = xr.open_zarr(out)
    assert (ds.status.values == store.PENDING).all()
    partial = ds.response_length.values[:, 0]
    assert (ds.finish_reason.values[:, 0] == 2).all() and ((partial > 0) & (partial < 200)).all()
    prefix = [ds.response_ids.values[i, 0, : partial[i]].copy() for i in range(8)]
    res = run_cli("run", *sim_args(tmp_path, out, *common))
    assert res.returncode == 0 and "8 done" in res.stdout, res.stdout + res.stderr
    ds = xr.open_zarr(out)
    # continued to the full budget (the simulated natural length is 200 from the start, so the tail hits length)
    assert (ds.response_length.values[:, 0] == 200).all() and (ds.finish_reason.values[:, 0] == 1).all()
    for i in range(8):
        np.testing.assert_array_equal(ds.response_ids.values[i, 0, : partial[i]], prefix[i])


def test_policy_settings_are_validated():
    with pytest.raises(ConfigError, match="keep_partial continues single-turn"):
        RunConfig(keep_partial=True, agent="tool")
    with pytest.raises(ConfigError, match="neither a duration"):
        RunConfig(deadline="tomorrow")
    assert RunConfig(deadline="90m").deadline_timestamp(1000.0) == 1000.0 + 5400
    assert RunConfig(deadline=30).deadline_timestamp(0.0) == 30.0
