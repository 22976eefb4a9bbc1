"""The in-process vLLM engine loses its ``EngineCore`` process mid-run (the vllm CPU lane).

``daskgen run --engine vllm`` on a LocalCluster (through the labelled test double ``RecordingEngine``,
which logs every request it passes to the real vLLM engine): once some partitions are committed, the
test SIGKILLs vLLM's ``EngineCore`` process, where the model runs.  The worker notices (its requests
fail with vLLM's ``EngineDeadError``), restarts the engine (a new ``EngineCore``), Dask retries the
partition, and the run ends with every prompt done; rows committed before the kill are neither
generated again nor changed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from daskgen import store
from tests.conftest import popen_cli, write_prompts
from tests.test_run import _wait_for_some_done, calls

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

N = 24  # prompts: 6 partitions of 4, one at a time: the kill lands once two are committed, with four still to run
CORE_NAME = "VLLM::EngineCor"  # vLLM's EngineCore process title, as the kernel truncates it


def _engine_cores(root: int) -> list[psutil.Process]:
    """vLLM EngineCore processes below process ``root`` (the run's client)."""
    found = []
    for proc in psutil.Process(root).children(recursive=True):
        try:
            if proc.name().startswith(CORE_NAME):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def _wait_for_core(run: subprocess.Popen, exclude: set[int], timeout: float = 900) -> psutil.Process:
    """The run's vLLM EngineCore other than ``exclude``, once it appears (fails when the run ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.poll() is not None:
            raise AssertionError(f"the run ended (exit {run.returncode}) first:\n{run.stdout.read()[-6000:]}")
        fresh = [p for p in _engine_cores(run.pid) if p.pid not in exclude]
        if fresh:
            return fresh[0]
        time.sleep(0.5)
    raise AssertionError(f"no vLLM EngineCore (other than {sorted(exclude)}) appeared within {timeout} s")


def _done_rows(path: Path) -> dict[int, Any]:
    """Row -> stored response ids of every committed row."""
    opened = store.GenerationStore.open(path)
    status = opened.read_status()
    ids = opened.read_region(0, N, ("response_ids",))["response_ids"]
    return {int(r): ids[r].copy() for r in np.nonzero(status == store.DONE)[0]}


def test_engine_core_killed_mid_run_is_restarted_and_the_run_completes(tmp_path: Path) -> None:
    from tests.test_engine_vllm import tiny_model_path

    prompts = write_prompts(tmp_path / "p.jsonl", N)
    out, log = tmp_path / "out.zarr", tmp_path / "requests.log"
    run = popen_cli(
        "run",
        *("--prompts", prompts, "--model", tiny_model_path(), "--store", out),
        *("--engine", "daskgen.testing.engines:RecordingEngine", "--engine-arg", "inner=vllm"),
        *("--engine-arg", f"log_path={log}", "--engine-arg", "dtype=float32", "--engine-arg", "max_model_len=2048"),
        *("--n-samples", "2", "--max-new-tokens", "64", "--temperature", "1", "--seed", "3"),
        *("--partition-size", "4", "--window", "1", "--max-retries", "3", "--n-workers", "1", "--no-progress"),
    )
    try:
        _wait_for_some_done(out, run, minimum=8, timeout=900)
        before = _done_rows(out)
        first = _wait_for_core(run, set())  # the EngineCore serving now (not one seen earlier)
        first.kill()
        second = _wait_for_core(run, {first.pid})
        output, _ = run.communicate(timeout=1200)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(60)
    assert run.returncode == 0, output[-6000:]
    assert f"{N} done, 0 failed, 0 pending of {N} prompts" in output, output[-6000:]
    assert "engine died" in output or "EngineDeadError" in output or "broken" in output, output[-6000:]
    after = _done_rows(out)
    assert sorted(after) == list(range(N))
    for row, ids in before.items():
        np.testing.assert_array_equal(after[row], ids, err_msg=f"row {row} changed after the crash")
    sent = calls(log)  # how often each request id reached the engine
    assert all(sent[f"p{row}-s{s}"] == 1 for row in before for s in range(2)), (
        "a row committed before the kill ran again"
    )
    assert any(count > 1 for count in sent.values()), "no request was lost with the EngineCore (the kill hit nothing)"
    assert second.pid != first.pid
