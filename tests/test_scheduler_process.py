"""The scheduler in a process of its own (``cluster.scheduler_process``): real clusters, real processes.

The SLURM end-to-end tests (tests/test_slurm_e2e.py) run it too: it is the default for batch clusters.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import cloudpickle
import dask
import psutil
import pytest
from distributed import Client

from daskgen.client.runner import run
from daskgen.config import RunConfig
from daskgen.deploy import deployment, make_cluster, parse_cluster_spec
from daskgen.deploy.deployment import runs_scheduler_process
from daskgen.deploy.scheduler_process import SchedulerProcess
from daskgen.errors import ConfigError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the scheduler process cannot import tests/


def scheduler_pid_and(key: str):
    """(pid, the Dask config value of ``key``) in the process that runs this function (on the scheduler)."""
    import os

    import dask

    return os.getpid(), dask.config.get(key, None)


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def test_defaults_per_kind_and_bad_values():
    assert runs_scheduler_process("slurm") and runs_scheduler_process("pbs")
    assert not runs_scheduler_process("local")
    assert deployment({"kind": "slurm", "memory": "1GB"}).scheduler_process
    assert not deployment({"kind": "slurm", "memory": "1GB", "scheduler_process": False}).scheduler_process
    assert deployment({"kind": "local", "scheduler_process": True}).scheduler_process
    with pytest.raises(ConfigError, match="cluster.scheduler_process must be true or false, got 'yes'"):
        parse_cluster_spec({"scheduler_process": "yes"})


def test_options_that_do_not_cross_a_process_boundary_are_refused():
    with pytest.raises(ValueError, match="cannot take the option.*validate"):
        SchedulerProcess(validate=True)
    from distributed.security import Security

    with pytest.raises(ConfigError, match="scheduler processes name certificate files.*tls_scheduler_key"):
        SchedulerProcess(security=Security.temporary())  # PEM texts in memory
    assert SchedulerProcess(services={}, blocked_handlers=None).spec["security"] is None  # empty defaults pass


def ignored_signals(pid: int) -> set[int]:
    """The signals process ``pid`` ignores (the ``SigIgn`` mask of ``/proc/PID/status``)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigIgn:"))
    mask = int(line.split()[1], 16)
    return {s for s in range(1, 65) if mask >> (s - 1) & 1}


@pytest.mark.timeout(120)
def test_local_cluster_with_its_scheduler_in_a_process_of_its_own():
    """The scheduler runs in another process and session, with the client's Dask config; closing the
    cluster ends the process and removes its directory."""
    with dask.config.set({"distributed.scheduler.default-task-durations": {"daskgen-partition": "77s"}}):
        cluster, info = make_cluster(
            {"kind": "local", "n_workers": 1, "threads_per_worker": 2, "scheduler_process": True}
        )
    proc = cluster.scheduler
    pid, directory = proc.process.pid, proc.directory
    try:
        assert isinstance(proc, SchedulerProcess) and f"scheduler in process {pid}" in str(info)
        assert os.getsid(pid) != os.getsid(0)  # its own session: a Ctrl-C for the client does not reach it
        # a scancel or walltime signal is for the client: the scheduler ignores it, so the kernel drops it
        # when it is sent (no waiting needed to see that it survives)
        assert {signal.SIGTERM, signal.SIGINT} <= ignored_signals(pid)
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
        with Client(cluster, timeout="20s") as client:
            got_pid, durations = client.run_on_scheduler(
                scheduler_pid_and, "distributed.scheduler.default-task-durations"
            )
            assert got_pid == pid != os.getpid()
            assert durations["daskgen-partition"] == "77s"  # the client's config reached it
            assert client.submit(sum, [1, 2], pure=False).result(timeout=30) == 3
    finally:
        cluster.close()
    assert _gone(pid) and not directory.exists()


@pytest.mark.timeout(120)
def test_an_elastic_local_cluster_declares_partition_durations_to_its_scheduler_process():
    """Adaptive scaling reads the expected partition duration on the scheduler: it must be set before the
    scheduler process starts; bad bounds are refused before anything starts."""
    with pytest.raises(ConfigError, match="max_workers=1 must be >= 1 and >= min_workers=2"):
        make_cluster({"kind": "local", "min_workers": 2, "max_workers": 1, "scheduler_process": True})
    with dask.config.set({"distributed.scheduler.default-task-durations": {}}):
        cluster, info = make_cluster(
            {"kind": "local", "n_workers": 1, "min_workers": 0, "max_workers": 1, "scheduler_process": True}
        )
        try:
            assert info.adaptive
            with Client(cluster, timeout="20s") as client:
                key = "distributed.scheduler.default-task-durations"
                _, durations = client.run_on_scheduler(scheduler_pid_and, key)
            assert durations["daskgen-partition"] == "60s"
        finally:
            cluster.close()


