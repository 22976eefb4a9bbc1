"""The Dask scheduler dies mid-run: the client notices within ``daskgen.scheduler-lost-after`` (timed from
the loss to the line it prints at that moment), keeps what was committed, releases the lock, exits 3, and
a rerun on a new cluster finishes with the earlier rows unchanged.  Each row ends committed exactly once,
counted from the recording engine's request log: a row a worker finished after the loss (nobody committed
it) is committed by the rerun as stored, without being sent again; every other row is sent once more."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest

from daskgen import store
from daskgen.engines.base import FinishReason
from daskgen.store.records.lock import LOCK_NAME
from tests.conftest import cli_env, on_scheduler, popen_cli, run_cli, simulated_run, write_prompts
from tests.fault_tally import Tally, count, logged_requests, record
from tests.probing import OutputLines
from tests.test_run import calls

pytestmark = pytest.mark.timeout(300)

#: ``daskgen.scheduler-lost-after`` in these runs, and how late past it the client may notice (one
#: housekeeping round of the client, the pipe to the test, a loaded machine).
LIMIT_S, MARGIN_S = 3.0, 1.5
#: Rows whose requests wait, once sent, until the test releases them (after the loss): one partition is then
#: surely in flight on the worker when the scheduler goes.
HELD = frozenset(range(40, 44))
#: What the client prints at the moment it notices (daskgen.client.scheduler_watch).
NOTICED = "is lost ("


def run_args(tmp_path) -> list:
    """The simulated engine behind the recording one: each request it is sent is a line of calls.log."""
    return [
        *("--engine", "daskgen.testing.engines:RecordingEngine", "--engine-arg", "inner=simulated"),
        *("--engine-arg", f"log_path={tmp_path / 'calls.log'}", "--engine-arg", "time_scale=0.2"),
        *("--model", "sim", "--max-new-tokens", "32", "--max-prompt-tokens", "128"),
        *("--partition-size", "4", "--window", "2", "--no-progress"),
    ]


def sent_rows(tmp_path) -> Counter:
    """How often each row's request reached an engine so far (one sample per prompt)."""
    return Counter(int(rid.split("-")[0][1:]) for rid, n in calls(tmp_path / "calls.log").items() for _ in range(n))


