"""A run whose workers are all gone stops with an error instead of waiting for ever (docs/reliability.md, case 20).

Real parts: ``daskgen run`` processes, a real LocalCluster (the run's own, or one started here and passed as
``--scheduler-address``), real stores.  The engine that closes its worker is a labelled test double.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from daskgen import store
from daskgen.engines.base import GenerationRequest, GenerationResult
from daskgen.engines.simulated import SimulatedEngine
from tests.conftest import on_scheduler, popen_cli, run_cli, runs_cluster, simulated_run, write_prompts
from tests.test_run import _wait_for_some_done

pytestmark = pytest.mark.timeout(180)

#: Engine checks every second instead of every 30 s, so that a stop comes within seconds.
QUICK_CHECKS = {"DASK_DASKGEN__ENGINE_CHECK_INTERVAL": "1s"}
#: A local cluster forgets a closed worker process this soon after it left (15 s by default): the check sees none.
FORGET_SOON = {"DASK_DISTRIBUTED__DEPLOY__LOST_WORKER_TIMEOUT": "0.1s"}


class ClosesItsWorker(SimulatedEngine):
    """Test double: the simulated engine, whose worker closes with its nanny at its sixth request (as a worker
    whose scheduler connection broke, or one retired by an operator, does): the worker process is gone for good."""

    def __init__(self, model: str = "simulated", **engine_args) -> None:
        super().__init__(model, **engine_args)
        self.requests = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests += 1
        if self.requests == 6:
            from distributed import get_worker

            asyncio.get_running_loop().create_task(get_worker().close(nanny=True, reason="test: closed for good"))
            await asyncio.sleep(3600)
        return await super().generate(request)


def _not_failed(path) -> store.GenerationStore:
    status = store.GenerationStore.open(path).read_status()
    assert not (status == store.FAILED).any(), "a worker that left fails no row"
    return status


@pytest.mark.parametrize("forgotten", [False, True], ids=["closed", "forgotten"])
def test_a_fixed_local_cluster_whose_workers_closed_stops_the_run_at_once(tmp_path, forgotten):
    """The worker process closes with its nanny; the next engine check finds the nanny closed, or (after
    ``distributed.deploy.lost-worker-timeout``) no longer in the cluster: the run stops (exit 2)."""
    prompts = write_prompts(tmp_path / "p.jsonl", 16)
    out = tmp_path / "out.zarr"
    run = [a.replace("simulated", "tests.test_workers_gone:ClosesItsWorker", 1) for a in simulated_run()]
    env = {**QUICK_CHECKS, **(FORGET_SOON if forgotten else {})}
    res = run_cli("run", "--prompts", prompts, "--store", out, *run, env=env, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "every worker of the run's cluster has closed and none will start again" in res.stderr, res.stderr[-2000:]
    assert "rerun the same command to resume" in res.stderr
    status = _not_failed(out)
    assert (status == store.DONE).sum() < 16


def _slow_run() -> list[str]:
    """A run of 20 partitions of ~0.3 s each (one request at a time)."""
    slow = simulated_run(partition_size=2, n_samples=1)
    slow[slow.index("time_scale=0")] = "time_scale=1"
    return [*slow, "--engine-arg", "max_batch=1"]


def test_a_run_whose_only_worker_left_an_external_scheduler_stops_after_the_engine_start_timeout(tmp_path):
    """The operator shrinks the cluster to no worker mid-run: the run waits ``daskgen.engine-start-timeout`` (here
    3 s) for another to join, then stops (exit 2) keeping what was committed."""
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    out = tmp_path / "out.zarr"
    with runs_cluster() as (cluster, client):
        env = {**QUICK_CHECKS, "DASK_DASKGEN__ENGINE_START_TIMEOUT": "3s"}
        proc = popen_cli(
            "run", "--prompts", prompts, "--store", out, *on_scheduler(_slow_run(), cluster.scheduler_address), env=env
        )
        try:
            done = _wait_for_some_done(out, proc, minimum=2)
            cluster.scale(0)
            output, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, output
    assert "no worker with an engine has been connected to the scheduler for" in output, output[-2000:]
    assert "no worker with an engine is connected to the scheduler: the run waits up to 3 s" in output
    status = _not_failed(out)
    assert done.sum() <= (status == store.DONE).sum() < 40, "what was committed before the worker left stays done"


def test_a_worker_whose_retirement_the_scheduler_refuses_takes_partitions_again(tmp_path):
    """The worker is drained before its retirement, but the scheduler refuses to retire it (it holds the only copy
    of a result): the worker takes partitions again and the run completes (a drained worker that stayed would leave
    the run waiting for ever)."""
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    out = tmp_path / "out.zarr"
    with runs_cluster() as (cluster, client):
        (worker,) = client.scheduler_info()["workers"]
        proc = popen_cli(
            "run", "--prompts", prompts, "--store", out, *on_scheduler(_slow_run(), cluster.scheduler_address)
        )
        try:
            _wait_for_some_done(out, proc, minimum=2)
            held = client.submit(int, 1, workers=[worker], pure=False)  # data no other worker has
            held.result()
            assert client.retire_workers([worker]) == {}, "the scheduler refuses to retire the worker"
            output, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert list(client.scheduler_info()["workers"]) == [worker]
    assert proc.returncode == 0, output
    assert (store.GenerationStore.open(out).read_status() == store.DONE).all()
