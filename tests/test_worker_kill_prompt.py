"""A prompt that kills its worker process (docs/reliability.md, case 4; the driver's policy step 3).

Real parts: the ``daskgen run`` CLI in a subprocess on a real LocalCluster of two nanny-managed worker
processes, a real Zarr store on disk.  The labelled test double ``RecordingEngine`` (wrapping the real
``simulated`` engine) sends a real SIGKILL to its own worker process whenever it is asked for the killer
row (``kill_rows``), as an engine segfault or an OOM kill would end it; the nanny starts a new worker
process each time.  Dask's ``allowed-failures`` is 1 here (two deaths end a task ``KilledWorker``) to keep
the test short; the policy is the same for the default 3.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from daskgen.store.layout import DONE, FAILED
from tests.conftest import run_cli, write_prompts
from tests.fault_tally import count, logged_requests, record
from tests.test_reliability import assert_same_store, reference
from tests.test_run import sim_args

pytestmark = pytest.mark.timeout(240)

N, KILLER = 20, 9
ALLOWED_FAILURES = 1
DEATHS = ALLOWED_FAILURES + 1  # worker deaths that end one task KilledWorker
ENV = {"DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": str(ALLOWED_FAILURES)}


def _attempts(log: Path) -> dict[str, list[int]]:
    """Request id -> the pid of each process that started generating it (RecordingEngine's log)."""
    out: dict[str, list[int]] = {}
    for line in log.read_text().splitlines():
        request, pid = line.split()
        out.setdefault(request, []).append(int(pid))
    return out


def _run(tmp_path: Path, out: Path, common: list, *extra: str, log: str, kill: bool = True):
    killing = ["--engine-arg", f"kill_rows=[{KILLER}]"] if kill else []
    return run_cli("run", *sim_args(tmp_path, out, *common, log=log), *killing, *extra, env=ENV, timeout=150)


def test_a_prompt_that_kills_its_worker_fails_alone_and_retry_failed_regenerates_nothing_done(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", N)
    out = tmp_path / "out.zarr"
    common = ["--prompts", prompts, "--partition-size", "4", "--n-workers", "2", "--no-progress"]

    res = _run(tmp_path, out, common, log="calls.log")
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"{N - 1} done, 1 failed, 0 pending of {N}" in res.stdout and "--retry-failed" in res.stdout
    ds = xr.open_zarr(out)
    status = ds.status.values
    assert status[KILLER] == FAILED and (np.delete(status, KILLER) == DONE).all(), status
    error = str(ds.error.values[KILLER])
    assert f"the worker process died while generating this row ({DEATHS} times" in error, error
    assert (np.delete(ds.response_length.values, KILLER, axis=0) > 0).all(), "every other row was generated"
    # the worker really died: the killer's partition task died DEATHS times, then its one-row task as often,
    # each time in a new worker process (a SIGKILLed process never asks for anything again)
    first = _attempts(tmp_path / "calls.log")
    killer = f"p{KILLER}-s0"
    assert len(first[killer]) == 2 * DEATHS and len(set(first[killer])) == 2 * DEATHS, first[killer]
    assert set(first) == {f"p{r}-s0" for r in range(N)}
    regenerated = sum(1 for request, pids in first.items() if request != killer and len(pids) > 1)
    kept = {name: ds[name].values.copy() for name in ("response_ids", "response_length", "committed_at")}

    # --retry-failed while the row still kills its worker: the same end (its one-row partition task dies, then
    # its alone task), and no done row generated again
    again = _run(tmp_path, out, common, "--retry-failed", log="retry.log")
    assert again.returncode == 1, again.stdout + again.stderr
    assert f"{N - 1} done, 1 failed, 0 pending of {N}" in again.stdout
    assert Counter(r for r, pids in _attempts(tmp_path / "retry.log").items() for _ in pids) == {killer: 2 * DEATHS}
    ds = xr.open_zarr(out)
    for name, values in kept.items():
        np.testing.assert_array_equal(np.delete(ds[name].values, KILLER, axis=0), np.delete(values, KILLER, axis=0))

    # the fault gone (a fixed engine): --retry-failed generates that row only and the store equals a clean run's
    fixed = _run(tmp_path, out, common, "--retry-failed", log="fixed.log", kill=False)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert f"{N} done, 0 failed" in fixed.stdout
    assert list(_attempts(tmp_path / "fixed.log")) == [killer]
    assert_same_store(out, reference(tmp_path, common))
    # the fault is there the whole run: every request is "before"; the killer row ends failed, neither kept
    # nor regenerated
    tally = count(r for r in logged_requests(tmp_path / "calls.log") if r != killer)
    assert tally.regenerated == regenerated and tally.kept + tally.regenerated == N - 1, tally
    record("a prompt that kills the worker process", rows=N, tally=tally)