def _dask(kind: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``dask scheduler`` or ``dask worker`` as its own process (started by hand, as a user would), in the
    environment of a command (or ``env``)."""
    module = {"scheduler": "distributed.cli.dask_scheduler", "worker": "distributed.cli.dask_worker"}[kind]
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=cli_env() if env is None else env,
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


def _wait_for_commits(out, client: subprocess.Popen, lines: OutputLines) -> None:
    """Until several partitions are committed and more are still running."""
    deadline = time.monotonic() + 120
    while _done(out).sum() < 8:
        assert client.poll() is None, lines.join()
        assert time.monotonic() < deadline, "no commits within 120 s"
        time.sleep(0.2)
    assert client.poll() is None and _done(out).sum() < 120, "the run must still be going"


def _wait_for_held(tmp_path, client: subprocess.Popen, lines: OutputLines) -> None:
    """Until the worker holds a partition in flight: a request of the held rows reached the engine."""
    deadline = time.monotonic() + 120
    while not HELD & set(sent_rows(tmp_path)):
        assert client.poll() is None, lines.join()
        assert time.monotonic() < deadline, f"no request of rows {sorted(HELD)} within 120 s"
        time.sleep(0.1)


def _finished_not_committed(out) -> np.ndarray:
    """Rows a worker generated and wrote whose commit never came (pending, their sample finished: stop or length)."""
    opened = store.GenerationStore.open(out)
    reasons = opened.read_region(0, 120, ("finish_reason",))["finish_reason"][:, 0]
    return (opened.read_status() == store.PENDING) & np.isin(reasons, (FinishReason.STOP, FinishReason.LENGTH))


def _stopped_in_time(client: subprocess.Popen, lines: OutputLines, lost_at: float, hung: bool) -> str:
    """The client noticed the loss in time, exited 3 and released the lock; its output.

    A killed scheduler closes the connection: noticed at once.  A hung one is pinged every quarter of the
    limit and each ping gets the rest of it: noticed between three quarters of the limit and the limit.
    """
    noticed = lines.wait_for(NOTICED, timeout=60) - lost_at
    client.wait(60)
    output = lines.join()
    assert client.returncode == 3 and "lost the Dask scheduler" in output, output
    low, high = (0.75 * LIMIT_S - 0.25, LIMIT_S + MARGIN_S) if hung else (0.0, MARGIN_S)
    late = f"noticed {noticed:.2f} s after the loss, not within [{low:g}, {high:g}] s"
    assert low <= noticed <= high, f"{late}; the client printed:\n{output[-3000:]}"
    return output


def _rerun_commits_each_row_once(tmp_path, prompts, out, *run_options: str) -> tuple[np.ndarray, np.ndarray, Tally]:
    """Rerun on a new cluster: every row committed before the loss unchanged and never sent again; every row
    a worker finished but nobody committed committed as stored, not sent again either; every other row sent
    exactly once more.  The rows committed before the loss, those finished but not committed, and the tally
    (rows kept, regenerated) from the request log split at the rerun."""
    opened = store.GenerationStore.open(out)
    status = opened.read_status()
    before = opened.read_region(0, 120, ("committed_at", "response_ids", "response_length"))
    kept, finished = status == store.DONE, _finished_not_committed(out)
    assert 8 <= kept.sum() < 120 and (status != store.FAILED).all(), "no row may be marked failed"
    first, first_requests = sent_rows(tmp_path), len(logged_requests(tmp_path / "calls.log"))
    res = run_cli("run", "--prompts", prompts, "--store", out, *run_args(tmp_path), *run_options)
    assert res.returncode == 0, res.stdout + res.stderr
    after = store.GenerationStore.open(out)
    assert (after.read_status() == store.DONE).all()
    again = after.read_region(0, 120, ("committed_at", "response_ids", "response_length"))
    for name, values in before.items():
        np.testing.assert_array_equal(again[name][kept], values[kept], err_msg=name)
        if name != "committed_at":
            np.testing.assert_array_equal(again[name][finished], values[finished], err_msg=name)
    rerun = sent_rows(tmp_path) - first
    assert all(first[r] == 1 and rerun[r] == 0 for r in np.flatnonzero(kept | finished)), (first, rerun)
    assert all(first[r] <= 1 and rerun[r] == 1 for r in np.flatnonzero(~kept & ~finished)), (first, rerun)
    requests = logged_requests(tmp_path / "calls.log")
    return kept, finished, count(requests[:first_requests], requests[first_requests:])


@pytest.mark.parametrize(
    ("how", "why"),
    [
        (signal.SIGKILL, "the connection broke"),  # a killed process: the connection closes at once
        (signal.SIGSTOP, f"did not answer within {LIMIT_S:g} s"),  # a hung one: open connection, no answers
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
            *("--prompts", prompts, "--store", out, "--scheduler-address", address, *run_args(tmp_path)),
            *("--engine-arg", f"hold_rows={list(HELD)}", "--engine-arg", f"hold_until={tmp_path / 'release'}"),
            env={"DASK_DASKGEN__SCHEDULER_LOST_AFTER": f"{LIMIT_S:g}s"},
        )
        lines = OutputLines(client)
        _wait_for_commits(out, client, lines)
        _wait_for_held(tmp_path, client, lines)
        lost_at = time.monotonic()  # before the signal: the client may read the closed connection before kill returns
        os.kill(scheduler.pid, how)
        output = _stopped_in_time(client, lines, lost_at, hung=how == signal.SIGSTOP)
        assert f"lost the Dask scheduler {address}" in output and why in output, output
        assert "Traceback" not in output, output[-6000:]
        # beside a hung scheduler the worker goes on with the partitions it holds: the held one finishes with
        # nobody to commit it (beside a dead one it may, or may cancel them)
        (tmp_path / "release").touch()
        deadline = time.monotonic() + 60
        while how == signal.SIGSTOP and not _finished_not_committed(out).any():
            assert time.monotonic() < deadline, "the orphaned worker finished no partition"
            time.sleep(0.1)
    finally:
        for proc in (scheduler, worker):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert not (out / LOCK_NAME).exists(), "the lock must be released"
    kept, finished, tally = _rerun_commits_each_row_once(tmp_path, prompts, out, "--n-workers", "1")
    assert finished.any() or how == signal.SIGKILL
    what = "SIGKILLed" if how == signal.SIGKILL else "hung (SIGSTOP)"
    assert tally.kept >= kept.sum() + finished.sum(), tally  # every row committed or finished before the loss
    record(f"the Dask scheduler {what} mid-run, rerun on a new cluster", rows=120, tally=tally)


def test_daskgens_own_scheduler_process_killed_mid_run_exits_3_and_the_rerun_keeps_earlier_rows(tmp_path):
    """The layout SLURM/PBS runs use by default: the scheduler in a process of its own beside the client."""
    import psutil

    from tests.test_preemption import _group_gone

    (tmp_path / "run.yaml").write_text("cluster:\n  kind: local\n  n_workers: 1\n  scheduler_process: true\n")
    prompts = write_prompts(tmp_path / "p.jsonl", 120)
    out = tmp_path / "out.zarr"
    config = ("--config", tmp_path / "run.yaml")
    client = popen_cli(
        "run",
        *("--prompts", prompts, "--store", out, *config, *run_args(tmp_path)),
        env={"DASK_DASKGEN__SCHEDULER_LOST_AFTER": f"{LIMIT_S:g}s"},
    )
    lines = OutputLines(client)
    _wait_for_commits(out, client, lines)
    (scheduler,) = [
        c
        for c in psutil.Process(client.pid).children(recursive=True)
        if "daskgen.deploy.scheduler_process" in " ".join(c.cmdline())
    ]
    lost_at = time.monotonic()  # before the kill, as above
    scheduler.kill()
    _stopped_in_time(client, lines, lost_at, hung=False)
    assert not (out / LOCK_NAME).exists(), "the lock must be released"
    assert _group_gone(client.pid), "a process of the run was left behind"
    _rerun_commits_each_row_once(tmp_path, prompts, out, *config)


@pytest.mark.timeout(120)
def test_connection_loss_tracebacks_of_the_client_are_not_printed_while_a_run_is_connected(tmp_path, caplog):
    """The client's event loop and its batched stream log a traceback when the scheduler's connection closes
    under them; a run reports the loss itself, so inside :func:`connect` those records are dropped and every
    other record of the same loggers still reaches the handlers."""
    import logging

    from distributed.comm.core import CommClosedError

    from daskgen.client.cluster import connect
    from daskgen.config import RunConfig

    def closed() -> tuple:
        try:
            raise CommClosedError("in: TCP closed")
        except CommClosedError:
            return sys.exc_info()

    config = RunConfig(model="sim", store=str(tmp_path / "s.zarr"), engine="simulated", n_workers=1, progress=False)
    names = ("distributed.batched", "tornado.application")
    with caplog.at_level(logging.INFO), connect(config):
        for name in names:
            logging.getLogger(name).error("Batched Comm Closed", exc_info=closed())
            logging.getLogger(name).error("kept: %s", name, exc_info=ValueError("not a connection loss"))
    kept = [r for r in caplog.records if r.name in names]
    assert [r.getMessage() for r in kept] == [f"kept: {name}" for name in names]
    logging.getLogger(names[0]).info("after the run", exc_info=closed())
    assert caplog.records[-1].getMessage() == "after the run", "the filter outlived the run"


#: Test double: a ``sitecustomize`` module that makes ``import daskgen`` fail in the process that loads it, as in a
#: scheduler started from an environment without daskgen.
HIDE_DASKGEN = """
import sys


class HideDaskgen:
    def find_spec(self, name, path=None, target=None):
        if name == "daskgen" or name.startswith("daskgen."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, HideDaskgen())
"""


def test_a_scheduler_without_daskgen_stops_the_run_and_fails_no_prompt(tmp_path):
    """The scheduler cannot unpickle the partition tasks (distributed's "Error during deserialization of the task
    graph"): the run stops at once with an error saying why and what to do (exit 2), every prompt still pending."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_DASKGEN)
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide), env.get("PYTHONPATH")]))
    prompts, out, scheduler_file = write_prompts(tmp_path / "p.jsonl", 16), tmp_path / "out.zarr", tmp_path / "s.json"
    scheduler = _dask("scheduler", "--scheduler-file", str(scheduler_file), "--port", "0", "--no-dashboard", env=env)
    worker = None
    try:
        address = _address(scheduler_file)
        worker = _dask("worker", address, "--nthreads", "2", "--no-dashboard", "--no-nanny")
        res = run_cli("run", "--prompts", prompts, "--store", out, *on_scheduler(simulated_run(), address), timeout=120)
    finally:
        for proc in (scheduler, worker):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert res.returncode == 2, res.stdout + res.stderr
    error = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert error and "the Dask scheduler could not unpickle daskgen's partition tasks" in error[-1], res.stderr
    assert "it lacks daskgen" in error[-1] and "no prompt was marked failed" in error[-1]
    assert (store.GenerationStore.open(out).read_status() == store.PENDING).all()