@pytest.mark.timeout(180)
def test_a_run_on_a_cluster_whose_scheduler_runs_apart(tmp_path, caplog):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "question {i}"}}\n' for i in range(24)))
    config = RunConfig(
        model="sim",
        engine="simulated",
        store=str(tmp_path / "out.zarr"),
        partition_size=8,
        max_new_tokens=8,
        engine_args={"time_scale": 0.0},
        cluster={"kind": "local", "n_workers": 1, "scheduler_process": True},
    )
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with caplog.at_level("INFO", logger="daskgen.client.cluster"):
        summary = run(config, str(prompts))
    assert summary.ok and summary.done == 24, summary.line()
    assert "scheduler in process" in caplog.text  # the cluster line names the scheduler's own process
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert all(_gone(pid) for pid in left)  # the scheduler and worker processes ended with the run


@pytest.mark.timeout(120)
def test_local_tls_cluster_with_a_scheduler_process_uses_certificate_files():
    cluster, info = make_cluster(
        {"kind": "local", "n_workers": 1, "threads_per_worker": 1, "tls": True, "scheduler_process": True}
    )
    files = cluster.tls_files.directory
    try:
        assert cluster.scheduler_address.startswith("tls://") and "TLS with a per-run certificate" in str(info)
        assert cluster.scheduler.spec["security"]["key"] == str(files / "key.pem")
        with Client(cluster, timeout="20s") as client:
            assert client.submit(sum, [1, 2], pure=False).result(timeout=30) == 3
        with pytest.raises(OSError):
            Client(cluster.scheduler_address.replace("tls://", "tcp://"), timeout="5s", set_as_default=False)
    finally:
        cluster.close()
    assert not files.exists()  # the certificate goes with the cluster


@pytest.mark.timeout(60)
def test_a_scheduler_that_cannot_start_is_a_clear_error():
    async def start(proc: SchedulerProcess) -> None:
        await proc

    proc = SchedulerProcess(host="no-such-host.invalid", dashboard=False)
    with pytest.raises(RuntimeError, match="scheduler process exited with code .*its log ends with") as err:
        asyncio.run(start(proc))
    assert "no-such-host.invalid" in str(err.value) and "scheduler_process: false" in str(err.value)
    assert proc.process is None and proc.directory is None  # nothing left behind


@pytest.mark.timeout(60)
def test_a_scheduler_slower_than_its_start_timeout_is_stopped_and_named():
    async def start(proc: SchedulerProcess) -> None:
        await proc

    proc = SchedulerProcess(host="127.0.0.1", dashboard=False)
    too_slow = r"did not listen within 0.01 s \(daskgen.scheduler-start-timeout\)"
    with dask.config.set({"daskgen.scheduler-start-timeout": "0.01s"}), pytest.raises(RuntimeError, match=too_slow):
        asyncio.run(start(proc))
    assert proc.process is None and proc.directory is None  # killed and cleaned up


@pytest.mark.timeout(60)
def test_the_scheduler_process_does_not_outlive_a_killed_client(tmp_path):
    """SIGKILL the client process: its scheduler process notices and ends too."""
    script = textwrap.dedent("""
        import asyncio, sys, time
        from daskgen.deploy.scheduler_process import SchedulerProcess

        async def main():
            proc = await SchedulerProcess(host="127.0.0.1", dashboard=False)
            print(proc.process.pid, flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
    """)
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(client.stdout.readline())
        (directory,) = {Path(f.path).parent for f in psutil.Process(pid).open_files() if f.path.endswith(".log")}
        assert psutil.pid_exists(pid) and directory.exists()
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
        assert _gone(pid), "the scheduler process outlived its client"
        assert not directory.exists(), "its log folder is removed too"
    finally:
        client.kill()


@pytest.mark.timeout(300)
def test_sigterm_to_every_process_of_the_client_still_saves_partial_responses(tmp_path):
    """``scancel``/walltime signal every process of the client's job: the scheduler process stays up while
    the client drains the workers through it, then ends with the run; nothing is left behind."""
    from daskgen import store
    from daskgen.client.interrupt import EXIT_INTERRUPTED
    from tests.conftest import popen_cli, write_prompts
    from tests.test_preemption import LONG, _group_gone, _partials
    from tests.test_run import _wait_for_some_done, sim_args

    (tmp_path / "run.yaml").write_text("cluster:\n  kind: local\n  n_workers: 2\n  scheduler_process: true\n")
    out = tmp_path / "out.zarr"
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    proc = popen_cli(
        "run",
        *sim_args(
            tmp_path,
            out,
            "--config",
            tmp_path / "run.yaml",
            "--prompts",
            prompts,
            "--partition-size",
            "2",
            "--n-samples",
            "2",
            "--grace",
            "20s",
            *LONG,
            step=1.0,
        ),
    )
    done_before = _wait_for_some_done(out, proc, minimum=4)
    (scheduler,) = [
        c
        for c in psutil.Process(proc.pid).children(recursive=True)
        if "daskgen.deploy.scheduler_process" in " ".join(c.cmdline())
    ]
    os.kill(proc.pid, signal.SIGTERM)
    scheduler.send_signal(signal.SIGTERM)  # like scancel: every process of the job
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, output
    assert _partials(out), "in-flight responses must be saved as partial responses"
    assert (store.GenerationStore.open(out).read_status()[done_before] == store.DONE).all()
    assert _gone(scheduler.pid) and _group_gone(proc.pid), "a process of the interrupted run was left behind"
