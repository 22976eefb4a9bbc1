"""A real engine server that stops answering (docs/reliability.md, case 3): ``transformers serve`` frozen.

Real parts: ``transformers serve`` with the tiny model on loopback (:mod:`tests.openai_server`), the
``daskgen run`` CLI in a subprocess on a LocalCluster with one nanny-managed worker process whose
``openai`` engine talks to that server, a Zarr store on disk, and real SIGSTOP/SIGCONT sent to the
server's process group.  A stopped server keeps its listening socket and its connections open (the
kernel still accepts new ones) and answers nothing: a hung server, seen from outside.

Greedy decoding on a server that runs one request at a time is a pure function of the prompt, so each
finished store is compared with a fault-free run of the same command (one for the module).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from daskgen import store
from daskgen.store.records.lock import LOCK_NAME
from tests.conftest import popen_cli, run_cli, write_prompts
from tests.fault_tally import Tally, record
from tests.openai_server import ServeProcess, tiny_model
from tests.probing import OutputLines
from tests.test_reliability import assert_same_store

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

N = 12
PARTITION = 2
KEPT = ("status", "committed_at", "response_ids", "response_length", "finish_reason")


def run_args(prompts: Path, out: Path, server: ServeProcess, *extra: str) -> list:
    """``daskgen run`` through ``server``: greedy, one partition of 2 prompts at a time on one worker."""
    return [
        *("--prompts", prompts, "--store", out, "--model", tiny_model(), "--engine", "openai"),
        *("--engine-arg", f"base_url={server.url}/v1", "--engine-arg", "api=completions"),
        *("--n-samples", "2", "--max-new-tokens", "16", "--temperature", "0"),
        *("--partition-size", str(PARTITION), "--window", "1", "--n-workers", "1", "--no-progress"),
        *extra,
    ]


@pytest.fixture(scope="module")
def served() -> Iterator[ServeProcess]:
    """The module's ``transformers serve`` of the tiny model: the fault-free run's, then each test's (which freezes
    it and wakes it again)."""
    server = ServeProcess(tiny_model()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, served: ServeProcess) -> tuple[Path, Path]:
    """The prompts and the store of a run that nothing interrupted."""
    folder = tmp_path_factory.mktemp("hang-reference")
    prompts, ref = write_prompts(folder / "p.jsonl", N), folder / "ref.zarr"
    res = run_cli("run", *run_args(prompts, ref, served), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return prompts, ref


@pytest.fixture
def server(served: ServeProcess) -> Iterator[ServeProcess]:
    """The module's server for a test that freezes it; woken at the end whatever the test did."""
    yield served
    with contextlib.suppress(ProcessLookupError):  # a test that failed may have left it dead: the module stops it
        served.send(signal.SIGCONT)


def freeze_once_some_are_done(server: ServeProcess, out: Path, proc: subprocess.Popen) -> dict[str, np.ndarray]:
    """SIGSTOP the server once two partitions are committed; what the store held at that moment."""
    deadline = time.monotonic() + 180
    while (
        store.read_store_attrs(out) is None or (store.GenerationStore.open(out).read_status() == store.DONE).sum() < 4
    ):
        assert proc.poll() is None, f"the run ended before the server was stopped: {proc.stdout.read()}"
        assert time.monotonic() < deadline, "no partition was committed in time"
        time.sleep(0.05)
    server.send(signal.SIGSTOP)
    return snapshot(out)


def snapshot(out: Path) -> dict[str, np.ndarray]:
    """The rows done now (``done``: status read first, so each row's data and commit time are final)."""
    opened = store.GenerationStore.open(out)
    done = opened.read_status() == store.DONE
    return {"done": done, **opened.read_region(0, N, KEPT[1:])}


def assert_kept(before: dict[str, np.ndarray], out: Path) -> None:
    """Every row done in ``before`` is still done with the same commit time and tokens."""
    now, rows = snapshot(out), before["done"]
    assert now["done"][rows].all(), "a committed row is no longer done"
    for name in KEPT[1:]:
        np.testing.assert_array_equal(now[name][rows], before[name][rows], err_msg=name)


