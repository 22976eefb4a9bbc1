"""Reliability suite (docs/reliability.md): real worker processes, subprocess clients, real stores."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from daskgen import store
from daskgen.analysis.accessor import open_store
from daskgen.engines.base import FinishReason
from daskgen.errors import StoreLockedError
from daskgen.store.records.lock import LOCK_NAME, StoreLock
from daskgen.testing.probes import row_of
from tests.conftest import popen_cli, run_cli, write_prompts
from tests.fault_tally import count, logged_requests, probed_requests, record
from tests.probing import gate_args, probe_args, wait_for_arrival
from tests.test_run import _wait_for_some_done, calls, sim_args

pytestmark = pytest.mark.timeout(300)

COMPARED = ("status", "response_ids", "response_length", "finish_reason", "prompt_ids", "response_mask")


def assert_same_store(a: Path, b: Path) -> None:
    x, y = xr.open_zarr(a), xr.open_zarr(b)
    for name in COMPARED:
        np.testing.assert_array_equal(x[name].values, y[name].values, err_msg=name)


def reference(tmp_path: Path, common: list) -> Path:
    ref = tmp_path / "ref.zarr"
    res = run_cli("run", *sim_args(tmp_path, ref, *common, log="ref.log"))
    assert res.returncode == 0, res.stdout + res.stderr
    return ref


@pytest.fixture
def cluster():
    """Two nanny-managed worker processes (a killed worker is restarted by its nanny)."""
    import dask
    from distributed import Client, LocalCluster

    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        yield lc, client


def test_worker_sigkill_mid_run_completes_exactly_once(tmp_path, cluster):
    lc, client = cluster
    prompts = write_prompts(tmp_path / "p.jsonl", 96)
    common = [
        "--prompts",
        prompts,
        "--n-samples",
        "2",
        "--partition-size",
        "4",
        "--seed",
        "11",
        "--window",
        "1",
        "--no-progress",
    ]
    ref = reference(tmp_path, common)
    out = tmp_path / "out.zarr"
    proc = popen_cli(
        "run", *sim_args(tmp_path, out, *common, "--scheduler-address", lc.scheduler_address, log="run.log", step=1.0)
    )
    done_at_kill = _wait_for_some_done(out, proc, minimum=8)
    pids = client.run(os.getpid)
    victim_addr, victim_pid = sorted(pids.items())[0]
    at_kill = len(logged_requests(tmp_path / "run.log"))
    os.kill(victim_pid, signal.SIGKILL)
    assert proc.wait(timeout=240) == 0, proc.stdout.read()
    assert_same_store(ref, out)
    assert (store.GenerationStore.open(out).read_status() == store.DONE).all()
    # count generations: every sample generated; a repeat only for work lost with the killed worker
    log = [line.split() for line in (tmp_path / "run.log").read_text().splitlines()]
    per_sample: dict[str, list[int]] = {}
    for request_id, pid in log:
        per_sample.setdefault(request_id, []).append(int(pid))
    assert set(per_sample) == {f"p{row}-s{s}" for row in range(96) for s in range(2)}
    repeated = {rid: pids_ for rid, pids_ in per_sample.items() if len(pids_) > 1}
    assert all(victim_pid in pids_[:-1] for pids_ in repeated.values()), repeated
    assert all(pids_.count(p) == 1 for pids_ in per_sample.values() for p in set(pids_)), "a worker repeated itself"
    committed_then_redone = {rid for rid in repeated if done_at_kill[int(rid[1:].split("-")[0])]}
    assert committed_then_redone == set(), f"committed samples generated again: {sorted(committed_then_redone)}"
    # the nanny's replacement worker got the engine plugin
    client.wait_for_workers(2, timeout=60)
    from daskgen.worker.plugin import plugin_status

    states = client.run(plugin_status)
    assert all(s["state"] == "ready" for s in states.values()), states
    new_pids = set(client.run(os.getpid).values())
    assert victim_pid not in new_pids and len(new_pids) == 2
    redone_rows = {int(rid[1:].split("-")[0]) for rid in repeated}
    requests = logged_requests(tmp_path / "run.log")
    tally = count(requests[:at_kill], requests[at_kill:])
    assert tally.regenerated == len(redone_rows), tally
    record("SIGKILL of a worker process mid-run", rows=96, tally=tally)


def finish_reasons_stored(out, rows: int) -> bool:
    """Whether the first ``rows`` rows' finish reasons (the array a store's region write ends with) have landed."""
    if not (out / "finish_reason" / "c" / "0" / "0").exists():
        return False
    try:
        reasons = store.GenerationStore.open(out).read_region(0, rows, ("finish_reason",))["finish_reason"]
    except Exception:  # the chunk is still being written
        return False
    return bool(np.isin(reasons, (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)).all())


def test_client_killed_between_data_write_and_commit(tmp_path):
    """The worker has written a partition's data, the client has not committed it: nothing is done.

    The probe engine (daskgen.testing.probes) holds partition 0 at a gate; once it reached the engine
    the test stops the client process (SIGSTOP: its worker processes go on), opens the gate, waits for
    the worker to write the partition's data, and kills everything.
    """
    prompts = write_prompts(tmp_path / "p.jsonl", 16)
    common = ["--prompts", prompts, "--partition-size", "4", "--seed", "5", "--window", "1", "--no-progress"]
    ref = reference(tmp_path, common)
    out, gate = tmp_path / "out.zarr", tmp_path / "gate"
    proc = popen_cli("run", *probe_args(tmp_path, out, *common, *gate_args(gate, [0, 1, 2, 3])))
    try:
        wait_for_arrival(tmp_path / "events.log", proc, row=0)
        os.kill(proc.pid, signal.SIGSTOP)  # the client can no longer commit
        gate.touch()
        deadline = time.monotonic() + 120
        while not finish_reasons_stored(out, rows=4):  # the worker writes partition 0's data, finish reasons last
            assert time.monotonic() < deadline, "the worker did not write partition 0"
            time.sleep(0.05)
        assert (store.GenerationStore.open(out).read_status() == store.PENDING).all(), (
            "the stopped client committed nothing"
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (store.GenerationStore.open(out).read_status() == store.PENDING).all(), (
        "no row may be done without its commit"
    )
    res = run_cli("run", *probe_args(tmp_path, out, *common, events="second.log"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert_same_store(ref, out)
    tally = count(probed_requests(tmp_path / "events.log"), probed_requests(tmp_path / "second.log"))
    resent = {row_of(request) for request in probed_requests(tmp_path / "second.log")}
    assert not resent & {0, 1, 2, 3}, "the rerun keeps the written partition's finished samples"
    assert tally.kept >= 4 and tally.regenerated == 0, tally
    record("SIGKILL of the client after a worker wrote a partition, before its commit", rows=16, tally=tally)


def test_hung_engine_is_detected_restarted_and_the_run_completes(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 16)
    flag = tmp_path / "hung-once"
    args = sim_args(
        tmp_path,
        tmp_path / "out.zarr",
        "--prompts",
        prompts,
        "--partition-size",
        "4",
        "--engine-arg",
        f"hang_once_flag={flag}",
        "--engine-arg",
        "hang_after=10",
        "--config",
        _yaml(tmp_path, "partition_timeout_s: 3.0\n"),
        "--no-progress",
    )
    res = run_cli("run", *args, env={"DASK_DASKGEN__HEALTH_TIMEOUT": "2s"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert flag.exists(), "the engine must really have hung"
    assert "16 done, 0 failed" in res.stdout
    assert "health check failed" in res.stderr and "restarting it" in res.stderr


def test_second_client_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    out, gate = tmp_path / "out.zarr", tmp_path / "gate"
    common = ["--prompts", prompts, "--partition-size", "4", "--window", "1", "--no-progress"]
    # the probe engine holds the last partition until `gate` exists (never): the first run is still going
    first = popen_cli("run", *probe_args(tmp_path, out, *common, *gate_args(gate, [36, 37, 38, 39])))
    try:
        wait_for_arrival(tmp_path / "events.log", first, row=36)
        assert _wait_for_some_done(out, first, minimum=36).sum() == 36, "all but the held partition committed"
        assert (out / LOCK_NAME).exists()
        second = run_cli("run", *probe_args(tmp_path, out, *common, events="second.log"))
        assert first.poll() is None, "the first run was still going while the second one started"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert second.returncode == 2
    assert "in use by another daskgen run" in second.stderr and f"pid {first.pid}" in second.stderr
    assert not (tmp_path / "second.log").exists(), "the refused run generated nothing"
    assert (out / LOCK_NAME).exists(), "a killed client leaves its lock behind"
    third = run_cli("run", *probe_args(tmp_path, out, *common, events="third.log"))
    assert third.returncode == 0, third.stdout + third.stderr
    assert "40 done" in third.stdout and not (out / LOCK_NAME).exists()


def test_lock_from_another_host_expires_by_heartbeat(tmp_path):
    import json

    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1, "heartbeat": time.time()}))
    with pytest.raises(StoreLockedError, match="host elsewhere"):
        StoreLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1, "heartbeat": time.time() - 999}))
    lock = StoreLock(tmp_path).acquire()
    assert lock.took_over["host"] == "elsewhere"
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_secrets_never_reach_store_logs_or_output(tmp_path):
    secret = "sk-PLANTED-0123456789abcdef"
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    out = tmp_path / "out.zarr"
    res = run_cli(
        "run",
        *sim_args(tmp_path, out, "--prompts", prompts, "--partition-size", "4"),
        "--engine-arg",
        f"api_key={secret}",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    status = run_cli("status", out)
    leaks = [p for p in out.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaks == []
    assert secret not in res.stdout + res.stderr + status.stdout + status.stderr
    assert store.read_store_attrs(out).config["engine_args"]["api_key"] == "***"


def test_full_disk_stops_the_run_clearly_and_the_store_resumes(tmp_path):
    """A real full filesystem: a 2 MiB tmpfs (needs root, as CI has for SLURM: fails there, skips elsewhere).

    The whole store takes ~4.3 MiB (400 prompts x 256 tokens, ~9 files of 4 KiB pages or more per partition), so
    the disk fills about half-way; 2 MiB leaves room for ~20 partitions before the first commit, which an instant
    engine on a loaded machine can write before the client commits (with 600 KiB, CI once saw no commit at all)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if mount.returncode != 0:
        why = f"needs permission to mount a small tmpfs (root): {mount.stderr.strip()}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {why}", pytrace=False)
        pytest.skip(why)
    try:
        prompts = write_prompts(tmp_path / "p.jsonl", 400)
        common = [
            "--prompts",
            prompts,
            "--partition-size",
            "8",
            "--max-new-tokens",
            "256",
            "--engine-arg",
            "length_dist=fixed",
            "--engine-arg",
            "length_mean=256",
            "--no-progress",
        ]
        args = [*SIM_BIG, *common, "--store", mnt / "out.zarr", "--engine-arg", f"log_path={tmp_path / 'a.log'}"]
        res = run_cli("run", *args)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "No space left on device" in res.stderr and "rerun the same command to resume" in res.stderr
        done_before = store.GenerationStore.open(mnt / "out.zarr").read_status() == store.DONE
        assert 0 < done_before.sum() < 400
        ds = open_store(mnt / "out.zarr")
        assert (ds.response_length.values[done_before] == 256).all(), "every done row has its data"
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        res = run_cli("run", *args[:-2], "--engine-arg", f"log_path={tmp_path / 'b.log'}")
        assert res.returncode == 0, res.stdout + res.stderr
        regenerated = {int(k[1:].split("-")[0]) for k in calls(tmp_path / "b.log")}
        assert not any(done_before[sorted(regenerated)])
        first = {int(k[1:].split("-")[0]) for k in calls(tmp_path / "a.log")}
        kept = set(np.flatnonzero(~done_before).tolist()) - regenerated
        assert kept <= first, "a pending row not regenerated must have been generated (and stored) before"
        assert (store.GenerationStore.open(mnt / "out.zarr").read_status() == store.DONE).all()
        assert (open_store(mnt / "out.zarr").response_length.values == 256).all()
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


SIM_BIG = [
    "--engine",
    "daskgen.testing.engines:RecordingEngine",
    "--engine-arg",
    "inner=simulated",
    "--model",
    "sim",
    "--max-prompt-tokens",
    "128",
    "--engine-arg",
    "time_scale=0",
]


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path
