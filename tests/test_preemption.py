"""Preemption (docs/reliability.md, cases 10-12): a run stopped from outside keeps finished work and
in-flight partial responses, and the next run continues each partial response token-exactly.

Real parts throughout: the CLI in a subprocess, LocalCluster worker processes, real Zarr stores,
the simulated engine (long, varied lengths so a stop lands mid-generation).  The same stop on the real tiny model,
resumed to the uninterrupted answers, is in tests/test_continuation.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from daskgen import store
from daskgen.client.interrupt import EXIT_INTERRUPTED, Interrupt, parse_slurm_time
from daskgen.engines.base import FinishReason
from daskgen.testing.probes import in_flight_after, read_events
from tests.conftest import cli_env, popen_cli, run_cli, simulated_run, write_prompts
from tests.fault_tally import count, logged_requests, record
from tests.probing import OutputLines, gate_args, probe_args, wait_for_arrival
from tests.test_run import _wait_for_some_done, sim_args

pytestmark = pytest.mark.timeout(300)

#: Long, varied responses (1..599 tokens at 0.02 s per step): some partitions finish early, many are in flight.
LONG = [
    "--max-new-tokens",
    "600",
    "--engine-arg",
    "length_dist=uniform",
    "--engine-arg",
    "length_mean=300",
    "--logprobs",
    "--no-progress",
]


def _group_gone(pgid: int, timeout: float = 30.0) -> bool:
    """True once no process of the process group ``pgid`` is left (zombies of reaped children don't count)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for p in psutil.process_iter(["pid", "status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
            except (ProcessLookupError, psutil.Error):
                continue
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _partials(path: Path) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """(row, sample) -> (response ids, logprobs) of every stored partial response of a pending row."""
    ds = xr.open_zarr(path)
    reason, length, status = ds.finish_reason.values, ds.response_length.values, ds.status.values
    out = {}
    for r, s in zip(*np.nonzero(reason == FinishReason.ABORT), strict=True):
        if status[r] == store.PENDING and length[r, s] > 0:
            n = length[r, s]
            out[int(r), int(s)] = (ds.response_ids.values[r, s, :n].copy(), ds.logprobs.values[r, s, :n].copy())
    return out


def _stop_mid_run(tmp_path: Path, out: Path, common: list, sig: int = signal.SIGTERM, minimum: int = 4):
    proc = popen_cli("run", *sim_args(tmp_path, out, *common, log="first.log", step=1.0))
    done_before = _wait_for_some_done(out, proc, minimum=minimum)
    os.kill(proc.pid, sig)
    output, _ = proc.communicate(timeout=120)
    return proc, output, done_before


def test_sigterm_keeps_finished_and_partial_work_and_the_rerun_continues_it_token_exactly(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "out.zarr"
    common = [
        "--prompts",
        prompts,
        "--partition-size",
        "2",
        "--n-samples",
        "2",
        "--seed",
        "3",
        "--grace",
        "20s",
        "--n-workers",
        "2",
        *LONG,
    ]
    proc, output, done_before = _stop_mid_run(tmp_path, out, common)
    assert proc.returncode == EXIT_INTERRUPTED, output
    assert "SIGTERM received" in output and "interrupted (SIGTERM received)" in output, output
    assert _group_gone(proc.pid), "a process of the interrupted run was left behind"
    assert not (out / "daskgen.lock").exists(), "the lock must be released"

    status = store.GenerationStore.open(out).read_status()
    assert (status[done_before] == store.DONE).all(), "every committed row stays committed"
    assert (status == store.PENDING).any(), "the stop must have landed mid-run"
    ds = xr.open_zarr(out)
    assert (ds.finish_reason.values[status == store.DONE] >= 0).all()
    saved = _partials(out)
    assert saved, "in-flight responses must be saved as partial responses"
    assert f"saved {len(saved)} partial responses" in output, output
    partial_partitions = sorted({r - r % 2 for r, _ in saved})
    assert store.read_store_attrs(out).partial_partitions == partial_partitions

    res = run_cli("run", *sim_args(tmp_path, out, *common, log="second.log"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "24 done, 0 failed, 0 pending" in res.stdout
    # length-aware dispatch: the partitions holding partial responses (the long ones) went first
    first_row = int((tmp_path / "second.log").read_text().split()[0][1:].split("-")[0])
    assert first_row - first_row % 2 in partial_partitions
    assert store.read_store_attrs(out).partial_partitions == []
    ds = xr.open_zarr(out)
    for (r, s), (ids, logprobs) in saved.items():
        n = len(ids)
        np.testing.assert_array_equal(ds.response_ids.values[r, s, :n], ids, err_msg=f"row {r} sample {s}")
        np.testing.assert_array_equal(ds.logprobs.values[r, s, :n], logprobs, err_msg=f"row {r} sample {s}")
        assert ds.continued_tokens.values[r, s] == n, "the store records how many tokens were continued"
        assert ds.finish_reason.values[r, s] in (FinishReason.STOP, FinishReason.LENGTH)
        assert ds.response_length.values[r, s] >= n
    untouched = np.ones(ds.continued_tokens.shape, bool)
    for key in saved:
        untouched[key] = False
    assert (ds.continued_tokens.values[untouched] == 0).all()
    assert "kept " in res.stdout and "tokens stored by interrupted attempts" in res.stdout
    resumed = [f"p{r}-s{s}" for r, s in saved]
    tally = count(logged_requests(tmp_path / "first.log"), logged_requests(tmp_path / "second.log"), resumed)
    assert tally.continued == len({r for r, _ in saved}), tally
    record("SIGTERM to the run (preemption), rerun continues partial samples", rows=24, tally=tally)


def test_sigterm_to_the_run_while_its_cluster_starts_is_an_interruption(tmp_path):
    """SIGTERM to the run's process group (a batch system's cancel) while its LocalCluster starts: the starting
    worker dies of it too, and the run ends interrupted (exit 3, resumable), not with the cluster's start-up error."""
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    out = tmp_path / "out.zarr"
    env = {"DASK_DISTRIBUTED__WORKER__PRELOAD": '["tests.slow_worker_start"]'}
    proc = popen_cli("run", "--prompts", prompts, "--store", out, *simulated_run(), env=env)
    try:
        deadline = time.monotonic() + 60
        while not (out / "daskgen.lock").exists():  # the lock is taken just before the cluster starts
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        time.sleep(1.5)  # the worker process is in its 30 s start
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_INTERRUPTED, output
    assert "the cluster did not start after the stop was asked for" in output, output
    assert "Traceback" not in output and "interrupted (SIGTERM received)" in output, output
    assert (store.GenerationStore.open(out).read_status() == store.PENDING).all()
    assert not (out / "daskgen.lock").exists(), "the lock is released"


def test_a_second_signal_stops_at_once_and_keeps_what_was_committed(tmp_path):
    """The probe engine (daskgen.testing.probes) holds the last partition at a gate that never opens, so
    after the first SIGINT the graceful stop waits for it (up to the 120 s grace): the second SIGINT,
    sent once the first was acknowledged, lands while the stop is under way."""
    prompts = write_prompts(tmp_path / "p.jsonl", 16)
    out, gate, events = tmp_path / "out.zarr", tmp_path / "gate", tmp_path / "events.log"
    common = ["--prompts", prompts, "--partition-size", "2", "--grace", "120s", "--n-workers", "1", *LONG]
    proc = popen_cli("run", *probe_args(tmp_path, out, *common, *gate_args(gate, [14, 15]), step=1.0))
    output = OutputLines(proc)
    try:
        wait_for_arrival(events, proc, row=14)
        done_before = _wait_for_some_done(out, proc, minimum=2)
        os.kill(proc.pid, signal.SIGINT)
        output.wait_for("SIGINT received: stopping")
        assert proc.poll() is None and any(in_flight_after(read_events(events)).values()), "the stop is under way"
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, output.join()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "again: stopping now" in output.join()
    assert (store.GenerationStore.open(out).read_status()[done_before] == store.DONE).all()
    assert _group_gone(proc.pid)
    res = run_cli("run", *probe_args(tmp_path, out, *common, events="second.log"))
    assert res.returncode == 0 and "16 done" in res.stdout, res.stdout + res.stderr


def _lose_one_of_two_workers(
    tmp_path: Path,
    lose,
    env: dict[str, str] | None = None,
    expect: str = "24 done, 0 failed, 0 pending",
    settings: dict[str, object] | None = None,
) -> tuple[Path, str]:
    """Run 24 long prompts on two worker processes; once some are done call ``lose(client)`` (it returns the
    address of the worker it made leave); the run must end as ``expect`` without that worker.  ``settings``:
    Dask settings the workers start with.  Returns (store, output)."""
    import dask
    from distributed import Client, LocalCluster

    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "out.zarr"
    common = ["--prompts", prompts, "--partition-size", "2", "--seed", "4", "--window", "3", *LONG]
    with (
        dask.config.set({"distributed.worker.daemon": False, **(settings or {})}),
        LocalCluster(n_workers=2, threads_per_worker=4, processes=True, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        proc = popen_cli(
            "run",
            *sim_args(tmp_path, out, *common, "--scheduler-address", lc.scheduler_address, log="run.log", step=1.0),
            env=env,
        )
        _wait_for_some_done(out, proc, minimum=2)
        victim = lose(client)
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == (0 if " 0 failed" in expect else 1), output
        assert victim not in client.scheduler_info()["workers"], "the worker left"
    assert expect in output, output
    return out, output


def test_retiring_one_of_two_workers_hands_its_partial_responses_back(tmp_path):
    out, output = _lose_one_of_two_workers(tmp_path, _retire_first)
    ds = xr.open_zarr(out)
    continued = ds.continued_tokens.values
    assert (continued > 0).any(), "the retired worker's in-flight responses must be continued, not restarted"
    assert "tokens stored by interrupted attempts" in output, output
    # a continued response is whole: its length covers what was continued and it finished normally
    rows, samples = np.nonzero(continued > 0)
    assert (ds.response_length.values[rows, samples] >= continued[rows, samples]).all()
    assert np.isin(ds.finish_reason.values[rows, samples], (FinishReason.STOP, FinishReason.LENGTH)).all()


def _retire_first(client) -> str:
    victim = sorted(client.scheduler_info()["workers"])[0]
    client.retire_workers([victim], close_workers=True)
    return victim


def test_rows_aborted_more_often_than_the_limit_fail_and_retry_failed_continues_them(tmp_path):
    """daskgen.abort-requeue-limit = 0: the retired worker's aborted rows are committed failed at once (the
    message says why), and ``--retry-failed`` continues their stored tokens instead of starting over."""
    out, output = _lose_one_of_two_workers(
        tmp_path, _retire_first, env={"DASK_DASKGEN__ABORT_REQUEUE_LIMIT": "0"}, expect="0 pending"
    )
    status, errors = store.GenerationStore.open(out).read_status(), xr.open_zarr(out).error.values
    failed = np.flatnonzero(status == store.FAILED)
    assert len(failed) > 0, output
    assert all("aborted 1 times in this run" in errors[r] and "--retry-failed" in errors[r] for r in failed)
    kept = xr.open_zarr(out).response_length.values[failed].sum()
    assert kept > 0, "the aborted rows' tokens stay stored"
    prompts = tmp_path / "p.jsonl"
    res = run_cli(
        "run",
        *sim_args(
            tmp_path,
            out,
            "--prompts",
            prompts,
            "--partition-size",
            "2",
            "--seed",
            "4",
            "--window",
            "3",
            *LONG,
            "--retry-failed",
            log="again.log",
            step=1.0,
        ),
    )
    assert res.returncode == 0 and "0 failed, 0 pending" in res.stdout, res.stdout + res.stderr
    assert (xr.open_zarr(out).continued_tokens.values[failed] > 0).any(), "continued, not regenerated"


def test_interrupt_turns_the_first_signal_into_a_request_and_the_second_into_an_exit():
    with Interrupt(10.0) as interrupt:
        assert not interrupt.requested and interrupt.collect_until() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert interrupt.requested and interrupt.reason == "SIGTERM received"
        assert interrupt.collect_until() is not None
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "handlers are restored"


#: ``daskgen run`` (its real entry point, ``daskgen.cli.main``) in a process that holds at its last exit step until
#: the file named by ``argv[1]`` exists: a test double (labelled) that keeps the shutdown after the summary line
#: going for as long as the test needs.  Registered before the CLI starts, the hook runs last of the atexit hooks.
HELD_AT_EXIT = """
import atexit, pathlib, sys, time

go = pathlib.Path(sys.argv[1])


def held() -> None:
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


atexit.register(held)
sys.argv = ["daskgen", *sys.argv[2:]]
from daskgen.cli import main

main()
"""


def test_sigterm_after_the_summary_line_lets_the_shutdown_finish_with_the_runs_status(tmp_path):
    """The run is over and everything committed once its summary line is printed: a SIGTERM that reaches the process
    while it shuts down (here: held at its last exit step) no longer kills it; it exits 0, cleanly."""
    prompts, out, go = write_prompts(tmp_path / "p.jsonl", 8), tmp_path / "out.zarr", tmp_path / "go"
    cmd = [sys.executable, "-c", HELD_AT_EXIT, str(go), "run", "--prompts", str(prompts), "--store", str(out)]
    proc = subprocess.Popen(
        [*cmd, *simulated_run()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:  # wait for the summary line
            lines.append(line)
            if line.startswith("daskgen: 8 done, 0 failed, 0 pending of 8 prompts"):
                break
        else:
            raise AssertionError("no summary line:\n" + "".join(lines))
        assert proc.poll() is None, "held at its last exit step until the go file exists"
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        go.touch()
    output = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=120) == 0, output
    assert "Traceback" not in output and "SIGTERM received: stopping" not in output, output
    assert (store.GenerationStore.open(out).read_status() == store.DONE).all()
    assert run_cli("status", out).returncode == 0  # the store opens: its lock was released


def test_a_finished_runs_interrupt_leaves_sigterm_ignored_only_when_asked():
    """``daskgen run`` asks (the process only shuts down after the run): SIGTERM is then ignored, SIGINT restored;
    a library call leaves both as they were; a run that raised restores both."""
    sigint = signal.getsignal(signal.SIGINT)  # as this process has it (a test worker's may be ignored)
    try:
        with Interrupt(10.0, ignore_sigterm_after=True):
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
            assert signal.getsignal(signal.SIGINT) is not sigint
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is sigint
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with pytest.raises(RuntimeError), Interrupt(10.0, ignore_sigterm_after=True):
            raise RuntimeError("the run failed")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        with Interrupt(10.0):
            pass
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_allocation_end_from_slurm(monkeypatch):
    from daskgen.client.interrupt import allocation_end

    monkeypatch.setenv("SLURM_JOB_END_TIME", "1900000000")
    assert allocation_end() == 1900000000.0
    monkeypatch.delenv("SLURM_JOB_END_TIME")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert allocation_end() is None
    assert parse_slurm_time("Unknown") is None and parse_slurm_time("N/A") is None
    assert parse_slurm_time("2030-01-01T00:00:00") is not None


def test_allocation_end_stops_the_run_gracefully(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 16)
    out = tmp_path / "out.zarr"
    end = int(time.time()) + 8  # the allocation "ends" 8 s from now; grace 5 s: the stop begins after ~3 s
    res = run_cli(
        "run",
        *sim_args(tmp_path, out, "--prompts", prompts, "--partition-size", "2", "--grace", "5s", *LONG, step=1.0),
        env={"SLURM_JOB_END_TIME": str(end)},
    )
    assert res.returncode == EXIT_INTERRUPTED, res.stdout + res.stderr
    assert "the batch allocation ends in" in res.stdout
    assert (store.GenerationStore.open(out).read_status() == store.PENDING).any()


def test_exit_status_mapping():
    from daskgen.cli import exit_status
    from daskgen.client.runner import RunSummary

    assert exit_status(RunSummary("s", 4, 4, 0, 0)) == 0
    assert exit_status(RunSummary("s", 4, 3, 1, 0)) == 1
    assert exit_status(RunSummary("s", 4, 2, 1, 1, interrupted="SIGTERM received")) == EXIT_INTERRUPTED


def test_an_interruption_after_every_prompt_ended_exits_with_the_runs_own_status():
    """A stop that arrives once nothing is pending (the last partition committed as the signal came) leaves
    nothing to resume: the status is the run's own, and the summary does not ask for a rerun."""
    from daskgen.cli import exit_status
    from daskgen.client.runner import RunSummary

    finished = RunSummary("s", 4, 4, 0, 0, interrupted="SIGTERM received")
    assert exit_status(finished) == 0
    assert "after every prompt had ended: nothing is left to resume" in finished.line()
    assert "rerun the same command" not in finished.line()
    assert exit_status(RunSummary("s", 4, 3, 1, 0, interrupted="SIGTERM received")) == 1


def test_grace_is_validated():
    from daskgen.config import RunConfig
    from daskgen.errors import ConfigError

    assert RunConfig(grace="2m").grace_seconds() == 120
    assert RunConfig(grace=30).grace_seconds() == 30
    with pytest.raises(ConfigError, match="positive duration"):
        RunConfig(grace="soon")


def test_subprocess_helper_is_real():  # the CLI exists and documents the new options
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "daskgen", "run", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert "--grace" in res.stdout and "--no-keep-partial" in res.stdout


def _dask_worker(address: str, name: str, log: Path) -> subprocess.Popen:
    """A real ``dask worker`` CLI with a nanny and daskgen's nanny preload, as HPC jobs start it."""
    import sys

    from tests.conftest import cli_env

    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            address,
            "--name",
            name,
            "--nthreads",
            "4",
            "--nanny",
            "--preload-nanny",
            "daskgen.worker.nanny",
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=cli_env(),
        start_new_session=True,
    )


def test_sigterm_to_a_dask_worker_job_hands_its_partial_responses_back(tmp_path):
    """The batch shell of a worker job (``exec dask worker``) gets SIGTERM: its nanny drains the worker first."""
    from distributed import Client, LocalCluster

    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "out.zarr"
    common = ["--prompts", prompts, "--partition-size", "2", "--seed", "4", "--window", "3", *LONG]
    with LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as lc, Client(lc) as client:
        jobs = [_dask_worker(lc.scheduler_address, f"job-{i}", tmp_path / f"job-{i}.log") for i in range(2)]
        try:
            client.wait_for_workers(2, timeout=120)
            proc = popen_cli(
                "run",
                *sim_args(tmp_path, out, *common, "--scheduler-address", lc.scheduler_address, log="run.log", step=1.0),
            )
            _wait_for_some_done(out, proc, minimum=2)
            os.kill(jobs[0].pid, signal.SIGTERM)
            assert jobs[0].wait(timeout=60) == 0, (tmp_path / "job-0.log").read_text()
            output, _ = proc.communicate(timeout=240)
        finally:
            for job in jobs:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    assert "24 done, 0 failed, 0 pending" in output
    assert "draining worker" in (tmp_path / "job-0.log").read_text()
    continued = xr.open_zarr(out).continued_tokens.values
    assert (continued > 0).any(), "the stopped job's in-flight responses must be continued, not restarted"


def test_sigterm_to_a_worker_process_drains_it_and_it_leaves(tmp_path):
    """SLURM signals every process of a job: a nanny-spawned worker process that gets SIGTERM drains itself."""

    def terminate(client):
        victim, pid = sorted(client.run(os.getpid).items())[0]
        os.kill(pid, signal.SIGTERM)
        return victim

    out, _ = _lose_one_of_two_workers(tmp_path, terminate)
    assert (xr.open_zarr(out).continued_tokens.values > 0).any()


def test_sigterm_to_a_worker_and_its_writer_processes_drains_it(tmp_path, capfd):
    """With ``daskgen.writer-processes: 1``, SLURM's SIGTERM reaches the worker and its writer process: the
    writer dies at once, the draining worker starts another, writes its partitions' partial responses, and
    leaves; they are continued elsewhere."""

    def terminate_with_writers(client):
        def processes() -> list[int]:
            import psutil

            return [os.getpid(), *(child.pid for child in psutil.Process().children())]

        victim, pids = sorted(client.run(processes).items())[0]
        assert len(pids) >= 2, f"the worker should have a writer process: {pids}"
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        return victim

    settings = {"daskgen.writer-processes": 1}
    out, _ = _lose_one_of_two_workers(tmp_path, terminate_with_writers, settings=settings)
    assert (xr.open_zarr(out).continued_tokens.values > 0).any()
    assert "a daskgen writer process died" in capfd.readouterr().err  # the worker's log: it wrote again


def test_drain_before_retire_keeps_every_way_of_choosing_workers():
    """The scheduler wrapper resolves targets as the scheduler does: addresses, names, or workers_to_close."""
    from distributed import Client, LocalCluster

    from daskgen.worker.scheduler import DrainBeforeRetire

    with (
        LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        client.register_plugin(DrainBeforeRetire(timeout=5), name=DrainBeforeRetire.name)
        client.wait_for_workers(4, timeout=60)
        workers = client.scheduler_info()["workers"]
        first = sorted(workers)[0]
        assert list(client.retire_workers([first])) == [first]
        name = next(w["name"] for a, w in client.scheduler_info()["workers"].items())
        assert len(client.retire_workers(names=[name])) == 1
        assert len(client.retire_workers(n=1)) == 1
        assert len(client.scheduler_info()["workers"]) == 1
        with pytest.raises(TypeError, match="mutually exclusive"):
            client.retire_workers(workers=[first], names=[name])


def test_a_leaving_worker_drops_only_distributeds_races_of_its_own_retirement():
    """A worker that retires itself on SIGTERM while its nanny or cluster closes it (the whole job got SIGTERM)
    makes distributed log two benign races; the leaving worker drops exactly those records, which distributed
    still words as :data:`LEAVING_RACES` says (this fails when it words them otherwise)."""
    import inspect
    import logging

    import distributed.worker

    from daskgen.worker.drain import LEAVING_RACES, LeavingRaces

    source = inspect.getsource(distributed.worker)
    assert all(f'"{race}' in source for race in LEAVING_RACES), "distributed words these races otherwise now"

    def record(msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, msg, args, None)

    races = LeavingRaces()
    assert not races.filter(record("Invalid Worker.status transition: %s -> %s", "closing", "closing_gracefully"))
    assert not races.filter(record("Scheduler was unaware of this worker; shutting down."))
    assert races.filter(record("Compute Failed\nKey: %s", "x")), "every other record of the worker is kept"
