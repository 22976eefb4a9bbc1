"""Torn writes (docs/reliability.md, case 2c): a process SIGKILLed while it writes a chunk.

Real parts: the ``daskgen run`` CLI in a subprocess on a real LocalCluster (nanny-managed worker
process), a real Zarr store on disk, real SIGKILL, ``daskgen verify``.  The moment of the kill is
made exact from outside daskgen's code: ``tests/freeze_hook`` (a labelled test double loaded as
``sitecustomize``) freezes the process that writes one chosen chunk — after zarr put the chunk in
place, or half-way through zarr's temporary file — and names its pid in a marker file; the test then
SIGKILLs that process.  Every test compares the finished store with a fault-free run of the same
prompts (the simulated engine is a pure function of the prompt ids) and runs ``daskgen verify``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from daskgen import store
from tests.conftest import REPO, popen_cli, run_cli, simulated_run, write_prompts
from tests.fault_tally import count, logged_requests, record
from tests.test_reliability import assert_same_store
from tests.test_run import calls, sim_args

pytestmark = pytest.mark.timeout(300)

RUN = simulated_run()  # 4 rows per partition, one worker process
HOOK = Path(__file__).parent / "freeze_hook"
N = 16
#: ``RUN``'s partitions, samples and worker, for runs through the recording wrapper (``sim_args``).
SHAPE = ["--partition-size", "4", "--n-samples", "2", "--n-workers", "1", "--no-progress"]


def _clean(tmp_path: Path, prompts: Path) -> Path:
    ref = tmp_path / "ref.zarr"
    res = run_cli("run", "--prompts", prompts, "--store", ref, *RUN)
    assert res.returncode == 0, res.stdout + res.stderr
    return ref


def _frozen_run(tmp_path: Path, prompts: Path, key: str, mode: str, run: list):
    """Start ``daskgen run`` with ``run`` (store included) whose first write of chunk ``key`` freezes its
    process; return the run and that pid."""
    marker = tmp_path / "frozen.pid"
    env = {
        "DASKGEN_TEST_FREEZE": json.dumps({"key": key, "mode": mode, "marker": str(marker)}),
        "PYTHONPATH": os.pathsep.join([str(HOOK), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = popen_cli("run", "--prompts", prompts, *run, env=env)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the chunk was never written"
        time.sleep(0.02)
    return proc, int(marker.read_text())


def _partials(out: Path) -> list[Path]:
    return sorted(out.rglob("*.partial"))


def _chunk_of(partial: Path) -> Path:
    """The chunk a zarr temporary file was written for (``<chunk>.<uuid>.partial``)."""
    return partial.with_name(partial.name.rsplit(".", 2)[0])


def _verify_passes(out: Path) -> None:
    res = run_cli("verify", out, "--no-progress")
    assert res.returncode == 0 and "sound" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize(
    ("key", "mode"),
    [
        ("prompt_ids/c/1/0", "after"),  # between arrays: one array of the partition is written, not all
        ("response_ids/c/1/0/0", "torn"),  # mid-chunk: half of the chunk's bytes in zarr's temporary file
    ],
)
def test_a_worker_killed_while_it_writes_its_region(tmp_path, key, mode):
    prompts = write_prompts(tmp_path / "p.jsonl", N)
    ref, out = _clean(tmp_path, prompts), tmp_path / "out.zarr"
    # the simulated engine inside the recording wrapper, which logs each request it is sent to calls.log
    proc, pid = _frozen_run(tmp_path, prompts, key, mode, sim_args(tmp_path, out, *SHAPE))
    assert pid != proc.pid, "the data write happens in the worker process"
    # the moment the kill lands
    if mode == "after":
        assert (out / "prompt_ids" / "c" / "1" / "0").exists()
        # the region's arrays are written side by side, its finish reasons after every other array
        assert not (out / "finish_reason" / "c" / "1").exists(), "finish_reason is written after the others"
    else:
        assert not (out / "response_ids" / "c" / "1" / "0" / "0").exists(), "a torn chunk never takes the key"
        # other threads of the frozen worker go on writing other chunks: only the chosen chunk's file counts
        torn = [p for p in _partials(out) if _chunk_of(p) == out / key]
        assert len(torn) == 1 and torn[0].stat().st_size > 0, _partials(out)
    assert (store.GenerationStore.open(out).read_status()[4:8] == store.PENDING).all()
    at_kill = len(logged_requests(tmp_path / "calls.log"))  # the frozen process sends nothing more
    os.kill(pid, signal.SIGKILL)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output  # the nanny's new worker runs the partition again
    assert_same_store(ref, out)
    if mode == "torn":  # zarr leaves the dead writer's temporary files; nothing reads them, verify ignores them
        left = _partials(out)
        assert set(torn) <= set(left), left
        assert all(_chunk_of(p).exists() for p in left), "every chunk whose write was cut is written again"
    _verify_passes(out)
    # rows sent to the engine twice: every partition the dead worker held, the frozen one among them
    redone = {rid.split("-")[0] for rid, n in calls(tmp_path / "calls.log").items() if n > 1}
    assert {f"p{row}" for row in range(4, 8)} <= redone, redone
    requests = logged_requests(tmp_path / "calls.log")
    tally = count(requests[:at_kill], requests[at_kill:])
    assert tally.regenerated == len(redone)
    record(f"worker SIGKILL while writing its region ({mode}: {key})", rows=N, tally=tally)


@pytest.mark.parametrize(
    ("key", "mode"),
    [
        ("committed_at/c/0", "after"),  # commit times written, status not yet: the rows stay pending
        ("status/c/0", "torn"),  # mid-chunk: half of the new status chunk in zarr's temporary file
    ],
)
def test_a_client_killed_while_it_commits(tmp_path, key, mode):
    prompts = write_prompts(tmp_path / "p.jsonl", N)
    ref, out = _clean(tmp_path, prompts), tmp_path / "out.zarr"
    proc, pid = _frozen_run(tmp_path, prompts, key, mode, sim_args(tmp_path, out, *SHAPE))
    assert pid == proc.pid, "commits happen in the client process"
    status_before = store.GenerationStore.open(out).read_status()
    os.killpg(proc.pid, signal.SIGKILL)  # the client and every process of its cluster
    proc.communicate(timeout=60)
    opened = store.GenerationStore.open(out)
    np.testing.assert_array_equal(opened.read_status(), status_before)  # the old status chunk, whole
    pending = int((status_before != store.DONE).sum())
    assert pending == N, "the first commit was the one cut"
    _verify_passes(out)  # before the rerun: sound (rows not done are not checked)
    rerun = run_cli("run", "--prompts", prompts, *sim_args(tmp_path, out, *SHAPE, log="rerun.log"))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_same_store(ref, out)
    _verify_passes(out)
    tally = count(logged_requests(tmp_path / "calls.log"), logged_requests(tmp_path / "rerun.log"))
    # what the workers wrote before the client died is committed by the rerun, not generated again
    assert tally.regenerated == 0 and tally.continued == 0, tally
    record(f"client SIGKILL while committing ({mode}: {key})", rows=N, tally=tally)


def test_a_torn_chunk_of_finished_rows_is_found_repaired_and_regenerated(tmp_path):
    """A write that is not atomic (a filesystem that does not honour the rename, a copy cut short):
    emulated by cutting a finished partition's chunk to half its bytes."""
    prompts = write_prompts(tmp_path / "p.jsonl", N)
    ref = _clean(tmp_path, prompts)
    out = tmp_path / "out.zarr"
    assert run_cli("run", "--prompts", prompts, *sim_args(tmp_path, out, *SHAPE)).returncode == 0
    chunk = out / "response_ids" / "c" / "2" / "0" / "0"  # rows 8..11
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    res = run_cli("verify", out, "--no-progress")
    assert res.returncode == 1 and "response_ids/c/2/0/0, rows 8..11" in res.stdout, res.stdout + res.stderr
    res = run_cli("verify", out, "--repair", "--no-progress")
    assert "repaired: 1 partition(s)" in res.stdout, res.stdout + res.stderr
    status = store.GenerationStore.open(out).read_status()
    assert (status[8:12] == store.PENDING).all() and (np.delete(status, range(8, 12)) == store.DONE).all()
    rerun = run_cli("run", "--prompts", prompts, *sim_args(tmp_path, out, *SHAPE, log="rerun.log"))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_same_store(ref, out)
    _verify_passes(out)
    tally = count(logged_requests(tmp_path / "calls.log"), logged_requests(tmp_path / "rerun.log"))
    assert (tally.kept, tally.regenerated) == (N - 4, 4), tally  # the repaired partition alone is generated again
    record("torn chunk of finished rows (truncated), verify --repair, rerun", rows=N, tally=tally)