def in_flight_rows(output: str) -> set[int]:
    """Rows of the partitions whose attempt broke on the frozen server (named by the worker's log)."""
    starts = {int(a) for a in re.findall(r"rows (\d+)\.\.\d+ did not finish within partition_timeout_s", output)}
    starts |= {int(r) - int(r) % PARTITION for r in re.findall(r"died while request 'p(\d+)-s\d+' ran", output)}
    return {r for s in starts for r in range(s, min(s + PARTITION, N))}


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The run's output once it exited (within ``timeout`` s: a run that does not end is a failure)."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the run did not end within {timeout} s:\n{proc.communicate()[0][-5000:]}") from None


def finish_reading(proc: subprocess.Popen, lines: OutputLines, timeout: float) -> str:
    """:func:`finish` for a run whose output ``lines`` collects."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the run did not end within {timeout} s:\n{lines.join()[-5000:]}") from None
    return lines.join()


def test_a_server_that_stops_answering_then_resumes_is_waited_out(tmp_path, fault_free, server):
    """Frozen for longer than the partition and health timeouts: the hung partition's health check fails,
    the engine is restarted in place (its start waits until the server answers again), the partition is
    retried; the run completes as if nothing happened."""
    prompts, ref = fault_free
    out = tmp_path / "out.zarr"
    timeouts = ("--partition-timeout-s", "6", "--engine-arg", "timeout_s=30")
    proc = popen_cli("run", *run_args(prompts, out, server, *timeouts), env={"DASK_DASKGEN__HEALTH_TIMEOUT": "4s"})
    lines = OutputLines(proc)
    try:
        before = freeze_once_some_are_done(server, out, proc)
        # woken once the hang was noticed: the restart's start then waits (timeout_s) for the server to answer
        lines.wait_for("health check failed: no token within 4 s", timeout=120)
        server.send(signal.SIGCONT)
        output = finish_reading(proc, lines, 240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    assert f"{N} done, 0 failed, 0 pending" in output, output
    assert "health check failed: no token within 4 s" in output and "restarting it" in output, "the hang was noticed"
    regenerated = in_flight_rows(output)
    assert regenerated and not before["done"][sorted(regenerated)].any(), output
    assert_kept(before, out)
    assert_same_store(ref, out)
    record(
        "the engine's server stops answering (SIGSTOP) past the partition and health timeouts, then resumes",
        rows=N,
        tally=Tally(kept=int(before["done"].sum()), regenerated=len(regenerated)),
    )


def test_a_server_that_stays_stopped_stops_the_run_which_resumes_later(tmp_path, fault_free, server):
    """Frozen for good, with the default partition timeout (none): requests get nothing for ``timeout_s``, the
    engine is restarted and its start gets nothing either; the run stops (exit 2) naming the server and the
    fix, no row failed, every committed row kept, the lock released.  Woken up, the same command finishes
    the rest and generates nothing twice."""
    prompts, ref = fault_free
    out = tmp_path / "out.zarr"
    args = run_args(prompts, out, server, "--engine-arg", "timeout_s=6", "--engine-arg", "max_retries=0")
    env = {"DASK_DASKGEN__ENGINE_CHECK_INTERVAL": "1s"}
    proc = popen_cli("run", *args, env=env)
    try:
        before = freeze_once_some_are_done(server, out, proc)
        # noticed after timeout_s (the request) + timeout_s (the restart's first request) + the engine check
        output = finish(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, output
    assert "error: the 'openai' engine has failed on every worker" in output, output
    assert f"the server at {server.url} sent nothing for 6 s" in output and "Check the server process" in output
    assert "rerun the same command" in output
    status = store.GenerationStore.open(out).read_status()
    assert not (status == store.FAILED).any(), "rows were marked failed because the server hung"
    stopped = snapshot(out)
    assert_kept(before, out)
    assert not (out / LOCK_NAME).exists(), "the lock is released"
    pending = int((status != store.DONE).sum())
    in_flight = in_flight_rows(output)
    assert pending > 0 and in_flight and not before["done"][sorted(in_flight)].any(), output
    server.send(signal.SIGCONT)
    rerun = run_cli("run", *args, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"{N} done, 0 failed, 0 pending" in rerun.stdout, rerun.stdout
    assert f"this run generated {pending} prompts" in rerun.stdout, "only the rows left were generated"
    assert_kept(stopped, out)
    assert_same_store(ref, out)
    record(
        "the engine's server stops answering (SIGSTOP) for good: the run stops; rerun once it resumes",
        rows=N,
        tally=Tally(kept=int(before["done"].sum()), regenerated=len(in_flight)),
    )
