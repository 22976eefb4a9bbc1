"""The Dask scheduler dies mid-run: the client stops within a bounded time, keeps what was committed,
releases the lock, exits 3, and a rerun on a new cluster finishes with the earlier rows unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from daskgen import store
from daskgen.store.lock import LOCK_NAME
from tests.conftest import cli_env, popen_cli, run_cli, write_prompts
from tests.fault_tally import count, logged_requests, record, recorded

pytestmark = pytest.mark.timeout(300)

RUN = [
    "--engine",
    "simulated",
    "--engine-arg",
    "time_scale=0.2",
    "--model",
    "sim",
    "--max-new-tokens",
    "32",
    "--max-prompt-tokens",
    "128",
    "--partition-size",
    "4",
    "--window",
    "2",
    "--no-progress",
]


def _dask(kind: str, *args: str) -> subprocess.Popen:
    """``dask scheduler`` or ``dask worker`` as its own process (started by hand, as a user would)."""
    module = {"scheduler": "distributed.cli.dask_scheduler", "worker": "distributed.cli.dask_worker"}[kind]
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=cli_env(),
        start_new_session=True,
    )


def _address(scheduler_file) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if scheduler_file.exists() and scheduler_file.stat().st_size:
            return json.loads(scheduler_file.read_text())["address"]
        time.sleep(0.1)
    raise AssertionError("the scheduler did not write its file within 60 s")


def _done(out) -> np.ndarray:
    opened = store.GenerationStore.open_if_exists(out) if (out / "zarr.json").exists() else None
    return np.zeros(0, dtype=bool) if opened is None else opened.read_status() == store.DONE


@pytest.mark.parametrize(
    ("how", "why"),
    [
        (signal.SIGKILL, "the connection broke"),  # a killed process: the connection closes at once
        (signal.SIGSTOP, "did not answer within 3 s"),  # a hung one: open connection, no answers
    ],
    ids=["killed", "hung"],
)
def test_scheduler_lost_mid_run_exits_3_and_the_rerun_keeps_earlier_rows(tmp_path, how, why):
    prompts = write_prompts(tmp_path / "p.jsonl", 120)
    out, scheduler_file = tmp_path / "out.zarr", tmp_path / "scheduler.json"
    scheduler = _dask("scheduler", "--scheduler-file", str(scheduler_file), "--port", "0", "--no-dashboard")
    worker = None
    try:
        address = _address(scheduler_file)
        worker = _dask("worker", address, "--nthreads", "4", "--no-dashboard", "--no-nanny")
        client = popen_cli(
            "run",
            *("--prompts", prompts, "--store", out, "--scheduler-address", address),
            *recorded(RUN, tmp_path / "first.log"),
            env={"DASK_DASKGEN__SCHEDULER_LOST_AFTER": "3s"},
        )
        deadline = time.monotonic() + 120
        while _done(out).sum() < 8:  # several partitions committed, more still running
            assert client.poll() is None, client.stdout.read()
            assert time.monotonic() < deadline, "no commits within 120 s"
            time.sleep(0.2)
        assert client.poll() is None and _done(out).sum() < 120, "the run must still be going"
        os.kill(scheduler.pid, how)
        killed = time.monotonic()
        output, _ = client.communicate(timeout=120)
        noticed = time.monotonic() - killed
    finally:
        for proc in (scheduler, worker):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert client.returncode == 3, output
    assert f"lost the Dask scheduler {address}" in output and why in output, output
    assert noticed < 30, f"the client took {noticed:.0f} s to notice and stop"
    assert "Traceback" not in output, output[-6000:]
    assert not (out / LOCK_NAME).exists(), "the lock must be released"
    opened = store.GenerationStore.open(out)
    before_status = opened.read_status()
    before = opened.read_region(0, 120, ("committed_at", "response_ids", "response_length"))
    kept = before_status == store.DONE
    assert 8 <= kept.sum() < 120 and (before_status != store.FAILED).all(), "no row may be marked failed"
    rerun = recorded(RUN, tmp_path / "rerun.log")
    res = run_cli("run", "--prompts", prompts, "--store", out, *rerun, "--n-workers", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    after = store.GenerationStore.open(out)
    assert (after.read_status() == store.DONE).all()
    again = after.read_region(0, 120, ("committed_at", "response_ids", "response_length"))
    for name, values in before.items():
        np.testing.assert_array_equal(again[name][kept], values[kept], err_msg=name)
    what = "SIGKILLed" if how == signal.SIGKILL else "hung (SIGSTOP)"
    tally = count(logged_requests(tmp_path / "first.log"), logged_requests(tmp_path / "rerun.log"))
    assert tally.kept >= kept.sum(), tally  # every committed row, at least
    record(f"the Dask scheduler {what} mid-run, rerun on a new cluster", rows=120, tally=tally)


def test_daskgens_own_scheduler_process_killed_mid_run_exits_3_and_leaves_nothing_behind(tmp_path):
    """The layout SLURM/PBS runs use by default: the scheduler in a process of its own beside the client."""
    import psutil

    from tests.test_preemption import _group_gone

    (tmp_path / "run.yaml").write_text("cluster:\n  kind: local\n  n_workers: 1\n  scheduler_process: true\n")
    prompts = write_prompts(tmp_path / "p.jsonl", 120)
    out = tmp_path / "out.zarr"
    client = popen_cli("run", "--prompts", prompts, "--store", out, "--config", tmp_path / "run.yaml", *RUN)
    deadline = time.monotonic() + 120
    while _done(out).sum() < 8:
        assert client.poll() is None, client.stdout.read()
        assert time.monotonic() < deadline, "no commits within 120 s"
        time.sleep(0.2)
    (scheduler,) = [
        c
        for c in psutil.Process(client.pid).children(recursive=True)
        if "daskgen.deploy.scheduler_process" in " ".join(c.cmdline())
    ]
    assert client.poll() is None and _done(out).sum() < 120, "the run must still be going"
    scheduler.kill()
    output, _ = client.communicate(timeout=120)
    assert client.returncode == 3 and "lost the Dask scheduler" in output, output
    assert not (out / LOCK_NAME).exists(), "the lock must be released"
    assert _group_gone(client.pid), "a process of the run was left behind"
    status = store.GenerationStore.open(out).read_status()
    assert (status != store.FAILED).all() and 8 <= (status == store.DONE).sum() < 120
